"""Draft-model proposer (``method: "draft_model"``): a smaller causal LM drafting ``k`` tokens autoregressively.

Two sources for the drafter:
* ``model: <dir>``: a separate HF checkpoint with the target's vocabulary (a different ``vocab_size`` is a
  ValueError), loaded with the engine's dtype and load format;
* ``draft_num_layers: N`` (an ascent extension key; ``model`` may then be omitted): the target truncated to its first
  ``N`` decoder layers followed by the target's final norm, sharing every weight module with the target (embedding,
  the ``N`` layers' projections and norms, final norm and ``lm_head``: the very module objects, so packed or
  quantized weights and their post-load state are shared too, no copy) but with its own attention (KV cache)
  layers. ``N = num_hidden_layers`` drafts the target's own greedy continuation (an oracle useful for testing).
The drafter consumes the same tokens as the target (its own KV cache, :mod:`ascent.spec_decode.draft_runner`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ascent.spec_decode.base import SpeculativeConfig
from ascent.spec_decode.draft_runner import DraftModelRunner
from ascent.spec_decode.model_proposer import ChainDrafter
from ascent.spec_decode.registry import register_proposer


def truncated_model(target: nn.Module, num_layers: int, device: torch.device) -> nn.Module:
    """The target's class built with ``num_layers`` layers whose weight modules ARE the target's (see
    :func:`share_modules`); only the attention layers that own a KV cache are the draft's own."""
    config = copy.copy(target.config)
    total = int(config.num_hidden_layers)
    if not 1 <= num_layers <= total:
        raise ValueError(f"draft_num_layers={num_layers} is invalid: must be in [1, {total}] (the target's layers)")
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:num_layers]
    with torch.device(device):
        draft = type(target)(config, dtype=target.dtype)
    share_modules(draft, target)
    share_parameters(draft, target)
    return draft.eval()


def _has_kv_layer(module: nn.Module) -> bool:
    from ascent.spec_decode.draft_runner import is_kv_layer

    return any(is_kv_layer(m) for m in module.modules())


def share_modules(dst: nn.Module, src: nn.Module) -> None:
    """Replace every submodule of ``dst`` that holds no KV-cache layer by the same-named module of ``src`` (the whole
    object: parameters, buffers and any packed / quantized state set up at load time); recurse into the others, so
    only the KV-cache layers themselves stay ``dst``'s own."""
    from ascent.spec_decode.draft_runner import is_kv_layer

    for name, child in list(dst.named_children()):
        other = getattr(src, name, None)
        if not isinstance(other, nn.Module) or is_kv_layer(child):
            continue
        if isinstance(child, nn.ModuleList) and isinstance(other, nn.ModuleList):
            for i, item in enumerate(child):
                if _has_kv_layer(item):
                    share_modules(item, other[i])
                else:
                    child[i] = other[i]
        elif _has_kv_layer(child):
            share_modules(child, other)
        else:
            setattr(dst, name, other)


def share_parameters(dst: nn.Module, src: nn.Module) -> None:
    """Replace every parameter of ``dst`` by the same-named parameter of ``src`` (ValueError if one is missing)."""
    params = dict(src.named_parameters(remove_duplicate=False))
    for module_name, module in dst.named_modules():
        for name in list(module._parameters):
            if module._parameters[name] is None:
                continue
            full = f"{module_name}.{name}" if module_name else name
            if full not in params:
                raise ValueError(f"cannot share draft parameter {full!r}: the target has no such parameter")
            module._parameters[name] = params[full]


@register_proposer("draft_model")
class DraftModelProposer(ChainDrafter):
    """Greedy or probabilistic drafts from a separate (or truncated) causal LM with its own KV cache."""

    uses_target_hidden = False

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        self.model: nn.Module | None = None

    def load_model(self, target_model: torch.nn.Module | None) -> None:
        assert self.env is not None and target_model is not None, "bind(env) and a target model are required"
        if self.config.draft_num_layers is not None:
            self.model = truncated_model(target_model, self.config.draft_num_layers, self.env.device)
        else:
            self.model = self._load_separate(target_model)
        self.runner = DraftModelRunner(self.model, self.env, self.k)

    def _load_separate(self, target_model: nn.Module) -> nn.Module:
        from ascent.loader.base import get_model
        from ascent.loader.model_info import load_hf_config

        assert self.env is not None and self.config.model is not None
        hf_config = load_hf_config(self.config.model)
        target_vocab = int(target_model.config.vocab_size)
        if int(hf_config.vocab_size) != target_vocab:
            raise ValueError(f"draft model {self.config.model!r} has vocab_size={hf_config.vocab_size}, the target "
                             f"{target_vocab}: a draft model must share the target's vocabulary")
        return get_model(self.config.model, hf_config, self.env.dtype, self.env.device, self.env.load_format)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                carry: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.model is not None
        return self.model(input_ids, positions), None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model.compute_logits(hidden).float()
