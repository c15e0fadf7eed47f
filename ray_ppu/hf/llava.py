"""Hugging Face LLaVA configs (``LlavaForConditionalGeneration``) ↔ ray_ppu's model and
vision sections.

A LLaVA directory's ``config.json`` nests a ``vision_config`` (SigLIP or CLIP) and a
``text_config`` (Qwen2 / Qwen3 / LLaMA, read by :func:`ray_ppu.hf.config.model_from_hf`) and
adds the recipe: ``vision_feature_layer``, ``vision_feature_select_strategy``,
``projector_hidden_act``, ``multimodal_projector_bias``, ``image_token_id``. 
The tensors' places and layouts are in :mod:`ray_ppu.hf.llava_weights`.
"""

from __future__ import annotations

from typing import Optional

from ray_ppu.config.schema import ModelConfig
from ray_ppu.config.vision import ACTIVATIONS, VisionConfig
from ray_ppu.errors import ConfigError
from ray_ppu.hf import config as hf_config
from ray_ppu.hf.config import model_from_hf

VISION_TYPES = {"siglip_vision_model": "siglip", "siglip": "siglip",
                "clip_vision_model": "clip", "clip": "clip"}
_HF_ACTIVATIONS = {ours: theirs for theirs, ours in ACTIVATIONS.items()}


def is_llava(hf: dict) -> bool:
    """Whether a config.json is a LLaVA model's."""
    return hf.get("model_type") == "llava"


def vision_from_hf(vision: dict, where: str, recipe: Optional[dict] = None) -> VisionConfig:
    """The vision section of a SigLIP / CLIP ``vision_config`` (or a vision tower's own
    config.json; a two-tower SigLIP / CLIP config is read by its ``vision_config``) and of the
    LLaVA ``recipe`` keys around it (a fresh run from separate parts: LLaVA's defaults)."""
    recipe = recipe or {}
    if vision.get("model_type") in ("siglip", "clip") and "vision_config" in vision:
        vision = vision["vision_config"]
    kind = VISION_TYPES.get(vision.get("model_type", "clip_vision_model"))
    if kind is None:
        raise ConfigError(f"{where}: vision model_type={vision.get('model_type')!r} is not "
                          f"supported (SigLIP or CLIP vision towers)")
    act = vision.get("hidden_act", "gelu_pytorch_tanh" if kind == "siglip" else "quick_gelu")
    projector_act = recipe.get("projector_hidden_act", "gelu")
    wrong = [f"{key}={value!r}" for key, value in (("hidden_act", act),
                                                   ("projector_hidden_act", projector_act))
             if value not in ACTIVATIONS]
    layer = recipe.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        wrong.append(f"vision_feature_layer={layer!r} (one layer, not a list)")
    if wrong:
        raise ConfigError(f"{where}: " + "; ".join(wrong) + " is not supported")
    token = recipe.get("image_token_id", recipe.get("image_token_index"))
    return VisionConfig(
        encoder=kind, image_size=vision.get("image_size", 224),
        patch_size=vision.get("patch_size", 16 if kind == "siglip" else 32),
        num_layers=vision.get("num_hidden_layers", 12), hidden_size=vision.get("hidden_size", 768),
        ffn_hidden_size=vision.get("intermediate_size", 3072),
        num_attention_heads=vision.get("num_attention_heads", 12),
        norm_epsilon=float(vision.get("layer_norm_eps", 1e-6 if kind == "siglip" else 1e-5)),
        activation=ACTIVATIONS[act], feature_layer=layer,
        feature_select=recipe.get("vision_feature_select_strategy",
                                  "full" if kind == "siglip" else "default"),
        projector_activation=ACTIVATIONS[projector_act],
        projector_bias=bool(recipe.get("multimodal_projector_bias", True)),
        **({"image_token_id": int(token)} if token is not None else {}))


def llava_from_hf(hf: dict, where: str) -> tuple[ModelConfig, VisionConfig]:
    """(language model, vision section) of a LLaVA config.json."""
    for key in ("text_config", "vision_config"):
        if not isinstance(hf.get(key), dict):
            raise ConfigError(f"{where}: a LLaVA config.json without {key}")
    text = dict(hf["text_config"])
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    return (model_from_hf(text, f"{where} (text_config)"),
            vision_from_hf(hf["vision_config"], f"{where} (vision_config)", hf))


def directory_vision(pretrained: str, vision_tower: Optional[str] = None) -> Optional[VisionConfig]:
    """The vision section a run starting from ``checkpoint.pretrained`` gets: a LLaVA
    directory's, or with ``vision_tower`` (separate parts) that tower's config.json with
    LLaVA's recipe defaults; None for a text model."""
    from ray_ppu.hf.config import read

    if vision_tower:
        return vision_from_hf(read(vision_tower), f"{vision_tower}/config.json")
    raw = read(pretrained)
    if raw.get("model_type") == "qwen2_5_vl":
        from ray_ppu.hf import qwen_vl

        return qwen_vl.directory_vision(pretrained)
    return llava_from_hf(raw, f"{pretrained}/config.json")[1] if is_llava(raw) else None


def _vision_to_hf(vision: VisionConfig) -> dict:
    """A ``vision_config`` of the layers the model runs (those after the feature layer, which
    LLaVA never runs, are not exported) without SigLIP's pooling head."""
    out = {"model_type": f"{vision.encoder}_vision_model", "hidden_size": vision.hidden_size,
           "intermediate_size": vision.ffn_hidden_size, "num_hidden_layers": vision.layers_built,
           "num_attention_heads": vision.num_attention_heads, "image_size": vision.image_size,
           "patch_size": vision.patch_size, "layer_norm_eps": vision.norm_epsilon,
           "hidden_act": _HF_ACTIVATIONS[vision.activation], "num_channels": 3}
    if vision.encoder == "siglip":
        out["vision_use_head"] = False
    return out


def _set_dtype(config: dict, dtype: str) -> dict:
    return {k: dtype if k in ("torch_dtype", "dtype") else v for k, v in config.items()}


def llava_to_hf(model: ModelConfig, vision: VisionConfig, dtype: str,
                base: Optional[dict] = None, whole_tower: bool = False) -> dict:
    """The ``config.json`` of an exported vision-language model. ``base``: the config.json the
    run started from. ``whole_tower``: the export holds every tensor of the tower of ``base``,
    a LLaVA config.json of this very model (:func:`ray_ppu.hf.llava_weights.copy_unused_tower`
    checked it), which then comes back as it was, its dtype set. Otherwise a LLaVA config is
    made around the text config (``base``: the language model's, or the LLaVA one's
    text_config) with a tower that ends at the feature layer."""
    base = dict(base or {})
    text_base = base or None
    if is_llava(base):
        text_base = dict(base["text_config"])
        text_base.setdefault("tie_word_embeddings", base.get("tie_word_embeddings", False))
    text = hf_config.to_hf(model, dtype, text_base)  # checks the language model's shape
    if whole_tower:
        return {**_set_dtype(base, dtype), "text_config": _set_dtype(base["text_config"], dtype)}
    tied = not model.untie_embeddings_and_output_weights
    return {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
            "text_config": {**text, "tie_word_embeddings": tied},
            "vision_config": _vision_to_hf(vision), "image_token_id": vision.image_token_id,
            # the exported tower ends at the feature layer (:func:`_vision_to_hf`)
            "vision_feature_layer": -1 if vision.feature_layer < 0 else vision.feature_layer,
            "vision_feature_select_strategy": vision.feature_select,
            "projector_hidden_act": _HF_ACTIVATIONS[vision.projector_activation],
            "multimodal_projector_bias": vision.projector_bias,
            "tie_word_embeddings": tied, "dtype": dtype}
