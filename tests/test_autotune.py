"""The GPU autotuner's choice and caching (the CUDA-event timing itself needs a GPU)."""

import json

import torch

import tiledsl
from helpers import randn
from tiledsl.backends.triton import autotune


def emitted_gemm():
    fn = tiledsl.compile("kernel f(x: f16[M, K], w: f16[N, K], b: f16[N]) -> f16[M, N] { return gelu(x @ w.T + b) }")
    fn(randn(512, 256, dtype=torch.float16), randn(384, 256, dtype=torch.float16), randn(384, dtype=torch.float16))
    (launch,) = fn.launches
    return launch.kernel, dict(launch.dims)


def test_choose_times_once_then_remembers(monkeypatch, tmp_path):
    monkeypatch.setenv("TILEDSL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_key", lambda emitted, dims: f"kernel|{sorted(dims.items())}|test-gpu")
    monkeypatch.setattr(autotune, "_chosen", {})
    emitted, dims = emitted_gemm()
    candidates = emitted.launch_candidates(dims, "cuda")
    assert [(c.constexprs["BLOCK_M"], c.constexprs["BLOCK_N"], c.num_warps) for c in candidates][:2] == \
        [(128, 128, 8), (128, 128, 8)]
    timed = []

    def fake_time(cands, launch):
        timed.append(len(cands))
        return cands[2]

    monkeypatch.setattr(autotune, "_time", fake_time)
    first = autotune.choose(emitted, dims, candidates, launch=lambda cfg: None)
    again = autotune.choose(emitted, dims, candidates, launch=lambda cfg: None)
    assert first is candidates[2] and again is candidates[2] and timed == [len(candidates)]
    saved = json.loads((tmp_path / "autotune.json").read_text())
    assert list(saved.values()) == [autotune.describe(candidates[2])]
    monkeypatch.setattr(autotune, "_chosen", {})  # a new process: read back from disk
    assert autotune.choose(emitted, dims, candidates, launch=lambda cfg: None) is candidates[2]
    assert timed == [len(candidates)]


def test_user_tile_hints_turn_autotuning_off():
    fn = tiledsl.compile("@tile(BLOCK_M=64, BLOCK_N=64)\nkernel f(a: f16[M, K], b: f16[K, N]) -> f16[M, N] { return a @ b }")
    fn(randn(512, 256, dtype=torch.float16), randn(256, 512, dtype=torch.float16))
    (launch,) = fn.launches
    assert launch.kernel.launch_candidates(dict(launch.dims), "cuda") == []
    cfg = launch.kernel.launch_config(dict(launch.dims), "cuda")
    assert (cfg.constexprs["BLOCK_M"], cfg.constexprs["BLOCK_N"]) == (64, 64)
