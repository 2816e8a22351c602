"""The `tiledsl` command line."""

import io
import json
import os
import shlex
import subprocess
import sys
import sysconfig
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

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
        "fuse-rows", "fuse-scatter",
        "hoist-row-scale", "lower-kernels", "online-softmax", "own-prologues", "recompute", "sink-reshape",
        "sink-transposes", "sum-precision", "widen-score-sums"]


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
                          "%eps: f32, %saved_0: f32[N, 1], %grad_0: f32[N, D]) -> (f32[N, D], f32[D]) {")
    code, out, _ = cli("explain", str(path), "--backward")
    assert code == 0 and "fusion report for @rms_backward" in out and "1 kernel for" in out


# --- bad options and inputs give one line on stderr and exit 1, in a process of their own ---------

OUTER = "kernel outer(a: f32[M, K], b: f32[K, N]) -> f32[M, N] {\n    return a @ b\n}\n"


def cli_process(*argv: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """`python -m tiledsl.cli ARGV` in its own process, as a user runs it: an LLVM abort, a
    closed descriptor or an environment variable read at import are the process's own."""
    return subprocess.run([sys.executable, "-m", "tiledsl.cli", *argv], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})}, **kw)


def one_line_error(result: subprocess.CompletedProcess, message: str) -> None:
    assert (result.returncode, result.stdout, result.stderr) == (1, "", f"error: {message}\n")


@pytest.fixture
def outer(tmp_path) -> str:
    path = tmp_path / "outer.tdsl"
    path.write_text(OUTER)
    return str(path)


def test_run_seed_past_64_bits_is_an_option_error():
    one_line_error(cli_process("run", RMSNORM, "--dims", "M=3,N=4", "--seed", str(2**70)),
                   f"--seed {2**70}: the seed must be between 0 and {2**64 - 1}")


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_run_seed_outside_torch_range_is_an_option_error(seed):
    assert cli("run", RMSNORM, "--dims", "M=3,N=4", "--seed", str(seed)) == (
        1, "", f"error: --seed {seed}: the seed must be between 0 and {2**64 - 1}\n")


def test_ptx_arch_triton_cannot_compile_for_is_refused_before_llvm_aborts():
    import triton

    result = cli_process("ptx", RMSNORM, "--dims", "M=4,N=8", "--arch", "sm_1000")
    assert (result.returncode, result.stdout) == (1, "")
    (line,) = result.stderr.splitlines()
    prefix = f"error: --arch sm_1000: the installed Triton ({triton.__version__}) cannot compile for sm_1000; " \
             "it compiles for sm_80, "
    assert line.startswith(prefix) and "sm_90" in line.split("; ")[1]


def test_ptx_arch_names_the_architectures_triton_compiles_for():
    from tiledsl.cli import _triton_gpu_archs

    archs = _triton_gpu_archs(90)
    assert archs[0] == 80 and 90 in archs and all(a >= 80 for a in archs)
    for arch in ("sm_75", "foo", "sm_9999999"):
        assert cli("ptx", RMSNORM, "--dims", "M=4,N=8", "--arch", arch)[2] == (
            f"error: --arch {arch}: give an NVIDIA architecture sm_80 or newer, e.g. sm_90\n")


def test_check_stdin_empty_is_one_line():
    one_line_error(cli_process("check", "-", stdin=subprocess.DEVNULL),
                   "cannot read <stdin>: standard input is empty")


def test_check_stdin_closed_is_one_line():
    script = f"exec 0<&-; exec {shlex.quote(sys.executable)} -m tiledsl.cli check -"
    result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=300)
    one_line_error(result, "cannot read <stdin>: standard input is closed")


def test_stdin_is_read_as_utf8_bytes():
    code, _, err = cli("check", "-", stdin=b"kernel k(x: f32[N]) -> f32[N] { return x }\n# \xff\n")
    assert (code, err) == (1, "error: cannot read <stdin>: it is not UTF-8 text (byte 0xff at offset 45)\n")
    code, out, _ = cli("check", "-", stdin="# größe\nkernel k(x: f32[N]) -> f32[N] { return x }\n")
    assert (code, out) == (0, "<stdin>: kernel 'k' ok\n")


def test_run_output_of_terabytes_is_refused_before_allocating(outer):
    one_line_error(cli_process("run", outer, "--dims", "M=1048576,N=1048576,K=1"),
                   f"--dims gives the matmul at {outer}:2:12 1099511627776 elements; tiledsl run checks the "
                   "program against torch op by op, with values of at most 2147483648 elements")


def test_run_output_that_cannot_be_allocated_is_one_line(outer):
    """8 GiB of output, within the element limit, in a process allowed 6 GiB of address
    space (tiledsl run on CPU needs about 1 GiB): the allocator refuses."""
    import resource

    limit = 6 * 2**30
    result = cli_process("run", outer, "--dims", "M=1048576,N=2048,K=1", "--repeat", "0",
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    one_line_error(result, "cannot allocate the program's outputs at these sizes "
                           "(tried to allocate 8589934592 bytes)")


def test_ptx_works_with_triton_interpret_set():
    result = cli_process("ptx", RMSNORM, "--dims", "M=4096,N=8192", "--json", env={"TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr
    (kernel,) = json.loads(result.stdout)["kernels"]
    assert kernel["name"] == "k0" and kernel["registers"] > 0 and kernel["spill_bytes"] == 0
