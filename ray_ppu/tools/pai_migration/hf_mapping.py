"""The mapping of a Hugging Face Trainer launch (Qwen-VL's ``finetune.py`` under deepspeed) to
ray_ppu settings, option by option, with the Trainer's own arithmetic.

The Trainer's defaults count where the call is silent (learning_rate 5e-5, weight_decay 0,
adam_beta2 0.999, a linear schedule, 3 epochs, fp32), and so do finetune.py's (model_max_length
8192, fix_vit true, LoRA r 64 / alpha 16 / dropout 0.05 on Qwen-VL's c_attn, attn.c_proj, w1,
w2): every value is written with its origin, so the config does not rest on ray_ppu's defaults,
which differ. Epochs become iterations as transformers 4.32 (Qwen-VL's pinned version) counts
them: accelerate hands each of W ranks ⌈⌈N / mbs⌉ / W⌉ batches per epoch, an update takes
gradient_accumulation_steps of them (at least one update per epoch), and the steps are
⌈epochs × updates per epoch⌉. Every option without a ray_ppu setting is named in one note.
"""

from __future__ import annotations

import math
import re

from ray_ppu.config.presets import PRESETS
from ray_ppu.errors import MigrationError
from ray_ppu.tools.pai_migration import hf_trainer
from ray_ppu.tools.pai_migration.hf_trainer import TrainerCall
from ray_ppu.tools.pai_migration.launch import Migration
from ray_ppu.tools.pai_migration.mapping import GPUS_PER_NODE

# transformers.TrainingArguments' defaults and finetune.py's own, for options the call omits
DEFAULTS = {"learning_rate": "5e-5", "weight_decay": "0.0", "adam_beta1": "0.9",
            "adam_beta2": "0.999", "adam_epsilon": "1e-8", "max_grad_norm": "1.0",
            "num_train_epochs": "3.0", "max_steps": "-1", "per_device_train_batch_size": "8",
            "gradient_accumulation_steps": "1", "lr_scheduler_type": "linear",
            "warmup_ratio": "0.0", "warmup_steps": "0", "logging_steps": "500",
            "save_strategy": "steps", "save_steps": "500", "model_max_length": "8192",
            "fix_vit": "True", "lora_r": "64", "lora_alpha": "16", "lora_dropout": "0.05",
            "lora_target_modules": "c_attn attn.c_proj w1 w2", "lora_bias": "none"}
# LoRA target names (Qwen-VL's, then Qwen2.5's) → Megatron-Core's fused linears
TARGETS = {"c_attn": "linear_qkv", "attn.c_proj": "linear_proj", "w1": "linear_fc1",
           "w2": "linear_fc1", "mlp.c_proj": "linear_fc2", "q_proj": "linear_qkv",
           "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
           "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant",
             "constant_with_warmup": "constant"}
# options read by the mapping below; the rest of the call is named as not reproduced
MAPPED = set(DEFAULTS) | {"model_name_or_path", "data_path", "eval_data_path", "bf16", "fp16",
                          "output_dir", "save_total_limit", "gradient_checkpointing",
                          "deepspeed", "use_lora", "q_lora", "report_to", "evaluation_strategy"}


class Options:
    """The call's options with the defaults under them, each value's label for the comments."""

    def __init__(self, call: TrainerCall):
        self.call = call

    def text(self, name: str) -> str:
        return self.call.options.get(name, DEFAULTS.get(name, ""))

    def label(self, name: str) -> str:
        given = name in self.call.options
        return self.call.label(name) if given else f"--{name} default {DEFAULTS.get(name, '')}"

    def flag(self, name: str) -> bool:
        value = self.text(name) or "False"
        if value not in ("True", "False", "true", "false", "1", "0"):
            raise MigrationError(f"{self.label(name)}={value!r}: expected True or False")
        return value in ("True", "true", "1")

    def number(self, name: str) -> float:
        try:
            return float(self.text(name))
        except ValueError:
            raise MigrationError(f"{self.label(name)}={self.text(name)!r}: expected a "
                                 f"number") from None

    def integer(self, name: str, minimum: int = 1) -> int:
        text = self.text(name)
        if not re.fullmatch(r"-?[0-9]+", text) or int(text) < minimum:
            raise MigrationError(f"{self.label(name)}={text!r}: expected an integer ≥ {minimum}")
        return int(text)


def map_cluster(o: Options, m: Migration) -> int:
    """The launcher's processes → workers (one per PPU); returns the world size."""
    world, how = hf_trainer.world_size(o.call)
    m.set("cluster.num_workers", world, f"{o.call.source}: {how}")
    m.set("cluster.device", "ppu")
    m.set("cluster.accelerator", "ppu-810e")
    if world % GPUS_PER_NODE:
        m.note(f"{how}: cluster.num_workers={world}; ray_ppu places one worker per PPU, 16 "
               f"per 810E node")
    return world


def map_model(o: Options, m: Migration) -> str:
    """--model_name_or_path → a qwen2.5-vl preset and checkpoint.pretrained; returns the preset."""
    path = o.text("model_name_or_path")
    if not path:
        raise MigrationError(f"{o.call.source}: the call passes no --model_name_or_path value")
    name = path.rstrip("/").lower()
    sized = re.search(r"qwen2\.5-vl-(\d+)b", name)
    if sized and f"qwen2.5-vl-{sized.group(1)}B" in PRESETS:
        preset, pretrained = f"qwen2.5-vl-{sized.group(1)}B", path
    elif re.search(r"qwen-vl", name):
        preset, pretrained = "qwen2.5-vl-7B", "Qwen/Qwen2.5-VL-7B-Instruct"
        m.note(f"--model_name_or_path {path}: Qwen-VL (Qwen-7B + a 1.9 B ViT-bigG) is not a "
               f"ray_ppu model; migrated to its successor at the same language size, "
               f"model.preset={preset}, checkpoint.pretrained={pretrained}")
    else:
        known = ", ".join(p for p in PRESETS if p.startswith("qwen2.5-vl-"))
        raise MigrationError(f"{o.label('model_name_or_path')}={path}: not a Qwen2.5-VL or "
                             f"Qwen-VL model; ray_ppu's presets for it: {known}")
    label = o.label("model_name_or_path")
    m.set("model.preset", preset, label)
    m.set("checkpoint.pretrained", pretrained, label)
    m.set("data.tokenizer", pretrained, f"{label}: AutoTokenizer.from_pretrained")
    return preset


def map_batch(o: Options, m: Migration, world: int) -> tuple[int, int]:
    """Micro batch, gradient accumulation × world → global batch, sequence, precision;
    returns (micro batch, accumulation)."""
    mbs = o.integer("per_device_train_batch_size")
    steps = o.integer("gradient_accumulation_steps")
    m.set("training.micro_batch_size", mbs, o.label("per_device_train_batch_size"))
    m.set("training.global_batch_size", mbs * steps * world,
          f"{o.label('per_device_train_batch_size')}, {o.label('gradient_accumulation_steps')}",
          f"{world} DP × {mbs} mbs × {steps} microbatches = {mbs * steps * world}")
    seq = o.integer("model_max_length")
    m.set("training.seq_length", seq, o.label("model_max_length"))
    m.set("data.max_padding_length", seq, o.label("model_max_length"),
          "finetune.py pads every sample to model_max_length")
    if o.flag("bf16"):
        m.set("training.precision", "bf16", o.label("bf16"))
    elif o.flag("fp16"):
        m.set("training.precision", "fp16", o.label("fp16"))
    else:
        m.set("training.precision", "fp32", "--bf16 / --fp16 unset: the Trainer trains in fp32")
    return mbs, steps


def train_steps(o: Options, world: int, mbs: int, steps: int) -> tuple[int, str]:
    """--max_steps, else epochs over the training JSON as the Trainer counts (module doc)."""
    if o.integer("max_steps", minimum=-1) > 0:
        return o.integer("max_steps"), o.label("max_steps")
    epochs = o.number("num_train_epochs")
    records = hf_trainer.record_count(o.text("data_path"), o.label("data_path"))
    batches = -(-(-(-records // mbs)) // world)  # ⌈⌈N / mbs⌉ / W⌉ per rank and epoch
    per_epoch = max(batches // steps, 1)
    total = math.ceil(epochs * per_epoch)
    return total, (f"{epochs:g} epochs × max(⌈⌈{records} records / {mbs}⌉ / {world}⌉ // "
                   f"{steps}, 1) = {epochs:g} × {per_epoch} = {total}")


def map_schedule(o: Options, m: Migration, world: int, mbs: int, steps: int) -> int:
    """Iterations, warmup (steps, else ⌈ratio × steps⌉), the decay and Adam; returns the steps."""
    total, how = train_steps(o, world, mbs, steps)
    m.set("training.train_iters", total, f"{o.label('num_train_epochs')}, {o.label('max_steps')}",
          how)
    if o.integer("warmup_steps", minimum=0):
        warmup, where = o.integer("warmup_steps"), o.label("warmup_steps")
    else:
        warmup = math.ceil(o.number("warmup_ratio") * total)
        where = f"⌈{o.label('warmup_ratio')} × {total}⌉"
    m.set("training.lr_warmup_iters", warmup, where)
    kind = o.text("lr_scheduler_type")
    style = SCHEDULES.get(kind)
    if style is None:
        style = "cosine"
        m.note(f"--lr_scheduler_type {kind}: ray_ppu decays cosine, linear or constant; "
               f"training.lr_decay_style=cosine")
    m.set("training.lr_decay_style", style, o.label("lr_scheduler_type"))
    m.set("training.lr_decay_iters", total, o.label("lr_scheduler_type"),
          f"the Trainer's decay reaches 0 at step {total}, after its {total} - {warmup} "
          f"steps of decay (the last step trains at a rate above 0)")
    m.set("training.lr", o.number("learning_rate"), o.label("learning_rate"))
    m.set("training.min_lr", 0.0, o.label("lr_scheduler_type"), "the Trainer's decay ends at 0")
    for ours, theirs in (("weight_decay", "weight_decay"), ("adam_beta1", "adam_beta1"),
                         ("adam_beta2", "adam_beta2"), ("adam_eps", "adam_epsilon"),
                         ("clip_grad", "max_grad_norm")):
        m.set(f"training.{ours}", o.number(theirs), o.label(theirs))
    return total


def map_memory(o: Options, m: Migration) -> None:
    """--gradient_checkpointing → full recompute of every layer; --deepspeed's ZeRO stage →
    the distributed optimizer (1, 2: sharded Adam and reduce-scattered gradients; 3 also
    shards the weights, which ray_ppu splits with TP / PP instead), its optimizer offload."""
    if o.flag("gradient_checkpointing"):
        label = o.label("gradient_checkpointing")
        m.set("memory.recompute", "full", label, "the Trainer checkpoints every layer")
        m.set("memory.recompute_method", "uniform", label)
        m.set("memory.recompute_num_layers", 1, label)
    else:
        m.set("memory.recompute", "none", "--gradient_checkpointing unset")
    config, given = hf_trainer.deepspeed_config(o.call)
    label = o.label("deepspeed")
    if not given:
        m.set("training.use_distributed_optimizer", False, "no --deepspeed: DDP")
        return
    if config is None:
        found = re.search(r"zero_?([0-3])", given)
        if found is None:
            raise MigrationError(f"{label}={given}: not found beside the script or here, and its "
                                 f"name gives no ZeRO stage")
        stage = int(found.group(1))
        m.note(f"--deepspeed {given} is not on this machine: ZeRO stage {stage} taken from its "
               f"name")
    else:
        stage = int((config.get("zero_optimization") or {}).get("stage", 0))
        offload = ((config.get("zero_optimization") or {}).get("offload_optimizer") or {})
        if offload.get("device") in ("cpu", "nvme"):
            m.set("memory.optimizer_offload", "static", f"{label}: offload_optimizer")
            m.set("memory.optimizer_offload_fraction", 1.0, f"{label}: offload_optimizer")
    m.set("training.use_distributed_optimizer", stage >= 1, f"{label}: ZeRO stage {stage}")
    if stage == 3:
        m.note(f"--deepspeed {given}: ZeRO-3 also shards the weights; ray_ppu shards the "
               f"optimizer (training.use_distributed_optimizer) and splits weights with "
               f"parallel.tensor_model_parallel_size / pipeline_model_parallel_size (not set)")


def map_lora(o: Options, m: Migration, preset: str) -> None:
    """--use_lora with finetune.py's LoraArguments; without it, --fix_vit (the tower frozen,
    its pooler — Qwen2.5-VL's merger — trained)."""
    if not o.flag("use_lora"):
        frozen = ["vision"] if o.flag("fix_vit") else []
        m.set("vision.freeze", frozen, o.label("fix_vit"))
        return
    if o.flag("q_lora"):
        raise MigrationError(f"{o.label('q_lora')}: a GPTQ 4-bit base has no ray_ppu equivalent "
                             f"(LoRA trains on a bf16 base); drop --q_lora")
    label = o.label("use_lora")
    m.set("lora.enabled", True, label)
    m.set("lora.rank", o.integer("lora_r"), o.label("lora_r"))
    m.set("lora.alpha", o.number("lora_alpha"), o.label("lora_alpha"))
    m.set("lora.dropout", o.number("lora_dropout"), o.label("lora_dropout"))
    names = o.text("lora_target_modules").replace(",", " ").split()
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise MigrationError(f"{o.label('lora_target_modules')}: {', '.join(unknown)} is not a "
                             f"linear ray_ppu adapts (known: {', '.join(TARGETS)})")
    targets = list(dict.fromkeys(TARGETS[n] for n in names))
    m.set("lora.target_modules", targets, o.label("lora_target_modules"),
          " + ".join(names) + " → the fused Megatron-Core linears")
    m.set("vision.freeze", ["vision", "projector"], label,
          "PEFT trains the adapters only (finetune.py reads --fix_vit only without LoRA)")
    if "chat" not in o.text("model_name_or_path").lower():
        tied = not PRESETS[preset].untie_embeddings_and_output_weights
        parts = ["embedding"] if tied else ["embedding", "output_layer"]
        m.set("lora.trainable", parts, o.label("model_name_or_path"),
              "finetune.py's modules_to_save wte, lm_head: the path names no chat model")
    if o.text("lora_bias") != "none":
        m.note(f"--lora_bias {o.text('lora_bias')}: ray_ppu's adapters train no biases; "
               f"not reproduced")


def map_files(o: Options, m: Migration, total: int) -> None:
    """Data, validation, checkpoints, logging and the output directory."""
    m.set("data.dataset", "sft", o.label("data_path"))
    m.set("data.data_path", [o.text("data_path")], o.label("data_path"))
    m.note("finetune.py's records are conversations from user / assistant with each image in "
           "the text as <img>path</img>; ray_ppu reads the same conversations with the images "
           "in an image / images field and an <image> tag in the text where each goes: convert "
           "the tags (data.image_root resolves relative paths)")
    evaluation = o.call.options.get("evaluation_strategy", "no")
    if o.text("eval_data_path") and evaluation != "no":
        m.set("data.valid_data_path", [o.text("eval_data_path")], o.label("eval_data_path"))
    else:
        m.set("training.eval_iters", 0, f"{o.label('eval_data_path')}, --evaluation_strategy "
              f"{evaluation}", "no evaluation")
    strategy = o.text("save_strategy")
    if strategy == "steps":
        m.set("checkpoint.save_interval", o.integer("save_steps"), o.label("save_steps"))
    elif strategy == "no":
        m.set("checkpoint.save_interval", total, o.label("save_strategy"),
              "--save_strategy no: the Trainer saves only at the end (its final save)")
    else:
        m.note(f"--save_strategy {strategy}: ray_ppu saves every checkpoint.save_interval "
               f"iterations; not set")
    if "save_total_limit" in o.call.options:
        m.set("checkpoint.keep_last", o.integer("save_total_limit"), o.label("save_total_limit"))
    m.set("training.log_interval", o.integer("logging_steps"), o.label("logging_steps"))
    if o.text("output_dir"):
        m.set("output.dir", o.text("output_dir"), o.label("output_dir"))
    report = o.call.options.get("report_to", "all")
    trackers = [t for t in re.split(r"[\s,]+", report) if t in ("mlflow", "wandb")]
    m.set("output.trackers", trackers, o.label("report_to") if "report_to" in o.call.options
          else "--report_to default all")
    m.set("output.tensorboard", report in ("all", "tensorboard"), "--report_to")


def unmapped(call: TrainerCall, m: Migration) -> None:
    """One note naming every option of the call that has no ray_ppu setting."""
    rest = [f"--{n} {call.options[n]}" for n in call.order if n not in MAPPED]
    if rest:
        m.note(f"not reproduced (no ray_ppu setting): {', '.join(rest)}")


def migrate_trainer(call: TrainerCall) -> Migration:
    """The ray_ppu config (with its notes) that reproduces one HF Trainer call."""
    o, m = Options(call), Migration()
    world = map_cluster(o, m)
    preset = map_model(o, m)
    mbs, steps = map_batch(o, m, world)
    total = map_schedule(o, m, world, mbs, steps)
    map_memory(o, m)
    map_lora(o, m, preset)
    map_files(o, m, total)
    unmapped(call, m)
    return m
