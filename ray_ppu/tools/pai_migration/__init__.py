"""Migrating a PAI-Megatron-Patch launch (``run_mcore_qwen*.sh``) to a ray_ppu config
(``entrypoints/from_pai_script.py``).

A launch is read from the script's arguments themselves (25 for the Qwen2.5 scripts, 27 for
run_mcore_qwen3.sh) or from a script that calls the launch script (:mod:`.bash`), parsed as
the script's bash would (:mod:`.launch`), mapped to ray_ppu settings with the script's own
arithmetic (:mod:`.mapping`, :mod:`.paths`; Qwen3's model options: :mod:`.qwen3`,
:mod:`.megatron_options`), then written as
YAML and validated with the config loader and ``build_plan`` (:mod:`.report`). Nothing is
written unless it validates: a config that ``pretrain.py`` would reject is no migration.

A deepspeed + Hugging Face Trainer launch (Qwen-VL's ``finetune/finetune_lora_ds.sh``: a script
passing ``--model_name_or_path``) takes the same road: its call read by :mod:`.hf_trainer`,
mapped by :mod:`.hf_mapping`, rendered and validated as above.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

import yaml

from ray_ppu.errors import MigrationError
from ray_ppu.tools.pai_migration import hf_mapping, hf_trainer
from ray_ppu.tools.pai_migration.bash import parse_script
from ray_ppu.tools.pai_migration.launch import (
    ARGUMENTS, ENV_VARS, QWEN3_ARGUMENTS, REFERENCE_SCRIPT, Arguments, Launch, Migration,
)
from ray_ppu.tools.pai_migration.mapping import migrate
from ray_ppu.tools.pai_migration.paths import checkpoint_format
from ray_ppu.tools.pai_migration.report import render, validate

__all__ = ["ARGUMENTS", "ENV_VARS", "QWEN3_ARGUMENTS", "REFERENCE_SCRIPT", "Arguments", "Launch",
           "Migrated", "Migration", "MigrationError", "migrate", "migrate_launch", "parse_script",
           "read_launch", "render", "validate"]


@dataclass(frozen=True)
class Migrated:
    """A validated migration: the launch it reproduces, the config with its notes, the YAML."""

    launch: Launch
    migration: Migration
    text: str

    @property
    def notes(self) -> list[str]:
        return self.migration.notes


def read_launch(words: Sequence[str], environ: Mapping[str, str],
                script: Optional[str] = None) -> Launch:
    """The launch from a script file (one word: its path) or from the script's arguments
    themselves (then only the script's environment variables of ``environ`` count);
    ``script``: the launch script the arguments are for, instead of the one called or the PAI
    guide's: a name, or the path of the user's copy, which is then read where the arguments do
    not say everything (run_mcore_qwen3.sh's MODEL_SIZE branch)."""
    if len(words) == 1:
        path = Path(words[0])
        if not path.is_file():
            raise MigrationError(f"{path}: no such launch script (or give all the script's "
                                 f"arguments)")
        launch = parse_script(path, environ)
    else:
        env = {k: environ[k] for k in ENV_VARS if k in environ}
        launch = Launch(tuple(words), env)
    if script:
        copy = Path(script)
        if "/" in script and not copy.is_file():
            raise MigrationError(f"--script {script}: no such file")
        launch = Launch(launch.args, launch.env, copy.name, launch.source,
                        script if copy.is_file() else None)
    return launch


def migrate_launch(words: Sequence[str], environ: Optional[Mapping[str, str]] = None,
                   script: Optional[str] = None,
                   output: Optional[str | os.PathLike] = None) -> Migrated:
    """Read, migrate, render and validate one launch (see :func:`read_launch`; ``environ``:
    this process's by default); the YAML is written to ``output`` only once it validates.
    Raises MigrationError naming the script argument at fault."""
    environ = os.environ if environ is None else environ
    trainer = trainer_script(words, script)
    if trainer is not None:
        return migrate_trainer_script(trainer, environ, output)
    launch = read_launch(words, environ, script)
    migration = migrate(launch)
    text = render(migration, launch)
    validate(text, migration)
    if output is not None:
        Path(output).write_text(text)
    return Migrated(launch, migration, text)


def trainer_script(words: Sequence[str], script: Optional[str]) -> Optional[Path]:
    """The HF Trainer launch named by ``--script PATH`` alone or by one path, else None."""
    named = [Path(w) for w in ([script] if script else []) + list(words)[:1]]
    found = next((p for p in named if hf_trainer.is_trainer_script(p)), None)
    if found is not None and len(words) > (0 if script and Path(script) == found else 1):
        raise MigrationError(f"{found} is a Hugging Face Trainer launch (it passes "
                             f"--model_name_or_path): give its path alone")
    return found


def migrate_trainer_script(path: Path, environ: Mapping[str, str],
                           output: Optional[str | os.PathLike] = None) -> Migrated:
    """:func:`migrate_launch` for an HF Trainer launch. A checkpoint.pretrained that is not a
    model directory here (a hub name) is noted, and the plan is checked without its files."""
    call = hf_trainer.read_call(path, environ)
    migration = hf_mapping.migrate_trainer(call)
    pretrained = migration.values["checkpoint"]["pretrained"]
    local = checkpoint_format(pretrained) == "hf"
    if not local:
        migration.note(f"checkpoint.pretrained={pretrained} is not a model directory on this "
                       f"machine: download it there and set checkpoint.pretrained and "
                       f"data.tokenizer to that directory (pretrain.py reads its config.json; "
                       f"this migration checked the plan without it)")
    launch = Launch(call.words, {}, call.program, call.source)
    text = render(migration, launch)
    tree = yaml.safe_load(text)
    if not local:  # the plan alone: the base weights as a ray_ppu checkpoint's path
        tree["checkpoint"]["load"] = tree["checkpoint"].pop("pretrained")
    validate(yaml.safe_dump(tree, sort_keys=False), migration)
    if output is not None:
        Path(output).write_text(text)
    return Migrated(launch, migration, text)
