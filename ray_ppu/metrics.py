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
    return (
        f"iter {m['iteration']:>6}/{m['train_iters']} | loss {m['lm_loss']:.4f} | "
        f"lr {m['lr']:.3e} | grad norm {m['grad_norm']:.3f} | "
        f"{m['tokens_per_s']:,.0f} tok/s | {m['step_time_s'] * 1000:.0f} ms/iter | ETA {eta}"
    )


def validation_line(m: dict) -> str:
    return (f"validation at iter {m['iteration']:>6} | loss {m['valid_lm_loss']:.4f} | "
            f"ppl {m['valid_ppl']:.2f} | {m['valid_samples']} samples")


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
        """One row: a training window (``lm_loss``, ...) or a validation pass (``valid_*``)."""
        self._jsonl.write(json.dumps({**metrics, "time": time.time()}) + "\n")
        is_valid = "valid_lm_loss" in metrics
        if self._tb is not None:
            step = metrics["iteration"]
            for key, value in metrics.items():
                if key not in ("iteration", "train_iters") and isinstance(value, (int, float)):
                    name = f"valid/{key.removeprefix('valid_')}" if is_valid else f"train/{key}"
                    self._tb.add_scalar(name, value, step)
        log.info(validation_line(metrics) if is_valid else progress_line(metrics))

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
