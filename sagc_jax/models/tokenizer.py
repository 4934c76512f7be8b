"""Tokenizer: `tokenizer.json` through the `tokenizers` library, chat template through jinja2.

Reads a transformers tokenizer directory without importing transformers: tokenizer.json,
tokenizer_config.json (special tokens, `chat_template`) and, if present, chat_template.jinja
(where transformers v5 writes the template). `train_tokenizer` writes such a directory from a
dataset's own text (``sagc-jax tokenizer``), for runs without a Hugging Face checkpoint.
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

from sagc_jax.config import ConfigError
from sagc_jax.models.files import read_json, read_text

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _special_token(config: dict[str, Any], key: str, file: str) -> str | None:
    """``config[key]``: a token string, an AddedToken dict (older configs) or null."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ConfigError(
            f'{file}: "{key}": {config[key]!r} is not a token; allowed: a string such as '
            f'"</s>", {{"content": "</s>"}} or null'
        )
    return value


def _config_template(config: dict[str, Any], file: str) -> str | None:
    """``chat_template`` of tokenizer_config.json: a string, or named templates (the default)."""
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {}
        for entry in template:
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise ConfigError(
                    f'{file}: "chat_template" entry {str(entry)[:60]} is not allowed; a list '
                    'holds {"name": ..., "template": ...} objects'
                )
            named[entry["name"]] = entry["template"]
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ConfigError(
            f'{file}: "chat_template" is a {type(template).__name__}; allowed: a jinja2 '
            'string or a list of {"name": ..., "template": ...}'
        )
    return template


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class Tokenizer:
    """Encode/decode text and render chat messages to a prompt string or token ids.

    ``template_source`` names where ``chat_template`` came from (a file, for error messages).
    The template is compiled on first use, as transformers does: a tokenizer whose template
    plain jinja2 cannot compile still tokenises, and the error names the file when rendering.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None = None,
        special_tokens: dict[str, str | None] | None = None,
        template_source: str | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_source = template_source
        self.path: str | None = None  # the directory it was read from (for error messages)
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._template = None

    def _compiled_template(self) -> jinja2.Template:
        """The chat template compiled in the environment transformers renders templates with."""
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as err:
                raise ConfigError(
                    f"{self._template_where()} line {err.lineno}: not a valid jinja2 template "
                    f"({err.message})"
                ) from None
        return self._template

    def _template_where(self) -> str:
        source = self.template_source or "the chat template"
        return f'{source}: "chat_template"' if source.endswith(".json") else source

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        """Loads tokenizer.json (+ tokenizer_config.json, chat_template.jinja) from `path`.

        Raises ConfigError (one line naming the file) for a file that cannot be read, is not
        (complete) JSON, or holds a value of the wrong kind.
        """
        vocab_file = os.path.join(path, "tokenizer.json")
        try:
            tok = tokenizers.Tokenizer.from_file(vocab_file)
        except Exception as err:  # tokenizers raises a bare Exception without the file
            read_json(vocab_file, "tokenizer")  # truncated, not UTF-8, not JSON: said there
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(
                f"{vocab_file}: not a tokenizer the tokenizers library can load ({reason})"
            ) from None
        config: dict[str, Any] = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_file):
            config = read_json(config_file, "tokenizer config")
        template, source = _config_template(config, config_file), config_file
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_file):
            template, source = read_text(jinja_file, "chat template"), jinja_file
        special = {k: _special_token(config, k, config_file) for k in _SPECIAL_KEYS}
        out = cls(tok, template, special, template_source=source if template else None)
        out.path = str(path)
        return out

    def check_special_tokens(self) -> None:
        """Raise ConfigError (one line: the file, the key, what to add) unless ``eos_token``
        names a token of the vocabulary: the sampler stops at it, and pads with it when
        ``pad_token`` is unset."""
        where = f"{self.path}/tokenizer_config.json" if self.path else "the tokenizer"
        vocab = f"{self.path}/tokenizer.json" if self.path else "its vocabulary"
        eos = self.special_tokens.get("eos_token")
        if eos is None:
            raise ConfigError(
                f'{where}: no "eos_token"; add e.g. "eos_token": "</s>", naming a token of '
                f'{vocab} (rollouts stop at it; it also pads unless "pad_token" is set)'
            )
        if self.eos_id is None:
            raise ConfigError(
                f'{where}: "eos_token": {eos!r} is not a token of {vocab}; name one of its '
                f'tokens or add it to its "added_tokens"'
            )

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
        if self.chat_template is None:
            where = f"{self.path}/tokenizer_config.json" if self.path else "this tokenizer"
            raise ConfigError(
                f'{where}: no "chat_template" (nor a chat_template.jinja beside it); add one, '
                "or set data.chat_template=false"
            )
        template = self._compiled_template()
        try:
            text = template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **kwargs,
            )
        except Exception as err:  # raise_exception(...), an undefined name, a type error
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"{self._template_where()}: rendering failed ({reason})") from None
        # The template already contains the special tokens (e.g. bos): add none on top.
        return self.encode(text, add_special_tokens=False) if tokenize else text


# --------------------------------------------------------------------------- building one

#: Specials of a built tokenizer, ids 0..3 (the ``tiny`` preset's bos 1 and eos 2).
BUILT_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
#: The chat template of a built tokenizer: ``<s>user: PROMPT\nassistant: ``.
BUILT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
TOKENIZER_KINDS = ("char", "bpe")
_PRINTABLE = "".join(chr(c) for c in range(32, 127)) + "\n\t"


def train_tokenizer(texts, out_dir, kind: str = "bpe", vocab_size: int = 512) -> Tokenizer:
    """Build a tokenizer from ``texts`` (an iterable of str) and write tokenizer.json and
    tokenizer_config.json (pad/bos/eos/unk, `BUILT_CHAT_TEMPLATE`) into ``out_dir``.

    kind ``char``: one token per character (every printable ASCII character plus those of the
    texts; others encode as ``<unk>``); ``vocab_size`` is only an upper bound. kind ``bpe``:
    byte-level BPE trained on the texts up to ``vocab_size`` tokens (any text encodes; at least
    256 bytes + 4 specials). Plain ``encode(text, add_special_tokens=True)`` prepends ``<s>``.
    Raises ValueError for a bad kind or a vocabulary that does not fit ``vocab_size``.
    """
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers

    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"tokenizer kind {kind!r} is not allowed; choose one of {TOKENIZER_KINDS}")
    specials = list(BUILT_SPECIALS)
    template_text = "user: \nassistant: "  # what the chat template adds around a prompt
    if kind == "char":
        chars = set(_PRINTABLE + template_text)
        for text in texts:
            chars.update(text)
        vocab = {t: i for i, t in enumerate(specials)}
        for ch in sorted(chars):
            vocab[ch] = len(vocab)
        if len(vocab) > vocab_size:
            raise ValueError(
                f"the texts have {len(chars)} distinct characters, {len(vocab)} tokens with the "
                f"specials; more than vocab_size = {vocab_size}"
            )
        tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
    else:
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(alphabet) + len(specials):
            raise ValueError(
                f"vocab_size = {vocab_size} is too small for a byte-level BPE; allowed: >= "
                f"{len(alphabet) + len(specials)} (256 bytes + {len(specials)} specials), or kind "
                f"'char'"
            )
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=alphabet,
            show_progress=False,
        )
        tok.train_from_iterator(_with_template_text(texts, template_text), trainer)
    tok.add_special_tokens(specials)
    bos = specials[1]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # transformers can load the directory too
        "pad_token": specials[0],
        "bos_token": specials[1],
        "eos_token": specials[2],
        "unk_token": specials[3],
        "chat_template": BUILT_CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return Tokenizer.from_dir(out_dir)


def _with_template_text(texts, template_text: str):
    yield template_text
    yield from texts
