"""SFT rows as a streaming, order-preserving Ray Dataset (:func:`sft_dataset`).

Ray Data reads each file into windows (one dataset row per window, so that Ray never splits or
merges one: the packing does not depend on its block sizes), a pool of actors turns windows
into rows with :func:`ray_ppu.data.sft.windows.process_window`, and a small actor gathers each
window's statistics for the summary. The read is fused into the actors, as
:func:`ray_ppu.data.preprocess.preprocess_with_ray` does, and the rows stay in input order:
the data contract.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import ray
import ray.data
from ray.data.datasource import FileBasedDatasource

from ray_ppu.data.readers import ParquetRandomAccess
from ray_ppu.data.sft.chat_encoder import ChatEncoder
from ray_ppu.data.sft.image_samples import VisionData
from ray_ppu.data.sft.files import file_entries, resolve_sft_inputs, windows
from ray_ppu.data.sft.rows import DEFAULT_MAX_SAMPLES_PER_ROW, DEFAULT_WINDOW, SFTOptions, concat_rows
from ray_ppu.data.sft.windows import as_encoder, merge_stats, process_window


class _SFTWindows(ParquetRandomAccess, FileBasedDatasource):
    """One row per window of a file's records: ``source``, ``window``, ``last`` and ``entries``
    (JSON: ``["ok", messages, where]`` / ``["problem", reason, message]``). A window is one
    row so that Ray Data never splits or merges it: packing stays independent of block sizes."""

    def __init__(self, paths: list[str], window: int) -> None:
        super().__init__(paths)
        self._window = window

    def _read_stream(self, f, path: str):
        for index, last, entries in windows(file_entries(f, path), self._window):
            yield pa.table({"source": pa.array([path], pa.string()), "window": pa.array([index], pa.int64()),
                            "last": pa.array([last], pa.bool_()),
                            "entries": pa.array([json.dumps(entries, ensure_ascii=False)], pa.large_string())})


class _StatsSink:
    """Ray actor: the statistics of each processed window, keyed by (file, window) so that a
    retried task or a second pass over the dataset does not count twice."""

    def __init__(self, files: list[str]) -> None:
        self.order = {os.path.normpath(f): i for i, f in enumerate(files)}
        self.files = files
        self.windows: dict[tuple[int, int], dict] = {}
        self.last: dict[int, int] = {}

    def report(self, source: str, window: int, last: bool, stats: dict) -> None:
        file = self.order.get(os.path.normpath(source))
        if file is None:  # not expected: Ray hands our own paths back
            file = self.order.setdefault(os.path.normpath(source), len(self.order))
        self.windows[(file, window)] = stats
        if last:
            self.last[file] = window

    def summary(self) -> dict:
        summary = merge_stats(self.windows[k] for k in sorted(self.windows))
        complete = (len(self.last) == len(self.files) and
                    all((f, w) in self.windows for f, n in self.last.items() for w in range(n + 1)))
        summary.update(files=len(self.files), windows=len(self.windows), complete=complete)
        return summary


class _ProcessWindows:
    """Ray Data actor: windows → rows (tokenize with the chat template, pad or pack)."""

    def __init__(self, encoder: ChatEncoder, options: SFTOptions, sink) -> None:
        # One CPU per actor: the Rust tokenizer would otherwise start a thread per core.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.encoder, self.options, self.sink = encoder, options, sink

    def __call__(self, batch: pa.Table) -> dict[str, np.ndarray]:
        parts = []
        for source, window, last, entries in zip(*(batch.column(c).to_pylist()
                                                   for c in ("source", "window", "last", "entries"))):
            rows, stats = process_window([tuple(e) for e in json.loads(entries)], self.encoder, self.options)
            parts.append(rows)
            # Waited for: when the consumer has the rows, the summary already counts them.
            ray.get(self.sink.report.remote(source, window, last, stats))
        return concat_rows(parts, self.options)


def sft_dataset(paths: Sequence[str | Path], tokenizer_dir: ChatEncoder | str | Path, seq_length: int,
                max_padding_length: int | None = None, packing: bool = False, on_error: str = "skip",
                *, window: int = DEFAULT_WINDOW, max_samples_per_row: int = DEFAULT_MAX_SAMPLES_PER_ROW,
                workers: int | None = None, vision: VisionData | None = None
                ) -> tuple["ray.data.Dataset", Callable[[], dict]]:
    """SFT rows of JSON / JSONL / Parquet files as a streaming, order-preserving Ray Dataset.

    ``paths``: files, directories or globs. ``tokenizer_dir``: a Hugging Face tokenizer
    directory with a ``chat_template`` (same path on every node), or a :class:`ChatEncoder`. ``seq_length``,
    ``max_padding_length``, ``packing``, ``on_error``, ``window``, ``max_samples_per_row``: see
    :class:`SFTOptions`. ``vision``: a vision-language model's image settings (the actors then
    decode each sample's images into the rows' ``images`` / ``num_images`` columns). ``workers``: actors that read, tokenize and pack (default: the
    cluster's CPUs, at most one per file: a file is read by one actor).

    Checked now, in the caller: inputs exist (else :class:`PreprocessError` naming the paths),
    the tokenizer and its template load, the options are consistent. Record problems surface
    while the dataset is consumed (counted, or raised with ``on_error="fail"``).

    Returns ``(dataset, stats_fn)``. Rows: ``tokens``, ``labels``, ``position_ids`` int32 and
    ``loss_mask`` float32, each ``[row_length]``; with packing also ``cu_seqlens`` int32
    ``[min(max_samples_per_row, seq_length) + 2]``, ``num_seqs`` and ``max_seqlen`` int32.
    ``stats_fn()`` returns the summary over the windows processed so far (``complete`` once
    every window of every file has been): ``records_read``, ``samples_used``, ``dropped``
    (per reason, and ``dropped_total``), ``truncated``, ``rows``, ``sample_tokens`` (non-pad),
    ``row_tokens``, ``loss_tokens``, ``packing_efficiency`` (= sample_tokens / row_tokens),
    ``examples`` (the first message per drop reason), ``files``, ``windows``.
    Needs a connected Ray.
    """
    options = SFTOptions(seq_length, max_padding_length, packing, on_error, window, max_samples_per_row,
                         vision)
    files = resolve_sft_inputs(paths)
    encoder = as_encoder(tokenizer_dir)
    if workers is None:
        workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
    workers = max(1, min(workers, len(files)))
    sink = ray.remote(_StatsSink).options(num_cpus=0).remote(files)
    # One read task per file, fused into the actors (as preprocess_with_ray does: a read task
    # that had to wait for a CPU the actors hold would stall the pipeline).
    ds = ray.data.read_datasource(_SFTWindows(files, options.window), override_num_blocks=len(files))
    ds.context.execution_options.preserve_order = True  # rows in input order: the data contract
    ds.context.enable_progress_bars = False
    # A bad record with on_error="fail" reaches the consumer as our PreprocessError, naming
    # file and line (not as Ray Data's UserCodeException, which does not carry its cause over)
    ds.context.raise_original_map_exception = True
    # A column Arrow cannot hold natively (a block of image file bytes it does not take as
    # binary) is pickled; said explicitly, Ray Data does not log its ArrowConversionError
    # warning about it on a user's run (the rows are the same either way)
    ds.context.enable_fallback_to_arrow_object_ext_type = True
    pool = ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=2)
    ds = ds.map_batches(_ProcessWindows, fn_constructor_args=(encoder, options, sink), batch_size=None,
                        batch_format="pyarrow", compute=pool, num_cpus=1)

    def stats_fn() -> dict:
        return ray.get(sink.summary.remote())

    return ds, stats_fn
