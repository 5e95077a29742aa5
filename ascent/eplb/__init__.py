"""Expert-parallel load balancing: placement model, metrics and rebalancing policies."""

from ascent.eplb.placement import imbalance, initial_placement, log2phy, move_stats, phy2log, rank_loads, \
    replica_counts, slot_moves
from ascent.eplb.policy import PolicyFactory

__all__ = ["PolicyFactory", "imbalance", "initial_placement", "log2phy", "move_stats", "phy2log", "rank_loads",
           "replica_counts", "slot_moves"]
