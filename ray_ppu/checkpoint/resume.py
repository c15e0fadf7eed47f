"""Where a run starts, decided in one place, and the check of the weights it starts from.

:func:`resume_point` is the one rule (the package docstring says why the file system decides
and who asks it); :func:`record_stream_start` writes down what a (re)started group chose;
:func:`origin` carries the Hugging Face source of the weights into later checkpoints;
:func:`check_sources` checks, before any worker starts, that the weights a run starts from
(Hugging Face files or a checkpoint) fit its model.

No torch at import: the driver calls all of these before any worker exists.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ray_ppu.checkpoint import base
from ray_ppu.checkpoint.layout import META_FILE, Meta, damage, latest, read_meta, save_root
from ray_ppu.config.schema import RunConfig
from ray_ppu.data.sampler import valid_start
from ray_ppu.errors import CheckpointError, ConfigError
from ray_ppu.util.fs import atomic_write_text

STREAM_START_FILE = "stream_start.json"


@dataclass(frozen=True)
class ResumePoint:
    """A complete checkpoint a run starts from; ``weights_only`` for ``checkpoint.finetune``."""

    path: str
    meta: Meta
    weights_only: bool = False

    @property
    def iteration(self) -> int:
        """The iteration training continues at (0 when only the weights are taken)."""
        return 0 if self.weights_only else self.meta.iteration


def resume_point(cfg: RunConfig) -> Optional[ResumePoint]:
    """Where this run starts: THE decision, made the same way by the driver and every worker
    (package docstring).

    1. The latest complete checkpoint in the run's own save root: an exact resume.
    2. Else ``checkpoint.load``: a checkpoint directory, or a directory of them (the latest
       complete one); weights only when ``checkpoint.finetune``. Not for LoRA, whose
       ``checkpoint.load`` is the base it reads at every start (:mod:`ray_ppu.checkpoint.base`).
    3. Else None: a fresh start.
    """
    own = latest(save_root(cfg))
    if own is not None:
        return ResumePoint(str(own[0]), own[1])
    if not cfg.checkpoint.load or cfg.lora.enabled:  # LoRA: checkpoint.load is the base
        return None
    load = Path(cfg.checkpoint.load).expanduser()
    meta = read_meta(load)
    if meta is not None:
        broken = damage(load, meta)
        if broken:
            raise CheckpointError(f"checkpoint.load {load} is damaged: {broken}")
        found: Optional[tuple[Path, Meta]] = (load, meta)
    elif (load / "metadata.json").is_file():  # a Megatron checkpoint whose save did not finish
        raise CheckpointError(f"checkpoint.load {load} has no {META_FILE}: its save did not "
                              f"finish; point checkpoint.load at a complete checkpoint")
    else:
        found = latest(load)
    if found is None:
        raise CheckpointError(f"checkpoint.load {load}: no complete checkpoint there "
                              f"(a directory with {META_FILE}, or a directory of them)")
    return ResumePoint(str(found[0].resolve()), found[1],
                       weights_only=cfg.checkpoint.finetune or found[1].weights_only)


def check_sources(cfg: RunConfig) -> None:
    """The weights the run starts from fit its model, before any worker starts: the Hugging
    Face files of ``checkpoint.pretrained`` (every tensor's name and shape), or the recorded
    model of ``checkpoint.load``. (The checkpoint fields' own rules are the plan's:
    :func:`ray_ppu.plan.rules.checkpoint_problems`.)"""
    c = cfg.checkpoint
    if c.pretrained:
        from ray_ppu.hf import pretrained

        pretrained.check(cfg)
    if cfg.lora.enabled:
        _check_lora_sources(cfg)
    elif c.load:
        try:
            start = resume_point(cfg)
        except CheckpointError:
            return  # the workers' load names what is wrong with it
        if start is not None:
            _check_model(start, cfg)


def _check_lora_sources(cfg: RunConfig) -> None:
    """A LoRA run's base: a checkpoint.load with every weight of this model (not another LoRA
    run's adapters); and a checkpoint of its own it resumes from was trained on that base."""
    found = base.base_dir(cfg)
    if found is None:
        return  # the plan's rules name the missing base
    kind, path = found
    if kind == "mcore":
        meta = read_meta(path)
        if meta.lora is not None:
            raise ConfigError(f"checkpoint.load {path} holds a LoRA run's adapters, not a base "
                              f"model: merge them into one first (convert_checkpoint.py "
                              f"mcore-to-hf --merge), or continue that run in its own output.dir")
        _check_model(ResumePoint(str(path), meta, weights_only=True), cfg)
    own = latest(save_root(cfg))
    if own is not None:
        base.check_same_base(str(own[0]), own[1].base, base.identity(cfg))


# Fields that shape the weights: a checkpoint of another architecture cannot be loaded.
_WEIGHT_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "vocab_size", "add_qkv_bias",
                  "untie_embeddings_and_output_weights", "qk_layernorm")


def _check_model(start: ResumePoint, cfg: RunConfig) -> None:
    """The checkpoint's recorded model (if it records one) has this run's weight shapes."""
    saved = start.meta.model
    if not saved:
        return
    wrong = [f"model.{k}: checkpoint {saved[k]!r}, this run {getattr(cfg.model, k)!r}"
             for k in _WEIGHT_FIELDS if k in saved and saved[k] != getattr(cfg.model, k)]
    # the head width: None means hidden / heads, so compare the widths, not the settings
    heads = saved.get("num_attention_heads")
    width = saved.get("kv_channels") or (saved.get("hidden_size", 0) // heads if heads else None)
    if width and width != cfg.model.effective_kv_channels:
        wrong.append(f"model.kv_channels: checkpoint {width}, this run "
                     f"{cfg.model.effective_kv_channels}")
    wrong += _vision_differences(start.meta.vision, cfg)
    if wrong:
        raise ConfigError(f"{start.path} holds another model than this run's: "
                          + "; ".join(wrong))


def _vision_differences(saved: Optional[dict], cfg: RunConfig) -> list[str]:
    """How the checkpoint's vision section (None: a text model) differs from the run's, in
    what shapes the weights; what is frozen may change (stage 1 → stage 2)."""
    ours = dataclasses.asdict(cfg.vision)
    if saved is None and not ours["encoder"]:
        return []
    if saved is None:
        return [f"vision.encoder: the checkpoint is a text model, this run {ours['encoder']!r}"]
    if not ours["encoder"]:
        return [f"vision.encoder: the checkpoint is a vision-language model "
                f"({saved['encoder']!r}), this run a text model (set its vision-language "
                f"model.preset, or the vision section)"]
    return [f"vision.{k}: checkpoint {saved[k]!r}, this run {ours[k]!r}"
            for k in sorted(ours) if k != "freeze" and k in saved and saved[k] != ours[k]]


def origin(cfg: RunConfig, resume: Optional[ResumePoint]) -> dict:
    """Where the run's weights came from, for its checkpoints' meta: the Hugging Face config
    and directory of ``checkpoint.pretrained``, or carried over from the checkpoint it loaded;
    for LoRA also the base's identity (:func:`ray_ppu.checkpoint.base.identity`)."""
    found = {"base": base.identity(cfg)} if cfg.lora.enabled else {}
    if resume is not None:
        meta = resume.meta
        return {**found, "hf_config": meta.hf_config, "hf_source": meta.hf_source}
    if cfg.checkpoint.pretrained:
        from ray_ppu.hf import config as hf_config

        source = Path(cfg.checkpoint.pretrained).expanduser().resolve()
        return {**found, "hf_config": hf_config.read(source), "hf_source": str(source)}
    if cfg.lora.enabled and cfg.checkpoint.load:  # the base checkpoint's own origin
        meta = read_meta(base.base_dir(cfg)[1])
        return {**found, "hf_config": meta.hf_config, "hf_source": meta.hf_source}
    return found


def record_stream_start(cfg: RunConfig, token: str, resume: Optional[ResumePoint],
                        eval_interval: int, eval_iters: int) -> dict:
    """Write down where a (re)started group's data streams begin: ``<save root>/stream_start.json``
    with the launch's ``token``, the checkpoint, and the first step of each split. Rank 0 of
    every group writes it; the fault tests and ``benchmark.py recovery`` read it."""
    iteration = resume.iteration if resume else 0
    record = {"token": token, "iteration": iteration,
              "checkpoint": resume.path if resume else None,
              "weights_only": bool(resume and resume.weights_only), "time": time.time(),
              "train": iteration, "valid": valid_start(iteration, eval_interval, eval_iters)}
    root = save_root(cfg)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(root / STREAM_START_FILE, json.dumps(record, indent=2))
    return record
