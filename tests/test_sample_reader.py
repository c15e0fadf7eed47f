"""The readers' numpy path against Megatron's own GPTDataset / BlendedDataset, sample by sample."""

import subprocess
import sys

import numpy as np
import pytest

from ray_ppu.data import idxmap
from ray_ppu.data.sampler import rank_sample_ids
from ray_ppu.data.sample_reader import IdxmapReader
from test_data import spec


def assert_reader_equals_megatron(s: idxmap.SampleSpec, ids_per_split: dict) -> None:
    """Every key of every listed sample, bit for bit, against ``GPTDataset.__getitem__``."""
    idxmap.prepare(s)
    reader = IdxmapReader(idxmap.manifest(s))
    for split, ids in ids_per_split.items():
        ours = reader.read(ids, split)
        theirs = idxmap.dataset(s, split)
        assert np.array_equal(ours["sample_id"], ids)
        for row, i in enumerate(ids):
            sample = theirs[int(i)]
            for key in idxmap.SAMPLE_KEYS:
                want = sample[key].numpy()
                assert ours[key][row].dtype == (np.float32 if key == "loss_mask" else np.int32)
                assert np.array_equal(ours[key][row], want), (split, int(i), key)


def test_single_prefix_both_splits(corpus, tmp_path):
    s = spec(corpus, tmp_path, train_samples=96, valid_samples=16)
    built = idxmap.prepare(s)
    assert_reader_equals_megatron(s, {"train": np.arange(built["train"]),
                                      "valid": np.arange(built["valid"])})


def test_weighted_blend_over_several_epochs(corpus, corpus_b, tmp_path):
    one_epoch_b = len(idxmap.dataset(spec(corpus_b, tmp_path / "b", train_samples=1), "train"))
    n = 3 * one_epoch_b  # weight 0.5 on the smaller corpus: it is read about 1.5 times over
    s = spec(corpus, tmp_path, train_samples=n, valid_samples=8)
    s = idxmap.SampleSpec(**{**s.__dict__, "prefixes": (corpus, corpus_b), "weights": (0.5, 0.5)})
    idxmap.prepare(s)
    assert type(idxmap.dataset(s, "train")).__name__ == "BlendedDataset"
    assert_reader_equals_megatron(s, {"train": np.arange(n), "valid": np.arange(8)})


def test_unweighted_blend_and_separate_validation_corpus(corpus, corpus_b, tmp_path):
    s = spec(corpus, tmp_path, train_samples=64, valid_samples=32, valid_prefixes=(corpus_b,))
    assert_reader_equals_megatron(s, {"train": np.arange(64), "valid": np.arange(32)})
    s = spec(corpus, tmp_path / "u", train_samples=80)
    s = idxmap.SampleSpec(**{**s.__dict__, "prefixes": (corpus, corpus_b)})
    assert_reader_equals_megatron(s, {"train": np.arange(80)})


def test_resumed_positions_in_sampler_order(corpus, tmp_path):
    """The ids a DP rank asks for after a resume (iteration 3 of gbs 8, DP 2, mbs 2)."""
    s = spec(corpus, tmp_path, train_samples=64)
    ids = rank_sample_ids(np.arange(3, 8), 1, 2, 8, 2)
    assert_reader_equals_megatron(s, {"train": ids})


def test_missing_manifest_is_named(corpus, tmp_path):
    s = spec(corpus, tmp_path)
    with pytest.raises(FileNotFoundError, match=r"ray_ppu-samples-.*\.json is missing"):
        IdxmapReader(idxmap.manifest(s))


def test_reading_path_imports_neither_torch_nor_megatron():
    """Nor Ray Data and its pyarrow / pandas (~90 MB of a reader's PSS): an SFT or
    vision-language reader reads the prepared rows and decodes images, nothing more."""
    code = ("import sys; import ray_ppu.data.sample_reader, ray_ppu.data.sft_store, "
            "ray_ppu.data.reader_pool; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'megatron', 'pyarrow', 'pandas') or m.startswith('ray.data')); "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
