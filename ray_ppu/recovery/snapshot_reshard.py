"""Restoring in-memory snapshots into a group of another data-parallel size (an elastic shrink
or grow), without the disk.

Why it is possible: a snapshot is one rank's shard of the training state, and of that state
only the distributed optimizer's part depends on DP. Megatron-Core's distributed optimizer
gives each DP rank a contiguous range of every parameter's flattened elements (its
``_get_model_param_range_map(param)["param"]``); a snapshot records, for each position of its
inner optimizer, which parameter and which range it holds (:func:`shard_ranges`). The ranks of
the old group that share a new rank's model coordinate — the same (PP, TP) for dense
parameters, the same (PP, EP, ETP) for experts — together hold every element of every one of
its parameters, so the new rank assembles its own ranges from theirs (:func:`assemble`): the
fp32 main parameters, Adam's moments, and the weights (with ``overlap_param_gather`` a
snapshot's weights are fresh only inside its own range; the first forward gathers the rest).

What must not change between the groups: TP, PP, CP, virtual PP, EP and ETP (the model's own
shards); only the world and DP may (:func:`ray_ppu.recovery.snapshot_keeper.reshards`, part of the
choice of snapshot). The optimizer must be the distributed one without host
offload or a precision-aware state (:func:`reshardable`): its state is then plain tensors per
range. Other snapshots restore only a group of their own layout; the disk reshards the rest.
"""

from __future__ import annotations

import io
import logging
import time
from typing import Callable, NamedTuple

import torch

from ray_ppu.checkpoint import CheckpointError, parts
from ray_ppu.checkpoint.rng import restore_rng
from ray_ppu.util.wrappers import unwrap

log = logging.getLogger("ray_ppu")

class Coords(NamedTuple):
    """Where a rank sits in Megatron-Core's groups."""

    pp: int
    tp: int
    cp: int
    dp: int
    ep: int
    etp: int

    def holds_same(self, other: "Coords", expert: bool) -> bool:
        """Whether ``other`` holds the same shard of a dense (or expert) parameter."""
        if expert:
            return (self.pp, self.ep, self.etp) == (other.pp, other.ep, other.etp)
        return (self.pp, self.tp) == (other.pp, other.tp)


def coords() -> Coords:
    from megatron.core import parallel_state as ps

    return Coords(ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                  ps.get_context_parallel_rank(), ps.get_data_parallel_rank(),
                  ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank())


def reshardable(opt) -> bool:
    """Whether ``opt`` (one of a chained optimizer's) keeps plain per-range tensors: Megatron's
    distributed optimizer without host offload or a precision-aware state."""
    config = getattr(opt, "config", None)
    return (hasattr(opt, "model_param_group_index_map")
            and type(opt.optimizer).__module__.startswith("torch.optim")
            and not getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))


def param_keys(model: list) -> dict:
    """``{parameter: (chunk index, name)}``: a parameter's name in every layout."""
    return {param: (i, name) for i, chunk in enumerate(model)
            for name, param in unwrap(chunk).named_parameters()}


def shard_ranges(opt, keys: dict) -> list:
    """Per position of ``opt``'s inner optimizer (param groups in order): ``(chunk, name, start,
    end)``, the parameter and the range of its flattened elements held there."""
    at = {place: param for param, place in opt.model_param_group_index_map.items()}
    ranges = []
    for g, group in enumerate(opt.optimizer.param_groups):
        for o in range(len(group["params"])):
            param = at[(g, o)]
            span = opt._get_model_param_range_map(param)["param"]
            ranges.append((*keys[param], span.start, span.end))
    return ranges


def assemble(pieces: list, start: int, end: int, what: str) -> torch.Tensor:
    """Elements ``start..end`` of a flattened tensor from ``pieces`` ``(start_i, end_i,
    values)`` that cover them (each piece's values are its own range's)."""
    out, at = [], start
    for s, e, values in sorted(pieces, key=lambda p: p[0]):
        if e <= at or s >= end:
            continue
        if s > at:
            break
        out.append(values.reshape(-1)[at - s:min(e, end) - s])
        at = min(e, end)
    if at != end:
        raise CheckpointError(f"the old group's snapshots hold elements of {what} up to {at} "
                              f"of the {start}..{end} this rank needs")
    return torch.cat(out) if len(out) > 1 else out[0].clone()


def _experts(model: list) -> set:
    """``(chunk, module prefix)`` of the expert parameters: their state (weights and any
    ``_extra_state`` beside them) comes from the old ranks of the same expert coordinate."""
    return {(i, name.rpartition(".")[0]) for i, chunk in enumerate(model)
            for name, param in unwrap(chunk).named_parameters()
            if not getattr(param, "allreduce", True)}


def restore_resharded(iteration: int, sources: dict, fetch: Callable[[int], bytes],
                      model: list, optimizers: list, scheduler) -> int:
    """Load this rank's state from the old group's snapshots at ``iteration``: ``sources``
    ``{old rank: Coords}``, ``fetch(old rank)`` its snapshot; ``optimizers``: the chain's
    distributed optimizers in order. Returns the iteration."""
    me = coords()
    experts = _experts(model)
    dense = [r for r, c in sorted(sources.items()) if me.holds_same(Coords(*c), expert=False)]
    expert = [r for r, c in sorted(sources.items()) if me.holds_same(Coords(*c), expert=True)]
    if not dense or (experts and not expert):
        raise CheckpointError(f"no rank of the old group holds this rank's shards ({me})")
    started, states = time.perf_counter(), {}
    for r in sorted(set(dense) | set(expert)):
        states[r] = torch.load(io.BytesIO(fetch(r)), map_location="cpu", weights_only=False)
        if states[r]["iteration"] != iteration:
            raise CheckpointError(f"old rank {r}'s snapshot holds iteration "
                                  f"{states[r]['iteration']}, not {iteration}")
    fetched = time.perf_counter()
    of_kind = {False: dense, True: expert}
    part = parts.of_model(model)  # a LoRA run's snapshots hold what trains
    for i, chunk in enumerate(model):  # every weight from one holder; ranges below
        own = parts.plain(unwrap(chunk), part)
        parts.load(unwrap(chunk), {
            key: states[of_kind[(i, key.rpartition(".")[0]) in experts][0]]["model"][i][key]
            for key in own}, part, f"the snapshots at iteration {iteration}")
    keys = param_keys(model)
    for n, opt in enumerate(optimizers):
        _restore_optimizer(n, opt, keys, experts, of_kind, states)
    first = states[dense[0]]
    scheduler.num_steps = 0  # Megatron's load steps a schedule on by the saved count
    scheduler.load_state_dict(first["scheduler"])
    # the RNG of the old rank at this DP rank's place (DP ranks are seeded alike), else DP 0's
    twin = next((r for r in dense if Coords(*sources[r])[2:4] == (me.cp, me.dp)), dense[0])
    restore_rng(states[twin]["rng"])
    if torch.distributed.get_rank() == 0:
        log.info("resharded restore: %d old snapshot(s) fetched and read in %.1f s, this rank's "
                 "ranges assembled in %.1f s", len(states), fetched - started,
                 time.perf_counter() - fetched)
    return iteration


def _restore_optimizer(n: int, opt, keys: dict, experts: set, of_kind: dict,
                       states: dict) -> None:
    """Optimizer ``n`` of the chain: each of its positions' weights, fp32 main parameter and
    Adam state, assembled from the old ranks' pieces of the same parameter."""
    held: dict = {}  # (chunk, name) → [(old rank, its position, start, end)]
    for r, state in states.items():
        saved = state["optimizers"][n]
        if saved.get("ranges") is None:
            raise CheckpointError(f"old rank {r}'s snapshot has no optimizer ranges to reshard")
        for p, (chunk, name, s, e) in enumerate(saved["ranges"]):
            held.setdefault((chunk, name), []).append((r, p, s, e))
    params = {place: param for param, place in keys.items()}
    mains = [p for group in opt.optimizer.param_groups for p in group["params"]]
    new_state = {}
    for j, (chunk, name, s, e) in enumerate(shard_ranges(opt, keys)):
        ranks = of_kind[(chunk, name.rpartition(".")[0]) in experts]
        have = [h for h in held.get((chunk, name), []) if h[0] in ranks]
        what = f"{name} (chunk {chunk})"

        def gather(get: Callable, label: str = "") -> torch.Tensor:
            """This position's range of ``get(old optimizer, position, old weight)``."""
            return assemble([(hs, he, get(states[r]["optimizers"][n], p,
                                          states[r]["model"][chunk][name].reshape(-1)[hs:he]))
                             for r, p, hs, he in have], s, e, what + label)

        with torch.no_grad():
            params[(chunk, name)].data.view(-1)[s:e].copy_(gather(lambda o, p, w: w))
            if all(states[r]["optimizers"][n]["mains"][p] is not None for r, p, _, _ in have):
                mains[j].copy_(gather(lambda o, p, w: o["mains"][p]))  # not views of weights
        first = states[have[0][0]]["optimizers"][n]["inner"]["state"].get(have[0][1], {})
        new_state[j] = {k: v if not isinstance(v, torch.Tensor) or v.dim() == 0  # Adam's step
                        else gather(lambda o, p, w, k=k: o["inner"]["state"][p][k], " " + k)
                        for k, v in first.items()}
    source = states[min(states)]["optimizers"][n]
    inner = opt.optimizer.state_dict()
    groups = source["inner"]["param_groups"]
    if len(groups) != len(inner["param_groups"]):
        raise CheckpointError(f"optimizer {n}: {len(groups)} param groups in the snapshot, "
                              f"{len(inner['param_groups'])} here")
    inner["state"] = {j: state for j, state in new_state.items() if state}
    inner["param_groups"] = [{**old, "params": new["params"]}
                             for old, new in zip(groups, inner["param_groups"])]
    opt.optimizer.load_state_dict(inner)
    if source["grad_scaler"] is not None:
        opt.grad_scaler.load_state_dict(source["grad_scaler"])
