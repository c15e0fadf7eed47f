"""Where each tensor of a vision-language model lives in Hugging Face checkpoints, and
loading it at any TP / PP.

A LLaVA directory's tensors come in two spellings: the model's own module names
(``model.vision_tower.…``, ``model.multi_modal_projector.…``, ``model.language_model.…``,
``lm_head.weight``), and the checkpoint spelling ``save_pretrained`` writes (transformers 4 and
5.25 alike, and most published LLaVA checkpoints): ``vision_tower.…``,
``multi_modal_projector.…``, ``language_model.model.…``, ``language_model.lm_head.weight``.
Both are read (:class:`Names`); exports write the second. A run may also start from separate
parts (LLaVA / Bunny stage 1, :class:`Parts`): a vision tower directory (a SigLIP or CLIP
checkpoint, vision-only or with its text tower: tensors under ``vision_model.``), a language
model directory, and a fresh projector.

The ViT's Megatron tensors, by rows (:class:`~ray_ppu.hf.weights.Piece`), h = ViT width,
d = head width: ``linear_qkv`` [3·h, h] holds, head by head, that head's query, key and value
rows (Megatron's layout with as many groups as heads), its bias likewise; the layer norms are
stored under Transformer Engine's fused names (``linear_qkv.layer_norm_weight`` is
``layer_norm1``, ``linear_fc1.layer_norm_weight`` is ``layer_norm2``); ``class_token``
[1, 1, h] is CLIP's ``class_embedding`` [h]. Tensors LLaVA never runs (SigLIP's pooling head
and post-norm, layers after the feature layer) are not read. The language model's tensors
are the text mapping's (:mod:`ray_ppu.hf.weights`) under the file's language prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ray_ppu.config.schema import ModelConfig
from ray_ppu.config.vision import VisionConfig
from ray_ppu.hf.files import Checkpoint
from ray_ppu.hf.weights import Piece, cut, fill_pieces, hf_shapes, load_into, pieces

_LAYER = "decoder.layers."
# ViT Megatron key (after ``vision_model.``) → HF name under the tower's ``encoder.layers.N.``
_LAYER_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "layer_norm1.weight",
    "self_attention.linear_qkv.layer_norm_bias": "layer_norm1.bias",
    "self_attention.linear_proj.weight": "self_attn.out_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.out_proj.bias",
    "mlp.linear_fc1.layer_norm_weight": "layer_norm2.weight",
    "mlp.linear_fc1.layer_norm_bias": "layer_norm2.bias",
    "mlp.linear_fc1.weight": "mlp.fc1.weight",
    "mlp.linear_fc1.bias": "mlp.fc1.bias",
    "mlp.linear_fc2.weight": "mlp.fc2.weight",
    "mlp.linear_fc2.bias": "mlp.fc2.bias",
}
_GLOBAL_NAMES = {"conv1.weight": "embeddings.patch_embedding.weight",
                 "conv1.bias": "embeddings.patch_embedding.bias",
                 "position_embeddings.weight": "embeddings.position_embedding.weight",
                 "class_token": "embeddings.class_embedding",
                 "ln_pre.weight": "pre_layrnorm.weight", "ln_pre.bias": "pre_layrnorm.bias"}
_PROJECTOR_NAMES = {"encoder.linear_fc1.weight": "linear_1.weight",
                    "encoder.linear_fc1.bias": "linear_1.bias",
                    "encoder.linear_fc2.weight": "linear_2.weight",
                    "encoder.linear_fc2.bias": "linear_2.bias"}
VISION, PROJECTOR, LANGUAGE = "vision_model.", "vision_projection.", "language_model."


@dataclass(frozen=True)
class Names:
    """Where a checkpoint keeps each part: ``language`` maps a causal LM's names
    (``model.…``, ``lm_head.weight``) to this file's; ``vision`` prefixes the ViT's names
    (``embeddings.…``, ``encoder.layers.…``) and ``projector`` the projector's
    (``linear_1``, ``linear_2``)."""

    language: tuple[str, str]  # (prefix for model.*, name of lm_head.weight)
    vision: str
    projector: str

    def text(self, name: str) -> str:
        if name == "lm_head.weight":
            return self.language[1]
        return self.language[0] + name.removeprefix("model.")

    @staticmethod
    def of(tensor_names) -> "Names":
        """The spelling of a checkpoint, found from its tensor names: the prefixes in front of
        the token embedding, the patch embedding and the projector's first linear."""
        def prefix(suffix: str, default: str) -> str:
            found = sorted(n[:-len(suffix)] for n in tensor_names if n.endswith(suffix))
            return found[0] if found else default

        language = prefix("embed_tokens.weight", "model.language_model.")
        head = [n for n in tensor_names if n.endswith("lm_head.weight")]
        return Names((language, head[0] if head else "lm_head.weight"),
                     prefix("embeddings.patch_embedding.weight", "model.vision_tower."),
                     prefix("multi_modal_projector.linear_1.weight", "model.") +
                     "multi_modal_projector.")


# what save_pretrained writes (transformers 5.x and 4.x alike), which exports write
EXPORT_NAMES = Names(("language_model.model.", "language_model.lm_head.weight"), "vision_tower.",
                     "multi_modal_projector.")


def image_to_hf(model: ModelConfig, vision: VisionConfig, key: str, layer: Optional[int],
                tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A whole stored ViT or projector tensor (``key`` with its ``vision_model.`` /
    ``vision_projection.`` prefix; one layer's slab for layer keys) as Hugging Face tensors
    under :data:`EXPORT_NAMES`."""
    if key.startswith(PROJECTOR):
        key = key[len(PROJECTOR):]
        return cut(key, tensor, projector_pieces(model, key, EXPORT_NAMES.projector))
    key = key[len(VISION):]
    if key == "class_token":  # [1, 1, h] → [h]
        return [(vision_pieces(vision, key, None, EXPORT_NAMES.vision)[0].name, tensor.view(-1))]
    return cut(key, tensor, vision_pieces(vision, key, layer, EXPORT_NAMES.vision))


def vision_pieces(vision: VisionConfig, key: str, layer: Optional[int],
                  prefix: str) -> list[Piece]:
    """The rows of ViT tensor ``key`` (after ``vision_model.``; of ``layer`` for layer keys) as
    HF pieces under ``prefix`` (the tower's place in the file)."""
    base = prefix
    h = vision.hidden_size
    if key.startswith(_LAYER):
        name = key[len(_LAYER):]
        hf = f"{base}encoder.layers.{layer}."
        if name in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = name.rsplit(".", 1)[1]
            d = h // vision.num_attention_heads
            return [Piece(f"{hf}self_attn.{p}_proj.{kind}", head * d, d)
                    for head in range(vision.num_attention_heads) for p in "qkv"]
        if name not in _LAYER_NAMES:
            raise KeyError(f"no Hugging Face counterpart for ViT tensor {key}")
        rows = h if "linear_fc1" not in name or "layer_norm" in name else vision.ffn_hidden_size
        return [Piece(hf + _LAYER_NAMES[name], 0, rows)]
    if key not in _GLOBAL_NAMES:
        raise KeyError(f"no Hugging Face counterpart for ViT tensor {key}")
    rows = {"position_embeddings.weight": vision.patches + int(vision.class_token),
            "class_token": 1}.get(key, h)
    return [Piece(base + _GLOBAL_NAMES[key], 0, rows)]


def projector_pieces(model: ModelConfig, key: str, prefix: str) -> list[Piece]:
    """The rows of projector tensor ``key`` (after ``vision_projection.``) as HF pieces."""
    if key not in _PROJECTOR_NAMES:
        raise KeyError(f"no Hugging Face counterpart for projector tensor {key}")
    return [Piece(prefix + _PROJECTOR_NAMES[key], 0, model.hidden_size)]


def vision_shapes(vision: VisionConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The ViT tensors a checkpoint must hold for the layers the model runs, with shapes."""
    h, f, p = vision.hidden_size, vision.ffn_hidden_size, vision.patch_size
    base = prefix
    shapes = {base + "embeddings.patch_embedding.weight": (h, 3, p, p),
              base + "embeddings.position_embedding.weight":
                  (vision.patches + int(vision.class_token), h)}
    if vision.class_token:
        shapes.update({base + "embeddings.class_embedding": (h,),
                       base + "pre_layrnorm.weight": (h,), base + "pre_layrnorm.bias": (h,)})
    else:
        shapes[base + "embeddings.patch_embedding.bias"] = (h,)
    for layer in range(vision.layers_built):
        hf = f"{base}encoder.layers.{layer}."
        for proj in ("q", "k", "v", "out"):
            shapes[f"{hf}self_attn.{proj}_proj.weight"] = (h, h)
            shapes[f"{hf}self_attn.{proj}_proj.bias"] = (h,)
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[f"{hf}{norm}.weight"] = shapes[f"{hf}{norm}.bias"] = (h,)
        shapes.update({f"{hf}mlp.fc1.weight": (f, h), f"{hf}mlp.fc1.bias": (f,),
                       f"{hf}mlp.fc2.weight": (h, f), f"{hf}mlp.fc2.bias": (h,)})
    return shapes


def projector_shapes(model: ModelConfig, vision: VisionConfig,
                     prefix: str) -> dict[str, tuple[int, ...]]:
    """The projector's tensors with shapes."""
    h, v = model.hidden_size, vision.hidden_size
    shapes = {prefix + "linear_1.weight": (h, v), prefix + "linear_2.weight": (h, h)}
    if vision.projector_bias:
        shapes.update({prefix + "linear_1.bias": (h,), prefix + "linear_2.bias": (h,)})
    return shapes


@dataclass(frozen=True)
class Parts:
    """Where a vision-language model's weights come from: one LLaVA directory, or a language
    model directory plus a vision tower directory (the projector then starts fresh)."""

    language: Path
    vision: Path
    names: Names
    projector: bool  # whether the projector is read (False: it keeps its initialisation)

    @staticmethod
    def of(pretrained: str, vision_tower: Optional[str] = None) -> "Parts":
        with Checkpoint(pretrained) as ckpt:
            names = Names.of(ckpt.files)
        if vision_tower is None:
            return Parts(Path(pretrained), Path(pretrained), names, True)
        with Checkpoint(vision_tower) as ckpt:  # its own spelling: vision_model.… mostly
            tower = Names.of(ckpt.files)
        return Parts(Path(pretrained), Path(vision_tower),
                     Names(names.language, tower.vision, ""), False)

    def check(self, model: ModelConfig, vision: VisionConfig) -> None:
        """Every tensor the model reads is there with its shape (headers only)."""
        text = {self.names.text(name): shape for name, shape in hf_shapes(model).items()}
        image = vision_shapes(vision, self.names.vision)
        if self.projector:
            image.update(projector_shapes(model, vision, self.names.projector))
        if self.language == self.vision:
            Checkpoint(self.language).check({**text, **image})
        else:
            Checkpoint(self.language).check(text)
            Checkpoint(self.vision).check(image)


class _Renamed:
    """A checkpoint read under the text mapping's names (``model.layers.…``)."""

    def __init__(self, ckpt: Checkpoint, names: Names) -> None:
        self.ckpt, self.names = ckpt, names

    def read_into(self, name, out, rows=None, cols=None) -> None:
        self.ckpt.read_into(self.names.text(name), out, rows, cols)


@torch.no_grad()
def load_pretrained(chunks: list, parts: Parts, model: ModelConfig, vision: VisionConfig,
                    padded_vocab: int) -> dict:
    """Fill this rank's chunks of a vision-language model from ``parts`` (after the header
    check): the language model through the text mapping, the ViT and projector by
    :func:`vision_pieces` / :func:`projector_pieces`."""
    parts.check(model, vision)
    with Checkpoint(parts.language) as text_ckpt, Checkpoint(parts.vision) as image_ckpt:
        renamed = _Renamed(text_ckpt, parts.names)

        def fill(key, layer, offset, out, expert):
            if key.startswith(LANGUAGE):
                key = key[len(LANGUAGE):]
                fill_pieces(renamed, key, pieces(model, padded_vocab, key, layer, expert),
                            offset, out)
            elif key.startswith(PROJECTOR):
                if not parts.projector:
                    return False
                key = key[len(PROJECTOR):]
                fill_pieces(image_ckpt, key, projector_pieces(model, key, parts.names.projector),
                            offset, out)
            elif key == VISION + "class_token":  # [1, 1, h] ← [h]
                image_ckpt.read_into(vision_pieces(vision, "class_token", None,
                                                   parts.names.vision)[0].name, out.view(-1))
            else:
                key = key[len(VISION):]
                fill_pieces(image_ckpt, key, vision_pieces(vision, key, layer,
                                                           parts.names.vision), offset, out)
            return True

        took = load_into(chunks, text_ckpt, model, padded_vocab, fill=fill)
        took["bytes_read"] += image_ckpt.bytes_read if parts.vision != parts.language else 0
        return took


def copy_unused_tower(source: Optional[Path], vision: VisionConfig, written: set,
                      add) -> bool:
    """``add(name, tensor)`` each vision tower tensor of the LLaVA directory ``source`` that an
    export did not write (``written``): the ones LLaVA never runs. Only when ``source`` is a
    LLaVA directory of this very tower; returns whether it was."""
    from ray_ppu.hf.config import read
    from ray_ppu.hf.llava import is_llava, llava_from_hf

    if source is None or not (source / "config.json").is_file():
        return False
    raw = read(source)
    if not is_llava(raw) or llava_from_hf(raw, str(source))[1].with_(freeze=vision.freeze) != vision:
        return False
    with Checkpoint(source) as ckpt:
        prefix = Names.of(ckpt.files).vision
        for name in sorted(ckpt.files):
            ours = EXPORT_NAMES.vision + name[len(prefix):]
            if name.startswith(prefix) and ours not in written:
                add(ours, ckpt.read(name))
    return True
