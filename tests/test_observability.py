"""Observability (issue 30): TILEDSL_LOGS channels on Python's logging, `tiledsl --version`,
and a program's display in a notebook."""

import re
import shutil
import subprocess
import sys

import torch
from test_cli import cli_process

import tiledsl
from tiledsl import logs

PROGRAM = "kernel f(x: f32[M, N]) -> f32[M, N] { return softmax(x * 2.0, axis=-1) }"


def test_tiledsl_logs_names_channels_as_torch_logs_does(tmp_path):
    script = ("import tiledsl, torch\n"
              f"fn = tiledsl.compile({PROGRAM!r})\n"
              "fn(torch.randn(3, 5)); fn(torch.randn(3, 5))\n")
    env = {"TILEDSL_LOGS": "fusion,launch,cache,bogus", "TILEDSL_CACHE_DIR": str(tmp_path),
           "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0] == ("tiledsl: TILEDSL_LOGS names unknown channel(s) bogus "
                        "(channels: fusion, autotune, cache, launch, all)")
    assert "[tiledsl.fusion] fusion report for @f" in lines
    launches = [line for line in lines if line.startswith("[tiledsl.launch]")]
    assert launches == ["[tiledsl.launch] k0_rows (rows) at M=3, N=5 on interpreter: grid=(1,), "
                        "BLOCK_O=4, BLOCK_R=8, ONE_PASS=True, EVEN_O=False, EVEN_R=False"]  # planned once
    assert [line.split()[1] for line in lines if line.startswith("[tiledsl.cache]")] == ["wrote"]


def test_logs_configure_returns_the_channels_turned_on(capsys):
    assert logs.configure("all") == ["fusion", "autotune", "cache", "launch"]
    assert logs.configure("") == []
    for channel in logs.CHANNELS:  # off again for the rest of the session
        logs.logger(channel).setLevel("WARNING")


def test_version():
    done = cli_process("--version")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert re.fullmatch(r"tiledsl 0\.1\.0 \(torch \S+, triton \S+, python \d+\.\d+\.\d+\)\n", out), out
    assert tiledsl.__version__ in out


def test_a_program_shows_its_fusion_in_a_notebook():
    fn = tiledsl.compile(PROGRAM)
    assert repr(fn) == "<tiledsl program 'f': 1 kernel(s)>"

    class Printer:
        def __init__(self):
            self.parts = []

        def text(self, s):
            self.parts.append(s)

    p = Printer()
    fn._repr_pretty_(p, False)
    assert p.parts == [fn.explain()]
    svg = fn._repr_svg_()
    if shutil.which("dot") is None:
        assert svg is None  # the notebook falls back to the text
    else:
        assert "<svg" in svg
    x = torch.randn(2, 17)
    torch.testing.assert_close(fn(x), torch.softmax(x * 2.0, dim=-1))
