"""Fault tolerance under the real Ray Train V2 (``make test-faults``; minutes each).

On a simulated multi-node cluster (``ray.cluster_utils.Cluster`` of one-PPU nodes, in a
subprocess: ``tests/faults/scenarios.py recovery`` / ``elastic``, each with its own Ray):

* node loss: a PPU node hosting a worker is removed after the checkpoint at 4; Ray Train
  restarts the group on a spare node, which resumes exactly (losses equal to 1e-6).
* elastic: num_workers (2, 4) at TP 2 starts on 3 nodes (DP 1 and a spare worker), grows to
  4 when a node joins, shrinks back when one is lost, each resized group restoring the
  previous one's in-memory snapshots resharded across DP; same samples, same losses (2e-4).

On the session's single-node cluster: a worker SIGKILLed in the middle of a save, and a
checkpoint disk (a tmpfs) that fills up. Every run must finish on exactly the uninterrupted
run's samples (by id, from the sample log) and losses.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

# the checkpoint tests' run settings, metrics readers and worker finder (their reference
# run is the session fixture `uninterrupted`, conftest.py)
from test_checkpoint import _config, _curve, _rows, launch_while, run_workers

REPO = Path(__file__).resolve().parents[1]
ITERS, GBS = 8, 4


def scenario(tmp_path_factory, corpus, name: str, *flags: str) -> dict:
    """Run ``tests/faults/scenarios.py <name> <flags>`` (a scenario on its own simulated
    cluster, in a subprocess); returns its JSON result."""
    work = tmp_path_factory.mktemp(name)
    result = work / "result.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "faults" / "scenarios.py"), name, *flags,
         "--dir", str(work), "--corpus", corpus, "--json", str(result), "--timeout", "600"],
        capture_output=True, text=True, timeout=660)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout)  # the figures (pytest -s shows them)
    return json.loads(result.read_text())


@pytest.fixture(scope="module")
def node_loss(corpus, tmp_path_factory):
    return scenario(tmp_path_factory, corpus, "recovery", "--reference")


@pytest.mark.slow
@pytest.mark.faults
def test_node_loss_resumes_exactly(node_loss):
    res, figures = node_loss, node_loss["figures"]
    assert "removed" in res["events"], res["events"]
    ref_rows, rows = _rows(res["reference_dir"]), _rows(res["dir"])
    # The run finished, at the same size and place as the uninterrupted one.
    assert res["final"]["iteration"] == ITERS
    assert res["final"]["consumed_samples"] == ITERS * GBS
    # The restarted group's streams started at the in-memory snapshot it restored (snapshots
    # every iteration; the surviving node's keeper holds the lost node's replica), at or after
    # the checkpoint at 4 the node was removed after, not from scratch.
    record = res["stream_start"]
    start = record["iteration"]
    assert start >= 4 and record["checkpoint"].startswith("memory:"), record
    assert figures["restored_from"] == "memory" and figures["resumed_from_iteration"] == start
    # Every iteration 1..8 is logged with consumed_samples = iteration × 4; rows logged before
    # the loss go up to some iteration, then the restarted group's rows begin at start + 1.
    train = [r for r in rows if "lm_loss" in r]
    assert {r["iteration"] for r in train} == set(range(1, ITERS + 1))
    assert all(r["consumed_samples"] == r["iteration"] * GBS for r in train), train
    after = [r["iteration"] for r in train if r["time"] > res["events"]["removed"]]
    assert after == list(range(start + 1, ITERS + 1)), after
    before = [r["iteration"] for r in train if r["time"] <= res["events"]["removed"]]
    assert before == list(range(1, len(before) + 1)) and len(before) >= 4, before
    # fp32 on CPU, same layout: the iterations after the loss are the uninterrupted ones.
    ref, got = _curve(ref_rows), _curve(rows)
    for key in [5, 6, 7, 8, ("valid", 8)]:
        assert got[key] == pytest.approx(ref[key], abs=1e-6), key
    assert ref[8] < ref[1] - 0.5  # and the reference did train
    assert figures["iterations_lost"] <= 1  # snapshots every iteration


@pytest.mark.slow
@pytest.mark.faults
def test_drained_node_is_saved_before_it_goes(node_loss, corpus, tmp_path_factory):
    """A preemption notice (Ray's drain API, as a spot reclaim sends) for a node hosting a
    worker: the run saves a checkpoint at the end of its iteration and trains on; when the node
    then goes, the restarted group resumes from that checkpoint (or a newer snapshot), not the
    last periodic one."""
    from ray_ppu.monitor.metrics_log import read_sample_log

    res = scenario(tmp_path_factory, corpus, "recovery", "--drain")
    events, figures = res["events"], res["figures"]
    saved_at = events["drain_saved_iteration"]
    assert events["drained"] < events["drain_saved"] < events["removed"], events
    rows = _rows(res["dir"])
    asked = [r for r in rows if r.get("event") == "interrupted"]
    assert [r["reason"] for r in asked] == ["node drain"] and asked[0]["iteration"] <= saved_at
    # Resumed from the drain's checkpoint or a newer in-memory snapshot: lost at most what
    # was trained between the last of them and the node going, same samples and losses.
    assert res["stream_start"]["iteration"] >= saved_at
    assert res["stream_start"]["iteration"] == figures["resumed_from_iteration"]
    assert figures["iterations_lost"] <= 1
    assert res["final"]["iteration"] == ITERS
    assert read_sample_log(res["dir"]) == {i: list(range((i - 1) * GBS, i * GBS))
                                           for i in range(1, ITERS + 1)}
    ref, got = _curve(_rows(node_loss["reference_dir"])), _curve(rows)
    for key in [*range(1, ITERS + 1), ("valid", 4), ("valid", 8)]:
        assert got[key] == pytest.approx(ref[key], abs=1e-6), key


@pytest.fixture(scope="module")
def elastic_run(corpus, tmp_path_factory):
    """``scenarios.py elastic --reference``: a fixed 2-worker run, then num_workers (2, 4) at
    TP 2 on 3 one-PPU nodes: 3 workers (DP 1 + a spare), grown to 4 (DP 2) when a node joins
    after the checkpoint at 2, back to 3 when a node hosting a worker is removed after the
    4-worker group's first checkpoint."""
    return scenario(tmp_path_factory, corpus, "elastic", "--reference")


@pytest.mark.slow
@pytest.mark.faults
def test_elastic_group_shrinks_and_grows(elastic_run):
    from ray_ppu.monitor.metrics_log import read_sample_log

    res = elastic_run
    events = res["events"]
    assert "added" in events and "removed" in events, events
    rows, ref_rows = _rows(res["dir"]), _rows(res["reference_dir"])
    train = [r for r in rows if "lm_loss" in r]
    shapes = []  # (world size, DP) of each group, in order
    for r in train:
        if not shapes or shapes[-1] != (r["world_size"], r["data_parallel_size"]):
            shapes.append((r["world_size"], r["data_parallel_size"]))
    # 3 workers: 2 train (TP 2 × DP 1) + 1 spare; 4: TP 2 × DP 2; 3 again after the loss.
    assert shapes == [(2, 1), (4, 2), (2, 1)], shapes
    grown = [r for r in train if r["world_size"] == 4]
    assert all(r["time"] > events["added"] for r in grown)
    final = res["final"]
    assert (final["iteration"], final["world_size"], final["spare_workers"]) == (12, 2, 1)
    # Only the node loss is a failure (the grow is Ray Train's resize), reported as a restart.
    restarts = [r for r in rows if r.get("event") == "restart"]
    assert len(restarts) == 1 and restarts[0]["time"] > events["removed"], restarts
    assert final["restarts"] == 1
    # Both resized groups restored the previous group's in-memory snapshots, resharded across
    # DP (1 → 2 → 1), not a checkpoint: memory:<nodes> is where their state came from.
    starts = [r for r in rows if r.get("event") == "start"]
    assert [r["resumed_from"] is None for r in starts] == [True, False], starts
    assert starts[1]["resumed_from"].startswith("memory:"), starts
    assert restarts[0]["resumed_from"].startswith("memory:"), restarts
    assert restarts[0]["restored_from"] == "memory", restarts
    # The same samples as the fixed run, by id, and the same losses (DP/TP summation order).
    expected = {i: list(range((i - 1) * GBS, i * GBS)) for i in range(1, 13)}
    assert read_sample_log(res["dir"]) == read_sample_log(res["reference_dir"]) == expected
    ref, got = _curve(ref_rows), _curve(rows)
    for key in [*range(1, 13), ("valid", 4), ("valid", 8), ("valid", 12)]:
        assert got[key] == pytest.approx(ref[key], abs=2e-4), key


# ---------------------------------------------------------------------------------------------
# On the session's single-node cluster: a worker killed during a save; a full checkpoint disk
# ---------------------------------------------------------------------------------------------
SAVE_EVERY_2 = ("cluster.num_workers=2", "cluster.max_failures=1", "checkpoint.save_interval=2")
EXPECTED_IDS = {i: list(range((i - 1) * GBS, i * GBS)) for i in range(1, ITERS + 1)}


def _assert_same_training(rows, reference):
    """Every iteration's loss (the last row of an iteration counts) and both validations equal
    the uninterrupted run's: fp32 on CPU, same layout."""
    ref, got = reference["curve"], _curve(rows)
    for key in [*range(1, ITERS + 1), ("valid", 4), ("valid", 8)]:
        assert got[key] == pytest.approx(ref[key], abs=1e-6), key


@pytest.mark.slow
@pytest.mark.faults
def test_worker_killed_during_a_save(ray_cluster, uninterrupted, corpus, tmp_path):
    """SIGKILL a worker while the checkpoint at 4 is being written: that save never counts,
    the group restarts from the one at 2, removes the partial directory, and the run ends
    exactly like the uninterrupted one, on the same samples."""
    from ray_ppu import checkpoint
    from ray_ppu.monitor.metrics_log import read_sample_log

    out = tmp_path / "killed_in_save"
    cfg, plan = _config(corpus, out, *SAVE_EVERY_2)
    partial = checkpoint.save_root(cfg) / "iter_0000004"
    killed = []

    def kill_in_save(stop) -> None:
        while not stop.is_set():
            if partial.is_dir() and not (partial / checkpoint.META_FILE).exists():
                workers = run_workers(out)
                if workers:
                    workers[-1].kill()
                    killed.append(not (partial / checkpoint.META_FILE).exists())
                    return
            time.sleep(0.005)

    final, _ = launch_while(cfg, plan, kill_in_save)
    assert killed == [True], "no worker was killed while the save was unfinished"
    rows = _rows(out)
    restart = [r for r in rows if r.get("event") == "restart"]
    assert [(r["iteration"], r["resumed_from"]) for r in restart] == [(2, "iter_0000002")]
    assert final["iteration"] == ITERS and final["restarts"] == 1
    _assert_same_training(rows, uninterrupted)
    assert read_sample_log(out) == EXPECTED_IDS
    # The interrupted save is gone; the one at 4 was written again, complete.
    names = sorted(p.name for p in checkpoint.checkpoint_dirs(checkpoint.save_root(cfg)))
    assert all(checkpoint.read_meta(checkpoint.save_root(cfg) / n) for n in names), names
    assert any(n.startswith("iter_0000008") for n in names), names


@pytest.fixture
def small_disk():
    """``mount(path)``: a 1 GiB tmpfs there (the checkpoint disk), unmounted after the test;
    skipped where mounting is not allowed."""
    mounted = []

    def mount(path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}): needs root")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.slow
@pytest.mark.faults
def test_full_checkpoint_disk(ray_cluster, uninterrupted, corpus, small_disk, tmp_path):
    """The checkpoint disk fills up after the save at 2: the next save fails on every rank,
    is removed, logged and counted, training goes on unchanged; once space is freed the
    following save succeeds."""
    import os

    from ray_ppu import checkpoint
    from ray_ppu.monitor.metrics_log import read_sample_log

    out = tmp_path / "full_disk"
    cfg, plan = _config(corpus, out, *SAVE_EVERY_2)
    root = small_disk(checkpoint.save_root(cfg))  # the run's checkpoints live on a small disk
    filler = root / "filler"
    events = {}

    def fill_then_free(stop) -> None:
        while not stop.is_set() and not (root / "iter_0000002" / checkpoint.META_FILE).exists():
            time.sleep(0.01)
        if stop.is_set():
            return
        free = os.statvfs(root)
        # all but 1 MiB: Ray Train's own small state files still fit, a checkpoint does not
        size = free.f_bavail * free.f_frsize - (1 << 20)
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, size)
        events["filled"] = time.time()
        while not stop.is_set():
            if any(r.get("event") == "checkpoint_failed" for r in _rows(out)):
                filler.unlink()
                events["freed"] = time.time()
                return
            time.sleep(0.05)

    final, _ = launch_while(cfg, plan, fill_then_free)
    assert "filled" in events and "freed" in events, events
    rows = _rows(out)
    failed = [r for r in rows if r.get("event") == "checkpoint_failed"]
    saved = [r["iteration"] for r in rows if r.get("event") == "checkpoint"]
    assert failed and all("No space left on device" in r["error"] for r in failed), failed
    assert final["checkpoint_failures"] == len(failed) and final["restarts"] == 0
    assert saved[0] == 2 and saved[-1] == ITERS and not set(saved) & {r["iteration"] for r in failed}
    # No partial directory of a failed save is left; what is there is complete.
    names = [p.name for p in checkpoint.checkpoint_dirs(root)]
    assert names and all(checkpoint.read_meta(root / n) for n in names), names
    _assert_same_training(rows, uninterrupted)
    assert read_sample_log(out) == EXPECTED_IDS
