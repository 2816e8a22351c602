"""The call path: the fast binder agrees with `bind`, and launch plans are built once per
size class and hold everything the sizes decide."""

import pytest
import torch

import tiledsl
from helpers import randn, run_checked
from tiledsl import binding
from tiledsl.diagnostics import ArgumentError

SRC = """
kernel f(x: f32[M, N], w: f16[N], s: f32, n: i32, flag: bool) -> f32[M, N] {
    y = x * cast(w, f32) * s + cast(n, f32)
    return where(flag, y, x.T.T)
}
"""


def _same(a: binding.BoundCall, b: binding.BoundCall) -> None:
    assert a.dims == b.dims and a.device == b.device and len(a.values) == len(b.values)
    for u, v in zip(a.values, b.values, strict=True):
        assert type(u) is type(v) and (u is v or u == v)


def test_fast_binder_binds_what_bind_binds_without_calling_it(monkeypatch):
    fn = tiledsl.compile(SRC)
    graph = fn.fused_graph()
    x, w = randn(17, 113), randn(113).half()
    calls = [((x, w, 0.5, 3, True), {}), ((x, w), {"s": 2, "n": -7, "flag": False}),
             ((), {"flag": True, "n": 1, "s": 1.5, "w": w, "x": x})]
    expected = [binding.bind(graph, args, kwargs) for args, kwargs in calls]

    def no_slow_path(*_):
        raise AssertionError("the fast binder fell back to bind()")

    monkeypatch.setattr(binding, "bind", no_slow_path)
    for (args, kwargs), want in zip(calls, expected, strict=True):
        _same(fn.runtime.binder(args, kwargs), want)


@pytest.mark.parametrize("args, kwargs, message", [
    ((randn(3, 5), randn(5), 0.5, 3, True), {}, "argument 'w' has dtype torch.float32"),
    ((randn(3, 5), randn(4).half(), 0.5, 3, True), {}, "argument 'w' has size 4 in dim 0 (N)"),
    ((randn(3, 5), randn(5).half(), 0.5, 2**31, True), {}, "argument 'n' = 2147483648 does not fit"),
    ((randn(3, 5), randn(5).half(), 0.5, 3, 1), {}, "argument 'flag' must be a bool, got int"),
    ((randn(3, 5), randn(5).half(), 0.5, 3), {"n": 1}, "got two values for argument 'n'"),
    ((randn(3, 5), randn(5).half(), 10**400, 3, True), {}, "too large for f32"),
])
def test_bad_calls_raise_the_same_errors_as_before(args, kwargs, message):
    fn = tiledsl.compile(SRC)
    with pytest.raises(ArgumentError) as err:
        fn(*args, **kwargs)
    assert message in str(err.value)


def test_unusual_arguments_take_the_slow_path_and_still_run():
    fn = tiledsl.compile(SRC)
    x, w = randn(4, 6), randn(6).half()
    expected = fn(x, w, 0.5, 3, True)
    neg = torch._neg_view(-x)  # reads as x, stored negated with the negative bit set
    assert neg.is_neg()
    assert torch.equal(fn(neg, w, 0.5, 3, True), expected)
    assert torch.equal(fn(x, w, torch.tensor(0.5), 3, True), expected)  # a 0-d tensor scalar


def test_one_plan_per_size_class_and_transposed_views_need_no_tensor(monkeypatch):
    from tiledsl.backends.triton import program

    built, launched = [], []
    real_arguments, real_launcher = program.argument_function, program.launcher

    def counting_arguments(*args, **kwargs):
        built.append(args[0].fn_name)
        return real_arguments(*args, **kwargs)

    def recording_launcher(fn, target):
        launch = real_launcher(fn, target)

        def record(*args, **options):
            launched.append(args)
            return launch(*args, **options)

        return record

    monkeypatch.setattr(program, "argument_function", counting_arguments)
    monkeypatch.setattr(program, "launcher", recording_launcher)
    fn = tiledsl.compile("kernel f(x: f32[M, N]) -> f32[N, M] { return exp(x.T) }")
    run_checked(fn, randn(3, 5), sm90=False)
    run_checked(fn, randn(3, 5), sm90=False)
    run_checked(fn, randn(7, 2), sm90=False)
    assert built == ["k0_pointwise", "k0_pointwise"]  # one plan per size class, not per call
    # the kernel reads x itself through permuted strides: no transposed tensor is made
    x = randn(3, 5)
    launched.clear()
    run_checked(fn, x, sm90=False)
    (args,) = launched
    assert args[0] is x and args[1:3] == (x.stride(1), x.stride(0))


def test_weak_float_outputs_come_back_in_the_declared_dtype():
    fn = tiledsl.compile("kernel f(x: f32[N]) -> (f32[N], f32) { return x * 2, 1.5 * 2 }")
    a, b = fn(randn(5))
    assert a.dtype == torch.float32 and b.dtype == torch.float32 and b.item() == 3.0


def test_cuda_graph_capture_needs_cuda_tensors():
    fn = tiledsl.compile("kernel f(x: f32[N], s: f32) -> f32[N] { return x * s }")
    with pytest.raises(tiledsl.TileDSLError) as err:
        fn.cuda_graph(randn(5), 2.0)
    assert str(err.value).endswith(
        "error: cuda_graph() captures a call on CUDA tensors; these arguments are on cpu")
