"""Which part of a model a checkpoint, a snapshot or a load covers.

A full run saves and restores every weight (``"all"``). A LoRA run trains adapters on a frozen
base that it reads from ``checkpoint.pretrained`` / ``checkpoint.load`` at every start, so its
checkpoints and in-memory snapshots hold only what trains (``"trainable"``: the adapters and
any base part ``lora.trainable`` names; a 7B model's rank-16 adapters are 0.5 % of it), and the
base is loaded without the adapters (``"base"``). One function per form a model's state takes:
Megatron's sharded state dict (checkpoints) and torch's plain one (snapshots).

No Megatron-Core here: these filter what the model hands out.
"""

from __future__ import annotations

from typing import Literal

from ray_ppu.config.lora import is_adapter_key
from ray_ppu.config.schema import RunConfig
from ray_ppu.errors import CheckpointError

Part = Literal["all", "trainable", "base"]


def of_run(cfg: RunConfig) -> Part:
    """What this run's checkpoints hold."""
    return "trainable" if cfg.lora.enabled else "all"


def of_model(model: list) -> Part:
    """What a snapshot of these model chunks holds: :func:`of_run`'s part, told from the model
    (LoRA: it carries adapters). Frozen parts of a full run (a vision-language model's tower)
    are not read again at a restart, so its snapshots hold them too."""
    lora = any(is_adapter_key(name) for chunk in model for name, _ in chunk.named_parameters())
    return "trainable" if lora else "all"


def _kept(module, part: Part) -> set[str]:
    """Names of the parameters (and, but for "trainable", other state entries) in ``part``."""
    if part == "trainable":
        return {name for name, p in module.named_parameters() if p.requires_grad}
    return {name for name in module.state_dict() if part == "all" or not is_adapter_key(name)}


def sharded(module, part: Part) -> dict:
    """``module.sharded_state_dict()`` cut to ``part``: what trains is found by parameter
    identity (a ShardedTensor's data is its parameter), the base by key."""
    state = module.sharded_state_dict()
    if part == "all":
        return state
    if part == "base":
        return {k: v for k, v in state.items() if not is_adapter_key(k)}
    trains = {id(p) for p in module.parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if id(getattr(v, "data", None)) in trains}


def plain(module, part: Part) -> dict:
    """``module.state_dict()`` cut to ``part``."""
    state = module.state_dict()
    if part == "all":
        return state
    kept = _kept(module, part)
    return {k: v for k, v in state.items() if k in kept}


def load(module, state: dict, part: Part, where: str) -> None:
    """``module.load_state_dict(state)`` for a state of ``part``: strict for a whole model;
    otherwise every entry must be one of the model's and everything in ``part`` must be there
    (a CheckpointError names what is missing or foreign, ``where`` the source)."""
    if part == "all":
        module.load_state_dict(state, strict=True)
        return
    result = module.load_state_dict(state, strict=False)
    missing = set(result.missing_keys) & _kept(module, part)
    missing = {k for k in missing if not k.endswith("_extra_state")}
    if missing or result.unexpected_keys:
        what = (f"lacks {', '.join(sorted(missing)[:4])}" if missing else
                f"holds {', '.join(sorted(result.unexpected_keys)[:4])}, which this model has not")
        raise CheckpointError(f"{where} {what} (a LoRA run's adapters and what it trains are "
                              f"checkpointed without the base: are its targets and ranks "
                              f"this run's?)")
