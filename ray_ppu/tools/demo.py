"""The demo corpus: the Python standard library's sources, tokenized with Qwen2.

Real text that ships with every Python, so the demo run (``entrypoints/pretrain.py`` without a
corpus), the benchmarks and the tests need no download. Two ways to build it, giving
byte-identical idxmap files for the same ``max_bytes``:

* :func:`build_stdlib_corpus` — in this process, with the tiktoken Qwen2 tokenizer
  (:func:`ray_ppu.data.preprocess.write_idxmap`);
* :func:`build_demo_corpus` — the way a user's corpus is built: a Hugging Face tokenizer
  directory, JSONL shards and :func:`ray_ppu.data.preprocess.preprocess_with_ray`.

Demo code, not part of the data pipeline: it lives here so that the library modules hold only
what every run uses.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path
from typing import Iterator

import ray
import ray.data

from ray_ppu import quiet
from ray_ppu.data.preprocess import CorpusStats, preprocess_with_ray, write_idxmap
from ray_ppu.data.tokenizer import Tokenizer, export_qwen2_tokenizer
from ray_ppu.util.fs import atomic_write_text

DEMO_SHARDS = 4


def stdlib_sources(max_bytes: int) -> Iterator[str]:
    """The Python standard library's own ``.py`` files, in a fixed order, up to ``max_bytes``.

    Real text that ships with every Python: the demo corpus needs no download.
    """
    for _, text in stdlib_files(max_bytes):
        yield text


def stdlib_files(max_bytes: int) -> Iterator[tuple[str, str]]:
    """``(path relative to the standard library, text)`` of :func:`stdlib_sources`: sorted,
    tests and site-packages left out, files that are not UTF-8 skipped."""
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
        yield path.relative_to(root).as_posix(), text


def build_stdlib_corpus(prefix: str | Path, tokenizer: Tokenizer, max_bytes: int = 4_000_000) -> CorpusStats | None:
    """The demo corpus: the standard library's sources as Qwen2 tokens; None if already built."""
    prefix = Path(prefix)
    if prefix.with_name(prefix.name + ".bin").is_file() and prefix.with_name(prefix.name + ".idx").is_file():
        return None
    return write_idxmap(stdlib_sources(max_bytes), tokenizer, prefix)


def build_demo_corpus(out_dir: str | Path, max_bytes: int = 4_000_000, workers: int | None = None) -> str:
    """The demo corpus the Hugging Face way; returns its idxmap prefix.

    Exports the Qwen2 tokenizer to ``out_dir/tokenizer``, writes the standard library's
    sources as ``DEMO_SHARDS`` JSONL shards under ``out_dir/raw/`` and tokenizes them with
    :func:`preprocess_with_ray` (``workers`` tokenizer actors, default one per CPU) into
    ``out_dir/stdlib_text_document``; does nothing when that ``.bin``/``.idx`` already exist.
    The shards keep the files' order, so the corpus is byte-identical to
    :func:`build_stdlib_corpus` with :func:`ray_ppu.data.tokenizer.qwen2` for the same
    ``max_bytes``.

    Ray: uses the Ray this process is connected to; if none, starts a local one and shuts it
    down before returning (so a later ``ray.init`` with other resources, e.g. the launcher's
    simulated PPUs, still works). Connect first to avoid starting Ray twice.
    """
    out_dir = Path(out_dir)
    prefix = out_dir / "stdlib_text_document"
    if prefix.with_name(prefix.name + ".bin").is_file() and prefix.with_name(prefix.name + ".idx").is_file():
        return str(prefix)
    tokenizer_dir = export_qwen2_tokenizer(out_dir / "tokenizer")
    raw = out_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    texts = list(stdlib_sources(max_bytes))
    per_shard = -(-len(texts) // DEMO_SHARDS)
    for shard in range(DEMO_SHARDS):
        # Atomic: the temporary file is hidden, which resolve_inputs skips, and a shard is
        # never seen half written.
        atomic_write_text(raw / f"stdlib-{shard:05d}-of-{DEMO_SHARDS:05d}.jsonl",
                          "".join(json.dumps({"text": text}, ensure_ascii=False) + "\n"
                                  for text in texts[shard * per_shard:(shard + 1) * per_shard]))
    started_ray = not ray.is_initialized()
    if started_ray:  # RAY_ADDRESS joins that cluster; otherwise a new local Ray, never a stale one
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local")
    try:
        # In a task, not here: Ray's core worker notes each Ray Data map worker it creates
        # ("constructor arguments in the object store"), on the creating process's stderr;
        # from a task that note comes through the driver's log forwarding, which
        # ray_ppu.quiet filters, and the demo's output stays the run's own
        task = ray.remote(num_cpus=0, max_retries=0)(_tokenize_quietly)
        ray.get(task.remote([str(raw)], str(prefix), str(tokenizer_dir), workers))
    finally:
        if started_ray:
            ray.shutdown()
    return str(prefix)


def _tokenize_quietly(inputs: list[str], prefix: str, tokenizer_dir: str, workers) -> None:
    """:func:`preprocess_with_ray` with our log lines shown and Ray Data's INFO progress lines
    off (the demo's corpus takes seconds; its result is our one line)."""
    import logging

    quiet.show_our_logs()
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    ray.data.DataContext.get_current().enable_progress_bars = False  # tqdm bars on stderr
    preprocess_with_ray(inputs, prefix, tokenizer_dir, workers=workers)
