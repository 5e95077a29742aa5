"""SpeculativeConfig (vLLM's --speculative-config keys and defaults) and the proposer registry."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ascent.spec_decode.base import Proposer, SpeculativeConfig
from ascent.spec_decode.ngram import NgramProposer
from ascent.spec_decode.registry import get_proposer_cls, register_proposer
from ascent.spec_decode.suffix import SuffixDecodingProposer


def test_ngram_lookup_defaults_follow_vllm():
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert c.rejection_sample_method == "standard" and c.dynamic is False


@pytest.mark.parametrize("key", ["prompt_lookup_max", "prompt_lookup_min"])
@pytest.mark.parametrize("value", [0, "4", True])
def test_a_bad_lookup_bound_is_named_as_given(key, value):
    with pytest.raises(ValueError, match=key):
        SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3, key: value})


def test_method_inference_and_aliases():
    assert SpeculativeConfig.from_json({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.from_json({"model": "/m/draft", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.from_json({"method": "deepseek_mtp", "num_speculative_tokens": 1}).method == "mtp"


def test_suffix_defaults_and_k_from_depth():
    c = SpeculativeConfig.from_json({"method": "suffix"})
    assert c.num_speculative_tokens == 24
    assert (c.suffix_decoding_max_tree_depth, c.suffix_decoding_max_cached_requests) == (24, 10000)
    assert (c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob) == (1.0, 0.1)
    c = SpeculativeConfig.from_json({"method": "suffix", "suffix_decoding_max_tree_depth": 8})
    assert c.num_speculative_tokens == 8


@pytest.mark.parametrize("bad, needle", [
    ('{"method": "ngram", "num_speculative_tokens": 2, "bogus_key": 1}', "bogus_key"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens=True"),
    ('{"method": "nope", "num_speculative_tokens": 2}', "method='nope'"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3}',
     "prompt_lookup_min=4"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}', "prompt_lookup_min=0"),
    ('{"method": "suffix", "suffix_decoding_max_tree_depth": 0}', "suffix_decoding_max_tree_depth=0"),
    ('{"method": "suffix", "suffix_decoding_max_cached_requests": -1}', "suffix_decoding_max_cached_requests=-1"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}', "suffix_decoding_min_token_prob=1.5"),
    ('{"method": "suffix", "suffix_decoding_max_spec_factor": -1}', "suffix_decoding_max_spec_factor=-1"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": NaN}', "suffix_decoding_min_token_prob=nan"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "fast"}',
     "rejection_sample_method='fast'"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "model=None"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[2, 4, 1]]}',
     "start at batch size 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "dynamic_params": {"budget_threshold": 2}}',
     "budget_threshold=2"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "dynamic_params": {"what": 1}}', "what"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "dynamic": "yes"}', "dynamic='yes'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_window_size": 0}', "draft_window_size=0"),
    ("{not json", "not JSON"),
    ("[1, 2]", "JSON object"),
])
def test_from_json_rejects_naming_the_value(bad, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig.from_json(bad)


def test_from_json_accepts_every_field_roundtrip():
    data = {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_tree_depth": 12,
            "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2.0,
            "suffix_decoding_min_token_prob": 0.25, "rejection_sample_method": "block", "dynamic": True,
            "dynamic_params": {"budget_update_interval": 4}, "num_speculative_tokens_per_batch_size": [[1, 8, 6]]}
    c = SpeculativeConfig.from_json(json.dumps(data))
    for key, value in data.items():
        expected = [tuple(e) for e in value] if key == "num_speculative_tokens_per_batch_size" else value
        assert getattr(c, key) == expected, key


def test_registry_resolves_builtins_and_rejects_unknown():
    assert get_proposer_cls("ngram") is NgramProposer
    assert get_proposer_cls("suffix") is SuffixDecodingProposer
    assert NgramProposer.deterministic and SuffixDecodingProposer.deterministic
    with pytest.raises(ValueError, match="'no-such-method'"):
        get_proposer_cls("no-such-method")


def test_register_custom_proposer_and_duplicate_rejected():
    @register_proposer("unit-test-echo")
    class Echo(Proposer):
        def propose(self, req_ids, token_ids, max_num_tokens):
            return np.stack([np.asarray(t[-self.k:], dtype=np.int64) for t in token_ids])

    assert get_proposer_cls("unit-test-echo") is Echo and Echo.method == "unit-test-echo"
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    out = get_proposer_cls("unit-test-echo")(cfg, 64).propose(["a"], [np.arange(5)], [2])
    assert out.tolist() == [[3, 4]]
    with pytest.raises(ValueError, match="unit-test-echo"):
        register_proposer("unit-test-echo")(type("Other", (Echo,), {}))
    with pytest.raises(ValueError, match="not a Proposer"):
        register_proposer("unit-test-bad")(int)  # type: ignore[arg-type]


def test_speculative_disable_by_batch_size_key():
    cfg = SpeculativeConfig.from_json({"method": "suffix", "speculative_disable_by_batch_size": 4})
    assert cfg.speculative_disable_by_batch_size == 4
    for bad in (1, 0, "4", True):
        with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):
            SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2,
                                         "speculative_disable_by_batch_size": bad})
