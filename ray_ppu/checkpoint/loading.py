"""Loading a checkpoint into a freshly built model, optimizer and schedule: :func:`load`.

Named ``loading`` rather than ``load`` so that the module does not share its name with the
function the package exports (``ray_ppu.checkpoint.load`` is the function).

It checks first that the checkpoint can be resumed by this run exactly (global batch, layout)
and, after loading, that what it holds is what its meta file and hence the data stream say.
Megatron-Core is imported when a load runs: the driver imports this package and never loads.
"""

from __future__ import annotations

from typing import Optional

import torch

from ray_ppu.checkpoint import base, parts
from ray_ppu.checkpoint.layout import META_FILE, _warn_once, config_hash, read_meta
from ray_ppu.checkpoint.optimizer_workarounds import _restore_adam_steps
from ray_ppu.checkpoint.resume import ResumePoint, _check_model
from ray_ppu.checkpoint.rng import _rng_sharded, restore_rng
from ray_ppu.checkpoint.saver import _sharded_state
from ray_ppu.config.lora import is_adapter_key
from ray_ppu.config.schema import RunConfig
from ray_ppu.errors import CheckpointError
from ray_ppu.util.wrappers import unwrap


def _layout_text(tp: int, pp: int, ep: int, etp: int) -> str:
    """"TP 2 × PP 1", and a MoE run's experts: "TP 2 × PP 1, experts EP 4 × ETP 1"."""
    return f"TP {tp} × PP {pp}" + (f", experts EP {ep} × ETP {etp}" if ep * etp > 1 else "")


def load(resume: ResumePoint, model: list, optimizer, scheduler, plan, cfg: RunConfig,
         base_identity: Optional[dict] = None) -> int:
    """Load ``resume`` into the freshly built model (and optimizer, schedule, RNG unless
    ``weights_only``); collective. Returns the iteration training continues at. A LoRA run
    loads its own checkpoints' adapters (refused on another base than ``base_identity``), or
    with ``weights_only`` its base's weights.

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
    saved = (meta.tensor_model_parallel_size, meta.pipeline_model_parallel_size,
             meta.expert_model_parallel_size, meta.expert_tensor_parallel_size)
    ours = (plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size,
            plan.expert_model_parallel_size, plan.expert_tensor_parallel_size)
    same_layout = saved == ours
    if not resume.weights_only:
        if meta.global_batch_size != plan.global_batch_size:
            raise CheckpointError(
                f"{resume.path} was trained with global batch {meta.global_batch_size}, this run "
                f"has {plan.global_batch_size}: the data position would not carry over "
                f"(use checkpoint.finetune=true to take the weights only)")
        if not same_layout:
            raise CheckpointError(
                f"{resume.path} was saved at {_layout_text(*saved)}, this run is "
                f"{_layout_text(*ours)}: the optimizer state ({meta.optimizer_format}) "
                f"reshards across DP only (use checkpoint.finetune=true to take the weights "
                f"only)")
        if meta.config_hash != config_hash(cfg):
            _warn_once(f"{resume.path} was saved by a run with another model/data/batch "
                       f"configuration (hash {meta.config_hash} != {config_hash(cfg)})")

    # a LoRA run loads what it trains from its own checkpoints, and its base weights only
    part = parts.of_run(cfg)
    if cfg.lora.enabled:
        if resume.weights_only != (resume.meta.lora is None):
            raise CheckpointError(f"{resume.path}: " + (
                "a LoRA checkpoint (adapters only) is no base to load" if resume.weights_only
                else "not a checkpoint of a LoRA run to resume (it holds every weight)"))
        part = "base" if resume.weights_only else "trainable"
        base.check_same_base(resume.path, resume.meta.base, base_identity)
    state = _sharded_state(model, None if resume.weights_only else optimizer, is_loading=True,
                           part=part)
    if not resume.weights_only:
        state["scheduler"] = None
        state["iteration"] = None
        state["consumed_samples"] = None
        if same_layout:
            state["rng_state"] = _rng_sharded(with_cuda=False)
    loaded = dist_checkpointing.load(state, resume.path)

    for i, chunk in enumerate(model):
        parts.load(unwrap(chunk), loaded["model" if len(model) == 1 else f"model{i}"], part,
                   resume.path)
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
        restore_rng(loaded["rng_state"])
    iteration = int(loaded["iteration"])
    if iteration != meta.iteration or loaded["consumed_samples"] != meta.consumed_samples:
        raise CheckpointError(f"{resume.path}: the checkpoint holds iteration {iteration}, "
                              f"its {META_FILE} says {meta.iteration}")
    return iteration


def load_trained(path: str, model: list) -> None:
    """What a LoRA run's checkpoint holds (its adapters and the base parts it trained: a
    projector, a merger, norms) into a model whose base is loaded: generation and export
    from the checkpoint itself, no optimizer; collective.

    What to read is what the checkpoint stores, not what this model would train: a model
    built for generation freezes nothing, and the run's own ``vision.freeze`` and
    ``lora.trainable`` decided what it saved. Every adapter of the model must be stored (else
    the targets or ranks differ), and nothing stored may be foreign to the model.
    """
    from megatron.core import dist_checkpointing

    stored = set(dist_checkpointing.load_tensors_metadata(path))
    wanted = []
    for chunk in model:
        state = parts.sharded(unwrap(chunk), "all")
        kept = {k: v for k, v in state.items() if getattr(v, "key", None) in stored}
        absent = sorted(v.key for k, v in state.items()
                        if is_adapter_key(k) and k not in kept)
        if absent:
            raise CheckpointError(f"{path} lacks the adapters {', '.join(absent[:4])}: its run "
                                  f"had other LoRA targets than its meta names")
        wanted.append(kept)
    state = {"model": wanted[0]} if len(model) == 1 else {
        f"model{i}": kept for i, kept in enumerate(wanted)}
    loaded = dist_checkpointing.load(state, path)
    for i, chunk in enumerate(model):
        values = loaded["model" if len(model) == 1 else f"model{i}"]
        result = unwrap(chunk).load_state_dict(values, strict=False)
        if result.unexpected_keys:
            raise CheckpointError(f"{path} holds {', '.join(result.unexpected_keys[:4])}, "
                                  f"which this model has not")
