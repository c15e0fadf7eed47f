"""Qwen2.5-VL's vision tower: Hugging Face's module inside Megatron-Core's ``HuggingFaceModule``.

Why not Megatron-Core layers, as the LLaVA towers are: Qwen2.5-VL's ViT is the same ~0.67 B
parameters at every size (3B, 7B, 72B: 32 layers of width 1280), and what sets it apart from
a CLIP ViT is all in its glue: images of any size batched as one sequence of patches, window
attention over 112-pixel windows with the patches permuted window by window (four layers
attend over the whole image), 2-D rotary positions, and the 2 × 2 patch merger. Rebuilt from
Megatron-Core layers, each piece would be ours to keep equal to transformers; wrapped, the
tower *is* transformers' (bit-exact by construction, its weights under their own names). The
cost is that it is replicated over TP instead of split: every TP rank of the first stage
runs the whole tower. By the plan's arithmetic (``benchmark.py vl``; issue note) the tower is a
small part of a 7B step, so replication costs little of the step at TP 2 and is paid in
memory (~1.3 GB of bf16 weights per rank, plus its activations).

The tower's attention is the one piece replaced (:class:`PackedWindowAttention`, same
``qkv`` / ``proj`` weights under the same names): transformers runs its window attention one
window at a time (``attn_implementation="sdpa"``: ~25 windows of 64 patches per image, 28
layers; tens of thousands of small kernels per step on an H200, where the Qwen2.5-VL LoRA
slice ran at 7.5 % MFU), and its flash-attention path needs the flash-attn package. Ours
hands every window's boundaries to :func:`ray_ppu.model.attention.packed_attention` at once
(torch's varlen flash attention on a device).

``HuggingFaceModule`` marks every parameter ``average_gradients_across_tp_domain``: Megatron's
``finalize_model_grads`` averages their gradients over TP, so the replicas stay equal. Its
default ``sharded_state_dict`` saves them as replicated tensors under ``vision_model.visual.…``,
which is how checkpoints and resumes see them.
"""

from __future__ import annotations

import torch
from megatron.core.models.huggingface.module import HuggingFaceModule
from megatron.core.transformer import TransformerConfig

from ray_ppu.config.vision import VisionConfig
from ray_ppu.hf.qwen_vl import hf_vision_config

MERGER = "visual.merger."  # the projector: its parameters' prefix inside the tower


class PackedWindowAttention(torch.nn.Module):
    """A Qwen2.5-VL vision block's attention (``attn``) with every window (or image, in the
    full-attention layers) attended in one :func:`~ray_ppu.model.attention.packed_attention`
    call; it takes over the block's own ``qkv`` and ``proj`` linears and computes what
    transformers' module computes (q / k / v, 2-D rotary positions, attention, projection)."""

    def __init__(self, hf_attention: torch.nn.Module) -> None:
        super().__init__()
        self.qkv, self.proj = hf_attention.qkv, hf_attention.proj
        self.num_heads = hf_attention.num_heads
        head_dim = self.qkv.out_features // 3 // self.num_heads
        self.scaling = getattr(hf_attention, "scaling", None) or head_dim ** -0.5

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                position_embeddings=None, max_seqlen=None, **_) -> torch.Tensor:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            apply_rotary_pos_emb_vision,
        )

        from ray_ppu.model.attention import packed_attention

        length = hidden_states.shape[0]
        q, k, v = (self.qkv(hidden_states).reshape(length, 3, self.num_heads, -1)
                   .permute(1, 0, 2, 3).unbind(0))  # [patches, heads, head_dim] each
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
        if not isinstance(max_seqlen, int):
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        out = packed_attention(q, k, v, cu_seqlens, max_seqlen, causal=False,
                               scale=self.scaling)
        return self.proj(out.reshape(length, -1))


class QwenVisionTower(HuggingFaceModule):
    """Patches [N, 3·t·p·p] and their grids [n_images, 3] → merged image tokens
    [Σ t·h·w / merge², language hidden], image after image (transformers' ``visual``).
    ``packed``: the blocks' attention is :class:`PackedWindowAttention` (else transformers'
    own, window by window)."""

    def __init__(self, config: TransformerConfig, vision: VisionConfig,
                 out_hidden_size: int, packed: bool = True) -> None:
        super().__init__(config)
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
            Qwen2_5_VLVisionConfig,
        )
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        hf = Qwen2_5_VLVisionConfig(**hf_vision_config(vision, out_hidden_size))
        # sdpa per window (flash-attention 2 is not a dependency); the same numbers as eager
        hf._attn_implementation = "sdpa"
        self.visual = Qwen2_5_VisionTransformerPretrainedModel(hf).to(config.params_dtype)
        if packed:
            for block in self.visual.blocks:
                block.attn = PackedWindowAttention(block.attn)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        dtype = self.visual.patch_embed.proj.weight.dtype
        out = self.visual(pixel_values.to(dtype), grid_thw=grid_thw)
        # transformers ≥ 5.2x: the merged tokens are the pooler output; earlier: the output
        return out.pooler_output if hasattr(out, "pooler_output") else out

    def merger_parameters(self) -> list[torch.nn.Parameter]:
        """The patch merger's (the "projector" of ``vision.freeze``)."""
        return list(self.visual.merger.parameters())

    def encoder_parameters(self) -> list[torch.nn.Parameter]:
        """Everything but the merger (the "vision" of ``vision.freeze``)."""
        merger = {id(p) for p in self.merger_parameters()}
        return [p for p in self.visual.parameters() if id(p) not in merger]


@torch.no_grad()
def broadcast_over_tensor_parallel(module: torch.nn.Module) -> None:
    """Make every TP rank's replica equal to TP rank 0's (a fresh tower is drawn from each
    rank's generator; loaded weights overwrite it anyway)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    source = parallel_state.get_tensor_model_parallel_src_rank()
    for tensor in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(tensor.data, source, group=group)
