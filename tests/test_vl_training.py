"""Vision-language training stages: what trains is exactly what the config names.

Each combination of ``vision.freeze`` and LoRA builds tiny-vl with Megatron's DDP and
distributed optimizer (a world of one, in this process) and takes one real optimizer step on
image-text rows: the parameters that moved are exactly the named ones, every other is
bit-identical, and the optimizer holds state for the trainable ones only (a frozen part costs
no optimizer memory). Across layouts and under Ray Train: tests/test_vl_model.py and
tests/test_vl_run.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from test_sft_training import sft_overrides
from test_vl_data import _ask, image_dir  # noqa: F401 (images drawn with Pillow, a fixture)
from ray_ppu import devices
from ray_ppu.config.loader import load
from ray_ppu.config.lora import ADAPTER_SUFFIX
from ray_ppu.model import parallel
from ray_ppu.plan import build_plan

COMPONENTS = ("vision", "projector", "language")
COMBINATIONS = [(frozen, lora) for n in range(4) for frozen in itertools.combinations(COMPONENTS, n)
                for lora in (False, True) if lora or len(frozen) < 3]  # all frozen, no LoRA: refused


def _config(tmp_path, tokenizer_dir, frozen, lora, pretrained):
    overrides = sft_overrides(tmp_path, tokenizer_dir, tmp_path / "out",
                              f"checkpoint.pretrained={pretrained}",
                              "cluster.num_workers=1", "training.eval_iters=0",
                              "training.micro_batch_size=2", "training.global_batch_size=2",
                              f"vision.freeze=[{', '.join(frozen)}]", f"lora.enabled={lora}",
                              "lora.rank=4", "training.lr=1e-2", "training.lr_warmup_iters=0")
    return load(None, overrides)


@pytest.fixture(scope="module")
def rows(image_dir, qwen2_tokenizer_dir):  # noqa: F811
    from ray_ppu.data.sft import sft_rows
    from ray_ppu.data.sft.image_samples import decode_rows, vision_data

    cfg = load(None, ["model.preset=tiny-vl", f"data.image_root={image_dir}"])
    records = [_ask("red.png", "Which colour?", "Red."), _ask("blue.jpg", "And this?", "Blue.")]
    vision = vision_data(cfg)
    rows, summary = sft_rows(records, qwen2_tokenizer_dir, 128, vision=vision,
                             max_padding_length=128)
    assert summary["samples_used"] == 2 and list(rows["num_images"]) == [1, 1]
    return decode_rows(rows, vision)  # the pixels a reader sends


@pytest.fixture(scope="module")
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _kind(name: str) -> str:
    if ADAPTER_SUFFIX + "." in name:
        return "adapters"
    for prefix, component in (("vision_model.", "vision"), ("vision_projection.", "projector"),
                              ("language_model.", "language")):
        if prefix in name:
            return component
    raise AssertionError(f"{name}: no component")


@pytest.mark.parametrize("frozen,lora", COMBINATIONS,
                         ids=[f"freeze={'+'.join(f) or 'none'}-lora={l}" for f, l in COMBINATIONS])
def test_one_step_moves_exactly_the_named_parts(world_of_one, rows, tmp_path, qwen2_tokenizer_dir,
                                                tiny_llava_dir, frozen, lora):
    from ray_ppu.model.gpt import build_model
    from ray_ppu.model.optim import build_optimizer
    from ray_ppu.train.schedule import make_schedule
    from ray_ppu.data.sft.image_samples import vision_data

    cfg = _config(tmp_path, qwen2_tokenizer_dir, frozen, lora, tiny_llava_dir)
    plan = build_plan(cfg)
    with devices.bound("cpu", 0), parallel.groups(plan, cfg.training.seed):
        model, _ = build_model(cfg, plan, "cpu")
        optimizer, _ = build_optimizer(cfg, plan, model)
        before = {n: p.detach().clone() for n, p in model[0].named_parameters()}
        trainable = {n for n, p in model[0].named_parameters() if p.requires_grad}
        schedule = make_schedule(plan, model, torch.device("cpu"), images=vision_data(cfg).spec)
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        schedule(iter([rows]), forward_only=False)
        ok, _, _ = optimizer.step()
        assert ok
        moved = {n for n, p in model[0].named_parameters() if not torch.equal(p, before[n])}
        state = sum(p.numel() for g in optimizer.optimizer.param_groups for p in g["params"])
        sizes = dict((n, p.numel()) for n, p in model[0].named_parameters())

    # the plan's counts are the model's (the base's, without adapters; tiny-vl's vocabulary
    # needs no padding at TP 1)
    assert plan.num_parameters == sum(n for name, n in sizes.items() if _kind(name) != "adapters")
    assert plan.num_trainable_parameters == sum(sizes[n] for n in trainable)
    expected = {"adapters"} if lora else set()
    expected |= set(COMPONENTS) - set(frozen) - ({"language"} if lora else set())
    assert {_kind(n) for n in trainable} == expected
    assert moved == trainable, sorted(moved ^ trainable)[:5]  # frozen: bit-identical
    assert state == sum(sizes[n] for n in trainable)  # Adam's state for the trainable only


@pytest.mark.parametrize("frozen", [("vision", "projector"), ("vision",), ()])
def test_flops_per_image_are_what_the_image_side_computes(world_of_one, tmp_path, tiny_llava_dir,
                                                          qwen2_tokenizer_dir, frozen):
    """The plan's FLOPs per image are torch's count of the ViT and projector's forward (and
    backward, as far as it trains) on one image: matmuls, the patch convolution, attention
    (SDPA's math kernel: torch's counter has no formula for the fused CPU kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from ray_ppu.model.gpt import build_model
    from ray_ppu.plan.vision import flops_per_image
    from ray_ppu.util.wrappers import unwrap

    cfg = _config(tmp_path, qwen2_tokenizer_dir, frozen, True, tiny_llava_dir)
    plan = build_plan(cfg)
    with devices.bound("cpu", 0), parallel.groups(plan, cfg.training.seed):
        model = unwrap(build_model(cfg, plan, "cpu", ddp=False)[0][0])
        image = torch.rand(1, 3, 32, 32)  # pixels never need a gradient
        with FlopCounterMode(display=False) as counter, sdpa_kernel([SDPBackend.MATH]):
            features = model.image_features(image)
            if features.requires_grad:
                features.sum().backward()
    assert counter.get_total_flops() == flops_per_image(cfg) > 0


def test_generate_answers_about_an_image_as_transformers_does(tiny_llava_dir, image_dir, tmp_path):  # noqa: F811
    """generate.py --image: the question in the chat template with the image's 16 tokens, the
    image through the model's processor; the greedy answer is transformers' for those ids and
    that image. A broken image is one error line naming it."""
    import json
    import subprocess
    import sys

    from PIL import Image
    from transformers import LlavaForConditionalGeneration, SiglipImageProcessor

    from conftest import REPO

    def generate(*args):
        return subprocess.run([sys.executable, str(REPO / "entrypoints" / "generate.py"),
                               "--checkpoint", str(tiny_llava_dir), "--max-new-tokens", "6",
                               *args], capture_output=True, text=True, timeout=300)

    proc = generate("--image", str(image_dir / "red.png"), "--prompt", "What colour is it?")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = json.loads(proc.stdout.strip().splitlines()[-1])
    ids = ours["prompt_ids"]
    assert ids.count(151_655) == 16 and ids[0] == 151_644  # <|im_start|>user … the image
    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir).eval()
    pixels = SiglipImageProcessor.from_pretrained(tiny_llava_dir)(
        images=Image.open(image_dir / "red.png"), return_tensors="pt").pixel_values
    with torch.no_grad():
        theirs = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels,
                                max_new_tokens=len(ours["new_ids"]), do_sample=False)
    assert ours["new_ids"] == theirs[0, len(ids):].tolist()
    (tmp_path / "broken.png").write_bytes(b"not a png")
    proc = generate("--image", str(tmp_path / "broken.png"), "--prompt", "Hi")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "broken.png" in proc.stderr


def test_a_generated_image_token_is_a_plain_token_as_in_transformers(world_of_one,
                                                                     tiny_llava_dir, image_dir):  # noqa: F811
    """A continuation holding the image token (which greedy decoding may emit) runs: the
    prompt's image tokens take the image, the new one is a plain token, as in transformers'
    cached decoding (no pixels after the prompt); the logits of the new positions agree."""
    from PIL import Image
    from transformers import LlavaForConditionalGeneration, SiglipImageProcessor

    from ray_ppu.offline import generation, inference

    setup = generation.setup(str(tiny_llava_dir), device="cpu")
    encoded = setup.encode(generation.Prompt("Which colour?", images=(str(image_dir / "red.png"),)))
    image_token = setup.source.vision.image_token_id
    ids = encoded.ids + [image_token, 872]
    with inference.built_model(setup.cfg, setup.plan, "cpu") as chunks:
        inference.load_weights(chunks, setup.source, setup.cfg, setup.plan)
        ours = inference.prompt_logits(chunks, ids, setup.source.model.vocab_size,
                                       torch.device("cpu"), encoded.images,
                                       image_positions=len(encoded.ids))
    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir).eval()
    pixels = SiglipImageProcessor.from_pretrained(tiny_llava_dir)(
        images=Image.open(image_dir / "red.png"), return_tensors="pt").pixel_values
    with torch.no_grad():
        prompt = model(input_ids=torch.tensor([encoded.ids]), pixel_values=pixels, use_cache=True)
        after = model(input_ids=torch.tensor([ids[-2:]]),
                      cache=prompt.past_key_values).logits[0]
    assert (ours[-2:] - after[:, :ours.shape[1]]).abs().max() <= 1e-4
    assert (ours[:-2] - prompt.logits[0, :, :ours.shape[1]]).abs().max() <= 1e-4
