"""Reading a deepspeed + Hugging Face Trainer launch, such as Qwen-VL's
``finetune/finetune_lora_ds.sh``: the one ``torchrun … finetune.py --option value …`` call in
it, the world size its launcher options give, and the DeepSpeed JSON it names.

Beside :mod:`.bash` (which reads calls of ``run_mcore_qwen*.sh``) because the shape differs:
the launcher's options come from a variable expanded without quotes (``$DISTRIBUTED_ARGS``,
split into words as bash splits it), the trainer's options are ``--name value`` pairs or bare
flags (HfArgumentParser: ``--use_lora`` means true), and a script computes things it never
uses (``DIR=`pwd```), which stay unknown unless the call reads them. The mapping of the
options to ray_ppu settings is :mod:`.hf_mapping`.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from ray_ppu.errors import MigrationError
from ray_ppu.tools.pai_migration.bash import (ASSIGNMENT, WRAPPERS, logical_lines, script_commands,
                                             simple_commands)

TRAINER_MARK = "--model_name_or_path"  # what makes a script an HF Trainer launch
LAUNCHERS = {"torchrun", "deepspeed", "python", "python3", "accelerate"}


@dataclass(frozen=True)
class TrainerCall:
    """One call of an HF Trainer script: where, its launcher's words, its options."""

    path: Path
    line: int
    program: str  # finetune.py
    launcher: tuple[str, ...]  # torchrun --nproc_per_node 8 --nnodes 1 …
    options: dict[str, str] = field(default_factory=dict)  # name (no dashes) → value
    order: tuple[str, ...] = ()  # the option names as the call gives them
    words: tuple[str, ...] = ()  # the program's arguments as written (after expansion)

    @property
    def source(self) -> str:
        return f"{self.path}:{self.line}"

    def label(self, name: str) -> str:
        return f"--{name} ({self.program})"


def is_trainer_script(path: Path) -> bool:
    """Whether a file is an HF Trainer launch (it passes --model_name_or_path)."""
    try:
        return path.is_file() and TRAINER_MARK in path.read_text(errors="replace")
    except OSError:
        return False


def _expand(token: str, variables: Mapping[str, str], unknown: Mapping[str, str],
            where: str) -> str:
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name in variables:
            return variables[name]
        why = unknown.get(name, "is not set in the script or the environment")
        raise MigrationError(f"{where}: ${name} {why}")

    if "$(" in token or "`" in token:
        raise MigrationError(f"{where}: command substitution in {token!r} cannot be evaluated")
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, token)


def _assign(words: list[str], variables: dict, unknown: dict, where: str) -> bool:
    """``VAR=value`` alone or ``export VAR=value``: record it (a value bash would compute with
    a command is unknown, an error only if the call reads it); True if the words were that."""
    body = words[1:] if words[0] == "export" else words
    if not body or not all(ASSIGNMENT.fullmatch(w) for w in body):
        return words[0] == "export"
    for word in body:
        name, value = ASSIGNMENT.fullmatch(word).groups()
        try:
            variables[name] = _expand(value, variables, unknown, where)
            unknown.pop(name, None)
        except MigrationError:
            variables.pop(name, None)
            unknown[name] = f"is computed by the script ({where}: {value!r}) and cannot be evaluated"
    return True


def _options(words: list[str], where: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """``--name value`` / ``--name=value`` / a bare ``--flag`` (true), as HfArgumentParser reads
    them."""
    options, order, i = {}, [], 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--"):
            raise MigrationError(f"{where}: {word!r} is not an option (--name value)")
        name, eq, value = word[2:].partition("=")
        if not eq:
            bare = i + 1 >= len(words) or words[i + 1].startswith("--")
            value = "True" if bare else words[i + 1]
            i += 0 if bare else 1
        options[name], i = value, i + 1
        order.append(name)
    return options, tuple(order)


def shell_lines(text: str) -> list[tuple[int, str]]:
    """:func:`.bash.logical_lines`, with a quoted string left open at a line's end continued on
    the next (``ARGS="`` newline ``--nnodes 1 …`` newline ``"``), newlines kept in it."""
    out: list[tuple[int, str]] = []
    for number, line in logical_lines(text):
        if out and _open_quote(out[-1][1]):
            out[-1] = (out[-1][0], out[-1][1] + "\n" + line)
        else:
            out.append((number, line))
    return out


def _open_quote(line: str) -> bool:
    try:
        simple_commands(line)
    except ValueError as err:
        return "quotation" in str(err)
    return False


def read_call(path: Path, environ: Mapping[str, str]) -> TrainerCall:
    """The one ``… program.py --model_name_or_path …`` call of the script."""
    variables, unknown, calls = dict(environ), {}, []
    for where, number, words in script_commands(path, shell_lines(path.read_text())):
        if _assign(words, variables, unknown, where):
            continue
        if TRAINER_MARK not in words:
            continue
        words = [_expand(w, variables, unknown, where) for w in words]
        while words and (ASSIGNMENT.fullmatch(words[0]) or words[0] in WRAPPERS):
            words.pop(0)
        at = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
        if at is None:
            raise MigrationError(f"{where}: no Python program (*.py) in the call")
        launcher = tuple(part for w in words[:at] for part in w.split())  # unquoted: split
        options, order = _options(words[at + 1:], where)
        calls.append(TrainerCall(path, number, posixpath.basename(words[at]), launcher,
                                 options, order, tuple(words[at + 1:])))
    if len(calls) != 1:
        raise MigrationError(f"{path}: expected one call passing {TRAINER_MARK}, found "
                             f"{len(calls)}")
    return calls[0]


def world_size(call: TrainerCall) -> tuple[int, str]:
    """(processes, how): torchrun's --nproc_per_node × --nnodes, deepspeed's --num_gpus ×
    --num_nodes; a plain ``python`` is one process."""
    words = list(call.launcher)

    def option(*names: str) -> Optional[str]:
        for i, word in enumerate(words):
            for name in names:
                if word == name and i + 1 < len(words):
                    return words[i + 1]
                if word.startswith(name + "="):
                    return word.split("=", 1)[1]
        return None

    per_node = option("--nproc_per_node", "--nproc-per-node", "--num_gpus", "--num-gpus")
    nodes = option("--nnodes", "--num_nodes", "--num-nodes")
    for name, text in (("processes per node", per_node), ("nodes", nodes)):
        if text is not None and not re.fullmatch(r"[1-9][0-9]*", text):
            raise MigrationError(f"{call.source}: {name} {text!r} in the launcher's options is "
                                 f"not a fixed count (ray_ppu needs the world size)")
    per_node, nodes = int(per_node or 1), int(nodes or 1)
    launcher = words[0] if words else "python"
    return per_node * nodes, f"{launcher}: {per_node} processes per node × {nodes} nodes"


def deepspeed_config(call: TrainerCall) -> tuple[Optional[dict], str]:
    """The --deepspeed JSON (looked up from the script's directory, its parent — the scripts
    run from the repository root — and the current directory), and its path as given."""
    given = call.options.get("deepspeed")
    if not given:
        return None, ""
    for base in (call.path.parent, call.path.parent.parent, Path.cwd()):
        candidate = base / given
        if candidate.is_file():
            try:
                return json.loads(candidate.read_text()), given
            except json.JSONDecodeError as err:
                raise MigrationError(f"{call.label('deepspeed')}={given}: not JSON ({err})") from None
    return None, given


def record_count(path: str, label: str) -> int:
    """Records of the training JSON (finetune.py ``json.load``s one list)."""
    try:
        records = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MigrationError(f"{label}={path}: not on this machine, and --num_train_epochs needs "
                             f"its record count; run where it is, or pass --max_steps") from None
    except (OSError, json.JSONDecodeError) as err:
        raise MigrationError(f"{label}={path}: not a JSON list of records ({err})") from None
    if not isinstance(records, list):
        raise MigrationError(f"{label}={path}: a JSON {type(records).__name__}, not the list of "
                             f"records finetune.py reads")
    return len(records)
