"""Idxmap samples: Megatron's order (datasets, blends, epochs, sampler)."""

import numpy as np
import pytest

from ray_ppu.data import idxmap
from ray_ppu.data.sampler import rank_sample_ids, valid_start
from ray_ppu.util.dist import single_process_group


def spec(corpus, tmp_path, train_samples=64, seq_length=32, **kw):
    # 90,10,0: the test corpora hold tens of documents; 1 % would give validation none.
    return idxmap.SampleSpec(prefixes=(corpus,), weights=None, split="90,10,0",
                             seq_length=seq_length, seed=1234, train_samples=train_samples,
                             index_cache_dir=str(tmp_path / "cache"), eod_token_id=151643,
                             vocab_size=151936, **kw)


def megatron_lm_sampler(total, consumed, mbs, dp_rank, dp_size):
    """Megatron-LM's MegatronPretrainingSampler (dataloader_type "single"), restated from its
    documented behaviour: consecutive ids, mbs × DP per step, rank r keeps [r·mbs, (r+1)·mbs)."""
    batch = []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == mbs * dp_size:
            yield batch[dp_rank * mbs:(dp_rank + 1) * mbs]
            batch = []


@pytest.mark.parametrize("gbs,mbs,dp", [(12, 2, 3), (8, 1, 2), (16, 2, 2), (6, 3, 1)])
def test_rank_order_is_megatron_lm_pretraining_sampler(gbs, mbs, dp):
    iters, start = 5, 2  # resumed at iteration 2: consumed samples = 2 × gbs
    for r in range(dp):
        ours = rank_sample_ids(np.arange(start, iters), r, dp, gbs, mbs).tolist()
        theirs = [i for b in megatron_lm_sampler(iters * gbs, start * gbs, mbs, r, dp) for i in b]
        assert ours == theirs, (r, ours[:8], theirs[:8])


def test_global_order_does_not_depend_on_dp():
    """An elastic restart at another DP size consumes the same samples per iteration."""
    gbs, mbs = 8, 1
    for dp in (1, 2, 4, 8):
        per_iter = [sorted(np.concatenate([rank_sample_ids(np.array([i]), r, dp, gbs, mbs)
                                           for r in range(dp)]).tolist()) for i in range(4)]
        assert per_iter == [list(range(i * gbs, (i + 1) * gbs)) for i in range(4)]


def test_validation_resumes_at_the_next_unread_batch():
    # eval every 4 iterations, 2 batches per pass: after iteration 9 passes at 4 and 8 ran
    assert valid_start(9, 4, 2) == 4
    assert valid_start(8, 4, 2) == 4 and valid_start(7, 4, 2) == 2 and valid_start(0, 4, 2) == 0


@pytest.mark.parametrize("split", ["98,2,0", "969,30,1", "90,10,0", "1,1,1", "100,0,0",
                                   "99.9,0.1", "7", "0,1,0", "33.3,33.3,33.4", "949,50,1"])
def test_split_matrix_is_megatrons(split, tmp_path):
    """The driver's own split matrix (no Megatron import) is the one GPTDatasetConfig derives,
    float for float: the empty-split check and Megatron's builder cut the same ranges."""
    s = idxmap.SampleSpec(prefixes=("corpus",), weights=None, split=split, seq_length=8,
                          seed=1, train_samples=8, index_cache_dir=str(tmp_path),
                          eod_token_id=0, vocab_size=16)
    assert idxmap.split_matrix(split) == idxmap.megatron_config(s).split_matrix


def test_blend_forms():
    assert idxmap.parse_blend(["a"]) == (("a",), None)
    assert idxmap.parse_blend(["a", "b"]) == (("a", "b"), None)
    assert idxmap.parse_blend(["0.3", "a", "0.7", "b"]) == (("a", "b"), (0.3, 0.7))
    assert idxmap.parse_blend([3, "a", 1, "b"]) == (("a", "b"), (3.0, 1.0))
    for bad in (["0.3", "a", "b"], ["a", "0.3"], ["0.5", "0.5"], ["-1", "a", "2", "b"]):
        with pytest.raises(idxmap.BlendError, match="data.data_path"):
            idxmap.parse_blend(bad)


def megatron_lm_datasets(s: idxmap.SampleSpec, cache, valid_samples=0, test_samples=0):
    """What Megatron-LM's pretrain_gpt builds for the same data arguments (all three splits,
    its own cache directory): the reference our samples must equal."""
    import dataclasses

    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset

    config = idxmap.megatron_config(dataclasses.replace(s, index_cache_dir=str(cache)))
    sizes = [s.train_samples, valid_samples, test_samples]
    with single_process_group():  # as rank 0 of a one-process job
        return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def assert_same_samples(ours, theirs, n):
    assert len(ours) >= n and len(theirs) >= n
    for i in list(range(min(n, 40))) + [n - 1]:
        assert np.array_equal(ours[i]["tokens"].numpy(), theirs[i]["tokens"].numpy()), i
        assert np.array_equal(ours[i]["labels"].numpy(), theirs[i]["labels"].numpy()), i


def test_single_prefix_equals_megatron_lm(corpus, tmp_path):
    s = spec(corpus, tmp_path, train_samples=96, valid_samples=16)
    built = idxmap.prepare(s)  # whole epochs: at least what was asked for
    assert built["train"] >= 96 and built["valid"] >= 16
    train, valid, _ = megatron_lm_datasets(s, tmp_path / "ref", valid_samples=16, test_samples=8)
    assert_same_samples(idxmap.dataset(s, "train"), train, 96)
    assert_same_samples(idxmap.dataset(s, "valid"), valid, 16)


def test_weighted_blend_and_epochs_equal_megatron_lm(corpus, corpus_b, tmp_path):
    # corpus_b holds ~1/3 of corpus's tokens; weight 0.5 on it with this many samples takes
    # it through several epochs (Megatron reshuffles per epoch).
    one_epoch_b = len(idxmap.dataset(spec(corpus_b, tmp_path / "b", train_samples=1), "train"))
    n = 3 * one_epoch_b
    s = spec(corpus, tmp_path, train_samples=n, valid_samples=8)
    s = idxmap.SampleSpec(**{**s.__dict__, "prefixes": (corpus, corpus_b), "weights": (0.5, 0.5)})
    idxmap.prepare(s)
    train, valid, _ = megatron_lm_datasets(s, tmp_path / "ref", valid_samples=8, test_samples=0)
    ours = idxmap.dataset(s, "train")
    assert type(ours).__name__ == "BlendedDataset" and len(ours) >= n  # ceil per prefix
    assert_same_samples(ours, train, n)
    drawn = np.bincount(ours.dataset_index[:n])
    assert abs(drawn[0] - drawn[1]) <= 1, drawn  # 0.5 / 0.5, interleaved from the start
    assert_same_samples(idxmap.dataset(s, "valid"), valid, 8)


def test_separate_validation_path_equals_megatron_lm(corpus, corpus_b, tmp_path):
    s = spec(corpus, tmp_path, train_samples=64, valid_samples=32, valid_prefixes=(corpus_b,))
    idxmap.prepare(s)
    train, valid, _ = megatron_lm_datasets(s, tmp_path / "ref", valid_samples=32)
    assert_same_samples(idxmap.dataset(s, "train"), train, 64)
    assert_same_samples(idxmap.dataset(s, "valid"), valid, 32)


def test_unweighted_list_too_short_is_a_clear_error(corpus, corpus_b, tmp_path):
    s = spec(corpus, tmp_path, train_samples=10**7)
    s = idxmap.SampleSpec(**{**s.__dict__, "prefixes": (corpus, corpus_b)})
    with pytest.raises(ValueError, match=r"the run needs 10000000; an unweighted list .* weights"):
        idxmap.prepare(s)


def test_samples_are_read_as_arrays(corpus, tmp_path):
    s = spec(corpus, tmp_path)
    idxmap.prepare(s)
    batch = idxmap.read(s, np.array([0, 5, 63]))
    assert batch["tokens"].shape == (3, 32) and batch["tokens"].dtype == np.int32
    assert np.array_equal(batch["tokens"][1], idxmap.dataset(s)[5]["tokens"].numpy())
    assert np.array_equal(batch["tokens"][1, 1:], batch["labels"][1, :-1])  # shifted by one
    assert batch["position_ids"][0].tolist() == list(range(32))
    assert batch["loss_mask"].min() == 1.0


def test_index_cache_is_reused(corpus, tmp_path):
    s = spec(corpus, tmp_path)
    idxmap.prepare(s)
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*.npy")}
    assert mtimes, "Megatron wrote no index files into the cache"
    idxmap.prepare(s)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*.npy")} == mtimes


def test_missing_prefix_is_named(corpus, tmp_path):
    from ray_ppu.errors import CorpusError

    s = spec(corpus, tmp_path)
    s = idxmap.SampleSpec(**{**s.__dict__, "prefixes": (corpus, str(tmp_path / "nothere"))})
    with pytest.raises(CorpusError, match=r"nothere\.bin: missing"):
        idxmap.prepare(s)


def test_empty_validation_split_is_caught_before_megatron_hangs(corpus, tmp_path):
    from ray_ppu.errors import CorpusError

    s = idxmap.SampleSpec(**{**spec(corpus, tmp_path, valid_samples=8).__dict__,
                             "split": "1000,1,0"})
    with pytest.raises(CorpusError, match=r"leaves the valid split none of its \d+ documents"):
        idxmap.prepare(s)
