"""The offline API's vLLM surface: SamplingParams normalisation (seed=-1, tiny temperatures, greedy n, stop id
de-duplication, output_kind enum), prompt TypedDicts, chat_template_kwargs precedence, a tqdm factory,
RequestOutput fields and order, request metrics, engine accessors."""

from __future__ import annotations

import pytest

from ascent import LLM, SamplingParams, TextPrompt, TokensPrompt
from ascent.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ascent.sampling_params import RequestOutputKind

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, disable_log_stats=True)


def test_sampling_params_normalise_like_vllm(caplog):
    assert SamplingParams(seed=-1).seed is None  # -1: unseeded
    with caplog.at_level("WARNING"):
        assert SamplingParams(temperature=1e-4).temperature == 0.01
    assert "raised" in caplog.text
    assert SamplingParams(temperature=0.0).temperature == 0.0
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):
        SamplingParams(n=2, temperature=0.0)
    assert SamplingParams(stop_token_ids=[5, 3, 5, 3, 7]).stop_token_ids == [5, 3, 7]
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=7)


def test_unseeded_minus_one_samples_differently(llm):
    params = SamplingParams(seed=-1, temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = {tuple(llm.generate("Hello world", params, use_tqdm=False)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(runs) > 1


def test_prompt_typed_dicts_and_bad_prompts(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    ids = llm.get_tokenizer().encode("Hello world")
    by_text = llm.generate(TextPrompt(prompt="Hello world"), greedy, use_tqdm=False)[0]
    by_ids = llm.generate(TokensPrompt(prompt_token_ids=ids), greedy, use_tqdm=False)[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids and by_ids.prompt is None
    with pytest.raises(ValueError, match="prompts=123"):
        llm.generate(123, greedy)
    assert llm.generate("Hi", greedy, use_tqdm=False, lora_request=None)[0].finished
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate("Hi", greedy, lora_request=object())


def test_chat_template_kwargs_win_over_the_named_options(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    messages = [{"role": "user", "content": "Hi"}]
    out = llm.chat(messages, greedy, use_tqdm=False, chat_template=TEMPLATE,
                   chat_template_kwargs={"add_generation_prompt": False, "tokenize": True})[0]
    assert out.prompt == "<user>Hi</user>"
    out = llm.chat(messages, greedy, use_tqdm=False, chat_template_content_format="openai",
                   chat_template_kwargs={"chat_template": TEMPLATE})[0]
    assert out.prompt == "<user>Hi</user><assistant>"
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(messages, greedy, chat_template_content_format="xml")


def test_tqdm_factory_and_request_metrics(llm):
    made = []

    def factory(**kwargs):
        from tqdm import tqdm

        made.append(kwargs["total"])
        return tqdm(disable=True, **{k: v for k, v in kwargs.items() if k != "disable"})

    outs = llm.generate(["a", "b"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=factory)
    assert made == [2]
    for out in outs:
        m = out.metrics
        assert m.first_scheduled_time is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time


def test_request_output_fields_and_engine_accessors(llm):
    metrics = RequestMetrics(arrival_time=1.0)
    out = RequestOutput("r", None, [1], None, [CompletionOutput(0, "", [], None, None)], True, metrics)
    assert out.metrics is metrics and out.num_cached_tokens is None  # vLLM's positional order
    assert (out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids, out.kv_transfer_params) == (
        None, None, None, None)
    assert out.outputs[0].lora_request is None
    engine = llm.llm_engine
    assert engine.model_config is engine.get_model_config() is engine.config.model_config
    assert engine.get_tokenizer() is llm.get_tokenizer()


def test_trust_remote_code_is_accepted(tiny_llama_dir):
    from ascent.args import EngineArgs

    assert EngineArgs(model=tiny_llama_dir, trust_remote_code=True).trust_remote_code is True
    with pytest.raises(ValueError, match="trust_remote_code='yes'.*boolean"):
        EngineArgs(trust_remote_code="yes")
