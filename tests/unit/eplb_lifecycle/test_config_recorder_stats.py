"""EplbConfig parsing/validation, the load recorder's window and logical folding, and the imbalance/hotness math."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ascent.eplb.config import EplbConfig
from ascent.eplb.load_recorder import LoadRecorder
from ascent.eplb.stats import EplbMetrics, RebalanceStats, hotness, imbalance, rank_loads
from ascent.layers.fused_moe import ExpertMap, FusedMoE


def test_from_json_with_vllm_ascend_keys_and_aliases(tmp_path) -> None:
    cfg = EplbConfig.from_json('{"policy": "flashlb", "window_size": 8, "step_interval": 20, '
                               '"num_redundant_experts": 2, "enable": true, "log_balancedness": true}')
    assert (cfg.policy, cfg.window_size, cfg.step_interval, cfg.num_redundant_experts) == ("flashlb", 8, 20, 2)
    assert cfg.enable and cfg.log_balancedness
    aliased = EplbConfig.from_dict({"dynamic_eplb": False, "eplb_policy_type": 2, "rebalance_interval": 7})
    assert (aliased.enable, aliased.policy, aliased.step_interval) == (False, "swift", 7)
    path = tmp_path / "eplb.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert EplbConfig.from_json(str(path)) == cfg


@pytest.mark.parametrize("text, match", [
    ('{"policy": "magic"}', "policy='magic'"),
    ('{"window_size": 0}', "window_size=0"),
    ('{"step_interval": 2, "plan_delay_steps": 2}', "plan_delay_steps=2"),
    ('{"num_redundant_experts": -1}', "num_redundant_experts=-1"),
    ('{"enable": "yes"}', "enable='yes'"),
    ('{"eplb_policy_type": 9}', "policy type 9"),
    ('{"windows": 3}', "'windows'"),
    ('{"enable": true, "dynamic_eplb": true}', "duplicates"),
    ('[1, 2]', "JSON object"),
    ('{not json', "not valid JSON"),
])
def test_invalid_config_names_the_value(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EplbConfig.from_json(text)


def _layer(p2l: list[int]) -> FusedMoE:
    return FusedMoE(4, 2, 8, 6, torch.float32, expert_map=ExpertMap(4, physical_to_logical=p2l))


def test_recorder_folds_local_slots_to_logical_and_consumes_counts() -> None:
    layers = [_layer([0, 1, 2, 3]), _layer([2, 0, 1, 3, 2, 0])]
    rec = LoadRecorder(layers, window_size=3)
    layers[0].last_expert_tokens = torch.tensor([1, 2, 3, 4])
    layers[1].last_expert_tokens = torch.tensor([5, 1, 0, 2, 7, 3])
    row = rec.record()
    assert row.tolist() == [[1, 2, 3, 4], [4, 0, 12, 2]]
    assert layers[0].last_expert_tokens is None and layers[1].last_expert_tokens is None
    assert rec.record().tolist() == [[0] * 4, [0] * 4]  # no forward since: a zero row, the ring still advances


def test_recorder_window_is_chronological_after_wrapping() -> None:
    layer = _layer([0, 1, 2, 3])
    rec = LoadRecorder([layer], window_size=2)
    for step in range(1, 4):
        layer.last_expert_tokens = torch.full((4,), step)
        rec.record()
    assert rec.filled == 2 and rec.local_window()[:, 0, 0].tolist() == [2, 3]
    rec.clear()
    assert rec.filled == 0 and rec.local_window().shape == (0, 1, 4)


def test_recorder_validates_counts_and_layers() -> None:
    layer = _layer([0, 1, 2, 3])
    layer.last_expert_tokens = torch.ones(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="3 entries"):
        LoadRecorder([layer], 2).record()
    with pytest.raises(ValueError, match="window_size=0"):
        LoadRecorder([layer], 0)
    with pytest.raises(ValueError, match="disagree"):
        LoadRecorder([layer, FusedMoE(6, 2, 8, 6, torch.float32)], 2)


def test_model_forward_feeds_the_recorder() -> None:
    torch.manual_seed(0)
    layer = _layer([0, 1, 2, 3])
    for p in layer.parameters():
        nn.init.normal_(p)
    layer(torch.randn(5, 8), torch.randn(5, 4))
    assert int(LoadRecorder([layer], 2).record().sum()) == 5 * 2


def test_rank_loads_imbalance_and_hotness() -> None:
    load = torch.tensor([[8.0, 2.0, 2.0, 0.0]])
    placement = torch.tensor([[[0, 1], [2, 3]]])
    per_rank = rank_loads(load, placement)
    assert per_rank.tolist() == [[10.0, 2.0]]
    assert imbalance(per_rank).tolist() == pytest.approx([10 / 6])
    replicated = torch.tensor([[[0, 1, 2], [0, 3, 3]]])  # expert 0 split over both ranks, expert 3 twice
    assert rank_loads(load, replicated).tolist() == [[8.0, 4.0]]
    ratio, hottest = hotness(load, top=2)
    assert ratio.tolist() == pytest.approx([8 / 3]) and hottest == [[0, 1]]
    assert imbalance(torch.zeros(1, 2)).tolist() == [1.0]
    with pytest.raises(ValueError, match="same L"):
        rank_loads(load, torch.zeros(2, 2, 2, dtype=torch.int64))


def test_metrics_accumulate_and_log_line() -> None:
    metrics = EplbMetrics()
    metrics.observe_load(torch.tensor([[8.0, 2.0, 2.0, 0.0]]), torch.tensor([[[0, 1], [2, 3]]]))
    assert metrics.imbalance == pytest.approx([10 / 6])
    stats = RebalanceStats(step=5, changed_layers=1, moves=2, p2p_transfers=1, bytes_moved=64, stall_s=0.002,
                           imbalance_before=[1.667], imbalance_after=[1.0], hotness=[2.667], hottest=[[0]])
    metrics.add(stats)
    metrics.add(stats)
    d = metrics.as_dict()
    assert (d["rebalances"], d["moves_total"], d["bytes_total"]) == (2, 4, 128)
    assert d["last"]["step"] == 5 and d["imbalance"] == [1.0]  # the current placement after the rebalance
    line = stats.log_line()
    assert "step 5" in line and "64 B" in line and "1.667] -> [1.000]" in line
