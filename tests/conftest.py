"""Test-suite setup: IR verification after every pass, a private kernel cache per session."""

import os

import pytest

os.environ.setdefault("TILEDSL_VERIFY", "1")
# Triton 3.9 warns on every compile until this default is chosen explicitly.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


@pytest.fixture(scope="session", autouse=True)
def _private_kernel_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiledsl-cache")
    os.environ["TILEDSL_CACHE_DIR"] = str(path)
    yield path


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A kernel cache of the test's own (its path), with no kernel loaded before or after."""
    from tiledsl.backends.triton import cache

    path = tmp_path / "cache"
    monkeypatch.setenv("TILEDSL_CACHE_DIR", str(path))
    cache.forget_loaded()
    yield path
    cache.forget_loaded()


@pytest.fixture(autouse=True)
def _inputs_depend_on_the_test_not_the_run_order(request):
    """helpers.randn() draws from a generator seeded by the test's id, so a test sees the
    same inputs whatever ran before it (and on whichever xdist worker)."""
    import zlib

    import helpers

    helpers._GEN.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def pytest_collection_modifyitems(config, items):
    """`gpu` tests are skipped without a CUDA device; `slow` ones unless `-m` asks for them
    (`-m slow`), so the default suite stays short."""
    import torch

    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA GPU")
    if "slow" not in (config.option.markexpr or ""):
        skips["slow"] = pytest.mark.skip(reason="a larger sweep: run with -m slow")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)
