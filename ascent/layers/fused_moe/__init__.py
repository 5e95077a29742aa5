"""Fused mixture-of-experts: routers, token dispatchers, the unified expert MLP, the expert map and the layer."""

from ascent.layers.fused_moe.dispatcher import MoECommType, select_moe_comm
from ascent.layers.fused_moe.expert_map import ExpertMap, ExpertMove
from ascent.layers.fused_moe.layer import FusedMoE, expert_param_name, make_expert_params_mapping

__all__ = ["ExpertMap", "ExpertMove", "FusedMoE", "expert_param_name", "MoECommType", "make_expert_params_mapping", "select_moe_comm"]
