"""check_corpus on real idxmap corpora written by Megatron's IndexedDatasetBuilder, then damaged on disk."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, _IndexWriter

from ray_ppu.data.checks import (
    HEADER_BYTES,
    MAGIC,
    CorpusError,
    CorpusInfo,
    check_corpus,
    sample_ranges,
)

VOCAB = 1000
SEQ = 64


def build(prefix: Path, docs: list, dtype=np.int32, multimodal: bool = False) -> str:
    """Write ``prefix.bin/.idx`` with Megatron's builder; a doc is an array or a list of sequences."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype, multimodal=multimodal)
    for doc in docs:
        seqs = doc if isinstance(doc, list) else [doc]
        tokens = torch.from_numpy(np.concatenate(seqs).astype(np.int64))
        builder.add_document(tokens, [len(s) for s in seqs],
                             modes=[0] * len(seqs) if multimodal else None)
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def random_docs(lengths, seed=0, vocab=VOCAB) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n) for n in lengths]


def put_token(prefix: str, position: int, value: int, dtype=np.int32) -> None:
    """Overwrite one token of the .bin in place (token position = byte position / itemsize)."""
    with open(prefix + ".bin", "r+b") as f:
        f.seek(position * np.dtype(dtype).itemsize)
        f.write(np.array([value], dtype=dtype).tobytes())


def patch_idx(prefix: str, offset: int, data: bytes) -> None:
    with open(prefix + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(data)


def check_problems(*args, **kwargs) -> list[str]:
    """check_corpus(*args) must fail; the one-line-per-problem body of its CorpusError."""
    with pytest.raises(CorpusError) as excinfo:
        check_corpus(*args, **kwargs)
    head, *lines = str(excinfo.value).splitlines()
    assert head == "unusable idxmap corpus:"
    return [line.removeprefix("  - ") for line in lines]


@pytest.fixture
def corpus(tmp_path) -> str:
    """5 documents, 1,700 tokens, int32; document 2 holds two sequences (documents != sequences)."""
    a, b, c1, c2, d, e = random_docs([300, 400, 150, 150, 500, 200])
    return build(tmp_path / "corpus", [a, b, [c1, c2], d, e])


# -- a good corpus passes, and we read the same counts as Megatron ---------------------------------

@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_corpus_passes_with_indexed_dataset_counts(tmp_path, dtype):
    a, b1, b2, c = random_docs([120, 80, 40, 300], seed=1)
    prefix = build(tmp_path / "c", [a, [b1, b2], c], dtype=dtype)
    [info] = check_corpus([prefix], SEQ, VOCAB)
    ds = IndexedDataset(prefix)
    assert info == CorpusInfo(prefix, np.dtype(dtype).name, len(ds.document_indices) - 1, len(ds),
                              int(ds.sequence_lengths.sum()))
    assert (info.documents, info.sequences, info.tokens) == (3, 4, 540)


def test_multimodal_index_with_sequence_modes_passes(tmp_path):
    a1, a2, b = random_docs([100, 50, 70], seed=2)
    prefix = build(tmp_path / "mm", [[a1, a2], b], multimodal=True)
    [info] = check_corpus([prefix], SEQ, VOCAB)
    ds = IndexedDataset(prefix, multimodal=True)
    assert (info.documents, info.sequences, info.tokens) == (
        len(ds.document_indices) - 1, len(ds), int(ds.sequence_lengths.sum())) == (2, 3, 220)


def test_several_prefixes_return_one_info_each(corpus, tmp_path):
    other = build(tmp_path / "other", random_docs([90, 90], seed=3), dtype=np.uint16)
    infos = check_corpus([corpus, Path(other)], SEQ, VOCAB)
    assert [(i.prefix, i.dtype, i.documents, i.tokens) for i in infos] == [
        (corpus, "int32", 5, 1700), (other, "uint16", 2, 180)]


# -- missing files ---------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_missing_file_is_named(corpus, suffix):
    os.remove(corpus + suffix)
    found = check_problems([corpus], SEQ, VOCAB)
    assert found == [f"{corpus}{suffix}: missing"]


def test_prefix_given_with_suffix_gets_a_hint(corpus):
    found = check_problems([corpus + ".bin"], SEQ, VOCAB)
    assert f"{corpus}.bin.bin: missing" in found[0]
    assert f"did you mean {corpus}?" in found[0]


# -- .idx header -----------------------------------------------------------------------------------

def test_wrong_magic_says_found_and_expected(corpus):
    patch_idx(corpus, 0, b"NOTMAGIC!")
    found = check_problems([corpus], SEQ, VOCAB)
    [line] = found
    assert line.startswith(f"{corpus}.idx: ")
    assert repr(b"NOTMAGIC!") in line and repr(MAGIC) in line


def test_unsupported_version(corpus):
    patch_idx(corpus, 9, struct.pack("<Q", 2))
    found = check_problems([corpus], SEQ, VOCAB)
    [line] = found
    assert line.startswith(f"{corpus}.idx: unsupported index version 2 ")
    assert "version 1 only" in line


def test_unknown_dtype_code_lists_known_codes(corpus):
    patch_idx(corpus, 17, struct.pack("<B", 99))
    found = check_problems([corpus], SEQ, VOCAB)
    [line] = found
    assert line.startswith(f"{corpus}.idx: unknown dtype code 99 ")
    assert "4 int32" in line and "8 uint16" in line and "1 uint8" in line


def test_idx_truncated_inside_arrays(corpus):
    # 6 sequences, 6 document-index entries: 34 + 6*4 + 6*8 + 6*8 bytes.
    full = HEADER_BYTES + 6 * 4 + 6 * 8 + 6 * 8
    assert os.path.getsize(corpus + ".idx") == full
    os.truncate(corpus + ".idx", full - 8)
    found = check_problems([corpus], SEQ, VOCAB)
    assert found == [f"{corpus}.idx: truncated: {full - 8} bytes, but its header "
                             f"(6 sequences, 6 document-index entries) needs {full} bytes"]


@pytest.mark.parametrize("size", [0, 5, 20])
def test_idx_truncated_inside_header(corpus, size):
    os.truncate(corpus + ".idx", size)
    found = check_problems([corpus], SEQ, VOCAB)
    assert found == [f"{corpus}.idx: truncated: {size} bytes, shorter than the 34-byte header"]


def test_idx_with_appended_bytes(corpus):
    full = os.path.getsize(corpus + ".idx")
    with open(corpus + ".idx", "ab") as f:
        f.write(b"\x00" * 3)
    found = check_problems([corpus], SEQ, VOCAB)
    [line] = found
    assert line.startswith(f"{corpus}.idx: {full + 3} bytes, but its header ")
    assert f"needs {full} bytes" in line


def test_document_index_not_ending_at_sequence_count(corpus):
    # Megatron asserts document_indices[-1] == sequence count, naming no file.
    patch_idx(corpus, HEADER_BYTES + 6 * 12 + 5 * 8, struct.pack("<q", 7))
    found = check_problems([corpus], SEQ, VOCAB)
    assert found == [f"{corpus}.idx: document index runs from sequence 0 to 7, "
                             f"expected 0 to the sequence count 6"]


def test_decreasing_document_index(corpus):
    # Document starts are sequences [0, 1, 2, 4, 5, 6]; make document 3 start before document 2.
    patch_idx(corpus, HEADER_BYTES + 6 * 12 + 3 * 8, struct.pack("<q", 1))
    found = check_problems([corpus], SEQ, VOCAB)
    assert found == [f"{corpus}.idx: document index decreases at document 3 (2 -> 1)"]


def test_negative_sequence_length(corpus):
    patch_idx(corpus, HEADER_BYTES + 2 * 4, struct.pack("<i", -150))
    found = check_problems([corpus], SEQ, VOCAB)
    assert found == [f"{corpus}.idx: sequence 2 has negative length -150"]


def test_non_contiguous_sequence_pointers(corpus):
    # Sequence 1 starts after sequence 0's 300 int32 tokens: byte 1200. Claim 1204.
    patch_idx(corpus, HEADER_BYTES + 6 * 4 + 1 * 8, struct.pack("<q", 1204))
    found = check_problems([corpus], SEQ, VOCAB)
    [line] = found
    assert line.startswith(f"{corpus}.idx: sequence 1 points to byte 1204, but the lengths before "
                           f"it end at byte 1200")


# -- .bin size against the index -------------------------------------------------------------------

def test_bin_shorter_than_index(corpus):
    os.truncate(corpus + ".bin", 1700 * 4 - 28)
    found = check_problems([corpus], SEQ, VOCAB)
    assert found == [
        f"{corpus}.bin: 6772 bytes, 28 bytes shorter than its index says: 1700 tokens × 4 bytes "
        f"(int32) = 6800 bytes; last sequence ends at byte 6800 (from {corpus}.idx)"]


def test_bin_longer_than_index(corpus):
    with open(corpus + ".bin", "ab") as f:
        f.write(b"\x01" * 6)
    found = check_problems([corpus], SEQ, VOCAB)
    [line] = found
    assert line.startswith(f"{corpus}.bin: 6806 bytes, 6 bytes longer than its index says: ")
    assert "= 6800 bytes" in line


# -- corpus size -----------------------------------------------------------------------------------

def test_corpus_without_documents_is_empty(tmp_path):
    prefix = build(tmp_path / "none", [])
    found = check_problems([prefix], SEQ, VOCAB)
    assert found == [f"{prefix}.idx: empty corpus: 0 documents, 0 tokens"]


def test_corpus_of_empty_documents_is_empty(tmp_path):
    prefix = build(tmp_path / "blank", [np.array([], dtype=np.int64)] * 2)
    found = check_problems([prefix], SEQ, VOCAB)
    assert found == [f"{prefix}.idx: empty corpus: 2 documents, 0 tokens"]


def test_seq_length_needs_one_more_token_than_it_is_long(tmp_path):
    prefix = build(tmp_path / "hundred", random_docs([60, 40], seed=4))
    assert check_corpus([prefix], 99, VOCAB)[0].tokens == 100  # 99 + 1 tokens: enough
    found = check_problems([prefix], 100, VOCAB)
    [line] = found
    assert line.startswith(f"{prefix}.idx: 100 tokens, but seq_length 100 needs at least 101 tokens")


def test_seq_length_is_checked_per_prefix_of_a_blend(corpus, tmp_path):
    small = build(tmp_path / "small", random_docs([50], seed=5))
    # Together they hold 1,750 tokens, but each prefix becomes its own GPTDataset.
    found = check_problems([corpus, small], 200, VOCAB)
    [line] = found
    assert line.startswith(f"{small}.idx: 50 tokens, but seq_length 200 needs at least 201")


# -- token ids against the vocabulary --------------------------------------------------------------

def test_id_at_vocab_size_is_out_of_range_and_one_below_is_fine(corpus):
    put_token(corpus, 350, VOCAB - 1)
    check_corpus([corpus], SEQ, VOCAB)
    put_token(corpus, 350, VOCAB)
    found = check_problems([corpus], SEQ, VOCAB)
    # Position 350: document 1 (tokens 300..699).
    assert found == [
        f"{corpus}.bin: token id {VOCAB} at token position 350 (document 1) is outside the "
        f"vocabulary [0, vocab_size={VOCAB}); 1 of 1700 sampled tokens are out of range "
        f"(ids {VOCAB}..{VOCAB})"]


def test_negative_id(corpus):
    put_token(corpus, 1699, -3)
    found = check_problems([corpus], SEQ, VOCAB)
    [line] = found
    assert line.startswith(f"{corpus}.bin: token id -3 at token position 1699 (document 4) ")


def test_uint16_corpus_above_vocab(tmp_path):
    prefix = build(tmp_path / "u16", random_docs([500, 500], seed=6), dtype=np.uint16)
    put_token(prefix, 720, 65535, np.uint16)
    found = check_problems([prefix], SEQ, VOCAB)
    [line] = found
    assert line.startswith(f"{prefix}.bin: token id 65535 at token position 720 (document 1) ")


@pytest.fixture
def big(tmp_path) -> str:
    """200,000 uint16 tokens: a short document, then one long one."""
    return build(tmp_path / "big", random_docs([1_000, 199_000], seed=7), dtype=np.uint16)


SAMPLE = 4096  # head and tail 1,536 tokens each, 8 interior windows of 128 tokens


def test_sample_catches_id_in_head(big):
    put_token(big, 1_200, 40_000, np.uint16)  # document 1, inside the 1,536-token head
    found = check_problems([big], SEQ, VOCAB, sample_tokens=SAMPLE)
    [line] = found
    assert line.startswith(f"{big}.bin: token id 40000 at token position 1200 (document 1) ")
    assert f"1 of {SAMPLE} sampled tokens" in line


def test_sample_catches_id_in_interior_window_past_the_head(big):
    ranges = sample_ranges(200_000, SAMPLE)
    start, stop = ranges[4]  # interior window 4, deep inside the long document
    assert start > 1_536 and stop - start == 128
    put_token(big, start + 77, 50_000, np.uint16)
    found = check_problems([big], SEQ, VOCAB, sample_tokens=SAMPLE)
    assert f"token id 50000 at token position {start + 77} (document 1)" in found[0]


def test_limitation_id_between_windows_is_not_found(big):
    """The documented limitation: only the sampled ranges are read."""
    (_, head_end), (next_start, _) = sample_ranges(200_000, SAMPLE)[:2]
    hidden = (head_end + next_start) // 2
    put_token(big, hidden, 50_000, np.uint16)
    assert check_corpus([big], SEQ, VOCAB, sample_tokens=SAMPLE)[0].tokens == 200_000
    # ... and found as soon as the sample covers the corpus.
    found = check_problems([big], SEQ, VOCAB, sample_tokens=200_000)
    assert f"token position {hidden} (document 1)" in found[0]


@pytest.mark.parametrize("tokens,sample", [(10, 100), (100, 100), (101, 100), (200_000, 4096),
                                           (5_000_000_000, 1_000_000), (50, 7)])
def test_sample_ranges_keep_their_promise(tokens, sample):
    ranges = sample_ranges(tokens, sample)
    assert ranges == sample_ranges(tokens, sample)  # deterministic
    assert all(0 <= a < b <= c < d <= tokens for (a, b), (c, d) in zip(ranges, ranges[1:]))
    covered = sum(b - a for a, b in ranges)
    if tokens <= sample:
        assert ranges == [(0, tokens)]
    else:
        assert covered <= sample
        assert ranges[0][0] == 0 and ranges[-1][1] == tokens
        if sample >= 64:
            head = ranges[0][1] - ranges[0][0]
            tail = ranges[-1][1] - ranges[-1][0]
            assert head >= sample * 3 // 8 - 1 and tail >= sample * 3 // 8 - 1
            if tokens >= 4 * sample:  # windows apart: the budget is spent, up to rounding
                assert covered >= sample - 2 * 8


def test_4gb_sparse_bin_is_sampled_not_read(tmp_path):
    """2 sequences of 2^30 uint16 tokens (4 GiB, sparse zeros): a check reads ~1M tokens of it."""
    prefix = str(tmp_path / "huge")
    n = 1 << 30
    # The builder would have to be fed 2^31 tokens; Megatron's own index writer takes lengths.
    with _IndexWriter(prefix + ".idx", np.uint16) as writer:
        writer.write([n, n], None, [0, 1, 2])
    with open(prefix + ".bin", "wb") as f:
        f.truncate(2 * n * 2)
    put_token(prefix, 2 * n - 1, 1_234, np.uint16)  # the last token: in the tail window
    begin = time.perf_counter()
    found = check_problems([prefix], 4096, VOCAB)
    elapsed = time.perf_counter() - begin
    assert found == [
        f"{prefix}.bin: token id 1234 at token position {2 * n - 1} (document 1) is outside the "
        f"vocabulary [0, vocab_size={VOCAB}); 1 of 1000000 sampled tokens are out of range "
        f"(ids 1234..1234)"]
    assert elapsed < 5, f"check took {elapsed:.1f}s: did it read the whole 4 GiB .bin?"

    put_token(prefix, 2 * n - 1, 0, np.uint16)
    [info] = check_corpus([prefix], 4096, VOCAB)
    ds = IndexedDataset(prefix)
    assert (info.documents, info.sequences, info.tokens) == (
        len(ds.document_indices) - 1, len(ds), int(ds.sequence_lengths.sum(dtype=np.int64))) == (2, 2, 2 * n)


# -- everything at once ----------------------------------------------------------------------------

def test_all_problems_of_two_prefixes_in_one_error(tmp_path):
    short = build(tmp_path / "short", random_docs([30, 20], seed=8))
    put_token(short, 10, VOCAB + 5)
    broken = build(tmp_path / "broken", random_docs([300], seed=9))
    os.remove(broken + ".bin")
    patch_idx(broken, 9, struct.pack("<Q", 2))
    found = check_problems([short, broken], SEQ, VOCAB)
    lines = found
    assert len(lines) == 4, lines
    assert lines[0].startswith(f"{short}.idx: 50 tokens, but seq_length {SEQ} needs at least {SEQ + 1}")
    assert lines[1].startswith(f"{short}.bin: token id {VOCAB + 5} at token position 10 (document 0)")
    assert lines[2] == f"{broken}.bin: missing"
    assert lines[3].startswith(f"{broken}.idx: unsupported index version 2")


def test_bad_arguments_are_not_corpus_errors(corpus):
    with pytest.raises(ValueError, match="at least one idxmap prefix"):
        check_corpus([], SEQ, VOCAB)
    with pytest.raises(ValueError, match="list of prefixes"):
        check_corpus(corpus, SEQ, VOCAB)
    with pytest.raises(ValueError, match="must be positive") as exc:
        check_corpus([corpus], 0, VOCAB)
    assert not isinstance(exc.value, CorpusError)
