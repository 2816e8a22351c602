"""What the benchmark scripts share: arguments, the device check, the timer, the table header."""

from __future__ import annotations

import argparse
import time

import torch


def arguments(doc: str) -> argparse.ArgumentParser:
    """A parser with --device (cuda, or cpu through the interpreter) and --quick."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run, not a measurement)")
    return parser


def open_device(script: str, device: str) -> bool:
    """Say which device measures; False (with the reason printed) when CUDA was asked for and is absent."""
    if device != "cuda":
        return True
    if not torch.cuda.is_available():
        print(f"{script} measures on a CUDA GPU and none is available here; nothing was measured "
              "(use --device cpu --quick for a smoke run)")
        return False
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    return True


def print_header(header: str) -> None:
    print(header)
    print("-" * len(header))


def bench(fn, device: str) -> float:
    """Median milliseconds of fn(): CUDA events via triton.testing.do_bench on a GPU, a wall clock
    (median of 3 after one warm-up call) on the CPU."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def close(a, b, what: str, tol: float) -> None:
    """Check a result against torch's before it is timed (rtol and atol `tol`)."""
    if not torch.allclose(a.double(), b.double(), rtol=tol, atol=tol):
        gap = (a.double() - b.double()).abs().max()
        raise AssertionError(f"{what}: tiledsl and torch disagree by {gap:.3e}")
