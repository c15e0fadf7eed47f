"""Files that readers see whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write_text(path: str | Path, text: str, fsync: bool = True) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one:
    a temporary file beside it, fsync'd, then renamed over it (a crash leaves no half file).
    ``fsync=False`` for files rewritten every iteration that need no durability (progress)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
