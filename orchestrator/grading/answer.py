"""Reading the agent's final answer out of a grader request's ``sample``.

The order is the one the Agent RFT endpoint-grader docs give:

1. ``sample["output_text"]``;
2. ``sample["output_json"]`` (an object or array is re-encoded with ``json.dumps(...,
   sort_keys=True)`` so the same answer always yields the same text; a string as is);
3. ``sample["choices"][0]["message"]["content"]``: a string, or a list of content parts
   (``{"type": "text" | "output_text", "text": ...}``, or bare strings) whose texts are
   concatenated with no separator, as the OpenAI SDK builds ``output_text``.

A source that is missing, ``None``, blank or of a shape we cannot read is skipped, so a
blank ``output_text`` does not hide a real ``output_json``. If nothing yields text the answer
is ``""``: that is still the agent's answer and is scored as usual, never an error.
This module never raises, whatever shape the sample has.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_TEXT_PART_TYPES = frozenset({"text", "output_text", "input_text"})


def extract_answer(sample: Any) -> str:
    """The agent's final answer in ``sample`` as text; ``""`` if there is none."""
    if not isinstance(sample, Mapping):
        return ""
    for text in (
        _as_text(sample.get("output_text")),
        _as_text(sample.get("output_json")),
        _message_content(sample.get("choices")),
    ):
        if text is not None and text.strip():
            return text
    return ""


def _as_text(value: Any) -> str | None:
    """A string as is; JSON-able values re-encoded deterministically; anything else None."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, int, float)):
        try:
            # default=str keeps odd nested values (sets, dates) from raising.
            return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
        except (TypeError, ValueError, RecursionError):
            # Mixed-type dict keys under sort_keys, circular or absurdly deep structures.
            return None
    return None


def _message_content(choices: Any) -> str | None:
    if not isinstance(choices, list) or not choices:
        return None
    choice = choices[0]
    if not isinstance(choice, Mapping):
        return None
    message = choice.get("message")
    if not isinstance(message, Mapping):
        return None
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [text for part in content if (text := _part_text(part)) is not None]
        return "".join(texts) if texts else None
    return None


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        return None
    kind = part.get("type")
    # Parts without a type are read too; images, audio, refusals and the like are not text.
    if kind is not None and kind not in _TEXT_PART_TYPES:
        return None
    text = part.get("text")
    if isinstance(text, str):
        return text
    # The Assistants API nests it: {"type": "text", "text": {"value": "...", ...}}.
    if isinstance(text, Mapping) and isinstance(text.get("value"), str):
        return str(text["value"])
    return None
