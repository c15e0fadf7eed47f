"""Vision-language training stages: what trains is exactly what the config names.

Each combination of ``vision.freeze`` and LoRA builds tiny-vl with Megatron's DDP and
distributed optimizer (a world of one, in this process) and takes one real optimizer step on
image-text rows: the parameters that moved are exactly the named ones, every other is
bit-identical, and the optimizer holds state for the trainable ones only (a frozen part costs
no optimizer memory). Across layouts and under Ray Train: tests/test_vl_model.py and
tests/test_vl_run.py.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from test_sft_training import sft_overrides
from test_vl_data import _ask, image_dir  # noqa: F401 (images drawn with Pillow, a fixture)
from ray_ppu import devices
from ray_ppu.config.loader import load
from ray_ppu.config.lora import ADAPTER_SUFFIX
from ray_ppu.model import parallel
from ray_ppu.plan import build_plan

COMPONENTS = ("vision", "projector", "language")
COMBINATIONS = [(frozen, lora) for n in range(4) for frozen in itertools.combinations(COMPONENTS, n)
                for lora in (False, True) if lora or len(frozen) < 3]  # all frozen, no LoRA: refused


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory, qwen2_tokenizer_dir):
    """tiny-vl as a Hugging Face LLaVA directory (SigLIP + Qwen2 with the real vocabulary,
    random weights), with its tokenizer and image processor beside it."""
    from transformers import (LlavaConfig, LlavaForConditionalGeneration, Qwen2Config,
                              SiglipImageProcessor, SiglipVisionConfig)

    path = tmp_path_factory.mktemp("tiny_llava") / "tiny-llava"
    torch.manual_seed(0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, image_size=32, patch_size=8)
    text = Qwen2Config(vocab_size=151_936, hidden_size=64, intermediate_size=176,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=32_768, rms_norm_eps=1e-6, rope_theta=1e6,
                       tie_word_embeddings=True)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=151_655,
                         vision_feature_layer=-1, vision_feature_select_strategy="full",
                         tie_word_embeddings=True)
    LlavaForConditionalGeneration(config).save_pretrained(path)
    SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(qwen2_tokenizer_dir) / name, path / name)
    return path


def _config(tmp_path, tokenizer_dir, frozen, lora, pretrained):
    overrides = sft_overrides(tmp_path, tokenizer_dir, tmp_path / "out",
                              f"checkpoint.pretrained={pretrained}",
                              "cluster.num_workers=1", "training.eval_iters=0",
                              "training.micro_batch_size=2", "training.global_batch_size=2",
                              f"vision.freeze=[{', '.join(frozen)}]", f"lora.enabled={lora}",
                              "lora.rank=4", "training.lr=1e-2", "training.lr_warmup_iters=0")
    return load(None, overrides)


@pytest.fixture(scope="module")
def rows(image_dir, qwen2_tokenizer_dir):  # noqa: F811
    from ray_ppu.data.sft import sft_rows
    from ray_ppu.data.sft.image_samples import vision_data

    cfg = load(None, ["model.preset=tiny-vl", f"data.image_root={image_dir}"])
    records = [_ask("red.png", "Which colour?", "Red."), _ask("blue.jpg", "And this?", "Blue.")]
    rows, summary = sft_rows(records, qwen2_tokenizer_dir, 128, vision=vision_data(cfg),
                             max_padding_length=128)
    assert summary["samples_used"] == 2 and list(rows["num_images"]) == [1, 1]
    return rows


@pytest.fixture(scope="module")
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _kind(name: str) -> str:
    if ADAPTER_SUFFIX + "." in name:
        return "adapters"
    for prefix, component in (("vision_model.", "vision"), ("vision_projection.", "projector"),
                              ("language_model.", "language")):
        if prefix in name:
            return component
    raise AssertionError(f"{name}: no component")


@pytest.mark.parametrize("frozen,lora", COMBINATIONS,
                         ids=[f"freeze={'+'.join(f) or 'none'}-lora={l}" for f, l in COMBINATIONS])
def test_one_step_moves_exactly_the_named_parts(world_of_one, rows, tmp_path, qwen2_tokenizer_dir,
                                                tiny_llava, frozen, lora):
    from ray_ppu.model.gpt import build_model
    from ray_ppu.model.optim import build_optimizer
    from ray_ppu.train.schedule import make_schedule
    from ray_ppu.data.sft.image_samples import vision_data

    cfg = _config(tmp_path, qwen2_tokenizer_dir, frozen, lora, tiny_llava)
    plan = build_plan(cfg)
    with devices.bound("cpu", 0), parallel.groups(plan, cfg.training.seed):
        model, _ = build_model(cfg, plan, "cpu")
        optimizer, _ = build_optimizer(cfg, plan, model)
        before = {n: p.detach().clone() for n, p in model[0].named_parameters()}
        trainable = {n for n, p in model[0].named_parameters() if p.requires_grad}
        schedule = make_schedule(plan, model, torch.device("cpu"), images=vision_data(cfg).spec)
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        schedule(iter([rows]), forward_only=False)
        ok, _, _ = optimizer.step()
        assert ok
        moved = {n for n, p in model[0].named_parameters() if not torch.equal(p, before[n])}
        state = sum(p.numel() for g in optimizer.optimizer.param_groups for p in g["params"])
        sizes = dict((n, p.numel()) for n, p in model[0].named_parameters())

    expected = {"adapters"} if lora else set()
    expected |= set(COMPONENTS) - set(frozen) - ({"language"} if lora else set())
    assert {_kind(n) for n in trainable} == expected
    assert moved == trainable, sorted(moved ^ trainable)[:5]  # frozen: bit-identical
    assert state == sum(sizes[n] for n in trainable)  # Adam's state for the trainable only
