"""Images in SFT samples: where their files are, how many tokens they take, how rows hold them.

A vision-language sample is a text sample whose user turns hold ``<image>`` tags, one per
image of the record (:func:`ray_ppu.data.sft.records.check_image_tags`). The chat encoder writes
each tag as :attr:`VisionData.tokens_per_image` copies of the image token (Hugging Face's LLaVA
processor expands its ``<image>`` token the same way), never in the loss.

Rows keep each image as its file's bytes, not its pixels: the Ray Data task that packs a
window reads the sample's images and decodes each once to check it (a bad image is counted
there, with its record), and stores the bytes (``image_bytes``: the row's images one after the
other, ``image_lengths`` int64 ``[max_images_per_row]``, ``num_images`` int32). Decoded pixels
would take ~8x the disk of the JPEGs they come from (432 KiB per 384 px image: ~240 GB for
Bunny's 558K), and a shared disk serves one sequential blob faster than 558K small files. The
reader process that serves a rank decodes them again (:func:`decode_rows`, the same Pillow
code, so the same pixels) into the fixed-shape uint8 ``images`` column ``[max_images_per_row,
3, H, W]`` the ranks receive; uint8 is the wire format, 4x fewer bytes than float32, and the
rank normalises on its device (:func:`ray_ppu.model.pixels.normalize`).

A row holds at most ``row_length // tokens_per_image`` images (every image's tokens are in
the row), which fixes the column's width. A sample cut to the row length keeps whole images
only: it is cut before an image whose tokens would not all fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ray_ppu.data.images import ImageProblem, ImageSpec, image_spec, load_image
from ray_ppu.data.sft.records import RecordProblem

@dataclass(frozen=True)
class VisionData:
    """How a vision-language model's samples carry images."""

    token_id: int
    """The image token's id (``vision.image_token_id``)."""
    tokens_per_image: int
    """Positions one image takes (``vision.image_tokens``)."""
    spec: ImageSpec
    """How pixels are prepared (the model's Hugging Face image processor)."""
    max_pixels: int
    """Largest image accepted, in pixels (``data.max_image_pixels``)."""
    image_root: Optional[str] = None
    """Directory relative image paths are under (``data.image_root``); None: the directory
    of the JSON file that names them."""

    def resolve(self, paths: Sequence[str], record_file: str) -> list[str]:
        """Absolute paths of a record's images."""
        root = self.image_root or os.path.dirname(os.path.abspath(record_file))
        return [p if os.path.isabs(p) else os.path.join(root, p) for p in paths]

    def slots(self, row_length: int) -> int:
        """Images a row can hold: ``row_length // tokens_per_image``."""
        return row_length // self.tokens_per_image


def vision_data(cfg) -> VisionData:
    """The image settings of a vision-language run (``cfg``: its RunConfig), its image
    processor that of checkpoint.pretrained (:func:`image_spec`)."""
    vision = cfg.vision
    return VisionData(vision.image_token_id, vision.image_tokens,
                      image_spec(vision, cfg.checkpoint.pretrained),
                      cfg.data.max_image_pixels, cfg.data.image_root)


def check_fit(vision: VisionData, row_length: int, n_images: int) -> None:
    """A RecordProblem when a record's images alone fill the row."""
    if n_images * vision.tokens_per_image >= row_length:
        raise RecordProblem("image_tokens_too_long", f"{n_images} image(s) of "
                            f"{vision.tokens_per_image} tokens fill the {row_length}-token row")


def whole_images(sample: tuple, vision: VisionData, row_length: int):
    """``sample`` (tokens, labels, loss_mask, truncated) with only whole images, and how many
    images it keeps (None when nothing with loss is left before the first cut image)."""
    tokens, labels, mask, truncated = sample
    places = np.flatnonzero(tokens == vision.token_id)
    kept = len(places) // vision.tokens_per_image
    if len(places) % vision.tokens_per_image:  # the cut fell inside an image: cut before it
        end = int(places[kept * vision.tokens_per_image])
        if not mask[:end].any():
            return None, 0
        last = int(np.flatnonzero(mask[:end])[-1]) + 1  # no trailing tokens without loss
        tokens, labels, mask, truncated = tokens[:last], labels[:last], mask[:last], True
    return (tokens, labels, mask, truncated), kept


def read_images(paths: Sequence[str], vision: VisionData) -> list[bytes]:
    """The images' file bytes, each decoded once to check it; a bad image is a RecordProblem
    with its reason (missing_image, unreadable_image, empty_image, image_too_large)."""
    out = []
    for path in paths:
        try:
            data = Path(path).read_bytes()
        except OSError:  # the path's own check below names why (missing, a directory, ...)
            data = None
        try:
            load_image(path if data is None else data, vision.spec, vision.max_pixels, name=path)
        except ImageProblem as problem:
            raise RecordProblem(problem.reason, problem.message) from None
        if data is None:
            raise RecordProblem("unreadable_image", f"{path}: cannot be read")
        out.append(data)
    return out


def image_columns(groups: Sequence[Sequence[tuple]], vision: VisionData,
                  row_length: int) -> dict[str, np.ndarray]:
    """The ``image_bytes`` / ``image_lengths`` / ``num_images`` columns of rows made of
    ``groups`` of samples (each sample's image bytes last in its tuple), in row order."""
    slots = vision.slots(row_length)
    blobs = np.empty(len(groups), object)
    lengths = np.zeros((len(groups), slots), np.int64)
    counts = np.zeros(len(groups), np.int32)
    for r, group in enumerate(groups):
        images = [data for sample in group for data in sample[-1]]
        if len(images) > slots:  # each image takes tokens_per_image of the row's positions
            raise AssertionError(f"{len(images)} images in a row of {slots} slots")
        blobs[r] = b"".join(images)
        lengths[r, :len(images)] = [len(data) for data in images]
        counts[r] = len(images)
    return {"image_bytes": blobs, "image_lengths": lengths, "num_images": counts}


def decode_rows(rows: dict[str, np.ndarray], vision: VisionData) -> dict[str, np.ndarray]:
    """``rows`` with their images as pixels: ``image_bytes`` and ``image_lengths`` become
    ``images`` uint8 ``[n, max_images_per_row, 3, H, W]``, the first ``num_images`` slots
    filled (what a reader sends a rank)."""
    rows = dict(rows)
    blobs, lengths = rows.pop("image_bytes"), rows.pop("image_lengths")
    spec = vision.spec
    images = np.zeros((len(blobs), lengths.shape[1], 3, spec.height, spec.width), np.uint8)
    for r, (blob, count) in enumerate(zip(blobs, rows["num_images"])):
        ends = np.cumsum(lengths[r, :count])
        for k, (begin, end) in enumerate(zip([0, *ends[:-1]], ends)):
            # checked when the row was made: a failure now means the cache was altered
            images[r, k] = load_image(blob[begin:end], spec, vision.max_pixels,
                                      name=f"image {k} of a stored row")
    rows["images"] = images
    return rows


def empty_image_columns(vision: VisionData, row_length: int) -> dict[str, np.ndarray]:
    """No rows' image columns, with their shapes."""
    return image_columns([], vision, row_length)
