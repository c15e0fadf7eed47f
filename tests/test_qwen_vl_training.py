"""tiny-qwen-vl fine-tuned with LoRA and a trainable vision tower under Ray Train.

The run starts from a Hugging Face Qwen2.5-VL directory (random weights, the real Qwen2
vocabulary) and trains on chat records whose images (drawn with Pillow) come in five sizes,
so samples carry different numbers of image tokens; rows are packed. LoRA adapts the language
model, the tower and its merger train in full (``vision.freeze=[]``: the case ms-swift's
Megatron backend cannot resume). At TP 2 it gives TP 1's losses; a worker SIGKILLed after
iteration 5 restores from the in-memory snapshot and every iteration trained again gives the
loss it gave the first time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_lora_training import _first_and_again, _run
from ray_ppu.config.loader import load

ITERS = 8
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220),
           "yellow": (230, 220, 30)}
SIZES = [(56, 56), (40, 130), (150, 60), (112, 112), (90, 70)]  # 4 … 16 tokens each


def _records(root: Path) -> Path:
    """24 chat records of one or two images each, their images beside them in ``root``."""
    from PIL import Image, ImageDraw

    root.mkdir()
    lines = []
    for i in range(24):
        names = list(COLOURS)[i % 4], list(COLOURS)[(i * 3 + 1) % 4]
        images = []
        for k, colour in enumerate(names[:1 + i % 2]):  # one or two images per record
            h, w = SIZES[(i + k) % len(SIZES)]
            image = Image.new("RGB", (w, h), (128, 128, 128))
            ImageDraw.Draw(image).ellipse((2, 2, w - 3, h - 3), fill=COLOURS[colour])
            image.save(root / f"{i}_{k}.png")
            images.append(f"{i}_{k}.png")
        question = "".join("<image>" for _ in images) + "Colours?"
        lines.append({"messages": [{"role": "user", "content": question},
                                   {"role": "assistant", "content": " and ".join(names[:len(images)])}],
                      "images": images})
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def _config(model_dir, records, out, tp, *extra):
    from ray_ppu.launch.output import absolute_paths

    return absolute_paths(load(None, [
        f"checkpoint.pretrained={model_dir}", "data.dataset=sft", f"data.data_path=[{records}]",
        "data.packing=true", f"output.dir={out}", "output.tensorboard=false",
        "cluster.device=cpu", "cluster.num_workers=2", "training.precision=fp32",
        "training.seq_length=96", "training.micro_batch_size=1", "training.global_batch_size=4",
        f"training.train_iters={ITERS}", "training.lr=1e-2", "training.min_lr=1e-3",
        "training.lr_warmup_iters=1", "training.eval_iters=0", "vision.freeze=[]",
        "lora.enabled=true", "lora.rank=8", "lora.alpha=16",
        f"parallel.tensor_model_parallel_size={tp}", *extra]))


def run_qwen_vl(root: Path, tiny_qwen_vl_dir) -> dict:
    """The module's two runs on the records it writes under ``root``: TP 1, the reference
    losses only (no snapshots, no checkpoint), and TP 2 with a worker killed after iteration
    5. One SFT row cache for both (its key is the records, tokenizer and row layout, which
    they share): the second run's rows are read, not made again by Ray Data. Prelaunched
    (tests/prelaunch.py)."""
    from test_checkpoint import kill_a_worker_at

    records, row_cache = _records(root / "records"), root / "rows"
    tp1, tp2 = root / "tp1", root / "tp2"
    for path in (row_cache, tp1, tp2):
        path.mkdir()
    reference = _run(_config(tiny_qwen_vl_dir, records, tp1, 1, "checkpoint.memory_interval=0",
                             "checkpoint.enabled=false", f"data.index_cache_dir={row_cache}"))
    cfg = _config(tiny_qwen_vl_dir, records, tp2, 2, "checkpoint.memory_interval=4",
                  "cluster.max_failures=1", f"data.index_cache_dir={row_cache}")
    killed: list = []
    result = _run(cfg, kill_a_worker_at(tp2, 5, killed, snapshot=4))
    assert len(killed) == 1, killed
    return {"tp1": reference, "tp2": result}


@pytest.fixture(scope="module")
def qwen_vl_runs(prelaunched):
    return prelaunched.result("qwen_vl_runs")


@pytest.fixture(scope="module")
def tp1(qwen_vl_runs):
    return qwen_vl_runs["tp1"]


@pytest.fixture(scope="module")
def tp2(qwen_vl_runs):
    return qwen_vl_runs["tp2"]


@pytest.mark.slow
def test_tp2_gives_tp1s_losses(tp1, tp2):
    ours, theirs = _first_and_again(tp2["rows"])[0], _first_and_again(tp1["rows"])[0]
    assert sorted(theirs) == list(range(1, ITERS + 1)) == sorted(ours)
    for iteration in theirs:
        assert ours[iteration] == pytest.approx(theirs[iteration], abs=2e-4), iteration
    assert theirs[ITERS] < theirs[1]  # it learns


@pytest.mark.slow
def test_resume_with_lora_and_a_trainable_tower_is_exact(tp2):
    rows = tp2["rows"]
    restarts = [(r["iteration"], r["resumed_from"]) for r in rows if r.get("event") == "restart"]
    # snapshots at 4 and 8: the kill after 5 loses one iteration, trained again
    assert len(restarts) == 1 and restarts[0][0] == 4, restarts
    assert restarts[0][1].startswith("memory:"), restarts
    first, again = _first_and_again(rows)
    assert 5 in again, again
    for iteration, loss in again.items():
        assert loss == pytest.approx(first[iteration], abs=1e-6), iteration
    final = tp2["final"]
    assert (final["iteration"], final["restarts"]) == (ITERS, 1)
