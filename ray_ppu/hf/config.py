"""A Hugging Face ``config.json`` (Qwen2 / Qwen3 / Qwen3-MoE / LLaMA) as a ModelConfig, and back.

Both spellings of RoPE settings are read: ``rope_theta`` + ``rope_scaling`` (transformers 4,
what the published Qwen2.5 and LLaMA-3.1 files use) and ``rope_parameters`` (transformers 5).
What Megatron-Core's GPTModel cannot express (sliding-window attention, an output-projection or
MLP bias, another activation, RoPE types other than default and llama3 with Megatron's fixed
llama3 constants) is an error naming the field, never a silently different model.

Qwen3 (dense) is LLaMA's layout plus a per-head RMSNorm of queries and keys (``qk_layernorm``)
and an explicit ``head_dim`` (``kv_channels``; transformers defaults it to 128 for Qwen3, not
to hidden / heads as for Qwen2 and LLaMA). Its ``attention_bias`` would also put a bias on
o_proj, which GPTModel's ``add_qkv_bias`` does not have: only false is accepted.

Qwen3-MoE is Qwen3's attention with routed experts in the MLPs. ray_ppu builds every layer as
a MoE layer, as both published checkpoints are (decoder_sparse_step 1, no mlp_only_layers):
another pattern is an error naming the two keys. transformers 5 writes ``num_experts`` as
``num_local_experts``; both are read. ``router_aux_loss_coef`` is a training choice
(``model.moe_aux_loss_coeff`` may differ from it).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from ray_ppu.errors import ConfigError
from ray_ppu.config.schema import ModelConfig

CONFIG_FILE = "config.json"
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM"}
QWEN3_FAMILY = ("qwen3", "qwen3_moe")  # q / k norms, head_dim 128 unless given, no bias
# transformers' Qwen3Config head_dim when config.json leaves it out (not hidden / heads)
QWEN3_HEAD_DIM = 128

# ModelConfig fields a config may set freely on top of a Hugging Face model: training choices,
# and max_position_embeddings, which shapes no weight (only RoPE tables) and differs between
# published variants of one model (Qwen2.5-7B: 131072, its Instruct: 32768).
TRAINING_FIELDS = ("preset", "init_method_std", "hidden_dropout", "attention_dropout",
                   "make_vocab_size_divisible_by", "max_position_embeddings",
                   "moe_aux_loss_coeff")

# HF config.json key for each architecture field, as named in error messages.
HF_NAMES = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "kv_channels": "head_dim",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "rotary_base": "rope_theta",
    "rope_scaling": "rope_scaling.rope_type",
    "rope_scaling_factor": "rope_scaling.factor",
    "norm_epsilon": "rms_norm_eps",
    "add_qkv_bias": "attention_bias (qwen2: always)",
    "qk_layernorm": "model_type (qwen3: q_norm / k_norm)",
    "untie_embeddings_and_output_weights": "tie_word_embeddings (negated)",
    "num_moe_experts": "num_experts",
    "moe_router_topk": "num_experts_per_tok",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "moe_norm_topk_prob": "norm_topk_prob",
    "moe_aux_loss_coeff": "router_aux_loss_coef",
    "mrope_section": "rope_scaling.mrope_section",
}

# Megatron-Core's llama3 RoPE scaling has these fixed (RotaryEmbedding._apply_scaling).
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}


def read(directory: str | Path) -> dict:
    """The parsed ``config.json`` of a Hugging Face model directory."""
    path = Path(directory).expanduser() / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing: checkpoint.pretrained must be a Hugging Face model "
                          f"directory (config.json + *.safetensors)") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: cannot read it as JSON ({err})") from None


def _rope(hf: dict, where: str) -> tuple[float, Optional[dict]]:
    """(theta, scaling parameters or None) from either spelling."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", hf.get("rope_theta"))
        scaling = params if params.get("rope_type", "default") != "default" else None
    else:
        theta = hf.get("rope_theta", 10_000.0)
        scaling = hf.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
    if theta is None:
        raise ConfigError(f"{where}: no rope_theta")
    return float(theta), scaling


def model_from_hf(hf: dict, where: str = CONFIG_FILE) -> ModelConfig:
    """The ModelConfig of a Qwen2 / Qwen3 / LLaMA ``config.json`` (``where`` names it in
    errors)."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"{where}: model_type={model_type!r} is not supported (expected one of "
                          f"{', '.join(map(repr, ARCHITECTURES))}: Qwen2 / Qwen2.5, Qwen3, "
                          f"LLaMA-3.x)")
    absent = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads", "vocab_size", "max_position_embeddings",
                          "rms_norm_eps") if k not in hf]
    if absent:
        raise ConfigError(f"{where}: no {', '.join(absent)}")
    problems = []

    def require(key: str, expected, default=None) -> None:
        value = hf.get(key, default)
        if value != expected:
            problems.append(f"{key}={value!r} (only {expected!r} is supported)")

    require("hidden_act", "silu", "silu")
    require("mlp_bias", False, False)
    if model_type == "qwen3_moe":  # every layer routed: the published pattern, and ours
        require("decoder_sparse_step", 1, 1)
        if hf.get("mlp_only_layers"):
            problems.append(f"mlp_only_layers={hf['mlp_only_layers']!r} (ray_ppu builds every "
                            f"layer as a MoE layer: only [] is supported)")
    if model_type in ("qwen2", *QWEN3_FAMILY):
        require("use_sliding_window", False, False)
    if model_type == "qwen2":
        qkv_bias = True  # Qwen2 always has Q/K/V biases and no output-projection bias
    else:
        # LLaMA's and Qwen3's flag also adds an o_proj bias
        require("attention_bias", False, False)
        qkv_bias = False
    heads = hf["num_attention_heads"]
    derived = hf["hidden_size"] // heads
    qwen3 = model_type in QWEN3_FAMILY
    head_dim = hf.get("head_dim") or (QWEN3_HEAD_DIM if qwen3 else derived)
    theta, scaling = _rope(hf, where)
    factor = 8.0
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            problems.append(f"rope_scaling.rope_type={kind!r} (only 'llama3' or none)")
        else:
            factor = float(scaling.get("factor", 8.0))
            for key, fixed in _LLAMA3_FIXED.items():
                if float(scaling.get(key, fixed)) != fixed:
                    problems.append(f"rope_scaling.{key}={scaling[key]!r} (Megatron-Core fixes "
                                    f"it at {fixed:g})")
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    if not float(theta).is_integer():
        raise ConfigError(f"{where}: rope_theta={theta!r} is not an integer")
    return ModelConfig(
        preset=None,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        # explicit where config.json's head width is its own (Qwen3: always); else derived
        kv_channels=(head_dim if qwen3 or head_dim * heads != hf["hidden_size"] else None),
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf["max_position_embeddings"],
        rotary_base=int(theta),
        rope_scaling=scaling is not None,
        rope_scaling_factor=factor,
        norm_epsilon=float(hf["rms_norm_eps"]),
        add_qkv_bias=qkv_bias,
        qk_layernorm=qwen3,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        **(_moe_from_hf(hf) if model_type == "qwen3_moe" else {}),
    )


def _moe_from_hf(hf: dict) -> dict:
    """ModelConfig's MoE fields of a Qwen3-MoE config.json (transformers' defaults where a key
    is left out)."""
    return dict(num_moe_experts=hf.get("num_experts", hf.get("num_local_experts", 128)),
                moe_router_topk=hf.get("num_experts_per_tok", 8),
                moe_ffn_hidden_size=hf.get("moe_intermediate_size", 768),
                moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)))


def mismatches(ours: ModelConfig, theirs: ModelConfig) -> list[str]:
    """Architecture fields on which ``ours`` differs from ``theirs`` (from config.json), one
    'model.x=… but config.json key=…' line each; rope_scaling_factor only with rope_scaling;
    kv_channels by the width it gives (None and hidden / heads are the same model)."""
    lines = []
    for f in dataclasses.fields(ModelConfig):
        if f.name in TRAINING_FIELDS:
            continue
        if f.name == "rope_scaling_factor" and not (ours.rope_scaling or theirs.rope_scaling):
            continue
        a, b = getattr(ours, f.name), getattr(theirs, f.name)
        if f.name == "kv_channels":
            a, b = ours.effective_kv_channels, theirs.effective_kv_channels
        if f.name == "moe_ffn_hidden_size":
            a, b = ours.effective_moe_ffn_hidden_size, theirs.effective_moe_ffn_hidden_size
        if f.name in ("moe_router_topk", "moe_norm_topk_prob") and not (ours.is_moe or theirs.is_moe):
            continue  # routing settings of a model with no experts
        if a != b:
            lines.append(f"model.{f.name}={a!r} but {HF_NAMES[f.name]} gives {b!r}")
    return lines


def qwen_vl_text(hf: dict, where: str) -> ModelConfig:
    """The language model of a Qwen2.5-VL config.json: Qwen2.5 with multimodal RoPE. Its keys
    sit at the top level (published checkpoints, ``rope_scaling: {type: mrope}``) or under
    ``text_config`` (transformers 5, ``rope_parameters``)."""
    text = dict(hf.get("text_config") or {k: v for k, v in hf.items() if k != "vision_config"})
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if not section:
        raise ConfigError(f"{where}: no mrope_section in rope_parameters / rope_scaling")
    theta = rope.get("rope_theta", text.get("rope_theta", 1_000_000.0))
    text.pop("rope_scaling", None)
    text.pop("use_sliding_window", None)  # Qwen2.5-VL's configs say false; it never slides
    text.update(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": theta})
    return model_from_hf(text, f"{where} (text)").with_(mrope_section=list(section))


def directory_model(directory: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face model directory's config.json (a LLaVA model's: of
    its language model, ``text_config``; a Qwen2.5-VL model's: :func:`qwen_vl_text`)."""
    raw, where = read(directory), str(Path(directory).expanduser() / CONFIG_FILE)
    if raw.get("model_type") == "qwen2_5_vl":
        return qwen_vl_text(raw, where)
    if raw.get("model_type") == "llava" and isinstance(raw.get("text_config"), dict):
        text = {"tie_word_embeddings": raw.get("tie_word_embeddings", False), **raw["text_config"]}
        return model_from_hf(text, f"{where} (text_config)")
    return model_from_hf(raw, where)


def require_match(model: ModelConfig, theirs: ModelConfig, directory: str | Path) -> None:
    """A run with ``checkpoint.pretrained=directory`` must train config.json's architecture
    ``theirs``: a ConfigError names every field of ``model`` that differs (training-only
    fields, :data:`TRAINING_FIELDS`, may)."""
    wrong = mismatches(model, theirs)
    if wrong:
        named = f" (preset {model.preset})" if model.preset else ""
        raise ConfigError(f"the model config{named} does not match checkpoint.pretrained "
                          f"{Path(directory).expanduser() / CONFIG_FILE}: " + "; ".join(wrong)
                          + ". Leave the model section out to take the architecture from "
                            "config.json.")


def to_hf(model: ModelConfig, dtype: str, base: Optional[dict] = None) -> dict:
    """The ``config.json`` of an exported model: ``base`` (the config.json the run started
    from) when known, with the architecture checked against ``model``; else a fresh Qwen3
    (q / k norms), Qwen2 (QKV bias) or LLaMA config in the transformers-4 spelling, which
    transformers 4 and 5 both read."""
    if base is not None:
        wrong = mismatches(model, model_from_hf(base, "the source config.json"))
        if wrong:
            raise ConfigError("the checkpoint's model differs from its source config.json: "
                              + "; ".join(wrong))
        out = dict(base)
        for key in ("torch_dtype", "dtype"):
            if key in out:
                out[key] = dtype
        return out
    if model.qk_layernorm and model.add_qkv_bias:
        raise ConfigError("a model with qk_layernorm and add_qkv_bias has no Hugging Face "
                          "architecture: Qwen3's attention_bias also puts a bias on o_proj")
    if model.is_moe and not model.qk_layernorm:
        raise ConfigError("a MoE model without qk_layernorm has no Hugging Face architecture "
                          "ray_ppu exports (Qwen3-MoE norms its queries and keys)")
    model_type = ("qwen3_moe" if model.is_moe else "qwen3" if model.qk_layernorm
                  else "qwen2" if model.add_qkv_bias else "llama")
    out = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "hidden_act": "silu",
        "num_hidden_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.effective_kv_channels,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": model.norm_epsilon,
        "rope_theta": float(model.rotary_base),
        "rope_scaling": ({"rope_type": "llama3", "factor": model.rope_scaling_factor,
                          **_LLAMA3_FIXED} if model.rope_scaling else None),
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "attention_dropout": 0.0,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if model_type == "qwen3_moe":
        out.update(num_experts=model.num_moe_experts, num_experts_per_tok=model.moe_router_topk,
                   moe_intermediate_size=model.effective_moe_ffn_hidden_size,
                   norm_topk_prob=model.moe_norm_topk_prob,
                   router_aux_loss_coef=model.moe_aux_loss_coeff, decoder_sparse_step=1,
                   mlp_only_layers=[], output_router_logits=False)
    if model_type != "qwen2":
        out.update(attention_bias=False)
    if model_type == "llama":
        out.update(mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    return out
