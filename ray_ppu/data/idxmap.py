"""Samples from Megatron idxmap corpora, built by ``megatron.core.datasets`` itself.

Megatron's ``GPTDataset`` (through ``BlendedMegatronDatasetBuilder``) decides which tokens
make up sample *i*: documents shuffled per epoch, concatenated and cut into windows of
``seq_length + 1`` tokens. We reuse it unchanged; this module only says which corpus, which
split and how many samples, and turns a list of sample ids into a numpy batch.

The indices Megatron builds (document / sample / shuffle) are cached under
``index_cache_dir``: :func:`prepare` builds them once (one process), every reader then loads
them with mmap.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SAMPLE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass(frozen=True)
class TokenIds:
    """The token facts GPTDataset reads from a tokenizer: EOD id and vocabulary size."""

    eod: int
    vocab_size: int

    @property
    def unique_identifiers(self) -> dict:  # part of Megatron's index-cache key
        return {"class": "ray_ppu.TokenIds", "eod": self.eod, "vocab_size": self.vocab_size}


@dataclass(frozen=True)
class SampleSpec:
    """Everything that fixes the global sample order (hashable: a cache key per process)."""

    data_path: tuple[str, ...]
    split: str
    seq_length: int
    seed: int
    num_samples: int
    index_cache_dir: str
    eod_token_id: int
    vocab_size: int


def check_prefixes(data_path: tuple[str, ...] | list[str]) -> None:
    """Fail early, naming the file, when a prefix lacks its .bin or .idx."""
    for prefix in data_path:
        for suffix in (".bin", ".idx"):
            if not Path(prefix + suffix).is_file():
                raise FileNotFoundError(f"idxmap file {prefix + suffix} does not exist")


def _build(spec: SampleSpec):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=spec.seed,
        sequence_length=spec.seq_length,
        blend=(list(spec.data_path), None),
        split=spec.split,
        path_to_cache=spec.index_cache_dir,
        tokenizer=TokenIds(spec.eod_token_id, spec.vocab_size),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # causal mask comes from the attention module
    )
    # Validation/test get one epoch of their split (None), never 0: Megatron's epoch count loops
    # forever on a split that asks for samples but holds no documents.
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [spec.num_samples, None, None], lambda: True, config
    ).build()
    if train is None or len(train) == 0:
        raise ValueError(f"no training samples in {list(spec.data_path)} with split {spec.split}")
    return train


@functools.lru_cache(maxsize=4)
def dataset(spec: SampleSpec):
    """This process's GPTDataset for ``spec`` (built or loaded from the cache once per process)."""
    return _build(spec)


def prepare(spec: SampleSpec) -> int:
    """Build and cache Megatron's indices for ``spec``; returns the number of samples."""
    check_prefixes(spec.data_path)
    Path(spec.index_cache_dir).mkdir(parents=True, exist_ok=True)
    return len(_build(spec))


def read(spec: SampleSpec, sample_ids: np.ndarray) -> dict[str, np.ndarray]:
    """Stack GPTDataset samples ``sample_ids`` into int64/float32 arrays [n, seq_length]."""
    ds = dataset(spec)
    samples = [ds[int(i)] for i in sample_ids]
    return {
        key: np.stack([s[key].numpy() for s in samples]).astype(
            np.float32 if key == "loss_mask" else np.int64
        )
        for key in SAMPLE_KEYS
    }


def spec_for(cfg, plan) -> SampleSpec:
    """The SampleSpec of a run (``cfg``: RunConfig, ``plan``: Plan)."""
    cache = cfg.data.index_cache_dir or str(Path(cfg.output.dir) / "index_cache")
    return SampleSpec(
        data_path=tuple(str(Path(p).expanduser().resolve()) for p in cfg.data.data_path),
        split=cfg.data.split,
        seq_length=plan.seq_length,
        seed=cfg.training.seed,
        num_samples=plan.train_samples,
        index_cache_dir=str(Path(cache).expanduser().resolve()),
        eod_token_id=cfg.data.eod_token_id,
        vocab_size=cfg.model.vocab_size,
    )
