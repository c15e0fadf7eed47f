"""The sign rule of every size and count in the config, read from the field's own docstring.

A size that is zero or negative makes the other rules' arithmetic meaningless (a global batch
of -256 "not divisible by" 8; a TP of 0 a division by zero) and, where nothing else checks it,
reaches Megatron-Core as a traceback on every rank. So each numeric field states its bound
where users read it (``pretrain.py --help-config``), as the docstring's ``[≥ 1]``, ``[≥ 0]`` or
``[> 0]``, and :func:`size_problems` enforces exactly that text: there is one place to read or
change a bound, and a new field cannot have a rule that its documentation does not show.
``None`` (where a field allows it: "unset", "off", "derived") is never out of bounds.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from ray_ppu.config import schema
from ray_ppu.config.reference import class_docstrings

_RULE = re.compile(r"\[(≥|>) (-?\d+(?:\.\d+)?)\]\s*$")


@functools.lru_cache(maxsize=None)
def bounds() -> dict[str, tuple[str, float]]:
    """``{"section.field": (relation, bound)}`` for every field whose docstring ends in a rule."""
    found = {}
    sections = [(f.name, f.default_factory().__class__) for f in dataclasses.fields(schema.RunConfig)]
    for section, cls in sections:
        for name, doc in class_docstrings(cls).items():
            match = _RULE.search(doc)
            if match:
                found[f"{section}.{name}"] = (match.group(1), float(match.group(2)))
    return found


def size_problems(cfg: schema.RunConfig) -> list[str]:
    """Every field outside its docstring's bound, one line each, in the order of the schema."""
    found = []
    for key, (relation, bound) in bounds().items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is None or isinstance(value, bool):
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:  # lists: each
            if item < bound if relation == "≥" else item <= bound:
                shown = f"{value}" if isinstance(value, (list, tuple)) else f"{value:g}"
                found.append(f"{key}={shown}: must be {relation} {bound:g}"
                             + (f" (has {item:g})" if shown != f"{item:g}" else ""))
                break
    return found
