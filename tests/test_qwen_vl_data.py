"""Qwen2.5-VL records → rows → what a reader sends a rank, against Hugging Face's own pieces.

Real files: images of several sizes drawn with Pillow, the real Qwen2 vocabulary and ChatML
template. Each ``<image>`` tag becomes <|vision_start|>, that image's <|image_pad|> tokens (as
many as its 14-pixel patches / 4 after transformers' ``smart_resize``), <|vision_end|>: the ids
equal the tokenizer's encoding of the chat template's text with the pads expanded, as
``Qwen2_5_VLProcessor`` expands them. The reader's pixels, made into patches on the rank side,
equal ``Qwen2VLImageProcessorPil``'s ``pixel_values``; its positions are M-RoPE's, per packed
sample. Bad input is counted per reason.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ray_ppu.data.native_images import NativeImageSpec
from ray_ppu.data.rope_index import mrope_positions
from ray_ppu.data.sft import sft_rows
from ray_ppu.data.sft.image_samples import VisionData, decode_rows

PAD, START, END = 151655, 151652, 151653
SPEC = NativeImageSpec(min_pixels=56 * 56, max_pixels=112 * 112)
SIZES = {"wide.png": (40, 130), "tall.jpg": (150, 60), "small.png": (20, 20),
         "big.png": (300, 400)}  # (height, width); tokens after smart_resize: 56 × 140 → 2 × 5,
# (the wide one) 28 × 140 → 1 × 5, 140 × 56 → 5 × 2, 56 × 56 (grown to min_pixels) → 2 × 2,
# 84 × 112 (shrunk under max_pixels) → 3 × 4


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    from PIL import Image, ImageDraw

    root = tmp_path_factory.mktemp("qwen_images")
    for i, (name, (h, w)) in enumerate(SIZES.items()):
        image = Image.new("RGB", (w, h), (40 * i, 200 - 30 * i, 90))
        ImageDraw.Draw(image).ellipse((2, 3, w - 5, h - 2), fill=(230, 50 * i, 20))
        image.save(root / name, **({"quality": 90} if name.endswith(".jpg") else {}))
    Image.new("RGB", (2000, 8), (1, 2, 3)).save(root / "sliver.png")  # aspect 250
    return root


def _vision(root) -> VisionData:
    return VisionData(PAD, 3, SPEC, 10**7, str(root), START)


def _chat(images, question="Which?", answer="The first one.", turns=1):
    tags = "".join("<image>" for _ in images)
    messages = [{"role": "user", "content": f"{tags}{question}"},
                {"role": "assistant", "content": answer}]
    for t in range(1, turns):
        messages += [{"role": "user", "content": f"And {t}?"},
                     {"role": "assistant", "content": f"Answer {t}."}]
    return {"messages": messages, "images": list(images)}


def _hf_ids(record, image_dir, tokenizer_dir) -> list[int]:
    """What Qwen2.5-VL's processor gives: the chat template's text with each image as
    <|vision_start|><|image_pad|><|vision_end|>, each pad expanded to its image's tokens."""
    from PIL import Image
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    images = [Image.open(image_dir / name) for name in record["images"]]
    grid = Qwen2VLImageProcessorPil(min_pixels=SPEC.min_pixels, max_pixels=SPEC.max_pixels)(
        images, return_tensors="pt")["image_grid_thw"]
    marked = [{**m, "content": m["content"].replace(
        "<image>", "<|vision_start|><|image_pad|><|vision_end|>")} for m in record["messages"]]
    # a sample ends at its last <|im_end|> (the template's newline after it is not trained)
    text = tokenizer.apply_chat_template(marked, tokenize=False).removesuffix("\n")
    for n in (grid.prod(-1) // 4).tolist():  # the processor's expansion, image by image
        text = text.replace("<|image_pad|>", "<|placeholder|>" * n, 1)
    return tokenizer(text.replace("<|placeholder|>", "<|image_pad|>"))["input_ids"]


def test_ids_equal_the_processors_and_pixels_and_positions_follow(image_dir,
                                                                  qwen2_tokenizer_dir):
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from ray_ppu.model.native_pixels import patchify

    records = [_chat(["wide.png"]), _chat(["tall.jpg", "small.png"], turns=2),
               _chat(["big.png"], question="Describe.", answer="Round.")]
    rows, stats = sft_rows(records, qwen2_tokenizer_dir, 128, vision=_vision(image_dir))
    assert stats["samples_used"] == 3 and stats["dropped_total"] == 0
    for r, record in enumerate(records):
        expected = _hf_ids(record, image_dir, qwen2_tokenizer_dir)
        tokens = rows["tokens"][r]
        assert tokens[:len(expected) - 1].tolist() == expected[:-1]  # tokens: ids but the last
        assert rows["labels"][r][:len(expected) - 1].tolist() == expected[1:]
        # images never carry loss
        assert not rows["loss_mask"][r][np.isin(rows["labels"][r], [PAD, START, END])].any()
    decoded = decode_rows(rows, _vision(image_dir))
    processor = Qwen2VLImageProcessorPil(min_pixels=SPEC.min_pixels, max_pixels=SPEC.max_pixels)
    for r, record in enumerate(records):
        n = int(decoded["num_images"][r])
        sizes = decoded["image_sizes"][r, :n]
        flat = torch.from_numpy(decoded["pixels"][r])
        images = [t.view(3, h, w) for t, (h, w) in zip(torch.split(
            flat, [3 * h * w for h, w in sizes.tolist()]), sizes.tolist())]
        values, grid = patchify(images, SPEC)
        hf = processor([Image.open(image_dir / name) for name in record["images"]],
                       return_tensors="pt")
        assert torch.equal(grid, hf["image_grid_thw"]) and torch.equal(values, hf["pixel_values"])
        assert np.array_equal(decoded["position_ids"][r], mrope_positions(
            rows["tokens"][r], grid.tolist(), PAD, 2))
    assert decoded["position_ids"].shape == (3, 3, 128)


def test_packed_rows_restart_positions_per_sample(image_dir, qwen2_tokenizer_dir):
    records = [_chat(["wide.png"]), _chat(["small.png"]), _chat(["tall.jpg"])]
    rows, _ = sft_rows(records, qwen2_tokenizer_dir, 160, packing=True, vision=_vision(image_dir))
    decoded = decode_rows(rows, _vision(image_dir))
    row, cu = 0, rows["cu_seqlens"][0]
    assert rows["num_images"][row] >= 2  # several samples, each with its image, in one row
    grids = [SPEC.grid(h, w) for h, w in decoded["image_sizes"][row, :rows["num_images"][row]]]
    at = 0
    for a, b in zip(cu[:-1], cu[1:]):
        if b <= a:
            continue
        sample = rows["tokens"][row][a:b]
        images = int(np.count_nonzero(sample == START))
        assert np.array_equal(decoded["position_ids"][row][:, a:b],
                              mrope_positions(sample, grids[at:at + images], PAD, 2))
        at += images
    # the packed row's token budget counts the image tokens
    assert int(np.count_nonzero(rows["tokens"][row] == PAD)) == sum(
        t * h * w // 4 for t, h, w in grids)


def test_bad_records_are_counted_per_reason(image_dir, qwen2_tokenizer_dir):
    records = [_chat(["wide.png"]),
               {**_chat(["wide.png"]), "video": "clip.mp4"},
               _chat(["sliver.png"]),
               _chat(["missing.png"]),
               _chat(["big.png", "big.png", "big.png"])]  # 3 × (12 + 2) tokens ≥ 40
    rows, stats = sft_rows(records, qwen2_tokenizer_dir, 40, vision=_vision(image_dir))
    dropped = {k: v for k, v in stats["dropped"].items() if v}
    assert dropped == {"unsupported_media": 1, "image_aspect": 1, "missing_image": 1,
                       "image_tokens_too_long": 1}
    assert stats["samples_used"] == 1
    examples = stats["examples"]
    assert "record 1" in examples["unsupported_media"] and "'video'" in examples["unsupported_media"]
    assert "sliver.png" in examples["image_aspect"] and "250" in examples["image_aspect"]
    assert "[12, 12, 12] tokens after resizing" in examples["image_tokens_too_long"]
    assert "40-token row" in examples["image_tokens_too_long"]


def test_a_cut_sample_keeps_whole_images_only(image_dir, qwen2_tokenizer_dir):
    """A multi-turn record whose second image would be cut by the row's end loses that image
    and everything after it; the first turn, its image and its answer stay."""
    record = {"messages": [{"role": "user", "content": "<image>Hi"},
                           {"role": "assistant", "content": "ok " * 10},
                           {"role": "user", "content": "<image>And?"},
                           {"role": "assistant", "content": "fine " * 30}],
              "images": ["wide.png", "big.png"]}
    rows, stats = sft_rows([record], qwen2_tokenizer_dir, 48, vision=_vision(image_dir))
    assert (stats["samples_used"], stats["truncated"], int(rows["num_images"][0])) == (1, 1, 1)
    tokens, mask = rows["tokens"][0], rows["loss_mask"][0]
    counts = [int(np.count_nonzero(tokens == t)) for t in (START, END, PAD)]
    assert counts == [1, 1, 5]  # the wide image whole (1 × 5 tokens), nothing of the big one
    assert mask.sum() == 12  # "ok " × 10 and <|im_end|>: the first answer, whole
