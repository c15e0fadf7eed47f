"""Checkpoints with the exact data position, under the real Ray Train TorchTrainer.

First, without Ray, the rule that picks the starting checkpoint and the check that the data
streams and the workers agree on it (files on disk only). Then four real training runs,
shared by the tests through fixtures (each costs tens of seconds), all 8 iterations of the
tiny model as in test_training.py, saving every 4. The reference is a session fixture
(conftest, prelaunched); the other three are this module's, each run when a test first needs it:

* ``uninterrupted``: DP 2, start to end: the reference losses and checkpoints.
* ``interrupted``: the same run, snapshotting in memory every iteration, interrupted twice.
  One Ray Train worker process is SIGKILLed after iteration 5 (the checkpoint at 4 complete):
  the restarted group restores the newest in-memory snapshot. Once it has logged an iteration,
  the snapshot keepers are killed (every in-memory copy gone), then a worker again: the next
  group falls back to the disk checkpoint at 4. Real interruptions rather than "run 4
  iterations, then 8": they exercise Ray Train's own restart (FailureConfig), the restarted
  workers starting their streams from their own resume point, and a schedule that never
  changed length (a run re-launched with another train_iters keeps the checkpoint's LR
  schedule, as Megatron does).
* ``resharded``: DP 1, started with ``checkpoint.load`` from a directory holding the
  interrupted run's DP-2 checkpoint at iteration 4 and a newer, incomplete one (no meta file).
* ``finetuned``: ``checkpoint.finetune=true`` from the resharded run's final checkpoint
  (saved in the background, at DP 1).

The finetune test's reference is measured apart from the runs: in the test process, without
Ray, each checkpoint loaded exactly as a resume loads it and the model's loss on the first
global batch evaluated.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from ray_ppu import checkpoint
from ray_ppu.config.loader import ConfigError, load
from ray_ppu.launch.launcher import launch
from ray_ppu.monitor import trackers
from ray_ppu.monitor.metrics_log import read_sample_log
from ray_ppu.plan import build_plan
from ray_ppu.launch.output import absolute_paths, prepare_output

ITERS = 8
SAVE = ["checkpoint.save_interval=4"]


# ---------------------------------------------------------------------------------------------
# The starting point, on files alone (fast)
# ---------------------------------------------------------------------------------------------

def _fake_checkpoint(path: Path, iteration: int, complete: bool = True) -> Path:
    """A checkpoint directory as the finder sees it: Megatron's metadata.json and a shard,
    and our meta file (listing both) when the save finished."""
    path.mkdir(parents=True)
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (path / "__0_0.distcp").write_bytes(b"\0" * 64)
    if complete:
        meta = checkpoint.Meta(iteration=iteration, consumed_samples=4 * iteration, world_size=2,
                               tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                               context_parallel_size=1, data_parallel_size=2,
                               global_batch_size=4, config_hash="x", optimizer_format="dp_reshardable",
                               saved_at=time.time(),
                               files={f.name: f.stat().st_size for f in path.iterdir()})
        (path / checkpoint.META_FILE).write_text(json.dumps(dataclasses.asdict(meta)))
    return path


def _writer_queue_child(conn) -> None:
    """A rank's process as far as the writer queue goes: make it, use it, report the server."""
    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from ray_ppu.checkpoint.saver import _start_writer_results_queue

    # a rank starts without one; this fork of the test process inherits the test process's
    # queue if an earlier test saved a checkpoint here
    filesystem_async._results_queue = None
    _start_writer_results_queue()
    queue = filesystem_async._get_write_results_queue()  # Megatron's own accessor
    result = {0: [WriteResult(MetadataIndex("w"), 8, _StorageInfo("__0_0.distcp", 0, 8))]}
    queue.put(result)
    conn.send((queue.get() == result, [c.pid for c in psutil.Process().children()]))
    time.sleep(600)  # until the test SIGKILLs it


def test_the_writer_results_queue_is_forked_ready_and_dies_with_its_rank():
    """Megatron-Core's torch_dist writer reports through a Manager queue it would spawn at a
    process's first save (the server importing torch: seconds of every first save). The Saver
    makes it first, in a server forked from the rank, which Megatron's accessor then returns;
    the server exits when the rank is SIGKILLed instead of outliving it."""
    import multiprocessing
    import signal

    import psutil

    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    rank = ctx.Process(target=_writer_queue_child, args=(theirs,))
    rank.start()
    try:
        assert ours.poll(60), "the rank process did not report"
        round_trip, servers = ours.recv()
        assert round_trip and len(servers) == 1, servers
        # held while the rank holds it alive: is_running() is then about this process, not
        # whichever takes its pid next (the suite goes through the 32,768 pids in minutes)
        server = psutil.Process(servers[0])
    finally:
        os.kill(rank.pid, signal.SIGKILL)
        rank.join()
    deadline = time.monotonic() + 10
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(server), "the writer queue's server outlived its rank"


def _running(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cfg(tmp_path, *extra):
    return absolute_paths(load(None, ["data.data_path=[corpus]", "training.train_iters=8",
                                      f"output.dir={tmp_path / 'run'}", *extra]))


def test_resume_point_rules(tmp_path, caplog):
    cfg = _cfg(tmp_path)
    assert checkpoint.resume_point(cfg) is None  # nothing anywhere: from scratch
    # Another run's checkpoints, given as checkpoint.load: the latest complete one, and with
    # finetune only its weights (iteration 0).
    other = tmp_path / "other"
    _fake_checkpoint(other / "iter_0000002", 2)
    _fake_checkpoint(other / "iter_0000006", 6)
    loaded = checkpoint.resume_point(_cfg(tmp_path, f"checkpoint.load={other}"))
    assert (Path(loaded.path).name, loaded.iteration, loaded.weights_only) == ("iter_0000006", 6, False)
    tuned = checkpoint.resume_point(_cfg(tmp_path, f"checkpoint.load={other / 'iter_0000002'}",
                                         "checkpoint.finetune=true"))
    assert (Path(tuned.path).name, tuned.iteration, tuned.weights_only) == ("iter_0000002", 0, True)
    # The run's own checkpoints win over checkpoint.load; an incomplete newer one is skipped
    # with a warning.
    root = checkpoint.save_root(cfg)
    _fake_checkpoint(root / "iter_0000004", 4)
    _fake_checkpoint(root / "iter_0000008", 8, complete=False)
    with caplog.at_level(logging.WARNING, logger="ray_ppu"):
        own = checkpoint.resume_point(_cfg(tmp_path, f"checkpoint.load={other}"))
    assert (Path(own.path).name, own.iteration, own.weights_only) == ("iter_0000004", 4, False)
    assert "iter_0000008 has no ray_ppu_meta.json" in caplog.text
    # checkpoint.load naming an unfinished save is an error, not a silent fresh start.
    with pytest.raises(checkpoint.CheckpointError, match="did not finish"):
        checkpoint.resume_point(_cfg(tmp_path / "x", f"checkpoint.load={root / 'iter_0000008'}"))
    # A finished save whose files changed since (a shard cut short, one gone) is damaged: the
    # resume falls back to the one before, with a warning; named explicitly, it is an error.
    _fake_checkpoint(root / "iter_0000012", 12)
    _fake_checkpoint(root / "iter_0000016", 16)
    (root / "iter_0000016" / "__0_0.distcp").write_bytes(b"\0" * 10)
    (root / "iter_0000016" / "metadata.json").unlink()
    assert checkpoint.resume_point(cfg).iteration == 12
    assert ("iter_0000016 is damaged (__0_0.distcp has 10 bytes, not 64, metadata.json "
            "missing): ignored" in caplog.text)
    with pytest.raises(checkpoint.CheckpointError, match="iter_0000016 is damaged"):
        checkpoint.resume_point(_cfg(tmp_path / "y", f"checkpoint.load={root / 'iter_0000016'}"))


def test_stream_start_is_recorded_from_the_resume_point(tmp_path):
    """The workers start their streams where resume_point says and record it: train from the
    checkpoint's iteration, validation from the next unread batch (one pass of eval_iters=1
    every 4 iterations so far)."""
    import json

    cfg = _cfg(tmp_path)
    root = checkpoint.save_root(cfg)
    assert checkpoint.record_stream_start(cfg, "launch-1", None, 4, 1)["train"] == 0
    _fake_checkpoint(root / "iter_0000004", 4)
    record = checkpoint.record_stream_start(cfg, "launch-1", checkpoint.resume_point(cfg), 4, 1)
    assert (record["train"], record["valid"], record["iteration"]) == (4, 1, 4)
    assert record["checkpoint"].endswith("iter_0000004")
    assert json.loads((root / checkpoint.STREAM_START_FILE).read_text()) == record


@pytest.mark.parametrize("override, message", [
    ("checkpoint.save_interval=0", "save_interval=0"),
    ("checkpoint.keep_last=0", "keep_last=0"),
    ("checkpoint.finetune=true", "needs checkpoint.load"),
    ("checkpoint.memory_interval=-1", "memory_interval=-1"),
])
def test_bad_checkpoint_settings(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        build_plan(_cfg(tmp_path, override))


# ---------------------------------------------------------------------------------------------
# Real runs under Ray Train (slow)
# ---------------------------------------------------------------------------------------------


def _overrides(corpus, out, *extra):
    from test_training import overrides  # the same run settings as the training tests

    return overrides(corpus, out, *SAVE, "output.sample_log=true", *extra)


def _config(corpus, out, *extra):
    cfg = absolute_paths(load(None, _overrides(corpus, out, *extra)))
    plan = build_plan(cfg)
    prepare_output(cfg, plan)
    return cfg, plan


def _rows(out) -> list[dict]:
    with open(Path(out) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _curve(rows) -> dict:
    """{iteration: loss} for training rows and {("valid", iteration): loss} for validation;
    a later row for the same iteration (logged again after a restart) replaces the earlier."""
    curve = {}
    for r in rows:
        if "lm_loss" in r:
            curve[r["iteration"]] = r["lm_loss"]
        elif "valid_lm_loss" in r:
            curve[("valid", r["iteration"])] = r["valid_lm_loss"]
    return curve


def _train_iterations(rows) -> list[int]:
    return [r["iteration"] for r in rows if "lm_loss" in r]


class _Captured(logging.Handler):
    """Collects ray_ppu's log records in the driver (the launcher logs there)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _launch(cfg, plan):
    handler = _Captured()
    logger = logging.getLogger("ray_ppu")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # the start-point line is INFO
    try:
        return launch(cfg, plan), handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def run_uninterrupted(root: Path, corpus) -> dict:
    """The reference: 8 iterations on 2 workers (DP 2), saving every 4, nothing going wrong.
    Meanwhile the node's Prometheus endpoint is scraped for the run's exported metrics.
    Prelaunched first (tests/prelaunch.py): the session fixture ``uninterrupted`` (conftest)."""
    corpus, out = str(corpus), root
    # in-memory snapshots at the automatic interval: the reference also shows that taking
    # them changes nothing (the restores compare with it) and exercises the choice
    # a declared peak (the PPU's 123 TFLOP/s): test_monitoring checks MFU against it; without
    # one a CPU run's MFU is n/a (test_entrypoint)
    cfg, plan = _config(corpus, out, "cluster.num_workers=2", "checkpoint.memory_interval=null",
                        "cluster.peak_tflops=123")
    scraped: list[str] = []
    managers = _dataset_managers()
    final, _ = launch_while(cfg, plan, scrape_ray_metrics(out.name, scraped))
    rows = _rows(out)
    assert _train_iterations(rows) == list(range(1, ITERS + 1))
    return {"cfg": cfg, "final": final, "rows": rows, "curve": _curve(rows),
            "ray_metrics": scraped, "dataset_managers_started": _dataset_managers() - managers}


def _dataset_managers() -> int:
    """Ray Train DatasetManager actors this process's Ray job has started (dead ones
    included; not another driver's, as the tests' beside the prelaunched runs)."""
    import ray
    from ray.util.state import list_actors

    return len(list_actors(filters=[("class_name", "=", "DatasetManager"),
                                    ("job_id", "=", ray.get_runtime_context().get_job_id())],
                           limit=10_000))


def scrape_ray_metrics(run: str, lines: list, ranks: int = 2):
    """A ``launch_while`` action: the node's metrics endpoint (what Prometheus scrapes), every
    half second while the run trains and after it until a scrape holds the gauges of every
    rank (the workers export every 2 s: the first rows may not be there yet), 30 s at most;
    keeps the last such scrape's ``ray_ppu_*`` samples of ``run``."""
    import ray
    import urllib.request

    from ray_ppu.monitor.ray_gauges import GAUGES

    port = ray.nodes()[0]["MetricsExportPort"]
    wanted = {("ray_" + GAUGES[key][0], f'rank="{rank}"') for rank in range(ranks)
              for key in ("lm_loss", "tflops_per_device", "mfu", "step_time_s", "iteration")}

    def complete(found: list) -> bool:
        return all(any(line.startswith(name + "{") and rank in line for line in found)
                   for name, rank in wanted)

    def action(stop: threading.Event) -> None:
        ended = None
        while ended is None or (not lines and time.monotonic() - ended < 30):
            if stop.wait(0.5) and ended is None:
                ended = time.monotonic()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                continue
            found = [line for line in text.splitlines()
                     if line.startswith("ray_ppu_") and f'run="{run}"' in line]
            if complete(found):
                lines[:] = found

    return action


def launch_while(cfg, plan, action) -> tuple[dict, list[str]]:
    """Launch the run while ``action(stop)`` runs in a thread (a fault to inject; it must
    return once ``stop`` is set, when the run is over); returns ``_launch``'s result."""
    stop = threading.Event()
    thread = threading.Thread(target=action, args=(stop,))
    thread.start()
    try:
        return _launch(cfg, plan)
    finally:
        stop.set()
        thread.join()


def run_workers(out: Path) -> list:
    """The training workers of the run writing to ``out``, rank order: the pids its ranks
    wrote in their progress files (``<out>/ray_train/<run>/progress/<launch>/rank_<r>.json``,
    rewritten by every group), those still running. Only this run's, whatever else trains on
    the session's Ray beside it (tests/prelaunch.py)."""
    import psutil

    from ray_ppu.recovery.watchdog import rank_process

    workers = []
    for path in sorted(Path(out).glob("ray_train/*/progress/*/rank_*.json")):
        try:
            rank = json.loads(path.read_text())
            # the rank's process still, not its pid used again, and not exiting (no command
            # line then)
            proc = rank_process(rank["pid"], rank["pid_started"])
            if proc is not None and proc.status() != psutil.STATUS_ZOMBIE and proc.cmdline():
                workers.append(proc)
        except (OSError, ValueError, KeyError, psutil.Error):  # being written, or gone
            continue
    return workers


def kill_a_worker_when(ready, out: Path, killed: list):
    """A ``launch_while`` action: SIGKILL one training worker of the run in ``out`` as soon
    as ``ready()`` holds."""

    def action(stop: threading.Event) -> None:
        while not stop.is_set():
            if ready():
                if _kill_one_worker(out, killed):
                    return
            time.sleep(0.01)

    return action


def _kill_one_worker(out: Path, killed: list) -> bool:
    """SIGKILL one training worker of the run in ``out`` (its pid into ``killed``), if any."""
    workers = run_workers(out)
    if workers:
        workers[0].kill()
        killed.append(workers[0].pid)
    return bool(workers)


def _rows_after_restart(metrics_file: Path, restarts: int) -> list[dict]:
    """Training rows rank 0 logged after ``restarts`` restarts (they carry the count)."""
    try:
        rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []
    return [r for r in rows if "lm_loss" in r and r.get("restarts") == restarts]


def _kill_keepers(out: Path) -> int:
    """Kill the named actors of the run in ``out`` (named after its launch's token, the name
    of its progress directory): its snapshot keepers, so all its in-memory copies are gone,
    and its readers with them."""
    import ray

    from ray_ppu.recovery.snapshot_keeper import NAMESPACE

    tokens = {p.name for p in Path(out).glob("ray_train/*/progress/*")}
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE and a["name"].split(":")[1] in tokens]
    for name in names:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE))
    return len(names)


def interrupt_twice(metrics_file: Path, record_file: Path, killed: list, seen: dict):
    """A ``launch_while`` action: kill a worker after iteration 5 (a memory restore follows);
    keep the restarted group's stream-start record; once that group has logged an iteration,
    kill the keepers and then a worker (a disk restore follows)."""
    out = metrics_file.parent
    first = kill_a_worker_at(out, 5, killed, snapshot=5)  # a snapshot every iteration

    def action(stop: threading.Event) -> None:
        first(stop)
        while not stop.is_set():
            if not seen.get("record") and record_file.exists():
                record = json.loads(record_file.read_text())
                if (record.get("checkpoint") or "").startswith("memory:"):  # None: scratch
                    seen["record"] = record  # the next group overwrites it
            if seen.get("record") and _rows_after_restart(metrics_file, 1):
                seen["keepers"] = _kill_keepers(out)
                _kill_one_worker(out, killed)
                return
            time.sleep(0.01)

    return action


@pytest.fixture(scope="module")
def interrupted(ray_cluster, corpus, tmp_path_factory):
    """The run interrupted twice (the module docstring): a memory restore, then a disk one."""
    out = tmp_path_factory.mktemp("interrupted")
    # MLflow beside it, fed as pretrain.py feeds it (a local sqlite store): one tracker run
    # through both restarts (tests/test_trackers.py has the server, its outage and a resume)
    cfg, plan = _config(corpus, out, "cluster.num_workers=2", "cluster.max_failures=2",
                        "checkpoint.memory_interval=1", "output.trackers=[mlflow]")
    killed: list = []
    seen: dict = {}
    record_file = checkpoint.save_root(cfg) / checkpoint.STREAM_START_FILE
    with trackers.feeding(cfg, plan) as feed:
        final, _ = launch_while(cfg, plan, interrupt_twice(out / "metrics.jsonl", record_file,
                                                           killed, seen))
        tracked = feed.finish("FINISHED", [out / "plan.json"])
    assert len(killed) == 2 and seen.get("keepers"), (killed, seen)
    rows = _rows(out)
    # Where the last group's streams began, as its rank 0 recorded it (the first start
    # recorded iteration 0, the memory restore its own iteration).
    record = json.loads(record_file.read_text())
    return {"cfg": cfg, "final": final, "rows": rows, "curve": _curve(rows), "record": record,
            "memory_record": seen["record"], "tracked": tracked}


@pytest.mark.slow
def test_interrupted_run_resumes_exactly(uninterrupted, interrupted):
    # The restarted group's streams began after the checkpoint at 4 (train step 4, validation
    # batch 1), and the workers loaded that checkpoint (they check it against this record).
    record = interrupted["record"]
    assert (record["iteration"], record["train"], record["valid"]) == (4, 4, 1), record
    assert record["checkpoint"].endswith("iter_0000004")
    # Rows 1..4, maybe some of 5.. logged before the kill, then 5..8 after the restart: never
    # anything before 5 again (not restarted from scratch).
    iterations = _train_iterations(interrupted["rows"])
    assert iterations[:4] == [1, 2, 3, 4] and iterations[-4:] == [5, 6, 7, 8], iterations
    assert min(iterations[4:]) == 5, iterations
    assert interrupted["final"]["iteration"] == ITERS
    assert interrupted["final"]["consumed_samples"] == ITERS * 4
    # fp32 on CPU, same layout: the resumed iterations are the uninterrupted ones.
    ref, got = uninterrupted["curve"], interrupted["curve"]
    # ("valid", 8) also shows the restarted validation stream began at its batch 1, as the
    # uninterrupted one did after the pass at iteration 4 had read batch 0.
    for key in [5, 6, 7, 8, ("valid", 4), ("valid", 8)]:
        assert got[key] == pytest.approx(ref[key], abs=1e-6), key
    assert ref[8] < ref[1] - 0.5  # and the reference did train


@pytest.mark.slow
def test_an_interrupted_run_is_one_tracker_run_with_each_iteration_once(interrupted):
    """Two restarts (disk, then memory) train some iterations again: MLflow gets each
    iteration once, with the loss the run ended with, in the one run it opened."""
    from mlflow.tracking import MlflowClient

    out = Path(interrupted["cfg"].output.dir)
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run_id = interrupted["tracked"]["mlflow"]["run_id"]
    assert interrupted["tracked"]["mlflow"]["dropped"] == 0
    [run] = client.search_runs([client.get_run(run_id).info.experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    history = {m.step: m.value for m in client.get_metric_history(run_id, "train/lm_loss")}
    assert len(client.get_metric_history(run_id, "train/lm_loss")) == len(history) == ITERS
    curve = interrupted["curve"]
    assert all(history[i] == pytest.approx(curve[i], abs=1e-6) for i in range(1, ITERS + 1))
    assert sum(".restart" in tag for tag in run.data.tags) == 2
    assert [a.path for a in client.list_artifacts(run_id)] == ["plan.json"]
    # the default store keeps its artifacts in the output directory, not where Ray started
    assert [p.name for p in (out / "mlflow-artifacts").rglob("plan.json")] == ["plan.json"]


def _logged(metrics_file: Path, iteration: int) -> bool:
    """Rank 0 has logged training ``iteration``."""
    try:
        return iteration in [json.loads(line).get("iteration") for line in
                             metrics_file.read_text().splitlines() if '"lm_loss"' in line]
    except (FileNotFoundError, json.JSONDecodeError):  # not there yet, or a line being written
        return False


def kill_a_worker_at(out: Path, iteration: int, killed: list, snapshot: int):
    """SIGKILL one training worker of the run in ``out`` once its rank 0 has logged
    ``iteration`` and its keepers hold every rank's snapshot of iteration ``snapshot`` or
    later: the memory restore that follows starts there, however slowly snapshots travel."""
    return kill_a_worker_when(lambda: (_logged(out / "metrics.jsonl", iteration)
                                       and _snapshot_held(out, snapshot)), out, killed)


def _snapshot_held(out: Path, iteration: int) -> bool:
    """The keepers of the run in ``out`` hold every rank's snapshot of one iteration at
    ``iteration`` or later."""
    import collections

    import ray

    from ray_ppu.recovery import snapshot_keeper

    progress = max(Path(out).glob("ray_train/*/progress/*"), key=lambda p: p.stat().st_mtime)
    ranks = [json.loads(f.read_text()) for f in progress.glob("rank_*.json")]
    held = collections.defaultdict(set)  # iteration → ranks held
    nodes = sorted({r["node"] for r in ranks})
    for keeper in snapshot_keeper.keepers(progress.name, nodes).values():
        for rank, snapshots in ray.get(keeper.index.remote()).items():
            for at in snapshots:
                held[at].add(rank)
    return any(at >= iteration and len(got) == len(ranks) for at, got in held.items())


@pytest.mark.slow
def test_the_snapshot_interval_is_chosen_once_for_all_ranks(uninterrupted):
    """With checkpoint.memory_interval unset, the first snapshot is timed and one interval
    chosen (an all-reduce over the ranks): the training rows after the choice carry it and
    the blocking time of the latest snapshot."""
    rows = [r for r in uninterrupted["rows"] if "snapshot_interval" in r]
    assert rows and all(r["snapshot_blocking_s"] > 0 for r in rows), rows
    chosen = {r["snapshot_interval"] for r in rows if r["snapshot_interval"] is not None}
    assert len(chosen) == 1 and min(chosen) >= 1, chosen


@pytest.mark.slow
def test_killed_worker_restores_from_memory(uninterrupted, interrupted):
    """The first interruption (a worker killed after iteration 5, once the keepers held its
    snapshot): the restarted group restores the newest in-memory snapshot from the keepers,
    newer than the disk checkpoint at 4, loses at most one iteration and trains to the
    uninterrupted run's losses."""
    record = interrupted["memory_record"]
    assert record["checkpoint"].startswith("memory:") and record["iteration"] >= 5, record
    first = [r for r in interrupted["rows"] if r.get("event") == "restart"][0]
    assert first["restored_from"] == "memory" and first["iterations_lost"] <= 1, first
    assert first["iteration"] == record["iteration"]
    assert first["resumed_from"].startswith("memory:")
    # the restored group's own rows (before the second interruption) are the reference's
    resumed = [r for r in interrupted["rows"] if "lm_loss" in r and r.get("restarts") == 1]
    assert resumed and min(r["iteration"] for r in resumed) == record["iteration"] + 1
    for row in resumed:
        assert row["lm_loss"] == pytest.approx(uninterrupted["curve"][row["iteration"]],
                                               abs=1e-6), row["iteration"]


@pytest.mark.slow
def test_interrupted_run_trains_on_exactly_the_uninterrupted_samples(uninterrupted, interrupted):
    # By id, from the ranks' sample logs (the last record of an iteration a restart re-trained
    # counts): iteration i's global batch is samples [(i-1)·4, i·4) of the run's order, both runs.
    expected = {i: list(range((i - 1) * 4, i * 4)) for i in range(1, ITERS + 1)}
    assert read_sample_log(uninterrupted["cfg"].output.dir) == expected
    assert read_sample_log(interrupted["cfg"].output.dir) == expected


@pytest.mark.slow
def test_restart_is_reported(uninterrupted, interrupted):
    restarts = [r for r in interrupted["rows"] if r.get("event") == "restart"]
    assert [r["restarts"] for r in restarts] == [1, 2], restarts
    memory, disk = restarts
    assert (memory["restored_from"], disk["restored_from"]) == ("memory", "disk")
    # the second found no in-memory copy (the keepers were killed): the checkpoint at 4
    assert (disk["iteration"], disk["resumed_from"]) == (4, "iter_0000004")
    for row in restarts:
        # The killed worker's death, as Ray Train saw it, names its rank and the kind of failure.
        assert row["cause"].startswith(f"rank {row['failed_ranks'][0]}: "), row
        # Iterations logged after the restored one and before the failure were trained again.
        before = [r["iteration"] for r in interrupted["rows"]
                  if "lm_loss" in r and r["time"] <= row["time"] and r["iteration"] > row["iteration"]]
        assert row["iterations_lost"] == (max(before) - row["iteration"] if before else 0)
        assert 0 < row["recovery_s"] < 300
    # Every training row after a restart counts it; the run's result too; none before.
    for count, row in ((1, memory), (2, disk)):
        later = [r["restarts"] for r in interrupted["rows"] if "lm_loss" in r
                 and r["time"] > row["time"] and (count == 2 or r["time"] < disk["time"])]
        assert later and set(later) == {count}, (count, later)
    assert interrupted["final"]["restarts"] == 2 and uninterrupted["final"]["restarts"] == 0
    assert not [r for r in uninterrupted["rows"] if r.get("event") == "restart"]


@pytest.mark.slow
def test_checkpoints_are_complete_and_kept(uninterrupted):
    root = checkpoint.save_root(uninterrupted["cfg"])
    found = checkpoint.complete_checkpoints(root)
    assert [m.iteration for _, m in found] == [4, 8]  # keep_last=2, every 4 iterations
    meta = found[-1][1]
    assert (meta.consumed_samples, meta.data_parallel_size, meta.world_size) == (32, 2, 2)
    assert meta.optimizer_format == "dp_reshardable"
    saves = [r for r in uninterrupted["rows"] if r.get("event") == "checkpoint"]
    assert [(r["iteration"], r["checkpoint"]) for r in saves] == [(4, "iter_0000004"),
                                                                  (8, "iter_0000008")]
    assert all(r["checkpoint_time_s"] > 0 for r in saves)
    assert uninterrupted["final"]["checkpoint_failures"] == 0
    # Ray Train registered them where they are (no copy), with the metrics of that iteration.
    import ray.train

    result = ray.train.Result.from_path(str(root))
    assert [(Path(c.path), m["iteration"]) for c, m in result.best_checkpoints] == [
        (root / "iter_0000004", 4), (root / "iter_0000008", 8)]


def _hardlink_tree(src: Path, dst: Path, drop: tuple = ()) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in drop:
            os.link(f, dst / f.name)


@pytest.fixture(scope="module")
def resharded(interrupted, corpus, tmp_path_factory):
    """DP 1 from a directory of checkpoints: the DP-2 one at iteration 4, and one at 8 whose
    save "died" before its meta file (and one of its shard files) was written."""
    source = checkpoint.save_root(interrupted["cfg"])
    pool = tmp_path_factory.mktemp("pool")
    _hardlink_tree(source / "iter_0000004", pool / "iter_0000004")
    _hardlink_tree(source / "iter_0000008", pool / "iter_0000008",
                   drop=(checkpoint.META_FILE, "__1_0.distcp"))
    out = tmp_path_factory.mktemp("resharded")
    # saving in the background (Megatron's async writer): the fine-tune test loads the result
    cfg, plan = _config(corpus, out, "cluster.num_workers=1", f"checkpoint.load={pool}",
                        "checkpoint.async_save=true")
    final, messages = _launch(cfg, plan)
    rows = _rows(out)
    return {"cfg": cfg, "pool": pool, "final": final, "rows": rows, "curve": _curve(rows),
            "messages": messages}


@pytest.mark.slow
def test_resume_at_another_dp_size(uninterrupted, resharded):
    saved = checkpoint.read_meta(resharded["pool"] / "iter_0000004")
    assert saved.data_parallel_size == 2
    assert _train_iterations(resharded["rows"]) == [5, 6, 7, 8]
    assert resharded["final"]["iteration"] == ITERS
    # 4 microbatches on one rank vs 2 × 2 on two: only the summation order differs.
    ref, got = uninterrupted["curve"], resharded["curve"]
    for key in [5, 6, 7, 8, ("valid", 8)]:
        assert got[key] == pytest.approx(ref[key], abs=2e-4), key
    own = checkpoint.latest(checkpoint.save_root(resharded["cfg"]))[1]
    assert (own.iteration, own.data_parallel_size, own.world_size) == (8, 1, 1)


@pytest.mark.slow
def test_incomplete_checkpoint_is_ignored(resharded):
    # The newer directory was skipped with a warning and the run started from iteration 4
    # (rows 5..8 above; loading the broken one would have failed or started at 8).
    pool, messages = resharded["pool"], resharded["messages"]
    incomplete = (pool / "iter_0000008").resolve()
    assert any(f"{incomplete} has no ray_ppu_meta.json" in m for m in messages), messages
    assert any(f"starting from {(pool / 'iter_0000004').resolve()} at iteration 4" in m
               for m in messages), messages


@pytest.fixture(scope="module")
def finetuned(resharded, corpus, tmp_path_factory):
    """``checkpoint.finetune=true`` from the resharded run's final checkpoint (written in the
    background, at DP 1)."""
    saved = checkpoint.save_root(resharded["cfg"]) / "iter_0000008"
    out = tmp_path_factory.mktemp("finetuned")
    cfg, plan = _config(corpus, out, "cluster.num_workers=1", f"checkpoint.load={saved}",
                        "checkpoint.finetune=true", "training.train_iters=2")
    final, _ = _launch(cfg, plan)
    return {"cfg": cfg, "saved": saved, "final": final, "rows": _rows(out)}


@pytest.mark.slow
def test_finetune_loads_weights_only(uninterrupted, finetuned, corpus, tmp_path):
    train = [r for r in finetuned["rows"] if "lm_loss" in r]
    # Iteration and data position restart at 0; the schedule is fresh (warmup of 1
    # iteration: peak LR at iteration 1, not the saved run's final 3e-4).
    assert [(r["iteration"], r["consumed_samples"]) for r in train] == [(1, 4), (2, 8)]
    assert train[0]["lr"] == pytest.approx(2e-2)
    assert checkpoint.latest(checkpoint.save_root(finetuned["cfg"]))[1].iteration == 2
    # The first loss is the saved model's loss on global batch 0, measured in a separate
    # process that loads the checkpoint the way a full resume does.
    reference = checkpoint.save_root(uninterrupted["cfg"]) / "iter_0000008"
    saved_model_loss, reference_loss = _measured_losses([finetuned["saved"], reference], corpus,
                                                        tmp_path / "eval")
    assert train[0]["lm_loss"] == pytest.approx(saved_model_loss, abs=1e-5)
    # …which is a trained model's loss, far below the ~11.9 of fresh weights: the model after
    # 8 iterations, as the synchronously saved DP 2 reference holds it (the background writer
    # saved the state of its iteration, not a later one).
    assert train[0]["lm_loss"] < uninterrupted["curve"][1] - 1.0
    assert saved_model_loss == pytest.approx(reference_loss, abs=2e-4)
    saves = [r for r in _rows(finetuned["saved"].parents[2]) if r.get("event") == "checkpoint"]
    assert saves and all(0 < r["save_blocking_s"] <= r["checkpoint_time_s"] for r in saves)


def test_a_checkpoint_of_another_head_width_or_norm_is_refused(tmp_path):
    """The recorded model's weight shapes against the run's: Qwen3's q/k norms and its head
    width (kv_channels None means hidden / heads: compared as widths, not as settings)."""
    import dataclasses

    from ray_ppu.checkpoint.resume import ResumePoint, _check_model

    cfg = _cfg(tmp_path, "model.kv_channels=32", "model.qk_layernorm=true")
    meta = checkpoint.Meta(8, 64, 2, 1, 1, 1, 2, 8, "h", checkpoint.OPTIMIZER_FORMAT, 0.0,
                           model=dataclasses.asdict(cfg.model))
    _check_model(ResumePoint("iter_0000008", meta), cfg)  # the same model: nothing to say
    plain = dataclasses.asdict(dataclasses.replace(cfg.model, kv_channels=None,
                                                   qk_layernorm=False))
    with pytest.raises(ConfigError) as err:
        _check_model(ResumePoint("iter_0000008", dataclasses.replace(meta, model=plain)), cfg)
    assert "model.qk_layernorm: checkpoint False, this run True" in str(err.value)
    assert f"model.kv_channels: checkpoint {cfg.model.hidden_size // cfg.model.num_attention_heads}, this run 32" in str(err.value)


def test_a_moe_checkpoint_resumes_only_at_its_expert_layout(tmp_path):
    """The distributed optimizer's state of a MoE run is cut by EP × ETP too: a full resume at
    another expert layout is refused before anything loads, naming both layouts."""
    from ray_ppu.checkpoint.resume import ResumePoint

    cfg = _cfg(tmp_path, "model.preset=tiny-moe", "training.global_batch_size=4")
    plan = build_plan(cfg)
    path = tmp_path / "iter_0000008"
    path.mkdir()
    meta = checkpoint.Meta(8, 32, 2, 1, 1, 1, 2, 4, "h", checkpoint.OPTIMIZER_FORMAT, 0.0,
                           expert_model_parallel_size=2, model=dataclasses.asdict(cfg.model))
    (path / checkpoint.META_FILE).write_text(json.dumps(dataclasses.asdict(meta)))
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(ResumePoint(str(path), meta), [], None, None, plan, cfg)
    assert ("was saved at TP 1 × PP 1, experts EP 2 × ETP 1, this run is TP 1 × PP 1: the "
            "optimizer state (dp_reshardable) reshards across DP only") in str(err.value)


def _measured_losses(paths: list, corpus, out: Path) -> list[float]:
    """Each checkpoint's loss on global batch 0, measured here, without Ray (the runs saved
    them under Ray Train)."""
    return _losses_of_checkpoints_on_first_batch(
        [str(p) for p in paths], _overrides(corpus, out, "cluster.num_workers=1"))


def _losses_of_checkpoints_on_first_batch(paths: list[str], overrides: list[str]) -> list[float]:
    """A gloo world of 1 in this process: build the model like a worker, load each of ``paths``
    as a full resume would, and evaluate global batch 0 of the training data (forward only)."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from ray_ppu import devices
    from ray_ppu.model import parallel
    from ray_ppu.data import idxmap, inprocess
    from ray_ppu.model.gpt import build_model
    from ray_ppu.model.optim import build_optimizer
    from ray_ppu.train.schedule import evaluate, make_schedule

    cfg = absolute_paths(load(None, overrides))
    plan = dataclasses.replace(build_plan(cfg), eval_iters=1)  # one global batch
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    spec = idxmap.spec_for(cfg, plan)
    idxmap.datasets(spec)
    try:
        with devices.bound("cpu", 0):
            parallel.initialize(plan, cfg.training.seed)
            model, _ = build_model(cfg, plan, "cpu")
            optimizer, scheduler = build_optimizer(cfg, plan, model)
            losses = []
            try:
                for path in paths:
                    meta = checkpoint.read_meta(path)
                    checkpoint.load(checkpoint.ResumePoint(path, meta), model, optimizer,
                                    scheduler, plan, cfg)
                    batches = inprocess.microbatches(spec, 0, 1, plan.global_batch_size,
                                                     plan.micro_batch_size, 0, 1, "train")
                    result = evaluate(plan, model, make_schedule(plan, model, torch.device("cpu")),
                                      batches, torch.device("cpu"), 0)
                    losses.append(result["valid_lm_loss"])
            finally:
                parallel.destroy()
    finally:
        dist.destroy_process_group()
    return losses

