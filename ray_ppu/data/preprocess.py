"""Text → Megatron idxmap (``prefix.bin`` / ``prefix.idx``) with Megatron's own writer.

One document per text, EOD appended (as Megatron's preprocess_data.py ``--append-eod``), token
ids stored in the dtype Megatron's ``DType.optimal_dtype`` picks for the vocabulary (int32 for
Qwen2 and LLaMA-3: they do not fit uint16).

Two ways in:

* :func:`write_idxmap` — texts from a Python iterable, tokenized in this process (tests, demo);
* :func:`preprocess_with_ray` — JSONL / JSON / Parquet files, read and tokenized in parallel by
  Ray Data and written, in input order, by this process (``entrypoints/preprocess_data.py``).

Both produce byte-identical files for the same texts and tokenizer.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import ray.data
from ray.data.datasource import FileBasedDatasource

from ray_ppu.data.readers import (
    NOT_AN_ARRAY,
    WHOLE_FILE,
    ParquetRandomAccess,
    input_format,
    json_records,
    resolve_inputs,
)
from ray_ppu.data.tokenizer import Tokenizer, load_tokenizer
from ray_ppu.errors import remote_cause
from ray_ppu.errors import PreprocessError  # noqa: F401 (also imported from here)

# torch and Megatron are imported where the files are written, not here: every Ray Data actor
# imports this module to unpickle its tokenizer class, and those two imports would cost each
# actor seconds of CPU for nothing.

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
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp_bin = prefix.with_name(prefix.name + ".bin.tmp")
    builder = IndexedDatasetBuilder(str(tmp_bin), dtype=DType.optimal_dtype(tokenizer.vocab_size))
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


# --- JSONL / JSON / Parquet → idxmap, in parallel with Ray Data -----------------------------------
#
# Reading: a small FileBasedDatasource of our own rather than ray.data.read_json: read_json
# fails a whole JSONL file when one record's text is not a string (its pyarrow parser wants one
# type per column and its json.load fallback cannot read JSONL), and with lines=True it reads
# through pandas, which turns the text "123" into the number 123. Here every record becomes one
# row — text, or the reason it has none — so nothing is dropped unseen.
#
# Tokenizing: map_batches with an actor class that holds the tokenizer, one actor per CPU. The
# UDF takes whole blocks (batch_size=None), which lets Ray Data fuse the read into the actors
# (plan: ActorPoolMapOperator[Read_TextRecords->MapBatches(_TokenizeBatch)]): a file is read by
# the actor that tokenizes it, and no read task waits for a CPU that the actors already hold —
# unfused, an actor per CPU starves the reads and the job hangs. The unit of parallelism is
# therefore the input file: shard large corpora into at least as many files as workers.
# Writing: this process, in input order (preserve_order), with Megatron's IndexedDatasetBuilder.

SKIP_REASONS = ("empty", "missing", "not_string")
# One tokenizer call per block of records: bounded in rows and in text bytes.
_RECORDS_PER_BLOCK = 1024
_TEXT_BYTES_PER_BLOCK = 16 << 20


@dataclass(frozen=True)
class _InvalidJSON:
    """What :func:`_parse_json` gives for bytes that are not JSON."""

    message: str


def _parse_json(data: bytes) -> object:
    try:
        return json.loads(data)
    except ValueError as err:
        return _InvalidJSON(f"invalid JSON: {err}")


def _json_file_records(f, path: str) -> Iterator[tuple[object, str]]:
    """``(record, where)`` of a JSON Lines or JSON-array file; a corrupt file is an error
    (PreprocessError naming the file, and the line for JSON Lines), never a skipped record."""
    for where, record in json_records(f, _parse_json):
        if isinstance(record, _InvalidJSON):
            raise PreprocessError(f"{path}: {record.message}" if where == WHOLE_FILE
                                  else f"{path}: {where}: {record.message}")
        if where == WHOLE_FILE:  # parsed, but not to an array
            raise PreprocessError(f"{path}: {NOT_AN_ARRAY}")
        yield record, where


def _classify(record: object, key: str) -> tuple[str | None, str | None]:
    """(text, None) for a usable record, else (None, skip reason)."""
    if not isinstance(record, dict):
        return None, "missing"
    value = record.get(key)
    if value is None:
        return None, "missing"
    if not isinstance(value, str):
        return None, "not_string"
    if not value.strip():  # the same test as write_idxmap, so both paths skip the same texts
        return None, "empty"
    return value, None


class _TextRecords(ParquetRandomAccess, FileBasedDatasource):
    """One row per record of JSONL / JSON-array / Parquet files: ``text`` (null when unusable),
    ``skip`` (the reason, null when usable), ``source`` (the file) and ``where`` (the record's
    place in it, for messages)."""

    def __init__(self, paths: list[str], key: str) -> None:
        super().__init__(paths)
        self._key = key

    def _read_stream(self, f, path: str):
        if input_format(path) == "parquet":
            yield from self._read_parquet(f, path)
        else:
            yield from self._read_json(f, path)

    def _table(self, rows: list[tuple[str | None, str | None, str]], path: str):
        texts, skips, wheres = zip(*rows)
        return pa.table({
            "text": pa.array(texts, pa.large_string()),
            "skip": pa.array(skips, pa.string()),
            "source": pa.array([path] * len(rows), pa.string()),
            "where": pa.array(wheres, pa.string()),
        })

    def _records_out(self, records: Iterable[tuple[object, str]], path: str):
        rows, size = [], 0
        for record, where in records:
            text, skip = _classify(record, self._key)
            rows.append((text, skip, where))
            size += len(text) if text else 0
            if len(rows) == _RECORDS_PER_BLOCK or size >= _TEXT_BYTES_PER_BLOCK:
                yield self._table(rows, path)
                rows, size = [], 0
        if rows:
            yield self._table(rows, path)

    def _read_json(self, f, path: str):
        yield from self._records_out(_json_file_records(f, path), path)

    def _read_parquet(self, f, path: str):
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(f)
        if self._key not in parquet.schema_arrow.names:
            # Every row lacks the field: count each one, as for JSON.
            n = parquet.metadata.num_rows
            yield from self._records_out(((None, f"row {i}") for i in range(n)), path)
            return
        row = 0
        for batch in parquet.iter_batches(batch_size=_RECORDS_PER_BLOCK, columns=[self._key]):
            values = batch.column(0).to_pylist()
            yield from self._records_out(
                (({self._key: v}, f"row {row + i}") for i, v in enumerate(values)), path)
            row += len(values)


class _TokenizeBatch:
    """Ray Data actor: token ids (EOD appended) of each usable row of a batch; empty for skipped rows."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        # Each actor holds one CPU; the Rust tokenizer would otherwise start a thread per core.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.tokenizer = tokenizer

    def __call__(self, batch: pa.Table) -> pa.Table:
        texts = batch.column("text").to_pylist()
        encoded = iter(self.tokenizer.encode_batch([t for t in texts if t is not None]))
        eod = self.tokenizer.eod
        ids = [[*next(encoded), eod] if t is not None else [] for t in texts]
        return pa.table({
            "ids": pa.array(ids, pa.list_(pa.int32())),
            "skip": batch.column("skip"),
            "source": batch.column("source"),
            "where": batch.column("where"),
        })


@dataclass(frozen=True)
class PreprocessStats:
    """What :func:`preprocess_with_ray` wrote and skipped (``to_dict`` is the entry point's JSON)."""

    prefix: str
    files: int
    documents: int
    tokens: int  # written, EOD included
    skipped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    workers: int = 0
    dtype: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["seconds"] = round(self.seconds, 3)
        out["tokens_per_s"] = round(self.tokens_per_s, 1)
        return out


def _skip_message(key: str, reason: str, source: str, where: str) -> str:
    what = {"missing": f"has no {key!r} field", "not_string": f"field {key!r} is not a string",
            "empty": f"field {key!r} is empty"}[reason]
    return f"{source}: {where}: {what}"


def _nothing_usable(key: str, skipped: dict, first_skip: dict) -> str:
    """The error of a corpus with no usable document: the counts by reason and the first."""
    counts = ", ".join(f"{reason}: {n}" for reason, n in skipped.items() if n) or "no records"
    hint = (f"; is --json-key {key!r} the field that holds the text?"
            if skipped["missing"] or skipped["not_string"] else "")
    first = f"; first: {next(iter(first_skip.values()))}" if first_skip else ""
    return f"no usable document in the input ({counts}){first}{hint}"


def _tokenized_dataset(files: list[str], json_key: str, tokenizer: Tokenizer, workers: int):
    """Rows of (ids, skip, source, where), one per input record, in input order."""
    # One read task per file: with fewer files than its target parallelism Ray Data would split
    # the read into its own task pool, which breaks the fusion described above.
    ds = ray.data.read_datasource(_TextRecords(files, json_key), override_num_blocks=len(files))
    # The dataset's own copy of the DataContext: other datasets of this process are unaffected.
    ds.context.execution_options.preserve_order = True
    # A task is a whole file: queue at most one more per actor, or the first actor to start
    # collects several files while the others sit idle.
    pool = ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=2)
    return ds.map_batches(_TokenizeBatch, fn_constructor_args=(tokenizer,), batch_size=None,
                          batch_format="pyarrow", compute=pool, num_cpus=1)


def preprocess_with_ray(inputs: Sequence[str | Path], output_prefix: str | Path,
                        tokenizer: Tokenizer | str | Path, *, json_key: str = "text",
                        workers: int | None = None, strict: bool = False) -> PreprocessStats:
    """Tokenize JSONL / JSON-array / Parquet files with Ray Data into ``output_prefix.bin/.idx``.

    ``inputs``: files, directories or globs (see :func:`resolve_inputs`). ``tokenizer``: a
    :class:`Tokenizer` or a Hugging Face tokenizer directory. One document per record with
    EOD appended, in input order, so the same input always gives byte-identical files.
    Records whose ``json_key`` is empty, missing or not a string are skipped and counted by
    reason; with ``strict`` a missing or non-string one raises PreprocessError naming the file
    and the key. ``workers``: tokenizer actors (default: the cluster's CPUs); each reads and
    tokenizes whole input files, so more workers than files do not help. Needs a connected
    Ray (``ray.init()``). The output files appear only when complete.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    files = resolve_inputs(inputs)
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = load_tokenizer(tokenizer)
    if workers is None:
        workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
    workers = min(workers, len(files))  # a worker per file at most: more would sit idle
    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    tmp_bin = prefix.with_name(f".{prefix.name}.bin.{os.getpid()}.tmp")
    tmp_idx = prefix.with_name(f".{prefix.name}.idx.{os.getpid()}.tmp")
    started = time.perf_counter()
    ds = _tokenized_dataset(files, json_key, tokenizer, workers)

    skipped = dict.fromkeys(SKIP_REASONS, 0)
    first_skip: dict[str, str] = {}
    documents = tokens = 0
    builder = IndexedDatasetBuilder(str(tmp_bin), dtype=dtype)
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            ids = batch.column("ids").combine_chunks()
            values = ids.flatten().to_numpy()
            ends = np.cumsum(ids.value_lengths().to_numpy())
            reasons = batch.column("skip").to_pylist()
            start = 0
            for row, (end, reason) in enumerate(zip(ends, reasons)):
                if reason is None:
                    builder.add_document(values[start:end], [int(end - start)])
                    documents += 1
                    tokens += int(end - start)
                else:
                    source = batch.column("source")[row].as_py()
                    where = batch.column("where")[row].as_py()
                    if strict and reason != "empty":
                        raise PreprocessError(_skip_message(json_key, reason, source, where))
                    skipped[reason] += 1
                    first_skip.setdefault(reason, _skip_message(json_key, reason, source, where))
                start = int(end)
        if documents == 0:  # an empty corpus trains nothing: say why, write nothing
            raise PreprocessError(_nothing_usable(json_key, skipped, first_skip))
        builder.finalize(str(tmp_idx))
    except BaseException as err:
        builder.data_file.close()
        for tmp in (tmp_bin, tmp_idx):
            tmp.unlink(missing_ok=True)
        ours = remote_cause(err, (PreprocessError,))  # our own error inside Ray's wrappers
        if ours is not None and type(err) is not PreprocessError:
            raise ours from None  # the message, not a page of Ray traceback
        raise
    # .idx then .bin: a reader checks for both, and the .bin appears last.
    tmp_idx.replace(prefix.with_name(prefix.name + ".idx"))
    tmp_bin.replace(prefix.with_name(prefix.name + ".bin"))
    seconds = time.perf_counter() - started

    stats = PreprocessStats(str(prefix), len(files), documents, tokens, skipped, seconds, workers,
                            np.dtype(dtype).name)
    if any(skipped.values()):
        log.warning("%s: skipped %d records (%s); first of each: %s", prefix, sum(skipped.values()),
                    ", ".join(f"{r}: {n}" for r, n in skipped.items() if n), "; ".join(first_skip.values()))
    log.info("%s: %d documents, %d tokens from %d files in %.1f s (%.0f tokens/s, %d workers)",
             prefix, documents, tokens, len(files), seconds, stats.tokens_per_s, workers)
    return stats
