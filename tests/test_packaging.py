"""Packaging (issue 30): the wheel carries what tiledsl reads at run time (the grammar, the
library programs of tiledsl.nn) and works installed with no checkout in sight; the sdist
builds, installs and carries the tests, which run from it against that install; the
metadata declares the license and the torch and Triton versions the suite runs on."""

import email.parser
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import tiledsl

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


def _run(*cmd: str, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kwargs)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return done


def _has_backend() -> bool:
    """Does this environment have the build backend pyproject.toml asks for (setuptools 77
    or newer, for the SPDX license)? A venv of Python 3.12+ has no setuptools, one of 3.11
    an older one: then pip builds in its isolated environment."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    return Version(version) >= Version("77")


def _isolation() -> list[str]:
    return ["--no-build-isolation"] if _has_backend() else []


def _install(what: Path, site: Path, cwd: Path) -> None:
    """pip-install `what` (a wheel, or an sdist pip builds a wheel of) into `site`."""
    isolation = _isolation()
    _run(sys.executable, "-m", "pip", "install", "--no-deps", *isolation, "-q", "--target", str(site),
         str(what), cwd=cwd)


def _env(site: Path, tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(site), "TILEDSL_CACHE_DIR": str(tmp_path / "cache")}


def test_the_wheel_works_installed_without_a_checkout(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    _run(sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", *_isolation(), "-q", "-w", str(wheels),
         cwd=tmp_path)
    (wheel,) = wheels.glob("tiledsl-*.whl")
    _install(wheel, site, tmp_path)
    run = _run(sys.executable, "-c", SCRIPT.format(site=str(site)), cwd=tmp_path, env=_env(site, tmp_path))
    assert run.stdout.split() == ["ok", tiledsl.__version__]


BUILD_SDIST = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"

# from the sdist: the docs' blocks, the FileCheck tests and every example program, each of
# which reads files the sdist must carry (README.md, docs/, tests/filecheck/, examples/)
SDIST_TESTS = ["tests/test_docs.py", "tests/test_filecheck.py", "tests/test_program_files.py"]

# what a clean clone does not have (the sdist is built from a copy, as a release from a clone)
NOT_IN_A_CLONE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                        ".pytest_cache", ".ruff_cache", ".whl", ".gl", ".bootstrap-stamp")


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    """The sdist, built by setuptools' own hook (pip cannot make one) from a copy of the
    checkout, so the build writes nothing into it."""
    tmp = tmp_path_factory.mktemp("sdist")
    shutil.copytree(ROOT, tmp / "src", ignore=NOT_IN_A_CLONE)
    env = dict(os.environ)
    if not _has_backend():
        _run(sys.executable, "-m", "pip", "install", "-q", "--target", str(tmp / "backend"), "setuptools>=77")
        env["PYTHONPATH"] = str(tmp / "backend")
    name = _run(sys.executable, "-c", BUILD_SDIST, str(tmp), cwd=tmp / "src", env=env).stdout.split()[-1]
    return tmp / name


def test_the_sdist_installs_and_its_tests_run(sdist, tmp_path):
    with tarfile.open(sdist) as archive:
        members = set(archive.getnames())
        archive.extractall(tmp_path, filter="data")
    top = tmp_path / sdist.name.removesuffix(".tar.gz")
    for path in ["LICENSE", "README.md", "docs/language.md", "tests/conftest.py", "tests/filecheck",
                 "examples/train_block.py", "scripts/test.sh", "tiledsl/library/norms.tdsl",
                 "tiledsl/grammar.lark", "passes/fusion", "backends/triton"]:
        assert f"{top.name}/{path}" in members, path
    assert not any("__pycache__" in m or m.endswith(".pyc") or "/.venv" in m for m in members)
    site = tmp_path / "site"
    _install(top, site, tmp_path)
    # run from outside the unpacked tree, so `tiledsl` is the installed one, not its sources
    run = _run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(top),
               *(str(top / t) for t in SDIST_TESTS), cwd=tmp_path, env=_env(site, tmp_path))
    assert " passed" in run.stdout and "failed" not in run.stdout, run.stdout[-2000:]


def test_the_metadata_declares_the_license_and_the_tested_versions(sdist):
    """The license as an SPDX expression with its text; torch and Triton as ranges bounded
    above (a new Triton changes codegen), which hold the versions this suite runs on, and
    which docs/api.md states."""
    with tarfile.open(sdist) as archive:
        info = archive.extractfile(f"{sdist.name.removesuffix('.tar.gz')}/PKG-INFO").read().decode()
    meta = email.parser.Parser().parsestr(info)
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    requires = {r.name: r.specifier for r in map(Requirement, meta.get_all("Requires-Dist")) if r.marker is None}
    import torch
    import triton

    docs = (ROOT / "docs" / "api.md").read_text()
    for package, version in [("torch", torch.__version__), ("triton", triton.__version__)]:
        spec = requires[package]
        assert spec.contains(Version(version).base_version), (package, version, spec)
        assert {s.operator for s in spec} == {">=", "<"}, spec
        assert f"`{package}{','.join(sorted(map(str, spec), reverse=True))}`" in docs, (package, spec)
    # the CUDA torch the quick start installs on a GPU machine is in the same range
    torch_range = ",".join(sorted(map(str, requires["torch"]), reverse=True))
    assert f'pip_install "torch{torch_range}"' in (ROOT / "scripts" / "bootstrap.sh").read_text()
