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

import dataclasses
import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ray_ppu.data import sample_reader
from ray_ppu.util.dist import single_process_group
from ray_ppu.util.fs import atomic_write_text
from ray_ppu.errors import BlendError  # noqa: F401 (also imported from here)

log = logging.getLogger(__name__)

SAMPLE_KEYS = sample_reader.SAMPLE_KEYS


@dataclass(frozen=True)
class TokenIds:
    """The token facts GPTDataset reads from a tokenizer: EOD id and vocabulary size."""

    eod: int
    vocab_size: int

    @property
    def unique_identifiers(self) -> dict:  # part of Megatron's index-cache key
        return {"class": "ray_ppu.TokenIds", "eod": self.eod, "vocab_size": self.vocab_size}


SPLITS = ("train", "valid")  # Megatron's Split order; the test split is never built


def is_number(text: str) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True


def parse_blend(items, key: str = "data.data_path") -> tuple[tuple[str, ...], tuple[float, ...] | None]:
    """Megatron's ``--data-path`` forms: ``[prefix, ...]`` or ``[weight, prefix, weight, prefix, ...]``.

    Returns ``(prefixes, weights)``; weights None means "each prefix once, in proportion to its
    size" (Megatron's unweighted blend). Weights need not sum to one (Megatron normalizes).
    """
    items = [str(i) for i in items]
    if not items:
        raise BlendError(f"{key} is empty: name at least one idxmap prefix")
    numeric = [is_number(i) for i in items]
    if not any(numeric):
        return tuple(items), None
    if len(items) % 2 or not all(numeric[0::2]) or any(numeric[1::2]):
        raise BlendError(f"{key}={items}: a blend alternates weight and prefix "
                         f"([w1, prefix1, w2, prefix2, ...]); got a number where a prefix belongs "
                         f"or an odd number of entries")
    weights = tuple(float(w) for w in items[0::2])
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise BlendError(f"{key}: blend weights {list(weights)} must be ≥ 0 with a positive sum")
    return tuple(items[1::2]), weights


@dataclass(frozen=True)
class SampleSpec:
    """Everything that fixes the global sample order (hashable: a cache key per process).

    ``valid_prefixes`` empty: validation comes from the ``split`` of ``prefixes`` (Megatron's
    ``--data-path`` + ``--split``); otherwise from its own blend (``--valid-data-path``) and
    the training blend is used whole.
    """

    prefixes: tuple[str, ...]
    weights: Optional[tuple[float, ...]]
    split: str
    seq_length: int
    seed: int
    train_samples: int
    index_cache_dir: str
    eod_token_id: int
    vocab_size: int
    valid_samples: int = 0  # 0: no validation, its indices are not built
    valid_prefixes: tuple[str, ...] = ()
    valid_weights: Optional[tuple[float, ...]] = None

    @property
    def all_prefixes(self) -> tuple[str, ...]:
        return self.prefixes + self.valid_prefixes

    def samples(self, split: str) -> int:
        return {"train": self.train_samples, "valid": self.valid_samples}[split]


def megatron_config(spec: SampleSpec):
    """The GPTDatasetConfig Megatron-LM would build for these data arguments."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    separate_valid = bool(spec.valid_prefixes)
    return GPTDatasetConfig(
        random_seed=spec.seed,
        sequence_length=spec.seq_length,
        blend=None if separate_valid else (list(spec.prefixes), _list(spec.weights)),
        blend_per_split=[
            (list(spec.prefixes), _list(spec.weights)),
            (list(spec.valid_prefixes), _list(spec.valid_weights)),
            None,
        ] if separate_valid else None,
        split=None if separate_valid else spec.split,
        path_to_cache=spec.index_cache_dir,
        tokenizer=TokenIds(spec.eod_token_id, spec.vocab_size),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # causal mask comes from the attention module
    )


def _list(values):
    return None if values is None else list(values)


def split_matrix(split: str) -> list[Optional[tuple[float, float]]]:
    """Each split's ``(lo, hi)`` share of every corpus's documents, or None for an empty one:
    the matrix ``GPTDatasetConfig`` derives from ``data.split`` ("98,2,0" → [(0, 0.98),
    (0.98, 1.0), None]), by the same float arithmetic (the parity test compares the two).
    Computed here because the launch checks the splits before anything else needs
    Megatron-Core, whose import costs the driver 2 s."""
    weights = [float(w) for w in re.findall(r"[.0-9]+", split)]
    weights += [0.0] * (len(SPLITS) + 1 - len(weights))  # train, valid, test
    total = np.sum(np.array(weights, dtype=np.float64))  # numpy's sum, as Megatron's
    bounds = [0.0]
    for share in (np.array(weights, dtype=np.float64) / total).tolist():
        bounds.append(bounds[-1] + share)
    return [(lo, hi) if hi > lo else None for lo, hi in zip(bounds[:-1], bounds[1:])]


def empty_splits(spec: SampleSpec, sequences: dict[str, int]) -> list[str]:
    """Splits this run reads that hold no documents of some prefix (``sequences``: per prefix).

    Megatron asks each prefix of a blend for samples from its own document range
    ``[round(lo × n), round(hi × n))``; an empty range asked for samples never finishes
    building (its epoch loop waits for tokens that never come), so it is caught here first.
    """
    if spec.valid_prefixes:
        return []
    matrix = split_matrix(spec.split)
    problems = []
    for prefix in spec.prefixes:
        n = sequences[prefix]
        for index, split in enumerate(SPLITS):
            if not spec.samples(split):
                continue
            bounds = matrix[index]
            docs = 0 if bounds is None else int(round(bounds[1] * n)) - int(round(bounds[0] * n))
            if docs <= 0:
                problems.append(f"{prefix}: data.split {spec.split} leaves the {split} split none "
                                f"of its {n} documents; the run reads {spec.samples(split)} "
                                f"{split} samples (set data.valid_data_path or change data.split)")
    return problems


def check(spec: SampleSpec) -> list:
    """Every corpus of ``spec`` usable for this run (files, headers, sizes, token ids, splits),
    or one CorpusError naming each file at fault. Cheap: headers, indices and a token sample."""
    from ray_ppu.data.checks import check_corpus
    from ray_ppu.errors import CorpusError

    infos = check_corpus(list(dict.fromkeys(spec.all_prefixes)), spec.seq_length, spec.vocab_size)
    problems = empty_splits(spec, {i.prefix: i.sequences for i in infos})
    if problems:
        raise CorpusError("unusable idxmap corpus:\n  - " + "\n  - ".join(problems))
    return infos


def _build(spec: SampleSpec) -> dict:
    """Megatron's datasets for the splits this run reads: {"train": ..., "valid": ... | None}."""
    with single_process_group():  # Megatron's index builders ask torch.distributed for the rank
        return _build_in_group(spec)


def _build_in_group(spec: SampleSpec) -> dict:
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset

    config = megatron_config(spec)
    # Splits we never read are not built at all: Megatron would otherwise build (and, for a
    # split holding no documents but asked for samples, loop forever on) their indices. The
    # training documents and order are unaffected: each split's document range is fixed by
    # the split string alone.
    if config.split_matrix is not None:
        config.split_matrix = [config.split_matrix[0],
                               config.split_matrix[1] if spec.valid_samples else None, None]
    elif not spec.valid_samples:
        config.blend_per_split[1] = None
    # 0, not None, for the splits not built: Megatron asserts sizes exist for weighted blends.
    sizes = [spec.train_samples, spec.valid_samples, 0]
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    built = {"train": train, "valid": valid if spec.valid_samples else None}
    for split in SPLITS:
        want = spec.samples(split)
        have = 0 if built[split] is None else len(built[split])
        if want and have < want:
            source = spec.valid_prefixes or spec.prefixes
            hint = ("; an unweighted list of prefixes is read once — give weights "
                    "([w1, prefix1, ...]) to repeat epochs" if len(source) > 1 and
                    (spec.valid_weights if spec.valid_prefixes else spec.weights) is None else "")
            raise ValueError(f"{split} data {list(source)} (split {spec.split}) gives {have} samples "
                             f"of {spec.seq_length} tokens; the run needs {want}{hint}")
    return built


@functools.lru_cache(maxsize=4)
def datasets(spec: SampleSpec) -> dict:
    """This process's Megatron datasets for ``spec`` (built or loaded from the cache once)."""
    return _build(spec)


def dataset(spec: SampleSpec, split: str = "train"):
    """This process's Megatron dataset (GPTDataset or BlendedDataset) for one split."""
    return datasets(spec)[split]


def prepare(spec: SampleSpec, checked: bool = False) -> dict[str, int]:
    """Check the corpora (unless ``checked``: the caller just did), build and cache Megatron's
    indices, and write the manifest the readers open them by (:mod:`ray_ppu.data.sample_reader`);
    returns samples per split."""
    if not checked:
        check(spec)
    Path(spec.index_cache_dir).mkdir(parents=True, exist_ok=True)
    built = _build(spec)
    _write_manifest(spec, built)
    return {split: 0 if ds is None else len(ds) for split, ds in built.items()}


def prepared(spec: SampleSpec) -> Optional[dict[str, int]]:
    """Samples per split when the cache already holds every index file of ``spec``'s manifest
    (no Megatron import, no rebuild: a restart or a second launch); else None."""
    try:
        meta = json.loads(manifest(spec).read_text())
    except (OSError, json.JSONDecodeError):  # absent (or not even a directory: the preflight says)
        return None
    if not all(Path(f).is_file() for f in sample_reader.index_files(meta)):
        return None
    return {split: 0 if e is None else e["samples"] for split, e in meta["splits"].items()}


def manifest(spec: SampleSpec) -> Path:
    """The manifest of ``spec``'s cached indices (written by :func:`prepare`)."""
    return sample_reader.manifest_path(spec.index_cache_dir, dataclasses.asdict(spec))


def _write_manifest(spec: SampleSpec, built: dict) -> None:
    """Name, per split, the index files Megatron cached for each of its datasets: the readers
    compute nothing, they map what Megatron built."""
    from megatron.core.datasets.blended_dataset import BlendedDataset

    def entry(ds) -> dict:
        if isinstance(ds, BlendedDataset):
            return {"kind": "blend", "hash": ds.unique_description_hash, "split": ds.split.name,
                    "datasets": [entry(d) for d in ds.datasets], "samples": len(ds)}
        return {"kind": "gpt", "hash": ds.unique_description_hash, "split": ds.index_split.name,
                "prefix": ds.dataset.path_prefix, "seq_length": spec.seq_length,
                "samples": len(ds)}

    text = json.dumps({"seq_length": spec.seq_length, "cache_dir": spec.index_cache_dir,
                       "splits": {split: None if ds is None else entry(ds)
                                  for split, ds in built.items()}}, indent=1)
    atomic_write_text(manifest(spec), text)


def read(spec: SampleSpec, sample_ids: np.ndarray, split: str = "train") -> dict[str, np.ndarray]:
    """Samples ``sample_ids`` of ``split`` as arrays [n, seq_length]: token ids, labels and
    positions int32 (half the bytes of int64 through Ray's object store; the training side
    widens them), loss mask float32; and ``sample_id`` [n], the ids themselves."""
    ds = dataset(spec, split)
    n = len(sample_ids)
    out = {key: np.empty((n, spec.seq_length), np.float32 if key == "loss_mask" else np.int32)
           for key in SAMPLE_KEYS}
    for row, i in enumerate(sample_ids):
        sample = ds[int(i)]
        for key in SAMPLE_KEYS:
            out[key][row] = sample[key].numpy()
    out["sample_id"] = np.asarray(sample_ids, dtype=np.int64)  # for output.sample_log
    return out


def spec_for(cfg, plan) -> SampleSpec:
    """The SampleSpec of a run (``cfg``: RunConfig, ``plan``: Plan)."""
    cache = cfg.index_cache_dir()
    prefixes, weights = parse_blend(cfg.data.data_path)
    valid_prefixes, valid_weights = (parse_blend(cfg.data.valid_data_path, "data.valid_data_path")
                                     if cfg.data.valid_data_path else ((), None))

    def resolve(paths):
        return tuple(str(Path(p).expanduser().resolve()) for p in paths)

    return SampleSpec(
        prefixes=resolve(prefixes),
        weights=weights,
        split=cfg.data.split,
        seq_length=plan.seq_length,
        seed=cfg.training.seed,
        train_samples=plan.train_samples,
        index_cache_dir=str(Path(cache).expanduser().resolve()),
        eod_token_id=cfg.data.eod_token_id,
        vocab_size=cfg.model.vocab_size,
        valid_samples=plan.valid_samples,
        valid_prefixes=resolve(valid_prefixes),
        valid_weights=valid_weights,
    )
