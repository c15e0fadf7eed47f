"""The mapping of ``run_mcore_qwen*.sh``'s arguments to ray_ppu settings, argument by argument.

Each ``map_*`` function reproduces what one part of the script does with its arguments,
including its quirks (bash integer division for the iteration counts, SP dropped at TP 1,
DO forced by OPTIMIZER_OFFLOAD, the no-overlap script's unused overlap options); every
setting that had to be reinterpreted leaves a note, which the entry point prints and the
YAML header repeats. The settings that depend on files (data, checkpoints, output) are in
:mod:`.paths`; what run_mcore_qwen3.sh does differently (its model options, offload fraction,
uneven pipeline, fp8 recipe) is in :mod:`.qwen3`.
"""

from __future__ import annotations

import shlex

from ray_ppu.config.presets import PRESETS
from ray_ppu.errors import MigrationError
from ray_ppu.tools.pai_migration import qwen3
from ray_ppu.tools.pai_migration.launch import Arguments, Launch, Migration
from ray_ppu.tools.pai_migration.paths import map_checkpoint, map_data, map_output, run_name

GPUS_PER_NODE = 16  # the script's GPUS_PER_NODE for both ENV=dsw and ENV=dlc (810E nodes)

# The script's own architecture table (its MODEL_SIZE branches), compared against the presets.
SCRIPT_MODELS = {
    size: dict(zip(("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                    "num_query_groups", "max_position_embeddings", "norm_epsilon",
                    "untie_embeddings_and_output_weights"), row))
    for size, row in {
        "0.5B": (24, 896, 14, 4864, 2, 32768, 1e-6, False),
        "1.5B": (28, 1536, 12, 8960, 2, 32768, 1e-6, False),
        "3B": (36, 2048, 16, 11008, 2, 32768, 1e-6, False),
        "7B": (28, 3584, 28, 18944, 4, 131072, 1e-6, True),
        "14B": (48, 5120, 40, 13824, 8, 131072, 1e-5, True),
        "32B": (64, 5120, 40, 27648, 8, 131072, 1e-5, True),
        "72B": (80, 8192, 64, 29568, 8, 131072, 1e-5, True),
    }.items()
}


def switch(a: Arguments, m: Migration, name: str, otherwise: str) -> bool:
    """A true/false argument as the script tests it (``[ $X = true ]``); any other value takes
    the script's non-true branch, noted with ``otherwise``."""
    value = a.raw(name)
    if value not in ("true", "false"):
        m.note(f"{name}={value} is neither true nor false: {otherwise}")
    return value == "true"


def passes_overlap(script: str) -> bool:
    """Whether the script's torchrun line gets its --overlap-grad-reduce --overlap-param-gather:
    not in the PAI guide's no-overlap copy, nor in run_mcore_qwen3.sh (both build
    comm_overlap_option and never use it)."""
    return "no-overlap" not in script and not script.startswith("run_mcore_qwen3")


def map_cluster(a: Arguments, m: Migration) -> None:
    """ENV: dsw = one node of 16 PPU; dlc = WORLD_SIZE nodes of 16."""
    env = a.raw("ENV")
    if a.qwen3 and env in ("dsw", "dlc"):
        m.note("ENV: run_mcore_qwen3.sh starts one process per device torch.cuda counts (dsw) or "
               "per KUBERNETES_CONTAINER_RESOURCE_GPU (dlc); ray_ppu counts 16 PPU per 810E node")
    if env == "dsw":
        m.set("cluster.num_workers", GPUS_PER_NODE, a.label("ENV"), "ENV=dsw: one node of 16 PPU")
    elif env == "dlc":
        if not a.env_value("WORLD_SIZE"):
            raise MigrationError("ENV=dlc: the script takes the node count from WORLD_SIZE, which "
                                 "is not set (set WORLD_SIZE=<nodes> in the environment)")
        nodes = a.integer("WORLD_SIZE")
        m.set("cluster.num_workers", nodes * GPUS_PER_NODE,
              f"{a.label('ENV')}, {a.label('WORLD_SIZE')}",
              f"ENV=dlc: WORLD_SIZE {nodes} nodes × 16 PPU")
    else:
        raise MigrationError(f"{a.label('ENV')}={env!r}: expected dsw (one node) or dlc "
                             f"(WORLD_SIZE nodes)")
    m.set("cluster.device", "ppu")
    m.set("cluster.accelerator", "ppu-810e")


def map_model(a: Arguments, m: Migration) -> int:
    """MODEL_SIZE → preset (plus the script's numbers where they differ); returns NUM_LAYERS."""
    size = a.raw("MODEL_SIZE")
    if size not in PRESETS:
        raise MigrationError(f"{a.label('MODEL_SIZE')}={size!r}: not a ray_ppu preset; "
                             f"known presets: {', '.join(PRESETS)}")
    m.set("model.preset", size, a.label("MODEL_SIZE"))
    preset = PRESETS[size]
    script = SCRIPT_MODELS.get(size)
    if script is None:
        m.note(f"MODEL_SIZE={size}: the script has no branch for it (NUM_LAYERS would be unset "
               f"and the run would fail); model.preset={size} from ray_ppu's presets")
        return preset.num_layers
    for key, value in script.items():
        if getattr(preset, key) != value:
            m.set(f"model.{key}", value, a.label("MODEL_SIZE"))
            m.note(f"MODEL_SIZE={size}: the script sets {key} {value} where the published "
                   f"checkpoint (preset) has {getattr(preset, key)}; model.{key}={value}")
    return script["num_layers"]


def map_batch(a: Arguments, m: Migration) -> None:
    """Batch sizes, learning rates and sequence length (as Megatron's argparse reads them)."""
    m.set("training.micro_batch_size", a.integer("BATCH_SIZE"), a.label("BATCH_SIZE"))
    m.set("training.global_batch_size", a.integer("GLOBAL_BATCH_SIZE"),
          a.label("GLOBAL_BATCH_SIZE"))
    m.set("training.seq_length", a.integer("SEQ_LEN"), a.label("SEQ_LEN"))
    m.set("training.lr", a.number("LR"), a.label("LR"))
    m.set("training.min_lr", a.number("MIN_LR"), a.label("MIN_LR"))
    a.integer("PAD_LEN")  # always passed as --max-padding-length: Megatron wants an integer


def map_schedule(a: Arguments, m: Migration, sft: bool) -> tuple[int, int]:
    """Train / warmup / decay iterations with the script's arithmetic; returns (train, warmup)."""
    train_label, warmup_label = a.label("TRAIN_TOKENS_OR_ITERS"), a.label("WARMUP_TOKENS_OR_ITERS")
    train = a.count("TRAIN_TOKENS_OR_ITERS", m)
    warmup = a.count("WARMUP_TOKENS_OR_ITERS", m)
    if sft:
        m.set("training.train_iters", train, train_label, f"SFT: TRAIN_ITERS = {train_label}")
        m.set("training.lr_warmup_iters", warmup, warmup_label,
              f"SFT: LR_WARMUP_ITERS = {warmup_label}")
        m.set("training.lr_decay_iters", train - warmup, f"{train_label}, {warmup_label}",
              f"$(( TRAIN_ITERS {train} - LR_WARMUP_ITERS {warmup} )): Megatron's "
              f"--lr-decay-iters, the iteration the decay ends at")
        return train, warmup
    gbs, seq = a.integer("GLOBAL_BATCH_SIZE"), a.integer("SEQ_LEN")
    train_iters = train // gbs // seq  # bash $(( )): integer division, left to right
    warmup_iters = warmup // gbs // seq
    arithmetic = ("{} {} / GLOBAL_BATCH_SIZE {} / SEQ_LEN {} = {} "
                  "(bash $(( )): integer division, left to right)")
    m.set("training.train_iters", train_iters, f"{train_label}, GLOBAL_BATCH_SIZE, SEQ_LEN",
          arithmetic.format("TRAIN_TOKENS", train, gbs, seq, train_iters))
    m.set("training.lr_warmup_iters", warmup_iters, f"{warmup_label}, GLOBAL_BATCH_SIZE, SEQ_LEN",
          arithmetic.format("WARMUP_TOKENS", warmup, gbs, seq, warmup_iters))
    m.set("training.lr_decay_iters", train_iters, f"{train_label}, GLOBAL_BATCH_SIZE, SEQ_LEN",
          "pretraining: LR_DECAY_ITERS = TRAIN_ITERS")
    return train_iters, warmup_iters


def map_precision(a: Arguments, m: Migration) -> None:
    """PR: fp16 (with QK layer scaling), bf16, fp8 (hybrid, max, 1024); else Megatron's fp32."""
    pr, label = a.raw("PR"), a.label("PR")
    if pr == "fp16":
        m.set("training.precision", "fp16", label)
        m.set("training.apply_query_key_layer_scaling", True, label)
        m.note("PR=fp16: the script adds --apply-query-key-layer-scaling; ray_ppu's precision=fp16 "
               "turns it on by default (written explicitly: "
               "training.apply_query_key_layer_scaling=true)")
    elif pr == "bf16":
        m.set("training.precision", "bf16", label)
    elif pr == "fp8" and a.qwen3:
        m.set("training.precision", "fp8", label)
        m.set("training.fp8_format", "hybrid", label)
        qwen3.fp8_recipe_note(m)
    elif pr == "fp8":
        m.set("training.precision", "fp8", label)
        m.set("training.fp8_format", "hybrid", label)
        m.set("training.fp8_amax_compute_algo", "max", label)
        m.set("training.fp8_amax_history_len", 1024, label)
    else:
        m.set("training.precision", "fp32", label)
        m.note(f"PR={pr} is none of fp16, bf16, fp8: the script passes no precision option and "
               f"Megatron trains in fp32; training.precision=fp32")


def map_parallel(a: Arguments, m: Migration, script: str) -> None:
    """TP / PP / CP, SP (only with TP > 1), MP_VP, and grad-reduce / param-gather overlap."""
    tp = a.integer("TP")
    m.set("parallel.tensor_model_parallel_size", tp, a.label("TP"))
    m.set("parallel.pipeline_model_parallel_size", a.integer("PP"), a.label("PP"))
    m.set("parallel.context_parallel_size", a.integer("CP"), a.label("CP"))
    sp = a.raw("SP")
    if sp == "true" and tp == 1:
        m.note("SP=true with TP=1: the script drops sequence parallelism; "
               "parallel.sequence_parallel=false")
    elif sp not in ("true", "false"):
        m.note(f"SP={sp} is neither true nor false: the script passes no --sequence-parallel; "
               f"parallel.sequence_parallel=false")
    m.set("parallel.sequence_parallel", sp == "true" and tp > 1,
          f"{a.label('SP')}, {a.label('TP')}")
    if a.env_value("MP_VP"):
        m.set("parallel.num_layers_per_virtual_pipeline_stage", a.integer("MP_VP"),
              a.label("MP_VP"))
    if not passes_overlap(script):
        m.set("parallel.overlap_grad_reduce", False, script)
        m.set("parallel.overlap_param_gather", False, script)
        m.note(f"{script} builds comm_overlap_option but never passes it to torchrun: "
               f"parallel.overlap_grad_reduce=false, parallel.overlap_param_gather=false")
    else:
        m.set("parallel.overlap_grad_reduce", True, f"{script}: --overlap-grad-reduce")
        m.set("parallel.overlap_param_gather", True, f"{script}: --overlap-param-gather")


def map_recompute(a: Arguments, m: Migration, num_layers: int, script: str) -> None:
    """AC: sel / full (MP_AC_LAYERS, the script's divisibility check) / offload / none / other."""
    ac, label = a.raw("AC"), a.label("AC")
    if ac == "sel":
        m.set("memory.recompute", "selective", label)
    elif ac == "full":
        layers = a.integer("MP_AC_LAYERS") if a.env_value("MP_AC_LAYERS") else 1
        pp = a.integer("PP")
        if (num_layers // pp) % layers:
            raise MigrationError(
                f"AC=full with MP_AC_LAYERS={layers}: ({num_layers} layers / PP {pp}) % {layers} "
                f"= {(num_layers // pp) % layers}; the script stops with \"the num layers per pp "
                f"rank must be a multiple of the recompute layers.\"")
        both = f"{label}, {a.label('MP_AC_LAYERS')}"
        m.set("memory.recompute", "full", label)
        m.set("memory.recompute_method", "uniform", label)
        m.set("memory.recompute_num_layers", layers, both)
    elif ac == "offload":
        layers = a.integer("MP_AC_LAYERS") if a.env_value("MP_AC_LAYERS") else 1
        m.set("memory.recompute", "none", label)
        m.set("memory.activation_offload_layers", layers, f"{label}, {a.label('MP_AC_LAYERS')}")
        if not passes_overlap(script):
            done = f"{script} passes no overlap options anyway"
        elif a.integer("TP") > 1:
            done = ("the script turns them off and adds --tp-comm-overlap, which ray_ppu has no "
                    "setting for (not reproduced)")
        else:
            done = "the script turns them off"
        m.note(f"AC=offload: memory.activation_offload_layers={layers}; grad-reduce/param-gather "
               f"overlap off ({done}): ray_ppu turns both off itself whenever "
               f"memory.activation_offload_layers > 0")
    elif ac == "none":
        m.set("memory.recompute", "none", label)
    else:
        m.set("memory.recompute", "none", label)
        m.note(f"AC={ac} is none of sel, full, offload, none: the script adds no recompute "
               f"option; memory.recompute=none")


def map_optimizer(a: Arguments, m: Migration) -> str:
    """DO and OPTIMIZER_OFFLOAD (offload forces DO=true); returns DO as the script ends up."""
    do, offload = a.raw("DO"), a.raw("OPTIMIZER_OFFLOAD")
    if offload != "false" and do == "false":
        m.note(f"OPTIMIZER_OFFLOAD={offload} with DO=false: the script forces DO=true (\"Offload "
               f"optimizer is valid only if $DO=true\"); training.use_distributed_optimizer=true")
        do = "true"
    elif do not in ("true", "false"):
        m.note(f"DO={do} is neither true nor false: the script passes no "
               f"--use-distributed-optimizer; training.use_distributed_optimizer=false")
    m.set("training.use_distributed_optimizer", do == "true",
          f"{a.label('DO')}, {a.label('OPTIMIZER_OFFLOAD')}")
    if a.qwen3:
        qwen3.map_offload(a, m)
        return do
    label = a.label("OPTIMIZER_OFFLOAD")
    if offload == "static":
        m.set("memory.optimizer_offload", "static", label)
        m.set("memory.optimizer_offload_fraction", 1.0, label)
    elif offload == "auto":
        m.set("memory.optimizer_offload", "auto", label)
    else:
        m.set("memory.optimizer_offload", "none", label)
        if offload != "false":
            m.note(f"OPTIMIZER_OFFLOAD={offload} is none of false, static, auto: the script "
                   f"offloads nothing; memory.optimizer_offload=none")
    return do


def map_attention(a: Arguments, m: Migration) -> None:
    """FL: true → Transformer Engine's flash attention, false → its fused attention."""
    fl, label = a.raw("FL"), a.label("FL")
    backend = {"true": "flash", "false": "fused"}.get(fl, "auto")
    m.set("training.attention_backend", backend, label)
    if backend == "auto":
        m.note(f"FL={fl} is neither true nor false: the script sets neither NVTE_FLASH_ATTN nor "
               f"NVTE_FUSED_ATTN and Transformer Engine picks; training.attention_backend=auto")


def map_fixed(m: Migration, qwen3_script: bool) -> None:
    """Options the script always passes (written so the config does not rest on defaults);
    run_mcore_qwen3.sh decays weights by 0.01 and takes the RoPE base from its MODEL_SIZE
    branch (:mod:`.qwen3`)."""
    decay = 0.01 if qwen3_script else 0.1
    fixed = (
        ("training.lr_decay_style", "cosine", "--lr-decay-style cosine"),
        ("training.weight_decay", decay, f"--weight-decay {decay}"),
        ("training.adam_beta1", 0.9, "--adam-beta1 0.9"),
        ("training.adam_beta2", 0.95, "--adam-beta2 0.95"),
        ("training.clip_grad", 1.0, "--clip-grad 1.0"),
        ("training.log_interval", 1, "--log-interval 1"),
        ("training.eval_interval", 10000, "--eval-interval 10000"),
        ("training.eval_iters", 10, "--eval-iters 10"),
        ("model.init_method_std", 0.008, "--init-method-std 0.008"),
        ("model.hidden_dropout", 0.0, "--hidden-dropout 0.0"),
        ("model.attention_dropout", 0.0, "--attention-dropout 0.0"),
    )
    if not qwen3_script:
        fixed += (("model.rotary_base", 1000000, "--rotary-base 1000000"),)
    for key, value, flag in fixed:
        m.set(key, value, f"the script's {flag}")


def migrate(launch: Launch) -> Migration:
    """The ray_ppu config (with its notes) that reproduces one call of the launch script."""
    a, m = Arguments(launch), Migration()
    if a.extra:
        m.note(f"{len(a.extra)} arguments after OUTPUT_BASEPATH ignored (the script reads "
               f"{len(a.names)}): {shlex.join(a.extra)}")
    map_cluster(a, m)
    num_layers = qwen3.map_model(a, m, launch) if a.qwen3 else map_model(a, m)
    map_batch(a, m)
    sft = switch(a, m, "SFT", "the script pretrains (--train-mode pretrain)")
    train_iters, warmup_iters = map_schedule(a, m, sft)
    map_precision(a, m)
    map_parallel(a, m, launch.script)
    map_recompute(a, m, num_layers, launch.script)
    if a.qwen3:
        qwen3.map_uneven_pipeline(a, m, num_layers)
    do = map_optimizer(a, m)
    map_attention(a, m)
    map_data(a, m, sft)
    map_checkpoint(a, m, sft, train_iters)
    if sft:  # NAME carries the arguments as written; pretraining, the computed iterations
        name = run_name(a, sft, do, a.raw("TRAIN_TOKENS_OR_ITERS"), a.raw("WARMUP_TOKENS_OR_ITERS"))
    else:
        name = run_name(a, sft, do, str(train_iters), str(warmup_iters))
    map_output(a, m, name)
    map_fixed(m, a.qwen3)
    return m
