"""The vision-language demo: tiny-vl learns to name the colour of a shape, in Bunny's two
stages, on CPU in a few minutes (``entrypoints/demo_vl.py``, ``make demo-vl``).

1. The shapes corpus (:mod:`ray_ppu.tools.shapes`) and the Qwen2 tokenizer, made locally.
2. Stage 1: the projector alone learns to caption (ViT and language model frozen).
3. Stage 2 starts from stage 1's weights: projector, language model and (random, not
   pretrained, so it must) the ViT learn to answer "What colour is the shape?". (Asking
   about shape and place as well halves the colour signal per step: the same 50 % took 400
   iterations instead of ~200 for ~33 %.)
4. On held-out images, ``generate``'s greedy answer to "What colour is the shape?" is scored
   against the truth: chance is one in six.

Demo code, not part of the training path.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ray_ppu.tools.shapes import COLOURS, QUESTIONS, write_corpus

log = logging.getLogger("ray_ppu")


def prepare(out: Path) -> dict:
    """The corpus and tokenizer under ``out`` (made once; the paths either way)."""
    from ray_ppu.data.tokenizer import export_qwen2_tokenizer

    data = out / "shapes"
    if not (data / "heldout.jsonl").is_file():
        write_corpus(data, kinds=("colour",))
    paths = {"image_root": str(data / "images"),
             **{name: str(data / f"{name}.jsonl")
                for name in ("captions", "train", "valid", "heldout")}}
    tokenizer = out / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        export_qwen2_tokenizer(tokenizer)
    paths["tokenizer"] = str(tokenizer)
    return paths


def colour_accuracy(checkpoint: str, heldout: str, image_root: str, tokenizer: str) -> dict:
    """Greedy answers of the checkpoint to the colour question about each held-out image (one
    process, the model loaded once): the share whose first word is the image's colour."""
    import torch

    from ray_ppu.model import parallel
    from ray_ppu.offline import generation, inference

    setup = generation.setup(checkpoint, tokenizer=tokenizer, device="cpu")
    records = [json.loads(line) for line in open(heldout, encoding="utf-8")]
    answers = []
    with parallel.process_group("cpu"), \
            inference.built_model(setup.cfg, setup.plan, "cpu") as chunks:
        inference.load_weights(chunks, setup.source, setup.cfg, setup.plan, **setup.adapters)
        for record in records:
            prompt = generation.Prompt(QUESTIONS["colour"],
                                       images=(str(Path(image_root) / record["image"]),))
            new, _ = generation.continue_prompt(
                chunks, setup.encode(prompt), setup.source.model.vocab_size,
                torch.device("cpu"), generation.Sampling(max_new_tokens=4))
            answers.append(setup.decode(new).split("<|im_end|>")[0].strip())
    right = sum(a.split(".")[0].strip().lower() == r["colour"] for a, r in zip(answers, records))
    return {"images": len(records), "right": right, "accuracy": right / len(records),
            "chance": 1 / len(COLOURS), "examples": [
                {"image": r["image"], "colour": r["colour"], "answer": a}
                for r, a in list(zip(records, answers))[:6]]}
