"""A compiled program as a PyTorch operator: `torch.ops.tiledsl.<kernel>_<hash>`.

Each `Program` is registered, through `torch.library`, as a custom op with

- a schema from its signature (`Tensor` per tensor parameter, `float`, `int` or
  `bool` per scalar, one `Tensor` per output). A parameter whose name the schema
  parser or Python reserves (`in`, `if`, `None`, `self`, `Tensor`, ...) is renamed
  `arg<i>_<name>` in the schema only. Past torch's limit of 64 schema arguments
  the arguments are packed by kind (`Convention`): `(Tensor[] tensors,
  float[] floats, int[] ints, bool[] bools)`, each list in parameter order;
- a CPU and a CUDA kernel that run the program (CPU through Triton's interpreter);
- a fake (meta) kernel from the IR's shape inference: each declared dim binds to
  the size of the parameter that declares it (a SymInt under dynamic shapes)
  and each output is an empty tensor of its declared shape and dtype, so
  `torch.compile`, `torch.export` and FakeTensor tracing see through calls;
- an Autograd kernel that, when some input needs a gradient, runs the training
  forward (the program returning the values its backward saves, an op of its
  own) and, on backward, the backward program (another op): both are derived
  by `tiledsl.autodiff` and compiled through the same pipeline. Under
  `torch.no_grad()`, or when no input needs a gradient, it runs the plain
  program and saves nothing. The backward is itself differentiable (double
  backward): under `create_graph=True` it recomputes the saved values through
  the training forward's op, so their dependence on the inputs is seen;
- a vmap rule (`torch.vmap`): one call per batch element, outputs stacked.
  The autograd function has `setup_context`, so `torch.func.grad` works too.

The name is the kernel's name and the SHA-256 of its graph IR (no source name, comment
or line position) and compile options, all 64 hex digits; registration compares the text
hashed, so two programs never share an op (a collision is refused): the same program, compiled twice or from
another file, gives the same op, in any process running the same build of tiledsl (its
sources hashed too: a backward op is the compiler's derivation, and torch.compile's caches
outlive the process). A generic kernel (`tiledsl.generic`)
is one op for all its bindings, named by its syntax tree without positions. Every live
program of that name is remembered weakly; when the last one is collected its
registration is released (at the next registration), so compiling many
programs does not keep every op forever. Registration happens once per name,
under a lock (several threads may compile the same program at once); a forked
child starts with fresh locks.
"""

from __future__ import annotations

import functools
import hashlib
import keyword
import os
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tiledsl import diagnostics as diag
from tiledsl import sharding
from tiledsl.binding import torch_dtype
from tiledsl.dims import evaluate
from tiledsl.ir import Graph
from tiledsl.types import DType

if TYPE_CHECKING:
    from tiledsl.api import Generic, Program, Training

NAMESPACE = "tiledsl"
MAX_SCHEMA_ARGS = 64  # torch's FunctionSchema limit: "this PyTorch build only supports 64"
_SCALAR_TYPES = {DType.F32: "float", DType.F16: "float", DType.BF16: "float", DType.I8: "int",
                 DType.U8: "int", DType.I16: "int", DType.I32: "int", DType.I64: "int", DType.BOOL: "bool"}
# names a schema argument may not have (its type names, and `self`/`out`, which torch's op
# machinery treats specially); Python keywords are refused too, and anything else the schema
# parser does not read back as the same name (`_schema_safe`)
_RESERVED = {"self", "out", "Tensor", "float", "int", "bool", "str", "None", "NoneType", "Scalar",
             "Device", "Layout", "ScalarType", "MemoryFormat", "Storage", "Generator", "SymInt",
             "SymFloat", "SymBool", "Dimname", "QScheme", "Stream", "Any", "complex"}
# a packed op's lists, in schema order: (kind, list type, argument name)
_PACKED = (("Tensor", "Tensor[]", "tensors"), ("float", "float[]", "floats"),
           ("int", "int[]", "ints"), ("bool", "bool[]", "bools"))

AUTOCAST_DEVICES = ("cpu", "cuda")  # the device types whose autocast the ops take part in
_lock = threading.RLock()  # guards _REGISTRY; every registration runs under it
_REGISTRY: dict[str, _Registration] = {}  # op name -> its registration
_released: list[str] = []  # names whose last program was collected, released at the next register


def _reset_after_fork() -> None:
    """A forked child has only the forking thread: a lock another thread held is held forever."""
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_reset_after_fork)


@dataclass(frozen=True)
class Identity:
    """What an op stands for: its name, `<kernel>_<sha256>` (all 64 hex digits: a shorter
    hash can be made to collide by a birthday search over a program's constants), and the
    text hashed, which registration compares so that one name is never two programs."""

    name: str
    text: str


def identity(program: Program) -> Identity:
    """The program's graph IR (no source name, comment, whitespace or line position enters
    it) and options: the same program, from any file or as text, is the same op in every
    process, so an exported program loads wherever it is compiled."""
    from tiledsl.printer import print_graph

    return _hashed(program.name, print_graph(program.source_graph),
                   (program.backend, program.pipeline, program.allow_tf32))


def generic_identity(fn: Generic) -> Identity:
    """A generic kernel's: its syntax tree without positions, and every option of `compile`
    (they shape each specialization: `check_bounds` adds outputs)."""
    from tiledsl import generic

    return _hashed(fn.name, generic.canonical(fn.kernel), fn._origin.options)


def _hashed(name: str, text: str, options: tuple) -> Identity:
    text = "\n".join((name, text, *map(str, options), compiler_fingerprint()))
    return Identity(f"{name}_{_digest(text)}", text)


@functools.cache
def compiler_fingerprint() -> str:
    """The SHA-256 of the compiler's own sources (its modules, grammar and library). It
    enters every op's name: what an op computes, and the backward op its autograd formula
    calls, are the compiler's derivation of the program, so a graph that torch.compile
    cached on disk (AOTAutograd's and Inductor's caches outlive the process) never calls a
    backward that another build of tiledsl named."""
    import tiledsl
    from tiledsl import backends, passes

    h = hashlib.sha256()
    for root in sorted({Path(m.__file__).parent for m in (tiledsl, passes, backends)}):
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".lark", ".tdsl") and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Convention:
    """How the op takes a program's arguments: one schema argument per parameter, or, past
    `MAX_SCHEMA_ARGS`, one list per kind of parameter (`_PACKED`), each in parameter order."""

    kinds: tuple[str, ...]  # per parameter: "Tensor", "float", "int" or "bool"
    names: tuple[str, ...]  # per parameter: its name in the schema
    packed: bool

    @staticmethod
    def of(graph: Graph) -> Convention:
        params = [graph.op(p) for p in graph.params]
        kinds = tuple(_SCALAR_TYPES[p.dtype] if p.attr("scalar") else "Tensor" for p in params)
        return Convention(kinds, _schema_names([p.attr("name") for p in params]),
                          len(params) > MAX_SCHEMA_ARGS)

    @staticmethod
    def of_kernel(kernel: Any) -> Convention:
        """A generic kernel's (`ast.Kernel`): a scalar typed by a dtype variable takes the
        kind its dtypes share."""
        from tiledsl.types import DTYPES

        variables = {tp.name: tp.dtypes for tp in kernel.type_params}
        kinds = []
        for p in kernel.params:
            if p.type.dims is not None:
                kinds.append("Tensor")
                continue
            options = {_SCALAR_TYPES.get(DTYPES.get(d)) for d in variables.get(p.type.dtype, (p.type.dtype,))}
            if len(options) != 1 or None in options:
                raise diag.DTypeError(p.type.span, message=(
                    f"scalar parameter '{p.name}': its dtypes must all be floats, all integers or bool"))
            kinds.append(options.pop())
        return Convention(tuple(kinds), _schema_names([p.name for p in kernel.params]),
                          len(kinds) > MAX_SCHEMA_ARGS)

    @property
    def lists(self) -> tuple[tuple[str, str, str], ...]:
        """The packed lists this program has (a kind no parameter has is left out)."""
        return tuple(entry for entry in _PACKED if entry[0] in self.kinds)

    def arguments(self) -> str:
        """The schema's argument list, `Tensor x, Tensor w, float eps`."""
        if self.packed:
            return ", ".join(f"{list_type} {name}" for _, list_type, name in self.lists)
        return ", ".join(f"{kind} {name}" for kind, name in zip(self.kinds, self.names, strict=True))

    def pack(self, args: Sequence[Any]) -> tuple:
        """The op's arguments for the program's arguments (in parameter order)."""
        if not self.packed:
            return tuple(args)
        return tuple([a for a, k in zip(args, self.kinds, strict=True) if k == kind]
                     for kind, _, _ in self.lists)

    def unpack(self, op_args: Sequence[Any]) -> tuple:
        """The program's arguments, in parameter order, from the op's (`pack`'s inverse). A
        non-tensor entry of a packed `Tensor[]`'s position (vmap's None in_dims) repeats."""
        if not self.packed:
            return tuple(op_args)
        lists = {kind: (iter(v) if isinstance(v, list | tuple) else _repeat(v))
                 for (kind, _, _), v in zip(self.lists, op_args, strict=True)}
        return tuple(next(lists[k]) for k in self.kinds)


def _repeat(value: Any):
    while True:
        yield value


def schema(graph: Graph) -> str:
    """The op's argument and return list, `(Tensor x, float eps) -> Tensor`."""
    return f"({Convention.of(graph).arguments()}) -> {_returns(len(graph.returns) - len(graph.checks))}"


def _returns(n: int) -> str:
    return "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"


def _schema_names(names: Sequence[str]) -> tuple[str, ...]:
    """Each parameter's name in the schema: its own, or `arg<i>_<name>` (unique) where the
    schema parser or Python reserves it."""
    kept = {n for n in names if _schema_safe(n)}
    out = []
    for i, name in enumerate(names):
        if name not in kept:
            mangled = f"arg{i}_{name}"
            while mangled in kept:
                mangled += "_"
            kept.add(mangled)
            name = mangled
        out.append(name)
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _schema_safe(name: str) -> bool:
    """Can `name` stand as a schema argument name and a Python keyword argument?"""
    if keyword.iskeyword(name) or name in _RESERVED or name.startswith("_"):
        return False
    try:
        parsed = torch._C.parse_schema(f"f(Tensor {name}) -> Tensor")
    except RuntimeError:
        return False
    return parsed.arguments[0].name == name


def register(program: Program | Generic) -> Any:
    """The op running `program` (an `OpOverload`), registered once per name; `program` is
    remembered weakly (`_sweep`). It takes the arguments as `Convention.of(graph)` packs them.
    A generic kernel has one op for all its bindings: each call runs (and its fake kernel
    shapes the outputs of) the specialization its arguments bind."""
    from tiledsl.api import Generic

    generic = isinstance(program, Generic)
    ident = generic_identity(program) if generic else identity(program)
    name = ident.name
    with _lock:
        _sweep()
        reg = _REGISTRY.get(name)
        if reg is not None and reg.text != ident.text:
            # a hash collision: serving this program's calls with the other's kernels would
            # be silently wrong, so it gets no op (its plain calls still run it)
            raise diag.InternalError(program.source_graph.span if not generic else program.kernel.span,
                                     message=(f"'{program.name}' and another live program hash to the "
                                              f"same op name torch.ops.{NAMESPACE}.{name}; their graphs "
                                              "differ, so neither may run the other's kernels"))
        if reg is None:
            if generic:
                convention = Convention.of_kernel(program.kernel)
                reg = _Registration(ident, convention, f"({convention.arguments()}) -> "
                                    f"{_returns(len(program.kernel.returns))}", len(program.kernel.returns),
                                    None)
            else:
                graph = program.source_graph
                convention = Convention.of(graph)
                reg = _Registration(ident, convention, schema(graph), len(graph.returns) - len(graph.checks),
                                    _fake(graph, convention))
            _REGISTRY[name] = reg
            if "torch.distributed.tensor" in sys.modules:  # else when a DTensor first arrives
                _shard(reg)
        reg.programs.add(program)
        weakref.finalize(program, _released.append, name)
        return reg.op


def _shard(reg: _Registration) -> None:
    """Register `reg`'s op's DTensor sharding rules (called under _lock)."""
    if not reg.convention.packed:
        sharding.register(reg.op, reg.sharding_rules)
    reg.sharded = True


def shard_for(args: Sequence[Any]) -> None:
    """Before a call with a DTensor argument: the sharding rules of every op registered
    before `torch.distributed.tensor` was imported (registering them imports it, 0.6 s a
    process: paid by programs that meet a DTensor, not by every first compile)."""
    if "torch.distributed.tensor" in sys.modules and any(type(a).__name__ == "DTensor" for a in args):
        with _lock:
            for reg in list(_REGISTRY.values()):
                if not reg.sharded:
                    _shard(reg)


def _sweep() -> None:
    """Release the registrations whose programs have all been collected (called under _lock;
    not from the finalizer itself, which may run inside any call, even the dispatcher's)."""
    while _released:
        name = _released.pop()
        reg = _REGISTRY.get(name)
        if reg is not None and not reg.programs:
            del _REGISTRY[name]
            reg.lib._destroy()


def registered() -> int:
    """How many ops are registered now (programs alive, or collected since the last sweep)."""
    with _lock:
        _sweep()
        return len(_REGISTRY)


class _Registration:
    """One op: its library (the registrations), its calling convention, and the live programs
    that run it (weakly: the first one alive runs a call; all compute the same thing)."""

    def __init__(self, ident: Identity, convention: Convention, signature: str, n_outputs: int,
                 fake: Any | None) -> None:
        self.name = name = ident.name
        self.text = ident.text  # what the name hashes: a program of this name must have it
        self.convention = convention
        self.n_outputs = n_outputs
        self.sharded = False  # its DTensor sharding rules registered (`_shard`)
        self.programs: weakref.WeakSet[Program | Generic] = weakref.WeakSet()
        lib = torch.library.Library(NAMESPACE, "FRAGMENT")
        lib.define(name + signature)
        lib.impl(name, self._run, "CPU")
        lib.impl(name, self._run, "CUDA")
        lib.impl(name, self._autograd, "Autograd")
        qualified = f"{NAMESPACE}::{name}"
        torch.library.register_fake(qualified, fake or self._generic_fake, lib=lib)
        torch.library.register_vmap(qualified, self._vmap, lib=lib)
        self.lib = lib
        self.op = getattr(getattr(torch.ops, NAMESPACE), name).default
        for device_type in AUTOCAST_DEVICES:
            _register_autocast(self, device_type)

    def program(self) -> Program | Generic:
        for program in self.programs:
            return program
        raise diag.OptionError(message=(
            f"torch.ops.{NAMESPACE}.{self.name}: the program this op runs is no longer referenced "
            "(keep the compiled program alive while its op is used, or compile it again)"))

    def _generic_fake(self, *op_args: Any) -> Any:
        """A generic op's fake kernel: the outputs of the specialization the arguments bind
        (compiled here on first use, outside the fake mode: compiling makes real tensors)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            program = self.program().resolve(self.convention.unpack(op_args))
        return _fake(program.source_graph, program._convention)(*op_args)

    def sharding_rules(self, args: Sequence[Any]) -> list[tuple[list[Any], list[Any]]]:
        """DTensor's acceptable placements for a call (`tiledsl.sharding`), from the graph of
        the program the arguments run (DTensor's specs stand for the tensors)."""
        specs = [sharding.SpecView(a) if hasattr(a, "tensor_meta") else a for a in args]
        return sharding.rules(self.program().resolve(specs).source_graph)

    def _run(self, *op_args: Any) -> Any:
        args = self.convention.unpack(op_args)
        return self.program().resolve(args)._run_op(args)

    def _autograd(self, *op_args: Any) -> Any:
        args = self.convention.unpack(op_args)
        program = self.program().resolve(args)
        refuse_forward_mode(program, args)
        wrt = program.wants_grad(args)
        if not wrt:
            with torch._C._AutoDispatchBelowAutograd():
                return self.op(*op_args)
        if torch._C._are_functorch_transforms_active():  # functorch cannot see this far in
            raise diag.GradientError(program.source_graph.span, message=(
                f"'{program.name}': under torch.func's transforms, call the compiled program "
                "itself (fn(...)), not fn.op: torch.func cannot differentiate through a custom "
                "op's Autograd kernel"))
        return differentiated(program, wrt, args)

    def _vmap(self, info: Any, in_dims: Sequence[Any], *op_args: Any) -> tuple[Any, Any]:
        """One call per batch element (the program's shapes are its own: no batch axis to
        fold it into in general), outputs stacked along a new leading axis."""
        args = self.convention.unpack(op_args)
        dims = self.convention.unpack(in_dims)
        rows = []
        for b in range(info.batch_size):
            sliced = [a if d is None else a.select(d, b) for a, d in zip(args, dims, strict=True)]
            out = self.op(*self.convention.pack(sliced))
            rows.append(out if isinstance(out, tuple) else (out,))
        outs = tuple(torch.stack(column) for column in zip(*rows, strict=True))
        if self.n_outputs == 1:
            return outs[0], 0
        return outs, (0,) * self.n_outputs


def _register_autocast(reg: _Registration, device_type: str) -> None:
    """Under `torch.autocast(device_type)` the op casts its floating-point tensor arguments
    (`autocast_args`), then runs below autocast. Registered as torch.library.register_autocast
    does (a kernel, and the same for the Python dispatcher torch.compile traces with)."""
    key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    key = getattr(torch._C.DispatchKey, key_name)

    plans: list[AutocastPlan] = []  # the program's, made at its first call under autocast

    def cast_and_run(*op_args: Any) -> Any:
        args = reg.convention.unpack(op_args)
        if not plans:
            plans.append(autocast_plan(reg.program()))
        cast = autocast_args(plans[0], args, torch.get_autocast_dtype(device_type), device_type)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return reg.op(*reg.convention.pack(cast))

    reg.op.py_impl(key)(cast_and_run)
    reg.lib.impl(reg.name, lambda _keyset, *op_args: cast_and_run(*op_args), key_name, with_keyset=True)


@dataclass(frozen=True)
class AutocastPlan:
    """What a call under autocast casts, fixed per program: each parameter's declared dtype,
    or (None) the dtype variable typing it; each variable's dtypes; does the kernel multiply
    matrices?"""

    declared: tuple[torch.dtype | None, ...]
    typed_by: tuple[str | None, ...]
    variables: Mapping[str, tuple[torch.dtype, ...]]
    matmul: bool


def autocast_plan(program: Program | Generic) -> AutocastPlan:
    from tiledsl import ast
    from tiledsl.api import Generic
    from tiledsl.generic import _walk
    from tiledsl.types import DTYPES

    if not isinstance(program, Generic):
        graph = program.source_graph
        return AutocastPlan(tuple(torch_dtype(graph.op(p).dtype) for p in graph.params),
                            tuple(None for _ in graph.params), {}, False)
    kernel = program.kernel
    variables = {tp.name: tuple(torch_dtype(DTYPES[d]) for d in tp.dtypes) for tp in kernel.type_params}
    typed_by = tuple(p.type.dtype if p.type.dtype in variables else None for p in kernel.params)
    declared = tuple(None if v else torch_dtype(DTYPES[p.type.dtype]) for p, v in zip(kernel.params, typed_by,
                                                                                       strict=True))
    matmul = any(isinstance(n, ast.Binary) and n.op == "@" for n in _walk(kernel.body))
    return AutocastPlan(declared, typed_by, variables, matmul)


def autocast_args(plan: AutocastPlan, args: Sequence[Any], dtype: torch.dtype, device_type: str) -> tuple:
    """The arguments a call under autocast runs with. Only floating-point tensors on the
    autocast device change, as torch's autocast casts:
    - a parameter of a declared dtype (`x: f16[N]`) takes its tensor cast to that dtype;
    - the parameters a dtype variable types (`x: T[..., K]`) take the autocast dtype when the
      kernel multiplies matrices (torch's matmul-class ops: `linear`, `matmul`) and T may be
      it; otherwise the widest of their dtypes (torch's promote ops), so a bf16 activation
      meets an f32 weight."""

    def floating(a: Any) -> bool:
        return isinstance(a, torch.Tensor) and a.is_floating_point() and a.device.type == device_type

    targets: dict[str, torch.dtype] = {}
    for name, choices in plan.variables.items():
        typed = [a.dtype for a, v in zip(args, plan.typed_by, strict=True) if v == name and floating(a)]
        if plan.matmul and dtype in choices:
            targets[name] = dtype
        elif typed:
            widest = functools.reduce(torch.promote_types, typed)
            if widest in choices:
                targets[name] = widest
    out = []
    for a, t, v in zip(args, plan.declared, plan.typed_by, strict=True):
        t = targets.get(v) if v is not None else t
        out.append(a.to(t) if floating(a) and t is not None and t.is_floating_point else a)
    return tuple(out)


def differentiated(program: Program, wrt: tuple[int, ...], args: Sequence[Any]) -> Any:
    """`program`'s outputs for `args`, differentiable with respect to the parameters `wrt`:
    from the op's Autograd kernel, or straight from `Program.__call__` under torch.func's
    transforms (which take an autograd.Function, but not a custom op's Autograd kernel)."""
    training = program.training(wrt)
    outs = _Differentiated.apply(training, *args)
    n = training.derivation.n_outputs
    return outs[0] if n == 1 else tuple(outs[:n])


def refuse_forward_mode(program: Program, args: Sequence[Any]) -> None:
    """A `GradientError` when a call carries forward-mode tangents (torch.func.jvp, jacfwd,
    torch.autograd.forward_ad), which tiledsl has no rule for: they would be dropped."""
    from torch.autograd import forward_ad

    dual = forward_ad._current_level >= 0 and any(
        isinstance(a, torch.Tensor) and forward_ad.unpack_dual(a).tangent is not None for a in args)
    if not dual and torch._C._are_functorch_transforms_active():
        from torch._C._functorch import TransformType
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        dual = any(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())
    if dual:
        raise diag.GradientError(program.source_graph.span, message=(
            f"'{program.name}' cannot be differentiated in forward mode (torch.func.jvp, jacfwd, "
            "hessian, torch.autograd.forward_ad): tiledsl derives reverse-mode gradients only; use "
            "torch.func.grad, vjp or jacrev (or torch.autograd.functional.hessian, which is "
            "reverse mode twice)"))


def _fake(graph: Graph, convention: Convention):
    """Outputs of the declared shapes and dtypes, dims bound from the inputs' sizes."""
    params = [graph.op(p) for p in graph.params]
    n = len(graph.returns) - len(graph.checks)
    returns = graph.returns[:n]

    def fake(*op_args: Any) -> Any:
        dims: dict[str, Any] = {}
        device = None
        for op, value in zip(params, convention.unpack(op_args), strict=True):
            if isinstance(value, torch.Tensor):
                device = device or value.device
                for d, size in zip(op.shape, value.shape, strict=True):
                    if isinstance(d, str):
                        dims.setdefault(d, size)
        outs = [torch.empty([evaluate(d, dims) for d in t.shape], dtype=torch_dtype(t.dtype),
                            device=device or "cpu") for t in returns]
        return outs[0] if n == 1 else tuple(outs)

    return fake


class _Differentiated(torch.autograd.Function):
    """One differentiated call: the training forward (its outputs, then the values its
    backward saves, which are outputs here too, not differentiable), then its backward
    program. `setup_context` is apart from `forward`, and vmap runs the two as plain
    functions over batched tensors, as functorch's transforms ask."""

    generate_vmap_rule = True

    @staticmethod
    def forward(training: Training, *args: Any) -> Any:
        outs = training.forward.call_op(args)
        return tuple(outs) if isinstance(outs, tuple | list) else (outs,)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        """Saves the inputs and, of the outputs, those the backward reads (and the values it
        saves): a caller may change any other output in place (`torch.relu_(h)`, `h += r`)
        as torch's own ops allow. (Every derived backward reads its inputs, if only for their
        sizes, and a double backward runs the training forward on them again.)"""
        training, *args = inputs
        d = training.derivation
        ctx.training, ctx.n_args = training, len(args)
        ctx.scalars = {i: a for i, a in enumerate(args) if not isinstance(a, torch.Tensor)}
        read = {s.index for s in d.sources if s.kind == "output"}
        ctx.outs = [k for k in range(len(output)) if k >= d.n_outputs or k in read]
        # an input made under torch.inference_mode() cannot be saved, and cannot change in
        # place out of it either, but could inside another such block: saved as a copy
        ctx.save_for_backward(*[a.clone() if a.is_inference() else a
                                for a in args if isinstance(a, torch.Tensor)],
                              *[output[k] for k in ctx.outs])
        ctx.mark_non_differentiable(*[o for k, o in enumerate(output)
                                      if k >= d.n_outputs or k not in d.differentiable_outputs])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        training = ctx.training
        d = training.derivation
        stored = list(ctx.saved_tensors)
        args: list[Any] = []
        for i in range(ctx.n_args):
            args.append(ctx.scalars[i] if i in ctx.scalars else stored.pop(0))
        kept = dict(zip(ctx.outs, stored, strict=True))
        results = [kept.get(k) for k in range(d.n_outputs)]  # None: not read
        saved = [kept[k] for k in range(d.n_outputs, d.n_outputs + len(d.saved))]
        if d.saved and torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            # create_graph: the saved values depend on the inputs too; recomputed through the
            # training forward's op, that dependence is differentiated (double backward)
            outs = training.forward.call_op(tuple(args))
            results, saved = list(outs[:d.n_outputs]), list(outs[d.n_outputs:])
        values = [{"input": args, "output": results, "saved": saved, "grad": grads}[s.kind][s.index]
                  for s in d.sources]
        out = training.backward.call_op(tuple(values))
        out = list(out) if isinstance(out, tuple | list) else [out]
        per_arg: list[Any] = [None] * ctx.n_args
        for i, g in zip(d.wrt, out, strict=True):
            per_arg[i] = g
        return (None, *per_arg)
