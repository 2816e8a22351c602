"""Split-KV attention (flash-decoding): where the (query block, batch) programs alone cannot
fill the GPU, SPLITS programs share each block's keys, each leaving its unnormalised output
and statistics, and a combine launch merges them by their log-sum-exp in split order
(`AttentionPlan.kv_split`, backends/triton/attention.py). Numerics against float64 torch on
awkward sizes at two split factors (and unsplit), special rows as torch has them, the same
bits on every run, the launches made, the derived backward, and the sm_90 build of decode
at B=1, H=32, L=32k."""

from __future__ import annotations

import pytest
import torch

import tiledsl
from helpers import gen, randn, run_checked
from tiledsl.backends.triton import aot

DECODE = """{hint}
kernel decode(q: {dt}[B, H, D], k: {dt}[B, H, L, D], v: {dt}[B, H, L, D]) -> {dt}[B, H, D] {{
    s = q[:, :, None, :] @ k.T * rsqrt(D)
    return (softmax(s) @ v)[:, :, 0, :]
}}"""

# a training forward: causal (a key bound the split ranges cut), its logsumexp stored, an
# epilogue reading a gate at the output tile
CAUSAL = """{hint}
kernel attn(q: f32[B, H, M, D], k: f32[B, H, N, D], v: f32[B, H, N, D],
            g: f32[B, H, M, D]) -> (f32[B, H, M, D], f32[B, H, M]) {{
    s = q @ k.T * rsqrt(D)
    s = where(causal(s), s, -inf)
    return (softmax(s) @ v) * sigmoid(g), logsumexp(s)
}}"""

# GQA decode: the query heads of a key/value head are a batch dim of the scores
GQA = """{hint}
kernel gqa(q: f32[B, H, D], k: f32[B, KH, L, D], v: f32[B, KH, L, D]) -> f32[B, H, D] {{
    qg = reshape(q, [B, KH, H // KH, 1, D])
    s = qg @ k[:, :, None].T * rsqrt(D)
    return reshape(softmax(s) @ v[:, :, None], [B, H, D])
}}"""

# linear attention: no softmax, the normaliser a sum over the keys
LINEAR = """{hint}
kernel lin(q: f32[B, M, D], k: f32[B, N, D], v: f32[B, N, D]) -> f32[B, M, D] {{
    s = elu(q @ k.T) + 1.0
    return (s @ v) / sum(s, axis=-1, keepdims=true)
}}"""


def split(src: str, splits: int | None, **fmt) -> tiledsl.Program:
    hint = "" if splits is None else f"@tile(SPLITS={splits})"
    return tiledsl.compile(src.format(hint=hint, **fmt))


def launches(fn) -> list[str]:
    return sorted(launch.kernel.fn_name for launch in fn.launches)


def paged(splits: int | None) -> tiledsl.Program:
    with open("examples/paged_decode.tdsl") as f:
        return tiledsl.compile(("" if splits is None else f"@tile(SPLITS={splits})\n") + f.read())


@pytest.mark.parametrize("b, h, l, d", [(1, 1, 1, 16), (2, 3, 1000, 17), (1, 2, 4099, 64)])
@pytest.mark.parametrize("splits", [1, 3, 5])
def test_decode_at_two_split_factors_and_unsplit(b, h, l, d, splits):
    fn = split(DECODE, splits, dt="f32")
    q, k, v = randn(b, h, d), randn(b, h, l, d), randn(b, h, l, d)
    _, out = run_checked(fn, q, k, v, sm90=False)
    blocks = -(-l // 128)  # the interpreter walks 128 keys a block: at most one range a block
    split_at_call = min(splits, blocks) > 1
    assert launches(fn) == (["k0_attention", "k0_attention_combine"] if split_at_call else ["k0_attention"])
    assert all(torch.equal(fn(q, k, v), out) for _ in range(2))  # no atomics: the same bits


def test_the_split_changes_the_order_not_the_result():
    """Three ranges and five merge different partials (different bits), both within the
    oracle's bound of the unsplit kernel's."""
    q, k, v = randn(2, 3, 40, seed=1), randn(2, 3, 3001, 40, seed=2), randn(2, 3, 3001, 40, seed=3)
    outs = [split(DECODE, s, dt="f32")(q, k, v) for s in (1, 3, 5)]
    ref = (torch.softmax(q.double()[:, :, None] @ k.double().transpose(-1, -2) * 40**-0.5, -1)
           @ v.double())[:, :, 0]
    for out in outs:
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
    assert not torch.equal(outs[1], outs[2])


@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_half_precision_decode(dt):
    fn = split(DECODE, 4, dt=dt)
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[dt]
    run_checked(fn, *(randn(*s, dtype=dtype) for s in ((2, 3, 64), (2, 3, 1111, 64), (2, 3, 1111, 64))),
                sm90=False)
    assert launches(fn) == ["k0_attention", "k0_attention_combine"]


@pytest.mark.parametrize("m, n", [(17, 300), (113, 1000), (300, 517)])
def test_causal_with_logsumexp_and_an_epilogue(m, n):
    """The key bound skips blocks past the diagonal and the ranges cut the rest: a range
    past a block's last row leaves nothing (max -inf, sum 0), merged as no keys; the
    logsumexp and the epilogue's gate come from the combine."""
    fn = split(CAUSAL, 3)
    args = [randn(2, 2, m, 24), randn(2, 2, n, 24), randn(2, 2, n, 24), randn(2, 2, m, 24)]
    run_checked(fn, *args, sm90=False)
    assert launches(fn) == ["k0_attention", "k0_attention_combine"]
    assert len(fn.kernels) == 1


def test_rows_with_no_keys_nan_and_inf_scores_are_torchs():
    """A row every key of which is masked gives 0 and logsumexp -inf; a NaN score makes its
    row NaN; a +inf score makes it NaN with logsumexp +inf: as the unsplit kernel and torch."""
    src = """@tile(SPLITS=4)
    kernel f(q: f32[M, D], k: f32[N, D], v: f32[N, D], lens: i32[M]) -> (f32[M, D], f32[M]) {
        s = q @ k.T
        s = where(index(s, -1) < lens[:, None], s, -inf)
        return softmax(s) @ v, logsumexp(s)
    }"""
    fn = tiledsl.compile(src)
    q, k, v = randn(6, 8, seed=4), randn(900, 8, seed=5), randn(900, 8, seed=6)
    lens = torch.tensor([0, 1, 200, 900, 900, 900], dtype=torch.int32)
    q[4, 0] = float("nan")  # every score of row 4 NaN
    q[5, 1] = float("inf")  # every score of row 5 +inf or -inf
    out, lse = fn(q, k, v, lens)
    s = q.double() @ k.double().T
    s = torch.where(torch.arange(900)[None, :] < lens[:, None], s, -torch.inf)
    ref = torch.softmax(s, -1) @ v.double()
    assert torch.equal(out[0], torch.zeros(8)) and lse[0] == float("-inf")
    torch.testing.assert_close(out[1:4].double(), ref[1:4], rtol=0, atol=1e-5)
    torch.testing.assert_close(lse[:4].double(), torch.logsumexp(s, -1)[:4], rtol=0, atol=1e-5)
    assert out[4].isnan().all() and lse[4].isnan() and ref[4].isnan().all()
    assert out[5].isnan().all() and lse[5] == float("inf") == torch.logsumexp(s, -1)[5]
    assert launches(fn) == ["k0_attention", "k0_attention_combine"]


def test_gqa_and_paged_decode():
    run_checked(split(GQA, 3), randn(2, 8, 32), randn(2, 2, 1500, 32), randn(2, 2, 1500, 32), sm90=False)
    fn = paged(3)
    b, h, d, p, blocks = 3, 2, 32, 16, 90
    q = randn(b, h, d, dtype=torch.float16)
    k_cache = randn(blocks, p, h, d, dtype=torch.float16)
    v_cache = randn(blocks, p, h, d, dtype=torch.float16)
    table = torch.randperm(blocks, generator=gen(7))[:b * 30].reshape(b, 30).to(torch.int32)
    lens = torch.tensor([1, 333, 480], dtype=torch.int32)  # one key; a range of nothing but masks
    run_checked(fn, q, k_cache, v_cache, table, lens, sm90=False)
    assert launches(fn) == ["k0_attention", "k0_attention_combine"]


def test_linear_attention_sums_its_ranges():
    fn = split(LINEAR, 5)
    run_checked(fn, randn(2, 17, 16), randn(2, 1200, 16), randn(2, 1200, 16), sm90=False)
    assert launches(fn) == ["k0_attention", "k0_attention_combine"]


def test_the_derived_backward_reads_the_combined_logsumexp():
    """Autograd through the split forward: its gradients are the float64 reference's."""
    fn = split(CAUSAL, 3)
    inputs = [randn(1, 2, 77, 16, seed=1), randn(1, 2, 600, 16, seed=2), randn(1, 2, 600, 16, seed=3),
              randn(1, 2, 77, 16, seed=4)]
    upstream = randn(1, 2, 77, 16, seed=5)
    args = [x.clone().requires_grad_() for x in inputs]
    out, _ = fn(*args)
    (out * upstream).sum().backward()
    fn(*inputs)
    assert launches(fn) == ["k0_attention", "k0_attention_combine"]
    wide = [x.double().requires_grad_() for x in inputs]
    q, k, v, g = wide
    s = q @ k.transpose(-1, -2) * 16**-0.5
    s = s.masked_fill(torch.ones(77, 600, dtype=torch.bool).tril().logical_not(), -torch.inf)
    ((torch.softmax(s, -1) @ v) * torch.sigmoid(g) * upstream.double()).sum().backward()
    for a, w in zip(args, wide, strict=True):
        torch.testing.assert_close(a.grad.double(), w.grad, rtol=0, atol=1e-4)


def test_a_kernel_storing_p_does_not_split():
    fn = tiledsl.compile("""@tile(SPLITS=4)
    kernel f(q: f32[M, D], k: f32[N, D], v: f32[N, D]) -> (f32[M, D], f32[M, N]) {
        p = softmax(q @ k.T)
        return p @ v, p
    }""")
    run_checked(fn, randn(5, 8), randn(700, 8), randn(700, 8), sm90=False)
    assert launches(fn) == ["k0_attention"]
    assert "split = keys" not in fn.ir()
    assert "launches: 1 (the keys are not split: it stores P" in fn.explain()


def test_explain_and_the_default_rule():
    fn = split(DECODE, None, dt="f16")
    assert "split = keys" in fn.ir()
    assert ("launches: 1, or 2 where its (query block, batch) programs alone cannot fill the GPU "
            "(split-KV: each program walks a range of the keys") in fn.explain()
    # decode at B=1, H=32, L=32k on a GPU: 32 programs of one query row; 9 ranges of 57 key
    # blocks make 288 programs
    dims = dict(B=1, H=32, L=32768, D=128)
    (launch, combine) = aot.meta_launches(fn, dims, {})
    cfg = launch.kernel.launch_config(dims, "cuda")
    assert cfg.constexprs["SPLITS"] == 9 and cfg.grid == (288,)
    # enough programs already: no split, and no combine
    dims = dict(B=8, H=32, L=32768, D=128)
    cfg = launch.kernel.launch_config(dims, "cuda")
    assert cfg.constexprs["SPLITS"] == 1 and cfg.grid == (256,)
    assert combine.kernel.launch_config(dims, "cuda").grid == (0,)
    assert [x.kernel.fn_name for x in aot.meta_launches(fn, dims, {})] == ["k0_attention"]
    # explain(dims=...) says what the launch builder chose at those sizes
    assert "        at these sizes: 2 launches on a GPU: 288 programs (SPLITS=9), then its combine's 32" \
        in fn.explain(dims=dict(B=1, H=32, L=32768, D=128)).splitlines()
    assert "        at these sizes: 1 launch on a GPU: 256 programs (SPLITS=1)" \
        in fn.explain(dims=dims).splitlines()


@pytest.mark.parametrize("program, dims", [
    ("decode", dict(B=1, H=32, L=32768, D=128)),
    ("gqa", dict(B=1, H=32, KH=8, L=32768, D=128)),
    ("paged", dict(B=1, H=32, D=128, NB=2048, P=16, L=2048)),
])
def test_decode_builds_for_sm90_with_programs_for_every_sm_and_no_spills(program, dims):
    src = {"decode": DECODE.format(hint="", dt="f16"), "gqa": GQA.format(hint="").replace("f32", "f16")}
    fn = paged(None) if program == "paged" else tiledsl.compile(src[program])
    launched = aot.meta_launches(fn, dims, {})
    reports = aot.inspect_program(fn, dims, {})
    assert [launch.kernel.fn_name for launch in launched] == ["k0_attention", "k0_attention_combine"]
    for report in reports:
        assert report.spill_bytes == 0, report
    main, combine = reports
    assert main.grid[0] >= 132 and main.config["SPLITS"] == 9, main
    assert combine.grid == (32,) and combine.workspace_bytes == 0
    # the partial outputs (9 x 32 rows x 128 f32) and their max and sum
    assert main.workspace_bytes == 9 * 32 * 128 * 4 + 9 * 32 * 2 * 4


def test_split_kv_benchmark_smoke_run(capsys):
    from test_benchmarks import load

    assert load("split_kv").main(["--device", "cpu", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("|")[0].split() == ["case"]
    rows = [line.split("|") for line in lines[2:]]
    assert [r[3].split()[0] for r in rows] == ["unsplit", "sdpa", "unsplit", "sdpa"]
    assert all(r[1].split() == ["2"] for r in rows), rows  # 4 programs: 1000 keys in 2 ranges


def test_an_epilogue_of_scalar_expressions_is_computed_again_by_the_combine():
    """`(s + N)` scales the scores and the output: the combine computes it again from the
    scalar and the dim."""
    fn = tiledsl.compile("""@tile(SPLITS=3)
    kernel f(x: f32[M, N], w: f32[N, N], s: f32) -> f32[M, N] {
        return softmax(x @ (w * (s + N)).T * (s + N)) @ w * (s + N)
    }""")
    run_checked(fn, randn(5, 700, seed=1, scale=0.01), randn(700, 700, seed=2, scale=0.01), 0.5, sm90=False)
    assert launches(fn) == ["k0_attention", "k0_attention_combine"]


def test_ptx_json_shows_the_partials_launch_and_its_combine(tmp_path):
    """`tiledsl ptx --json` at decode sizes: the key-range launch (288 programs, its
    workspaces) and the combine, each with no spills."""
    import json

    from test_cli import cli

    path = tmp_path / "decode.tdsl"
    path.write_text(DECODE.format(hint="", dt="f16"))
    code, out, _ = cli("ptx", str(path), "--dims", "B=1,H=32,L=32768,D=128", "--json")
    assert code == 0
    main, combine = json.loads(out)["kernels"]
    assert (main["function"], combine["function"]) == ("k0_attention", "k0_attention_combine")
    assert main["grid"] == [288] and main["config"]["SPLITS"] == 9 and combine["grid"] == [32]
    assert main["workspace_bytes"] == 9 * 32 * (128 + 2) * 4 and combine["workspace_bytes"] == 0
    assert main["spill_bytes"] == combine["spill_bytes"] == 0
