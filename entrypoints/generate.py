"""Continue a prompt from a checkpoint: the quick look users take after training.

    python entrypoints/generate.py --checkpoint outputs/run/ray_train/run --prompt "Hello"
    python entrypoints/generate.py --checkpoint /ckpt/Qwen2.5-0.5B --raw --prompt "def fib(n):"
    python entrypoints/generate.py --checkpoint RUN --image a.png --prompt "What colour is it?"
    python entrypoints/generate.py --checkpoint RUN --prompts prompts.jsonl --temperature 0.7 \\
        --top-p 0.9 --seed 1
    torchrun --nproc-per-node 8 entrypoints/generate.py --checkpoint … --tp 8 --prompt …

--checkpoint is a Hugging Face directory (config.json + safetensors) or a ray_ppu checkpoint
(or a directory of them: the latest complete one). A checkpoint carries its tokenizer, chat
template and image processor; a LoRA run's checkpoint is applied to the base its meta names
(--base DIR: where that base is now, checked by fingerprint). --lora DIR applies a Hugging
Face PEFT adapter. A prompt is the user turn of the chat template where the tokenizer has one
(--raw: continue the plain text). Greedy unless --temperature > 0. --prompts FILE: one JSON
object per line, {"prompt": text} or {"token_ids": [...]}, with "images": [paths] for a
vision-language model. One JSON line per prompt on stdout. --dump-logits writes the (first)
prompt's logits (every position, the real vocabulary, fp32) as JSON, to compare with another
framework's. Under torchrun the model is split --tp × --pp ways (other ranks are DP
replicas); rank 0 prints.

No KV cache: every new token runs the whole sequence again. A sanity check, not a server.
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

from ray_ppu.errors import ConfigError, UserError, entry_point  # noqa: E402
from ray_ppu.errors import report_before_group  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="Hugging Face directory or ray_ppu checkpoint (directory)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the user's message (with --raw: text to continue)")
    prompt.add_argument("--token-ids", help="comma-separated token ids to continue instead")
    prompt.add_argument("--prompts", metavar="JSONL",
                        help='prompts, one JSON object per line: {"prompt": …} or '
                             '{"token_ids": […]}, optionally "images": [paths]')
    parser.add_argument("--raw", action="store_true",
                        help="continue the prompt as plain text, without the chat template")
    parser.add_argument("--tokenizer", help="Hugging Face tokenizer directory (default: the "
                                            "one the checkpoint carries)")
    parser.add_argument("--lora", metavar="DIR",
                        help="a Hugging Face PEFT LoRA adapter directory to apply to the "
                             "checkpoint (its base)")
    parser.add_argument("--base", metavar="DIR",
                        help="where a LoRA checkpoint's base is now, if it moved (checked "
                             "against the fingerprint the checkpoint recorded)")
    parser.add_argument("--image", action="append", metavar="PATH",
                        help="an image for a vision-language model to answer about (repeat for "
                             "several): --prompt is then the user's question, in the chat "
                             "template, its <image> tags (or the images first) the images; "
                             "Qwen2.5-VL takes each at its own size (the model's min / max "
                             "pixels) with M-RoPE positions")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (default); > 0: sample")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--dump-logits", metavar="FILE", help="write the prompt's logits here")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert parallel size of a MoE model (each rank holds its experts)")
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"],
                        help="compute dtype (default: fp32 on CPU, bf16 on a device)")
    parser.add_argument("--device", choices=["auto", "cpu", "ppu"], default="auto")
    return parser.parse_args(argv)


def _token_ids(text: str) -> list[int]:
    """--token-ids 1,2,3 as integers; anything else is a ConfigError naming the bad item."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    bad = [item for item in items if not item.lstrip("-").isdigit()]
    if bad:
        raise ConfigError(f"--token-ids {text}: {', '.join(map(repr, bad))} "
                          f"{'is not an integer' if len(bad) == 1 else 'are not integers'} "
                          f"(expected comma-separated token ids, e.g. 151644,872)")
    return [int(item) for item in items]


def prepare(args: argparse.Namespace) -> tuple:
    """(the Setup, the encoded prompts, the sampling): every error before any process group
    or model exists (Megatron-Core is not imported yet: 8 s a process)."""
    from ray_ppu.offline import generation

    sampling = generation.Sampling(args.max_new_tokens, args.temperature, args.top_k,
                                   args.top_p, args.seed)
    if sampling.problems():
        raise ConfigError("; ".join(sampling.problems()))
    if args.prompts is not None:
        if args.image:
            raise ConfigError("--image goes with --prompt; in --prompts give each line "
                              "its \"images\"")
        prompts = generation.read_prompts(args.prompts)
    else:
        prompts = [generation.Prompt(
            args.prompt, _token_ids(args.token_ids) if args.token_ids is not None else None,
            tuple(args.image or ()))]
    setup = generation.setup(args.checkpoint, lora=args.lora, base=args.base,
                             tokenizer=args.tokenizer, raw=args.raw,
                             world_size=int(os.environ.get("WORLD_SIZE", 1)), tp=args.tp,
                             pp=args.pp, ep=args.ep, precision=args.precision,
                             device=args.device)
    return setup, [setup.encode(p) for p in prompts], sampling


def main(argv=None) -> int:
    """1. :func:`prepare`: errors before any process group or model exists.
    2. The process group (torchrun's, or one process), the model at TP × PP, its weights.
    3. Each prompt continued; rank 0 prints a JSON line for each, dumps the logits.
    """
    args = parse_args(argv)
    try:
        setup, encoded, sampling = prepare(args)
    except (UserError, RuntimeError) as err:
        return report_before_group(err)

    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    import torch.distributed as dist

    from ray_ppu import devices  # Megatron-Core: after the checks
    from ray_ppu.model import parallel
    from ray_ppu.offline import generation, inference

    results = []
    backend, vocab = setup.cfg.cluster.device, setup.source.model.vocab_size
    with parallel.process_group(backend):
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        with inference.built_model(setup.cfg, setup.plan, backend, local_rank) as chunks:
            inference.load_weights(chunks, setup.source, setup.cfg, setup.plan, **setup.adapters)
            device = devices.torch_device(backend)
            for prompt in encoded:
                results.append(generation.continue_prompt(chunks, prompt, vocab, device,
                                                          sampling))
        if dist.get_rank() != 0:
            return 0
    for prompt, (new, logits) in zip(encoded, results):
        result = {"checkpoint": str(setup.checkpoint),
                  "format": "mcore" if setup.adapters["trained"] else setup.source.kind,
                  "prompt_ids": prompt.ids, "new_ids": new}
        text = setup.decode(new)
        if text is not None:
            result["text"] = text
        if args.dump_logits and prompt is encoded[0]:
            Path(args.dump_logits).write_text(json.dumps(
                {"checkpoint": str(setup.checkpoint), "token_ids": prompt.ids,
                 "vocab_size": logits.shape[1], "logits": logits.cpu().tolist()}))
            result["logits"] = args.dump_logits
        print(json.dumps(result, ensure_ascii=False))
    return 0


if __name__ == "__main__":  # dist_checkpointing starts spawn-context helpers: guard needed
    sys.exit(entry_point(main))
