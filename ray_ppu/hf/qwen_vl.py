"""Hugging Face Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``) ↔ ray_ppu: config, tensor
names, loading at any TP / PP.

``config.json`` comes in two spellings: the published checkpoints' (transformers 4: the text
model's keys at the top level, ``rope_scaling: {type: mrope, mrope_section}``) and
transformers 5's (a ``text_config`` with ``rope_parameters``); both hold a ``vision_config``
(``depth``, ``num_heads``, ``fullatt_block_indexes``, …). The language model is Qwen2.5's
plus its ``mrope_section`` (:func:`ray_ppu.hf.config.qwen_vl_text`).

The tensors also come in two spellings: ``model.layers.…`` / ``visual.…`` / ``lm_head.weight``
(the published files) and ``model.language_model.layers.…`` / ``model.visual.…`` (transformers
5's module names). Both are read (:class:`Names`, from the files' own names); exports write the
published one. The language model goes through the text mapping (:mod:`ray_ppu.hf.weights`);
the tower is transformers' own module (:mod:`ray_ppu.model.qwen_vision`), so its tensors are
copied whole under their own names, on every TP rank of the first stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ray_ppu.config.schema import ModelConfig
from ray_ppu.config.vision import VisionConfig
from ray_ppu.errors import ConfigError
from ray_ppu.hf import config as hf_config

TOWER = "vision_model.visual."  # the tower's tensors in a ray_ppu model (qwen_vision)
LANGUAGE = "language_model."
# every vision_config key ray_ppu builds from, with transformers' default where it has one
_VISION_DEFAULTS = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                    "hidden_act": "silu", "patch_size": 14, "spatial_merge_size": 2,
                    "temporal_patch_size": 2, "window_size": 112,
                    "fullatt_block_indexes": [7, 15, 23, 31], "in_channels": 3}


# the tower's architecture fields (what an export's config.json must agree with)
TOWER_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "patch_size", "spatial_merge_size", "temporal_patch_size", "window_size",
                "full_attention_layers")


def hf_vision_config(vision: VisionConfig, out_hidden_size: int) -> dict:
    """The ``vision_config`` of transformers' ``Qwen2_5_VLVisionConfig`` for ``vision``;
    ``out_hidden_size``: the language model's width (the merger's output)."""
    return {"model_type": "qwen2_5_vl_vision", "depth": vision.num_layers,
            "hidden_size": vision.hidden_size, "intermediate_size": vision.ffn_hidden_size,
            "num_heads": vision.num_attention_heads, "hidden_act": vision.activation,
            "patch_size": vision.patch_size, "spatial_merge_size": vision.spatial_merge_size,
            "temporal_patch_size": vision.temporal_patch_size, "window_size": vision.window_size,
            "fullatt_block_indexes": list(vision.full_attention_layers),
            "out_hidden_size": out_hidden_size, "in_channels": 3}


def is_qwen_vl(hf: dict) -> bool:
    """Whether a config.json is a Qwen2.5-VL model's."""
    return hf.get("model_type") == "qwen2_5_vl"


def qwen_vl_from_hf(hf: dict, where: str) -> tuple[ModelConfig, VisionConfig]:
    """(language model, vision section) of a Qwen2.5-VL config.json."""
    model = hf_config.qwen_vl_text(hf, where)
    v = {**_VISION_DEFAULTS, **(hf.get("vision_config") or {})}
    wrong = [f"vision_config.{k}={v[k]!r}" for k, good in (("hidden_act", "silu"),
                                                            ("in_channels", 3)) if v[k] != good]
    if v.get("out_hidden_size", model.hidden_size) != model.hidden_size:
        wrong.append(f"vision_config.out_hidden_size={v['out_hidden_size']} (the language "
                     f"model's hidden_size is {model.hidden_size})")
    if wrong:
        raise ConfigError(f"{where}: " + "; ".join(wrong) + " is not supported")
    ids = {k: hf[k] for k in ("image_token_id", "vision_start_token_id") if k in hf}
    vision = VisionConfig(
        encoder="qwen2.5-vl", image_size=448, patch_size=v["patch_size"],
        num_layers=v["depth"], hidden_size=v["hidden_size"],
        ffn_hidden_size=v["intermediate_size"], num_attention_heads=v["num_heads"],
        activation="silu", spatial_merge_size=v["spatial_merge_size"],
        temporal_patch_size=v["temporal_patch_size"], window_size=v["window_size"],
        full_attention_layers=list(v["fullatt_block_indexes"]), **ids)
    return model, vision


def qwen_vl_to_hf(model: ModelConfig, vision: VisionConfig, dtype: str,
                  base: Optional[dict] = None) -> dict:
    """The ``config.json`` of an exported Qwen2.5-VL model: ``base`` (the one the run started
    from, checked against the model) with its dtype set, else one in the published spelling."""
    if base is not None and is_qwen_vl(base):
        theirs, tower = qwen_vl_from_hf(base, "the source config.json")
        wrong = hf_config.mismatches(model, theirs) + [
            f"vision.{k}={getattr(vision, k)!r} but config.json gives {getattr(tower, k)!r}"
            for k in TOWER_FIELDS if getattr(vision, k) != getattr(tower, k)]
        if wrong:
            raise ConfigError("the checkpoint's model differs from its source config.json: "
                              + "; ".join(wrong))
        return {k: dtype if k in ("torch_dtype", "dtype") else v for k, v in base.items()}
    text = hf_config.to_hf(model.with_(mrope_section=None), dtype)
    text.pop("architectures", None)
    text.update(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"],
                rope_scaling={"type": "mrope", "mrope_section": list(model.mrope_section)},
                image_token_id=vision.image_token_id,
                vision_start_token_id=vision.vision_start_token_id,
                vision_end_token_id=vision.vision_start_token_id + 1,
                vision_config=hf_vision_config(vision, model.hidden_size))
    return text


@dataclass(frozen=True)
class Names:
    """Where a Qwen2.5-VL checkpoint keeps each part: the language model's prefix for
    ``model.*`` names and its lm_head's name, and the tower's prefix."""

    language: str
    head: str
    tower: str

    def text(self, name: str) -> str:
        """A causal LM's tensor name (``model.…``, ``lm_head.weight``) in this file."""
        return self.head if name == "lm_head.weight" else self.language + name[len("model."):]

    @staticmethod
    def of(tensor_names) -> "Names":
        def prefix(suffix: str, default: str) -> str:
            found = sorted(n[:-len(suffix)] for n in tensor_names if n.endswith(suffix))
            return found[0] if found else default

        head = sorted(n for n in tensor_names if n.endswith("lm_head.weight"))
        return Names(prefix("embed_tokens.weight", "model."),
                     head[0] if head else "lm_head.weight",
                     prefix("patch_embed.proj.weight", "visual."))


EXPORT_NAMES = Names("model.", "lm_head.weight", "visual.")  # the published spelling


def tower_shapes(vision: VisionConfig, out_hidden: int, prefix: str) -> dict[str, tuple]:
    """Every tensor of the tower with its shape (transformers' module, checked against it by
    the tests), under ``prefix``."""
    h, f, p, t = vision.hidden_size, vision.ffn_hidden_size, vision.patch_size, \
        vision.temporal_patch_size
    merged = h * vision.spatial_merge_size ** 2  # the merger's input: 2 × 2 patches side by side
    shapes = {"patch_embed.proj.weight": (h, 3, t, p, p), "merger.ln_q.weight": (h,),
              "merger.mlp.0.weight": (merged, merged), "merger.mlp.0.bias": (merged,),
              "merger.mlp.2.weight": (out_hidden, merged), "merger.mlp.2.bias": (out_hidden,)}
    for i in range(vision.num_layers):
        b = f"blocks.{i}."
        shapes.update({b + "norm1.weight": (h,), b + "norm2.weight": (h,),
                       b + "attn.qkv.weight": (3 * h, h), b + "attn.qkv.bias": (3 * h,),
                       b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,),
                       b + "mlp.down_proj.weight": (h, f), b + "mlp.down_proj.bias": (h,)})
        for name in ("gate_proj", "up_proj"):
            shapes.update({f"{b}mlp.{name}.weight": (f, h), f"{b}mlp.{name}.bias": (f,)})
    return {prefix + k: v for k, v in shapes.items()}


@dataclass(frozen=True)
class Parts:
    """A Qwen2.5-VL directory: one place for the language model and the tower."""

    path: Path
    names: Names

    @staticmethod
    def of(pretrained: str) -> "Parts":
        from ray_ppu.hf.files import Checkpoint

        with Checkpoint(pretrained) as ckpt:
            return Parts(Path(pretrained), Names.of(ckpt.files))

    def check(self, model: ModelConfig, vision: VisionConfig) -> None:
        """Every tensor the model reads is there with its shape (headers only)."""
        from ray_ppu.hf.files import Checkpoint
        from ray_ppu.hf.weights import hf_shapes

        expected = {self.names.text(n): s for n, s in hf_shapes(model).items()}
        expected.update(tower_shapes(vision, model.hidden_size, self.names.tower))
        Checkpoint(self.path).check(expected)


def load_pretrained(chunks: list, parts: Parts, model: ModelConfig, vision: VisionConfig,
                    padded_vocab: int) -> dict:
    """Fill this rank's chunks from a Qwen2.5-VL directory (after the header check): the
    language model through the text mapping, the tower's tensors whole."""
    import torch

    from ray_ppu.hf.files import Checkpoint
    from ray_ppu.hf.weights import fill_pieces, load_into, pieces

    parts.check(model, vision)
    with Checkpoint(parts.path) as ckpt, torch.no_grad():
        renamed = _Renamed(ckpt, parts.names)

        def fill(key, layer, offset, out, expert):
            if key.startswith(TOWER):  # replicated: the whole tensor, no offsets
                ckpt.read_into(parts.names.tower + key[len(TOWER):], out)
            else:
                key = key[len(LANGUAGE):]
                fill_pieces(renamed, key, pieces(model, padded_vocab, key, layer, expert),
                            offset, out)
            return True

        return load_into(chunks, ckpt, model, padded_vocab, fill=fill)


class _Renamed:
    """A checkpoint read under the text mapping's names (``model.layers.…``)."""

    def __init__(self, ckpt, names: Names) -> None:
        self.ckpt, self.names = ckpt, names

    def read_into(self, name, out, rows=None, cols=None) -> None:
        self.ckpt.read_into(self.names.text(name), out, rows, cols)


def directory_vision(path: str | Path) -> VisionConfig:
    """The vision section of a Qwen2.5-VL directory: config.json's tower and its
    preprocessor_config.json's pixel bounds (the published ones allow 3136 … 12845056
    pixels, not the processor class's default 1003520)."""
    import json

    from ray_ppu.data.images import PROCESSOR_FILE
    from ray_ppu.data.native_images import NativeImageSpec

    path = Path(path).expanduser()
    vision = qwen_vl_from_hf(hf_config.read(path), str(path / hf_config.CONFIG_FILE))[1]
    processor = path / PROCESSOR_FILE
    if not processor.is_file():
        return vision
    spec = NativeImageSpec.from_hf(json.loads(processor.read_text()), str(processor))
    return vision.with_(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
