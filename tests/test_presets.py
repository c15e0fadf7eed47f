"""Every shipped preset against the numbers published in its Hugging Face config.json."""

import pytest

from ray_ppu.config.presets import PRESETS, VISION_PRESETS
from ray_ppu.config.loader import load
from ray_ppu.plan import build_plan

# (num_hidden_layers, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads,
#  vocab_size, max_position_embeddings, rope_theta, rms_norm_eps, tie_word_embeddings)
PUBLISHED = {
    "0.5B": (24, 896, 4864, 14, 2, 151936, 32768, 1_000_000, 1e-6, True),
    "1.5B": (28, 1536, 8960, 12, 2, 151936, 131072, 1_000_000, 1e-6, True),
    "3B": (36, 2048, 11008, 16, 2, 151936, 32768, 1_000_000, 1e-6, True),
    "7B": (28, 3584, 18944, 28, 4, 152064, 131072, 1_000_000, 1e-6, False),
    "14B": (48, 5120, 13824, 40, 8, 152064, 131072, 1_000_000, 1e-5, False),
    "32B": (64, 5120, 27648, 40, 8, 152064, 131072, 1_000_000, 1e-5, False),
    "72B": (80, 8192, 29568, 64, 8, 152064, 131072, 1_000_000, 1e-5, False),
    "llama3.1-8B": (32, 4096, 14336, 32, 8, 128256, 131072, 500_000, 1e-5, False),
    # meta-llama/Meta-Llama-3-8B: LLaMA-3.1-8B's shape, 8192 positions, no RoPE scaling
    "llama3-8B": (32, 4096, 14336, 32, 8, 128256, 8192, 500_000, 1e-5, False),
    "llama3.1-70B": (80, 8192, 28672, 64, 8, 128256, 131072, 500_000, 1e-5, False),
}

# Qwen3 dense, from Qwen/Qwen3-<size> config.json: (num_hidden_layers, hidden_size,
#  intermediate_size, num_attention_heads, num_key_value_heads, head_dim, vocab_size,
#  max_position_embeddings, rope_theta, rms_norm_eps, tie_word_embeddings); every one has
#  attention_bias false and q_norm / k_norm in its weights
PUBLISHED_QWEN3 = {
    "qwen3-0.6B": (28, 1024, 3072, 16, 8, 128, 151936, 40960, 1_000_000, 1e-6, True),
    "qwen3-1.7B": (28, 2048, 6144, 16, 8, 128, 151936, 40960, 1_000_000, 1e-6, True),
    "qwen3-4B": (36, 2560, 9728, 32, 8, 128, 151936, 40960, 1_000_000, 1e-6, True),
    "qwen3-8B": (36, 4096, 12288, 32, 8, 128, 151936, 40960, 1_000_000, 1e-6, False),
    "qwen3-14B": (40, 5120, 17408, 40, 8, 128, 151936, 40960, 1_000_000, 1e-6, False),
    "qwen3-32B": (64, 5120, 25600, 64, 8, 128, 151936, 40960, 1_000_000, 1e-6, False),
}

# Qwen3-MoE, from Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json (transformers 4.51):
#  (num_hidden_layers, hidden_size, intermediate_size, moe_intermediate_size,
#  num_attention_heads, num_key_value_heads, head_dim, num_experts, num_experts_per_tok,
#  norm_topk_prob, router_aux_loss_coef, tie_word_embeddings); both have vocab 151936, 40960
#  positions, rope_theta 1e6, rms_norm_eps 1e-6, decoder_sparse_step 1, mlp_only_layers []
PUBLISHED_QWEN3_MOE = {
    "qwen3-30B-A3B": (48, 2048, 6144, 768, 32, 4, 128, 128, 8, True, 0.001, False),
    "qwen3-235B-A22B": (94, 4096, 12288, 1536, 64, 4, 128, 128, 8, True, 0.001, False),
}
# Their exact totals (untied embeddings, q / k norms, routers), as keras-hub's Qwen3-MoE presets
# list them, and the model cards' active counts (billions): 30.5B / 3.3B, 235B / 22B
PUBLISHED_MOE_PARAMS = {"qwen3-30B-A3B": (30_532_122_624, 3.3),
                        "qwen3-235B-A22B": (235_093_634_560, 22.0)}

# Parameter counts published on the model cards (billions), as a cross-check of the layout.
PUBLISHED_PARAMS_B = {"0.5B": 0.49, "1.5B": 1.54, "3B": 3.09, "7B": 7.61, "14B": 14.7,
                      "32B": 32.5, "72B": 72.7, "llama3.1-8B": 8.03, "llama3.1-70B": 70.6,
                      "llama3-8B": 8.03,
                      "qwen3-0.6B": 0.6, "qwen3-1.7B": 1.7, "qwen3-4B": 4.0, "qwen3-8B": 8.2,
                      "qwen3-14B": 14.8, "qwen3-32B": 32.8}


def test_every_published_preset_is_covered():
    assert set(PRESETS) - {"tiny", "tiny-moe", *VISION_PRESETS} == (
        set(PUBLISHED) | set(PUBLISHED_QWEN3) | set(PUBLISHED_QWEN3_MOE))
    assert set(PUBLISHED_PARAMS_B) == set(PUBLISHED) | set(PUBLISHED_QWEN3)
    assert set(VISION_PRESETS) - {"tiny-vl", "tiny-qwen-vl"} == (set(PUBLISHED_VISION)
                                                                 | set(PUBLISHED_QWEN_VL))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_matches_config_json(name):
    m = PRESETS[name]
    layers, hidden, ffn, heads, kv, vocab, max_pos, theta, eps, tied = PUBLISHED[name]
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size) == (layers, hidden, ffn)
    assert (m.num_attention_heads, m.num_query_groups) == (heads, kv)
    assert (m.vocab_size, m.max_position_embeddings) == (vocab, max_pos)
    assert m.rotary_base == theta and m.norm_epsilon == eps
    assert m.untie_embeddings_and_output_weights == (not tied)
    is_qwen = not name.startswith("llama")
    assert m.add_qkv_bias == is_qwen  # Qwen2 has QKV bias, LLaMA none
    # LLaMA-3.1 scales RoPE (factor 8), LLaMA-3 and Qwen2.5 do not
    assert m.rope_scaling == name.startswith("llama3.1") and (is_qwen or m.rope_scaling_factor == 8.0)
    assert m.preset == name


# Vision-language presets: (language preset, vision config.json: image_size, patch_size,
#  num_hidden_layers, hidden_size, intermediate_size, num_attention_heads, layer_norm_eps,
#  hidden_act; the LLaVA recipe: vision_feature_layer, image tokens per image)
_SIGLIP_SO400M = (384, 14, 27, 1152, 4304, 16, 1e-6, "gelu_tanh")  # google/siglip-so400m-patch14-384
PUBLISHED_VISION = {
    "bunny-llama3-8b-v": ("llama3-8B", *_SIGLIP_SO400M, -2, 729),  # BAAI/Bunny-Llama-3-8B-V
    "llava-qwen2.5-7b": ("7B", *_SIGLIP_SO400M, -1, 729),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_VISION))
def test_vision_preset_matches_its_parts(name):
    language, size, patch, layers, hidden, ffn, heads, eps, act, feature, tokens = \
        PUBLISHED_VISION[name]
    cfg = load(None, [f"model.preset={name}"])
    v = cfg.vision
    assert cfg.model == PRESETS[language].with_(preset=name)
    assert (v.encoder, v.image_size, v.patch_size, v.num_layers) == ("siglip", size, patch, layers)
    assert (v.hidden_size, v.ffn_hidden_size, v.num_attention_heads) == (hidden, ffn, heads)
    assert (v.norm_epsilon, v.activation, v.feature_layer) == (eps, act, feature)
    assert v.image_tokens == tokens and v.layers_built == layers + 1 + feature
    assert v.image_token_id < cfg.model.vocab_size and not v.problems(8)
    # an explicit vision key overrides the preset's
    assert load(None, [f"model.preset={name}", "vision.freeze=[]"]).vision.freeze == []


def test_text_presets_have_no_vision_part():
    assert not load(None, ["model.preset=7B"]).vision.enabled
    assert load(None, ["model.preset=tiny-vl"]).vision.image_tokens == 16


@pytest.mark.parametrize("name", sorted(PUBLISHED_QWEN3))
def test_qwen3_preset_matches_config_json(name):
    m = PRESETS[name]
    layers, hidden, ffn, heads, kv, head_dim, vocab, max_pos, theta, eps, tied = PUBLISHED_QWEN3[name]
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size) == (layers, hidden, ffn)
    assert (m.num_attention_heads, m.num_query_groups) == (heads, kv)
    assert m.kv_channels == m.effective_kv_channels == head_dim
    assert (m.vocab_size, m.max_position_embeddings) == (vocab, max_pos)
    assert m.rotary_base == theta and m.norm_epsilon == eps
    assert m.untie_embeddings_and_output_weights == (not tied)
    assert m.qk_layernorm and not m.add_qkv_bias and not m.rope_scaling
    assert m.preset == name


@pytest.mark.parametrize("name", sorted(PUBLISHED_QWEN3_MOE))
def test_qwen3_moe_preset_matches_config_json(name):
    m = PRESETS[name]
    (layers, hidden, ffn, moe_ffn, heads, kv, head_dim, experts, topk, norm_topk, aux,
     tied) = PUBLISHED_QWEN3_MOE[name]
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size) == (layers, hidden, ffn)
    assert (m.moe_ffn_hidden_size, m.num_moe_experts, m.moe_router_topk) == (moe_ffn, experts, topk)
    assert m.moe_norm_topk_prob == norm_topk and m.moe_aux_loss_coeff == aux
    assert (m.num_attention_heads, m.num_query_groups, m.kv_channels) == (heads, kv, head_dim)
    assert (m.vocab_size, m.max_position_embeddings, m.rotary_base, m.norm_epsilon) == (
        151936, 40960, 1_000_000, 1e-6)
    assert m.untie_embeddings_and_output_weights == (not tied)
    assert m.qk_layernorm and not m.add_qkv_bias and m.is_moe and m.preset == name


@pytest.mark.parametrize("name", sorted(PUBLISHED_MOE_PARAMS))
def test_moe_preset_total_and_active_parameters(name):
    plan = build_plan(load(None, [f"model.preset={name}", "training.train_iters=1",
                                  "cluster.num_workers=1", "training.global_batch_size=1",
                                  "data.data_path=[x]"]))
    total, active_b = PUBLISHED_MOE_PARAMS[name]
    assert plan.num_parameters == total  # 151936 is a multiple of 128: no vocabulary padding
    assert plan.num_active_parameters / 1e9 == pytest.approx(active_b, rel=0.02)


def test_tiny_moe_preset_is_qwen3_moe_shrunk():
    tiny, big = PRESETS["tiny-moe"], PRESETS["qwen3-30B-A3B"]
    for field in ("vocab_size", "rotary_base", "norm_epsilon", "add_qkv_bias", "qk_layernorm",
                  "moe_norm_topk_prob", "moe_aux_loss_coeff"):
        assert getattr(tiny, field) == getattr(big, field), field
    assert tiny.num_moe_experts % 2 == 0 and tiny.moe_router_topk < tiny.num_moe_experts


def test_qwen3_head_width_is_not_always_hidden_over_heads():
    # what kv_channels is for: 0.6B, 4B and 32B project to more query channels than their
    # hidden size (heads × 128 > hidden); in 1.7B, 8B and 14B the two happen to agree
    apart = {name for name in PUBLISHED_QWEN3
             if PRESETS[name].hidden_size // PRESETS[name].num_attention_heads != 128}
    assert apart == {"qwen3-0.6B", "qwen3-4B", "qwen3-32B"}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS_B))
def test_preset_parameter_count_matches_model_card(name):
    plan = build_plan(load(None, [f"model.preset={name}", "training.train_iters=1",
                                  "cluster.num_workers=1", "training.global_batch_size=1",
                                  "data.data_path=[x]"]))
    # Padded vocabulary adds a little over the card's count; 1.5% covers rounding on the cards.
    assert plan.num_parameters / 1e9 == pytest.approx(PUBLISHED_PARAMS_B[name], rel=0.015)


def test_tiny_preset_has_the_qwen2_5_architecture():
    tiny, small = PRESETS["tiny"], PRESETS["0.5B"]
    assert tiny.vocab_size == small.vocab_size  # trains on real Qwen2 tokens
    for field in ("rotary_base", "norm_epsilon", "add_qkv_bias", "untie_embeddings_and_output_weights"):
        assert getattr(tiny, field) == getattr(small, field), field
    assert tiny.num_attention_heads % tiny.num_query_groups == 0 and tiny.num_query_groups > 1


# Qwen2.5-VL, from Qwen/Qwen2.5-VL-<size>-Instruct config.json: the language model's
#  (num_hidden_layers, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads,
#  vocab_size, rms_norm_eps, tie_word_embeddings) and vision_config's intermediate_size; all
#  have max_position_embeddings 128000, rope_theta 1e6, mrope_section [16, 24, 24], and the
#  same tower: depth 32, hidden_size 1280, num_heads 16, patch 14, merge 2, window 112,
#  fullatt_block_indexes [7, 15, 23, 31], out_hidden_size = the language width
PUBLISHED_QWEN_VL = {
    "qwen2.5-vl-3B": (36, 2048, 11008, 16, 2, 151936, 1e-6, True, 3420),
    "qwen2.5-vl-7B": (28, 3584, 18944, 28, 4, 152064, 1e-6, False, 3420),
    "qwen2.5-vl-72B": (80, 8192, 29568, 64, 8, 152064, 1e-6, False, 3456),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_QWEN_VL))
def test_qwen_vl_preset_matches_config_json(name):
    layers, hidden, ffn, heads, kv, vocab, eps, tied, tower_ffn = PUBLISHED_QWEN_VL[name]
    cfg = load(None, [f"model.preset={name}"])
    m, v = cfg.model, cfg.vision
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size) == (layers, hidden, ffn)
    assert (m.num_attention_heads, m.num_query_groups, m.vocab_size) == (heads, kv, vocab)
    assert (m.norm_epsilon, m.untie_embeddings_and_output_weights) == (eps, not tied)
    assert (m.max_position_embeddings, m.rotary_base, m.mrope_section) == (128000, 1_000_000,
                                                                            [16, 24, 24])
    assert (v.encoder, v.num_layers, v.hidden_size, v.ffn_hidden_size) == ("qwen2.5-vl", 32,
                                                                            1280, tower_ffn)
    assert (v.num_attention_heads, v.patch_size, v.spatial_merge_size, v.window_size) == (
        16, 14, 2, 112)
    assert v.full_attention_layers == [7, 15, 23, 31] and v.activation == "silu"
    assert (v.image_token_id, v.vision_start_token_id) == (151655, 151652)
    assert not v.problems(8) and m.preset == name
    # the plan's nominal 448-pixel image: 32 × 32 patches, merged 2 × 2 into 256 tokens
    assert v.image_tokens == 256


def test_tiny_qwen_vl_mrope_fits_its_heads_and_bad_settings_are_named():
    from ray_ppu.plan.rules import model_problems, vision_problems

    cfg = load(None, ["model.preset=tiny-qwen-vl", "data.dataset=sft"])
    assert 2 * sum(cfg.model.mrope_section) == cfg.model.effective_kv_channels
    assert not model_problems(cfg) and not vision_problems(cfg)
    bad = load(None, ["model.preset=tiny-qwen-vl", "data.dataset=sft",
                      "model.mrope_section=[4,4,4]", "vision.min_pixels=20000"])
    assert model_problems(bad) == ["mrope_section [4, 4, 4] must be three numbers summing to "
                                   "kv_channels / 2 = 8"]
    assert vision_problems(bad) == ["vision.min_pixels=20000 exceeds vision.max_pixels=12544"]
