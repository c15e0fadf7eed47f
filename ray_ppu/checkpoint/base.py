"""The base model of a LoRA run: where it is read from, and what identifies it.

A LoRA checkpoint holds adapters, not the weights they adapt: resumed on another base they
would be meaningless, silently. So every LoRA checkpoint's meta records its base (the path and
a content fingerprint), and a resume on a base with another fingerprint is refused, naming both
(:func:`check_same_base`). A moved copy of the same base has the same fingerprint.

The fingerprint is a sha256 over each weight file's name and size, its first 64 KiB (a
safetensors header names every tensor, dtype and offset), its last 64 KiB and two blocks in
between: 256 KiB read per file, so every rank can compute it at start (a 72B model's 37 shards:
9.5 MB), and two fine-tunes of one architecture, whose headers agree, differ in the sampled
values. No torch here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

from ray_ppu.config.schema import RunConfig
from ray_ppu.errors import CheckpointError

BLOCK = 64 * 1024
_SUFFIXES = (".safetensors", ".distcp", ".json", ".metadata")


def fingerprint(path: str | Path) -> str:
    """The content fingerprint of a weight directory (module docstring)."""
    digest = hashlib.sha256()
    root = Path(path)
    for file in sorted(p for p in root.iterdir() if p.is_file() and p.suffix in _SUFFIXES
                       and p.name != "ray_ppu_meta.json"):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            for offset in sorted({0, size // 3, 2 * size // 3, max(size - BLOCK, 0)}):
                f.seek(offset)
                digest.update(f.read(BLOCK))
    return digest.hexdigest()[:20]


def base_dir(cfg: RunConfig) -> Optional[tuple[str, Path]]:
    """("hf" or "mcore", the directory) of a LoRA run's base: checkpoint.pretrained, or the
    complete checkpoint checkpoint.load names (the latest of a directory of them)."""
    c = cfg.checkpoint
    if c.pretrained:
        return "hf", Path(c.pretrained).expanduser().resolve()
    if c.load:
        from ray_ppu.checkpoint.layout import latest, read_meta

        load = Path(c.load).expanduser().resolve()
        if read_meta(load) is not None:
            return "mcore", load
        found = latest(load)
        if found is None:
            raise CheckpointError(f"checkpoint.load {load}: no complete checkpoint there to be "
                                  f"the LoRA run's base")
        return "mcore", found[0].resolve()
    return None


def identity(cfg: RunConfig) -> Optional[dict]:
    """``{"path", "kind", "fingerprint"}`` of a LoRA run's base (None for a full run)."""
    if not cfg.lora.enabled:
        return None
    found = base_dir(cfg)
    if found is None:
        return None
    kind, path = found
    return {"path": str(path), "kind": kind, "fingerprint": fingerprint(path)}


def check_same_base(checkpoint: str, saved: Optional[dict], ours: Optional[dict]) -> None:
    """A LoRA checkpoint resumes only on the base it was trained on."""
    if not saved or not ours or saved.get("fingerprint") == ours.get("fingerprint"):
        return
    raise CheckpointError(
        f"{checkpoint} holds adapters trained on the base {saved['path']} (fingerprint "
        f"{saved['fingerprint']}), but this run's base is {ours['path']} (fingerprint "
        f"{ours['fingerprint']}): resume on the base it was trained on, or start a new run in "
        f"another output.dir (lora.adapter can start it from an export of these adapters)")
