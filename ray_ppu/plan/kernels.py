"""Which kernels a run computes with: core attention, packed rows, the loss and the experts.

Decided in this one place from the config and from whether Transformer Engine (TE) imports on
the workers, so the model build, the memory plan, ``--dry-run`` and the launch summary agree.
Config only: no torch.

* **attention**: ``te`` (TE's layer spec and kernels, unchanged where TE imports and the run
  does not ask otherwise); ``sdpa`` (Megatron-Core's local layer spec with our torch core
  attention, :mod:`ray_ppu.model.attention`: ``scaled_dot_product_attention`` with no mask
  tensor, GQA without copying K/V); ``local`` (Megatron-Core's own reference attention: the
  s × s scores in fp32, an unfused softmax, K/V repeated per head).
* **packed**: how packed SFT rows keep their samples apart: ``thd`` (the microbatch flattened
  into one row with its sample boundaries, Megatron's PackedSeqParams: TE's fused attention,
  or torch's varlen flash attention / one SDPA call per sample) or ``mask`` (an explicit
  s × s block-diagonal mask, the only way Megatron-Core's local attention can).
* **loss**: ``chunked`` (:mod:`ray_ppu.model.output_loss`: the output layer and the
  vocabulary-parallel cross entropy a chunk of tokens at a time) or ``megatron``.
* **experts** (MoE): ``te_grouped`` (TE's grouped GEMM), ``grouped`` (torch's ``_grouped_mm``
  over the local experts, :mod:`ray_ppu.model.moe_layers`) or ``sequential`` (one expert after
  another: asked for, or LoRA adapts the experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ray_ppu.config.schema import RunConfig
from ray_ppu.plan.te_options import uses_transformer_engine

CHUNK_LOGIT_BYTES = 512 * 1024 ** 2  # one chunk's fp32 logits: 880 tokens of 152k at TP 1


def chunk_tokens(vocab_per_rank: int, configured: int = 0) -> int:
    """Tokens per chunk of the chunked loss: ``configured`` (training.cross_entropy_chunk_tokens),
    or as many as keep a chunk's fp32 logits under :data:`CHUNK_LOGIT_BYTES`."""
    return configured or max(1, CHUNK_LOGIT_BYTES // (4 * vocab_per_rank))


_ATTENTION = {
    "te": "Transformer Engine's",
    "sdpa": "torch scaled_dot_product_attention (causal without a mask, GQA without copies)",
    "local": "Megatron-Core's reference (s × s fp32 scores, unfused softmax, K/V copied per head)",
}
_PACKED = {
    ("te", "thd"): "TE's fused attention by sample boundaries",
    ("sdpa", "thd"): "torch varlen flash attention by sample boundaries on a device, one SDPA "
                     "call per sample on the CPU",
    ("local", "mask"): "an s × s block-diagonal mask per row",
}
_LOSS = {
    "chunked": "chunked vocabulary-parallel cross entropy (the output layer a chunk of tokens "
               "at a time; no microbatch-wide fp32 logits)",
    "megatron": "Megatron-Core's vocab_parallel_cross_entropy over the microbatch's logits",
}
_EXPERTS = {
    "te_grouped": "TE's grouped GEMM",
    "grouped": "one torch._grouped_mm per linear over the local experts",
    "sequential": "one expert after another (SequentialMLP)",
}


@dataclass(frozen=True)
class Kernels:
    """The kernels of one run (see the module docstring for each value)."""

    attention: str
    packed: Optional[str]
    loss: str
    experts: Optional[str]

    def describe(self) -> str:
        """One line for the launch summary and ``--dry-run``."""
        parts = [f"attention {self.attention}: {_ATTENTION[self.attention]}"]
        if self.packed:
            parts.append(f"packed rows: {_PACKED[self.attention, self.packed]}")
        parts.append(f"loss: {_LOSS[self.loss]}")
        if self.experts:
            parts.append(f"experts: {_EXPERTS[self.experts]}")
        return "; ".join(parts)


def choose(cfg: RunConfig, te_available: bool) -> Kernels:
    """The kernels of ``cfg`` on workers where TE imports (``te_available``) or not."""
    te = uses_transformer_engine(cfg, te_available)
    attention = "te" if te else ("local" if cfg.training.attention_backend == "local" else "sdpa")
    packed = None
    if cfg.data.dataset == "sft" and cfg.data.packing:
        packed = "mask" if attention == "local" else "thd"
    experts = None
    if cfg.model.is_moe:
        if not cfg.training.moe_grouped_gemm or cfg.lora.on_experts(True):
            experts = "sequential"
        else:
            experts = "te_grouped" if te else "grouped"
    return Kernels(attention=attention, packed=packed, loss=cfg.training.cross_entropy,
                   experts=experts)


def planned(cfg: RunConfig) -> Kernels:
    """The kernels the plan counts with before any worker runs: on ``cluster.device=cpu`` TE
    is absent; on a device it is assumed present (PPU images ship it), and a worker without
    it takes ``sdpa`` (the same memory, see :mod:`ray_ppu.plan.memory`)."""
    return choose(cfg, cfg.cluster.device != "cpu")
