"""`tiledsl.compile(str)`: when a string is a path and when it is program text
(`tiledsl.files.load_source`)."""

from pathlib import Path

import pytest

import tiledsl
from tiledsl import TileDSLError
from tiledsl.files import is_path

PROGRAM = "kernel f(x: f32[N]) -> f32[N] { return x * 2.0 }\n"


def test_a_path_with_braces_is_read_as_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "{exp}").mkdir(parents=True)
    (tmp_path / "runs" / "{exp}" / "k.tdsl").write_text(PROGRAM)
    assert tiledsl.compile("runs/{exp}/k.tdsl").name == "f"


def test_a_missing_path_with_braces_says_no_such_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TileDSLError) as info:
        tiledsl.compile("runs/{exp}/k.tdsl")
    assert str(info.value) == "error: cannot read runs/{exp}/k.tdsl: No such file or directory"


def test_an_existing_file_with_a_newline_in_its_name_is_a_path(tmp_path):
    path = tmp_path / "two\nlines {x}.tdsl"
    path.write_text(PROGRAM)
    assert tiledsl.compile(str(path)).name == "f"
    other = tmp_path / "no-suffix\n"
    other.write_text(PROGRAM.replace("f(", "g("))
    assert tiledsl.compile(str(other)).name == "g"


def test_errors_in_a_file_read_by_path_name_the_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "{a}").mkdir()
    (tmp_path / "{a}" / "bad.tdsl").write_text("kernel f(x: f32[N]) -> f32[N] { return y }\n")
    with pytest.raises(TileDSLError) as info:
        tiledsl.compile("{a}/bad.tdsl")
    assert str(info.value).splitlines()[0] == "{a}/bad.tdsl:1:40: error: undefined name 'y'"


@pytest.mark.parametrize(("text", "name"), [
    (PROGRAM, "f"),
    (PROGRAM.strip(), "f"),
    (PROGRAM.strip() + "  # written from k.tdsl", "f"),  # one line, ending in .tdsl: a declaration in it
    ("kernel g[T: f32](x: T[N]) -> T[N] { return x } # g.tdsl", "g"),
])
def test_program_text_stays_program_text(text, name):
    assert not is_path(text)
    assert tiledsl.compile(text).name == name


@pytest.mark.parametrize(("text", "path"), [
    ("missing.tdsl", True),
    ("runs/{exp}/kernel.tdsl", True),
    ("a\nb.tdsl", False),  # two lines that name nothing: text (and a parse error)
    ("kernel.tdsl", True),
    ("", False),
])
def test_the_rule(text, path):
    assert is_path(text) is path


def test_a_path_object_is_always_a_path(tmp_path):
    with pytest.raises(TileDSLError) as info:
        tiledsl.compile(Path("kernel f(x: f32[N]) -> f32[N] { return x }"))
    assert str(info.value).startswith("error: cannot read kernel f(x: f32[N]) -> f32[N] { return x }: ")
