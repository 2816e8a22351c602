"""Every op's Triton: the rendering of each elementwise op (`RENDERINGS`, by kind), and how
each reduction and scan merges, combines and finishes its partials in Triton source
(`REDUCTIONS`, `SCANS`). The ops declare what they compute (`tiledsl.ops`: types, folds,
torch references, derivatives, costs); this module is the only place that says how Triton
computes them, and `missing()` names any op without a rendering here (a test holds it
empty, as the reference backend's for its torch references).

A rendering is `render(em, op, args, out) -> value` (see `render.py`): `em` is the emitter,
`args` the operands read as the op's `Reads` says, `out` the result's compute type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiledsl import ops
from tiledsl.ops.activations import SELU_ALPHA, SELU_SCALE
from tiledsl.ops.core import Reduction, Scan
from tiledsl.types import NARROW, Compute, compute_type

from .render import (
    NAN_ALL,
    Render,
    all_of,
    any_of,
    binary,
    compare,
    in_wide_type,
    is_precise,
    is_rounded_to_bf16,
    nan_propagating,
    take,
    unary,
)

# --- unary ops (tiledsl/ops/unary.py) ------------------------------------------------------

def _helper(name: str, helper: str, fast: str):
    """exp, exp2, sin, cos: an f32 op's through the `helper` module function (HELPERS: about
    an ulp, no libdevice f64 form), others' Triton's own (`fast`)."""

    def render(em, op, args, out):
        x = em.tensor(args[0])
        if is_precise(op, out):
            em.helpers.add(helper)
            return em.assign(f"{name}_f32({x.text})", out)
        return em.assign(fast.format(x=x.text), out)

    return render


def _render_tan(em, op, args, out):
    """sin / cos: Triton has no tan outside libdevice, which the interpreter lacks. In
    the wide type (f64) for f32 ops, so the quotient's error stays below an f32 ulp."""
    cat, x = in_wide_type(em, op, out, args[0])
    v = em.assign(f"tl.sin({x}) / tl.cos({x})", cat)
    return em.convert(v, out)


INF = 'float("inf")'


def log1p_of(em, x: str, cat: Compute):
    """log(u) * x / (u - 1) with u = 1 + x (Goldberg): the rounding of u cancels, so small x
    keep full precision without libdevice. `x`: a tensor's text in `cat`."""
    u = em.assign(f"1.0 + {x}", cat).text
    special = any_of(f"{u} == 1.0", f"{u} == {INF}")
    return em.assign(f"tl.where({special}, {x}, tl.log({u}) * ({x} / ({u} - 1.0)))", cat)


def expm1_of(em, x: str, cat: Compute):
    """(u - 1) * x / log(u) with u = exp(x) (Kahan): exact enough for small x. `x`: a
    tensor's text in `cat`."""
    u = em.assign(f"tl.exp({x})", cat).text
    saturated = any_of(f"{u} - 1.0 == -1.0", f"{u} == {INF}")
    return em.assign(f"tl.where({u} == 1.0, {x}, tl.where({saturated}, "
                     f"{u} - 1.0, ({u} - 1.0) * ({x} / tl.log({u}))))", cat)


def _render_log1p(em, op, args, out):
    """f32 ops compute it in f64."""
    cat, x = in_wide_type(em, op, out, args[0])
    return em.convert(log1p_of(em, x, cat), out)


def _render_expm1(em, op, args, out):
    """f32 ops compute it in f64."""
    cat, x = in_wide_type(em, op, out, args[0])
    return em.convert(expm1_of(em, x, cat), out)


def tanh_of(em, x, approximate: bool = False):
    """tanh(x) = sign(x) * (1 - e) / (1 + e), e = exp(-2|x|): no overflow for any x. With
    `approximate` (an op rounded to bf16: `is_rounded_to_bf16`), the hardware's
    tanh.approx.f32 on a GPU (the `tanh` helper: relative error about 2^-11)."""
    if approximate and x.cat is Compute.F32:
        em.helpers.add("tanh")
        return em.assign(f"tanh_approx({x.text}, INTERPRETER)", x.cat)
    e = em.assign(f"tl.exp(-2.0 * tl.abs({x.text}))", x.cat)
    return em.assign(f"tl.where({x.text} < 0, -1.0, 1.0) * (1.0 - {e.text}) / (1.0 + {e.text})",
                     x.cat)


def _render_gelu(em, op, args, out):
    x = em.tensor(args[0]).text
    if op.attr("approximate") == "tanh":
        inner = em.assign(f"0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})", out)
        tanh = tanh_of(em, inner, is_rounded_to_bf16(op, out))
        return em.assign(f"0.5 * {x} * (1.0 + {tanh.text})", out)
    return em.assign(f"0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))", out)


def _render_relu(em, op, args, out):
    x = em.tensor(args[0]).text
    return em.assign(f"tl.where({x} < 0, {em.literal(0, out).text}, {x})", out)


def _render_cast(em, op, args, out):
    """A cast to f16/bf16/f8 rounds there, because the user asked for it; the value then
    computes in f32 again. A cast to an integer wraps into it there, even where the result
    computes wider (a weak one, in i64)."""
    (x,) = args
    if op.dtype.is_float and op.dtype.itemsize < 4:
        v = em.tensor(em.convert(x, Compute.F32))
        v = em.assign(em.widen(em.narrow(v.text, op.dtype), op.dtype), Compute.F32)
        return em.convert(v, out)
    if op.dtype.is_int:
        return em.convert(em.convert(x, compute_type(op.dtype)), out)
    return em.convert(x, out)


def _render_round(em, op, args, out):
    """Half to even, from exact steps: x - floor(x) is exact, and so is the parity test."""
    (x,) = args
    if not out.is_float:
        return x
    x = em.tensor(x).text
    f = em.assign(f"tl.floor({x})", out).text
    d = em.assign(f"{x} - {f}", out).text
    odd = em.assign(f"{f} - 2.0 * tl.floor({f} * 0.5)", out).text
    return em.assign(f"tl.where({d} > 0.5, {f} + 1.0, tl.where({d} == 0.5, {f} + {odd}, "
                     f"tl.where({x} == {x}, {f}, {x})))", out)


def _render_sign(em, op, args, out):
    """1, -1 or 0 (NaN gives 0, as in torch); bools are their own sign."""
    (x,) = args
    if out is Compute.BOOL:
        return x
    x = em.tensor(x).text
    one, zero = em.literal(1, out).text, em.literal(0, out).text
    return em.assign(f"tl.where({x} > {zero}, {one}, {zero}) - tl.where({x} < {zero}, {one}, {zero})",
                     out)


def _render_not(em, op, args, out):
    (x,) = args
    x = em.tensor(x).text
    if out is Compute.BOOL:
        return em.assign(f"{x} == 0", out)
    # u8's complement as an xor with 255: the same instruction, and Triton's interpreter
    # before 3.9 computes `~` on u8 as an xor with -1, which numpy refuses
    return em.assign(f"{x} ^ 255" if out is Compute.U8 else f"~{x}", out)


# --- binary ops (tiledsl/ops/binary.py) ----------------------------------------------------

def _render_true_div(em, op, args, out):
    """IEEE division, except that a divisor which is one value for the whole program (a
    by-value argument, a literal, or their products) becomes a product with its reciprocal,
    computed once: what eager torch does on a GPU for a scalar divisor ("may lose one bit of
    precision", `div_true_kernel_cuda`), so within the oracle, and one multiply an element
    instead of a division (Gemma-2's `s / cap`; a softmax's temperature). The reciprocal is
    correctly rounded for f32 ops, Triton's fast one for the others (rounded to 16 bits)."""
    a, b = args
    if out is Compute.F32 and (b.uniform or b.literal) and op.type.rank > 0:
        return em.assign(f"{em.tensor(a).text} * {em.reciprocal(b, is_precise(op, out)).text}", out)
    return _DIVIDE(em, op, args, out)


_DIVIDE = binary("{a} / {b}", "tl.div_rn({a}, {b})")


def _render_division(remainder: bool):
    """Floor semantics (Python's, torch's) from Triton's truncating `%` (C's fmod)."""
    def render(em, op, args, out):
        if out.is_float:
            return _float_division(em, args, out, remainder)
        if out in NARROW:  # in i32, where a - r cannot wrap; the result fits the narrow type
            wide = [em.convert(x, Compute.I32) for x in args]
            return em.convert(_int_division_render(em, wide, Compute.I32, remainder), out)
        return _int_division_render(em, args, out, remainder)

    return render


def _int_division_render(em, args, out, remainder):
    a, b = args
    a = em.tensor(a).text
    if b.literal and b.value not in (0, -1):
        # a literal divisor (`i // 2`, `j % w`): one fix-up of the remainder's sign
        fix = "<" if b.value > 0 else ">"
        r = em.assign(f"{a} % {b.text}", out).text
        r = em.assign(f"tl.where({r} {fix} 0, {r} + {b.text}, {r})", out).text
        return em.assign(r if remainder else f"({a} - {r}) // {b.text}", out)
    b = em.tensor(b).text
    # 0 and -1 divide as 1 (x // 0 is 0; INT_MIN // -1 wraps to INT_MIN, as in torch)
    zero_or_minus_one = any_of(f"{b} == 0", f"{b} == -1")
    safe = em.assign(f"tl.where({zero_or_minus_one}, 1, {b})", out).text
    r = em.assign(f"{a} % {safe}", out).text
    cross = all_of(f"{r} != 0", f"({r} < 0) != ({safe} < 0)")
    r = em.assign(f"tl.where({cross}, {r} + {safe}, {r})", out).text
    if remainder:
        return em.assign(f"tl.where({zero_or_minus_one}, 0, {r})", out)
    q = em.assign(f"({a} - {r}) // {safe}", out).text
    return em.assign(f"tl.where({b} == 0, 0, tl.where({b} == -1, 0 - {a}, {q}))", out)


def _float_division(em, args, out, remainder):
    """torch's floor division and remainder of floats: from fmod, with the quotient rounded
    to the nearest integer when fmod's rounding left it just below one."""
    a, b = (em.tensor(x).text for x in args)
    m = em.assign(f"{a} % {b}", out).text
    cross = all_of(f"{m} != 0", f"({b} < 0) != ({m} < 0)")
    if remainder:
        return em.assign(f"tl.where({cross}, {m} + {b}, {m})", out)
    div = "tl.div_rn({0}, {1})" if out is Compute.F32 else "{0} / {1}"
    d = em.assign(div.format(f"{a} - {m}", b), out).text
    d = em.assign(f"tl.where({cross}, {d} - 1.0, {d})", out).text
    f = em.assign(f"tl.floor({d})", out).text
    f = em.assign(f"tl.where({d} - {f} > 0.5, {f} + 1.0, {f})", out).text
    return em.assign(f"tl.where({b} == 0, {div.format(a, b)}, {f})", out)


# x ** literal: the forms torch uses for these exponents
_LITERAL_POWERS = {0: "{x} * 0 + 1", 1: "{x}", 2: "{x} * {x}", 3: "{x} * {x} * {x}"}


_RECIPROCALS = {-0.5: "{sqrt}", -1: "{x}", -2: "{x} * {x}"}


def _render_pow(em, op, args, out):
    a, b = args
    if b.literal and b.value in _LITERAL_POWERS and (out.is_float or b.value >= 0):
        x = em.tensor(a).text
        if b.value == 0 and out.is_float:
            return em.assign(f"tl.zeros_like({x}) + 1.0", out)  # NaN ** 0 is 1
        return em.assign(_LITERAL_POWERS[b.value].format(x=x), out)
    if not out.is_float:
        return _int_power(em, em.tensor(a).text, em.tensor(b).text, out)
    if b.literal and (b.value == 0.5 or b.value in _RECIPROCALS):
        x = em.tensor(a).text
        precise = is_precise(op, out)
        sqrt = f"tl.sqrt_rn({x})" if precise else f"tl.sqrt({x})"
        if b.value == 0.5:
            return em.assign(sqrt, out)
        den = em.assign(_RECIPROCALS[b.value].format(x=x, sqrt=sqrt), out).text
        return em.assign(f"tl.div_rn(tl.full([], 1.0, tl.float32), {den})" if precise
                         else f"1.0 / {den}", out)
    return _float_power(em, op, a, b, out)


def _int_power(em, a, b, out):
    """Square and multiply over the exponent's bits (wrapping like torch's integers)."""
    r, base, e = em.fresh(), em.fresh(), em.fresh()
    em.code(f"{r} = {a} * 0 + {b} * 0 + 1")
    em.code(f"{base} = {a} + {b} * 0")
    em.code(f"{e} = {b} + {a} * 0")
    bits = 63 if out is Compute.I64 else 31
    em.code(f"for {em.fresh('k')} in tl.static_range({bits}):")
    with em.code.indent():
        em.code(f"{r} = tl.where(({e} & 1) != 0, {r} * {base}, {r})")
        em.code(f"{base} = {base} * {base}")
        em.code(f"{e} = {e} >> 1")
    negative = f"tl.where({a} == 1, 1, tl.where({a} == -1, 1 - 2 * ({b} & 1), 0))"
    return em.assign(f"tl.where({b} < 0, {negative}, {r})", out)


def _float_power(em, op, a, b, out):
    """exp(b * log|a|) with C's rules for signs, zeros, ones and infinities; f32 ops
    compute it in f64 (its error then stays below an f32 ulp)."""
    cat, a = in_wide_type(em, op, out, a)
    b = in_wide_type(em, op, out, b)[1]
    ax = em.assign(f"tl.abs({a})", cat).text
    r = em.assign(f"tl.exp({b} * tl.log({ax}))", cat).text
    whole = em.assign(f"{b} == tl.floor({b})", Compute.BOOL).text
    odd = em.assign(all_of(whole, f"{b} - 2.0 * tl.floor({b} * 0.5) == 1.0"), Compute.BOOL).text
    negative = any_of(f"{a} < 0", all_of(f"{a} == 0", f"1.0 / {a} < 0"))
    r = em.assign(f"tl.where({negative}, tl.where({whole}, tl.where({odd}, -{r}, {r}), "
                  f"tl.where({a} == -float(\"inf\"), {r}, float(\"nan\"))), {r})", cat).text
    one = any_of(f"{b} == 0", f"{a} == 1", all_of(f"{ax} == 1", f"tl.abs({b}) == float(\"inf\")"))
    return em.convert(em.assign(f"tl.where({one}, 1.0, {r})", cat), out)


def _logic(function: str, bitwise: str):
    """On bools a select: Triton's interpreter cannot `|` a 0-d comparison result (its value
    is a NumPy scalar); on a GPU the select compiles to the same predicate logic. On i32
    bitwise."""
    on_ints = binary(bitwise)

    def render(em, op, args, out):
        if out is Compute.BOOL:
            a, b = (em.tensor(x) for x in args)
            pick = f"{b.text}, False" if function == "and" else f"True, {b.text}"
            return em.assign(f"tl.where({a.text}, {pick})", out)
        return on_ints(em, op, args, out)

    return render


# on bools a != b (the exclusive or); on integers bitwise, in the promoted type
def _render_xor(em, op, args, out):
    a, b = (em.tensor(x).text for x in args)
    return em.assign(f"{a} != {b}" if out is Compute.BOOL else f"{a} ^ {b}", out)


def _render_where(em, op, args, out):
    c, a, b = args
    return em.assign(f"tl.where({c.text}, {a.text}, {b.text})", out)


def _render_clamp(em, op, args, out):
    """min(max(x, lo), hi) with NaN from any operand, as torch.clamp."""
    x, lo, hi = (em.tensor(v).text for v in args)
    nan = NAN_ALL if out.is_float else ""
    return em.assign(f"tl.minimum(tl.maximum({x}, {lo}{nan}), {hi}{nan})", out)


# --- activations (tiledsl/ops/activations.py) ----------------------------------------------

def _lit(em, value: float, cat) -> str:
    return em.literal(value, cat).text


def _render_softplus(em, op, args, out):
    """torch's: x where x * beta > threshold, else log1p(exp(x * beta)) / beta."""
    cat, x = in_wide_type(em, op, out, args[0])
    beta, threshold = _lit(em, op.attr("beta"), cat), _lit(em, op.attr("threshold"), cat)
    bx = em.assign(f"{x} * {beta}", cat).text
    soft = log1p_of(em, em.assign(f"tl.exp({bx})", cat).text, cat).text
    return em.convert(em.assign(f"tl.where({bx} > {threshold}, {x}, {soft} / {beta})", cat), out)


def _render_logsigmoid(em, op, args, out):
    """min(x, 0) - log1p(exp(-|x|)): exp never overflows (NaN stays NaN)."""
    cat, x = in_wide_type(em, op, out, args[0])
    soft = log1p_of(em, em.assign(f"tl.exp(-tl.abs({x}))", cat).text, cat).text
    return em.convert(em.assign(f"tl.where({x} < 0, {x}, 0.0) - {soft}", cat), out)


def _render_mish(em, op, args, out):
    """x * tanh(softplus(x)); softplus is x past 20, where tanh of either is 1."""
    cat, x = in_wide_type(em, op, out, args[0])
    soft = log1p_of(em, em.assign(f"tl.exp({x})", cat).text, cat).text
    soft = em.assign(f"tl.where({x} > 20.0, {x}, {soft})", cat)
    return em.convert(em.assign(f"{x} * {tanh_of(em, soft).text}", cat), out)


def _elu_render(alpha, scale: float, input_scale):
    """`alpha`, `input_scale`: the constants from the op's attributes."""

    def render(em, op, args, out):
        cat, x = in_wide_type(em, op, out, args[0])
        a, s = alpha(op), input_scale(op)
        inner = x if s == 1.0 else em.assign(f"{x} * {_lit(em, s, cat)}", cat).text
        neg = expm1_of(em, inner, cat).text
        pos = x if scale == 1.0 else f"{x} * {_lit(em, scale, cat)}"
        return em.convert(em.assign(
            f"tl.where({x} > 0, {pos}, {neg} * {_lit(em, a * scale, cat)})", cat), out)

    return render


def _render_leaky_relu(em, op, args, out):
    x = em.tensor(args[0]).text
    return em.assign(f"tl.where({x} > 0, {x}, {x} * {_lit(em, op.attr('slope'), out)})", out)


def _render_hardtanh(em, op, args, out):
    """A clamp that keeps NaN."""
    x = em.tensor(args[0]).text
    lo, hi = _lit(em, op.attr("min_val"), out), _lit(em, op.attr("max_val"), out)
    return em.assign(f"tl.where({x} < {lo}, {lo}, tl.where({x} > {hi}, {hi}, {x}))", out)


def _relu6_of(em, x: str, out) -> str:
    """min(max(x + 3, 0), 6), NaN kept."""
    v = em.assign(f"{x} + 3.0", out).text
    return em.assign(f"tl.where({v} < 0.0, 0.0, tl.where({v} > 6.0, 6.0, {v}))", out).text


def _render_hardsigmoid(em, op, args, out):
    return em.assign(f"{_relu6_of(em, em.tensor(args[0]).text, out)} / 6.0", out)


def _render_hardswish(em, op, args, out):
    x = em.tensor(args[0]).text
    return em.assign(f"{x} * {_relu6_of(em, x, out)} / 6.0", out)


def _render_softsign(em, op, args, out):
    x = em.tensor(args[0]).text
    return em.assign(f"{x} / (1.0 + tl.abs({x}))", out)


# --- random numbers (tiledsl/ops/random.py) ------------------------------------------------

def _render_random(em, op, args, out):
    position, seed = (em.tensor(a).text for a in args)
    em.helpers.add("random")
    function = "uniform_at" if op.attr("dist") == "uniform" else "normal_at"
    return em.assign(f"{function}({seed}, {position}.to(tl.int64))", Compute.F32)


def _rounding(text: str) -> Render:
    """floor/ceil: integers pass through unchanged (as in torch)."""
    def render(em, op, args, out):
        (x,) = args
        if not out.is_float:
            return x
        return em.assign(text.format(x=em.tensor(x).text), out)

    return render


def _predicate(text: str) -> Render:
    """isnan/isinf of a float; an integer is neither (`x != x` is False)."""
    def render(em, op, args, out):
        (x,) = args
        x = em.tensor(x).text
        return em.assign(text.format(x=x) if args[0].cat.is_float else f"{x} != {x}", Compute.BOOL)

    return render


def _alpha(op) -> float:
    return op.attr("alpha")


def _one(op) -> float:
    return 1.0


# --- the tables --------------------------------------------------------------------------

RENDERINGS: dict[str, Render] = {
    # unary
    "exp": _helper("exp", "exp", "tl.exp({x})"),
    "exp2": _helper("exp2", "exp", "tl.exp2({x})"),
    "log": unary("tl.log({x})"),
    "log2": unary("tl.log2({x})"),
    "sqrt": unary("tl.sqrt_rn({x})", wide="tl.sqrt({x})"),  # sqrt_rn is f32 only; f64 sqrt is IEEE
    "rsqrt": unary("tl.rsqrt({x})", "tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn({x}))"),
    "sigmoid": unary("tl.sigmoid({x})"),
    "silu": unary("{x} * tl.sigmoid({x})"),
    "erf": unary("tl.erf({x})"),
    "sin": _helper("sin", "trig", "tl.sin({x})"),
    "cos": _helper("cos", "trig", "tl.cos({x})"),
    "tan": _render_tan,
    "log1p": _render_log1p,
    "expm1": _render_expm1,
    "tanh": lambda em, op, args, out: tanh_of(em, em.tensor(args[0]), is_rounded_to_bf16(op, out)),
    "gelu": _render_gelu,
    "neg": unary("-{x}"),
    "abs": unary("tl.abs({x})"),
    "relu": _render_relu,
    "cast": _render_cast,
    "floor": _rounding("tl.floor({x})"),
    "ceil": _rounding("tl.ceil({x})"),
    "round": _render_round,
    "sign": _render_sign,
    "isnan": _predicate("{x} != {x}"),
    "isinf": _predicate('tl.abs({x}) == float("inf")'),
    "not": _render_not,
    # binary
    "add": binary("{a} + {b}"),
    "sub": binary("{a} - {b}"),
    "mul": binary("{a} * {b}"),
    "div": _render_true_div,
    "floordiv": _render_division(False),
    "mod": _render_division(True),
    "pow": _render_pow,
    "and": _logic("and", "{a} & {b}"),
    "or": _logic("or", "{a} | {b}"),
    "xor": _render_xor,
    "shl": binary("{a} << {b}"),
    "shr": binary("{a} >> {b}"),
    **{kind: compare(symbol) for kind, symbol in (("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">="),
                                                   ("eq", "=="), ("ne", "!="))},
    "maximum": nan_propagating("maximum"),
    "minimum": nan_propagating("minimum"),
    "where": _render_where,
    "clamp": _render_clamp,
    # activations
    "softplus": _render_softplus,
    "logsigmoid": _render_logsigmoid,
    "mish": _render_mish,
    "elu": _elu_render(_alpha, 1.0, _one),
    "selu": _elu_render(lambda op: SELU_ALPHA, SELU_SCALE, _one),
    "celu": _elu_render(_alpha, 1.0, lambda op: 1.0 / op.attr("alpha")),
    "leaky_relu": _render_leaky_relu,
    "hardtanh": _render_hardtanh,
    "hardsigmoid": _render_hardsigmoid,
    "hardswish": _render_hardswish,
    "softsign": _render_softsign,
    # structure, random
    "take": take,
    "expand": lambda em, op, args, out: args[0],  # read at each element's index, broadcast
    "random": _render_random,
}


@dataclass(frozen=True)
class Reducing:
    """A reduction as the Triton templates compute it: its declaration (`ops.Reduction`,
    whose fields read through) and its Triton source. `combine`: two partials {a} and {b}
    merged elementwise ({nan}: NaN_ALL where partials keep NaN); `collapse`: a tile {x}
    reduced along its {axis}; `helper`: a function of expr.HELPERS that `collapse` calls
    (Triton has no tl.prod); `finalize`: the result from the merged {total} and the axis'
    {length}. None for an `online` one, whose partials are pairs (online.py)."""

    declared: Reduction
    combine: str | None
    collapse: str | None
    helper: str | None = None
    finalize: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.declared, name)


@dataclass(frozen=True)
class Scanning:
    """A scan as the rows template computes it: its declaration (`ops.Scan`, whose fields read
    through) and its Triton source. `combine`: per partial, its combination from the left
    partials {a0} {a1} ... and the right ones {b0} {b1} ...; `lift`: per partial, an
    element's from the operands {x0} {x1} ... (None: the operands); `finalize`: the result
    from the partials {p0} {p1} ...; `builtin`: Triton's own scan with this combine
    (tl.cumsum), called instead of associative_scan; `collapse`: a chunk's combination along
    the row from its tile {x}, when not its last partial."""

    declared: Scan
    combine: tuple[str, ...]
    lift: tuple[str, ...] | None = None
    finalize: str = "{p0}"
    builtin: str | None = None
    collapse: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.declared, name)


_SUM = "tl.sum({x}, axis={axis})"
_ADD = "{a} + {b}"
_MAX = ("tl.maximum({a}, {b}{nan})", "tl.max({x}, axis={axis})")
_MIN = ("tl.minimum({a}, {b}{nan})", "tl.min({x}, axis={axis})")
_REDUCTION_TEXT: dict[str, tuple] = {
    "sum": (_ADD, _SUM),
    "mean": (_ADD, _SUM, None, "{total} / {length}"),
    "max": _MAX, "argmax": _MAX,
    "min": _MIN, "argmin": _MIN,
    "prod": ("{a} * {b}", "tl.reduce({x}, {axis}, mul_combine)", "mul_combine"),
    "logsumexp": (None, None),
}
REDUCTIONS: dict[str, Reducing] = {kind: Reducing(ops.OPS[kind].reduction, *text)
                                   for kind, text in _REDUCTION_TEXT.items()}

# logcumsumexp's partials are a running max m and the sum of exp(x - m), as online
# logsumexp's (log(1 + e) in one partial loses e's low bits at every step: 9e-5 over 4k
# elements); a rescale is 1 where the maxima are equal (two -inf or two inf)
_M = "tl.maximum({a0}, {b0}, propagate_nan=tl.PropagateNan.ALL)"
_LOG_ADD_EXP = (_M, f"tl.where({{a0}} == {_M}, 1.0, tl.exp({{a0}} - {_M})) * {{a1}} + "
                    f"tl.where({{b0}} == {_M}, 1.0, tl.exp({{b0}} - {_M})) * {{b1}}")
_SCAN_TEXT: dict[str, dict[str, Any]] = {
    "cumsum": {"combine": ("{a0} + {b0}",), "builtin": "tl.cumsum", "collapse": "tl.sum({x}, axis=1)"},
    "cumprod": {"combine": ("{a0} * {b0}",), "builtin": "tl.cumprod"},
    "cummax": {"combine": (_M,)},
    "cummin": {"combine": ("tl.minimum({a0}, {b0}, propagate_nan=tl.PropagateNan.ALL)",)},
    "logcumsumexp": {"combine": _LOG_ADD_EXP, "lift": ("{x0}", "1.0"), "finalize": "{p0} + tl.log({p1})"},
    # linear_scan(a, b): the partials are (the product of a, h) over a stretch of the row
    "linear_scan": {"combine": ("{a0} * {b0}", "{b0} * {a1} + {b1}"), "finalize": "{p1}"},
}
SCANS: dict[str, Scanning] = {kind: Scanning(ops.OPS[kind].scan, **text) for kind, text in _SCAN_TEXT.items()}


def missing() -> list[str]:
    """The ops this backend cannot compute: an elementwise op with no rendering, a reduction
    or a scan with no Triton text (the other categories are templates of their own)."""
    out = []
    for kind, d in ops.OPS.items():
        if d.category is ops.Category.ELEMENTWISE and d.arity != 0 and kind not in RENDERINGS:
            out.append(kind)
        elif d.reduction is not None and kind not in REDUCTIONS:
            out.append(kind)
        elif d.scan is not None and kind not in SCANS:
            out.append(kind)
    return out
