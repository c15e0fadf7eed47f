"""Experiment trackers (MLflow, Weights & Biases): each run where teams compare runs.

The driver feeds them, not the ranks (:func:`feeding`). A thread tails
``<output.dir>/metrics.jsonl``, which rank 0 writes whatever happens to the worker group
(restarts, a resubmitted job), and puts each row on a bounded queue; a second thread sends the
queue to every tracker. Neither is on the training path: a tracker that is down or slow costs
the run nothing. A send that fails is retried with backoff, the rows behind it wait in the
queue (past :data:`QUEUE_ROWS` the oldest are dropped and counted), and at the end the feed
flushes for up to :data:`FLUSH_S` and says what each tracker got and dropped.

What a run sends: the resolved config and the plan's figures as parameters, once; every
training and validation row of metrics.jsonl as metrics at its iteration; events (start,
restart, checkpoint, interrupted) as tags; at the end config.yaml, plan.json and the run
report as artifacts, and the run's status.

Continuity: ``<output.dir>/trackers.json`` keeps each tracker's run id and the last iteration
sent to it. A resumed or resubmitted run continues that tracker run and sends only rows after
that iteration: the iterations a restarted group trains again are not sent twice.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

from ray_ppu.errors import ConfigError
from ray_ppu.monitor.tracker_clients import CLIENTS, PACKAGES

log = logging.getLogger("ray_ppu")

STATE_FILE = "trackers.json"
QUEUE_ROWS = 100_000  # ~100 MB of rows at most: days of a run logged every iteration
FLUSH_S = 30.0  # at the end, how long the rows still queued may take to go
_POLL_S = 1.0  # metrics.jsonl is read this often
_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # waits between tries while a tracker is down


def problems(trackers: list[str], wandb_mode: str = "offline") -> list[str]:
    """``output.trackers`` problems, one line each: an unknown name, a package not installed,
    W&B online without credentials (refused rather than sent offline: a run the user expects
    on the dashboard would be missing from it, and every row dropped at the end)."""
    found = []
    for name in trackers:
        if name not in PACKAGES:
            found.append(f"output.trackers: unknown tracker {name!r} (known: "
                         f"{', '.join(PACKAGES)})")
        elif importlib.util.find_spec(PACKAGES[name]) is None:
            found.append(f"output.trackers: {name} needs its package: pip install "
                         f"{PACKAGES[name]} (or pip install 'ray-ppu[trackers]')")
        elif name == "wandb" and wandb_mode == "online" and not wandb_credentials():
            found.append("output.trackers: wandb with output.wandb_mode=online, and no W&B "
                         "credentials here (WANDB_API_KEY, `wandb login`'s netrc entry or "
                         "settings file): log in, or set output.wandb_mode=offline and "
                         "`wandb sync` the run later")
    return found


def wandb_credentials() -> bool:
    """Whether W&B finds an API key the way it looks for one (without importing it): the
    environment, the netrc entry of its host, a settings file; or a mode that never sends."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") in (
            "offline", "disabled", "dryrun"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    home = Path.home()
    for path in filter(None, (os.environ.get("NETRC"), home / ".netrc", home / "_netrc")):
        try:
            if netrc.netrc(path).authenticators(host):
                return True
        except (OSError, netrc.NetrcParseError):
            continue
    config = Path(os.environ.get("WANDB_CONFIG_DIR", home / ".config" / "wandb"))
    for settings in (config / "settings", Path("wandb") / "settings"):
        try:
            if "api_key" in settings.read_text():
                return True
        except OSError:
            continue
    return False


class _Sender:
    """One tracker behind a queue and a thread: rows go in at once, out as it takes them."""

    def __init__(self, client, state: dict):
        self.client, self.state = client, state
        # per kind of row (train, valid): rows after the last one queued go in; event rows
        # after the ones already sent (a resumed feed reads metrics.jsonl from its start)
        self.queued = dict(state.get("last_steps", {}))
        self.events_sent_before = state.get("events_sent", 0)
        self.queue: collections.deque = collections.deque()
        self.sent = self.dropped = self.failures = 0
        self.opened = False
        self._wake = threading.Event()
        self._closing = self._abandoned = False
        self._thread = threading.Thread(target=self._run, name=f"tracker-{client.name}",
                                        daemon=True)
        self._thread.start()

    def put(self, item: tuple) -> None:
        if len(self.queue) >= QUEUE_ROWS:
            self.queue.popleft()
            self.dropped += 1
        self.queue.append(item)
        self._wake.set()

    def _run(self) -> None:
        tries = 0
        while True:
            if self._abandoned or (self._closing and self.opened and not self.queue):
                return  # sent all, or past the flush: close() counted what is left
            if not self.opened:  # first the tracker run: a new one, or the one a resumed
                item = ("open", 0, None)  # run continues (its id in trackers.json)
            elif not self.queue:
                self._wake.wait(_POLL_S)
                self._wake.clear()
                continue
            else:
                item = self.queue[0]
            try:
                if item[0] == "open":
                    self.state["run_id"] = self.client.open(self.state.get("run_id"))
                    self.opened = True
                else:
                    self.client.send(*item)
            except Exception as err:  # down, slow, refusing: keep the row, wait, try again
                self.failures += 1
                if tries == 0:
                    log.warning("tracker %s: %s (rows are kept and sent when it answers)",
                                self.client.name, " ".join(str(err).split())[:200])
                time.sleep(_BACKOFF_S[min(tries, len(_BACKOFF_S) - 1)])
                tries += 1
                continue
            if tries:
                log.info("tracker %s answers again after %d failed tries", self.client.name,
                         tries)
            tries = 0
            if item[0] == "open":
                continue
            self.queue.popleft()
            self.sent += 1
            if item[0] == "metrics":
                sent = self.state.setdefault("last_steps", {})
                sent[item[2][0]] = max(sent.get(item[2][0], 0), item[1])
            elif item[0] == "event":
                self.state["events_sent"] = self.state.get("events_sent", 0) + 1
            elif item[0] == "params":
                self.state["params_sent"] = True

    def close(self, deadline: float) -> None:
        """Send what is queued until ``deadline`` (time.monotonic); the rest is dropped."""
        self._closing = True
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._abandoned = True  # a send in flight may still finish; nothing after it
        self.dropped += len(self.queue)


def _rows(path: Path, stop: threading.Event) -> Iterator[dict]:
    """metrics.jsonl's rows as rank 0 appends them, until ``stop`` is set and all are read."""
    offset, pending = 0, b""
    while True:
        stopping = stop.is_set()  # read once more after the stop: the last rows
        if path.is_file():
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()  # a line being written: the rest of it comes next time
            for line in lines:
                with contextlib.suppress(ValueError):
                    yield json.loads(line)
        if stopping:
            return
        stop.wait(_POLL_S)


def _numbers(row: dict, prefix: str = "") -> dict[str, float]:
    """The row's numeric values (nested mappings as ``outer/inner``), without bookkeeping."""
    out = {}
    for key, value in row.items():
        if key in ("iteration", "time", "event"):
            continue
        if isinstance(value, dict):
            out.update(_numbers(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out


class Feed:
    """The trackers of one run (see the module docstring); :func:`feeding` runs it."""

    def __init__(self, out: Path, clients: list, state: dict):
        self.out, self.state = out, state
        self.senders = [_Sender(c, state.setdefault(c.name, {})) for c in clients]
        self._stop = threading.Event()
        self._tail = threading.Thread(target=self._follow, name="tracker-feed", daemon=True)

    def start(self, params: dict) -> "Feed":
        for sender in self.senders:
            if not sender.state.get("params_sent"):  # parameters once, on the run's first start
                sender.put(("params", 0, params))
        self._tail.start()
        return self

    def _follow(self) -> None:
        events, saved = 0, time.monotonic()
        for row in _rows(self.out / "metrics.jsonl", self._stop):
            events += "event" in row
            step = int(row.get("iteration", 0))
            values = _numbers(row)
            kind = "valid" if any(k.startswith("valid_") for k in values) else "train"
            if kind == "valid":  # valid/lm_loss beside train/lm_loss
                values = {k.removeprefix("valid_"): v for k, v in values.items()}
            for sender in self.senders:
                if "event" in row:
                    if events > sender.events_sent_before:
                        sender.put(("event", step, row))
                elif step > sender.queued.get(kind, 0):  # not what a restart trains again
                    sender.put(("metrics", step, (kind, values)))
                    sender.queued[kind] = step
            if time.monotonic() - saved >= _POLL_S:  # not a file write per row: once a poll
                self._save_state()
                saved = time.monotonic()

    def _save_state(self) -> None:
        try:
            text = json.dumps(self.state, indent=2)
        except RuntimeError:  # a sender added a key meanwhile: the next save writes it
            return
        tmp = self.out / (STATE_FILE + ".tmp")
        tmp.write_text(text)
        tmp.replace(self.out / STATE_FILE)

    def finish(self, status: str, artifacts: list[Path]) -> dict:
        """Read the last rows, send the artifacts, end the tracker runs; {tracker: sent,
        dropped} (logged, one line per tracker that lost rows)."""
        self._stop.set()
        if self._tail.is_alive():
            self._tail.join()
        for sender in self.senders:
            sender.put(("end", 0, {"status": status,
                                   "artifacts": [str(p) for p in artifacts if p.is_file()]}))
        deadline = time.monotonic() + FLUSH_S
        summary = {}
        for sender in self.senders:
            sender.close(deadline)
            summary[sender.client.name] = {"run_id": sender.state.get("run_id"),
                                           "sent": sender.sent, "dropped": sender.dropped}
            if sender.dropped:
                log.warning("tracker %s: %d row(s) not sent (it did not answer in time)",
                            sender.client.name, sender.dropped)
        self._save_state()
        lost = {name: t["dropped"] for name, t in summary.items() if t["dropped"]}
        if lost:  # an event row, so that a report written after this shows it
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"event": "trackers_dropped", "dropped": lost,
                                    "time": time.time()}) + "\n")
        return summary


def _params(cfg, plan) -> dict:
    """The resolved config as ``section.field`` and the plan's headline figures."""
    flat = {f"{section}.{key}": value for section, values in cfg.to_dict().items()
            for key, value in values.items()}
    figures = plan.to_dict()
    flat.update({f"plan.{k}": v for k, v in figures.items() if not isinstance(v, (dict, list))})
    return flat


@contextlib.contextmanager
def feeding(cfg, plan) -> Iterator[Optional[Feed]]:
    """The run's trackers while the block runs (None and nothing imported without any):
    ``feed.finish(...)`` at its end sends the artifacts; an exception ends them FAILED."""
    if not cfg.output.trackers:
        yield None
        return
    found = problems(cfg.output.trackers, cfg.output.wandb_mode)
    if found:  # the launch's local checks come after the feed starts: say it here, one line
        raise ConfigError("; ".join(found))
    out = Path(cfg.output.dir)
    state_path = out / STATE_FILE
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    clients = [CLIENTS[name](cfg, out) for name in cfg.output.trackers]  # opened by senders
    feed = Feed(out, clients, state).start(_params(cfg, plan))
    done = False
    try:
        yield feed
        done = True
    finally:
        if not feed._stop.is_set():  # the block did not finish it: the run failed
            feed.finish("FINISHED" if done else "FAILED", [])
