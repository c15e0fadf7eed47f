"""The migrated config as YAML, and its check: the text a user reads (the call, its
environment, every reinterpretation, each value's origin as a comment) and the proof that
``pretrain.py --config`` accepts it, with any problem traced back to the script arguments.
"""

from __future__ import annotations

import re
import shlex
import textwrap
import warnings
from typing import Any

import yaml

from ray_ppu.config.loader import from_dict
from ray_ppu.errors import ConfigError, MigrationError
from ray_ppu.plan import Plan, build_plan
from ray_ppu.tools.pai_migration.launch import ENV_VARS, Launch, Migration

SECTIONS = ("model", "parallel", "training", "memory", "data", "output", "cluster", "checkpoint",
            "lora", "vision")

# Words of build_plan's messages that name a setting without its config key.
PROBLEM_WORDS = {
    "TP": "parallel.tensor_model_parallel_size", "PP": "parallel.pipeline_model_parallel_size",
    "CP": "parallel.context_parallel_size", "DP": "cluster.num_workers",
    "EP": "parallel.expert_model_parallel_size", "ETP": "parallel.expert_tensor_parallel_size",
    "world size": "cluster.num_workers", "workers": "cluster.num_workers",
    "num_layers": "model.preset", "hidden_size": "model.preset",
    "num_attention_heads": "model.preset", "num_query_groups": "model.preset",
    "max_position_embeddings": "model.preset", "training length": "training.train_iters",
}


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
