"""``benchmark.py hf-load``: loading Hugging Face weights straight into a split model.

For each size, a synthetic Qwen2 checkpoint (Qwen2.5-3B's layer shape, as many layers as the
size allows, bf16, random values, upstream's ≤ 5 GB shards) is written once under --dir; then
one torchrun launch of --ranks CPU processes per layout (TP = ranks, or PP = ranks) builds the
model without initialising it and loads it with ``checkpoint.pretrained``'s code. Every rank
samples its own /proc/self/status every 5 ms. Printed per size and layout, for the worst rank:

* load time;
* what the rank must hold (its parameters) and the checkpoint size;
* resident memory (VmRSS) once the model is built, and its peak during the load;
* the load's increase of private memory (RssAnon: the blocks a column slice or a cast goes
  through) and of file-backed memory (RssFile: mapped file pages; 0 since reads are plain
  positioned reads, no memory map).

The model is built on the CPU, where Megatron-Core draws each weight whole before keeping this
rank's part (use_cpu_initialization): that spike is the model build's, before the load, and
does not happen on a device.

The page cache is warm (the files were just written or read): load times are the loader's,
not the disk's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ray_ppu.util.net import free_port  # noqa: E402

# Qwen/Qwen2.5-3B's layer shape; the layer count is chosen per size
SHAPE = dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
             num_key_value_heads=2, vocab_size=151_936)
GB = 10**9


def _layers_for(size_gb: float, multiple: int) -> int:
    """Layers for about ``size_gb`` GB, a multiple of ``multiple`` (the PP size)."""
    h, f, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    kv = h // SHAPE["num_attention_heads"] * SHAPE["num_key_value_heads"]
    per_layer = 2 * (2 * h * h + 2 * kv * h + 3 * h * f + 2 * h + h + 2 * kv)  # bf16 bytes
    return max(1, round((size_gb * GB - 2 * v * h) / per_layer / multiple)) * multiple


def synthetic_checkpoint(directory: Path, layers: int) -> int:
    """A random bf16 Qwen2 directory with ``layers`` layers (reused if there); its bytes."""
    from ray_ppu.config.schema import ModelConfig
    from ray_ppu.hf.config import to_hf
    from ray_ppu.hf.files import ShardedWriter
    from ray_ppu.hf.weights import hf_shapes

    model = ModelConfig(num_layers=layers, hidden_size=SHAPE["hidden_size"],
                        ffn_hidden_size=SHAPE["intermediate_size"],
                        num_attention_heads=SHAPE["num_attention_heads"],
                        num_query_groups=SHAPE["num_key_value_heads"],
                        vocab_size=SHAPE["vocab_size"], untie_embeddings_and_output_weights=False)
    done = directory / "config.json"
    if not done.is_file():
        generator = torch.Generator().manual_seed(0)
        writer = ShardedWriter(directory)
        for name, shape in hf_shapes(model).items():
            writer.add(name, (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16))
        writer.close()
        done.write_text(json.dumps(to_hf(model, "bfloat16"), indent=2))
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


class _Peaks:
    """Samples /proc/self/status (kB fields) in a thread; keeps the peaks."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> dict[str, int]:
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    fields[key] = int(value.split()[0]) * 1024
        return fields

    def _run(self) -> None:
        while not self.stop.is_set():
            for key, value in self.now().items():
                self.peak[key] = max(self.peak.get(key, 0), value)
            time.sleep(0.005)

    def __enter__(self) -> "_Peaks":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def child(directory: str, tp: int, pp: int, out: str) -> None:
    """One torchrun rank: build the model at TP × PP (bf16, not initialised), load, measure."""
    import logging

    import torch.distributed as dist

    from ray_ppu.model import parallel
    from ray_ppu.offline import inference
    from ray_ppu.hf.weights import load_pretrained

    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    with parallel.process_group("cpu"):
        source = inference.open_source(directory)
        cfg, plan = inference.inference_config(source.model, dist.get_world_size(), tp, pp,
                                               precision="bf16", device="cpu")
        with inference.built_model(cfg, plan, "cpu") as chunks:
            held = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
            before = _Peaks.now()
            dist.barrier()
            with _Peaks() as peaks:
                took = load_pretrained(chunks, directory, cfg.model, plan.padded_vocab_size)
        after = _Peaks.now()
        row = {"rank": dist.get_rank(), "seconds": took["seconds"], "read": took["bytes_read"],
               "held": held, "before": before,
               "peak": {k: max(peaks.peak.get(k, 0), after[k]) for k in after}}
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps(rows))


def hf_load(sizes_gb: list[float], ranks: int, work: Path) -> list[dict]:
    """Write the checkpoints, launch one torchrun per size and layout, print the table."""
    results = []
    print(f"{'ckpt GB':>8} {'layout':>7} {'load s':>7} {'GB/s':>6} {'held GB':>8} "
          f"{'RSS built':>10} {'RSS peak':>9} {'+anon':>7} {'+file':>7} {'peak/ckpt':>10}",
          flush=True)
    for size in sizes_gb:
        layers = _layers_for(size, ranks)
        directory = work / f"qwen2_{layers}_layers"
        total = synthetic_checkpoint(directory, layers)
        for layout, (tp, pp) in (("TP", (ranks, 1)), ("PP", (1, ranks))):
            out = work / f"rows_{size:g}_{layout}.json"
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                 "--master-port", str(free_port("127.0.0.1")), __file__, str(directory), str(tp),
                 str(pp), str(out)], capture_output=True, text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"})
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"the {layout} launch for {size} GB failed")
            rows = json.loads(out.read_text())
            worst = max(rows, key=lambda r: r["peak"]["VmRSS"])  # the rank that needs most
            slowest = max(r["seconds"] for r in rows)

            def grew(key: str) -> float:
                return max(r["peak"][key] - r["before"][key] for r in rows) / GB

            result = {"size_gb": total / GB, "layout": f"{layout}{ranks}", "seconds": slowest,
                      "held_gb": worst["held"] / GB, "rss_built_gb": worst["before"]["VmRSS"] / GB,
                      "rss_peak_gb": worst["peak"]["VmRSS"] / GB, "anon_gb": grew("RssAnon"),
                      "file_gb": grew("RssFile"), "rows": rows}
            results.append(result)
            print(f"{total / GB:8.2f} {result['layout']:>7} {slowest:7.2f} "
                  f"{total / GB / slowest:6.2f} {result['held_gb']:8.2f} "
                  f"{result['rss_built_gb']:10.2f} {result['rss_peak_gb']:9.2f} "
                  f"{result['anon_gb']:7.2f} {result['file_gb']:7.2f} "
                  f"{result['rss_peak_gb'] / (total / GB):10.2f}", flush=True)
    return results


if __name__ == "__main__":  # a torchrun rank of hf_load
    child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
