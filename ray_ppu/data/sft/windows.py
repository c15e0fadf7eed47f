"""One packing window → rows and statistics; and the whole pipeline in this process, without Ray.

:func:`process_window` is the step every path runs: the Ray Data actors
(:mod:`ray_ppu.data.sft.ray_source`) and the in-process :func:`sft_rows` (already-parsed
records: tests, inspection) and :func:`sft_rows_from_files` (files: inspection, torchrun runs
without Ray). All of them cut the input into the same windows, so they give the same rows in
the same order. The statistics of each window (records read, used, dropped per reason with the
first message of each reason, tokens) merge into the summary that :func:`sft_dataset`
documents.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from ray_ppu.data.sft.chat_encoder import ChatEncoder
from ray_ppu.data.sft.files import file_entries, open_local, record_entry, resolve_sft_inputs, windows
from ray_ppu.data.sft.image_samples import (VisionData, check_fit, check_native_fit,
                                            image_columns, read_images, read_native_images,
                                            whole_images)
from ray_ppu.data.sft.records import DROP_REASONS, RecordProblem, check_image_tags
from ray_ppu.data.sft.rows import (
    DEFAULT_MAX_SAMPLES_PER_ROW,
    DEFAULT_WINDOW,
    SFTOptions,
    concat_rows,
    empty_rows,
    make_sample,
    pack_groups,
    pack_rows,
    pad_rows,
)
from ray_ppu.errors import PreprocessError

# --- statistics -------------------------------------------------------------------------------


def new_stats() -> dict:
    """The statistics of no records."""
    return {"records_read": 0, "samples_used": 0, "dropped": dict.fromkeys(DROP_REASONS, 0),
            "truncated": 0, "rows": 0, "sample_tokens": 0, "row_tokens": 0, "loss_tokens": 0,
            "bad": []}


def _count_problem(stats: dict, reason: str, message: str) -> None:
    stats["dropped"][reason] += 1
    stats["bad"].append([reason, message])


def merge_stats(parts: Iterable[dict]) -> dict:
    """The summary of several windows' statistics (in window order: the first example wins)."""
    total = new_stats()
    for part in parts:
        for key in ("records_read", "samples_used", "truncated", "rows", "sample_tokens", "row_tokens",
                    "loss_tokens"):
            total[key] += part[key]
        for reason, n in part["dropped"].items():
            total["dropped"][reason] += n
        total["bad"] += part["bad"]
    total["examples"] = {}  # the first bad record of each reason
    for reason, message in total["bad"]:
        total["examples"].setdefault(reason, message)
    total["dropped_total"] = sum(total["dropped"].values())
    total["packing_efficiency"] = total["sample_tokens"] / total["row_tokens"] if total["row_tokens"] else 0.0
    return total


# --- one window: conversations → rows ---------------------------------------------------------


def process_window(entries: Sequence[tuple], encoder: ChatEncoder, options: SFTOptions):
    """Rows and statistics of one window of entries (see the package docstring).

    Every record is checked before any is reported, so the window's bad records come out in
    file order (``stats["bad"]``: ``[reason, "file: line N: why"]``), and with
    ``on_error="fail"`` the error names the first of them (prompt_too_long, a length policy,
    never fails)."""
    stats = new_stats()
    stats["records_read"] = len(entries)
    bad: list[tuple[int, RecordProblem, str]] = []  # (entry index, problem, where)
    good = []  # (entry index, entry)
    for index, entry in enumerate(entries):
        if entry[0] == "problem":  # its message already names the place
            bad.append((index, RecordProblem(entry[1], entry[2]), ""))
            continue
        try:
            _check_images(entry, options)
            good.append((index, entry))
        except RecordProblem as problem:
            bad.append((index, problem, entry[2]))
    vision = options.vision
    image_token = (vision.token_id, vision.tokens_per_image) if vision else None
    if vision is not None and vision.native:  # token counts depend on the images' sizes
        good, image_token = _read_native(good, bad, options)
    samples = []
    for (index, entry), result in zip(good, encoder.encode_many([e[1] for _, e in good], image_token)):
        try:
            if isinstance(result, RecordProblem):
                raise result
            sample = _sample(entry, result, options)
        except RecordProblem as problem:
            bad.append((index, problem, entry[2]))
            continue
        samples.append(sample)
        stats["truncated"] += sample[3]
        stats["sample_tokens"] += len(sample[0])
        stats["loss_tokens"] += int(sample[2].sum())
    _report_bad(stats, options, bad)
    stats["samples_used"] = len(samples)
    rows = _rows(samples, encoder, options)
    stats["rows"] = len(rows["tokens"])
    stats["row_tokens"] = stats["rows"] * options.row_length
    return rows, stats


def _report_bad(stats: dict, options: SFTOptions, bad: list) -> None:
    """Count the window's dropped records in file order (``fail``: raise for the first one
    that is not the prompt_too_long length policy)."""
    bad.sort(key=lambda found: found[0])
    messages = [(problem.reason, f"{where}: {problem.message}" if where else problem.message)
                for _, problem, where in bad]
    if options.on_error == "fail":
        fatal = next((message for reason, message in messages if reason != "prompt_too_long"), None)
        if fatal is not None:
            raise PreprocessError(fatal)
    for reason, message in messages:
        _count_problem(stats, reason, message)


def _check_images(entry: tuple, options: SFTOptions) -> None:
    """A record's images fit the model: none for a text model, one tag each for a
    vision-language one."""
    images = entry[3] if len(entry) > 3 else []
    if options.vision is None:
        if images:
            raise RecordProblem("bad_field_type", f"{len(images)} image(s), and the model has "
                                f"no vision part (vision.encoder)")
        return
    check_image_tags(entry[1], images)


def _read_native(good: list, bad: list, options: SFTOptions) -> tuple[list, list]:
    """Native-resolution images: each record's images read (file bytes appended to its entry)
    and sized; the records that fit (with their entry index), and each one's images' token ids
    for the encoder. The others go to ``bad``."""
    vision, kept, ids = options.vision, [], []
    for index, entry in good:
        # (kind, conversation, where, images, record file): every field, the bytes after them
        entry = (*entry[:3], entry[3] if len(entry) > 3 else [], entry[4] if len(entry) > 4 else "")
        try:
            paths = vision.resolve(entry[3], entry[4])
            data, tokens = read_native_images(paths, vision)
            check_native_fit(vision, options.row_length, tokens)
        except RecordProblem as problem:
            bad.append((index, problem, entry[2]))
            continue
        kept.append((index, (*entry, data)))
        ids.append([vision.image_ids(n) for n in tokens])
    return kept, ids


def _sample(entry: tuple, encoded: tuple, options: SFTOptions) -> tuple:
    """The sample of one encoded conversation (with its images' file bytes, for a
    vision-language model); a RecordProblem when it cannot be used."""
    length = options.row_length
    ids, mask = encoded
    vision, images = options.vision, (entry[3] if len(entry) > 3 else [])
    if vision is not None and not vision.native:  # native: checked by _read_native
        check_fit(vision, length, len(images))
    sample = make_sample(ids, mask, length)
    if vision is not None and sample is not None:
        sample, kept = whole_images(sample, vision, length)
        images = images[:kept]
    if sample is None:
        prompt = mask.index(1) if 1 in mask else len(mask)
        raise RecordProblem("prompt_too_long", f"the prompt alone is {prompt} tokens, the row "
                            f"{length}")
    if vision is None:
        return sample
    if vision.native:  # read before encoding: the whole images' bytes
        return (*sample, entry[5][:len(images)])
    return (*sample, read_images(vision.resolve(images, entry[4]), vision))


def _rows(samples: list, encoder: ChatEncoder, options: SFTOptions) -> dict:
    """The window's rows: padded or packed, with image columns for a vision-language model."""
    if not samples:
        return empty_rows(options)
    length = options.row_length
    if options.packing:
        rows = pack_rows(samples, options.seq_length, encoder.pad_id, options.max_samples_per_row)
    else:
        rows = pad_rows(samples, length, encoder.pad_id)
    if options.vision is not None:
        groups = (pack_groups(samples, options.seq_length, options.max_samples_per_row)
                  if options.packing else [[sample] for sample in samples])
        rows.update(image_columns(groups, options.vision, length))
    return rows


# --- the whole pipeline in this process -------------------------------------------------------


def as_encoder(tokenizer) -> ChatEncoder:
    """``tokenizer`` itself when it is a :class:`ChatEncoder`, else the one of that directory."""
    return tokenizer if isinstance(tokenizer, ChatEncoder) else ChatEncoder(tokenizer)


def sft_rows(records: Sequence[object], tokenizer: ChatEncoder | str | Path, seq_length: int,
             max_padding_length: int | None = None, packing: bool = False, on_error: str = "skip",
             *, window: int = DEFAULT_WINDOW, max_samples_per_row: int = DEFAULT_MAX_SAMPLES_PER_ROW,
             source: str = "<records>", vision: Optional[VisionData] = None
             ) -> tuple[dict[str, np.ndarray], dict]:
    """Rows and summary of already-parsed records, in this process (tests, inspection).

    ``records`` are treated as one file named ``source`` (windows of ``window`` records), so a
    JSONL file holding the same records gives the same rows through :func:`sft_dataset`.
    ``tokenizer``: a :class:`ChatEncoder` or a tokenizer directory. Returns ``(rows, summary)``;
    rows: dict of arrays ``[n_rows, row_length]`` (+ packing columns), summary: see
    :func:`sft_dataset`.
    """
    options = SFTOptions(seq_length, max_padding_length, packing, on_error, window, max_samples_per_row,
                         vision)
    encoder = as_encoder(tokenizer)

    def entries():
        for i, record in enumerate(records):
            yield record_entry(source, f"record {i}", record)

    return _run_windows([windows(entries(), options.window)], encoder, options, files=1)


def sft_rows_from_files(paths: Sequence[str | Path], tokenizer: ChatEncoder | str | Path, seq_length: int,
                        max_padding_length: int | None = None, packing: bool = False,
                        on_error: str = "skip", *, window: int = DEFAULT_WINDOW,
                        max_samples_per_row: int = DEFAULT_MAX_SAMPLES_PER_ROW,
                        vision: Optional[VisionData] = None, max_records: int = 0
                        ) -> tuple[dict[str, np.ndarray], dict]:
    """:func:`sft_dataset`'s rows and summary, computed in this process without Ray.

    Same arguments and the same rows in the same order (the windows are the same); for
    inspection, and for runs without Ray (torchrun). ``max_records``: only the first this many
    records of each file (0: all; a multiple of ``window`` keeps those windows' rows exact).
    """
    options = SFTOptions(seq_length, max_padding_length, packing, on_error, window, max_samples_per_row,
                         vision)
    files = resolve_sft_inputs(paths)
    encoder = as_encoder(tokenizer)

    def file_windows(path):
        with open_local(path) as f:
            entries = file_entries(f, path)
            yield from windows(itertools.islice(entries, max_records or None), options.window)

    return _run_windows([file_windows(p) for p in files], encoder, options, files=len(files))


def _run_windows(per_file, encoder: ChatEncoder, options: SFTOptions, files: int):
    parts, stats = [], []
    count = 0
    for file_windows in per_file:
        for _, _, entries in file_windows:
            rows, window_stats = process_window(entries, encoder, options)
            parts.append(rows)
            stats.append(window_stats)
            count += 1
    summary = merge_stats(stats)
    summary.update(files=files, windows=count, complete=True)
    return concat_rows(parts, options), summary
