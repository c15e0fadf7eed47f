"""Greedy-decode a prompt from a checkpoint: the quick look users take after training.

    python entrypoints/generate.py --checkpoint /ckpt/Qwen2.5-0.5B --prompt "def fib(n):"
    python entrypoints/generate.py --checkpoint outputs/run/ray_train/run --prompt "Hello" \\
        --max-new-tokens 64 --dump-logits logits.json
    torchrun --nproc-per-node 8 entrypoints/generate.py --checkpoint … --tp 8 --prompt …

--checkpoint is a Hugging Face directory (config.json + safetensors) or a ray_ppu checkpoint
(or a directory of them: the latest complete one); a LoRA run's checkpoint is applied to the
base it names. --lora DIR applies a Hugging Face PEFT adapter to the checkpoint. The tokenizer is --tokenizer, else the
Hugging Face directory (for a ray_ppu checkpoint: the one its run started from); --token-ids
skips tokenizing. --dump-logits writes the prompt's logits (every position, the real
vocabulary, fp32) as JSON, to compare with another framework's. Under torchrun the model is
split --tp × --pp ways (other ranks are DP replicas); rank 0 prints.

No KV cache: every new token runs the whole sequence again. A sanity check, not a server.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

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
    prompt.add_argument("--prompt", help="text to continue")
    prompt.add_argument("--token-ids", help="comma-separated token ids to continue instead")
    parser.add_argument("--tokenizer", help="Hugging Face tokenizer directory (default: the "
                                            "checkpoint's Hugging Face directory)")
    parser.add_argument("--lora", metavar="DIR",
                        help="a Hugging Face PEFT LoRA adapter directory to apply to the "
                             "checkpoint (its base)")
    parser.add_argument("--image", action="append", metavar="PATH",
                        help="an image for a vision-language model to answer about (repeat for "
                             "several): --prompt is then the user's question, in the chat "
                             "template, its <image> tags (or the images first) the images; "
                             "Qwen2.5-VL takes each at its own size (the model's min / max "
                             "pixels) with M-RoPE positions")
    parser.add_argument("--max-new-tokens", type=int, default=32)
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
    """The checkpoint (format, model config), the tokenizer and prompt ids, and the layout
    checked against the model: (source, tokenizer or None, prompt, backend, cfg, plan, the
    adapters: a PEFT adapter and / or a LoRA checkpoint, for ``load_weights``).

    Megatron-Core is not imported yet (8 s a process): under torchrun every rank finds a bad
    --tp in about a second, before any process group exists.
    """
    from ray_ppu import devices
    from ray_ppu.data.tokenizer import load_tokenizer
    from ray_ppu.offline.source import inference_config, open_source

    token_ids = _token_ids(args.token_ids) if args.token_ids is not None else None
    source, lora, adapter, trained = _with_adapters(open_source(args.checkpoint), args.lora)
    tokenizer_dir = args.tokenizer or source.hf_dir
    tokenizer = None
    if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(tokenizer_dir)
    images, stops = _images(args, source, tokenizer_dir), ()
    if images is not None and token_ids is None:
        from ray_ppu.offline.image_prompt import prompt_ids

        prompt, stops = prompt_ids(tokenizer_dir, args.prompt, len(args.image), source.vision,
                                   images.get("tokens"))
    elif token_ids is not None:
        prompt = token_ids
    elif tokenizer is None:
        raise ConfigError(f"no tokenizer.json for {source.path}: pass --tokenizer DIR or "
                          f"--token-ids")
    else:
        prompt = tokenizer.encode(args.prompt)
    if images is not None:
        wanted = sum(images.get("tokens") or [source.vision.image_tokens] * len(args.image))
        if prompt.count(source.vision.image_token_id) != wanted:
            raise ConfigError(f"the prompt holds {prompt.count(source.vision.image_token_id)} "
                              f"image tokens (id {source.vision.image_token_id}); "
                              f"{len(args.image)} --image(s) take {wanted}")
    if not prompt or max(prompt) >= source.model.vocab_size or min(prompt) < 0:
        raise ConfigError(f"prompt token ids {prompt[:8]}…: expected 1 or more ids below "
                          f"vocab_size {source.model.vocab_size}")
    backend = devices.resolve(args.device)
    precision = args.precision or ("bf16" if backend == "ppu" else "fp32")
    # The layout against the model now, for the world the process group will have
    # (torchrun's WORLD_SIZE, else one process): not on every rank after joining it.
    cfg, plan = inference_config(source.model, int(os.environ.get("WORLD_SIZE", 1)), args.tp,
                                 args.pp, precision=precision, device=backend, ep=args.ep,
                                 etp=1 if args.ep > 1 else None, lora=lora,
                                 vision=source.vision)
    stops = stops or ((tokenizer.eod,) if tokenizer is not None else ())
    return (source, tokenizer, prompt, backend, cfg, plan,
            {"adapter": adapter, "trained": trained}, {**(images or {}), "stop": tuple(stops)})


def _images(args: argparse.Namespace, source, tokenizer_dir) -> Optional[dict]:
    """--image's model inputs (None without it): ``images`` (LLaVA: pixel values; Qwen2.5-VL:
    (pixel values, grid_thw), with each image's ``tokens`` and the M-RoPE ``positions_of``); a
    text model or a missing tokenizer is a ConfigError."""
    if not args.image:
        return None
    if not source.vision.enabled:
        raise ConfigError(f"--image: {source.path} is a text model (no vision section)")
    if args.token_ids is None and tokenizer_dir is None:
        raise ConfigError(f"--image: no tokenizer for {source.path}: pass --tokenizer DIR")
    from ray_ppu.offline import image_prompt

    if source.vision.native:  # Qwen2.5-VL: each image at its own size, M-RoPE positions
        pixels, grid, tokens = image_prompt.native_pixels(args.image, source.vision,
                                                          source.hf_dir)
        return {"images": (pixels, grid), "tokens": tokens,
                "positions_of": image_prompt.mrope_of(grid, source.vision)}
    return {"images": image_prompt.pixel_values(args.image, source.vision, source.hf_dir)}


def _with_adapters(source, lora_dir: Optional[str]) -> tuple:
    """(the base to load, its lora section or None, a PEFT adapter or None, a LoRA checkpoint
    to load the adapters from or None): a LoRA run's checkpoint names its base; --lora adds a
    PEFT adapter to whatever the checkpoint is."""
    from ray_ppu.config.lora import LoraConfig
    from ray_ppu.offline.source import open_source

    trained, lora, adapter = None, None, None
    if source.kind == "mcore" and source.meta.lora is not None:
        base = (source.meta.base or {}).get("path")
        if not base or not Path(base).is_dir():
            raise ConfigError(f"{source.path} holds LoRA adapters; their base {base} is not "
                              f"there")
        trained, lora = str(source.path), LoraConfig(**source.meta.lora)
        source = open_source(base)
    if lora_dir is not None:
        if lora is not None:
            raise ConfigError(f"--lora {lora_dir}: {trained} has adapters already")
        from ray_ppu.hf.peft import lora_section, read_adapter

        adapter = read_adapter(lora_dir, "--lora")
        lora = LoraConfig(**lora_section(adapter, source.model))
    return source, lora, adapter, trained


def main(argv=None) -> int:
    """1. :func:`prepare`: errors before any process group or model exists.
    2. The process group (torchrun's, or one process), the model at TP × PP, its weights.
    3. Greedy decoding; rank 0 prints the continuation and dumps the logits.
    """
    args = parse_args(argv)
    try:
        source, tokenizer, prompt, backend, cfg, plan, adapters, extra = prepare(args)
    except (UserError, RuntimeError) as err:
        return report_before_group(err)

    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    import torch.distributed as dist

    from ray_ppu import devices  # Megatron-Core: after the checks
    from ray_ppu.model import parallel
    from ray_ppu.offline import inference

    with parallel.process_group(backend):
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        with inference.built_model(cfg, plan, backend, local_rank) as chunks:
            inference.load_weights(chunks, source, cfg, plan, **adapters)
            device = devices.torch_device(backend)  # greedy moves the images there
            new, logits = inference.greedy(chunks, prompt, source.model.vocab_size, device,
                                           args.max_new_tokens, extra["stop"],
                                           extra.get("images"), extra.get("positions_of"))
        if dist.get_rank() != 0:
            return 0
    result = {"checkpoint": str(source.path), "format": source.kind, "prompt_ids": prompt,
              "new_ids": new}
    if tokenizer is not None:
        result["text"] = tokenizer.decode(new)
    if args.dump_logits:
        Path(args.dump_logits).write_text(json.dumps(
            {"checkpoint": str(source.path), "token_ids": prompt, "vocab_size": logits.shape[1],
             "logits": logits.cpu().tolist()}))
        result["logits"] = args.dump_logits
    print(json.dumps(result, ensure_ascii=False))
    return 0


if __name__ == "__main__":  # dist_checkpointing starts spawn-context helpers: guard needed
    sys.exit(entry_point(main))
