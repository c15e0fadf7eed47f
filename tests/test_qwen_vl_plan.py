"""The plan's count of Qwen2.5-VL's image side (ray_ppu.plan.qwen_vision) against transformers'
own tower: parameters per component (the merger is vision.freeze's "projector"), FLOPs per
image by torch's FLOP counter (whole and partial attention windows, every freeze), the tower
replicated over TP in the memory plan, and the shipped qwen2.5-vl-7b-lora.yaml dry-run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from ray_ppu.config.loader import load
from ray_ppu.plan import build_plan
from ray_ppu.plan.memory import memory_plan
from ray_ppu.plan.qwen_vision import attention_pairs, window_sides
from ray_ppu.plan.vision import component_parameters, flops_per_image

CONFIG = REPO / "entrypoints" / "configs" / "qwen2.5-vl-7b-lora.yaml"
FREEZES = [(), ("vision",), ("projector",), ("vision", "projector")]


def _tower(cfg):
    """transformers' tower as ray_ppu builds it (ray_ppu.model.qwen_vision), fp32 on the CPU."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    from ray_ppu.hf.qwen_vl import hf_vision_config

    hf = Qwen2_5_VLVisionConfig(**hf_vision_config(cfg.vision, cfg.model.hidden_size))
    hf._attn_implementation = "sdpa"
    return Qwen2_5_VisionTransformerPretrainedModel(hf)


@pytest.mark.parametrize("preset", ["tiny-qwen-vl", "qwen2.5-vl-7B", "qwen2.5-vl-72B"])
def test_component_parameters_are_the_towers(preset):
    cfg = load(None, [f"model.preset={preset}"])
    with torch.device("meta"):
        tower = _tower(cfg)
    merger = sum(p.numel() for p in tower.merger.parameters())
    assert component_parameters(cfg) == {
        "vision": sum(p.numel() for p in tower.parameters()) - merger, "projector": merger}


@pytest.mark.parametrize("size", [112, 84, 140])  # 2 × 2 windows; 2 + 1 and 2 + 2 + 1 per side
@pytest.mark.parametrize("frozen", FREEZES, ids=lambda f: "+".join(f) or "none")
def test_flops_per_image_are_what_the_tower_computes(size, frozen):
    """torch's FLOP count of the tower's forward (and backward, as far as it trains) on one
    image of ``size`` pixels is the plan's: linears, the Conv3d, attention per window and
    over the whole image, the merger. (sdpa's math backend: torch counts its matmuls; the
    CPU's fused kernel has no FLOP formula.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    cfg = load(None, ["model.preset=tiny-qwen-vl", f"vision.image_size={size}",
                      f"vision.freeze=[{', '.join(frozen)}]"])
    v = cfg.vision
    torch.manual_seed(0)
    tower = _tower(cfg)
    tower.requires_grad_(False)
    if "vision" not in frozen:
        tower.requires_grad_(True)
    tower.merger.requires_grad_("projector" not in frozen)
    side = size // v.patch_size
    pixels = torch.rand(side * side, 3 * v.temporal_patch_size * v.patch_size ** 2)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = tower(pixels, grid_thw=torch.tensor([[1, side, side]])).pooler_output
        if out.requires_grad:
            out.sum().backward()
    assert out.shape == (v.image_tokens, cfg.model.hidden_size)
    assert counter.get_total_flops() == flops_per_image(cfg) > 0


def test_windows_of_the_7b_nominal_image():
    """448 px: 32 × 32 patches in 4 × 4 windows of 8 × 8; 28 window layers of 1024 · 64 pairs
    and 4 full ones of 1024²; 476 px adds a 2-patch rest per side."""
    cfg = load(None, ["model.preset=qwen2.5-vl-7B"])
    v = cfg.vision
    assert (v.patches, v.image_tokens, window_sides(v)) == (1024, 256, [8, 8, 8, 8])
    assert attention_pairs(cfg) == 28 * 1024 * 64 + 4 * 1024 ** 2
    assert window_sides(v.with_(image_size=476)) == [8, 8, 8, 8, 2]
    h, f, H, n = 1280, 3420, 3584, 1024
    layers = 32 * n * (4 * h * h + 3 * h * f) + 2 * h * attention_pairs(cfg)
    conv = n * 3 * 2 * 14 * 14 * h
    merger = 256 * (16 * h * h + 4 * h * H)
    assert flops_per_image(cfg) == 2 * (layers + conv) + 6 * merger  # default: tower frozen
    assert flops_per_image(cfg) == pytest.approx(1.393e12, rel=1e-3)


def test_the_tower_is_replicated_over_tensor_parallel():
    """At TP 2 each rank holds all of the tower (and keeps all its activations); the
    language model's share halves."""
    base = ["model.preset=qwen2.5-vl-7B", "data.dataset=sft", "data.tokenizer=/t",
            "data.data_path=[a]", "training.eval_iters=0", "training.train_iters=10", "training.global_batch_size=16",
            "cluster.num_workers=2", "vision.freeze=[]", "training.seq_length=2048"]
    one = load(None, base + ["parallel.tensor_model_parallel_size=1"])
    two = load(None, base + ["parallel.tensor_model_parallel_size=2"])
    tower = sum(component_parameters(one).values())
    p1, p2 = build_plan(one), build_plan(two)
    language = p1.num_parameters_per_device - tower
    assert p2.num_parameters_per_device - tower == pytest.approx(language / 2, rel=0.01)
    assert p2.num_trainable_parameters_per_device - tower == pytest.approx(language / 2, rel=0.01)
    from ray_ppu.plan.vision import activation_bytes

    assert activation_bytes(two, 2, 2, 2) == activation_bytes(one, 2, 1, 2) > 0
    assert memory_plan(two, p2).parameters_gib > tower * 2 / 2**30


def test_shipped_config_dry_run_counts_the_tower(tmp_path):
    """qwen2.5-vl-7b-lora.yaml (the seed's Qwen-VL row) plans on one 16-PPU node and its FLOPs
    per iteration include 128 nominal images through the tower; its placeholder
    checkpoint.pretrained is replaced by a directory with the published config.json."""
    from ray_ppu.hf.qwen_vl import qwen_vl_to_hf

    cfg = load(None, ["model.preset=qwen2.5-vl-7B"])
    (tmp_path / "config.json").write_text(json.dumps(qwen_vl_to_hf(cfg.model, cfg.vision,
                                                                   "bfloat16")))
    proc = subprocess.run([sys.executable, str(REPO / "entrypoints" / "pretrain.py"), "--config",
                           str(CONFIG), "--dry-run", "--plan-only",
                           f"checkpoint.pretrained={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    plan, memory = result["plan"], result["memory"]
    assert (plan["data_parallel_size"], plan["micro_batch_size"], plan["num_microbatches"],
            plan["global_batch_size"], plan["seq_length"]) == (16, 2, 4, 128, 2048)
    shipped = load(CONFIG, [f"checkpoint.pretrained={tmp_path}"])
    assert plan["flops_per_image"] == flops_per_image(shipped) > 0
    assert plan["flops_per_iteration"] > 128 * plan["flops_per_image"]
    assert shipped.lora.enabled and shipped.training.precision == "bf16"
    assert shipped.training.use_distributed_optimizer and memory["fits"]
    assert "FLOPs per nominal image (qwen2.5-vl at native resolution" in proc.stderr
