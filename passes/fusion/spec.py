"""Kernel specifications: what a fusion pass decided about a kernel, in graph nodes.

A pass that forms a kernel decides what each of its ops is for: the iteration space of a
row program, the matmul of a GEMM and its duals and statistics, the two matmuls of an
attention kernel with its score modification, operand prologues, softmax, stored
logsumexps, sums over the keys and epilogue. It says so in a spec, in the nodes of the
graph it is looking at. `regions.replace_with_kernel` outlines the group and renumbers
the spec's nodes as the values of the region (`in_region`); the template's planner
(`fusion.planning`) turns the spec into the plan. A planner adds only facts of the
region's dataflow (the tensor an operand's prologue reads, how a value maps onto a row
space, a mask's key bound); it decides no role again.

A field holding nodes is declared with `nodes()`: renumbering maps exactly those (an int,
None, a tuple or frozenset of them, or a nested spec record).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, ClassVar

from tiledsl.plans import (
    AttentionBackwardPlan,
    AttentionPlan,
    GemmPlan,
    Member,
    MergedPlan,
    PointwisePlan,
    RowPlan,
    ScatterPlan,
)
from tiledsl.types import Shape

from .legality import RowSpace


def nodes(**kwargs: Any) -> Any:
    """A field of graph nodes, renumbered as region values when the kernel is outlined."""
    return field(metadata={"nodes": True}, **kwargs)


def in_region(record, values: Mapping[int, int]):
    """`record` (a spec or a nested record of one) with its node fields as region values."""
    return replace(record, **{f.name: _renumber(getattr(record, f.name), values)
                              for f in fields(record) if f.metadata.get("nodes")})


def _renumber(x, values: Mapping[int, int]):
    if x is None:
        return None
    if isinstance(x, int):
        return values[x]
    if isinstance(x, tuple | frozenset):
        return type(x)(_renumber(v, values) for v in x)
    assert is_dataclass(x), f"a node field holds nodes, not {type(x).__name__}"
    return in_region(x, values)


@dataclass(frozen=True)
class PointwiseSpec:
    """Elementwise ops over one shape (fuse-elementwise's group, lower-kernels' one op)."""

    plan: ClassVar = PointwisePlan
    shape: Shape


@dataclass(frozen=True)
class ScatterSpec:
    """`put` ops over one space (the values they write), with the elementwise ops that compute
    those values and their indices (fuse-scatter's group, lower-kernels' one put)."""

    plan: ClassVar = ScatterPlan
    shape: Shape


@dataclass(frozen=True)
class RowSpec:
    """A row program over `space`: its seed's shape and the axes its reductions run along,
    as fuse-rows admitted every member against it."""

    plan: ClassVar = RowPlan
    space: RowSpace


@dataclass(frozen=True)
class GemmSpec:
    """A GEMM: its matmul, the duals sharing its A tiles (one accumulator each), the
    statistics of A's rows accumulated in the K loop, and the sums of the product over its
    batch axes `summed_axes` taken in the K loop (`batch_sums`, in order), as fuse-epilogue
    admitted them; the ops feeding their operands are the prologue, the others the
    epilogue."""

    plan: ClassVar = GemmPlan
    matmul: int = nodes()
    duals: tuple[int, ...] = nodes(default=())
    stats: tuple[int, ...] = nodes(default=())
    batch_sums: tuple[int, ...] = nodes(default=())
    summed_axes: tuple[int, ...] = ()
    batch_scales: tuple[int, ...] = nodes(default=())  # the muls scaling each product summed
    segment: int | None = nodes(default=None)  # a grouped GEMM's per-row index of B's matrix


@dataclass(frozen=True)
class AttentionSpec:
    """An attention kernel as fuse-attention matched it: q @ k.T (`qk`), the score
    modification (`score_ops`, with the side ops the key sums read), the softmax (None: the
    chain is summed as it is) and its cast p or the ops linear in p after it (`p_ops`: dropout),
    p @ v, the logsumexps stored and the widenings
    they read, the sums over the keys, and the epilogue (with the values per query row
    computed from the logsumexps and sums). The other members are the operands' prologues."""

    plan: ClassVar = AttentionPlan
    qk: int = nodes()
    pv: int = nodes()
    softmax: int | None = nodes()
    p_cast: int | None = nodes()
    score_ops: tuple[int, ...] = nodes()
    lse: tuple[int, ...] = nodes()
    lse_casts: tuple[int, ...] = nodes()
    row_sums: tuple[int, ...] = nodes()
    epilogue: tuple[int, ...] = nodes()
    p_ops: tuple[int, ...] = nodes(default=())


@dataclass(frozen=True)
class ProductSpec:
    """A product of the attention backward: a matmul summing a score-space value `x` over
    the queries or the keys, through the transpose `view` of x when it has one, and the
    sums and reshapes after it that sum it over batch axes too (GQA's dk, dv)."""

    matmul: int = nodes()
    x: int = nodes()
    view: int | None = nodes()
    batch_sums: tuple[int, ...] = nodes()


@dataclass(frozen=True)
class AttentionBackwardSpec:
    """One kernel of an attention backward's score space (`fusion.score_space`): which
    walk it is (`over`: the queries or the keys its products sum over), its score dots,
    its products, the score-space values it stores per tile, and the chains of sums of
    score-space values it adds into its outputs."""

    plan: ClassVar = AttentionBackwardPlan
    over: str
    dots: tuple[int, ...] = nodes()
    products: tuple[ProductSpec, ...] = nodes()
    stores: tuple[int, ...] = nodes()
    reductions: tuple[tuple[int, ...], ...] = nodes()


@dataclass(frozen=True)
class MergedSpec:
    """Independent kernels merged into one launch (fuse-horizontal), each a member with its
    own plan over its part of the merged region (`regions.merged_region`)."""

    plan: ClassVar = MergedPlan
    members: tuple[Member, ...]


Spec = PointwiseSpec | RowSpec | GemmSpec | AttentionSpec | AttentionBackwardSpec | MergedSpec | ScatterSpec
