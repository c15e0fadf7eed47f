"""LoRA in the plan: its rules, what trains and where, and the FLOPs a frozen base computes.

Config only, like the rest of the plan: ``--dry-run`` shows a LoRA run's trainable and frozen
parameters and its FLOPs on a laptop.

Sharding of one adapter (A [r, in], B [out, r]; W [out, in] is split by TP):

* on a column-parallel linear (``linear_qkv``, ``linear_fc1``: the output is split), B is
  split like W's rows and A is whole on every TP rank;
* on a row-parallel one (``linear_proj``, ``linear_fc2``: the input is split), A is split like
  W's columns and B is whole;
* an expert's adapters live with the expert (EP), split by ETP as the expert is.
"""

from __future__ import annotations

import difflib

from ray_ppu.config.lora import (ALL_LINEAR, COLUMN_TARGETS, DENSE_TARGETS, HF_TARGETS,
                                 MOE_TARGETS, TRAINABLE_PARTS, canonical_targets)
from ray_ppu.config.schema import RunConfig


def _close(name: str, known) -> str:
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def problems(cfg: RunConfig, forward_only: bool = False) -> list[str]:
    """The lora section against the model and the run, each problem one line (checked whether
    or not LoRA is on: a misspelt target is a mistake either way)."""
    lora, m = cfg.lora, cfg.model
    own = MOE_TARGETS if m.is_moe else DENSE_TARGETS
    found = []
    for name in lora.target_modules:
        if set(canonical_targets(name, m.is_moe)) <= set(own):
            continue
        if name in DENSE_TARGETS + MOE_TARGETS:
            why = (f"a MoE model has no dense MLP (each expert's is experts.{name})"
                   if m.is_moe else "the model has no experts (model.num_moe_experts is null)")
            found.append(f"lora.target_modules '{name}': {why}")
        else:
            known = (*own, *HF_TARGETS, *ALL_LINEAR)
            found.append(f"lora.target_modules: unknown module '{name}'{_close(name, known)}; "
                         f"this model's linears are {', '.join(own)} (or as Hugging Face "
                         f"names them: {', '.join(HF_TARGETS)}; all-linear)")
    targets = lora.targets(m.is_moe)
    for key, pattern, low in (("rank_pattern", lora.rank_pattern, "≥ 1"),
                              ("alpha_pattern", lora.alpha_pattern, "> 0")):
        for name, value in pattern.items():
            if not set(canonical_targets(name, m.is_moe)) & set(targets):
                found.append(f"lora.{key} names '{name}', which is not a target"
                             f"{_close(name, targets)} (targets: {', '.join(targets)})")
            elif value < 1 if key == "rank_pattern" else value <= 0:
                found.append(f"lora.{key}.{name}={value:g}: must be {low}")
    if not 0.0 <= lora.dropout < 1.0:
        found.append(f"lora.dropout={lora.dropout:g}: must be at least 0 and below 1")
    for part in lora.trainable:
        if part not in TRAINABLE_PARTS:
            found.append(f"lora.trainable: unknown part '{part}'{_close(part, TRAINABLE_PARTS)}; "
                         f"the parts are {', '.join(TRAINABLE_PARTS)}")
        elif part == "router" and not m.is_moe:
            found.append("lora.trainable 'router': the model has no experts to route to")
        elif part == "output_layer" and not m.untie_embeddings_and_output_weights:
            found.append("lora.trainable 'output_layer': this model's output layer is its input "
                         "embedding (tied): name 'embedding' to train it")
    if not lora.enabled:
        return found
    experts = [t for t in targets if t.startswith("experts.")]
    if experts:
        from ray_ppu.plan.derived import expert_sizes

        _, etp = expert_sizes(cfg)
        tp = cfg.parallel.tensor_model_parallel_size
        if etp not in (1, tp):
            found.append(f"LoRA on {', '.join(experts)} at ETP {etp}: adapters on experts need "
                         f"ETP 1 or ETP = TP ({tp}), where their replicated halves are counted "
                         f"once in the gradient norm")
    c = cfg.checkpoint
    if not forward_only and not (c.pretrained or c.load):
        found.append("lora.enabled needs a base model to adapt: checkpoint.pretrained (a Hugging "
                     "Face directory) or checkpoint.load (a ray_ppu checkpoint with every weight)")
    return found


def adapter_shapes(cfg: RunConfig) -> dict[str, tuple[int, int, int]]:
    """``{target: (in, out, rank)}`` of one layer's adapter on each target (for an expert
    target: one expert's)."""
    m, lora = cfg.model, cfg.lora
    h = m.hidden_size
    q = m.effective_kv_channels * m.num_attention_heads
    k = m.effective_kv_channels * m.num_query_groups
    f = m.effective_moe_ffn_hidden_size if m.is_moe else m.ffn_hidden_size
    dims = {"linear_qkv": (h, q + 2 * k), "linear_proj": (q, h),
            "linear_fc1": (h, 2 * f), "linear_fc2": (f, h),
            "experts.linear_fc1": (h, 2 * f), "experts.linear_fc2": (f, h)}
    return {t: (*dims[t], lora.rank_of(t)) for t in lora.targets(m.is_moe)}


def _adapter_counts(cfg: RunConfig, tp: int, ep: int, etp: int,
                    experts_only: bool = False) -> tuple[int, int]:
    """One layer's adapter parameters (``experts_only``: the experts'): (all of them, those
    one device holds)."""
    total = device = 0
    for target, (n_in, n_out, r) in adapter_shapes(cfg).items():
        if experts_only and not target.startswith("experts."):
            continue
        split = etp if target.startswith("experts.") else tp
        column = target in COLUMN_TARGETS
        whole = r * (n_in + n_out)
        mine = r * n_in + r * n_out // split if column else r * n_in // split + r * n_out
        if target.startswith("experts."):
            whole, mine = whole * cfg.model.num_moe_experts, mine * cfg.model.num_moe_experts // ep
        total, device = total + whole, device + mine
    return total, device


def expert_adapter_parameters_per_device(cfg: RunConfig, pp: int, ep: int, etp: int) -> int:
    """The adapters on experts one device of a stage holds (sharded by the distributed
    optimizer over expert-DP, as the experts are)."""
    tp = cfg.parallel.tensor_model_parallel_size
    return cfg.model.num_layers // pp * _adapter_counts(cfg, tp, ep, etp, experts_only=True)[1]


def _base_counts(cfg: RunConfig, tp: int, padded_vocab: int) -> dict[str, tuple[int, int]]:
    """Trainable base parts: ``{part: (parameters in all, on a device, or per layer)}``."""
    m = cfg.model
    h, V = m.hidden_size, padded_vocab
    norms = 2 * h + (2 * m.effective_kv_channels if m.qk_layernorm else 0)
    router = m.num_moe_experts * h if m.is_moe else 0
    return {"embedding": (V * h, V * h // tp), "output_layer": (V * h, V * h // tp),
            "norms": (norms, norms), "router": (router, router)}


def trainable_parameters(cfg: RunConfig, tp: int, pp: int, padded_vocab: int, ep: int = 1,
                         etp: int = 1) -> tuple[int, int, int]:
    """What trains: (in all, on one device of the first stage, of the last stage), as
    :func:`ray_ppu.plan.arithmetic.stage_parameters` counts the whole model. Adapters, plus
    the base parts ``lora.trainable`` names (the final norm and a tied output layer's copy on
    the last stage with the norms / embedding)."""
    m, lora = cfg.model, cfg.lora
    parts = set(lora.trainable)
    base = _base_counts(cfg, tp, padded_vocab)
    per_layer_total, per_layer_device = _adapter_counts(cfg, tp, ep, etp)
    for part in ("norms", "router"):
        if part in parts:
            per_layer_total += base[part][0]
            per_layer_device += base[part][1]
    total = m.num_layers * per_layer_total
    stage = m.num_layers // pp * per_layer_device
    first = last = stage
    tied = not m.untie_embeddings_and_output_weights
    if "embedding" in parts:
        total += base["embedding"][0]
        first += base["embedding"][1]
        if tied and pp > 1:
            last += base["embedding"][1]  # Megatron's copy of a tied embedding, kept in sync
    if "output_layer" in parts:
        total += base["output_layer"][0]
        last += base["output_layer"][1]
    if "norms" in parts:  # the final norm
        total += m.hidden_size
        last += m.hidden_size
    if pp == 1:
        first = last = first + last - stage
    return total, first, last


def _gemm(multiplies: int, grad_in: bool, trains: bool) -> int:
    """FLOPs of one GEMM for one token: 2 per multiply-add forward, 2 more for its input's
    gradient when a gradient flows into its input, 2 more for its weight's when it trains."""
    return 2 * multiplies * (1 + grad_in + trains)


def _adapter(n_in: int, n_out: int, r: int, grad_in: bool) -> int:
    """An adapter's FLOPs for one token: x·Aᵀ and z·Bᵀ forward, both weight gradients, z's
    gradient always (A trains), x's when a gradient flows into x."""
    return 2 * r * (n_in + n_out) + 2 * r * (n_in + n_out) + 2 * r * n_out + 2 * r * n_in * grad_in


def flops_per_iteration(cfg: RunConfig, padded_vocab: int) -> tuple[float, float]:
    """(FLOPs of one iteration, core attention FLOPs per sample ÷ its length²) of a LoRA run:
    what is computed, not Megatron-LM's 3 × forward.

    Per token and layer, each frozen GEMM of n multiply-adds costs 2n forward and 2n for its
    input's gradient (Megatron-Core runs no weight-gradient GEMM for a frozen weight), and only
    where a gradient flows into its input: nothing below the first adapter trains, so the
    first layer's QKV projection (unless the embedding or norms train) computes no input
    gradient. An adapter of rank r on an in → out linear costs 2r(in + out) forward, 2r(in +
    out) for A's and B's gradients, 2r·out for z = x·Aᵀ's gradient and 2r·in for x's. Core
    attention (QKᵀ and AV, causal: 2·q·s² per sample and layer forward) adds twice that
    backward where its q, k, v carry a gradient. The output layer: 2hV forward, 2hV for its
    input's gradient, 2hV more if it trains. Norms count nothing, as in Megatron-LM.
    """
    m, t, lora = cfg.model, cfg.training, cfg.lora
    h = m.hidden_size
    q = m.effective_kv_channels * m.num_attention_heads
    k = m.effective_kv_channels * m.num_query_groups
    trains = set(lora.trainable)
    adapters = adapter_shapes(cfg)
    moe = m.is_moe
    f = m.effective_moe_ffn_hidden_size if moe else m.ffn_hidden_size
    mlp_copies = m.moe_router_topk if moe else 1  # a token passes through top-k experts
    fc1, fc2 = ("experts.linear_fc1", "experts.linear_fc2") if moe else ("linear_fc1", "linear_fc2")

    def linear(target: str, n_in: int, n_out: int, grad_in: bool) -> tuple[int, bool]:
        """(FLOPs, whether its output carries a gradient)."""
        flops = _gemm(n_in * n_out, grad_in, False)
        if target in adapters:
            flops += _adapter(n_in, n_out, adapters[target][2], grad_in)
        return flops, grad_in or target in adapters

    per_token, attention = 0, 0.0
    # whether the residual stream carries a gradient so far (full recompute: always, see
    # ray_ppu.model.lora.keep_gradients_through_recompute)
    flows = "embedding" in trains or cfg.memory.recompute == "full"
    for _ in range(m.num_layers):
        into = flows or "norms" in trains
        flops, qkv_out = linear("linear_qkv", h, q + 2 * k, into)
        per_token += flops
        attention += 2 * q * (1 + 2 * qkv_out)  # × s² per sample (causal: half of 4·q·s²)
        flops, out = linear("linear_proj", q, h, qkv_out)
        per_token += flops
        flows = flows or out
        into = flows or "norms" in trains
        if moe:
            per_token += _gemm(m.num_moe_experts * h, into, "router" in trains)
        flops, hidden = linear(fc1, h, 2 * f, into)
        flops2, out = linear(fc2, f, h, hidden)
        per_token += (flops + flops2) * mlp_copies
        flows = flows or out
    output_trains = "output_layer" in trains or (
        "embedding" in trains and not m.untie_embeddings_and_output_weights)
    per_token += _gemm(h * padded_vocab, flows, output_trains)
    tokens = t.global_batch_size * t.seq_length
    return (float(tokens * per_token + t.global_batch_size * t.seq_length ** 2 * attention),
            attention)
