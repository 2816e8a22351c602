"""The fused attention backward (autodiff's flash form + fuse-attention-backward): gradients
against float64 torch autograd of the reference by the oracle (`testing.check_grads`) on the
FlashAttention grid's awkward shapes, score modifications with learnable inputs, fully
masked rows and GQA; kernel counts and what explain() shows; sm_90 compilation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiledsl
from helpers import gen, randn, run_checked
from tiledsl import testing
from tiledsl.backends.triton import aot

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def grads_ok(fn, *args, seed=0):
    report = testing.check_grads(fn, *args, generator=gen(seed))
    assert report.ok, f"{fn.name}: {report}"


def templates(program) -> list[str]:
    return [k.template for k in program.kernels]


def attention(dt: str, causal: bool, extra: str = "", mod: str = "") -> tiledsl.Program:
    mask = "s = where(causal(s), s, -inf)" if causal else ""
    return tiledsl.compile(f"""
    kernel attn(q: {dt}[B, H, M, D], k: {dt}[B, H, N, D], v: {dt}[B, H, N, D]{extra}) -> {dt}[B, H, M, D] {{
        s = q @ k.T * rsqrt(D)
        {mod}
        {mask}
        return softmax(s, axis=-1) @ v
    }}""")


def qkv(b, h, m, n, d, dt, seed=0):
    t = DTYPES[dt]
    return (randn(b, h, m, d, dtype=t, seed=seed), randn(b, h, n, d, dtype=t, seed=seed + 1),
            randn(b, h, n, d, dtype=t, seed=seed + 2))


# the FlashAttention test grid's awkward shapes, at sizes the interpreter runs fast
GRID = [((1, 239), 32), ((113, 203), 59), ((128, 217), 64), ((108, 256), 80), ((33, 47), 128),
        ((256, 512), 64)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", GRID, ids=[f"{m}x{n}-d{d}" for (m, n), d in GRID])
def test_backward_matches_float64_autograd_on_the_grid(shape, causal):
    (m, n), d = shape
    dt = "f16" if (m + d) % 2 else "bf16"
    grads_ok(attention(dt, causal), *qkv(1, 1, m, n, d, dt))


@pytest.mark.parametrize("dt", ["f32", "bf16", "f16"])
def test_batched_heads_in_every_dtype(dt):
    grads_ok(attention(dt, True), *qkv(2, 3, 17, 33, 16, dt))


def test_the_backward_is_three_kernels_and_the_forward_one():
    fn = attention("f16", True)
    training = fn.training(fn.differentiable)
    assert [k.template for k in training.forward.kernels] == ["attention"]
    assert [k.template for k in fn.backward.kernels] == ["rows", "attention_backward", "attention_backward"]
    # the saved logsumexp is f32, one per query row; nothing [M, N] is saved
    assert [s.kind for s in training.derivation.sources].count("saved") == 1
    assert str(training.derivation.forward.returns[-1]) == "f32[B, H, M, 1]"


def test_explain_shows_the_structure_of_the_backward_kernels():
    backward = attention("f16", True).backward
    report = backward.explain()
    assert "3 kernels" in report
    # line 3 is `s = q @ k.T * rsqrt(D)`, line 6 `softmax(s) @ v`
    assert "summed over the queries: matmul (line 6), matmul (line 3); scaled once after the walk: mul " \
           "(line 3); one program per key block walks the query blocks, scores recomputed per tile" in report
    # dk = (ds * scale).T @ q and dq = (ds * scale) @ k: each sum is scaled once, not each score
    assert "scaled once after the walk: mul (line 3); summed over the keys: matmul (line 3); one program " \
           "per query block walks the key blocks" in report
    assert "key blocks outside the mask's bound, where every value it sums or stores is 0, are skipped, blocks " \
           "inside it for every row run without the mask" in report
    assert ("[fuse-attention-backward] fused: matmul (line 6) -> matmul (line 3): flash attention "
            "backward (2 score dots; over the queries: matmul (line 6), matmul (line 3); over the keys: "
            "matmul (line 3))") in [str(r) for r in backward.remarks]


def test_softcap_bias_and_causal_with_the_bias_gradient():
    fn = attention("f16", True, extra=", bias: f16[B, H, M, N]",
                   mod="s = tanh((s + bias) * 0.05) * 20.0")
    q, k, v = qkv(2, 2, 17, 33, 32, "f16")
    grads_ok(fn, q, k, v, randn(2, 2, 17, 33, dtype=torch.float16, seed=7))
    # the bias gradient is the score gradient, stored per tile by the dk/dv kernel, which
    # skips the tiles past the causal bound (0 there: the output starts zero-filled)
    assert templates(fn.backward) == ["rows", "attention_backward", "attention_backward"]
    assert "stored per tile: " in fn.backward.explain() and \
        "query blocks outside the mask's bound, where every value it sums or stores is 0" in fn.backward.explain()


def alibi(dt: str) -> tiledsl.Program:
    # f32 slopes times an f32 distance: in f16 and bf16 the scores are f32 (mixed precision)
    return attention(dt, True, extra=", slopes: f32[H, 1, 1]",
                     mod="s = s + slopes * cast(index(s, -1) - index(s, -2), f32)")


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
def test_learnable_alibi_slopes(dt):
    fn = alibi(dt)
    q, k, v = qkv(2, 3, 17, 33, 16, dt)
    grads_ok(fn, q, k, v, randn(3, 1, 1, seed=9) * 0.1)
    # the slopes' gradient, sum(ds * (j - i)) over B, M and N: each program of the dk/dv
    # kernel sums its tiles and adds them into the [H, 1, 1] result atomically; in mixed
    # precision the f32 dots load the f16 tensors and widen them (no kernel casts them)
    assert templates(fn.backward) == ["rows", "attention_backward", "attention_backward"]
    assert "reduced by atomic adds: sum (line 4), sum (line 4), sum (line 4);" in fn.backward.explain()


# learnable broadcast biases: per key, per query row, shared by the batch; in f16 and bf16
# the sums run in f32 and a cast back follows (a 4th kernel)
BIASES = [("f16", "N", (33,)), ("bf16", "M, 1", (17, 1)), ("f32", "H, M, N", (3, 17, 33)),
          ("f32", "B, 1, 1, N", (2, 1, 1, 33))]


@pytest.mark.parametrize("bias", BIASES, ids=[f"{dt}[{decl}]" for dt, decl, _ in BIASES])
def test_broadcast_bias_gradients_are_summed_in_the_kernel(bias):
    dt, decl, shape = bias
    fn = attention(dt, True, extra=f", bias: {dt}[{decl}]", mod="s = s + bias")
    grads_ok(fn, *qkv(2, 3, 17, 33, 16, dt), randn(*shape, dtype=DTYPES[dt], seed=9))
    kinds = templates(fn.backward)
    assert kinds == ["rows", "attention_backward", "attention_backward"] + (["pointwise"] if dt != "f32" else [])


@pytest.mark.parametrize("dt", ["f16", "bf16", "f32"])
def test_operand_prologues_are_computed_on_the_loaded_tiles(dt):
    # q, k and v scaled before their dots (by a literal, a dim's rsqrt and a scalar
    # argument): the backward kernels scale the tiles they load, the scalar's factor on dk
    # (stored transposed) joins the dk/dv kernel's epilogue
    fn = tiledsl.compile(f"""
    kernel attn(q: {dt}[B, H, M, D], k: {dt}[B, H, N, D], v: {dt}[B, H, N, D], c: f32) -> {dt}[B, H, M, D] {{
        s = (q * rsqrt(D)) @ (k * c).T
        s = where(causal(s), s, -inf)
        return softmax(s, axis=-1) @ (v * 2.0)
    }}""")
    grads_ok(fn, *qkv(2, 3, 17, 33, 16, dt), 0.7)
    assert templates(fn.backward) == ["rows", "attention_backward", "attention_backward"]
    assert "operand prologues: mul (line 3), mul (line 3), mul (line 5), mul (line 3); score dots" \
        in fn.backward.explain()


def test_probabilities_of_saved_scores_are_not_operand_prologues():
    # p from saved scores (no score dot recomputes them) is read by p.T @ do through a
    # transpose: a product of the score space, not a dot of loaded tensors (an internal
    # error before; found by scripts/fuzz_programs.py, seed 97)
    fn = tiledsl.compile("""
    kernel f(s0: f32[M, N], v: f32[N, D], do: f32[M, D], lse: f32[M, 1],
             k: f32[N, D]) -> (f32[N, D], f32[M, D]) {
        p = exp(s0 * 0.5 - lse)
        ds = p * (do @ v.T)
        return p.T @ do, ds @ k
    }""")
    args = (randn(17, 33, seed=1), randn(33, 16, seed=2), randn(17, 16, seed=3), randn(17, 1, seed=4).abs() + 2,
            randn(33, 16, seed=5))
    report = testing.check(fn, *args)
    assert report.ok, report
    assert templates(fn) == ["attention_backward", "attention_backward"]


def test_a_product_reading_the_scores_broadcast_over_a_batch_axis_is_not_the_kernels():
    # `p @ wb` with p: [M, N] and wb: [H, N, D] multiplies the same scores once per head, and
    # the kernels own one batch element of the scores each (an internal error before: wb's
    # tile was addressed with the scores' batch indices; fuzz finding 0:2984). Alone it is a
    # GEMM of the stored p; beside a product the kernels serve, it refuses the space
    fn, _ = run_checked("""kernel f(x: f32[M, N], w: f32[N, N], wb: f32[H, N, N]) -> f32[H, M, N] {
    return exp(x @ w) @ wb
}""", randn(17, 33), randn(33, 33, scale=0.2), randn(3, 33, 33, scale=0.2))
    assert templates(fn) == ["matmul", "matmul"]
    fn, _ = run_checked("""kernel f(q: f32[M, D], k: f32[N, D], v: f32[N, D], wb: f32[H, N, D]) -> (f32[M, D], f32[H, M, D]) {
    p = exp(q @ k.T)
    return p @ v, p @ wb
}""", randn(17, 16), randn(33, 16, scale=0.3), randn(33, 16), randn(3, 33, 16))
    assert templates(fn) == ["matmul", "matmul", "matmul"]
    assert [str(r) for r in fn.remarks if r.pass_name == "fuse-attention-backward"] == [
        "[fuse-attention-backward] refused: exp (line 2) -> matmul (line 3): matmul (line 3) reads exp "
        "(line 2) of the attention backward's scores broadcast from [M, N] to the batch of its [H, M, D], "
        "and the kernels run one program per batch element of the scores [rule: other-index]"]


@pytest.mark.parametrize("dt", ["bf16", "f32"])
def test_attention_sinks_gradients(dt):
    # gpt-oss's sink logit: normalized to softmax(s) * sigmoid(lse - sink), the row factor
    # past the matmul; dp's operand is the gradient times that factor, which the row
    # pre-pass stores and the backward kernels load; the sink's gradient is a sum over the
    # batch and query axes (0 and 2, not adjacent): one row program
    src = (EXAMPLES / "attention_sinks.tdsl").read_text().replace("bf16", dt)
    fn = tiledsl.compile(src)
    q, k, v = qkv(2, 3, 17, 33, 16, dt)
    grads_ok(fn, q, k, v, randn(3, 1, 1, dtype=DTYPES[dt], seed=8))
    assert templates(fn.backward) == ["rows", "attention_backward", "attention_backward", "rows"]


@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_a_sinks_gradient_keeps_the_precision_of_its_small_share(dt):
    """The sink's gradient is the row's gradient times sigmoid * (1 - sigmoid), the sink's
    share 1 - sigmoid a few percent here (scores sharpened, sinks below the rows' logsumexp).
    online-softmax computed the factor in the program's dtype, from a logsumexp rounded to it:
    1 - sigmoid then kept 2^-12 of absolute error from the rounded sigmoid and 2^-9 from the
    logsumexp, and the sink's gradient missed the oracle (f16: 2.0e-4 against 8.7e-5; bf16:
    8.2e-4 against 3.2e-4; fuzz findings s3:1142 and across:666, up to 10x). The factor is
    computed in f32 from the f32 logsumexp now."""
    fn = tiledsl.compile(f"""
    kernel attn(q: {dt}[H, M, D], k: {dt}[H, N, D], v: {dt}[H, N, D], sink: {dt}[H, 1, 1]) -> {dt}[H, M, D] {{
        s = q @ k.T * rsqrt(D)
        m = maximum(max(s, axis=-1, keepdims=true), sink)
        e = exp(s - m)
        p = e / (sum(e, axis=-1, keepdims=true) + exp(sink - m))
        return p @ v
    }}""")
    t = DTYPES[dt]
    q, k, v = randn(3, 33, 40, dtype=t, seed=1, scale=2.0), randn(3, 113, 40, dtype=t, seed=2), \
        randn(3, 113, 40, dtype=t, seed=3)
    grads_ok(fn, q, k, v, (randn(3, 1, 1, seed=4) - 1.0).to(t))


def test_diff_attention_backward_is_derived_from_the_distributed_form():
    # (p1 - lam * p2) @ v: autodiff differentiates the program after distribute-matmul, so
    # each softmax is attention in the flash form: the row pre-pass, two kernels per
    # softmax and the sum of the two dv contributions; nothing [M, N] is stored
    fn = tiledsl.compile((EXAMPLES / "diff_attention.tdsl").read_text())
    t = torch.float16
    q1, k1, q2, k2, v = (randn(2, 2, 17 if i in (0, 2) else 33, 16, dtype=t, seed=i) for i in range(5))
    grads_ok(fn, q1, k1, q2, k2, v, 0.4)
    assert templates(fn.backward) == ["rows"] + ["attention_backward"] * 4 + ["pointwise"]


@pytest.mark.parametrize("width", [1, 20, 300])
def test_blocks_outside_a_window_are_skipped(width):
    # a window j in (i - width, i + 3]: both kernels walk only the blocks it reaches (the
    # plan's key bound), which at 113 x 97 with 64-wide blocks skips some
    fn = tiledsl.compile("""
    kernel attn(q: f32[B, H, M, D], k: f32[B, H, N, D], v: f32[B, H, N, D], w: i32) -> f32[B, H, M, D] {
        s = q @ k.T * rsqrt(D)
        i = index(s, -2)
        j = index(s, -1)
        return softmax(where((i + 3 >= j) & (j > i - w), s, -inf), axis=-1) @ v
    }""")
    grads_ok(fn, *qkv(1, 2, 113, 97, 16, "f32"), width)
    assert "query blocks outside the mask's bound, where every value it sums or stores is 0, are skipped" \
        in fn.backward.explain()


def test_fully_masked_rows_have_zero_gradients_never_nan():
    fn = tiledsl.compile("""
    kernel attn(q: f32[M, D], k: f32[N, D], v: f32[N, D], keep: bool[M]) -> f32[M, D] {
        s = where(keep[:, None], q @ k.T * 0.25, -inf)
        return softmax(s) @ v
    }""")
    q, k, v = randn(17, 16, seed=1), randn(33, 16, seed=2), randn(33, 16, seed=3)
    keep = torch.rand(17, generator=gen(4)) > 0.4
    grads_ok(fn, q, k, v, keep)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, keep)
    out.backward(randn(17, 16, seed=5))
    assert not q.grad.isnan().any() and (q.grad[~keep] == 0).all()
    assert "attention_backward" in templates(fn.backward)


def test_gqa_gradients():
    # dk and dv are summed over the query heads sharing a kv head: the dk/dv kernel walks
    # the group's heads with the query blocks, summing them in its accumulators
    fn = tiledsl.compile((EXAMPLES / "gqa_attention.tdsl").read_text())
    t = torch.float16
    for h, kh, s in [(4, 2, 17), (6, 1, 33), (6, 3, 70)]:
        q, k, v = randn(2, h, s, 16, dtype=t, seed=1), randn(2, kh, s, 16, dtype=t, seed=2), \
            randn(2, kh, s, 16, dtype=t, seed=3)
        grads_ok(fn, q, k, v)
    assert templates(fn.backward) == ["rows", "attention_backward", "attention_backward"]
    assert "walks the query blocks and batch axis 2 of the scores (the query heads sharing a key/value " \
           "head)" in fn.backward.explain()


@pytest.mark.parametrize("kv", ["B, 1, N, D", "N, D"])
def test_mqa_gradients(kv):
    # one key/value head for every query head, broadcast from a size-1 head dim or from no
    # batch dims at all (summed over B and H)
    fn = tiledsl.compile(f"""
    kernel mqa(q: f16[B, H, M, D], k: f16[{kv}], v: f16[{kv}]) -> f16[B, H, M, D] {{
        s = where(causal(q @ k.T), q @ k.T * rsqrt(D), -inf)
        return softmax(s) @ v
    }}""")
    shape = (2, 1, 33, 16) if kv.startswith("B") else (33, 16)
    t = torch.float16
    grads_ok(fn, randn(2, 3, 17, 16, dtype=t, seed=1), randn(*shape, dtype=t, seed=2), randn(*shape, dtype=t, seed=3))
    assert templates(fn.backward) == ["rows", "attention_backward", "attention_backward"]


@pytest.mark.parametrize("d", [64, 128])
def test_backward_kernels_compile_for_sm90_without_spills(d):
    fn = attention("f16", True)
    reports = aot.inspect_program(fn.backward, {"B": 4, "H": 16, "M": 4096, "N": 4096, "D": d})
    assert len(reports) == 3
    assert all(r.spill_bytes == 0 for r in reports), reports
    assert all(r.wgmma for r in reports[1:]), reports  # the two attention_backward kernels


def test_every_autotune_candidate_compiles_for_sm90_without_spills():
    fn = attention("bf16", False)
    reports = aot.inspect_program(fn.backward, {"B": 4, "H": 16, "M": 4096, "N": 4096, "D": 128},
                                  every_candidate=True)
    tiles = [(r.name, r.config["BLOCK_M"], r.config["BLOCK_N"], r.config["num_stages"])
             for r in reports if "BLOCK_K0" in r.config]
    assert len(tiles) == 4 and len(set(tiles)) == 4, tiles  # 2 candidates for each kernel
    assert all(r.spill_bytes == 0 for r in reports), [(r.name, r.config, r.spill_bytes) for r in reports]
    assert all(r.wgmma for r in reports if "BLOCK_K0" in r.config), reports


@pytest.mark.parametrize("d", [64, 128])
def test_the_default_backward_tiles_do_each_dot_once(d):
    """No warpgroup computes what another does (issue 29: 8 warps on 64 score rows computed
    S and dP twice, 1.5x and 1.7x the tensor work at head dim 128): the tensor cycles the
    loop profile models per score are the kernel's dots' multiply-adds per score (the dk/dv
    kernel's S, dP, dV and dK: 4 x D; the dq kernel's S, dP and dQ: 3 x D) at the f16 rate."""
    from tiledsl.backends.triton.loop_profile import MAC_RATE

    reports = aot.inspect_program(attention("f16", True).backward,
                                  {"B": 4, "H": 16, "M": 4096, "N": 4096, "D": d})
    for r, dots in zip(reports[1:], (4, 3), strict=True):
        per_score = r.loop["modeled"]["tensor"] / r.loop["work"]
        assert per_score == pytest.approx(dots * d / MAC_RATE["f16"], rel=1e-3), (r.name, r.config, r.loop)


@pytest.mark.parametrize("d", [64, 128])
def test_each_walked_tile_is_loaded_once(d):
    """The loop's global loads (the profile's memory term) are the walked side's tiles, each
    loaded once: the dk/dv kernel's Q^T and dO^T tiles of S^T = K Q^T and dP^T = V dO^T are
    the dK and dV products' Q and dO (transposed in shared memory), plus the rows' lse and
    delta; the dq kernel's K^T tile of S = Q K^T is the dQ product's K, a transposed view of
    the same tensor (`KernelOp.transposed_inputs`)."""
    from tiledsl.backends.triton.loop_profile import HBM_BYTES_PER_CLOCK

    reports = aot.inspect_program(attention("f16", True).backward,
                                  {"B": 4, "H": 16, "M": 4096, "N": 4096, "D": d})
    dkdv, dq = reports[1:]
    loaded = {r.name: r.loop["modeled"]["memory"] * HBM_BYTES_PER_CLOCK for r in reports[1:]}
    tiles = 2 * dkdv.config["BLOCK_M"] * d * 2  # q and do: [BLOCK_M, D] f16
    assert tiles <= loaded[dkdv.name] < tiles * 1.25, (loaded, dkdv.config)
    # k and v: [BLOCK_N, D] f16 (the profile rounds its cycles to 0.1)
    assert loaded[dq.name] == pytest.approx(2 * dq.config["BLOCK_N"] * d * 2, rel=1e-3), (loaded, dq.config)


def test_whole_tiles_skip_the_bound_checks():
    """Where every block and the head dim fill their tiles the launcher says `EVEN` and the
    bound checks fold away; a tail anywhere keeps them (and the gradients are right both ways)."""
    fn = attention("f16", True)
    dims = {"B": 1, "H": 2, "M": 64, "N": 64, "D": 16}
    for change, even in (({}, True), ({"D": 24}, False), ({"N": 63}, False)):
        launches = [launch for launch in aot.meta_launches(fn.backward, {**dims, **change})
                    if launch.kernel.kernel.template == "attention_backward"]
        assert len(launches) == 2
        for launch in launches:  # the interpreter's configuration: 64 x 64 tiles
            assert launch.kernel.launch_config(dict(launch.dims), "cpu").constexprs["EVEN"] is even, change
    grads_ok(fn, *qkv(1, 2, 64, 64, 16, "f16"))


def test_mixed_precision_backward_compiles_for_sm90_without_spills():
    # f16 q, k, v with f32 ALiBi scores: the score dots run on the tensor cores from the
    # f16 tiles; the f32 products (p.T @ do, ds.T @ q in f32) on the FMA units, in 32-wide tiles
    reports = aot.inspect_program(alibi("f16").backward, {"B": 4, "H": 16, "M": 4096, "N": 4096, "D": 128})
    assert len(reports) == 3
    assert all(r.spill_bytes == 0 for r in reports), reports
    assert reports[2].wgmma, reports


def test_gqa_backward_compiles_for_sm90_without_spills():
    fn = tiledsl.compile((EXAMPLES / "gqa_attention.tdsl").read_text())
    reports = aot.inspect_program(fn.backward, {"B": 2, "H": 32, "KH": 8, "H // KH": 4, "S": 4096, "D": 128})
    assert len(reports) == 3
    assert all(r.spill_bytes == 0 for r in reports), reports
    assert all(r.wgmma for r in reports[1:]), reports


@pytest.mark.parametrize("name", ["attention_sinks", "diff_attention", "dilated_window_attention",
                                  "document_mask_attention", "neighborhood_attention",
                                  "trig_score_mod_attention", "causal_softcap_attention"])
def test_example_backwards_compile_for_sm90_without_spills(name):
    # at head dim 128; score modifications with many ops (neighborhood's mask, the trig
    # score mod) walk 32-row blocks, which keeps them out of local memory
    fn = tiledsl.compile((EXAMPLES / f"{name}.tdsl").read_text())
    dims = {d: 1024 for d in testing.needed_dims(fn.backward)} | {"B": 2, "H": 8, "D": 128}
    scalars = {"lam": 0.5, "scale": 0.1}
    reports = [r for r in aot.inspect_program(fn.backward, dims, scalars=scalars) if "BLOCK_K0" in r.config]
    assert reports and all(r.spill_bytes == 0 and r.wgmma for r in reports), reports

