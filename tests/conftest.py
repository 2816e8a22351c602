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


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
