"""The mapping of what ``run_mcore_qwen*.sh`` reads and writes: the dataset (idxmap or raw JSON),
the checkpoints it saves and the one it starts from, and the output directory and run name.

These are the settings whose meaning depends on files: the data type changes which arguments
are used at all, and PRETRAIN_CHECKPOINT_PATH is read as a Hugging Face model directory or a
Megatron checkpoint depending on what is on disk. Part of :mod:`.mapping`'s ``migrate``.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from ray_ppu.errors import MigrationError
from ray_ppu.tools.pai_migration.launch import Arguments, Migration


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
            raise MigrationError(f"MP_DATASET_TYPE=raw: the script tokenizes with the Hugging "
                                 f"Face tokenizer in {a.label('PRETRAIN_CHECKPOINT_PATH')}, "
                                 f"which is none")
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
    family = "qwen3-moe-megatron" if a.qwen3 else "qwen2.5"  # each script's PREFIX
    prefix = (f"{'finetune' if sft else 'pretrain'}-mcore-{family}-{a.raw('MODEL_SIZE')}"
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
