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


def _unexpected(output: str) -> list[str]:
    """Lines not allowed. (Beside another local Ray, Ray Train's placement-group cleaner used
    to die with a "Found multiple active Ray instances" traceback: a run now pins its own
    Ray's state API, ray_ppu.launch.ray_connect, and that traceback is not allowed.)"""
    lines = [ANSI.sub("", line).rstrip() for line in output.splitlines()]
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
        "Exception in thread PlacementGroupCleanerMonitor:", "Traceback (most recent call last):",
        "ConnectionError: Found multiple active Ray instances: {'a', 'b'}"))
    assert len(_unexpected(cleaner)) == 3


@pytest.mark.faults  # two launches at once: ~75 s on 2 cores
def test_two_runs_at_once_each_talk_to_their_own_ray_with_clean_logs(tmp_path, qwen2_tokenizer_dir):
    """An SFT run and a vision-language run started together on one machine (beside this
    session's Ray when it has one): each pins its own Ray's state API, so neither prints
    Ray's "multiple active Ray instances" traceback; both finish, and both whole outputs (a
    file, as a Ray job's log is) hold only allowed lines, without colour codes. The SFT
    corpus's two bad records are named in the log, and listed under its run directory."""
    from ray_ppu.tools.shapes import write_corpus

    records = [{"instruction": f"What is {i} + 1?", "output": str(i + 1)} for i in range(60)]
    lines = [json.dumps(r) for r in records]
    lines[4], lines[9] = '{"instruction": "broken",', json.dumps({"instruction": "no output"})
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    shapes = write_corpus(tmp_path / "shapes", train=32, valid=8, heldout=0)
    common = ["training.train_iters=4", "training.lr_warmup_iters=1", "training.eval_iters=0",
              f"data.tokenizer={qwen2_tokenizer_dir}", "output.tensorboard=false",
              "output.report=false"]
    runs = {
        "sft": ["data.dataset=sft", f"data.data_path=[{tmp_path / 'train.jsonl'}]",
                "training.seq_length=64", "training.micro_batch_size=2",
                "training.global_batch_size=4", "cluster.device=cpu",
                "training.precision=fp32", "model.make_vocab_size_divisible_by=64"],
        "vl": ["--config", str(REPO / "entrypoints" / "configs" / "demo-vl.yaml"),
               f"data.data_path=[{shapes['train']}]", "data.valid_data_path=[]",
               f"data.image_root={shapes['image_root']}"],
    }
    jobs = {}
    for name, args in runs.items():
        log = open(tmp_path / f"{name}.log", "w")
        jobs[name] = (subprocess.Popen(
            [sys.executable, str(REPO / "entrypoints" / "pretrain.py"), *args, *common,
             f"output.dir={tmp_path / name}"], stdout=log, stderr=subprocess.STDOUT,
            cwd=tmp_path), log)
    for name, (job, log) in jobs.items():
        assert job.wait(timeout=400) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        log.close()
    for name in runs:
        output = (tmp_path / f"{name}.log").read_text()
        assert "\x1b[" not in output, "colour codes in a log file"
        assert "multiple active Ray instances" not in output
        assert _unexpected(output) == [], "\n".join(_unexpected(output))
        final = json.loads(next(line for line in output.splitlines()
                                if line.startswith('{"final"')))["final"]
        assert final["iteration"] == 4, (name, final)
    sft = (tmp_path / "sft.log").read_text()
    assert f"malformed_json × 1: {tmp_path / 'train.jsonl'}: line 5: invalid JSON" in sft
    assert f"missing_fields × 1: {tmp_path / 'train.jsonl'}: line 10: " in sft
    listed = (tmp_path / "sft" / "bad_records" / "train.jsonl").read_text().splitlines()
    assert [json.loads(line)["reason"] for line in listed] == ["malformed_json", "missing_fields"]
