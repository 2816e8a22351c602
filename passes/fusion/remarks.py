"""Fusion decisions as records: what fused into what, and every refusal with its rule.

Remarks name ops by their payloads (kind and source span), not by node ids,
because later passes replace nodes; they are what `explain()` prints and what
tests assert on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tiledsl.ir import Op
from tiledsl.source import Span


class Rule(str, enum.Enum):
    """The rules a refusal can cite (their values are what reports print)."""

    CYCLE = "cycle"  # a value the group needs depends on the group
    OTHER_INDEX = "other-index"  # the consumer reads the producer transposed or broadcast
    TILE = "tile"  # shape or axis does not fit the kernel's iteration space
    OP = "op"  # no fusion pattern takes this op here
    MATERIALIZE = "materialize"  # a value the kernel never holds whole is needed whole outside
    PROFIT = "profit"  # legal, but the kernel would repeat more work than it saves

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Refusal:
    """A legality or profitability check saying no: the rule, and why in words."""

    rule: Rule
    detail: str


def describe(op: Op) -> str:
    where = f" (line {op.span.line})" if op.span is not None else ""
    return f"{op.kind}{where}"


@dataclass(frozen=True)
class FusionRemark:
    """One decision of a fusion pass about a producer/consumer pair or a group.

    A refusal carries the `Rule` that refused it; a fusion made has none.
    """

    pass_name: str
    fused: bool
    rule: Rule | None
    producer: Op
    consumer: Op
    detail: str

    @classmethod
    def refused(cls, pass_name: str, refusal: Refusal, producer: Op, consumer: Op) -> FusionRemark:
        return cls(pass_name, False, refusal.rule, producer, consumer, refusal.detail)

    @property
    def ops(self) -> tuple[Op, Op]:
        return self.producer, self.consumer

    @property
    def spans(self) -> tuple[Span | None, Span | None]:
        return self.producer.span, self.consumer.span

    def __str__(self) -> str:
        verb = "fused" if self.fused else "refused"
        head = f"[{self.pass_name}] {verb}: {describe(self.producer)} -> {describe(self.consumer)}"
        return f"{head}: {self.detail}" + ("" if self.fused else f" [rule: {self.rule.value}]")
