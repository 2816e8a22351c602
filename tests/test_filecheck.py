"""FileCheck golden tests: tests/filecheck/<pass>.tdsl, one file per pass.

Each file's `# RUN:` line is a `tiledsl` command (with %s for the file); its
output is checked against the file's `# CHECK` lines by the `filecheck` tool.
"""

import contextlib
import io
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tiledsl.cli import main

FILES = sorted((Path(__file__).parent / "filecheck").glob("*.tdsl"))


def run_line(path: Path) -> list[str]:
    for line in path.read_text().splitlines():
        if line.startswith("# RUN:"):
            return shlex.split(line[len("# RUN:"):].replace("%s", str(path)))
    raise AssertionError(f"{path.name} has no RUN line")


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_filecheck(path, tmp_path):
    argv = run_line(path)
    assert argv[0] == "tiledsl"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv[1:]) == 0
    output = tmp_path / "out.txt"
    output.write_text(out.getvalue())
    check = subprocess.run([sys.executable, "-m", "filecheck", str(path), "--input-file", str(output)],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr + "\n--- output ---\n" + out.getvalue()


def test_every_registered_pass_has_a_filecheck_file():
    from tiledsl.passes.registry import REGISTRY, _load_builtin_passes

    _load_builtin_passes()
    assert {p.stem for p in FILES} >= set(REGISTRY)
