"""Which run options need Transformer Engine (TE), and whether a worker builds TE layers.

A run asking for a TE-only option where TE cannot run is an error naming the option, never a
silent fallback to another kernel: the plan (before any worker), the preflight (per node) and
the model build (per worker) all ask :func:`needs_transformer_engine`. Config only: no torch.
"""

from __future__ import annotations

from ray_ppu.config.schema import RunConfig


def needs_transformer_engine(cfg: RunConfig) -> list[str]:
    """The options of ``cfg`` only Transformer Engine provides, each named as the user set it."""
    t, mem, p = cfg.training, cfg.memory, cfg.parallel
    needs = []
    if t.precision == "fp8":
        needs.append("training.precision=fp8 (FP8 GEMMs)")
    if t.attention_backend in ("flash", "fused", "unfused"):
        needs.append(f"training.attention_backend={t.attention_backend} (a TE attention kernel)")
    if mem.activation_offload_layers:
        needs.append(f"memory.activation_offload_layers={mem.activation_offload_layers} "
                     f"(TE's CPU offload context)")
    if p.context_parallel_size > 1:
        needs.append(f"parallel.context_parallel_size={p.context_parallel_size} (Megatron-Core's "
                     f"local attention refuses CP > 1)")
    return needs


def uses_transformer_engine(cfg: RunConfig, te_available: bool) -> bool:
    """TE layers (TE spec) unless the config asks for a torch attention (``sdpa``, or
    Megatron-Core's ``local``) or TE is not there; ``auto`` takes TE where it imports."""
    return te_available and cfg.training.attention_backend not in ("local", "sdpa")
