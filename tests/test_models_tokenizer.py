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
