"""Migrating a PAI-Megatron-Patch launch (``run_mcore_qwen*.sh``) to a ray_ppu config
(``entrypoints/from_pai_script.py``).

A launch is read from the script's arguments themselves (25 for the Qwen2.5 scripts, 27 for
run_mcore_qwen3.sh) or from a script that calls the launch script (:mod:`.bash`), parsed as
the script's bash would (:mod:`.launch`), mapped to ray_ppu settings with the script's own
arithmetic (:mod:`.mapping`, :mod:`.paths`; Qwen3's model options: :mod:`.qwen3`,
:mod:`.megatron_options`), then written as
YAML and validated with the config loader and ``build_plan`` (:mod:`.report`). Nothing is
written unless it validates: a config that ``pretrain.py`` would reject is no migration.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ray_ppu.errors import MigrationError
from ray_ppu.tools.pai_migration.bash import parse_script
from ray_ppu.tools.pai_migration.launch import (
    ARGUMENTS, ENV_VARS, QWEN3_ARGUMENTS, REFERENCE_SCRIPT, Arguments, Launch, Migration,
)
from ray_ppu.tools.pai_migration.mapping import migrate
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
    launch = read_launch(words, os.environ if environ is None else environ, script)
    migration = migrate(launch)
    text = render(migration, launch)
    validate(text, migration)
    if output is not None:
        Path(output).write_text(text)
    return Migrated(launch, migration, text)
