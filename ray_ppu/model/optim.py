"""Megatron-Core optimizer (distributed by default) and its warmup + cosine schedule."""

from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from ray_ppu.config.schema import RunConfig
from ray_ppu.model.megatron_settings import optimizer_settings
from ray_ppu.plan.memory import offload_fraction
from ray_ppu.plan import Plan


def build_optimizer(cfg: RunConfig, plan: Plan, model_chunks: list):
    """Adam with decoupled weight decay, gradient clipping, and Megatron's LR scheduler;
    fp16 adds dynamic loss scaling, ``memory.optimizer_offload`` Megatron-Core's hybrid-device
    optimizer (states and update on the host for the offloaded fraction).

    The scheduler counts samples, as Megatron-LM does (``step(increment=global_batch_size)``),
    so warmup and decay stay put if the global batch is changed mid-run.
    """
    t = cfg.training
    settings = optimizer_settings(cfg, offload_fraction(cfg, plan))
    settings["params_dtype"] = getattr(torch, settings["params_dtype"])
    optimizer = get_megatron_optimizer(OptimizerConfig(**settings), model_chunks)
    gbs = plan.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if plan.lr_warmup_iters else t.lr,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=plan.lr_warmup_iters * gbs,
        lr_decay_steps=plan.lr_decay_iters * gbs,
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=plan.train_iters * gbs,
        wd_incr_style="constant",
    )
    return optimizer, scheduler
