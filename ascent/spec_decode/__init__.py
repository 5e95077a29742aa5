"""Speculative decoding: configuration, the Proposer interface and registry, and the proposers."""

from ascent.spec_decode.base import Proposer, SpeculativeConfig
from ascent.spec_decode.registry import get_proposer_cls, register_proposer

__all__ = ["Proposer", "SpeculativeConfig", "get_proposer_cls", "register_proposer"]
