"""Bunny's stage 2 of tiny-vl with LoRA under Ray Train, on the shapes corpus (ray_ppu.tools.shapes).

The run starts from a ray_ppu checkpoint of a Hugging Face LLaVA directory (hf-to-mcore; a
stage-1 run's checkpoint is loaded the same way: checkpoint.load + finetune, the freeze set
changed) and trains the projector in full and the language model through LoRA adapters, on
question-answer records at TP 2 with in-memory snapshots; a worker is SIGKILLed after
iteration 5 and the group restores iteration 4 from memory (adapters and projector from the
snapshot, the frozen base re-read): each iteration trained again gives the loss it gave the
first time. Its checkpoint, merged and exported to Hugging Face, keeps the frozen ViT
bit-identical to the source and loads in transformers. (That TP 2 and PP 2 compute what TP 1
does for stage 1 and stage 2 in full, and every freeze × LoRA combination trains exactly its
parts: tests/test_vl_model.py, test_vl_training.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_lora_training import _first_and_again, _run
from ray_ppu.config.loader import load

STAGE2_ITERS = 8
BAD_RECORDS = ('{"image": "nowhere.png", "conversations": [{"from": "human", "value": "<image>"}, '
               '{"from": "gpt", "value": "Red."}]}\n{"image": "x.png", "conversations": [\n')


def _config(shapes, base, out, data, *extra):
    from ray_ppu.launch.output import absolute_paths

    return absolute_paths(load(None, [
        "data.dataset=sft", f"data.data_path=[{data}]", f"data.valid_data_path=[{shapes['valid']}]",
        f"data.image_root={shapes['image_root']}", f"data.tokenizer={base}",
        f"output.dir={out}", "output.tensorboard=false", "cluster.device=cpu",
        "cluster.num_workers=2", "training.precision=fp32", "training.seq_length=64",
        "training.micro_batch_size=1", "training.global_batch_size=4", "training.lr=2e-2",
        "training.min_lr=2e-3", "training.lr_warmup_iters=1", "training.eval_interval=4",
        "training.eval_iters=1", *extra]))


def _converted(tiny_llava_dir, out: Path) -> Path:
    """The LLaVA directory as a weights-only ray_ppu checkpoint in ``out`` (what a stage-1
    run leaves). In a process of its own: the checkpoint writer forks a helper, and a fork of
    a Ray driver breaks the Ray Data pipelines that follow."""
    import subprocess
    import sys

    from conftest import REPO

    out.mkdir()
    proc = subprocess.run([sys.executable, str(REPO / "entrypoints" / "convert_checkpoint.py"),
                           "hf-to-mcore", "--hf", str(tiny_llava_dir), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def run_vl_stage2(root: Path, tiny_llava_dir) -> dict:
    """The module's run, from files it makes under ``root``: the shapes corpus (and two bad
    records after its training records: dropped, counted and listed), the converted LLaVA
    checkpoint; a worker killed after iteration 5. Prelaunched (tests/prelaunch.py)."""
    from ray_ppu.tools.shapes import write_corpus
    from test_checkpoint import kill_a_worker_at

    shapes = write_corpus(root / "shapes", train=48, valid=8, heldout=0)
    converted = _converted(tiny_llava_dir, root / "converted")
    out = root / "stage2"
    out.mkdir()
    data = root / "train_and_bad.jsonl"
    data.write_text(Path(shapes["train"]).read_text() + BAD_RECORDS)
    cfg = _config(shapes, tiny_llava_dir, out, data,
                  f"checkpoint.load={converted}",
                  "checkpoint.finetune=true", "model.preset=tiny-vl", "vision.freeze=[vision]",
                  "lora.enabled=true", "lora.rank=8", "lora.alpha=16",
                  "parallel.tensor_model_parallel_size=2", f"training.train_iters={STAGE2_ITERS}",
                  "checkpoint.memory_interval=4", "cluster.max_failures=1")
    killed: list = []
    result = _run(cfg, kill_a_worker_at(out, 5, killed, snapshot=4))
    assert len(killed) == 1, killed
    return {"shapes": shapes, "converted": converted, "stage2": result}


@pytest.fixture(scope="module")
def vl_stage2_run(prelaunched):
    return prelaunched.result("vl_stage2_run")


@pytest.fixture(scope="module")
def shapes(vl_stage2_run):
    return vl_stage2_run["shapes"]


@pytest.fixture(scope="module")
def converted(vl_stage2_run):
    return vl_stage2_run["converted"]


@pytest.fixture(scope="module")
def stage2(vl_stage2_run):
    return vl_stage2_run["stage2"]


@pytest.mark.slow
def test_stage2_restores_exactly_from_memory(stage2):
    rows = stage2["rows"]
    restarts = [(r["iteration"], r["resumed_from"]) for r in rows if r.get("event") == "restart"]
    assert len(restarts) == 1 and restarts[0][0] == 4 and restarts[0][1].startswith("memory:")
    first, again = _first_and_again(rows)
    assert sorted(first) == list(range(1, STAGE2_ITERS + 1)) and 5 in again, again
    for iteration, loss in again.items():
        assert loss == pytest.approx(first[iteration], abs=1e-6), iteration
    assert first[STAGE2_ITERS] < first[1]
    final = stage2["final"]
    assert (final["iteration"], final["restarts"]) == (STAGE2_ITERS, 1)
    # the FLOPs behind the logged TFLOPS count the images the batches held: one per row here
    # (a question of ~20 tokens and its 16 image tokens: two do not fit in 64)
    row = next(r for r in rows if r.get("iteration") == STAGE2_ITERS and "lm_loss" in r)
    assert row["images_per_iteration"] == 4 and row["images_per_s"] > 0


@pytest.mark.slow
def test_the_launch_names_every_bad_record_and_lists_them_in_the_run_directory(stage2, shapes):
    """Dropped records are counted in the end-of-run account and listed whole, with their
    file and line, in <dir>/bad_records/train.jsonl (the first of each reason in the log)."""
    good = len(Path(shapes["train"]).read_text().splitlines())
    data = stage2["final"]["data"]["train"]
    assert (data["records_read"], data["samples_used"]) == (good + 2, good)
    assert {k: v for k, v in data["dropped"].items() if v} == {"missing_image": 1,
                                                                "malformed_json": 1}
    listed = Path(stage2["cfg"].output.dir) / "bad_records" / "train.jsonl"
    records = [json.loads(line) for line in listed.read_text().splitlines()]
    assert [(r["reason"], r["record"].split(": ")[1]) for r in records] == [
        ("missing_image", f"line {good + 1}"), ("malformed_json", f"line {good + 2}")]
    assert "nowhere.png" in records[0]["record"]


@pytest.mark.slow
def test_stage2_lora_checkpoint_merges_into_a_llava_model(stage2, tiny_llava_dir, tmp_path):
    from transformers import LlavaForConditionalGeneration

    from ray_ppu.checkpoint.layout import latest, save_root
    from ray_ppu.hf.files import read_all
    from ray_ppu.offline.lora_export import export_merged, export_peft

    _, meta = latest(save_root(stage2["cfg"]))  # it records the vision section export reads
    assert meta.vision["encoder"] == "siglip" and meta.vision["freeze"] == ["vision"]
    adapter = export_peft(save_root(stage2["cfg"]), tmp_path / "peft")
    assert adapter["modules_to_save"] == ["multi_modal_projector"]  # the projector trained
    summary = export_merged(save_root(stage2["cfg"]), tmp_path / "hf")
    original, merged = dict(read_all(tiny_llava_dir)), dict(read_all(summary["out"]))
    assert sorted(original) == sorted(merged)
    moved = {n for n, t in original.items() if not torch.equal(t, merged[n])}
    tower = {n for n in original if n.startswith("vision_tower.")}
    projector = {n for n in original if n.startswith("multi_modal_projector.")}
    adapted = {n for n in original if n.startswith("language_model.model.layers.")
               and n.endswith("proj.weight")}  # q k v o gate up down: LoRA's default targets
    assert tower and not moved & tower  # frozen: bit-identical
    assert moved == projector | adapted, moved ^ (projector | adapted)  # norms, embedding kept
    hf = LlavaForConditionalGeneration.from_pretrained(summary["out"]).eval()
    pixels = torch.rand(1, 3, 32, 32) * 2 - 1
    ids = torch.tensor([[hf.config.image_token_id] * 16 + [1, 2, 3]])
    with torch.no_grad():
        merged_logits = hf(input_ids=ids, pixel_values=pixels).logits
    assert torch.isfinite(merged_logits).all()
    # the PEFT adapter (LoRA on the language model, the projector as modules_to_save) on the
    # LLaVA base the run started from gives the merged model's logits
    from peft import PeftModel

    base = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir).eval()
    with torch.no_grad():
        before = base(input_ids=ids, pixel_values=pixels).logits
        with_adapter = PeftModel.from_pretrained(base, tmp_path / "peft").eval()(
            input_ids=ids, pixel_values=pixels).logits
    assert (with_adapter - merged_logits).abs().max() <= 1e-4
    assert (before - merged_logits).abs().max() > 1e-2  # the adapter moved them
    # and back: the adapter (projector included) applied by ray_ppu to the same base
    from ray_ppu.model import parallel
    from ray_ppu.offline import generation, inference

    setup = generation.setup(str(tiny_llava_dir), lora=str(tmp_path / "peft"), device="cpu")
    with parallel.process_group("cpu"), \
            inference.built_model(setup.cfg, setup.plan, "cpu") as chunks:
        inference.load_weights(chunks, setup.source, setup.cfg, setup.plan, **setup.adapters)
        ours = inference.prompt_logits(chunks, ids[0].tolist(), setup.source.model.vocab_size,
                                       torch.device("cpu"), pixels)
    assert (ours - merged_logits[0, :, :ours.shape[1]]).abs().max() <= 1e-4


@pytest.mark.slow
def test_the_cache_keeps_the_image_files_and_readers_decode_them(stage2, shapes):
    """The prepared rows hold each image's file bytes (not 8x larger pixels); the reader's
    read gives the pixels the image processor's code gives for the file."""
    import numpy as np

    from ray_ppu.data import sft_store
    from ray_ppu.data.images import load_image
    from ray_ppu.plan import build_plan

    cfg = stage2["cfg"]
    spec = sft_store.spec_for(cfg, build_plan(cfg))
    split = spec.split_dir("train")
    meta = json.loads((split / sft_store.META).read_text())
    assert meta["columns"]["image_bytes"] == [[], sft_store.BYTES] and "images" not in meta["columns"]
    files = [Path(shapes["image_root"]) / json.loads(line)["image"]
             for line in Path(shapes["train"]).read_text().splitlines()]
    assert meta["rows"] == len(files)  # one question per row, none dropped, in file order
    assert (split / "image_bytes.bin").stat().st_size == sum(f.stat().st_size for f in files)
    rows = sft_store.read(spec, np.array([0, 5, len(files) + 2]))  # ids cycle over the rows
    assert rows["images"].shape == (3, 4, 3, 32, 32) and list(rows["num_images"]) == [1, 1, 1]
    for slot, row in zip(rows["images"], (0, 5, 2)):
        assert np.array_equal(slot[0], load_image(files[row], spec.vision.spec, 10**8))
        assert not slot[1:].any()


def test_a_hugging_face_llava_base_is_merged_through_a_converted_copy(tiny_llava_dir, tmp_path):
    """A VL LoRA run from checkpoint.pretrained merges onto its LLaVA base converted to a
    temporary ray_ppu checkpoint: that copy exports back bit-identical."""
    from ray_ppu.hf.files import read_all
    from ray_ppu.offline.lora_export import _as_mcore
    from ray_ppu.offline.mcore_to_hf import export

    with _as_mcore({"kind": "hf", "path": str(tiny_llava_dir)}, tiny_llava_dir) as base:
        summary = export(base, tmp_path / "hf")
    original, exported = dict(read_all(tiny_llava_dir)), dict(read_all(summary["out"]))
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(t, exported[n]) for n, t in original.items())


@pytest.mark.slow
def test_the_lora_checkpoint_generates_on_its_own_as_its_merged_export(stage2, converted, shapes,
                                                                       tmp_path):
    """generate.py on the LoRA checkpoint alone (no --tokenizer; the tokenizer, chat template
    and image processor are the ones it carries) gives the logits transformers gives for its
    merged export, prompted as transformers users prompt it (AutoProcessor: the export's chat
    template with an image, its image processor), whose ids are generate.py's; every file it
    and the export hold is readable by all. A moved base is found with --base (checked by content)
    by generation and merging alike; another model as --base is refused."""
    import json
    import shutil
    import stat
    import subprocess
    import sys
    from pathlib import Path

    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from conftest import REPO
    from ray_ppu.checkpoint.layout import latest, save_root
    from ray_ppu.errors import ConfigError
    from ray_ppu.hf.files import read_all
    from ray_ppu.offline import generation
    from ray_ppu.offline.lora_export import export_merged
    from ray_ppu.tools.shapes import QUESTIONS

    path, meta = latest(save_root(stage2["cfg"]))
    # the run prepared its images by the processor its converted base carries
    assert stage2["cfg"].data.image_processor == str(latest(converted)[0] / "processor")
    carried = {f"processor/{n}" for n in ("tokenizer.json", "tokenizer_config.json",
                                          "preprocessor_config.json")}
    assert carried <= set(meta.files), sorted(meta.files)
    summary = export_merged(save_root(stage2["cfg"]), tmp_path / "hf")
    for file in [*Path(path).rglob("*"), *Path(summary["out"]).iterdir()]:
        if file.is_file():
            assert stat.S_IMODE(file.stat().st_mode) & 0o044 == 0o044, file
    image = str(Path(shapes["image_root"]) / "train_00000.png")
    proc = subprocess.run([sys.executable, str(REPO / "entrypoints" / "generate.py"),
                           "--checkpoint", str(save_root(stage2["cfg"])), "--image", image,
                           "--prompt", QUESTIONS["colour"], "--max-new-tokens", "2",
                           "--dump-logits", str(tmp_path / "logits.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ours["checkpoint"] == str(path) and ours["prompt_ids"][0] == 151_644  # <|im_start|>
    # the export as transformers users prompt it: AutoProcessor, its chat template, the image
    processor = AutoProcessor.from_pretrained(summary["out"])
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": QUESTIONS["colour"]}]}],
        add_generation_prompt=True)
    batch = processor(images=[Image.open(image).convert("RGB")], text=[text], return_tensors="pt")
    assert batch["input_ids"][0].tolist() == ours["prompt_ids"]
    merged = LlavaForConditionalGeneration.from_pretrained(summary["out"]).eval()
    with torch.no_grad():
        theirs = merged(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"]).logits[0]
    logits = torch.tensor(json.loads((tmp_path / "logits.json").read_text())["logits"])
    assert (logits - theirs[:, :logits.shape[1]]).abs().max() <= 1e-4

    moved = tmp_path / "moved"
    shutil.copytree(converted, moved)
    setup = generation.setup(str(path), base=str(moved), device="cpu")
    assert str(setup.source.path).startswith(str(moved)) and setup.adapters["trained"]
    again = export_merged(save_root(stage2["cfg"]), tmp_path / "again", base_at=str(moved))
    assert again["base"].startswith(str(moved))
    first, second = dict(read_all(summary["out"])), dict(read_all(again["out"]))
    assert sorted(first) == sorted(second)
    assert all(torch.equal(t, second[n]) for n, t in first.items())
    with pytest.raises(ConfigError, match="not the base"):
        generation.setup(str(path), base=str(summary["out"]), device="cpu")
