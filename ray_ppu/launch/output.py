"""Run bookkeeping shared by the entry points: paths made absolute, the output directory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml

from ray_ppu.config.schema import RunConfig
from ray_ppu.plan import Plan


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
    cfg = dataclasses.replace(cfg, data=data, output=output, checkpoint=checkpoint)
    return _with_image_processor(cfg)


def _with_image_processor(cfg: RunConfig) -> RunConfig:
    """A vision-language run's data.image_processor made explicit (absolute; by default
    checkpoint.pretrained's, else the one checkpoint.load's checkpoint carries), so the
    driver's data preparation and every worker prepare images alike."""
    from ray_ppu.checkpoint.processor import image_processor_dir

    if not cfg.vision.enabled:
        return cfg
    given = cfg.data.image_processor
    found = _absolute(given) if given else image_processor_dir(cfg)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, image_processor=found))


def prepare_output(cfg: RunConfig, plan: Plan) -> Path:
    """Create the output directory and save the resolved config and plan in it (the launch
    does this once its local checks pass; its log has the plan's summary)."""
    out = Path(cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (out / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2))
    return out
