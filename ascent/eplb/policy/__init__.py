"""EPLB rebalancing policies behind one interface (specs/eplb_moe_lora.md §2)."""

from ascent.eplb.policy.base import EplbPolicy
from ascent.eplb.policy.default import DefaultEplb
from ascent.eplb.policy.factory import POLICIES, PolicyFactory
from ascent.eplb.policy.flashlb import FlashLB
from ascent.eplb.policy.random_policy import RandomLoadBalance
from ascent.eplb.policy.swift import SwiftBalanceEplb
from ascent.eplb.policy.validate import validate_placement

__all__ = ["POLICIES", "DefaultEplb", "EplbPolicy", "FlashLB", "PolicyFactory", "RandomLoadBalance",
           "SwiftBalanceEplb", "validate_placement"]
