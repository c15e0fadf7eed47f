"""The readers: per-node lean Ray actors serving several data ranks and both splits, in order."""

import numpy as np
import ray

from ray_ppu.data import idxmap, inprocess, reader_pool
from test_data import spec


def test_one_pool_serves_every_rank_and_split_in_megatron_order(ray_cluster, corpus, tmp_path):
    """Two readers on this node serve DP ranks 0 and 1 (TP 2 × DP 2: ranks 0 and 2 read), the
    train stream resumed at iteration 1 and the validation stream, each microbatch equal to
    what Megatron's GPTDataset gives for Megatron-LM's sampler order; the first iterations,
    read ahead by the driver, come from the readers' cache."""
    train_iters, gbs, mbs, dp = 4, 8, 2, 2
    s = spec(corpus, tmp_path, train_samples=train_iters * gbs, valid_samples=2 * gbs)
    idxmap.prepare(s)
    source = {"manifest": str(idxmap.manifest(s))}
    node = ray.get_runtime_context().get_node_id()
    starts = {"train": (1, train_iters), "valid": (0, 2)}
    first = reader_pool.first_requests([0, 1], dp, gbs, mbs, starts, window=2)
    handles = reader_pool.start(source, "t1", [node], per_node=2, cpus=0.25)
    reader_pool.read_ahead(handles, 2, first)
    try:
        pool = reader_pool.node_readers(source, "t1", per_node=2, cpus=0.25)
        assert [r._actor_id for r in pool] == [h._actor_id for h in handles]  # found, not made
        for dp_rank in range(dp):
            for split, (start, stop) in starts.items():
                stream = reader_pool.RankStream(pool, split, start, stop, dp_rank, dp, gbs, mbs,
                                                window=2)
                streamed = list(stream)
                expected = list(inprocess.microbatches(s, dp_rank, dp, gbs, mbs, start, stop, split))
                assert len(streamed) == len(expected) == (stop - start) * gbs // dp // mbs
                for got, want in zip(streamed, expected):
                    assert np.array_equal(got["sample_id"], want["sample_id"])
                    for key in idxmap.SAMPLE_KEYS:
                        assert np.array_equal(got[key], want[key]), (dp_rank, split, key)
        # Every read-ahead request was consumed from the cache: nothing is left in it.
        assert ray.get([h.cached.remote() for h in handles]) == [0, 0]
        # Lean: the reader processes never imported torch or Megatron-Core.
        for modules in ray.get([h.modules.remote() for h in handles]):
            assert "numpy" in modules and "torch" not in modules and "megatron" not in modules
    finally:
        for h in handles:
            ray.kill(h)


def test_a_node_without_the_drivers_readers_starts_its_own(ray_cluster, corpus, tmp_path):
    s = spec(corpus, tmp_path, train_samples=16)
    idxmap.prepare(s)
    source = {"manifest": str(idxmap.manifest(s))}
    pool = reader_pool.node_readers(source, "t2", per_node=1, cpus=0.25)
    try:
        got = list(reader_pool.RankStream(pool, "train", 0, 2, 0, 1, 8, 4, window=2))
        assert [b["sample_id"].tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                          [8, 9, 10, 11], [12, 13, 14, 15]]
    finally:
        for r in pool:
            ray.kill(r)


def test_reader_count_follows_the_node_data_ranks():
    assert reader_pool.readers_per_node(0, 16) == 2 and reader_pool.readers_per_node(0, 1) == 1
    assert reader_pool.readers_per_node(3, 16) == 3  # data.reader_actors wins
    assert reader_pool.window(4, 16) == 2 and reader_pool.window(12, 4) == 3
