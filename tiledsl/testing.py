"""The numerics oracle of design section 5, and random inputs for a program.

    report = check(fn, *args, **kwargs)
    assert report.ok, report

The golden result is the program run op by op in float64; the yardstick is
the same program run eagerly in the input dtypes. The compiled result passes
when its max-abs error against the golden is at most 2 x the eager error +
1e-5, and it has no NaN where the golden has none. Equal infinities count as
no error; an infinity where the golden differs counts as an infinite error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tiledsl.api import Program
from tiledsl.binding import eval_shape, torch_dtype
from tiledsl.types import DType


@dataclass(frozen=True)
class OutputReport:
    error: float  # max |compiled - golden|
    eager_error: float  # max |eager - golden|
    bad_nan: int  # NaNs where the golden has none

    @property
    def tolerance(self) -> float:
        return 2 * self.eager_error + 1e-5

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance and not self.bad_nan


@dataclass(frozen=True)
class Report:
    outputs: tuple[OutputReport, ...]

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    def __str__(self) -> str:
        return "; ".join(
            f"output {i}: error {o.error:.3g} (tolerance {o.tolerance:.3g} = 2 x eager "
            f"{o.eager_error:.3g} + 1e-5), {o.bad_nan} NaN where the golden has none"
            for i, o in enumerate(self.outputs))


def max_error(value: torch.Tensor, golden: torch.Tensor) -> float:
    """Max abs error, ignoring places where both are the same infinity or both NaN."""
    v, g = value.double().cpu(), golden.double().cpu()
    same = (v == g) | (v.isnan() & g.isnan())
    diff = torch.where(same, torch.zeros((), dtype=torch.float64), (v - g).abs())
    diff = torch.where(diff.isnan(), torch.full((), float("inf"), dtype=torch.float64), diff)
    return diff.max().item() if diff.numel() else 0.0


def as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def compare(outputs, golden, eager) -> Report:
    reports = []
    for out, gold, ref in zip(as_tuple(outputs), as_tuple(golden), as_tuple(eager), strict=True):
        o, g = out.double().cpu(), gold.double().cpu()
        bad_nan = int((o.isnan() & ~g.isnan()).sum())
        reports.append(OutputReport(max_error(out, gold), max_error(ref, gold), bad_nan))
    return Report(tuple(reports))


def check(fn: Program, *args: Any, **kwargs: Any) -> Report:
    """Run `fn` and compare it with the float64 golden and the eager yardstick."""
    outputs = fn(*args, **kwargs)
    golden = fn.reference(*args, float64=True, **kwargs)
    eager = fn.reference(*args, **kwargs)
    return compare(outputs, golden, eager)


def check_grads(fn: Program, *args: Any, generator: torch.Generator | None = None,
                as_given: bool = False, **kwargs: Any) -> Report:
    """The oracle for gradients: `fn` is called on the arguments with every floating-point
    tensor requiring grad, its outputs are pulled back along random cotangents through its
    backward program, and each parameter's gradient is compared with torch autograd of the
    reference in float64 (golden) and in the input dtypes (the eager yardstick).
    `as_given`: the compiled call differentiates the arguments themselves (detached, their
    strides kept), not contiguous copies. The cotangents come from `generator`, by default
    one seeded with 0: never torch's global one, whose state depends on what ran before."""
    from tiledsl.backends import reference
    from tiledsl.binding import BoundCall, bind

    generator = generator if generator is not None else torch.Generator().manual_seed(0)

    graph = fn.source_graph
    bound = bind(graph, args, kwargs)
    wrt = list(fn.differentiable)
    if not wrt:
        raise ValueError(f"'{fn.name}' has no floating-point tensor argument to differentiate")

    def leaves(dtype: torch.dtype | None = None, copy: bool = True) -> list[Any]:
        return [(v.detach().to(dtype or v.dtype).clone() if copy else v.detach()).requires_grad_(True)
                if i in wrt else v for i, v in enumerate(bound.values)]

    def pull(values: list[Any], outs: Any, cotangents: list[torch.Tensor] | None) -> list:
        """Gradients along one random cotangent per floating-point output (the same in every
        run; outputs that do not depend on a differentiated input are left out)."""
        outs = [o for o in (outs if isinstance(outs, list | tuple) else [outs])]
        if cotangents is None:
            cotangents = [torch.randn(o.shape, generator=generator) for o in outs]
        pairs = [(o, c.to(device=o.device, dtype=o.dtype)) for o, c in zip(outs, cotangents, strict=True)
                 if o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], [values[i] for i in wrt],
                                    [c for _, c in pairs], allow_unused=True) if pairs else [None] * len(wrt)
        return cotangents, [torch.zeros_like(values[i]) if g is None else g
                            for i, g in zip(wrt, grads, strict=True)]

    compiled_in = leaves(copy=not as_given)
    cotangents, compiled = pull(compiled_in, fn(*compiled_in), None)
    gold_in = leaves(torch.float64)
    golden = pull(gold_in, reference.run(graph, BoundCall(gold_in, bound.dims, bound.device),
                                         float64=True), cotangents)[1]
    eager_in = leaves()
    eager = pull(eager_in, reference.run(graph, BoundCall(eager_in, bound.dims, bound.device)),
                 cotangents)[1]
    return compare(tuple(compiled), tuple(golden), tuple(eager))


def random_inputs(fn: Program, dims: Mapping[str, int], device: str = "cpu",
                  generator: torch.Generator | None = None,
                  scalars: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Random arguments for every parameter: normal floats, small ints, random masks."""
    graph = fn.fused_graph()
    out: dict[str, Any] = {}
    for node in graph.params:
        op = graph.op(node)
        name, t = op.attr("name"), op.attr("type")
        if scalars and name in scalars:
            out[name] = scalars[name]
            continue
        if op.attr("scalar"):
            r = torch.rand((), generator=generator).item()
            out[name] = r > 0.5 if t.dtype is DType.BOOL else (int(r * 7) + 1 if t.dtype.is_int else 0.25 + r)
            continue
        shape = eval_shape(t.shape, dims)
        if t.dtype.is_float:
            value = torch.randn(shape, generator=generator, dtype=torch.float32)
        elif t.dtype.is_int:
            value = torch.randint(-50, 50, shape, generator=generator, dtype=torch.int32)
        else:
            value = torch.rand(shape, generator=generator) > 0.5
        out[name] = value.to(device=device, dtype=torch_dtype(t.dtype))
    return out


def needed_dims(fn: Program) -> list[str]:
    """The dim symbols a call of `fn` binds, in order of first appearance (those of a
    parameter's dim expression, like a backward's `H // KH`, included)."""
    from tiledsl.dims import symbols

    graph = fn.fused_graph()
    seen: dict[str, None] = {}
    for node in graph.params:
        for d in graph.op(node).attr("type").shape:
            if isinstance(d, str):
                for symbol in symbols(d):
                    seen.setdefault(symbol)
    return list(seen)
