"""The tiny preset trained under the real Ray Train TorchTrainer on simulated PPU resources.

Every Ray run here is a real worker group: Ray Train places one worker per PPU unit, the
per-node readers stream the idxmap samples, Megatron-Core trains over gloo with the CPU shim.
The reference they are held to is the same loop under plain torchrun (one process, DP 1).
"""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ray_ppu.config.loader import load
from ray_ppu.errors import ClusterError
from ray_ppu.launch.launcher import launch
from ray_ppu.plan import build_plan
from ray_ppu.launch.output import absolute_paths, prepare_output

from conftest import REPO, SIMULATED_PPUS

pytestmark = pytest.mark.slow

ITERS = 8


def overrides(corpus, out, *extra):
    return [
        f"data.data_path=[{corpus}]", f"output.dir={out}", "output.tensorboard=false",
        "cluster.device=cpu", "training.precision=fp32",
        f"training.train_iters={ITERS}", "training.global_batch_size=4", "training.micro_batch_size=1",
        "training.seq_length=32", "training.lr=2e-2", "training.min_lr=3e-4",
        "training.lr_warmup_iters=1", "training.log_interval=1",
        # validation after iterations 4 and 8 on the 20 % validation share (tens of documents)
        "training.eval_interval=4", "training.eval_iters=1", "data.split=80,20,0",
        # 151936 is a multiple of 64 × TP for TP ≤ 2: the padded vocabulary, hence the
        # initial weights, are the same at TP 1 and TP 2.
        "model.make_vocab_size_divisible_by=64",
        # no in-memory snapshots unless a test is about them (test_snapshots, the restores in
        # test_checkpoint / test_watchdog): on 2 cores their copies slow every run down
        "checkpoint.memory_interval=0",
        *extra,
    ]


def losses(out):
    """Training losses per iteration, then the validation losses (iterations 4 and 8)."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    train = [r for r in rows if "lm_loss" in r]
    valid = [r for r in rows if "valid_lm_loss" in r]
    assert [r["iteration"] for r in train] == list(range(1, ITERS + 1))
    assert [r["iteration"] for r in valid] == [4, 8]
    assert all(abs(r["valid_ppl"] - math.exp(r["valid_lm_loss"])) < 1e-6 * r["valid_ppl"] for r in valid)
    return [r["lm_loss"] for r in train] + [r["valid_lm_loss"] for r in valid]


def train_on_ray(corpus, out, *extra):
    cfg = absolute_paths(load(None, overrides(corpus, out, *extra)))
    plan = build_plan(cfg)
    prepare_output(cfg, plan)
    final = launch(cfg, plan)
    assert final["iteration"] == ITERS and final["consumed_samples"] == ITERS * 4
    return losses(out)


def train_with_torchrun(corpus, out, nproc, *extra, variants=None):
    """The same loop under plain torchrun (entrypoints/torchrun_pretrain.py), no Ray.
    ``variants``: {name: overrides} trained one after another in the one launch (each into
    ``out/name``); returns {name: losses}."""
    script = [str(REPO / "entrypoints" / "torchrun_pretrain.py")]
    if variants is not None:
        spec = Path(out) / "variants.json"
        spec.parent.mkdir(parents=True, exist_ok=True)
        spec.write_text(json.dumps(variants))
        script += ["--variants", str(spec)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           *script, *overrides(corpus, out, f"cluster.num_workers={nproc}", *extra)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if variants is not None:
        return {name: losses(Path(out) / name) for name in variants}
    return losses(out)


def run_training(root: Path, corpus) -> dict:
    """The module's two runs, prelaunched (tests/prelaunch.py): ``references``, one process
    under plain torchrun, one launch: the tiny model and tiny-moe (4 experts, top 2), each at
    TP 1, PP 1, DP 1 (EP 1), four microbatches per iteration; and ``moe``, tiny-moe under Ray
    Train (test_moe_at_tp2_ep2_on_ray_trains_like_one_process)."""
    corpus = str(corpus)
    curves = train_with_torchrun(corpus, root / "tp1dp1", 1, variants={
        "dense": [], "moe": ["model.preset=tiny-moe"]})
    references = {"curves": curves, "moe_rows": moe_rows(root / "tp1dp1" / "moe")}
    out = root / "moe_tp2_ep2"
    curve = train_on_ray(corpus, out, "model.preset=tiny-moe", "cluster.num_workers=2",
                         "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                         "parallel.expert_model_parallel_size=2",
                         "parallel.expert_tensor_parallel_size=1",
                         "checkpoint.enabled=false")  # nothing reads its checkpoint
    return {"references": references, "moe": {"curve": curve, "rows": moe_rows(out)}}


@pytest.fixture(scope="module")
def training_runs(prelaunched):
    return prelaunched.result("training_runs")


@pytest.fixture(scope="module")
def references(training_runs):
    return training_runs["references"]


@pytest.fixture(scope="module")
def baseline(references):
    """The dense reference every Ray Train run here is held to (so the Ray runs also show that
    torchrun and Ray Train train alike; torchrun at TP 2: tests/test_options.py's one torchrun
    launch)."""
    return references["curves"]["dense"]


def assert_falls(curve):
    train, valid = curve[:ITERS], curve[ITERS:]
    assert train[-1] < train[0] - 0.5, curve
    assert valid[1] < valid[0], curve  # held-out loss improves between the two passes


def test_dp2_on_ray_trains_like_dp1_on_torchrun(baseline, uninterrupted):
    """Ray Train at DP 2 and plain torchrun at DP 1 give the same losses: the same samples in
    the same order, only the DP summation order differs."""
    # the checkpoint tests' reference run: these settings on 2 workers (and saving every 4)
    dp2 = losses(uninterrupted["cfg"].output.dir)
    assert uninterrupted["final"]["consumed_samples"] == ITERS * 4
    assert_falls(dp2)
    # Same global batch: 2 ranks × 2 microbatches vs 1 rank × 4; only summation order differs.
    # The validation losses match too: the same held-out samples whatever the DP size.
    assert dp2 == pytest.approx(baseline, abs=2e-4)


def test_a_launch_starts_no_ray_data_manager(uninterrupted):
    """Ray Train's datasets callback is left out (ray_ppu.launch.launcher._Trainer): the readers feed
    the ranks, and its DatasetManager actor would be a process more at every group start."""
    assert uninterrupted["dataset_managers_started"] == 0


def moe_rows(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "moe_expert_load_max_over_mean" in r]


@pytest.fixture(scope="module")
def moe_baseline(references):
    """tiny-moe in one process under plain torchrun: EP 1, TP 1, DP 1."""
    return references["curves"]["moe"], references["moe_rows"]


def test_moe_at_tp2_ep2_on_ray_trains_like_one_process(moe_baseline, training_runs):
    """Ray Train, 2 workers: attention at TP 2 with sequence parallelism, the 4 experts split
    by EP 2 (2 whole experts a rank, ETP 1), tokens exchanged by all-to-all. Same samples,
    same initial weights (experts are drawn per global expert): the losses are the
    one-process run's. Tolerance 2e-4, as for the dense layouts: only summation order
    differs (measured: ≤ 1e-6 after 8 iterations); a token routed to another expert by a
    tie would move a loss by far more, and the routing statistics would differ."""
    moe, rows = training_runs["moe"]["curve"], training_runs["moe"]["rows"]
    reference, reference_rows = moe_baseline
    assert_falls(moe)
    assert moe == pytest.approx(reference, abs=2e-4)
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1))
    for ours, theirs in zip(rows, reference_rows):
        # every rank's routers counted (tokens per expert summed over the group): the same
        # busiest-expert share as the one process, and Megatron's balancing loss (1 = even)
        assert 1.0 <= ours["moe_expert_load_max_over_mean"] <= 4 / 2  # E / top-k at worst
        assert ours["moe_expert_load_max_over_mean"] == pytest.approx(
            theirs["moe_expert_load_max_over_mean"], abs=1e-9)
        assert ours["moe_load_balancing_loss"] == pytest.approx(
            theirs["moe_load_balancing_loss"], rel=1e-4)
        assert 0.99 < ours["moe_load_balancing_loss"] < 2.0


# TP 2 of the dense model: under torchrun in tests/test_options.py (the "tp2" variant against
# "plain"), under Ray Train in tests/test_sft_training.py (packed rows at TP 2, resumed exactly).
# PP 2 under Ray Train: tests/test_hf.py::test_finetune_from_hf_under_ray_train (its first
# loss is transformers' on the same batch, then training and validation losses fall); PP 2's
# losses equal the plain run's: tests/test_options.py.


def test_too_few_ppus_fails_at_once(ray_cluster, corpus, tmp_path):
    workers = SIMULATED_PPUS * 2
    cfg = absolute_paths(load(None, overrides(corpus, tmp_path, f"cluster.num_workers={workers}",
                                              f"training.global_batch_size={workers}")))
    start = time.monotonic()
    with pytest.raises(ClusterError, match=rf"needs {workers} workers × 1 PPU = {workers} PPU, "
                                           rf"but the cluster has {SIMULATED_PPUS}"):
        launch(cfg, build_plan(cfg))
    assert time.monotonic() - start < 10  # an error, not a wait for placement
