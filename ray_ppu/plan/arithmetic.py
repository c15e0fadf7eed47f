"""Counting a model: parameters per pipeline stage and device, and Megatron-LM's FLOPs per
iteration (what MFU divides by). Config only: ``--dry-run`` prints these on a laptop, and the
memory plan builds on :func:`stage_parameters`."""

from __future__ import annotations

from ray_ppu.config.schema import RunConfig


def flops_per_iteration(cfg: RunConfig, padded_vocab_size: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` for a dense GQA model with SwiGLU.

    q and k are the query and key/value projection widths (kv_channels × heads, × groups),
    which Qwen3 sets apart from the hidden size; norms (Qwen3's q / k norms too) count no FLOPs
    there, as in Megatron-LM.

    Forward + backward = 3 × forward, 2 FLOPs per multiply-add, hence the 6s. Core attention
    counts QKᵀ and AV, halved for the causal mask: 6·s²·q per layer and sample.
    """
    m, t = cfg.model, cfg.training
    h, L, s, B = m.hidden_size, m.num_layers, t.seq_length, t.global_batch_size
    q = m.effective_kv_channels * m.num_attention_heads
    k = m.effective_kv_channels * m.num_query_groups
    f = m.ffn_hidden_size
    per_layer = 6 * h * (q + 2 * k) + 6 * q * h + 6 * h * f * 3  # QKV, proj, SwiGLU (3 mats)
    return B * s * (L * per_layer + 6 * h * padded_vocab_size) + B * s * s * attention_flops_coefficient(cfg)


def attention_flops_coefficient(cfg: RunConfig) -> float:
    """Core attention FLOPs per sample ÷ its length²: 6·L·q (QKᵀ and AV, halved by the causal
    mask, times 3 for forward + backward)."""
    m = cfg.model
    return 6.0 * m.num_layers * m.effective_kv_channels * m.num_attention_heads


def stage_parameters(cfg: RunConfig, tp: int, pp: int, padded_vocab: int) -> tuple[int, int, int]:
    """Total parameters, and those one device of the first and of the last pipeline stage
    holds (TP splits the matrices, PP the layers; with PP 1 both are the one stage)."""
    m = cfg.model
    h, f = m.hidden_size, m.ffn_hidden_size
    q = m.effective_kv_channels * m.num_attention_heads
    k = m.effective_kv_channels * m.num_query_groups
    qkv_bias = (q + 2 * k) if m.add_qkv_bias else 0
    layer_split = h * (q + 2 * k) + qkv_bias + q * h + 3 * h * f  # divided by TP
    # the two RMSNorms, and Qwen3's q / k norms (one kv_channels weight each, on every TP rank)
    layer_replicated = 2 * h + (2 * m.effective_kv_channels if m.qk_layernorm else 0)
    embedding = padded_vocab * h
    output = embedding if m.untie_embeddings_and_output_weights else 0
    total = m.num_layers * (layer_split + layer_replicated) + embedding + output + h
    stage = (m.num_layers // pp) * (layer_split // tp + layer_replicated)
    if pp == 1:
        only = stage + embedding // tp + h + output // tp
        return total, only, only
    first = stage + embedding // tp
    # The last stage holds the final norm and the output layer; with tied embeddings and PP > 1
    # Megatron keeps a copy of the embedding there too.
    last = stage + h + embedding // tp
    return total, first, last
