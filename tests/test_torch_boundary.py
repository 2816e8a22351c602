"""The torch boundary under careless and concurrent use: threads and fork, more parameters
than a torch schema takes, parameter names torch or Python reserve, outputs that would
alias, torch.vmap and torch.func, pickling, nested tensors, and the op registry's memory."""

from __future__ import annotations

import gc
import pickle
import subprocess
import sys
import threading

import pytest
import torch

import tiledsl
from helpers import randn
from tiledsl import torch_op


def rms64(x, w, eps):
    x, w = x.double(), w.double()
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


RMS = """kernel rms_boundary(x: f32[N, D], w: f32[D], eps: f32) -> f32[N, D] {
    r = rsqrt(mean(x * x, axis=-1, keepdims=true) + eps)
    return x * r * w
}"""


# --- threads and fork --------------------------------------------------------------------

def test_threads_compiling_one_new_program_and_taking_its_first_backward_all_succeed():
    """8 threads compile the same new program at once (one op registration), then take its
    first backward at once (one derivation): every one gets the float64 gradients."""
    src = "kernel threads_first(x: f32[M, N], w: f32[N]) -> f32[M, N] { return softmax(x * w) * x }"
    x, w = randn(17, 33), randn(33)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    (torch.softmax(x64 * w64, -1) * x64).square().sum().backward()
    barrier = threading.Barrier(8, timeout=120)
    results: list = [None] * 8

    def work(k: int) -> None:
        try:
            barrier.wait()
            fn = tiledsl.compile(src)
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            barrier.wait()
            fn(xs, ws).square().sum().backward()
            results[k] = (fn.op, xs.grad, ws.grad)
        except Exception as err:  # noqa: BLE001 - reported below, with the thread's number
            results[k] = err
            barrier.abort()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert len({id(op) for op, _, _ in results}) == 1
    for _, gx, gw in results:
        torch.testing.assert_close(gx.double(), x64.grad, rtol=0, atol=1e-4)
        torch.testing.assert_close(gw.double(), w64.grad, rtol=0, atol=1e-4)


FORK_SCRIPT = """
import os, sys, threading, time
import torch, tiledsl
from tiledsl.backends.triton import interpret

fn = tiledsl.compile("kernel fork_mm(x: f32[M, K], w: f32[K, N]) -> f32[M, N] { return relu(x @ w) }")
x, w = torch.randn(113, 64), torch.randn(64, 96)
want = torch.relu(x.double() @ w.double())
s = torch.randn(17, 33)
s64 = s.double().requires_grad_()
(torch.softmax(s64, -1) * 3.0).square().sum().backward()
fn(x, w)
stop = threading.Event()

def calls():
    while not stop.is_set():
        fn(x, w)

thread = threading.Thread(target=calls, daemon=True)
thread.start()
for attempt in range(6):  # each fork races the thread's launch anew
    while interpret._depth == 0:  # until the thread is inside a launch
        time.sleep(0.0001)
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)  # (libgomp's thread pool does not survive a fork)
        ok = (fn(x, w).double() - want).abs().max().item() < 1e-3
        g = tiledsl.compile("kernel fork_fresh(x: f32[N, D]) -> f32[N, D] { return softmax(x) * 3.0 }")
        y = s.clone().requires_grad_()
        g(y).square().sum().backward()
        ok = ok and (y.grad.double() - s64.grad).abs().max().item() < 1e-4
        os._exit(0 if ok else 3)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("the forked child hung")
        sys.exit(1)
    if os.waitstatus_to_exitcode(status) != 0:
        break
stop.set()
thread.join()
print("child exit", os.waitstatus_to_exitcode(status))
"""


def test_fork_while_a_thread_is_inside_a_call_does_not_deadlock_the_child(tmp_path):
    """A process forks, six times, while another thread runs CPU calls in a loop; the fork
    waits for the thread's launch to leave NumPy (a fork inside OpenBLAS hung the child's
    first `tl.dot`), and each child runs the program, compiles a new one and takes its
    first backward."""
    script = tmp_path / "fork.py"
    script.write_text(FORK_SCRIPT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip().splitlines()[-1:] == ["child exit 0"], result.stdout + result.stderr


# --- the schema: parameter count and names -------------------------------------------------

def test_a_program_of_100_parameters_runs_forward_and_backward_through_a_packed_op():
    """torch's schemas take 64 arguments: past that the op takes lists by kind."""
    n = 98
    params = ", ".join(f"x{i}: f32[N]" for i in range(n)) + ", s: f32, k: i32"
    body = " + ".join(f"x{i} * x{i + 1}" for i in range(n - 1))
    fn = tiledsl.compile(f"kernel hundred({params}) -> f32[N] {{ return ({body}) * s + cast(k, f32) }}")
    assert str(fn.op._schema).endswith("(Tensor[] tensors, float[] floats, int[] ints) -> Tensor")
    xs = [randn(17).requires_grad_() for _ in range(n)]
    x64 = [x.detach().double().requires_grad_() for x in xs]
    y = fn(*xs, 0.5, 3)
    y64 = sum(x64[i] * x64[i + 1] for i in range(n - 1)) * 0.5 + 3
    torch.testing.assert_close(y.double(), y64, rtol=0, atol=1e-4)
    torch.testing.assert_close(fn(*[x.detach() for x in xs], k=3, s=0.5), y.detach(), rtol=0, atol=0)
    y.square().sum().backward()
    y64.square().sum().backward()
    for x, ref in zip(xs, x64, strict=True):
        torch.testing.assert_close(x.grad.double(), ref.grad, rtol=0, atol=1e-3)
    with pytest.raises(tiledsl.TileDSLError, match=r"argument 's' must be a number \(f32\), got str"):
        fn(*xs, "0.5", 3)  # a bad argument is the binder's error, not the packed schema's
    assert set(torch.library.opcheck(fn.op, ([x.detach() for x in xs[:n]], [0.5], [3])).values()) \
        == {"SUCCESS"}


def test_a_backward_of_more_than_64_parameters_from_a_forward_of_fewer_works():
    """60 parameters, 4 outputs the backward reads (exp's derivative is its result), 4
    gradients: the backward program has 68 parameters, its op packs them."""
    params = ", ".join(f"x{i}: f32[N]" for i in range(60))
    outs = ", ".join("exp((" + " + ".join(f"x{i}" for i in range(k, 60, 4)) + ") * 0.1)" for k in range(4))
    fn = tiledsl.compile(f"kernel sixty({params}) -> (f32[N], f32[N], f32[N], f32[N]) {{ return {outs} }}")
    assert len(fn.backward.source_graph.params) == 68
    assert str(fn.backward.op._schema).split("(", 1)[1].startswith("Tensor[] tensors) -> (")
    xs = [randn(17).requires_grad_() for _ in range(60)]
    x64 = [x.detach().double().requires_grad_() for x in xs]
    sum(o.square().sum() for o in fn(*xs)).backward()
    sum(torch.exp(sum(x64[i] for i in range(k, 60, 4)) * 0.1).square().sum() for k in range(4)).backward()
    for x, ref in zip(xs, x64, strict=True):
        torch.testing.assert_close(x.grad.double(), ref.grad, rtol=0, atol=1e-4)


KEYWORDS = ["in", "is", "if", "for", "def", "class", "not", "and", "or", "import", "True", "False",
            "NoneType", "lambda", "self", "out", "Tensor", "str", "Scalar", "Device", "Layout",
            "ScalarType", "MemoryFormat", "Storage", "Generator", "return", "while", "with"]


def test_parameters_named_like_python_and_torch_schema_keywords_work():
    """Tensor parameters named by Python keywords and schema type names, and scalar ones named
    float, int and bool: the schema renames them; calls by position and by name, the
    backward, and fn.op all work."""
    params = ", ".join(f"{k}: f32[N]" for k in KEYWORDS) + ", float: f32, int: i32, bool: bool"
    body = " + ".join(f"{a} * {b}" for a, b in zip(KEYWORDS, KEYWORDS[1:], strict=False))
    fn = tiledsl.compile(f"kernel keywords({params}) -> f32[N] {{\n"
                         f"    return where(bool, {body}, in) * float + cast(int, f32)\n}}")
    schema = str(fn.op._schema)
    assert "Tensor arg0_in, Tensor arg1_is, Tensor arg2_if," in schema
    assert "Tensor arg13_lambda, Tensor arg14_self, Tensor arg15_out, Tensor arg16_Tensor," in schema
    assert schema.endswith("float arg28_float, int arg29_int, bool arg30_bool) -> Tensor")
    xs = {k: randn(17) for k in KEYWORDS}
    x64 = {k: v.double().requires_grad_() for k, v in xs.items()}
    want = sum(x64[a] * x64[b] for a, b in zip(KEYWORDS, KEYWORDS[1:], strict=False)) * 0.5 + 3
    positional = fn(*xs.values(), 0.5, 3, True)
    torch.testing.assert_close(positional.double(), want, rtol=0, atol=1e-4)
    named = fn(**xs, float=0.5, int=3, bool=True)
    torch.testing.assert_close(named, positional, rtol=0, atol=0)
    torch.testing.assert_close(fn.op(*xs.values(), 0.5, 3, True), positional, rtol=0, atol=0)
    leaves = {k: v.clone().requires_grad_() for k, v in xs.items()}
    fn(**leaves, float=0.5, int=3, bool=True).square().sum().backward()
    want.square().sum().backward()
    for k in KEYWORDS:
        torch.testing.assert_close(leaves[k].grad.double(), x64[k].grad, rtol=0, atol=1e-4)


# --- outputs ------------------------------------------------------------------------------

def test_returning_one_value_twice_gives_two_tensors_and_opcheck_passes():
    """torch's custom-op contract: no output aliases another output or an input."""
    twice = tiledsl.compile("kernel twice(x: f32[N, D]) -> (f32[N, D], f32[N, D]) {\n"
                            "    y = x * 2.0\n    return y, y\n}")
    x = randn(5, 7)
    for a, b in (twice.op(x), twice(x)):  # the op, and a direct call too
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
        assert torch.equal(a, x * 2) and torch.equal(b, x * 2)
    assert set(torch.library.opcheck(twice.op, (x.clone().requires_grad_(),)).values()) == {"SUCCESS"}
    same = tiledsl.compile("kernel same_twice(x: f32[N, D]) -> (f32[N, D], f32[N, D]) { return x, x }")
    a, b = same.op(x)
    assert len({t.untyped_storage().data_ptr() for t in (a, b, x)}) == 3
    assert set(torch.library.opcheck(same.op, (x.clone().requires_grad_(),)).values()) == {"SUCCESS"}


# --- functorch ----------------------------------------------------------------------------

def test_torch_vmap_of_a_program_runs_it_per_batch_element():
    fn = tiledsl.compile(RMS)
    x, w = randn(3, 17, 33), randn(33)
    out = torch.vmap(fn, in_dims=(0, None, None))(x, w, 1e-5)
    torch.testing.assert_close(out.double(), rms64(x, w, 1e-5), rtol=0, atol=1e-5)
    ws = randn(33, 2)  # batched along its last axis, and the output's along axis 1
    out = torch.vmap(fn, in_dims=(None, 1, None), out_dims=1)(x[0], ws, 1e-5)
    want = torch.stack([rms64(x[0], ws[:, b], 1e-5) for b in range(2)], 1)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)


def test_torch_func_grad_and_vmap_of_grad_of_a_program():
    fn = tiledsl.compile(RMS)
    x, w = randn(17, 33), randn(33)
    gx, gw = torch.func.grad(lambda x, w: fn(x, w, 1e-5).square().sum(), argnums=(0, 1))(x, w)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    rms64(x64, w64, 1e-5).square().sum().backward()
    torch.testing.assert_close(gx.double(), x64.grad, rtol=0, atol=1e-4)
    torch.testing.assert_close(gw.double(), w64.grad, rtol=0, atol=1e-4)
    xb = randn(2, 17, 33)
    per = torch.vmap(torch.func.grad(lambda x: fn(x, w, 1e-5).square().sum()))(xb)
    for b in range(2):
        xb64 = xb[b].double().requires_grad_()
        rms64(xb64, w, 1e-5).square().sum().backward()
        torch.testing.assert_close(per[b].double(), xb64.grad, rtol=0, atol=1e-4)
    with pytest.raises(tiledsl.TileDSLError) as err:  # torch.func cannot reach into an op
        torch.func.grad(lambda x: fn.op(x, w, 1e-5).sum())(x)
    assert err.value.message == (
        "'rms_boundary': under torch.func's transforms, call the compiled program itself (fn(...)), "
        "not fn.op: torch.func cannot differentiate through a custom op's Autograd kernel")


def test_forward_mode_tangents_are_refused_not_dropped():
    """tiledsl derives reverse mode only: a jvp through a program gave a zero tangent."""
    from torch.autograd import forward_ad

    fn = tiledsl.compile(RMS)
    x, w, t = randn(17, 33), randn(33), randn(17, 33)
    message = ("'rms_boundary' cannot be differentiated in forward mode (torch.func.jvp, jacfwd, "
               "hessian, torch.autograd.forward_ad): tiledsl derives reverse-mode gradients only; use "
               "torch.func.grad, vjp or jacrev (or torch.autograd.functional.hessian, which is "
               "reverse mode twice)")

    def dual():
        with forward_ad.dual_level():
            return fn(forward_ad.make_dual(x, t), w, 1e-5)

    for call in (lambda: torch.func.jvp(lambda x: fn(x, w, 1e-5), (x,), (t,)),
                 lambda: torch.func.jacfwd(lambda x: fn(x, w, 1e-5))(x), dual):
        with pytest.raises(tiledsl.TileDSLError) as err:
            call()
        assert err.value.message == message and err.value.line == 1


# --- pickling -----------------------------------------------------------------------------

class Holder(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.w = torch.nn.Parameter(torch.rand(33, generator=torch.Generator().manual_seed(3)) + 0.5)

    def forward(self, x):
        return self.fn(x, self.w, 1e-5)


def test_a_compiled_program_pickles_as_its_source_and_compiles_again_on_load(tmp_path):
    path = tmp_path / "norm.tdsl"
    path.write_text(RMS)
    x, w = randn(17, 33), randn(33)
    for fn in (tiledsl.compile(RMS), tiledsl.compile(path),
               tiledsl.compile(RMS, pipeline="canonicalize,fuse-rows", allow_tf32=True, check_bounds=True)):
        back = pickle.loads(pickle.dumps(fn))
        assert back is not fn and back.op is fn.op
        assert (back.name, back.pipeline, back.allow_tf32, back.ir()) == (fn.name, fn.pipeline, fn.allow_tf32,
                                                                         fn.ir())
        torch.testing.assert_close(back(x, w, 1e-5), fn(x, w, 1e-5), rtol=0, atol=0)
    from_file = pickle.loads(pickle.dumps(tiledsl.compile(path)))
    path.unlink()  # the text travels in the pickle; the file is not read again
    assert from_file.source_graph.span.source.name == str(path)
    backward = pickle.loads(pickle.dumps(tiledsl.compile(RMS).backward))
    assert backward.name == "rms_boundary_backward" and backward.ir() == tiledsl.compile(RMS).backward.ir()
    model = Holder(tiledsl.compile(RMS))
    saved = tmp_path / "model.pt"
    torch.save(model, saved)
    loaded = torch.load(saved, weights_only=False)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    torch.testing.assert_close(loaded(x).double(), rms64(x, model.w.detach(), 1e-5), rtol=0, atol=1e-5)


# --- binding ------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["jagged", "strided"])
def test_a_nested_tensor_argument_gets_a_located_error_naming_the_parameter(layout):
    fn = tiledsl.compile(RMS)
    nested = torch.nested.nested_tensor([randn(3, 33), randn(4, 33)],
                                        layout=getattr(torch, layout))
    message = (f"argument 'x' is a nested tensor ({layout} layout); tiledsl kernels read dense "
               "tensors of one shape: pad it (torch.nested.to_padded_tensor(x, 0.0)) or call the "
               "program once per component")
    for call in (lambda: fn(nested, randn(33), 1e-5), lambda: fn(w=randn(33), x=nested, eps=1e-5)):
        with pytest.raises(tiledsl.TileDSLError) as err:
            call()
        assert err.value.message == message and (err.value.line, err.value.column) == (1, 21)


# --- memory -------------------------------------------------------------------------------

def test_registrations_of_programs_no_longer_referenced_are_released():
    """300 distinct programs compiled and dropped leave no op behind; a program still
    referenced keeps working, and one compiled again after release registers again."""
    kept = tiledsl.compile(RMS)
    gc.collect()
    before = torch_op.registered()
    names = []
    for i in range(300):
        fn = tiledsl.compile(f"kernel drop{i}(x: f32[N]) -> f32[N] {{ return x * {i}.5 }}", backend="reference")
        names.append(fn.op._opname)
        del fn
    gc.collect()
    assert torch_op.registered() <= before
    assert not any(hasattr(torch.ops.tiledsl, n) for n in names)
    x = randn(17, 33)
    torch.testing.assert_close(kept(x, x[0], 1e-5).double(), rms64(x, x[0], 1e-5), rtol=0, atol=1e-5)
    again = tiledsl.compile("kernel drop7(x: f32[N]) -> f32[N] { return x * 7.5 }", backend="reference")
    assert again.op._opname == names[7]
    y = randn(17)
    torch.testing.assert_close(again.op(y), y * 7.5, rtol=0, atol=0)
    assert set(torch.library.opcheck(again.op, (y.requires_grad_(),)).values()) == {"SUCCESS"}


def test_second_order_backward_of_attention_sinks_compiles():
    """fuse-epilogue once formed a cycle in the backward of gpt-oss sinks' backward (bf16):
    an internal error (NetworkXUnfeasible) at compile time."""
    from pathlib import Path

    fn = tiledsl.compile(Path(__file__).parent.parent / "examples" / "attention_sinks.tdsl")
    second = fn.backward.backward
    assert second.kernels and all(k.source for k in second.kernels)


# --- in-place changes after a call ---------------------------------------------------------


@pytest.mark.parametrize("change", ["relu_", "ReLU(inplace=True)", "+= r"])
def test_an_output_changed_in_place_does_not_break_a_backward_that_does_not_read_it(change):
    """RMSNorm's backward reads x, w and the saved 1/rms, not its output: the output is not
    saved, so changing it in place (as a model's activation or residual does) is allowed,
    as with torch's RMSNorm, and the gradients are torch's."""
    import tiledsl.nn as tnn

    x, r = randn(5, 17), randn(5, 17)

    def run(norm: torch.nn.Module, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        xg = x.to(dtype).clone().requires_grad_()
        h = norm(xg)
        if change == "relu_":
            torch.relu_(h)
        elif change == "ReLU(inplace=True)":
            h = torch.nn.ReLU(inplace=True)(h)
        else:
            h += r.to(h.dtype)
        (h * r.to(h.dtype)).sum().backward()
        return xg.grad, norm.weight.grad

    ours = run(tnn.RMSNorm(17, eps=1e-5))
    golden = run(torch.nn.RMSNorm(17, eps=1e-5).double(), torch.float64)
    eager = run(torch.nn.RMSNorm(17, eps=1e-5))
    for o, g, e in zip(ours, golden, eager, strict=True):
        assert (o.double() - g).abs().max() <= 2 * (e.double() - g).abs().max() + 1e-5


def test_an_input_the_backward_reads_changed_in_place_is_refused_as_torch_refuses_it():
    fn = tiledsl.compile(RMS)
    x, w = randn(4, 9).requires_grad_(), randn(9).requires_grad_()
    x2 = x * 1.0  # not a leaf: it may change in place
    y = fn(x2, w, 1e-5)
    x2.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_an_input_made_under_inference_mode_feeds_a_module_whose_weight_trains():
    """torch's RMSNorm takes such an input (it saves nothing of it); autograd cannot save
    an inference tensor, so the call saves a copy of it: the weight's gradient is torch's."""
    import tiledsl.nn as tnn

    with torch.inference_mode():
        x = randn(6, 17) * 1.5
    ours, golden = tnn.RMSNorm(17, eps=1e-5), torch.nn.RMSNorm(17, eps=1e-5).double()
    g = randn(6, 17)
    (ours(x) * g).sum().backward()
    (golden(x.double()) * g.double()).sum().backward()
    eager = torch.nn.RMSNorm(17, eps=1e-5)
    (eager(x) * g).sum().backward()
    err, yardstick = [(w.grad.double() - golden.weight.grad).abs().max() for w in (ours.weight, eager.weight)]
    assert err <= 2 * yardstick + 1e-5
    fn = tiledsl.compile(RMS)
    w = randn(17).requires_grad_()
    (fn(x, w, 1e-5) * g).sum().backward()
    wd = w.detach().double().requires_grad_()
    (rms64(x, wd, 1e-5) * g.double()).sum().backward()
    torch.testing.assert_close(w.grad.double(), wd.grad, rtol=1e-5, atol=1e-5)


def test_torch_jit_trace_records_the_op_of_a_program_and_of_a_tiledsl_nn_module():
    """Under torch.jit.trace a call goes through the op (the trace records
    `tiledsl::<kernel>_<hash>`, not the kernels' launches; sizes are traced values, which
    the launch planner's generated argument code could not take: a NameError)."""
    import warnings

    import tiledsl.nn as tnn

    fn = tiledsl.compile(RMS)
    x, w = randn(3, 17), randn(17)
    traced = torch.jit.trace(lambda x, w: fn(x, w, 1e-5), (x, w))
    assert f"tiledsl::{fn.op._opname}" in str(traced.graph)
    x2 = randn(5, 17)
    torch.testing.assert_close(traced(x2, w).double(), rms64(x2, w, 1e-5), rtol=1e-5, atol=1e-6)
    norm = tnn.RMSNorm(17, eps=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the module's shape check
        module = torch.jit.trace(norm, (x,))
    torch.testing.assert_close(module(x2), norm(x2), rtol=0, atol=0)
    torch.testing.assert_close(module(x2).double(), rms64(x2, norm.weight.detach(), 1e-5), rtol=1e-5, atol=1e-6)
