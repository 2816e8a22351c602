"""Flash attention against torch's scaled_dot_product_attention.

    python benchmarks/attention.py                   # on a CUDA GPU: the issue's table
    python benchmarks/attention.py --device cpu --quick   # a smoke run through the interpreter
    python benchmarks/attention.py --backward        # backward and forward+backward TFLOP/s
                                                     # (attention_backward.py's table)

For head dim D in {64, 128}, sequence length N in {1k, 4k, 16k} with B * N =
16k, H = 16, causal and not, f16 and bf16, it times in one run, on the same
random inputs:
  ours      tiledsl's one attention kernel, compiled from the DSL text below
  flash     SDPA with the flash backend forced (sdpa_kernel(FLASH_ATTENTION))
  default   SDPA with torch's own backend choice
  math      eager math attention: softmax(q @ k.T * scale) @ v, unfused
and prints TFLOP/s (4 * B * H * N^2 * D, halved for causal) and the ratios the
issue sets goals for: ours >= 1.2x flash and >= 450 TFLOP/s at D = 128
non-causal; causal <= 0.55x the non-causal time (on an H100).

Timing: triton.testing.do_bench (CUDA events, median) after a warm-up call that
also runs tiledsl's autotuning; inputs are random normal (never zeros), and
each result is checked against SDPA before it is timed.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, bench, open_device, print_header  # noqa: E402

import tiledsl  # noqa: E402

SOURCE = """
kernel attention(q: {dt}[B, H, N, D], k: {dt}[B, H, N, D], v: {dt}[B, H, N, D],
                 scale: f32) -> {dt}[B, H, N, D] {{
    s = q @ k.T * scale
    {mod}
    {mask}
    return softmax(s) @ v
}}"""  # mod: a score modification (attention_backward.py's softcap), mask: causal or none
CAUSAL = "s = where(causal(s), s, -inf)"
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
HEADS = 16
TOKENS = 16384  # B * N


def shapes(quick: bool) -> list[tuple[int, int, int, int]]:
    """(B, H, N, D) for every size of the table."""
    if quick:
        return [(1, 2, 77, 64)]
    return [(TOKENS // n, HEADS, n, d) for d in (64, 128) for n in (1024, 4096, 16384)]


def math_attention(q, k, v, scale, causal):
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def sdpa(q, k, v, scale, causal, backend=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    if backend is None:
        return scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    with sdpa_kernel(getattr(SDPBackend, backend)):
        return scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def time_all(fn, q, k, v, scale: float, causal: bool, device: str) -> tuple[float, ...]:
    """Median ms of: ours, SDPA flash (CUDA only), SDPA default, eager math (when its scores fit)."""
    b, h, n, _ = q.shape
    flash = (bench(lambda: sdpa(q, k, v, scale, causal, "FLASH_ATTENTION"), device)
             if device == "cuda" else float("nan"))
    fits = b * h * n * n * 4 <= (8 << 30)  # eager math materialises the B*H*N^2 scores
    return (bench(lambda: fn(q, k, v, scale=scale), device), flash,
            bench(lambda: sdpa(q, k, v, scale, causal), device),
            bench(lambda: math_attention(q, k, v, scale, causal), device) if fits else float("nan"))


def measure(device: str, quick: bool = False) -> list[dict]:
    """One row per (dtype, causal, shape): times in ms, or the error that kept it untimed."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, dtype in DTYPES.items():
        for causal in (False, True):
            fn = tiledsl.compile(SOURCE.format(dt=name, mod="", mask=CAUSAL if causal else ""))
            assert [k.template for k in fn.kernels] == ["attention"], fn.explain()
            for b, h, n, d in shapes(quick):
                row = {"dtype": name, "causal": causal, "B": b, "H": h, "N": n, "D": d}
                rows.append(row)
                q, k, v = (torch.randn((b, h, n, d), generator=gen).to(dtype).to(device) for _ in range(3))
                scale = 1 / math.sqrt(d)
                out = fn(q, k, v, scale=scale)  # warm-up: compiles and autotunes
                ref = math_attention(q.float(), k.float(), v.float(), scale, causal)
                rel = ((out.float() - ref).norm() / ref.norm()).item()
                if rel > 2e-2:
                    row["error"] = f"relative error {rel:.2e}: results disagree, not timed"
                    continue
                t_ours, t_flash, t_default, t_math = time_all(fn, q, k, v, scale, causal, device)
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                row.update(ours_ms=t_ours, tflops=flops / (t_ours * 1e-3) / 1e12, sdpa_flash_ms=t_flash,
                           sdpa_default_ms=t_default, eager_math_ms=t_math)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--backward", action="store_true",
                        help="time the derived backward against SDPA flash and FlexAttention instead")
    args = parser.parse_args(argv)
    if args.backward:
        import attention_backward

        return attention_backward.main(["--device", args.device] + (["--quick"] if args.quick else []))
    device = args.device
    if not open_device("attention.py", device):
        return 2
    header = (f"{'B':>3} {'H':>3} {'N':>6} {'D':>4} {'causal':>6} {'dtype':>5} | {'ours ms':>8} "
              f"{'TFLOP/s':>7} | {'flash':>7} {'default':>7} {'math':>7} | {'flash/ours':>10} "
              f"{'default/ours':>12} {'math/ours':>9}")
    print_header(header)
    timed: dict[tuple, float] = {}
    for r in measure(device, args.quick):
        b, h, n, d, causal, name = r["B"], r["H"], r["N"], r["D"], r["causal"], r["dtype"]
        if "error" in r:
            print(f"  {name} {b}x{h}x{n}x{d}: {r['error']}")
            continue
        t_ours, t_flash, t_default, t_math = (r["ours_ms"], r["sdpa_flash_ms"], r["sdpa_default_ms"],
                                              r["eager_math_ms"])
        timed[(name, n, d, causal)] = t_ours
        print(f"{b:>3} {h:>3} {n:>6} {d:>4} {str(causal):>6} {name:>5} | {t_ours:8.3f} "
              f"{r['tflops']:7.1f} | {t_flash:7.3f} {t_default:7.3f} "
              f"{t_math:7.3f} | {t_flash / t_ours:10.2f} {t_default / t_ours:12.2f} "
              f"{t_math / t_ours:9.2f}")
    pairs = [(key, timed[key], timed.get((*key[:3], False))) for key in timed if key[3]]
    if pairs:
        print("causal / non-causal time: " + ", ".join(
            f"{key[0]} N={key[1]} D={key[2]}: {t / full:.2f}" for key, t, full in pairs if full))
    return 0


if __name__ == "__main__":
    sys.exit(main())
