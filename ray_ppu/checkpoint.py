"""Megatron-Core distributed checkpoints that carry the exact data position, and resuming.

A checkpoint is one directory, ``<save root>/iter_0000004``, written collectively by every rank
with ``megatron.core.dist_checkpointing`` (torch_dist format):

* ``model``: each model chunk's ``sharded_state_dict()``: TP/PP-aware ShardedTensors.
* ``optimizer``: the Megatron optimizer's ``sharded_state_dict(model_sd)``; for the
  distributed optimizer in the ``dp_reshardable`` layout (:data:`OPTIMIZER_FORMAT`), which saves
  and loads fully in parallel and can be loaded at another DP size (elastic restarts).
* ``scheduler`` (OptimizerParamScheduler.state_dict()), ``iteration``, ``consumed_samples``.
* ``rng_state``: Python/NumPy/torch/CUDA and Megatron's RNG-tracker states, one per (PP, TP)
  rank (loaded only when TP and PP are unchanged, as Megatron-LM does).

``ray_ppu_meta.json`` (:class:`Meta`) is written last, by rank 0, after every rank has finished
writing: a directory without it is an interrupted save and is never loaded.

Where a run starts (the one rule)
--------------------------------
:func:`resume_point` is the only place that decides: the latest complete checkpoint in the
run's save root (:func:`save_root`), else ``checkpoint.load``, else nothing. The driver calls it
to log where the run starts and to have the readers read the first iterations ahead; every
worker of every (re)started group calls it again and starts its data streams there (nothing
writes checkpoints in between: the previous group is gone, the new one has not saved yet), and
rank 0 records the choice in ``stream_start.json`` (:func:`record_stream_start`). After
loading, the ``iteration`` stored inside the checkpoint is checked against its meta file
(:func:`load`) and against the stream's first step (``worker.run``). The file system is the
source of truth rather than ``ray.train.get_checkpoint()``: the two differ when a run died
between writing a checkpoint and Ray registering it (then Ray's is older) or when Ray's latest
is incomplete (then ours is older).

No Ray here: the launcher reports checkpoints to Ray Train; under torchrun :func:`prune` keeps
the last ``keep_last``. Megatron-Core 0.16.1 problems on its torch-Adam (no Apex/TE),
fp32 and mixed-dtype paths are worked around from the outside, each where it bites:
:func:`_materialize_optimizer_state`, :func:`_restore_adam_steps`,
:func:`_align_param_group_index_map`, and a ``no_grad`` around the optimizer load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ray_ppu.errors import ConfigError
from ray_ppu.config.schema import RunConfig
from ray_ppu.data.order import consumed_samples, valid_start
from ray_ppu.util.fs import atomic_write_text
from ray_ppu.util.wrappers import unwrap
from ray_ppu.errors import CheckpointError  # noqa: F401 (also imported from here)

log = logging.getLogger("ray_ppu")

META_FILE = "ray_ppu_meta.json"
STREAM_START_FILE = "stream_start.json"
FORMAT_VERSION = 1
# Megatron's DistributedOptimizer layout: every rank writes and reads its own contiguous
# buffer shards (no gather), and the shards are re-cut on load when DP changes. TP/PP changes
# need 'fully_reshardable' (gathers the state on DP rank 0 at save): not worth it for the
# elastic case, where only DP changes.
OPTIMIZER_FORMAT = "dp_reshardable"
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

    @classmethod
    def from_dict(cls, values: dict) -> "Meta":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


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


# ---------------------------------------------------------------------------------------------
# Finding checkpoints (no torch.distributed: also runs on the driver and in the controller)
# ---------------------------------------------------------------------------------------------

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


def resume_point(cfg: RunConfig) -> Optional[ResumePoint]:
    """Where this run starts: THE decision, made the same way by the driver and every worker
    (module docstring).

    1. The latest complete checkpoint in the run's own save root: an exact resume.
    2. Else ``checkpoint.load``: a checkpoint directory, or a directory of them (the latest
       complete one); weights only when ``checkpoint.finetune``.
    3. Else None: a fresh start.
    """
    own = latest(save_root(cfg))
    if own is not None:
        return ResumePoint(str(own[0]), own[1])
    if not cfg.checkpoint.load:
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


def check_config(cfg: RunConfig) -> None:
    """Reject checkpoint settings that cannot work, before any worker starts."""
    c = cfg.checkpoint
    if c.save_interval is not None and c.save_interval < 1:
        raise ConfigError(f"checkpoint.save_interval={c.save_interval}: expected ≥ 1, or null "
                          f"to save only at the end")
    if c.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={c.keep_last}: expected ≥ 1")
    if c.memory_interval is not None and c.memory_interval < 0:
        raise ConfigError(f"checkpoint.memory_interval={c.memory_interval}: expected ≥ 1, 0 for "
                          f"no in-memory snapshots, or null for every iteration within 2 % of "
                          f"the step")
    if c.finetune and not c.load:
        raise ConfigError("checkpoint.finetune=true needs checkpoint.load (the weights to start from)")
    if c.pretrained:
        if c.load:
            raise ConfigError(f"checkpoint.pretrained={c.pretrained} and checkpoint.load={c.load}: "
                              f"set one (the weights a fresh run starts from)")
        from ray_ppu.hf.weights import check_checkpoint

        check_checkpoint(c.pretrained, cfg.model)
    if c.load:
        try:
            start = resume_point(cfg)
        except CheckpointError:
            return  # the workers' load names what is wrong with it
        if start is not None:
            _check_model(start, cfg)


# Fields that shape the weights: a checkpoint of another architecture cannot be loaded.
_WEIGHT_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "vocab_size", "add_qkv_bias",
                  "untie_embeddings_and_output_weights")


def _check_model(start: ResumePoint, cfg: RunConfig) -> None:
    """The checkpoint's recorded model (if it records one) has this run's weight shapes."""
    saved = start.meta.model
    if not saved:
        return
    wrong = [f"model.{k}: checkpoint {saved[k]!r}, this run {getattr(cfg.model, k)!r}"
             for k in _WEIGHT_FIELDS if k in saved and saved[k] != getattr(cfg.model, k)]
    if wrong:
        raise ConfigError(f"{start.path} holds another model than this run's: "
                          + "; ".join(wrong))


def origin(cfg: RunConfig, resume: Optional[ResumePoint]) -> dict:
    """Where the run's weights came from, for its checkpoints' meta: the Hugging Face config
    and directory of ``checkpoint.pretrained``, or carried over from the checkpoint it loaded."""
    if resume is not None:
        meta = resume.meta
        return {"hf_config": meta.hf_config, "hf_source": meta.hf_source}
    if cfg.checkpoint.pretrained:
        from ray_ppu.hf import config as hf_config

        source = Path(cfg.checkpoint.pretrained).expanduser().resolve()
        return {"hf_config": hf_config.read(source), "hf_source": str(source)}
    return {}


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


# ---------------------------------------------------------------------------------------------
# Saving and loading (collective: every rank of the world calls them)
# ---------------------------------------------------------------------------------------------

def _materialize_optimizer_state(optimizer) -> None:
    """Give a fresh torch Adam its (zero) state before Megatron builds a sharded state dict.

    Megatron-Core 0.16.1 without Apex/Transformer Engine reads Adam's ``step`` from the torch
    optimizer's per-parameter state (``DistributedOptimizer.state_dict``), and a torch Adam that
    has not stepped yet has none (an AssertionError): always the case when loading. Megatron's
    own ``init_state_fn`` allocates the moments; we add ``step`` 0, which is exactly what torch
    Adam's first step would start from. A load overwrites all of it. TE/Apex optimizers keep
    ``step`` elsewhere: untouched.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or len(inner.state):
            continue
        if getattr(opt, "init_state_fn", None) is not None:
            opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param].setdefault("step", torch.tensor(0.0))


def _restore_adam_steps(optimizer) -> None:
    """Set every parameter's torch Adam ``step`` to the checkpoint's, each its own tensor.

    Megatron-Core 0.16.1 without Apex/TE keeps the saved step in the optimizer's param groups
    (``DistributedOptimizer.state_dict``), but its load then (a) puts ONE step tensor into every
    parameter's state, which torch Adam would advance once per parameter per iteration, and
    (b) with the dp_reshardable layout copies the step of the loading template (0) over it.
    Either breaks Adam's bias correction from the first step after a resume.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                if param in inner.state:
                    inner.state[param]["step"] = torch.tensor(float(group["step"]),
                                                              dtype=torch.float32)


def _align_param_group_index_map(optimizer) -> None:
    """Point the distributed optimizer's (group, order) index of each model parameter at its own
    main parameter.

    Megatron-Core 0.16.1 numbers a group's parameters in grad-buffer order (all bf16 buffers,
    then fp32) but lays the optimizer's group out as [fp32 shards, fp32 copies of bf16 shards];
    in a model that mixes bf16 and fp32 parameters (bf16 with the local spec: its torch RMSNorm
    weights stay fp32) checkpoints would then pair parameters with other parameters' state.
    Only its checkpoint code reads this map. Rebuilt here by identity, so it is a no-op where
    the two orders agree (one dtype, or a Megatron that numbers them right).
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        index = getattr(opt, "model_param_group_index_map", None)
        if index is None or not hasattr(opt, "shard_fp32_groups"):
            continue
        float16_mains = (opt.shard_float16_groups
                         if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                         else opt.shard_fp32_from_float16_groups)
        for g, group in enumerate(opt.optimizer.param_groups):
            position = {id(p): k for k, p in enumerate(group["params"])}
            pairs = [*zip(opt.model_fp32_groups[g], opt.shard_fp32_groups[g]),
                     *zip(opt.model_float16_groups[g], float16_mains[g])]
            for model_param, main_param in pairs:
                index[model_param] = (g, position[id(main_param)])


def _sharded_state(model: list, optimizer, is_loading: bool) -> dict:
    """Model chunks' and optimizer's sharded state dicts, keyed as Megatron-LM does."""
    state: dict = {}
    if len(model) == 1:
        state["model"] = unwrap(model[0]).sharded_state_dict()
    else:  # virtual pipeline stages: each chunk knows its own layer offsets (vp_stage)
        for i, chunk in enumerate(model):
            state[f"model{i}"] = unwrap(chunk).sharded_state_dict()
    if optimizer is not None:
        _align_param_group_index_map(optimizer)
        _materialize_optimizer_state(optimizer)  # a fresh optimizer: loading, or iteration 0
        model_state = {k: v for k, v in state.items() if k.startswith("model")}
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": OPTIMIZER_FORMAT,
                      "chained_optim_avoid_prefix": True},
        )
    return state


def _rng_state(with_cuda: bool) -> dict:
    from megatron.core import tensor_parallel

    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if with_cuda:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded(with_cuda: bool):
    """This rank's RNG states as a ShardedObject: one per (PP, TP) rank, DP ranks are replicas
    (they are seeded alike), as Megatron-LM stores them."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(
        "rng_state", _rng_state(with_cuda),
        (parallel_state.get_pipeline_model_parallel_world_size(),
         parallel_state.get_tensor_model_parallel_world_size()),
        (parallel_state.get_pipeline_model_parallel_rank(),
         parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )


def _new_dir(root: Path, iteration: int) -> Path:
    """A fresh directory for a checkpoint, chosen on rank 0 and shared with every rank.

    ``iter_NNNNNNN``, or ``iter_NNNNNNN_k`` when that name is taken (an interrupted save of the
    same iteration, or another run's checkpoint): never write into a used directory.
    """
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


class CheckpointSaveError(CheckpointError):
    """A save failed on some rank (full disk, storage gone): raised on every rank alike, after
    the partial directory is removed; training can go on and try again at the next save."""

    def __init__(self, message: str, iteration: int) -> None:
        super().__init__(message)
        self.iteration = iteration


def _write_error(err: BaseException) -> str:
    """One line per distinct cause: torch's CheckpointException (a BaseException) wraps each
    rank's write error with its traceback; the last line of each is what went wrong."""
    causes = getattr(err, "failures", None)
    if not causes:
        return f"{type(err).__name__}: {err}"
    lines = []
    for cause in causes.values():
        cause = cause[0] if isinstance(cause, tuple) else cause
        line = f"{type(cause).__name__}: {cause}".strip().splitlines()[-1]
        if line not in lines:
            lines.append(line)
    return "; ".join(lines)


def _agree_saved(path: Path, iteration: int, error: Optional[str]) -> None:
    """Every rank learns whether every rank wrote its part (torch's checkpoint writer already
    gathers write errors, but a rank can also fail outside it); on any failure rank 0 removes
    the partial directory (freeing what it took on a full disk) and all ranks raise alike."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = {rank: e for rank, e in enumerate(errors) if e is not None}
    if not failed:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    causes = list(dict.fromkeys(failed.values()))  # distinct, in rank order
    raise CheckpointSaveError(
        f"checkpoint at iteration {iteration} not saved: {len(failed)} of {len(errors)} ranks "
        f"failed to write {path} (rank {min(failed)}: {'; '.join(causes)[:500]})", iteration)


def _save_errors() -> tuple:
    """What a failed save raises: any Exception, and torch's CheckpointException (a
    BaseException). Imported when a save fails, not with this module: torch.distributed
    .checkpoint costs the driver 1.3 s, and the driver never saves."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


class Saver:
    """Writes a run's checkpoints; collective: every rank calls the same methods in order.

    Synchronous by default: :meth:`save` returns when the checkpoint is complete. With
    ``async_save`` (Megatron's async strategy) :meth:`save` only stages the state (on PPUs a
    copy to host memory; on the CPU a forked writer's copy-on-write view) and a background
    process writes it while training goes on; :meth:`poll`, after every iteration, completes
    the saves whose writers have all finished, :meth:`wait` all of them.

    Each method returns the checkpoints it completed, as ``(path, meta, tag)`` (``tag``: what
    the caller passed to :meth:`save`), or raises :class:`CheckpointSaveError` (on every rank
    alike) for one that failed.

    Completing a save: all ranks agree every part was written (else the directory goes and
    the error is raised), then rank 0 writes ``ray_ppu_meta.json`` (listing the files), the
    mark of a complete checkpoint, and a last agreement makes it complete everywhere.
    """

    def __init__(self, root: str | Path, plan, cfg: RunConfig, with_cuda_rng: bool = False,
                 async_save: bool = False, origin: Optional[dict] = None) -> None:
        self.root, self.plan, self.cfg = Path(root), plan, cfg
        self.origin = origin or {}
        self.with_cuda_rng = with_cuda_rng
        self.queue = None
        if async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.queue = AsyncCallsQueue()
        # async call index → (path, iteration, tag, error (None), weights only)
        self.pending: dict[int, tuple] = {}

    def save(self, iteration: int, model: list, optimizer, scheduler, tag=None) -> list[tuple]:
        """Start (async) or write (sync) the checkpoint after ``iteration`` iterations.

        1. Rank 0 creates a fresh ``iter_…`` directory; every rank learns its name.
        2. Every rank writes (or stages) its shards of model, optimizer and RNG states
           (torch_dist; replicated tensors spread over the DP ranks); rank 0 the common part.
           Without ``optimizer`` and ``scheduler``: the weights only (a conversion).
        3. Sync: complete it now. Async: complete it in a later :meth:`poll`.
        """
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.serialization import (
            get_default_save_sharded_strategy,
        )
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )

        path = _new_dir(self.root, iteration)
        state = _sharded_state(model, optimizer, is_loading=False)
        state["iteration"] = iteration
        state["consumed_samples"] = consumed_samples(iteration, self.plan.global_batch_size)
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
            state["rng_state"] = _rng_sharded(self.with_cuda_rng)
        strategy = FullyParallelSaveStrategyWrapper(
            get_default_save_sharded_strategy("torch_dist"),
            parallel_state.get_data_parallel_group(with_context_parallel=True),
        )
        error = request = None
        try:  # a full disk, a lost mount: any write error (torch's is a BaseException)
            request = dist_checkpointing.save(state, str(path), sharded_strategy=strategy,
                                              async_sharded_save=self.queue is not None)
        except _save_errors() as err:
            error = _write_error(err)
        if self.queue is None or error is not None:
            return [self._complete(path, iteration, tag, error, optimizer is None)]
        self.pending[self.queue.schedule_async_request(request)] = (
            path, iteration, tag, None, optimizer is None)
        return []

    def poll(self, blocking: bool = False) -> list[tuple]:
        """Complete the background saves whose writers finished on every rank (all of them,
        waiting, with ``blocking``)."""
        if self.queue is None or not self.pending:
            return []
        try:
            finished = self.queue.maybe_finalize_async_calls(blocking=blocking)
        except _save_errors() as err:
            # Megatron finalizes in order and raises on every rank: the oldest one failed
            path, iteration, tag, _, weights_only = self.pending.pop(min(self.pending))
            return [self._complete(path, iteration, tag, _write_error(err), weights_only)]
        return [self._complete(*self.pending.pop(i)) for i in finished]

    def wait(self) -> list[tuple]:
        """Complete every background save (end of training)."""
        return self.poll(blocking=True)

    def _complete(self, path: Path, iteration: int, tag, error: Optional[str] = None,
                  weights_only: bool = False) -> tuple:
        _agree_saved(path, iteration, error)
        plan = self.plan
        meta = Meta(
            iteration=iteration,
            consumed_samples=consumed_samples(iteration, plan.global_batch_size),
            world_size=dist.get_world_size(),
            tensor_model_parallel_size=plan.tensor_model_parallel_size,
            pipeline_model_parallel_size=plan.pipeline_model_parallel_size,
            context_parallel_size=plan.context_parallel_size,
            data_parallel_size=plan.data_parallel_size,
            global_batch_size=plan.global_batch_size,
            config_hash=config_hash(self.cfg),
            optimizer_format=OPTIMIZER_FORMAT,
            saved_at=time.time(),
            files={f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file()}
            if dist.get_rank() == 0 else None,
            weights_only=weights_only,
            model=dataclasses.asdict(self.cfg.model),
            **self.origin,
        )
        error = None
        if dist.get_rank() == 0:
            try:
                atomic_write_text(path / META_FILE, json.dumps(dataclasses.asdict(meta), indent=2))
            except OSError as err:
                error = f"{type(err).__name__}: {err}"
        _agree_saved(path, iteration, error)  # also the barrier: complete on every rank now
        return path, meta, tag


def load(resume: ResumePoint, model: list, optimizer, scheduler, plan, cfg: RunConfig) -> int:
    """Load ``resume`` into the freshly built model (and optimizer, schedule, RNG unless
    ``weights_only``); collective. Returns the iteration training continues at.

    1. Check the meta against this run: same global batch and config hash for an exact resume;
       the DP size may differ (the optimizer layout re-cuts), TP/PP may not (weights only may).
    2. ``dist_checkpointing.load`` of the sharded state this run's layout asks for.
    3. Weights into the model chunks; then optimizer, scheduler and RNG states, or for weights
       only a refresh of the optimizer's main-parameter copies.
    4. The loaded ``iteration`` must be the meta's (and hence the data stream's) iteration.
    """
    from megatron.core import dist_checkpointing

    meta = read_meta(resume.path)
    if meta is None:
        raise CheckpointError(f"{resume.path}: {META_FILE} disappeared")
    _check_model(resume, cfg)
    same_layout = (meta.tensor_model_parallel_size == plan.tensor_model_parallel_size
                   and meta.pipeline_model_parallel_size == plan.pipeline_model_parallel_size)
    if not resume.weights_only:
        if meta.global_batch_size != plan.global_batch_size:
            raise CheckpointError(
                f"{resume.path} was trained with global batch {meta.global_batch_size}, this run "
                f"has {plan.global_batch_size}: the data position would not carry over "
                f"(use checkpoint.finetune=true to take the weights only)")
        if not same_layout:
            raise CheckpointError(
                f"{resume.path} was saved at TP {meta.tensor_model_parallel_size} × PP "
                f"{meta.pipeline_model_parallel_size}, this run is TP "
                f"{plan.tensor_model_parallel_size} × PP {plan.pipeline_model_parallel_size}: "
                f"the optimizer state ({meta.optimizer_format}) reshards across DP only "
                f"(use checkpoint.finetune=true to take the weights only)")
        if meta.config_hash != config_hash(cfg):
            _warn_once(f"{resume.path} was saved by a run with another model/data/batch "
                       f"configuration (hash {meta.config_hash} != {config_hash(cfg)})")

    state = _sharded_state(model, None if resume.weights_only else optimizer, is_loading=True)
    if not resume.weights_only:
        state["scheduler"] = None
        state["iteration"] = None
        state["consumed_samples"] = None
        if same_layout:
            state["rng_state"] = _rng_sharded(with_cuda=False)
    loaded = dist_checkpointing.load(state, resume.path)

    if len(model) == 1:
        unwrap(model[0]).load_state_dict(loaded["model"], strict=True)
    else:
        for i, chunk in enumerate(model):
            unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=True)
    if resume.weights_only:
        # The optimizer copied the (random) weights into its main parameters when it was built.
        if optimizer is not None:
            optimizer.reload_model_params()
        return 0
    # no_grad: Megatron-Core 0.16.1's dp_reshardable loader copies into the main parameters
    # without it (its other loaders have it); in fp32 they are views of the model parameters,
    # which require grad, and autograd refuses the in-place copy.
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(optimizer)
    scheduler.load_state_dict(loaded["scheduler"])
    if "rng_state" in loaded:
        _set_rng_state(loaded["rng_state"])
    iteration = int(loaded["iteration"])
    if iteration != meta.iteration or loaded["consumed_samples"] != meta.consumed_samples:
        raise CheckpointError(f"{resume.path}: the checkpoint holds iteration {iteration}, "
                              f"its {META_FILE} says {meta.iteration}")
    return iteration
