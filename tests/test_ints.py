"""Small integers and bits: i8, u8 and i16 values, hex literals, `& | ^ ~ << >>`, the i8
GEMM (i32 results) and the int4 dequantizing GEMM, against torch."""

from pathlib import Path

import pytest
import torch

import tiledsl
from helpers import SIZES, gen, randn, run_checked
from tiledsl import parser
from tiledsl.backends.triton import aot
from tiledsl.diagnostics import TileDSLError

EXAMPLES = Path(__file__).parent.parent / "examples"
TORCH = {"i8": torch.int8, "u8": torch.uint8, "i16": torch.int16, "i32": torch.int32}
WIDTH = {"i8": 8, "u8": 8, "i16": 16}


def full_range(dt: str, n: int, seed: int) -> torch.Tensor:
    """Random values over the whole range of `dt` (never all zeros)."""
    info = torch.iinfo(TORCH[dt])
    return torch.randint(info.min, info.max + 1, (n,), generator=gen(seed), dtype=torch.int64).to(TORCH[dt])


def exact(fn, args, expected):
    """The compiled outputs equal torch's, dtype and value, and the oracle holds."""
    _, outs = run_checked(fn, *args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    for out, want in zip(outs, expected, strict=True):
        assert out.dtype is want.dtype and torch.equal(out, want), (out, want)


# --- literals ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [("0xF", 15), ("0xff", 255), ("0XFF", 255), ("0x0", 0),
                                         ("0x7fffffff", 2**31 - 1), ("017", 17)])
def test_hex_literals_parse(text, value):
    program = parser.parse(f"kernel f(x: i32[N]) -> i32[N] {{ return x & {text} }}")
    assert program.kernels[0].body[-1].values[0].rhs.value == value


def test_a_hex_literal_past_i32_is_refused():
    with pytest.raises(TileDSLError) as err:
        tiledsl.compile("kernel f(x: i32[N]) -> i32[N] { return x & 0x80000000 }")
    assert str(err.value).splitlines()[0] == (
        "<string>:1:44: error: integer literal 2147483648 must be at most 2147483647 (it must fit in i32)")


# --- bitwise operators -------------------------------------------------------------------

BITS = """
kernel f(a: {dt}[N], b: {dt}[N], s: {dt}[N]) -> ({dt}[N], {dt}[N], {dt}[N], {dt}[N], {dt}[N], {dt}[N], {dt}[N]) {{
    return a & b, a | b, a ^ b, ~a, a << s, a >> s, (a >> 3) & 0xF
}}"""


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dt", ["i8", "u8", "i16"])
def test_bitwise_operators_match_torch(dt, n):
    a, b = full_range(dt, n, 1), full_range(dt, n, 2)
    # every shift 0 .. width - 1 (a shift by the width or more is undefined on a GPU)
    s = (torch.arange(n) % WIDTH[dt]).to(TORCH[dt])
    expected = (a & b, a | b, a ^ b, ~a, a << s, a >> s, (a >> 3) & 0xF)
    exact(tiledsl.compile(BITS.format(dt=dt)), (a, b, s), expected)


def test_right_shift_is_arithmetic_on_signed_and_logical_on_u8():
    src = "kernel f(a: i8[N], b: u8[N]) -> (i8[N], u8[N]) { return a >> 1, b >> 1 }"
    a = torch.tensor([-128, -1, -3, 127], dtype=torch.int8)
    b = torch.tensor([255, 128, 3, 127], dtype=torch.uint8)
    fn = tiledsl.compile(src)
    ra, rb = fn(a, b)
    assert ra.tolist() == [-64, -1, -2, 63] and rb.tolist() == [127, 64, 1, 63]


def test_bitwise_ops_promote_like_torch():
    src = """
    kernel f(a: i8[N], b: u8[N], c: i16[N], d: i32[N]) -> (i16[N], i16[N], i32[N], u8[N], i8[N]) {
        return a ^ b, b | c, c & d, b << 1, a ^ 0xFF
    }"""
    a, b, c = full_range("i8", 113, 3), full_range("u8", 113, 4), full_range("i16", 113, 5)
    d = torch.randint(-2**31, 2**31, (113,), generator=gen(6), dtype=torch.int64).to(torch.int32)
    exact(tiledsl.compile(src), (a, b, c, d), (a ^ b, b | c, c & d, b << 1, a ^ 0xFF))


def test_xor_and_not_of_bools():
    src = "kernel f(x: f32[N], y: f32[N]) -> (bool[N], bool[N]) { return (x > 0) ^ (y > 0), ~(x > y) }"
    x, y = randn(113, seed=7), randn(113, seed=8)
    exact(tiledsl.compile(src), (x, y), ((x > 0) ^ (y > 0), ~(x > y)))


# --- arithmetic and casts in the narrow types -----------------------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dt", ["i8", "u8", "i16"])
def test_narrow_arithmetic_wraps_like_torch(dt, n):
    src = f"""
    kernel f(a: {dt}[N], b: {dt}[N]) -> ({dt}[N], {dt}[N], bool[N], {dt}[N], {dt}[N], {dt}[N]) {{
        return a + b, a * b - 3, a + b > 7, a // 7, a % 7, a * 300
    }}"""
    a, b = full_range(dt, n, 9), full_range(dt, n, 10)
    expected = (a + b, a * b - 3, a + b > 7, a // 7, a % 7, a * 300)
    exact(tiledsl.compile(src), (a, b), expected)


def test_casts_truncate_toward_zero_and_wrap_between_integers():
    src = """
    kernel f(x: f32[N], c: i16[N]) -> (i8[N], u8[N], i16[N], i8[N], f16[N]) {
        return cast(x, i8), cast(abs(x), u8), cast(x * 100.0, i16), cast(c, i8), cast(c, f16)
    }"""
    x = randn(113, seed=11, scale=40).clamp(-127, 127)  # in range: out of range is undefined in torch
    c = full_range("i16", 113, 12)
    expected = (x.to(torch.int8), x.abs().to(torch.uint8), (x * 100).to(torch.int16), c.to(torch.int8),
                c.to(torch.float16))
    exact(tiledsl.compile(src), (x, c), expected)


def test_narrow_scalar_parameters():
    src = "kernel f(a: u8[N], s: u8, t: i8) -> (u8[N], u8[N]) { return a >> s, a ^ t }"
    a = full_range("u8", 113, 13)
    exact(tiledsl.compile(src), (a, 3, -5), (a >> 3, a ^ torch.tensor(-5, dtype=torch.int8)))


# --- misuse --------------------------------------------------------------------------------

K = "kernel f(x: f32[N], i: i32[N], q: i8[N, N], h: f16[N, N]) -> f32[N] {\n    return %s\n}"


@pytest.mark.parametrize("body, message", [
    ("x & i", "<string>:2:12: error: '&' needs bool or integer operands, got f32; compare first, e.g. (x > 0)"),
    ("x ^ 2", "<string>:2:12: error: '^' needs bool or integer operands, got f32; write x ** y for a power"),
    ("x << 2", "<string>:2:12: error: '<<' shifts integers, got f32"),
    ("i >> x", "<string>:2:12: error: '>>' shifts integers, got f32"),
    ("cast(i > 0, i32) << (x > 0)", "<string>:2:12: error: '<<' shifts integers, got bool"),
    ("sum(q @ h, 0)", "<string>:2:16: error: an i8 matmul needs both operands in i8, got i8 @ f16; "
                      "cast the f16 operand"),
    ("sum(cast(q, i32) @ cast(q, i32), 0)",
     "<string>:2:16: error: matmul needs floating-point or i8 operands, got i32"),
])
def test_misuse_is_refused_exactly(body, message):
    with pytest.raises(TileDSLError) as err:
        tiledsl.compile(K % body)
    assert str(err.value).splitlines()[0] == message


# --- the i8 GEMM -----------------------------------------------------------------------------

@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (17, 113, 33), (113, 64, 17)])
def test_int8_gemm_example(m, k, n):
    """SmoothQuant's W8A8 linear: i8 products summed in i32, the row and column scales in the
    epilogue, one kernel."""
    fn = tiledsl.compile(EXAMPLES / "int8_gemm.tdsl")
    assert [(kn.template, [op.kind for op in kn.ops]) for kn in fn.kernels] == \
        [("matmul", ["matmul", "mul", "mul", "cast"])]
    xq = torch.randint(-128, 128, (m, k), generator=gen(14), dtype=torch.int8)
    wq = torch.randint(-128, 128, (k, n), generator=gen(15), dtype=torch.int8)
    sx, sw = torch.rand(m, 1, generator=gen(16)) * 1e-2, torch.rand(n, generator=gen(17)) * 1e-2
    _, out = run_checked(fn, xq, wq, sx, sw)
    assert out.dtype is torch.float16


@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (17, 113, 33), (113, 256, 17)])
def test_int8_matmul_is_exact_in_i32(m, k, n):
    """The i32 result is exact (torch._int_mm's): 128 * 128 * 256 stays inside i32."""
    xq = torch.randint(-128, 128, (m, k), generator=gen(18), dtype=torch.int8)
    wq = torch.randint(-128, 128, (k, n), generator=gen(19), dtype=torch.int8)
    fn = tiledsl.compile("kernel f(a: i8[M, K], b: i8[K, N]) -> i32[M, N] { return a @ b }")
    exact(fn, (xq, wq), ((xq.long() @ wq.long()).int(),))


def test_int8_gemm_runs_on_integer_wgmma_on_sm90_without_spills():
    fn = tiledsl.compile(EXAMPLES / "int8_gemm.tdsl")
    (r,) = aot.inspect_program(fn, {"M": 4096, "N": 4096, "K": 4096})
    assert r.spill_bytes == 0 and r.wgmma == ["m64n128k32"], r
    from tiledsl.backends.triton.aot import compile_launch

    xq = torch.randint(-128, 128, (256, 512), generator=gen(20), dtype=torch.int8)
    wq = torch.randint(-128, 128, (512, 256), generator=gen(21), dtype=torch.int8)
    fn(xq, wq, torch.rand(256, 1) * 1e-2, torch.rand(256) * 1e-2)
    (launch,) = fn.launches
    assert "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8" in compile_launch(launch).asm["ptx"]


# --- the int4 dequantizing GEMM (GPTQ's layout) ----------------------------------------------

def gptq_weight(wq: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The f16 weight wq packs, in float64: nibble k % 8 of wq[k // 8], less its group's zero
    point, times its scale (groups of 128 rows)."""
    k, n = torch.arange(wq.shape[0] * 8)[:, None], torch.arange(wq.shape[1])[None, :]
    q = (wq.long()[k // 8, n] >> (4 * (k % 8))) & 0xF
    return (q.double() - zeros.double()[k // 128, n]) * scales.double()[k // 128, n]


@pytest.mark.parametrize("m, k, n", [(1, 128, 1), (17, 256, 33), (113, 384, 17)])
def test_gptq_int4_gemm(m, k, n):
    """The weight is unpacked, shifted by its zero point and scaled as each B tile is loaded
    (fuse-epilogue's gathered prologue): one kernel, the f16 weight never stored."""
    fn = tiledsl.compile(EXAMPLES / "gptq_int4_gemm.tdsl")
    assert [kn.template for kn in fn.kernels] == ["matmul"]
    x = randn(m, k, dtype=torch.float16, seed=22)
    wq = torch.randint(-2**31, 2**31, (k // 8, n), generator=gen(23), dtype=torch.int64).to(torch.int32)
    zeros = torch.randint(0, 16, (k // 128, n), generator=gen(24)).half()
    scales = (torch.rand(k // 128, n, generator=gen(25)) * 0.02).half()
    _, out = run_checked(fn, x, wq, zeros, scales)
    want = x.double() @ gptq_weight(wq, zeros, scales)
    assert (out.double() - want).abs().max() < 1e-2 * want.abs().max()


@pytest.mark.parametrize("m, wgmma", [(16, []), (4096, ["m64n128k16"])])
def test_gptq_int4_gemm_compiles_for_sm90_without_spills(m, wgmma):
    """A decode's 16 rows and a prefill's 4096, at LLaMA-7B's 4096 x 4096 projection (the
    decode's 64 tiles split K: its combine launch too)."""
    fn = tiledsl.compile(EXAMPLES / "gptq_int4_gemm.tdsl")
    r, *combine = aot.inspect_program(fn, {"M": m, "K": 4096, "N": 4096, "KP": 512, "G": 32})
    assert r.spill_bytes == 0 and r.wgmma == wgmma, r
    assert [c.function for c in combine] == (["k0_combine"] if m == 16 else [])
    assert all(c.spill_bytes == 0 for c in combine), combine


@pytest.mark.parametrize("src", [
    "kernel f(x: f16[M, K], w: i8[N, K], scales: f16[N]) -> f16[M, N] { return (x @ cast(w, f16).T) * scales }",
    """kernel f(x: f16[M, K], packed: u8[KP, N], code: f16[16], absmax: f16[G, N]) -> f16[M, N] {
        k = index(x[0][:, None], 0)
        n = index(packed[0][None, :], 1)
        return x @ (code[(packed[k // 2, n] >> (4 * (k % 2))) & 0xF] * absmax[k // 64, n])
    }""",
], ids=["int8-weight-only", "nf4"])
def test_weight_only_quantized_linears_are_one_gemm_without_spills(src):
    """gpt-fast's int8 weight-only linear and an NF4 weight read through its code table: the
    dequantization is B's prologue, one GEMM kernel, built for sm_90 without spills."""
    fn = tiledsl.compile(src)
    assert [k.template for k in fn.kernels] == ["matmul"]
    (r,) = aot.inspect_program(fn, {"M": 4096, "K": 4096, "N": 4096, "KP": 2048, "G": 64})
    assert r.spill_bytes == 0 and r.wgmma, r


@pytest.mark.parametrize("k, n", [(2, 1), (18, 17), (226, 113)])
def test_u8_two_nibble_unpack(k, n):
    src = """
    kernel f(w: f32[K, N], wq: u8[KP, N]) -> i32[K, N] {
        r = index(w, 0)
        return (wq[r // 2, index(w, 1)] >> (4 * (r % 2))) & 0xF
    }"""
    wq = full_range("u8", k // 2 * n, 26).reshape(k // 2, n)
    want = torch.stack([wq & 0xF, wq >> 4], dim=1).reshape(k, n).int()
    exact(tiledsl.compile(src), (randn(k, n, seed=27), wq), (want,))
