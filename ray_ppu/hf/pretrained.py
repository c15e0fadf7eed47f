"""The Hugging Face weights a run starts from (``checkpoint.pretrained``), text or
vision-language: one entry for the checks before any worker starts and for the ranks' loads.

A text model's directory is read by :mod:`ray_ppu.hf.weights`; a vision-language model's
parts (a LLaVA directory, or a language model directory plus ``checkpoint.pretrained_vision``,
a vision tower's) by :mod:`ray_ppu.hf.llava_weights`, a Qwen2.5-VL directory by
:mod:`ray_ppu.hf.qwen_vl`.
"""

from __future__ import annotations

from ray_ppu.config.schema import RunConfig


def _parts(cfg: RunConfig):
    if cfg.vision.native:  # Qwen2.5-VL: one directory
        from ray_ppu.hf.qwen_vl import Parts as QwenParts

        return QwenParts.of(cfg.checkpoint.pretrained)
    from ray_ppu.hf.llava_weights import Parts

    return Parts.of(cfg.checkpoint.pretrained, cfg.checkpoint.pretrained_vision)


def check(cfg: RunConfig) -> None:
    """Every tensor the run reads is there with its shape (safetensors headers only); a
    ConfigError names each missing or misshapen one."""
    if cfg.vision.enabled:
        _parts(cfg).check(cfg.model, cfg.vision)
    else:
        from ray_ppu.hf.weights import check_checkpoint

        check_checkpoint(cfg.checkpoint.pretrained, cfg.model)


def load(chunks: list, cfg: RunConfig, padded_vocab: int) -> dict:
    """Fill this rank's model chunks from ``checkpoint.pretrained`` (and the vision tower);
    returns {"bytes_read", "seconds"}."""
    if cfg.vision.native:
        from ray_ppu.hf.qwen_vl import load_pretrained as load_qwen_vl

        return load_qwen_vl(chunks, _parts(cfg), cfg.model, cfg.vision, padded_vocab)
    if cfg.vision.enabled:
        from ray_ppu.hf.llava_weights import load_pretrained

        return load_pretrained(chunks, _parts(cfg), cfg.model, cfg.vision, padded_vocab)
    from ray_ppu.hf.weights import load_pretrained

    return load_pretrained(chunks, cfg.checkpoint.pretrained, cfg.model, padded_vocab)
