"""Programs and tiledsl.nn modules under torch.autocast: the op's Autocast kernel casts the
floating-point arguments as torch's autocast casts its own ops (`torch_op.autocast_args`):
a kernel that multiplies matrices runs in the autocast dtype, like torch's linear and
matmul; one that does not takes the widest of its arguments' dtypes; a declared dtype is
the one a parameter's tensor is cast to. Compared with torch's modules under the same
autocast, by the float64 oracle of the same casts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tiledsl
import tiledsl.nn as tnn
from helpers import randn

BF16 = torch.bfloat16


def within_twice_eager(ours: torch.Tensor, golden: torch.Tensor, eager: torch.Tensor) -> None:
    err = (ours.double() - golden).abs().max().item()
    yardstick = (eager.double() - golden).abs().max().item()
    assert err <= 2 * yardstick + 1e-5, (err, yardstick)


def test_swiglu_with_f32_weights_takes_a_bf16_activation_as_torchs_linear_layers_do():
    """A LlamaMLP of f32 weights under autocast(bf16) fed a bf16 activation (it raised a
    dtype-variable error): the GEMMs run in bf16, the gradients reach the f32 weights."""
    mlp = tnn.SwiGLU(48, 113)
    x = randn(2, 17, 48, dtype=BF16)
    g = randn(2, 17, 48)

    def torch_mlp(x, weights):
        gate, up, down = weights
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

    weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    xg = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=BF16):
        ours = mlp(xg)
        copies = [w.detach().clone().requires_grad_() for w in weights]
        xe = x.clone().requires_grad_()
        eager = torch_mlp(xe, copies)
    assert ours.dtype is BF16 and eager.dtype is BF16
    (ours.float() * g).sum().backward()
    (eager.float() * g).sum().backward()
    # golden: the same casts (bf16 operands), every product and sum in float64
    x64 = x.double().requires_grad_()
    w64 = [w.detach().to(BF16).double().requires_grad_() for w in weights]
    golden = torch_mlp(x64, w64)
    (golden * g.double()).sum().backward()
    within_twice_eager(ours, golden, eager)
    within_twice_eager(xg.grad, x64.grad, xe.grad)
    for w, e, g64 in zip(weights, copies, w64, strict=True):
        assert w.grad.dtype is torch.float32
        within_twice_eager(w.grad, g64.grad, e.grad)


def test_attention_with_a_bf16_query_and_f32_keys_runs_in_bf16_as_sdpa_does():
    attn = tnn.Attention()
    q = randn(2, 3, 17, 16, dtype=BF16)
    k, v = randn(2, 3, 33, 16), randn(2, 3, 33, 16)
    with torch.autocast("cpu", dtype=BF16):
        ours = attn(q, k, v)
        eager = F.scaled_dot_product_attention(q, k, v)
    assert ours.dtype is BF16
    golden = F.scaled_dot_product_attention(q.double(), k.to(BF16).double(), v.to(BF16).double())
    within_twice_eager(ours, golden, eager)


def test_a_kernel_without_a_matmul_takes_the_widest_dtype_and_a_declared_dtype_is_kept():
    scaled = tiledsl.compile("""
    kernel scaled[T: f16 | bf16 | f32](x: T[..., D], w: T[D]) -> T[..., D] {
        return x * w + 1.0
    }""")
    x, w = randn(5, 17, dtype=BF16), randn(17)
    with torch.autocast("cpu", dtype=BF16):
        out = scaled(x, w)
    assert out.dtype is torch.float32  # torch's promotion of bf16 and f32
    torch.testing.assert_close(out, x.float() * w + 1.0, rtol=0, atol=0)
    fixed = tiledsl.compile("""
    kernel fixed(a: f16[M, K], b: f16[N, K]) -> f32[M, N] {
        return a @ b.T
    }""")
    a, b = randn(17, 24), randn(5, 24)
    with torch.autocast("cpu", dtype=BF16):
        out = fixed(a, b)
    golden = a.half().double() @ b.half().double().T
    within_twice_eager(out, golden, (a.half().float() @ b.half().float().T))


def test_autocast_under_torch_compile_and_outside_it_nothing_is_cast():
    mlp = tnn.SwiGLU(16, 40)
    x = randn(3, 5, 16)
    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=BF16):
        traced, eager = compiled(x), mlp(x)
    assert traced.dtype is BF16
    torch.testing.assert_close(traced, eager, rtol=0, atol=0)
    assert mlp(x).dtype is torch.float32  # no autocast: the f32 program
