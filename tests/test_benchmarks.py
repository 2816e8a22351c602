"""The benchmark scripts run (smoke runs on CPU; their timings are not asserted)."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).parent.parent / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gemm_epilogue_smoke_run(capsys):
    assert load("gemm_epilogue").main(["--device", "cpu", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("|")[0].split() == ["M", "N", "K", "dtype"]
    assert [line.split()[3] for line in lines[2:]] == ["f16", "bf16"]


def test_compile_time_smoke_run(capsys):
    load("compile_time").main(["--quick", "--repeat", "2"])
    out = capsys.readouterr().out
    assert "examples/attention.tdsl: median" in out and "100 statements" in out
