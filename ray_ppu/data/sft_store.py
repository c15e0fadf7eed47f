"""SFT rows, tokenized once by Ray Data and stored on shared disk, then read by sample id.

Fine-tuning corpora are raw JSON shards (:mod:`ray_ppu.data.sft`): Ray Data reads, templates,
tokenizes and packs them in parallel, in input order. :func:`prepare` streams those rows into
one flat file per column under the cache directory (never all in memory), then writes
``meta.json`` last; every reader memory-maps the files. Training then reads row ids exactly as
it reads idxmap samples (:mod:`ray_ppu.data.sampler`): iteration *i* consumes global rows
``[i × gbs, (i+1) × gbs)``, cycling through the rows epoch after epoch (the reference's
"cyclic" loader), so the order is DP-independent and a resumed run continues at the next row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ray_ppu.data.sft.image_samples import VisionData, decode_rows, vision_data
from ray_ppu import quiet
from ray_ppu.errors import PreprocessError, remote_cause

log = logging.getLogger("ray_ppu")

META = "meta.json"
BAD = "bad_records.jsonl"  # every dropped record of a split: {"reason", "record": "file: line N: why"}
BYTES = "bytes"  # a column's dtype in meta.json: variable-length bytes per row (images)
SPLITS = ("train", "valid")


@dataclass(frozen=True)
class SFTSpec:
    """Everything that fixes the SFT rows of a run (hashable: the cache key)."""

    train_paths: tuple[str, ...]
    valid_paths: tuple[str, ...]
    tokenizer_dir: str
    seq_length: int
    max_padding_length: Optional[int]
    packing: bool
    on_error: str
    cache_dir: str
    train_samples: int
    valid_samples: int = 0
    vision: Optional[VisionData] = None  # a vision-language model's images (rows hold file bytes)
    inputs: tuple = ()  # (split, file, size, mtime_ns) of each input file: one edited in place is re-read
    max_dropped_share: float = 1.0  # the share of dropped records that refuses the split

    def paths(self, split: str) -> tuple[str, ...]:
        return {"train": self.train_paths, "valid": self.valid_paths}[split]

    def samples(self, split: str) -> int:
        return {"train": self.train_samples, "valid": self.valid_samples}[split]

    def split_dir(self, split: str) -> Path:
        """Rows depend on inputs, tokenizer and layout, not on how many samples a run reads."""
        key = {k: v for k, v in dataclasses.asdict(self).items()
               if k not in ("cache_dir", "train_samples", "valid_samples", "max_dropped_share")}
        key["split"], key["paths"] = split, self.paths(split)
        key["inputs"] = [entry for entry in self.inputs if entry[0] == split]
        if self.vision is not None:  # caches of the earlier layout held decoded pixels
            key["images_stored_as"] = "file bytes"
        for k in ("train_paths", "valid_paths"):
            key.pop(k)
        digest = hashlib.md5(json.dumps(key, sort_keys=True).encode(), usedforsecurity=False)
        return Path(self.cache_dir) / f"sft-{split}-{digest.hexdigest()[:16]}"


def spec_for(cfg, plan) -> SFTSpec:
    """The SFTSpec of a run (``cfg``: RunConfig with ``data.dataset == "sft"``)."""
    d = cfg.data
    cache = cfg.index_cache_dir()
    return SFTSpec(
        train_paths=tuple(d.data_path),
        valid_paths=tuple(d.valid_data_path),
        tokenizer_dir=str(Path(d.tokenizer).expanduser().resolve()),
        seq_length=cfg.training.seq_length,
        max_padding_length=None if d.packing else plan.seq_length,
        packing=d.packing,
        on_error=d.on_bad_record,
        cache_dir=str(Path(cache).expanduser().resolve()),
        train_samples=plan.train_samples,
        valid_samples=plan.valid_samples,
        vision=vision_data(cfg) if cfg.vision.enabled else None,
        inputs=_fingerprint("train", d.data_path) + _fingerprint("valid", d.valid_data_path),
        max_dropped_share=d.max_dropped_share,
    )


def _fingerprint(split: str, paths: list[str]) -> tuple:
    """(split, file, size, mtime_ns) of each input file of ``split``; none when they do not
    resolve (preparing them then names the problem)."""
    from ray_ppu.data.readers import resolve_inputs

    if not paths:
        return ()
    try:
        stats = [(f, os.stat(f)) for f in resolve_inputs(paths)]
    except (OSError, PreprocessError):
        return ()
    return tuple((split, f, st.st_size, st.st_mtime_ns) for f, st in stats)


def _write_split(spec: SFTSpec, split: str) -> dict:
    """Run the Ray Data pipeline for one split, appending each column to its file."""
    from ray_ppu.data.sft import sft_dataset

    out = spec.split_dir(split)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    ds, stats_fn = sft_dataset(list(spec.paths(split)), spec.tokenizer_dir, spec.seq_length,
                               spec.max_padding_length, spec.packing, spec.on_error,
                               vision=spec.vision)
    tmp.mkdir(parents=True, exist_ok=True)  # after the inputs and tokenizer were checked
    try:
        with _ray_data_errors_unlogged(), quiet.native_stderr_filtered():
            shapes, rows = _write_columns(ds, tmp)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)  # no half-written split stays in the cache
        # A bad record (on_error="fail") raised in a Ray Data actor: the user's error itself
        cause = remote_cause(err)
        if cause is not None:
            raise cause from None
        raise
    summary = stats_fn()
    with open(tmp / BAD, "w", encoding="utf-8") as f:  # the list beside the counts, not in them
        for reason, record in summary.pop("bad"):
            f.write(json.dumps({"reason": reason, "record": record}, ensure_ascii=False) + "\n")
    meta = {"rows": rows, "columns": shapes, "summary": summary, "split": split,
            "paths": list(spec.paths(split))}
    (tmp / META).write_text(json.dumps(meta, indent=2, ensure_ascii=False))
    if out.exists():  # another process finished first: keep its (identical) rows
        return json.loads((out / META).read_text())
    tmp.rename(out)  # published whole: readers never see a half-written split
    return meta


def _write_columns(ds, out: Path) -> tuple[dict, int]:
    """Append every column of ``ds``'s rows to ``out/<column>.bin``; (shapes, rows). A column
    of bytes (a row's images) is one blob, with ``<column>.offsets.bin`` int64 ``[rows + 1]``."""
    files: dict = {}
    shapes: dict = {}
    ends: dict = {}  # a bytes column's offsets (8 bytes a row: 4.5 MB for 558K rows)
    rows = 0
    try:
        for batch in ds.iter_batches(batch_size=256, batch_format="numpy"):
            for key, value in batch.items():
                if key not in files:
                    files[key] = open(out / f"{key}.bin", "wb")
                    shapes[key] = ([], BYTES) if value.dtype == object else (
                        list(value.shape[1:]), value.dtype.str)
                if value.dtype == object:
                    ends.setdefault(key, [0]).extend(files[key].tell() + np.cumsum(
                        [len(v) for v in value]))
                    files[key].write(b"".join(value))
                else:
                    files[key].write(np.ascontiguousarray(value).tobytes())
            rows += len(next(iter(batch.values())))
    finally:
        for f in files.values():
            f.close()
    for key, offsets in ends.items():
        np.asarray(offsets, np.int64).tofile(out / f"{key}.offsets.bin")
    return shapes, rows


@contextlib.contextmanager
def _ray_data_errors_unlogged():
    """Ray Data logs a failed read's whole traceback (about 200 lines) at ERROR before it
    raises the same error to us; here it is raised and reported once, so that log is off."""
    logger = logging.getLogger("ray.data")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def prepare(spec: SFTSpec, bad_records_dir: Optional[Path] = None) -> dict[str, int]:
    """Tokenize (or find in the cache) each split the run reads; returns rows per split.

    Needs a connected Ray. Logs the record accounting (read, used, dropped by reason,
    truncated, packing efficiency) and the first bad records of each reason; copies the whole
    list to ``bad_records_dir/<split>.jsonl``. Fails when a split yields no rows or drops more
    than ``spec.max_dropped_share`` of its records.
    """
    # here, not at the top: readers import this module and need neither pyarrow nor the encoder
    from ray_ppu.data.sft.sample_check import over_bound

    rows = {}
    for split in SPLITS:
        if not spec.samples(split):
            rows[split] = 0
            continue
        meta_path = spec.split_dir(split) / META
        start = time.perf_counter()
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else _write_split(spec, split)
        s = meta["summary"]
        log.info("%s (%s, %.1f s)", summary_line(spec, split, meta), spec.split_dir(split),
                 time.perf_counter() - start)
        listed = _bad_records(spec, split, s["dropped"], bad_records_dir)
        if meta["rows"] == 0:
            raise ValueError(f"SFT {split} data {list(spec.paths(split))} gave no usable "
                             f"samples ({s['records_read']} records read, dropped: "
                             f"{ {k: v for k, v in s['dropped'].items() if v} }):\n  "
                             + "\n  ".join(listed))
        refused = over_bound(f"SFT {split}", s, spec.max_dropped_share, listed)
        if refused:
            raise ValueError(refused)
        for line in listed:
            log.warning("SFT %s: %s", split, line)
        rows[split] = meta["rows"]
    return rows


def _bad_records(spec: SFTSpec, split: str, dropped: dict, out_dir: Optional[Path]) -> list[str]:
    """The split's bad records per reason (``dropped``: its counts; the first few read from
    the list), and where the whole list is (copied to ``out_dir/<split>.jsonl``); [] when
    every record was used."""
    from ray_ppu.data.sft.sample_check import bad_lines

    path = spec.split_dir(split) / BAD
    if not path.is_file() or not path.stat().st_size:
        if out_dir is not None:  # an earlier run's list in the same directory is not this one's
            (out_dir / f"{split}.jsonl").unlink(missing_ok=True)
        return []
    # split at "\n" only: a record's text may hold U+2028, which str.splitlines() also splits at
    bad = [(r["reason"], r["record"]) for r in map(
        json.loads, filter(None, path.read_text(encoding="utf-8").split("\n")))]
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, out_dir / f"{split}.jsonl")
        path = out_dir / f"{split}.jsonl"
    return bad_lines({"dropped": dropped, "bad": bad}) + [f"every bad record: {path}"]


def summary_line(spec: SFTSpec, split: str, meta: dict) -> str:
    """The record accounting of one split: read, used, dropped by reason, truncated, rows."""
    s = meta["summary"]
    return (f"SFT {split}: {s['records_read']} records read, {s['samples_used']} used, "
            f"{s['dropped_total']} dropped {({k: v for k, v in s['dropped'].items() if v})}, "
            f"{s['truncated']} truncated -> {meta['rows']} rows of "
            f"{spec.seq_length if spec.packing else spec.max_padding_length} tokens, packing "
            f"efficiency {100 * s['packing_efficiency']:.1f} %")


def summaries(spec: SFTSpec) -> dict[str, dict]:
    """{split: record accounting} of the prepared splits (the end-of-run data summary)."""
    found = {}
    for split in SPLITS:
        meta_path = spec.split_dir(split) / META
        if spec.samples(split) and meta_path.is_file():
            meta = json.loads(meta_path.read_text())
            found[split] = {**meta["summary"], "rows": meta["rows"],
                            "line": summary_line(spec, split, meta)}
    return found


class _Blobs:
    """A bytes column: row ``i`` is ``blob[offsets[i]:offsets[i + 1]]``."""

    def __init__(self, path: Path, rows: int):
        self.offsets = np.fromfile(path.with_suffix(".offsets.bin"), np.int64)
        # np.memmap refuses an empty file (rows whose records had no image)
        self.blob = (np.memmap(path, np.uint8, mode="r") if self.offsets[-1]
                     else np.zeros(0, np.uint8))
        assert len(self.offsets) == rows + 1, (path, len(self.offsets), rows)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        out = np.empty(len(rows), object)
        out[:] = [self.blob[self.offsets[r]:self.offsets[r + 1]].tobytes() for r in rows]
        return out


@functools.lru_cache(maxsize=8)
def dataset(spec: SFTSpec, split: str = "train") -> dict:
    """This process's memory maps of one split's columns (``[rows, ...]`` each)."""
    out = spec.split_dir(split)
    meta = json.loads((out / META).read_text())
    return {key: _Blobs(out / f"{key}.bin", meta["rows"]) if dtype == BYTES else
            np.memmap(out / f"{key}.bin", dtype=np.dtype(dtype), mode="r",
                      shape=(meta["rows"], *shape))
            for key, (shape, dtype) in meta["columns"].items()}


def read(spec: SFTSpec, sample_ids: np.ndarray, split: str = "train") -> dict[str, np.ndarray]:
    """Rows ``sample_ids`` of ``split`` (cycling: id modulo the row count), every column; a
    vision-language row's images decoded to pixels (here, in the reader process)."""
    columns = dataset(spec, split)
    n = len(next(iter(columns.values())))
    ids = np.asarray(sample_ids, dtype=np.int64)
    out = {key: np.array(col[ids % n]) for key, col in columns.items()}
    if spec.vision is not None:
        out = decode_rows(out, spec.vision)
    out["sample_id"] = ids  # the run's sample number (for output.sample_log), not the row
    return out
