"""Flash attention, forward and backward, after the design of Triton's tutorial
06-fused-attention.py (Flash Attention v2), written for these benchmarks.

Forward (`_attn_fwd`, the tutorial's TMA variant): one program per BLOCK_M queries of one
(batch, head), Q kept on chip, K and V read by tensor descriptors (here made on the device:
3-d over [B*H, N, D], so a block never crosses into the next head and rows past the end
arrive as zeros); the softmax scale and log2(e) are folded into one multiply and exp2 is
the only transcendental per score (the running max is taken of the raw scores and scaled
once, as the tutorial does). Causal attention (top-left aligned: query i sees keys j <= i)
runs the key blocks left of the diagonal without a mask and the diagonal band with one; a
ragged last key block is masked the same way. It stores O and the base-2 log-sum-exp of each
row for the backward. SOFTCAP scores `cap * tanh(s / cap)` with one `tanh.approx.f32`
(inline PTX: it compiles, but the interpreter cannot run it) and 1/cap folded into the scale.

Backward, three kernels as the tutorial's (it fuses dK/dV and dQ into one launch; here
they are two kernels, so each is compared with its counterpart):
  `_attn_bwd_preprocess`  delta_i = sum_d O_id dO_id;
  `_attn_bwd_dkdv`        one program per BLOCK_N keys, K and V on chip, looping over query
                          blocks: S^T = K Q^T directly (K pre-scaled by scale*log2 e once),
                          P^T = exp2(S^T - lse), dV += P^T dO, dP^T = V dO^T,
                          dS^T = P^T (dP^T - delta), dK += dS^T Q;
  `_attn_bwd_dq`          one program per BLOCK_M queries, looping over key blocks:
                          dQ += dS K (Q pre-scaled instead of K).
Unmasked blocks come first in each kernel, so the hottest loop of a build is the unmasked
one. Contiguous [B, H, L, D] tensors; the tutorial's block sizes (and its warps, but at
D=128 in the backward, see `backward_warps`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sm90 import Build, launch

LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, k_desc, v_desc, bh, offs_m, lo, hi, N_CTX, qk_scale, cap_scale,
                cap_log2, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = k_desc.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, k.T)
        if SOFTCAP:  # log2(e) * cap * tanh(s * scale / cap)
            qk = _tanh(qk * cap_scale) * cap_log2
            scale = 1.0
        else:
            scale = qk_scale
        if MASKED:
            keep = (start_n + offs_n)[None, :] < N_CTX
            if CAUSAL:
                keep = keep & ((start_n + offs_n)[None, :] <= offs_m[:, None])
            qk = qk * scale + tl.where(keep, 0, -1.0e6)
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_ij[:, None]
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * scale)
            qk = qk * scale - m_ij[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = v_desc.load([bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _heads_desc(T, BH, CTX, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """A TMA descriptor over [batch x heads, CTX, HEAD_DIM] contiguous rows, BLOCK at a time."""
    return tl.make_tensor_descriptor(T, shape=[BH, CTX, HEAD_DIM], strides=[CTX * HEAD_DIM, HEAD_DIM, 1],
                                     block_shape=[1, BLOCK, HEAD_DIM])


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, sm_scale, cap, M_CTX, N_CTX, HEAD_DIM: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              SOFTCAP: tl.constexpr):
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    BH = tl.num_programs(1)
    q_desc = _heads_desc(Q, BH, M_CTX, HEAD_DIM, BLOCK_M)
    o_desc = _heads_desc(O, BH, M_CTX, HEAD_DIM, BLOCK_M)
    k_desc = _heads_desc(K, BH, N_CTX, HEAD_DIM, BLOCK_N)
    v_desc = _heads_desc(V, BH, N_CTX, HEAD_DIM, BLOCK_N)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp(x) = exp2(x log2 e)
    cap_scale = sm_scale / cap
    cap_log2 = cap * 1.4426950408889634
    q = q_desc.load([bh, start_m * BLOCK_M, 0]).reshape(BLOCK_M, HEAD_DIM)
    # key blocks every query of this block sees whole, then the masked rest
    full = N_CTX // BLOCK_N * BLOCK_N
    if CAUSAL:
        full = tl.minimum(start_m * BLOCK_M, full)
        end = tl.minimum((start_m + 1) * BLOCK_M, N_CTX)
    else:
        end = N_CTX
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_desc, v_desc, bh, offs_m, 0, full, N_CTX, qk_scale,
                                cap_scale, cap_log2, HEAD_DIM, BLOCK_N, False, CAUSAL, SOFTCAP)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_desc, v_desc, bh, offs_m, full, end, N_CTX, qk_scale,
                                cap_scale, cap_log2, HEAD_DIM, BLOCK_N, True, CAUSAL, SOFTCAP)
    acc = acc / l_i[:, None]
    tl.store(LSE + bh * M_CTX + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < M_CTX)
    o_desc.store([bh, start_m * BLOCK_M, 0], acc.to(O.dtype.element_ty).reshape(1, BLOCK_M, HEAD_DIM))


@triton.jit
def _attn_bwd_preprocess(O, DO, DELTA, M_CTX, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (bh * M_CTX + offs_m).to(tl.int64)
    inside = offs_m[:, None] < M_CTX
    o = tl.load(O + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=inside, other=0.0)
    do = tl.load(DO + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=inside, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh * M_CTX + offs_m, delta, mask=offs_m < M_CTX)


@triton.jit
def _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, offs_n, lo, hi, M_CTX, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in tl.range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qT_ptrs = Q + offs_m[None, :] * HEAD_DIM + offs_d[:, None]
        do_ptrs = DO + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
        if MASKED:
            inside = offs_m < M_CTX
            qT = tl.load(qT_ptrs, mask=inside[None, :], other=0.0)
            lse = tl.load(LSE + offs_m, mask=inside, other=0.0)
        else:
            qT = tl.load(qT_ptrs)
            lse = tl.load(LSE + offs_m)
        sT = tl.dot(k, qT)  # S^T, scaled by scale * log2(e) through K
        pT = tl.math.exp2(sT - lse[None, :])
        if MASKED:
            keep = inside[None, :]
            if CAUSAL:
                keep = keep & (offs_m[None, :] >= offs_n[:, None])
            pT = tl.where(keep, pT, 0.0)
            do = tl.load(do_ptrs, mask=inside[:, None], other=0.0)
            delta = tl.load(DELTA + offs_m, mask=inside, other=0.0)
        else:
            do = tl.load(do_ptrs)
            delta = tl.load(DELTA + offs_m)
        dv += tl.dot(pT.to(do.dtype), do)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT))
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, sm_scale, M_CTX, N_CTX, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    tl.static_assert(BLOCK_N % BLOCK_M == 0)
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    Q += bh * M_CTX * HEAD_DIM
    DO += bh * M_CTX * HEAD_DIM
    LSE += bh * M_CTX
    DELTA += bh * M_CTX
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv = (bh * N_CTX + offs_n)[:, None] * HEAD_DIM + offs_d[None, :]
    inside = offs_n[:, None] < N_CTX
    k = tl.load(K + kv, mask=inside, other=0.0)
    v = tl.load(V + kv, mask=inside, other=0.0)
    k = (k * (sm_scale * 1.4426950408889634)).to(k.dtype)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    full = M_CTX // BLOCK_M * BLOCK_M
    if CAUSAL:  # queries below the diagonal band see these keys whole
        lo = start_n + BLOCK_N
    else:
        lo = 0
    dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, offs_n, lo, full, M_CTX, HEAD_DIM, BLOCK_M,
                          False, CAUSAL)
    if CAUSAL:  # the diagonal band
        dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, offs_n, start_n,
                              tl.minimum(start_n + BLOCK_N, M_CTX), M_CTX, HEAD_DIM, BLOCK_M, True, CAUSAL)
    # a ragged last query block
    dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, offs_n, tl.maximum(lo, full), M_CTX, M_CTX,
                          HEAD_DIM, BLOCK_M, True, CAUSAL)
    tl.store(DV + kv, dv.to(DV.dtype.element_ty), mask=inside)
    tl.store(DK + kv, (dk * sm_scale).to(DK.dtype.element_ty), mask=inside)


@triton.jit
def _dq_blocks(dq, q, do, lse, delta, K, V, offs_m, lo, hi, N_CTX, HEAD_DIM: tl.constexpr,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT_ptrs = K + offs_n[None, :] * HEAD_DIM + offs_d[:, None]
        vT_ptrs = V + offs_n[None, :] * HEAD_DIM + offs_d[:, None]
        if MASKED:
            inside = offs_n[None, :] < N_CTX
            kT = tl.load(kT_ptrs, mask=inside, other=0.0)
            vT = tl.load(vT_ptrs, mask=inside, other=0.0)
        else:
            kT = tl.load(kT_ptrs)
            vT = tl.load(vT_ptrs)
        s = tl.dot(q, kT)  # scaled by scale * log2(e) through Q
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            keep = inside
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, vT)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT))
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, sm_scale, M_CTX, N_CTX, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    K += bh * N_CTX * HEAD_DIM
    V += bh * N_CTX * HEAD_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (bh * M_CTX + offs_m)[:, None] * HEAD_DIM + offs_d[None, :]
    inside = offs_m < M_CTX
    q = tl.load(Q + rows, mask=inside[:, None], other=0.0)
    do = tl.load(DO + rows, mask=inside[:, None], other=0.0)
    lse = tl.load(LSE + bh * M_CTX + offs_m, mask=inside, other=0.0)
    delta = tl.load(DELTA + bh * M_CTX + offs_m, mask=inside, other=0.0)
    q = (q * (sm_scale * 1.4426950408889634)).to(q.dtype)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full = N_CTX // BLOCK_N * BLOCK_N
    if CAUSAL:  # keys left of the diagonal band are seen whole
        full = tl.minimum(start_m, full)
        end = tl.minimum(start_m + BLOCK_M, N_CTX)
    else:
        end = N_CTX
    dq = _dq_blocks(dq, q, do, lse, delta, K, V, offs_m, 0, full, N_CTX, HEAD_DIM, BLOCK_N, False, CAUSAL)
    dq = _dq_blocks(dq, q, do, lse, delta, K, V, offs_m, full, end, N_CTX, HEAD_DIM, BLOCK_N, True, CAUSAL)
    tl.store(DQ + rows, (dq * sm_scale).to(DQ.dtype.element_ty), mask=inside[:, None])


# the tutorial's backward blocks: dK/dV over 128 keys in steps of 32 queries, dQ over 128
# queries in steps of 32 keys, 5 stages; its preprocess over 128 rows
BWD = {"dkdv": (32, 128), "dq": (128, 32), "stages": 5, "pre_block": 128}


def backward_warps(head_dim: int) -> int:
    """The tutorial's 4 warps; 8 at D=128, where with 4 the dK/dV kernel spills 4 KiB a
    thread (ptxas, sm_90) and the dQ kernel 160 bytes."""
    return 8 if head_dim >= 128 else 4


def forward_config(head_dim: int) -> dict[str, int]:
    """BLOCK_M, BLOCK_N, warps and stages of the forward: picks from the tutorial's TMA
    autotuning space (BLOCK_N <= HEAD_DIM; 8 warps only for 128x128 blocks)."""
    if head_dim >= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "warps": 8, "stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 64, "warps": 4, "stages": 3}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool,
              cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, the base-2 log-sum-exp of each row's scaled scores, f32 [B, H, M]) of
    softmax(q k^T * sm_scale [soft-capped by cap], causal) v, for contiguous [B, H, L, D]."""
    B, H, M, D = q.shape
    N = k.shape[2]
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and D in (16, 32, 64, 128, 256)
    if not q.is_cuda and (q.dtype is torch.bfloat16 or cap is not None):
        raise ValueError("Triton's interpreter multiplies bf16 dot operands as raw bits and cannot run "
                         "the soft-cap's inline PTX: on the CPU, run f16 without a cap")
    cfg = forward_config(D)
    o = torch.empty_like(q)
    lse = torch.empty((B, H, M), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), B * H)
    launch(_attn_fwd, grid, q, k, v, o, lse, sm_scale, 1.0 if cap is None else cap, M, N,
           HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal, SOFTCAP=cap is not None,
           num_warps=cfg["warps"], num_stages=cfg["stages"])
    return o, lse


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, do: torch.Tensor, sm_scale: float,
                       causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of `attention` (not soft-capped) given its O and log-sum-exp."""
    B, H, M, D = q.shape
    N = k.shape[2]
    do = do.contiguous()
    delta = torch.empty_like(lse)
    launch(_attn_bwd_preprocess, (triton.cdiv(M, BWD["pre_block"]), B * H), o, do, delta, M,
           HEAD_DIM=D, BLOCK_M=BWD["pre_block"])
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    bm, bn = BWD["dkdv"]
    launch(_attn_bwd_dkdv, (triton.cdiv(N, bn), B * H), q, k, v, do, lse, delta, dk, dv, sm_scale, M, N,
           HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, num_warps=backward_warps(D),
           num_stages=BWD["stages"])
    bm, bn = BWD["dq"]
    launch(_attn_bwd_dq, (triton.cdiv(M, bm), B * H), q, k, v, do, lse, delta, dq, sm_scale, M, N,
           HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, num_warps=backward_warps(D),
           num_stages=BWD["stages"])
    return dq, dk, dv


def forward_build(M: int, N: int, D: int, dtype: torch.dtype, causal: bool, softcap: bool) -> Build:
    cfg = forward_config(D)
    name = "attn_fwd" + ("_softcap" if softcap else "")
    return Build(name, "forward", _attn_fwd,
                 {"Q": dtype, "K": dtype, "V": dtype, "O": dtype, "LSE": torch.float32, "sm_scale": 0.5,
                  "cap": 30.0, "M_CTX": M, "N_CTX": N},
                 {"HEAD_DIM": D, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "CAUSAL": causal,
                  "SOFTCAP": softcap},
                 cfg["warps"], cfg["stages"], cfg["BLOCK_M"] * cfg["BLOCK_N"], "score")


def backward_builds(M: int, N: int, D: int, dtype: torch.dtype, causal: bool) -> list[Build]:
    """The preprocess (role "delta"), dK/dV ("dkdv") and dQ ("dq") kernels."""
    args = {"Q": dtype, "K": dtype, "V": dtype, "DO": dtype, "LSE": torch.float32, "DELTA": torch.float32,
            "DK": dtype, "DV": dtype, "DQ": dtype, "O": dtype, "sm_scale": 0.5, "M_CTX": M, "N_CTX": N}
    builds = [Build("attn_bwd_preprocess", "delta", _attn_bwd_preprocess, args,
                    {"HEAD_DIM": D, "BLOCK_M": BWD["pre_block"]}, 4, 3, BWD["pre_block"] * D, "element")]
    for role, fn in (("dkdv", _attn_bwd_dkdv), ("dq", _attn_bwd_dq)):
        bm, bn = BWD[role]
        builds.append(Build(f"attn_bwd_{role}", role, fn, args,
                            {"HEAD_DIM": D, "BLOCK_M": bm, "BLOCK_N": bn, "CAUSAL": causal},
                            backward_warps(D), BWD["stages"], bm * bn, "score"))
    return builds


