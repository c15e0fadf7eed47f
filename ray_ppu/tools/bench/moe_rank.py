"""One rank of ``benchmark.py moe``: trains each of its runs as a rank of a run does, with the MoE
layers' token dispatchers timed.

    python -m torch.distributed.run --nproc-per-node 2 -m ray_ppu.tools.bench.moe_rank \\
        --runs runs.json --result figures.json section.field=value ...

``--runs``: a JSON object ``{name: [section.field=value, ...]}`` trained in turn on one
process group (the start is paid once), each on top of the common overrides. The timing needs
the model object in the training process, which ``train_rank`` keeps to itself, so this module
builds what it builds (parallel state, model, optimizer, in-process data as under
``torchrun_pretrain.py``) and runs the same loop (:func:`ray_ppu.train.loop.train`), with a
:class:`~ray_ppu.tools.bench.dispatch_clock.DispatcherClock` on the model. Rank 0 writes
``--result``: per run, every iteration's training row, each rank's dispatcher seconds per
iteration, and the plan's figures for throughput and MFU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", required=True, help="JSON file {name: [key=value, ...]}")
    parser.add_argument("--result", required=True, help="figures written here by rank 0")
    parser.add_argument("overrides", nargs="*", help="section.field=value, every run")
    args = parser.parse_args()
    logging.getLogger("megatron.core").setLevel(logging.WARNING)

    import torch.distributed as dist

    from ray_ppu import devices
    from ray_ppu.config.loader import load
    from ray_ppu.launch.output import absolute_paths

    runs = json.loads(Path(args.runs).read_text())
    configs = {name: absolute_paths(load(None, [*args.overrides, *extra]))
               for name, extra in runs.items()}
    backend = devices.resolve(next(iter(configs.values())).cluster.device)
    dist.init_process_group(backend=devices.dist_backend(backend))
    try:
        figures = {name: train_timed(cfg, backend) for name, cfg in configs.items()}
        if dist.get_rank() == 0:
            Path(args.result).write_text(json.dumps(figures, indent=2))
    finally:
        dist.destroy_process_group()


def _batches(cfg, plan):
    """This rank's training microbatches, read in-process (None where a rank reads none)."""
    import torch.distributed as dist

    from ray_ppu.data import idxmap, inprocess

    spec = idxmap.spec_for(cfg, plan)
    idxmap.check(spec)
    idxmap.datasets(spec)  # collective: rank 0 builds the index cache, then all load it
    return inprocess.rank_streams(spec, plan, dist.get_rank())[0]


def train_timed(cfg, backend) -> dict:
    """Train ``cfg`` with its dispatchers timed; the run's figures (the same on every rank but
    for ``dispatcher_s``, which all ranks' lists make up: gathered, a collective)."""
    import torch.distributed as dist

    from ray_ppu import devices
    from ray_ppu.model import parallel
    from ray_ppu.model.gpt import transformer_engine_available
    from ray_ppu.plan import build_plan
    from ray_ppu.plan.te_options import uses_transformer_engine

    plan = build_plan(cfg)
    batches = _batches(cfg, plan)
    with (devices.bound(backend, int(os.environ.get("LOCAL_RANK", 0))),
          parallel.groups(plan, cfg.training.seed)):
        rows, timed = _train(cfg, plan, backend, batches)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, timed)
    return {"rows": rows, "dispatcher_s": everyone, "layers": timed["layers"],
            "world_size": plan.world_size, "data_parallel_size": plan.data_parallel_size,
            "expert_model_parallel_size": plan.expert_model_parallel_size,
            "tokens_per_iteration": plan.global_batch_size * plan.seq_length,
            "flops_per_iteration": plan.flops_per_iteration,
            # the TE spec's experts are one grouped GEMM; the local spec's a loop of them
            "transformer_engine": uses_transformer_engine(cfg, transformer_engine_available(backend))}


def _train(cfg, plan, backend, batches) -> tuple[list[dict], dict]:
    """The loop of ``train_rank`` (model, optimizer, routing statistics, one training row per
    iteration) with a dispatcher clock read after every optimizer step."""
    from ray_ppu import devices
    from ray_ppu.model.gpt import build_model
    from ray_ppu.model.optim import build_optimizer
    from ray_ppu.tools.bench.dispatch_clock import DispatcherClock
    from ray_ppu.train.loop import Hooks, TrainState, train
    from ray_ppu.train.moe_metrics import expert_load

    model, config = build_model(cfg, plan, backend)
    optimizer, scheduler = build_optimizer(cfg, plan, model)
    device = devices.torch_device(backend)
    state = TrainState(plan, model, optimizer, scheduler, device,
                       expert_load=expert_load(model, config, device))
    clock = DispatcherClock(model, cuda=backend == "ppu")
    rows: list[dict] = []
    timed = {"layers": clock.layers, "forward": [], "backward": []}

    def on_iteration(done, sample_ids):
        forward, backward = clock.take()
        timed["forward"].append(forward)
        timed["backward"].append(backward)

    train(state, batches, Hooks(on_log=rows.append, on_iteration=on_iteration), log_interval=1)
    return [r for r in rows if "lm_loss" in r], timed


if __name__ == "__main__":
    main()
