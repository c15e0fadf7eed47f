"""Input files of the raw-corpus readers: which files, which format, their JSON records.

Both raw-text paths read the same kinds of file: pretraining preprocessing
(:mod:`ray_ppu.data.preprocess`, text → idxmap) and supervised fine-tuning
(:mod:`ray_ppu.data.sft`, conversations → rows). They must agree on what counts as a data file
and on where a record sits in its file (``line N``, ``element i``), because their messages name
that place; so the file discovery and the JSON reading live here, once. What a bad record
means differs (preprocessing stops at a corrupt file, SFT counts it and goes on), so the
reader leaves the parsing, and what a parse failure becomes, to the caller.

No Ray here (the mixin for Ray's datasources only names a method): plain file handling, which
the driver's preflight also uses to check that the inputs exist (:func:`resolve_inputs`).
"""

from __future__ import annotations

import codecs
import glob
from pathlib import Path
from typing import Callable, Iterator, Sequence

from ray_ppu.errors import PreprocessError

_COMPRESSION_SUFFIXES = (".gz", ".zst", ".bz2", ".lz4")  # pyarrow decompresses by file name
# JSON Lines are read in chunks of this size: one chunk of the file in memory at a time; the
# first one decides whether the file is a JSON array.
HEAD_BYTES = 8 << 20
# ``where`` of a JSON array file that did not parse (or did not parse to an array).
WHOLE_FILE = "whole file"
NOT_AN_ARRAY = "expected a JSON array of records"


def input_format(name: str) -> str | None:
    """``jsonl``, ``json`` or ``parquet`` from a file name; None for anything else."""
    name = name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    for suffix in _COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if name.endswith(".json"):
        return "json"  # a JSON array of objects, or JSONL under a .json name (decided on read)
    return None


def is_compressed(name: str) -> bool:
    """Whether pyarrow decompresses the file ``name`` (by its suffix)."""
    return name.lower().endswith(_COMPRESSION_SUFFIXES)


def _is_data_file(path: Path) -> bool:
    # Hidden and underscore files are bookkeeping (.crc, _SUCCESS, our own .tmp files), not data.
    return path.is_file() and not path.name.startswith((".", "_")) and input_format(path.name) is not None


def resolve_inputs(paths: Sequence[str | Path]) -> list[str]:
    """Expand files, directories (recursively) and globs into absolute data-file paths.

    Order is the order of ``paths``; within a directory or glob, sorted by path. Raises
    PreprocessError naming the path when a path does not exist or matches no .jsonl / .ndjson
    / .json / .parquet file (optionally .gz / .zst / .bz2 / .lz4 compressed for JSON).
    """
    if not paths:
        raise PreprocessError("no input paths given")
    files: list[str] = []
    for spec in map(str, paths):
        path = Path(spec)
        if path.is_file():
            if input_format(path.name) is None:
                raise PreprocessError(f"{spec}: not a .jsonl, .json or .parquet file")
            found = [path]
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if _is_data_file(p))
            if not found:
                raise PreprocessError(f"{spec}: directory holds no .jsonl, .json or .parquet files")
        elif glob.has_magic(spec):
            found = []
            for match in sorted(glob.glob(spec, recursive=True)):
                m = Path(match)
                found += sorted(p for p in m.rglob("*") if _is_data_file(p)) if m.is_dir() else [m]
            found = [p for p in found if _is_data_file(p)]
            if not found:
                raise PreprocessError(f"{spec}: no .jsonl, .json or .parquet files match")
        else:
            raise PreprocessError(f"{spec}: no such file or directory")
        # Absolute: Ray workers do not share this process's working directory.
        files.extend(str(p.resolve()) for p in found)
    return files


class ParquetRandomAccess:
    """Mixin for a Ray Data ``FileBasedDatasource`` that reads Parquet among other formats.

    Ray hands ``_read_stream`` a sequential stream by default; a Parquet file's footer is at
    its end, so Parquet inputs are opened for random access instead.
    """

    def _open_input_source(self, filesystem, path: str, **open_args):
        if input_format(path) == "parquet":
            return filesystem.open_input_file(path)
        return super()._open_input_source(filesystem, path, **open_args)


def is_json_array(head: bytes) -> bool:
    """Whether a JSON file whose first :data:`HEAD_BYTES` are ``head`` is a JSON array (its
    first non-blank byte after a UTF-8 byte-order mark is ``[``), not JSON Lines."""
    return head.removeprefix(codecs.BOM_UTF8).lstrip()[:1] == b"["


def json_records(f, parse: Callable[[bytes], object]) -> Iterator[tuple[str, object]]:
    """Each record of an opened JSON Lines or JSON-array file as ``(where, parse(its bytes))``.

    A file whose first non-blank byte (after a UTF-8 byte-order mark, which some Windows tools
    write) is ``[`` is a JSON array: it has to be parsed whole, and its elements come out as
    ``element i``; when ``parse`` gives anything but a list (its failure value, say), that
    value comes out once as ``(WHOLE_FILE, value)`` for the caller to report. Anything else is
    JSON Lines, streamed in chunks: ``line N`` (1-based; blank lines are counted but are not
    records: files often end in one). ``parse`` may return a failure value or raise; the
    reader passes either on, so records before a bad line are still yielded first.
    """
    head = f.read(HEAD_BYTES).removeprefix(codecs.BOM_UTF8)
    if is_json_array(head):
        records = parse(head + f.read())
        if isinstance(records, list):
            yield from ((f"element {i}", r) for i, r in enumerate(records))
        else:
            yield WHOLE_FILE, records
        return
    pending, number, chunk = b"", 0, head
    while chunk:
        pieces = (pending + chunk).split(b"\n")
        pending = pieces.pop()  # the last piece may continue in the next chunk
        for line in pieces:
            number += 1
            if line.strip():
                yield f"line {number}", parse(line)
        chunk = f.read(HEAD_BYTES)
    if pending.strip():
        yield f"line {number + 1}", parse(pending)
