"""The pass manager: runs a pipeline as straight-line named stages.

After each pass it can verify the graph (always in tests and debug mode:
`TILEDSL_VERIFY=1`), keep a snapshot for `fn.ir(stage)`, print the IR (like
`mlir-opt --mlir-print-ir-after-all`) and time the pass.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tiledsl.ir import Graph
from tiledsl.passes.lower_kernels import LowerKernels
from tiledsl.passes.registry import Pass, PassContext, parse_pipeline
from tiledsl.printer import print_graph
from tiledsl.verifier import verify


def verify_by_default() -> bool:
    return os.environ.get("TILEDSL_VERIFY", "") not in ("", "0")


@dataclass
class PipelineResult:
    graph: Graph
    stages: dict[str, Graph] = field(default_factory=dict)  # stage name -> snapshot
    timings: list[tuple[str, float]] = field(default_factory=list)  # (stage, seconds)
    context: PassContext = field(default_factory=PassContext)


class PassManager:
    def __init__(
        self,
        pipeline: str | Sequence[Pass],
        *,
        verify: bool | None = None,
        snapshots: bool = True,
        print_after: Callable[[str, Graph], None] | None = None,
    ) -> None:
        self.passes = parse_pipeline(pipeline) if isinstance(pipeline, str) else list(pipeline)
        self.verify = verify_by_default() if verify is None else verify
        self.snapshots = snapshots
        self.print_after = print_after

    @property
    def pipeline(self) -> str:
        return ",".join(p.spec() for p in self.passes)

    def run(self, graph: Graph, ctx: PassContext | None = None) -> PipelineResult:
        result = PipelineResult(graph, context=ctx or PassContext())
        if self.verify:
            verify(graph, "sema")
        self._record(result, "graph", graph)
        names = [p.name for p in self.passes]
        compiles = bool(names) and names[-1] == LowerKernels.name
        for i, p in enumerate(self.passes):
            result.context.following = tuple(names[i + 1:]) if compiles else None
            start = time.perf_counter()
            p.run(graph, result.context)
            elapsed = time.perf_counter() - start
            stage = self._stage_name(result, p.name)
            result.timings.append((stage, elapsed))
            if self.verify:
                verify(graph, p.name)
            self._record(result, stage, graph)
        return result

    def _stage_name(self, result: PipelineResult, name: str) -> str:
        if name not in result.stages:
            return name
        n = 2
        while f"{name}.{n}" in result.stages:
            n += 1
        return f"{name}.{n}"

    def _record(self, result: PipelineResult, stage: str, graph: Graph) -> None:
        if self.snapshots:
            result.stages[stage] = graph.copy()
        if self.print_after is not None:
            self.print_after(stage, graph)


def print_ir_to(stream, locations: bool = False) -> Callable[[str, Graph], None]:
    """A `print_after` callback that writes MLIR-style dumps to a stream."""

    def dump(stage: str, graph: Graph) -> None:
        stream.write(f"// -----// IR Dump After {stage} //----- //\n")
        stream.write(print_graph(graph, locations))

    return dump
