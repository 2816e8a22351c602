"""Programs as PyTorch operators (`fn.op`, `tiledsl.torch_op`): the schema, opcheck,
torch.compile(fullgraph=True) training under aot_eager and inductor, torch.export."""

from __future__ import annotations

import pytest
import torch

import tiledsl
from helpers import randn
from tiledsl import testing

RMS = """kernel rms(x: f32[N, D], w: f32[D], eps: f32) -> f32[N, D] {
    r = rsqrt(mean(x * x, axis=-1, keepdims=true) + eps)
    return x * r * w
}"""


def test_the_op_is_named_by_kernel_and_content_and_registered_once():
    fn, again = tiledsl.compile(RMS), tiledsl.compile(RMS)
    assert fn.op is again.op
    assert str(fn.op).startswith("tiledsl.rms_") and len(fn.op._opname) == len("rms_") + 64
    assert str(fn.op._schema).endswith("(Tensor x, Tensor w, float eps) -> Tensor")
    other = tiledsl.compile(RMS.replace("+ eps", "+ eps * 2.0"))
    assert other.op is not fn.op
    x, w = randn(17, 33), randn(33)
    torch.testing.assert_close(fn.op(x, w, 1e-5), fn(x, w, 1e-5), rtol=0, atol=0)


def test_programs_a_short_hash_would_merge_are_two_ops():
    """`softmax(x) * c` for these two constants shared one op under a 48-bit name (a
    birthday search finds such pairs in minutes): autograd ran the first one's kernels for
    the second. The name is the whole SHA-256, and each op runs its own program."""
    source = "kernel k(x: f32[M, N]) -> f32[M, N] {{ return softmax(x, axis=-1) * {c} }}"
    constants = (16455470, 24233931)
    fns = [tiledsl.compile(source.format(c=c)) for c in constants]
    assert fns[0].op is not fns[1].op
    x = randn(3, 17)
    for fn, c in zip(fns, constants, strict=True):
        torch.testing.assert_close(fn.op(x).double(), torch.softmax(x.double(), -1) * c, rtol=1e-6, atol=0)
        report = testing.check_grads(fn, x)  # through fn.op: x requires a gradient
        assert report.ok, report


def test_a_name_collision_is_refused_not_served_by_the_other_program(monkeypatch):
    """Were two programs' names ever equal (every digest made equal here), registration
    compares the text hashed and refuses the second: one name is one program."""
    from tiledsl import torch_op

    monkeypatch.setattr(torch_op, "_digest", lambda text: "0" * 64)
    first = tiledsl.compile(RMS)
    assert tiledsl.compile(RMS).op is first.op  # the same program: the same op
    with pytest.raises(tiledsl.TileDSLError) as err:
        tiledsl.compile(RMS.replace("x * r * w", "x * r * w * 2.0"))
    assert err.value.message == (
        "internal compiler error: 'rms' and another live program hash to the same op name "
        f"torch.ops.tiledsl.rms_{'0' * 64}; their graphs differ, so neither may run the "
        "other's kernels")


def test_opcheck_passes_on_a_program_and_its_derived_ops():
    fn = tiledsl.compile(RMS)
    args = (randn(5, 7).requires_grad_(), randn(7).requires_grad_(), 1e-5)
    assert set(torch.library.opcheck(fn.op, args).values()) == {"SUCCESS"}
    multi = tiledsl.compile("""kernel two(x: f32[N, D], m: bool[N]) -> (f32[N], f32[N, D], i32[N]) {
        return where(m, sum(x, axis=-1), 0.0), x.T.T * 2.0, cast(m, i32)
    }""")
    margs = (randn(5, 7).requires_grad_(), torch.tensor([True, False, True, True, False]))
    assert set(torch.library.opcheck(multi.op, margs).values()) == {"SUCCESS"}


def test_outputs_never_alias_inputs_through_the_op():
    fn = tiledsl.compile("kernel same(x: f32[N, D]) -> (f32[N, D], f32[D, N]) { return x, x.T }")
    x = randn(5, 7)
    a, b = fn.op(x)
    assert a.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert torch.equal(a, x) and torch.equal(b, x.T) and b.is_contiguous()
    assert set(torch.library.opcheck(fn.op, (x.requires_grad_(),)).values()) == {"SUCCESS"}


def test_keyword_arguments_and_argument_errors_through_the_op():
    fn = tiledsl.compile(RMS)
    x, w = randn(17, 33).requires_grad_(), randn(33)
    y = fn(x, eps=1e-5, w=w)
    torch.testing.assert_close(y, fn(x.detach(), w, 1e-5))
    with pytest.raises(tiledsl.TileDSLError, match="has no parameter 'ep'; did you mean 'eps'"):
        fn(x, w, ep=1e-5)
    with pytest.raises(tiledsl.TileDSLError, match="argument 'x' has dtype torch.float16"):
        fn(x.half(), w, 1e-5)


class Block(torch.nn.Module):
    """A pre-norm MLP whose norm is a tiledsl program with a trainable weight."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.w = torch.nn.Parameter(torch.rand(33, generator=torch.Generator().manual_seed(1)) + 0.5)
        self.proj = torch.nn.Linear(33, 33)
        torch.nn.init.normal_(self.proj.weight, generator=torch.Generator().manual_seed(2))

    def forward(self, x):
        return self.proj(self.fn(x, self.w, 1e-5)).square().mean()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_trains_like_eager(backend):
    fn = tiledsl.compile(RMS)
    model = Block(fn)
    x = randn(17, 33)
    loss = model(x)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    closs = compiled(x)
    closs.backward()
    torch.testing.assert_close(closs, loss, rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6)
    # a few optimizer steps stay in step with eager
    eager = Block(fn)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    eager.load_state_dict(model.state_dict())
    for _ in range(3):
        for m, opt in ((compiled, opt_c), (eager, opt_e)):
            opt.zero_grad()
            m(x).backward()
            opt.step()
    torch.testing.assert_close(model.w, eager.w, rtol=1e-5, atol=1e-6)


def test_torch_export_keeps_the_op():
    fn = tiledsl.compile(RMS)
    model = Block(fn)
    ep = torch.export.export(model, (randn(17, 33),))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert fn.op in targets
    x = randn(17, 33, seed=9)
    torch.testing.assert_close(ep.module()(x), model(x))


def test_the_op_is_named_by_the_program_not_its_text(tmp_path):
    """The op's name hashes the program's graph IR and options: the same program from a file,
    as text, with comments and another layout is one op; another program or option is not."""
    path = tmp_path / "norm.tdsl"
    path.write_text("# an RMSNorm\n" + RMS.replace("{", "{\n   # rows\n", 1))
    a, b = tiledsl.compile(RMS), tiledsl.compile(path)
    assert a.op is b.op and a.op.name() == b.op.name()
    assert tiledsl.compile(RMS.replace("x * r * w", "x * r * w * 2.0")).op is not a.op
    assert tiledsl.compile(RMS, allow_tf32=True).op is not a.op
    generic = "kernel g[T: f16 | f32](x: T[..., D]) -> T[..., D] { return x * 2.0 }"
    g1 = tiledsl.compile(generic)
    g2 = tiledsl.compile(generic.replace("{ ", "{\n  # doubled\n  ") + "\n")
    assert g1.op is g2.op


def test_an_exported_program_loads_in_a_fresh_process(tmp_path):
    """torch.export.save in this process; in a fresh one, the same program compiled from
    other text (a file, with a comment) makes the op the saved graph names."""
    import subprocess
    import sys

    fn = tiledsl.compile(RMS)
    ep = torch.export.export(Block(fn), (randn(17, 33),))
    torch.export.save(ep, tmp_path / "block.pt2")
    x = randn(17, 33, seed=9)
    torch.save((x, ep.module()(x)), tmp_path / "expected.pt")
    (tmp_path / "rms.tdsl").write_text("# the same program\n" + RMS)
    script = f"""
import torch, tiledsl
fn = tiledsl.compile({str(tmp_path / "rms.tdsl")!r})
ep = torch.export.load({str(tmp_path / "block.pt2")!r})
x, expected = torch.load({str(tmp_path / "expected.pt")!r})
torch.testing.assert_close(ep.module()(x), expected, rtol=0, atol=0)
print("ok", fn.op.name())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok", fn.op.name()]


def test_torch_compile_of_a_program_never_called_eagerly():
    fn = tiledsl.compile(RMS.replace("rms(", "fresh("))
    torch._dynamo.reset()
    x, w = randn(17, 33).requires_grad_(), randn(33).requires_grad_()
    y = torch.compile(lambda x, w: fn(x, w, 1e-5).sum(), backend="aot_eager", fullgraph=True)(x, w)
    y.backward()
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
    (xs * torch.rsqrt((xs * xs).mean(-1, keepdim=True) + 1e-5) * ws).sum().backward()
    torch.testing.assert_close(x.grad, xs.grad)
    torch.testing.assert_close(w.grad, ws.grad)
