"""Qwen2.5-VL against transformers' ``Qwen2_5_VLForConditionalGeneration``.

A tiny random Qwen2.5-VL is built offline from config objects and saved with
``save_pretrained`` (conftest's ``random_qwen_vl``): a 4-layer tower (window attention in layers
0 and 2, whole-image attention in 1 and 3, 56-pixel windows so the larger image spans
several), a 4-layer Qwen2.5 language model with M-RoPE sections [2, 3, 3] of its 16-channel
heads. Norms and biases are drawn at random too, so a mix-up shows, and the attention weights
wide enough for positions to matter (wrong M-RoPE positions move the logits by ~0.1). One
prompt holds two real images of different sizes (Pillow drawings through transformers' own
image processor): 10 × 8 and 4 × 12 patches, 20 and 12 image tokens.

One torchrun launch of two CPU ranks (this file's ``__main__``) loads it at TP 1, TP 2 and
PP 2 and writes the logits of that prompt, with transformers' own M-RoPE positions; then
trains it three steps at TP 1, TP 2, PP 2 and PP 2 with virtual stages.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from conftest import launch_torchrun, qwen_vl_reference, random_qwen_vl


LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (TP, PP); DP makes up the 2 ranks
# training layouts: (TP, PP, layers per virtual stage); the last interleaves 4 layers as 2 × 2
TRAIN_LAYOUTS = [(1, 1, None), (2, 1, None), (1, 2, None), (1, 2, 1)]
IMAGE, START, END = 999, 997, 998  # <|image_pad|>, <|vision_start|>, <|vision_end|>
SIZES = [(140, 112), (56, 168)]  # (height, width) in pixels: multiples of 28, no resize


def _images() -> list:
    from PIL import Image, ImageDraw

    out = []
    for i, (h, w) in enumerate(SIZES):
        image = Image.new("RGB", (w, h), (30 + 60 * i, 200 - 50 * i, 90))
        draw = ImageDraw.Draw(image)
        draw.ellipse((5, 7, w - 9, h - 4), fill=(220, 40 + 90 * i, 10))
        draw.rectangle((w // 3, h // 4, w // 2, h // 2), fill=(0, 0, 255 - 100 * i))
        out.append(image)
    return out


def _prompt(grid: torch.Tensor) -> list[int]:
    """Text, image 1, text, image 2, text: each image <|vision_start|>, its pads, <|vision_end|>."""
    tokens = [5, 17, 300]
    for i, (t, h, w) in enumerate(grid.tolist()):
        tokens += [START] + [IMAGE] * (t * h * w // 4) + [END] + [40 + i, 41, 42 + 7 * i]
    return tokens + [600, 7]


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    dirs = {}
    for spelling in ("transformers5", "published"):
        path = tmp_path_factory.mktemp(f"qwen_vl_{spelling}")
        # 4 text layers: PP 2 × 2 virtual stages of one layer each
        model = random_qwen_vl(path, vocab=1000, text_layers=4, sharp=True,
                               published_names=spelling == "published", ids=(IMAGE, START, 996))
        dirs[spelling] = path
    processed = Qwen2VLImageProcessorPil()(_images(), return_tensors="pt")
    pixels, grid = processed["pixel_values"], processed["image_grid_thw"]
    reference = qwen_vl_reference(model, torch.tensor([_prompt(grid)]), pixels, grid, IMAGE)
    torch.save(reference, dirs["transformers5"] / "reference.pt")
    return dirs


@pytest.fixture(scope="module")
def launched(qwen_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen_vl_layouts")
    jobs = {"out": str(out), "models": {k: str(v) for k, v in qwen_dirs.items()},
            "reference": str(qwen_dirs["transformers5"] / "reference.pt"), "layouts": LAYOUTS}
    return launch_torchrun(__file__, jobs, out, timeout=600)


def test_the_prompt_has_two_images_of_different_sizes(qwen_dirs):
    reference = torch.load(qwen_dirs["transformers5"] / "reference.pt")
    assert reference["grid"].tolist() == [[1, 10, 8], [1, 4, 12]]
    assert reference["ids"].count(IMAGE) == 20 + 12
    # M-RoPE: the image tokens' height and width positions differ, text ones are equal
    positions = reference["positions"]
    assert not torch.equal(positions[1], positions[2])


def test_wrong_positions_would_show(qwen_dirs, launched):
    """The layouts' check can fail: TP 1 with plain RoPE positions (0 … n-1 on all three
    axes) is far off transformers'."""
    reference = torch.load(qwen_dirs["transformers5"] / "reference.pt")["logits"]
    wrong = torch.load(launched / "arange_positions.pt")
    assert (wrong - reference).abs().max() > 1e-2


@pytest.mark.parametrize("spelling", ["transformers5", "published"])
def test_logits_equal_transformers_at_every_layout(qwen_dirs, launched, spelling):
    reference = torch.load(qwen_dirs["transformers5"] / "reference.pt")["logits"]
    for tp, pp in LAYOUTS:
        ours = torch.load(launched / f"{spelling}_tp{tp}_pp{pp}.pt")
        assert ours.shape == reference.shape
        assert (ours - reference).abs().max() <= 1e-4, (spelling, tp, pp)


def test_training_at_tp2_pp2_and_interleaved_gives_tp1s_losses(launched):
    """Three optimizer steps of the whole model (tower, merger, language) on rows of native
    images with M-RoPE positions: TP 2, PP 2 and PP 2 with virtual stages (whose middle
    chunks read the positions too) give TP 1's losses, and training moves them."""
    runs = {layout: json.loads((launched / f"train_{layout}.json").read_text())
            for layout in ("1-1-None", "2-1-None", "1-2-None", "1-2-1")}
    reference = runs["1-1-None"]["losses"]
    assert reference[-1] < reference[0]
    for layout, run in runs.items():
        assert run["losses"] == pytest.approx(reference, abs=1e-5), layout


def test_config_json_gives_the_model_and_vision_sections(qwen_dirs):
    from ray_ppu.config.loader import load

    cfg = load(None, [f"checkpoint.pretrained={qwen_dirs['published']}"])
    assert cfg.model.mrope_section == [2, 3, 3] and cfg.model.hidden_size == 64
    v = cfg.vision
    assert (v.encoder, v.num_layers, v.hidden_size, v.num_attention_heads, v.window_size,
            v.full_attention_layers, v.image_token_id) == ("qwen2.5-vl", 4, 32, 2, 56, [1, 3],
                                                           IMAGE)


def test_tower_shapes_are_transformers_module():
    """The header check's shapes (written out, so the driver needs no transformers) are those
    of the module the ranks build, at the 7B preset's tower."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    from ray_ppu.config.presets import VISION_PRESETS
    from ray_ppu.hf.qwen_vl import hf_vision_config, tower_shapes

    vision = VISION_PRESETS["qwen2.5-vl-7B"][1]
    with torch.device("meta"):
        module = Qwen2_5_VisionTransformerPretrainedModel(
            Qwen2_5_VLVisionConfig(**hf_vision_config(vision, 3584)))
    theirs = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    assert tower_shapes(vision, 3584, "") == theirs
    assert sum(math.prod(s) for s in theirs.values()) == pytest.approx(0.67e9, rel=0.01)


# The torchrun side: python -m torch.distributed.run --nproc-per-node 2 tests/test_qwen_vl_model.py
# ---------------------------------------------------------------------------------------------

def _run_layouts(jobs: dict) -> None:
    import logging

    import torch.distributed as dist

    from ray_ppu.model import parallel
    from ray_ppu.offline import inference

    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    out = Path(jobs["out"])
    reference = torch.load(jobs["reference"])
    images = (reference["pixels"], reference["grid"])
    with parallel.process_group("cpu"):
        for spelling, directory in jobs["models"].items():
            source = inference.open_source(directory)
            for tp, pp in jobs["layouts"]:
                cfg, plan = inference.inference_config(source.model, dist.get_world_size(), tp,
                                                       pp, device="cpu", vision=source.vision)
                with inference.built_model(cfg, plan, "cpu") as chunks:
                    inference.load_weights(chunks, source, cfg, plan)
                    logits = inference.prompt_logits(
                        chunks, reference["ids"], source.model.vocab_size, torch.device("cpu"),
                        images, positions_of=lambda _tokens: reference["positions"])
                    if (tp, pp) == (1, 1) and spelling == "published":
                        arange = inference.prompt_logits(
                            chunks, reference["ids"], source.model.vocab_size,
                            torch.device("cpu"), images, positions_of=lambda tokens:
                            torch.arange(len(tokens)).expand(3, -1))
                        if dist.get_rank() == 0:
                            torch.save(arange, out / "arange_positions.pt")
                if dist.get_rank() == 0:
                    torch.save(logits, out / f"{spelling}_tp{tp}_pp{pp}.pt")
        for tp, pp, vp in TRAIN_LAYOUTS:
            losses = _train(jobs["models"]["published"], tp, pp, vp)
            if dist.get_rank() == 0:
                (out / f"train_{tp}-{pp}-{vp}.json").write_text(json.dumps({"losses": losses}))


def _rows(count: int, seq: int = 40) -> list[dict]:
    """``count`` one-row microbatches: random text around one random 56 × 84 image (4 × 6
    patches: 6 tokens between <|vision_start|> and <|vision_end|>), M-RoPE positions, the
    loss after the image; as a reader sends them."""
    import numpy as np

    from ray_ppu.data.rope_index import mrope_positions

    rng = np.random.default_rng(0)
    rows = []
    for _ in range(count):
        tokens = rng.integers(0, 990, seq + 1)
        tokens[3], tokens[4:10], tokens[10] = START, IMAGE, END
        mask = np.zeros(seq, np.float32)
        mask[10:] = 1.0
        pixels = np.empty(1, object)
        pixels[0] = rng.integers(0, 256, 3 * 56 * 84, dtype=np.uint8)
        rows.append({"tokens": tokens[None, :-1], "labels": tokens[None, 1:], "loss_mask": mask[None],
                     "position_ids": mrope_positions(tokens[:-1], [(1, 4, 6)], IMAGE)[None],
                     "pixels": pixels, "image_sizes": np.array([[[56, 84]]], np.int32),
                     "num_images": np.ones(1, np.int32)})
    return rows


def _train(directory: str, tp: int, pp: int, vp, steps: int = 3) -> list:
    """``steps`` optimizer steps of the model in ``directory``, everything training, at
    TP × PP (× virtual stages of ``vp`` layers), global batch 4 in one-row microbatches."""
    import numpy as np
    from megatron.core import parallel_state as ps

    from ray_ppu import devices
    from ray_ppu.config.loader import load
    from ray_ppu.data.sampler import rank_sample_ids
    from ray_ppu.data.sft.image_samples import vision_data
    from ray_ppu.hf import pretrained
    from ray_ppu.model import parallel
    from ray_ppu.model.gpt import build_model
    from ray_ppu.model.optim import build_optimizer
    from ray_ppu.plan import build_plan
    from ray_ppu.train.loop import wire_gradient_sync
    from ray_ppu.train.schedule import make_schedule, mean_loss, sum_reports

    cfg = load(None, [f"checkpoint.pretrained={directory}", "cluster.device=cpu",
                      "cluster.num_workers=2", f"parallel.tensor_model_parallel_size={tp}",
                      f"parallel.pipeline_model_parallel_size={pp}", "training.precision=fp32",
                      *([f"parallel.num_layers_per_virtual_pipeline_stage={vp}"] if vp else []),
                      "training.seq_length=40", "training.micro_batch_size=1",
                      "training.global_batch_size=4", f"training.train_iters={steps}",
                      "training.lr=1e-2", "training.lr_warmup_iters=0", "training.eval_iters=0",
                      "data.dataset=sft", "data.data_path=[unused.jsonl]", "vision.freeze=[]"])
    plan = build_plan(cfg)
    rows, device = _rows(4), torch.device("cpu")
    with devices.bound("cpu", 0), parallel.groups(plan, cfg.training.seed):
        model, _ = build_model(cfg, plan, "cpu")
        pretrained.load(model, cfg, plan.padded_vocab_size)
        optimizer, _ = build_optimizer(cfg, plan, model)
        wire_gradient_sync(model, optimizer)
        schedule = make_schedule(plan, model, device, images=vision_data(cfg).spec)
        ids = rank_sample_ids(np.arange(steps), ps.get_data_parallel_rank(),
                              plan.data_parallel_size, 4, 1)
        batches = iter([rows[i % 4] for i in ids])
        losses = []
        for _ in range(steps):
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            total = sum_reports(schedule(batches, forward_only=False), None)
            assert optimizer.step()[0]
            losses.append(mean_loss(total, device))
    return losses


if __name__ == "__main__":  # dist_checkpointing starts spawn-context helpers: guard needed
    _run_layouts(json.loads(Path(sys.argv[1]).read_text()))
