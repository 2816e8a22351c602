"""Fusion profitability: which legal fusions are worth forming.

Legality keeps fusions that never add memory traffic or recompute (a consumer
reading its producer at another index is refused there). What is left to
weigh here is work that a fused kernel repeats:

- a GEMM operand prologue is recomputed for every column tile of the output,
  so only cheap ops qualify (a cast, a scale, a shift, a clamp); an
  exponential or a division of every A element per tile would cost more than
  the one extra pass over A that materializing it takes;
- a prologue value that something else also uses must be stored anyway, so
  fusing it would only duplicate work;
- an epilogue is capped at `MAX_EPILOGUE_INPUTS` extra tensors, beyond which
  the loads and registers outgrow the benefit;
- a row program longer than a block reads its rows once per reduction phase
  (a reduction that needs an earlier one's result, like layernorm's variance
  after its mean) and recomputes every value between them in each loop, so
  it is capped at `MAX_ROW_PHASES` phases, where storing an intermediate row
  and starting a new kernel costs less; and at `MAX_ROW_OPS` ops, which keeps
  each kernel's registers, source and compile time bounded (and compile time
  linear in the program's length).
"""

from __future__ import annotations

from tiledsl import ops

PROLOGUE_KINDS = frozenset(kind for kind, d in ops.OPS.items() if d.cheap)
MAX_EPILOGUE_INPUTS = 8
MAX_ROW_PHASES = 8
MAX_ROW_OPS = 256


def prologue_refusal(kind: str, users_outside: bool) -> str | None:
    """Why an elementwise op on a GEMM operand should not fuse into the operand load."""
    if users_outside:
        return "its value is also used elsewhere, so it is stored anyway"
    if kind not in PROLOGUE_KINDS:
        return (f"{kind} would be recomputed for every column tile of the output; only "
                f"{', '.join(sorted(PROLOGUE_KINDS))} are cheap enough")
    return None
