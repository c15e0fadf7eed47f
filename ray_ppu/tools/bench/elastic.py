"""``benchmark.py elastic``: an elastic worker group shrinking and growing on a simulated
multi-node cluster.

1. A CPU-only head and three one-PPU nodes. 2. ``--reference``: the run on a fixed group of
2 workers (TP 1 × DP 2), uninterrupted. 3. The elastic run, num_workers (2, 4) at TP 2,
launched from a thread so the scenario's main thread can add and remove nodes: it starts on the
3 workers that fit (TP 2 × DP 1, one spare); once its checkpoint at 2 is complete a fourth
node joins and Ray Train grows the group to 4 (TP 2 × DP 2); after that group's first
checkpoint a node hosting a worker is removed, and the run ends on 3 again.

Printed: each group's shape and median step time, and how long growing and shrinking took
(event → first iteration of the new group). tests/test_faults.py checks the same run's samples
and losses against the reference.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from ray_ppu.tools.bench.common import metrics_rows, write_json
from ray_ppu.tools.bench.scenario import (PPU_NODE, add_head_arguments, add_tail_arguments,
                                          node_of_a_train_worker, prepare, run_config,
                                          run_scenario, simulated_cluster, wait_for)

HELP = "elastic group: starts small with a spare, grows when a node joins, shrinks when one is lost"
ELASTIC_ITERS = 12


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_head_arguments(parser, "outputs/benchmark_elastic")
    parser.add_argument("--reference", action="store_true", help="run a fixed group first")
    add_tail_arguments(parser, "write the figures and results here")


def main(args, program: Path) -> dict | None:
    """``--child``: the scenario itself; otherwise run it as ``program``'s child, then print
    each group's shape and step time, and how long growing and shrinking took."""
    if args.child:
        return child(args)
    prepare(args)
    res, _ = run_scenario(program, "elastic", args, ["--reference"] if args.reference else [])
    if "error" in res:
        raise SystemExit(f"the elastic run failed: {res['error']}")
    rows = [r for r in metrics_rows(Path(res["dir"])) if "lm_loss" in r]
    print(f"elastic run: {len(rows)} iteration rows, final iteration {res['final']['iteration']}")
    for phase in _group_phases(rows):
        steps = [r["step_time_s"] for r in phase[1:]] or [phase[0]["step_time_s"]]
        print(f"  iterations {phase[0]['iteration']:>2}-{phase[-1]['iteration']:<2} world "
              f"{phase[0]['world_size']} (DP {phase[0]['data_parallel_size']}): median step "
              f"{statistics.median(steps) * 1000:.0f} ms")
    for name, key, shape in (("grow", "added", 4), ("shrink", "removed", 2)):
        t = res["events"].get(key)
        first = next((r for r in rows if t and r["time"] > t and r["world_size"] == shape), None)
        if first:
            res[f"{name}_s"] = first["time"] - t
            print(f"  {name}: node {key} → first iteration of the world-{shape} group "
                  f"{res[name + '_s']:.1f} s (iteration {first['iteration']})")
    if args.json:
        write_json(args.json, res, indent=2)
    return res


def _group_phases(rows: list[dict]) -> list[list[dict]]:
    """Runs of consecutive iteration rows of one group shape."""
    phases: list[list[dict]] = []
    for r in rows:
        if not phases or (phases[-1][-1]["world_size"], phases[-1][-1]["iteration"]) != (
                r["world_size"], r["iteration"] - 1):
            phases.append([])
        phases[-1].append(r)
    return phases


def _config(corpus: str, out: Path, *extra: str):
    return run_config(corpus, out, f"training.train_iters={ELASTIC_ITERS}",
                      "output.sample_log=true", *extra)


def child(args) -> None:
    """The elastic scenario, in its own process (its own Ray: a Cluster of simulated nodes)."""
    from ray_ppu.launch.launcher import launch

    work = Path(args.dir).resolve()
    result: dict = {}
    with simulated_cluster(ppu_nodes=3, head_cpus=8) as (cluster, ppu_nodes):
        if args.reference:
            cfg, plan = _config(args.corpus, work / "reference", "cluster.num_workers=2")
            result["reference_final"] = launch(cfg, plan)
            result["reference_dir"] = str(cfg.output.dir)
        _elastic_run(args.corpus, cluster, ppu_nodes, work / "elastic", result)
    write_json(args.child_json, result, indent=None)


def _elastic_run(corpus: str, cluster, ppu_nodes: list, out: Path, result: dict) -> None:
    """The elastic run in a thread while this one grows, then shrinks, the cluster."""
    from ray_ppu import checkpoint
    from ray_ppu.launch.launcher import launch

    cfg, plan = _config(corpus, out, "cluster.num_workers=4", "cluster.min_workers=2",
                        "parallel.tensor_model_parallel_size=2",
                        "cluster.elastic_resize_interval_s=2", "cluster.max_failures=3",
                        "cluster.group_start_timeout_s=15")
    root = checkpoint.save_root(cfg)
    events: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            result["final"] = launch(cfg, plan)
        except BaseException as err:  # reported, and the scenario below stops waiting
            result["error"] = repr(err)
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    t0 = time.time()
    thread.start()
    try:
        _grow_then_shrink(cluster, ppu_nodes, out, root, done, events)
        done.wait()
    finally:
        thread.join(timeout=60)
    result.update(wall_s=time.time() - t0, events=events, dir=str(out))


def _refresh_ray_trains_view() -> None:
    """Have Ray's autoscaling coordinator, through which Ray Train's elastic policy sees the
    cluster, look at the nodes now: it refreshes its view only every 20 s
    (``TICK_INTERVAL_S``), and a 12-iteration CPU run can end before that tick notices the
    joined node (the grow then never happens). On a real cluster the grow waits for the tick;
    here the figure is the rest: node joined → the larger group's first iteration."""
    import ray

    coordinator = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
    ray.get(coordinator.get_reserved_resources.remote("ray_ppu-elastic-scenario", recompute=True))


def _grow_then_shrink(cluster, ppu_nodes: list, out: Path, root: Path, done: threading.Event,
                      events: dict) -> None:
    """A fourth node once the 3-worker group's checkpoint at 2 is complete; then, once the
    4-worker group has saved, the loss of a node hosting a worker."""
    from ray_ppu import checkpoint

    if not wait_for(lambda: (root / "iter_0000002" / checkpoint.META_FILE).exists(), done):
        return
    ppu_nodes.append(cluster.add_node(**PPU_NODE))
    events["added"] = time.time()
    print(f"ELASTIC node added at {events['added']:.3f}", flush=True)
    _refresh_ray_trains_view()

    def grown_and_saved():
        rows = metrics_rows(out)
        grown = [r["time"] for r in rows if r.get("world_size") == 4]
        return grown and any(r.get("event") == "checkpoint" and r["time"] > grown[0]
                             for r in rows)

    if wait_for(grown_and_saved, done):
        victim = node_of_a_train_worker(ppu_nodes)
        cluster.remove_node(victim, allow_graceful=False)
        events["removed"] = time.time()
        print(f"ELASTIC node {victim.node_id[:8]} removed at {events['removed']:.3f}", flush=True)
