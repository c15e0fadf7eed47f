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
passes input gradients back (4); anything that trains costs 6, as Megatron-LM counts, but
the patch convolution, whose input (the pixels) needs no gradient (4). Checked against
torch's FLOP counter on the model (tests/test_vl_training.py). Qwen2.5-VL's tower (native
resolution, window attention, a gated MLP, the 2 × 2 merger as projector, replicated over TP)
is counted in :mod:`ray_ppu.plan.qwen_vision`; each function here hands it over.
"""

from __future__ import annotations

from ray_ppu.config.schema import RunConfig
from ray_ppu.plan import qwen_vision


def component_parameters(cfg: RunConfig) -> dict[str, int]:
    """Parameters of the ViT's built layers and embeddings, and of the projector."""
    v = cfg.vision
    if not v.enabled:
        return {}
    if v.native:
        return qwen_vision.component_parameters(cfg)
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
    if v.native:
        return qwen_vision.flops_per_image(cfg)
    h, f, H = v.hidden_size, v.ffn_hidden_size, cfg.model.hidden_size
    n = v.patches + int(v.class_token)
    layers = v.layers_built * (n * (4 * h * h + 2 * h * f) + 2 * n * n * h)
    patches = v.patches * h * 3 * v.patch_size ** 2
    projector = v.image_tokens * (h * H + H * H)
    return qwen_vision.by_freeze(v.freeze, layers, patches, projector)


def per_device(cfg: RunConfig, count: int, tp: int) -> int:
    """A TP rank's share of ``count`` image-side parameters: LLaVA's ViT and projector are
    Megatron layers split over TP; Qwen2.5-VL's tower is replicated on every TP rank."""
    return count if cfg.vision.native else count // tp


def trainable_parameters(cfg: RunConfig) -> int:
    """Parameters of the image side that train (not named in vision.freeze)."""
    parts = component_parameters(cfg)
    return sum(n for name, n in parts.items() if name not in cfg.vision.freeze)


def activation_bytes(cfg: RunConfig, micro_batch_size: int, tp: int, element_bytes: int,
                     attention: str = "sdpa") -> float:
    """What the image side keeps for backward per microbatch on a first-stage device: one
    image per sample (the plan's estimate). A frozen ViT (pixels need no gradient) keeps
    nothing, nor does a frozen projector behind it. A training ViT layer keeps, per position,
    its two LayerNorm inputs and outputs (4h), q, k, v and the attention output (4h / TP), the
    MLP's input-side GELU tensors (2f / TP), and its attention's softmax: the fp32 statistics
    per head and position of a fused kernel (``attention`` te / sdpa), or with Megatron-Core's
    reference attention (``local``) the fp32 softmax over every position pair (heads / TP ×
    n², plus its 16-bit cast); a training projector its input, its hidden layer and the GELU
    output (h + 2H / TP) per image token."""
    v = cfg.vision
    if not v.enabled:
        return 0.0
    if v.native:  # replicated over TP: no share of it is split
        return qwen_vision.activation_bytes(cfg, micro_batch_size, element_bytes)
    vit_trains = "vision" not in v.freeze
    projector_trains = "projector" not in v.freeze
    h, f, H, e = v.hidden_size, v.ffn_hidden_size, cfg.model.hidden_size, element_bytes
    n = v.patches + int(v.class_token)
    per_image = 0.0
    if vit_trains:
        heads = v.num_attention_heads / tp
        softmax = (heads * n * n * (4 + (e if e < 4 else 0)) if attention == "local"
                   else heads * n * 4)
        layer = n * e * (4 * h + (4 * h + 2 * f) / tp) + softmax
        per_image += v.layers_built * layer
    if vit_trains or projector_trains:
        per_image += v.image_tokens * e * (h + 2 * H / tp)
    return micro_batch_size * per_image
