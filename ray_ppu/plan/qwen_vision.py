"""Counting Qwen2.5-VL's image side: its vision tower ("vision") and patch merger ("projector"),
per nominal image, for the plan (:mod:`ray_ppu.plan.vision` hands a ``qwen2.5-vl`` encoder here).

Apart from the LLaVA count because the tower differs in every term: images come at their own
size, so the plan counts one square image of ``vision.image_size`` pixels (n = (size / 14)²
patches); attention is windowed (QKᵀ and AV within each window of window_size pixels, 8 × 8 =
64 patches at 112 px, except ``full_attention_layers``, which attend over all n); the MLP is
gated (gate, up, down: 3hf); the patch embedding is a Conv3d over t = 2 frames (3·t·p²·h per
patch, no bias); the merger is an RMSNorm, then Linear(4h, 4h), GELU, Linear(4h, H) on each
2 × 2 group of patches (n / 4 tokens, H the language width). The frozen / trained FLOP rules
are LLaVA's (module docstring of :mod:`ray_ppu.plan.vision`). And it is transformers' module,
replicated on every TP rank of the first stage (:mod:`ray_ppu.model.qwen_vision`), so neither
its parameters nor its activations are divided by TP. Checked against torch's FLOP counter
and parameter count on transformers' module (tests/test_qwen_vl_plan.py).
"""

from __future__ import annotations

from ray_ppu.config.schema import RunConfig


def component_parameters(cfg: RunConfig) -> dict[str, int]:
    """Parameters of the tower without its merger ("vision") and of the merger ("projector")."""
    v, H = cfg.vision, cfg.model.hidden_size
    h, f, p, t = v.hidden_size, v.ffn_hidden_size, v.patch_size, v.temporal_patch_size
    # qkv 3h² + 3h, proj h² + h; gate / up 2(hf + f), down fh + h; norm1, norm2 2h
    block = (4 * h * h + 4 * h) + (3 * h * f + 2 * f + h) + 2 * h
    tower = 3 * t * p * p * h + v.num_layers * block  # the Conv3d patch embedding: no bias
    m = h * v.spatial_merge_size ** 2  # the merger's width: 2 × 2 patches side by side
    merger = h + (m * m + m) + (m * H + H)  # ln_q, Linear(4h, 4h), Linear(4h, H)
    return {"vision": tower, "projector": merger}


def window_sides(v) -> list[int]:
    """Sides, in patches, of the windows along one side of the nominal image: whole windows
    of window_size pixels from the corner, then the rest (transformers pads the merged grid
    to whole windows and drops the padding): 448 px → [8, 8, 8, 8], 476 px → [8, 8, 8, 8, 2]."""
    merge = v.spatial_merge_size
    grid = v.patches_per_side // merge  # merged tokens per side
    window = max(1, v.window_size // merge // v.patch_size)  # merged tokens per window side
    sides = [window] * (grid // window) + ([grid % window] if grid % window else [])
    return [s * merge for s in sides]


def attention_pairs(cfg: RunConfig) -> int:
    """Query-key pairs of one image summed over the layers: n² in each full-attention layer,
    Σ over windows of (window patches)² in each window layer (n·64 at 112-px windows when the
    side is a multiple of 112)."""
    v = cfg.vision
    n = v.patches
    per_side = sum(s * s for s in window_sides(v))
    windowed = per_side * per_side  # Σ_rows Σ_cols (a·b)² = (Σ a²)(Σ b²)
    full = sum(1 for i in v.full_attention_layers if 0 <= i < v.num_layers)
    return full * n * n + (v.num_layers - full) * windowed


def by_freeze(freeze: list, layers: float, patches: float, projector: float) -> float:
    """FLOPs of an image side from its multiply-adds (encoder layers, patch embedding,
    projector) and what ``vision.freeze`` keeps from training: what trains costs 6 FLOPs per
    multiply-add, but the patch embedding, whose input (the pixels) needs no gradient, 4; a
    frozen encoder runs forward only (2); a frozen projector behind a training encoder still
    passes input gradients back (4)."""
    encoder_trains = "vision" not in freeze
    projector_trains = "projector" not in freeze
    encoder = (6 * layers + 4 * patches) if encoder_trains else 2 * (layers + patches)
    return float(encoder + (6 if projector_trains else 4 if encoder_trains else 2) * projector)


def flops_per_image(cfg: RunConfig) -> float:
    """FLOPs of one nominal image through the tower and the merger, forward and backward as
    far as they train: per layer n·(4h² + 3hf) in its linears, 2·h per query-key pair
    (QKᵀ and AV); the patch Conv3d n·3·t·p²·h; the merger (n / 4)·((4h)² + 4h·H)."""
    v, H = cfg.vision, cfg.model.hidden_size
    h, f, n = v.hidden_size, v.ffn_hidden_size, v.patches
    layers = v.num_layers * n * (4 * h * h + 3 * h * f) + 2 * h * attention_pairs(cfg)
    patches = n * 3 * v.temporal_patch_size * v.patch_size ** 2 * h
    m = h * v.spatial_merge_size ** 2
    merger = v.image_tokens * (m * m + m * H)
    return by_freeze(v.freeze, layers, patches, merger)


def activation_bytes(cfg: RunConfig, micro_batch_size: int, element_bytes: int) -> float:
    """What the image side keeps for backward per microbatch on a first-stage device, one
    nominal image per sample, on every TP rank alike (replicated). A training tower layer
    keeps, per patch, its two RMSNorms' inputs and outputs (4h), the qkv output and the
    rotated q and k that attention reads (5h), the attention output (h), the MLP's gate, up,
    SiLU(gate) and product (4f), and the fp32 softmax statistics of its fused attention (4
    bytes per head); a training merger (or one that passes gradients back to the tower) its
    norm's input and output and its GELU's input and output (4 × 4h per token)."""
    v, e = cfg.vision, element_bytes
    h, f, n = v.hidden_size, v.ffn_hidden_size, v.patches
    tower_trains = "vision" not in v.freeze
    merger_trains = "projector" not in v.freeze
    per_image = 0.0
    if tower_trains:
        layer = n * (e * (10 * h + 4 * f) + 4 * v.num_attention_heads)
        per_image += v.num_layers * layer
    if tower_trains or merger_trains:
        per_image += v.image_tokens * e * 4 * h * v.spatial_merge_size ** 2
    return micro_batch_size * per_image
