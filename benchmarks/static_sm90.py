"""tiledsl's kernels against reference designs, statically, for sm_90 and without a GPU (issue 29).

    python benchmarks/static_sm90.py [--json rows.json] [--only SUBSTRING]

For each shape of the issue it compiles tiledsl's kernels (as `tiledsl ptx` does:
`aot.meta_launches`, `aot.inspect_launch`) and our reference kernels after Triton's
tutorials (`benchmarks/references`) for sm_90, reads the hottest loop of each from its SASS
(`loop_profile`) and prints one row per kernel pair:
  instr/1k     warp instructions per 1000 units of work: instructions x warps / work, per
               iteration of the hottest loop (unit: a score for attention, a multiply-add
               for a GEMM, a row element for row programs)
  cycles/1k    modeled H100 SM cycles per 1000 units: the largest of the model's tensor,
               issue, MUFU and memory cycles per iteration, over the work (an estimate)
  ratio        tiledsl / reference, of instructions and of modeled cycles (above 1: tiledsl
               issues more or is modeled slower)
  spills       bytes spilled per thread (ptxas), tiledsl / reference
  over smem    tiledsl's autotune candidates (the launch's configuration when it has none)
               needing more shared memory than an H100's 232448 bytes a block: they cannot
               launch
Cases: causal attention forward (B=4, H=16, M=N=4096; f16 at D=64 and 128, and bf16
soft-capped), its backward (the gradient program `fn.backward`), GEMMs at M=N=8192, K=4096
(f16 A B^T, and the fp8 e4m3 GEMM with row and column scales), softmax and layer norm of
4096 rows of 4096, 16384 and 32768 elements.

Kernels are paired by role. A forward program has one kernel each side. The backward has
three each side, told apart by tiledsl's plans: the row program (a `RowPlan`: delta =
rowsum(dO * O)) pairs with the reference's preprocess kernel, the attention-backward kernel
walking the query blocks (`over == "queries"`: one program per key block, accumulating dK
and dV) with the reference's dK/dV kernel, and the one walking the key blocks
(`over == "keys"`: dQ) with its dQ kernel. A role one side lacks gets a row with the other
side only.

A row program's loop is all its passes over the row together (`loop_profile`: each runs
once per block of the row, so an element costs every one): where one side reads a row in
several passes (tiledsl's long rows, the reference layer norm's three) the per-element
costs and memory cycles are of all of them; a program with no loop (one block holds the
row) counts its whole function. TMA copies are not counted as memory traffic.

The fp8 GEMM of examples/gemm_fp8_scaled.tdsl takes B as [K, N]; the reference, as the
tutorial, takes it K-major as [N, K] (what Hopper's fp8 wgmma reads). tiledsl's launcher
hands B over K-major (a copy made once per weight tensor, `EmittedKernel.k_major`), so both
sides' loops read the same layout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # this compiles for a GPU: Triton must not interpret

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from references import attention, layernorm, matmul, softmax  # noqa: E402
from references.sm90 import Build, report  # noqa: E402

import tiledsl  # noqa: E402
from tiledsl.backends.triton import aot  # noqa: E402
from tiledsl.plans import AttentionBackwardPlan, AttentionPlan, GemmPlan, RowPlan  # noqa: E402

EXAMPLES = HERE.parent / "examples"
SHARED_LIMIT = 232448  # an H100's shared memory per block (227 KiB)

GEMM = "kernel matmul(a: f16[M, K], b: f16[N, K]) -> f16[M, N] { return a @ b.T }"
LAYER_NORM = """kernel layer_norm(x: f16[M, N], w: f16[N], b: f16[N], eps: f32) -> f16[M, N] {
    xf = cast(x, f32)
    xc = xf - mean(xf, axis=-1, keepdims=true)
    var = mean(xc * xc, axis=-1, keepdims=true)
    return xc * rsqrt(var + eps) * w + b
}"""


@dataclass(frozen=True)
class Case:
    name: str
    program: str  # a program's text
    dims: dict[str, int]
    backward: bool
    references: list[Build]


def cases() -> list[Case]:
    out = []
    # the examples as they are, but the attention example's @tile hints (the first autotune
    # candidate, a user's choice): the table compares the kernels tiledsl chooses
    ex = {name: re.sub(r"@tile\([^)]*\)[^\n]*\n", "", (EXAMPLES / f"{name}.tdsl").read_text()) for name in
          ("attention", "causal_softcap_attention", "gemm_fp8_scaled", "softmax")}
    for d in (64, 128):
        dims = {"B": 4, "H": 16, "M": 4096, "N": 4096, "D": d}
        out.append(Case(f"attention causal f16 D={d}", ex["attention"], dims, False,
                        [attention.forward_build(4096, 4096, d, torch.float16, True, False)]))
        out.append(Case(f"attention causal softcap bf16 D={d}", ex["causal_softcap_attention"], dims, False,
                        [attention.forward_build(4096, 4096, d, torch.bfloat16, True, True)]))
        out.append(Case(f"attention backward causal f16 D={d}", ex["attention"], dims, True,
                        attention.backward_builds(4096, 4096, d, torch.float16, True)))
    gemm = {"M": 8192, "N": 8192, "K": 4096}
    out.append(Case("gemm f16 8192x8192x4096", GEMM, gemm, False,
                    [matmul.sm90_build(8192, 8192, 4096, torch.float16)]))
    out.append(Case("gemm fp8 scaled 8192x8192x4096", ex["gemm_fp8_scaled"], gemm, False,
                    [matmul.sm90_build(8192, 8192, 4096, torch.float8_e4m3fn)]))
    for n in (4096, 16384, 32768):
        out.append(Case(f"softmax f32 N={n}", ex["softmax"], {"M": 4096, "N": n}, False,
                        [softmax.sm90_build(4096, n, torch.float32)]))
        out.append(Case(f"layernorm f16 N={n}", LAYER_NORM, {"M": 4096, "N": n}, False,
                        [layernorm.sm90_build(4096, n, torch.float16)]))
    return out


def role(plan: Any, backward: bool) -> str:
    """A tiledsl kernel's role, named as the reference builds name theirs."""
    if isinstance(plan, AttentionPlan):
        return "forward"
    if isinstance(plan, AttentionBackwardPlan):
        return {"queries": "dkdv", "keys": "dq"}[plan.over]
    if isinstance(plan, GemmPlan):
        return "gemm"
    if isinstance(plan, RowPlan):
        return "delta" if backward else "rows"
    raise ValueError(f"no reference role for a {type(plan).__name__}")


def tiledsl_kernels(case: Case) -> dict[str, dict[str, Any]]:
    """Per role: the report of tiledsl's kernel at the configuration its launch uses first,
    and which of its autotune candidates need more shared memory than a block can have."""
    fn = tiledsl.compile(case.program)
    if case.backward:
        fn = fn.backward
    out: dict[str, dict[str, Any]] = {}
    for launch in aot.meta_launches(fn, case.dims):
        dims = dict(launch.dims)
        first = launch.kernel.launch_config(dims, "cuda")
        candidates = launch.kernel.launch_candidates(dims, "cuda") or [first]
        reports = [aot.inspect_launch(launch, cfg) for cfg in candidates]
        chosen = reports[candidates.index(first)] if first in candidates else \
            aot.inspect_launch(launch, first)
        name = role(launch.kernel.kernel.plan, case.backward)
        if name in out:
            raise ValueError(f"{case.name}: two tiledsl kernels of role {name}")
        out[name] = {"report": chosen.as_dict(), "candidates": len(candidates),
                     "over_shared": [r.config for r in reports if r.shared_bytes > SHARED_LIMIT]}
    return out


def per_unit(r: dict[str, Any]) -> dict[str, float]:
    loop = r["loop"]
    modeled = loop["modeled"]
    cycles = max(modeled[k] for k in ("tensor", "issue", "mufu", "memory"))
    return {"instructions": loop["instructions"] * loop["warps"] / loop["work"],
            "cycles": cycles / loop["work"], "bound": modeled["bound"], "unit": loop["work_unit"]}


def rows(case: Case) -> list[dict[str, Any]]:
    """One row per role of the case: both sides' reports, their costs per unit of work and
    the ratios tiledsl / reference."""
    ours = tiledsl_kernels(case)
    refs = {b.role: report(b) for b in case.references}
    out = []
    for name in list(refs) + [r for r in ours if r not in refs]:
        row: dict[str, Any] = {"case": case.name, "role": name}
        if name in ours:
            row["tiledsl"] = {**ours[name], **per_unit(ours[name]["report"])}
        if name in refs:
            row["reference"] = {"report": refs[name], **per_unit(refs[name])}
        if "tiledsl" in row and "reference" in row:
            row["ratio"] = {k: row["tiledsl"][k] / row["reference"][k] for k in ("instructions", "cycles")}
        out.append(row)
    return out


HEADER = (f"{'case':38} {'role':6} {'unit':7} | {'tiledsl instr/1k':>16} {'cycles/1k':>9} {'bound':>6} | "
          f"{'ref instr/1k':>12} {'cycles/1k':>9} {'bound':>6} | {'ratio instr':>11} {'cycles':>6} | "
          f"{'spills t/r':>10} | over smem")


def line(row: dict[str, Any]) -> str:
    def side(key: str, width: int) -> str:
        s = row.get(key)
        if s is None:
            return f"{'-':>{width}} {'-':>9} {'-':>6}"
        return f"{s['instructions'] * 1e3:>{width}.3g} {s['cycles'] * 1e3:>9.3g} {s['bound'][:6]:>6}"

    t, r = row.get("tiledsl"), row.get("reference")
    unit = (t or r)["unit"]
    ratio = row.get("ratio")
    ratios = f"{ratio['instructions']:>11.2f} {ratio['cycles']:>6.2f}" if ratio else f"{'-':>11} {'-':>6}"
    spills = (f"{t['report']['spill_bytes'] if t else '-'}/"
              f"{r['report']['spill_bytes'] if r else '-'}")
    over = f"{len(t['over_shared'])} of {t['candidates']}" if t else "-"
    return (f"{row['case']:38} {row['role']:6} {unit:7} | {side('tiledsl', 16)} | {side('reference', 12)} | "
            f"{ratios} | {spills:>10} | {over}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the rows (both sides' reports) as JSON")
    parser.add_argument("--only", metavar="SUBSTRING", help="only the cases whose name contains it")
    args = parser.parse_args(argv)
    selected = [c for c in cases() if args.only is None or args.only in c.name]
    print(HEADER)
    print("-" * len(HEADER))
    table = []
    for case in selected:
        for row in rows(case):
            table.append(row)
            print(line(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
