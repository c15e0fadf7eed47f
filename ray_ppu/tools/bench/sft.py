"""``benchmark.py sft``: SFT records per second per core through Ray Data, packing vs padding.

A synthetic instruction corpus (``--records`` alpaca and chat records, a third Chinese,
log-normal lengths) read, templated, tokenized and padded or packed by the SFT Ray Data
pipeline (:func:`ray_ppu.data.sft.sft_dataset`) with each ``--workers`` count of tokenizer
actors: records per second per core, and the fraction of non-pad tokens per row, padded vs
packed (the compute packing saves).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HELP = "SFT records/s per core through Ray Data; packing efficiency vs padding"
_LATIN = "the of and to in is for that with on as model data train value result".split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--records", type=int, default=60_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="tokenizer actor counts to measure (one CPU each)")
    parser.add_argument("--dir", default="outputs/benchmark_sft", help="corpus and tokenizer")


def _text(rng, words: int, chinese: bool) -> str:
    if chinese:  # common CJK ideographs, with a full stop every ~12 characters
        return "".join(chr(0x4E00 + rng.randrange(0, 3000)) + ("。" if rng.random() < 0.08 else "")
                       for _ in range(words))
    return " ".join(rng.choice(_LATIN) if rng.random() < 0.5 else
                    "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                    for _ in range(words))


def sft_corpus(directory: Path, records: int, shards: int, seed: int = 0) -> list[Path]:
    """``records`` SFT records in ``shards`` JSONL files: 80 % alpaca, 20 % chat (1-3 turns),
    a third Chinese; lengths log-normal like instruction data (prompt median ~40 words,
    response ~120, a long tail past the sequence length), written once."""
    import math
    import random

    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"sft_{i:02d}.jsonl" for i in range(shards)]
    if all(p.exists() for p in paths):
        return paths
    rng = random.Random(seed)

    def words(median: float) -> int:
        return max(1, int(rng.lognormvariate(math.log(median), 0.9)))

    files = [open(p, "w", encoding="utf-8") for p in paths]
    try:
        for i in range(records):
            zh = rng.random() < 1 / 3
            if rng.random() < 0.8:
                record = {"instruction": _text(rng, words(25), zh),
                          "input": _text(rng, words(15), zh) if rng.random() < 0.4 else "",
                          "output": _text(rng, words(120), zh)}
            else:
                turns = []
                for _ in range(rng.randint(1, 3)):
                    turns += [{"role": "user", "content": _text(rng, words(30), zh)},
                              {"role": "assistant", "content": _text(rng, words(100), zh)}]
                record = {"messages": turns}
            files[i * shards // records].write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        for f in files:
            f.close()
    return paths


def main(args) -> None:
    """1. Corpus and tokenizer. 2. For each worker count: the corpus through Ray Data padded
    and packed (alternating), rows counted as they arrive. 3. Records/s per core, efficiency."""
    import ray

    from ray_ppu.data.tokenizer import export_qwen2_tokenizer

    root = Path(args.dir).resolve()
    t0 = time.perf_counter()
    paths = sft_corpus(root / "raw", args.records, args.shards)
    tokenizer = export_qwen2_tokenizer(root / "tokenizer")
    mb = sum(p.stat().st_size for p in paths) / 1e6
    print(f"corpus: {args.records} records in {len(paths)} shards, {mb:.0f} MB "
          f"(ready in {time.perf_counter() - t0:.1f} s); seq_length {args.seq_length}", flush=True)
    ray.init(num_cpus=max(args.workers), log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    results = {}
    try:
        for workers in args.workers:
            for mode in ("padding", "packing"):
                results[(workers, mode)] = _through_ray_data(paths, tokenizer, args.seq_length,
                                                             workers, mode)
    finally:
        ray.shutdown()
    w = max(args.workers)
    print(f"\nrecords/s per core ({w} workers): padding {results[(w, 'padding')][0]:,.0f}, "
          f"packing {results[(w, 'packing')][0]:,.0f}; non-pad tokens per row: padding "
          f"{100 * results[(w, 'padding')][1]:.1f} %, packing {100 * results[(w, 'packing')][1]:.1f} % "
          f"-> packing needs {results[(w, 'padding')][1] / results[(w, 'packing')][1]:.2f}x the "
          f"rows (compute) of padding")


def _through_ray_data(paths: list[Path], tokenizer, seq_length: int, workers: int,
                      mode: str) -> tuple[float, float]:
    """The corpus through the pipeline once (``mode`` padding or packing): its line printed;
    (records/s per worker, packing efficiency)."""
    from ray_ppu.data.sft import sft_dataset

    ds, stats_fn = sft_dataset(
        [str(p) for p in paths], str(tokenizer), seq_length,
        max_padding_length=None if mode == "packing" else seq_length,
        packing=mode == "packing", workers=workers)
    start = time.perf_counter()
    rows = sum(len(b["tokens"]) for b in ds.iter_batches(batch_size=1024,
                                                          batch_format="numpy"))
    wall = time.perf_counter() - start
    stats = stats_fn()
    assert stats["complete"] and stats["rows"] == rows, stats
    rate = stats["records_read"] / wall
    print(f"{mode:8s} {workers} worker(s): {stats['records_read']} records -> "
          f"{rows} rows in {wall:.1f} s = {rate:,.0f} records/s = "
          f"{rate / workers:,.0f} per core | non-pad tokens "
          f"{100 * stats['packing_efficiency']:.1f} % | dropped "
          f"{stats['dropped_total']}, truncated {stats['truncated']}", flush=True)
    return rate / workers, stats["packing_efficiency"]
