"""Idxmap samples streamed by Ray Data to the ranks that read data.

The Ray Dataset handed to the trainer is the run's remaining iterations (``range``); for each
data-reading rank, :class:`IdxmapDataConfig` maps it to that rank's samples: iteration *i* →
the DP rank's slice of global batch *i* (:mod:`ray_ppu.data.order`) → tokens read by Megatron's
GPTDataset in Ray Data tasks. Ranks that read nothing (TP ranks > 0, middle pipeline stages)
get ``None`` and receive their batch by broadcast inside the TP group.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np
import ray
import ray.train

from ray_ppu.data import idxmap
from ray_ppu.data.order import rank_sample_ids
from ray_ppu.plan import ParallelDims


def _iteration_numbers(batch: Dict[str, np.ndarray], start: int) -> Dict[str, np.ndarray]:
    return {"iteration": batch["id"] + start}


class _RankReader:
    """A Ray Data actor reading one DP rank's samples: opens the corpus and Megatron's cached
    indices once (mmap), then turns iteration numbers into that rank's microbatch rows."""

    def __init__(self, spec: idxmap.SampleSpec, dp_rank: int, dp_size: int,
                 global_batch_size: int) -> None:
        self.spec, self.dp_rank, self.dp_size = spec, dp_rank, dp_size
        self.global_batch_size = global_batch_size
        idxmap.dataset(spec)

    def __call__(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        ids = rank_sample_ids(batch["iteration"], self.dp_rank, self.dp_size, self.global_batch_size)
        return idxmap.read(self.spec, ids)


def iterations_dataset(train_iters: int, start_iteration: Callable[[], int] = lambda: 0):
    """The trainer's dataset factory: one row (``iteration``) per remaining iteration.

    A factory, not a Dataset: Ray Train calls it at every (re)start of the worker group, so a
    restarted group sees the iterations left from its starting point.
    """

    def make():
        start = start_iteration()
        remaining = train_iters - start
        ds = ray.data.range(remaining, override_num_blocks=max(1, min(remaining, 64)))
        return ds.map_batches(_iteration_numbers, fn_kwargs={"start": start}, batch_format="numpy")

    return make


class IdxmapDataConfig(ray.train.DataConfig):
    """Hands each data-reading rank its own ordered stream; every other rank gets ``None``.

    World size is the one Ray Train started with (it can differ after an elastic restart), so
    DP is derived here from the model-parallel sizes, not taken from the plan.
    """

    def __init__(self, spec: idxmap.SampleSpec, tp: int, pp: int, cp: int, global_batch_size: int,
                 reader_cpus: float = 0.5) -> None:
        super().__init__(datasets_to_split=[])
        self.spec, self.tp, self.pp, self.cp = spec, tp, pp, cp
        self.global_batch_size = global_batch_size
        self.reader_cpus = reader_cpus

    def configure(self, datasets, world_size: int, worker_handles=None, worker_node_ids=None,
                  **kwargs) -> List[Dict[str, Optional[ray.data.DataIterator]]]:
        dims = ParallelDims(world_size, self.tp, self.pp, self.cp)
        output: List[Dict[str, Optional[ray.data.DataIterator]]] = [
            {name: None for name in datasets} for _ in range(world_size)
        ]
        for name, ds in datasets.items():
            for rank, dp_rank in dims.data_ranks():
                rank_ds = ds.map_batches(
                    _RankReader,
                    fn_constructor_kwargs=dict(spec=self.spec, dp_rank=dp_rank, dp_size=dims.dp,
                                               global_batch_size=self.global_batch_size),
                    # One long-lived reader per rank: a process per read task would pay the
                    # torch/Megatron import each time and crowd the training processes' cores.
                    concurrency=1,
                    batch_size=1,  # one iteration's samples per call: low latency to first batch
                    batch_format="numpy",
                    num_cpus=self.reader_cpus,
                )
                # Samples must arrive in training order: the order is the data contract.
                rank_ds.context.execution_options.preserve_order = True
                output[rank][name] = rank_ds.iterator()
        return output
