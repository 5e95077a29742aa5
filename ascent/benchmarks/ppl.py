"""Teacher-forced perplexity through the engine's ``prompt_logprobs`` on fixed windows of the local corpus.

Windows are taken from the *end* of ``benchmarks/data/ppl_corpus.txt`` (calibration for static activation scales and
SmoothQuant reads its beginning), each ``window`` tokens long and non-overlapping; the first token of a window has no
logprob, so a window scores ``window - 1`` tokens. ppl = exp(-mean logprob) over every scored token.
"""

from __future__ import annotations

import math
from typing import Any

from ascent.quantization.export.calibrate import corpus_token_ids


def corpus_windows(tokenizer: Any, num_tokens: int, window: int) -> list[list[int]]:
    """``ceil(num_tokens / window)`` windows of ``window`` tokens from the corpus tail (ValueError if too short)."""
    if window < 2 or num_tokens < 1:
        raise ValueError(f"ppl window={window} must be >= 2 and ppl tokens={num_tokens} >= 1")
    ids = corpus_token_ids(tokenizer)
    count = math.ceil(num_tokens / window)
    if count * window > len(ids):
        raise ValueError(f"ppl needs {count} x {window} tokens but the corpus has {len(ids)}; lower --ppl-tokens")
    tail = ids[len(ids) - count * window:]
    return [tail[i * window:(i + 1) * window] for i in range(count)]


def engine_perplexity(llm: Any, windows: list[list[int]]) -> dict[str, float]:
    """Perplexity of ``llm`` on ``windows`` (one ``generate`` with ``prompt_logprobs=0``, one new token each)."""
    from ascent import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    total, count = 0.0, 0
    for window, out in zip(windows, outputs):
        entries = out.prompt_logprobs or []
        for token, entry in zip(window[1:], entries[1:]):
            if entry is None or token not in entry:
                raise ValueError(f"prompt_logprobs lack the logprob of prompt token {token}")
            total += float(entry[token].logprob)
            count += 1
    if count != sum(len(w) - 1 for w in windows):
        raise ValueError(f"prompt_logprobs scored {count} tokens, expected {sum(len(w) - 1 for w in windows)}")
    return {"perplexity": math.exp(-total / count), "scored_tokens": count, "mean_logprob": total / count}
