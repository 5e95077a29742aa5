"""SamplingParams with vLLM's field names, defaults and validation."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5
_MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: smaller positive temperatures overflow the softmax
# the seeds a torch.Generator takes (a negative seed is read modulo 2^64)
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


class RequestOutputKind(IntEnum):
    """How outputs are streamed (``SamplingParams.output_kind``).

    CUMULATIVE: every output carries all text/tokens so far. DELTA: only what is new since the previous output.
    FINAL_ONLY: a single output once the request finished.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """Per-request sampling parameters (vLLM semantics).

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 disables top-k. ``top_p`` is applied over the
    top-k set and renormalised (vLLM v1 order: allowed ids / min_tokens / logit_bias / penalties -> temperature ->
    min-p -> top-k -> top-p).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine: tokenizer EOS ∪ generation_config EOS (not the request's own stop_token_ids).
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    _eos_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine from bad_words: the token sequences whose last token is banned after the others.
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        if self.seed == -1:  # vLLM: -1 means no seed
            self.seed = None
        if 0 < self.temperature < _MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s and is raised to it (vLLM)", self.temperature,
                           _MIN_TEMPERATURE)
            self.temperature = _MIN_TEMPERATURE
        if self.output_kind in set(RequestOutputKind):  # a plain 0/1/2 becomes the enum (vLLM's type)
            self.output_kind = RequestOutputKind(self.output_kind)
        if self.top_k == -1:
            self.top_k = 0
        if self.logprobs is True:  # OpenAI-style boolean
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: neutralise the random-sampling knobs like vLLM does.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    def _verify(self) -> None:
        def bad(name: str, value: object, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {value!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "must be an integer >= 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be greater than zero")
        if self.temperature < 0.0:
            raise bad("temperature", self.temperature, "must be non-negative")
        if self.temperature < _SAMPLING_EPS and self.n > 1:
            raise bad("n", self.n, "must be 1 when using greedy sampling")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", self.output_kind, f"must be one of {[k.name for k in RequestOutputKind]}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be 0 or -1 (disable), or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "must be at least 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be greater than or equal to 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must be less than or equal to max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < -1):
            raise bad("logprobs", self.logprobs, "must be non-negative (or -1 for the full vocabulary)")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < -1
        ):
            raise bad("prompt_logprobs", self.prompt_logprobs, "must be non-negative (or -1)")
        if self.seed is not None and (not isinstance(self.seed, int) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise bad("seed", self.seed, f"must be an integer in [{_SEED_MIN}, {_SEED_MAX}]")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", self.stop, "must contain only non-empty strings")
        if self.stop and not self.detokenize:
            raise bad("stop", self.stop, "needs detokenize=True (stop strings are matched on the text)")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "must be non-negative integers")
        if self.allowed_token_ids is not None:
            if len(self.allowed_token_ids) == 0:
                raise bad("allowed_token_ids", self.allowed_token_ids, "must not be empty")
            if any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", self.allowed_token_ids, "must be non-negative integers")
        if self.truncate_prompt_tokens is not None and (
                not isinstance(self.truncate_prompt_tokens, int) or self.truncate_prompt_tokens == 0
                or self.truncate_prompt_tokens < -1):
            raise bad("truncate_prompt_tokens", self.truncate_prompt_tokens,
                      "must be a positive integer (the prompt tokens kept) or -1 (max_model_len)")
        if self.bad_words is not None and (
                isinstance(self.bad_words, str) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad("bad_words", self.bad_words, "must be a list of non-blank strings")
        if self.best_of is not None and self.best_of != self.n:
            raise bad("best_of", self.best_of, f"must equal n={self.n}: best-of selection is not supported (as in "
                      "vLLM's V1 engine)")

    def verify_vocab(self, vocab_size: int) -> None:
        """Check token-id valued fields against the model vocabulary (raises ValueError naming the value)."""
        for name in ("allowed_token_ids", "stop_token_ids"):
            ids = getattr(self, name) or []
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} contains out-of-vocabulary token ids {bad} (vocab size {vocab_size}).")
        if self.logit_bias:
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"logit_bias contains out-of-vocabulary token ids {bad} (vocab size {vocab_size}).")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    def update_from_generation_config(self, eos_token_ids: set[int]) -> None:
        """Record the model's EOS set (tokenizer EOS ∪ generation_config EOS): it stops the request unless
        ``ignore_eos``, and it is among the ids ``min_tokens`` holds back either way (vLLM's all_stop_token_ids)."""
        self._eos_token_ids = set() if self.ignore_eos else set(eos_token_ids)
        self._all_stop_token_ids = set(self.stop_token_ids) | set(eos_token_ids)

    def update_from_tokenizer(self, tokenizer: Any, vocab_size: int) -> None:
        """Tokenize ``bad_words`` as vLLM does: each word alone, and after a space when that gives a different first
        token of the same length (a word inside the text); ids outside the vocabulary are a ValueError."""
        self._bad_words_token_ids = []
        for word in self.bad_words or []:
            alone = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            self._bad_words_token_ids.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                self._bad_words_token_ids.append(spaced)
        invalid = [t for ids in self._bad_words_token_ids for t in ids if not 0 <= t < vocab_size]
        if invalid:
            raise ValueError(f"bad_words={self.bad_words!r} tokenize to ids {invalid} outside the vocabulary "
                             f"(size {vocab_size}).")

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)


def truncate_prompt(prompt_token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """``truncate_prompt_tokens`` as vLLM applies it: the last ``keep`` prompt tokens (left truncation; -1 keeps
    ``max_model_len``), or the whole prompt when ``keep`` is None or covers it."""
    if keep is None:
        return prompt_token_ids
    keep = max_model_len if keep == -1 else keep
    return prompt_token_ids[-keep:] if len(prompt_token_ids) > keep else prompt_token_ids
