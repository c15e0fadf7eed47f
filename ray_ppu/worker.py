"""One training process: device → Megatron parallel state → model → optimizer → loop.

No Ray here: Ray Train (``ray_ppu.launcher``) and plain torchrun (``entrypoints/torchrun_pretrain.py``)
both call :func:`run` after creating the default process group.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch.distributed as dist

from ray_ppu import devices, parallel
from ray_ppu.config.schema import RunConfig
from ray_ppu.metrics import MetricsWriter
from ray_ppu.plan import Plan


def run(
    cfg: RunConfig,
    plan: Plan,
    backend: devices.Backend,
    device_id: int,
    batches: Optional[Iterator[dict]],
    valid_batches: Optional[Iterator[dict]] = None,
    start_iteration: int = 0,
) -> dict:
    """Train this rank; returns the last logged metrics (identical on every rank).

    1. Bind the device (PPU id, or the CPU shim) for this thread.
    2. Megatron parallel groups and seeds on the existing process group.
    3. GPTModel chunks in Megatron DDP; Megatron optimizer and LR schedule.
    4. The loop; rank 0 writes metrics.jsonl, TensorBoard and the progress line.
    5. Tear down the parallel groups (the process group belongs to the caller).
    """
    from ray_ppu.model import build_model
    from ray_ppu.optim import build_optimizer
    from ray_ppu.train_loop import train

    writer = MetricsWriter(cfg.output.dir, cfg.output.tensorboard) if dist.get_rank() == 0 else None

    def on_log(metrics: dict) -> None:
        if writer is not None:
            writer.write(metrics)

    with devices.bound(backend, device_id):
        parallel.initialize(plan, cfg.training.seed)
        try:
            model, _ = build_model(cfg, plan, backend)
            optimizer, scheduler = build_optimizer(cfg, plan, model)
            return train(plan, model, optimizer, scheduler, batches, devices.torch_device(backend),
                         cfg.training.log_interval, on_log, start_iteration, valid_batches)
        finally:
            parallel.destroy()
            if writer is not None:
                writer.close()
