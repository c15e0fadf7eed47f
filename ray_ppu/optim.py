"""Megatron-Core optimizer (distributed by default) and its warmup + cosine schedule."""

from __future__ import annotations

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from ray_ppu.config.schema import RunConfig
from ray_ppu.plan import Plan


def build_optimizer(cfg: RunConfig, plan: Plan, model_chunks: list):
    """Adam with decoupled weight decay, gradient clipping, and Megatron's LR scheduler.

    The scheduler counts samples, as Megatron-LM does (``step(increment=global_batch_size)``),
    so warmup and decay stay put if the global batch is changed mid-run.
    """
    t = cfg.training
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            adam_eps=t.adam_eps,
            clip_grad=t.clip_grad,
            bf16=t.precision == "bf16",
            fp16=t.precision == "fp16",
            params_dtype=model_chunks[0].config.params_dtype,
            use_distributed_optimizer=t.use_distributed_optimizer,
        ),
        model_chunks,
    )
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
