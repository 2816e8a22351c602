"""Unit views (a reshape or slice that only drops or inserts size-1 dims) sink below the
elementwise ops reading them (passes/sink_reshape.py): the ops are computed in the view's
source shape, their other operands viewed so too, and join the kernel computing it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tiledsl
from helpers import randn, run_checked

# as model code writes a training batch norm with running statistics (attorch, timm)
BATCH_NORM = """
kernel bn(x: f32[B, C, S], weight: f32[C], bias: f32[C], running_mean: f32[C], running_var: f32[C],
          momentum: f32, eps: f32) -> (f32[B, C, S], f32[C], f32[C]) {
    mu = mean(x, axis=(0, 2), keepdims=true)
    xc = x - mu
    var = mean(xc * xc, axis=(0, 2), keepdims=true)
    y = weight[:, None] * xc * rsqrt(var + eps) + bias[:, None]
    n = B * S
    new_mean = (1.0 - momentum) * running_mean + momentum * mu[0, :, 0]
    new_var = (1.0 - momentum) * running_var + momentum * var[0, :, 0] * n / (n - 1)
    return y, new_mean, new_var
}"""


@pytest.mark.parametrize("b, c, s", [(2, 1, 17), (4, 24, 37), (3, 113, 5)])
def test_batch_norm_running_statistics_are_one_kernel(b, c, s):
    fn = tiledsl.compile(BATCH_NORM)
    assert len(fn.kernels) == 1, fn.explain()
    x = randn(b, c, s, seed=1, scale=2.0) + 0.5
    w, bias, rm, rv = randn(c, seed=2), randn(c, seed=3), randn(c, seed=4, scale=0.1), randn(c, seed=5).abs() + 0.5
    y, new_mean, new_var = run_checked(fn, x, w, bias, rm, rv, 0.1, 1e-5, sm90=False)[1]
    rm_ref, rv_ref = rm.double().clone(), rv.double().clone()
    y_ref = F.batch_norm(x.double(), rm_ref, rv_ref, w.double(), bias.double(), training=True,
                         momentum=0.1, eps=1e-5)
    torch.testing.assert_close(y.double(), y_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(new_mean.double(), rm_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(new_var.double(), rv_ref, rtol=0, atol=1e-5)
    remarks = [line for line in fn.explain().splitlines() if "[sink-reshape] fused: slice (line 9)" in line]
    assert remarks and "its other operands viewed in that shape" in remarks[0]


def test_a_per_row_value_read_through_a_dropped_dim_joins_its_row_program():
    """`logsumexp(x, -1, keepdims)[:, 0]` scaled by a per-row weight: one row kernel; the
    weight and its elementwise op are computed in the [M, 1] shape."""
    fn = tiledsl.compile("""kernel f(x: f32[M, N], w: f32[M], t: f32) -> f32[M] {
        lse = logsumexp(x, axis=-1, keepdims=true)
        return lse[:, 0] * (w * t + 1.0)
    }""")
    assert [k.template for k in fn.kernels] == ["rows"], fn.explain()
    run_checked(fn, randn(113, 17), randn(113), 0.5, sm90=False)


def test_a_slice_that_is_not_a_unit_view_stays_a_gather():
    """`s[:, 1:]` drops elements: not a unit view (the kernels stay as they were)."""
    fn = tiledsl.compile("""kernel f(x: f32[M, N], w: f32[M]) -> f32[M] {
        s = sum(x, axis=-1, keepdims=true)
        c = concat(s, s, axis=1)
        return c[:, 1] * w
    }""")
    run_checked(fn, randn(17, 9), randn(17), sm90=False)
    assert "viewed in that shape" not in fn.explain()
