"""Quantized GEMMs against torch: GPTQ's int4 weight, SmoothQuant's int8 linear layer and vLLM's
dynamic per-token fp8 linear layer.

    python benchmarks/quantized_gemm.py                    # on a CUDA GPU
    python benchmarks/quantized_gemm.py --device cpu --quick    # a smoke run through the interpreter

For LLaMA-7B's 4096 x 4096 projection at M = 16 (a decode's tokens) and 4096 (a prefill's)
it times, in one run and on the same random inputs:
  int4      tiledsl's GPTQ GEMM (`examples/gptq_int4_gemm.tdsl`: the packed weight unpacked,
            shifted by its group's zero point and scaled as each B tile is loaded; one kernel)
  f16       torch.matmul of x and the dequantized f16 weight (the weight already unpacked:
            the floor the int4 kernel's 4x fewer weight bytes have to beat at small M)
  int8      tiledsl's `examples/int8_gemm.tdsl` (i8 products summed in i32 on the tensor
            cores, the row and column scales in the epilogue; one kernel)
  int_mm    torch._int_mm and the scales in eager (where the device has it)
  fp8       tiledsl's `examples/fp8_per_token_linear.tdsl` (a row program quantizing each token
            to e4m3 with its scale, then the e4m3 GEMM with both scales in its epilogue: 2 kernels)
  scaled_mm the same in eager torch: vLLM's per-token quantization, then torch._scaled_mm with
            row-wise scales (where the device has it)
and prints times and the ratios f16 / int4, int_mm / int8 and scaled_mm / fp8 (above 1: tiledsl
faster).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, bench, open_device, print_header  # noqa: E402

import tiledsl  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SIZES = [(16, 4096, 4096), (4096, 4096, 4096)]
GROUP = 128


def dequantize(wq: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """GPTQ's f16 weight: nibble k % 8 of wq[k // 8], less its group's zero point, times its scale."""
    k = torch.arange(wq.shape[0] * 8, device=wq.device)[:, None]
    n = torch.arange(wq.shape[1], device=wq.device)[None, :]
    q = (wq[k // 8, n] >> (4 * (k % 8))) & 0xF
    return ((q.float() - zeros[k // GROUP, n].float()) * scales[k // GROUP, n].float()).half()


def int8_eager(xq, wq, sx, sw):
    return (torch._int_mm(xq, wq).float() * sx * sw).half()


def relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def int4_row(fn, m: int, n: int, k: int, gen: torch.Generator, device: str) -> dict:
    row = {"kind": "int4", "M": m, "N": n, "K": k}
    x = (torch.randn(m, k, generator=gen) * 0.1).half().to(device)
    wq = torch.randint(-2**31, 2**31, (k // 8, n), generator=gen, dtype=torch.int64).to(torch.int32)
    zeros = torch.randint(0, 16, (k // GROUP, n), generator=gen).half()
    scales = (torch.rand(k // GROUP, n, generator=gen) * 0.02).half()
    args = (x, wq.to(device), zeros.to(device), scales.to(device))
    w = dequantize(*args[1:])
    rel = relative(fn(*args), x.double() @ w.double())
    if rel > 1e-2:
        return row | {"error": f"relative error {rel:.2e}: results disagree, not timed"}
    row.update(ours_ms=bench(lambda: fn(*args), device), base_ms=bench(lambda: torch.matmul(x, w), device))
    return row


def int8_row(fn, m: int, n: int, k: int, gen: torch.Generator, device: str) -> dict:
    row = {"kind": "int8", "M": m, "N": n, "K": k}
    args = (torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8).to(device),
            torch.randint(-128, 128, (k, n), generator=gen, dtype=torch.int8).to(device),
            (torch.rand(m, 1, generator=gen) * 1e-3).to(device),
            (torch.rand(n, generator=gen) * 1e-3).to(device))
    xq, wq, sx, sw = (a.double() for a in args)
    rel = relative(fn(*args), (xq @ wq) * sx * sw)
    if rel > 1e-2:
        return row | {"error": f"relative error {rel:.2e}: results disagree, not timed"}
    row["ours_ms"] = bench(lambda: fn(*args), device)
    # torch._int_mm wants more than 16 rows on a GPU, and is CUDA's only
    row["base_ms"] = bench(lambda: int8_eager(*args), device) if device == "cuda" and m > 16 else float("nan")
    return row


def fp8_eager(x, w, w_scale):
    """vLLM's dynamic per-token fp8 linear in torch: quantize, then the row-wise scaled GEMM."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True) / 448.0
    q = (xf / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return torch._scaled_mm(q, w.T, scale_a=s, scale_b=w_scale.T, out_dtype=torch.bfloat16)


def fp8_row(fn, m: int, n: int, k: int, gen: torch.Generator, device: str) -> dict:
    row = {"kind": "fp8", "M": m, "N": n, "K": k}
    x = torch.randn(m, k, generator=gen).bfloat16().to(device)
    w = (torch.randn(n, k, generator=gen) * 8).to(torch.float8_e4m3fn).to(device)
    w_scale = (torch.rand(n, 1, generator=gen) * 0.01 + 0.001).to(device)
    xf = x.double()
    s = xf.abs().amax(-1, keepdim=True) / 448
    q = (xf / s).float().clamp(-448, 448).to(torch.float8_e4m3fn).double()
    want = (q @ w.double().T) * s * w_scale.double().T
    rel = relative(fn(x, w, w_scale), want)
    if rel > 2e-2:
        return row | {"error": f"relative error {rel:.2e}: results disagree, not timed"}
    row["ours_ms"] = bench(lambda: fn(x, w, w_scale), device)
    # torch._scaled_mm is CUDA's (sm_89 and later), with 16-aligned sizes
    row["base_ms"] = bench(lambda: fp8_eager(x, w, w_scale), device) if device == "cuda" and m % 16 == 0 \
        else float("nan")
    return row


def measure(device: str, quick: bool = False) -> list[dict]:
    """Three rows per size (int4, int8, fp8): times in ms, or the error that kept it untimed."""
    gen = torch.Generator().manual_seed(0)
    int4 = tiledsl.compile(ROOT / "examples" / "gptq_int4_gemm.tdsl")
    int8 = tiledsl.compile(ROOT / "examples" / "int8_gemm.tdsl")
    fp8 = tiledsl.compile(ROOT / "examples" / "fp8_per_token_linear.tdsl")
    assert len(int4.kernels) == 1 and len(int8.kernels) == 1 and len(fp8.kernels) == 2
    rows = []
    for m, n, k in [(17, 64, 256)] if quick else SIZES:
        rows += [int4_row(int4, m, n, k, gen, device), int8_row(int8, m, n, k, gen, device),
                 fp8_row(fp8, m, n, k, gen, device)]
    for row in rows:
        if "ours_ms" in row:
            row["tflops"] = 2 * row["M"] * row["N"] * row["K"] / (row["ours_ms"] * 1e-3) / 1e12
    return rows


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__).parse_args(argv)
    if not open_device("quantized_gemm.py", args.device):
        return 2
    header = (f"{'kind':>4} {'M':>5} {'N':>5} {'K':>5} | {'ours ms':>8} {'TFLOP/s':>7} | "
              f"{'baseline ms':>11} | {'baseline/ours':>13}")
    print_header(header)
    for r in measure(args.device, args.quick):
        if "error" in r:
            print(f"  {r['kind']} {r['M']}x{r['N']}x{r['K']}: {r['error']}")
            continue
        base = r["base_ms"]
        print(f"{r['kind']:>4} {r['M']:>5} {r['N']:>5} {r['K']:>5} | {r['ours_ms']:8.3f} "
              f"{r['tflops']:7.1f} | {base:11.3f} | {base / r['ours_ms']:13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
