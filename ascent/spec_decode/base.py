"""Speculative decoding: the configuration (vLLM's ``--speculative-config`` keys) and the ``Proposer`` interface.

A proposer drafts up to ``k = num_speculative_tokens`` tokens per request after every engine step; the rejection
sampler verifies them on the next step. Model-free proposers (n-gram, suffix) are ``deterministic``: they have no
draft distribution, so verification uses the point-mass rule.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np
import torch

from ascent.config import parse_json_object
from ascent.spec_decode.calibration import DraftEvidence
from ascent.spec_decode.dynamic import DynamicSpecParams, validate_batch_size_schedule

SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "medusa", "eagle", "eagle3", "mtp", "dflash", "dspark",
                       "extract_hidden_states")
REJECTION_SAMPLE_METHODS = ("standard", "block")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
MODEL_FREE_METHODS = ("ngram", "suffix")
DRAFT_MODEL_REQUIRED = ("draft_model", "medusa", "eagle", "eagle3", "dflash")  # mtp/dspark may reuse the target's
DEFAULT_PROMPT_LOOKUP = 5  # vLLM: both n-gram bounds default to 5 when neither is given


def _fail(name: str, value: Any, why: str) -> None:
    raise ValueError(f"{name}={value!r} is invalid: {why}.")


def _check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(name, value, f"must be an integer >= {minimum}")


def _check_float(name: str, value: Any, lo: float, hi: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value and (hi is None or value <= hi)
    if not ok:
        _fail(name, value, f"must be a number in [{lo}, {'inf' if hi is None else hi}]")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(name, value, f"must be one of {choices}")


@dataclass
class SpeculativeConfig:
    """Speculative decoding settings; names and defaults follow vLLM's ``SpeculativeConfig``.

    Extensions beyond vLLM's keys: ``suffix_decoding_max_spec_offset`` (Arctic's ``suffix_max_spec_offset``),
    ``dynamic`` + ``dynamic_params`` (the DynamicSpecScheduler of ``spec_decode.dynamic``), ``draft_window_size``
    (vLLM Ascend's ``additional_config.draft_window_size``, see ``spec_decode.sliding_window``) and
    ``draft_num_layers`` (``draft_model`` without a ``model``: the target truncated to its first N layers, sharing its
    weights, see ``spec_decode.draft_model``).
    ``speculative_disable_by_batch_size`` (vLLM V0's key): no drafts in a step where at least that many requests
    are running (speculation only pays while a step is memory-bound); ``num_speculative_tokens_per_batch_size``
    caps the draft length by the number of running requests the same way (K = 0 disables).
    ``draft_model_config`` is vLLM's key; only ``{"hf_config": {...}}`` overrides are read (e.g.
    ``eagle_aux_hidden_state_layer_ids`` for ``eagle3`` / ``extract_hidden_states``).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_spec_offset: float = 0.0
    rejection_sample_method: str = "standard"
    draft_sample_method: str = "greedy"
    draft_tensor_parallel_size: int | None = None
    max_model_len: int | None = None
    quantization: str | None = None
    revision: str | None = None
    code_revision: str | None = None
    enforce_eager: bool | None = None
    disable_padded_drafter_batch: bool = False
    parallel_drafting: bool = False
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = None
    speculative_disable_by_batch_size: int | None = None
    dynamic: bool = False
    dynamic_params: dict[str, Any] = field(default_factory=dict)
    draft_window_size: int | None = None
    draft_num_layers: int | None = None
    draft_model_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.method == "[ngram]":
            self.method = "ngram"
        elif isinstance(self.method, str) and self.method.endswith("_mtp"):  # vLLM's deprecated MTP aliases
            self.method = "mtp"
        _check_choice("method", self.method, SPECULATIVE_METHODS)
        self._check_suffix()
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.method == "ngram":
            self._resolve_prompt_lookup()
        _check_choice("rejection_sample_method", self.rejection_sample_method, REJECTION_SAMPLE_METHODS)
        _check_choice("draft_sample_method", self.draft_sample_method, DRAFT_SAMPLE_METHODS)
        _check_int("draft_tensor_parallel_size", self.draft_tensor_parallel_size, 1, optional=True)
        _check_int("max_model_len", self.max_model_len, 1, optional=True)
        _check_int("draft_window_size", self.draft_window_size, 1, optional=True)
        _check_int("draft_num_layers", self.draft_num_layers, 1, optional=True)
        _check_int("speculative_disable_by_batch_size", self.speculative_disable_by_batch_size, 2, optional=True)
        self._check_model_methods()
        for name in ("disable_padded_drafter_batch", "parallel_drafting", "dynamic"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be a boolean")
        self._check_dynamic()

    def _check_model_methods(self) -> None:
        if self.draft_num_layers is not None and self.method != "draft_model":
            _fail("draft_num_layers", self.draft_num_layers, "only applies to method 'draft_model'")
        truncated = self.method == "draft_model" and self.draft_num_layers is not None
        if self.method in DRAFT_MODEL_REQUIRED and self.model is None and not truncated:
            _fail("model", self.model, f"method {self.method!r} needs a draft model path")
        if self.draft_model_config is not None:
            hf = self.draft_model_config.get("hf_config", {}) if isinstance(self.draft_model_config, dict) else None
            if not isinstance(hf, dict) or set(self.draft_model_config) - {"hf_config"}:
                _fail("draft_model_config", self.draft_model_config, 'must be {"hf_config": {...}}')
        if self.method == "extract_hidden_states":
            if self.num_speculative_tokens != 1:
                _fail("num_speculative_tokens", self.num_speculative_tokens,
                      "must be 1 for method 'extract_hidden_states' (as in vLLM)")
            if not self.aux_hidden_state_layer_ids():
                _fail("draft_model_config", self.draft_model_config, "method 'extract_hidden_states' needs "
                      '{"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}')

    def aux_hidden_state_layer_ids(self) -> list[int] | None:
        """``draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids`` (None when not given)."""
        hf = (self.draft_model_config or {}).get("hf_config", {})
        ids = hf.get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            return None
        if not isinstance(ids, (list, tuple)) or not ids or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            _fail("eagle_aux_hidden_state_layer_ids", ids, "must be a non-empty list of layer indices >= 0")
        return list(ids)

    def _resolve_prompt_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None:  # checked under its own name before one stands in for the other
                _check_int(name, value, 1)
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        _check_int("prompt_lookup_min", lo, 1)
        _check_int("prompt_lookup_max", hi, 1)
        if lo > hi:
            _fail("prompt_lookup_min", lo, f"must be <= prompt_lookup_max={hi}")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    def _check_suffix(self) -> None:
        _check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1)
        _check_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0)
        _check_float("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor, 0.0)
        _check_float("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob, 0.0, 1.0)
        _check_float("suffix_decoding_max_spec_offset", self.suffix_decoding_max_spec_offset, float("-inf"))

    def _check_dynamic(self) -> None:
        if self.num_speculative_tokens_per_batch_size is not None:
            self.num_speculative_tokens_per_batch_size = validate_batch_size_schedule(
                self.num_speculative_tokens_per_batch_size)
        if not isinstance(self.dynamic_params, dict):
            _fail("dynamic_params", self.dynamic_params, "must be a JSON object")
        DynamicSpecParams.from_dict(self.dynamic_params)

    @classmethod
    def from_json(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """Build from vLLM's ``--speculative-config`` JSON (a string or an already parsed dict).

        ``method`` may be omitted as in vLLM: ``model`` "ngram" / "[ngram]" means n-gram, any other model means
        ``draft_model``. ``num_speculative_tokens`` may be omitted for ``suffix`` (defaults to the tree depth).
        Raises ValueError naming unknown keys, malformed JSON and bad values.
        """
        data = parse_json_object("speculative_config", value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known keys: {sorted(known)}")
        if data.get("method") is None:
            data["method"] = _infer_method(data.get("model"))
        if data["method"] == "suffix" and data.get("num_speculative_tokens") is None:
            data["num_speculative_tokens"] = data.get("suffix_decoding_max_tree_depth", 24)
        if data.get("num_speculative_tokens") is None:
            _fail("num_speculative_tokens", None, f"is required for method {data['method']!r}")
        return cls(**data)


def _infer_method(model: Any) -> str:
    if model in ("ngram", "[ngram]"):
        return "ngram"
    if model is None:
        _fail("method", None, "is required when no draft model is given")
    return "draft_model"


def pad_drafts(drafts: Sequence[Sequence[int]], k: int) -> np.ndarray:
    """Pack per-request draft lists into int64 ``[len(drafts), k]``, padded with -1 (each list must be <= k long)."""
    out = np.full((len(drafts), k), -1, dtype=np.int64)
    for i, d in enumerate(drafts):
        assert len(d) <= k, (len(d), k)
        out[i, : len(d)] = d
    return out


class Proposer(ABC):
    """Drafts tokens for a batch of requests. One instance per engine; per-request state is keyed by ``req_id``.

    Lifecycle per request: ``add_request`` (prompt) -> ``update_request`` (each step's accepted outputs, in order)
    -> ``remove_request`` (finished or preempted; a preempted request is added again later). ``remove_request`` of
    an unknown id is a no-op.
    """

    method: ClassVar[str]
    deterministic: ClassVar[bool] = True  # True: no draft probabilities (point-mass verification)

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        _check_int("max_model_len", max_model_len, 1)
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len

    def load_model(self, target_model: torch.nn.Module | None) -> None:
        """Load the drafter (model-based proposers may share the target's embeddings/head); model-free: no-op."""
        return None

    def add_request(self, req_id: str, prompt_token_ids: list[int]) -> None:
        """Start tracking ``req_id`` with its prompt."""
        return None

    def update_request(self, req_id: str, new_token_ids: list[int]) -> None:
        """Append the request's newly accepted output tokens (in generation order)."""
        return None

    def update_requests(self, req_ids: Sequence[str], new_token_ids: Sequence[Sequence[int]]) -> None:
        """``update_request`` for each request of a step that has new tokens (proposers may do it in one go)."""
        for req_id, tokens in zip(req_ids, new_token_ids):
            if len(tokens):
                self.update_request(req_id, list(tokens))

    def remove_request(self, req_id: str) -> None:
        """Free the request's per-request state."""
        return None

    @abstractmethod
    def propose(self, req_ids: list[str], token_ids: list[np.ndarray], max_num_tokens: list[int]) -> np.ndarray:
        """Draft the next tokens.

        ``token_ids[i]``: int 1-D, every token of request ``i`` so far (prompt + accepted outputs).
        ``max_num_tokens[i]``: the most drafts row ``i`` may hold (0: none, e.g. a partial prefill).
        Returns int64 ``[len(req_ids), k]`` padded with -1; row ``i`` holds at most ``max_num_tokens[i]`` drafts and
        never drafts past ``max_model_len``.
        """

    def draft_evidence(self) -> list[DraftEvidence | None] | None:
        """Per request of the latest :meth:`propose` call (same order), the proposer's own evidence for its draft
        (None for a request without a draft); None when the proposer does not score its drafts. Dynamic
        speculation calibrates it into per-draft acceptance estimates (:mod:`ascent.spec_decode.calibration`)."""
        return None

    def _check_batch(self, req_ids: list[str], token_ids: list[np.ndarray], max_num_tokens: list[int]) -> None:
        if not len(req_ids) == len(token_ids) == len(max_num_tokens):
            raise ValueError(f"propose() got {len(req_ids)} req_ids, {len(token_ids)} token_ids and "
                             f"{len(max_num_tokens)} max_num_tokens; they must have equal lengths")
        for r, m in zip(req_ids, max_num_tokens):
            if m < 0:
                raise ValueError(f"max_num_tokens={m} for request {r!r} is invalid: must be >= 0")
