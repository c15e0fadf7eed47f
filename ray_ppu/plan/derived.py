"""Numbers the plan derives from the config that its rules need too (layers per model chunk,
the row length, the schedule in iterations). Each is lenient: on a config the rules reject it
gives a placeholder (None or 0), so the rules can report every problem in one message."""

from __future__ import annotations

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
    per_iteration = tokens_per_iteration(cfg)
    if t.train_tokens is not None:
        train = t.train_tokens // per_iteration
    else:
        train = t.train_iters if t.train_iters is not None else 0
    warmup = (t.lr_warmup_tokens // per_iteration if t.lr_warmup_tokens is not None
              else t.lr_warmup_iters)
    sft = cfg.data.dataset == "sft"
    decay = t.lr_decay_iters if t.lr_decay_iters is not None else train - (warmup if sft else 0)
    return train, warmup, decay
