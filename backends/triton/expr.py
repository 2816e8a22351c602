"""Elementwise ops as Triton statements, shared by every template.

Inside a kernel all elementwise math runs in a compute type per category:
floats in fp32, integers in int32, bools in int1 (the numerics contract:
rounded once, at the store). An explicit `cast` to f16/bf16 rounds there,
because the user asked for it. Literals stay Python literals so Triton folds
them; everything else is assigned to a fresh compiler-owned name `v<n>`.

Ops whose IR dtype is f32 get f32-accurate math: `exp`/`exp2` go through f64
and division and `rsqrt` are correctly rounded, because the fast forms (a GPU's
`ex2.approx` and `div.full`, NumPy's SIMD f32 `exp` in the interpreter) are
off by 2 ulp or more, which the test oracle (2 x a correctly rounded eager
error) does not allow at large magnitudes. f16/bf16 ops keep the fast f32
forms: their error is far below a half-precision ulp.

Templates supply how to read region inputs (`inputs`) and how to compute
`index` ops over their tile (`index`); `Emitter.run` emits the rest.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tiledsl import ops
from tiledsl.ir import Op, Region
from tiledsl.types import DType, TensorType, result_dtype

from .codegen import Code

COMPUTE = {"f": "tl.float32", "d": "tl.float64", "i": "tl.int32", "b": "tl.int1"}

# Added to modules that convert bf16. Triton's interpreter truncates f32 -> bf16
# and mis-converts bf16 subnormals, so when INTERPRETER is set the conversions
# go through the bits (exact, round-to-nearest-even); on a GPU they are the
# native instructions.
BF16_HELPERS = """\
@triton.jit
def bf16_to_f32(x, INTERPRETER: tl.constexpr):
    if INTERPRETER:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def f32_to_bf16(x, INTERPRETER: tl.constexpr):
    if INTERPRETER:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), rounded)
    else:
        return x.to(tl.bfloat16)

"""


def category(dtype: DType) -> str:
    return "f" if dtype.is_float else ("i" if dtype is DType.I32 else "b")


def value_category(t) -> str:
    """The compute category of a value: weak floats (Python-scalar-like) compute in f64,
    like the Python arithmetic they stand for; other floats in f32."""
    return "d" if t.weak and t.dtype.is_float else category(t.dtype)


@dataclass(frozen=True, slots=True)
class Val:
    """A value during emission: source text, compute category, and whether it is a literal."""

    text: str
    cat: str
    literal: bool = False
    value: object = None  # the Python value of a literal


def literal(value: object, cat: str) -> Val:
    if cat == "b":
        v: object = bool(value)
        text = "True" if v else "False"
    elif cat == "i":
        v = int(value)
        text = str(v) if v >= 0 else f"({v})"
    else:
        v = float(value)
        if math.isinf(v):
            text = 'float("inf")' if v > 0 else '(-float("inf"))'
        elif math.isnan(v):
            text = 'float("nan")'
        else:
            text = repr(v) if v >= 0 else f"({v!r})"
    return Val(text, cat, True, v)


class Emitter:
    def __init__(self, code: Code) -> None:
        self.code = code
        self._count = 0
        self.uses_bf16 = False

    def widen(self, text: str, dtype: DType) -> str:
        """Source text of a stored `dtype` value in its compute type."""
        if dtype is DType.BF16:
            self.uses_bf16 = True
            return f"bf16_to_f32({text}, INTERPRETER)"
        if dtype is DType.F16:
            return f"{text}.to(tl.float32)"
        return text

    def narrow(self, text: str, dtype: DType) -> str:
        """Source text of a compute value rounded to the storage `dtype`."""
        if dtype is DType.BF16:
            self.uses_bf16 = True
            return f"f32_to_bf16({text}, INTERPRETER)"
        if dtype is DType.F16:
            return f"{text}.to(tl.float16)"
        return text

    def scalar(self, name: str, dtype: DType) -> Val:
        """A by-value kernel argument. Bools arrive as i32 (0/1): Triton 3.6's interpreter
        mis-stores Python bool arguments. Floats become 0-d tensors: the interpreter
        hands them over as Python floats, which have no `.to()`."""
        if dtype is DType.BOOL:
            return self.convert(Val(name, "i"), "b")
        if dtype.is_float:
            return self.assign(f"tl.full([], 0.0, tl.float32) + {name}", "f")
        return Val(name, category(dtype))

    def load(self, text: str, t: TensorType) -> Val:
        """Assign a `tl.load(...)` of a value of type `t`, widened to its compute type.

        A weak float is stored as f64 (`weak_storage`) and computes in f64."""
        if t.weak and t.dtype.is_float:
            return self.assign(text, "d")
        return self.assign(self.widen(text, t.dtype), category(t.dtype))

    def fresh(self, prefix: str = "v") -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def assign(self, expr: str, cat: str) -> Val:
        name = self.fresh()
        self.code(f"{name} = {expr}")
        return Val(name, cat)

    # --- conversions ------------------------------------------------------------------

    def convert(self, val: Val, cat: str) -> Val:
        if val.cat == cat:
            return val
        if val.literal:
            return literal(val.value, cat)
        if cat == "b":
            return self.assign(f"{val.text} != 0", "b")
        return self.assign(f"{val.text}.to({COMPUTE[cat]})", cat)

    def tensor(self, val: Val) -> Val:
        """A literal as a 0-d Triton tensor (for functions that take no Python scalars)."""
        if not val.literal:
            return val
        return self.assign(f"tl.full([], {val.text}, {COMPUTE[val.cat]})", val.cat)

    def store_value(self, val: Val, t: TensorType) -> str:
        """Source text converting a compute value to how a value of type `t` is stored."""
        if t.weak and t.dtype.is_float:
            return self.tensor(self.convert(val, "d")).text
        val = self.tensor(self.convert(val, category(t.dtype)))
        return self.narrow(val.text, t.dtype)

    # --- ops -----------------------------------------------------------------------------

    def run(
        self,
        region: Region,
        vals: dict[int, Val],
        index: Callable[[Op], Val],
        skip: Callable[[int], bool] = lambda v: False,
    ) -> dict[int, Val]:
        """Emit the region's elementwise ops in order into `vals` (value id -> Val),
        which holds the template's inputs and results already; returns it.

        `skip(value)` leaves an op to the template (a reduction, a matmul).
        """
        n = len(region.inputs)
        for i, rop in enumerate(region.ops):
            vid = n + i
            if vid in vals or skip(vid):
                continue
            op = rop.op
            if op.kind == "const":
                vals[vid] = literal(op.attr("value"), category(op.dtype))
            elif op.kind == "index":
                vals[vid] = index(op)
            elif ops.is_elementwise(op.kind):
                args = [vals[v] for v in rop.operands]
                types = tuple(region.value_type(v) for v in rop.operands)
                vals[vid] = self.op(op, args, types)
            else:
                break  # the template computes this op; later ops depend on it
        return vals

    def op(self, op: Op, args: list[Val], types: tuple) -> Val:
        kind = op.kind
        out = value_category(op.type)
        if kind == "cast":
            (a,) = args
            if op.dtype in (DType.F16, DType.BF16):
                v = self.tensor(self.convert(a, "f"))
                v = self.assign(self.widen(self.narrow(v.text, op.dtype), op.dtype), "f")
                return self.convert(v, out)
            return self.convert(a, out)
        if kind in ("lt", "le", "gt", "ge", "eq", "ne"):
            cat = category(result_dtype(types))
            if cat == "f" and all(t.weak for t in types):
                cat = "d"
            a, b = (self.convert(x, cat) for x in args)
            return self.assign(f"{a.text} {_CMP[kind]} {b.text}", "b")
        if kind == "where":
            c = self.tensor(self.convert(args[0], "b"))
            a, b = (self.convert(x, out) for x in args[1:])
            return self.assign(f"tl.where({c.text}, {a.text}, {b.text})", out)
        args = [self.convert(x, out) for x in args]
        precise = out == "f" and op.dtype is DType.F32
        if kind == "div" and precise:
            a, b = (self.tensor(x) for x in args)
            return self.assign(f"tl.div_rn({a.text}, {b.text})", out)
        if kind in ("and", "or") and out == "b":
            # masks as a select: Triton's interpreter cannot `|` a 0-d comparison result (its
            # value is a NumPy scalar); on a GPU the select compiles to the same predicate logic
            a, b = (self.tensor(x) for x in args)
            pick = f"{b.text}, False" if kind == "and" else f"True, {b.text}"
            return self.assign(f"tl.where({a.text}, {pick})", "b")
        if kind in _BINARY:
            a, b = args
            if all(x.literal for x in args):
                a = self.tensor(a)
            return self.assign(_BINARY[kind].format(a=a.text, b=b.text), out)
        if kind in ("maximum", "minimum"):
            a, b = (self.tensor(x) for x in args)
            nan = ", propagate_nan=tl.PropagateNan.ALL" if out in ("f", "d") else ""
            return self.assign(f"tl.{kind}({a.text}, {b.text}{nan})", out)
        (a,) = args
        a = self.tensor(a)
        x = a.text
        if kind == "neg":
            return self.assign(f"-{x}", out)
        if kind == "relu":
            return self.assign(f"tl.where({x} < 0, {literal(0, out).text}, {x})", out)
        if kind == "tanh":
            return self._tanh(a)
        if kind in ("exp", "exp2") and precise:
            return self.assign(f"tl.{kind}({x}.to(tl.float64)).to(tl.float32)", out)
        if kind == "sqrt" and out == "d":  # sqrt_rn is f32 only; f64 sqrt is IEEE anyway
            return self.assign(f"tl.sqrt({x})", out)
        if kind == "rsqrt" and precise:
            return self.assign(f"tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn({x}))", out)
        if kind == "gelu":
            if op.attr("approximate") == "tanh":
                inner = self.assign(f"0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})", out)
                return self.assign(f"0.5 * {x} * (1.0 + {self._tanh(inner).text})", out)
            return self.assign(f"0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))", out)
        return self.assign(_UNARY[kind].format(x=x), out)

    def _tanh(self, a: Val) -> Val:
        # tanh(x) = sign(x) * (1 - e) / (1 + e), e = exp(-2|x|): no overflow for any x.
        e = self.assign(f"tl.exp(-2.0 * tl.abs({a.text}))", a.cat)
        return self.assign(f"tl.where({a.text} < 0, -1.0, 1.0) * (1.0 - {e.text}) / (1.0 + {e.text})",
                           a.cat)


_CMP = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_BINARY = {"add": "{a} + {b}", "sub": "{a} - {b}", "mul": "{a} * {b}", "div": "{a} / {b}",
           "and": "{a} & {b}", "or": "{a} | {b}"}  # and/or on i32: bitwise
_UNARY = {
    "exp": "tl.exp({x})", "exp2": "tl.exp2({x})", "log": "tl.log({x})", "log2": "tl.log2({x})",
    "sqrt": "tl.sqrt_rn({x})", "rsqrt": "tl.rsqrt({x})", "abs": "tl.abs({x})",
    "sigmoid": "tl.sigmoid({x})", "silu": "{x} * tl.sigmoid({x})", "erf": "tl.erf({x})",
}
