"""tiledsl against the peers' own kernels, statically, for sm_90 and without a GPU (issue 46).

    pip install -e ".[peers]"      # the peer's kernels, pinned (Liger-Kernel 0.8.5)
    python benchmarks/static_peers.py [--json rows.json] [--only SUBSTRING]

Each op runs as a model's training step needs it, at LLaMA-7B-class sizes: 8192 rows of 4096
in bf16 (B = 2, S = 4096, 32 heads of 128 for RoPE), a vocabulary of 128256 for the loss.
Our side is the op written as Hugging Face writes it, compiled by tiledsl (its forward, or
the backward its training derives, or both); the peer's is Liger-Kernel's own @triton.jit
kernels, launched as Liger's Python launches them (its block sizes, warps, persistent
grids), both compiled for sm_90 as Triton would on an H100 (`references.sm90.compile_sm90`,
`aot.inspect_launch`). Per op and side it prints:
  kernels      launches (the peer's small torch launches around its kernel counted too)
  B/elt        HBM bytes per element of the op: "code" from each kernel's hottest loop (global
               load and store bytes per unit of work, times the units the kernel runs),
               "design" ours from the fusion report's traffic model, the peer's counted
               from its source (below)
  instr/elt    warp instructions per element, all kernels
  regs, spills the most of any kernel (per thread)
  time         modeled H100 microseconds: each kernel's largest of its tensor, issue, MUFU and
               memory cycles per unit of work (`loop_profile`, the code's bytes), times its
               units over 132 SMs, plus 2 us a launch; an estimate, not a measurement
  design       the same with the design's bytes at 3.35 TB/s as the memory time (a roofline:
               loads of what a program loaded before, a gathered partner half, hit the cache)
  ratio        tiledsl / peer, of both times and of bytes (code)

The elements of an op: x's for a norm, q's and k's for RoPE, the logits for the loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # this compiles for a GPU: Triton must not interpret

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from references.sm90 import Build, report  # noqa: E402

import tiledsl  # noqa: E402
from tiledsl import cost  # noqa: E402
from tiledsl.backends.triton import aot  # noqa: E402
from tiledsl.backends.triton.loop_profile import HBM_BYTES_PER_CLOCK  # noqa: E402
from tiledsl.binding import eval_shape  # noqa: E402
from tiledsl.plans import MergedPlan, PointwisePlan  # noqa: E402

SMS = 132
CLOCK_GHZ = 1.83
HBM_BYTES_PER_US = 3.35e6  # an H100 SXM's 3.35 TB/s
LAUNCH_US = 2.0  # a kernel launch's fixed cost, about what a dependent launch costs on an H100

ROWS, HIDDEN, VOCAB = 8192, 4096, 128256
B, S, H, D = 2, 4096, 32, 128

RMS_NORM = """kernel rms_norm(x: bf16[N, D], w: bf16[D], eps: f32) -> bf16[N, D] {
    xf = cast(x, f32)
    r = rsqrt(mean(xf * xf, axis=-1, keepdims=true) + eps)
    return w * cast(xf * r, bf16)
}"""

LAYER_NORM = """kernel layer_norm(x: bf16[N, D], w: bf16[D], b: bf16[D], eps: f32) -> bf16[N, D] {
    xf = cast(x, f32)
    mu = mean(xf, axis=-1, keepdims=true)
    xc = xf - mu
    r = rsqrt(mean(xc * xc, axis=-1, keepdims=true) + eps)
    return cast(xc * r * cast(w, f32) + cast(b, f32), bf16)
}"""

ROPE = """kernel rope(q: bf16[B, H, S, D], k: bf16[B, KH, S, D], cos: bf16[B, S, D],
                 sin: bf16[B, S, D]) -> (bf16[B, H, S, D], bf16[B, KH, S, D]) {
    c = cos[:, None]
    s = sin[:, None]
    qr = q * c + concat(-q[..., D // 2:], q[..., :D // 2], axis=-1) * s
    kr = k * c + concat(-k[..., D // 2:], k[..., :D // 2], axis=-1) * s
    return qr, kr
}"""

CROSS_ENTROPY = """kernel cross_entropy(logits: bf16[N, V], labels: i64[N]) -> f32 {
    x = cast(logits, f32)
    ignored = labels == -100
    nll = logsumexp(x, axis=-1) - gather(x, where(ignored, 0, labels), axis=-1)
    return sum(where(ignored, 0.0, nll), axis=0) / sum(where(ignored, 0.0, 1.0), axis=0)
}"""


@dataclass(frozen=True)
class PeerKernel:
    build: Build
    units: int  # the units of work (`build.work_unit`) the launch runs


@dataclass(frozen=True)
class Op:
    name: str
    program: str
    dims: dict[str, int]
    elements: int
    ours: Callable[[Any], list[Any]]  # the compiled program -> the programs whose kernels run
    peer: Callable[[], list[PeerKernel]]
    peer_design_bytes: float  # per element, counted from the peer's source
    peer_extra_launches: int = 0  # small torch launches around the peer's kernels
    notes: list[str] = field(default_factory=list)


def liger():
    try:
        from liger_kernel.ops import cross_entropy, layer_norm, rms_norm, rope
    except ImportError as err:
        raise SystemExit(f"static_peers needs Liger-Kernel: pip install --no-deps liger-kernel==0.8.5 einops "
                         f"({err})") from None
    return rms_norm, layer_norm, rope, cross_entropy


def rms_norm_backward() -> list[PeerKernel]:
    """Liger's rms_norm_backward at 4096 columns: the row kernel (BLOCK_SIZE 4096 > 256), one
    program per SM walking its rows, dW's per-program partials summed by torch after."""
    rms_norm, *_ = liger()
    import triton.language as tl

    per = -(-ROWS // SMS)
    args = {"dY_ptr": torch.bfloat16, "dY_row_stride": HIDDEN, "dX_ptr": torch.bfloat16,
            "dX_row_stride": HIDDEN, "X_ptr": torch.bfloat16, "X_row_stride": HIDDEN,
            "W_ptr": torch.bfloat16, "W_row_stride": 1, "RSTD_ptr": torch.float32, "RSTD_row_stride": 1,
            "dW_ptr": torch.float32, "dW_row_stride": HIDDEN, "n_rows": ROWS, "n_cols": HIDDEN,
            "offset": 0.0, "rows_per_program": per}
    consts = {"X_dtype": tl.bfloat16, "casting_mode": 0, "elementwise_affine": True, "BLOCK_SIZE": 4096,
              "COMPUTE_DW": True}
    build = Build("liger rms_norm_backward", "rows", rms_norm._rms_norm_backward_kernel, args, consts,
                  8, 3, HIDDEN, "element")
    return [PeerKernel(build, ROWS * HIDDEN)]


def layer_norm_backward() -> list[PeerKernel]:
    """Liger's layer_norm_backward: a persistent row kernel, dW and dB partials per program."""
    _, layer_norm, *_ = liger()
    per = -(-ROWS // SMS)
    args = {"X_ptr": torch.bfloat16, "stride_x": HIDDEN, "W_ptr": torch.bfloat16, "Mean_ptr": torch.float32,
            "stride_mean": 1, "RSTD_ptr": torch.float32, "stride_rstd": 1, "DX_ptr": torch.bfloat16,
            "stride_dx": HIDDEN, "DW_ptr": torch.float32, "stride_dw": HIDDEN, "DB_ptr": torch.float32,
            "stride_db": HIDDEN, "DY_ptr": torch.bfloat16, "stride_dy": HIDDEN, "n_rows": ROWS,
            "n_cols": HIDDEN}
    consts = {"rows_per_program": per, "BLOCK_SIZE": 4096, "COMPUTE_DW": True, "COMPUTE_DB": True}
    build = Build("liger layer_norm_backward", "rows", layer_norm._layer_norm_backward_kernel, args, consts,
                  8, 3, HIDDEN, "element")
    return [PeerKernel(build, ROWS * HIDDEN)]


def rope_kernel(backward: bool) -> list[PeerKernel]:
    """Liger's _triton_rope: one program per token, every head of q and k, in place."""
    *_, rope, _ = liger()
    args = {"q_ptr": torch.bfloat16, "q_row_stride": H * D, "k_ptr": torch.bfloat16, "k_row_stride": H * D,
            "cos": torch.bfloat16, "cos_row_stride": D, "sin": torch.bfloat16, "sin_row_stride": D,
            "sl": S}
    consts = {"bs": B, "cos_bs": B, "n_qh": H, "n_kh": H, "hd": D, "pad_n_qh": H, "pad_n_kh": H,
              "pad_hd": D, "pad_rd": D, "rd": D, "BLOCK_SIZE": H, "BACKWARD_PASS": backward}
    name = "liger rope " + ("backward" if backward else "forward")
    build = Build(name, "rows", rope._triton_rope, args, consts, 4, 3, 2 * H * D, "element")
    return [PeerKernel(build, B * S * 2 * H * D)]


def cross_entropy_kernel() -> list[PeerKernel]:
    """Liger's liger_cross_entropy_kernel: loss and gradient in one program per row, two
    passes over the logits in blocks of 32768, 32 warps on Hopper (its launcher)."""
    *_, cross_entropy = liger()
    args = {"X_ptr": torch.bfloat16, "X_stride": VOCAB, "Y_ptr": torch.int64, "Y_stride": 1,
            "weight_ptr": torch.float32, "loss_ptr": torch.bfloat16, "z_loss_ptr": torch.bfloat16,
            "loss_stride": 1, "token_accuracy_ptr": torch.float32, "token_accuracy_stride": 0,
            "predicted_tokens_ptr": torch.int64, "predicted_tokens_stride": 0, "n_cols": VOCAB,
            "n_non_ignore": ROWS - 17, "sum_non_ignore_weight": ROWS - 17, "weight_sum": 0.0,
            "ignore_index": -100, "softcap": 0.0}
    consts = {"lse_square_scale": 0.0, "label_smoothing": 0.0, "reduction": "mean",
              "RETURN_Z_LOSS": False, "RETURN_TOKEN_ACCURACY": False, "RETURN_PREDICTED_TOKENS": False,
              "BLOCK_SIZE": 32768, "HAS_WEIGHT": False, "HAS_SOFTCAPPING": False, "HAS_GRADIENTS": True}
    build = Build("liger cross_entropy", "rows", cross_entropy.liger_cross_entropy_kernel, args, consts,
                  32, 3, 32768, "element")
    return [PeerKernel(build, ROWS * VOCAB)]


def ops() -> list[Op]:
    norm = {"N": ROWS, "D": HIDDEN}
    rope_dims = {"B": B, "H": H, "KH": H, "S": S, "D": D}
    return [
        Op("RMSNorm backward", RMS_NORM, norm, ROWS * HIDDEN, lambda fn: [fn.training((0, 1)).backward],
           rms_norm_backward, 6.0, peer_extra_launches=1,
           notes=["the peer: dY, X read, dX written (the saved rstd per row); dW's [132, 4096] f32 "
                  "partials summed by torch.sum"]),
        Op("LayerNorm backward", LAYER_NORM, norm, ROWS * HIDDEN,
           lambda fn: [fn.training((0, 1, 2)).backward], layer_norm_backward, 6.0, peer_extra_launches=2,
           notes=["the peer: dY, X read, dX written (mean and rstd saved per row); dW's and dB's "
                  "partials summed by torch.sum"]),
        Op("RoPE forward", ROPE, rope_dims, B * S * 2 * H * D, lambda fn: [fn], lambda: rope_kernel(False),
           4.0, peer_extra_launches=2,
           notes=["the peer: q, k read and written in place, in [B, S, H, D]: Hugging Face's [B, H, S, D] "
                  "is transposed and copied first (its two launches counted, not their bytes)"]),
        Op("RoPE backward", ROPE, rope_dims, B * S * 2 * H * D, lambda fn: [fn.training((0, 1)).backward],
           lambda: rope_kernel(True), 4.0, peer_extra_launches=2,
           notes=["the peer: the forward with sin negated, dq and dk in place"]),
        Op("cross-entropy forward+backward", CROSS_ENTROPY, {"N": ROWS, "V": VOCAB}, ROWS * VOCAB,
           lambda fn: [fn.training((0,)).forward, fn.training((0,)).backward], cross_entropy_kernel, 6.0,
           peer_extra_launches=6,
           notes=["the peer: the logits read twice (the log-sum-exp, then the gradient) and the "
                  "gradient written over them; around it torch counts the rows not ignored and checks "
                  "the labels' range (each a sync), zero-fills the losses and sums them"]),
    ]


def _units(plan: Any, dims: dict[str, int]) -> int:
    if isinstance(plan, MergedPlan):
        return sum(_units(m.plan, dims) for m in plan.members)
    return int(torch.Size(eval_shape(plan.shape, dims)).numel())


def _costs(loop: dict[str, Any], units: int) -> dict[str, float]:
    """A kernel's totals over `units` of work: GPU cycles (over the SMs), HBM bytes and warp
    instructions."""
    modeled = loop["modeled"]
    per_unit = max(modeled[k] for k in ("tensor", "issue", "mufu", "memory")) / loop["work"]
    compute = max(modeled[k] for k in ("tensor", "issue", "mufu")) / loop["work"]
    return {"cycles": per_unit * units / SMS, "compute_cycles": compute * units / SMS,
            "bytes": modeled["memory"] * HBM_BYTES_PER_CLOCK / loop["work"] * units,
            "instructions": loop["instructions"] * loop["warps"] / loop["work"] * units}


def ours(op: Op) -> dict[str, Any]:
    fn = tiledsl.compile(op.program)
    kernels, design = [], 0
    for program in op.ours(fn):
        graph = program.fused_graph()
        design += sum(cost.evaluate(cost.kernel_traffic(graph.op(k)), op.dims) for k in graph.kernels())
        workspace = 0
        for launch in aot.meta_launches(program, op.dims):
            r = aot.inspect_launch(launch)
            # a split row program's combine merges the f32 partials its first launch wrote
            units = workspace // 4 if r.function.endswith("_combine") else \
                _units(launch.kernel.kernel.plan, dict(launch.dims))
            workspace = r.workspace_bytes
            plan = launch.kernel.kernel.plan
            if isinstance(plan, MergedPlan) and all(isinstance(m.plan, PointwisePlan) for m in plan.members):
                # no loop: the profile is the whole function, every member's code once, and a
                # program runs one member's: each member's units cost a share of it
                units /= len(plan.members)
            kernels.append({"name": r.function, "registers": r.registers, "spills": r.spill_bytes,
                            "config": r.config, **_costs(r.loop, units)})
    return _side(kernels, len(kernels), design / op.elements, op.elements)


def peer(op: Op) -> dict[str, Any]:
    kernels = []
    for k in op.peer():
        r = report(k.build)
        kernels.append({"name": k.build.name, "registers": r["registers"], "spills": r["spill_bytes"],
                        "config": r["config"], **_costs(r["loop"], k.units)})
    return _side(kernels, len(kernels) + op.peer_extra_launches, op.peer_design_bytes, op.elements)


def _side(kernels: list[dict[str, Any]], launches: int, design: float, elements: int) -> dict[str, Any]:
    cycles = sum(k["cycles"] for k in kernels)
    compute_us = sum(k["compute_cycles"] for k in kernels) / (CLOCK_GHZ * 1e3)
    return {"kernels": kernels, "launches": launches, "design_bytes": design,
            # a roofline of the design's HBM bytes and the code's issue, tensor and MUFU cycles:
            # what the time would be where a kernel's loads of what it loaded before (a
            # gathered partner half, a row read again) hit the cache
            "design_time_us": max(compute_us, design * elements / HBM_BYTES_PER_US) + LAUNCH_US * launches,
            "code_bytes": sum(k["bytes"] for k in kernels) / elements,
            "instructions": sum(k["instructions"] for k in kernels) / elements,
            "registers": max(k["registers"] for k in kernels), "spills": max(k["spills"] for k in kernels),
            "time_us": cycles / (CLOCK_GHZ * 1e3) + LAUNCH_US * launches}


HEADER = (f"{'op':32} {'side':7} | {'kernels':>7} {'B/elt code':>10} {'design':>6} {'instr/elt':>9} "
          f"{'regs':>4} {'spills':>6} {'time us':>8} {'design':>6} | {'ratio time':>10} {'design':>6} "
          f"{'bytes':>5}")


def lines(name: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = []
    for side, s in (("tiledsl", a), ("peer", b)):
        ratio = ""
        if side == "tiledsl":
            times = a["time_us"] / b["time_us"], a["design_time_us"] / b["design_time_us"]
            ratio = f"{times[0]:>10.2f} {times[1]:>6.2f} {a['code_bytes'] / b['code_bytes']:>5.2f}"
        label = name if side == "tiledsl" else ""
        out.append(f"{label:32} {side:7} | {s['launches']:>7} {s['code_bytes']:>10.2f} "
                   f"{s['design_bytes']:>6.2f} {s['instructions']:>9.3f} {s['registers']:>4} "
                   f"{s['spills']:>6} {s['time_us']:>8.1f} {s['design_time_us']:>6.1f} | {ratio}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write every kernel's figures as JSON")
    parser.add_argument("--only", metavar="SUBSTRING", help="only the ops whose name contains it")
    args = parser.parse_args(argv)
    liger()
    print(HEADER)
    print("-" * len(HEADER))
    table = []
    for op in ops():
        if args.only is not None and args.only not in op.name:
            continue
        a, b = ours(op), peer(op)
        table.append({"op": op.name, "tiledsl": a, "peer": b, "notes": op.notes})
        for text in lines(op.name, a, b):
            print(text, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": table}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
