"""The reward registry and batch scoring policies."""

import math
import textwrap
import threading
import time

import numpy as np
import pytest

from sagc_jax.tasks import (
    REWARDS,
    MathReward,
    RewardError,
    Scores,
    math_reward,
    resolve_reward,
    score_batch,
    synthetic_reward,
)

USER_MODULE = textwrap.dedent(
    """
    def length_reward(prompts, completions, answers):
        return [float(len(c)) for c in completions]

    class Scorers:
        @staticmethod
        def exact(prompts, completions, answers):
            return [float(c == a) for c, a in zip(completions, answers)]

    NOT_CALLABLE = 3

    def one_arg(completions):
        return [0.0] * len(completions)
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "sagc_test_user_rewards.py").write_text(USER_MODULE)
    (tmp_path / "sagc_test_broken_rewards.py").write_text("raise RuntimeError('boom\\nsecond')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "sagc_test_user_rewards"


def test_builtins_resolve_and_score():
    assert resolve_reward("synthetic") is synthetic_reward
    assert resolve_reward(" math ") is math_reward
    configured = resolve_reward("math", timeout_s=1.5, batch_timeout_s=9.0, workers=3)
    assert isinstance(configured, MathReward) and configured.batch_timeout_s == 9.0
    assert resolve_reward("synthetic", timeout_s=1.5) is synthetic_reward
    assert synthetic_reward(["1+2="] * 2, ["1>3#3", "1>3#4"], ["3", "3"]) == [1.0, 0.0]
    assert math_reward(["q"] * 2, ["\\boxed{3/4}", "#### 2"], ["0.75", "3"]) == [1.0, 0.0]


def test_user_function_by_module_colon_name(user_module):
    fn = resolve_reward(f"{user_module}:length_reward")
    assert fn(["p"], ["abc"], ["a"]) == [3.0]
    assert resolve_reward(f"{user_module}:Scorers.exact")(["p"], ["a"], ["a"]) == [1.0]


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("nonsense", f"reward 'nonsense' is neither a built-in ({', '.join(REWARDS)}) nor"),
        (":fn", "reward ':fn' is neither a built-in"),
        ("sagc_no_such_module_xyz:fn", "cannot import module 'sagc_no_such_module_xyz'"),
        (
            "sagc_test_broken_rewards:fn",
            "importing module 'sagc_test_broken_rewards' failed (RuntimeError: boom)",
        ),
        ("sagc_test_user_rewards:missing", "'sagc_test_user_rewards' has no attribute 'missing'"),
        ("sagc_test_user_rewards:Scorers.nope", "has no attribute 'nope'"),
        ("sagc_test_user_rewards:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not callable"),
        ("sagc_test_user_rewards:one_arg", "cannot be called as fn(prompts, completions, answers)"),
        ("", "reward = '' must be a non-empty string"),
    ],
)
def test_resolution_errors_name_the_spec(user_module, spec, needle):
    with pytest.raises(RewardError) as info:
        resolve_reward(spec)
    assert needle in str(info.value) and "\n" not in str(info.value)


P, C, A = ["p0", "p1", "p2", "p3"], ["c0", "bad", "c2", "c3"], ["a"] * 4


def raises_on_bad(prompts, completions, answers):
    if "bad" in completions:
        raise ValueError("cannot score 'bad'")
    return [1.0] * len(completions)


def nan_on_bad(prompts, completions, answers):
    return [math.nan if c == "bad" else 0.5 for c in completions]


def wrong_length(prompts, completions, answers):
    return [1.0] * (len(completions) + 1)


def test_score_batch_clean():
    result = score_batch(lambda p, c, a: np.arange(len(c)), P, C, A)
    assert result.rewards.dtype == np.float32 and result.rewards.tolist() == [0, 1, 2, 3]
    assert result.failed == () and result.message == ""


@pytest.mark.parametrize(
    "fn, rewards, failed, why",
    [
        (raises_on_bad, [1, 0, 1, 1], (1,), "raised ValueError: cannot score 'bad'"),
        (nan_on_bad, [0.5, 0, 0.5, 0.5], (1,), "returned nan"),
        (lambda p, c, a: [1, "x", math.inf, 2], [1, 0, 0, 2], (1, 2), "returned a non-number 'x'"),
        (wrong_length, [0, 0, 0, 0], (0, 1, 2, 3), "returned 2 values for 1 completions"),
    ],
)
def test_score_batch_zero_policy_isolates_rows(fn, rewards, failed, why):
    result = score_batch(fn, P, C, A, on_error="zero")
    assert result.rewards.tolist() == rewards and result.failed == failed
    assert f"failed at index {failed[0]} of 4 ({why}" in result.message
    assert f"{len(failed)} row(s) failed: {list(failed)}" in result.message


@pytest.mark.parametrize("fn", [raises_on_bad, nan_on_bad])
def test_score_batch_raise_policy_names_the_index(fn):
    with pytest.raises(RewardError, match=r"failed at index 1 of 4 .*1 row\(s\) failed: \[1\]"):
        score_batch(fn, P, C, A, on_error="raise")


def test_score_batch_argument_errors():
    with pytest.raises(ValueError, match="got 3 prompts, 4 completions, 4 answers"):
        score_batch(raises_on_bad, P[:3], C, A)
    with pytest.raises(ValueError, match="on_error = 'skip' is not allowed"):
        score_batch(raises_on_bad, P, C, A, on_error="skip")


def test_score_batch_carries_the_rows_a_reward_timed_out():
    def slow_on_bad(prompts, completions, answers):
        return Scores(
            [0.0 if c == "bad" else 1.0 for c in completions], [1] if "bad" in completions else []
        )

    result = score_batch(slow_on_bad, P, C, A)
    assert result.rewards.tolist() == [1, 0, 1, 1] and result.timed_out == (1,)
    assert result.failed == () and result.message == ""


def never_returns(pred, ref):
    """An injected symbolic check that hangs (what sympy does on some inputs)."""
    time.sleep(10**6)


PATHOLOGICAL = [
    "\\boxed{" * 20_000,  # no answer: 0.0 at once (the extraction is linear), not a time-out
    "so \\boxed{9^{{9}^{9}}}",  # a power tower: refused before sympy sees it, counted
    "so \\boxed{2\\sqrt{2}}",  # symbolic: its check never returns, stopped at the deadline
    "so \\boxed{3}",  # numeric: decided in the caller
]


def test_math_reward_scores_pathological_rows_zero_and_counts_them():
    pytest.importorskip("math_verify")
    reward = MathReward(timeout_s=0.2, batch_timeout_s=5.0, check=never_returns)
    result = score_batch(reward, ["q"] * 4, PATHOLOGICAL, ["1", "1", "\\sqrt{8}", "3"])
    assert result.rewards.tolist() == [0, 0, 0, 1]
    assert result.timed_out == (1, 2) and result.failed == ()


def test_math_reward_is_bounded_when_called_from_a_thread():
    pytest.importorskip("math_verify")
    reward = MathReward(timeout_s=0.2, batch_timeout_s=5.0, check=never_returns)
    results = []
    caller = threading.Thread(
        target=lambda: results.append(reward(["q"] * 4, PATHOLOGICAL, ["1", "1", "\\sqrt{8}", "3"]))
    )
    caller.start()
    caller.join()  # ends by construction: no signal is involved
    [scores] = results
    assert list(scores) == [0, 0, 0, 1] and scores.timed_out == (1, 2)


def test_math_reward_batch_bound_stops_every_remaining_row():
    pytest.importorskip("math_verify")
    # each row alone could run 60 s; the batch gets 0.3 s in all
    reward = MathReward(timeout_s=60.0, batch_timeout_s=0.3, workers=2, check=never_returns)
    scores = reward(["q"] * 5, ["\\boxed{2\\sqrt{2}}"] * 5, ["\\sqrt{8}"] * 5)
    assert list(scores) == [0.0] * 5 and scores.timed_out == (0, 1, 2, 3, 4)
