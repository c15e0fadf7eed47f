"""Qwen2-VL's 3-D rotary positions (M-RoPE) for token rows with images, made by the data side.

Why: Qwen2.5-VL rotates each token by three positions (time, height, width), not one. Text
tokens get the same number on all three, counting on as in a text model; an image's tokens
(one per 2 × 2 merged patch group) share the image's start position on the time axis and
count rows and columns from it on the other two; text after the image resumes at
start + max(merged rows, merged columns), not at start + its token count. transformers
computes this in ``Qwen2_5_VLModel.get_rope_index`` with torch on the model's device; here it
is numpy in the reader, beside the token rows it belongs to, so the rank receives it ready
(and this module imports no torch, so readers stay small).

Equal to ``get_rope_index`` (transformers 5.25) for one unpadded sample with still images. A
packed row (:func:`packed_mrope_positions`) restarts at 0 per sample, as text packing
restarts its position ids (:func:`ray_ppu.data.sft.rows.pack_rows`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

Grid = Sequence[int]  # (t, h, w): an image's patch grid before the merge (image_grid_thw row)


def _image_runs(ids: np.ndarray, image_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) of each run of consecutive image tokens."""
    is_image = np.concatenate([[0], (ids == image_token_id).astype(np.int8), [0]])
    edges = np.diff(is_image)
    return np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)


def _check(runs: tuple[np.ndarray, np.ndarray], grids: Sequence[Grid], merge_size: int,
           where: str) -> list[tuple[int, int, int]]:
    """The grids as ints, after checking them against the runs; ValueError naming counts."""
    starts, ends = runs
    if len(starts) != len(grids):
        raise ValueError(f"{where}: {len(starts)} runs of image tokens but {len(grids)} image "
                         f"grids")
    out = []
    for i, (grid, a, b) in enumerate(zip(grids, starts, ends)):
        t, h, w = (int(v) for v in grid)
        if min(t, h, w) < 1 or h % merge_size or w % merge_size:
            raise ValueError(f"{where}: image {i} grid {(t, h, w)} is not a patch grid "
                             f"(h and w multiples of merge_size={merge_size})")
        tokens = t * (h // merge_size) * (w // merge_size)
        if b - a != tokens:
            raise ValueError(f"{where}: image {i} (grid {(t, h, w)}) needs {tokens} image tokens, "
                             f"its run at token {a} has {b - a}")
        out.append((t, h, w))
    return out


def mrope_positions(input_ids: np.ndarray, grids: Sequence[Grid], image_token_id: int,
                    merge_size: int = 2, *, where: str = "mrope_positions") -> np.ndarray:
    """int64 ``[3, s]`` (time, height, width) positions of one unpadded sample ``[s]``: image
    tokens are the runs of ``image_token_id``, one run per grid in order (two images need text
    between them, as Qwen's <|vision_start|> / <|vision_end|> give). A mismatch of runs and
    grids is a ValueError naming both counts."""
    ids = np.asarray(input_ids).reshape(-1)
    starts, ends = _image_runs(ids, image_token_id)
    checked = _check((starts, ends), grids, merge_size, where)
    out = np.empty((3, ids.size), np.int64)
    position, done = 0, 0  # next text position; tokens placed so far
    for (t, h, w), a, b in zip(checked, starts, ends):
        out[:, done:a] = np.arange(position, position + a - done)  # text: same on the 3 axes
        position += a - done
        # Image: time, row, column of each merged token (time-major, as the vision tower
        # emits them), all offset by the image's start position.
        out[:, a:b] = np.indices((t, h // merge_size, w // merge_size)).reshape(3, -1)
        out[:, a:b] += position
        # HF: the text after resumes max(h, w) // merge later (t is not counted; 1 for stills).
        position += max(h, w) // merge_size
        done = b
    out[:, done:] = np.arange(position, position + ids.size - done)
    return out


def packed_mrope_positions(input_ids: np.ndarray, sample_lengths: Sequence[int],
                           grids: Sequence[Grid], image_token_id: int,
                           merge_size: int = 2) -> np.ndarray:
    """int64 ``[3, S]`` positions of a packed row ``[S]``: samples of ``sample_lengths`` tokens
    back to back, each from 0 (:func:`mrope_positions`), consuming ``grids`` in order. Tokens
    after the last sample (padding) are one text sequence of their own, 0, 1, 2, ... on all
    three axes, whatever their ids: the padding tail is its own sequence in cu_seqlens too
    (``pack_rows``), and it is never attended from a sample."""
    # A Python loop over samples and images, numpy within each: measured on this repo's 2-core
    # CPU box, 0.2 ms for a 2048-token row of 4 samples × 1 image, 0.2-0.6 ms for 8192 tokens
    # with 8 images (1 or 8 samples), 1.6 ms for 8192 tokens of 32 one-image samples.
    ids = np.asarray(input_ids).reshape(-1)
    lengths = [int(n) for n in sample_lengths]
    if min(lengths, default=0) < 0 or sum(lengths) > ids.size:
        raise ValueError(f"packed_mrope_positions: sample lengths {lengths} (sum "
                         f"{sum(lengths)}) do not fit a row of {ids.size} tokens")
    out = np.empty((3, ids.size), np.int64)
    a, used = 0, 0  # row offset; grids consumed
    for k, n in enumerate(lengths):
        sample = ids[a:a + n]
        images = len(_image_runs(sample, image_token_id)[0])
        if used + images > len(grids):
            raise ValueError(f"packed_mrope_positions: sample {k} has {images} runs of image "
                             f"tokens but only {len(grids) - used} of {len(grids)} image grids "
                             f"are left")
        out[:, a:a + n] = mrope_positions(sample, grids[used:used + images], image_token_id,
                                          merge_size, where=f"packed_mrope_positions: sample {k}")
        a, used = a + n, used + images
    if used != len(grids):
        raise ValueError(f"packed_mrope_positions: the samples have {used} runs of image tokens "
                         f"but {len(grids)} image grids were given")
    out[:, a:] = np.arange(ids.size - a)
    return out
