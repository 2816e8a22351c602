"""Shared test helpers: the design section 5 oracle, random inputs, sm_90 compilation."""

from __future__ import annotations

import torch

import tiledsl
from tiledsl import testing

SIZES = (1, 17, 113)  # awkward sizes: a single element, a prime, a prime past a block


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, dtype=torch.float32, seed: int | None = None, scale: float = 1.0) -> torch.Tensor:
    g = _GEN if seed is None else gen(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


_GEN = gen(1234)

_compiled_for_gpu: set = set()


def compile_for_sm90(fn: tiledsl.Program) -> list:
    """Compile every launch `fn` has made for GPUTarget("cuda", 90, 32); returns the CompiledKernels."""
    from tiledsl.backends.triton.aot import compile_launch

    out = []
    for launch in sorted(fn.launches, key=lambda l: l.kernel.fn_name):
        cfg = launch.kernel.launch_config(dict(launch.dims), "cuda")
        key = (launch.kernel.source, launch.signature, tuple(sorted(cfg.constexprs.items())))
        if key in _compiled_for_gpu:
            continue
        out.append((launch, compile_launch(launch)))
        _compiled_for_gpu.add(key)
    return out


def run_checked(src, *args, kernel=None, sm90: bool = True, **kwargs):
    """Compile, run on the given inputs, assert the design section 5 oracle, compile for sm_90.

    Returns (program, outputs).
    """
    fn = src if isinstance(src, tiledsl.Program) else tiledsl.compile(src, kernel=kernel)
    outputs = fn(*args, **kwargs)
    golden = fn.reference(*args, float64=True, **kwargs)
    eager = fn.reference(*args, **kwargs)
    report = testing.compare(outputs, golden, eager)
    assert report.ok, f"{fn.name}: {report}"
    if sm90:
        compile_for_sm90(fn)
    return fn, outputs
