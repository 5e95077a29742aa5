"""Medusa proposer (``method: "medusa"``, ``model: <heads dir>``; Cai et al., arXiv 2401.10774).

``K`` heads read the target's final hidden state at the position that produced the last committed token; head ``i``
(``i = 0..K-1``) predicts the token ``i + 1`` places after it, so all ``k <= K`` drafts come from one pass (no KV
cache). Head ``i`` = ``num_layers`` residual blocks ``x + SiLU(W x + b)`` then a vocabulary projection. Checkpoint
layouts: FasterDecoding's ``medusa_head.{i}.{j}.linear.{weight,bias}`` + ``medusa_head.{i}.{num_layers}.weight``
(``medusa_heads.`` accepted too), or vLLM's ``blocks.{i}.layers.{j}.{weight,bias}`` + ``lm_heads.{i}.weight``;
``config.json``: ``medusa_num_heads`` / ``medusa_num_layers`` (or vLLM's ``num_heads`` / ``num_hidden_layers``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ascent.spec_decode.base import SpeculativeConfig, pad_drafts
from ascent.spec_decode.model_proposer import ModelProposer, TargetStep
from ascent.spec_decode.registry import register_proposer

_FASTER_DECODING = re.compile(r"^medusa_heads?\.(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")
_VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")


class MedusaHeads(nn.Module):
    """``forward(hidden [n, H]) -> fp32 logits [K, n, V]``."""

    def __init__(self, num_heads: int, num_layers: int, hidden: int, vocab: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(hidden, hidden, dtype=dtype) for _ in range(num_layers)) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden, vocab, bias=False, dtype=dtype) for _ in range(num_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        outs = []
        for block, head in zip(self.blocks, self.lm_heads):
            x = hidden
            for layer in block:
                x = x + nn.functional.silu(layer(x))
            outs.append(head(x).float())
        return torch.stack(outs)

    def load(self, weights: dict[str, torch.Tensor], num_layers: int) -> None:
        """Load either layout; ValueError naming what is missing or unknown."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights.items():
            target = _module_name(name, num_layers)
            if target is None or target not in params:
                raise ValueError(f"unexpected Medusa checkpoint tensor {name!r}")
            with torch.no_grad():
                params[target].copy_(tensor.to(params[target].dtype))
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"Medusa checkpoint is missing {', '.join(missing[:6])}")


def _module_name(name: str, num_layers: int) -> str | None:
    m = _FASTER_DECODING.match(name)
    if m:
        i, j, kind = int(m.group(1)), int(m.group(2)), m.group(3)
        return f"lm_heads.{i}.weight" if j == num_layers else f"blocks.{i}.{j}.{kind}"
    m = _VLLM_BLOCK.match(name)
    if m:
        return f"blocks.{m.group(1)}.{m.group(2)}.{m.group(3)}"
    m = _VLLM_HEAD.match(name)
    return f"lm_heads.{m.group(1)}.weight" if m else None


@register_proposer("medusa")
class MedusaProposer(ModelProposer):
    """All ``k`` drafts from the target's last valid hidden state, one pass over ``k`` heads."""

    needs_hidden_states = True

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        self.heads: MedusaHeads | None = None
        self._last: dict[str, tuple[int, torch.Tensor]] = {}

    def load_model(self, target_model: nn.Module | None) -> None:
        from ascent.loader.hf import iterate_safetensors_weights

        assert self.env is not None and target_model is not None and self.config.model is not None
        cfg = json.loads((Path(self.config.model) / "config.json").read_text())
        num_heads = int(cfg.get("medusa_num_heads", cfg.get("num_heads", 0)))
        num_layers = int(cfg.get("medusa_num_layers", cfg.get("num_hidden_layers", 1)))
        if self.k > num_heads:
            raise ValueError(f"num_speculative_tokens={self.k} is invalid: the Medusa checkpoint has {num_heads} "
                             "heads")
        hidden, vocab = int(target_model.config.hidden_size), int(target_model.config.vocab_size)
        with torch.device(self.env.device):
            heads = MedusaHeads(num_heads, num_layers, hidden, vocab, self.env.dtype)
        heads.load(dict(iterate_safetensors_weights(self.config.model)), num_layers)
        self.heads = heads.eval()

    def observe(self, step: TargetStep) -> None:
        for i, req_id in enumerate(step.req_ids):
            n = int(step.num_valid[i])
            if n:
                rows = step.rows(i)
                self._last[req_id] = (int(step.first_positions[i]) + n - 1, step.hidden_states[rows.stop - 1])

    def remove_request(self, req_id: str) -> None:
        super().remove_request(req_id)
        self._last.pop(req_id, None)

    def propose(self, req_ids: list[str], token_ids: list[np.ndarray], max_num_tokens: list[int]) -> np.ndarray:
        self._check_batch(req_ids, token_ids, max_num_tokens)
        assert self.heads is not None
        ready = [i for i, (r, t) in enumerate(zip(req_ids, token_ids))
                 if r in self._last and self._last[r][0] == len(t) - 2 and max_num_tokens[i] > 0]
        drafts: list[list[int]] = [[] for _ in req_ids]
        for r in req_ids:
            self._probs.pop(r, None)
        if ready:
            hidden = torch.stack([self._last[req_ids[i]][1] for i in ready])
            logits = self.heads(hidden)
            sub = [req_ids[i] for i in ready]
            for j in range(min(self.k, max(max_num_tokens[i] for i in ready))):
                tokens = self.sample_drafts(sub, logits[j]).tolist()
                for i, t in zip(ready, tokens):
                    if j < max_num_tokens[i]:
                        drafts[i].append(int(t))
        return pad_drafts(drafts, self.k)
