"""The device case of Qwen2.5-VL: the seed's Qwen-VL row (LoRA, bf16, seq 2048, mbs 2) on a
4-layer slice of qwen2.5-vl-7B with its whole tower, under Ray Train on every visible GPU / PPU.

Photo-like 640 × 480 JPEGs (:func:`ray_ppu.tools.bench.common.photos`) at native resolution:
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
    from ray_ppu.tools.bench.common import photos

    path = out / "qwen_vl.jsonl"
    pictures = photos(out / "photos", count)
    with open(path, "w", encoding="utf-8") as f:
        for i, photo in enumerate(pictures):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": "<image>Describe the picture."},
                {"role": "assistant", "content": f"Coloured shapes on a gradient, number {i}."}],
                "images": [str(photo)]}) + "\n")
    return path


def random_base(out: Path, overrides: list[str], device: str = "cpu") -> Path:
    """A Hugging Face Qwen2.5-VL directory of random weights in bf16 for the model the
    ``overrides`` name (LoRA needs a base to adapt and the device has no checkpoint to
    download), with the Qwen2 tokenizer and the image processor; made once."""
    import shutil

    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from ray_ppu.config.loader import load
    from ray_ppu.data.images import PROCESSOR_FILE
    from ray_ppu.data.sft.image_samples import native_spec
    from ray_ppu.data.tokenizer import export_qwen2_tokenizer
    from ray_ppu.hf.qwen_vl import qwen_vl_to_hf

    if (out / "config.json").is_file():
        return out
    cfg = load(None, [o for o in overrides if o.startswith(("model.", "vision."))])
    config = Qwen2_5_VLConfig.from_dict(qwen_vl_to_hf(cfg.model, cfg.vision, "bfloat16"))
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # drawn in bf16: half the memory of fp32 then cast
    try:
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out)
    del model
    (out / PROCESSOR_FILE).write_text(json.dumps(native_spec(cfg.vision).to_hf(), indent=2))
    tokenizer = export_qwen2_tokenizer(out.parent / "tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(tokenizer) / name, out / name)
    return out


def device(out: Path, iters: int, timeout: float) -> dict:
    """The Qwen2.5-VL LoRA slice on every visible device (DP); its figures, printed."""
    import torch

    from ray_ppu.devices.specs import accelerator_of
    from ray_ppu.tools.bench.common import device_run_figures

    nproc, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    accelerator = accelerator_of(name)
    out.mkdir(parents=True, exist_ok=True)
    base = random_base(out / "base", DEVICE_RUN, "cuda")
    run = out / "run"
    overrides = [*DEVICE_RUN, "data.dataset=sft", f"data.data_path=[{records(out)}]",
                 f"checkpoint.pretrained={base}", f"cluster.num_workers={nproc}",
                 f"cluster.accelerator={accelerator}",
                 f"training.global_batch_size={8 * nproc}",  # nproc DP × 2 mbs × 4 microbatches
                 f"training.train_iters={iters}"]
    return device_run_figures(overrides, run, timeout, f"qwen2.5-vl-7B with 4 language "
                              f"layers, LoRA, frozen tower, bf16, {nproc} × {name}",
                              accelerator, "Qwen2.5-VL")


def reader_figures(work: Path, photos: list, iters: int) -> dict:
    """The photos as Qwen2.5-VL chat records through Ray Data and one 16-PPU node's readers
    at the 7B LoRA layout (seq 2048, packed, mbs 2, gbs 128 = 16 DP × 2 × 4): the store's
    bytes per image, the readers' PSS, images/s per rank delivered, and tokens used per
    packed row against one padded sample per row."""
    import ray

    from ray_ppu.config.loader import load
    from ray_ppu.data import sft_store
    from ray_ppu.data.tokenizer import export_qwen2_tokenizer
    from ray_ppu.plan import build_plan
    from ray_ppu.tools.bench.data_path import stream_node

    records = work / "qwen_vl_photos.jsonl"
    records.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": "<image>What is in the picture?"},
        {"role": "assistant", "content": "Coloured ellipses on a gradient."}],
        "images": [str(p)]}) + "\n" for p in photos))
    tokenizer = work / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        export_qwen2_tokenizer(tokenizer)
    gbs = 128  # 16 DP × mbs 2 × 4 microbatches: the seed's Qwen-VL row on one node
    cfg = load(None, ["model.preset=qwen2.5-vl-7B", "cluster.num_workers=16", "data.dataset=sft",
                      f"data.data_path=[{records}]", f"data.tokenizer={tokenizer}",
                      f"data.index_cache_dir={work / 'cache_qwen'}", "data.packing=true",
                      "training.seq_length=2048", "training.micro_batch_size=2",
                      f"training.global_batch_size={gbs}", f"training.train_iters={iters}",
                      "training.eval_iters=0"])
    spec = sft_store.spec_for(cfg, build_plan(cfg))
    ray.init(address="local", num_cpus=4, resources={"PPU": 16}, log_to_driver=False)
    try:
        rows = sft_store.prepare(spec)["train"]
        node = stream_node({"sft": spec}, 16, gbs, {"train": (0, iters)})
    finally:
        ray.shutdown()
    summary = sft_store.summaries(spec)["train"]
    ranks = node["ranks"]
    samples = summary["samples_used"]
    images = samples  # one photo per record
    per_rank_rows = min(r["samples"] / r["seconds"] for r in ranks)
    figures = {
        "qwen_rows": rows, "qwen_images": images,
        "qwen_tokens_per_sample": summary["sample_tokens"] / samples,
        "qwen_store_bytes_per_image": (spec.split_dir("train") / "image_bytes.bin").stat().st_size
        / images,
        "qwen_reader_pss_mb_max": max(node["pss_mb"]),
        "qwen_reader_pss_mb_opened": max(node["pss_mb_opened"]),
        "qwen_first_batch_s_max": max(r["first_batch_s"] for r in ranks),
        "qwen_images_per_s_per_rank": per_rank_rows * images / rows,
        "qwen_row_tokens_used_packed": summary["packing_efficiency"],
        "qwen_row_tokens_used_padded": summary["sample_tokens"] / (samples * 2048)}
    print(f"Qwen2.5-VL-7B layout: {images} photos at native resolution, "
          f"{figures['qwen_tokens_per_sample']:.0f} tokens per sample, {rows} packed rows; the store "
          f"keeps {figures['qwen_store_bytes_per_image'] / 1024:.0f} KiB per image; readers "
          f"{figures['qwen_reader_pss_mb_max']:.0f} MB PSS the largest (opened "
          f"{figures['qwen_reader_pss_mb_opened']:.0f} MB); first batch after "
          f"{figures['qwen_first_batch_s_max']:.2f} s; {figures['qwen_images_per_s_per_rank']:.1f} "
          f"images/s per rank (slowest); row tokens used: "
          f"{100 * figures['qwen_row_tokens_used_packed']:.1f} % packed vs "
          f"{100 * figures['qwen_row_tokens_used_padded']:.1f} % one sample per row")
    return figures
