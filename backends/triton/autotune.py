"""Choosing among launch configurations on a GPU, once per kernel and size bucket.

A template may offer several configurations for a size (`EmittedKernel.
launch_candidates`, e.g. the GEMM's Hopper tiles). The first launch in a size
bucket times each candidate and keeps the fastest:
- a bucket rounds every dim up to a power of two, so a new sequence length in
  the same bucket reuses the choice instead of tuning again;
- each candidate is launched once (which compiles it; one that does not fit
  the device is skipped), then timed `TIMED_RUNS` times with CUDA events,
  flushing the L2 cache before each run; its time is the median;
- tuning shares one budget per process, `TILEDSL_AUTOTUNE_BUDGET_S` seconds
  (default 30): when it runs out, the best configuration so far is kept, and
  later kernels take their first candidate (the template's default) untimed.
  Choices made on a spent budget are not saved, so a later process tunes them;
- tuning that takes over a second prints one line on stderr.
Choices are cached in memory and in `autotune.json` in the kernel cache
directory (plain JSON, read again and written atomically under a lock on
`autotune.json.lock`, so processes tuning at once keep each other's choices), keyed by the kernel's cache key,
the size bucket and the device name. That file is data, never trusted: one
that is not a regular file, not a JSON object, or holds entries of the wrong
shape is ignored (its kernels are tuned again; one line on stderr), and one
that cannot be saved (a full disk) leaves no temp file and keeps the choice
for this process. Outputs are fresh tensors, so launching a kernel several
times is harmless.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tiledsl import diagnostics as diag
from tiledsl import logs

from .base import EmittedKernel, LaunchConfig, describe
from .cache import cache_dir, cache_key, read_regular, write_atomic
from .codegen import next_pow2

_lock = threading.Lock()
_chosen: dict[str, dict[str, Any]] = {}
TIMED_RUNS = 5
DEFAULT_BUDGET_S = 30.0
L2_FLUSH_BYTES = 256 << 20  # more than any GPU's L2 (an H100 has 50 MB)
_spent = [0.0]  # seconds this process has spent tuning
_flush_buffers: dict[int, Any] = {}  # per device
_warned: set[str] = set()
MAX_FILE_BYTES = 16 << 20  # an autotune.json larger than this is not read (tens of thousands of choices)


def _reset_after_fork() -> None:
    """A forked child has only the forking thread: a lock another thread held is held forever."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def bucket(dims: Mapping[str, int]) -> dict[str, int]:
    """The size bucket of a call: every dim rounded up to a power of two."""
    return {k: next_pow2(v) for k, v in dims.items()}


def _key(emitted: EmittedKernel, dims: Mapping[str, int]) -> str:
    import torch

    sizes = ",".join(f"{k}={v}" for k, v in sorted(bucket(dims).items()))
    return f"{cache_key(emitted.source, 'cuda', emitted.ir())[:32]}|{sizes}|{torch.cuda.get_device_name()}"


def budget_s() -> float:
    text = os.environ.get("TILEDSL_AUTOTUNE_BUDGET_S")
    if text is None:
        return DEFAULT_BUDGET_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise diag.OptionError(message=(
            f"TILEDSL_AUTOTUNE_BUDGET_S={text[:40]}: give a number of seconds (0 or more)"))
    return value


def _path() -> Path:
    return cache_dir() / "autotune.json"


def _load_disk() -> dict[str, dict[str, Any]]:
    """The valid choices in `autotune.json`; anything else in it is ignored, with one warning."""
    path = _path()
    data = read_regular(path, MAX_FILE_BYTES)
    if data is None:
        if os.path.lexists(path):
            _warn(f"ignoring {path}: it is not a readable regular file of at most "
                  f"{MAX_FILE_BYTES >> 20} MiB; its kernels are tuned again")
        return {}
    try:
        found = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep
        found = None
    if not isinstance(found, dict):
        _warn(f"ignoring {path}: it is not a JSON object of launch choices; its kernels are tuned again")
        return {}
    choices = {k: v for k, v in found.items() if _is_choice(v)}
    if len(choices) < len(found):
        _warn(f"ignoring {len(found) - len(choices)} malformed entries in {path}; their kernels are "
              "tuned again")
    return choices


def _is_choice(value: Any) -> bool:
    """What `describe` writes: launch parameters by name, each an int or a bool."""
    return isinstance(value, dict) and bool(value) and all(
        isinstance(v, int) for v in value.values())


def _save_disk(key: str, choice: dict[str, Any]) -> None:
    """Add one choice to `autotune.json`; a failure (a full disk) keeps it for this process only.
    Other processes tune and save too: the file is read again and replaced under an exclusive
    lock (`_locked`), so a choice another process saved meanwhile is kept, never overwritten
    by a copy read before it was there."""
    path = _path()
    try:
        with _locked(path.with_name(path.name + ".lock")):
            data = _load_disk()
            data[key] = choice
            write_atomic(path, json.dumps(data, indent=1, sort_keys=True).encode())
    except OSError as err:
        _warn(f"cannot save autotuning choices to {path}: {err.strerror or err}; they are kept for this "
              "process only")


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on the file `lock` (made if missing, mode 0600; it stays,
    empty). Where there is no fcntl (Windows), or the lock file cannot be used (something
    other than a regular file in its place), the save goes ahead unlocked, with one line on
    stderr for the latter."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as err:
        _warn(f"cannot lock {lock} ({err.strerror or err}); saving autotuning choices without it")
        yield
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            _warn(f"cannot lock {lock} (not a regular file); saving autotuning choices without it")
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd is closed, or the process dies
        except OSError as err:  # a file system without locks (ENOLCK, EOPNOTSUPP on some NFS)
            _warn(f"cannot lock {lock} ({err.strerror or err}); saving autotuning choices without it")
        yield
    finally:
        os.close(fd)


def _warn(message: str) -> None:
    """One line on stderr, once per process for each message."""
    if message not in _warned:
        _warned.add(message)
        print(f"tiledsl: {message}", file=sys.stderr)


def choose(emitted: EmittedKernel, dims: Mapping[str, int], candidates: Sequence[LaunchConfig],
           launch: Callable[[LaunchConfig], None]) -> LaunchConfig:
    """The fastest candidate for this size bucket (timed once, then remembered)."""
    key = _key(emitted, dims)
    with _lock:
        if key not in _chosen:
            _chosen.update({k: v for k, v in _load_disk().items() if k not in _chosen})
        wanted = _chosen.get(key)
    if wanted is not None:
        for cfg in candidates:
            if describe(cfg) == wanted:
                if logs.logger("autotune").isEnabledFor(logging.INFO):
                    logs.logger("autotune").info("%s: %s (chosen before)", emitted.kernel.name, _format(cfg))
                return cfg
    left = budget_s() - _spent[0]
    if left <= 0:  # the budget is spent: the first candidate that fits, untimed
        return next((cfg for cfg in candidates if _fits(cfg, launch)), candidates[0])
    start = time.perf_counter()
    sizes = ", ".join(f"{k}={v}" for k, v in dims.items())

    def progress(i: int) -> None:  # once, when tuning has run past a second
        print(f"tiledsl: autotuning kernel {emitted.kernel.name} ({emitted.kernel.template}) at {sizes}: "
              f"candidate {i + 1} of {len(candidates)} after {time.perf_counter() - start:.1f} s "
              "(TILEDSL_AUTOTUNE_BUDGET_S bounds it)", file=sys.stderr)

    best, complete = _time(candidates, launch, start + left, progress)
    elapsed = time.perf_counter() - start
    _spent[0] += elapsed
    if elapsed > 1.0:
        note = "" if complete else " (the autotuning budget ran out: best so far)"
        print(f"tiledsl: autotuned kernel {emitted.kernel.name} ({emitted.kernel.template}) at "
              f"{sizes} in {elapsed:.1f} s: {_format(best)}{note}", file=sys.stderr)
    log = logs.logger("autotune")
    if log.isEnabledFor(logging.INFO):
        log.info("%s (%s) at %s: chose %s in %.2f s%s", emitted.kernel.name, emitted.kernel.template,
                 ", ".join(f"{k}={v}" for k, v in dims.items()), _format(best), elapsed,
                 "" if complete else " (budget ran out)")
    with _lock:
        _chosen[key] = describe(best)
        if complete:
            _save_disk(key, _chosen[key])
    return best


def _format(cfg: LaunchConfig) -> str:
    return ", ".join(f"{k}={v}" for k, v in describe(cfg).items() if k != "INTERPRETER")


def _time(candidates: Sequence[LaunchConfig], launch: Callable[[LaunchConfig], None],
          deadline: float, progress: Callable[[int], None] | None = None) -> tuple[LaunchConfig, bool]:
    """The fastest candidate, and whether every one was timed before `deadline`;
    `progress(i)` once, before candidate i, when timing has run past a second."""
    best: tuple[float, LaunchConfig] | None = None
    start, told = time.perf_counter(), progress is None
    for i, cfg in enumerate(candidates):
        if i > 0 and time.perf_counter() > deadline:
            return best[1] if best else candidates[0], False
        if not told and time.perf_counter() - start > 1.0:
            progress(i)
            told = True
        elapsed = _measure(cfg, launch)
        if logs.logger("autotune").isEnabledFor(logging.INFO):
            logs.logger("autotune").info("  candidate %s: %s", _format(cfg),
                                         "does not fit" if elapsed is None else f"{elapsed * 1e3:.3f} ms")
        if elapsed is not None and (best is None or elapsed < best[0]):
            best = (elapsed, cfg)
    if best is None:
        raise RuntimeError("no launch configuration fits this device")
    return best[1], True


def _fits(cfg: LaunchConfig, launch: Callable[[LaunchConfig], None]) -> bool:
    """Launch once (compiling): False if the device cannot hold the tile."""
    import torch

    try:
        launch(cfg)
        torch.cuda.synchronize()
    except Exception as err:  # e.g. triton's OutOfResources: the tile does not fit
        if "OutOfResources" not in type(err).__name__ and "out of resource" not in str(err):
            raise
        return False
    return True


def _measure(cfg: LaunchConfig, launch: Callable[[LaunchConfig], None]) -> float | None:
    """Median milliseconds of one launch with a cold L2, or None if it does not fit."""
    import torch

    if not _fits(cfg, launch):
        return None
    device = torch.cuda.current_device()
    if device not in _flush_buffers:
        _flush_buffers[device] = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    flush = _flush_buffers[device]
    times = []
    for _ in range(TIMED_RUNS):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch(cfg)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
