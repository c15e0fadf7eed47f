"""SFT input files → entries (a conversation, or the reason a record is unusable) → windows.

Files are found and their JSON records read by :mod:`ray_ppu.data.readers`, shared with
pretraining preprocessing. Here a record becomes an *entry*: ``("ok", messages, where, images,
file)`` (the image paths as the record gives them, and the file they are relative to) or
``("problem", reason, message)``, so that a bad record is counted, never lost, and the place
``file: line N`` (``element i``, ``row i``) is kept for the message. Reading never raises for a
record (``on_error="fail"`` is the window's to apply, after its other checks, so that the error
names the first bad record in file order, not the first one a stage happened to find). Entries
are then cut into packing windows of consecutive records (see the package docstring for why
windows).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import pyarrow as pa

from ray_ppu.data.readers import NOT_AN_ARRAY, WHOLE_FILE, input_format, json_records, resolve_inputs
from ray_ppu.data.sft.records import RecordProblem, conversation_from_record, record_images
from ray_ppu.errors import PreprocessError


def record_entry(path: str, where: str, record: object) -> tuple:
    """The entry of one record read from ``path`` at ``where`` (a parse failure as its
    :class:`RecordProblem`): ``("ok", messages, where, image paths, path)`` or
    ``("problem", reason, message)``."""
    if isinstance(record, RecordProblem):
        return ("problem", record.reason, f"{path}: {where}: {record.message}")
    try:
        images = record_images(record) if isinstance(record, dict) else []
        return ("ok", conversation_from_record(record), f"{path}: {where}", images, path)
    except RecordProblem as problem:
        return ("problem", problem.reason, f"{path}: {where}: {problem.message}")


def file_entries(f, path: str) -> Iterator[tuple]:
    """Every record of one opened file as its entry (:func:`record_entry`)."""
    for where, record in file_records(f, path):
        yield record_entry(path, where, record)


def file_records(f, path: str) -> Iterator[tuple[str, object]]:
    """``(where, record or RecordProblem)`` of every record of one opened file."""
    return _parquet_records(f) if input_format(path) == "parquet" else _json_records(f)


@contextlib.contextmanager
def open_local(path: str):
    """A local file opened for :func:`file_entries`, outside Ray Data."""
    if input_format(path) == "parquet":  # ParquetFile needs random access: a plain file
        with pa.OSFile(path) as f:
            yield f
    else:
        with pa.input_stream(path, compression="detect") as f:
            yield f


def decode_json(data: bytes):
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        return RecordProblem("invalid_utf8", f"invalid UTF-8 at byte {err.start}")
    try:
        return json.loads(text)
    except ValueError as err:
        return RecordProblem("malformed_json", f"invalid JSON: {err}")


def _json_records(f) -> Iterator[tuple[str, object]]:
    # A JSON array is parsed whole: a problem with it is the whole file's.
    for where, record in json_records(f, decode_json):
        if where == WHOLE_FILE and not isinstance(record, RecordProblem):
            record = RecordProblem("malformed_json", NOT_AN_ARRAY)
        yield where, record


def _parquet_records(f) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq

    row = 0
    for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            yield f"row {row}", record
            row += 1


def windows(entries: Iterable[tuple], size: int) -> Iterator[tuple[int, bool, list]]:
    """``(index, is_last, entries)`` for consecutive windows of ``size`` entries (an empty input
    is one empty last window, so every file reports that it was read)."""
    window, index = [], 0
    pending = None
    for entry in entries:
        window.append(entry)
        if len(window) == size:
            if pending is not None:
                yield index - 1, False, pending
            pending, window, index = window, [], index + 1
    if pending is not None:
        if window:
            yield index - 1, False, pending
            yield index, True, window
        else:
            yield index - 1, True, pending
    else:
        yield 0, True, window


def resolve_sft_inputs(paths: Sequence[str | Path]) -> list[str]:
    """The data files of ``paths`` (files, directories, globs; see :func:`resolve_inputs`).

    Raises :class:`PreprocessError` naming the paths when there are none, or when every file
    found is empty.
    """
    files = resolve_inputs(paths)
    if all(os.path.getsize(f) == 0 for f in files):
        raise PreprocessError(f"no SFT records: every input file is empty ({', '.join(files)}; "
                              f"given {[str(p) for p in paths]})")
    return files
