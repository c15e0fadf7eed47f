"""Experiment trackers fed from a run's metrics.jsonl (ray_ppu.monitor.trackers).

A real MLflow tracking server (``mlflow server``, sqlite store) on 127.0.0.1, started by the
test; rows are appended to a real metrics.jsonl as rank 0 appends them (training and
validation rows, a restart that trains two iterations again), and read back with MLflow's own
client: parameters once, every row at its step once, events, artifacts, one run across a
resume. The server is killed mid-run and started again: the rows logged meanwhile arrive.
W&B in offline mode: its run file, read with wandb's own reader, holds every row.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ray_ppu.config.loader import load
from ray_ppu.launch.output import prepare_output
from ray_ppu.monitor import trackers
from ray_ppu.plan import build_plan
from ray_ppu.util.net import free_port


class _Server:
    """``mlflow server`` on 127.0.0.1 with a sqlite store under ``root``."""

    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, free_port("127.0.0.1"), None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import os
        import urllib.request

        # lean: one web worker, and no job runner (MLflow 3 otherwise starts huey consumer
        # pools for its GenAI jobs beside a SQL store: ~8 processes importing mlflow)
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
               "MLFLOW_SERVER_JOB_ENABLE_PERIODIC_TASKS": "false"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port",
             str(self.port), "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts"), "--workers", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env=env)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=1)
                return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("mlflow server did not start")

    def stop(self) -> None:
        import os
        import signal

        os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its workers: all ours
        self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("mlflow")
    srv = _Server(tmp_path_factory.mktemp("mlflow"))
    srv.start()
    yield srv
    srv.stop()


def _run(out: Path, *extra: str):
    cfg = load(None, [f"output.dir={out}", "training.train_iters=20", "data.data_path=[corpus]",
                      *extra])
    plan = build_plan(cfg)
    prepare_output(cfg, plan)
    return cfg, plan


def _append(out: Path, *rows: dict) -> None:
    with open(out / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _train(i: int) -> dict:
    return {"iteration": i, "lm_loss": 10.0 - i / 4, "lr": 1e-4, "grad_norm": 1.5,
            "tokens_per_s": 1000.0 + i, "time": time.time()}


def _wait_sent(feed, rows: int, timeout: float = 30) -> None:
    """Until every tracker of ``feed`` has sent ``rows`` items (the tail reads every second)."""
    _wait(lambda: all(s.sent >= rows for s in feed.senders), timeout)


def _wait(condition, timeout: float = 30) -> None:
    """Until ``condition()`` holds (polled every 0.1 s), or ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)


def test_mlflow_gets_params_every_row_once_events_artifacts_and_one_run_across_a_resume(
        server, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setattr(trackers, "_BACKOFF_S", (0.5,))  # retries while the server is down
    out = tmp_path / "run"
    cfg, plan = _run(out, "output.trackers=[mlflow]", f"output.mlflow_tracking_uri={server.uri}")
    client = MlflowClient(server.uri)
    with trackers.feeding(cfg, plan) as feed:
        _append(out, *(_train(i) for i in range(1, 6)),
                {"iteration": 5, "valid_lm_loss": 8.5, "valid_ppl": 4900.0},
                {"event": "checkpoint", "iteration": 5, "path": "iter_0000005"},
                _train(6),
                # a worker lost: the group restores 5 and trains 6 again (already sent)
                {"event": "restart", "iteration": 5, "resumed_from": "memory:iter_5"}, _train(6))
        _wait_sent(feed, 1 + 6 + 1 + 2)  # parameters, 6 training rows, 1 validation, 2 events
        server.stop()  # down: rows are kept, the run goes on
        _append(out, _train(7), _train(8))
        _wait(lambda: all(s.failures and s.queued.get("train", 0) >= 8 for s in feed.senders))
        server.start()
        summary = feed.finish("FINISHED", [out / "config.yaml", out / "plan.json"])
    run_id = summary["mlflow"]["run_id"]
    assert summary["mlflow"]["dropped"] == 0
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["training.train_iters"] == "20"
    assert run.data.params["plan.global_batch_size"] == str(plan.global_batch_size)
    history = client.get_metric_history(run_id, "train/lm_loss")
    assert sorted(m.step for m in history) == list(range(1, 9))  # each once, 7 and 8 too
    assert {m.step: m.value for m in history}[7] == _train(7)["lm_loss"]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "valid/lm_loss")] == [
        (5, 8.5)]
    assert "trackers_dropped" not in (out / "metrics.jsonl").read_text()
    assert "event.00000005.restart" in run.data.tags
    assert "memory:iter_5" in run.data.tags["event.00000005.restart"]
    assert {a.path for a in client.list_artifacts(run_id)} == {"config.yaml", "plan.json"}

    # the job resubmitted: the same run continues; rows it already has are not sent again
    with trackers.feeding(cfg, plan) as feed:
        _append(out, {"event": "start", "iteration": 8}, _train(8), _train(9), _train(10))
        summary = feed.finish("FINISHED", [])
    assert summary["mlflow"]["run_id"] == run_id
    assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [run_id]
    steps = [m.step for m in client.get_metric_history(run_id, "train/lm_loss")]
    assert sorted(steps) == list(range(1, 11))
    state = json.loads((out / trackers.STATE_FILE).read_text())["mlflow"]
    assert state["last_steps"] == {"train": 10, "valid": 5}
    assert state["events_sent"] == 3  # checkpoint, restart, then this start: none twice
    assert summary["mlflow"]["sent"] == 2 + 1 + 1  # rows 9 and 10, the start event, the end


def test_a_tracker_that_never_answers_costs_the_run_nothing(tmp_path, monkeypatch):
    """Down from the start (nothing listens on its port): the feed starts at once, takes every
    row without blocking, and at the end counts them dropped, in an event row of the run."""
    pytest.importorskip("mlflow")
    monkeypatch.setattr(trackers, "_BACKOFF_S", (0.2,))
    monkeypatch.setattr(trackers, "FLUSH_S", 1.0)
    out = tmp_path / "run"
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    cfg, plan = _run(out, "output.trackers=[mlflow]", f"output.mlflow_tracking_uri={dead}")
    started = time.monotonic()
    with trackers.feeding(cfg, plan) as feed:
        _append(out, *(_train(i) for i in range(1, 4)))
        summary = feed.finish("FINISHED", [out / "plan.json"])
    assert time.monotonic() - started < 15
    assert summary["mlflow"] == {"run_id": None, "sent": 0, "dropped": 1 + 3 + 1}
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "trackers_dropped" and last["dropped"] == {"mlflow": 5}


def test_wandb_offline_history_holds_every_row(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    # lean: no system metrics, machine facts, requirements, git or code capture (the rows are
    # what the test reads); each is a process or a scan W&B otherwise starts with the run
    for key, value in {"WANDB__DISABLE_STATS": "true", "WANDB__DISABLE_META": "true",
                       "WANDB__DISABLE_MACHINE_INFO": "true", "WANDB__SAVE_REQUIREMENTS": "false",
                       "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true"}.items():
        monkeypatch.setenv(key, value)

    out = tmp_path / "run"
    cfg, plan = _run(out, "output.trackers=[wandb]", "output.wandb_mode=offline")
    with trackers.feeding(cfg, plan) as feed:
        _append(out, *(_train(i) for i in range(1, 5)), {"iteration": 4, "valid_lm_loss": 9.0})
        summary = feed.finish("FINISHED", [out / "plan.json"])
    assert summary["wandb"]["dropped"] == 0
    [run_file] = (out / "wandb").glob(f"offline-run-*/run-{summary['wandb']['run_id']}.wandb")
    history: dict = {}
    deadline = time.monotonic() + 60  # wandb's service process may still be writing it
    while len(history) < 4 and time.monotonic() < deadline:
        try:
            history = _wandb_history(run_file, wandb_internal_pb2)
        except Exception:  # a chunk half written: read again
            history = {}
        time.sleep(0.1 if len(history) < 4 else 0)
    assert sorted(history) == [1, 2, 3, 4]
    assert [history[i]["train/lm_loss"] for i in (1, 2, 3, 4)] == [
        _train(i)["lm_loss"] for i in (1, 2, 3, 4)]
    assert history[4]["valid/lm_loss"] == 9.0


def _wandb_history(run_file, pb2) -> dict:
    """{step: logged items} of the history records in a .wandb file."""
    history = {}
    for data in _wandb_records(run_file.read_bytes()):
        record = pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}
            history[int(items["_step"])] = items
    return history


def _wandb_records(raw: bytes):
    """The records of a .wandb file as wandb writes it (its reader left the Python package
    in 0.2x): a 7-byte header, then LevelDB's log format, 32 KiB blocks of chunks, each
    ``crc32 (4) | length (2) | type (1: full, 2: first, 3: middle, 4: last)`` and its bytes."""
    assert raw[:4] == b":W&B", raw[:7]
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(raw):
        if (pos % block) + 7 > block:  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(raw[pos + 4:pos + 6], "little"), raw[pos + 6]
        chunk, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:  # zero padding at the end
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            yield pending


def test_no_tracker_imports_none_and_a_missing_package_is_one_line(tmp_path, monkeypatch):
    code = ("import sys; from ray_ppu.config.loader import load; from ray_ppu.plan import "
            "build_plan; from ray_ppu.monitor.trackers import feeding; "
            "import ray_ppu.launch.local_checks; "
            "cfg = load(None, ['training.train_iters=2', 'data.data_path=[c]']); "
            "f = feeding(cfg, build_plan(cfg)); assert f.__enter__() is None; "
            "print(sorted(m for m in ('mlflow', 'wandb') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    assert trackers.problems(["comet"]) == [
        "output.trackers: unknown tracker 'comet' (known: mlflow, wandb)"]
    monkeypatch.setitem(trackers.PACKAGES, "mlflow", "no_such_module_here")
    assert trackers.problems(["mlflow"]) == [
        "output.trackers: mlflow needs its package: pip install no_such_module_here (or pip "
        "install 'ray-ppu[trackers]')"]
    # a launch starts its feed before its local checks: the feed refuses with the same line
    # (a misspelt name was a KeyError traceback there), and nothing is written
    from ray_ppu.config.loader import load
    from ray_ppu.errors import ConfigError
    from ray_ppu.plan import build_plan

    cfg = load(None, ["training.train_iters=2", "data.data_path=[c]",
                      f"output.dir={tmp_path / 'run'}", "output.trackers=[mlfow, mlflow]"])
    with pytest.raises(ConfigError) as err:
        with trackers.feeding(cfg, build_plan(cfg)):
            pass
    assert str(err.value) == (
        "output.trackers: unknown tracker 'mlfow' (known: mlflow, wandb); output.trackers: "
        "mlflow needs its package: pip install no_such_module_here (or pip install "
        "'ray-ppu[trackers]')")
    assert not (tmp_path / "run").exists()


def test_online_wandb_without_credentials_is_refused_before_the_run(monkeypatch, tmp_path):
    """W&B online with no key anywhere trained, waited 30 s at the end and dropped every row
    (exit 0); now the local checks refuse it in one line, and a key, a netrc entry or offline
    mode lets it through."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_BASE_URL", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (refused,) = trackers.problems(["wandb"], "online")
    assert refused.startswith("output.trackers: wandb with output.wandb_mode=online, and no W&B "
                              "credentials here"), refused
    assert "output.wandb_mode=offline" in refused
    assert trackers.problems(["wandb"], "offline") == []
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k3y\n")
    assert trackers.problems(["wandb"], "online") == []
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k3y")
    assert trackers.problems(["wandb"], "online") == []
