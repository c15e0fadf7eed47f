"""``benchmark.py vl``: can Ray Data's CPUs keep a node of vision-language ranks fed?

Photo-like JPEGs (``--images`` of 640 × 480, smooth gradients and shapes with noise, about
the size of a COCO photo) are decoded and preprocessed exactly as the data pipeline does
(:func:`ray_ppu.data.images.load_image`: RGB, resize, crop; uint8 out) for the
``bunny-llama3-8b-v`` model (SigLIP at 384 px) in one process: images per second per CPU.
Beside it, the rate one rank consumes them at the seed's Bunny layout (16 PPUs, TP 1, the
pretraining stage's ~800-token samples of one image each: the plan's FLOPs per sample at 50 %
MFU of a PPU), and what the two give: the CPUs a 16-PPU node needs for decoding. Also the wire
and store bytes of one image in uint8 (what ray_ppu ships) against float32 (an HF
processor's output). CPU time is counted (``time.process_time``), so a busy machine slows the
wall clock, not the figure.

Then the same photos as LLaVA records go the whole data path of one 16-PPU node at the
llava-qwen2.5-7b layout (Bunny's shape: seq 1024, one image of 729 tokens per row, gbs 128 =
16 DP x 8): Ray Data prepares the rows (each image read and checked once; the store keeps its
file bytes), the node's reader processes start as a launch starts them and decode every
rank's images while 16 rank threads read (:func:`ray_ppu.tools.bench.data_path.stream_node`):
the store's bytes per image against decoded pixels, the reader processes' PSS, the time to
every rank's first batch, and images/s per rank delivered against consumed. The same photos
then go the Qwen2.5-VL path at the qwen2.5-vl-7B LoRA layout, at native resolution and packed
(:func:`ray_ppu.tools.bench.qwen_vl.reader_figures`: also the row tokens used, packed against
one padded sample per row). Last, tiny-vl's step time in the demo's setting (2 CPU workers
under Ray Train, stage 2 on the shapes corpus).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HELP = "image decoding per CPU against a Bunny rank's consumption"
PPU_PEAK = 123e12  # bf16 FLOP/s of one PPU (the seed's MFU denominator)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default="outputs/benchmark_vl", help="images and records")
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--iters", type=int, default=3,
                        help="iterations the 16 ranks read through the readers")
    parser.add_argument("--tiny-iters", type=int, default=12,
                        help="iterations of the tiny-vl run (0: skip it)")
    parser.add_argument("--json", help="write the figures here")


def _decode_rate(paths: list[Path], spec) -> float:
    from ray_ppu.data.images import load_image

    load_image(paths[0], spec, 50_000_000)  # warm up: PIL's plugins
    started = time.process_time()
    for path in paths:
        load_image(path, spec, 50_000_000)
    return len(paths) / (time.process_time() - started)


def _consumption() -> dict:
    """Samples per second one PPU consumes at 50 % MFU in the seed's Bunny layout."""
    from ray_ppu.config.loader import load
    from ray_ppu.plan import build_plan

    cfg = load(None, ["model.preset=bunny-llama3-8b-v", "cluster.num_workers=16",
                      "data.dataset=sft", "data.data_path=[bunny.json]", "data.tokenizer=.",
                      "training.seq_length=800", "training.micro_batch_size=8",
                      "training.global_batch_size=128", "training.train_iters=10",
                      "training.eval_iters=0", "training.precision=bf16",
                      "vision.freeze=[vision, language]"])
    plan = build_plan(cfg)
    per_sample = plan.flops_per_iteration / plan.global_batch_size
    return {"flops_per_sample": per_sample,
            "samples_per_s_per_ppu": 0.5 * PPU_PEAK / per_sample,
            "seed_samples_per_s_per_ppu": 37.01 / 16}


def main(args) -> dict:
    from ray_ppu.data.images import ImageSpec, image_bytes_per_sample
    from ray_ppu.tools.bench import qwen_vl
    from ray_ppu.tools.bench.common import photos

    work = Path(args.dir).resolve()
    paths = photos(work / "photos", args.images)
    spec = ImageSpec.siglip(384)
    rate = _decode_rate(paths, spec)
    need = _consumption()
    node = 16 * need["samples_per_s_per_ppu"]
    figures = {
        "jpeg_kib_mean": sum(p.stat().st_size for p in paths) / len(paths) / 1024,
        "decode_images_per_s_per_cpu": rate,
        **need,
        "node_images_per_s_at_50pct_mfu": node,
        "cpus_per_node_for_decoding": node / rate,
        "seed_cpus_per_node": 16 * need["seed_samples_per_s_per_ppu"] / rate,
        "image_bytes_uint8": image_bytes_per_sample(spec),
        "image_bytes_float32": 4 * image_bytes_per_sample(spec),
    }
    print(f"decode + preprocess (SigLIP 384, {figures['jpeg_kib_mean']:.0f} KiB JPEGs): "
          f"{rate:.0f} images/s per CPU")
    print(f"one PPU at 50 % MFU, Bunny stage 1: {need['samples_per_s_per_ppu']:.2f} images/s "
          f"({need['flops_per_sample']:.3g} FLOPs per sample); the seed measured "
          f"{need['seed_samples_per_s_per_ppu']:.2f}")
    print(f"a 16-PPU node: {node:.1f} images/s = {figures['cpus_per_node_for_decoding']:.2f} "
          f"CPUs of decoding ({figures['seed_cpus_per_node']:.2f} at the seed's rate)")
    print(f"one image on the wire / in the store: {figures['image_bytes_uint8'] / 1024:.0f} KiB "
          f"uint8 vs {figures['image_bytes_float32'] / 1024:.0f} KiB float32 (4.0x)")
    figures.update(_reader_figures(work, paths, args.iters, need["samples_per_s_per_ppu"]))
    figures.update(qwen_vl.reader_figures(work, paths, args.iters))
    if args.tiny_iters:
        figures.update(_tiny_vl_step(work, args.tiny_iters))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return figures


def _reader_figures(work: Path, photos: list[Path], iters: int, consumed: float) -> dict:
    """The photos through Ray Data and one node's readers (see the module docstring)."""
    import ray

    from ray_ppu.config.loader import load
    from ray_ppu.data import reader_pool, sft_store
    from ray_ppu.data.images import image_bytes_per_sample
    from ray_ppu.data.tokenizer import export_qwen2_tokenizer
    from ray_ppu.plan import build_plan
    from ray_ppu.tools.bench.data_path import stream_node

    records = work / "photos.jsonl"
    records.write_text("".join(json.dumps({"image": p.name, "conversations": [
        {"from": "human", "value": "<image>\nWhat is in the picture?"},
        {"from": "gpt", "value": "Coloured ellipses on a gradient."}]}) + "\n" for p in photos))
    tokenizer = work / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        export_qwen2_tokenizer(tokenizer)
    gbs = 128  # 16 DP x mbs 8, Bunny's
    cfg = load(None, ["model.preset=llava-qwen2.5-7b", "cluster.num_workers=16",
                      "data.dataset=sft", f"data.data_path=[{records}]",
                      f"data.image_root={photos[0].parent}", f"data.tokenizer={tokenizer}",
                      f"data.index_cache_dir={work / 'cache'}", "training.seq_length=1024",
                      "training.micro_batch_size=8", f"training.global_batch_size={gbs}",
                      f"training.train_iters={iters}", "training.eval_iters=0"])
    spec = sft_store.spec_for(cfg, build_plan(cfg))
    ray.init(address="local", num_cpus=4, resources={"PPU": 16}, log_to_driver=False)
    try:
        started = time.perf_counter()
        rows = sft_store.prepare(spec)["train"]
        prepared = time.perf_counter() - started
        node = stream_node({"sft": spec}, 16, gbs, {"train": (0, iters)})
    finally:
        ray.shutdown()
    stored = (spec.split_dir("train") / "image_bytes.bin").stat().st_size / rows
    ranks = node["ranks"]
    figures = {"prepare_s": prepared, "rows": rows, "store_bytes_per_image": stored,
               "decoded_bytes_per_image": image_bytes_per_sample(spec.vision.spec),
               "reader_processes": len(node["pss_mb"]), "reader_pss_mb_max": max(node["pss_mb"]),
               "reader_pss_mb_opened": max(node["pss_mb_opened"]),
               "reader_cpu_s_per_image": node["cpu_s"] / sum(r["samples"] for r in ranks),
               "first_batch_s_max": max(r["first_batch_s"] for r in ranks),
               "images_per_s_per_rank": min(r["samples"] / r["seconds"] for r in ranks),
               "consumed_images_per_s_per_rank": consumed}
    print(f"Ray Data prepared {rows} rows in {prepared:.1f} s; the store keeps "
          f"{stored / 1024:.0f} KiB per image (its file) against "
          f"{figures['decoded_bytes_per_image'] / 1024:.0f} KiB of pixels")
    print(f"16 data ranks, {iters} iterations of gbs {gbs}: {figures['reader_processes']} reader "
          f"processes, {figures['reader_pss_mb_max']:.0f} MB PSS the largest (opened: "
          f"{figures['reader_pss_mb_opened']:.0f} MB), "
          f"{1e3 * figures['reader_cpu_s_per_image']:.1f} ms of reader CPU per image; first "
          f"batch after {figures['first_batch_s_max']:.2f} s; "
          f"{figures['images_per_s_per_rank']:.1f} images/s per rank (slowest) vs "
          f"{consumed:.2f} consumed")
    return figures


def _tiny_vl_step(work: Path, iters: int) -> dict:
    """tiny-vl's median step (after two) in the demo's stage 2: 2 CPU workers, Ray Train."""
    import shutil
    import statistics
    import subprocess
    import sys

    from ray_ppu.tools import vl_demo
    from ray_ppu.tools.bench.common import metrics_rows

    paths = vl_demo.prepare(work / "demo")
    run = work / "tiny_vl"
    shutil.rmtree(run, ignore_errors=True)  # a finished run would resume, done
    proc = subprocess.run(
        [sys.executable, "entrypoints/pretrain.py", "--config", "entrypoints/configs/demo-vl.yaml",
         f"data.data_path=[{paths['train']}]", f"data.valid_data_path=[{paths['valid']}]",
         f"data.image_root={paths['image_root']}", f"data.tokenizer={paths['tokenizer']}",
         "vision.freeze=[]", f"training.train_iters={iters}", "training.log_interval=1",
         "training.eval_iters=0", "checkpoint.enabled=false", "output.tensorboard=false",
         f"output.dir={run}"], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"the tiny-vl run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [r for r in metrics_rows(run) if "lm_loss" in r][2:]  # the first two: warm-up
    figures = {"tiny_vl_step_s": statistics.median(r["step_time_s"] for r in rows),
               "tiny_vl_images_per_s": statistics.median(r["images_per_s"] for r in rows)}
    print(f"tiny-vl, the demo's stage 2 (2 CPU workers, gbs 16): "
          f"{1e3 * figures['tiny_vl_step_s']:.0f} ms per step, "
          f"{figures['tiny_vl_images_per_s']:.1f} images/s")
    return figures


# The device case: the llava-qwen2.5-7b architecture cut to 4 language layers (SigLIP-so400m
# whole: its 729 image tokens per image), Bunny's stage 2 (ViT frozen), bf16, on the shapes
# corpus (64-pixel drawings, resized to 384 by the SigLIP processor)
DEVICE_RUN = ["model.preset=llava-qwen2.5-7b", "model.num_layers=4", "vision.freeze=[vision]",
              "parallel.tensor_model_parallel_size=1",
              "training.precision=bf16", "training.seq_length=1024",
              "training.micro_batch_size=2", "training.lr=1e-4", "training.min_lr=1e-5",
              "training.lr_warmup_iters=2", "training.log_interval=2", "training.eval_iters=0",
              "checkpoint.enabled=false", "output.tensorboard=false", "cluster.device=ppu"]


def device(out: Path, iters: int, timeout: float) -> dict:
    """Stage 2 of a LLaVA-Qwen2.5 slice under Ray Train on every visible GPU / PPU (DP): step
    time, TFLOP/s and MFU counting the images each batch held, peak memory, the losses."""
    import torch

    from ray_ppu.devices.specs import accelerator_of
    from ray_ppu.tools import vl_demo
    from ray_ppu.tools.bench.common import device_run_figures

    nproc = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    accelerator = accelerator_of(name)
    paths = vl_demo.prepare(out)
    run = out / "run"
    overrides = [*DEVICE_RUN, "data.dataset=sft", f"data.data_path=[{paths['train']}]",
                 f"data.image_root={paths['image_root']}", f"data.tokenizer={paths['tokenizer']}",
                 f"cluster.num_workers={nproc}", f"cluster.accelerator={accelerator}",
                 f"training.global_batch_size={8 * nproc}", f"training.train_iters={iters}"]
    return device_run_figures(overrides, run, timeout, f"llava-qwen2.5-7b with 4 language "
                              f"layers, stage 2, bf16, {nproc} × {name}", accelerator, "VL")
