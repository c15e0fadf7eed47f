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

Spread records are found by byte offset (JSON Lines: the line holding each offset, its number
counted from the newlines before it) or by row (Parquet: only the row groups holding them are
read), so the time does not grow with the file's records; a compressed file cannot be sought
in, and gives its first records only (said in the report). A JSON-array file is parsed whole
by the pipeline too.
"""

from __future__ import annotations

import itertools
import mmap
import time
from dataclasses import dataclass, field

from ray_ppu.data.readers import input_format, is_compressed
from ray_ppu.data.sft.files import decode_json, file_records, open_local, record_entry
from ray_ppu.data.sft.rows import SFTOptions
from ray_ppu.data.sft.windows import merge_stats, process_window

_COUNT_CHUNK = 64 << 20  # newlines are counted this many bytes at a time
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

    @property
    def dropped_share(self) -> float:
        read = self.stats["records_read"]
        return self.stats["dropped_total"] / read if read else 0.0

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
    options = SFTOptions(options.seq_length, options.max_padding_length, options.packing,
                         "skip", options.window, options.max_samples_per_row, options.vision)
    parts, head_only = [], []
    for path in files:
        records, sought = _sample_records(path, n)
        if not sought:
            head_only.append(path)
        entries = [record_entry(path, where, record) for where, record in records]
        if entries:
            parts.append(process_window(entries, encoder, options)[1])
    return SampleReport(split, len(files), merge_stats(parts), time.perf_counter() - started,
                        head_only)


def problems(report: SampleReport, on_error: str, max_dropped_share: float) -> list[str]:
    """The run's policy on a sample (or on a whole split's statistics): ``fail`` refuses its
    first bad record (prompt_too_long is a length policy, never fatal); ``skip`` refuses a
    drop share over ``max_dropped_share``, listing the reasons."""
    bad = report.stats["bad"]
    if on_error == "fail":
        first = next((message for reason, message in bad if reason != "prompt_too_long"), None)
        if first is not None:
            return [f"data.on_bad_record=fail: {first}"]
        return []
    if report.stats["records_read"] and report.dropped_share > max_dropped_share:
        return [f"SFT {report.split} sample: {report.stats['dropped_total']} of "
                f"{report.stats['records_read']} records dropped ({100 * report.dropped_share:.0f} %, "
                f"over data.max_dropped_share={max_dropped_share:g}):\n  "
                + "\n  ".join(bad_lines(report.stats))]
    return []


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
        head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
    if head[:1] == b"[":  # a JSON array: parsed whole, by the pipeline too
        with open_local(path) as f:
            records = list(file_records(f, path))
        return records[:n] + _spread(records[n:], n), True
    if is_compressed(path):  # no seeking in it
        with open_local(path) as f:
            return list(itertools.islice(file_records(f, path), n)), False
    return _jsonl_sample(path, n), True


def _spread(items: list, n: int) -> list:
    """``n`` of ``items`` evenly spaced (all of them when there are no more)."""
    if len(items) <= n:
        return items
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
            pos = 3 if mm[:3] == b"\xef\xbb\xbf" else 0
            line = 0
            while pos < size and len(out) < n:
                pos, line = _take_line(mm, pos, line, out)
            if pos >= size or not n:
                return out
            counted, lines_before = pos, line
            taken = set()
            for k in range(n):
                start = mm.rfind(b"\n", pos, pos + (2 * k + 1) * (size - pos) // (2 * n)) + 1
                start = max(start, pos)
                if start in taken:
                    continue
                taken.add(start)
                lines_before += _newlines(mm, counted, start)
                counted = start
                _take_line(mm, start, lines_before, out)
            return out


def _take_line(mm, pos: int, line: int, out: list) -> tuple[int, int]:
    """Append the record of the line starting at ``pos`` (the file's line ``line + 1``) when
    it is not blank; returns the next line's start and number of lines read."""
    end = mm.find(b"\n", pos)
    end = len(mm) if end < 0 else end
    text = mm[pos:end]
    if text.strip():
        out.append((f"line {line + 1}", decode_json(text)))
    return end + 1, line + 1


def _newlines(mm, start: int, end: int) -> int:
    return sum(mm[a:min(a + _COUNT_CHUNK, end)].count(b"\n")
               for a in range(start, end, _COUNT_CHUNK))


def _parquet_sample(path: str, n: int) -> list[tuple[str, object]]:
    """The first ``n`` rows and ``n`` spread over the rest, reading only their row groups."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    total = pf.metadata.num_rows
    wanted = list(range(min(n, total))) + [n + i for i in _spread(list(range(total - n)), n)] \
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
