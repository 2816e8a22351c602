"""Sharding rules for DTensor, derived from a program's graph IR and registered for its op.

A dim symbol `d` of the program can be sharded (`Shard`) when every op treats it as a
batch dim: elementwise ops, matmul batch and free dims, transposes, reductions and
softmaxes along other axes. Then each tensor with `d` is sharded along it, tensors without
it are replicated, and every rank computes its own slice with no communication (an
RMSNorm's rows, a column-parallel `gelu(x @ w + b)`, attention's batch and heads). A dim
that a `sum` reduces or a matmul contracts gives `Partial` outputs when those reductions
are returned directly (through casts and transposes only): each rank holds a partial sum
(a row-parallel `x @ w`). Anything else that reads `d` (a softmax or a max along it, its
`index`, its size as a value, a reshape, slice or gather touching it) rules it out.
Replicating everything is always a rule.

`register(op, rules)` registers the rules with `torch.distributed.tensor`'s
`register_sharding` where torch has it; a generic kernel's op derives them per call from
the specialization its arguments bind.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tiledsl import ops
from tiledsl.dims import symbols as dim_symbols
from tiledsl.ir import Graph

_LINEAR = ("cast", "transpose")  # ops a partial sum may pass on its way out


def _axes(op: Any, rank: int) -> tuple[int, ...]:
    axis = op.attr("axis")
    if axis is None:
        return tuple(range(rank))
    if isinstance(axis, tuple | list):
        return tuple(a % rank for a in axis)
    return (axis % rank,) if rank else ()


def _mentions(shape: Sequence[Any], d: str) -> bool:
    """Does a shape use `d` inside a dim expression (`D // 2`), not as the dim itself?"""
    return any(isinstance(x, str) and x != d and d in dim_symbols(x) for x in shape)


def _kind(graph: Graph, d: str) -> str | None:
    """How `d` may be sharded: "shard" (a batch dim everywhere), "partial" (summed or
    contracted only, into outputs returned as such), or None."""
    reductions: list[int] = []
    for node in graph.nodes():
        op = graph.op(node)
        operands = [graph.op(o) for o in graph.operands(node)]
        shapes = [tuple(op.shape)] + [tuple(o.shape) for o in operands]
        if any(_mentions(s, d) for s in shapes):
            return None
        kind = op.kind
        if kind == "dim":
            if op.attr("symbol") == d:
                return None
            continue
        if not any(d in s for s in shapes):
            continue
        if kind == "index":
            if op.shape[op.attr("axis") % len(op.shape)] == d:
                return None
        elif kind in ("param", "const", "return", "transpose") or ops.is_elementwise(kind):
            continue
        elif kind == "matmul":
            a, b = operands
            if a.shape[-1] == d:  # contracted
                reductions.append(node)
            elif a.shape[-2] == d and b.shape[-1] == d:
                return None
        elif ops.category(kind) in (ops.Category.REDUCTION, ops.Category.SOFTMAX, ops.Category.SCAN,
                                    ops.Category.SELECT):
            x = operands[0].shape
            if any(x[a] == d for a in _axes(op, len(x))):
                if kind != "sum":
                    return None
                reductions.append(node)
        else:  # views, gathers, scatters: conservatively not shardable along d
            return None
    if not reductions:
        return "shard"
    outputs = {n for n, _ in graph.outputs}
    for node in reductions:
        n = node
        while n not in outputs:
            users = graph.users(n)
            if len(users) != 1 or graph.op(users[0][0]).kind not in _LINEAR:
                return None
            n = users[0][0]
        if any(graph.op(u).kind not in _LINEAR and graph.op(u).kind != "return" for u, _ in graph.users(n)):
            return None
    return "partial"


def rules(graph: Graph) -> list[tuple[list[Any], list[Any]]]:
    """The acceptable (output placements, input placements) of `graph`'s op, in its schema's
    order (a scalar's placement is None)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    params = [graph.op(p) for p in graph.params]
    n_out = len(graph.returns) - len(graph.checks)
    returned = [graph.op(n) for n, _ in graph.outputs][:n_out]
    out: list[tuple[list[Any], list[Any]]] = [
        ([Replicate()] * n_out, [None if p.attr("scalar") else Replicate() for p in params])]
    symbols = sorted({x for p in params if not p.attr("scalar") for x in p.shape if isinstance(x, str)})
    for d in symbols:
        kind = _kind(graph, d)
        if kind is None or any(list(p.shape).count(d) > 1 for p in params):
            continue
        ins = [None if p.attr("scalar") else Shard(list(p.shape).index(d)) if d in p.shape else Replicate()
               for p in params]
        outs: list[Any] = []
        for r in returned:
            if list(r.shape).count(d) == 1:
                outs.append(Shard(list(r.shape).index(d)))
            elif d not in r.shape and kind == "partial":
                outs.append(Partial())
            else:
                break
        else:
            if kind == "shard" or any(isinstance(o, Partial) for o in outs):
                out.append((outs, ins))
    return out


def register(op: Any, derive: Callable[[Sequence[Any]], list[tuple[list[Any], list[Any]]]]) -> None:
    """Register `derive(args)` (the rules for a call's arguments, DTensor's specs in place of
    tensors) as `op`'s sharding, where torch.distributed has `register_sharding`."""
    try:
        import torch.distributed as dist
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:  # a torch built without distributed
        return
    if not dist.is_available():
        return

    @register_sharding(op)
    def sharding(*args: Any) -> list[tuple[list[Any], list[Any]]]:
        return derive(args)


class SpecView:
    """A DTensor spec seen as a tensor by `tiledsl.generic.bind`: its global shape and dtype."""

    def __init__(self, spec: Any) -> None:
        self.shape = tuple(spec.shape)
        self.dtype = spec.tensor_meta.dtype

    def dim(self) -> int:
        return len(self.shape)
