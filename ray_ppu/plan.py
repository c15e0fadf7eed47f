"""Derived numbers of a run: parallel layout, batch arithmetic, schedule length, FLOPs, size.

Everything here is pure arithmetic on the RunConfig (no Ray, no torch), so ``--dry-run`` can
print it on a laptop and the launcher can reject a bad run before placing any worker. Field
names are Megatron-Core's (``num_microbatches``, ``train_iters``, ``lr_warmup_iters``, ...).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Iterator, Optional

from ray_ppu.errors import ConfigError
from ray_ppu.config.schema import RunConfig
from ray_ppu.te_options import needs_transformer_engine


@dataclass(frozen=True)
class ParallelDims:
    """World size cut into TP × CP × DP × PP, in Megatron's default rank order tp-cp-ep-dp-pp."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        model_parallel = self.tp * self.pp * self.cp
        if self.world_size % model_parallel:
            raise ConfigError(
                f"world size {self.world_size} is not divisible by "
                f"TP {self.tp} × PP {self.pp} × CP {self.cp} = {model_parallel}"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """(tp, cp, dp, pp) ranks of a global rank; tp varies fastest, pp slowest."""
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp}

    def data_ranks(self) -> Iterator[tuple[int, int]]:
        """(global rank, dp rank) of every rank that reads data.

        As in Megatron: the first TP rank of the first pipeline stage (tokens, positions) and of
        the last stage (labels, loss mask), for every DP and CP rank; it broadcasts the batch to
        the rest of its TP group. Middle pipeline stages read nothing.
        """
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            if c["tp"] == 0 and c["pp"] in (0, self.pp - 1):
                yield rank, c["dp"]


@dataclass(frozen=True)
class Plan:
    """The numbers a run is built from, printed by ``--dry-run``."""

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    data_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None
    sequence_parallel: bool
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    seq_length: int
    train_iters: int
    lr_warmup_iters: int
    lr_decay_iters: int
    train_samples: int
    train_tokens: int
    eval_interval: int
    eval_iters: int
    valid_samples: int
    packed_sequences: bool
    padded_vocab_size: int
    kv_channels: int
    num_parameters: int
    num_parameters_per_device: int
    flops_per_iteration: float
    # core attention FLOPs of one sample = this × its length² (causal, Megatron-LM's count):
    # packed rows count their samples' lengths instead of seq_length
    attention_flops_coefficient: float = 0.0
    warnings: tuple[str, ...] = ()
    spare_workers: int = 0  # workers in the Ray group beyond world_size, outside Megatron's groups

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(
            self.world_size,
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def flops_per_iteration(cfg: RunConfig, padded_vocab_size: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` for a dense GQA model with SwiGLU.

    Forward + backward = 3 × forward, 2 FLOPs per multiply-add, hence the 6s. Core attention
    counts QKᵀ and AV, halved for the causal mask: 6·s²·q per layer and sample.
    """
    m, t = cfg.model, cfg.training
    h, L, s, B = m.hidden_size, m.num_layers, t.seq_length, t.global_batch_size
    q = m.kv_channels * m.num_attention_heads
    k = m.kv_channels * m.num_query_groups
    f = m.ffn_hidden_size
    per_layer = 6 * h * (q + 2 * k) + 6 * q * h + 6 * h * f * 3  # QKV, proj, SwiGLU (3 mats)
    return B * s * (L * per_layer + 6 * h * padded_vocab_size) + B * s * s * attention_flops_coefficient(cfg)


def attention_flops_coefficient(cfg: RunConfig) -> float:
    """Core attention FLOPs per sample ÷ its length²: 6·L·q (QKᵀ and AV, halved by the causal
    mask, times 3 for forward + backward)."""
    m = cfg.model
    return 6.0 * m.num_layers * m.kv_channels * m.num_attention_heads


def stage_parameters(cfg: RunConfig, tp: int, pp: int, padded_vocab: int) -> tuple[int, int, int]:
    """Total parameters, and those one device of the first and of the last pipeline stage
    holds (TP splits the matrices, PP the layers; with PP 1 both are the one stage)."""
    m = cfg.model
    h, f = m.hidden_size, m.ffn_hidden_size
    q = m.kv_channels * m.num_attention_heads
    k = m.kv_channels * m.num_query_groups
    qkv_bias = (q + 2 * k) if m.add_qkv_bias else 0
    layer_split = h * (q + 2 * k) + qkv_bias + q * h + 3 * h * f  # divided by TP
    layer_replicated = 2 * h  # the two RMSNorms
    embedding = padded_vocab * h
    output = embedding if m.untie_embeddings_and_output_weights else 0
    total = m.num_layers * (layer_split + layer_replicated) + embedding + output + h
    stage = (m.num_layers // pp) * (layer_split // tp + layer_replicated)
    if pp == 1:
        only = stage + embedding // tp + h + output // tp
        return total, only, only
    first = stage + embedding // tp
    # The last stage holds the final norm and the output layer; with tied embeddings and PP > 1
    # Megatron keeps a copy of the embedding there too.
    last = stage + h + embedding // tp
    return total, first, last


def _sft_problems(cfg: RunConfig) -> list[str]:
    """SFT: JSON inputs, a tokenizer, a padding length that fits, validation data if asked."""
    d, t = cfg.data, cfg.training
    problems = []
    if not d.data_path:
        problems.append("data.data_path is empty: name the SFT training JSON files")
    if not d.tokenizer:
        problems.append("data.dataset=sft needs data.tokenizer (a Hugging Face tokenizer or "
                        "checkpoint directory with a chat template)")
    if d.max_padding_length is not None and not 0 < d.max_padding_length <= t.seq_length:
        problems.append(f"data.max_padding_length {d.max_padding_length} must be between 1 and "
                        f"seq_length {t.seq_length}")
    if d.packing and d.max_padding_length is not None:
        problems.append("data.max_padding_length applies to padded samples; with data.packing "
                        "rows are seq_length long (drop one of the two)")
    if t.eval_iters and not d.valid_data_path:
        problems.append(f"eval_iters {t.eval_iters} asks for validation: set "
                        f"data.valid_data_path (SFT has no split) or training.eval_iters=0")
    if d.packing and cfg.parallel.pipeline_model_parallel_size > 2:
        problems.append(f"data.packing with PP {cfg.parallel.pipeline_model_parallel_size}: "
                        f"middle pipeline stages read no data, so they cannot build the "
                        f"per-sample attention mask; use PP ≤ 2")
    if d.packing and cfg.parallel.context_parallel_size > 1:
        problems.append(f"data.packing with CP {cfg.parallel.context_parallel_size}: packed rows "
                        f"are not split across context-parallel ranks; use CP 1")
    if t.train_tokens is not None or t.lr_warmup_tokens is not None:
        problems.append("SFT is scheduled in iterations (train_iters, lr_warmup_iters), as the "
                        "reference does; train_tokens / lr_warmup_tokens are for pretraining")
    return problems


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
        if n < 1:
            problems.append(f"memory.recompute_num_layers {n} must be ≥ 1")
        elif layers_per_chunk and mem.recompute_method == "uniform" and layers_per_chunk % n:
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
    return problems


def _data_problems(cfg: RunConfig) -> list[str]:
    """Blend syntax, split syntax, and a validation source when validation is asked for."""
    from ray_ppu.data.idxmap import BlendError, parse_blend

    d, t = cfg.data, cfg.training
    if d.dataset == "sft":
        return _sft_problems(cfg)
    problems = []
    for key, value in (("data.data_path", d.data_path), ("data.valid_data_path", d.valid_data_path)):
        if value or key == "data.data_path":
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
    if t.eval_iters < 0 or t.eval_interval < 1:
        problems.append(f"eval_iters {t.eval_iters} must be ≥ 0 and eval_interval "
                        f"{t.eval_interval} ≥ 1")
    elif t.eval_iters and not d.valid_data_path and (len(shares) < 2 or shares[1] == 0):
        problems.append(f"eval_iters {t.eval_iters} asks for validation but split '{d.split}' "
                        f"gives it no documents: set data.valid_data_path, a validation share "
                        f"in data.split, or training.eval_iters=0")
    return problems


def active_workers(world_size: int, tp: int, pp: int, cp: int, global_batch_size: int,
                   micro_batch_size: int) -> int:
    """How many of ``world_size`` workers can train: the largest multiple of TP × PP × CP whose
    DP size divides the global batch into micro batches (0: not even one model replica)."""
    model_parallel = tp * pp * cp
    for active in range(world_size - world_size % model_parallel, 0, -model_parallel):
        if global_batch_size % (micro_batch_size * (active // model_parallel)) == 0:
            return active
    return 0


def plan_for_world(cfg: RunConfig, world_size: int) -> Plan:
    """The plan of a worker group of ``world_size`` (an elastic group can be smaller than
    ``cluster.num_workers``): the active workers' layout, the same global batch (more
    microbatches per rank), the rest spare."""
    p, t = cfg.parallel, cfg.training
    active = active_workers(world_size, p.tensor_model_parallel_size,
                            p.pipeline_model_parallel_size, p.context_parallel_size,
                            t.global_batch_size, t.micro_batch_size)
    if active == 0:
        raise ConfigError(f"{world_size} workers hold no model replica of TP × PP × CP = "
                          f"{p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size}"
                          f" with global batch {t.global_batch_size}")
    cluster = dataclasses.replace(cfg.cluster, num_workers=active, min_workers=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the launcher has shown the notes of the full plan
        plan = build_plan(dataclasses.replace(cfg, cluster=cluster))
    return dataclasses.replace(plan, spare_workers=world_size - active)


def build_plan(cfg: RunConfig) -> Plan:
    """Validate the config against itself and derive the plan; ConfigError lists every problem.

    1. Parallel layout: world size divisible by TP × PP × CP.
    2. Model against layout: heads and KV groups by TP, layers by PP (× virtual stages).
    3. Batch arithmetic: global batch = micro batch × DP × microbatches.
    4. Sequence: seq_length within max_position_embeddings.
    5. Options: SP needs TP, recompute units divide a chunk's layers, offload rules, and
       Transformer Engine options on a CPU run.
    6. Schedule: train / warmup / decay iterations (tokens → iterations as the reference does).
    7. Data: blend and split syntax, a validation source when eval_iters > 0.
    """
    m, p, t, c = cfg.model, cfg.parallel, cfg.training, cfg.cluster
    problems: list[str] = []
    notes: list[str] = []
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    model_parallel = max(1, tp * pp * cp)
    try:  # the full group must be whole replicas; an elastic one may have spares (plan_for_world)
        dims = ParallelDims(c.num_workers, tp, pp, cp)
    except ConfigError as err:
        problems.append(str(err))
        dims = None
    if c.min_workers is not None:
        if not 1 <= c.min_workers <= c.num_workers:
            problems.append(f"cluster.min_workers {c.min_workers} must be between 1 and "
                            f"num_workers {c.num_workers}")
        elif not active_workers(c.min_workers, tp, pp, cp, t.global_batch_size, t.micro_batch_size):
            problems.append(f"cluster.min_workers {c.min_workers} cannot hold one model replica: "
                            f"TP {tp} × PP {pp} × CP {cp} = {model_parallel} workers whose DP "
                            f"size divides global_batch_size {t.global_batch_size} by "
                            f"micro_batch_size {t.micro_batch_size}")
    if m.num_attention_heads % tp:
        problems.append(f"num_attention_heads {m.num_attention_heads} is not divisible by TP {tp}")
    if m.num_query_groups % tp:
        problems.append(f"num_query_groups {m.num_query_groups} is not divisible by TP {tp}")
    if m.num_attention_heads % m.num_query_groups:
        problems.append(f"num_attention_heads {m.num_attention_heads} is not divisible by "
                        f"num_query_groups {m.num_query_groups}")
    if m.hidden_size % m.num_attention_heads:
        problems.append(f"hidden_size {m.hidden_size} is not divisible by "
                        f"num_attention_heads {m.num_attention_heads}")
    if m.num_layers % pp:
        problems.append(f"num_layers {m.num_layers} is not divisible by PP {pp}")
    vpp = None
    if p.num_layers_per_virtual_pipeline_stage is not None:
        per_vstage = p.num_layers_per_virtual_pipeline_stage
        if pp < 2:
            problems.append(f"num_layers_per_virtual_pipeline_stage {per_vstage} needs PP > 1, got PP {pp}")
        elif per_vstage < 1 or m.num_layers % (pp * per_vstage):
            problems.append(f"num_layers {m.num_layers} is not divisible by PP {pp} × "
                            f"num_layers_per_virtual_pipeline_stage {per_vstage} = {pp * per_vstage}")
        else:
            vpp = m.num_layers // pp // per_vstage
    layers_per_chunk = None
    if not m.num_layers % pp:
        layers_per_chunk = m.num_layers // pp // (vpp or 1)
    problems += _option_problems(cfg, layers_per_chunk)

    num_microbatches = 0
    if dims is not None:
        per_step = t.micro_batch_size * dims.dp
        if t.micro_batch_size < 1 or t.global_batch_size % per_step:
            problems.append(
                f"global_batch_size {t.global_batch_size} is not divisible by "
                f"micro_batch_size {t.micro_batch_size} × DP {dims.dp} = {per_step}"
            )
        else:
            num_microbatches = t.global_batch_size // per_step
    # SFT padded to max_padding_length trains on rows of that length.
    seq_length = (cfg.data.max_padding_length if cfg.data.dataset == "sft" and not cfg.data.packing
                  and cfg.data.max_padding_length else t.seq_length)
    if t.seq_length > m.max_position_embeddings:
        problems.append(f"seq_length {t.seq_length} exceeds max_position_embeddings "
                        f"{m.max_position_embeddings}")

    tokens_per_iter = t.global_batch_size * seq_length
    if t.train_tokens is not None:
        train_iters = t.train_tokens // tokens_per_iter
    elif t.train_iters is not None:
        train_iters = t.train_iters
    else:
        problems.append("set training.train_tokens (pretraining) or training.train_iters")
        train_iters = 0
    if train_iters < 1 and (t.train_tokens is not None or t.train_iters is not None):
        problems.append(f"training length is {train_iters} iterations (train_tokens "
                        f"{t.train_tokens} < global_batch_size × seq_length = {tokens_per_iter}?)")
    if t.lr_warmup_tokens is not None:
        warmup = t.lr_warmup_tokens // tokens_per_iter
    else:
        warmup = t.lr_warmup_iters
    # Pretraining decays over all iterations; SFT over those after warmup (the reference).
    sft = cfg.data.dataset == "sft"
    decay = t.lr_decay_iters if t.lr_decay_iters is not None else train_iters - (warmup if sft else 0)
    if warmup >= decay and not problems:  # Megatron's scheduler asserts warmup < decay
        how = ("set" if t.lr_decay_iters is not None
               else f"train_iters − lr_warmup_iters for SFT" if sft else "train_iters")
        problems.append(f"lr_warmup_iters {warmup} must be below lr_decay_iters {decay} ({how}): "
                        f"the schedule warms up, then decays; lower the warmup or train longer")
    if cfg.cluster.hang_timeout_s is not None and cfg.cluster.hang_timeout_s < 0:
        problems.append(f"cluster.hang_timeout_s {cfg.cluster.hang_timeout_s:g}: expected > 0, "
                        f"0 for no hang detection, or null for a timeout from the step time")
    if t.min_lr > t.lr:  # Megatron's scheduler asserts max_lr >= min_lr
        problems.append(f"min_lr {t.min_lr:g} is above lr {t.lr:g}: the schedule decays to min_lr")
    problems += _data_problems(cfg)
    evaluations = train_iters // t.eval_interval + 1 if t.eval_interval > 0 else 0

    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    for note in notes:
        warnings.warn(note, stacklevel=2)

    padded_vocab = m.padded_vocab_size(tp)
    total, first, last = stage_parameters(cfg, tp, pp, padded_vocab)
    return Plan(
        world_size=dims.world_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=dims.cp,
        data_parallel_size=dims.dp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=p.sequence_parallel,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        train_iters=train_iters,
        lr_warmup_iters=warmup,
        lr_decay_iters=decay,
        train_samples=train_iters * t.global_batch_size,
        train_tokens=train_iters * tokens_per_iter,
        eval_interval=t.eval_interval,
        eval_iters=t.eval_iters,
        # Megatron's count: a pass every eval_interval plus one at the end, each pass reading
        # fresh validation samples (the validation stream never rewinds).
        valid_samples=evaluations * t.eval_iters * t.global_batch_size,
        packed_sequences=cfg.data.dataset == "sft" and cfg.data.packing,
        padded_vocab_size=padded_vocab,
        kv_channels=m.kv_channels,
        num_parameters=total,
        num_parameters_per_device=max(first, last),
        flops_per_iteration=float(flops_per_iteration(cfg, padded_vocab)),
        attention_flops_coefficient=attention_flops_coefficient(cfg),
        warnings=tuple(notes),
    )
