"""Fault tolerance under the real Ray Train V2: losing a whole node.

The scenario (``entrypoints/benchmark.py recovery``) runs in a subprocess because it needs its
own Ray: a ``ray.cluster_utils.Cluster`` of simulated nodes (a CPU-only head and three nodes
with one PPU each, one spare), not the session's single-node ``ray_cluster``. In it, the tiny
model trains on 2 workers (DP 2) for 8 iterations, saving every 2: first uninterrupted (the
reference), then again while a thread removes a PPU node hosting a worker (its raylet and the
worker on it die) as soon as the checkpoint at iteration 4 is complete. Ray Train's
FailureConfig restarts the group at the same size on the surviving nodes; the group loads the
latest complete checkpoint and the data streams start right after it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_checkpoint import _curve, _rows  # same metrics.jsonl readers as the checkpoint tests

REPO = Path(__file__).resolve().parents[1]
ITERS, GBS = 8, 4


@pytest.fixture(scope="module")
def node_loss(corpus, tmp_path_factory):
    work = tmp_path_factory.mktemp("node_loss")
    result = work / "result.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "entrypoints" / "benchmark.py"), "recovery", "--reference",
         "--dir", str(work), "--corpus", corpus, "--json", str(result), "--timeout", "540"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout)  # the recovery figures (pytest -s shows them)
    return json.loads(result.read_text())


@pytest.mark.slow
@pytest.mark.faults
def test_node_loss_resumes_exactly(node_loss):
    res, figures = node_loss, node_loss["figures"]
    assert "removed" in res["events"], res["events"]
    ref_rows, rows = _rows(res["reference_dir"]), _rows(res["dir"])
    # The run finished, at the same size and place as the uninterrupted one.
    assert res["final"]["iteration"] == ITERS
    assert res["final"]["consumed_samples"] == ITERS * GBS
    # The restarted group's streams started at the checkpoint it loaded (an even iteration ≥ 4:
    # save_interval 2), not from scratch.
    record = res["stream_start"]
    start = record["iteration"]
    assert start >= 4 and start % 2 == 0 and record["checkpoint"].endswith(f"iter_{start:07d}")
    assert figures["resumed_from_iteration"] == start
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
    assert figures["iterations_lost"] <= 2  # at most the save interval
