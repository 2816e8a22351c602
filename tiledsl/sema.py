"""Semantic analysis: AST -> graph IR.

One walk over a kernel's AST resolves names, binds builtin arguments, checks
shapes and dtypes through the op type rules of `tiledsl.ops`, and builds the
graph. Every error is located: the primary span is the construct at fault,
and notes point at related spans (the first definition, the other operand,
the declared return type).
"""

from __future__ import annotations

from collections.abc import Sequence

from tiledsl import ast, ops
from tiledsl import diagnostics as diag
from tiledsl.builder import Builder
from tiledsl.builtins import BUILTINS, REQUIRED, TILE_HINTS, TORCH_SPELLINGS, BParam, Builtin
from tiledsl.dims import Lin
from tiledsl.dims import symbols as dim_symbols
from tiledsl.indexing import Indexing, axis_arg, const_bool, const_int, literal_int
from tiledsl.ir import Graph, make_attrs
from tiledsl.parser import LITERAL_WORDS
from tiledsl.passes.canonicalize import fold_value, folds
from tiledsl.source import Span
from tiledsl.types import (
    DTYPES,
    MAX_RANK,
    PARAM_DTYPES,
    DType,
    TensorType,
    format_shape,
    normalize_axis,
)

MAX_PARAMS = 256
I32_MAX = 2**31 - 1


def analyze(kernel: ast.Kernel, check_bounds: bool = False) -> Graph:
    """Check one kernel and lower it to a graph IR. `check_bounds`: every index a program
    gives also counts its out-of-range values, returned as extra outputs (`Graph.checks`)."""
    return _KernelBuilder(kernel, check_bounds).build()


def select_kernel(program: ast.Program, name: str | None) -> ast.Kernel:
    """The kernel to compile: the named one, or the only one."""
    seen: dict[str, ast.Kernel] = {}
    for k in program.kernels:
        if k.name in seen:
            raise diag.DuplicateKernelError(
                k.name_span, [diag.Note("first defined here", seen[k.name].name_span)], name=k.name)
        seen[k.name] = k
    names = ", ".join(seen)
    if name is None:
        if len(seen) > 1:
            first = program.kernels[0].name_span
            raise diag.KernelSelectionError(first, message=(
                f"the program defines {len(seen)} kernels ({names}); "
                "choose one with kernel=..."))
        return program.kernels[0]
    if name not in seen:
        hint = diag.did_you_mean(name, seen)
        raise diag.KernelSelectionError(program.kernels[0].name_span, message=(
            f"no kernel named '{name}'{hint or ''} (kernels: {names})"))
    return seen[name]


class _KernelBuilder:
    def __init__(self, kernel: ast.Kernel, check_bounds: bool = False) -> None:
        self.kernel = kernel
        self.graph = Graph(kernel.name, kernel.span)
        self.b = Builder(self.graph)
        # name -> (node, span where it was bound)
        self.scope: dict[str, tuple[int, Span]] = {}
        # dim symbol -> (param name, span of its first occurrence)
        self.dims: dict[str, tuple[str, Span]] = {}
        self.indexing = Indexing(self.b, self.expr,
                                 lambda name: name in self.dims and name not in self.scope, check_bounds)

    # --- kernel structure ------------------------------------------------------------

    def build(self) -> Graph:
        k = self.kernel
        self.graph.hints = self._hints(k.decorators)
        if len(k.params) > MAX_PARAMS:
            raise diag.LimitError(k.params[MAX_PARAMS].span, what="the number of parameters",
                                  limit=MAX_PARAMS)
        for index, param in enumerate(k.params):
            self._param(index, param)
        for pname, (_, pspan) in self.scope.items():
            if pname in self.dims:
                raise diag.NameConflictError(
                    pspan, [diag.Note("used as a dimension here", self.dims[pname][1])], name=pname)
        returned = False
        for stmt in k.body:
            if returned:
                raise diag.ReturnError(stmt.span, message="statement after 'return' is unreachable")
            if isinstance(stmt, ast.Assign):
                self.scope[stmt.target] = (self.expr(stmt.value), stmt.target_span)
            elif isinstance(stmt, ast.AssignItem):
                name = stmt.target.value.id
                if name not in self.scope:
                    self.expr(stmt.target.value)  # the unknown name's located error
                    raise diag.IndexingError(stmt.target.value.span, message=(
                        f"cannot write into '{name}': it is a dim, not a value"))
                x, span = self.scope[name]
                value = (self.expr(stmt.value), stmt.value.span)
                self.scope[name] = (self.indexing.write(stmt.target, x, value, stmt.span), span)
            elif isinstance(stmt, ast.Unpack):
                values = self._unpacked(stmt)
                for name, span, value in zip(stmt.targets, stmt.target_spans, values, strict=True):
                    self.scope[name] = (value, span)
            else:
                self._return(stmt)
                returned = True
        if not returned:
            raise diag.ReturnError(k.name_span, message=f"kernel '{k.name}' has no 'return' statement")
        return self.graph

    def _unpacked(self, stmt: ast.Unpack) -> tuple[int, ...]:
        """The values `a, b = ...` binds: a builtin's several results, or a tuple's values,
        every one computed before any name is bound (`a, b = b, a` swaps)."""
        for i, name in enumerate(stmt.targets):
            if name in stmt.targets[:i]:
                first = stmt.target_spans[stmt.targets.index(name)]
                raise diag.UnpackError(stmt.target_spans[i], [diag.Note("first here", first)],
                                       message=f"'{name}' is assigned twice in one statement")
        n = len(stmt.targets)
        if len(stmt.values) == 1:
            (e,) = stmt.values
            builtin = BUILTINS.get(e.func) if isinstance(e, ast.Call) and e.func not in self.scope else None
            if builtin is None or not builtin.results:
                several = ", ".join(k for k, b in BUILTINS.items() if b.results)
                raise diag.UnpackError(e.span, message=(
                    f"cannot unpack one value into {n} names: only a builtin with several results "
                    f"({several}) or a tuple (`a, b = x, y`) unpacks"))
            if len(builtin.results) != n:
                raise diag.UnpackError(stmt.span, message=(
                    f"'{e.func}' gives {len(builtin.results)} results ({', '.join(builtin.results)}), "
                    f"not {n}"))
            return getattr(self, "_results_" + _RESULTS[e.func])(e, builtin, _bind(builtin, e))
        if len(stmt.values) != n:
            raise diag.UnpackError(stmt.span, message=f"{n} names but {len(stmt.values)} values")
        return tuple(self.expr(v) for v in stmt.values)

    def _hints(self, decorators: Sequence[ast.Decorator]) -> dict[str, tuple[int, Span]]:
        hints: dict[str, tuple[int, Span]] = {}
        seen_tile: Span | None = None
        for dec in decorators:
            if dec.name != "tile":
                close = diag.suggest(dec.name, ["tile"])
                hint = "; did you mean '@tile'?" if close else "; the only decorator is @tile(...)"
                raise diag.TileHintError(dec.span, message=f"unknown decorator '@{dec.name}'{hint}")
            if seen_tile is not None:
                raise diag.TileHintError(dec.span, [diag.Note("first @tile here", seen_tile)],
                                         message="@tile is given twice")
            seen_tile = dec.span
            for h in dec.hints:
                if h.name not in TILE_HINTS:
                    raise diag.TileHintError(h.span, message=(
                        f"unknown tile hint '{h.name}'{diag.did_you_mean(h.name, TILE_HINTS)} "
                        f"(known: {', '.join(TILE_HINTS)})"))
                if h.name in hints:
                    raise diag.TileHintError(h.span, [diag.Note("first given here", hints[h.name][1])],
                                             message=f"tile hint '{h.name}' is given twice")
                value = const_int(h.value, f"tile hint '{h.name}'")
                _check_hint(h.name, value, h.span)
                hints[h.name] = (value, h.span)
        return hints

    def _param(self, index: int, param: ast.Param) -> None:
        if param.name in LITERAL_WORDS:
            raise diag.LiteralNameError(param.name_span, name=param.name, what="parameter",
                                        meaning=LITERAL_WORDS[param.name])
        if param.name in self.scope:
            first = self.scope[param.name][1]
            raise diag.DuplicateParameterError(
                param.name_span, [diag.Note("first declared here", first)], name=param.name)
        t = self._type(param.type, param.name)
        scalar = param.type.dims is None
        node = self.b.param(t, param.span, name=param.name, index=index, scalar=scalar)
        self.scope[param.name] = (node, param.name_span)

    def _type(self, texpr: ast.TypeExpr, owner: str | None) -> TensorType:
        dtype = DTYPES.get(texpr.dtype)
        if dtype is None:
            raise _unknown_dtype(texpr.dtype_span, texpr.dtype)
        dims = texpr.dims or ()
        if len(dims) > MAX_RANK:
            raise diag.LimitError(texpr.span, what=f"rank {len(dims)}", limit=MAX_RANK)
        for d in dims:
            if isinstance(d.value, int):
                if d.value < 1:
                    raise diag.RankError(d.span, message=f"dim sizes must be at least 1, got {d.value}")
                if d.value > I32_MAX:  # dims are i32 values in the language and in kernels
                    raise diag.RankError(d.span, message=(
                        f"dim sizes must be at most {I32_MAX}, got {d.value}"))
            elif d.value in LITERAL_WORDS:
                raise diag.LiteralNameError(d.span, name=d.value, what="dim",
                                            meaning=LITERAL_WORDS[d.value])
            elif owner is not None and not d.value.isidentifier():
                raise diag.RankError(d.span, message=(
                    f"parameter '{owner}' declares the dim {d.value}: a parameter's dims are "
                    "symbols or integers (dim expressions may appear in return types)"))
            elif owner is not None and d.value not in self.dims:
                self.dims[d.value] = (owner, d.span)
        return TensorType(dtype, tuple(d.value for d in dims))

    def _return(self, stmt: ast.Return) -> None:
        declared = self.kernel.returns
        values = stmt.values
        if len(values) == 1 and isinstance(values[0], ast.TupleLit):  # return (a, b)
            values = values[0].items
        if len(values) != len(declared):
            raise diag.ReturnError(stmt.span, [diag.Note("declared here", self.kernel.returns_span)],
                                   message=(f"kernel '{self.kernel.name}' declares {len(declared)} "
                                            f"return value(s) but returns {len(values)}"))
        outs = []
        self.graph.returns = tuple(self._type(t, None) for t in declared)
        for i, (value, texpr) in enumerate(zip(values, declared, strict=True)):
            node = self.expr(value)
            got = self.graph.op(node).type
            want = self._type(texpr, None)
            note = [diag.Note("declared here", texpr.span)]
            which = f"return value {i + 1}" if len(declared) > 1 else "the returned value"
            for d in want.shape:
                for sym in dim_symbols(d) if isinstance(d, str) else ():
                    if sym not in self.dims:
                        raise diag.ReturnTypeError(texpr.span, message=(
                            f"the declared return type uses dim '{sym}', which no parameter defines"))
            if got.shape != want.shape:
                message = (f"{which} has shape {format_shape(got.shape)} but the kernel declares "
                           f"{format_shape(want.shape)}")
                agreed = self.b.agree_shape(node, value.span, want.shape, message)
                if agreed is None:
                    raise diag.ReturnTypeError(value.span, note, message=message)
                node = agreed
            if got.dtype != want.dtype and self._narrowed_positions(node, want.dtype, value.span, which):
                node = self.b.user_op("cast", [(node, value.span)], value.span, dtype=want.dtype)
            elif got.dtype != want.dtype:
                if not (got.dtype.is_float and want.dtype.is_float):
                    raise diag.ReturnTypeError(value.span, note, message=(
                        f"{which} is {got.dtype} but the kernel declares {want.dtype}; "
                        f"convert it explicitly with cast(..., {want.dtype})"))
                node = self.b.user_op("cast", [(node, value.span)], value.span, dtype=want.dtype)
            outs.append(node)
        checks = self.indexing.checks
        if checks:
            outs += [node for node, _ in checks]
            self.graph.returns += (TensorType(DType.I32, ()),) * len(checks)
            self.graph.checks = tuple(check for _, check in checks)
        self.b.ret(outs, stmt.span)

    def _result_of(self, e: ast.Subscript) -> int | None:
        """`topk(x, k)[0]`, `sort(x)[1]`, `max(x, axis=-1)[1]`: one result of a builtin with
        several, picked as torch picks from the tuple it returns (not a row of the values).
        max and min return a tuple only along an axis, as torch's."""
        call = e.value
        if not isinstance(call, ast.Call) or call.func in self.scope or len(e.items) != 1:
            return None
        builtin = BUILTINS.get(call.func)
        k = literal_int(e.items[0])
        if builtin is None or not builtin.results or k not in range(len(builtin.results)):
            return None
        args = _bind(builtin, call)
        if call.func in ("max", "min") and (args.get("axis") is None or literal_int(args["axis"]) is None):
            return None  # over every element or several axes: one value
        return getattr(self, "_results_" + _RESULTS[call.func])(call, builtin, args)[k]

    def _narrowed_positions(self, node: int, want: DType, span, which: str) -> bool:
        """Positions along an axis (argmax's, topk's and sort's i64 indices) returned as i32,
        as routers hand them on (vLLM's topk_softmax writes int32): exact while the axis
        is shorter than 2**31, which the call checks where the sizes decide."""
        op = self.graph.op(node)
        if want is not DType.I32 or op.kind not in ("argtopk", "argmax", "argmin"):
            return False
        x = self.graph.op(self.graph.operands(node)[0]).type
        n = Lin.of(x.shape[op.attr("axis") % x.rank])
        requires = list(self.graph.requires)
        self.indexing._require(Lin((), 2**31 - 1) - n, span, (
            f"{which} holds positions along an axis of {x.shape[op.attr('axis') % x.rank]} elements, "
            "more than an i32 holds"), requires)
        self.graph.requires = tuple(requires)
        return True

    # --- expressions --------------------------------------------------------------------

    def expr(self, e: ast.Expr) -> int:
        if isinstance(e, ast.Subscript):
            if (picked := self._result_of(e)) is not None:
                return picked
            return self.indexing.subscript(e)
        method = getattr(self, "_" + type(e).__name__)
        return method(e)

    def _Name(self, e: ast.Name) -> int:
        if e.id in self.scope:
            return self.scope[e.id][0]
        if e.id in self.dims:
            return self.b.dim(e.id, e.span)
        if e.id in BUILTINS:
            raise diag.UndefinedNameError(e.span, name=e.id,
                                          hint=f"; '{e.id}' is a function, call it as {e.id}(...)")
        candidates = list(self.scope) + list(self.dims)
        raise diag.UndefinedNameError(e.span, name=e.id, hint=diag.did_you_mean(e.id, candidates))

    def _IntLit(self, e: ast.IntLit) -> int:
        if e.value > I32_MAX:
            raise diag.ConstantExpected(e.span, what=f"integer literal {e.value}",
                                        expected=f"at most {I32_MAX} (it must fit in i32)")
        return self.b.const(e.value, DType.I32, e.span)

    def _FloatLit(self, e: ast.FloatLit) -> int:
        return self.b.const(e.value, DType.F32, e.span)

    def _BoolLit(self, e: ast.BoolLit) -> int:
        return self.b.const(e.value, DType.BOOL, e.span)

    def _NoneLit(self, e: ast.NoneLit) -> int:
        raise diag.DTypeError(e.span, message="None is only allowed as axis=None (every axis)")

    def _TupleLit(self, e: ast.TupleLit) -> int:
        raise diag.DTypeError(e.span, message=(
            "a tuple is only allowed as the axes of a reduction, e.g. sum(x, axis=(0, 1))"))

    def _ListLit(self, e: ast.ListLit) -> int:
        raise diag.DTypeError(e.span, message=(
            "a list is only allowed as a shape, e.g. reshape(x, [B, H // 2, 2])"))

    def _StrLit(self, e: ast.StrLit) -> int:
        raise diag.DTypeError(e.span, message="a string is only allowed as a keyword value, "
                              "e.g. gelu(x, approximate=\"tanh\")")

    def _Unary(self, e: ast.Unary) -> int:
        operand = self.expr(e.operand)
        if e.op == "+":
            return operand
        return self.b.user_op("neg" if e.op == "-" else "not", [(operand, e.operand.span)], e.span)

    def _Binary(self, e: ast.Binary) -> int:
        lhs, rhs = self.expr(e.lhs), self.expr(e.rhs)
        kind = "matmul" if e.op == "@" else ops.BINARY_KINDS[e.op]
        return self.b.user_op(kind, [(lhs, e.lhs.span), (rhs, e.rhs.span)], e.span)

    def _Compare(self, e: ast.Compare) -> int:
        if len(e.ops) > 1:
            raise diag.ChainedComparisonError(e.span, op1=e.ops[0], op2=e.ops[1])
        lhs, rhs = (self.expr(x) for x in e.operands)
        kind = ops.COMPARE_KINDS[e.ops[0]]
        return self.b.user_op(kind, [(lhs, e.operands[0].span), (rhs, e.operands[1].span)], e.span)

    def _Attribute(self, e: ast.Attribute) -> int:
        if e.name != "T":
            raise diag.UnknownAttributeError(e.name_span, name=e.name)
        value = self.expr(e.value)
        t = self.graph.op(value).type
        if t.rank < 2:
            raise diag.RankError(e.span, [diag.Note(f"this value is {t}", e.value.span)],
                                 message=f"'.T' needs a value of rank 2 or more, got rank {t.rank}")
        return self.b.user_op("transpose", [(value, e.value.span)], e.span, dims=(t.rank - 2, t.rank - 1))

    def _Call(self, e: ast.Call) -> int:
        if e.func in self.scope:
            raise diag.NotCallableError(e.func_span, name=e.func, what="variable")
        if e.func == "concat":
            return self.indexing.concat(e)
        builtin = BUILTINS.get(e.func)
        if builtin is None:
            if e.func in TORCH_SPELLINGS:
                raise diag.UnknownFunctionError(e.func_span, name=e.func, hint=(
                    f"; tiledsl writes {TORCH_SPELLINGS[e.func].format(x='x')}"))
            raise diag.UnknownFunctionError(e.func_span, name=e.func,
                                            hint=diag.did_you_mean(e.func, BUILTINS))
        args = _bind(builtin, e)
        handler = _HANDLERS.get(e.func, "op")
        if handler in Indexing.CALLS:
            return getattr(self.indexing, handler)(e, args)
        return getattr(self, "_call_" + handler)(e, builtin, args)

    # --- builtins --------------------------------------------------------------------------

    def _value(self, args: dict[str, ast.Expr], name: str) -> tuple[int, Span]:
        expr = args[name]
        return self.expr(expr), expr.span

    def _call_op(self, e: ast.Call, b: Builtin, args: dict[str, ast.Expr]) -> int:
        """An op called by name: its value parameters are its operands, its constant
        parameters the attributes of the same name."""
        attrs = {p.name: _constant(args.get(p.name), p, e.func)
                 for p in b.params if p.kind != "value"}
        operands = [self._value(args, p.name) for p in b.params if p.kind == "value"]
        return self.b.user_op(e.func, operands, e.span, **attrs)

    def _call_reduce(self, e: ast.Call, b: Builtin, args: dict[str, ast.Expr], **attrs: object) -> int:
        """A reduction along the given axis (or axes); `attrs` are further attributes of a
        one-axis one (a pair's `pair`)."""
        x = self._value(args, "x")
        rank = self.graph.op(x[0]).type.rank
        if rank == 0:
            raise diag.RankError(e.span, self._elementwise_spelling(e),
                                 message=f"'{e.func}' needs a value of rank 1 or more")
        given = args.get("axis")
        if isinstance(given, ast.TupleLit | ast.NoneLit):
            if ops.OPS[e.func].reduction.index:
                raise diag.ConstantExpected(given.span, what=f"'axis' of '{e.func}'", expected=(
                    "one integer: a position is along one axis (reshape(x, [...]) merges axes)"))
            return self._reduce_axes(e, x, given, rank, args)
        try:
            axis = axis_arg(e, args, "axis", rank)
        except (diag.ConstantExpected, diag.AxisError) as err:
            if notes := self._elementwise_spelling(e):
                raise type(err)(err.span, (*err.notes, *notes), **err.fields) from None
            raise
        keepdims = const_bool(args.get("keepdims"), f"'keepdims' of '{e.func}'")
        return self.b.user_op(e.func, [x], e.span, axis=axis, keepdims=keepdims, **attrs)

    @staticmethod
    def _elementwise_spelling(e: ast.Call) -> list[diag.Note]:
        """A note for Python's `max(a, b)` of two values (`max(x, 0.0)`, gpt-fast's
        `max(temperature, 1e-5)`): the elementwise op's name."""
        if e.func not in _ELEMENTWISE_SPELLING or len(e.args) != 2:
            return []
        spelling = _ELEMENTWISE_SPELLING[e.func]
        return [diag.Note(f"'{e.func}' reduces along an axis; the elementwise {spelling} of two values "
                          f"is {spelling}(a, b)")]

    def _results_extremum(self, e: ast.Call, b: Builtin, args: dict[str, ast.Expr]) -> tuple[int, int]:
        """`values, indices = max(x, axis)`, torch's pair: the max along one axis and the
        position of its first occurrence (argmax, i64)."""
        given = args.get("axis")
        if isinstance(given, ast.TupleLit | ast.NoneLit):
            raise diag.ConstantExpected(given.span, what=f"'axis' of '{e.func}' unpacked", expected=(
                "one integer: the indices are positions along one axis"))
        # the pair's values send their gradient to the indices' position, as torch.max(x,
        # dim)'s do (a plain max shares it between ties, as torch.amax)
        values = self._call_reduce(e, b, args, pair=True)
        op = self.graph.op(values)
        (x,) = self.graph.operands(values)
        indices = self.b.user_op("arg" + e.func, [(x, args["x"].span)], e.span, axis=op.attr("axis"),
                                 keepdims=op.attr("keepdims"))
        return values, indices

    def _results_cumulative(self, e: ast.Call, b: Builtin, args: dict[str, ast.Expr]) -> tuple[int, int]:
        """`values, indices = cummax(x, axis)` (cummin), torch's pair: the running extremum and
        the position of its latest occurrence (i64; after a NaN, the latest NaN's), a second
        scan: the running max of the positions where x is the running extremum or NaN (with
        reverse=true, the running min of those positions from the end)."""
        values = self._call_along(e, b, args)
        op, (x,) = self.graph.op(values), self.graph.operands(values)
        xspan, span = args["x"].span, e.span
        axis, reverse = op.attr("axis"), op.attr("reverse")
        hit = self.b.user_op("eq", [(x, xspan), (values, span)], span)
        if self.graph.op(x).dtype.is_float:
            nan = self.b.user_op("isnan", [(x, xspan)], span)
            hit = self.b.user_op("or", [(hit, span), (nan, span)], span)
        at = self.b.user_op("index", [], span, axis=axis, shape=op.shape)
        miss = self.b.size(op.shape[axis], span) if reverse else self.b.const(-1, DType.I32, span)
        positions = self.b.user_op("where", [(hit, span), (at, span), (miss, span)], span)
        latest = self.b.user_op("cummin" if reverse else "cummax", [(positions, span)], span, axis=axis,
                                reverse=reverse)
        return values, self.b.user_op("cast", [(latest, span)], span, dtype=DType.I64)

    def _results_select(self, e: ast.Call, b: Builtin, args: dict[str, ast.Expr]) -> tuple[int, int]:
        """`values, indices = topk(x, k)` (or sort(x)): torch's pair, one topk and one argtopk
        of the same x (the rows template computes them from one sort)."""
        x, xspan = self._value(args, "x")
        t = self.graph.op(x).type
        if t.rank == 0:
            raise diag.RankError(e.span, message=f"'{e.func}' needs a value of rank 1 or more")
        axis = axis_arg(e, args, "axis", t.rank)
        if e.func == "topk":
            k = self.indexing._dim_expr(args["k"], f"the k of '{e.func}'")
            requires = list(self.graph.requires)
            message = f"k = {k.dim()} of 'topk' is outside 1 to {t.shape[axis]} (the length of axis {axis})"
            self.indexing._require(k - Lin((), 1), args["k"].span, message, requires)
            self.indexing._require(Lin.of(t.shape[axis]) - k, args["k"].span, message, requires)
            self.graph.requires = tuple(requires)
            largest = "largest" not in args or const_bool(args["largest"], "'largest' of 'topk'")
            attrs = {"k": k.dim(), "largest": largest}
        else:
            attrs = {"k": t.shape[axis],
                     "largest": const_bool(args.get("descending"), f"'descending' of '{e.func}'")}
        return tuple(self.b.user_op(kind, [(x, xspan)], e.span, axis=axis, **attrs)
                     for kind in ("topk", "argtopk"))

    def _call_select(self, e: ast.Call, b: Builtin, args: dict[str, ast.Expr]) -> int:
        """topk(x, k) and sort(x) used as one value are the values; argsort(x) the indices."""
        values, indices = self._results_select(e, b, args)
        return indices if e.func == "argsort" else values

    def _reduce_axes(self, e: ast.Call, x: tuple[int, Span], given: ast.Expr, rank: int,
                     args: dict[str, ast.Expr]) -> int:
        """`axis=(a, b, ...)` or `axis=None` (every axis): one reduction per axis, the last
        axis first, so each reduces a whole group of the ones before (a mean of equal-sized
        means is the mean; a logsumexp of logsumexps is the logsumexp)."""
        keepdims = const_bool(args.get("keepdims"), f"'keepdims' of '{e.func}'")
        if isinstance(given, ast.NoneLit):
            axes = list(range(rank))
        else:
            axes = []
            for item in given.items:
                axis = const_int(item, f"an axis of '{e.func}'")
                norm = normalize_axis(axis, rank)
                if norm is None:
                    raise diag.AxisError(item.span, axis=axis, rank=rank, lo=-rank, hi=rank - 1)
                if norm in axes:
                    raise diag.DuplicateAxisError(item.span, axis=axis, func=e.func)
                axes.append(norm)
        for axis in sorted(axes, reverse=True):
            x = (self.b.user_op(e.func, [x], e.span, axis=axis, keepdims=keepdims), e.span)
        return x[0]

    def _call_along(self, e: ast.Call, b: Builtin, args: dict[str, ast.Expr]) -> int:
        """softmax and the scans: one value per element, computed along one axis."""
        operands = [self._value(args, p.name) for p in b.params if p.kind == "value"]
        rank = self.graph.op(operands[0][0]).type.rank
        if rank == 0:
            raise diag.RankError(e.span, message=f"'{e.func}' needs a value of rank 1 or more")
        attrs = {p.name: _constant(args.get(p.name), p, e.func)
                 for p in b.params if p.kind != "value" and p.name != "axis"}
        return self.b.user_op(e.func, operands, e.span, axis=axis_arg(e, args, "axis", rank), **attrs)

    def _call_transpose(self, e: ast.Call, b: Builtin, args: dict[str, ast.Expr]) -> int:
        x = self._value(args, "x")
        rank = self.graph.op(x[0]).type.rank
        a = axis_arg(e, args, "a", rank, None)
        b_ = axis_arg(e, args, "b", rank, None)
        return self.b.user_op("transpose", [x], e.span, dims=(min(a, b_), max(a, b_)))

    def _call_index(self, e: ast.Call, b: Builtin, args: dict[str, ast.Expr]) -> int:
        x, _ = self._value(args, "x")
        shape = self.graph.op(x).shape
        axis = axis_arg(e, args, "axis", len(shape), None)
        return self.b.user_op("index", [], e.span, axis=axis, shape=shape)

    def _call_random(self, e: ast.Call, b: Builtin, args: dict[str, ast.Expr]) -> int:
        """`rand(x, seed)` and `randn(x, seed)`: f32 numbers of x's shape, uniform in [0, 1)
        or standard normal, each a function of the seed and its position in x alone. Triton's
        `rand(seed, offsets)` (an integer scalar, then integer positions) is the numbers at
        those positions: `tl.rand`'s, bit for bit."""
        dist = "uniform" if e.func == "rand" else "normal"
        x, xspan = self._value(args, "x")
        seed, sspan = self._value(args, "seed")
        xt, st = self.graph.op(x).type, self.graph.op(seed).type
        if xt.rank == 0 and xt.dtype.is_int and st.rank > 0 and st.dtype.is_int:
            position = self.b.user_op("cast", [(seed, sspan)], sspan, dtype=DType.I64)
            return self.b.user_op("random", [(position, sspan), (x, xspan)], e.span, dist=dist)
        return self._random(x, (seed, sspan), e.span, dist)

    def _call_dropout(self, e: ast.Call, b: Builtin, args: dict[str, ast.Expr]) -> int:
        """`dropout(x, p, seed)`: x * where(rand(x, seed) >= p, 1 / (1 - p), 0) in x's dtype,
        torch's scaling; the mask factor reads no x, so its gradient is g times it."""
        x, xspan = self._value(args, "x")
        t = self.graph.op(x).type
        if not t.dtype.is_float:
            raise diag.DTypeError(xspan, message=f"dropout needs a float value, got {t}")
        p, pspan = self._value(args, "p")
        self._probability(p, pspan, e.span)
        u = self._random(x, self._value(args, "seed"), e.span, "uniform")
        keep = self.b.user_op("ge", [(u, e.span), (p, pspan)], e.span)
        one = self.b.const(1.0, DType.F32, e.span)
        kept = self.b.user_op("sub", [(one, e.span), (p, pspan)], e.span)
        scale = self.b.user_op("div", [(one, e.span), (kept, pspan)], e.span)
        zero = self.b.const(0.0, DType.F32, e.span)
        factor = self.b.user_op("where", [(keep, e.span), (scale, e.span), (zero, e.span)], e.span)
        out = self.b.user_op("mul", [(x, xspan), (factor, e.span)], e.span)
        if self.graph.op(out).dtype is not t.dtype:  # a p given as an f32 parameter
            out = self.b.user_op("cast", [(out, e.span)], e.span, dtype=t.dtype)
        return out

    def _probability(self, p: int, pspan: Span, span: Span) -> None:
        """dropout's p outside [0, 1] is refused as torch refuses it: a p of literals here;
        a scalar parameter at each call (its `bounds`, which the binder checks)."""
        value = _folded(self.graph, p)
        if value is not None:
            if not 0.0 <= value <= 1.0:
                raise diag.DropoutProbabilityError(pspan, value=value)
            return
        op = self.graph.op(p)
        if op.kind == "param":
            bounds = (*op.attr("bounds", ()), (0.0, 1.0, "dropout probability", span))
            self.graph.set_op(p, op.replace(attrs=make_attrs(**(op.attr_map | {"bounds": bounds}))))

    def _random(self, x: int, seed: tuple[int, Span], span: Span, dist: str) -> int:
        """`random` at each element's flat (row-major) position in x, an i64."""
        shape = self.graph.op(x).shape
        position = self.b.const(0, DType.I64, span)
        stride = None
        for axis in reversed(range(len(shape))):
            if shape[axis] == 1:
                continue
            at = self.b.user_op("cast", [(self.b.user_op("index", [], span, axis=axis, shape=shape), span)],
                                span, dtype=DType.I64)
            if stride is not None:
                at = self.b.user_op("mul", [(at, span), (stride, span)], span)
            position = self.b.user_op("add", [(position, span), (at, span)], span)
            size = self.b.user_op("cast", [(self.b.size(shape[axis], span), span)], span, dtype=DType.I64)
            stride = size if stride is None else self.b.user_op("mul", [(stride, span), (size, span)], span)
        return self.b.user_op("random", [(position, span), seed], span, dist=dist)

    def _call_fill(self, e: ast.Call, b: Builtin, args: dict[str, ast.Expr]) -> int:
        """`full(x, value)` and `zeros(x)`: one number (a literal or a 0-d value) at x's shape
        in x's dtype, like torch.full_like; x's values are never read (no gradient flows)."""
        t = self.graph.op(self._value(args, "x")[0]).type
        zero = (self.b.const(0, DType.I32, e.span), e.span)
        value = self._value(args, "value") if "value" in args else zero
        if self.graph.op(value[0]).type.rank != 0:
            raise diag.RankError(value[1], message=(
                f"the value of '{e.func}' is one number, got {self.graph.op(value[0]).type}"))
        cast = self.b.user_op("cast", [value], e.span, dtype=t.dtype)
        return self.b.user_op("expand", [(cast, e.span)], e.span, shape=t.shape) if t.rank else cast

    def _call_causal(self, e: ast.Call, b: Builtin, args: dict[str, ast.Expr]) -> int:
        x, xspan = self._value(args, "x")
        t = self.graph.op(x).type
        if t.rank < 2:
            raise diag.RankError(e.span, [diag.Note(f"this value is {t}", xspan)],
                                 message=f"'causal' needs a value of rank 2 or more, got rank {t.rank}")
        row = self.b.user_op("index", [], e.span, axis=t.rank - 2, shape=t.shape)
        col = self.b.user_op("index", [], e.span, axis=t.rank - 1, shape=t.shape)
        return self.b.user_op("ge", [(row, e.span), (col, e.span)], e.span)


_ELEMENTWISE_SPELLING = {"max": "maximum", "min": "minimum"}

# builtins that need more than `_call_op` (axes checked against the operand's rank, macros)
_HANDLERS = {
    **{kind: "reduce" for kind, d in ops.OPS.items() if d.reduction is not None},
    **{kind: "along" for kind, d in ops.OPS.items() if d.scan is not None},
    "softmax": "along", "transpose": "transpose", "index": "index", "causal": "causal",
    "gather": "gather", "reshape": "reshape", "squeeze": "squeeze", "expand": "expand", "flip": "flip",
    "pad": "pad", "full": "fill", "zeros": "fill",
    "scatter": "scatter", "scatter_add": "scatter_add", "index_add": "index_add",
    "index_copy": "index_copy",
    "rand": "random", "randn": "random", "dropout": "dropout",
    "topk": "select", "sort": "select", "argsort": "select",
}


# builtins with several results (`values, indices = max(x, -1)`): how each is unpacked
_RESULTS = {"max": "extremum", "min": "extremum", "topk": "select", "sort": "select",
            "cummax": "cumulative", "cummin": "cumulative"}


# index_add and index_copy take torch's order, (x, axis, index, src), or the scatters' order,
# (x, index, src, axis=), told apart by the second argument: an axis is an integer literal
_SCATTER_ORDER = ("x", "index", "src")


def _bind(b: Builtin, call: ast.Call) -> dict[str, ast.Expr]:
    """Bind a call's arguments to the builtin's parameters, like Python does."""
    if b.name in ("index_add", "index_copy") and len(call.args) >= 2 and literal_int(call.args[1]) is None:
        if len(call.args) > len(_SCATTER_ORDER):
            raise diag.ArityError(call.span, name=b.name, expected=b.arity_text(), got=len(call.args))
        call = ast.Call(call.span, call.func, call.func_span, (), tuple(
            ast.Keyword(name, a, a.span) for name, a in zip(_SCATTER_ORDER, call.args, strict=False)
        ) + call.keywords, call.depth)
    if len(call.args) > len(b.params):
        raise diag.ArityError(call.span, name=b.name, expected=b.arity_text(), got=len(call.args))
    bound: dict[str, ast.Expr] = {p.name: a for p, a in zip(b.params, call.args, strict=False)}
    names = [p.name for p in b.params]
    for kw in call.keywords:
        if kw.name not in names:
            raise diag.KeywordError(kw.span, message=(
                f"'{b.name}' has no parameter '{kw.name}'{diag.did_you_mean(kw.name, names)} "
                f"(parameters: {', '.join(names)})"))
        if kw.name in bound:
            raise diag.KeywordError(kw.span, message=f"'{b.name}' got two values for '{kw.name}'")
        bound[kw.name] = kw.value
    for p in b.params:
        if p.name not in bound and p.default is REQUIRED:
            given = len(call.args) + len(call.keywords)
            if p.kind == "value" and not call.keywords:
                raise diag.ArityError(call.span, name=b.name, expected=b.arity_text(), got=given)
            raise diag.KeywordError(call.span, message=f"'{b.name}' is missing the argument '{p.name}'")
        arg = bound.get(p.name)
        if arg is not None and p.kind == "value" and isinstance(arg, ast.StrLit):
            raise diag.DTypeError(arg.span, message=f"'{p.name}' of '{b.name}' cannot be a string")
    return bound


def _folded(graph: Graph, node: int) -> object:
    """The value of a weak scalar expression of literals (`-0.5`, `0.5 * 3`), folded as
    Python computes it; None for anything else."""
    op = graph.op(node)
    if op.kind == "const":
        return op.attr("value")
    if not folds(op):
        return None
    values = [_folded(graph, o) for o in graph.operands(node)]
    if any(v is None for v in values):
        return None
    return fold_value(op, values)


def _constant(expr: ast.Expr | None, param: BParam, func: str) -> object:
    """The value of a constant argument (its default when not given)."""
    if param.kind == "dtype":
        if not isinstance(expr, ast.Name) or expr.id not in DTYPES:
            name = expr.id if isinstance(expr, ast.Name) else expr.span.text
            raise _unknown_dtype(expr.span, name)
        return DTYPES[expr.id]
    if param.kind == "str":
        return _const_str(expr, param, param.default)
    if expr is None:
        return param.default
    if param.kind == "bool":
        return const_bool(expr, f"'{param.name}' of '{func}'")
    if param.kind == "float":
        return _const_float(expr, f"'{param.name}' of '{func}'")
    return const_int(expr, f"'{param.name}' of '{func}'")


def _const_float(expr: ast.Expr, what: str) -> float:
    """A number literal, or one negated (an int one too: `beta=2`)."""
    negated = isinstance(expr, ast.Unary) and expr.op == "-"
    value = expr.operand if negated else expr
    if not isinstance(value, ast.IntLit | ast.FloatLit):
        raise diag.ConstantExpected(expr.span, what=what, expected="a number constant")
    return -float(value.value) if negated else float(value.value)


def _unknown_dtype(span: Span, name: str) -> diag.UnknownDTypeError:
    return diag.UnknownDTypeError(span, [diag.Note(f"the dtypes are {', '.join(PARAM_DTYPES)}")],
                                  name=name, hint=diag.did_you_mean(name, PARAM_DTYPES))


def _const_str(expr: ast.Expr | None, param, default: str) -> str:
    if expr is None:
        return default
    if not isinstance(expr, ast.StrLit) or expr.value not in param.choices:
        choices = " or ".join(f'"{c}"' for c in param.choices)
        raise diag.ConstantExpected(expr.span, what=f"'{param.name}'", expected=choices)
    return expr.value


def _check_hint(name: str, value: int, span: Span) -> None:
    def fail(requirement: str) -> None:
        raise diag.TileHintError(span, message=f"tile hint {name} must be {requirement}, got {value}")

    if name.startswith("BLOCK_"):
        if value < 1 or value & (value - 1):
            fail("a positive power of two")
        if value > 1024:
            fail("at most 1024")
    elif name == "num_warps":
        if value not in (1, 2, 4, 8, 16, 32):
            fail("one of 1, 2, 4, 8, 16, 32")
    elif name == "num_stages":
        if not 1 <= value <= 8:
            fail("between 1 and 8")
    elif name == "GROUP_M":
        if not 1 <= value <= 64:
            fail("between 1 and 64")
    elif name == "SPLITS":
        if not 1 <= value <= 1024:
            fail("between 1 and 1024")
