"""The DSL's builtin functions: every op's signature, plus the macros.

A builtin's parameters bind like Python's (positionally, then by keyword, with
defaults). An op called by name declares its parameters in its `OpDef`
(`tiledsl/ops`); this module collects them, and adds the builtins that build
several ops (`causal`). Sema binds arguments against these signatures, so
arity and keyword errors are uniform.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiledsl.ops import OPS, REQUIRED, BParam

__all__ = ["BUILTINS", "REQUIRED", "TILE_HINTS", "TORCH_SPELLINGS", "BParam", "Builtin"]


@dataclass(frozen=True, slots=True)
class Builtin:
    name: str
    params: tuple[BParam, ...]
    # the names of its results when it has several, unpacked `values, indices = max(x, -1)`;
    # a call used as one value is its first result (max(x, -1) is the values)
    results: tuple[str, ...] = ()

    @property
    def min_args(self) -> int:
        return sum(1 for p in self.params if p.default is REQUIRED)

    def arity_text(self) -> str:
        lo, hi = self.min_args, len(self.params)
        count = str(lo) if lo == hi else f"{lo} to {hi}"
        return f"{count} argument{'s' if hi != 1 else ''}"


BUILTINS: dict[str, Builtin] = {
    kind: Builtin(kind, d.params) for kind, d in OPS.items() if d.params is not None
}
# torch's pairs: `values, indices = max(x, axis)` is the max and the argmax along one axis
for _kind in ("max", "min"):
    BUILTINS[_kind] = Builtin(_kind, BUILTINS[_kind].params, results=("values", "indices"))
# torch's pairs of the running extremum and its position: `values, indices = cummax(x, axis)`
for _kind in ("cummax", "cummin"):
    BUILTINS[_kind] = Builtin(_kind, BUILTINS[_kind].params, results=("values", "indices"))
# topk's pair; sort(x, axis, descending) is topk of every element, argsort its indices
BUILTINS["topk"] = Builtin("topk", BUILTINS["topk"].params, results=("values", "indices"))
BUILTINS["sort"] = Builtin("sort", (BParam("x"), BParam("axis", "int", -1),
                                    BParam("descending", "bool", False)), results=("values", "indices"))
BUILTINS["argsort"] = Builtin("argsort", BUILTINS["sort"].params)
# random numbers at each element's position in x (tiledsl/ops/random.py); dropout keeps an
# element with probability 1 - p and scales it by 1 / (1 - p)
BUILTINS["rand"] = Builtin("rand", (BParam("x"), BParam("seed")))
BUILTINS["randn"] = Builtin("randn", (BParam("x"), BParam("seed")))
BUILTINS["dropout"] = Builtin("dropout", (BParam("x"), BParam("p"), BParam("seed")))
# macros: causal(x) is index(x, -2) >= index(x, -1)
BUILTINS["causal"] = Builtin("causal", (BParam("x"),))
# concat(*values, axis=-1) takes any number of values (sema binds it itself)
BUILTINS["concat"] = Builtin("concat", (BParam("values"), BParam("axis", "int", -1)))
# gather(x, idx, axis) is a take: idx along `axis`, index(..) along the others
BUILTINS["gather"] = Builtin("gather", (BParam("x"), BParam("index"), BParam("axis", "int", -1)))
# torch's scatters, out of place: x with src written (scatter, index_copy) or added
# (scatter_add, index_add) at the indices, a `put` each (tiledsl/indexing.py)
BUILTINS["scatter"] = Builtin("scatter", (BParam("x"), BParam("index"), BParam("src"),
                                          BParam("axis", "int", -1)))
BUILTINS["scatter_add"] = Builtin("scatter_add", (BParam("x"), BParam("index"), BParam("src"),
                                                  BParam("axis", "int", -1)))
BUILTINS["index_add"] = Builtin("index_add", (BParam("x"), BParam("axis", "int"), BParam("index"),
                                              BParam("src")))
BUILTINS["index_copy"] = Builtin("index_copy", (BParam("x"), BParam("axis", "int"), BParam("index"),
                                                BParam("src")))
# squeeze(x, axis) is a `slice` taking index 0 of size-1 axes
BUILTINS["squeeze"] = Builtin("squeeze", (BParam("x"), BParam("axis", "int")))
# flip(x, axis) reads x at n - 1 - i along the axis (a gather through an index expression)
BUILTINS["flip"] = Builtin("flip", (BParam("x"), BParam("axis", "int", -1)))

# pad(x, (before, after), axis=-1, value=0) reads x at i - before, `value` outside it
BUILTINS["pad"] = Builtin("pad", (BParam("x"), BParam("pad"), BParam("axis", "int", -1),
                                  BParam("value", default=0)))
# full(x, value) and zeros(x): x's shape and dtype, x's values never read
BUILTINS["full"] = Builtin("full", (BParam("x"), BParam("value")))
BUILTINS["zeros"] = Builtin("zeros", (BParam("x"),))

# torch names of builtins tiledsl spells otherwise, and how tiledsl writes them ({x}: the value)
TORCH_SPELLINGS = {
    "cat": "concat(a, b, axis=...)", "view": "reshape({x}, [...])", "flatten": "reshape({x}, [-1])",
    "unsqueeze": "{x}[:, None] (None adds an axis where it stands)", "permute": "transpose({x}, a, b)",
    "amax": "max({x}, axis=...)", "amin": "min({x}, axis=...)", "pow": "pow({x}, y) or {x} ** y",
    "reshape": "reshape({x}, [...])", "squeeze": "squeeze({x}, axis)", "cumsum": "cumsum({x}, axis=...)",
    "take_along_dim": "gather({x}, idx, axis=...)", "clip": "clamp({x}, lo, hi)",
    "masked_fill": "where(mask, value, {x}), or {x}[mask] = value", "index_put": "{x}[idx] = value",
}

# @tile(...) hints; SPLITS: how many programs share a GEMM's K loop or an attention's keys
# (1: never split), where the launch builder would otherwise choose
TILE_HINTS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLITS", "num_warps", "num_stages")
