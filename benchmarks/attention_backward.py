"""Attention backward and forward+backward against SDPA's flash backend and FlexAttention.

    python benchmarks/attention_backward.py                   # on a CUDA GPU
    python benchmarks/attention_backward.py --device cpu --quick   # a smoke run (interpreter)

For head dim D in {64, 128}, N in {1k, 4k, 16k} with B * N = 16k, H = 16, causal
and not, f16 and bf16, plus a soft-capped causal variant (`20 * tanh(s / 20)`), it
times in one run, on the same random inputs and output gradient:
  ours      tiledsl's derived backward (fn.backward: the delta row kernel, the dk/dv
            kernel and the dq kernel) and the training forward + backward through autograd
  flash     SDPA with the flash backend forced (plain variants; CUDA only)
  flex      FlexAttention under torch.compile with the same score_mod (soft-capped; CUDA only)
and prints backward and forward+backward TFLOP/s (backward 10 * B * H * N^2 * D,
forward 4 * ..., halved for causal) and the ratios the issue sets goals for: backward
>= 1.0x SDPA flash at D = 128, N >= 4k, and >= FlexAttention's for the softcap mod.

Each result's gradients are checked against float32 eager autograd before timing.
Timing: `common.bench` (CUDA events, median via triton.testing.do_bench).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import CAUSAL, DTYPES, SOURCE, shapes  # noqa: E402  (the forward table's programs)
from common import arguments, bench, open_device, print_header  # noqa: E402

import tiledsl  # noqa: E402

SOFTCAP = "s = tanh(s * 0.05) * 20.0"
VARIANTS = {"plain": (False, ""), "causal": (True, ""), "softcap causal": (True, SOFTCAP)}


def eager(q, k, v, scale, causal, softcap):
    s = q @ k.transpose(-1, -2) * scale
    if softcap:
        s = torch.tanh(s * 0.05) * 20.0
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def baseline(q, k, v, scale, causal, softcap, device):
    """SDPA flash for the plain variants, FlexAttention for the soft-capped one; None on the CPU."""
    if device != "cuda":
        return None
    if not softcap:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        def run():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        return run
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = q.shape[-2]
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n, device=device)
    flex = torch.compile(flex_attention)
    return lambda: flex(q, k, v, score_mod=lambda s, b, h, i, j: 20.0 * torch.tanh(s / 20.0),
                        block_mask=mask, scale=scale)


def fwd_bwd(run, inputs, do):
    out = run()
    return torch.autograd.grad(out, inputs, do)


def measure(device: str, quick: bool = False) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, dtype in DTYPES.items():
        for variant, (causal, mod) in VARIANTS.items():
            fn = tiledsl.compile(SOURCE.format(dt=name, mask=CAUSAL if causal else "", mod=mod))
            kinds = [k.template for k in fn.backward.kernels]
            assert kinds == ["rows", "attention_backward", "attention_backward"], fn.backward.explain()
            for shape in shapes(quick):
                row = {"dtype": name, "variant": variant, **dict(zip("BHND", shape, strict=True))}
                row.update(measure_one(fn, shape, dtype, causal, bool(mod), gen, device))
                rows.append(row)
    return rows


def measure_one(fn, shape, dtype, causal: bool, softcap: bool, gen, device: str) -> dict:
    """Times in ms for one shape, or the error that kept it untimed."""
    b, h, n, d = shape
    q, k, v, do = (torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(4))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    scale = 1 / math.sqrt(d)
    ours = fwd_bwd(lambda: fn(q, k, v, scale=scale), (q, k, v), do)  # compiles and autotunes
    wide = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref = fwd_bwd(lambda: eager(*wide, scale, causal, softcap), wide, do.float())
    rel = max(((g.float() - r).norm() / r.norm()).item() for g, r in zip(ours, ref, strict=True))
    if rel > 3e-2:
        return {"error": f"relative gradient error {rel:.2e}: results disagree, not timed"}
    out, lse = fn.training(fn.differentiable).forward(q.detach(), k.detach(), v.detach(), scale)
    args = (q.detach(), k.detach(), v.detach(), scale, out, lse, do)
    t_bwd = bench(lambda: fn.backward(*args), device)
    t_both = bench(lambda: fwd_bwd(lambda: fn(q, k, v, scale=scale), (q, k, v), do), device)
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    row = {"bwd_ms": t_bwd, "fwd_bwd_ms": t_both, "bwd_tflops": 2.5 * flops / (t_bwd * 1e-3) / 1e12,
           "fwd_bwd_tflops": 3.5 * flops / (t_both * 1e-3) / 1e12}
    base = baseline(q, k, v, scale, causal, softcap, device)
    if base is not None:
        fwd_bwd(base, (q, k, v), do)
        t_base_both = bench(lambda: fwd_bwd(base, (q, k, v), do), device)
        row.update(base_fwd_bwd_ms=t_base_both, base_bwd_ms=t_base_both - bench(base, device))
    return row


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__).parse_args(argv)
    device = args.device
    if not open_device("attention_backward.py", device):
        return 2
    header = (f"{'B':>3} {'H':>3} {'N':>6} {'D':>4} {'variant':>14} {'dtype':>5} | {'bwd ms':>7} "
              f"{'TFLOP/s':>7} {'f+b ms':>7} {'TFLOP/s':>7} | {'base bwd':>8} {'base f+b':>8} | "
              f"{'bwd base/ours':>13} {'f+b base/ours':>13}")
    print_header(header)
    for r in measure(device, args.quick):
        where = f"{r['dtype']} {r['variant']} {r['B']}x{r['H']}x{r['N']}x{r['D']}"
        if "error" in r:
            print(f"  {where}: {r['error']}")
            continue
        base_bwd, base_both = r.get("base_bwd_ms", float("nan")), r.get("base_fwd_bwd_ms", float("nan"))
        print(f"{r['B']:>3} {r['H']:>3} {r['N']:>6} {r['D']:>4} {r['variant']:>14} {r['dtype']:>5} | "
              f"{r['bwd_ms']:7.3f} {r['bwd_tflops']:7.1f} "
              f"{r['fwd_bwd_ms']:7.3f} {r['fwd_bwd_tflops']:7.1f} | "
              f"{base_bwd:8.3f} {base_both:8.3f} | {base_bwd / r['bwd_ms']:13.2f} "
              f"{base_both / r['fwd_bwd_ms']:13.2f}")
    print("base: SDPA flash (plain, causal), FlexAttention (softcap causal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
