"""The command line's output and environment: a standard output that cannot be written
(a full disk, a closed descriptor, a reader gone), a `--dump` directory that cannot be,
and `tiledsl ptx` under TRITON_INTERPRET=1 whatever imported Triton first. Each in a
process of its own, as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import RMSNORM, cli, cli_process

ROOT = Path(__file__).parent.parent


def writing_to(stdout, *argv: str) -> subprocess.CompletedProcess:
    """`python -m tiledsl.cli ARGV` with its standard output on `stdout`."""
    return subprocess.run([sys.executable, "-m", "tiledsl.cli", *argv], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=300)


def test_a_full_disk_on_stdout_is_a_write_error():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with open("/dev/full", "w") as full:
        result = writing_to(full, "triton", RMSNORM)
    assert (result.returncode, result.stderr) == (1, "tiledsl: write error: No space left on device\n")


def test_a_full_disk_under_version_is_a_write_error_too():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with open("/dev/full", "w") as full:
        result = writing_to(full, "--version")
    assert (result.returncode, result.stderr) == (1, "tiledsl: write error: No space left on device\n")


def test_a_closed_stdout_is_a_write_error():
    # `tiledsl check f >&-`: Python starts with sys.stdout None and print() writes nothing
    result = subprocess.run([sys.executable, "-c", "import os, runpy, sys; os.close(1); "
                             "sys.argv = ['tiledsl', 'check', sys.argv[1]]; "
                             "runpy.run_module('tiledsl.cli', run_name='__main__')", RMSNORM],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    assert (result.returncode, result.stderr) == (1, "tiledsl: write error: Bad file descriptor\n")
    closed = subprocess.run(f"{sys.executable} -m tiledsl.cli check {RMSNORM} >&-", shell=True,
                            stderr=subprocess.PIPE, text=True, timeout=300)
    assert (closed.returncode, closed.stderr) == (1, "tiledsl: write error: Bad file descriptor\n")


def test_a_reader_that_went_away_ends_the_command_quietly():
    read, write = os.pipe()
    os.close(read)  # `| head` after head exited: every write is EPIPE
    try:
        result = writing_to(write, "triton", RMSNORM)
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (1, "")


def test_output_written_in_process_still_reaches_a_redirected_stdout():
    code, out, err = cli("check", RMSNORM)
    assert (code, out, err) == (0, f"{RMSNORM}: kernel 'rmsnorm' ok\n", "")


def test_building_the_parser_imports_no_triton():
    code = ("import sys; from tiledsl.cli import _parser; _parser(); "
            "print('triton' in sys.modules, 'triton.language' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout == "False False\n", result.stderr


# --- ptx under TRITON_INTERPRET=1 -------------------------------------------------------------


def check_ptx_json(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr
    (kernel,) = json.loads(result.stdout)["kernels"]
    assert kernel["name"] == "k0" and kernel["registers"] > 0 and kernel["spill_bytes"] == 0


def test_ptx_under_triton_interpret_from_the_command_line():
    check_ptx_json(cli_process("ptx", RMSNORM, "--dims", "M=4096,N=8192", "--json",
                               env={"TRITON_INTERPRET": "1"}))


@pytest.mark.parametrize("first", ["import triton", "import triton.language",
                                   "import tiledsl.backends.triton.launch", "import torch._inductor"])
def test_ptx_under_triton_interpret_whatever_imported_triton_first(first, tmp_path):
    """A caller (or a future import in tiledsl) that loaded Triton with the variable set
    cannot break ptx: it then runs in a fresh process without it."""
    code = (f"{first}\nimport sys\nfrom tiledsl.cli import main\n"
            "sys.exit(main(['ptx', sys.argv[1], '--dims', 'M=4096,N=8192', '--json']))")
    result = subprocess.run([sys.executable, "-c", code, RMSNORM], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path,
                            env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)})
    check_ptx_json(result)


def test_ptx_of_stdin_under_triton_interpret_after_triton_was_imported():
    code = ("import triton, sys\nfrom tiledsl.cli import main\n"
            "sys.exit(main(['ptx', '-', '--dims', 'M=4096,N=8192', '--json']))")
    result = subprocess.run([sys.executable, "-c", code], input=Path(RMSNORM).read_text(),
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    check_ptx_json(result)


# --- ptx --dump DIR: refused before anything is compiled ---------------------------------------


def refused_dump(directory: str, why: str) -> None:
    code, out, err = cli("ptx", RMSNORM, "--dims", "M=4096,N=8192", "--dump", directory)
    assert (code, out, err) == (1, "", f"error: --dump {directory}: cannot write files there ({why})\n")


def test_dump_into_a_file_is_refused_first(tmp_path, monkeypatch):
    from tiledsl.backends.triton import aot

    def never(*args, **kwargs):
        raise AssertionError("compiled before the directory was checked")

    monkeypatch.setattr(aot, "inspect_program_compiled", never)
    file = tmp_path / "file"
    file.write_text("")
    refused_dump(str(file), "Not a directory")
    refused_dump(str(file / "below"), "Not a directory")
    assert file.read_text() == ""


def test_dump_where_nothing_can_be_made_is_refused_first(tmp_path):
    refused_dump("/proc/tiledsl-dump", "No such file or directory")
    if os.geteuid() != 0:  # root writes anywhere; the next test refuses it there too
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        refused_dump(str(locked / "out"), "Permission denied")


def test_dump_where_making_the_directory_is_not_permitted_is_refused_first(tmp_path, monkeypatch):
    """The permission error an unprivileged user meets, made to happen as root too."""
    from tiledsl.backends.triton import aot

    def never(*args, **kwargs):
        raise AssertionError("compiled before the directory was checked")

    locked = tmp_path / "locked"
    real = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self == locked / "out" or locked in self.parents:
            raise PermissionError(13, "Permission denied")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(aot, "inspect_program_compiled", never)
    monkeypatch.setattr(Path, "mkdir", mkdir)
    locked.mkdir()
    for directory in (locked / "out", locked / "out" / "below"):
        code, out, err = cli("ptx", RMSNORM, "--dims", "M=4096,N=8192", "--dump", str(directory))
        assert (code, out, err) == (
            1, "", f"error: --dump {directory}: cannot write files there (Permission denied)\n")
    assert list(locked.iterdir()) == []


def test_dump_makes_its_directory_and_removes_it_when_the_command_fails(tmp_path):
    made = tmp_path / "a" / "b"
    code, _, err = cli("ptx", RMSNORM, "--dims", "M=4096", "--dump", str(made))
    assert code == 1 and err.startswith("error: give a size for every dim with --dims: missing N")
    assert not (tmp_path / "a").exists()
    code, _, err = cli("ptx", RMSNORM, "--dims", "M=4096,N=8192", "--dump", str(made))
    assert code == 0, err
    assert sorted(p.name for p in made.iterdir()) == ["k0.cubin", "k0.json", "k0.ptx", "k0.ttgir"]


def test_dump_that_fails_while_writing_is_one_line(tmp_path, monkeypatch):
    directory = tmp_path / "out"
    real = Path.write_text

    def full(self, data, *args, **kwargs):
        if self.parent == directory:
            raise OSError(28, "No space left on device")
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    code, out, err = cli("ptx", RMSNORM, "--dims", "M=4096,N=8192", "--dump", str(directory))
    assert (code, out) == (1, "")
    assert err.startswith(f"error: --dump {directory}: cannot write k0.") and err.endswith(
        " (No space left on device)\n")
