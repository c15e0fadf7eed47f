"""Numbers the plan derives from the config that its rules need too (layers per model chunk,
the row length, the schedule in iterations). Each is lenient: on a config the rules reject it
gives a placeholder (None or 0), so the rules can report every problem in one message."""

from __future__ import annotations

import math

from typing import Optional

from ray_ppu.config.schema import RunConfig


def virtual_stages(cfg: RunConfig) -> Optional[int]:
    """Model chunks per pipeline stage when interleaved; None when not interleaved (or when the
    interleaving is invalid: :mod:`ray_ppu.plan.rules` says why)."""
    m, p = cfg.model, cfg.parallel
    per_vstage, pp = p.num_layers_per_virtual_pipeline_stage, p.pipeline_model_parallel_size
    if per_vstage is None or pp < 2 or per_vstage < 1 or m.num_layers % (pp * per_vstage):
        return None
    return m.num_layers // pp // per_vstage


def expert_sizes(cfg: RunConfig) -> tuple[int, int]:
    """(EP, ETP) the experts are laid out with: ETP unset is TP (Megatron-Core's default) for
    a MoE model; a dense model has no experts, so (1, 1) whatever is set (the rules say so)."""
    p = cfg.parallel
    if not cfg.model.is_moe:
        return 1, 1
    etp = p.expert_tensor_parallel_size
    return p.expert_model_parallel_size, p.tensor_model_parallel_size if etp is None else etp


def layers_per_chunk(cfg: RunConfig) -> Optional[int]:
    """Transformer layers in one model chunk (a pipeline stage, or a virtual stage)."""
    pp = cfg.parallel.pipeline_model_parallel_size
    if cfg.model.num_layers % pp:
        return None
    return cfg.model.num_layers // pp // (virtual_stages(cfg) or 1)


def row_length(cfg: RunConfig) -> int:
    """Tokens per training row: SFT padded to max_padding_length trains on rows of that length."""
    d = cfg.data
    if d.dataset == "sft" and not d.packing and d.max_padding_length:
        return d.max_padding_length
    return cfg.training.seq_length


def tokens_per_iteration(cfg: RunConfig) -> int:
    return cfg.training.global_batch_size * row_length(cfg)


def schedule_iterations(cfg: RunConfig) -> tuple[int, int, int]:
    """(train, warmup, decay) iterations; tokens become iterations as Megatron-LM does (floor).

    Pretraining decays over all iterations; SFT over those after warmup, as PAI-Megatron-Patch's
    SFT script does. Train is 0 when neither train_tokens nor train_iters is set.
    """
    t = cfg.training
    train = _iterations(cfg, t.train_iters, t.train_tokens) or 0
    warmup = _iterations(cfg, t.lr_warmup_iters, t.lr_warmup_tokens) or 0
    decay = _iterations(cfg, t.lr_decay_iters, t.lr_decay_tokens)
    if decay is None:
        decay = train - (warmup if cfg.data.dataset == "sft" else 0)
    return train, warmup, decay


def _iterations(cfg: RunConfig, iterations: Optional[int], tokens: Optional[int]) -> Optional[int]:
    """A length given in iterations or in tokens (floor of tokens per iteration), else None."""
    if tokens is not None:
        return tokens // max(1, tokens_per_iteration(cfg))  # sizes ≥ 1 are the rules' to say
    return iterations


# The token forms of the lengths, each beside the iteration form it converts to.
TOKEN_FORMS = {"train_tokens": "train_iters", "lr_warmup_tokens": "lr_warmup_iters",
               "lr_decay_tokens": "lr_decay_iters"}


def rounded_to_zero(cfg: RunConfig) -> list[str]:
    """Token lengths shorter than one iteration (they become 0 iterations), one line each."""
    t, per_iteration = cfg.training, tokens_per_iteration(cfg)
    return [f"training.{name} {getattr(t, name):,} is under one iteration ({per_iteration:,} "
            f"tokens = global_batch_size {t.global_batch_size} × {row_length(cfg)}): "
            f"{iters} = 0" for name, iters in TOKEN_FORMS.items()
            if getattr(t, name) and getattr(t, name) < per_iteration]


def lr_at(cfg: RunConfig, plan, iteration: int) -> float:
    """The learning rate iteration ``iteration`` (counted from 1) trains with: Megatron-Core's
    OptimizerParamScheduler as ``ray_ppu.model.optim`` builds it (linear warmup from 0, then
    the decay style down to min_lr at ``lr_decay_iters``, min_lr after), which the step before
    an iteration sets."""
    t = cfg.training
    done, warmup, decay = iteration - 1, plan.lr_warmup_iters, plan.lr_decay_iters
    if warmup and done <= warmup:
        return t.lr * done / warmup
    if t.lr_decay_style == "constant":
        return t.lr
    if done > decay:
        return t.min_lr
    ratio = (done - warmup) / max(1, decay - warmup)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if t.lr_decay_style == "cosine" else 1 - ratio
    return t.min_lr + coeff * (t.lr - t.min_lr)


def schedule_notes(cfg: RunConfig, plan) -> list[str]:
    """Iterations that train at a learning rate of 0 after the decay (min_lr 0 and a decay
    that ends before the training does), one line; none otherwise."""
    t = cfg.training
    if t.min_lr or t.lr_decay_style == "constant" or plan.lr_decay_iters >= plan.train_iters:
        return []
    first = plan.lr_decay_iters + 1  # the decay's end sets the rate of the iteration after it
    return [f"iterations {first}..{plan.train_iters} train at lr 0: the decay reaches "
            f"min_lr 0 at iteration {plan.lr_decay_iters} (training.lr_decay_iters) and "
            f"training goes on to {plan.train_iters}"]
