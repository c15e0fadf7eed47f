"""Convert between Hugging Face model directories and ray_ppu (torch_dist) checkpoints.

    # HF → torch_dist, for runs that start from this model again and again (checkpoint.load=…)
    python entrypoints/convert_checkpoint.py hf-to-mcore --hf /ckpt/Qwen2.5-7B --out /ckpt/qwen7b_mcore
    torchrun --nproc-per-node 8 entrypoints/convert_checkpoint.py hf-to-mcore --hf … --out … --tp 8

    # torch_dist (a training checkpoint saved at any TP / PP / DP) → HF safetensors
    python entrypoints/convert_checkpoint.py mcore-to-hf --checkpoint outputs/run/ray_train/run \\
        --out /ckpt/qwen7b_sft_hf

hf-to-mcore builds the model at --tp × --pp over the process group (one process, or torchrun's
ranks, which split the weights between them) and writes ``<out>/iter_0000000``, weights only:
a run loading it starts at iteration 0 with a fresh optimizer. The layout does not bind the
runs that load it (torch_dist reshards). Starting straight from the HF directory
(``checkpoint.pretrained``) needs no conversion at all; this saves the safetensors reads.

A LoRA run's checkpoint (adapters only) becomes a Hugging Face PEFT adapter directory
(adapter_config.json + adapter_model.safetensors: peft.PeftModel.from_pretrained(base, DIR)),
or with --merge its base with the adapters merged in, a plain Hugging Face model. A
Qwen2.5-VL run's PEFT adapter targets Qwen2_5_VLForConditionalGeneration's language model
(transformers 5 module names); a LLaVA run's exports with --merge only.

Vision-language models convert both ways too: LLaVA (LlavaForConditionalGeneration) and
Qwen2.5-VL (written in the published spelling, ``model.*`` / ``visual.*`` / ``lm_head.weight``,
with the source's preprocessor_config.json).

mcore-to-hf needs one process and no device: it reads one layer at a time and writes ≤ 5 GB
shards with an index, config.json (the source model's own when the run started from one),
generation_config.json and the tokenizer files (--tokenizer, else the source HF directory),
so the result loads in transformers, vLLM and ModelScope tools. A checkpoint argument may be a
directory of checkpoints: the latest complete one is exported.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ray_ppu.errors import ConfigError, UserError, entry_point  # noqa: E402
from ray_ppu.errors import report_before_group  # noqa: E402

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*(B|KB|MB|GB)?$", re.IGNORECASE)


def size_bytes(text: str) -> int:
    """'5GB', '200MB', '1000' → bytes (decimal units, as transformers' max_shard_size)."""
    match = _SIZE.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size like 5GB, 200MB or 1000")
    unit = (match.group(2) or "B").upper()
    return int(float(match.group(1)) * {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}[unit])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="Hugging Face directory → torch_dist")
    to_mcore.add_argument("--hf", required=True, help="Hugging Face model directory")
    to_mcore.add_argument("--out", required=True, help="where iter_0000000/ is written")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default 1)")
    to_mcore.add_argument("--ep", type=int, default=1,
                          help="expert parallel size of a MoE model (default 1; each rank "
                               "reads only its experts)")
    to_mcore.add_argument("--precision", choices=["bf16", "fp16", "fp32"],
                          help="stored dtype (default: config.json's torch_dtype)")
    to_mcore.add_argument("--device", choices=["cpu", "ppu", "auto"], default="cpu",
                          help="where the model is built (default cpu: no device needed)")
    to_hf = sub.add_parser("mcore-to-hf", help="torch_dist checkpoint → Hugging Face directory")
    to_hf.add_argument("--checkpoint", required=True,
                       help="a checkpoint directory, or a directory of them (the latest)")
    to_hf.add_argument("--out", required=True, help="the Hugging Face directory to write")
    to_hf.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                       help="tensor dtype (default: as stored)")
    to_hf.add_argument("--tokenizer", help="directory whose tokenizer files are copied "
                                           "(default: those the checkpoint carries, else the "
                                           "source Hugging Face directory's)")
    to_hf.add_argument("--base", metavar="DIR",
                       help="with --merge: where the LoRA run's base is now, if it moved "
                            "(checked against the fingerprint the checkpoint recorded)")
    to_hf.add_argument("--max-shard-size", type=size_bytes, default="5GB",
                       help="largest safetensors shard (default 5GB, as upstream)")
    to_hf.add_argument("--merge", action="store_true",
                       help="a LoRA run's checkpoint: write its base with the adapters merged "
                            "in (default: a PEFT adapter directory)")
    return parser.parse_args(argv)


def _to_hf(args: argparse.Namespace) -> dict:
    """mcore-to-hf: a full checkpoint's Hugging Face form; a LoRA run's PEFT adapter, or with
    --merge its base with the adapters merged in."""
    from ray_ppu.offline.mcore_to_hf import export
    from ray_ppu.offline.source import open_source

    source = open_source(args.checkpoint)
    lora = source.kind == "mcore" and source.meta.lora is not None
    if lora:
        from ray_ppu.offline.lora_export import export_merged, export_peft

        if not args.merge:
            return export_peft(source.path, args.out)
        return export_merged(source.path, args.out, args.dtype, args.tokenizer,
                             args.max_shard_size, base_at=args.base)
    if args.merge or args.base:
        flag = "--merge" if args.merge else "--base"
        raise ConfigError(f"{flag}: {source.path} is no LoRA run's checkpoint (nothing to "
                          f"merge; drop {flag})")
    summary = export(args.checkpoint, args.out, args.dtype, args.tokenizer, args.max_shard_size)
    if not summary["tokenizer"]:
        print("note: no tokenizer files copied (pass --tokenizer DIR)", file=sys.stderr)
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    grouped = False
    try:
        if args.command == "hf-to-mcore":
            from ray_ppu.devices import resolve
            from ray_ppu.offline.hf_to_mcore import conversion_plan, to_mcore

            try:
                backend = resolve(args.device)
            except RuntimeError as err:  # ppu asked for where torch.cuda sees no device
                raise ConfigError(str(err)) from None
            # Source and layout for the world the process group will have (torchrun's
            # WORLD_SIZE, else one process): one error line before any rank joins it, and
            # before Megatron-Core is imported (8 s a process)
            conversion_plan(args.hf, int(os.environ.get("WORLD_SIZE", 1)), args.tp, args.pp,
                            args.precision, backend, args.ep)
            from ray_ppu.model.parallel import process_group

            with process_group(backend):
                import torch.distributed as dist

                grouped = True  # a problem from here on may be one rank's own
                summary = to_mcore(args.hf, args.out, args.tp, args.pp, args.precision,
                                   backend, args.ep)
                if dist.get_rank() != 0:
                    return 0
        else:
            summary = _to_hf(args)
    except UserError as err:
        if grouped:  # in the process group: maybe this rank's own problem
            print(f"error: {err}", file=sys.stderr)
            return 2
        return report_before_group(err)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":  # dist_checkpointing starts spawn-context helpers: guard needed
    sys.exit(entry_point(main))
