"""Workarounds, applied from the outside, for Megatron-Core 0.16.1's distributed optimizer
when it saves and loads checkpoints on the paths ray_ppu uses: torch Adam/AdamW (no Apex or
Transformer Engine optimizer), fp32 training, and models that mix bf16 and fp32 parameters.

Each one, in Megatron-Core 0.16.1:

* :func:`_materialize_optimizer_state`: ``DistributedOptimizer.state_dict`` reads Adam's
  ``step`` from the torch optimizer's per-parameter state, which a torch Adam that has not
  stepped yet does not have (an AssertionError on every load).
* :func:`_restore_adam_steps`: the load puts one shared ``step`` tensor into every parameter's
  state, and the ``dp_reshardable`` load then copies the loading template's step (0) over it:
  Adam's bias correction restarts after a resume.
* :func:`_align_param_group_index_map`: ``model_param_group_index_map`` numbers a group's
  parameters in grad-buffer order while the optimizer's group is laid out in another, so in a
  mixed bf16/fp32 model checkpoints pair parameters with other parameters' state.

(The fourth, a ``no_grad`` around the optimizer load, is a single line where it bites:
``ray_ppu.checkpoint.loading``.)

pyproject allows ``megatron-core>=0.16.1``. None of these is pinned to a version: each is
correct on a Megatron-Core that fixed the problem too (it adds what a first Adam step would
start from, writes the step the checkpoint holds, or rebuilds a map that is already right), so
a later release needs no switch. What each does check is the attributes it relies on: where a
release no longer has them, it leaves the optimizer as Megatron-Core built it instead of
failing. Megatron-Core 0.16.1 has all of them, so there each one does exactly what it did
before it had a guard.
"""

from __future__ import annotations

import torch

# What _align_param_group_index_map reads of a DistributedOptimizer (Megatron-Core 0.16.1
# sets all of them in its __init__).
_MAIN_PARAM_GROUPS = ("model_fp32_groups", "model_float16_groups", "shard_fp32_groups",
                      "shard_float16_groups", "shard_fp32_from_float16_groups")


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
    Either breaks Adam's bias correction from the first step after a resume. A Megatron that
    keeps no ``step`` in the param groups is left alone.
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


def _has_main_param_groups(opt) -> bool:
    """``opt`` is a distributed optimizer laid out as Megatron-Core 0.16.1 lays one out."""
    return (getattr(opt, "model_param_group_index_map", None) is not None
            and all(hasattr(opt, name) for name in _MAIN_PARAM_GROUPS)
            and hasattr(getattr(opt, "config", None),
                        "use_precision_aware_optimizer_no_fp8_or_ds_fp8"))


def _align_param_group_index_map(optimizer) -> None:
    """Point the distributed optimizer's (group, order) index of each model parameter at its own
    main parameter.

    Megatron-Core 0.16.1 numbers a group's parameters in grad-buffer order (all bf16 buffers,
    then fp32) but lays the optimizer's group out as [fp32 shards, fp32 copies of bf16 shards];
    in a model that mixes bf16 and fp32 parameters (bf16 with the local spec: its torch RMSNorm
    weights stay fp32) checkpoints would then pair parameters with other parameters' state.
    Only its checkpoint code reads this map. Rebuilt here by identity, so it is a no-op where
    the two orders agree (one dtype, or a Megatron that numbers them right). Optimizers without
    these groups (not distributed, or a Megatron that renamed them) are left alone.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not _has_main_param_groups(opt):
            continue
        index = opt.model_param_group_index_map
        float16_mains = (opt.shard_float16_groups
                         if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                         else opt.shard_fp32_from_float16_groups)
        for g, group in enumerate(opt.optimizer.param_groups):
            position = {id(p): k for k, p in enumerate(group["params"])}
            pairs = [*zip(opt.model_fp32_groups[g], opt.shard_fp32_groups[g]),
                     *zip(opt.model_float16_groups[g], float16_mains[g])]
            for model_param, main_param in pairs:
                index[model_param] = (g, position[id(main_param)])
