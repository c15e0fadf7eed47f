"""The ray_ppu training loop under plain torchrun, without Ray (benchmarks, debugging).

    torchrun --nproc-per-node 2 entrypoints/torchrun_pretrain.py --config run.yaml [key=value ...]

Reads the same samples the Ray Data stream would deliver, in-process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from ray_ppu import devices, worker  # noqa: E402
from ray_ppu.config.loader import load  # noqa: E402
from ray_ppu.data import idxmap, local  # noqa: E402
from ray_ppu.plan import build_plan  # noqa: E402
from ray_ppu.data.order import valid_steps  # noqa: E402
from ray_ppu.run import absolute_paths  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML run config")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("megatron.core").setLevel(logging.WARNING)

    cfg = absolute_paths(load(args.config, args.overrides))
    plan = build_plan(cfg)
    backend = devices.resolve(cfg.cluster.device)
    dist.init_process_group(backend=devices.dist_backend(backend))
    rank = dist.get_rank()
    spec = idxmap.spec_for(cfg, plan)
    # Collective: Megatron's builder lets rank 0 build the index cache while the others wait,
    # then every rank loads it. Done up front so no read during training hits that barrier.
    idxmap.check(spec)
    idxmap.datasets(spec)

    coords = plan.dims.coordinates(rank)
    reads = any(r == rank for r, _ in plan.dims.data_ranks())
    rank_args = (spec, coords["dp"], plan.data_parallel_size, plan.global_batch_size,
                 plan.micro_batch_size)
    batches = local.microbatches(*rank_args, 0, plan.train_iters) if reads else None
    valid = (local.microbatches(*rank_args, 0, valid_steps(plan), "valid")
             if reads and plan.eval_iters else None)
    try:
        final = worker.run(cfg, plan, backend, int(os.environ.get("LOCAL_RANK", 0)), batches, valid)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"final": final}))


if __name__ == "__main__":
    main()
