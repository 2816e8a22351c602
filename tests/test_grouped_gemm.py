"""Grouped GEMMs (issue "The compiler owns its intermediates"): a product of one row per token
times a matrix its index selects (`x[:, None, :] @ w[expert].T`, a token's expert or adapter
weight) takes the tokens as its rows, and a tile multiplies each index its rows hold (one or
two where the tokens are sorted by it) by that index's matrix: every weight tile is loaded
once a row tile, not once a token, and no gathered [T, K, N] weight is ever stored."""

from __future__ import annotations

import pytest
import torch

import tiledsl
from helpers import run_checked
from tiledsl.backends.triton import aot

GROUPED = """kernel expert_linear(x: bf16[T, K], w: bf16[E, N, K], expert: i64[T]) -> bf16[T, N] {
    return (x[:, None, :] @ transpose(w[expert], 1, 2))[:, 0, :]
}"""

# Switch Transformer's token-choice layer (top-1 routing, each token through its expert's MLP,
# scaled by its router probability), written with the gathered expert weights
SWITCH = """kernel switch_ffn(x: bf16[T, D], router: bf16[E, D], w_in: bf16[E, F, D],
                  w_out: bf16[E, D, F]) -> bf16[T, D] {
    probs = softmax(cast(x @ router.T, f32), axis=-1)
    gate = max(probs, axis=-1, keepdims=true)
    expert = argmax(probs, axis=-1)
    h = gelu((x[:, None, :] @ transpose(w_in[expert], 1, 2))[:, 0, :])
    y = (h[:, None, :] @ transpose(w_out[expert], 1, 2))[:, 0, :]
    return cast(cast(y, f32) * gate, bf16)
}"""

# Mixtral's expert MLP (SwiGLU) for each token's expert
MIXTRAL = """kernel mixtral_expert(x: bf16[T, D], w1: bf16[E, F, D], w3: bf16[E, F, D], w2: bf16[E, D, F],
                       expert: i64[T]) -> bf16[T, D] {
    xe = x[:, None, :]
    h = silu(xe @ transpose(w1[expert], 1, 2)) * (xe @ transpose(w3[expert], 1, 2))
    return (h @ transpose(w2[expert], 1, 2))[:, 0, :]
}"""

STRUCTURE = ("structure: grouped GEMM: a tile's rows are elements of T, and each value of take (line {line}) "
             "among them multiplies its rows by the B matrix it selects (one or two a tile where the rows "
             "are sorted by it): every B tile is loaded once a row tile")


def weights(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).bfloat16()


@pytest.mark.parametrize("t, e, n, k", [(1, 3, 8, 16), (17, 4, 33, 40), (113, 5, 20, 64), (200, 7, 48, 24)])
@pytest.mark.parametrize("order", ["sorted", "unsorted"])
def test_a_matrix_selected_per_token_is_a_grouped_gemm(t, e, n, k, order):
    """Sorted (a tile holds one or two experts) or not (a tile may hold them all): the same
    kernel, whose rows are the tokens, meets the f64 product."""
    g = torch.Generator().manual_seed(t * e)
    x, w = weights(t, k, seed=t), weights(e, n, k, seed=k)
    expert = torch.randint(0, e, (t,), generator=g)
    if order == "sorted":
        expert = expert.sort().values
    fn, out = run_checked(GROUPED, x, w, expert)
    assert [kn.template for kn in fn.kernels] == ["matmul"]
    assert "plan gemm {matmul = %r5, a = %a2, b = %r4 (prologue (%a1, %r0, %r1, %r2, %r3, %r4) on %a0), " \
        "grouped by %r1, epilogue = ()}" in fn.ir("lower-kernels")
    assert STRUCTURE.format(line=2) in fn.explain()
    want = torch.einsum("tk,tnk->tn", x.double(), w.double()[expert])
    torch.testing.assert_close(out.double(), want, rtol=2 ** -8, atol=2 ** -8 * want.abs().max().item())


@pytest.mark.parametrize("t", [1, 17, 113])
def test_a_switch_transformer_layer_is_four_kernels(t):
    """The router's GEMM, its row program (softmax, the top probability and its expert), and the
    two expert GEMMs grouped by the expert the row program stored, gelu and the gate in their
    epilogues: no expert weight gathered per token is stored."""
    x, router = weights(t, 24, seed=t), weights(5, 24, seed=1)
    w_in, w_out = weights(5, 40, 24, seed=2), weights(5, 24, 40, seed=3)
    fn, _ = run_checked(SWITCH, x, router, w_in, w_out)
    assert [kn.template for kn in fn.kernels] == ["matmul", "rows", "matmul", "matmul"]
    assert fn.explain().count("structure: grouped GEMM") == 2


@pytest.mark.parametrize("t", [1, 17, 113])
def test_mixtrals_expert_mlp_is_two_grouped_gemms(t):
    """SwiGLU over each token's expert: the gate and up projections are one grouped dual GEMM
    (both weights selected by the token's expert, one accumulator each, silu(g) * u its
    epilogue), the down projection a second. (It was an attention backward kernel reading
    every token's gathered weights, stored [T, F, D] by a kernel of their own.)"""
    x = weights(t, 24, seed=t)
    w1, w3, w2 = weights(5, 40, 24, seed=1), weights(5, 40, 24, seed=2), weights(5, 24, 40, seed=3)
    expert = torch.randint(0, 5, (t,), generator=torch.Generator().manual_seed(t)).sort().values
    fn, _ = run_checked(MIXTRAL, x, w1, w3, w2, expert)
    assert [kn.template for kn in fn.kernels] == ["matmul", "matmul"]
    assert fn.explain().count("structure: grouped GEMM") == 2
    assert "dual = %r8 with b = %r7 (prologue (%a1, %r0, %r1, %r2, %r3, %r7) on %a3), grouped by %r1" \
        in fn.ir("lower-kernels")


def test_a_dual_gemm_refuses_a_b_gathered_otherwise():
    """Two weights selected by different indices share no grouped GEMM's pass over the rows."""
    fn = tiledsl.compile("""kernel f(x: bf16[T, D], w1: bf16[E, F, D], w3: bf16[E, F, D], a: i64[T],
                                     b: i64[T]) -> bf16[T, 1, F] {
        xe = x[:, None, :]
        return silu(xe @ transpose(w1[a], 1, 2)) * (xe @ transpose(w3[b], 1, 2))
    }""")
    assert [kn.template for kn in fn.kernels] == ["matmul", "matmul"]
    assert ("a dual GEMM loads its B operands through their pointers, or selects both by the same index per "
            "row (a grouped GEMM's); this one gathers a B otherwise [rule: op]") in fn.explain()


def test_mixtrals_grouped_dual_gemm_fits_its_registers():
    """Both B tiles' addresses beside two accumulators: 128 x 64 tiles, no spills (24 bytes
    spilled at 128 x 128)."""
    fn = tiledsl.compile(MIXTRAL)
    dual, down = aot.inspect_program(fn, {"T": 4096, "E": 8, "F": 14336, "D": 4096})
    assert (dual.config["BLOCK_M"], dual.config["BLOCK_N"]) == (128, 64) and dual.spill_bytes == 0, dual
    assert down.spill_bytes == 0 and down.wgmma, down


@pytest.mark.parametrize("dims, grid", [({"T": 4096, "E": 8, "N": 14336, "K": 4096}, 32 * 112),
                                        ({"T": 16, "E": 8, "N": 14336, "K": 4096}, 14336 // 64)])
def test_a_grouped_gemm_tiles_the_tokens(dims, grid):
    """A program per tile of tokens and columns (not per token), on the tensor cores, no spills;
    never split along K."""
    fn = tiledsl.compile(GROUPED)
    (r,) = aot.inspect_program(fn, dims)
    assert r.grid == (grid,) and r.config["SPLITS"] == 1 and r.spill_bytes == 0, r
    assert r.wgmma if dims["T"] >= 128 else r.config["BLOCK_M"] == 16, r


# vLLM's multi-LoRA (punica's bgmv, `einsum("bi,boi->bo", x, w[indices])`) written with matmuls
MULTI_LORA = """kernel multi_lora(x: bf16[T, K], w: bf16[N, K], lora_a: bf16[L, R, K], lora_b: bf16[L, N, R],
                  indices: i64[T], scaling: f32) -> bf16[T, N] {
    shrunk = x[:, None, :] @ transpose(lora_a[indices], 1, 2)
    expanded = (shrunk @ transpose(lora_b[indices], 1, 2))[:, 0, :]
    return cast(cast(x @ w.T, f32) + cast(expanded, f32) * scaling, bf16)
}"""


@pytest.mark.parametrize("t", [1, 17, 113])
def test_multi_lora_shrink_and_expand_are_grouped_gemms(t):
    """The base GEMM, the shrink and the expand (the base product and the scaling its
    epilogue): vLLM's 3 launches, the adapters' matrices loaded once a tile of tokens."""
    x, w = weights(t, 64, seed=t), weights(48, 64, seed=1)
    a, b = weights(3, 16, 64, seed=2), weights(3, 48, 16, seed=3)
    indices = torch.randint(0, 3, (t,), generator=torch.Generator().manual_seed(t))
    fn, _ = run_checked(MULTI_LORA, x, w, a, b, indices, 0.5)
    assert [kn.template for kn in fn.kernels] == ["matmul", "matmul", "matmul"]
    assert fn.explain().count("structure: grouped GEMM") == 2


def test_an_expert_index_counts_from_the_end_and_one_out_of_range_reads_zero():
    """The language's gather semantics, kept where the matrix is read through its strides: -1
    is the last expert, an index outside [-E, E) reads 0."""
    x, w = weights(40, 16, seed=3), weights(3, 8, 16, seed=4)
    expert = torch.tensor([0, 1, 2, -1, -3, 3, 5, -4] * 5)
    fn = tiledsl.compile(GROUPED)
    out = fn(x, w, expert)
    wrapped = expert.where(expert >= 0, expert + 3)
    valid = (wrapped >= 0) & (wrapped < 3)
    want = torch.einsum("tk,tnk->tn", x.double(), w.double()[wrapped.clamp(0, 2)]) * valid[:, None]
    torch.testing.assert_close(out.double(), want, rtol=2 ** -8, atol=2 ** -8 * want.abs().max().item())
    assert "b_ptrs = in0_ptr + b_e * in0_s0" in fn.kernels[0].source  # through its strides, not a gather
