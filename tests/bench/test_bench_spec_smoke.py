"""Smoke run of ``ascent bench spec`` on a tiny random model (JSON schema, equal greedy outputs, consistent
acceptance numbers; never timing thresholds) and unit checks of its workload and acceptance helpers."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from ascent.benchmarks.cli import register_bench_parser
from ascent.benchmarks.spec import (SpecCounts, acceptance_summary, format_summary, non_repetitive_conversations,
                                    outputs_match, parse_dynamic_params, parse_methods, repetitive_conversations,
                                    speculative_config)
from ascent.benchmarks.spec_workloads import WORKLOADS, build_workloads
from ascent.spec_decode.base import SpeculativeConfig
from ascent.spec_decode.dynamic import DynamicSpecParams

K = 3
NUM_PROMPTS = 4
OUTPUT_LEN = 12
RUN_KEYS = ("elapsed_time", "total_output_tokens", "output_tokens_per_second")
METHOD_KEYS = (*RUN_KEYS, "num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos",
               "mean_acceptance_length", "acceptance_rate", "per_position_acceptance_rate", "mean_draft_length",
               "speedup_vs_no_spec", "outputs_equal_no_spec", "num_mismatched_requests", "first_mismatch_positions")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ascent")
    register_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def spec_result(tiny_llama_dir: str, tmp_path_factory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("bench_spec") / "spec.json"
    args = _parse(["bench", "spec", "--model", tiny_llama_dir, "--dtype", "float32", "--methods", "ngram,suffix",
                   "--num-speculative-tokens", str(K), "--prompt-lookup-min", "1", "--prompt-lookup-max", "3",
                   "--num-prompts", str(NUM_PROMPTS), "--output-len", str(OUTPUT_LEN), "--ignore-eos",
                   "--num-threads", "1", "--rounds", "1", "--output-json", str(out)])
    returned = args.func(args)
    return returned, json.loads(out.read_text())


def _check_acceptance(r: dict) -> None:
    drafts, accepted, per_pos = r["num_drafts"], r["num_accepted_tokens"], r["accepted_per_pos"]
    assert drafts > 0 and 0 <= accepted <= r["num_draft_tokens"] <= K * drafts
    assert len(per_pos) == K and sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # acceptance is a prefix of each draft
    assert 1.0 <= r["mean_acceptance_length"] <= 1.0 + K
    assert r["mean_acceptance_length"] == pytest.approx(1.0 + accepted / drafts)
    assert r["acceptance_rate"] == pytest.approx(accepted / r["num_draft_tokens"])
    rates = r["per_position_acceptance_rate"]
    assert rates == pytest.approx([c / drafts for c in per_pos])
    assert all(0.0 <= x <= 1.0 for x in rates) and all(a >= b for a, b in zip(rates, rates[1:]))
    assert 1.0 <= r["mean_draft_length"] <= K


def test_spec_bench_json_schema(spec_result: tuple[dict, dict]) -> None:
    returned, data = spec_result
    assert data["benchmark"] == "spec_decode" and data["methods"] == ["ngram", "suffix"]
    assert data["num_speculative_tokens"] == K and data["dtype"] == "float32"
    assert set(data["workloads"]) == {"repetitive", "non_repetitive"}
    assert set(data["startup"]) == {"none", "ngram", "suffix"}
    assert data["env"]["num_threads"] == 1 and data["config"]["ignore_eos"] is True
    assert data["speculation_ceiling"] is None  # no cost-gated (dynamic) method ran
    assert data["config"]["speculative_configs"]["ngram"]["prompt_lookup_max"] == 3
    assert returned["workloads"]["repetitive"]["no_spec"]["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    for work in data["workloads"].values():
        assert work["requested"]["num_requests"] == NUM_PROMPTS
        assert all(k in work["no_spec"] for k in RUN_KEYS)
        assert set(work["methods"]) == {"ngram", "suffix"}
        for r in work["methods"].values():
            assert all(k in r for k in METHOD_KEYS)


def test_spec_bench_outputs_equal_and_tokens(spec_result: tuple[dict, dict]) -> None:
    _, data = spec_result
    for work in data["workloads"].values():
        base = work["no_spec"]
        assert base["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
        for r in work["methods"].values():
            assert r["outputs_equal_no_spec"] is True and r["num_mismatched_requests"] == 0
            assert r["first_mismatch_positions"] == []
            assert r["total_output_tokens"] == base["total_output_tokens"]
            assert r["output_tokens_per_second"] > 0 and math.isfinite(r["output_tokens_per_second"])
            assert r["speedup_vs_no_spec"] == pytest.approx(
                r["output_tokens_per_second"] / base["output_tokens_per_second"])


def test_spec_bench_acceptance_numbers(spec_result: tuple[dict, dict]) -> None:
    _, data = spec_result
    for method in ("ngram", "suffix"):
        _check_acceptance(data["workloads"]["repetitive"]["methods"][method])
    text = format_summary(data)
    assert "repetitive" in text and "non_repetitive" in text and "suffix" in text


def test_acceptance_summary_and_counts_delta() -> None:
    before = SpecCounts(2, 5, 3, (2, 1), (4, 1))
    after = SpecCounts(6, 16, 9, (5, 3, 1), (10, 3))
    delta = after.minus(before)
    assert delta == SpecCounts(4, 11, 6, (3, 2, 1), (6, 2)) and delta.plus(before) == after
    summary = acceptance_summary(delta, 4)
    assert summary["mean_acceptance_length"] == pytest.approx(2.5)
    assert summary["acceptance_rate"] == pytest.approx(6 / 11)
    assert summary["per_position_acceptance_rate"] == pytest.approx([0.75, 0.5, 0.25, 0.0])
    assert summary["accepted_per_pos"] == [3, 2, 1, 0]
    empty = acceptance_summary(SpecCounts(), 3)
    assert empty["mean_acceptance_length"] is None and empty["per_position_acceptance_rate"] is None
    assert empty["acceptance_rate"] is None and empty["accepted_per_pos"] == [0, 0, 0]


def test_workloads_are_seeded_and_repetitive() -> None:
    rep = repetitive_conversations(8, seed=3)
    assert rep == repetitive_conversations(8, seed=3) and rep != repetitive_conversations(8, seed=4)
    code = rep[0][0]["content"]
    assert "```python" in code and "Rename the variable" in code
    assert [m["role"] for m in rep[2]] == ["user", "assistant", "user"]
    questions = non_repetitive_conversations(30, seed=0)
    assert len({q[0]["content"] for q in questions}) == 30


def test_parse_methods_and_outputs_match() -> None:
    assert parse_methods("ngram, suffix") == ["ngram", "suffix"]
    assert parse_methods("suffix,suffix+dynamic,draft_model") == ["suffix", "suffix+dynamic", "draft_model"]
    for bad in ("ngram,ngram", " , ", "suffix+fast", "foo"):
        with pytest.raises(ValueError):
            parse_methods(bad)
    for needs_heads in ("eagle", "eagle3", "medusa+dynamic"):
        with pytest.raises(ValueError, match="trained"):
            parse_methods(needs_heads)
    assert outputs_match([[1, 2], [3]], [[1, 2], [3]]) == (True, [])
    assert outputs_match([[1, 2], [3, 5]], [[1, 2], [3, 4]]) == (False, [1])
    assert outputs_match([[1, 2, 3], [7]], [[1, 2], [8]]) == (False, [2, 0])
    with pytest.raises(ValueError):
        outputs_match([[1]], [])


def test_cli_flags_build_valid_speculative_configs() -> None:
    args = _parse(["bench", "spec", "--methods", "ngram,suffix+dynamic,draft_model", "--max-concurrency", "1",
                   "--rounds", "3", "--draft-num-layers", "4", "--disable-by-batch-size", "8",
                   "--dynamic-params", '{"min_draft_survival": 0.4, "probe_interval": 5}'])
    assert args.max_concurrency == 1 and args.rounds == 3 and args.draft_num_layers == 4
    configs = {m: speculative_config(args, m) for m in parse_methods(args.methods)}
    assert configs["draft_model"]["draft_num_layers"] == 4 and "dynamic" not in configs["draft_model"]
    assert configs["suffix+dynamic"]["method"] == "suffix" and configs["suffix+dynamic"]["dynamic"] is True
    assert configs["suffix+dynamic"]["dynamic_params"] == {"min_draft_survival": 0.4, "probe_interval": 5}
    assert all(c["speculative_disable_by_batch_size"] == 8 for c in configs.values())
    for config in configs.values():
        SpeculativeConfig.from_json(config)  # every bench config is a valid engine config
    defaults = _parse(["bench", "spec"])
    assert defaults.max_concurrency is None and defaults.rounds == 3 and defaults.draft_num_layers == 6
    assert "draft_model" in parse_methods(defaults.methods)
    assert parse_dynamic_params(None) == {}  # the engine's own dynamic defaults
    assert DynamicSpecParams.from_dict(speculative_config(defaults, "suffix+dynamic")["dynamic_params"]) == \
        DynamicSpecParams()
    for bad in ("[1]", "{", '{"unknown": 1}', '{"min_draft_survival": 2}'):
        with pytest.raises(ValueError):
            parse_dynamic_params(bad)


class _CharTokenizer:
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 256 for c in text]


def test_workload_builder_requests() -> None:
    work = build_workloads(_CharTokenizer(), num_prompts=5, output_len=7, seed=1)
    assert tuple(work) == WORKLOADS
    for reqs in work.values():
        assert len(reqs) == 5 and all(r.output_len == 7 and r.input_len > 10 for r in reqs)
    again = build_workloads(_CharTokenizer(), num_prompts=5, output_len=7, seed=1)
    assert [r.prompt_token_ids for r in again["repetitive"]] == [r.prompt_token_ids for r in work["repetitive"]]
    other = build_workloads(_CharTokenizer(), num_prompts=5, output_len=7, seed=2)
    assert [r.prompt_token_ids for r in other["repetitive"]] != [r.prompt_token_ids for r in work["repetitive"]]


def test_spec_bench_rounds_concurrency_and_draft_model(tiny_llama_dir: str) -> None:
    """Two rounds at concurrency 1 with draft_model (self-draft: all layers -> every draft accepted) and a
    dynamic suffix variant; outputs equal, round ratios reported."""
    args = _parse(["bench", "spec", "--model", tiny_llama_dir, "--dtype", "float32",
                   "--methods", "draft_model,suffix+dynamic", "--draft-num-layers", "2", "--max-concurrency", "1",
                   "--rounds", "2", "--num-speculative-tokens", str(K), "--num-prompts", "2", "--output-len", "8",
                   "--ignore-eos", "--num-threads", "1",
                   # without the cost model the arbiter decides every step (with it, not batch 1's memory-bound ones)
                   "--dynamic-params", '{"goodput_arbiter": true, "cost_gate": false}'])
    data = args.func(args)
    assert data["config"]["rounds"] == 2 and data["config"]["max_concurrency"] == 1
    for work in data["workloads"].values():
        assert work["no_spec"]["total_output_tokens"] == 2 * 2 * 8
        for r in work["methods"].values():
            assert r["outputs_equal_no_spec"] is True and len(r["speedup_per_round"]) == 2
            assert r["speedup_vs_no_spec"] > 0 and r["speedup_aggregate"] > 0
        draft = work["methods"]["draft_model"]
        assert draft["num_drafts"] > 0 and draft["num_accepted_tokens"] == draft["num_draft_tokens"]
        assert (draft["arbiter_speculative_steps"], draft["arbiter_plain_steps"]) == (0, 0)  # not dynamic
        dynamic = work["methods"]["suffix+dynamic"]
        assert dynamic["arbiter_speculative_steps"] > 0  # the arbiter decided this run's steps (speculation first)


def test_draft_length_defaults_per_method() -> None:
    """Without --num-speculative-tokens suffix decoding gets the engine's default (its tree depth, as vLLM) and the
    other methods 3; an explicit k applies to every method."""
    args = _parse(["bench", "spec", "--methods", "ngram,suffix,suffix+dynamic"])
    depth = SpeculativeConfig.from_json({"method": "suffix"}).num_speculative_tokens
    assert depth == 24
    assert speculative_config(args, "suffix")["num_speculative_tokens"] == depth
    assert speculative_config(args, "suffix+dynamic")["num_speculative_tokens"] == depth
    assert speculative_config(args, "ngram")["num_speculative_tokens"] == 3
    explicit = _parse(["bench", "spec", "--num-speculative-tokens", "5"])
    assert {speculative_config(explicit, m)["num_speculative_tokens"] for m in ("ngram", "suffix")} == {5}


def test_summary_shows_positions_up_to_the_last_accepted() -> None:
    from ascent.benchmarks.spec import _positions_text

    assert _positions_text([0.5, 0.25, 0.0, 0.0]) == "[0.50, 0.25, 0 x 2]"
    assert _positions_text([0.0, 0.0]) == "[0.00, 0 x 1]"
    assert _positions_text([0.5]) == "[0.50]" and _positions_text(None) == "n/a"


def test_validation_rejects_zero_counts_but_allows_the_default_k() -> None:
    from ascent.benchmarks.spec import _validate

    _validate(_parse(["bench", "spec"]))  # num_speculative_tokens None: per-method defaults
    for name in ("num_prompts", "output_len", "num_speculative_tokens", "rounds"):
        args = _parse(["bench", "spec"])
        setattr(args, name, 0)
        with pytest.raises(ValueError, match=name):
            _validate(args)


def test_concurrency_sweep_runs_each_value(tiny_llama_dir: str, tmp_path, capsys) -> None:
    """--concurrency-sweep runs the whole benchmark per value (engines at that max_num_seqs) and tabulates the
    speed-ups; the per-value runs are the plain benchmark's results."""
    out = tmp_path / "sweep.json"
    args = _parse(["bench", "spec", "--model", tiny_llama_dir, "--dtype", "float32", "--methods", "ngram",
                   "--concurrency-sweep", "1,2", "--num-speculative-tokens", str(K), "--prompt-lookup-min", "1",
                   "--num-prompts", "2", "--output-len", "6", "--ignore-eos", "--num-threads", "1",
                   "--output-json", str(out)])
    returned = args.func(args)
    data = json.loads(out.read_text())
    assert data["benchmark"] == "spec_decode_sweep" and data["concurrencies"] == [1, 2]
    assert [run["config"]["max_concurrency"] for run in data["runs"]] == [1, 2]
    assert [row["max_concurrency"] for row in data["speedups"]] == [1, 2]
    for run, row in zip(returned["runs"], returned["speedups"]):
        for work in ("repetitive", "non_repetitive"):
            method = run["workloads"][work]["methods"]["ngram"]
            assert method["outputs_equal_no_spec"] is True
            assert row[f"{work}/ngram"] == {"speedup": method["speedup_vs_no_spec"],
                                            "mean_acceptance_length": method["mean_acceptance_length"]}
    table = capsys.readouterr().out.split("speed-up over no speculation by concurrency")[1]
    assert "| concurrency | repetitive/ngram | non_repetitive/ngram |" in table and "\n| 2 | x" in table


def test_concurrency_sweep_list_errors() -> None:
    from ascent.benchmarks.spec_sweep import parse_concurrency_list

    assert parse_concurrency_list("1, 8,32") == [1, 8, 32]
    for bad in ("", "1,x", "0,4"):
        with pytest.raises(ValueError, match="concurrency sweep"):
            parse_concurrency_list(bad)
