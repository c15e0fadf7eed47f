"""The vision-language demo: tiny-vl learns to name a shape's colour in Bunny's two stages
(the projector; then everything, the tiny tower being random rather than pretrained), on a
local Ray, on CPU (about 5 minutes on 2 cores); then its answers on held-out images are scored
(chance: one in six).

    python entrypoints/demo_vl.py [--stage1-iters N] [--stage2-iters N]

Output in outputs/demo-vl/: shapes/ (the corpus), tokenizer/, stage1/ and stage2/ (each a
run: config.yaml, metrics.jsonl, checkpoints). Each launch starts its stage afresh.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ray_ppu.errors import UserError, entry_point  # noqa: E402

CONFIG = REPO / "entrypoints" / "configs" / "demo-vl.yaml"
OUT = Path("outputs/demo-vl")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage1-iters", type=int, default=20)
    parser.add_argument("--stage2-iters", type=int, default=200)
    return parser.parse_args(argv)


def _stage(paths: dict, name: str, overrides: list[str]) -> tuple:
    from ray_ppu.config.loader import load
    from ray_ppu.launch.output import absolute_paths
    from ray_ppu.plan import build_plan

    shutil.rmtree(OUT / name, ignore_errors=True)  # afresh: a finished run would resume, done
    cfg = absolute_paths(load(CONFIG, [f"output.dir={OUT / name}", *overrides]))
    return cfg, build_plan(cfg)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from ray_ppu.checkpoint.layout import save_root
    from ray_ppu.launch.launcher import connect, launch, shutdown
    from ray_ppu.tools import vl_demo

    paths = vl_demo.prepare(OUT)
    stage1, plan1 = _stage(paths, "stage1", [
        f"data.data_path=[{paths['captions']}]", "vision.freeze=[vision, language]",
        f"training.train_iters={args.stage1_iters}", "training.lr=1e-2", "training.min_lr=1e-3"])
    started = connect(stage1)
    try:
        first = launch(stage1, plan1)
        stage2, plan2 = _stage(paths, "stage2", [
            # the tiny tower is drawn at random, not pretrained: it learns in stage 2 too
            f"data.data_path=[{paths['train']}]", "vision.freeze=[]",
            f"checkpoint.load={save_root(stage1)}", "checkpoint.finetune=true",
            f"training.train_iters={args.stage2_iters}", "training.lr=1e-2",
            "training.min_lr=1e-3"])
        second = launch(stage2, plan2)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        if started:
            shutdown()
    accuracy = vl_demo.colour_accuracy(str(save_root(stage2)), paths["heldout"],
                                       paths["image_root"], paths["tokenizer"])
    print(json.dumps({"stage1": {k: first.get(k) for k in ("iteration", "lm_loss")},
                      "stage2": {k: second.get(k) for k in ("iteration", "lm_loss")},
                      "colour": accuracy}, indent=2))
    return 0


if __name__ == "__main__":  # dist_checkpointing starts spawn-context helpers: guard needed
    sys.exit(entry_point(main))
