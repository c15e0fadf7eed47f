"""Benchmarks that print figures (not timed tests).

    python entrypoints/benchmark.py overhead [--rounds 3] [--iters 30] [--json FILE] [key=value ...]
    python entrypoints/benchmark.py data [--data-ranks 16] [--iters 20] [--json FILE]
    python entrypoints/benchmark.py sft [--records 60000] [--seq-length 2048] [--workers 1 2]
    python entrypoints/benchmark.py recovery [--dir DIR] [--reference] [--json FILE]
    python entrypoints/benchmark.py elastic [--dir DIR] [--reference] [--json FILE]
    python entrypoints/benchmark.py metrics [--rounds 4] [--iters 30] [key=value ...]
    python entrypoints/benchmark.py options [--dir DIR] [--corpus PREFIX]
    python entrypoints/benchmark.py device [--dir DIR] [--iters 20] [--timeout 120]
    python entrypoints/benchmark.py hf-load [--sizes-gb 1 2 4] [--ranks 2] [--dir DIR]

``overhead``: the same tiny training run under Ray Train (a local Ray the run starts, and a job
joining a Ray already running) and under plain torchrun (in-process reads), alternated:
median step times, time to the first iteration, start-up phases, ratios; ``--json``
(ray_ppu.tools.bench.overhead).

``data``: the data path of one simulated node of ``--data-ranks`` data ranks (the reference 7B
layout's shape by default: seq 4096, mbs 1, gbs 256, DP 16, validation on) over a synthetic
idxmap corpus written once under ``--dir``, no training: reader processes, their PSS and CPU
seconds per 1,000 samples, time to every rank's first batch, tokens/s per rank beside a rank's
consumption (0.5B at 50 % MFU of a PPU); ``--json`` writes them (ray_ppu.tools.bench.data_path).

``sft``: a synthetic instruction corpus (``--records`` alpaca and chat records, a third
Chinese, log-normal lengths) read, templated, tokenized and padded or packed by the SFT Ray
Data pipeline with 1 and 2 tokenizer actors: records per second per core, and the fraction of
non-pad tokens per row, padded vs packed (the compute packing saves).

``metrics``: the demo run under Ray Train with ``output.ray_metrics`` on and off, alternated:
median step times and their ratio (the cost of exporting every logged row to Ray's metrics).

``options`` (CPU) and ``device`` (every visible GPU / PPU, < 8 minutes on one H200): the same
short run once per training option (precision, recompute, offload, SP / VP / CP, distributed
optimizer, attention backend); a table of option, ran, loss matches (its reference variant's
losses at every iteration), iteration time, peak memory, TFLOP/s and MFU
(``ray_ppu/tools/option_matrix.py``).

``hf-load``: synthetic multi-GB Hugging Face checkpoints loaded with ``checkpoint.pretrained``'s
code by --ranks CPU processes at TP = ranks and at PP = ranks: per-rank load time and peak host
memory against the checkpoint size (``entrypoints/hf_benchmark.py``).

``recovery``: node loss under Ray Train V2 on a simulated multi-node cluster
(``ray.cluster_utils.Cluster``: a CPU-only head and three nodes with one PPU each, one spare).
The tiny model trains on 2 workers (DP 2), saving every 2 iterations; once the checkpoint at
iteration 4 is complete a PPU node hosting a worker is removed (its raylet and worker killed)
and the group restarts on the survivors. Prints the time from the loss to the first completed iteration after it
(detection, worker-group restart, checkpoint load, first step), the iterations lost, and the
checkpoint save/load throughput against the raw write/read speed of the same disk.
``--reference`` runs the same job uninterrupted first (tests/test_faults.py compares them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))



def metrics_overhead(rounds: int, iters: int, extra: list[str]) -> None:
    """The demo run under Ray Train with the Ray metrics export on and off, alternated; median step times side by side and their ratio."""
    from ray_ppu.tools.bench.overhead import one_run
    from ray_ppu.config.loader import load
    from ray_ppu.data.preprocess import build_stdlib_corpus
    from ray_ppu.data.tokenizer import qwen2
    from ray_ppu.run import absolute_paths

    demo = absolute_paths(load(REPO / "entrypoints" / "configs" / "demo.yaml", extra))
    build_stdlib_corpus(demo.data.data_path[0], qwen2())
    switch = {"on": ["output.ray_metrics=true"], "off": ["output.ray_metrics=false"]}
    steps: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for kind in ("on", "off") if r % 2 == 0 else ("off", "on"):
                step = one_run("ray", Path(tmp) / f"{kind}{r}", iters, [*extra, *switch[kind]])["step_s"]
                steps[kind].append(step)
                print(f"round {r} metrics {kind:3s} median step {step * 1000:7.1f} ms", flush=True)
    on, off = statistics.median(steps["on"]), statistics.median(steps["off"])
    print(f"\nmedian step time: metrics on {on * 1000:.1f} ms, off {off * 1000:.1f} ms -> "
          f"ratio on/off {on / off:.4f}")


def data(args) -> None:
    """The data path of one simulated node (ray_ppu.tools.bench.data_path)."""
    from ray_ppu.tools.bench import data_path

    work = Path(args.dir).resolve()
    prefix = work / f"synthetic_{args.tokens:.0e}".replace("+", "")
    t0 = time.perf_counter()
    data_path.synthetic_corpus(prefix, int(args.tokens))
    print(f"corpus {prefix}: {int(args.tokens):.3g} tokens, "
          f"{Path(f'{prefix}.bin').stat().st_size / 1e9:.2f} GB "
          f"(ready in {time.perf_counter() - t0:.1f} s)", flush=True)
    data_path.run(prefix, work / "index_cache", args.data_ranks, args.seq_length,
                  args.global_batch_size, args.iters, args.json)


# ---------------------------------------------------------------------------------------------
# sft: records tokenized and packed per core through Ray Data; packing vs padding
# ---------------------------------------------------------------------------------------------

_LATIN = "the of and to in is for that with on as model data train value result".split()


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


def sft(args) -> None:
    """1. Corpus and tokenizer. 2. For each worker count: the corpus through Ray Data padded
    and packed (alternating), rows counted as they arrive. 3. Records/s per core, efficiency."""
    import ray

    from ray_ppu.data.sft import sft_dataset
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
                ds, stats_fn = sft_dataset(
                    [str(p) for p in paths], str(tokenizer), args.seq_length,
                    max_padding_length=None if mode == "packing" else args.seq_length,
                    packing=mode == "packing", workers=workers)
                start = time.perf_counter()
                rows = sum(len(b["tokens"]) for b in ds.iter_batches(batch_size=1024,
                                                                      batch_format="numpy"))
                wall = time.perf_counter() - start
                stats = stats_fn()
                assert stats["complete"] and stats["rows"] == rows, stats
                rate = stats["records_read"] / wall
                results[(workers, mode)] = (rate / workers, stats["packing_efficiency"])
                print(f"{mode:8s} {workers} worker(s): {stats['records_read']} records -> "
                      f"{rows} rows in {wall:.1f} s = {rate:,.0f} records/s = "
                      f"{rate / workers:,.0f} per core | non-pad tokens "
                      f"{100 * stats['packing_efficiency']:.1f} % | dropped "
                      f"{stats['dropped_total']}, truncated {stats['truncated']}", flush=True)
    finally:
        ray.shutdown()
    w = max(args.workers)
    print(f"\nrecords/s per core ({w} workers): padding {results[(w, 'padding')][0]:,.0f}, "
          f"packing {results[(w, 'packing')][0]:,.0f}; non-pad tokens per row: padding "
          f"{100 * results[(w, 'padding')][1]:.1f} %, packing {100 * results[(w, 'packing')][1]:.1f} % "
          f"-> packing needs {results[(w, 'padding')][1] / results[(w, 'packing')][1]:.2f}x the "
          f"rows (compute) of padding")


# ---------------------------------------------------------------------------------------------
# recovery: node loss on a simulated multi-node cluster
# ---------------------------------------------------------------------------------------------

RECOVERY_ITERS = 8
RECOVERY_SAVE_INTERVAL = 2
LOSS_AFTER = 4  # the node is removed once this iteration's checkpoint is complete


def _node_of_a_train_worker(nodes):
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


def _rows(out: Path) -> list[dict]:
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
        rows = _rows(out)
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


PPU_NODE = {"num_cpus": 2, "resources": {"PPU": 1}}  # a simulated node: one worker + its reader


def simulated_cluster(ppu_nodes: int, head_cpus: int):
    """A ``ray.cluster_utils.Cluster`` on this machine, connected: a head with CPUs only (the
    driver, Ray Train's controller, the data readers) and ``ppu_nodes`` one-PPU nodes whose
    raylets hand out PPU ids. Returns the cluster and its PPU nodes."""
    import ray
    from ray.cluster_utils import Cluster

    from ray_ppu.launcher import UNIT_INSTANCE_RESOURCES

    # Every raylet started below inherits this: distinct PPU ids per worker.
    os.environ["RAY_custom_unit_instance_resources"] = UNIT_INSTANCE_RESOURCES
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus})
    nodes = [cluster.add_node(**PPU_NODE) for _ in range(ppu_nodes)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=True)
    return cluster, nodes


def _recovery_child(args) -> None:
    """The scenario itself, in its own process (its own Ray: a Cluster of simulated nodes)."""
    import signal
    import threading

    import ray

    from ray_ppu import checkpoint
    from ray_ppu.config.loader import load
    from ray_ppu.launcher import launch
    from ray_ppu.plan import build_plan
    from ray_ppu.run import absolute_paths, prepare_output

    if args.drain:  # Ray Train's drain watcher (and our check) every second, not 5: a short run
        os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "1"
    work = Path(args.dir).resolve()
    # Three PPU nodes for two workers: one spare, so the group restarts at full size on the
    # survivors (nodes are added only from the main thread, which is busy in launch()).
    cluster, ppu_nodes = simulated_cluster(ppu_nodes=3, head_cpus=6)
    result: dict = {}

    def config(out: Path):
        cfg = absolute_paths(load(None, recovery_overrides(args.corpus, out)))
        plan = build_plan(cfg)
        prepare_output(cfg, plan)
        return cfg, plan

    try:
        if args.reference:
            out = work / "reference"
            cfg, plan = config(out)
            t0 = time.time()
            result["reference_final"] = launch(cfg, plan)
            result["reference_wall_s"] = time.time() - t0
            result["reference_dir"] = str(out)
            result["reference_root"] = str(checkpoint.save_root(cfg))

        out = work / "interrupted"
        cfg, plan = config(out)
        root = checkpoint.save_root(cfg)
        # --drain: the notice comes after the checkpoint at 2, the run's own save follows it
        meta_file = root / f"iter_{2 if args.drain else LOSS_AFTER:07d}" / checkpoint.META_FILE
        stop, events = threading.Event(), {}

        def lose_a_node() -> None:
            while not stop.is_set():
                if meta_file.exists():
                    victim = _node_of_a_train_worker(ppu_nodes)
                    if args.drain:  # a preemption notice first: the run saves, then loses it
                        _drain_and_wait_for_a_save(cluster.address, victim.node_id, out, events)
                    events["loss_start"] = time.time()
                    rows = _rows(out)
                    cluster.remove_node(victim, allow_graceful=not args.hard)
                    events["removed"] = time.time()
                    events["removed_node"] = victim.node_id
                    events["rows_at_loss"] = len(rows)
                    print(f"RECOVERY node {victim.node_id[:8]} removed at {events['removed']:.3f}",
                          flush=True)
                    # Ray starts a node's processes with PR_SET_PDEATHSIG: keep this thread
                    # (which removed one) alive until the run is over.
                    stop.wait()
                    return
                time.sleep(0.01)

        def guarded() -> None:
            try:
                lose_a_node()
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
    finally:
        ray.shutdown()
        cluster.shutdown()
    Path(args.child_json).write_text(json.dumps(result, default=str))


# ---------------------------------------------------------------------------------------------
# elastic: shrink and grow on a simulated multi-node cluster
# ---------------------------------------------------------------------------------------------

ELASTIC_ITERS = 12


def _wait_for(condition, stop: threading.Event, poll: float = 0.05):
    """Poll ``condition()`` until it returns something truthy (returned) or ``stop`` is set."""
    while not stop.is_set():
        value = condition()
        if value:
            return value
        time.sleep(poll)
    return None


def _elastic_child(args) -> None:
    """The elastic scenario, in its own process (its own Ray: a Cluster of simulated nodes).

    1. A CPU-only head and three one-PPU nodes. 2. ``--reference``: the run on a fixed group of
    2 workers (TP 1 × DP 2), uninterrupted. 3. The elastic run, num_workers (2, 4) at TP 2,
    launched from a thread so this (main) thread can add and remove nodes: it starts on the 3
    workers that fit (TP 2 × DP 1, one spare); once its checkpoint at 2 is complete a fourth
    node joins and Ray Train grows the group to 4 (TP 2 × DP 2); after that group's first
    checkpoint a node hosting a worker is removed, and the run ends on 3 again.
    """
    import ray

    from ray_ppu import checkpoint
    from ray_ppu.config.loader import load
    from ray_ppu.launcher import launch
    from ray_ppu.plan import build_plan
    from ray_ppu.run import absolute_paths, prepare_output

    work = Path(args.dir).resolve()
    cluster, ppu_nodes = simulated_cluster(ppu_nodes=3, head_cpus=8)
    result: dict = {}

    def config(out: Path, *extra: str):
        cfg = absolute_paths(load(None, recovery_overrides(
            args.corpus, out, f"training.train_iters={ELASTIC_ITERS}", "output.sample_log=true",
            *extra)))
        plan = build_plan(cfg)
        prepare_output(cfg, plan)
        return cfg, plan

    try:
        if args.reference:
            cfg, plan = config(work / "reference", "cluster.num_workers=2")
            result["reference_final"] = launch(cfg, plan)
            result["reference_dir"] = str(cfg.output.dir)

        out = work / "elastic"
        cfg, plan = config(out, "cluster.num_workers=4", "cluster.min_workers=2",
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
            # grow: a fourth node once the 3-worker group's checkpoint at 2 is complete
            if _wait_for(lambda: (root / "iter_0000002" / checkpoint.META_FILE).exists(), done):
                ppu_nodes.append(cluster.add_node(**PPU_NODE))
                events["added"] = time.time()
                print(f"ELASTIC node added at {events['added']:.3f}", flush=True)

                def grown_and_saved():
                    rows = _rows(out)
                    grown = [r["time"] for r in rows if r.get("world_size") == 4]
                    return grown and any(r.get("event") == "checkpoint" and r["time"] > grown[0]
                                         for r in rows)

                # shrink: a node hosting a worker goes once the 4-worker group has saved
                if _wait_for(grown_and_saved, done):
                    victim = _node_of_a_train_worker(ppu_nodes)
                    cluster.remove_node(victim, allow_graceful=False)
                    events["removed"] = time.time()
                    print(f"ELASTIC node {victim.node_id[:8]} removed at {events['removed']:.3f}",
                          flush=True)
            done.wait()
        finally:
            thread.join(timeout=60)
        result.update(wall_s=time.time() - t0, events=events, dir=str(out))
    finally:
        ray.shutdown()
        cluster.shutdown()
    Path(args.child_json).write_text(json.dumps(result, default=str))


def elastic(args) -> dict:
    """Run the elastic scenario in a child process; print each group's shape and step time,
    and how long growing and shrinking took (event → first iteration of the new group)."""
    work = Path(args.dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.corpus is None:
        args.corpus = _default_corpus(work)
    res, _ = _run_scenario("elastic", args, ["--reference"] if args.reference else [])
    if "error" in res:
        raise SystemExit(f"the elastic run failed: {res['error']}")
    rows = [r for r in _rows(Path(res["dir"])) if "lm_loss" in r]
    phases: list[list[dict]] = []
    for r in rows:  # consecutive rows of one group shape
        if not phases or (phases[-1][-1]["world_size"], phases[-1][-1]["iteration"]) != (
                r["world_size"], r["iteration"] - 1):
            phases.append([])
        phases[-1].append(r)
    print(f"elastic run: {len(rows)} iteration rows, final iteration {res['final']['iteration']}")
    for phase in phases:
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
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    return res


_ASCTIME = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
_LOADED = re.compile(_ASCTIME + r" loaded (\S+) in ([\d.]+) s: training continues at iteration (\d+)")
_SAVED = re.compile(_ASCTIME + r" checkpoint at iteration (\d+) saved to (\S+) in ([\d.]+) s")
# Ray Train V2's controller on a worker-group failure (its log lines reach the driver's output).
_DETECTED = re.compile(r"Training failed due to worker errors|health check failed|ActorDiedError")
_ATTEMPT = re.compile(r"Attempting to start training worker group")
_STARTED = re.compile(r"Started training worker group")


def _asctime(text: str) -> float:
    import datetime

    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def raw_disk_speed(directory: Path, size: int) -> tuple[float, float]:
    """(write, read) bytes/s of ``directory``'s disk: a ``size``-byte file written with fsync,
    dropped from the page cache, read back."""
    size = max(size, 16 << 20)
    chunk = os.urandom(4 << 20)
    path = Path(directory) / "raw_disk_probe.bin"
    try:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            written = 0
            while written < size:
                f.write(chunk)
                written += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        write = written / (time.perf_counter() - t0)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: really dropped
        finally:
            os.close(fd)
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(4 << 20):
                pass
        read = written / (time.perf_counter() - t0)
    finally:
        path.unlink(missing_ok=True)
    return write, read


def _default_corpus(work: Path) -> str:
    from ray_ppu.data.preprocess import build_stdlib_corpus
    from ray_ppu.data.tokenizer import qwen2

    corpus = str(work / "corpus" / "stdlib_text_document")
    build_stdlib_corpus(corpus, qwen2(), max_bytes=600_000)
    return corpus


def _run_scenario(name: str, args, extra: list[str]) -> tuple[dict, list[tuple[float, str]]]:
    """Run ``benchmark.py <name> --child`` (its own Ray cluster) in its own process group;
    returns its JSON result and its output lines, each timestamped as it arrived."""
    work = Path(args.dir).resolve()
    child_json = work / "child.json"
    child_json.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, name, "--child", "--child-json", str(child_json),
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


def recovery(args) -> dict:
    """Run the scenario in a child process, timestamp its output lines, print the figures."""
    work = Path(args.dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.corpus is None:
        args.corpus = _default_corpus(work)
    start = time.time()
    res, lines = _run_scenario("recovery", args, (["--reference"] if args.reference else [])
                               + (["--hard"] if args.hard else [])
                               + (["--drain"] if args.drain else []))
    res["total_wall_s"] = time.time() - start
    res["hard"] = args.hard
    ev = res["events"]
    if "removed" not in ev:
        raise SystemExit("the node was never removed: the run ended before the checkpoint at "
                         f"iteration {LOSS_AFTER} was complete")
    t_loss = ev["removed"]
    rows = _rows(Path(res["dir"]))
    train = [r for r in rows if "lm_loss" in r]
    before = [r for r in train if r["time"] <= t_loss]
    last_before = max((r["iteration"] for r in before), default=0)
    resumed_at = res["stream_start"]["iteration"]
    after = [r for r in train if r["time"] > t_loss]
    first_after = after[0] if after else None

    loads = [(_asctime(m[1]), m[2], float(m[3]), int(m[4]))
             for _, l in lines if (m := _LOADED.search(l))]
    load = next((x for x in loads if x[0] > t_loss), None)
    saves = [(_asctime(m[1]), int(m[2]), m[3], float(m[4]))
             for _, l in lines if (m := _SAVED.search(l))]
    # Detection: the first line after the loss that is about the failure (controller / Ray core),
    # else the restarted group's rank 0 writing stream_start.json.
    detect_line = next(((t, l) for t, l in lines
                        if t > t_loss and "RECOVERY" not in l and _DETECTED.search(l)), None)
    t_detect = detect_line[0] if detect_line else res["stream_start_mtime"]
    t_attempt = next((t for t, l in lines if t > t_loss and _ATTEMPT.search(l)), None)
    t_started = next((t for t, l in lines if t > t_loss and _STARTED.search(l)), None)
    t_load_end = load[0] if load else None
    t_load_start = t_load_end - load[2] if load else None
    t_first = first_after["time"] if first_after else None

    def span(a, b):
        return None if a is None or b is None else b - a

    figures = {
        "detection_s": span(t_loss, t_detect),
        "group_restart_s": span(t_detect, t_load_start),
        "restart_attempt_after_detection_s": span(t_detect, t_attempt),
        "group_started_after_detection_s": span(t_detect, t_started),
        "stream_start_written_after_loss_s": span(t_loss, res["stream_start_mtime"]),
        "checkpoint_load_s": load[2] if load else None,
        "first_step_s": span(t_load_end, t_first),
        "recovery_s": span(t_loss, t_first),
        "remove_node_call_s": ev["removed"] - ev["loss_start"],
        "last_iteration_before_loss": last_before,
        "resumed_from_iteration": resumed_at,
        "iterations_lost": last_before - resumed_at,
        "restored_from": next((r.get("restored_from") for r in rows
                               if r.get("event") == "restart"), None),
        "snapshot_blocking_s": (statistics.median(b) if (b := [
            r["snapshot_blocking_s"] for r in train if "snapshot_blocking_s" in r]) else None),
        "detect_line": (re.sub(r"\x1b\[[0-9;]*m", "", detect_line[1])[:200] if detect_line
                        else "(stream_start.json mtime)"),
    }
    if "drained" in ev:  # --drain: the preemption notice → the checkpoint it caused
        figures["drain_saved_iteration"] = ev.get("drain_saved_iteration")
        figures["drain_to_saved_s"] = span(ev["drained"], ev.get("drain_saved"))
    # Checkpoint throughput: bytes of each saved directory that still exists ÷ its logged time.
    ckpt_bytes, save_rates = 0, []
    for _, iteration, path, secs in saves:
        if Path(path).is_dir() and secs > 0:
            b = _dir_bytes(Path(path))
            ckpt_bytes = max(ckpt_bytes, b)
            save_rates.append(b / secs)
    if load and Path(load[1]).is_dir():
        ckpt_bytes = ckpt_bytes or _dir_bytes(Path(load[1]))
        figures["load_Bps"] = _dir_bytes(Path(load[1])) / max(load[2], 1e-9)
    figures["checkpoint_bytes"] = ckpt_bytes
    figures["save_times_s"] = [s[3] for s in saves]
    figures["save_Bps"] = statistics.median(save_rates) if save_rates else None
    figures["save_best_Bps"] = max(save_rates) if save_rates else None  # least disturbed save
    write, read = raw_disk_speed(Path(res["root"]), ckpt_bytes)
    figures.update(raw_write_Bps=write, raw_read_Bps=read)
    figures["save_vs_raw_write"] = (figures["save_Bps"] / write
                                    if figures["save_Bps"] and write else None)
    res["figures"] = figures
    # the headline figures at the top level too
    res.update({k: figures[k] for k in ("recovery_s", "iterations_lost", "restored_from",
                                        "snapshot_blocking_s", "save_vs_raw_write")})
    _print_recovery(figures, res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return res


def _print_recovery(f: dict, res: dict) -> None:
    def sec(x):
        return "   n/a" if x is None else f"{x:6.1f} s"

    def mbs(x):
        return "n/a" if x is None else f"{x / 1e6:,.0f} MB/s"

    rec = f["recovery_s"]
    ratio = (f["save_Bps"] / f["raw_write_Bps"]) if f["save_Bps"] else None
    if "drain_to_saved_s" in f:
        print(f"\ndrain notice → checkpoint at iteration {f['drain_saved_iteration']} "
              f"{sec(f['drain_to_saved_s'])}; then the node was removed")
    lost_ok = f["iterations_lost"] <= 1
    print(f"\nnode loss → first completed iteration after it (tiny model, DP 2, "
          f"{'SIGKILL' if res.get('hard') else 'node removed'}):")
    print(f"  detection (loss → Ray Train notices)     {sec(f['detection_s'])}"
          f"   [{f['detect_line'][:90]}]")
    print(f"  worker-group restart                     {sec(f['group_restart_s'])}"
          f"   (restart attempted +{sec(f['restart_attempt_after_detection_s']).strip()},"
          f" group started +{sec(f['group_started_after_detection_s']).strip()},"
          f" then workers build the model until the load starts)")
    print(f"  restore from {f['restored_from'] or 'scratch':<8}                    "
          f"{sec(f['checkpoint_load_s'])}")
    print(f"  first step                               {sec(f['first_step_s'])}")
    print(f"  total recovery                           {sec(rec)}   target ≤ 10 s: "
          f"{'OK' if rec is not None and rec <= 10 else 'MISSED'}")
    print(f"  iterations lost  {f['last_iteration_before_loss']} reached − restored "
          f"{f['resumed_from_iteration']} = {f['iterations_lost']}   target ≤ 1: "
          f"{'OK' if lost_ok else 'MISSED'}")
    if f["snapshot_blocking_s"] is not None:
        print(f"  in-memory snapshot: training blocked {1e3 * f['snapshot_blocking_s']:.1f} ms "
              f"per snapshot (median)")
    print(f"checkpoint {f['checkpoint_bytes'] / 1e6:.1f} MB; save times {f['save_times_s']} s "
          f"(logged to 0.1 s)")
    print(f"  save  {mbs(f['save_Bps']):>14}  (median) vs raw write (fsync) {mbs(f['raw_write_Bps'])}"
          f"  = {'n/a' if ratio is None else f'{100 * ratio:.0f} %'}   target ≥ 50 %: "
          f"{'OK' if ratio is not None and ratio >= 0.5 else 'MISSED'}")
    if f.get("save_best_Bps"):
        print(f"  save (fastest of the saves) {mbs(f['save_best_Bps'])} = "
              f"{100 * f['save_best_Bps'] / f['raw_write_Bps']:.0f} % of raw write")
    print(f"  load  {mbs(f.get('load_Bps')):>14}  vs raw read (cache dropped) "
          f"{mbs(f['raw_read_Bps'])}")
    print(f"wall: interrupted run {res['wall_s']:.1f} s"
          + (f", reference {res['reference_wall_s']:.1f} s" if "reference_wall_s" in res else "")
          + f", all {res['total_wall_s']:.1f} s")



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    ov = sub.add_parser("overhead", help="Ray Train vs torchrun step time and startup")
    ov.add_argument("--rounds", type=int, default=3)
    ov.add_argument("--iters", type=int, default=30)
    ov.add_argument("--json", default=None, help="write the figures here")
    ov.add_argument("overrides", nargs="*", metavar="section.field=value",
                    help="applied to both runs (default: the demo config, TP=2 on 2 workers)")
    da = sub.add_parser("data", help="the data path of one node of data ranks: reader "
                                     "processes, PSS, CPU, first batch, tokens/s per rank")
    da.add_argument("--tokens", type=float, default=2e8, help="synthetic corpus size")
    da.add_argument("--dir", default="outputs/benchmark_data", help="corpus and index cache")
    da.add_argument("--data-ranks", type=int, default=16, help="data ranks on the node (DP)")
    da.add_argument("--seq-length", type=int, default=4096)
    da.add_argument("--global-batch-size", type=int, default=256)
    da.add_argument("--iters", type=int, default=20, help="iterations each rank reads")
    da.add_argument("--json", default=None, help="write the figures here")
    sf = sub.add_parser("sft", help="SFT records/s per core through Ray Data; packing "
                                    "efficiency vs padding")
    sf.add_argument("--records", type=int, default=60_000)
    sf.add_argument("--shards", type=int, default=8)
    sf.add_argument("--seq-length", type=int, default=2048)
    sf.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                    help="tokenizer actor counts to measure (one CPU each)")
    sf.add_argument("--dir", default="outputs/benchmark_sft", help="corpus and tokenizer")
    el = sub.add_parser("elastic", help="elastic group: starts small with a spare, grows when "
                                        "a node joins, shrinks when one is lost")
    el.add_argument("--dir", default="outputs/benchmark_elastic", help="runs, corpus, log")
    el.add_argument("--corpus", default=None, help="idxmap prefix (default: a small stdlib one)")
    el.add_argument("--reference", action="store_true", help="run a fixed group first")
    el.add_argument("--json", default=None, help="write the figures and results here")
    el.add_argument("--timeout", type=float, default=900, help="give up (and stop it) after")
    el.add_argument("--verbose", action="store_true", help="echo the scenario's output")
    el.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    el.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    rc = sub.add_parser("recovery", help="node loss: recovery time, iterations lost, "
                                         "checkpoint throughput vs raw disk")
    rc.add_argument("--dir", default="outputs/benchmark_recovery", help="runs, corpus, log")
    rc.add_argument("--corpus", default=None, help="idxmap prefix (default: a small stdlib one)")
    rc.add_argument("--reference", action="store_true", help="run uninterrupted first")
    rc.add_argument("--hard", action="store_true",
                    help="SIGKILL the node's processes (default: SIGTERM first, as remove_node)")
    rc.add_argument("--drain", action="store_true",
                    help="drain the node first (a preemption notice): the run saves, then loses it")
    rc.add_argument("--json", default=None, help="write all figures and the runs' results here")
    rc.add_argument("--timeout", type=float, default=900, help="give up (and stop it) after")
    rc.add_argument("--verbose", action="store_true", help="echo the scenario's output")
    rc.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    rc.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    mt = sub.add_parser("metrics", help="Ray metrics export on vs off: step-time ratio")
    mt.add_argument("--rounds", type=int, default=4)
    mt.add_argument("--iters", type=int, default=30)
    mt.add_argument("overrides", nargs="*", metavar="section.field=value")
    op = sub.add_parser("options", help="each training option on CPU against the plain run")
    op.add_argument("--dir", default="outputs/benchmark_options", help="runs and corpus")
    op.add_argument("--corpus", default=None, help="idxmap prefix (default: a small stdlib one)")
    dv = sub.add_parser("device", help="GPU/PPU-only options (fp8, TE attention, activation "
                                       "offload, CP): ran, losses, time, memory, MFU")
    dv.add_argument("--dir", default="outputs/benchmark_device", help="runs and corpus")
    dv.add_argument("--corpus", default=None, help="idxmap prefix (default: a small stdlib one)")
    dv.add_argument("--iters", type=int, default=20)
    dv.add_argument("--timeout", type=float, default=120, help="per option")
    hl = sub.add_parser("hf-load", help="HF checkpoint load time and peak host memory per rank "
                                         "vs checkpoint size")
    hl.add_argument("--sizes-gb", type=float, nargs="+", default=[1, 2, 4])
    hl.add_argument("--ranks", type=int, default=2, help="processes (TP or PP size)")
    hl.add_argument("--dir", default="outputs/benchmark_hf", help="synthetic checkpoints")
    args = parser.parse_args()
    if args.bench == "hf-load":
        import hf_benchmark

        hf_benchmark.hf_load(args.sizes_gb, args.ranks, Path(args.dir).resolve())
    elif args.bench in ("options", "device"):
        from ray_ppu.tools import option_matrix as option_runs

        work = Path(args.dir).resolve()
        corpus = args.corpus or _default_corpus(work)
        if args.bench == "options":
            option_runs.options(corpus, work / "runs")
        else:
            option_runs.device(corpus, args.iters, work / "runs", args.timeout)
    elif args.bench == "metrics":
        metrics_overhead(args.rounds, args.iters, args.overrides)
    elif args.bench == "overhead":
        from ray_ppu.tools.bench import overhead

        overhead.run(args.rounds, args.iters, args.overrides, args.json)
    elif args.bench == "data":
        data(args)
    elif args.bench == "sft":
        sft(args)
    elif args.bench == "elastic":
        _elastic_child(args) if args.child else elastic(args)
    elif args.child:
        _recovery_child(args)
    else:
        recovery(args)


if __name__ == "__main__":
    main()
