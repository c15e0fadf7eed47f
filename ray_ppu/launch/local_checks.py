"""Everything the launch checks before it needs a cluster, shared with ``--dry-run``.

A dry run that passes what the launch then refuses teaches users to distrust it, so both call
:func:`check`: the memory plan against the device, the corpora (idxmap headers, sizes, token
ids) or the SFT files and tokenizer, and the checkpoint the run starts from. Every problem is
collected, so one run of either names them all, in the same words. Nothing is written:
``output.dir`` is the launch's to create, after these pass.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ray_ppu import checkpoint
from ray_ppu.config.schema import RunConfig
from ray_ppu.errors import ConfigError, UserError
from ray_ppu.monitor.trackers import problems as tracker_problems
from ray_ppu.plan import Plan
from ray_ppu.plan.fit import fit_problem


@dataclass(frozen=True)
class Checked:
    """What the checks found: the config with ``checkpoint.load`` made absolute (the workers
    run elsewhere), where the run starts (None: from scratch), one line per fact worth
    telling (the corpora, the starting point) and per thing worth a warning."""

    cfg: RunConfig
    resume: Optional[checkpoint.ResumePoint]
    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def check(cfg: RunConfig, plan: Plan, files: bool = True, data: bool = True) -> Checked:
    """Run every local check; a ConfigError lists every problem found (one line when there is
    one). ``files=False``: the memory plan only (planning where the data is not);
    ``data=False``: not the training data (the demo's corpus is made by its launch)."""
    problems, lines, warnings, resume = [], [], [], None
    found = fit_problem(cfg, plan)
    if found:
        problems.append(found)
    problems += tracker_problems(cfg.output.trackers, cfg.output.wandb_mode)
    if cfg.vision.native and importlib.util.find_spec("transformers") is None:
        problems.append(f"vision.encoder={cfg.vision.encoder} runs transformers' vision tower: "
                        f"pip install 'transformers>=5.25' (or pip install 'ray-ppu[qwen-vl]')")
    if files and data:
        lines += _data_lines(cfg, plan, problems)
        lines += _sft_lines(cfg, plan, problems, warnings)
    if files:
        try:
            cfg, resume, start, warning = starting_point(cfg, plan)
            lines.append(start)
            warnings += [warning] if warning else []
        except UserError as err:
            problems.append(str(err))
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:  # a problem of several lines (a corpus's files) stays together, indented
        raise ConfigError("the run cannot start:\n  - " + "\n  - ".join(
            problem.replace("\n", "\n    ") for problem in problems))
    return Checked(cfg, resume, lines, warnings)


def unchecked(cfg: RunConfig) -> list[str]:
    """What a plan made from the config alone (``files=False``) leaves for the run's checks."""
    found = ["the training data (data.data_path, data.valid_data_path)"
             + (": files, records, images" if cfg.data.dataset == "sft" else ": headers, sizes, token ids")]
    if cfg.data.dataset == "sft":
        found.append("data.tokenizer and its chat template")
    if cfg.checkpoint.pretrained:
        found.append("checkpoint.pretrained (its config.json against the preset, its weights)")
    found.append("where the run starts (checkpoint.load, output.dir's checkpoints)")
    if not os.environ.get("RAY_ADDRESS"):
        found.append("the cluster (with RAY_ADDRESS set: its nodes, paths and devices)")
    return found


def _data_lines(cfg: RunConfig, plan: Plan, problems: list[str]) -> list[str]:
    """idxmap: every corpus of both splits (:func:`ray_ppu.data.idxmap.check`); its problems
    go to ``problems``."""
    if cfg.data.dataset != "idxmap":
        return []
    from ray_ppu.data import idxmap

    try:
        found = idxmap.check(idxmap.spec_for(cfg, plan))
    except UserError as err:
        problems.append(str(err))
        return []
    return [f"corpus {info.prefix}: {info.documents} documents, {info.tokens:.4g} tokens "
            f"({info.dtype})" for info in found]


def _sft_lines(cfg: RunConfig, plan: Plan, problems: list[str], warnings: list[str]) -> list[str]:
    """SFT: the JSON inputs of both splits exist and hold data; the tokenizer and its chat
    template load (what Ray Data's pipeline checks first, here before the cluster); then a
    sample of every file read as the pipeline reads it (:mod:`ray_ppu.data.sft.sample_check`):
    its bad records are warnings, or problems under the run's policy."""
    if cfg.data.dataset != "sft":
        return []
    from ray_ppu.data.sft.files import resolve_sft_inputs
    from ray_ppu.data.sft.windows import as_encoder

    d, counts, found, before = cfg.data, [], {}, len(problems)
    for split, paths in (("train", d.data_path), ("valid", d.valid_data_path)):
        if paths:
            try:
                found[split] = resolve_sft_inputs(paths)
                counts.append(f"{len(found[split])} {split} file(s)")
            except UserError as err:
                problems.append(f"{_paths_key(split)}: {err}")
    try:
        encoder = as_encoder(str(Path(d.tokenizer).expanduser().resolve()))
    except (UserError, OSError, ValueError) as err:
        problems.append(f"data.tokenizer: {err}")
    if len(problems) > before:
        return []
    lines = [f"SFT data: {', '.join(counts)}; tokenizer {d.tokenizer}"]
    if d.check_records:
        lines += _sample_lines(cfg, plan, found, encoder, problems, warnings)
    return lines


def _sample_lines(cfg: RunConfig, plan: Plan, files: dict, encoder, problems: list[str],
                  warnings: list[str]) -> list[str]:
    """Each split's sample: its line; its bad records as warnings (per reason, the first few),
    or a problem when the run's policy refuses them."""
    from ray_ppu.data import sft_store
    from ray_ppu.data.sft import sample_check
    from ray_ppu.data.sft.rows import SFTOptions

    d = cfg.data
    try:
        spec = sft_store.spec_for(cfg, plan)
        options = SFTOptions(spec.seq_length, spec.max_padding_length, spec.packing,
                             vision=spec.vision)
    except (UserError, OSError, ValueError) as err:
        problems.append(str(err))
        return []
    lines = []
    for split, paths in files.items():
        try:
            report = sample_check.sample_split(split, paths, encoder, options, d.check_records)
        except UserError as err:  # a file that cannot be read at all
            problems.append(f"{_paths_key(split)}: {err}")
            continue
        lines.append(report.line())
        refused = sample_check.problems(report, d.on_bad_record, d.max_dropped_share)
        problems += refused
        if not refused and report.stats["dropped_total"]:
            warnings += [f"SFT {split} sample: {line}" for line in sample_check.bad_lines(report.stats)]
    return lines


def _paths_key(split: str) -> str:
    """The config key naming a split's SFT files."""
    return "data.data_path" if split == "train" else "data.valid_data_path"


def starting_point(cfg: RunConfig, plan: Plan):
    """Check the checkpoint settings and say where the run starts: ``(cfg with checkpoint.load
    absolute, the resume point or None, the line saying where, a warning or None)``."""
    checkpoint.check_sources(cfg)
    if cfg.checkpoint.load:
        load = str(Path(cfg.checkpoint.load).expanduser().resolve())
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load=load))
    try:
        resume = checkpoint.resume_point(cfg)
    except checkpoint.CheckpointError as err:
        raise ConfigError(str(err)) from None
    root = checkpoint.save_root(cfg)
    if resume is None:
        source = f" from {cfg.checkpoint.pretrained}" if cfg.checkpoint.pretrained else ""
        return cfg, None, f"no checkpoint in {root}: training from scratch{source}", None
    line = (f"starting from {resume.path}{' (weights only)' if resume.weights_only else ''} at "
            f"iteration {resume.iteration} ({resume.iteration * cfg.training.global_batch_size} "
            f"samples consumed)")
    warning = None
    if resume.iteration >= plan.train_iters:
        warning = (f"the run in {root} is already complete (iteration {resume.iteration} of "
                   f"{plan.train_iters}): nothing to train; use another output.dir or raise the "
                   f"training length")
    return cfg, resume, line, warning
