"""Session fixtures: tiny random HF models built once per test run."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYTHONHASHSEED", "0")
torch.set_num_threads(int(os.environ.get("ASCENT_TEST_THREADS", "2")))

from tests.fixtures.tiny_models import build_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return str(build_model("llama", tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    return str(build_model("qwen3", tmp_path_factory.mktemp("tiny_qwen3"), seed=1))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    return str(build_model("qwen2", tmp_path_factory.mktemp("tiny_qwen2"), seed=2))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ASCENT_RUN_SLOW") == "1":
        return
    skip_slow = pytest.mark.skip(reason="slow suite: set ASCENT_RUN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


@pytest.fixture(scope="module", autouse=True)
def _restore_hardware_profile():
    """Engines set the process-wide hardware profile at start; restore it after each test module so a module that
    ran a 310p / a5 engine does not change what later modules' directly built layers see."""
    from ascent.platform.device_config import set_current_profile

    previous = set_current_profile(None)
    set_current_profile(previous)
    yield
    set_current_profile(previous)
