"""The on-disk cache of generated kernel modules, and loading them.

`@triton.jit` reads a kernel's source from its file, so generated modules are
written to a per-user cache directory and imported from there, on CPU and GPU
alike. The directory is private (mode 0700, owned by the user): code is
imported from it. File names are content-addressed: a SHA-256 over the module
source (which is printed from the IR), the tiledsl and Triton versions, and
the target. Writes are atomic (temp file + rename); nothing is pickled; a file
whose content does not match its key is rewritten before it is imported.
The key covers the kernel's IR (its printed region) as well as its source.

The directory is `$TILEDSL_CACHE_DIR`, else `$XDG_CACHE_HOME/tiledsl`, else
`~/.cache/tiledsl`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import stat
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from tiledsl.diagnostics import OptionError

_lock = threading.Lock()
_loaded: dict[tuple[str, str], Any] = {}


def cache_dir() -> Path:
    env = os.environ.get("TILEDSL_CACHE_DIR")
    if env:
        path = Path(env)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = Path(base) / "tiledsl"
    _ensure_private(path)
    return path


def _ensure_private(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not hasattr(os, "getuid"):
        return
    st = path.stat()
    if st.st_uid != os.getuid():
        raise OptionError(message=(
            f"the kernel cache directory {path} belongs to another user; tiledsl imports code "
            "from it, so it must be your own (set TILEDSL_CACHE_DIR to another directory)"))
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)


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


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".py")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
        try:
            current = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            current = None
        if current != source:
            _write_atomic(path, source)
        mod_name = f"tiledsl_kernels.{path.stem}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
        fn = getattr(module, fn_name)
        if target == "interpreter":
            from .interpret import interpreted

            fn = interpreted(fn)
        _loaded[key] = fn
        return fn
