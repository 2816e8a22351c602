"""Split-K GEMMs (the K loop shared among programs where the output tiles cannot fill the GPU,
a combine launch adding the partials) against the same program unsplit and against torch.

    python benchmarks/split_k.py                       # on a CUDA GPU
    python benchmarks/split_k.py --device cpu --quick   # a smoke run through the interpreter

For each shape (f16, C = A @ B with A: [M, K], B: [K, N]; M = 16, N = 4096, K = 16384 the
decode-sized one of the issue) it times, in one run and on the same random inputs (each
result checked against torch before it is timed):
  split    tiledsl's GEMM at its default configuration (split-K where its tiles are few)
  unsplit  the same program with @tile(SPLITS=1): one program per output tile
  torch    torch.matmul
and prints the split count and grid of the main launch, milliseconds, and baseline time /
tiledsl time (above 1: tiledsl is faster).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, bench, close, open_device, print_header  # noqa: E402

import tiledsl  # noqa: E402

GEMM = "kernel f(a: f16[M, K], b: f16[K, N]) -> f16[M, N] { return a @ b }"
SHAPES = [(16, 4096, 16384), (32, 8192, 8192), (64, 2048, 32768)]
QUICK_SHAPES = [(1, 17, 2000)]  # the interpreter's blocks: four splits


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__).parse_args(argv)
    if not open_device("split_k.py", args.device):
        return 0
    dev, g = args.device, torch.Generator().manual_seed(0)
    target = "cuda" if dev == "cuda" else "interpreter"
    split, unsplit = tiledsl.compile(GEMM), tiledsl.compile(f"@tile(SPLITS=1)\n{GEMM}")
    print_header(f"{'case':<28} | {'splits':>6} {'grid':>6} | {'tiledsl ms':>10} | {'baseline':<9} "
                 f"{'ms':>9} | ratio")
    for m, n, k in QUICK_SHAPES if args.quick else SHAPES:
        a = torch.randn(m, k, generator=g).to(torch.float16).to(dev)
        b = (torch.randn(k, n, generator=g) / k ** 0.5).to(torch.float16).to(dev)
        want = (a.float() @ b.float())
        close(split(a, b), want, "split", 2e-2)
        close(unsplit(a, b), want, "unsplit", 2e-2)
        (step,) = split.runtime.steps
        cfg = step.emitted.launch_config({"M": m, "N": n, "K": k}, target)
        case = f"f16 M={m} N={n} K={k}"
        ours = bench(lambda a=a, b=b: split(a, b), dev)
        for name, base in (("unsplit", bench(lambda a=a, b=b: unsplit(a, b), dev)),
                           ("torch", bench(lambda a=a, b=b: torch.matmul(a, b), dev))):
            print(f"{case:<28} | {cfg.constexprs['SPLITS']:>6} {cfg.grid[0]:>6} | {ours:>10.4f} | "
                  f"{name:<9} {base:>9.4f} | {base / ours:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
