"""``extract_hidden_states``: per-request hidden states of the configured layers equal transformers' hidden states."""

from __future__ import annotations

import pytest
import torch

from ascent import LLM, SamplingParams
from ascent.spec_decode.extract_hidden import get_hidden_states
from tests.integration.helpers import random_prompts

LAYERS = [2, 0, 1]  # 2 = the last layer's output before the final norm (tiny models have 2 layers)


def _hf_reference(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """[T, len(LAYERS), H] from transformers: output_hidden_states[i] for i < L, the last layer's raw output for L."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: captured.__setitem__("last", out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    hook.remove()
    per_layer = {i: out.hidden_states[i][0] for i in range(len(model.model.layers))}
    per_layer[len(model.model.layers)] = captured["last"].reshape(len(token_ids), -1)
    return torch.stack([per_layer[i] for i in LAYERS], dim=1)


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_extracted_hidden_states_match_transformers(request, model_fixture):
    model_dir = request.getfixturevalue(model_fixture)
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}}}
    llm = LLM(model=model_dir, speculative_config=spec, dtype="float32", max_model_len=128, disable_log_stats=True,
              max_num_batched_tokens=16, max_num_seqs=16)  # the 30-token prompt is prefilled in chunks
    prompts = random_prompts(3, 512, 5, 30, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        data = get_hidden_states(llm, out.request_id)
        consumed = prompt + list(out.outputs[0].token_ids)[:-1]
        assert data["token_ids"].tolist() == consumed
        assert data["hidden_states"].shape == (len(consumed), len(LAYERS), 64)
        ref = _hf_reference(model_dir, consumed)
        torch.testing.assert_close(data["hidden_states"], ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="no captured"):
        get_hidden_states(llm, outs[0].request_id)  # popped


def test_extract_hidden_states_needs_layers_and_k_1():
    from ascent.spec_decode.base import SpeculativeConfig

    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        SpeculativeConfig(method="extract_hidden_states", num_speculative_tokens=1)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(method="extract_hidden_states", num_speculative_tokens=2,
                          draft_model_config={"hf_config": {"eagle_aux_hidden_state_layer_ids": [1]}})
