"""fuse-epilogue: a matmul and the elementwise ops around it become one GEMM kernel.

Before: `matmul` then elementwise ops on its result, each its own kernel
(composable-kernel's `(a @ b) * d * e` is three).
After: one `matmul` kernel per matmul whose region holds
- the epilogue: every elementwise op that consumes the product element for
  element (result shape = the product's shape), and elementwise producers of
  their extra operands that have that shape too; they run on the f32
  accumulator before the one store. Extra operands ("D tensors") of any
  broadcastable shape (bias `[N]`, row and column scales, full tensors,
  batch-broadcast ones, scalars, dims) are read at the output tile through
  their strides. A member used outside the group (returned, or read by a
  later kernel) is stored as well: the kernel has several outputs.
- the prologue: cheap elementwise ops that feed one GEMM operand element for
  element from a single tensor (a cast or scale of A; a per-token quantizer
  `cast(cast(x / s, f8e4m3), f32)` reading its scale `s: [M, 1]` once per row), applied
  right after the operand tile is loaded; or, for B, the ops that compute it from gathers at
  index expressions of its tile (a packed int4 weight unpacked with shifts and masks,
  its zero points and scales read per group: GPTQ), loaded through the indices;
- dual GEMMs: a further matmul of the same A whose product the epilogue reads
  (LLaMA's MLP `silu(x @ w1.T) * (x @ w3.T)`), with its own B operand and
  accumulator: each A tile is loaded once for both (`MAX_ACCUMULATORS`).

- a batch sum: a `sum` or `mean` of the product over one of its batch axes (and further
  ones over the result, a chain), the product read by nothing else: sum_t A_t @ B_t is a
  longer K loop, accumulated in the same accumulator; the output tiles are the sum's, and
  the epilogue after it runs on them (a mean divided by the axis's size first).

Refused, with a recorded rule: an op reading the product transposed or
broadcast ("other-index", e.g. `c + c.T`), an op whose result is larger than
the product ("tile"), an operand that depends on the product ("cycle"), and
prologues that are not worth recomputing per tile ("profit"), a reduction of the product
over its rows or columns or of ops on it ("tile"), and a batch sum beside a dual GEMM or row
statistics ("op").
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from tiledsl import ops
from tiledsl.ir import Graph, KernelOp, Op
from tiledsl.passes.fusion.admission import (
    epilogue_refusal,
    gathered_operand,
    gathered_prologue_refusal,
    pending_source,
    prologue_budget,
    prologue_op_refusal,
    prologue_units,
    row_segment,
)
from tiledsl.passes.fusion.grow import Admission, elementwise_candidate, fuse_groups
from tiledsl.passes.fusion.legality import GroupPlan, describe_node
from tiledsl.passes.fusion.profitability import MAX_ACCUMULATORS
from tiledsl.passes.fusion.remarks import Refusal, Rule
from tiledsl.passes.fusion.spec import GemmSpec
from tiledsl.passes.regions import is_clonable
from tiledsl.passes.registry import Pass, PassContext, register


@register
@dataclass(frozen=True)
class FuseEpilogue(Pass):
    name = "fuse-epilogue"
    dual_gemm: bool = True  # false: one matmul per kernel (the benchmarks' unfused baseline)

    def run(self, graph: Graph, ctx: PassContext) -> None:
        def candidate(node: int) -> bool:
            return elementwise_candidate(graph, node) or _is_matmul(graph, node) or _is_stat_kind(graph, node)

        def admit_for(plan: GroupPlan, seed: int) -> Admission:
            kernel = _Kernel(graph, plan, seed, 2 if self.dual_gemm else 1)
            return Admission(kernel.admit, kernel.spec)

        fuse_groups(graph, ctx.remarks, self.name, lambda node: _is_matmul(graph, node), candidate,
                    admit_for)


# reductions a GEMM computes from its A tiles in the K loop: the additive ones (sum, mean)
STAT_KINDS = tuple(k for k, d in ops.OPS.items() if d.reduction is not None and d.reduction.additive)


def _is_matmul(graph: Graph, node: int) -> bool:
    return graph.op(node).kind == "matmul"


def _is_stat_kind(graph: Graph, node: int) -> bool:
    op = graph.op(node)
    return isinstance(op, Op) and op.kind in STAT_KINDS


class _Kernel:
    """The GEMM kernel growing around one matmul: what each member is for."""

    def __init__(self, graph: Graph, plan: GroupPlan, seed: int, accumulators: int) -> None:
        self.graph, self.plan, self.seed = graph, plan, seed
        self.accumulators = min(accumulators, MAX_ACCUMULATORS)
        self.matmuls = {seed}  # the seed and the dual matmuls admitted with it
        self.prologue: set[int] = set()  # members feeding the matmuls' operands or the stats
        self.a_side: set[int] = set()  # ... those computed from A's tiles (stats included)
        self.spent = {True: 0, False: 0}  # the units per element of A's prologue, of B's
        self.budget = prologue_budget(graph, seed)
        self.stats: set[int] = set()  # reductions of A's rows along K, done in the K loop
        self.rows: set[int] = set()  # values of the rows' shape [..., M, 1], from the stats
        self.memo: dict = {}  # producers' sources, with the duals this seed may take
        # sums of the product over its batch axes, taken in the K loop: the ops, in order,
        # and the product's axes they sum; `axes` maps each dim of the output to the
        # product's dim it is (a summed one kept as size 1 with keepdims too)
        self.batch_sums: list[int] = []
        self.summed: list[int] = []
        # the muls scaling each batch element's product before the first batch sum adds it
        # (DeepSeek-V3's per-block scales: sum_t (A_t @ B_t) * sa_t * sb_t)
        self.batch_scales: tuple[int, ...] = ()
        self.axes = list(range(len(graph.op(seed).shape)))
        self.row_shape = self.out_shape[:-1] + (1,)
        # A may be a result of an earlier kernel (an attention's output): an edge, not a node
        self.a_edge = graph.operand_edges(seed)[0]
        self.a = self.a_edge[0]
        self.a_shape = graph.result_type(*self.a_edge).shape
        # a B operand loaded through gathers at index expressions of its tile (a packed int4
        # weight): the ops computing it, each tile's prologue
        self.gathered = gathered_operand(graph, graph.operand_edges(seed)[1])
        self.gathered_of = {seed: self.gathered}  # each matmul's, the grouped duals' too

    def joins(self, node: int) -> bool:
        """Ops besides elementwise ones an epilogue producer may be computed from."""
        return (_is_matmul(self.graph, node) and _dual_refusal(self.graph, self.seed, set(), node) is None) \
            or (_is_stat_kind(self.graph, node) and self.stat_refusal(node) is None)

    def admit(self, group: set[int], cand: int) -> Refusal | None:
        graph = self.graph
        if _is_matmul(graph, cand):
            if self.batch_sums:
                return Refusal(Rule.OP, "the GEMM sums its product over the batch; a dual product "
                               "would be kept per batch element")
            reason = _dual_refusal(graph, self.seed, self.matmuls, cand, self.accumulators)
            if reason is None and not self.plan.creates_cycle(group, cand):
                self.matmuls.add(cand)
                # a grouped dual's B, selected by the same index: unpacked in the K loop too
                self.gathered_of[cand] = gathered_operand(graph, graph.operand_edges(cand)[1])
            return reason
        if _is_stat_kind(graph, cand):
            if any(o in group for o in graph.operands(cand)):
                reason = self.batch_sum_refusal(cand)
                if reason is None:
                    self.add_batch_sum(cand)
                return reason
            reason = self.stat_refusal(cand) or self.users_outside(group, cand)
            if reason is None and any(u in self.prologue for u, _ in graph.users(cand)):
                reason = Refusal(Rule.TILE, "a prologue reads it at every step of the K loop, which "
                                 "sums it: it is known only after the loop")
            if reason is None and self.batch_sums:
                reason = Refusal(Rule.OP, "the GEMM sums its product over the batch; statistics of "
                                 "A's rows are per batch element")
            if reason is None:
                self.stats.add(cand)
                self.a_side.add(cand)
            return reason
        owner = next((m for m, ops_ in self.gathered_of.items() if cand in ops_), None)
        if owner is not None:
            reason = gathered_prologue_refusal(graph, cand, self.gathered_of[owner], owner)
            if reason is None:
                self.prologue.add(cand)
            return reason
        users = [(u, slot) for u, slot in graph.users(cand)]
        consumers = self.matmuls | self.prologue | self.stats
        if any(u in consumers for u, _ in users):  # a prologue op
            on_a = any((u == self.seed or u in self.matmuls) and slot == 0 or u in self.a_side
                       for u, slot in users)
            if on_a and graph.op(cand).shape != self.a_shape and \
                    (source := pending_source(graph, cand)) is not None:  # a per-token scale
                return Refusal(Rule.TILE, f"a prologue reads it at every step of the K loop, and it is "
                               f"computed from {describe_node(graph, source)}, which needs whole rows "
                               "first: another kernel computes it")
            if any(u in group and u not in consumers for u, _ in users):
                return Refusal(Rule.OTHER_INDEX, "it feeds both a matmul operand and the epilogue")
            reason = prologue_op_refusal(graph, cand, any(u not in group for u, _ in users),
                                         self.a_shape if on_a else None, self.spent[on_a], self.budget)
            if reason is None:
                self.spent[on_a] += prologue_units(graph, cand)
                self.prologue.add(cand)
                if on_a:
                    self.a_side.add(cand)
            return reason
        if graph.op(cand).shape == self.row_shape and graph.op(cand).shape != self.out_shape:
            reason = self.row_refusal(group, cand)
            if reason is None:
                self.rows.add(cand)
            return reason
        epilogue = [m for m in group if m not in consumers and m not in self.rows
                    and m not in self.batch_sums]
        return epilogue_refusal(graph, group, cand, self.out_shape,
                                "the batch sum" if self.batch_sums else "the product", epilogue,
                                self.joins, self.memo, broadcast=self.rows | self.stats)

    @property
    def out_shape(self):
        """The shape of the kernel's output tiles: the product's, or its last batch sum's."""
        return self.graph.op(self.batch_sums[-1] if self.batch_sums else self.seed).shape

    def batch_sum_refusal(self, cand: int) -> Refusal | None:
        """Why reduction `cand` of a group value is not a sum the K loop takes over a batch
        axis of the product: the reduction must read the product (or the batch sum before it)
        itself, along a batch axis, and nothing else may read what it reduces."""
        graph = self.graph
        op = graph.op(cand)
        (x,) = graph.operands(cand)
        shape = graph.op(x).shape
        axis = op.attr("axis") % len(shape)
        scales = () if self.batch_sums else self.scale_chain(x)
        if x != (self.batch_sums[-1] if self.batch_sums else self.seed) and scales is None \
                or axis >= len(shape) - 2:
            return Refusal(Rule.TILE, "a reduction of the product needs whole rows of the output; "
                           "the GEMM holds one tile of them")
        if self.axes[axis] in self.summed:
            return Refusal(Rule.TILE, "it sums a batch axis the K loop has summed already")
        if len(self.matmuls) > 1 or self.stats:
            return Refusal(Rule.OP, "a GEMM with a dual product or row statistics keeps its batch; "
                           "its K loop sums one product per batch element")
        if [u for u, _ in graph.users(x)] != [cand]:
            return Refusal(Rule.MATERIALIZE, f"{describe_node(graph, x)} is also used elsewhere, and "
                           "the GEMM summing it over the batch never holds it whole")
        self.batch_scales = scales or ()
        return None

    def scale_chain(self, x: int) -> tuple[int, ...] | None:
        """The muls from the product to `x`, in order, when `x` is the product scaled by
        factors the product does not feed (`p * sa * sb`), each value read only by the next
        and of the product's shape: applied to each batch element's product in the K loop, so
        the sum of the scaled products is still one accumulator. None otherwise."""
        graph, shape, chain = self.graph, self.graph.op(self.seed).shape, []
        while x != self.seed:
            op = graph.op(x)
            if not isinstance(op, Op) or op.kind != "mul" or op.shape != shape or not op.dtype.is_float:
                return None
            on = [o for o in graph.operands(x) if o == self.seed or self.seed in nx.ancestors(graph.nx, o)]
            if len(on) != 1 or len(graph.users(on[0])) != 1:
                return None
            chain.append(x)
            x = on[0]
        return tuple(reversed(chain))

    def add_batch_sum(self, cand: int) -> None:
        """Take batch sum `cand` into the K loop: the output tiles are now its."""
        op = self.graph.op(cand)
        axis = op.attr("axis") % len(self.axes)
        self.summed.append(self.axes[axis])
        if not op.attr("keepdims"):
            del self.axes[axis]
        self.batch_sums.append(cand)
        self.row_shape = self.out_shape[:-1] + (1,)

    def spec(self, members: list[int]) -> GemmSpec:
        """The group as this kernel admitted it: the seed, its duals and the statistics of A."""
        duals = tuple(m for m in members if m in self.matmuls and m != self.seed)
        stats = tuple(m for m in members if m in self.stats)
        # a product of one row per batch element whose B is gathered by a per-row index: a
        # grouped GEMM, its rows the batch elements (`admission.row_segment`)
        segment = None if stats or self.batch_sums or not self.gathered & set(members) \
            else row_segment(self.graph, self.seed, self.gathered)
        return GemmSpec(self.seed, duals, stats, tuple(self.batch_sums), tuple(sorted(self.summed)),
                        self.batch_scales, segment)

    def users_outside(self, group: set[int], cand: int) -> Refusal | None:
        if any(u not in group for u, _ in self.graph.users(cand)):
            return Refusal(Rule.MATERIALIZE, "it is also used outside the GEMM, which only computes it "
                           "row by row")
        return None

    def stat_refusal(self, node: int) -> Refusal | None:
        """Why reduction `node` is not a statistic of A's rows the K loop can accumulate: a sum
        or mean along K, keeping the dim, of cheap elementwise ops of A's source tensor."""
        graph = self.graph
        op = graph.op(node)
        (x,) = graph.operand_edges(node)
        x_shape = graph.result_type(*x).shape
        if not op.attr("keepdims") or op.attr("axis") != len(x_shape) - 1 or x_shape != self.a_shape:
            return Refusal(Rule.TILE, f"only a {' or '.join(STAT_KINDS)} of A's rows along K "
                           "(keepdims=true) is computed in the K loop")
        root = _operand_root(graph, x, self.a_shape)
        if root is None or root != _operand_root(graph, self.a_edge, self.a_shape):
            return Refusal(Rule.OP, "the statistic is not computed from the tiles of A alone")
        return None

    def row_refusal(self, group: set[int], cand: int) -> Refusal | None:
        """Why a value of the rows' shape cannot be computed at the output tile from the
        statistics (and scalars, and row-shaped inputs)."""
        graph = self.graph
        if (outside := self.users_outside(group, cand)) is not None:
            return outside
        stack = list(graph.operands(cand))
        seen: set[int] = set()
        while stack:
            n = stack.pop()
            if n in seen or n in group:
                continue
            seen.add(n)
            op = graph.op(n)
            if isinstance(op, KernelOp) or op.kind in ("param", "dim", "const") or op.shape == ():
                continue
            if _is_stat_kind(graph, n):
                why = self.stat_refusal(n)
                if why is None:
                    continue
                return Refusal(why.rule, f"it is computed from {describe_node(graph, n)}: {why.detail}")
            if ops.is_elementwise(op.kind) and op.shape == self.row_shape:
                stack.extend(graph.operands(n))
                continue
            return Refusal(Rule.OTHER_INDEX, f"it is computed from {describe_node(graph, n)}, which the "
                           "GEMM does not compute per row")
        return None


def _operand_root(graph: Graph, value: tuple[int, int], shape) -> tuple[int, int] | None:
    """The one tensor of `shape` that `value` (a node and its result index) is computed from
    through elementwise ops (the source a prologue or statistic reads), or None. A result of
    an earlier kernel is a tensor like a parameter; which result it is matters."""
    roots: set[tuple[int, int]] = set()
    stack, seen = [value], set()
    while stack:
        edge = stack.pop()
        if edge in seen:
            continue
        seen.add(edge)
        op = graph.op(edge[0])
        if isinstance(op, Op) and ops.is_elementwise(op.kind) and not is_clonable(graph, edge[0]):
            stack.extend(graph.operand_edges(edge[0]))
        elif graph.result_type(*edge).shape == shape:
            roots.add(edge)
    return roots.pop() if len(roots) == 1 else None


def _dual_refusal(graph: Graph, seed: int, matmuls: set[int], cand: int,
                  accumulators: int = MAX_ACCUMULATORS) -> Refusal | None:
    """Why matmul `cand` cannot share the kernel of `seed` as a dual GEMM (its own
    accumulator over the same A tiles)."""
    first, other = graph.op(seed), graph.op(cand)
    twin = next((m for m in (seed, *sorted(matmuls)) if graph.operand_edges(m) == graph.operand_edges(cand)
                 and graph.op(m).key() == other.key()), None)
    if twin is not None:  # in a pipeline without cse
        return Refusal(Rule.OP, f"it is the product {describe_node(graph, twin)} computes (the same A and "
                       "B); cse computes it once")
    if graph.operands(cand)[0] != graph.operands(seed)[0]:
        return Refusal(Rule.OP, "a dual GEMM shares the A operand; these multiply different ones")
    gathered = [gathered_operand(graph, graph.operand_edges(m)[1]) for m in (seed, cand)]
    segments = {row_segment(graph, m, g) if g else None for m, g in zip((seed, cand), gathered, strict=True)}
    if any(gathered) and (len(segments) != 1 or None in segments):
        return Refusal(Rule.OP, "a dual GEMM loads its B operands through their pointers, or selects both "
                       "by the same index per row (a grouped GEMM's); this one gathers a B otherwise")
    if other.shape != first.shape or other.dtype is not first.dtype:
        return Refusal(Rule.TILE, f"its product {other.type} is not the kernel's {first.type}")
    if accumulators == 1:
        return Refusal(Rule.OP, "dual GEMMs are off in this pipeline (fuse-epilogue{dual-gemm=false})")
    if len(matmuls) >= accumulators:
        return Refusal(Rule.PROFIT, f"a GEMM kernel holds at most {accumulators} accumulators")
    return None
