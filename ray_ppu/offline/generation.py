"""What ``generate.py`` does, as a library: from a checkpoint and prompts to continuations.

Everything a user can get wrong is found by :func:`setup` and :meth:`Setup.encode` before any
process group or model exists (under torchrun every rank would otherwise fail alike, after
importing Megatron-Core): the checkpoint and its base, the tokenizer, each prompt and image.
Then :func:`continue_prompt` runs the model (:mod:`ray_ppu.offline.inference`) once per new token.

As users expect from transformers' ``generate`` and a chat UI:

* a checkpoint is enough: the tokenizer, chat template and image processor are the ones it
  carries (:mod:`ray_ppu.checkpoint.processor`), else its run's Hugging Face directory's; a LoRA
  checkpoint finds its base from its meta, or at ``base`` (checked by content fingerprint);
* a prompt is the user turn of the chat template, with the generation prompt after it, where
  the tokenizer has a template; ``raw`` continues the plain text instead;
* greedy by default; ``temperature`` > 0 samples, after ``top_k`` and ``top_p`` filtering, from
  a generator seeded with ``seed`` (every rank draws the same token);
* a token the model emits is never an error: an image token it generates is a plain token (as
  in transformers, whose cached decoding gives new tokens no image features), and the M-RoPE
  positions of a continuation go on from the prompt's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ray_ppu.checkpoint.processor import IMAGE_PROCESSOR_FILE
from ray_ppu.config.lora import LoraConfig
from ray_ppu.errors import ConfigError
from ray_ppu.hf.processor import chat_template
from ray_ppu.offline.source import Source, inference_config, lora_base, open_source


@dataclass(frozen=True)
class Prompt:
    """One prompt as a user gives it: text (or token ids) and the images it asks about."""

    text: Optional[str] = None
    token_ids: Optional[list[int]] = None
    images: tuple[str, ...] = ()


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (transformers' ``generate`` arguments)."""

    max_new_tokens: int = 32
    """Tokens to add at most; fewer when a stop token (end of turn, end of text) comes."""
    temperature: float = 0.0
    """0: greedy (the most likely token); > 0: sample from softmax(logits / temperature)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: all)."""
    top_p: float = 1.0
    """Sample among the fewest most likely tokens whose probability adds up to top_p."""
    seed: int = 0
    """Seed of the sampling generator: the same seed gives the same continuation."""

    def problems(self) -> list[str]:
        found = []
        if self.max_new_tokens < 0:
            found.append(f"--max-new-tokens {self.max_new_tokens}: expected ≥ 0")
        if self.temperature < 0:
            found.append(f"--temperature {self.temperature}: expected ≥ 0 (0: greedy)")
        if self.top_k < 0:
            found.append(f"--top-k {self.top_k}: expected ≥ 0 (0: no limit)")
        if not 0 < self.top_p <= 1:
            found.append(f"--top-p {self.top_p}: expected 0 < top_p ≤ 1")
        return found

    def pick(self, logits, generator) -> int:
        """The next token from the last position's logits [vocab] (fp32, same on every rank)."""
        import torch

        if self.temperature == 0:
            return int(logits.argmax())
        scores = logits.double().cpu() / self.temperature
        if 0 < self.top_k < scores.numel():
            kth = torch.topk(scores, self.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1:
            ordered, order = torch.sort(scores, descending=True)
            mass = ordered.softmax(0).cumsum(0)
            drop = mass - ordered.softmax(0) >= self.top_p  # keep the token crossing top_p
            scores[order[drop]] = float("-inf")
        return int(torch.multinomial(scores.softmax(0), 1, generator=generator))


@dataclass
class Encoded:
    """A prompt as the model takes it."""

    ids: list[int]
    stops: tuple[int, ...]
    images: Any = None
    """LLaVA: pixel values [n, 3, H, W]; Qwen2.5-VL: (patches, grid_thw); None: no images."""
    positions_of: Optional[Callable] = None
    """M-RoPE positions [3, n] of the prompt followed by n - len(ids) new tokens."""


@dataclass
class Setup:
    """A checkpoint ready to generate from (no model yet)."""

    checkpoint: Path
    """What the user named (a LoRA checkpoint, not its base)."""
    source: Source
    """The weights to load first (a LoRA checkpoint's base)."""
    tokenizer_dir: Optional[Path]
    tokenizer: Any
    image_dir: Optional[Path]
    """Whose preprocessor_config.json prepares the images (None: the encoder's default)."""
    chat: bool
    """Prompts go through the tokenizer's chat template."""
    cfg: Any
    plan: Any
    adapters: dict = field(default_factory=dict)
    """For :func:`ray_ppu.offline.inference.load_weights`: a PEFT ``adapter``, a LoRA
    checkpoint (``trained``)."""

    def encode(self, prompt: Prompt) -> Encoded:
        """The prompt's token ids, images and positions; a ConfigError names what is wrong."""
        vision = self.source.vision
        if prompt.images and not vision.enabled:
            raise ConfigError(f"--image: {self.checkpoint} is a text model (no vision section)")
        images = _images(prompt.images, vision, self.image_dir) if prompt.images else {}
        stops: tuple[int, ...] = (self.tokenizer.eod,) if self.tokenizer is not None else ()
        if prompt.token_ids is not None:
            ids = list(prompt.token_ids)
        elif self.tokenizer_dir is None or self.tokenizer is None:
            raise ConfigError(f"no tokenizer for {self.checkpoint} (it carries none, and its "
                              f"run's Hugging Face directory is not there): pass --tokenizer "
                              f"DIR or --token-ids")
        elif self.chat or prompt.images:
            from ray_ppu.offline.image_prompt import prompt_ids

            ids, found = prompt_ids(self.tokenizer_dir, prompt.text, len(prompt.images), vision,
                                    images.get("tokens"))
            stops = tuple(found)
        else:
            ids = self.tokenizer.encode(prompt.text)
        if prompt.images:
            wanted = sum(images.get("tokens") or [vision.image_tokens] * len(prompt.images))
            if ids.count(vision.image_token_id) != wanted:
                raise ConfigError(f"the prompt holds {ids.count(vision.image_token_id)} image "
                                  f"tokens (id {vision.image_token_id}); "
                                  f"{len(prompt.images)} --image(s) take {wanted}")
        vocab = self.source.model.vocab_size
        if not ids or max(ids) >= vocab or min(ids) < 0:
            raise ConfigError(f"prompt token ids {ids[:8]}…: expected 1 or more ids below "
                              f"vocab_size {vocab}")
        return Encoded(ids, stops, images.get("images"), images.get("positions_of"))

    def decode(self, ids: list[int]) -> Optional[str]:
        """Text of generated ids (ids past the tokenizer's vocabulary: the model's padding
        rows, shown as nothing)."""
        if self.tokenizer is None:
            return None
        size = getattr(self.tokenizer, "vocab_size", None)
        return self.tokenizer.decode([i for i in ids if size is None or i < size])


def setup(checkpoint: str, *, lora: Optional[str] = None, base: Optional[str] = None,
          tokenizer: Optional[str] = None, raw: bool = False, world_size: int = 1,
          tp: int = 1, pp: int = 1, ep: int = 1, precision: Optional[str] = None,
          device: str = "auto") -> Setup:
    """The checkpoint, its base and adapters, tokenizer and layout, checked (no Megatron-Core:
    a bad --tp under torchrun is one line on every rank in a second)."""
    from ray_ppu import devices
    from ray_ppu.data.tokenizer import load_tokenizer

    named = open_source(checkpoint)
    source, lora_cfg, adapter, trained = _with_adapters(named, lora, base)
    tokenizer_dir = next((Path(p) for p in (tokenizer, named.processor_dir, source.processor_dir)
                          if p is not None and (Path(p) / "tokenizer.json").is_file()), None)
    if tokenizer is not None and tokenizer_dir != Path(tokenizer):
        raise ConfigError(f"--tokenizer {tokenizer}: no tokenizer.json there")
    loaded = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    image_dir = next((p for p in (named.processor_dir, source.processor_dir)
                      if p is not None and (p / IMAGE_PROCESSOR_FILE).is_file()), None)
    backend = devices.resolve(device)
    precision = precision or ("bf16" if backend == "ppu" else "fp32")
    cfg, plan = inference_config(source.model, world_size, tp, pp, precision=precision,
                                 device=backend, ep=ep, etp=1 if ep > 1 else None,
                                 lora=lora_cfg, vision=source.vision)
    return Setup(named.path, source, tokenizer_dir, loaded, image_dir,
                 chat=not raw and tokenizer_dir is not None
                 and chat_template(tokenizer_dir) is not None,
                 cfg=cfg, plan=plan, adapters={"adapter": adapter, "trained": trained})


def _with_adapters(source: Source, lora_dir: Optional[str], base: Optional[str]) -> tuple:
    """(the base to load, its lora section or None, a PEFT adapter or None, a LoRA checkpoint
    to load the adapters from or None): a LoRA run's checkpoint names its base (``base``: where
    it is now, checked against the fingerprint its meta records); ``lora_dir`` adds a PEFT
    adapter to whatever the checkpoint is."""
    trained, lora, adapter = None, None, None
    if source.kind == "mcore" and source.meta.lora is not None:
        trained, lora = str(source.path), LoraConfig(**source.meta.lora)
        source = open_source(lora_base(source, base))
    elif base is not None:
        raise ConfigError(f"--base {base}: {source.path} is no LoRA checkpoint (it holds every "
                          f"weight)")
    if lora_dir is not None:
        if lora is not None:
            raise ConfigError(f"--lora {lora_dir}: {trained} has adapters already")
        from ray_ppu.hf.peft import lora_section, read_adapter

        adapter = read_adapter(lora_dir, "--lora")
        lora = LoraConfig(**lora_section(adapter, source.model))
    return source, lora, adapter, trained


def _images(paths: tuple[str, ...], vision, model_dir: Optional[Path]) -> dict:
    """The images' model inputs: ``images`` (LLaVA: pixel values; Qwen2.5-VL: (pixel values,
    grid_thw)), each image's ``tokens`` and the M-RoPE ``positions_of`` (Qwen2.5-VL)."""
    from ray_ppu.offline import image_prompt

    if vision.native:  # Qwen2.5-VL: each image at its own size, M-RoPE positions
        pixels, grid, tokens = image_prompt.native_pixels(paths, vision, model_dir)
        return {"images": (pixels, grid), "tokens": tokens,
                "positions_of": image_prompt.mrope_of(grid, vision)}
    return {"images": image_prompt.pixel_values(paths, vision, model_dir)}


def read_prompts(path: str) -> list[Prompt]:
    """A JSONL file of prompts, one object per line: ``{"prompt": text}`` or ``{"token_ids":
    [ids]}``, with ``"images": [paths]`` for a vision-language model (relative to the file).
    Every bad line is named, in one error."""
    file = Path(path).expanduser()
    try:
        # at "\n" only: str.splitlines() would also cut a prompt holding U+2028 in two
        lines = file.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--prompts {path}: {err}") from None
    prompts, problems = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            prompts.append(_prompt_of(json.loads(line), file.parent))
        except (ValueError, TypeError) as err:
            problems.append(f"{file}: line {number}: {err}")
    if problems or not prompts:
        raise ConfigError("; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)"
                                                     if len(problems) > 5 else "")
                          if problems else f"--prompts {path}: no prompt in it")
    return prompts


def _prompt_of(record, root: Path) -> Prompt:
    if not isinstance(record, dict) or ("prompt" in record) == ("token_ids" in record):
        raise ValueError('expected an object with "prompt" (text) or "token_ids" (ids)')
    images = record.get("images", [])
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        raise ValueError('"images" must be a list of paths')
    token_ids = record.get("token_ids")
    if token_ids is not None and not (isinstance(token_ids, list) and all(
            isinstance(i, int) for i in token_ids)):
        raise ValueError('"token_ids" must be a list of integers')
    text = record.get("prompt")
    if text is not None and not isinstance(text, str):
        raise ValueError('"prompt" must be text')
    return Prompt(text, token_ids, tuple(str(root / p) for p in images))


def continue_prompt(chunks: list, encoded: Encoded, vocab_size: int, device,
                    sampling: Sampling) -> tuple[list[int], Any]:
    """The new token ids (up to ``max_new_tokens``, ending at a stop id) and the prompt's own
    logits [len(prompt), vocab] (fp32); collective over the model's ranks."""
    import torch

    from ray_ppu.offline.inference import prompt_logits

    generator = torch.Generator().manual_seed(sampling.seed)
    ids, first = list(encoded.ids), None
    n = len(encoded.ids)  # image features go to the prompt's image tokens only
    for _ in range(sampling.max_new_tokens):
        logits = prompt_logits(chunks, ids, vocab_size, device, encoded.images,
                               encoded.positions_of, image_positions=n)
        first = logits if first is None else first
        token = sampling.pick(logits[-1], generator)
        ids.append(token)
        if token in encoded.stops:
            break
    if first is None:
        first = prompt_logits(chunks, ids, vocab_size, device, encoded.images,
                              encoded.positions_of, image_positions=n)
    return ids[n:], first
