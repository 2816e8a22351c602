"""Bad input of every kind is a one-line `TileDSLError` (or, on the command line, that
line on stderr and a non-zero exit): never a raw Python exception."""

import io
import math
from contextlib import redirect_stderr, redirect_stdout

import numpy as np
import pytest
import torch

import tiledsl
from helpers import randn
from tiledsl import diagnostics as diag
from tiledsl.cli import main

SRC = "kernel k(x: f32[M, N], s: f32, b: bool, n: i32) -> f32[M, N] { return where(b, x * s, x + n) }"
BIG = "9" * 5000


def error(src: str) -> diag.TileDSLError:
    with pytest.raises(diag.TileDSLError) as info:
        tiledsl.compile(src)
    return info.value


@pytest.mark.parametrize("src", [
    f"kernel k(x: f32[N]) -> f32[N] {{ return x * {BIG} }}",
    f"kernel k(x: f32[{BIG}]) -> f32[N] {{ return x }}",
    f"kernel k(x: f32[N]) -> f32[] {{ return sum(x, axis={BIG}) }}",
    f"@tile(BLOCK_M={BIG})\nkernel k(x: f32[N]) -> f32[N] {{ return x }}",
])
def test_huge_integer_literals(src):
    err = error(src)
    assert isinstance(err, diag.LimitError)
    assert err.message == "the length of an integer literal (5000 digits) exceeds the limit of 18 digits"
    assert src[err.span.start:err.span.end] == BIG


def test_dim_literals_must_fit_in_i32():
    assert error("kernel k(x: f32[9999999999999]) -> f32[N] { return x }").message == (
        "dim sizes must be at most 2147483647, got 9999999999999")


def test_oversized_input_is_refused_before_parsing():
    err = error("kernel k(x: f32[N]) -> f32[N] {\n" + "    x = x * 1.5 + 2.0\n" * 100_000 + "    return x\n}")
    assert err.message == "program size in characters exceeds the limit of 1000000"


def test_too_many_statements_are_refused_while_parsing():
    err = error("kernel k(x: f32[N]) -> f32[N] {\n" + "    x = x + 1.0\n" * 5_001 + "    return x\n}")
    assert err.message == "the number of statements in a program exceeds the limit of 5000"
    assert err.line == 5_002  # the newline that ends statement 5,001


def test_too_long_a_statement_is_refused_while_parsing():
    err = error("kernel k(x: f32[N]) -> f32[N] {\n    return x" + " + x" * 12_000 + "\n}")
    assert err.message == "the number of tokens in a statement exceeds the limit of 20000"


def test_unreadable_paths(tmp_path):
    (tmp_path / "bin.tdsl").write_bytes(b"kernel k(x: f32[N]) -> f32[N] { return x }\n\xff\xfe")
    assert error(str(tmp_path / "bin.tdsl")).message == (
        f"cannot read {tmp_path / 'bin.tdsl'}: it is not UTF-8 text (byte 0xff at offset 43)")
    assert error("a\0b.tdsl").message == "cannot read a\\x00b.tdsl: not a valid file name"
    assert error("\udcff.tdsl").message.startswith("cannot read \\udcff.tdsl: ")


@pytest.mark.parametrize("kwargs, message", [
    ({"kernel": 3}, "compile(): 'kernel' must be a kernel name (str) or None, got int"),
    ({"backend": None}, "compile(): 'backend' must be a str, got NoneType"),
    ({"pipeline": 5}, "compile(): 'pipeline' must be a comma-separated str of pass names or None, got int"),
    ({"allow_tf32": "yes"}, "compile(): 'allow_tf32' must be a bool, got str"),
    ({"verify": 1}, "compile(): 'verify' must be a bool or None, got int"),
])
def test_compile_option_types(kwargs, message):
    with pytest.raises(diag.OptionError) as err:
        tiledsl.compile(SRC, **kwargs)
    assert err.value.message == message
    with pytest.raises(diag.OptionError, match="'source' must be program text or a path, got bytes"):
        tiledsl.compile(SRC.encode())


@pytest.fixture(scope="module")
def fn():
    return tiledsl.compile(SRC)


@pytest.mark.parametrize("call, message", [
    (lambda f: f.ir(5), "ir(): 'stage' must be a stage name (str), got int"),
    (lambda f: f.ir("graph", locations="yes"), "ir(): 'locations' must be a bool, got str"),
    (lambda f: f.explain(dims=5), "explain(): 'dims' must be a mapping of dim names to sizes, got int"),
    (lambda f: f.explain(dims={"M": 4}), "explain(): dims= needs a size for every dim of 'k'; missing N"),
    (lambda f: f.explain(dims={"M": 4, "N": -1}), "explain(): dim N must be a positive int, got -1"),
    (lambda f: f.explain(dims={"M": 4, "N": 2.5}), "explain(): dim N must be a positive int, got 2.5"),
    (lambda f: f.explain(dims={"M": 4, "N": True}), "explain(): dim N must be a positive int, got True"),
    (lambda f: f.explain(dims={"M": 4, "NN": 3}),
     "explain(): 'NN' is not a dim of 'k'; did you mean 'N'? (dims: M, N)"),
    (lambda f: f.draw(5), "draw(): 'path' must be a path, got int"),
    (lambda f: f.reference(randn(2, 3), 1.0, True, 2, float64="yes"),
     "reference(): 'float64' must be a bool, got str"),
])
def test_method_option_types(fn, call, message):
    with pytest.raises(diag.OptionError) as err:
        call(fn)
    assert err.value.message == message


def test_explain_with_dims_reports_bytes(fn):
    assert "  modeled HBM traffic: 256 B fused; 896 B op by op\n" in fn.explain(dims={"M": 4, "N": 8})


def test_scalar_arguments(fn):
    x = randn(3, 4)
    assert torch.equal(fn(x, 2.0, np.bool_(True), 1), x * 2.0)  # a numpy bool is a bool
    with pytest.raises(diag.ArgumentError) as err:
        fn(x, 10**5000, True, 1)
    assert err.value.message == "argument 's' is an int of 16610 bits, too large for f32"
    with pytest.raises(diag.ArgumentError) as err:
        fn(x.to_sparse(), 2.0, True, 1)
    assert err.value.message == ("argument 'x' is a sparse_coo tensor; tiledsl kernels read dense (strided) "
                                 "tensors: pass x.to_dense()")
    assert torch.equal(fn(x, math.inf, False, 1), x + 1)


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def program(tmp_path):
    path = tmp_path / "s.tdsl"
    path.write_text(SRC + "\n")
    return str(path)


RUN = ("--dims", "M=3,N=4", "--repeat", "0")


@pytest.mark.parametrize("argv, message", [
    (["run", "{p}", "--dims", "M=3,N=4", "--scalar", "s=abc"], "--scalar s=abc: s is f32: give a number (inf and nan too)"),
    (["run", "{p}", "--dims", "M=3,N=4", "--scalar", "b=1"], "--scalar b=1: b is a bool: give true or false"),
    (["run", "{p}", "--dims", "M=3,N=4", "--scalar", "n=1.5"], "--scalar n=1.5: n is an i32: give an integer"),
    (["run", "{p}", "--dims", "M=3,N=4", "--scalar", "zz=1"],
     "--scalar zz: 'k' has no scalar parameter 'zz' (scalars: s, b, n)"),
    (["run", "{p}", "--dims", "M=3,N=4", "--scalar", "s=1", "--scalar", "s=2"], "--scalar gives s twice"),
    (["run", "{p}", "--dims", "M=-3,N=4"], "--dims M=-3: the size must be between 1 and 2147483647"),
    (["run", "{p}", "--dims", f"M={BIG},N=4"], f"--dims M={BIG[:40]}: the size must be an integer"),
    (["run", "{p}", "--dims", "M=99999999999,N=4"], "--dims M=99999999999: the size must be between 1 and 2147483647"),
    (["run", "{p}", "--dims", "M=100000,N=100000"],
     "--dims gives 'x' 10000000000 elements; tiledsl run draws random inputs of at most 2147483648"),
    (["run", "{p}", "--dims", "M=3,M=4,N=2"], "--dims gives M twice"),
    (["run", "{p}", "--dims", "M=3,N=4", "--device", "tpu"], "--device tpu: tiledsl runs on cpu or cuda (cuda:N)"),
    (["opt", "{p}", "--print-ir-after", "fuse-bogus"],
     "--print-ir-after fuse-bogus: no such stage in this pipeline; did you mean 'fuse-rows'? (stages: graph, "
     "canonicalize, sink-reshape, cse, dce, online-softmax, distribute-matmul, hoist-row-scale, sum-precision, recompute, "
     "fuse-attention, widen-score-sums, own-prologues, sink-transposes, fuse-attention-backward, "
     "fuse-epilogue, fuse-rows, fuse-scatter, fuse-elementwise, "
     "fuse-horizontal, lower-kernels)"),
    (["check", "kernel"], "cannot read kernel: No such file or directory"),
    (["check", "missing.tdsl"], "cannot read missing.tdsl: No such file or directory"),
])
def test_cli_errors_are_one_line(program, argv, message):
    code, out, err = cli(*(a.replace("{p}", program) for a in argv))
    assert code == 1 and out == ""
    assert err == f"error: {message}\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cli_cuda_without_a_gpu(program):
    assert cli("run", program, *RUN, "--device", "cuda")[2] == "error: --device cuda: no CUDA device is available here\n"


def test_cli_binary_file(tmp_path):
    path = tmp_path / "bin.tdsl"
    path.write_bytes(b"\x00\x01\xff\xfebinary")
    assert cli("check", str(path)) == (1, "", f"error: cannot read {path}: it is not UTF-8 text (byte 0xff at offset 2)\n")


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e-3", "2"])
def test_cli_float_scalars_take_special_values(program, value):
    code, out, _ = cli("run", program, *RUN, "--scalar", f"s={value}", "--scalar", "b=true", "--scalar", "n=2")
    assert code == 0 and "output 0:" in out and "ok" in out
