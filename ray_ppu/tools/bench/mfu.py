"""``benchmark.py device --part mfu``: how fast each model kind trains on one device, and why.

Four slices of the models the seed's table trains, each at its real width, bf16, on the
torch kernels a device without Transformer Engine runs (:mod:`ray_ppu.plan.kernels`):

* **dense**: Qwen2.5-7B at seq 4096, as many layers as the memory plan fits in 80 % of the
  device (torchrun, the idxmap corpus);
* **llava**: llava-qwen2.5-7b (Bunny's shape) with the whole SigLIP-so400m, stage 2, seq 1024
  (Ray Train, the shapes corpus);
* **qwen_vl**: qwen2.5-vl-7B with its whole tower frozen, LoRA r64 on the language model,
  packed rows of 2048 tokens of 640 × 480 photos at native resolution (Ray Train; the seed's
  Qwen-VL row);
* **moe**: Qwen3-30B-A3B's layers (128 experts of 768, top 8) at seq 4096, as many as fit.

Per model: step time, model TFLOP/s (Megatron-LM's count), MFU against the datasheet peak and
against a bf16 matmul measured first in the same call, peak memory against the memory plan,
the losses, and the profile of its last two iterations (``output.profile_iters``:
``<run>/profile.txt``), printed as each finishes and as one table at the end.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[3]
FILL = 0.8  # the share of the device the memory plan may fill (the plan is ±10 %)
PROFILED = 2  # the last iterations, under the profiler (left out of the step times)

_COMMON = ["training.precision=bf16", "training.attention_backend=sdpa",
           "training.lr=1e-4", "training.min_lr=1e-5", "training.lr_warmup_iters=2",
           "training.log_interval=1", "training.eval_iters=0", "checkpoint.enabled=false",
           "output.tensorboard=false", "output.report=false", "output.ray_metrics=false",
           "cluster.device=ppu", "memory.require_fit=false"]
# name → (launch, overrides, the layer count is searched up to this, what it is)
CASES = {
    "dense": ("torchrun", ["model.preset=7B", "training.seq_length=4096",
                           "training.micro_batch_size=1", "data.split=100,0,0"], 28,
              "Qwen2.5-7B layers, seq 4096, mbs 1"),
    "llava": ("ray", ["model.preset=llava-qwen2.5-7b", "vision.freeze=[vision]",
                      "training.seq_length=1024", "training.micro_batch_size=4"], 12,
              "llava-qwen2.5-7b, SigLIP-so400m frozen, stage 2, seq 1024, mbs 4"),
    "qwen_vl": ("ray", ["model.preset=qwen2.5-vl-7B", "vision.freeze=[vision]",
                        "lora.enabled=true", "lora.rank=64", "lora.alpha=16",
                        "training.seq_length=2048", "training.micro_batch_size=2",
                        "data.packing=true"], 8,
                "qwen2.5-vl-7B, tower frozen, LoRA r64, packed 2048, native resolution"),
    "moe": ("torchrun", ["model.preset=qwen3-30B-A3B", "training.seq_length=4096",
                         "training.micro_batch_size=1", "data.split=100,0,0",
                         "parallel.expert_model_parallel_size=1"], 48,
            "Qwen3-30B-A3B layers (128 experts of 768, top 8), seq 4096, mbs 1"),
}
MICROBATCHES = 4  # per iteration on one device: the optimizer step amortised over four


def layers_that_fit(name: str, accelerator: str, memory_gib: Optional[float] = None) -> int:
    """The most layers of case ``name`` whose memory plan (without Transformer Engine) stays
    within :data:`FILL` of the device, up to the case's cap."""
    best = 1
    for layers in range(1, CASES[name][2] + 1):
        mem = planned_memory(name, accelerator, layers, memory_gib)
        if mem.total_gib > FILL * mem.device_memory_gib:
            break
        best = layers
    return best


def planned_memory(name: str, accelerator: str, layers: int,
                   memory_gib: Optional[float] = None):
    """The memory plan of case ``name`` at ``layers`` on one device without TE."""
    from ray_ppu.config.loader import load
    from ray_ppu.plan import build_plan
    from ray_ppu.plan.kernels import choose
    from ray_ppu.plan.memory import memory_plan

    overrides = CASES[name][1]
    cfg = load(None, [*_COMMON, *overrides, *_placeholders(name), f"model.num_layers={layers}",
                      f"cluster.accelerator={accelerator}", "cluster.num_workers=1",
                      f"training.global_batch_size={_gbs(overrides)}", "training.train_iters=10"])
    if memory_gib:
        cfg = dataclasses.replace(cfg, memory=dataclasses.replace(
            cfg.memory, device_memory_gib=memory_gib))
    return memory_plan(cfg, build_plan(cfg), choose(cfg, False))


def _gbs(overrides: list[str]) -> int:
    mbs = next(int(o.split("=")[1]) for o in overrides if o.startswith("training.micro_batch_size"))
    return mbs * MICROBATCHES


def _placeholders(name: str) -> list[str]:
    """What a plan needs to be built before the data exists (the paths are not read)."""
    if CASES[name][0] == "torchrun":
        return ["data.data_path=[corpus]"]
    # LoRA needs a base to plan; checkpoint.load is not read while planning (pretrained is)
    base = ["checkpoint.load=base"] if name == "qwen_vl" else []
    return ["data.dataset=sft", "data.data_path=[records.jsonl]", "data.tokenizer=tokenizer",
            *base]


def _release_device() -> None:
    """Give what this process's allocator caches back to the device (the runs are other
    processes, sized by the plan to 80 % of it)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def matmul_tflops(size: int = 8192, repeats: int = 20) -> float:
    """A bf16 ``size``³ matmul's rate on this device, on random data (the achievable peak)."""
    import torch

    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * size ** 3 * repeats / (start.elapsed_time(end) / 1e3) / 1e12


def _data(name: str, work: Path, corpus: str) -> list[str]:
    """The case's data overrides (made once under ``work``)."""
    if CASES[name][0] == "torchrun":
        return [f"data.data_path=[{corpus}]"]
    if name == "llava":
        from ray_ppu.tools import vl_demo

        paths = vl_demo.prepare(work / "llava")
        return ["data.dataset=sft", f"data.data_path=[{paths['train']}]",
                f"data.image_root={paths['image_root']}", f"data.tokenizer={paths['tokenizer']}"]
    from ray_ppu.tools.bench import qwen_vl

    return ["data.dataset=sft", f"data.data_path=[{qwen_vl.records(work / 'qwen_vl')}]"]


def _launch(name: str, overrides: list[str], run: Path, timeout: float) -> None:
    """The case's run in a process session of its own: past ``timeout`` the whole session
    (torchrun's worker, Ray's processes) is ended, so the next case finds the device free."""
    import os
    import signal

    launch = CASES[name][0]
    if launch == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
               str(REPO / "entrypoints" / "torchrun_pretrain.py")]
    else:  # a config file of its own (without one pretrain.py runs the demo and its corpus)
        (run / "case.yaml").write_text("{}\n")
        cmd = [sys.executable, str(REPO / "entrypoints" / "pretrain.py"), "--config",
               str(run / "case.yaml")]
    with open(run / "stderr.txt", "w") as err:
        proc = subprocess.Popen([*cmd, *overrides, f"output.dir={run}"], stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=grace)
                    break
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    continue
            code = f"timed out after {timeout:.0f} s"
    if code != 0:
        raise RuntimeError(f"exit {code}: {(run / 'stderr.txt').read_text()[-1500:]}")


def run_case(name: str, work: Path, corpus: str, iters: int, accelerator: str,
             matmul: float, timeout: float, layers: Optional[int] = None,
             shrink: tuple = ()) -> dict:
    """Train case ``name`` for ``iters`` iterations; its figures. ``layers``: instead of
    :func:`layers_that_fit`; ``shrink``: overrides last (a CPU rehearsal of the wiring with a
    tiny model: ``cluster.device=cpu``, ``model.hidden_size=…``)."""
    from ray_ppu.devices.specs import SPECS
    from ray_ppu.tools.bench.common import metrics_rows

    _, overrides, _, setting = CASES[name]
    layers = layers or layers_that_fit(name, accelerator)
    extra = [*_COMMON, *overrides, f"model.num_layers={layers}",
             f"cluster.accelerator={accelerator}", "cluster.num_workers=1",
             f"training.global_batch_size={_gbs(overrides)}", f"training.train_iters={iters}",
             f"output.profile_iters={PROFILED}", f"output.profile_start={iters - PROFILED + 1}",
             *shrink]
    if name == "qwen_vl":
        from ray_ppu.tools.bench import qwen_vl

        device = "cpu" if "cluster.device=cpu" in shrink else "cuda"
        base = qwen_vl.random_base(work / "qwen_vl" / f"base_{layers}", extra, device)
        extra.append(f"checkpoint.pretrained={base}")
        _release_device()  # the base was built on the device: its memory back to the run
    run = work / name
    run.mkdir(parents=True, exist_ok=True)
    overrides_all = [*extra, *_data(name, work, corpus)]
    started = time.perf_counter()
    _launch(name, overrides_all, run, timeout)
    rows = [r for r in metrics_rows(run) if "lm_loss" in r]
    if not rows:
        raise RuntimeError(f"the run logged no training row (see {run / 'stderr.txt'})")
    # steady iterations: after the first two (caches, autotuning), before the profiled ones
    steady = [r for r in rows if 2 < r["iteration"] <= iters - PROFILED] or rows
    step = sum(r["step_time_s"] for r in steady) / len(steady)
    tflops = sum(r["tflops_per_device"] for r in steady) / len(steady)
    planned = planned_memory(name, accelerator, layers).total_gib
    peak = max(r.get("peak_memory_gib", 0.0) for r in rows)
    profile = json.loads((run / "profile.json").read_text()) if (run / "profile.json").is_file() else None
    start_row = next((r for r in metrics_rows(run) if r.get("event") == "start"), {})
    return {"setting": f"{setting}, {layers} layers", "layers": layers,
            "step_time_s": step, "tflops_per_device": tflops,
            "mfu_datasheet": tflops / SPECS[accelerator].bf16_tflops, "mfu_matmul": tflops / matmul,
            "peak_memory_gib": peak, "planned_memory_gib": planned,
            "losses": [r["lm_loss"] for r in rows], "kernels": start_row.get("kernels"),
            "profile": profile, "wall_s": time.perf_counter() - started}


def _line(name: str, f: dict) -> str:
    if "error" in f:
        return f"{name}: did not run: {f['error']}"
    return (f"{name} ({f['setting']}): {f['step_time_s'] * 1e3:.0f} ms/step, "
            f"{f['tflops_per_device']:.0f} TFLOP/s, MFU {f['mfu_datasheet']:.1%} of the datasheet, "
            f"{f['mfu_matmul']:.1%} of the matmul; peak {f['peak_memory_gib']:.1f} GiB, plan "
            f"{f['planned_memory_gib']:.1f}; losses {f['losses'][0]:.3f} → {f['losses'][-1]:.3f}"
            f"; {f['wall_s']:.0f} s")


def device(work: Path, corpus: str, iters: int, timeout: float,
           only: Optional[list[str]] = None) -> dict:
    """Every case (or ``only``) on device 0; the figures, printed as they come and at the end."""
    import torch

    from ray_ppu.devices.specs import accelerator_of
    from ray_ppu.monitor.step_profile import table

    if iters < PROFILED + 4:
        raise SystemExit(f"--iters {iters}: --part mfu needs at least {PROFILED + 4} (2 to warm "
                         f"up, 2 timed, {PROFILED} profiled)")
    accelerator = accelerator_of(torch.cuda.get_device_name(0))
    matmul = matmul_tflops()
    _release_device()
    print(f"bf16 8192³ matmul: {matmul:.0f} TFLOP/s ({accelerator})", flush=True)
    results: dict = {"matmul_tflops": matmul, "accelerator": accelerator}
    work.mkdir(parents=True, exist_ok=True)
    for name in only or list(CASES):
        try:
            figures = run_case(name, work, corpus, iters, accelerator, matmul, timeout)
        except Exception as err:  # one case failing must not hide the others' figures
            figures = {"error": str(err)[-1500:]}
        results[name] = figures
        print(_line(name, figures), flush=True)
        if figures.get("profile"):
            print(table(figures["profile"]), flush=True)
        # after every case: a call cut short still brings back what ran
        (work / "mfu.json").write_text(json.dumps(results, indent=2, default=str))
    print("\nmodel    layers  ms/step  TFLOP/s  MFU sheet  MFU matmul  peak GiB  plan GiB")
    for name in only or list(CASES):
        f = results[name]
        if "error" not in f:
            print(f"{name:<8} {f['layers']:>6} {f['step_time_s'] * 1e3:>8.0f} "
                  f"{f['tflops_per_device']:>8.0f} {f['mfu_datasheet']:>10.1%} "
                  f"{f['mfu_matmul']:>11.1%} {f['peak_memory_gib']:>9.1f} "
                  f"{f['planned_memory_gib']:>9.1f}")
    (work / "mfu.json").write_text(json.dumps(results, indent=2, default=str))
    return results
