"""Generic kernels: dtype variables and `...` batch dims, bound per call.

    kernel rmsnorm[T: f16 | bf16 | f32](x: T[..., D], w: T[D], eps: f32) -> T[..., D]

A dtype variable (`T`) lists the dtypes it may bind; it binds the dtype of the tensors
passed for the parameters declared with it, which must agree. `...`, the first dim of a
type, binds the leading dims an argument has beyond the declared ones: one batch shape for
the whole signature, each parameter's right-aligned against it (NumPy's broadcasting: a
parameter may have fewer leading dims, as a bias has, or size 1 where another has more,
which `broadcast` expands without a copy). A binding (`Binding`) turns the
kernel into a concrete one, the same kernel with the variables and `...` written out
(`specialize`); `tiledsl.compile` returns a `Generic` that compiles one per binding on first
use and caches it, as sizes are.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiledsl import ast
from tiledsl import diagnostics as diag
from tiledsl.types import DTYPES, MAX_RANK, PARAM_DTYPES

ELLIPSIS = "..."


@dataclass(frozen=True, slots=True)
class Binding:
    """What a generic kernel is specialized to: each dtype variable's dtype, in declaration
    order, and how many leading dims `...` stands for."""

    dtypes: tuple[tuple[str, str], ...]
    batch: int
    leads: tuple[int, ...] = ()  # per parameter with `...`, in order: its leading dims

    def __str__(self) -> str:
        parts = [f"{var}={dtype}" for var, dtype in self.dtypes]
        return ",".join(parts + [f"...={self.batch}"] if self.leads else parts)


def is_generic(kernel: ast.Kernel) -> bool:
    return bool(kernel.type_params) or any(has_ellipsis(t) for t in _types(kernel))


def _types(kernel: ast.Kernel) -> list[ast.TypeExpr]:
    return [p.type for p in kernel.params] + list(kernel.returns)


def has_ellipsis(t: ast.TypeExpr) -> bool:
    return any(d.value == ELLIPSIS for d in t.dims or ())


def check(kernel: ast.Kernel) -> None:
    """The signature's generic parts are well formed: each variable declared once, its dtypes
    real, distinct and used by some tensor parameter (so a call binds it); `...` only first
    and in some parameter when the result has it."""
    seen: dict[str, ast.TypeParam] = {}
    for tp in kernel.type_params:
        if tp.name in seen:
            raise diag.DTypeError(tp.span, [diag.Note("first declared here", seen[tp.name].span)],
                                  message=f"dtype variable '{tp.name}' is declared twice")
        if tp.name in DTYPES:
            raise diag.DTypeError(tp.span, message=(
                f"'{tp.name}' names a dtype: a dtype variable needs a name of its own"))
        seen[tp.name] = tp
        for name, span in zip(tp.dtypes, tp.dtype_spans, strict=True):
            if name not in PARAM_DTYPES:
                raise diag.UnknownDTypeError(span, [diag.Note(f"the dtypes are {', '.join(PARAM_DTYPES)}")],
                                             name=name, hint=diag.did_you_mean(name, PARAM_DTYPES))
        if len(set(tp.dtypes)) != len(tp.dtypes):
            raise diag.DTypeError(tp.span, message=f"dtype variable '{tp.name}' lists a dtype twice")
        if not any(p.type.dtype == tp.name and p.type.dims is not None for p in kernel.params):
            raise diag.DTypeError(tp.span, message=(
                f"dtype variable '{tp.name}' is not the dtype of any tensor parameter, so no call "
                "could bind it"))
    names = [(p.name, p.name_span) for p in kernel.params] + [
        (target, span) for stmt in kernel.body if not isinstance(stmt, ast.Return | ast.AssignItem)
        for target, span in (zip(stmt.targets, stmt.target_spans, strict=True)
                             if isinstance(stmt, ast.Unpack) else [(stmt.target, stmt.target_span)])]
    for name, span in names:
        if name in seen:
            raise diag.DTypeError(span, [diag.Note("the dtype variable", seen[name].span)],
                                  message=f"'{name}' names both a dtype variable and a value")
    for t in _types(kernel):
        for i, d in enumerate(t.dims or ()):
            if d.value == ELLIPSIS and i:
                raise diag.RankError(d.span, message="'...' stands for leading dims: it must come first")
    params = [p.type for p in kernel.params]
    if any(has_ellipsis(t) for t in kernel.returns) and not any(has_ellipsis(t) for t in params):
        span = next(d.span for t in kernel.returns for d in t.dims or () if d.value == ELLIPSIS)
        raise diag.RankError(span, message=(
            "the return type has '...' but no parameter does, so no call could bind it"))


@functools.cache
def _of_torch() -> dict[Any, str]:
    """A torch dtype's name in the language."""
    from tiledsl.binding import torch_dtype

    return {torch_dtype(d): d.value for d in DTYPES.values() if d.value in PARAM_DTYPES}


def bind(kernel: ast.Kernel, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Binding:
    """The binding a call's arguments give (tensors by their dtype and rank); an argument that
    binds nothing is left for the specialized kernel's own checks to refuse."""
    of_torch = _of_torch()
    names = [p.name for p in kernel.params]
    passed: dict[str, Any] = dict(zip(names, args, strict=False))  # too many: the binder's error
    passed.update((k, v) for k, v in kwargs.items() if k in names)
    variables = {tp.name: tp for tp in kernel.type_params}
    dtypes: dict[str, tuple[str, ast.Param]] = {}
    batch = 0
    leads: list[int] = []
    for p in kernel.params:
        value = passed.get(p.name)
        shape = getattr(value, "shape", None)
        dtype = getattr(value, "dtype", None)
        if p.type.dims is None or shape is None or dtype is None:
            leads += [0] if p.type.dims is not None and has_ellipsis(p.type) else []
            continue
        if p.type.dtype in variables:
            tp = variables[p.type.dtype]
            name = of_torch.get(dtype, str(dtype))
            if name not in tp.dtypes:
                raise diag.ArgumentError(p.type.dtype_span, message=(
                    f"argument '{p.name}' is {dtype}, but its dtype variable '{tp.name}' binds "
                    f"{' | '.join(tp.dtypes)}"))
            if tp.name in dtypes and dtypes[tp.name][0] != name:
                first, other = dtypes[tp.name]
                raise diag.ArgumentError(p.type.dtype_span, [diag.Note(
                    f"'{other.name}' bound it to {first} here", other.type.dtype_span)], message=(
                    f"argument '{p.name}' is {name}, but dtype variable '{tp.name}' is already {first}"))
            dtypes.setdefault(tp.name, (name, p))
        if has_ellipsis(p.type):
            fixed = len(p.type.dims) - 1
            if len(shape) < fixed:
                raise diag.ArgumentError(p.type.span, message=(
                    f"argument '{p.name}' has {len(shape)} dims, but its type needs at least {fixed} "
                    "after '...'"))
            leads.append(len(shape) - fixed)
            batch = max(batch, len(shape) - fixed)
    missing = [tp for tp in kernel.type_params if tp.name not in dtypes]
    if missing:
        tp = missing[0]
        raise diag.ArgumentError(tp.span, message=(
            f"no tensor argument binds dtype variable '{tp.name}'"))
    return Binding(tuple((tp.name, dtypes[tp.name][0]) for tp in kernel.type_params), batch, tuple(leads))


def fixed_dims(kernel: ast.Kernel) -> dict[str, int]:
    """Each parameter with `...`: how many dims its type declares after it."""
    return {p.name: len(p.type.dims) - 1 for p in kernel.params if p.type.dims and has_ellipsis(p.type)}


def broadcast(names: Sequence[str], fixed: Mapping[str, int], args: tuple,
              kwargs: dict) -> tuple[tuple, dict]:
    """The arguments (of parameters `names`, those with `...` in `fixed`, as `fixed_dims`
    gives) with each leading dim of size 1 expanded, without a copy (a stride of 0), to the
    size another argument has there: NumPy's broadcasting, which a specialization, whose
    batch dims are sizes bound once, does not do itself. Autograd sums an expanded
    argument's gradient back over its broadcast dims. Sizes that differ and are not 1 are
    left for the specialization's error."""
    leading: dict[str, tuple[int, ...]] = {}
    for name, value in (*zip(names, args, strict=False), *kwargs.items()):
        # (isinstance, not hasattr: torch.compile traces this, and a scalar may be a SymFloat)
        if name in fixed and isinstance(value, torch.Tensor) and value.dim() >= fixed[name]:
            leading[name] = tuple(value.shape[:value.dim() - fixed[name]])
    if len(leading) < 2 or len(set(leading.values())) == 1:
        return args, kwargs
    batch = [1] * max(map(len, leading.values()))
    for lead in leading.values():
        for i, n in enumerate(lead, len(batch) - len(lead)):
            batch[i] = n if batch[i] == 1 else batch[i]

    def expanded(name: str, value: Any) -> Any:
        lead = leading.get(name)
        if lead is None:
            return value
        target = tuple(b if n == 1 else n for n, b in zip(lead, batch[len(batch) - len(lead):], strict=True))
        return value if target == lead else value.expand(*target, *value.shape[len(lead):])

    args = tuple(expanded(n, v) for n, v in zip(names, args, strict=False)) + args[len(names):]
    return args, {k: expanded(k, v) for k, v in kwargs.items()}


def batch_names(kernel: ast.Kernel, batch: int) -> tuple[str, ...]:
    """Fresh dim names for the `batch` leading dims: batch0, batch1, ... (with underscores
    appended where the kernel already uses such a name)."""
    used = {d.value for t in _types(kernel) for d in t.dims or () if isinstance(d.value, str)}
    used |= {n.id for n in _walk(kernel.body) if isinstance(n, ast.Name)}
    prefix = "batch"
    while any(f"{prefix}{i}" in used for i in range(batch)):
        prefix += "_"
    return tuple(f"{prefix}{i}" for i in range(batch))


def specialize(kernel: ast.Kernel, binding: Binding) -> ast.Kernel:
    """The concrete kernel `binding` makes of `kernel`: every dtype variable (in types, and
    named in the body, as `cast(x, T)`) replaced by its dtype, and `...` by the batch dims
    (right-aligned: a parameter with fewer dims than the batch takes the last ones)."""
    dtypes = dict(binding.dtypes)
    lead = batch_names(kernel, binding.batch)
    leads = iter(binding.leads)

    def typ(t: ast.TypeExpr, n: int) -> ast.TypeExpr:
        dims = t.dims
        if dims and dims[0].value == ELLIPSIS:
            dims = tuple(ast.DimExpr(name, dims[0].span) for name in lead[binding.batch - n:]) + dims[1:]
        return dataclasses.replace(t, dtype=dtypes.get(t.dtype, t.dtype), dims=dims)

    params = tuple(dataclasses.replace(p, type=typ(p.type, next(leads, binding.batch)
                                                   if has_ellipsis(p.type) else 0))
                   for p in kernel.params)
    returns = tuple(typ(t, binding.batch) for t in kernel.returns)
    body = _substitute(kernel.body, dtypes)
    return dataclasses.replace(kernel, type_params=(), params=params, returns=returns, body=body)


def _walk(node: Any):
    if isinstance(node, tuple):
        for item in node:
            yield from _walk(item)
    elif type(node).__module__ == ast.__name__:
        yield node
        for f in dataclasses.fields(node):
            yield from _walk(getattr(node, f.name))


def _substitute(node: Any, dtypes: Mapping[str, str]) -> Any:
    """`node` with every `Name` of a dtype variable renamed to its dtype."""
    if isinstance(node, tuple):
        return tuple(_substitute(item, dtypes) for item in node)
    if isinstance(node, ast.Name):
        return dataclasses.replace(node, id=dtypes.get(node.id, node.id))
    if type(node).__module__ == ast.__name__ and dataclasses.is_dataclass(node):
        changes = {f.name: _substitute(getattr(node, f.name), dtypes) for f in dataclasses.fields(node)}
        return dataclasses.replace(node, **changes)
    return node


def signature(kernel: ast.Kernel) -> str:
    """What makes a kernel generic, for messages: `[T: f16 | bf16], '...'`."""
    parts = []
    if kernel.type_params:
        variables = (f"{tp.name}: {' | '.join(tp.dtypes)}" for tp in kernel.type_params)
        parts.append("[" + ", ".join(variables) + "]")
    if any(has_ellipsis(t) for t in _types(kernel)):
        parts.append("'...'")
    return ", ".join(parts)


def canonical(kernel: ast.Kernel) -> str:
    """The kernel's syntax tree without positions: the same for the same kernel from any file,
    with any comments, whitespace or layout (a generic op's identity)."""

    def render(node: Any) -> str:
        if isinstance(node, tuple):
            return "(" + ",".join(render(n) for n in node) + ")"
        if type(node).__module__ == ast.__name__ and dataclasses.is_dataclass(node):
            fields = [f"{f.name}={render(getattr(node, f.name))}" for f in dataclasses.fields(node)
                      if not f.name.endswith("span") and not f.name.endswith("spans")]
            return f"{type(node).__name__}({','.join(fields)})"
        return repr(node)

    return render(kernel)


def given(kernel: ast.Kernel, batch: int, dtypes: Mapping[str, str], where: str) -> Binding:
    """The binding given by hand (`Generic.specialize`, the CLI's --bind): each dtype
    variable's dtype, and `batch` leading dims for every parameter with `...`."""
    variables = {tp.name: tp for tp in kernel.type_params}
    unknown = sorted(set(dtypes) - set(variables))
    if unknown:
        raise diag.OptionError(message=(
            f"{where}: '{unknown[0]}' is not a dtype variable of '{kernel.name}'"
            f"{diag.did_you_mean(unknown[0], variables)}"))
    missing = [v for v in variables if v not in dtypes]
    if missing:
        raise diag.OptionError(message=f"{where}: give every dtype variable: {', '.join(missing)}")
    for var, dtype in dtypes.items():
        if dtype not in variables[var].dtypes:
            raise diag.OptionError(message=(
                f"{where}: {var}={dtype!r} is not one of {' | '.join(variables[var].dtypes)}"))
    if batch < 0:
        raise diag.OptionError(message=f"{where}: '...' stands for 0 or more dims, not {batch}")
    _check_rank(kernel, batch)
    leads = tuple(batch for p in kernel.params if has_ellipsis(p.type))
    return Binding(tuple((v, dtypes[v]) for v in variables), batch, leads)


def _check_rank(kernel: ast.Kernel, batch: int) -> None:
    """Refuse a binding whose `...` makes some type's rank pass `MAX_RANK` before its batch
    dims are named (a binding of 10^8 dims would build 10^8 names first): the rank-limit
    error sema gives for that type, at the first such type (parameters, then results)."""
    for t in _types(kernel):
        if has_ellipsis(t) and len(t.dims) - 1 + batch > MAX_RANK:
            raise diag.LimitError(t.span, what=f"rank {len(t.dims) - 1 + batch}", limit=MAX_RANK)


# Digits of a `--bind ...=N` read as a number: any more name a rank past every limit, and
# int() of thousands of digits is refused by Python (or slow).
_MAX_BATCH_DIGITS = 18


def parse_binding(kernel: ast.Kernel, text: str) -> Binding:
    """The CLI's `--bind T=bf16,...=2`: dtype variables and the batch dims' count."""
    dtypes: dict[str, str] = {}
    batch = 0
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not eq:
            raise diag.OptionError(message=f"--bind {text}: give NAME=VALUE pairs, e.g. T=bf16,...=2")
        if name == ELLIPSIS:
            # ASCII digits only: str.isdigit() takes '²' and '١', which int() refuses or reads
            if not (value.isascii() and value.isdigit()):
                raise diag.OptionError(message=(
                    f"--bind {text}: '...' takes a number of dims, got {value[:40]!r}"))
            digits = value.lstrip("0") or "0"
            if len(digits) > _MAX_BATCH_DIGITS:
                raise diag.OptionError(message=(
                    f"--bind {text[:80]}...: '...' takes a number of dims; {len(digits)} digits "
                    f"pass the rank limit of {MAX_RANK}"))
            batch = int(digits)
        else:
            dtypes[name] = value
    return given(kernel, batch, dtypes, f"--bind {text}")


def every_binding(kernel: ast.Kernel, batch: int = 1) -> list[Binding]:
    """Each combination of the dtype variables' dtypes, with `batch` leading dims."""
    import itertools

    names = [tp.name for tp in kernel.type_params]
    return [given(kernel, batch, dict(zip(names, combo, strict=True)), "check")
            for combo in itertools.product(*(tp.dtypes for tp in kernel.type_params))]


# `tiledsl check` checks every combination of a kernel's dtypes up to this many; past it, a
# covering set (eight variables of eleven dtypes each are 2 * 10^8 combinations)
CHECK_EVERY = 64
# ... in which every two variables' dtypes meet, while there are at most this many such pairs
# (about 18 variables of eleven dtypes; the set is a few hundred bindings); past it, one in
# which each variable takes each of its dtypes
CHECK_PAIRS = 20_000


@dataclass(frozen=True, slots=True)
class CheckSet:
    """The bindings `tiledsl check` checks, of `total` combinations: "every" one, a set in
    which every pair of dtypes of two variables occurs ("pairs"), or one in which every
    dtype of every variable does ("dtypes")."""

    bindings: tuple[Binding, ...]
    total: int
    coverage: str


def check_bindings(kernel: ast.Kernel, batch: int = 1) -> CheckSet:
    """The bindings to check a generic kernel with, without enumerating more than
    CHECK_EVERY combinations (`tiledsl.covering`)."""
    from tiledsl import covering

    domains = [len(tp.dtypes) for tp in kernel.type_params]
    total = math.prod(domains)
    if total <= CHECK_EVERY:
        return CheckSet(tuple(every_binding(kernel, batch)), total, "every")
    if covering.pair_count(domains) <= CHECK_PAIRS:
        rows, coverage = covering.pairwise(domains), "pairs"
    else:
        rows, coverage = covering.each_choice(domains), "dtypes"
    return CheckSet(tuple(given(kernel, batch, {tp.name: tp.dtypes[c] for tp, c in zip(
        kernel.type_params, row, strict=True)}, "check") for row in rows), total, coverage)
