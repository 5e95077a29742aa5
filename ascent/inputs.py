"""Prompt types of the offline API, with vLLM's names (``vllm.inputs``): plain dicts at run time."""

from __future__ import annotations

from typing import NotRequired, TypedDict, Union


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine."""

    prompt: str


class TokensPrompt(TypedDict):
    """A tokenized prompt (``prompt`` optionally names its text for the outputs)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = Union[str, TextPrompt, TokensPrompt]

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
