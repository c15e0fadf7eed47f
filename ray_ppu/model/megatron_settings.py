"""What a run config becomes in Megatron-Core, as plain data.

``model.py`` and ``optim.py`` build ``TransformerConfig``, ``DistributedDataParallelConfig`` and
``OptimizerConfig`` from these dicts, and ``--dry-run`` prints the same dicts, so what a user
reads before renting 16 PPU is what the workers construct. No torch here: dtypes are names.

Which settings need Transformer Engine is decided in :mod:`ray_ppu.plan.te_options`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

from ray_ppu.config.schema import RunConfig
from ray_ppu.plan.memory import offload_fraction
from ray_ppu.plan.kernels import choose

# Precision → the dtype parameters are kept and computed in (fp8 keeps bf16 parameters; TE casts
# the GEMM inputs to fp8 with delayed scaling).
PARAMS_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "bfloat16"}


def _precision(precision: str) -> dict:
    """The precision switches both TransformerConfig and OptimizerConfig carry."""
    return dict(bf16=precision in ("bf16", "fp8"), fp16=precision == "fp16",
                params_dtype=PARAMS_DTYPE[precision])


def overlap(cfg: RunConfig) -> dict[str, bool]:
    """Grad-reduce / param-gather overlap as the DDP wrapper gets it: activation offload turns
    both off (the reference does); param gather only exists with the distributed optimizer."""
    p, t = cfg.parallel, cfg.training
    offload = cfg.memory.activation_offload_layers > 0
    return {
        "overlap_grad_reduce": p.overlap_grad_reduce and not offload,
        "overlap_param_gather": (p.overlap_param_gather and t.use_distributed_optimizer
                                 and not offload),
    }


def transformer_settings(cfg: RunConfig, plan, te: bool) -> dict:
    """Keyword arguments of Megatron-Core's ``TransformerConfig`` (``te``: TE layers in use;
    without them the fused-kernel switches are off: they need apex / TE / CUDA)."""
    m, t, mem = cfg.model, cfg.training, cfg.memory
    precision = t.precision
    qk_scaling = (t.apply_query_key_layer_scaling if t.apply_query_key_layer_scaling is not None
                  else precision == "fp16")
    settings = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.effective_kv_channels,  # explicit: Qwen3's head_dim is not hidden/heads
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True,  # SwiGLU: silu(gate) * up (activation_func set by model.py)
        add_bias_linear=False,
        add_qkv_bias=m.add_qkv_bias,
        # Qwen3's per-head q / k RMSNorm: model.py's layer specs build the norms, and
        # finalize_model_grads sums their gradients over TP (each rank normed its own heads)
        qk_layernorm=m.qk_layernorm,
        mrope_section=list(m.mrope_section) if m.mrope_section else None,
        **_precision(precision),
        pipeline_dtype=PARAMS_DTYPE[precision],
        apply_query_key_layer_scaling=qk_scaling,
        # TE layers take the kernel choice from here; the local spec is Megatron's own attention
        attention_backend=t.attention_backend if te else "local",
        tensor_model_parallel_size=plan.tensor_model_parallel_size,
        pipeline_model_parallel_size=plan.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=plan.virtual_pipeline_model_parallel_size,
        context_parallel_size=plan.context_parallel_size,
        sequence_parallel=plan.sequence_parallel,
        # Megatron-LM's defaults: interleaved pipelines overlap their p2p transfers, which takes
        # the unbatched send/recv path (with PP 2 each direction on its own communicator; the
        # batched path mixes up the two directions' messages between the same two ranks)
        overlap_p2p_comm=plan.virtual_pipeline_model_parallel_size is not None,
        batch_p2p_comm=plan.virtual_pipeline_model_parallel_size is None,
        # recompute: Megatron's names; selective recomputes core attention ("core_attn")
        recompute_granularity=None if mem.recompute == "none" else mem.recompute,
        recompute_method=mem.recompute_method if mem.recompute == "full" else None,
        recompute_num_layers=mem.recompute_num_layers if mem.recompute == "full" else None,
        cpu_offloading=mem.activation_offload_layers > 0,
        cpu_offloading_num_layers=mem.activation_offload_layers,
        cpu_offloading_activations=True,
        cpu_offloading_weights=False,
        # no CUDA graphs are captured (cuda_graph_impl stays "none"); Megatron-Core's default
        # scope, "full", only makes every rank warn that it is deprecated
        cuda_graph_scope=[],
    )
    if m.is_moe:
        settings.update(moe_settings(cfg, plan, te))
    if precision == "fp8":
        settings.update(fp8=t.fp8_format, fp8_recipe="delayed",
                        fp8_amax_history_len=t.fp8_amax_history_len,
                        fp8_amax_compute_algo=t.fp8_amax_compute_algo)
    if not te:
        settings.update(masked_softmax_fusion=False, bias_activation_fusion=False,
                        bias_dropout_fusion=False, apply_rope_fusion=False,
                        gradient_accumulation_fusion=False, persist_layer_norm=False,
                        cross_entropy_loss_fusion=False)
    return settings


def moe_settings(cfg: RunConfig, plan, te: bool) -> dict:
    """TransformerConfig's mixture-of-experts keywords for Qwen3-MoE routing: softmax over the
    experts' logits in fp32, top-k, renormalised (HF norm_topk_prob) or not, a per-layer
    load-balancing loss; the experts laid out by EP × ETP."""
    m = cfg.model
    return dict(
        num_moe_experts=m.num_moe_experts,
        moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.effective_moe_ffn_hidden_size,
        moe_router_score_function="softmax",
        # renormalised top-k = softmax over the k chosen logits; otherwise softmax over all,
        # then the top k of it (Megatron-Core's pre-softmax)
        moe_router_pre_softmax=not m.moe_norm_topk_prob,
        moe_router_dtype="fp32",  # HF routes in fp32 whatever the model's dtype
        moe_router_load_balancing_type="aux_loss" if m.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_token_dispatcher_type=cfg.parallel.moe_token_dispatcher_type,
        # TE's grouped GEMM runs every local expert in one kernel (the local spec's own grouped
        # experts are chosen by ray_ppu.plan.kernels, not by this switch, which picks
        # Megatron's GroupedMLP); one after another where LoRA adapts the experts (its
        # adapters hook each expert's linears). The fused permutation needs TE ≥ 2.1: left off.
        moe_grouped_gemm=(te and cfg.training.moe_grouped_gemm
                          and not cfg.lora.on_experts(m.is_moe)),
        moe_permute_fusion=False,
        expert_model_parallel_size=plan.expert_model_parallel_size,
        expert_tensor_parallel_size=plan.expert_tensor_parallel_size,
    )


def ddp_settings(cfg: RunConfig) -> dict:
    """Keyword arguments of Megatron-Core's ``DistributedDataParallelConfig``."""
    return dict(
        grad_reduce_in_fp32=True,  # fp32 gradient buffers: 4 bytes per parameter (memory plan)
        use_distributed_optimizer=cfg.training.use_distributed_optimizer,
        bucket_size=cfg.parallel.ddp_bucket_size,
        **overlap(cfg),
    )


def optimizer_settings(cfg: RunConfig, offload_fraction: Optional[float] = None) -> dict:
    """Keyword arguments of Megatron-Core's ``OptimizerConfig`` (Adam, decoupled weight decay).

    ``offload_fraction``: the host share of the optimizer states (``memory.optimizer_offload``;
    auto: from the memory plan, ``ray_ppu.plan.memory``)."""
    t, mem = cfg.training, cfg.memory
    settings = dict(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.clip_grad,
        **_precision(t.precision),
        use_distributed_optimizer=t.use_distributed_optimizer,
    )
    if t.precision == "fp16":
        settings.update(loss_scale=t.loss_scale, initial_loss_scale=t.initial_loss_scale,
                        min_loss_scale=t.min_loss_scale, loss_scale_window=t.loss_scale_window,
                        hysteresis=t.hysteresis)
    if mem.optimizer_offload != "none":
        fraction = mem.optimizer_offload_fraction if offload_fraction is None else offload_fraction
        settings.update(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction,
                        # Megatron-Core's hybrid optimizer updates fp32 copies on the host
                        )
    return settings


def describe(cfg: RunConfig, plan, te: bool = True) -> dict:
    """The three Megatron-Core configs, the layer spec and the kernels, for ``--dry-run``
    (``te``: whether the target devices have Transformer Engine; PPU and GPU images do)."""
    kernels = choose(cfg, te)
    return {
        "layer_spec": "transformer_engine" if kernels.attention == "te" else "local",
        "kernels": asdict(kernels),
        "TransformerConfig": transformer_settings(cfg, plan, kernels.attention == "te"),
        "DistributedDataParallelConfig": ddp_settings(cfg),
        "OptimizerConfig": optimizer_settings(cfg, offload_fraction(cfg, plan)),
    }
