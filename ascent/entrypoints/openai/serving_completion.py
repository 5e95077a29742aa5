"""POST /v1/completions: non-streaming JSON and SSE streaming in the OpenAI ``text_completion`` format."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from http import HTTPStatus

from starlette.requests import Request

from ascent.core.async_llm import EngineDeadError
from ascent.entrypoints.openai.protocol import (
    SSE_DONE,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    ErrorResponse,
    make_usage,
    sse_event,
)
from ascent.entrypoints.openai.serving_tokens import OpenAIServing, merge_async_iterators, run_until_disconnected
from ascent.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs
from ascent.sampling_params import SamplingParams

CompletionResult = CompletionResponse | ErrorResponse | AsyncGenerator[str, None] | None


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]
    params: SamplingParams


@dataclass
class _Choice:
    """Per-choice streaming state: text emitted so far (for ``text_offset``) and tokens generated."""

    echoed: bool = False
    text_len: int = 0
    num_tokens: int = 0


class OpenAIServingCompletion(OpenAIServing):
    """Handler of /v1/completions. Each prompt of a batched ``prompt`` is one engine request with ``n`` choices."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request | None = None
                                ) -> CompletionResult:
        """An ErrorResponse, a CompletionResponse, an SSE string generator (stream), or None (client left)."""
        error = self.check_model(request.model)
        if error is not None:
            return error
        try:
            prompts = self._prepare(request)
        except ValueError as exc:
            return ErrorResponse.create(str(exc))
        request_id = f"cmpl-{self.base_request_id(raw_request, request.request_id)}"
        self.force_usage(request)
        for i, p in enumerate(prompts):
            self.log_request(request_id if len(prompts) == 1 else f"{request_id}-{i}", p.text, p.token_ids, p.params)
        streams = [
            self.engine.generate({"prompt": p.text, "prompt_token_ids": p.token_ids}, p.params,
                                 request_id if len(prompts) == 1 else f"{request_id}-{i}", request.priority)
            for i, p in enumerate(prompts)
        ]
        header = dict(id=request_id, created=int(time.time()), model=self.model_name(request.model))
        if request.stream:
            return self._stream(request, prompts, streams, header)
        return await run_until_disconnected(raw_request, self._full(request, prompts, streams, header))

    def _prepare(self, request: CompletionRequest) -> list[_Prompt]:
        raw_prompts = request.prompts()
        if not raw_prompts:
            raise ValueError("prompt must contain at least one prompt.")
        prompts = []
        for raw in raw_prompts:
            text, ids = ((raw, self.encode(raw, request.add_special_tokens)) if isinstance(raw, str)
                         else (None, list(raw)))
            ids = self.truncate(ids, request.truncate_prompt_tokens)
            self.check_prompt(ids)
            params = request.to_sampling_params(self.default_max_tokens(ids), self.sampling_defaults)
            self.check_params(ids, params)
            prompts.append(_Prompt(text, ids, params))
        return prompts

    # ------------------------------------------------------------------------------------------------ non-stream
    async def _full(self, request: CompletionRequest, prompts: list[_Prompt],
                    streams: list[AsyncIterator[RequestOutput]], header: dict) -> CompletionResponse | ErrorResponse:
        finals: list[RequestOutput | None] = [None] * len(prompts)
        try:
            async with aclosing(merge_async_iterators(*streams)) as merged:
                async for i, result in merged:
                    finals[i] = result
        except ValueError as exc:
            return ErrorResponse.create(str(exc))
        except EngineDeadError as exc:
            return ErrorResponse.create(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR)
        choices: list[CompletionResponseChoice] = []
        num_generated = 0
        for i, result in enumerate(finals):
            assert result is not None and result.finished
            prompt_logprobs = (self.prompt_logprobs(result.prompt_logprobs) if request.prompt_logprobs is not None
                               else None)  # one list per prompt, shared by its n choices
            for out in sorted(result.outputs, key=lambda o: o.index):
                choice = self._choice(request, result, out, i * request.n + out.index, _Choice())
                if prompt_logprobs is not None:
                    choice.prompt_logprobs = prompt_logprobs
                choices.append(choice)
                num_generated += 0 if request.echo_without_generation else len(out.token_ids)
        num_prompt = sum(len(p.token_ids) for p in prompts)
        usage = self.with_details(make_usage(num_prompt, num_generated), sum(r.num_cached_tokens or 0 for r in finals))
        return CompletionResponse(**header, choices=choices, usage=usage)

    # ------------------------------------------------------------------------------------------------ stream
    async def _stream(self, request: CompletionRequest, prompts: list[_Prompt],
                      streams: list[AsyncIterator[RequestOutput]], header: dict) -> AsyncGenerator[str, None]:
        states = [_Choice() for _ in range(len(prompts) * request.n)]
        cached = [0] * len(prompts)
        try:
            async with aclosing(merge_async_iterators(*streams)) as merged:
                async for i, result in merged:
                    cached[i] = result.num_cached_tokens or cached[i]
                    for out in result.outputs:
                        index = i * request.n + out.index
                        state = states[index]
                        state.num_tokens += 0 if request.echo_without_generation else len(out.token_ids)
                        chunk = CompletionStreamResponse(
                            **header, choices=[self._choice(request, result, out, index, state)])
                        if request.continuous_usage:
                            chunk.usage = make_usage(len(prompts[i].token_ids), state.num_tokens)
                        yield sse_event(chunk)
            if request.include_usage:
                num_prompt = sum(len(p.token_ids) for p in prompts)
                usage = self.with_details(make_usage(num_prompt, sum(s.num_tokens for s in states)), sum(cached))
                yield sse_event(CompletionStreamResponse(**header, choices=[], usage=usage))
        except ValueError as exc:
            yield sse_event(ErrorResponse.create(str(exc)))
        except EngineDeadError as exc:
            yield sse_event(ErrorResponse.create(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR))
        yield SSE_DONE

    # ------------------------------------------------------------------------------------------------ choices
    def _choice(self, request: CompletionRequest, result: RequestOutput, out: CompletionOutput, index: int,
                state: _Choice) -> CompletionResponseChoice:
        """One choice (whole or delta); with ``echo`` the first one of each index starts with the prompt (and with
        ``max_tokens=0`` it is only the prompt)."""
        text, token_ids = out.text, list(out.token_ids)
        entries: list = list(out.logprobs or [])
        if request.echo_without_generation:
            text, token_ids, entries = "", [], []
        if request.echo and not state.echoed:
            state.echoed = True
            prompt_text = result.prompt if result.prompt is not None else self.tokenizer.decode(
                result.prompt_token_ids)
            text = prompt_text + text
            token_ids = list(result.prompt_token_ids) + token_ids
            entries = _prompt_entries(result.prompt_logprobs, len(result.prompt_token_ids)) + entries
        logprobs = None
        if request.logprobs is not None:
            logprobs = self._logprobs(token_ids, entries, state.text_len, self.tokens_as_ids(request))
        state.text_len += len(text)
        return CompletionResponseChoice(index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
                                        stop_reason=out.stop_reason)

    def _logprobs(self, token_ids: list[int], entries: SampleLogprobs | PromptLogprobs,
                  initial_offset: int, as_ids: bool = False) -> CompletionLogProbs:
        """OpenAI completions logprobs: each token's text, logprob, top alternatives and character offset."""
        result = CompletionLogProbs()
        offset = initial_offset
        for token_id, entry in zip(token_ids, entries):
            own = entry.get(token_id) if entry else None
            token = self.token_text(token_id, own.decoded_token if own else None, as_ids)
            result.tokens.append(token)
            result.token_logprobs.append(max(own.logprob, -9999.0) if own else None)
            result.top_logprobs.append(
                {self.token_text(t, lp.decoded_token, as_ids): max(lp.logprob, -9999.0) for t, lp in entry.items()}
                if entry else None)
            result.text_offset.append(offset)
            offset += len(token)
        return result


def _prompt_entries(prompt_logprobs: PromptLogprobs | None, num_prompt_tokens: int) -> PromptLogprobs:
    """Prompt logprobs padded to one entry per prompt token (None where the engine computed none)."""
    entries = list(prompt_logprobs or [])
    return entries + [None] * (num_prompt_tokens - len(entries))
