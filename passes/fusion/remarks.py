"""Fusion decisions as records: what fused into what, and every refusal with its rule.

Remarks name ops by their payloads (kind and source span), not by node ids,
because later passes replace nodes; they are what `explain()` prints and what
tests assert on.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl.ir import Op
from tiledsl.source import Span

# The rules a refusal can cite.
RULES = {
    "cycle": "fusing would create a cycle: a value the group needs depends on the group",
    "other-index": "the consumer reads the producer at another index (transposed or broadcast)",
    "tile": "the group's tile cannot hold it (shape or axis does not fit the kernel's iteration space)",
    "op": "no fusion pattern takes this op here",
    "materialize": "a value the fused kernel never holds whole is needed whole outside it",
    "profit": "legal, but the fused kernel would repeat more work than it saves",
}


def describe(op: Op) -> str:
    where = f" (line {op.span.line})" if op.span is not None else ""
    return f"{op.kind}{where}"


@dataclass(frozen=True)
class FusionRemark:
    """One decision of a fusion pass about a producer/consumer pair or a group."""

    pass_name: str
    fused: bool
    rule: str  # a key of RULES for refusals; "fused" for fusions made
    producer: Op
    consumer: Op
    detail: str

    @property
    def spans(self) -> tuple[Span | None, Span | None]:
        return self.producer.span, self.consumer.span

    def __str__(self) -> str:
        verb = "fused" if self.fused else "refused"
        head = f"[{self.pass_name}] {verb}: {describe(self.producer)} -> {describe(self.consumer)}"
        return f"{head}: {self.detail}" + ("" if self.fused else f" [rule: {self.rule}]")
