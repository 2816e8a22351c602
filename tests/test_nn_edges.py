"""tiledsl.nn at its edges: -inf logits give torch's cross-entropy (forward and gradient,
with and without label smoothing), a target that is neither a class nor ignore_index is an
error as in torch, Attention modules share their programs only while they hold them, and
torch.fx's symbolic_trace and make_fx (real mode) trace a model
holding the modules into a graph that runs as the model does eagerly."""

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from test_nn import SDPA, HFRotary, LlamaMLP, _perturbed, assert_matches
from torch.fx.experimental.proxy_tensor import make_fx

from helpers import randn
from tiledsl import diagnostics as diag
from tiledsl import nn as tnn
from tiledsl import testing

INF = float("inf")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CAUSAL = "where(index(s, -1) <= index(s, -2), s, -inf)"


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
    runs = ((tnn.CrossEntropyLoss(), lambda t: t), (torch.nn.CrossEntropyLoss(), torch.Tensor.double),
            (torch.nn.CrossEntropyLoss(), lambda t: t))
    for module, cast in runs:
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


# --- targets outside the classes ------------------------------------------------------------


@pytest.mark.parametrize("bad, ignore_index, smoothing", [(7, -100, 0.0), (-1, -100, 0.0), (5, -100, 0.1),
                                                          (-100, -1, 0.0), (-3, 3, 0.1)])
def test_cross_entropy_refuses_a_target_outside_the_classes(bad, ignore_index, smoothing):
    """torch raises IndexError ("Target 7 is out of bounds.") for a target outside [0, C)
    that is not ignore_index (-1 and -100 included, unless one is ignore_index); tiledsl's
    error is an IndexError too, naming the target, the classes and ignore_index."""
    logits = randn(6, 5, seed=43)
    labels = torch.tensor([0, 4, bad, 2, ignore_index, 1])
    kw = {"ignore_index": ignore_index, "label_smoothing": smoothing}
    with pytest.raises(IndexError) as theirs:
        torch.nn.CrossEntropyLoss(**kw)(logits, labels)
    assert str(theirs.value) == f"Target {bad} is out of bounds."
    with pytest.raises(tnn.TargetError) as info:
        tnn.CrossEntropyLoss(**kw)(logits, labels)
    assert isinstance(info.value, IndexError) and isinstance(info.value, diag.TileDSLError)
    assert info.value.message == (f"tiledsl.nn.cross_entropy: target {bad} is out of bounds for 5 classes "
                                  f"(targets are 0 to 4, or ignore_index {ignore_index})")
    # the same under autocast and with a logit needing a gradient: no tracer, the host check
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(tnn.TargetError):
        tnn.CrossEntropyLoss(**kw)(logits.clone().requires_grad_(), labels)


def test_cross_entropy_checks_targets_at_dim_1_and_takes_minus_one_as_ignore_index():
    """Classes at dim 1: -1 as ignore_index is ignored, as torch's; with the default
    ignore_index it and an 11 of 11 classes are out of bounds, the first (in the targets'
    order) named, as torch names it."""
    logits = randn(2, 11, 3, 7, seed=44)
    labels = torch.randint(0, 11, (2, 3, 7), generator=torch.Generator().manual_seed(45))
    labels[1, 2, 3] = -1
    for reduction in ("mean", "none"):
        kw = {"reduction": reduction, "ignore_index": -1}
        assert_matches(tnn.CrossEntropyLoss(**kw), torch.nn.CrossEntropyLoss(**kw), logits, labels)
    labels[0, 1, 5] = 11
    with pytest.raises(IndexError) as theirs:
        torch.nn.CrossEntropyLoss()(logits, labels)
    assert str(theirs.value) == "Target 11 is out of bounds."
    with pytest.raises(tnn.TargetError) as info:
        tnn.CrossEntropyLoss()(logits, labels)
    assert info.value.message == ("tiledsl.nn.cross_entropy: target 11 is out of bounds for 11 classes "
                                  "(targets are 0 to 10, or ignore_index -100)")


def test_cross_entropy_checks_targets_in_a_traced_graph():
    """Traced (make_fx, torch.compile), the check is torch._assert_async, kept in the graph:
    a bad target raises RuntimeError when the graph runs on the CPU (a device-side assert on
    CUDA); good targets give torch's loss."""
    loss = tnn.CrossEntropyLoss(label_smoothing=0.1)
    logits = randn(9, 5, seed=46)
    good = torch.tensor([0, 4, 3, -100, 2, 1, 1, 0, 4])
    bad = good.clone()
    bad[6] = 5
    graph = make_fx(loss)(logits, good)
    assert torch.ops.aten._assert_async.msg in [n.target for n in graph.graph.nodes]
    compiled = torch.compile(loss, fullgraph=True)
    theirs = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    for fn in (graph, compiled):
        report = testing.compare(fn(logits, good), theirs(logits.double(), good), theirs(logits, good))
        assert report.ok, report
        with pytest.raises(RuntimeError) as info:
            fn(logits, bad)
        assert str(info.value) == ("tiledsl.nn.cross_entropy: a target is out of bounds (targets are class "
                                   "indices, 0 to the number of classes - 1, or ignore_index -100)")


@pytest.mark.gpu
def test_cross_entropy_checks_targets_on_cuda_without_a_sync():
    """On CUDA the check is a device-side assert: no host sync (CUDA's sync debug mode would
    raise on one), and a bad target fails the process's CUDA context at the next sync, as
    torch's own cross-entropy does (so it runs in a child process)."""
    labels = torch.tensor([0, 4, 3, -100, 2], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tnn._check_targets(labels, 5, -100)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    script = ("import torch, tiledsl.nn as tnn\n"
              "logits = torch.randn(5, 5, device='cuda')\n"
              "tnn.CrossEntropyLoss()(logits, torch.tensor([0, 4, 3, 7, 2], device='cuda'))\n"
              "torch.cuda.synchronize()\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode != 0 and "device-side assert triggered" in proc.stderr, proc.stderr


# --- torch.fx ---------------------------------------------------------------------------------


class Block(torch.nn.Module):
    """Every tiledsl.nn module and apply_rotary in one model (`lib="tiledsl"`), or torch's
    and Hugging Face's equivalents (`lib="torch"`), with a torch Linear among them."""

    def __init__(self, lib: str) -> None:
        super().__init__()
        self.ours = lib == "tiledsl"
        nn = tnn if self.ours else torch.nn
        self.norm = nn.RMSNorm(24, eps=1e-6)
        self.ln = nn.LayerNorm(24)
        self.mlp = tnn.SwiGLU(24, 40, bias=True) if self.ours else LlamaMLP(24, 40, bias=True)
        self.attn = tnn.Attention(CAUSAL) if self.ours else SDPA(causal=True)
        self.head = torch.nn.Linear(24, 29)
        self.loss = nn.CrossEntropyLoss(label_smoothing=0.1)

    def forward(self, x, labels, cos, sin):
        h = self.ln(self.norm(x))
        h = h + self.mlp(h)
        q = h.view(2, 7, 2, 12).transpose(1, 2)
        q, k = tnn.apply_rotary(q, q, cos, sin) if self.ours else HFRotary()(q, q, cos, sin)
        a = self.attn(q, k, q).transpose(1, 2).reshape(14, 24)
        return self.loss(self.head(a), labels)


def _blocks() -> tuple[Block, Block]:
    torch.manual_seed(47)  # nn.Linear's initialization draws from the global generator
    ours = _perturbed(Block("tiledsl"), 48)
    theirs = Block("torch")
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    labels = torch.randint(0, 29, (14,), generator=torch.Generator().manual_seed(seed))
    labels[::4] = -100
    angles = randn(2, 7, 6, seed=seed + 1)
    emb = torch.cat((angles, angles), dim=-1)
    return randn(2, 7, 24, seed=seed + 2), labels, emb.cos(), emb.sin()


def _runs_as_eager(graph, ours: Block, theirs: Block, inputs: tuple, grads: bool) -> None:
    """`graph` on new inputs: ours' output bit for bit (and the parameters' gradients, when
    `grads`), which passes the oracle against torch's block (float64 golden)."""
    out, eager = graph(*inputs), ours(*inputs)
    assert torch.equal(out, eager)
    golden = [x.double() if x.is_floating_point() else x for x in inputs]
    report = testing.compare(out, theirs.double()(*golden), theirs.float()(*inputs))
    assert report.ok, report
    if grads:
        params = list(ours.parameters())
        for g, e in zip(torch.autograd.grad(out, params), torch.autograd.grad(eager, params), strict=True):
            assert torch.equal(g, e)


def test_symbolic_trace_records_each_tiledsl_nn_call_as_one_node():
    """torch.fx.symbolic_trace traces a model holding tiledsl.nn modules (it failed inside
    RMSNorm's forward, reading a Proxy's dtype): each module call, and apply_rotary, is one
    call_function node of the function the module's forward calls, torch.nn.functional's
    way; the graph shares the model's parameters and differentiates as it does."""
    ours, theirs = _blocks()
    graph = torch.fx.symbolic_trace(ours)
    called = [n.target for n in graph.graph.nodes if n.op == "call_function"
              and getattr(n.target, "__module__", None) == "tiledsl.nn"]
    assert called == [tnn.rms_norm, tnn.layer_norm, tnn.swiglu, tnn.apply_rotary, tnn.attention,
                      tnn.cross_entropy]
    _runs_as_eager(graph, ours, theirs, _inputs(49), grads=True)


@pytest.mark.parametrize("grad", [False, True])
def test_make_fx_traces_the_custom_ops(grad):
    """make_fx in real mode records each call as its torch.ops.tiledsl op. With no input
    needing a gradient the call used to run its kernels directly, under make_fx's dispatch
    mode, which then traced the Triton interpreter's own aten calls and failed on a storage
    argument; any dispatch mode now sends the call through the op."""
    ours, theirs = _blocks()
    ours.requires_grad_(grad)
    graph = make_fx(ours)(*_inputs(50))
    ops = [n.target for n in graph.graph.nodes if isinstance(n.target, torch._ops.OpOverload)]
    assert len([op for op in ops if op.namespace == "tiledsl"]) == 6
    assert {op.namespace for op in ops} == {"aten", "tiledsl"}
    assert torch.ops.aten.set_.source_Storage_storage_offset not in ops
    _runs_as_eager(graph, ours, theirs, _inputs(51), grads=False)


# --- attention programs ---------------------------------------------------------------------


def test_attention_modules_share_a_program_while_one_holds_it(monkeypatch):
    """Two modules with one score_mod share a program (and its op); the process-wide cache
    holds it weakly, so once no module does it is collected (releasing its op) rather than
    kept for the process. A module runs the program it holds, not the cache's."""
    mod = "s * 0.75 - 0.125"  # no other test's: nothing else holds this program
    a, b = tnn.Attention(mod), tnn.Attention(mod)
    assert a.program is b.program and tnn._ATTENTION_PROGRAMS[mod] is a.program
    assert tnn.Attention(CAUSAL).program is not a.program
    q, k, v = (randn(2, n, 8, seed=70 + i) for i, n in enumerate((5, 9, 9)))
    want = torch.softmax((q @ k.transpose(-1, -2) / 8 ** 0.5) * 0.75 - 0.125, dim=-1) @ v

    with monkeypatch.context() as m:
        m.setattr(tnn, "_ATTENTION_PROGRAMS", weakref.WeakValueDictionary())
        torch.testing.assert_close(a(q, k, v), want)
        assert len(tnn._ATTENTION_PROGRAMS) == 0  # no lookup, no recompile

    held = weakref.ref(a.program)
    del a
    gc.collect()
    assert held() is b.program and mod in tnn._ATTENTION_PROGRAMS
    del b
    gc.collect()
    assert held() is None and mod not in tnn._ATTENTION_PROGRAMS


def test_the_attention_function_holds_its_recent_programs(monkeypatch):
    """The function `attention` holds the programs it ran last (a bounded few): a loop of
    calls compiles once, and one no longer among them is collected when nothing else holds
    it."""
    monkeypatch.setattr(tnn, "_RECENT_LIMIT", 2)
    monkeypatch.setattr(tnn, "_RECENT_ATTENTION", {})
    q = randn(2, 5, 8, seed=80)
    mods = ["s * 0.5 + 0.25", "s * 0.5 + 0.375", "s * 0.5 + 0.625"]  # no other test's
    tnn.attention(q, q, q, mods[0])
    held = weakref.ref(tnn._ATTENTION_PROGRAMS[mods[0]])
    gc.collect()
    tnn.attention(q, q, q, mods[0])
    assert tnn._ATTENTION_PROGRAMS[mods[0]] is held()  # not compiled again
    for mod in mods[1:]:
        tnn.attention(q, q, q, mod)
    gc.collect()
    assert held() is None and list(tnn._RECENT_ATTENTION) == mods[1:]
    with pytest.raises(diag.OptionError) as info:
        tnn.attention(q, q, q, ["s"])
    assert info.value.message == "tiledsl.nn.Attention: score_mod must be DSL text (a str), got list"
