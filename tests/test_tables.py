"""Each template and each pass is declared once, and every table that needs it reads that
declaration (issue 27): `plans.TEMPLATES` (a plan class per template, with its printer and
verifier) and `passes.pipeline.PASSES` (every pass in pipeline order, with its stage).
"""

from __future__ import annotations

import ast
import io
import tokenize
import typing
from pathlib import Path

import pytest

from tiledsl import ops
from tiledsl.api import DEFAULT_PIPELINE, NORMALIZING
from tiledsl.backends.triton.program import EMITTERS
from tiledsl.explain import REWRITE_PASSES
from tiledsl.parser import parse
from tiledsl.passes.fusion.planning import PLANNERS
from tiledsl.passes.fusion.spec import Spec
from tiledsl.passes.lower_kernels import LOWERED
from tiledsl.passes.pipeline import FUSION, PASSES, Stage
from tiledsl.passes.registry import REGISTRY, parse_pipeline
from tiledsl.plans import TEMPLATES
from tiledsl.sema import analyze

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for d in ("tiledsl", "passes", "backends") for p in (ROOT / d).rglob("*.py"))
parse_pipeline("canonicalize")  # registers every built-in pass


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_every_template_has_a_plan_printer_verifier_planner_and_emitter(name):
    plan = TEMPLATES[name]
    assert plan.template == name
    assert (plan.__doc__ or "").strip(), f"{plan.__name__} has no description"
    assert "format" in vars(plan) and "verify" in vars(plan), f"{plan.__name__} lacks a printer or verifier"
    assert isinstance(plan.strided_stores, bool)
    assert plan in PLANNERS, f"no planner for {name}"
    assert plan in EMITTERS, f"no Triton emitter for {name}"

# an op of each category lower-kernels gives a kernel of its own
LOWERED_PROGRAM = """kernel each(x: f32[M, K], w: f32[K, N]) -> (f32[M, N], f32[M], f32[M, N], f32[M, K]) {
    y = x @ w
    return (exp(y), sum(y, axis=1), softmax(y, axis=1), cumsum(x, axis=1))
}
"""


def test_the_tables_keyed_by_plan_class_hold_only_templates():
    templates = set(TEMPLATES.values())
    assert set(PLANNERS) == templates
    assert set(EMITTERS) == templates
    # every spec a fusion pass (or lower-kernels) hands a planner names one template's plan
    assert {spec.plan for spec in typing.get_args(Spec)} == templates
    graph = analyze(parse(LOWERED_PROGRAM, "lowered.tdsl").kernels[0])
    for node in graph.topo_order():
        make = LOWERED.get(ops.category(graph.op(node).kind))
        if make is not None:
            assert make(graph, node).plan in templates


def test_every_registered_pass_is_in_the_ordered_list_once():
    classes = [cls for cls, _ in PASSES]
    assert len(classes) == len(set(classes))
    assert set(classes) == set(REGISTRY.values())
    assert all(isinstance(stage, Stage) for _, stage in PASSES)


def test_the_pipelines_derive_from_the_ordered_list():
    names = [cls.name for cls, _ in PASSES]
    stages = [stage for _, stage in PASSES]
    assert DEFAULT_PIPELINE == ",".join(names)
    # the stages run in order, each once: normalizing, fusion, then lowering (lower-kernels, last)
    assert stages == sorted(stages, key=list(Stage).index)
    assert [s for i, s in enumerate(stages) if s not in stages[:i]] == list(Stage)
    assert names[-1] == "lower-kernels" and stages.count(Stage.LOWERING) == 1
    assert list(NORMALIZING) == names[:len(NORMALIZING)]
    assert NORMALIZING == tuple(n for n, s in zip(names, stages, strict=True) if s is Stage.NORMALIZING)
    assert FUSION == tuple(n for n, s in zip(names, stages, strict=True) if s is Stage.FUSION)
    assert REWRITE_PASSES <= set(names)


def _literals(path: Path):
    """(line, value) of every plain string literal in a source file (f-strings are not), but
    those of its `__all__` (names of its functions: `tiledsl.nn.attention`, not a template)."""
    text = path.read_text()
    exported = {line for node in ast.parse(text).body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                for line in range(node.lineno, node.end_lineno + 1)}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.STRING and not tok.string.lstrip("rRbBuU").startswith(("f", "F")) \
                and tok.start[0] not in exported:
            yield tok.start[0], tok.line, ast.literal_eval(tok.string)


def test_template_names_are_spelled_only_in_their_declaration():
    """A template name as a string literal appears once, in its plan class. "matmul" is an op
    kind too: only its uses next to a template (`template == "matmul"`) count."""
    found = []
    for path in SOURCES:
        for line_no, line, value in _literals(path):
            if value not in TEMPLATES or f'template: ClassVar[str] = "{value}"' in line:
                continue
            if value == "matmul" and "template" not in line.lower():
                continue  # the op kind
            found.append(f"{path.relative_to(ROOT)}:{line_no}: {line.strip()}")
    assert found == []
    plans = (ROOT / "tiledsl" / "plans.py").read_text()
    for name in TEMPLATES:
        assert plans.count(f'template: ClassVar[str] = "{name}"') == 1


def test_pass_names_are_spelled_only_on_their_pass():
    """A pass name as a string literal appears only in the module of its pass class."""
    own = {cls.name: Path(__import__(cls.__module__, fromlist=["_"]).__file__).resolve()
           for cls in REGISTRY.values()}
    found = [f"{path.relative_to(ROOT)}:{line_no}: {line.strip()}"
             for path in SOURCES for line_no, line, value in _literals(path)
             if value in own and path.resolve() != own[value]
             and 'nodes[node].get("recompute"' not in line and 'nodes[node]["recompute"]' not in line]
    assert found == []  # (the graph's "recompute" node attribute is the pass's mark, not its name)
