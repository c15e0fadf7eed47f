"""Tokenize JSONL / JSON / Parquet text into a Megatron idxmap (PREFIX.bin / PREFIX.idx) with Ray Data.

    python entrypoints/preprocess_data.py --input data/*.jsonl --output-prefix out/corpus_text_document \\
        --tokenizer /models/Qwen2.5-0.5B [--json-key text] [--workers N] [--strict]

One document per record, EOD appended, in input order. With RAY_ADDRESS set (as under
``ray job submit``) it joins that cluster; otherwise it starts a local Ray. Prints a JSON summary.
Exit status 2: bad input (no such path, no matching files, unreadable tokenizer, a record
``--strict`` rejects).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ray_ppu.data.preprocess import preprocess_with_ray  # noqa: E402
from ray_ppu.data.readers import resolve_inputs  # noqa: E402
from ray_ppu.errors import PreprocessError, entry_point  # noqa: E402
from ray_ppu.data.tokenizer import load_tokenizer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="files, directories or globs of .jsonl / .json / .parquet")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", required=True, metavar="DIR",
                        help="Hugging Face tokenizer or checkpoint directory (with tokenizer.json)")
    parser.add_argument("--json-key", default="text", help="the record field holding the text (default: text)")
    parser.add_argument("--workers", type=int, default=None,
                        help="tokenizer actors (default: the cluster's CPUs, at most one per file)")
    parser.add_argument("--strict", action="store_true",
                        help="fail on a record whose field is missing or not a string (default: skip and count)")
    args = parser.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        parser.error("--workers must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    # Everything that can be wrong with the arguments fails here, before Ray starts.
    try:
        files = resolve_inputs(args.input)
        tokenizer = load_tokenizer(args.tokenizer)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    import ray

    # RAY_ADDRESS (ray job submit) joins that cluster; otherwise a new local Ray (never one
    # that `ray start` or a test cluster happened to leave on this machine)
    ray.init(address=os.environ.get("RAY_ADDRESS") or "local")
    try:
        stats = preprocess_with_ray(files, args.output_prefix, tokenizer, json_key=args.json_key,
                                    workers=args.workers, strict=args.strict)
    except PreprocessError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        ray.shutdown()
    print(json.dumps({**stats.to_dict(), "tokenizer": tokenizer.name}))
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main))
