"""Compile time of tiledsl.compile(): parse -> passes -> code generation (Triton JIT excluded).

    python benchmarks/compile_time.py [--repeat 30]

Reports the median compile time of examples/attention.tdsl, and of generated
programs of 250 to 2000 statements of several shapes (an elementwise chain;
`x = x - mean(x, keepdims=true)`, which chains dependent row reductions; a
chain of scalar statements; softmax after softmax; matmul after matmul), with
the time and the generated source per statement, to show that both grow
linearly. Then how fast an oversized input is refused. Targets: attention
<= 30 ms median (issue 2); 2000 statements of any shape in under 5 s, source
linear in the statements, a 2 MB input refused in well under a second
(issue 8).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import tiledsl

ROOT = Path(__file__).resolve().parent.parent


def chain(n: int) -> str:
    """An elementwise program of n statements, each using the one before."""
    lines = ["kernel chain(x: f32[M, N], y: f32[M, N]) -> f32[M, N] {", "    a0 = x * y + 1.0"]
    lines += [f"    a{i} = a{i - 1} * 0.5 + y" for i in range(1, n)]
    lines += [f"    return a{n - 1}", "}"]
    return "\n".join(lines)


def repeated(header: str, statement: str, ret: str) -> Callable[[int], str]:
    return lambda n: "\n".join([header, *([f"    {statement}"] * n), f"    {ret}", "}"])


FAMILIES: dict[str, Callable[[int], str]] = {
    "elementwise chain": chain,
    "x - mean(x)": repeated("kernel k(x: f32[M, N]) -> f32[M, N] {",
                            "x = x - mean(x, keepdims=true)", "return x"),
    "scalar chain": repeated("kernel k(x: f32[M, N], s: f32) -> f32[M, N] {", "s = s * 1.01 + N",
                             "return x * s"),
    "softmax chain": repeated("kernel k(x: f32[M, N]) -> f32[M, N] {", "x = softmax(x) * 2.0",
                              "return x"),
    "matmul chain": repeated("kernel k(x: f32[N, N], w: f32[N, N]) -> f32[N, N] {", "x = relu(x @ w)",
                             "return x"),
}


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

    for family, make in FAMILIES.items():
        print(f"\n{family:<22}  median     per statement   source per statement")
        for n in ((50, 100) if args.quick else (250, 500, 1000, 2000)):
            source = make(n)
            t = median_time(source, max(3, args.repeat // 10))
            size = sum(len(k.source) for k in tiledsl.compile(source).kernels)
            mark = "  (target < 5 s)" if n == 2000 else ""
            print(f"  {n:5d} statements  {t * 1e3:9.1f} ms  {t / n * 1e6:8.1f} us  {size / n:9.0f} B{mark}")

    big = "kernel k(x: f32[N]) -> f32[N] {\n" + "    x = x * 1.5 + 2.0\n" * 100_000 + "    return x\n}\n"
    start = time.perf_counter()
    try:
        tiledsl.compile(big)
    except tiledsl.TileDSLError as err:
        print(f"\na {len(big) / 1e6:.1f} MB input: refused in {(time.perf_counter() - start) * 1e3:.1f} ms "
              f"({err.message})")

if __name__ == "__main__":
    main()
