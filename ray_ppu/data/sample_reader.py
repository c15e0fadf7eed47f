"""Samples by id from Megatron's cached indices, with numpy alone (the readers' side).

Megatron-Core decides the data order: :func:`ray_ppu.data.idxmap.prepare` builds its
document / sample / shuffle indices (and a blend's dataset indices) once, into the index cache,
and writes a manifest naming them (:func:`manifest_path`). Every reader process then only
memory-maps those ``.npy`` files and the corpus's ``.bin`` / ``.idx`` and assembles a sample the
way ``GPTDataset.__getitem__`` does (megatron/core/datasets/gpt_dataset.py, 0.16.1):

* ``shuffle_index[i]`` picks a row of ``sample_index``; rows ``j`` and ``j + 1`` give the first
  and last (document-index position, token offset) of the sample;
* the tokens are the concatenation of those documents' slices (``document_index`` maps a
  position to a sequence of the ``.idx``), ``seq_length + 1`` of them, padded with the pad id
  (-1, Megatron's ``_PAD_TOKEN_ID``: our token facts carry no pad) when the corpus ran short;
* tokens = text[:-1], labels = text[1:]; the loss mask is 1 except where a label is padding;
  positions are 0 .. s-1; padding becomes token 0 (no EOD masking, no position reset: the
  pretraining settings of :func:`ray_ppu.data.idxmap.megatron_config`);
* a blend maps id *i* through ``dataset_index`` / ``dataset_sample_index`` to a sample of one
  of its GPTDatasets.

Why not call ``GPTDataset`` itself in the readers: it returns torch tensors, and importing torch
and Megatron-Core costs every reader process about 380 MB (measured with psutil's PSS), to read
numpy arrays. ``tests/test_sample_reader.py`` holds this module to ``GPTDataset.__getitem__``
sample by sample (blends, several epochs, both splits), so Megatron stays the authority.

This module imports the standard library and numpy only (a test checks the reader processes'
``sys.modules``).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Optional

import numpy as np

SAMPLE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
PAD = -1  # megatron.core.datasets.megatron_dataset._PAD_TOKEN_ID
_IDX_HEADER = b"MMIDIDX\x00\x00"
# megatron.core.datasets.indexed_dataset.DType codes
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
           7: np.float32, 8: np.uint16}


def manifest_path(cache_dir: str, key: dict) -> Path:
    """Where :func:`ray_ppu.data.idxmap.prepare` writes the manifest for the spec ``key``
    (the spec's fields: every field that changes an index changes the file)."""
    digest = hashlib.md5(json.dumps(key, sort_keys=True).encode(), usedforsecurity=False)
    return Path(cache_dir) / f"ray_ppu-samples-{digest.hexdigest()[:16]}.json"


def index_files(meta: dict) -> list[str]:
    """Every file a manifest's readers open (to tell a complete cache from a partial one)."""
    files = []

    def walk(entry: dict) -> None:
        if entry["kind"] == "blend":
            base = os.path.join(meta["cache_dir"], f"{entry['hash']}-BlendedDataset-{entry['split']}-")
            files.extend(base + f for f in ("dataset_index.npy", "dataset_sample_index.npy"))
            for part in entry["datasets"]:
                walk(part)
        else:
            base = os.path.join(meta["cache_dir"], f"{entry['hash']}-GPTDataset-{entry['split']}-")
            files.extend(base + f"{k}_index.npy" for k in ("document", "sample", "shuffle"))
            files.extend(entry["prefix"] + ext for ext in (".bin", ".idx"))

    for entry in meta["splits"].values():
        if entry is not None:
            walk(entry)
    return files


class _Corpus:
    """One ``.bin`` / ``.idx`` pair: the index memory-mapped (sequence pointers and lengths),
    the tokens read with positioned reads. Not a memory map of the ``.bin``: the kernel's
    read-ahead around every random sample would map hundreds of MB of page cache into each
    reader (counted in its PSS, measured: 650 MB for 5,000 samples of 4,096 tokens)."""

    def __init__(self, prefix: str) -> None:
        idx = f"{prefix}.idx"
        with open(idx, "rb") as f:
            if f.read(9) != _IDX_HEADER:
                raise ValueError(f"{idx}: not a Megatron index file (bad header)")
            (version,) = struct.unpack("<Q", f.read(8))
            (code,) = struct.unpack("<B", f.read(1))
            sequences, _documents = struct.unpack("<QQ", f.read(16))
            offset = f.tell()
        if version != 1 or code not in _DTYPES:
            raise ValueError(f"{idx}: index version {version}, dtype code {code} not readable")
        raw = np.memmap(idx, mode="r")
        self.lengths = np.frombuffer(raw, np.int32, sequences, offset)
        self.pointers = np.frombuffer(raw, np.int64, sequences, offset + self.lengths.nbytes)
        self.dtype = np.dtype(_DTYPES[code])
        self.fd = os.open(f"{prefix}.bin", os.O_RDONLY)

    def get(self, sequence: int, offset: int, length: Optional[int]) -> np.ndarray:
        """``IndexedDataset.get``: ``length`` tokens (None: to the end) of one sequence."""
        if length is None:
            length = int(self.lengths[sequence]) - offset
        size = self.dtype.itemsize
        data = os.pread(self.fd, length * size, int(self.pointers[sequence]) + offset * size)
        return np.frombuffer(data, self.dtype)


class _GPTSamples:
    """One GPTDataset's samples from its cached indices (see the module docstring)."""

    def __init__(self, entry: dict, cache_dir: str, corpora: dict) -> None:
        base = os.path.join(cache_dir, f"{entry['hash']}-GPTDataset-{entry['split']}-")
        self.document_index = np.load(base + "document_index.npy", mmap_mode="r")
        self.sample_index = np.load(base + "sample_index.npy", mmap_mode="r")
        self.shuffle_index = np.load(base + "shuffle_index.npy", mmap_mode="r")
        prefix = entry["prefix"]
        if prefix not in corpora:
            corpora[prefix] = _Corpus(prefix)
        self.corpus = corpora[prefix]
        self.window = entry["seq_length"] + 1  # add_extra_token_to_sequence
        self.size = len(self.sample_index) - 1

    def text(self, i: int) -> np.ndarray:
        """The ``seq_length + 1`` token ids of sample ``i`` (int64, padding = -1)."""
        j = int(self.shuffle_index[i])
        (beg, beg_off), (end, end_off) = self.sample_index[j], self.sample_index[j + 1]
        beg, beg_off, end, end_off = int(beg), int(beg_off), int(end), int(end_off)
        if beg == end:
            parts = [self.corpus.get(int(self.document_index[beg]), beg_off,
                                     end_off - beg_off + 1)]
        else:
            parts = [self.corpus.get(int(self.document_index[d]), beg_off if d == beg else 0,
                                     end_off + 1 if d == end else None)
                     for d in range(beg, end + 1)]
        text = np.full(self.window, PAD, np.int64)
        at = 0
        for part in parts:
            text[at:at + len(part)] = part
            at += len(part)
        return text


class _BlendSamples:
    """A BlendedDataset: sample ``i`` is sample ``dataset_sample_index[i]`` of dataset
    ``dataset_index[i]``."""

    def __init__(self, entry: dict, cache_dir: str, corpora: dict) -> None:
        base = os.path.join(cache_dir, f"{entry['hash']}-BlendedDataset-{entry['split']}-")
        self.dataset_index = np.load(base + "dataset_index.npy", mmap_mode="r")
        self.dataset_sample_index = np.load(base + "dataset_sample_index.npy", mmap_mode="r")
        self.parts = [_GPTSamples(e, cache_dir, corpora) for e in entry["datasets"]]
        self.size = len(self.dataset_index)

    def text(self, i: int) -> np.ndarray:
        return self.parts[int(self.dataset_index[i])].text(int(self.dataset_sample_index[i]))


class IdxmapReader:
    """Samples of the splits in one manifest, by global sample id (every split it names)."""

    def __init__(self, manifest: Path) -> None:
        try:
            meta = json.loads(Path(manifest).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{manifest} is missing: the index cache was not prepared "
                                    f"for this run (ray_ppu.data.idxmap.prepare)") from None
        self.seq_length = meta["seq_length"]
        corpora: dict = {}  # one memory map per corpus, shared by the splits
        self.splits = {}
        for split, entry in meta["splits"].items():
            if entry is not None:
                kind = _BlendSamples if entry["kind"] == "blend" else _GPTSamples
                self.splits[split] = kind(entry, meta["cache_dir"], corpora)

    def read_text(self, sample_ids, split: str = "train") -> dict[str, np.ndarray]:
        """Samples ``sample_ids`` of ``split`` as ``text`` int32 ``[n, s + 1]`` (padding -1)
        and ``sample_id``: a quarter of the bytes of the four arrays training needs, which
        :func:`expand` derives where they are used."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        source = self.splits[split]
        text = np.empty((len(ids), self.seq_length + 1), np.int32)
        for row, i in enumerate(ids):
            text[row] = source.text(int(i))
        return {"text": text, "sample_id": ids}

    def read(self, sample_ids, split: str = "train") -> dict[str, np.ndarray]:
        """Samples ``sample_ids`` of ``split`` as :func:`ray_ppu.data.idxmap.read` returns them."""
        return expand(self.read_text(sample_ids, split))


def expand(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``text`` rows to what training reads, as ``GPTDataset.__getitem__`` builds it: int32
    tokens, labels and positions, float32 loss mask ``[n, s]``; ``sample_id`` kept. Batches
    without ``text`` (SFT rows) pass unchanged."""
    if "text" not in batch:
        return batch
    text = batch["text"]
    n, s = text.shape[0], text.shape[1] - 1
    labels = text[:, 1:]
    return {"tokens": np.where(text[:, :-1] == PAD, 0, text[:, :-1]),
            "labels": np.where(labels == PAD, 0, labels),
            "loss_mask": (labels != PAD).astype(np.float32),
            "position_ids": np.broadcast_to(np.arange(s, dtype=np.int32), (n, s)).copy(),
            "sample_id": batch["sample_id"]}
