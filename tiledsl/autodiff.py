"""Reverse-mode differentiation of the graph IR: a program's backward program.

`derive(graph, wrt)` takes a kernel's graph IR (after sema, before any pass) and
the parameters that want a gradient, and builds two graphs that go through the
same pipeline as any program:

- the training forward: the program with the values its backward reads
  appended to its outputs (`Derivation.saved`);
- the backward: parameters are the forward's parameters (every one, so every
  dim binds), the forward outputs and saved values it reads, then one
  gradient per differentiable output (`grad_0`, ...); it returns the gradient
  of each parameter in `wrt`, in that parameter's dtype and shape.

Each op's vector-Jacobian product is its `vjp` in the op registry
(`tiledsl/ops`): given an `Adjoint` (the gradient of its result and access to
its primal operands and result) it returns one contribution per operand, or
None where it contributes nothing (a zero gradient: `floor`, `sign`, the
condition of `where`). The driver here owns the rest: only float values on a
path from `wrt` to an output are differentiated, contributions are summed in
the value's dtype, summed over the axes an operand was broadcast along, cast
to the operand's dtype, and a parameter's gradient is expanded to its shape.

Primal values the rules read are placeholders until the backward is built and
dead code is gone; then each one still read is resolved by the cost model
(`_resolve`): a parameter is passed in, a forward output is passed in (it
exists anyway), a value whose recomputation would run a matmul is saved by
the training forward (a matmul, or a reduction, softmax or view of a matmul's
result; an elementwise op is recomputed from such saved values), anything
else is recomputed in the backward from the values it depends on (where the
fusion passes fuse it into the kernels that read it: AOTAutograd's min-cut
partitioner makes the same call for pointwise and reduction ops).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx

from tiledsl import diagnostics as diag
from tiledsl import ops
from tiledsl.builder import Builder
from tiledsl.ir import Graph, Op, make_attrs, walk
from tiledsl.source import Span
from tiledsl.types import DType, TensorType, broadcast_shapes, broadcasts_to


@dataclass(frozen=True, slots=True)
class Source:
    """What one backward parameter is bound to at the call: forward parameter `index`
    ("input"), forward output `index` ("output"), saved value `index` (the training
    forward's output `n_outputs + index`: "saved"), or the gradient of forward output
    `index` ("grad")."""

    kind: str
    index: int


@dataclass
class Derivation:
    """A differentiated program: its training forward, its backward, and how they meet."""

    forward: Graph  # the program, returning its outputs and then the saved values
    backward: Graph
    wrt: tuple[int, ...]  # forward parameter indices whose gradients the backward returns
    sources: tuple[Source, ...]  # per backward parameter
    n_outputs: int  # the program's own outputs (the training forward has more)
    saved: tuple[int, ...]  # forward nodes saved, in order

    @property
    def differentiable_outputs(self) -> tuple[int, ...]:
        return tuple(s.index for s in self.sources if s.kind == "grad")


class Adjoint:
    """What a derivative rule sees of one op: the gradient `g` of its result (in the
    result's dtype, broadcastable to its shape), its primal operands `x(i)` and result
    `y`, and a builder for the backward ops, each located at the op's span."""

    def __init__(self, builder: _Backward, node: int, op: Op, g: int) -> None:
        self._b, self._node, self.op, self.g = builder, node, op, g
        self._operands = builder.fwd.operands(node)

    def x(self, i: int) -> int:
        return self._b.primal(self._operands[i])

    def primal(self, node: int) -> int:
        """Forward node `node` (one the op's operands are computed from) in the backward."""
        return self._b.primal(node)

    @property
    def y(self) -> int:
        return self._b.primal(self._node)

    def x_type(self, i: int) -> TensorType:
        return self._b.fwd.op(self._operands[i]).type

    @property
    def forward(self) -> Graph:
        """The forward graph, to read the structure of the op's operands (an index map)."""
        return self._b.fwd

    def operand(self, i: int) -> int:
        """Operand i's forward node (`x(i)` is its value in the backward)."""
        return self._operands[i]

    @property
    def backward(self) -> Graph:
        return self._b.bwd

    def reread(self, v: int, coords: Sequence[int | None]) -> int:
        """Backward value `v` read at `coords` (an index value per axis of v; None along an
        axis of size 1), computed where it is read (`indexing.reindex`): the gradient of a
        view or of a gather at an index map is read back so in the kernel reading it, never
        stored for a gather. A primal map of positions alone that v reads (a concat's
        `i < D - D // 2`) is computed in the backward first, so it is read through too."""
        from tiledsl.indexing import reindex

        view = self._own_positions(v, coords)
        if view is not None:
            return view
        self._b.positions_now(v)
        return reindex(self._b.b, v, list(coords), self.op.span)

    def _own_positions(self, v: int, coords: Sequence[int | None]) -> int | None:
        """v read at positions that are the result's own along axes in v's order (a label
        per row [N] read at the rows of [N, C]): a view of v with the result's other axes
        new, its own size-1 ones dropped; None when the coordinates are not such."""
        bwd = self._b.bwd
        shape = bwd.op(v).shape
        axes = []
        for c, n in zip(coords, shape, strict=True):
            if c is None:
                axes.append(None)
                continue
            op = bwd.op(c)
            if op.kind != "index" or op.shape[op.attr("axis")] != n:
                return None
            axes.append((op.attr("axis"), len(op.shape)))
        mapped = [a for a in axes if a is not None]
        order = [a for a, _ in mapped]
        if not mapped or len({r for _, r in mapped}) != 1 or order != sorted(set(order)):
            return None
        rank = mapped[0][1]
        items, q = [], 0
        for a, n in zip(axes, shape, strict=True):
            if a is None:
                items.append(("at", 0))
                continue
            items += [("new",)] * (a[0] - q) + [("range", 0, n, 1, n)]
            q = a[0] + 1
        items += [("new",)] * (rank - q)
        return self.call("slice", v, items=tuple(items))

    def primal_of(self, v: int) -> tuple[Graph, int] | None:
        """The forward graph and node a backward placeholder stands for (None: `v` is an op
        of the backward's own)."""
        node = self._b.standing_for.get(v)
        return (self._b.fwd, node) if node is not None and self._b.placeholders.get(node) == v else None

    @property
    def scores(self) -> bool:
        """Is this op an attention's score matmul (recomputed by the fused backward)?"""
        return self._node in self._b.flash_scores

    def attr(self, name: str) -> Any:
        return self.op.attr(name)

    def shape(self, v: int) -> tuple:
        """The shape of a backward value (`g` may be broadcast: smaller than the result)."""
        return self._b.bwd.op(v).shape

    def call(self, kind: str, *operands: int, **attrs: Any) -> int:
        return self._b.emit(kind, operands, self.op.span, **attrs)

    def add(self, a: int, b: int) -> int:
        return self.call("add", a, b)

    def sub(self, a: int, b: int) -> int:
        return self.call("sub", a, b)

    def mul(self, *factors: int) -> int:
        out = factors[0]
        for f in factors[1:]:
            out = self.call("mul", out, f)
        return out

    def div(self, a: int, b: int) -> int:
        return self.call("div", a, b)

    def neg(self, a: int) -> int:
        return self.call("neg", a)

    def c(self, value: float | int | bool) -> int:
        """A literal (weak: it takes the other operand's dtype, like a Python scalar)."""
        return self._b.const(value, self.op.span)

    def where(self, cond: int, a: int, b: int) -> int:
        return self.call("where", cond, a, b)

    def all(self, conds: Sequence[int]) -> int:
        """The conjunction of bool values (at least one)."""
        out = conds[0]
        for c in conds[1:]:
            out = self.call("and", out, c)
        return out

    def keep(self, v: int) -> int:
        """A reduction's `v` with its reduced axis back (size 1), if the op dropped it."""
        if self.op.attr("keepdims"):
            return v
        rank = len(self.x_type(0).shape)
        axis = self.op.attr("axis") % rank
        return self._b.unsqueeze(v, axis, self.op.span)

    def size(self, dim: Any) -> int:
        """A dim (an int or a dim expression) as a value."""
        return self._b.size(dim, self.op.span)

    def axis_size(self) -> int:
        """The size of the reduced axis, as a value."""
        t = self.x_type(0)
        return self._b.size(t.shape[self.op.attr("axis") % len(t.shape)], self.op.span)

    def transpose(self, v: int) -> int:
        return self._b.transpose(v, self.op.span)


def derive(graph: Graph, wrt: Sequence[int] | None = None) -> Derivation:
    """The derivation of `graph` (graph IR) with respect to its tensor parameters `wrt`
    (indices; default: every float tensor parameter). A `GradientError` names the op a
    gradient cannot pass through."""
    params = [graph.op(p) for p in graph.params]
    if wrt is None:
        wrt = [i for i, p in enumerate(params) if differentiable(p)]
    for i in wrt:
        if not differentiable(params[i]):
            raise diag.GradientError(params[i].span, message=(
                f"parameter '{params[i].attr('name')}' ({params[i].attr('type')}) has no gradient: "
                "only floating-point tensor parameters are differentiable"))
    return _Backward(graph.copy(), tuple(wrt)).build()


def differentiable(param: Op) -> bool:
    """Can a parameter have a gradient: a floating-point tensor (not a scalar, index or
    mask, nor an f8 tensor, which is storage for a matmul operand)?"""
    return _differentiable_dtype(param.dtype) and not param.attr("scalar")


def _differentiable_dtype(dtype: DType) -> bool:
    return dtype.is_float and not dtype.is_f8


PRIMAL = "param"  # placeholders are parameter ops until `_resolve` binds them


class _Backward:
    def __init__(self, fwd: Graph, wrt: tuple[int, ...]) -> None:
        self.fwd, self.wrt = fwd, wrt
        self.bwd = Graph(f"{fwd.name}_backward", fwd.span, fwd.hints)
        self.b = Builder(self.bwd)
        self.bwd.requires = fwd.requires
        self.placeholders: dict[int, int] = {}  # forward node -> placeholder node
        # placeholder node -> forward node, as made (an entry whose placeholder was resolved
        # since is stale: `placeholders` says which stand)
        self.standing_for: dict[int, int] = {}
        self.resolved: dict[int, int] = {}  # forward node -> backward node computing it
        self.consts: dict[tuple, int] = {}
        self.dims: dict[str, int] = {}
        self.sources: list[tuple[Source, int]] = []  # (source, backward parameter node)
        self.saved: list[int] = []
        # attention differentiated in its flash form (`_flash`): softmaxes recomputed from
        # their logsumexp, which the forward saves instead of the probabilities, and the
        # score matmuls, recomputed rather than saved
        self.flash_softmax: set[int] = set()
        self.flash_scores: set[int] = set()

    # --- building ------------------------------------------------------------------------

    def emit(self, kind: str, operands: Iterable[int], span: Span | None, **attrs: Any) -> int:
        return self.b.op(kind, tuple(operands), span, **attrs)

    def const(self, value: Any, span: Span | None) -> int:
        dtype = DType.BOOL if isinstance(value, bool) else DType.I32 if isinstance(value, int) \
            else DType.F32
        key = (value, dtype)
        if key not in self.consts:
            self.consts[key] = self.b.const(value, dtype, span)
        return self.consts[key]

    def size(self, dim: Any, span: Span | None) -> int:
        from tiledsl.dims import build

        def name(symbol: str) -> int:
            if symbol not in self.dims:
                self.dims[symbol] = self.b.dim(symbol, span)
            return self.dims[symbol]

        return build(dim, name, lambda k: self.const(k, span),
                     lambda kind, *args: self.emit(kind, args, span))

    def unsqueeze(self, v: int, axis: int, span: Span | None) -> int:
        """`v` with a size-1 axis inserted at `axis` (a `slice` view, x[:, None])."""
        shape = self.bwd.op(v).shape
        items = [("range", 0, d, 1, d) for d in shape]
        items.insert(axis, ("new",))
        return self.emit("slice", [v], span, items=tuple(items))

    def transpose(self, v: int, span: Span | None) -> int:
        """`v` with its last two dims swapped (dims as sema writes them, so that
        canonicalize folds a transpose of a transpose)."""
        rank = self.bwd.op(v).type.rank
        return self.emit("transpose", [v], span, dims=(rank - 2, rank - 1))

    def cast(self, v: int, dtype: DType, span: Span | None) -> int:
        if self.bwd.op(v).dtype is dtype:
            return v
        return self.emit("cast", [v], span, dtype=dtype)

    def primal(self, node: int) -> int:
        """The forward value `node` in the backward, as a placeholder until `_resolve`."""
        if node in self.resolved:
            return self.resolved[node]
        if node not in self.placeholders:
            op = self.fwd.op(node)
            ph = self.b.op(PRIMAL, [], op.span, type=op.type)
            self.bwd.params.remove(ph)
            self.placeholders[node] = ph
            self.standing_for[ph] = node
        return self.placeholders[node]

    def positions_now(self, v: int) -> None:
        """Compute in the backward now each placeholder `v` reads that stands for a map of
        positions alone (`index`es, constants and dims through elementwise ops), as
        `_resolve` would later, so that `reindex` reads it through."""
        for n in list(walk([v], self.bwd.operands)):
            node = self.standing_for.get(n)
            if node is not None and self.placeholders.get(node) == n and _positions_alone(self.fwd, node):
                self._compute(node)

    def _compute(self, node: int) -> int:
        """Forward node `node` computed in the backward (its operands first), replacing its
        placeholder."""
        if node in self.resolved:
            return self.resolved[node]
        new = self.b.copy(self.fwd.op(node), [self._compute(o) for o in self.fwd.operands(node)])
        self.resolved[node] = new
        ph = self.placeholders.pop(node, None)
        if ph is not None:
            self.bwd.replace_uses(ph, new)
            self.bwd.remove(ph)
        return new

    # --- the derivation ------------------------------------------------------------------

    def build(self) -> Derivation:
        fwd, bwd = self.fwd, self.bwd
        for p in fwd.params:
            op = fwd.op(p)
            node = self.b.copy(op, [])
            self.resolved[p] = node
            self.sources.append((Source("input", op.attr("index")), node))
        active = self._active()
        adjoints: dict[int, list[int]] = {}
        names = {fwd.op(p).attr("name") for p in fwd.params}
        outputs = fwd.outputs
        n_outputs = len(outputs) - len(fwd.checks)
        for k, ((node, _), t) in enumerate(zip(outputs[:n_outputs], fwd.returns, strict=False)):
            if node not in active:
                continue
            g = self.b.param(t, fwd.op(node).span, name=_fresh(f"grad_{k}", names), scalar=False)
            self.sources.append((Source("grad", k), g))
            adjoints.setdefault(node, []).append(self.cast(g, fwd.op(node).dtype, fwd.op(node).span))
        for node in reversed(fwd.topo_order()):
            if node not in adjoints or fwd.op(node).kind == "param":
                continue
            op = fwd.op(node)
            g = self._sum(adjoints.pop(node), op)
            if self.bwd.op(g).shape != op.shape and not ops.is_elementwise(op.kind):
                # a broadcast gradient (a sum's, [M, 1]) in full for the rules that contract
                # or rearrange it (matmul, reshape, transpose); elementwise ones broadcast it
                g = self.emit("expand", [g], op.span, shape=op.shape)
            flash = self._flash(node, active)
            if flash is not None:
                for o, c in zip((fwd.operands(flash[0])[0], fwd.operands(node)[1]),
                                self._flash_vjp(node, *flash, g, active), strict=True):
                    if c is not None:  # (None: that operand needs no gradient)
                        adjoints.setdefault(o, []).append(self._fit(c, fwd.op(o), op.span))
                continue
            self._chain(node)
            rule = ops.OPS[op.kind].vjp
            if rule is None:
                raise diag.GradientError(op.span, message=(
                    f"'{ops.OPS[op.kind].symbol or op.kind}' has no derivative in tiledsl yet; "
                    "the gradient of this program passes through it"))
            operands = fwd.operands(node)
            wanted = [o in active for o in operands]
            try:
                contributions = list(rule(Adjoint(self, node, op, g), wanted))
            except ops.NotDifferentiable as err:
                raise diag.GradientError(op.span, message=str(err)) from None
            contributions += [None] * (len(operands) - len(contributions))
            for slot, (o, c, w) in enumerate(zip(operands, contributions, wanted, strict=True)):
                if c is not None and w:
                    # (others' are whole; a gathered operand's, a scatter-add, has its shape)
                    whole = not ops.is_elementwise(op.kind) or ops.gathers_at(op.kind, slot)
                    full = () if whole else op.shape
                    adjoints.setdefault(o, []).append(self._fit(c, fwd.op(o), op.span, full))
        grads = []
        for i in self.wrt:
            p = fwd.params[i]
            op = fwd.op(p)
            g = self._sum(adjoints.get(p, []), op) if p in adjoints else self.const(0.0, op.span)
            if bwd.op(g).shape != op.shape:
                g = self.emit("expand", [g], op.span, shape=op.shape)
            grads.append(self.cast(g, op.dtype, op.span))
        self.b.ret(grads, fwd.span)
        bwd.returns = tuple(fwd.op(fwd.params[i]).type for i in self.wrt)
        self._dce()
        self._resolve()
        self._dce()
        forward = self._training_forward(n_outputs)
        sources = self._order_params()
        return Derivation(forward, bwd, self.wrt, sources, n_outputs, tuple(self.saved))

    def _flash(self, node: int, active: set[int]) -> tuple[int, list[tuple[int, int]]] | None:
        """The softmax of `softmax(scores) @ v`, when the product is its one use (through ops
        linear in the probabilities, each the only use of the one before: casts, dropout's
        product with a mask, `where(c, p, 0)`, whose other operands need no gradient), the
        softmax runs along the keys (the last axis) and the scores are computed from a matmul:
        attention, which is differentiated the way FlashAttention does it (`_flash_vjp`).
        With the softmax, the linear ops from the product's operand down to it, each as
        (node, the slot the probabilities come in at)."""
        fwd = self.fwd
        if fwd.op(node).kind != "matmul":
            return None
        outputs = {n for n, _ in fwd.outputs}
        n, chain = fwd.operands(node)[0], []
        while fwd.op(n).kind != "softmax":
            inner = [k for k, o in enumerate(fwd.operands(n))
                     if ops.linear_in(fwd, n, k) and _reaches_softmax(fwd, o)]
            if len(inner) != 1 or n in outputs or len(fwd.users(n)) != 1:
                return None
            others = [o for k, o in enumerate(fwd.operands(n)) if k != inner[0]]
            if any(o in active and fwd.op(o).dtype.is_float for o in others):
                return None  # a factor that needs a gradient of its own
            chain.append((n, inner[0]))
            n = fwd.operands(n)[inner[0]]
        sm, op = n, fwd.op(n)
        if op.attr("axis") % len(op.shape) != len(op.shape) - 1 \
                or sm in outputs or len(fwd.users(sm)) != 1:
            return None
        (x,) = fwd.operands(sm)
        if not _runs_matmul(fwd, x):
            return None
        return sm, chain

    def _flash_vjp(self, pv: int, sm: int, chain: list[tuple[int, int]], g: int,
                   active: set[int]) -> tuple[int | None, int | None]:
        """Contributions of `o = L(softmax(x)) @ v` to x and to v from the output's gradient g,
        L the linear ops `chain` (none, a cast, dropout's mask): dv = L(p).T @ g,
        dx = p * (L'(g @ v.T) - delta) with delta = rowsum(g * o) in f32 (the softmax's
        rowsum(dp * p), by associativity: L is diagonal; FlashAttention-2's pre-pass). The
        probabilities are recomputed in the backward from the scores and their saved
        logsumexp, and the scores from q and k: nothing [M, N] is saved (a dropout mask is
        drawn again from its seed)."""
        fwd = self.fwd
        span = fwd.op(pv).span
        p_node, v_node = fwd.operands(pv)
        (x,) = fwd.operands(sm)
        self.flash_softmax.add(sm)
        self._mark_scores(x)
        p = self.primal(p_node)
        dv = self.emit("matmul", [self.transpose(p, span), g], span) if v_node in active else None
        if x not in active:
            return None, dv
        dp = self.emit("matmul", [g, self.transpose(self.primal(v_node), span)], span)
        for n, slot in chain:  # L is diagonal: its adjoint is L itself, on dp
            op, operands = fwd.op(n), fwd.operands(n)
            if op.kind == "mul":
                dp = self.emit("mul", [dp, self.primal(operands[1 - slot])], op.span)
            elif op.kind == "where":
                zero = self.const(0.0, op.span)
                branches = [dp, zero] if slot == 1 else [zero, dp]
                dp = self.emit("where", [self.primal(operands[0]), *branches], op.span)
        wide = [self.cast(v, DType.F32, span) for v in (g, self.primal(pv))]
        delta = self.emit("sum", [self.emit("mul", wide, span)], span, axis=fwd.op(pv).type.rank - 1,
                          keepdims=True)
        dx = self.emit("mul", [self.primal(sm), self.emit("sub", [dp, delta], span)], span)
        return dx, dv

    def _chain(self, node: int) -> None:
        """`f(q @ k.T) @ v` with no softmax, its left operand computed elementwise from the
        scores and used by the product alone (and sums over the keys): one kernel that never
        stores the scores (fuse-attention), so the backward recomputes them from q and k, as
        for attention."""
        from tiledsl.passes.fusion.admission import keys_are_data

        fwd = self.fwd
        if fwd.op(node).kind != "matmul":
            return
        p, v = fwd.operands(node)
        outputs = {n for n, _ in fwd.outputs}
        last = len(fwd.op(p).shape) - 1
        others = [u for u, _ in fwd.users(p) if u != node and not (
            fwd.op(u).kind == "sum" and fwd.op(u).attr("axis") == last)]  # a normaliser's sum
        if not ops.is_elementwise(fwd.op(p).kind) or p in outputs or others or not _runs_matmul(fwd, p):
            return
        scores = self._score_matmuls(p)
        if any(keys_are_data(fwd.op(fwd.operands(m)[1]).type, fwd.op(v).type) for m in scores):
            self.flash_scores |= scores

    def _score_matmuls(self, x: int) -> set[int]:
        """The matmuls `x` is computed from through elementwise ops."""
        fwd, stack, out, seen = self.fwd, [x], set(), set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            op = fwd.op(n)
            if op.kind == "matmul":
                out.add(n)
            elif ops.is_elementwise(op.kind) and _runs_matmul(fwd, n):
                stack.extend(fwd.operands(n))
        return out

    def _mark_scores(self, x: int) -> None:
        """The matmuls the scores `x` are computed from through elementwise ops: recomputed in
        the backward (a flash forward never stores them)."""
        self.flash_scores |= self._score_matmuls(x)

    def _active(self) -> set[int]:
        """Float values on a path from a `wrt` parameter to an output."""
        fwd = self.fwd
        reach = set()
        for i in self.wrt:
            reach |= {fwd.params[i]} | nx.descendants(fwd.nx, fwd.params[i])
        to_out = set()
        for node, _ in fwd.outputs:
            to_out |= {node} | nx.ancestors(fwd.nx, node)
        return {n for n in reach & to_out if _differentiable_dtype(fwd.op(n).dtype)}

    def _sum(self, terms: list[int], op: Op) -> int:
        out = terms[0]
        for t in terms[1:]:
            out = self.emit("add", [out, t], op.span)
        return self.cast(out, op.dtype, op.span)

    def _fit(self, c: int, operand: Op, span: Span | None, full: tuple = ()) -> int:
        """A contribution to an operand, summed over the axes it was broadcast along and in
        its dtype (it may stay smaller: it broadcasts to the operand). `c` stands for a value
        of the op's shape `full`: where it is broadcast itself (size 1) along an axis of
        `full` the operand was broadcast along too, the sum over that axis is c times the
        axis's size (`sum(x - z, -1)`: z [M, 1] gets -N * g)."""
        shape = self.bwd.op(c).shape
        target = operand.shape
        for k in range(1, len(full) + 1):
            d = full[-k]
            if d != 1 and (target[-k] if k <= len(target) else 1) == 1 \
                    and (shape[-k] if k <= len(shape) else 1) == 1:
                c = self.emit("mul", [c, self.size(d, span)], span)
        shape = self.bwd.op(c).shape
        if not broadcasts_to(target, shape) and not broadcasts_to(shape, target):
            c = self.emit("expand", [c], span, shape=broadcast_shapes(shape, target))
            shape = self.bwd.op(c).shape
        lead = len(shape) - len(target)
        for _ in range(max(lead, 0)):  # axes the operand lacks
            first = self.bwd.op(c).shape[0]
            c = self._drop_first(c, span) if first == 1 else self.emit(
                "sum", [c], span, axis=0, keepdims=False)
        shape = self.bwd.op(c).shape
        off = len(target) - len(shape)
        for k, d in enumerate(shape):
            if d != 1 and target[off + k] == 1:
                c = self.emit("sum", [c], span, axis=k, keepdims=True)
        return self.cast(c, operand.dtype, span)

    def _drop_first(self, v: int, span: Span | None) -> int:
        shape = self.bwd.op(v).shape
        items = (("at", 0),) + tuple(("range", 0, d, 1, d) for d in shape[1:])
        return self.emit("slice", [v], span, items=items)

    def _dce(self) -> None:
        bwd = self.bwd
        live = nx.ancestors(bwd.nx, bwd.output) | {bwd.output}
        dead = [n for n in bwd.nodes() if n not in live and n not in bwd.params]
        bwd.remove_all(dead)
        for table in (self.placeholders, self.resolved):
            for k, v in list(table.items()):
                if v not in bwd.nx:
                    del table[k]
        for name in [s for s, n in self.dims.items() if n not in bwd.nx]:
            del self.dims[name]
        self.consts = {k: n for k, n in self.consts.items() if n in bwd.nx}

    # --- what the backward reads of the forward --------------------------------------------

    def _resolve(self) -> None:
        """Bind every placeholder: recompute it, pass a forward output, or save it."""
        fwd, bwd = self.fwd, self.bwd
        outputs = {node: k for k, (node, _) in reversed(list(enumerate(fwd.outputs)))}
        order = {n: i for i, n in enumerate(fwd.topo_order())}
        while self.placeholders:
            node = max(self.placeholders, key=order.__getitem__)  # consumers first
            ph = self.placeholders.pop(node)
            op = fwd.op(node)
            k = outputs.get(node)
            if k is not None and k < len(fwd.returns) and fwd.returns[k] == op.type:
                new = self._source(Source("output", k), op, f"out_{k}")
            elif node in self.flash_softmax:
                new = self._probabilities(node)
            elif not op.weak and node not in self.flash_scores and (
                    _runs_matmul(fwd, node) and not ops.is_elementwise(op.kind)
                    or _epilogue_into_matmul(fwd, node, self.flash_scores) or _row_statistic(fwd, node)):
                self.saved.append(node)
                new = self._source(Source("saved", len(self.saved) - 1), op,
                                   f"saved_{len(self.saved) - 1}")
            else:
                new = self.b.copy(op, [self.primal(o) for o in fwd.operands(node)])
            self.resolved[node] = new
            bwd.replace_uses(ph, new)
            bwd.remove(ph)

    def _probabilities(self, sm: int) -> int:
        """A flash softmax's result recomputed from its scores x and their logsumexp, which the
        training forward saves in f32 (the attention kernel stores it per row): exp(x - lse),
        with an empty row's -inf taken as 0 (its probabilities are 0, never NaN)."""
        fwd, op = self.fwd, self.fwd.op(sm)
        span = op.span
        (x,) = fwd.operands(sm)
        forward = Builder(fwd)
        wide = x if fwd.op(x).dtype is DType.F32 else forward.op("cast", [x], span, dtype=DType.F32)
        lse = forward.op("logsumexp", [wide], span, axis=op.type.rank - 1, keepdims=True)
        self.saved.append(lse)
        k = len(self.saved) - 1
        saved = self._source(Source("saved", k), fwd.op(lse), f"saved_{k}")
        empty = self.emit("eq", [saved, self.const(float("-inf"), span)], span)
        m = self.emit("where", [empty, self.const(0.0, span), saved], span)
        e = self.emit("exp", [self.emit("sub", [self.cast(self.primal(x), DType.F32, span), m], span)], span)
        return self.cast(e, op.dtype, span)

    def _source(self, source: Source, op: Op, name: str) -> int:
        names = {self.bwd.op(n).attr("name") for n in self.bwd.params}
        node = self.b.param(TensorType(op.dtype, op.shape), op.span, name=_fresh(name, names),
                            scalar=False)
        self.sources.append((source, node))
        return node

    def _order_params(self) -> tuple[Source, ...]:
        """Parameters in call order (inputs, outputs, saved, gradients), indexed."""
        rank = {"input": 0, "output": 1, "saved": 2, "grad": 3}
        ordered = sorted(self.sources, key=lambda s: (rank[s[0].kind], s[0].index))
        bwd = self.bwd
        bwd.params = []
        for i, (_, node) in enumerate(ordered):
            op = bwd.op(node)
            bwd.set_op(node, op.replace(attrs=make_attrs(**{**op.attr_map, "index": i})))
            bwd.params.append(node)
        return tuple(s for s, _ in ordered)

    def _training_forward(self, n_outputs: int) -> Graph:
        fwd = self.fwd.copy()
        if not self.saved:
            return fwd
        fwd.name = f"{self.fwd.name}_training"
        ret = fwd.output
        outs = fwd.operand_edges(ret)
        span = fwd.op(ret).span
        fwd.remove_all([ret])
        fwd.output = None
        checks = outs[n_outputs:]
        Builder(fwd).ret(outs[:n_outputs] + [(n, 0) for n in self.saved] + checks, span)
        types = tuple(TensorType(fwd.op(n).dtype, fwd.op(n).shape) for n in self.saved)
        fwd.returns = fwd.returns[:n_outputs] + types + fwd.returns[n_outputs:]
        return fwd


def _positions_alone(graph: Graph, node: int) -> bool:
    """Is `node` computed from positions, constants and dims alone (no parameter, no
    gather)?"""
    def read(n: int) -> list[int]:
        return [] if graph.op(n).kind in ("const", "dim", "index") else list(graph.operands(n))

    return all(op.kind in ("const", "dim", "index") or op.kind != "take" and ops.is_elementwise(op.kind)
               for op in map(graph.op, walk([node], read)))


def _reaches_softmax(graph: Graph, node: int) -> bool:
    """Is `node` a softmax, or computed from one through operands ops are linear in
    (`ops.linear_in`: what `Derive._flash` takes as linear in the probabilities)?"""
    linear = lambda n: [o for k, o in enumerate(graph.operands(n)) if ops.linear_in(graph, n, k)]  # noqa: E731
    return any(graph.op(n).kind == "softmax" for n in walk([node], linear))


def _runs_matmul(graph: Graph, node: int) -> bool:
    """Would recomputing `node` from the parameters run a matmul? (One pass in topological
    order per graph, memoised: programs may be thousands of ops deep.)"""
    memo = graph.memo("runs-matmul")
    if not memo:
        for n in graph.topo_order():
            memo[n] = graph.op(n).kind == "matmul" or any(memo[o] for o in graph.operands(n))
    return memo[node]


def _row_statistic(graph: Graph, node: int) -> bool:
    """Is `node` a reduction along an axis of its operand (a row's logsumexp, mean, sum of
    squares)? The forward computes it anyway; saved, it costs a value a row written and read
    (1/n of the row's bytes), where recomputed it costs the backward a pass over the row
    (the whole row again when it is longer than a tile: a cross-entropy's 128k logits)."""
    op = graph.op(node)
    if ops.category(op.kind) is not ops.Category.REDUCTION or op.dtype is not DType.F32:
        return False
    shape = graph.op(graph.operands(node)[0]).shape
    return len(shape) > 0 and shape[op.attr("axis") % len(shape)] != 1


def _epilogue_into_matmul(graph: Graph, node: int, scores: set[int]) -> bool:
    """Is `node` a 16-bit value the forward computes elementwise from a matmul's f32
    accumulator and stores for another matmul to read (a gated MLP's `silu(x @ w1) *
    (x @ w3)`)? Recomputed, it would start from the matmul results rounded to 16 bits: more
    roundings than the forward's (f16 weight gradients at 2.5x eager's error); saved, it
    costs the forward nothing it does not store already. Not attention's scores (`scores`:
    their matmuls), which a flash kernel never stores and the backward recomputes."""
    op = graph.op(node)
    if not ops.is_elementwise(op.kind) or op.dtype not in (DType.F16, DType.BF16):
        return False
    if not any(graph.op(u).kind == "matmul" for u, _ in graph.users(node)):
        return False
    stack, seen, found = [node], set(), False
    while stack:
        n = stack.pop()
        for o in graph.operands(n):
            if o in seen:
                continue
            seen.add(o)
            kind = graph.op(o).kind
            if kind == "matmul":
                if o in scores:
                    return False
                found = True
            elif ops.is_elementwise(kind):
                stack.append(o)
    return found


def _fresh(name: str, taken: set[str]) -> str:
    while name in taken:
        name += "_"
    taken.add(name)
    return name

