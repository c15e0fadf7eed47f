"""Every config field with its type, default and docstring, read from the schema itself.

``pretrain.py --help-config`` prints this, so what a user reads is what the loader accepts: the
field docstrings in :mod:`ray_ppu.config.schema` are the one description of each field (a
dataclass keeps no attribute docstrings at run time, so they are read from the module's source).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass
from typing import Optional

from ray_ppu.config import schema


@dataclass(frozen=True)
class FieldDoc:
    """One documented config key."""

    key: str  # section.field, as overrides and YAML name it
    type: str
    default: str
    doc: str


def class_docstrings(cls: type) -> dict[str, str]:
    """{field: docstring} of a dataclass: the string literal that follows each annotated field."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return "(required)"


def field_docs(section: Optional[str] = None) -> list[FieldDoc]:
    """Every field of every section of :class:`~ray_ppu.config.schema.RunConfig` (or of one)."""
    found = []
    for part in dataclasses.fields(schema.RunConfig):
        if section is not None and part.name != section:
            continue
        cls = part.default_factory().__class__
        docs = class_docstrings(cls)
        for f in dataclasses.fields(cls):
            found.append(FieldDoc(f"{part.name}.{f.name}", str(f.type), _default(f),
                                  docs.get(f.name, "")))
    return found


def sections() -> list[str]:
    return [part.name for part in dataclasses.fields(schema.RunConfig)]


def format_reference(section: Optional[str] = None) -> str:
    """The reference as text: ``key: type = default`` and the docstring indented below it."""
    lines = []
    for doc in field_docs(section):
        lines.append(f"{doc.key}: {doc.type} = {doc.default}")
        lines += ["    " + line if line else "" for line in doc.doc.splitlines()]
        lines.append("")
    return "\n".join(lines)
