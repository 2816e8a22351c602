"""A compiled program as a PyTorch operator: `torch.ops.tiledsl.<kernel>_<hash>`.

Each `Program` is registered once, through `torch.library`, as a custom op with

- a schema from its signature (`Tensor` per tensor parameter, `float`, `int` or
  `bool` per scalar, one `Tensor` per output);
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
  program and saves nothing.

The name is the kernel's name and a hash of its graph IR, source name and
compile options: compiling the same program twice gives the same op (the
first registration is kept; its program computes the same thing). A program
registers its op when it is built; the derived programs are built the first
time a gradient is asked for (under `torch.compile`, while AOTAutograd traces).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch

from tiledsl.binding import torch_dtype
from tiledsl.dims import evaluate
from tiledsl.ir import Graph
from tiledsl.types import DType

if TYPE_CHECKING:
    from tiledsl.api import Program

NAMESPACE = "tiledsl"
_LIBRARIES: dict[str, torch.library.Library] = {}  # op name -> its registrations (kept alive)
_PROGRAMS: dict[str, Program] = {}  # op name -> the program its kernels run
_SCALAR_TYPES = {DType.F32: "float", DType.F16: "float", DType.BF16: "float", DType.I32: "int",
                 DType.I64: "int", DType.BOOL: "bool"}
# names the schema parser reserves; a parameter so named is renamed in the schema only
_RESERVED = {"self", "out", "Tensor", "float", "int", "bool", "str", "None"}


def op_name(program: Program) -> str:
    """`<kernel>_<hash>`: stable across processes for the same program and options."""
    from tiledsl.printer import print_graph

    graph = program.source_graph
    text = "\n".join((
        graph.span.source.name if graph.span else "", print_graph(graph, locations=True),
        program.backend, program.pipeline, str(program.allow_tf32)))
    return f"{graph.name}_{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def schema(graph: Graph) -> str:
    """The op's argument and return list, `(Tensor x, float eps) -> Tensor`."""
    args = []
    for i, p in enumerate(graph.params):
        op = graph.op(p)
        kind = _SCALAR_TYPES[op.dtype] if op.attr("scalar") else "Tensor"
        args.append(f"{kind} {_arg_name(op.attr('name'), i)}")
    n = len(graph.returns) - len(graph.checks)
    rets = "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
    return f"({', '.join(args)}) -> {rets}"


def _arg_name(name: str, index: int) -> str:
    return f"arg{index}_{name}" if name in _RESERVED or name.startswith("_") else name


def register(program: Program) -> Any:
    """The op running `program` (an `OpOverload`), registered once per name."""
    name = op_name(program)
    if name not in _LIBRARIES:
        graph = program.source_graph
        lib = torch.library.Library(NAMESPACE, "FRAGMENT")
        lib.define(name + schema(graph))
        _PROGRAMS[name] = program

        def run(*args: Any) -> Any:
            return _PROGRAMS[name]._run_op(args)

        lib.impl(name, run, "CPU")
        lib.impl(name, run, "CUDA")
        lib.impl(name, _autograd_kernel(name), "Autograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", _fake(graph), lib=lib)
        _LIBRARIES[name] = lib
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def _fake(graph: Graph):
    """Outputs of the declared shapes and dtypes, dims bound from the inputs' sizes."""
    params = [graph.op(p) for p in graph.params]
    n = len(graph.returns) - len(graph.checks)
    returns = graph.returns[:n]

    def fake(*args: Any) -> Any:
        dims: dict[str, Any] = {}
        device = None
        for op, value in zip(params, args, strict=True):
            if isinstance(value, torch.Tensor):
                device = device or value.device
                for d, size in zip(op.shape, value.shape, strict=True):
                    if isinstance(d, str):
                        dims.setdefault(d, size)
        outs = [torch.empty([evaluate(d, dims) for d in t.shape], dtype=torch_dtype(t.dtype),
                            device=device or "cpu") for t in returns]
        return outs[0] if n == 1 else tuple(outs)

    return fake


def _autograd_kernel(name: str):
    def kernel(*args: Any) -> Any:
        program = _PROGRAMS[name]
        wrt = program.wants_grad(args)
        if not wrt:
            with torch._C._AutoDispatchBelowAutograd():
                return program.op(*args)
        return _Differentiated.apply(program, wrt, *args)

    return kernel


class _Differentiated(torch.autograd.Function):
    """One differentiated call: the training forward, then its backward program."""

    @staticmethod
    def forward(ctx: Any, program: Program, wrt: tuple[int, ...], *args: Any) -> Any:
        training = program.training(wrt)
        d = training.derivation
        outs = training.forward.op(*args)
        outs = list(outs) if isinstance(outs, tuple | list) else [outs]
        results, saved = outs[:d.n_outputs], outs[d.n_outputs:]
        ctx.training, ctx.n_args = training, len(args)
        ctx.scalars = {i: a for i, a in enumerate(args) if not isinstance(a, torch.Tensor)}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        ctx.save_for_backward(*tensors, *results, *saved)
        ctx.mark_non_differentiable(*[r for k, r in enumerate(results)
                                      if k not in d.differentiable_outputs])
        return results[0] if len(results) == 1 else tuple(results)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        training = ctx.training
        d = training.derivation
        stored = list(ctx.saved_tensors)
        args: list[Any] = []
        for i in range(ctx.n_args):
            args.append(ctx.scalars[i] if i in ctx.scalars else stored.pop(0))
        results, saved = stored[:d.n_outputs], stored[d.n_outputs:]
        values = []
        for s in d.sources:
            values.append({"input": args, "output": results, "saved": saved,
                           "grad": grads}[s.kind][s.index])
        out = training.backward.op(*values)
        out = list(out) if isinstance(out, tuple | list) else [out]
        per_arg: list[Any] = [None] * ctx.n_args
        for i, g in zip(d.wrt, out, strict=True):
            per_arg[i] = g
        return (None, None, *per_arg)
