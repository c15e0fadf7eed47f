"""A run's report: one self-contained HTML page drawn from its output directory.

:func:`write_report` reads ``metrics.jsonl`` (training, validation and event rows, see
:mod:`ray_ppu.monitor.metrics_log`), ``config.yaml`` and ``plan.json`` (:func:`ray_ppu.launch.output.prepare_output`)
and writes ``<output dir>/report.html``: a header (progress, final loss, time), SVG charts drawn
here (loss and validation loss per iteration, throughput and MFU or TFLOP/s per device over time
with restarts and checkpoints marked, data wait per iteration), the events, the config and the
plan. No JavaScript, no external assets: the file can be copied anywhere and opened offline.

Any of the three files may be missing or partial (a live run appends to metrics.jsonl): the
page shows what there is.

The parts, in the order a page is made: data.py reads the files and words the numbers,
charts.py picks the charts, svg.py draws them, page.html.j2 (a Jinja2 template shipped as
package data, rendered with autoescaping) lays out the page.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

import jinja2

from ray_ppu.monitor.report import svg
from ray_ppu.monitor.report.charts import charts_of
from ray_ppu.monitor.report.data import Run, load_run, page
from ray_ppu.util.fs import atomic_write_text

__all__ = ["REPORT_FILE", "Run", "load_run", "render", "write_report"]

REPORT_FILE = "report.html"


@functools.cache
def _template() -> jinja2.Template:
    # autoescape: every run-derived text is escaped by the template; only svg.draw's output
    # is Markup. keep_trailing_newline: the file ends in a newline, as text files do.
    environment = jinja2.Environment(autoescape=True, trim_blocks=True, lstrip_blocks=True,
                                     keep_trailing_newline=True,
                                     undefined=jinja2.StrictUndefined)
    source = resources.files(__package__).joinpath("page.html.j2").read_text(encoding="utf-8")
    return environment.from_string(source)


def render(run: Run) -> str:
    """The report page of a run."""
    return _template().render(page=page(run), charts=charts_of(run) if run.train else [],
                              draw=svg.draw)


def write_report(output_dir: str | Path) -> Path:
    """Write ``<output_dir>/report.html`` from the run's files and return its path.

    The page replaces the previous one in one step (a browser reloading it during a live run
    never reads half a page).
    """
    directory = Path(output_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such output directory")
    path = directory / REPORT_FILE
    atomic_write_text(path, render(load_run(directory)))
    return path
