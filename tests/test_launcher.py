"""The Triton backend's launcher and module cache, and hygiene of the generated source."""

import io
import os
import stat
import tokenize

import torch

import tiledsl
from helpers import randn, run_checked
from tiledsl.backends.triton import cache

SRC = "kernel f(x: f32[M, N], y: f32[N]) -> f32[M, N] { return exp(x) * y }"


def cached_files(path):
    return sorted(p.name for p in path.iterdir())


def test_cache_directory_is_private(private_cache):
    fn = tiledsl.compile(SRC)
    fn(randn(3, 5), randn(5))
    assert stat.S_IMODE(os.stat(private_cache).st_mode) == 0o700
    assert all(name.startswith("tdsl_") and name.endswith(".py") for name in cached_files(private_cache))


def test_modules_are_content_addressed_and_keyed_by_versions_and_target(private_cache, monkeypatch):
    fn = tiledsl.compile(SRC)
    fn(randn(3, 5), randn(5))
    first = cached_files(private_cache)
    assert len(first) == len(fn.kernels)
    tiledsl.compile(SRC)(randn(4, 6), randn(6))  # same program, new sizes
    assert cached_files(private_cache) == first
    for e in fn.runtime.emitted:
        key = cache.cache_key(e.source, "interpreter", e.ir())
        assert (private_cache / f"tdsl_{key[:40]}.py").read_text() == e.source
    source = fn.kernels[0].source
    assert cache.cache_key(source, "interpreter") != cache.cache_key(source, "cuda")
    key = cache.cache_key(source, "interpreter")
    monkeypatch.setattr(tiledsl, "__version__", "9.9.9")
    assert cache.cache_key(source, "interpreter") != key


def test_tampered_cache_file_is_rewritten_before_import(private_cache):
    fn = tiledsl.compile(SRC)
    x, y = randn(3, 5), randn(5)
    expected = fn(x, y)
    for name in cached_files(private_cache):
        (private_cache / name).write_text("raise SystemExit('tampered')\n")
    cache.forget_loaded()
    assert torch.equal(tiledsl.compile(SRC)(x, y), expected)
    assert not [n for n in cached_files(private_cache) if n.startswith(".tmp-")]  # atomic writes


def test_changing_a_runtime_dim_does_not_regenerate_kernels(private_cache):
    fn = tiledsl.compile("kernel f(x: f32[M, N]) -> f32[M] { return sum(x * 2, axis=-1) }")
    sources = [k.source for k in fn.kernels]
    run_checked(fn, randn(3, 100), sm90=False)
    files = cached_files(private_cache)
    loaded = cache.loaded()
    run_checked(fn, randn(17, 113), sm90=False)  # BLOCK_R stays 128: nothing new at all
    assert [k.source for k in fn.kernels] == sources
    assert cached_files(private_cache) == files
    assert cache.loaded() == loaded
    # a size that moves a block size only changes launch constants, never the source
    cfg_small = fn.runtime.emitted[0].launch_config({"M": 3, "N": 100}, "cuda")
    cfg_long = fn.runtime.emitted[0].launch_config({"M": 3, "N": 100_000}, "cuda")
    assert cfg_small.constexprs["BLOCK_R"] != cfg_long.constexprs["BLOCK_R"]


def test_generated_source_uses_only_compiler_owned_names(tmp_path):
    path = tmp_path / "evil\nimport os; os.system('echo pwned')\n.tdsl"
    path.write_text("""
    kernel zq_kernel(zq_input: f32[ZQM, ZQN], zq_scale: f32) -> f32[ZQM, ZQN] {
        zq_tmp = zq_input * zq_scale + ZQN
        return softmax(zq_tmp) + sum(zq_tmp, keepdims=true)
    }""")
    fn = tiledsl.compile(path)
    for k in fn.kernels:
        compile(k.source, "<generated>", "exec")  # still valid Python
        tokens = list(tokenize.generate_tokens(io.StringIO(k.source).readline))
        code = [t.string for t in tokens if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE)]
        assert not [t for t in code if "zq" in t.lower() or "pwned" in t or "evil" in t], k.source
        comments = [t.string for t in tokens if t.type == tokenize.COMMENT]
        assert any("evil\\nimport os" in c for c in comments)  # escaped, still one comment line
        assert not any(line.startswith("import os") for line in k.source.splitlines())
    run_checked(fn, randn(3, 7), 0.5)


def test_interpreted_runs_leave_triton_unpatched():
    import triton.language as tl
    from triton.runtime.jit import JITFunction
    before = (JITFunction.__call__, tl.core.reduce, tl.reduce)
    tiledsl.compile("kernel f(x: f32[M, N]) -> f32[M] { return max(x) + sum(x) }")(randn(3, 9))
    assert (JITFunction.__call__, tl.core.reduce, tl.reduce) == before


def test_outputs_are_fresh_contiguous_tensors():
    fn = tiledsl.compile("kernel f(x: f32[M, N]) -> (f32[M, N], f32[N, M]) { return x, x.T }")
    x = randn(3, 5)
    a, b = fn(x)
    assert a.data_ptr() != x.data_ptr() and torch.equal(a, x)
    assert b.is_contiguous() and torch.equal(b, x.T)


def test_rows_whose_dims_collapse_are_one_stride_apart():
    """A row program over several row dims (the attention backward's rowsum(dO * O) over B,
    H, M) addresses a tensor whose row dims collapse as the flat row index times one stride
    (`RowsFlat`, per call), not through an int32 division of the row index a dim; a tensor
    laid out otherwise (H and M swapped in memory) takes the dims' indices. Both are right."""
    from tiledsl.backends.triton.aot import meta_launches
    from tiledsl.binding import BoundCall

    fn = tiledsl.compile("kernel f(x: f16[B, H, M, D], y: f16[B, H, M, D]) -> f32[B, H, M, 1] "
                         "{ return sum(cast(x, f32) * cast(y, f32), axis=-1, keepdims=true) }")
    x = randn(2, 3, 17, 24, dtype=torch.float16, seed=1)
    swapped = randn(2, 17, 3, 24, dtype=torch.float16, seed=2).transpose(1, 2)
    dims = {"B": 2, "H": 3, "M": 17, "D": 24}

    def flags(y):
        (launch,) = fn.runtime.launches_at(BoundCall([x, y], dims, torch.device("cpu")))
        return {a.name: a.value for a in launch.arguments if a.name.endswith("_flat")}

    assert flags(x.clone()) == {"in0_flat": True, "in1_flat": True, "out0_flat": True}
    assert flags(swapped) == {"in0_flat": True, "in1_flat": False, "out0_flat": True}
    for y in (x.flip(0), swapped):
        run_checked(fn, x, y, sm90=False)
    (launch,) = meta_launches(fn, dims)
    assert "(o[:, None] * in0_s2 if in0_flat else " in launch.kernel.source
