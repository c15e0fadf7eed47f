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
the group layout it was taken in, the rank's coordinates in that group, whether it reshards
(``ray_ppu.recovery.snapshot_reshard``) and its length. A snapshot counts only if it arrived whole (its
length checked) — one cut off by its sender's death never enters. :func:`newest_restorable` is
THE decision which snapshots a restarted group uses — its own layout's, or a resized group's
of the same model shards; rank 0 makes it and broadcasts it (``ray_ppu.recovery.snapshot``), so every
rank loads the same one.

Imports: Ray and the standard library only (no torch: a keeper holds bytes, and its process
stays ~120 MB plus what it holds).
"""

from __future__ import annotations

import collections
import logging
import sys
from dataclasses import dataclass
from typing import Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

log = logging.getLogger("ray_ppu")

NAMESPACE = "ray_ppu"
KEEP = 2  # per rank: ranks send in order and at most one behind another (ray_ppu.recovery.snapshot)


class _Keeper:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        # rank → OrderedDict(iteration → (layout, blob)), oldest first
        self._held: dict[int, collections.OrderedDict] = {}

    def put(self, rank: int, iteration: int, layout: tuple, shards: tuple, nbytes: int,
            blob: bytes) -> int:
        """Hold ``blob``, rank ``rank``'s snapshot after ``iteration`` in group ``layout``
        (``shards``: its coordinates there and whether it reshards); drops that rank's older
        ones past :data:`KEEP`. Returns the bytes now held."""
        if len(blob) != nbytes:  # cannot happen through Ray, but a short copy is never kept
            raise ValueError(f"snapshot of rank {rank} at iteration {iteration}: {len(blob)} "
                             f"bytes arrived of {nbytes}")
        held = self._held.setdefault(rank, collections.OrderedDict())
        coords, reshardable = shards
        held[iteration] = ({"layout": tuple(layout), "coords": tuple(coords),
                            "reshardable": bool(reshardable)}, blob)
        held.move_to_end(iteration)
        while len(held) > KEEP:
            held.popitem(last=False)
        return self.nbytes()

    def index(self) -> dict:
        """``{rank: {iteration: {"layout", "coords", "reshardable"}}}`` of everything held."""
        return {rank: {it: entry for it, (entry, _) in held.items()}
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


def start(token: str, node_ids: list[str], detached: bool = False) -> list:
    """One keeper per node (no CPU reserved: it only copies bytes), without waiting.

    ``detached``: one a worker starts on a node that joined after the launch. Owned by that
    worker, it would die with its group (taking the replicas it holds with it, at exactly the
    restart they are for); detached, it lives until the driver's :func:`stop_all` at the end.
    """
    return [_KeeperActor.options(
        name=_name(token, node_id), namespace=NAMESPACE, get_if_exists=True, num_cpus=0,
        max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        **({"lifetime": "detached"} if detached else {}),
    ).remote(node_id) for node_id in node_ids]


def stop_all(token: str, node_ids: list[str]) -> None:
    """Kill this launch's keepers on ``node_ids`` still there (the driver, as the launch
    ends: the detached ones outlive it otherwise)."""
    for handle in keepers(token, node_ids).values():
        ray.kill(handle)


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


# Positions in ray_ppu.recovery.snapshot.layout_of: world, TP, PP, CP, DP, VP, EP, ETP. Snapshots of a
# group of another layout restore a group when all but the world (0) and DP (4) are the same.
MODEL_SHARDS = (1, 2, 3, 5, 6, 7)


def reshards(old_layout: tuple, new_layout: tuple) -> bool:
    """Whether the snapshots of a group of ``old_layout`` can restore one of ``new_layout``
    (``ray_ppu.recovery.snapshot_reshard``): the same model shards, another world and DP size."""
    return all(old_layout[i] == new_layout[i] for i in MODEL_SHARDS)


@dataclass(frozen=True)
class Found:
    """The snapshots a restarted group restores from."""

    iteration: int
    layout: tuple
    """The layout of the group that took them: the restarted group's own, or (resharded) a
    resized one's."""
    holders: dict
    """``{rank of that group: [node_id, …]}``: the keepers holding each rank's copy."""
    coords: dict
    """``{rank of that group: its coordinates}`` (``ray_ppu.recovery.snapshot_reshard.Coords``)."""


def newest_restorable(indexes: dict, layout: tuple, not_before: int = 0) -> Optional[Found]:
    """The newest iteration ``>= not_before`` at which some group's snapshots are complete —
    every rank ``0..world-1`` of that group in some keeper — and restore a group of
    ``layout``: its own layout's, or a group's with the same model shards whose snapshots all
    reshard. At one iteration the same layout wins (no resharding). None if there is none.

    ``indexes``: ``{node_id: keeper.index()}`` of the keepers that answered.
    """
    own = tuple(layout)
    # (iteration, layout) → rank → (nodes holding it, entry)
    where: dict[tuple, dict[int, tuple[list, dict]]] = {}
    for node_id, index in indexes.items():
        for rank, held in index.items():
            for iteration, entry in held.items():
                theirs = tuple(entry["layout"])
                if iteration >= not_before and (theirs == own or (
                        entry["reshardable"] and reshards(theirs, own))):
                    nodes, _ = where.setdefault((iteration, theirs), {}).setdefault(
                        rank, ([], entry))
                    nodes.append(node_id)
    for iteration, theirs in sorted(where, key=lambda k: (k[0], k[1] == own), reverse=True):
        ranks = where[(iteration, theirs)]
        if all(r in ranks for r in range(theirs[0])):
            return Found(iteration, theirs, {r: sorted(ranks[r][0]) for r in range(theirs[0])},
                         {r: tuple(ranks[r][1]["coords"]) for r in range(theirs[0])})
    return None
