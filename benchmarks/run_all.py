"""Every benchmark in one process: one markdown table of ratios, and the same as JSON.

    python benchmarks/run_all.py [--json results.json]      # on a CUDA GPU (about 5-8 min on an H100)
    python benchmarks/run_all.py --device cpu --quick       # a smoke run through the interpreter

Runs attention (against SDPA's flash backend, SDPA's default and eager math),
its derived backward and forward+backward (against SDPA flash's, and
FlexAttention's for a soft-capped score mod),
GEMM + multi-D epilogue (against torch.matmul alone, eager and torch.compile),
the dual GEMM and the norm -> GEMM rewrite (against tiledsl without them, eager and
torch.compile), causal linear attention (against flash-linear-attention's naive forms, eager
and torch.compile), the GPTQ int4, int8 and per-token fp8 GEMMs (against torch.matmul of the
dequantized f16 weight, torch._int_mm and torch._scaled_mm), the grouped MoE GEMM (against
Hugging Face's per-expert loop), tiledsl.nn's modules forward+backward (against torch's
modules, eager and torch.compile, and Liger-Kernel's where installed),
row softmax (against torch.softmax and a device copy) and host overhead
(against Triton's own dispatch and torch eager). Every baseline is timed in
the same run on the same inputs, and every ratio is baseline time / tiledsl
time: above 1 means tiledsl is faster. Each script's goals (its docstring)
are checked where they apply; the table marks a row that misses one.
(benchmarks/static_sm90.py compares kernels with tutorial-design references from their sm_90 SASS, no GPU.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import attention  # noqa: E402
import attention_backward  # noqa: E402
import fusion_rewrites  # noqa: E402
import gemm_epilogue  # noqa: E402
import host_overhead  # noqa: E402
import linear_attention  # noqa: E402
import moe_gemm  # noqa: E402
import nn_modules  # noqa: E402
import quantized_gemm  # noqa: E402
import softmax  # noqa: E402
from common import open_device  # noqa: E402

# (benchmark, row key of a baseline's time, its name in the table[, the row key of our time
# it compares with: "ours_ms" unless named])
BASELINES = {
    "attention": (("sdpa_flash_ms", "SDPA flash"), ("sdpa_default_ms", "SDPA default"),
                  ("eager_math_ms", "eager math")),
    "attention_backward": (("base_bwd_ms", "backward: SDPA flash / FlexAttention", "bwd_ms"),
                           ("base_fwd_bwd_ms", "forward+backward: the same", "fwd_bwd_ms")),
    "gemm_epilogue": (("matmul_ms", "torch.matmul alone"), ("eager_ms", "eager"),
                      ("compile_ms", "torch.compile")),
    "softmax": (("torch_softmax_ms", "torch.softmax"), ("copy_ms", "device copy")),
    "fusion_rewrites": (("unfused_ms", "tiledsl unfused"), ("eager_ms", "eager"),
                        ("compile_ms", "torch.compile")),
    "linear_attention": (("eager_ms", "FLA naive, eager"), ("compile_ms", "FLA naive, torch.compile"),
                         ("chunked_ms", "FLA chunked naive, eager")),
    # int4: torch.matmul of the dequantized f16 weight; int8: torch._int_mm and the scales; fp8:
    # per-token quantization and torch._scaled_mm
    "quantized_gemm": (("base_ms", "f16 GEMM of the dequantized weight / torch._int_mm / _scaled_mm"),),
    "moe_gemm": (("loop_ms", "Hugging Face's per-expert loop, eager"),),
    "nn_modules": (("eager_ms", "torch's module, eager"), ("compile_ms", "torch's module, torch.compile"),
                   ("liger_ms", "Liger-Kernel's module")),
}


def case(bench: str, row: dict) -> str:
    if bench == "attention_backward":
        return f"{row['dtype']} B={row['B']} H={row['H']} N={row['N']} D={row['D']} {row['variant']}"
    if bench == "attention":
        mask = " causal" if row["causal"] else ""
        return f"{row['dtype']} B={row['B']} H={row['H']} N={row['N']} D={row['D']}{mask}"
    if bench == "gemm_epilogue":
        return f"{row['dtype']} {row['M']}x{row['N']}x{row['K']}"
    if bench == "fusion_rewrites":
        return (f"{row['program']} {row['dtype']} {row['size']} ({row['kernels']} vs "
                f"{row['unfused_kernels']} kernels)")
    if bench == "linear_attention":
        return f"{row['dtype']} B={row['B']} H={row['H']} T={row['T']} D={row['D']} causal"
    if bench == "quantized_gemm":
        return f"{row['kind']} {row['M']}x{row['N']}x{row['K']}"
    if bench == "moe_gemm":
        return f"bf16 T={row['T']} E={row['E']} {row['N']}x{row['K']} sorted"
    if bench == "nn_modules":
        return f"{row['module']} {row['dtype']} {row['shape']} forward+backward"
    return f"{row['dtype']} {row['M']}x{row['N']}" + (" one pass" if row.get("one_pass") else "")


def rate(bench: str, row: dict) -> str:
    if bench == "softmax":
        return f"{row['gbs']:.0f} GB/s"
    if bench == "attention_backward":
        return f"{row['bwd_tflops']:.0f} TFLOP/s backward, {row['fwd_bwd_tflops']:.0f} forward+backward"
    if bench == "nn_modules":
        return ""
    return f"{row['tflops']:.0f} TFLOP/s"


def goal_misses(bench: str, row: dict, rows: list[dict]) -> list[str]:
    """The issue's goals a row misses (on an H100; only where the row is one they name)."""
    misses = []
    if bench == "attention" and row["D"] == 128 and not row["causal"]:
        if row["sdpa_flash_ms"] / row["ours_ms"] < 1.2:
            misses.append("< 1.2x SDPA flash")
        if row["tflops"] < 450:
            misses.append("< 450 TFLOP/s")
    if bench == "attention" and row["causal"]:
        full = [r for r in rows if not r["causal"] and "ours_ms" in r
                and (r["dtype"], r["N"], r["D"]) == (row["dtype"], row["N"], row["D"])]
        if full and row["ours_ms"] > 0.55 * full[0]["ours_ms"]:
            misses.append("causal > 0.55x non-causal")
    if bench == "attention_backward" and row["base_bwd_ms"] < row["bwd_ms"] and (
            row["variant"] == "softcap causal" or row["D"] == 128 and row["N"] >= 4096):
        misses.append("backward slower than " + ("FlexAttention's" if row["variant"] == "softcap causal"
                                                 else "SDPA flash's"))
    if bench == "gemm_epilogue" and row["ours_ms"] > 1.05 * row["matmul_ms"]:
        misses.append("> 1.05x torch.matmul")
    if bench == "fusion_rewrites" and row["ours_ms"] > row["unfused_ms"]:
        misses.append("slower than unfused")
    if bench == "softmax":
        if row["ours_ms"] > row["torch_softmax_ms"]:
            misses.append("slower than torch.softmax")
        if row["copy_ms"] / row["ours_ms"] < 0.85:
            misses.append("< 0.85x copy bandwidth")
    return misses


def ms(value: float) -> str:
    return "n/a" if value != value else f"{value:.3f} ms"  # NaN: not run on this device


def table(results: dict, on_gpu: bool) -> list[str]:
    lines = ["| benchmark | case | tiledsl | rate | baseline | baseline / tiledsl | goals |",
             "|---|---|---|---|---|---|---|"]
    for bench, rows in results["kernels"].items():
        for row in rows:
            if "error" in row:
                lines.append(f"| {bench} | {case(bench, row)} | not timed: {row['error']} | | | | |")
                continue
            misses = (", ".join(goal_misses(bench, row, rows)) or "met") if on_gpu else "n/a (no GPU)"
            for i, (key, name, *mine) in enumerate(BASELINES[bench]):
                ours = row[mine[0] if mine else "ours_ms"]
                ratio = row.get(key, float("nan")) / ours  # NaN: no baseline on this device
                first = (rate(bench, row), misses) if i == 0 else ("", "")
                lines.append(f"| {bench} | {case(bench, row) if i == 0 else ''} | {ms(ours)} | {first[0]} | "
                             f"{name} {ms(row.get(key, float('nan')))} | "
                             f"{'n/a' if ratio != ratio else f'{ratio:.2f}'} | {first[1]} |")
    for name, row in results["host_overhead"].items():
        ratio = row["triton_dispatch_us"] / row["tiledsl_us"]
        goal = "met" if row["goal_met"] else "over 2x Triton's dispatch + 10 us"
        lines.append(f"| host overhead | {name} | {row['tiledsl_us']:.1f} us | | Triton dispatch "
                     f"{row['triton_dispatch_us']:.1f} us | {ratio:.2f} | {goal} |")
        if "gpu_call_us" in row:
            eager, call = row["torch_eager_us"], row["gpu_call_us"]
            lines.append(f"| host overhead | {name} (GPU call) | {call:.1f} us | | torch eager "
                         f"{eager:.1f} us | {eager / call:.2f} | |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run, not a measurement)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if not open_device("run_all.py", args.device):
        return 2
    start = time.perf_counter()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (Triton's interpreter)"
    results: dict = {"device": device_name, "torch": torch.__version__, "kernels": {}}
    results["kernels"]["attention"] = attention.measure(args.device, args.quick)
    results["kernels"]["attention_backward"] = attention_backward.measure(args.device, args.quick)
    results["kernels"]["gemm_epilogue"] = gemm_epilogue.measure(args.device, args.quick)
    results["kernels"]["softmax"] = softmax.measure(args.device, args.quick)
    results["kernels"]["fusion_rewrites"] = fusion_rewrites.measure(args.device, args.quick)
    results["kernels"]["linear_attention"] = linear_attention.measure(args.device, args.quick)
    results["kernels"]["quantized_gemm"] = quantized_gemm.measure(args.device, args.quick)
    results["kernels"]["moe_gemm"] = moe_gemm.measure(args.device, args.quick)
    results["kernels"]["nn_modules"] = nn_modules.measure(args.device, args.quick)
    results["host_overhead"] = host_overhead.measure(3 if args.quick else 2000)
    results["seconds"] = round(time.perf_counter() - start, 1)
    print(f"tiledsl benchmarks on {device_name}, torch {torch.__version__}, "
          f"{results['seconds']} s{' (--quick: not a measurement)' if args.quick else ''}")
    print("\n".join(table(results, args.device == "cuda")))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
