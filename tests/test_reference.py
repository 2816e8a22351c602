"""The reference backend: torch semantics, the float64 golden mode, and the numerics contract."""

import pytest
import torch
import torch.nn.functional as F

import tiledsl
from helpers import randn


def ref(src: str, *args, float64: bool = False, **kw):
    return tiledsl.compile(src, backend="reference")(*args, **kw) if not float64 else \
        tiledsl.compile(src, backend="reference").reference(*args, float64=True, **kw)


def test_reference_backend_matches_torch_eager():
    x, w, b = randn(17, 33, dtype=torch.float16), randn(19, 33, dtype=torch.float16), randn(19, dtype=torch.float16)
    out = ref("kernel f(x: f16[M, K], w: f16[N, K], b: f16[N]) -> f16[M, N] { return gelu(x @ w.T + b) }",
              x, w, b)
    expected = F.gelu(x @ w.T + b)
    assert out.dtype == torch.float16
    assert torch.equal(out, expected)


def test_python_scalars_do_not_promote_like_in_torch():
    x = randn(17, 113, dtype=torch.float16)
    out = ref("kernel f(x: f16[M, N]) -> f16[M, N] { return x * 0.1 + 3 }", x)
    assert torch.equal(out, x * 0.1 + 3)


def test_float64_mode_computes_in_float64():
    x = randn(17, 113, dtype=torch.float16)
    gold = ref("kernel f(x: f16[M, N]) -> f16[M, N] { return exp(x) * 0.1 }", x, float64=True)
    assert gold.dtype == torch.float64
    assert torch.allclose(gold, torch.exp(x.double()) * 0.1, rtol=0, atol=0)


def test_softmax_of_fully_masked_row_is_zero_not_nan():
    x = randn(3, 7)
    x[1] = float("-inf")
    for float64 in (False, True):
        out = ref("kernel f(x: f32[M, N]) -> f32[M, N] { return softmax(x) }", x, float64=float64)
        assert (out[1] == 0).all() and not out.isnan().any()
        assert torch.allclose(out[0].float(), torch.softmax(x[0], 0))


def test_integer_sum_is_i32():
    i = torch.randint(-9, 9, (5, 7), dtype=torch.int32)
    out = ref("kernel f(i: i32[M, N]) -> i32[M] { return sum(i) }", i)
    assert out.dtype == torch.int32 and torch.equal(out, i.sum(1).int())


def test_reference_runs_the_fused_graph_like_the_graph_ir():
    src = "kernel f(x: f32[M, N], s: f32) -> f32[M] { return logsumexp(x * s + N) }"
    x = randn(17, 113)
    fn = tiledsl.compile(src, backend="reference")
    # __call__ evaluates the fused IR (kernel regions); .reference evaluates the graph IR
    assert torch.equal(fn(x, 0.5), fn.reference(x, s=0.5))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_forms(approximate):
    x = randn(113)
    out = ref(f'kernel f(x: f32[N]) -> f32[N] {{ return gelu(x, approximate="{approximate}") }}', x)
    assert torch.equal(out, F.gelu(x, approximate=approximate))

