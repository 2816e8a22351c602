"""Reading program files and standard input, bounded.

A program may have at most `MAX_SOURCE_CHARS` characters, which UTF-8 spells in at
most four bytes each. A path can name anything: a sparse file of 30 GB, `/dev/zero`,
a pipe that never ends. So a regular file is refused by its size before it is read,
and everything is read with a bound (at most `MAX_SOURCE_BYTES` + 1 bytes): an input
too large is refused within a second, with the limit named, never read into memory.
A FIFO or a device is read as `cat` would read it (the open waits for a writer), but
only up to that bound.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import BinaryIO

from tiledsl import diagnostics as diag
from tiledsl.parser import MAX_SOURCE_CHARS

MAX_SOURCE_BYTES = 4 * MAX_SOURCE_CHARS  # the most UTF-8 bytes a program within the limit has
_CHUNK = 1 << 20


# A kernel's declaration, `kernel NAME(` or `kernel NAME[T: ...](`: what every program has
# and no file name does (`runs/{exp}/kernel.tdsl` has none)
_DECLARATION = re.compile(r"\bkernel\s+\w+\s*[\[(]")


def load_source(source: str | os.PathLike) -> tuple[str, str]:
    """(text, display name) of program text or a path to a .tdsl file. A path object is a
    path; a string is a path when it names something that exists (a file, or a device such
    as /dev/stdin: braces and newlines are allowed in file names), or when it is one line
    ending in `.tdsl` with no kernel declaration in it (so `runs/{exp}/k.tdsl` is a path,
    and a missing one says so: "cannot read ...: No such file or directory"). Any other
    string is program text."""
    from tiledsl.api import check_option  # api imports this module

    check_option("compile()", "source", source, "program text or a path", str, os.PathLike)
    if isinstance(source, os.PathLike) or is_path(source):
        return read_program(Path(source))
    return source, "<string>"


def is_path(source: str) -> bool:
    """Is a string given to `compile()` a path (`load_source`'s rule)?"""
    one_line = "\n" not in source and "\r" not in source
    if one_line and source.endswith(".tdsl") and not _DECLARATION.search(source):
        return True
    return _exists(source)


def _exists(source: str) -> bool:
    """Does `source` name something (a dangling link too)? Program text is rarely a
    possible file name (at most 4096 bytes, no NUL), so this is mostly not asked."""
    if len(source) > 4096 or "\0" in source:
        return False
    try:
        return os.path.lexists(source)
    except (OSError, ValueError):  # a name that cannot be encoded
        return False


def read_program(path: Path) -> tuple[str, str]:
    """(text, display name) of a program file, or an `OptionError` saying why not."""
    shown = str(path)  # messages escape control characters themselves
    try:
        with open(path, "rb", buffering=0) as f:
            info = os.fstat(f.fileno())  # a directory fails at the open (EISDIR)
            if stat.S_ISREG(info.st_mode) and info.st_size > MAX_SOURCE_BYTES:
                raise _too_large(shown, f"{info.st_size} bytes")
            data = read_bounded(f, shown)
    except OSError as err:
        raise _unreadable(shown, err.strerror or str(err)) from None
    except (ValueError, UnicodeError):  # a NUL byte or an unencodable character in the path
        raise _unreadable(shown, "not a valid file name") from None
    return decode_program(data, shown), shown


def read_stream(stream: BinaryIO | None, shown: str = "<stdin>") -> tuple[str, str]:
    """(text, display name) of a program read from a binary stream (standard input);
    `None` (Python's closed standard input) is refused like an unreadable file."""
    if stream is None:
        raise _unreadable(shown, "standard input is closed")
    try:
        data = read_bounded(stream, shown)
    except OSError as err:  # EBADF: the descriptor was closed after Python started
        raise _unreadable(shown, err.strerror or str(err)) from None
    except ValueError:  # a Python file object that was closed
        raise _unreadable(shown, "standard input is closed") from None
    if not data:
        raise _unreadable(shown, "standard input is empty")
    return decode_program(data, shown), shown


def read_bounded(stream: BinaryIO, shown: str) -> bytes:
    """All of `stream`, refused once more than `MAX_SOURCE_BYTES` arrive."""
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_SOURCE_BYTES:
        chunk = stream.read(min(_CHUNK, MAX_SOURCE_BYTES + 1 - size))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
    raise _too_large(shown, f"more than {MAX_SOURCE_BYTES} bytes")


def decode_program(data: bytes, shown: str) -> str:
    """The text of a program's bytes: UTF-8 within the size limit."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _unreadable(shown, (f"it is not UTF-8 text (byte 0x{data[err.start]:02x} at offset "
                                  f"{err.start})")) from None
    if len(text) > MAX_SOURCE_CHARS:
        raise _too_large(shown, f"{len(text)} characters")
    return text


def _unreadable(shown: str, why: str) -> diag.OptionError:
    return diag.OptionError(message=f"cannot read {shown}: {why}")


def _too_large(shown: str, size: str) -> diag.OptionError:
    return _unreadable(shown, f"its size ({size}) exceeds the limit of {MAX_SOURCE_CHARS} characters")
