"""The parallel layout: a world of workers cut into TP × CP × DP × PP (and, for the experts of a
MoE model, ETP × EP × expert-DP × PP), and how many of a group can train (an elastic group may
hold spares). Pure arithmetic, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ray_ppu.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    """World size cut into TP × CP × DP × PP, in Megatron's default rank order tp-cp-ep-dp-pp.

    The experts of a MoE layer are laid out apart (Megatron-Core's second rank generator): each
    pipeline stage's TP × CP × DP ranks are cut into ETP × EP × expert-DP, ETP varying fastest.
    A rank's attention coordinates (what :meth:`coordinates` gives and the data shards follow)
    do not depend on it."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    every_stage_reads: bool = False  # M-RoPE positions, packed boundaries: every stage needs them

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep", "etp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        model_parallel = self.tp * self.pp * self.cp
        if self.world_size % model_parallel:
            raise ConfigError(
                f"world size {self.world_size} is not divisible by "
                f"TP {self.tp} × PP {self.pp} × CP {self.cp} = {model_parallel}"
            )
        if (self.world_size // self.pp) % (self.ep * self.etp):
            raise ConfigError(
                f"the {self.world_size // self.pp} ranks of a pipeline stage (world size "
                f"{self.world_size} / PP {self.pp}) are not divisible by EP {self.ep} × "
                f"ETP {self.etp} = {self.ep * self.etp}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert shard: a stage's ranks / (EP × ETP). Expert gradients are
        reduced, and their optimizer states sharded, over this group."""
        return self.world_size // (self.pp * self.ep * self.etp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """(tp, cp, dp, pp) ranks of a global rank; tp varies fastest, pp slowest."""
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp}

    def data_ranks(self) -> Iterator[tuple[int, int]]:
        """(global rank, dp rank) of every rank that reads data.

        As in Megatron: the first TP rank of the first pipeline stage (tokens, positions) and of
        the last stage (labels, loss mask), for every DP and CP rank; it broadcasts the batch to
        the rest of its TP group. Middle pipeline stages read nothing, but for M-RoPE's
        positions and packed rows' sample boundaries (``every_stage_reads``), which every
        stage's attention needs.
        """
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            if c["tp"] == 0 and (self.every_stage_reads or c["pp"] in (0, self.pp - 1)):
                yield rank, c["dp"]


def active_workers(world_size: int, tp: int, pp: int, cp: int, global_batch_size: int,
                   micro_batch_size: int, experts_per_stage: int = 1) -> int:
    """How many of ``world_size`` workers can train: the largest multiple of TP × PP × CP whose
    DP size divides the global batch into micro batches and whose stages hold whole EP × ETP
    expert groups (``experts_per_stage``; 1 for a dense model). 0: not even one replica."""
    model_parallel = tp * pp * cp
    for active in range(world_size - world_size % model_parallel, 0, -model_parallel):
        if (global_batch_size % (micro_batch_size * (active // model_parallel)) == 0
                and (active // pp) % experts_per_stage == 0):
            return active
    return 0
