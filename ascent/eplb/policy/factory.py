"""Policy lookup by name (or legacy integer id 0-3)."""

from __future__ import annotations

from typing import Any

from ascent.eplb.policy.base import EplbPolicy
from ascent.eplb.policy.default import DefaultEplb
from ascent.eplb.policy.flashlb import FlashLB
from ascent.eplb.policy.random_policy import RandomLoadBalance
from ascent.eplb.policy.swift import SwiftBalanceEplb

POLICIES: dict[str, type[EplbPolicy]] = {"random": RandomLoadBalance, "default": DefaultEplb,
                                          "swift": SwiftBalanceEplb, "flashlb": FlashLB}
LEGACY_IDS = {0: "random", 1: "default", 2: "swift", 3: "flashlb"}


class PolicyFactory:
    """``generate_policy(name, **kwargs)`` builds a policy; unknown names raise ``ValueError`` (the original fell
    back to the random policy silently)."""

    @staticmethod
    def generate_policy(name: str | int, **kwargs: Any) -> EplbPolicy:
        key = LEGACY_IDS.get(name, name) if isinstance(name, int) else str(name).lower()
        if key not in POLICIES:
            raise ValueError(f"unknown EPLB policy {name!r}; expected one of {sorted(POLICIES)} or 0-3")
        return POLICIES[key](**kwargs)
