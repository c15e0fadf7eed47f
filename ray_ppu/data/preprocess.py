"""Text → Megatron idxmap (``prefix.bin`` / ``prefix.idx``) with Megatron's own writer.

One document per text, EOD appended (as Megatron's preprocess_data.py ``--append-eod``), token
ids stored as int32 (the Qwen2 vocabulary does not fit uint16).
"""

from __future__ import annotations

import logging
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from ray_ppu.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CorpusStats:
    prefix: str
    documents: int
    tokens: int
    skipped_empty: int


def write_idxmap(texts: Iterable[str], tokenizer: Tokenizer, prefix: str | Path,
                 batch_size: int = 64) -> CorpusStats:
    """Tokenize ``texts`` and write ``prefix.bin/.idx``; empty texts are skipped and counted."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp_bin = prefix.with_name(prefix.name + ".bin.tmp")
    builder = IndexedDatasetBuilder(str(tmp_bin), dtype=np.int32)
    documents = tokens = skipped = 0
    batch: list[str] = []

    def flush() -> None:
        nonlocal documents, tokens
        for ids in tokenizer.encode_batch(batch):
            ids.append(tokenizer.eod)
            builder.add_document(torch.tensor(ids, dtype=torch.int32), [len(ids)])
            documents += 1
            tokens += len(ids)
        batch.clear()

    for text in texts:
        if not text.strip():
            skipped += 1
            continue
        batch.append(text)
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    builder.finalize(str(prefix.with_name(prefix.name + ".idx")))
    # Publish the .bin last-but-atomically so a reader never sees a half-written corpus.
    tmp_bin.replace(prefix.with_name(prefix.name + ".bin"))
    if skipped:
        log.warning("%s: skipped %d empty documents", prefix, skipped)
    return CorpusStats(str(prefix), documents, tokens, skipped)


def stdlib_sources(max_bytes: int) -> Iterator[str]:
    """The Python standard library's own ``.py`` files, in a fixed order, up to ``max_bytes``.

    Real text that ships with every Python: the demo corpus needs no download.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text)
        if total > max_bytes:
            return
        yield text


def build_stdlib_corpus(prefix: str | Path, tokenizer: Tokenizer, max_bytes: int = 4_000_000) -> CorpusStats | None:
    """The demo corpus: the standard library's sources as Qwen2 tokens; None if already built."""
    prefix = Path(prefix)
    if prefix.with_name(prefix.name + ".bin").is_file() and prefix.with_name(prefix.name + ".idx").is_file():
        return None
    return write_idxmap(stdlib_sources(max_bytes), tokenizer, prefix)
