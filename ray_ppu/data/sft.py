"""Supervised fine-tuning samples from raw JSON shards (the seed's ``MP_DATASET_TYPE=raw``, ``SFT=true``).

Pipeline, one arrow per step::

    files / dirs / globs  ->  records (JSON Lines, JSON array or Parquet; alpaca or chat form)
      -> conversations [{role, content}, ...]      (validated; problems counted by reason)
      -> chat template (Jinja, from tokenizer_config.json) + tokenizer -> ids + assistant mask
      -> samples (tokens = t[:-1], labels = t[1:], loss_mask)     (too long prompt: dropped)
      -> rows: one padded sample per row, or several samples packed per row

Records
    ``{"instruction", "input"?, "output", "system"?}`` (alpaca) becomes system? → user
    (instruction and input joined by a newline, either may be empty) → assistant (output).
    ``{"messages": [{"role", "content"}, ...]}`` (chat) is used as is; roles are system, user,
    assistant, several turns allowed, at least one assistant turn, no empty assistant turn.
    A record with a ``messages`` key is read as chat, else as alpaca.

Problems are never lost silently: each record is either used or dropped for one reason of
:data:`DROP_REASONS`, and the first message of each reason (``file: line N: ...``) is kept in
the summary. ``on_error="fail"`` raises :class:`PreprocessError` on the first record problem
instead; ``prompt_too_long`` is a length policy, not a data error, and never fails. No input
file at all (or only empty files) is always an error naming the paths.

Tokenization (:class:`ChatEncoder`)
    The conversation is rendered with the tokenizer's own chat template (jinja2, the way Hugging
    Face renders it: trim_blocks, lstrip_blocks, ``raise_exception``; no ``transformers``). To
    know which characters came from message contents, the template is first rendered with each
    content replaced by a private-use placeholder; the rendering with the real contents must be
    that string with the placeholders substituted by the contents, as they are or stripped
    (LLaMA-3's templates ``| trim`` them); any other rewrite drops the record as
    ``template_mismatch``.
    Scaffolding (template text) is split at the tokenizer's added tokens, which become their
    ids (``<|im_start|>`` → 151644); contents are always encoded as ordinary text, so a user
    who writes ``<|im_end|>`` gets the characters, never the special id.
    Assistant turns are located by rendering prefixes: turn *k* spans from the end of
    ``render(messages[:k], add_generation_prompt=True)`` to the end of
    ``render(messages[:k+1])``; both must be prefixes of the full rendering. Inside that span
    the loss covers everything up to and including the first added token after the content —
    the end-of-turn token (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for LLaMA-3) — and not the
    scaffolding after it (ChatML's ``\\n``). Tokens after the last assistant token carry no
    loss and are cut off.
    Ordinary text (template text between special tokens, and contents) is tokenized turn by
    turn: cut at every special token and at every assistant turn's start and end. That
    concatenation must equal the tokenization of the whole rendering (cut at special tokens
    only). When it does not (BPE merged across a turn boundary, e.g. an answer starting with a
    newline right after ChatML's ``assistant\\n``) the record is dropped as
    ``template_mismatch`` (fatal with ``on_error="fail"``): the prompt the model would be
    trained on would differ from the one it gets at inference.

Sample layout (Megatron GPT contract, :data:`ray_ppu.data.idxmap.SAMPLE_KEYS`)
    For token ids t[0..n]: ``tokens = t[:-1]``, ``labels = t[1:]``, ``loss_mask[i] = 1`` iff
    ``labels[i]`` is an assistant token. Row length L is ``max_padding_length`` (padding) or
    ``seq_length`` (packing). A sample whose prompt (the tokens before the first assistant
    token) is ≥ L tokens is dropped (``prompt_too_long``); a longer one is cut to L + 1 ids and
    counted as ``truncated`` (loss on the kept part).

Rows (int32 ids and positions, float32 loss mask, as :func:`ray_ppu.data.idxmap.read`)
    * padding: one sample per row, padded to L with the pad id (``pad_token`` of
      tokenizer_config.json, else EOD); labels are the pad id and loss mask 0 there;
      ``position_ids`` 0..L-1.
    * packing: samples, in input order, greedily packed into rows of exactly ``seq_length``
      tokens (a new row starts when the next sample does not fit or the row already has
      ``max_samples_per_row`` samples); the rest of the row is padding. Position ids restart
      at 0 at each sample (and at the padding tail). Extra columns: ``cu_seqlens`` int32
      ``[max_samples_per_row + 2]`` (sequence boundaries, the padding tail being the last
      sequence, so ``cu_seqlens[num_seqs] == seq_length``; entries after ``num_seqs`` repeat the
      last value), ``num_seqs`` int32 and ``max_seqlen`` int32 (the longest sequence of the row).

Packing windows: determinism vs. streaming
    Greedy packing is sequential. Rather than one global packer (a single stage through which
    every sample must pass, with no end-of-stream hook in ``map_batches`` to flush its last
    row), each input file is cut into windows of ``window`` consecutive records (default 1024,
    bad records included) and every window is packed on its own, in order. A window is one
    row of the Ray dataset, so Ray Data can neither split it nor reorder it: rows depend only
    on the files, the tokenizer and the options — not on Ray's block sizes or the number of
    workers — and windows are processed in parallel while the dataset streams. The cost: each
    window ends with its own partly filled row (≈ one row per window of loss against a
    global greedy packing; with 1024 records of ~500 tokens in 4096-token rows, < 1 %), and a
    file with fewer records than ``window`` is a window of its own: shard corpora into files of
    many records. :func:`sft_rows` and :func:`sft_rows_from_files` (in-process) use the same
    windows, so they give the Ray path's rows exactly.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import ray
import ray.data
from ray.data.datasource import FileBasedDatasource

from ray_ppu.data.idxmap import SAMPLE_KEYS
from ray_ppu.data.preprocess import _input_format, resolve_inputs
from ray_ppu.errors import PreprocessError
from ray_ppu.data.tokenizer import HFTokenizer, load_tokenizer

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
ON_ERROR = ("skip", "fail")
# Why a record was not used, in the order the pipeline can find out.
DROP_REASONS = (
    "malformed_json",     # not valid JSON (a JSONL line, or a whole JSON-array file)
    "invalid_utf8",       # bytes that are not UTF-8
    "not_object",         # a record that is not a JSON object
    "missing_fields",     # no instruction/output, no messages, a message without role/content
    "bad_field_type",     # a field of the wrong type (e.g. content that is not a string)
    "unknown_role",       # a role other than system / user / assistant
    "no_assistant_turn",  # a conversation with nothing to learn
    "empty_response",     # an assistant turn (alpaca output) that is empty or blank
    "template_error",     # the chat template raised (e.g. its raise_exception on role order)
    "template_mismatch",  # the template or tokenizer does not fit the piecewise encoding
    "prompt_too_long",    # everything before the first assistant token fills the row
)
PACKING_COLUMNS = ("cu_seqlens", "num_seqs", "max_seqlen")
DEFAULT_WINDOW = 1024
DEFAULT_MAX_SAMPLES_PER_ROW = 64

# Placeholders for message contents while rendering: Unicode private-use characters, which no
# chat template's own text contains.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")


class RecordProblem(Exception):
    """A record that cannot be used: ``reason`` (one of :data:`DROP_REASONS`) and a message."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


# --- records → conversations -------------------------------------------------------------------


def conversation_from_record(record: object) -> list[dict]:
    """The chat messages ``[{"role", "content"}, ...]`` of an alpaca or chat record.

    Alpaca ``{instruction, input?, output, system?}``: system (when non-empty) → user
    (instruction and input joined by "\\n", empty parts left out) → assistant (output).
    Chat ``{messages: [...]}``: roles system / user / assistant, contents strings, at least one
    assistant turn. Raises :class:`RecordProblem` with the reason when the record is unusable.
    """
    if not isinstance(record, dict):
        raise RecordProblem("not_object", f"a record must be a JSON object, got {type(record).__name__}")
    if "messages" in record:
        return _chat_messages(record["messages"])
    missing = [k for k in ("instruction", "output") if record.get(k) is None]
    if missing:
        raise RecordProblem("missing_fields", f"neither 'messages' nor alpaca field(s) {missing}")
    for key in ("instruction", "input", "output", "system"):
        value = record.get(key)
        if value is not None and not isinstance(value, str):
            raise RecordProblem("bad_field_type", f"field {key!r} is {type(value).__name__}, not a string")
    if not record["output"].strip():
        raise RecordProblem("empty_response", "field 'output' is empty")
    messages = []
    if record.get("system"):
        messages.append({"role": "system", "content": record["system"]})
    user = "\n".join(part for part in (record["instruction"], record.get("input") or "") if part)
    messages.append({"role": "user", "content": user})
    messages.append({"role": "assistant", "content": record["output"]})
    return messages


def _chat_messages(messages: object) -> list[dict]:
    if not isinstance(messages, list):
        raise RecordProblem("bad_field_type", f"'messages' is {type(messages).__name__}, not a list")
    if not messages:
        raise RecordProblem("missing_fields", "'messages' is empty")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RecordProblem("bad_field_type", f"messages[{i}] is {type(message).__name__}, not an object")
        role, content = message.get("role"), message.get("content")
        if role is None or content is None:
            raise RecordProblem("missing_fields", f"messages[{i}] has no 'role' or no 'content'")
        if not isinstance(role, str) or not isinstance(content, str):
            raise RecordProblem("bad_field_type", f"messages[{i}]: role and content must be strings")
        if role not in ROLES:
            raise RecordProblem("unknown_role", f"messages[{i}] has role {role!r} (allowed: {', '.join(ROLES)})")
        if role == "assistant" and not content.strip():
            raise RecordProblem("empty_response", f"messages[{i}] (assistant) is empty")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise RecordProblem("no_assistant_turn", "the conversation has no assistant turn")
    return out


# --- chat template + tokenizer -----------------------------------------------------------------


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_template(directory: Path, config: dict) -> str:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name", "template"}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (directory / "chat_template.jinja").is_file():  # newer HF layout
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"{directory}: tokenizer_config.json has no chat_template (nor is there a "
                         f"chat_template.jinja): SFT needs the model's conversation format")
    return template


class _TemplateRaised(Exception):
    """``raise_exception(...)`` called by a chat template."""


def _raise_exception(message):
    raise _TemplateRaised(message)


def _tojson(value, indent=None, separators=None, sort_keys=False):
    # As Hugging Face's: no HTML escaping (jinja2's own tojson escapes <, >, &, ').
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatEncoder:
    """A tokenizer directory's chat template and tokenizer: conversation → (ids, assistant mask).

    Reads ``tokenizer.json`` (through :func:`load_tokenizer`) and ``tokenizer_config.json``
    (``chat_template``, ``pad_token``, ``bos_token``/``eos_token`` for the template). Pickles as
    the directory plus the template text and the added-token table: cheap to send to Ray
    workers, which need the directory at the same path.
    """

    def __init__(self, tokenizer_dir: str | Path) -> None:
        self.tokenizer: HFTokenizer = load_tokenizer(tokenizer_dir)  # type: ignore[assignment]
        directory = Path(self.tokenizer.directory)
        config_path = directory / "tokenizer_config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"tokenizer directory {directory} has no tokenizer_config.json "
                                    f"(the chat template lives there)")
        config = json.loads(config_path.read_text(encoding="utf-8"))
        self.template = _read_chat_template(directory, config)
        with open(directory / "tokenizer.json", encoding="utf-8") as f:
            added = json.load(f).get("added_tokens") or []
        # Every added token, special or not, is atomic in template text (HF matches them in the
        # rendering too); lstrip/rstrip flags of added tokens are not applied.
        self.added_tokens: dict[str, int] = {t["content"]: int(t["id"]) for t in added if t.get("content")}
        self.template_vars = {k: _token_text(config.get(k)) or ""
                              for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.pad_id = self._pad_id(_token_text(config.get("pad_token")), config_path)
        self._compiled = None
        self._splitter = None
        self._compile()  # a template with a syntax error fails here, in the caller

    def _pad_id(self, pad: str | None, config_path: Path) -> int:
        if not pad:
            return self.tokenizer.eod
        if pad in self.added_tokens:
            return self.added_tokens[pad]
        ids = self.tokenizer.encode(pad)  # a pad token that is an ordinary vocabulary entry
        if len(ids) != 1:
            raise ValueError(f"{config_path}: pad_token {pad!r} is not one token of tokenizer.json")
        return ids[0]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_compiled"] = state["_splitter"] = None
        return state

    def _compile(self):
        if self._compiled is None:
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            # The environment Hugging Face renders chat templates in (a sandbox: templates come
            # with downloaded checkpoints), minus strftime_now: renders stay deterministic.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            try:
                self._compiled = env.from_string(self.template)
            except jinja2.TemplateSyntaxError as err:
                raise ValueError(f"{self.tokenizer.directory}: chat_template does not compile: {err}") from err
            names = sorted(self.added_tokens, key=len, reverse=True)
            self._splitter = re.compile("|".join(map(re.escape, names))) if names else None
        return self._compiled

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (what ``apply_chat_template(tokenize=False)`` gives)."""
        return self._compile().render(messages=messages, add_generation_prompt=add_generation_prompt,
                                      **self.template_vars)

    def encode(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """Token ids and per-token assistant flags (1 = trained on) of one conversation.

        Raises :class:`RecordProblem` (``template_error`` / ``template_mismatch``).
        """
        result = self.encode_many([messages])[0]
        if isinstance(result, RecordProblem):
            raise result
        return result

    def encode_many(self, conversations: Sequence[list[dict]]) -> list:
        """:meth:`encode` for many conversations with one tokenizer call; a problem is returned
        (a :class:`RecordProblem` in that conversation's place), not raised."""
        layouts, texts = [], []
        for messages in conversations:
            try:
                layouts.append(self._layout(messages, texts))
            except RecordProblem as problem:
                layouts.append(problem)
        # Most reference units repeat a unit of the turn-by-turn encoding (and templates repeat
        # their scaffolding): encode each distinct text once.
        distinct = list(dict.fromkeys(texts))
        by_text = dict(zip(distinct, self.tokenizer.encode_batch(distinct) if distinct else []))
        encoded = [by_text[t] for t in texts]
        return [layout if isinstance(layout, RecordProblem) else self._assemble(layout, encoded)
                for layout in layouts]

    # The layout of one conversation: the units to encode turn by turn ("segments": text or an
    # added-token id, tagged with its assistant turn) and the units of the whole rendering
    # ("reference"); their texts go to ``texts`` for one batch encode.
    def _layout(self, messages: list[dict], texts: list[str]) -> dict:
        import jinja2

        marks = [f"{_MARK_OPEN}{i}{_MARK_CLOSE}" for i in range(len(messages))]
        masked = [{"role": m["role"], "content": marks[i]} for i, m in enumerate(messages)]
        try:
            full = self.render(masked)
            real = self.render(messages)
            prefixes = [(k, self.render(masked[:k], True), self.render(masked[:k + 1]))
                        for k, m in enumerate(messages) if m["role"] == "assistant"]
        except (_TemplateRaised, jinja2.TemplateError, TypeError, ValueError, KeyError) as err:
            raise RecordProblem("template_error", f"the chat template raised: {err}") from None

        found = [(m.start(), m.end(), int(m.group(1))) for m in _MARK.finditer(full)]
        if [i for _, _, i in found] != list(range(len(messages))):
            raise RecordProblem("template_mismatch", "the chat template does not render each message "
                                "content exactly once and in order")
        # The contents as the template writes them: unchanged, or stripped (LLaMA-3's templates
        # `| trim` every content); any other rewrite leaves content and template inseparable.
        for contents in ([m["content"] for m in messages], [m["content"].strip() for m in messages]):
            if _MARK.sub(lambda m: contents[int(m.group(1))], full) == real:
                break
        else:
            raise RecordProblem("template_mismatch", "the chat template rewrites message contents "
                                "(other than trimming them): cannot tell content from template text")
        spans = []  # (start, end, message index) of each assistant turn, in characters of `full`
        for k, prompt, upto in prefixes:
            if not upto.startswith(prompt) or not full.startswith(upto):
                raise RecordProblem("template_mismatch", f"rendering messages[:{k}] (with generation "
                                    f"prompt) / messages[:{k + 1}] is not a prefix of the whole "
                                    f"conversation's rendering")
            start, end = len(prompt), len(upto)
            mark_start, mark_end = found[k][0], found[k][1]
            if not (start <= mark_start and mark_end <= end) or (spans and start < spans[-1][1]):
                raise RecordProblem("template_mismatch", f"assistant turn {k} is not rendered between "
                                    f"its generation prompt and its end")
            spans.append((start, end, k))

        # Events in rendering order: ("text", str, turn, content_of), ("special", id, turn, -1)
        # and ("cut", None, turn, -1) where an assistant turn starts or ends.
        cuts = sorted({0, len(full), *(p for s, e, _ in found for p in (s, e)),
                       *(p for s, e, _ in spans for p in (s, e))})
        turn_cuts = {p for s, e, _ in spans for p in (s, e)}
        content_at = {s: i for s, _, i in found}
        events = []
        for a, b in zip(cuts, cuts[1:]):
            turn = next((k for s, e, k in spans if s <= a and b <= e), -1)
            if a in turn_cuts:
                events.append(("cut", None, turn, -1))
            if a in content_at and full[a:b] == marks[content_at[a]]:
                events.append(("text", contents[content_at[a]], turn, content_at[a]))
                continue
            piece = full[a:b]
            if _MARK_OPEN in piece or _MARK_CLOSE in piece:  # a turn boundary inside a content
                raise RecordProblem("template_mismatch", "an assistant turn boundary falls inside a "
                                    "message content")
            pos = 0
            for match in (self._splitter.finditer(piece) if self._splitter else ()):
                if match.start() > pos:
                    events.append(("text", piece[pos:match.start()], turn, -1))
                events.append(("special", self.added_tokens[match.group()], turn, -1))
                pos = match.end()
            if pos < len(piece):
                events.append(("text", piece[pos:], turn, -1))

        # Units to encode: ordinary text (template text and contents alike: the template's
        # special tokens are already split out, so nothing in a content can become one) merged
        # up to the next special token — and, for the encoding used, up to the next turn
        # boundary too. The reference is the whole rendering's encoding (no turn boundaries).
        def units(split_at_turns: bool) -> list[list]:
            out, text, tags = [], [], None
            for kind, value, turn, content_of in events:
                if kind == "text":
                    if not text:
                        tags = [turn, -1]
                    text.append(value)
                    if content_of >= 0 and content_of == turn:
                        tags[1] = content_of
                    continue
                if text and (kind == "special" or split_at_turns):
                    out.append([len(texts), None, *tags])
                    texts.append("".join(text))
                    text = []
                if kind == "special":
                    out.append([None, value, turn, -1])
            if text:
                out.append([len(texts), None, *tags])
                texts.append("".join(text))
            return out

        return {"segments": units(True), "reference": units(False)}

    @staticmethod
    def _assemble(layout: dict, encoded: list[list[int]]):
        ids: list[int] = []
        mask: list[int] = []
        phase: dict[int, str] = {}  # turn → "before" / "after" (its content) / "ended"
        for text, token, turn, has_content in layout["segments"]:
            piece = encoded[text] if text is not None else [token]
            flag = 0
            if turn >= 0:
                state = phase.get(turn, "before")
                # The turn is trained on up to and including the first added token after its
                # content (the end-of-turn token); template text after that (ChatML's "\n") is
                # not something the model says.
                flag = 0 if state == "ended" else 1
                if has_content == turn:
                    state = "after"
                elif state == "after" and token is not None:
                    state = "ended"
                phase[turn] = state
            ids.extend(piece)
            mask.extend([flag] * len(piece))
        reference = [t for text, token, *_ in layout["reference"]
                     for t in (encoded[text] if text is not None else [token])]
        if reference != ids:
            at = next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b), min(len(ids), len(reference)))
            return RecordProblem("template_mismatch", f"the template does not fit the tokenizer: "
                                 f"tokenizing the conversation turn by turn differs from tokenizing "
                                 f"the whole rendering at token {at} (BPE merges across the start "
                                 f"or end of an assistant turn, e.g. an answer that starts with a "
                                 f"newline)")
        if 1 not in mask:
            return RecordProblem("empty_response", "no assistant token after tokenization")
        last = len(mask) - mask[::-1].index(1)  # tokens after the last assistant token: no loss
        return ids[:last], mask[:last]


# --- samples and rows ---------------------------------------------------------------------------


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SFTOptions:
    """How samples become rows; validated on construction (ValueError naming the values).

    ``seq_length``: the model's sequence length (row length when packing).
    ``max_padding_length``: row length without packing (default ``seq_length``; ≤ ``seq_length``).
    ``packing``: several samples per row. ``on_error``: ``"skip"`` (count and go on) or
    ``"fail"`` (raise on the first bad record). ``window``: records per packing window.
    ``max_samples_per_row``: packed samples per row at most (fixes the ``cu_seqlens`` width).
    """

    seq_length: int
    max_padding_length: int | None = None
    packing: bool = False
    on_error: str = "skip"
    window: int = DEFAULT_WINDOW
    max_samples_per_row: int = DEFAULT_MAX_SAMPLES_PER_ROW

    def __post_init__(self) -> None:
        if not _is_int(self.seq_length) or self.seq_length < 2:
            raise ValueError(f"seq_length={self.seq_length} must be an integer ≥ 2")
        if self.max_padding_length is not None:
            if not _is_int(self.max_padding_length) or self.max_padding_length < 2:
                raise ValueError(f"max_padding_length={self.max_padding_length} must be an integer ≥ 2")
            if self.max_padding_length > self.seq_length:
                raise ValueError(f"max_padding_length={self.max_padding_length} exceeds "
                                 f"seq_length={self.seq_length}: samples are padded to at most the "
                                 f"model's sequence length")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error={self.on_error!r}: expected one of {ON_ERROR}")
        if self.window < 1 or self.max_samples_per_row < 1:
            raise ValueError(f"window={self.window} and max_samples_per_row={self.max_samples_per_row} "
                             f"must be ≥ 1")

    @property
    def row_length(self) -> int:
        """Tokens per row: ``seq_length`` when packing, else ``max_padding_length``."""
        if self.packing or self.max_padding_length is None:
            return self.seq_length
        return self.max_padding_length

    @property
    def cu_seqlens_width(self) -> int:
        """Entries of each row's ``cu_seqlens``: the samples, a padding tail and the leading 0."""
        return min(self.max_samples_per_row, self.seq_length) + 2


def make_sample(ids: Sequence[int], mask: Sequence[int], max_length: int):
    """``(tokens, labels, loss_mask, truncated)`` of one conversation, or None when its prompt
    (the tokens before the first assistant token) is ≥ ``max_length`` tokens.

    ``tokens = ids[:-1]``, ``labels = ids[1:]``, ``loss_mask = mask[1:]``, at most
    ``max_length`` long: longer samples keep their first ``max_length + 1`` ids (and
    trailing tokens without loss are cut, as they teach nothing).
    """
    prompt = mask.index(1) if 1 in mask else len(mask)
    if prompt >= max_length:
        return None
    truncated = len(ids) > max_length + 1
    ids, mask = list(ids[:max_length + 1]), list(mask[:max_length + 1])
    if truncated:
        last = len(mask) - mask[::-1].index(1)
        ids, mask = ids[:last], mask[:last]
    return (np.asarray(ids[:-1], np.int32), np.asarray(ids[1:], np.int32),
            np.asarray(mask[1:], np.float32), truncated)


def _empty_rows(options: SFTOptions) -> dict[str, np.ndarray]:
    length = options.row_length
    rows = {"tokens": np.empty((0, length), np.int32), "labels": np.empty((0, length), np.int32),
            "loss_mask": np.empty((0, length), np.float32), "position_ids": np.empty((0, length), np.int32)}
    if options.packing:
        rows["cu_seqlens"] = np.empty((0, options.cu_seqlens_width), np.int32)
        rows["num_seqs"] = np.empty((0,), np.int32)
        rows["max_seqlen"] = np.empty((0,), np.int32)
    return rows


def pad_rows(samples: Sequence[tuple], length: int, pad_id: int) -> dict[str, np.ndarray]:
    """One row per sample ``(tokens, labels, loss_mask)``, padded to ``length``: pad id in
    tokens and labels, loss mask 0, position ids 0..length-1."""
    n = len(samples)
    rows = {"tokens": np.full((n, length), pad_id, np.int32), "labels": np.full((n, length), pad_id, np.int32),
            "loss_mask": np.zeros((n, length), np.float32),
            "position_ids": np.tile(np.arange(length, dtype=np.int32), (n, 1))}
    for r, (tokens, labels, loss_mask, *_) in enumerate(samples):
        rows["tokens"][r, :len(tokens)] = tokens
        rows["labels"][r, :len(labels)] = labels
        rows["loss_mask"][r, :len(loss_mask)] = loss_mask
    return rows


def pack_rows(samples: Sequence[tuple], seq_length: int, pad_id: int,
              max_samples_per_row: int = DEFAULT_MAX_SAMPLES_PER_ROW) -> dict[str, np.ndarray]:
    """Samples ``(tokens, labels, loss_mask)`` (each ≤ ``seq_length``), in order, greedily packed
    into rows of ``seq_length``: a row is closed when the next sample does not fit or it holds
    ``max_samples_per_row`` samples. Positions restart at 0 per sample and for the padding tail;
    ``cu_seqlens`` / ``num_seqs`` / ``max_seqlen`` describe each row's sequences (padding tail
    last)."""
    groups: list[list[tuple]] = []
    used = seq_length + 1
    for sample in samples:
        if len(sample[0]) > seq_length:
            raise ValueError(f"a sample of {len(sample[0])} tokens does not fit seq_length={seq_length}")
        if used + len(sample[0]) > seq_length or len(groups[-1]) >= max_samples_per_row:
            groups.append([])
            used = 0
        groups[-1].append(sample)
        used += len(sample[0])
    n, width = len(groups), min(max_samples_per_row, seq_length) + 2
    rows = {"tokens": np.full((n, seq_length), pad_id, np.int32),
            "labels": np.full((n, seq_length), pad_id, np.int32),
            "loss_mask": np.zeros((n, seq_length), np.float32),
            "position_ids": np.zeros((n, seq_length), np.int32),
            "cu_seqlens": np.zeros((n, width), np.int32),
            "num_seqs": np.zeros(n, np.int32),
            "max_seqlen": np.zeros(n, np.int32)}
    for r, group in enumerate(groups):
        bounds = [0]
        for tokens, labels, loss_mask, *_ in group:
            a, b = bounds[-1], bounds[-1] + len(tokens)
            rows["tokens"][r, a:b] = tokens
            rows["labels"][r, a:b] = labels
            rows["loss_mask"][r, a:b] = loss_mask
            bounds.append(b)
        if bounds[-1] < seq_length:  # the padding tail is a sequence of its own
            bounds.append(seq_length)
        lengths = np.diff(bounds)
        rows["position_ids"][r] = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
        rows["cu_seqlens"][r, :len(bounds)] = bounds
        rows["cu_seqlens"][r, len(bounds):] = bounds[-1]
        rows["num_seqs"][r] = len(lengths)
        rows["max_seqlen"][r] = lengths.max()
    return rows


def block_diagonal_causal_mask(cu_seqlens, count: int, seq_length: int) -> np.ndarray:
    """The attention mask of one packed row: bool ``[1, seq_length, seq_length]``.

    Megatron-Core's convention: **True = masked out** (``attention_mask_func`` in
    megatron/core/transformer/utils.py does ``scores.masked_fill_(mask, -10000)``, and
    ``get_default_causal_mask`` is ``triu(ones, 1)``: True above the diagonal). Position *q* may
    attend to *k* iff *k* ≤ *q* and both lie in the same sequence ``[cu_seqlens[j],
    cu_seqlens[j+1])``, j < ``count``. Stack rows into ``[b, 1, s, s]`` (torch.from_numpy) for
    the local (non-Transformer-Engine) attention.
    """
    bounds = np.asarray(cu_seqlens)[1:count + 1]
    segment = np.searchsorted(bounds, np.arange(seq_length), side="right")
    allowed = (segment[:, None] == segment[None, :]) & np.tri(seq_length, dtype=bool)
    return ~allowed[None]


# --- statistics -------------------------------------------------------------------------------


def _new_stats() -> dict:
    return {"records_read": 0, "samples_used": 0, "dropped": dict.fromkeys(DROP_REASONS, 0),
            "truncated": 0, "rows": 0, "sample_tokens": 0, "row_tokens": 0, "loss_tokens": 0,
            "examples": {}}


def _count_problem(stats: dict, reason: str, message: str) -> None:
    stats["dropped"][reason] += 1
    stats["examples"].setdefault(reason, message)


def _merge_stats(parts: Iterable[dict]) -> dict:
    total = _new_stats()
    for part in parts:
        for key in ("records_read", "samples_used", "truncated", "rows", "sample_tokens", "row_tokens",
                    "loss_tokens"):
            total[key] += part[key]
        for reason, n in part["dropped"].items():
            total["dropped"][reason] += n
        for reason, message in part["examples"].items():
            total["examples"].setdefault(reason, message)
    total["dropped_total"] = sum(total["dropped"].values())
    total["packing_efficiency"] = total["sample_tokens"] / total["row_tokens"] if total["row_tokens"] else 0.0
    return total


# --- reading files ------------------------------------------------------------------------------


def _problem_or_raise(reason: str, message: str, on_error: str) -> tuple:
    if on_error == "fail":
        raise PreprocessError(message)
    return ("problem", reason, message)


def _entries(f, path: str, on_error: str) -> Iterator[tuple]:
    """Every record of one opened file as ``("ok", messages)`` or ``("problem", reason, message)``."""
    kind = _input_format(path)
    for where, record in (_parquet_records(f) if kind == "parquet" else _json_records(f, path)):
        if isinstance(record, RecordProblem):
            yield _problem_or_raise(record.reason, f"{path}: {where}: {record.message}", on_error)
            continue
        try:
            yield ("ok", conversation_from_record(record), f"{path}: {where}")
        except RecordProblem as problem:
            yield _problem_or_raise(problem.reason, f"{path}: {where}: {problem.message}", on_error)


def _decode_json(data: bytes):
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        return RecordProblem("invalid_utf8", f"invalid UTF-8 at byte {err.start}")
    try:
        return json.loads(text)
    except ValueError as err:
        return RecordProblem("malformed_json", f"invalid JSON: {err}")


def _json_records(f, path: str) -> Iterator[tuple[str, object]]:
    chunk_bytes = 8 << 20
    head = f.read(chunk_bytes).removeprefix(codecs.BOM_UTF8)
    if head.lstrip()[:1] == b"[":  # a JSON array: parsed whole, a problem is the whole file's
        records = _decode_json(head + f.read())
        if isinstance(records, RecordProblem):
            yield "whole file", records
        elif not isinstance(records, list):
            yield "whole file", RecordProblem("malformed_json", "expected a JSON array of records")
        else:
            yield from ((f"element {i}", r) for i, r in enumerate(records))
        return
    pending, number, chunk = b"", 0, head  # JSON Lines, one chunk of the file in memory at a time
    while chunk:
        pieces = (pending + chunk).split(b"\n")
        pending = pieces.pop()
        for line in pieces:
            number += 1
            if line.strip():  # blank lines are not records
                yield f"line {number}", _decode_json(line)
        chunk = f.read(chunk_bytes)
    if pending.strip():
        yield f"line {number + 1}", _decode_json(pending)


def _parquet_records(f) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq

    row = 0
    for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            yield f"row {row}", record
            row += 1


def _windows(entries: Iterable[tuple], size: int) -> Iterator[tuple[int, bool, list]]:
    """``(index, is_last, entries)`` for consecutive windows of ``size`` entries (an empty input
    is one empty last window, so every file reports that it was read)."""
    window, index = [], 0
    pending = None
    for entry in entries:
        window.append(entry)
        if len(window) == size:
            if pending is not None:
                yield index - 1, False, pending
            pending, window, index = window, [], index + 1
    if pending is not None:
        if window:
            yield index - 1, False, pending
            yield index, True, window
        else:
            yield index - 1, True, pending
    else:
        yield 0, True, window


def resolve_sft_inputs(paths: Sequence[str | Path]) -> list[str]:
    """The data files of ``paths`` (files, directories, globs; see :func:`resolve_inputs`).

    Raises :class:`PreprocessError` naming the paths when there are none, or when every file
    found is empty.
    """
    files = resolve_inputs(paths)
    if all(os.path.getsize(f) == 0 for f in files):
        raise PreprocessError(f"no SFT records: every input file is empty ({', '.join(files)}; "
                              f"given {[str(p) for p in paths]})")
    return files


# --- one window: conversations → rows ---------------------------------------------------------


def process_window(entries: Sequence[tuple], encoder: ChatEncoder, options: SFTOptions):
    """Rows and statistics of one window of entries (see module docstring)."""
    stats = _new_stats()
    stats["records_read"] = len(entries)
    good = [e for e in entries if e[0] == "ok"]
    for entry in entries:
        if entry[0] == "problem":
            _count_problem(stats, entry[1], entry[2])
    samples = []
    length = options.row_length
    for entry, result in zip(good, encoder.encode_many([e[1] for e in good])):
        if isinstance(result, RecordProblem):
            message = f"{entry[2]}: {result.message}"
            if options.on_error == "fail":
                raise PreprocessError(message)
            _count_problem(stats, result.reason, message)
            continue
        sample = make_sample(*result, length)
        if sample is None:
            _count_problem(stats, "prompt_too_long", f"{entry[2]}: the prompt alone is "
                           f"{result[1].index(1)} tokens, the row {length}")
            continue
        samples.append(sample)
        stats["truncated"] += sample[3]
        stats["sample_tokens"] += len(sample[0])
        stats["loss_tokens"] += int(sample[2].sum())
    stats["samples_used"] = len(samples)
    if not samples:
        rows = _empty_rows(options)
    elif options.packing:
        rows = pack_rows(samples, options.seq_length, encoder.pad_id, options.max_samples_per_row)
    else:
        rows = pad_rows(samples, length, encoder.pad_id)
    stats["rows"] = len(rows["tokens"])
    stats["row_tokens"] = stats["rows"] * length
    return rows, stats


def _concat_rows(parts: list[dict], options: SFTOptions) -> dict[str, np.ndarray]:
    parts = [p for p in parts if len(p["tokens"])]
    if not parts:
        return _empty_rows(options)
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def _encoder(tokenizer) -> ChatEncoder:
    return tokenizer if isinstance(tokenizer, ChatEncoder) else ChatEncoder(tokenizer)


def sft_rows(records: Sequence[object], tokenizer: ChatEncoder | str | Path, seq_length: int,
             max_padding_length: int | None = None, packing: bool = False, on_error: str = "skip",
             *, window: int = DEFAULT_WINDOW, max_samples_per_row: int = DEFAULT_MAX_SAMPLES_PER_ROW,
             source: str = "<records>") -> tuple[dict[str, np.ndarray], dict]:
    """Rows and summary of already-parsed records, in this process (tests, inspection).

    ``records`` are treated as one file named ``source`` (windows of ``window`` records), so a
    JSONL file holding the same records gives the same rows through :func:`sft_dataset`.
    ``tokenizer``: a :class:`ChatEncoder` or a tokenizer directory. Returns ``(rows, summary)``;
    rows: dict of arrays ``[n_rows, row_length]`` (+ packing columns), summary: see
    :func:`sft_dataset`.
    """
    options = SFTOptions(seq_length, max_padding_length, packing, on_error, window, max_samples_per_row)
    encoder = _encoder(tokenizer)

    def entries():
        for i, record in enumerate(records):
            try:
                yield ("ok", conversation_from_record(record), f"{source}: record {i}")
            except RecordProblem as problem:
                yield _problem_or_raise(problem.reason, f"{source}: record {i}: {problem.message}", on_error)

    return _run_windows([_windows(entries(), options.window)], encoder, options, files=1)


def sft_rows_from_files(paths: Sequence[str | Path], tokenizer: ChatEncoder | str | Path, seq_length: int,
                        max_padding_length: int | None = None, packing: bool = False,
                        on_error: str = "skip", *, window: int = DEFAULT_WINDOW,
                        max_samples_per_row: int = DEFAULT_MAX_SAMPLES_PER_ROW
                        ) -> tuple[dict[str, np.ndarray], dict]:
    """:func:`sft_dataset`'s rows and summary, computed in this process without Ray.

    Same arguments and the same rows in the same order (the windows are the same); for
    inspection, and for runs without Ray (torchrun).
    """
    options = SFTOptions(seq_length, max_padding_length, packing, on_error, window, max_samples_per_row)
    files = resolve_sft_inputs(paths)
    encoder = _encoder(tokenizer)

    def file_windows(path):
        if _input_format(path) == "parquet":  # ParquetFile needs random access: a plain file
            with pa.OSFile(path) as f:
                yield from _windows(_entries(f, path, on_error), options.window)
        else:
            with pa.input_stream(path, compression="detect") as f:
                yield from _windows(_entries(f, path, on_error), options.window)

    return _run_windows([file_windows(p) for p in files], encoder, options, files=len(files))


def _run_windows(per_file, encoder: ChatEncoder, options: SFTOptions, files: int):
    parts, stats = [], []
    windows = 0
    for file_windows in per_file:
        for _, _, entries in file_windows:
            rows, window_stats = process_window(entries, encoder, options)
            parts.append(rows)
            stats.append(window_stats)
            windows += 1
    summary = _merge_stats(stats)
    summary.update(files=files, windows=windows, complete=True)
    return _concat_rows(parts, options), summary


# --- Ray Data -----------------------------------------------------------------------------------


class _SFTWindows(FileBasedDatasource):
    """One row per window of a file's records: ``source``, ``window``, ``last`` and ``entries``
    (JSON: ``["ok", messages, where]`` / ``["problem", reason, message]``). A window is one
    row so that Ray Data never splits or merges it: packing stays independent of block sizes."""

    def __init__(self, paths: list[str], window: int, on_error: str) -> None:
        super().__init__(paths)
        self._window, self._on_error = window, on_error

    def _open_input_source(self, filesystem, path: str, **open_args):
        if _input_format(path) == "parquet":  # the footer is at the end: needs random access
            return filesystem.open_input_file(path)
        return super()._open_input_source(filesystem, path, **open_args)

    def _read_stream(self, f, path: str):
        for index, last, entries in _windows(_entries(f, path, self._on_error), self._window):
            yield pa.table({"source": pa.array([path], pa.string()), "window": pa.array([index], pa.int64()),
                            "last": pa.array([last], pa.bool_()),
                            "entries": pa.array([json.dumps(entries, ensure_ascii=False)], pa.large_string())})


class _StatsSink:
    """Ray actor: the statistics of each processed window, keyed by (file, window) so that a
    retried task or a second pass over the dataset does not count twice."""

    def __init__(self, files: list[str]) -> None:
        self.order = {os.path.normpath(f): i for i, f in enumerate(files)}
        self.files = files
        self.windows: dict[tuple[int, int], dict] = {}
        self.last: dict[int, int] = {}

    def report(self, source: str, window: int, last: bool, stats: dict) -> None:
        file = self.order.get(os.path.normpath(source))
        if file is None:  # not expected: Ray hands our own paths back
            file = self.order.setdefault(os.path.normpath(source), len(self.order))
        self.windows[(file, window)] = stats
        if last:
            self.last[file] = window

    def summary(self) -> dict:
        summary = _merge_stats(self.windows[k] for k in sorted(self.windows))
        complete = (len(self.last) == len(self.files) and
                    all((f, w) in self.windows for f, n in self.last.items() for w in range(n + 1)))
        summary.update(files=len(self.files), windows=len(self.windows), complete=complete)
        return summary


class _ProcessWindows:
    """Ray Data actor: windows → rows (tokenize with the chat template, pad or pack)."""

    def __init__(self, encoder: ChatEncoder, options: SFTOptions, sink) -> None:
        # One CPU per actor: the Rust tokenizer would otherwise start a thread per core.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.encoder, self.options, self.sink = encoder, options, sink

    def __call__(self, batch: pa.Table) -> dict[str, np.ndarray]:
        parts = []
        for source, window, last, entries in zip(*(batch.column(c).to_pylist()
                                                   for c in ("source", "window", "last", "entries"))):
            rows, stats = process_window([tuple(e) for e in json.loads(entries)], self.encoder, self.options)
            parts.append(rows)
            # Waited for: when the consumer has the rows, the summary already counts them.
            ray.get(self.sink.report.remote(source, window, last, stats))
        return _concat_rows(parts, self.options)


def sft_dataset(paths: Sequence[str | Path], tokenizer_dir: ChatEncoder | str | Path, seq_length: int,
                max_padding_length: int | None = None, packing: bool = False, on_error: str = "skip",
                *, window: int = DEFAULT_WINDOW, max_samples_per_row: int = DEFAULT_MAX_SAMPLES_PER_ROW,
                workers: int | None = None) -> tuple["ray.data.Dataset", Callable[[], dict]]:
    """SFT rows of JSON / JSONL / Parquet files as a streaming, order-preserving Ray Dataset.

    ``paths``: files, directories or globs. ``tokenizer_dir``: a Hugging Face tokenizer
    directory with a ``chat_template`` (same path on every node), or a :class:`ChatEncoder`. ``seq_length``,
    ``max_padding_length``, ``packing``, ``on_error``, ``window``, ``max_samples_per_row``: see
    :class:`SFTOptions`. ``workers``: actors that read, tokenize and pack (default: the
    cluster's CPUs, at most one per file: a file is read by one actor).

    Checked now, in the caller: inputs exist (else :class:`PreprocessError` naming the paths),
    the tokenizer and its template load, the options are consistent. Record problems surface
    while the dataset is consumed (counted, or raised with ``on_error="fail"``).

    Returns ``(dataset, stats_fn)``. Rows: ``tokens``, ``labels``, ``position_ids`` int32 and
    ``loss_mask`` float32, each ``[row_length]``; with packing also ``cu_seqlens`` int32
    ``[min(max_samples_per_row, seq_length) + 2]``, ``num_seqs`` and ``max_seqlen`` int32.
    ``stats_fn()`` returns the summary over the windows processed so far (``complete`` once
    every window of every file has been): ``records_read``, ``samples_used``, ``dropped``
    (per reason, and ``dropped_total``), ``truncated``, ``rows``, ``sample_tokens`` (non-pad),
    ``row_tokens``, ``loss_tokens``, ``packing_efficiency`` (= sample_tokens / row_tokens),
    ``examples`` (the first message per drop reason), ``files``, ``windows``.
    Needs a connected Ray.
    """
    options = SFTOptions(seq_length, max_padding_length, packing, on_error, window, max_samples_per_row)
    files = resolve_sft_inputs(paths)
    encoder = _encoder(tokenizer_dir)
    if workers is None:
        workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
    workers = max(1, min(workers, len(files)))
    sink = ray.remote(_StatsSink).options(num_cpus=0).remote(files)
    # One read task per file, fused into the actors (as preprocess_with_ray does: a read task
    # that had to wait for a CPU the actors hold would stall the pipeline).
    ds = ray.data.read_datasource(_SFTWindows(files, options.window, on_error), override_num_blocks=len(files))
    ds.context.execution_options.preserve_order = True  # rows in input order: the data contract
    ds.context.enable_progress_bars = False
    pool = ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=2)
    ds = ds.map_batches(_ProcessWindows, fn_constructor_args=(encoder, options, sink), batch_size=None,
                        batch_format="pyarrow", compute=pool, num_cpus=1)

    def stats_fn() -> dict:
        return ray.get(sink.summary.remote())

    return ds, stats_fn


__all__ = [
    "DROP_REASONS", "PACKING_COLUMNS", "SAMPLE_KEYS", "ChatEncoder", "PreprocessError", "RecordProblem",
    "SFTOptions", "block_diagonal_causal_mask", "conversation_from_record", "make_sample", "pack_rows",
    "pad_rows", "process_window", "resolve_sft_inputs", "sft_dataset", "sft_rows", "sft_rows_from_files",
]
