"""Incremental detokenization and stop-string matching for one request.

Decoding uses the prefix/read-offset algorithm over token ids: the text of a sliding window ``ids[prefix:]`` is
decoded and only the part past ``decode(ids[prefix:read])`` is emitted, and only once it no longer ends in U+FFFD
(an incomplete UTF-8 sequence). Windows start on character boundaries, so the concatenated pieces equal
``tokenizer.decode(all_ids)`` except that, as in vLLM, an incomplete character at the end is never emitted (not even
when the request finishes). The first window starts inside the prompt (a suffix of 4-23 prompt tokens that decodes
cleanly, vLLM's rule), so a SentencePiece tokenizer keeps the space of the first output word. For HF fast tokenizers
the Rust ``tokenizers.Tokenizer`` decodes directly.
"""

from __future__ import annotations

from typing import Any, Callable

from ascent.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"

DecodeFn = Callable[[list[int]], str]


def backend_tokenizer(tokenizer: Any) -> Any | None:
    """The Rust ``tokenizers.Tokenizer`` behind ``tokenizer`` (or ``tokenizer`` itself), else None."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if getattr(tokenizer, "is_fast", False):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if isinstance(backend, Tokenizer):
            return backend
    return None


def make_decode_fn(tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool = True) -> DecodeFn:
    """A ``list[int] -> str`` decoder: the Rust backend when available, else ``tokenizer.decode``.

    Tokenization-space cleanup is never applied (it is not incremental; vLLM ignores it as well).
    """
    backend = backend_tokenizer(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        clean_up_tokenization_spaces=False,
    )


def prompt_context(prompt_token_ids: list[int], decode: DecodeFn) -> list[int]:
    """The prompt tokens the first decoding window starts with (vLLM's choice): for prompts longer than 4 tokens
    the shortest suffix of 4 to 23 tokens whose text has no U+FFFD, else the whole prompt."""
    if len(prompt_token_ids) <= 4:
        return list(prompt_token_ids)
    for length in range(4, min(len(prompt_token_ids), 23) + 1):
        suffix = prompt_token_ids[-length:]
        if _REPLACEMENT_CHAR not in decode(suffix):
            return list(suffix)
    return list(prompt_token_ids)


class _WindowDecoder:
    """Prefix/read-offset incremental decoder over a growing list of token ids; ``context`` (prompt tokens) only
    conditions the text of the first output tokens and is never emitted."""

    def __init__(self, decode: DecodeFn, context: list[int] | None = None) -> None:
        self._decode = decode
        self._ids: list[int] = list(context or [])
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_len = len(decode(self._ids)) if self._ids else 0  # len(decode(ids[prefix:read]))

    def step(self, token_id: int) -> str:
        """Add one token; return the newly completed text ("" while a character is still incomplete)."""
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= self._prefix_len or text.endswith(_REPLACEMENT_CHAR):
            return ""
        new_text = text[self._prefix_len :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_len = len(self._decode(self._ids[self._prefix : self._read]))
        return new_text


def find_stop_string(text: str, check_from: int, stops: list[str], include: bool) -> tuple[str, int] | None:
    """The stop string whose first occurrence ending after ``check_from`` ends earliest in ``text``; a tie goes to
    the one listed first (vLLM's ``check_stop_strings``).

    Returns ``(stop, truncate_to)``: ``text[:truncate_to]`` is what remains (stop kept when ``include``).
    """
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        idx = text.find(stop, max(0, check_from - len(stop) + 1))
        if idx != -1 and (best is None or idx + len(stop) < best[0]):
            best = (idx + len(stop), idx, stop)
    if best is None:
        return None
    end, idx, stop = best
    return stop, end if include else idx


class IncrementalDetokenizer:
    """Per-request incremental detokenizer with stop strings and DELTA hold-back.

    Without a tokenizer, or with ``params.detokenize`` False, only token ids are tracked and the text stays "".
    """

    def __init__(self, tokenizer: Any | None, params: SamplingParams,
                 prompt_token_ids: list[int] | None = None) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        decode_text = tokenizer is not None and params.detokenize
        if self.stop and not decode_text:
            raise ValueError(f"stop strings {self.stop!r} require detokenize=True and a tokenizer.")
        self._decoder: _WindowDecoder | None = None
        if decode_text:
            decode = make_decode_fn(tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens)
            self._decoder = _WindowDecoder(decode, prompt_context(prompt_token_ids or [], decode))
        hold = self.stop and not self.include_stop_str_in_output
        self._stop_buffer_length = max(len(s) for s in self.stop) - 1 if hold else 0
        self._sent_offset = 0
        self._finished = False

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def finished(self) -> bool:
        return self._finished

    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Decode ``new_token_ids`` and check stop strings; return the matched stop string or None.

        ``stop_terminated``: the core stopped on the last of these tokens (EOS / stop token id); its text is left
        out unless ``include_stop_str_in_output``. A stop-string match truncates the text and finishes decoding.
        """
        if not new_token_ids or self._finished:
            self.token_ids.extend(new_token_ids)
            return None
        skipped = None
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids, skipped = new_token_ids[:-1], new_token_ids[-1]
        check_from = len(self.text)
        first_new = len(self.token_ids)
        pieces: list[str] = []
        ends: list[int] = []  # text length once each new token is decoded
        end = len(self.text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            if self._decoder is not None:
                pieces.append(self._decoder.step(token_id))
                end += len(pieces[-1])
            ends.append(end)
            if self.min_tokens and len(self.token_ids) <= self.min_tokens:
                check_from = end
        self.text += "".join(pieces)
        if skipped is not None:
            self.token_ids.append(skipped)
        return self._check_stop(check_from, first_new, ends)

    def finish(self) -> None:
        """Mark the request finished: the stop-string hold-back is released. Bytes of an incomplete character at
        the end stay out of the text (vLLM emits no U+FFFD for them)."""
        self._finished = True

    def output_text(self, delta: bool) -> str:
        """All text so far (``delta=False``) or the text not returned by an earlier delta call.

        While unfinished, the last ``len(longest stop) - 1`` characters are held back (they may begin a stop string).
        """
        buffer = 0 if self._finished else self._stop_buffer_length
        end = max(len(self.text) - buffer, 0)
        if not delta:
            return self.text[:end]
        start = self._sent_offset
        if end <= start:
            return ""
        self._sent_offset = end
        return self.text[start:end]

    def _check_stop(self, check_from: int, first_new: int = 0, ends: list[int] | None = None) -> str | None:
        """Truncate at the first stop string from ``check_from``. With ``ends`` (the text length after each token
        from ``first_new``), tokens after the one that completes the stop string are dropped too: a step that
        produced several tokens (speculative decoding) must not return tokens past the stop."""
        if not self.stop or len(self.token_ids) <= self.min_tokens or check_from >= len(self.text):
            return None
        match = find_stop_string(self.text, check_from, self.stop, self.include_stop_str_in_output)
        if match is None:
            return None
        stop, truncate_to = match
        if ends:
            stop_end = truncate_to if self.include_stop_str_in_output else truncate_to + len(stop)
            last = next((i for i, end in enumerate(ends) if end >= stop_end), len(ends) - 1)
            del self.token_ids[first_new + last + 1:]
        self.text = self.text[:truncate_to]
        self._finished = True
        return stop
