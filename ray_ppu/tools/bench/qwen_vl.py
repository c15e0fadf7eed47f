"""The device case of Qwen2.5-VL: the seed's Qwen-VL row (LoRA, bf16, seq 2048, mbs 2) on a
4-layer slice of qwen2.5-vl-7B with its whole tower, under Ray Train on every visible GPU / PPU.

Photo-like 640 × 480 JPEGs (:func:`ray_ppu.tools.bench.vl._photos`) at native resolution:
``smart_resize`` makes them 476 × 644, 34 × 46 patches, 391 tokens after the 2 × 2 merge, so
packed rows of 2048 tokens hold four samples. The tower stays frozen and LoRA adapts the
language model, as Qwen-VL's ``finetune_lora_ds.sh`` trains (its ViT fixed); the figures are
step time, images/s, TFLOP/s and MFU counting the images each batch held, peak memory and the
losses.
"""

from __future__ import annotations

import json
from pathlib import Path

DEVICE_RUN = ["model.preset=qwen2.5-vl-7B", "model.num_layers=4", "vision.freeze=[vision]",
              "lora.enabled=true", "lora.rank=64", "lora.alpha=16",
              "parallel.tensor_model_parallel_size=1", "training.precision=bf16",
              "training.seq_length=2048", "training.micro_batch_size=2", "data.packing=true",
              "training.lr=1e-4", "training.min_lr=1e-5", "training.lr_warmup_iters=2",
              "training.log_interval=2", "training.eval_iters=0", "checkpoint.enabled=false",
              "output.tensorboard=false", "cluster.device=ppu"]


def records(out: Path, count: int = 64) -> Path:
    """``count`` one-image chat records over the benchmark's photos (made once)."""
    from ray_ppu.tools.bench.vl import _photos

    path = out / "qwen_vl.jsonl"
    photos = _photos(out / "photos", count)
    with open(path, "w", encoding="utf-8") as f:
        for i, photo in enumerate(photos):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": "<image>Describe the picture."},
                {"role": "assistant", "content": f"Coloured shapes on a gradient, number {i}."}],
                "images": [str(photo)]}) + "\n")
    return path


def device(out: Path, iters: int, timeout: float) -> dict:
    """The Qwen2.5-VL LoRA slice on every visible device (DP); its figures, printed."""
    import subprocess
    import sys

    import torch

    from ray_ppu.data.tokenizer import export_qwen2_tokenizer
    from ray_ppu.devices.specs import SPECS, accelerator_of
    from ray_ppu.tools.bench.common import metrics_rows

    nproc, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    accelerator = accelerator_of(name)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = out / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        export_qwen2_tokenizer(tokenizer)
    run = out / "run"
    overrides = [*DEVICE_RUN, "data.dataset=sft", f"data.data_path=[{records(out)}]",
                 f"data.tokenizer={tokenizer}", f"cluster.num_workers={nproc}",
                 f"cluster.accelerator={accelerator}",
                 f"training.global_batch_size={8 * nproc}",  # nproc DP × 2 mbs × 4 microbatches
                 f"training.train_iters={iters}", f"output.dir={run}"]
    proc = subprocess.run([sys.executable, "entrypoints/pretrain.py", *overrides],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark.py device's Qwen2.5-VL part failed (exit "
                         f"{proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [r for r in metrics_rows(run) if "lm_loss" in r]
    steady = rows[1:] or rows  # the first window holds the first step's compilation
    tflops = sum(r["tflops_per_device"] for r in steady) / len(steady)
    figures = {"setting": f"qwen2.5-vl-7B with 4 language layers, LoRA, frozen tower, bf16, "
                          f"{nproc} × {name}", "losses": [r["lm_loss"] for r in rows],
               "step_time_s": sum(r["step_time_s"] for r in steady) / len(steady),
               "images_per_s": sum(r["images_per_s"] for r in steady) / len(steady),
               "tflops_per_device": tflops, "mfu": tflops / SPECS[accelerator].bf16_tflops,
               "peak_memory_gib": max(r.get("peak_memory_gib", 0.0) for r in rows)}
    print(f"Qwen2.5-VL ({figures['setting']}): {figures['step_time_s'] * 1e3:.0f} ms/step, "
          f"{figures['images_per_s']:.1f} images/s, {tflops:.1f} TFLOP/s per device, MFU "
          f"{figures['mfu']:.1%}, peak {figures['peak_memory_gib']:.1f} GiB; losses "
          f"{figures['losses'][0]:.3f} → {figures['losses'][-1]:.3f}")
    return figures
