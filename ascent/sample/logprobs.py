"""Logprobs of sampled (or prompt) tokens plus the top-k alternatives (vLLM "raw_logprobs" mode).

Logprobs are ``log_softmax`` of the RAW logits (before penalties, masks, temperature, truncation). The rank of a
token is 1-based: the number of vocabulary entries whose logprob is ``>=`` the token's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascent.core.sched_output import LogprobsEntry


@dataclass
class LogprobsTensors:
    """Logprobs for ``N`` positions.

    token_ids: int64 ``[N, 1 + k]``, column 0 = the sampled / target token, then the top-k ids by decreasing logprob;
    logprobs: float32 ``[N, 1 + k]`` aligned with ``token_ids``; ranks: int64 ``[N]``, 1-based rank of column 0.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    def to_entries(self) -> list[LogprobsEntry]:
        """One LogprobsEntry per row (host lists)."""
        ids = self.token_ids.tolist()
        lps = self.logprobs.tolist()
        ranks = self.ranks.tolist()
        return [LogprobsEntry(token_ids=i, logprobs=lp, rank=r) for i, lp, r in zip(ids, lps, ranks)]


def compute_logprobs_tensors(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Logprobs of ``token_ids`` under ``logits`` plus the top ``num_logprobs``.

    ``logits``: ``[N, V]`` raw (any float dtype; computed in float32); ``token_ids``: int ``[N]`` or ``[N, 1]``;
    ``num_logprobs``: ``>= 0``, or ``-1`` for the whole vocabulary (``k = V``). For prompt logprobs pass the logits of
    the prompt positions and the NEXT prompt token of each position as ``token_ids``.
    """
    num_rows, vocab_size = logits.shape
    if num_logprobs < -1:
        raise ValueError(f"num_logprobs must be >= -1, got {num_logprobs}.")
    k = vocab_size if num_logprobs == -1 else min(num_logprobs, vocab_size)
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    targets = token_ids.reshape(num_rows, 1).to(device=logits.device, dtype=torch.int64)
    target_lp = logprobs.gather(1, targets)
    ranks = (logprobs >= target_lp).sum(dim=-1)
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        targets = torch.cat([targets, top_ids], dim=1)
        target_lp = torch.cat([target_lp, top_lp], dim=1)
    return LogprobsTensors(token_ids=targets, logprobs=target_lp, ranks=ranks)
