"""What does my model see? The first samples one data-parallel rank would train on, in order.

    python entrypoints/inspect_data.py --config run.yaml --dp-size 16 --dp-rank 3 --num-samples 4
    python entrypoints/inspect_data.py --config run.yaml --tokenizer /ckpt/Qwen2.5-7B   # + text
    python entrypoints/inspect_data.py --config sft.yaml --html rows.html   # SFT / VL: + a page

Pretraining (idxmap): one JSON line per sample: its global sample id, the iteration and
microbatch it belongs to, its token ids, and (with --tokenizer) the decoded text. The ids come
from the same functions the readers use (Megatron's dataset built from the config,
Megatron-LM's sampler order), without Ray or workers; Megatron's indices are built into /
loaded from the run's index cache.

SFT and vision-language (data.dataset: sft): the corpus's figures (records, used, dropped by
reason, tokens, packing efficiency, images and image positions per sample), then each row as
the model sees it: the chat template rendered, ⟦trained tokens⟧ apart from the prompt,
⟨image⟩ spans with their image's size and positions, packed samples one after another, the
padding. From the run's prepared rows when its cache has them, else from the first --records
records of each file, read here the pipeline's way. --html writes the same as a page, with the
images.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ray_ppu.config.loader import load  # noqa: E402
from ray_ppu.errors import ConfigError, UserError, entry_point  # noqa: E402
from ray_ppu.data import idxmap  # noqa: E402
from ray_ppu.data.sampler import rank_sample_ids  # noqa: E402
from ray_ppu.plan import build_plan  # noqa: E402
from ray_ppu.launch.output import absolute_paths  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("--dp-size", type=int, help="data-parallel size (default: the config's)")
    parser.add_argument("--dp-rank", type=int, default=0, help="which DP rank (default 0)")
    parser.add_argument("--num-samples", type=int, default=4, help="how many samples to print")
    parser.add_argument("--start-iteration", type=int, default=0,
                        help="first iteration (a resumed run starts after its checkpoint)")
    parser.add_argument("--split", choices=idxmap.SPLITS, default="train")
    parser.add_argument("--tokenizer", help="idxmap: HF tokenizer directory: also print decoded text")
    parser.add_argument("--records", type=int, default=1024,
                        help="SFT without prepared rows: records read from each file (0: all; "
                             "default one packing window, whose rows are the run's own)")
    parser.add_argument("--html", help="SFT: also write the rows and figures as an HTML page here")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value")
    return parser.parse_args(argv)


def rank_places(dp_rank: int, dp_size: int, global_batch_size: int, micro_batch_size: int,
                start_iteration: int, num_samples: int) -> list[tuple[int, int, int]]:
    """(sample id, iteration, microbatch) of the rank's first samples, in the sampler's order."""
    per_rank = global_batch_size // dp_size
    iterations = np.arange(start_iteration, start_iteration + -(-num_samples // per_rank))
    ids = rank_sample_ids(iterations, dp_rank, dp_size, global_batch_size, micro_batch_size)
    return [(int(sample_id), start_iteration + n // per_rank, (n % per_rank) // micro_batch_size)
            for n, sample_id in enumerate(ids[:num_samples])]


def rank_samples(spec: idxmap.SampleSpec, split: str, dp_rank: int, dp_size: int,
                 global_batch_size: int, micro_batch_size: int, start_iteration: int,
                 num_samples: int):
    """Yield (sample id, iteration, microbatch, token ids) for the rank's first samples."""
    places = rank_places(dp_rank, dp_size, global_batch_size, micro_batch_size,
                         start_iteration, num_samples)
    tokens = idxmap.read(spec, np.array([p[0] for p in places]), split)["tokens"]
    for (sample_id, iteration, microbatch), row in zip(places, tokens):
        yield sample_id, iteration, microbatch, row.tolist()


def _tokenizer(directory):
    """The --tokenizer to decode with (None without one); a bad directory is a ConfigError."""
    if not directory:
        return None
    from ray_ppu.data.tokenizer import load_tokenizer

    try:
        return load_tokenizer(directory)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--tokenizer {directory}: {err}") from None


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        tokenizer = _tokenizer(args.tokenizer)  # before the index work: a bad path fails at once
        cfg = absolute_paths(load(args.config, args.overrides))
        plan = build_plan(cfg)
        dp = args.dp_size or plan.data_parallel_size
        step = plan.micro_batch_size * dp
        if dp < 1 or not 0 <= args.dp_rank < dp or plan.global_batch_size % step:
            raise ConfigError(f"--dp-rank {args.dp_rank} of --dp-size {dp}: need 0 ≤ rank < size "
                              f"and global_batch_size {plan.global_batch_size} divisible by "
                              f"micro_batch_size {plan.micro_batch_size} × {dp} = {step}")
        if args.split == "valid" and not plan.valid_samples:
            raise ConfigError("--split valid: the config runs no validation (training.eval_iters=0)")
        if cfg.data.dataset == "sft":
            return _show_sft(args, cfg, plan, dp)
        spec = idxmap.spec_for(cfg, plan)
        idxmap.prepare(spec)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for sample_id, iteration, microbatch, tokens in rank_samples(
            spec, args.split, args.dp_rank, dp, plan.global_batch_size, plan.micro_batch_size,
            args.start_iteration, args.num_samples):
        row = {"sample_id": sample_id, "iteration": iteration, "microbatch": microbatch,
               "tokens": tokens}
        if tokenizer is not None:
            row["text"] = tokenizer.decode(tokens)
        print(json.dumps(row, ensure_ascii=False))
    return 0


def _show_sft(args, cfg, plan, dp: int) -> int:
    """The SFT / VL view: figures, then the rank's first rows (and the page with --html)."""
    from ray_ppu.data.sft.view import inspect
    from ray_ppu.tools.data_page import figure_lines, html_page, text_lines

    places = rank_places(args.dp_rank, dp, plan.global_batch_size, plan.micro_batch_size,
                         args.start_iteration, args.num_samples)
    found, source, views = inspect(cfg, plan, args.split, np.array([p[0] for p in places]),
                                   args.records)
    placed = [(view, f" (sample {sample_id}, iteration {iteration}, microbatch {microbatch} of "
                     f"DP rank {args.dp_rank})")
              for (view, _), (sample_id, iteration, microbatch) in zip(views, places)]
    print("\n".join(figure_lines(found, source)))
    for view, where in placed:
        print("\n".join(text_lines(view, where, colour=sys.stdout.isatty())))
    if args.html:
        Path(args.html).write_text(html_page(f"{args.split} rows of {args.config}", found, source,
                                             placed), encoding="utf-8")
        print(f"page: {args.html}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main))
