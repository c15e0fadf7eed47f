"""Qwen2.5-VL out of ray_ppu: checkpoint → Hugging Face, LoRA exports, generate --image.

A tiny random Qwen2.5-VL (the real Qwen2 vocabulary, so the real tokenizer and chat template
serve, with Qwen's vision tokens added at their published ids; an untied lm_head; random norms
and biases so a mix-up shows) in the published spelling, with a preprocessor_config.json whose
pixel range resizes the test image (150 × 90 → 140 × 84: 15 image tokens).

One torchrun launch of two CPU ranks (this file's ``__main__``) converts it at TP 2 and at PP 2,
and builds ray_ppu's LoRA model on the TP 2 checkpoint (adapters on all four targets, ranks
and alphas not all equal, A and B random so the adapters matter; the tower frozen as a LoRA
run has it), writes that model's logits for the image prompt and saves its LoRA checkpoint.
The exports are then checked against transformers (and PEFT) in this process, and
generate.py --image against transformers' logits for the same image and question.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import launch_torchrun, qwen_vl_reference, random_qwen_vl


REPO = Path(__file__).resolve().parents[1]
IMAGE, START = 151_655, 151_652
# Qwen's added tokens after <|im_end|> (151645), in id order: <|vision_start|> is 151652
ADDED = ["<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
         "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
         "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
QUESTION = "What is in the picture?"
PIXELS = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16}
LORA = {"enabled": True, "rank": 4, "alpha": 8.0, "rank_pattern": {"linear_qkv": 6},
        "alpha_pattern": {"linear_fc2": 4.0},
        "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}


def _model(path: Path) -> None:
    """The random tiny Qwen2.5-VL (2 + 2 layers, untied), saved in the published spelling."""
    random_qwen_vl(path, tower_layers=2, full_attention=(1,), tied=False, sharp=True,
                   published_names=True)


def _tokenizer(source: Path, path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer

    shutil.copyfile(source / "tokenizer_config.json", path / "tokenizer_config.json")
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ADDED])
    assert tokenizer.token_to_id("<|image_pad|>") == IMAGE
    tokenizer.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, qwen2_tokenizer_dir):
    """The model directory, its test image, and transformers' inputs and logits for the
    question about it (the ids as Qwen2_5_VLProcessor expands the chat prompt)."""
    from PIL import Image, ImageDraw
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    path = tmp_path_factory.mktemp("qwen_vl_export") / "hf"
    _model(path)
    _tokenizer(Path(qwen2_tokenizer_dir), path)
    Qwen2VLImageProcessorPil(**PIXELS).save_pretrained(path)
    image = Image.new("RGB", (90, 150), (40, 180, 90))
    ImageDraw.Draw(image).ellipse((5, 9, 80, 140), fill=(220, 60, 10))
    image.save(path.parent / "picture.png")

    processed = Qwen2VLImageProcessorPil.from_pretrained(path)([image], return_tensors="pt")
    pixels, grid = processed["pixel_values"], processed["image_grid_thw"]
    tokens = int(grid.prod()) // 4
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"<|vision_start|><|image_pad|><|vision_end|>{QUESTION}"}],
        add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * tokens))
                        ["input_ids"]])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path).eval()
    torch.save(qwen_vl_reference(model, ids, pixels, grid, IMAGE), path.parent / "reference.pt")
    return path


def _reference(qwen_dir: Path) -> dict:
    return torch.load(qwen_dir.parent / "reference.pt")


@pytest.fixture(scope="module")
def launched(qwen_dir):
    out = qwen_dir.parent / "launched"
    out.mkdir()
    jobs = {"out": str(out), "hf": str(qwen_dir), "reference": str(qwen_dir.parent /
                                                                    "reference.pt")}
    return launch_torchrun(__file__, jobs, out, timeout=600)


def _hf_logits(model, reference: dict) -> torch.Tensor:
    ids = torch.tensor([reference["ids"]])
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=reference["pixels"],
                     image_grid_thw=reference["grid"],
                     mm_token_type_ids=(ids == IMAGE).int()).logits[0]


def _loaded(path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    model, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(path,
                                                                     output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    return model.eval()


def test_round_trip_through_tp2_and_pp2_is_bit_exact(qwen_dir, launched, tmp_path):
    from ray_ppu.hf.files import read_all
    from ray_ppu.offline.mcore_to_hf import export

    original = dict(read_all(qwen_dir))
    assert "lm_head.weight" in original and "visual.merger.mlp.2.bias" in original
    for layout in ("tp2", "pp2"):
        summary = export(launched / layout, tmp_path / layout)
        exported = dict(read_all(summary["out"]))
        assert sorted(exported) == sorted(original), layout
        assert all(torch.equal(exported[n], t) for n, t in original.items()), layout
        for name in ("config.json", "preprocessor_config.json", "tokenizer.json",
                     "tokenizer_config.json"):
            assert (tmp_path / layout / name).read_bytes() == (qwen_dir / name).read_bytes() \
                or name == "config.json", name
        config = json.loads((tmp_path / layout / "config.json").read_text())
        assert config == {**json.loads((qwen_dir / "config.json").read_text()),
                          "dtype": "float32"}
    reference = _reference(qwen_dir)
    assert torch.equal(_hf_logits(_loaded(tmp_path / "tp2"), reference), reference["logits"])
    # what Qwen2_5_VLProcessor reads besides: its class, and a chat template that takes an
    # image entry (the processor itself needs torchvision for its video half, not installed
    # here: its template is applied through the tokenizer, its image pad expanded as it does)
    from transformers import AutoTokenizer

    out = tmp_path / "tp2"
    assert json.loads((out / "processor_config.json").read_text()) == {
        "processor_class": "Qwen2_5_VLProcessor"}
    template = json.loads((out / "chat_template.json").read_text())["chat_template"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        chat_template=template, add_generation_prompt=True, tokenize=False)
    tokens = int(reference["grid"].prod()) // 4
    assert tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * tokens))["input_ids"] == \
        reference["ids"]
    assert tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                         chat_template=template, tokenize=False) == \
        tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False)


def test_an_export_without_its_source_config_writes_one_transformers_loads(qwen_dir, launched,
                                                                            tmp_path):
    """A checkpoint that does not know its source: config.json from ray_ppu's sections, the
    image processor from the vision section's pixel range."""
    from ray_ppu.offline.mcore_to_hf import export

    bare = tmp_path / "bare"
    shutil.copytree(launched / "tp2", bare)
    meta_file = next(bare.rglob("ray_ppu_meta.json"))
    meta = json.loads(meta_file.read_text())
    meta.update(hf_config=None, hf_source=None)
    meta_file.write_text(json.dumps(meta))
    export(meta_file.parent, tmp_path / "hf", tokenizer=qwen_dir)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl" and config["vision_config"]["depth"] == 2
    processor = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
    assert processor["image_processor_type"] == "Qwen2VLImageProcessor"
    reference = _reference(qwen_dir)
    assert torch.equal(_hf_logits(_loaded(tmp_path / "hf"), reference), reference["logits"])


def test_merged_lora_export_has_the_lora_models_logits(qwen_dir, launched, tmp_path):
    from ray_ppu.hf.files import read_all
    from ray_ppu.offline.lora_export import export_merged

    ours = torch.load(launched / "lora_logits.pt")
    reference = _reference(qwen_dir)
    assert (ours - reference["logits"]).abs().max() > 1e-2  # the adapters matter
    summary = export_merged(launched / "lora", tmp_path / "merged")
    merged, original = dict(read_all(summary["out"])), dict(read_all(qwen_dir))
    assert sorted(merged) == sorted(original)
    moved = {n for n, t in original.items() if not torch.equal(t, merged[n])}
    assert moved and all(n.startswith("model.layers.") and n.endswith("proj.weight")
                         for n in moved)
    assert (_hf_logits(_loaded(tmp_path / "merged"), reference) - ours).abs().max() <= 1e-4


def test_peft_export_loads_on_transformers_model_with_the_lora_models_logits(
        qwen_dir, launched, tmp_path):
    from peft import PeftModel

    from ray_ppu.offline.lora_export import export_peft

    export_peft(launched / "lora", tmp_path / "peft")
    model = PeftModel.from_pretrained(_loaded(qwen_dir), tmp_path / "peft").eval()
    adapted = {n.rpartition(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert len(adapted) == 2 * 7 and not any("visual" in n for n in adapted)
    ours = torch.load(launched / "lora_logits.pt")
    assert (_hf_logits(model, _reference(qwen_dir)) - ours).abs().max() <= 1e-4


def test_a_trained_merger_is_exported_as_modules_to_save(qwen_dir, launched, tmp_path):
    """A LoRA run that trained the merger too: its PEFT export carries the merger as
    modules_to_save; PeftModel on the base gives the run's logits, which the merger moved, and
    so does generate.py's --lora path reading the export back."""
    from peft import PeftModel

    from ray_ppu.offline.lora_export import export_peft

    summary = export_peft(launched / "lora_merger", tmp_path / "peft")
    assert summary["modules_to_save"] == ["visual.merger"]
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["visual.merger"]
    model = PeftModel.from_pretrained(_loaded(qwen_dir), tmp_path / "peft").eval()
    ours = torch.load(launched / "lora_merger_logits.pt")
    assert (ours - torch.load(launched / "lora_logits.pt")).abs().max() > 1e-3
    reference = _reference(qwen_dir)
    assert (_hf_logits(model, reference) - ours).abs().max() <= 1e-4
    # and back: ray_ppu applies the adapter (merger included) to the base: the run's logits
    from ray_ppu.model import parallel
    from ray_ppu.offline import generation, inference

    setup = generation.setup(str(qwen_dir), lora=str(tmp_path / "peft"), device="cpu")
    with parallel.process_group("cpu"), \
            inference.built_model(setup.cfg, setup.plan, "cpu") as chunks:
        inference.load_weights(chunks, setup.source, setup.cfg, setup.plan, **setup.adapters)
        again = inference.prompt_logits(
            chunks, reference["ids"], setup.source.model.vocab_size, torch.device("cpu"),
            (reference["pixels"], reference["grid"]),
            positions_of=lambda _tokens: reference["positions"])
    assert (again - ours).abs().max() <= 1e-5


def test_generate_with_an_image_has_transformers_logits(qwen_dir, launched, tmp_path):
    """generate.py --image on the Hugging Face directory: the chat prompt is transformers'
    (ids), its logits are (first token: the last row); on the TP 2 checkpoint the same
    prompt, pixels and positions come out of the preparation (its source's processor and
    tokenizer)."""
    sys.path.insert(0, str(REPO / "entrypoints"))
    import generate

    reference = _reference(qwen_dir)
    proc = subprocess.run(
        [sys.executable, str(REPO / "entrypoints" / "generate.py"), "--checkpoint",
         str(qwen_dir), *_generate_args(qwen_dir), "--dump-logits", str(tmp_path / "logits.json")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["prompt_ids"] == reference["ids"] and len(result["new_ids"]) == 2
    logits = torch.tensor(json.loads((tmp_path / "logits.json").read_text())["logits"])
    assert (logits - reference["logits"]).abs().max() <= 1e-4
    assert result["new_ids"][0] == int(reference["logits"][-1].argmax())

    prepared = generate.prepare(generate.parse_args(["--checkpoint", str(launched / "tp2"),
                                                     *_generate_args(qwen_dir)]))
    [encoded] = prepared[1]
    assert encoded.ids == reference["ids"]
    pixels, grid = encoded.images
    assert torch.equal(pixels, reference["pixels"]) and torch.equal(grid, reference["grid"])
    assert torch.equal(encoded.positions_of(encoded.ids), reference["positions"])


def _generate_args(qwen_dir: Path) -> list[str]:
    return ["--image", str(qwen_dir.parent / "picture.png"), "--prompt", QUESTION,
            "--max-new-tokens", "2"]


# The torchrun side: python -m torch.distributed.run --nproc-per-node 2 tests/test_qwen_vl_export.py
# ---------------------------------------------------------------------------------------------

def _lora_checkpoint(jobs: dict, base: str, out: Path) -> None:
    """ray_ppu's LoRA model on ``base`` at TP 2 with random adapters: its logits, and its
    checkpoint as a LoRA run saves it (the adapters only; meta: lora section and base)."""
    import torch.distributed as dist

    from ray_ppu.checkpoint import saver
    from ray_ppu.config.lora import LoraConfig, is_adapter_key
    from ray_ppu.offline import inference

    reference = torch.load(jobs["reference"])
    source = inference.open_source(base)
    cfg, plan = inference.inference_config(source.model, dist.get_world_size(), 2, 1,
                                           device="cpu", lora=LoraConfig(**LORA),
                                           vision=source.vision)
    with inference.built_model(cfg, plan, "cpu") as chunks:
        inference.load_weights(chunks, source, cfg, plan)
        torch.manual_seed(3)  # the same draws on both ranks: replicated adapters stay equal
        with torch.no_grad():
            for name, param in chunks[0].named_parameters():
                if is_adapter_key(name):
                    param.normal_(0.0, 0.1)
                elif name.startswith("vision_model."):  # a LoRA run's frozen tower
                    param.requires_grad_(False)
        def save_logits(name: str) -> None:
            logits = inference.prompt_logits(
                chunks, reference["ids"], source.model.vocab_size, torch.device("cpu"),
                (reference["pixels"], reference["grid"]),
                positions_of=lambda _tokens: reference["positions"])
            if dist.get_rank() == 0:
                torch.save(logits, out / name)

        save_logits("lora_logits.pt")

        # what a LoRA run's training save holds: the adapters, and its lora section in meta
        origin = {"base": {"path": base, "kind": "mcore", "fingerprint": "test"},
                  "hf_source": jobs["hf"], "hf_config": source.meta.hf_config}
        saver.Saver(out / "lora", plan, cfg, origin=origin).save(1, chunks, None, None,
                                                                 trained_only=True)
        # a run that trained the merger too (vision.freeze=[vision] with LoRA): its logits
        # and checkpoint, the merger saved beside the adapters
        torch.manual_seed(4)
        with torch.no_grad():
            for name, param in chunks[0].named_parameters():
                if ".merger." in name:
                    param.add_(torch.randn_like(param) * 0.05).requires_grad_(True)
        save_logits("lora_merger_logits.pt")
        saver.Saver(out / "lora_merger", plan, cfg, origin=origin).save(
            1, chunks, None, None, trained_only=True)


def _run(jobs: dict) -> None:
    import logging

    from ray_ppu.model import parallel
    from ray_ppu.offline.hf_to_mcore import to_mcore

    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    out = Path(jobs["out"])
    with parallel.process_group("cpu"):
        tp2 = to_mcore(jobs["hf"], out / "tp2", tp=2)["checkpoint"]
        to_mcore(jobs["hf"], out / "pp2", pp=2)
        _lora_checkpoint(jobs, tp2, out)


if __name__ == "__main__":  # dist_checkpointing starts spawn-context helpers: guard needed
    _run(json.loads(Path(sys.argv[1]).read_text()))
