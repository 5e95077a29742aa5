"""Prompt handling shared by every route (model names, chat rendering, tokenization, length checks) and the
/tokenize and /detokenize handlers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from http import HTTPStatus
from typing import Any, TypeVar

import jinja2
from starlette.requests import Request

from ascent.core.async_llm import AsyncLLM
from ascent.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    PromptLogprob,
    PromptTokenUsageInfo,
    StreamOptions,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    random_uuid,
)
from ascent.outputs import PromptLogprobs
from ascent.sampling_params import SamplingParams, truncate_prompt
from ascent.tokenizer import apply_chat_template, normalize_messages

T = TypeVar("T")
logger = logging.getLogger(__name__)


@dataclass
class FrontendOptions:
    """Server-wide request handling (``ascent serve`` flags with vLLM's names)."""

    response_role: str = "assistant"  # --response-role: the reply's role after a generation prompt
    log_requests: bool = False  # --enable-log-requests
    max_log_len: int | None = None  # --max-log-len: prompt characters / token ids logged per request
    force_include_usage: bool = False  # --enable-force-include-usage: streams end with a usage chunk
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage reports cached prompt tokens
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: logprob tokens as "token_id:<id>"

# Parameters of ``tokenizer.apply_chat_template`` that decide how (not with what) the template renders.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "chat_template", "add_generation_prompt", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class OpenAIServing:
    """State and checks common to the OpenAI handlers (one instance per route family, all sharing the engine)."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], chat_template: str | None,
                 options: FrontendOptions | None = None) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must name at least one model.")
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.chat_template = chat_template
        self.options = options or FrontendOptions()
        self.response_role = self.options.response_role
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.model_config.max_model_len
        self.vocab_size: int = engine.model_config.vocab_size
        self.sampling_defaults = engine.generation_defaults()  # generation_config values for unset request fields

    # ------------------------------------------------------------------------------------------------ model names
    def check_model(self, model: str | None) -> ErrorResponse | None:
        """None when ``model`` is served (or omitted / empty: the default model, as vLLM), else a 404 naming it."""
        if not model or model in self.served_model_names:
            return None
        return ErrorResponse.create(
            f"The model `{model}` does not exist. Served models: {self.served_model_names}.",
            HTTPStatus.NOT_FOUND, param="model")

    def model_name(self, model: str | None) -> str:
        return model or self.served_model_names[0]

    @staticmethod
    def base_request_id(raw_request: Request | None, body_request_id: str | None) -> str:
        """The base of a response id (vLLM): the ``X-Request-Id`` header, else the body's ``request_id``, else
        random."""
        default = body_request_id or random_uuid()
        return raw_request.headers.get("X-Request-Id", default) if raw_request is not None else default

    def log_request(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams) -> None:
        """``--enable-log-requests``: the prompt (cut at ``--max-log-len``) and the sampling params at INFO."""
        if not self.options.log_requests:
            return
        cut = self.options.max_log_len
        text = prompt[:cut] if prompt is not None and cut is not None else prompt
        ids = token_ids[:cut] if cut is not None else token_ids
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", request_id, text, params, ids)

    def with_details(self, usage: UsageInfo, cached_tokens: int) -> UsageInfo:
        """``--enable-prompt-tokens-details``: the usage with the prompt tokens the prefix cache served."""
        if self.options.prompt_tokens_details:
            usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached_tokens)
        return usage

    def force_usage(self, request: Any) -> None:
        """``--enable-force-include-usage``: a stream ends with a usage chunk even when the client did not ask."""
        if self.options.force_include_usage and request.stream and not request.include_usage:
            continuous = bool(request.stream_options and request.stream_options.continuous_usage_stats)
            request.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=continuous)

    # ------------------------------------------------------------------------------------------------ prompts
    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    template_kwargs: dict[str, Any] | None = None, continue_final_message: bool = False) -> str:
        """The prompt text of a conversation (``--chat-template``, else the model's template).

        ``template_kwargs`` reach the template as variables; names that steer the rendering itself are rejected.
        """
        kwargs = dict(template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved}.")
        if continue_final_message:
            kwargs["continue_final_message"] = True
        try:
            return apply_chat_template(
                self.tokenizer, normalize_messages(messages), add_generation_prompt=add_generation_prompt,
                chat_template=self.chat_template, **kwargs)
        except (jinja2.TemplateError, TypeError) as exc:  # e.g. raise_exception() in a template
            raise ValueError(f"cannot render the chat template: {exc}") from exc

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_token_ids(self, token_ids: list[int], name: str) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{name} contains out-of-vocabulary token ids {bad[:8]} (vocab size {self.vocab_size}).")

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ValueError when the prompt is empty, has unknown ids or leaves no room for an output token."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("The prompt is empty: at least one prompt token is required.")
        if n >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens (max_model_len). However, "
                f"your prompt has {n} tokens, which leaves no room for output tokens. Please shorten the prompt.")
        self.check_token_ids(prompt_token_ids, "prompt")

    def check_params(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError when ``params`` do not fit the model (vocabulary, context length)."""
        params.verify_vocab(self.vocab_size)
        total = len(prompt_token_ids) + (params.max_tokens or 0)
        if total > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(prompt_token_ids)} in the prompt, {params.max_tokens} in the completion). "
                "Please reduce the length of the prompt or max_tokens.")

    def truncate(self, prompt_token_ids: list[int], keep: int | None) -> list[int]:
        """The prompt's last ``keep`` tokens (``truncate_prompt_tokens``; -1: ``max_model_len``), or all of it."""
        return truncate_prompt(prompt_token_ids, keep, self.max_model_len)

    def default_max_tokens(self, prompt_token_ids: list[int]) -> int:
        return self.max_model_len - len(prompt_token_ids)

    def token_text(self, token_id: int, decoded: str | None = None, as_id: bool = False) -> str:
        """A token as logprobs show it: its text, or ``token_id:<id>`` (``return_tokens_as_token_ids``)."""
        if as_id:
            return f"token_id:{token_id}"
        return decoded if decoded is not None else self.tokenizer.decode([token_id])

    def tokens_as_ids(self, request: Any) -> bool:
        """The request's ``return_tokens_as_token_ids``, else the server's ``--return-tokens-as-token-ids``."""
        asked = request.return_tokens_as_token_ids
        return self.options.return_tokens_as_token_ids if asked is None else asked

    def prompt_logprobs(self, entries: PromptLogprobs | None) -> list[dict[int, PromptLogprob] | None]:
        """vLLM's ``prompt_logprobs`` of a response: per prompt token None or {token id: logprob, rank, decoded
        token}, -inf clamped to -9999.0 (JSON has no infinity)."""
        return [None if entry is None else {
            token_id: PromptLogprob(logprob=max(lp.logprob, -9999.0), rank=lp.rank,
                                    decoded_token=self.token_text(token_id, lp.decoded_token))
            for token_id, lp in entry.items()} for entry in entries or []]


# ---------------------------------------------------------------------------------------------------- async helpers
async def run_until_disconnected(raw_request: Request | None, work: Awaitable[T]) -> T | None:
    """Await ``work`` unless the HTTP client disconnects first; then ``work`` is cancelled and None returned.

    Cancelling the work closes the engine stream it iterates, which aborts the request and frees its KV blocks.
    """
    task = asyncio.ensure_future(work)
    if raw_request is None:
        return await task
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncGenerator[tuple[int, T], None]:
    """Yield ``(index, item)`` from several async iterators as items arrive; closing this closes them all."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[index]))] = index
                yield index, item
    finally:
        for future in pending:
            future.cancel()  # cancels the engine stream's wait, which aborts its request


# ---------------------------------------------------------------------------------------------------- routes
class OpenAIServingTokenization(OpenAIServing):
    """POST /tokenize and /detokenize."""

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse | ErrorResponse:
        error = self.check_model(request.model)
        if error is not None:
            return error
        try:
            if request.messages is not None:
                text = self.render_chat(request.messages, request.add_generation_prompt, request.chat_template_kwargs,
                                        request.continue_final_message)
                default_special = False  # the template already placed the special tokens
            else:
                text, default_special = request.prompt, True
            special = default_special if request.add_special_tokens is None else request.add_special_tokens
            tokens = self.encode(text, add_special_tokens=special)
        except ValueError as exc:
            return ErrorResponse.create(str(exc))
        strs = self.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens, token_strs=strs)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse | ErrorResponse:
        error = self.check_model(request.model)
        if error is not None:
            return error
        try:
            self.check_token_ids(request.tokens, "tokens")
        except ValueError as exc:
            return ErrorResponse.create(str(exc))
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
