"""What a MoE model's routers did over a log window: the load-balancing loss and the expert load.

Two numbers per training row, the same on every rank (both reduce over the whole group):

* ``moe_load_balancing_loss``: Megatron-Core's per-layer ``aux_loss`` without its coefficient,
  averaged over the MoE layers and the window's microbatches. 1.0 is perfectly balanced
  routing; it grows as tokens crowd onto few experts. Megatron-Core tracks it itself (only
  while training, with ``moe_aux_loss_coeff`` > 0); we reduce its tracker over PP, TP × CP and
  DP as Megatron-LM's ``track_moe_metrics`` does, then clear it.
* ``moe_expert_load_max_over_mean``: tokens routed to the busiest expert ÷ the mean over
  experts, in the most imbalanced layer (1.0: every expert got the same share; top-k / E × …
  would be the worst case of all tokens on k experts: E / k). Counted from the routers'
  routing maps by a forward hook (no Megatron code changed), over every rank's tokens.

A dense model has neither, and :func:`expert_load` gives None for it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter

from ray_ppu.util.wrappers import unwrap

_AUX = "load_balancing_loss"  # Megatron-Core's tracker name for the aux_loss balancing type


class ExpertLoad:
    """Tokens per expert per layer since the last row, counted on this rank's routers."""

    def __init__(self, model: list, config, device: torch.device) -> None:
        self.config = config
        self.counts = torch.zeros(config.num_layers, config.num_moe_experts, dtype=torch.float64,
                                  device=device)
        for chunk in model:
            for module in unwrap(chunk).modules():
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(self._count)

    def _count(self, router, args, output) -> None:
        # training passes only (as Megatron tracks its aux loss); with full recompute the first
        # forward runs without grad and the recomputation counts once
        if router.training and torch.is_grad_enabled():
            _, routing_map = output  # [tokens, experts], True where a token goes
            self.counts[router.layer_number - 1] += routing_map.sum(0).to(self.counts.dtype)

    def row(self, microbatches: int) -> dict:
        """The window's two numbers (collective: every rank calls it); resets the window.
        ``microbatches``: how many the window ran (iterations × microbatches per iteration)."""
        # a layer's counts live on its pipeline stage and are zeros elsewhere; TP ranks without
        # sequence parallelism count the same tokens, which scales a layer but not its ratio
        dist.all_reduce(self.counts)
        per_layer = self.counts[self.counts.sum(1) > 0]
        imbalance = (per_layer.max(1).values / per_layer.mean(1)).max() if len(per_layer) else 1.0
        self.counts.zero_()
        row = {"moe_expert_load_max_over_mean": float(imbalance)}
        if self.config.moe_aux_loss_coeff > 0:
            row["moe_load_balancing_loss"] = self._balancing_loss(microbatches)
        return row

    def _balancing_loss(self, microbatches: int) -> float:
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        if _AUX not in tracker:  # a stage that ran no MoE layer yet: zeros keep ranks in step
            tracker[_AUX] = {"values": torch.zeros(self.config.num_layers, device=self.counts.device)}
        moe_utils.reduce_aux_losses_tracker_across_ranks([_AUX])
        values = tracker[_AUX]["values"] / max(microbatches, 1)
        moe_utils.clear_aux_losses_tracker()
        return float(values.sum() / self.config.num_layers)  # every layer is a MoE layer


def expert_load(model: list, config, device: torch.device) -> Optional[ExpertLoad]:
    """An :class:`ExpertLoad` hooked into ``model``'s routers; None for a dense model."""
    return ExpertLoad(model, config, device) if config.num_moe_experts else None
