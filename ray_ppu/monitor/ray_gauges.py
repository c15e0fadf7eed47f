"""Training metrics into Ray's metrics pipeline (``ray.util.metrics``): the Ray dashboard's
Metrics view and any Prometheus scraping the nodes show them, tagged by run and rank.

Each worker exports its own rows (every rank logs the same reduced loss; throughput, memory and
data wait are its own). Ray prefixes the names with ``ray_``: ``ppu_lm_loss`` is scraped as
``ray_ppu_lm_loss``; ``cluster/grafana/ray_ppu.json`` charts them.
"""

from __future__ import annotations

import math
from typing import Optional

# metrics.jsonl key → (Ray metric name, description). Gauges: the latest value.
GAUGES: dict[str, tuple[str, str]] = {
    "iteration": ("ppu_iteration", "Iterations done"),
    "lm_loss": ("ppu_lm_loss", "Training loss (token-weighted mean over the log window)"),
    "valid_lm_loss": ("ppu_valid_lm_loss", "Validation loss of the latest pass"),
    "valid_ppl": ("ppu_valid_ppl", "Validation perplexity of the latest pass"),
    "lr": ("ppu_lr", "Learning rate"),
    "grad_norm": ("ppu_grad_norm", "Global gradient norm before clipping"),
    "loss_scale": ("ppu_loss_scale", "fp16 dynamic loss scale"),
    "skipped_iterations": ("ppu_skipped_iterations", "Steps skipped (fp16 overflow) in the window"),
    "step_time_s": ("ppu_step_time_s", "Seconds per iteration"),
    "tokens_per_s": ("ppu_tokens_per_s", "Tokens per second, whole run"),
    "tokens_per_s_per_device": ("ppu_tokens_per_s_per_device", "Tokens per second per device"),
    "tflops_per_device": ("ppu_tflops_per_device", "Model TFLOP/s per device (Megatron-LM count)"),
    "mfu": ("ppu_mfu", "Model FLOPs utilization: TFLOP/s per device / bf16 peak"),
    "data_wait_s": ("ppu_data_wait_s", "Seconds per iteration waiting on the data stream"),
    "peak_memory_gib": ("ppu_peak_memory_gib", "Peak device memory allocated, GiB"),
    "eta_s": ("ppu_eta_s", "Estimated seconds to the end of training"),
    "restarts": ("ppu_restarts", "Worker-group restarts so far"),
    "checkpoint_time_s": ("ppu_checkpoint_time_s", "Seconds the latest checkpoint took"),
    "checkpoint_failures": ("ppu_checkpoint_failures", "Failed checkpoint saves so far"),
    "world_size": ("ppu_world_size", "Workers training (an elastic group changes it)"),
    "moe_load_balancing_loss": ("ppu_moe_load_balancing_loss",
                                "MoE load-balancing loss per layer, without its coefficient (1 = balanced)"),
    "moe_expert_load_max_over_mean": ("ppu_moe_expert_load_max_over_mean",
                                      "Tokens of the busiest expert / the mean, worst MoE layer"),
}


class RayMetrics:
    """Gauges of one worker, tagged ``run`` (Ray Train run name) and ``rank``."""

    def __init__(self, run: str, rank: int) -> None:
        from ray.util.metrics import Gauge

        self.tags = {"run": run, "rank": str(rank)}
        self._gauges = {key: Gauge(name, description=text, tag_keys=("run", "rank"))
                        for key, (name, text) in GAUGES.items()}

    def export(self, row: dict) -> None:
        """Set the gauges of the fields this row carries (a training window, a validation
        pass or an event row)."""
        for key, value in row.items():
            gauge: Optional[object] = self._gauges.get(key)
            if gauge is not None and isinstance(value, (int, float)) and math.isfinite(value):
                gauge.set(float(value), tags=self.tags)
