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


def test_fusion_rewrites_smoke_run(capsys):
    assert load("fusion_rewrites").main(["--device", "cpu", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("|")[0].split() == ["program", "dtype", "size"]
    assert [line.split()[:2] for line in lines[2:]] == [["swiglu", "f16"], ["swiglu", "bf16"],
                                                        ["rms_proj", "bf16"]]


def test_linear_attention_smoke_run(capsys):
    assert load("linear_attention").main(["--device", "cpu", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("|")[0].split() == ["dtype", "B", "H", "T", "D"]
    assert [line.split()[0] for line in lines[2:]] == ["bf16", "f16"]


def test_compile_time_smoke_run(capsys):
    load("compile_time").main(["--quick", "--repeat", "2"])
    out = capsys.readouterr().out
    assert "examples/attention.tdsl: median" in out and "100 statements" in out


def test_attention_backward_smoke_run(capsys):
    assert load("attention").main(["--device", "cpu", "--quick", "--backward"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # every variant's gradients agreed with eager autograd and were timed
    assert [line.split("|")[0].split()[4:] for line in lines[2:8]] == [
        ["plain", "f16"], ["causal", "f16"], ["softcap", "causal", "f16"],
        ["plain", "bf16"], ["causal", "bf16"], ["softcap", "causal", "bf16"]]


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
    assert sorted(result) == ["attention", "gemm_multiply_multiply", "gqa_attention", "rmsnorm", "softmax"]
    for row in result.values():
        assert row["kernels"] == 1 and row["tiledsl_us"] > 0 and row["triton_dispatch_us"] > 0


def test_run_all_smoke_run(capsys, tmp_path):
    import json

    out_json = tmp_path / "results.json"
    assert load("run_all").main(["--device", "cpu", "--quick", "--json", str(out_json)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tiledsl benchmarks on CPU (Triton's interpreter), torch ")
    assert lines[1] == "| benchmark | case | tiledsl | rate | baseline | baseline / tiledsl | goals |"
    rows = [line.split("|")[1].strip() for line in lines[3:]]
    assert rows.count("attention") == 12 and rows.count("gemm_epilogue") == 6
    assert rows.count("softmax") == 4 and rows.count("host overhead") == 5
    assert rows.count("fusion_rewrites") == 9 and rows.count("attention_backward") == 12
    assert rows.count("linear_attention") == 6 and rows.count("quantized_gemm") == 3
    assert rows.count("nn_modules") == 18 and rows.count("moe_gemm") == 1
    assert "| f16 B=1 H=2 N=77 D=64 causal |" in lines[6] and "SDPA flash n/a | n/a | n/a (no GPU) |" in lines[6]
    backward = [line for line in lines if line.startswith("| attention_backward | f16 B=1 H=2 N=77 D=64 plain |")]
    assert len(backward) == 1 and "backward: SDPA flash / FlexAttention n/a | n/a | n/a (no GPU) |" in backward[0]
    result = json.loads(out_json.read_text())
    assert sorted(result["kernels"]) == ["attention", "attention_backward", "fusion_rewrites", "gemm_epilogue",
                                         "linear_attention", "moe_gemm", "nn_modules", "quantized_gemm",
                                         "softmax"]
    assert all("bwd_ms" in row and "fwd_bwd_ms" in row if bench == "attention_backward" else "ours_ms" in row
               for bench, rows in result["kernels"].items() for row in rows)
    assert sorted(result["host_overhead"]) == ["attention", "gemm_multiply_multiply", "gqa_attention", "rmsnorm",
                                              "softmax"]


def test_nn_modules_smoke_run(capsys):
    """Each module's forward and backward agrees with torch's before it is timed."""
    assert load("nn_modules").main(["--device", "cpu", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("|")[0].split() == ["module", "shape", "dtype"]
    names = [line.split("|")[0].rsplit(None, 2)[0].strip() for line in lines[2:]]
    assert names == ["RMSNorm", "LayerNorm", "SwiGLU", "CrossEntropyLoss", "apply_rotary", "Attention causal"]
    assert all(line.split("|")[0].split()[-1] == "float32" for line in lines[2:]), lines


def test_quantized_gemm_smoke_run(capsys):
    assert load("quantized_gemm").main(["--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "int4    17    64   256 |" in out and "int8    17    64   256 |" in out
    assert " fp8    17    64   256 |" in out


def test_moe_gemm_smoke_run(capsys):
    """The grouped GEMM agrees with the per-expert loop before either is timed."""
    assert load("moe_gemm").main(["--device", "cpu", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split("|")[0].split() == ["37", "4", "48", "64"], lines


def test_split_rows_smoke_run(capsys):
    assert load("split_rows").main(["--device", "cpu", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("|")[0].split() == ["case"]
    assert [line.split("|")[2].split()[0] for line in lines[2:]] == ["unsplit", "torch", "torch", "torch"]


def test_split_k_smoke_run(capsys):
    assert load("split_k").main(["--device", "cpu", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("|")[0].split() == ["case"]
    rows = [line.split("|") for line in lines[2:]]
    assert [r[3].split()[0] for r in rows] == ["unsplit", "torch"]
    assert all(r[1].split() == ["4", "4"] for r in rows), rows  # four splits of the one tile
