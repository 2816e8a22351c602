"""Activations (tiledsl/ops/activations.py) against torch.nn.functional in float64: values
across every region of each (past softplus's threshold, around the hard ones' +-3, far
negative for logsigmoid and the elus), gradients at exactly the kinks (torch's convention
there), fusion into a GEMM epilogue, sm_90 compilation, and their keyword diagnostics."""

import math

import pytest
import torch
import torch.nn.functional as F

import tiledsl
from helpers import randn, run_checked
from tiledsl import diagnostics as diag
from tiledsl import testing
from tiledsl.backends.triton import aot

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}

# (DSL call, torch's): defaults, and keywords away from them
CASES = [
    ("softplus(x)", F.softplus),
    ("softplus(x, beta=2, threshold=5.0)", lambda x: F.softplus(x, beta=2, threshold=5.0)),
    ("softplus(x, -0.5)", lambda x: F.softplus(x, -0.5)),
    ("logsigmoid(x)", F.logsigmoid),
    ("elu(x)", F.elu),
    ("elu(x, alpha=0.25)", lambda x: F.elu(x, alpha=0.25)),
    ("selu(x)", F.selu),
    ("celu(x)", F.celu),
    ("celu(x, alpha=-1.5)", lambda x: F.celu(x, alpha=-1.5)),
    ("leaky_relu(x)", F.leaky_relu),
    ("leaky_relu(x, slope=0.2)", lambda x: F.leaky_relu(x, 0.2)),
    ("hardtanh(x)", F.hardtanh),
    ("hardtanh(x, min_val=-3, max_val=0.5)", lambda x: F.hardtanh(x, -3.0, 0.5)),
    ("hardsigmoid(x)", F.hardsigmoid),
    ("hardswish(x)", F.hardswish),
    ("mish(x)", F.mish),
    ("softsign(x)", F.softsign),
]
IDS = [c for c, _ in CASES]

# the kinks and region edges of every case above, exactly, and past the ends of exp's range
SPECIAL = [-1000.0, -100.0, -40.0, -20.0, -10.0, -3.0001, -3.0, -2.9999, -1.0, -0.5, 0.0, 0.5, 1.0,
           2.5, 2.9999, 3.0, 3.0001, 5.0, 10.0, 19.99, 20.0, 20.01, 40.0, 100.0, 1000.0]


def values(*shape: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Random values spread over [-30, 30] with the special points in the first elements."""
    x = randn(*shape, seed=seed, scale=10.0).clamp(-30, 30).flatten()
    special = torch.tensor(SPECIAL)[: x.numel()]
    x[: special.numel()] = special
    return x.reshape(shape).to(dtype)


def program(call: str, dt: str) -> tiledsl.Program:
    return tiledsl.compile(f"kernel f(x: {dt}[M, N]) -> {dt}[M, N] {{ return {call} }}")


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (17, 113), (3, 1000)], ids=str)
@pytest.mark.parametrize("call, torch_fn", CASES, ids=IDS)
def test_activation_matches_torch(call, torch_fn, shape, dt):
    x = values(*shape, dtype=DTYPES[dt])
    _, out = run_checked(program(call, dt), x)
    expected = torch_fn(x.double()).to(x.dtype).double()  # rounded as stored: -inf can be right
    tol = {"f32": 2e-6, "f16": 2e-3, "bf16": 1.6e-2}[dt]
    assert torch.allclose(out.double(), expected, rtol=tol, atol=tol), call


@pytest.mark.parametrize("dt", ["f32", "f16"])
@pytest.mark.parametrize("call, torch_fn", CASES, ids=IDS)
def test_activation_gradient_matches_torch_at_the_kinks(call, torch_fn, dt):
    x = values(7, 17, dtype=DTYPES[dt], seed=3)
    report = testing.check_grads(program(call, dt), x)
    assert report.ok, f"{call}: {report}"


def test_gradients_at_the_kinks_follow_torchs_conventions():
    """Where the derivative is undefined, torch's derivatives.yaml picks a side; so does
    tiledsl (checked exactly, with a unit cotangent)."""
    x = torch.tensor([[-3.0, 3.0, 0.0, -1.0, 1.0, 20.0]], dtype=torch.float32)
    for call, torch_fn in CASES:
        fn = program(call, "f32")
        leaf = x.clone().requires_grad_(True)
        fn(leaf).backward(torch.ones_like(x))
        ref = x.double().requires_grad_(True)
        torch_fn(ref).backward(torch.ones_like(ref))
        assert torch.allclose(leaf.grad.double(), ref.grad, rtol=1e-6, atol=1e-7), call


# every activation with a piecewise or thresholded derivative (the CASES, relu, relu6 as
# hardtanh(0, 6), gelu, silu) with its breakpoints: each is checked there and at NaN, +-inf, +-0
EDGE_CASES = [
    *[(call, fn, edges) for (call, fn), edges in zip(CASES, [
        [20.0], [2.5], [-40.0], [], [], [], [], [], [], [], [], [-1.0, 1.0], [-3.0, 0.5],
        [-3.0, 3.0], [-3.0, 3.0], [20.0], []], strict=True)],
    ("relu(x)", torch.relu, []),
    ("hardtanh(x, min_val=0, max_val=6)", F.relu6, [6.0]),
    ("gelu(x)", F.gelu, []),
    ('gelu(x, approximate="tanh")', lambda x: F.gelu(x, approximate="tanh"), []),
    ("silu(x)", F.silu, []),
]


def torch_gradient(torch_fn, x: torch.Tensor) -> torch.Tensor:
    """torch's gradient in float64 along a unit cotangent, one element at a time: its
    elementwise formulas (its CUDA kernels', and its CPU kernels' on a scalar). The CPU
    kernels of elu, hardtanh and hardswish test the other side of the kink in their vector
    loops, so at a NaN they give NaN, 0, NaN there and the scale, g, g on a tensor's
    last elements: which one depends on where the NaN lies."""
    grads = []
    for v in x.double().flatten().tolist():
        t = torch.tensor([v], dtype=torch.float64, requires_grad=True)
        grads += torch.autograd.grad(torch_fn(t), t, torch.ones_like(t))
    return torch.cat(grads).reshape(x.shape)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("call, torch_fn, edges", EDGE_CASES, ids=[c for c, _, _ in EDGE_CASES])
def test_gradient_at_nan_infinities_zero_and_breakpoints_is_torchs(call, torch_fn, edges, dt, backend):
    """elu, selu and celu pass g times the scale at a NaN (they sent it to the exponential:
    NaN), hardsigmoid 0 (it let it through as g / 6), softsign is NaN at +-inf (0, the limit),
    as torch's; NaN at the same places, and the values."""
    x = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, *edges], dtype=DTYPES[dt])[None]
    fn = tiledsl.compile(f"kernel f(x: {dt}[M, N]) -> {dt}[M, N] {{ return {call} }}", backend=backend)
    leaf = x.clone().requires_grad_(True)
    (ours,) = torch.autograd.grad(fn(leaf), leaf, torch.ones_like(leaf))
    expected = torch_gradient(torch_fn, x)
    assert torch.equal(ours.isnan(), expected.isnan()), (call, x, ours, expected)
    tol = {"f32": 2e-6, "bf16": 1.6e-2}[dt]
    torch.testing.assert_close(ours.double(), expected, rtol=tol, atol=tol, equal_nan=True)


def test_large_negative_inputs_do_not_overflow():
    x = torch.tensor([[-1e30, -1e4, -800.0, -90.0, 90.0, 800.0, 1e4, 1e30]], dtype=torch.float32)
    fn = tiledsl.compile("kernel f(x: f32[M, N]) -> (f32[M, N], f32[M, N], f32[M, N], f32[M, N]) {"
                         " return logsigmoid(x), softplus(x), elu(x), mish(x) }")
    outs = fn(x)
    for out, torch_fn in zip(outs, (F.logsigmoid, F.softplus, F.elu, F.mish), strict=True):
        assert torch.equal(out.isfinite(), torch_fn(x.double()).isfinite())
        assert torch.allclose(out.double(), torch_fn(x.double()).float().double(), rtol=1e-6)


def test_integer_input_computes_in_f32():
    x = torch.arange(-5, 6, dtype=torch.int32).reshape(1, 11)
    fn = tiledsl.compile("kernel f(x: i32[M, N]) -> f32[M, N] { return hardswish(x) + mish(x) }")
    expected = F.hardswish(x.double()) + F.mish(x.double())
    assert torch.allclose(fn(x).double(), expected, rtol=1e-6, atol=1e-7)


GEMM = """
kernel f(x: f16[M, K], w: f16[K, N]) -> f16[M, N] {
    y = x @ w
    a = mish(y) + softplus(y, beta=2.0) - logsigmoid(y) + elu(y) * selu(y) + celu(y, 0.5)
    return a + leaky_relu(y, 0.1) + hardtanh(y) + hardsigmoid(y) * hardswish(y) + softsign(y)
}"""


def test_activations_fuse_into_a_gemm_epilogue():
    x, w = randn(17, 113, dtype=torch.float16, seed=1), randn(113, 33, dtype=torch.float16, seed=2)
    fn, _ = run_checked(GEMM, x, w)
    assert [k.template for k in fn.kernels] == ["matmul"]


@pytest.mark.parametrize("call", ["mish(y)", "softplus(y, beta=2.0)", "logsigmoid(y)", "elu(y)",
                                  "selu(y)", "celu(y, 0.5)", "leaky_relu(y, 0.1)", "hardtanh(y)",
                                  "hardsigmoid(y)", "hardswish(y)", "softsign(y)"])
def test_activation_epilogue_compiles_for_sm90_without_spills(call):
    """One activation in the epilogue of the default wgmma tile: 128 x 256 for cheap ops
    (leaky_relu, hardtanh), 128 x 128 for the others (a chain of ten, of these or of gelu,
    tanh, erf..., spills at that tile; mish spills at 128 x 256)."""
    call = call.replace("(y", "(x @ w")
    fn = tiledsl.compile(f"kernel f(x: f16[M, K], w: f16[K, N]) -> f16[M, N] {{ return {call} }}")
    (r,) = aot.inspect_program(fn, {"M": 4096, "N": 4096, "K": 4096})
    cheap = call.split("(")[0] in ("leaky_relu", "hardtanh")
    assert r.config["BLOCK_N"] == (256 if cheap else 128), r
    assert r.spill_bytes == 0 and r.wgmma == [f"m64n{r.config['BLOCK_N']}k16"], r


def test_f32_activations_compute_in_f64_on_sm90_without_spills():
    fn = tiledsl.compile("kernel f(x: f32[M, N]) -> f32[M, N] { return mish(x) + softplus(x) "
                         "+ logsigmoid(x) + selu(x) + celu(x, 2.0) }")
    (r,) = aot.inspect_program(fn, {"M": 4096, "N": 4096})
    assert r.spill_bytes == 0, r


K = "kernel f(x: f32[N], y: f32[N]) -> f32[N] {\n    return %s\n}"


@pytest.mark.parametrize("call, message", [
    ("softplus(x, beta=y)", "<string>:2:29: error: 'beta' of 'softplus' must be a number constant"),
    ("leaky_relu(x, slope=true)",
     "<string>:2:32: error: 'slope' of 'leaky_relu' must be a number constant"),
    ('elu(x, alpha="1.0")', "<string>:2:25: error: 'alpha' of 'elu' must be a number constant"),
    ("elu(x, alpha=2 * 0.5)", "<string>:2:25: error: 'alpha' of 'elu' must be a number constant"),
    ("hardtanh(x, min_val=2.0, max_val=1.0)",
     "<string>:2:12: error: 'max_val' of 'hardtanh' must be at least its min_val (2.0)"),
    ("celu(x, alpha=0)", "<string>:2:12: error: 'alpha' of 'celu' must be nonzero"),
    ("leaky_relu(x, negative_slope=0.1)",
     "<string>:2:26: error: 'leaky_relu' has no parameter 'negative_slope' (parameters: x, slope)"),
])
def test_bad_keywords_are_diagnosed(call, message):
    with pytest.raises(diag.TileDSLError) as info:
        tiledsl.compile(K % call)
    assert str(info.value).splitlines()[0] == message
