"""The readers: a few lean Ray actors per node that serve every local data rank, both splits.

Each data-reading rank (TP rank 0 of the first and last pipeline stage of each DP replica)
streams its own microbatches, in exactly Megatron-LM's sampler order
(:func:`ray_ppu.data.sampler.rank_sample_ids`), from the reader actors on its own node: it asks
for iteration *i* of its split, a reader turns that into the rank's sample ids and reads them
(:mod:`ray_ppu.data.sample_reader` for idxmap, :mod:`ray_ppu.data.sft_store` for SFT rows),
and the arrays come back through the node's shared-memory object store. A :class:`RankStream`
keeps ``window`` iterations in flight ahead of training, spread over the node's readers
(iteration *i* goes to reader ``i % n``: successive iterations are read in parallel, and
the answer is the same whichever reader reads it).

Why not one Ray Data pipeline per rank and split, as before: every such pipeline started its
own actor pool (2 actors × 2 splits per rank: 64 processes on a 16-rank node), each importing
torch and Megatron-Core (~380 MB PSS), and the validation pool started only at the first
validation pass. Reading a sample is a memory-mapped copy of a few KB; one lean process per
few ranks is far more than a rank consumes (``benchmark.py data`` measures both rates).

Lifetime: the driver starts the readers of every PPU node (:func:`start`) while it runs the
preflight and builds the indices, then asks them to read the first iterations of both splits
(:func:`read_ahead`) as the worker group starts, so the readers' start-up overlaps the
workers' imports and model build, and a restarted group finds them
running (they belong to the driver, not to the workers that die). A rank on a node that has
no reader of this launch (a node that joined later) starts them there itself; those belong to
that worker and go with its group.

Imports in the reader processes: this module, numpy, Ray, and the two readers above — never
torch or Megatron-Core (``tests/test_reader_pool.py`` checks ``sys.modules`` there).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import sys
import time
from typing import Iterator, Optional

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_ppu.data.sampler import rank_sample_ids
from ray_ppu.data.sample_reader import expand

log = logging.getLogger("ray_ppu")

NAMESPACE = "ray_ppu"
RANKS_PER_READER = 8  # one reader per 8 local data ranks (auto sizing; see the docstring above)
_CACHE_BYTES = 512 << 20  # prefetched iterations a reader holds before dropping the oldest


class _Reader:
    """One reader process: ``source`` is ``{"manifest": path}`` (idxmap) or ``{"sft": SFTSpec}``."""

    def __init__(self, source: dict) -> None:
        self.source = source
        self._reader = None
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cached_bytes = 0

    def _open(self):
        if self._reader is None:
            if "manifest" in self.source:
                from ray_ppu.data.sample_reader import IdxmapReader

                # tokens only: the stream expands them on the training side (sample_reader.expand)
                self._reader = IdxmapReader(self.source["manifest"]).read_text
            else:
                from ray_ppu.data import sft_store

                spec = self.source["sft"]
                self._reader = lambda ids, split: sft_store.read(spec, ids, split)
        return self._reader

    def read(self, split: str, iteration: int, dp_rank: int, dp_size: int,
             global_batch_size: int, micro_batch_size: int) -> dict:
        """DP rank ``dp_rank``'s samples of one iteration of ``split``, microbatch after
        microbatch (``num_microbatches × micro_batch_size`` rows)."""
        key = (split, iteration, dp_rank, dp_size, global_batch_size, micro_batch_size)
        batch = self._cache.pop(key, None)
        if batch is not None:
            self._cached_bytes -= _nbytes(batch)
            return batch
        ids = rank_sample_ids(np.array([iteration]), dp_rank, dp_size, global_batch_size,
                              micro_batch_size)
        return self._open()(ids, split)

    def prefetch(self, requests: list[tuple]) -> int:
        """Read ``requests`` (argument tuples of :meth:`read`) ahead; returns how many."""
        for key in requests:
            if key in self._cache:
                continue
            batch = self.read(*key)
            self._cache[key] = batch
            self._cached_bytes += _nbytes(batch)
            while self._cached_bytes > _CACHE_BYTES and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)  # a rank that went elsewhere
                self._cached_bytes -= _nbytes(old)
        return len(requests)

    def cached(self) -> int:
        """Iterations read ahead and not yet asked for."""
        return len(self._cache)

    def ready(self) -> int:
        """Opened (the manifest and memory maps): this process's pid."""
        self._open()
        return os.getpid()

    def modules(self) -> list[str]:
        """Top-level packages imported in this process (the lean-reader test)."""
        return sorted({name.split(".")[0] for name in sys.modules})


def _nbytes(batch: dict) -> int:
    return sum(v.nbytes for v in batch.values())


_ReaderActor = ray.remote(_Reader)


def readers_per_node(configured: int, local_data_ranks: int) -> int:
    """``data.reader_actors`` (0: one per :data:`RANKS_PER_READER` local data ranks)."""
    return configured or max(1, math.ceil(local_data_ranks / RANKS_PER_READER))


def window(prefetch_batches: int, num_microbatches: int) -> int:
    """Iterations a rank's stream keeps requested ahead: ``data.prefetch_batches``
    microbatches in whole iterations, at least 2 (one being read while one is trained on)."""
    return max(2, math.ceil(prefetch_batches / num_microbatches))


def _name(token: str, node_id: str, index: int) -> str:
    return f"ray_ppu_reader:{token}:{node_id}:{index}"


def _create(source: dict, token: str, node_id: str, index: int, cpus: float):
    return _ReaderActor.options(
        name=_name(token, node_id, index), namespace=NAMESPACE, get_if_exists=True,
        num_cpus=cpus, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(source)


def start(source: dict, token: str, node_ids: list[str], per_node: int, cpus: float) -> list:
    """Start ``per_node`` readers on each node, without waiting: their processes start while
    the caller goes on (they open ``source`` at their first read). Returns the handles, node
    after node (the caller keeps them alive)."""
    return [_create(source, token, node_id, i, cpus)
            for node_id in node_ids for i in range(per_node)]


def read_ahead(handles: list, per_node: int, first: list[tuple]) -> None:
    """Have each node's readers read ``first`` (argument tuples of :meth:`_Reader.read`) as
    the streams will ask them: iteration *i* by reader ``i % per_node`` of every node."""
    for at, reader in enumerate(handles):
        reader.prefetch.remote([r for r in first if r[1] % per_node == at % per_node])


def first_requests(data_ranks: list[int], dp_size: int, global_batch_size: int,
                   micro_batch_size: int, starts: dict[str, tuple[int, int]],
                   window: int) -> list[tuple]:
    """The first ``window`` iterations of each split (``starts``: split → (first, stop)) for
    every data rank: what the streams of a starting group ask first."""
    return [(split, it, dp_rank, dp_size, global_batch_size, micro_batch_size)
            for split, (first, stop) in starts.items()
            for it in range(first, min(stop, first + window)) for dp_rank in data_ranks]


def node_readers(source: dict, token: str, per_node: int, cpus: float) -> list:
    """This node's readers of the launch ``token``: the driver's, else started here."""
    node_id = ray.get_runtime_context().get_node_id()
    readers = []
    for i in range(per_node):
        try:
            readers.append(ray.get_actor(_name(token, node_id, i), namespace=NAMESPACE))
        except ValueError:  # no such actor: a node without the driver's readers
            readers.append(_create(source, token, node_id, i, cpus))
    return readers


class RankStream:
    """One data rank's microbatches of ``split`` for iterations ``[first, stop)``, in order,
    with ``window`` iterations requested ahead. Also times the wait for the first one."""

    def __init__(self, readers: list, split: str, first: int, stop: int, dp_rank: int,
                 dp_size: int, global_batch_size: int, micro_batch_size: int,
                 window: int) -> None:
        self.readers, self.split = readers, split
        self.args = (dp_rank, dp_size, global_batch_size, micro_batch_size)
        self.micro_batch_size = micro_batch_size
        self.next_request, self.stop = first, stop
        self.window = max(1, window)
        self.pending: collections.deque = collections.deque()
        self.current: Optional[dict] = None
        self.offset = 0
        self.first_wait_s: Optional[float] = None
        self._fill()

    def _fill(self) -> None:
        while len(self.pending) < self.window and self.next_request < self.stop:
            it = self.next_request
            reader = self.readers[it % len(self.readers)]
            self.pending.append(reader.read.remote(self.split, it, *self.args))
            self.next_request += 1

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if self.current is None or self.offset >= len(self.current["sample_id"]):
            if not self.pending:
                raise StopIteration
            started = time.perf_counter()
            self.current = ray.get(self.pending.popleft())
            if self.first_wait_s is None:
                self.first_wait_s = time.perf_counter() - started
            self.offset = 0
            self._fill()
        mbs, at = self.micro_batch_size, self.offset
        self.offset += mbs
        return expand({k: v[at:at + mbs] for k, v in self.current.items()})
