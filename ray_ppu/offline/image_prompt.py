"""A question about images as a vision-language model's input: token ids with each image's
positions, and the images' pixel values, prepared as training prepares them.

The question becomes the user turn of the tokenizer's chat template with the generation prompt
after it (what ``apply_chat_template(add_generation_prompt=True)`` gives), each ``<image>`` tag
becoming the model's image tokens, as LLaVA's processor expands them; without tags the images
go first, one tag per line, as LLaVA's training records put them. Template tokens (``<|im_start|>``
…) are matched whole, as Hugging Face matches added tokens in a rendering. The pixels come from
the same decoding and preprocessing as the training data (:mod:`ray_ppu.data.images`).

Qwen2.5-VL (``vision.native``) takes each image at its own size, so an image's token count is
known only once it is resized (:func:`native_pixels`): a tag becomes ``<|vision_start|>``, that
many ``<|image_pad|>`` and ``<|vision_end|>``, as Qwen's processor expands its chat template's
image entry (the ids from the vision section, so a tokenizer without the vision tokens works
too), and the positions are M-RoPE's (:func:`mrope_of`), computed again for each longer sequence.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence

import torch

from ray_ppu.config.schema import DataConfig
from ray_ppu.config.vision import VisionConfig
from ray_ppu.data.images import ImageProblem, image_spec, load_image
from ray_ppu.errors import ConfigError

IMAGE_TAG = "<image>"


def pixel_values(paths: Sequence[str], vision: VisionConfig,
                 model_dir: Optional[Path]) -> torch.Tensor:
    """[n, 3, H, W] float32 pixel values of the images at ``paths``, by the image processor
    of ``model_dir`` (its preprocessor_config.json) or the encoder family's; a bad image is a
    ConfigError naming it."""
    from ray_ppu.model.pixels import normalize

    spec = image_spec(vision, model_dir)
    return normalize(torch.stack(_loaded(paths, load_image, spec)), spec)


def _loaded(paths: Sequence[str], load, spec) -> list[torch.Tensor]:
    """Each image as ``load`` makes its uint8 pixels; a bad image is a ConfigError naming it."""
    try:
        return [torch.from_numpy(load(p, spec, DataConfig.max_image_pixels)) for p in paths]
    except ImageProblem as problem:
        raise ConfigError(f"--image: {problem}") from None


def native_pixels(paths: Sequence[str], vision: VisionConfig, model_dir: Optional[Path]
                  ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(pixel_values [Σ patches, 3·t·p·p], grid_thw [n, 3], image tokens of each image) of the
    images at ``paths`` at their own sizes; a bad image is a ConfigError naming it."""
    from ray_ppu.data.native_images import load_native
    from ray_ppu.data.sft.image_samples import native_spec
    from ray_ppu.model.native_pixels import patchify

    spec = native_spec(vision, model_dir)
    pixels, grid = patchify(_loaded(paths, load_native, spec), spec)
    return pixels, grid, [int(t * h * w) // spec.merge_size ** 2 for t, h, w in grid.tolist()]


def mrope_of(grid: torch.Tensor, vision: VisionConfig):
    """``positions_of(tokens) -> [3, len(tokens)]``: M-RoPE positions of a sequence holding
    these images' token runs in order (the prompt, and the prompt with its continuation)."""
    import numpy as np

    from ray_ppu.data.rope_index import mrope_positions

    grids = grid.tolist()

    def positions_of(tokens: list[int]) -> torch.Tensor:
        return torch.from_numpy(mrope_positions(np.asarray(tokens), grids, vision.image_token_id,
                                                vision.spatial_merge_size))

    return positions_of


def prompt_ids(tokenizer_dir: str | Path, question: str, images: int,
               vision: VisionConfig, native_tokens: Optional[list[int]] = None
               ) -> tuple[list[int], list[int]]:
    """(token ids of the chat prompt asking ``question`` about ``images`` images, the ids that
    end an answer: the template's end-of-turn and the tokenizer's end of text).
    ``native_tokens``: a Qwen2.5-VL model's image tokens of each image."""
    from ray_ppu.data.sft.chat_encoder import ChatEncoder

    tags = question.count(IMAGE_TAG)
    if tags == 0:  # LLaVA's records: a tag per line; Qwen's template: the images run on
        question = (IMAGE_TAG if native_tokens else f"{IMAGE_TAG}\n") * images + question
    elif tags != images:
        raise ConfigError(f"--prompt has {tags} {IMAGE_TAG} tag(s) for {images} --image(s)")
    try:
        encoder = ChatEncoder(tokenizer_dir)
        text = encoder.render([{"role": "user", "content": question}], add_generation_prompt=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{tokenizer_dir}: no usable chat template ({err})") from None
    special = dict(encoder.added_tokens)
    pieces = re.split("(" + "|".join(map(re.escape, sorted([IMAGE_TAG, *special], key=len,
                                                             reverse=True))) + ")", text)
    ids: list[int] = []
    counts = iter(native_tokens or [])
    for piece in pieces:
        if piece == IMAGE_TAG and native_tokens:
            start = vision.vision_start_token_id
            ids += [start] + [vision.image_token_id] * next(counts) + [start + 1]
        elif piece == IMAGE_TAG:
            ids += [vision.image_token_id] * vision.image_tokens
        elif piece in special:
            ids.append(special[piece])
        elif piece:
            ids += encoder.tokenizer.encode(piece)
    stops = [encoder.tokenizer.eod] + [special[t] for t in ("<|im_end|>", "<|eot_id|>")
                                        if t in special]
    return ids, stops
