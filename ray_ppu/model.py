"""GPTModel from a preset, wrapped in Megatron-Core DDP: the ``model_provider`` of Megatron."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from ray_ppu.config.schema import RunConfig
from ray_ppu.devices import Backend
from ray_ppu.plan import Plan

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def transformer_engine_available(backend: Backend) -> bool:
    """Transformer Engine is used only on a device backend and only when it imports."""
    if backend != "ppu":
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken build against this torch
        return False
    return True


def transformer_config(cfg: RunConfig, plan: Plan, backend: Backend) -> TransformerConfig:
    """Megatron-Core TransformerConfig for the Qwen2.5 / LLaMA architecture of ``cfg.model``."""
    m, precision = cfg.model, cfg.training.precision
    dtype = _DTYPES[precision]
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True,  # SwiGLU: silu(gate) * up
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=m.add_qkv_bias,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=plan.tensor_model_parallel_size,
        pipeline_model_parallel_size=plan.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=plan.virtual_pipeline_model_parallel_size,
        context_parallel_size=plan.context_parallel_size,
        sequence_parallel=plan.sequence_parallel,
        # CPU init draws the full weight from the (identically seeded) CPU generator and then
        # slices it, so the model is the same whatever TP is: TP=2 trains like TP=1.
        use_cpu_initialization=backend == "cpu",
        # Fused kernels need apex / Transformer Engine / CUDA; the local path uses plain torch.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
    )


def packed_format(plan: Plan, backend: Backend) -> Optional[str]:
    """How packed SFT rows keep their samples apart: ``"thd"`` with Transformer Engine
    (PackedSeqParams: its fused attention takes the sample boundaries, no s² mask), ``"mask"``
    with the local spec (an explicit block-diagonal causal mask); None for unpacked rows."""
    if not plan.packed_sequences:
        return None
    return "thd" if transformer_engine_available(backend) else "mask"


def build_model(cfg: RunConfig, plan: Plan, backend: Backend) -> tuple[list[DistributedDataParallel], TransformerConfig]:
    """One GPTModel chunk per virtual pipeline stage, each wrapped in Megatron-Core DDP."""
    config = transformer_config(cfg, plan, backend)
    if transformer_engine_available(backend):
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        layer_spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")

    chunks = []
    num_chunks = plan.virtual_pipeline_model_parallel_size or 1
    for vp_stage in range(num_chunks):
        stage = vp_stage if plan.virtual_pipeline_model_parallel_size else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=plan.padded_vocab_size,
            max_sequence_length=cfg.model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
            position_embedding_type="rope",
            rotary_base=cfg.model.rotary_base,
            rope_scaling=cfg.model.rope_scaling,
            rope_scaling_factor=cfg.model.rope_scaling_factor,
            vp_stage=stage,
        )
        if backend == "ppu":
            model.cuda(torch.cuda.current_device())
        chunks.append(model)

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=cfg.training.use_distributed_optimizer,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
    )
    wrapped = [
        DistributedDataParallel(
            config=config,
            ddp_config=ddp_config,
            module=chunk,
            # Only the first chunk's buckets can be overlapped with the pipeline bubble.
            disable_bucketing=i > 0,
        )
        for i, chunk in enumerate(chunks)
    ]
    return wrapped, config
