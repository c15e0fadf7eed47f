"""Low-rank adapters on Megatron-Core's parallel linears, equal to unsharded LoRA at any layout.

An adapter of rank r adds ``(alpha / r)·x·Aᵀ·Bᵀ`` to a linear's output (A [r, in] drawn as
PEFT draws it, B [out, r] zero). It is a module of its own beside the linear it adapts
(``self_attention.linear_qkv_lora`` beside ``linear_qkv``), called from a forward hook on that
linear: the linear, its checkpoint keys and its Hugging Face mapping stay as they are, and the
adapter brings its own sharded state dict.

How each piece is sharded, and what crosses the TP group (x: the linear's input; z = x·Aᵀ):

* **column-parallel** (``linear_qkv``, ``linear_fc1``; the output split): A whole, B split like
  W's rows. Without sequence parallelism x is whole on every rank, z too; z's gradient is
  summed over TP on the way back (each rank's B saw its own rows), so A's gradient is the same
  on every rank. With it, x is this rank's share of the sequence: z is gathered along the
  sequence (r columns instead of the h the linear gathers) and its gradient reduce-scattered
  back; A's gradient, a sum over the rank's tokens only, is summed over TP in
  ``finalize_model_grads`` (``sequence_parallel`` set, as on the norms).
* **row-parallel** (``linear_proj``, ``linear_fc2``; the input split): A split like W's
  columns, B whole. z is a partial sum over TP: all-reduced (or, with sequence parallelism,
  reduce-scattered along the sequence, B's gradient then summed over TP as above).
* **experts**: each expert's adapters live with it (EP). Megatron-Core's token dispatcher does
  the experts' communication, so nothing is reduced here at ETP 1; at ETP > 1 the replicated
  half (A of fc1, B of fc2) has its gradient all-reduced over the expert-TP group inside the
  backward (:class:`_ReplicatedWeight`), and the rules allow ETP only 1 or TP (where Megatron's
  gradient norm counts a replicated piece once).
* Transformer Engine's fused layer-norm linears take the un-normalised input: the adapter
  normalises it with the linear's own norm weight (the adapter input is the normalised
  activation, as for the local spec's separate norm).

A draws come from a generator seeded by the run's seed, the global layer, the target and the
global expert index, the full matrix then sliced: the same adapters at every TP / PP / EP.
Pieces carry Megatron's attributes (``tensor_model_parallel``, ``allreduce`` of the expert
weight beside them, ``sequence_parallel``), so DDP buckets them, the distributed optimizer
shards them and the gradient norm counts each once. Everything else is frozen except the
base parts ``lora.trainable`` names; DDP and the optimizer see only what trains.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import mappings

from ray_ppu.config.lora import ADAPTER_SUFFIX, COLUMN_TARGETS, LoraConfig, is_adapter_key

@dataclass(frozen=True)
class Comm:
    """What crosses ranks around one adapter: the group its linear is split over, and how."""

    group: object  # the TP group (dense) or the expert-TP group
    size: int
    rank: int
    sequence_parallel: bool  # dense linears with parallel.sequence_parallel
    explicit: bool  # experts at EP or ETP > 1: the token dispatcher communicates
    expert: bool


class _ReplicatedWeight(torch.autograd.Function):
    """``x·Wᵀ`` whose weight gradient is summed over ``group`` (an expert adapter's piece
    that every expert-TP rank holds whole, each seeing the same tokens through its own shard);
    the input gradient stays this rank's partial one, which the dispatcher sums."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_weight = grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        torch.distributed.all_reduce(grad_weight, group=ctx.group)
        return grad.matmul(weight), grad_weight, None


class LoraAdapter(torch.nn.Module):
    """A [r, in_local] and B [out_local, r] of one linear, and the forward its hook adds.

    ``column``: the linear splits its output (else its input); ``gated``: a SwiGLU fc1, whose
    rows are gate then up and whose shards hold a part of each (checkpointed in two halves, as
    Megatron-Core checkpoints the weight); ``norm``: (weight, eps) of a fused layer-norm linear.
    """

    def __init__(self, in_local: int, out_local: int, rank: int, scale: float, dropout: float,
                 column: bool, gated: bool, comm: Comm, dtype: torch.dtype,
                 norm: Optional[tuple] = None) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(rank, in_local, dtype=dtype))
        self.b = torch.nn.Parameter(torch.zeros(out_local, rank, dtype=dtype))
        self.scale, self.dropout_p = scale, dropout
        self.column, self.gated, self.comm, self.norm = column, gated, comm, norm
        split = "b" if column else "a"
        for name in ("a", "b"):
            # an expert at ETP 1 is whole on its rank: nothing of it is a TP replica (so
            # Megatron marks its weights); else only the split piece is TP-parallel
            tensor_parallel.set_tensor_model_parallel_attributes(
                getattr(self, name), is_parallel=name == split or (comm.expert and comm.size == 1),
                dim=0 if column else 1, stride=1)
        # with sequence parallelism the replicated piece saw only this rank's tokens
        replicated = self.b if split == "a" else self.a
        replicated.sequence_parallel = comm.sequence_parallel

    def _dropout(self, x: torch.Tensor, distinct: bool) -> torch.Tensor:
        """Dropout on the adapter's input: from the model-parallel RNG where each TP rank's x is
        its own (a share of the sequence or of the features), else from the default one (the
        same mask on every rank, whose x is the same)."""
        if not self.dropout_p or not self.training:
            return x
        if distinct:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.dropout(x, self.dropout_p, True)
        return F.dropout(x, self.dropout_p, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.comm
        if self.norm is not None:
            weight, eps = self.norm
            x = F.rms_norm(x, (x.shape[-1],), weight, eps)
        if self.column:
            x = self._dropout(x, distinct=c.sequence_parallel)
            if c.explicit and c.size > 1:
                z = _ReplicatedWeight.apply(x, self.a, c.group)
            else:
                z = F.linear(x, self.a)
                if c.sequence_parallel:
                    z = mappings.gather_from_sequence_parallel_region(
                        z, tensor_parallel_output_grad=True, group=c.group)
                elif not c.explicit:
                    z = mappings.copy_to_tensor_model_parallel_region(z, group=c.group)
            return F.linear(z, self.b) * self.scale
        z = F.linear(self._dropout(x, distinct=c.size > 1), self.a)  # partial over the group
        if c.explicit:  # the dispatcher sums the experts' partial outputs
            if c.size > 1:
                return _ReplicatedWeight.apply(z, self.b, c.group) * self.scale
            return F.linear(z, self.b) * self.scale
        if c.sequence_parallel:
            z = mappings.reduce_scatter_to_sequence_parallel_region(z, group=c.group)
        else:
            z = mappings.reduce_from_tensor_model_parallel_region(z, group=c.group)
        return F.linear(z, self.b) * self.scale

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """A and B as Megatron-Core ShardedTensors, split along the axis W is split along,
        over the linear's group (a gated fc1's B in its gate and up halves)."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                                     make_sharded_tensors_for_checkpoint)

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = {"a": self.a, "b": self.b}
        sharded = make_sharded_tensors_for_checkpoint(
            state, prefix, {"b": 0} if self.column else {"a": 1}, sharded_offsets,
            tp_group=self.comm.group, dp_cp_group=metadata["dp_cp_group"])
        if self.gated:
            key = f"{prefix}b"
            sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets)
        return sharded


def draw_a(seed: int, layer: int, target: str, expert: Optional[int], rank: int,
           in_full: int) -> torch.Tensor:
    """The full A [rank, in] of one adapter, fp32: PEFT's draw (Kaiming-uniform with a = √5,
    i.e. U(±1/√in)) from a generator seeded by the run's seed and the adapter's place in the
    whole model, so every layout draws the same."""
    name = f"{seed}/{layer}/{target}/{expert}".encode()
    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(name).digest()[:8],
                                                             "little") % 2**63)
    full = torch.empty(rank, in_full)
    torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
    return full


@dataclass(frozen=True)
class Site:
    """A linear that gets an adapter: where it sits in the whole model."""

    parent: torch.nn.Module  # the attention or MLP module holding the linear
    name: str  # linear_qkv, linear_proj, linear_fc1, linear_fc2
    target: str  # the lora target it answers to (experts.linear_fc1 for an expert's fc1)
    layer: int  # global layer number (1-based, Megatron's)
    expert: Optional[int]  # global expert index


def sites(module: torch.nn.Module, targets: tuple[str, ...]) -> Iterator[Site]:
    """The linears of a GPTModel chunk that ``targets`` name (an expert's, per local expert)."""
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    for layer in module.decoder.layers:
        number = layer.layer_number
        attention = layer.self_attention
        for name in ("linear_qkv", "linear_proj"):
            if name in targets:
                yield Site(attention, name, name, number, None)
        mlp = layer.mlp
        experts = getattr(mlp, "experts", None)
        if experts is None:
            for name in ("linear_fc1", "linear_fc2"):
                if name in targets:
                    yield Site(mlp, name, name, number, None)
            continue
        local = getattr(experts, "local_experts", None)
        if local is None:
            raise NotImplementedError("LoRA on experts needs sequential experts (the spec is "
                                      "built without grouped GEMM when experts are targeted)")
        for i, expert in enumerate(local):
            for name in ("linear_fc1", "linear_fc2"):
                if f"experts.{name}" in targets:
                    yield Site(expert, name, f"experts.{name}", number,
                               ep_rank * len(local) + i)


def _comm(expert: bool, sequence_parallel: bool) -> Comm:
    if expert:
        size = parallel_state.get_expert_tensor_parallel_world_size()
        explicit = size > 1 or parallel_state.get_expert_model_parallel_world_size() > 1
        return Comm(parallel_state.get_expert_tensor_parallel_group(), size,
                    parallel_state.get_expert_tensor_parallel_rank(), False, explicit, True)
    return Comm(parallel_state.get_tensor_model_parallel_group(),
                parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_tensor_model_parallel_rank(), sequence_parallel, False, False)


@torch.no_grad()
def attach(module: torch.nn.Module, lora: LoraConfig, is_moe: bool, tied: bool, seed: int,
           sequence_parallel: bool, dtype: torch.dtype) -> int:
    """Give the targets of one GPTModel chunk their adapters (A drawn, B zero: a resume or a
    PEFT adapter loads over them) and freeze the base but for ``lora.trainable``; returns the
    number of adapters attached."""
    attached = 0
    for site in sites(module, lora.targets(is_moe)):
        linear = getattr(site.parent, site.name)
        out_local, in_local = linear.weight.shape
        column = site.target in COLUMN_TARGETS
        comm = _comm(site.expert is not None, sequence_parallel)
        norm = ((linear.layer_norm_weight, linear.eps)
                if hasattr(linear, "layer_norm_weight") else None)
        rank = lora.rank_of(site.target)
        adapter = LoraAdapter(in_local, out_local, rank, lora.scale_of(site.target),
                              lora.dropout, column, column and site.name == "linear_fc1", comm,
                              dtype, norm)
        full = draw_a(seed, site.layer, site.target, site.expert, rank,
                      in_local if column else in_local * comm.size)
        adapter.a.copy_(full if column else full.chunk(comm.size, dim=1)[comm.rank])
        allreduce = getattr(linear.weight, "allreduce", True)
        for param in (adapter.a, adapter.b):
            param.allreduce = allreduce  # an expert's: reduced over expert-DP, as its weight
        site.parent.add_module(site.name + ADAPTER_SUFFIX, adapter)
        linear.register_forward_hook(_add_adapter_output(adapter))
        attached += 1
    freeze_base(module, lora.trainable, tied)
    return attached


def keep_gradients_through_recompute(module: torch.nn.Module) -> None:
    """Make the first stage's embedding output require grad. Megatron-Core's full recompute
    runs each unit of layers in a checkpoint function whose output requires grad only when
    its input does: behind a frozen embedding the layers' input does not, and no adapter in
    any recomputed layer would get a gradient (zeros, silently: tests/test_lora.py)."""
    def hook(_embedding, _args, output):
        return output if output.requires_grad else output.requires_grad_()

    module.embedding.register_forward_hook(hook)


def _add_adapter_output(adapter: LoraAdapter):
    def hook(_linear, args, output):
        out, bias = output
        return out + adapter(args[0]), bias

    return hook


def freeze_base(module: torch.nn.Module, trainable: list[str], tied: bool) -> None:
    """Every parameter but the adapters' and those of the named base parts stops training."""
    parts = set(trainable)
    for name, param in module.named_parameters():
        param.requires_grad = is_adapter_key(name) or _part_of(name, tied) in parts


def _part_of(name: str, tied: bool) -> Optional[str]:
    """The ``lora.trainable`` part a base parameter belongs to, if any. A tied output layer's
    copy on the last pipeline stage is the embedding."""
    if name.startswith("embedding.word_embeddings."):
        return "embedding"
    if name.startswith("output_layer."):
        return "embedding" if tied else "output_layer"
    if "layernorm" in name or "layer_norm" in name:
        return "norms"
    if ".mlp.router." in name:
        return "router"
    return None
