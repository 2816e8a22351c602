"""Recompute and merge (issue 27): independent pointwise and row kernels over different
iteration spaces as one launch (the merged template), and broadcast producers (a gate, RoPE's
cos and sin computed from positions) computed again by their readers. Numerics by the float64
oracle at awkward sizes, with exact kernel counts."""

from __future__ import annotations

import pytest
import torch

import tiledsl
from tests.helpers import SIZES, randn, run_checked


def structure(fn) -> list[str]:
    return [k.template for k in fn.kernels]


QK_NORM = """
kernel qk_norm(q: f32[2, {s}, 6, 64], k: f32[2, {s}, 2, 64], wq: f32[64], wk: f32[64],
               eps: f32) -> (f32[2, {s}, 6, 64], f32[2, {s}, 2, 64]) {{
    qn = q * rsqrt(mean(q * q, axis=-1, keepdims=true) + eps) * wq
    kn = k * rsqrt(mean(k * k, axis=-1, keepdims=true) + eps) * wk
    return qn, kn
}}
"""


@pytest.mark.parametrize("s", SIZES)
def test_q_norm_and_k_norm_with_different_head_counts_are_one_launch(s):
    fn = tiledsl.compile(QK_NORM.format(s=s))
    assert structure(fn) == ["merged"]
    plan = fn.fused_graph().op(fn.fused_graph().kernels()[0]).plan
    assert [(m.plan.template, m.plan.shape) for m in plan.members] == [("rows", (2, s, 6, 64)),
                                                                        ("rows", (2, s, 2, 64))]
    run_checked(fn, randn(2, s, 6, 64), randn(2, s, 2, 64), randn(64), randn(64), eps=1e-6)
    assert ("[fuse-horizontal] fused: mul (line 4) -> mul (line 5): 2 kernels over different iteration "
            f"spaces ([2, {s}, 6, 64] rows along axis 3, [2, {s}, 2, 64] rows along axis 3) as one launch, "
            "its programs partitioned among them: 1 launch fewer") in fn.explain()


ROPE = """
kernel rope(q: f32[B, S, H, D], k: f32[B, S, KH, D], pos: i32[S]) -> (f32[B, S, H, D], f32[B, S, KH, D]) {
    inv_freq = 10000.0 ** (-2.0 * cast(index(q[0, 0, 0, :], 0) % (D // 2), f32) / D)
    ang = cast(pos, f32)[:, None] * inv_freq
    c = cos(ang)[:, None]
    s = sin(ang)[:, None]
    qr = q * c + concat(-q[..., D // 2:], q[..., :D // 2], axis=-1) * s
    kr = k * c + concat(-k[..., D // 2:], k[..., :D // 2], axis=-1) * s
    return qr, kr
}
"""


@pytest.mark.parametrize("s", SIZES)
def test_rope_of_q_and_k_with_fewer_key_heads_is_one_kernel_computing_its_tables(s):
    fn = tiledsl.compile(ROPE)
    # cos and sin are computed from the positions by the one launch, never stored
    assert structure(fn) == ["merged"]
    pos = torch.arange(s, dtype=torch.int32) + 3
    run_checked(fn, randn(2, s, 6, 32), randn(2, s, 2, 32), pos)
    rewrites = fn.explain().split("rewrites:\n")[1].split("\n\n")[0].splitlines()
    # cos(ang)[:, None] is a slice of a value computed from positions: sema reads it through
    # (computed at each element that reads it), so no table is stored or recomputed by a pass
    assert rewrites == ["  [fuse-horizontal] fused: floordiv (line 3) -> floordiv (line 3): 2 kernels over "
                        "different iteration spaces ([B, S, H, D], [B, S, KH, D]) as one launch, its "
                        "programs partitioned among them: 1 launch fewer"]


LOSS = """
kernel loss_terms(a: f32[{m}, 48], t: f32[{m}, 48], b: f32[{m}, 7, 20],
                  c: f32[5, {m}]) -> (f32[{m}], f32[{m}, 7], f32[{m}]) {{
    na = a * rsqrt(mean(a * a, axis=-1, keepdims=true) + 1e-6)
    nb = b - mean(b, axis=-1, keepdims=true)
    nc = softmax(c, axis=0)
    return sum(na * t, axis=-1), sum(nb * nb, axis=-1), sum(nc * c, axis=0)
}}
"""


@pytest.mark.parametrize("m", SIZES)
def test_several_row_normalizations_of_one_loss_share_a_launch(m):
    fn = tiledsl.compile(LOSS.format(m=m))
    run_checked(fn, randn(m, 48), randn(m, 48), randn(m, 7, 20), randn(5, m))
    # three row programs over different spaces (launch-bound at these sizes): one launch
    assert structure(fn) == ["merged"]
    plan = fn.fused_graph().op(fn.fused_graph().kernels()[0]).plan
    assert [(p.plan.shape, p.plan.axes) for p in plan.members] == [((m, 48), (1,)), ((m, 7, 20), (2,)),
                                                                     ((5, m), (0,))]


def test_kernels_that_share_no_input_at_unknown_sizes_are_not_merged():
    fn, _ = run_checked("kernel f(x: f32[M, N], y: f32[N]) -> (f32[M, N], f32[N]) { return exp(x), sin(y) }",
                        randn(17, 113), randn(113))
    assert structure(fn) == ["pointwise", "pointwise"]
    assert not [r for r in fn.remarks if r.pass_name == "fuse-horizontal"]


def test_a_launch_past_the_op_limit_is_refused_with_its_rule():
    chain = "".join("    a = sin(a) + x\n" for _ in range(130))  # 260 ops
    fn, _ = run_checked(f"""
kernel f(x: f32[4, 3], z: f32[5, 4, 3]) -> (f32[4, 3], f32[5, 4, 3]) {{
    a = x
{chain}    return a, exp(x + z)
}}""", randn(4, 3, scale=0.1), randn(5, 4, 3))
    assert structure(fn) == ["pointwise", "pointwise"]
    assert [str(r) for r in fn.remarks if r.pass_name == "fuse-horizontal"] == [
        "[fuse-horizontal] refused: sin (line 4) -> add (line 134): the merged launch would exceed 256 ops "
        "[rule: profit]"]


GATE = """
kernel gated(g: f32[B, D], x: f32[B, D, N], bias: f32[D]) -> f32[B, D, N] {
    gate = sigmoid(g + bias)
    return x * gate[:, :, None]
}
"""


@pytest.mark.parametrize("b, d, n", [(1, 1, 1), (3, 17, 113), (2, 113, 17)])
def test_a_broadcast_gate_is_recomputed_by_its_reader(b, d, n):
    fn, _ = run_checked(GATE, randn(b, d), randn(b, d, n), randn(d))
    assert structure(fn) == ["pointwise"]
    assert [str(r) for r in fn.remarks if r.fused] == [
        "[recompute] fused: sigmoid (line 3) -> slice (line 4): computed again at the elements of its slice "
        "[:B, :D, None] (5 operation units per element, within 16) from slices of its operands, instead of "
        "read through a slice of a stored [B, D]",
        "[recompute] fused: sigmoid (line 3) -> mul (line 4): computed again at each [B, D, N] element of its "
        "reader (5 operation units per element, within 16) instead of stored as [B, D, 1] by a kernel of its own"]


def test_merged_row_members_flag_their_row_layouts_apart():
    """Each member of a merged launch takes its own `RowsFlat` flags (named for the member:
    two members may read one tensor along different row dims); a member whose input is a
    transposed view takes the per-dim indices, the other the flat row index."""
    fn = tiledsl.compile("""kernel f(x: f32[B, M, N], y: f32[B, N, M]) -> (f32[B, M, 1], f32[B, N, 1]) {
        return sum(x, axis=-1, keepdims=true), sum(y * 2.0, axis=-1, keepdims=true)
    }""")
    (kernel,) = fn.kernels
    assert kernel.template == "merged"
    # (member 1's own input 0 is the launch's y)
    assert "m0_in0_flat: tl.constexpr" in kernel.source and "m1_in0_flat: tl.constexpr" in kernel.source
    x = randn(2, 17, 33, seed=1)
    run_checked(fn, x, randn(2, 33, 17, seed=2))
    run_checked(fn, x, randn(2, 17, 33, seed=3).transpose(1, 2), sm90=False)
