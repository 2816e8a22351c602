"""Pass base class, registry and pipeline strings.

A pass is a frozen dataclass with a `name` and its options as fields; its
docstring states what the graph looks like before and after. `register`
adds it to one registry, so a pipeline is a string usable from tests and the
CLI:

    "canonicalize,cse,dce,lower-kernels"
    "canonicalize{max-iterations=4},dce"

The built-in passes, in pipeline order with their stages, are listed once, in
`tiledsl.passes.pipeline`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tiledsl.diagnostics import OptionError, did_you_mean
from tiledsl.ir import Graph


@dataclass
class PassContext:
    """State shared by the passes of one pipeline run.

    `remarks` collects fusion decisions (made and refused) for `explain()`. `following`:
    the names of the passes after the running one in a pipeline that compiles (ends in
    `lower-kernels`), so a rewrite whose accuracy rests on a later fusion can hold back
    when none follows; None when that is unknown (a pipeline that stops at the graph IR,
    as `tiledsl opt --no-lower` and the normalizing passes do, or a pass run by itself),
    where a pass assumes the default pipeline.
    """

    remarks: list[Any] = field(default_factory=list)
    following: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Pass:
    """One pass. Any pipeline of registered passes compiles (docs/api.md), so a pass may
    run after any other and meet kernels an earlier pass formed: it leaves them as they
    are. A `KernelOp` is a producer of values, each typed by `Graph.result_type(node, res)`
    of the edge that reads it, never an op to match or rewrite; a pass reads a value's
    type through its edge and an operand's kind only where it is an `Op`."""

    name: ClassVar[str] = ""

    def run(self, graph: Graph, ctx: PassContext) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def spec(self) -> str:
        """This pass as pipeline text, options included."""
        opts = [f"{f.name.replace('_', '-')}={_format(getattr(self, f.name))}"
                for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
        return self.name + ("{" + ",".join(opts) + "}" if opts else "")


REGISTRY: dict[str, type[Pass]] = {}


def register(cls: type[Pass]) -> type[Pass]:
    assert cls.name and cls.name not in REGISTRY, cls
    REGISTRY[cls.name] = cls
    return cls


def _format(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


_ITEM = re.compile(r"\s*([A-Za-z][\w-]*)\s*(?:\{([^{}]*)\})?\s*(?:,|$)")


def parse_pipeline(text: str) -> list[Pass]:
    """Parse "a,b{opt=1},c" into pass instances, with clear errors."""
    _load_builtin_passes()
    passes: list[Pass] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _ITEM.match(text, pos)
        if not m or m.end() == pos:
            raise OptionError(message=f"cannot parse the pipeline {text!r} at {text[pos:]!r}; "
                              "expected 'pass' or 'pass{option=value}' separated by commas")
        name, options = m.group(1), m.group(2)
        cls = REGISTRY.get(name)
        if cls is None:
            raise OptionError(message=f"unknown pass '{name}'{did_you_mean(name, REGISTRY)} "
                              f"(passes: {', '.join(sorted(REGISTRY))})")
        passes.append(cls(**_options(cls, options or "")))
        pos = m.end()
    return passes


def _options(cls: type[Pass], text: str) -> dict[str, Any]:
    fields = {f.name.replace("_", "-"): f for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, raw = item.partition("=")
        key = key.strip()
        f = fields.get(key)
        if f is None:
            known = ", ".join(fields) or "none"
            raise OptionError(message=f"pass '{cls.name}' has no option '{key}' (options: {known})")
        out[f.name] = _convert(cls.name, key, raw.strip(), f.type)
    return out


def _convert(pass_name: str, key: str, raw: str, typ: Any) -> Any:
    typ = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    try:
        if typ == "bool":
            if raw not in ("true", "false"):
                raise ValueError
            return raw == "true"
        if typ == "int":
            return int(raw)
        return raw
    except ValueError:
        raise OptionError(message=f"option '{key}' of pass '{pass_name}' expects a {typ}, "
                          f"got {raw!r}") from None


def _load_builtin_passes() -> None:
    # Importing the ordered list of built-in passes imports (and so registers) them all.
    from tiledsl.passes import pipeline  # noqa: F401
