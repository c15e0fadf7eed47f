"""The keepers of in-memory snapshots: one lean Ray actor per PPU node that holds the ranks'
training-state snapshots in its own memory, so they outlive the worker processes.

Why a separate actor, owned by the driver: an object in Ray's object store dies with the
process that owns it, so a snapshot ``ray.put`` by a worker is gone when that worker dies —
exactly when it is needed. A keeper receives each snapshot as one ``bytes`` argument, which
Ray deserializes into the keeper's own heap (a copy, owned by nobody else); the worker's
object-store copy can then go. The driver starts a keeper on every PPU node (as it starts the
readers) and keeps it for the whole launch, across worker-group restarts; a keeper on a lost
node goes with it, which is why every snapshot also goes to the keeper of another node
(:func:`replica_of`).

What a keeper holds: per world rank, the newest :data:`KEEP` snapshots it received, each with
the group layout it was taken in and its length. A snapshot counts only if it arrived whole
(its length checked) — one cut off by its sender's death never enters. :func:`newest_complete`
is THE decision which snapshot a restarted group can use; rank 0 makes it and broadcasts it
(``ray_ppu.snapshot``), so every rank loads the same one.

Imports: Ray and the standard library only (no torch: a keeper holds bytes, and its process
stays ~120 MB plus what it holds).
"""

from __future__ import annotations

import collections
import logging
import sys
from typing import Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

log = logging.getLogger("ray_ppu")

NAMESPACE = "ray_ppu"
KEEP = 2  # per rank: ranks send in order and at most one behind another (ray_ppu.snapshot)


class _Keeper:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        # rank → OrderedDict(iteration → (layout, blob)), oldest first
        self._held: dict[int, collections.OrderedDict] = {}

    def put(self, rank: int, iteration: int, layout: tuple, nbytes: int, blob: bytes) -> int:
        """Hold ``blob``, rank ``rank``'s snapshot after ``iteration`` in group ``layout``;
        drops that rank's older ones past :data:`KEEP`. Returns the bytes now held."""
        if len(blob) != nbytes:  # cannot happen through Ray, but a short copy is never kept
            raise ValueError(f"snapshot of rank {rank} at iteration {iteration}: {len(blob)} "
                             f"bytes arrived of {nbytes}")
        held = self._held.setdefault(rank, collections.OrderedDict())
        held[iteration] = (tuple(layout), blob)
        held.move_to_end(iteration)
        while len(held) > KEEP:
            held.popitem(last=False)
        return self.nbytes()

    def index(self) -> dict:
        """``{rank: {iteration: layout}}`` of everything held."""
        return {rank: {it: layout for it, (layout, _) in held.items()}
                for rank, held in self._held.items()}

    def get(self, rank: int, iteration: int) -> bytes:
        return self._held[rank][iteration][1]

    def modules(self) -> list[str]:
        """Top-level packages imported in this process (the tests check: no torch)."""
        return sorted({name.split(".")[0] for name in sys.modules})

    def nbytes(self) -> int:
        return sum(len(blob) for held in self._held.values() for _, blob in held.values())



_KeeperActor = ray.remote(_Keeper)


def _name(token: str, node_id: str) -> str:
    return f"ray_ppu_keeper:{token}:{node_id}"


def start(token: str, node_ids: list[str]) -> list:
    """One keeper per node (no CPU reserved: it only copies bytes), without waiting."""
    return [_KeeperActor.options(
        name=_name(token, node_id), namespace=NAMESPACE, get_if_exists=True, num_cpus=0,
        max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(node_id) for node_id in node_ids]


def keepers(token: str, node_ids: list[str]) -> dict:
    """``{node_id: handle}`` of this launch's keepers that are still there."""
    found = {}
    for node_id in node_ids:
        try:
            found[node_id] = ray.get_actor(_name(token, node_id), namespace=NAMESPACE)
        except ValueError:  # never started there, or its node is gone
            pass
    return found


def replica_of(node_id: str, node_ids: list[str]) -> Optional[str]:
    """The node whose keeper holds the replicas of ``node_id``'s ranks: the next one in sorted
    order (a ring, so every node's ranks have one); None on a one-node cluster."""
    ring = sorted(set(node_ids))
    if len(ring) < 2 or node_id not in ring:
        return None
    return ring[(ring.index(node_id) + 1) % len(ring)]


def newest_complete(indexes: dict, world_size: int, layout: tuple,
                    not_before: int = 0) -> Optional[tuple[int, dict]]:
    """The newest iteration ``>= not_before`` whose snapshot every rank ``0..world_size-1`` of
    a group of ``layout`` has in some keeper: ``(iteration, {rank: [node_id, …]})``, the
    keepers holding each rank's copy (a rank reads its own node's when it is there), or None.

    ``indexes``: ``{node_id: keeper.index()}`` of the keepers that answered.
    """
    where: dict[int, dict[int, list]] = {}  # iteration → rank → nodes holding it
    for node_id, index in indexes.items():
        for rank, held in index.items():
            for iteration, their_layout in held.items():
                if tuple(their_layout) == tuple(layout) and iteration >= not_before:
                    where.setdefault(iteration, {}).setdefault(rank, []).append(node_id)
    for iteration in sorted(where, reverse=True):
        ranks = where[iteration]
        if all(r in ranks for r in range(world_size)):
            return iteration, {r: sorted(ranks[r]) for r in range(world_size)}
    return None
