"""Routers and samplers written as model code writes them: DeepSeek-V3's group-limited
sigmoid router and a top-p (nucleus) logits filter, against float64 torch references on
awkward sizes (the same experts chosen, the same tokens kept), with kernel counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiledsl
from helpers import randn, run_checked

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def deepseek_reference(logits, bias, scale, groups=8, kept=4, top=8):
    """DeepSeek-V3's MoEGate (noaux_tc) in float64."""
    t, e = logits.shape
    s = logits.double().sigmoid()
    biased = s + bias.double()
    group_score = biased.view(t, groups, -1).topk(2, -1).values.sum(-1)
    chosen = torch.zeros(t, groups, dtype=torch.bool).scatter_(1, group_score.topk(kept, -1).indices, True)
    masked = biased.masked_fill(~chosen.repeat_interleave(e // groups, 1), float("-inf"))
    experts = masked.topk(top, -1).indices
    w = s.gather(1, experts)
    return w / w.sum(-1, keepdim=True) * scale, experts


@pytest.mark.parametrize("t, e", [(1, 64), (17, 256), (113, 64)])
def test_deepseek_router_chooses_deepseeks_experts(t, e):
    fn = tiledsl.compile(EXAMPLES / "deepseek_router.tdsl")
    logits, bias = randn(t, e), randn(e, seed=1) * 0.1
    _, (weights, experts) = run_checked(fn, logits, bias, scale=2.5)
    want_w, want_e = deepseek_reference(logits, bias, 2.5)
    assert torch.equal(experts, want_e)
    assert torch.allclose(weights.double(), want_w, atol=1e-6)
    # the scores; the group scores; the groups kept; the mask; the experts and weights
    assert [k.template for k in fn.kernels] == ["pointwise", "rows", "rows", "rows", "rows"]


def hf_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """transformers' TopPLogitsWarper (min_tokens_to_keep=1)."""
    sorted_logits, idx = torch.sort(logits, descending=False)
    remove = sorted_logits.softmax(-1).cumsum(-1) <= (1 - p)
    remove[..., -1:] = False
    return logits.masked_fill(remove.scatter(1, idx, remove), float("-inf"))


@pytest.mark.parametrize("b, v", [(1, 1), (17, 113), (3, 1000), (2, 16000), (2, 40000)])
@pytest.mark.parametrize("p", [0.1, 0.9])
def test_top_p_keeps_hugging_faces_tokens(b, v, p):
    fn = tiledsl.compile(EXAMPLES / "top_p.tdsl")
    logits = randn(b, v) * 3
    _, out = run_checked(fn, logits, p=p)
    assert torch.equal(out, hf_top_p(logits.double(), p).float())
    # the softmax, the sort, the cumsum and the threshold; then the filter
    assert [k.template for k in fn.kernels] == ["rows", "rows"]
