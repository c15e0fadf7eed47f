"""Megatron-Core's module-level imports of a package ray_ppu never uses through it, declined.

Megatron-Core imports ``wandb`` when its modules load (megatron/core/timers.py and its
inference engine and context, all pulled in by ``import megatron.core``) for its own W&B
writers. ray_ppu does not use them: a run's W&B tracker is ray_ppu's own, fed by the driver
(:mod:`ray_ppu.monitor.tracker_clients`). Where wandb is installed, that import is 0.64 s of
CPU (and 0.6 s of wall time) in every process that imports Megatron-Core: each Ray Train
worker of every worker group, restarts included, each torchrun rank, each conversion or
generation process. On a 2-core node it delays every group's start.

:func:`install` puts a finder on ``sys.meta_path`` that answers "not installed" to those
imports only: the importing module is one of Megatron-Core's. Megatron-Core then takes the
branch it has for a machine without wandb. Every other import of wandb, ours included, is
untouched, and a wandb already imported is Megatron-Core's as before.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

_DECLINED = frozenset({"wandb"})
_IMPORTERS = "megatron."  # whose imports of _DECLINED are declined


def _importer() -> str:
    """The module whose ``import`` statement is running: the first frame outside Python's
    import machinery."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(("importlib", "_frozen_importlib")):
            return name
        frame = frame.f_back
    return ""


class _DeclinedForMegatron(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in _DECLINED and _importer().startswith(_IMPORTERS):
            raise ModuleNotFoundError(f"No module named {name!r} (declined for Megatron-Core "
                                      "by ray_ppu.lean_imports)", name=name)
        return None


def install() -> None:
    """Once per process, before Megatron-Core is imported (``import ray_ppu`` does it)."""
    if not any(isinstance(f, _DeclinedForMegatron) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeclinedForMegatron())
