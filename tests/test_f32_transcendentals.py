"""exp, exp2, sin and cos of an f32 op without libdevice's f64 forms (`HELPERS["exp"]`,
`HELPERS["trig"]`). exp: Cody-Waite reduction, a Taylor tail and one rounding in f32
arithmetic, within the oracle (2 x torch's f32 error + 1e-5) across the whole f32 range,
special values as torch's, no f64 instruction in the sm_90 build (the f64 form it replaces
ran hundreds of instructions an element in software). sin and cos: the reduction by pi/2 in
f64 hardware arithmetic, the polynomials in f32, no libdevice call."""

from __future__ import annotations

import math
import re

import pytest
import torch

import tiledsl
from helpers import compile_for_sm90, gen
from tiledsl import testing

PROGRAM = "kernel f(x: f32[N]) -> (f32[N], f32[N]) { return exp(x), exp2(x) }"


def arguments() -> torch.Tensor:
    """Every part of the range: underflow to 0 and subnormals, around 0, up to overflow, the
    reduction's boundaries (n ln2 +- ln2 / 2), and the special values."""
    ln2 = math.log(2.0)
    edges = torch.tensor([k * ln2 + d for k in range(-150, 130, 7) for d in (-ln2 / 2, -1e-7, 0.0, 1e-7, ln2 / 2)])
    special = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 88.72, 88.73, 127.99, 128.0,
                            -87.3, -103.9, -104.0, -149.0, -150.0, -151.0, 1e-30, -1e-30])
    return torch.cat([torch.linspace(-160.0, 130.0, 20011), torch.randn(4001, generator=gen(5)) * 4.0,
                      edges, special]).float()


def ulps(value: torch.Tensor, golden: torch.Tensor) -> torch.Tensor:
    """|value - golden| in units of the f32 spacing at golden (finite, normal goldens)."""
    g32 = golden.float()
    spacing = (torch.nextafter(g32, torch.tensor(math.inf)) - g32).double()
    return (value.double() - golden).abs() / spacing


def test_exp_and_exp2_meet_the_oracle_and_stay_within_an_ulp():
    fn = tiledsl.compile(PROGRAM)
    x = arguments()
    report = testing.check(fn, x)
    assert report.ok, report
    for got, golden in zip(fn(x), (torch.exp(x.double()), torch.exp2(x.double())), strict=True):
        normal = torch.isfinite(golden) & (golden >= torch.finfo(torch.float32).tiny) \
            & (golden <= torch.finfo(torch.float32).max)
        assert ulps(got, golden)[normal].max().item() < 1.0


@pytest.mark.parametrize("op", ["exp", "exp2"])
def test_special_values_and_the_ends_of_the_range_are_torchs(op):
    x = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 88.73, 89.0, 128.0, 129.0, 1e30,
                      -104.0, -150.0, -152.0, -1e30], dtype=torch.float32)
    fn = tiledsl.compile(f"kernel f(x: f32[N]) -> f32[N] {{ return {op}(x) }}")
    got, want = fn(x), getattr(torch, op)(x)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    # inf, 0 and the largest finite values exactly; the subnormal 2^-150 rounds as torch's
    assert torch.equal(got[finite], want[finite]), (got, want)


def test_the_sm90_build_computes_exp_without_f64():
    fn = tiledsl.compile("kernel f(x: f32[N]) -> f32[N] { return exp(x) * exp2(x * 0.5) }")
    fn(torch.randn(100, generator=gen(0)))
    ((_, compiled),) = compile_for_sm90(fn)
    ptx = compiled.asm["ptx"]
    assert ".f64" not in ptx
    assert "fma.rn.f32" in ptx


TRIG = "kernel f(x: f32[N]) -> (f32[N], f32[N]) { return sin(x), cos(x) }"


def test_sin_and_cos_meet_the_oracle_far_from_zero_and_at_the_quadrants():
    """Arguments to a billion (a RoPE angle at position 10^6 is about that), the quadrant
    boundaries, signed zeros; inf and NaN give NaN."""
    fn = tiledsl.compile(TRIG)
    quarter = math.pi / 4
    x = torch.cat([torch.linspace(-200.0, 200.0, 20011), torch.randn(4001, generator=gen(7)) * 1e4,
                   torch.tensor([k * quarter + d for k in range(-16, 17) for d in (-1e-6, 0.0, 1e-6)]),
                   torch.tensor([1e6, -3e7, 1e9, 0.0, -0.0, math.inf, -math.inf, math.nan])]).float()
    report = testing.check(fn, x)
    assert report.ok, report
    for got, golden in zip(fn(x), (torch.sin(x.double()), torch.cos(x.double())), strict=True):
        finite = torch.isfinite(golden)
        assert (got.double() - golden)[finite].abs().max().item() < 2e-7
        assert torch.equal(got.isnan(), golden.isnan())


def test_the_sm90_build_calls_no_libdevice_trig():
    fn = tiledsl.compile(TRIG)
    fn(torch.randn(100, generator=gen(1)))
    ((_, compiled),) = compile_for_sm90(fn)
    ptx = compiled.asm["ptx"]
    assert "__nv_sin" not in ptx and "__nv_cos" not in ptx
    assert re.search(r"^\s*call", ptx, re.MULTILINE) is None  # (no slow-path call)
