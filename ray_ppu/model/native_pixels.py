"""Qwen2-VL ``pixel_values`` and ``image_grid_thw``, made on the device from uint8 images.

Why: the reader processes ship each image as uint8 ``[3, H, W]`` at its own size
(:func:`ray_ppu.data.native_images.load_native`); the rank turns a microbatch of them into what
``Qwen2VLImageProcessor`` would have given, bit for bit, without float64 on the device:

* the values: a lookup per (channel, uint8 value) in :func:`ray_ppu.data.images.value_table`
  (HF's rescale-in-float64 and normalise-in-float32, done once on the CPU;
  :func:`ray_ppu.model.pixels.normalize`). The patch layout below only moves values, so the
  result is torch.equal to HF's, not merely close.
* the layout: one row per 14 × 14 patch, rows ordered so that each 2 × 2 group of patches the
  vision tower merges into one token is 4 consecutive rows. Per image, rows run over (merged
  row, merged column, row in group, column in group); a row's 1176 = 3 × 2 × 14 × 14 values
  run over (channel, frame, y, x), the 2 frames of a still image being the same picture.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ray_ppu.data.native_images import NativeImageSpec
from ray_ppu.model.pixels import normalize


def _patches(image: torch.Tensor, spec: NativeImageSpec) -> torch.Tensor:
    """uint8 [3, H, W] → uint8 [gh·gw, 3, p, p] in HF's patch order."""
    p, m = spec.patch_size, spec.merge_size
    c, height, width = image.shape
    gh, gw = height // p, width // p
    # [c, gh/m, m, p, gw/m, m, p] → [gh/m, gw/m, m(row), m(col), c, p(y), p(x)]
    grouped = image.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    return grouped.reshape(gh * gw, c, p, p)


def patchify(images: Sequence[torch.Tensor],
             spec: NativeImageSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 ``[3, H, W]`` images (H, W multiples of spec.factor, all on one device) → float32
    ``pixel_values`` ``[Σ gh·gw, 3·T·p·p]`` on that device and int64 ``grid_thw`` ``[n, 3]``
    rows (1, gh, gw) on the CPU (the vision tower and the position code read its numbers on
    the host; the caller moves it if it wants it elsewhere)."""
    width_out = 3 * spec.temporal_patch_size * spec.patch_size ** 2
    grids = []
    for i, image in enumerate(images):
        if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[0] != 3:
            raise ValueError(f"patchify: image {i} must be uint8 [3, H, W], got {image.dtype} "
                             f"{list(image.shape)}")
        grids.append(spec.grid(image.shape[1], image.shape[2]))  # ValueError off the 28 grid
    grid_thw = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
    if not grids:
        return torch.empty(0, width_out, dtype=torch.float32), grid_thw
    # Rearranging uint8 before the lookup moves 1/4 of the bytes a float rearrangement would,
    # and one lookup serves the whole microbatch.
    patches = torch.cat([_patches(image, spec) for image in images])
    values = normalize(patches, spec)  # float32 [N, 3, p, p]
    n = values.shape[0]
    # The frame axis after the channel: [N, 3, T, p, p], each frame the same still image.
    framed = values.unsqueeze(2).expand(n, 3, spec.temporal_patch_size, *values.shape[2:])
    return framed.reshape(n, width_out), grid_thw
