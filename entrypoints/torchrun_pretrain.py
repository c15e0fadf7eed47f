"""The ray_ppu training loop under plain torchrun, without Ray (benchmarks, debugging).

    torchrun --nproc-per-node 2 entrypoints/torchrun_pretrain.py --config run.yaml [key=value ...]
    torchrun ... entrypoints/torchrun_pretrain.py --config run.yaml --variants variants.json

Reads the same samples the readers would deliver, in-process. ``--variants``: a JSON
object ``{name: [key=value, ...]}``; the processes train each variant in turn (its overrides
on top of the others, output in ``<output.dir>/<name>``), so option comparisons pay the start
once (``benchmark.py options``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# as under Ray (ray_ppu.launch.process_group): before torch touches CUDA; the user's value wins
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ray_ppu import checkpoint, devices  # noqa: E402
from ray_ppu.config.loader import load  # noqa: E402
from ray_ppu.data import idxmap, inprocess  # noqa: E402
from ray_ppu.plan import build_plan  # noqa: E402
from ray_ppu.monitor.report import write_report  # noqa: E402
from ray_ppu.launch.output import absolute_paths, prepare_output  # noqa: E402
from ray_ppu.errors import ConfigError, UserError, entry_point  # noqa: E402
from ray_ppu.errors import report_before_group  # noqa: E402
from ray_ppu.train.rank import train_rank  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML run config")
    parser.add_argument("--variants", help="JSON file {name: [section.field=value, ...]}: "
                        "train each in turn")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    try:  # every rank finds the same mistake: one line, before any process group
        runs = _checked(args, int(os.environ.get("WORLD_SIZE", 1)))
    except (UserError, ValueError) as err:
        return report_before_group(err)

    backend = devices.resolve(runs[0][1].cluster.device)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "ppu":  # before NCCL and the memory counters: both need this rank's device
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=devices.dist_backend(backend))
    try:
        for name, cfg in runs:
            if backend == "ppu":  # each variant's own peak, on this rank's device
                torch.cuda.reset_peak_memory_stats(local_rank)
            final = train(cfg, backend)
            if dist.get_rank() == 0:
                print(json.dumps({"variant": name, "final": final} if name else {"final": final}))
    finally:
        dist.destroy_process_group()
    return 0


def _checked(args: argparse.Namespace, world_size: int) -> list[tuple[str, object]]:
    """(variant name, config) of every run, each checked against the path and the world
    torchrun started: a bad key, an SFT corpus, a plan for another world size."""
    variants = {"": []}
    if args.variants:
        try:
            variants = json.loads(Path(args.variants).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"--variants {args.variants}: {err}") from None
    base = load(args.config, args.overrides)
    runs = []
    for name, extra in variants.items():
        out = [f"output.dir={Path(base.output.dir) / name}"] if name else []
        cfg = absolute_paths(load(args.config, [*args.overrides, *extra, *out]))
        if cfg.data.dataset != "idxmap":
            raise ConfigError(f"data.dataset={cfg.data.dataset}: the torchrun path trains "
                              f"idxmap corpora; train SFT data with entrypoints/pretrain.py")
        plan = build_plan(cfg)
        if plan.world_size != world_size:
            raise ConfigError(f"torchrun started {world_size} processes, the plan is for "
                              f"{plan.world_size} (cluster.num_workers="
                              f"{cfg.cluster.num_workers}): set --nproc-per-node × --nnodes "
                              f"to it, or cluster.num_workers={world_size}")
        runs.append((name, cfg))
    return runs


def train(cfg, backend) -> dict:
    """One run of ``cfg`` on the existing process group; rank 0 writes config, plan and, at
    the end, the run report into the output directory."""
    plan = build_plan(cfg)
    rank = dist.get_rank()
    if rank == 0:
        prepare_output(cfg, plan)
    spec = idxmap.spec_for(cfg, plan)
    # Collective: Megatron's builder lets rank 0 build the index cache while the others wait,
    # then every rank loads it. Done up front so no read during training hits that barrier.
    started = time.perf_counter()
    idxmap.check(spec)
    idxmap.datasets(spec)
    startup = {"index": time.perf_counter() - started}  # the start: line, as under Ray

    batches, valid = inprocess.rank_streams(spec, plan, rank)
    final = train_rank(cfg, plan, backend, int(os.environ.get("LOCAL_RANK", 0)), batches, valid,
                       resume=_weights_to_load(cfg), startup=startup)
    if rank == 0 and cfg.output.report:
        write_report(cfg.output.dir)
    return final


def _weights_to_load(cfg):
    """``checkpoint.load`` with ``checkpoint.finetune``: weights only, training from iteration
    0. Resuming mid-run (exact data position, validation stream) is the Ray path's job."""
    resume = checkpoint.resume_point(cfg)
    if resume is not None and not resume.weights_only:
        raise SystemExit(f"{resume.path}: the torchrun path starts runs and fine-tunes "
                         f"(checkpoint.finetune=true); resume with entrypoints/pretrain.py")
    return resume

if __name__ == "__main__":
    sys.exit(entry_point(main))
