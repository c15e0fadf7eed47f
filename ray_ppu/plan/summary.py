"""The plan in a few lines a person reads: the launch logs them, ``--dry-run`` prints them on
stderr (its JSON on stdout holds every number). Layout, batch arithmetic, schedule (with any
token length that rounded to zero iterations), model size and FLOPs, the kernels, the memory of
one device.
"""

from __future__ import annotations

from ray_ppu.config.schema import RunConfig
from ray_ppu.plan.derived import (lr_at, rounded_to_zero, schedule_notes,
                                  tokens_per_iteration)
from ray_ppu.plan.kernels import choose, planned
from ray_ppu.plan.memory import HEADROOM, MemoryPlan
from ray_ppu.plan.vision import component_parameters


def summary_lines(cfg: RunConfig, plan, memory: MemoryPlan) -> list[str]:
    """The plan's human summary, one fact per line."""
    validation = ([f"validation: every {plan.eval_interval} iterations and at the end, "
                   f"{plan.eval_iters} × {plan.global_batch_size} samples per pass, "
                   f"{plan.valid_samples} in all"] if plan.eval_iters else [])
    return ([_layout(plan), _batch(cfg, plan), _schedule(cfg, plan)]
            + [f"note: {line}" for line in rounded_to_zero(cfg) + schedule_notes(cfg, plan)]
            + validation
            + [_model(plan)] + _vision(cfg, plan) + _lora(cfg, plan) + [_kernels(cfg)]
            + [_memory(memory)])


def _layout(plan) -> str:
    line = (f"layout: {plan.world_size} workers = TP {plan.tensor_model_parallel_size} × CP "
            f"{plan.context_parallel_size} × PP {plan.pipeline_model_parallel_size} × DP "
            f"{plan.data_parallel_size}")
    if plan.virtual_pipeline_model_parallel_size:
        line += f", {plan.virtual_pipeline_model_parallel_size} virtual stages per stage"
    if plan.sequence_parallel:
        line += ", sequence parallel"
    if plan.expert_model_parallel_size * plan.expert_tensor_parallel_size > 1:
        line += (f"; experts EP {plan.expert_model_parallel_size} × ETP "
                 f"{plan.expert_tensor_parallel_size} × expert-DP {plan.expert_data_parallel_size}")
    return line


def _batch(cfg: RunConfig, plan) -> str:
    return (f"batch: {plan.global_batch_size} samples = {plan.micro_batch_size} per microbatch "
            f"× DP {plan.data_parallel_size} × {plan.num_microbatches} microbatches; "
            f"{plan.seq_length} tokens per sample, {tokens_per_iteration(cfg):,} per iteration")


def _schedule(cfg: RunConfig, plan) -> str:
    t = cfg.training
    how = (f"train_tokens {t.train_tokens:,} / {tokens_per_iteration(cfg):,}"
           if t.train_tokens is not None else "train_iters")
    decay = ("constant lr" if t.lr_decay_style == "constant" else
             f"{t.lr_decay_style} decay to min_lr {t.min_lr:g} at iteration {plan.lr_decay_iters}")
    last = plan.train_iters
    return (f"schedule: {plan.train_iters} iterations ({how}), warmup {plan.lr_warmup_iters}, "
            f"{decay}; lr {t.lr:g} at its peak, {lr_at(cfg, plan, 1):.3g} at iteration 1 and "
            f"{lr_at(cfg, plan, last):.3g} at iteration {last}")


def _model(plan) -> str:
    active = ("" if plan.num_active_parameters == plan.num_parameters
              else f" ({_count(plan.num_active_parameters)} active per token)")
    return (f"model: {_count(plan.num_parameters)} parameters{active}, "
            f"{_count(plan.num_parameters_per_device)} on the most loaded device; "
            f"{plan.flops_per_iteration:.3g} FLOPs per iteration")


def _vision(cfg: RunConfig, plan) -> list[str]:
    """A vision-language model's parameters per component, what trains, the image FLOPs."""
    v = cfg.vision
    if not v.enabled:
        return []
    parts = component_parameters(cfg)
    parts["language"] = plan.num_parameters - sum(parts.values())
    described = ", ".join(f"{name} {_count(n)} ({'frozen' if name in v.freeze else 'trains'})"
                          for name, n in parts.items())
    if v.native:  # images at their own size: the counts are of the nominal one
        full = len(v.full_attention_layers)
        return [f"components: {described}; {plan.num_trainable_parameters:,} parameters train; "
                f"{v.image_tokens} tokens and {plan.flops_per_image:.3g} FLOPs per nominal "
                f"image ({v.encoder} at native resolution, {v.min_pixels:,} … "
                f"{v.max_pixels:,} pixels; counted at {v.image_size} × {v.image_size} px: "
                f"{v.patches} patches, {v.num_layers} ViT layers, {full} of them over the whole "
                f"image, the rest in {v.window_size}-px windows; replicated on each TP rank)"]
    return [f"components: {described}; {plan.num_trainable_parameters:,} parameters train; "
            f"{v.image_tokens} tokens and {plan.flops_per_image:.3g} FLOPs per image "
            f"({v.encoder} {v.image_size} px, {v.layers_built} ViT layers)"]


def _lora(cfg: RunConfig, plan) -> list[str]:
    """What a LoRA run trains: its count and share, and the adapters."""
    if not cfg.lora.enabled:
        return []
    lora, share = cfg.lora, plan.num_trainable_parameters / plan.num_parameters
    spelled = lora.spelled(cfg.model.is_moe)  # the names the config gave, where not these
    ranks = ", ".join(f"{t} r{lora.rank_of(t)}"
                      + (f" (from {', '.join(spelled[t])})" if t in spelled else "")
                      for t in lora.targets(cfg.model.is_moe))
    also = f"; also training {', '.join(lora.trainable)}" if lora.trainable else ""
    return [f"trainable: {_count(plan.num_trainable_parameters)} of "
            f"{_count(plan.num_parameters)} parameters ({share:.2%}), "
            f"{_count(plan.num_trainable_parameters_per_device)} on the most loaded device: "
            f"LoRA {ranks}{also}; the base is frozen", _exports(cfg)]


def _exports(cfg: RunConfig) -> str:
    """What a LoRA run's checkpoints export to (convert_checkpoint.py mcore-to-hf): a PEFT
    adapter (a trained projector / merger as its modules_to_save), or only the merged model
    when base parts outside those train in full."""
    vision, full = cfg.vision, list(cfg.lora.trainable)
    if vision.enabled and "vision" not in vision.freeze:
        full.append("the vision tower")
    saved = (" (the " + ("merger" if vision.native else "projector") + " as modules_to_save)"
             if vision.enabled and "projector" not in vision.freeze else "")
    if full:
        verb = "trains" if len(full) == 1 else "train"
        return (f"exports: the merged model (--merge) only: {', '.join(full)} {verb} in full, "
                f"which a PEFT adapter does not carry")
    return f"exports: a PEFT adapter{saved}, or the merged model (--merge)"


def _kernels(cfg: RunConfig) -> str:
    """The kernels the layers run (:mod:`ray_ppu.plan.kernels`); on a device with
    ``attention_backend=auto`` also what a worker without Transformer Engine takes."""
    kernels = planned(cfg)
    line = f"kernels: {kernels.describe()}"
    if kernels.attention == "te" and cfg.training.attention_backend == "auto":
        line += f" (a worker where Transformer Engine does not import: {choose(cfg, False).describe()})"
    return line


def _count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    return f"{n / 1e6:.1f} M" if n >= 1e5 else f"{n / 1e3:.1f} K"


def _memory(m: MemoryPlan) -> str:
    verdict = "fits" if m.fits else "does NOT fit"
    stage = "" if m.stage == "only" else f", {m.stage} pipeline stage"
    offload = (f", {m.optimizer_host_gib:.1f} GiB of optimizer on the host"
               if m.optimizer_host_gib else "")
    split = (f" (frozen {m.frozen_parameters_gib:.1f}, trainable "
             f"{m.trainable_parameters_gib:.2f})" if m.frozen_parameters else "")
    return (f"memory per device ({m.accelerator}, {m.device_memory_gib:g} GiB{stage}): "
            f"{m.total_gib:.1f} GiB = parameters {m.parameters_gib:.1f}{split} + gradients "
            f"{m.gradients_gib:.1f} + optimizer {m.optimizer_gib:.1f} + activations "
            f"{m.activations_gib:.1f}{offload}: {verdict} in {HEADROOM:.0%} of the device")
