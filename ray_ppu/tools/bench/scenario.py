"""The harness of the multi-node scenarios (``benchmark.py recovery`` / ``elastic``, and the
fault tests through tests/faults/scenarios.py): a simulated PPU cluster, the run it trains,
and the child process each scenario runs in.

Each scenario needs a Ray of its own (a ``ray.cluster_utils.Cluster`` whose nodes it adds and
removes), so the front end re-runs itself as ``<program> <name> --child`` in its own process
group: the parent timestamps every output line as it arrives (the recovery figures are spans
between log lines) and, on ``--timeout``, stops the child and every Ray process it started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ray_ppu.tools.bench.common import add_corpus_argument, default_corpus

RECOVERY_ITERS = 8
RECOVERY_SAVE_INTERVAL = 2
LOSS_AFTER = 4  # the node is removed once this iteration's checkpoint is complete
PPU_NODE = {"num_cpus": 2, "resources": {"PPU": 1}}  # a simulated node: one worker + its reader


def add_head_arguments(parser: argparse.ArgumentParser, default_dir: str) -> None:
    """--dir and --corpus, the first flags of both scenarios."""
    parser.add_argument("--dir", default=default_dir, help="runs, corpus, log")
    add_corpus_argument(parser)


def add_tail_arguments(parser: argparse.ArgumentParser, json_help: str) -> None:
    """--json, --timeout, --verbose and the child's hidden flags, the last of both scenarios."""
    parser.add_argument("--json", default=None, help=json_help)
    parser.add_argument("--timeout", type=float, default=900, help="give up (and stop it) after")
    parser.add_argument("--verbose", action="store_true", help="echo the scenario's output")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-json", default=None, help=argparse.SUPPRESS)


@contextlib.contextmanager
def simulated_cluster(ppu_nodes: int, head_cpus: int):
    """A ``ray.cluster_utils.Cluster`` on this machine, connected: a head with CPUs only (the
    driver, Ray Train's controller, the data readers) and ``ppu_nodes`` one-PPU nodes whose
    raylets hand out PPU ids. Yields the cluster and its PPU nodes; shut down on exit."""
    import ray
    from ray.cluster_utils import Cluster

    from ray_ppu.launch.launcher import UNIT_INSTANCE_RESOURCES

    # Every raylet started below inherits this: distinct PPU ids per worker.
    os.environ["RAY_custom_unit_instance_resources"] = UNIT_INSTANCE_RESOURCES
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus})
    nodes = [cluster.add_node(**PPU_NODE) for _ in range(ppu_nodes)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=True)
    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def node_of_a_train_worker(nodes):
    """One of ``nodes`` that hosts a Ray Train worker (a spare node's loss would not fail).

    A node's workers are child processes of its raylet; no state API (it needs the dashboard,
    which a test cluster may not run).
    """
    import psutil
    from ray._private import ray_constants

    workers = [p for p in psutil.process_iter(["cmdline"])
               if "RayTrainWorker" in " ".join(p.info["cmdline"] or [])]
    for node in nodes:
        raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
        for proc in workers:
            try:
                if raylet in {p.pid for p in proc.parents()}:
                    return node
            except psutil.Error:  # exited meanwhile
                continue
    raise RuntimeError(f"no Ray Train worker on the PPU nodes {[n.node_id[:8] for n in nodes]}")


def recovery_overrides(corpus: str, out: Path, *extra: str) -> list[str]:
    """The checkpoint tests' run (tests/test_checkpoint.py): tiny model, fp32 on CPU, seq 32,
    global batch 4, 8 iterations, validation at 4 and 8, on 2 workers, saving every 2."""
    return [
        f"data.data_path=[{corpus}]", f"output.dir={out}", "output.tensorboard=false",
        "cluster.device=cpu", "training.precision=fp32",
        f"training.train_iters={RECOVERY_ITERS}", "training.global_batch_size=4",
        "training.micro_batch_size=1", "training.seq_length=32", "training.lr=2e-2",
        "training.min_lr=3e-4", "training.lr_warmup_iters=1", "training.log_interval=1",
        "training.eval_interval=4", "training.eval_iters=1", "data.split=80,20,0",
        "model.make_vocab_size_divisible_by=64", "cluster.num_workers=2",
        f"checkpoint.save_interval={RECOVERY_SAVE_INTERVAL}", "cluster.max_failures=2",
        "checkpoint.memory_interval=1",  # the case: a snapshot after every iteration
        "output.sample_log=true", *extra,
    ]


def run_config(corpus: str, out: Path, *extra: str):
    """(cfg, plan) of :func:`recovery_overrides`' run plus ``extra``, its output prepared."""
    from ray_ppu.config.loader import load
    from ray_ppu.plan import build_plan
    from ray_ppu.launch.output import absolute_paths, prepare_output

    cfg = absolute_paths(load(None, recovery_overrides(corpus, out, *extra)))
    plan = build_plan(cfg)
    prepare_output(cfg, plan)
    return cfg, plan


def wait_for(condition, stop: threading.Event, poll: float = 0.05):
    """Poll ``condition()`` until it returns something truthy (returned) or ``stop`` is set."""
    while not stop.is_set():
        value = condition()
        if value:
            return value
        time.sleep(poll)
    return None


def prepare(args) -> Path:
    """The scenario's work directory, made; ``args.corpus`` defaults to a small stdlib one."""
    work = Path(args.dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.corpus is None:
        args.corpus = default_corpus(work)
    return work


def run_scenario(program: Path, name: str, args,
                 extra: list[str]) -> tuple[dict, list[tuple[float, str]]]:
    """Run ``<program> <name> --child`` (its own Ray cluster) in its own process group;
    returns its JSON result and its output lines, each timestamped as it arrived."""
    work = Path(args.dir).resolve()
    child_json = work / "child.json"
    child_json.unlink(missing_ok=True)
    cmd = [sys.executable, str(program), name, "--child", "--child-json", str(child_json),
           "--dir", str(work), "--corpus", args.corpus, *extra]
    lines: list[tuple[float, str]] = []
    with open(work / f"{name}.log", "w") as log_file:
        # Own process group: on timeout the scenario and every Ray process it started go.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)

        def stop_child() -> None:
            lines.append((time.time(), f"SCENARIO timed out after {args.timeout:.0f} s"))
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    return
                time.sleep(grace)

        watchdog = threading.Timer(args.timeout, stop_child)
        watchdog.daemon = True
        watchdog.start()
        for line in proc.stdout:
            now = time.time()
            lines.append((now, line.rstrip("\n")))
            log_file.write(f"{now:.3f} {line}")
            log_file.flush()
            if args.verbose:
                print(line, end="", flush=True)
        rc = proc.wait()
        watchdog.cancel()
    if rc != 0 or not child_json.exists():
        tail = "\n".join(l for _, l in lines[-60:])
        raise SystemExit(f"{name} scenario failed (rc {rc}); log {work / (name + '.log')}:\n{tail}")
    return json.loads(child_json.read_text()), lines
