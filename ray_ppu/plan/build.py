"""The plan: the numbers a run is built from, derived once the config has passed its rules."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ray_ppu.config.schema import RunConfig
from ray_ppu.errors import ConfigError
from ray_ppu.plan import derived, rules, vision
from ray_ppu.plan.arithmetic import (active_parameters, attention_flops_coefficient,
                                     trainable_stage_parameters,
                                     flops_per_iteration, stage_parameters)
from ray_ppu.plan.layout import ParallelDims, active_workers


@dataclass(frozen=True)
class Plan:
    """The numbers a run is built from, printed by ``--dry-run``."""

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    data_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int
    expert_data_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None
    sequence_parallel: bool
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    seq_length: int
    train_iters: int
    lr_warmup_iters: int
    lr_decay_iters: int
    train_samples: int
    train_tokens: int
    eval_interval: int
    eval_iters: int
    valid_samples: int
    packed_sequences: bool
    padded_vocab_size: int
    kv_channels: int
    num_parameters: int
    # what one token's forward pass multiplies with: a MoE model's routed top-k experts (and
    # its routers), not all of them; the total for a dense model
    num_active_parameters: int
    num_parameters_per_device: int
    flops_per_iteration: float
    # core attention FLOPs of one sample = this × its length² (causal, Megatron-LM's count):
    # packed rows count their samples' lengths instead of seq_length
    attention_flops_coefficient: float = 0.0
    # a vision-language model's FLOPs per image (ViT + projector): the plan counts one image
    # per sample, the training log the images its batches held
    flops_per_image: float = 0.0
    spare_workers: int = 0  # workers in the Ray group beyond world_size, outside Megatron's groups
    # what trains (all of it, but for LoRA: the adapters and the base parts lora.trainable names)
    num_trainable_parameters: int = 0
    num_trainable_parameters_per_device: int = 0
    # M-RoPE (Qwen2.5-VL): the positions travel with the data and every stage reads them
    positions_in_data: bool = False

    @property
    def every_chunk_reads(self) -> bool:
        """Every model chunk's attention needs what comes with the data: M-RoPE's positions,
        or packed rows' sample boundaries; so every pipeline stage (and, interleaved, every
        virtual stage) reads the microbatch, not only the first and the last."""
        return self.positions_in_data or self.packed_sequences

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(
            self.world_size,
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
            self.expert_model_parallel_size,
            self.expert_tensor_parallel_size,
            every_stage_reads=self.every_chunk_reads,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def build_plan(cfg: RunConfig, forward_only: bool = False, files: bool = True) -> Plan:
    """Validate the config against itself (:func:`ray_ppu.plan.rules.problems`: ConfigError lists
    every problem) and derive the plan (``forward_only``: of a model that never trains;
    ``files=False``: for planning where the data is not, ``--plan-only``)."""
    found = rules.problems(cfg, forward_only, files)
    if found:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(found))
    m, p, t = cfg.model, cfg.parallel, cfg.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dims = rules.dims_or_none(cfg)
    train_iters, warmup, decay = derived.schedule_iterations(cfg)
    # Megatron's count: a pass every eval_interval plus one at the end, each pass reading
    # fresh validation samples (the validation stream never rewinds).
    evaluations = train_iters // t.eval_interval + 1 if t.eval_interval > 0 else 0
    padded_vocab = m.padded_vocab_size(tp)
    total, first, last = stage_parameters(cfg, tp, pp, padded_vocab, dims.ep, dims.etp)
    trainable = trainable_stage_parameters(cfg, tp, pp, padded_vocab, dims.ep, dims.etp)
    return Plan(
        world_size=dims.world_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=dims.cp,
        data_parallel_size=dims.dp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
        expert_data_parallel_size=dims.expert_dp,
        virtual_pipeline_model_parallel_size=derived.virtual_stages(cfg),
        sequence_parallel=p.sequence_parallel,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        num_microbatches=t.global_batch_size // (t.micro_batch_size * dims.dp),
        seq_length=derived.row_length(cfg),
        train_iters=train_iters,
        lr_warmup_iters=warmup,
        lr_decay_iters=decay,
        train_samples=train_iters * t.global_batch_size,
        train_tokens=train_iters * derived.tokens_per_iteration(cfg),
        eval_interval=t.eval_interval,
        eval_iters=t.eval_iters,
        valid_samples=evaluations * t.eval_iters * t.global_batch_size,
        packed_sequences=cfg.data.dataset == "sft" and cfg.data.packing,
        positions_in_data=cfg.model.mrope_section is not None,
        padded_vocab_size=padded_vocab,
        kv_channels=m.effective_kv_channels,
        num_parameters=total,
        num_active_parameters=active_parameters(cfg, padded_vocab),
        num_parameters_per_device=max(first, last),
        flops_per_iteration=float(flops_per_iteration(cfg, padded_vocab)),
        attention_flops_coefficient=attention_flops_coefficient(cfg),
        flops_per_image=vision.flops_per_image(cfg),
        num_trainable_parameters=trainable[0],
        num_trainable_parameters_per_device=max(trainable[1:]),
    )


def plan_for_world(cfg: RunConfig, world_size: int) -> Plan:
    """The plan of a worker group of ``world_size`` (an elastic group can be smaller than
    ``cluster.num_workers``): the active workers' layout, the same global batch (more
    microbatches per rank), the rest spare."""
    p, t = cfg.parallel, cfg.training
    ep, etp = derived.expert_sizes(cfg)
    active = active_workers(world_size, p.tensor_model_parallel_size,
                            p.pipeline_model_parallel_size, p.context_parallel_size,
                            t.global_batch_size, t.micro_batch_size, ep * etp)
    if active == 0:
        experts = f" and stages of whole EP {ep} × ETP {etp} groups" if ep * etp > 1 else ""
        raise ConfigError(f"{world_size} workers hold no model replica of TP × PP × CP = "
                          f"{p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size}"
                          f" with global batch {t.global_batch_size}{experts}")
    cluster = dataclasses.replace(cfg.cluster, num_workers=active, min_workers=None)
    plan = build_plan(dataclasses.replace(cfg, cluster=cluster))
    return dataclasses.replace(plan, spare_workers=world_size - active)
