"""What a checkpoint carries besides its weights, so that it is used on its own: the run's
tokenizer (its files and chat template), its generation config and, for a vision-language model,
the image processor its images were prepared with, in ``<checkpoint>/processor/`` under the
names a Hugging Face model directory gives them.

Copies, not paths: the directory a run read its tokenizer or weights from is often gone or
elsewhere by the time its checkpoint is generated from or exported (a scratch download, another
machine), and an image processor silently replaced by the encoder's default moves a model's
logits. The files are a few MB beside the weights. Generation and export read them first
(:func:`carried`), then the Hugging Face directory the run started from, for checkpoints saved
before they carried them.

No torch, no Megatron-Core: rank 0 writes the files when a save completes, the driver and the
offline tools read them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ray_ppu.checkpoint.layout import latest, read_meta
from ray_ppu.config.schema import RunConfig

PROCESSOR_DIR = "processor"
# What a Hugging Face model directory carries for its tokenizer (and chat template).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json")
GENERATION_CONFIG = "generation_config.json"
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"  # = ray_ppu.data.images.PROCESSOR_FILE
FILE_MODE = 0o644  # what transformers' save_pretrained leaves: others on the cluster read it


def carried(checkpoint: str | Path) -> Optional[Path]:
    """The processor directory a checkpoint carries; None for one saved before they did."""
    path = Path(checkpoint) / PROCESSOR_DIR
    return path if path.is_dir() else None


def start_checkpoint(cfg: RunConfig) -> Optional[Path]:
    """The checkpoint ``checkpoint.load`` names (itself, or the latest complete one in it)."""
    if not cfg.checkpoint.load:
        return None
    load = Path(cfg.checkpoint.load).expanduser()
    if read_meta(load) is not None:
        return load
    found = latest(load)
    return found[0] if found else None


def sources(cfg: RunConfig, hf_source: Optional[str] = None) -> list[Path]:
    """Where a run's tokenizer and side files come from, first wins: ``data.tokenizer``,
    ``checkpoint.pretrained``, what ``checkpoint.load``'s checkpoint carries, then the Hugging
    Face directory the run's weights came from (``hf_source``, from the checkpoint meta)."""
    start = start_checkpoint(cfg)
    found = [cfg.data.tokenizer, cfg.checkpoint.pretrained,
             carried(start) if start else None, hf_source]
    return [Path(p).expanduser() for p in found if p and Path(p).expanduser().is_dir()]


def image_processor_dir(cfg: RunConfig) -> Optional[str]:
    """The directory whose ``preprocessor_config.json`` a vision-language run prepares its
    images by: ``checkpoint.pretrained``'s, else the one ``checkpoint.load``'s checkpoint
    carries (a stage-2 or LoRA run on a stage-1 checkpoint); None: the encoder's default."""
    start = start_checkpoint(cfg)
    for directory in (cfg.checkpoint.pretrained, carried(start) if start else None):
        if directory and (Path(directory).expanduser() / IMAGE_PROCESSOR_FILE).is_file():
            return str(Path(directory).expanduser().resolve())
    return None


def gather(cfg: RunConfig, hf_source: Optional[str] = None,
           image_processor: Optional[bytes] = None) -> dict[str, bytes]:
    """The files a run's checkpoints carry, by name: every tokenizer file of the first source
    holding a tokenizer (one source, so the files agree), the first generation config, and
    ``image_processor`` (the preprocessor_config.json its images were prepared by)."""
    files: dict[str, bytes] = {}
    where = sources(cfg, hf_source)
    tokenizer = next((d for d in where if any((d / n).is_file() for n in TOKENIZER_FILES)),
                     None)
    if tokenizer is not None:
        files.update({n: (tokenizer / n).read_bytes() for n in TOKENIZER_FILES
                      if (tokenizer / n).is_file()})
    generation = next((d / GENERATION_CONFIG for d in where
                       if (d / GENERATION_CONFIG).is_file()), None)
    if generation is not None:
        files[GENERATION_CONFIG] = generation.read_bytes()
    if image_processor is not None:
        files[IMAGE_PROCESSOR_FILE] = image_processor
    return files


def write(checkpoint: str | Path, files: dict[str, bytes]) -> list[str]:
    """``files`` into the checkpoint's processor directory, readable by all; their names
    relative to the checkpoint (for its meta's file list)."""
    if not files:
        return []
    directory = Path(checkpoint) / PROCESSOR_DIR
    directory.mkdir(exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
        os.chmod(directory / name, FILE_MODE)
    return [f"{PROCESSOR_DIR}/{name}" for name in sorted(files)]
