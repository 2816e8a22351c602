"""A static profile of a compiled kernel's hottest loop, read from its SASS (or its PTX).

`tiledsl ptx` compiles every kernel for sm_90 without a GPU; this reads what would run.
The SASS comes from the cubin through the `cuobjdump` Triton ships (PTX when there is
none). A loop is a branch back to an earlier address in the function's body (before its
last unconditional EXIT: the out-of-line blocks after it branch back too) and the
instructions between its target and it; one of a few instructions (a barrier's spin-wait)
is not the kernel's work. The
hottest loop is the innermost one issuing the most matrix instructions (a GEMM's K loop,
attention's key loop: the first, unmasked one of equal ones), else the longest innermost
one (a row program's phases all run as often); a kernel without loops (a pointwise one)
is profiled whole.

Per warp and iteration it counts instructions, MUFU ops (exp2, rcp, tanh...), matrix
instructions by shape, barriers, shared-memory loads and stores, and the bytes global loads
and stores move (TMA copies not counted). `modeled` turns them into H100 SM cycles per
iteration of one program, an estimate from published rates, not a measurement: tensor
(multiply-adds over the SM's rate for their type), issue (warp instructions over 4
schedulers), MUFU (lanes over 16 a clock) and memory (bytes over an SM's share of HBM).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiledsl.plans import (
    AttentionBackwardPlan,
    AttentionPlan,
    GemmPlan,
    MergedPlan,
    PointwisePlan,
    RowPlan,
    ScatterPlan,
)

# H100 SXM per SM and clock (1.83 GHz boost, 132 SMs): dense multiply-adds of wgmma by input
# type, mma.sync at half of that; 4 warp schedulers; 16 MUFU lanes; 3.35 TB/s of HBM shared
MAC_RATE = {"f16": 2048, "tf32": 1024, "f8": 4096, "i8": 4096}
SYNC_MMA_SHARE = 0.5
SCHEDULERS = 4
MUFU_LANES = 16
HBM_BYTES_PER_CLOCK = 3.35e12 / 132 / 1.83e9
SPIN_WAIT = 4  # a loop of this many instructions or fewer waits on a barrier

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
_WIDTH = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


@dataclass(frozen=True)
class Instruction:
    address: int
    predicated: bool
    opcode: str  # with its modifiers: "HGMMA.64x128x16.F32.BF16"
    operands: str


def cuobjdump() -> Path | None:
    """The cuobjdump Triton ships (None: this Triton has none)."""
    try:
        import triton
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return path if path.exists() else None


def sass(cubin: bytes) -> str | None:
    """The SASS text of a cubin, or None without a cuobjdump that reads it."""
    import tempfile

    tool = cuobjdump()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        try:
            result = subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True,
                                    check=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
    return result.stdout


def parse_sass(text: str) -> list[Instruction]:
    out = []
    for m in _INSTR.finditer(text):
        out.append(Instruction(int(m.group(1), 16), m.group(2) is not None, m.group(3), m.group(4).strip()))
    return out


def body_end(instrs: list[Instruction]) -> int:
    """The index of the function body's last instruction: its last unconditional EXIT (the
    blocks after it are out-of-line paths, a barrier's spin-wait say, that branch back)."""
    exits = [i for i, ins in enumerate(instrs) if ins.opcode == "EXIT" and not ins.predicated]
    return exits[-1] if exits else len(instrs) - 1


def sass_loops(instrs: list[Instruction]) -> list[tuple[int, int]]:
    """(first, last) instruction indices of each loop: a branch in the function's body back
    to an earlier address (a loop exits at its top or its bottom), longer than a spin-wait."""
    index = {ins.address: i for i, ins in enumerate(instrs)}
    loops = []
    for i, ins in enumerate(instrs[:body_end(instrs) + 1]):
        if ins.opcode.startswith("BRA"):
            target = re.match(r"(?:`\()?\s*(0x[0-9a-f]+)", ins.operands)
            if target and int(target.group(1), 16) < ins.address and int(target.group(1), 16) in index:
                first = index[int(target.group(1), 16)]
                if i - first + 1 > SPIN_WAIT:
                    loops.append((first, i))
    return loops


def _mma_shape(opcode: str) -> tuple[str, int, str] | None:
    """(shape, multiply-adds per issuing unit, input type) of a matrix instruction; the
    unit is a warpgroup for wgmma (HGMMA, QGMMA, IGMMA), a warp for mma.sync (HMMA, IMMA)."""
    parts = opcode.split(".")
    op = parts[0]
    shape = re.fullmatch(r"(\d+)x(\d+)x(\d+)", parts[1]) if len(parts) > 1 else None
    if op in ("HGMMA", "QGMMA", "IGMMA") and shape:
        m, n, k = (int(x) for x in shape.groups())
        kind = {"HGMMA": "tf32" if "TF32" in parts else "f16", "QGMMA": "f8", "IGMMA": "i8"}[op]
        return parts[1], m * n * k, kind
    digits = re.fullmatch(r"(16)(8)(\d+)", parts[1]) if len(parts) > 1 else None
    if op in ("HMMA", "IMMA") and digits:
        m, n, k = (int(x) for x in digits.groups())
        return parts[1], m * n * k, "i8" if op == "IMMA" else ("tf32" if "TF32" in parts else "f16")
    return None


def _global_bytes(ins: Instruction) -> int:
    """Bytes a warp's global load or store (or cp.async copy) moves."""
    parts = ins.opcode.split(".")
    if parts[0] not in ("LDG", "STG", "LDGSTS"):
        return 0
    width = next((_WIDTH[p] for p in parts[1:] if p in _WIDTH), 4)
    return 32 * width


def profile_instructions(body: list[Instruction], warps: int, work: int, work_unit: str,
                         source: str) -> dict[str, Any]:
    """The loop profile of one iteration's instructions."""
    mma: dict[str, int] = {}
    macs_cycles = 0.0
    mufu = barriers = shared = global_bytes = 0
    for ins in body:
        op = ins.opcode.split(".")[0]
        shape = _mma_shape(ins.opcode)
        if shape is not None:
            name, macs, kind = shape
            mma[name] = mma.get(name, 0) + 1
            group = op in ("HGMMA", "QGMMA", "IGMMA")
            units = warps / 4 if group else warps
            rate = MAC_RATE[kind] * (1 if group else SYNC_MMA_SHARE)
            macs_cycles += units * macs / rate
        mufu += op == "MUFU"
        barriers += op in ("BAR", "SYNCS")
        shared += op in ("LDS", "STS", "LDSM", "STSM")
        global_bytes += _global_bytes(ins)
    modeled = {"tensor": round(macs_cycles, 1),
               "issue": round(len(body) * warps / SCHEDULERS, 1),
               "mufu": round(mufu * warps * 32 / MUFU_LANES, 1),
               "memory": round(global_bytes * warps / HBM_BYTES_PER_CLOCK, 1)}
    modeled["bound"] = max(("tensor", "issue", "mufu", "memory"), key=lambda k: modeled[k])
    return {"source": source, "instructions": len(body), "mufu": mufu, "mma": mma,
            "barriers": barriers, "shared_ops": shared, "warps": warps, "work": work,
            "work_unit": work_unit, "modeled": modeled}


def _hottest_loop(loops: list[tuple[int, int]], records: list[Instruction]) -> list[Instruction] | None:
    """The instructions of the hottest of `loops` ((first, last) indices into `records`): the
    innermost one with the most matrix instructions, else the longest innermost one, the
    first of equal ones (None: no loop)."""
    inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    if not inner:
        return None

    def body(loop: tuple[int, int]) -> list[Instruction]:
        return [i for i in records[loop[0]:loop[1] + 1] if i.opcode != "LABEL"]

    def rank(loop: tuple[int, int]) -> tuple:
        n_mma = sum(_mma_shape(i.opcode) is not None for i in body(loop))
        return (n_mma, 0, -loop[0]) if n_mma else (0, len(body(loop)), -loop[0])

    return body(max(inner, key=rank))


def _passes(loops: list[tuple[int, int]], records: list[Instruction]) -> list[Instruction] | None:
    """The instructions of every innermost one of `loops`, in order (None: no loop): a row
    program's passes over its row, each running once per block of the row."""
    inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    return [i for a, b in sorted(inner) for i in records[a:b + 1] if i.opcode != "LABEL"] or None


def hottest(instrs: list[Instruction], passes: bool = False) -> list[Instruction]:
    """The hottest loop's instructions (the whole function when it has no loop); with
    `passes`, every innermost loop's."""
    loops = sass_loops(instrs)
    found = _passes(loops, instrs) if passes else _hottest_loop(loops, instrs)
    return found or instrs[:body_end(instrs) + 1]


# --- PTX, without a cuobjdump ----------------------------------------------------------------

_PTX_LINE = re.compile(r"^\s*(@%?!?\w+\s+)?([a-z][\w.:]*)\b")
_PTX_LABEL = re.compile(r"^(\$?\w+):")


def ptx_instructions(ptx: str) -> list[Instruction]:
    """PTX instructions as SASS-like records (opcodes mapped to what they become: ex2 and
    the approximate functions to MUFU, wgmma to HGMMA...), labels as their own records."""
    out = []
    for n, line in enumerate(ptx.splitlines()):
        line = line.split("//")[0].rstrip()
        label = _PTX_LABEL.match(line.strip())
        if label:
            out.append(Instruction(n, False, "LABEL", label.group(1)))
            continue
        m = _PTX_LINE.match(line)
        if not m or line.strip().startswith(".") or not line.strip().endswith(";"):
            continue
        op = m.group(2)
        mapped = op.upper()
        if op.startswith(("ex2.approx", "lg2.approx", "rcp.approx", "rsqrt.approx", "sqrt.approx",
                          "sin.approx", "cos.approx", "tanh.approx")):
            mapped = "MUFU"
        elif op.startswith("wgmma.mma_async"):
            shape = re.search(r"m(\d+)n(\d+)k(\d+)", op)
            kind = "QGMMA" if "e4m3" in op or "e5m2" in op else "IGMMA" if ".s8" in op else "HGMMA"
            mapped = f"{kind}.{shape.group(1)}x{shape.group(2)}x{shape.group(3)}" + (".TF32" if "tf32" in op
                                                                                       else "")
        elif op.startswith("mma.sync"):
            shape = re.search(r"m(\d+)n(\d+)k(\d+)", op)
            mapped = f"HMMA.{shape.group(1)}{shape.group(2)}{shape.group(3)}"
        elif op.startswith("bar.") or op.startswith("barrier"):
            mapped = "BAR"
        elif op.startswith(("ld.shared", "st.shared", "ldmatrix", "stmatrix")):
            mapped = "LDS"
        elif op.startswith(("ld.global", "st.global")):
            width = re.search(r"\.v(\d)\.[bfsu](\d+)", op) or re.search(r"\.[bfsu](\d+)$", op)
            size = 4
            if width and width.lastindex == 2:
                size = int(width.group(1)) * int(width.group(2)) // 8
            elif width:
                size = int(width.group(1)) // 8
            mapped = ("LDG" if op.startswith("ld") else "STG") + {1: ".U8", 2: ".U16", 8: ".64",
                                                                  16: ".128"}.get(size, "")
        elif op.startswith("bra"):
            target = line.strip().split()[-1].rstrip(";")
            out.append(Instruction(n, m.group(1) is not None, "BRA", target))
            continue
        out.append(Instruction(n, m.group(1) is not None, mapped, ""))
    return out


def ptx_hottest(instrs: list[Instruction], passes: bool = False) -> list[Instruction]:
    labels = {ins.operands: i for i, ins in enumerate(instrs) if ins.opcode == "LABEL"}
    loops = []
    for i, ins in enumerate(instrs):
        if ins.opcode == "BRA" and ins.predicated and labels.get(ins.operands, i) < i:
            loops.append((labels[ins.operands], i))
    loops = [(a, b) for a, b in loops if b - a > SPIN_WAIT]
    found = _passes(loops, instrs) if passes else _hottest_loop(loops, instrs)
    return found if found is not None else [i for i in instrs if i.opcode != "LABEL"]


def loop_profile(compiled: Any, warps: int, work: int, work_unit: str) -> dict[str, Any]:
    """The profile of a `CompiledKernel`'s hottest loop, from its SASS (its PTX without a
    cuobjdump). For element work (a row program) the loop is all its passes over the row
    together: each runs once per block of the row, so an element costs all of them (a
    layer norm of three passes, the mean's, the variance's and the output's, costs the
    three loops, not the longest)."""
    passes = work_unit == "element"
    text = sass(compiled.asm["cubin"]) if "cubin" in compiled.asm else None
    if text:
        return profile_instructions(hottest(parse_sass(text), passes), warps, work, work_unit, "sass")
    return profile_instructions(ptx_hottest(ptx_instructions(compiled.asm["ptx"]), passes), warps, work,
                                work_unit, "ptx")


def _gemm_work(cfg: dict[str, Any]) -> tuple[int, str]:
    if "BLOCK_K" not in cfg:
        return _combine_work(cfg)
    return cfg["BLOCK_M"] * cfg["BLOCK_N"] * cfg["BLOCK_K"], "mac"


def _score_work(cfg: dict[str, Any]) -> tuple[int, str]:
    if "BLOCK_N" not in cfg:
        return _combine_work(cfg)
    return cfg["BLOCK_M"] * cfg["BLOCK_N"], "score"


def _combine_work(cfg: dict[str, Any]) -> tuple[int, str]:
    """The combine launch of a split dot kernel (split-K, split-KV), which has no K or key
    block: its merge loop's tile of partial elements, one split per iteration."""
    work = 1
    for name, value in cfg.items():
        if name.startswith("BLOCK_") and isinstance(value, int):
            work *= value
    return work, "element"


def _element_work(cfg: dict[str, Any]) -> tuple[int, str]:
    if "BLOCK_R" in cfg:
        return cfg["BLOCK_O"] * cfg["BLOCK_R"], "element"
    if "BLOCK_W" in cfg:  # a split row program's combine: a [BLOCK_W, COMBINE_CHUNKS] tile of partials
        from .combine import COMBINE_CHUNKS

        return cfg["BLOCK_W"] * COMBINE_CHUNKS, "element"
    return int(cfg.get("BLOCK", 1)), "element"


# the elements of work one iteration of a kernel's hottest loop does for a whole program
# instance, by its plan: a GEMM's BLOCK_M x BLOCK_N x BLOCK_K multiply-adds, attention's
# BLOCK_M x BLOCK_N scores, a row program's BLOCK_O x BLOCK_R elements, a pointwise
# program's BLOCK (a merged launch: its first member's)
WORK = {GemmPlan: _gemm_work, AttentionPlan: _score_work, AttentionBackwardPlan: _score_work,
        RowPlan: _element_work, PointwisePlan: _element_work, ScatterPlan: _element_work}


def work_of(plan: Any, config: dict[str, Any]) -> tuple[int, str]:
    """(elements of work per iteration, their unit) of a kernel of `plan` at `config`."""
    if isinstance(plan, MergedPlan):
        first = plan.members[0].plan
        return WORK[type(first)]({k[3:]: v for k, v in config.items() if k.startswith("M0_")})
    return WORK[type(plan)](config)
