"""What a backend gives `tiledsl.Program`: kernels to show and a way to run a bound call.

Two backends implement it: `reference` (torch eager, op by op: the oracle's
eager leg and a debugging aid) and `triton` (generated kernels, launched
through a launch plan per size class). `api.Program` holds one and never
asks which it is.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tiledsl.binding import Binder, BoundCall
from tiledsl.ir import Graph, Op


@dataclass(frozen=True)
class Kernel:
    """One generated kernel, in launch order.

    `ops` are the DSL ops it computes (each with `.kind` and `.span`);
    `source` is the Triton module text (None for the reference backend).
    """

    name: str
    template: str
    ops: tuple[Op, ...]
    source: str | None
    fn_name: str | None = None

    @property
    def lines(self) -> tuple[int, ...]:
        return tuple(sorted({op.span.line for op in self.ops if op.span is not None}))


class Backend(abc.ABC):
    """Runs one compiled (fused, lowered) graph."""

    name: ClassVar[str]

    def __init__(self, graph: Graph, allow_tf32: bool = False) -> None:
        self.graph = graph
        self.allow_tf32 = allow_tf32
        self.binder = Binder(graph)  # call arguments -> BoundCall, validated

    @property
    @abc.abstractmethod
    def kernels(self) -> list[Kernel]:
        """The kernels a call runs, in launch order."""

    @abc.abstractmethod
    def run(self, bound: BoundCall) -> list[Any]:
        """The program's outputs for one bound call (fresh tensors)."""

    @property
    def launches(self) -> list[Any]:
        """Launches recorded so far (argument types and sizes), for ahead-of-time
        compilation; backends that launch nothing record none."""
        return []

    def split_launches(self, dims: Mapping[str, int]) -> dict[str, str]:
        """What each kernel that may make several launches (a split: partials, then a
        combine) launches at these sizes on a GPU, by kernel name, as `explain(dims=...)`
        shows it; backends that launch nothing say nothing."""
        return {}


def make_backend(name: str, graph: Graph, allow_tf32: bool = False) -> Backend:
    if name == "triton":
        from tiledsl.backends.triton.program import TritonBackend

        return TritonBackend(graph, allow_tf32)
    from tiledsl.backends.reference import ReferenceBackend

    return ReferenceBackend(graph, allow_tf32)


BACKENDS = ("triton", "reference")


def missing_renderings(name: str) -> list[str]:
    """The ops the backend `name` cannot compute (none, for every backend: a test holds it).
    The reference backend computes each op by its torch `reference`; the Triton backend by
    its tables of renderings, reductions and scans (`backends/triton/renderings.py`)."""
    if name == "triton":
        from tiledsl.backends.triton.renderings import missing

        return missing()
    from tiledsl.ops import OPS, Category

    return [kind for kind, d in OPS.items()
            if d.category not in (Category.SOURCE, Category.RETURN) and d.reference is None]
