"""Tokenizer wrapper: tokenizer.json + chat template, compared with transformers on a tiny BPE."""

import json
import os

import pytest
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

from sagc_jax.models import Tokenizer

# ChatML with a bos token, a system-prompt default and an error branch (as real templates have).
TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "what is 2+3? answer briefly"}]


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """(transformers tokenizer, v5 layout dir, v4 layout dir with the template in the config)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "what is 2+3? the answer is 5."]
    tok.train_from_iterator(corpus * 10, trainer)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf.chat_template = TEMPLATE
    v5_dir = str(tmp_path_factory.mktemp("tok_v5"))
    hf.save_pretrained(v5_dir)
    v4_dir = str(tmp_path_factory.mktemp("tok_v4"))
    tok.save(os.path.join(v4_dir, "tokenizer.json"))
    with open(os.path.join(v4_dir, "tokenizer_config.json"), "w") as f:
        config = {
            "chat_template": TEMPLATE,
            "bos_token": {"content": "<s>", "special": True},  # older AddedToken form
            "eos_token": "<|im_end|>",
            "pad_token": None,
        }
        json.dump(config, f)
    return hf, v5_dir, v4_dir


def test_chat_template_and_ids_match_transformers(tokenizer_dirs):
    hf, v5_dir, v4_dir = tokenizer_dirs
    want_text = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    want_ids = hf(want_text, add_special_tokens=False)["input_ids"]
    for path in (v5_dir, v4_dir):
        tok = Tokenizer.from_dir(path)
        assert tok.apply_chat_template(MESSAGES) == want_text
        assert tok.apply_chat_template(MESSAGES, tokenize=True) == want_ids
        assert want_text.startswith("<s><|im_start|>system\nYou are helpful.")
    no_prompt = Tokenizer.from_dir(v5_dir).apply_chat_template(
        MESSAGES, add_generation_prompt=False
    )
    assert no_prompt == hf.apply_chat_template(MESSAGES, tokenize=False)


def test_special_ids_encode_decode(tokenizer_dirs):
    hf, v5_dir, v4_dir = tokenizer_dirs
    tok = Tokenizer.from_dir(v5_dir)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
    )
    assert Tokenizer.from_dir(v4_dir).pad_id == hf.eos_token_id  # no pad token: falls back to eos
    text = "the lazy fox"
    assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(tok.encode(text) + [tok.eos_id]) == text
    assert tok.vocab_size == len(hf)


def test_template_errors_surface(tokenizer_dirs):
    _, v5_dir, _ = tokenizer_dirs
    with pytest.raises(Exception, match="unknown role tool"):
        Tokenizer.from_dir(v5_dir).apply_chat_template([{"role": "tool", "content": "x"}])


# --------------------------------------------------------------------------- sagc-jax tokenizer

ROWS = [
    {"prompt": f"What is {a} + {b}? Put the answer in \\boxed{{}}.", "answer": str(a + b)}
    for a in range(6)
    for b in range(4)
]


def write_rows(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_built_tokenizer_round_trips_and_matches_transformers(tmp_path, kind):
    from sagc_jax.models.tokenizer import train_tokenizer

    texts = [t for r in ROWS for t in (r["prompt"], r["answer"])]
    tok = train_tokenizer(texts, tmp_path / "tok", kind=kind, vocab_size=300)
    tok.check_special_tokens()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2) and tok.vocab_size <= 300
    text = ROWS[7]["prompt"] + " ~"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(text, add_special_tokens=True) == [1, *tok.encode(text)]
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 2?"}], tokenize=True)
    assert tok.decode(ids, skip_special_tokens=False) == "<s>user: What is 1 + 2?\nassistant: "
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert hf(text)["input_ids"] == tok.encode(text, add_special_tokens=True)
    assert (hf.pad_token_id, hf.eos_token_id) == (0, 2)


def test_built_tokenizer_vocab_limits(tmp_path):
    from sagc_jax.models.tokenizer import train_tokenizer

    with pytest.raises(ValueError, match="vocab_size = 100 is too small for a byte-level BPE"):
        train_tokenizer(["a"], tmp_path / "a", kind="bpe", vocab_size=100)
    with pytest.raises(ValueError, match="distinct characters"):
        train_tokenizer(["a"], tmp_path / "b", kind="char", vocab_size=50)


@pytest.mark.parametrize(
    "config, needle",
    [
        ({"bos_token": "<s>"}, 'tokenizer_config.json: no "eos_token"; add e.g. "eos_token"'),
        ({"eos_token": "</eos>"}, "\"eos_token\": '</eos>' is not a token of"),
        (None, 'tokenizer_config.json: no "eos_token"'),  # no tokenizer_config.json at all
    ],
)
def test_tokenizer_without_eos_is_a_one_line_error_at_load(tmp_path, capsys, config, needle):
    from helpers import RAW_ROWS, TINY

    from sagc_jax.cli import main

    tok = tokenizers.Tokenizer(models.WordLevel({"<s>": 0, "1": 1, "<unk>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "1 1", "answer": "2"}])
    sets = [
        *TINY,
        "data.task=dataset",
        *RAW_ROWS,
        f"data.path={data}",
        f"model.tokenizer={tmp_path / 'tok'}",
    ]
    args = ["train", *[a for s in sets for a in ("--set", s)]]
    assert main([*args, "--set", f"logging.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'tok'}") and needle in err and err.count("\n") == 1


@pytest.mark.slow
def test_tokenizer_command_then_train_a_dataset_run(tmp_path, capsys):
    """The walkthrough of docs/tasks.md: JSONL -> sagc-jax tokenizer -> sagc-jax train."""
    from helpers import RAW_ROWS, TINY

    from sagc_jax.cli import main

    data = write_rows(tmp_path / "train.jsonl")
    tok_dir = tmp_path / "tokenizer"
    assert main(["tokenizer", "--data", str(data), "--out", str(tok_dir)]) == 0
    assert f"train with --set model.tokenizer={tok_dir}" in capsys.readouterr().out
    assert main(["tokenizer", "--data", str(data), "--out", str(tok_dir)]) == 2  # no --force
    assert "exists; choose another --out or add --force" in capsys.readouterr().err
    sets = [
        *TINY,
        f"model.tokenizer={tok_dir}",
        "data.task=dataset",
        *RAW_ROWS,
        f"data.path={data}",
        "data.chat_template=true",
        "sampling.prompt_buckets=auto",
        "train.steps=1",
        "train.eval_size=2",
        "controller.candidates=[2]",
        "logging.tensorboard=false",
        f"logging.run_dir={tmp_path / 'run'}",
    ]
    assert main(["train", *[a for s in sets for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    assert "data: sampling.prompt_buckets auto -> [" in out and "train done" in out
