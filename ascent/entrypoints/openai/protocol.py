"""Pydantic request/response models of the OpenAI-compatible server (OpenAI + vLLM field names and defaults)."""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from http import HTTPStatus
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ascent.outputs import RequestOutputKind
from ascent.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# OpenAI caps top_logprobs at 20; vLLM follows.
MAX_TOP_LOGPROBS = 20
# OpenAI clamps each logit_bias value to [-100, 100]; vLLM follows.
MAX_LOGIT_BIAS = 100.0
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# vLLM request features this server does not implement: rejected rather than silently ignored
_UNSUPPORTED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                       "structured_outputs", "use_beam_search")


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    """Unknown request fields are ignored, as the OpenAI server does."""

    model_config = ConfigDict(extra="ignore")


# ------------------------------------------------------------------------------------------------------- errors
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    """``{"error": {"message", "type", "param", "code"}}``; ``code`` is the HTTP status."""

    error: ErrorInfo

    @classmethod
    def create(cls, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
               err_type: str | None = None, param: str | None = None) -> "ErrorResponse":
        names = {HTTPStatus.BAD_REQUEST: "BadRequestError", HTTPStatus.NOT_FOUND: "NotFoundError"}
        kind = err_type or names.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
        return cls(error=ErrorInfo(message=message, type=kind, param=param, code=int(status)))

    @property
    def status_code(self) -> int:
        return self.error.code


# ------------------------------------------------------------------------------------------------------- common
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None  # with --enable-prompt-tokens-details


def make_usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ascent"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI, then vLLM extras). Unknown fields are
    ignored and logged (as vLLM does); features this server lacks (structured output, tool calls) are a 400."""

    model: str | None = None
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    priority: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    response_format: dict[str, Any] | None = None
    request_id: str | None = None  # the response id's base (an X-Request-Id header wins), vLLM's field
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:<id>" (default: the server's)

    @model_validator(mode="before")
    @classmethod
    def _check_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        unsupported = [name for name in _UNSUPPORTED_FIELDS if data.get(name) not in (None, False)]
        if unsupported:
            raise ValueError(f"{unsupported} are not supported by this server.")
        fmt = data.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
            raise ValueError(f"response_format type {fmt.get('type')!r} (structured output) is not supported by "
                             "this server; only 'text'.")
        plp = data.get("prompt_logprobs")
        if isinstance(plp, int) and not isinstance(plp, bool):
            if data.get("stream") and (plp > 0 or plp == -1):
                raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
            if plp < -1:
                raise ValueError(f"`prompt_logprobs` must be a positive value or -1, got {plp}.")
        ignored = sorted(set(data) - set(cls.model_fields))
        if ignored:
            logger.warning("The following fields were present in the request but ignored: %s", ignored)
        return data

    @model_validator(mode="after")
    def _check_stream_options(self) -> "_SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true.")
        return self

    def _build_params(self, max_tokens: int | None, default_max_tokens: int, logprobs: int | None,
                      defaults: dict[str, Any] | None = None) -> SamplingParams:
        """SamplingParams for this request (raises ValueError on invalid values). A sampling field the request
        leaves unset takes the model's generation_config value from ``defaults`` (SamplingParams keywords), else
        the OpenAI default; without ``max_tokens`` the output may fill the context, capped by the default's."""
        defaults = defaults or {}

        def pick(value: Any, name: str, fallback: Any) -> Any:
            return value if value is not None else defaults.get(name, fallback)

        if max_tokens is None:
            max_tokens = min(default_max_tokens, defaults.get("max_tokens", default_max_tokens))
        logit_bias = _clamped_logit_bias(self.logit_bias) if self.logit_bias else None
        return SamplingParams(
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick(self.repetition_penalty, "repetition_penalty", 1.0),
            temperature=pick(self.temperature, "temperature", 1.0),
            top_p=pick(self.top_p, "top_p", 1.0),
            top_k=pick(self.top_k, "top_k", 0),
            min_p=pick(self.min_p, "min_p", 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


def _clamped_logit_bias(raw: dict[str, float]) -> dict[int, float]:
    """``logit_bias`` with token-id keys and values clamped to [-100, 100] (OpenAI, vLLM); NaN is a ValueError."""
    try:
        bias = {int(k): v for k, v in raw.items()}
    except ValueError as exc:
        raise ValueError(f"logit_bias keys must be token ids, got {list(raw)!r}.") from exc
    nan = [k for k, v in bias.items() if math.isnan(v)]
    if nan:
        raise ValueError(f"logit_bias values must be numbers, got NaN for token ids {nan}.")
    return {k: min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, v)) for k, v in bias.items()}


# ------------------------------------------------------------------------------------------------------- completions
class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. ``max_tokens`` defaults to 16 like OpenAI and vLLM; ``None`` means "to the end"."""

    prompt: list[int] | list[list[int]] | str | list[str]
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True  # e.g. the tokenizer's BOS before the prompt text

    @model_validator(mode="after")
    def _check_completion(self) -> "CompletionRequest":
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}.")
        if self.suffix is not None:
            raise ValueError("suffix is not supported.")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported; only best_of == n.")
        return self

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a list of single prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def echo_without_generation(self) -> bool:
        """``echo`` with ``max_tokens=0`` (OpenAI, vLLM): the prompt comes back (with its logprobs when asked), and
        the engine runs one step that is not returned."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, default_max_tokens: int, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """``default_max_tokens`` (``max_model_len - prompt_len``) applies when ``max_tokens`` is None; ``defaults``:
        the model's generation_config sampling values."""
        max_tokens = 1 if self.echo_without_generation else self.max_tokens
        params = self._build_params(max_tokens, default_max_tokens, self.logprobs, defaults)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = self.logprobs
        return params


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """One alternative of a prompt position (vLLM's ``Logprob``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token, None (the first) or {token id: Logprob}
PromptLogprobsField = list[dict[int, PromptLogprob] | None] | None


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsField = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------------------------------------------- chat
def _reject_request_template(chat_template: str | None) -> None:
    # A client-chosen template (or template file path) is not trusted, as in vLLM without
    # --trust-request-chat-template; the server's --chat-template applies.
    if chat_template is not None:
        raise ValueError("a per-request chat_template is not accepted; start the server with --chat-template.")


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions. Absent ``max_completion_tokens``/``max_tokens`` mean "to the end" (vLLM)."""

    messages: list[dict[str, Any]]
    logprobs: bool = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # the last message's content before the reply when it has the reply's role (vLLM)
    add_special_tokens: bool = False  # the template already placed them
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_logprobs(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("top_logprobs") is not None:
            top = data["top_logprobs"]
            if isinstance(top, int) and not 0 <= top <= MAX_TOP_LOGPROBS:
                raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}.")
            if top and not data.get("logprobs"):
                raise ValueError("when using top_logprobs, logprobs must be set to true.")
        if isinstance(data, dict) and data.get("tools") and data.get("tool_choice", "auto") != "none":
            raise ValueError("tool calling is not supported by this server (tools need tool_choice 'none').")
        return data

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        _reject_request_template(self.chat_template)
        if not self.messages:
            raise ValueError("messages must contain at least one message.")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true.")
        return self

    def to_sampling_params(self, default_max_tokens: int, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``; neither -> ``default_max_tokens``;
        ``defaults``: the model's generation_config sampling values."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._build_params(max_tokens, default_max_tokens, logprobs, defaults)


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsField = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------------------------------------------- tokens
class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: either ``prompt`` or chat ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _check_one(self) -> "TokenizeRequest":
        _reject_request_template(self.chat_template)
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages must be given.")
        if self.continue_final_message and self.add_generation_prompt and self.messages is not None:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true.")
        return self


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


def _chunk_fields(value: Any) -> Any:
    """``value`` as JSON data, models without the None fields nobody set (a None passed explicitly stays)."""
    if isinstance(value, BaseModel):
        return {name: _chunk_fields(getattr(value, name)) for name in type(value).model_fields
                if getattr(value, name) is not None or name in value.model_fields_set}
    if isinstance(value, (list, tuple)):
        return [_chunk_fields(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _chunk_fields(v) for k, v in value.items()}
    return value


def sse_event(chunk: BaseModel) -> str:
    """One server-sent event: ``data: <json>`` and a blank line. A None field is left out unless it was set
    explicitly, so an open choice carries ``"finish_reason": null`` as in vLLM's and OpenAI's chunks."""
    return f"data: {json.dumps(_chunk_fields(chunk), ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
