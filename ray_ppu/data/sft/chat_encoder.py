"""Conversation → token ids and assistant mask, with the model's own chat template.

:class:`ChatEncoder` renders a conversation with the tokenizer directory's chat template (jinja2,
the way Hugging Face renders it, without ``transformers``) and tokenizes it so that the loss mask
follows the assistant turns token by token. The package docstring (:mod:`ray_ppu.data.sft`,
"Tokenization") gives the rules; in short: the template is rendered with placeholders for the
message contents to tell template text from content, assistant turns are located by rendering
prefixes, template text is cut at the tokenizer's added tokens (contents never are), and the
turn-by-turn tokenization must equal the tokenization of the whole rendering, or the record is
dropped as ``template_mismatch``: the model would be trained on a prompt it never gets at
inference. Hugging Face's ``apply_chat_template(return_assistant_tokens_mask=True)`` would need
``{% generation %}`` markers, which the Qwen2.5 and LLaMA-3.1 templates do not have.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

from ray_ppu.data.sft.records import IMAGE_TAG, RecordProblem
from ray_ppu.data.tokenizer import HFTokenizer, load_tokenizer

# Placeholders for message contents while rendering: Unicode private-use characters, which no
# chat template's own text contains.
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def chat_template_of(directory: Path, config: Optional[dict] = None) -> Optional[str]:
    """A tokenizer directory's chat template: tokenizer_config.json's (``config``, read here
    when not given; named templates: the default one), else chat_template.jinja; None when it
    has none."""
    if config is None:
        path = directory / "tokenizer_config.json"
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name", "template"}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (directory / "chat_template.jinja").is_file():  # newer HF layout
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    return template if isinstance(template, str) and template.strip() else None


def _read_chat_template(directory: Path, config: dict) -> str:
    template = chat_template_of(directory, config)
    if template is None:
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


@dataclass(frozen=True)
class _Rendering:
    """One conversation rendered with a placeholder in place of each message content."""

    full: str  # the rendering with placeholders
    marks: list[str]  # the placeholder of each message
    contents: list[str]  # each message's content as the template writes it (as is, or stripped)
    found: list[tuple[int, int, int]]  # (start, end, message index) of each placeholder in `full`
    # (k, render(messages[:k], add_generation_prompt=True), render(messages[:k+1])) per assistant turn k
    prefixes: list[tuple[int, str, str]]


ImageTokens = Optional[Iterator[list[int]]]  # each image's ids in turn, None: tags are text


def _image_iterators(image_token, n: int) -> list[ImageTokens]:
    """Per conversation, an iterator over its images' token ids. ``image_token``: None; (id,
    count), every image ``count`` copies of ``id`` (LLaVA); or per conversation a list of
    each image's ids (Qwen2.5-VL: <|vision_start|>, its pads, <|vision_end|>)."""
    if image_token is None:
        return [None] * n
    if isinstance(image_token, tuple):
        token, count = image_token
        return [itertools.repeat([token] * count) for _ in range(n)]
    return [iter(images) for images in image_token]


def _content_events(content: str, turn: int, index: int, images: ImageTokens) -> list[tuple]:
    """A message content as events: its text, and with ``images`` each ``<image>`` tag as the
    next image's tokens (atomic, like the template's added tokens)."""
    if images is None or IMAGE_TAG not in content:
        return [("text", content, turn, index)]
    events: list[tuple] = []
    for k, piece in enumerate(content.split(IMAGE_TAG)):
        if k:
            ids = next(images, None)
            if ids is None:
                raise RecordProblem("image_tag_mismatch", f"more {IMAGE_TAG} tags than images")
            events.extend(("special", token, turn, -1) for token in ids)
        if piece:
            events.append(("text", piece, turn, index))
    return events


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

    def encode_many(self, conversations: Sequence[list[dict]], image_token=None) -> list:
        """:meth:`encode` for many conversations with one tokenizer call; a problem is returned
        (a :class:`RecordProblem` in that conversation's place), not raised. ``image_token``
        (id, count): each ``<image>`` tag in a content becomes ``count`` copies of that id
        (a vision-language model's image positions); a list (per conversation) of lists (per
        image) of ids: each tag becomes its image's ids; None: tags are ordinary text."""
        layouts, texts = [], []
        for messages, images in zip(conversations,
                                    _image_iterators(image_token, len(conversations))):
            try:
                layouts.append(self._layout(messages, texts, images))
            except RecordProblem as problem:
                layouts.append(problem)
        # Most reference units repeat a unit of the turn-by-turn encoding (and templates repeat
        # their scaffolding): encode each distinct text once.
        distinct = list(dict.fromkeys(texts))
        by_text = dict(zip(distinct, self.tokenizer.encode_batch(distinct) if distinct else []))
        encoded = [by_text[t] for t in texts]
        return [layout if isinstance(layout, RecordProblem) else self._assemble(layout, encoded)
                for layout in layouts]

    # --- the layout of one conversation, step by step ---------------------------------------

    def _layout(self, messages: list[dict], texts: list[str], images: ImageTokens = None) -> dict:
        """The units to encode turn by turn (``"segments"``: text or an added-token id, tagged
        with its assistant turn) and the units of the whole rendering (``"reference"``); their
        texts go to ``texts`` for one batch encode. Raises :class:`RecordProblem`."""
        rendering = self._render_marked(messages)
        spans = self._assistant_spans(rendering)
        events = self._events(rendering, spans, images)
        return {"segments": self._units(events, texts, split_at_turns=True),
                "reference": self._units(events, texts, split_at_turns=False)}

    def _render_marked(self, messages: list[dict]) -> _Rendering:
        """Step 1: render with each content replaced by its placeholder (and the prefixes that
        delimit the assistant turns); the real rendering must be that one with the contents
        put back, as they are or stripped."""
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
        return _Rendering(full, marks, self._written_contents(messages, full, real), found, prefixes)

    @staticmethod
    def _written_contents(messages: list[dict], full: str, real: str) -> list[str]:
        # The contents as the template writes them: unchanged, or stripped (LLaMA-3's templates
        # `| trim` every content); any other rewrite leaves content and template inseparable.
        for contents in ([m["content"] for m in messages], [m["content"].strip() for m in messages]):
            if _MARK.sub(lambda m: contents[int(m.group(1))], full) == real:
                return contents
        raise RecordProblem("template_mismatch", "the chat template rewrites message contents "
                            "(other than trimming them): cannot tell content from template text")

    @staticmethod
    def _assistant_spans(rendering: _Rendering) -> list[tuple[int, int, int]]:
        """Step 2: ``(start, end, message index)`` of each assistant turn, in characters of the
        placeholder rendering: from the end of its generation prompt to the end of its turn."""
        spans: list[tuple[int, int, int]] = []
        for k, prompt, upto in rendering.prefixes:
            if not upto.startswith(prompt) or not rendering.full.startswith(upto):
                raise RecordProblem("template_mismatch", f"rendering messages[:{k}] (with generation "
                                    f"prompt) / messages[:{k + 1}] is not a prefix of the whole "
                                    f"conversation's rendering")
            start, end = len(prompt), len(upto)
            mark_start, mark_end = rendering.found[k][0], rendering.found[k][1]
            if not (start <= mark_start and mark_end <= end) or (spans and start < spans[-1][1]):
                raise RecordProblem("template_mismatch", f"assistant turn {k} is not rendered between "
                                    f"its generation prompt and its end")
            spans.append((start, end, k))
        return spans

    def _events(self, rendering: _Rendering, spans: list[tuple[int, int, int]],
                images: ImageTokens = None) -> list[tuple]:
        """Step 3: the rendering as events, in order: ``("text", str, turn, content_of)``,
        ``("special", id, turn, -1)`` and ``("cut", None, turn, -1)`` where an assistant turn
        starts or ends (turn -1: outside every assistant turn; content_of -1: template text)."""
        full = rendering.full
        cuts = sorted({0, len(full), *(p for s, e, _ in rendering.found for p in (s, e)),
                       *(p for s, e, _ in spans for p in (s, e))})
        turn_cuts = {p for s, e, _ in spans for p in (s, e)}
        content_at = {s: i for s, _, i in rendering.found}
        events: list[tuple] = []
        for a, b in zip(cuts, cuts[1:]):
            turn = next((k for s, e, k in spans if s <= a and b <= e), -1)
            if a in turn_cuts:
                events.append(("cut", None, turn, -1))
            if a in content_at and full[a:b] == rendering.marks[content_at[a]]:
                events.extend(_content_events(rendering.contents[content_at[a]], turn,
                                              content_at[a], images))
                continue
            piece = full[a:b]
            if _MARK_OPEN in piece or _MARK_CLOSE in piece:  # a turn boundary inside a content
                raise RecordProblem("template_mismatch", "an assistant turn boundary falls inside a "
                                    "message content")
            events.extend(self._template_text_events(piece, turn))
        return events

    def _template_text_events(self, piece: str, turn: int) -> list[tuple]:
        """Template text cut at the tokenizer's added tokens, which become their ids."""
        events, pos = [], 0
        for match in (self._splitter.finditer(piece) if self._splitter else ()):
            if match.start() > pos:
                events.append(("text", piece[pos:match.start()], turn, -1))
            events.append(("special", self.added_tokens[match.group()], turn, -1))
            pos = match.end()
        if pos < len(piece):
            events.append(("text", piece[pos:], turn, -1))
        return events

    @staticmethod
    def _units(events: list[tuple], texts: list[str], split_at_turns: bool) -> list[list]:
        """Step 4: the units to encode, ``[text index, None, turn, content_of]`` for text (its
        string appended to ``texts``) and ``[None, token id, turn, -1]`` for an added token.

        Ordinary text (template text and contents alike: the template's special tokens are
        already split out, so nothing in a content can become one) is merged up to the next
        special token — and, with ``split_at_turns`` (the encoding used), up to the next turn
        boundary too. Without it, the units are the reference: the whole rendering's encoding.
        """
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
