"""Images in SFT samples: where their files are, how many tokens they take, their pixels in rows.

A vision-language sample is a text sample whose user turns hold ``<image>`` tags, one per
image of the record (:func:`ray_ppu.data.sft.records.check_image_tags`). The chat encoder writes
each tag as :attr:`VisionData.tokens_per_image` copies of the image token (Hugging Face's LLaVA
processor expands its ``<image>`` token the same way), never in the loss. This module then
decodes the sample's images (in the Ray Data task that packs the window: decoding is CPU work
that belongs beside the data, not on a training rank) and lays them out per row as fixed-shape
columns: ``images`` uint8 ``[max_images_per_row, 3, H, W]`` (the first ``num_images`` filled,
in the order their tokens appear) and ``num_images`` int32. uint8 is the wire format: 4x fewer
bytes than float32; the rank normalises on its device (:func:`ray_ppu.model.pixels.normalize`).

A row holds at most ``row_length // tokens_per_image`` images (every image's tokens are in
the row), which fixes the column's width. A sample cut to the row length keeps whole images
only: it is cut before an image whose tokens would not all fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
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


def decode(paths: Sequence[str], vision: VisionData) -> list[np.ndarray]:
    """The images' uint8 [3, H, W] pixels; a bad image is a RecordProblem with its reason
    (missing_image, unreadable_image, empty_image, image_too_large)."""
    out = []
    for path in paths:
        try:
            out.append(load_image(path, vision.spec, vision.max_pixels))
        except ImageProblem as problem:
            raise RecordProblem(problem.reason, problem.message) from None
    return out


def image_columns(groups: Sequence[Sequence[tuple]], vision: VisionData,
                  row_length: int) -> dict[str, np.ndarray]:
    """The ``images`` / ``num_images`` columns of rows made of ``groups`` of samples (each
    sample's images last in its tuple), in row order."""
    slots = vision.slots(row_length)
    shape = (3, vision.spec.height, vision.spec.width)
    images = np.zeros((len(groups), slots, *shape), np.uint8)
    counts = np.zeros(len(groups), np.int32)
    for r, group in enumerate(groups):
        pixels = [p for sample in group for p in sample[-1]]
        if len(pixels) > slots:  # each image takes tokens_per_image of the row's positions
            raise AssertionError(f"{len(pixels)} images in a row of {slots} slots")
        if pixels:
            images[r, :len(pixels)] = np.stack(pixels)
        counts[r] = len(pixels)
    return {"images": images, "num_images": counts}


def empty_image_columns(vision: VisionData, row_length: int) -> dict[str, np.ndarray]:
    """No rows' image columns, with their shapes."""
    return image_columns([], vision, row_length)
