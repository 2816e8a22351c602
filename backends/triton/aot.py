"""Ahead-of-time compilation of generated kernels for a GPU target, without a GPU.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` lowers a
kernel through TTIR, TTGIR, LLVM IR and PTX to a cubin on any machine. Given
a recorded launch (its argument types and the sizes of the call), this builds
exactly what would run on an H100: the launch configuration is the GPU's
(`launch_config(dims, "cuda")`, or one of its autotune candidates), not the
interpreter's.
"""

from __future__ import annotations

from typing import Any

from .cache import load
from .program import Launch

SM90 = ("cuda", 90, 32)


def compile_launch(launch: Launch, target: tuple[str, int, int] = SM90, config: Any = None) -> Any:
    """The `CompiledKernel` (with `.asm["ptx"]`, `.asm["cubin"]`) of a recorded launch.

    `config` picks a launch configuration (default: the GPU's for these sizes).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    emitted = launch.kernel
    cfg = config or emitted.launch_config(dict(launch.dims), "cuda")
    fn = load(emitted.source, emitted.fn_name, "cuda", emitted.ir())
    signature: dict[str, str] = dict(launch.signature)
    signature.update({name: "constexpr" for name in cfg.constexprs})
    source = ASTSource(fn, signature=signature, constexprs=dict(cfg.constexprs))
    options = {"num_warps": cfg.num_warps or 4, "num_stages": cfg.num_stages or 3}
    return triton.compile(source, target=GPUTarget(*target), options=options)


def resource_usage(compiled: Any, arch: int = 90) -> dict[str, int]:
    """Registers, spill stores/loads and stack frame of a compiled kernel, from `ptxas -v`.

    The numbers a GPU driver would report (`n_spills`, `n_regs`) need a GPU;
    ptxas gives the same counts from the PTX on any machine.
    """
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    ptx = compiled.asm["ptx"]
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    gpu = target.group(1).rstrip(",") if target else f"sm_{arch}a"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        result = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", str(src),
                                 "-o", str(Path(tmp) / "kernel.cubin")],
                                capture_output=True, text=True, check=True)
    text = result.stdout + result.stderr

    def number(pattern: str) -> int:
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0

    return {"registers": number(r"Used (\d+) registers"),
            "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"),
            "stack": number(r"(\d+) bytes stack frame")}
