"""Graph IR and fused IR.

One `Graph` per kernel: a networkx `MultiDiGraph` whose nodes carry one frozen
payload in the node attribute "op", and whose edges (u, v, key=slot, res=i)
say that result `i` of `u` is operand `slot` of `v`. A MultiDiGraph so that
`x * x` has two edges from `x`.

Payloads:
- `Op`: one tensor op of the graph IR (kind, dtype, shape, attrs, span).
- `KernelOp`: a kernel-level op of the fused IR, owning a `Region` (an
  immutable SSA sub-program over its inputs), naming the code template
  that implements it and carrying the plan (`tiledsl.plans`) that template
  consumes. Fusion passes build bigger regions; `lower-kernels` wraps every
  op that is left into a region of its own.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import networkx as nx

from tiledsl.plans import Plan, zero_filled
from tiledsl.source import Span
from tiledsl.types import DType, Shape, TensorType

Attrs = tuple[tuple[str, Any], ...]


def walk(starts: Iterable[Any], successors: Any) -> Iterator[Any]:
    """Each value reachable from `starts` through `successors(value)` (an iterable), once,
    depth first: the search the passes' graph predicates run, which they end early with
    `any` or `all`."""
    stack, seen = list(starts), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        yield n
        stack.extend(successors(n))


def make_attrs(**attrs: Any) -> Attrs:
    return tuple(sorted(attrs.items()))


@dataclass(frozen=True, slots=True)
class Op:
    """One graph-IR op; `attrs` is a sorted tuple of (name, value) pairs."""

    kind: str
    dtype: DType
    shape: Shape
    attrs: Attrs = ()
    span: Span | None = None
    weak: bool = False

    @property
    def type(self) -> TensorType:
        return TensorType(self.dtype, self.shape, self.weak)

    def attr(self, name: str, default: Any = None) -> Any:
        for key, value in self.attrs:
            if key == name:
                return value
        return default

    @property
    def attr_map(self) -> dict[str, Any]:
        return dict(self.attrs)

    def replace(self, **changes: Any) -> Op:
        return dataclasses.replace(self, **changes)

    def key(self) -> tuple:
        """Identity for CSE: everything but the span."""
        return (self.kind, self.dtype, self.shape, self.attrs, self.weak)


@dataclass(frozen=True, slots=True)
class RegionInput:
    """A value entering a region. `scalar`: passed by value (a scalar param or a dim)."""

    type: TensorType
    scalar: bool = False


@dataclass(frozen=True, slots=True)
class RegionOp:
    """An op inside a region; operands are value ids (inputs first, then ops in order)."""

    op: Op
    operands: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Region:
    """An immutable SSA sub-program: inputs, ops in dependency order, outputs."""

    inputs: tuple[RegionInput, ...]
    ops: tuple[RegionOp, ...]
    outputs: tuple[int, ...]

    def value_type(self, value: int) -> TensorType:
        n = len(self.inputs)
        return self.inputs[value].type if value < n else self.ops[value - n].op.type

    @property
    def output_types(self) -> tuple[TensorType, ...]:
        return tuple(self.value_type(v) for v in self.outputs)

    def gathered(self, value: int) -> bool:
        """Does an op read `value` at indices it computes (see `ops.gathers_at`)?"""
        from tiledsl.ops import gathers_at

        return any(gathers_at(r.op.kind, slot) for r in self.ops
                   for slot, o in enumerate(r.operands) if o == value)

    def read_whole(self, value: int) -> bool:
        """Is `value` returned, or read element for element by some op?"""
        from tiledsl.ops import gathers_at

        return value in self.outputs or any(
            o == value and not gathers_at(r.op.kind, slot)
            for r in self.ops for slot, o in enumerate(r.operands))

    def part(self, inputs: tuple[int, ...], values: tuple[int, ...], outputs: tuple[int, ...]) -> Region:
        """The region of the ops `values` (in order), reading the inputs `inputs` and
        computing this region's outputs at positions `outputs`, renumbered as a region of its
        own (a member of a merged launch: `plans.MergedPlan`). An input may be a value the
        part does not compute (another member's result): a tensor input of the part."""
        n_in = len(self.inputs)
        local = {v: i for i, v in enumerate(inputs)}
        body = []
        for v in values:
            r = self.ops[v - n_in]
            body.append(RegionOp(r.op, tuple(local[o] for o in r.operands)))
            local[v] = len(inputs) + len(body) - 1
        return Region(tuple(self.inputs[i] if i < n_in else RegionInput(self.value_type(i)) for i in inputs),
                      tuple(body), tuple(local[self.outputs[j]] for j in outputs))

    def depends(self, value: int) -> set[int]:
        """The values `value` is computed from, itself included."""
        n_in = len(self.inputs)
        out, stack = set(), [value]
        while stack:
            v = stack.pop()
            if v not in out:
                out.add(v)
                if v >= n_in:
                    stack.extend(self.ops[v - n_in].operands)
        return out


@dataclass(frozen=True, slots=True)
class KernelOp:
    """A kernel of the fused IR: a code template applied to a region, with the plan the
    pass that formed it decided (`tiledsl.plans`)."""

    name: str  # compiler-owned, e.g. "k3"
    template: str  # a key of `plans.TEMPLATES`; `plan` is an instance of its class
    region: Region
    span: Span | None = None
    kind: str = "kernel"
    plan: Plan | None = None
    # per result, the axis order of its tensor in memory when a returned transpose of it is
    # stored directly (lower-kernels): result r is a view of a contiguous tensor of the
    # transposed shape. Empty (or None at r): contiguous in its own order.
    out_orders: tuple[tuple[int, ...] | None, ...] = ()
    # pairs (i, j): region input i is input j with its last two dims swapped, a transpose
    # view of the same tensor (lower-kernels): a template may load one tile for both
    transposed_inputs: tuple[tuple[int, int], ...] = ()

    def out_order(self, r: int) -> tuple[int, ...] | None:
        return self.out_orders[r] if r < len(self.out_orders) else None

    def zero_filled(self, r: int) -> bool:
        """Must result r start at 0 (its plan's `zero_filled`: the programs add into it, or
        write only part of it)?"""
        return self.region.outputs[r] in zero_filled(self.plan)

    @property
    def result_types(self) -> tuple[TensorType, ...]:
        return self.region.output_types

    @property
    def covered(self) -> tuple[Op, ...]:
        """The DSL ops this kernel computes (inlined constants excluded)."""
        return tuple(r.op for r in self.region.ops if r.op.kind != "const")

    def replace(self, **changes: Any) -> KernelOp:
        return dataclasses.replace(self, **changes)


Payload = Op | KernelOp
Edge = tuple[int, int]  # a value: (node, result index); a kernel node has several results


class Graph:
    """One kernel's program. `params` are the parameter nodes in declaration order."""

    def __init__(self, name: str, span: Span | None = None,
                 hints: dict[str, tuple[int, Span]] | None = None) -> None:
        self.name = name
        self.span = span
        self.hints: dict[str, tuple[int, Span]] = dict(hints or {})
        self.nx = nx.MultiDiGraph()
        self._memos: dict[str, dict] = {}
        self.params: list[int] = []
        self.output: int | None = None
        self.returns: tuple[TensorType, ...] = ()  # the declared return types
        # dim expressions a call's sizes must keep >= 0 (slice bounds inside their axis),
        # with the construct that needs it and what to say when one does not
        self.requires: tuple[tuple[str, Span | None, str], ...] = ()
        # compile(check_bounds=True): the last len(checks) outputs count the out-of-range
        # values of one index each, (span of the indexing, indexed tensor, axis, its size)
        self.checks: tuple[tuple[Span | None, str, int, object], ...] = ()
        self._ids = itertools.count()

    # construction ---------------------------------------------------------------

    def add(self, op: Payload, operands: Iterable[int | tuple[int, int]] = ()) -> int:
        """Add a node; operands are node ids or (node, result index) pairs."""
        self._changed()
        node = next(self._ids)
        self.nx.add_node(node, op=op)
        for slot, operand in enumerate(operands):
            src, res = operand if isinstance(operand, tuple) else (operand, 0)
            self.nx.add_edge(src, node, key=slot, res=res)
        if op.kind == "param":
            self.params.append(node)
        elif op.kind == "return":
            self.output = node
        return node

    def copy(self) -> Graph:
        other = Graph.__new__(Graph)
        other.name, other.span, other.hints = self.name, self.span, dict(self.hints)
        other.nx = self.nx.copy()
        other.params = list(self.params)
        other.output = self.output
        other.returns = self.returns
        other.requires = self.requires
        other.checks = self.checks
        start = max(self.nx.nodes, default=-1) + 1
        other._ids = itertools.count(start)
        other._memos = {}
        return other

    # queries ----------------------------------------------------------------------

    def memo(self, name: str) -> dict:
        """A dict for derived facts about nodes (`name` says which), emptied by every
        mutation: analyses stay linear without going stale."""
        return self._memos.setdefault(name, {})

    def _changed(self) -> None:
        self._memos.clear()

    def op(self, node: int) -> Payload:
        return self.nx.nodes[node]["op"]

    def recomputed(self, node: int) -> bool:
        """Did the recompute pass decide that every kernel reading `node` computes it again
        (`passes/recompute.py`)?"""
        return self.nx.nodes[node].get("recompute", False)

    def set_recomputed(self, node: int) -> None:
        self._changed()
        self.nx.nodes[node]["recompute"] = True

    def score_space(self, node: int) -> Any:
        """The score space of an attention backward that `node` is a score dot or score op
        of, as the analysis recorded it (`passes/fusion/score_space.py`: a `Mark`), or None."""
        return self.nx.nodes[node].get("score_space")

    def set_score_space(self, node: int, mark: Any) -> None:
        """Record (or, with None, drop) `node`'s score space. A record, not a change to the
        program: the memoized analyses stay."""
        if mark is None:
            self.nx.nodes[node].pop("score_space", None)
        else:
            self.nx.nodes[node]["score_space"] = mark

    def result_type(self, node: int, res: int = 0) -> TensorType:
        """The type of result `res` of `node` (a kernel has one per output)."""
        op = self.op(node)
        return op.result_types[res] if isinstance(op, KernelOp) else op.type

    def operand_edges(self, node: int) -> list[tuple[int, int]]:
        """(producer, result index) for each operand slot, in order."""
        edges = sorted(self.nx.in_edges(node, keys=True, data="res"), key=lambda e: e[2])
        return [(u, res) for u, _, _, res in edges]

    def operands(self, node: int) -> list[int]:
        return [u for u, _ in self.operand_edges(node)]

    def users(self, node: int) -> list[tuple[int, int]]:
        """(user, slot) for every use of any result of `node`."""
        return [(v, slot) for _, v, slot in self.nx.out_edges(node, keys=True)]

    def nodes(self) -> Iterator[int]:
        return iter(self.nx.nodes)

    def topo_order(self) -> list[int]:
        """A deterministic topological order (ties broken by creation order)."""
        return list(nx.lexicographical_topological_sort(self.nx))

    @property
    def outputs(self) -> list[tuple[int, int]]:
        return self.operand_edges(self.output) if self.output is not None else []

    def kernels(self) -> list[int]:
        return [n for n in self.topo_order() if isinstance(self.op(n), KernelOp)]

    # mutation -----------------------------------------------------------------------

    def set_op(self, node: int, op: Payload) -> None:
        self._changed()
        self.nx.nodes[node]["op"] = op

    def set_operands(self, node: int, operands: Iterable[int | tuple[int, int]]) -> None:
        self._changed()
        self.nx.remove_edges_from(list(self.nx.in_edges(node, keys=True)))
        for slot, operand in enumerate(operands):
            src, res = operand if isinstance(operand, tuple) else (operand, 0)
            self.nx.add_edge(src, node, key=slot, res=res)

    def replace_uses(self, old: int, new: int, new_res: int = 0, old_res: int | None = None) -> None:
        """Point every use of `old` (or of its result `old_res`) at `new`."""
        self._changed()
        for _, user, slot, res in list(self.nx.out_edges(old, keys=True, data="res")):
            if old_res is not None and res != old_res:
                continue
            self.nx.remove_edge(old, user, key=slot)
            self.nx.add_edge(new, user, key=slot, res=new_res)

    def remove_all(self, nodes: Iterable[int]) -> None:
        """Remove nodes whose uses are all among themselves (dead code)."""
        self._changed()
        self.nx.remove_nodes_from(list(nodes))

    def remove(self, node: int) -> None:
        self._changed()
        assert not self.nx.succ[node], f"removing node {node} that still has uses"
        self.nx.remove_node(node)
        if node in self.params:
            self.params.remove(node)
        if node == self.output:
            self.output = None
