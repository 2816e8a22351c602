"""The static profile of each kernel's hottest loop (`tiledsl ptx`, issue 29): counts read
from the SASS of the sm_90 build, checked against what the configuration implies, never
against numbers copied from a build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tiledsl
from tiledsl.backends.triton import aot, loop_profile

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
GEMM = (EXAMPLES / "matmul_bias_relu.tdsl", {"M": 8192, "N": 8192, "K": 4096})
ATTENTION = (EXAMPLES / "attention.tdsl", {"B": 4, "H": 16, "M": 4096, "N": 4096, "D": 128})


def report(example):
    path, dims = example
    (r,) = aot.inspect_program(tiledsl.compile(path), dims)
    return r


def test_a_gemm_loop_issues_one_wgmma_per_k16_step_of_its_warpgroup_tile():
    r = report(GEMM)
    cfg, loop = r.config, r.loop
    groups = cfg["num_warps"] // 4  # warpgroups, each owning BLOCK_M / groups rows
    n = cfg["BLOCK_N"]
    shape = f"{cfg['BLOCK_M'] // groups}x{n}x16" if cfg["BLOCK_M"] // groups == 64 else None
    assert loop["source"] == "sass" and loop["mma"] == {shape: cfg["BLOCK_K"] // 16}, (cfg, loop)
    assert (loop["work"], loop["work_unit"]) == (cfg["BLOCK_M"] * n * cfg["BLOCK_K"], "mac")
    # tensor cycles: each warpgroup's multiply-adds at the f16 rate
    macs = groups * loop["mma"][shape] * 64 * n * 16
    assert loop["modeled"]["tensor"] == pytest.approx(macs / loop_profile.MAC_RATE["f16"], abs=0.1)
    assert loop["modeled"]["issue"] == pytest.approx(loop["instructions"] * cfg["num_warps"] / 4, abs=0.1)
    assert loop["modeled"]["bound"] == "tensor"


def test_an_attention_loop_runs_both_dots_of_a_key_block_and_an_exp_per_score():
    r = report(ATTENTION)
    cfg, loop = r.config, r.loop
    m, n, d = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_D"]
    per_group = m // (cfg["num_warps"] // 4)
    assert per_group == 64, cfg
    qk, pv = f"64x{n}x16", f"64x{cfg['BLOCK_DV']}x16"
    want = {qk: d // 16, pv: n // 16} if qk != pv else {qk: d // 16 + n // 16}
    assert loop["mma"] == want, (cfg, loop)
    assert (loop["work"], loop["work_unit"]) == (m * n, "score")
    assert loop["mufu"] >= m * n // (cfg["num_warps"] * 32)  # an exp2 per score, a thread's share


def test_the_ptx_fallback_counts_the_same_matrix_instructions(monkeypatch):
    """Without a cuobjdump the profile reads the PTX: the same wgmma per iteration."""
    sass = report(GEMM).loop
    monkeypatch.setattr(loop_profile, "cuobjdump", lambda: None)
    ptx = report(GEMM).loop
    assert ptx["source"] == "ptx" and ptx["mma"] == sass["mma"], (ptx, sass)


def test_a_row_program_profiles_its_chunk_loop():
    (r,) = aot.inspect_program(tiledsl.compile(EXAMPLES / "selective_scan.tdsl"), {"B": 4, "L": 2048, "D": 1536})
    assert r.config["ONE_PASS"] is False
    assert (r.loop["work"], r.loop["work_unit"]) == (r.config["BLOCK_O"] * r.config["BLOCK_R"], "element")
    assert r.loop["mma"] == {} and r.loop["instructions"] > 0 and r.loop["warps"] == r.config["num_warps"]


def test_a_long_row_profiles_every_pass_over_it():
    """A row read in two passes (the online softmax's statistics, then its output) costs an
    element both: the profile's loop is every pass's, its memory the bytes of x and the bias
    read twice and the output written once, per block of the row. (It took the longest pass
    alone, so a one-pass kernel compared with a three-pass one looked three times worse.)"""
    fn = tiledsl.compile("kernel f(x: f32[M, N], b: f32[M, N]) -> f32[M, N] { return softmax(x + b, axis=-1) }")
    (r,) = aot.inspect_program(fn, {"M": 4096, "N": 32768})
    assert r.config["ONE_PASS"] is False and r.spill_bytes == 0, r.config
    moved = r.loop["modeled"]["memory"] * loop_profile.HBM_BYTES_PER_CLOCK
    block = r.config["BLOCK_O"] * r.config["BLOCK_R"] * 4
    assert moved == pytest.approx(5 * block, rel=1e-3), (moved, r.config)
    # one pass holds a row where it fits: an f32 softmax of 32k elements (no spills)
    (one,) = aot.inspect_program(tiledsl.compile(EXAMPLES / "softmax.tdsl"), {"M": 4096, "N": 32768})
    assert one.config["ONE_PASS"] is True and one.spill_bytes == 0, one.config


def test_ptx_dump_writes_each_kernels_compiled_forms_and_report(tmp_path):
    out = tmp_path / "dump"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tiledsl.cli", "ptx", str(GEMM[0]), "--dims",
                             "M=8192,N=8192,K=4096", "--json", "--dump", str(out)],
                            capture_output=True, text=True, env=env, check=True)
    (kernel,) = json.loads(result.stdout)["kernels"]
    assert sorted(p.name for p in out.iterdir()) == ["k0.cubin", "k0.json", "k0.ptx", "k0.ttgir"]
    assert json.loads((out / "k0.json").read_text()) == kernel
    assert set(kernel["loop"]) == {"source", "instructions", "mufu", "mma", "barriers", "shared_ops",
                                   "warps", "work", "work_unit", "modeled"}
    assert "triton_gpu" in (out / "k0.ttgir").read_text() or "ttg." in (out / "k0.ttgir").read_text()
    assert (out / "k0.cubin").read_bytes()[:4] == b"\x7fELF"
