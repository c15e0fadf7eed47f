"""Where a run's checkpoints live on disk and which of them can be loaded.

The save root (:func:`save_root`), the ``iter_NNNNNNN[_k]`` directories in it, the
``ray_ppu_meta.json`` that marks one complete (:class:`Meta`), the checks that its files are
all still there (:func:`damage`), and the deleting of interrupted saves and surplus
checkpoints (:func:`remove_incomplete`, :func:`prune`).

No torch at import: the driver and Ray Train's controller look for checkpoints too, and they
need only the file system for it. :func:`_new_dir`, the one collective here, imports
torch.distributed when a save calls it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ray_ppu.config.schema import RunConfig

log = logging.getLogger("ray_ppu")

META_FILE = "ray_ppu_meta.json"
FORMAT_VERSION = 1
_DIR_PATTERN = re.compile(r"^iter_(\d{7,})(?:_(\d+))?$")
_warned: set = set()


@dataclass(frozen=True)
class Meta:
    """``ray_ppu_meta.json``: what a complete checkpoint holds, readable without torch."""

    iteration: int
    consumed_samples: int
    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    data_parallel_size: int
    global_batch_size: int
    config_hash: str
    optimizer_format: str
    saved_at: float
    format_version: int = FORMAT_VERSION
    expert_model_parallel_size: int = 1
    """EP of a MoE run (1: dense, or a checkpoint from before MoE)."""
    expert_tensor_parallel_size: int = 1
    """ETP of a MoE run."""
    files: Optional[dict] = None
    """Every file the save wrote (name → bytes): a load first checks they are all there."""
    weights_only: bool = False
    """Model weights and nothing else (``convert_checkpoint.py hf-to-mcore``): always loaded
    as a fine-tune start (iteration 0, fresh optimizer and data)."""
    model: Optional[dict] = None
    """The ModelConfig the weights belong to (export and generation read it)."""
    hf_config: Optional[dict] = None
    """The Hugging Face config.json the run's weights came from, if they did (export writes it
    back, with its token ids and other fields ray_ppu has no use for)."""
    hf_source: Optional[str] = None
    """That Hugging Face directory (export copies its tokenizer and generation config)."""
    lora: Optional[dict] = None
    """A LoRA run's lora section: the checkpoint holds its adapters (and the base parts it
    trains), not the base."""
    vision: Optional[dict] = None
    """A vision-language model's vision section (its encoder, projector and image token):
    export, generation and a later stage read the architecture from it."""
    base: Optional[dict] = None
    """A LoRA run's base: path, kind (hf / mcore) and content fingerprint
    (:mod:`ray_ppu.checkpoint.base`); a resume on another base is refused."""

    @classmethod
    def from_dict(cls, values: dict) -> "Meta":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


def run_name(cfg: RunConfig) -> str:
    """The Ray Train run name: ``output.name``, else the output directory's name."""
    return cfg.output.name or Path(cfg.output.dir).expanduser().resolve().name


def save_root(cfg: RunConfig) -> Path:
    """Where this run's checkpoints go: Ray Train's experiment directory of the run,
    ``<output.dir>/ray_train/<run name>`` (Ray registers checkpoints only inside it)."""
    return Path(cfg.output.dir).expanduser().resolve() / "ray_train" / run_name(cfg)


def config_hash(cfg: RunConfig) -> str:
    """Hash of what must not change across a resume for the data position and the weights to
    mean the same: the model, the data sources and split, global batch, sequence length, seed."""
    d, t = cfg.data, cfg.training
    key = {
        "model": dataclasses.asdict(cfg.model),
        "data": [d.data_path, d.valid_data_path, d.split, d.eod_token_id],
        "training": [t.global_batch_size, t.seq_length, t.seed],
    }
    if cfg.lora.enabled:  # (a full run's hash is what it was before LoRA existed)
        key["lora"] = dataclasses.asdict(cfg.lora.with_(adapter=None))
    if cfg.vision.enabled:  # the architecture; what is frozen may change on a resume
        key["vision"] = dataclasses.asdict(cfg.vision.with_(freeze=[]))
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def read_meta(path: str | Path) -> Optional[Meta]:
    """The meta of a complete checkpoint directory; None when it has none (incomplete)."""
    try:
        return Meta.from_dict(json.loads((Path(path) / META_FILE).read_text()))
    except FileNotFoundError:
        return None


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def checkpoint_dirs(root: str | Path) -> list[Path]:
    """Directories under ``root`` named like checkpoints (``iter_NNNNNNN[_k]``), complete or not."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _DIR_PATTERN.match(p.name))


def damage(path: str | Path, meta: Meta) -> Optional[str]:
    """What is wrong with a checkpoint whose save finished: files its meta lists that are now
    missing or of another size (a partial copy, a cleanup gone wrong); None when intact."""
    if not meta.files:  # saved before files were listed
        return None
    problems = []
    for name, size in sorted(meta.files.items()):
        try:
            actual = (Path(path) / name).stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} missing")
            continue
        if actual != size:
            problems.append(f"{name} has {actual} bytes, not {size}")
    if not problems:
        return None
    more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
    return ", ".join(problems[:5]) + more


def complete_checkpoints(root: str | Path, warn: bool = True) -> list[tuple[Path, Meta]]:
    """Complete, intact checkpoints under ``root``, oldest first (by iteration, then save
    time). Skipped, with a warning unless ``warn`` is False (while the run saves, one may be in
    progress): directories without the meta file (the save did not finish) and those whose
    files no longer match their meta (:func:`damage`): a resume falls back to the one before."""
    found = []
    for path in checkpoint_dirs(root):
        meta = read_meta(path)
        if meta is None:
            if warn:
                _warn_once(f"checkpoint {path} has no {META_FILE}: its save did not finish; "
                           f"ignored")
            continue
        broken = damage(path, meta)
        if broken:
            if warn:
                _warn_once(f"checkpoint {path} is damaged ({broken}): ignored, an older one is "
                           f"used")
            continue
        found.append((path, meta))
    return sorted(found, key=lambda item: (item[1].iteration, item[1].saved_at))


def latest(root: str | Path) -> Optional[tuple[Path, Meta]]:
    """The newest complete checkpoint under ``root``, or None."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def remove_incomplete(root: str | Path) -> list[Path]:
    """Delete the run's interrupted saves (``iter_*`` directories without the meta file): a
    group that starts is the only writer of its save root, so none of them is still being
    written, and none will ever load. Returns what it removed."""
    removed = []
    for path in checkpoint_dirs(root):
        if read_meta(path) is None:
            shutil.rmtree(path, ignore_errors=True)
            log.warning("removed %s: an interrupted save (no %s)", path, META_FILE)
            removed.append(path)
    return removed


def prune(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (the torchrun path; under
    Ray, Ray Train's CheckpointConfig(num_to_keep) deletes the ones it registered)."""
    removed = []
    for path, _ in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _new_dir(root: Path, iteration: int) -> Path:
    """A fresh directory for a checkpoint, chosen on rank 0 and shared with every rank.

    ``iter_NNNNNNN``, or ``iter_NNNNNNN_k`` when that name is taken (an interrupted save of the
    same iteration, or another run's checkpoint): never write into a used directory.
    """
    import torch.distributed as dist  # here, not above: the rest of this module runs without torch

    chosen = [None]
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        name, k = f"iter_{iteration:07d}", 1
        while (root / name).exists():
            k += 1
            name = f"iter_{iteration:07d}_{k}"
        (root / name).mkdir()
        chosen = [name]
    dist.broadcast_object_list(chosen, src=0)
    return root / chosen[0]
