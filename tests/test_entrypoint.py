"""entrypoints/pretrain.py end to end: a real job on its own embedded Ray, stopped as
``ray job stop`` stops it (SIGTERM: the workers save a checkpoint and stop)."""

import json
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def _is_train_worker(proc: psutil.Process) -> bool:
    try:
        return "RayTrainWorker" in " ".join(proc.cmdline())
    except psutil.Error:  # exited meanwhile
        return False


# What the demo's whole output (driver and workers) may hold, line by line: ours (the
# ray_ppu logger's time-stamped lines, the process-group line, the result), Ray's start and
# its worker-group placement. Anything else (a library warning, a traceback) fails the test.
ALLOWED = [re.compile(p) for p in (
    r"^(\(\w+ pid=\d+\) )?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \S",  # ray_ppu's lines
    r"^\(RayTrainWorker pid=\d+\) process group: gloo over \S+, 2 ranks$",
    r"^\{\"final\": ",
    r"\tWARNING authentication_token_setup\.py:\d+ -- Token authentication is enabled",
    r"\tINFO worker\.py:\d+ -- Started a local Ray instance\.",
    r"^\(TrainController pid=\d+\) (Requesting resources: |Attempting to start training worker "
    r"group of size 2 |Started training worker group of size 2:|- \(ip=\S+, pid=\d+\) "
    r"world_rank=\d)",
)]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


# Ray's, not the demo's: with another Ray on the machine (this test session's own), Ray
# Train's placement-group cleaner asks the state API for "the" local cluster, finds two and
# its monitor thread dies with a traceback. A user's demo beside another local Ray shows it too.
TWO_RAYS = "ConnectionError: Found multiple active Ray instances"


def _unexpected(output: str) -> list[str]:
    lines = [ANSI.sub("", line).rstrip() for line in output.splitlines()]
    if any(TWO_RAYS in line for line in lines):
        lines = [line for line in lines if not line.startswith("(PlacementGroupCleaner pid=")]
    return [line for line in lines if line and not any(p.search(line) for p in ALLOWED)]


@pytest.mark.faults  # 53 s of the default suite's 10-minute budget: `make test-faults`
def test_stop_signal_ends_the_job_and_its_workers(tmp_path):
    """The demo (its corpus built the way users build theirs, with Ray Data), stopped with
    SIGTERM after a few iterations; its whole output holds only allowed lines."""
    out = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "entrypoints" / "pretrain.py"),  # no --config: the demo
           f"output.dir={out}", "training.train_iters=100000",
           "training.log_interval=1", "training.seq_length=32", "training.eval_iters=0"]
    # the demo's relative corpus path lands under tmp_path
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           cwd=tmp_path)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert job.poll() is None, job.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no training progress within 240 s"
        time.sleep(1)
    workers = [p for p in psutil.Process(job.pid).children(recursive=True)]
    assert (out / "config.yaml").exists() and (out / "plan.json").exists()
    first = json.loads(metrics.read_text().splitlines()[0])
    assert {"iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "step_time_s",
            "tokens_per_s"} <= set(first)

    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=120) == 143  # saved and stopped (130: aborted)
    output = job.stdout.read()
    _, alive = psutil.wait_procs(workers, timeout=30)
    survivors = [p.pid for p in alive if _is_train_worker(p)]
    assert not survivors, f"Ray Train workers {survivors} outlived the job"
    assert (out / "tensorboard").is_dir()
    # The workers finished the iteration they were in and saved it: a complete checkpoint at
    # the iteration the job reports, and the log says how to resume.
    final = json.loads(next(line for line in output.splitlines()
                            if line.startswith('{"final"')))["final"]
    stopped = final["stopped_at"]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows if r.get("event") == "checkpoint"] == [stopped]
    assert max(r["iteration"] for r in rows if "lm_loss" in r) == stopped
    meta = json.loads((out / "ray_train" / "run" / f"iter_{stopped:07d}" /
                       "ray_ppu_meta.json").read_text())
    assert meta["iteration"] == stopped
    assert "run the same config again to resume" in output
    # the end of the run writes its report (rendered in a browser by tests/test_report.py)
    report = (out / "report.html").read_text()
    assert report.count("<svg") >= 3 and f"{stopped}" in report
    assert final["tflops_per_device"] > 0  # the result carries the last row
    # a CPU's peak is unknown: no MFU against a PPU's peak (it would read 0.0 %)
    assert final["mfu"] is None and "MFU n/a" in output and "MFU 0.0%" not in output
    assert _unexpected(output) == [], "\n".join(_unexpected(output))


def test_the_allow_list_catches_a_library_warning():
    noisy = ("2026-12-02 19:10:15,999 exported the Qwen2 tokenizer\n"
             "\x1b[36m(RayTrainWorker pid=7)\x1b[0m /venv/megatron/core/x.py:21: UserWarning: "
             "Apex is not installed. Falling back to Torch Norm\n"
             "[2026-12-02 19:07:26,239 E 4263 4263] core_worker.cc:2465: Actor with class name\n")
    assert _unexpected(noisy) == [
        "(RayTrainWorker pid=7) /venv/megatron/core/x.py:21: UserWarning: Apex is not "
        "installed. Falling back to Torch Norm",
        "[2026-12-02 19:07:26,239 E 4263 4263] core_worker.cc:2465: Actor with class name"]
    cleaner = "\n".join(f"(PlacementGroupCleaner pid=3) {line}" for line in (
        "Exception in thread PlacementGroupCleanerMonitor:", "Traceback (most recent call last):"))
    assert len(_unexpected(cleaner)) == 2  # only beside another Ray is its traceback Ray's
    assert _unexpected(cleaner + f"\n(PlacementGroupCleaner pid=3) {TWO_RAYS}: {{'a', 'b'}}") == []
