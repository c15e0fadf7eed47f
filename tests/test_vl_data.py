"""Image-text SFT records → rows with image tokens and the images' file bytes, decoded to
uint8 pixels as a reader does (in-process pipeline; the Ray path runs the same window function).

The records are real files: PNG / JPEG images drawn with Pillow, referred to by the three
forms users have (LLaVA / ShareGPT conversations, chat messages + images, caption pairs),
tokenized with the real Qwen2 vocabulary and ChatML template.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_ppu.data.images import ImageSpec
from ray_ppu.model.pixels import normalize
from ray_ppu.data.sft import sft_rows
from ray_ppu.data.sft.image_samples import VisionData, decode_rows

IMAGE_ID = 151655  # Qwen2's <|image_pad|>
TOKENS = 16


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    from PIL import Image, ImageDraw

    root = tmp_path_factory.mktemp("images")
    red = Image.new("RGB", (40, 30), (128, 128, 128))
    ImageDraw.Draw(red).ellipse((5, 5, 30, 25), fill=(220, 20, 20))
    red.save(root / "red.png")
    Image.new("RGB", (24, 48), (20, 30, 200)).save(root / "blue.jpg", quality=90)
    Image.new("P", (33, 33), 3).save(root / "palette.png")
    Image.new("CMYK", (20, 20), (0, 255, 255, 0)).save(root / "cmyk.jpg")
    Image.new("RGBA", (20, 20), (0, 255, 0, 128)).save(root / "alpha.png")
    (root / "text.jpg").write_text("not an image")
    data = (root / "red.png").read_bytes()
    (root / "truncated.png").write_bytes(data[: len(data) // 2])
    return root


def _vision(root, **changes) -> VisionData:
    settings = {"max_pixels": 10**6, "image_root": str(root), **changes}
    return VisionData(IMAGE_ID, TOKENS, ImageSpec.siglip(32), **settings)


def _ask(image, question="What is it?", answer="A shape."):
    return {"image": image, "conversations": [{"from": "human", "value": f"<image>\n{question}"},
                                               {"from": "gpt", "value": answer}]}


def test_three_record_forms_give_image_tokens_and_pixels(image_dir, qwen2_tokenizer_dir):
    from PIL import Image
    from transformers import SiglipImageProcessor

    records = [
        _ask("red.png"),
        {"messages": [{"role": "user", "content": "<image> or <image>?"},
                      {"role": "assistant", "content": "The second."}],
         "images": ["blue.jpg", str(image_dir / "red.png")]},  # relative and absolute
        {"image": "palette.png", "caption": "A flat colour."},
    ]
    vision = _vision(image_dir)
    stored, summary = sft_rows(records, qwen2_tokenizer_dir, 128, vision=vision)
    assert summary["samples_used"] == 3 and summary["dropped_total"] == 0
    assert list(stored["num_images"]) == [1, 2, 1]
    # rows keep the files' bytes, in token order; a reader decodes them
    files = [["red.png"], ["blue.jpg", "red.png"], ["palette.png"]]
    for r, names in enumerate(files):
        data = [(image_dir / name).read_bytes() for name in names]
        assert stored["image_bytes"][r] == b"".join(data)
        assert list(stored["image_lengths"][r]) == [len(d) for d in data] + [0] * (8 - len(data))
    rows = decode_rows(stored, vision)
    assert "image_bytes" not in rows and "image_lengths" not in rows
    assert rows["images"].shape == (3, 128 // TOKENS, 3, 32, 32) and rows["images"].dtype == np.uint8
    for r, n in enumerate(rows["num_images"]):
        places = rows["tokens"][r] == IMAGE_ID
        assert places.sum() == n * TOKENS
        assert not rows["loss_mask"][r][places].any()  # never in the loss
        assert not rows["images"][r, n:].any()  # unused slots stay empty
    # each image's tokens are one run, the tag's place in the text
    first = np.flatnonzero(rows["tokens"][0] == IMAGE_ID)
    assert (np.diff(first) == 1).all()
    # the pixels, normalised as a rank does, are Hugging Face's processor's
    processor = SiglipImageProcessor(size={"height": 32, "width": 32})
    spec = ImageSpec.siglip(32)
    for r, slot, name in ((0, 0, "red.png"), (1, 0, "blue.jpg"), (1, 1, "red.png")):
        theirs = processor(images=Image.open(image_dir / name), return_tensors="pt").pixel_values[0]
        ours = normalize(torch.from_numpy(rows["images"][r, slot]), spec)
        assert torch.equal(ours, theirs), (r, slot, name)


def test_image_tokens_are_what_hf_tokenizes_for_the_expanded_prompt(qwen2_tokenizer_dir,
                                                                   tmp_path):
    """As Hugging Face's LLaVA processor does: the chat template's rendering with each
    <image> tag written as 16 image tokens (an added token, so text never merges across it),
    tokenized whole. Our turn-by-turn encoding gives exactly those ids."""
    import json
    import shutil

    from tokenizers import Tokenizer

    from ray_ppu.data.sft import ChatEncoder

    directory = tmp_path / "tokenizer"
    shutil.copytree(qwen2_tokenizer_dir, directory)
    table = json.loads((directory / "tokenizer.json").read_text())
    table["added_tokens"].append({"id": IMAGE_ID, "content": "<|image_pad|>", "single_word": False,
                                  "lstrip": False, "rstrip": False, "normalized": False,
                                  "special": True})
    (directory / "tokenizer.json").write_text(json.dumps(table))
    messages = [{"role": "system", "content": "Look."},
                {"role": "user", "content": "<image>\nWhat colour is\n<image>?"},
                {"role": "assistant", "content": "Red, then blue."}]
    encoder = ChatEncoder(directory)
    ids, mask = encoder.encode_many([messages], (IMAGE_ID, TOKENS))[0]
    expanded = [{**m, "content": m["content"].replace("<image>", "<|image_pad|>" * TOKENS)}
                for m in messages]
    hf = Tokenizer.from_file(str(directory / "tokenizer.json"))
    pad = hf.token_to_id("<|image_pad|>")  # this exported vocabulary numbers it on from its end
    theirs = [IMAGE_ID if t == pad else t
              for t in hf.encode(encoder.render(expanded), add_special_tokens=False).ids]
    assert ids == theirs[:len(ids)] and ids.count(IMAGE_ID) == 2 * TOKENS
    assert not any(m for t, m in zip(ids, mask) if t == IMAGE_ID)


def test_every_bad_input_is_counted_with_its_place(image_dir, qwen2_tokenizer_dir):
    records = [
        _ask("missing.png"),                      # 0 missing_image
        _ask("text.jpg"),                         # 1 unreadable_image
        _ask("truncated.png"),                    # 2 unreadable_image
        {"image": ["red.png", "blue.jpg"],        # 3 image_tag_mismatch (1 tag, 2 images)
         "conversations": [{"from": "human", "value": "<image> hi"}, {"from": "gpt", "value": "x"}]},
        {"messages": [{"role": "user", "content": "draw"},  # 4 tag in an answer
                      {"role": "assistant", "content": "<image>"}], "images": ["red.png"]},
        {"image": ["red.png"] * 8, "conversations": [  # 5 images alone fill the 128-token row
            {"from": "human", "value": "<image>" * 8}, {"from": "gpt", "value": "x"}]},
        _ask("cmyk.jpg"), _ask("alpha.png"), _ask("palette.png"),  # converted, used
        _ask("red.png"),
    ]
    rows, summary = sft_rows(records, qwen2_tokenizer_dir, 128, vision=_vision(image_dir),
                             source="vl.jsonl")
    dropped = {k: v for k, v in summary["dropped"].items() if v}
    assert dropped == {"missing_image": 1, "unreadable_image": 2, "image_tag_mismatch": 2,
                       "image_tokens_too_long": 1}
    assert summary["samples_used"] == 4 and summary["records_read"] == 10
    examples = summary["examples"]
    assert examples["missing_image"].startswith("vl.jsonl: record 0: ")
    assert "missing.png" in examples["missing_image"]
    assert examples["unreadable_image"].startswith("vl.jsonl: record 1: ")
    assert "1 <image> tag(s) in the text, 2 image(s)" in examples["image_tag_mismatch"]
    assert "8 image(s) of 16 tokens fill the 128-token row" in examples["image_tokens_too_long"]


def test_huge_image_is_refused_by_its_header(image_dir, qwen2_tokenizer_dir):
    rows, summary = sft_rows([_ask("red.png")], qwen2_tokenizer_dir, 128,
                             vision=_vision(image_dir, max_pixels=1000))
    assert summary["dropped"]["image_too_large"] == 1
    assert "40 x 30" in summary["examples"]["image_too_large"]


def test_packing_keeps_each_rows_images_in_token_order(image_dir, qwen2_tokenizer_dir):
    records = [_ask(name, f"Q{i}") for i, name in enumerate(["red.png", "blue.jpg"] * 3)]
    vision = _vision(image_dir)
    rows, summary = sft_rows(records, qwen2_tokenizer_dir, 160, packing=True, vision=vision)
    rows = decode_rows(rows, vision)
    assert summary["samples_used"] == 6 and rows["images"].shape[1] == 160 // TOKENS
    assert int(rows["num_images"].sum()) == 6
    for r, n in enumerate(rows["num_images"]):
        assert (rows["tokens"][r] == IMAGE_ID).sum() == n * TOKENS
        # samples alternate red, blue: so do the row's image slots
        reds = [rows["images"][r, k, 0].mean() > rows["images"][r, k, 2].mean() for k in range(n)]
        assert all(a != b for a, b in zip(reds, reds[1:]))


def test_a_cut_sample_keeps_whole_images_only(image_dir, qwen2_tokenizer_dir):
    """A second user turn's image that the row cuts in two goes, with the turn."""
    record = {"image": ["red.png", "blue.jpg"], "conversations": [
        {"from": "human", "value": "<image> first?"}, {"from": "gpt", "value": "Red."},
        {"from": "human", "value": "<image> second?"}, {"from": "gpt", "value": "Blue."}]}
    rows, summary = sft_rows([record], qwen2_tokenizer_dir, 48, vision=_vision(image_dir))
    assert summary["truncated"] == 1 and list(rows["num_images"]) == [1]
    assert (rows["tokens"][0] == IMAGE_ID).sum() == TOKENS


def test_text_model_refuses_records_with_images(image_dir, qwen2_tokenizer_dir):
    rows, summary = sft_rows([_ask("red.png")], qwen2_tokenizer_dir, 128)
    assert summary["dropped"]["bad_field_type"] == 1
    assert "no vision part" in summary["examples"]["bad_field_type"]


def test_vision_plan_problems_are_named_together():
    from ray_ppu.config.loader import load
    from ray_ppu.errors import ConfigError
    from ray_ppu.plan import build_plan

    cfg = load(None, ["model.preset=tiny-vl", "data.dataset=idxmap", "vision.feature_layer=3",
                      "vision.num_attention_heads=3", "vision.freeze=[vision, projector, llm]",
                      "parallel.context_parallel_size=2", "vision.image_token_id=10000000"])
    with pytest.raises(ConfigError) as err:
        build_plan(cfg)
    text = str(err.value)
    for line in ["vision.feature_layer=3 selects no layer of vision.num_layers=2",
                 "vision.hidden_size=32 is not divisible by vision.num_attention_heads=3",
                 "vision.freeze=['vision', 'projector', 'llm']: llm is not one of",
                 "vision.encoder with CP 2", "vision.image_token_id=10000000 is outside",
                 "vision.encoder trains on image-text records: set data.dataset=sft"]:
        assert line in text, (line, text)
    cfg = load(None, ["model.preset=tiny-vl", "data.dataset=sft", "vision.freeze=[vision, language]",
                      "parallel.pipeline_model_parallel_size=2", "cluster.num_workers=2"])
    with pytest.raises(ConfigError, match=r"with PP 2: pipeline stages 2…2 hold only the frozen"):
        build_plan(cfg)


def test_plan_counts_each_component_and_what_trains():
    """Bunny's stage 2 at TP 2: the dry run names each component with its count and state,
    the memory plan keeps gradients and Adam only for what trains (the frozen ViT's half on
    this device), and a frozen language model (stage 1) costs 4 FLOPs per multiply-add, not 6."""
    from ray_ppu.config.loader import load
    from ray_ppu.plan import build_plan
    from ray_ppu.plan.memory import memory_plan
    from ray_ppu.plan.summary import summary_lines
    from ray_ppu.plan.vision import component_parameters

    base = ["model.preset=bunny-llama3-8b-v", "cluster.num_workers=16", "data.dataset=sft",
            "training.seq_length=2048", "training.global_batch_size=128",
            "parallel.tensor_model_parallel_size=2", "training.precision=bf16",
            "data.data_path=[bunny.json]", "data.tokenizer=llama3", "training.train_iters=10",
            "training.eval_iters=0"]
    cfg = load(None, base)
    plan = build_plan(cfg)
    parts = component_parameters(cfg)
    # 26 of so400m's 27 layers (feature layer -2) of 15 239 504 (h 1152, MLP 4304), the
    # 14-pixel patch convolution and 729 positions
    assert parts["vision"] == 26 * 15_239_504 + 3 * 14 * 14 * 1152 + 1152 + 729 * 1152
    line = next(l for l in summary_lines(cfg, plan, memory_plan(cfg, plan))
                if l.startswith("components:"))
    assert "vision 397.7 M (frozen), projector 21.5 M (trains), language 8.03 B (trains)" in line
    assert "729 tokens" in line
    memory = memory_plan(cfg, plan)
    assert memory.frozen_parameters == parts["vision"] // 2
    stage1 = build_plan(load(None, base + ["vision.freeze=[vision, language]"]))
    assert stage1.num_trainable_parameters == parts["projector"]
    language = plan.flops_per_iteration - 128 * plan.flops_per_image
    frozen = stage1.flops_per_iteration - 128 * stage1.flops_per_image
    attention = 128 * 2048 ** 2 * plan.attention_flops_coefficient
    assert (frozen - attention) / (language - attention) == pytest.approx(4 / 6)
