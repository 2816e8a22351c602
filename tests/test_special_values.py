"""Special values match torch exactly: the contract for every reduction and softmax.

NaN and infinities go where torch puts them (max/min propagate NaN; a softmax
row holding NaN or +inf is all NaN; logsumexp of a row holding +inf is +inf),
with one documented difference (design section 5): a softmax row that is all
-inf is 0, not torch's NaN. Short rows are read once; long rows loop over
blocks, a separate code path, so both are drawn.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiledsl
from helpers import randn

SPECIALS = (math.nan, math.inf, -math.inf)
REDUCTIONS = ("sum", "mean", "max", "min", "logsumexp", "softmax")
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def torch_contract(kind: str, x: torch.Tensor, axis: int) -> torch.Tensor:
    """What tiledsl must return, computed by torch in float64."""
    x = x.double()
    if kind == "softmax":
        out = torch.softmax(x, axis)
        return out.masked_fill((x == -math.inf).all(axis, keepdim=True), 0.0)
    return {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin,
            "logsumexp": torch.logsumexp}[kind](x, axis)


def assert_same_special_values(out: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    out, expected = out.double(), expected.double()
    for name, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        assert torch.equal(test(out), test(expected)), f"{what}: {name} at different places\n{out}\n{expected}"
    finite = torch.isfinite(expected)
    assert torch.allclose(out[finite], expected[finite], rtol=2e-2, atol=2e-2), what


@st.composite
def rows_with_specials(draw):
    rows = draw(st.sampled_from([1, 3, 17]))
    length = draw(st.sampled_from([1, 2, 17, 113, 5003]))  # 5003: longer than a block, loops
    seed = draw(st.integers(0, 2**16))
    x = torch.randn(rows, length, generator=torch.Generator().manual_seed(seed))
    for _ in range(draw(st.integers(1, 6))):
        r, c = draw(st.integers(0, rows - 1)), draw(st.integers(0, length - 1))
        x[r, c] = draw(st.sampled_from(SPECIALS))
    if draw(st.booleans()):  # a whole row of -inf
        x[draw(st.integers(0, rows - 1))] = -math.inf
    return x


@pytest.fixture(scope="module")
def programs():
    cache = {}

    def get(kind: str, dt: str, axis: int):
        key = (kind, dt, axis)
        if key not in cache:
            out = "f32[M, N]" if kind == "softmax" else ("f32[N]" if axis == 0 else "f32[M]")
            cache[key] = tiledsl.compile(
                f"kernel k(x: {dt}[M, N]) -> {out} {{ return {kind}(x, axis={axis}) }}")
        return cache[key]

    return get


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(x=rows_with_specials(), kind=st.sampled_from(REDUCTIONS), dt=st.sampled_from(sorted(DTYPES)),
       axis=st.sampled_from([-1, 0]))
def test_special_values_follow_torch(programs, x, kind, dt, axis):
    if axis == 0:
        x = x.T.contiguous()
    x = x.to(DTYPES[dt])
    fn = programs(kind, dt, 0 if axis == 0 else 1)
    assert_same_special_values(fn(x), torch_contract(kind, x, axis), f"{kind}(axis={axis}) {dt} {tuple(x.shape)}")
    assert_same_special_values(fn.reference(x), torch_contract(kind, x, axis), "reference backend")


@pytest.mark.parametrize("length", [4, 5003])
@pytest.mark.parametrize("kind", REDUCTIONS)
def test_each_special_value_alone(programs, kind, length):
    x = randn(6, length)
    x[0, 1] = math.nan
    x[1, 2] = math.inf
    x[2, 0] = -math.inf
    x[3] = -math.inf
    x[4, 1], x[4, 3] = math.inf, -math.inf
    fn = programs(kind, "f32", 1)
    assert_same_special_values(fn(x), torch_contract(kind, x, -1), kind)


ATTENTION = """
kernel attn(q: f32[M, D], k: f32[N, D], v: f32[N, D], bias: f32[M, N]) -> (f32[M, D], f32[M]) {
    s = where(causal(q @ k.T), q @ k.T + bias, -inf)
    return softmax(s) @ v, logsumexp(s)
}"""


@pytest.mark.parametrize("n", [17, 300])
def test_attention_rows_with_special_scores(n):
    fn = tiledsl.compile(ATTENTION)
    assert [k.template for k in fn.kernels] == ["attention"]
    m, d = 40, 16
    q, k, v, bias = randn(m, d), randn(n, d), randn(n, d), randn(m, n)
    bias[3, 2] = math.nan          # NaN score: row NaN, lse NaN
    bias[5, 1] = math.inf          # +inf score: row NaN, lse +inf
    bias[7, 12] = math.inf         # masked by causal: no effect
    bias[9, 0], bias[9, 5] = math.inf, math.nan
    bias[11, :] = -math.inf        # all masked: row 0, lse -inf
    out, lse = fn(q, k, v, bias)
    s = (q.double() @ k.double().T + bias.double()).masked_fill(
        ~torch.ones(m, n, dtype=torch.bool).tril(), -math.inf)
    p = torch.softmax(s, -1).masked_fill((s == -math.inf).all(-1, keepdim=True), 0.0)
    assert_same_special_values(out, p @ v.double(), "attention output")
    assert_same_special_values(lse, torch.logsumexp(s, -1), "attention logsumexp")
    assert out[11].eq(0).all() and not out[[0, 1, 2, 4, 6, 7, 8, 10]].isnan().any()


def test_negative_and_conjugate_bits_are_resolved():
    fn = tiledsl.compile("kernel k(x: f32[M, N], y: f32[N]) -> f32[M, N] { return x * 2.0 + y }")
    z = torch.complex(randn(3, 5), randn(3, 5))
    x = z.conj().imag  # a view with the negative bit set
    assert x.is_neg()
    y = torch.complex(randn(5), randn(5)).conj().imag
    assert torch.equal(fn(x, y), x.resolve_neg() * 2.0 + y.resolve_neg())


def test_inputs_that_require_grad_get_gradients_and_scalars_say_they_have_none():
    fn = tiledsl.compile("kernel k(x: f32[N], s: f32) -> f32[N] { return x * s }")
    x = randn(5).requires_grad_()
    fn(x, 2.0).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    with pytest.raises(tiledsl.TileDSLError) as err:
        fn(randn(5), torch.tensor(2.0, requires_grad=True))
    assert err.value.message == (
        "argument 's' requires grad, but 's' is a scalar parameter, which has no gradient: declare "
        "it a tensor (like f32[1]) to differentiate it, or pass s.detach()")
    assert torch.equal(fn(x.detach(), torch.tensor(2.0)), x.detach() * 2.0)
    with torch.no_grad():
        assert torch.equal(fn(x, 2.0), x.detach() * 2.0)
    assert torch.equal(fn(x.detach(), 2.0), x.detach() * 2.0)


@pytest.mark.parametrize("s", [3.0, -0.1, 0.0, -0.0, math.inf, -math.inf, math.nan, 1e30])
def test_division_by_a_scalar_is_torchs_reciprocal_product(s):
    """`x / s` with `s` one value for the whole program is `x * (1 / s)` with the reciprocal
    correctly rounded in f32, as eager torch divides by a scalar on a GPU: bit for bit that,
    within one ulp of IEEE division, and torch's special values (x / 0 is +-inf, 0 / 0 NaN,
    x / inf is +-0) where either side is special."""
    fn = tiledsl.compile("kernel f(x: f32[N], s: f32) -> f32[N] { return x / s }")
    x = randn(113, seed=3) * 100
    x[:5] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])
    out = fn(x, s=s)
    product = x * (torch.tensor(1.0) / torch.tensor(s, dtype=torch.float32))
    assert torch.equal(out.isnan(), product.isnan()) and torch.equal(out.isnan(), (x / s).isnan())
    kept = ~out.isnan()
    assert torch.equal(out[kept], product[kept]), (out, product)
    assert torch.equal(torch.signbit(out[kept]), torch.signbit((x / s)[kept]))
    ieee = (x.double() / s).float()
    finite = ieee.isfinite()
    ulp = torch.finfo(torch.float32).eps * ieee[finite].abs().double()
    assert ((out[finite].double() - ieee[finite].double()).abs() <= ulp).all()
    assert torch.equal(out[~finite & kept], ieee[~finite & kept])
