#!/usr/bin/env python3
"""Mutation fuzzing of program text (tests/fuzzgen.py: `mutate`, `compile_outcome`).

    python scripts/fuzz_parser.py --count 100000 [--seed 0] [--jobs 2]

Mutates the example and FileCheck programs; every mutant must compile or be
refused with a located, non-internal TileDSLError. Prints each finding and a
summary; exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def batch(job: tuple[int, int, int]) -> tuple[int, list[tuple[str, str]]]:
    import fuzzgen

    base, first, count = job
    sources = fuzzgen.seeds()
    findings = []
    for i in range(first, first + count):
        rng = random.Random(f"{base}:{i}")
        text = fuzzgen.mutate(rng, rng.choice(sources))
        outcome = fuzzgen.compile_outcome(text)
        if outcome is not None:
            findings.append((repr(text), outcome))
    return count, findings


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    start = time.perf_counter()
    size = 250
    jobs = [(args.seed, f, min(size, args.count - f)) for f in range(0, args.count, size)]
    total, findings = 0, []
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        for count, found in pool.imap_unordered(batch, jobs):
            total += count
            for text, outcome in found:
                findings.append(outcome)
                print(f"FAIL: {outcome[:300]}\n  input: {text[:2000]}", flush=True)
    print(f"{total} mutated programs, {len(findings)} failing, {time.perf_counter() - start:.0f} s")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
