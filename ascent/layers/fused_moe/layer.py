"""FusedMoE: routed experts of one MoE layer (router -> expert map -> dispatch -> grouped expert MLP -> combine).

Parallelism (``ascent.distributed.parallel_state``):
* TP without expert parallelism: every rank holds all experts, each sliced along the intermediate dim
  (``w13`` rows ``[r*I/tp, (r+1)*I/tp)`` of gate and of up, ``w2`` the same columns); the routed output is
  all-reduced over TP.
* Expert parallelism (EP group size > 1): experts are whole; rank r of the EP group holds the physical slots
  ``[r*S, (r+1)*S)`` of its :class:`ExpertMap`. Tokens are replicated across the TP group, so each TP rank takes a
  contiguous slice of them (``ceil(T / tp)`` per rank; the last ones may be short or empty), routes it, dispatches
  it over the EP group with the dispatcher chosen by the profile's ``moe_comm`` policy, and the TP ranks all-gather
  the combined slices back to ``[T, H]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ascent.distributed.parallel_state import GroupCoordinator, get_ep_group, get_tp_group
from ascent.layers.fused_moe.dispatcher import MoECommType, MoEDispatcher, make_dispatcher, select_moe_comm
from ascent.layers.fused_moe.expert_map import ExpertMap, ExpertMove
from ascent.layers.fused_moe.mlp import ACTIVATIONS, unified_apply_mlp
from ascent.layers.fused_moe.router import create_router
from ascent.layers.linear import set_weight_attrs
from ascent.platform.adaptor import get_device_adaptor
from ascent.platform.device_config import get_current_profile

SHARD_IDS = ("w1", "w2", "w3")
ExpertWeights = tuple[torch.Tensor, ...]  # one view per expert tensor of a slot, in expert_tensor_names() order


def make_expert_params_mapping(num_experts: int, ckpt_gate_proj_name: str = "gate_proj",
                               ckpt_down_proj_name: str = "down_proj",
                               ckpt_up_proj_name: str = "up_proj") -> list[tuple[str, str, int, str]]:
    """``(param_name, checkpoint fragment, expert_id, shard_id)`` for every expert and projection: param_name is
    ``"experts.w13_weight"`` (gate = "w1", up = "w3") or ``"experts.w2_weight"`` (down = "w2"); the fragment is
    ``"experts.{e}.{proj}."``. A checkpoint key ``<prefix>experts.{e}.gate_proj.weight`` loads into
    ``<prefix>experts.w13_weight`` (prefix = the key up to the fragment)."""
    shards = (("w1", ckpt_gate_proj_name), ("w2", ckpt_down_proj_name), ("w3", ckpt_up_proj_name))
    return [("experts.w2_weight" if sid == "w2" else "experts.w13_weight", f"experts.{e}.{proj}.", e, sid)
            for e in range(num_experts) for sid, proj in shards]


def expert_param_name(param_name: str, checkpoint_name: str, fragment_end: int) -> str:
    """The fused parameter for a per-expert checkpoint tensor: ``experts.w13_weight`` + the tensor's suffix after the
    ``experts.{e}.{proj}.`` fragment ending at ``fragment_end`` (``weight`` -> ``w13_weight``, ``weight_scale`` ->
    ``w13_weight_scale``, ``weight_packed`` -> ``w13_weight_packed``)."""
    suffix = checkpoint_name[fragment_end:]
    return param_name[: -len("weight")] + suffix if param_name.endswith("weight") else param_name


def _check_routing_args(num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                        activation: str) -> None:
    for name, value in (("num_experts", num_experts), ("top_k", top_k), ("hidden_size", hidden_size),
                        ("intermediate_size", intermediate_size)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")


class FusedMoE(nn.Module):
    """Routed experts. Parameters: ``w13_weight [S, 2*I_tp, H]`` (gate rows then up rows), ``w2_weight [S, H, I_tp]``
    (S = local physical slots, I_tp = intermediate size per TP rank) and, with ``e_score_correction_bias``, a float32
    ``e_score_correction_bias [E]``. Every parameter has ``weight_loader(param, loaded, weight_name, shard_id,
    expert_id)``.

    ``forward(hidden [T, H], router_logits [T, E]) -> [T, H]`` (hidden's dtype): the routed experts weighted by the
    (renormalised / scaled) routing weights, reduced over TP / gathered over EP; plus ``shared_experts(hidden)``
    (times ``sigmoid(shared_expert_gate(hidden))`` when a gate is given) if those optional modules are passed.
    ``forced_comm`` (None = the profile policy) pins the EP dispatcher, e.g. for comparisons and benchmarks.

    ``quant_config`` (keyword-only): when ``quant_config.get_quant_method(self, prefix)`` returns a method, the
    experts' parameters come from its ``create_weights`` (``w13_*`` / ``w2_*`` tagged with ``moe_role``,
    ``moe_shard_dim``, ``moe_per_shard_scalar``) and the expert MLP runs its ``apply_experts``.

    Keyword-only extras beyond the shared contract: ``num_redundant_experts`` (extra physical slots, default
    round-robin replicas) or a ready ``expert_map`` (its EP rank/size must match the EP group), and
    ``shared_experts`` / ``shared_expert_gate``. ``last_expert_tokens`` holds the rows per local slot of the last
    forward (EPLB load statistics).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 params_dtype: torch.dtype, renormalize: bool = True, scoring_func: str = "softmax",
                 use_grouped_topk: bool = False, num_expert_group: int | None = None, topk_group: int | None = None,
                 e_score_correction_bias: bool = False, routed_scaling_factor: float = 1.0,
                 activation: str = "silu", prefix: str = "", *, num_redundant_experts: int = 0,
                 expert_map: ExpertMap | None = None, shared_experts: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None, quant_config: Any | None = None) -> None:
        super().__init__()
        _check_routing_args(num_experts, top_k, hidden_size, intermediate_size, activation)
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.activation, self.prefix, self.params_dtype = activation, prefix, params_dtype
        self.profile = get_current_profile()
        self.adaptor = get_device_adaptor(self.profile)
        self.router = create_router(num_experts, top_k, renormalize=renormalize, scoring_func=scoring_func,
                                    use_grouped_topk=use_grouped_topk, num_expert_group=num_expert_group,
                                    topk_group=topk_group, has_bias=e_score_correction_bias,
                                    routed_scaling_factor=routed_scaling_factor, adaptor=self.adaptor,
                                    profile=self.profile)
        self.ep_group: GroupCoordinator = get_ep_group()
        self.tp_group: GroupCoordinator = get_tp_group()
        self.use_ep = self.ep_group.world_size > 1
        self.moe_tp_size = 1 if self.use_ep else self.tp_group.world_size
        self.moe_tp_rank = 0 if self.use_ep else self.tp_group.rank_in_group
        if intermediate_size % self.moe_tp_size:
            raise ValueError(f"intermediate_size={intermediate_size} is not divisible by tp size {self.moe_tp_size}")
        self.intermediate_size_per_partition = intermediate_size // self.moe_tp_size
        self.expert_map = expert_map or ExpertMap(num_experts, self.ep_group.world_size,
                                                  self.ep_group.rank_in_group, num_redundant=num_redundant_experts)
        self._check_expert_map()
        self.quant_method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self._create_weights(e_score_correction_bias)
        self.shared_experts, self.shared_expert_gate = shared_experts, shared_expert_gate
        self.forced_comm: MoECommType | None = None
        self.last_expert_tokens: torch.Tensor | None = None
        self._dispatchers: dict[MoECommType, MoEDispatcher] = {}

    def _check_expert_map(self) -> None:
        em = self.expert_map
        if (em.num_logical, em.ep_size, em.ep_rank) != (self.num_experts, self.ep_group.world_size,
                                                         self.ep_group.rank_in_group):
            raise ValueError(f"expert_map {em!r} does not match num_experts={self.num_experts}, ep rank "
                             f"{self.ep_group.rank_in_group}/{self.ep_group.world_size}")

    def _create_weights(self, with_bias: bool) -> None:
        s, i, h = self.expert_map.num_local, self.intermediate_size_per_partition, self.hidden_size
        if self.quant_method is not None:
            self.quant_method.create_weights(self, s, h, i, self.params_dtype, self.weight_loader)
        else:
            for name, shape in (("w13_weight", (s, 2 * i, h)), ("w2_weight", (s, h, i))):
                param = nn.Parameter(torch.empty(shape, dtype=self.params_dtype), requires_grad=False)
                set_weight_attrs(param, {"weight_loader": self.weight_loader})
                self.register_parameter(name, param)
        if with_bias:
            bias = nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(bias, {"weight_loader": self.weight_loader})
            self.register_parameter("e_score_correction_bias", bias)
        else:
            self.register_parameter("e_score_correction_bias", None)

    # ----- weight loading -----
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str = "",
                      shard_id: str | None = None, expert_id: int | None = None) -> bool:
        """Copy one checkpoint tensor into ``param``: the bias whole (cast to float32); an expert projection
        (``shard_id`` "w1" gate ``[I, H]``, "w3" up ``[I, H]``, "w2" down ``[H, I]``) into every local slot holding
        logical ``expert_id``, narrowed to this TP rank. Returns False when the expert is not local (skipped)."""
        where = weight_name or self.prefix
        if param is self.e_score_correction_bias:
            if tuple(loaded_weight.shape) != (self.num_experts,):
                raise ValueError(f"{where}: bias shape {tuple(loaded_weight.shape)} != ({self.num_experts},)")
            param.data.copy_(loaded_weight.float())
            return True
        if shard_id not in SHARD_IDS:
            raise ValueError(f"{where}: shard_id {shard_id!r} must be one of {SHARD_IDS}")
        role = getattr(param, "moe_role", None) or {id(self.w13_weight): "w13", id(self.w2_weight): "w2"}.get(id(param))
        if role != ("w2" if shard_id == "w2" else "w13"):
            raise ValueError(f"{where}: shard_id {shard_id!r} does not belong to this parameter")
        if expert_id is None or not 0 <= int(expert_id) < self.num_experts:
            raise ValueError(f"{where}: expert_id {expert_id!r} outside [0, {self.num_experts})")
        slots = self.expert_map.local_slots(int(expert_id))
        for slot in slots:
            self._load_shard(param.data[slot], loaded_weight, shard_id, where, param)
        return bool(slots)

    def _load_shard(self, dst: torch.Tensor, loaded: torch.Tensor, shard_id: str, where: str,
                    param: torch.Tensor | None = None) -> None:
        """One expert's shard into its slot ``dst``: w1/w3 into the first/second half of dim 0 (narrowed to this
        TP rank), w2 narrowed along ``moe_shard_dim`` (default 1; None = not sharded). ``moe_per_shard_scalar``
        parameters take the value whole into row 0 (w1, w2) or 1 (w3)."""
        if getattr(param, "moe_per_shard_scalar", False):
            row = dst[1 if shard_id == "w3" else 0]
            if loaded.numel() != row.numel():
                raise ValueError(f"{where}: {shard_id} value of shape {tuple(loaded.shape)} != {tuple(row.shape)}")
            row.copy_(loaded.reshape(row.shape))
            return
        tp, rank = self.moe_tp_size, self.moe_tp_rank
        dim = getattr(param, "moe_shard_dim", 1) if shard_id == "w2" else 0
        if dim is None:
            full, size = tuple(dst.shape), 0
        else:
            size = dst.shape[dim] if shard_id == "w2" else dst.shape[0] // 2
            full = tuple(size * tp if d == dim else n for d, n in enumerate(dst.shape))
        if tuple(loaded.shape) != full:
            raise ValueError(f"{where}: {shard_id} shape {tuple(loaded.shape)} != expected {full}")
        if dim is None:
            dst.copy_(loaded)
        elif shard_id == "w2":
            dst.copy_(loaded.narrow(dim, rank * size, size))
        else:
            dst.narrow(0, 0 if shard_id == "w1" else size, size).copy_(loaded.narrow(0, rank * size, size))

    # ----- EPLB: placement updates -----
    def expert_tensor_names(self) -> tuple[str, ...]:
        """Names of the per-slot tensors (dim 0 = local slot) that together hold one expert, in a fixed order (the
        same on every rank): ``("w13_weight", "w2_weight")`` unquantized; with a quant method every parameter it
        registered with a ``moe_role`` (int8 / packed int4 weights, per-channel / per-group scales, offsets, scale
        biases, shape records ...), in registration order."""
        if self.quant_method is None:
            return ("w13_weight", "w2_weight")
        return tuple(name for name, param in self.named_parameters(recurse=False)
                     if getattr(param, "moe_role", None) is not None)

    def expert_weights(self, local_slot: int) -> ExpertWeights:
        """Views of every expert tensor of a local slot (``expert_tensor_names`` order); unquantized
        ``(w13 [2*I_tp, H], w2 [H, I_tp])``."""
        return tuple(getattr(self, name).data[local_slot] for name in self.expert_tensor_names())

    def _check_expert_weights(self, weights: ExpertWeights, logical: int) -> None:
        names = self.expert_tensor_names()
        if len(weights) != len(names):
            raise ValueError(f"{self.prefix}: weights for expert {logical} have {len(weights)} tensors, the layer's "
                             f"experts have {len(names)} ({', '.join(names)})")
        for name, got in zip(names, weights):
            want = getattr(self, name).data
            if tuple(got.shape) != tuple(want.shape[1:]) or got.dtype != want.dtype:
                raise ValueError(f"{self.prefix}: weights for expert {logical}: {name} has shape "
                                 f"{tuple(got.shape)} {got.dtype}, expected {tuple(want.shape[1:])} {want.dtype}")

    def rearrange_experts(self, new_physical_to_logical: Sequence[int] | torch.Tensor,
                          fetch: Callable[[ExpertMove], ExpertWeights] | None = None) -> list[ExpertMove]:
        """Adopt a new placement and refill the local slots whose expert changed. A slot's new tensors (all of
        ``expert_tensor_names``: quantized weights move with their scales / offsets) are copied from a local slot
        that held that expert before; otherwise ``fetch(move)`` must return them (e.g. received from
        ``move.sources`` on another rank). ValueError (and no change) when a slot cannot be filled. Afterwards a
        quant method's ``experts_moved(layer, slots)`` rebuilds the caches it derived from the moved slots."""
        moves = self.expert_map.plan_placement(new_physical_to_logical)
        start, s = self.expert_map.local_start, self.expert_map.num_local
        fresh: list[ExpertWeights] = []
        for move in moves:
            local = [p - start for p in move.sources if start <= p < start + s]
            if local:
                weights = self.expert_weights(local[0])
            elif fetch is not None:
                weights = tuple(fetch(move))
            else:
                raise ValueError(f"local slot {move.local_slot} needs expert {move.new_logical}, held only by "
                                 f"physical slots {list(move.sources)} elsewhere, and no fetch was given")
            self._check_expert_weights(weights, move.new_logical)
            fresh.append(tuple(w.clone() for w in weights))
        self.expert_map.update_placement(new_physical_to_logical)
        names = self.expert_tensor_names()
        for move, weights in zip(moves, fresh):
            for name, w in zip(names, weights):
                getattr(self, name).data[move.local_slot].copy_(w)
        if moves and self.quant_method is not None:
            self.quant_method.experts_moved(self, sorted({m.local_slot for m in moves}))
        return moves

    # ----- forward -----
    def select_comm(self, tokens_per_rank: int) -> MoECommType:
        """The dispatcher for this step (``forced_comm`` or the profile policy); the same on every EP rank."""
        if not self.use_ep:
            return MoECommType.LOCAL
        return self.forced_comm or select_moe_comm(self.profile.moe_comm, self.ep_group.world_size, tokens_per_rank)

    def _dispatcher(self, kind: MoECommType) -> MoEDispatcher:
        if kind not in self._dispatchers:
            self._dispatchers[kind] = make_dispatcher(kind, self.ep_group, self.expert_map.num_physical,
                                                      self.adaptor)
        return self._dispatchers[kind]

    def _experts(self, x: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
        self.last_expert_tokens = group_list
        if self.quant_method is not None:
            return self.quant_method.apply_experts(self, x, group_list, self.activation)
        return unified_apply_mlp(x, self.w13_weight, self.w2_weight, group_list, 1, self.activation,
                                 adaptor=self.adaptor)

    def _routed(self, hidden: torch.Tensor, logits: torch.Tensor, token_offset: int, kind: MoECommType
                ) -> torch.Tensor:
        weights, ids = self.router.route(logits, self.e_score_correction_bias)
        physical = self.expert_map.to_physical(ids, token_offset)
        return self._dispatcher(kind).run(hidden, weights, physical, self._experts)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(f"hidden_states shape {tuple(hidden_states.shape)} must be [T, {self.hidden_size}]")
        if router_logits.shape != (hidden_states.shape[0], self.num_experts):
            raise ValueError(f"router_logits shape {tuple(router_logits.shape)} must be "
                             f"[{hidden_states.shape[0]}, {self.num_experts}]")
        if self.use_ep:
            out = self._forward_ep(hidden_states, router_logits)
        else:
            out = self.tp_group.all_reduce(self._routed(hidden_states, router_logits, 0, MoECommType.LOCAL))
        if self.shared_experts is not None:
            shared = self.shared_experts(hidden_states)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
            out = out + shared
        return out

    def _forward_ep(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        tp = self.tp_group
        total = hidden.shape[0]
        chunk = -(-total // tp.world_size)
        start = min(total, tp.rank_in_group * chunk)
        end = min(total, start + chunk)
        out = self._routed(hidden[start:end], logits[start:end], start, self.select_comm(chunk))
        if tp.world_size == 1:
            return out
        padded = out.new_zeros(chunk, out.shape[1])
        padded[: out.shape[0]] = out
        return tp.all_gather(padded, 0)[:total]

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate_per_rank={self.intermediate_size_per_partition}, ep={self.ep_group.world_size}, "
                f"router={type(self.router).__name__}")
