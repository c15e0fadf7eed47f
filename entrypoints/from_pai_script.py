"""Migrate a PAI-Megatron-Patch launch (``run_mcore_qwen*.sh``) to a ray_ppu YAML config.

    python entrypoints/from_pai_script.py run_dsw_7b.sh --output run.yaml
    python entrypoints/from_pai_script.py --output run.yaml -- \\
        dsw 7B 1 256 1e-5 1e-6 4096 4096 bf16 1 1 1 true true true false false false 100000 \\
        DATASET_PATH VALID_DATASET_PATH PRETRAIN_CHECKPOINT_PATH 10000000000 1000000 OUTPUT_BASEPATH
    python entrypoints/pretrain.py --config run.yaml --dry-run

Give either the 25 positional arguments of ``run_mcore_qwen.sh`` (ENV MODEL_SIZE BATCH_SIZE
GLOBAL_BATCH_SIZE LR MIN_LR SEQ_LEN PAD_LEN PR TP PP CP SP DO FL SFT AC OPTIMIZER_OFFLOAD
SAVE_INTERVAL DATASET_PATH VALID_DATASET_PATH PRETRAIN_CHECKPOINT_PATH TRAIN_TOKENS_OR_ITERS
WARMUP_TOKENS_OR_ITERS OUTPUT_BASEPATH) or one path to a script such as the PAI guide's
``run_dsw_7b.sh`` that calls ``run_mcore_qwen*.sh``: its arguments are read from that call (line
continuations, comments, ``VAR=value cmd`` prefixes, ``export``/``unset`` lines, ``$VAR``).

The script's environment variables MP_DATASET_TYPE, MP_AC_LAYERS, MP_VP, MP_SFT_PACKING and
WORLD_SIZE (ENV=dlc: nodes) come from this process's environment, overridden by the parsed
script. The config reproduces what the script does, with the script's own arithmetic (bash
integer division for the iteration counts); every setting that had to be reinterpreted is
printed on stderr, one line each, and repeated in the YAML header. The config is validated with
``ray_ppu.config.loader.load`` and ``ray_ppu.plan.build_plan`` before it is written; a problem
is reported with the script argument it comes from (exit status 2).
"""

from __future__ import annotations

import argparse
import os
import posixpath
import re
import shlex
import sys
import textwrap
import warnings
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ray_ppu.config.loader import from_dict  # noqa: E402
from ray_ppu.errors import ConfigError  # noqa: E402
from ray_ppu.config.presets import PRESETS  # noqa: E402
from ray_ppu.plan import Plan, build_plan  # noqa: E402
from ray_ppu.errors import MigrationError  # noqa: F401 (also imported from here)

ARGUMENTS = (
    "ENV", "MODEL_SIZE", "BATCH_SIZE", "GLOBAL_BATCH_SIZE", "LR", "MIN_LR", "SEQ_LEN", "PAD_LEN",
    "PR", "TP", "PP", "CP", "SP", "DO", "FL", "SFT", "AC", "OPTIMIZER_OFFLOAD", "SAVE_INTERVAL",
    "DATASET_PATH", "VALID_DATASET_PATH", "PRETRAIN_CHECKPOINT_PATH", "TRAIN_TOKENS_OR_ITERS",
    "WARMUP_TOKENS_OR_ITERS", "OUTPUT_BASEPATH",
)
ENV_VARS = ("MP_DATASET_TYPE", "MP_AC_LAYERS", "MP_VP", "MP_SFT_PACKING", "WORLD_SIZE")
GPUS_PER_NODE = 16  # the script's GPUS_PER_NODE for both ENV=dsw and ENV=dlc (810E nodes)
REFERENCE_SCRIPT = "run_mcore_qwen-no-overlap.sh"  # the PAI guide's launch script
CALLED_SCRIPT = re.compile(r"run_mcore_qwen[\w.-]*\.sh")
BASH_INT_MAX = 2**63 - 1
SECTIONS = ("model", "parallel", "training", "memory", "data", "output", "cluster", "checkpoint")

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

# Words of build_plan's messages that name a setting without its config key.
PROBLEM_WORDS = {
    "TP": "parallel.tensor_model_parallel_size", "PP": "parallel.pipeline_model_parallel_size",
    "CP": "parallel.context_parallel_size", "DP": "cluster.num_workers",
    "world size": "cluster.num_workers", "workers": "cluster.num_workers",
    "num_layers": "model.preset", "hidden_size": "model.preset",
    "num_attention_heads": "model.preset", "num_query_groups": "model.preset",
    "max_position_embeddings": "model.preset", "training length": "training.train_iters",
}


@dataclass(frozen=True)
class Launch:
    """One call of the launch script: its 25 arguments and the environment it sees."""

    args: tuple[str, ...]
    env: Mapping[str, str]
    script: str = REFERENCE_SCRIPT
    source: str = "command-line arguments"


@dataclass
class Migration:
    """The config being built: values by section, where each came from, and the notes."""

    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    comments: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def set(self, key: str, value: Any, source: Optional[str] = None,
            comment: Optional[str] = None) -> None:
        section, name = key.split(".")
        self.values.setdefault(section, {})[name] = value
        if source:
            self.sources[key] = source
        if comment:
            self.comments[key] = comment

    def note(self, text: str) -> None:
        self.notes.append(text)


class Arguments:
    """The launch's positional arguments and environment, parsed the way the script uses them."""

    def __init__(self, launch: Launch):
        if len(launch.args) < len(ARGUMENTS):
            missing = " ".join(ARGUMENTS[len(launch.args):])
            raise MigrationError(f"{launch.source}: {len(launch.args)} arguments, the script "
                                 f"reads {len(ARGUMENTS)}; missing: {missing}")
        self.values = dict(zip(ARGUMENTS, launch.args))
        self.extra = launch.args[len(ARGUMENTS):]
        self.env = launch.env

    def raw(self, name: str) -> str:
        return self.values[name]

    @staticmethod
    def label(name: str) -> str:
        if name in ENV_VARS:
            return f"{name} (environment)"
        i = ARGUMENTS.index(name) + 1
        return f"{name} (${i})" if i < 10 else f"{name} (${{{i}}})"

    def env_value(self, name: str) -> str:
        """An environment variable as the script's ``[ -z ${VAR} ]`` sees it ('' = unset)."""
        return self.env.get(name, "")

    def _text(self, name: str) -> str:
        return self.env_value(name) if name in ENV_VARS else self.raw(name)

    def integer(self, name: str, minimum: int = 1) -> int:
        """A plain decimal integer (what Megatron's argparse and bash both accept)."""
        text = self._text(name)
        if not re.fullmatch(r"[0-9]+", text) or int(text) < minimum:
            raise MigrationError(f"{self.label(name)}={text!r}: expected an integer ≥ {minimum}")
        return int(text)

    def number(self, name: str) -> float:
        try:
            return float(self.raw(name))
        except ValueError:
            raise MigrationError(f"{self.label(name)}={self.raw(name)!r}: expected a "
                                 f"number") from None

    def count(self, name: str, m: Migration) -> int:
        """A count the script feeds to bash ``$(( ))``: plain integers as they are; scientific
        notation (1e10) as the integer it denotes, noted, since bash cannot parse it."""
        text = self.raw(name)
        if re.fullmatch(r"[0-9]+", text):
            value = int(text)
        else:
            try:
                number = Decimal(text)
            except InvalidOperation:
                number = None
            if number is None or not number.is_finite() or number != number.to_integral_value() \
                    or number < 0:
                raise MigrationError(f"{self.label(name)}={text!r}: expected a non-negative "
                                     f"integer")
            value = int(number)
            m.note(f"{name}={text}: bash $(( )) cannot parse {text} (the script would stop with an "
                   f"arithmetic syntax error); taken as {value}")
        if value > BASH_INT_MAX:
            raise MigrationError(f"{self.label(name)}={text}: exceeds bash's 64-bit arithmetic")
        return value


# --------------------------------------------------------------------------- the mapping

def switch(a: Arguments, m: Migration, name: str, otherwise: str) -> bool:
    """A true/false argument as the script tests it (``[ $X = true ]``); any other value takes
    the script's non-true branch, noted with ``otherwise``."""
    value = a.raw(name)
    if value not in ("true", "false"):
        m.note(f"{name}={value} is neither true nor false: {otherwise}")
    return value == "true"


def map_cluster(a: Arguments, m: Migration) -> None:
    """ENV: dsw = one node of 16 PPU; dlc = WORLD_SIZE nodes of 16."""
    env = a.raw("ENV")
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
        m.set("training.train_iters", train, train_label, "SFT: TRAIN_ITERS ($23)")
        m.set("training.lr_warmup_iters", warmup, warmup_label, "SFT: LR_WARMUP_ITERS ($24)")
        m.set("training.lr_decay_iters", train - warmup, f"{train_label}, {warmup_label}",
              f"$(( TRAIN_ITERS {train} - LR_WARMUP_ITERS {warmup} ))")
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
    if "no-overlap" in script:
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
        if "no-overlap" in script:
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
    if fl == "true":
        m.set("training.attention_backend", "flash", label)
    elif fl == "false":
        m.set("training.attention_backend", "fused", label)
    else:
        m.set("training.attention_backend", "auto", label)
        m.note(f"FL={fl} is neither true nor false: the script sets neither NVTE_FLASH_ATTN nor "
               f"NVTE_FUSED_ATTN and Transformer Engine picks; training.attention_backend=auto")


def map_data(a: Arguments, m: Migration, sft: bool) -> None:
    """MP_DATASET_TYPE idxmap (split 99,1,0) or raw (train / valid JSON, tokenizer, packing)."""
    kind = a.env_value("MP_DATASET_TYPE") or "idxmap"
    packing_text = a.env_value("MP_SFT_PACKING") or "false"
    packing = packing_text == "true"
    if kind not in ("idxmap", "raw"):
        m.note(f"MP_DATASET_TYPE={kind} is neither idxmap nor raw: the script reads idxmap data; "
               f"data.dataset=idxmap")
    if packing_text not in ("true", "false"):
        m.note(f"MP_SFT_PACKING={packing_text} is neither true nor false: the script does not "
               f"pack; data.packing=false")
    data, valid = a.raw("DATASET_PATH"), a.raw("VALID_DATASET_PATH")
    pad = a.integer("PAD_LEN")
    if kind == "raw":
        checkpoint = a.raw("PRETRAIN_CHECKPOINT_PATH")
        if checkpoint == "none":
            raise MigrationError("MP_DATASET_TYPE=raw: the script tokenizes with the Hugging Face "
                                 "tokenizer in PRETRAIN_CHECKPOINT_PATH (${22}), which is none")
        m.set("data.dataset", "sft", a.label("MP_DATASET_TYPE"))
        m.set("data.data_path", [data], a.label("DATASET_PATH"))
        m.set("data.valid_data_path", [valid], a.label("VALID_DATASET_PATH"))
        m.set("data.tokenizer", checkpoint, a.label("PRETRAIN_CHECKPOINT_PATH"))
        if packing:
            m.set("data.packing", True, a.label("MP_SFT_PACKING"))
            m.note(f"PAD_LEN={pad} unused: with MP_SFT_PACKING=true rows are SEQ_LEN long; "
                   f"data.max_padding_length not set")
        else:
            m.set("data.max_padding_length", pad, a.label("PAD_LEN"))
        if not sft:
            m.note("MP_DATASET_TYPE=raw with SFT=false: ray_ppu reads the JSON with its SFT "
                   "dataset (data.dataset=sft); the script's pretraining schedule (tokens → "
                   "iterations, decay = train iterations) is kept")
        return
    m.set("data.dataset", "idxmap", a.label("MP_DATASET_TYPE") +
          ("" if a.env_value("MP_DATASET_TYPE") else ", unset: idxmap"))
    m.set("data.data_path", [data], a.label("DATASET_PATH"))
    m.set("data.split", "99,1,0", "the script's --split 99,1,0")
    m.note(f"VALID_DATASET_PATH={valid} unused: with idxmap data the script validates on the 1% "
           f"split of DATASET_PATH (--split 99,1,0); data.split=99,1,0")
    m.note(f"PAD_LEN={pad} unused: only raw data (MP_DATASET_TYPE=raw) without packing is padded; "
           f"data.max_padding_length not set")
    if packing:
        m.note("MP_SFT_PACKING=true with idxmap data: the script resets position ids at each end "
               "of document (--reset-position-ids); ray_ppu's idxmap reader has no such setting "
               "(data.packing is for sft data): not reproduced")
    if sft:
        m.note("SFT=true with idxmap data: the script masks the loss on EOD tokens "
               "(--eod-mask-loss); ray_ppu's idxmap reader has no such setting: not reproduced")


def checkpoint_format(path: str) -> str:
    """'hf' (config.json / *.safetensors), 'missing' (not on this machine) or 'other'."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        return "missing"
    if (directory / "config.json").is_file() or any(directory.glob("*.safetensors")):
        return "hf"
    return "other"


def map_checkpoint(a: Arguments, m: Migration, sft: bool, train_iters: int) -> None:
    """SAVE_INTERVAL, keep every checkpoint, PRETRAIN_CHECKPOINT_PATH (Hugging Face weights,
    or a Megatron checkpoint's weights only)."""
    interval = a.integer("SAVE_INTERVAL")
    m.set("checkpoint.save_interval", interval, a.label("SAVE_INTERVAL"))
    written = max(1, -(-train_iters // interval))  # every interval, plus one at the end
    m.set("checkpoint.keep_last", written, a.label("SAVE_INTERVAL"),
          f"every checkpoint: ceil({train_iters} / {interval})")
    m.note(f"the script keeps every checkpoint it saves (Megatron deletes none); "
           f"checkpoint.keep_last={written}, all that {train_iters} iterations with "
           f"SAVE_INTERVAL={interval} write")
    m.note("--no-save-optim: the script's checkpoints hold no optimizer state; ray_ppu's "
           "checkpoints do (exact resume)")
    path = a.raw("PRETRAIN_CHECKPOINT_PATH")
    if path == "none":
        return
    label = a.label("PRETRAIN_CHECKPOINT_PATH")
    kind = checkpoint_format(path)
    if kind == "hf":
        m.set("checkpoint.pretrained", path, label)
        m.note(f"PRETRAIN_CHECKPOINT_PATH={path} is a Hugging Face model directory: "
               f"checkpoint.pretrained loads its weights directly at this run's TP/PP (the "
               f"script's Megatron finds no latest_checkpointed_iteration.txt there and trains "
               f"from random weights unless it was converted first); its config.json must match "
               f"model.preset, which the config check enforces")
        return
    m.set("checkpoint.load", path, label)
    m.set("checkpoint.finetune", True, f"{label}, --no-load-optim --no-load-rng")
    if not sft:
        m.note("PRETRAIN_CHECKPOINT_PATH with SFT=false: the script loads the weights only "
               "(--no-load-optim --no-load-rng) and a converted (release) checkpoint starts at "
               "iteration 0; checkpoint.finetune=true")
    if kind == "missing":
        m.note(f"PRETRAIN_CHECKPOINT_PATH={path} is not on this machine, so its format was not "
               f"checked: if it is a Hugging Face model directory (the PAI guide downloads "
               f"Qwen2.5 there with modelscope), set checkpoint.pretrained={path} instead of "
               f"checkpoint.load and checkpoint.finetune")


def run_name(a: Arguments, sft: bool, do: str, train_iters: str, warmup_iters: str) -> str:
    """The script's NAME: PREFIX (finetune-/pretrain-…) and the run's settings."""
    prefix = (f"{'finetune' if sft else 'pretrain'}-mcore-qwen2.5-{a.raw('MODEL_SIZE')}"
              f"-lr-{a.raw('LR')}-minlr-{a.raw('MIN_LR')}-bs-{a.raw('BATCH_SIZE')}"
              f"-gbs-{a.raw('GLOBAL_BATCH_SIZE')}-seqlen-{a.raw('SEQ_LEN')}")
    return (f"{prefix}-pr-{a.raw('PR')}-tp-{a.raw('TP')}-pp-{a.raw('PP')}-cp-{a.raw('CP')}"
            f"-ac-{a.raw('AC')}-do-{do}-sp-{a.raw('SP')}-ti-{train_iters}-wi-{warmup_iters}")


def map_output(a: Arguments, m: Migration, name: str) -> None:
    """OUTPUT_BASEPATH/NAME holds what the script spreads over checkpoint/ and tensorboard/."""
    base = a.raw("OUTPUT_BASEPATH")
    m.set("output.dir", posixpath.join(base, name), a.label("OUTPUT_BASEPATH"))
    m.set("output.name", name, "the script's NAME")
    m.set("output.tensorboard", True, "--tensorboard-dir")
    m.note(f"OUTPUT_BASEPATH={base}: the script writes checkpoint/NAME and tensorboard/NAME_<time> "
           f"under it; output.dir=OUTPUT_BASEPATH/NAME holds both (checkpoints in "
           f"ray_train/NAME), output.name=NAME")


def map_fixed(m: Migration) -> None:
    """Options the script always passes (written so the config does not rest on defaults)."""
    for key, value, flag in (
        ("training.lr_decay_style", "cosine", "--lr-decay-style cosine"),
        ("training.weight_decay", 0.1, "--weight-decay 0.1"),
        ("training.adam_beta1", 0.9, "--adam-beta1 0.9"),
        ("training.adam_beta2", 0.95, "--adam-beta2 0.95"),
        ("training.clip_grad", 1.0, "--clip-grad 1.0"),
        ("training.log_interval", 1, "--log-interval 1"),
        ("training.eval_interval", 10000, "--eval-interval 10000"),
        ("training.eval_iters", 10, "--eval-iters 10"),
        ("model.init_method_std", 0.008, "--init-method-std 0.008"),
        ("model.hidden_dropout", 0.0, "--hidden-dropout 0.0"),
        ("model.attention_dropout", 0.0, "--attention-dropout 0.0"),
        ("model.rotary_base", 1000000, "--rotary-base 1000000"),
    ):
        m.set(key, value, f"the script's {flag}")


def migrate(launch: Launch) -> Migration:
    """The ray_ppu config (with its notes) that reproduces one call of the launch script."""
    a, m = Arguments(launch), Migration()
    if a.extra:
        m.note(f"{len(a.extra)} arguments after OUTPUT_BASEPATH ignored (the script reads 25): "
               f"{shlex.join(a.extra)}")
    map_cluster(a, m)
    num_layers = map_model(a, m)
    map_batch(a, m)
    sft = switch(a, m, "SFT", "the script pretrains (--train-mode pretrain)")
    train_iters, warmup_iters = map_schedule(a, m, sft)
    map_precision(a, m)
    map_parallel(a, m, launch.script)
    map_recompute(a, m, num_layers, launch.script)
    do = map_optimizer(a, m)
    map_attention(a, m)
    map_data(a, m, sft)
    map_checkpoint(a, m, sft, train_iters)
    if sft:  # NAME carries the arguments as written; pretraining, the computed iterations
        name = run_name(a, sft, do, a.raw("TRAIN_TOKENS_OR_ITERS"), a.raw("WARMUP_TOKENS_OR_ITERS"))
    else:
        name = run_name(a, sft, do, str(train_iters), str(warmup_iters))
    map_output(a, m, name)
    map_fixed(m)
    return m


# --------------------------------------------------------------------------- reading a script

def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each shell line, backslash-newline continuations joined."""
    lines: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not pending:
            start = number
        if line.endswith("\\") and not line.lstrip().startswith("#"):
            pending += line[:-1] + " "
            continue
        lines.append((start, pending + line))
        pending = ""
    if pending:
        lines.append((start, pending))
    return lines


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of a line (split at ; && || |), comments dropped, quotes removed."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token and set(token) <= set(";&|"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    return [c for c in commands if c]


def expand(token: str, variables: Mapping[str, str], where: str) -> str:
    """``$VAR`` / ``${VAR}`` from the variables known at that point; anything else is an error
    (an unknown variable would shift the positional arguments)."""
    if "$(" in token or "`" in token:
        raise MigrationError(f"{where}: command substitution in {token!r} cannot be evaluated")

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise MigrationError(f"{where}: ${name} is not set in the script or the environment")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, token)


ASSIGNMENT = re.compile(r"([A-Za-z_]\w*)=(.*)", re.S)
WRAPPERS = {"sh", "bash", "source", ".", "exec", "nohup", "time", "env"}


def parse_script(path: Path, environ: Mapping[str, str]) -> Launch:
    """The one call of ``run_mcore_qwen*.sh`` in a launch script: its arguments and environment."""
    variables, exported = dict(environ), set(environ)
    calls = []
    for number, line in logical_lines(path.read_text()):
        where = f"{path}:{number}"
        try:
            commands = simple_commands(line)
        except ValueError as err:
            raise MigrationError(f"{where}: cannot split the line ({err})") from None
        for words in commands:
            words = [expand(w, variables, where) for w in words]
            if words[0] in ("export", "unset"):
                for word in words[1:]:
                    match = ASSIGNMENT.fullmatch(word)
                    if words[0] == "unset":
                        variables.pop(word, None)
                        exported.discard(word)
                    elif match:
                        variables[match.group(1)] = match.group(2)
                        exported.add(match.group(1))
                    else:
                        exported.add(word)
                continue
            prefix = {}
            while words and ASSIGNMENT.fullmatch(words[0]):
                key, value = ASSIGNMENT.fullmatch(words.pop(0)).groups()
                prefix[key] = value
            while words and words[0] in WRAPPERS:
                words.pop(0)
                while words and ASSIGNMENT.fullmatch(words[0]):  # env VAR=value cmd
                    key, value = ASSIGNMENT.fullmatch(words.pop(0)).groups()
                    prefix[key] = value
            if not words:
                variables.update(prefix)  # VAR=value alone: a shell variable
                continue
            if CALLED_SCRIPT.fullmatch(posixpath.basename(words[0])):
                env = {k: variables[k] for k in exported if k in variables} | prefix
                calls.append(Launch(tuple(words[1:]), env, posixpath.basename(words[0]),
                                    f"{where}"))
    if len(calls) != 1:
        found = ", ".join(c.source for c in calls) or "none"
        raise MigrationError(f"{path}: expected one call of run_mcore_qwen*.sh, found "
                             f"{len(calls)} ({found}); pass the 25 arguments directly instead")
    return calls[0]


# --------------------------------------------------------------------------- output

def scalar(value: Any) -> str:
    """A YAML flow scalar or list (1e-5 → 1.0e-05, which YAML 1.1 reads as a float)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9)
    return text.removesuffix("...\n").strip()


def render(m: Migration, launch: Launch) -> str:
    """The YAML text: a header (the call, its environment, the notes), then the sections with
    each value's origin or arithmetic as a comment."""
    lines = ["# ray_ppu config migrated by entrypoints/from_pai_script.py from "
             f"{launch.source}:", f"#   {launch.script} {shlex.join(launch.args)}"]
    env = {k: launch.env[k] for k in ENV_VARS if launch.env.get(k)}
    if env:
        lines.append(f"#   environment: {' '.join(f'{k}={v}' for k, v in env.items())}")
    if m.notes:
        lines.append("# Reinterpreted:")
        for note in m.notes:
            lines += textwrap.wrap(note, 98, initial_indent="#   - ", subsequent_indent="#     ")
    for section in SECTIONS:
        if section not in m.values:
            continue
        lines.append(f"{section}:")
        for name, value in m.values[section].items():
            key = f"{section}.{name}"
            comment = m.comments.get(key) or m.sources.get(key)
            text = f"  {name}: {scalar(value)}"
            lines.append(f"{text}  # {comment}" if comment else text)
    return "\n".join(lines) + "\n"


def blame(problem: str, m: Migration) -> str:
    """The script arguments a validation problem comes from, as ' [from: …]'."""
    keys = [key for key in m.sources
            if re.search(rf"(?<!\w){re.escape(key.split('.')[1])}(?!\w)", problem)]
    keys += [key for word, key in PROBLEM_WORDS.items()
             if re.search(rf"(?<!\w){re.escape(word)}(?!\w)", problem) and key in m.sources]
    labels = list(dict.fromkeys(m.sources[key] for key in keys))
    return f" [from: {'; '.join(labels)}]" if labels else ""


def validate(text: str, m: Migration) -> Plan:
    """Load the YAML as ``pretrain.py --config`` would and build its plan; a ConfigError becomes
    a MigrationError naming the script arguments behind each problem."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build_plan(from_dict(yaml.safe_load(text)))
    except ConfigError as err:
        problems = [p.strip() for p in str(err).split("\n  - ")]
        if len(problems) > 1:  # build_plan: "invalid configuration:" and one line each
            problems.pop(0)
        raise MigrationError("\n  - ".join(["the migrated config is invalid:"] +
                                           [p + blame(p, m) for p in problems])) from None


# --------------------------------------------------------------------------- command line

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("launch", nargs="+", metavar="SCRIPT_OR_ARGUMENT",
                        help="a launch script (one path) or the 25 arguments of run_mcore_qwen.sh")
    parser.add_argument("--output", "-o", metavar="FILE",
                        help="write the YAML here (default: stdout)")
    parser.add_argument("--script", metavar="NAME",
                        help=f"the launch script the arguments are for (default: the one the "
                             f"script file calls, else {REFERENCE_SCRIPT}, the PAI guide's; a "
                             f"name without 'no-overlap' passes --overlap-grad-reduce "
                             f"--overlap-param-gather)")
    return parser.parse_args(argv)


def read_launch(args: argparse.Namespace, environ: Mapping[str, str]) -> Launch:
    """The launch from a script file or from the arguments themselves."""
    if len(args.launch) == 1:
        path = Path(args.launch[0])
        if not path.is_file():
            raise MigrationError(f"{path}: no such launch script (or give all 25 arguments)")
        launch = parse_script(path, environ)
    else:
        env = {k: environ[k] for k in ENV_VARS if k in environ}
        launch = Launch(tuple(args.launch), env)
    if args.script:
        launch = Launch(launch.args, launch.env, args.script, launch.source)
    return launch


def main(argv=None, environ: Optional[Mapping[str, str]] = None) -> int:
    args = parse_args(argv)
    try:
        launch = read_launch(args, os.environ if environ is None else environ)
        migration = migrate(launch)
        text = render(migration, launch)
        validate(text, migration)
    except MigrationError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for note in migration.notes:
        print(note, file=sys.stderr)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
