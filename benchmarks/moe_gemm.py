"""Mixture-of-experts GEMMs against torch: each token times its expert's weight.

    python benchmarks/moe_gemm.py                    # on a CUDA GPU
    python benchmarks/moe_gemm.py --device cpu --quick    # a smoke run through the interpreter

For Mixtral-8x7B's up projection (8 experts, 4096 -> 14336) over 4096 tokens (a prefill's) and 16
(a decode step's), the tokens sorted by their expert, it times, in one run and on the same
random inputs:
  ours     tiledsl's grouped GEMM (`x[:, None, :] @ w[expert].T`: a tile of tokens walks the
           experts its rows hold, each expert's weight tiles loaded once a tile; one kernel)
  loop     Hugging Face's per-expert loop in eager torch (`x[expert == e] @ w[e].T` for each
           expert, scattered back: Mixtral's MixtralSparseMoeBlock)
and prints times and the ratio loop / ours (above 1: tiledsl faster).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, bench, open_device, print_header  # noqa: E402

import tiledsl  # noqa: E402

SIZES = [(4096, 8, 14336, 4096), (16, 8, 14336, 4096)]  # (T, E, N, K)
PROGRAM = """kernel expert_linear(x: bf16[T, K], w: bf16[E, N, K], expert: i64[T]) -> bf16[T, N] {
    return (x[:, None, :] @ transpose(w[expert], 1, 2))[:, 0, :]
}"""


def per_expert_loop(x: torch.Tensor, w: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """Hugging Face's MoE block: the tokens of each expert through its weight, put back."""
    out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    for e in range(w.shape[0]):
        rows = (expert == e).nonzero().squeeze(-1)
        out[rows] = x[rows] @ w[e].T
    return out


def measure(device: str, quick: bool = False) -> list[dict]:
    """A row per size: times in ms, or the error that kept it untimed."""
    gen = torch.Generator().manual_seed(0)
    fn = tiledsl.compile(PROGRAM)
    assert len(fn.kernels) == 1 and fn.kernels[0].template == "matmul"
    return [size_row(fn, *size, gen, device) for size in ([(37, 4, 48, 64)] if quick else SIZES)]


def size_row(fn, t: int, e: int, n: int, k: int, gen: torch.Generator, device: str) -> dict:
    row = {"T": t, "E": e, "N": n, "K": k}
    x = (torch.randn(t, k, generator=gen) * 0.1).bfloat16().to(device)
    w = (torch.randn(e, n, k, generator=gen) * k ** -0.5).bfloat16().to(device)
    expert = torch.randint(0, e, (t,), generator=gen).sort().values.to(device)
    ours, want = fn(x, w, expert), per_expert_loop(x, w, expert)
    gap = ((ours.double() - want.double()).norm() / want.double().norm()).item()
    if gap > 1e-2:
        return row | {"error": f"relative error {gap:.2e}: results disagree, not timed"}
    row.update(ours_ms=bench(lambda: fn(x, w, expert), device),
               loop_ms=bench(lambda: per_expert_loop(x, w, expert), device))
    row["tflops"] = 2 * t * n * k / (row["ours_ms"] * 1e-3) / 1e12
    return row


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__).parse_args(argv)
    if not open_device("moe_gemm.py", args.device):
        return 2
    header = (f"{'T':>5} {'E':>3} {'N':>6} {'K':>5} | {'ours ms':>8} {'TFLOP/s':>7} | {'loop ms':>8} | "
              f"{'loop/ours':>9}")
    print_header(header)
    for r in measure(args.device, args.quick):
        if "error" in r:
            print(f"  {r['T']}x{r['N']}x{r['K']}: {r['error']}")
            continue
        print(f"{r['T']:>5} {r['E']:>3} {r['N']:>6} {r['K']:>5} | {r['ours_ms']:8.3f} {r['tflops']:7.1f} | "
              f"{r['loop_ms']:8.3f} | {r['loop_ms'] / r['ours_ms']:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
