"""What ``examples/qwen3/run_mcore_qwen3.sh`` does differently from the Qwen2.5 scripts: its
MODEL_SIZE branches (dense 0.6B-32B, MoE A3B and A22B with ETP / EP), its optimizer offload
fraction, its uneven first pipeline stage (MP_PP0_LAYERS) and its fp8 recipe.

The model comes from Megatron options, not from numbers: each MODEL_SIZE branch sets variables
and option strings (``moe_options`` above all) that the script splices into its torchrun
line. They are read from the user's copy of the script when one is given (``--script PATH``),
else taken from the published script (Pai-Megatron-Patch a098ca5), and mapped option by
option by :mod:`.megatron_options`. Part of :mod:`.mapping`'s ``migrate``.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Mapping

from ray_ppu.config.presets import PRESETS
from ray_ppu.errors import MigrationError
from ray_ppu.tools.pai_migration.bash import branch_assignments
from ray_ppu.tools.pai_migration.launch import Arguments, Launch, Migration
from ray_ppu.tools.pai_migration.megatron_options import Options, read_options

# The published script's MODEL_SIZE branches: NUM_LAYERS, HIDDEN_SIZE, NUM_ATTENTION_HEADS,
# INTERMEDIATE_SIZE, NUM_KEY_VALUE_HEADS, untied embeddings, and for MoE (NUM_EXPERTS,
# ROUTER_TOPK, MOE_INTERMEDIATE_SIZE). Every branch: 40960 positions, vocabulary 151936,
# RoPE base 1e6, RMSNorm epsilon 1e-6.
SIZES = {
    "0.6B": (28, 1024, 16, 3072, 8, False, None),
    "1.7B": (28, 2048, 16, 6144, 8, False, None),
    "4B": (36, 2560, 32, 9728, 8, False, None),
    "8B": (36, 4096, 32, 12288, 8, True, None),
    "14B": (40, 5120, 40, 17408, 8, True, None),
    "32B": (64, 5120, 64, 25600, 8, True, None),
    "A3B": (48, 2048, 32, 6144, 4, True, (128, 8, 768)),
    "A22B": (94, 4096, 64, 12288, 4, True, (128, 8, 1536)),
}
PRESET_NAMES = {"A3B": "qwen3-30B-A3B", "A22B": "qwen3-235B-A22B"}  # else qwen3-<MODEL_SIZE>
# The model part of the script's megatron_options: option, then the branch variable giving
# its value ('' = a switch). The script always passes these; the branch's option strings
# follow them on the torchrun line.
MODEL_OPTIONS = (
    ("--num-layers", "NUM_LAYERS"), ("--hidden-size", "HIDDEN_SIZE"),
    ("--num-attention-heads", "NUM_ATTENTION_HEADS"), ("--ffn-hidden-size", "INTERMEDIATE_SIZE"),
    ("--max-position-embeddings", "MAX_POSITION_EMBEDDINGS"),
    ("--padded-vocab-size", "VOCAB_SIZE"), ("--swiglu", ""), ("--normalization", "=RMSNorm"),
    ("--norm-epsilon", "RMS_NORM_EPS"), ("--disable-bias-linear", ""),
    ("--rotary-base", "ROPE_THETA"), ("--qk-layernorm", ""), ("--kv-channels", "=128"),
)
BRANCH_OPTIONS = ("moe_options", "tie_option", "gqa_options")  # in the torchrun line's order
# Keys written even when they equal the preset: what sets Qwen3 apart from Qwen2.5 (per-head
# norms and width, no bias) and its experts, stated in the config rather than left to it.
EXPLICIT = {"model.kv_channels", "model.qk_layernorm", "model.add_qkv_bias",
            "model.num_moe_experts", "model.moe_router_topk", "model.moe_ffn_hidden_size",
            "model.moe_norm_topk_prob", "model.moe_aux_loss_coeff"}


def published_branch(size: str, etp: str, ep: str) -> dict[str, str]:
    """The variables the published script's ``[ $MODEL_SIZE = size ]`` branch leaves."""
    layers, hidden, heads, ffn, groups, untied, moe = SIZES[size]
    branch = dict(NUM_LAYERS=str(layers), HIDDEN_SIZE=str(hidden), NUM_ATTENTION_HEADS=str(heads),
                  INTERMEDIATE_SIZE=str(ffn), MAX_POSITION_EMBEDDINGS="40960",
                  VOCAB_SIZE="151936", ROPE_THETA="1000000", RMS_NORM_EPS="1e-6",
                  gqa_options=f"--group-query-attention --num-query-groups {groups}",
                  tie_option="--untie-embeddings-and-output-weights" if untied else "",
                  moe_options="")
    if moe:
        experts, topk, expert_ffn = moe
        branch["moe_options"] = shlex.join([
            "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
            "--moe-router-topk", str(topk), "--num-experts", str(experts),
            "--expert-tensor-parallel-size", etp, "--expert-model-parallel-size", ep,
            "--moe-ffn-hidden-size", str(expert_ffn), "--moe-router-load-balancing-type",
            "aux_loss", "--moe-aux-loss-coeff", "0.001", "--moe-layer-freq", f"([1]*{layers})"])
    return branch


def read_branch(a: Arguments, launch: Launch) -> tuple[dict[str, str], dict[str, str], str]:
    """(variables, why any could not be read, origin) of the MODEL_SIZE branch: the user's
    copy of the script when given, else the published one."""
    size, label = a.raw("MODEL_SIZE"), a.label("MODEL_SIZE")
    known = {"ETP": a.raw("ETP"), "EP": a.raw("EP")}
    if launch.script_path is None:
        if size not in SIZES:
            raise MigrationError(f"{label}={size!r}: {launch.script} has no branch for it "
                                 f"(NUM_LAYERS would be unset); its sizes: {', '.join(SIZES)}")
        return published_branch(size, known["ETP"], known["EP"]), {}, label
    path = Path(launch.script_path)
    found = branch_assignments(path, "MODEL_SIZE", size, known)
    if found is None:
        raise MigrationError(f"{label}={size!r}: {path} has no [ $MODEL_SIZE = {size} ] branch "
                             f"(NUM_LAYERS would be unset)")
    return found[0], found[1], f"{path}, MODEL_SIZE={size} branch"


def branch_words(branch: Mapping[str, str], unreadable: Mapping[str, str],
                 origin: str) -> list[str]:
    """The model options the script's torchrun line gets from the branch (eval splits each
    option string into words, removing the quotes inside, such as ``'([1]*48)'``'s)."""
    def value(name: str) -> str:
        if name in unreadable:
            raise MigrationError(unreadable[name])
        if not branch.get(name):
            raise MigrationError(f"{origin}: {name} is not set (the script would pass an "
                                 f"empty value to Megatron)")
        return branch[name]

    words = []
    for option, source in MODEL_OPTIONS:
        words.append(option)
        if source:
            words.append(source[1:] if source.startswith("=") else value(source))
    for name in BRANCH_OPTIONS:
        if name in unreadable:
            raise MigrationError(unreadable[name])
        try:
            words += shlex.split(branch.get(name, ""))
        except ValueError as err:
            raise MigrationError(f"{origin}: {name} cannot be split ({err})") from None
    return words


def map_model(a: Arguments, m: Migration, launch: Launch) -> int:
    """MODEL_SIZE → qwen3 preset, the branch's options against it; returns NUM_LAYERS."""
    size = a.raw("MODEL_SIZE")
    branch, unreadable, origin = read_branch(a, launch)
    if branch.get("moe_options", "").strip():  # errors name the argument, not the option
        a.integer("ETP")
        a.integer("EP")
    else:
        unused = [f"{n}={a.raw(n)}" for n in ("ETP", "EP") if a.raw(n) != "1"]
        if unused:
            m.note(f"{', '.join(unused)} unused: MODEL_SIZE={size} is dense (the script passes "
                   f"no MoE options)")
    options = read_options(branch_words(branch, unreadable, origin), origin)
    preset_name = PRESET_NAMES.get(size, f"qwen3-{size}")
    preset = PRESETS.get(preset_name)
    if preset is None:
        m.note(f"MODEL_SIZE={size}: no ray_ppu preset {preset_name}; every model value is "
               f"written from {origin}")
    else:
        m.set("model.preset", preset_name, a.label("MODEL_SIZE"))
    apply(a, m, options, preset, size, origin)
    for note in options.notes:
        m.note(note)
    return options.values["model.num_layers"]


def apply(a: Arguments, m: Migration, options: Options, preset, size: str,
          origin: str) -> None:
    """Write the options' values: every parallel one, model ones that differ from the preset
    (noted) or are in EXPLICIT; each with its option and where that came from."""
    for key, value in options.values.items():
        section, name = key.split(".")
        flag = options.flags[key]
        if key == "parallel.expert_model_parallel_size":
            source = f"{a.label('EP')}: {flag}"
        elif key == "parallel.expert_tensor_parallel_size":
            source = f"{a.label('ETP')}: {flag}"
        else:
            source = f"{origin}: {flag}"
        if section == "model" and preset is not None:
            if getattr(preset, name) != value:
                m.note(f"MODEL_SIZE={size}: the script sets {name} {value} ({flag}) where the "
                       f"preset {preset.preset} has {getattr(preset, name)}; model.{name}={value}")
            elif key not in EXPLICIT:
                continue
        m.set(key, value, source)
    vocab = options.values.get("model.vocab_size")
    tp = a.integer("TP")
    multiple = 128 * tp  # Megatron's make-vocab-size-divisible-by 128, times TP
    if vocab is not None and vocab % multiple:
        m.note(f"--padded-vocab-size {vocab}: Megatron keeps exactly {vocab} embedding rows; "
               f"ray_ppu pads them to {-(-vocab // multiple) * multiple} at TP {tp} (rows no "
               f"token id reaches)")


def map_offload(a: Arguments, m: Migration) -> None:
    """OPTIMIZER_OFFLOAD: false, or the fraction of optimizer states the script offloads
    (--optimizer-offload-fraction ${OPTIMIZER_OFFLOAD}, a float to Megatron)."""
    text, label = a.raw("OPTIMIZER_OFFLOAD"), a.label("OPTIMIZER_OFFLOAD")
    if text == "false":
        m.set("memory.optimizer_offload", "none", label)
        return
    try:
        fraction = float(text)
    except ValueError:
        raise MigrationError(f"{label}={text!r}: expected false or the fraction of optimizer "
                             f"states to offload (the script passes it to "
                             f"--optimizer-offload-fraction)") from None
    m.set("memory.optimizer_offload", "static", label)
    m.set("memory.optimizer_offload_fraction", fraction, label)
    m.note(f"OPTIMIZER_OFFLOAD={text}: the script offloads that fraction of the optimizer states "
           f"(--optimizer-cpu-offload --use-precision-aware-optimizer); "
           f"memory.optimizer_offload=static, memory.optimizer_offload_fraction={fraction:g}")


def map_uneven_pipeline(a: Arguments, m: Migration, num_layers: int) -> None:
    """MP_PP0_LAYERS: layers of the first pipeline stage, which ray_ppu cannot make uneven."""
    if not a.env_value("MP_PP0_LAYERS"):
        return
    first, pp = a.integer("MP_PP0_LAYERS"), a.integer("PP")
    if pp == 1:
        raise MigrationError(f"MP_PP0_LAYERS={first} with PP=1: the script stops with \"uneven "
                             f"pipeline split must be used when PP > 1\"")
    if (num_layers - first) % (pp - 1):
        raise MigrationError(f"MP_PP0_LAYERS={first}: ({num_layers} layers - {first}) % (PP {pp} "
                             f"- 1) = {(num_layers - first) % (pp - 1)}; the script stops with "
                             f"\"With uneven pipelineing the left over layers must be divisible "
                             f"by left over stages.\"")
    m.note(f"MP_PP0_LAYERS={first}: the script gives the first pipeline stage {first} layers "
           f"(--decoder-first-pipeline-num-layers); ray_ppu splits the {num_layers} layers "
           f"evenly over PP {pp}: not reproduced")


def fp8_recipe_note(m: Migration) -> None:
    m.note("PR=fp8: the script passes --fp8-format hybrid --fp8-recipe blockwise; ray_ppu's fp8 "
           "scales per tensor from an amax history (delayed scaling): the blockwise recipe is "
           "not reproduced")
