"""``benchmark.py overhead``: the demo trained under Ray Train and under plain torchrun.

Three ways to launch the same run (the demo config, TP 2 on 2 CPU workers), alternated round
by round so all see the same machine noise:

* ``ray`` — ``pretrain.py`` as the demo runs it: it starts a local Ray first (``ray.init``);
* ``ray-job`` — ``pretrain.py`` with ``RAY_ADDRESS`` set, joining a Ray already running on
  this machine (started once by the benchmark, as ``ray start`` would): what a ``ray job
  submit`` to a running cluster costs, the production path;
* ``torchrun`` — ``torchrun_pretrain.py`` (in-process reads through Megatron's GPTDataset).

Per launch: the median step time (iterations after the first 3), the time from the command to
the first finished iteration, and the start-up phases rank 0 logged (``start`` row of
metrics.jsonl), and where the CPU went in the steady state: CPU seconds per iteration of
every process by role and of the ranks' threads besides the main one
(:mod:`ray_ppu.tools.bench.cpu_account`). ``--json`` writes ``{"first_iteration_s": {...},
"step_ratio": ray/torchrun, "phases": {launch: {phase: s}}, "cpu_per_iteration_s": {launch:
{role: s}}, ...}``.
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

from ray_ppu.tools.bench import cpu_account
from ray_ppu.tools.bench.common import metrics_rows, write_json

REPO = Path(__file__).resolve().parents[3]
WARMUP_ITERS = 3
KINDS = ("ray", "ray-job", "torchrun")
HELP = "Ray Train vs torchrun step time and startup"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value",
                        help="applied to both runs (default: the demo config, TP=2 on 2 workers)")


def main(args) -> dict:
    return run(args.rounds, args.iters, args.overrides, args.json)


def build_demo_corpus(extra: list[str]) -> None:
    """The demo config's corpus (with ``extra`` applied), built once."""
    from ray_ppu.config.loader import load
    from ray_ppu.tools.demo import build_stdlib_corpus
    from ray_ppu.data.tokenizer import qwen2
    from ray_ppu.launch.output import absolute_paths

    # Every launch resolves the demo's relative corpus path against this directory.
    demo = absolute_paths(load(REPO / "entrypoints" / "configs" / "demo.yaml", extra))
    build_stdlib_corpus(demo.data.data_path[0], qwen2())


def one_run(kind: str, out: Path, iters: int, extra: list[str],
            env: dict | None = None, cpu_roots: list[int] | None = None) -> dict:
    """One launch of the demo: median step after warmup, seconds to the first iteration,
    and the logged start-up phases."""
    config = str(REPO / "entrypoints" / "configs" / "demo.yaml")
    args = ["--config", config, f"output.dir={out}", f"training.train_iters={iters}",
            "training.log_interval=1", "output.tensorboard=false", *extra]
    if kind == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               str(REPO / "entrypoints" / "torchrun_pretrain.py"), *args]
    else:
        cmd = [sys.executable, str(REPO / "entrypoints" / "pretrain.py"), *args]
    start = time.time()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        cpu = _account_cpu(proc, out, iters, roots=[proc.pid] + (cpu_roots or []))
        if proc.wait() != 0:
            log.seek(0)
            raise SystemExit(f"{kind} run failed:\n{log.read()[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "step_time_s" in r]  # training rows, not validation passes
    phases = next((r["phases_s"] for r in rows if r.get("event") == "start"), {})
    return {"step_s": statistics.median(r["step_time_s"] for r in train[WARMUP_ITERS:]),
            "first_iteration_s": train[0]["time"] - start, "phases": phases,
            "wall_s": time.time() - start, "cpu_per_iteration_s": cpu}


def _account_cpu(proc, out: Path, iters: int, roots: list[int]) -> dict:
    """CPU seconds per iteration by role (:mod:`ray_ppu.tools.bench.cpu_account`) between the
    first logged iteration after the warm-up and the one before the last (the processes are
    gone after it); {} when the run logged too few."""
    before = after = None
    while proc.poll() is None:
        done = max((r["iteration"] for r in metrics_rows(out) if "step_time_s" in r), default=0)
        if before is None and done >= WARMUP_ITERS + 1:
            before = (done, cpu_account.snapshot(roots))
        elif before is not None and done >= iters - 1 and after is None:
            after = (done, cpu_account.snapshot(roots))
        time.sleep(0.1)
    if before is None or after is None or after[0] <= before[0]:
        return {}
    return cpu_account.per_iteration(before[1], after[1], after[0] - before[0])


class _RunningRay:
    """A Ray started by a child process and kept up for the rounds (as ``ray start`` would
    keep one); ``address`` for RAY_ADDRESS. Closing the child's stdin ends it and its Ray."""

    def __init__(self) -> None:
        code = ("import os, sys, ray\n"
                "os.environ.setdefault('RAY_custom_unit_instance_resources', "
                "'neuron_cores,TPU,NPU,HPU,RBLN,FURIOSA,TTNPU,MBLT,PPU')\n"
                "ctx = ray.init(address='local', num_cpus=max(os.cpu_count() or 1, 4), "
                "resources={'PPU': 2}, log_to_driver=False)\n"
                "print(ctx.address_info['gcs_address'], flush=True)\n"
                "sys.stdin.read()\n"
                "ray.shutdown()\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        self.address = self.proc.stdout.readline().strip()
        if not self.address:
            raise SystemExit("could not start a Ray for the ray-job launches")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run(rounds: int, iters: int, extra: list[str], json_path: str | None) -> dict:
    """``rounds`` rounds of the three launches, alternated; the figures printed and written."""
    build_demo_corpus(extra)
    results: dict[str, list[dict]] = {k: [] for k in KINDS}
    cluster = _RunningRay()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(rounds):
                for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                    # a job joins with the running Ray's token (ray.init wrote it, as ray start)
                    run_env = ({**env, "RAY_ADDRESS": cluster.address, "RAY_AUTH_MODE": "token"}
                               if kind == "ray-job" else env)
                    res = one_run(kind, Path(tmp) / f"{kind}{r}", iters, extra, run_env,
                                  [cluster.proc.pid] if kind == "ray-job" else None)
                    results[kind].append(res)
                    print(f"round {r} {kind:8s} median step {res['step_s'] * 1000:7.1f} ms | "
                          f"first iteration after {res['first_iteration_s']:5.1f} s | "
                          + _phase_line(res["phases"]), flush=True)
    finally:
        cluster.close()
    figures = _summary(results)
    _print(figures)
    if json_path:
        write_json(json_path, figures)
    return figures


def _phase_line(phases: dict) -> str:
    return " | ".join(f"{k} {v:.1f} s" for k, v in phases.items())


def _summary(results: dict[str, list[dict]]) -> dict:
    step = {k: statistics.median(r["step_s"] for r in v) for k, v in results.items()}
    first = {k: statistics.median(r["first_iteration_s"] for r in v) for k, v in results.items()}
    phases = {k: {name: statistics.median(r["phases"].get(name, 0.0) for r in v)
                  for name in v[0]["phases"]} for k, v in results.items()}
    cpu = {k: _median_roles([r["cpu_per_iteration_s"] for r in v]) for k, v in results.items()}
    return {"first_iteration_s": first, "step_s": step, "cpu_per_iteration_s": cpu,
            "step_ratio": step["ray"] / step["torchrun"],
            "step_ratio_ray_job": step["ray-job"] / step["torchrun"],
            "first_iteration_ratio": first["ray"] / first["torchrun"],
            "first_iteration_ratio_ray_job": first["ray-job"] / first["torchrun"],
            "phases": phases, "rounds": len(results["ray"])}


def _median_roles(runs: list[dict]) -> dict:
    roles = {name for run in runs for name in run}
    return {name: statistics.median(run.get(name, 0.0) for run in runs) for name in sorted(
        roles, key=lambda n: -max(run.get(n, 0.0) for run in runs))}


def _print(f: dict) -> None:
    s, t = f["step_s"], f["first_iteration_s"]
    print(f"\nmedian step time: ray {s['ray'] * 1000:.1f} ms, ray-job {s['ray-job'] * 1000:.1f} "
          f"ms, torchrun {s['torchrun'] * 1000:.1f} ms -> ratio ray/torchrun "
          f"{f['step_ratio']:.3f} (ray-job {f['step_ratio_ray_job']:.3f})")
    print(f"time to first iteration: ray {t['ray']:.1f} s, ray-job {t['ray-job']:.1f} s, "
          f"torchrun {t['torchrun']:.1f} s -> ratio {f['first_iteration_ratio']:.2f} "
          f"(ray-job {f['first_iteration_ratio_ray_job']:.2f})")
    for kind, phases in f["phases"].items():
        print(f"start-up phases, {kind:8s} {_phase_line(phases)}")
    print("\nCPU seconds per iteration by process and rank thread (median of rounds):")
    for kind, roles in f["cpu_per_iteration_s"].items():
        print(f"  {kind:8s} " + ", ".join(f"{name} {cpu:.3f}" for name, cpu in roles.items()))
