"""Type promotion (differential against torch.result_type), broadcasting, and sema's types."""

import itertools

import pytest
import torch

from tiledsl.ir import Op
from tiledsl.parser import parse
from tiledsl.sema import analyze
from tiledsl.types import (
    BroadcastMismatch,
    DType,
    TensorType,
    broadcast_shapes,
    promote_types,
    result_dtype,
)

TORCH = {DType.F16: torch.float16, DType.BF16: torch.bfloat16, DType.F32: torch.float32,
         DType.I8: torch.int8, DType.U8: torch.uint8, DType.I16: torch.int16, DType.I32: torch.int32,
         DType.I64: torch.int64, DType.BOOL: torch.bool}
FROM_TORCH = {v: k for k, v in TORCH.items()}
PY_SCALAR = {DType.F32: 0.5, DType.I32: 3, DType.BOOL: True}


def torch_operand(t: TensorType):
    if t.weak:
        return PY_SCALAR[t.dtype]
    return torch.ones((2,) * t.rank, dtype=TORCH[t.dtype])  # result_type reads only dtypes and ranks


# f8 values never promote (torch refuses; tiledsl asks for a cast): left out
PROMOTING = [d for d in DType if not d.is_f8]
KINDS = [TensorType(d, ("N",)) for d in PROMOTING] + [TensorType(d, ()) for d in PROMOTING] + [
    TensorType(d, (), True) for d in (DType.F32, DType.I32, DType.BOOL)]


# (two Python scalars have no tensor operation in torch to compare with)
@pytest.mark.parametrize("a, b", [(a, b) for a, b in itertools.product(KINDS, KINDS)
                                  if not (a.weak and b.weak)])
def test_result_dtype_matches_torch(a, b):
    expected = FROM_TORCH[torch.result_type(torch_operand(a), torch_operand(b))]
    if expected is DType.I64 and DType.I64 not in (a.dtype, b.dtype):
        expected = DType.I32  # an integer literal is an i32 (torch's Python ints are int64)
    assert result_dtype((a, b)) is expected


def test_promote_types_table():
    assert promote_types(DType.F16, DType.BF16) is DType.F32
    assert promote_types(DType.I32, DType.F16) is DType.F16
    assert promote_types(DType.BOOL, DType.I32) is DType.I32
    assert promote_types(DType.I32, DType.I64) is DType.I64
    assert promote_types(DType.I64, DType.BF16) is DType.BF16


def test_broadcast_shapes():
    assert broadcast_shapes(("M", "N"), ("N",)) == ("M", "N")
    assert broadcast_shapes(("M", 1), (1, "N")) == ("M", "N")
    assert broadcast_shapes(("B", 1, "M", "N"), ("H", 1, 1)) == ("B", "H", "M", "N")
    assert broadcast_shapes((), ("N",)) == ("N",)
    with pytest.raises(BroadcastMismatch) as info:
        broadcast_shapes(("M", "N"), ("N", "M"))
    assert (info.value.dim, info.value.a, info.value.b) == (0, "M", "N")
    with pytest.raises(BroadcastMismatch):
        broadcast_shapes((16,), (17,))


def types_of(src: str) -> list[str]:
    g = analyze(parse(src).kernels[0])
    return [f"{g.op(n).kind}:{g.op(n).type}" for n in g.topo_order()
            if isinstance(g.op(n), Op) and g.op(n).kind not in ("param", "return", "const", "dim")]


def test_sema_infers_types_like_torch():
    assert types_of("""
    kernel f(x: f16[M, N], b: bf16[N], s: f32, i: i32[M, 1]) -> f32[M, N] {
        y = x * s            # a 0-dim f32 does not promote an f16 tensor
        z = y + b            # f16 + bf16 -> f32, computed y read at its f16 value
        w = i / 2            # true division of ints -> f32
        return z * w
    }""") == ["mul:f16[M, N]", "cast:f16[M, N]", "add:f32[M, N]", "div:f32[M, 1]", "mul:f32[M, N]"]


def test_sema_reads_a_computed_half_value_a_wider_op_promotes_at_its_dtype():
    """torch promotes a 16-bit value; a kernel holds it in f32 and rounds it only where it
    stores or casts it, so sema reads it through a cast to its own type (in `y + s`,
    `s > y` and the f32 `where`). Not a parameter or a view of one, an operand compared in
    its own type (`s > 1.0`), or an explicit cast, which widens the value held."""
    assert types_of("""
    kernel f(x: bf16[M, N], y: f32[M, N], z: bf16[N]) -> (f32[M, N], bool[M, N], bool[M, N], f32[M, N],
                                                        f32[M, N]) {
        s = x * 2.0
        return y + s, s > y, s > 1.0, where(x > 0.0, y, s), cast(s, f32) + x + z[None, :]
    }""") == ["mul:bf16[M, N]", "cast:bf16[M, N]", "add:f32[M, N]", "cast:bf16[M, N]", "gt:bool[M, N]",
              "gt:bool[M, N]", "gt:bool[M, N]", "cast:bf16[M, N]", "where:f32[M, N]", "cast:f32[M, N]",
              "add:f32[M, N]", "slice:bf16[1, N]", "add:f32[M, N]"]


def test_sema_literal_and_dim_values_are_weak():
    assert types_of("""
    kernel f(x: f16[M, N]) -> f16[M, N] {
        return x / N * 0.5 + rsqrt(N)
    }""") == ["div:f16[M, N]", "mul:f16[M, N]", "rsqrt:weak f32", "add:f16[M, N]"]


def test_sema_reductions_and_layout():
    assert types_of("""
    kernel f(x: f16[B, M, N], m: bool[M, N], i: i32[N]) -> f16[B, N, M] {
        a = sum(x, axis=1)
        b = max(x, keepdims=true)
        c = logsumexp(i)
        d = sum(m, axis=0)
        e = softmax(x, axis=0)
        return transpose(e, 1, 2)
    }""") == ["sum:f16[B, N]", "max:f16[B, M, 1]", "logsumexp:f32", "sum:i32[N]",
              "softmax:f16[B, M, N]", "transpose:f16[B, N, M]"]


def test_sema_matmul_broadcasts_batch_dims_and_promotes():
    assert types_of("""
    kernel f(a: f16[B, 1, M, K], b: f32[H, K, N]) -> f32[B, H, M, N] {
        return a @ b
    }""") == ["matmul:f32[B, H, M, N]"]


def test_causal_lowers_to_index_comparison():
    assert types_of("""
    kernel f(s: f32[B, M, N]) -> bool[B, M, N] {
        return causal(s)
    }""") == ["index:i32[B, M, N]", "index:i32[B, M, N]", "ge:bool[B, M, N]"]


def test_implicit_cast_on_return():
    assert types_of("""
    kernel f(a: f32[N]) -> f16[N] {
        return a * 2
    }""") == ["mul:f32[N]", "cast:f16[N]"]
