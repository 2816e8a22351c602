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


def test_attention_smoke_run(capsys):
    assert load("attention").main(["--device", "cpu", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("|")[0].split() == ["B", "H", "N", "D", "causal", "dtype"]
    rows = [line.split() for line in lines[2:-1]]
    assert [(r[4], r[5]) for r in rows] == [("False", "f16"), ("True", "f16"), ("False", "bf16"), ("True", "bf16")]
    assert lines[-1].startswith("causal / non-causal time: f16 N=77 D=64: ")


def test_softmax_smoke_run(capsys):
    assert load("softmax").main(["--device", "cpu", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("|")[0].split() == ["M", "N", "dtype", "one", "block"]
    assert [line.split()[2] for line in lines[2:]] == ["f16", "f32"]


def test_host_overhead_smoke_run(capsys):
    import json

    load("host_overhead").main(["--json", "--calls", "3"])
    result = json.loads(capsys.readouterr().out)
    assert sorted(result) == ["attention", "gemm_multiply_multiply", "rmsnorm", "softmax"]
    for row in result.values():
        assert row["kernels"] == 1 and row["tiledsl_us"] > 0 and row["triton_dispatch_us"] > 0
