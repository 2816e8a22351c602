"""64-bit offsets: a tensor whose element offsets pass 2^31 is read and written correctly by
every template (issue 26's critical defect: `index * stride` computed in int32 wrapped, which
crashed the interpreter and, on a GPU, read out of bounds).

The inputs are `as_strided` views over one large `torch.empty` storage: its pages are only
reserved, and a test touches just the few rows its views cover, so no large allocation is
made. Each view's rows sit `FAR` elements apart, so row 2 starts past 2^31. A kernel gets
the per-call flag WIDE when some tensor it touches reaches past int32 (`launch.fits_int32`),
and then computes every index and offset in int64; the sm_90 build of that variant is
checked to do all its address arithmetic in 64 bits.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import tiledsl
from helpers import compile_for_sm90, gen, randn, run_checked
from tiledsl import testing
from tiledsl.backends.triton import aot
from tiledsl.backends.triton.launch import fits_int32, wide_at
from tiledsl.binding import BoundCall

FAR = 2**30 + 7  # a row stride: the third row of a view starts past 2^31 elements
SLOT = 4096  # elements of each row that one view owns: views never overlap
EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.fixture(scope="module")
def storage():
    """4 GB of f16, reserved but untouched (an overcommitting OS maps pages on first write)."""
    try:
        return torch.empty(2 * FAR + 16 * SLOT, dtype=torch.float16)
    except RuntimeError as err:  # an OS that does not overcommit cannot run these tests
        pytest.fail(f"cannot reserve 4 GB of address space for the far views: {err}")


class Far:
    """Views of `storage` whose rows are FAR elements apart, each at its own SLOT."""

    def __init__(self, storage: torch.Tensor) -> None:
        self.storage = storage
        self.next = 0

    def __call__(self, *shape: int, dtype=torch.float16) -> torch.Tensor:
        """A [3, *rest] view (row stride FAR, the rest contiguous) holding random values."""
        rows, *rest = shape
        assert rows <= 3 and dtype == torch.float16
        strides = [FAR, *torch.empty(rest).stride()]
        assert torch.Size(rest).numel() <= SLOT
        view = self.storage.as_strided(shape, strides, self.next * SLOT)
        self.next += 1
        view.copy_(randn(*shape, dtype=dtype))
        assert not fits_int32(view) and view.stride(0) == FAR
        return view


@pytest.fixture
def far(storage):
    return Far(storage)


def wide_flags(fn: tiledsl.Program) -> set:
    return {a.value for launch in fn.launches for a in launch.arguments if a.name == "WIDE"}


def test_pointwise_reads_past_2_31(far):
    x = far(3, 17)
    fn, _ = run_checked("kernel f(x: f16[M, N]) -> f32[M, N] { return exp(x) * 2.0 + x }", x)
    assert wide_flags(fn) == {True}


def test_pointwise_reads_a_transposed_view_past_2_31(far):
    x = far(3, 17)
    run_checked("kernel f(x: f16[N, M]) -> f32[N, M] { return sigmoid(x) - 1.0 }", x.T)


def test_rows_reduce_along_a_stride_past_2_31(far):
    """A sum over axis 0: the reduced axis is the far one (`r * stride` overflowed)."""
    x = far(3, 113)
    run_checked("kernel f(x: f16[M, N]) -> f32[N] { return sum(cast(x, f32), axis=0) }", x)


def test_rows_softmax_of_far_rows(far):
    x = far(3, 17)
    run_checked("kernel f(x: f16[M, N]) -> f16[M, N] { return softmax(x, axis=-1) }", x)


def test_gather_from_far_rows(far):
    """A gathered table and a cross-entropy's picked logits, both with far rows."""
    table, logits = far(3, 16), far(3, 113)
    ids = torch.tensor([2, 0, 2, 1, -1], dtype=torch.int32)
    run_checked("kernel f(t: f16[V, D], ids: i32[N]) -> f16[N, D] { return t[ids] }", table, ids)
    labels = torch.tensor([112, 5, 60], dtype=torch.int64)
    run_checked("""kernel ce(x: f16[M, V], y: i64[M]) -> f32[M] {
        return logsumexp(cast(x, f32)) - cast(gather(x, y), f32)
    }""", logits, labels)


def test_matmul_with_far_operands_and_epilogue(far):
    """A's rows, B^T's rows (a transposed operand) and an epilogue tensor all far apart."""
    a, bt, d = far(3, 64), far(3, 64), far(3, 3)
    run_checked("kernel f(a: f16[M, K], b: f16[K, N], d: f16[M, N]) -> f32[M, N] { return a @ b * d }",
                a, bt.T, d)


def test_dual_gemm_of_rank_4_with_far_rows(far):
    """SwiGLU's two GEMMs sharing A (a [1, 1, M, K] view whose rows are far apart), with 2-D
    weights: also the rank-4 dual GEMM whose batch index shadowed its second B tile."""
    x = far(3, 32)[None, None]
    wg, wu = randn(24, 32, dtype=torch.float16), randn(24, 32, dtype=torch.float16)
    fn, _ = run_checked("""kernel f(x: f16[A, B, S, D], wg: f16[F, D], wu: f16[F, D]) -> f16[A, B, S, F] {
        return silu(x @ wg.T) * (x @ wu.T)
    }""", x, wg, wu)
    assert [k.template for k in fn.kernel_ops()] == ["matmul"]


def test_dual_gemm_of_rank_4_with_2d_weights():
    """The bug found while writing acceptance tests: a rank-4 `x` and 2-D weights failed in
    the interpreter (`pointer<fp32> and float32`)."""
    x = randn(2, 3, 17, 16)
    fn, _ = run_checked("""kernel f(x: f32[A, B, S, D], wg: f32[F, D], wu: f32[F, D]) -> f32[A, B, S, F] {
        return silu(x @ wg.T) * (x @ wu.T)
    }""", x, randn(24, 16), randn(24, 16))
    assert [k.template for k in fn.kernel_ops()] == ["matmul"]


ATTENTION = """
kernel attn(q: f16[B, M, D], k: f16[B, N, D], v: f16[B, N, D]) -> f16[B, M, D] {
    s = q @ k.T * rsqrt(D)
    return softmax(where(causal(s), s, -inf)) @ v
}
"""


def test_attention_with_far_rows(far):
    """Queries, keys and values whose sequence positions are far apart (`rm * stride`)."""
    q, k, v = (far(3, 32)[None] for _ in range(3))
    fn, _ = run_checked(ATTENTION, q, k, v)
    assert [k.template for k in fn.kernel_ops()] == ["attention"]


def test_attention_backward_with_far_rows(far):
    """Gradients of q, k, v read through far views (the saved inputs keep their strides)."""
    # a kernel name of its own: the torch op runs the first program registered under a name
    fn = tiledsl.compile(ATTENTION.replace("attn(", "attn_far_backward("))
    q, k, v = (far(3, 32)[None] for _ in range(3))
    report = testing.check_grads(fn, q, k, v, generator=gen(0), as_given=True)
    assert report.ok, report
    training = fn.training(fn.differentiable)
    # the kernels reading q, k or v (not the backward's row sums of fresh tensors)
    assert True in wide_flags(training.forward) and True in wide_flags(training.backward)
    compile_for_sm90(training.backward)


def test_ordinary_calls_keep_32_bit_offsets():
    """The launcher proves an ordinary call fits: WIDE is off (the kernels' int32 path)."""
    fn, _ = run_checked(ATTENTION, *(randn(3, n, 32, dtype=torch.float16) for n in (17, 33, 33)))
    assert wide_flags(fn) == {False}


def test_fits_int32_measures_the_last_offset():
    meta = {"device": "meta", "dtype": torch.float16}
    assert fits_int32(torch.empty(2**31, **meta))
    assert not fits_int32(torch.empty(2**31 + 1, **meta))
    assert fits_int32(torch.empty(2**16, 2**15, **meta)[:, :8])  # a narrow slice of a big tensor
    assert not fits_int32(torch.empty(2**16, 2**16, **meta).T)
    assert fits_int32(torch.empty(1, **meta).expand(2**40))  # a broadcast reads one element
    assert fits_int32(torch.empty(0, 2**40, **meta).T)


def test_big_outputs_and_dims_near_2_31_take_64_bit_offsets():
    assert wide_at([((2**16, 2**15 + 1), None, None, None)], {})
    assert not wide_at([((2**16, 2**15), None, None, None)], {"N": 2**31 - 2**21})
    assert wide_at([((1,), None, None, None)], {"N": 2**31 - 1})


def test_an_output_past_2_31_elements_sets_the_flag():
    """Seen without allocating: the launches a call on meta tensors would make."""
    fn = tiledsl.compile("kernel f(x: f16[M, 1], y: f16[1, N]) -> f16[M, N] { return x * y }")
    (launch,) = fn.runtime.launches_at(BoundCall(
        [torch.empty(2**16, 1, dtype=torch.float16, device="meta"),
         torch.empty(1, 2**16, dtype=torch.float16, device="meta")],
        {"M": 2**16, "N": 2**16}, torch.device("meta")))
    assert [a.value for a in launch.arguments if a.name == "WIDE"] == [True]


# --- the sm_90 build of the 64-bit variant --------------------------------------------------


def offset_types(ttir: str) -> set[str]:
    """The integer types of every pointer offset (`tt.addptr`) in a kernel's TTIR."""
    types = set()
    for line in ttir.splitlines():
        if "tt.addptr" in line:
            offset = line.rsplit(":", 1)[1].rsplit(",", 1)[1]
            types.add(re.search(r"i\d+", offset.rsplit("x", 1)[-1]).group(0))
    return types


def widened(launch, tma: bool = True):
    """`launch` with 64-bit offsets (and, unless `tma`, its operands read through pointers)."""
    args = tuple(dataclasses.replace(a, value=True) if a.name == "WIDE" else
                 dataclasses.replace(a, value=False) if "_tma" in a.name and not tma else a
                 for a in launch.arguments)
    return dataclasses.replace(launch, arguments=args)


SIZES = {"B": 2, "H": 8, "KH": 2}


@pytest.mark.parametrize("name", ["attention", "gemm_multiply_multiply", "cross_entropy", "rope",
                                  "gqa_attention", "swiglu_mlp"])
def test_64_bit_kernels_compile_for_sm90_with_64_bit_addresses(name):
    """Each template's WIDE variant (for attention, the backward's kernels too) builds for an
    H100, and every pointer offset in it is i64."""
    fn = tiledsl.compile(EXAMPLES / f"{name}.tdsl")
    programs = [fn]
    if "attention" in name:
        programs.append(fn.backward)
    launches = [launch for p in programs
                for launch in aot.meta_launches(p, {d: SIZES.get(d, 64) for d in testing.needed_dims(p)})]
    assert {launch.kernel.kernel.template for launch in launches} >= (
        {"attention", "attention_backward", "rows"} if "attention" in name else {"matmul"}
        if "gemm" in name or "swiglu" in name else set())
    for launch in launches:
        ttir = aot.compile_launch(widened(launch, tma=False)).asm["ttir"]
        assert offset_types(ttir) == {"i64"}, launch.kernel.fn_name
        if any("_tma" in a.name and a.value for a in launch.arguments):  # descriptors: no offsets
            assert offset_types(aot.compile_launch(widened(launch)).asm["ttir"]) <= {"i64"}
