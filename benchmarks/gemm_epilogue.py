"""GEMM with a fused epilogue against torch: composable-kernel's E = (A @ B) * D * E.

    python benchmarks/gemm_epilogue.py                 # on a CUDA GPU: the issue's table
    python benchmarks/gemm_epilogue.py --device cpu --quick   # a smoke run through the interpreter

For (M, N, K) = (8192, 8192, {1024, 2048, 4096, 8192}) in f16 and bf16 it times,
in one run and on the same random inputs:
  fused     tiledsl's one kernel (matmul + both multiplies in the epilogue)
  matmul    torch.matmul alone (the floor: the epilogue's reads are extra bytes)
  eager     torch eager, unfused: mm, then each multiply
  compile   torch.compile of the same function (Inductor)
and prints times, TFLOP/s (2*M*N*K / time) and the ratios the issue sets goals for:
fused <= 1.05x matmul, eager >= 1.7x fused at K = 2048 (on an H100).

Timing: triton.testing.do_bench (CUDA events, median) after a warm-up call that
also runs tiledsl's autotuning; inputs are random normal (never zeros).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, bench, open_device, print_header  # noqa: E402

import tiledsl  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SIZES = [(8192, 8192, k) for k in (1024, 2048, 4096, 8192)]
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


def eager(a, b, d, e):
    return torch.matmul(a, b) * d * e


def time_all(fn, compiled, args: tuple, device: str) -> tuple[float, float, float, float]:
    """Median ms of: the fused kernel, torch.matmul alone, torch eager, torch.compile."""
    a, b, _, _ = args
    return (bench(lambda: fn(*args), device), bench(lambda: torch.matmul(a, b), device),
            bench(lambda: eager(*args), device),
            bench(lambda: compiled(*args), device) if compiled else float("nan"))


def measure(device: str, quick: bool = False, with_compile: bool = True) -> list[dict]:
    """One row per (dtype, size): times in ms, or the error that kept it untimed."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, dtype in DTYPES.items():
        src = (ROOT / "examples" / "gemm_multiply_multiply.tdsl").read_text().replace("f16", name)
        fn = tiledsl.compile(src)
        assert len(fn.kernels) == 1, fn.explain()
        compiled = torch.compile(eager) if with_compile and device == "cuda" else None
        for m, n, k in [(113, 96, 64)] if quick else SIZES:
            row = {"dtype": name, "M": m, "N": n, "K": k}
            rows.append(row)
            a, b, d, e = (torch.randn(shape, generator=gen).to(dtype).to(device)
                          for shape in ((m, k), (k, n), (m, n), (m, n)))
            out = fn(a, b, d, e)  # warm-up: compiles and autotunes
            ref = eager(a.float(), b.float(), d.float(), e.float())
            rel = ((out.float() - ref).norm() / ref.norm()).item()
            if rel > 2e-2:
                row["error"] = f"relative error {rel:.2e}: results disagree, not timed"
                continue
            t_fused, t_mm, t_eager, t_comp = time_all(fn, compiled, (a, b, d, e), device)
            row.update(ours_ms=t_fused, tflops=2 * m * n * k / (t_fused * 1e-3) / 1e12,
                       matmul_ms=t_mm, eager_ms=t_eager, compile_ms=t_comp)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    args = parser.parse_args(argv)
    if not open_device("gemm_epilogue.py", args.device):
        return 2
    header = (f"{'M':>5} {'N':>5} {'K':>5} {'dtype':>5} | {'fused ms':>8} {'TFLOP/s':>7} | {'matmul':>7} "
              f"{'eager':>7} {'compile':>7} | {'fused/mm':>8} {'eager/fused':>11} {'compile/fused':>13}")
    print_header(header)
    for r in measure(args.device, args.quick, not args.no_compile):
        m, n, k, name = r["M"], r["N"], r["K"], r["dtype"]
        if "error" in r:
            print(f"  {name} {m}x{n}x{k}: {r['error']}")
            continue
        t_fused, t_mm, t_eager, t_comp = r["ours_ms"], r["matmul_ms"], r["eager_ms"], r["compile_ms"]
        print(f"{m:>5} {n:>5} {k:>5} {name:>5} | {t_fused:8.3f} {r['tflops']:7.1f} | {t_mm:7.3f} "
              f"{t_eager:7.3f} {t_comp:7.3f} | {t_fused / t_mm:8.2f} {t_eager / t_fused:11.2f} "
              f"{t_comp / t_fused:13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
