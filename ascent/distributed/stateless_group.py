"""A side-channel group over a ``TCPStore``: pickled-object send/recv/broadcast/all-gather between ``world_size``
ranks, independent of ``torch.distributed``'s default group (usable before, after or without it).

Rank 0 hosts the store at ``host:port`` (``port=0`` picks a free one; read it back from ``group.port``); the other
ranks connect as clients. Messages are store keys with per-peer sequence numbers, deleted once consumed. Every wait
is bounded by ``timeout_s`` and raises ``TimeoutError`` naming the peer.
"""

from __future__ import annotations

import pickle
import socket
from collections import defaultdict
from datetime import timedelta
from typing import Any

import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (prefer ``port=0`` where the API allows it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class StatelessProcessGroup:
    """Object messaging between ranks ``0..world_size-1`` through one TCPStore; create with :meth:`create`."""

    def __init__(self, rank: int, world_size: int, store: dist.Store, timeout_s: float, port: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside [0, {world_size})")
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.port = port
        self.timeout_s = timeout_s
        self._send_seq: dict[int, int] = defaultdict(int)
        self._recv_seq: dict[int, int] = defaultdict(int)
        self._bcast_seq: dict[int, int] = defaultdict(int)
        self._gather_seq = 0

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S,
               prefix: str = "ascent-stateless") -> "StatelessProcessGroup":
        """Rank 0 hosts the store (``port`` 0 = any free port); others connect (retrying up to ``timeout_s``)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be positive")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside [0, {world_size})")
        if rank != 0 and port <= 0:
            raise ValueError(f"port={port}: clients need the host's actual port")
        tcp = dist.TCPStore(host, port, None, rank == 0, timeout=timedelta(seconds=timeout_s),
                            wait_for_workers=False)
        return cls(rank, world_size, dist.PrefixStore(prefix, tcp), timeout_s, int(tcp.port))

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.world_size:
            raise ValueError(f"{what}={peer} is outside [0, {self.world_size})")

    def _wait_get(self, key: str, peer: int) -> bytes:
        try:
            self.store.wait([key], timedelta(seconds=self.timeout_s))
            return self.store.get(key)
        except (dist.DistStoreError, RuntimeError) as exc:
            raise TimeoutError(f"stateless group rank {self.rank}: nothing from rank {peer} within "
                               f"{self.timeout_s}s (key {key!r})") from exc

    def send_obj(self, obj: Any, dst: int) -> None:
        """Queue ``obj`` for rank ``dst`` (returns without waiting for the receiver)."""
        self._check_peer(dst, "dst")
        seq = self._send_seq[dst]
        self._send_seq[dst] += 1
        self.store.set(f"p2p/{self.rank}/{dst}/{seq}", pickle.dumps(obj))

    def recv_obj(self, src: int) -> Any:
        """The next object rank ``src`` sent to this rank (FIFO per sender)."""
        self._check_peer(src, "src")
        seq = self._recv_seq[src]
        self._recv_seq[src] += 1
        key = f"p2p/{src}/{self.rank}/{seq}"
        data = self._wait_get(key, src)
        self.store.delete_key(key)
        return pickle.loads(data)

    def _consume_shared(self, key: str, peer: int, readers: int) -> bytes:
        """Read a key that ``readers`` ranks read once each; the last reader deletes it."""
        data = self._wait_get(key, peer)
        if self.store.add(key + "/reads", 1) == readers:
            self.store.delete_key(key)
            self.store.delete_key(key + "/reads")
        return data

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj`` on every rank (all ranks call it in the same order)."""
        self._check_peer(src, "src")
        seq = self._bcast_seq[src]
        self._bcast_seq[src] += 1
        key = f"bcast/{src}/{seq}"
        if self.rank == src:
            if self.world_size > 1:
                self.store.set(key, pickle.dumps(obj))
            return obj
        return pickle.loads(self._consume_shared(key, src, self.world_size - 1))

    def all_gather_obj(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, indexed by rank."""
        seq = self._gather_seq
        self._gather_seq += 1
        self.store.set(f"gather/{seq}/{self.rank}", pickle.dumps(obj))
        out = []
        for r in range(self.world_size):
            out.append(obj if r == self.rank else
                       pickle.loads(self._consume_shared(f"gather/{seq}/{r}", r, self.world_size - 1)))
        if self.world_size == 1:
            self.store.delete_key(f"gather/{seq}/0")
        return out

    def barrier(self) -> None:
        """Return once every rank reached the barrier (bounded by ``timeout_s``)."""
        self.all_gather_obj(None)
