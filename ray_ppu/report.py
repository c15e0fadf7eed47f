"""A run's report: one self-contained HTML page drawn from its output directory.

:func:`write_report` reads ``metrics.jsonl`` (training, validation and event rows, see
:mod:`ray_ppu.metrics`), ``config.yaml`` and ``plan.json`` (:func:`ray_ppu.run.prepare_output`)
and writes ``<output dir>/report.html``: a header (progress, final loss, time), SVG charts drawn
here (loss and validation loss per iteration, throughput and MFU or TFLOP/s per device over time
with restarts and checkpoints marked, data wait per iteration), the events, the config and the
plan. No JavaScript, no external assets: the file can be copied anywhere and opened offline.

Any of the three files may be missing or partial (a live run appends to metrics.jsonl): the
page shows what there is.
"""

from __future__ import annotations

import datetime
import html
import json
import math
import os
from pathlib import Path
from typing import NamedTuple, Optional

import yaml

from ray_ppu.metrics import event_line

REPORT_FILE = "report.html"

# The chart canvas (SVG user units; the page scales it to its column's width).
_W, _H = 640, 300
_LEFT, _RIGHT, _TOP, _BOTTOM = 72, 16, 14, 46
# With more checkpoints than this, their lines go unlabelled (the labels would overlap).
_MAX_CHECKPOINT_LABELS = 12


class Series(NamedTuple):
    name: str
    points: list  # [(x, y)]; points with a missing or non-finite coordinate are left out;
    # a None item breaks the line (a restart: no training between the groups' windows)
    dots: bool = False  # markers only (validation passes) instead of a line


class Marker(NamedTuple):
    """A vertical line across a time chart: a restart, a checkpoint, ..."""

    x: float
    label: str  # drawn along the line; "" for none
    kind: str  # the row's event: the line's CSS class
    detail: str  # the hover text


class Run(NamedTuple):
    name: str
    directory: Path
    train: list  # training rows, in file order
    valid: list  # validation rows
    events: list  # event rows
    config: Optional[dict]
    plan: Optional[dict]


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _num(row: dict, key: str) -> Optional[float]:
    """The row's finite number under ``key``, else None (missing, null, NaN, a string)."""
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


# ---------------------------------------------------------------- reading the output directory

def read_rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows; unreadable lines (a live run's half-written last one) are skipped."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _read_mapping(path: Path, parse) -> Optional[dict]:
    try:
        value = parse(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return value if isinstance(value, dict) else None


def load_run(output_dir: str | Path) -> Run:
    directory = Path(output_dir)
    rows = read_rows(directory / "metrics.jsonl")
    return Run(
        name=directory.resolve().name,
        directory=directory,
        train=[r for r in rows if "event" not in r and "lm_loss" in r],
        valid=[r for r in rows if "event" not in r and "valid_lm_loss" in r],
        events=[r for r in rows if "event" in r],
        config=_read_mapping(directory / "config.yaml", yaml.safe_load),
        plan=_read_mapping(directory / "plan.json", json.loads),
    )


def _last_per_iteration(rows: list[dict]) -> list[dict]:
    """One row per iteration, the last one logged (a restart trains, and logs, some again)."""
    last = {}
    for row in rows:
        if _num(row, "iteration") is not None:
            last[row["iteration"]] = row
    return [last[i] for i in sorted(last)]


# ---------------------------------------------------------------- the time axis

class Clock(NamedTuple):
    """Seconds since the run started, shown in ``unit`` (``divisor`` seconds each)."""

    start: Optional[float]  # time.time() at the run's start
    divisor: float
    unit: str

    def at(self, row: dict) -> Optional[float]:
        """Where a row goes on the time axis (in ``unit``), None if it carries no time."""
        t = _num(row, "time")
        if t is not None and self.start is not None:
            return (t - self.start) / self.divisor
        elapsed = _num(row, "elapsed_s")
        return elapsed / self.divisor if elapsed is not None else None


def _clock(run: Run) -> Clock:
    """The run started at its first group's start: a training row's time less its elapsed_s
    (elapsed_s counts from its worker group's start, so it starts again after a restart)."""
    starts = [r["time"] - r["elapsed_s"] for r in run.train
              if _num(r, "time") is not None and _num(r, "elapsed_s") is not None]
    times = [r["time"] for r in run.train + run.valid + run.events if _num(r, "time") is not None]
    start = min(starts) if starts else (min(times) if times else None)
    span = (max(times) - start) if times and start is not None else max(
        [_num(r, "elapsed_s") or 0.0 for r in run.train] or [0.0])
    if span < 300:
        return Clock(start, 1.0, "s")
    if span < 3 * 3600:
        return Clock(start, 60.0, "min")
    return Clock(start, 3600.0, "h")


# ---------------------------------------------------------------- number formatting

def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 × 10^k apart) covering [lo, hi]."""
    if not hi - lo > 1e-12 * max(1.0, abs(lo), abs(hi)):
        pad = abs(lo) * 0.05 or 0.5
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    first = math.floor(lo / step + 1e-9) * step
    n = math.ceil((hi - first) / step - 1e-9)
    return [first + i * step for i in range(n + 1)]


def tick_labels(ticks: list[float]) -> list[str]:
    """Labels of an axis's ticks, one format for all: 12k, 1.5M for large values, as few
    decimals as tell the ticks apart, scientific notation for tiny steps."""
    biggest = max(abs(t) for t in ticks)
    divisor, suffix = 1.0, ""
    for d, s in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if biggest >= max(d, 1e4):  # 1000-9999 stay as they are
            divisor, suffix = d, s
            break
    scaled = [t / divisor for t in ticks]
    step = abs(scaled[1] - scaled[0]) if len(scaled) > 1 else abs(scaled[0]) or 1.0
    for decimals in range(7):
        if all(abs(round(v, decimals) - v) < step * 1e-6 for v in scaled):
            texts = [f"{v:.{decimals}f}" for v in scaled]
            return ["0" if float(t) == 0 else t + suffix for t in texts]  # never "-0.0"
    return [f"{v:.2e}" for v in ticks]


def _config_value(value) -> str:
    """A config value as the YAML has it (no thousands separators: a seed, a token id)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, (list, tuple)):
        return ", ".join(_config_value(v) for v in value) if value else "[]"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def format_value(value) -> str:
    """A number for the header and the tables: 1,234,567 for ints, 4 significant digits else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:,.0f}" if value.is_integer() and abs(value) < 1e7 else f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(format_value(v) for v in value) if value else "[]"
    return _config_value(value)


def format_duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {s:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _format_time(timestamp: Optional[float]) -> str:
    if timestamp is None:
        return "?"
    moment = datetime.datetime.fromtimestamp(timestamp).astimezone()
    return moment.strftime("%Y-%m-%d %H:%M:%S %Z")


# ---------------------------------------------------------------- SVG charts

class _Scale(NamedTuple):
    lo: float
    hi: float
    start: float  # canvas coordinate of lo
    end: float  # canvas coordinate of hi

    def __call__(self, value: float) -> float:
        return self.start + (value - self.lo) / (self.hi - self.lo) * (self.end - self.start)


def _segments(points: list) -> list[list]:
    """The stretches of a line between its breaks (None items), finite points only."""
    segments = [[]]
    for point in points:
        if point is None:
            segments.append([])
        elif all(v is not None and math.isfinite(v) for v in point):
            segments[-1].append(point)
    return [s for s in segments if s]


def _finite_points(points: list) -> list:
    return [p for segment in _segments(points) for p in segment]


def _axes(xs: _Scale, ys: _Scale, x_ticks, y_ticks, x_label: str, y_label: str) -> list[str]:
    """Grid lines, tick labels, the frame and the axis titles."""
    parts = []
    for tick, label in zip(y_ticks, tick_labels(y_ticks)):
        y = ys(tick)
        parts.append(f'<line class="grid" x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{y:.1f}" '
                     f'y2="{y:.1f}"/><text class="tick" x="{_LEFT - 6}" y="{y + 4:.1f}" '
                     f'text-anchor="end">{_e(label)}</text>')
    for tick, label in zip(x_ticks, tick_labels(x_ticks)):
        x = xs(tick)
        parts.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{_TOP}" '
                     f'y2="{_H - _BOTTOM}"/><text class="tick" x="{x:.1f}" '
                     f'y="{_H - _BOTTOM + 16}" text-anchor="middle">{_e(label)}</text>')
    parts.append(f'<rect class="frame" x="{_LEFT}" y="{_TOP}" width="{_W - _LEFT - _RIGHT}" '
                 f'height="{_H - _TOP - _BOTTOM}"/>')
    middle_x, middle_y = (_LEFT + _W - _RIGHT) / 2, (_TOP + _H - _BOTTOM) / 2
    parts.append(f'<text class="label" x="{middle_x:.1f}" y="{_H - 8}" '
                 f'text-anchor="middle">{_e(x_label)}</text>')
    parts.append(f'<text class="label" x="16" y="{middle_y:.1f}" text-anchor="middle" '
                 f'transform="rotate(-90 16 {middle_y:.1f})">{_e(y_label)}</text>')
    return parts


def _marker_svg(marker: Marker, xs: _Scale) -> str:
    x = xs(marker.x)
    text = ""
    if marker.label:
        # read upwards, left of the line, from the top: inside the frame even at its right edge
        text = (f'<text class="marker-label" text-anchor="end" '
                f'transform="translate({x - 4:.1f} {_TOP + 4}) rotate(-90)">{_e(marker.label)}'
                f'</text>')
    return (f'<g class="marker {_e(marker.kind)}"><title>{_e(marker.detail)}</title>'
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_TOP}" y2="{_H - _BOTTOM}"/>{text}</g>')


def _series_svg(index: int, series: Series, xs: _Scale, ys: _Scale, x_label: str) -> str:
    """A polyline per stretch of the line (dots where a stretch is one point), or dots."""
    shapes = []
    for segment in _segments(series.points):
        if not series.dots:
            coordinates = " ".join(f"{xs(x):.1f},{ys(y):.1f}" for x, y in segment)
            shapes.append(f'<polyline class="line" points="{coordinates}"><title>'
                          f'{_e(series.name)}</title></polyline>')
        if series.dots or len(segment) == 1:
            shapes += [f'<circle cx="{xs(x):.1f}" cy="{ys(y):.1f}" r="3.5"><title>'
                       f'{_e(series.name)}: {_e(format_value(y))} at {_e(x_label)} '
                       f'{_e(format_value(x))}</title></circle>' for x, y in segment]
    return f'<g class="series s{index}" data-name="{_e(series.name)}">{"".join(shapes)}</g>'


def _line_chart(series: list[Series], x_label: str, y_label: str,
                markers: list[Marker] = ()) -> str:
    """An SVG chart of ``series`` (lines, or dots where ``Series.dots``) with vertical
    ``markers``; a "no data" paragraph when no series has a point."""
    points = [p for s in series for p in _finite_points(s.points)]
    if not points:
        return '<p class="empty">no data</p>'
    x_values = [x for x, _ in points] + [m.x for m in markers]
    y_values = [y for _, y in points]
    x_ticks = nice_ticks(min(x_values), max(x_values))
    y_ticks = nice_ticks(min(y_values), max(y_values))
    xs = _Scale(x_ticks[0], x_ticks[-1], _LEFT, _W - _RIGHT)
    ys = _Scale(y_ticks[0], y_ticks[-1], _H - _BOTTOM, _TOP)
    parts = _axes(xs, ys, x_ticks, y_ticks, x_label, y_label)
    parts += [_marker_svg(m, xs) for m in markers]
    parts += [_series_svg(i, s, xs, ys, x_label) for i, s in enumerate(series)]
    return (f'<svg class="chart" viewBox="0 0 {_W} {_H}" role="img" '
            f'aria-label="{_e(y_label)} vs {_e(x_label)}">{"".join(parts)}</svg>')


def _legend(series: list[Series], markers: list[Marker]) -> str:
    keys = [f'<span class="key s{i}{" dots" if s.dots else ""}">{_e(s.name)}</span>'
            for i, s in enumerate(series) if _finite_points(s.points)]
    kinds = dict.fromkeys(m.kind for m in markers)
    keys += [f'<span class="key marker {_e(k)}">{_e(k.replace("_", " "))}</span>' for k in kinds]
    return f'<div class="legend">{"".join(keys)}</div>'


def _figure(title: str, series: list[Series], x_label: str, y_label: str,
            markers: list[Marker] = ()) -> str:
    return (f'<figure><figcaption>{_e(title)}</figcaption>'
            f'{_line_chart(series, x_label, y_label, markers)}{_legend(series, markers)}'
            f'</figure>')


# ---------------------------------------------------------------- the charts of a run

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
            x -= (_num(row, "recovery_s") or 0.0) / clock.divisor
            label = f"restart {row.get('restarts', '?')}"
        elif kind == "checkpoint":
            label = f"ckpt {row.get('iteration', '?')}" if checkpoints <= _MAX_CHECKPOINT_LABELS \
                else ""
        markers.append(Marker(x, label, kind, _event_text(row)))
    return markers


def _loss_chart(run: Run) -> str:
    train = [(_num(r, "iteration"), _num(r, "lm_loss")) for r in _last_per_iteration(run.train)]
    valid = [(_num(r, "iteration"), _num(r, "valid_lm_loss"))
             for r in _last_per_iteration(run.valid)]
    series = [Series("training loss", train), Series("validation loss", valid, dots=True)]
    return _figure("Loss", series, "iteration", "lm loss")


def _new_group(previous: dict, row: dict) -> bool:
    """Whether ``row`` is a new worker group's first window (elapsed_s starts again at a
    restart, and at a resumed launch; ``restarts`` changes)."""
    before, now = _num(previous, "elapsed_s"), _num(row, "elapsed_s")
    return ((before is not None and now is not None and now < before)
            or previous.get("restarts") != row.get("restarts"))


def _time_series(run: Run, clock: Clock, key: str, scale: float = 1.0) -> list:
    """(time, value × scale) of the training rows, the line broken between worker groups."""
    points, previous = [], None
    for row in run.train:
        if previous is not None and _new_group(previous, row):
            points.append(None)
        value = _num(row, key)
        points.append((clock.at(row), value * scale if value is not None else None))
        previous = row
    return points


def _throughput_chart(run: Run, clock: Clock, markers: list[Marker]) -> str:
    points = _time_series(run, clock, "tokens_per_s")
    return _figure("Throughput", [Series("tokens/s", points)], f"time ({clock.unit})",
                   "tokens/s", markers)


def _efficiency_chart(run: Run, clock: Clock, markers: list[Marker]) -> str:
    """MFU where the rows carry it (a fraction; shown in %), else TFLOP/s per device."""
    mfu = [_num(r, "mfu") for r in run.train if _num(r, "mfu") is not None]
    if mfu:
        scale = 100.0 if max(mfu) <= 1.0 else 1.0  # a fraction: 0.42 is 42 %
        return _figure("Model FLOPs utilization", [Series("MFU", _time_series(
            run, clock, "mfu", scale))], f"time ({clock.unit})", "MFU (%)", markers)
    points = _time_series(run, clock, "tflops_per_device")
    return _figure("TFLOP/s per device", [Series("TFLOP/s per device", points)],
                   f"time ({clock.unit})", "TFLOP/s per device", markers)


def _data_wait_chart(run: Run) -> str:
    rows = _last_per_iteration(run.train)
    waits = [_num(r, "data_wait_s") for r in rows]
    points = [(_num(r, "iteration"), w * 1000 if w is not None else None)
              for r, w in zip(rows, waits)]
    return _figure("Data wait", [Series("rank 0's wait on its data stream", points)],
                   "iteration", "data wait per iteration (ms)")


def _charts(run: Run) -> str:
    clock = _clock(run)
    markers = _event_markers(run, clock)
    charts = [_loss_chart(run), _throughput_chart(run, clock, markers),
              _efficiency_chart(run, clock, markers), _data_wait_chart(run)]
    return f'<section class="charts">{"".join(charts)}</section>'


# ---------------------------------------------------------------- header and tables

def _event_text(row: dict) -> str:
    try:
        return event_line(row)
    except (KeyError, TypeError, ValueError):  # a row from an older or newer writer
        return json.dumps({k: v for k, v in row.items() if k not in ("event", "time")})


def _planned_iterations(run: Run) -> Optional[int]:
    if run.plan and isinstance(run.plan.get("train_iters"), int):
        return run.plan["train_iters"]
    planned = [r["train_iters"] for r in run.train if isinstance(r.get("train_iters"), int)]
    return planned[-1] if planned else None


def _summary_items(run: Run) -> list[tuple[str, str]]:
    clock = _clock(run)
    last = run.train[-1]
    done = max(int(_num(r, "iteration") or 0) for r in run.train)
    planned = _planned_iterations(run)
    progress = f"{done:,} / {planned:,} ({100 * done / planned:.0f} %)" if planned \
        else f"{done:,} / ?"
    items = [("iterations", progress),
             ("final training loss", f"{format_value(last.get('lm_loss'))} "
                                     f"(iteration {format_value(last.get('iteration'))})")]
    if run.valid:
        v = run.valid[-1]
        items.append(("final validation loss", f"{format_value(v.get('valid_lm_loss'))} "
                      f"(ppl {format_value(v.get('valid_ppl'))}, iteration "
                      f"{format_value(v.get('iteration'))})"))
    times = [r["time"] for r in run.train + run.valid + run.events if _num(r, "time") is not None]
    if times and clock.start is not None:
        items.append(("wall time", f"{format_duration(max(times) - clock.start)} (started "
                                   f"{_format_time(clock.start)})"))
        items.append(("last update", _format_time(max(times))))
    if _num(last, "tokens_per_s") is not None:
        step = _num(last, "step_time_s")
        items.append(("throughput (last)", f"{last['tokens_per_s']:,.0f} tokens/s" + (
            f", {format_duration(step)} per iteration" if step is not None else "")))
    return items + _event_counts(run)


def _event_counts(run: Run) -> list[tuple[str, str]]:
    counts = {}
    for row in run.events:
        counts.setdefault(str(row.get("event")), []).append(row)
    items = [("restarts", str(len(counts.get("restart", []))))]
    saved = counts.get("checkpoint", [])
    items.append(("checkpoints", f"{len(saved)}" + (
        f" (last at iteration {format_value(saved[-1].get('iteration'))})" if saved else "")))
    for kind in ("checkpoint_failed", "interrupted"):
        if kind in counts:
            items.append((kind.replace("_", " "), str(len(counts[kind]))))
    return items


def _header(run: Run) -> str:
    items = _summary_items(run) if run.train else []
    rows = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in items)
    return (f'<header><h1>{_e(run.name)}</h1><p class="path">{_e(run.directory.resolve())}'
            f'</p><dl class="summary">{rows}</dl></header>')


def _table(rows: list[tuple[str, str]], head: tuple[str, ...] = ()) -> str:
    header = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_e(cell)}</td>" for cell in row) + "</tr>"
                   for row in rows)
    return f'<table>{f"<thead><tr>{header}</tr></thead>" if head else ""}<tbody>{body}</tbody>' \
           f'</table>'


def _flatten(mapping: dict, prefix: str = "") -> list[tuple[str, str]]:
    rows = []
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            rows += _flatten(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", _config_value(value)))
    return rows


def _config_section(config: Optional[dict]) -> str:
    if not config:
        return '<section><h2>Config</h2><p class="empty">no config.yaml</p></section>'
    loose = {k: v for k, v in config.items() if not isinstance(v, dict)}
    parts = [f'<div class="config-section"><h3>{_e(name)}</h3>{_table(_flatten(values))}</div>'
             for name, values in config.items() if isinstance(values, dict)]
    if loose:
        parts.append(f'<div class="config-section"><h3>other</h3>{_table(_flatten(loose))}</div>')
    return f'<section><h2>Config</h2><div class="config">{"".join(parts)}</div></section>'


def _plan_section(plan: Optional[dict]) -> str:
    if not plan:
        return '<section><h2>Plan</h2><p class="empty">no plan.json</p></section>'
    rows = [(key, format_value(value)) for key, value in plan.items()
            if key != "warnings" and not isinstance(value, (dict, list))]
    warnings = plan.get("warnings") or []
    notes = "".join(f"<li>{_e(w)}</li>" for w in warnings)
    return (f'<section><h2>Plan</h2>{_table(rows)}'
            f'{f"<h3>warnings</h3><ul>{notes}</ul>" if notes else ""}</section>')


def _events_section(run: Run) -> str:
    if not run.events:
        return ""
    clock = _clock(run)
    rows = [(format_duration((clock.at(r) or 0.0) * clock.divisor),
             format_value(r.get("iteration")), str(r.get("event")), _event_text(r))
            for r in run.events]
    return (f'<section><h2>Events</h2>'
            f'{_table(rows, ("time", "iteration", "event", "what happened"))}</section>')


# ---------------------------------------------------------------- the page

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; color: #222; margin: 0 auto; max-width: 1180px;
       padding: 16px 24px 48px; }
h1 { margin: 0 0 2px; font-size: 24px; } h2 { margin: 28px 0 8px; font-size: 18px; }
h3 { margin: 12px 0 4px; font-size: 14px; }
.path { color: #777; margin: 0 0 12px; font-family: ui-monospace, monospace; font-size: 12px; }
.summary { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; margin: 0; }
.summary dt { color: #666; } .summary dd { margin: 0; font-weight: 600; }
.empty { color: #888; font-style: italic; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(480px, 1fr));
          gap: 16px; margin-top: 20px; }
figure { margin: 0; border: 1px solid #e3e3e3; border-radius: 6px; padding: 8px 10px; }
figcaption { font-weight: 600; margin-bottom: 4px; }
svg.chart { width: 100%; height: auto; display: block; }
svg .grid { stroke: #ececec; } svg .frame { fill: none; stroke: #999; }
svg .tick { font-size: 12px; fill: #555; } svg .label { font-size: 13px; fill: #333; }
svg .line { fill: none; stroke-width: 1.8; stroke-linejoin: round; }
svg .s0 .line { stroke: #1f6fb4; } svg .s0 circle { fill: #1f6fb4; }
svg .s1 .line { stroke: #d9480f; } svg .s1 circle { fill: #d9480f; stroke: #fff; }
svg .marker line { stroke-width: 1.2; stroke-dasharray: 4 3; }
svg .marker-label { font-size: 12px; }
svg .restart line { stroke: #c92a2a; } svg .restart text { fill: #c92a2a; }
svg .checkpoint line { stroke: #2b8a3e; } svg .checkpoint text { fill: #2b8a3e; }
svg .checkpoint_failed line { stroke: #e67700; } svg .checkpoint_failed text { fill: #e67700; }
svg .interrupted line { stroke: #7048e8; } svg .interrupted text { fill: #7048e8; }
.legend { font-size: 12px; color: #444; display: flex; flex-wrap: wrap; gap: 4px 14px; }
.key::before { content: ""; display: inline-block; width: 14px; height: 3px;
               vertical-align: middle; margin-right: 5px; background: #888; }
.key.dots::before { width: 7px; height: 7px; border-radius: 50%; }
.key.s0::before { background: #1f6fb4; } .key.s1::before { background: #d9480f; }
.key.marker::before { height: 0; border-top: 2px dashed; background: none; }
.key.restart::before { border-color: #c92a2a; } .key.checkpoint::before { border-color: #2b8a3e; }
.key.checkpoint_failed::before { border-color: #e67700; }
.key.interrupted::before { border-color: #7048e8; }
table { border-collapse: collapse; font-size: 13px; }
td, th { padding: 2px 10px 2px 0; text-align: left; vertical-align: top; }
th, td:first-child { white-space: nowrap; } td:last-child { overflow-wrap: anywhere; }
tbody tr:nth-child(odd) { background: #f7f7f7; } td:first-child { color: #555; }
.config { display: grid; grid-template-columns: repeat(auto-fill, minmax(340px, 1fr));
          gap: 4px 24px; }
footer { margin-top: 32px; color: #999; font-size: 12px; }
"""


def render(run: Run) -> str:
    """The report page of a run."""
    if run.train:
        body = _charts(run)
    else:
        body = ('<p class="empty" id="no-rows">No training iterations logged yet: '
                f'{_e(run.directory / "metrics.jsonl")} has no training rows.</p>')
    generated = _format_time(datetime.datetime.now().timestamp())
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{_e(run.name)}: run report</title><style>{_STYLE}</style></head><body>'
            f'{_header(run)}{body}{_events_section(run)}{_config_section(run.config)}'
            f'{_plan_section(run.plan)}<footer>ray_ppu run report, generated {_e(generated)}'
            f'</footer></body></html>\n')


def write_report(output_dir: str | Path) -> Path:
    """Write ``<output_dir>/report.html`` from the run's files and return its path.

    The page replaces the previous one in one step (a browser reloading it during a live run
    never reads half a page).
    """
    directory = Path(output_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such output directory")
    path = directory / REPORT_FILE
    partial = path.with_name(f".{REPORT_FILE}.{os.getpid()}.tmp")
    partial.write_text(render(load_run(directory)), encoding="utf-8")
    os.replace(partial, path)
    return path
