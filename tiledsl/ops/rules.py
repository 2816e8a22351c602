"""Pieces the type rules share: broadcasting with blame, axes, float results."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiledsl import diagnostics as diag
from tiledsl.types import (
    BroadcastMismatch,
    DType,
    TensorType,
    broadcast_shapes,
    format_shape,
    normalize_axis,
)

from .core import RuleError


def broadcast(types: tuple[TensorType, ...]) -> tuple:
    try:
        return broadcast_shapes(*(t.shape for t in types))
    except BroadcastMismatch as err:
        # Find the two operands that disagree, for the notes.
        rank = max(t.rank for t in types)
        culprits = [
            i for i, t in enumerate(types)
            if t.rank > rank - err.dim - 1 and t.shape[err.dim - (rank - t.rank)] in (err.a, err.b)
        ]
        a, b = (culprits + [0, 1])[:2]
        raise RuleError(
            diag.BroadcastError, (a, b), lhs=format_shape(types[a].shape),
            rhs=format_shape(types[b].shape), dim=err.dim, a=err.a, b=err.b,
        ) from None


def float_of(dtype: DType) -> DType:
    return dtype if dtype.is_float else DType.F32


def axis(attrs: Mapping[str, Any], rank: int) -> int:
    given = attrs["axis"]
    norm = normalize_axis(given, rank)
    if norm is None:
        raise RuleError(diag.AxisError, (0,), axis=given, rank=rank, lo=-rank, hi=rank - 1)
    return norm


def reduced_shape(x: TensorType, attrs: Mapping[str, Any]) -> tuple:
    ax = axis(attrs, x.rank)
    if attrs.get("keepdims", False):
        return x.shape[:ax] + (1,) + x.shape[ax + 1 :]
    return x.shape[:ax] + x.shape[ax + 1 :]
