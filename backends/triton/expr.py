"""Elementwise ops as Triton statements, shared by every template.

Inside a kernel every value computes in its `Compute` type: floats in fp32,
integers in their own width, bools in int1, and weak (Python-scalar-like) values
as Python computes them, floats in fp64 and integers in int64 (the numerics
contract: rounded once, at the store). Literals stay Python literals so Triton folds
them; everything else is assigned to a fresh compiler-owned name `v<n>`.

What each op renders to is its `triton` entry in the op registry
(`tiledsl/ops`); the emitter reads the operands as the op's `Reads` says and
hands them over. Templates supply how to read region inputs and how to
compute `index` ops over their tile (`index`); `Emitter.run` emits the rest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass

import torch

from tiledsl import ops
from tiledsl.ir import Op, Region, RegionOp
from tiledsl.ops import Reads
from tiledsl.ops.core import read_types
from tiledsl.types import NARROW, Compute, DType, TensorType, compute_type, value_compute

from .codegen import Code, TensorRef
from .render import is_precise
from .renderings import RENDERINGS

TRITON_TYPE = {Compute.F32: "tl.float32", Compute.F64: "tl.float64", Compute.I8: "tl.int8",
               Compute.U8: "tl.uint8", Compute.I16: "tl.int16", Compute.I32: "tl.int32",
               Compute.I64: "tl.int64", Compute.BOOL: "tl.int1"}

# Helper functions added to modules that convert these dtypes, keyed by dtype name.
# bf16: Triton's interpreter truncates f32 -> bf16
# and mis-converts bf16 subnormals, so when INTERPRETER is set the conversions
# go through the bits (exact, round-to-nearest-even); on a GPU they are the
# native instructions.
HELPERS: dict[str, str] = {}
HELPERS["bf16"] = """\
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

# a product along an axis (prod's collapse): tl.reduce's combine must be a jit function
# tiledsl/ops/random.py: Philox (tl.randint4x) at an i64 position; a normal is Box-Muller of
# its first two words in f64, rounded once (the reference computes the same)
HELPERS["random"] = """\
@triton.jit
def uniform_at(seed, position):
    w0, _, _, _ = tl.randint4x(seed, position)
    return tl.uint_to_uniform_float(w0)


@triton.jit
def normal_at(seed, position):
    w0, w1, _, _ = tl.randint4x(seed, position)
    u1 = tl.maximum(tl.uint_to_uniform_float(w0), 1.0e-7).to(tl.float64)
    u2 = tl.uint_to_uniform_float(w1).to(tl.float64)
    return (tl.sqrt(-2.0 * tl.log(u1)) * tl.cos(6.283185307179586 * u2)).to(tl.float32)

"""
# tanh of a value whose op rounds to bf16 (`tanh_of`): the hardware's tanh.approx.f32 (one
# MUFU op, relative error about 2^-11, a quarter of bf16's rounding) on a GPU; the
# interpreter cannot run PTX and computes the exact form
HELPERS["tanh"] = """\
@triton.jit
def tanh_approx(x, INTERPRETER: tl.constexpr):
    if INTERPRETER:
        e = tl.exp(-2.0 * tl.abs(x))
        return tl.where(x < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
    else:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)

"""
# exp and exp2 of an f32 op, accurate to about half an f32 ulp in f32 arithmetic (no f64,
# whose software exp costs hundreds of instructions an element): x = n ln2 + r with n an
# integer and |r| <= ln2 / 2 (Cody-Waite: ln2 in two parts, the first exact in products with
# n), exp(r) = 1 + r + r^2 p(r) (Taylor to r^8, truncation under 2^-30), the sum 1 + r split
# exactly (Fast2Sum) so one rounding remains, then scaled by 2^n as two exact powers of 2
# (results down to subnormals, and inf past the f32 range); NaN stays NaN. Triton's own
# tl.exp is ex2.approx of x * log2(e), whose rounding grows with |x| (tens of ulps).
HELPERS["exp"] = """\
@triton.jit
def exp_tail(r, n, x):
    p = tl.fma(r, 2.48015873015873e-05, 1.984126984126984e-04)
    p = tl.fma(p, r, 1.388888888888889e-03)
    p = tl.fma(p, r, 8.333333333333333e-03)
    p = tl.fma(p, r, 4.1666666666666664e-02)
    p = tl.fma(p, r, 1.6666666666666666e-01)
    p = tl.fma(p, r, 0.5)
    hi = 1.0 + r
    lo = (1.0 - hi) + r
    e = hi + tl.fma(r * r, p, lo)
    k = n.to(tl.int32)
    h = k >> 1
    s1 = ((h + 127) << 23).to(tl.float32, bitcast=True)
    s2 = ((k - h + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, e * s1 * s2)


@triton.jit
def exp_f32(x):
    xc = tl.minimum(tl.maximum(x, -104.0), 89.0)
    n = tl.floor(xc * 1.4426950408889634 + 0.5)
    r = tl.fma(n, -0.693145751953125, xc)
    r = tl.fma(n, -1.4286067653301870e-06, r)
    return exp_tail(r, n, x)


@triton.jit
def exp2_f32(x):
    xc = tl.minimum(tl.maximum(x, -151.0), 129.0)
    n = tl.floor(xc + 0.5)
    return exp_tail((xc - n) * 0.6931471805599453, n, x)

"""
# sin and cos of an f32 op without libdevice's f64 forms (whose large-argument reduction is
# a slow path across which a tile's values spill): x reduced by a multiple k of pi/2 in f64
# hardware arithmetic (pi/2 in two parts: exact for |k| up to 2^30), the remainder |r| <= pi/4
# evaluated in f32 by Cephes' polynomials (about an ulp), the quadrant k mod 4 choosing sin or
# cos of r and its sign. NaN and +-inf give NaN, as torch's.
HELPERS["trig"] = """\
@triton.jit
def trig_reduced(x):
    xd = x.to(tl.float64)
    k = tl.floor(xd * 0.6366197723675814 + 0.5)
    r = ((xd - k * 1.5707963267948966) - k * 6.123233995736766e-17).to(tl.float32)
    z = r * r
    s = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * r + r
    c = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2) * z * z \\
        - 0.5 * z + 1.0
    q = (k - 4.0 * tl.floor(k * 0.25)).to(tl.int32)
    return s, c, q


@triton.jit
def sin_f32(x):
    s, c, q = trig_reduced(x)
    v = tl.where((q & 1) == 1, c, s)
    return tl.where(q >= 2, -v, v)


@triton.jit
def cos_f32(x):
    s, c, q = trig_reduced(x)
    v = tl.where((q & 1) == 1, s, c)
    return tl.where((q == 1) | (q == 2), -v, v)

"""
HELPERS["mul_combine"] = """\
@triton.jit
def mul_combine(a, b):
    return a * b

"""

# f8: Triton's interpreter mis-converts NaN and large values, and Triton's own f32 -> f8
# need not overflow as torch does; the narrowing helpers follow torch bit for bit on every
# target (round to nearest even; e4m3fn saturates at 448 and has no inf; e5m2 overflows
# to inf).
# f32 -> f8: the 23 mantissa bits rounded to `mantissa` (to nearest even) in the normal
# range, where past the largest finite code an e4m3 saturates (126: 448) and an e5m2 is
# inf (124); below the smallest normal, the nearest even multiple of the smallest subnormal.
# On a GPU an e4m3 is the hardware's conversion (`cvt.rn.satfinite.e4m3x2.f32`: to nearest
# even, saturating at 448 past the largest finite value and for infinities, as torch does): one
# instruction for two values, where the bit arithmetic takes about twenty, which a GEMM whose
# prologue quantizes each A tile would be issue-bound on. An e5m2's saturates where torch
# overflows to inf: it keeps the bit arithmetic.
F8_NARROW = """\
@triton.jit
def f32_to_{name}(x, INTERPRETER: tl.constexpr):
    if {hardware} and not INTERPRETER:
        return x.to({tl_type})
    u = x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    sign = ((x.to(tl.uint32, bitcast=True) >> 24) & 128).to(tl.int32)
    a = tl.abs(x)
    r = u + ((1 << (22 - {mantissa})) - 1) + ((u >> (23 - {mantissa})) & 1)
    e = (r >> 23).to(tl.int32) - {rebias}
    code = (e << {mantissa}) | ((r >> (23 - {mantissa})) & {mask}).to(tl.int32)
    normal = tl.where(code > {max_finite}, {overflow}, code)
    q = a * {subnormal_scale}
    f = tl.floor(q)
    odd = f - 2.0 * tl.floor(f * 0.5)
    sub = tl.where(q - f > 0.5, f + 1.0, tl.where(q - f == 0.5, f + odd, f)).to(tl.int32)
    bits = tl.where(x != x, 127, tl.where(a < {min_normal}, sub, normal)) | sign
    return bits.to(tl.uint8).to({tl_type}, bitcast=True)
"""
HELPERS["f8e4m3"] = ("""\
@triton.jit
def f8e4m3_to_f32(x, INTERPRETER: tl.constexpr):
    if INTERPRETER:
        bits = x.to(tl.uint8, bitcast=True).to(tl.int32)
        e = (bits >> 3) & 15
        m = bits & 7
        scale = ((tl.maximum(e, 1) + 120) << 23).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m, m + 8).to(tl.float32) * 0.125 * scale
        mag = tl.where(e == 15, tl.where(m == 7, float("nan"), mag), mag)
        return tl.where(bits >= 128, -mag, mag)
    else:
        return x.to(tl.float32)


{narrow}""").format(narrow=F8_NARROW.format(name="f8e4m3", mantissa=3, mask=7, rebias=120, max_finite=126,
                                             overflow=126, subnormal_scale=512.0, min_normal=2.0**-6,
                                             tl_type="tl.float8e4nv", hardware=True))
HELPERS["f8e5m2"] = ("""\
@triton.jit
def f8e5m2_to_f32(x, INTERPRETER: tl.constexpr):
    if INTERPRETER:
        return (x.to(tl.uint8, bitcast=True).to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return x.to(tl.float32)


{narrow}""").format(narrow=F8_NARROW.format(name="f8e5m2", mantissa=2, mask=3, rebias=112, max_finite=123,
                                             overflow=124, subnormal_scale=65536.0, min_normal=2.0**-14,
                                             tl_type="tl.float8e5", hardware=False))


def with_scalar_operands(region: Region, values: Iterable[int], have: Container[int]) -> set[int]:
    """`values` (region ops) and the constants and scalar expressions they read that are not
    in `have`. Outlining clones those once for the whole region; a template that emits the
    region piecewise, at several tiles, computes them again wherever they are read."""
    n_in = len(region.inputs)
    wanted = set(values)
    stack = [o for v in wanted for o in region.ops[v - n_in].operands]
    while stack:
        o = stack.pop()
        if o < n_in or o in wanted or o in have or region.value_type(o).rank != 0:
            continue
        kind = region.ops[o - n_in].op.kind
        if kind == "const" or ops.is_elementwise(kind):
            wanted.add(o)
            stack.extend(region.ops[o - n_in].operands)
    return wanted


def inputs_read(region: Region, values: Iterable[int]) -> list[int]:
    """The region inputs the ops `values` read at their tile, in order of first read (a
    gathered operand is read through its pointer, not at the tile)."""
    n_in, found = len(region.inputs), {}
    for v in values:
        rop = region.ops[v - n_in]
        for slot, o in enumerate(rop.operands):
            if o < n_in and not ops.gathers_at(rop.op.kind, slot):
                found[o] = None
    return list(found)


def dot_kwargs(dtype: DType, allow_tf32: bool) -> str:
    """`tl.dot`'s keyword arguments for operands of `dtype`: f32 dots are IEEE unless tf32 is
    allowed; integer dots accumulate in i32, said explicitly (Triton before 3.9 checks an i32
    accumulator against the default out_dtype, f32, and refuses it)."""
    if dtype.is_int:
        return ", out_dtype=tl.int32"
    if dtype is not DType.F32:
        return ""
    return ', input_precision="tf32"' if allow_tf32 else ', input_precision="ieee"'


@dataclass(frozen=True, slots=True)
class Gather:
    """A region input that an op reads at indices it computes (`take`): its pointer and
    strides, the source text of each dim's size, and its type."""

    ref: TensorRef
    sizes: tuple[str, ...]
    type: TensorType


@dataclass(frozen=True, slots=True)
class Val:
    """A value during emission: source text, compute type, and whether it is a literal.
    `source`: the tensor an op gathers from (the operand `Emitter.operands` hands over).
    `uniform`: one value for the whole program (a by-value argument), which the compiler
    computes from once, outside any loop."""

    text: str
    cat: Compute
    literal: bool = False
    value: object = None  # the Python value of a literal
    source: Gather | None = None
    uniform: bool = False
    # an `index` op's value: a position along an axis of this size (a size's source text),
    # in [0, size) at every lane the template's mask (`Emitter.mask`) keeps
    bound: str | None = None


def literal(value: object, cat: Compute) -> Val:
    if cat is Compute.BOOL:
        v: object = bool(value)
        text = "True" if v else "False"
    elif cat.is_int:
        v = int(value)
        # torch wraps a scalar into a narrow tensor's type (Triton refuses a literal outside
        # it), and an explicit cast wraps a value into its type (Triton would widen it)
        lo, hi = DType(cat.value).int_range
        v = (v - lo) % (hi - lo + 1) + lo
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


def _scalar_slot(op: Op, args: list[Val], types: tuple[TensorType, ...], out: Compute) -> int | None:
    """The operand of an f32 `mul` or `div` (the divisor) that is a loop-invariant scalar
    times a tile, or None."""
    if out is not Compute.F32 or op.type.rank == 0 or any(a.cat is not Compute.F32 for a in args):
        return None
    slots = (0, 1) if op.kind == "mul" else (1,)
    for k in slots:
        other = args[1 - k]
        if types[k].rank == 0 and (args[k].literal or args[k].uniform) and types[1 - k].rank > 0 \
                and not other.literal:
            return k
    return None


class Emitter:
    def __init__(self, code: Code) -> None:
        self.code = code
        self._count = 0
        self.helpers: set[str] = set()  # the HELPERS the module needs
        self.sources: dict[int, Gather] = {}  # region inputs that ops gather from
        # a tile value times a loop-invariant scalar (a by-value argument, a literal, or
        # their products): value text -> (tile, scalar), so consumers fold the scalar
        self.scaled: dict[str, tuple[Val, Val]] = {}
        # the template's mask of the lanes it computes, where its `index` values are bounded
        # by their axes' sizes there (`Val.bound`); None: no such promise
        self.mask: str | None = None

    def widen(self, text: str, dtype: DType) -> str:
        """Source text of a stored `dtype` value in its compute type."""
        if dtype is DType.BF16 or dtype.is_f8:
            self.helpers.add(dtype.value)
            return f"{dtype.value}_to_f32({text}, INTERPRETER)"
        if dtype is DType.F16:
            return f"{text}.to(tl.float32)"
        return text

    def narrow(self, text: str, dtype: DType) -> str:
        """Source text of a compute value rounded to the storage `dtype`."""
        if dtype is DType.BF16:
            self.helpers.add(dtype.value)
            return f"f32_to_bf16({text}, INTERPRETER)"
        if dtype.is_f8:  # torch's rounding, bit for bit, on every target (see HELPERS)
            self.helpers.add(dtype.value)
            return f"f32_to_{dtype.value}({text}, INTERPRETER)"
        if dtype is DType.F16:
            return f"{text}.to(tl.float16)"
        return text

    def scalar(self, name: str, t: TensorType) -> Val:
        """A by-value kernel argument, as a 0-d tensor. Floats: the interpreter hands them
        over as Python floats, which have no `.to()`; a scalar parameter declared f16 or
        bf16 is used at f32, not rounded to its dtype (torch's Python scalar with a
        half-precision tensor). Integers: Triton's launcher compiles an argument equal to 1
        in as a constant, which has no `.to()` either; a weak one (a dim's size) computes in
        i64. Bools arrive as i32 (0/1): Triton 3.6's interpreter mis-stores Python bool
        arguments."""
        if t.dtype.is_float:
            # -0.0 is the sum's identity (+0.0 + -0.0 would lose an argument's sign)
            value = self.assign(f"tl.full([], -0.0, tl.float32) + {name}", Compute.F32)
            return Val(value.text, value.cat, uniform=True)
        cat = value_compute(t) if t.dtype.is_int else Compute.I32
        value = self.assign(f"tl.full([], 0, {TRITON_TYPE[cat]}) + {name}", cat)
        if cat in NARROW:  # the argument arrives as an i32, which the sum promotes to
            value = self.assign(f"{value.text}.to({TRITON_TYPE[cat]})", cat)
        return self.convert(value, Compute.BOOL) if t.dtype is DType.BOOL else value

    def load(self, text: str, t: TensorType) -> Val:
        """Assign a `tl.load(...)` of a value of type `t`, widened to its compute type.

        A weak float is stored as f64 (`weak_storage`) and computes in f64."""
        if t.weak and t.dtype.is_float:
            return self.assign(text, Compute.F64)
        return self.assign(self.widen(text, t.dtype), compute_type(t.dtype))

    def load_at(self, ptrs: str, mask: str | None, t: TensorType) -> Val:
        """`load` of the pointers `ptrs` under `mask` (a float 0 outside it: Triton's
        interpreter cannot convert an integer fill to f8)."""
        if mask is None:
            return self.load(f"tl.load({ptrs})", t)
        return self.load(f"tl.load({ptrs}, mask={mask}, other={'0.0' if t.dtype.is_float else '0'})", t)

    def gather_from(self, region: Region, refs: Mapping[int, TensorRef],
                    size: Callable[[object], str]) -> None:
        """Register the region inputs that ops gather from (`take`), by their pointers and
        strides. A template loads an input at its tile only if `region.read_whole(i)`."""
        for i, ref in refs.items():
            if region.gathered(i):
                t = region.inputs[i].type
                self.sources[i] = Gather(ref, tuple(size(d) for d in t.shape), t)

    def operands(self, rop: RegionOp, vals: Mapping[int, Val]) -> list[Val] | None:
        """The Vals of an op's operands (a gathered one: its source), or None while one is
        not computed yet."""
        out = []
        for slot, o in enumerate(rop.operands):
            if ops.gathers_at(rop.op.kind, slot):
                src = self.sources[o]
                out.append(Val(src.ref.ptr, compute_type(src.type.dtype), source=src))
            elif o in vals:
                out.append(vals[o])
            else:
                return None
        return out

    def index(self, expr: str | None, bound: str | None = None) -> Val:
        """An `index` op's value: `expr` is the tile's index along its axis, None along a
        size-1 axis (where it is 0); `bound`, the axis's size where the template's mask
        (`mask`) keeps only lanes inside it: a gather at that index then needs no checks."""
        if expr is None:
            return literal(0, Compute.I32)
        val = self.assign(f"{expr if expr.isidentifier() else f'({expr})'}.to(tl.int32)", Compute.I32)
        return Val(val.text, val.cat, bound=bound if self.mask is not None else None)

    def fresh(self, prefix: str = "v") -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def assign(self, expr: str, cat: Compute) -> Val:
        name = self.fresh()
        self.code(f"{name} = {expr}")
        return Val(name, cat)

    # --- conversions ------------------------------------------------------------------

    def literal(self, value: object, cat: Compute) -> Val:
        return literal(value, cat)

    def convert(self, val: Val, cat: Compute) -> Val:
        if val.cat is cat:
            return val
        if val.literal:
            return literal(val.value, cat)
        if cat is Compute.BOOL:
            return self.assign(f"{val.text} != 0", cat)
        out = self.assign(f"{val.text}.to({TRITON_TYPE[cat]})", cat)
        return Val(out.text, cat, uniform=True) if val.uniform else out

    def tensor(self, val: Val) -> Val:
        """A literal as a 0-d Triton tensor (for functions that take no Python scalars)."""
        if not val.literal:
            return val
        return self.assign(f"tl.full([], {val.text}, {TRITON_TYPE[val.cat]})", val.cat)

    def rounded(self, val: Val, dtype: DType) -> Val:
        """An f32 compute value rounded to `dtype` and read back (its value as stored)."""
        return self.assign(self.widen(self.narrow(self.tensor(val).text, dtype), dtype), val.cat)

    def store_value(self, val: Val, t: TensorType) -> str:
        """Source text converting a compute value to how a value of type `t` is stored."""
        if t.weak and t.dtype.is_float:
            return self.tensor(self.convert(val, Compute.F64)).text
        val = self.tensor(self.convert(val, compute_type(t.dtype)))
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
                vals[vid] = literal(op.attr("value"), value_compute(op.type))
            elif op.kind == "index":
                vals[vid] = index(op)
            elif ops.is_elementwise(op.kind):
                args = self.operands(rop, vals)
                types = tuple(region.value_type(v) for v in rop.operands)
                vals[vid] = self.op(op, args, types)
            else:
                break  # the template computes this op; later ops depend on it
        return vals

    def op(self, op: Op, args: list[Val], types: tuple[TensorType, ...]) -> Val:
        """One elementwise op: its operands read as its `Reads` says, then its rendering."""
        opdef = ops.OPS[op.kind]
        out = value_compute(op.type)
        reads = read_types(op.kind, types, op.type)
        read: list[Val] = []
        for x, r in zip(args, reads, strict=True):
            x = x if r is None else self.convert(x, value_compute(r))
            # where's condition as a tensor: tl.where takes no Python scalar for it
            read.append(self.tensor(x) if opdef.reads is Reads.SELECT and not read else x)
        args = read
        if opdef.reads is Reads.COMPARE and reads[0].dtype in (DType.F16, DType.BF16) and not reads[0].weak:
            # compared in a half-precision type as torch compares, both sides rounded to it,
            # so a value stored in f16 by one kernel compares with a literal as it would
            # inside one kernel
            args = [self.rounded(x, reads[0].dtype) for x in args]
        if op.kind in ("mul", "div"):
            result = self.scalar_product(op, args, types, out)
        else:
            result = RENDERINGS[op.kind](self, op, args, out)
        if op.type.rank == 0 and not result.literal and all(a.literal or a.uniform for a in args):
            return Val(result.text, result.cat, uniform=True)  # of the program's scalars only
        return result

    def reciprocal(self, b: Val, exact: bool) -> Val:
        """1 / b of a loop-invariant divisor (a by-value argument, a literal, or their
        products), in f32: correctly rounded where `exact` (a literal's in torch's f32
        arithmetic), else Triton's fast reciprocal (for ops rounded to 16 bits)."""
        if b.literal:
            one = torch.tensor(1.0, dtype=torch.float32)
            return literal(float(one / torch.tensor(float(b.value), dtype=torch.float32)), Compute.F32)
        text = f"tl.div_rn(1.0, {b.text})" if exact else f"(1.0 / {b.text})"
        return Val(text, Compute.F32, uniform=True)

    def scalar_product(self, op: Op, args: list[Val], types: tuple[TensorType, ...], out: Compute) -> Val:
        """A product or quotient of a tile and a loop-invariant scalar. For an op rounded to
        16 bits, a tile that is itself a product with a scalar, `(x * a) * b`, becomes
        `x * (a * b)` (the scalars multiply once, outside the loop: Gemma-2's
        `s * scale / cap` is one multiply a score). Records `scaled` for the consumers."""
        k = _scalar_slot(op, args, types, out)
        tile = args[1 - k] if k is not None else None
        if tile is not None and tile.text in self.scaled and not is_precise(op, out):
            base, a = self.scaled[tile.text]
            b = args[k]
            factor = Val(f"({a.text} * {b.text})" if op.kind == "mul" else f"({a.text} / {b.text})",
                         Compute.F32, uniform=True)
            result = self.assign(f"{base.text} * {factor.text}", out)
            self.scaled[result.text] = (base, factor)
            return result
        result = RENDERINGS[op.kind](self, op, args, out)
        if tile is not None and not result.literal:
            if op.kind == "mul":
                self.scaled[result.text] = (tile, args[k])
            elif not is_precise(op, out):  # `div`'s reciprocal product
                self.scaled[result.text] = (tile, self.reciprocal(args[k], False))
        return result
