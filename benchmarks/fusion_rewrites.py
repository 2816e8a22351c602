"""Fusions beyond one matmul's epilogue against torch and against tiledsl without them.

    python benchmarks/fusion_rewrites.py                 # on a CUDA GPU
    python benchmarks/fusion_rewrites.py --device cpu --quick   # a smoke run through the interpreter

Two programs (SwiGLU in f16 and bf16, the norm in bf16), timed in one run on the same
random inputs:
  swiglu     LLaMA's MLP (silu(x @ w1.T) * (x @ w3.T)) @ w2.T: a dual GEMM (x read once, two
             accumulators, the silu-mul epilogue) then the down projection, 2 kernels
  rms_proj   RMSNorm then a projection, cast(x * rsqrt(mean(x^2) + eps) * g) @ w.T: one GEMM
             that accumulates the row statistic in its K loop and scales rows in the epilogue
against
  unfused    the same program through tiledsl without the fusion (fuse-epilogue{dual-gemm=false}:
             3 kernels; no hoist-row-scale: a row kernel writing the normalised x, then the GEMM)
  eager      torch eager
  compile    torch.compile (Inductor) of the same function
and prints times, TFLOP/s (the GEMMs' 2*M*N*K per time) and baseline / fused ratios
(above 1: the fused program is faster).

Timing: triton.testing.do_bench (CUDA events, median) after a warm-up call that also
autotunes; inputs are random normal (never zeros).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, bench, open_device, print_header  # noqa: E402

import tiledsl  # noqa: E402
from tiledsl.api import DEFAULT_PIPELINE  # noqa: E402

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}

SWIGLU = """kernel swiglu(x: {dt}[M, K], w1: {dt}[F, K], w3: {dt}[F, K], w2: {dt}[N, F]) -> {dt}[M, N] {{
    return (silu(x @ w1.T) * (x @ w3.T)) @ w2.T
}}"""
RMS_PROJ = """kernel rms_proj(x: {dt}[M, K], g: {dt}[K], w: {dt}[N, K]) -> {dt}[M, N] {{
    xf = cast(x, f32)
    return cast(xf * rsqrt(mean(xf * xf, axis=-1, keepdims=true) + 1e-6) * g, {dt}) @ w.T
}}"""


def swiglu(x, w1, w3, w2):
    return (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def rms_proj(x, g, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * g).to(x.dtype) @ w.T


# (program, eager function, pipeline without the fusion, kernels fused / unfused, dtypes,
#  sizes (M, K, N[, F]), quick sizes). The norm is hoisted out of bf16 operands, not f16
# ones (unscaled, an f16 operand might overflow; hoist-row-scale)
CASES = {
    "swiglu": (SWIGLU, swiglu, DEFAULT_PIPELINE.replace("fuse-epilogue", "fuse-epilogue{dual-gemm=false}"),
               (2, 3), ("f16", "bf16"), [(4096, 4096, 4096, 11008), (8192, 4096, 4096, 14336)],
               [(33, 40, 24, 48)]),
    "rms_proj": (RMS_PROJ, rms_proj, DEFAULT_PIPELINE.replace("hoist-row-scale,", ""), (1, 2), ("bf16",),
                 [(4096, 4096, 12288), (8192, 8192, 8192)], [(33, 40, 24)]),
}


def inputs(name: str, size: tuple, dtype, device: str, gen) -> tuple:
    def rnd(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)

    if name == "swiglu":
        m, k, n, f = size
        return rnd(m, k), rnd(f, k, scale=k ** -0.5), rnd(f, k, scale=k ** -0.5), rnd(n, f, scale=f ** -0.5)
    m, k, n = size
    return rnd(m, k), rnd(k), rnd(n, k, scale=k ** -0.5)


def flops(name: str, size: tuple) -> int:
    if name == "swiglu":
        m, k, n, f = size
        return 2 * m * k * f * 2 + 2 * m * f * n
    m, k, n = size
    return 2 * m * k * n


def measure(device: str, quick: bool = False, with_compile: bool = True) -> list[dict]:
    """One row per (program, dtype, size): times in ms, or the error that kept it untimed."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, (src, eager, unfused_pipeline, (n_fused, n_unfused), dts, sizes, quick_sizes) in CASES.items():
        compiled = torch.compile(eager) if with_compile and device == "cuda" else None
        for dt in dts:
            dtype = DTYPES[dt]
            fn = tiledsl.compile(src.format(dt=dt))
            unfused = tiledsl.compile(src.format(dt=dt), pipeline=unfused_pipeline)
            assert (len(fn.kernels), len(unfused.kernels)) == (n_fused, n_unfused), fn.explain()
            for size in quick_sizes if quick else sizes:
                row = {"program": name, "dtype": dt, "size": "x".join(map(str, size)),
                       "kernels": n_fused, "unfused_kernels": n_unfused}
                rows.append(row)
                args = inputs(name, size, dtype, device, gen)
                out = fn(*args)  # warm-up: compiles and autotunes
                unfused(*args)
                ref = eager(*(a.float() for a in args))
                rel = ((out.float() - ref).norm() / ref.norm()).item()
                if rel > 2e-2:
                    row["error"] = f"relative error {rel:.2e}: results disagree, not timed"
                    continue
                t, t_unfused, t_eager, t_compile = time_all((fn, unfused, eager, compiled), args, device)
                row.update(ours_ms=t, tflops=flops(name, size) / (t * 1e-3) / 1e12, unfused_ms=t_unfused,
                           eager_ms=t_eager, compile_ms=t_compile)
    return rows


def time_all(functions: tuple, args: tuple, device: str) -> list[float]:
    """Median ms of each function on `args` (NaN for one not run on this device)."""
    return [bench(lambda f=f: f(*args), device) if f is not None else float("nan") for f in functions]


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    args = parser.parse_args(argv)
    if not open_device("fusion_rewrites.py", args.device):
        return 2
    header = (f"{'program':>8} {'dtype':>5} {'size':>22} | {'fused ms':>8} {'TFLOP/s':>7} | "
              f"{'unfused':>7} {'eager':>7} {'compile':>7} | {'unfused/fused':>13} {'eager/fused':>11} "
              f"{'compile/fused':>13}")
    print_header(header)
    for r in measure(args.device, args.quick, not args.no_compile):
        lead = f"{r['program']:>8} {r['dtype']:>5} {r['size']:>22}"
        if "error" in r:
            print(f"{lead} | {r['error']}")
            continue
        t = r["ours_ms"]
        print(f"{lead} | {t:8.3f} {r['tflops']:7.1f} | {r['unfused_ms']:7.3f} {r['eager_ms']:7.3f} "
              f"{r['compile_ms']:7.3f} | {r['unfused_ms'] / t:13.2f} {r['eager_ms'] / t:11.2f} "
              f"{r['compile_ms'] / t:13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
