"""Tokenizer loading (HF directory or GGUF metadata) and chat-template rendering."""

from __future__ import annotations

import os
from typing import Any

from ascent.default_model import is_gguf_path, resolve_model_path

# A value containing any of these is a template string, not a file path (vLLM's rule).
_JINJA_CHARS = "{}\n"


def load_chat_template(chat_template: str) -> str:
    """Template text from ``chat_template``: a readable file's contents, or the value itself when it is a template.

    A value that looks like a path (no ``{``, ``}`` or newline) but is not a readable file raises ValueError naming it.
    """
    if not isinstance(chat_template, str) or not chat_template:
        raise ValueError(f"chat_template must be a non-empty string, got {chat_template!r}")
    if os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    if any(c in chat_template for c in _JINJA_CHARS):
        return chat_template
    raise ValueError(f"chat_template {chat_template!r} is neither a readable file nor a template string")


def get_tokenizer(model_path: str, tokenizer: str | None = None, chat_template: str | None = None) -> Any:
    """The tokenizer for a model (a ``transformers.PreTrainedTokenizerBase``).

    ``tokenizer`` (a directory, a ``.gguf`` file or the default model name) overrides where it is loaded from;
    directories load with ``AutoTokenizer`` (local files only), GGUF files are built from their metadata.
    ``chat_template`` (file path or template string) replaces the model's own template.
    """
    source = resolve_model_path(model_path) if tokenizer is None else resolve_model_path(tokenizer, "tokenizer")
    if is_gguf_path(source):
        from ascent.loader.gguf import gguf_tokenizer

        tok = gguf_tokenizer(source)
    else:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"cannot load a tokenizer from {source!r}: {exc}") from exc
    if chat_template is not None:
        tok.chat_template = load_chat_template(chat_template)
    return tok


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **kwargs: Any,
) -> str:
    """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) to the prompt string.

    ``chat_template`` (file path or template string) overrides the tokenizer's template. Raises ValueError when
    neither exists or ``messages`` is not a list of dicts. Extra ``kwargs`` reach the template (e.g. ``tools``).
    """
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"messages must be a list of dicts, got {messages!r}")
    template = load_chat_template(chat_template) if chat_template is not None else None
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; pass one with --chat-template"
        )
    return tokenizer.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )


_TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with string content, as vLLM renders them for a string template: missing or null content is "", a
    list of parts (plain strings, ``text`` / ``input_text`` / ``output_text`` / ``refusal`` parts) is joined by
    newlines; other parts (images, audio) are a ValueError."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role', got {message!r}.")
        content = message.get("content")
        if content is None:
            message = {**message, "content": ""}
        elif isinstance(content, list):
            message = {**message, "content": "\n".join(_part_text(i, part) for part in content)}
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts, got {content!r}.")
        out.append(message)
    return out


def _part_text(index: int, part: Any) -> str:
    if isinstance(part, str):
        return part
    key = _TEXT_PART_KEYS.get(part.get("type")) if isinstance(part, dict) else None
    if key is None or not isinstance(part.get(key), str):
        raise ValueError(f"messages[{index}].content: only text parts are supported, got {part!r}.")
    return part[key]
