"""``benchmark.py moe``: tiny-moe on 2 CPU ranks at EP 1 and EP 2, its token dispatcher timed
inside the training processes; its bad inputs stopped before any rank starts; the device part
refused, saying so, where there is no GPU."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

BENCH = [sys.executable, str(REPO / "entrypoints" / "benchmark.py")]
# the test size: 2 microbatches of 32 tokens per rank per step (the default is 4 × 64)
SMALL = ["training.global_batch_size=4", "training.micro_batch_size=1", "training.seq_length=32"]
TIMED, WARMUP = 2, 2


@pytest.mark.slow
def test_moe_benchmark_times_the_dispatcher_at_ep1_and_ep2(corpus, tmp_path):
    out = tmp_path / "moe.json"
    proc = subprocess.run([*BENCH, "moe", "--iters", str(TIMED), "--corpus", corpus,
                           "--json", str(out), *SMALL], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    ep1, ep2 = figures["runs"]["ep1"], figures["runs"]["ep2"]
    assert (ep1["expert_model_parallel_size"], ep2["expert_model_parallel_size"]) == (1, 2)
    assert ep1["data_parallel_size"] == ep2["data_parallel_size"] == 2
    for run in (ep1, ep2):
        assert run["moe_layers"] == 2  # tiny-moe: every one of its 2 layers is routed
        assert len(run["losses"]) == WARMUP + TIMED
        assert run["tokens_per_s"] == pytest.approx(4 * 32 / run["step_time_s"])
        # both directions ran, inside the step
        assert run["dispatcher_forward_s"] > 0 and run["dispatcher_backward_s"] > 0
        assert 0 < run["dispatcher_s"] < run["step_time_s"]
        assert run["dispatcher_share"] == pytest.approx(run["dispatcher_s"] / run["step_time_s"])
        assert len(run["dispatcher_s_per_rank"]) == 2
    # EP 2 adds the all-to-alls over gloo to the same permutations: its dispatcher costs more
    assert ep2["dispatcher_s"] > ep1["dispatcher_s"]
    ratios = figures["ratios"]
    assert ratios["step_time_s"] == pytest.approx(ep2["step_time_s"] / ep1["step_time_s"])
    assert ratios["dispatcher_s"] == pytest.approx(ep2["dispatcher_s"] / ep1["dispatcher_s"])
    # same weights, same data: EP only regroups the experts, so the losses agree
    assert ep2["losses"] == pytest.approx(ep1["losses"], rel=1e-5)
    assert figures["losses_agree"] is True
    assert "EP2/EP1" in proc.stdout and "losses agree" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--corpus", "/nonexistent/corpus"], "/nonexistent/corpus.bin is not a file"),
    (["--iters", "0"], "--iters 0: at least 1"),
    # 3 experts cannot be split over 2 EP ranks: the EP 2 run's plan says so
    (["model.num_moe_experts=3"], "model.num_moe_experts 3 is not divisible by EP 2"),
])
def test_moe_benchmark_stops_on_bad_input_before_training(corpus, args, message, tmp_path):
    cmd = [*BENCH, "moe", *args, *([] if "--corpus" in args else ["--corpus", corpus])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and message in proc.stderr
    assert "torch.distributed" not in proc.stderr  # no rank was started


def test_device_moe_says_when_there_is_no_device(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the device benchmark would run")
    proc = subprocess.run([*BENCH, "device", "--part", "moe", "--dir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "needs a CUDA(-compatible) device" in proc.stderr
    assert not (tmp_path / "work").exists()  # stopped before building a corpus there
