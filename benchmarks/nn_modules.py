"""tiledsl.nn's modules, forward and backward, against torch's and Liger-Kernel's.

    python benchmarks/nn_modules.py                      # on a CUDA GPU
    python benchmarks/nn_modules.py --device cpu --quick # a smoke run through the interpreter

For each drop-in module at the sizes of a LLaMA-style 7B-class layer (bf16; f32 in a
--quick run) it times one forward and backward (the gradients of every input and
parameter along one random cotangent), in one run and on the same inputs:
  ours      tiledsl.nn's module
  eager     the torch module it replaces (for Attention: SDPA with is_causal)
  compile   the same under torch.compile (left out of a --quick run: minutes on a CPU)
  liger     Liger-Kernel's module, where `liger_kernel` imports and a GPU runs it
Every module's output is first checked against torch's; a row that disagrees is not
timed. Ratios are baseline time / tiledsl time: above 1 means tiledsl is faster.
"""

from __future__ import annotations

import copy
import math
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, bench, open_device, print_header  # noqa: E402

import tiledsl.nn as tnn  # noqa: E402

CAUSAL = "where(index(s, -1) <= index(s, -2), s, -inf)"


def _liger():
    """Liger-Kernel's transformers module, or None where it is not installed."""
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        return None
    return liger


class Eager(nn.Module):
    """A function of a module run as torch ops: the baseline over a copy of tiledsl's
    module's own parameters (Hugging Face's LlamaMLP for SwiGLU)."""

    def __init__(self, module: nn.Module, forward: Callable) -> None:
        super().__init__()
        self.module, self.fn = copy.deepcopy(module), forward

    def forward(self, *args):
        return self.fn(self.module, *args)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def torch_rotary(q, k, cos, sin):
    cos, sin = cos[:, None], sin[:, None]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@dataclass
class Case:
    """One module: how to build tiledsl's, torch's and Liger's (callables of the inputs),
    and its inputs."""

    name: str
    shape: str
    ours: Callable[[], Callable]
    torch: Callable[[], Callable]
    liger: Callable[[object], Callable] | None
    inputs: Callable[[torch.Generator], tuple]
    tol: float


def cases(quick: bool, dtype: torch.dtype, device: str) -> list[Case]:
    rows, dim, hidden, vocab = (17, 64, 96, 113) if quick else (8192, 4096, 11008, 32000)
    b, h, t, d = (2, 2, 17, 16) if quick else (4, 32, 2048, 128)
    tol = 1e-4 if dtype is torch.float32 else 3e-2

    def tensor(g, *shape, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(dtype).to(device)

    def module(m: nn.Module) -> nn.Module:
        return m.to(device=device, dtype=dtype)

    def rotary_inputs(g):
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2) / d))
        emb = torch.cat([torch.arange(t)[:, None] * inv[None, :]] * 2, dim=-1).expand(b, t, d)
        return (tensor(g, b, h, t, d), tensor(g, b, h, t, d), emb.cos().to(dtype).to(device),
                emb.sin().to(dtype).to(device))

    def labels(g):
        y = torch.randint(0, vocab, (rows,), generator=g)
        y[::7] = -100
        return y.to(device)

    torch.manual_seed(0)
    swiglu = module(tnn.SwiGLU(dim, hidden))

    def liger_swiglu(liger) -> nn.Module:
        m = liger.LigerSwiGLUMLP(types.SimpleNamespace(hidden_size=dim, intermediate_size=hidden,
                                                       hidden_act="silu"))
        module(m).load_state_dict(swiglu.state_dict())
        return m

    return [
        Case("RMSNorm", f"{rows}x{dim}", lambda: module(tnn.RMSNorm(dim, eps=1e-6)),
             lambda: module(nn.RMSNorm(dim, eps=1e-6)),
             lambda lg: module(lg.LigerRMSNorm(dim, eps=1e-6, in_place=False)),
             lambda g: (tensor(g, rows, dim),), tol),
        Case("LayerNorm", f"{rows}x{dim}", lambda: module(tnn.LayerNorm(dim)),
             lambda: module(nn.LayerNorm(dim)),
             lambda lg: module(lg.LigerLayerNorm(dim, eps=1e-5, bias=True)),
             lambda g: (tensor(g, rows, dim),), tol),
        Case("SwiGLU", f"{rows}x{dim}->{hidden}", lambda: swiglu,
             lambda: Eager(swiglu, lambda m, x: m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))),
             liger_swiglu, lambda g: (tensor(g, rows, dim),), tol),
        Case("CrossEntropyLoss", f"{rows}x{vocab}", lambda: tnn.CrossEntropyLoss(),
             lambda: nn.CrossEntropyLoss(), lambda lg: lg.LigerCrossEntropyLoss(),
             lambda g: (tensor(g, rows, vocab, scale=2.0), labels(g)), tol),
        Case("apply_rotary", f"{b}x{h}x{t}x{d}", lambda: tnn.apply_rotary, lambda: torch_rotary,
             lambda lg: lg.liger_rotary_pos_emb, rotary_inputs, tol),
        Case("Attention causal", f"{b}x{h}x{t}x{d}", lambda: tnn.Attention(CAUSAL),
             lambda: lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), None,
             lambda g: tuple(tensor(g, b, h, t, d) for _ in range(3)), tol),
    ]


def forward_backward(fn: Callable, inputs: tuple, cotangents: list) -> Callable[[], tuple]:
    """A call of fn on fresh leaves of `inputs` (the floating-point ones need gradients)
    that takes the gradients of every floating-point input and parameter."""
    params = list(fn.parameters()) if isinstance(fn, nn.Module) else []

    def run() -> tuple:
        leaves = [x.detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        wrt = [x for x in leaves if x.requires_grad] + params
        return outs, torch.autograd.grad(outs, wrt, cotangents)

    return run


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def measure(device: str, quick: bool = False) -> list[dict]:
    """One row per module: times in ms (NaN where a baseline is absent), or the error that
    kept it untimed."""
    dtype = torch.float32 if quick else torch.bfloat16
    liger = _liger() if device == "cuda" else None
    rows = []
    for case in cases(quick, dtype, device):
        g = torch.Generator().manual_seed(0)
        inputs = case.inputs(g)
        row = {"module": case.name, "shape": case.shape, "dtype": str(dtype).removeprefix("torch."),
               "liger": "not installed" if liger is None and device == "cuda" else None}
        rows.append(row)
        ours, theirs = case.ours(), case.torch()
        with torch.no_grad():
            shapes = theirs(*inputs)
        cots = [torch.randn(o.shape, generator=g).to(o.dtype).to(device)
                for o in (shapes if isinstance(shapes, tuple) else (shapes,))]
        ref_outs, ref_grads = forward_backward(theirs, inputs, cots)()
        outs, grads = forward_backward(ours, inputs, cots)()
        err = max(_max_rel(a, b) for a, b in zip((*outs, *grads), (*ref_outs, *ref_grads), strict=True))
        if not math.isfinite(err) or err > case.tol:
            row["error"] = f"max relative difference from torch's {err:.1e}: not timed"
            continue
        row["ours_ms"] = bench(forward_backward(ours, inputs, cots), device)
        row["eager_ms"] = bench(forward_backward(theirs, inputs, cots), device)
        compiled = forward_backward(torch.compile(theirs), inputs, cots)
        row["compile_ms"] = math.nan if quick else bench(compiled, device)
        row["liger_ms"] = math.nan
        if liger is not None and case.liger is not None:
            try:
                row["liger_ms"] = bench(forward_backward(case.liger(liger), inputs, cots), device)
            except Exception as e:  # a Liger version without this module or argument
                row["liger"] = f"{type(e).__name__}: {e}"[:80]
    return rows


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__).parse_args(argv)
    if not open_device("nn_modules.py", args.device):
        return 2
    header = (f"{'module':>17} {'shape':>20} {'dtype':>8} | {'ours ms':>8} | {'eager/ours':>10} "
              f"{'compile/ours':>12} {'liger/ours':>10}")
    print_header(header)
    for r in measure(args.device, args.quick):
        if "error" in r:
            print(f"{r['module']:>17} {r['shape']:>20}: {r['error']}")
            continue
        ours = r["ours_ms"]
        print(f"{r['module']:>17} {r['shape']:>20} {r['dtype']:>8} | {ours:8.3f} | "
              f"{r['eager_ms'] / ours:10.2f} {r['compile_ms'] / ours:12.2f} {r['liger_ms'] / ours:10.2f}"
              + (f"  (Liger: {r['liger']})" if r["liger"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
