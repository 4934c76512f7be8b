"""Reading the JSON and text files a user hands over (tokenizers, HF checkpoints), with errors
that name the file: one line, ``ConfigError``, what is wrong and where (line, column)."""

from __future__ import annotations

import json
from typing import Any

from sagc_jax.config import ConfigError

__all__ = ["read_json", "read_text"]


def read_text(path: str, what: str) -> str:
    """The UTF-8 text of ``path`` (``what`` it is, for the message: 'chat template')."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the {what} ({err.strerror})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ConfigError(
            f"{path}:{line}: the {what} is not UTF-8 text (byte {err.start + 1} of the file)"
        ) from None


def read_json(path: str, what: str, *, mapping: bool = True) -> Any:
    """The JSON value of ``path``; with ``mapping`` it must be an object (a dict)."""
    text = read_text(path, what)
    if not text.strip():
        raise ConfigError(f"{path}: the {what} is empty (0 bytes of JSON)")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        if err.pos >= len(text.rstrip()):
            why = "it ends before the JSON does: truncated?"
        elif err.msg.startswith("Unterminated string"):
            why = f"the string at column {err.colno} never ends: truncated?"
        else:
            why = f"{err.msg} at column {err.colno}"
        raise ConfigError(f"{path}:{err.lineno}: the {what} is not valid JSON ({why})") from None
    if mapping and not isinstance(value, dict):
        raise ConfigError(
            f"{path}: the {what} must be a JSON object {{...}}, not a {type(value).__name__}"
        )
    return value
