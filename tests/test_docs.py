"""Every Python block in README.md and docs/*.md runs (issue 30): the blocks of one file
share a namespace, in order, from the repository root, so no statement in the docs goes
stale silently. A block that shows DSL text is marked `text`, not `python`."""

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


def test_the_docs_have_python_to_run():
    assert (ROOT / "docs").is_dir() and len(FILES) >= 8
    assert sum(len(blocks(p)) for p in FILES) >= 4


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_python_block_runs(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    for i, code in enumerate(blocks(path)):
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, f"{path.name} block {i + 1}", "exec"), namespace)  # noqa: S102


def test_the_readmes_links_lead_to_the_docs():
    text = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\((docs/[^)]+)\)", text):
        assert (ROOT / link).is_file(), link
    assert {f"docs/{p.name}" for p in FILES[1:]} <= set(re.findall(r"\]\((docs/[^)]+)\)", text))
