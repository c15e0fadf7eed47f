"""One microbatch, from this rank's data stream to Megatron-Core's ``forward_step`` contract.

``forward_step(batches, model)`` returns ``(output, loss_func)``, as in Megatron-Core's simple
train loop: TP rank 0 of the first and last pipeline stage reads the microbatch and broadcasts
it to its TP group; packed SFT rows carry their sample boundaries, from which every rank builds
the block-diagonal mask (local attention) or the THD parameters (Transformer Engine).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Iterator, Optional

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.utils import get_attr_wrapped_model

from ray_ppu.data.native_images import NativeImageSpec
from ray_ppu.model.native_pixels import patchify
from ray_ppu.model.pixels import normalize

Microbatch = dict  # tokens, labels, loss_mask, position_ids: [micro_batch_size, seq_length]
_INT_KEYS = ("tokens", "labels", "position_ids")


# columns that are not int64 on the device: the loss mask, and images as the wire's uint8
_DTYPES = {"loss_mask": torch.float32, "images": torch.uint8}


def _as_tensors(batch: dict, device: torch.device) -> dict:
    # torch.tensor copies (Ray Data hands out read-only arrays from its object store) and
    # widens the int32 ids to the int64 Megatron's embedding and loss expect.
    out = {k: torch.tensor(v, dtype=_DTYPES.get(k, torch.int64)).to(device, non_blocking=True)
           for k, v in batch.items() if k not in ("sample_id", "pixels")}
    if "pixels" in batch:  # native-resolution images: each row's uint8 bytes, one after another
        flat = np.concatenate([np.asarray(row, np.uint8) for row in batch["pixels"]])
        out["pixels"] = torch.from_numpy(flat).to(device, non_blocking=True)
    return out


def _native_images(data: Optional[dict], spec) -> tuple[torch.Tensor, torch.Tensor]:
    """A Qwen2.5-VL microbatch's images as (pixel_values [N, 3·t·p·p], grid_thw [n, 3]), row
    by row: the uint8 bytes and each image's (H, W) broadcast over TP, then cut into patches
    and normalised here, on the device (:func:`patchify`: the processor's values)."""
    pixels = tensor_parallel.broadcast_data(["pixels"], data, torch.uint8)["pixels"]
    meta = tensor_parallel.broadcast_data(["image_sizes", "num_images"], data, torch.int64)
    used = (torch.arange(meta["image_sizes"].shape[1], device=pixels.device)
            < meta["num_images"][:, None])
    sizes = meta["image_sizes"][used].tolist()  # [(H, W)] of the microbatch's images, in order
    images = torch.split(pixels, [3 * h * w for h, w in sizes])
    pixel_values, grid = patchify([image.view(3, h, w) for image, (h, w) in zip(images, sizes)],
                                  spec)
    return pixel_values, grid.to(pixels.device)


def _images(data: Optional[dict], spec) -> torch.Tensor:
    """The microbatch's images as float pixel values [n, 3, H, W], row by row (each row's
    first ``num_images`` slots), broadcast over TP as uint8 and normalised here, on the
    device (:func:`normalize`: the values HF's processor gives)."""
    if data is not None:  # Megatron broadcasts at most 4 dims: [b, slots, 3·H·W] on the wire
        data["images"] = data["images"].flatten(2)
    pixels = tensor_parallel.broadcast_data(["images"], data, torch.uint8)["images"]
    counts = tensor_parallel.broadcast_data(["num_images"], data, torch.int64)["num_images"]
    used = torch.arange(pixels.shape[1], device=pixels.device) < counts[:, None]
    return normalize(pixels[used].view(-1, 3, spec.height, spec.width), spec)


def packed_attention_mask(cu_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """Block-diagonal causal mask [b, 1, s, s] for rows packing several samples.

    ``cu_seqlens`` [b, K]: sample boundaries per row, padded with its last value (= s). True
    means masked out (Megatron's convention: ``attention_mask_func`` fills True with -10000):
    a token sees earlier tokens of its own sample only.
    """
    positions = torch.arange(seq_length, device=cu_seqlens.device)
    # sample index of each position: how many boundaries after the first lie at or before it
    sample = torch.searchsorted(cu_seqlens[:, 1:].contiguous(),
                                positions.expand(len(cu_seqlens), -1).contiguous(), right=True)
    other_sample = sample[:, :, None] != sample[:, None, :]
    future = torch.ones(seq_length, seq_length, dtype=torch.bool, device=cu_seqlens.device).triu(1)
    return (other_sample | future)[:, None]


def thd_packed_seq_params(cu_seqlens: torch.Tensor, seq_length: int):
    """Megatron's PackedSeqParams (THD) for a microbatch of packed rows flattened into one.

    ``cu_seqlens`` [b, K]: each row's boundaries, padded with its last value. Row r's
    boundaries shift by r·s; the repeats are dropped. Transformer Engine's attention then runs
    causal attention within each sample only, and RoPE restarts at each sample.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    offsets = torch.arange(len(cu_seqlens), device=cu_seqlens.device)[:, None] * seq_length
    bounds = torch.unique_consecutive((cu_seqlens + offsets).reshape(-1)).to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def get_batch(batches: Optional[Iterator[Microbatch]], model, device: torch.device,
              packed: Optional[str] = None, images=None, every_chunk: bool = False) -> dict:
    """Next microbatch for this model chunk, broadcast from TP rank 0 to its TP group.

    First pipeline stage needs tokens and positions, the last needs labels and the loss mask;
    chunks in between need nothing (Megatron's get_batch contract). Packed rows also carry
    their sample boundaries (a few ints broadcast instead of s² mask entries), from which
    every rank builds the block-diagonal mask (``packed="mask"``), or, for Transformer Engine
    (``"thd"``), the THD parameters of the microbatch flattened into one row of b·s tokens.
    ``images``: a vision-language model's ImageSpec; the first stage then also gets the
    microbatch's images, normalised on the device. ``every_chunk``: M-RoPE, whose positions
    come with the data and which every chunk's attention needs, so every chunk reads.
    """
    pre = get_attr_wrapped_model(model, "pre_process")
    post = get_attr_wrapped_model(model, "post_process")
    if not (pre or post or every_chunk):
        return {}
    data = None
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        data = _as_tensors(next(batches), device)
    ints = tensor_parallel.broadcast_data(list(_INT_KEYS), data, torch.int64)
    floats = tensor_parallel.broadcast_data(["loss_mask"], data, torch.float32)
    batch = {**ints, **floats}
    mrope = batch["position_ids"].dim() == 3  # M-RoPE's [b, 3, s] → GPTModel's [3, b, s]
    if mrope:
        batch["position_ids"] = batch["position_ids"].transpose(0, 1).contiguous()
    if images is not None and pre:
        native = isinstance(images, NativeImageSpec)
        batch["images"] = _native_images(data, images) if native else _images(data, images)
    if packed:
        cu = tensor_parallel.broadcast_data(["cu_seqlens"], data, torch.int64)["cu_seqlens"]
        b, s = batch["tokens"].shape
        if packed == "thd":  # one row of b·s tokens (M-RoPE: [3, 1, b·s])
            batch = {k: v if k == "images" else v.reshape(3, 1, b * s)
                     if (k == "position_ids" and mrope) else v.reshape(1, b * s)
                     for k, v in batch.items()}
            batch["packed_seq_params"] = thd_packed_seq_params(cu, s)
        else:
            batch["attention_mask"] = packed_attention_mask(cu, s)
    return batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked token losses, the token count, and both for logging (Megatron's 3-tuple)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), mask.sum().detach()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(batches, model, device: torch.device, packed: Optional[str] = None,
                 images=None, every_chunk: bool = False):
    batch = get_batch(batches, model, device, packed, images, every_chunk)
    extra = {"images": batch["images"]} if "images" in batch else {}
    output = model(
        batch.get("tokens"),
        batch.get("position_ids"),
        # None: causal, built by the attention module; packed rows: block-diagonal causal
        batch.get("attention_mask"),
        labels=batch.get("labels"),
        packed_seq_params=batch.get("packed_seq_params"),  # THD packed rows (TE)
        **extra,  # a vision-language model's pixel values
    )
    return output, partial(loss_func, batch.get("loss_mask"))


class TimedIterator:
    """Wraps a microbatch iterator: adds up the time spent waiting in ``next`` and keeps the
    sample ids handed out since the last :meth:`take_ids`."""

    def __init__(self, batches: Iterator[Microbatch]) -> None:
        self.batches, self.waited_s = batches, 0.0
        self.ids: list = []
        self.squared_lengths = 0  # packed rows: Σ length² of the samples read (attention FLOPs)
        self.images = 0  # a vision-language model's images read (ViT FLOPs)

    def __iter__(self):
        return self

    def __next__(self) -> Microbatch:
        start = time.perf_counter()
        try:
            batch = next(self.batches)
        finally:
            self.waited_s += time.perf_counter() - start
        if "sample_id" in batch:
            self.ids.extend(int(i) for i in batch["sample_id"])
        if "cu_seqlens" in batch:  # boundaries padded with the last one: zero-length repeats
            lengths = np.diff(np.asarray(batch["cu_seqlens"], dtype=np.int64), axis=-1)
            self.squared_lengths += int((lengths ** 2).sum())
        if "num_images" in batch:
            self.images += int(np.sum(batch["num_images"]))
        return batch

    def take_ids(self) -> list:
        ids, self.ids = self.ids, []
        return ids
