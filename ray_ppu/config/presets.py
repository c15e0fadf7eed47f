"""Model presets: the architecture numbers of published checkpoints, as data.

Each entry copies the Hugging Face ``config.json`` named in its comment; field names are
Megatron-Core's (``TransformerConfig`` / ``GPTModel``). HF → Megatron mapping:
num_hidden_layers → num_layers, intermediate_size → ffn_hidden_size,
num_key_value_heads → num_query_groups, rope_theta → rotary_base, rms_norm_eps → norm_epsilon,
tie_word_embeddings → not untie_embeddings_and_output_weights. Qwen2 adds a bias to Q, K and V
only (add_qkv_bias); LLaMA-3.1 uses no bias and "llama3" RoPE scaling with factor 8. Qwen3
drops the bias, norms each query and key head (q_norm / k_norm → qk_layernorm) and gives the
head width explicitly (head_dim → kv_channels: 128 at every size, not hidden / heads for
0.6B, 4B and 32B). Qwen3-MoE routes every layer's tokens to experts: num_experts →
num_moe_experts, num_experts_per_tok → moe_router_topk, moe_intermediate_size →
moe_ffn_hidden_size, norm_topk_prob → moe_norm_topk_prob, router_aux_loss_coef →
moe_aux_loss_coeff.

Vision-language presets (:data:`VISION_PRESETS`) pair a language preset with a ``vision``
section (:class:`~ray_ppu.config.vision.VisionConfig`), from the vision tower's config.json and
the LLaVA recipe's feature layer; ``model.preset`` names them like any other preset.
"""

from __future__ import annotations

from ray_ppu.config.schema import ModelConfig
from ray_ppu.config.vision import VisionConfig


def _qwen2_5(**arch) -> ModelConfig:
    # Shared by every Qwen2.5 dense checkpoint: SwiGLU, RMSNorm, RoPE base 1e6, QKV bias.
    return ModelConfig(rotary_base=1_000_000, norm_epsilon=1e-6, add_qkv_bias=True, **arch)


def _qwen3(**arch) -> ModelConfig:
    # Shared by every Qwen3 dense checkpoint: head_dim 128, q / k norms, no bias, RoPE base 1e6,
    # the Qwen2 vocabulary, 40960 positions.
    return ModelConfig(rotary_base=1_000_000, norm_epsilon=1e-6, add_qkv_bias=False,
                       qk_layernorm=True, kv_channels=128, vocab_size=151_936,
                       max_position_embeddings=40_960, **arch)


def _qwen3_moe(**arch) -> ModelConfig:
    # Shared by both Qwen3-MoE checkpoints: Qwen3's attention, 128 experts of which each token
    # uses 8 (renormalised), every layer sparse, load-balancing loss weight 0.001, untied.
    return _qwen3(num_moe_experts=128, moe_router_topk=8, moe_norm_topk_prob=True,
                  moe_aux_loss_coeff=0.001, untie_embeddings_and_output_weights=True, **arch)


def _llama3_1(**arch) -> ModelConfig:
    # Shared by LLaMA-3.1: RoPE base 5e5 with llama3 scaling (factor 8), no biases, untied.
    return ModelConfig(
        rotary_base=500_000,
        rope_scaling=True,
        rope_scaling_factor=8.0,
        norm_epsilon=1e-5,
        add_qkv_bias=False,
        vocab_size=128_256,
        max_position_embeddings=131_072,
        untie_embeddings_and_output_weights=True,
        **arch,
    )


_PRESETS: dict[str, ModelConfig] = {
    # Qwen/Qwen2.5-0.5B config.json
    "0.5B": _qwen2_5(num_layers=24, hidden_size=896, ffn_hidden_size=4864,
                     num_attention_heads=14, num_query_groups=2, vocab_size=151_936,
                     max_position_embeddings=32_768, untie_embeddings_and_output_weights=False),
    # Qwen/Qwen2.5-1.5B config.json
    "1.5B": _qwen2_5(num_layers=28, hidden_size=1536, ffn_hidden_size=8960,
                     num_attention_heads=12, num_query_groups=2, vocab_size=151_936,
                     max_position_embeddings=131_072, untie_embeddings_and_output_weights=False),
    # Qwen/Qwen2.5-3B config.json
    "3B": _qwen2_5(num_layers=36, hidden_size=2048, ffn_hidden_size=11008,
                   num_attention_heads=16, num_query_groups=2, vocab_size=151_936,
                   max_position_embeddings=32_768, untie_embeddings_and_output_weights=False),
    # Qwen/Qwen2.5-7B config.json
    "7B": _qwen2_5(num_layers=28, hidden_size=3584, ffn_hidden_size=18944,
                   num_attention_heads=28, num_query_groups=4, vocab_size=152_064,
                   max_position_embeddings=131_072, untie_embeddings_and_output_weights=True),
    # Qwen/Qwen2.5-14B config.json (rms_norm_eps 1e-5 from 14B up)
    "14B": _qwen2_5(num_layers=48, hidden_size=5120, ffn_hidden_size=13824,
                    num_attention_heads=40, num_query_groups=8, vocab_size=152_064,
                    max_position_embeddings=131_072, untie_embeddings_and_output_weights=True)
    .with_(norm_epsilon=1e-5),
    # Qwen/Qwen2.5-32B config.json
    "32B": _qwen2_5(num_layers=64, hidden_size=5120, ffn_hidden_size=27648,
                    num_attention_heads=40, num_query_groups=8, vocab_size=152_064,
                    max_position_embeddings=131_072, untie_embeddings_and_output_weights=True)
    .with_(norm_epsilon=1e-5),
    # Qwen/Qwen2.5-72B config.json
    "72B": _qwen2_5(num_layers=80, hidden_size=8192, ffn_hidden_size=29568,
                    num_attention_heads=64, num_query_groups=8, vocab_size=152_064,
                    max_position_embeddings=131_072, untie_embeddings_and_output_weights=True)
    .with_(norm_epsilon=1e-5),
    # meta-llama/Meta-Llama-3-8B config.json (LLaMA-3: no RoPE scaling, 8192 positions)
    "llama3-8B": _llama3_1(num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                           num_attention_heads=32, num_query_groups=8)
    .with_(rope_scaling=False, max_position_embeddings=8192),
    # Qwen/Qwen3-0.6B config.json
    "qwen3-0.6B": _qwen3(num_layers=28, hidden_size=1024, ffn_hidden_size=3072,
                         num_attention_heads=16, num_query_groups=8,
                         untie_embeddings_and_output_weights=False),
    # Qwen/Qwen3-1.7B config.json
    "qwen3-1.7B": _qwen3(num_layers=28, hidden_size=2048, ffn_hidden_size=6144,
                         num_attention_heads=16, num_query_groups=8,
                         untie_embeddings_and_output_weights=False),
    # Qwen/Qwen3-4B config.json
    "qwen3-4B": _qwen3(num_layers=36, hidden_size=2560, ffn_hidden_size=9728,
                       num_attention_heads=32, num_query_groups=8,
                       untie_embeddings_and_output_weights=False),
    # Qwen/Qwen3-8B config.json
    "qwen3-8B": _qwen3(num_layers=36, hidden_size=4096, ffn_hidden_size=12288,
                       num_attention_heads=32, num_query_groups=8,
                       untie_embeddings_and_output_weights=True),
    # Qwen/Qwen3-14B config.json
    "qwen3-14B": _qwen3(num_layers=40, hidden_size=5120, ffn_hidden_size=17408,
                        num_attention_heads=40, num_query_groups=8,
                        untie_embeddings_and_output_weights=True),
    # Qwen/Qwen3-32B config.json
    "qwen3-32B": _qwen3(num_layers=64, hidden_size=5120, ffn_hidden_size=25600,
                        num_attention_heads=64, num_query_groups=8,
                        untie_embeddings_and_output_weights=True),
    # Qwen/Qwen3-30B-A3B config.json (intermediate_size: the dense MLP no layer has)
    "qwen3-30B-A3B": _qwen3_moe(num_layers=48, hidden_size=2048, ffn_hidden_size=6144,
                                moe_ffn_hidden_size=768, num_attention_heads=32,
                                num_query_groups=4),
    # Qwen/Qwen3-235B-A22B config.json
    "qwen3-235B-A22B": _qwen3_moe(num_layers=94, hidden_size=4096, ffn_hidden_size=12288,
                                  moe_ffn_hidden_size=1536, num_attention_heads=64,
                                  num_query_groups=4),
    # meta-llama/Llama-3.1-8B config.json
    "llama3.1-8B": _llama3_1(num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                             num_attention_heads=32, num_query_groups=8),
    # meta-llama/Llama-3.1-70B config.json
    "llama3.1-70B": _llama3_1(num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                              num_attention_heads=64, num_query_groups=8),
    # Not a published checkpoint: the Qwen2.5 architecture (GQA, QKV bias, SwiGLU, RMSNorm,
    # tied embeddings, the Qwen2 vocabulary) shrunk so a CPU trains it in seconds.
    "tiny": _qwen2_5(num_layers=2, hidden_size=64, ffn_hidden_size=176,
                     num_attention_heads=4, num_query_groups=2, vocab_size=151_936,
                     max_position_embeddings=32_768, untie_embeddings_and_output_weights=False),
    # Not a published checkpoint: Qwen3-MoE's architecture (q / k norms, no bias, every layer
    # routed, top-2 of 4 renormalised, an aux loss) at the tiny preset's width, for CPU runs of
    # expert parallelism (EP 2 or 4 divides the 4 experts).
    "tiny-moe": ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176,
                            num_attention_heads=4, num_query_groups=2, vocab_size=151_936,
                            rotary_base=1_000_000, norm_epsilon=1e-6, add_qkv_bias=False,
                            qk_layernorm=True, num_moe_experts=4, moe_router_topk=2,
                            moe_ffn_hidden_size=64, moe_aux_loss_coeff=0.001),
}



def _siglip_so400m(**recipe) -> VisionConfig:
    # google/siglip-so400m-patch14-384 config.json (vision_config): 27 layers of width 1152,
    # MLP 4304, 16 heads, 14-pixel patches of a 384-pixel image (27² = 729 patches).
    return VisionConfig(encoder="siglip", image_size=384, patch_size=14, num_layers=27,
                        hidden_size=1152, ffn_hidden_size=4304, num_attention_heads=16,
                        norm_epsilon=1e-6, activation="gelu_tanh", feature_select="full",
                        projector_activation="gelu", **recipe)


def _qwen2_5_vl_tower(**arch) -> VisionConfig:
    # Qwen/Qwen2.5-VL-*-Instruct config.json (vision_config): 32 layers of width 1280, 16
    # heads, 14-pixel patches merged 2 × 2, 112-pixel windows except layers 7, 15, 23, 31;
    # the processor's 56² … 28²·1280 pixels; <|image_pad|> 151655, <|vision_start|> 151652.
    return VisionConfig(encoder="qwen2.5-vl", image_size=448, patch_size=14, num_layers=32,
                        hidden_size=1280, num_attention_heads=16, activation="silu",
                        spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                        full_attention_layers=[7, 15, 23, 31], image_token_id=151_655,
                        vision_start_token_id=151_652, **arch)


# Qwen2.5-VL's language models: Qwen2.5 with M-RoPE sections [16, 24, 24] of the 128-wide
# heads and 128000 positions (Qwen/Qwen2.5-VL-*-Instruct config.json, top level)
_QWEN_VL_TEXT = dict(mrope_section=[16, 24, 24], max_position_embeddings=128_000)


# name → (language preset, or a language model of its own, vision section)
VISION_PRESETS: dict[str, tuple[str, VisionConfig]] = {
    # BAAI/Bunny-Llama-3-8B-V: SigLIP-so400m (its SigLIP tower drops the last encoder layer
    # and reads the rest's output: HF vision_feature_layer -2) + an mlp2x_gelu projector +
    # Meta-Llama-3-8B(-Instruct); images at LLaMA-3's <|reserved_special_token_0|> (128002).
    "bunny-llama3-8b-v": ("llama3-8B", _siglip_so400m(feature_layer=-2, image_token_id=128_002)),
    # SigLIP-so400m + Qwen2.5-7B, as LLaVA-OneVision pairs them (last layer, every patch);
    # images at Qwen2.5's <|image_pad|> (151655).
    "llava-qwen2.5-7b": ("7B", _siglip_so400m(feature_layer=-1, image_token_id=151_655)),
    # Not a published checkpoint: a SigLIP-style ViT (32-pixel images, 8-pixel patches: 16
    # image tokens) on the tiny language preset, so a CPU trains both stages in minutes.
    "tiny-vl": ("tiny", VisionConfig(encoder="siglip", image_size=32, patch_size=8,
                                     num_layers=2, hidden_size=32, ffn_hidden_size=64,
                                     num_attention_heads=2, feature_layer=-1,
                                     image_token_id=151_655)),
    # Qwen/Qwen2.5-VL-3B-Instruct: the tower (MLP 3420) + Qwen2.5-3B's shape, tied embeddings
    "qwen2.5-vl-3B": (_PRESETS["3B"].with_(**_QWEN_VL_TEXT),
                      _qwen2_5_vl_tower(ffn_hidden_size=3420)),
    # Qwen/Qwen2.5-VL-7B-Instruct: the tower (MLP 3420) + Qwen2.5-7B's shape, untied
    "qwen2.5-vl-7B": (_PRESETS["7B"].with_(**_QWEN_VL_TEXT),
                      _qwen2_5_vl_tower(ffn_hidden_size=3420)),
    # Qwen/Qwen2.5-VL-72B-Instruct: the tower with MLP 3456 + Qwen2.5-72B's shape (eps 1e-6)
    "qwen2.5-vl-72B": (_PRESETS["72B"].with_(norm_epsilon=1e-6, **_QWEN_VL_TEXT),
                       _qwen2_5_vl_tower(ffn_hidden_size=3456)),
    # Not a published checkpoint: Qwen2.5-VL's architecture (4 tower layers, windows of 56
    # pixels, whole-image attention in layers 1 and 3; images of 56² … 112² pixels: 4 … 16
    # tokens) on the tiny language preset with M-RoPE, so a CPU trains it in minutes.
    # (tiny's 16-wide heads: 8 frequency pairs, split 2 / 3 / 3 as 16 / 24 / 24 of 64)
    "tiny-qwen-vl": (_PRESETS["tiny"].with_(mrope_section=[2, 3, 3]), VisionConfig(
        encoder="qwen2.5-vl", image_size=112, patch_size=14, num_layers=4, hidden_size=32,
        ffn_hidden_size=48, num_attention_heads=2, activation="silu", window_size=56,
        full_attention_layers=[1, 3], min_pixels=56 * 56, max_pixels=112 * 112,
        image_token_id=151_655, vision_start_token_id=151_652)),
}

PRESETS: dict[str, ModelConfig] = {name: arch.with_(preset=name) for name, arch in _PRESETS.items()}
PRESETS.update({name: (PRESETS[language] if isinstance(language, str) else language)
                .with_(preset=name) for name, (language, _) in VISION_PRESETS.items()})
