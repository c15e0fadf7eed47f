"""Hugging Face checkpoints in and out: transformers' own Qwen2 / Qwen3 / LLaMA models are the
reference.

Small random models are built offline from config objects (no hub) and saved with
``save_pretrained``: a Qwen2 with GQA (2 KV groups), QKV bias and tied embeddings in several
shards; a Qwen2 with one KV group in one file; a LLaMA-3.1 with llama3 RoPE scaling and an
untied output layer; a Qwen3 with q / k norms, tied embeddings and head_dim 32, not hidden /
heads = 16 (so kv_channels is what sizes the projections). Their vocabulary (1000) is not a
multiple of 128, so Megatron pads it. Norms and biases are drawn at random too: a mapping that
mixed them up would show.

One torchrun launch of two CPU ranks (this file's ``__main__``) loads every model at every
layout and writes the logits, and converts three of them to torch_dist at TP 2; the tests compare
with transformers' logits, export the conversions back, decode with ``generate.py``, and
fine-tune from a Hugging Face directory under Ray Train.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, ByteTokenizer, launch_torchrun
from ray_ppu.util.net import free_port
from ray_ppu.config.loader import ConfigError, load
from ray_ppu.config.presets import PRESETS

PROMPT = [5, 17, 300, 999, 42, 7, 8, 9, 123, 456, 2, 0]
SMALL = dict(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
             num_attention_heads=4, rms_norm_eps=1e-6)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# (model, TP, PP, layers per virtual stage[, EP, ETP]): what the torchrun launch runs; DP makes
# up 2 ranks. Qwen3-MoE: its experts split by EP 2, and EP 2 with attention at TP 2 (each
# expert whole: ETP 1); at TP 2 alone its experts are split by ETP 2 (ETP defaults to TP).
LAYOUTS = {
    "qwen_gqa": [(1, 1, None), (2, 1, None), (1, 2, None), (1, 2, 1)],
    "qwen_one_kv_group": [(1, 1, None), (1, 2, None)],  # one KV group cannot be split over TP
    "llama": [(1, 1, None), (2, 1, None), (1, 2, None)],
    "qwen3": [(1, 1, None), (2, 1, None), (1, 2, None)],
    "qwen3_moe": [(1, 1, None), (2, 1, None), (1, 2, None), (1, 1, None, 2, 1),
                  (2, 1, None, 2, 1)],
}
# converted to torch_dist at TP 2 in the same launch
CONVERTED = ("qwen_gqa", "llama", "qwen3", "qwen3_moe")


def layout_name(kind: str, layout: tuple) -> str:
    tp, pp, vs, *experts = layout
    return f"{kind}_tp{tp}_pp{pp}_vs{vs}" + ("_ep{}_etp{}".format(*experts) if experts else "")


def _hf_model(kind: str, **overrides):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    torch.manual_seed(0)
    if kind == "qwen3_moe":
        # 4 experts of width 48 (≠ intermediate_size), top 2 renormalised, untied output
        config = Qwen3MoeConfig(**{**SMALL, "num_key_value_heads": 2, "head_dim": 32,
                                   "num_experts": 4, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 48, "norm_topk_prob": True,
                                   "tie_word_embeddings": False, "rope_theta": 1e6,
                                   "max_position_embeddings": 4096, **overrides})
        model = Qwen3MoeForCausalLM(config)
    elif kind == "qwen3":
        config = Qwen3Config(**{**SMALL, "num_key_value_heads": 2, "head_dim": 32,
                                "tie_word_embeddings": True, "rope_theta": 1e6,
                                "max_position_embeddings": 4096, **overrides})
        model = Qwen3ForCausalLM(config)
    elif kind == "llama":
        config = LlamaConfig(**{**SMALL, "num_key_value_heads": 2, "tie_word_embeddings": False,
                                "rope_theta": 500_000.0, "rope_scaling": LLAMA3_SCALING,
                                "max_position_embeddings": 16384, **overrides})
        model = LlamaForCausalLM(config)
    else:
        config = Qwen2Config(**{**SMALL, "num_key_value_heads": 2 if kind == "qwen_gqa" else 1,
                                "tie_word_embeddings": True, "rope_theta": 1e6,
                                "max_position_embeddings": 4096, **overrides})
        model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif "bias" in name:
                param.normal_(0.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)  # routing far from ties: a swapped expert would show
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, qwen2_tokenizer_dir):
    """{name: directory} of the four models, with transformers' logits of PROMPT saved."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for kind in LAYOUTS:
        model = _hf_model(kind)
        path = root / kind
        # several shards with an index for two of them, one model.safetensors for the third
        model.save_pretrained(path, max_shard_size="100KB" if kind != "qwen_one_kv_group" else "1GB")
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT])).logits[0]
        torch.save(logits, path / "reference_logits.pt")
        dirs[kind] = path
    for name in ("tokenizer.json", "tokenizer_config.json"):  # carried through the export
        shutil.copyfile(Path(qwen2_tokenizer_dir) / name, dirs["qwen_gqa"] / name)
    return dirs


@pytest.fixture(scope="module")
def launched(hf_dirs, tmp_path_factory):
    """One torchrun launch (2 CPU ranks) of this file: every layout's logits, three
    conversions."""
    out = tmp_path_factory.mktemp("layouts")
    jobs = {"out": str(out), "models": {k: str(v) for k, v in hf_dirs.items()},
            "layouts": LAYOUTS, "convert": list(CONVERTED)}
    return launch_torchrun(__file__, jobs, out, timeout=600)


# ---------------------------------------------------------------------------------------------
# config.json ↔ ModelConfig (no model)
# ---------------------------------------------------------------------------------------------

# Qwen/Qwen3-30B-A3B config.json's MoE and architecture keys
_QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_act": "silu", "hidden_size": 2048,
                  "intermediate_size": 6144, "moe_intermediate_size": 768,
                  "num_hidden_layers": 48, "num_attention_heads": 32,
                  "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                  "num_experts_per_tok": 8, "norm_topk_prob": True,
                  "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "output_router_logits": False,
                  "vocab_size": 151936, "max_position_embeddings": 40960,
                  "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-06,
                  "tie_word_embeddings": False, "attention_bias": False,
                  "use_sliding_window": False, "sliding_window": None,
                  "max_window_layers": 48}

# The architecture fields of the published config.json files (transformers-4 spelling).
PUBLISHED = {
    # Qwen/Qwen2.5-0.5B config.json
    "0.5B": {"model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896,
             "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
             "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
             "use_sliding_window": False},
    # Qwen/Qwen2.5-7B config.json
    "7B": {"model_type": "qwen2", "hidden_act": "silu", "hidden_size": 3584,
           "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 131072,
           "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
           "use_sliding_window": False},
    # meta-llama/Llama-3.1-8B config.json
    "llama3.1-8B": {"model_type": "llama", "hidden_act": "silu", "hidden_size": 4096,
                    "intermediate_size": 14336, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                    "max_position_embeddings": 131072, "rope_theta": 500000.0,
                    "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
                    "attention_bias": False, "mlp_bias": False, "head_dim": 128,
                    "rope_scaling": {**LLAMA3_SCALING, "rope_type": "llama3"}},
    # Qwen/Qwen3-0.6B config.json
    "qwen3-0.6B": {"model_type": "qwen3", "hidden_act": "silu", "hidden_size": 1024,
                   "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                   "max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": None,
                   "rms_norm_eps": 1e-06, "tie_word_embeddings": True, "attention_bias": False,
                   "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28},
    # Qwen/Qwen3-32B config.json
    "qwen3-32B": {"model_type": "qwen3", "hidden_act": "silu", "hidden_size": 5120,
                  "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                  "max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": None,
                  "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "attention_bias": False,
                  "use_sliding_window": False, "sliding_window": None, "max_window_layers": 64},
    # Qwen/Qwen3-30B-A3B config.json (its MoE and architecture keys)
    "qwen3-30B-A3B": _QWEN3_30B_A3B,
    # Qwen/Qwen3-235B-A22B config.json: the same keys, these values apart
    "qwen3-235B-A22B": {**_QWEN3_30B_A3B, "hidden_size": 4096, "intermediate_size": 12288,
                        "moe_intermediate_size": 1536, "num_hidden_layers": 94,
                        "num_attention_heads": 64, "max_window_layers": 94},
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_published_config_json_is_the_preset(preset):
    from ray_ppu.hf.config import mismatches, model_from_hf, to_hf

    derived = model_from_hf(PUBLISHED[preset])
    assert mismatches(PRESETS[preset], derived) == []
    # the Instruct variants' shorter max_position_embeddings shapes no weight: not a mismatch
    assert mismatches(PRESETS[preset], derived.with_(max_position_embeddings=32768)) == []
    # and back: the exported config.json describes the same model
    assert mismatches(PRESETS[preset], model_from_hf(to_hf(PRESETS[preset], "bfloat16"))) == []


def test_qwen3_config_json_gives_head_dim_qk_norms_and_no_bias(hf_dirs):
    from ray_ppu.hf.config import mismatches, model_from_hf, read

    model = model_from_hf(read(hf_dirs["qwen3"]))  # transformers 5 wrote it
    assert (model.kv_channels, model.effective_kv_channels, model.hidden_size) == (32, 32, 64)
    assert model.qk_layernorm and not model.add_qkv_bias
    assert not model.untie_embeddings_and_output_weights
    # transformers' Qwen3Config has head_dim 128 when config.json leaves it out, not hidden/heads
    published = PUBLISHED["qwen3-0.6B"]
    unsized = model_from_hf({k: v for k, v in published.items() if k != "head_dim"})
    assert unsized.kv_channels == 128
    # the Qwen2 / LLaMA derivation stays: a head_dim of hidden / heads is no field of its own
    assert model_from_hf(PUBLISHED["llama3.1-8B"]).kv_channels is None
    # every difference from the checkpoint is named with its config.json key
    wrong = mismatches(PRESETS["qwen3-0.6B"], model_from_hf({**published, "head_dim": 64}))
    assert wrong == ["model.kv_channels=128 but head_dim gives 64"]
    wrong = mismatches(PRESETS["0.5B"].with_(add_qkv_bias=False),
                       model_from_hf({**PUBLISHED["0.5B"], "model_type": "qwen3",
                                      "head_dim": 64}))
    assert wrong == ["model.qk_layernorm=False but model_type (qwen3: q_norm / k_norm) gives True"]


@pytest.mark.parametrize("published, change, message", [
    ("qwen3-0.6B", {"attention_bias": True}, "attention_bias=True (only False is supported)"),
    ("qwen3-0.6B", {"use_sliding_window": True},
     "use_sliding_window=True (only False is supported)"),
    ("qwen3-0.6B", {"mlp_bias": True}, "mlp_bias=True (only False is supported)"),
    # Qwen3-MoE: every layer routed, as published
    ("qwen3-30B-A3B", {"decoder_sparse_step": 2}, "decoder_sparse_step=2 (only 1 is supported)"),
    ("qwen3-30B-A3B", {"mlp_only_layers": [0, 3]},
     "mlp_only_layers=[0, 3] (ray_ppu builds every layer as a MoE layer: only [] is supported)"),
    ("qwen3-30B-A3B", {"attention_bias": True}, "attention_bias=True (only False is supported)"),
])
def test_unsupported_qwen3_config_json_is_named(published, change, message):
    from ray_ppu.hf.config import model_from_hf

    with pytest.raises(ConfigError) as err:
        model_from_hf({**PUBLISHED[published], **change}, "/m/config.json")
    assert str(err.value).startswith("/m/config.json: ") and message in str(err.value)


def _assert_transformers_builds_it(model_dir: Path, config: dict, tmp_path: Path,
                                   architecture: str) -> None:
    """``config`` in place of ``model_dir``'s config.json: transformers builds
    ``architecture`` from it, whose logits on the same weights are the reference's."""
    from transformers import AutoModelForCausalLM

    from ray_ppu.hf.config import CONFIG_FILE

    fresh = tmp_path / "fresh"
    shutil.copytree(model_dir, fresh)
    (fresh / CONFIG_FILE).write_text(json.dumps(config))
    loaded = AutoModelForCausalLM.from_pretrained(fresh).eval()
    assert type(loaded).__name__ == architecture
    with torch.no_grad():
        logits = loaded(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits, torch.load(model_dir / "reference_logits.pt"),
                               rtol=0, atol=1e-6)


def test_fresh_qwen3_config_json_is_what_transformers_loads(hf_dirs, tmp_path):
    """The config.json an export writes for a Qwen3 model trained without a Hugging Face
    origin (no source config.json to copy): transformers builds the same Qwen3ForCausalLM from
    it, whose logits on the same weights are the reference's. A model with both QKV bias and
    q / k norms has no Hugging Face architecture and is refused."""
    from ray_ppu.hf.config import model_from_hf, read, to_hf

    model = model_from_hf(read(hf_dirs["qwen3"]))
    config = to_hf(model, "float32")
    assert (config["architectures"], config["model_type"], config["head_dim"]) == \
        (["Qwen3ForCausalLM"], "qwen3", 32)
    assert config["attention_bias"] is False and config["tie_word_embeddings"] is True
    _assert_transformers_builds_it(hf_dirs["qwen3"], config, tmp_path, "Qwen3ForCausalLM")
    with pytest.raises(ConfigError, match="qk_layernorm and add_qkv_bias has no Hugging Face"):
        to_hf(model.with_(add_qkv_bias=True), "float32")


def test_qwen3_moe_config_json_both_spellings_and_a_fresh_export(hf_dirs, tmp_path):
    """transformers 5 writes num_experts as num_local_experts (and rope_parameters); both are
    read. A fresh export (no source config.json) is a Qwen3MoeForCausalLM config that
    transformers builds the reference's model from: the same logits on the same weights."""
    from ray_ppu.hf.config import mismatches, model_from_hf, read, to_hf

    raw = read(hf_dirs["qwen3_moe"])
    assert "num_local_experts" in raw and "num_experts" not in raw  # transformers 5 wrote it
    model = model_from_hf(raw)
    assert (model.num_moe_experts, model.moe_router_topk, model.moe_ffn_hidden_size) == (4, 2, 48)
    assert model.moe_norm_topk_prob and model.qk_layernorm and model.kv_channels == 32
    # a different load-balancing weight is a training choice; a different top-k is another model
    assert mismatches(model.with_(moe_aux_loss_coeff=0.01), model) == []
    assert mismatches(model.with_(moe_router_topk=1), model) == [
        "model.moe_router_topk=1 but num_experts_per_tok gives 2"]
    config = to_hf(model, "float32")
    assert (config["architectures"], config["num_experts"], config["moe_intermediate_size"]) == (
        ["Qwen3MoeForCausalLM"], 4, 48)
    _assert_transformers_builds_it(hf_dirs["qwen3_moe"], config, tmp_path,
                                   "Qwen3MoeForCausalLM")
    with pytest.raises(ConfigError, match="a MoE model without qk_layernorm"):
        to_hf(model.with_(qk_layernorm=False), "float32")


def test_transformers5_spelling_is_read(hf_dirs):
    from ray_ppu.hf.config import model_from_hf, read

    raw = read(hf_dirs["llama"])
    assert "rope_parameters" in raw and "rope_scaling" not in raw  # transformers 5 wrote it
    model = model_from_hf(raw)
    assert (model.rope_scaling, model.rope_scaling_factor, model.rotary_base) == (True, 8.0, 500_000)
    assert model.untie_embeddings_and_output_weights and not model.add_qkv_bias


def test_model_comes_from_config_json_or_must_match_it(hf_dirs, tmp_path):
    qwen = hf_dirs["qwen_gqa"]
    cfg = load(None, [f"checkpoint.pretrained={qwen}", "model.init_method_std=0.02"])
    assert (cfg.model.num_layers, cfg.model.num_query_groups, cfg.model.vocab_size) == (4, 2, 1000)
    assert cfg.model.init_method_std == 0.02  # a training field on top of config.json
    assert cfg.data.tokenizer == str(qwen)  # the model's own tokenizer by default
    with pytest.raises(ConfigError) as err:
        load(None, [f"checkpoint.pretrained={qwen}", "model.preset=0.5B"])
    text = str(err.value)
    assert "(preset 0.5B) does not match checkpoint.pretrained" in text
    assert "model.hidden_size=896 but hidden_size gives 64" in text
    assert "model.num_layers=24 but num_hidden_layers gives 4" in text
    assert "model.untie_embeddings_and_output_weights" not in text  # both tied
    # the config.yaml a pretrained run writes (preset null) reads back as the same model
    from ray_ppu.config.loader import from_dict

    tree = cfg.to_dict()
    tree["checkpoint"]["pretrained"] = None
    assert from_dict(tree).model == cfg.model
    with pytest.raises(ConfigError) as err:  # a field set without a preset: only it differs
        load(None, [f"checkpoint.pretrained={qwen}", "model.num_query_groups=4"])
    assert str(err.value).count(" but ") == 1
    assert "model.num_query_groups=4 but num_key_value_heads gives 2" in str(err.value)


@pytest.mark.parametrize("change, message", [
    ({"use_sliding_window": True}, "use_sliding_window=True (only False is supported)"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "mistral"}, "model_type='mistral' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
    ({"rope_scaling": {**LLAMA3_SCALING, "high_freq_factor": 2.0}},
     "rope_scaling.high_freq_factor=2.0 (Megatron-Core fixes it at 4)"),
])
def test_unsupported_config_json_is_named(change, message):
    from ray_ppu.hf.config import model_from_hf

    with pytest.raises(ConfigError) as err:
        model_from_hf({**PUBLISHED["0.5B"], **change}, "/m/config.json")
    assert str(err.value).startswith("/m/config.json: ") and message in str(err.value)


def test_missing_or_misshapen_tensors_fail_before_any_worker(hf_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    from ray_ppu import checkpoint

    broken = tmp_path / "broken"
    shutil.copytree(hf_dirs["qwen_one_kv_group"], broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.3.mlp.up_proj.weight"]
    tensors["model.norm.weight"] = torch.ones(32)
    save_file(tensors, broken / "model.safetensors")
    cfg = load(None, [f"checkpoint.pretrained={broken}"])
    with pytest.raises(ConfigError) as err:
        checkpoint.check_sources(cfg)
    text = str(err.value)
    assert f"checkpoint.pretrained {broken} does not fit the model" in text
    assert "model.layers.3.mlp.up_proj.weight missing" in text
    assert "model.norm.weight in model.safetensors has shape [32], expected [64]" in text
    cfg = load(None, [f"checkpoint.pretrained={hf_dirs['qwen_gqa']}", "checkpoint.load=/x"])
    from ray_ppu.plan import build_plan

    with pytest.raises(ConfigError, match="set one"):  # a rule of the plan
        build_plan(cfg)
    # one KV group cannot be split over TP 2: the plan says so before any worker starts
    cfg = load(None, [f"checkpoint.pretrained={hf_dirs['qwen_one_kv_group']}",
                      "parallel.tensor_model_parallel_size=2", "training.train_iters=1",
                      "data.data_path=[x]"])
    with pytest.raises(ConfigError, match="num_query_groups 1 is not divisible by TP 2"):
        build_plan(cfg)


def test_sharded_writer_follows_upstream_layout(tmp_path):
    from ray_ppu.hf.files import INDEX_FILE, ShardedWriter, read_all

    tensors = {f"t{i}": torch.full((250,), float(i)) for i in range(5)}  # 1000 bytes each
    writer = ShardedWriter(tmp_path / "many", max_bytes=2500)
    writer.add_all(tensors.items())
    files = [p.name for p in writer.close()]
    assert files == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors", INDEX_FILE]
    index = json.loads((tmp_path / "many" / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 5000
    assert index["weight_map"]["t4"] == "model-00003-of-00003.safetensors"
    assert {k: v.tolist() for k, v in read_all(tmp_path / "many")} == \
        {k: v.tolist() for k, v in tensors.items()}
    writer = ShardedWriter(tmp_path / "one")
    writer.add_all(tensors.items())
    assert [p.name for p in writer.close()] == ["model.safetensors"]


# ---------------------------------------------------------------------------------------------
# Our model with the loaded weights against transformers
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_logits_equal_transformers_at_every_layout(hf_dirs, launched, kind):
    reference = torch.load(hf_dirs[kind] / "reference_logits.pt")
    for layout in LAYOUTS[kind]:
        name = layout_name(kind, layout)
        ours = torch.load(launched / f"{name}.pt")
        assert ours.shape == reference.shape == (len(PROMPT), 1000), name
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("kind", CONVERTED)
def test_round_trip_is_bit_exact(hf_dirs, launched, tmp_path, kind):
    """HF → torch_dist (saved at TP 2 by the launch) → HF: the same tensors, bit for bit, the
    same config.json, shards ≤ the size asked for, side files copied."""
    from safetensors import safe_open

    from ray_ppu.hf.files import INDEX_FILE, read_all

    out = tmp_path / "exported"
    proc = subprocess.run(
        [sys.executable, str(REPO / "entrypoints" / "convert_checkpoint.py"), "mcore-to-hf",
         "--checkpoint", str(launched / f"mcore_{kind}"), "--out", str(out),
         "--max-shard-size", "100KB"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    original, exported = dict(read_all(hf_dirs[kind])), dict(read_all(out))
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and exported[name].shape == tensor.shape, name
        assert torch.equal(exported[name].view(torch.int32), tensor.view(torch.int32)), name
    assert json.loads((out / "config.json").read_text()) == \
        json.loads((hf_dirs[kind] / "config.json").read_text())
    weight_map = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    for shard in set(weight_map.values()):
        with safe_open(str(out / shard), "pt") as f:
            assert sum(f.get_tensor(k).numel() * 4 for k in f.keys()) <= 100_000 or \
                len(list(f.keys())) == 1
    assert (out / "generation_config.json").is_file()
    with pytest.raises(ConfigError, match="already holds safetensors weights"):
        from ray_ppu.offline.mcore_to_hf import export

        export(launched / f"mcore_{kind}", out)  # stale shards would mix with new ones
    if kind == "qwen_gqa":
        assert (out / "tokenizer.json").read_bytes() == \
            (hf_dirs[kind] / "tokenizer.json").read_bytes()


@pytest.mark.slow
def test_converted_checkpoint_starts_a_finetune_of_the_same_model(launched):
    """checkpoint.load of an hf-to-mcore result: weights only, iteration 0, whatever
    checkpoint.finetune says; another architecture is refused before any worker starts."""
    from ray_ppu import checkpoint

    converted = launched / "mcore_qwen_gqa"
    cfg = load(None, [f"checkpoint.load={converted}", "model.preset=tiny"])
    start = checkpoint.resume_point(cfg)
    assert start.weights_only and start.iteration == 0 and start.meta.tensor_model_parallel_size == 2
    with pytest.raises(ConfigError) as err:
        checkpoint.check_sources(cfg)
    assert "model.num_layers: checkpoint 4, this run 2" in str(err.value)
    assert "model.vocab_size: checkpoint 1000, this run 151936" in str(err.value)


@pytest.mark.slow
# Qwen3-MoE: its TP 2 conversion generated at EP 2 under torchrun (each rank its 2 experts)
@pytest.mark.parametrize("kind, launcher", [
    ("llama", []),
    ("qwen3_moe", ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "0"]),
])
def test_generate_from_torch_dist_matches_transformers(hf_dirs, launched, tmp_path, kind,
                                                       launcher):
    """generate.py on the converted checkpoint: transformers' greedy tokens and logits."""
    from transformers import AutoModelForCausalLM

    prompt = PROMPT[:5]
    model = AutoModelForCausalLM.from_pretrained(hf_dirs[kind]).eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                  min_new_tokens=6)[0, len(prompt):].tolist()
        expected_logits = model(torch.tensor([prompt])).logits[0]
    dump = tmp_path / "logits.json"
    experts = ["--ep", "2"] if launcher else []
    if launcher:
        launcher = [*launcher[:-1], str(free_port("127.0.0.1"))]
    proc = subprocess.run(
        [sys.executable, *launcher, str(REPO / "entrypoints" / "generate.py"), "--checkpoint",
         str(launched / f"mcore_{kind}"), "--token-ids", ",".join(map(str, prompt)),
         "--max-new-tokens", "6", "--dump-logits", str(dump), *experts],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["format"] == "mcore" and result["new_ids"] == expected
    logits = json.loads(dump.read_text())
    assert logits["token_ids"] == prompt
    torch.testing.assert_close(torch.tensor(logits["logits"]), expected_logits, rtol=0, atol=1e-5)


def _transformer_engine_device() -> bool:
    from ray_ppu.model.gpt import transformer_engine_available

    return torch.cuda.is_available() and transformer_engine_available("ppu")


@pytest.mark.gpu
@pytest.mark.skipif(not _transformer_engine_device(),
                    reason="needs a CUDA/PPU device with Transformer Engine")
@pytest.mark.parametrize("kind", ["qwen_gqa", "llama", "qwen3"])
def test_transformer_engine_layers_load_the_same_weights(hf_dirs, tmp_path, kind):
    """On a device the model is built with Transformer Engine's fused layers (norms inside
    LayerNormLinear): the same mapping fills them; fp32 logits match transformers'."""
    dump = tmp_path / "logits.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "entrypoints" / "generate.py"), "--checkpoint",
         str(hf_dirs[kind]), "--token-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "1",
         "--device", "ppu", "--precision", "fp32", "--dump-logits", str(dump)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = torch.load(hf_dirs[kind] / "reference_logits.pt")
    ours = torch.tensor(json.loads(dump.read_text())["logits"])
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-3)  # TE kernels, TF32 off


@pytest.mark.slow
def test_model_trained_from_scratch_exports_to_transformers(uninterrupted, qwen2_tokenizer_dir,
                                                           tmp_path):
    """The checkpoint tests' reference run (the tiny preset trained under Ray Train at DP 2, no
    Hugging Face origin): exported with the Qwen2 tokenizer, transformers loads it as a Qwen2
    model whose logits are ours (generate.py on the checkpoint itself)."""
    from transformers import AutoModelForCausalLM

    from ray_ppu import checkpoint
    from ray_ppu.offline.mcore_to_hf import export

    saved, meta = checkpoint.latest(checkpoint.save_root(uninterrupted["cfg"]))
    assert meta.hf_config is None and meta.model["preset"] == "tiny"
    summary = export(saved, tmp_path / "hf", tokenizer=qwen2_tokenizer_dir)
    assert summary["tokenizer"] and summary["files"] == ["model.safetensors"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["tie_word_embeddings"], config["vocab_size"]) == \
        ("qwen2", True, 151_936)
    dump = tmp_path / "logits.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "entrypoints" / "generate.py"), "--checkpoint", str(saved),
         "--tokenizer", str(qwen2_tokenizer_dir), "--raw", "--prompt", "def main(", "--max-new-tokens",
         "3", "--dump-logits", str(dump)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["new_ids"]) == 3 and isinstance(result["text"], str)
    ours = json.loads(dump.read_text())
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        theirs = model(torch.tensor([ours["token_ids"]])).logits[0]
    torch.testing.assert_close(torch.tensor(ours["logits"]), theirs, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Fine-tuning from a Hugging Face directory under Ray Train
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_finetune_from_hf_under_ray_train(ray_cluster, byte_corpus, qwen2_tokenizer_dir, tmp_path):
    """PP 2 under Ray Train from a Hugging Face Qwen2 with tied embeddings (the last stage's
    output layer reads embed_tokens) and a vocabulary of 384 padded to 512 (the padding masked;
    the byte corpus, conftest: Qwen2's 151,936 entries were most of this test's time):
    iteration 1's loss is transformers' loss on the same global batch; training and
    validation losses fall (the Ray path's pipeline test: the first and last stages read the
    data); the trained checkpoint exports to a model transformers loads, with a lower loss on
    the batch it trained on."""
    from test_checkpoint import _launch
    from test_training import overrides
    from transformers import AutoModelForCausalLM

    from ray_ppu import checkpoint
    from ray_ppu.data import idxmap, inprocess
    from ray_ppu.offline.mcore_to_hf import export
    from ray_ppu.plan import build_plan
    from ray_ppu.launch.output import absolute_paths, prepare_output

    hf = tmp_path / "Qwen2-tiny"
    _hf_model("qwen_gqa", vocab_size=ByteTokenizer.vocab_size, num_hidden_layers=2,
              max_position_embeddings=32768).save_pretrained(hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(qwen2_tokenizer_dir) / name, hf / name)
    cfg = absolute_paths(load(None, [
        *overrides(byte_corpus, tmp_path / "run", "training.train_iters=4",
                   "training.eval_interval=2", "cluster.num_workers=2",
                   "parallel.pipeline_model_parallel_size=2", "training.lr=1e-2"),
        "model.make_vocab_size_divisible_by=256", f"data.eod_token_id={ByteTokenizer.eod}",
        f"checkpoint.pretrained={hf}"]))
    assert cfg.model.vocab_size == ByteTokenizer.vocab_size and cfg.model.preset is None
    plan = build_plan(cfg)
    assert plan.padded_vocab_size == 512
    prepare_output(cfg, plan)
    final, messages = _launch(cfg, plan)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    train = [r for r in rows if "lm_loss" in r]
    valid = [r["valid_lm_loss"] for r in rows if "valid_lm_loss" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4] and len(valid) == 2
    assert train[-1]["lm_loss"] < train[0]["lm_loss"] - 0.1 and valid[1] < valid[0]

    spec = idxmap.spec_for(cfg, plan)
    idxmap.datasets(spec)
    batch = list(inprocess.microbatches(spec, 0, 1, plan.global_batch_size, 1, 0, 1))

    def hf_loss(path) -> float:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        total = 0.0
        with torch.no_grad():
            for mb in batch:
                logits = model(torch.as_tensor(mb["tokens"]).long()).logits
                total += torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), torch.as_tensor(mb["labels"]).long().flatten(),
                    reduction="sum").item()
        return total / sum(torch.as_tensor(mb["labels"]).numel() for mb in batch)

    before = hf_loss(hf)
    assert train[0]["lm_loss"] == pytest.approx(before, abs=2e-5)
    saved, meta = checkpoint.latest(checkpoint.save_root(cfg))
    assert meta.iteration == 4 and meta.hf_source == str(hf)
    summary = export(saved, tmp_path / "exported")
    assert summary["tokenizer"] and summary["dtype"] == "float32"
    assert hf_loss(tmp_path / "exported") < before - 0.05  # it learned from the batch it saw


# ---------------------------------------------------------------------------------------------
# The torchrun side: python -m torch.distributed.run --nproc-per-node 2 tests/test_hf.py JOBS
# ---------------------------------------------------------------------------------------------

def _run_layouts(jobs: dict) -> None:
    """Every (model, layout) in ``jobs``: load the HF weights, write the prompt's logits
    (rank 0); then convert the listed models at TP 2 with convert_checkpoint's code."""
    import logging

    import torch.distributed as dist

    from ray_ppu.model import parallel
    from ray_ppu.offline import inference
    from ray_ppu.offline.hf_to_mcore import to_mcore

    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    out = Path(jobs["out"])
    with parallel.process_group("cpu"):
        for kind, layouts in jobs["layouts"].items():
            source = inference.open_source(jobs["models"][kind])
            for layout in layouts:
                tp, pp, vs, ep, etp = (*layout, 1, None)[:5]
                cfg, plan = inference.inference_config(source.model, dist.get_world_size(), tp,
                                                       pp, vs, device="cpu", ep=ep, etp=etp)
                with inference.built_model(cfg, plan, "cpu") as chunks:
                    inference.load_weights(chunks, source, cfg, plan)
                    logits = inference.prompt_logits(chunks, PROMPT, source.model.vocab_size,
                                                     torch.device("cpu"))
                if dist.get_rank() == 0:
                    torch.save(logits, out / f"{layout_name(kind, layout)}.pt")
        for kind in jobs["convert"]:
            to_mcore(jobs["models"][kind], out / f"mcore_{kind}", tp=2)


if __name__ == "__main__":  # dist_checkpointing starts spawn-context helpers: guard needed
    _run_layouts(json.loads(Path(sys.argv[1]).read_text()))
