"""EAGLE / EAGLE-3 proposers (``method: "eagle"`` / ``"eagle3"``, ``model: <head dir>``): chain drafting of ``k``
tokens with a one-layer head over the target's features (heads: :mod:`ascent.spec_decode.eagle_heads`).

The draft input at position ``p`` pairs token ``p + 1`` with the target's feature at ``p``: EAGLE-1 uses the
target's final hidden state, EAGLE-3 the aux hidden states of layers ``eagle_aux_hidden_state_layer_ids`` (from
``speculative_config.draft_model_config.hf_config``, else the head's ``config.json``, else vLLM's default
``(2, L // 2, L - 3)``; id ``i`` = residual stream entering target layer ``i``, ``L`` = the last layer's output)
fused by the head's ``fc``. Later chain steps feed the head's own output. The head has its own paged KV cache
(:class:`DraftModelRunner`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ascent.layers.embed_head import VocabParallelEmbedding
from ascent.loader.base import finalize_model
from ascent.spec_decode.base import SpeculativeConfig
from ascent.spec_decode.draft_runner import DraftModelRunner
from ascent.spec_decode.eagle_heads import Eagle1Head, Eagle3Head, load_head_weights, normalize_name
from ascent.spec_decode.model_proposer import ChainDrafter, TargetStep
from ascent.spec_decode.registry import register_proposer


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's EAGLE-3 default: ``(2, L // 2, L - 3)``."""
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layers(ids: list[int], num_layers: int) -> tuple[int, ...]:
    """ValueError unless every id is in ``[0, num_layers]``."""
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"eagle_aux_hidden_state_layer_ids={ids} is invalid for a target with {num_layers} layers: "
                         f"ids must be in [0, {num_layers}] (set them in the head config or draft_model_config)")
    return tuple(ids)


def _read_weights(model_dir: str) -> dict[str, torch.Tensor]:
    from ascent.loader.hf import iterate_safetensors_weights

    return dict(iterate_safetensors_weights(model_dir))


@register_proposer("eagle")
@register_proposer("eagle3")
class EagleProposer(ChainDrafter):
    """EAGLE-1 (``method="eagle"``) or EAGLE-3 (``method="eagle3"``) chain drafting."""

    uses_target_hidden = True
    needs_hidden_states = True

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        self.eagle3 = config.method == "eagle3"
        self.head: Eagle1Head | Eagle3Head | None = None
        self.target_lm_head: nn.Module | None = None

    def load_model(self, target_model: nn.Module | None) -> None:
        from ascent.loader.model_info import load_hf_config

        assert self.env is not None and target_model is not None and self.config.model is not None
        head_config = load_hf_config(self.config.model)
        weights = _read_weights(self.config.model)
        names = {normalize_name(n) for n in weights}
        target_config = target_model.config
        with torch.device(self.env.device):
            if self.eagle3:
                self.capture_layers = self._aux_layers(head_config, int(target_config.num_hidden_layers))
                head: nn.Module = Eagle3Head(head_config, self.env.dtype, len(self.capture_layers),
                                             int(target_config.hidden_size), int(target_config.vocab_size))
                if "lm_head.weight" not in names:
                    head.lm_head = None
            else:
                head = Eagle1Head(head_config, self.env.dtype, fc_bias="fc.bias" in names)
            if "embed_tokens.weight" in names:
                head.embed_tokens = VocabParallelEmbedding(int(target_config.vocab_size),
                                                           int(target_config.hidden_size), self.env.dtype,
                                                           prefix="embed_tokens")
        loaded = load_head_weights(head, weights.items())
        missing = sorted(set(dict(head.named_parameters())) - loaded)
        if missing:
            raise ValueError(f"EAGLE head {self.config.model!r} is missing weights for: {', '.join(missing[:10])}")
        finalize_model(head)
        self._share_target_modules(head, target_model)
        self.head = head.eval()
        self.target_lm_head = target_model.lm_head
        self.runner = DraftModelRunner(self.head, self.env, self.k)

    def _aux_layers(self, head_config: object, num_layers: int) -> tuple[int, ...]:
        ids = self.config.aux_hidden_state_layer_ids() or getattr(head_config, "eagle_aux_hidden_state_layer_ids",
                                                                 None)
        if not ids:
            path = Path(self.config.model or "") / "config.json"
            ids = json.loads(path.read_text()).get("eagle_aux_hidden_state_layer_ids") if path.exists() else None
        return check_aux_layers(list(ids or default_aux_layers(num_layers)), num_layers)

    @staticmethod
    def _share_target_modules(head: nn.Module, target_model: nn.Module) -> None:
        if head.embed_tokens is None:
            head.embed_tokens = target_model.model.embed_tokens
        if isinstance(head, Eagle3Head) and head.lm_head is None:
            if head.draft_vocab_size != head.vocab_size:
                raise ValueError("an EAGLE-3 head with a reduced draft vocabulary needs its own lm_head.weight")
            head.lm_head = target_model.lm_head

    # ------------------------------------------------------------------------------------------------ drafting
    def target_features(self, step: TargetStep, i: int) -> torch.Tensor:
        if not self.eagle3:
            return step.hidden_states[step.rows(i)]
        assert step.aux_hidden_states is not None, "EAGLE-3 needs the target's aux hidden states"
        return torch.cat([a[step.rows(i)] for a in step.aux_hidden_states], dim=-1)

    def first_carry(self, features: torch.Tensor) -> torch.Tensor:
        assert self.head is not None
        return self.head.combine(features) if isinstance(self.head, Eagle3Head) else features

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                carry: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.head is not None and carry is not None
        if isinstance(self.head, Eagle3Head):
            return self.head(input_ids, positions, carry)
        out = self.head(input_ids, positions, carry)
        return out, out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.head is not None and self.target_lm_head is not None
        if isinstance(self.head, Eagle3Head):
            return self.head.compute_logits(hidden)
        return self.target_lm_head(hidden).float()

