"""Samples and rows: one conversation's ids and mask → a training sample → padded or packed rows.

The sample layout is Megatron's GPT contract (:data:`ray_ppu.data.idxmap.SAMPLE_KEYS`): for
token ids t[0..n], ``tokens = t[:-1]``, ``labels = t[1:]``, ``loss_mask[i] = 1`` iff ``labels[i]``
is an assistant token. Rows hold int32 ids and positions and a float32 loss mask, as
:func:`ray_ppu.data.idxmap.read` gives them; packed rows add ``cu_seqlens``, ``num_seqs`` and
``max_seqlen``. The layout rules (row length, dropping, truncation, padding, packing) are in
the package docstring (:mod:`ray_ppu.data.sft`). No tokenizer and no Ray here: plain numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ray_ppu.data.sft.image_samples import VisionData, empty_image_columns

ON_ERROR = ("skip", "fail")
DEFAULT_WINDOW = 1024
DEFAULT_MAX_SAMPLES_PER_ROW = 64


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SFTOptions:
    """How samples become rows; validated on construction (ValueError naming the values).

    ``seq_length``: the model's sequence length (row length when packing).
    ``max_padding_length``: row length without packing (default ``seq_length``; ≤ ``seq_length``).
    ``packing``: several samples per row. ``on_error``: ``"skip"`` (count and go on) or
    ``"fail"`` (raise on the first bad record). ``window``: records per packing window.
    ``max_samples_per_row``: packed samples per row at most (fixes the ``cu_seqlens`` width).
    ``vision``: a vision-language model's image settings (rows then carry image columns).
    """

    seq_length: int
    max_padding_length: int | None = None
    packing: bool = False
    on_error: str = "skip"
    window: int = DEFAULT_WINDOW
    max_samples_per_row: int = DEFAULT_MAX_SAMPLES_PER_ROW
    vision: Optional[VisionData] = None

    def __post_init__(self) -> None:
        if not _is_int(self.seq_length) or self.seq_length < 2:
            raise ValueError(f"seq_length={self.seq_length} must be an integer ≥ 2")
        if self.max_padding_length is not None:
            if not _is_int(self.max_padding_length) or self.max_padding_length < 2:
                raise ValueError(f"max_padding_length={self.max_padding_length} must be an integer ≥ 2")
            if self.max_padding_length > self.seq_length:
                raise ValueError(f"max_padding_length={self.max_padding_length} exceeds "
                                 f"seq_length={self.seq_length}: samples are padded to at most the "
                                 f"model's sequence length")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error={self.on_error!r}: expected one of {ON_ERROR}")
        if self.window < 1 or self.max_samples_per_row < 1:
            raise ValueError(f"window={self.window} and max_samples_per_row={self.max_samples_per_row} "
                             f"must be ≥ 1")

    @property
    def row_length(self) -> int:
        """Tokens per row: ``seq_length`` when packing, else ``max_padding_length``."""
        if self.packing or self.max_padding_length is None:
            return self.seq_length
        return self.max_padding_length

    @property
    def cu_seqlens_width(self) -> int:
        """Entries of each row's ``cu_seqlens``: the samples, a padding tail and the leading 0."""
        return min(self.max_samples_per_row, self.seq_length) + 2


def make_sample(ids: Sequence[int], mask: Sequence[int], max_length: int):
    """``(tokens, labels, loss_mask, truncated)`` of one conversation, or None when its prompt
    (the tokens before the first assistant token) is ≥ ``max_length`` tokens.

    ``tokens = ids[:-1]``, ``labels = ids[1:]``, ``loss_mask = mask[1:]``, at most
    ``max_length`` long: longer samples keep their first ``max_length + 1`` ids (and
    trailing tokens without loss are cut, as they teach nothing).
    """
    prompt = mask.index(1) if 1 in mask else len(mask)
    if prompt >= max_length:
        return None
    truncated = len(ids) > max_length + 1
    ids, mask = list(ids[:max_length + 1]), list(mask[:max_length + 1])
    if truncated:
        last = len(mask) - mask[::-1].index(1)
        ids, mask = ids[:last], mask[:last]
    return (np.asarray(ids[:-1], np.int32), np.asarray(ids[1:], np.int32),
            np.asarray(mask[1:], np.float32), truncated)


def empty_rows(options: SFTOptions) -> dict[str, np.ndarray]:
    """No rows, with every column's shape and dtype (a window whose records were all dropped)."""
    length = options.row_length
    rows = {"tokens": np.empty((0, length), np.int32), "labels": np.empty((0, length), np.int32),
            "loss_mask": np.empty((0, length), np.float32), "position_ids": np.empty((0, length), np.int32)}
    if options.packing:
        rows["cu_seqlens"] = np.empty((0, options.cu_seqlens_width), np.int32)
        rows["num_seqs"] = np.empty((0,), np.int32)
        rows["max_seqlen"] = np.empty((0,), np.int32)
    if options.vision is not None:
        rows.update(empty_image_columns(options.vision, length))
    return rows


def pad_rows(samples: Sequence[tuple], length: int, pad_id: int) -> dict[str, np.ndarray]:
    """One row per sample ``(tokens, labels, loss_mask)``, padded to ``length``: pad id in
    tokens and labels, loss mask 0, position ids 0..length-1."""
    n = len(samples)
    rows = {"tokens": np.full((n, length), pad_id, np.int32), "labels": np.full((n, length), pad_id, np.int32),
            "loss_mask": np.zeros((n, length), np.float32),
            "position_ids": np.tile(np.arange(length, dtype=np.int32), (n, 1))}
    for r, (tokens, labels, loss_mask, *_) in enumerate(samples):
        rows["tokens"][r, :len(tokens)] = tokens
        rows["labels"][r, :len(labels)] = labels
        rows["loss_mask"][r, :len(loss_mask)] = loss_mask
    return rows


def pack_groups(samples: Sequence[tuple], seq_length: int,
                max_samples_per_row: int = DEFAULT_MAX_SAMPLES_PER_ROW) -> list[list[tuple]]:
    """The samples of each packed row (:func:`pack_rows`' greedy rule)."""
    groups: list[list[tuple]] = []
    used = seq_length + 1
    for sample in samples:
        if len(sample[0]) > seq_length:
            raise ValueError(f"a sample of {len(sample[0])} tokens does not fit seq_length={seq_length}")
        if used + len(sample[0]) > seq_length or len(groups[-1]) >= max_samples_per_row:
            groups.append([])
            used = 0
        groups[-1].append(sample)
        used += len(sample[0])
    return groups


def pack_rows(samples: Sequence[tuple], seq_length: int, pad_id: int,
              max_samples_per_row: int = DEFAULT_MAX_SAMPLES_PER_ROW) -> dict[str, np.ndarray]:
    """Samples ``(tokens, labels, loss_mask)`` (each ≤ ``seq_length``), in order, greedily packed
    into rows of ``seq_length``: a row is closed when the next sample does not fit or it holds
    ``max_samples_per_row`` samples. Positions restart at 0 per sample and for the padding tail;
    ``cu_seqlens`` / ``num_seqs`` / ``max_seqlen`` describe each row's sequences (padding tail
    last)."""
    groups = pack_groups(samples, seq_length, max_samples_per_row)
    n, width = len(groups), min(max_samples_per_row, seq_length) + 2
    rows = {"tokens": np.full((n, seq_length), pad_id, np.int32),
            "labels": np.full((n, seq_length), pad_id, np.int32),
            "loss_mask": np.zeros((n, seq_length), np.float32),
            "position_ids": np.zeros((n, seq_length), np.int32),
            "cu_seqlens": np.zeros((n, width), np.int32),
            "num_seqs": np.zeros(n, np.int32),
            "max_seqlen": np.zeros(n, np.int32)}
    for r, group in enumerate(groups):
        bounds = [0]
        for tokens, labels, loss_mask, *_ in group:
            a, b = bounds[-1], bounds[-1] + len(tokens)
            rows["tokens"][r, a:b] = tokens
            rows["labels"][r, a:b] = labels
            rows["loss_mask"][r, a:b] = loss_mask
            bounds.append(b)
        if bounds[-1] < seq_length:  # the padding tail is a sequence of its own
            bounds.append(seq_length)
        lengths = np.diff(bounds)
        rows["position_ids"][r] = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
        rows["cu_seqlens"][r, :len(bounds)] = bounds
        rows["cu_seqlens"][r, len(bounds):] = bounds[-1]
        rows["num_seqs"][r] = len(lengths)
        rows["max_seqlen"][r] = lengths.max()
    return rows


def concat_rows(parts: list[dict], options: SFTOptions) -> dict[str, np.ndarray]:
    """The rows of several windows, in order, as one dict of arrays."""
    parts = [p for p in parts if len(p["tokens"])]
    if not parts:
        return empty_rows(options)
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
