"""Where logged iterations go: metrics.jsonl, TensorBoard, and a one-line progress report."""

from __future__ import annotations

import datetime
import json
import logging
import math
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger("ray_ppu")


def progress_line(m: dict) -> str:
    eta = datetime.timedelta(seconds=round(m["eta_s"])) if math.isfinite(m["eta_s"]) else "?"
    line = (
        f"iter {m['iteration']:>6}/{m['train_iters']} | loss {m['lm_loss']:.4f} | "
        f"lr {m['lr']:.3e} | grad norm {m['grad_norm']:.3f} | "
        f"{m['tokens_per_s']:,.0f} tok/s | {m['step_time_s'] * 1000:.0f} ms/iter"
    )
    if "tflops_per_device" in m:
        line += f" | {m['tflops_per_device']:.3g} TFLOP/s/device"
    if "mfu" in m:  # None where the device's peak is unknown (a CPU run)
        line += f" | MFU {m['mfu']:.1%}" if m["mfu"] is not None else " | MFU n/a"
    if "loss_scale" in m:
        line += f" | loss scale {m['loss_scale']:g}"
    if "moe_expert_load_max_over_mean" in m:
        line += f" | expert load max/mean {m['moe_expert_load_max_over_mean']:.2f}"
    return line + f" | ETA {eta}"


def validation_line(m: dict) -> str:
    return (f"validation at iter {m['iteration']:>6} | loss {m['valid_lm_loss']:.4f} | "
            f"ppl {m['valid_ppl']:.2f} | {m['valid_samples']} samples")


def event_line(m: dict) -> str:
    """Log line of an event row (``event``: start, checkpoint, checkpoint_failed, interrupted,
    restart)."""
    from ray_ppu.monitor.restarts import restart_line

    if m["event"] == "restart":
        return restart_line(m)
    if m["event"] == "checkpoint":
        return (f"checkpoint at iteration {m['iteration']} saved to {m['path']} in "
                f"{m['checkpoint_time_s']:.1f} s")
    if m["event"] == "interrupted":
        return (f"{m['reason']}: saving a checkpoint at iteration {m['iteration']}"
                + (", then stopping" if m["reason"] == "job stop" else ", training goes on"))
    if m["event"] == "start":  # once, after the first training row of a run
        return "start: " + " | ".join(f"{k} {v:.1f} s" for k, v in m["phases_s"].items())
    if m["event"] == "checkpoint_failed":
        return (f"{m['error']} ({m['checkpoint_failures']} failed save(s) so far); training "
                f"goes on, the run resumes from the previous complete checkpoint if it fails")
    return json.dumps(m)


class MetricsWriter:
    """Appends each logged iteration to ``metrics.jsonl`` and TensorBoard; one writer per run."""

    def __init__(self, output_dir: str | Path, tensorboard: bool = True) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
        self._tb: Optional[object] = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"))

    def write(self, metrics: dict) -> None:
        """One row: a training window (``lm_loss``, ...), a validation pass (``valid_*``) or an
        event (``event``: checkpoint, checkpoint_failed, interrupted, restart)."""
        self._jsonl.write(json.dumps({**metrics, "time": time.time()}) + "\n")
        event = metrics.get("event")
        is_valid = "valid_lm_loss" in metrics
        if self._tb is not None:
            step = metrics["iteration"]
            for key, value in metrics.items():
                if key not in ("iteration", "train_iters") and isinstance(value, (int, float)):
                    group = event or ("valid" if is_valid else "train")
                    self._tb.add_scalar(f"{group}/{key.removeprefix('valid_')}", value, step)
        if event:
            line = event_line(metrics)
            (log.info if event in ("checkpoint", "start") else log.warning)(line)
        else:
            log.info(validation_line(metrics) if is_valid else progress_line(metrics))

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


class SampleLog:
    """``output.sample_log``: which samples each iteration trained on, one file per data-reading
    rank (``<dir>/samples/rank_NNNNN.jsonl``, a line per iteration: iteration, DP rank, ids).

    An audit of the data a run saw (which documents were in the batch before a loss spike);
    after a restart the iterations trained again are logged again, and the group that trained
    an iteration last is the one that counts (:func:`read_sample_log`).
    """

    def __init__(self, output_dir: str | Path, world_rank: int, dp_rank: int,
                 dp_size: int) -> None:
        path = Path(output_dir) / "samples" / f"rank_{world_rank:05d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._file = open(path, "a", buffering=1)

    def write(self, iteration: int, sample_ids: list) -> None:
        self._file.write(json.dumps({"iteration": iteration, "dp_rank": self.dp_rank,
                                     "dp_size": self.dp_size, "time": time.time(),
                                     "ids": sample_ids}) + "\n")

    def close(self) -> None:
        self._file.close()


def read_sample_log(output_dir: str | Path) -> dict[int, list]:
    """{iteration: sorted ids of the whole global batch} from every rank's sample log.

    A restart re-trains, and re-logs, the iterations after its checkpoint, possibly at another
    DP size (elastic). Per iteration, the lines of the DP size that logged it last count, the
    last line per DP rank among them: a group that shrank mid-iteration leaves lines of DP
    ranks the next group does not have, and those are stale.
    """
    rows: dict = {}  # iteration -> lines
    for path in sorted((Path(output_dir) / "samples").glob("rank_*.jsonl")):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                rows.setdefault(row["iteration"], []).append(row)
    batches: dict = {}
    for iteration, lines in sorted(rows.items()):
        lines.sort(key=lambda r: r.get("time", 0.0))  # stable: file order without times
        size = lines[-1].get("dp_size")
        last = {r["dp_rank"]: r["ids"] for r in lines if r.get("dp_size") == size}
        batches[iteration] = sorted(i for ids in last.values() for i in ids)
    return batches
