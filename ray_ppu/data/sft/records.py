"""Records → conversations: which JSON objects are SFT examples, and their chat messages.

Record forms. Alpaca ``{"instruction", "input"?, "output", "system"?}``
becomes system? → user (instruction and input joined by a newline, either may be empty) →
assistant (output). Chat ``{"messages": [{"role", "content"}, ...]}`` is used as is: roles
system, user, assistant, several turns allowed, at least one assistant turn, no empty
assistant turn. LLaVA / ShareGPT ``{"conversations": [{"from": human | gpt | system,
"value"}]}`` is chat with those speakers. Caption ``{"image", "caption"}`` (projector
pre-training) is a user turn holding only the image and the caption as the answer. The form is
the first key found of messages, conversations, caption; else alpaca. Images (``image``: a
path or a list; ``images`` beside chat messages) are placed by ``<image>`` tags in user turns,
one per image (:func:`check_image_tags`).

A record that cannot be used raises :class:`RecordProblem` with one reason of
:data:`DROP_REASONS`, so the pipeline can count every dropped record under its reason.
"""

from __future__ import annotations

ROLES = ("system", "user", "assistant")
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
    "image_tag_mismatch",  # <image> tags in the text ≠ the record's images (or in an answer)
    "image_tokens_too_long",  # the images' tokens alone fill the row
    "missing_image",      # an image file that does not exist
    "unreadable_image",   # not an image, or truncated / corrupt
    "empty_image",        # zero width or height
    "image_too_large",    # more pixels than data.max_image_pixels
    "image_aspect",       # Qwen2.5-VL: one side over 200 times the other
    "unsupported_media",  # a video or audio record (images only)
    "prompt_too_long",    # everything before the first assistant token fills the row
)
# ShareGPT / LLaVA speakers → chat roles
SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
            "system": "system"}
IMAGE_TAG = "<image>"
MEDIA_KEYS = ("video", "videos", "audio", "audios")  # record keys of media ray_ppu does not train


class RecordProblem(Exception):
    """A record that cannot be used: ``reason`` (one of :data:`DROP_REASONS`) and a message."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


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
    if "conversations" in record:
        return _chat_messages(_sharegpt_messages(record["conversations"]))
    if "caption" in record:
        caption = record["caption"]
        if not isinstance(caption, str):
            raise RecordProblem("bad_field_type", f"field 'caption' is {type(caption).__name__}, "
                                f"not a string")
        if not caption.strip():
            raise RecordProblem("empty_response", "field 'caption' is empty")
        # projector pre-training (LLaVA / Bunny stage 1): the image, then its caption to learn
        return [{"role": "user", "content": IMAGE_TAG}, {"role": "assistant", "content": caption}]
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


def _sharegpt_messages(turns: object) -> object:
    """LLaVA / ShareGPT ``[{"from": human | gpt | system, "value": ...}]`` as chat messages
    (checked by the chat rules after)."""
    if not isinstance(turns, list):
        raise RecordProblem("bad_field_type", f"'conversations' is {type(turns).__name__}, not a list")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordProblem("bad_field_type", f"conversations[{i}] is {type(turn).__name__}, not an object")
        speaker, value = turn.get("from"), turn.get("value")
        if speaker is None or value is None:
            raise RecordProblem("missing_fields", f"conversations[{i}] has no 'from' or no 'value'")
        if speaker not in SPEAKERS:
            raise RecordProblem("unknown_role", f"conversations[{i}] is from {speaker!r} (allowed: "
                                f"{', '.join(SPEAKERS)})")
        out.append({"role": SPEAKERS[speaker], "content": value})
    return out


def record_images(record: dict) -> list[str]:
    """The image paths of a record: ``image`` (one path or a list, LLaVA / caption form) or
    ``images`` (chat form); [] for none. A record with other media (video, audio) is refused:
    ray_ppu trains on text and still images."""
    other = [key for key in MEDIA_KEYS if key in record]
    if other:
        raise RecordProblem("unsupported_media", f"'{other[0]}': {other[0]} records are not "
                            f"supported (text and still images only)")
    value = record.get("images", record.get("image"))
    if value is None:
        return []
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise RecordProblem("bad_field_type", f"'image' / 'images' must be a path or a list of "
                            f"paths, got {value!r:.80}")
    return paths


def check_image_tags(messages: list[dict], images: list[str]) -> None:
    """The record's text holds one <image> tag per image, none in an assistant turn."""
    tags = sum(m["content"].count(IMAGE_TAG) for m in messages)
    answered = [i for i, m in enumerate(messages)
                if m["role"] == "assistant" and IMAGE_TAG in m["content"]]
    if answered:
        raise RecordProblem("image_tag_mismatch", f"an {IMAGE_TAG} tag in assistant turn "
                            f"messages[{answered[0]}]: images go in user turns")
    if tags != len(images):
        raise RecordProblem("image_tag_mismatch", f"{tags} {IMAGE_TAG} tag(s) in the text, "
                            f"{len(images)} image(s) in the record")
