"""The running-sum task, its checker, and the character tokenizer."""

import numpy as np
import pytest

from sagc_jax.tasks import CharTokenizer, SyntheticTask, check_running_sum, encode_sft_batch


def test_tokenizer_round_trip_and_specials():
    tok = CharTokenizer()
    assert tok.vocab_size < 64 and {tok.pad_id, tok.bos_id, tok.eos_id} == {0, 1, 2}
    text = "3+5+2+7=3>8>10>17#17"
    ids = tok.encode(text)
    assert len(ids) == len(text) and min(ids) >= 3 and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=True) == [tok.bos_id, *ids]
    with_specials = [tok.bos_id, *ids, tok.eos_id, tok.pad_id]
    assert tok.decode(with_specials) == text
    assert tok.decode(with_specials, skip_special_tokens=False) == f"<bos>{text}<eos><pad>"


def test_tokenizer_errors_name_the_character_and_id():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=r"character 'x' at position 2 of '12x'"):
        tok.encode("12x")
    with pytest.raises(ValueError, match=rf"id {tok.vocab_size} is out of range"):
        tok.decode([3, tok.vocab_size])
    with pytest.raises(ValueError, match="distinct"):
        CharTokenizer("aa")


def test_encode_sft_batch_masks_completion_and_eos():
    tok = CharTokenizer()
    tokens, mask = encode_sft_batch(tok, [("1+2=", "1>3#3"), ("4=", "4#4")], length=12)
    assert tokens.shape == mask.shape == (2, 12) and tokens.dtype == np.int32
    assert tokens[0, 0] == tok.bos_id and tok.decode(tokens[0, 1:5]) == "1+2="
    assert tokens[0, 10] == tok.eos_id and tokens[0, 11] == tok.pad_id
    np.testing.assert_array_equal(mask[0], [0] * 5 + [1] * 6 + [0])
    np.testing.assert_array_equal(mask[1], [0] * 3 + [1] * 4 + [0] * 5)
    with pytest.raises(ValueError, match="row 0 has 11 tokens"):
        encode_sft_batch(tok, [("1+2=", "1>3#3")], length=10)


def test_problems_are_deterministic_and_order_independent():
    a, b = SyntheticTask(seed=3), SyntheticTask(seed=3)
    forward = [a.problem(i) for i in range(50)]
    backward = [b.problem(i) for i in reversed(range(50))][::-1]
    assert forward == backward
    assert a.batch(2, 5) == forward[10:15]
    other_seed = [SyntheticTask(seed=4).problem(i) for i in range(50)]
    assert other_seed != forward
    assert [q for q, _ in a.sft_pairs(5)] != [p.prompt for p in forward[:5]]  # own stream


def test_traces_are_correct_running_sums():
    task = SyntheticTask(min_terms=2, max_terms=12, min_digits=1, max_digits=3)
    for p in task.batch(0, 200):
        terms = [int(t) for t in p.prompt.rstrip("=").split("+")]
        assert p.prompt.endswith("=") and len(terms) == p.num_terms
        sums = np.cumsum(terms)
        assert p.trace == ">".join(map(str, sums)) + f"#{sums[-1]}"
        assert p.answer == str(sums[-1]) and task.score(p, p.trace) == 1.0
        assert len(p.prompt) <= task.max_prompt_chars()
        assert len(p.trace) <= task.max_completion_chars()


def test_modulus_keeps_sums_small():
    task = SyntheticTask(min_terms=3, max_terms=6, modulus=10, min_digits=1, max_digits=1)
    for p in task.batch(0, 50):
        terms = [int(t) for t in p.prompt.rstrip("=").split("+")]
        assert p.answer == str(sum(terms) % 10)
        assert all(len(s) == 1 for s in p.trace.split("#")[0].split(">"))


def test_completion_lengths_spread_several_fold():
    task = SyntheticTask()  # defaults: 2..12 terms, 1..2 digits
    problems = task.batch(0, 500)
    by_k = {k: [len(p.trace) for p in problems if p.num_terms == k] for k in (2, 12)}
    assert np.mean(by_k[12]) >= 3 * np.mean(by_k[2])
    assert min(by_k[12]) >= 3 * max(by_k[2]) / 2
    assert len({p.num_terms for p in problems}) == 11


def test_heldout_split_is_disjoint_from_training():
    task = SyntheticTask(min_terms=2, max_terms=3, min_digits=1, max_digits=1)  # small space
    train = {p.prompt for p in task.batch(0, 2000)} | {q for q, _ in task.sft_pairs(2000)}
    heldout = {p.prompt for p in task.heldout(300)}
    assert heldout and train and not heldout & train
    assert task.heldout(3) == task.heldout(3)


def test_checker_right_wrong_malformed():
    assert check_running_sum("3>8>10>17#17", "17") == 1.0
    assert check_running_sum(" 3>8>10>17#17\n", "17") == 1.0
    assert check_running_sum("3>9>11>18#17", "17") == 1.0  # only the final answer counts
    malformed = ["3>8>10>17", "3>8>10>17#", "17", "#17#17", "3>8#17>", "#1 7", "#017", "#١٧", ""]
    for bad in ["3>8>10>17#18", *malformed]:
        assert check_running_sum(bad, "17") == 0.0, bad


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"min_terms": 0}, "min_terms = 0"),
        ({"min_terms": 5, "max_terms": 4}, "max_terms = 4"),
        ({"max_digits": 10}, "max_digits = 10"),
        ({"modulus": 1}, "modulus = 1"),
        ({"heldout_fraction": 1.0}, "heldout_fraction = 1.0"),
    ],
)
def test_bad_parameters_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=f"SyntheticTask: {key} is out of range"):
        SyntheticTask(**kwargs)


def test_bad_split_index_and_tiny_space():
    task = SyntheticTask()
    with pytest.raises(ValueError, match="split = 'test'"):
        task.problem(0, "test")
    with pytest.raises(ValueError, match="index = -1"):
        task.problem(-1)
    tiny = SyntheticTask(
        min_terms=1, max_terms=1, min_digits=1, max_digits=1, heldout_fraction=1e-4
    )
    with pytest.raises(ValueError, match="no heldout problem"):
        tiny.problem(0, "heldout")


# --------------------------------------------------------------------------- curriculum


def test_curriculum_terms_rise_linearly_then_stay():
    task = SyntheticTask(min_terms=2, max_terms=12)
    caps = [task.curriculum_terms(step, 10) for step in (0, 1, 5, 9, 10, 11, 1000)]
    assert caps == [2, 3, 7, 11, 12, 12, 12]
    assert task.curriculum_terms(1, 4) == 4  # 2 + 10 * 1/4 = 4.5, floored
    assert task.curriculum_terms(0, 10, start_terms=6) == 6
    assert task.curriculum_terms(5, 10, start_terms=6) == 9
    assert task.curriculum_terms(7, 0) == 12  # off: never capped
    for bad in (1, 13):
        with pytest.raises(ValueError, match=f"start_terms = {bad} is outside"):
            task.curriculum_terms(0, 10, start_terms=bad)


def test_capped_problems_respect_the_cap_and_are_deterministic():
    task = SyntheticTask(min_terms=2, max_terms=12, seed=5)
    for cap in (2, 5):
        problems = task.batch(0, 100, max_terms=cap)
        assert {p.num_terms for p in problems} == set(range(2, cap + 1))
        assert all(len(p.prompt.rstrip("=").split("+")) == p.num_terms for p in problems)
        again = SyntheticTask(min_terms=2, max_terms=12, seed=5)
        assert [again.problem(i, max_terms=cap) for i in reversed(range(100))][::-1] == problems
    with pytest.raises(ValueError, match="max_terms = 1 must be an integer >= min_terms = 2"):
        task.problem(0, max_terms=1)
    for split in ("heldout", "sft"):
        with pytest.raises(ValueError, match="caps the train split only"):
            task.problem(0, split, max_terms=5)


def test_uncapped_problems_are_unchanged():
    task = SyntheticTask(seed=0)
    task.batch(0, 20, max_terms=3)  # capped draws leave no trace
    fresh = SyntheticTask(seed=0)
    uncapped = [fresh.problem(i) for i in range(40)]
    assert [task.problem(i, "train", None) for i in range(40)] == uncapped
    assert task.batch(0, 40, max_terms=12) == uncapped  # a cap of max_terms is no cap
    assert task.batch(0, 40, max_terms=99) == uncapped
    assert [p.prompt for p in uncapped[:3]] == [  # recorded before the curriculum existed
        "5+8+98+9+5+2+35+4+24+26+75=",
        "7+81+8+84+8+13+17=",
        "52+3+1+5+5+9+47+17+3+1+15+3=",
    ]
    assert [p.prompt for p in task.heldout(2)] == ["95+78+2+30+5+91+39+3=", "95+15+6="]


def _source(*overrides):
    from sagc_jax.config import load_config
    from sagc_jax.tasks.source import make_source

    base = ["model.preset=tiny", "sampling.max_new_tokens=32", "sampling.prompt_buckets=auto"]
    cfg = load_config(None, [*base, "data.min_terms=2", "data.max_terms=10", *overrides])
    return make_source(cfg, log=lambda _: None)


def test_synthetic_source_prompts_grow_under_a_curriculum():
    source = _source("data.curriculum_steps=10")
    plain = _source()

    def terms(step, src=source, round_=0):
        return [p.text.count("+") + 1 for p in src.batch(step, round_, 32)]

    early, mid, late = terms(0), terms(5), terms(10)
    assert max(early) == 2 and max(mid) <= 6 and max(late) == 10
    assert np.mean(early) < np.mean(mid) < np.mean(late)
    assert max(terms(0, round_=1)) == 2  # dynamic-sampling rounds share the step's cap
    assert source.batch(12, 0, 8) == plain.batch(12, 0, 8)  # past the ramp: uncapped
    assert _source("data.curriculum_steps=10").batch(5, 1, 8) == source.batch(5, 1, 8)  # resume
    assert source.heldout(16) == plain.heldout(16)
    assert source.sft_pairs(8, 0) == plain.sft_pairs(8, 0)
    started = _source("data.curriculum_steps=10", "data.curriculum_start_terms=4")
    assert max(p.text.count("+") + 1 for p in started.batch(0, 0, 32)) == 4


def test_bad_curriculum_start_terms_is_a_config_error():
    from sagc_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.min_terms=3", "data.max_terms=8", "data.curriculum_start_terms=9"])
    message = str(info.value)
    assert "data.curriculum_start_terms = 9 is outside" in message and "\n" not in message
    assert "data.min_terms = 3" in message and "data.max_terms = 8" in message
    with pytest.raises(ConfigError, match="data.curriculum_start_terms = 2 is outside"):
        load_config(None, ["data.min_terms=3", "data.curriculum_start_terms=2"])
    with pytest.raises(ConfigError, match="data.curriculum_steps = -1 is out of range"):
        load_config(None, ["data.curriculum_steps=-1"])


def test_the_experiment_workload_keeps_its_length_promises():
    """configs/experiments/straggler.yaml: every concluded completion (eos included) is at most
    max_new_tokens / tau, so one rambling member of a group whose median concludes makes the
    group straggle; rambling warm-start traces run to the cap; the curriculum lengthens the
    training completions over the run while held-out problems keep the full range."""
    from sagc_jax.config import load_config
    from sagc_jax.tasks.source import SyntheticSource
    from sagc_jax.train.sft import ramble

    cfg = load_config("configs/experiments/straggler.yaml", [])
    source = SyntheticSource(cfg, log=lambda _: None)
    cap, tau = cfg.sampling.max_new_tokens, cfg.controller.tau
    assert source.task.max_completion_chars() + 1 <= cap / tau
    trace = source.task.problem(0, "sft").trace
    assert len(ramble(trace, cap)) == cap and "#" not in ramble(trace, cap)
    assert cfg.sft.ramble_fraction >= 0.8  # the warm start mostly rambles: RL has room

    first = [p.text for p in source.batch(0, 0, 256)]
    last = [p.text for p in source.batch(cfg.data.curriculum_steps, 0, 256)]

    def terms(texts):
        return np.mean([t.count("+") + 1 for t in texts])

    assert terms(first) <= cfg.data.curriculum_start_terms < terms(last)
    assert max(t.count("+") + 1 for t in last) == cfg.data.max_terms
    assert max(p.text.count("+") + 1 for p in source.heldout(256)) == cfg.data.max_terms


def test_recheck_traces_score_right_and_have_a_geometric_tail():
    from sagc_jax.config import load_config
    from sagc_jax.tasks.source import SyntheticSource
    from sagc_jax.train.sft import recheck, sft_batch

    assert recheck("3>8>0#0", 2, 48) == "3>8>0=3>8>0=3>8>0#0"
    assert recheck("3>8>0#0", 9, 20) == "3>8>0=3>8>0=3>8>0#0"  # only the passes that fit
    assert check_running_sum(recheck("3>8>0#0", 2, 48), "0") == 1.0
    cfg = load_config(
        "configs/experiments/straggler.yaml", ["sft.batch_size=4096", "sft.ramble_fraction=0"]
    )
    source = SyntheticSource(cfg, log=lambda _: None)
    tokens, mask = sft_batch(cfg, source, step=0, width=80)
    again, _ = sft_batch(cfg, source, step=0, width=80)
    np.testing.assert_array_equal(tokens, again)  # deterministic
    tok = source.tokenizer
    passes = np.array(
        [tok.decode(row[m > 0]).count("=") for row, m in zip(tokens, mask, strict=True)]
    )
    q = cfg.sft.recheck_prob
    for j in (1, 2, 3):  # P(at least j extra passes) = q ** j (up to what fits the cap)
        assert abs(np.mean(passes >= j) - q**j) < 0.03, j
