"""A GEMM whose product is summed over batch axes is one kernel: sum_t A_t @ B_t is a longer
K loop (`fuse-epilogue`'s batch sums, `GemmPlan.batch_sums` / `summed_axes`, the batch loop
around the K loop in `backends/triton/matmul.py`). Numerics against the float64 oracle on
awkward sizes, one kernel, keepdims and inner batch axes, a mean, an epilogue on the summed
tile, broadcast operands, split-K over the (batch element, block of K) steps, the same bits on
every run, the refused cases' remarks, the derived backward, and the sm_90 build."""

from __future__ import annotations

import pytest
import torch

import tiledsl
from helpers import randn, run_checked
from tiledsl.backends.triton import aot
from tiledsl.testing import check_grads

SPLIT = ["k0_combine", "k0_matmul"]
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
SUM = "kernel f(a: {dt}[T, M, K], b: {dt}[T, K, N]) -> {dt}[M, N] {{ return sum(a @ b, axis=0) }}"


def templates(fn) -> list[str]:
    return [k.template for k in fn.kernels]


def launches(fn) -> list[str]:
    return sorted(launch.kernel.fn_name for launch in fn.launches)


def splits_run(fn) -> set[int]:
    return {launch.kernel.launch_config(dict(launch.dims), "interpreter").constexprs["SPLITS"]
            for launch in fn.launches if launch.kernel.fn_name == "k0_matmul"}


def same_bits_twice(fn, *args, **kwargs) -> None:
    assert torch.equal(fn(*args, **kwargs), fn(*args, **kwargs))


def refusals(fn) -> list[str]:
    return [line.strip() for line in fn.explain().splitlines() if "refused" in line]


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (17, 113, 17), (113, 17, 113), (17, 1, 113)])
def test_a_sum_over_the_batch_is_one_gemm(dt, t, m, n, k):
    a, b = randn(t, m, k, dtype=DTYPES[dt]), randn(t, k, n, dtype=DTYPES[dt])
    fn, out = run_checked(SUM.format(dt=dt), a, b, sm90=False)
    assert templates(fn) == ["matmul"] and out.shape == (m, n)


def test_the_plan_records_the_summed_axes_and_the_sm90_build():
    a, b = randn(3, 17, 113, dtype=torch.float16), randn(3, 113, 17, dtype=torch.float16)
    fn, _ = run_checked(SUM.format(dt="f16"), a, b)
    assert "batch_sums = (%r1) over axes (0), epilogue = ()" in fn.ir("fused")
    assert "fusions not made: none" in fn.explain()


@pytest.mark.parametrize("hint", ["", "@tile(SPLITS=3)\n"])
def test_i8_sums_exactly_in_i32(hint):
    g = torch.Generator().manual_seed(7)
    a = torch.randint(-128, 128, (17, 33, 113), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (17, 113, 17), generator=g, dtype=torch.int8)
    fn = tiledsl.compile(hint + "kernel f(a: i8[T, M, K], b: i8[T, K, N]) -> i32[M, N] "
                                "{ return sum(a @ b, axis=0) }")
    assert torch.equal(fn(a, b), (a.long() @ b.long()).sum(0).int())
    # (17 steps of one block of K for one tile: the default rule splits them too)
    assert templates(fn) == ["matmul"] and launches(fn) == SPLIT


def test_an_operand_prologue_runs_on_every_summed_element():
    src = """kernel f(a: f16[T, M, K], b: f32[T, K, N], s: f32) -> f32[M, N] {
        return sum((cast(a, f32) * s) @ b, axis=0)
    }"""
    fn, _ = run_checked(src, randn(3, 17, 113, dtype=torch.float16), randn(3, 113, 33), s=0.5)
    assert templates(fn) == ["matmul"] and "prologue" in fn.ir("fused")


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", [1, -3, 0])
def test_any_batch_axis_of_a_rank_4_product_keepdims_or_not(axis, keepdims):
    kd = "true" if keepdims else "false"
    out = {(1, False): "B, M, N", (0, False): "H, M, N", (1, True): "B, 1, M, N", (0, True): "1, H, M, N"}[
        (axis % 4, keepdims)]
    src = (f"kernel f(a: f32[B, H, M, K], b: f32[B, H, K, N]) -> f32[{out}] "
           f"{{ return sum(a @ b, axis={axis}, keepdims={kd}) }}")
    a, b = randn(2, 3, 17, 33), randn(2, 3, 33, 113)
    fn, _ = run_checked(src, a, b, sm90=False)
    assert templates(fn) == ["matmul"]
    assert f"over axes ({axis % 4})" in fn.ir("fused")


def test_two_batch_axes_summed_one_after_the_other():
    src = """kernel f(a: f32[B, H, M, K], b: f32[B, H, K, N]) -> f32[M, N] {
        return sum(sum(a @ b, axis=1), axis=0)
    }"""
    fn, _ = run_checked(src, randn(2, 3, 17, 33), randn(2, 3, 33, 17), sm90=False)
    assert templates(fn) == ["matmul"] and "over axes (0, 1)" in fn.ir("fused")


def test_a_chain_keeping_a_dim_then_dropping_one():
    src = """kernel f(a: f32[B, H, M, K], b: f32[H, K, N]) -> f32[1, M, N] {
        return sum(sum(a @ b, axis=1, keepdims=true), axis=0)
    }"""
    fn, _ = run_checked(src, randn(3, 2, 17, 33), randn(2, 33, 17), sm90=False)
    assert templates(fn) == ["matmul"] and "over axes (0, 1)" in fn.ir("fused")


def test_the_tma_path_walks_the_batch():
    """f16 operands with 16-byte aligned rows are read through descriptors: the batch loop's
    index is a descriptor coordinate; split, a range starts inside an element's K loop."""
    a, b = randn(3, 17, 1024, dtype=torch.float16), randn(3, 1024, 64, dtype=torch.float16)
    for hint in ("", "@tile(SPLITS=5)\n"):
        fn, _ = run_checked(hint + SUM.format(dt="f16"), a, b, sm90=False)
        main = [x for x in fn.launches if x.kernel.fn_name == "k0_matmul"][-1]
        flags = {arg.name: arg.value for arg in main.arguments if arg.type == "constexpr"}
        assert flags["in0_tma"] and flags["in1_tma"], flags


def test_a_mean_is_divided_by_the_axis_size():
    src = "kernel f(a: f16[T, M, K], b: f16[T, K, N]) -> f16[M, N] { return mean(a @ b, axis=0) }"
    a, b = randn(17, 17, 113, dtype=torch.float16), randn(17, 113, 33, dtype=torch.float16)
    fn, _ = run_checked(src, a, b)
    assert templates(fn) == ["matmul"]


def test_an_epilogue_after_the_sum_runs_on_the_summed_tile():
    src = """kernel f(a: bf16[T, M, K], b: bf16[T, K, N], bias: f32[N], s: f32) -> bf16[M, N] {
        return cast(relu(sum(a @ b, axis=0) * s + bias), bf16)
    }"""
    args = randn(3, 113, 17, dtype=torch.bfloat16), randn(3, 17, 17, dtype=torch.bfloat16), randn(17)
    fn, _ = run_checked(src, *args, s=0.5)
    assert templates(fn) == ["matmul"]
    fused = fn.ir("fused")
    assert "batch_sums = (%r1) over axes (0)" in fused and "epilogue = ()" not in fused


@pytest.mark.parametrize("src, shapes", [
    # sum_t A_t @ B = (sum_t A_t) @ B
    ("kernel f(a: f32[T, M, K], b: f32[K, N]) -> f32[M, N] { return sum(a @ b, axis=0) }",
     ((17, 33, 113), (113, 17))),
    ("kernel f(a: f32[M, K], b: f32[T, K, N]) -> f32[M, N] { return sum(a @ b, axis=0) }",
     ((17, 113), (3, 113, 33))),
    ("kernel f(a: f32[B, H, M, K], b: f32[H, K, N]) -> f32[H, M, N] { return sum(a @ b, axis=0) }",
     ((3, 2, 17, 33), (2, 33, 17))),
])
def test_broadcast_batch_dims_of_one_operand(src, shapes):
    fn, _ = run_checked(src, *(randn(*s) for s in shapes), sm90=False)
    assert templates(fn) == ["matmul"]


@pytest.mark.parametrize("splits", [3, 5])
@pytest.mark.parametrize("t, k", [(17, 113), (3, 1000), (2, 17)])
def test_a_forced_split_is_correct_and_the_same_bits_every_run(splits, t, k):
    """The split ranges over the flattened (batch element, block of K) steps: with T = 2 and
    one block of K there are two steps, so at most two splits."""
    a, b = randn(t, 17, k), randn(t, k, 33)
    fn, _ = run_checked(f"@tile(SPLITS={splits})\n" + SUM.format(dt="f32"), a, b, sm90=False)
    assert templates(fn) == ["matmul"] and launches(fn) == SPLIT
    steps = t * -(-k // 128)  # the interpreter's K block is 128
    assert splits_run(fn) == {min(splits, steps)}
    same_bits_twice(fn, a, b)


def test_a_split_runs_the_epilogue_in_the_combine():
    src = """@tile(SPLITS=3)
    kernel f(a: f16[T, M, K], b: f16[K, N], bias: f16[N], s: f32) -> f16[M, N] {
        return cast(mean(a @ b, axis=0) * s + bias, f16)
    }"""
    args = randn(5, 17, 300, dtype=torch.float16), randn(300, 113, dtype=torch.float16), \
        randn(113, dtype=torch.float16)
    fn, _ = run_checked(src, *args, s=0.25)
    assert launches(fn) == SPLIT
    same_bits_twice(fn, *args, s=0.25)


def test_the_default_rule_splits_many_short_k_loops_of_one_tile():
    """M = N = 64, T = 64, K = 128 in the interpreter: one output tile of 64 x 64, 64 steps
    of one block of K each: sixteen splits of four steps."""
    a, b = randn(64, 64, 128), randn(64, 128, 64)
    fn, _ = run_checked(SUM.format(dt="f32"), a, b, sm90=False)
    assert launches(fn) == SPLIT and splits_run(fn) == {16}
    same_bits_twice(fn, a, b)


def test_refused_reductions_keep_their_remarks():
    def compiled(body: str, out: str = "M, N") -> tiledsl.Program:
        return tiledsl.compile(f"kernel f(a: f32[T, M, K], b: f32[T, K, N]) -> {body}")

    # a max over the batch is no sum the K loop can take: not a GEMM epilogue at all
    fn = compiled("f32[M, N] { return max(a @ b, axis=0) }")
    assert templates(fn) == ["matmul", "rows"]
    fn = compiled("f32[T, N] { return sum(a @ b, axis=1) }")
    assert templates(fn) == ["matmul", "rows"]
    assert any("a reduction of the product needs whole rows of the output" in r and "[rule: tile]" in r
               for r in refusals(fn))
    fn = compiled("f32[M, N] { return sum(exp(a @ b), axis=0) }")
    assert templates(fn) == ["matmul", "rows"]
    assert any("exp" in r and "[rule: tile]" in r for r in refusals(fn))
    fn = compiled("(f32[M, N], f32[T, M, N]) { p = a @ b\n return sum(p, axis=0), p }")
    assert templates(fn) == ["matmul", "rows"]
    assert any("is also used elsewhere" in r and "[rule: materialize]" in r for r in refusals(fn)), \
        refusals(fn)
    args = randn(3, 17, 33), randn(3, 33, 17)
    run_checked(fn, *args, sm90=False)


def test_a_second_product_of_the_same_a_keeps_its_batch():
    """Two products of one A, one summed over the batch and one returned whole: two GEMMs,
    the summed one with its batch loop; and a sum of two summed products, each its own."""
    src = """kernel f(a: f32[T, M, K], b: f32[T, K, N], c: f32[T, K, N]) -> (f32[M, N], f32[T, M, N]) {
        return sum(a @ b, axis=0), a @ c
    }"""
    args = randn(3, 17, 33), randn(3, 33, 17), randn(3, 33, 17)
    fn, _ = run_checked(src, *args, sm90=False)
    assert templates(fn) == ["matmul", "matmul"] and "batch_sums" in fn.ir("fused")
    src = """kernel f(a: f32[T, M, K], b: f32[T, K, N], c: f32[T, K, N]) -> f32[M, N] {
        return sum(a @ b, axis=0) + sum(a @ c, axis=0)
    }"""
    fn, _ = run_checked(src, *args, sm90=False)
    assert templates(fn) == ["matmul", "matmul"] and fn.ir("fused").count("batch_sums") == 2


def test_the_backward_is_correct():
    src = """kernel f(a: f32[T, M, K], b: f32[T, K, N], bias: f32[N]) -> f32[M, N] {
        return sum(a @ b, axis=0) * 0.5 + bias
    }"""
    fn = tiledsl.compile(src)
    report = check_grads(fn, randn(3, 17, 33), randn(3, 33, 17), randn(17))
    assert report.ok, report
    # the weight gradient of a batch-broadcast B is a batch sum of the backward's product
    fn = tiledsl.compile("kernel f(a: f32[T, M, K], b: f32[K, N]) -> f32[T, M, N] { return a @ b }")
    report = check_grads(fn, randn(3, 17, 33), randn(33, 17))
    assert report.ok, report
    assert all(t == "matmul" for t in templates(fn.backward))


# --- on a GPU, built for sm_90 without one ---------------------------------------------------

def test_the_default_rule_fills_every_sm_and_builds_without_spills():
    """M = N = 64, T = 256, K = 256 in f16 on an H100: one 64 x 64 tile and 1024 steps of a
    64-wide block of K: the K loop is shared by 264 programs, then a combine."""
    fn = tiledsl.compile(SUM.format(dt="f16"))
    dims = {"T": 256, "M": 64, "N": 64, "K": 256}
    launched = aot.meta_launches(fn, dims, {})
    assert [launch.kernel.fn_name for launch in launched] == ["k0_matmul", "k0_combine"]
    main = launched[0].kernel.launch_config(dict(launched[0].dims), "cuda")
    assert main.grid[0] >= 132 and main.constexprs["SPLITS"] > 1
    reports = aot.inspect_program(fn, dims, {})
    assert all(r.spill_bytes == 0 for r in reports), reports


def test_an_unsplit_summed_gemm_builds_without_spills():
    src = """kernel f(a: f16[T, M, K], b: f16[T, K, N], bias: f16[N]) -> f16[M, N] {
        return cast(gelu(sum(a @ b, axis=0) + bias), f16)
    }"""
    fn = tiledsl.compile(src)
    dims = {"T": 8, "M": 4096, "N": 4096, "K": 1024}
    (report,) = aot.inspect_program(fn, dims, {})
    assert report.config["SPLITS"] == 1 and report.spill_bytes == 0, report
