"""Counting a vision-language model's image side: parameters per component and the FLOPs of
the ViT and the projector per image, beside the language model's own counts
(:mod:`ray_ppu.plan.arithmetic`), so MFU compares with the seed's (which counts both).

Per image of n positions (patches, plus CLIP's class token) in a ViT of width h, MLP width f
and L' built layers: each layer multiplies n·(4h² + 2hf) in its linears and 2·n²·h in
attention (QKᵀ and AV over every position: no causal halving); the patch convolution
patches·h·3p²; the projector image_tokens·(h·H + H²) into the language width H. A
multiply-add is 2 FLOPs; backward doubles it again for the input gradients and again for the
weight gradients. What a frozen part skips: a frozen ViT (the first thing in the model) runs
forward only (2 FLOPs per multiply-add); a frozen projector behind a training ViT still
passes input gradients back (4); anything that trains costs 6, as Megatron-LM counts.
"""

from __future__ import annotations

from ray_ppu.config.schema import RunConfig


def component_parameters(cfg: RunConfig) -> dict[str, int]:
    """Parameters of the ViT's built layers and embeddings, and of the projector."""
    v = cfg.vision
    if not v.enabled:
        return {}
    h, f, p = v.hidden_size, v.ffn_hidden_size, v.patch_size
    layer = (4 * h * h + 4 * h) + (2 * h * f + f + h) + 4 * h  # attention, MLP, two LayerNorms
    positions = v.patches + int(v.class_token)
    embeddings = 3 * p * p * h + positions * h
    embeddings += 3 * h if v.class_token else h  # class token + pre-norm, or the conv bias
    H = cfg.model.hidden_size
    projector = h * H + H * H + (2 * H if v.projector_bias else 0)
    return {"vision": v.layers_built * layer + embeddings, "projector": projector}


def flops_per_image(cfg: RunConfig) -> float:
    """FLOPs of one image through the ViT and the projector, forward and backward as far as
    they train (module docstring)."""
    v = cfg.vision
    if not v.enabled:
        return 0.0
    h, f, H = v.hidden_size, v.ffn_hidden_size, cfg.model.hidden_size
    n = v.patches + int(v.class_token)
    vit = v.layers_built * (n * (4 * h * h + 2 * h * f) + 2 * n * n * h) + v.patches * h * 3 * v.patch_size ** 2
    projector = v.image_tokens * (h * H + H * H)
    vit_trains = "vision" not in v.freeze
    projector_trains = "projector" not in v.freeze
    vit_factor = 6 if vit_trains else 2
    projector_factor = 6 if projector_trains else (4 if vit_trains else 2)
    return float(vit_factor * vit + projector_factor * projector)


def trainable_parameters(cfg: RunConfig) -> int:
    """Parameters of the image side that train (not named in vision.freeze)."""
    parts = component_parameters(cfg)
    return sum(n for name, n in parts.items() if name not in cfg.vision.freeze)
