"""The chart engine: a :class:`~ray_ppu.monitor.report.charts.Chart` drawn as inline SVG markup.

Hand-written rather than a plotting library's: the report promises a page that opens offline
without JavaScript or external assets, and a line chart with ticks, breaks, dots and vertical
markers is a hundred lines of SVG. The page's stylesheet (page.html.j2) colours the classes
used here (``grid``, ``tick``, ``line``, ``s0``/``s1``, ``marker``, the event kinds).

What :func:`draw` returns is trusted markup (:class:`markupsafe.Markup`, so the template's
autoescaping leaves it as it is): every text in it that comes from a run (series names, labels,
marker texts, event kinds) is escaped here, as it is built.
"""

from __future__ import annotations

from typing import NamedTuple

from markupsafe import Markup, escape as _e

from ray_ppu.monitor.report.charts import Chart, Marker, Series
from ray_ppu.monitor.report.data import format_value, nice_ticks, tick_labels

# The chart canvas (SVG user units; the page scales it to its column's width).
_W, _H = 640, 300
_LEFT, _RIGHT, _TOP, _BOTTOM = 72, 16, 14, 46


class _Scale(NamedTuple):
    lo: float
    hi: float
    start: float  # canvas coordinate of lo
    end: float  # canvas coordinate of hi

    def __call__(self, value: float) -> float:
        return self.start + (value - self.lo) / (self.hi - self.lo) * (self.end - self.start)


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
    for segment in series.segments():
        if not series.dots:
            coordinates = " ".join(f"{xs(x):.1f},{ys(y):.1f}" for x, y in segment)
            shapes.append(f'<polyline class="line" points="{coordinates}"><title>'
                          f'{_e(series.name)}</title></polyline>')
        if series.dots or len(segment) == 1:
            shapes += [f'<circle cx="{xs(x):.1f}" cy="{ys(y):.1f}" r="3.5"><title>'
                       f'{_e(series.name)}: {_e(format_value(y))} at {_e(x_label)} '
                       f'{_e(format_value(x))}</title></circle>' for x, y in segment]
    return f'<g class="series s{index}" data-name="{_e(series.name)}">{"".join(shapes)}</g>'


def draw(chart: Chart) -> Markup:
    """An SVG chart of ``chart.series`` (lines, or dots where ``Series.dots``) with its
    vertical markers; a "no data" paragraph when no series has a point."""
    points = [p for s in chart.series for p in s.finite_points()]
    if not points:
        return Markup('<p class="empty">no data</p>')
    x_values = [x for x, _ in points] + [m.x for m in chart.markers]
    y_values = [y for _, y in points]
    x_ticks = nice_ticks(min(x_values), max(x_values))
    y_ticks = nice_ticks(min(y_values), max(y_values))
    xs = _Scale(x_ticks[0], x_ticks[-1], _LEFT, _W - _RIGHT)
    ys = _Scale(y_ticks[0], y_ticks[-1], _H - _BOTTOM, _TOP)
    parts = _axes(xs, ys, x_ticks, y_ticks, chart.x_label, chart.y_label)
    parts += [_marker_svg(m, xs) for m in chart.markers]
    parts += [_series_svg(i, s, xs, ys, chart.x_label) for i, s in enumerate(chart.series)]
    # Markup: every run-derived text in parts was escaped above, as it was put in
    return Markup(f'<svg class="chart" viewBox="0 0 {_W} {_H}" role="img" '
                  f'aria-label="{_e(chart.y_label)} vs {_e(chart.x_label)}">{"".join(parts)}'
                  f'</svg>')
