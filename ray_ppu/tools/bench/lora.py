"""``benchmark.py lora``: LoRA beside full fine-tuning of the same model, in one run.

The Qwen2.5-0.5B architecture (random weights, written once as a Hugging Face directory under
``--dir``: both runs start from it through ``checkpoint.pretrained``) at TP 2 on 2 CPU ranks
(``cluster.device=cpu``; overrides change it), trained on the stdlib corpus twice: every
parameter, then LoRA of ``--rank`` on all four linears. Each run is one torchrun launch of
:mod:`ray_ppu.tools.bench.lora_rank`, so its peak host memory is its own. Per run: the median
step time and tokens/s over the iterations after the warm-up, and per rank the DDP gradient
buffers, the optimizer's state (fp32 main parameters and Adam's moments), its peak resident
memory, an in-memory snapshot's size and what taking it blocks; then LoRA / full ratios beside
the targets: LoRA's step at most full's (no weight gradients for the base), its gradient +
optimizer bytes at most 2 % of full's, a snapshot every iteration within 2 % of its step.
``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from ray_ppu.tools.bench.common import (add_corpus_argument, launch_ranks, work_and_corpus,
                                        write_json)

HELP = "LoRA vs full fine-tuning (0.5B at TP 2): step, tokens/s, gradient and optimizer bytes, " \
       "host memory, snapshot size and blocking time"
WARMUP_ITERS = 1
COMMON = ["cluster.device=cpu", "cluster.num_workers=2", "parallel.tensor_model_parallel_size=2",
          "training.precision=fp32", "training.seq_length=128", "training.global_batch_size=2",
          "training.micro_batch_size=1", "training.lr=1e-4", "training.min_lr=1e-5",
          "training.lr_warmup_iters=0", "training.eval_iters=0", "data.split=100,0,0",
          "output.tensorboard=false", "checkpoint.enabled=false"]
# Qwen/Qwen2.5-0.5B config.json's architecture (ray_ppu.config.presets "0.5B")
QWEN25_05B = dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default="outputs/bench_lora",
                        help="work directory (the base model, corpus and runs)")
    parser.add_argument("--iters", type=int, default=3,
                        help=f"timed iterations per run (after {WARMUP_ITERS} warm-up)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (all four linears)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    add_corpus_argument(parser)
    parser.add_argument("overrides", nargs="*", metavar="section.field=value",
                        help="applied to both runs")


def main(args) -> dict:
    if args.iters < 1 or args.rank < 1:
        raise SystemExit(f"--iters {args.iters} / --rank {args.rank}: both must be ≥ 1")
    work, corpus = work_and_corpus(args)
    base = _base_model(work / "Qwen2.5-0.5B-random")
    common = [*COMMON, f"checkpoint.pretrained={base}", f"data.data_path=[{corpus}]",
              f"training.train_iters={WARMUP_ITERS + args.iters}",
              f"data.index_cache_dir={work / 'index_cache'}", *args.overrides]
    runs = {"full": [], "lora": ["lora.enabled=true", f"lora.rank={args.rank}",
                                 f"lora.alpha={2 * args.rank}"]}
    result = {name: _launch(work / name, [*common, *extra, f"output.dir={work / name}"],
                            args.timeout) for name, extra in runs.items()}
    figures = summarize(result)
    figures["setting"] = (f"Qwen2.5-0.5B architecture (random weights), TP 2 on 2 CPU ranks, "
                          f"fp32, 2 × 128 tokens per iteration; {args.iters} timed iterations "
                          f"after {WARMUP_ITERS}; LoRA rank {args.rank} on linear_qkv, "
                          f"linear_proj, linear_fc1, linear_fc2")
    print_figures(figures)
    if args.json:
        write_json(args.json, figures)
    return figures


def _base_model(path: Path) -> Path:
    """The random Qwen2.5-0.5B Hugging Face directory both runs start from (written once)."""
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B)).save_pretrained(path)
    return path


def _launch(out: Path, overrides: list[str], timeout: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    result = out / "figures.json"
    result.unlink(missing_ok=True)  # an earlier launch's figures are not this one's
    launch_ranks("ray_ppu.tools.bench.lora_rank", ["--result", str(result), *overrides], 2,
                 timeout, f"lora benchmark, {out.name} run")
    return json.loads(result.read_text())


def _run_figures(r: dict) -> dict:
    timed = r["rows"][WARMUP_ITERS:]
    step = statistics.median(row["step_time_s"] for row in timed)
    ranks = r["ranks"]
    most = {key: max(rank[key] for rank in ranks) for key in ranks[0]}
    return {"step_time_s": step, "tokens_per_s": r["tokens_per_iteration"] / step,
            "trainable_parameters": r["trainable_parameters"], "parameters": r["parameters"],
            "losses": [row["lm_loss"] for row in r["rows"]], **most,
            "snapshot_share_of_step": most["snapshot_blocking_s"] / step}


def summarize(result: dict) -> dict:
    full, lora = _run_figures(result["full"]), _run_figures(result["lora"])
    state = (lora["gradient_bytes"] + lora["optimizer_bytes"]) / (
        full["gradient_bytes"] + full["optimizer_bytes"])
    ratios = {key: lora[key] / full[key] for key in
              ("step_time_s", "tokens_per_s", "gradient_bytes", "optimizer_bytes",
               "peak_host_memory_bytes", "snapshot_bytes", "snapshot_blocking_s")}
    return {"runs": {"full": full, "lora": lora}, "ratios": {**ratios,
            "gradient_and_optimizer_bytes": state},
            "targets": {"lora step ≤ full step": ratios["step_time_s"] <= 1.0,
                        "gradient + optimizer bytes ≤ 2 % of full's": state <= 0.02,
                        "snapshot every iteration within 2 % of the step":
                            lora["snapshot_share_of_step"] <= 0.02}}


def print_figures(f: dict) -> None:
    full, lora, ratio = f["runs"]["full"], f["runs"]["lora"], f["ratios"]
    mib = 2 ** 20
    rows = [("median step time", "step_time_s", lambda v: f"{v * 1000:,.0f} ms"),
            ("tokens/s", "tokens_per_s", lambda v: f"{v:,.1f}"),
            ("trainable parameters", "trainable_parameters", lambda v: f"{v:,}"),
            ("gradient buffers per rank", "gradient_bytes", lambda v: f"{v / mib:,.1f} MiB"),
            ("optimizer state per rank", "optimizer_bytes", lambda v: f"{v / mib:,.1f} MiB"),
            ("peak host memory per rank", "peak_host_memory_bytes",
             lambda v: f"{v / mib:,.0f} MiB"),
            ("snapshot per rank", "snapshot_bytes", lambda v: f"{v / mib:,.1f} MiB"),
            ("snapshot blocking", "snapshot_blocking_s", lambda v: f"{v * 1000:,.1f} ms"),
            ("  share of the step", "snapshot_share_of_step", lambda v: f"{v:.2%}")]
    print(f"\n{f['setting']}")
    print(f"{'':28s}{'full':>16s}{'LoRA':>16s}{'LoRA/full':>12s}")
    for label, key, show in rows:
        line = f"{label:28s}{show(full[key]):>16s}{show(lora[key]):>16s}"
        if key in ratio:
            line += f"{ratio[key]:>12.4f}"
        print(line)
    print(f"gradient + optimizer bytes, LoRA/full: {ratio['gradient_and_optimizer_bytes']:.4%}")
    for target, met in f["targets"].items():
        print(f"target: {target}: {'met' if met else 'NOT met'}")
