"""Where the kernel cache lives, and the checks made before anything is created there.

The rules are the threat model's (backends/triton/cache.py): the cache
directory must be the user's own and writable by no one else; each directory
above it must be the user's or root's, and writable by others only if sticky.
They are applied to what exists *before* anything is created:

- the deepest existing ancestor of the directory is resolved through symlinks
  and checked with all its parents; a refused location gets nothing created
  in it (running as root with `HOME` in another user's home is refused before
  a root-owned `.cache` appears there);
- each missing directory is then created alone (`mkdir`, mode 0700), opened
  without following links and set to exactly 0700 (a umask only removes bits,
  and 0 removes none), so no directory tiledsl makes is ever open to others;
- a name that appears meanwhile (another process, or another user in a sticky
  directory) is not used blindly: the walk starts again and checks it.

`XDG_CACHE_HOME` is used only when absolute: the XDG base directory
specification says a relative path is invalid and must be ignored.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from tiledsl.diagnostics import CacheError

SETTING = "set TILEDSL_CACHE_DIR to a directory of your own"
_RETRIES = 8  # walks restarted because a directory appeared while we created it


def cache_dir() -> Path:
    """The cache directory, created if missing, after the checks in the module docstring."""
    env = os.environ.get("TILEDSL_CACHE_DIR")
    if env is not None:
        if not env.strip():
            raise CacheError(message=(
                "TILEDSL_CACHE_DIR is set but blank; set it to a directory of your own, or unset it "
                "to use ~/.cache/tiledsl"))
        return private_dir(Path(os.path.abspath(env)))
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # unset, empty or relative: the XDG rule says ignore it
        home = os.path.expanduser("~")
        if not os.path.isabs(home):
            raise CacheError(message=f"cannot find your home directory for the kernel cache; {SETTING}")
        base = os.path.join(home, ".cache")
    return private_dir(Path(os.path.abspath(base)) / "tiledsl")


def private_dir(path: Path) -> Path:
    """`path` (absolute) resolved through symlinks, checked, and created if missing."""
    for _ in range(_RETRIES):
        existing, missing = _split_existing(path)
        real = _resolve(existing, path)
        if not missing:
            check_private(real, path)
            return real
        for directory in (real, *real.parents):
            _check_ancestor(directory, path)
        try:
            for name in missing:
                real = _make_private(real / name, path)
        except FileExistsError:  # made meanwhile by someone else: check it like any other
            continue
        check_private(real, path)
        return real
    raise unusable(path, "its directories keep changing while it is created")


def unusable(path: Path, why: str | None) -> CacheError:
    return CacheError(message=f"cannot use the kernel cache directory {path}: {why}; {SETTING}")


def _split_existing(path: Path) -> tuple[Path, list[str]]:
    """The deepest existing prefix of `path` (a link counts, dangling or not) and the names below it."""
    missing: list[str] = []
    current = path
    while True:
        try:
            os.lstat(current)
            return current, missing
        except FileNotFoundError:
            if current.parent == current:
                raise unusable(path, os.strerror(errno.ENOENT)) from None
            missing.insert(0, current.name)
            current = current.parent
        except OSError as err:  # a file on the way (ENOTDIR), a link loop, no permission
            raise unusable(path, err.strerror) from None


def _resolve(existing: Path, given: Path) -> Path:
    try:
        return Path(os.path.realpath(existing, strict=True))
    except OSError as err:  # a dangling symlink, a loop
        raise unusable(given, err.strerror or "it cannot be resolved") from None


def _make_private(path: Path, given: Path) -> Path:
    """Create one directory in a checked parent, mode exactly 0700 whatever the umask."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        raise
    except OSError as err:
        raise unusable(given, err.strerror) from None
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        raise unusable(given, err.strerror) from None
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o700)
    except OSError as err:
        raise unusable(given, err.strerror) from None
    finally:
        os.close(fd)
    return path


def check_private(real: Path, given: Path) -> None:
    """`real` is a directory of the current user's that no one else can write, in safe parents."""
    try:
        st = os.stat(real)
    except OSError as err:
        raise unusable(given, err.strerror) from None
    if not stat.S_ISDIR(st.st_mode):
        raise unusable(given, "it is not a directory")
    if not hasattr(os, "getuid"):
        return
    shown = f"{given}" if real == given else f"{given} (= {real})"
    if st.st_uid != os.getuid():
        raise CacheError(message=(
            f"the kernel cache directory {shown} belongs to another user (uid {st.st_uid}); tiledsl "
            f"runs code from it, so it must be your own; {SETTING}"))
    if st.st_mode & 0o022:
        raise CacheError(message=(
            f"the kernel cache directory {shown} is writable by other users "
            f"(mode {stat.S_IMODE(st.st_mode):o}); tiledsl runs code from it, so it refuses; "
            f"run 'chmod go-w {real}' or {SETTING}"))
    for parent in real.parents:
        _check_ancestor(parent, given, shown)


def _check_ancestor(directory: Path, given: Path, shown: str | None = None) -> None:
    """A directory above the cache: the user's or root's, and writable by others only if sticky."""
    try:
        st = os.stat(directory)
    except OSError as err:
        raise unusable(given, err.strerror) from None
    if not stat.S_ISDIR(st.st_mode):
        raise unusable(given, os.strerror(errno.ENOTDIR))
    if not hasattr(os, "getuid"):
        return
    foreign = st.st_uid not in (os.getuid(), 0)
    open_to_others = st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
    if foreign or open_to_others:
        raise CacheError(message=(
            f"the kernel cache directory {shown or given} is inside {directory}, which "
            + (f"belongs to another user (uid {st.st_uid})" if foreign else
               f"other users can write (mode {stat.S_IMODE(st.st_mode):o}, not sticky)")
            + f", so they could replace the cache; {SETTING}"))
