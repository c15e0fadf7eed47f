"""Whether the memory plan fits the device, and if not, the nearest layout that does.

A plan that does not fit is otherwise learned from an out-of-memory error minutes after the
devices were rented, on every rank. The memory plan (:mod:`ray_ppu.plan.memory`) is arithmetic,
so the refusal can come before any worker starts, and it can say what would fit: the same
devices cut with more TP or PP, activation recompute, the distributed optimizer, or (last)
optimizer offload, searched in that order of cost and tried through the same rules and plan a
launch uses.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

from ray_ppu.config.schema import RunConfig
from ray_ppu.errors import ConfigError
from ray_ppu.plan.memory import HEADROOM, MemoryPlan, memory_plan

_RECOMPUTE = ("none", "selective", "full")  # cheapest first
_MAX_TP = 8  # TP stays inside a node's fast links (Megatron's usual bound)


def fit_problem(cfg: RunConfig, plan) -> Optional[str]:
    """The refusal of a plan that does not fit (None when it fits, when ``memory.require_fit``
    is false, or on ``cluster.device=cpu``, whose workers use host memory): the total against
    the budget, the biggest terms, and a layout that fits."""
    if not cfg.memory.require_fit or cfg.cluster.device == "cpu":
        return None
    memory = memory_plan(cfg, plan)
    if memory.fits:
        return None
    budget = HEADROOM * memory.device_memory_gib
    terms = sorted([("parameters", memory.parameters_gib), ("gradients", memory.gradients_gib),
                    ("optimizer", memory.optimizer_gib), ("activations", memory.activations_gib)],
                   key=lambda term: -term[1])
    where = "" if memory.stage == "only" else f", {memory.stage} pipeline stage"
    found = fitting_change(cfg)
    if found is None:
        fix = (f"no cut of these {plan.world_size} devices up to TP {_MAX_TP} × PP 8 with "
               f"recompute, the distributed optimizer and optimizer offload fits: add devices "
               f"(cluster.num_workers) or shorten training.seq_length")
    else:
        changes, fitted = found
        fix = (f"it fits with {' '.join(f'{k}={_yaml(v)}' for k, v in changes.items())} "
               f"({fitted.total_gib:.1f} GiB)")
    return (f"the memory plan needs {memory.total_gib:.1f} GiB per device, over the "
            f"{budget:.1f} GiB (90 %) of a {memory.device_memory_gib:g} GiB {memory.accelerator}"
            f" ({', '.join(f'{name} {gib:.1f}' for name, gib in terms)} GiB{where}); {fix}; "
            f"or set memory.device_memory_gib to the device's real memory, or "
            f"memory.require_fit=false to launch anyway")


def fitting_change(cfg: RunConfig) -> Optional[tuple[dict, MemoryPlan]]:
    """The cheapest change that makes the plan fit: ``({key: value}, its memory plan)``.

    Cost order: no optimizer offload before offload (it moves the update to the host), then
    the least model parallelism (TP × PP: every step of it costs communication), then the
    least recompute. Only layouts the rules accept are considered.
    """
    from ray_ppu.plan.build import build_plan

    p, mem = cfg.parallel, cfg.memory
    tps = [p.tensor_model_parallel_size * k for k in (1, 2, 4, 8)
           if p.tensor_model_parallel_size * k <= max(_MAX_TP, p.tensor_model_parallel_size)]
    pps = [p.pipeline_model_parallel_size * k for k in (1, 2, 4, 8)]
    recomputes = _RECOMPUTE[_RECOMPUTE.index(mem.recompute):]
    offloads = ["none", "auto"] if mem.optimizer_offload == "none" else [mem.optimizer_offload]
    best = None
    for offload, tp, pp, recompute in itertools.product(offloads, tps, pps, recomputes):
        changes = {"parallel.tensor_model_parallel_size": tp,
                   "parallel.pipeline_model_parallel_size": pp,
                   "parallel.sequence_parallel": p.sequence_parallel or tp > 1,
                   "memory.recompute": recompute, "memory.optimizer_offload": offload,
                   "training.use_distributed_optimizer": True}
        trial = _changed(cfg, changes)
        try:
            fitted = memory_plan(trial, build_plan(trial, files=False))  # layouts, not data
        except ConfigError:
            continue
        if not fitted.fits:
            continue
        cost = (offload != "none", tp * pp, _RECOMPUTE.index(recompute))
        if best is None or cost < best[0]:
            best = (cost, changes, fitted)
    if best is None:
        return None
    _, changes, fitted = best
    return {k: v for k, v in changes.items() if v != _value(cfg, k)}, fitted


def _yaml(value) -> str:
    """A value as an override writes it (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _value(cfg: RunConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _changed(cfg: RunConfig, changes: dict) -> RunConfig:
    sections: dict[str, dict] = {}
    for key, value in changes.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)
                                       for section, values in sections.items()})
