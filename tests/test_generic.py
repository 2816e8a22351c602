"""Generic kernels (issue 30): dtype variables and `...` batch dims, bound per call.

A generic kernel is specialized per binding on first call and cached; each specialization
is an ordinary program (fusion, explain, autograd, its torch op), checked here by the
oracle against float64 at awkward sizes and ranks 1-4.
"""

import pickle

import pytest
import torch

import tiledsl
from helpers import gen, randn, run_checked
from tiledsl import diagnostics as diag
from tiledsl import testing
from tiledsl.generic import Binding

RMSNORM = """kernel rmsnorm[T: f16 | bf16 | f32](x: T[..., D], w: T[D], eps: f32) -> T[..., D] {
    xf = cast(x, f32)
    return cast(xf * rsqrt(mean(xf * xf, axis=-1, keepdims=true) + eps), T) * w
}"""

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


@pytest.fixture(scope="module")
def rmsnorm():
    return tiledsl.compile(RMSNORM)


@pytest.mark.parametrize("dt", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(17,), (113, 17), (2, 3, 17), (2, 1, 3, 64)])
def test_one_program_takes_every_dtype_and_rank_it_declares(rmsnorm, dt, shape):
    x = randn(*shape, dtype=DTYPES[dt], seed=1)
    w = randn(shape[-1], dtype=DTYPES[dt], seed=2)
    fn = rmsnorm.for_args(x, w, eps=1e-6)
    _, out = run_checked(fn, x, w, eps=1e-6, sm90=len(shape) == 3)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert [op.template for op in fn.kernel_ops()] == ["rows"]
    batch = len(shape) - 1
    assert rmsnorm.for_args(x, w, eps=1e-6) is fn  # cached, as sizes are
    assert fn is rmsnorm.specialize(T=dt, batch=batch)
    assert Binding((("T", dt),), batch, (batch,)) in rmsnorm.bindings
    names = ", ".join([f"batch{i}" for i in range(batch)] + ["D"])
    assert f"x: {dt}[{names}]" in fn.ir("graph")


def test_a_specialization_is_a_whole_program(rmsnorm):
    """explain, the IR, autograd and the op are the specialization's own."""
    x = randn(2, 5, 33, dtype=torch.bfloat16, seed=3).requires_grad_()
    w = randn(33, dtype=torch.bfloat16, seed=4).requires_grad_()
    out = rmsnorm(x, w, eps=1e-5)
    fn = rmsnorm.for_args(x, w, 1e-5)
    assert "rows" in fn.explain() and fn.op is not rmsnorm.specialize(T="f32", batch=2).op
    report = testing.check_grads(fn, x.detach(), w.detach(), 1e-5, generator=gen(5))
    assert report.ok, report  # the float64 oracle, through the specialization's derived backward
    grad = randn(2, 5, 33, dtype=torch.bfloat16, seed=5)
    through_generic = torch.autograd.grad(out, (x, w), grad)
    through_specialization = torch.autograd.grad(fn(x, w, 1e-5), (x, w), grad)
    assert all(torch.equal(a, b) for a, b in zip(through_generic, through_specialization, strict=True))


def test_parameters_broadcast_against_the_batch():
    """`...` is one batch shape for the signature; a parameter with fewer leading dims is
    right-aligned against it, as NumPy broadcasts."""
    fn = tiledsl.compile("kernel add[T: f32 | f16](x: T[..., N], y: T[..., N]) -> T[..., N] { return x + y }")
    x, y = randn(2, 3, 17, seed=6), randn(3, 17, seed=7)
    _, out = run_checked(fn.for_args(x, y), x, y, sm90=False)
    torch.testing.assert_close(out, x + y, rtol=0, atol=0)
    assert fn.for_args(x, y) is not fn.for_args(y, x)
    assert torch.equal(fn(y, x), y + x)


@pytest.mark.parametrize("x_shape, g_shape", [((3, 1, 17), (3, 5, 17)), ((1, 113), (2, 7, 113)),
                                              ((2, 1, 3, 17), (1, 5, 1, 17))])
def test_leading_dims_of_size_one_broadcast(x_shape, g_shape):
    """Under `...`, a size-1 leading dim broadcasts against another argument's, as NumPy's
    do; its gradient is summed back over the broadcast dims."""
    fn = tiledsl.compile("kernel gate[T: f32 | bf16](x: T[..., N], g: T[..., N], s: f32) -> T[..., N] "
                         "{ return x * sigmoid(g) * s }")
    x = randn(*x_shape, dtype=torch.bfloat16, seed=30).requires_grad_()
    g = randn(*g_shape, dtype=torch.bfloat16, seed=31).requires_grad_()
    out = fn(x, g, 0.75)
    shape = torch.broadcast_shapes(x_shape, g_shape)
    assert out.shape == shape and out.dtype == torch.bfloat16
    cot = randn(*shape, dtype=torch.bfloat16, seed=32)

    def reference(dtype):
        a, b = (t.detach().to(dtype).requires_grad_() for t in (x, g))
        y = a * torch.sigmoid(b) * 0.75
        return (y, *torch.autograd.grad(y, (a, b), cot.to(dtype)))

    ours = (out.detach(), *torch.autograd.grad(out, (x, g), cot))
    assert ours[1].shape == x_shape and ours[2].shape == g_shape
    report = testing.compare(ours, reference(torch.float64), reference(torch.bfloat16))
    assert report.ok, report

    traced = torch.compile(fn, fullgraph=True, dynamic=True, backend="eager")
    assert torch.equal(traced(x.detach(), g.detach(), 0.75), out.detach())  # (a scalar traced as a SymFloat)


def test_a_dtype_variable_is_a_dtype_in_the_body():
    fn = tiledsl.compile("kernel f[T: f16 | bf16](x: T[N]) -> f32[N] { return cast(cast(x, f32) * 3.0, T) }")
    x = randn(113, dtype=torch.bfloat16, seed=8)
    _, out = run_checked(fn.for_args(x), x, sm90=False)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, (x.float() * 3.0).bfloat16().float(), rtol=0, atol=0)


def test_a_kernel_with_only_batch_dims_generic():
    fn = tiledsl.compile("kernel f(x: f32[..., N]) -> f32[...] { return sum(x, axis=-1) }")
    for shape in [(5,), (3, 5), (2, 3, 5)]:
        x = randn(*shape, seed=9)
        _, out = run_checked(fn.for_args(x), x, sm90=False)
        assert out.shape == shape[:-1]


def test_generic_programs_pickle_and_compile_under_torch_compile(rmsnorm):
    again = pickle.loads(pickle.dumps(rmsnorm))
    x, w = randn(3, 7, 17, seed=10), randn(17, seed=11)
    assert torch.equal(again(x, w, 1e-6), rmsnorm(x, w, 1e-6))
    fn = rmsnorm.for_args(x, w, 1e-6)
    assert torch.equal(pickle.loads(pickle.dumps(fn))(x, w, 1e-6), fn(x, w, 1e-6))

    @torch.compile(fullgraph=True, dynamic=True, backend="eager")
    def both(a, b, w):
        return rmsnorm(a, w, 1e-6), rmsnorm(b, w, 1e-6)

    a, b = randn(5, 17, seed=12), randn(2, 3, 17, seed=13)
    out_a, out_b = both(a, b, w)
    assert torch.equal(out_a, rmsnorm(a, w, 1e-6)) and torch.equal(out_b, rmsnorm(b, w, 1e-6))


def _error(src: str, *args, **kwargs) -> str:
    with pytest.raises(diag.TileDSLError) as info:
        fn = tiledsl.compile(src)
        fn(*args, **kwargs) if args else None
    return info.value.message


def test_binding_errors_name_the_argument_and_the_variable(rmsnorm):
    x16, w32 = randn(4, 8, dtype=torch.float16, seed=14), randn(8, seed=15)
    with pytest.raises(diag.ArgumentError) as info:
        rmsnorm(x16, w32, 1e-6)
    assert info.value.message == "argument 'w' is f32, but dtype variable 'T' is already f16"
    with pytest.raises(diag.ArgumentError) as info:
        rmsnorm(randn(4, 8, seed=16).double(), randn(8, seed=17).double(), 1e-6)
    assert info.value.message == ("argument 'x' is torch.float64, but its dtype variable 'T' binds "
                                  "f16 | bf16 | f32")
    with pytest.raises(diag.ArgumentError) as info:
        rmsnorm(torch.tensor(1.0), randn(8, seed=18), 1e-6)
    assert info.value.message == "argument 'x' has 0 dims, but its type needs at least 1 after '...'"
    with pytest.raises(diag.OptionError) as info:
        rmsnorm.explain()
    assert info.value.message == (
        "kernel 'rmsnorm' is generic ([T: f16 | bf16 | f32], '...'): explain belongs to a "
        "specialization, fn.specialize(T=..., batch=...) or fn.for_args(<arguments>)")
    with pytest.raises(diag.OptionError) as info:
        rmsnorm.specialize(T="i32", batch=1)
    assert info.value.message == "specialize(): T='i32' is not one of f16 | bf16 | f32"
    with pytest.raises(diag.OptionError) as info:
        rmsnorm.specialize(batch=1)
    assert info.value.message == "specialize(): give every dtype variable: T"


@pytest.mark.parametrize("src, message", [
    ("kernel f[T: f16 | f16](x: T[N]) -> T[N] { return x }", "dtype variable 'T' lists a dtype twice"),
    ("kernel f[T: f16, T: f32](x: T[N]) -> T[N] { return x }", "dtype variable 'T' is declared twice"),
    ("kernel f[f16: f16 | f32](x: f16[N]) -> f16[N] { return x }",
     "'f16' names a dtype: a dtype variable needs a name of its own"),
    ("kernel f[T: f16 | f64](x: T[N]) -> T[N] { return x }", "unknown dtype 'f64'"),
    ("kernel f[T: f16](x: f32[N]) -> T[N] { return x }",
     "dtype variable 'T' is not the dtype of any tensor parameter, so no call could bind it"),
    ("kernel f(x: f32[N, ...]) -> f32[N] { return sum(x, axis=-1) }",
     "'...' stands for leading dims: it must come first"),
    ("kernel f[T: f32](x: T[N]) -> f32[N] { T = x * 2.0; return T }",
     "'T' names both a dtype variable and a value"),
    ("kernel f[T: f32](T: T[N]) -> f32[N] { return T }", "'T' names both a dtype variable and a value"),
    ("kernel f(x: f32[... + 1, N]) -> f32[N] { return x }", "'...' stands for leading dims: it takes no arithmetic"),
    ("kernel f(x: f32[N]) -> f32[..., N] { return x }",
     "the return type has '...' but no parameter does, so no call could bind it"),
])
def test_malformed_generic_signatures_are_refused_at_compile(src, message):
    with pytest.raises(diag.TileDSLError) as info:
        tiledsl.compile(src)
    assert info.value.message.startswith(message), info.value.message


def test_the_cli_specializes_with_bind(tmp_path):
    from test_cli import cli

    path = tmp_path / "rmsnorm.tdsl"
    path.write_text(RMSNORM)
    code, out, err = cli("check", str(path))
    assert code == 0 and out.strip() == (
        f"{path}: kernel 'rmsnorm' ok (3 bindings: T=f16,...=1; T=bf16,...=1; T=f32,...=1)"), err
    code, out, err = cli("explain", str(path), "--bind", "T=bf16,...=2")
    assert code == 0 and "in:  x: bf16[batch0, batch1, D]" in out, err
    code, out, err = cli("opt", str(path), "--bind", "T=f16,...=0", "--no-lower", "--passes", "")
    assert code == 0 and out.startswith("func @rmsnorm(%x: f16[D], %w: f16[D], %eps: f32) -> (f16[D])"), out
    code, _, err = cli("triton", str(path))
    assert code == 1 and err.strip() == ("error: kernel 'rmsnorm' is generic ([T: f16 | bf16 | f32], '...'): "
                                         "give its binding with --bind, e.g. --bind T=f16,...=1")
    code, _, err = cli("triton", str(path), "--bind", "T=f64,...=1")
    assert code == 1 and err.strip() == "error: --bind T=f64,...=1: T='f64' is not one of f16 | bf16 | f32"
    code, _, err = cli("ptx", str(path), "--bind", "T=f16,...=x", "--dims", "D=64")
    assert code == 1 and err.strip() == "error: --bind T=f16,...=x: '...' takes a number of dims, got 'x'"
