"""Choosing among launch configurations on a GPU, once per kernel and problem size.

A template may offer several configurations for a size (`EmittedKernel.
launch_candidates`, e.g. the GEMM's Hopper tiles). The first launch at that
size times each candidate with CUDA events (one warm-up launch, which also
compiles it, then a few timed ones; configurations that do not fit the device
are skipped) and keeps the fastest. Choices are cached in memory and in
`autotune.json` in the kernel cache directory (plain JSON, written
atomically), keyed by the kernel's cache key, the sizes and the device name.
Outputs are fresh tensors, so launching a kernel several times is harmless.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .base import EmittedKernel, LaunchConfig
from .cache import cache_dir, cache_key

_lock = threading.Lock()
_chosen: dict[str, dict[str, Any]] = {}
TIMED_RUNS = 5


def _key(emitted: EmittedKernel, dims: Mapping[str, int]) -> str:
    import torch

    sizes = ",".join(f"{k}={v}" for k, v in sorted(dims.items()))
    return f"{cache_key(emitted.source, 'cuda', emitted.ir())[:32]}|{sizes}|{torch.cuda.get_device_name()}"


def describe(cfg: LaunchConfig) -> dict[str, Any]:
    return {**{k: v for k, v in cfg.constexprs.items() if isinstance(v, int | bool)},
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _path():
    return cache_dir() / "autotune.json"


def _load_disk() -> dict[str, dict[str, Any]]:
    try:
        return json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_disk(key: str, choice: dict[str, Any]) -> None:
    data = _load_disk()
    data[key] = choice
    path = _path()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def choose(emitted: EmittedKernel, dims: Mapping[str, int], candidates: Sequence[LaunchConfig],
           launch: Callable[[LaunchConfig], None]) -> LaunchConfig:
    """The fastest candidate for these sizes (timed once, then remembered)."""
    key = _key(emitted, dims)
    with _lock:
        if key not in _chosen:
            _chosen.update({k: v for k, v in _load_disk().items() if k not in _chosen})
        wanted = _chosen.get(key)
    if wanted is not None:
        for cfg in candidates:
            if describe(cfg) == wanted:
                return cfg
    best = _time(candidates, launch)
    with _lock:
        _chosen[key] = describe(best)
        _save_disk(key, _chosen[key])
    return best


def _time(candidates: Sequence[LaunchConfig], launch: Callable[[LaunchConfig], None]) -> LaunchConfig:
    import torch

    best: tuple[float, LaunchConfig] | None = None
    for cfg in candidates:
        try:
            launch(cfg)  # compiles
            torch.cuda.synchronize()
        except Exception as err:  # e.g. triton's OutOfResources: the tile does not fit
            if "OutOfResources" not in type(err).__name__ and "out of resource" not in str(err):
                raise
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(TIMED_RUNS):
            launch(cfg)
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end) / TIMED_RUNS
        if best is None or elapsed < best[0]:
            best = (elapsed, cfg)
    if best is None:
        raise RuntimeError("no launch configuration fits this device")
    return best[1]
