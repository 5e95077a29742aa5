"""Model-based proposers: what the runner hands them after each target step, and chain drafting.

After every target forward the runner builds a :class:`TargetStep`: for each scheduled request the rows whose
context is fully committed ("valid"): with ``N`` committed tokens after the step, the target's hidden state at
position ``p`` is valid iff ``p <= N - 2`` (the last committed token has not been fed yet), i.e. the accepted drafts'
rows plus the row that produced the bonus / recovered token, or every row of a prefill chunk. Hidden states are the
target's final (post-norm) output; ``aux_hidden_states`` are the residual-stream values captured at the layers of
``capture_layers`` (``DecoderModel.capture_layers``: id ``i`` = the value entering layer ``i``, ``i = L`` = the
last layer's output before the final norm).

:class:`ChainDrafter` drafts ``k`` tokens autoregressively with its own paged KV cache (:class:`DraftModelRunner`):
a catch-up pass over the positions the drafter has not seen yet (one batched varlen forward), whose last row gives
draft 1, then ``k - 1`` one-token steps. Draft tokens are greedy (argmax) or, with ``draft_sample_method =
"probabilistic"``, sampled from ``softmax(logits / T)`` with the request's temperature; their probabilities are kept
for the rejection sampler so random-mode verification stays exact.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from ascent.spec_decode.base import Proposer, SpeculativeConfig, pad_drafts
from ascent.spec_decode.draft_runner import DraftEnv, DraftModelRunner

_SAMPLING_EPS = 1e-5


@dataclass
class TargetStep:
    """Valid target rows of one step, requests in batch order.

    ``first_positions`` int64 ``[B]``: position of each request's first valid row; ``num_valid`` int64 ``[B]``;
    ``hidden_states`` ``[sum(num_valid), H]``; ``aux_hidden_states``: one ``[sum(num_valid), H]`` per captured layer
    (None when nothing is captured).
    """

    req_ids: list[str]
    first_positions: np.ndarray
    num_valid: np.ndarray
    hidden_states: torch.Tensor
    aux_hidden_states: list[torch.Tensor] | None

    def rows(self, i: int) -> slice:
        start = int(self.num_valid[:i].sum())
        return slice(start, start + int(self.num_valid[i]))


class ModelProposer(Proposer):
    """A proposer that may read the target's hidden states and own a KV cache.

    The runner calls ``bind(env)`` before ``load_model``, ``observe(step)`` after every target forward (when
    ``needs_hidden_states``), ``set_sampling`` before ``propose`` and ``draft_probs`` when verifying.
    """

    needs_hidden_states: bool = False

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        self.deterministic = config.draft_sample_method == "greedy"
        self.env: DraftEnv | None = None
        self.capture_layers: tuple[int, ...] = ()
        self._temperature: dict[str, float] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._probs: dict[str, list[torch.Tensor]] = {}

    def bind(self, env: DraftEnv) -> None:
        self.env = env

    def observe(self, step: TargetStep) -> None:
        """Receive one step's valid target rows."""
        return None

    def kv_cache_bytes_per_block(self) -> int:
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        return None

    def set_sampling(self, temperatures: dict[str, float], generators: dict[str, torch.Generator]) -> None:
        """Per-request temperatures (and seeded generators) for probabilistic drafting."""
        self._temperature = temperatures
        self._generators = generators

    def draft_probs(self, req_id: str, num: int) -> torch.Tensor | None:
        """float32 ``[num, V]`` proposal distributions of the request's first ``num`` drafts (None: greedy)."""
        rows = self._probs.get(req_id)
        if self.deterministic or rows is None or len(rows) < num:
            return None
        return torch.stack(rows[:num])

    def remove_request(self, req_id: str) -> None:
        self._probs.pop(req_id, None)

    def sample_drafts(self, req_ids: list[str], logits: torch.Tensor) -> torch.Tensor:
        """One draft per row (int64 ``[n]``) from fp32 ``logits [n, V]``; records probabilities when sampling."""
        if self.deterministic:
            return logits.argmax(dim=-1)
        out = logits.argmax(dim=-1)
        for i, req_id in enumerate(req_ids):
            temp = self._temperature.get(req_id, 0.0)
            if temp < _SAMPLING_EPS:
                probs = torch.zeros_like(logits[i]).scatter_(0, out[i:i + 1], 1.0)
            else:
                probs = torch.softmax(logits[i] / temp, dim=-1)
                gen = self._generators.get(req_id)
                device = gen.device if gen is not None else probs.device
                out[i] = torch.multinomial(probs.to(device), 1, generator=gen)[0]
            self._probs.setdefault(req_id, []).append(probs)
        return out


class ChainDrafter(ModelProposer):
    """Autoregressive drafting with a model that has its own paged KV cache.

    Subclasses build ``self.runner`` in ``load_model`` and implement ``forward`` / ``logits``;
    ``uses_target_hidden``: the draft input at position ``p`` pairs token ``p + 1`` with the target's hidden
    state at ``p`` (EAGLE, MTP), so the catch-up ends at ``N - 1``; otherwise (draft model) it feeds ``[c, N)``.
    """

    uses_target_hidden: bool = False

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        self.runner: DraftModelRunner | None = None
        self._pending: dict[str, tuple[int, list[torch.Tensor]]] = {}

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                carry: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft forward -> (hidden for the logits ``[n, H]``, carry for the next chain step or None)."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 ``[n, V_target]`` draft logits."""

    def first_carry(self, features: torch.Tensor) -> torch.Tensor:
        """Map the target features of the catch-up rows to the draft's carry input (EAGLE-3: ``fc``)."""
        return features

    def target_features(self, step: TargetStep, i: int) -> torch.Tensor:
        """The target features this drafter consumes for request ``i`` of ``step`` (default: final hidden)."""
        return step.hidden_states[step.rows(i)]

    # ------------------------------------------------------------------------------------------------ state
    def kv_cache_bytes_per_block(self) -> int:
        assert self.runner is not None
        return self.runner.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        assert self.runner is not None
        self.runner.initialize_kv_cache(num_blocks)

    def remove_request(self, req_id: str) -> None:
        super().remove_request(req_id)
        self._pending.pop(req_id, None)
        if self.runner is not None:
            self.runner.remove(req_id)

    def observe(self, step: TargetStep) -> None:
        if not self.uses_target_hidden:
            return
        for i, req_id in enumerate(step.req_ids):
            if step.num_valid[i] == 0:
                continue
            first = int(step.first_positions[i])
            feats = self.target_features(step, i)
            start, chunks = self._pending.get(req_id, (first, []))
            if start + sum(c.shape[0] for c in chunks) != first:  # a gap (cache hit, recompute): restart
                start, chunks = first, []
            self._pending[req_id] = (start, chunks + [feats])

    # ------------------------------------------------------------------------------------------------ propose
    def propose(self, req_ids: list[str], token_ids: list[np.ndarray], max_num_tokens: list[int]) -> np.ndarray:
        self._check_batch(req_ids, token_ids, max_num_tokens)
        for r in req_ids:
            self._probs.pop(r, None)
        plans = [self._plan(r, np.asarray(t), m) for r, t, m in zip(req_ids, token_ids, max_num_tokens)]
        active = [p for p in plans if p is not None]
        drafts: dict[str, list[int]] = {}
        if active:
            self._draft(active, drafts)
        return pad_drafts([drafts.get(r, []) for r in req_ids], self.k)

    def _plan(self, req_id: str, tokens: np.ndarray, budget: int) -> _Plan | None:
        """Catch-up inputs of one request, or None (nothing to feed, or no draft blocks)."""
        assert self.runner is not None
        n = len(tokens)
        end = n - 1 if self.uses_target_hidden else n
        feats = None
        if self.uses_target_hidden:
            pend_start, chunks = self._pending.pop(req_id, (end, []))
            feats = torch.cat(chunks) if chunks else None
            computed = self.runner.num_computed(req_id)
            if computed is None or computed < pend_start or computed > end:
                self.runner.reset(req_id, pend_start)
            begin = self.runner.num_computed(req_id)
            if feats is not None:
                feats = feats[begin - pend_start: end - pend_start]
        else:
            computed = self.runner.num_computed(req_id)
            if computed is None or computed > end:
                self.runner.reset(req_id, 0)
            begin = self.runner.num_computed(req_id)
        if begin >= end or (feats is not None and feats.shape[0] != end - begin):
            self.runner.remove(req_id)
            return None
        if not self.runner.ensure_slots(req_id, end + max(budget - 1, 0)):
            self.runner.remove(req_id)
            return None
        ids = tokens[begin + 1: end + 1] if self.uses_target_hidden else tokens[begin:end]
        return _Plan(req_id, begin, end, budget, ids, feats)

    def _draft(self, plans: list[_Plan], drafts: dict[str, list[int]]) -> None:
        assert self.runner is not None and self.env is not None
        dev = self.env.device
        req_ids = [p.req_id for p in plans]
        first = np.array([p.begin for p in plans], dtype=np.int64)
        num = np.array([p.end - p.begin for p in plans], dtype=np.int64)
        ids = torch.from_numpy(np.concatenate([p.input_ids for p in plans]).astype(np.int64)).to(dev)
        positions = torch.from_numpy(np.concatenate([np.arange(p.begin, p.end) for p in plans])).to(dev)
        carry = None
        if self.uses_target_hidden:
            carry = self.first_carry(torch.cat([p.features for p in plans]).to(dev))
        md = self.runner.metadata(req_ids, first, num)
        hidden, carry = self.runner.run(md, self.forward, ids, positions, carry)
        last = torch.from_numpy(np.cumsum(num) - 1).to(dev)
        hidden = hidden[last]
        carry = carry[last] if carry is not None else None
        for p in plans:
            self.runner.set_computed(p.req_id, p.end)
        self._chain(plans, hidden, carry, drafts)

    def _chain(self, plans: list[_Plan], hidden: torch.Tensor, carry: torch.Tensor | None,
               drafts: dict[str, list[int]]) -> None:
        """Sample draft ``j`` from ``hidden`` and feed it back, for every plan whose budget allows it."""
        assert self.runner is not None and self.env is not None
        dev = self.env.device
        live = [i for i, p in enumerate(plans) if p.budget > 0]
        step = 0
        while live:
            sub = [plans[i] for i in live]
            tokens = self.sample_drafts([p.req_id for p in sub], self.logits(hidden))
            for p, t in zip(sub, tokens.tolist()):
                drafts.setdefault(p.req_id, []).append(int(t))
            step += 1
            keep = [j for j, p in enumerate(sub) if p.budget > step]
            if not keep:
                return
            sub = [sub[j] for j in keep]
            live = [live[j] for j in keep]
            index = torch.tensor(keep, device=dev)
            pos = np.array([p.end + step - 1 for p in sub], dtype=np.int64)
            md = self.runner.metadata([p.req_id for p in sub], pos, np.ones(len(sub), dtype=np.int64))
            carry_in = carry.index_select(0, index) if carry is not None else None
            hidden, carry = self.runner.run(md, self.forward, tokens.index_select(0, index).to(dev),
                                            torch.from_numpy(pos).to(dev), carry_in)


@dataclass
class _Plan:
    req_id: str
    begin: int
    end: int
    budget: int
    input_ids: np.ndarray
    features: torch.Tensor | None
