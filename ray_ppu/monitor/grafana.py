"""The Grafana board of the gauges workers export (``cluster/grafana/ray_ppu.json``), built
from :data:`ray_ppu.monitor.ray_gauges.GAUGES` so that the two cannot drift apart by hand.

Regenerate the committed board after changing a gauge or a panel::

    python -m ray_ppu.monitor.grafana > cluster/grafana/ray_ppu.json

tests/test_monitoring.py asserts the committed file is this module's output. GAUGES says what
is exported; :data:`PANELS` below says how it is charted: which gauges share a panel, the
panel's title and Grafana unit, and whether the panel shows every rank or rank 0 only (every
rank logs the same reduced loss, learning rate, progress and event counts; throughput, memory
and data wait are each rank's own). Imports neither Ray nor torch: it runs anywhere.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from ray_ppu.monitor.ray_gauges import GAUGES


class Panel(NamedTuple):
    title: str
    keys: tuple[str, ...]  # metrics.jsonl keys of GAUGES, one query each
    unit: str = "none"  # Grafana's unit id
    per_rank: bool = False  # a line per rank, else rank 0's


# In board order: two panels a row, left then right.
PANELS: tuple[Panel, ...] = (
    Panel("Training and validation loss", ("lm_loss", "valid_lm_loss")),
    Panel("Throughput (tokens/s, whole run)", ("tokens_per_s",)),
    Panel("Tokens/s per device", ("tokens_per_s_per_device",), per_rank=True),
    Panel("TFLOP/s per device (Megatron-LM count)", ("tflops_per_device",), per_rank=True),
    Panel("MFU", ("mfu",), unit="percentunit", per_rank=True),
    Panel("Iteration time", ("step_time_s",), unit="s", per_rank=True),
    Panel("Data wait per iteration", ("data_wait_s",), unit="s", per_rank=True),
    Panel("Peak device memory", ("peak_memory_gib",), per_rank=True),
    Panel("Learning rate", ("lr",)),
    Panel("Gradient norm", ("grad_norm",)),
    Panel("fp16 loss scale and skipped steps", ("loss_scale", "skipped_iterations")),
    Panel("Validation perplexity", ("valid_ppl",)),
    Panel("Progress (iterations) and ETA", ("iteration", "eta_s")),
    Panel("Restarts, failed saves, world size",
          ("restarts", "checkpoint_failures", "world_size")),
    Panel("Checkpoint time", ("checkpoint_time_s",), unit="s"),
    Panel("MoE routing: load-balancing loss, busiest expert / mean",
          ("moe_load_balancing_loss", "moe_expert_load_max_over_mean")),
)

TITLE = "ray_ppu training"
UID = "ray-ppu-training"
DESCRIPTION = ("Metrics ray_ppu workers export with ray.util.metrics (ray_ppu/monitor/ray_gauges.py), "
               "tagged by run and rank")
# Panels are half the board wide (Grafana's grid is 24 columns) and 8 rows high.
_WIDTH, _HEIGHT = 12, 8
# Every panel and query reads the data source the board's picker chose.
_DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _prometheus_name(key: str) -> str:
    return "ray_" + GAUGES[key][0]  # Ray prefixes the names it exports


def _target(ref_id: str, key: str, per_rank: bool) -> dict:
    name = _prometheus_name(key)
    if per_rank:
        expr = f'max by (run, rank) ({name}{{run=~"$run"}})'
        legend = f"{{{{run}}}} rank {{{{rank}}}} {key}"
    else:
        expr = f'max by (run) ({name}{{run=~"$run", rank="0"}})'
        legend = f"{{{{run}}}} {key}"
    return {"refId": ref_id, "datasource": dict(_DATASOURCE), "expr": expr,
            "legendFormat": legend}


def _panel(index: int, panel: Panel) -> dict:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": panel.title,
        "gridPos": {"h": _HEIGHT, "w": _WIDTH, "x": (index % 2) * _WIDTH,
                    "y": (index // 2) * _HEIGHT},
        "datasource": dict(_DATASOURCE),
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"}},
        "targets": [_target(chr(ord("A") + i), key, panel.per_rank)
                    for i, key in enumerate(panel.keys)],
    }


def _templating() -> dict:
    """The data source picker and the run picker (the runs that export an iteration)."""
    runs = f"label_values({_prometheus_name('iteration')}, run)"
    return {"list": [
        {"name": "datasource", "type": "datasource", "query": "prometheus",
         "label": "Prometheus"},
        {"name": "run", "type": "query", "label": "Run", "multi": True, "includeAll": True,
         "datasource": dict(_DATASOURCE), "query": {"query": runs, "refId": "run"},
         "definition": runs, "refresh": 2},
    ]}


def check_panels() -> None:
    """Every gauge on exactly one panel, and no panel key that is not a gauge: a gauge added
    to GAUGES without a panel fails here rather than going uncharted."""
    placed = [key for panel in PANELS for key in panel.keys]
    unknown = sorted(set(placed) - set(GAUGES))
    twice = sorted({key for key in placed if placed.count(key) > 1})
    missing = sorted(set(GAUGES) - set(placed))
    if unknown or twice or missing:
        raise ValueError(f"PANELS and GAUGES disagree: not gauges {unknown}, charted twice "
                         f"{twice}, on no panel {missing}")


def dashboard() -> dict:
    """The board, as Grafana's Dashboards → Import reads it."""
    check_panels()
    return {
        "title": TITLE,
        "uid": UID,
        "description": DESCRIPTION,
        "tags": ["ray", "ray_ppu", "megatron"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": _templating(),
        "panels": [_panel(i, panel) for i, panel in enumerate(PANELS)],
    }


def dashboard_json() -> str:
    """The text of cluster/grafana/ray_ppu.json."""
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    print(dashboard_json(), end="")
