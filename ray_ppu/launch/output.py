"""Run bookkeeping shared by the entry points: output directory and start-of-run log."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import yaml

from ray_ppu.config.schema import RunConfig
from ray_ppu.plan import Plan

log = logging.getLogger("ray_ppu")


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _absolute_blend(items: list[str]) -> list[str]:
    """Prefixes resolved, blend weights (``[0.3, prefix, ...]``) kept as they are."""
    from ray_ppu.data.idxmap import is_number

    return [item if is_number(item) else _absolute(item) for item in items]


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """Paths resolved against the submitting directory: workers run in other directories."""
    data = dataclasses.replace(
        cfg.data,
        data_path=_absolute_blend(cfg.data.data_path),
        valid_data_path=_absolute_blend(cfg.data.valid_data_path),
        index_cache_dir=_absolute(cfg.data.index_cache_dir) if cfg.data.index_cache_dir else None,
    )
    output = dataclasses.replace(cfg.output, dir=_absolute(cfg.output.dir))
    pretrained = cfg.checkpoint.pretrained
    checkpoint = dataclasses.replace(cfg.checkpoint,
                                     pretrained=_absolute(pretrained) if pretrained else None)
    return dataclasses.replace(cfg, data=data, output=output, checkpoint=checkpoint)


def prepare_output(cfg: RunConfig, plan: Plan) -> Path:
    """Create the output directory, save the resolved config and plan, log the derived numbers."""
    out = Path(cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (out / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2))
    log.info(
        "world %d = TP %d × CP %d × PP %d × DP %d | global batch %d = DP %d × micro %d × %d microbatches"
        " | %d iterations × %d tokens = %.3g tokens | %.3g params (%.3g per device) | %.3g FLOPs/iter",
        plan.world_size, plan.tensor_model_parallel_size, plan.context_parallel_size,
        plan.pipeline_model_parallel_size, plan.data_parallel_size, plan.global_batch_size,
        plan.data_parallel_size, plan.micro_batch_size, plan.num_microbatches, plan.train_iters,
        plan.global_batch_size * plan.seq_length, plan.train_tokens, plan.num_parameters,
        plan.num_parameters_per_device, plan.flops_per_iteration,
    )
    if plan.eval_iters:
        log.info("validation every %d iterations and at the end: %d × %d samples per pass, "
                 "%d validation samples in all", plan.eval_interval, plan.eval_iters,
                 plan.global_batch_size, plan.valid_samples)
    return out
