"""Tokenizers for building idxmap corpora.

Two backends behind one interface (:class:`Tokenizer`):

* :func:`qwen2` — the Qwen2 byte-level BPE (what Qwen2.5 checkpoints use) run by ``tiktoken``
  from the BPE ranks that the ``dashscope`` wheel ships (``dashscope/resources/qwen.tiktoken``),
  so a real Qwen vocabulary works offline. ``<|endoftext|>`` (151643) is the end-of-document
  token.
* :func:`load_tokenizer` — any Hugging Face ``tokenizer.json`` (every Qwen2.5 and LLaMA-3.1
  checkpoint ships one), run by HF's Rust ``tokenizers`` package.

:func:`export_qwen2_tokenizer` writes the dashscope ranks as a Hugging Face tokenizer
directory, so the HF path can be exercised (and checked against tiktoken) without a download.

Both backends encode text as *ordinary* text: no BOS/EOS is added, and a literal
``<|endoftext|>`` inside a document is tokenized as the characters it is made of, never as the
special id — a scraped web page that happens to contain that string must not plant a fake
document boundary in the corpus.
"""

from __future__ import annotations

import abc
import functools
import json
import logging
import time
import importlib.util
from pathlib import Path

from ray_ppu.util.fs import atomic_write_text

log = logging.getLogger(__name__)

# Qwen2's pre-tokenisation pattern (its tokenizer.json "Split" regex).
_QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_EOD = 151_643  # <|endoftext|>
QWEN2_VOCAB_SIZE = 151_936  # embedding rows in Qwen2.5 0.5B-3B (151643 BPE + specials + padding)
QWEN2_SPECIAL_TOKENS = {"<|endoftext|>": QWEN2_EOD, "<|im_start|>": 151_644, "<|im_end|>": 151_645}
# The added tokens after them in every Qwen2.5 tokenizer.json, up to the vision ones
# Qwen2.5-VL writes images with (<|vision_start|>, <|image_pad|> × n, <|vision_end|>).
QWEN2_MARKUP_TOKENS = {name: 151_646 + i for i, name in enumerate((
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>"))}

# A ChatML template (the conversation format Qwen2.5 is trained on), written for this project.
# A conversation without a system turn gets Qwen's default system prompt.
QWEN2_CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set turns = messages[1:] -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{%- set turns = messages -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for turn in turns -%}"
    "{{- '<|im_start|>' + turn['role'] + '\\n' + turn['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class Tokenizer(abc.ABC):
    """What preprocessing needs of a tokenizer: encode text, decode ids, the EOD id, the vocabulary size.

    Implementations must be cheap to send to Ray workers: they pickle as a recipe (a factory
    or a directory path), not as the multi-megabyte vocabulary.
    """

    name: str
    eod: int
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as ordinary text (no special tokens added or recognised)."""
        return self.encode_batch([text])[0]

    @abc.abstractmethod
    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` for many texts at once (faster than one call per text)."""

    @abc.abstractmethod
    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (special tokens included)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, eod={self.eod}, vocab_size={self.vocab_size})"


class TiktokenTokenizer(Tokenizer):
    """A ``tiktoken.Encoding``; pickles as the zero-argument factory that built it."""

    def __init__(self, name: str, eod: int, vocab_size: int, encoding, factory) -> None:
        self.name, self.eod, self.vocab_size = name, eod, vocab_size
        self._encoding = encoding
        self._factory = factory

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encoding.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(ids)

    def __reduce__(self):
        # tiktoken would otherwise pickle all 151k ranks into every Ray task that uses us.
        return (self._factory, ())


def _qwen2_ranks() -> dict[bytes, int]:
    try:
        from tiktoken.load import load_tiktoken_bpe
    except ImportError as err:  # pragma: no cover - the demo/test extras install it
        raise RuntimeError("the Qwen2 tokenizer needs `pip install tiktoken dashscope`") from err
    # Only the data file is read: finding the package does not run it (importing dashscope
    # costs ~0.8 s and pulls its web-client stack, which a training image may not carry).
    spec = importlib.util.find_spec("dashscope")
    if spec is None or not spec.submodule_search_locations:  # pragma: no cover
        raise RuntimeError("the Qwen2 tokenizer needs `pip install tiktoken dashscope`")
    ranks_file = Path(spec.submodule_search_locations[0]) / "resources" / "qwen.tiktoken"
    return load_tiktoken_bpe(str(ranks_file))


@functools.lru_cache(maxsize=1)
def qwen2() -> Tokenizer:
    """The Qwen2 BPE, offline (needs the ``tiktoken`` and ``dashscope`` packages)."""
    import tiktoken

    encoding = tiktoken.Encoding(
        name="qwen2",
        pat_str=_QWEN2_PATTERN,
        mergeable_ranks=_qwen2_ranks(),
        special_tokens=QWEN2_SPECIAL_TOKENS,
    )
    return TiktokenTokenizer("qwen2", QWEN2_EOD, QWEN2_VOCAB_SIZE, encoding, qwen2)


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` run by the ``tokenizers`` package.

    Pickles as its directory (plus the already-resolved EOD id and vocabulary size); a copy
    loads ``tokenizer.json`` on first use, so shipping it to a Ray worker costs bytes, not the
    vocabulary. Workers on other nodes therefore need the directory at the same path (shared
    storage, like the corpus itself).
    """

    def __init__(self, directory: str | Path) -> None:
        # Absolute: a Ray worker resolves the path in its own working directory.
        self.directory = str(Path(directory).resolve())
        self.name = self.directory
        self._tok = None
        tok = self._backend()  # validates the directory now, in the caller, with a clear error
        self.eod = _eos_id(Path(self.directory), tok)
        # Added tokens count: Megatron pads the embedding beyond this, never below it.
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def _backend(self):
        if self._tok is None:
            from tokenizers import Tokenizer as RustTokenizer

            path = Path(self.directory) / "tokenizer.json"
            try:
                tok = RustTokenizer.from_file(str(path))
            except Exception as err:  # the Rust side raises a bare Exception for bad JSON
                raise ValueError(f"{path}: not a readable Hugging Face tokenizer: {err}") from err
            # A checkpoint's tokenizer.json may carry truncation/padding for inference; a corpus
            # must keep every token of every document.
            tok.no_truncation()
            tok.no_padding()
            # Special tokens spelled out in the data are text, as tiktoken's encode_ordinary does.
            tok.encode_special_tokens = True
            self._tok = tok
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._backend().encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        tok = self._backend()
        # encode_batch_fast (tokenizers 0.20+) skips the character offsets we never use.
        encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
        encoded = encode(list(texts), add_special_tokens=False)
        return [e.ids for e in encoded]

    def decode(self, ids: list[int]) -> str:
        return self._backend().decode(list(ids), skip_special_tokens=False)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_tok"] = None
        return state


def _eos_id(directory: Path, tok) -> int:
    """The id of tokenizer_config.json's ``eos_token``, else of ``<|endoftext|>``."""
    eos = None
    config_path = directory / "tokenizer_config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ValueError(f"{config_path}: unreadable: {err}") from err
        eos = config.get("eos_token")
        if isinstance(eos, dict):  # older configs store an AddedToken object
            eos = eos.get("content")
    token = eos or "<|endoftext|>"
    token_id = tok.token_to_id(token)
    if token_id is None:
        source = f"eos_token of {config_path}" if eos else "the default end-of-document token"
        raise ValueError(f"{directory}: {source} {token!r} is not in tokenizer.json's vocabulary")
    return token_id


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The Hugging Face tokenizer of a checkpoint or tokenizer directory (its ``tokenizer.json``).

    EOD is ``eos_token`` from ``tokenizer_config.json`` when present, else ``<|endoftext|>``;
    ``vocab_size`` counts added tokens. Raises FileNotFoundError naming the directory and the
    missing file, ValueError for an unreadable tokenizer.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory {directory} does not exist")
    if not (directory / "tokenizer.json").is_file():
        raise FileNotFoundError(f"tokenizer directory {directory} has no tokenizer.json")
    return HFTokenizer(directory)


# --- exporting the dashscope ranks as a Hugging Face tokenizer ---------------------------------


@functools.lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map used by byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, …) are
    mapped, in byte order, to the characters from U+0100 on.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _merge_parts(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two parts that byte-level BPE, using only tokens ranked below ``token``, reduces it to.

    That pair is ``token``'s merge rule: a tokenizer.json BPE that applies merges in rank order then
    reproduces tiktoken's "merge the lowest-ranked adjacent pair" loop. None when BPE gets stuck
    at three or more parts (the token is only reachable as a whole word).
    """
    limit = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    get = ranks.get
    while len(parts) > 2:
        best_rank, best_at = limit, -1
        for i in range(len(parts) - 1):
            rank = get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:  # strict: the leftmost pair wins ties
                best_rank, best_at = rank, i
        if best_at < 0:
            return None
        parts[best_at:best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts[0], parts[1]


def export_qwen2_tokenizer(directory: str | Path) -> Path:
    """Write the Qwen2 BPE (from the dashscope ranks) as a Hugging Face tokenizer directory.

    Writes ``tokenizer.json`` (byte-level BPE: GPT-2 byte mapping, merges derived from the
    ranks, Qwen2's split regex, the three ChatML special tokens), ``tokenizer_config.json``
    (Qwen2.5 base: eos = pad = ``<|endoftext|>``, a ChatML chat template), ``vocab.json`` and
    ``merges.txt``. Idempotent: a directory that already has ``tokenizer.json`` is returned
    untouched. ``tokenizer.json`` is written last and atomically, so its presence means the
    export is complete. Returns the directory. Takes a few seconds (merge derivation).
    """
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import BPE

    directory = Path(directory)
    if (directory / "tokenizer.json").is_file():
        return directory
    started = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    ranks = _qwen2_ranks()
    to_unicode = _byte_to_unicode()

    def as_text(token: bytes) -> str:
        return "".join(to_unicode[b] for b in token)

    ordered = sorted(ranks, key=ranks.__getitem__)
    vocab = {as_text(token): ranks[token] for token in ordered}
    merges = []
    for token in ordered:
        if len(token) > 1 and (parts := _merge_parts(token, ranks)) is not None:
            merges.append((as_text(parts[0]), as_text(parts[1])))

    # ignore_merges: a pre-token that is itself in the vocabulary is emitted whole, as tiktoken
    # does before it runs any merge.
    tok = RustTokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    special = {**QWEN2_SPECIAL_TOKENS, **QWEN2_MARKUP_TOKENS}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    for text, expected in special.items():
        if tok.token_to_id(text) != expected:  # ids follow the vocabulary; make sure they are Qwen's
            raise RuntimeError(f"{text} got id {tok.token_to_id(text)}, expected {expected}")

    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for t, i in special.items()}
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "added_tokens_decoder": added,
        "chat_template": QWEN2_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 131072,
        "split_special_tokens": False,
    }
    atomic_write_text(directory / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False))
    atomic_write_text(directory / "vocab.json", json.dumps(vocab, ensure_ascii=False))
    atomic_write_text(directory / "merges.txt", "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    atomic_write_text(directory / "tokenizer.json", tok.to_str(pretty=False))
    log.info("exported the Qwen2 tokenizer (%d merges) to %s in %.1f s",
                                     len(merges), directory, time.perf_counter() - started)
    return directory
