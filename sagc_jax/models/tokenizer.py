"""Tokenizer: `tokenizer.json` through the `tokenizers` library, chat template through jinja2.

Reads a transformers tokenizer directory without importing transformers: tokenizer.json,
tokenizer_config.json (special tokens, `chat_template`) and, if present, chat_template.jinja
(where transformers v5 writes the template).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class Tokenizer:
    """Encode/decode text and render chat messages to a prompt string or token ids."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None = None,
        special_tokens: dict[str, str | None] | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._template = None
        if chat_template is not None:
            # The environment transformers renders chat templates with.
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            self._template = env.from_string(chat_template)

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        """Loads tokenizer.json (+ tokenizer_config.json, chat_template.jinja) from `path`."""
        tok = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config: dict[str, Any] = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_file):
            with open(config_file) as f:
                config = json.load(f)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = {t["name"]: t["template"] for t in template}.get("default")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_file):
            with open(jinja_file) as f:
                template = f.read()
        special = {k: _token_str(config.get(k)) for k in _SPECIAL_KEYS}
        return cls(tok, template, special)

    # --------------------------------------------------------------- ids of special tokens
    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self.token_id(self.special_tokens.get("bos_token"))

    @property
    def eos_id(self) -> int | None:
        return self.token_id(self.special_tokens.get("eos_token"))

    @property
    def pad_id(self) -> int | None:
        """The pad token's id, falling back to the eos id."""
        pad = self.token_id(self.special_tokens.get("pad_token"))
        return self.eos_id if pad is None else pad

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    # --------------------------------------------------------------- text <-> ids
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs,
    ) -> str | list[int]:
        """Renders `messages` ([{"role", "content"}]) like transformers' apply_chat_template."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json)")
        text = self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
            **kwargs,
        )
        # The template already contains the special tokens (e.g. bos): add none on top.
        return self.encode(text, add_special_tokens=False) if tokenize else text
