"""``benchmark.py data``: the data path of one simulated node of data ranks, without training.

The shape is the reference 7B layout's (TP 1 on one 16-PPU node: 16 data ranks, seq 4096,
mbs 1, gbs 256, validation on). The driver starts the node's readers exactly as a launch does
(:func:`ray_ppu.data.reader_pool.start`, then the first iterations of both splits read ahead), then
every rank's train and validation streams start at once, one thread per rank in this process
(the consumers are not what is measured), and read ``--iters`` iterations as fast as they can.

Figures (printed, and written with ``--json``): reader processes and their PSS (psutil: shared
pages divided among the processes sharing them), their CPU seconds per 1,000 samples, the time
from asking the readers to each rank's first batch, and tokens/s per rank beside what a rank
consumes: the 0.5B preset's FLOPs per token (Megatron-LM's count, :mod:`ray_ppu.plan`) at 50 %
MFU of a PPU's bf16 peak — the hungriest model we ship per device.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from ray_ppu.tools.bench.common import write_json

VOCAB = 151_936
HELP = ("the data path of one node of data ranks: reader processes, PSS, CPU, first batch, "
        "tokens/s per rank")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=float, default=2e8, help="synthetic corpus size")
    parser.add_argument("--dir", default="outputs/benchmark_data", help="corpus and index cache")
    parser.add_argument("--data-ranks", type=int, default=16, help="data ranks on the node (DP)")
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--iters", type=int, default=20, help="iterations each rank reads")
    parser.add_argument("--json", default=None, help="write the figures here")


def main(args) -> dict:
    """The synthetic corpus under ``--dir`` (written once), then :func:`run` over it."""
    work = Path(args.dir).resolve()
    prefix = work / f"synthetic_{args.tokens:.0e}".replace("+", "")
    t0 = time.perf_counter()
    synthetic_corpus(prefix, int(args.tokens))
    print(f"corpus {prefix}: {int(args.tokens):.3g} tokens, "
          f"{Path(f'{prefix}.bin').stat().st_size / 1e9:.2f} GB "
          f"(ready in {time.perf_counter() - t0:.1f} s)", flush=True)
    return run(prefix, work / "index_cache", args.data_ranks, args.seq_length,
               args.global_batch_size, args.iters, args.json)


def consumed_tokens_per_s(seq_length: int, global_batch_size: int, data_ranks: int,
                          mfu: float = 0.5) -> float:
    """Tokens/s one PPU trains on for the 0.5B preset at ``mfu`` of the PPU's bf16 peak."""
    from ray_ppu.config.loader import load
    from ray_ppu.devices.specs import peak_tflops
    from ray_ppu.plan import build_plan

    cfg = load(None, ["model.preset=0.5B", f"training.seq_length={seq_length}",
                      f"training.global_batch_size={global_batch_size}",
                      "training.micro_batch_size=1", f"cluster.num_workers={data_ranks}",
                      "training.train_iters=10", "cluster.accelerator=ppu-810e",
                      "data.data_path=[unused]"])  # the plan needs a corpus name, not its files
    plan = build_plan(cfg)
    flops_per_token = plan.flops_per_iteration / (global_batch_size * seq_length)
    return mfu * peak_tflops(cfg.cluster.accelerator) * 1e12 / flops_per_token


def run(corpus_prefix: Path, cache: Path, data_ranks: int, seq_length: int,
        global_batch_size: int, iters: int, json_path: str | None) -> dict:
    import ray

    from ray_ppu.data import idxmap, reader_pool

    train_samples = (iters + 2) * global_batch_size
    spec = idxmap.SampleSpec(prefixes=(str(corpus_prefix),), weights=None, split="98,2,0",
                             seq_length=seq_length, seed=1234, train_samples=train_samples,
                             index_cache_dir=str(cache), eod_token_id=VOCAB - 1,
                             vocab_size=VOCAB, valid_samples=2 * global_batch_size)
    t0 = time.perf_counter()
    idxmap.prepare(spec)
    print(f"indices ready in {time.perf_counter() - t0:.1f} s", flush=True)
    starts = {"train": (0, iters), "valid": (0, 2)}
    ray.init(address="local", num_cpus=max(4, reader_pool.readers_per_node(0, data_ranks) + 2),
             resources={"PPU": data_ranks}, log_to_driver=False)
    try:
        node = stream_node({"manifest": str(idxmap.manifest(spec))}, data_ranks,
                           global_batch_size, starts)
    finally:
        ray.shutdown()
    results = node["ranks"]
    samples = sum(r["samples"] for r in results)
    tokens_per_rank = [r["samples"] * seq_length / r["seconds"] for r in results]
    figures = {
        "data_ranks": data_ranks, "seq_length": seq_length,
        "global_batch_size": global_batch_size, "iterations": iters,
        "reader_processes": len(node["pss_mb"]),
        "reader_pss_mb_total": sum(node["pss_mb"]), "reader_pss_mb_max": max(node["pss_mb"]),
        "reader_cpu_s_per_1000_samples": 1000 * node["cpu_s"] / samples,
        "first_batch_s_max": max(r["first_batch_s"] for r in results),
        "first_batch_s_median": statistics.median(r["first_batch_s"] for r in results),
        "tokens_per_s_per_rank": min(tokens_per_rank),
        "tokens_per_s_per_rank_median": statistics.median(tokens_per_rank),
        "consumed_tokens_per_s_per_rank": consumed_tokens_per_s(seq_length, global_batch_size,
                                                                data_ranks),
    }
    _print(figures)
    if json_path:
        write_json(json_path, figures)
    return figures


def stream_node(source: dict, data_ranks: int, global_batch_size: int, starts: dict) -> dict:
    """One node's readers of ``source`` started on the connected Ray as a launch starts them
    (then the first iterations read ahead), and every data rank's streams read at once (mbs
    1, TP 1): {"ranks": per-rank first batch, samples, seconds; "pss_mb" and "cpu_s" of the
    reader processes}."""
    import psutil
    import ray

    from ray_ppu.data import reader_pool

    per_node = reader_pool.readers_per_node(0, data_ranks)
    dp, mbs = data_ranks, 1
    window = reader_pool.window(4, global_batch_size // dp)
    node = ray.get_runtime_context().get_node_id()
    first = reader_pool.first_requests(list(range(dp)), dp, global_batch_size, mbs, starts, window)
    asked = time.perf_counter()
    handles = reader_pool.start(source, "bench", [node], per_node, 0.5)
    # opened (its imports and memory maps), before any read: the PSS a reader starts with
    procs = [psutil.Process(p) for p in ray.get([h.ready.remote() for h in handles])]
    opened = [p.memory_full_info().pss / 2**20 for p in procs]
    reader_pool.read_ahead(handles, per_node, first)
    pool = reader_pool.node_readers(source, "bench", per_node, 0.5)
    ranks = _stream_all(pool, dp, global_batch_size, mbs, starts, window, asked)
    return {"ranks": ranks, "cpu_s": sum(sum(p.cpu_times()[:2]) for p in procs),
            "pss_mb": [p.memory_full_info().pss / 2**20 for p in procs], "pss_mb_opened": opened}


def _stream_all(pool: list, dp: int, gbs: int, mbs: int, starts: dict, window: int,
                asked: float) -> list[dict]:
    """Every rank's train stream (timed) and validation stream if any (its first batch), at
    once."""
    from ray_ppu.data.reader_pool import RankStream

    results: list = [None] * dp
    errors: list = []

    def rank(dp_rank: int) -> None:
        try:
            streams = {split: RankStream(pool, split, first, stop, dp_rank, dp, gbs, mbs, window)
                       for split, (first, stop) in starts.items()}
            if "valid" in streams:
                next(streams["valid"])
            first_valid = time.perf_counter() - asked
            batch = next(streams["train"])
            first_train = time.perf_counter() - asked
            began, n = time.perf_counter(), len(batch["tokens"])
            for batch in streams["train"]:
                n += len(batch["tokens"])
            results[dp_rank] = {"first_batch_s": max(first_train, first_valid), "samples": n,
                                "seconds": time.perf_counter() - began}
        except BaseException as err:  # reported by the caller, with its rank
            errors.append((dp_rank, err))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(dp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"data rank {errors[0][0]} failed: {errors[0][1]!r}")
    return results


def _print(f: dict) -> None:
    ratio = f["tokens_per_s_per_rank"] / f["consumed_tokens_per_s_per_rank"]
    print(f"\n{f['data_ranks']} data ranks, seq {f['seq_length']}, gbs {f['global_batch_size']}, "
          f"{f['iterations']} iterations, validation on")
    print(f"reader processes      {f['reader_processes']}")
    print(f"reader PSS            {f['reader_pss_mb_total']:.0f} MB in all, "
          f"{f['reader_pss_mb_max']:.0f} MB the largest")
    print(f"reader CPU            {f['reader_cpu_s_per_1000_samples']:.2f} s per 1,000 samples")
    print(f"first batch           {f['first_batch_s_max']:.2f} s the slowest rank "
          f"({f['first_batch_s_median']:.2f} s median), after the readers were asked")
    print(f"tokens/s per rank     {f['tokens_per_s_per_rank']:,.0f} (slowest rank) vs "
          f"{f['consumed_tokens_per_s_per_rank']:,.0f} consumed by a rank (0.5B at 50 % MFU) "
          f"-> {ratio:.1f}x")


def synthetic_corpus(prefix: Path, tokens: int, vocab_size: int = VOCAB, seed: int = 0) -> None:
    """``tokens`` random ids in documents of log-normal length (median ~700, long tail), in
    Megatron's idxmap format (written once; a chunk of documents per call)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if Path(f"{prefix}.bin").exists() and Path(f"{prefix}.idx").exists():
        return
    prefix.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    written = 0
    while written < tokens:
        lengths = np.clip(rng.lognormal(6.5, 1.0, size=10_000).astype(np.int64), 16, 32_768)
        if lengths.sum() > tokens - written:
            lengths = lengths[np.cumsum(lengths) <= tokens - written]
        if len(lengths) == 0:
            lengths = np.array([tokens - written])
        ids = rng.integers(0, vocab_size, size=int(lengths.sum()), dtype=np.int32)
        builder.add_document(torch.from_numpy(ids), lengths.tolist())  # sequences = documents
        written += int(lengths.sum())
    builder.finalize(f"{prefix}.idx")
