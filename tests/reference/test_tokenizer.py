"""Our GGUF tokenizer vs transformers' GGUF tokenizer (and vs SmolLM's original pre-tokenizer recipe)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascent.default_model import default_model_path
from ascent.loader.gguf import gguf_tokenizer
from ascent.loader.model_info import get_eos_token_ids, get_generation_defaults
from ascent.tokenizer import apply_chat_template, get_tokenizer
from tests.fixtures.tiny_models import CHATML_TEMPLATE, build_tokenizer

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "héllo wörld — naïve café, Ångström",
    "日本語のテキスト 你好，世界！ 한국어",
    "emoji 🦙🚀 and ZWJ 👩‍👩‍👧",
    "it's I'M we'll they'D you've",
    "numbers 0 12 345 6789 3.14159 1e-9 2024-01-01",
    "def f(x):\n    return x**2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "special <|endoftext|> inside <repo_name> text",
    "",
    " ",
    "\n",
]
# Whitespace runs before digits: SmolLM's tokenizer isolates digits first, transformers' GGUF rebuild does not.
DIGIT_AFTER_SPACE = ["\n 0", "x =\n 42", "a\n\n 7 b", "\t 2024"]
MESSAGES = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語 🎨"},
    ],
]


@pytest.fixture(scope="module")
def smollm_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def ours(smollm_path: str):
    return gguf_tokenizer(smollm_path)


@pytest.fixture(scope="module")
def ref(smollm_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path))


@pytest.fixture(scope="module")
def ref_original_pre(ref):
    """transformers' vocabulary/merges/special tokens with SmolLM's own pre-tokenizer (its tokenizer.json:
    Digits(individual_digits) then ByteLevel with the GPT-2 regex; llama.cpp's "smollm" = \\p{N} then GPT-2)."""
    from tokenizers import Tokenizer, pre_tokenizers

    backend = Tokenizer.from_str(ref.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equal_transformers(ours, ref, text: str) -> None:
    for add_special in (True, False):
        ids = ours(text, add_special_tokens=add_special)["input_ids"]
        assert ids == ref(text, add_special_tokens=add_special)["input_ids"]
    assert ours.decode(ids) == ref.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)


def test_digits_follow_original_pretokenizer(ours, ref, ref_original_pre) -> None:
    for text in DIGIT_AFTER_SPACE + TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == ref_original_pre.encode(text).ids
        assert ours.decode(ids) == text
    # the reason these are checked against the original recipe: transformers' rebuild splits them differently
    assert ours("\n 0")["input_ids"] != ref("\n 0")["input_ids"]


_LETTERS = st.sampled_from([*"abcXYZ \n\t.,;'!?-_(){}<>|/\\\"#=+*", "é", "ß", "日", "本", "🦙", "\xa0", "ñ"])
_DIGITS = st.sampled_from(list("0123456789") + ["²", "½", "٣", "Ⅷ"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(_LETTERS, max_size=24))
def test_random_text_without_digits_equals_transformers(ours, ref, text: str) -> None:
    ids = ours(text)["input_ids"]
    assert ids == ref(text)["input_ids"]
    assert ours.decode(ids) == text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.one_of(_LETTERS, _DIGITS), max_size=24))
def test_random_text_equals_original_recipe(ours, ref_original_pre, text: str) -> None:
    ids = ours(text)["input_ids"]
    assert ids == ref_original_pre.encode(text).ids
    assert ours.decode(ids) == text


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.one_of(st.integers(0, 20), st.integers(0, 49151)), max_size=16))
def test_decode_ids_equal_transformers(ours, ref, ids: list[int]) -> None:
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_vocab_and_special_ids(ours, ref, smollm_path: str) -> None:
    assert ours.get_vocab() == ref.get_vocab()
    assert len(ours) == len(ref) == 49152
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "bos_token", "eos_token"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert (ours.bos_token_id, ours.eos_token_id, ours.eos_token) == (1, 2, "<|im_end|>")
    assert ours.add_bos_token is False
    assert get_eos_token_ids(smollm_path, ours) == {2}
    assert get_generation_defaults(smollm_path) == {}


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(ours, ref, messages, add_generation_prompt: bool) -> None:
    rendered = apply_chat_template(ours, messages, add_generation_prompt=add_generation_prompt)
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    ids = ours(rendered)["input_ids"]
    assert ids == ref(expected)["input_ids"]
    assert ids.count(ours.convert_tokens_to_ids("<|im_start|>")) == rendered.count("<|im_start|>")
    assert ours.decode(ids) == rendered


def test_get_tokenizer_gguf_with_template_override(smollm_path: str, ref) -> None:
    override = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    tok = get_tokenizer(smollm_path, chat_template=override)
    assert tok("Hi <|im_end|>")["input_ids"] == ref("Hi <|im_end|>")["input_ids"]
    assert tok.chat_template == override != ref.chat_template
    assert apply_chat_template(tok, [{"role": "user", "content": "x"}], add_generation_prompt=False) == "[user] x\n"


# ------------------------------------------------------------------------------ tiny GGUF tokenizers written here
def _write_tokenizer_gguf(tmp_path: Path, pre: str) -> Path:
    """A GGUF holding only tokenizer metadata (in its own directory: transformers reads tokenizer files next to it)."""
    build_tokenizer(tmp_path / "source")
    data = json.loads((tmp_path / "source" / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    specials = {t["content"] for t in data["added_tokens"] if t["special"]}
    (tmp_path / "gguf").mkdir()
    path = tmp_path / "gguf" / f"tok-{pre}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens + ["<think>"])  # plus one USER_DEFINED token
    writer.add_token_types([3 if t in specials else 1 for t in tokens] + [4])
    writer.add_token_merges([" ".join(m) for m in data["model"]["merges"]])
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHATML_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", ["gpt2", "qwen2", "llama-bpe"])
def test_tiny_gguf_tokenizer_equals_transformers(tmp_path: Path, pre: str) -> None:
    from transformers import AutoTokenizer

    path = _write_tokenizer_gguf(tmp_path, pre)
    ours_tiny = gguf_tokenizer(str(path))
    ref_tiny = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    think = ours_tiny.convert_tokens_to_ids("<think>")
    assert ours_tiny("a<think>b")["input_ids"].count(think) == 1 and think not in ours_tiny.all_special_ids
    for text in TEXTS + DIGIT_AFTER_SPACE + ["Paged attention stores keys\n\n\n  in blocks 0123456789 <think>x"]:
        ids = ours_tiny(text)["input_ids"]
        assert ids == ref_tiny(text)["input_ids"], text
        assert ids[:1] == [ours_tiny.bos_token_id]
        assert ours_tiny.decode(ids, skip_special_tokens=True) == ref_tiny.decode(ids, skip_special_tokens=True)
    messages = MESSAGES[1]
    assert apply_chat_template(ours_tiny, messages) == ref_tiny.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


# ------------------------------------------------------------------------------------------ directories, errors
def test_directory_tokenizer_and_template_overrides(tiny_llama_dir: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = get_tokenizer(tiny_llama_dir)
    ref_dir = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert tok("Hello world")["input_ids"] == ref_dir("Hello world")["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    assert apply_chat_template(tok, messages) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    template_file = tmp_path / "template.jinja"
    template_file.write_text("{{ messages[0]['content'] | upper }}")
    assert apply_chat_template(get_tokenizer(tiny_llama_dir, chat_template=str(template_file)), messages) == "HI"
    assert apply_chat_template(tok, messages, chat_template=str(template_file)) == "HI"
    assert get_tokenizer(str(tmp_path), tokenizer=tiny_llama_dir).get_vocab() == ref_dir.get_vocab()


def test_missing_template_and_bad_values(tiny_llama_dir: str, tmp_path: Path) -> None:
    tok = get_tokenizer(tiny_llama_dir)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        apply_chat_template(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="no_such_template.jinja"):
        get_tokenizer(tiny_llama_dir, chat_template="no_such_template.jinja")
    with pytest.raises(ValueError, match="'not-a-list'"):
        apply_chat_template(get_tokenizer(tiny_llama_dir), "not-a-list")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="some-org/some-model"):
        get_tokenizer("some-org/some-model")
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        gguf_tokenizer(str(_write_spm_gguf(tmp_path)))


def _write_spm_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
