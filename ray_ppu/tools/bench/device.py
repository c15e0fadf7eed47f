"""``benchmark.py device``: the options only a GPU / PPU runs (fp8, TE attention kernels,
activation / optimizer offload, CP 2), on every visible device; then a MoE at EP 1 vs EP = the
devices, with its token dispatcher's time and MFU; then a vision-language run (a 4-layer slice
of llava-qwen2.5-7b with the whole SigLIP-so400m, Bunny's stage 2) with MFU and memory; last
the Qwen-VL row's LoRA fine-tuning on a slice of qwen2.5-vl-7B (:mod:`.qwen_vl`). ``--part mfu``
(:mod:`.mfu`) is the speed check: four model kinds at their real width on the torch kernels,
MFU against the datasheet and a measured matmul, memory against the plan, a step profile each.

This is the prepared script others run on a lent GPU. On one H200 (no Transformer Engine) the
VL part took 89 s, the MoE part 35 s and the Qwen2.5-VL part 154 s (its random bf16 base
written first); each option is one torchrun of ~17 s of start-up plus
its iterations, so the 13 options of one device need ~4-5 minutes. Its command line
and its tables are a contract, so they change only together with their readers. ``--part``
runs one of the two. The matrix is :func:`ray_ppu.tools.option_matrix.device`, the MoE part
:func:`ray_ppu.tools.bench.moe.device`; on a machine without CUDA either stops, saying so
(tests/test_options.py and tests/test_benchmark_moe.py check the messages).
"""

from __future__ import annotations

import argparse

from ray_ppu.tools.bench.common import add_corpus_argument, work_and_corpus

HELP = ("GPU/PPU-only options (fp8, TE attention, activation offload, CP), MoE EP 1 vs EP N and "
        "a vision-language run: ran, losses, time, memory, dispatcher time, MFU")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default="outputs/benchmark_device", help="runs and corpus")
    add_corpus_argument(parser)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=120, help="per option or MoE run")
    parser.add_argument("--part", choices=("all", "options", "moe", "vl", "qwen-vl", "mfu"),
                        default="all", help="the option matrix, the MoE EP comparison, the "
                                            "LLaVA run, the Qwen2.5-VL LoRA run, all four, or "
                                            "mfu: each model kind's MFU, memory against the "
                                            "plan and step profile (not part of all)")
    parser.add_argument("--cases", nargs="+", default=None,
                        help="--part mfu: only these of dense, llava, qwen_vl, moe")


def main(args) -> dict:
    from ray_ppu.tools import option_matrix
    from ray_ppu.tools.bench import moe, qwen_vl, vl

    moe.require_cuda("benchmark.py device")  # before the corpus is built
    work, corpus = work_and_corpus(args)
    if args.part == "mfu":
        from ray_ppu.tools.bench import mfu

        return mfu.device(work / "mfu", corpus, args.iters, args.timeout, args.cases)
    results = {}
    if args.part in ("all", "options"):
        results["options"] = option_matrix.device(corpus, args.iters, work / "runs", args.timeout)
    if args.part in ("all", "moe"):
        # one launch trains both runs: twice the per-run timeout, plus the start
        results["moe"] = moe.device(corpus, args.iters, work / "moe", 2 * args.timeout + 120)
    if args.part in ("all", "vl"):  # under Ray Train: its start-up on top of the run
        results["vl"] = vl.device(work / "vl", args.iters, args.timeout + 120)
    if args.part in ("all", "qwen-vl"):
        results["qwen_vl"] = qwen_vl.device(work / "qwen_vl", args.iters, args.timeout + 120)
    return results
