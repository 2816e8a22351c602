"""The wheel (issue 30): it carries what tiledsl reads at run time (the grammar, the
library programs of tiledsl.nn) and works installed with no checkout in sight."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import torch, tiledsl, tiledsl.nn as tnn
assert tiledsl.__file__.startswith({site!r}), tiledsl.__file__
x = torch.randn(3, 5, 17)
ours, theirs = tnn.RMSNorm(17, eps=1e-6), torch.nn.RMSNorm(17, eps=1e-6)
torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)
fn = tiledsl.compile("kernel f(x: f32[N]) -> f32[N] {{ return exp(x) }}")
torch.testing.assert_close(fn(x[0, 0]), torch.exp(x[0, 0]))
print("ok", tiledsl.__version__)
"""


def test_the_wheel_works_installed_without_a_checkout(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    import importlib.util

    # the build backend from this environment where it has one (a venv of Python 3.12+ may
    # not: then pip's isolated build environment)
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", *isolation,
                            "-q", "-w", str(wheels)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("tiledsl-*.whl")
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr
    env = {**os.environ, "PYTHONPATH": str(site), "TILEDSL_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", SCRIPT.format(site=str(site))], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["ok", "0.1.0"]
