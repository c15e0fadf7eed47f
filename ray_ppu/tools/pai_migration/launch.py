"""A call of PAI-Megatron-Patch's ``run_mcore_qwen*.sh``: its positional arguments (25 for the
Qwen2.5 scripts, 27 for ``run_mcore_qwen3.sh``, which adds ETP and EP after CP) and the
environment variables it reads, parsed the way the script's bash does, and the config being
built from them with each value's origin.

The parsing is strict on purpose: bash and Megatron's argparse would stop on a malformed
value, so a migration that guessed would describe a run the script never makes. Errors name
the argument as the script does (``TRAIN_TOKENS_OR_ITERS (${23})``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Mapping, Optional

from ray_ppu.errors import MigrationError

ARGUMENTS = (
    "ENV", "MODEL_SIZE", "BATCH_SIZE", "GLOBAL_BATCH_SIZE", "LR", "MIN_LR", "SEQ_LEN", "PAD_LEN",
    "PR", "TP", "PP", "CP", "SP", "DO", "FL", "SFT", "AC", "OPTIMIZER_OFFLOAD", "SAVE_INTERVAL",
    "DATASET_PATH", "VALID_DATASET_PATH", "PRETRAIN_CHECKPOINT_PATH", "TRAIN_TOKENS_OR_ITERS",
    "WARMUP_TOKENS_OR_ITERS", "OUTPUT_BASEPATH",
)
# examples/qwen3/run_mcore_qwen3.sh: the expert-parallel sizes come right after CP.
QWEN3_ARGUMENTS = ARGUMENTS[:12] + ("ETP", "EP") + ARGUMENTS[12:]
ENV_VARS = ("MP_DATASET_TYPE", "MP_AC_LAYERS", "MP_VP", "MP_SFT_PACKING", "MP_PP0_LAYERS",
            "WORLD_SIZE")
REFERENCE_SCRIPT = "run_mcore_qwen-no-overlap.sh"  # the PAI guide's launch script
BASH_INT_MAX = 2**63 - 1


@dataclass(frozen=True)
class Launch:
    """One call of the launch script: its arguments and the environment it sees."""

    args: tuple[str, ...]
    env: Mapping[str, str]
    script: str = REFERENCE_SCRIPT
    source: str = "command-line arguments"
    script_path: Optional[str] = None
    """The user's copy of the launch script, read for what the arguments do not say (the
    MODEL_SIZE branch of run_mcore_qwen3.sh); None = the published script's behaviour."""

    @property
    def qwen3(self) -> bool:
        """A call of examples/qwen3's run_mcore_qwen3*.sh (27 arguments, Qwen3 models)."""
        return self.script.startswith("run_mcore_qwen3")

    @property
    def argument_names(self) -> tuple[str, ...]:
        return QWEN3_ARGUMENTS if self.qwen3 else ARGUMENTS


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
        self.names = names = launch.argument_names
        if len(launch.args) < len(names):
            missing = " ".join(names[len(launch.args):])
            raise MigrationError(f"{launch.source}: {len(launch.args)} arguments, "
                                 f"{launch.script} reads {len(names)}; missing: {missing}")
        self.values = dict(zip(names, launch.args))
        self.extra = launch.args[len(names):]
        self.env = launch.env
        self.qwen3 = launch.qwen3

    def raw(self, name: str) -> str:
        return self.values[name]

    def label(self, name: str) -> str:
        if name in ENV_VARS:
            return f"{name} (environment)"
        i = self.names.index(name) + 1
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
