"""Idxmap samples streamed by Ray Data to the ranks that read data.

The trainer gets two Ray Datasets of step numbers (``range``): ``train`` (the run's remaining
iterations) and ``valid`` (the remaining validation iterations, when validation is on). For
each data-reading rank, :class:`IdxmapDataConfig` maps them to that rank's samples: step *i* →
the DP rank's microbatches of global batch *i* (:mod:`ray_ppu.data.order`) → tokens read by
Megatron's dataset in a Ray Data actor. Ranks that read nothing (TP ranks > 0, middle pipeline
stages) get ``None`` and receive their batch by broadcast inside the TP group.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np
import ray
import ray.train

from ray_ppu.data import idxmap, sft_store
from ray_ppu.data.order import rank_sample_ids
from ray_ppu.plan import ParallelDims, active_workers


def _iteration_numbers(batch: Dict[str, np.ndarray], start: int) -> Dict[str, np.ndarray]:
    return {"iteration": batch["id"] + start}


class _RankReader:
    """A Ray Data actor reading one DP rank's samples: opens the corpus and Megatron's cached
    indices once (mmap), then turns iteration numbers into that rank's microbatch rows."""

    def __init__(self, spec: idxmap.SampleSpec, split: str, dp_rank: int, dp_size: int,
                 global_batch_size: int, micro_batch_size: int) -> None:
        self.spec, self.split, self.dp_rank, self.dp_size = spec, split, dp_rank, dp_size
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        # idxmap: Megatron's datasets over .bin/.idx; sft: the stored rows of the JSON shards.
        self.source = sft_store if isinstance(spec, sft_store.SFTSpec) else idxmap
        self.source.dataset(spec, split)

    def __call__(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        ids = rank_sample_ids(batch["iteration"], self.dp_rank, self.dp_size,
                              self.global_batch_size, self.micro_batch_size)
        return self.source.read(self.spec, ids, self.split)


def steps_dataset(total: int, start: Callable[[], int] = lambda: 0):
    """A dataset factory: one row (``iteration``) per remaining step ``start() .. total``.

    A factory, not a Dataset: Ray Train calls it at every (re)start of the worker group, so a
    restarted group sees the steps left from its starting point.
    """

    def make():
        first = start()
        remaining = max(0, total - first)
        ds = ray.data.range(remaining, override_num_blocks=max(1, min(remaining, 64)))
        return ds.map_batches(_iteration_numbers, fn_kwargs={"start": first}, batch_format="numpy")

    return make


class IdxmapDataConfig(ray.train.DataConfig):
    """Hands each data-reading rank its own ordered stream; every other rank gets ``None``.

    World size is the one Ray Train started with (it can differ after an elastic restart), so
    DP is derived here (:func:`ray_ppu.plan.active_workers`), not taken from the plan.
    """

    def __init__(self, spec: idxmap.SampleSpec, tp: int, pp: int, cp: int, global_batch_size: int,
                 micro_batch_size: int, reader_cpus: float = 0.5, reader_actors: int = 2) -> None:
        super().__init__(datasets_to_split=[])
        self.spec, self.tp, self.pp, self.cp = spec, tp, pp, cp
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.reader_cpus, self.reader_actors = reader_cpus, reader_actors

    def configure(self, datasets, world_size: int, worker_handles=None, worker_node_ids=None,
                  **kwargs) -> List[Dict[str, Optional[ray.data.DataIterator]]]:
        # An elastic group may hold spares past the last usable replica: they read nothing.
        active = active_workers(world_size, self.tp, self.pp, self.cp, self.global_batch_size,
                                self.micro_batch_size)
        dims = ParallelDims(active, self.tp, self.pp, self.cp)
        output: List[Dict[str, Optional[ray.data.DataIterator]]] = [
            {name: None for name in datasets} for _ in range(world_size)
        ]
        for name, ds in datasets.items():
            for rank, dp_rank in dims.data_ranks():
                rank_ds = ds.map_batches(
                    _RankReader,
                    fn_constructor_kwargs=dict(spec=self.spec, split=name, dp_rank=dp_rank,
                                               dp_size=dims.dp,
                                               global_batch_size=self.global_batch_size,
                                               micro_batch_size=self.micro_batch_size),
                    # Long-lived readers per rank: a process per read task would pay the
                    # torch/Megatron import each time and crowd the training processes' cores.
                    compute=ray.data.ActorPoolStrategy(size=self.reader_actors),
                    batch_size=1,  # one iteration's samples per call: low latency to first batch
                    batch_format="numpy",
                    num_cpus=self.reader_cpus,
                )
                # Samples must arrive in training order: the order is the data contract.
                rank_ds.context.execution_options.preserve_order = True
                # Job logs are files: tqdm bars redrawn with \r bury the progress lines.
                rank_ds.context.enable_progress_bars = False
                output[rank][name] = rank_ds.iterator()
        return output
