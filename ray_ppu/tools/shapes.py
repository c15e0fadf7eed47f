"""The vision-language demo corpus: coloured shapes drawn with Pillow, with captions and
questions about them.

Each image is one shape (circle, square or triangle) of one of six colours in one of four
places on a light background, its size and exact place jittered. Bunny's two stages get their
records:

* ``captions.jsonl`` — stage 1 (the projector learns to say what the image holds):
  ``{"image": ..., "caption": "A red circle on the left."}``;
* ``train.jsonl`` / ``valid.jsonl`` — stage 2 (LLaVA conversations), one question per record:
  half about the colour, the rest about the shape or the place;
* ``heldout.jsonl`` — images no record names, with their truth: the colour accuracy of
  ``generate.py --image`` is measured on them (chance is one in six).

Everything is made locally from a seed, so the demo and the tests need no download.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220),
           "yellow": (235, 210, 30), "purple": (140, 40, 170), "orange": (240, 130, 20)}
SHAPES = ("circle", "square", "triangle")
PLACES = {"on the left": (0.28, 0.5), "on the right": (0.72, 0.5), "at the top": (0.5, 0.28),
          "at the bottom": (0.5, 0.72)}
QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is it?",
             "place": "Where is the shape?"}
SIZE = 64  # pixels per side; the image processor resizes to the model's input


def draw(colour: str, shape: str, place: str, rng: random.Random):
    """One image: ``shape`` in ``colour`` around ``place``, size and place jittered."""
    from PIL import Image, ImageDraw

    background = tuple(rng.randint(200, 245) for _ in range(3))
    image = Image.new("RGB", (SIZE, SIZE), background)
    fx, fy = PLACES[place]
    r = rng.uniform(0.2, 0.27) * SIZE  # large: the colour fills several of a small ViT's patches
    x, y = fx * SIZE + rng.uniform(-3, 3), fy * SIZE + rng.uniform(-3, 3)
    pen = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse((x - r, y - r, x + r, y + r), fill=fill)
    elif shape == "square":
        pen.rectangle((x - r, y - r, x + r, y + r), fill=fill)
    else:
        pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)
    return image


def answer(kind: str, colour: str, shape: str, place: str) -> str:
    return {"colour": f"{colour.capitalize()}.", "shape": f"A {shape}.",
            "place": f"{place[0].upper()}{place[1:]}."}[kind]


def _record(stage: int, name: str, truth: tuple, rng: random.Random,
            kinds: tuple[str, ...]) -> dict:
    colour, shape, place = truth
    if stage == 1:
        return {"image": name, "caption": f"A {colour} {shape} {place}."}
    kind = rng.choice(kinds)
    return {"image": name, "conversations": [
        {"from": "human", "value": f"<image>\n{QUESTIONS[kind]}"},
        {"from": "gpt", "value": answer(kind, *truth)}]}


def write_corpus(root: str | Path, train: int = 512, valid: int = 64, heldout: int = 60,
                 seed: int = 0, kinds: tuple[str, ...] = ("colour", "colour", "shape", "place")
                 ) -> dict:
    """Draw the images under ``root/images`` and write the four record files; returns
    their paths ({"image_root", "captions", "train", "valid", "heldout"})."""
    root = Path(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    files = {"captions": [], "train": [], "valid": [], "heldout": []}
    for split, count in (("train", train), ("valid", valid), ("heldout", heldout)):
        for i in range(count):
            truth = (rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(list(PLACES)))
            name = f"{split}_{i:05d}.png"
            draw(*truth, rng).save(root / "images" / name)
            if split == "heldout":
                files["heldout"].append({"image": name, "colour": truth[0], "shape": truth[1],
                                         "place": truth[2]})
                continue
            files[split].append(_record(2, name, truth, rng, kinds))
            if split == "train":
                files["captions"].append(_record(1, name, truth, rng, kinds))
    paths = {"image_root": str(root / "images")}
    for name, records in files.items():
        paths[name] = str(root / f"{name}.jsonl")
        with open(paths[name], "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return paths
