"""``benchmark.py device``: the options only a GPU / PPU runs (fp8, TE attention kernels,
activation / optimizer offload, CP 2), on every visible device.

This is the prepared script others run on a lent GPU (< 8 minutes on one H200): its command
line and its table are a contract, so they change only together with their readers. The
matrix is :func:`ray_ppu.tools.option_matrix.device`; on a machine without CUDA it stops,
saying so (tests/test_options.py checks the message).
"""

from __future__ import annotations

import argparse

from ray_ppu.tools.bench.common import add_corpus_argument, work_and_corpus

HELP = ("GPU/PPU-only options (fp8, TE attention, activation offload, CP): ran, losses, time, "
        "memory, MFU")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default="outputs/benchmark_device", help="runs and corpus")
    add_corpus_argument(parser)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=120, help="per option")


def main(args) -> dict:
    from ray_ppu.tools import option_matrix

    work, corpus = work_and_corpus(args)
    return option_matrix.device(corpus, args.iters, work / "runs", args.timeout)
