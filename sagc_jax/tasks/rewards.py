"""Reward functions: built-ins by name, user functions by ``module:function``, safe batch scoring.

A reward function scores a batch of completions::

    def my_reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        ...

The three lists have one entry per completion (B = prompts x G rows: a prompt and its answer are
repeated for each of its G completions); completions are decoded text, cut at eos. It returns B
finite floats (any sequence: list, tuple, numpy array), or a :class:`Scores` that also lists
the rows it scored 0.0 because checking them hit a time limit. Built-ins:

  ``synthetic``  1.0 for the right running-sum answer after ``#`` (:func:`check_running_sum`)
  ``math``       1.0 when the extracted final answer equals the reference (:class:`MathReward`:
                 the symbolic stage runs in worker processes under per-completion and per-batch
                 time limits)

:func:`resolve_reward` turns a config string into a function (import errors surface at start-up,
not at the first step); :func:`score_batch` calls it and isolates rows that fail.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable, Sequence

import numpy as np

from sagc_jax.tasks.math_checker import (
    Verdict,
    check_symbolic,
    compare_answers,
    final_answers,
    symbolic_equal,
)
from sagc_jax.tasks.synthetic import check_running_sum

__all__ = [
    "BUILTIN_REWARDS",
    "MathReward",
    "RewardError",
    "RewardFn",
    "RewardResult",
    "Scores",
    "math_reward",
    "resolve_reward",
    "score_batch",
    "synthetic_reward",
]

RewardFn = Callable[[list[str], list[str], list[str]], Sequence[float]]


class RewardError(ValueError):
    """A reward spec cannot be resolved, or a reward function failed (message is one line)."""


def synthetic_reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Built-in ``synthetic``: running-sum final answer check, per row."""
    return [check_running_sum(c, a) for c, a in zip(completions, answers, strict=True)]


class Scores(list):
    """A reward function's B values plus ``timed_out``: the rows it scored 0.0 because checking
    them would have run past its time limit (stopped at the deadline, or refused up front)."""

    def __init__(self, values, timed_out: Sequence[int] = ()):
        super().__init__(values)
        self.timed_out = tuple(timed_out)


class MathReward:
    """Built-in ``math``: 1.0 when the extracted final answer equals the reference, per row.

    Extraction, normalisation and the numeric comparison run in the caller in linear time.
    Answers that need math-verify go to a pool of ``workers`` processes (shared by the process,
    started on first use) under hard deadlines: ``timeout_s`` per completion and
    ``batch_timeout_s`` for the batch; a worker past its deadline is killed and replaced. Rows
    stopped at a deadline, and rows refused up front because they could hang sympy (a power
    tower, a huge exponent or factorial, an answer over ``max_symbolic_chars``), score 0.0 and
    are listed in the result's :attr:`Scores.timed_out`. ``check`` is the symbolic comparison
    (a module-level function; tests inject one that never returns).
    """

    def __init__(
        self,
        timeout_s: float = 2.0,
        batch_timeout_s: float = 30.0,
        workers: int = 2,
        *,
        max_symbolic_chars: int = 200,
        check: Callable[[str, str], bool] = symbolic_equal,
    ):
        self.timeout_s, self.batch_timeout_s, self.workers = timeout_s, batch_timeout_s, workers
        self.max_symbolic_chars = max_symbolic_chars
        self.check = check

    def __repr__(self) -> str:
        return (
            f"MathReward(timeout_s={self.timeout_s}, batch_timeout_s={self.batch_timeout_s}, "
            f"workers={self.workers})"
        )

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str]) -> Scores:
        values = [0.0] * len(completions)
        timed_out: list[int] = []
        symbolic: dict[int, tuple[str, str]] = {}
        for i, (c, a) in enumerate(zip(completions, answers, strict=True)):
            pair = final_answers(c, a)
            if pair is None:
                continue
            verdict, normalized = compare_answers(*pair, max_symbolic_chars=self.max_symbolic_chars)
            if verdict is Verdict.EQUAL:
                values[i] = 1.0
            elif verdict is Verdict.REFUSED:
                timed_out.append(i)
            elif verdict is Verdict.SYMBOLIC:
                symbolic[i] = normalized
        same = check_symbolic(
            list(symbolic.values()),
            item_seconds=self.timeout_s,
            total_seconds=self.batch_timeout_s,
            workers=self.workers,
            check=self.check,
        )
        for i, ok in zip(symbolic, same, strict=True):
            values[i] = 1.0 if ok else 0.0
            if ok is None:
                timed_out.append(i)
        return Scores(values, sorted(timed_out))


math_reward = MathReward()
BUILTIN_REWARDS: dict[str, RewardFn] = {"synthetic": synthetic_reward, "math": math_reward}


def _one_line(err: BaseException, limit: int = 160) -> str:
    text = str(err).strip().splitlines()
    text = text[0] if text else ""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def resolve_reward(spec: str, **math_options) -> RewardFn:
    """A built-in name (``synthetic``, ``math``) or ``package.module:function`` -> the function.

    ``math_options`` (``timeout_s``, ``batch_timeout_s``, ``workers``) configure the built-in
    ``math`` reward (:class:`MathReward`); other rewards ignore them. The function part may be
    dotted (``module:Class.method``). Raises :class:`RewardError` naming the spec when the module
    cannot be imported, the attribute does not exist, it is not callable, or it cannot be called
    with three positional lists.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"reward = {spec!r} must be a non-empty string")
    spec = spec.strip()
    if spec == "math" and math_options:
        return MathReward(**math_options)
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    builtins = ", ".join(BUILTIN_REWARDS)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardError(
            f"reward '{spec}' is neither a built-in ({builtins}) nor 'package.module:function'"
        )
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise RewardError(
            f"reward '{spec}': cannot import module '{module_name}' ({err})"
        ) from None
    except Exception as err:  # the user's module itself failed while importing
        raise RewardError(
            f"reward '{spec}': importing module '{module_name}' failed ({_one_line(err)})"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardError(
                f"reward '{spec}': '{getattr(obj, '__name__', obj)}' has no attribute '{part}'"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(
            f"reward '{spec}': '{attr}' is a {type(obj).__name__}, not callable; expected "
            "fn(prompts, completions, answers) -> list[float]"
        )
    try:
        inspect.signature(obj).bind([], [], [])
    except TypeError:
        raise RewardError(
            f"reward '{spec}': '{attr}' cannot be called as fn(prompts, completions, answers)"
        ) from None
    except ValueError:  # no signature available (some builtins): trust it
        pass
    return obj


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """Scores of a batch: ``rewards`` float32 [B]; ``failed`` the rows scored 0.0 because the
    function failed on them (empty when all is well); ``message`` a one-line summary or '';
    ``timed_out`` the rows the function scored 0.0 at its time limit (:attr:`Scores.timed_out`).
    """

    rewards: np.ndarray
    failed: tuple[int, ...]
    message: str
    timed_out: tuple[int, ...] = ()


def _call(fn: RewardFn, prompts, completions, answers) -> tuple[list[float | str], set[int]]:
    """Call ``fn``; return its values, or for every row a string saying why it failed, and the
    rows it says timed out."""
    n = len(completions)
    try:
        out = fn(list(prompts), list(completions), list(answers))
        values = list(out)
    except Exception as err:
        return [f"raised {_one_line(err)}"] * n, set()
    if len(values) != n:
        return [f"returned {len(values)} values for {n} completions"] * n, set()
    timed_out = {i for i in getattr(out, "timed_out", ()) if isinstance(i, int) and 0 <= i < n}
    checked: list[float | str] = []
    for v in values:
        try:
            x = float(v)
        except (TypeError, ValueError):
            checked.append(f"returned a non-number {v!r:.40}")
            continue
        checked.append(x if math.isfinite(x) else f"returned {x}")
    return checked, timed_out


def score_batch(
    fn: RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    on_error: str = "raise",
) -> RewardResult:
    """Score B completions with ``fn``, isolating rows that make it fail.

    The batch is scored in one call. If that call raises or returns the wrong number of values,
    each row is scored alone to find the culprits. A row fails when its call raises, returns
    other than one value, or its value is not a finite number. ``on_error="raise"`` raises
    :class:`RewardError` naming the first failing index and why; ``on_error="zero"`` scores the
    failed rows 0.0 and lists them in :attr:`RewardResult.failed`. Rows that ``fn`` reports as
    timed out (it returned a :class:`Scores`) are listed in :attr:`RewardResult.timed_out`.
    """
    if on_error not in ("raise", "zero"):
        raise ValueError(f"score_batch: on_error = {on_error!r} is not allowed; use raise or zero")
    n = len(completions)
    if len(prompts) != n or len(answers) != n:
        raise ValueError(
            f"score_batch: got {len(prompts)} prompts, {n} completions, {len(answers)} answers;"
            " the three lists must have one entry per completion"
        )
    values, timed_out = _call(fn, prompts, completions, answers)
    if n > 1 and all(isinstance(v, str) for v in values):  # whole-batch failure: isolate rows
        rows = [_call(fn, [prompts[i]], [completions[i]], [answers[i]]) for i in range(n)]
        values = [v[0] for v, _ in rows]
        timed_out = {i for i, (_, t) in enumerate(rows) if t}
    failed = tuple(i for i, v in enumerate(values) if isinstance(v, str))
    rewards = np.array([0.0 if isinstance(v, str) else v for v in values], np.float32)
    message = ""
    if failed:
        name = getattr(fn, "__qualname__", repr(fn))
        first = failed[0]
        message = (
            f"reward {getattr(fn, '__module__', '?')}:{name} failed at index {first} of {n} "
            f"({values[first]}); {len(failed)} row(s) failed: {list(failed[:10])}"
            + ("..." if len(failed) > 10 else "")
        )
        if on_error == "raise":
            raise RewardError(message)
    return RewardResult(rewards.reshape(n), failed, message, tuple(sorted(timed_out)))
