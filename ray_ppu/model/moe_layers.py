"""The router and experts of a MoE model on the local (CPU) spec.

Megatron-Core 0.16.1's router computes its gate through a function that calls Transformer
Engine's GEMM whenever the routing dtype is not fp64, and raises NameError where TE is not
installed. :class:`LocalTopKRouter` computes the same logits with torch (``x · Wᵀ`` in the
routing dtype; the gradient is torch's).

The experts are initialised the same at any EP / ETP:

Megatron-Core's CPU initialisation draws each weight's full matrix from the default generator
and slices it for the rank, so a dense model starts the same at TP 1 and TP 2. Its experts do
not: each EP rank draws its *local* experts 0, 1, … in turn from the same generator state, so
at EP 2 both halves of the experts start identical, and every later layer starts from another
point of the stream than at EP 1. :class:`LayoutFreeSequentialMLP` builds the experts with the
default generator left untouched (one draw of a base seed, the same on every layout), then draws
each expert's full matrices from a generator seeded by that base and the expert's *global*
index and keeps this rank's ETP slice. EP 1 and EP 2 (ETP 1 or 2) then train the same model,
which is what lets a test hold EP 2's losses to EP 1's.

On a device the experts are initialised by Megatron-Core (its expert RNG tracker, per EP
rank), as in Megatron-LM.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter


class LocalTopKRouter(TopKRouter):
    """Megatron-Core's top-k router with its gate in torch: the logits in the routing dtype
    (``moe_router_dtype``, else the input's), for the local spec (no Transformer Engine)."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype,
                                                                    input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)


class LayoutFreeSequentialMLP(SequentialMLP):
    """Megatron-Core's SequentialMLP (one MLP per local expert, looped over) whose weights are
    drawn per global expert: the same model at every EP / ETP layout (CPU initialisation)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        # one draw from the default generator, as many on every layout
        base_seed = int(torch.randint(0, 2**62, (1,)).item())
        with torch.random.fork_rng(devices=[]):
            super().__init__(num_local_experts, config, submodules, pg_collection)
        if config.use_cpu_initialization and config.perform_initialization:
            self._draw_per_global_expert(base_seed)

    @torch.no_grad()
    def _draw_per_global_expert(self, base_seed: int) -> None:
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()
        etp = parallel_state.get_expert_tensor_parallel_world_size()
        for local, expert in enumerate(self.local_experts):
            expert_index = ep_rank * self.num_local_experts + local
            for name, linear, init in (("fc1", expert.linear_fc1, self.config.init_method),
                                       ("fc2", expert.linear_fc2, self.config.output_layer_init_method)):
                weight = linear.weight
                # fc1 [2F/ETP, H] holds this rank's share of gate and of up (stride 2, as
                # Megatron cuts a gated fc1); fc2 [H, F/ETP] its share of the input columns
                dim, stride = (0, 2 if self.config.gated_linear_unit else 1) if name == "fc1" else (1, 1)
                full_shape = list(weight.shape)
                full_shape[dim] *= etp
                full = torch.empty(full_shape, dtype=torch.float32)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed((base_seed + 2 * expert_index + (name == "fc2")) % 2**63)
                    init(full)
                chunks = full.chunk(etp * stride, dim=dim)
                weight.copy_(torch.cat(chunks[etp_rank::etp], dim=dim).to(weight.dtype))
