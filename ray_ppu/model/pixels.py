"""A vision-language model's pixel values, made on the device from the uint8 images the data
pipeline ships: HF's ``pixel_values``, bit for bit, by a lookup in
:func:`ray_ppu.data.images.value_table` (its module docstring says why a lookup)."""

from __future__ import annotations

import functools

import torch

from ray_ppu.data.images import value_table


@functools.lru_cache(maxsize=8)
def _device_table(spec, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(value_table(spec).copy()).to(device)


def normalize(pixels: torch.Tensor, spec) -> torch.Tensor:
    """uint8 ``[..., 3, H, W]`` on any device → HF's float32 ``pixel_values`` for them, on that
    device, bit for bit (a lookup in :func:`ray_ppu.data.images.value_table`). With do_rescale
    and do_normalize both false HF gives uint8: the same values come back as float32."""
    if pixels.dtype != torch.uint8 or pixels.dim() < 3 or pixels.shape[-3] != 3:
        raise ValueError(f"normalize takes uint8 [..., 3, H, W] pixels, got {pixels.dtype} "
                         f"{list(pixels.shape)}")
    index = pixels.to(torch.int64)
    index += torch.arange(0, 3 * 256, 256, device=pixels.device).view(3, 1, 1)
    return _device_table(spec, pixels.device).view(-1)[index]
