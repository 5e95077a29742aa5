"""The offline ``LLM`` class with vLLM's shapes: ``LLM(model=..., **engine_args).generate(prompts, params)``."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

from ascent.args import EngineArgs
from ascent.core.llm_engine import LLMEngine, PromptType
from ascent.outputs import RequestOutput, RequestOutputKind
from ascent.sampling_params import SamplingParams
from ascent.tokenizer import apply_chat_template, normalize_messages

ChatMessages = list[dict[str, Any]]
CONTENT_FORMATS = ("auto", "string", "openai")  # message content as text, or as OpenAI parts: both are accepted


def _check_no_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError(f"lora_request={lora_request!r}: LoRA adapters are not served by this build; pass None.")


class LLM:
    """Offline batched inference.

    ``LLM(model=None)`` loads the bundled SmolLM2-135M-Instruct; any ``EngineArgs`` field is accepted as a keyword.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        import dataclasses

        known = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; valid ones: {sorted(known)}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a call without any uses (as vLLM): the model's ``generation_config.json`` sampling
        values (temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens as max_tokens) over
        SamplingParams' own defaults."""
        return SamplingParams(**self.llm_engine.generation_defaults())

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions; returns one RequestOutput per prompt, in input order. ``use_tqdm`` may be a tqdm-like
        factory (vLLM); ``lora_request`` is accepted for vLLM's signature and must be None (no LoRA in this build)."""
        _check_no_lora(lora_request)
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) and not hasattr(prompts, "__iter__"):
            raise ValueError(f"prompts={prompts!r} must be a prompt (str, dict, token ids) or a sequence of them.")
        prompts = list(prompts)
        params = self._expand_params(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries but there are {len(prompts)} prompts.")
        return self._run(prompts, params, priority, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | list[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate. Message content may be a
        string or a list of OpenAI text parts (either ``chat_template_content_format``); ``continue_final_message``
        leaves the last (assistant) message open for the model to continue; ``tools`` reach the template;
        ``chat_template_kwargs`` are passed last and win over the named options (vLLM)."""
        _check_no_lora(lora_request)
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r} must be one of "
                             f"{CONTENT_FORMATS}.")
        kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, "chat_template": chat_template,
                                  "continue_final_message": continue_final_message}
        if tools is not None:
            kwargs["tools"] = tools
        kwargs.update(chat_template_kwargs or {})
        kwargs.pop("tokenize", None)  # the prompt is rendered as text, then tokenized here
        if kwargs["continue_final_message"] and kwargs["add_generation_prompt"]:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true.")
        if not kwargs["continue_final_message"]:
            del kwargs["continue_final_message"]
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [apply_chat_template(self.get_tokenizer(), normalize_messages(conv), **kwargs)
                   for conv in conversations]
        tok = self.get_tokenizer()
        token_prompts = [{"prompt": p, "prompt_token_ids": tok.encode(p, add_special_tokens=False)} for p in prompts]
        return self.generate(token_prompts, sampling_params, use_tqdm=use_tqdm)

    def _expand_params(self, sampling_params, num: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * num
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num
        sampling_params = list(sampling_params)
        if len(sampling_params) != num:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {num} prompts.")
        return sampling_params

    def _run(self, prompts, params, priority, use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                p = p.clone()
                p.output_kind = RequestOutputKind.FINAL_ONLY
                ids.append(engine.add_request(None, prompt, p, priority=priority[i] if priority else 0))
        except Exception:
            engine.abort_request(ids)
            raise
        results: dict[str, RequestOutput] = {}
        progress = use_tqdm if callable(use_tqdm) else tqdm
        bar = progress(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop worker processes (TP/EP) and release the engine; also done automatically at exit."""
        self.llm_engine.shutdown()
