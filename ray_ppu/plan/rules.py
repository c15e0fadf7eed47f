"""Every rule a config must meet against itself, before any worker starts.

Types are checked when the config loads (:mod:`ray_ppu.config.loader`) and the cluster by the
preflight (:mod:`ray_ppu.launch.preflight`); every rule between fields lives here, one function per
area, each returning its problems as lines naming the numbers at fault. :func:`problems`
collects them all, so a user fixes a config in one pass, not one error at a time.
"""

from __future__ import annotations

from typing import Optional

from ray_ppu.config.schema import RunConfig
from ray_ppu.errors import ConfigError
from ray_ppu.plan import lora
from ray_ppu.plan.derived import (TOKEN_FORMS, expert_sizes, layers_per_chunk,
                                  schedule_iterations, tokens_per_iteration)
from ray_ppu.plan.layout import ParallelDims, active_workers
from ray_ppu.plan.sizes import size_problems
from ray_ppu.plan.te_options import needs_transformer_engine


def problems(cfg: RunConfig, forward_only: bool = False, files: bool = True) -> list[str]:
    """All of the config's problems, in the order a reader meets the fields (``forward_only``:
    a model for forward passes, conversion or generation, that never trains; ``files=False``:
    a plan made where the files are not, which need not name its data or tokenizer). A size out of
    its bound (:mod:`ray_ppu.plan.sizes`) skips the rules that compute with the sizes: their
    arithmetic on a zero or negative number would only add noise."""
    sizes = size_problems(cfg)
    if sizes:
        return sizes + run_problems(cfg) + checkpoint_problems(cfg) + lora.problems(cfg, forward_only)
    found = (layout_problems(cfg) + model_problems(cfg) + moe_problems(cfg, forward_only)
             + _option_problems(cfg, layers_per_chunk(cfg)) + batch_problems(cfg))
    # Megatron's scheduler asserts warmup < decay: worth saying only of an otherwise sound config
    found += schedule_problems(cfg, check_warmup=not found)
    return (found + run_problems(cfg) + checkpoint_problems(cfg)
            + lora.problems(cfg, forward_only) + vision_problems(cfg, forward_only)
            + _data_problems(cfg, files))


def vision_problems(cfg: RunConfig, forward_only: bool = False) -> list[str]:
    """A vision-language model: its own section's rules, a dense language model, no context
    parallelism (images are written into whole sequences), image data (SFT records)."""
    v, p = cfg.vision, cfg.parallel
    if not v.enabled:
        return []
    found = v.problems(p.tensor_model_parallel_size)
    if cfg.model.is_moe:
        found.append("vision.encoder with a MoE language model: vision-language models take "
                     "a dense language preset (Qwen2.5, Qwen3, LLaMA-3.x)")
    if p.context_parallel_size > 1:
        found.append(f"vision.encoder with CP {p.context_parallel_size}: images are written into "
                     f"whole sequences; use CP 1")
    if not 0 <= v.image_token_id < cfg.model.vocab_size:
        found.append(f"vision.image_token_id={v.image_token_id} is outside the vocabulary "
                     f"(model.vocab_size={cfg.model.vocab_size})")
    if not forward_only and cfg.data.dataset != "sft":
        found.append("vision.encoder trains on image-text records: set data.dataset=sft")
    if not forward_only and set(v.freeze) >= {"vision", "projector", "language"} \
            and not cfg.lora.enabled:
        found.append("vision.freeze names every component and LoRA is off: nothing would train")
    elif not forward_only and "language" in v.freeze and not cfg.lora.enabled \
            and p.pipeline_model_parallel_size > 1:
        # Megatron's distributed optimizer cannot save the state of a rank that has no
        # parameter to train (its state has no step)
        found.append(f"vision.freeze={v.freeze} with PP {p.pipeline_model_parallel_size}: "
                     f"pipeline stages 2…{p.pipeline_model_parallel_size} hold only the frozen "
                     f"language model and would train nothing; use PP 1 (TP / DP for the "
                     f"memory) or LoRA")
    return found


def dims_or_none(cfg: RunConfig) -> Optional[ParallelDims]:
    """The full group's layout; None when it is not whole replicas (:func:`layout_problems`)."""
    p = cfg.parallel
    try:
        return ParallelDims(cfg.cluster.num_workers, p.tensor_model_parallel_size,
                            p.pipeline_model_parallel_size, p.context_parallel_size,
                            *expert_sizes(cfg))
    except ConfigError:
        return None


def layout_problems(cfg: RunConfig) -> list[str]:
    """The full group is whole replicas; an elastic minimum holds at least one."""
    p, t, c = cfg.parallel, cfg.training, cfg.cluster
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    ep, etp = expert_sizes(cfg)
    found = []
    try:  # the full group must be whole replicas; an elastic one may have spares (plan_for_world)
        ParallelDims(c.num_workers, tp, pp, cp, ep, etp)
    except ConfigError as err:
        found.append(str(err))
    if c.min_workers is not None:
        if c.min_workers > c.num_workers:
            found.append(f"cluster.min_workers {c.min_workers} must be at most "
                         f"num_workers {c.num_workers}")
        elif not active_workers(c.min_workers, tp, pp, cp, t.global_batch_size,
                                t.micro_batch_size, ep * etp):
            experts = f" with stages of whole EP {ep} × ETP {etp} groups" if ep * etp > 1 else ""
            found.append(f"cluster.min_workers {c.min_workers} cannot hold one model replica: "
                         f"TP {tp} × PP {pp} × CP {cp} = {max(1, tp * pp * cp)} workers whose DP "
                         f"size divides global_batch_size {t.global_batch_size} by "
                         f"micro_batch_size {t.micro_batch_size}{experts}")
    return found


def model_problems(cfg: RunConfig) -> list[str]:
    """Heads and KV groups split by TP, layers by PP (× virtual stages when interleaved); the
    head width derived from the hidden size or given (kv_channels)."""
    m, p = cfg.model, cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    found = []
    if m.num_attention_heads % tp:
        found.append(f"num_attention_heads {m.num_attention_heads} is not divisible by TP {tp}")
    if m.num_query_groups % tp:
        found.append(f"num_query_groups {m.num_query_groups} is not divisible by TP {tp}")
    if m.num_attention_heads % m.num_query_groups:
        found.append(f"num_attention_heads {m.num_attention_heads} is not divisible by "
                     f"num_query_groups {m.num_query_groups}")
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        # only where the head width is derived from it: an explicit kv_channels (Qwen3's
        # head_dim) sets the projections' widths apart from the hidden size
        found.append(f"hidden_size {m.hidden_size} is not divisible by "
                     f"num_attention_heads {m.num_attention_heads}")
    if m.kv_channels is not None and m.kv_channels % 2:
        found.append(f"kv_channels {m.kv_channels} must be an even number "
                     f"(RoPE rotates each head's channels in pairs)")
    if m.mrope_section is not None and (len(m.mrope_section) != 3 or
                                        2 * sum(m.mrope_section) != m.effective_kv_channels):
        found.append(f"mrope_section {list(m.mrope_section)} must be three numbers summing to "
                     f"kv_channels / 2 = {m.effective_kv_channels // 2}")
    if m.num_layers % pp:
        found.append(f"num_layers {m.num_layers} is not divisible by PP {pp}")
    per_vstage = p.num_layers_per_virtual_pipeline_stage
    if per_vstage is not None:
        if pp < 2:
            found.append(f"num_layers_per_virtual_pipeline_stage {per_vstage} needs PP > 1, got PP {pp}")
        elif m.num_layers % (pp * per_vstage):
            found.append(f"num_layers {m.num_layers} is not divisible by PP {pp} × "
                         f"num_layers_per_virtual_pipeline_stage {per_vstage} = {pp * per_vstage}")
    return found


def moe_problems(cfg: RunConfig, forward_only: bool = False) -> list[str]:
    """Experts split whole by EP and their MLPs by ETP; routing Megatron-Core can build; the
    expert-parallel settings only on a MoE model; sequence parallelism where it trains at TP > 1."""
    m, p = cfg.model, cfg.parallel
    if not m.is_moe:
        set_ = [f"parallel.{k}={getattr(p, k)}" for k, unset in
                (("expert_model_parallel_size", 1), ("expert_tensor_parallel_size", None))
                if getattr(p, k) != unset]
        return [f"{', '.join(set_)} needs a MoE model (model.num_moe_experts)"] if set_ else []
    ep, etp = expert_sizes(cfg)
    experts, topk, ffn = m.num_moe_experts, m.moe_router_topk, m.effective_moe_ffn_hidden_size
    found = []
    if experts % ep:
        found.append(f"model.num_moe_experts {experts} is not divisible by EP {ep} (each EP "
                     f"rank holds whole experts)")
    if not 1 <= topk <= max(experts, 1):
        found.append(f"model.moe_router_topk {topk} must be between 1 and num_moe_experts "
                     f"{experts}")
    elif topk == 1 and m.moe_norm_topk_prob:
        # Megatron-Core refuses softmax over a single logit (every weight would be 1)
        found.append("model.moe_router_topk 1 needs model.moe_norm_topk_prob=false (renormalised "
                     "over one expert, every routing weight would be 1)")
    if ffn % etp:
        found.append(f"model.moe_ffn_hidden_size {ffn} is not divisible by ETP {etp}")
    if p.tensor_model_parallel_size > 1 and not p.sequence_parallel and not forward_only:
        found.append(f"a MoE model at TP {p.tensor_model_parallel_size} needs "
                     f"parallel.sequence_parallel=true (Megatron-Core's MoE layer trains only so)")
    return found


def batch_problems(cfg: RunConfig) -> list[str]:
    """Global batch = micro batch × DP × microbatches; the sequence fits the position table."""
    t, m = cfg.training, cfg.model
    found = []
    dims = dims_or_none(cfg)
    if dims is not None:
        per_step = t.micro_batch_size * dims.dp
        if t.global_batch_size % per_step:
            found.append(f"global_batch_size {t.global_batch_size} is not divisible by "
                         f"micro_batch_size {t.micro_batch_size} × DP {dims.dp} = {per_step}")
    if t.seq_length > m.max_position_embeddings:
        found.append(f"seq_length {t.seq_length} exceeds max_position_embeddings "
                     f"{m.max_position_embeddings}")
    return found


def schedule_problems(cfg: RunConfig, check_warmup: bool = True) -> list[str]:
    """A training length of at least one iteration; warmup below decay. Each message names the
    form of a length the user wrote (``lr_warmup_tokens``, not the iterations it became)."""
    t = cfg.training
    train, warmup, decay = schedule_iterations(cfg)
    found = []
    if t.train_tokens is None and t.train_iters is None:
        found.append("set training.train_tokens (pretraining) or training.train_iters")
    elif train < 1:
        found.append(f"training length is {train} iterations (train_tokens {t.train_tokens} < "
                     f"global_batch_size × seq_length = {tokens_per_iteration(cfg)}?)")
    if check_warmup and not found and warmup >= decay:
        per = tokens_per_iteration(cfg)
        said = (f"lr_warmup_tokens {t.lr_warmup_tokens:,} (= {warmup} iterations of {per:,} "
                f"tokens)" if t.lr_warmup_tokens is not None else f"lr_warmup_iters {warmup}")
        if t.lr_decay_tokens is not None:
            length = f"lr_decay_tokens {t.lr_decay_tokens:,} (= {decay} iterations)"
        elif t.lr_decay_iters is not None:
            length = f"lr_decay_iters {decay}"
        elif cfg.data.dataset == "sft":
            length = f"the {decay} iterations of decay (train_iters − warmup for SFT)"
        else:
            length = f"the {decay} iterations of decay (the training length)"
        found.append(f"{said} must be below {length}: the schedule warms up, then decays; "
                     f"lower the warmup or train longer")
    return found


def run_problems(cfg: RunConfig) -> list[str]:
    """Settings of the run around the model: the LR floor."""
    t = cfg.training
    found = []
    if t.min_lr > t.lr:  # Megatron's scheduler asserts max_lr >= min_lr
        found.append(f"min_lr {t.min_lr:g} is above lr {t.lr:g}: the schedule decays to min_lr")
    return found


def checkpoint_problems(cfg: RunConfig) -> list[str]:
    """Save and snapshot intervals, kept checkpoints, and one source of starting weights."""
    c = cfg.checkpoint
    found = []
    if c.finetune and not c.load:
        found.append("checkpoint.finetune=true needs checkpoint.load (the weights to start from)")
    if c.pretrained and c.load:
        found.append(f"checkpoint.pretrained={c.pretrained} and checkpoint.load={c.load}: set "
                     f"one (the weights a fresh run starts from)")
    return found


def _option_problems(cfg: RunConfig, layers_per_chunk: Optional[int]) -> list[str]:
    """Precision, recompute and offload switches that cannot go together, or need Transformer
    Engine where the run cannot have it (``cluster.device=cpu``)."""

    mem, t, p = cfg.memory, cfg.training, cfg.parallel
    problems = []
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        problems.append("parallel.sequence_parallel needs TP > 1 (it shards activations inside "
                        "the TP group), got TP 1")
    if mem.recompute == "full":
        n = mem.recompute_num_layers
        if layers_per_chunk and mem.recompute_method == "uniform" and layers_per_chunk % n:
            problems.append(f"memory.recompute_num_layers {n} does not divide the "
                            f"{layers_per_chunk} layers of a model chunk (num_layers per "
                            f"pipeline stage, and per virtual stage when interleaved)")
        elif layers_per_chunk and n > layers_per_chunk:
            problems.append(f"memory.recompute_num_layers {n} exceeds the {layers_per_chunk} "
                            f"layers of a model chunk")
    offload = mem.activation_offload_layers
    if offload:
        if mem.recompute != "none":
            problems.append(f"memory.activation_offload_layers {offload} with memory.recompute="
                            f"{mem.recompute}: Megatron-Core offloads or recomputes, not both")
        if p.pipeline_model_parallel_size > 1:
            problems.append(f"memory.activation_offload_layers {offload} needs PP 1 (Megatron-Core "
                            f"has no offload with pipelining), got PP {p.pipeline_model_parallel_size}")
        if not 0 < offload < cfg.model.num_layers:
            problems.append(f"memory.activation_offload_layers {offload} must be between 1 and "
                            f"num_layers {cfg.model.num_layers} − 1")
    if mem.optimizer_offload != "none" and not t.use_distributed_optimizer:
        problems.append(f"memory.optimizer_offload={mem.optimizer_offload} needs the distributed "
                        f"optimizer, but training.use_distributed_optimizer is false")
    if not 0.0 <= mem.optimizer_offload_fraction <= 1.0:
        problems.append(f"memory.optimizer_offload_fraction {mem.optimizer_offload_fraction} "
                        f"must be between 0 and 1")
    if cfg.cluster.device == "cpu":
        problems += [f"{need} needs Transformer Engine, which cluster.device=cpu does not have"
                     for need in needs_transformer_engine(cfg)]
    elif p.context_parallel_size > 1 and t.attention_backend in ("sdpa", "local"):
        problems.append(f"parallel.context_parallel_size={p.context_parallel_size} needs "
                        f"Transformer Engine's attention; training.attention_backend="
                        f"{t.attention_backend} has no context parallelism (use auto or a TE "
                        f"backend)")
    return problems


def _data_problems(cfg: RunConfig, files: bool = True) -> list[str]:
    """Blend syntax, split syntax, and a validation source when validation is asked for
    (``files=False``: only what is given is checked; nothing need be named)."""
    from ray_ppu.data.idxmap import BlendError, parse_blend

    d, t = cfg.data, cfg.training
    if d.dataset == "sft":
        return _sft_problems(cfg, files)
    problems = []
    for key, value in (("data.data_path", d.data_path), ("data.valid_data_path", d.valid_data_path)):
        if value or (key == "data.data_path" and files):
            try:
                parse_blend(value, key)
            except BlendError as err:
                problems.append(str(err))
    try:
        shares = [float(x) for x in d.split.replace("/", ",").split(",")]
        if len(shares) > 3 or any(x < 0 for x in shares) or sum(shares) <= 0:
            raise ValueError
    except ValueError:
        problems.append(f"data.split '{d.split}': expected up to three non-negative shares, "
                        f"e.g. 99,1,0")
        shares = [1.0]
    if t.eval_iters and not d.valid_data_path and (len(shares) < 2 or shares[1] == 0) and files:
        problems.append(f"eval_iters {t.eval_iters} asks for validation but split '{d.split}' "
                        f"gives it no documents: set data.valid_data_path, a validation share "
                        f"in data.split, or training.eval_iters=0")
    return problems


def _sft_problems(cfg: RunConfig, files: bool = True) -> list[str]:
    """SFT: JSON inputs, a tokenizer, a padding length that fits, validation data if asked
    (``files=False``: the inputs, tokenizer and validation data need not be named)."""
    d, t = cfg.data, cfg.training
    problems = []
    if not d.data_path and files:
        problems.append("data.data_path is empty: name the SFT training JSON files")
    if not d.tokenizer and files:
        problems.append("data.dataset=sft needs data.tokenizer (a Hugging Face tokenizer or "
                        "checkpoint directory with a chat template)")
    if d.max_padding_length is not None and not 0 < d.max_padding_length <= t.seq_length:
        problems.append(f"data.max_padding_length {d.max_padding_length} must be between 1 and "
                        f"seq_length {t.seq_length}")
    if d.packing and d.max_padding_length is not None:
        problems.append("data.max_padding_length applies to padded samples; with data.packing "
                        "rows are seq_length long (drop one of the two)")
    if t.eval_iters and not d.valid_data_path and files:
        problems.append(f"eval_iters {t.eval_iters} asks for validation: set "
                        f"data.valid_data_path (SFT has no split) or training.eval_iters=0")
    if not 0.0 <= d.max_dropped_share <= 1.0:
        problems.append(f"data.max_dropped_share {d.max_dropped_share:g} must be between 0 and 1")
    if d.packing and cfg.parallel.context_parallel_size > 1:
        problems.append(f"data.packing with CP {cfg.parallel.context_parallel_size}: packed rows "
                        f"are not split across context-parallel ranks; use CP 1")
    tokens = [f"training.{k}" for k in TOKEN_FORMS if getattr(t, k) is not None]
    if tokens:
        problems.append(f"SFT is scheduled in iterations (train_iters, lr_warmup_iters, "
                        f"lr_decay_iters), as the reference does; {', '.join(tokens)} "
                        f"{'is' if len(tokens) == 1 else 'are'} for pretraining")
    return problems
