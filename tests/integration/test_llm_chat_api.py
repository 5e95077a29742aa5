"""`LLM.chat` and `LLM.generate` surface as vLLM: OpenAI content parts, continue_final_message, tools, and the
model's generation_config as the default sampling params."""

from __future__ import annotations

import json
import shutil

import pytest

from ascent import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TEMPLATE = ("{% if tools %}[tools:{{ tools | map(attribute='function.name') | join(',') }}]{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not (loop.last and continue_final_message) %}"
            "</{{ m.role }}>{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, disable_log_stats=True)


def _prompt(llm, messages, **kwargs) -> str:
    return llm.chat(messages, GREEDY, use_tqdm=False, chat_template=TEMPLATE, **kwargs)[0].prompt


def test_text_parts_are_joined_like_a_string(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    assert _prompt(llm, parts) == _prompt(llm, [{"role": "user", "content": "Hi\nthere"}])
    with pytest.raises(ValueError, match="text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], GREEDY, use_tqdm=False)


def test_continue_final_message_and_tools_reach_the_template(llm):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    assert _prompt(llm, messages, add_generation_prompt=False, continue_final_message=True) == \
        "<user>Hi</user><assistant>Hel"
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    assert _prompt(llm, messages[:1], tools=tools) == "[tools:lookup]<user>Hi</user><assistant>"
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(messages, GREEDY, use_tqdm=False, continue_final_message=True)


def test_generation_config_gives_the_default_sampling_params(tiny_llama_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    gen = json.loads((model / "generation_config.json").read_text()) if (model / "generation_config.json").exists() \
        else {}
    gen.update(temperature=0.0, top_k=7, max_new_tokens=3)
    (model / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(model=str(model), dtype="float32", max_model_len=64, disable_log_stats=True)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 3)
    out = llm.generate("hello", use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 3
    assert out.token_ids == llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=3),
                                         use_tqdm=False)[0].outputs[0].token_ids


def test_generation_config_source_and_overrides(tiny_llama_dir, tmp_path):
    """vLLM's --generation-config auto | vllm | DIR and --override-generation-config."""
    from ascent.loader.model_info import get_generation_defaults, read_generation_config

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 7, "eos_token_id": [2, 9]}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    assert get_generation_defaults(str(model)) == {"temperature": 0.3, "top_k": 7}
    assert get_generation_defaults(str(model), "vllm") == {}
    assert get_generation_defaults(str(model), str(other)) == {"top_p": 0.5}
    assert get_generation_defaults(str(model), "auto", {"temperature": 0.9, "max_new_tokens": 5}) == {
        "temperature": 0.9, "top_k": 7, "max_new_tokens": 5}
    with pytest.raises(ValueError, match="generation_config='/nowhere'"):
        read_generation_config(str(model), "/nowhere")
    llm = LLM(model=str(model), dtype="float32", max_model_len=64, disable_log_stats=True, generation_config="vllm",
              override_generation_config='{"max_new_tokens": 4}')
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (1.0, 0, 4)
    assert 9 not in llm.llm_engine.model_config.eos_token_ids  # no generation_config EOS with "vllm"
    with pytest.raises(ValueError, match="override_generation_config"):
        LLM(model=str(model), override_generation_config="[1]")


def test_best_of_other_than_n_is_rejected():
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=1, best_of=3)
    assert SamplingParams(n=2, best_of=2).best_of == 2
