"""tiledsl.nn at its edges: -inf logits give torch's cross-entropy (forward and gradient,
with and without label smoothing)."""

import pytest
import torch
from test_nn import assert_matches

from helpers import randn
from tiledsl import nn as tnn
from tiledsl import testing

INF = float("inf")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# --- cross-entropy with -inf logits ---------------------------------------------------------


def _masked_logits(dtype: torch.dtype, minus_inf_target: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [29, 37]: the last 6 classes padding (-inf), about a fifth of the others masked
    (-inf) but never a target's, every fifth row ignored (row 5's column 0, which an ignored
    row's gather reads, -inf). With `minus_inf_target`, two rows' target logits are -inf
    (torch's loss there is +inf)."""
    g = torch.Generator().manual_seed(31)
    x = torch.randn(29, 37, generator=g) * 3
    labels = torch.randint(0, 31, (29,), generator=g)
    masked = torch.rand(29, 37, generator=g) < 0.2
    masked[torch.arange(29), labels] = False
    x[masked] = -INF
    x[:, 31:] = -INF
    labels[::5] = -100
    x[5, 0] = -INF
    if minus_inf_target:
        x[3, labels[3]] = -INF
        x[11, labels[11]] = -INF
    return x.to(dtype), labels


def _same_nonfinite(value: torch.Tensor, golden: torch.Tensor) -> bool:
    v, g = value.double(), golden.double()
    return all(torch.equal(f(v), f(g)) for f in (torch.isnan, torch.isposinf, torch.isneginf))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("minus_inf_target", [False, True])
def test_cross_entropy_with_minus_inf_logits_is_torchs(dtype, reduction, smoothing, minus_inf_target):
    """A vocabulary padded with -inf and masked logits: without smoothing the loss is finite
    (it was NaN: 0 times the smoothing term's +inf), +inf on a row whose target logit is
    -inf; with smoothing every row not ignored is +inf, and NaN where s = 1 meets a -inf
    target (0 * inf in torch too). The oracle against torch's module, and the NaNs and
    infinities of the loss and of its gradient exactly where torch's float64 has them."""
    logits, labels = _masked_logits(dtype, minus_inf_target)
    kw = {"reduction": reduction, "label_smoothing": smoothing}
    assert_matches(tnn.CrossEntropyLoss(**kw), torch.nn.CrossEntropyLoss(**kw), logits, labels)

    x, xg = logits.clone().requires_grad_(), logits.double().requires_grad_()
    out = tnn.CrossEntropyLoss(**kw)(x, labels)
    gold = torch.nn.CrossEntropyLoss(**kw)(xg, labels)
    cot = randn(*out.shape, seed=99)
    (grad,) = torch.autograd.grad(out, x, cot.to(out.dtype))
    (gold_grad,) = torch.autograd.grad(gold, xg, cot.double())
    assert _same_nonfinite(out, gold) and _same_nonfinite(grad, gold_grad)
    assert grad.isfinite().all()
    if smoothing == 0.0 and not minus_inf_target:
        assert out.isfinite().all()


def test_cross_entropy_gives_an_ignored_row_of_minus_inf_no_gradient():
    """A row whose logits are all -inf, ignored: its loss is 0, as torch's. torch's gradient
    for that row is NaN (its log_softmax backward multiplies the row's NaN probabilities by
    the zero incoming gradient); the loss does not depend on the row, and tiledsl's gradient
    there is 0. The other rows' gradients pass the oracle."""
    logits = randn(7, 13, seed=41) * 2
    logits[2] = -INF
    labels = torch.randint(0, 13, (7,), generator=torch.Generator().manual_seed(42))
    labels[2] = -100
    grads, outs = [], []
    for module, cast in ((tnn.CrossEntropyLoss(), lambda t: t), (torch.nn.CrossEntropyLoss(), torch.Tensor.double),
                         (torch.nn.CrossEntropyLoss(), lambda t: t)):
        x = cast(logits).requires_grad_()
        out = module(x, labels)
        outs.append(out)
        grads.append(torch.autograd.grad(out, x)[0])
    assert testing.compare(*outs).ok and outs[0].isfinite()
    assert grads[1][2].isnan().all()  # torch's, which tiledsl does not copy
    assert torch.equal(grads[0][2], torch.zeros(13))
    rows = [0, 1, 3, 4, 5, 6]
    report = testing.compare(grads[0][rows], grads[1][rows], grads[2][rows])
    assert report.ok, report
