"""``sagc-jax eval`` of a Hugging Face model directory (a base model before training), greedy and
sampled with pass@k, its figures written with --out; pass@k's estimator by hand."""

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from helpers import RAW_ROWS, TINY, write_word_tokenizer
from hf_tiny import COMMON, randomize

from sagc_jax.cli import main
from sagc_jax.config import load_config
from sagc_jax.train.evaluate import pass_at_k


def test_pass_at_k_matches_the_binomial_formula():
    # 1 - C(n - c, k) / C(n, k): n = 4, c = 1, k = 2 -> 1 - 3/6; c = 0 -> 0; c = n -> 1
    assert pass_at_k(np.array([1]), 4, 2) == pytest.approx(0.5)
    assert pass_at_k(np.array([0, 4]), 4, 3) == pytest.approx(0.5)
    assert pass_at_k(np.array([3]), 8, 1) == pytest.approx(3 / 8)  # k = 1: the share right
    assert pass_at_k(np.array([2]), 5, 4) == 1.0  # 3 wrong ones cannot fill 4 draws
    assert pass_at_k(np.array([2]), 200, 100) == pytest.approx(1 - (100 * 99) / (200 * 199))


@pytest.fixture
def model_dir(tmp_path):
    """A tiny Llama saved by transformers, with the word tokenizer beside its weights."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()
    randomize(model, seed=0)
    model.save_pretrained(tmp_path / "hf")
    write_word_tokenizer(tmp_path / "tok")
    for f in (tmp_path / "tok").iterdir():
        shutil.copy(f, tmp_path / "hf")
    rows = [{"prompt": f"what is {a} plus 1", "answer": str(a + 1)} for a in range(10)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return tmp_path / "hf"


def eval_args(model_dir, *extra):
    sets = [
        *[s for s in TINY if not s.startswith("model.preset")],
        "data.task=dataset",
        *RAW_ROWS,
        f"data.path={model_dir.parent / 'd.jsonl'}",
        "data.reward=math",
    ]
    return [
        "eval",
        "--checkpoint",
        str(model_dir),
        *[a for s in sets for a in ("--set", s)],
        *extra,
    ]


def test_eval_of_a_model_directory_greedy_and_sampled(model_dir, tmp_path, capsys):
    out = tmp_path / "base.json"
    assert main(eval_args(model_dir, "--num", "3", "--out", str(out))) == 0
    greedy = json.loads(out.read_text())
    assert greedy["kind"] == "model" and greedy["samples"] == 1 and greedy["prompts"] == 3
    assert greedy["temperature"] == 0.0 and "eval/pass@1" not in greedy
    assert {"eval/accuracy", "eval/reward", "eval/length_mean", "eval/truncated_frac"} <= set(
        greedy
    )
    assert main(eval_args(model_dir, "--num", "3", "--samples", "3", "--out", str(out))) == 0
    sampled = json.loads(out.read_text())
    assert sampled["samples"] == 3 and sampled["temperature"] == 1.0
    assert {"eval/pass@1", "eval/pass@2", "eval/pass@3"} <= set(sampled)
    assert sampled["eval/pass@1"] == pytest.approx(sampled["eval/accuracy"])
    assert sampled["eval/pass@1"] <= sampled["eval/pass@2"] <= sampled["eval/pass@3"]
    assert "a Hugging Face model" in capsys.readouterr().out


def test_eval_writes_every_sampled_completion_and_the_length_tail(model_dir, tmp_path, capsys):
    out, lines = tmp_path / "base.json", tmp_path / "tail" / "c.jsonl"
    extra = ("--num", "3", "--samples", "4", "--out", str(out), "--completions", str(lines))
    assert main(eval_args(model_dir, *extra)) == 0
    records = [json.loads(line) for line in lines.read_text().splitlines()]
    assert [(r["prompt"], r["sample"]) for r in records] == [
        (p, k) for p in range(3) for k in range(4)
    ]
    # the texts, so that a wrong answer reads beside the right one
    assert [(r["prompt_text"], r["answer"]) for r in records[::4]] == [
        (f"what is {a} plus 1", str(a + 1)) for a in range(3)
    ]
    assert all(isinstance(r["completion_text"], str) for r in records)
    assert [r["accepted"] for r in records] == [r["reward"] >= 1 for r in records]
    figures = json.loads(out.read_text())
    lengths = np.array([r["length"] for r in records])
    assert figures["eval/length_mean"] == pytest.approx(lengths.mean())
    assert figures["eval/accuracy"] == pytest.approx(np.mean([r["reward"] >= 1 for r in records]))
    assert figures["tail/completions"] == 12 and "tail/straggle@4" in figures  # TINY's G = 4
    assert (tmp_path / "tail" / "c.png").is_file()
    assert "length tail: " in capsys.readouterr().out
    (tmp_path / "a_file").write_text("")
    bad = ("--num", "1", "--samples", "2", "--completions", str(tmp_path / "a_file" / "c.jsonl"))
    assert main(eval_args(model_dir, *bad)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write the completions" in err, err


def test_eval_decodes_through_the_rows_of_a_training_step_of_the_largest_g():
    """--samples K of every held-out prompt streams through no more rows than a step decoded
    (TINY: 2 prompts x G = 4); the sampled test above sends 3 x 3 rows through 8."""
    from sagc_jax.commands.eval import _eval_slots

    assert _eval_slots(load_config(None, TINY), None) == 2 * 4
    assert _eval_slots(load_config(None, [*TINY, "sampling.slots=4"]), None) == 4
    # auto: as the trainer resolves it on this machine (its memory holds every rollout)
    assert _eval_slots(load_config(None, [*TINY, "sampling.slots=auto"]), None) == 2 * 4


def test_eval_of_neither_a_run_nor_a_model_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["eval", "--checkpoint", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither a run directory" in err, err
    assert main(["eval", "--checkpoint", str(tmp_path / "empty"), "--samples", "0"]) == 2
    assert "--samples = 0" in capsys.readouterr().err
