"""Check Megatron idxmap corpora (``prefix.bin`` / ``prefix.idx``) on the driver, before any worker.

Why: Megatron reads a corpus deep inside every worker, after Ray has placed them and
``torch.distributed`` is up, and what it says about a bad corpus is a bare ``assert`` (bad header,
bad version, document-index mismatch) with no file name, a ``ValueError: buffer is smaller than
requested size`` from ``numpy.frombuffer`` for a truncated file, or a device-side assert in the
embedding lookup when a token id is outside the vocabulary. On a cluster that costs minutes and many
interleaved tracebacks. :func:`check_corpus` reads only the ``.idx`` files and a bounded sample of
each ``.bin`` (a 4 GB corpus is checked in well under a second) and raises one
:class:`CorpusError` that names the file and the fact at fault for every problem it finds.

The ``.idx`` layout it parses (Megatron ``indexed_dataset._IndexWriter``), little-endian::

    magic            9 bytes  b"MMIDIDX\\x00\\x00"
    version          <Q       1
    dtype code       <B       1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count   <Q       S
    document count   <Q       D = documents + 1 (the document index starts with a 0)
    sequence lengths int32 × S
    sequence pointers int64 × S   byte offset of each sequence in the .bin
    document indices int64 × D    sequence index where each document starts; the last one is S
    sequence modes   int8 × S     only in multimodal corpora
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from ray_ppu.errors import CorpusError  # noqa: F401 (also imported from here)

MAGIC = b"MMIDIDX\x00\x00"
SUPPORTED_VERSION = 1
HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count

# Megatron's DType enum (indexed_dataset.DType), repeated here so that parsing needs no Megatron
# import and an unknown code becomes a message instead of Megatron's bare ``ValueError``.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}

# How the token sample of one .bin is laid out (see sample_ranges).
INTERIOR_WINDOWS = 8
INTERIOR_FRACTION = 4  # the interior windows share 1/4 of sample_tokens; head and tail 3/8 each


@dataclass(frozen=True)
class CorpusInfo:
    """What the ``.idx`` of one prefix says (only returned when the whole check passed)."""

    prefix: str
    dtype: str  # numpy name of the token dtype, e.g. "int32"
    documents: int
    sequences: int
    tokens: int


def sample_ranges(tokens: int, sample_tokens: int) -> list[tuple[int, int]]:
    """Token position ranges ``[start, stop)`` of a corpus of ``tokens`` tokens that are checked.

    The promise (tested): if ``tokens <= sample_tokens`` every token is checked. Otherwise at most
    ``sample_tokens`` tokens are read: the first and the last ``(sample_tokens - interior) // 2``
    tokens (about 3/8 of ``sample_tokens`` each) and ``INTERIOR_WINDOWS`` windows of
    ``sample_tokens // (4 * INTERIOR_WINDOWS)`` tokens, window *i* (1-based) starting at
    ``tokens * i // (INTERIOR_WINDOWS + 1)``. The layout depends only on the two numbers, so a
    check is reproducible. Token ids outside these ranges are NOT checked: a bad id between
    windows of a large corpus goes unnoticed here (it fails later, inside a worker).
    Ranges are sorted and do not overlap.
    """
    if tokens <= 0:
        return []
    if tokens <= sample_tokens:
        return [(0, tokens)]
    window = sample_tokens // (INTERIOR_FRACTION * INTERIOR_WINDOWS)
    edge = (sample_tokens - window * INTERIOR_WINDOWS) // 2
    ranges = [(0, edge)]
    if window:
        for i in range(1, INTERIOR_WINDOWS + 1):
            start = tokens * i // (INTERIOR_WINDOWS + 1)
            ranges.append((start, min(start + window, tokens)))
    ranges.append((tokens - edge, tokens))
    # Merge overlaps (a corpus barely larger than sample_tokens) so no token is read twice.
    merged: list[tuple[int, int]] = []
    for start, stop in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


@dataclass
class _Index:
    idx_path: str
    dtype: np.dtype
    lengths: np.ndarray  # int32 × S
    pointers: np.ndarray  # int64 × S
    doc_index: np.ndarray  # int64 × D

    @property
    def documents(self) -> int:
        return max(len(self.doc_index) - 1, 0)

    @functools.cached_property
    def tokens(self) -> int:  # cached: a sum over every sequence of a large index
        return int(self.lengths.sum(dtype=np.int64))


def _read_index(idx_path: str, problems: list[str]) -> _Index | None:
    """Parse one .idx; append a line to ``problems`` and return None when it cannot be used."""
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        header = f.read(HEADER_BYTES)
    magic = header[:9]
    if len(magic) < len(MAGIC) and MAGIC.startswith(magic):
        problems.append(f"{idx_path}: truncated: {size} bytes, shorter than the "
                        f"{HEADER_BYTES}-byte header")
        return None
    if magic != MAGIC:
        # Say what is there: a .bin passed as .idx, a text file, an older fairseq index...
        problems.append(f"{idx_path}: not a Megatron index: starts with {magic!r}, "
                        f"expected magic {MAGIC!r}")
        return None
    if len(header) < HEADER_BYTES:
        problems.append(f"{idx_path}: truncated: {size} bytes, shorter than the "
                        f"{HEADER_BYTES}-byte header")
        return None
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[9:])
    if version != SUPPORTED_VERSION:
        problems.append(f"{idx_path}: unsupported index version {version} "
                        f"(Megatron reads version {SUPPORTED_VERSION} only)")
        return None
    dtype = DTYPE_CODES.get(code)
    if dtype is None:
        known = ", ".join(f"{c} {d.name}" for c, d in DTYPE_CODES.items())
        problems.append(f"{idx_path}: unknown dtype code {code} (known codes: {known})")
        return None

    # Python ints: a garbage count (e.g. 2**63) must not overflow into a plausible size.
    text_size = HEADER_BYTES + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if size < text_size:
        problems.append(f"{idx_path}: truncated: {size} bytes, but its header ({n_seq} sequences, "
                        f"{n_doc} document-index entries) needs {text_size} bytes")
        return None
    if size not in (text_size, text_size + n_seq):  # + n_seq: int8 modes of a multimodal corpus
        problems.append(f"{idx_path}: {size} bytes, but its header ({n_seq} sequences, {n_doc} "
                        f"document-index entries) needs {text_size} bytes ({text_size + n_seq} "
                        f"with multimodal sequence modes): the counts are wrong or bytes were appended")
        return None

    # np.fromfile reads exactly these arrays: the index is small next to the .bin.
    with open(idx_path, "rb") as f:
        f.seek(HEADER_BYTES)
        lengths = np.fromfile(f, dtype="<i4", count=n_seq)
        pointers = np.fromfile(f, dtype="<i8", count=n_seq)
        doc_index = np.fromfile(f, dtype="<i8", count=n_doc)
    index = _Index(idx_path, dtype, lengths, pointers, doc_index)

    before = len(problems)
    if n_doc == 0:
        problems.append(f"{idx_path}: the document index is empty (a valid one starts with 0)")
    else:
        if doc_index[0] != 0 or doc_index[-1] != n_seq:
            # Megatron asserts document_indices[-1] == sequence count without naming the file.
            problems.append(f"{idx_path}: document index runs from sequence {doc_index[0]} to "
                            f"{doc_index[-1]}, expected 0 to the sequence count {n_seq}")
        steps = np.flatnonzero(np.diff(doc_index) < 0)
        if steps.size:
            i = int(steps[0])
            problems.append(f"{idx_path}: document index decreases at document {i + 1} "
                            f"({doc_index[i]} -> {doc_index[i + 1]})")
    negative = np.flatnonzero(lengths < 0)
    if negative.size:
        i = int(negative[0])
        problems.append(f"{idx_path}: sequence {i} has negative length {lengths[i]}")
    elif n_seq:
        # Megatron's writer packs sequences back to back; token position p of the corpus is then
        # byte p * itemsize of the .bin, which the sample below relies on.
        expected = np.zeros(n_seq, dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=expected[1:])
        off = np.flatnonzero(pointers != expected)
        if off.size:
            i = int(off[0])
            problems.append(f"{idx_path}: sequence {i} points to byte {pointers[i]}, but the "
                            f"lengths before it end at byte {expected[i]} (sequences are not "
                            f"contiguous)")
    return index if len(problems) == before else None


def _bin_size_problem(bin_path: str, index: _Index) -> str | None:
    size = os.path.getsize(bin_path)
    item = index.dtype.itemsize
    by_lengths = index.tokens * item
    by_pointers = int(index.pointers[-1]) + int(index.lengths[-1]) * item if len(index.lengths) else 0
    if size == by_lengths == by_pointers:
        return None
    gap = size - by_lengths
    what = "shorter" if gap < 0 else "longer"
    return (f"{bin_path}: {size} bytes, {abs(gap)} bytes {what} than its index says: "
            f"{index.tokens} tokens × {item} bytes ({index.dtype.name}) = {by_lengths} bytes; "
            f"last sequence ends at byte {by_pointers} (from {index.idx_path})")


def _token_problem(bin_path: str, index: _Index, vocab_size: int, sample_tokens: int) -> str | None:
    tokens = index.tokens
    # memmap maps without reading: only the pages of the sampled ranges are ever touched.
    data = np.memmap(bin_path, dtype=index.dtype.newbyteorder("<"), mode="r", shape=(tokens,))
    first: tuple[int, float] | None = None
    n_bad = n_read = 0
    low = high = None
    try:
        for start, stop in sample_ranges(tokens, sample_tokens):
            chunk = np.array(data[start:stop])  # a copy: no view keeps the mapping open
            n_read += chunk.size
            bad = np.flatnonzero((chunk < 0) | (chunk >= vocab_size))
            if not bad.size:
                continue
            values = chunk[bad]
            n_bad += bad.size
            low = values.min() if low is None else min(low, values.min())
            high = values.max() if high is None else max(high, values.max())
            if first is None:
                first = (start + int(bad[0]), values[0].item())
    finally:
        del data  # close the mapping now, not at some later garbage collection
    if first is None:
        return None
    pos, value = first
    # token position -> sequence -> document, only for the one id we report.
    seq = int(np.searchsorted(np.cumsum(index.lengths, dtype=np.int64), pos, side="right"))
    doc = int(np.searchsorted(index.doc_index, seq, side="right")) - 1
    return (f"{bin_path}: token id {value} at token position {pos} (document {doc}) is outside "
            f"the vocabulary [0, vocab_size={vocab_size}); {n_bad} of {n_read} sampled tokens "
            f"are out of range (ids {low.item()}..{high.item()})")


def check_corpus(prefixes: Sequence[str | os.PathLike], seq_length: int, vocab_size: int, *,
                 sample_tokens: int = 1_000_000) -> list[CorpusInfo]:
    """Check each idxmap prefix; return one :class:`CorpusInfo` per prefix, or raise.

    Checked per prefix: ``.bin`` and ``.idx`` exist; the ``.idx`` header (magic, version 1, a
    known dtype code) and its size against the counts in it; the document index and sequence
    pointers are consistent; the ``.bin`` size equals what the index describes; the corpus is not
    empty and holds at least ``seq_length + 1`` tokens (each prefix on its own: Megatron builds a
    GPTDataset per prefix of a blend); token ids lie in ``[0, vocab_size)`` on the sample of
    :func:`sample_ranges` (every token when the corpus has at most ``sample_tokens`` tokens,
    otherwise ids between the sampled windows are not checked).

    Reads headers, the index arrays and at most ``sample_tokens`` tokens per ``.bin``.
    Raises :class:`CorpusError` listing every problem of every prefix, one line each.
    """
    if isinstance(prefixes, (str, os.PathLike)):
        # A bare string would be checked character by character.
        raise ValueError(f"check_corpus takes a list of prefixes, got the single {prefixes!r}")
    if not prefixes:
        raise ValueError("check_corpus needs at least one idxmap prefix")
    if seq_length < 1 or vocab_size < 1 or sample_tokens < 1:
        raise ValueError(f"seq_length ({seq_length}), vocab_size ({vocab_size}) and "
                         f"sample_tokens ({sample_tokens}) must be positive")
    problems: list[str] = []
    infos: list[CorpusInfo] = []
    for raw in prefixes:
        prefix = os.fspath(raw)
        bin_path, idx_path = prefix + ".bin", prefix + ".idx"
        missing = [p for p in (bin_path, idx_path) if not Path(p).is_file()]
        for path in missing:
            hint = ""
            if prefix.endswith((".bin", ".idx")):
                hint = f" (a prefix has no suffix: did you mean {prefix[:-4]}?)"
            problems.append(f"{path}: missing{hint}")
        if idx_path in missing:
            continue
        size_problem = None
        index = _read_index(idx_path, problems)
        if index is None:
            continue
        if bin_path not in missing:
            size_problem = _bin_size_problem(bin_path, index)
            if size_problem:
                problems.append(size_problem)
        if index.documents == 0 or index.tokens == 0:
            problems.append(f"{idx_path}: empty corpus: {index.documents} documents, "
                            f"{index.tokens} tokens")
            continue
        if index.tokens < seq_length + 1:
            problems.append(f"{idx_path}: {index.tokens} tokens, but seq_length {seq_length} needs "
                            f"at least {seq_length + 1} tokens in every prefix (Megatron builds "
                            f"one GPTDataset per prefix)")
        # Sampling a .bin whose size disagrees with the index would read the wrong bytes.
        if bin_path in missing or size_problem:
            continue
        token_problem = _token_problem(bin_path, index, vocab_size, sample_tokens)
        if token_problem:
            problems.append(token_problem)
        infos.append(CorpusInfo(prefix, index.dtype.name, index.documents, len(index.lengths),
                                index.tokens))
    if problems:
        raise CorpusError("unusable idxmap corpus:\n  - " + "\n  - ".join(problems))
    return infos
