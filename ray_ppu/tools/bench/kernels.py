"""``benchmark.py kernels``: the torch kernels against Megatron-Core's reference ones on the CPU.

Two figures, both sides measured in the same run (these machines are noisy):

* **the demo's step** (``entrypoints/configs/demo.yaml``: tiny Qwen2.5, TP 2, seq 128, fp32, 2
  CPU ranks under torchrun): the reference kernels (``attention_backend=local``,
  ``cross_entropy=megatron``) and the torch ones (``sdpa``, ``chunked``), alternated
  ``--rounds`` times in one launch; median step time of each and their ratio;
* **a packed SFT step at seq 4096** (the same model, one process, one row of samples of 100 to
  1,500 tokens): peak host memory and time of one forward and backward, with the s × s
  block-diagonal mask (reference) and with the sample boundaries (torch). Each side in a fresh
  process, so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ray_ppu.tools.bench.common import add_corpus_argument, work_and_corpus, write_json

HELP = "torch kernels vs Megatron-Core's reference ones on the CPU: demo step, packed-row memory"
REPO = Path(__file__).resolve().parents[3]
SIDES = {"reference": ["training.attention_backend=local", "training.cross_entropy=megatron"],
         "torch": ["training.attention_backend=sdpa", "training.cross_entropy=chunked"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default="outputs/benchmark_kernels", help="runs and corpus")
    add_corpus_argument(parser)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two sides")
    parser.add_argument("--iters", type=int, default=8, help="iterations per demo run")
    parser.add_argument("--seq-length", type=int, default=4096, help="the packed row's length")
    parser.add_argument("--json", help="write the figures here")


def demo_steps(work: Path, corpus: str, rounds: int, iters: int) -> dict:
    """Median step time of each side over its runs (the first 2 iterations of each left out)."""
    variants = {f"{side}_{r}": overrides for r in range(rounds) for side, overrides in SIDES.items()}
    spec = work / "variants.json"
    spec.write_text(json.dumps(variants))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(REPO / "entrypoints" / "torchrun_pretrain.py"), "--config",
           str(REPO / "entrypoints" / "configs" / "demo.yaml"), "--variants", str(spec),
           f"output.dir={work / 'demo'}", f"data.data_path=[{corpus}]",
           f"training.train_iters={iters}", "training.log_interval=1", "training.eval_iters=0",
           "checkpoint.enabled=false", "output.tensorboard=false", "output.report=false",
           "training.lr_warmup_iters=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"the demo runs failed:\n{proc.stderr[-3000:]}")
    steps: dict[str, list[float]] = {side: [] for side in SIDES}
    for name in variants:
        rows = [json.loads(line) for line in (work / "demo" / name / "metrics.jsonl").open()]
        steps[name.rsplit("_", 1)[0]] += [r["step_time_s"] for r in rows
                                          if "lm_loss" in r and r["iteration"] > 2]
    medians = {side: statistics.median(times) for side, times in steps.items()}
    return {"demo_step_ms": {s: 1e3 * t for s, t in medians.items()},
            "demo_step_ratio_torch_over_reference": medians["torch"] / medians["reference"]}


def packed_step(side: str, seq: int) -> dict:
    """In this (fresh) process: one forward and backward of a packed row of ``seq`` tokens;
    peak RSS (MB) and seconds."""
    import resource
    import time

    import numpy as np
    import torch
    import torch.distributed as dist

    from ray_ppu import devices
    from ray_ppu.config.loader import load
    from ray_ppu.model import parallel
    from ray_ppu.model.gpt import build_model, packed_format
    from ray_ppu.plan import build_plan
    from ray_ppu.train.batch import forward_step

    cfg = load(None, ["model.preset=tiny", "cluster.device=cpu", "cluster.num_workers=1",
                      "training.precision=fp32", f"training.seq_length={seq}",
                      "training.micro_batch_size=1", "training.global_batch_size=1",
                      "training.train_iters=1", "training.eval_iters=0", "data.dataset=sft",
                      "data.packing=true", "data.data_path=[records]", "data.tokenizer=tok",
                      *SIDES[side]])
    plan = build_plan(cfg)
    rng = np.random.default_rng(0)
    lengths = []
    while sum(lengths) < seq:
        lengths.append(int(min(rng.integers(100, 1500), seq - sum(lengths))))
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(0, 150_000, (1, seq))
    batch = {"tokens": tokens, "labels": tokens, "loss_mask": np.ones((1, seq), np.float32),
             "position_ids": np.concatenate([np.arange(n) for n in lengths])[None],
             "cu_seqlens": bounds[None]}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with devices.bound("cpu", 0):
        parallel.initialize(plan, cfg.training.seed)
        model, _ = build_model(cfg, plan, "cpu")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        started = time.perf_counter()
        output, loss = forward_step(iter([batch]), model[0], torch.device("cpu"),
                                    packed=packed_format(cfg, plan, "cpu"))
        loss(output)[0].backward()
        seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_rss_mb": peak, "step_rss_growth_mb": peak - before, "seconds": seconds,
            "samples": len(lengths)}


def _packed_side(side: str, seq: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "ray_ppu.tools.bench.kernels", side, str(seq)],
                          capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    if proc.returncode != 0:
        raise SystemExit(f"the packed {side} step failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(args) -> dict:
    work, corpus = work_and_corpus(args)
    figures = demo_steps(work, corpus, args.rounds, args.iters)
    figures["packed"] = {side: _packed_side(side, args.seq_length) for side in SIDES}
    ms = figures["demo_step_ms"]
    print(f"demo step (tiny, TP 2, seq 128, 2 CPU ranks; median of {args.rounds} alternated runs): "
          f"reference {ms['reference']:.0f} ms, torch {ms['torch']:.0f} ms, ratio "
          f"{figures['demo_step_ratio_torch_over_reference']:.2f}")
    for side, f in figures["packed"].items():
        print(f"packed SFT step at seq {args.seq_length} ({f['samples']} samples, {side} kernels): "
              f"peak RSS {f['peak_rss_mb']:.0f} MB (+{f['step_rss_growth_mb']:.0f} MB in the "
              f"step), {f['seconds']:.2f} s")
    if args.json:
        write_json(args.json, figures)
    return figures


if __name__ == "__main__":  # one packed step, for main(): python -m … SIDE SEQ
    print(json.dumps(packed_step(sys.argv[1], int(sys.argv[2]))))
