"""Kernel plans: what a fusion pass decided about a kernel, carried by its `KernelOp`.

A pass that forms a kernel knows things about it that its region alone does
not say: which values play which role, how every value maps onto the kernel's
iteration space. It records them once, in a frozen plan; the verifier checks
the plan against the region (`verify`), the printer shows it (`format`),
`explain()` reads it, and the code templates consume it without analysing the
region again. Value ids are the region's (inputs first, then ops).

Each plan class is the registry entry of one code template: it names the
template (`template`), says what the template is in its docstring's first line,
whether the template stores every output through its strides (`strided_stores`),
and carries its printed form and its verifier check. `TEMPLATES` maps the
template names to them; planners (`passes/fusion/planning.py`) and emitters
(`backends/triton/program.py`) are keyed by plan class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, get_args

from tiledsl import ops
from tiledsl.types import DType, Shape, format_shape

if TYPE_CHECKING:
    from tiledsl.ir import Op, Region
    from tiledsl.verifier import PlanCheck

Name = Callable[[int], str]  # a value's printed name (%a0, %r3)

# Per dim of a value: the row-space dim it is read along, or None (size 1 or broadcast).
Layout = tuple[int | None, ...]


@dataclass(frozen=True, slots=True)
class PointwisePlan:
    """An elementwise region over one iteration space (the outputs' shape)."""

    template: ClassVar[str] = "pointwise"
    strided_stores: ClassVar[bool] = False  # it stores at a flat index

    shape: Shape

    def format(self, name: Name) -> str:
        return f"plan pointwise {{space = {format_shape(self.shape)}}}"

    def verify(self, check: PlanCheck) -> None:
        if any(t.shape != self.shape for t in check.region.output_types):
            check.fail("an output does not have the plan's shape")


@dataclass(frozen=True, slots=True)
class ScatterPlan:
    """Values written or added at indices (`put`): each program computes a block of the
    written values over their space, elementwise ops before them included, and stores or
    atomically adds each at its indices into a result that starts at 0, or as a copy of the
    input `starts` names (a `put_into`'s x, copied by the launch before the programs run)."""

    template: ClassVar[str] = "indexed"
    strided_stores: ClassVar[bool] = False  # it stores at the indices, into contiguous results

    shape: Shape  # the space: the written values' shape
    puts: tuple[int, ...]  # the `put` and `put_into` ops, the region's outputs in order
    starts: tuple[int | None, ...] = ()  # per put: the region input its result starts as, or None: 0
    # (put_into, put of the kernel it adds onto): one buffer, the output's (the gradients of
    # two gathers of one weight)
    into: tuple[tuple[int, int], ...] = ()
    # per put: its start is another kernel's result that nothing else reads, which it writes
    # in place instead of copying (lower-kernels decides; empty: none)
    in_place: tuple[bool, ...] = ()

    def format(self, name: Name) -> str:
        starts = "".join(f", {name(p)} starts as {name(i)}"
                         for p, i in zip(self.puts, self.starts, strict=True) if i is not None)
        puts = _names(self.puts, name)
        into = "".join(f", {name(v)} adds onto {name(b)}" for v, b in self.into)
        into += "".join(f", {name(p)} in place" for p, inplace in zip(self.puts, self.in_place, strict=False)
                        if inplace)
        return f"plan indexed {{space = {format_shape(self.shape)}, puts = {puts}{starts}{into}}}"

    def buffers(self) -> dict[int, int]:
        """Each put of the kernel (outputs and those `into` chains) by the output whose buffer
        it writes or adds into."""
        onto = dict(self.into)
        out = {}
        for v in self.puts:
            out[v] = v
            w = v
            while w in onto:
                w = onto[w]
                out[w] = v
        return out

    def verify(self, check: PlanCheck) -> None:
        if tuple(check.region.outputs) != self.puts:
            check.fail("its indexed plan's puts are not its outputs")
        if len(self.starts) != len(self.puts):
            check.fail("its indexed plan has not one start per put")
        pairs = zip(self.in_place, self.starts, strict=False)
        if self.in_place and (len(self.in_place) != len(self.puts)
                              or any(inplace and start is None for inplace, start in pairs)):
            check.fail("its indexed plan writes in place a put that starts at 0")
        onto = dict(self.into)
        for v, start in zip(self.puts, self.starts, strict=True):
            check.expect(v, tuple(ops.WRITTEN), "put")
            kind = check.kind(v)
            operands = check.operands(v)
            if check.region.value_type(operands[ops.WRITTEN[kind]]).shape != self.shape:
                check.fail("a put of its indexed plan writes values outside the plan's space")
            root = v
            while root in onto:
                root = onto[root]
            if check.kind(root) not in ops.WRITTEN:
                check.fail("a put of its indexed plan adds onto a value that is not a put")
            if start != (check.operands(root)[0] if check.kind(root) == "put_into" else None):
                check.fail("a put of its indexed plan does not start as its chain's x (a put_into's) or 0")
            if start is not None and start >= len(check.region.inputs):
                check.fail("a put_into of its indexed plan starts as a value its kernel computes")
        for v, base in self.into:
            if check.kind(v) != "put_into" or check.operands(v)[0] != base:
                check.fail("an `into` pair of its indexed plan is not a put_into and the put it adds onto")
        n_in = len(check.region.inputs)
        written = {n_in + k for k, r in enumerate(check.region.ops) if r.op.kind in ops.WRITTEN}
        if written != set(self.buffers()):
            check.fail("its indexed plan leaves a put with no buffer")


# the most elements of a row a topk or sort keeps in registers (one tile of i64 keys, sorted
# there: 32k words, as a scan's partials); a larger k sorts the row through memory
SELECT_LIMIT = 1 << 14


def may_be_long(select: Op) -> bool:
    """May the selection `select` (a topk or sort) keep more than `SELECT_LIMIT` elements (k
    not a literal up to it)? A call whose does sorts its rows in a workspace in memory."""
    k = select.shape[select.attr("axis")]
    return not isinstance(k, int) or k > SELECT_LIMIT


def sorts_whole_row(region: Region, v: int) -> bool:
    """Is the selection `v` of `region` a sort of its whole row (k the row's length): its
    values a permutation of the row, whose softmax statistics they share?"""
    rop = region.ops[v - len(region.inputs)]
    axis = rop.op.attr("axis")
    return rop.op.attr("k") == region.value_type(rop.operands[0]).shape[axis]


@dataclass(frozen=True, slots=True)
class RowPlan:
    """Reductions along the `axes` of the space `shape`, with the elementwise ops around them.

    A row is the elements along `axes` (one axis, or several: a reduction over several
    axes, adjacent or not; batch norm's 0, 2 and 3 of NCHW), the other dims index rows.
    `layouts[v]`: how value v maps onto the space (None: an input no op reads).
    `reducing`: the reductions and softmaxes that really reduce (their operand
    varies along the axes; one over a size-1 axis is elementwise).
    `partial`: reductions over some of the axes whose rest the reductions reading them
    reduce (sema writes a reduction over several axes one axis at a time): never computed.
    `sources`: (v, the value v reduces) for every reducing v: its operand, or the first
    operand of the partial reductions before it.
    `phases[v]`: how many dependent reductions v needs (layernorm's output: 2).
    `selected`: the values along the k elements a topk or sort selected from the row (and
    the elementwise ops reading them): per-row tiles of k, not along the row.
    `across`: the kept dim some reductions run along, across the rows (Mamba's sum over its
    state dim after a scan along the sequence, a loss summed over tokens, a weight
    gradient's column sums), and `across_reducing` those reductions; a value that does not
    vary along it is stored by the first of those rows. Along a short dim (a literal size of
    at most 256) a program owns all the rows along it. Otherwise the plan is `split`: each
    program reduces a chunk of the rows into partials, and a combine launch merges them in
    a fixed order and computes the `tail` (the reductions across and the elementwise ops
    computed from them), so the kernel is two launches.
    """

    template: ClassVar[str] = "rows"
    strided_stores: ClassVar[bool] = True

    shape: Shape
    axes: tuple[int, ...]
    layouts: tuple[Layout | None, ...]
    reducing: frozenset[int]
    phases: tuple[int, ...]
    partial: frozenset[int]
    sources: tuple[tuple[int, int], ...]
    selected: frozenset[int] = frozenset()
    across: int | None = None
    across_reducing: frozenset[int] = frozenset()
    split: bool = False
    tail: frozenset[int] = frozenset()

    def long_selections(self, region: Region) -> tuple[int, ...]:
        """The selections whose k may pass `SELECT_LIMIT` (k not a literal up to it): when a
        call's does, the row is sorted through a workspace in memory, not in registers."""
        n_in = len(region.inputs)
        return tuple(v for v in sorted(self.reducing) if ops.category(region.ops[v - n_in].op.kind)
                     is ops.Category.SELECT and may_be_long(region.ops[v - n_in].op))

    def full(self, value: int) -> bool:
        """Does the value vary along the row axes (a selection's values vary along its k)?"""
        layout = self.layouts[value]
        return layout is not None and any(a in layout for a in self.axes) and value not in self.selected

    def source(self, value: int) -> int:
        """The value a reducing value reduces."""
        return dict(self.sources)[value]

    def format(self, name: Name) -> str:
        layouts = ", ".join(f"{name(v)} = {_layout(lay)}" for v, lay in enumerate(self.layouts)
                            if lay is not None)
        axes = f"axis = {self.axes[0]}" if len(self.axes) == 1 else f"axes = {self.axes}"
        partial = f"partial = {_names(self.partial, name)}, " if self.partial else ""
        partial += f"selected = {_names(self.selected, name)}, " if self.selected else ""
        if self.across is not None:
            partial += f"across = {self.across}, across_reducing = {_names(self.across_reducing, name)}, "
        if self.split:
            partial += f"split, tail = {_names(self.tail, name)}, "
        return (f"plan rows {{space = {format_shape(self.shape)}, {axes}, "
                f"phases = {max(self.phases, default=0)}, reducing = {_names(self.reducing, name)}, "
                f"{partial}layouts = ({layouts})}}")

    def verify(self, check: PlanCheck) -> None:
        region = check.region
        n_values = len(region.inputs) + len(region.ops)
        if not (len(self.layouts) == len(self.phases) == n_values and self.axes
                and list(self.axes) == sorted(set(self.axes)) and 0 <= self.axes[0]
                and self.axes[-1] < len(self.shape)):
            check.fail("its row plan does not cover its region")
        for v, layout in enumerate(self.layouts):
            if layout is not None and len(layout) != region.value_type(v).rank:
                check.fail(f"value {v} has a layout of the wrong rank")
        for v in self.reducing:
            check.expect(v, ops.ROW_KINDS, "reduction")
        for v in self.partial:
            check.expect(v, ops.ROW_KINDS, "partial reduction")
            if v in region.outputs:
                check.fail(f"its partial reduction {v} is an output")
        if {v for v, _ in self.sources} != self.reducing:
            check.fail("its row plan does not name the value every reduction reduces")
        if (self.across is None) != (not self.across_reducing) or self.across in self.axes or (
                self.across is not None and not self.split and not isinstance(self.shape[self.across], int)):
            check.fail("its row plan reduces across rows along no kept dim of a literal size")
        for v in self.across_reducing:
            check.expect(v, ops.ROW_KINDS, "reduction across rows")
        if self.split != bool(self.tail) or (self.split and not self.across_reducing <= self.tail):
            check.fail("its split row plan's tail does not hold its reductions across rows")
        n_in = len(region.inputs)
        if any(o in self.tail and n_in + i not in self.tail for i, r in enumerate(region.ops)
               for o in r.operands):
            check.fail("a value of its split row plan's rows reads what the combine launch computes")


@dataclass(frozen=True, slots=True)
class DualB:
    """A further matmul of the same A in a GEMM kernel (a dual GEMM: `x @ w1.T` and
    `x @ w3.T` meeting in one epilogue), with its own B operand and accumulator."""

    matmul: int
    b: int
    b_source: int
    b_prologue: frozenset[int]


@dataclass(frozen=True, slots=True)
class GemmPlan:
    """C = A @ B with operand prologues and an epilogue on the f32 accumulator.

    `a`, `b`: the matmul's operand values; `a_source`, `b_source`: the region
    inputs their tiles are loaded from; `a_prologue`, `b_prologue`: the values
    each operand is computed from (source and scalars included), applied per
    loaded tile; `prologue_only`: prologue ops the epilogue does not read;
    `epilogue`: the ops computed at the output tile, in order; `duals`: further
    matmuls of the same `a` whose products the epilogue also reads; `batch_sums`: the
    sums and means of the product over its batch axes `summed_axes` (a chain, each
    reading the one before, the first the product), taken in the K loop: sum_t A_t @ B_t
    is one longer K loop, the accumulator the last one's value (a mean divided by its
    axis's size); the kernel's output tiles are the last one's, the epilogue after it.
    """

    template: ClassVar[str] = "matmul"
    strided_stores: ClassVar[bool] = True

    matmul: int
    a: int
    b: int
    # the inputs a and b are computed from by a prologue (`q * scale`, a widening cast) on
    # the tiles loaded; a and b themselves when they are inputs
    a_source: int
    b_source: int
    a_source: int
    b_source: int
    a_prologue: frozenset[int]
    b_prologue: frozenset[int]
    prologue_only: frozenset[int]
    epilogue: tuple[int, ...]
    duals: tuple[DualB, ...] = ()  # more matmuls of A, one accumulator each
    # sums and means of A's rows along K, accumulated in the K loop from A's source tiles
    # (through `stat_chain`, the ops they are computed from); the epilogue reads them per row
    row_stats: tuple[int, ...] = ()
    stat_chain: frozenset[int] = frozenset()
    # the product's batch axes the K loop sums over (sorted), and the sum or mean ops that
    # sum them, in order: the epilogue reads the last one
    summed_axes: tuple[int, ...] = ()
    batch_sums: tuple[int, ...] = ()
    # the muls scaling each batch element's product before the first batch sum adds it, in
    # order (DeepSeek-V3's per-block scales: sum_t (A_t @ B_t) * sa_t * sb_t), and every value
    # they compute from at the product's tile (their factors' ops): done inside the batch loop
    batch_scales: tuple[int, ...] = ()
    scale_ops: frozenset[int] = frozenset()
    # a grouped GEMM (a product of one row per batch element, [..., T, 1, N], whose gathered B
    # selects its matrix by an index per row, `w[idx]`): the value of that index in B's
    # prologue; the kernel's rows are T, and it multiplies each index's rows by its matrix
    segment: int | None = None

    @property
    def has_prologue(self) -> bool:
        return self.a != self.a_source or self.b != self.b_source or any(
            d.b != d.b_source for d in self.duals)

    def format(self, name: Name) -> str:
        def operand(value: int, source: int, chain: frozenset[int]) -> str:
            if value == source:
                return name(value)
            return f"{name(value)} (prologue {_names(chain - {source}, name)} on {name(source)})"

        return (f"plan gemm {{matmul = {name(self.matmul)}, "
                f"a = {operand(self.a, self.a_source, self.a_prologue)}, "
                f"b = {operand(self.b, self.b_source, self.b_prologue)}, "
                + "".join(f"dual = {name(d.matmul)} with b = {operand(d.b, d.b_source, d.b_prologue)}, "
                          for d in self.duals)
                + (f"row_stats = {_names(self.row_stats, name)} of {_names(self.stat_chain, name)}, "
                   if self.row_stats else "")
                + (f"batch_sums = {_names(self.batch_sums, name)} over axes "
                   f"({', '.join(map(str, self.summed_axes))}), " if self.batch_sums else "")
                + (f"batch_scales = {_names(self.batch_scales, name)} of {_names(self.scale_ops, name)}, "
                   if self.batch_scales else "")
                + (f"grouped by {name(self.segment)}, " if self.segment is not None else "")
                + f"epilogue = {_names(self.epilogue, name)}}}")

    def verify(self, check: PlanCheck) -> None:
        check.expect(self.matmul, ("matmul",), "matmul")
        if check.operands(self.matmul) != (self.a, self.b):
            check.fail("its plan's operands are not the matmul's")
        for d in self.duals:
            check.expect(d.matmul, ("matmul",), "dual matmul")
            if check.operands(d.matmul) != (self.a, d.b):
                check.fail("a dual matmul does not share the A operand")
        for source, chain in ((self.a_source, self.a_prologue), (self.b_source, self.b_prologue),
                              *((d.b_source, d.b_prologue) for d in self.duals)):
            check.expect(source, (None,), "operand source")
            if source not in chain:
                check.fail("an operand source is outside its prologue")
        for v in self.epilogue:
            check.kind(v)
        self._verify_batch_sums(check)
        if self.segment is not None:
            product = check.region.value_type(self.matmul).shape
            if len(product) < 3 or product[-2] != 1 or self.segment not in self.b_prologue:
                check.fail("a grouped GEMM's rows are not its batch elements, or its B is not selected by "
                           "its index")

    def _verify_batch_sums(self, check: PlanCheck) -> None:
        """The batch sums are a chain of sums or means from the product over distinct batch
        axes, its rows and columns left whole, with no second accumulator or row statistic."""
        if not self.batch_sums and not self.summed_axes:
            return
        rank = check.region.value_type(self.matmul).rank
        if len(self.batch_sums) != len(self.summed_axes) or list(self.summed_axes) != sorted(
                set(self.summed_axes)) or not all(0 <= a < rank - 2 for a in self.summed_axes):
            check.fail(f"its batch sums {self.summed_axes} are not one per distinct batch axis")
        if self.duals or self.row_stats:
            check.fail("a GEMM summing its batch has a second accumulator or row statistics")
        previous = self.matmul
        for v in self.batch_scales:
            check.expect(v, ("mul",), "batch scale")
            if previous not in check.operands(v) or v not in self.scale_ops:
                check.fail("a batch scale does not multiply the product (or the scale before it)")
            previous = v
        for v in self.batch_sums:
            check.expect(v, ("sum", "mean"), "batch sum")
            if check.operands(v) != (previous,):
                check.fail("a batch sum does not read the product (or the batch sum or scale before it)")
            previous = v
        out, product = check.region.value_type(previous).shape, check.region.value_type(self.matmul).shape
        if out[-2:] != product[-2:]:
            check.fail("its batch sums reduce the product's rows or columns")


@dataclass(frozen=True, slots=True)
class IndexSum:
    """`i * i_coefficient + j * j_coefficient + sum(sign * value) + constant`: a sum the
    mask computes in i32 from the query index i, the key index j and integer scalars (each
    value as i32). Where some call's sizes or scalars carry it past i32 it wraps, as torch's
    does, and the mask stops meaning its bound: the kernel keeps the bound only while every
    such sum stays inside i32 for all the call's rows and keys (it walks every key with the
    mask otherwise)."""

    i_coefficient: int
    j_coefficient: int
    offsets: tuple[tuple[int, int], ...]
    constant: int


@dataclass(frozen=True, slots=True)
class KeyBound:
    """A mask `where(i + a >= j + b, s, -inf)` (or >, or the mirrored <=, <) keeps key j
    of query row i only while j <= i + a - b (j < for strict): key blocks past the last
    row's bound are skipped. `offsets` are (sign, value id) terms of a - b, each value
    taken as i32 (as the mask's i32 arithmetic takes it), `strict` subtracts one more; the
    kernel computes the bound where it cannot overflow (in int64 but for small literals).
    `lower`: a second conjunct `j >= i + offsets + constant` (a sliding window's start),
    whose blocks before the first row's start are skipped too. `exact`: the mask's
    condition is these comparisons alone (no other conjunct), so a key block inside the
    bounds for every row needs no mask. `checks`: the sums of the mask's index arithmetic
    (of both bounds) that could wrap in i32; the bound holds at a call only while none does."""

    offsets: tuple[tuple[int, int], ...]
    constant: int
    strict: bool
    exact: bool = False
    lower: LowerBound | None = None
    checks: tuple[IndexSum, ...] = ()


@dataclass(frozen=True, slots=True)
class LowerBound:
    """Row i keeps key j only while j >= i + sum(sign * value) + constant (each value as
    i32); the sums of this comparison that could wrap are among its `KeyBound`'s `checks`."""

    offsets: tuple[tuple[int, int], ...]
    constant: int


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """softmax(score_mod(q @ kt)) @ v with its prologues, logsumexp and epilogue; or, with
    no softmax (`softmax` None), any score function `f(q @ kt) @ v` (linear attention,
    retention, a chunked scan's intra-chunk part), summed over the keys as it is.

    `q_source`, `k_source`, `v_source`: the region inputs the q, k and v tiles are
    loaded from (for a gathered operand, the tensor it gathers from); `v`: the value p @ v
    reads (an input, or a gather computed from `v_chain`); `k_transposed`: the k tensor is [.., N, D] and read
    as K^T.
    """

    template: ClassVar[str] = "attention"
    strided_stores: ClassVar[bool] = True

    qk: int
    pv: int
    softmax: int | None  # None: p @ v multiplies the scores themselves
    scores: int  # the softmax's input, or p itself (after the score modification)
    q_chain: frozenset[int]  # values the left operand of qk is computed from
    k_chain: frozenset[int]
    q_source: int
    k_source: int
    v: int
    k_transposed: bool
    score_ops: tuple[int, ...]  # ops between qk and the softmax, in order
    lse: tuple[int, ...]  # logsumexp of the scores, stored too
    epilogue: tuple[int, ...]  # ops after pv
    bound: KeyBound | None
    # a cast of the probabilities to the dtype of p @ v, which the template's narrowing of
    # P before the second dot performs
    p_cast: int | None = None
    # the probabilities (or their cast) when they are an output too: a second walk over the
    # keys, with the statistics final, stores them normalised
    p_out: int | None = None
    # the scores widened to f32 for a logsumexp (the kernel computes it in f32 anyway)
    lse_casts: tuple[int, ...] = ()
    # sums over the keys of score-space values (a linear attention's normaliser
    # `sum(f(s), -1)`), accumulated beside p @ v; the epilogue reads them per query row
    row_sums: tuple[int, ...] = ()
    # with no softmax: the mask condition `bound` comes from (everything summed is 0 where
    # it is false), true on the blocks inside an exact bound for every row
    bound_cond: int | None = None
    # the values v is computed from when it is gathered (a paged cache, loaded through the
    # index over each tile); empty when v is an input, read through its strides
    v_chain: frozenset[int] = frozenset()
    v_source: int | None = None  # None: `v` itself
    # ops between the softmax and p @ v that are linear in p (dropout's `p * where(rand(p,
    # seed) >= r, 1 / (1 - r), 0)`), with the side values they read: applied to each key
    # block's p after its sum joins the normaliser, so the softmax is normalised by every
    # probability and p @ v multiplies the modified ones
    p_ops: tuple[int, ...] = ()
    # the keys may be split among programs (split-KV, flash-decoding): each walks a range
    # of them and leaves its unnormalised output, running max and sum (and its sums over the
    # keys), which a combine launch merges by their log-sum-exp in range order before the
    # epilogue; the launch builder splits where the (query block, batch) programs alone
    # cannot fill the GPU. False where the plan stores P (normalised by the final statistics
    # in a second walk over every key)
    kv_split: bool = False

    def role(self, value: int) -> str:
        if value in self.q_chain:
            return "q prologue"
        if value in self.k_chain:
            return "k prologue"
        if value in self.v_chain:
            return "v prologue"
        if value in self.score_ops:
            return "score modification" if self.softmax is not None else "score function"
        if value in self.p_ops:
            return "probability modification"
        if value in self.lse or value in self.lse_casts:
            return "logsumexp"
        if value in self.row_sums:
            return "sum over the keys"
        if value in self.epilogue:
            return "epilogue"
        return {self.qk: "q @ k.T", self.softmax: "online softmax", self.p_cast: "online softmax",
                self.pv: "p @ v"}[value]

    def format(self, name: Name) -> str:
        softmax = "none" if self.softmax is None else name(self.softmax)
        return (f"plan attention {{qk = {name(self.qk)}, softmax = {softmax}, "
                f"{'' if self.p_cast is None else f'p_cast = {name(self.p_cast)}, '}"
                f"{'' if self.softmax is not None else f'p = {name(self.scores)}, '}"
                f"pv = {name(self.pv)}, q = {name(self.q_source)}, "
                f"k = {name(self.k_source)}{' (transposed)' if self.k_transposed else ''}, "
                f"v = {name(self.v if self.v_source is None else self.v_source)}, "
                f"score_mod = {_names(self.score_ops, name)}, "
                f"{f'p_mod = {_names(self.p_ops, name)}, ' if self.p_ops else ''}"
                f"lse = {_names(self.lse, name)}, epilogue = {_names(self.epilogue, name)}, "
                f"{'split = keys, ' if self.kv_split else ''}key_bound = {_bound(self.bound, name)}"
                + ("" if self.p_out is None else f", stores_p = {name(self.p_out)}")
                + (f", row_sums = {_names(self.row_sums, name)}" if self.row_sums else "") + "}")

    def verify(self, check: PlanCheck) -> None:
        check.expect(self.qk, ("matmul",), "q @ k.T")
        check.expect(self.pv, ("matmul",), "p @ v")
        if self.softmax is None:  # p @ v multiplies the scores themselves
            if check.operands(self.pv) != (self.scores, self.v):
                check.fail("its attention plan does not match p @ v")
            cond = self.bound_cond
            if cond is not None and check.region.value_type(cond).dtype is not DType.BOOL:
                check.fail("its attention plan's mask condition is not a bool")
        else:
            check.expect(self.softmax, ("softmax",), "softmax")
            p = self.softmax if self.p_cast is None else self.p_cast
            if self.p_ops:  # p @ v reads the last of them
                p = check.operands(self.pv)[0]
                if p not in self.p_ops:
                    check.fail("its attention plan's p @ v does not read the modified probabilities")
            if self.p_cast is not None:
                check.expect(self.p_cast, ("cast",), "the cast of p")
                if check.operands(self.p_cast) != (self.softmax,):
                    check.fail("its attention plan's cast of p does not read the softmax")
            if check.operands(self.pv) != (p, self.v) or check.operands(self.softmax) != (self.scores,):
                check.fail("its attention plan does not match p @ v")
        for v in self.row_sums:
            check.expect(v, ("sum",), "sum over the keys")
        for v in (self.q_source, self.k_source, self.v if self.v_source is None else self.v_source):
            check.expect(v, (None,), "q, k or v")
        for v in (*self.score_ops, *self.p_ops, *self.lse, *self.epilogue):
            check.kind(v)
        # the score tile has q @ k.T, the inputs and what the score ops compute: a value of an
        # operand's prologue exists on its operand's tile only
        at_tile = {self.qk, *self.score_ops}
        for v in self.score_ops:
            for o in check.operands(v):
                if o not in at_tile and check.kind(o) not in (None, "const"):
                    check.fail(f"its score op {v} reads {o}, which the score tile does not compute")
        for v in self.lse_casts:
            check.expect(v, ("cast",), "widening of the scores")


@dataclass(frozen=True, slots=True)
class ScoreDot:
    """A matmul of the score tile, `a @ b`: a [.., M, K] and b [.., K, N] are region inputs
    (views read through their strides) or computed from one by a prologue, loaded whole
    along K."""

    matmul: int
    a: int
    b: int
    # the inputs a and b are computed from by a prologue (`q * scale`, a widening cast) on
    # the tiles loaded; a and b themselves when they are inputs
    a_source: int
    b_source: int


@dataclass(frozen=True, slots=True)
class ScoreProduct:
    """A product of a score-space value `x` [.., M, N] with a region input `y`, summed over
    the kernel's loop: `x.T @ y` (y [.., M, P]; `y_first`: `y.T @ x`, y [.., P, M], the
    result [.., P, N]) over the queries, `x @ y` (y [.., N, P]) over the keys."""

    matmul: int
    x: int
    y: int
    y_first: bool
    # the batch dims of what the kernel stores, each the score batch axis it indexes (None:
    # a kept size-1 dim), when the walk sums the product over batch axes (`walked`)
    batch: tuple[int | None, ...] | None = None
    y_source: int | None = None  # the input y's prologue reads; None: y is an input
    # the product of `scaled` = x * scale (a scalar), which it reads: the walk sums x's
    # products and multiplies the sum by the scalar once
    scale: int | None = None
    scaled: int | None = None


@dataclass(frozen=True, slots=True)
class ScoreReduction:
    """A score-space value `x` summed over some of the score axes by the chain of `sum` ops
    (and reshapes merging their axes) `sums` (a broadcast bias's gradient; the last is the
    kernel's output, f32). `dims`: for each dim of the result, the score axis it indexes,
    or None (a kept size-1 dim). Each program sums its tiles and adds them to the result
    atomically: the output starts at 0."""

    x: int
    sums: tuple[int, ...]
    axes: frozenset[int]  # the score axes summed over
    dims: tuple[int | None, ...]

    @property
    def result(self) -> int:
        return self.sums[-1]


@dataclass(frozen=True, slots=True)
class AttentionBackwardPlan:
    """One of FlashAttention-2's backward kernels. `over`: "queries", one program per key
    block walking the query blocks (dk, dv), or "keys", one program per query block walking
    the key blocks (dq). Per step it recomputes the score tiles of `dots`, runs `score_ops`
    (elementwise, in order) and adds each product's step to its accumulator; `epilogue` runs
    on the finished accumulators."""

    template: ClassVar[str] = "attention_backward"
    strided_stores: ClassVar[bool] = True

    over: str
    dots: tuple[ScoreDot, ...]
    score_ops: tuple[int, ...]
    products: tuple[ScoreProduct, ...]
    epilogue: tuple[int, ...]
    stores: tuple[int, ...] = ()  # score-space values stored per tile (a bias gradient)
    # a mask bound outside which every value the kernel sums, stores or reduces is zero:
    # the walk skips the blocks past it (as the forward does)
    bound: KeyBound | None = None
    reductions: tuple[ScoreReduction, ...] = ()
    # the ops that compute dot and product operands from the inputs, on the tiles loaded
    prologues: tuple[int, ...] = ()
    # batch axes of the scores the kernel walks too, its products summed over them by
    # `batch_sums` (GQA's dk, dv: over the query heads sharing a key/value head)
    walked: tuple[int, ...] = ()
    batch_sums: tuple[int, ...] = ()
    # the mask condition `bound` comes from: true on the blocks inside an exact bound for
    # every row, whose steps skip its `where`s
    bound_cond: int | None = None

    def role(self, value: int) -> str:
        if value in self.stores:
            return "stored per tile"
        if value in self.prologues:
            return "operand prologues"
        if value in self.batch_sums:
            return "summed over the walked heads"
        if any(value in r.sums for r in self.reductions):
            return "reduced by atomic adds"
        if value in self.score_ops:
            return "score ops"
        if value in self.epilogue:
            return "epilogue"
        if any(p.scaled == value for p in self.products):
            return "scaled once after the walk"
        if any(d.matmul == value for d in self.dots):
            return "score dots"
        return f"summed over the {self.over}"

    def format(self, name: Name) -> str:
        def scaled(product: str, p: ScoreProduct) -> str:
            return product if p.scale is None else f"({product}) * {name(p.scale)}"

        products = ", ".join(
            f"{name(p.matmul)} = " + scaled(f"{name(p.y)}.T @ {name(p.x)}" if p.y_first else
                                            f"{name(p.x)}.T @ {name(p.y)}" if self.over == "queries" else
                                            f"{name(p.x)} @ {name(p.y)}", p) for p in self.products)
        dots = ", ".join(f"{name(d.matmul)} = {name(d.a)} @ {name(d.b)}" for d in self.dots)
        return (f"plan attention_backward {{over = {self.over}, dots = ({dots}), "
                f"score_ops = {_names(self.score_ops, name)}, products = ({products}), "
                f"epilogue = {_names(self.epilogue, name)}"
                + (f", stores = {_names(self.stores, name)}" if self.stores else "")
                + "".join(f", reduce {name(r.x)} over {tuple(sorted(r.axes))} = {name(r.result)}"
                          for r in self.reductions)
                + (f", walks batch axes {self.walked}" if self.walked else "")
                + (f", key_bound = {_bound(self.bound, name)}" if self.bound else "") + "}")

    def verify(self, check: PlanCheck) -> None:
        for d in self.dots:
            check.expect(d.matmul, ("matmul",), "score dot")
            check.expect(d.a_source, (None,), "score dot operand")
            check.expect(d.b_source, (None,), "score dot operand")
        for p in self.products:
            check.expect(p.matmul, ("matmul",), "product")
            check.expect(p.y if p.y_source is None else p.y_source, (None,), "product operand")
        if not self.products or self.over not in ("queries", "keys"):
            check.fail("its attention backward plan has no product")
        for v in (*self.score_ops, *self.epilogue):
            check.kind(v)
        for v in self.prologues:
            check.kind(v)
        for r in self.reductions:
            for v in r.sums:
                check.expect(v, ("sum", "reshape"), "reduction chain")
            check.expect(r.result, ("sum",), "reduction")
            region = check.region
            if r.result not in region.outputs or region.value_type(r.result).dtype is not DType.F32:
                check.fail(f"its reduction {r.result} is not an f32 output the programs add into")


@dataclass(frozen=True, slots=True)
class Member:
    """One program of a merged launch: its plan over its own part of the region
    (`Region.part(inputs, values, outputs)`, whose value ids the plan's are)."""

    inputs: tuple[int, ...]  # the region inputs it reads, in its own order
    values: tuple[int, ...]  # the region ops it computes, in order
    outputs: tuple[int, ...]  # the positions of its results among the region's outputs
    plan: PointwisePlan | RowPlan


@dataclass(frozen=True, slots=True)
class MergedPlan:
    """Pointwise and row programs over different iteration spaces in one launch: its
    programs are partitioned in member order (ids [0, n1) run the first member over its
    space, [n1, n1 + n2) the second...), each member keeping its own plan and layout.

    Split row members leave partials in their own workspaces; their combines follow as
    launches of their own, in member order. So a split member's tail (what its combine
    computes) may read an earlier member's result, which the merged kernel stores: a global
    norm over several tensors, whose last sum of squares adds the others' in its combine.
    Nothing else reads another member's result: the partitioned programs run at once."""

    template: ClassVar[str] = "merged"
    strided_stores: ClassVar[bool] = False  # a pointwise member stores at a flat index

    members: tuple[Member, ...]

    def format(self, name: Name) -> str:
        def member(m: Member) -> str:
            ids = (*m.inputs, *m.values)
            return m.plan.format(lambda v: name(ids[v]))

        return f"plan merged {{programs in order: {'; '.join(member(m) for m in self.members)}}}"

    def verify(self, check: PlanCheck) -> None:
        region = check.region
        n_in = len(region.inputs)
        values = sorted(v for m in self.members for v in m.values)
        outputs = sorted(j for m in self.members for j in m.outputs)
        if len(self.members) < 2 or values != list(range(n_in, n_in + len(region.ops))) \
                or outputs != list(range(len(region.outputs))):
            check.fail("its merged plan's members do not cover its region once each")
        earlier: set[int] = set()  # the values the members before this one compute
        for m in self.members:
            known = set(m.inputs)
            for v in m.values:
                if not set(region.ops[v - n_in].operands) <= known:
                    check.fail(f"a member of its merged plan reads a value outside it at {v}")
                known.add(v)
            if not all(0 <= i < n_in or (i in earlier and i in region.outputs) for i in m.inputs) \
                    or not all(region.outputs[j] in known for j in m.outputs):
                check.fail("a member of its merged plan names values it does not compute")
            part = region.part(m.inputs, m.values, m.outputs)
            read = {i for i, v in enumerate(m.inputs) if v >= n_in}  # other members' results
            tail = m.plan.tail if isinstance(m.plan, RowPlan) and m.plan.split else frozenset()
            if any(set(r.operands) & read and len(part.inputs) + j not in tail
                   for j, r in enumerate(part.ops)):
                check.fail("a member of its merged plan reads another's result outside its combine")
            earlier.update(m.values)
            m.plan.verify(check.part(part))


Plan = PointwisePlan | RowPlan | GemmPlan | AttentionPlan | AttentionBackwardPlan | MergedPlan | ScatterPlan


def zero_filled(plan: Plan | None) -> frozenset[int]:
    """The outputs that start at 0: values a kernel's programs add into (atomically), and
    values stored per tile by a walk that skips the tiles where they are 0."""
    if isinstance(plan, AttentionBackwardPlan):
        skipped = plan.stores if plan.bound is not None else ()
        return frozenset(r.result for r in plan.reductions) | frozenset(skipped)
    if isinstance(plan, ScatterPlan):
        return frozenset(p for p, start in zip(plan.puts, plan.starts, strict=True) if start is None)
    return frozenset()

# the code templates by name: each plan class is its template's entry
TEMPLATES: dict[str, type[Plan]] = {plan.template: plan for plan in get_args(Plan)}


# --- text ---------------------------------------------------------------------------------


def _names(values, name: Name) -> str:
    return "(" + ", ".join(name(v) for v in sorted(values)) + ")"


def _bound(bound: KeyBound | None, name: Name) -> str:
    if bound is None:
        return "none"

    def terms(offsets, constant: int) -> str:
        text = "".join(f" {'+' if s > 0 else '-'} {name(v)}" for s, v in offsets)
        return text + (f" {'+' if constant > 0 else '-'} {abs(constant)}" if constant else "")

    def index_sum(c: IndexSum) -> str:
        parts = [f"{'-' if k < 0 else ''}{'' if abs(k) == 1 else f'{abs(k)} * '}{axis}"
                 for axis, k in (("i", c.i_coefficient), ("j", c.j_coefficient)) if k]
        return " + ".join(parts).replace("+ -", "- ") + terms(c.offsets, c.constant)

    text = f"j {'<' if bound.strict else '<='} i{terms(bound.offsets, bound.constant)}"
    if bound.lower is not None:
        text += f" and j >= i{terms(bound.lower.offsets, bound.lower.constant)}"
    text += " exactly" if bound.exact else ""
    if bound.checks:
        fit = "fits" if len(bound.checks) == 1 else "fit"
        text += " while " + " and ".join(index_sum(c) for c in bound.checks) + f" {fit} i32"
    return text


def _layout(layout: Layout) -> str:
    return "[" + ", ".join("_" if d is None else str(d) for d in layout) + "]"
