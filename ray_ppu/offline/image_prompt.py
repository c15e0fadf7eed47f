"""A question about images as a vision-language model's input: token ids with each image's
positions, and the images' pixel values, prepared as training prepares them.

The question becomes the user turn of the tokenizer's chat template with the generation prompt
after it (what ``apply_chat_template(add_generation_prompt=True)`` gives), each ``<image>`` tag
becoming the model's image tokens, as LLaVA's processor expands them; without tags the images
go first, one tag per line, as LLaVA's training records put them. Template tokens (``<|im_start|>``
…) are matched whole, as Hugging Face matches added tokens in a rendering. The pixels come from
the same decoding and preprocessing as the training data (:mod:`ray_ppu.data.images`).
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
    try:
        pixels = [torch.from_numpy(load_image(p, spec, DataConfig.max_image_pixels))
                  for p in paths]
    except ImageProblem as problem:
        raise ConfigError(f"--image: {problem}") from None
    return normalize(torch.stack(pixels), spec)


def prompt_ids(tokenizer_dir: str | Path, question: str, images: int,
               vision: VisionConfig) -> tuple[list[int], list[int]]:
    """(token ids of the chat prompt asking ``question`` about ``images`` images, the ids that
    end an answer: the template's end-of-turn and the tokenizer's end of text)."""
    from ray_ppu.data.sft.chat_encoder import ChatEncoder

    tags = question.count(IMAGE_TAG)
    if tags == 0:
        question = f"{IMAGE_TAG}\n" * images + question
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
    for piece in pieces:
        if piece == IMAGE_TAG:
            ids += [vision.image_token_id] * vision.image_tokens
        elif piece in special:
            ids.append(special[piece])
        elif piece:
            ids += encoder.tokenizer.encode(piece)
    stops = [encoder.tokenizer.eod] + [special[t] for t in ("<|im_end|>", "<|eot_id|>")
                                        if t in special]
    return ids, stops
