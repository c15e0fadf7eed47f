"""``benchmark.py options``: every CPU-capable training option against the plain run.

The same short run once per option (precision, recompute, SP / VP, distributed optimizer,
overlap, ...) through :mod:`ray_ppu.tools.option_matrix`: a table of option, ran, loss matches
(its reference variant's losses at every iteration), iteration time, peak memory, TFLOP/s and
MFU. The GPU / PPU options are :mod:`ray_ppu.tools.bench.device`'s.
"""

from __future__ import annotations

import argparse

from ray_ppu.tools.bench.common import add_corpus_argument, work_and_corpus

HELP = "each training option on CPU against the plain run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default="outputs/benchmark_options", help="runs and corpus")
    add_corpus_argument(parser)


def main(args) -> dict:
    from ray_ppu.tools import option_matrix

    work, corpus = work_and_corpus(args)
    return option_matrix.options(corpus, work / "runs")
