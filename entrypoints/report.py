"""A run's report: one self-contained HTML page of its output directory.

    python entrypoints/report.py outputs/demo          # writes outputs/demo/report.html
    python entrypoints/report.py outputs/demo --open   # ... and opens it in a browser

Loss and validation loss per iteration, throughput and MFU (or TFLOP/s per device) over time
with restarts and checkpoints marked, data wait per iteration, the events, the config and the
plan; drawn from the directory's metrics.jsonl, config.yaml and plan.json. On a live run, run it
again for a fresh page. Exit status 2: the directory has no metrics.jsonl.
"""

from __future__ import annotations

import argparse
import sys
import webbrowser
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ray_ppu.errors import ConfigError, entry_point  # noqa: E402
from ray_ppu.monitor.report import write_report  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="the run's output.dir")
    parser.add_argument("--open", action="store_true", help="open the page in a browser")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    directory = Path(args.output_dir)
    if not (directory / "metrics.jsonl").is_file():
        raise ConfigError(f"{directory}: no metrics.jsonl here; is it a run's output.dir, and "
                          f"has the run started?")
    path = write_report(directory)
    print(path)
    if args.open:
        webbrowser.open(path.resolve().as_uri())
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main))
