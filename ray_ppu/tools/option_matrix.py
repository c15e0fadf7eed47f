"""Train the same short run once per option and compare: the option matrix behind
``benchmark.py options`` (CPU) and ``benchmark.py device`` (a GPU / PPU machine).

Each variant is a list of ``section.field=value`` overrides on one base run; the runs go
through ``torchrun_pretrain.py --variants`` (real Megatron-Core, real data, the same loop as
under Ray Train). For every variant: did it run, do its losses match its reference variant's,
median iteration time, peak device memory, TFLOP/s per device and MFU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
WARMUP_ITERS = 2  # step times after these (the first iterations build caches)

# CPU: options Megatron-Core runs without CUDA. Name → (overrides, reference, tolerance): the
# losses must match the reference variant's to the relative tolerance at every iteration.
# "init" trains first and saves; every other variant fine-tunes from its checkpoint ("{out}":
# the matrix's output directory), so all layouts start from the same weights (Megatron seeds
# each pipeline stage differently, so a PP run would otherwise start elsewhere). Recompute and
# SP change no arithmetic; other layouts reduce in another order; 16-bit runs round.
# Optimizer offload is not here: Megatron-Core's hybrid-device optimizer splits states by
# param.is_cuda, which a CPU-only process has no two sides of (benchmark.py device runs it).
_FROM_INIT = ["checkpoint.load={out}/init/ray_train/init", "checkpoint.finetune=true",
              "checkpoint.enabled=false"]
CPU_VARIANTS: dict[str, tuple[list[str], Optional[str], float]] = {
    "init": (["training.train_iters=2", "training.lr_warmup_iters=0"], None, 0.0),
    # its last iteration under the step profiler (which changes no arithmetic)
    "plain": ([*_FROM_INIT, "output.profile_iters=1", "output.profile_start=3"], None, 0.0),
    # Megatron-Core's reference attention and loss, against the torch kernels of the others
    "reference_kernels": ([*_FROM_INIT, "training.attention_backend=local",
                           "training.cross_entropy=megatron"], "plain", 1e-5),
    "no_overlap": ([*_FROM_INIT, "parallel.overlap_grad_reduce=false",
                    "parallel.overlap_param_gather=false"], "plain", 1e-6),
    "selective_recompute": ([*_FROM_INIT, "memory.recompute=selective"], "plain", 1e-6),
    "full_recompute_uniform": ([*_FROM_INIT, "memory.recompute=full",
                                "memory.recompute_num_layers=2"], "plain", 1e-6),
    "full_recompute_block": ([*_FROM_INIT, "memory.recompute=full", "memory.recompute_method=block",
                              "memory.recompute_num_layers=1"], "plain", 1e-6),
    "distributed_optimizer_off": ([*_FROM_INIT, "training.use_distributed_optimizer=false"],
                                  "plain", 1e-5),
    "tp2": ([*_FROM_INIT, "parallel.tensor_model_parallel_size=2"], "plain", 1e-5),
    "tp2_sequence_parallel": ([*_FROM_INIT, "parallel.tensor_model_parallel_size=2",
                               "parallel.sequence_parallel=true"], "tp2", 1e-6),
    "pp2": ([*_FROM_INIT, "parallel.pipeline_model_parallel_size=2"], "plain", 1e-5),
    "pp2_virtual_pipeline": ([*_FROM_INIT, "parallel.pipeline_model_parallel_size=2",
                              "parallel.num_layers_per_virtual_pipeline_stage=1"], "pp2", 1e-5),
    "bf16": ([*_FROM_INIT, "training.precision=bf16"], "plain", 2e-2),
    # a small initial scale: 2**32 (Megatron's default) skips the first ~20 steps on overflow
    "fp16_loss_scaling": ([*_FROM_INIT, "training.precision=fp16",
                           "training.initial_loss_scale=4096"], "plain", 2e-2),
}

# GPU / PPU: the options that need CUDA and Transformer Engine, against a bf16 TE run. That
# run saves its final checkpoint (the one save of the matrix) as the base of LoRA's variant,
# which trains rank-16 adapters on it (another model, so its losses are its own: no reference).
DEVICE_VARIANTS: dict[str, tuple[list[str], Optional[str], float]] = {
    "bf16_te_auto": (["checkpoint.enabled=true"], None, 0.0),
    "lora_rank16": (["lora.enabled=true", "lora.rank=16", "lora.alpha=32",
                     "checkpoint.load={out}/bf16_te_auto/ray_train/bf16_te_auto"], None, 0.0),
    "attention_flash": (["training.attention_backend=flash"], "bf16_te_auto", 2e-2),
    "attention_fused": (["training.attention_backend=fused"], "bf16_te_auto", 2e-2),
    "attention_unfused": (["training.attention_backend=unfused"], "bf16_te_auto", 2e-2),
    "attention_local": (["training.attention_backend=local"], "bf16_te_auto", 2e-2),
    "fp8_hybrid": (["training.precision=fp8"], "bf16_te_auto", 5e-2),
    "fp16_loss_scaling": (["training.precision=fp16", "training.initial_loss_scale=65536"],
                          "bf16_te_auto", 5e-2),
    "selective_recompute": (["memory.recompute=selective"], "bf16_te_auto", 2e-2),
    "full_recompute": (["memory.recompute=full", "memory.recompute_num_layers=1"],
                       "bf16_te_auto", 2e-2),
    "activation_offload": (["memory.activation_offload_layers=1"], "bf16_te_auto", 2e-2),
    "optimizer_offload_static": (["memory.optimizer_offload=static"], "bf16_te_auto", 2e-2),
    "optimizer_offload_auto": (["memory.optimizer_offload=auto"], "bf16_te_auto", 2e-2),
    "context_parallel_2": (["parallel.context_parallel_size=2"], "bf16_te_auto", 2e-2),
}


def run_variants(variants: dict, base: list[str], nproc: int, out: Path,
                 separate: bool = False, timeout: float = 600) -> dict[str, dict]:
    """Train every variant; returns name → {ran, error, losses, step_time_s, peak_memory_gib,
    tflops_per_device}. ``separate``: one torchrun per variant (a failing option cannot take
    the others down; the device script), else all in one launch (CPU tests: one start)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in variants:  # metrics.jsonl appends: start each variant afresh
        shutil.rmtree(out / name, ignore_errors=True)
    groups = [[name] for name in variants] if separate else [list(variants)]
    results: dict[str, dict] = {}
    for names in groups:
        spec = out / f"variants_{names[0]}.json"
        spec.write_text(json.dumps({n: [o.replace("{out}", str(out)) for o in variants[n][0]]
                                    for n in names}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               str(REPO / "entrypoints" / "torchrun_pretrain.py"), "--variants", str(spec),
               f"output.dir={out}", *base]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            error = None if proc.returncode == 0 else _last_error(proc.stderr)
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout:.0f} s"
        for name in names:
            results[name] = r = _read(out / name, error)
            if separate:  # as each finishes: a device call cut short still shows what ran
                print(f"{name}: {_progress(r)}", flush=True)
    return results


def _progress(r: dict) -> str:
    """One finished variant in a line."""
    if not r["ran"]:
        return f"did not run: {r['error']}"
    peak = r.get("peak_memory_gib")
    return (f"{1e3 * r['step_time_s']:.0f} ms/step, peak "
            f"{'-' if peak is None else f'{peak:.1f} GiB'}, losses {r['losses'][0]:.3f} → "
            f"{r['losses'][-1]:.3f}")


def _last_error(stderr: str) -> str:
    """The exception a failed launch died of: the last ``...Error: ...`` line of a rank."""
    errors = [line.split("]:", 1)[-1].strip() for line in stderr.splitlines()
              if re.search(r"\w(Error|Exception|Missing): ", line) and "ChildFailedError" not in line]
    return (errors[-1] if errors else "failed (see the torchrun output)")[:300]


def _read(out: Path, error: Optional[str]) -> dict:
    """A variant's figures from its metrics.jsonl; it ran when every iteration was logged
    (``error``: its launch failed; it applies to the variants that did not finish)."""
    metrics = out / "metrics.jsonl"
    rows = ([json.loads(line) for line in metrics.read_text().splitlines()]
            if metrics.exists() else [])
    rows = [r for r in rows if "lm_loss" in r]
    ran = bool(rows) and rows[-1]["iteration"] == rows[-1]["train_iters"]
    steady = rows[WARMUP_ITERS:] or rows
    result = {"ran": ran, "error": None if ran else (error or "did not finish"),
              "losses": [r["lm_loss"] for r in rows]}
    if rows:
        result["step_time_s"] = statistics.median(r["step_time_s"] for r in steady)
        result["tflops_per_device"] = statistics.median(r["tflops_per_device"] for r in steady)
        peaks = [r["peak_memory_gib"] for r in rows if "peak_memory_gib" in r]
        result["peak_memory_gib"] = max(peaks) if peaks else None
        result["skipped_iterations"] = sum(r.get("skipped_iterations", 0) for r in rows)
        result["loss_scale"] = rows[-1].get("loss_scale")
    return result


def compare(variants: dict, results: dict[str, dict]) -> dict[str, Optional[bool]]:
    """Per variant: whether its losses match its reference's within its tolerance (None: no
    reference, or one of the two did not run)."""
    verdicts = {}
    for name, (_, reference, tolerance) in variants.items():
        mine, theirs = results[name], results.get(reference) if reference else None
        if not (theirs and mine["ran"] and theirs["ran"]):
            verdicts[name] = None
            continue
        pairs = list(zip(mine["losses"], theirs["losses"]))
        verdicts[name] = (len(mine["losses"]) == len(theirs["losses"]) and
                          all(abs(a - b) <= tolerance * abs(b) for a, b in pairs))
    return verdicts


def print_table(variants: dict, results: dict, peak_tflops: Optional[float]) -> None:
    """One row per variant; ``peak_tflops``: the device's bf16 peak, for MFU (None: a CPU,
    whose peak is unknown: MFU n/a, not a percentage of a PPU's)."""
    verdicts = compare(variants, results)
    print(f"{'option':28s} {'ran':4s} {'loss matches':13s} {'iter time':>10s} "
          f"{'peak mem':>9s} {'TFLOP/s':>8s} {'MFU':>6s}")
    for name in variants:
        r = results[name]
        match = {True: "yes", False: "NO", None: "-"}[verdicts[name]]
        if not r["ran"]:
            print(f"{name:28s} {'no':4s} {match:13s} {r['error']}")
            continue
        peak = f"{r['peak_memory_gib']:.2f} GiB" if r.get("peak_memory_gib") is not None else "-"
        mfu = f"{r['tflops_per_device'] / peak_tflops:6.1%}" if peak_tflops else f"{'n/a':>6s}"
        print(f"{name:28s} {'yes':4s} {match:13s} {r['step_time_s'] * 1000:8.1f}ms "
              f"{peak:>9s} {r['tflops_per_device']:8.2f} {mfu}")


def cpu_base(corpus: str, iters: int = 3) -> list[str]:
    """The CPU matrix's base run: tiny model with 4 layers (VP needs 2 per stage), fp32, DP 2."""
    return [f"data.data_path=[{corpus}]", "cluster.device=cpu", "cluster.num_workers=2",
            "training.precision=fp32", "model.preset=tiny", "model.num_layers=4",
            "model.make_vocab_size_divisible_by=64", f"training.train_iters={iters}",
            "training.global_batch_size=4", "training.micro_batch_size=1",
            "training.seq_length=32", "training.lr=2e-2", "training.min_lr=3e-4",
            "training.lr_warmup_iters=1", "training.eval_iters=0", "data.split=100,0,0",
            "output.tensorboard=false"]


def device_base(corpus: str, iters: int, nproc: int, accelerator: str) -> list[str]:
    """The device matrix's base run: the 0.5B preset at 2048 tokens, bf16, one worker per
    device (TE where installed)."""
    return [f"data.data_path=[{corpus}]", "cluster.device=ppu", f"cluster.num_workers={nproc}",
            f"cluster.accelerator={accelerator}", "model.preset=0.5B",
            f"training.train_iters={iters}", f"training.global_batch_size={8 * nproc}",
            "training.micro_batch_size=2", "training.seq_length=2048", "training.lr=1e-4",
            "training.min_lr=1e-5", "training.lr_warmup_iters=2", "training.eval_iters=0",
            "data.split=100,0,0", "output.tensorboard=false",
            "checkpoint.enabled=false"]  # 13 saves of ~7 GB would fill the disk and the time


def options(corpus: str, out: Optional[Path] = None) -> dict[str, dict]:
    """The CPU matrix: every option trained and compared; prints the table."""
    with tempfile.TemporaryDirectory() as tmp:
        results = run_variants(CPU_VARIANTS, cpu_base(corpus), 2, out or Path(tmp))
    print_table(CPU_VARIANTS, results, None)
    return results


def device(corpus: str, iters: int, out: Path, timeout: float) -> dict[str, dict]:
    """The device matrix on every visible GPU / PPU (CP needs two); prints the table."""
    import torch

    from ray_ppu.devices.specs import SPECS, accelerator_of

    if not torch.cuda.is_available():
        raise SystemExit("benchmark.py device needs a CUDA(-compatible) device; this machine "
                         "has none (the CPU options: benchmark.py options)")
    nproc = torch.cuda.device_count()
    accelerator = accelerator_of(torch.cuda.get_device_name(0))
    variants = dict(DEVICE_VARIANTS)
    if nproc < 2:  # CP 2 needs two devices; say so instead of running it on one
        variants.pop("context_parallel_2")
    results = run_variants(variants, device_base(corpus, iters, nproc, accelerator), nproc, out,
                           separate=True, timeout=timeout)
    print(f"{nproc} × {torch.cuda.get_device_name(0)} (peak {SPECS[accelerator].bf16_tflops} "
          f"TFLOP/s bf16); 0.5B preset, seq 2048, {iters} iterations per option")
    print_table(variants, results, SPECS[accelerator].bf16_tflops)
    if "context_parallel_2" not in variants:
        print("context_parallel_2: not run (one device; CP 2 needs two)")
    return results
