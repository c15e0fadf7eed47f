"""Benchmarks that print figures (not timed tests).

    python entrypoints/benchmark.py overhead [--rounds 3] [--iters 30] [--json FILE] [key=value ...]
    python entrypoints/benchmark.py data [--data-ranks 16] [--iters 20] [--json FILE]
    python entrypoints/benchmark.py sft [--records 60000] [--seq-length 2048] [--workers 1 2]
    python entrypoints/benchmark.py recovery [--dir DIR] [--reference] [--json FILE]
    python entrypoints/benchmark.py elastic [--dir DIR] [--reference] [--json FILE]
    python entrypoints/benchmark.py metrics [--rounds 4] [--iters 30] [key=value ...]
    python entrypoints/benchmark.py options [--dir DIR] [--corpus PREFIX]
    python entrypoints/benchmark.py device [--dir DIR] [--iters 20] [--timeout 120] [--part all|options|moe|vl|qwen-vl|mfu]
    python entrypoints/benchmark.py kernels [--rounds 2] [--iters 8] [--seq-length 4096] [--json FILE]
    python entrypoints/benchmark.py moe [--iters 10] [--json FILE] [--corpus PREFIX] [key=value ...]
    python entrypoints/benchmark.py hf-load [--sizes-gb 1 2 4] [--ranks 2] [--dir DIR]
    python entrypoints/benchmark.py lora [--rank 16] [--iters 3] [--dir DIR] [--json FILE]
    python entrypoints/benchmark.py vl [--images 200] [--iters 3] [--tiny-iters 12] [--dir DIR] [--json FILE]

``overhead``: the same tiny training run under Ray Train (a local Ray the run starts, and a job
joining a Ray already running) and under plain torchrun (in-process reads), alternated:
median step times, time to the first iteration, start-up phases, ratios; ``--json``
(ray_ppu.tools.bench.overhead).

``data``: the data path of one simulated node of ``--data-ranks`` data ranks (the reference 7B
layout's shape by default: seq 4096, mbs 1, gbs 256, DP 16, validation on) over a synthetic
idxmap corpus written once under ``--dir``, no training: reader processes, their PSS and CPU
seconds per 1,000 samples, time to every rank's first batch, tokens/s per rank beside a rank's
consumption (0.5B at 50 % MFU of a PPU); ``--json`` writes them (ray_ppu.tools.bench.data_path).

``sft``: a synthetic instruction corpus (``--records`` alpaca and chat records, a third
Chinese, log-normal lengths) read, templated, tokenized and padded or packed by the SFT Ray
Data pipeline with 1 and 2 tokenizer actors: records per second per core, and the fraction of
non-pad tokens per row, padded vs packed (the compute packing saves).

``metrics``: the demo run under Ray Train with ``output.ray_metrics`` on and off, alternated:
median step times and their ratio (the cost of exporting every logged row to Ray's metrics).

``options`` (CPU) and ``device`` (every visible GPU / PPU, < 8 minutes on one H200): the same
short run once per training option (precision, recompute, offload, SP / VP / CP, distributed
optimizer, attention backend); a table of option, ran, loss matches (its reference variant's
losses at every iteration), iteration time, peak memory, TFLOP/s and MFU
(``ray_ppu/tools/option_matrix.py``).

``device --part mfu`` (one H200, < 8 minutes): a Qwen2.5-7B slice at seq 4096 as deep as the
device holds, the llava-qwen2.5-7b and qwen2.5-vl-7B LoRA slices and a Qwen3-30B-A3B slice, on
the torch kernels: step time, TFLOP/s, MFU against the datasheet and a measured bf16 matmul,
peak memory against the plan, losses and a step profile each (ray_ppu.tools.bench.mfu).

``kernels``: the torch kernels (SDPA, chunked loss) against Megatron-Core's reference ones on
the CPU, side by side: the demo's median step time, and a packed SFT step at seq 4096's peak
host memory and time (ray_ppu.tools.bench.kernels).

``moe``: the tiny-moe preset (4 experts, top-2) on 2 CPU ranks at EP 1 (DP 2) and EP 2 (DP 2):
median step time, tokens/s, the time per step in Megatron-Core's token dispatcher (permutation,
all-to-all, unpermutation; forward and backward) and its share of the step, the EP2/EP1 ratios
and whether the two runs' losses agree; ``device`` measures the same on GPUs with a bigger MoE
and MFU (ray_ppu.tools.bench.moe).

``lora``: the Qwen2.5-0.5B architecture at TP 2, LoRA of rank 16 on all four linears beside
full fine-tuning of the same base, one torchrun launch each: step time, tokens/s, gradient and
optimizer bytes per rank, peak host memory, an in-memory snapshot's size and blocking time,
and the ratios against their targets (ray_ppu.tools.bench.lora).

``vl``: photo-like JPEGs decoded and preprocessed for SigLIP at 384 px as the data pipeline
does, per CPU, beside what one PPU consumes at 50 % MFU in the seed's Bunny layout: the CPUs a
16-PPU node needs for decoding; an image's bytes in uint8 vs float32 (ray_ppu.tools.bench.vl).

``hf-load``: synthetic multi-GB Hugging Face checkpoints loaded with ``checkpoint.pretrained``'s
code by --ranks CPU processes at TP = ranks and at PP = ranks: per-rank load time and peak host
memory against the checkpoint size (``entrypoints/hf_benchmark.py``).

``recovery``: node loss under Ray Train V2 on a simulated multi-node cluster
(``ray.cluster_utils.Cluster``: a CPU-only head and three nodes with one PPU each, one spare).
The tiny model trains on 2 workers (DP 2), saving every 2 iterations; once the checkpoint at
iteration 4 is complete a PPU node hosting a worker is removed (its raylet and worker killed)
and the group restarts on the survivors. Prints the time from the loss to the first completed iteration after it
(detection, worker-group restart, checkpoint load, first step), the iterations lost, and the
checkpoint save/load throughput against the raw write/read speed of the same disk.
``--reference`` runs the same job uninterrupted first (tests/test_faults.py compares them).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ray_ppu.tools.bench import (data_path, device, elastic, kernels, lora,  # noqa: E402
                                 metrics_export, moe, options, overhead, recovery, sft, vl)
from ray_ppu.tools.bench.common import subcommand_parser  # noqa: E402

# In --help's order; each module has HELP, add_arguments(parser) and main(args).
BENCHES = {"overhead": overhead, "data": data_path, "sft": sft, "elastic": elastic,
           "recovery": recovery, "metrics": metrics_export, "options": options,
           "device": device, "kernels": kernels, "moe": moe, "lora": lora, "vl": vl}
# Each runs on a Ray of its own, as this script re-run with --child: main(args, program).
SCENARIOS = ("elastic", "recovery")


def _add_hf_load(sub) -> None:
    """hf-load's code is entrypoints/hf_benchmark.py, also the script of its torchrun ranks."""
    hl = sub.add_parser("hf-load", help="HF checkpoint load time and peak host memory per rank "
                                         "vs checkpoint size")
    hl.add_argument("--sizes-gb", type=float, nargs="+", default=[1, 2, 4])
    hl.add_argument("--ranks", type=int, default=2, help="processes (TP or PP size)")
    hl.add_argument("--dir", default="outputs/benchmark_hf", help="synthetic checkpoints")


def main() -> None:
    parser, sub = subcommand_parser(__doc__, "bench", BENCHES)
    _add_hf_load(sub)
    args = parser.parse_args()
    if args.bench == "hf-load":
        import hf_benchmark  # entrypoints/: this script's directory is on sys.path

        hf_benchmark.hf_load(args.sizes_gb, args.ranks, Path(args.dir).resolve())
    elif args.bench in SCENARIOS:
        BENCHES[args.bench].main(args, Path(__file__))
    else:
        BENCHES[args.bench].main(args)


if __name__ == "__main__":
    main()
