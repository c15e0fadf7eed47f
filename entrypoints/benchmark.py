"""Benchmarks that print figures (not timed tests).

    python entrypoints/benchmark.py overhead [--rounds 3] [--iters 30] [key=value ...]

``overhead``: the same tiny training run under Ray Train (embedded local Ray, Ray Data stream)
and under plain torchrun (in-process reads), alternating so both see the same machine noise.
Prints, per launcher, the median step time (iterations after the first 3) and the time from
launch to the first finished iteration, then the Ray/torchrun step-time ratio.
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    ov = sub.add_parser("overhead", help="Ray Train vs torchrun step time and startup")
    ov.add_argument("--rounds", type=int, default=3)
    ov.add_argument("--iters", type=int, default=30)
    ov.add_argument("overrides", nargs="*", metavar="section.field=value",
                    help="applied to both runs (default: the demo config, TP=2 on 2 workers)")
    args = parser.parse_args()
    overhead(args.rounds, args.iters, args.overrides)


if __name__ == "__main__":
    main()
