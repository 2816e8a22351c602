"""Admitting elementwise ops into a GEMM or attention kernel: one set of checks for every
pass that grows one (fuse-epilogue, fuse-attention).

- An epilogue op consumes the kernel's output element for element, or produces
  another operand of the epilogue from the program's inputs (a gate `sigmoid(g)`;
  one computed from a pending reduction or softmax is left to the pass that fuses
  it with that, "profit"): its result
  has the output's shape (legality: "tile" or "other-index"), it reads no
  group value transposed or broadcast ("other-index"), and the epilogue reads
  at most `MAX_EPILOGUE_INPUTS` extra tensors ("profit").
- A prologue op feeds a dot operand from one tensor of the operand's shape
  plus scalars and, on A, vectors along K or along its rows ("other-index" otherwise),
  the prologue's ops at the operand's shape are cheap to recompute per tile
  (`profitability.PROLOGUE_BUDGET`), and it has no other user ("profit",
  `profitability.prologue_refusal`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tiledsl import ops
from tiledsl.ir import Graph, KernelOp, Op
from tiledsl.types import Shape, TensorType, broadcasts_to, format_shape

from .legality import describe_node, reads_other_index
from .profitability import MAX_EPILOGUE_INPUTS, PROLOGUE_BUDGET, prologue_refusal, unpacking_refusal
from .remarks import Refusal, Rule


def epilogue_refusal(graph: Graph, group: set[int], cand: int, shape: Shape, what: str,
                     epilogue: Iterable[int], joins: Callable[[int], bool] | None = None,
                     memo: dict | None = None, broadcast: set[int] = frozenset()) -> Refusal | None:
    """Why `cand` cannot join the epilogue of a kernel whose output (`what`) has `shape`.

    `epilogue`: the epilogue ops admitted so far; the extra tensors they and `cand`
    read from outside the group count against `MAX_EPILOGUE_INPUTS`. `joins`: ops the
    kernel may take besides elementwise ones (the dual matmuls of a GEMM), which a producer
    may be computed from; `memo`: the caller's memo for them (see `pending_source`);
    `broadcast`: members the kernel computes per row, which ops may read broadcast.
    """
    op = graph.op(cand)
    consumer = any(s in group for s in graph.operands(cand))
    if not consumer and (source := pending_source(graph, cand, joins, memo)) is not None:
        return Refusal(Rule.PROFIT, f"it is computed from {describe_node(graph, source)}, which "
                       "a later fusion can keep in registers with it; the epilogue takes values "
                       "computed from the program's inputs")
    if op.shape != shape:
        if not consumer and len(op.shape) <= len(shape):
            return Refusal(Rule.OTHER_INDEX, f"the epilogue would read it broadcast from "
                           f"{format_shape(op.shape)} to {format_shape(shape)}")
        return Refusal(Rule.TILE, f"its result {format_shape(op.shape)} is not {what}'s "
                       f"{format_shape(shape)}")
    why = reads_other_index(graph, cand, set(group) - broadcast)
    if why:
        return Refusal(Rule.OTHER_INDEX, why)
    extra = {e for m in (*epilogue, cand) for e in graph.operand_edges(m)
             if e[0] not in group and e[0] != cand and graph.result_type(*e).rank > 0}
    if len(extra) > MAX_EPILOGUE_INPUTS:
        return Refusal(Rule.PROFIT, f"the epilogue would read more than {MAX_EPILOGUE_INPUTS} extra "
                       "tensors")
    return None


def keys_are_data(*right: TensorType) -> bool:
    """May `f(q @ k) @ v` with no softmax run as one attention-like kernel, the scores never
    stored? When k and v have batch dims they are data (per-head keys and values, whose
    widths are head dims, a tile each); a rank-2 right operand is a weight shared by every
    row (an MLP's), as wide as the model, which one tile cannot hold: those two GEMMs stay
    apart, and the backward saves what the forward stores. `right`: the right operands of
    the matmuls (k, v; in the backward, those of the recomputed score dots)."""
    return all(t.rank >= 3 for t in right)


def prologue_op_refusal(graph: Graph, cand: int, users_outside: bool,
                        a_shape: Shape | None = None, spent: int = 0,
                        budget: int = PROLOGUE_BUDGET) -> Refusal | None:
    """Why `cand` cannot be applied to each loaded tile of a dot operand, where the ops the
    prologue holds already cost `spent` units per element (`prologue_units`) of the `budget`
    (`prologue_budget`). `a_shape`: the shape of an A operand, whose prologue may also read
    vectors along K (`x * g` with `g: [K]`), loaded once per K step, and along its rows (a
    per-token scale `x / s` with `s: [M, 1]` another kernel computes), loaded once per row of
    the tile.

    A narrowing cast whose operand's own ops would pass the budget is refused too: the
    prologue stops at the narrowest value of the chain (a quantizer's f8 values, stored by
    the kernel computing them, a byte each), not at a wider one above it."""
    op = graph.op(cand)
    why = prologue_refusal(op.kind, users_outside, spent if per_element(op.shape) else 0, budget)
    if why:
        return Refusal(Rule.PROFIT, why)
    if op.kind == "cast" and per_element(op.shape):
        (src,) = graph.operand_edges(cand)
        wider = graph.result_type(*src).dtype
        total = spent + ops.units(op.kind) + _chain_units(graph, src[0])
        if op.dtype.itemsize < wider.itemsize and total > budget:
            return Refusal(Rule.PROFIT, f"with the ops computing its {wider} operand the prologue would "
                           f"cost {total} units per element, more than the {budget} the dot hides: the "
                           f"kernel computing them stores its {op.dtype} result, the chain's narrowest")
    tensors = list(dict.fromkeys(  # one tensor read twice (`x * x`) is one tensor
        s for s in graph.operand_edges(cand) if graph.result_type(*s).rank > 0
        and not (a_shape is not None and _a_vector(graph.result_type(*s).shape, a_shape))))
    if len(tensors) != 1 or graph.result_type(*tensors[0]).shape != op.shape:
        return Refusal(Rule.OTHER_INDEX,
                       "a prologue reads one operand tensor element for element (plus scalars)")
    return None


def prologue_budget(graph: Graph, matmul: int) -> int:
    """The units per element a prologue of `matmul`'s operands may cost: `PROLOGUE_BUDGET`,
    half that for a dot of f8 values (an f8 parameter, or a widening cast of an f8 value, on
    both sides), whose tensor cores multiply twice as fast."""
    def f8(edge: tuple[int, int]) -> bool:
        op = graph.op(edge[0])
        if graph.result_type(*edge).dtype.is_f8:
            return True
        return isinstance(op, Op) and op.kind == "cast" and graph.result_type(
            *graph.operand_edges(edge[0])[0]).dtype.is_f8
    return PROLOGUE_BUDGET // 2 if all(f8(e) for e in graph.operand_edges(matmul)) else PROLOGUE_BUDGET


def _chain_units(graph: Graph, node: int) -> int:
    """The units per element of the elementwise ops computing `node` at a tile's shape, each
    read by nothing else, back to the tensors they load."""
    total, stack, seen = 0, [node], set()
    while stack:
        n = stack.pop()
        op = graph.op(n)
        if n in seen or not isinstance(op, Op) or not ops.is_elementwise(op.kind) or op.kind == "take" \
                or not per_element(op.shape):
            continue
        seen.add(n)
        total += ops.units(op.kind)
        stack.extend(o for o in graph.operands(n) if len(graph.users(o)) == 1)
    return total


def prologue_units(graph: Graph, cand: int) -> int:
    """What prologue op `cand` adds to its prologue's cost per element: its units at the
    operand's shape, none at a vector's (computed once per row or column of the tile)."""
    op = graph.op(cand)
    return ops.units(op.kind) if per_element(op.shape) else 0


def per_element(shape: Shape) -> bool:
    """Does a value of `shape` vary along both dims of a tile (no size-1 dim among its last two)?"""
    return len(shape) >= 2 and shape[-1] != 1 and shape[-2] != 1


def gathered_operand(graph: Graph, edge: tuple[int, int]) -> frozenset[int]:
    """The ops a dot operand is computed from when it is loaded through gathers at index
    expressions of its tile (GPTQ's `(wq[k // 8, n] >> (4 * (k % 8))) & 0xF` times the
    scales at `[k // G, n]`): elementwise ops of values broadcast to its shape, walked back to
    `take`s of stored tensors (their index operands walked too), `index` ops, parameters and
    views of them (`g_idx[:, None]`, read at the tile's index), scalars and constants. Empty
    when the operand is anything else (a tensor read element for element, a reduction, a
    kernel's result) or gathers nothing."""
    node, res = edge
    if res != 0 or not isinstance(graph.op(node), Op):
        return frozenset()
    shape = graph.op(node).shape
    out: set[int] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        op = graph.op(n)
        if n in out or isinstance(op, Op) and (op.kind in ("const", "dim") or op.shape == ()
                                               or parameter_or_view(graph, n)):
            continue
        if not isinstance(op, Op) or not ops.is_elementwise(op.kind) or not broadcasts_to(op.shape, shape):
            return frozenset()
        out.add(n)
        operands = graph.operands(n)
        if op.kind == "take":  # read through its pointer: any stored tensor (a parameter, or
            operands = operands[1:]  # a router's expert per token that a row program stores)
        stack.extend(operands)
    return frozenset(out) if any(graph.op(n).kind == "take" for n in out) else frozenset()


def row_segment(graph: Graph, matmul: int, gathered: frozenset[int]) -> int | None:
    """The index a gathered B operand selects its matrix by, per row of a grouped GEMM: in a
    product of one row per batch element, [..., T, 1, N] (a token's `x[:, None, :]` times its
    expert's or adapter's weight `w[idx]`), the gather's index that varies along T alone
    (`idx[t]`), constant along K and N. The kernel then takes T as its rows, and walks the
    indices a tile's rows hold (consecutive when the rows are sorted by it), multiplying each
    one's rows by its matrix: every matrix tile is loaded once a row tile, not once a row.
    None when the product is not of that form."""
    shape = graph.op(matmul).shape
    if len(shape) < 3 or shape[-2] != 1 or shape[-3] == 1:
        return None
    tensors = [n for n in gathered if graph.op(n).kind == "take"
               and graph.op(graph.operands(n)[0]).kind == "param" and graph.op(n).shape[-2:] != (1, 1)]
    if len(tensors) != 1:
        return None
    along_t = [o for o in graph.operands(tensors[0])[1:]
               if (s := graph.op(o).shape) and len(s) >= 3 and s[-3] != 1]
    if len(along_t) != 1 or graph.op(along_t[0]).shape[-2:] != (1, 1) or \
            len(graph.op(along_t[0]).shape) != len(shape):
        return None
    return along_t[0]


def grouped_dot(graph: Graph, matmul: int) -> bool:
    """Is `matmul` a grouped GEMM's product (`row_segment`): one row per batch element, times
    a matrix its index selects (a token's expert weight): an MLP per token, not the scores or
    the output of an attention, whose keys and values are data per batch element."""
    gathered = gathered_operand(graph, graph.operand_edges(matmul)[1])
    return bool(gathered) and row_segment(graph, matmul, gathered) is not None


def parameter_or_view(graph: Graph, node: int) -> bool:
    """A parameter, or a view (slice, reshape, transpose) of one, through views."""
    op = graph.op(node)
    while isinstance(op, Op) and ops.category(op.kind) is ops.Category.LAYOUT:
        node = graph.operands(node)[0]
        op = graph.op(node)
    return isinstance(op, Op) and op.kind == "param"


def gathered_prologue_refusal(graph: Graph, cand: int, inside: frozenset[int], matmul: int) -> Refusal | None:
    """Why `cand`, one of the ops of a gathered operand (`gathered_operand`: `inside`), cannot
    be computed on each tile the matmul loads: its ops at the operand's shape cost more units
    per element than the K loop hides (`profitability.GATHERED_PROLOGUE_BUDGET`)."""
    if any(u not in inside and u != matmul for u, _ in graph.users(cand)):
        return Refusal(Rule.PROFIT, "its value is also used elsewhere, so it is stored anyway")
    why = unpacking_refusal(gathered_units(graph, inside, matmul))
    return None if why is None else Refusal(Rule.PROFIT, why)


def gathered_units(graph: Graph, inside: frozenset[int], matmul: int) -> int:
    """The units per element of a gathered operand's ops at the operand's shape; those at a
    smaller shape (`k // 8` along K) run once per row or column of its tile."""
    full = graph.result_type(*graph.operand_edges(matmul)[1]).shape
    return sum(ops.units(graph.op(n).kind) for n in inside if graph.op(n).shape == full)


def pending_source(graph: Graph, node: int, joins: Callable[[int], bool] | None = None,
                    memo: dict | None = None) -> int | None:
    """The first op `node` is computed from, through elementwise ops and views, that no kernel
    computes yet and that is not elementwise (a reduction, a softmax, a matmul), or None when
    it is computed from inputs, constants and kernel results only: a side chain an epilogue
    can take without splitting what a later pass would fuse. Memoized until the graph
    changes (or in `memo`, which a caller with `joins` owns), so growing a group stays
    linear."""
    memo = graph.memo("pending-source") if memo is None else memo
    stack = list(graph.operands(node))
    while stack:
        n = stack[-1]
        if n in memo:
            stack.pop()
            continue
        op = graph.op(n)
        if isinstance(op, KernelOp) or op.kind in ("param", "dim", "const") or (joins and joins(n)):
            memo[n] = None
        elif ops.category(op.kind) is ops.Category.LAYOUT and isinstance(
                src := graph.op(graph.operands(n)[0]), Op) and src.kind == "matmul":
            memo[n] = None  # a view of a product: no epilogue of the product reads through it
        elif ops.is_elementwise(op.kind) or ops.category(op.kind) is ops.Category.LAYOUT:
            pending = [o for o in graph.operands(n) if o not in memo]
            if pending:
                stack.extend(pending)
                continue
            memo[n] = next((memo[o] for o in graph.operands(n) if memo[o] is not None), None)
        else:
            memo[n] = n
        stack.pop()
    return next((memo[o] for o in graph.operands(node) if memo[o] is not None), None)


def _a_vector(shape: Shape, a_shape: Shape) -> bool:
    """A vector along A's K dim ([K], or [1, ..., 1, K]) or along its rows ([..., M, 1], its
    batch dims A's or 1)."""
    if len(shape) >= 1 and shape[-1] == a_shape[-1] and all(d == 1 for d in shape[:-1]):
        return True
    return 2 <= len(shape) <= len(a_shape) and shape[-1] == 1 and shape[-2] == a_shape[-2] \
        and broadcasts_to(shape, a_shape)
