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
