"""Migrate a PAI-Megatron-Patch launch (``run_mcore_qwen*.sh``) to a ray_ppu YAML config.

    python entrypoints/from_pai_script.py examples/run_dsw_7b.sh --output run.yaml
    python entrypoints/from_pai_script.py --output run.yaml -- \\
        dsw 7B 1 256 1e-5 1e-6 4096 4096 bf16 1 1 1 true true true false false false 100000 \\
        DATASET_PATH VALID_DATASET_PATH PRETRAIN_CHECKPOINT_PATH 10000000000 1000000 OUTPUT_BASEPATH
    python entrypoints/pretrain.py --config run.yaml --dry-run --plan-only
    python entrypoints/from_pai_script.py --script examples/qwen3/run_mcore_qwen3.sh \\
        --output run.yaml -- dsw A3B 1 32 1e-5 1e-6 1024 1024 bf16 2 1 1 1 8 true true true ...
    python entrypoints/from_pai_script.py --script finetune/finetune_lora_ds.sh --output run.yaml

Give either the 25 positional arguments of ``run_mcore_qwen.sh`` (ENV MODEL_SIZE BATCH_SIZE
GLOBAL_BATCH_SIZE LR MIN_LR SEQ_LEN PAD_LEN PR TP PP CP SP DO FL SFT AC OPTIMIZER_OFFLOAD
SAVE_INTERVAL DATASET_PATH VALID_DATASET_PATH PRETRAIN_CHECKPOINT_PATH TRAIN_TOKENS_OR_ITERS
WARMUP_TOKENS_OR_ITERS OUTPUT_BASEPATH; ``run_mcore_qwen3.sh``'s 27 add ETP EP after CP) or
one path to a script such as the PAI guide's ``run_dsw_7b.sh`` that calls
``run_mcore_qwen*.sh``: its arguments are read from that call (line continuations, comments,
``VAR=value cmd`` prefixes, ``export``/``unset`` lines, ``$VAR``). For run_mcore_qwen3.sh the
model and MoE options (experts, top-k, dispatcher, load balancing, layer pattern) are those of
its MODEL_SIZE branch: the published script's, or those of your copy with ``--script PATH``.

The script's environment variables MP_DATASET_TYPE, MP_AC_LAYERS, MP_VP, MP_SFT_PACKING,
MP_PP0_LAYERS (run_mcore_qwen3.sh) and WORLD_SIZE (ENV=dlc: nodes) come from this process's
environment, overridden by the parsed script. The config reproduces what the script does,
with the script's own arithmetic (bash integer division for the iteration counts); every
setting that had to be reinterpreted is printed on stderr, one line each, and repeated in the
YAML header. The config is validated with ``ray_ppu.config.loader.load`` and
``ray_ppu.plan.build_plan`` before it is written; a problem is reported with the script
argument it comes from (exit status 2).

A deepspeed + Hugging Face Trainer launch (a script passing ``--model_name_or_path``, such as
Qwen-VL's ``finetune/finetune_lora_ds.sh``, given with ``--script`` or as the one path) is
migrated from its trainer options instead: the model path to a qwen2.5-vl preset and
checkpoint.pretrained, batch and accumulation × the launcher's world size to the global batch,
epochs to iterations, LoRA, gradient checkpointing and the ZeRO stage; the options with no
ray_ppu setting are named on stderr (ray_ppu.tools.pai_migration.hf_mapping).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Mapping, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ray_ppu.errors import MigrationError, entry_point  # noqa: E402
from ray_ppu.tools.pai_migration import REFERENCE_SCRIPT, migrate_launch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("launch", nargs="*", metavar="SCRIPT_OR_ARGUMENT",
                        help="a launch script (one path) or the arguments of run_mcore_qwen*.sh "
                             "(25; 27 for run_mcore_qwen3.sh)")
    parser.add_argument("--output", "-o", metavar="FILE",
                        help="write the YAML here (default: stdout)")
    parser.add_argument("--script", metavar="NAME_OR_PATH",
                        help=f"the launch script the arguments are for (default: the one the "
                             f"script file calls, else {REFERENCE_SCRIPT}, the PAI guide's; a "
                             f"Qwen2.5 name without 'no-overlap' passes --overlap-grad-reduce "
                             f"--overlap-param-gather); the path of your copy of "
                             f"run_mcore_qwen3.sh to read its MODEL_SIZE branch; or, alone, "
                             f"a deepspeed + Hugging Face Trainer launch such as Qwen-VL's "
                             f"finetune/finetune_lora_ds.sh")
    args = parser.parse_args(argv)
    if not args.launch and not args.script:
        parser.error("give a launch script, the launch script's arguments, or --script PATH")
    return args


def main(argv=None, environ: Optional[Mapping[str, str]] = None) -> int:
    args = parse_args(argv)
    try:
        migrated = migrate_launch(args.launch, environ, args.script, args.output)
    except MigrationError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for note in migrated.notes:
        print(note, file=sys.stderr)
    if not args.output:
        sys.stdout.write(migrated.text)
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main))
