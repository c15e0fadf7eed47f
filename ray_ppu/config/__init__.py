"""Typed run configuration: dataclasses (schema), model presets, YAML + overrides (loader)."""

from ray_ppu.config.loader import ConfigError, from_dict, load
from ray_ppu.config.presets import PRESETS
from ray_ppu.config.schema import RunConfig

__all__ = ["ConfigError", "PRESETS", "RunConfig", "from_dict", "load"]
