"""Row softmax against torch.softmax and against a device copy of the same bytes.

    python benchmarks/softmax.py                    # on a CUDA GPU: the issue's table
    python benchmarks/softmax.py --device cpu --quick    # a smoke run through the interpreter

For rows of 4k to 32k columns (f16 and f32, 64 MiB of input per case) it
times, in one run and on the same random inputs:
  ours     tiledsl's row kernel (online softmax: one read when a row fits a
           block, two when it does not, one write)
  torch    torch.softmax
  copy     a device-to-device copy of the same tensor (one read, one write)
and prints GB/s (bytes read once plus bytes written once, over time) and the
ratios the issue sets goals for: ours >= torch.softmax, and >= 0.85x copy
bandwidth for rows that fit in one block (on an H100).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, bench, open_device, print_header  # noqa: E402

import tiledsl  # noqa: E402

SOURCE = "kernel softmax_rows(x: {dt}[M, N]) -> {dt}[M, N] {{ return softmax(x) }}"
DTYPES = {"f16": torch.float16, "f32": torch.float32}
COLUMNS = (4096, 8192, 16384, 32768)
BYTES = 64 << 20  # input bytes per case


def time_all(fn, x, device: str) -> tuple[float, float, float]:
    """Median ms of: ours, torch.softmax, a copy of x."""
    return (bench(lambda: fn(x), device), bench(lambda: torch.softmax(x, dim=-1), device),
            bench(lambda: x.clone(), device))


def measure(device: str, quick: bool = False) -> list[dict]:
    """One row per (dtype, row length): times in ms, or the error that kept it untimed."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, dtype in DTYPES.items():
        fn = tiledsl.compile(SOURCE.format(dt=name))
        assert [k.template for k in fn.kernels] == ["rows"], fn.explain()
        for n in ((96,) if quick else COLUMNS):
            m = 33 if quick else BYTES // (n * dtype.itemsize)
            row = {"dtype": name, "M": m, "N": n}
            rows.append(row)
            x = (torch.randn((m, n), generator=gen) * 4).to(dtype).to(device)
            out = fn(x)  # warm-up: compiles
            ref = torch.softmax(x.double(), dim=-1)
            err = (out.double() - ref).abs().max().item()
            if err > (1e-2 if dtype is torch.float16 else 1e-5):
                row["error"] = f"max error {err:.2e}: results disagree, not timed"
                continue
            (launch,) = [la for la in fn.launches if dict(la.dims)["N"] == n]
            target = device if device == "cuda" else "interpreter"
            row["one_pass"] = launch.kernel.launch_config(dict(launch.dims), target).constexprs["ONE_PASS"]
            t_ours, t_torch, t_copy = time_all(fn, x, device)
            row.update(ours_ms=t_ours, gbs=2 * x.numel() * dtype.itemsize / (t_ours * 1e-3) / 1e9,
                       torch_softmax_ms=t_torch, copy_ms=t_copy)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__).parse_args(argv)
    device = args.device
    if not open_device("softmax.py", device):
        return 2
    header = (f"{'M':>6} {'N':>6} {'dtype':>5} {'one block':>9} | {'ours ms':>8} {'GB/s':>7} | {'torch':>7} "
              f"{'copy':>7} | {'ours/torch':>10} {'ours/copy':>9}")
    print_header(header)
    for r in measure(device, args.quick):
        m, n, name = r["M"], r["N"], r["dtype"]
        if "error" in r:
            print(f"  {name} {m}x{n}: {r['error']}")
            continue
        t_ours, t_torch, t_copy = r["ours_ms"], r["torch_softmax_ms"], r["copy_ms"]
        print(f"{m:>6} {n:>6} {name:>5} {str(r['one_pass']):>9} | {t_ours:8.3f} {r['gbs']:7.1f} | "
              f"{t_torch:7.3f} {t_copy:7.3f} | {t_torch / t_ours:10.2f} {t_copy / t_ours:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
