#!/usr/bin/env python3
"""Run the random-program differential fuzzer (tests/fuzzgen.py) at scale.

    python scripts/fuzz_programs.py --count 20000 --jobs 2 [--seed 0] [--sm90-every 10] [--out F]
    python scripts/fuzz_programs.py --grads --count 2000    # gradients (fuzzgen.run_grads)

Program i is generated from seed (base seed, i), so any finding reproduces
with `--seed S --first I --count 1`. Prints each failing program (source,
sizes, what went wrong) and a summary with how many passed the oracle, were
rejected with a located error, overflowed in their own dtypes, or missed it only
at the drawn inputs, not at inputs moved by an ulp ("unstable", see `fuzzgen.run`);
exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def one(job: tuple[int, int, int, bool]) -> tuple[int, str, str, str]:
    import fuzzgen

    base, i, sm90_every, grads = job
    program = fuzzgen.generate(random.Random(f"{base}:{i}"), seed=i)
    try:
        outcome = fuzzgen.run_grads(program) if grads else \
            fuzzgen.run(program, sm90=sm90_every > 0 and i % sm90_every == 0)
    except Exception as err:  # noqa: BLE001 - the driver reports, never dies
        outcome = fuzzgen.Outcome("fail", f"driver: {type(err).__name__}: {err}")
    return (i, f"# M={program.m} N={program.n} B={program.b} H={program.h} seed={i}\n{program.source}",
            outcome.status, outcome.detail)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, help="also write the findings here")
    p.add_argument("--sm90-every", type=int, default=10,
                   help="also compile every Nth program's kernels for H100 (0: never)")
    p.add_argument("--grads", action="store_true",
                   help="check each program's gradients instead of its outputs")
    args = p.parse_args()
    start = time.perf_counter()
    jobs = [(args.seed, i, args.sm90_every, args.grads) for i in range(args.first, args.first + args.count)]
    failures = []
    statuses: collections.Counter = collections.Counter()
    with multiprocessing.get_context("spawn").Pool(args.jobs, maxtasksperchild=500) as pool:
        for done, (i, source, status, detail) in enumerate(pool.imap_unordered(one, jobs, chunksize=8), 1):
            statuses[status] += 1
            if status == "fail":
                failures.append((i, source, detail))
                print(f"FAIL {i}: {detail[:300]}\n{source}", flush=True)
            if done % 500 == 0:
                print(f"... {done}/{len(jobs)} programs, {len(failures)} failing, "
                      f"{time.perf_counter() - start:.0f} s", flush=True)
    summary = (f"{len(jobs)} programs, {len(failures)} failing ({dict(sorted(statuses.items()))}), "
               f"{time.perf_counter() - start:.0f} s")
    print(summary)
    if args.out:
        args.out.write_text(summary + "\n" + "\n".join(f"FAIL {i}: {o}\n{s}" for i, s, o in failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
