"""scripts/bootstrap.sh: which Python the README's commands install into and run.

Without PYTHON they use the project's virtual environment .venv, created when missing (a
Debian or Ubuntu system Python refuses pip installs: PEP 668); PYTHON=... selects an
interpreter. Each test runs the real script in a copy of the repository's scripts. A fresh
environment installs torch (minutes), so that case is a dry run, which decides the same
way and says what it would do; the other cases run for real with nothing to install.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.fixture
def repo(tmp_path) -> Path:
    """A checkout with the scripts and pyproject.toml, and no .venv."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def bootstrap(repo: Path, script: str = "bootstrap.sh", *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "TILEDSL_BOOTSTRAP_DRY_RUN")}
    return subprocess.run([str(repo / "scripts" / script), *args], capture_output=True, text=True,
                          timeout=300, env={**environ, **env}, stdin=subprocess.DEVNULL)


def venv_with_everything(repo: Path) -> Path:
    """A real .venv in `repo` that sees this interpreter's packages (torch, tiledsl, pytest,
    pip) through a .pth file, and a stamp newer than pyproject.toml: nothing to install."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(repo / ".venv")], check=True)
    site = subprocess.run([str(repo / ".venv/bin/python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    here = sysconfig.get_path("purelib")
    Path(site, "parent.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    (repo / ".bootstrap-stamp").touch()
    os.utime(repo / "pyproject.toml", (0, 0))
    return repo / ".venv/bin/python"


def test_bootstrap_without_python_creates_the_project_venv(repo):
    result = bootstrap(repo, TILEDSL_BOOTSTRAP_DRY_RUN="1")
    assert result.returncode == 0, result.stderr
    venv_python = f"{repo}/.venv/bin/python"
    assert result.stdout == venv_python + "\n"
    base = shutil.which("python3")
    lines = result.stderr.splitlines()
    assert lines[0] == (f"bootstrap: using {venv_python}: no PYTHON given, so a project virtual environment .venv, "
                        f"created now from {base} (a system Python may refuse pip installs; set PYTHON to use "
                        "another interpreter)")
    assert lines[1] == f"bootstrap: would run: {base} -m venv {repo}/.venv"
    pip = f"bootstrap: would run: {venv_python} -m pip install -q --root-user-action=ignore"
    torch = next(i for i, line in enumerate(lines) if line.startswith(f"{pip} torch"))
    project = lines.index(f"{pip} -e .[dev]")
    assert 1 < torch < project  # torch first: the CPU build where there is no GPU
    if shutil.which("nvidia-smi") is None:
        assert lines[torch] == f"{pip} torch==2.13.0"
    assert not (repo / ".venv").exists() and not (repo / ".bootstrap-stamp").exists()


def test_bootstrap_with_python_set_uses_that_interpreter(repo):
    (repo / ".bootstrap-stamp").touch()
    os.utime(repo / "pyproject.toml", (0, 0))
    result = bootstrap(repo, PYTHON=sys.executable)
    assert (result.returncode, result.stdout) == (0, f"{sys.executable}\n")
    assert result.stderr == f"bootstrap: using {sys.executable}: PYTHON is set\n"
    assert not (repo / ".venv").exists()


def test_test_script_runs_pytest_in_the_project_venv_and_installs_nothing(repo):
    python = venv_with_everything(repo)
    (repo / "tests").mkdir()
    (repo / "tests/test_which.py").write_text("import sys\n\ndef test_which():\n    print('RAN', sys.executable)\n")
    result = bootstrap(repo, "test.sh", "-n", "0", "-s", "tests/test_which.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"RAN {python}\n" in result.stdout
    assert result.stderr == (f"bootstrap: using {python}: no PYTHON given, so the project's virtual environment "
                             ".venv (set PYTHON to use another interpreter)\n")
