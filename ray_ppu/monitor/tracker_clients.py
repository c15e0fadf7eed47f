"""What each experiment tracker is sent, through its own client (:mod:`ray_ppu.monitor.trackers`
queues and retries; this module only speaks each tracker's API).

Every client has ``open(run_id) -> run_id`` (a new tracker run, or the one a resumed run
continues) and ``send(kind, step, payload)`` for the four kinds the feed queues: ``params``
(a flat dict, once), ``metrics`` (``(row kind, {name: value})`` at the row's iteration),
``event`` (a metrics.jsonl event row) and ``end`` (status and artifact paths). A send raises
when the tracker does not take it; the feed keeps the item and tries again. Packages are
imported when a client is made: a run without trackers imports none.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}  # tracker → the module it needs
_PARAM_CHARS = 6000  # MLflow keeps a parameter value up to 6000 characters


def _event_text(row: dict) -> str:
    return json.dumps({k: v for k, v in row.items() if k not in ("event", "time")})[:4000]


class MLflow:
    """MLflow through ``MlflowClient`` (no global active run): a server, or a local store."""

    name = "mlflow"

    def __init__(self, cfg, out: Path):
        # the feed retries on its own schedule: MLflow's own retries (7, backing off for
        # minutes) would hold the end of a run whose server is down
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.tracking import MlflowClient

        uri = cfg.output.mlflow_tracking_uri or f"sqlite:///{out.resolve() / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        # the default store's artifacts beside it (MLflow's own default: ./mlruns, wherever
        # the driver was started); a server or a store the user names keeps its own
        self.artifacts = (None if cfg.output.mlflow_tracking_uri
                          else (out.resolve() / "mlflow-artifacts").as_uri())
        self.experiment = cfg.output.mlflow_experiment
        self.run_name, self.out = cfg.output.name or out.name, out
        self.run_id = None

    def open(self, run_id):
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
        else:
            found = self.client.get_experiment_by_name(self.experiment)
            experiment = (found.experiment_id if found else self.client.create_experiment(
                self.experiment, artifact_location=self.artifacts))
            run_id = self.client.create_run(experiment, run_name=self.run_name, tags={
                "ray_ppu.output_dir": str(self.out.resolve())}).info.run_id
        self.run_id = run_id
        return run_id

    def send(self, kind: str, step: int, payload) -> None:
        from mlflow.entities import Metric, Param

        if kind == "params":
            items = [Param(k, str(v)[:_PARAM_CHARS]) for k, v in payload.items()]
            for i in range(0, len(items), 100):  # log_batch takes 100 parameters a call
                self.client.log_batch(self.run_id, params=items[i:i + 100])
        elif kind == "metrics":
            now = int(1000 * time.time())
            metrics = [Metric(f"{payload[0]}/{k}", v, now, step) for k, v in payload[1].items()]
            self.client.log_batch(self.run_id, metrics=metrics)
        elif kind == "event":
            self.client.set_tag(self.run_id, f"event.{step:08d}.{payload['event']}",
                                _event_text(payload))
        elif kind == "end":
            for path in payload["artifacts"]:
                self.client.log_artifact(self.run_id, path)
            self.client.set_terminated(self.run_id, payload["status"])


class Wandb:
    """Weights & Biases (``wandb.init`` with the run's id, resumed if it exists)."""

    name = "wandb"

    def __init__(self, cfg, out: Path):
        import wandb

        self.wandb, self.cfg, self.out = wandb, cfg, out
        self.run = None

    def open(self, run_id):
        o = self.cfg.output
        run_id = run_id or uuid.uuid4().hex[:8]  # W&B run ids: short, lowercase
        self.run = self.wandb.init(project=o.wandb_project, entity=o.wandb_entity,
                                   mode=o.wandb_mode, id=run_id, resume="allow",
                                   name=o.name or self.out.name, dir=str(self.out),
                                   settings=self.wandb.Settings(console="off", silent=True))
        return run_id

    def send(self, kind: str, step: int, payload) -> None:
        if kind == "params":
            self.run.config.update(payload, allow_val_change=True)
        elif kind == "metrics":
            row_kind, values = payload
            self.run.log({f"{row_kind}/{k}": v for k, v in values.items()}, step=step)
        elif kind == "event":
            self.run.log({f"event/{payload['event']}": 1}, step=step)
        elif kind == "end":
            for path in payload["artifacts"]:
                self.run.save(path, base_path=str(Path(path).parent), policy="now")
            self.run.finish(exit_code=0 if payload["status"] == "FINISHED" else 1)


CLIENTS = {"mlflow": MLflow, "wandb": Wandb}
