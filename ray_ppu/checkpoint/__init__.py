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
the last ``keep_last``. Megatron-Core 0.16.1 problems on its torch-Adam (no Apex or Transformer
Engine), fp32 and mixed-dtype paths are worked around from the outside, each where it bites:
the three functions of :mod:`ray_ppu.checkpoint.optimizer_workarounds`, and a ``no_grad``
around the optimizer load (:func:`load`).

The modules, one concern each
-----------------------------
* ``layout``: the save root, the ``iter_*`` directories, :class:`Meta`, which checkpoints are
  complete, deleting interrupted and surplus ones (imports no torch).
* ``resume``: :func:`resume_point`, :func:`record_stream_start`, :func:`origin`,
  :func:`check_sources` (imports no torch either).
* ``rng``: every RNG state a rank draws from, captured and set back.
* ``optimizer_workarounds``: the Megatron-Core 0.16.1 workarounds.
* ``saver``: :class:`Saver`, collective saves that are complete everywhere or not at all.
* ``loading``: :func:`load`.
* ``parts``: which part of a model a checkpoint or snapshot holds (a LoRA run's: what trains).
* ``base``: a LoRA run's base model, and the fingerprint that ties its checkpoints to it.

Megatron-Core is imported only inside the functions that save and load: the driver
(``launcher``, ``ray_worker``) imports this package and must not import Megatron-Core. Nor
does importing the package import torch: ``load``, ``load_trained`` and the saver's names are
imported on first use (PEP 562), so ``--dry-run``, ``--plan-only`` and the data tools, which
ask only where a run starts, do not pay torch's second of imports.
"""

import importlib

from ray_ppu.checkpoint import base, parts
from ray_ppu.checkpoint.layout import (
    FORMAT_VERSION,
    META_FILE,
    Meta,
    checkpoint_dirs,
    complete_checkpoints,
    config_hash,
    damage,
    latest,
    prune,
    read_meta,
    remove_incomplete,
    run_name,
    save_root,
)
from ray_ppu.checkpoint.resume import (
    STREAM_START_FILE,
    ResumePoint,
    check_sources,
    origin,
    record_stream_start,
    resume_point,
)
from ray_ppu.errors import CheckpointError  # also imported from here

__all__ = [
    "CheckpointError", "CheckpointSaveError", "FORMAT_VERSION", "META_FILE", "Meta",
    "OPTIMIZER_FORMAT", "ResumePoint", "STREAM_START_FILE", "Saver", "check_sources",
    "checkpoint_dirs", "complete_checkpoints", "config_hash", "damage", "latest", "load",
    "load_trained", "origin", "prune", "read_meta", "record_stream_start", "remove_incomplete", "resume_point",
    "run_name", "save_root", "base", "parts",
]

# name → its module: these import torch (and, when called, Megatron-Core)
_ON_FIRST_USE = {"load": "loading", "load_trained": "loading", "Saver": "saver",
                 "CheckpointSaveError": "saver", "OPTIMIZER_FORMAT": "saver"}


def __getattr__(name: str):
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_ON_FIRST_USE[name]}"), name)
