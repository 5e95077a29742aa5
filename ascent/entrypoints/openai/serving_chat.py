"""POST /v1/chat/completions: the chat template, then non-streaming JSON or SSE ``chat.completion.chunk`` events."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from http import HTTPStatus

from starlette.requests import Request

from ascent.core.async_llm import EngineDeadError
from ascent.entrypoints.openai.protocol import (
    SSE_DONE,
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    ErrorResponse,
    make_usage,
    sse_event,
)
from ascent.entrypoints.openai.serving_tokens import OpenAIServing, run_until_disconnected
from ascent.outputs import Logprob, RequestOutput, SampleLogprobs
from ascent.sampling_params import SamplingParams
from ascent.tokenizer import normalize_messages

ChatResult = ChatCompletionResponse | ErrorResponse | AsyncGenerator[str, None] | None


class OpenAIServingChat(OpenAIServing):
    """Handler of /v1/chat/completions: one engine request with ``n`` choices per call."""

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request | None = None
                                     ) -> ChatResult:
        """An ErrorResponse, a ChatCompletionResponse, an SSE string generator (stream), or None (client left)."""
        error = self.check_model(request.model)
        if error is not None:
            return error
        try:
            prompt, token_ids, params = self._prepare(request)
        except ValueError as exc:
            return ErrorResponse.create(str(exc))
        request_id = f"chatcmpl-{self.base_request_id(raw_request, request.request_id)}"
        self.force_usage(request)
        self.log_request(request_id, prompt, token_ids, params)
        stream = self.engine.generate({"prompt": prompt, "prompt_token_ids": token_ids}, params, request_id,
                                      request.priority)
        header = dict(id=request_id, created=int(time.time()), model=self.model_name(request.model))
        role = self._role(request)
        if request.stream:
            return self._stream(request, len(token_ids), stream, header, role)
        return await run_until_disconnected(raw_request, self._full(request, stream, header, role))

    def _prepare(self, request: ChatCompletionRequest) -> tuple[str, list[int], SamplingParams]:
        prompt = self.render_chat(request.messages, request.add_generation_prompt, request.chat_template_kwargs,
                                  request.continue_final_message)
        token_ids = self.encode(prompt, add_special_tokens=request.add_special_tokens)
        token_ids = self.truncate(token_ids, request.truncate_prompt_tokens)
        self.check_prompt(token_ids)
        params = request.to_sampling_params(self.default_max_tokens(token_ids), self.sampling_defaults)
        self.check_params(token_ids, params)
        return prompt, token_ids, params

    def _role(self, request: ChatCompletionRequest) -> str:
        """The reply's role (vLLM): ``--response-role`` after a generation prompt, else the last message's role."""
        return self.response_role if request.add_generation_prompt else request.messages[-1]["role"]

    def _echo(self, request: ChatCompletionRequest, role: str) -> str:
        """``echo``: the last message's text when it has the reply's role (it is the start of the reply), else ""."""
        last = request.messages[-1]
        if not request.echo or last.get("role") != role:
            return ""
        return normalize_messages([last])[0]["content"]

    # ------------------------------------------------------------------------------------------------ non-stream
    async def _full(self, request: ChatCompletionRequest, stream: AsyncIterator[RequestOutput],
                    header: dict, role: str) -> ChatCompletionResponse | ErrorResponse:
        final: RequestOutput | None = None
        try:
            async with aclosing(stream):
                async for result in stream:
                    final = result
        except ValueError as exc:
            return ErrorResponse.create(str(exc))
        except EngineDeadError as exc:
            return ErrorResponse.create(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR)
        assert final is not None and final.finished
        echo = self._echo(request, role)
        choices = [
            ChatCompletionResponseChoice(
                index=out.index,
                message=ChatMessage(role=role, content=echo + out.text),
                logprobs=self._logprobs(request, out.logprobs),
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )
            for out in sorted(final.outputs, key=lambda o: o.index)
        ]
        usage = self.with_details(make_usage(len(final.prompt_token_ids), sum(len(o.token_ids) for o in final.outputs)),
                                  final.num_cached_tokens or 0)
        response = ChatCompletionResponse(**header, choices=choices, usage=usage)
        if request.prompt_logprobs is not None:
            response.prompt_logprobs = self.prompt_logprobs(final.prompt_logprobs)
        return response

    # ------------------------------------------------------------------------------------------------ stream
    async def _stream(self, request: ChatCompletionRequest, num_prompt_tokens: int,
                      stream: AsyncIterator[RequestOutput], header: dict, role: str) -> AsyncGenerator[str, None]:
        num_tokens = [0] * request.n
        first, cached = True, 0
        try:
            async with aclosing(stream):
                async for result in stream:
                    cached = result.num_cached_tokens or cached
                    if first:  # the role opens every choice once the engine accepted the request
                        first = False
                        echo = self._echo(request, role)
                        for index in range(request.n):
                            chunk = self._chunk(header, index, DeltaMessage(role=role, content=""))
                            if request.continuous_usage:
                                chunk.usage = make_usage(num_prompt_tokens, 0)
                            yield sse_event(chunk)
                            if echo:
                                yield sse_event(self._chunk(header, index, DeltaMessage(content=echo)))
                    for out in result.outputs:
                        num_tokens[out.index] += len(out.token_ids)
                        chunk = self._chunk(header, out.index, DeltaMessage(content=out.text),
                                            self._logprobs(request, out.logprobs), out.finish_reason,
                                            out.stop_reason)
                        if request.continuous_usage:
                            chunk.usage = make_usage(num_prompt_tokens, num_tokens[out.index])
                        yield sse_event(chunk)
            if request.include_usage:
                usage = self.with_details(make_usage(num_prompt_tokens, sum(num_tokens)), cached)
                yield sse_event(ChatCompletionStreamResponse(**header, choices=[], usage=usage))
        except ValueError as exc:
            yield sse_event(ErrorResponse.create(str(exc)))
        except EngineDeadError as exc:
            yield sse_event(ErrorResponse.create(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR))
        yield SSE_DONE

    @staticmethod
    def _chunk(header: dict, index: int, delta: DeltaMessage, logprobs: ChatCompletionLogProbs | None = None,
               finish_reason: str | None = None, stop_reason: int | str | None = None
               ) -> ChatCompletionStreamResponse:
        choice = ChatCompletionResponseStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                                    finish_reason=finish_reason, stop_reason=stop_reason)
        return ChatCompletionStreamResponse(**header, choices=[choice])

    # ------------------------------------------------------------------------------------------------ logprobs
    def _logprobs(self, request: ChatCompletionRequest, logprobs: SampleLogprobs | None
                  ) -> ChatCompletionLogProbs | None:
        """OpenAI chat logprobs: per token its text, logprob, UTF-8 bytes and the ``top_logprobs`` best by rank."""
        if not request.logprobs or logprobs is None:
            return None
        num_top = request.top_logprobs or 0
        as_ids = self.tokens_as_ids(request)
        content = []
        for entry in logprobs:
            token_id, own = next(iter(entry.items()))  # the sampled token comes first
            ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank is not None and lp.rank <= num_top)
            top = [self._entry(t, entry[t], as_ids) for _, t in ranked]
            content.append(ChatCompletionLogProbsContent(**self._entry(token_id, own, as_ids).model_dump(),
                                                         top_logprobs=top))
        return ChatCompletionLogProbs(content=content)

    def _entry(self, token_id: int, logprob: Logprob, as_id: bool) -> ChatCompletionLogProb:
        token = self.token_text(token_id, logprob.decoded_token, as_id)
        return ChatCompletionLogProb(token=token, logprob=max(logprob.logprob, -9999.0),
                                     bytes=list(token.encode("utf-8", errors="replace")))
