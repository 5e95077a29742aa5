"""A stand-in policy module for the policy process (the ``PolicyFactory`` interface of ``ascent.eplb.policy``, numpy
inputs): "rotate" moves every layer's experts one slot right, "same" never changes, "slow" sleeps, "boom" raises."""

from __future__ import annotations

import time

import torch


class _Rotate:
    def rebalance_experts(self, placement: torch.Tensor, load: torch.Tensor):
        placement = torch.as_tensor(placement)
        layers = placement.shape[0]
        flat = placement.reshape(layers, -1).roll(1, dims=1)
        return True, list(range(layers)), flat.reshape(placement.shape)


class _Same:
    def rebalance_experts(self, placement: torch.Tensor, load: torch.Tensor):
        placement = torch.as_tensor(placement)
        return False, list(range(placement.shape[0])), placement.clone()


class _Slow(_Rotate):
    def rebalance_experts(self, placement: torch.Tensor, load: torch.Tensor):
        time.sleep(3.0)
        return super().rebalance_experts(placement, load)


class _Boom:
    def rebalance_experts(self, placement: torch.Tensor, load: torch.Tensor):
        raise RuntimeError("policy exploded")


class PolicyFactory:
    @staticmethod
    def generate_policy(name: str):
        policies = {"rotate": _Rotate, "same": _Same, "slow": _Slow, "boom": _Boom}
        if name not in policies:
            raise ValueError(f"unknown fake policy {name!r}")
        return policies[name]()
