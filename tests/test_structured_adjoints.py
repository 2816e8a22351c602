"""Adjoints that keep structure (`tiledsl.index_maps`): the gradient of a gather at an index map
of positions (a concat's pieces, a flip, a pad, a roll) is the incoming gradient read back at the
inverse map, and the gradient of a gather of labels along a row is a one-hot term in the row
program: never a scatter into a zero-filled buffer. Numerics by the oracle (float64 torch
autograd of the reference) on awkward sizes; kernel counts; no `indexed` (scatter) kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiledsl
from helpers import gen, randn
from tiledsl import testing
from tiledsl.backends import reference
from tiledsl.binding import BoundCall, bind

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def grads_ok(fn, *args, seed=0):
    report = testing.check_grads(fn, *args, generator=gen(seed))
    assert report.ok, f"{fn.name}: {report}"


def grads_of_some_ok(fn, args, wrt, seed=0):
    """The oracle for the gradients of arguments `wrt` only, through the backward torch's
    autograd asks for when the others need none."""
    bound = bind(fn.source_graph, args, {})
    g = gen(seed)
    cots = None

    def pull(run, dtype=None):
        nonlocal cots
        xs = [a.detach().to(dtype or a.dtype).clone().requires_grad_(i in wrt) if a.is_floating_point()
              else a for i, a in enumerate(args)]
        outs = run(xs)
        outs = list(outs) if isinstance(outs, list | tuple) else [outs]
        cots = cots or [torch.randn(o.shape, generator=g) for o in outs]
        return torch.autograd.grad(outs, [xs[i] for i in wrt], [c.to(o.dtype) for c, o in zip(cots, outs, strict=True)])

    compiled = pull(lambda xs: fn(*xs))
    golden = pull(lambda xs: reference.run(fn.source_graph, BoundCall(xs, bound.dims, bound.device),
                                           float64=True), torch.float64)
    eager = pull(lambda xs: reference.run(fn.source_graph, BoundCall(xs, bound.dims, bound.device)))
    report = testing.compare(tuple(compiled), tuple(golden), tuple(eager))
    assert report.ok, f"{fn.name}: {report}"


def templates(program):
    return [k.template for k in program.kernels]


@pytest.mark.parametrize("dt", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("b,h,kh,s,d", [(2, 4, 2, 5, 8), (1, 3, 1, 17, 7), (1, 1, 1, 1, 2)])
def test_rope_backward_is_one_kernel_reading_the_gradient_at_the_rotated_half(dt, b, h, kh, s, d):
    """LLaMA's rotate_half: each half's gradient is the incoming one read at the other half
    (Liger's backward: the forward with sin negated), q and k in one launch; an odd head dim
    too (halves of D - D // 2 and D // 2)."""
    src = (EXAMPLES / "rope.tdsl").read_text().replace("f32", dt)
    fn = tiledsl.compile(src)
    q, k = randn(b, h, s, d, dtype=DTYPES[dt]), randn(b, kh, s, d, dtype=DTYPES[dt], seed=1)
    c, sn = randn(s, d, dtype=DTYPES[dt], seed=2), randn(s, d, dtype=DTYPES[dt], seed=3)
    assert templates(fn.training((0, 1)).backward) == ["merged"]
    grads_of_some_ok(fn, [q, k, c, sn], (0, 1))
    # with the tables' gradients too: their sums over the batch and heads are row programs
    assert "indexed" not in templates(fn.backward)
    grads_ok(fn, q, k, c, sn)


INDEX_MAPS = {
    "flip": "kernel f(x: {t}[N, D]) -> {t}[N, D] {{ return flip(x, axis=-1) * 2.0 + x }}",
    "pad": "kernel f(x: {t}[N, D]) -> {t}[N, D + 3] {{ return pad(sin(x), (2, 1), axis=-1, value=0.5) }}",
    "concat3": ("kernel f(x: {t}[N, D], y: {t}[N, 3]) -> {t}[N, 2 * D + 3] "
                "{{ return concat(x * 2.0, y, flip(x, axis=-1), axis=-1) }}"),
    "rows": "kernel f(x: {t}[N, D]) -> {t}[N + 1, D] {{ return concat(x[N - 1:, :], -x, axis=0) }}",
    # gather at i - 1: position 0 reads the last element (a negative index wraps)
    "roll": "kernel f(x: {t}[N, D]) -> {t}[N, D] {{ return gather(x, index(x, -1) - 1, axis=-1) * 3.0 }}",
    # gather at D - 2 - i: position D - 1 reads x[-1]
    "flip-wrap": "kernel f(x: {t}[N, D]) -> {t}[N, D] {{ return gather(x, D - 2 - index(x, -1), axis=-1) }}",
    "constant": "kernel f(x: {t}[N, D]) -> {t}[N, D] {{ return x * x[:, D - 1:] }}",
}


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("n,d", [(1, 1), (17, 5), (3, 16)])
@pytest.mark.parametrize("name", INDEX_MAPS)
def test_gradients_of_index_maps_read_back_never_scatter(name, n, d, dt):
    fn = tiledsl.compile(INDEX_MAPS[name].format(t=dt))
    args = [randn(n, d, dtype=DTYPES[dt])]
    if name == "concat3":
        args.append(randn(n, 3, dtype=DTYPES[dt], seed=1))
    grads_ok(fn, *args)
    assert "indexed" not in templates(fn.backward), fn.backward.explain()


CE = """kernel ce(logits: {t}[N, C], labels: i64[N]) -> f32 {{
    x = cast(logits, f32)
    ignored = labels == -100
    nll = logsumexp(x, axis=-1) - gather(x, where(ignored, 0, labels), axis=-1)
    return sum(where(ignored, 0.0, nll), axis=0) / sum(where(ignored, 0.0, 1.0), axis=0)
}}"""


@pytest.mark.parametrize("dt", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("n,c", [(1, 1), (17, 33), (5, 300)])
def test_cross_entropy_gradient_is_a_one_hot_term_in_the_row_program(dt, n, c):
    """gather(x, label)'s gradient is `index == label` in the row program that computes the
    softmax term: one row kernel over the logits (and the count of rows not ignored, a sum
    over the rows), ignored rows and -inf logits (a padded vocabulary) included."""
    fn = tiledsl.compile(CE.format(t=dt))
    logits = randn(n, c, dtype=DTYPES[dt])
    labels = torch.randint(0, c, (n,), generator=gen(3))
    if n > 1:
        labels[1] = -100
        logits[0, c // 2:] = float("-inf")
        labels[0] = min(labels[0].item(), c // 2 - 1) if c > 1 else 0
    grads_ok(fn, logits, labels)
    assert templates(fn.backward).count("rows") == len(fn.backward.kernels) <= 2, fn.backward.explain()


def test_a_label_counting_from_the_end_gets_its_gradient():
    """A negative label reads the class counted from the end (gather's semantics), and its
    gradient goes there; one out of range reads 0 and gets none."""
    fn = tiledsl.compile("kernel f(x: f32[N, C], y: i64[N]) -> f32[N] { return gather(x, y, axis=-1) * 2.0 }")
    grads_ok(fn, randn(4, 7), torch.tensor([-1, 3, -7, 9]))
    assert "indexed" not in templates(fn.backward)


def test_a_gather_by_loaded_indices_along_a_free_axis_still_scatters():
    """Two rows reading one row of x (an embedding lookup) need their gradients summed: a
    scatter-add, not an index map."""
    fn = tiledsl.compile("kernel f(w: f32[V, D], ids: i64[N]) -> f32[N, D] { return w[ids] * 2.0 }")
    grads_ok(fn, randn(11, 5), torch.tensor([3, 3, 0, 10, 3]))
    assert "indexed" in templates(fn.backward)


def test_the_forwards_row_statistics_are_saved_for_the_backward():
    """A row's logsumexp and the count of rows not ignored, which the forward computes anyway,
    are saved (4 bytes a row, and one number), so the backward is one row program reading
    the logits once: no logsumexp of its own (a second pass over 128k logits a row at a
    LLaMA-3 vocabulary), no sum over the rows."""
    fn = tiledsl.compile(CE.format(t="bf16"))
    training = fn.training((0,))
    saved = [n for n in training.backward.ir("graph").splitlines()[0].split("%")[1:] if n.startswith("saved")]
    assert saved == ["saved_0: f32, ", "saved_1: f32[N], "]
    assert [k.template for k in training.backward.kernels] == ["rows"]
    assert not any(op.kind in ("logsumexp", "sum") for k in training.backward.kernels for op in k.ops)
    logits, labels = randn(17, 300, dtype=torch.bfloat16), torch.randint(0, 300, (17,), generator=gen(4))
    grads_ok(fn, logits, labels)


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("n", [1, 17])
def test_sides_of_a_selected_gather_with_a_gap_between_their_ranges(n, dt):
    """Columns 5 and 6 of x, then 0 and 1, concatenated: one gather at a selected index whose
    sides read [5, 7) and [0, 2) of x, provably apart, so both read g at one position; the
    columns between are read by neither (their gradient 0, though the shared position lands
    in the second side's range there)."""
    fn = tiledsl.compile(f"kernel f(x: {dt}[N, 7]) -> {dt}[N, 4] {{ return concat(-x[:, 5:], x[:, :2], axis=-1) }}")
    grads_ok(fn, randn(n, 7, dtype=DTYPES[dt]))
    assert templates(fn.backward) == ["pointwise"]
    assert sum(op.kind == "take" for k in fn.backward.kernels for op in k.ops) == 1
