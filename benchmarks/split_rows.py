"""Split row programs (a reduction across rows as partials plus a combine launch) against the
same programs unsplit and against torch.

    python benchmarks/split_rows.py                    # on a CUDA GPU
    python benchmarks/split_rows.py --device cpu --quick    # a smoke run through the interpreter

It times, in one run and on the same random inputs (each result checked against torch
before it is timed):
  cross-entropy mean (bf16 logits, M tokens, V = 32000)
    split    tiledsl's one kernel: the per-token loss and its sum over the tokens as
             partials, the mean in the combine launch
    unsplit  tiledsl's per-token loss kernel, then torch's mean of it
    torch    F.cross_entropy
  RMSNorm backward (f32, M = 16384 rows of N = 4096)
    split    tiledsl's derived backward: dx and the weight's column sums in one kernel
    torch    eager autograd of the same RMSNorm
  global norm (f32, M x 4096)
    split    tiledsl's sum over every element, split over programs
    torch    torch.linalg.vector_norm
and prints milliseconds and baseline time / tiledsl time (above 1: tiledsl is faster).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, bench, close, open_device, print_header  # noqa: E402

import tiledsl  # noqa: E402

CE_MEAN = """kernel ce(x: bf16[M, V], y: i64[M]) -> f32[] {
    xf = cast(x, f32)
    return mean(logsumexp(xf, axis=-1) - gather(xf, y), axis=0)
}"""
CE_ROWS = """kernel ce_rows(x: bf16[M, V], y: i64[M]) -> f32[M] {
    xf = cast(x, f32)
    return logsumexp(xf, axis=-1) - gather(xf, y)
}"""
RMSNORM = """kernel rms(x: f32[M, N], w: f32[N]) -> f32[M, N] {
    return x * rsqrt(mean(x * x, axis=-1, keepdims=true) + 1e-6) * w
}"""
NORM = "kernel norm(x: f32[M, N]) -> f32[] { return sqrt(sum(x * x, axis=None)) }"


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__).parse_args(argv)
    if not open_device("split_rows.py", args.device):
        return 0
    dev, g = args.device, torch.Generator().manual_seed(0)
    m, v, n = (37, 301, 113) if args.quick else (8192, 32000, 4096)
    rows = 53 if args.quick else 16384
    print_header(f"{'case':<32} | {'tiledsl ms':>10} | {'baseline':<9} {'ms':>9} | ratio")

    def line(case: str, ours: float, name: str, base: float) -> None:
        print(f"{case:<32} | {ours:>10.4f} | {name:<9} {base:>9.4f} | {base / ours:5.2f}")

    x = (torch.randn(m, v, generator=g) * 3).to(torch.bfloat16).to(dev)
    y = torch.randint(0, v, (m,), generator=g).to(dev)
    split, unsplit = tiledsl.compile(CE_MEAN), tiledsl.compile(CE_ROWS)
    want = F.cross_entropy(x.float(), y)
    close(split(x, y), want, "cross-entropy mean", 2e-3)
    close(unsplit(x, y).mean(), want, "cross-entropy rows", 2e-3)
    ours = bench(lambda: split(x, y), dev)
    line(f"cross-entropy mean M={m} V={v}", ours, "unsplit", bench(lambda: unsplit(x, y).mean(), dev))
    line(f"cross-entropy mean M={m} V={v}", ours, "torch", bench(lambda: F.cross_entropy(x.float(), y), dev))

    xs, w = torch.randn(rows, n, generator=g).to(dev), torch.randn(n, generator=g).to(dev)
    dy = torch.randn(rows, n, generator=g).to(dev)
    training = tiledsl.compile(RMSNORM).training((0, 1))
    _, *saved = training.forward(xs, w)  # what the training forward saves: the rows' mean of squares

    def backward(xs, w, dy):
        return training.backward(xs, w, *saved, dy)

    def torch_backward():
        xr, wr = xs.detach().requires_grad_(), w.detach().requires_grad_()
        out = xr * torch.rsqrt((xr * xr).mean(-1, keepdim=True) + 1e-6) * wr
        return torch.autograd.grad(out, [xr, wr], dy)

    for a, b in zip(backward(xs, w, dy), torch_backward(), strict=True):
        close(a, b, "RMSNorm backward", 2e-3)
    line(f"RMSNorm backward M={rows} N={n}", bench(lambda: backward(xs, w, dy), dev), "torch",
         bench(torch_backward, dev))

    norm = tiledsl.compile(NORM)
    close(norm(xs), torch.linalg.vector_norm(xs), "global norm", 2e-3)
    line(f"global norm M={rows} N={n}", bench(lambda: norm(xs), dev), "torch",
         bench(lambda: torch.linalg.vector_norm(xs), dev))
    return 0


if __name__ == "__main__":
    sys.exit(main())
