"""Counting a model: parameters per pipeline stage and device (all, and a MoE model's active
ones), and Megatron-LM's FLOPs per iteration (what MFU divides by). Config only: ``--dry-run`` prints these on a laptop, and the
memory plan builds on :func:`stage_parameters`."""

from __future__ import annotations

import dataclasses

from ray_ppu.config.schema import RunConfig
from ray_ppu.plan import lora, vision


def flops_per_iteration(cfg: RunConfig, padded_vocab_size: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` for a GQA model with SwiGLU, dense or MoE.

    q and k are the query and key/value projection widths (kv_channels × heads, × groups),
    which Qwen3 sets apart from the hidden size; norms (Qwen3's q / k norms too) count no FLOPs
    there, as in Megatron-LM. A MoE layer counts the top-k experts each token goes through,
    as Megatron-LM does, plus the router's h × experts gate, which Megatron-LM leaves out
    (Qwen3-30B-A3B: 128 of the 8 × 3 × 768 = 18 432 MLP columns a token meets, 0.7 %).

    Forward + backward = 3 × forward, 2 FLOPs per multiply-add, hence the 6s. Core attention
    counts QKᵀ and AV, halved for the causal mask: 6·s²·q per layer and sample. A LoRA run
    (frozen base: no weight-gradient GEMMs) counts what it computes instead:
    :func:`ray_ppu.plan.lora.flops_per_iteration`. A vision-language model adds its images
    (:func:`ray_ppu.plan.vision.flops_per_image`, one per sample in the plan; the training log
    counts the images its batches held); a frozen language model (Bunny's stage 1) computes
    no weight gradients: 4 FLOPs per multiply-add in its linears, not 6.
    """
    images = cfg.training.global_batch_size * vision.flops_per_image(cfg)
    if cfg.lora.enabled:
        return lora.flops_per_iteration(cfg, padded_vocab_size)[0] + images
    m, t = cfg.model, cfg.training
    h, L, s, B = m.hidden_size, m.num_layers, t.seq_length, t.global_batch_size
    q = m.effective_kv_channels * m.num_attention_heads
    k = m.effective_kv_channels * m.num_query_groups
    per_layer = h * (q + 2 * k) + q * h + _mlp_multiplies(m, active=True)
    linear = 4 if cfg.vision.enabled and "language" in cfg.vision.freeze else 6
    return (B * s * linear * (L * per_layer + h * padded_vocab_size)
            + B * s * s * attention_flops_coefficient(cfg) + images)


def _mlp_multiplies(m, active: bool) -> int:
    """Weights of one layer's MLP that a token multiplies with (``active``: only its top-k
    experts' and the router's) or that the layer holds: SwiGLU's 3 matrices per MLP."""
    if not m.is_moe:
        return 3 * m.hidden_size * m.ffn_hidden_size
    experts = m.moe_router_topk if active else m.num_moe_experts
    return experts * 3 * m.hidden_size * m.effective_moe_ffn_hidden_size + _router(m)


def _router(m) -> int:
    """The router's gate: one h-wide row per expert (replicated on every rank of its stage)."""
    return m.num_moe_experts * m.hidden_size if m.is_moe else 0


def attention_flops_coefficient(cfg: RunConfig) -> float:
    """Core attention FLOPs per sample ÷ its length²: 6·L·q (QKᵀ and AV, halved by the causal
    mask, times 3 for forward + backward; a LoRA run's layers without a gradient into their
    attention count forward only)."""
    if cfg.lora.enabled:
        return lora.flops_per_iteration(cfg, cfg.model.padded_vocab_size(1))[1]
    m = cfg.model
    return 6.0 * m.num_layers * m.effective_kv_channels * m.num_attention_heads


def _layer_counts(m) -> tuple[int, int, int]:
    """One layer's parameters: (split by TP, split by EP × ETP, on every rank of the stage)."""
    h = m.hidden_size
    q = m.effective_kv_channels * m.num_attention_heads
    k = m.effective_kv_channels * m.num_query_groups
    qkv_bias = (q + 2 * k) if m.add_qkv_bias else 0
    attention = h * (q + 2 * k) + qkv_bias + q * h
    # the two RMSNorms, Qwen3's q / k norms (one kv_channels weight each) and a MoE router
    replicated = 2 * h + (2 * m.effective_kv_channels if m.qk_layernorm else 0) + _router(m)
    if m.is_moe:
        return attention, _mlp_multiplies(m, active=False) - _router(m), replicated
    return attention + _mlp_multiplies(m, active=False), 0, replicated


def expert_parameters_per_device(cfg: RunConfig, pp: int, ep: int, etp: int) -> int:
    """A MoE model's expert weights on one device of a stage (EP × ETP split them); 0 dense.
    The distributed optimizer shards these over expert-DP, the rest over DP."""
    _, experts, _ = _layer_counts(cfg.model)
    return (cfg.model.num_layers // pp) * experts // (ep * etp)


def active_parameters(cfg: RunConfig, padded_vocab: int) -> int:
    """Parameters one token's forward pass multiplies with: the total, with each MoE layer's
    experts counted top-k times instead of num_moe_experts (Qwen3-30B-A3B: 3.3e9 of 30.5e9)."""
    m = cfg.model
    total, _, _ = stage_parameters(cfg, 1, 1, padded_vocab)
    if not m.is_moe:
        return total
    idle = m.num_moe_experts - m.moe_router_topk
    return total - m.num_layers * idle * 3 * m.hidden_size * m.effective_moe_ffn_hidden_size


def stage_parameters(cfg: RunConfig, tp: int, pp: int, padded_vocab: int, ep: int = 1,
                     etp: int = 1) -> tuple[int, int, int]:
    """Total parameters, and those one device of the first and of the last pipeline stage
    holds (TP splits the matrices, PP the layers, EP × ETP a MoE layer's experts; with PP 1
    both are the one stage)."""
    m = cfg.model
    h = m.hidden_size
    split, experts, replicated = _layer_counts(m)
    embedding = padded_vocab * h
    output = embedding if m.untie_embeddings_and_output_weights else 0
    total = m.num_layers * (split + experts + replicated) + embedding + output + h
    stage = (m.num_layers // pp) * (split // tp + experts // (ep * etp) + replicated)
    image = sum(vision.component_parameters(cfg).values())  # on the first stage
    total += image
    image = vision.per_device(cfg, image, tp)  # TP-split (LLaVA) or replicated (Qwen2.5-VL)
    if pp == 1:
        only = stage + embedding // tp + h + output // tp + image
        return total, only, only
    first = stage + embedding // tp + image
    # The last stage holds the final norm and the output layer; with tied embeddings and PP > 1
    # Megatron keeps a copy of the embedding there too.
    last = stage + h + embedding // tp
    return total, first, last


def trainable_stage_parameters(cfg: RunConfig, tp: int, pp: int, padded_vocab: int, ep: int = 1,
                               etp: int = 1) -> tuple[int, int, int]:
    """:func:`stage_parameters` of what trains: all of it, the adapters and named base parts
    under LoRA; a vision-language model's frozen components (vision.freeze) left out."""
    if cfg.lora.enabled:
        total, first, last = lora.trainable_parameters(cfg, tp, pp, padded_vocab, ep, etp)
        # LoRA's count is of the language model; the image side trains as vision.freeze says
        image = vision.trainable_parameters(cfg)
        share = vision.per_device(cfg, image, tp)
        return total + image, first + share, last + (share if pp == 1 else 0)
    total, first, last = stage_parameters(cfg, tp, pp, padded_vocab, ep, etp)
    frozen = sum(vision.component_parameters(cfg).values()) - vision.trainable_parameters(cfg)
    share = vision.per_device(cfg, frozen, tp)
    if "language" in cfg.vision.freeze and cfg.vision.enabled:
        language = stage_parameters(dataclasses.replace(cfg, vision=cfg.vision.with_(encoder=None)),
                                    tp, pp, padded_vocab, ep, etp)
        return (total - language[0] - frozen, first - language[1] - share,
                last - language[2] - (share if pp == 1 else 0))
    return total - frozen, first - share, last - (share if pp == 1 else 0)
