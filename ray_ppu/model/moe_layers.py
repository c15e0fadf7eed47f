"""The router and experts of a MoE model on the local (non-Transformer-Engine) spec.

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

:class:`GroupedLayoutFreeMLP` runs those same experts as one ``torch._grouped_mm`` per linear
(``training.moe_grouped_gemm``): SequentialMLP's Python loop launches 2 × E GEMMs (three
times that with the backward pass) per layer and microbatch, each over the few tokens routed
to one expert; on an H200 a MoE of 8 experts ran at 4.4 % MFU that way.
"""

from __future__ import annotations

import functools

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter

from ray_ppu import devices


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


_GROUPED_WGRAD = [True]  # False once the device's _grouped_mm refused a weight gradient


class _GroupedLinear(torch.autograd.Function):
    """``x [T, in]``, rows ``offsets[e-1]:offsets[e]`` through expert e's ``W_e [out, in]``,
    as one ``torch._grouped_mm``. The experts' weights are stacked only while a kernel reads
    them (forward, then again in the backward pass) instead of autograd keeping the stack: at
    Qwen3-30B-A3B's 128 experts that is 1.2 GB a layer not held from forward to backward."""

    @staticmethod
    def forward(ctx, x, offsets, *weights):
        ctx.save_for_backward(x, offsets, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        x, offsets, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, torch.stack(weights), offs=offsets)
        grads = [None] * len(weights)
        if any(ctx.needs_input_grad[2:]):
            grads = list(_weight_gradients(grad, x, offsets))
        return (grad_x, None, *grads)


def _weight_gradients(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor):
    """``grad_eᵀ · x_e`` per expert [n, out, in]: one grouped GEMM over the token dimension;
    one GEMM per expert where the device's kernel refuses that form (said once)."""
    if grad.shape[0] == 0:  # no token reached these experts: nothing to contract over
        return torch.zeros(len(offsets), grad.shape[1], x.shape[1], dtype=grad.dtype,
                           device=grad.device).unbind(0)
    if _GROUPED_WGRAD[0]:
        try:
            return torch._grouped_mm(grad.t(), x, offs=offsets).unbind(0)
        except RuntimeError as error:
            if devices.kernel_failure_is_fatal(error):
                raise
            import logging

            _GROUPED_WGRAD[0] = False
            logging.getLogger(__name__).warning(
                "torch._grouped_mm refused the experts' weight gradients (%s); they are "
                "computed one expert at a time from now on", str(error).splitlines()[0])
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    return [grad[a:b].t() @ x[a:b] for a, b in zip(starts, ends)]


def grouped_gemm_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs here: the CPU in any float dtype (torch ≥ 2.9); CUDA
    in bf16 on Hopper or newer (what its kernel supports)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type != "cuda":
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    return dtype == torch.bfloat16 and _capability(device.index) >= 9


@functools.lru_cache(maxsize=None)
def _capability(index) -> int:
    return torch.cuda.get_device_capability(index)[0]


class GroupedLayoutFreeMLP(LayoutFreeSequentialMLP):
    """The same experts (weights, names, checkpoints, initialisation) run as two grouped GEMMs
    over all local experts instead of a Python loop of 2 × E GEMMs: Megatron-Core's
    SequentialMLP semantics (fc1, SwiGLU, the routing probabilities applied before fc2, in
    the activations' dtype), one kernel launch per linear. Where torch's grouped GEMM cannot
    run (:func:`grouped_gemm_usable`) or fp8 / per-input probabilities are asked for, the loop
    runs as before."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        config = self.config
        if (self.num_local_experts == 1 or config.fp8 or getattr(config, "fp4", None)
                or config.moe_apply_probs_on_input or config.add_bias_linear
                or getattr(config, "activation_func_clamp_value", None) is not None
                or getattr(config, "glu_linear_offset", 0.0)
                or not grouped_gemm_usable(x.device, x.dtype)):
            return super().forward(x, tokens_per_expert, permuted_probs)
        self._run_linears_pre_hooks()
        offsets = torch.cumsum(torch.as_tensor(tokens_per_expert), 0).to(torch.int32)
        if x.is_cuda:  # a few ints from the dispatcher's host copy, without a stream sync
            offsets = offsets.pin_memory().to(x.device, non_blocking=True)
        fc1 = [expert.linear_fc1.weight for expert in self.local_experts]
        fc2 = [expert.linear_fc2.weight for expert in self.local_experts]
        hidden = _GroupedLinear.apply(x, offsets, *fc1)
        if config.gated_linear_unit:
            gate, up = torch.chunk(hidden, 2, dim=-1)
            hidden = config.activation_func(gate) * up
        else:
            hidden = config.activation_func(hidden)
        hidden = (hidden * permuted_probs.unsqueeze(-1)).to(x.dtype)
        return _GroupedLinear.apply(hidden, offsets, *fc2), None

    def _run_linears_pre_hooks(self) -> None:
        """Run what a call of each expert linear would run first: the grouped GEMM reads their
        weights without calling them, and Megatron DDP's parameter all-gather (the
        distributed optimizer with ``overlap_param_gather``) waits in those linears' forward
        pre-hooks. Without this, expert shards other ranks updated would never be gathered."""
        for expert in self.local_experts:
            for linear in (expert.linear_fc1, expert.linear_fc2):
                for key, hook in linear._forward_pre_hooks.items():
                    if key in linear._forward_pre_hooks_with_kwargs:
                        hook(linear, (), {})
                    else:
                        hook(linear, ())
