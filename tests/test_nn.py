"""tiledsl.nn against the torch modules it replaces (issue 30): the same constructor
arguments, parameters and state_dict keys; outputs and gradients by the oracle (float64
golden, the torch module in the input dtype as the yardstick) in f32, bf16 and f16 at
ranks 2-4 with awkward sizes."""

import copy

import pytest
import torch
import torch.nn.functional as F

import tiledsl
from helpers import randn
from tiledsl import diagnostics as diag
from tiledsl import nn as tnn
from tiledsl import testing

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(17, 33), (2, 5, 33), (2, 3, 1, 33)]


def _perturbed(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Parameters away from their initial ones and zeros (never test on constants)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + 1.0)
    return module


def assert_matches(ours: torch.nn.Module, theirs: torch.nn.Module, *inputs: torch.Tensor,
                   grads: bool = True, golden: torch.nn.Module | None = None) -> None:
    """`ours(*inputs)` and its gradients (inputs and parameters) by the oracle against
    `theirs` in float64 (golden: `golden`, by default a copy of `theirs`) and in the
    inputs' dtype (eager)."""
    golden_m = copy.deepcopy(golden or theirs).double()
    floats = [x for x in inputs if x.is_floating_point()]

    def run(module, cast):
        xs = [cast(x).detach().requires_grad_(x.is_floating_point()) if x.is_floating_point() else x
              for x in inputs]
        out = module(*xs)
        if not grads:
            return out, []
        cot = randn(*out.shape, seed=99).to(out.dtype)
        params = list(module.parameters())
        wrt = [x for x in xs if x.is_floating_point()] + params
        return out, torch.autograd.grad(out, wrt, cot.to(out.dtype))

    out, got = run(ours, lambda x: x)
    gold, gold_g = run(golden_m, lambda x: x.double())
    eager, eager_g = run(theirs, lambda x: x)
    assert out.dtype == eager.dtype and out.shape == eager.shape
    report = testing.compare(out, gold, eager)
    assert report.ok, report
    if grads:
        assert len(got) == len(gold_g) == len(floats) + len(list(ours.parameters()))
        for g, gg, ge in zip(got, gold_g, eager_g, strict=True):
            report = testing.compare(g, gg, ge)
            assert report.ok, report


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_is_torchs(dtype, shape):
    theirs = _perturbed(torch.nn.RMSNorm(33, eps=1e-6), 1).to(dtype)
    ours = tnn.RMSNorm(33, eps=1e-6).to(dtype)
    ours.load_state_dict(theirs.state_dict())
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["weight"]
    assert_matches(ours, theirs, randn(*shape, dtype=dtype, seed=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_options(dtype):
    """eps=None is the dtype's machine epsilon (the golden, in float64, is given the input
    dtype's explicitly); no weight without elementwise_affine; a normalized_shape of two
    dims normalizes both."""
    x = randn(3, 4, 5, 7, dtype=dtype, seed=3)
    theirs = _perturbed(torch.nn.RMSNorm((5, 7)), 4).to(dtype)
    ours = tnn.RMSNorm((5, 7)).to(dtype)
    ours.load_state_dict(theirs.state_dict())
    golden = copy.deepcopy(theirs)
    golden.eps = torch.finfo(dtype).eps
    assert_matches(ours, theirs, x, golden=golden)
    plain = tnn.RMSNorm(7, elementwise_affine=False)
    assert list(plain.state_dict()) == [] and plain.weight is None
    assert_matches(plain, torch.nn.RMSNorm(7, elementwise_affine=False), x,
                   golden=torch.nn.RMSNorm(7, eps=torch.finfo(dtype).eps, elementwise_affine=False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine, bias", [(True, True), (True, False), (False, False)])
def test_layer_norm_is_torchs(dtype, shape, affine, bias):
    theirs = _perturbed(torch.nn.LayerNorm(33, elementwise_affine=affine, bias=bias), 5).to(dtype)
    ours = tnn.LayerNorm(33, elementwise_affine=affine, bias=bias).to(dtype)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert_matches(ours, theirs, randn(*shape, dtype=dtype, seed=6) * 2 + 0.5)


class LlamaMLP(torch.nn.Module):
    """Hugging Face's LlamaMLP, as written there."""

    def __init__(self, dim, hidden, bias=False):
        super().__init__()
        self.gate_proj = torch.nn.Linear(dim, hidden, bias=bias)
        self.up_proj = torch.nn.Linear(dim, hidden, bias=bias)
        self.down_proj = torch.nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, bias", [((17, 24), False), ((2, 5, 24), True), ((2, 1, 3, 24), False)])
def test_swiglu_is_llamas_mlp(dtype, shape, bias):
    torch.manual_seed(len(shape))  # nn.Linear's initialization draws from the global generator
    theirs = LlamaMLP(24, 40, bias).to(dtype)
    ours = tnn.SwiGLU(24, 40, bias=bias).to(dtype)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert_matches(ours, theirs, randn(*shape, dtype=dtype, seed=7))


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


class HFRotary(torch.nn.Module):
    """Hugging Face's apply_rotary_pos_emb (unsqueeze_dim=1), as written there."""

    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class Rotary(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        return tnn.apply_rotary(q, k, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_apply_rotary_is_hugging_faces(dtype, heads, kv_heads):
    b, s, d = 2, 17, 16
    q, k = randn(b, heads, s, d, dtype=dtype, seed=8), randn(b, kv_heads, s, d, dtype=dtype, seed=9)
    angles = torch.arange(s)[:, None] * (1e-2 * torch.arange(d // 2))[None, :] + randn(b, s, d // 2, seed=10)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    for ours, theirs in zip(Rotary()(q, k, cos, sin), HFRotary()(q, k, cos, sin), strict=True):
        golden = [t.double() for t in (q, k, cos, sin)]
        gold = HFRotary()(*golden)[0 if ours.shape[1] == heads else 1]
        assert testing.compare(ours, gold, theirs).ok


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_is_torchs(dtype, reduction, smoothing):
    logits = randn(33, 113, dtype=dtype, seed=11) * 3
    labels = torch.randint(0, 113, (33,), generator=torch.Generator().manual_seed(12))
    labels[::5] = -100
    kw = {"reduction": reduction, "label_smoothing": smoothing}
    assert_matches(tnn.CrossEntropyLoss(**kw), torch.nn.CrossEntropyLoss(**kw), logits, labels)


def test_cross_entropy_with_classes_at_dim_1_and_another_ignore_index():
    logits = randn(2, 17, 3, 5, seed=13)
    labels = torch.randint(0, 17, (2, 3, 5), generator=torch.Generator().manual_seed(14))
    labels[0, 1] = 7
    for reduction in ("mean", "none"):
        kw = {"reduction": reduction, "ignore_index": 7}
        assert_matches(tnn.CrossEntropyLoss(**kw), torch.nn.CrossEntropyLoss(**kw), logits, labels)


class SDPA(torch.nn.Module):
    def __init__(self, causal=False):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mod, causal", [(None, False), ("where(index(s, -1) <= index(s, -2), s, -inf)", True)])
def test_attention_is_sdpa(dtype, mod, causal):
    q, k, v = (randn(2, 3, n, 16, dtype=dtype, seed=15 + i) for i, n in enumerate((17, 17, 17)))
    assert_matches(tnn.Attention(mod), SDPA(causal), q, k, v)


def test_attention_with_a_soft_cap():
    class Capped(torch.nn.Module):
        def forward(self, q, k, v):
            s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
            return torch.softmax(20.0 * torch.tanh(s / 20.0), dim=-1) @ v

    q, k, v = (randn(3, n, 32, seed=20 + i) * 3 for i, n in enumerate((5, 113, 113)))
    assert_matches(tnn.Attention("20.0 * tanh(s / 20.0)"), Capped(), q, k, v)


def test_modules_refuse_what_they_do_not_support():
    with pytest.raises(diag.OptionError) as info:
        tnn.CrossEntropyLoss(weight=torch.rand(3))
    assert info.value.message == ("tiledsl.nn.CrossEntropyLoss: per-class weight and the deprecated "
                                  "size_average/reduce are not supported")
    with pytest.raises(diag.ArgumentError) as info:
        tnn.CrossEntropyLoss()(randn(4, 3), torch.rand(4, 3))
    assert info.value.message == ("tiledsl.nn.cross_entropy: class-index targets only (probability targets "
                                  "are not supported)")
    with pytest.raises(diag.ArgumentError) as info:
        tnn.RMSNorm(8)(randn(4, 7))
    assert info.value.message == "rms_norm: expected an input whose last dims are [8], got [4, 7]"
    with pytest.raises(diag.OptionError) as info:
        tnn.Attention("s)\n    t = (s")
    assert info.value.message == "tiledsl.nn.Attention: score_mod must be one expression, got 's)\\n    t = (s'"
    with pytest.raises(diag.UnexpectedTokenError):
        tnn.Attention("s }")
    with pytest.raises(diag.OptionError) as info:  # was a TypeError: a list is unhashable
        tnn.Attention(["s"])
    assert info.value.message == "tiledsl.nn.Attention: score_mod must be DSL text (a str), got list"


class Functional(torch.nn.Module):
    """`fn(x, *params)`, the params as parameters (so the oracle checks their gradients)."""

    def __init__(self, fn, *params: torch.Tensor) -> None:
        super().__init__()
        self.fn = fn
        self.params = torch.nn.ParameterList(params)

    def forward(self, x):
        return self.fn(x, *self.params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_functions_are_torch_nn_functionals(dtype):
    """The functions the modules' forwards call, against torch.nn.functional's (layer_norm
    with a bias and no weight too, which no module of either makes) and against the gated
    MLP written with F.linear."""
    x = randn(3, 5, 33, dtype=dtype, seed=60) * 2 + 0.5
    w, b = (randn(33, dtype=dtype, seed=s) * 0.5 + 1 for s in (61, 62))
    cases = [
        (lambda x, w: tnn.rms_norm(x, 33, w, 1e-6), lambda x, w: F.rms_norm(x, (33,), w, 1e-6), [w]),
        (lambda x, w, b: tnn.layer_norm(x, (33,), w, b), lambda x, w, b: F.layer_norm(x, (33,), w, b), [w, b]),
        (lambda x, b: tnn.layer_norm(x, (33,), bias=b), lambda x, b: F.layer_norm(x, (33,), bias=b), [b]),
        (lambda x: tnn.layer_norm(x, [5, 33], eps=1e-3), lambda x: F.layer_norm(x, [5, 33], eps=1e-3), []),
    ]
    gate, up, down = (randn(*shape, dtype=dtype, seed=63 + i) * 0.2
                      for i, shape in enumerate(((40, 33), (40, 33), (33, 40))))
    cases.append((tnn.swiglu, lambda x, g, u, d: F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d),
                  [gate, up, down]))
    for ours, theirs, params in cases:
        assert_matches(Functional(ours, *params), Functional(theirs, *params), x)
    with pytest.raises(diag.ArgumentError) as info:
        tnn.swiglu(x, gate, up, down, gate_bias=b)
    assert info.value.message == "tiledsl.nn.swiglu: give the three biases (gate_bias, up_bias, down_bias) or none"


def test_library_programs_are_readable_generic_programs():
    fn = tnn.program("rms_norm")
    assert isinstance(fn, tiledsl.api.Generic) and fn.kernel.type_params[0].dtypes == ("f16", "bf16", "f32")
    spec = fn.specialize(T="bf16", batch=2)
    assert "1 kernel for" in spec.explain()
    with pytest.raises(diag.OptionError) as info:
        tnn.program("rmsnorm")
    assert info.value.message.startswith("tiledsl.nn.program: no library program 'rmsnorm'; did you mean")


def test_the_example_block_trains_under_torch_compile_as_torchs_does():
    """examples/train_block.py: a transformer block of tiledsl.nn modules, compiled with
    torch.compile(fullgraph=True, dynamic=True), trains step for step with the same block
    built from torch's modules (f32: the losses agree to f32 rounding)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "train_block.py"
    spec = importlib.util.spec_from_file_location("train_block", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(steps=2)
    for ours, theirs in losses:
        assert abs(ours - theirs) <= 1e-6 * abs(theirs), losses
    assert losses[1][0] < losses[0][0]
