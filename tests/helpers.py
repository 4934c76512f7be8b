"""Shared pieces of the trainer tests: a tiny run config and a tiny real tokenizer."""

import hashlib
import json

TINY = [
    "model.preset=tiny",
    "sampling.max_new_tokens=12",
    "sampling.prompt_buckets=[16]",
    "data.max_terms=4",
    "train.prompts_per_step=2",
    "train.learning_rate=1e-3",
    "train.eval_size=4",
    "logging.progress=false",
    "controller.sagc.candidates=[2,4]",
]


def write_word_tokenizer(path):
    """A tiny word-level tokenizer.json + tokenizer_config.json with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [
        "<pad>",
        "<s>",
        "</s>",
        "<unk>",
        "what",
        "is",
        "plus",
        "the",
        "answer",
        "user:",
        "assistant:",
        *[str(i) for i in range(20)],
    ]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}user: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "chat_template": template,
            }
        )
    )


def sets(overrides):
    """``--set`` arguments of a list of ``section.key=value`` overrides."""
    return [a for o in overrides for a in ("--set", o)]


def tree_digest(path):
    """Hash of every file under ``path`` (names and bytes)."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()
