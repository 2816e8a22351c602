"""The on-disk cache of generated kernel modules, and loading them.

`@triton.jit` reads a kernel's source from its file, so generated modules are
written to a per-user cache directory, on CPU and GPU alike. File names are
content-addressed: a SHA-256 over the module source (which is printed from
the IR), the kernel's IR, the tiledsl and Triton versions, and the target.
Writes are atomic (temp file + rename); nothing is pickled.

What the cache trusts, and why (the threat model, also in the README): code
from the cache runs as the user, so another local user must not be able to
put code there.

- The directory (`$TILEDSL_CACHE_DIR`, else `$XDG_CACHE_HOME/tiledsl` when
  that is absolute, else `~/.cache/tiledsl`) is resolved once, through any
  symlinks, and must be a directory owned by the current user that no one
  else can write; so must each directory above it, unless it is root's or
  sticky (like /tmp), where others cannot rename our entries. A directory
  that fails is refused with a `CacheError`, never repaired. These checks
  come first: nothing is created in a refused location, and each directory
  tiledsl creates is made alone with mode 0700 whatever the umask
  (`cache_dir.py`).
- A module is never imported with Python's import machinery, which would
  trust a `__pycache__/*.pyc` whose header matches the file. It is compiled
  from the exact text the compiler generated, held in memory, and its
  source is registered in `linecache` so `@triton.jit` and the interpreter
  read that text, not the file. The file is a copy for people and tools; if
  it differs from the source (tampered, truncated, non-UTF-8, a directory,
  a link, a FIFO or a device in its place) it is rewritten, and its content
  is never executed either way. A file is only opened once it is known to
  be a regular file, so a FIFO or a device never blocks a load.

Loaded kernels are released with the programs that use them: a kernel and
its `linecache` entry live while anything holds the kernel (a program's
launch plans), plus the `KEEP_RECENT` most recently loaded ones. A kernel
that is needed again after its release is compiled again from its generated
text; the `linecache` entry of a kernel still alive is never dropped, so
Triton never falls back to reading the file (an entry is dropped at the first
load after its module was collected).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import linecache
import os
import shutil
import stat
import tempfile
import threading
import types
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tiledsl import logs
from tiledsl.diagnostics import CacheError

from .cache_dir import SETTING, cache_dir

KEEP_RECENT = 512  # kernels kept loaded after no program holds them (recompiling one costs ~ms)
_lock = threading.Lock()
_live: weakref.WeakValueDictionary[tuple[str, str], Any] = weakref.WeakValueDictionary()
_recent: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
_sources: dict[str, int] = {}  # linecache filename -> how many loaded modules read it
# Filenames of modules collected since the last load. A finalizer only appends here: it may run
# in any thread, during any allocation, even one made while `_lock` is held.
_collected: collections.deque[str] = collections.deque()


def _reset_after_fork() -> None:
    """A forked child has only the forking thread: if another thread was inside `load`, its
    lock would stay held and the child's first new kernel would hang. The child starts with a
    fresh lock (what that load had half done is at worst a source line kept too long)."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def loaded() -> dict[tuple[str, str], Any]:
    """The kernels this process has loaded and not released, by (cache key, name): a copy."""
    with _lock:
        return dict(_live)


def forget_loaded() -> None:
    """Forget the loaded kernels, so the next load reads (and checks) the cache file again."""
    with _lock:
        _live.clear()
        _recent.clear()


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


def read_regular(path: Path, limit: int) -> bytes | None:
    """The bytes of `path` if it is a regular file of at most `limit` bytes, else None.

    Never blocks and never reads more than `limit` + 1 bytes: the type and size are
    checked before opening (a FIFO would block the open, a device could be endless), the
    open follows no link, and the open descriptor is checked again (the name may have
    been replaced in between)."""
    try:
        if not _small_regular(os.lstat(path), limit):
            return None
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_NOCTTY", 0))
    except OSError:
        return None
    try:
        if not _small_regular(os.fstat(fd), limit):
            return None
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
        return None if left <= 0 else b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def _small_regular(st: os.stat_result, limit: int) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_size <= limit


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` through a temp file and a rename; on any failure the temp file is removed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
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


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def load(source: str, fn_name: str, target: str, ir: str = "") -> Any:
    """The kernel function `fn_name` of a generated module, ready for `fn[grid](...)`.

    target "cuda": the `@triton.jit` function; target "interpreter": the same
    function wrapped in Triton's interpreter. `ir` is the kernel's IR text.
    """
    key = (cache_key(source, target, ir), fn_name)
    with _lock:
        _release_collected()
        fn = _live.get(key)
        if fn is None:
            fn = _live[key] = _load_new(source, fn_name, target, key[0])
        _recent[key] = fn
        _recent.move_to_end(key)
        while len(_recent) > KEEP_RECENT:
            _recent.popitem(last=False)
        return fn


def _load_new(source: str, fn_name: str, target: str, key: str) -> Any:
    path = cache_dir() / f"tdsl_{key[:40]}.py"
    data = source.encode("utf-8")
    if read_regular(path, len(data)) == data:
        logs.logger("cache").info("reused %s", path)
    else:
        logs.logger("cache").info("wrote %s", path)
        try:
            write_atomic(path, data)
        except OSError as err:
            raise CacheError(message=(
                f"cannot write to the kernel cache directory {path.parent}: {err.strerror}; "
                f"{SETTING}")) from None
    module = _module(f"tiledsl_kernels.{path.stem}", path, source)
    fn = getattr(module, fn_name)
    if target == "interpreter":
        from .interpret import interpreted

        fn = interpreted(fn)
    return fn


def _module(name: str, path: Path, source: str) -> types.ModuleType:
    """A module executed from `source` itself; `path` only names it.

    It is not entered in `sys.modules` (which would keep it forever): its functions keep
    its namespace alive, and their source is served by `linecache`."""
    filename = str(path)
    code = compile(source, filename, "exec", dont_inherit=True)
    module = types.ModuleType(name)
    module.__file__ = filename
    # inspect.getsource (used by @triton.jit and the interpreter) reads linecache first;
    # an entry without an mtime is never re-read from disk
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    _sources[filename] = _sources.get(filename, 0) + 1
    try:
        exec(code, module.__dict__)
    except BaseException:
        _release(filename)
        raise
    functions = [f.fn for f in vars(module).values()
                 if isinstance(getattr(f, "fn", None), types.FunctionType)]
    for raw in functions:
        forget_in_triton(raw)
    # Every function of the module holds its namespace, and the namespace holds them all, so
    # the whole module is garbage exactly when any one of its functions is: watch one of them.
    if functions:
        weakref.finalize(functions[0], _collected.append, filename)
    else:
        _release(filename)
    return module


def forget_in_triton(raw: types.FunctionType) -> None:
    """Take the `@triton.jit` function made from `raw` out of Triton's registry of every
    JITFunction (for deserializing JITFunction constants, which tiledsl never passes): it
    would keep every kernel ever loaded alive."""
    registry, name = _triton_registry(), _registry_name(raw)
    if getattr(registry.get(name), "fn", None) is raw:
        del registry[name]


@contextlib.contextmanager
def triton_registry_kept(raw: types.FunctionType) -> Iterator[None]:
    """Inside, Triton may register a new JITFunction of `raw` (its interpreter makes one to
    find a kernel's line numbers); on leaving, the registry holds for that name what it held
    before: nothing for a tiledsl kernel, the shipped function for Triton's own."""
    registry, name = _triton_registry(), _registry_name(raw)
    before = registry.get(name)
    try:
        yield
    finally:
        if before is None:
            registry.pop(name, None)
        else:
            registry[name] = before


def _registry_name(raw: types.FunctionType) -> str:
    return f"{raw.__module__}:{raw.__qualname__}"


def _triton_registry() -> dict[str, Any]:
    """`triton.runtime.jit._triton_jit_function_registry` where this Triton has one, else {}."""
    try:
        from triton.runtime import jit
    except ImportError:
        return {}
    registry = getattr(jit, "_triton_jit_function_registry", None)
    return registry if isinstance(registry, dict) else {}


def _release_collected() -> None:
    while _collected:
        _release(_collected.popleft())


def _release(filename: str) -> None:
    """One module that reads `filename` is gone: drop the source when it was the last."""
    left = _sources.get(filename, 0) - 1
    if left > 0:
        _sources[filename] = left
    else:
        _sources.pop(filename, None)
        linecache.cache.pop(filename, None)
