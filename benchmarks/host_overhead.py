"""Host overhead of one call: tiledsl's Python against Triton's own dispatch.

    python benchmarks/host_overhead.py           # a table
    python benchmarks/host_overhead.py --json    # {"attention": {"tiledsl_us": ..,
                                                 #   "triton_dispatch_us": ..}, ..}

For each example program (attention, rmsnorm, softmax, the multiply-multiply
GEMM) at decode-sized shapes, after a warm-up call:

  tiledsl_us          one `fn(*args)` on the CUDA dispatch path (argument
                      binding and validation, the launch-plan lookup, output
                      allocation, kernel arguments) with Triton's launch
                      replaced by a no-op: the `run` of each kernel function
                      records its arguments and returns.
  triton_dispatch_us  Triton's own `JITFunction.run` for the same kernels and
                      arguments (binding and specializing them, the kernel
                      cache lookup, the grid), with the compiled kernel's
                      launch replaced by a no-op the same way.

Both run on a CPU-only machine: tensors stay on the CPU, and Triton's dispatch
runs against a stand-in driver that reports an sm_90 target (the kernels are
compiled for it, once, without a GPU). On a GPU the real driver is used, and
the script also reports real small-shape call latency (wall clock per call,
back to back, synchronized once per batch) of the compiled program and of
the same program run op by op in torch eager (`fn.reference`).

The goal (issue 9): tiledsl_us <= 2 * triton_dispatch_us + 10 for every program.
Timing is the median over 7 batches of `--calls` calls (perf_counter).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import tiledsl
from tiledsl import testing

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# (example file, dim sizes): decode-sized calls
PROGRAMS = {
    "attention": ("attention.tdsl", {"B": 1, "H": 8, "M": 1, "N": 256, "D": 64}),
    "rmsnorm": ("rmsnorm.tdsl", {"M": 4, "N": 4096}),
    "softmax": ("softmax.tdsl", {"M": 4, "N": 1024}),
    "gemm_multiply_multiply": ("gemm_multiply_multiply.tdsl", {"M": 16, "N": 256, "K": 256}),
    # four views per call: q and the result reshaped, k and v sliced with a new axis
    "gqa_attention": ("gqa_attention.tdsl", {"B": 1, "H": 8, "KH": 2, "S": 64, "D": 64}),
}


def arguments(fn: tiledsl.Program, dims: dict, device: str) -> list:
    """Random arguments in parameter order (a positional call)."""
    return list(testing.random_inputs(fn, dims, device, torch.Generator().manual_seed(0)).values())


class _NoLaunch:
    """A kernel function whose launch only records what it was given."""

    def __init__(self, real, calls: list) -> None:
        self.real, self.calls = real, calls

    def run(self, *args, grid, warmup, **options) -> None:
        self.calls.append((self.real, args, grid, options))


def per_call_us(call, calls: int) -> float:
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def tiledsl_dry(fn: tiledsl.Program, args: list, calls: int) -> tuple[float, list]:
    """tiledsl's cost per call with launches as no-ops, and one call's launches."""
    runtime = fn.runtime
    recorded: list = []
    real_load = runtime.load
    runtime.target = lambda device: "cuda"
    runtime.load = lambda emitted, target: _NoLaunch(real_load(emitted, target), recorded)
    fn(*args)  # builds the launch plan
    recorded.clear()
    fn(*args)
    launches = list(recorded)
    return per_call_us(lambda: fn(*args), calls), launches


class _Target:
    """A stand-in for Triton's CUDA driver on a machine without one: what dispatch asks."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")


class _Compiled:
    """A compiled kernel whose launch is a no-op (what dispatch touches, nothing more)."""

    def __init__(self) -> None:
        self.function, self.packed_metadata = None, None

    def launch_metadata(self, grid, stream, *args) -> None:
        return None  # what it returns with no launch hooks installed

    def run(self, *args) -> None:
        pass


def triton_dispatch(launches: list, calls: int) -> float:
    """Triton's `JITFunction.run` for the recorded launches, with no-op kernel launches."""
    from triton.runtime.driver import driver

    fake = not torch.cuda.is_available()
    active = driver._active
    if fake:
        driver.set_active(_Target())
    try:
        for jit, args, grid, options in launches:
            jit.run(*args, grid=grid, warmup=True, **options)  # compile (for sm_90), never launch
            for cache in jit.device_caches.values():
                for key, kernel in list(cache[0].items()):
                    if not isinstance(kernel, _Compiled):
                        cache[0][key] = _Compiled()

        def dispatch() -> None:
            for jit, args, grid, options in launches:
                jit.run(*args, grid=grid, warmup=False, **options)

        return per_call_us(dispatch, calls)
    finally:
        driver._active = active


def gpu_latency(fn: tiledsl.Program, args: list, calls: int) -> tuple[float, float]:
    """Real per-call latency on the GPU: the compiled program and torch eager, in µs."""
    def batch(call):
        call()
        torch.cuda.synchronize()
        times = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / calls * 1e6)
        return statistics.median(times)

    return batch(lambda: fn(*args)), batch(lambda: fn.reference(*args))


def measure(calls: int = 2000) -> dict[str, dict]:
    """Per example program: tiledsl's and Triton's dispatch cost in µs (and, on a GPU, the
    real call latency against torch eager)."""
    results = {}
    for name, (path, dims) in PROGRAMS.items():
        fn = tiledsl.compile(EXAMPLES / path)
        args = arguments(fn, dims, "cpu")
        ours, launches = tiledsl_dry(fn, args, calls)
        theirs = triton_dispatch(launches, calls)
        row = {"tiledsl_us": round(ours, 2), "triton_dispatch_us": round(theirs, 2),
               "kernels": len(launches), "goal_met": ours <= 2 * theirs + 10}
        if torch.cuda.is_available():
            gpu_fn = tiledsl.compile(EXAMPLES / path)
            real, eager = gpu_latency(gpu_fn, arguments(gpu_fn, dims, "cuda"), calls // 4)
            row.update(gpu_call_us=round(real, 2), torch_eager_us=round(eager, 2))
        results[name] = row
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed batch")
    opts = parser.parse_args(argv)
    results = measure(opts.calls)
    if opts.json:
        print(json.dumps(results))
        return 0
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only (stand-in driver)"
    print(f"host overhead per call, {where}; torch {torch.__version__}")
    header = f"{'program':<24}{'kernels':>8}{'tiledsl us':>12}{'triton us':>11}{'goal':>6}"
    if torch.cuda.is_available():
        header += f"{'GPU call us':>13}{'eager us':>10}"
    print(header)
    print("-" * len(header))
    for name, row in results.items():
        line = (f"{name:<24}{row['kernels']:>8}{row['tiledsl_us']:>12.1f}{row['triton_dispatch_us']:>11.1f}"
                f"{'met' if row['goal_met'] else 'MISS':>6}")
        if "gpu_call_us" in row:
            line += f"{row['gpu_call_us']:>13.1f}{row['torch_eager_us']:>10.1f}"
        print(line)
    return 0 if all(r["goal_met"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
