"""The `tiledsl` command line."""

import io
import subprocess
import sys
import sysconfig
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from tiledsl.cli import main

EXAMPLES = Path(__file__).parent.parent / "examples"
RMSNORM = str(EXAMPLES / "rmsnorm.tdsl")


def cli(*argv: str, stdin: str | bytes | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    old = sys.stdin
    if stdin is not None:  # the command line reads standard input as bytes
        data = stdin if isinstance(stdin, bytes) else stdin.encode()
        sys.stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = main(list(argv))
    finally:
        sys.stdin = old
    return code, out.getvalue(), err.getvalue()


def test_opt_prints_the_final_ir():
    code, out, _ = cli("opt", RMSNORM)
    assert code == 0 and out.startswith("func @rmsnorm(") and "kernel @k0 rows(%x, %eps, %w)" in out


def test_opt_print_ir_after_all_and_timing():
    code, out, err = cli("opt", RMSNORM, "--passes", "canonicalize,cse", "--print-ir-after-all", "--timing")
    assert code == 0
    stages = [line for line in out.splitlines() if line.startswith("// -----// IR Dump After")]
    assert stages == [f"// -----// IR Dump After {s} //----- //"
                      for s in ("graph", "canonicalize", "cse", "lower-kernels")]  # --passes given
    assert "// pass timing for @rmsnorm:" in err and "//   total" in err


def test_opt_print_ir_after_one_pass_without_lowering():
    code, out, _ = cli("opt", RMSNORM, "--passes", "cse", "--no-lower", "--print-ir-after", "cse")
    assert code == 0 and out.count("IR Dump After") == 1 and "kernel @" not in out


def test_triton_dot_explain():
    code, out, _ = cli("triton", RMSNORM)
    assert code == 0 and out.count("@triton.jit\ndef k0_rows(") == 1
    code, out, _ = cli("triton", RMSNORM, "--passes", "canonicalize,cse,dce")
    assert code == 0 and out.count("@triton.jit\ndef k") == 8
    code, out, _ = cli("dot", RMSNORM)
    assert code == 0 and out.startswith('digraph "rmsnorm"') and out.count("subgraph cluster_") == 1
    code, out, _ = cli("explain", RMSNORM)
    assert code == 0 and "  1 kernel for 8 ops" in out


def test_run_checks_against_the_reference():
    code, out, _ = cli("run", RMSNORM, "--dims", "M=17,N=113", "--scalar", "eps=1e-6", "--repeat", "1")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == "rmsnorm on Triton interpreter: 1 kernel(s), dims M=17, N=113"
    assert lines[1].startswith("  output 0: max abs error ") and lines[1].endswith(" ok")
    assert "first call" in lines[2]


def test_run_reports_missing_and_unknown_dims():
    code, _, err = cli("run", RMSNORM, "--dims", "M=17")
    assert code == 1
    assert err.strip() == "error: give a size for every dim with --dims: missing N (e.g. --dims M=64,N=64)"
    code, _, err = cli("run", RMSNORM, "--dims", "M=1,N=2,K=3")
    assert err.strip() == "error: --dims names K, which 'rmsnorm' does not use (its dims: M, N)"


def test_errors_print_diagnostics_and_exit_1():
    code, out, err = cli("opt", "-", stdin="kernel f(x: f32[N]) -> f32[N] {\n    return exq(x)\n}\n")
    assert code == 1 and out == ""
    assert err.splitlines() == [
        "<stdin>:2:12: error: unknown function 'exq'; did you mean 'exp'?",
        "        return exq(x)",
        "               ^~~",
    ]


def test_opt_on_a_file_with_several_kernels_prints_each():
    src = "kernel a(x: f32[N]) -> f32[N] { return x }\nkernel b(x: f32[N]) -> f32[N] { return -x }\n"
    code, out, _ = cli("opt", "-", "--passes", "cse", "--no-lower", stdin=src)
    assert code == 0 and out.count("func @") == 2
    code, out, _ = cli("opt", "-", "-k", "b", "--passes", "cse", "--no-lower", stdin=src)
    assert out.startswith("func @b(")


def test_check_and_passes():
    code, out, _ = cli("check", str(EXAMPLES / "attention.tdsl"))
    assert code == 0 and out.strip().endswith("kernel 'attention' ok")
    code, out, _ = cli("passes")
    assert [line.split()[0] for line in out.splitlines()] == [
        "canonicalize", "cse", "dce", "distribute-matmul", "fuse-attention", "fuse-attention-backward", "fuse-elementwise", "fuse-epilogue", "fuse-horizontal",
        "fuse-rows",
        "hoist-row-scale", "lower-kernels", "online-softmax", "recompute", "sink-reshape"]


def test_console_script_is_installed():
    # where pip puts this interpreter's scripts: a venv need not be activated (nor on PATH)
    places = [Path(sysconfig.get_path("scripts")), Path(sys.executable).parent]
    script = next((p / "tiledsl" for p in places if (p / "tiledsl").is_file()), None)
    assert script is not None, f"no console script in {places}"
    result = subprocess.run([str(script), "passes"], capture_output=True, text=True)
    assert result.returncode == 0 and "lower-kernels" in result.stdout


def test_backward_prints_the_derived_program(tmp_path):
    path = tmp_path / "rms.tdsl"
    path.write_text("kernel rms(x: f32[N, D], w: f32[D], eps: f32) -> f32[N, D] {\n"
                    "    r = rsqrt(mean(x * x, axis=-1, keepdims=true) + eps)\n"
                    "    return x * r * w\n}\n")
    code, out, _ = cli("opt", str(path), "--backward", "--print-ir-after", "graph")
    assert code == 0
    assert out.startswith("// -----// IR Dump After graph //----- //\nfunc @rms_backward(%x: f32[N, D], %w: f32[D], "
                          "%eps: f32, %grad_0: f32[N, D]) -> (f32[N, D], f32[D]) {")
    code, out, _ = cli("explain", str(path), "--backward")
    assert code == 0 and "fusion report for @rms_backward" in out and "2 kernels for" in out
