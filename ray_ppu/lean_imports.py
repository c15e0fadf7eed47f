"""What Megatron-Core loads at import and never uses here, left unloaded until it is used.

Every process that trains imports Megatron-Core: each Ray Train worker of every worker group
(restarts included), each torchrun rank, each conversion or generation process. On a 2-core
node what that import costs delays every group's start. Two parts of it do no work for ray_ppu:

- **wandb and TensorBoard.** Megatron-Core imports wandb when its modules load
  (megatron/core/timers.py and its inference engine and context) for its own W&B writers, and
  torch.utils.tensorboard (its timers' writer type). ray_ppu uses neither through it: a run's
  W&B and TensorBoard trackers are ray_ppu's own, fed by the driver
  (:mod:`ray_ppu.monitor.tracker_clients`). Where installed, they cost 0.64 s and 0.15 s of CPU
  a process. A finder on ``sys.meta_path`` answers "not installed" to those imports only (the
  importing module is one of Megatron-Core's); Megatron-Core takes the branch it has for a
  machine without them. Every other import of them, ours included, is untouched.
- **torch.compile at decoration.** ``megatron.core.jit.jit_fuser`` is ``torch.compile`` on
  torch ≥ 2.2, and Megatron-Core decorates ~40 functions with it as its modules load (the bias
  + activation fusions, the fused cross entropy, the MoE router's expert bias). Calling
  ``torch.compile(fn)`` imports TorchDynamo and Inductor at once (1.3 s of CPU a process),
  although it compiles nothing until ``fn`` is first called, and without Transformer Engine
  ray_ppu turns those fusions off (:mod:`ray_ppu.model.megatron_settings`). Once
  ``megatron.core.jit`` has run, its ``jit_fuser`` is replaced by :func:`compile_on_first_call`:
  the same ``torch.compile`` with the same options, made on a function's first call. A fusion
  that runs is compiled as before; one that does not costs nothing.

:func:`install` (``import ray_ppu`` does it) must run before Megatron-Core is imported; a
Megatron-Core already imported is left as it is.
"""

from __future__ import annotations

import functools
import sys
import threading
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import PathFinder

_DECLINED = frozenset({"wandb", "torch.utils.tensorboard"})
_IMPORTERS = "megatron."  # whose imports of _DECLINED are declined
_JIT = "megatron.core.jit"  # whose torch.compile is deferred


def compile_on_first_call(fn=None, **options):
    """``torch.compile(fn, **options)``, made when ``fn`` is first called (a decorator with or
    without options, as ``torch.compile`` is). Until then neither TorchDynamo nor Inductor is
    imported."""
    if fn is None:
        return lambda f: compile_on_first_call(f, **options)
    compiled = None
    lock = threading.Lock()  # two threads' first calls compile once

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            with lock:
                if compiled is None:
                    import torch

                    compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    return call


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


class _DeferredCompile(Loader):
    """``megatron.core.jit``'s own loader, then its ``jit_fuser`` swapped when it is
    ``torch.compile`` (not when Megatron-Core chose TorchScript or no fusion)."""

    def __init__(self, loader: Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        torch = sys.modules.get("torch")
        if torch is not None and getattr(module, "jit_fuser", None) is torch.compile:
            module.jit_fuser = compile_on_first_call

    def __getattr__(self, name):  # get_source, get_filename, ... as the file's own loader
        return getattr(self._loader, name)


class _LeanMegatron(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in _DECLINED and _importer().startswith(_IMPORTERS):
            raise ModuleNotFoundError(f"No module named {name!r} (declined for Megatron-Core "
                                      "by ray_ppu.lean_imports)", name=name)
        if name == _JIT:
            spec = PathFinder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _DeferredCompile(spec.loader)
            return spec
        return None


def install() -> None:
    """Once per process, before Megatron-Core is imported (``import ray_ppu`` does it)."""
    if not any(isinstance(f, _LeanMegatron) for f in sys.meta_path):
        sys.meta_path.insert(0, _LeanMegatron())
