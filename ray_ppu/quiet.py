"""Library notices that tell a ray_ppu user nothing, filtered once per process.

Every process that runs our code imports :mod:`ray_ppu` before torch or Megatron-Core (the
driver, Ray Train's workers unpickling their function, Ray tasks and actors), so the package
installs these filters on import. Each names one notice exactly; everything else still shows.
"""

from __future__ import annotations

import logging
import warnings

# Megatron-Core warns at import, in four modules and on every rank, that Transformer Engine and
# Apex are missing and it falls back to its own kernels. Where a run's options need Transformer
# Engine, the preflight says so in one line before anything starts (ray_ppu.devices); on CPU
# the fallback is the only path.
_MESSAGES = (r"Transformer Engine and Apex are not installed",)
# Megatron-FSDP (which we do not use) logs at import which of its back ends it found.
_QUIET_LOGGERS = ("megatron.core.distributed.fsdp",)


def install() -> None:
    for message in _MESSAGES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
