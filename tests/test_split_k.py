"""Split-K for the GEMM template: where a call's output tiles alone cannot fill the GPU, the
programs of a tile share its K loop, each storing the partial products (and row statistics)
of its range of K in a workspace, and a combine launch adds them in range order and runs the
epilogue (`backends/triton/matmul.py`). Numerics against the float64 oracle on awkward sizes
with K not a multiple of the block, forced splits (`@tile(SPLITS=n)`) and the default rule,
one kernel of two launches (one where it does not split), the same bits on every run, and the
sm_90 build at a decode-sized GEMM: every SM busy, no spills."""

from __future__ import annotations

import pytest
import torch

import tiledsl
from helpers import randn, run_checked
from tiledsl.backends.triton import aot

SPLIT = ["k0_combine", "k0_matmul"]


def launches(fn) -> list[str]:
    return sorted(launch.kernel.fn_name for launch in fn.launches)


def hinted(splits: int, src: str) -> str:
    return f"@tile(SPLITS={splits})\n{src}"


def splits_run(fn) -> set[int]:
    """The SPLITS each recorded launch of the main kernel ran with (interpreter)."""
    return {launch.kernel.launch_config(dict(launch.dims), "interpreter").constexprs["SPLITS"]
            for launch in fn.launches if launch.kernel.fn_name == "k0_matmul"}


def same_bits_twice(fn, *args, **kwargs) -> None:
    first, second = fn(*args, **kwargs), fn(*args, **kwargs)
    for a, b in zip(*(x if isinstance(x, tuple | list) else (x,) for x in (first, second)), strict=True):
        assert torch.equal(a, b)


GEMM = "kernel f(a: {dt}[M, K], b: {dt}[K, N]) -> {dt}[M, N] {{ return a @ b }}"
MULTI_D = """kernel f(a: f16[M, K], b: f16[K, N], bias: f16[N], d: f32[M, N], e: f32[M, 1]) -> f16[M, N] {
    return cast((a @ b + bias) * d * e, f16)
}"""


# K = 1000: not a multiple of the interpreter's 128-wide K block (8 blocks, the last short);
# five splits of two blocks leave the fifth none (it stores zeros)
@pytest.mark.parametrize("splits", [3, 5])
@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("m, n", [(1, 1), (17, 113), (113, 17)])
def test_a_forced_split_is_correct_and_the_same_bits_every_run(splits, dt, m, n):
    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dt]
    a, b = randn(m, 1000, dtype=tdt), randn(1000, n, dtype=tdt)
    fn, out = run_checked(hinted(splits, GEMM.format(dt=dt)), a, b, sm90=False)
    want = a.double() @ b.double()
    eager = (a.float() @ b.float()).double()
    assert (out.double() - want).abs().max() <= 2 * (eager - want).abs().max() + 2e-2 * want.abs().max()
    assert len(fn.kernels) == 1 and launches(fn) == SPLIT
    assert splits_run(fn) == {splits}
    same_bits_twice(fn, a, b)


def test_split_one_is_one_launch():
    a, b = randn(17, 1000), randn(1000, 113)
    fn, _ = run_checked(hinted(1, GEMM.format(dt="f32")), a, b, sm90=False)
    assert launches(fn) == ["k0_matmul"] and splits_run(fn) == {1}


def test_small_k_is_one_launch_by_default():
    """Too few blocks of K to share (under 4 a split): no split, whatever the tiles."""
    fn, _ = run_checked(GEMM.format(dt="f32"), randn(17, 300), randn(300, 113), sm90=False)
    assert launches(fn) == ["k0_matmul"]


def test_the_default_rule_splits_a_long_k_of_one_tile():
    """M = 1, N = 17, K = 2000 in the interpreter: one 16 x 32 tile, 16 blocks of 128 of K:
    four splits of four blocks."""
    a, b = randn(1, 2000), randn(2000, 17)
    fn, _ = run_checked(GEMM.format(dt="f32"), a, b, sm90=False)
    assert launches(fn) == SPLIT and splits_run(fn) == {4}
    same_bits_twice(fn, a, b)


# (not 1 x 1: the oracle's f16 tolerance of one element is whatever eager rounding gave it)
@pytest.mark.parametrize("splits", [3, 5])
@pytest.mark.parametrize("m, n", [(1, 17), (17, 113)])
def test_a_multi_d_epilogue_runs_in_the_combine(splits, m, n):
    args = (randn(m, 1000, dtype=torch.float16), randn(1000, n, dtype=torch.float16),
            randn(n, dtype=torch.float16), randn(m, n), randn(m, 1))
    fn, _ = run_checked(hinted(splits, MULTI_D), *args, sm90=False)
    assert [k.template for k in fn.kernels] == ["matmul"] and launches(fn) == SPLIT
    same_bits_twice(fn, *args)


@pytest.mark.parametrize("splits", [3, 5])
def test_a_batched_gemm_splits_every_batch_element(splits):
    src = """kernel f(a: f32[B, H, M, K], b: f32[K, N], c: f32[H, M, N]) -> (f32[B, H, M, N], f32[B, H, M, N]) {
        p = a @ b
        return c * p, p
    }"""
    args = randn(3, 2, 17, 1000), randn(1000, 113), randn(2, 17, 113)
    fn, _ = run_checked(hinted(splits, src), *args, sm90=False)
    assert [k.template for k in fn.kernels] == ["matmul"] and launches(fn) == SPLIT
    same_bits_twice(fn, *args)
    args = randn(2, 17, 1000), randn(2, 1000, 33)  # batched B too
    fn, _ = run_checked(hinted(splits, "kernel f(a: f32[B, M, K], b: f32[B, K, N]) -> f32[B, M, N] "
                                       "{ return a @ b }"), *args, sm90=False)
    assert launches(fn) == SPLIT


@pytest.mark.parametrize("splits", [3, 5])
def test_an_i8_gemm_adds_i32_partials(splits):
    """SmoothQuant's W8A8 linear layer: i32 partials, added exactly."""
    from pathlib import Path

    fn = tiledsl.compile(hinted(splits, (Path(__file__).parent.parent / "examples" / "int8_gemm.tdsl")
                                .read_text()))
    g = torch.Generator().manual_seed(splits)
    xq = torch.randint(-128, 128, (17, 1000), generator=g, dtype=torch.int8)
    wq = torch.randint(-128, 128, (1000, 113), generator=g, dtype=torch.int8)
    run_checked(fn, xq, wq, randn(17, 1) * 1e-3, randn(113) * 1e-3, sm90=False)
    assert launches(fn) == SPLIT
    plain = tiledsl.compile(hinted(splits, "kernel f(a: i8[M, K], b: i8[K, N]) -> i32[M, N] { return a @ b }"))
    assert torch.equal(plain(xq, wq), xq.long().matmul(wq.long()).int())


@pytest.mark.parametrize("splits", [3, 5])
def test_operand_prologues_and_a_dual_gemm_split(splits):
    """Prologues on the loaded tiles (a scale, a cast, a vector along K) and two accumulators,
    each with its partials; a second output stored by the combine."""
    src = """kernel f(x: f16[M, K], g: f32[K], w1: f16[K, N], w3: f32[K, N], s: f32) -> (f32[M, N], f32[M, N]) {
        a = cast(x, f32) * s * g
        h = a @ cast(w1, f32)
        u = a @ w3
        return h * sigmoid(u), u
    }"""
    args = randn(17, 1000, dtype=torch.float16), randn(1000), randn(1000, 113, dtype=torch.float16), \
        randn(1000, 113)
    fn, _ = run_checked(hinted(splits, src), *args, s=0.7, sm90=False)
    assert [k.template for k in fn.kernels] == ["matmul"] and launches(fn) == SPLIT
    assert "dual = " in fn.ir("fused")
    same_bits_twice(fn, *args, s=0.7)


@pytest.mark.parametrize("splits", [3, 5])
def test_a_row_statistic_is_summed_in_partials_and_finalized_after(splits):
    """RMSNorm then the projection: the mean of squares of A's rows is summed along K with the
    products, a partial sum per split; the combine adds them and divides by K."""
    src = """kernel f(x: f32[M, K], g: f32[K], w: f32[N, K]) -> f32[M, N] {
        y = x * rsqrt(mean(x * x, axis=-1, keepdims=true) + 1e-6) * g
        return y @ w.T
    }"""
    args = randn(17, 1000), randn(1000), randn(113, 1000)
    fn, _ = run_checked(hinted(splits, src), *args, sm90=False)
    assert [k.template for k in fn.kernels] == ["matmul"] and launches(fn) == SPLIT
    assert "row_stats = " in fn.ir("fused")
    same_bits_twice(fn, *args)


def test_fp8_and_a_gathered_int4_weight_split():
    from pathlib import Path

    examples = Path(__file__).parent.parent / "examples"
    fn = tiledsl.compile(hinted(3, (examples / "gemm_fp8_scaled.tdsl").read_text()))
    a, b = randn(17, 1000).to(torch.float8_e4m3fn), randn(1000, 113, scale=3).to(torch.float8_e4m3fn)
    run_checked(fn, a, b, randn(17, 1), randn(1, 113), sm90=False)
    assert launches(fn) == SPLIT
    fn = tiledsl.compile(hinted(3, (examples / "gptq_int4_gemm.tdsl").read_text()))
    g = torch.Generator().manual_seed(4)
    k, n = 1024, 40
    wq = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (k // 128, n), generator=g).half()
    run_checked(fn, randn(5, k, dtype=torch.float16), wq, zeros, randn(k // 128, n, dtype=torch.float16,
                                                                         scale=0.01), sm90=False)
    assert launches(fn) == SPLIT


def test_the_tma_path_splits():
    """f16 operands whose rows are 16-byte aligned are read through descriptors (the flags
    set): a split's tiles start at its range of K."""
    a, b = randn(17, 1024, dtype=torch.float16), randn(1024, 64, dtype=torch.float16)
    fn, _ = run_checked(hinted(3, GEMM.format(dt="f16")), a, b, sm90=False)
    (main,) = [x for x in fn.launches if x.kernel.fn_name == "k0_matmul"]
    flags = {arg.name: arg.value for arg in main.arguments if arg.type == "constexpr"}
    assert flags["in0_tma"] and flags["in1_tma"], flags
    assert launches(fn) == SPLIT


def test_an_empty_k_gives_the_epilogue_of_zeros():
    fn = tiledsl.compile(hinted(3, "kernel f(a: f32[M, K], b: f32[K, N], c: f32[N]) -> f32[M, N] "
                                   "{ return a @ b + c }"))
    c = randn(5)
    assert torch.equal(fn(torch.empty(3, 0), torch.empty(0, 5), c), c.expand(3, 5))
    assert launches(fn) == ["k0_matmul"]


# --- on a GPU: the default rule at a decode-sized GEMM, built for sm_90 without one ---------

DECODE = """kernel f(a: f16[M, K], b: f16[K, N], bias: f16[N]) -> f16[M, N] {
    return cast(gelu(a @ b + bias), f16)
}"""


def test_a_decode_gemm_splits_to_fill_every_sm_and_builds_without_spills():
    """M = 16, N = 4096, K = 16384: 64 tiles of 16 x 64 alone leave most of an H100's 132 SMs
    idle; five splits of 52 blocks of K make 320 programs, then a combine of the 5 partials
    (1.25 MiB of f32)."""
    fn = tiledsl.compile(DECODE)
    dims = {"M": 16, "N": 4096, "K": 16384}
    launched = aot.meta_launches(fn, dims)
    assert [launch.kernel.fn_name for launch in launched] == ["k0_matmul", "k0_combine"]
    reports = aot.inspect_program(fn, dims)
    main, combine = reports
    assert main.grid[0] >= 132 and main.config["SPLITS"] == 5, main
    assert main.workspace_bytes == 5 * 16 * 4096 * 4 and combine.workspace_bytes == 0
    assert combine.grid[0] > 0 and combine.config["SPLITS"] == 5
    assert main.spill_bytes == combine.spill_bytes == 0, reports


def test_tiles_that_fill_the_gpu_are_one_launch_on_it():
    fn = tiledsl.compile(DECODE)
    launched = aot.meta_launches(fn, {"M": 4096, "N": 4096, "K": 16384})
    assert [launch.kernel.fn_name for launch in launched] == ["k0_matmul"]
    cfg = launched[0].kernel.launch_config(dict(launched[0].dims), "cuda")
    assert cfg.constexprs["SPLITS"] == 1


def test_autotune_candidates_split_as_the_configuration_sizing_the_workspace():
    """M = N = 128, K = 65536: one 128 x 128 tile on a GPU; every candidate splits as
    `configure` does (the workspace is laid out per output element, so any tile works), and
    none is persistent."""
    fn = tiledsl.compile(DECODE)
    (step,) = fn.runtime.steps
    emitted, dims = step.emitted, {"M": 128, "N": 128, "K": 65536}
    cfg = emitted.launch_config(dims, "cuda")
    splits = cfg.constexprs["SPLITS"]
    assert splits > 1 and cfg.grid == (splits,)
    candidates = emitted.launch_candidates(dims, "cuda")
    assert candidates and all(c.constexprs["SPLITS"] == splits and not c.persistent for c in candidates)
    assert emitted.workspace(dims, "cuda") == ((splits * 128 * 128, "float32"),)


def test_ptx_json_shows_the_split_gemm_and_its_combine(tmp_path):
    import json

    from test_cli import cli

    path = tmp_path / "decode.tdsl"
    path.write_text(DECODE)
    code, out, _ = cli("ptx", str(path), "--dims", "M=16,N=4096,K=16384", "--json")
    assert code == 0
    main, combine = json.loads(out)["kernels"]
    assert (main["function"], combine["function"]) == ("k0_matmul", "k0_combine")
    assert main["grid"] == [320] and main["config"]["SPLITS"] == 5


def test_a_split_of_far_rows_computes_its_offsets_in_int64():
    """A whose rows lie 2^30 elements apart (`test_offsets64`'s views): the call is WIDE, and a
    split's pointers start at its range of K in int64."""
    from test_offsets64 import FAR, SLOT, Far

    try:
        storage = torch.empty(2 * FAR + 4 * SLOT, dtype=torch.float16)
    except RuntimeError as err:
        pytest.fail(f"cannot reserve 4 GB of address space for the far views: {err}")
    a = Far(storage)(3, 1000)
    fn, _ = run_checked(hinted(3, GEMM.format(dt="f16")), a, randn(1000, 17, dtype=torch.float16))
    (main,) = [x for x in fn.launches if x.kernel.fn_name == "k0_matmul"]
    assert {arg.name: arg.value for arg in main.arguments}["WIDE"] is True
    assert launches(fn) == SPLIT
