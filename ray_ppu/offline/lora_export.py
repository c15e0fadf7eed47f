"""A LoRA run's checkpoint → what users load: a Hugging Face PEFT adapter directory, or the
base with the adapters merged into it.

One process, no model, no device (as :mod:`ray_ppu.offline.mcore_to_hf`): the checkpoint's
adapters are read one layer at a time, whatever layout saved them.

* :func:`export_peft`: ``adapter_config.json`` + ``adapter_model.safetensors``, which
  ``peft.PeftModel.from_pretrained`` loads onto the base (:func:`ray_ppu.hf.peft.to_peft`
  splits a fused adapter into q / k / v and gate / up adapters sharing its A). A
  vision-language model's adapters go onto its language model, named as PEFT finds it on
  transformers 5's ``LlavaForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration``
  (:data:`VL_LAYERS`), and a trained projector or merger as PEFT's ``modules_to_save``; a
  trained ViT or other base part is refused (use --merge).
* :func:`export_merged`: every weight of the base with ``(alpha / r)·B·A`` added to each
  adapted one (in fp32, then cast), and the base parts the run trained taken from the
  checkpoint: a plain Hugging Face model. From a Hugging Face base its tensors are streamed
  one at a time; from a ray_ppu base checkpoint through :func:`~ray_ppu.offline.mcore_to_hf.
  export`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from ray_ppu.checkpoint.processor import carried
from ray_ppu.config.lora import LoraConfig, is_adapter_key
from ray_ppu.errors import ConfigError
from ray_ppu.hf import llava_weights, peft, qwen_vl, weights
from ray_ppu.hf.peft_modules import SAVED_MODULES, VL_LAYERS
from ray_ppu.hf.files import (INDEX_FILE, MAX_SHARD_BYTES, PUBLIC_FILE_MODE, Checkpoint,
                              ShardedWriter)
from ray_ppu.offline.mcore_to_hf import (DTYPES, GENERATION_CONFIG, TOKENIZER_FILES, _layer_slabs,
                                         _reader, _whole, export, hf_dtype_name, stored_tensors)
from ray_ppu.offline.source import Source, lora_base, open_source

# target → the Megatron weight its delta adds to
WEIGHT_OF = {"linear_qkv": weights.QKV, "linear_proj": weights.PROJ,
             "linear_fc1": weights.FC1, "linear_fc2": weights.FC2,
             "experts.linear_fc1": weights.EXPERT_FC1, "experts.linear_fc2": weights.EXPERT_FC2}


def lora_source(path: str | Path) -> tuple[Source, LoraConfig]:
    """The LoRA checkpoint at ``path`` (or the latest in a directory of them) and its lora
    section; a ConfigError if it is not one."""
    source = open_source(path)
    if source.kind != "mcore" or source.meta.lora is None:
        raise ConfigError(f"{path} is not a LoRA run's checkpoint (it holds every weight: "
                          f"export it with mcore-to-hf without --merge)")
    return source, LoraConfig(**source.meta.lora)


_MODEL_PREFIXES = ("decoder", "embedding", "output_layer")  # not optimizer, rng, scheduler
_IMAGE_PREFIXES = (llava_weights.VISION, llava_weights.PROJECTOR)


class _Trained:
    """What a LoRA checkpoint holds, one layer's slab at a time: adapters, and the base parts
    the run trained (``lora.trainable``; a vision-language run's unfrozen ViT or projector).
    Language keys are given without a vision-language model's ``language_model.`` prefix, as
    the text mapping names them; image parts keep their full keys."""

    def __init__(self, source: Source) -> None:
        self.reader = _reader(source.path)
        self.stored = stored_tensors(self.reader)
        self.prefix = llava_weights.LANGUAGE if source.vision.enabled else ""
        language = [k for k in self.stored if k.startswith(self.prefix)
                    and k[len(self.prefix):].split(".")[0] in _MODEL_PREFIXES]
        self.parts = [k[len(self.prefix):] for k in language if not is_adapter_key(k)]
        self.image_parts = [k for k in self.stored if k.startswith(_IMAGE_PREFIXES)]

    def _read(self, keys: list[str], layer: Optional[int]) -> dict[str, torch.Tensor]:
        """{key: its slab of ``layer`` (None: the whole tensor)}."""
        if layer is None:
            return _whole(self.reader, self.stored, keys)
        return _layer_slabs(self.reader, self.stored, keys, layer)

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        """{key: slab of ``layer``} of every per-layer language tensor stored."""
        start = self.prefix + "decoder.layers."  # no optimizer's
        slabs = self._read([k for k in self.stored if k.startswith(start)], layer)
        return {k[len(self.prefix):]: t for k, t in slabs.items()}

    def globals(self) -> dict[str, torch.Tensor]:
        """{key: tensor} of trained base tensors outside the layers (embedding, output layer,
        final norm)."""
        keys = [self.prefix + k for k in self.parts if not k.startswith("decoder.layers.")]
        return {k[len(self.prefix):]: t for k, t in self._read(keys, None).items()}

    def image_part(self, key: str, layer: Optional[int], tensor: torch.Tensor) -> torch.Tensor:
        """The trained ViT / projector tensor ``key`` (``layer``'s slab), else ``tensor``."""
        return self._read([key], layer)[key] if key in self.image_parts else tensor


def _adapters(slabs: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{target: (A, B)} among one layer's slabs."""
    found: dict = {}
    for key, tensor in slabs.items():
        if is_adapter_key(key):
            target, piece = peft.target_of_key(key)
            found.setdefault(target, {})[piece] = tensor.float()
    return {t: (ab["a"], ab["b"]) for t, ab in found.items()}


def export_peft(checkpoint: str | Path, out: str | Path) -> dict:
    """Write the PEFT adapter of a LoRA checkpoint into ``out``; returns a summary. A
    vision-language run's trained projector (LLaVA) or merger (Qwen2.5-VL) goes in as PEFT's
    ``modules_to_save``, which ``PeftModel.from_pretrained`` loads over the base's."""
    started = time.perf_counter()
    source, lora = lora_source(checkpoint)
    model, vision = source.model, source.vision
    trained = _Trained(source)
    saved = SAVED_MODULES.get(vision.native) if vision.enabled else None
    projector = [k for k in trained.image_parts if saved and k.startswith(saved[0])]
    tower = len(trained.image_parts) > len(projector)  # trained image parts beyond it
    if trained.parts or tower:
        what = lora.trainable + (["the vision tower"] if tower else [])
        raise ConfigError(f"{source.path} also trained {', '.join(what)} (full weights, which "
                          f"a PEFT adapter does not carry): export it with --merge")
    language = ((lambda name: VL_LAYERS + name.removeprefix("model.layers")) if vision.enabled
                else (lambda name: name))
    out = Path(out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    experts = sum(t in peft.EXPERT_PARAMETERS for t in lora.targets(model.is_moe)) == 2
    for layer in range(model.num_layers):
        for target, (a, b) in _adapters(trained.layer(layer)).items():
            tensors.update(peft.to_peft(model, target, layer, a, b, experts, language))
    for key, tensor in trained._read(projector, None).items():
        tensors.update(_saved_module_tensors(source, key, tensor))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / peft.WEIGHTS_FILE),
              metadata={"format": "pt"})
    os.chmod(out / peft.WEIGHTS_FILE, PUBLIC_FILE_MODE)
    config = peft.adapter_config(model, lora, source.meta.hf_source or
                                 (source.meta.base or {}).get("path"),
                                 VL_LAYERS if vision.enabled else None,
                                 [saved[1]] if projector else None)
    (out / peft.CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return {"checkpoint": str(source.path), "out": str(out), "format": "peft",
            "tensors": len(tensors), "bytes": sum(t.numel() * t.element_size()
                                                 for t in tensors.values()),
            "modules_to_save": [saved[1]] if projector else [],
            "seconds": time.perf_counter() - started}


def _saved_module_tensors(source: Source, key: str, tensor: torch.Tensor) -> dict:
    """A trained projector / merger tensor under its PEFT name: the transformers 5 module
    path (``model.multi_modal_projector.linear_1.weight``) after PEFT's prefix."""
    if source.vision.native:
        names = [(qwen_vl.EXPORT_NAMES.tower + key[len(qwen_vl.TOWER):], tensor)]
    else:
        names = llava_weights.image_to_hf(source.model, source.vision, key, None, tensor)
    return {f"{peft.PREFIX}model.{name}": part for name, part in names}


def _deltas(model, lora: LoraConfig, slabs: dict) -> dict:
    """{Megatron weight key: what to add} for one layer (experts: [E, …] stacked)."""
    out = {}
    for target, (a, b) in _adapters(slabs).items():
        out[WEIGHT_OF[target]] = lora.scale_of(target) * torch.matmul(b, a)
    return out


def export_merged(checkpoint: str | Path, out: str | Path, dtype: Optional[str] = None,
                  tokenizer: Optional[str | Path] = None,
                  max_shard_bytes: int = MAX_SHARD_BYTES,
                  base_at: Optional[str] = None) -> dict:
    """Write the base with the adapters merged (and the trained base parts) into ``out``;
    ``base_at``: where the base is now, if it moved (checked by its fingerprint)."""
    started = time.perf_counter()
    source, lora = lora_source(checkpoint)
    base = source.meta.base or {}
    if base_at is not None:
        base = {**base, "path": lora_base(source, base_at)}
    trained = _Trained(source)
    base_dir = Path(base.get("path") or source.meta.hf_source or "")
    if base.get("kind") != "mcore" and not (base_dir / "config.json").is_file():
        raise ConfigError(f"{source.path}: its base {base_dir} is not there (a merge reads it)")
    if base.get("kind") == "mcore" or source.vision.enabled:
        with _as_mcore(base, base_dir) as base_checkpoint:
            summary = export(base_checkpoint, out, dtype,
                             tokenizer or carried(source.path) or source.hf_dir,
                             max_shard_bytes, adjust=_Adjust(source.model, lora, trained),
                             adjust_image=trained.image_part)
        return {**summary, "checkpoint": str(source.path), "base": base.get("path"),
                "format": "merged", "seconds": time.perf_counter() - started}
    out = Path(out).expanduser().resolve()
    if any(out.glob("*.safetensors")) or (out / INDEX_FILE).exists():
        raise ConfigError(f"{out} already holds safetensors weights: merge into an empty or new "
                          f"directory (stale shards would be loaded with the new ones)")
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardedWriter(out, max_shard_bytes)
    adjust = _Adjust(source.model, lora, trained)
    model = source.model
    names = list(weights.hf_shapes(model))
    with Checkpoint(base_dir) as ckpt:
        first = ckpt.shapes_of(names[0])[1]
        out_dtype = DTYPES[dtype] if dtype else {"F32": torch.float32, "BF16": torch.bfloat16,
                                                 "F16": torch.float16}[first]
        for layer in [*range(model.num_layers), None]:
            updates = adjust.hf_updates(layer)
            prefix = f"model.layers.{layer}." if layer is not None else None
            for name in names:
                if (prefix is None) == name.startswith("model.layers.") or (
                        prefix and not name.startswith(prefix)):
                    continue
                tensor = ckpt.read(name)
                if name in updates:
                    how, value = updates[name]
                    tensor = value if how == "set" else (tensor.float() + value)
                writer.add(name, tensor.to(out_dtype))
    files = writer.close()
    for name in ("config.json", *TOKENIZER_FILES, GENERATION_CONFIG):
        for where in (Path(tokenizer) if tokenizer else None, carried(source.path), base_dir):
            if where is not None and (where / name).is_file():
                shutil.copyfile(where / name, out / name)
                os.chmod(out / name, PUBLIC_FILE_MODE)
                break
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = hf_dtype_name(out_dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"checkpoint": str(source.path), "base": str(base_dir), "out": str(out),
            "format": "merged", "files": [f.name for f in files], "bytes": writer.total,
            "dtype": hf_dtype_name(out_dtype), "seconds": time.perf_counter() - started}


@contextlib.contextmanager
def _as_mcore(base: dict, base_dir: Path):
    """The base as a ray_ppu checkpoint: itself, or a Hugging Face LLaVA base converted into a
    temporary one (its ViT and projector are then exported through the same path as the
    language model's merged weights)."""
    if base.get("kind") == "mcore":
        yield base["path"]
        return
    from ray_ppu.model import parallel
    from ray_ppu.offline.hf_to_mcore import to_mcore

    with tempfile.TemporaryDirectory(prefix="ray_ppu_merge_") as tmp, \
            parallel.process_group("cpu"):
        to_mcore(base_dir, tmp)
        yield tmp


class _Adjust:
    """What merging does to a base tensor: add its adapters' delta, or take the trained part
    instead. Called with Megatron tensors by :func:`export` (a ray_ppu base), or asked for a
    layer's Hugging Face updates (a Hugging Face base)."""

    def __init__(self, model, lora: LoraConfig, trained: _Trained) -> None:
        self.model, self.lora, self.trained = model, lora, trained
        self._layer: Optional[int] = None
        self._current: tuple[dict, dict] = ({}, {})  # the layer's deltas and trained parts
        self._globals: Optional[dict] = None

    def _of(self, layer: Optional[int]) -> tuple[dict, dict]:
        """(deltas, trained base tensors) of ``layer`` (None: outside the layers)."""
        if layer is None:
            if self._globals is None:
                self._globals = self.trained.globals()
            return {}, self._globals
        if layer != self._layer:  # export asks once per key: read and multiply once per layer
            slabs = self.trained.layer(layer)
            self._layer = layer
            self._current = (_deltas(self.model, self.lora, slabs),
                             {k: v for k, v in slabs.items() if not is_adapter_key(k)})
        return self._current

    def __call__(self, key: str, layer: Optional[int], tensor: torch.Tensor,
                 expert: Optional[int] = None) -> torch.Tensor:
        deltas, parts = self._of(layer)
        if key in parts:
            value = parts[key]
            return value[expert] if expert is not None else value
        if key in deltas:
            delta = deltas[key][expert] if expert is not None else deltas[key]
            return (tensor.float() + delta).to(tensor.dtype)
        return tensor

    def hf_updates(self, layer: Optional[int]) -> dict[str, tuple[str, torch.Tensor]]:
        """{Hugging Face tensor name: ("add", delta) or ("set", trained value)} of a layer."""
        deltas, parts = self._of(layer)
        updates: dict = {}
        v = self.model.vocab_size
        for how, found in (("add", deltas), ("set", parts)):
            for key, tensor in found.items():
                if key in weights.expert_keys(self.model):
                    for e, part in enumerate(tensor):
                        for name, t in weights.to_hf(self.model, v, key, layer, part, e):
                            updates[name] = (how, t.float())
                else:
                    padded = tensor.shape[0] if key in (weights.EMBEDDING, weights.OUTPUT) else v
                    for name, t in weights.to_hf(self.model, padded, key, layer, tensor):
                        updates[name] = (how, t.float())
        return updates
