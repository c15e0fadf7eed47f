"""Memory plan: what one device holds, so TP / PP / recompute / offload can be chosen before
renting the devices. Pure arithmetic on the config and plan (no torch); ``--dry-run`` prints it.

Per device of the most loaded pipeline stage:

- parameters: its parameter count × 2 bytes (bf16 / fp16 / fp8 keep bf16 or fp16 weights; fp32: 4);
- gradients: Megatron DDP's fp32 gradient buffers, 4 bytes per parameter that trains (a LoRA
  run's frozen base has none, nor optimizer state or snapshots);
- optimizer: Adam's two fp32 moments plus the fp32 master weights of 16-bit runs (12 bytes per
  parameter, 8 in fp32), divided over DP × CP by the distributed optimizer (a MoE model's
  expert weights, split by EP × ETP, over expert-DP); the offloaded fraction lives on the host
  instead;
- activations: what autograd keeps per layer for one microbatch (the tensors each op saves for
  its backward, below), times the layers of the stage, times the microbatches the pipeline
  schedule has in flight on that stage, plus, with full recompute, one recompute unit rebuilt in
  the backward pass.

Not counted: the CUDA context, communication buffers and allocator fragmentation (the budget
keeps 10 % of the device for them), and transient forward temporaries.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from ray_ppu.config.schema import RunConfig
from ray_ppu.devices.specs import SPECS
from ray_ppu.plan import lora, vision
from ray_ppu.plan.arithmetic import (expert_parameters_per_device, stage_parameters,
                                     trainable_stage_parameters)
from ray_ppu.plan.kernels import Kernels, chunk_tokens, planned

GIB = 1024 ** 3
SNAPSHOT_COPIES = 5  # 2 kept + 2 replicas (ray_ppu.recovery.snapshot_keeper.KEEP) + 1 in flight
HEADROOM = 0.9  # share of device memory the plan may fill


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes on one device of the most loaded pipeline stage, in GiB."""

    accelerator: str
    device_memory_gib: float
    stage: str  # "only" (PP 1), "first" or "last"
    parameters_gib: float
    gradients_gib: float
    optimizer_gib: float
    optimizer_host_gib: float  # offloaded optimizer states, per device, on its host
    optimizer_offload_fraction: float
    activations_per_microbatch_gib: float
    microbatches_in_flight: int
    recompute_unit_gib: float  # full recompute: one unit's activations rebuilt in backward
    activations_gib: float
    total_gib: float
    fits: bool  # total ≤ 90 % of the device
    snapshot_gib: float = 0.0
    """One in-memory snapshot of this device's state (weights, main parameters, Adam)."""
    snapshot_host_gib: float = 0.0
    """Host memory the snapshots of this device take on the nodes: the keepers hold the newest
    2 per rank and a replica of each on another node, plus the copy in flight (× 5; × 3 on
    one node). Per node: this × the node's PPUs."""
    trainable_parameters: int = 0
    """Parameters on this device that train (every one, but for LoRA: adapters and the base
    parts lora.trainable names): only these have gradients and optimizer state."""
    frozen_parameters: int = 0
    """Parameters on this device that stay fixed (LoRA's base)."""
    trainable_parameters_gib: float = 0.0
    frozen_parameters_gib: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _element_bytes(cfg: RunConfig) -> int:
    return 4 if cfg.training.precision == "fp32" else 2


def layer_activation_bytes(cfg: RunConfig, plan, kernels: Kernels) -> dict[str, float]:
    """Bytes one transformer layer keeps for its backward, per microbatch on one device.

    ``stored``: without recompute (selective: core attention's internals dropped, its q/k/v
    inputs kept); ``input``: the layer input alone (what full recompute keeps). s is this
    device's sequence share (CP), TP divides the projections, SP also the norm inputs.
    ``kernels``: the run's (:mod:`ray_ppu.plan.kernels`): TE's layers, or the local spec with
    torch's SDPA or Megatron-Core's reference attention.
    """
    te = kernels.attention == "te"
    m, mem = cfg.model, cfg.memory
    e = _element_bytes(cfg)
    s = plan.seq_length / plan.context_parallel_size
    b, h, f, t = plan.micro_batch_size, m.hidden_size, m.ffn_hidden_size, plan.tensor_model_parallel_size
    q = m.effective_kv_channels * m.num_attention_heads
    k = m.effective_kv_channels * m.num_query_groups
    heads = m.num_attention_heads / t
    norm_div = t if plan.sequence_parallel else 1
    per_token = s * b / t * e  # bytes of one TP-split activation column, per microbatch
    # input norm's input, QKV GEMM's input, MLP norm's input, FC1's input: s·b·h each; torch's
    # RMSNorm (no TE) also keeps its normalized output for the weight's gradient
    norms_and_gemm_inputs = (4 if te else 6) * s * b * h / norm_div * e
    # the output projection's input (q); SwiGLU keeps FC1's output (gate and up, 2f),
    # silu(gate) (f) and the product FC2 reads (f)
    projections = (q + 4 * f) * per_token
    if m.is_moe:
        projections = q * per_token + _routed_mlp_bytes(cfg, plan, s * b / norm_div)
    # core attention's inputs: q and k after RoPE, and v, a view of the QKV GEMM's output
    # (whose whole storage stays): 2q + 3k; with selective recompute that is all it keeps
    if mem.recompute == "selective":
        attention = (2 * q + 3 * k) * per_token
    elif te:  # fused / flash attention also keeps the softmax statistics (fp32 per head)
        attention = (2 * q + 3 * k) * per_token + s * b * heads * 4
    elif kernels.attention == "sdpa":
        # the same, plus its output: SDPA returns [b, heads, s, d], which the [s, b, h] layout
        # the output projection reads is a copy of unless b = 1 (packed rows: one row)
        packed_or_one = kernels.packed == "thd" or b == 1
        attention = ((2 * q + 3 * k + (0 if packed_or_one else q)) * per_token
                     + s * b * heads * 4)
    else:
        # Megatron's local attention repeats k and v to every query head (GQA): q, k, v at q
        # each; and it keeps the fp32 softmax output (and its 16-bit cast) for the s² product
        attention = 3 * q * per_token + heads * s * s * b * (4 + (e if e < 4 else 0))
    stored = norms_and_gemm_inputs + projections + attention
    return {"stored": stored, "input": s * b * h / norm_div * e}


def _routed_mlp_bytes(cfg: RunConfig, plan, tokens: float) -> float:
    """What a MoE layer's MLP keeps for backward on one device, ``tokens`` being its sequence
    share: the all-to-all balances routed tokens over the EP ranks, so a device's experts see
    top-k copies of as many tokens as it sent, on average. Per routed token: the permuted
    input fc1 reads and the output before it is combined back (h each), and each expert's
    SwiGLU (4 F' / ETP, as the dense MLP's 4 f); per token the router's fp32 softmax and
    probabilities (2 × experts)."""
    m = cfg.model
    e = _element_bytes(cfg)
    ffn = m.effective_moe_ffn_hidden_size / plan.expert_tensor_parallel_size
    routed = tokens * m.moe_router_topk * (2 * m.hidden_size + 4 * ffn) * e
    return routed + tokens * 2 * m.num_moe_experts * 4


def _in_flight(plan) -> int:
    """Microbatch-chunks the first pipeline stage holds at once.

    1F1B: the first stage runs PP − 1 warm-up forwards before its first backward (PP in
    flight); interleaved: 2·(PP − 1) + (VP − 1)·PP warm-up chunk-forwards, plus the one in
    steady state. Without pipelining microbatches run one after the other.
    """
    pp, vp, m = (plan.pipeline_model_parallel_size,
                 plan.virtual_pipeline_model_parallel_size or 1, plan.num_microbatches)
    if pp == 1:
        return 1
    if vp == 1:
        return min(pp, m)
    return min(m * vp, 2 * (pp - 1) + (vp - 1) * pp + 1)


def _activation_bytes(cfg: RunConfig, plan, kernels: Kernels,
                      stage: str) -> tuple[float, int, float]:
    """(stored bytes per microbatch-chunk, chunks in flight, recompute-unit bytes) of a stage."""
    m, mem = cfg.model, cfg.memory
    layer = layer_activation_bytes(cfg, plan, kernels)
    chunks = plan.virtual_pipeline_model_parallel_size or 1
    layers = m.num_layers // plan.pipeline_model_parallel_size // chunks  # per model chunk
    unit = 0.0
    if mem.recompute == "full":
        n = min(mem.recompute_num_layers, layers)
        if mem.recompute_method == "uniform":
            per_chunk = layer["input"] * math.ceil(layers / n)
        else:  # block: the first n layers of a chunk keep their input only
            per_chunk = layer["input"] * n + layer["stored"] * (layers - n)
        unit = layer["stored"] * n
    else:
        per_chunk = layer["stored"] * layers
    in_flight = _in_flight(plan) if stage in ("first", "only") else 1
    if stage in ("first", "only"):  # a vision-language model's ViT and projector
        per_chunk += vision.activation_bytes(cfg, plan.micro_batch_size,
                                             plan.tensor_model_parallel_size, _element_bytes(cfg),
                                             kernels.attention)
    if stage in ("last", "only"):
        per_chunk += _loss_bytes(cfg, plan, kernels, layer["input"])
    return per_chunk, in_flight, unit


def _loss_bytes(cfg: RunConfig, plan, kernels: Kernels, layer_input: float) -> float:
    """The last stage's output side: the final norm's input (and, torch's RMSNorm, its
    normalised output), and what the loss keeps. Megatron's keeps the output layer's input and
    the softmax of the microbatch's logits (fp32, over V'/TP); the chunked one the output
    layer's input (the whole sequence: gathered under SP) and one fp32 log-sum-exp per token,
    plus the softmax when the microbatch fits in one chunk (then it is not recomputed)."""
    s = plan.seq_length / plan.context_parallel_size
    tokens = s * plan.micro_batch_size
    norm = layer_input * (1 if kernels.attention == "te" else 2)
    logits = tokens * plan.padded_vocab_size / plan.tensor_model_parallel_size * 4  # fp32
    if kernels.loss == "chunked":
        e, h = _element_bytes(cfg), cfg.model.hidden_size
        vocab = plan.padded_vocab_size // plan.tensor_model_parallel_size
        # a microbatch within one chunk keeps its softmax instead of recomputing it; over
        # several, the backward pass sums the output weight's gradient in fp32 (plus one
        # chunk's product and the final cast) while every activation is still held
        single = tokens <= chunk_tokens(vocab, cfg.training.cross_entropy_chunk_tokens)
        return norm + tokens * h * e + tokens * 4 + (logits if single else 0.0)
    return norm + layer_input + logits


def loss_backward_bytes(cfg: RunConfig, plan, kernels: Kernels) -> float:
    """What the chunked loss's backward pass holds besides the activations, when the
    microbatch spans several chunks and the output weight trains: its gradient summed in fp32,
    one chunk's product and the final cast (V'/TP × h × (4 + 2e)), while every activation of
    the stage is still held. Megatron's loss holds the logits' gradient then instead, counted
    in its activations."""
    if kernels.loss != "chunked":
        return 0.0
    e, h = _element_bytes(cfg), cfg.model.hidden_size
    vocab = plan.padded_vocab_size // plan.tensor_model_parallel_size
    tokens = plan.seq_length / plan.context_parallel_size * plan.micro_batch_size
    lora = cfg.lora
    trains = not lora.enabled or bool({"output_layer", "embedding"} & set(lora.trainable))
    if tokens <= chunk_tokens(vocab, cfg.training.cross_entropy_chunk_tokens) or not trains:
        return 0.0
    return vocab * h * (4 + 2 * e)


def memory_plan(cfg: RunConfig, plan, kernels: Optional[Kernels] = None,
                offload: Optional[float] = None) -> MemoryPlan:
    """The memory plan of the most loaded device. ``kernels``: what the layers run (default:
    what the target devices would use, :func:`ray_ppu.plan.kernels.planned`); ``offload``:
    the host share of the optimizer states (default: as configured, ``auto`` computed by
    :func:`offload_fraction`)."""

    t, mem = cfg.training, cfg.memory
    if kernels is None:
        kernels = planned(cfg)
    spec = SPECS[cfg.cluster.accelerator]
    device_gib = mem.device_memory_gib or spec.memory_gib
    if offload is None:
        offload = {"none": 0.0, "static": mem.optimizer_offload_fraction}.get(
            mem.optimizer_offload)
        if offload is None:  # auto
            offload = offload_fraction(cfg, plan)
    pp, ep, etp = (plan.pipeline_model_parallel_size, plan.expert_model_parallel_size,
                   plan.expert_tensor_parallel_size)
    tp = plan.tensor_model_parallel_size
    _, first, last = stage_parameters(cfg, tp, pp, plan.padded_vocab_size, ep, etp)
    experts = expert_parameters_per_device(cfg, pp, ep, etp)
    stages = {"only": first} if pp == 1 else {"first": first, "last": last}
    # gradients and optimizer state for what trains only (LoRA, vision.freeze)
    _, tfirst, tlast = trainable_stage_parameters(cfg, tp, pp, plan.padded_vocab_size, ep, etp)
    trains = {"only": tfirst, "first": tfirst, "last": tlast}
    if cfg.lora.enabled:
        experts = lora.expert_adapter_parameters_per_device(cfg, pp, ep, etp)
    param_bytes = _element_bytes(cfg)
    optimizer_per_param = 8 + (4 if t.precision != "fp32" else 0)
    distributed = t.use_distributed_optimizer
    shards = plan.data_parallel_size * plan.context_parallel_size if distributed else 1
    expert_shards = plan.expert_data_parallel_size if distributed else 1
    best = None
    for stage, params in stages.items():
        per_chunk, in_flight, unit = _activation_bytes(cfg, plan, kernels, stage)
        trainable = trains[stage]
        optimizer = ((trainable - experts) / shards + experts / expert_shards) * optimizer_per_param
        snapshot = trainable * param_bytes + optimizer  # weights + main copies and Adam's shard
        activations = per_chunk * in_flight + unit
        if stage in ("last", "only"):  # transient, at the activations' peak
            activations += loss_backward_bytes(cfg, plan, kernels)
        total = params * param_bytes + trainable * 4 + optimizer * (1 - offload) + activations
        candidate = MemoryPlan(
            accelerator=cfg.cluster.accelerator,
            device_memory_gib=device_gib,
            stage=stage,
            parameters_gib=params * param_bytes / GIB,
            gradients_gib=trainable * 4 / GIB,
            optimizer_gib=optimizer * (1 - offload) / GIB,
            optimizer_host_gib=optimizer * offload / GIB,
            optimizer_offload_fraction=offload,
            activations_per_microbatch_gib=per_chunk / GIB,
            microbatches_in_flight=in_flight,
            recompute_unit_gib=unit / GIB,
            activations_gib=activations / GIB,
            total_gib=total / GIB,
            fits=total / GIB <= HEADROOM * device_gib,
            snapshot_gib=snapshot / GIB,
            snapshot_host_gib=snapshot * SNAPSHOT_COPIES / GIB,
            trainable_parameters=trainable,
            frozen_parameters=params - trainable,
            trainable_parameters_gib=trainable * param_bytes / GIB,
            frozen_parameters_gib=(params - trainable) * param_bytes / GIB,
        )
        if best is None or candidate.total_gib > best.total_gib:
            best = candidate
    return best


def offload_fraction(cfg: RunConfig, plan) -> Optional[float]:
    """``memory.optimizer_offload=auto``: the smallest share of the optimizer states on the
    host that brings the memory plan within 90 % of the device (1.0 if even that is not
    enough); None for the other modes (static takes the configured fraction)."""
    if cfg.memory.optimizer_offload != "auto":
        return None
    on_device = memory_plan(cfg, plan, offload=0.0)
    excess = on_device.total_gib - HEADROOM * on_device.device_memory_gib
    if excess <= 0 or on_device.optimizer_gib == 0:
        return 0.0
    return min(1.0, math.ceil(100 * excess / on_device.optimizer_gib) / 100)
