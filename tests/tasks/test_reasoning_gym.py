"""reasoning-gym tasks (data.task: reasoning_gym): the splits, the prompts, the reward in its
time-limited worker, the one-line errors, and a short training run."""

import json
import subprocess
import sys

import pytest

from sagc_jax.config import ConfigError, load_config
from sagc_jax.tasks import score_batch

needs_rg = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import reasoning_gym"], capture_output=True).returncode,
    reason="reasoning-gym is not installed (pip install 'sagc-jax[rg]')",
)
SMALL = "data.rg_config={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}"


def rg_sets(tmp_path, *overrides):
    """--set overrides of a chain_sum run on the tiny preset with the tiny word tokenizer."""
    from helpers import TINY, write_word_tokenizer

    tok = tmp_path / "tok"
    if not tok.exists():
        write_word_tokenizer(tok)
    return [
        *TINY,
        "data.task=reasoning_gym",
        "data.rg_dataset=chain_sum",
        SMALL,
        "data.rg_train_size=60",
        "data.rg_eval_size=30",
        "sampling.prompt_buckets=auto",
        f"model.tokenizer={tok}",
        *overrides,
    ]


def rg_source(tmp_path, *overrides, log=None):
    from sagc_jax.models import Tokenizer
    from sagc_jax.tasks.source import make_source

    cfg = load_config(None, rg_sets(tmp_path, *overrides))
    notes = [] if log is None else log
    return make_source(cfg, Tokenizer.from_dir(str(tmp_path / "tok")), log=notes.append)


@needs_rg
def test_the_splits_are_disjoint_and_a_function_of_the_seeds(tmp_path):
    notes = []
    source = rg_source(tmp_path, log=notes)
    train = [source.prompt_at(i, 0) for i in range(60)]
    held = source.heldout(30)
    assert sorted(p.id for p in train) == list(range(60))  # one epoch: every entry once
    assert not {p.text for p in train} & {p.text for p in held}
    dropped = 30 - len(held)
    assert notes[0] == (
        f"data: reasoning_gym chain_sum: 60 training entries (seed 0), {len(held)} held-out "
        f"(seed 1000000; dropped {dropped} whose question is a training one)"
    )
    assert notes[1].startswith("data: sampling.prompt_buckets auto -> ")
    assert held[0].text.startswith("State the final answer to the following arithmetic problem")
    # the same seeds give the same prompts, in the same order; another seed others
    again = rg_source(tmp_path)
    assert [again.prompt_at(i, 0) for i in range(60)] == train and again.heldout(30) == held
    other = rg_source(tmp_path, "data.seed=7")
    assert [p.text for p in other.batch(0, 0, 2)] != [p.text for p in train[:2]]
    # the next epoch visits the entries in a new order
    assert [source.prompt_at(60 + i, 0).id for i in range(60)] != [p.id for p in train]


@needs_rg
def test_prompts_go_through_the_chat_template_with_the_system_prompt(tmp_path):
    from reasoning_gym.utils import SYSTEM_PROMPTS

    source = rg_source(tmp_path)
    prompt = source.heldout(1)[0]
    ids = source.encode(prompt)
    expect = source.tokenizer.apply_chat_template(
        [
            {"role": "system", "content": SYSTEM_PROMPTS["default"]},
            {"role": "user", "content": prompt.text},
        ],
        add_generation_prompt=True,
        tokenize=True,
    )
    assert ids == expect and ids[-1] == 10  # the word tokenizer's "assistant:"
    assert len(ids) <= max(source.prompt_buckets)


@needs_rg
def test_the_reward_is_the_datasets_score_answer_in_the_time_limited_worker(tmp_path):
    from sagc_jax.tasks import TimeLimitedReward

    source = rg_source(tmp_path, "data.reward_timeout_s=30")
    reward = source.reward_fn
    assert isinstance(reward, TimeLimitedReward)
    assert reward.spec == "sagc_jax.tasks.reasoning_gym:score" and reward.timeout_s == 30
    try:
        prompts = source.heldout(2)
        right = [json.loads(p.answer)["answer"] for p in prompts]
        completions = [
            f"2 + 3 is 5, so <answer>{right[0]}</answer>",
            f"<answer>{int(right[1]) + 1}</answer>",
            "no tags at all",
            f"<answer>{right[1]}</answer>",
        ]
        texts = [prompts[0].text, prompts[1].text, prompts[1].text, prompts[1].text]
        answers = [prompts[0].answer, prompts[1].answer, prompts[1].answer, prompts[1].answer]
        result = score_batch(reward, texts, completions, answers)
        assert result.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
        assert not result.failed and not result.timed_out
    finally:
        reward.close()


@needs_rg
def test_entries_that_survive_json_are_carried_whole():
    from sagc_jax.tasks.reasoning_gym import _answer, score

    entry = {"question": "What is 2 + 3?", "answer": "5", "metadata": {"x": [1, 2]}}
    answer = _answer("chain_sum", {}, 0, 10, 4, entry, "tags")
    assert json.loads(answer) == {"rg": "chain_sum", "config": {}, "entry": entry}
    tupled = {**entry, "metadata": {"x": (1, 2)}}  # a tuple comes back a list: re-created
    key = json.loads(_answer("chain_sum", {}, 0, 10, 4, tupled, "tags"))
    assert key == dict(rg="chain_sum", config={}, seed=0, size=10, index=4, answer="5")
    completions = ["<answer>5</answer>", "<answer>6</answer>"]
    assert score(["What is 2 + 3?"] * 2, completions, [answer] * 2) == [1.0, 0.0]
    # a re-created entry whose question is not the prompt's: the reward fails (not a silent 0)
    with pytest.raises(ValueError, match="another question than the prompt"):
        score(["not the question"], ["<answer>5</answer>"], [json.dumps(key)])


@needs_rg
def test_final_answers_score_without_tags_only_when_asked():
    """data.rg_answer: tags (the default) reads <answer> tags alone; final also reads a final
    answer in the math reward's conventions when the completion has no tags."""
    from sagc_jax.tasks.reasoning_gym import _answer, score

    entry = {"question": "What is 2 + 3?", "answer": "5", "metadata": {}}
    tags, final = (_answer("chain_sum", {}, 0, 10, 4, entry, x) for x in ("tags", "final"))
    completions = ["2 + 3 = 5.", "\\boxed{} #### 5", "<answer>6</answer> so 5", "2 + 3 = 6."]
    assert score([entry["question"]] * 4, completions, [tags] * 4) == [0.0, 0.0, 0.0, 0.0]
    assert score([entry["question"]] * 4, completions, [final] * 4) == [1.0, 1.0, 0.0, 0.0]


@needs_rg
def test_a_bad_dataset_name_or_keyword_is_one_line_naming_the_key_and_the_allowed(tmp_path):
    with pytest.raises(ConfigError) as info:
        rg_source(tmp_path, "data.rg_dataset=chain_summ")
    message = str(info.value)
    assert message.startswith("data.rg_dataset = 'chain_summ' is not a reasoning-gym dataset; ")
    assert "allowed: " in message and "chain_sum, " in message and "\n" not in message
    with pytest.raises(ConfigError) as info:
        rg_source(tmp_path, "data.rg_config.max_term=3")
    message = str(info.value)
    assert message.startswith("data.rg_config.max_term is not a keyword argument of ")
    assert "allowed: min_terms, max_terms, min_digits, max_digits" in message
    assert "\n" not in message
    with pytest.raises(ConfigError, match=r"^data\.rg_config\.seed is set by the trainer"):
        rg_source(tmp_path, "data.rg_config.seed=3")
    with pytest.raises(ConfigError, match=r"rejects it \(max_terms must be >= min_terms\)$"):
        rg_source(tmp_path, "data.rg_config={min_terms: 4, max_terms: 2}")


def test_without_the_package_the_source_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym fails
    with pytest.raises(ConfigError) as info:
        rg_source(tmp_path)
    assert "pip install 'sagc-jax[rg]'" in str(info.value) and "\n" not in str(info.value)


def test_the_config_checks_the_keys_without_importing_reasoning_gym(tmp_path):
    with pytest.raises(ConfigError, match="needs data.rg_dataset"):
        load_config(None, ["data.task=reasoning_gym"])
    with pytest.raises(ConfigError, match=r"data\.rg_eval_seed = 50 draws held-out entries"):
        load_config(None, rg_sets(tmp_path, "data.rg_eval_seed=50"))
    cfg = load_config(None, rg_sets(tmp_path, "data.rg_eval_seed=60", "data.rg_config.min_terms=3"))
    assert cfg.data.rg_config == {"min_terms": 3, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    with pytest.raises(ConfigError, match=r"data\.rg_config = 3 has the wrong type"):
        load_config(None, ["data.rg_config=3"])
    code = (
        "import sys; from sagc_jax.config import load_config; "
        "load_config(None, ['data.task=reasoning_gym', 'data.rg_dataset=chain_sum']); "
        "assert 'reasoning_gym' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@needs_rg
def test_the_data_identity_is_the_task_not_a_file(tmp_path):
    from sagc_jax.tasks.source import data_identity

    one = data_identity(load_config(None, rg_sets(tmp_path)))
    assert list(one) == ["data.rg_dataset"]
    assert one["data.rg_dataset"]["path"] == "reasoning_gym:chain_sum"
    assert data_identity(load_config(None, rg_sets(tmp_path))) == one
    other = data_identity(load_config(None, rg_sets(tmp_path, "data.rg_train_size=61")))
    assert other["data.rg_dataset"]["sha256"] != one["data.rg_dataset"]["sha256"]


@needs_rg
@pytest.mark.slow
def test_a_short_training_run(tmp_path):
    from sagc_jax.train.loop import Trainer

    sets = rg_sets(tmp_path, "train.steps=1", "logging.tensorboard=false", "train.eval_size=2")
    trainer = Trainer(load_config(None, sets), tmp_path / "run")
    try:
        summary = trainer.run(progress=False)
    finally:
        trainer.close()
    assert summary["steps"] == 1 and 0.0 <= summary["eval/accuracy"] <= 1.0
