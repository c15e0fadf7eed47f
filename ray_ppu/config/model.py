"""The model section of the run configuration: the architecture, in Megatron-Core's words.

Its own module because everything that counts or maps a model (presets, the plan's
arithmetic, the Hugging Face mapping) needs this section and nothing else of the run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only GPT (Qwen2.5 / Qwen3 / Qwen3-MoE / LLaMA-3.1 family)."""

    preset: Optional[str] = None
    """Preset (ray_ppu.config.presets) the other fields started from; explicit keys override it."""
    num_layers: int = 2
    """Transformer layers (HF: num_hidden_layers). [≥ 1]"""
    hidden_size: int = 64
    """Width of the residual stream (HF: hidden_size). [≥ 1]"""
    ffn_hidden_size: int = 176
    """Width of the SwiGLU MLP (HF: intermediate_size). [≥ 1]"""
    num_attention_heads: int = 4
    """Query heads (HF: num_attention_heads). [≥ 1]"""
    num_query_groups: int = 2
    """Key/value heads for grouped-query attention (HF: num_key_value_heads). [≥ 1]"""
    kv_channels: Optional[int] = None
    """Width of each query, key and value head (HF: head_dim); None = hidden_size /
    num_attention_heads (Qwen2.5, LLaMA-3.1). Qwen3 sets 128 at every size, which is not
    hidden / heads for 0.6B, 4B and 32B. [≥ 2]"""
    vocab_size: int = 151_936
    """Embedding rows of the published checkpoint, before padding for tensor parallelism. [≥ 1]"""
    max_position_embeddings: int = 32_768
    """Longest sequence the RoPE tables are built for; seq_length may not exceed it. [≥ 1]"""
    rotary_base: int = 1_000_000
    """RoPE base (HF: rope_theta). [> 0]"""
    rope_scaling: bool = False
    """Apply LLaMA-3.1 ("llama3") RoPE frequency scaling."""
    rope_scaling_factor: float = 8.0
    """Scaling factor for rope_scaling (LLaMA-3.1: 8). [> 0]"""
    mrope_section: Optional[list[int]] = None
    """Multimodal RoPE (Qwen2.5-VL; HF rope_parameters / rope_scaling ``mrope_section``): how
    many of each head's rotary frequency pairs turn with the temporal, height and width
    position of a token (text tokens have all three equal, so this is plain RoPE for text);
    they sum to kv_channels / 2 (Qwen2.5-VL: [16, 24, 24] of 64). None = RoPE."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon (HF: rms_norm_eps). [> 0]"""
    add_qkv_bias: bool = True
    """Bias on the Q, K and V projections only (Qwen2: true; LLaMA, Qwen3: false)."""
    qk_layernorm: bool = False
    """RMSNorm over each query and key head before RoPE, one weight of kv_channels shared by
    the heads (HF: Qwen3's q_norm / k_norm)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output layer instead of reusing the input embedding (HF: not tie_word_embeddings)."""
    init_method_std: float = 0.008
    """Std of the normal weight initialisation (reference script: 0.008). [≥ 0]"""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP (the reference trains with 0)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (the reference trains with 0)."""
    num_moe_experts: Optional[int] = None
    """Mixture of experts: routed experts in every layer's MLP (HF Qwen3-MoE: num_experts);
    None = a dense SwiGLU MLP of ffn_hidden_size. Every layer is a MoE layer, as in every
    published Qwen3-MoE checkpoint (decoder_sparse_step 1, no mlp_only_layers). [≥ 1]"""
    moe_router_topk: int = 2
    """Experts each token is routed to (HF: num_experts_per_tok). [≥ 1]"""
    moe_ffn_hidden_size: Optional[int] = None
    """Width of each expert's SwiGLU MLP (HF: moe_intermediate_size); None = ffn_hidden_size. [≥ 1]"""
    moe_norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to 1 (HF: norm_topk_prob; Qwen3-MoE:
    true). Either way the softmax is over all experts' logits, as HF computes it: true is
    Megatron-Core's softmax over the top-k logits, false its moe_router_pre_softmax."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss added to the LM loss (HF: router_aux_loss_coef;
    Qwen3-MoE: 0.001). Megatron-Core computes it per MoE layer (``aux_loss`` balancing). [≥ 0]"""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this × TP, as Megatron does. [≥ 1]"""

    def with_(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def effective_kv_channels(self) -> int:
        """Per-head width the model is built with: kv_channels, else hidden_size /
        num_attention_heads (what Megatron-Core derives when it is not given)."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Vocabulary padded so every TP rank holds an equal, aligned slice (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    @property
    def is_moe(self) -> bool:
        """A mixture-of-experts model (num_moe_experts set)."""
        return self.num_moe_experts is not None

    @property
    def effective_moe_ffn_hidden_size(self) -> int:
        """Each expert's MLP width: moe_ffn_hidden_size, else ffn_hidden_size (Megatron-Core's
        fallback)."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_hidden_size
