"""The merged template: independent pointwise and row programs over different iteration
spaces in one launch (`plans.MergedPlan`, formed by fuse-horizontal).

Each member is emitted by its own template, over its part of the region, as a @triton.jit
function of the module; the kernel partitions its programs among them in member order:

    pid = tl.program_id(0)
    end0 = tl.cdiv(m0_numel, M0_BLOCK)
    end1 = end0 + tl.cdiv(m1_n_rows, M1_BLOCK_O)
    if pid < end0:
        k0_0_pointwise(..., 0, M0_BLOCK)
    else:
        k0_1_rows(..., end0, M1_BLOCK_O, M1_BLOCK_R, M1_ONE_PASS)

A member numbers its programs from the first id it is given (its `pid` line rebased). Its
parameters are renamed for the kernel (an input's or output's by its number in the merged
region; a size's `m<i>_` before its name; the constexprs, `M<i>_`),
and a parameter filled the same way for two members (a shared input's pointer, a dim) is
passed once. The grid is the sum of the members' grids, each picked by its template for the
call's sizes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace

from tiledsl.ir import KernelOp
from tiledsl.plans import MergedPlan

from .base import PROGRAM_ID, EmittedKernel, Hints, LaunchConfig
from .codegen import (
    FLAGS,
    ArgSpec,
    Code,
    DimSize,
    Numel,
    Ptr,
    RowsFlat,
    Scalar,
    Stride,
    Wide,
    Workspace,
    header,
)
from .expr import HELPERS


def emit(kernel: KernelOp, hints: Hints, allow_tf32: bool = False) -> EmittedKernel:
    from .program import EMITTERS

    plan: MergedPlan = kernel.plan
    members = []
    for i, m in enumerate(plan.members):
        region = kernel.region.part(m.inputs, m.values, m.outputs)
        part = KernelOp(f"{kernel.name}_{i}", m.plan.template, region, kernel.span, plan=m.plan)
        members.append(EMITTERS[type(m.plan)](part, hints, allow_tf32))

    n_in = len(kernel.region.inputs)
    outputs = kernel.region.outputs
    # each member's workspaces follow the members' before it
    spaces = [0]
    for e in members:
        used = [spec.index for stage in (e, *e.then) for _, spec in stage.params
                if isinstance(spec, Workspace)]
        spaces.append(spaces[-1] + max(used, default=-1) + 1)

    def rebased(spec: ArgSpec, i: int) -> ArgSpec:
        return _rebased(spec, plan.members[i], n_in, outputs, spaces[i])

    params: dict[ArgSpec, str] = {}  # the kernel's parameters, by how each is filled
    constexprs: list[str] = []
    flag = any(e.interpreter_flag for e in members)
    code = Code()
    for line in header(kernel):
        code(line)
    for name in sorted(set().union(*(e.function.helpers for e in members))):
        for line in HELPERS[name].splitlines():
            code(line)
    calls = []
    for i, e in enumerate(members):
        fn = e.function
        renamed: dict[str, str] = {}
        for name, spec in fn.sig.params:
            spec = rebased(spec, i)
            renamed[name] = params.setdefault(spec, _name(spec) or f"m{i}_{name}")
        for name in fn.sig.constexprs:
            renamed[name] = "INTERPRETER" if name == "INTERPRETER" else f"M{i}_{name}"
            if name != "INTERPRETER":
                constexprs.append(renamed[name])
        lines = [(f"{PROGRAM_ID} - first_program" if line == PROGRAM_ID else line) for line in fn.lines]
        assert lines.count(f"{PROGRAM_ID} - first_program") == 1, "a member numbers its programs once"
        names = [f"{n}: tl.constexpr" if isinstance(spec, FLAGS) else n for n, spec in fn.sig.params]
        names += ["first_program", *(f"{c}: tl.constexpr" for c in fn.sig.constexprs)]
        code("@triton.jit")
        code(f"def {e.fn_name}({', '.join(names)}):")
        with code.indent():
            for line in lines:
                code(line)
        code("")
        args = [renamed[n] for n, _ in fn.sig.params]
        calls.append((e.fn_name, args, [renamed[c] for c in fn.sig.constexprs],
                      re.sub(r"\b\w+\b", lambda t, r=renamed: r.get(t.group(), t.group()), fn.programs)))

    fn_name = f"{kernel.name}_{kernel.template}"
    names = [f"{n}: tl.constexpr" if isinstance(spec, FLAGS) else n for spec, n in params.items()]
    names += [f"{c}: tl.constexpr" for c in constexprs + (["INTERPRETER"] if flag else [])]
    code("@triton.jit")
    code(f"def {fn_name}({', '.join(names)}):")
    with code.indent():
        code("pid = tl.program_id(0)")
        for i, (_, _, _, programs) in enumerate(calls[:-1]):
            code(f"end{i} = " + (f"end{i - 1} + " if i else "") + programs)
        for i, (name, args, consts, _) in enumerate(calls):
            first = f"end{i - 1}" if i else "0"
            test = "if" if i == 0 else "elif" if i < len(calls) - 1 else "else"
            code(f"{test} pid < end{i}:" if test != "else" else "else:")
            with code.indent():
                code(f"{name}({', '.join([*args, first, *consts])})")

    def configure(dims: Mapping[str, int], device: str) -> LaunchConfig:
        cfgs = [e.configure(dims, device) for e in members]
        consts = {f"M{i}_{k}": v for i, c in enumerate(cfgs) for k, v in c.constexprs.items()}
        return LaunchConfig((sum(c.grid[0] for c in cfgs),), consts,
                            num_warps=max(c.num_warps or 4 for c in cfgs))

    def workspace(dims: Mapping[str, int], target: str) -> tuple[tuple[int, str], ...]:
        return tuple(w for e in members if e.workspace is not None for w in e.workspace(dims, target))

    # the combines of split members, each a launch of its own in member order (a later one
    # may read what an earlier one stored), over the merged kernel's arguments
    then = tuple(replace(stage, kernel=kernel,
                         params=tuple((n, rebased(spec, i)) for n, spec in stage.params))
                 for i, e in enumerate(members) for stage in e.then)
    return EmittedKernel(kernel, fn_name, code.text(), tuple((n, spec) for spec, n in params.items()),
                         configure, interpreter_flag=flag, hints=dict(hints),
                         workspace=workspace if spaces[-1] else None, then=then)


def _name(spec: ArgSpec) -> str | None:
    """The kernel's name for a parameter of an input or output (a member's, renumbered)."""
    if isinstance(spec, Ptr):
        return f"{spec.role}{spec.index}_ptr"
    if isinstance(spec, Stride):
        return f"{spec.role}{spec.index}_s{spec.dim}"
    if isinstance(spec, Scalar):
        return f"in{spec.index}_val"
    return "WIDE" if isinstance(spec, Wide) else None


def _rebased(spec: ArgSpec, member, n_in: int, outputs: tuple[int, ...], workspaces: int) -> ArgSpec:
    """A member's parameter as the merged kernel fills it: its inputs, outputs and
    workspaces renumbered; an input that is another member's result (0-d, read by a combine)
    is that result, an output of the merged kernel."""
    if isinstance(spec, Ptr | Stride | RowsFlat):
        role, index = spec.role, (member.inputs if spec.role == "in" else member.outputs)[spec.index]
        if role == "in" and index >= n_in:
            role, index = "out", outputs.index(index)
        if isinstance(spec, Ptr):
            return Ptr(role, index)
        return Stride(role, index, spec.dim) if isinstance(spec, Stride) else RowsFlat(index, spec.axes, role)
    if isinstance(spec, Scalar):
        return Scalar(member.inputs[spec.index])
    if isinstance(spec, Workspace):
        return Workspace(workspaces + spec.index)
    assert isinstance(spec, DimSize | Numel | Wide), f"a merged member takes no {type(spec).__name__}"
    return spec
