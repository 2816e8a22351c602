"""The on-disk cache of generated kernel modules, and loading them.

`@triton.jit` reads a kernel's source from its file, so generated modules are
written to a per-user cache directory, on CPU and GPU alike. File names are
content-addressed: a SHA-256 over the module source (which is printed from
the IR), the kernel's IR, the tiledsl and Triton versions, and the target.
Writes are atomic (temp file + rename); nothing is pickled.

What the cache trusts, and why (the threat model, also in the README): code
from the cache runs as the user, so another local user must not be able to
put code there.

- The directory (`$TILEDSL_CACHE_DIR`, else `$XDG_CACHE_HOME/tiledsl`, else
  `~/.cache/tiledsl`) is resolved once, through any symlinks, and must be a
  directory owned by the current user that no one else can write; so must
  each directory above it, unless it is root's or sticky (like /tmp), where
  others cannot rename our entries. A directory that fails is refused with a
  `CacheError`, never repaired: tiledsl only sets the mode (0700) of a
  directory it has just created.
- A module is never imported with Python's import machinery, which would
  trust a `__pycache__/*.pyc` whose header matches the file. It is compiled
  from the exact text the compiler generated, held in memory, and its
  source is registered in `linecache` so `@triton.jit` and the interpreter
  read that text, not the file. The file is a copy for people and tools; if
  it differs from the source (tampered, truncated, non-UTF-8, a directory in
  its place) it is rewritten, and its content is never executed either way.
"""

from __future__ import annotations

import contextlib
import hashlib
import linecache
import os
import shutil
import stat
import sys
import tempfile
import threading
import types
from pathlib import Path
from typing import Any

from tiledsl.diagnostics import CacheError

_lock = threading.Lock()
_loaded: dict[tuple[str, str], Any] = {}
_SETTING = "set TILEDSL_CACHE_DIR to a directory of your own"


def loaded() -> dict[tuple[str, str], Any]:
    """The kernels this process has loaded, by (cache directory, module name): a copy."""
    with _lock:
        return dict(_loaded)


def forget_loaded() -> None:
    """Forget the loaded kernels, so the next load reads (and checks) the cache file again."""
    with _lock:
        _loaded.clear()


def cache_dir() -> Path:
    """The cache directory, created if missing, after the checks in the module docstring."""
    env = os.environ.get("TILEDSL_CACHE_DIR")
    if env is not None:
        if not env.strip():
            raise CacheError(message=(
                "TILEDSL_CACHE_DIR is set but blank; set it to a directory of your own, or unset it "
                "to use ~/.cache/tiledsl"))
        path = Path(env)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = Path(base) / "tiledsl"
    return _private_dir(path)


def _private_dir(path: Path) -> Path:
    try:
        os.lstat(path)
    except FileNotFoundError:
        _create(path)
    except OSError as err:
        raise _unusable(path, err.strerror) from None
    try:
        real = Path(os.path.realpath(path, strict=True))
    except OSError as err:  # a dangling symlink, a loop
        raise _unusable(path, err.strerror or "it cannot be resolved") from None
    _check_private(real, path)
    return real


def _create(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:  # created meanwhile: checked like any existing directory
        return
    except OSError as err:
        raise _unusable(path, err.strerror) from None
    with contextlib.suppress(OSError):  # ours, just made: undo the umask's effect on group bits
        os.chmod(path, 0o700, follow_symlinks=False)


def _unusable(path: Path, why: str | None) -> CacheError:
    return CacheError(message=f"cannot use the kernel cache directory {path}: {why}; {_SETTING}")


def _check_private(real: Path, given: Path) -> None:
    try:
        st = os.stat(real)
    except OSError as err:
        raise _unusable(given, err.strerror) from None
    if not stat.S_ISDIR(st.st_mode):
        raise _unusable(given, "it is not a directory")
    if not hasattr(os, "getuid"):
        return
    me = os.getuid()
    shown = f"{given}" if real == given else f"{given} (= {real})"
    if st.st_uid != me:
        raise CacheError(message=(
            f"the kernel cache directory {shown} belongs to another user (uid {st.st_uid}); tiledsl "
            f"runs code from it, so it must be your own; {_SETTING}"))
    if st.st_mode & 0o022:
        raise CacheError(message=(
            f"the kernel cache directory {shown} is writable by other users "
            f"(mode {stat.S_IMODE(st.st_mode):o}); tiledsl runs code from it, so it refuses; "
            f"run 'chmod go-w {real}' or {_SETTING}"))
    for parent in real.parents:
        try:
            pst = os.stat(parent)
        except OSError as err:
            raise _unusable(given, err.strerror) from None
        foreign = pst.st_uid not in (me, 0)
        open_to_others = pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX
        if foreign or open_to_others:
            raise CacheError(message=(
                f"the kernel cache directory {shown} is inside {parent}, which "
                + (f"belongs to another user (uid {pst.st_uid})" if foreign else
                   f"other users can write (mode {stat.S_IMODE(pst.st_mode):o}, not sticky)")
                + f", so they could replace the cache; {_SETTING}"))


def versions() -> str:
    import triton

    from tiledsl import __version__

    return f"tiledsl={__version__};triton={triton.__version__}"


def cache_key(source: str, target: str, ir: str = "") -> str:
    h = hashlib.sha256()
    for part in (versions(), target, ir, source):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".py")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            os.replace(tmp, path)
        except OSError:  # a directory in the file's place: ours to remove, in our own cache
            if not path.is_dir() or path.is_symlink():
                raise
            shutil.rmtree(path)
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read(path: Path) -> bytes | None:
    """The file's bytes, or None if it is missing or not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    except OSError:
        return None
    finally:
        os.close(fd)


def _module(name: str, path: Path, source: str) -> types.ModuleType:
    """A module executed from `source` itself; `path` only names it."""
    filename = str(path)
    code = compile(source, filename, "exec", dont_inherit=True)
    module = types.ModuleType(name)
    module.__file__ = filename
    # inspect.getsource (used by @triton.jit and the interpreter) reads linecache first;
    # an entry without an mtime is never re-read from disk
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    sys.modules[name] = module
    exec(code, module.__dict__)
    return module


def load(source: str, fn_name: str, target: str, ir: str = "") -> Any:
    """The kernel function `fn_name` of a generated module, ready for `fn[grid](...)`.

    target "cuda": the `@triton.jit` function; target "interpreter": the same
    function wrapped in Triton's interpreter. `ir` is the kernel's IR text.
    """
    key = (cache_key(source, target, ir), fn_name)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        path = cache_dir() / f"tdsl_{key[0][:40]}.py"
        data = source.encode("utf-8")
        if _read(path) != data:
            try:
                _write_atomic(path, data)
            except OSError as err:
                raise CacheError(message=(
                    f"cannot write to the kernel cache directory {path.parent}: {err.strerror}; "
                    f"{_SETTING}")) from None
        module = _module(f"tiledsl_kernels.{path.stem}", path, source)
        fn = getattr(module, fn_name)
        if target == "interpreter":
            from .interpret import interpreted

            fn = interpreted(fn)
        _loaded[key] = fn
        return fn
