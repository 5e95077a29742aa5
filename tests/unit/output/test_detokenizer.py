"""Incremental detokenization vs transformers' ``tokenizer.decode`` of all ids (the independent reference)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascent.core.detokenizer import IncrementalDetokenizer, find_stop_string
from ascent.sampling_params import SamplingParams

UNICODE_TEXTS = [
    "héllo wörld, café naïve façade",
    "日本語のテキストと中文字符",
    "emoji 😀🎉🦊 and flags 🇫🇷 mixed with text",
    "combining a\u0301e\u0301 and Ωμέγα Ελληνικά",
    "  leading spaces,\ttabs\nand newlines  ",
]
NO_FFFD_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), min_size=1, max_size=24
)


def final_text(tokenizer, ids: list[int], skip: bool) -> str:
    """vLLM's final text: ``decode`` of the longest prefix of ``ids`` whose text does not end in an incomplete
    character (U+FFFD); bytes of a character the output never completes are not emitted."""
    complete = max(k for k in range(len(ids) + 1) if not tokenizer.decode(ids[:k], skip_special_tokens=skip)
                   .endswith("\ufffd"))
    return tokenizer.decode(ids[:complete], skip_special_tokens=skip)


def stream(det: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int] | None = None) -> list[str]:
    """Feed ``ids`` in chunks (default one token each), finish, and return every DELTA text."""
    deltas, pos, sizes = [], 0, list(chunk_sizes or [])
    while pos < len(ids):
        size = max(1, sizes.pop(0)) if sizes else 1
        det.update(ids[pos : pos + size], stop_terminated=False)
        deltas.append(det.output_text(delta=True))
        pos += size
    det.finish()
    deltas.append(det.output_text(delta=True))
    return deltas


@pytest.mark.parametrize("skip", [True, False])
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_random_token_streams_match_decode(tokenizer, skip, data):
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), min_size=1, max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 5), max_size=40))
    det = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=skip))
    deltas = stream(det, ids, chunks)
    reference = final_text(tokenizer, ids, skip)
    assert "".join(deltas) == reference
    assert det.output_text(delta=False) == reference
    assert det.output_token_ids == ids


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_unicode_text_one_token_at_a_time(tokenizer, skip, text):
    specials = [tokenizer.eos_token_id, tokenizer.bos_token_id]
    body = tokenizer.encode(text, add_special_tokens=False)
    ids = [specials[1], *body, specials[0], *body]
    det = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=skip))
    deltas = stream(det, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    if skip:
        assert "".join(deltas) == text + text
    # some character really is split over several tokens, so the test exercises the hold-back
    assert any(d == "" for d in deltas[:-1]) or all(ord(c) < 128 for c in text)


@settings(max_examples=100, deadline=None)
@given(text=NO_FFFD_TEXT, skip=st.booleans())
def test_arbitrary_unicode_never_yields_replacement_char(tokenizer, text, skip):
    ids = tokenizer.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=skip))
    deltas = stream(det, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


class _DecodeOnlyTokenizer:
    """A tokenizer exposing only ``decode`` (like a slow tokenizer): exercises the generic decode path."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = 0

    def decode(self, ids, skip_special_tokens=False, **kwargs):
        assert kwargs == {"spaces_between_special_tokens": True, "clean_up_tokenization_spaces": False}
        self.calls += 1
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip", [True, False])
def test_generic_decode_path_matches(tokenizer, skip):
    slow = _DecodeOnlyTokenizer(tokenizer)
    ids = tokenizer.encode(" ".join(UNICODE_TEXTS), add_special_tokens=False) + [tokenizer.eos_token_id, 5, 7]
    det = IncrementalDetokenizer(slow, SamplingParams(skip_special_tokens=skip))
    assert "".join(stream(det, ids)) == final_text(tokenizer, ids, skip)
    assert slow.calls >= len(ids)


@pytest.fixture(scope="module")
def sentencepiece_style_tokenizer():
    """Llama-style BPE: metaspace, byte fallback and a decoder that strips the first leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=specials)
    tok.train_from_iterator(UNICODE_TEXTS * 3 + ["The quick brown fox jumps over the lazy dog."] * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>", unk_token="<unk>")


@pytest.mark.parametrize("skip", [True, False])
def test_sentencepiece_style_valid_text(sentencepiece_style_tokenizer, skip):
    tok = sentencepiece_style_tokenizer
    for text in UNICODE_TEXTS + ["Hello there 😀 you"]:
        ids = tok.encode(text, add_special_tokens=False)
        ids = ids + [tok.eos_token_id] + ids
        deltas = stream(IncrementalDetokenizer(tok, SamplingParams(skip_special_tokens=skip)), ids)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("include", [False, True])
def test_stop_terminated_token_text(tokenizer, include):
    ids = tokenizer.encode("Hello world", add_special_tokens=False) + [tokenizer.eos_token_id]
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    det = IncrementalDetokenizer(tokenizer, params)
    det.update(ids[:-1], stop_terminated=False)
    assert det.update(ids[-1:], stop_terminated=True) is None
    det.finish()
    expected = tokenizer.decode(ids if include else ids[:-1], skip_special_tokens=False)
    assert det.output_text(delta=False) == expected
    assert det.output_token_ids == ids


def test_no_text_without_detokenize(tokenizer):
    det = IncrementalDetokenizer(tokenizer, SamplingParams(detokenize=False))
    det.update([10, 11, 12], stop_terminated=False)
    det.finish()
    assert det.output_text(delta=False) == ""
    assert det.output_token_ids == [10, 11, 12]
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tokenizer, SamplingParams(detokenize=False, stop=["x"]))
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(None, SamplingParams(stop=["x"]))


def test_find_stop_string_earliest_and_overlap():
    assert find_stop_string("abcdef", 4, ["cde"], include=False) == ("cde", 2)
    assert find_stop_string("abcdef", 4, ["cde"], include=True) == ("cde", 5)
    assert find_stop_string("abcdef", 5, ["bc"], include=False) is None
    assert find_stop_string("xxabcd", 3, ["cd", "ab"], include=False) == ("ab", 2)


def test_incomplete_last_character_is_never_emitted(tokenizer):
    """A request that ends (length / abort) inside a multi-byte character: vLLM emits no U+FFFD for the held
    bytes, and a stop string cannot match inside them."""
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    cut = next(k for k in range(len(ids), 0, -1) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    held = ids[:cut]
    assert tokenizer.decode(held).endswith("\ufffd")
    for stop in ([], ["\ufffd"]):
        det = IncrementalDetokenizer(tokenizer, SamplingParams(stop=stop))
        assert det.update(held, stop_terminated=False) is None
        det.finish()
        text = det.output_text(delta=False)
        assert "\ufffd" not in text and text == final_text(tokenizer, held, True)
        assert text.startswith("ok") and det.output_token_ids == held


def test_first_output_word_keeps_its_space_after_the_prompt(sentencepiece_style_tokenizer):
    """The prompt conditions the first window (vLLM primes its decode stream with a prompt suffix): a
    SentencePiece decoder strips the leading space of a sequence's first word, but not of the first output word."""
    tok = sentencepiece_style_tokenizer
    prompt = tok.encode("The quick brown fox", add_special_tokens=False)
    out = tok.encode("The lazy dog", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, SamplingParams(), prompt)
    deltas = stream(det, out)
    expected = tok.decode(prompt + out)[len(tok.decode(prompt)):]
    assert expected.startswith(" The") and "".join(deltas) == expected
    alone = IncrementalDetokenizer(tok, SamplingParams())  # no prompt: decode(out) as it stands
    assert "".join(stream(alone, out)) == tok.decode(out) == "The lazy dog"
