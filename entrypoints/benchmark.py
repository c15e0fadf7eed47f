"""Benchmarks that print figures (not timed tests).

    python entrypoints/benchmark.py overhead [--rounds 3] [--iters 30] [key=value ...]
    python entrypoints/benchmark.py data [--tokens 1e9] [--seq-length 4096] [--rounds 3]

``overhead``: the same tiny training run under Ray Train (embedded local Ray, Ray Data stream)
and under plain torchrun (in-process reads), alternating so both see the same machine noise.
Prints, per launcher, the median step time (iterations after the first 3) and the time from
launch to the first finished iteration, then the Ray/torchrun step-time ratio.

``data``: one DP rank's sample stream from the same idxmap corpus (synthetic, ``--tokens``
tokens, written once under ``--dir``): time to first batch with a cold and a warm index cache,
then tokens per second delivered by (a) the ray_ppu Ray Data path and (b) Megatron's
GPTDataset + ``torch.utils.data.DataLoader`` with Megatron-LM's sampler (Pai-Megatron-Patch's
path), alternated; and the demo's time waiting for data per iteration (from metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WARMUP_ITERS = 3


def _overrides(out: Path, iters: int, extra: list[str]) -> list[str]:
    return [f"output.dir={out}", f"training.train_iters={iters}", "training.log_interval=1",
            "output.tensorboard=false", *extra]


def _one_run(kind: str, out: Path, iters: int, extra: list[str]) -> tuple[float, float]:
    """(median step time after warmup, seconds from launch to the first iteration)."""
    config = str(REPO / "entrypoints" / "configs" / "demo.yaml")
    args = ["--config", config, *_overrides(out, iters, extra)]
    if kind == "ray":
        cmd = [sys.executable, str(REPO / "entrypoints" / "pretrain.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               str(REPO / "entrypoints" / "torchrun_pretrain.py"), *args]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r]  # training rows, not validation passes
    steps = [r["step_time_s"] for r in rows[WARMUP_ITERS:]]
    return statistics.median(steps), rows[0]["time"] - start


def overhead(rounds: int, iters: int, extra: list[str]) -> None:
    from ray_ppu.config.loader import load
    from ray_ppu.data.preprocess import build_stdlib_corpus
    from ray_ppu.data.tokenizer import qwen2
    from ray_ppu.run import absolute_paths

    # Both runs resolve the demo's relative corpus path against this directory, as pretrain.py does.
    demo = absolute_paths(load(REPO / "entrypoints" / "configs" / "demo.yaml", extra))
    build_stdlib_corpus(demo.data.data_path[0], qwen2())
    results: dict[str, list[tuple[float, float]]] = {"ray": [], "torchrun": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for kind in ("ray", "torchrun") if r % 2 == 0 else ("torchrun", "ray"):
                out = Path(tmp) / f"{kind}{r}"
                results[kind].append(_one_run(kind, out, iters, extra))
                step, first = results[kind][-1]
                print(f"round {r} {kind:8s} median step {step * 1000:7.1f} ms | first iteration after {first:5.1f} s",
                      flush=True)
    step = {k: statistics.median(s for s, _ in v) for k, v in results.items()}
    first = {k: statistics.median(f for _, f in v) for k, v in results.items()}
    print(f"\nmedian step time: ray {step['ray'] * 1000:.1f} ms, torchrun {step['torchrun'] * 1000:.1f} ms"
          f" -> ratio ray/torchrun {step['ray'] / step['torchrun']:.3f}")
    print(f"time to first iteration: ray {first['ray']:.1f} s, torchrun {first['torchrun']:.1f} s")


def synthetic_corpus(prefix: Path, tokens: int, vocab_size: int, seed: int = 0) -> None:
    """``tokens`` random ids in documents of log-normal length (median ~700, long tail), written
    with Megatron's IndexedDatasetBuilder; a chunk of documents per call keeps Python out of it."""
    import numpy as np
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
        lengths = lengths[np.cumsum(lengths) <= tokens - written] if lengths.sum() > tokens - written else lengths
        if len(lengths) == 0:
            lengths = np.array([tokens - written])
        ids = rng.integers(0, vocab_size, size=int(lengths.sum()), dtype=np.int32)
        builder.add_document(torch.from_numpy(ids), lengths.tolist())  # sequences = documents
        written += int(lengths.sum())
    builder.finalize(f"{prefix}.idx")


def data(args) -> None:
    """1. Corpus. 2. Time to first batch, cold then warm cache. 3. Ray Data vs DataLoader,
    alternated. 4. The demo's data wait (if the demo has run)."""
    import numpy as np
    import ray
    import torch

    from ray_ppu.data import idxmap
    from ray_ppu.data.order import rank_sample_ids
    from ray_ppu.data.ray_stream import IdxmapDataConfig, steps_dataset

    vocab = 151_936
    prefix = Path(args.dir).resolve() / f"synthetic_{args.tokens:.0e}".replace("+", "")
    t0 = time.perf_counter()
    synthetic_corpus(prefix, int(args.tokens), vocab)
    size_gb = Path(f"{prefix}.bin").stat().st_size / 1e9
    print(f"corpus {prefix}: {int(args.tokens):.3g} tokens, {size_gb:.2f} GB "
          f"(ready in {time.perf_counter() - t0:.1f} s)", flush=True)

    gbs, mbs, dp, seq = args.global_batch_size, 1, args.dp_size, args.seq_length
    iters = args.iters
    cache = Path(args.dir).resolve() / "index_cache"
    spec = idxmap.SampleSpec(prefixes=(str(prefix),), weights=None, split="99,1,0",
                             seq_length=seq, seed=1234,
                             train_samples=int(args.tokens) // (seq + 1) * 98 // 100,
                             index_cache_dir=str(cache), eod_token_id=vocab - 1, vocab_size=vocab)
    ray.init(num_cpus=max(4, os.cpu_count() or 1), log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    config = IdxmapDataConfig(spec, tp=1, pp=1, cp=1, global_batch_size=gbs, micro_batch_size=mbs)

    def ray_stream(start: int):
        it = config.configure({"train": steps_dataset(start + iters, lambda: start)()},
                              world_size=dp)[0]["train"]
        return it.iter_batches(batch_size=mbs, batch_format="numpy", prefetch_batches=4)

    # 2. time to first batch: check + build indices (one task in a real run) + first microbatch
    import shutil

    for label in ("cold", "warm"):
        if label == "cold":
            shutil.rmtree(cache, ignore_errors=True)
        t0 = time.perf_counter()
        idxmap.check(spec)
        t_check = time.perf_counter() - t0
        idxmap.prepare(spec)
        t_index = time.perf_counter() - t0 - t_check
        next(iter(ray_stream(0)))
        print(f"time to first batch, {label} cache: {time.perf_counter() - t0:.1f} s "
              f"(corpus check {t_check:.2f} s, indices {t_index:.1f} s)", flush=True)

    # 3. throughput to one DP rank (rank 0 of dp), same samples both ways
    ds = idxmap.dataset(spec)

    def dataloader(start: int):
        ids = rank_sample_ids(np.arange(start, start + iters), 0, dp, gbs, mbs).reshape(-1, mbs)
        loader = torch.utils.data.DataLoader(ds, batch_sampler=ids.tolist(), num_workers=2,
                                             pin_memory=False, persistent_workers=False)
        return iter(loader)

    samples_per_round = iters * gbs // dp
    results: dict[str, list[float]] = {"ray_data": [], "dataloader": []}
    for r in range(args.rounds):
        order = ("ray_data", "dataloader") if r % 2 == 0 else ("dataloader", "ray_data")
        for kind in order:
            # fresh samples for every read: no run is favoured by a page cache the other warmed
            start = (1 + 2 * r + order.index(kind)) * iters % (spec.train_samples // gbs - iters)
            stream = iter(ray_stream(start) if kind == "ray_data" else dataloader(start))
            t_open = time.perf_counter()
            n = len(next(stream)["tokens"])  # start-up (actor / worker processes) excluded:
            t0 = time.perf_counter()         # reported as time to first batch above
            for batch in stream:
                n += len(batch["tokens"])
            dt = time.perf_counter() - t0
            assert n == samples_per_round, (kind, n)
            results[kind].append((n - mbs) * seq / dt)
            print(f"round {r} {kind:10s} {(n - mbs) * seq / dt:12,.0f} tokens/s ({n} samples, "
                  f"{dt:.2f} s; first batch after {t0 - t_open:.2f} s)", flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nmedian tokens/s to one DP rank (DP {dp}, gbs {gbs}, seq {seq}): ray_data "
          f"{med['ray_data']:,.0f}, dataloader {med['dataloader']:,.0f} -> ratio "
          f"{med['ray_data'] / med['dataloader']:.2f}")
    ray.shutdown()

    demo_metrics = REPO / "outputs" / "demo" / "metrics.jsonl"
    if demo_metrics.exists():
        rows = [json.loads(l) for l in demo_metrics.read_text().splitlines()]
        rows = [r for r in rows if "data_wait_s" in r][1:]  # after the first window (start-up)
        if rows:
            wait = statistics.mean(r["data_wait_s"] for r in rows)
            step = statistics.mean(r["step_time_s"] for r in rows)
            print(f"demo ({demo_metrics}): data wait {wait * 1000:.2f} ms per iteration of "
                  f"{step * 1000:.0f} ms = {100 * wait / step:.2f} %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    ov = sub.add_parser("overhead", help="Ray Train vs torchrun step time and startup")
    ov.add_argument("--rounds", type=int, default=3)
    ov.add_argument("--iters", type=int, default=30)
    ov.add_argument("overrides", nargs="*", metavar="section.field=value",
                    help="applied to both runs (default: the demo config, TP=2 on 2 workers)")
    da = sub.add_parser("data", help="Ray Data vs DataLoader tokens/s; time to first batch")
    da.add_argument("--tokens", type=float, default=1e9, help="synthetic corpus size")
    da.add_argument("--dir", default="outputs/benchmark_data", help="corpus and index cache")
    da.add_argument("--seq-length", type=int, default=4096)
    da.add_argument("--global-batch-size", type=int, default=64)
    da.add_argument("--dp-size", type=int, default=8)
    da.add_argument("--iters", type=int, default=50, help="iterations read per round")
    da.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.bench == "overhead":
        overhead(args.rounds, args.iters, args.overrides)
    else:
        data(args)


if __name__ == "__main__":
    main()
