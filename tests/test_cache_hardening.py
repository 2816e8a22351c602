"""The kernel cache under hostile files, careless environments and many programs.

Non-regular files in a module's place never block a load; the cache directory
is checked before anything is created (mode 0700 whatever the umask, nothing
in a refused location, nothing in another user's home); loaded kernels and
their `linecache` source are released with the programs that use them.
"""

import gc
import inspect
import linecache
import os
import stat
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import tiledsl
from faults import disk_full, finishes, non_regular_kinds, plant
from helpers import randn, run_checked
from tiledsl.backends.triton import cache
from tiledsl.diagnostics import CacheError

SRC = "kernel f(x: f32[M, N], y: f32[N]) -> f32[M, N] { return exp(x) * y }"
SETTING = "set TILEDSL_CACHE_DIR to a directory of your own"
IS_ROOT = hasattr(os, "getuid") and os.getuid() == 0
NOBODY = 65534


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh HOME and no cache variables: the cache goes to ~/.cache/tiledsl."""
    path = tmp_path / "home"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(path))
    monkeypatch.delenv("TILEDSL_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return path


# --- non-regular files in the cache --------------------------------------------------------------

@pytest.mark.parametrize("kind", non_regular_kinds())
def test_cached_module_replaced_by_fifo_or_device_does_not_block(private_cache, kind):
    x, y = randn(17, 113), randn(113)
    fn, expected = run_checked(SRC, x, y, sm90=False)
    modules = sorted(private_cache.glob("tdsl_*.py"))
    assert modules
    for module in modules:
        plant(module, kind)
    cache.forget_loaded()
    again = finishes(lambda: tiledsl.compile(SRC)(x, y), unblock=modules[0] if kind == "fifo" else None)
    assert torch.equal(again, expected)
    sources = {e.source for e in fn.runtime.emitted}
    for module in modules:
        assert stat.S_ISREG(os.lstat(module).st_mode)
        assert module.read_text() in sources
    assert not list(private_cache.glob(".tmp-*"))


def test_a_regular_file_is_read_only_up_to_the_size_wanted(tmp_path):
    path = tmp_path / "big"
    with open(path, "wb") as f:
        f.truncate(30 << 30)  # sparse: 30 GB that must never be read
    assert cache.read_regular(path, 1 << 20) is None
    path.write_bytes(b"abc")
    assert cache.read_regular(path, 3) == b"abc"
    assert cache.read_regular(path, 2) is None


# --- the cache directory: checked before anything is created --------------------------------------

@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_directories_tiledsl_creates_are_0700_whatever_the_umask(home, umask):
    old = os.umask(umask)
    try:
        path = cache.cache_dir()
    finally:
        os.umask(old)
    assert path == home / ".cache" / "tiledsl"
    for created in (home / ".cache", path):
        assert stat.S_IMODE(os.stat(created).st_mode) == 0o700, created


def test_nothing_is_created_under_a_parent_others_can_write(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # not sticky
    path = shared / "a" / "b" / "cache"
    monkeypatch.setenv("TILEDSL_CACHE_DIR", str(path))
    with pytest.raises(CacheError) as err:
        cache.cache_dir()
    assert err.value.message == (
        f"the kernel cache directory {path} is inside {shared}, which other users can write (mode 777, "
        f"not sticky), so they could replace the cache; {SETTING}")
    assert list(shared.iterdir()) == []


@pytest.mark.skipif(not IS_ROOT, reason="only root can create a directory inside another user's")
def test_nothing_is_created_under_another_users_directory(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    path = theirs / "a" / "cache"
    monkeypatch.setenv("TILEDSL_CACHE_DIR", str(path))
    with pytest.raises(CacheError) as err:
        cache.cache_dir()
    assert err.value.message == (
        f"the kernel cache directory {path} is inside {theirs}, which belongs to another user "
        f"(uid {NOBODY}), so they could replace the cache; {SETTING}")
    assert list(theirs.iterdir()) == []


@pytest.mark.skipif(not IS_ROOT, reason="only root can create a directory in a home it does not own")
def test_root_creates_nothing_in_another_users_home(home):
    os.chmod(home, 0o755)
    os.chown(home, NOBODY, NOBODY)  # e.g. `sudo` keeping the user's HOME
    with pytest.raises(CacheError) as err:
        cache.cache_dir()
    assert err.value.message == (
        f"the kernel cache directory {home / '.cache' / 'tiledsl'} is inside {home}, which belongs to "
        f"another user (uid {NOBODY}), so they could replace the cache; {SETTING}")
    assert list(home.iterdir()) == []


def test_a_relative_xdg_cache_home_is_ignored(home, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert cache.cache_dir() == home / ".cache" / "tiledsl"
    assert list(work.iterdir()) == []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # an absolute one is used
    assert cache.cache_dir() == tmp_path / "xdg" / "tiledsl"


def test_a_relative_home_is_not_used(home, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", "relative/home")
    with pytest.raises(CacheError) as err:
        cache.cache_dir()
    assert err.value.message == f"cannot find your home directory for the kernel cache; {SETTING}"
    assert list(work.iterdir()) == []


def test_a_kernel_that_cannot_be_written_is_a_cache_error_and_leaves_no_temp_file(private_cache,
                                                                                   monkeypatch):
    full = disk_full(monkeypatch)
    with pytest.raises(CacheError) as err:
        tiledsl.compile(SRC)(randn(3, 5), randn(5))
    assert err.value.message == (
        f"cannot write to the kernel cache directory {private_cache}: No space left on device; {SETTING}")
    assert full and list(private_cache.iterdir()) == []


# --- memory: loaded kernels are released --------------------------------------------------------

def kernel_source(i: int) -> str:
    return f"import triton\n\n\n@triton.jit\ndef k(x_ptr):\n    # variant {i}\n    pass\n"


def cached_lines() -> list[str]:
    return [name for name in linecache.cache if os.path.basename(name).startswith("tdsl_")]


def test_loading_many_distinct_kernels_keeps_memory_bounded(private_cache, monkeypatch):
    monkeypatch.setattr(cache, "KEEP_RECENT", 8)
    x, y = randn(17, 113), randn(113)
    early, _ = run_checked(SRC, x, y, sm90=False)  # compiled first, still referenced
    held = cache.load(kernel_source(-1), "k", "cuda")  # a kernel a live program would hold
    before = len(cached_lines())
    for i in range(120):
        cache.load(kernel_source(i), "k", "cuda")
    for _ in range(2):  # a load releases what was collected before it; the first one evicts one more
        gc.collect()
        cache.load(kernel_source(0), "k", "cuda")
    assert len(cache.loaded()) <= before + 8
    assert len(cached_lines()) <= before + 8
    assert not [n for n in sys.modules if n.startswith("tiledsl_kernels.")]
    # the held kernel keeps its generated text, even with its file tampered with
    held_file = Path(held.fn.__code__.co_filename)
    held_file.write_text("raise SystemExit('tampered')\n")
    assert inspect.getsource(held.fn) == kernel_source(-1).split("\n", 3)[3]
    # the early program still runs, on new inputs
    run_checked(early, randn(1, 17), randn(17), sm90=False)
    run_checked(early, x, y, sm90=False)
    # a released kernel needed again is compiled again from its text
    again = cache.load(kernel_source(1), "k", "cuda")
    assert inspect.getsource(again.fn).endswith("    # variant 1\n    pass\n")


# --- fork ----------------------------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this system")
def test_a_fork_while_another_thread_loads_a_kernel_does_not_deadlock_the_child(private_cache):
    from tiledsl.backends.triton import autotune

    cache.cache_dir()
    held, release = threading.Event(), threading.Event()

    def inside_a_load():  # what a thread in the middle of `load` or `choose` holds
        with cache._lock, autotune._lock:
            held.set()
            release.wait(60)

    thread = threading.Thread(target=inside_a_load, daemon=True)
    thread.start()
    assert held.wait(30)
    try:
        pid = os.fork()
        if pid == 0:  # the child: load a new kernel and look up autotuning choices, then leave
            ok = cache.load(kernel_source(10_000), "k", "cuda").fn.__name__ == "k"
            with autotune._lock:
                os._exit(0 if ok else 1)
    finally:
        release.set()
    thread.join()
    status = wait_for(pid, timeout=60)
    assert status == 0


def wait_for(pid: int, timeout: float) -> int | None:
    """The child's exit status, or None (after killing it) if it is still running at `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


def test_running_many_distinct_programs_on_the_interpreter_keeps_memory_bounded(tmp_path, monkeypatch):
    """The interpreter's wrapper of each kernel (and Triton's class-level cache of rewritten
    kernels) kept every kernel ever run alive: they are now released with the kernel."""
    monkeypatch.setenv("TILEDSL_CACHE_DIR", str(tmp_path / "cache"))
    cache.forget_loaded()
    monkeypatch.setattr(cache, "KEEP_RECENT", 4)
    src = "kernel f(x: f32[M, N], y: f32[N]) -> f32[M, N] {{ return exp(x) * y + {} }}"
    early, _ = run_checked(src.format(0.5), randn(17, 113), randn(113), sm90=False)

    def settle() -> None:  # collect, then let a load drop what was collected
        for _ in range(2):
            gc.collect()
            cache.load("import triton\n@triton.jit\ndef k():\n    pass\n", "k", "cuda")

    settle()
    before = len(cached_lines())
    for i in range(40):
        run_checked(src.format(i + 1), randn(3, 5), randn(5), sm90=False)
    settle()
    assert len(cache.loaded()) <= before + 4 and len(cached_lines()) <= before + 4
    run_checked(early, randn(1, 17), randn(17), sm90=False)
