"""What several benchmarks share: the subcommand parser of their front ends, the small corpus
they train on when none is named, the metrics.jsonl rows their figures come from, and the
``--json`` file the figures go to.

Heavy imports stay inside the functions: ``entrypoints/benchmark.py`` imports every bench
module to build its ``--help``, which must not start torch or Ray.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def subcommand_parser(description: str, dest: str, modules: dict):
    """(parser, its subparsers): one subcommand per ``name: module`` (the module's ``HELP`` and
    ``add_arguments``), in the dict's order; the description printed as written. Both front
    ends (entrypoints/benchmark.py, tests/faults/scenarios.py) build theirs with it."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest=dest, required=True)
    for name, module in modules.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP))
    return parser, sub


def add_corpus_argument(parser: argparse.ArgumentParser) -> None:
    """--corpus: the runs' idxmap; without it, :func:`default_corpus` under --dir."""
    parser.add_argument("--corpus", default=None,
                        help="idxmap prefix (default: a small stdlib one)")


def work_and_corpus(args) -> tuple[Path, str]:
    """``--dir`` resolved, and ``--corpus`` or the default corpus built under it."""
    work = Path(args.dir).resolve()
    return work, args.corpus or default_corpus(work)


def default_corpus(work: Path) -> str:
    """A small idxmap of the standard library's sources under ``work`` (built once)."""
    from ray_ppu.tools.demo import build_stdlib_corpus
    from ray_ppu.data.tokenizer import qwen2

    corpus = str(work / "corpus" / "stdlib_text_document")
    build_stdlib_corpus(corpus, qwen2(), max_bytes=600_000)
    return corpus


def metrics_rows(out: Path) -> list[dict]:
    """The rows of ``out/metrics.jsonl`` so far ([] before the run wrote any)."""
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_json(path: str | Path, obj, indent: int | None = 2) -> None:
    """``obj`` as JSON at ``path``; what JSON cannot hold (paths, exceptions) as its str."""
    Path(path).write_text(json.dumps(obj, indent=indent, default=str))


def launch_ranks(module: str, args: list[str], nproc: int, timeout: float, what: str):
    """``python -m torch.distributed.run --nproc-per-node NPROC -m MODULE ARGS`` on a free port,
    one thread per rank (ranks share the cores); SystemExit naming ``what`` when it runs past
    ``timeout`` or fails (with the end of its stderr)."""
    import os
    import subprocess
    import sys

    from ray_ppu.util.net import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port("127.0.0.1")), "-m", module, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{what}: the ranks ran past --timeout {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise SystemExit(f"{what}: the ranks failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    return proc


def photos(root: Path, count: int) -> list[Path]:
    """``count`` 640 × 480 JPEGs (quality 90) made once under ``root``."""
    import numpy as np
    from PIL import Image, ImageDraw

    root.mkdir(parents=True, exist_ok=True)
    paths = [root / f"photo_{i:05d}.jpg" for i in range(count)]
    rng = np.random.default_rng(0)
    for path in paths:
        if path.exists():
            continue
        y, x = np.mgrid[0:480, 0:640]
        base = np.stack([(x * rng.uniform(0.1, 0.4) + y * rng.uniform(0.1, 0.4)) % 256
                         for _ in range(3)], axis=-1)
        noisy = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        image = Image.fromarray(noisy)
        pen = ImageDraw.Draw(image)
        for _ in range(6):
            x0, y0 = rng.integers(0, 560), rng.integers(0, 400)
            pen.ellipse((x0, y0, x0 + rng.integers(20, 80), y0 + rng.integers(20, 80)),
                        fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
        image.save(path, quality=90)
    return paths


def device_run_figures(overrides: list[str], run: Path, timeout: float, setting: str,
                       accelerator: str, label: str) -> dict:
    """``entrypoints/pretrain.py`` with ``overrides`` (writing ``run``; a failure stops the
    benchmark with its stderr), then its figures from metrics.jsonl, printed as one line under
    ``label``: step time, images/s, TFLOP/s and MFU over the steady windows (the first holds
    the first step's compilation), peak memory and the losses."""
    import subprocess
    import sys

    from ray_ppu.devices.specs import SPECS

    proc = subprocess.run([sys.executable, "entrypoints/pretrain.py", *overrides,
                           f"output.dir={run}"], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark.py device's {label} part failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    rows = [r for r in metrics_rows(run) if "lm_loss" in r]
    steady = rows[1:] or rows
    tflops = sum(r["tflops_per_device"] for r in steady) / len(steady)
    figures = {"setting": setting, "losses": [r["lm_loss"] for r in rows],
               "step_time_s": sum(r["step_time_s"] for r in steady) / len(steady),
               "images_per_s": sum(r["images_per_s"] for r in steady) / len(steady),
               "tflops_per_device": tflops, "mfu": tflops / SPECS[accelerator].bf16_tflops,
               "peak_memory_gib": max(r.get("peak_memory_gib", 0.0) for r in rows)}
    print(f"{label} ({setting}): {figures['step_time_s'] * 1e3:.0f} ms/step, "
          f"{figures['images_per_s']:.1f} images/s, {tflops:.1f} TFLOP/s per device, MFU "
          f"{figures['mfu']:.1%}, peak {figures['peak_memory_gib']:.1f} GiB; losses "
          f"{figures['losses'][0]:.3f} → {figures['losses'][-1]:.3f}")
    return figures
