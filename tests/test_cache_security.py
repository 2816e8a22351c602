"""The kernel cache runs only what the compiler wrote (the threat model in backends/triton/cache.py).

Each hostile file is planted by the test itself, as the current user; a
directory "owned by another user" is made with chown when the tests run as
root, and is an existing root-owned directory otherwise.
"""

import importlib.util
import os
import stat
import sys
from importlib._bootstrap_external import _code_to_timestamp_pyc

import pytest
import torch

import tiledsl
from helpers import randn
from tiledsl.backends.triton import cache
from tiledsl.diagnostics import CacheError

SRC = "kernel f(x: f32[M, N], y: f32[N]) -> f32[M, N] { return exp(x) * y }"
BLANK = ("TILEDSL_CACHE_DIR is set but blank; set it to a directory of your own, or unset it to use "
         "~/.cache/tiledsl")


@pytest.fixture
def use_cache(tmp_path, monkeypatch):
    """Point the cache at a path; forget every loaded module before and after."""

    def use(path):
        monkeypatch.setenv("TILEDSL_CACHE_DIR", str(path))
        _forget()
        return path

    yield use
    _forget()


def _forget():
    cache.forget_loaded()
    for name in [n for n in sys.modules if n.startswith("tiledsl_kernels.")]:
        del sys.modules[name]


def run_once():
    x, y = randn(3, 5), randn(5)
    out = tiledsl.compile(SRC)(x, y)
    assert torch.allclose(out, torch.exp(x) * y)
    return out


def test_planted_bytecode_is_never_executed(use_cache, tmp_path, monkeypatch):
    path = use_cache(tmp_path / "cache")
    run_once()
    marker = tmp_path / "pwned"
    for module in path.glob("tdsl_*.py"):
        st = os.stat(module)
        evil = compile(f"open({str(marker)!r}, 'w').write('pwned')\n", str(module), "exec")
        pyc = importlib.util.cache_from_source(str(module))
        os.makedirs(os.path.dirname(pyc), exist_ok=True)
        with open(pyc, "wb") as f:  # a header that matches the genuine file's mtime and size
            f.write(_code_to_timestamp_pyc(evil, int(st.st_mtime), st.st_size))
    for dont_write in ("", "1"):
        monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", dont_write)
        _forget()
        run_once()
        assert not marker.exists()


def test_the_file_on_disk_is_not_what_runs(use_cache, tmp_path):
    path = use_cache(tmp_path / "cache")
    run_once()
    for module in path.glob("tdsl_*.py"):
        module.write_text("raise SystemExit('tampered')\n")
    _forget()
    run_once()  # rewritten, and compiled from the generated text
    assert all("tampered" not in m.read_text() for m in path.glob("tdsl_*.py"))
    assert not list(path.glob(".tmp-*"))  # atomic writes


def test_a_new_directory_is_private(use_cache, tmp_path):
    path = use_cache(tmp_path / "deep" / "cache")
    run_once()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700


def test_a_directory_writable_by_others_is_refused_and_left_alone(use_cache, tmp_path):
    path = use_cache(tmp_path / "cache")
    path.mkdir()
    os.chmod(path, 0o777)
    with pytest.raises(CacheError) as err:
        run_once()
    assert err.value.message == (
        f"the kernel cache directory {path} is writable by other users (mode 777); tiledsl runs code "
        f"from it, so it refuses; run 'chmod go-w {path}' or set TILEDSL_CACHE_DIR to a directory of "
        "your own")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o777


def test_a_directory_of_another_user_is_refused(use_cache, tmp_path):
    if os.getuid() == 0:
        path = tmp_path / "theirs"
        path.mkdir(mode=0o755)
        os.chown(path, 65534, 65534)
    else:
        path = tmp_path.anchor  # "/", root's
    use_cache(path)
    with pytest.raises(CacheError, match=r"belongs to another user \(uid \d+\); tiledsl runs code from "
                       "it, so it must be your own; set TILEDSL_CACHE_DIR"):
        run_once()


def test_a_parent_others_can_write_is_refused(use_cache, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # not sticky: anyone could rename our cache away
    use_cache(shared / "cache")
    with pytest.raises(CacheError, match=f"is inside {shared}, which other users can write "
                       r"\(mode 777, not sticky\), so they could replace the cache"):
        run_once()
    os.chmod(shared, 0o1777)  # sticky, like /tmp: fine
    run_once()


def test_a_symlinked_directory_is_used_but_never_chmodded(use_cache, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    os.chmod(target, 0o755)
    link = tmp_path / "link"
    link.symlink_to(target)
    use_cache(link)
    run_once()
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755
    assert list(target.glob("tdsl_*.py"))
    os.chmod(target, 0o777)
    _forget()
    with pytest.raises(CacheError, match=f"{link} \\(= {target}\\) is writable by other users"):
        run_once()
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o777


@pytest.mark.parametrize("kind", ["file", "dangling", "proc", "blank", "under-a-file"])
def test_unusable_locations_say_what_to_set(use_cache, tmp_path, monkeypatch, kind):
    if kind == "file":
        path = tmp_path / "afile"
        path.write_text("x")
        expected = f"cannot use the kernel cache directory {path}: it is not a directory"
    elif kind == "dangling":
        path = tmp_path / "dangling"
        path.symlink_to(tmp_path / "nowhere")
        expected = f"cannot use the kernel cache directory {path}: No such file or directory"
    elif kind == "proc":
        path = "/proc"
        expected = "/proc"
    elif kind == "under-a-file":
        (tmp_path / "afile").write_text("x")
        path = tmp_path / "afile" / "cache"
        expected = f"cannot use the kernel cache directory {path}: Not a directory"
    else:
        path = " \t "
        expected = BLANK
    use_cache(path)
    with pytest.raises(CacheError) as err:
        run_once()
    assert expected in err.value.message
    assert "TILEDSL_CACHE_DIR" in err.value.message


@pytest.mark.parametrize("corruption", ["non-utf8", "directory", "nul", "symlink"])
def test_a_corrupt_entry_is_rebuilt(use_cache, tmp_path, corruption):
    path = use_cache(tmp_path / "cache")
    run_once()
    elsewhere = tmp_path / "elsewhere.py"
    elsewhere.write_text("precious = 1\n")
    for module in list(path.glob("tdsl_*.py")):
        module.unlink()
        if corruption == "non-utf8":
            module.write_bytes(b"\xff\xfe\x00garbage")
        elif corruption == "nul":
            module.write_bytes(b"\0" * 64)
        elif corruption == "directory":
            module.mkdir()
            (module / "inner").write_text("x")
        else:
            module.symlink_to(elsewhere)
    _forget()
    run_once()
    for module in path.glob("tdsl_*.py"):
        assert module.is_file() and not module.is_symlink()
        assert "@triton.jit" in module.read_text()
    assert elsewhere.read_text() == "precious = 1\n"  # a link is replaced, never written through
