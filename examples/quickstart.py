"""Quick start: compile examples/attention.tdsl, run it, check it, and look inside.

On a machine with a CUDA GPU the kernels run compiled; without one they run
through Triton's interpreter on the CPU (same generated code, smaller sizes).
Exits with status 1 if the result does not match torch.
"""

from __future__ import annotations

import pathlib
import sys
import time

import torch
import torch.nn.functional as F

import tiledsl
from tiledsl import testing

HERE = pathlib.Path(__file__).parent


def main() -> int:
    fn = tiledsl.compile(HERE / "attention.tdsl")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, H, M, N, D = (4, 16, 1024, 1024, 64) if device == "cuda" else (1, 2, 113, 203, 64)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=gen).half().to(device) for L in (M, N, N))
    scale = D**-0.5

    start = time.perf_counter()
    out = fn(q, k, v, scale=scale)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    where = "GPU" if device == "cuda" else "CPU (Triton interpreter)"
    print(f"compiled @{fn.name}: {len(fn.kernels)} Triton kernel(s); ran on {where} in "
          f"{elapsed * 1e3:.0f} ms (first call, includes Triton compilation)")
    print(f"  q, k, v: {tuple(q.shape)} {q.dtype} -> out {tuple(out.shape)} {out.dtype}")

    # torch's own causal attention (top-left aligned, like tiledsl's causal())
    sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=scale)
    print(f"  max |out - torch SDPA|        = {(out.float() - sdpa).abs().max().item():.2e}")
    report = testing.check(fn, q, k, v, scale=scale)
    o = report.outputs[0]
    print(f"  max |out - float64 reference| = {o.error:.2e}  (eager f16: {o.eager_error:.2e}; "
          f"{'ok' if report.ok else 'MISMATCH'})")

    print("\n--- graph IR (fn.ir('graph')) ---")
    print(fn.ir("graph"), end="")
    print("\n--- after canonicalize (fn.ir('canonicalize')) ---")
    print(fn.ir("canonicalize"), end="")
    print("\n--- fusion report (fn.explain()) ---")
    print(fn.explain(), end="")
    first = fn.kernels[0]
    print(f"\n--- Triton source of {first.name} (fn.kernels[0].source) ---")
    print(first.source, end="")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
