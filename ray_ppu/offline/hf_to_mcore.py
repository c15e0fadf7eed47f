"""Hugging Face directory → ray_ppu checkpoint (torch_dist, weights only), for runs that start
from the same model again and again (``checkpoint.load`` then skips the safetensors reads).

The model is built at the requested TP × PP on the current process group (one process, or
torchrun ranks: the weights are split across them), filled from the safetensors slices each
rank holds, and saved with the same code training checkpoints use. torch_dist reshards on load,
so the layout converted at does not bind the runs that load it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from ray_ppu import checkpoint, devices
from ray_ppu.config.schema import RunConfig
from ray_ppu.errors import ConfigError
from ray_ppu.offline.mcore_to_hf import DTYPES, hf_dtype_name
from ray_ppu.offline.source import Source, inference_config, open_source
from ray_ppu.plan import Plan

# config.json's torch_dtype → the training precision whose parameters keep it exactly
PRECISION = {hf_dtype_name(dtype): precision for precision, dtype in DTYPES.items()}


def conversion_plan(hf_dir: str | Path, world_size: int, tp: int = 1, pp: int = 1,
                    precision: Optional[str] = None, backend: str = "cpu",
                    ep: int = 1) -> tuple[Source, str, RunConfig, Plan]:
    """hf-to-mcore's checks for a world of ``world_size``: the source (it must be a Hugging
    Face directory), the precision (config.json's torch_dtype unless given) and the TP × PP
    layout (× EP for a MoE model's experts, each whole on its rank) against the model;
    ConfigError naming the problem.

    Imports no Megatron-Core, so the entry point runs it before any rank joins the process
    group (a bad --tp is one error line in about a second); :func:`to_mcore` runs it again for
    the group it is given.
    """
    source = open_source(hf_dir)
    if source.kind != "hf":
        raise ConfigError(f"{hf_dir} is not a Hugging Face model directory")
    dtype = source.hf_config.get("torch_dtype") or source.hf_config.get("dtype") or "float32"
    precision = precision or PRECISION.get(dtype, "fp32")
    cfg, plan = inference_config(source.model, world_size, tp, pp, precision=precision,
                                 device=backend, ep=ep, etp=1 if ep > 1 else None,
                                 vision=source.vision)
    return source, precision, cfg, plan


def to_mcore(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1,
             precision: Optional[str] = None, device: str = "cpu", ep: int = 1) -> dict:
    """Convert; collective over the current process group. Returns a summary (rank 0's).

    1. :func:`conversion_plan` for this group: model config from config.json, precision,
       layout.
    2. The model at TP × PP (DP = the remaining ranks), without random initialisation.
    3. Every rank reads its slices from the safetensors files.
    4. A weights-only checkpoint ``<out>/iter_0000000`` (meta: model config, source
       config.json and directory, so an export restores them).
    """
    from ray_ppu.offline.inference import built_model, load_weights

    started = time.perf_counter()
    backend = devices.resolve(device)
    source, precision, cfg, plan = conversion_plan(hf_dir, dist.get_world_size(), tp, pp,
                                                   precision, backend, ep)
    with built_model(cfg, plan, backend, int(os.environ.get("LOCAL_RANK", 0))) as chunks:
        read = load_weights(chunks, source, cfg, plan)
        saver = checkpoint.Saver(out, plan, cfg, origin={"hf_config": source.hf_config,
                                                         "hf_source": str(source.path)},
                                 carried=_carried(cfg, source) if dist.get_rank() == 0 else None)
        [(path, meta, _)] = saver.save(0, chunks, None, None)
    return {"checkpoint": str(path), "precision": precision, "tp": tp, "pp": pp, "ep": ep,
            "bytes_read_rank0": read["bytes_read"], "files": len(meta.files or {}),
            "seconds": time.perf_counter() - started}


def _carried(cfg: RunConfig, source: Source) -> dict:
    """The source directory's tokenizer, generation config and image processor, for the
    checkpoint to carry (:mod:`ray_ppu.checkpoint.processor`)."""
    import dataclasses

    from ray_ppu.checkpoint.processor import gather
    from ray_ppu.data.sft.image_samples import processor_file

    read_from = dataclasses.replace(cfg, checkpoint=dataclasses.replace(
        cfg.checkpoint, pretrained=str(source.path)))
    return gather(read_from, str(source.path), processor_file(read_from))
