"""The plan of an attention kernel: which value of its region plays which role.

`fuse-attention` builds the region; `attention_plan` records the two matmuls,
the operand prologues and the tensors q, k and v are loaded from, the score
modification, the softmax, stored `logsumexp`s, the epilogue, and the
key-block bound a mask allows (`KeyBound`). The template and `explain()` read
the plan; nothing analyses the region again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable

from tiledsl import ops as ops_module
from tiledsl.dims import Lin
from tiledsl.ir import Op, Region, walk
from tiledsl.plans import (
    AttentionBackwardPlan,
    AttentionPlan,
    IndexSum,
    KeyBound,
    LowerBound,
    ScoreDot,
    ScoreProduct,
    ScoreReduction,
)
from tiledsl.types import DType, result_dtype

from .spec import AttentionBackwardSpec, AttentionSpec


def attention_plan(region: Region, spec: AttentionSpec) -> AttentionPlan:
    """The plan of the roles fuse-attention gave (`AttentionSpec`), with what the region's
    dataflow says about them: the values each operand of q @ k.T is computed from and the
    tensor it loads, whether k is read transposed, the clones (index expressions, scalar
    expressions) the score modification or the epilogue computes, and the key bound of the
    mask. With no softmax the bound is one outside which p and every summed value are 0
    (`where(causal(s), s, 0)`, a decay `s * where(i >= j, g, 0)`)."""
    n_in = len(region.inputs)
    ops = {n_in + i: r for i, r in enumerate(region.ops)}
    qk, pv, sm = spec.qk, spec.pv, spec.softmax
    p = spec.p_cast if spec.p_cast is not None else sm
    scores = ops[sm].operands[0] if sm is not None else ops[pv].operands[0]
    a, b = ops[qk].operands
    q_chain, k_chain = frozenset(region.depends(a)), frozenset(region.depends(b))
    v = ops[pv].operands[1]
    # a computed v is a gather (a paged cache): loaded through the index it computes per tile
    v_chain = frozenset(region.depends(v)) if v >= n_in else frozenset()
    summed = [ops[x].operands[0] for x in spec.row_sums]
    if spec.p_ops:
        p = ops[pv].operands[0]
    members = {qk, pv, sm, p, *spec.score_ops, *spec.lse, *spec.lse_casts, *spec.row_sums, *spec.epilogue,
               *spec.p_ops}
    # the ops cloned into the kernel (not members) run with the role that reads them
    clones = [x for x in ops if x not in members and x not in q_chain | k_chain | v_chain
              and ops[x].op.kind != "const"]
    before = _reads(region, spec.score_ops)
    # values an operand's prologue computes that another role reads too (the sequence of a
    # token, whose block table row its keys are gathered at and whose length its mask reads):
    # the prologue computes them on its operand's tile only, so the role reading them computes
    # them again at its own tile, as it does its clones
    shared = _shared_prologue(region, q_chain | k_chain | v_chain, (qk, pv))
    at_scores = _reads(region, spec.score_ops, {qk})
    at_p = _reads(region, spec.p_ops, {qk, *([] if sm is None else [sm])}) - at_scores
    # what the probabilities' ops compute that the score modification reads too (an index)
    # runs with the scores
    score_ops = tuple(x for x in ops
                      if x in spec.score_ops or (x in clones or x in spec.p_ops) and x in before
                      or x in shared and x in at_scores)
    after_p = _reads(region, spec.p_ops) - before
    p_ops = tuple(x for x in ops if x in after_p and (x in spec.p_ops or x in clones)
                  or x in shared and x in at_p)
    epilogue = tuple(x for x in ops if x in spec.epilogue or x in clones and x not in before | after_p
                     or x in shared and x not in at_scores | at_p)
    transposes = sum(ops[v].op.kind == "transpose" for v in k_chain if v >= n_in)
    if sm is None:
        bound, cond = _vanishing_bound(region, [scores, *summed])
    else:
        bound, cond = _key_bound(region, scores), None
        if bound is not None and summed:  # key blocks past the bound are skipped: nothing summed is lost
            mask, memo = ops[scores].operands[0], {}
            if not all(_vanishes(region, mask, x, False, memo) for x in summed):
                bound = None
    p_out = p if sm is not None and p in region.outputs else None
    return AttentionPlan(qk, pv, sm, scores, q_chain, k_chain, operand_source(region, q_chain),
                         operand_source(region, k_chain), v, transposes % 2 == 1,
                         score_ops, spec.lse, epilogue, bound, spec.p_cast, p_out, spec.lse_casts,
                         row_sums=spec.row_sums, bound_cond=cond, v_chain=v_chain,
                         v_source=operand_source(region, v_chain) if v_chain else None, p_ops=p_ops,
                         kv_split=p_out is None)


def _shared_prologue(region: Region, chains: frozenset[int], dots: tuple[int, int]) -> set[int]:
    """The ops of the operands' prologues (`chains`) that an op outside them other than the
    two dots reads, with the prologue ops they are computed from."""
    n_in = len(region.inputs)
    read = {o for k, r in enumerate(region.ops) if n_in + k not in chains and n_in + k not in dots
            for o in r.operands if o in chains and o >= n_in}
    found = set().union(*(region.depends(o) for o in read))
    return {x for x in found if x >= n_in and region.ops[x - n_in].op.kind != "const"}


def _reads(region: Region, roots: Iterable[int], stop: Collection[int] = ()) -> set[int]:
    """The values `roots` are computed from (themselves included) without going through the
    values `stop` (q @ k.T: its operands are loaded tiles, not values of the score tile)."""
    n_in = len(region.inputs)

    def operands(v: int) -> list[int]:
        return [o for o in region.ops[v - n_in].operands if o not in stop] if v >= n_in else []

    return set(walk((v for v in roots if v not in stop), operands))


def attention_backward_plan(region: Region, spec: AttentionBackwardSpec) -> AttentionBackwardPlan:
    """The plan of one kernel of an attention backward from the roles fuse-attention-backward
    gave (`AttentionBackwardSpec`), with what the region's dataflow says about them: the
    tensor each loaded operand of a score dot or product is read from and its prologue, which
    operand of a product is the score-space value (`x.T @ y` through a transpose of x,
    `y.T @ x` or, summing over the keys, `x @ y`), the axes the sums after a product or of a
    score-space value run over, the score ops and epilogue, and the mask's key bound."""
    n_in = len(region.inputs)
    ops = {n_in + i: r for i, r in enumerate(region.ops)}
    prologues: set[int] = set()

    def loaded(v: int) -> int | None:
        """The input `v` is loaded from: itself, or what a prologue on it reads (elementwise
        ops of one same-shape tensor and scalars), whose ops join `prologues`; None for a
        computed value."""
        src = v
        while src >= n_in:
            r = ops[src]
            tensors = [o for o in r.operands if region.value_type(o).rank > 0]
            if not ops_module.is_elementwise(r.op.kind) or len(tensors) != 1 \
                    or region.value_type(tensors[0]).shape != r.op.shape:
                return None
            src = tensors[0]
        prologues.update(p for p in region.depends(v) if p >= n_in and region.value_type(p).rank > 0)
        return src

    dots = []
    for d in sorted(spec.dots):
        a, b = ops[d].operands
        a_source, b_source = loaded(a), loaded(b)
        assert a_source is not None and b_source is not None, "a score dot's operands are loaded"
        dots.append(ScoreDot(d, a, b, a_source, b_source))
    products, batch_sums, walked = [], [], ()
    for p in sorted(spec.products, key=lambda p: p.matmul):
        a, b = ops[p.matmul].operands
        y_first = b == p.x and p.view is None  # y.T @ x (y read transposed in place)
        y = a if y_first else b
        x, scale = _scaled_operand(region, p.x, p.view or p.matmul)
        product = ScoreProduct(p.matmul, x, y, y_first, y_source=loaded(y), scale=scale,
                               scaled=None if scale is None else p.x)
        if p.batch_sums:
            axes, dims = reduction_axes(ops[p.matmul].op.shape, [ops[v].op for v in p.batch_sums])
            walked = tuple(sorted(axes))
            product = dataclasses.replace(product, batch=dims[:-2])
        products.append(product)
        batch_sums += p.batch_sums
    outputs = {v: j for j, v in reversed(list(enumerate(region.outputs)))}
    reductions = []
    for x, *chain in sorted(spec.reductions, key=lambda r: outputs[r[-1]]):
        axes = reduction_axes(region.value_type(x).shape, [ops[v].op for v in chain])
        assert axes is not None, "fuse-attention-backward checked the chain"
        reductions.append(ScoreReduction(x, tuple(chain), *axes))
    stores = tuple(sorted(spec.stores, key=outputs.__getitem__))
    sums = {s for r in reductions for s in r.sums} | set(batch_sums)
    xs = [p.x for p in products] + [r.x for r in reductions]
    before = set().union(*(region.depends(v) for v in xs + list(stores)))
    matmuls = {d.matmul for d in dots} | {p.matmul for p in products}
    views = {p.view for p in spec.products if p.view is not None} | {p.scaled for p in products if p.scaled}
    score_ops = tuple(v for v in ops if v in before and v not in matmuls | prologues
                      and ops[v].op.kind != "const")
    epilogue = tuple(v for v in ops if v not in before and v not in matmuls | views | sums | prologues
                     and ops[v].op.kind != "const")
    bound, cond = _vanishing_bound(region, xs + list(stores))
    return AttentionBackwardPlan(spec.over, tuple(dots), score_ops, tuple(products), epilogue, stores, bound,
                                 tuple(reductions), tuple(sorted(prologues)), walked,
                                 tuple(sorted(batch_sums)), cond)


def _scaled_operand(region: Region, x: int, reader: int) -> tuple[int, int | None]:
    """A product's score-space operand `x` as (tile, scalar) when it is a tile times a scalar
    (dK's dS * scale) that only the product reads: the product multiplies the accumulated
    sum by the scalar once, not every score (FlashAttention-2's dK *= scale); else (x, None)."""
    n_in = len(region.inputs)
    if x < n_in or x in region.outputs:
        return x, None
    rop = region.ops[x - n_in]
    readers = [n_in + k for k, r in enumerate(region.ops) if x in r.operands]
    if rop.op.kind != "mul" or readers != [reader] or not rop.op.dtype.is_float:
        return x, None
    scalars = [o for o in rop.operands if region.value_type(o).rank == 0]
    tiles = [o for o in rop.operands if region.value_type(o).shape == rop.op.shape]
    if len(scalars) != 1 or len(tiles) != 1 or not region.value_type(scalars[0]).dtype.is_float:
        return x, None
    return tiles[0], scalars[0]


def reduction_axes(shape, chain: list[Op]) -> tuple[frozenset[int], tuple[int | None, ...]] | None:
    """The axes of a value of `shape` that a chain of `sum`s and `reshape`s merging two
    adjacent axes (and maybe adding a size-1 dim after them: canonicalize's merge of two
    sums keeping their dims) sums over, and for each dim of the result the axis it keeps
    (None: a kept size-1 dim); None when a result dim would merge two axes (an index the
    kernels do not compute)."""
    dims: list[tuple[int, ...]] = [(a,) for a in range(len(shape))]
    sizes = list(shape)
    axes: set[int] = set()
    for op in chain:
        if op.kind == "reshape":
            merge = next(((k, unit) for k in range(len(sizes) - 1) for unit in ((), (1,))
                          if tuple(op.shape) == (*sizes[:k], (Lin.of(sizes[k]) * Lin.of(sizes[k + 1])).dim(),
                                                 *unit, *sizes[k + 2:])), None)
            if merge is None:
                return None
            lo, unit = merge
            dims[lo:lo + 2] = [dims[lo] + dims[lo + 1]] + [()] * len(unit)
        else:
            axis = op.attr("axis") % len(dims)
            axes.update(dims[axis])
            if op.attr("keepdims"):
                dims[axis] = ()
            else:
                del dims[axis]
        sizes = list(op.shape)
    if any(len(d) > 1 for d in dims):
        return None
    return frozenset(axes), tuple(d[0] if d else None for d in dims)


def _vanishing_bound(region: Region, values: list[int]) -> tuple[KeyBound | None, int | None]:
    """A mask's key bound outside which every one of `values` is 0, found from the masks
    the score ops apply (`where(cond, s, -inf)`, `where(cond, ds, 0)`): the probabilities
    `exp(z - lse)` of masked scores are 0, and so is anything they multiply. Blocks past the
    bound add nothing, and the kernel skips them (a stored value's skipped tiles are left
    at 0: its output is zero-filled, `plans.zero_filled`). With the condition whose
    `where`s apply it."""
    rank = len(region.value_type(values[0]).shape)
    conds = dict.fromkeys(r.operands[0] for r in region.ops if r.op.kind == "where")
    for cond in conds:
        bound = _cond_bound(region, cond, rank)
        memo: dict[tuple[int, bool], bool] = {}
        if bound is not None and all(_vanishes(region, cond, v, False, memo) for v in values):
            return bound, cond
    return None, None


def _vanishes(region: Region, cond: int, v: int, neg_inf: bool, memo: dict) -> bool:
    """Is v 0 (or -inf, `neg_inf`) wherever `cond` is false?"""
    n_in = len(region.inputs)
    if v < n_in:
        return False
    if (v, neg_inf) not in memo:
        r = region.ops[v - n_in]
        kind, args = r.op.kind, r.operands

        def zero(a: int, inf: bool = False) -> bool:
            return _vanishes(region, cond, a, inf, memo)

        if kind == "where":  # where cond is false, the third operand (or both, another cond)
            found = (args[0] == cond and _const(region, args[2]) == (-math.inf if neg_inf else 0.0)) \
                or (zero(args[2], neg_inf) and (args[0] == cond or zero(args[1], neg_inf)))
        elif kind == "cast":
            found = zero(args[0], neg_inf)
        elif neg_inf:
            found = _keeps_neg_inf(region, kind, args, lambda a: zero(a, True))
        elif kind in ("neg", "div"):
            found = zero(args[0])
        elif kind == "mul":
            found = zero(args[0]) or zero(args[1])
        else:
            found = kind == "exp" and zero(args[0], True)
        memo[v, neg_inf] = found
    return memo[v, neg_inf]


def _keeps_neg_inf(region: Region, kind: str, args, neg_inf) -> bool:
    """Does an op keep -inf where `neg_inf(arg)` says its operand is: -inf minus or plus a
    row value (the logsumexp, one per query row: finite, or the row is NaN anyway), -inf
    times a positive constant?"""
    def row_value(v: int) -> bool:
        return region.value_type(v).shape[-1:] in ((), (1,))

    if kind == "sub":
        return neg_inf(args[0]) and row_value(args[1])
    if kind == "add":
        return any(neg_inf(a) and row_value(b) for a, b in (args, args[::-1]))
    if kind == "mul":
        c = _const(region, args[1])
        return c is not None and c > 0 and neg_inf(args[0])
    return False


def operand_source(region: Region, chain: frozenset[int]) -> int:
    """The one tensor input a dot operand is loaded from (its prologue adds only scalars and,
    for a GEMM's A, vectors along K or its rows: [1, ..., 1, K], [..., M, 1]); for a gathered
    operand, the tensor it gathers from (the first, for a GEMM's B gathered from several: a packed weight, its
    scales and zero points)."""
    n_in = len(region.inputs)
    takes = sorted(v for v in chain if v >= n_in and region.ops[v - n_in].op.kind == "take")
    indices = set().union(*(region.depends(o) for t in takes for o in region.ops[t - n_in].operands[1:]))
    tensors = [region.ops[t - n_in].operands[0] for t in takes if t not in indices]
    if len(set(tensors)) > 1:
        return tensors[0]
    if not tensors:
        tensors = [v for v in chain if v < n_in and not region.inputs[v].scalar
                   and region.inputs[v].type.rank > 0]
    if len(tensors) > 1:  # not the vectors along K ([1, K]) or along A's rows ([M, 1])
        tensors = [v for v in tensors if len(shape := region.inputs[v].type.shape) >= 2
                   and shape[-1] != 1 and shape[-2] != 1]
    assert len(tensors) == 1, "a dot operand is computed from one tensor"
    return tensors[0]


def _key_bound(region: Region, scores: int) -> KeyBound | None:
    """The bound of a mask applied last: `softmax(where(cond, s, -inf))`."""
    n_in = len(region.inputs)
    if scores < n_in or region.ops[scores - n_in].op.kind != "where":
        return None
    cond, _, masked = region.ops[scores - n_in].operands
    if _const(region, masked) != -math.inf:
        return None
    return _cond_bound(region, cond, len(region.value_type(scores).shape))


def _cond_bound(region: Region, cond: int, rank: int) -> KeyBound | None:
    """The upper key bound of a mask condition (with a lower one when a conjunct gives one);
    exact when the condition is nothing but those comparisons."""
    upper, lower, exact = None, None, True
    upper_sums: tuple[IndexSum, ...] = ()
    lower_sums: tuple[IndexSum, ...] = ()
    for c in _conjuncts(region, cond):
        found, sums = _comparison_bound(region, c, rank) or (None, ())
        if isinstance(found, KeyBound) and upper is None:
            upper, upper_sums = found, sums
        elif isinstance(found, LowerBound) and lower is None:
            lower, lower_sums = found, sums
        else:  # not a bound, or a second one of its kind: this conjunct stays a mask
            exact = False
    if upper is None:
        return None
    checks = upper_sums + lower_sums
    return dataclasses.replace(upper, exact=exact, lower=lower, checks=checks)


def _conjuncts(region: Region, cond: int) -> list[int]:
    n_in = len(region.inputs)
    if cond >= n_in and region.ops[cond - n_in].op.kind == "and":
        return [c for o in region.ops[cond - n_in].operands for c in _conjuncts(region, o)]
    return [cond]


def _comparison_bound(region: Region, cond: int, rank: int
                      ) -> tuple[KeyBound | LowerBound, tuple[IndexSum, ...]] | None:
    """A comparison of linear forms in the query index i and key index j (`i + a >= j + b`,
    `i - j < w`, `j > i - w`, ...) whose difference is `i - j + c` (an upper bound on key j)
    or `j - i + c` (a lower one). The comparison and the sums it compares are i32 (torch's
    types: an index with a literal or a 0-d scalar of any integer type stays i32), so each
    scalar is taken as i32, and the sums that could wrap come with the bound (for
    `KeyBound.checks`); a comparison in another type (a float, an i64 tensor) gives no
    bound."""
    n_in = len(region.inputs)
    if cond < n_in:
        return None
    rop = region.ops[cond - n_in]
    if rop.op.kind not in ("ge", "gt", "le", "lt") \
            or result_dtype([region.value_type(o) for o in rop.operands]) is not DType.I32:
        return None
    sums: list[IndexSum] = []
    lhs, rhs = (_linear(region, v, rank, sums) for v in rop.operands)
    if lhs is None or rhs is None:
        return None
    if rop.op.kind in ("le", "lt"):
        lhs, rhs = rhs, lhs
    strict = rop.op.kind in ("gt", "lt")
    # lhs - rhs >= 0 (> 0 when strict): exact, both sides being the i32 values the mask compares
    axes, terms, const = _combine(lhs, rhs, -1)
    i, j = rank - 2, rank - 1
    if axes == {i: 1, j: -1}:  # j <= i + terms + const
        return KeyBound(terms, const, strict), tuple(sums)
    if axes == {i: -1, j: 1}:  # j >= i - terms - const (+1 when strict)
        return LowerBound(tuple((-s, v) for s, v in terms), -const + strict), tuple(sums)
    return None


Linear = tuple[dict[int, int], tuple[tuple[int, int], ...], int]
I32_MIN, I32_MAX = DType.I32.int_range
# the largest index: a dim of an i32 index has at most 2^31 - 1 positions
INDEX_MAX = I32_MAX - 1


def _linear(region: Region, value: int, rank: int, sums: list[IndexSum]) -> Linear | None:
    """`sum(coefficient * index(axis)) + sum(sign * scalar) + constant` as (coefficients by
    axis, scalar terms, constant), or None. Integer scalars known for the whole kernel are
    terms; the template computes them before the key loop. An i32 sum of an index that some
    sizes or scalars could carry past i32 (`i + 1`, `i + w`) joins `sums`, to be checked
    at the call; a sum in another type, or of an index along another axis, gives None."""
    n_in = len(region.inputs)
    if _is_scalar(region, value):
        c = _const(region, value)
        if c is None:
            return {}, ((1, value),), 0
        # an integer literal in i32 arithmetic is its value wrapped into i32, as torch takes it
        return ({}, (), _wrap_i32(int(c))) if float(c).is_integer() else None
    if value < n_in:
        return None
    rop = region.ops[value - n_in]
    op: Op = rop.op
    if op.kind == "index":
        axis = op.attr("axis") % len(op.shape)
        if op.shape[axis] == 1:  # along a size-1 axis the index is 0
            return {}, (), 0
        return {axis + rank - len(op.shape): 1}, (), 0
    if op.kind not in ("neg", "add", "sub") or op.dtype is not DType.I32:
        return None
    if op.kind == "neg":
        inner = _linear(region, rop.operands[0], rank, sums)
        found = None if inner is None else _combine(({}, (), 0), inner, -1)
    else:
        x, y = (_linear(region, o, rank, sums) for o in rop.operands)
        found = None if x is None or y is None else _combine(x, y, -1 if op.kind == "sub" else 1)
    if found is None or not set(found[0]) <= {rank - 2, rank - 1}:
        return None
    axes, terms, const = found
    i, j = axes.get(rank - 2, 0), axes.get(rank - 1, 0)
    # the sum's extremes over every index and every i32 value of its scalars
    lowest = (min(0, i) + min(0, j)) * INDEX_MAX + sum(I32_MIN if s > 0 else -I32_MAX for s, _ in terms)
    highest = (max(0, i) + max(0, j)) * INDEX_MAX + sum(I32_MAX if s > 0 else -I32_MIN for s, _ in terms)
    if lowest + const < I32_MIN or highest + const > I32_MAX:
        sums.append(IndexSum(i, j, terms, const))
    return found


def _wrap_i32(c: int) -> int:
    return (c - I32_MIN) % 2**32 + I32_MIN


def _combine(x: Linear, y: Linear, sign: int) -> Linear:
    """x + sign * y."""
    axes = dict(x[0])
    for axis, c in y[0].items():
        axes[axis] = axes.get(axis, 0) + sign * c
    return ({a: c for a, c in axes.items() if c}, x[1] + tuple((sign * s, v) for s, v in y[1]),
            x[2] + sign * y[2])


def _const(region: Region, value: int):
    n_in = len(region.inputs)
    if value < n_in:
        return None
    op = region.ops[value - n_in].op
    return op.attr("value") if op.kind == "const" else None


def _is_scalar(region: Region, value: int) -> bool:
    """An integer value known for the whole kernel: computed from literals and scalars
    passed by value only (the template computes it before the key loop)."""
    t = region.value_type(value)
    if t.rank != 0 or t.dtype.is_float:
        return False
    n_in = len(region.inputs)
    return all(region.inputs[v].scalar if v < n_in else region.value_type(v).rank == 0
               for v in region.depends(value))
