"""lower-kernels: graph IR -> fused IR (one kernel per op that is left).

Before: a graph of tensor ops, possibly with kernel nodes already formed by
fusion passes.
After: every compute op is inside a `KernelOp` whose template implements it
(`LOWERED`: by the op's category, the spec of its kernel).

What stays outside kernels: parameters, dims, views (`transpose`, `slice`, `reshape`:
consumers read them through their offsets and strides, no copy), and the return. Constants are
inlined into the kernels that use them, and so are scalar expressions
(`rsqrt(D) * N`): only a returned one becomes a kernel. A returned value that no kernel
produces (a parameter, a view, a constant) gets a pointwise copy kernel, so
every output is a fresh tensor; a reshape of a kernel result read by nothing else is
already one, and a transpose of one is stored in the transposed order by the kernel
(`KernelOp.out_orders`) where its template stores through strides (`strided_stores`). Finally all
kernels are named k0, k1, ... in launch (topological) order. Must run last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from tiledsl import ops
from tiledsl.ir import Graph, KernelOp, Op, Region, RegionInput, RegionOp, make_attrs
from tiledsl.ops import Category
from tiledsl.passes.fusion.legality import RowSpace, reduced_axes
from tiledsl.passes.fusion.spec import GemmSpec, PointwiseSpec, RowSpec, ScatterSpec, Spec
from tiledsl.passes.regions import is_by_value, is_clonable, remove_dead_clonables, replace_with_kernel
from tiledsl.passes.registry import Pass, PassContext, register
from tiledsl.plans import TEMPLATES, PointwisePlan, ScatterPlan
from tiledsl.types import reshape_ends


def _row(graph: Graph, node: int) -> RowSpec:
    x = graph.result_type(*graph.operand_edges(node)[0])
    return RowSpec(RowSpace(x.shape, reduced_axes(x.rank, [graph.op(node)])))


# the kernel an op no fusion pass took runs in, by the op's category: its spec
LOWERED: dict[Category, Callable[[Graph, int], Spec]] = {
    Category.ELEMENTWISE: lambda graph, node: PointwiseSpec(graph.op(node).shape),
    Category.REDUCTION: _row, Category.SOFTMAX: _row, Category.SCAN: _row, Category.SELECT: _row,
    Category.MATMUL: lambda graph, node: GemmSpec(node),
    Category.SCATTER: lambda graph, node: ScatterSpec(graph.result_type(
        *graph.operand_edges(node)[ops.WRITTEN[graph.op(node).kind]]).shape)}


def _transposed_inputs(graph: Graph, node: int) -> tuple[tuple[int, int], ...]:
    """The kernel's inputs that are transposes (of the last two dims) of another of its
    inputs: (i, j), input i is input j transposed (`KernelOp.transposed_inputs`)."""
    edges = graph.operand_edges(node)
    found = []
    for i, (src, _) in enumerate(edges):
        op = graph.op(src)
        if isinstance(op, Op) and op.kind == "transpose" and sorted(op.attr("dims")) == [op.type.rank - 2,
                                                                                         op.type.rank - 1]:
            found += [(i, j) for j, e in enumerate(edges) if e == graph.operand_edges(src)[0]]
    return tuple(found)


def _stored_in(kernel: KernelOp, res: int, order: list[int]) -> KernelOp:
    """`kernel` storing its result `res` in the axis order `order` (`KernelOp.out_orders`)."""
    orders = list(kernel.out_orders) + [None] * (len(kernel.result_types) - len(kernel.out_orders))
    orders[res] = tuple(order)
    return kernel.replace(out_orders=tuple(orders))


def _viewed_result(graph: Graph, edge: tuple[int, int]) -> tuple[int, int]:
    """The value a chain of views (transposes, slices, reshapes) `edge` reads reads."""
    while isinstance(op := graph.op(edge[0]), Op) and op.kind in ("transpose", "slice", "reshape"):
        (edge,) = graph.operand_edges(edge[0])
    return edge


def _through_reshape(mem: list[int], source: tuple, out: tuple) -> list[int] | None:
    """The memory order (axes, outermost first) of a reshape's source that gives its result
    the memory order `mem`: the axes both shapes begin and end with map one to one, and the
    middle ones (merged or split) must be adjacent and in order in `mem`, where the
    source's middle axes take their place in order. None where they are not."""
    lo, hi = reshape_ends(source, out)
    mid_out = list(range(lo, len(out) - hi))
    mid_src = list(range(lo, len(source) - hi))
    shift = len(source) - len(out)
    result: list[int] = []
    k = 0
    while k < len(mem):
        a = mem[k]
        if a in mid_out:
            if mem[k:k + len(mid_out)] != mid_out:
                return None
            result += mid_src
            k += len(mid_out)
            continue
        result.append(a if a < lo else a + shift)
        k += 1
    if not mid_out:  # size-1 source axes the reshape drops: anywhere, here last
        result += mid_src
    return result


@register
@dataclass(frozen=True)
class LowerKernels(Pass):
    name = "lower-kernels"

    def run(self, graph: Graph, ctx: PassContext) -> None:
        for node in graph.topo_order():
            if node not in graph.nx:  # a scalar expression cloned into all its users
                continue
            op = graph.op(node)
            if isinstance(op, KernelOp):
                continue
            if is_clonable(graph, node) and not any(u == graph.output for u, _ in graph.users(node)):
                # cloned into the kernels that read it; only a returned one is stored, and one
                # nothing reads (dead code, in a pipeline without dce) is dropped
                remove_dead_clonables(graph, [node])
                continue
            spec = LOWERED.get(ops.category(op.kind))
            if spec is not None:
                replace_with_kernel(graph, [node], [node], spec(graph, node))
        viewed: set[int] = set()
        self._copy_unproduced_outputs(graph, viewed)
        self._store_for_reshapes(graph, viewed)
        self._write_in_place(graph)
        for i, node in enumerate(graph.kernels()):
            kernel = graph.op(node).replace(name=f"k{i}", transposed_inputs=_transposed_inputs(graph, node))
            graph.set_op(node, kernel)

    def _copy_unproduced_outputs(self, graph: Graph, viewed: set[int]) -> None:
        """A returned value no kernel produces gets a copy kernel, but for views of a kernel
        result that the kernel can make a fresh contiguous tensor (`viewed`: the reshapes of
        them, views by construction)."""
        outputs = graph.outputs
        new_outputs = []
        for src, res in outputs:
            op = graph.op(src)
            if isinstance(op, KernelOp) or self._is_fresh_reshape(graph, src, outputs) \
                    or self._store_transposed(graph, src, outputs) \
                    or self._is_fresh_squeeze(graph, src, outputs) \
                    or self._store_viewed(graph, src, outputs, viewed):
                new_outputs.append((src, res))
                continue
            if op.kind == "const":
                region, operands = Region((), (RegionOp(op, ()),), (0,)), []
            else:
                region = Region((RegionInput(op.type, is_by_value(op)),), (), (0,))
                operands = [(src, res)]
            plan = PointwisePlan(op.type.shape)
            kernel = KernelOp("k?", plan.template, region, op.span, plan=plan)
            copy = graph.add(kernel, operands)
            new_outputs.append((copy, 0))
        if new_outputs != outputs:
            graph.set_operands(graph.output, new_outputs)
            for node in list(graph.nodes()):
                op = graph.op(node)
                if isinstance(op, Op) and op.kind == "const" and graph.nx.out_degree(node) == 0:
                    graph.remove(node)

    @staticmethod
    def _store_transposed(graph: Graph, node: int, outputs) -> bool:
        """A returned transpose of a kernel result that nothing else reads, from a template
        that stores through strides (`strided_stores`): the kernel stores the result in the
        transposed order (recorded in its `out_orders`), so the returned view is a fresh
        contiguous tensor and needs no copy (composable-kernel's gemm-softmax-gemm-permute)."""
        op = graph.op(node)
        if not (isinstance(op, Op) and op.kind == "transpose") or outputs.count((node, 0)) != 1 \
                or len(graph.users(node)) != 1:
            return False
        return LowerKernels._transposed_store(graph, node)

    @staticmethod
    def _transposed_store(graph: Graph, node: int) -> bool:
        """Have the kernel store the result transpose `node` reads in the transposed order,
        if its template can and nothing else reads that result."""
        op = graph.op(node)
        (src, res), = graph.operand_edges(node)
        kernel = graph.op(src)
        if not isinstance(kernel, KernelOp) or not TEMPLATES[kernel.template].strided_stores \
                or kernel.out_order(res) is not None:
            return False
        if [u for u, slot in graph.users(src) if graph.operand_edges(u)[slot] == (src, res)] != [node]:
            return False
        a, b = op.attr("dims")
        order = list(range(op.type.rank))
        order[a], order[b] = order[b], order[a]
        graph.set_op(src, _stored_in(kernel, res, order))
        return True

    @staticmethod
    def _write_in_place(graph: Graph) -> None:
        """A scatter that starts from another kernel's result (a put_into's x: `y = x * 2;
        y[idx] = v`) nothing else reads, not returned and stored contiguous, writes into it
        in place: the launch hands the result over instead of copying it (`ScatterPlan.in_place`)."""
        outputs = set(graph.outputs)
        for node in graph.kernels():
            kernel = graph.op(node)
            if not isinstance(kernel.plan, ScatterPlan) or not any(s is not None for s in kernel.plan.starts):
                continue
            edges = graph.operand_edges(node)
            in_place = []
            for start in kernel.plan.starts:
                edge = edges[start] if start is not None else None
                source = graph.op(edge[0]) if edge is not None else None
                readers = [] if edge is None else [
                    (u, slot) for u, slot in graph.users(edge[0]) if graph.operand_edges(u)[slot] == edge]
                in_place.append(isinstance(source, KernelOp) and source.out_order(edge[1]) is None
                                and edge not in outputs and readers == [(node, start)])
            if any(in_place):
                plan = dataclasses.replace(kernel.plan, in_place=tuple(in_place))
                graph.set_op(node, kernel.replace(plan=plan))

    @staticmethod
    def _store_viewed(graph: Graph, node: int, outputs, viewed: set[int]) -> bool:
        """A returned chain of transposes and reshapes of a kernel result that nothing else
        reads (`transpose(reshape(o, [B, H, S, D]), 1, 2)`: attention's output back to
        [B, S, H, D] after a grouped-query split of its heads), from a template storing
        through strides: the kernel stores the result in the order that makes the returned
        value contiguous, a fresh tensor needing no copy. Each reshape must then keep the
        dims it merges or splits adjacent and in order in that layout; the chain's reshapes
        are recorded in `viewed`."""
        if outputs.count((node, 0)) != 1:
            return False
        chain, n, res = [], node, 0
        while isinstance(op := graph.op(n), Op) and op.kind in ("transpose", "reshape") \
                and len(graph.users(n)) == 1 and not (op.kind == "reshape" and op.attr("copy")):
            chain.append(n)
            (n, res), = graph.operand_edges(n)
        kernel = graph.op(n)
        readers = [u for u, slot in graph.users(n) if graph.operand_edges(u)[slot] == (n, res)]
        if not chain or not isinstance(kernel, KernelOp) or not TEMPLATES[kernel.template].strided_stores \
                or kernel.out_order(res) is not None or readers != [chain[-1]]:
            return False
        mem: list[int] | None = list(range(graph.op(node).type.rank))  # axes, outermost first
        for v in chain:
            op = graph.op(v)
            if op.kind == "transpose":
                a, b = (d % op.type.rank for d in op.attr("dims"))
                mem = [{a: b, b: a}.get(i, i) for i in mem]
            else:
                source = graph.result_type(*graph.operand_edges(v)[0]).shape
                mem = _through_reshape(mem, source, op.type.shape)
                if mem is None:
                    return False
        if mem != sorted(mem):
            graph.set_op(n, _stored_in(kernel, res, mem))
        viewed.update(v for v in chain if graph.op(v).kind == "reshape")
        return True

    @staticmethod
    def _store_for_reshapes(graph: Graph, viewed: set[int]) -> None:
        """Intermediates' layouts are the compiler's. A reshape of transposes of a kernel
        result (the head merge after attention, `reshape(transpose(p @ v, 1, 2), [B, N, C])`)
        may merge dims that are not adjacent in the result's contiguous layout: the kernel
        stores the result in the order the transposes view it (its `out_orders`), which
        makes the reshape a view. Where the kernel cannot (it stores at a flat index, or
        another reshape already chose its order, or other views come between), the reshape
        copies where the view is impossible (`copy=true`, torch's `reshape`): only a caller's
        tensors can make a reshape fail."""
        for node in graph.topo_order():
            op = graph.op(node)
            if not (isinstance(op, Op) and op.kind == "reshape") or op.attr("copy") or node in viewed:
                continue
            (src, res), = graph.operand_edges(node)
            swaps: list[tuple[int, int]] | None = []  # the transposes, last first
            while isinstance(graph.op(src), Op) and graph.op(src).kind in ("transpose", "reshape", "slice"):
                view = graph.op(src)
                transposes = view.kind == "transpose" and swaps is not None
                swaps = swaps + [view.attr("dims")] if transposes else None
                (src, res), = graph.operand_edges(src)
            kernel = graph.op(src)
            if not isinstance(kernel, KernelOp):
                continue
            perm = None
            if swaps is not None:  # the result's axis each axis of the reshaped value is
                perm = list(range(graph.result_type(src, res).rank))
                for a, b in reversed(swaps):
                    perm[a], perm[b] = perm[b], perm[a]
            order = kernel.out_order(res)
            if perm is not None and order is None:
                if perm == sorted(perm):
                    continue  # a view of the contiguous result
                if TEMPLATES[kernel.template].strided_stores:
                    graph.set_op(src, _stored_in(kernel, res, perm))
                    continue
            if perm is None or order != tuple(perm):
                graph.set_op(node, op.replace(attrs=make_attrs(**{**op.attr_map, "copy": True})))

    @staticmethod
    def _is_fresh_squeeze(graph: Graph, node: int, outputs) -> bool:
        """A slice that only drops size-1 dims (the gradient of a `k[:, :, None]`), returned
        once, of a kernel result nothing else reads, or of a transpose of one that the
        kernel then stores transposed: a view of a fresh contiguous tensor."""
        op = graph.op(node)
        if not (isinstance(op, Op) and op.kind == "slice") or outputs.count((node, 0)) != 1 \
                or len(graph.users(node)) != 1:
            return False
        (src, res), = graph.operand_edges(node)
        shape = graph.result_type(src, res).shape
        items = op.attr("items")
        if len(items) != len(shape) or not all(item == ("at", 0) and d == 1 or item == ("range", 0, d, 1, d)
                                               for item, d in zip(items, shape, strict=True)):
            return False
        source = graph.op(src)
        if isinstance(source, KernelOp):
            return source.out_order(res) is None and \
                [u for u, slot in graph.users(src) if graph.operand_edges(u)[slot] == (src, res)] == [node]
        return isinstance(source, Op) and source.kind == "transpose" and len(graph.users(src)) == 1 \
            and LowerKernels._transposed_store(graph, src)

    @staticmethod
    def _is_fresh_reshape(graph: Graph, node: int, outputs) -> bool:
        """A reshape of a kernel result returned once, where no other output is that result
        or a view of it: the kernel's fresh contiguous tensor viewed in the returned shape is
        already a fresh output (kernels reading the result too read it, never write it: a
        KV cache appended to, returned and read by attention)."""
        op = graph.op(node)
        if not (isinstance(op, Op) and op.kind == "reshape") or outputs.count((node, 0)) != 1:
            return False
        (src, res), = graph.operand_edges(node)
        if not isinstance(graph.op(src), KernelOp):
            return False
        return [o for o in outputs if _viewed_result(graph, o) == (src, res)] == [(node, 0)]
