"""entrypoints/pretrain.py end to end: a real job on its own embedded Ray, stopped as
``ray job stop`` stops it (SIGTERM: the workers save a checkpoint and stop)."""

import json
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


def test_stop_signal_ends_the_job_and_its_workers(corpus, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "entrypoints" / "pretrain.py"),
           "--config", str(REPO / "entrypoints" / "configs" / "demo.yaml"),
           f"data.data_path=[{corpus}]", f"output.dir={out}", "training.train_iters=100000",
           "training.log_interval=1", "training.seq_length=32", "training.eval_iters=0"]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
