"""Hugging Face tensor names and layouts ↔ Megatron-Core GPTModel checkpoint keys.

Every Megatron tensor is described by its rows (dim 0) as a list of :class:`Piece`: row ranges
of Hugging Face tensors, in order; the other dims are the same on both sides. Loading reads
the pieces a rank's region overlaps into the parameter; exporting cuts a whole tensor back
into its pieces. The
layouts (h = hidden, d = head dim, G = query groups, Q = query heads per group, f = ffn, V =
vocabulary, V' = V padded for TP):

* ``linear_qkv.weight`` [G·(Q+2)·d, h] is grouped: for each group g, its Q query heads, then
  its key head, then its value head (Megatron's GQA layout: a TP rank owns whole groups).
  ``linear_qkv.bias`` likewise (Qwen2).
* ``linear_fc1.weight`` [2f, h] is gate_proj then up_proj (SwiGLU; Megatron re-cuts it per TP
  rank itself: each rank holds its share of both halves).
* ``word_embeddings`` / ``output_layer`` [V', h]: the V rows of HF, then V' − V padding rows,
  zeros on load (:func:`ray_ppu.model.gpt.mask_padded_vocab` keeps them out of the softmax) and
  dropped on export. A tied output layer reads ``embed_tokens``.
* The two RMSNorm weights are stored under the names Transformer Engine's fused layers give
  them (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), whatever the spec.
* Qwen3's per-head norms ``self_attn.q_norm`` / ``k_norm`` [d] are Megatron's
  ``self_attention.q_layernorm`` / ``k_layernorm`` (both specs name them so): one weight shared
  by every head, so each TP rank holds all of it, as it holds the other norms.
* Qwen3-MoE layers (E experts of width F', published one tensor per expert): the router
  ``mlp.gate`` [E, h] is ``mlp.router.weight``, replicated; the experts are stored with a
  second leading axis, the global expert index (an EP rank holds a contiguous block of them):
  ``mlp.experts.experts.linear_fc1.weight`` [E, 2F', h] is expert e's gate_proj then up_proj,
  ``linear_fc2`` [E, h, F'] its down_proj. A MoE layer's pre-MLP norm is not fused into fc1
  (Transformer Engine's MoE layer keeps it apart): ``pre_mlp_layernorm.weight``, on both specs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from ray_ppu.util.wrappers import unwrap
from ray_ppu.config.lora import is_adapter_key
from ray_ppu.config.schema import ModelConfig
from ray_ppu.hf.files import Checkpoint

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
_LAYER = "decoder.layers."
QKV = _LAYER + "self_attention.linear_qkv.weight"
QKV_BIAS = _LAYER + "self_attention.linear_qkv.bias"
QKV_NORM = _LAYER + "self_attention.linear_qkv.layer_norm_weight"
PROJ = _LAYER + "self_attention.linear_proj.weight"
FC1_NORM = _LAYER + "mlp.linear_fc1.layer_norm_weight"
FC1 = _LAYER + "mlp.linear_fc1.weight"
FC2 = _LAYER + "mlp.linear_fc2.weight"
Q_NORM = _LAYER + "self_attention.q_layernorm.weight"
K_NORM = _LAYER + "self_attention.k_layernorm.weight"
MOE_NORM = _LAYER + "pre_mlp_layernorm.weight"
ROUTER = _LAYER + "mlp.router.weight"
EXPERT_FC1 = _LAYER + "mlp.experts.experts.linear_fc1.weight"
EXPERT_FC2 = _LAYER + "mlp.experts.experts.linear_fc2.weight"


@dataclass(frozen=True)
class Piece:
    """``rows`` rows of HF tensor ``name`` from row ``start`` (``name`` None: padding rows)."""

    name: Optional[str]
    start: int
    rows: int


def layer_keys(model: ModelConfig) -> list[str]:
    """The per-layer Megatron keys (stored with a leading layer axis)."""
    attention = [QKV_NORM, QKV] + ([QKV_BIAS] if model.add_qkv_bias else [])
    attention += [Q_NORM, K_NORM] if model.qk_layernorm else []
    if model.is_moe:
        return attention + [PROJ, MOE_NORM, ROUTER]
    return attention + [PROJ, FC1_NORM, FC1, FC2]


def expert_keys(model: ModelConfig) -> list[str]:
    """The per-expert Megatron keys (stored with a leading layer axis and an expert axis)."""
    return [EXPERT_FC1, EXPERT_FC2] if model.is_moe else []


def global_keys(model: ModelConfig) -> list[str]:
    """The Megatron keys outside the layers."""
    return [EMBEDDING, FINAL_NORM] + ([OUTPUT] if model.untie_embeddings_and_output_weights else [])


def pieces(model: ModelConfig, padded_vocab: int, key: str, layer: Optional[int],
           expert: Optional[int] = None) -> list[Piece]:
    """The rows of Megatron tensor ``key`` (of ``layer`` for per-layer keys, and of ``expert``
    for per-expert ones) as HF pieces."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.effective_kv_channels
    per_group = model.num_attention_heads // model.num_query_groups
    hf = f"model.layers.{layer}."
    if key in (EXPERT_FC1, EXPERT_FC2):
        e, width = f"{hf}mlp.experts.{expert}.", model.effective_moe_ffn_hidden_size
        if key == EXPERT_FC1:
            return [Piece(e + "gate_proj.weight", 0, width), Piece(e + "up_proj.weight", 0, width)]
        return [Piece(e + "down_proj.weight", 0, h)]
    if key in (QKV, QKV_BIAS):
        kind = "weight" if key == QKV else "bias"
        out = []
        for g in range(model.num_query_groups):
            out += [Piece(f"{hf}self_attn.q_proj.{kind}", g * per_group * d, per_group * d),
                    Piece(f"{hf}self_attn.k_proj.{kind}", g * d, d),
                    Piece(f"{hf}self_attn.v_proj.{kind}", g * d, d)]
        return out
    if key == FC1:
        return [Piece(f"{hf}mlp.gate_proj.weight", 0, f), Piece(f"{hf}mlp.up_proj.weight", 0, f)]
    if key in (EMBEDDING, OUTPUT):
        tied = key == EMBEDDING or not model.untie_embeddings_and_output_weights
        name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        v = model.vocab_size
        padding = [Piece(None, 0, padded_vocab - v)] if padded_vocab > v else []
        return [Piece(name, 0, v), *padding]
    single = {QKV_NORM: (f"{hf}input_layernorm.weight", h),
              PROJ: (f"{hf}self_attn.o_proj.weight", h),
              FC1_NORM: (f"{hf}post_attention_layernorm.weight", h),
              FC2: (f"{hf}mlp.down_proj.weight", h),
              Q_NORM: (f"{hf}self_attn.q_norm.weight", d),
              K_NORM: (f"{hf}self_attn.k_norm.weight", d),
              MOE_NORM: (f"{hf}post_attention_layernorm.weight", h),
              ROUTER: (f"{hf}mlp.gate.weight", model.num_moe_experts or 0),
              FINAL_NORM: ("model.norm.weight", h)}
    if key not in single:
        raise KeyError(f"no Hugging Face counterpart for Megatron tensor {key}")
    name, rows = single[key]
    return [Piece(name, 0, rows)]


def hf_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of ``model`` holds, with its shape."""
    h, d = model.hidden_size, model.effective_kv_channels
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    shapes = {"model.embed_tokens.weight": (model.vocab_size, h), "model.norm.weight": (h,)}
    if model.untie_embeddings_and_output_weights:
        shapes["lm_head.weight"] = (model.vocab_size, h)
    for layer in range(model.num_layers):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
        })
        shapes.update(_mlp_shapes(model, p))
        if model.add_qkv_bias:
            for proj, size in (("q", q), ("k", kv), ("v", kv)):
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (size,)
        if model.qk_layernorm:
            for norm in ("q_norm", "k_norm"):
                shapes[f"{p}self_attn.{norm}.weight"] = (d,)
    return shapes


def _mlp_shapes(model: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A layer's MLP tensors (``p``: its name prefix): SwiGLU's three, or a MoE layer's router
    and each expert's three."""
    h = model.hidden_size
    if not model.is_moe:
        f = model.ffn_hidden_size
        return {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f)}
    f = model.effective_moe_ffn_hidden_size
    shapes = {p + "mlp.gate.weight": (model.num_moe_experts, h)}
    for e in range(model.num_moe_experts):
        shapes.update({f"{p}mlp.experts.{e}.gate_proj.weight": (f, h),
                       f"{p}mlp.experts.{e}.up_proj.weight": (f, h),
                       f"{p}mlp.experts.{e}.down_proj.weight": (h, f)})
    return shapes


def fill_region(ckpt: Checkpoint, model: ModelConfig, padded_vocab: int, key: str,
                layer: Optional[int], offset: tuple[int, ...], out: torch.Tensor,
                expert: Optional[int] = None) -> None:
    """Fill ``out`` with rows ``offset[0] : offset[0] + len(out)`` (and likewise columns) of
    Megatron tensor ``key``, read from only the HF slices they overlap; padding rows are 0."""
    fill_pieces(ckpt, key, pieces(model, padded_vocab, key, layer, expert), offset, out)


def fill_pieces(ckpt: Checkpoint, key: str, hf_pieces: list[Piece], offset: tuple[int, ...],
                out: torch.Tensor) -> None:
    """:func:`fill_region` for a tensor laid out as ``hf_pieces``."""
    first, last = offset[0], offset[0] + out.shape[0]
    cols = slice(offset[1], offset[1] + out.shape[1]) if out.dim() > 1 else None
    at = 0
    for piece in hf_pieces:
        lo, hi = max(first, at), min(last, at + piece.rows)
        if lo < hi:
            part = out[lo - first:hi - first]
            if piece.name is None:
                part.zero_()
            else:
                rows = slice(piece.start + lo - at, piece.start + hi - at)
                ckpt.read_into(piece.name, part, rows, cols)
        at += piece.rows
    if at < last:
        raise ValueError(f"{key}: rows up to {last} asked, the tensor has {at}")


def to_hf(model: ModelConfig, padded_vocab: int, key: str, layer: Optional[int],
          tensor: torch.Tensor, expert: Optional[int] = None) -> list[tuple[str, torch.Tensor]]:
    """A whole Megatron tensor cut back into its Hugging Face tensors (padding dropped; a tied
    output layer is not exported: HF ties it to ``embed_tokens``)."""
    if key == OUTPUT and not model.untie_embeddings_and_output_weights:
        return []
    return cut(key, tensor, pieces(model, padded_vocab, key, layer, expert))


def cut(key: str, tensor: torch.Tensor, hf_pieces: list[Piece]) -> list[tuple[str, torch.Tensor]]:
    """Megatron tensor ``key`` cut into the Hugging Face tensors its rows are (``hf_pieces``
    in row order; padding rows dropped)."""
    grouped: dict[str, list[tuple[int, torch.Tensor]]] = {}
    at = 0
    for piece in hf_pieces:
        if piece.name is not None:
            grouped.setdefault(piece.name, []).append((piece.start, tensor[at:at + piece.rows]))
        at += piece.rows
    if at != tensor.shape[0]:
        raise ValueError(f"{key}: {tensor.shape[0]} rows, the model config implies {at}")
    return [(name, torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]))
            for name, parts in grouped.items()]


def _sharded_tensors(module) -> Iterator:
    """The ShardedTensors of a GPTModel chunk: views of its parameters (the SwiGLU fc1
    factory applied: one view per half)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = module.sharded_state_dict()
    apply_factories(state)
    for value in nested_values(state):
        if isinstance(value, ShardedTensor):
            yield value


@torch.no_grad()
def load_into(chunks: list, ckpt: Checkpoint, model: ModelConfig, padded_vocab: int,
              fill: Optional[Callable] = None) -> dict:
    """Fill this rank's model chunks (any TP / PP / VP, any spec, inside DDP or Float16Module)
    from a Hugging Face checkpoint, reading only the regions they hold.

    1. For every chunk, its sharded state dict says which region of which Megatron tensor each
       parameter (half, for fc1) holds; the layer is the global one (PP / VP offsets included).
    2. Each region is read from the HF slices it overlaps, into the parameter itself (through
       bounded blocks where it must be cast, moved to the device or cut into columns).
    3. Every parameter element must have been written: else an error names the gap.

    ``fill(key, layer, offset, out, expert)`` reads one region in place of
    :func:`fill_region` from ``ckpt`` (a vision-language model's parts come from several
    places); it returns False for a tensor it leaves as built (a fresh projector).
    Returns {"bytes_read", "seconds"} for this rank.
    """
    start = time.perf_counter()
    if fill is None:
        def fill(key, layer, offset, out, expert):
            fill_region(ckpt, model, padded_vocab, key, layer, offset, out, expert)
            return True
    for chunk in chunks:
        module = unwrap(chunk)
        filled = kept = 0
        for sh in _sharded_tensors(module):
            if is_adapter_key(sh.key):  # LoRA's: drawn, or read from a PEFT adapter
                continue
            # leading axes: the layer, and for experts the global expert index
            prepend = sh.prepend_axis_num
            layer = sh.global_offset[0] if prepend else None
            expert = sh.global_offset[1] if prepend > 1 else None
            if tuple(sh.data.shape) != tuple(sh.local_shape):
                raise ValueError(f"{sh.key} (layer {layer}): the parameter holds "
                                 f"{list(sh.data.shape)}, its shard says {list(sh.local_shape)}")
            if fill(sh.key, layer, tuple(sh.global_offset[prepend:]), sh.data, expert):
                filled += sh.data.numel()
            else:
                kept += sh.data.numel()
        total = sum(p.numel() for name, p in module.named_parameters()
                    if not is_adapter_key(name)) - kept
        if filled != total:
            raise RuntimeError(f"loaded {filled} of the {total} parameter elements of a model "
                               f"chunk: its sharded state dict does not cover every parameter")
    return {"bytes_read": ckpt.bytes_read, "seconds": time.perf_counter() - start}


def check_checkpoint(directory: str, model: ModelConfig) -> None:
    """Before any worker starts: the directory holds every tensor ``model`` needs, with its
    shape (safetensors headers only); a ConfigError names each missing or misshapen one."""
    Checkpoint(directory).check(hf_shapes(model))


def load_pretrained(chunks: list, directory: str, model: ModelConfig, padded_vocab: int) -> dict:
    """:func:`load_into` from the Hugging Face directory ``directory``, after the header check
    (what a run checks on the driver; conversion and generation get it here)."""
    with Checkpoint(directory) as ckpt:
        ckpt.check(hf_shapes(model))
        return load_into(chunks, ckpt, model, padded_vocab)
