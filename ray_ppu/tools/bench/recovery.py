"""``benchmark.py recovery``: node loss under Ray Train V2 on a simulated multi-node cluster.

A CPU-only head and three nodes with one PPU each (one spare). The tiny model trains on 2
workers (DP 2), saving every 2 iterations; once the checkpoint at iteration 4 is complete a PPU
node hosting a worker is removed (its raylet and worker killed) and the group restarts on the
survivors. ``--reference`` runs the same job uninterrupted first (tests/test_faults.py compares
them); ``--drain`` sends a preemption notice first (the run saves, then loses the node);
``--hard`` SIGKILLs the node's processes.

This module is the scenario (:func:`child`, in its own process with its own Ray) and its flags;
:mod:`ray_ppu.tools.bench.recovery_figures` turns the child's result and timestamped output
into the figures and prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path

from ray_ppu.tools.bench import recovery_figures
from ray_ppu.tools.bench.common import metrics_rows, write_json
from ray_ppu.tools.bench.scenario import (LOSS_AFTER, add_head_arguments, add_tail_arguments,
                                          node_of_a_train_worker, prepare, run_config,
                                          run_scenario, simulated_cluster, wait_for)

HELP = "node loss: recovery time, iterations lost, checkpoint throughput vs raw disk"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_head_arguments(parser, "outputs/benchmark_recovery")
    parser.add_argument("--reference", action="store_true", help="run uninterrupted first")
    parser.add_argument("--hard", action="store_true",
                        help="SIGKILL the node's processes (default: SIGTERM first, as "
                             "remove_node)")
    parser.add_argument("--drain", action="store_true",
                        help="drain the node first (a preemption notice): the run saves, then "
                             "loses it")
    add_tail_arguments(parser, "write all figures and the runs' results here")


def main(args, program: Path) -> dict | None:
    """``--child``: the scenario itself; otherwise run it as ``program``'s child, then the
    figures (printed; ``--json`` writes them with the runs' results)."""
    if args.child:
        return child(args)
    prepare(args)
    start = time.time()
    res, lines = run_scenario(program, "recovery", args, (["--reference"] if args.reference else [])
                              + (["--hard"] if args.hard else [])
                              + (["--drain"] if args.drain else []))
    return recovery_figures.report(res, lines, start, args.hard, args.json)


def child(args) -> None:
    """The scenario itself, in its own process (its own Ray: a Cluster of simulated nodes)."""
    if args.drain:  # Ray Train's drain watcher (and our check) every second, not 5: a short run
        os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "1"
    work = Path(args.dir).resolve()
    result: dict = {}
    # Three PPU nodes for two workers: one spare, so the group restarts at full size on the
    # survivors (nodes are added only from the main thread, which is busy in launch()).
    with simulated_cluster(ppu_nodes=3, head_cpus=6) as (cluster, ppu_nodes):
        if args.reference:
            _reference_run(args.corpus, work / "reference", result)
        _interrupted_run(args, cluster, ppu_nodes, work / "interrupted", result)
    write_json(args.child_json, result, indent=None)


def _reference_run(corpus: str, out: Path, result: dict) -> None:
    """The same job uninterrupted: the losses the interrupted run must repeat."""
    from ray_ppu import checkpoint
    from ray_ppu.launch.launcher import launch

    cfg, plan = run_config(corpus, out)
    t0 = time.time()
    result["reference_final"] = launch(cfg, plan)
    result["reference_wall_s"] = time.time() - t0
    result["reference_dir"] = str(out)
    result["reference_root"] = str(checkpoint.save_root(cfg))


def _interrupted_run(args, cluster, ppu_nodes: list, out: Path, result: dict) -> None:
    """The run, with a thread that takes a worker's node away once the checkpoint is there."""
    from ray_ppu import checkpoint
    from ray_ppu.launch.launcher import launch

    cfg, plan = run_config(args.corpus, out)
    root = checkpoint.save_root(cfg)
    # --drain: the notice comes after the checkpoint at 2, the run's own save follows it
    meta_file = root / f"iter_{2 if args.drain else LOSS_AFTER:07d}" / checkpoint.META_FILE
    stop, events = threading.Event(), {}

    def guarded() -> None:
        try:
            if wait_for(meta_file.exists, stop, poll=0.01):
                _lose_a_node(cluster, ppu_nodes, out, events, drain=args.drain, hard=args.hard)
                # Ray starts a node's processes with PR_SET_PDEATHSIG: keep this thread
                # (which removed one) alive until the run is over.
                stop.wait()
        except BaseException as err:  # the run would wait for PPUs forever: abort it
            events["error"] = repr(err)
            print(f"RECOVERY failed: {err!r}", flush=True)
            os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=guarded, daemon=True)
    thread.start()
    t0 = time.time()
    try:
        result["final"] = launch(cfg, plan)
    finally:
        stop.set()
        thread.join()
    result.update(wall_s=time.time() - t0, events=events, dir=str(out), root=str(root))
    record = root / checkpoint.STREAM_START_FILE
    result["stream_start"] = json.loads(record.read_text())
    result["stream_start_mtime"] = record.stat().st_mtime


def _lose_a_node(cluster, ppu_nodes: list, out: Path, events: dict, *, drain: bool,
                 hard: bool) -> None:
    """Remove a node hosting a worker (after a preemption notice and its save if ``drain``);
    ``events`` gets the times."""
    victim = node_of_a_train_worker(ppu_nodes)
    if drain:  # a preemption notice first: the run saves, then loses it
        _drain_and_wait_for_a_save(cluster.address, victim.node_id, out, events)
    events["loss_start"] = time.time()
    rows = metrics_rows(out)
    cluster.remove_node(victim, allow_graceful=not hard)
    events["removed"] = time.time()
    events["removed_node"] = victim.node_id
    events["rows_at_loss"] = len(rows)
    print(f"RECOVERY node {victim.node_id[:8]} removed at {events['removed']:.3f}", flush=True)


def _drain_and_wait_for_a_save(address: str, node_id: str, out: Path, events: dict,
                               timeout_s: float = 90) -> None:
    """Tell Ray that ``node_id`` is being preempted (as a cloud's spot reclaim would, through
    the autoscaler's drain API), then wait until the run has saved a checkpoint because of it."""
    import ray
    from ray.core.generated import autoscaler_pb2

    deadline_ms = int((time.time() + timeout_s) * 1000)
    accepted, why = ray._raylet.GcsClient(address=address).drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "benchmark: spot reclaim", deadline_ms)
    if not accepted:
        raise RuntimeError(f"drain of {node_id[:8]} refused: {why}")
    events["drained"] = time.time()
    print(f"RECOVERY node {node_id[:8]} drained at {events['drained']:.3f}", flush=True)

    def saved_for_it():
        rows = metrics_rows(out)
        asked = [r["iteration"] for r in rows if r.get("event") == "interrupted"
                 and r["time"] > events["drained"]]
        return asked and next((r["iteration"] for r in rows if r.get("event") == "checkpoint"
                               and r["iteration"] >= asked[0]), None)

    while time.time() * 1000 < deadline_ms:
        iteration = saved_for_it()
        if iteration:
            events["drain_saved_iteration"] = iteration
            events["drain_saved"] = time.time()
            return
        time.sleep(0.05)
