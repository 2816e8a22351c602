"""Program files are read with a size bound: anything a path or standard input can name
(a device, a sparse file of 30 GB, a pipe that never ends) is refused within a second,
with the limit named, and never read into memory. BOMs and CR line endings are text."""

import contextlib
import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import tiledsl
from helpers import randn
from tiledsl import diagnostics as diag
from tiledsl.cli import main
from tiledsl.files import MAX_SOURCE_BYTES

LIMIT = "exceeds the limit of 1000000 characters"
STREAM_TOO_LARGE = f"its size (more than {MAX_SOURCE_BYTES} bytes) {LIMIT}"
PROGRAM = "kernel affine(x: f32[N]) -> f32[N] {\n    y = x * 2.5\n    return y - 1.0\n}\n"
FAST = 5.0  # seconds: a bounded read takes milliseconds; an unbounded one never ends


def refused(source) -> tuple[str, float]:
    start = time.perf_counter()
    with pytest.raises(diag.OptionError) as info:
        tiledsl.compile(source)
    return info.value.message, time.perf_counter() - start


def cli_in_process(argv: list[str], stdin) -> tuple[int, str, float]:
    err, old = io.StringIO(), sys.stdin
    sys.stdin = stdin
    start = time.perf_counter()
    try:
        with contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        sys.stdin = old
    return code, err.getvalue(), time.perf_counter() - start


def cli_process(*argv: str, **kw) -> subprocess.CompletedProcess:
    """The command line in its own process; a read that never ends fails at the timeout."""
    return subprocess.run([sys.executable, "-m", "tiledsl.cli", *argv], capture_output=True, text=True,
                          timeout=120, **kw)


@pytest.fixture
def sparse_30gb(tmp_path) -> Path:
    path = tmp_path / "huge.tdsl"
    with open(path, "wb") as f:
        f.truncate(30 * 2**30)  # a hole: no disk used
    return path


# --- the three inputs of the issue, through compile() and through the command line ---------------


def test_dev_zero_is_refused_by_size_not_read():
    for source in (Path("/dev/zero"), "/dev/zero"):
        message, seconds = refused(source)
        assert message == f"cannot read /dev/zero: {STREAM_TOO_LARGE}"
        assert seconds < FAST


def test_sparse_30gb_file_is_refused_before_reading(sparse_30gb):
    message, seconds = refused(sparse_30gb)
    assert message == f"cannot read {sparse_30gb}: its size (32212254720 bytes) {LIMIT}"
    assert seconds < FAST


def test_endless_stdin_is_refused_by_size():
    with open("/dev/zero") as zeros:
        code, err, seconds = cli_in_process(["check", "-"], zeros)
    assert (code, err) == (1, f"error: cannot read <stdin>: {STREAM_TOO_LARGE}\n")
    assert seconds < FAST


def test_endless_pipe_on_stdin_is_refused_by_size():
    writer = subprocess.Popen(["yes", "kernel"], stdout=subprocess.PIPE)
    try:
        result = cli_process("check", "-", stdin=writer.stdout)
    finally:
        writer.kill()
        writer.wait()
        writer.stdout.close()
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == f"error: cannot read <stdin>: {STREAM_TOO_LARGE}\n"


@pytest.mark.parametrize("case", ["dev-zero", "sparse"])
def test_cli_refuses_oversized_program_files_in_one_line(case, sparse_30gb):
    path = "/dev/zero" if case == "dev-zero" else str(sparse_30gb)
    code, err, seconds = cli_in_process(["opt", path], sys.stdin)
    size = STREAM_TOO_LARGE if case == "dev-zero" else f"its size (32212254720 bytes) {LIMIT}"
    assert (code, err) == (1, f"error: cannot read {path}: {size}\n")
    assert seconds < FAST


# --- FIFOs and the bound itself --------------------------------------------------------------------


def fifo_writer(path: Path, data: bytes, forever: bool = False) -> threading.Thread:
    """A thread that writes `data` into the FIFO `path` (over and over while `forever`, until
    the reader closes it), then closes it."""
    def write() -> None:
        try:
            with open(path, "wb") as f:
                f.write(data)
                while forever:
                    f.write(data)
        except BrokenPipeError:
            pass

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def test_fifo_program_file_is_read(tmp_path):
    path = tmp_path / "prog.tdsl"
    os.mkfifo(path)
    writer = fifo_writer(path, PROGRAM.encode())
    fn = tiledsl.compile(path)
    writer.join(timeout=10)
    x = randn(17)
    torch.testing.assert_close(fn(x), (x.double() * 2.5 - 1.0).float())


def test_endless_fifo_program_file_is_refused_by_size(tmp_path):
    path = tmp_path / "endless.tdsl"
    os.mkfifo(path)
    writer = fifo_writer(path, b"# a comment that never ends\n" * 1000, forever=True)
    message, seconds = refused(path)
    writer.join(timeout=10)
    assert message == f"cannot read {path}: {STREAM_TOO_LARGE}"
    assert seconds < FAST and not writer.is_alive()


def test_program_of_multibyte_characters_within_the_limit_is_read(tmp_path):
    """The byte bound is 4 bytes a character: a program near the character limit whose
    characters take 4 bytes in UTF-8 is read and compiled, not refused by its bytes."""
    comment = "# " + "\U0001F600" * 990_000 + "\n"
    path = tmp_path / "emoji.tdsl"
    path.write_text(comment + PROGRAM, encoding="utf-8")
    assert 3_900_000 < path.stat().st_size <= MAX_SOURCE_BYTES
    fn = tiledsl.compile(path)
    x = randn(113)
    torch.testing.assert_close(fn(x), (x.double() * 2.5 - 1.0).float())


def test_program_file_over_the_character_limit_is_refused(tmp_path):
    path = tmp_path / "long.tdsl"
    path.write_text(PROGRAM + "#" * 1_000_000)
    assert refused(path)[0] == f"cannot read {path}: its size ({len(PROGRAM) + 1_000_000} characters) {LIMIT}"


def test_a_directory_named_as_a_program_is_refused(tmp_path):
    assert refused(tmp_path)[0] == f"cannot read {tmp_path}: Is a directory"
    assert refused(str(tmp_path))[0] == f"cannot read {tmp_path}: Is a directory"


@pytest.mark.parametrize("bom, newline", [(b"\xef\xbb\xbf", b"\n"), (b"", b"\r"), (b"\xef\xbb\xbf", b"\r\n")],
                         ids=["bom", "cr", "bom-crlf"])
def test_program_file_with_a_bom_or_cr_line_endings_compiles(tmp_path, bom, newline):
    path = tmp_path / "windows.tdsl"
    path.write_bytes(bom + PROGRAM.encode().replace(b"\n", newline))
    fn = tiledsl.compile(path)
    x = randn(113)
    torch.testing.assert_close(fn(x), (x.double() * 2.5 - 1.0).float())
    bad = path.read_bytes().replace(b"y - 1.0", b"exq(y)")
    path.write_bytes(bad)
    with pytest.raises(diag.TileDSLError) as info:
        tiledsl.compile(path)
    assert str(info.value).splitlines() == [
        f"{path}:3:12: error: unknown function 'exq'; did you mean 'exp'?", "        return exq(y)", "               ^~~"]
