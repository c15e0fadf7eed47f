"""A vision-language model on Megatron-Core: an image encoder, a projector and a GPTModel.

Megatron-Core's own pieces do the work: ``CLIPViTModel`` (its ``siglip`` and ``clip``
subtypes) encodes the images, ``MultimodalProjector`` maps their patch features to the
language model's width, and the language model is the same ``GPTModel`` a text run builds
(:mod:`ray_ppu.model.gpt`), so every text option (TP, SP, PP, VP, recompute, LoRA, packing)
carries over. Only the glue is ours, and it is why this is not Megatron-Core's
``LLaVAModel``: that model widens each image token into the patch count *inside* the
forward pass, so a row's length depends on its images (fixed-shape microbatches, packing and
pipeline transfers all want one length), and it refuses sequence parallelism without
Transformer Engine's attention. Here the data path expands every image into
:attr:`~ray_ppu.config.vision.VisionConfig.image_tokens` placeholder tokens, as Hugging Face's
LLaVA processor does, so a row is ``seq_length`` tokens like any text row; the forward pass
writes the projected patch features over the placeholders' embeddings in order (Hugging
Face's ``masked_scatter``), then scatters the sequence over TP for SP and runs the decoder.

The encoder and projector live on the first pipeline stage (they feed its embeddings); later
stages hold only their share of the decoder, exactly as for text.

Qwen2.5-VL (``vision.native``) shares the glue but not the encoder: its tower is transformers'
module (:mod:`ray_ppu.model.qwen_vision`, replicated over TP) with its merger as the
projector, each image takes its own number of placeholder tokens, and the GPTModel's RoPE is
M-RoPE, whose [3, b, s] positions come with the data.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from ray_ppu.config.schema import RunConfig
from ray_ppu.config.vision import COMPONENTS, VisionConfig


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation: x·sigmoid(1.702·x)."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATION_FUNCTIONS = {"gelu": F.gelu, "gelu_tanh": partial(F.gelu, approximate="tanh"),
                        "quick_gelu": quick_gelu}


class LayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm built the way Megatron-Core builds norms (``config, hidden_size,
    eps``): the ViT's pre-norm and its layers' norms on the local spec."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)


def local_vit_layer_spec(attention: str = "sdpa") -> ModuleSpec:
    """A ViT layer in plain torch / Megatron-Core layers: pre-norm attention over every patch
    (no mask: Megatron-Core's own local ViT spec asks for a causal one) and a biased GELU MLP.
    Its norms are checkpointed under Transformer Engine's fused names, as the GPT local spec's
    are, so both specs read and write the same keys. ``attention``: the run's kernel
    (:mod:`ray_ppu.plan.kernels`): ``sdpa`` is torch's fused attention, ``local``
    Megatron-Core's reference one."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_layer import (TransformerLayer,
                                                             TransformerLayerSubmodules)

    core_attention = DotProductAttention
    if attention == "sdpa":
        from ray_ppu.model.attention import TorchAttention

        core_attention = TorchAttention
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=LayerNorm,
        self_attention=ModuleSpec(
            module=SelfAttention, params={"attn_mask_type": AttnMaskType.no_mask},
            submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                               core_attention=core_attention,
                                               linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=LayerNorm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                                     "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}))


def projector_spec(te: bool):
    """The projector's two linears (HF LlavaMultiModalProjector: linear → activation →
    linear), column- then row-parallel over TP, as MultimodalProjector takes them."""
    from megatron.core.transformer.mlp import MLPSubmodules

    if te:
        from megatron.core.extensions.transformer_engine import (TEColumnParallelLinear,
                                                                 TERowParallelLinear)
        fc1, fc2 = TEColumnParallelLinear, TERowParallelLinear
    else:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        fc1, fc2 = ColumnParallelLinear, RowParallelLinear
    return MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)


# Settings of the language model's TransformerConfig that do not apply to the encoder and the
# projector: they run unpipelined on the first stage, over whole images (no SP / CP), with
# no recompute or offload, and have no experts.
_LANGUAGE_ONLY = ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                  "sequence_parallel", "context_parallel_size", "recompute_granularity",
                  "recompute_method", "recompute_num_layers", "cpu_offloading",
                  "cpu_offloading_num_layers", "qk_layernorm", "num_moe_experts",
                  "mrope_section")


def _component_settings(language: dict) -> dict:
    """The language settings minus what only the language model has (MoE keys included)."""
    return {k: v for k, v in language.items()
            if k not in _LANGUAGE_ONLY and not k.startswith(("moe_", "expert_"))}


def vision_settings(vision: VisionConfig, language: dict) -> dict:
    """TransformerConfig keywords of the ViT (``language``: the language model's, whose
    precision, TP and kernel switches it shares)."""
    heads = vision.num_attention_heads
    return dict(_component_settings(language),
                num_layers=vision.layers_built, hidden_size=vision.hidden_size,
                ffn_hidden_size=vision.ffn_hidden_size, num_attention_heads=heads,
                num_query_groups=heads, kv_channels=vision.hidden_size // heads,
                normalization="LayerNorm", layernorm_epsilon=vision.norm_epsilon,
                gated_linear_unit=False, add_bias_linear=True, add_qkv_bias=True,
                hidden_dropout=0.0, attention_dropout=0.0,
                apply_query_key_layer_scaling=False,
                # a tower drawn fresh (not loaded): LeCun-normal, as HF's SigLIP / CLIP draw
                # theirs; the language model's small std (0.008) leaves image features ~1e-3
                init_method_std=vision.hidden_size ** -0.5)


def projector_settings(vision: VisionConfig, language: dict) -> dict:
    """TransformerConfig keywords of the projector: vision width → language width → language
    width (HF's linear_1 and linear_2)."""
    hidden = language["hidden_size"]
    return dict(_component_settings(language), num_layers=1, hidden_size=hidden,
                ffn_hidden_size=hidden, num_attention_heads=language["num_attention_heads"],
                gated_linear_unit=False, add_bias_linear=vision.projector_bias,
                init_method_std=vision.hidden_size ** -0.5)  # fan-in of its first linear


class VisionLanguageModel(MegatronModule):
    """An image encoder + projector (first pipeline stage only) + a GPTModel, behind GPTModel's
    forward contract plus ``images``. LLaVA: float pixel values [n_images, 3, H, W] of the
    microbatch's images in the order their placeholder tokens appear (row by row). Qwen2.5-VL
    (``vision.native``): (patches [N, 3·t·p·p], grid_thw [n_images, 3]) in that order, and
    ``position_ids`` are M-RoPE's [3, b, s]; its merger is part of ``vision_model``."""

    def __init__(self, language_model, vision: VisionConfig, vision_model=None,
                 vision_projection=None) -> None:
        super().__init__(config=language_model.config)
        self.language_model = language_model
        self.pre_process, self.post_process = language_model.pre_process, language_model.post_process
        self.model_type = language_model.model_type  # what Megatron's schedules look up
        self.share_embeddings_and_output_weights = language_model.share_embeddings_and_output_weights
        self.image_token_id = vision.image_token_id
        self.native = vision.native
        self.drop_class_token = vision.class_token and vision.feature_select == "default"
        self.vision_model, self.vision_projection = vision_model, vision_projection

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self):
        return self.language_model.shared_embedding_or_output_weight()

    def image_features(self, images) -> torch.Tensor:
        """Projected image tokens [Σ tokens of the images, language hidden], image by image."""
        if self.native:
            return self.vision_model(*images)
        weight = self.vision_model.conv1.weight
        features = self.vision_model(images.to(weight.dtype))  # [n, patches (+class), h_vision]
        if self.drop_class_token:
            features = features[:, self.vision_model.class_token_len:]
        features = self.vision_projection(features)
        return features.reshape(-1, features.shape[-1])

    @staticmethod
    def _count(images) -> int:
        return int(images[1].shape[0]) if isinstance(images, tuple) else int(images.shape[0])

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
              images: Optional[torch.Tensor], image_positions: Optional[int] = None
              ) -> torch.Tensor:
        """The decoder's input [s, b, h] (this rank's sequence share under SP): token
        embeddings with each image's features written over its placeholder tokens (those
        among the first ``image_positions`` positions if given: a generated image token is a
        plain token, as in transformers' cached decoding)."""
        embeddings = self.language_model.embedding(input_ids=input_ids, position_ids=position_ids)
        placeholders = input_ids == self.image_token_id  # [b, s]
        if image_positions is not None:
            placeholders[:, image_positions:] = False
        if images is not None and self._count(images):
            features = self.image_features(images)
            n_features, n_places = features.shape[0], int(placeholders.sum())
            if n_features != n_places:
                raise ValueError(f"the microbatch has {n_places} image tokens (id "
                                 f"{self.image_token_id}) but its {self._count(images)} images "
                                 f"give {n_features} features")
            # row by row, as the data path lays the images out ([b, s] order, HF's)
            by_row = embeddings.transpose(0, 1)
            by_row = by_row.masked_scatter(placeholders[..., None], features.to(by_row.dtype))
            embeddings = by_row.transpose(0, 1).contiguous()
        elif bool(placeholders.any()):
            raise ValueError(f"the microbatch has {int(placeholders.sum())} image tokens (id "
                             f"{self.image_token_id}) and no images")
        if self.config.sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
        return embeddings

    def forward(self, input_ids, position_ids, attention_mask, labels=None, images=None,
                packed_seq_params=None, image_positions=None, **kwargs):
        decoder_input = (self.embed(input_ids, position_ids, images, image_positions)
                         if self.pre_process else None)
        return self.language_model(input_ids, position_ids, attention_mask,
                                   decoder_input=decoder_input, labels=labels,
                                   packed_seq_params=packed_seq_params, **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        state = self.language_model.sharded_state_dict(f"{prefix}language_model.",
                                                        sharded_offsets, metadata)
        for name in ("vision_model", "vision_projection"):
            module = getattr(self, name)
            if module is not None:
                state.update(module.sharded_state_dict(f"{prefix}{name}.", sharded_offsets,
                                                       metadata))
        return state


def _component_parameters(model: VisionLanguageModel, name: str) -> list:
    """The parameters of one ``vision.freeze`` component on this stage (none: not here)."""
    if name == "language":
        return list(model.language_model.parameters())
    if model.vision_model is None:
        return []
    if model.native:  # Qwen2.5-VL: the projector is the tower's patch merger
        tower = model.vision_model
        return tower.encoder_parameters() if name == "vision" else tower.merger_parameters()
    module = model.vision_model if name == "vision" else model.vision_projection
    return list(module.parameters())


def freeze(model: VisionLanguageModel, cfg: RunConfig) -> None:
    """``vision.freeze``'s components stop training. The language model under LoRA is left to
    the adapters' own freezing (its base is frozen, its adapters train)."""
    for name in cfg.vision.freeze:
        if name in COMPONENTS and not (name == "language" and cfg.lora.enabled):
            for param in _component_parameters(model, name):
                param.requires_grad = False


def _llava_components(vision: VisionConfig, language_settings: dict, attention: str,
                      use_cpu_initialization: bool) -> tuple:
    """LLaVA's ViT (Megatron-Core's CLIPViTModel) and its MLP projector."""
    def config(settings: dict, activation: str) -> TransformerConfig:
        # the language settings it derives from already hold torch dtypes (gpt._settings)
        return TransformerConfig(**settings, activation_func=ACTIVATION_FUNCTIONS[activation],
                                 use_cpu_initialization=use_cpu_initialization)

    te = attention == "te"
    if te:
        from megatron.core.models.vision.vit_layer_specs import (
            get_vit_layer_with_transformer_engine_spec,
        )
        layer_spec = get_vit_layer_with_transformer_engine_spec()
    else:
        layer_spec = local_vit_layer_spec(attention)
    clip = vision.encoder == "clip"
    # the side the patches cover: CLIPViTModel wants a multiple of the patch, and its
    # unpadded patch convolution ignores the rest of a larger image, as HF's does
    covered = vision.patches_per_side * vision.patch_size
    encoder = CLIPViTModel(
        config(vision_settings(vision, language_settings), vision.activation), layer_spec,
        ln_pre_impl=LayerNorm, ln_post_impl=LayerNorm, add_class_token=clip,
        class_token_len=int(clip), patch_dim=vision.patch_size, img_h=covered, img_w=covered,
        model_subtype=vision.encoder)
    # LLaVA reads a hidden state, never the post-norm's output (SigLIP's ln_post)
    encoder.ln_post = None
    projector = MultimodalProjector(
        config(projector_settings(vision, language_settings), vision.projector_activation),
        projector_spec(te), "mlp", vision.hidden_size)
    return encoder, projector


def _qwen_tower(vision: VisionConfig, language_settings: dict, attention: str,
                use_cpu_initialization: bool):
    """Qwen2.5-VL's tower (transformers' module, replicated over TP), equal on every TP rank;
    its window attention by :func:`ray_ppu.model.attention.packed_attention` unless the run
    asks for the reference (``local``) kernels."""
    from ray_ppu.model.qwen_vision import QwenVisionTower, broadcast_over_tensor_parallel

    config = TransformerConfig(**_component_settings(language_settings),
                               use_cpu_initialization=use_cpu_initialization)
    tower = QwenVisionTower(config, vision, language_settings["hidden_size"],
                            packed=attention != "local")
    broadcast_over_tensor_parallel(tower)
    return tower


def build(cfg: RunConfig, language_model, language_settings: dict, kernels,
          use_cpu_initialization: bool) -> VisionLanguageModel:
    """The vision-language model around ``language_model`` (built with
    ``scatter_embedding_sequence_parallel=False``: the images go in before the scatter); the
    image side only on the first pipeline stage, with the run's attention ``kernels``
    (:class:`ray_ppu.plan.kernels.Kernels`)."""
    vision = cfg.vision
    encoder = projector = None
    if language_model.pre_process and vision.native:
        encoder = _qwen_tower(vision, language_settings, kernels.attention,
                              use_cpu_initialization)
    elif language_model.pre_process:
        encoder, projector = _llava_components(vision, language_settings, kernels.attention,
                                               use_cpu_initialization)
    model = VisionLanguageModel(language_model, vision, encoder, projector)
    freeze(model, cfg)
    return model
