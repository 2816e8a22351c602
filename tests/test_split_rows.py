"""Split row programs: a reduction across the rows of a row program along a dim the call
sizes (tokens, a batch, a weight gradient's rows) is done in the producing kernel as
per-chunk partials plus a combine launch (`RowPlan.split`, backends/triton/combine.py).
Numerics against float64 torch on awkward sizes and rows longer than the interpreter's
block (the looped form, whose partials merge in the workspace), one kernel of two launches,
the same bits on every run, and the sm_90 build at the sizes of real models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tiledsl
from helpers import gen, randn, run_checked
from tiledsl import testing
from tiledsl.backends.triton import aot
from tiledsl.passes.fusion.remarks import FusionRemark

# 5000 is longer than the interpreter's row block (4096): the row loops and the partials
# of a full value merge in the workspace; 600 rows make several chunks
SIZES = [(1, 7), (17, 113), (600, 33), (37, 5000)]


def launches(fn) -> list[str]:
    return sorted(launch.kernel.fn_name for launch in fn.launches)


CE_MEAN = """
kernel ce(x: bf16[M, V], y: i32[M], ignore_index: i32) -> f32[] {
    xf = cast(x, f32)
    lse = logsumexp(xf, axis=-1)
    x_y = sum(where(index(xf, -1) == y[:, None], xf, 0.0), axis=-1)
    valid = y != ignore_index
    loss = where(valid, lse - x_y, 0.0)
    return sum(loss, axis=0) / sum(cast(valid, f32), axis=0)
}
"""


@pytest.mark.parametrize("m, v", SIZES)
def test_cross_entropy_mean_is_one_kernel_of_two_launches(m, v):
    """Liger's cross-entropy, reduction="mean": the per-row loss and the count of valid rows
    summed over the tokens in the row program, the mean in its combine launch."""
    fn = tiledsl.compile(CE_MEAN)
    x = randn(m, v, dtype=torch.bfloat16, seed=m, scale=3.0)
    y = torch.randint(0, v, (m,), generator=gen(v), dtype=torch.int32)
    y[::5] = -100
    out = fn(x, y, -100)
    if (y != -100).any():
        want = F.cross_entropy(x.double(), y.long(), ignore_index=-100)
        eager = F.cross_entropy(x.float(), y.long(), ignore_index=-100)
        assert abs(out.double() - want) <= 2 * abs(eager.double() - want) + 1e-6 * abs(want) + 1e-6
    else:  # every row ignored: 0 / 0, as torch
        assert out.isnan()
    assert [k.template for k in fn.kernels] == ["rows"], fn.explain()
    assert launches(fn) == ["k0_combine", "k0_rows"]
    assert "split, tail" in fn.ir()
    assert ("        launches: 2 (split: sum (line 8), sum (line 8) across its rows along M, as partials "
            "over chunks of rows; a combine launch merges them in chunk order)") in fn.explain().splitlines()


@pytest.mark.parametrize("b, t, v", [(1, 1, 5), (2, 17, 113), (3, 301, 33), (2, 5, 5000)])
def test_per_sequence_log_prob_sums(b, t, v):
    """DPO's per-sequence log-probability of the chosen tokens, masked and summed over each
    sequence's tokens: the sum over T (the other kept dim B indexes the partials)."""
    src = """kernel logps(x: f32[B, T, V], y: i64[B, T], m: f32[B, T]) -> f32[B] {
        lp = x - logsumexp(x, axis=-1, keepdims=true)
        return sum(gather(lp, y) * m, axis=-1)
    }"""
    x, m = randn(b, t, v, seed=t), (randn(b, t, seed=v) > 0).float()
    y = torch.randint(0, v, (b, t), generator=gen(b))
    fn, out = run_checked(src, x, y, m)
    want = (torch.log_softmax(x.double(), -1).gather(-1, y[..., None])[..., 0] * m.double()).sum(-1)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert len(fn.kernels) == 1 and launches(fn) == ["k0_combine", "k0_rows"]


@pytest.mark.parametrize("m, n", SIZES)
def test_column_statistics_of_a_row_program(m, n):
    """A normalized value's column mean and max over the tokens (a full value reduced across
    the rows: partials per position along the row), with the normalized rows themselves."""
    src = """kernel f(x: f32[M, N]) -> (f32[M, N], f32[N], f32[1, N]) {
        h = x * rsqrt(mean(x * x, axis=-1, keepdims=true) + 1e-6)
        return h, mean(h, axis=0), max(h, axis=0, keepdims=true) * 2.0
    }"""
    fn, _ = run_checked(src, randn(m, n, seed=m + n))
    assert len(fn.kernels) == 1 and launches(fn) == ["k0_combine", "k0_rows"], fn.explain()


def test_a_nan_in_a_column_is_its_max_as_torch():
    x = randn(300, 17, seed=4)
    x[211, 3] = float("nan")
    fn = tiledsl.compile("kernel f(x: f32[M, N]) -> f32[N] { return max(exp(x - max(x, axis=-1, "
                         "keepdims=true)), axis=0) }")
    out = fn(x)
    want = torch.exp(x - x.amax(-1, keepdim=True)).amax(0)
    assert torch.equal(out.isnan(), want.isnan()) and out[3].isnan()
    torch.testing.assert_close(out[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("m, n", SIZES)
def test_rmsnorm_and_layernorm_backward_sum_weight_gradients_in_partials(m, n, dt):
    """The weight gradient is a column sum of the rows' products: partials per chunk of rows
    in the kernel that writes dx, merged by its combine launch (Liger's design): x and dy
    read once, dx written once. LayerNorm's bias gradient, dy's column sum, reads no value
    of the rows: fuse-rows never reaches it from the row program (they share only an input),
    and fuse-horizontal merges its column-sum kernel into the split row program (its sums
    across the rows). In bf16 too: fuse-rows seeds a column sum after the reductions along
    the row, so the bias gradient's sum does not grow from the cast of dy it reads into a
    row program along the columns that takes the ops dx needs (it was 3 kernels)."""
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dt]
    rms = tiledsl.compile(f"""kernel rms(x: {dt}[M, N], w: {dt}[N]) -> {dt}[M, N] {{
        xf = cast(x, f32)
        return cast(xf * rsqrt(mean(xf * xf, axis=-1, keepdims=true) + 1e-6) * cast(w, f32), {dt})
    }}""")
    ln = tiledsl.compile(f"""kernel ln(x: {dt}[M, N], w: {dt}[N], b: {dt}[N]) -> {dt}[M, N] {{
        xf = cast(x, f32)
        mu = mean(xf, axis=-1, keepdims=true)
        var = mean((xf - mu) * (xf - mu), axis=-1, keepdims=true)
        return cast((xf - mu) * rsqrt(var + 1e-5) * cast(w, f32) + cast(b, f32), {dt})
    }}""")
    x, w, b = randn(m, n, dtype=dtype, seed=m), randn(n, dtype=dtype, seed=n), randn(n, dtype=dtype, seed=1)
    for fn, args in ((rms, (x, w)), (ln, (x, w, b))):
        report = testing.check_grads(fn, *args, generator=gen(m * n))
        assert report.ok, f"{fn.name}: {report}"
        bwd = fn.backward
        assert [k.template for k in bwd.kernels] == ["rows"], bwd.explain()
        assert "_combine(" in bwd.kernels[0].source


def test_the_same_bits_on_every_run():
    """No atomics: each chunk's partial and the combine's order depend on the sizes only."""
    fn = tiledsl.compile(CE_MEAN)
    x = randn(997, 301, dtype=torch.bfloat16, seed=3, scale=3.0)
    y = torch.randint(0, 301, (997,), generator=gen(5), dtype=torch.int32)
    first = fn(x, y, -100)
    assert all(torch.equal(fn(x, y, -100), first) for _ in range(3))
    x, w, g = randn(613, 211, seed=8), randn(211, seed=9), randn(613, 211, seed=10)
    training = tiledsl.compile("""kernel rms(x: f32[M, N], w: f32[N]) -> f32[M, N] {
        return x * rsqrt(mean(x * x, axis=-1, keepdims=true) + 1e-6) * w
    }""").training((0, 1))
    _, *saved = training.forward(x, w)  # (the row's mean of squares)
    bwd_in = (x, w, *saved, g)
    once = training.backward(*bwd_in)
    assert all(torch.equal(a, b) for a, b in zip(training.backward(*bwd_in), once, strict=True))


@pytest.mark.parametrize("program", ["ce", "logps", "norm"])
def test_a_reduction_of_one_value_per_row_gives_the_same_bits_at_every_split(program, monkeypatch):
    """A loss's or a norm's partials are per block of rows, merged in block order: how many
    blocks each program takes (CHUNK, from `SPLIT_PROGRAMS`) does not change a bit. (These
    f32 sums accumulate in f64, so per-chunk partials rarely differed either: the workspace,
    a partial per block at both splits, is what says the merge does not follow the split.)"""
    from tiledsl.backends.triton import row_split

    src = {"ce": CE_MEAN, "logps": """kernel logps(x: f32[B, T, V], y: i64[B, T]) -> f32[B] {
        return sum(gather(x - logsumexp(x, axis=-1, keepdims=true), y), axis=-1)
    }""", "norm": """kernel norm(g: f32[M, N]) -> f32[] {
        return sqrt(sum(g * g, axis=None))
    }"""}[program]
    args = {"ce": lambda: (randn(2001, 113, dtype=torch.bfloat16, seed=3, scale=3.0),
                           torch.randint(0, 113, (2001,), generator=gen(5), dtype=torch.int32), -100),
            "logps": lambda: (randn(3, 5001, 13, seed=4), torch.randint(0, 13, (3, 5001), generator=gen(6))),
            "norm": lambda: (randn(3001, 65, seed=7),)}[program]()
    outs, chunks, spaces = [], [], []
    for programs in (264, 1):  # (a chunk of one block, and one chunk of all of them)
        monkeypatch.setattr(row_split, "SPLIT_PROGRAMS", programs)
        fn = tiledsl.compile(src)
        outs.append(fn(*args))
        launch = next(launch for launch in fn.launches if launch.kernel.fn_name == "k0_rows")
        dims = dict(launch.dims)
        cfg = launch.kernel.launch_config(dims, "interpreter").constexprs
        chunks.append(cfg["CHUNK"])
        spaces.append(launch.kernel.workspace(dims, "interpreter"))
    assert chunks[0] < chunks[1], chunks
    across = {"ce": 2001, "logps": 5001, "norm": 3001}[program]
    groups = 3 if program == "logps" else 1
    assert spaces[0] == spaces[1] and set(spaces[0]) == {(-(-across // cfg["BLOCK_O"]) * groups, "float64")}, \
        spaces
    assert torch.equal(outs[0], outs[1])


def test_an_empty_dim_across_gives_the_sum_and_mean_of_nothing():
    fn = tiledsl.compile("""kernel f(x: f32[M, N]) -> (f32[N], f32[N]) {
        h = exp(x - max(x, axis=-1, keepdims=true))
        return sum(h, axis=0), mean(h, axis=0)
    }""")
    s, m = fn(torch.empty(0, 5))
    assert torch.equal(s, torch.zeros(5)) and m.isnan().all()


def test_what_the_combine_cannot_take_stays_a_kernel_of_its_own():
    """An op reading a reduction across the rows and a value of the rows (the global
    response norm's x * nx) needs the reduction before the rows: refused, with its rule."""
    fn = tiledsl.compile("""kernel f(x: f32[M, N]) -> f32[M, N] {
        h = x - max(x, axis=-1, keepdims=true)
        return h * sum(h, axis=0, keepdims=true)
    }""")
    assert len(fn.kernels) == 2
    refusals = [str(r) for r in fn.remarks if isinstance(r, FusionRemark) and not r.fused]
    assert ("[fuse-rows] refused: sum (line 3) -> mul (line 3): mul combines a reduction across the "
            "rows with a value of the rows (a combine launch merges that reduction after them) "
            "[rule: tile]") in refusals


@pytest.mark.parametrize("program, dims", [
    ("ce", dict(M=4096, V=32000)),
    ("ce", dict(M=4096, V=128256)),
    ("rms", dict(M=16384, N=4096)),
    ("rms", dict(M=4096, N=32768)),
    ("ln", dict(M=8192, N=4096)),
])
def test_split_kernels_build_for_sm90_with_programs_for_every_sm_and_no_spills(program, dims):
    src = {"ce": CE_MEAN, "rms": """kernel rms(x: bf16[M, N], w: bf16[N]) -> bf16[M, N] {
        xf = cast(x, f32)
        return cast(xf * rsqrt(mean(xf * xf, axis=-1, keepdims=true) + 1e-6) * cast(w, f32), bf16)
    }""", "ln": """kernel ln(x: bf16[M, N], w: bf16[N], b: bf16[N]) -> bf16[M, N] {
        xf = cast(x, f32)
        mu = mean(xf, axis=-1, keepdims=true)
        var = mean((xf - mu) * (xf - mu), axis=-1, keepdims=true)
        return cast((xf - mu) * rsqrt(var + 1e-5) * cast(w, f32) + cast(b, f32), bf16)
    }"""}[program]
    fn = tiledsl.compile(src)
    fn = fn.backward if program != "ce" else fn
    found = {r.name: r for r in []}
    reports = aot.inspect_program(fn, dims, {"ignore_index": -100})
    launched = aot.meta_launches(fn, dims, {"ignore_index": -100})
    for launch, report in zip(launched, reports, strict=True):
        found[launch.kernel.fn_name] = report
        assert report.spill_bytes == 0, report  # (the vocabulary walked 8k at a time: rows.ROW_WALK)
    rows = next(launch for launch in launched if launch.kernel.fn_name == "k0_rows")
    grid = rows.kernel.launch_config(dict(rows.dims), "cuda").grid
    assert grid[0] >= 132, grid
    assert set(found) == {"k0_rows", "k0_combine"}


def test_ptx_json_shows_each_launch_of_a_split_kernel(tmp_path):
    """`tiledsl ptx --json`: the partials launch and the combine, each with its grid and the
    workspace allocated for it (RMSNorm's backward at M = 16384, N = 4096: chunks of 64 rows, 256
    programs, 256 partial rows of 4096 f64 words)."""
    import json

    from test_cli import cli

    path = tmp_path / "rms.tdsl"
    path.write_text("kernel rms(x: f32[M, N], w: f32[N]) -> f32[M, N] {\n"
                    "    return x * rsqrt(mean(x * x, axis=-1, keepdims=true) + 1e-6) * w\n}\n")
    code, out, _ = cli("ptx", str(path), "--backward", "--dims", "M=16384,N=4096", "--json")
    assert code == 0
    rows, combine = json.loads(out)["kernels"]
    assert (rows["function"], combine["function"]) == ("k0_rows", "k0_combine")
    assert rows["grid"] == [256] and rows["config"]["CHUNK"] == 64 and combine["grid"] == [16]
    assert rows["workspace_bytes"] == 256 * 4096 * 8 and combine["workspace_bytes"] == 0  # (it reads it)
    assert rows["spill_bytes"] == combine["spill_bytes"] == 0


def test_a_max_across_no_rows_raises_as_torch():
    fn = tiledsl.compile("kernel f(x: f32[M, N]) -> f32[N] { return max(exp(x - max(x, axis=-1, "
                         "keepdims=true)), axis=0) }")
    with pytest.raises(tiledsl.TileDSLError) as err:
        fn(torch.empty(0, 5))
    assert str(err.value).splitlines()[0] == (
        "<string>:1:43: error: max over an empty axis (M = 0 at this call): max has no identity "
        "(torch raises too)")


def test_a_sort_of_a_call_sized_k_does_not_split():
    """A topk whose k the call decides may sort its rows in the workspace, one program a row:
    the reduction of its values is a row program of its own, which splits across the rows."""
    fn = tiledsl.compile("""kernel f(x: f32[M, N], k: i32[K]) -> (f32[M, K], f32[]) {
        t = topk(x, K, axis=-1)
        return t, sum(sum(t, axis=-1), axis=0)
    }""")
    assert [k.template for k in fn.kernels] == ["rows", "rows"]
    sort, total = fn.kernel_ops()
    assert not sort.plan.split and total.plan.split
    refusals = [str(r) for r in fn.remarks if isinstance(r, FusionRemark) and not r.fused]
    assert any("sum reduces the elements a topk selected, which a row longer than 16384 sorts in memory "
               "(a row program of its own reads them) [rule: tile]" in r for r in refusals), refusals
    x = randn(37, 11, seed=5)
    k = torch.randint(-9, 9, (4,), generator=gen(5), dtype=torch.int32)  # (only its size is read: K)
    t, total_sum = fn(x, k)
    want = torch.topk(x.double(), 4).values
    assert torch.equal(t.double(), want)
    torch.testing.assert_close(total_sum.double(), want.sum(), rtol=1e-6, atol=1e-6)


def test_a_column_sum_merges_into_the_split_row_program_reading_the_same_gradient():
    """LayerNorm's backward: db = sum(dy, 0) is its own row program along the columns until
    fuse-horizontal merges it into dx's split row program, where it is one more sum across
    the rows (dy read once)."""
    training = tiledsl.compile("""kernel ln(x: f32[M, N], w: f32[N], b: f32[N]) -> f32[M, N] {
        mu = mean(x, axis=-1, keepdims=true)
        xc = x - mu
        return xc * rsqrt(mean(xc * xc, axis=-1, keepdims=true) + 1e-5) * w + b
    }""").training((0, 1, 2))
    fn = training.backward
    assert len(fn.kernels) == 1
    assert ("[fuse-horizontal] fused: mul (line 4) -> sum (line 4): 2 rows kernels over [M, N] rows along "
            "axis 1 as one ([M, N] rows along axis 0 reduced across its rows): 1 launch fewer; shared inputs "
            "read once: saves 4·M·N B") in fn.explain()
    x, w, b, dy = randn(613, 211, seed=1), randn(211, seed=2), randn(211, seed=3), randn(613, 211, seed=4)
    _, *saved = training.forward(x, w, b)  # (the rows' mean and variance)
    run_checked(fn, x, w, b, *saved, dy, sm90=False)
    assert launches(fn) == ["k0_combine", "k0_rows"]


CLIP3 = """kernel clip(g1: f32[A, K], g2: f32[K], g3: f32[C, E], max_norm: f32)
        -> (f32[A, K], f32[K], f32[C, E], f32[]) {
    total_norm = sqrt(sum(g1 * g1, axis=None) + sum(g2 * g2, axis=None) + sum(g3 * g3, axis=None))
    clip_coef = minimum(max_norm / (total_norm + 1e-6), 1.0)
    return g1 * clip_coef, g2 * clip_coef, g3 * clip_coef, total_norm
}"""


@pytest.mark.parametrize("a, k, c, e", [(613, 113, 64, 17), (1, 1, 1, 1), (3, 5000, 301, 2)])
def test_clip_grad_norm_is_two_kernels_as_torchs_foreach_path(a, k, c, e):
    """torch's clip_grad_norm_ (norm 2) over three gradients: the three sums of squares are
    one launch (g2's one row, g3's and g1's rows split into partials), whose combines follow
    in order, the last adding the others' sums (stored by the launch) into the clipping
    coefficient; the three scales are one more launch: 2 kernels, the hand-written count."""
    fn = tiledsl.compile(CLIP3)
    assert [k.template for k in fn.kernels] == ["merged", "merged"], fn.explain()
    report = fn.explain().splitlines()
    assert ("        launches: 3 (its members' programs, then the combine of each split one, in order, "
            "merging its partials: sum (line 3), sum (line 3))") in report
    assert ("  [fuse-horizontal] fused: mul (line 3) -> mul (line 3): 3 kernels over different iteration "
            "spaces ([K] rows along axis 0, [C, E] rows along axis 1, [A, K] rows along axis 1) as one "
            "launch, its programs partitioned among them: 2 launches fewer") in report
    grads = randn(a, k, seed=1), randn(k, seed=2), randn(c, e, seed=3)
    for max_norm in (5.0, 1e4):  # clipped, and not
        out = fn(*grads, max_norm)
        params = [torch.nn.Parameter(torch.zeros_like(g, dtype=torch.float64)) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.double().clone()
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
        for got, p in zip(out[:3], params, strict=True):
            torch.testing.assert_close(got.double(), p.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out[3].double(), total, rtol=1e-5, atol=0)
        assert all(torch.equal(x, y) for x, y in zip(fn(*grads, max_norm), out, strict=True))
    assert launches(fn) == ["k0_1_combine", "k0_2_combine", "k0_merged", "k1_merged"]


def test_clip_grad_norm_builds_for_sm90_with_programs_for_every_sm_and_no_spills():
    fn = tiledsl.compile(CLIP3)
    dims = dict(A=4096, K=4096, C=11008, E=4096)
    launched = aot.meta_launches(fn, dims, {"max_norm": 1.0})
    reports = aot.inspect_program(fn, dims, {"max_norm": 1.0})
    assert [launch.kernel.fn_name for launch in launched] == ["k0_merged", "k0_1_combine", "k0_2_combine",
                                                              "k1_merged"]
    assert all(r.spill_bytes == 0 for r in reports), reports
    first = launched[0].kernel.launch_config(dict(launched[0].dims), "cuda").grid
    assert first[0] >= 2 * 132, first  # g1's and g3's chunks, and g2's one program


def test_independent_split_row_programs_over_different_spaces_are_one_launch():
    """A loss and an auxiliary loss over other tensors (a token-mean cross-entropy and
    ST-MoE's router z-loss, the mean square of the router logits' logsumexp): two split row
    programs that share no input merge as reductions into one launch; each combine
    finalizes its own mean."""
    fn = tiledsl.compile("""kernel f(x: f32[M, V], y: i64[M], r: f32[T, E]) -> (f32[], f32[]) {
        lse = logsumexp(x, axis=-1)
        ce = mean(lse - sum(where(index(x, -1) == y[:, None], x, 0.0), axis=-1))
        z = logsumexp(r, axis=-1)
        return ce, mean(z * z) * 0.001
    }""")
    assert [k.template for k in fn.kernels] == ["merged"], fn.explain()
    for m, v, t, e in [(1, 1, 1, 1), (613, 113, 301, 8), (17, 5000, 37, 64)]:
        x, r = randn(m, v, seed=m), randn(t, e, seed=t)
        y = torch.randint(0, v, (m,), generator=gen(v))
        ce, aux = fn(x, y, r)
        torch.testing.assert_close(ce.double(), torch.nn.functional.cross_entropy(x.double(), y),
                                   rtol=1e-5, atol=1e-6)
        z = torch.logsumexp(r.double(), -1)
        torch.testing.assert_close(aux.double(), (z * z).mean() * 0.001, rtol=1e-5, atol=1e-7)
    assert sorted(set(launches(fn))) == ["k0_0_combine", "k0_1_combine", "k0_merged"]
