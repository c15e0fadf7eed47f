"""Core attention in torch's own kernels: the ``sdpa`` attention backend.

Megatron-Core 0.16's local layer spec (what runs wherever Transformer Engine does not: the CPU,
a GPU or PPU image without a TE build) computes attention the textbook way: K and V copied to
every query head, the s × s scores materialised in fp32, an unfused masked softmax, and for
packed rows an explicit s × s block-diagonal mask. On an H200 that made a 0.5B model run at
9 % MFU; on the CPU one layer of it took 876 ms against SDPA's 241 ms (DESIGN.md §8).

:class:`TorchAttention` is a ``core_attention`` submodule with Megatron-Core's contract
(``query [sq, b, np, hn]``, ``key`` / ``value`` ``[sk, b, ng, hn]`` in, ``[sq, b, np·hn]``
out; THD packed rows ``[t, heads, hn]`` with ``packed_seq_params``), so the layer spec swaps
it in for ``DotProductAttention`` and nothing else changes:

* unpacked rows: ``F.scaled_dot_product_attention`` with ``is_causal`` (no mask tensor) and
  ``enable_gqa`` (K/V not copied per head); torch picks flash / cuDNN / memory-efficient on
  a device and its fused kernel on the CPU. An explicit mask (Megatron: True = masked out) is
  honoured when one is passed.
* packed rows (:func:`packed_attention`): the sample boundaries go to a kernel that takes
  them: torch's varlen flash attention on a CUDA-compatible device in 16-bit, else one SDPA
  call per sample. Never an s × s mask. The Qwen2.5-VL tower's window attention uses the
  same function (windows are "samples" attending both ways).

Context parallelism stays Transformer Engine's (the plan says so before any worker starts).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ray_ppu import devices

# masks that mean "a query sees itself and the keys before it"
_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)


@functools.lru_cache(maxsize=1)
def _varlen():
    """torch's varlen flash attention and its keyword parameters, or None (torch < 2.9)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


_VARLEN_REFUSED: list[str] = []  # the device's varlen kernel failed once: why


def packed_kernel(query: torch.Tensor) -> str:
    """Which kernel :func:`packed_attention` runs for ``query``: ``varlen`` (flash, 16-bit on
    a CUDA-compatible device) or ``per_sample`` (SDPA once per sample: the CPU, fp32, or a
    device whose varlen kernel refused to run, said once in the log)."""
    if (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and _varlen()
            and not _VARLEN_REFUSED):
        return "varlen"
    return "per_sample"


def _varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal: bool, scale: float):
    varlen_attn, params = _varlen()
    kwargs = {}
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, q.shape[-1] ** -0.5):
        q = q * (scale * q.shape[-1] ** 0.5)  # the kernel's own scale is 1/√hn
    if "window_size" in params:  # torch ≥ 2.11: a causal window is (-1, 0)
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:  # torch 2.9 / 2.10
        kwargs["is_causal"] = causal
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # query head j reads K/V group j // (heads / groups), Megatron's GQA layout
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return varlen_attn(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), **kwargs)


def _per_sample_attention(q, k, v, cu_seqlens, causal: bool, scale: float, dropout: float):
    bounds = cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    if sum(lengths) != q.shape[0]:
        raise ValueError(f"packed rows: the sample boundaries cover {sum(lengths)} tokens, "
                         f"the microbatch has {q.shape[0]}")
    outputs = []
    for qs, ks, vs in zip(*(t.split(lengths) for t in (q, k, v))):
        # [len, heads, hn] -> [1, heads, len, hn]
        out = F.scaled_dot_product_attention(
            qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
            dropout_p=dropout, is_causal=causal, scale=scale,
            enable_gqa=ks.shape[1] != qs.shape[1])
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cu_seqlens: torch.Tensor, max_seqlen: int, causal: bool,
                     scale: Optional[float] = None, dropout: float = 0.0) -> torch.Tensor:
    """Attention within each sample of a packed sequence: ``query [t, heads, hn]``, ``key`` /
    ``value [t, groups, hn]``, ``cu_seqlens [n + 1]`` the samples' boundaries (0 … t);
    ``[t, heads, hn]`` out. A token never sees another sample's tokens."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if packed_kernel(query) == "varlen" and dropout == 0.0:
        try:
            return _varlen_attention(query, key, value, cu_seqlens, max_seqlen, causal, scale)
        except RuntimeError as error:  # a build without the kernel for this device or shape
            import logging

            if devices.kernel_failure_is_fatal(error):
                raise

            _VARLEN_REFUSED.append(str(error).splitlines()[0])
            logging.getLogger(__name__).warning(
                "torch's varlen attention refused to run (%s): packed rows take one SDPA "
                "call per sample from now on", _VARLEN_REFUSED[0])
    return _per_sample_attention(query, key, value, cu_seqlens, causal, scale, dropout)


def _bottom_right_causal(sq: int, sk: int, device) -> torch.Tensor:
    """Keep-mask for causal attention of the last ``sq`` of ``sk`` positions (SDPA's is_causal
    aligns the square top-left, which is wrong when a query block follows cached keys)."""
    rows = torch.arange(sq, device=device)[:, None] + (sk - sq)
    return torch.arange(sk, device=device)[None, :] <= rows


class TorchAttention(MegatronModule):
    """Megatron-Core's ``core_attention`` contract on torch's SDPA and varlen kernels (module
    docstring). The arguments are ``DotProductAttention``'s."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError("the sdpa attention backend has no context parallelism "
                             "(CP > 1 needs Transformer Engine)")
        self.attn_mask_type = attn_mask_type
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if softmax_scale is None:
            softmax_scale = getattr(config, "softmax_scale", None)
        # apply_query_key_layer_scaling divides by the layer number before an fp16 softmax and
        # multiplies back inside it: the same scores; SDPA's softmax accumulates in fp32 anyway
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5

    def _dropout(self) -> float:
        return self.dropout if self.training else 0.0

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("the sdpa attention backend takes no attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in _CAUSAL
        # Megatron forks the TP RNG tracker around attention dropout (each TP rank drops its
        # own heads); without dropout the fork changes nothing
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if self._dropout() else None
        with rng or contextlib.nullcontext(), torch.profiler.record_function("core_attention"):
            if packed_seq_params is not None:
                out = packed_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                       packed_seq_params.max_seqlen_q, causal, self.scale,
                                       self._dropout())
                return out.reshape(out.shape[0], -1)  # [t, heads·hn]
            return self._sdpa(query, key, value, attention_mask, causal)

    def _sdpa(self, query, key, value, attention_mask, causal: bool) -> torch.Tensor:
        sq, b, heads, hn = query.shape
        sk = key.shape[0]
        # [s, b, h, d] -> [b, h, s, d]: views (the flash kernels read this layout's strides)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = None
        if attention_mask is not None:  # Megatron: True = masked out; SDPA: True = attends
            mask = ~attention_mask
        elif causal and sq != sk:
            mask = _bottom_right_causal(sq, sk, query.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self._dropout(),
            is_causal=causal and mask is None, scale=self.scale, enable_gqa=k.shape[1] != heads)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

