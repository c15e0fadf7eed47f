"""Idxmap samples: Megatron's GPTDataset order, DP slicing, and the Ray Data stream."""

import numpy as np
import pytest

from ray_ppu.data import idxmap, local
from ray_ppu.data.order import rank_sample_ids


def spec(corpus, tmp_path, num_samples=64, seq_length=32):
    return idxmap.SampleSpec(data_path=(corpus,), split="99,1,0", seq_length=seq_length, seed=1234,
                             num_samples=num_samples, index_cache_dir=str(tmp_path / "cache"),
                             eod_token_id=151643, vocab_size=151936)


def test_each_iteration_consumes_the_next_global_batch_split_contiguously():
    gbs, dp = 12, 3
    iterations = np.array([0, 1, 5])
    per_rank = [rank_sample_ids(iterations, r, dp, gbs).reshape(3, -1) for r in range(dp)]
    for row, iteration in enumerate(iterations):
        joined = np.concatenate([ids[row] for ids in per_rank])
        assert joined.tolist() == list(range(iteration * gbs, (iteration + 1) * gbs))
    assert per_rank[1][0].tolist() == [4, 5, 6, 7]  # rank 1: the second third of batch 0


def test_global_order_does_not_depend_on_dp():
    gbs = 8
    it = np.arange(4)
    for dp in (1, 2, 4, 8):
        order = np.concatenate([rank_sample_ids(it, r, dp, gbs).reshape(4, -1) for r in range(dp)], axis=1)
        assert order.reshape(-1).tolist() == list(range(32))


def test_samples_are_megatrons_gpt_dataset(corpus, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    s = spec(corpus, tmp_path)
    assert idxmap.prepare(s) >= 64
    batch = idxmap.read(s, np.array([0, 5, 63]))
    assert batch["tokens"].shape == (3, 32) and batch["tokens"].dtype == np.int64
    # labels are tokens shifted by one (windows of seq_length + 1)
    full = idxmap.dataset(s)[5]
    assert np.array_equal(batch["tokens"][1], full["tokens"].numpy())
    assert np.array_equal(batch["tokens"][1, 1:], batch["labels"][1, :-1])
    assert batch["position_ids"][0].tolist() == list(range(32))
    assert batch["loss_mask"].min() == 1.0
    # every token comes from the corpus vocabulary written by Megatron's builder
    raw = IndexedDataset(corpus)
    assert batch["tokens"].max() < 151936 and raw.sequence_lengths.sum() > 100_000


def test_index_cache_is_reused(corpus, tmp_path):
    s = spec(corpus, tmp_path)
    idxmap.prepare(s)
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("*.npy"))
    assert cached, "Megatron wrote no index files into the cache"
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*.npy")}
    idxmap.prepare(s)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*.npy")} == mtimes


def test_missing_prefix_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothere\.bin does not exist"):
        idxmap.check_prefixes([str(tmp_path / "nothere")])


def test_ray_data_stream_delivers_the_local_order(ray_cluster, corpus, tmp_path):
    """Through real Ray Data: TP=2 × DP=2 on 4 workers; TP rank 0 of each DP group reads."""
    from ray_ppu.data.ray_stream import IdxmapDataConfig, iterations_dataset

    train_iters, gbs, mbs = 4, 8, 2
    s = spec(corpus, tmp_path, num_samples=train_iters * gbs)
    idxmap.prepare(s)
    config = IdxmapDataConfig(s, tp=2, pp=1, cp=1, global_batch_size=gbs)
    per_rank = config.configure({"train": iterations_dataset(train_iters)()}, world_size=4)
    assert [it["train"] is None for it in per_rank] == [False, True, False, True]
    for rank, dp_rank in ((0, 0), (2, 1)):
        streamed = list(per_rank[rank]["train"].iter_batches(batch_size=mbs, batch_format="numpy"))
        expected = list(local.microbatches(s, dp_rank, 2, gbs, mbs, 0, train_iters))
        assert len(streamed) == len(expected) == train_iters * gbs // 2 // mbs
        for got, want in zip(streamed, expected):
            for key in idxmap.SAMPLE_KEYS:
                assert np.array_equal(got[key], want[key]), (rank, key)
