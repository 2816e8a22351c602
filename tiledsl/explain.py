"""The fusion report behind `Program.explain()`.

One row per kernel in launch order: its template, the DSL ops it computes
and the lines they came from. Then the fusion decisions recorded by the
passes (`PassContext.remarks`): fusions made, and fusions refused with the
rule that refused them. When no fusion pass ran, it says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiledsl.api import Program

FUSION_PASSES = ("fuse-elementwise", "fuse-epilogue", "fuse-rows", "online-softmax",
                 "fuse-attention")


def explain(program: Program) -> str:
    kernels = program.kernels
    lines = [f"fusion report for @{program.name}",
             f"  pipeline: {program.pipeline}",
             f"  {len(kernels)} kernel{'s' if len(kernels) != 1 else ''}"]
    ran = [p for p in program.pipeline.split(",") if p.split("{")[0] in FUSION_PASSES]
    if not ran:
        lines.append("  no fusion pass ran: every op is its own kernel")
    lines.append("")
    rows = [("kernel", "template", "ops (DSL line)")]
    for k in kernels:
        ops = ", ".join(f"{op.kind} ({op.span.line})" if op.span else op.kind for op in k.ops)
        rows.append((k.name, k.template, ops or "copy"))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines.extend(f"  {a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows)
    remarks = program.remarks
    lines.append("")
    if remarks:
        lines.append("fusion decisions:")
        lines.extend(f"  {r}" for r in remarks)
    else:
        lines.append("fusion decisions: none recorded")
    return "\n".join(lines) + "\n"
