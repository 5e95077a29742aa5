"""Workloads of ``ascent bench spec`` (locally generated chat conversations, no downloads), tokenized with the model's
own tokenizer and chat template.

- ``repetitive``: code-edit style prompts (a code snippet or JSON record to return with a small edit), structured
  answers re-asked in a follow-up turn and "repeat this paragraph" requests; greedy decoding tends to copy the input,
  which is where prompt-lookup (n-gram) and suffix drafting find matches;
- ``non_repetitive``: varied natural-language questions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ascent.benchmarks.datasets import BenchRequest

WORKLOADS = ("repetitive", "non_repetitive")

_NAMES = ("values", "items", "records", "scores", "prices", "events", "rows", "weights", "samples", "orders")
_VARS = ("total", "count", "result", "acc", "best", "limit", "offset", "factor", "step", "window")
_FUNCS = ("summarize", "filter_rows", "normalize", "accumulate", "rank_items", "merge_counts", "clip_values",
          "moving_sum", "bucketize", "score_events")
_KEYS = ("name", "version", "timeout", "retries", "region", "owner", "max_batch", "log_level", "cache_size", "enabled")
_TASKS = ("deploying a web service", "reviewing a pull request", "preparing a release", "onboarding a new engineer",
          "migrating a database", "debugging a memory leak", "writing a design document", "running a load test")
_STEPS = ("Read the current documentation", "List the open questions", "Write down the expected result",
          "Run the automated tests", "Check the logs for errors", "Ask a colleague for a review",
          "Update the change log", "Measure the baseline first", "Back up the existing data",
          "Announce the change to the team", "Verify the rollback plan", "Close the related tickets")
_SENTENCES = ("The river runs past the old mill and into the valley.", "Every morning the baker lights the oven.",
              "A small bell rings when the door opens.", "The library keeps its oldest maps in a locked room.",
              "Children play football in the square after school.", "The train to the coast leaves at noon.",
              "Snow covers the hills for most of the winter.", "The market sells fresh fruit on Saturdays.")
_QUESTIONS = ("Why is the sky blue", "How do vaccines train the immune system", "What causes ocean tides",
              "How does a bicycle stay upright", "Why do leaves change colour in autumn",
              "What is the difference between weather and climate", "How do bees make honey",
              "Why does bread rise", "How does a compass work", "What makes a good night's sleep",
              "How do airplanes fly", "Why do cats purr", "How is glass made", "What is inflation",
              "How do solar panels produce electricity", "Why do we have leap years", "How do volcanoes form",
              "What does a city planner do", "How does the heart pump blood", "Why is the ocean salty")
_STYLES = ("Answer in two sentences.", "Explain it to a ten-year-old.", "Give one concrete example.",
           "Answer briefly.", "Mention one common misconception.", "Use a short analogy.")

# ------------------------------------------------------------------------------------------------ workloads
def _code_snippet(rng: np.random.Generator) -> tuple[str, str]:
    """A small Python function built from templates; returns (code, name of a local variable to rename)."""
    fn, seq = str(rng.choice(_FUNCS)), str(rng.choice(_NAMES))
    acc, lim = (str(v) for v in rng.choice(_VARS, size=2, replace=False))
    factor = int(rng.integers(2, 9))
    code = (f"def {fn}({seq}, {lim}):\n"
            f"    {acc} = 0\n"
            f"    for item in {seq}:\n"
            f"        if item > {lim}:\n"
            f"            {acc} += item * {factor}\n"
            f"        else:\n"
            f"            {acc} -= item\n"
            f"    return {acc}\n")
    return code, acc


def _code_edit(rng: np.random.Generator) -> list[dict[str, str]]:
    code, var = _code_snippet(rng)
    new = f"{var}_{rng.choice(('sum', 'value', 'out', 'tmp'))}"
    return [{"role": "user", "content": f"Here is a Python function:\n```python\n{code}```\nRename the variable "
                                        f"`{var}` to `{new}` and return the complete updated function in one code "
                                        f"block, without any explanation."}]


def _json_edit(rng: np.random.Generator) -> list[dict[str, str]]:
    keys = [str(k) for k in rng.choice(_KEYS, size=6, replace=False)]
    record = ",\n".join(f'  "{k}": {int(rng.integers(1, 500))}' for k in keys)
    key, value = keys[int(rng.integers(0, len(keys)))], int(rng.integers(500, 999))
    return [{"role": "user", "content": f"Here is a configuration file:\n```json\n{{\n{record}\n}}\n```\nSet "
                                        f'"{key}" to {value} and output the complete file again.'}]


def _reask(rng: np.random.Generator) -> list[dict[str, str]]:
    task = str(rng.choice(_TASKS))
    steps = [str(s) for s in rng.choice(_STEPS, size=5, replace=False)]
    answer = "\n".join(f"{i + 1}. {s}." for i, s in enumerate(steps))
    return [{"role": "user", "content": f"Give me a short checklist for {task}."},
            {"role": "assistant", "content": f"Checklist for {task}:\n{answer}"},
            {"role": "user", "content": "Write the checklist above again, exactly as it is, and add a sixth step "
                                        "at the end."}]


def _repeat_text(rng: np.random.Generator) -> list[dict[str, str]]:
    paragraph = " ".join(str(s) for s in rng.choice(_SENTENCES, size=4, replace=False))
    return [{"role": "user", "content": f"Repeat the following paragraph word for word:\n\n{paragraph}"}]


def repetitive_conversations(num: int, seed: int) -> list[list[dict[str, str]]]:
    """``num`` code-edit / re-ask / repeat conversations (the four kinds in turn), seeded."""
    rng = np.random.default_rng(seed)
    kinds = (_code_edit, _json_edit, _reask, _repeat_text)
    return [kinds[i % len(kinds)](rng) for i in range(num)]


def non_repetitive_conversations(num: int, seed: int) -> list[list[dict[str, str]]]:
    """``num`` varied natural-language questions (distinct up to 120 prompts), seeded."""
    rng = np.random.default_rng(seed)
    pairs = [(q, s) for s in _STYLES for q in _QUESTIONS]
    order = rng.permutation(len(pairs))
    return [[{"role": "user", "content": f"{pairs[order[i % len(pairs)]][0]}? "
                                         f"{pairs[order[i % len(pairs)]][1]}"}] for i in range(num)]


def encode_conversation(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the conversation through the tokenizer's chat template (plain ``role: text`` lines without)."""
    if getattr(tokenizer, "chat_template", None):
        from ascent.tokenizer import apply_chat_template

        text = apply_chat_template(tokenizer, messages, add_generation_prompt=True)
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return list(tokenizer.encode(text, add_special_tokens=False))


def build_workloads(tokenizer: Any, num_prompts: int, output_len: int, seed: int,
                    ) -> dict[str, list[BenchRequest]]:
    """The two workloads as token-id requests, each of ``num_prompts`` prompts and ``output_len`` max tokens."""
    makers = {"repetitive": repetitive_conversations, "non_repetitive": non_repetitive_conversations}
    return {name: [BenchRequest(encode_conversation(tokenizer, conv), output_len)
                   for conv in makers[name](num_prompts, seed)] for name in WORKLOADS}
