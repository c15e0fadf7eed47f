"""Which charts a run's report has, as data: its rows as series, its events as markers.

Loss and validation loss per iteration, throughput and MFU (or TFLOP/s per device) over time
with restarts and checkpoints marked, data wait per iteration. Kept apart from svg.py, which
draws any :class:`Chart` and knows nothing of runs, and from data.py, which would pass 400 lines
with them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ray_ppu.monitor.report.data import Clock, Run, clock_of, event_text, last_per_iteration, num

# With more checkpoints than this, their lines go unlabelled (the labels would overlap).
_MAX_CHECKPOINT_LABELS = 12


class Series(NamedTuple):
    name: str
    points: list  # [(x, y)]; points with a missing or non-finite coordinate are left out;
    # a None item breaks the line (a restart: no training between the groups' windows)
    dots: bool = False  # markers only (validation passes) instead of a line

    def segments(self) -> list[list]:
        """The stretches of the line between its breaks (None items), finite points only."""
        segments = [[]]
        for point in self.points:
            if point is None:
                segments.append([])
            elif all(v is not None and math.isfinite(v) for v in point):
                segments[-1].append(point)
        return [s for s in segments if s]

    def finite_points(self) -> list:
        return [p for segment in self.segments() for p in segment]


class Marker(NamedTuple):
    """A vertical line across a time chart: a restart, a checkpoint, ..."""

    x: float
    label: str  # drawn along the line; "" for none
    kind: str  # the row's event: the line's CSS class
    detail: str  # the hover text


class Chart(NamedTuple):
    """One figure of the page: its caption, its lines or dots, its axes and markers."""

    title: str
    series: list[Series]
    x_label: str
    y_label: str
    markers: list[Marker] = ()

    def legend(self) -> list[tuple[str, str]]:
        """(CSS classes, text) of the legend's keys: each series that has a point, then each
        kind of marker once."""
        keys = [(f"s{i}{' dots' if s.dots else ''}", s.name)
                for i, s in enumerate(self.series) if s.finite_points()]
        kinds = dict.fromkeys(m.kind for m in self.markers)
        return keys + [(f"marker {k}", k.replace("_", " ")) for k in kinds]


def _event_markers(run: Run, clock: Clock) -> list[Marker]:
    """Restarts (at the failure: the row is written once the first iteration after it is
    done, ``recovery_s`` later), checkpoints, failed saves and interruptions."""
    checkpoints = sum(1 for r in run.events if r.get("event") == "checkpoint")
    markers = []
    for row in run.events:
        x = clock.at(row)
        if x is None:
            continue
        kind = str(row.get("event"))
        label = kind.replace("_", " ")
        if kind == "restart":
            x -= (num(row, "recovery_s") or 0.0) / clock.divisor
            label = f"restart {row.get('restarts', '?')}"
        elif kind == "checkpoint":
            label = f"ckpt {row.get('iteration', '?')}" if checkpoints <= _MAX_CHECKPOINT_LABELS \
                else ""
        markers.append(Marker(x, label, kind, event_text(row)))
    return markers


def _loss_chart(run: Run) -> Chart:
    train = [(num(r, "iteration"), num(r, "lm_loss")) for r in last_per_iteration(run.train)]
    valid = [(num(r, "iteration"), num(r, "valid_lm_loss"))
             for r in last_per_iteration(run.valid)]
    series = [Series("training loss", train), Series("validation loss", valid, dots=True)]
    return Chart("Loss", series, "iteration", "lm loss")


def _new_group(previous: dict, row: dict) -> bool:
    """Whether ``row`` is a new worker group's first window (elapsed_s starts again at a
    restart, and at a resumed launch; ``restarts`` changes)."""
    before, now = num(previous, "elapsed_s"), num(row, "elapsed_s")
    return ((before is not None and now is not None and now < before)
            or previous.get("restarts") != row.get("restarts"))


def _time_series(run: Run, clock: Clock, key: str, scale: float = 1.0) -> list:
    """(time, value × scale) of the training rows, the line broken between worker groups."""
    points, previous = [], None
    for row in run.train:
        if previous is not None and _new_group(previous, row):
            points.append(None)
        value = num(row, key)
        points.append((clock.at(row), value * scale if value is not None else None))
        previous = row
    return points


def _throughput_chart(run: Run, clock: Clock, markers: list[Marker]) -> Chart:
    points = _time_series(run, clock, "tokens_per_s")
    return Chart("Throughput", [Series("tokens/s", points)], f"time ({clock.unit})",
                 "tokens/s", markers)


def _efficiency_chart(run: Run, clock: Clock, markers: list[Marker]) -> Chart:
    """MFU where the rows carry it (a fraction; shown in %), else TFLOP/s per device."""
    mfu = [num(r, "mfu") for r in run.train if num(r, "mfu") is not None]
    if mfu:
        scale = 100.0 if max(mfu) <= 1.0 else 1.0  # a fraction: 0.42 is 42 %
        return Chart("Model FLOPs utilization", [Series("MFU", _time_series(
            run, clock, "mfu", scale))], f"time ({clock.unit})", "MFU (%)", markers)
    points = _time_series(run, clock, "tflops_per_device")
    return Chart("TFLOP/s per device", [Series("TFLOP/s per device", points)],
                 f"time ({clock.unit})", "TFLOP/s per device", markers)


def _data_wait_chart(run: Run) -> Chart:
    rows = last_per_iteration(run.train)
    waits = [num(r, "data_wait_s") for r in rows]
    points = [(num(r, "iteration"), w * 1000 if w is not None else None)
              for r, w in zip(rows, waits)]
    return Chart("Data wait", [Series("rank 0's wait on its data stream", points)],
                 "iteration", "data wait per iteration (ms)")


def _routing_chart(run: Run) -> Chart:
    """A MoE run's routing per iteration: the load-balancing loss (1 = balanced) and the
    busiest expert's tokens over the mean (worst layer)."""
    rows = last_per_iteration(run.train)
    series = [Series(label, [(num(r, "iteration"), num(r, key)) for r in rows])
              for key, label in (("moe_load_balancing_loss", "load-balancing loss"),
                                 ("moe_expert_load_max_over_mean", "busiest expert / mean"))
              if any(num(r, key) is not None for r in rows)]
    return Chart("Expert routing", series, "iteration", "1 = balanced")


def charts_of(run: Run) -> list[Chart]:
    """The run's charts, in page order; the time charts share the event markers; a MoE run's
    routing chart last."""
    clock = clock_of(run)
    markers = _event_markers(run, clock)
    charts = [_loss_chart(run), _throughput_chart(run, clock, markers),
              _efficiency_chart(run, clock, markers), _data_wait_chart(run)]
    if any(num(r, "moe_expert_load_max_over_mean") is not None for r in run.train):
        charts.append(_routing_chart(run))
    return charts
