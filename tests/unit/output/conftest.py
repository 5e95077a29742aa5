"""Fixtures for output-processing tests: the tiny byte-level BPE tokenizer, loaded through transformers."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.fixtures.tiny_models import build_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("output_tokenizer")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))
