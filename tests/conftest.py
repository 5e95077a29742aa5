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


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ASCENT_RUN_SLOW") == "1":
        return
    skip_slow = pytest.mark.skip(reason="slow suite: set ASCENT_RUN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
