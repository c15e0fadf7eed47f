"""A ray_ppu checkpoint (torch_dist, saved at any TP / PP / DP) → a Hugging Face directory.

One process, no model, no device, no process group: the checkpoint's metadata gives every
tensor's global shape; torch.distributed.checkpoint reads one layer's slab of each stored
tensor at a time (whatever layout wrote it), :func:`ray_ppu.hf.weights.to_hf` cuts it into
Hugging Face tensors and :class:`ray_ppu.hf.files.ShardedWriter` streams them into ≤ 5 GB
safetensors shards. Peak memory is one shard plus one layer, not the model.

A vision-language model's image side follows the language model: LLaVA's ViT and projector
through :mod:`ray_ppu.hf.llava_weights`; Qwen2.5-VL's tower, transformers' own module stored
whole under its own names (``vision_model.visual.…``), is written back as ``visual.…``, the
published spelling (:data:`ray_ppu.hf.qwen_vl.EXPORT_NAMES`) that every transformers loads.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from ray_ppu.checkpoint.processor import GENERATION_CONFIG, TOKENIZER_FILES, carried
from ray_ppu.data.images import PROCESSOR_FILE, image_spec
from ray_ppu.errors import ConfigError
from ray_ppu.hf import config as hf_config
from ray_ppu.hf import llava, llava_weights, qwen_vl, weights
from ray_ppu.hf.processor import PROCESSOR_CONFIG, processor_files
from ray_ppu.hf.files import INDEX_FILE, MAX_SHARD_BYTES, PUBLIC_FILE_MODE, ShardedWriter

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def hf_dtype_name(dtype: torch.dtype) -> str:
    """config.json's name of a dtype: torch.bfloat16 → "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def stored_tensors(reader) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{key: (global shape, dtype)} of every tensor in a torch_dist checkpoint (metadata only)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = reader.read_metadata()
    return {key: (tuple(value.size), value.properties.dtype)
            for key, value in metadata.state_dict_metadata.items()
            if isinstance(value, TensorStorageMetadata)}


def _reader(path: Path):
    """A torch_dist reader that unpickles the checkpoint's metadata once, not per read."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        _metadata = None

        def read_metadata(self):
            if self._metadata is None:
                self._metadata = super().read_metadata()
            return self._metadata

    return Reader(str(path))


def read_regions(reader, regions: dict[str, tuple[tuple[int, ...], torch.Tensor]]) -> None:
    """Fill each ``{key: (global offset, tensor)}`` with that region of the stored tensor,
    reading only the chunks it overlaps, whatever layout saved them (torch.distributed
    .checkpoint with a planner that asks for the regions; no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RegionPlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, (offset, tensor) in regions.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=tensor.shape)
                items += create_read_items_for_chunk_list(
                    key, self.metadata.state_dict_metadata[key], [chunk])
            return LoadPlan(items)

        def resolve_tensor(self, read_item):
            tensor = regions[read_item.dest_index.fqn][1]
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                tensor = tensor.narrow(dim, start, length)
            return tensor

    dcp.load({}, storage_reader=reader, planner=RegionPlanner(), no_dist=True)


def _copy_side_files(sources: list[Path], out: Path) -> list[str]:
    """Tokenizer files and generation config from the first source directory holding each."""
    copied = []
    for name in (*TOKENIZER_FILES, GENERATION_CONFIG, PROCESSOR_FILE, PROCESSOR_CONFIG):
        for source in sources:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
                os.chmod(out / name, PUBLIC_FILE_MODE)
                copied.append(name)
                break
    return copied


def export(checkpoint_path: str | Path, out: str | Path, dtype: Optional[str] = None,
           tokenizer: Optional[str | Path] = None,
           max_shard_bytes: int = MAX_SHARD_BYTES, adjust: Optional[Callable] = None,
           adjust_image: Optional[Callable] = None) -> dict:
    """Write the Hugging Face form of a ray_ppu checkpoint into ``out``; returns a summary.
    ``adjust(key, layer, tensor, expert)``: each language Megatron tensor as written (a LoRA
    merge adds its adapters there: :mod:`ray_ppu.offline.lora_export`); ``adjust_image(key,
    layer, tensor)`` likewise each ViT / projector tensor (the parts a LoRA run trained).

    1. The checkpoint's model config (its meta), stored keys and shapes; every tensor the
       model needs must be there.
    2. Layer by layer, then embedding, final norm and output layer: read the slab, cut it into
       Hugging Face tensors (cast to ``dtype``, default the stored one), stream into shards.
       A vision-language model's ViT and projector follow (a ``LlavaForConditionalGeneration``).
    3. config.json (the source model's own, when the run started from one), generation config,
       tokenizer files and image processor (from ``tokenizer``, else those the checkpoint
       carries, else the source Hugging Face directory's).
    """
    from ray_ppu.offline.source import open_source

    started = time.perf_counter()
    source = open_source(checkpoint_path)
    if source.kind != "mcore":
        raise ConfigError(f"{checkpoint_path} is already a Hugging Face directory")
    model, path, vision = source.model, source.path, source.vision
    out = Path(out).expanduser().resolve()
    if any(out.glob("*.safetensors")) or (out / INDEX_FILE).exists():
        raise ConfigError(f"{out} already holds safetensors weights: export into an empty or new "
                          f"directory (stale shards would be loaded with the new ones)")
    reader = _reader(path)
    stored = stored_tensors(reader)
    prefix = llava_weights.LANGUAGE if vision.enabled else ""
    _check_stored(stored, model, prefix, path)
    padded_vocab = stored[prefix + weights.EMBEDDING][0][0]
    out_dtype = DTYPES[dtype] if dtype else stored[prefix + weights.QKV][1]
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardedWriter(out, max_shard_bytes)
    rename = (qwen_vl.EXPORT_NAMES.text if vision.native else llava_weights.EXPORT_NAMES.text
              if vision.enabled else (lambda name: name))

    def emit(key: str, layer: Optional[int], tensor: torch.Tensor,
             expert: Optional[int] = None) -> None:
        if adjust is not None:
            tensor = adjust(key, layer, tensor, expert)
        for name, part in weights.to_hf(model, padded_vocab, key, layer, tensor, expert):
            writer.add(rename(name), part.to(out_dtype))

    _export_language(reader, stored, model, prefix, emit)
    whole_tower = False
    if vision.native:
        _export_tower(reader, stored, lambda name, t: writer.add(name, t.to(out_dtype)),
                      adjust_image or (lambda key, layer, tensor: tensor))
    elif vision.enabled:
        whole_tower = _export_image_parts(reader, stored, model, vision, source.hf_dir,
                                          lambda name, t: writer.add(name, t.to(out_dtype)),
                                          adjust_image or (lambda key, layer, tensor: tensor))
    files = writer.close()

    base = source.meta.hf_config
    if vision.native:
        config = qwen_vl.qwen_vl_to_hf(model, vision, hf_dtype_name(out_dtype), base)
    elif vision.enabled:
        config = llava.llava_to_hf(model, vision, hf_dtype_name(out_dtype), base, whole_tower)
    else:
        config = hf_config.to_hf(model, hf_dtype_name(out_dtype), base)
    (out / hf_config.CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    # the tokenizer and image processor the checkpoint carries, else its run's source's
    copied = _side_files(out, [Path(p) for p in (tokenizer, carried(path), source.hf_dir) if p],
                         config, vision)
    return {"checkpoint": str(path), "out": str(out), "files": [f.name for f in files],
            "bytes": writer.total, "dtype": hf_dtype_name(out_dtype), "copied": copied,
            "tokenizer": any(name in copied for name in TOKENIZER_FILES),
            "seconds": time.perf_counter() - started}


def _check_stored(stored: dict, model, prefix: str, path: Path) -> None:
    """Every tensor the model needs is stored (under ``prefix``: a vision-language model's
    language model), with the model config's layer count."""
    expected = weights.layer_keys(model) + weights.expert_keys(model) + weights.global_keys(model)
    missing = [prefix + k for k in expected if prefix + k not in stored]
    if missing:
        family = ("Qwen3-MoE" if model.is_moe else "Qwen3" if model.qk_layernorm
                  else "Qwen2" if model.add_qkv_bias else "LLaMA")
        raise ConfigError(f"{path}: the checkpoint lacks {', '.join(missing)} (not a "
                          f"{family} model of this shape?)")
    layers = stored[prefix + weights.QKV][0][0]
    if layers != model.num_layers:
        raise ConfigError(f"{path}: {layers} layers stored, its model config says "
                          f"{model.num_layers}")


def _layer_slabs(reader, stored: dict, keys: list[str], layer: int) -> dict[str, torch.Tensor]:
    """One layer's slab of each stored per-layer key (a MoE layer's: all its experts)."""
    regions = {key: ((layer,) + (0,) * (len(stored[key][0]) - 1),
                     torch.empty((1, *stored[key][0][1:]), dtype=stored[key][1]))
               for key in keys}
    read_regions(reader, regions)
    return {key: tensor[0] for key, (_, tensor) in regions.items()}


def _whole(reader, stored: dict, keys: list[str]) -> dict[str, torch.Tensor]:
    regions = {key: ((0,) * len(stored[key][0]), torch.empty(stored[key][0], dtype=stored[key][1]))
               for key in keys}
    read_regions(reader, regions)
    return {key: tensor for key, (_, tensor) in regions.items()}


def _export_language(reader, stored: dict, model, prefix: str, emit: Callable) -> None:
    """The language model, layer by layer, then the embedding, final norm and output layer;
    ``emit`` takes the keys without ``prefix``."""
    experts = weights.expert_keys(model)
    per_layer = weights.layer_keys(model) + experts
    for layer in range(model.num_layers):
        slabs = _layer_slabs(reader, stored, [prefix + k for k in per_layer], layer)
        for key in per_layer:
            if key in experts:
                for expert, part in enumerate(slabs[prefix + key]):
                    emit(key, layer, part, expert)
            else:
                emit(key, layer, slabs[prefix + key])
    tensors = _whole(reader, stored, [prefix + k for k in weights.global_keys(model)])
    for key in weights.global_keys(model):
        emit(key, None, tensors[prefix + key])


def _export_image_parts(reader, stored: dict, model, vision, source_dir: Optional[Path],
                        add: Callable, adjust: Callable) -> bool:
    """The ViT (layer by layer) and the projector; then, from the LLaVA directory the run
    started from, the tower's tensors LLaVA never runs (SigLIP's head, the post-norm, layers
    after the feature layer), so that the whole tower goes back. Returns whether it did;
    otherwise the exported tower ends at the feature layer."""
    layer_prefix = llava_weights.VISION + "decoder.layers."
    per_layer = sorted(k for k in stored if k.startswith(layer_prefix))
    written = set()
    for layer in range(vision.layers_built):
        for key, slab in _layer_slabs(reader, stored, per_layer, layer).items():
            slab = adjust(key, layer, slab)
            for name, part in llava_weights.image_to_hf(model, vision, key, layer, slab):
                add(name, part)
                written.add(name)
    others = sorted(k for k in stored if k.startswith((llava_weights.VISION,
                                                       llava_weights.PROJECTOR))
                    and not k.startswith(layer_prefix))
    for key, tensor in _whole(reader, stored, others).items():
        tensor = adjust(key, None, tensor)
        for name, part in llava_weights.image_to_hf(model, vision, key, None, tensor):
            add(name, part)
            written.add(name)
    if llava_weights.copy_unused_tower(source_dir, vision, written, add):
        return True
    # the tower's final LayerNorm, which LLaVA never runs (it reads the hidden states):
    # written as the identity so that transformers finds every tensor it builds
    prefix = llava_weights.EXPORT_NAMES.vision + "post_layernorm."
    dtype = stored[llava_weights.VISION + "conv1.weight"][1]  # the tower's stored dtype
    add(prefix + "weight", torch.ones(vision.hidden_size, dtype=dtype))
    add(prefix + "bias", torch.zeros(vision.hidden_size, dtype=dtype))
    return False


def _export_tower(reader, stored: dict, add: Callable, adjust: Callable) -> None:
    """Qwen2.5-VL's tower (patch embedding, blocks, merger): each stored tensor whole, under
    the published name (``visual.…``); ``adjust`` as for LLaVA's image parts."""
    keys = sorted(k for k in stored if k.startswith(qwen_vl.TOWER))
    if not keys:
        raise ConfigError(f"the checkpoint holds no {qwen_vl.TOWER}* tensors (a Qwen2.5-VL "
                          f"model's vision tower)")
    for key in keys:  # one at a time: a block's tensors are MBs
        tensor = adjust(key, None, _whole(reader, stored, [key])[key])
        add(qwen_vl.EXPORT_NAMES.tower + key[len(qwen_vl.TOWER):], tensor)


def _side_files(out: Path, sources: list[Path], config: dict, vision) -> list[str]:
    """Tokenizer files, generation config and a vision-language model's image processor
    config: copied from the first source holding each, else written from the config; and
    the processor config and image-taking chat template :mod:`ray_ppu.hf.processor` writes."""
    copied = _copy_side_files(sources, out)
    if GENERATION_CONFIG not in copied:
        text = config.get("text_config", config)
        generation = {k: text[k] for k in ("bos_token_id", "eos_token_id") if k in text}
        (out / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
    if vision.enabled and PROCESSOR_FILE not in copied:  # the encoder family's processor
        from ray_ppu.data.sft.image_samples import native_spec

        spec = native_spec(vision, None) if vision.native else image_spec(vision)
        (out / PROCESSOR_FILE).write_text(json.dumps(spec.to_hf(), indent=2) + "\n")
        copied.append(PROCESSOR_FILE)
    if vision.enabled:  # what AutoProcessor needs to prompt it with images
        for name, text in processor_files(vision, out).items():
            if name not in copied:
                (out / name).write_text(text)
                copied.append(name)
    return copied
