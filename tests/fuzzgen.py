"""Random well-typed tiledsl programs for differential testing.

A program has a few statements over parameters of mixed shapes and dtypes,
then returns one to three of its values. Expressions mix elementwise builtins,
operators, comparisons and `where`, reductions, softmax, logsumexp, matmul (A operands of
batch rank 0 to 2, so ranks 2 to 4, against a 2-D or a batched weight, in the shapes model
code writes: attention, a dual GEMM, a row-normalised A, a projection), indexing
(slices, concat, gather, scatter_add, index_add, scatter and index_copy at argsort's
positions, computed indices, flip), reshape, scans (cumsum, cumprod, cummax,
cummin, logcumsumexp, linear_scan, reversed),
casts and transposes, and integer and bitwise arithmetic on an i32 tensor;
leaves include constants, dims, scalar parameters, `index` values and
scalar-only subexpressions (`rsqrt(N) * s`), so constants shared between
kernels, 0-d values and multi-output mixes of row and pointwise kernels all
come up. Shapes are tracked while generating, so nearly every program is
valid; whatever tiledsl rejects must be a located error, never an internal
one. Values are kept where the functions are well conditioned: log, sqrt,
rsqrt and division get arguments bounded away from 0. (The oracle compares
worst-case errors with eager's; next to a singularity, such as sqrt at 0,
that comparison measures luck: seen with an attention output of 1e-5 under
a sqrt, where our 4x smaller max error still lost to eager's at one element.)

    program = generate(random.Random(seed))
    outcome = run(program)        # Outcome: pass, rejected, overflow, unstable or fail
    outcome = run_grads(program)  # the same for gradients: pass, nograd, overflow, unstable or fail

`scripts/fuzz_programs.py` runs many; `tests/test_fuzz_programs.py` a bounded number.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

Shape = tuple[str, ...]

UNARY = ["exp", "tanh", "sigmoid", "relu", "silu", "erf", "gelu", "abs", "-", "sin", "cos"]
# floor/ceil/round/sign and float // and % are discontinuous: a last-bit difference from the
# eager run could move a step, so the float fuzzer leaves them to the integer expressions
SAFE_UNARY = {"log": "log(abs({}) + 1.0)", "sqrt": "sqrt(abs({}) + 0.25)", "rsqrt": "rsqrt(abs({}) + 0.5)",
              "log2": "log2(abs({}) + 0.5)", "exp2": "exp2(tanh({}))", "div": "({} / (abs({}) + 1.0))",
              "log1p": "log1p(abs({}))", "expm1": "expm1(tanh({}))", "pow": "((abs({}) + 0.5) ** 1.5)",
              "square": "({} ** 2)", "clamp": "clamp({}, -1.0, 1.5)", "tan": "tan(tanh({}))"}
# activations, drawn from a stream of their own in place of a UNARY op now and then
ACTIVATIONS = ["softplus({})", "softplus({}, beta=2.0, threshold=5.0)", "logsigmoid({})", "elu({})",
               "selu({})", "celu({}, alpha=1.5)", "leaky_relu({}, slope=0.1)", "hardtanh({})",
               "hardtanh({}, min_val=-2.0, max_val=0.5)", "hardsigmoid({})", "hardswish({})", "mish({})",
               "softsign({})"]
BINARY = ["+", "-", "*", "maximum", "minimum"]
REDUCE = ["sum", "max", "min", "mean", "logsumexp", "prod"]
# prod of factors near 1, so a product along a row stays finite in f16 (argmax and argmin
# are left out: a near tie the rounding of f32 can flip would make a position differ)
REDUCE_OPERAND = {"prod": "(1.0 + 0.1 * tanh({}))"}
CONSTANTS = ["0.5", "2", "1.0", "-3", "1e-3", "0.0"]
SCALAR_EXPRS = ["rsqrt(N)", "(s * 2.0)", "(N - 1)", "(s + N)", "(1.0 / N)", "log2(8.0)", "sqrt(2.0)"]
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Value:
    text: str
    shape: Shape
    kind: str = "float"  # float | bool


# batched activations a matmul's A operand may draw (`Generator.operand`): ranks 3 and 4
BATCHED = (Value("u", ("H", "M", "N")), Value("q", ("B", "H", "M", "N")))


@dataclass(frozen=True)
class Program:
    source: str
    dtype: str
    m: int
    n: int
    seed: int
    b: int = 2
    h: int = 3

    def args(self) -> dict:
        g = torch.Generator().manual_seed(self.seed)
        dt = DTYPES[self.dtype]
        m, n, b, h = self.m, self.n, self.b, self.h
        return {
            "x": torch.randn(m, n, generator=g).to(dt), "y": torch.randn(n, generator=g).to(dt),
            "z": torch.randn(m, 1, generator=g).to(dt), "w": (torch.randn(n, n, generator=g) / n**0.5).to(dt),
            "mask": torch.rand(m, n, generator=g) > 0.4, "s": 0.75, "flag": bool(self.seed & 1),
            "k": torch.randint(-50, 50, (m, n), generator=g, dtype=torch.int32),
            "q": torch.randn(b, h, m, n, generator=g).to(dt), "u": torch.randn(h, m, n, generator=g).to(dt),
            "wb": (torch.randn(h, n, n, generator=g) / n**0.5).to(dt),
        }


PARAMS = ("x: {dt}[M, N], y: {dt}[N], z: {dt}[M, 1], w: {dt}[N, N], mask: bool[M, N], s: f32, flag: bool, "
          "k: i32[M, N], q: {dt}[B, H, M, N], u: {dt}[H, M, N], wb: {dt}[H, N, N]")
INT_EXPRS = ["(k & 7)", "((k & 12) | 1)", "(k - 3)", "(k * 2)", "maximum(k, 0)", "abs(k)", "(k // 3)",
             "(k % -5)", "(k // (k & 7))", "(k ** 2)", "clamp(k, -9, 9)", "sign(k)", "(~k & 15)"]
# small integers and bits: k in a narrow dtype, an operator, an operand (shifts by 0 .. width - 1)
SMALL_INTS = {"i8": 8, "u8": 8, "i16": 16}
SMALL_INT_OPS = ["^", "&", "|", "<<", ">>", "+", "*", "//"]


def broadcast(a: Shape, b: Shape) -> Shape | None:
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        da = a[-i] if i <= len(a) else "1"
        db = b[-i] if i <= len(b) else "1"
        if da == db or db == "1":
            out.append(da)
        elif da == "1":
            out.append(db)
        else:
            return None
    return tuple(reversed(out))


class Generator:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        # reductions over several axes draw from a stream of their own, seeded from the main
        # one's state without advancing it: every other choice stays what it was (the salt
        # keeps the programs test_fuzz_programs.py pins by seed as they were)
        self.axes_rng = random.Random("axes1:" + str(rng.getstate()[1][:8]))
        # and so do the index maps an attention's keys and values are read through
        self.maps_rng = random.Random("maps1:" + str(rng.getstate()[1][:8]))
        # and so do the activations that stand in for a UNARY op (salt 8: the first that keeps
        # the pinned programs)
        self.acts_rng = random.Random("acts8:" + str(rng.getstate()[1][:8]))
        # and so do the scan a cumsum's place draws, its direction, and flip
        self.scans_rng = random.Random("scans1:" + str(rng.getstate()[1][:8]))
        # and so do the scatter-adds that now and then stand in for a gather
        self.scatters_rng = random.Random("scatters1:" + str(rng.getstate()[1][:8]))
        # and so do the small-integer expressions that stand in for an INT_EXPRS one
        self.ints_rng = random.Random("ints1:" + str(rng.getstate()[1][:8]))
        # and so do the pads, fills, sorts and random numbers that now and then stand in for
        # an indexing
        self.fills_rng = random.Random("fills1:" + str(rng.getstate()[1][:8]))
        # and so do the reductions across rows (along a dim of a literal size) that now and
        # then wrap a reduction's operand (salt 2: the first that keeps the pinned programs)
        self.across_rng = random.Random("across2:" + str(rng.getstate()[1][:8]))
        # and so do the layouts of computed values (a reshape of a transposed intermediate)
        # and the weights gathered at index expressions that stand in for w (salt 3: the
        # first that keeps the pinned programs)
        self.layouts_rng = random.Random("layouts3:" + str(rng.getstate()[1][:8]))
        # and so do the out-of-place writes (scatter, index_copy at argsort's positions, all
        # or half of them) that now and then stand in for a gather or a flip (salt 3: the
        # first that keeps the pinned programs)
        self.writes_rng = random.Random("writes3:" + str(rng.getstate()[1][:8]))
        # and so do the subscript writes (`t[..., :1] = s`) that now and then follow a statement
        # (salt 2: the first that keeps the pinned programs)
        self.items_rng = random.Random("items2:" + str(rng.getstate()[1][:8]))
        # and so do the sampling warpers that now and then stand in for an out-of-place write
        # (a mask computed along the sorted row, scattered back to the row's order and filling
        # it; salt 2: the first that keeps the pinned programs)
        self.sample_rng = random.Random("sample2:" + str(rng.getstate()[1][:8]))
        # and so do the values of the rows computed over a transposed smaller space that now
        # and then scale an indexed value (a broadcast join; salt 1 keeps the
        # pinned programs)
        self.joins_rng = random.Random("joins1:" + str(rng.getstate()[1][:8]))
        self.values: list[Value] = [
            Value("x", ("M", "N")), Value("y", ("N",)), Value("z", ("M", "1")), Value("s", ()),
            Value("mask", ("M", "N"), "bool"), Value("flag", (), "bool")]

    def across(self, a: Value) -> str:
        """Now and then, in place of `a`: a value of a's shape reduced over a literal dim of 3
        after a row op along one of a's dims (`sum(softmax(t, axis=0), axis=-1)` with t:
        [M, N, 3]), which joins the row program, reduced across its rows (Mamba's state)."""
        rng = self.across_rng
        if a.kind != "float" or rng.random() >= 0.12:
            return a.text
        t = f"concat({a.text}[..., None], tanh({a.text})[..., None], ({a.text} * 0.5)[..., None], axis=-1)"
        row = rng.choice(["softmax({}, axis={})", "cumsum(tanh({}), axis={})", "logsumexp({}, axis={}, "
                          "keepdims=true)", "max({}, axis={}, keepdims=true)"])
        op = rng.choice([k for k in REDUCE if k != "logsumexp"])
        inner = row.format(t, rng.randrange(len(a.shape)))
        return f"{op}({REDUCE_OPERAND.get(op, '{}').format(inner)}, axis=-1)"

    def leaf(self) -> Value:
        r = self.rng.random()
        if r < 0.15:
            return Value(self.rng.choice(CONSTANTS), ())
        if r < 0.25:
            return Value(self.rng.choice(SCALAR_EXPRS), ())
        if r < 0.3:
            a = self.rng.choice([v for v in self.values if v.kind == "float" and v.shape])
            axis = self.rng.randrange(len(a.shape))
            return Value(f"(index({a.text}, {axis}) * 0.01)", a.shape)
        if r < 0.35:  # integer arithmetic and bitwise ops on an i32 tensor, then a float
            expr = self.rng.choice(INT_EXPRS)
            if self.ints_rng.random() < 0.4:
                expr = self.small_int()
            return Value(f"(cast({expr}, f32) * 0.05)", ("M", "N"))
        floats = [v for v in self.values if v.kind == "float"]
        return self.rng.choice(floats)

    def small_int(self) -> str:
        """k in an i8, u8 or i16 (wrapping), an operator, and k again in a narrow dtype (the
        two promote like torch's: i8 with u8 gives i16), a hex mask or a shift in range."""
        rng = self.ints_rng
        dt = rng.choice(sorted(SMALL_INTS))
        op = rng.choice(SMALL_INT_OPS)
        a = f"cast(k, {dt})"
        if op in ("<<", ">>"):
            return f"({a} {op} {rng.randrange(SMALL_INTS[dt])})"
        if op == "//":
            return f"({a} // {rng.choice([3, -7, 16])})"
        b = rng.choice([f"cast(k * 3, {rng.choice(sorted(SMALL_INTS))})", "0xF", "0x5A", f"(~{a})"])
        return f"({a} {op} {b})"

    def cond(self, depth: int) -> Value:
        r = self.rng.random()
        bools = [v for v in self.values if v.kind == "bool"]
        if r < 0.3:
            b = self.rng.choice(bools)
            return Value(f"(~{b.text})", b.shape, "bool") if r < 0.1 else b
        if r < 0.35:
            return Value(f"({self.rng.choice(INT_EXPRS)} {self.rng.choice(['>', '==', '<='])} 3)", ("M", "N"),
                         "bool")
        if r < 0.4:
            a = self.rng.choice([v for v in self.values if v.kind == "float" and len(v.shape) == 2])
            if self.rng.random() < 0.5:
                return Value(f"causal({a.text})", a.shape, "bool")
            return Value(f"(index({a.text}, 0) + {self.rng.randint(-3, 3)} >= index({a.text}, 1))",
                         a.shape, "bool")
        a, b = self.expr(depth - 1), self.leaf()
        shape = broadcast(a.shape, b.shape)
        if shape is None:
            return self.rng.choice(bools)
        op = self.rng.choice(["<", "<=", ">", ">=", "!=", "=="])
        c = Value(f"({a.text} {op} {b.text})", shape, "bool")
        if self.rng.random() < 0.2:
            other = self.rng.choice(bools)
            s2 = broadcast(c.shape, other.shape)
            if s2 is not None:
                return Value(f"({c.text} {self.rng.choice('&|')} {other.text})", s2, "bool")
        return c

    def expr(self, depth: int) -> Value:
        if depth <= 0 or self.rng.random() < 0.25:
            return self.leaf()
        r = self.rng.random()
        if r < 0.22:
            a = self.expr(depth - 1)
            op = self.rng.choice(UNARY)
            if self.acts_rng.random() < 0.25:
                return Value(self.acts_rng.choice(ACTIVATIONS).format(a.text), a.shape)
            return Value(f"-({a.text})" if op == "-" else f"{op}({a.text})", a.shape)
        if r < 0.32:
            a = self.expr(depth - 1)
            key = self.rng.choice(sorted(SAFE_UNARY))
            if key == "div":
                b = self.expr(depth - 1)
                shape = broadcast(a.shape, b.shape)
                return a if shape is None else Value(SAFE_UNARY[key].format(a.text, b.text), shape)
            return Value(SAFE_UNARY[key].format(a.text), a.shape)
        if r < 0.55:
            a, b = self.expr(depth - 1), self.expr(depth - 1)
            shape = broadcast(a.shape, b.shape)
            if shape is None:
                return a
            op = self.rng.choice(BINARY)
            text = f"{op}({a.text}, {b.text})" if op[0].isalpha() else f"({a.text} {op} {b.text})"
            return Value(text, shape)
        if r < 0.65:
            c, a, b = self.cond(depth - 1), self.expr(depth - 1), self.expr(depth - 1)
            if self.rng.random() < 0.3:
                b = Value("-inf", ())
            shape = broadcast(c.shape, a.shape)
            shape = shape and broadcast(shape, b.shape)
            return a if shape is None else Value(f"where({c.text}, {a.text}, {b.text})", shape)
        if r < 0.78:
            a = self.expr(depth - 1)
            if not a.shape:
                return a
            axis = self.rng.choice([-1, 0]) if len(a.shape) > 1 else -1
            keep = self.rng.random() < 0.5
            axes = {axis % len(a.shape)}
            if len(a.shape) > 1 and self.axes_rng.random() < 0.3:  # a tuple of axes, or all
                axis = self.axes_rng.choice(["(0, -1)", "None"])
                axes = {0, len(a.shape) - 1} if axis != "None" else set(range(len(a.shape)))
            out = tuple("1" if i in axes else d for i, d in enumerate(a.shape) if keep or i not in axes)
            op = self.rng.choice(REDUCE)
            x = REDUCE_OPERAND.get(op, "{}").format(self.across(a))
            return Value(f"{op}({x}, axis={axis}, keepdims={'true' if keep else 'false'})", out)
        if r < 0.85:
            a = self.expr(depth - 1)
            if not a.shape:
                return a
            axis = self.rng.choice([-1, 0]) if len(a.shape) > 1 else -1
            return Value(f"softmax({a.text}, axis={axis})", a.shape)
        if r < 0.9:
            return self.matmul(self.operand(self.expr(depth - 1)))
        if r < 0.95:
            return self.indexed(self.expr(depth - 1))
        if r < 0.97:
            a = self.expr(depth - 1)
            return Value(f"cast({a.text}, {self.rng.choice(['f16', 'bf16', 'f32'])})", a.shape)
        a = self.expr(depth - 1)
        if len(a.shape) != 2:
            return a
        return Value(f"transpose({a.text}, 0, 1)", (a.shape[1], a.shape[0]))

    def operand(self, a: Value) -> Value:
        """A matmul's A operand, [..., N] (x when `a` is not): half the time with batch dims
        joined in from a 3-D u: [H, M, N] or 4-D q: [B, H, M, N] activation, as model code
        multiplies them (`x: [B, H, S, D] @ w.T`), the activation alone or combined with `a`."""
        if len(a.shape) < 2 or a.shape[-1] != "N":
            a = self.values[0]  # x: [M, N]
        r = self.rng.random()
        if r < 0.5:
            return a
        batched = self.rng.choice(BATCHED)
        if r < 0.7:
            return batched
        shape = broadcast(a.shape, batched.shape)
        op = self.rng.choice(["+", "*"])
        return a if shape is None else Value(f"({a.text} {op} {batched.text})", shape)

    def weight(self, a: Value) -> tuple[str, Shape]:
        """A matmul's B operand for `a`, and the product's shape: the 2-D w (broadcast over
        any batch dims of `a`) or, when the batch dims allow, the batched wb: [H, N, N]."""
        batch = broadcast(a.shape[:-2], ("H",))
        if batch is not None and self.rng.random() < 0.3:
            return "wb", batch + a.shape[-2:]
        if self.layouts_rng.random() < 0.15:  # w's rows permuted and scaled at computed indices
            rows = f"(index(w, 0) * {self.layouts_rng.choice([1, 5, 7])} + 2) % N"
            gathered = f"(w[{rows}, index(w, 1)] * y[index(w, 0)])"
            if self.layouts_rng.random() < 0.5:  # as F.linear takes it: [out, in], transposed
                gathered = f"transpose(w[{rows}, index(w, 1)] * y[index(w, 1)], 0, 1)"
            return gathered, a.shape
        return "w", a.shape

    def matmul(self, a: Value) -> Value:
        """Matmul shapes of model code on A operand `a`: attention (with a mask, a sink), a
        two-matmul chain with no softmax (batched data on the right: a mask or a decay, maybe a
        normaliser), a dual GEMM, a row-normalised A, a plain projection."""
        b, shape = self.weight(a)
        r = self.rng.random()
        batched = b == "wb"
        if r < 0.4 or batched and r < 0.6:
            b = self.keys(b)
        if batched and r < 0.6:  # two products of data with no softmax (linear attention)
            s = f"({a.text} @ {b}.T)"
            c = self.cond(0)
            if broadcast(c.shape, shape) != shape:
                c = Value(f"causal({s})", shape, "bool")
            f = self.rng.choice([f"where({c.text}, {s}, 0.0)", f"({s} * where(causal({s}), 0.5, 0.0))",
                                 f"relu({s})"])
            if self.rng.random() < 0.3:  # normalised by a sum over the keys
                return Value(f"(({f} @ {b}) / (sum(abs({f}), axis=-1, keepdims=true) + 1.0))", shape)
            return Value(f"({f} @ {b})", shape)
        if r < 0.4:  # attention-shaped: softmax of scores, then @ w
            scores = Value(f"({a.text} @ {b}.T * {self.rng.choice(['0.125', 's', 'rsqrt(N)'])})", shape)
            if self.rng.random() < 0.5:
                scores = Value(f"where({self.cond(0).text}, {scores.text}, -inf)", shape)
            if self.rng.random() < 0.25:  # a sink logit per row in the denominator
                # (the max includes the sink, as gpt-oss writes it: a fully masked row is
                # then 0 in the written form too, not NaN)
                m = f"maximum(max({scores.text}, axis=-1, keepdims=true), z)"
                e = f"exp({scores.text} - {m})"
                return Value(f"(({e} / (sum({e}, axis=-1, keepdims=true) + exp(z - {m}))) @ {b})", shape)
            return Value(f"(softmax({scores.text}, axis=-1) @ {b})", shape)
        if r < 0.5:  # two products of the same A meeting in one epilogue (a dual GEMM)
            return Value(f"(silu({a.text} @ {b}) * ({a.text} @ {b}.T))", shape)
        if r < 0.6:  # a row-normalised A (a factor constant along K)
            norm = f"rsqrt(mean({a.text} * {a.text}, axis=-1, keepdims=true) + 1.0)"
            return Value(f"(({a.text} * {norm}) @ {b})", shape)
        return Value(f"({a.text} @ {b})", shape)

    def keys(self, b: str) -> str:
        """The keys and values of an attention or a chain, `b`, maybe read through an index
        map, as a paged cache or a shifted window is: a flip, a half rotation, a permutation
        computed from `index()`, or a gather through the i32 tensor k (along the keys)."""
        if self.maps_rng.random() >= 0.3:
            return b
        lead = "index(wb, 0), " if b == "wb" else ""
        row, col = ("index(wb, 1)", "index(wb, 2)") if b == "wb" else ("index(w, 0)", "index(w, 1)")
        colons = ":, " if b == "wb" else ""
        return self.maps_rng.choice([
            f"{b}[{lead}N - 1 - {row}, {col}]",
            f"concat({b}[{colons}N // 2:], {b}[{colons}:N // 2], axis={1 if b == 'wb' else 0})",
            f"{b}[{lead}({row} * 7 + 3) % N, {col}]",
            f"{b}[{lead}abs(k[0, :][:, None] + 0 * {row}) % N, {col}]",
        ])

    def indexed(self, a: Value) -> Value:
        """Indexing, views and scans of `a` (`_indexed`), or now and then (its own stream) a
        pad read back at a's shape, a fill, a sort or random numbers (`fill`)."""
        out = self._indexed(a)
        if len(a.shape) == 2 and a.kind == "float" and self.fills_rng.random() < 0.2:
            return self.fill(a)
        if out.shape == ("M", "N") and out.kind == "float" and self.joins_rng.random() < 0.15:
            return self.join(out)
        return out

    def join(self, a: Value) -> Value:
        """`a` ([M, N]) scaled by a value of its rows computed over the transposed [1, M]
        space of z and read back transposed (vLLM's merge of attention states reads its lse
        so): a row program over [M, N] computes it once a row."""
        rng = self.joins_rng
        zt = "transpose(z, 0, 1)"
        f = rng.choice([f"exp({zt} * 0.5) + 1.0", f"sigmoid({zt}) * tanh({zt} + 0.5)",
                        f"log(1.0 + exp({zt} - max({zt}, axis=-1, keepdims=true)))"])
        shift = rng.choice(["", f" + transpose({zt} * 0.25, 0, 1)"])
        return Value(f"({a.text} * transpose({f}, 0, 1){shift})", a.shape)

    def fill(self, a: Value) -> Value:
        """A value of a's 2-D shape: a shift (a pad and a slice), a fill, a sort, dropout or
        uniform noise at a literal seed."""
        rng, (m, n) = self.fills_rng, a.shape
        kind = rng.randrange(6)
        if kind == 0:
            return Value(f"pad({a.text}, (1, 0))[:, :{n}]", a.shape)
        if kind == 1:
            return Value(f"pad({a.text}, (2, 1), axis=0, value=0.5)[1:{m} + 1, :]", a.shape)
        if kind == 2:
            return Value(f"(full({a.text}, 0.25) * {a.text} + zeros({a.text}))", a.shape)
        if kind == 3:
            return Value(f"sort({a.text}, axis=-1, descending={rng.choice(['true', 'false'])})", a.shape)
        if kind == 4:
            return Value(f"dropout({a.text}, 0.25, {rng.randrange(100)})", a.shape)
        return Value(f"({a.text} + rand({a.text}, {rng.randrange(100)}))", a.shape)

    def _indexed(self, a: Value) -> Value:
        """Indexing, views and scans of `a`: a half rotation (concat of two slices), a
        gather or a flip through computed indices, a reshape, a cumsum."""
        if not a.shape:
            return a
        choice = self.rng.randrange(5)
        if choice in (1, 2, 3) and a.shape != ("M", "N"):
            a = self.values[0]  # x: [M, N]
        if choice == 0 and a.shape[-1] == "N":
            return Value(f"concat({a.text}[..., N // 2:], {a.text}[..., :N // 2], axis=-1)", a.shape)
        if choice == 1:
            kind = self.scatters_rng.randrange(4)
            if kind == 0 and a.kind == "float":
                return Value(f"scatter_add({a.text}, abs(k) % M, {a.text} * 0.5, 0)", a.shape)
            if kind == 1 and a.kind == "float":
                return Value(f"index_add({a.text}, 1, abs(k[0, :]) % N, {a.text})", a.shape)
            if a.kind == "float" and self.writes_rng.random() < 0.5:
                return Value(self.write(a), a.shape)
            return Value(f"gather({a.text}, abs(k) % N, axis=-1)", a.shape)
        if choice == 2:
            if a.kind == "float" and self.writes_rng.random() < 0.3:  # (draws from no other stream)
                return Value(self.write(a), a.shape)
            return Value(f"{a.text}[M - 1 - index({a.text}, 0), index({a.text}, 1)]", a.shape)
        if choice == 3:
            if self.layouts_rng.random() < 0.4:  # a computed value's transpose, flattened and viewed
                return Value(f"reshape(reshape(transpose(({a.text} + 0.5), 0, 1), [-1]), [N, M])", ("N", "M"))
            return Value(f"reshape(reshape({a.text}, [-1]), [N, M])", ("N", "M"))
        axis = self.rng.randrange(len(a.shape))
        return Value(self.scan(a, axis), a.shape)

    def write(self, a: Value) -> str:
        """An out-of-place write into `a` ([M, N]) at distinct positions, so that which write
        wins never matters: argsort's positions of k's columns (a permutation: the scatter
        reads no x), half of them (into a copy of a), the rows of an index_copy, or a gather at
        the permutation scattered back (the values themselves)."""
        rng, t = self.writes_rng, a.text
        if self.sample_rng.random() < 0.3:
            return self.warper(a)
        half = "(M + 1) // 2"
        return rng.choice([
            f"scatter({t}, argsort(k, axis=0), {t} * 0.5, 0)",
            f"scatter({t}, argsort(k, axis=0)[:{half}, :], tanh({t})[:{half}, :], 0)",
            f"index_copy({t}, 0, argsort(k[:, 0], axis=0)[:{half}], {t}[:{half}, :] * 0.5)",
            f"scatter({t}, argsort(k, axis=0, descending=true), gather({t}, argsort(k, axis=0, "
            "descending=true), axis=0), 0)"])

    def warper(self, a: Value) -> str:
        """A sampling warper's filter of `a` ([M, N]) along its rows, as Hugging Face writes
        top-p and min-p: a mask computed in sorted order (a cumulative softmax, or a mask of
        the row gathered there, the first element kept), scattered back at the sort's
        positions, filling `a` with a finite value."""
        rng, t = self.sample_rng, a.text
        if rng.random() < 0.5:
            keep = rng.choice(["0.3", "0.6", "0.9"])
            m = f"cumsum(softmax(sort({t}, axis=1)[0], axis=1), axis=1) <= {keep}"
            i = f"argsort({t}, axis=1)"
        else:
            i = f"argsort({t}, axis=1, descending=true)"
            m = (f"where(index({t}, 1) < 1, false, gather(softmax({t}, axis=1) < 0.2 * max(softmax({t}, "
                 f"axis=1), axis=1, keepdims=true), {i}, axis=1))")
        return f"where(scatter({m}, {i}, {m}, 1), {rng.choice(['0.0', '-1.0'])}, {t})"

    def scan(self, a: Value, axis: int) -> str:
        """A scan of `a` along `axis` (a cumsum half the time; the others' operands bounded, so
        a product over a row stays in range), or a flip."""
        rng = self.scans_rng
        kind, reverse = rng.randrange(9), rng.random() < 0.3
        if kind < 4 or a.kind != "float":
            return f"cumsum({a.text}, axis={axis}" + (", reverse=true)" if reverse else ")")
        if kind == 8:
            return f"flip({a.text}, axis={axis})"
        call = {4: f"cumprod(1.0 + 0.1 * tanh({a.text})", 5: f"cummax({a.text}", 6: f"cummin({a.text}",
                7: rng.choice([f"logcumsumexp({a.text}", f"linear_scan(sigmoid({a.text}), {a.text} * 0.5"])}
        return call[kind] + f", axis={axis}" + (", reverse=true)" if reverse else ")")

    def statement(self, i: int) -> str:
        v = self.expr(self.rng.randint(1, 3))
        name = f"t{i}"
        self.values.append(Value(name, v.shape, v.kind))
        # a scalar may be integer-valued (`N - 1`); `* 1.0` makes it a float, exactly
        line = f"    {name} = {v.text}" + (" * 1.0" if not v.shape else "")
        return line + self.write_items(name, v)

    def write_items(self, name: str, v: Value) -> str:
        """Now and then, a write into the statement's [M, N] float value: through slices or a
        bool mask (a select over it) or at distinct rows (argsort's positions: a scatter into
        a copy)."""
        rng = self.items_rng
        if v.shape != ("M", "N") or v.kind != "float" or rng.random() >= 0.05:
            return ""
        return "\n    " + rng.choice([
            f"{name}[..., :1] = s",
            f"{name}[1::2] = tanh({name}[1::2])",
            f"{name}[:, N // 2:] = y[N // 2:] * 0.5",
            f"{name}[argsort(k[:, 0], axis=0)[:(M + 1) // 2]] = {name}[:(M + 1) // 2] * 0.5",
            f"{name}[{name} < 0.0] = 0.25"])


def _type(v: Value, dt: str) -> str:
    return f"{dt}[{', '.join(v.shape)}]" if v.shape else dt


def generate(rng: random.Random, seed: int | None = None) -> Program:
    gen = Generator(rng)
    dt = rng.choice(sorted(DTYPES))
    lines = [gen.statement(i) for i in range(rng.randint(1, 5))]
    temps = gen.values[len(Generator(rng).values):]
    # returned values have at least M (>= 17) elements, and in half-precision programs M x N
    # (>= 561): the oracle compares max errors, a statistic that needs samples. On few
    # elements of a half-precision program one rounding decides it: our single rounding
    # of a more exact value lost to eager's luckier double rounding on 1, 17 and 33
    # elements. Scalars are tested in test_valid_programs.py.
    wanted = ("M", "N") if dt != "f32" else ()
    temps = [v for v in temps if ("M" in v.shape or "N" in v.shape) and all(d in v.shape for d in wanted)]
    temps = temps or [gen.values[0]]
    outs = rng.sample(temps, k=min(len(temps), rng.randint(1, 3)))
    rtypes = [_type(v, rng.choice(["f32", dt])) for v in outs]
    ret = rtypes[0] if len(rtypes) == 1 else f"({', '.join(rtypes)})"
    body = "\n".join(lines) + f"\n    return {', '.join(v.text for v in outs)}"
    src = f"kernel f({PARAMS.format(dt=dt)}) -> {ret} {{\n{body}\n}}\n"
    return Program(src, dt, rng.choice([17, 33]), rng.choice([33, 113]),
                   rng.randrange(2**31) if seed is None else seed, rng.choice([1, 2]), rng.choice([2, 3]))


@dataclass(frozen=True)
class Outcome:
    """How a program fared: "pass", "rejected" (a located error), "overflow" or
    "unstable" (see `run`), or "fail"; `detail` says what happened."""

    status: str
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "fail"


# a reshape that would merge dims a view keeps apart (`reshape(transpose(t, 0, 1), [-1])`) is
# refused at the call, with its location, as the README says: the program is valid, the
# view is not
RESHAPE_REFUSAL = "this reshape merges dims"


def run(program: Program, sm90: bool = False) -> Outcome:
    """Compile and run `program`, judge it by the design section 5 oracle (and, with `sm90`,
    compile every kernel it launched for H100).

    A program whose eager run in its own dtypes is infinite or NaN where the float64
    golden is finite (exp of a sum overflowing f16, say) leaves the oracle without a
    yardstick: it is counted as "overflow", and only checked for NaN where neither the
    golden nor eager has one. A miss that inputs moved by an ulp do not repeat is
    "unstable" (see `PERTURBATIONS`).
    """
    import tiledsl
    from tiledsl import testing

    try:
        fn = tiledsl.compile(program.source)
    except tiledsl.TileDSLError as err:
        if isinstance(err, tiledsl.diagnostics.InternalError) or err.line < 1:
            return Outcome("fail", f"compile: {err}")
        return Outcome("rejected", err.message)

    def judge(args: dict) -> Outcome:
        return _judge(fn(**args), fn.reference(**args, float64=True), fn.reference(**args), testing)

    try:
        outcome = judge(program.args())
    except tiledsl.diagnostics.ArgumentError as err:
        if err.line >= 1 and err.message.startswith(RESHAPE_REFUSAL):
            return Outcome("rejected", err.message)  # the README's refusal of a reshape of a transpose
        return Outcome("fail", f"run: {err}")
    except Exception as err:  # noqa: BLE001 - any failure here is a finding
        return Outcome("fail", f"run: {type(err).__name__}: {err}")
    if outcome.failed:
        return _unless_met_nearby(outcome, program, lambda args: not judge(args).failed)
    if not sm90:
        return outcome
    from helpers import compile_for_sm90

    try:
        compile_for_sm90(fn)
    except Exception as err:  # noqa: BLE001
        return Outcome("fail", f"sm90: {type(err).__name__}: {str(err)[:500]}")
    return outcome


def run_grads(program: Program) -> Outcome:
    """Differentiate `program` and judge its gradients along random cotangents against float64
    torch autograd of the reference (`testing.check_grads`). "nograd": nothing to
    differentiate, an op tiledsl cannot differentiate (a located GradientError), or one
    torch cannot (floor division); "overflow": the eager gradient is not finite where the
    golden is; "unstable": a miss that inputs moved by an ulp do not repeat (see
    `PERTURBATIONS`)."""
    import tiledsl
    from tiledsl import testing

    try:
        fn = tiledsl.compile(program.source)
    except tiledsl.TileDSLError as err:
        if isinstance(err, tiledsl.diagnostics.InternalError) or err.line < 1:
            return Outcome("fail", f"compile: {err}")
        return Outcome("rejected", err.message)
    if not fn.differentiable:
        return Outcome("nograd", "no floating-point tensor parameter")
    try:
        _ = fn.backward
    except tiledsl.diagnostics.GradientError as err:
        return Outcome("nograd", err.message) if err.line >= 1 else Outcome("fail", str(err))
    except tiledsl.TileDSLError as err:
        return Outcome("fail", f"backward: {err}")

    def check(args: dict) -> testing.Report:
        return testing.check_grads(fn, generator=torch.Generator().manual_seed(program.seed), **args)

    try:
        report = check(program.args())
    except RuntimeError as err:
        if "floor_divide" in str(err):
            return Outcome("nograd", "torch has no derivative for floor division")
        return Outcome("fail", f"grads: {type(err).__name__}: {err}")
    except Exception as err:  # noqa: BLE001 - any failure here is a finding
        return Outcome("fail", f"grads: {type(err).__name__}: {err}")
    if any(not math.isfinite(o.eager_error) for o in report.outputs):
        return Outcome("overflow", "the eager gradient is not finite where the golden is")
    if report.ok:
        return Outcome("pass")
    return _unless_met_nearby(Outcome("fail", f"gradients: {report}"), program, lambda args: check(args).ok)


# The oracle compares max errors, a statistic that a few elements can decide, and in
# rounding-sized ways that say nothing about the compiler: an output that is one bf16 value
# repeated (seed 2604, program 176: `maximum(N - 1, x) * mean(z, axis=0)`, where eager's
# double rounding landed closer than our single one), exp of a bf16 matmul whose largest
# element decides (seed 2601, program 377: 13.3 against eager's 2.66 at 667, a smaller
# relative error overall), a gradient through `maximum` at a near tie, where the golden,
# eager and the compiled program each pick a side (seed 2801, program 195: 0.30000104 in
# float64, 0.2998 from a stored bf16 sin, 0.3008 in eager bf16, against 0.3). A miss that the
# oracle no longer sees once every input moves by an ulp or two, in one of
# `PERTURBATIONS` draws, is "unstable": counted apart and never a pass. A wrong result, an
# index or a derivative, is wrong at every nearby input.
PERTURBATIONS = 3


def _unless_met_nearby(miss: Outcome, program: Program, meets) -> Outcome:
    """`miss`, or "unstable" when `meets(args)` at inputs moved by an ulp (`_perturbed`)."""
    for k in range(PERTURBATIONS):
        if meets(_perturbed(program.args(), torch.Generator().manual_seed(program.seed + k + 1))):
            return Outcome("unstable", f"{miss.detail} (met at inputs moved by an ulp, draw {k})")
    return miss


def _perturbed(args: dict, generator: torch.Generator) -> dict:
    """`args` with every floating-point tensor moved by about an ulp of its dtype, each
    element up or down at random."""
    out = dict(args)
    for name, value in args.items():
        if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
            sign = torch.randint(0, 2, value.shape, generator=generator) * 2 - 1
            out[name] = (value.double() * (1 + sign * torch.finfo(value.dtype).eps)).to(value.dtype)
    return out


def _judge(outputs, golden, eager, testing) -> Outcome:
    as_tuple = testing.as_tuple
    overflow = any(((~e.double().isfinite()) & g.double().isfinite()).any()
                   for e, g in zip(as_tuple(eager), as_tuple(golden), strict=True))
    if not overflow:
        report = testing.compare(outputs, golden, eager)
        return Outcome("pass") if report.ok else Outcome("fail", f"numerics: {report}")
    for i, (o, g, e) in enumerate(zip(as_tuple(outputs), as_tuple(golden), as_tuple(eager), strict=True)):
        bad = o.double().isnan() & ~g.double().isnan() & ~e.double().isnan()
        if bad.any():
            return Outcome("fail", f"numerics: output {i}: {int(bad.sum())} NaN where neither the golden "
                                   "nor eager has one")
    return Outcome("overflow", "the eager run overflows where the golden does not")


# --- mutation fuzzing of program text -------------------------------------------------------

PIECES = ["kernel", "f", "(", ")", "x", ":", "f32", "f16", "bool", "i32", "[", "]", "N", "M", "1", ",",
          "->", "{", "}", "return", "=", "+", "-", "*", "/", "@", ".T", "softmax", "sum", "axis=", "-1",
          "keepdims=true", "1e3", "\n", ";", "#", '"s"', "inf", "-inf", "where", "<", ">=", "&", "|",
          "@tile", "BLOCK_M=64", "cast", "index", "causal", "transpose", "0", "99999999999", "\t",
          "\x00", "\u00e9", "\u202e", "\ud800", "(((", ")))", "x.T", "maximum", "gelu", 'approximate="tanh"']


def seeds() -> list[str]:
    """The programs mutations start from: the examples and the FileCheck inputs."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    files = sorted(root.glob("examples/*.tdsl")) + sorted(root.glob("tests/filecheck/*.tdsl"))
    return [f.read_text() for f in files]


def mutate(rng: random.Random, text: str) -> str:
    """One to four random edits: delete, duplicate or move a span, insert a piece or a
    random character, swap two tokens, truncate."""
    for _ in range(rng.randint(1, 4)):
        n = len(text)
        i, j = sorted(rng.randrange(n + 1) for _ in range(2))
        r = rng.random()
        if r < 0.2:
            text = text[:i] + text[j:]
        elif r < 0.35:
            text = text[:j] + text[i:j] + text[j:]
        elif r < 0.65:
            text = text[:i] + rng.choice(PIECES) + text[i:]
        elif r < 0.75:
            text = text[:i] + chr(rng.choice([rng.randrange(32, 127), rng.randrange(0, 32),
                                              rng.randrange(128, 0x3000)])) + text[i:]
        elif r < 0.9:
            words = text.split(" ")
            if len(words) > 2:
                a, b = rng.randrange(len(words)), rng.randrange(len(words))
                words[a], words[b] = words[b], words[a]
                text = " ".join(words)
        else:
            text = text[:j]
    return text


def compile_outcome(text: str) -> str | None:
    """None when `text` compiles or is refused with a located, non-internal error."""
    import tiledsl

    try:
        tiledsl.compile(text)
    except tiledsl.TileDSLError as err:
        if isinstance(err, tiledsl.diagnostics.InternalError):
            return f"internal: {err}"
        if err.line < 1 and not isinstance(err, tiledsl.diagnostics.OptionError):
            return f"unlocated: {err}"
        str(err)  # renders
    except Exception as err:  # noqa: BLE001 - any raw exception is a finding
        return f"raw: {type(err).__name__}: {err}"
    return None
