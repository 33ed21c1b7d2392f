"""Reading fields of a target's JSON with their types checked: a wrong type is a `BadResponse`, never a traceback.

A target is whatever answers at its URL: an engine with a bug, a proxy, a hostile mock. Every field
the gates take from its JSON (a stream chunk's choices and usage, a model list's ids, an admin
route's blocks) is read through these helpers, so a response whose `cached_tokens` is the string
"64" becomes a request error naming the field, what was expected and what was found
(`usage.prompt_tokens_details.cached_tokens: expected a count (an integer >= 0), found '64' (str)`)
instead of a TypeError in a sum three modules later.

A missing field or JSON null reads as None wherever the field is optional (the OpenAI API leaves
most of them out at times); only a present value of the wrong type is an error.
"""

from __future__ import annotations

from typing import Any, Optional

FOUND_CHARS = 40
MISSING = object()


class BadResponse(ValueError):
    """A field of a target's JSON with the wrong type: `field` is its path, the message says what was expected."""

    def __init__(self, field: str, expected: str, found: Any) -> None:
        super().__init__(f"{field}: expected {expected}, found {describe_value(found)}")
        self.field, self.expected = field, expected


def describe_value(value: Any) -> str:
    """A found value in a reason: its repr, shortened, and its JSON type ("'64' (str)", "[1, 2] (list)")."""
    if value is MISSING:
        return "nothing"
    text = repr(value)
    text = text if len(text) <= FOUND_CHARS else text[: FOUND_CHARS - 1] + "…"
    return f"{text} ({type(value).__name__})"


def _get(container: dict, key: str) -> Any:
    return container.get(key) if isinstance(container, dict) else None


def json_object(value: Any, field: str) -> dict:
    """`value` itself as a JSON object (BadResponse when it is anything else)."""
    if not isinstance(value, dict):
        raise BadResponse(field, "a JSON object", value)
    return value


def optional_object(container: dict, key: str, field: str) -> Optional[dict]:
    """container[key] as a JSON object, None when missing or null."""
    value = _get(container, key)
    if value is None:
        return None
    return json_object(value, field)


def optional_list(container: dict, key: str, field: str) -> Optional[list]:
    """container[key] as a JSON array, None when missing or null."""
    value = _get(container, key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise BadResponse(field, "a JSON array", value)
    return value


def optional_text(container: dict, key: str, field: str) -> Optional[str]:
    """container[key] as a string, None when missing or null."""
    value = _get(container, key)
    if value is None or isinstance(value, str):
        return value
    raise BadResponse(field, "a string", value)


def optional_count(container: dict, key: str, field: str) -> Optional[int]:
    """container[key] as a count (an integer >= 0; a bool is not one), None when missing or null."""
    value = _get(container, key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadResponse(field, "a count (an integer >= 0)", value)
    return value


def required_text(container: dict, key: str, field: str) -> str:
    """container[key] as a string (BadResponse when it is missing, null or not a string)."""
    value = container.get(key, MISSING) if isinstance(container, dict) else MISSING
    if not isinstance(value, str):
        raise BadResponse(field, "a string", value)
    return value


def required_list(container: dict, key: str, field: str) -> list:
    """container[key] as a JSON array (BadResponse when it is missing, null or not an array)."""
    value = container.get(key, MISSING) if isinstance(container, dict) else MISSING
    if not isinstance(value, list):
        raise BadResponse(field, "a JSON array", value)
    return value
