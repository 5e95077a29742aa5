"""Independent float64 numpy reference of the vLLM v1 sampling pipeline, written from the formulas (not our code).

Per row: allowed_token_ids -> min_tokens -> logit_bias -> penalties -> (greedy: argmax) -> temperature -> min-p ->
top-k -> top-p (renormalised over the top-k set) -> softmax.
"""

from __future__ import annotations

import numpy as np

from ascent.sampling_params import SamplingParams


def processed_logits(logits: np.ndarray, prompt: list[int], output: list[int], p: SamplingParams) -> np.ndarray:
    """Masks, bias and penalties for one row, by explicit loops over the vocabulary."""
    x = np.asarray(logits, dtype=np.float64).copy()
    vocab = x.shape[0]
    if p.allowed_token_ids is not None:
        for t in range(vocab):
            if t not in p.allowed_token_ids:
                x[t] = -np.inf
    if len(output) < p.min_tokens:
        for t in set(p._eos_token_ids) | set(p.stop_token_ids):
            x[t] = -np.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in range(vocab):
        count = sum(1 for o in output if o == t)
        if t in prompt or count > 0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * count
        if count > 0:
            x[t] -= p.presence_penalty
    return x


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def support_after_truncation(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Bool mask of tokens that survive temperature -> min-p -> top-k -> top-p for one processed row."""
    x = x / p.temperature
    keep = np.isfinite(x)
    if p.min_p > 0:
        probs = _softmax(x)
        keep &= probs >= p.min_p * probs.max()
    if 0 < p.top_k < x.shape[0]:
        kth = np.sort(x[keep])[::-1][min(p.top_k, keep.sum()) - 1]
        keep &= x >= kth
    if p.top_p < 1.0:
        probs = _softmax(np.where(keep, x, -np.inf))
        order = np.argsort(-probs, kind="stable")
        before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
        top_p_keep = np.zeros_like(keep)
        top_p_keep[order[before < p.top_p]] = True
        keep &= top_p_keep
    return keep


def target_probs(logits: np.ndarray, prompt: list[int], output: list[int], p: SamplingParams) -> np.ndarray:
    """The exact distribution the sampler must draw from for one row (one-hot argmax for greedy rows)."""
    x = processed_logits(logits, prompt, output, p)
    if p.temperature < 1e-5:
        out = np.zeros_like(x)
        out[int(np.argmax(x))] = 1.0
        return out
    keep = support_after_truncation(x, p)
    return _softmax(np.where(keep, x / p.temperature, -np.inf))
