"""Tokenizers for building idxmap corpora.

The Qwen2 byte-level BPE (what Qwen2.5 checkpoints use) is built from the BPE ranks that the
``dashscope`` wheel ships (``dashscope/resources/qwen.tiktoken``), so a real Qwen vocabulary
works offline. Ids are the same as Hugging Face's Qwen2 tokenizer for ordinary text;
``<|endoftext|>`` (151643) is the end-of-document token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources

# Qwen2's pre-tokenisation pattern (its tokenizer.json "Split" regex).
_QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_EOD = 151_643  # <|endoftext|>
QWEN2_VOCAB_SIZE = 151_936  # embedding rows in Qwen2.5 0.5B-3B (151643 BPE + specials + padding)


@dataclass(frozen=True)
class Tokenizer:
    """What preprocessing needs of a tokenizer: encode text, the EOD id, the vocabulary size."""

    name: str
    eod: int
    vocab_size: int
    _encoding: object

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encoding.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(ids)


@functools.lru_cache(maxsize=1)
def qwen2() -> Tokenizer:
    """The Qwen2 BPE, offline (needs the ``tiktoken`` and ``dashscope`` packages)."""
    try:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe
    except ImportError as err:  # pragma: no cover - the demo/test extras install it
        raise RuntimeError("the Qwen2 tokenizer needs `pip install tiktoken dashscope`") from err
    ranks_file = resources.files("dashscope") / "resources" / "qwen.tiktoken"
    ranks = load_tiktoken_bpe(str(ranks_file))
    encoding = tiktoken.Encoding(
        name="qwen2",
        pat_str=_QWEN2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": QWEN2_EOD, "<|im_start|>": 151_644, "<|im_end|>": 151_645},
    )
    return Tokenizer("qwen2", QWEN2_EOD, QWEN2_VOCAB_SIZE, encoding)
