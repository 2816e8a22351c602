"""Faults the cache tests plant: a call that must not block, non-regular files, a full disk."""

import contextlib
import os
import stat
import tempfile
import threading
from pathlib import Path

import pytest


def finishes(call, unblock: Path | None = None, timeout: float = 30.0):
    """`call()`'s result, run in a thread that must end within `timeout` seconds. A thread
    stuck opening the FIFO `unblock` is released (by opening its write end) before failing."""
    result = {}

    def run():
        try:
            result["value"] = call()
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
            result["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        # Release it, however often it opens the FIFO again: a thread left blocked would hold
        # the cache's locks and hang every later test.
        for _ in range(100):
            if unblock is None or not thread.is_alive():
                break
            with contextlib.suppress(OSError):  # ENXIO: no reader waiting at this moment
                os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(0.1)
        pytest.fail(f"still blocked after {timeout} s")
    if "error" in result:
        raise result["error"]
    return result.get("value")


NON_REGULAR = ("fifo", "link-to-dev-zero", "device-node")


def non_regular_kinds() -> list:
    """NON_REGULAR as pytest params, each skipped with its reason where it cannot be made."""
    is_root = hasattr(os, "getuid") and os.getuid() == 0
    found = []
    for kind in NON_REGULAR:
        reason = None
        if kind == "device-node" and not is_root:
            reason = "only root can make a device node"
        elif kind != "fifo" and not os.path.exists("/dev/zero"):
            reason = "no /dev/zero on this system"
        found.append(pytest.param(kind, marks=pytest.mark.skip(reason=reason)) if reason else kind)
    return found


def plant(path: Path, kind: str) -> None:
    """Put a non-regular file named `path` in place of whatever is there."""
    if os.path.lexists(path):
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "link-to-dev-zero":
        path.symlink_to("/dev/zero")
    else:  # a character device node with /dev/zero's numbers
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))


def disk_full(monkeypatch) -> list[str]:
    """Make every temp file opened through `tempfile.mkstemp` a descriptor of /dev/full
    (writes fail with ENOSPC, from the kernel) while its name is made in the directory as
    usual. Returns the names made."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    made = []
    mkstemp = tempfile.mkstemp

    def full_mkstemp(*args, **kwargs):
        fd, name = mkstemp(*args, **kwargs)
        os.close(fd)
        made.append(name)
        return os.open("/dev/full", os.O_WRONLY), name

    monkeypatch.setattr(tempfile, "mkstemp", full_mkstemp)
    return made
