"""The GPU autotuner's choice and caching (the CUDA-event timing itself needs a GPU)."""

import json
import os
import stat
from pathlib import Path

import pytest
import torch

import tiledsl
from faults import disk_full, finishes, non_regular_kinds, plant
from helpers import randn
from tiledsl.backends.triton import autotune
from tiledsl.backends.triton.base import LaunchConfig


def emitted_gemm():
    fn = tiledsl.compile("kernel f(x: f16[M, K], w: f16[N, K], b: f16[N]) -> f16[M, N] { return gelu(x @ w.T + b) }")
    fn(randn(512, 256, dtype=torch.float16), randn(384, 256, dtype=torch.float16), randn(384, dtype=torch.float16))
    (launch,) = fn.launches
    return launch.kernel, dict(launch.dims)


def test_choose_times_once_then_remembers(monkeypatch, tmp_path):
    monkeypatch.setenv("TILEDSL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_key", lambda emitted, dims: f"kernel|{sorted(dims.items())}|test-gpu")
    monkeypatch.setattr(autotune, "_chosen", {})
    emitted, dims = emitted_gemm()
    candidates = emitted.launch_candidates(dims, "cuda")
    assert [(c.constexprs["BLOCK_M"], c.constexprs["BLOCK_N"], c.num_warps) for c in candidates][:2] == \
        [(128, 128, 8), (128, 256, 8)]
    timed = []

    def fake_time(cands, launch, deadline, progress=None):
        timed.append(len(cands))
        return cands[2], True

    monkeypatch.setattr(autotune, "_time", fake_time)
    first = autotune.choose(emitted, dims, candidates, launch=lambda cfg: None)
    again = autotune.choose(emitted, dims, candidates, launch=lambda cfg: None)
    assert first is candidates[2] and again is candidates[2] and timed == [len(candidates)]
    saved = json.loads((tmp_path / "autotune.json").read_text())
    assert list(saved.values()) == [autotune.describe(candidates[2])]
    monkeypatch.setattr(autotune, "_chosen", {})  # a new process: read back from disk
    assert autotune.choose(emitted, dims, candidates, launch=lambda cfg: None) is candidates[2]
    assert timed == [len(candidates)]


@pytest.mark.parametrize("src, dims", [
    ("@tile(BLOCK_M=64, BLOCK_N=64)\nkernel f(a: f16[M, K], b: f16[K, N]) -> f16[M, N] { return a @ b }",
     {"M": 512, "N": 512, "K": 256}),
    ((Path(__file__).resolve().parent.parent / "examples" / "attention.tdsl").read_text(),
     {"B": 4, "H": 16, "M": 4096, "N": 4096, "D": 64}),
])
def test_user_tile_hints_are_the_first_autotune_candidate_not_the_only_one(src, dims):
    """(issue 29: the shipped attention example's @tile(64, 64) turned autotuning off, 1.15-1.3x
    from the best tile at D = 64)"""
    from tiledsl.backends.triton.aot import meta_launches

    hinted = tiledsl.compile(src)
    (launch,) = meta_launches(hinted, dims)
    cfg = launch.kernel.launch_config(dict(launch.dims), "cuda")
    assert (cfg.constexprs["BLOCK_M"], cfg.constexprs["BLOCK_N"]) == (64, 64)
    candidates = launch.kernel.launch_candidates(dict(launch.dims), "cuda")
    assert candidates[0] == cfg
    (plain,) = meta_launches(tiledsl.compile(src.replace("@tile(BLOCK_M=64, BLOCK_N=64)", "")), dims)
    others = plain.kernel.launch_candidates(dict(plain.dims), "cuda")
    assert len(others) > 1 and [autotune.describe(c) for c in candidates] == [autotune.describe(cfg)] + [
        autotune.describe(c) for c in others if autotune.describe(c) != autotune.describe(cfg)]


class FakeGpu:
    """Candidate timings on a fake clock: each timed candidate costs `cost_s` seconds."""

    def __init__(self, monkeypatch, tmp_path, ms, cost_s=0.1, too_big=()):
        self.now, self.measured, self.ms, self.cost_s = 0.0, [], ms, cost_s
        self.too_big, self.tried = too_big, []  # configurations the device cannot hold
        monkeypatch.setenv("TILEDSL_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(autotune, "_chosen", {})
        monkeypatch.setattr(autotune, "_spent", [0.0])
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test-gpu")
        monkeypatch.setattr(autotune.time, "perf_counter", lambda: self.now)
        monkeypatch.setattr(autotune, "_measure", self.measure)
        monkeypatch.setattr(autotune, "_fits", self.fits)

    def fits(self, cfg, launch):
        self.tried.append(cfg)
        return cfg not in self.too_big

    def measure(self, cfg, launch):
        self.now += self.cost_s
        self.measured.append(cfg)
        return self.ms[len(self.measured) - 1]


def test_a_size_bucket_is_tuned_once(monkeypatch, tmp_path):
    emitted, dims = emitted_gemm()
    candidates = emitted.launch_candidates(dims, "cuda")
    gpu = FakeGpu(monkeypatch, tmp_path, [3.0, 1.0] + [2.0] * (len(candidates) - 2))
    assert autotune.choose(emitted, dims, candidates, launch=None) is candidates[1]
    assert len(gpu.measured) == len(candidates)
    # 512 -> 500 and 384 -> 300 stay in the buckets 512 and 512: no new timing
    same = {**dims, "M": 500, "N": 300}
    chosen = autotune.choose(emitted, same, emitted.launch_candidates(same, "cuda"), launch=None)
    assert autotune.describe(chosen) == autotune.describe(candidates[1])
    assert len(gpu.measured) == len(candidates)
    assert autotune.bucket(same) == autotune.bucket(dims) != autotune.bucket({**dims, "M": 513})


def test_the_budget_keeps_the_best_so_far_then_the_first_that_fits(monkeypatch, tmp_path, capsys):
    emitted, dims = emitted_gemm()
    candidates = emitted.launch_candidates(dims, "cuda")
    assert len(candidates) >= 4
    gpu = FakeGpu(monkeypatch, tmp_path, [3.0, 1.0, 0.5, 0.1], cost_s=2.0)
    monkeypatch.setenv("TILEDSL_AUTOTUNE_BUDGET_S", "3")
    # two candidates fit in 3 s (the second starts at 2 s); the third would start past it
    assert autotune.choose(emitted, dims, candidates, launch=None) is candidates[1]
    assert gpu.measured == candidates[:2]
    err = capsys.readouterr().err.splitlines()
    # a progress line once tuning has run past a second (before the second candidate, at 2 s)
    assert err[0] == ("tiledsl: autotuning kernel k0 (matmul) at K=256, M=512, N=384: candidate 2 of "
                      f"{len(candidates)} after 2.0 s (TILEDSL_AUTOTUNE_BUDGET_S bounds it)")
    assert err[1].startswith("tiledsl: autotuned kernel k0 (matmul) at K=256, M=512, N=384 in 4.0 s: ")
    assert err[1].endswith("(the autotuning budget ran out: best so far)") and len(err) == 2
    assert not (tmp_path / "autotune.json").exists()  # a later process tunes it properly
    # the budget is spent: another size takes the template's default without timing
    other = {**dims, "M": 4096}
    others = emitted.launch_candidates(other, "cuda")
    assert autotune.choose(emitted, other, others, launch=None) is others[0]
    assert gpu.measured == candidates[:2]
    # ... or, where the device cannot hold the default's tile, the first candidate it can
    gpu.tried = []
    third = {**dims, "M": 2048}
    thirds = emitted.launch_candidates(third, "cuda")
    gpu.too_big = (thirds[0],)
    assert autotune.choose(emitted, third, thirds, launch=None) is thirds[1]
    assert gpu.tried == thirds[:2] and gpu.measured == candidates[:2]


def test_quick_tuning_prints_nothing(monkeypatch, tmp_path, capsys):
    emitted, dims = emitted_gemm()
    candidates = emitted.launch_candidates(dims, "cuda")
    FakeGpu(monkeypatch, tmp_path, [1.0] * len(candidates), cost_s=0.01)
    autotune.choose(emitted, dims, candidates, launch=None)
    assert capsys.readouterr().err == ""
    assert (tmp_path / "autotune.json").exists()


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_bad_budget_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("TILEDSL_AUTOTUNE_BUDGET_S", value)
    with pytest.raises(tiledsl.TileDSLError) as err:
        autotune.budget_s()
    assert str(err.value) == (f"error: TILEDSL_AUTOTUNE_BUDGET_S={value}: give a number of seconds "
                              "(0 or more)")


# --- autotune.json is data: ignored when malformed, never fatal when it cannot be saved ----------

KEY = "kernel|M=512|test-gpu"
CANDIDATES = [LaunchConfig((4,), {"BLOCK_M": b}, num_warps=4, num_stages=3) for b in (64, 128, 256)]
BEST = autotune.describe(CANDIDATES[1])


@pytest.fixture
def tuner(monkeypatch, tmp_path):
    """`choose` on fake candidates with a fake clock-free timer that picks the second one."""
    monkeypatch.setenv("TILEDSL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_key", lambda emitted, dims: KEY)
    monkeypatch.setattr(autotune, "_chosen", {})
    monkeypatch.setattr(autotune, "_warned", set())
    monkeypatch.setattr(autotune, "_spent", [0.0])
    timed = []

    def fake_time(cands, launch, deadline, progress=None):
        timed.append(len(cands))
        return cands[1], True

    monkeypatch.setattr(autotune, "_time", fake_time)
    return tmp_path, timed


def choose():
    return autotune.choose(None, {"M": 512}, CANDIDATES, launch=None)


NOT_AN_OBJECT = "it is not a JSON object of launch choices; its kernels are tuned again"


@pytest.mark.parametrize(("content", "why"), [
    (b"[1, 2]", NOT_AN_OBJECT),
    (b'"x"', NOT_AN_OBJECT),
    (b"null", NOT_AN_OBJECT),
    (b"{", NOT_AN_OBJECT),
    (b"\xff\xfe{}", NOT_AN_OBJECT),
    (b"[" * 100_000, NOT_AN_OBJECT),
    (json.dumps({KEY: 5, "other": {"BLOCK_M": 64, "num_warps": 4}}).encode(), "1 malformed entries"),
    (json.dumps({KEY: {"BLOCK_M": "128"}, "a": [], "b": {}, "c": {"num_warps": 4.0},
                 "other": {"BLOCK_M": 64, "num_warps": 4}}).encode(), "4 malformed entries"),
])
def test_autotune_json_that_is_valid_json_but_not_choices_is_ignored(tuner, capsys, content, why):
    path, timed = tuner
    (path / "autotune.json").write_bytes(content)
    assert choose() is CANDIDATES[1]
    assert timed == [len(CANDIDATES)]
    file = path / "autotune.json"
    expected = (f"tiledsl: ignoring {file}: {why}\n" if why == NOT_AN_OBJECT else
                f"tiledsl: ignoring {why} in {file}; their kernels are tuned again\n")
    assert capsys.readouterr().err == expected  # one line, though the file was read twice
    saved = json.loads(file.read_text())
    assert saved[KEY] == BEST
    if "malformed" in why:  # the good entry is kept
        assert saved == {KEY: BEST, "other": {"BLOCK_M": 64, "num_warps": 4}}
    assert not list(path.glob(".tmp-*"))


@pytest.mark.parametrize("kind", non_regular_kinds())
def test_autotune_json_replaced_by_fifo_or_device_does_not_block(tuner, capsys, kind):
    path, _ = tuner
    file = path / "autotune.json"
    plant(file, kind)
    assert finishes(choose, unblock=file if kind == "fifo" else None) is CANDIDATES[1]
    assert capsys.readouterr().err == (
        f"tiledsl: ignoring {file}: it is not a readable regular file of at most 16 MiB; its kernels are "
        "tuned again\n")
    assert stat.S_ISREG(os.lstat(file).st_mode)
    assert json.loads(file.read_text()) == {KEY: BEST}


def test_autotune_json_that_cannot_be_saved_leaves_no_temp_file(tuner, capsys, monkeypatch):
    path, timed = tuner
    file = path / "autotune.json"
    file.write_text(json.dumps({"other": {"BLOCK_M": 64}}))
    made = disk_full(monkeypatch)
    assert choose() is CANDIDATES[1]  # no exception reaches the call
    assert made and not list(path.glob(".tmp-*"))
    assert capsys.readouterr().err == (
        f"tiledsl: cannot save autotuning choices to {file}: No space left on device; they are kept for "
        "this process only\n")
    assert json.loads(file.read_text()) == {"other": {"BLOCK_M": 64}}  # untouched
    assert choose() is CANDIDATES[1] and timed == [len(CANDIDATES)]  # remembered in memory


# --- processes tuning at once keep each other's choices ------------------------------------------

SAVER = """
import os, sys, time
from tiledsl.backends.triton import autotune
worker, count, start = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
open(f"{start}.ready{worker}", "w").close()
while not os.path.exists(start):
    time.sleep(0.001)
for i in range(count):
    autotune._save_disk(f"kernel{worker}-{i}|M=512|test-gpu", {"BLOCK_M": 64 + i, "num_warps": worker})
"""


def test_concurrent_processes_saving_choices_keep_every_one(tmp_path):
    import subprocess
    import sys
    import time

    cache, start = tmp_path / "cache", tmp_path / "start"
    cache.mkdir(mode=0o700)
    env = {**os.environ, "TILEDSL_CACHE_DIR": str(cache)}
    workers, count = 4, 30
    procs = [subprocess.Popen([sys.executable, "-c", SAVER, str(w), str(count), str(start)], env=env,
                              stderr=subprocess.PIPE, text=True) for w in range(workers)]
    deadline = time.monotonic() + 240
    while len(list(tmp_path.glob("start.ready*"))) < workers and time.monotonic() < deadline:
        time.sleep(0.01)
    start.touch()  # every worker is imported and waiting: they save at once
    errors = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * workers, errors
    assert errors == [""] * workers
    saved = json.loads((cache / "autotune.json").read_text())
    assert saved == {f"kernel{w}-{i}|M=512|test-gpu": {"BLOCK_M": 64 + i, "num_warps": w}
                     for w in range(workers) for i in range(count)}
    assert not list(cache.glob(".tmp-*"))
    assert stat.S_IMODE(os.stat(cache / "autotune.json.lock").st_mode) == 0o600


def test_a_lock_file_that_is_not_a_file_does_not_stop_saving(tuner, capsys):
    path, _ = tuner
    (path / "autotune.json.lock").mkdir()
    assert choose() is CANDIDATES[1]
    assert json.loads((path / "autotune.json").read_text()) == {KEY: BEST}
    err = capsys.readouterr().err
    assert err.startswith(f"tiledsl: cannot lock {path / 'autotune.json.lock'} (") and err.endswith(
        "); saving autotuning choices without it\n") and err.count("\n") == 1


def test_a_file_system_without_locks_does_not_stop_saving(tuner, capsys, monkeypatch):
    """flock failing (ENOLCK, EOPNOTSUPP on some NFS mounts): the choice is saved unlocked,
    with one line saying so."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    path, _ = tuner
    assert choose() is CANDIDATES[1]
    assert json.loads((path / "autotune.json").read_text()) == {KEY: BEST}
    assert capsys.readouterr().err == (f"tiledsl: cannot lock {path / 'autotune.json.lock'} (No locks "
                                       "available); saving autotuning choices without it\n")


def test_saving_without_fcntl_still_saves(tuner, monkeypatch):
    import builtins

    path, _ = tuner
    real_import = builtins.__import__

    def no_fcntl(name, *args, **kwargs):
        if name == "fcntl":
            raise ImportError("No module named 'fcntl'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fcntl)
    assert choose() is CANDIDATES[1]
    assert json.loads((path / "autotune.json").read_text()) == {KEY: BEST}
    assert not (path / "autotune.json.lock").exists()
