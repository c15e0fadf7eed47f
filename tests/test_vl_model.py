"""Vision-language models against transformers' ``LlavaForConditionalGeneration``.

Two tiny random LLaVA models are built offline from config objects and saved with
``save_pretrained``: a SigLIP tower (36-pixel images in 8-pixel patches: 4 pixels of each side
are never seen, as SigLIP-so400m's 384 / 14; the penultimate layer's features, every patch)
with a Qwen2 language model (QKV bias, tied embeddings), and a CLIP tower (class token and
pre-norm, the class token dropped by the "default" strategy, quick GELU) with a LLaMA-3
language model (untied). Norms and biases are drawn at random too, so a mix-up shows. The
pixels are real images drawn with Pillow, through Hugging Face's own image processors.

One torchrun launch of two CPU ranks (this file's ``__main__``) loads both at TP 1, TP 2 and
PP 2 and writes the logits of a prompt holding two images.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ray_ppu.config.loader import ConfigError
from conftest import launch_torchrun

LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (TP, PP); DP makes up the 2 ranks
# Bunny's stages: 1 trains the projector, 2 the projector and the language model; stage 1 at
# PP 2 is refused (the last stage would hold nothing to train: ray_ppu.plan.rules)
STAGES = {"stage1": (["vision", "language"], LAYOUTS[:2]), "stage2": (["vision"], LAYOUTS)}
KINDS = ("siglip_qwen2", "clip_llama")
TEXT = dict(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


def _llava(kind: str):
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, Qwen2Config, SiglipVisionConfig)

    torch.manual_seed(0)
    if kind == "siglip_qwen2":
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                    num_attention_heads=2, image_size=36, patch_size=8)
        text = Qwen2Config(**TEXT, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1e6)
        config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=999,
                             vision_feature_layer=-2, vision_feature_select_strategy="full")
    else:
        vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=2, image_size=28, patch_size=7,
                                  projection_dim=16)
        text = LlamaConfig(**TEXT, rms_norm_eps=1e-5, tie_word_embeddings=False,
                           rope_theta=500_000.0)
        config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=998,
                             vision_feature_layer=-2, vision_feature_select_strategy="default")
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif "bias" in name or "class_embedding" in name:
                param.normal_(0.0, 0.1)
    return model


def _images(size: int) -> list:
    """Two real pictures (a red disc on grey, a blue bar on yellow), not of the model's size."""
    from PIL import Image, ImageDraw

    disc = Image.new("RGB", (50, 40), (128, 128, 128))
    ImageDraw.Draw(disc).ellipse((10, 5, 40, 35), fill=(220, 30, 30))
    bar = Image.new("RGB", (30, 45), (230, 220, 40))
    ImageDraw.Draw(bar).rectangle((5, 10, 25, 20), fill=(20, 40, 200))
    return [disc, bar]


def _processor(kind: str, size: int):
    from transformers import CLIPImageProcessor, SiglipImageProcessor

    if kind == "siglip_qwen2":
        return SiglipImageProcessor(size={"height": size, "width": size})
    return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


@pytest.fixture(scope="module")
def llava_dirs(tmp_path_factory):
    """{kind: directory}, each with the prompt, its pixel values and transformers' logits."""
    root = tmp_path_factory.mktemp("llava")
    dirs = {}
    for kind in KINDS:
        model = _llava(kind)
        path = root / kind
        model.save_pretrained(path)
        size = model.config.vision_config.image_size
        pixels = _processor(kind, size)(images=_images(size), return_tensors="pt").pixel_values
        token, n = model.config.image_token_id, 16  # 16 features per image in both models
        ids = [5, 17, 300] + [token] * n + [42, 7, 8] + [token] * n + [9, 1]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
        torch.save({"ids": ids, "pixels": pixels, "logits": logits}, path / "reference.pt")
        dirs[kind] = path
    return dirs


@pytest.fixture(scope="module")
def launched(llava_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("vl_layouts")
    jobs = {"out": str(out), "models": {k: str(v) for k, v in llava_dirs.items()},
            "layouts": LAYOUTS}
    return launch_torchrun(__file__, jobs, out, timeout=600)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_transformers_at_every_layout(llava_dirs, launched, kind):
    reference = torch.load(llava_dirs[kind] / "reference.pt")["logits"]
    for tp, pp in LAYOUTS:
        ours = torch.load(launched / f"{kind}_tp{tp}_pp{pp}.pt")
        assert ours.shape == reference.shape
        assert (ours - reference).abs().max() <= 1e-4, (kind, tp, pp)


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bit_exact(llava_dirs, launched, tmp_path, kind):
    """LLaVA → torch_dist (converted at TP 2) → LLaVA: every tensor bit for bit (the tower's
    last layer and SigLIP's head, which LLaVA never runs, come from the source directory), the
    same config.json; an image processor config beside them."""
    from ray_ppu.hf.files import read_all
    from ray_ppu.offline.mcore_to_hf import export

    summary = export(launched / f"mcore_{kind}", tmp_path / "exported")
    out = Path(summary["out"])
    original, exported = dict(read_all(llava_dirs[kind])), dict(read_all(out))
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert json.loads((out / "config.json").read_text()) == \
        json.loads((llava_dirs[kind] / "config.json").read_text())
    assert "preprocessor_config.json" in summary["copied"]


@pytest.mark.parametrize("stage", STAGES)
def test_training_at_tp2_and_pp2_gives_tp1s_losses(launched, stage):
    """Three optimizer steps of SigLIP + Qwen2 from its LLaVA directory at TP 1 (DP 2), TP 2
    and PP 2 (stage 2): the same losses; on every rank the frozen parameters are bit-identical
    after training and every trainable one moved."""
    results = {(tp, pp): json.loads((launched / f"train_{stage}_tp{tp}_pp{pp}.json").read_text())
               for tp, pp in STAGES[stage][1]}
    reference = results[(1, 1)]["losses"]
    assert reference[-1] < reference[0]  # it learns
    for layout, result in results.items():
        assert result["losses"] == pytest.approx(reference, rel=1e-5, abs=1e-6), layout
        for rank, (kept, moved, trainable) in enumerate(result["ranks"]):
            assert kept and moved and trainable > 0, (layout, rank)


def test_export_without_its_source_ends_the_tower_at_the_feature_layer(llava_dirs, tmp_path):
    """A checkpoint whose LLaVA source is gone (or a run from separate parts) exports the
    layers it runs: a config whose tower ends at the feature layer, which transformers loads
    with every tensor present and whose logits are the source model's."""
    import shutil

    from transformers import LlavaForConditionalGeneration

    from conftest import REPO
    from ray_ppu.offline.mcore_to_hf import export

    source = tmp_path / "source"
    shutil.copytree(llava_dirs["siglip_qwen2"], source)
    proc = subprocess.run([sys.executable, str(REPO / "entrypoints" / "convert_checkpoint.py"),
                           "hf-to-mcore", "--hf", str(source), "--out", str(tmp_path / "mcore")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.rmtree(source)
    out = Path(export(tmp_path / "mcore", tmp_path / "exported")["out"])
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"]["num_hidden_layers"] == 2  # of 3: feature layer -2
    assert config["vision_feature_layer"] == -1
    model, info = LlavaForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    reference = torch.load(llava_dirs["siglip_qwen2"] / "reference.pt")
    with torch.no_grad():
        logits = model.eval()(input_ids=torch.tensor([reference["ids"]]),
                              pixel_values=reference["pixels"]).logits[0]
    assert (logits - reference["logits"]).abs().max() <= 1e-5


def test_llava_config_json_gives_the_vision_section(llava_dirs):
    from ray_ppu.hf import config as hf_config
    from ray_ppu.hf.llava import llava_from_hf

    siglip = llava_from_hf(hf_config.read(llava_dirs["siglip_qwen2"]), "siglip")
    clip = llava_from_hf(hf_config.read(llava_dirs["clip_llama"]), "clip")
    model, vision = siglip
    assert model.add_qkv_bias and not model.untie_embeddings_and_output_weights
    assert (vision.encoder, vision.image_size, vision.patches, vision.layers_built) == (
        "siglip", 36, 16, 2)
    assert (vision.activation, vision.feature_select, vision.image_token_id) == (
        "gelu_tanh", "full", 999)
    model, vision = clip
    assert model.untie_embeddings_and_output_weights and not model.add_qkv_bias
    assert (vision.encoder, vision.class_token, vision.image_tokens) == ("clip", True, 16)
    assert (vision.activation, vision.feature_select, vision.norm_epsilon) == (
        "quick_gelu", "default", 1e-5)


@pytest.mark.parametrize("change, message", [
    ({"vision_feature_layer": [-2, -1]}, "vision_feature_layer=[-2, -1]"),
    ({"projector_hidden_act": "relu"}, "projector_hidden_act='relu'"),
    ({"vision_config": {"model_type": "pixtral"}}, "model_type='pixtral'"),
])
def test_unsupported_llava_config_is_named(llava_dirs, change, message):
    from ray_ppu.hf import config as hf_config
    from ray_ppu.hf.llava import llava_from_hf

    raw = {**hf_config.read(llava_dirs["siglip_qwen2"]), **change}
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        llava_from_hf(raw, "config.json")


def test_missing_vision_tensor_fails_before_any_model(llava_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    from ray_ppu.offline.source import open_source

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json",):
        (broken / name).write_text((llava_dirs["siglip_qwen2"] / name).read_text())
    tensors = load_file(str(llava_dirs["siglip_qwen2"] / "model.safetensors"))
    gone = next(n for n in tensors if n.endswith("encoder.layers.1.mlp.fc1.weight"))
    del tensors[gone]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ConfigError, match=f"{gone} missing"):
        open_source(broken)


# ---------------------------------------------------------------------------------------------
# The torchrun side: python -m torch.distributed.run --nproc-per-node 2 tests/test_vl_model.py
# ---------------------------------------------------------------------------------------------

def _run_layouts(jobs: dict) -> None:
    import logging

    import torch.distributed as dist

    from ray_ppu.model import parallel
    from ray_ppu.offline import inference
    from ray_ppu.offline.hf_to_mcore import to_mcore

    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    out = Path(jobs["out"])
    with parallel.process_group("cpu"):
        for kind, directory in jobs["models"].items():
            reference = torch.load(Path(directory) / "reference.pt")
            source = inference.open_source(directory)
            for tp, pp in jobs["layouts"]:
                cfg, plan = inference.inference_config(source.model, dist.get_world_size(), tp,
                                                       pp, device="cpu", vision=source.vision)
                with inference.built_model(cfg, plan, "cpu") as chunks:
                    inference.load_weights(chunks, source, cfg, plan)
                    logits = inference.prompt_logits(chunks, reference["ids"],
                                                     source.model.vocab_size,
                                                     torch.device("cpu"), reference["pixels"])
                if dist.get_rank() == 0:
                    torch.save(logits, out / f"{kind}_tp{tp}_pp{pp}.pt")
            to_mcore(directory, out / f"mcore_{kind}", tp=2)  # for the export test
        for stage, (frozen, layouts) in STAGES.items():
            for tp, pp in layouts:
                result = _train(jobs["models"]["siglip_qwen2"], frozen, tp, pp)
                if dist.get_rank() == 0:
                    (out / f"train_{stage}_tp{tp}_pp{pp}.json").write_text(json.dumps(result))


def _rows(count: int, seq: int = 48, seed: int = 0) -> list[dict]:
    """``count`` one-row microbatches of random tokens around one image (16 tokens of id
    999) with random pixels; the loss on the tokens after the image."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        tokens = rng.integers(0, 990, seq + 1)
        tokens[3:19] = 999
        mask = np.zeros(seq, dtype=np.float32)
        mask[19:] = 1.0
        rows.append({"tokens": tokens[None, :-1], "labels": tokens[None, 1:],
                     "loss_mask": mask[None], "position_ids": np.arange(seq)[None],
                     "images": rng.integers(0, 256, (1, 1, 3, 36, 36), dtype=np.uint8),
                     "num_images": np.ones(1, dtype=np.int64)})
    return rows


def _train(directory: str, frozen: list, tp: int, pp: int, steps: int = 3) -> dict:
    """``steps`` optimizer steps of the LLaVA model in ``directory`` at TP × PP (DP: the rest),
    global batch 4 in one-row microbatches (each DP rank its share); the losses, and on every
    rank whether the frozen parameters kept their values and the others moved."""
    import numpy as np
    import torch.distributed as dist

    from ray_ppu import devices
    from ray_ppu.config.loader import load
    from ray_ppu.data.sampler import rank_sample_ids
    from ray_ppu.data.sft.image_samples import vision_data
    from ray_ppu.hf import pretrained
    from ray_ppu.model import parallel
    from ray_ppu.model.gpt import build_model
    from ray_ppu.model.optim import build_optimizer
    from ray_ppu.plan import build_plan
    from ray_ppu.train.loop import wire_gradient_sync
    from ray_ppu.train.schedule import make_schedule, mean_loss, sum_reports

    cfg = load(None, [f"checkpoint.pretrained={directory}", "cluster.device=cpu",
                      "cluster.num_workers=2", f"parallel.tensor_model_parallel_size={tp}",
                      f"parallel.pipeline_model_parallel_size={pp}", "training.precision=fp32",
                      "training.seq_length=48", "training.micro_batch_size=1",
                      "training.global_batch_size=4", f"training.train_iters={steps}",
                      "training.lr=1e-2", "training.lr_warmup_iters=0", "training.eval_iters=0",
                      "data.dataset=sft", "data.data_path=[unused.jsonl]",
                      f"vision.freeze=[{', '.join(frozen)}]"])
    plan = build_plan(cfg)
    rows, device = _rows(4), torch.device("cpu")  # the same global batch each step
    with devices.bound("cpu", 0), parallel.groups(plan, cfg.training.seed):
        from megatron.core import parallel_state as ps

        model, _ = build_model(cfg, plan, "cpu")
        pretrained.load(model, cfg, plan.padded_vocab_size)
        optimizer, _ = build_optimizer(cfg, plan, model)
        wire_gradient_sync(model, optimizer)  # as train() does: DP reduction after the last
        before = {n: p.detach().clone() for n, p in model[0].named_parameters()}
        schedule = make_schedule(plan, model, device, images=vision_data(cfg).spec)
        ids = rank_sample_ids(np.arange(steps), ps.get_data_parallel_rank(),
                              plan.data_parallel_size, 4, 1)
        batches = iter([rows[i % 4] for i in ids])
        losses = []
        for _ in range(steps):
            model[0].zero_grad_buffer()
            optimizer.zero_grad()
            total = sum_reports(schedule(batches, forward_only=False), None)
            assert optimizer.step()[0]
            losses.append(mean_loss(total, device))
        kept = [torch.equal(p, before[n]) for n, p in model[0].named_parameters()
                if not p.requires_grad]
        moved = [not torch.equal(p, before[n]) for n, p in model[0].named_parameters()
                 if p.requires_grad]
        ok = torch.tensor([all(kept), all(moved), len(moved)], dtype=torch.int64)
        everyone = [torch.zeros_like(ok) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, ok)
    return {"losses": losses, "ranks": [t.tolist() for t in everyone]}


if __name__ == "__main__":  # dist_checkpointing starts spawn-context helpers: guard needed
    _run_layouts(json.loads(Path(sys.argv[1]).read_text()))
