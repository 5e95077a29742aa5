"""EPLB configuration (``--eplb-config`` JSON), with vLLM / vLLM-Ascend key names.

Keys: ``enable`` (alias ``dynamic_eplb``), ``policy`` (random | default | swift | flashlb; alias ``eplb_policy_type``
0..3), ``window_size`` (steps of expert load kept for the policy), ``step_interval`` (alias ``rebalance_interval``:
a rebalance is planned every that many steps), ``num_redundant_experts``, ``log_balancedness`` (log imbalance every
window), ``plan_delay_steps`` (steps the plan may compute in the background before it is applied) and
``plan_timeout_s`` (bound on waiting for the policy process when the plan is due).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

POLICY_NAMES = ("random", "default", "swift", "flashlb")
POLICY_TYPE_IDS = dict(enumerate(POLICY_NAMES))  # vLLM-Ascend eplb_policy_type
ALIASES = {"dynamic_eplb": "enable", "eplb_policy_type": "policy", "rebalance_interval": "step_interval"}


@dataclass
class EplbConfig:
    """Dynamic expert-parallel load balancing settings (validated on construction)."""

    enable: bool = True
    policy: str = "swift"
    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    log_balancedness: bool = False
    plan_delay_steps: int = 1
    plan_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.policy, int) and not isinstance(self.policy, bool):
            if self.policy not in POLICY_TYPE_IDS:
                raise ValueError(f"eplb policy type {self.policy} must be one of {sorted(POLICY_TYPE_IDS)}")
            self.policy = POLICY_TYPE_IDS[self.policy]
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"eplb policy={self.policy!r} must be one of {POLICY_NAMES}")
        for name in ("enable", "log_balancedness"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"eplb {name}={getattr(self, name)!r} must be a bool")
        for name, low in (("window_size", 1), ("step_interval", 1), ("num_redundant_experts", 0),
                          ("plan_delay_steps", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"eplb {name}={value!r} must be an int >= {low}")
        if self.plan_delay_steps >= self.step_interval:
            raise ValueError(f"eplb plan_delay_steps={self.plan_delay_steps} must be < step_interval="
                             f"{self.step_interval}")
        if not isinstance(self.plan_timeout_s, (int, float)) or self.plan_timeout_s <= 0:
            raise ValueError(f"eplb plan_timeout_s={self.plan_timeout_s!r} must be a positive number")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "EplbConfig":
        """Build from a mapping; aliases are renamed, unknown keys raise ValueError."""
        if not isinstance(values, dict):
            raise ValueError(f"eplb config must be a JSON object, got {values!r}")
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            name = ALIASES.get(key, key)
            if name not in known:
                raise ValueError(f"unknown eplb config key {key!r}; expected one of {sorted(known | set(ALIASES))}")
            if name in kwargs:
                raise ValueError(f"eplb config key {key!r} duplicates {name!r}")
            kwargs[name] = value
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> "EplbConfig":
        """Parse ``--eplb-config``: JSON object text, the path of a file holding one, or an already parsed dict."""
        if isinstance(text, dict):
            return cls.from_dict(text)
        if not isinstance(text, str):
            raise ValueError(f"eplb config {text!r} must be JSON text or a dict")
        stripped = text.strip()
        if not stripped.startswith("{") and Path(stripped).is_file():
            stripped = Path(stripped).read_text()
        try:
            values = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"eplb config {text!r} is not valid JSON: {exc}") from exc
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
