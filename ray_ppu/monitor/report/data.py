"""What the report page says, read from a run's output directory, and how its numbers read.

:func:`load_run` reads ``metrics.jsonl`` (training, validation and event rows, see
:mod:`ray_ppu.monitor.metrics_log`), ``config.yaml`` and ``plan.json`` (:func:`ray_ppu.launch.output.prepare_output`);
:func:`page` turns that into the page's texts and table rows as plain strings, so that the
template (page.html.j2) only lays them out and escapes them, and charts.py and svg.py only pick
and draw the charts. Any of the three files may be missing or partial (a live run appends to
metrics.jsonl): the page shows what there is.
"""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import NamedTuple, Optional

import yaml

from ray_ppu.monitor.metrics_log import event_line

class Run(NamedTuple):
    name: str
    directory: Path
    train: list  # training rows, in file order
    valid: list  # validation rows
    events: list  # event rows
    config: Optional[dict]
    plan: Optional[dict]


def num(row: dict, key: str) -> Optional[float]:
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


def last_per_iteration(rows: list[dict]) -> list[dict]:
    """One row per iteration, the last one logged (a restart trains, and logs, some again)."""
    last = {}
    for row in rows:
        if num(row, "iteration") is not None:
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
        t = num(row, "time")
        if t is not None and self.start is not None:
            return (t - self.start) / self.divisor
        elapsed = num(row, "elapsed_s")
        return elapsed / self.divisor if elapsed is not None else None


def clock_of(run: Run) -> Clock:
    """The run started at its first group's start: a training row's time less its elapsed_s
    (elapsed_s counts from its worker group's start, so it starts again after a restart)."""
    starts = [r["time"] - r["elapsed_s"] for r in run.train
              if num(r, "time") is not None and num(r, "elapsed_s") is not None]
    times = [r["time"] for r in run.train + run.valid + run.events if num(r, "time") is not None]
    start = min(starts) if starts else (min(times) if times else None)
    span = (max(times) - start) if times and start is not None else max(
        [num(r, "elapsed_s") or 0.0 for r in run.train] or [0.0])
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


def format_time(timestamp: Optional[float]) -> str:
    if timestamp is None:
        return "?"
    moment = datetime.datetime.fromtimestamp(timestamp).astimezone()
    return moment.strftime("%Y-%m-%d %H:%M:%S %Z")


# ---------------------------------------------------------------- header and tables

def event_text(row: dict) -> str:
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
    clock = clock_of(run)
    last = run.train[-1]
    done = max(int(num(r, "iteration") or 0) for r in run.train)
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
    times = [r["time"] for r in run.train + run.valid + run.events if num(r, "time") is not None]
    if times and clock.start is not None:
        items.append(("wall time", f"{format_duration(max(times) - clock.start)} (started "
                                   f"{format_time(clock.start)})"))
        items.append(("last update", format_time(max(times))))
    if num(last, "tokens_per_s") is not None:
        step = num(last, "step_time_s")
        items.append(("throughput (last)", f"{last['tokens_per_s']:,.0f} tokens/s" + (
            f", {format_duration(step)} per iteration" if step is not None else "")))
    return items + _event_counts(run)


def _event_counts(run: Run) -> list[tuple[str, str]]:
    counts = {}
    for row in run.events:
        counts.setdefault(str(row.get("event")), []).append(row)
    allowed = ((run.config or {}).get("cluster") or {}).get("max_failures")
    items = [("restarts", str(len(counts.get("restart", []))) + (
        "" if allowed is None else " (cluster.max_failures: "
        f"{'unlimited' if allowed < 0 else allowed}; a crash loop stops the run)"))]
    saved = counts.get("checkpoint", [])
    items.append(("checkpoints", f"{len(saved)}" + (
        f" (last at iteration {format_value(saved[-1].get('iteration'))})" if saved else "")))
    for kind in ("checkpoint_failed", "interrupted"):
        if kind in counts:
            items.append((kind.replace("_", " "), str(len(counts[kind]))))
    return items


def _flatten(mapping: dict, prefix: str = "") -> list[tuple[str, str]]:
    rows = []
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            rows += _flatten(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", _config_value(value)))
    return rows


def _config_sections(config: dict) -> list[tuple[str, list[tuple[str, str]]]]:
    """(section, its (key, value) rows) per config section, then "other" for the top-level
    values outside a section."""
    loose = {k: v for k, v in config.items() if not isinstance(v, dict)}
    sections = [(name, _flatten(values)) for name, values in config.items()
                if isinstance(values, dict)]
    return sections + ([("other", _flatten(loose))] if loose else [])


def _plan_rows(plan: dict) -> list[tuple[str, str]]:
    return [(key, format_value(value)) for key, value in plan.items()
            if key != "warnings" and not isinstance(value, (dict, list))]


def _event_rows(run: Run) -> list[tuple[str, str, str, str]]:
    """(time since the start, iteration, event, what happened) per event row."""
    clock = clock_of(run)
    return [(format_duration((clock.at(r) or 0.0) * clock.divisor),
             format_value(r.get("iteration")), str(r.get("event")), event_text(r))
            for r in run.events]


class Page(NamedTuple):
    """The texts and table rows of the report page (page.html.j2 lays them out; the charts
    come from :func:`ray_ppu.monitor.report.charts.charts_of`)."""

    name: str
    path: str  # the output directory, resolved
    metrics_path: str  # where the training rows would be (named when there are none)
    has_training: bool
    summary: list[tuple[str, str]]  # the header's (term, value) items
    events: list[tuple[str, str, str, str]]
    config: Optional[list]  # None without a config.yaml, else _config_sections
    plan: Optional[list]  # None without a plan.json, else its (key, value) rows
    plan_warnings: list
    generated: str  # when this page was made


def page(run: Run) -> Page:
    return Page(
        name=run.name,
        path=str(run.directory.resolve()),
        metrics_path=str(run.directory / "metrics.jsonl"),
        has_training=bool(run.train),
        summary=_summary_items(run) if run.train else [],
        events=_event_rows(run),
        config=_config_sections(run.config) if run.config else None,
        plan=_plan_rows(run.plan) if run.plan else None,
        plan_warnings=list((run.plan or {}).get("warnings") or []),
        generated=format_time(datetime.datetime.now().timestamp()),
    )
