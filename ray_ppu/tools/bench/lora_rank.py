"""One rank of ``benchmark.py lora``: trains one run as a rank of a run does, then measures what
the run keeps per rank.

    python -m torch.distributed.run --nproc-per-node 2 -m ray_ppu.tools.bench.lora_rank \\
        --result figures.json section.field=value ...

The figures need the model and optimizer objects, which ``train_rank`` keeps to itself, so this
module builds what it builds (parallel state, model, optimizer, the base weights from
``checkpoint.pretrained``, in-process data as under ``torchrun_pretrain.py``) and runs the same
loop. After training: the bytes of the DDP gradient buffers and of the optimizer's state (its
fp32 main parameters and Adam's moments) on this rank, its peak resident memory, and an
in-memory snapshot taken as the Ray path takes one (:func:`ray_ppu.recovery.snapshot.capture`,
timed: what the training thread waits) and its size (its tensors' bytes, what the keepers
receive but for pickling's few KB). Rank 0 writes ``--result``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import time
from pathlib import Path

SNAPSHOTS = 3  # captures timed after training; the median is reported


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", required=True, help="figures written here by rank 0")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args()
    logging.getLogger("megatron.core").setLevel(logging.WARNING)

    import torch.distributed as dist

    from ray_ppu import devices
    from ray_ppu.config.loader import load
    from ray_ppu.launch.output import absolute_paths

    cfg = absolute_paths(load(None, args.overrides))
    backend = devices.resolve(cfg.cluster.device)
    dist.init_process_group(backend=devices.dist_backend(backend))
    try:
        figures = train_measured(cfg, backend)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, figures.pop("rank"))
        if dist.get_rank() == 0:
            Path(args.result).write_text(json.dumps({**figures, "ranks": everyone}, indent=2))
    finally:
        dist.destroy_process_group()


def train_measured(cfg, backend) -> dict:
    """Train ``cfg``, then measure (module docstring); ``rank``: this rank's own figures."""
    from ray_ppu import devices
    from ray_ppu.model import parallel
    from ray_ppu.plan import build_plan
    from ray_ppu.tools.bench.moe_rank import _batches

    plan = build_plan(cfg)
    batches = _batches(cfg, plan)
    with (devices.bound(backend, int(os.environ.get("LOCAL_RANK", 0))),
          parallel.groups(plan, cfg.training.seed)):
        rows, rank = _train(cfg, plan, backend, batches)
    return {"rows": rows, "rank": rank, "world_size": plan.world_size,
            "tokens_per_iteration": plan.global_batch_size * plan.seq_length,
            "flops_per_iteration": plan.flops_per_iteration,
            "trainable_parameters": plan.num_trainable_parameters,
            "parameters": plan.num_parameters}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _tensors(value):
    """Every tensor in a nested snapshot."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _train(cfg, plan, backend, batches) -> tuple[list[dict], dict]:
    import torch

    from ray_ppu.hf.weights import load_pretrained
    from ray_ppu.model.gpt import build_model
    from ray_ppu.model.optim import build_optimizer
    from ray_ppu.recovery.snapshot import capture
    from ray_ppu.train.loop import Hooks, TrainState, train

    model, _ = build_model(cfg, plan, backend, initialize=False)
    optimizer, scheduler = build_optimizer(cfg, plan, model)
    load_pretrained(model, cfg.checkpoint.pretrained, cfg.model, plan.padded_vocab_size)
    optimizer.reload_model_params()
    device = torch.device("cuda") if backend == "ppu" else torch.device("cpu")
    state = TrainState(plan, model, optimizer, scheduler, device)
    rows: list[dict] = []
    train(state, batches, Hooks(on_log=rows.append), log_interval=1)

    inner = [opt.optimizer for opt in optimizer.chained_optimizers]
    grads = _bytes(b.grad_data for chunk in model for b in chunk.buffers)
    adam = _bytes(v for opt in inner for st in opt.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0)
    mains = _bytes(p for opt in inner for group in opt.param_groups for p in group["params"])
    blocking, size = [], 0
    for _ in range(SNAPSHOTS):
        started = time.perf_counter()
        snapshot = capture(plan.train_iters, model, optimizer, scheduler, backend == "ppu")
        blocking.append(time.perf_counter() - started)
        # what serialize writes, but for pickling's few KB: a full run's serialized copy on
        # top of the copy itself would not fit two ranks of this machine
        size = _bytes(_tensors(snapshot))
        del snapshot
    return rows, {"gradient_bytes": grads, "optimizer_bytes": adam + mains,
                  "adam_bytes": adam, "main_parameter_bytes": mains,
                  "snapshot_bytes": size, "snapshot_blocking_s": statistics.median(blocking),
                  # Linux reports the peak resident set in KiB
                  "peak_host_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                  * 1024}


if __name__ == "__main__":
    main()
