"""Records → conversations: which JSON objects are SFT examples, and their chat messages.

Two record forms are accepted. Alpaca ``{"instruction", "input"?, "output", "system"?}``
becomes system? → user (instruction and input joined by a newline, either may be empty) →
assistant (output). Chat ``{"messages": [{"role", "content"}, ...]}`` is used as is: roles
system, user, assistant, several turns allowed, at least one assistant turn, no empty
assistant turn. A record with a ``messages`` key is read as chat, else as alpaca.

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
    "prompt_too_long",    # everything before the first assistant token fills the row
)


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
