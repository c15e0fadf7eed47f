"""GPTModel from a preset, wrapped in Megatron-Core DDP: the ``model_provider`` of Megatron."""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from ray_ppu.config.schema import RunConfig
from ray_ppu.devices import Backend, transformer_engine_error
from ray_ppu.errors import TransformerEngineMissing
from ray_ppu.model.megatron_settings import ddp_settings, transformer_settings
from ray_ppu.plan import Plan
from ray_ppu.plan.kernels import Kernels, choose
from ray_ppu.plan.te_options import needs_transformer_engine


def transformer_engine_available(backend: Backend) -> bool:
    """Transformer Engine is used only on a device backend and only when it imports."""
    return backend == "ppu" and transformer_engine_error() is None


class RMSNorm(torch.nn.Module):
    """RMSNorm for the local (non-TE) layer spec, as Megatron-Core's norm modules are built
    (``config, hidden_size, eps``). Megatron's torch-based norm refuses sequence parallelism;
    this one marks its weight ``sequence_parallel`` so ``finalize_model_grads`` all-reduces its
    gradient over the TP group (each TP rank saw only its share of the sequence)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def local_block_spec(config: TransformerConfig, vp_stage: Optional[int],
                     kernels: Kernels) -> TransformerBlockSubmodules:
    """Megatron-Core's local GPT layer spec (plain torch attention and MLP, or a MoE layer of
    :class:`~ray_ppu.model.moe_layers.LayoutFreeSequentialMLP` experts) with :class:`RMSNorm` for
    both layer norms, the final norm and (``qk_layernorm``, Qwen3) the per-head query / key
    norms, for this stage's layers. ``kernels.attention == "sdpa"``: the core attention is
    :class:`~ray_ppu.model.attention.TorchAttention`; ``kernels.experts == "grouped"``: the
    experts run as :class:`~ray_ppu.model.moe_layers.GroupedLayoutFreeMLP`."""
    layer = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                     normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    layer.submodules.input_layernorm = RMSNorm
    layer.submodules.pre_mlp_layernorm = RMSNorm
    attention = layer.submodules.self_attention.submodules
    if kernels.attention == "sdpa":
        from ray_ppu.model.attention import TorchAttention

        attention.core_attention = TorchAttention
    if config.num_moe_experts:
        from ray_ppu.model.moe_layers import (GroupedLayoutFreeMLP, LayoutFreeSequentialMLP,
                                              LocalTopKRouter)

        layer.submodules.mlp.submodules.router = LocalTopKRouter
        layer.submodules.mlp.submodules.experts.module = (
            GroupedLayoutFreeMLP if kernels.experts == "grouped" else LayoutFreeSequentialMLP)
        # a MoE layer's pre-MLP norm is its own module (no fc1 to fuse it into): saved under
        # its own name, as Transformer Engine's MoE layer saves it, so checkpoints of both
        # specs agree (the local spec would file it under fc1's fused-norm name)
        layer.submodules.sharded_state_dict_keys_map.pop("pre_mlp_layernorm.", None)
    if config.qk_layernorm:
        attention.q_layernorm = RMSNorm
        attention.k_layernorm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage),
                                      layer_norm=RMSNorm)


def worker_kernels(cfg: RunConfig, backend: Backend) -> Kernels:
    """The kernels this worker builds its layers with (:mod:`ray_ppu.plan.kernels`); an option
    that needs TE where it cannot run is an error naming the option (no silent fallback to
    another kernel)."""
    available = transformer_engine_available(backend)
    missing = [] if available else needs_transformer_engine(cfg)
    if missing:
        raise TransformerEngineMissing(
            f"Transformer Engine is not usable on this {backend} worker, but the run asks for: "
            + "; ".join(missing))
    return choose(cfg, available)


def transformer_config(cfg: RunConfig, plan: Plan, backend: Backend) -> TransformerConfig:
    """Megatron-Core TransformerConfig for the Qwen2.5 / Qwen3 / LLaMA architecture of
    ``cfg.model`` with the run's precision, recompute, offload and parallel settings
    (``ray_ppu.model.megatron_settings``, also what ``--dry-run`` prints)."""
    return TransformerConfig(
        **_settings(cfg, plan, backend),
        activation_func=F.silu,
        # CPU init draws the full weight from the (identically seeded) CPU generator and then
        # slices it, so the model is the same whatever TP is: TP=2 trains like TP=1.
        use_cpu_initialization=backend == "cpu",
    )


def _settings(cfg: RunConfig, plan: Plan, backend: Backend) -> dict:
    """``transformer_settings`` with torch's dtypes and Megatron's attention-backend enum."""
    settings = transformer_settings(cfg, plan, worker_kernels(cfg, backend).attention == "te")
    for key in ("params_dtype", "pipeline_dtype"):
        settings[key] = getattr(torch, settings[key])
    settings["attention_backend"] = AttnBackend[settings["attention_backend"]]
    return settings


def packed_format(cfg: RunConfig, plan: Plan, backend: Backend) -> Optional[str]:
    """How packed SFT rows keep their samples apart: ``"thd"`` (PackedSeqParams: Transformer
    Engine's fused attention or our torch kernels take the sample boundaries, no s² mask),
    ``"mask"`` with Megatron-Core's local attention (an explicit block-diagonal causal mask);
    None for unpacked rows."""
    if not plan.packed_sequences:
        return None
    return worker_kernels(cfg, backend).packed


def mask_padded_vocab(output_layer: torch.nn.Module, vocab_size: int) -> None:
    """Keep the rows Megatron pads the vocabulary with (to a multiple of
    ``make_vocab_size_divisible_by`` × TP) out of the softmax: their logits are set to -inf in place, on the TP ranks that hold them, so the loss
    and the predictions are those of the real vocabulary (a Hugging Face model's, exactly), and
    the padding rows get no gradient. In place: a linear layer does not keep its output for
    the backward pass, so no copy of the logits is made."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()

    def hook(module, args, kwargs, result):
        if kwargs.get("labels") is not None:  # the chunked loss's call: losses, masked within
            return result
        logits = result[0]
        part = logits.shape[-1]  # this rank's vocabulary slice
        first_padded = vocab_size - tp_rank * part
        if first_padded < part:
            logits[..., max(first_padded, 0):].fill_(float("-inf"))
        return result

    output_layer.register_forward_hook(hook, with_kwargs=True)


def _gpt_class(cfg: RunConfig, kernels: Kernels):
    """GPTModel, or with ``kernels.loss == "chunked"`` its chunked-loss form (the real
    vocabulary and the chunk size bound in)."""
    if kernels.loss != "chunked":
        return GPTModel
    from ray_ppu.model.output_loss import ChunkedLossGPTModel

    return partial(ChunkedLossGPTModel, real_vocab_size=cfg.model.vocab_size,
                   chunk=cfg.training.cross_entropy_chunk_tokens)


def build_model(cfg: RunConfig, plan: Plan, backend: Backend, initialize: bool = True,
                ddp: bool = True) -> tuple[list[torch.nn.Module], TransformerConfig]:
    """One GPTModel chunk per virtual pipeline stage (in a Float16Module for fp16 / bf16 /
    fp8), each wrapped in Megatron-Core DDP. ``initialize`` False: the weights are about to be
    loaded, so they start as zeros instead of random draws. ``ddp`` False (no training:
    conversion, generation): no DDP wrapper, hence no fp32 gradient buffers."""
    config = transformer_config(cfg, plan, backend)
    if not initialize:
        # Not perform_initialization=False: Megatron-Core 0.16 marks a weight tensor-parallel
        # only while initialising it, and unmarked TP shards count as replicas in the grad norm.
        for name in ("init_method", "output_layer_init_method", "embedding_init_method"):
            if hasattr(config, name):
                setattr(config, name, torch.nn.init.zeros_)
    kernels = worker_kernels(cfg, backend)
    te = kernels.attention == "te"
    if te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        # MoE: TE's grouped GEMM for the experts (one kernel for all local experts), unless
        # LoRA adapts them (megatron_settings.moe_settings)
        layer_spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=bool(config.moe_grouped_gemm),
            qk_layernorm=config.qk_layernorm)
    else:
        layer_spec = None  # per chunk: local_block_spec

    chunks = []
    num_chunks = plan.virtual_pipeline_model_parallel_size or 1
    for vp_stage in range(num_chunks):
        stage = vp_stage if plan.virtual_pipeline_model_parallel_size else None
        model = _gpt_class(cfg, kernels)(
            config=config,
            transformer_layer_spec=layer_spec or local_block_spec(config, stage, kernels),
            vocab_size=plan.padded_vocab_size,
            max_sequence_length=cfg.model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
            position_embedding_type="mrope" if cfg.model.mrope_section else "rope",
            rotary_base=cfg.model.rotary_base,
            rope_scaling=cfg.model.rope_scaling,
            rope_scaling_factor=cfg.model.rope_scaling_factor,
            vp_stage=stage,
            # a vision-language model writes the images into the embeddings, then scatters
            scatter_embedding_sequence_parallel=not cfg.vision.enabled,
        )
        if model.post_process and plan.padded_vocab_size > cfg.model.vocab_size:
            mask_padded_vocab(model.output_layer, cfg.model.vocab_size)
        if cfg.lora.enabled:  # adapters on the frozen base, before DDP sees what trains
            from ray_ppu.model.lora import attach, keep_gradients_through_recompute

            attach(model, cfg.lora, cfg.model.is_moe,
                   tied=not cfg.model.untie_embeddings_and_output_weights,
                   seed=cfg.training.seed, sequence_parallel=plan.sequence_parallel,
                   dtype=config.params_dtype)
            if config.recompute_granularity == "full" and model.pre_process:
                keep_gradients_through_recompute(model)
        if cfg.vision.enabled:  # the ViT and projector join the first stage's chunk
            from ray_ppu.model import vision_language

            model = vision_language.build(cfg, model, _settings(cfg, plan, backend), kernels,
                                          use_cpu_initialization=backend == "cpu")
        if backend == "ppu":
            model.cuda(torch.cuda.current_device())
        if config.fp16 or config.bf16:
            # as Megatron-LM's get_model: every parameter in 16 bits (the local spec's norms
            # too) and fp32 logits out of the last stage
            model = Float16Module(config, model)
        chunks.append(model)

    if not ddp:
        return chunks, config
    ddp_config = DistributedDataParallelConfig(**ddp_settings(cfg))
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
