"""The kernel that really runs on a GPU, built without one: arguments specialized the way
Triton's launcher specializes them, and `tiledsl ptx` / `aot.inspect_program` reports."""

import json
import re
from pathlib import Path

import pytest
import torch
import triton
from test_cli import cli
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

import tiledsl
from tiledsl.backends.triton import aot
from tiledsl.backends.triton.launch import specialize
from tiledsl.binding import bind

EXAMPLES = Path(__file__).parent.parent / "examples"
ATTENTION_DIMS = {"B": 4, "H": 16, "M": 4096, "N": 4096, "D": 128}
GEMM_DIMS = {"M": 8192, "N": 8192, "K": 4096}


@triton.jit
def _probe(a):
    pass


def _launcher_specialization(value):
    """What Triton's own launcher (JITFunction.run's binder) makes of `value`."""
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(_probe.signature, _probe.params, backend)
    _, specialization, _ = binder(value)
    kind, key = specialization[0][:2]
    return kind, key == "D" if kind != "constexpr" else None


def _values():
    tensors = [torch.empty(64, dtype=dt) for dt in (torch.float16, torch.bfloat16, torch.float32,
                                                     torch.int32, torch.bool, torch.float64, torch.int64)]
    views = [torch.empty(65, dtype=torch.float16)[1:], torch.empty(68, dtype=torch.float32)[2:]]
    ints = [0, 1, -1, 2, 16, -16, 17, 48, 4096, 2**31 - 1, 2**31, -(2**31), 2**40 + 16, 2**63]
    return tensors + views + ints + [True, False, 0.5, 1.0, -3.25]


@pytest.mark.parametrize("value", _values(), ids=lambda v: f"{type(v).__name__}-{getattr(v, 'dtype', v)}")
def test_arguments_are_specialized_like_tritons_launcher(value):
    arg = specialize("a", value)
    assert (arg.type, arg.aligned if arg.type != "constexpr" else None) == _launcher_specialization(value)


def test_launches_at_sees_alignment_unit_strides_and_sizes():
    fn = tiledsl.compile("kernel f(x: f16[M, N]) -> f16[M, N] { return exp(x) * 2 }")
    graph = fn.fused_graph()
    aligned = torch.empty(32, 1024, dtype=torch.float16)
    shifted = torch.empty(32 * 1024 + 1, dtype=torch.float16)[1:].view(32, 1024)
    (a,) = fn.runtime.launches_at(bind(graph, [aligned], {}))
    (b,) = fn.runtime.launches_at(bind(graph, [shifted], {}))
    args_a = {x.name: (x.type, x.aligned) for x in a.arguments}
    args_b = {x.name: (x.type, x.aligned) for x in b.arguments}
    assert args_a == {"in0_ptr": ("*fp16", True), "in0_s0": ("i32", True), "in0_s1": ("constexpr", False),
                      "out0_ptr": ("*fp16", True), "numel": ("i32", True), "d0": ("i32", True),
                      "d1": ("i32", True),  # (M: a tile of rows of the last axis, `TILED`)
                      "WIDE": ("constexpr", False)}  # int32 offsets: the call's tensors fit
    assert args_b == {**args_a, "in0_ptr": ("*fp16", False)}
    # the aligned build vectorizes its loads; the shifted one cannot
    assert "ld.global.v4.b32" in aot.compile_launch(a).asm["ptx"]
    ptx_b = aot.compile_launch(b).asm["ptx"]
    assert "ld.global.b16" in ptx_b and "ld.global.v4" not in ptx_b
    # nothing ran and nothing was recorded as a launch
    assert fn.launches == []


def _report(path, dims, every=False):
    fn = tiledsl.compile((EXAMPLES / path).read_text())
    return aot.inspect_program(fn, dims, every_candidate=every)


def test_attention_example_as_it_runs_on_an_h100():
    (r,) = _report("attention.tdsl", ATTENTION_DIMS)
    assert r.name == "k0" and r.spill_bytes == 0 and 0 < r.registers <= 255
    assert r.config["BLOCK_M"] == 64 and r.config["BLOCK_N"] == 64  # the example's @tile hints
    assert r.config["num_warps"] == 4  # one warpgroup per 64 query rows: m64n64, not m64n32
    assert r.wgmma == ["m64n64k16", "m64n128k16"]  # q @ k.T over 64 keys, p @ v over D=128
    assert r.shared_bytes > 0


def test_paged_decode_example_as_it_runs_on_an_h100():
    dims = {"B": 8, "H": 32, "D": 128, "NB": 4096, "P": 16, "L": 128}
    (r,) = _report("paged_decode.tdsl", dims)
    assert r.name == "k0" and r.spill_bytes == 0 and 0 < r.registers <= 255
    # one query row takes a 16-row tile: mma.sync, not a 64-row wgmma that wastes 63 of its rows
    # and holds a 64 x D accumulator (236 registers when it did)
    assert r.config["BLOCK_M"] == 16 and r.wgmma == [] and r.registers <= 160
    assert r.tma == 0  # k and v are gathered: loaded at the addresses the kernel computes


def test_gemm_example_reports_every_candidate():
    default = _report("gemm_multiply_multiply.tdsl", GEMM_DIMS)
    every = _report("gemm_multiply_multiply.tdsl", GEMM_DIMS, every=True)
    assert len(default) == 1 and len(every) >= 4
    assert every[0] == default[0]  # the launcher starts from the first candidate
    # 128 x 256, its tiles filling an H100 many times over (Triton's tutorial's tile)
    assert default[0].wgmma == ["m64n256k16"]
    assert all(r.spill_bytes == 0 and r.wgmma for r in every)
    # the first two tiles again on a persistent grid: one program per SM (an H100's 132 here)
    assert [r.config for r in every[-2:]] == [{**r.config, "programs": 132} for r in every[:2]]
    assert "programs" not in default[0].config


def test_fp8_gemm_example_uses_fp8_tensor_cores_and_tma():
    (r,) = _report("gemm_fp8_scaled.tdsl", GEMM_DIMS)
    assert r.wgmma == ["m64n256k32"]  # f8 operands as they are: k32 is the f8 wgmma
    assert r.spill_bytes == 0 and r.tma > 0


def test_fp8_gemm_steps_128_of_k_and_every_candidate_fits():
    """(issue 29: at 64 of K a step the fp8 GEMM's loop was issue-bound, its B tile
    transposed through shared memory each step for the K-major fp8 wgmma)"""
    (r,) = _report("gemm_fp8_scaled.tdsl", GEMM_DIMS)
    assert r.config["BLOCK_K"] == 128 and r.loop["modeled"]["bound"] == "tensor", r
    every = _report("gemm_fp8_scaled.tdsl", GEMM_DIMS, every=True)
    assert any(c.config["BLOCK_K"] == 64 for c in every)
    assert all(c.spill_bytes == 0 and c.shared_bytes <= 232448 for c in every), every


def test_ptx_cli_json():
    code, out, _ = cli("ptx", str(EXAMPLES / "gemm_multiply_multiply.tdsl"), "--dims", "M=8192,N=8192,K=4096",
                       "--json")
    assert code == 0
    (kernel,) = json.loads(out)["kernels"]
    assert set(kernel) == {"name", "config", "registers", "spill_bytes", "shared_bytes", "wgmma", "tma", "loop",
                           "function", "grid", "workspace_bytes"}
    assert kernel["config"]["BLOCK_M"] == 128 and kernel["spill_bytes"] == 0
    assert kernel["function"] == "k0_matmul" and kernel["workspace_bytes"] == 0 and len(kernel["grid"]) >= 1


def test_ptx_cli_text_and_errors():
    code, out, _ = cli("ptx", str(EXAMPLES / "rmsnorm.tdsl"), "--dims", "M=4096,N=8192")
    assert code == 0
    assert out.splitlines()[0].startswith("k0: BLOCK_O=")
    assert re.match(r"  registers \d+, spills 0 bytes, shared \d+ bytes, wgmma none, TMA copies 0$",
                    out.splitlines()[1])
    code, _, err = cli("ptx", str(EXAMPLES / "rmsnorm.tdsl"), "--dims", "M=4096")
    assert code == 1 and "give a size for every dim with --dims: missing N" in err
    code, _, err = cli("ptx", str(EXAMPLES / "rmsnorm.tdsl"), "--dims", "M=4,N=8", "--arch", "sm_75")
    assert code == 1 and err.strip() == "error: --arch sm_75: give an NVIDIA architecture sm_80 or newer, e.g. sm_90"


ROW_PROGRAMS = {
    "softmax": "kernel f(x: {dt}[M, N]) -> {dt}[M, N] {{ return softmax(x * 0.5, axis=-1) }}",
    "rmsnorm": """kernel f(x: {dt}[M, N], w: {dt}[N], eps: f32) -> {dt}[M, N] {{
        xf = cast(x, f32)
        return xf * rsqrt(mean(xf * xf, keepdims=true) + eps) * w
    }}""",
    "layernorm": """kernel f(x: {dt}[M, N], w: {dt}[N], b: {dt}[N], eps: f32) -> {dt}[M, N] {{
        mu = mean(x, keepdims=true)
        xc = x - mu
        return xc * rsqrt(mean(xc * xc, keepdims=true) + eps) * w + b
    }}""",
}


@pytest.mark.parametrize("name, dt, n, block_r, one_pass", [
    ("softmax", "f16", 32768, 32768, True), ("softmax", "f32", 16384, 16384, True),
    # an f32 softmax of 32k in one pass (online in f32); an f32 RMSNorm sums in f64: two
    ("softmax", "f32", 32768, 32768, True), ("rmsnorm", "f32", 32768, 16384, False),
    ("rmsnorm", "f16", 32768, 32768, True),
    ("rmsnorm", "bf16", 4096, 4096, True), ("layernorm", "f16", 16384, 16384, True),
    ("layernorm", "f16", 32768, 16384, False), ("layernorm", "f32", 8192, 8192, True),
])
def test_rows_read_once_up_to_the_one_pass_limit_without_spills(name, dt, n, block_r, one_pass):
    fn = tiledsl.compile(ROW_PROGRAMS[name].format(dt=dt))
    (r,) = aot.inspect_program(fn, {"M": 4096, "N": n})
    assert (r.config["BLOCK_R"], r.config["ONE_PASS"]) == (block_r, one_pass)
    assert r.config["num_warps"] == max(4, min(16, block_r // 1024))
    assert r.spill_bytes == 0, r


@pytest.mark.parametrize("m, n, even_o, even_r", [(4096, 16384, True, True), (4096, 16383, True, False),
                                                   (13, 64, False, True), (64, 64, True, True)])
def test_rows_that_fill_their_blocks_are_read_without_masks(m, n, even_o, even_r):
    """A call whose rows fill every program and whose row length is a multiple of the block
    gets constant masks (`EVEN_O`, `EVEN_R`), which Triton folds: the layer norm's loops then
    select nothing (each masked pass selected the identity for the tail before reducing)."""
    fn = tiledsl.compile(ROW_PROGRAMS["layernorm"].format(dt="f16"))
    (r,) = aot.inspect_program(fn, {"M": m, "N": n})
    assert (r.config["EVEN_O"], r.config["EVEN_R"]) == (even_o, even_r)
    (masked,) = aot.inspect_program(fn, {"M": m, "N": n - 1 if even_r else n})
    if even_r:
        assert r.loop["instructions"] < masked.loop["instructions"], (r.loop, masked.loop)
        assert r.spill_bytes == 0


def test_short_rows_share_a_program():
    fn = tiledsl.compile(ROW_PROGRAMS["rmsnorm"].format(dt="f16"))
    (r,) = aot.inspect_program(fn, {"M": 4096, "N": 128})
    assert (r.config["BLOCK_O"], r.config["BLOCK_R"], r.config["num_warps"]) == (32, 128, 4)
    assert r.spill_bytes == 0


def test_short_rows_computing_trig_hold_a_pointwise_tile():
    """QK-norm with RoPE (cos and sin computed in the row program, in f64, whose slow path is
    a call): 8 elements a thread, not 32, which spilled 87 KB a thread across those calls."""
    (r, _) = _report("qk_norm_rope_attention.tdsl", {"B": 2, "S": 2048, "H": 32, "KH": 8, "D": 128})
    assert r.name == "k0"
    assert [r.config[f"M{i}_{k}"] for i in (0, 1) for k in ("BLOCK_O", "BLOCK_R")] == [8, 128, 8, 128]
    assert r.config["num_warps"] == 4 and r.spill_bytes == 0, r


def test_long_rows_computing_trig_are_chunked_at_a_pointwise_tile():
    """The backward of QK-norm with RoPE sums the norm weights' gradients over B * S * H rows
    (a row of 524,288 elements per channel) recomputing the tables' cos and sin: chunks of
    1024 elements, 8 a thread; a 16k chunk spilled 208,852 bytes."""
    fn = tiledsl.compile((EXAMPLES / "qk_norm_rope_attention.tdsl").read_text()).backward
    reports = aot.inspect_program(fn, {"B": 4, "S": 4096, "H": 32, "KH": 8, "D": 128})
    assert [r.spill_bytes for r in reports] == [0] * len(reports)
    long_rows = [r for r in reports if not r.config.get("M0_ONE_PASS", True)]
    assert long_rows and all(r.config["M0_BLOCK_R"] == 1024 for r in long_rows)


# --- TMA: descriptors where the call's tensors allow them, pointers elsewhere ---------------------

GEMM = "kernel f(a: {dt}[M, K], b: {dt}[K, N], d: {dt}[M, N]) -> {dt}[M, N] {{ return (a @ b) * d }}"


def tma_flags(fn, *args):
    (launch,) = fn.runtime.launches_at(bind(fn.fused_graph(), list(args), {}))
    return {a.name: a.value for a in launch.arguments if "_tma" in a.name}, launch


@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_gemm_operands_come_through_tma_when_the_call_allows(dt):
    from helpers import randn, run_checked

    fn = tiledsl.compile(GEMM.format(dt=dt))
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[dt]
    m, n, k = 113, 72, 64
    a, b, d = randn(m, k, dtype=dtype), randn(k, n, dtype=dtype), randn(m, n, dtype=dtype)
    shifted = randn(m * k + 1, dtype=dtype)[1:].view(m, k)  # 2 bytes past an aligned address
    odd_k = randn(m, 33, dtype=dtype), randn(33, n, dtype=dtype)  # a: rows of 66 bytes
    column_major = b.t().contiguous().t()  # last stride K, not 1
    def flags(a_tma, b_tma, b_tma_t=False):
        return {"in0_tma": a_tma, "in0_tma_t": False, "in1_tma": b_tma, "in1_tma_t": b_tma_t}

    cases = {
        "aligned": ((a, b, d), flags(True, True)),
        "shifted a": ((shifted, b, d), flags(False, True)),
        "rows of 66 bytes": ((*odd_k, d), flags(False, True)),
        # read as rows of its transpose, transposed in the kernel
        "column-major b": ((a, column_major, d), flags(True, False, True)),
        "column-major b, shifted a": ((shifted, column_major, d), flags(False, False, True)),
    }
    for name, (args, expected) in cases.items():
        flags, launch = tma_flags(fn, *args)
        assert flags == expected, name
        run_checked(fn, *args, sm90=False)  # the interpreter takes the same path
        ptx = aot.compile_launch(launch).asm["ptx"]
        assert ("cp.async.bulk.tensor" in ptx) == any(expected.values()), name


def test_batched_gemm_operands_come_through_tma():
    from helpers import randn, run_checked

    fn = tiledsl.compile("kernel f(a: bf16[B, M, K], b: bf16[K, N]) -> bf16[B, M, N] { return a @ b }")
    a, b = randn(3, 113, 64, dtype=torch.bfloat16), randn(64, 40, dtype=torch.bfloat16)
    flags, launch = tma_flags(fn, a, b)
    assert flags == {"in0_tma": True, "in0_tma_t": False, "in1_tma": True, "in1_tma_t": False}
    assert "reshape([BLOCK_M, BLOCK_K])" in fn.kernels[0].source  # one batch element per block
    run_checked(fn, a, b, sm90=False)
    assert "cp.async.bulk.tensor" in aot.compile_launch(launch).asm["ptx"]
    every_other = randn(6, 113, 64, dtype=torch.bfloat16)[::2]  # batch stride 2 x 113 x 64
    assert tma_flags(fn, every_other, b)[0]["in0_tma"]
    run_checked(fn, every_other, b, sm90=False)


def test_ptx_counts_tma_copies_of_the_gemm_example():
    fn = tiledsl.compile((EXAMPLES / "gemm_multiply_multiply.tdsl").read_text())
    for r in aot.inspect_program(fn, GEMM_DIMS, every_candidate=True):
        assert r.tma > 0 and r.spill_bytes == 0, r


def test_attention_moves_q_k_v_and_o_through_tma_when_the_call_allows():
    from helpers import randn, run_checked

    fn = tiledsl.compile((EXAMPLES / "attention.tdsl").read_text())
    q, k, v = (randn(2, 3, n, 64, dtype=torch.float16) for n in (77, 130, 130))
    shifted_q = randn(2 * 3 * 77 * 64 + 8, dtype=torch.float16)[8:].view(2, 3, 77, 64)  # 16 bytes in
    odd = [randn(2, 3, n, 59, dtype=torch.float16) for n in (77, 130, 130)]  # rows of 118 bytes
    q_off = randn(2 * 3 * 77 * 64 + 1, dtype=torch.float16)[1:].view(2, 3, 77, 64)  # 2 bytes in
    # k.T of a [.., N, D] tensor: the descriptor over its rows, transposed in the kernel
    contiguous = {"in0_tma": True, "in1_tma": False, "in1_tma_t": True, "in3_tma": True, "out0_tma": True}
    cases = {
        "contiguous": ((q, k, v), contiguous),
        "q 16 bytes in": ((shifted_q, k, v), contiguous),
        "q 2 bytes in": ((q_off, k, v), {**contiguous, "in0_tma": False}),
        "rows of 118 bytes": (tuple(odd), {n: False for n in contiguous}),
    }
    for name, (args, expected) in cases.items():
        flags, launch = tma_flags(fn, *args, 0.125)
        assert flags == expected, name
        run_checked(fn, *args, 0.125, sm90=False)
        ptx = aot.compile_launch(launch).asm["ptx"]
        assert ("cp.async.bulk.tensor" in ptx) == any(expected.values()), name


def test_compile_for_sm90_in_an_interpreting_process_is_an_option_error():
    """TRITON_INTERPRET=1 at Triton's import builds every kernel for the interpreter, which
    triton.compile cannot lower ('InterpretedFunction' has no 'cache_key'): say so."""
    import os
    import subprocess
    import sys

    code = ("import tiledsl\nfrom tiledsl.backends.triton import aot\n"
            "fn = tiledsl.compile('kernel f(x: f16[M, N]) -> f16[M, N] { return exp(x) }')\n"
            "try:\n    aot.inspect_program(fn, {'M': 64, 'N': 64})\n"
            "except tiledsl.TileDSLError as err:\n    print(type(err).__name__, err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.stdout.startswith("OptionError error: cannot compile for a GPU in a process that "
                                 "imported Triton with TRITON_INTERPRET=1 set"), out.stdout + out.stderr


def test_fp8_b_comes_k_major_once():
    """Hopper's fp8 wgmma reads B K-major: the example's b: [K, N] is handed over as a K-major
    copy (`EmittedKernel.k_major`), read through the transposed descriptor, so the loop moves
    no tile through shared memory by hand (68 shared-memory ops a K step when it did). A
    tensor already K-major, or on the CPU (the interpreter), is passed as it is; a GPU
    tensor is copied at every call (a kept copy could go stale: the next test)."""
    from tiledsl.backends.triton.launch import k_major

    fn = tiledsl.compile(EXAMPLES / "gemm_fp8_scaled.tdsl")
    (emitted,) = fn.runtime.emitted
    b = [i for i, inp in enumerate(emitted.kernel.region.inputs) if inp.type.shape[-2:] == ("K", "N")]
    assert emitted.k_major == tuple(b) and len(b) == 1
    (r,) = _report("gemm_fp8_scaled.tdsl", GEMM_DIMS)
    assert r.loop["shared_ops"] == 0 and r.tma > 0, r
    f16 = tiledsl.compile("kernel f(a: f16[M, K], b: f16[K, N]) -> f16[M, N] { return a @ b }")
    assert f16.runtime.emitted[0].k_major == ()

    w = torch.empty(96, 160, dtype=torch.float8_e4m3fn, device="meta")
    copy = k_major(w, -2)
    assert copy.shape == w.shape and copy.stride() == (1, 96)
    assert k_major(copy, -2) is copy
    batched = torch.empty(3, 96, 160, device="meta").transpose(0, 2)  # [160, 96, 3], axis 1 = K
    assert k_major(batched, 1).stride(1) == 1 and k_major(batched, 1).shape == batched.shape
    cpu = torch.randn(96, 160)
    assert k_major(cpu, -2) is cpu


def test_an_fp8_weight_changed_through_its_data_is_never_multiplied_stale(monkeypatch):
    """`w.data.copy_(new)` and `w.data = new` change a weight without changing its id or its
    version: a K-major copy kept between calls by (id, version) multiplied by the old
    weight. Here the CPU takes the GPU's path (b copied K-major) through the interpreter."""
    from tiledsl.backends.triton import launch

    monkeypatch.setattr(launch, "K_MAJOR_DEVICES", ("cpu",))
    fn = tiledsl.compile(EXAMPLES / "gemm_fp8_scaled.tdsl")
    gen = torch.Generator().manual_seed(3)

    def f8(*shape):
        return torch.randn(shape, generator=gen).to(torch.float8_e4m3fn)

    a, rows, cols = f8(17, 48), torch.rand(17, 1, generator=gen), torch.rand(1, 33, generator=gen)
    w = torch.nn.Parameter(f8(48, 33), requires_grad=False)

    def check():
        golden = (a.double() @ w.detach().double()) * rows.double() * cols.double()
        torch.testing.assert_close(fn(a, w, rows, cols).double(), golden.to(torch.bfloat16).double(),
                                   rtol=2 ** -7, atol=1e-5)

    check()
    w.data.copy_(f8(48, 33))
    check()
    w.data = f8(48, 33)
    check()


def test_a_16_bit_tanh_is_one_hardware_op():
    """tanh of a bf16 op (rounded to 8 bits of mantissa, a quarter of tanh.approx.f32's
    error) is the hardware's tanh.approx on a GPU: the soft-capped attention's
    loop takes two MUFU ops a score (the tanh and the exp2; the rescale's exp2 a row more); `s *
    scale / cap` and the softmax's base-2 conversion of `cap * tanh(...)` are one multiply
    each. An f16 op (whose rounding is finer than the approximation) and an f32 op keep the
    exact form; the interpreter computes the exact form too."""
    src = (EXAMPLES / "causal_softcap_attention.tdsl").read_text()
    (r,) = _report("causal_softcap_attention.tdsl", {"B": 4, "H": 16, "M": 4096, "N": 4096, "D": 64})
    loop = r.loop
    per_score = loop["mufu"] * 32 * loop["warps"] / loop["work"]
    # the rescale's exp2 of each row is computed by the 4 lanes of the wgmma layout holding it
    assert per_score == pytest.approx(2 + 4 / r.config["BLOCK_N"]), (per_score, r.config)
    (kernel,) = tiledsl.compile(src).kernels
    assert kernel.source.count("tanh_approx(") == 3  # the helper's definition and two key loops
    assert re.search(r"t = v\d+ \* \(v\d+ \* 1\.4426950408889634\)\n", kernel.source), kernel.source
    for dtype, approx in (("f16", False), ("bf16", True), ("f32", False)):
        fn = tiledsl.compile(f"kernel f(x: {dtype}[N]) -> {dtype}[N] {{ return tanh(x) + gelu(x, approximate=\"tanh\") }}")
        assert ("tanh_approx(" in fn.kernels[0].source) is approx, dtype
