"""Causal linear attention, one tiledsl kernel, against flash-linear-attention's naive forms.

    python benchmarks/linear_attention.py                 # on a CUDA GPU
    python benchmarks/linear_attention.py --device cpu --quick   # a smoke run through the interpreter

The program is examples/linear_attention.tdsl: scaled scores with no softmax, zeroed above
the diagonal, times v; tiledsl runs it as one chain kernel that never stores the [T, T]
scores and skips the key blocks past the diagonal. Timed in one run on the same random
inputs against
  eager     the quadratic form as flash-linear-attention's naive reference writes it
            (q * scale @ k.T, masked_fill of the upper triangle with 0, @ v), torch eager
  compile   torch.compile (Inductor) of that function
  chunked   flash-linear-attention's chunked naive form (chunks of 64: the state k.T @ v per
            chunk, its exclusive prefix sum, the inter-chunk q @ state plus the masked
            intra-chunk products), torch eager: linear in T, where the others are quadratic
and prints times, TFLOP/s (the quadratic form's 4 * B * H * T * T * D / 2 useful flops per
time) and baseline / tiledsl ratios (above 1: tiledsl is faster).

Timing: triton.testing.do_bench (CUDA events, median) after a warm-up call that also
autotunes; inputs are random normal (never zeros).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import arguments, bench, open_device, print_header  # noqa: E402

import tiledsl  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
SOURCE = (HERE.parent / "examples" / "linear_attention.tdsl").read_text()
CHUNK = 64


def naive(q, k, v):
    """The quadratic form: every [T, T] score stored, masked, multiplied."""
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
    t = scores.shape[-1]
    upper = torch.triu(torch.ones(t, t, dtype=torch.bool, device=q.device), diagonal=1)
    return scores.masked_fill(upper, 0.0) @ v


def chunked(q, k, v):
    """The chunked form: a [D, E] state per chunk, prefix-summed, and the masked products
    within each chunk of CHUNK steps (T a multiple of CHUNK)."""
    b, h, t, d = q.shape
    n = t // CHUNK
    q = (q * d ** -0.5).reshape(b, h, n, CHUNK, d)
    k = k.reshape(b, h, n, CHUNK, d)
    v = v.reshape(b, h, n, CHUNK, v.shape[-1])
    state = (k.transpose(-1, -2) @ v).cumsum(2)
    state = torch.cat([torch.zeros_like(state[:, :, :1]), state[:, :, :-1]], dim=2)
    upper = torch.triu(torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device), diagonal=1)
    intra = (q @ k.transpose(-1, -2)).masked_fill(upper, 0.0) @ v
    return (q @ state + intra).reshape(b, h, t, -1)


# (B, H, T, D, E); quick sizes for the interpreter
SIZES = [(8, 16, 2048, 64, 64), (4, 16, 4096, 128, 128), (2, 16, 8192, 64, 64)]
QUICK = [(1, 2, 128, 16, 16)]


def measure(device: str, quick: bool = False, with_compile: bool = True) -> list[dict]:
    """One row per (dtype, size): times in ms, or the error that kept it untimed."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    compiled = torch.compile(naive) if with_compile and device == "cuda" else None
    for dt, dtype in DTYPES.items():
        fn = tiledsl.compile(SOURCE.replace("bf16", dt))
        assert [k.template for k in fn.kernels] == ["attention"], fn.explain()
        for b, h, t, d, e in QUICK if quick else SIZES:
            row = {"dtype": dt, "B": b, "H": h, "T": t, "D": d, "E": e}
            rows.append(row)
            q, k, v = ((torch.randn(b, h, t, w, generator=gen) * s).to(dtype).to(device)
                       for w, s in ((d, 1.0), (d, 1.0), (e, 1.0)))
            out = fn(q, k, v)  # warm-up: compiles and autotunes
            ref = naive(q.double(), k.double(), v.double())
            rel = ((out.double() - ref).norm() / ref.norm()).item()
            if rel > 2e-2:
                row["error"] = f"relative error {rel:.2e}: results disagree, not timed"
                continue
            args = (q, k, v)
            times = [bench(lambda f=f, a=args: f(*a), device) if f is not None else float("nan")
                     for f in (fn, naive, compiled, chunked)]
            flops = 4 * b * h * t * t * d / 2  # the useful half of the quadratic form
            row.update(ours_ms=times[0], tflops=flops / (times[0] * 1e-3) / 1e12, eager_ms=times[1],
                       compile_ms=times[2], chunked_ms=times[3])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    args = parser.parse_args(argv)
    if not open_device("linear_attention.py", args.device):
        return 2
    header = (f"{'dtype':>5} {'B':>2} {'H':>3} {'T':>5} {'D':>4} | {'ms':>8} {'TFLOP/s':>7} | {'eager':>7} "
              f"{'compile':>7} {'chunked':>7} | {'eager/ours':>10} {'compile/ours':>12} {'chunked/ours':>12}")
    print_header(header)
    for r in measure(args.device, args.quick, not args.no_compile):
        lead = f"{r['dtype']:>5} {r['B']:>2} {r['H']:>3} {r['T']:>5} {r['D']:>4}"
        if "error" in r:
            print(f"{lead} | {r['error']}")
            continue
        t = r["ours_ms"]
        print(f"{lead} | {t:8.3f} {r['tflops']:7.1f} | {r['eager_ms']:7.3f} {r['compile_ms']:7.3f} "
              f"{r['chunked_ms']:7.3f} | {r['eager_ms'] / t:10.2f} {r['compile_ms'] / t:12.2f} "
              f"{r['chunked_ms'] / t:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
