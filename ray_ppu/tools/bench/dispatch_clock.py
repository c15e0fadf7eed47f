"""How long a training step spends in Megatron-Core's MoE token dispatcher, forward and backward.

The dispatcher is the part of a MoE layer that moves tokens to their experts and back:
``dispatch_preprocess`` (permutation 1), ``token_dispatch`` (the all-to-all over EP),
``dispatch_postprocess`` (sort by local expert), then after the experts ``combine_preprocess``
(unsort), ``token_combine`` (the reverse all-to-all) and ``combine_postprocess``
(unpermutation). :class:`DispatcherClock` replaces those six methods on each MoE layer's
dispatcher *instance* (an attribute that shadows the class's method, in this process only:
Megatron-Core's code is unchanged) by a timed call of the original.

Forward: the wall time of each call. Backward: autograd runs the dispatcher's backward as
the same chain in reverse, so each call's inputs and outputs pass through an identity
autograd function (:class:`_Stamp`) whose backward notes the time: the first gradient
reaching the call's outputs starts its backward, the last one leaving through its inputs
ends it. The engine runs the nodes made later in the forward first, so between those two
notes it runs only that call's own backward nodes. On a CUDA device each note synchronizes
first (kernels are asynchronous), which serialises the step a little: the figures are what
the dispatcher costs, the step time is slightly pessimistic.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

METHODS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
           "combine_preprocess", "token_combine", "combine_postprocess")


class _Call:
    """One dispatcher call's backward notes: when gradients reached its outputs, when its
    inputs' gradients were done."""

    __slots__ = ("arrived", "left")

    def __init__(self) -> None:
        self.arrived: list[float] = []
        self.left: list[float] = []

    def backward_s(self) -> float:
        # a call whose outputs got no gradient (none flowed back through it) ran no backward
        return max(self.left) - min(self.arrived) if self.arrived and self.left else 0.0


class _Stamp(torch.autograd.Function):
    """Identity in the forward; its backward appends the time to ``notes`` (after ``sync``)."""

    @staticmethod
    def forward(ctx, x, notes, sync):
        ctx.notes, ctx.sync = notes, sync
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.sync()
        ctx.notes.append(time.perf_counter())
        return grad, None, None


def _stamped(value, notes: list, sync: Callable[[], None]):
    """``value`` (a tensor, or a tuple / list of values) with every floating tensor that
    takes part in autograd passed through a :class:`_Stamp` noting into ``notes``."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad and value.is_floating_point():
            return _Stamp.apply(value, notes, sync)
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_stamped(v, notes, sync) for v in value)
    return value


class DispatcherClock:
    """Times the token dispatchers of every MoE layer in ``model`` (a list of chunks, DDP- or
    Float16Module-wrapped); :meth:`take` gives the seconds since its last call."""

    def __init__(self, model: list, cuda: bool) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        from ray_ppu.util.wrappers import unwrap

        self._sync = torch.cuda.synchronize if cuda else _no_sync
        self.forward_s = 0.0
        self.calls: list[_Call] = []
        layers = [m for chunk in model for m in unwrap(chunk).modules() if isinstance(m, MoELayer)]
        if not layers:
            raise ValueError("the model has no MoE layer (model.num_moe_experts unset?): "
                             "there is no token dispatcher to time")
        self.layers = len(layers)
        for layer in layers:
            for name in METHODS:
                self._wrap(layer.token_dispatcher, name)

    def _wrap(self, dispatcher, name: str) -> None:
        original = getattr(dispatcher, name)  # bound to this instance

        def timed(*args, **kwargs):
            call = _Call() if torch.is_grad_enabled() else None
            if call is not None:  # outside the forward's clock: the stamps are not dispatcher work
                args = _stamped(args, call.left, self._sync)
            self._sync()
            start = time.perf_counter()
            out = original(*args, **kwargs)
            self._sync()
            self.forward_s += time.perf_counter() - start
            if call is None:
                return out
            self.calls.append(call)
            return _stamped(out, call.arrived, self._sync)

        setattr(dispatcher, name, timed)

    def take(self) -> tuple[float, float]:
        """(forward seconds, backward seconds) in the dispatchers since the last take; call it
        after an optimizer step, when every backward has run."""
        figures = (self.forward_s, sum(c.backward_s() for c in self.calls))
        self.forward_s, self.calls = 0.0, []
        return figures


def _no_sync() -> None:
    """CPU kernels finish before they return: nothing to wait for."""
