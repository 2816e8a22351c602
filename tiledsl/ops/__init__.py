"""The op set: every op declared once, with everything every layer needs to know of it.

An op's `OpDef` (see `core.py`) holds its arity, category, type rule, DSL
signature, how it reads its operands, its constant fold, its torch reference, its
cost and its derivative: what it computes. Sema, the verifier, canonicalize, the
passes and the reference backend read these entries; how a backend computes an op
is the backend's, keyed by kind (Triton's: `backends/triton/renderings.py`). Adding an
elementwise builtin is one `define(...)` in `unary.py`, `activations.py` or `binary.py`,
its rendering, plus tests (`tests/test_ops.py` checks that every op has every part and a
rendering in every backend).

A type rule that rejects its operands raises `RuleError`, which names the
diagnostic class and which operands to point at; sema turns it into a located
error.
"""

from __future__ import annotations

from . import activations, binary, random, structure, unary  # noqa: F401 - each module defines its ops
from .core import (
    ACCUMULATE,
    OPS,
    REQUIRED,
    SLOW_PATH_UNITS,
    BParam,
    Category,
    NotDifferentiable,
    OpDef,
    Reads,
    Reduction,
    RuleError,
    Scan,
    category,
    gathers_at,
    in_f64,
    infer,
    is_elementwise,
    linear_in,
    units,
)

# ops a row program computes along its row axis (the rows template)
ROW_KINDS = tuple(k for k, d in OPS.items()
                  if d.category in (Category.REDUCTION, Category.SOFTMAX, Category.SCAN,
                                    Category.SELECT))
COMPARE_KINDS = {d.symbol: k for k, d in OPS.items() if d.reads is Reads.COMPARE}
# the operand a scatter op (Category.SCATTER) writes at the indices that follow it
WRITTEN = structure.WRITTEN
BINARY_KINDS = {d.symbol: k for k, d in OPS.items()
                if d.symbol and d.arity == 2 and d.reads is Reads.PROMOTED}

__all__ = ["ACCUMULATE", "BINARY_KINDS", "COMPARE_KINDS", "OPS", "REQUIRED", "ROW_KINDS", "SLOW_PATH_UNITS",
           "WRITTEN",
           "BParam", "Category", "NotDifferentiable", "OpDef", "Reads", "Reduction", "RuleError", "Scan",
           "category", "gathers_at", "in_f64", "infer", "is_elementwise", "linear_in", "units"]
