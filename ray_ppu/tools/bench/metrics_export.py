"""``benchmark.py metrics``: the cost of exporting every logged row to Ray's metrics.

The demo run under Ray Train (:func:`ray_ppu.tools.bench.overhead.one_run`, a local Ray the
run starts) with ``output.ray_metrics`` on and off, alternated round by round so both see the
same machine noise: median step times side by side and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from ray_ppu.tools.bench.overhead import build_demo_corpus, one_run

HELP = "Ray metrics export on vs off: step-time ratio"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("overrides", nargs="*", metavar="section.field=value")


def main(args) -> None:
    run(args.rounds, args.iters, args.overrides)


def run(rounds: int, iters: int, extra: list[str]) -> None:
    """The demo run under Ray Train with the Ray metrics export on and off, alternated; median
    step times side by side and their ratio."""
    build_demo_corpus(extra)
    switch = {"on": ["output.ray_metrics=true"], "off": ["output.ray_metrics=false"]}
    steps: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for kind in ("on", "off") if r % 2 == 0 else ("off", "on"):
                step = one_run("ray", Path(tmp) / f"{kind}{r}", iters, [*extra, *switch[kind]])["step_s"]
                steps[kind].append(step)
                print(f"round {r} metrics {kind:3s} median step {step * 1000:7.1f} ms", flush=True)
    on, off = statistics.median(steps["on"]), statistics.median(steps["off"])
    print(f"\nmedian step time: metrics on {on * 1000:.1f} ms, off {off * 1000:.1f} ms -> "
          f"ratio on/off {on / off:.4f}")
