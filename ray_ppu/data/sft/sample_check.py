"""A sample of every SFT file, read the way the pipeline reads it, before any Ray starts.

The full read (:mod:`ray_ppu.data.sft_store`) runs on the cluster, after Ray and Ray Data
have started: 35–60 s on two cores, minutes on a big corpus, before a corpus the model cannot
use (records with images for a text model, a mistyped ``data.image_root``, a GBK-encoded
file) is found. So ``--dry-run`` and the launch first read a sample of each file in this
process: the first ``n`` records (where a broken export shows first) and ``n`` more spread
evenly over the rest (where a concatenated shard changes format), through the same
:func:`~ray_ppu.data.sft.files.record_entry` and
:func:`~ray_ppu.data.sft.windows.process_window` as the Ray Data tasks: parsed, templated,
tokenized, images opened and prepared. The run's policy then applies to the sample:
``on_bad_record: fail`` refuses the first bad record in file order, ``skip`` refuses a drop
share over ``data.max_dropped_share``.

Spread records are found by byte offset (JSON Lines: the line holding each offset) or by row
(Parquet: only the row groups holding them are read), so the time does not grow with the
file's records; only a bad spread record's line number is counted (the newlines before it),
so a clean file costs no pass over it. A compressed file cannot be sought in, and gives its
first records only (said in the report). A JSON-array file is parsed whole by the pipeline
too.
"""

from __future__ import annotations

import codecs
import dataclasses
import itertools
import mmap
import re
import time
from dataclasses import dataclass, field
from typing import Optional

import pyarrow as pa

from ray_ppu.data.readers import HEAD_BYTES, input_format, is_compressed, is_json_array
from ray_ppu.data.sft.files import decode_json, file_records, open_local, record_entry
from ray_ppu.data.sft.rows import SFTOptions
from ray_ppu.data.sft.windows import merge_stats, process_window
from ray_ppu.errors import PreprocessError

_COUNT_CHUNK = 64 << 20  # newlines are counted this many bytes at a time
_AT = "byte "  # a spread record's place until a problem with it needs its line number
SHOWN_PER_REASON = 3  # bad records a report names per reason (the file under output.dir: all)
FULL_FILES = 16  # files read n + n records each; more share that budget


@dataclass
class SampleReport:
    """What the sample found: the pipeline's statistics over it (``stats``: records read,
    used, dropped by reason, ``bad`` in file order), the files read only from their start
    (compressed), and how long it took."""

    split: str
    files: int
    stats: dict
    seconds: float
    head_only: list[str] = field(default_factory=list)

    def line(self) -> str:
        s = self.stats
        dropped = {k: v for k, v in s["dropped"].items() if v}
        head = (f" ({len(self.head_only)} compressed: first records only)" if self.head_only
                else "")
        return (f"SFT {self.split} sample: {s['records_read']} records of {self.files} file(s) "
                f"read in {self.seconds:.1f} s{head}: {s['samples_used']} usable, "
                f"{s['dropped_total']} dropped{f' {dropped}' if dropped else ''}")


def sample_split(split: str, files: list[str], encoder, options: SFTOptions, n: int) -> SampleReport:
    """Read ``n`` + ``n`` records of each of ``files`` (see the module docstring) through the
    pipeline's steps with ``on_error="skip"``; the caller applies the run's policy
    (:func:`problems`). Over :data:`FULL_FILES` files the budget of that many files is shared
    out (at least one record from the head and one from the rest of every file), so a corpus
    of thousands of shards costs seconds, not minutes."""
    started = time.perf_counter()
    if len(files) > FULL_FILES:
        n = max(1, FULL_FILES * n // len(files))
    options = dataclasses.replace(options, on_error="skip")
    parts, head_only = [], []
    for path in files:
        try:
            records, sought = _sample_records(path, n)
        except (OSError, ValueError, pa.ArrowException) as err:  # unreadable, corrupt Parquet
            raise PreprocessError(f"{path}: cannot read it: {err}") from None
        if not sought:
            head_only.append(path)
        entries = [record_entry(path, where, record) for where, record in records]
        if entries:
            parts.append(_numbered(path, process_window(entries, encoder, options)[1]))
    return SampleReport(split, len(files), merge_stats(parts), time.perf_counter() - started,
                        head_only)


def problems(report: SampleReport, on_error: str, max_dropped_share: float) -> list[str]:
    """The run's policy on a sample, as the launch applies it to the whole split: ``fail``
    refuses its first bad record (prompt_too_long is a length policy, never fatal); either
    way a drop share over ``max_dropped_share`` is refused, listing the reasons."""
    bad = report.stats["bad"]
    if on_error == "fail":
        first = next((message for reason, message in bad if reason != "prompt_too_long"), None)
        if first is not None:
            return [f"data.on_bad_record=fail: {first}"]
    found = over_bound(f"SFT {report.split} sample", report.stats, max_dropped_share,
                       bad_lines(report.stats))
    return [found] if found else []


def over_bound(label: str, stats: dict, bound: float, listed: list[str]) -> Optional[str]:
    """The refusal of records ``stats`` whose dropped share is over ``bound``
    (``data.max_dropped_share``), with the ``listed`` reasons under it; None within it. The
    sample and the launch's whole split are refused in the same words."""
    read, dropped = stats["records_read"], stats["dropped_total"]
    if not read or dropped / read <= bound:
        return None
    return (f"{label}: {dropped} of {read} records dropped ({100 * dropped / read:.0f} %, over "
            f"data.max_dropped_share={bound:g}):\n  " + "\n  ".join(listed))


def bad_lines(stats: dict, shown: int = SHOWN_PER_REASON) -> list[str]:
    """Per reason, in the order they first occur: its count and its first ``shown`` records
    (``file: line N: why``)."""
    lines = []
    for reason in dict.fromkeys(why for why, _ in stats["bad"]):
        count = stats["dropped"][reason]
        firsts = [message for why, message in stats["bad"] if why == reason][:shown]
        more = f" (+{count - len(firsts)} more)" if count > len(firsts) else ""
        lines.append(f"{reason} × {count}: " + "; ".join(firsts) + more)
    return lines


# --- which records ----------------------------------------------------------------------------


def _sample_records(path: str, n: int) -> tuple[list[tuple[str, object]], bool]:
    """``([(where, record or RecordProblem)], whether the spread was read)``."""
    kind = input_format(path)
    if kind == "parquet":
        return _parquet_sample(path, n), True
    with open_local(path) as f:
        array = is_json_array(f.read(HEAD_BYTES))
    if array:  # parsed whole, by the pipeline too
        with open_local(path) as f:
            records = list(file_records(f, path))
        return records[:n] + _spread(records[n:], n), True
    if is_compressed(path):  # no seeking in it
        with open_local(path) as f:
            return list(itertools.islice(file_records(f, path), n)), False
    return _jsonl_sample(path, n), True


def _spread(items, n: int) -> list:
    """``n`` of ``items`` (a list or a range) evenly spaced (all of them when there are no
    more)."""
    if len(items) <= n:
        return list(items)
    return [items[(2 * k + 1) * len(items) // (2 * n)] for k in range(n)]


def _jsonl_sample(path: str, n: int) -> list[tuple[str, object]]:
    """The first ``n`` records of a JSON Lines file, then the line holding each of ``n``
    byte offsets spread over the rest (numbered as :func:`ray_ppu.data.readers.json_records`
    numbers them: blank lines counted, not records)."""
    with open(path, "rb") as f:
        if not f.seek(0, 2):
            return []
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            size, out = len(mm), []
            pos = len(codecs.BOM_UTF8) if mm[:3] == codecs.BOM_UTF8 else 0
            line = 0
            while pos < size and len(out) < n:
                pos, line = _take_line(mm, pos, line, out)
            if pos >= size or not n:
                return out
            taken = set()
            for k in range(n):
                start = mm.rfind(b"\n", pos, pos + (2 * k + 1) * (size - pos) // (2 * n)) + 1
                start = max(start, pos)
                if start not in taken:
                    taken.add(start)
                    _take_line(mm, start, None, out)
            return out


def _take_line(mm, pos: int, line: Optional[int], out: list) -> tuple[int, int]:
    """Append the record of the line starting at ``pos`` (the file's line ``line + 1``; None:
    not counted, named by its byte offset until :func:`_numbered`) when it is not blank;
    returns the next line's start and number of lines read."""
    end = mm.find(b"\n", pos)
    end = len(mm) if end < 0 else end
    text = mm[pos:end]
    if text.strip():
        out.append((f"line {line + 1}" if line is not None else f"{_AT}{pos}", decode_json(text)))
    return end + 1, (line or 0) + 1


def _numbered(path: str, stats: dict) -> dict:
    """``stats`` with its bad spread records named by line number: the newlines before each
    one counted, in one pass up to the last."""
    pattern = re.compile(rf"^{re.escape(path)}: {_AT}(\d+): ")
    offsets = sorted({int(m.group(1)) for _, message in stats["bad"]
                      if (m := pattern.match(message))})
    if not offsets:
        return stats
    lines, counted, before = {}, 0, 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for offset in offsets:
            before += _newlines(mm, counted, offset)
            counted, lines[offset] = offset, before + 1

    def renamed(message: str) -> str:
        return pattern.sub(lambda m: f"{path}: line {lines[int(m.group(1))]}: ", message)

    stats["bad"] = [[reason, renamed(message)] for reason, message in stats["bad"]]
    return stats


def _newlines(mm, start: int, end: int) -> int:
    return sum(mm[a:min(a + _COUNT_CHUNK, end)].count(b"\n")
               for a in range(start, end, _COUNT_CHUNK))


def _parquet_sample(path: str, n: int) -> list[tuple[str, object]]:
    """The first ``n`` rows and ``n`` spread over the rest, reading only their row groups."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    total = pf.metadata.num_rows
    wanted = list(range(min(n, total))) + [n + i for i in _spread(range(total - n), n)] \
        if total > n else list(range(total))
    out, start = [], 0
    starts = []
    for g in range(pf.metadata.num_row_groups):
        starts.append(start)
        start += pf.metadata.row_group(g).num_rows
    by_group: dict[int, list[int]] = {}
    for row in wanted:
        group = max(g for g, s in enumerate(starts) if s <= row)
        by_group.setdefault(group, []).append(row)
    for group, rows in sorted(by_group.items()):
        table = pf.read_row_group(group)
        for row in rows:
            out.append((f"row {row}", table.slice(row - starts[group], 1).to_pylist()[0]))
    return out
