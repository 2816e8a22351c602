"""Compile time of tiledsl.compile(): parse -> passes -> code generation (Triton JIT excluded).

    python benchmarks/compile_time.py [--repeat 30]

Reports the median compile time of examples/attention.tdsl, and of generated
elementwise programs of 250 to 4000 statements, with the time per statement
to show that cost grows linearly. Targets (issue 2): attention <= 30 ms
median, a 1000-statement program <= 2 s.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import tiledsl

ROOT = Path(__file__).resolve().parent.parent


def chain(n: int) -> str:
    """An elementwise program of n statements, each using the one before."""
    lines = ["kernel chain(x: f32[M, N], y: f32[M, N]) -> f32[M, N] {", "    a0 = x * y + 1.0"]
    lines += [f"    a{i} = a{i - 1} * 0.5 + y" for i in range(1, n)]
    lines += [f"    return a{n - 1}", "}"]
    return "\n".join(lines)


def median_time(source: str, repeat: int) -> float:
    tiledsl.compile(source)  # warm up: builds the parser tables, imports the backend
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        tiledsl.compile(source)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30, help="timed compiles per program (attention)")
    parser.add_argument("--quick", action="store_true", help="small programs only (a smoke run)")
    args = parser.parse_args(argv)

    cpu = platform.processor() or platform.machine()
    print(f"tiledsl {tiledsl.__version__}, Python {platform.python_version()}, {cpu}")
    attention = (ROOT / "examples" / "attention.tdsl").read_text()
    t = median_time(attention, args.repeat)
    print(f"\nexamples/attention.tdsl: median {t * 1e3:.2f} ms over {args.repeat} compiles (target <= 30 ms)")

    print("\nelementwise chain       median      per statement")
    for n in ((50, 100) if args.quick else (250, 500, 1000, 2000, 4000)):
        t = median_time(chain(n), max(3, args.repeat // 10))
        mark = "  (target <= 2 s)" if n == 1000 else ""
        print(f"  {n:5d} statements  {t * 1e3:9.1f} ms  {t / n * 1e6:8.1f} us{mark}")


if __name__ == "__main__":
    main()
