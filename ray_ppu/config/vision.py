"""The ``vision`` section: the image encoder and projector of a vision-language model.

Two families. LLaVA's recipe: a ViT (SigLIP or CLIP) turns each fixed-size image into patch
features, a two-layer MLP projects them to the language model's width, and those vectors take
the places of the image tokens in the text; the language model is any dense ``model`` preset.
Qwen2.5-VL (``encoder: qwen2.5-vl``): a ViT that takes each image at its native resolution
(a multiple of 28 pixels per side, between ``min_pixels`` and ``max_pixels``), attends within
windows of ``window_size`` pixels except in ``full_attention_layers``, and merges each 2 × 2
patches into one token (its merger is the projector); the language model is Qwen2.5 with
multimodal RoPE (``model.mrope_section``). Its own section, beside ``model`` (the language model, unchanged), because
the plan, the model build, the data path (how many tokens an image becomes, how its pixels are
prepared) and the Hugging Face mapping all read it, and a text run has none of it
(``encoder: null``).

Field names follow Hugging Face's ``vision_config`` where Megatron-Core has no name of its own
(``feature_layer`` is LLaVA's ``vision_feature_layer``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

# The parts of a vision-language model a run can freeze (vision.freeze).
COMPONENTS = ("vision", "projector", "language")
ENCODERS = ("siglip", "clip", "qwen2.5-vl")
# HF hidden_act of each encoder family → ours: SigLIP's tanh-approximated GELU, CLIP's
# x·sigmoid(1.702·x), the exact GELU.
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "quick_gelu": "quick_gelu", "gelu": "gelu",
               "silu": "silu"}


@dataclass(frozen=True)
class VisionConfig:
    """The image side of a LLaVA-architecture model; ``encoder`` None: a text-only model."""

    encoder: Optional[Literal["siglip", "clip", "qwen2.5-vl"]] = None
    """ViT family: ``siglip`` (no class token, a patch-embedding bias, images resized to the
    square), ``clip`` (a class token, a pre-norm, the short side resized then centre-cropped)
    or ``qwen2.5-vl`` (native resolution, window attention, 2 × 2 patch merger); None = no
    vision part (a text model)."""
    image_size: int = 384
    """Side of the square image the ViT takes, in pixels (HF: image_size). Qwen2.5-VL takes
    every image at its own size: there it is the side of the image the plan counts FLOPs and
    memory for (a multiple of 28). [≥ 1]"""
    patch_size: int = 14
    """Side of one patch (HF: patch_size). Patches tile the image from its corner and a rest
    narrower than a patch is not seen, as HF's unpadded patch convolution does (SigLIP-so400m:
    27 patches of 14 over 384 pixels, the last 6 unused). [≥ 1]"""
    num_layers: int = 27
    """ViT layers in the checkpoint (HF: num_hidden_layers); those after feature_layer are not
    built. [≥ 1]"""
    hidden_size: int = 1152
    """ViT width (HF: hidden_size). [≥ 1]"""
    ffn_hidden_size: int = 4304
    """ViT MLP width (HF: intermediate_size). [≥ 1]"""
    num_attention_heads: int = 16
    """ViT attention heads (HF: num_attention_heads); divisible by TP. [≥ 1]"""
    norm_epsilon: float = 1e-6
    """LayerNorm epsilon (HF: layer_norm_eps; SigLIP 1e-6, CLIP 1e-5). [> 0]"""
    activation: Literal["gelu_tanh", "quick_gelu", "gelu", "silu"] = "gelu_tanh"
    """ViT MLP activation (HF hidden_act gelu_pytorch_tanh, quick_gelu, gelu; Qwen2.5-VL's
    gated MLP: silu)."""
    feature_layer: int = -1
    """Which ViT hidden state feeds the projector (HF LLaVA: vision_feature_layer): -1 the last
    layer's output, -2 the penultimate's (LLaVA-1.5); k ≥ 1 the output of layer k. Never the
    post-norm's output: LLaVA reads hidden states, SigLIP's post_layernorm comes after them."""
    feature_select: Literal["full", "default"] = "full"
    """HF vision_feature_select_strategy: ``default`` drops CLIP's class token, ``full`` keeps
    every position (SigLIP has no class token: full)."""
    projector_activation: Literal["gelu", "gelu_tanh", "quick_gelu"] = "gelu"
    """Activation between the projector's two linears (HF projector_hidden_act)."""
    projector_bias: bool = True
    """Biases on the projector's linears (HF multimodal_projector_bias)."""
    image_token_id: int = 151_655
    """Token id an image position carries in the text (HF image_token_id); each image becomes
    :attr:`image_tokens` of them. Qwen2.5's <|image_pad|> by default. [≥ 0]"""
    spatial_merge_size: int = 2
    """Qwen2.5-VL: patches merged into one token along each side (HF spatial_merge_size), so an
    image of h × w patches takes h·w / merge² tokens. [≥ 1]"""
    temporal_patch_size: int = 2
    """Qwen2.5-VL: frames per patch (HF temporal_patch_size); a still image is repeated to fill
    them. [≥ 1]"""
    window_size: int = 112
    """Qwen2.5-VL: side of an attention window in pixels (HF window_size). [≥ 1]"""
    full_attention_layers: list[int] = field(default_factory=lambda: [7, 15, 23, 31])
    """Qwen2.5-VL: ViT layers (0-based) attending over the whole image instead of windows (HF
    fullatt_block_indexes); each below num_layers. [≥ 0]"""
    min_pixels: int = 56 * 56
    """Qwen2.5-VL: fewest pixels an image is resized to (HF processor min_pixels). [≥ 1]"""
    max_pixels: int = 28 * 28 * 1280
    """Qwen2.5-VL: most pixels an image is resized to (HF processor max_pixels; 1280 tokens);
    not below min_pixels. [≥ 1]"""
    vision_start_token_id: int = 151_652
    """Qwen2.5-VL: <|vision_start|>, the token before each image's pads. [≥ 0]"""
    freeze: list[str] = field(default_factory=lambda: ["vision"])
    """Components that do not train (no gradients, no optimizer state): any of vision,
    projector, language. LLaVA / Bunny stage 1 (projector pre-training): [vision, language];
    stage 2: [vision]; with lora.enabled the language model's adapters train whether or not
    it is named. Unset on a Qwen2.5-VL LoRA run: [vision, projector] (the adapters alone
    train, as the seed's Qwen-VL LoRA recipe and PEFT train them)."""

    @property
    def enabled(self) -> bool:
        """Whether the model has a vision part."""
        return self.encoder is not None

    @property
    def native(self) -> bool:
        """Images at their own resolution (Qwen2.5-VL), not resized to one square."""
        return self.encoder == "qwen2.5-vl"

    @property
    def class_token(self) -> bool:
        """Whether the ViT prepends a class token (CLIP)."""
        return self.encoder == "clip"

    @property
    def patches_per_side(self) -> int:
        """Whole patches along an image side: ⌊image_size / patch_size⌋."""
        return self.image_size // self.patch_size

    @property
    def patches(self) -> int:
        """Patches per image: patches_per_side²."""
        return self.patches_per_side ** 2

    @property
    def image_tokens(self) -> int:
        """Positions an image takes in the text: its patches, plus CLIP's class token when
        feature_select keeps it."""
        if self.native:  # the plan's image: its patches after the merge
            return self.patches // self.spatial_merge_size ** 2
        keep_class = self.class_token and self.feature_select == "full"
        return self.patches + int(keep_class)

    @property
    def layers_built(self) -> int:
        """ViT layers the model runs: up to feature_layer (LLaVA never uses the rest)."""
        if self.feature_layer < 0:
            return self.num_layers + 1 + self.feature_layer
        return self.feature_layer

    def problems(self, tensor_model_parallel_size: int = 1) -> list[str]:
        """Every inconsistency, one line each with its numbers (empty: fine)."""
        if not self.enabled:
            return []
        out = []
        if self.patch_size > self.image_size:
            out.append(f"vision.patch_size={self.patch_size} exceeds "
                       f"vision.image_size={self.image_size}")
        if not 1 <= self.layers_built <= self.num_layers:
            out.append(f"vision.feature_layer={self.feature_layer} selects no layer of "
                       f"vision.num_layers={self.num_layers} (-{self.num_layers} … -1 or "
                       f"1 … {self.num_layers})")
        if self.hidden_size % self.num_attention_heads:
            out.append(f"vision.hidden_size={self.hidden_size} is not divisible by "
                       f"vision.num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % tensor_model_parallel_size:
            out.append(f"vision.num_attention_heads={self.num_attention_heads} is not divisible "
                       f"by parallel.tensor_model_parallel_size={tensor_model_parallel_size}")
        if self.native:
            out += self._native_problems()
        if self.feature_select == "default" and not self.class_token:
            out.append(f"vision.feature_select=default drops a class token {self.encoder} does "
                       f"not have: use full")
        unknown = [c for c in self.freeze if c not in COMPONENTS]
        if unknown:
            out.append(f"vision.freeze={self.freeze}: {', '.join(unknown)} is not one of "
                       f"{', '.join(COMPONENTS)}")
        return out

    def _native_problems(self) -> list[str]:
        factor = self.patch_size * self.spatial_merge_size  # pixels per merged token's side
        out = []
        if self.min_pixels > self.max_pixels:
            out.append(f"vision.min_pixels={self.min_pixels} exceeds "
                       f"vision.max_pixels={self.max_pixels}")
        if self.image_size % factor:
            out.append(f"vision.image_size={self.image_size} is not a multiple of "
                       f"{factor} (patch_size × spatial_merge_size)")
        outside = [i for i in self.full_attention_layers if not 0 <= i < self.num_layers]
        if outside:
            out.append(f"vision.full_attention_layers {outside} are not layers of "
                       f"vision.num_layers={self.num_layers} (0 … {self.num_layers - 1})")
        return out

    def with_(self, **changes) -> "VisionConfig":
        return dataclasses.replace(self, **changes)
