"""The DSL's builtin functions: their parameters and how they map onto IR ops.

A builtin's parameters bind like Python's (positionally, then by keyword, with
defaults). A parameter's `kind` says what the argument must be: a tensor
expression ("value") or a compile-time constant ("int", "bool", "dtype",
"str"). Sema owns what each builtin builds; this table owns the signatures,
so arity and keyword errors are uniform.
"""

from __future__ import annotations

from dataclasses import dataclass

REQUIRED = object()


@dataclass(frozen=True, slots=True)
class BParam:
    name: str
    kind: str = "value"  # value | int | bool | dtype | str
    default: object = REQUIRED
    choices: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Builtin:
    name: str
    params: tuple[BParam, ...]

    @property
    def min_args(self) -> int:
        return sum(1 for p in self.params if p.default is REQUIRED)

    def arity_text(self) -> str:
        lo, hi = self.min_args, len(self.params)
        count = str(lo) if lo == hi else f"{lo} to {hi}"
        return f"{count} argument{'s' if hi != 1 else ''}"


def _b(name: str, *params: BParam) -> Builtin:
    return Builtin(name, params)


X = BParam("x")
AXIS = BParam("axis", "int", -1)
KEEPDIMS = BParam("keepdims", "bool", False)

UNARY = ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "abs", "tanh", "sigmoid", "relu",
         "silu", "erf")
REDUCTIONS = ("sum", "max", "min", "mean", "logsumexp")

BUILTINS: dict[str, Builtin] = {name: _b(name, X) for name in UNARY}
BUILTINS.update({
    "gelu": _b("gelu", X, BParam("approximate", "str", "none", ("none", "tanh"))),
    "maximum": _b("maximum", BParam("a"), BParam("b")),
    "minimum": _b("minimum", BParam("a"), BParam("b")),
    "where": _b("where", BParam("cond"), BParam("a"), BParam("b")),
    "cast": _b("cast", X, BParam("dtype", "dtype")),
    "softmax": _b("softmax", X, AXIS),
    "transpose": _b("transpose", X, BParam("a", "int"), BParam("b", "int")),
    "index": _b("index", X, BParam("axis", "int")),
    "causal": _b("causal", X),
})
BUILTINS.update({name: _b(name, X, AXIS, KEEPDIMS) for name in REDUCTIONS})

# @tile(...) hints: name -> (check, description)
TILE_HINTS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
