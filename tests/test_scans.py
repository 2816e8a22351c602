"""Scans (cumsum, cumprod, cummax, cummin, logcumsumexp, linear_scan, reverse=) and flip:
against torch in float64 along different axes at awkward sizes, their gradients, kernel
counts, sm_90 builds without spills, and the selective scan example."""

from pathlib import Path

import pytest
import torch

import tiledsl
from helpers import SIZES, gen, randn, run_checked
from tiledsl import testing
from tiledsl.backends.triton import aot
from tiledsl.passes.fusion.remarks import FusionRemark

DTYPES = {"f32": torch.float32, "f16": torch.float16}
EXAMPLES = Path(__file__).parent.parent / "examples"
UNARY = ["cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"]


def scan_input(op, shape, dtype=torch.float32, seed=0):
    x = randn(*shape, seed=seed)
    if op == "cumprod":  # factors near 1, so long products stay in range
        x = 1.0 + 0.05 * x
    return x.to(dtype)


@pytest.mark.parametrize("reverse", ["false", "true"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", UNARY)
def test_scan_matches_torch(op, n, axis, reverse):
    x = scan_input(op, (5, n) if axis == 1 else (n, 5), seed=n)
    fn, out = run_checked(f"kernel f(x: f32[M, N]) -> f32[M, N] {{ return {op}(x, axis={axis}, "
                          f"reverse={reverse}) }}", x)
    flip = reverse == "true"
    xt = (x.flip(axis) if flip else x).double()
    want = {"cumsum": torch.cumsum, "cumprod": torch.cumprod, "logcumsumexp": torch.logcumsumexp,
            "cummax": lambda v, d: torch.cummax(v, d).values,
            "cummin": lambda v, d: torch.cummin(v, d).values}[op](xt, axis)
    torch.testing.assert_close(out.double(), want.flip(axis) if flip else want, rtol=1e-5, atol=1e-5)
    assert [k.template for k in fn.kernels] == ["rows"]


@pytest.mark.parametrize("op", UNARY)
def test_f16_scans_compute_in_f32(op):
    run_checked(f"kernel f(x: f16[M, N]) -> f16[M, N] {{ return {op}(x, axis=-1) }}",
                scan_input(op, (17, 113), torch.float16))


@pytest.mark.parametrize("reverse", ["false", "true"])
@pytest.mark.parametrize("op", UNARY + ["linear_scan"])
def test_rows_longer_than_a_block_carry_the_chunks_before(op, reverse):
    """4099 > the interpreter's 4096-element row block: two chunks, the second continuing
    (or, reversed, the first continuing) the first's partials."""
    x = scan_input(op, (3, 4099), seed=7)
    if op == "linear_scan":
        src = (f"kernel f(a: f32[M, N], b: f32[M, N]) -> f32[M, N] {{ return linear_scan(sigmoid(a), "
               f"b, axis=1, reverse={reverse}) }}")
        run_checked(src, x, randn(3, 4099, seed=8), sm90=False)
    else:
        run_checked(f"kernel f(x: f32[M, N]) -> f32[M, N] {{ return {op}(x * 2.0, axis=1, "
                    f"reverse={reverse}) }}", x, sm90=False)


def test_integer_scans_are_exact():
    x = torch.randint(-3, 4, (7, 113), dtype=torch.int32)
    fn, (p, hi, lo) = run_checked("""kernel f(x: i32[M, N]) -> (i32[M, N], i32[M, N], i32[M, N]) {
        return cumprod(x, axis=0), cummax(x, axis=1, reverse=true), cummin(x)
    }""", x)
    assert torch.equal(p, torch.cumprod(x, 0).int())
    assert torch.equal(hi, torch.cummax(x.flip(1), 1).values.flip(1))
    assert torch.equal(lo, torch.cummin(x, 1).values)


def test_cummax_propagates_nan_as_torch():
    x = randn(4, 17)
    x[1, 5] = float("nan")
    _, out = run_checked("kernel f(x: f32[M, N]) -> f32[M, N] { return cummax(x) }", x)
    assert out[1, 5:].isnan().all() and not out[1, :5].isnan().any()


def linear_scan_loop(a, b, axis):
    """h[t] = a[t] * h[t - 1] + b[t] in float64, the loop a model writes."""
    a, b = a.double().movedim(axis, 0), b.double().movedim(axis, 0)
    h, out = torch.zeros_like(b[0]), []
    for t in range(b.shape[0]):
        h = a[t] * h + b[t]
        out.append(h)
    return torch.stack(out).movedim(0, axis)


@pytest.mark.parametrize("m, n", [(1, 1), (17, 33), (5, 1000)])
@pytest.mark.parametrize("op", ["cummax", "cummin"])
def test_cummax_and_cummin_give_torchs_pair(op, m, n):
    """`values, indices = cummax(x, axis)`: the latest position of the running extremum (ties
    take the later one; after a NaN, the latest NaN's), as torch's, along either axis."""
    src = f"""kernel f(x: f32[M, N]) -> (f32[M, N], i64[M, N], f32[M, N], i64[M, N]) {{
        a, i = {op}(x, -1)
        b, j = {op}(x, 0)
        return a, i, b, j
    }}"""
    x = torch.randint(-3, 4, (m, n), generator=gen(5)).float()  # many ties
    x[0, n // 2] = float("nan")
    x[m - 1, n - 1] = float("nan")
    _, (a, i, b, j) = run_checked(src, x)
    rows, cols = getattr(torch, op)(x, -1), getattr(torch, op)(x, 0)
    assert torch.equal(i, rows.indices) and torch.equal(j, cols.indices)
    assert torch.allclose(a, rows.values, equal_nan=True) and torch.allclose(b, cols.values, equal_nan=True)


@pytest.mark.parametrize("reverse", [False, True])
def test_a_cumulative_extremum_and_its_positions_are_one_row_kernel(reverse):
    """The positions are a second scan in the same row program (a running max of the
    positions where x is the running max); reversed, the nearest such position after."""
    flag = "true" if reverse else "false"
    fn = tiledsl.compile(f"""kernel f(x: i32[M, N]) -> (i32[M, N], i64[M, N]) {{
        values, indices = cummax(x, reverse={flag})
        return values, indices
    }}""")
    assert [k.template for k in fn.kernels] == ["rows"]
    x = torch.randint(-5, 5, (17, 300), generator=gen(6), dtype=torch.int32)
    _, (values, indices) = run_checked(fn, x)
    want = torch.cummax(x.flip(-1), -1) if reverse else torch.cummax(x, -1)
    if reverse:
        want = (want.values.flip(-1), 299 - want.indices.flip(-1))
    assert torch.equal(values, want[0]) and torch.equal(indices, want[1])


@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("n", SIZES)
def test_linear_scan_is_the_recurrence(n, axis):
    shape = [3, 4, 5]
    shape[axis] = n
    a, b = torch.sigmoid(randn(*shape, seed=1)), randn(*shape, seed=2)
    fn, out = run_checked(f"""kernel f(a: f32[P, Q, R], b: f32[P, Q, R]) -> f32[P, Q, R] {{
        return linear_scan(a, b, axis={axis})
    }}""", a, b)
    torch.testing.assert_close(out.double(), linear_scan_loop(a, b, axis), rtol=1e-5, atol=1e-5)
    fn, out = run_checked(f"""kernel f(a: f32[P, Q, R], b: f32[P, Q, R]) -> f32[P, Q, R] {{
        return linear_scan(a, b, axis={axis}, reverse=true)
    }}""", a, b)
    torch.testing.assert_close(out.double(), linear_scan_loop(a.flip(axis), b.flip(axis), axis).flip(axis),
                               rtol=1e-5, atol=1e-5)


def test_linear_scan_needs_operands_of_one_shape():
    with pytest.raises(tiledsl.TileDSLError) as err:
        tiledsl.compile("kernel f(a: f32[M, N], b: f32[N]) -> f32[M, N] { return linear_scan(a, b, axis=0) }")
    assert "'linear_scan' needs a and b of one shape, got [M, N] and [N]; expand(a, [...]) broadcasts one" \
        in str(err.value)


@pytest.mark.parametrize("reverse", ["false", "true"])
@pytest.mark.parametrize("op", UNARY)
def test_scan_gradients(op, reverse):
    x = scan_input(op, (17, 13), seed=3)
    if op == "cumprod":  # zeros: one in a row, two in another (no division by x)
        x[3, 4] = x[5, 2] = x[5, 7] = 0.0
    if op in ("cummax", "cummin"):
        x = x.round()  # ties: the gradient goes to the latest, as torch's
    for axis in (0, 1):
        fn = tiledsl.compile(f"kernel f(x: f32[M, N]) -> f32[M, N] {{ return {op}(x, axis={axis}, "
                             f"reverse={reverse}) }}")
        report = testing.check_grads(fn, x, generator=gen(0))
        assert report.ok, report


@pytest.mark.parametrize("reverse", ["false", "true"])
def test_linear_scan_gradients(reverse):
    a, b = torch.sigmoid(randn(17, 13, seed=4)), randn(17, 13, seed=5)
    fn = tiledsl.compile(f"""kernel f(a: f32[M, N], b: f32[M, N]) -> f32[M, N] {{
        return linear_scan(a, b * 2.0, axis=0, reverse={reverse})
    }}""")
    report = testing.check_grads(fn, a, b, generator=gen(0))
    assert report.ok, report


def special_scan_inputs(special, n, axis, reverse, seed):
    """a in (0, 1) with `special` at the first element the scan reads in row 0 (its a[0],
    which the recurrence multiplies by h[-1] = 0), and a NaN midway along row 1 (an inf there
    is ±inf in the loop, but the associative scan regroups inf * (u + v) as inf * u + inf * v,
    NaN where u and v differ in sign: docs/language.md says so)."""
    shape = (3, n) if axis == 1 else (n, 3)
    a, b = torch.sigmoid(randn(*shape, seed=seed)), randn(*shape, seed=seed + 1)
    first = n - 1 if reverse else 0
    at = (lambda row, t: (row, t)) if axis == 1 else (lambda row, t: (t, row))
    a[at(0, first)] = special
    a[at(1, n // 2)] = float("nan")
    return a, b


def loop_of(a, b, axis, reverse):
    """h[t] = a[t] * h[t - 1] + b[t] from h[-1] = 0, in a's dtype (from the end when reverse)."""
    if reverse:
        return loop_of(a.flip(axis), b.flip(axis), axis, False).flip(axis)
    a, b = a.movedim(axis, 0), b.movedim(axis, 0)
    h, out = torch.zeros_like(b[0]), []
    for t in range(b.shape[0]):
        h = a[t] * h + b[t]
        out.append(h)
    return torch.stack(out).movedim(0, axis)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("axis, n", [(1, 1), (1, 17), (0, 113), (1, 4099)])
@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf")])
def test_linear_scan_multiplies_a_first_by_h_before_it_which_is_0(special, axis, n, reverse):
    """h[0] = a[0] * 0 + b[0]: NaN where a[0] is NaN or inf (the kernel started from b[0]);
    a special value later in a row follows the recurrence too. One chunk, two chunks (4099)
    and a size-1 axis, either way."""
    a, b = special_scan_inputs(special, n, axis, reverse, seed=n)
    src = (f"kernel f(a: f32[M, N], b: f32[M, N]) -> f32[M, N] {{ return linear_scan(a, b, axis={axis}, "
           f"reverse={str(reverse).lower()}) }}")
    out = tiledsl.compile(src)(a, b)
    golden, eager = loop_of(a.double(), b.double(), axis, reverse), loop_of(a, b, axis, reverse)
    assert torch.equal(out.isnan(), golden.isnan())
    report = testing.compare(out, golden, eager)
    assert report.ok, report
    row0 = out[0] if axis == 1 else out[:, 0]
    assert row0.isnan().all()
    assert torch.equal(tiledsl.compile(src, backend="reference")(a, b).isnan(), golden.isnan())


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("special", [float("nan"), float("inf")])
def test_linear_scan_gradients_with_a_special_first_element_are_torchs(special, reverse):
    """torch autograd of the loop in float64: da[0] = dh[0] * h[-1] = 0, da[t] = dh[t] *
    h[t-1] NaN after a NaN state, db = dh."""
    a, b = special_scan_inputs(special, 17, 0, reverse, seed=9)
    g = randn(17, 3, seed=11)
    fn = tiledsl.compile(f"""kernel f(a: f32[M, N], b: f32[M, N]) -> f32[M, N] {{
        return linear_scan(a, b, axis=0, reverse={str(reverse).lower()})
    }}""")

    def grads(f, dtype):
        x, y = a.to(dtype).requires_grad_(True), b.to(dtype).requires_grad_(True)
        return torch.autograd.grad(f(x, y), (x, y), g.to(dtype))

    got = grads(fn, torch.float32)
    golden = grads(lambda x, y: loop_of(x, y, 0, reverse), torch.float64)
    eager = grads(lambda x, y: loop_of(x, y, 0, reverse), torch.float32)
    for out, gold in zip(got, golden, strict=True):
        assert torch.equal(out.isnan(), gold.isnan())
    report = testing.compare(got, golden, eager)
    assert report.ok, report


@pytest.mark.parametrize("reverse", ["false", "true"])
def test_logcumsumexp_gradient_past_exp_overflow(reverse):
    """Its adjoint is a linear scan whose first factor, exp(y) at the row's last element,
    overflows past y = 88; the recurrence multiplies it by h[-1] = 0, so it is 0 there."""
    x = randn(5, 17, seed=12) + 95.0
    fn = tiledsl.compile(f"kernel f(x: f32[M, N]) -> f32[M, N] {{ return logcumsumexp(x, axis=1, "
                         f"reverse={reverse}) }}")
    report = testing.check_grads(fn, x, generator=gen(0))
    assert report.ok, report


def test_scan_fuses_with_its_producers_and_consumers():
    x, w = randn(17, 113), randn(113)
    fn, _ = run_checked("""kernel f(x: f32[M, N], w: f32[N]) -> (f32[M, N], f32[M]) {
        c = logcumsumexp(x * w, axis=1) - 1.0
        return sigmoid(c), sum(cumprod(1.0 + 0.01 * c, axis=1), axis=1)
    }""", x, w)
    assert [k.template for k in fn.kernels] == ["rows"]


def test_scans_both_ways_along_a_row_are_two_kernels():
    fn, _ = run_checked("kernel f(x: f32[M, N]) -> f32[M, N] { return cumsum(x) + cummax(x, reverse=true) }",
                        randn(5, 113))
    assert len(fn.kernels) == 2
    assert "[fuse-rows] refused: cummax (line 1) -> add (line 1): scans run both ways along the row " \
        "[rule: tile]" in [str(r) for r in fn.remarks]


@pytest.mark.parametrize("n", SIZES)
def test_flip_reads_in_place(n):
    x = randn(n, 7)
    for axis in (0, 1):
        fn, out = run_checked(f"kernel f(x: f32[M, N]) -> f32[M, N] {{ return flip(exp(x), axis={axis}) * 2.0 }}", x)
        torch.testing.assert_close(out, torch.flip(torch.exp(x), [axis]) * 2.0)
        assert [k.template for k in fn.kernels] == ["pointwise"]


@pytest.mark.parametrize("axis", [0, 1])
def test_flip_of_a_parameter_has_a_gradient(axis):
    """flip reads x through a gather at an index map of positions, so its gradient is g read
    back at the inverse map (g flipped): one pointwise kernel, no scatter."""
    fn = tiledsl.compile(f"kernel f(x: f32[M, N]) -> f32[M, N] {{ return flip(x, axis={axis}) * 3.0 }}")
    report = testing.check_grads(fn, randn(17, 113), generator=gen(0))
    assert report.ok, str(report)
    assert [k.template for k in fn.backward.kernels] == ["pointwise"]


@pytest.mark.parametrize("op, dt, n, one_pass", [
    ("cumsum", "f32", 16384, True), ("cumsum", "f32", 40000, False), ("cumprod", "f16", 32768, True),
    ("cummax", "f32", 40000, False), ("logcumsumexp", "f32", 8192, True), ("logcumsumexp", "f32", 16384, False),
    ("logcumsumexp", "f16", 32768, False), ("linear_scan", "f32", 16384, True),
    ("linear_scan", "f16", 32768, False), ("linear_scan", "f32", 128, True),
])
def test_scans_build_for_sm90_without_spills(op, dt, n, one_pass):
    if op == "linear_scan":
        src = f"kernel f(a: {dt}[M, N], x: {dt}[M, N]) -> {dt}[M, N] {{ return linear_scan(sigmoid(a), x) }}"
    else:
        src = f"kernel f(x: {dt}[M, N]) -> {dt}[M, N] {{ return {op}(x * 0.5, axis=-1) }}"
    (r,) = aot.inspect_program(tiledsl.compile(src), {"M": 4096, "N": n})
    assert r.config["ONE_PASS"] is one_pass and r.spill_bytes == 0, r


def selective_scan_loop(x, delta, A, Bm, C):
    """Mamba-1's selective_scan_ref (no D, no z) in float64: the state [B, D, N] stepped over L."""
    x, delta, A, Bm, C = (t.double() for t in (x, delta, A, Bm, C))
    h = torch.zeros(x.shape[0], x.shape[2], A.shape[1], dtype=torch.float64)
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(delta[:, t, :, None] * A) * h + delta[:, t, :, None] * Bm[:, t, None, :] * x[:, t, :, None]
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, dim=1)


SELECTIVE_SCAN_N = """
kernel selective_scan(x: f32[B, L, D], delta: f32[B, L, D], A: f32[D, N], Bm: f32[B, L, N],
                      C: f32[B, L, N]) -> f32[B, L, D] {
    dA = exp(delta[..., None] * A)
    h = linear_scan(dA, delta[..., None] * Bm[:, :, None, :] * x[..., None], axis=1)
    return sum(C[:, :, None, :] * h, axis=-1)
}
"""


def selective_scan_inputs(b, l, d, n):
    x, delta = randn(b, l, d, seed=1), torch.nn.functional.softplus(randn(b, l, d, seed=2))
    return x, delta, -torch.exp(randn(d, n, seed=3)), randn(b, l, n, seed=4), randn(b, l, n, seed=5)


@pytest.mark.parametrize("b, l, d", [(1, 1, 1), (2, 17, 5), (1, 113, 3)], ids=str)
def test_selective_scan_example(b, l, d):
    """The state dim a literal 16: a program owns a channel's 16 states and sums them as it
    scans, one kernel."""
    fn = tiledsl.compile((EXAMPLES / "selective_scan.tdsl").read_text())
    args = selective_scan_inputs(b, l, d, 16)
    _, y = run_checked(fn, *args)
    torch.testing.assert_close(y.double(), selective_scan_loop(*args), rtol=1e-4, atol=1e-4)
    assert [k.template for k in fn.kernels] == ["rows"]
    assert not [r for r in fn.remarks if isinstance(r, FusionRemark) and not r.fused]
    assert "across = 3, across_reducing = (%r6)" in fn.ir("fuse-rows")


def test_selective_scan_gradients():
    """Its backward: 3 kernels, the sums over the state in them across their rows too."""
    fn = tiledsl.compile((EXAMPLES / "selective_scan.tdsl").read_text())
    report = testing.check_grads(fn, *selective_scan_inputs(2, 17, 3, 16), generator=gen(0))
    assert report.ok, report
    backward = fn.backward
    assert len(backward.kernels) == 3
    assert "across = 3" in backward.ir("fuse-rows")


@pytest.mark.parametrize("l, one_pass", [(100, True), (2048, False)])
def test_selective_scan_builds_for_sm90_without_spills(l, one_pass):
    """At Mamba-130m's sizes (D = 1536): a program holds 16 rows (one channel's states) of
    128 positions, the half tile a reduction across rows leaves (16 x 256 spilled 120 bytes)."""
    fn = tiledsl.compile((EXAMPLES / "selective_scan.tdsl").read_text())
    (r,) = aot.inspect_program(fn, {"B": 4, "L": l, "D": 1536})
    assert (r.config["BLOCK_O"], r.config["BLOCK_R"]) == (16, 128) and r.config["ONE_PASS"] is one_pass, r
    assert r.spill_bytes == 0, r


@pytest.mark.parametrize("b, l, d, n", [(1, 1, 1, 1), (2, 17, 5, 16), (1, 113, 3, 4)], ids=str)
def test_selective_scan_of_a_state_dim_the_call_decides(b, l, d, n):
    """N a symbol: it may be a batch of thousands, which one program would not walk. The sum
    over it reduces the scanned states, which vary along L, the row: split, each chunk of N
    leaves a partial row of L per (b, d), which the combine merges (where the (b, d) groups
    fill the GPU, one chunk: the partials are the size of the result). One kernel, two
    launches; it was a second kernel reading the [B, L, D, N] states back."""
    fn = tiledsl.compile(SELECTIVE_SCAN_N)
    args = selective_scan_inputs(b, l, d, n)
    _, y = run_checked(fn, *args)
    torch.testing.assert_close(y.double(), selective_scan_loop(*args), rtol=1e-4, atol=1e-4)
    assert [k.template for k in fn.kernels] == ["rows"], fn.explain()
    assert not [r for r in fn.remarks if isinstance(r, FusionRemark) and not r.fused]
    assert "split, tail = (%r" in fn.ir("fuse-rows")


def test_selective_scan_of_a_call_sized_state_dim_builds_for_sm90_without_spills():
    """At Mamba-130m's sizes (D = 1536, N = 16 given by the call): 6144 (b, d) groups, so one
    chunk each; both launches spill nothing."""
    fn = tiledsl.compile(SELECTIVE_SCAN_N)
    dims = {"B": 4, "L": 2048, "D": 1536, "N": 16}
    launched = aot.meta_launches(fn, dims, {})
    reports = aot.inspect_program(fn, dims, {})
    assert [launch.kernel.fn_name for launch in launched] == ["k0_rows", "k0_combine"]
    assert launched[0].kernel.launch_config(dims, "cuda").grid == (4 * 1536,)
    assert all(r.spill_bytes == 0 for r in reports), reports


MAMBA_TINY = """kernel selective_scan(u: f32[B, L, D], dt: f32[B, L, D], A: f32[D, N], Bm: f32[B, L, N],
                      Cm: f32[B, L, N], Dp: f32[D]) -> f32[B, L, D] {
    dA = maximum(dt[..., None] * A, -20.0)
    dB_u = (dt * u)[..., None] * Bm[:, :, None, :]
    dA_cumsum = exp(sum(dA, axis=1, keepdims=true) - cumsum(dA, axis=1))
    x = cumsum(dB_u * dA_cumsum, axis=1) / (dA_cumsum + 1e-12)
    y = sum(x * Cm[:, :, None, :], axis=-1)
    return y + u * Dp
}"""


@pytest.mark.parametrize("b, l, d, n", [(1, 1, 1, 1), (2, 33, 24, 16), (1, 113, 5, 17), (2, 7, 3, 300)])
def test_the_skip_term_after_a_split_sum_over_the_state_is_in_its_combine(b, l, d, n):
    """mamba-tiny's selective scan (two cumulative sums, Heinsen's trick) with its skip term
    `y + u * Dp`: the combine reads u and Dp at its own (b, l, d) positions (u * Dp's [B, L, D]
    maps onto the [B, L, D, N] space without N): one kernel."""
    fn = tiledsl.compile(MAMBA_TINY)
    assert [k.template for k in fn.kernels] == ["rows"], fn.explain()
    g = gen(l * n)
    u, bm, cm = (torch.randn(*shape, generator=g) for shape in ((b, l, d), (b, l, n), (b, l, n)))
    dt = torch.nn.functional.softplus(torch.randn(b, l, d, generator=g) - 2.0)
    a, dp = -torch.exp(torch.rand(d, n, generator=g)), torch.randn(d, generator=g)
    u64, dt64, a64, b64, c64, dp64 = (t.double() for t in (u, dt, a, bm, cm, dp))
    da = torch.clamp(dt64[..., None] * a64, min=-20.0)
    da_cumsum = torch.exp(da.sum(1, keepdim=True) - torch.cumsum(da, 1))
    x = torch.cumsum((dt64 * u64)[..., None] * b64[:, :, None, :] * da_cumsum, 1) / (da_cumsum + 1e-12)
    want = (x * c64[:, :, None, :]).sum(-1) + u64 * dp64
    _, out = run_checked(fn, u, dt, a, bm, cm, dp)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    assert torch.equal(fn(u, dt, a, bm, cm, dp), out)


def test_the_fuzzer_generates_every_scan_and_flip():
    import random

    import fuzzgen

    sources = " ".join(fuzzgen.generate(random.Random(f"cover:{i}")).source for i in range(2000))
    for name in UNARY + ["linear_scan(", "reverse=true", "flip("]:
        assert name in sources, name


@pytest.mark.parametrize("op", UNARY)
def test_a_scan_along_a_size_1_axis_is_its_operand(op):
    """(found by the fuzzer: the row program asked for the source of a scan it never runs)"""
    z = scan_input(op, (17, 1))
    _, out = run_checked(f"kernel f(z: f32[M, 1]) -> f32[M, 1] {{ return {op}(z, axis=1) * 2.0 }}", z)
    torch.testing.assert_close(out, z * 2.0)
    a, b = randn(17, 1, seed=1), randn(17, 1, seed=2)
    _, out = run_checked("kernel f(a: f32[M, 1], b: f32[M, 1]) -> f32[M, 1] { return linear_scan(a, b, axis=1) }",
                         a, b)
    torch.testing.assert_close(out, b)


@pytest.mark.parametrize("dims", [{"B": 4, "L": 2048, "D": 1536, "N": 16}, {"B": 1, "L": 4096, "D": 64, "N": 128}])
def test_the_skip_term_scan_builds_for_sm90_without_spills(dims):
    """Two f64 cumsums beside the row-sized partials: a split block of scanned rows takes a
    tile per two words of their partials ([16, 64]; [16, 128] spilled 160 bytes)."""
    fn = tiledsl.compile(MAMBA_TINY)
    reports = aot.inspect_program(fn, dims, {})
    assert [r.function for r in reports] == ["k0_rows", "k0_combine"]
    assert reports[0].config["BLOCK_O"] * reports[0].config["BLOCK_R"] == 1024, reports[0]
    assert all(r.spill_bytes == 0 for r in reports), reports
