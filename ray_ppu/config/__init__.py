"""The typed run configuration every other package reads: one frozen dataclass per section of
``run.yaml``, a docstring on every field (:mod:`~ray_ppu.config.schema`), the model presets
naming their source ``config.json`` (:mod:`~ray_ppu.config.presets`), and the YAML file plus
``section.key=value`` overrides turned into a :class:`RunConfig`, each mistake one line with a
did-you-mean (:mod:`~ray_ppu.config.loader`). Nothing derived lives here: the numbers a config
implies (layout, batches, FLOPs, memory) are :mod:`ray_ppu.plan`'s.
"""

from ray_ppu.config.loader import ConfigError, from_dict, load
from ray_ppu.config.presets import PRESETS
from ray_ppu.config.schema import RunConfig

__all__ = ["ConfigError", "PRESETS", "RunConfig", "from_dict", "load"]
