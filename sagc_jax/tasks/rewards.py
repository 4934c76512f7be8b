"""Reward functions: built-ins by name (``REWARDS``), user functions by ``module:function``, safe
batch scoring.

A reward function scores a batch of completions::

    def my_reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        ...

The three lists have one entry per completion (B = prompts x G rows: a prompt and its answer are
repeated for each of its G completions); completions are decoded text, cut at eos. It returns B
finite floats (any sequence: list, tuple, numpy array), or a :class:`Scores` that also lists
the rows it scored 0.0 because checking them hit a time limit. Built-ins, one entry each in
``REWARDS`` (``data.reward``'s names; adding one is a function and an entry: docs/architecture.md,
"Add a reward"):

  ``synthetic``  1.0 for the right running-sum answer after ``#`` (:func:`check_running_sum`)
  ``math``       1.0 when the extracted final answer equals the reference (:class:`MathReward`:
                 the symbolic stage runs in worker processes under per-completion and per-batch
                 time limits)

:func:`resolve_reward` turns a config string into a function (import errors surface at start-up,
not at the first step); :func:`score_batch` calls it and isolates rows that fail. A function of
your own given a time limit (``reward_timeout_s``, the trainer's ``data.reward_timeout_s``) runs
in a worker process that is killed at the limit (:class:`TimeLimitedReward`): a Python thread
stuck in a loop, a regular expression or a C extension cannot be stopped, a process can.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from sagc_jax.config import Registry
from sagc_jax.tasks.deadline_pool import TIMED_OUT, DeadlinePool, WorkerError
from sagc_jax.tasks.math_checker import (
    Verdict,
    check_symbolic,
    compare_answers,
    final_answers,
    symbolic_equal,
)
from sagc_jax.tasks.synthetic import check_running_sum

__all__ = [
    "REWARDS",
    "MathReward",
    "Reward",
    "RewardError",
    "RewardFn",
    "RewardResult",
    "Scores",
    "TimeLimitedReward",
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


@dataclasses.dataclass(frozen=True)
class Reward:
    """A built-in reward (``data.reward``): ``build(**options)`` the function, given the
    ``math_*`` options of the config (a reward that has none ignores them); ``help``: its line
    in ``data.reward``'s help."""

    build: Callable[..., RewardFn]
    help: str


def is_import_path(spec: str) -> bool:
    """Whether ``spec`` has the form ``package.module:function``."""
    module_name, sep, attr = spec.partition(":")
    return bool(sep and module_name and attr)


REWARDS = Registry(
    "data.reward",
    {
        "synthetic": Reward(
            lambda **_: synthetic_reward, "the running-sum answer after '#' (the synthetic task)"
        ),
        "math": Reward(
            lambda **options: MathReward(**options) if options else math_reward,
            "the final answer equal to the reference, symbolically",
        ),
    }.items(),
    also=("auto",),
    form=("package.module:function", is_import_path),
)


def _one_line(err: BaseException, limit: int = 160) -> str:
    text = str(err).strip().splitlines()
    text = text[0] if text else ""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def resolve_reward(spec: str, *, reward_timeout_s: float = 0.0, **math_options) -> RewardFn:
    """A built-in name (a key of ``REWARDS``) or ``package.module:function`` -> the function.

    ``math_options`` (``timeout_s``, ``batch_timeout_s``, ``workers``) configure the built-in
    ``math`` reward (:class:`MathReward`); other rewards ignore them. The function part may be
    dotted (``module:Class.method``). With ``reward_timeout_s > 0`` a ``module:function`` comes
    back wrapped in a :class:`TimeLimitedReward` (run in a worker process, at most that many
    seconds per batch); 0: the function itself, called in this process without a limit. Raises
    :class:`RewardError` naming the spec when the module cannot be imported, the attribute does
    not exist, it is not callable, or it cannot be called with three positional lists.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"reward = {spec!r} must be a non-empty string")
    spec = spec.strip()
    if spec in REWARDS:
        return REWARDS[spec].build(**math_options)
    builtins = ", ".join(REWARDS)
    module_name, sep, attr = spec.partition(":")
    if not is_import_path(spec):
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
    if reward_timeout_s > 0:
        return TimeLimitedReward(spec, obj, reward_timeout_s)
    return obj


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """Scores of a batch: ``rewards`` float32 [B]; ``failed`` the rows scored 0.0 because the
    function failed on them (empty when all is well); ``message`` a one-line summary or '';
    ``timed_out`` the rows scored 0.0 at a time limit: those the function reported
    (:attr:`Scores.timed_out`) and those it did not finish within ``data.reward_timeout_s``;
    ``batch_timed_out``: the call of the whole batch ran past ``data.reward_timeout_s`` and its
    rows were then scored one by one (whatever they scored).
    """

    rewards: np.ndarray
    failed: tuple[int, ...]
    message: str
    timed_out: tuple[int, ...] = ()
    batch_timed_out: bool = False


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


def _score_calls(fn: RewardFn, calls: list[tuple[list, list, list]]) -> list[_Outcome]:
    """Each call's outcome: in ``fn``'s worker under its time limit, or here."""
    run = getattr(fn, "score_calls", None)
    if run is not None:
        return run(calls)
    return [_Outcome(*_call(fn, *call)) for call in calls]


def _reward_name(fn: RewardFn) -> str:
    spec = getattr(fn, "spec", None)
    if isinstance(spec, str):
        return spec
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _rows(rows: Sequence[int]) -> str:
    return f"{list(rows[:10])}" + ("..." if len(rows) > 10 else "")


def score_batch(
    fn: RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    on_error: str = "raise",
) -> RewardResult:
    """Score B completions with ``fn``, isolating rows that make it fail.

    The batch is scored in one call. If that call raises, returns the wrong number of values or
    (a :class:`TimeLimitedReward`) runs past its time limit, each row is scored alone to find
    the culprits. A row fails when its call raises, returns other than one value, or its value
    is not a finite number; it overruns when its call alone runs past the limit (or is not
    reached within it). ``on_error="raise"`` raises :class:`RewardError` naming the function,
    the first such index and why; ``on_error="zero"`` scores those rows 0.0 and lists failed
    rows in :attr:`RewardResult.failed`, overrun rows in :attr:`RewardResult.timed_out`. Rows
    that ``fn`` reports as timed out (it returned a :class:`Scores`) are listed in
    :attr:`RewardResult.timed_out` too.
    """
    if on_error not in ("raise", "zero"):
        raise ValueError(f"score_batch: on_error = {on_error!r} is not allowed; use raise or zero")
    n = len(completions)
    if len(prompts) != n or len(answers) != n:
        raise ValueError(
            f"score_batch: got {len(prompts)} prompts, {n} completions, {len(answers)} answers;"
            " the three lists must have one entry per completion"
        )
    [whole] = _score_calls(fn, [(list(prompts), list(completions), list(answers))])
    values, timed_out = whole.values, whole.timed_out
    overran = set(range(n)) if whole.overran else set()
    if n > 1 and all(isinstance(v, str) for v in values):  # whole-batch failure: isolate rows
        rows = _score_calls(fn, [([prompts[i]], [completions[i]], [answers[i]]) for i in range(n)])
        values = [row.values[0] for row in rows]
        timed_out = {i for i, row in enumerate(rows) if row.timed_out}
        overran = {i for i, row in enumerate(rows) if row.overran}
    failed = tuple(i for i, v in enumerate(values) if isinstance(v, str) and i not in overran)
    rewards = np.array([0.0 if isinstance(v, str) else v for v in values], np.float32)
    name = _reward_name(fn)
    message = ""
    if failed:
        first = failed[0]
        message = (
            f"reward {name} failed at index {first} of {n} ({values[first]}); "
            f"{len(failed)} row(s) failed: {_rows(failed)}"
        )
        if on_error == "raise":
            raise RewardError(message)
    if overran:
        first = min(overran)
        alone = "" if n == 1 else ", and again scored alone"
        overrun = (
            f"reward {name} ran past data.reward_timeout_s = {fn.timeout_s:g} s at index "
            f"{first} of {n} (completion {completions[first]!r:.60}){alone}; "
            f"{len(overran)} row(s) unscored: {_rows(sorted(overran))}"
        )
        if on_error == "raise":
            raise RewardError(
                f"{overrun}; its worker process was stopped; fix the function, raise "
                "data.reward_timeout_s, or set data.reward_on_error=zero to score such rows 0 "
                "(counted in reward_timeouts)"
            )
        message = f"{message}; {overrun}" if message else overrun
    return RewardResult(
        rewards.reshape(n),
        failed,
        message,
        tuple(sorted(timed_out | overran)),
        batch_timed_out=whole.overran and n > 1,
    )


# --------------------------------------------------------------------------- time limits

_LOADED: dict[str, RewardFn] = {}  # in a worker process: the functions imported by spec


def _load_reward(spec: str) -> RewardFn:
    if spec not in _LOADED:
        _LOADED[spec] = resolve_reward(spec)
    return _LOADED[spec]


def _warm_up(spec: str) -> None:
    """A worker's start: import the function before the clock starts (errors come per call)."""
    try:
        _load_reward(spec)
    except Exception:
        pass


def _score_in_worker(spec: str, prompts, completions, answers) -> tuple[list, set[int]]:
    try:
        fn = _load_reward(spec)
    except Exception as err:
        return [f"could not be imported in its worker process ({_one_line(err)})"] * len(
            completions
        ), set()
    return _call(fn, prompts, completions, answers)


class _Outcome(NamedTuple):
    """One call of a reward: per row a float or why it failed (str), the rows the function
    reported as timed out, and whether it was stopped at its time limit."""

    values: list
    timed_out: set[int]
    overran: bool = False


class TimeLimitedReward:
    """A reward function of your own, run in a worker process, ``timeout_s`` seconds per batch.

    The worker (a fresh interpreter, started once and reused) imports the function by its
    ``spec`` as :func:`resolve_reward` did, before the clock starts; it cannot reach the
    trainer's accelerator or state. A call still running at the limit has its worker killed and
    replaced; :func:`score_batch` then scores the batch one row at a time (on two workers from
    then on; each row, and all rows together, within ``timeout_s`` again) to name the rows that
    hang: a batch takes at most twice the limit.
    ``fn`` is the function as imported here (for its name and signature).
    """

    def __init__(self, spec: str, fn: RewardFn, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"TimeLimitedReward: timeout_s = {timeout_s} must be > 0")
        self.spec, self.fn, self.timeout_s = spec, fn, timeout_s
        self._pool: DeadlinePool | None = None

    def __repr__(self) -> str:
        return f"TimeLimitedReward({self.spec!r}, timeout_s={self.timeout_s:g})"

    def score_calls(self, calls: Sequence[tuple[list, list, list]]) -> list[_Outcome]:
        """Run each ``(prompts, completions, answers)`` call in the worker, all of them within
        ``timeout_s``; a call not finished by then is an overrun (every row a string)."""
        if self._pool is None:
            self._pool = DeadlinePool(1, warmup=functools.partial(_warm_up, self.spec))
        if len(calls) > 1:  # rows one by one: a row that hangs holds one worker, not all rows
            self._pool.grow(2)
        try:
            results = self._pool.map(
                _score_in_worker,
                [(self.spec, *call) for call in calls],
                item_seconds=self.timeout_s,
                total_seconds=self.timeout_s,
            )
        except RuntimeError as err:  # its worker exits before it is ready
            raise RewardError(f"reward '{self.spec}': {err}") from None
        outcomes = []
        for (_, completions, _), out in zip(calls, results, strict=True):
            n = len(completions)
            if out is TIMED_OUT:
                why = f"ran past data.reward_timeout_s = {self.timeout_s:g} s"
                outcomes.append(_Outcome([why] * n, set(), overran=True))
            elif isinstance(out, WorkerError):  # it died: os._exit, a crash in C code
                outcomes.append(_Outcome([f"killed its worker process ({out})"] * n, set()))
            else:
                outcomes.append(_Outcome(*out))
        return outcomes

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str]) -> Scores:
        """Score one batch; raise :class:`RewardError` when a row fails or runs past the limit."""
        result = score_batch(self, prompts, completions, answers, on_error="raise")
        return Scores(result.rewards.tolist(), result.timed_out)

    def close(self) -> None:
        """Stop the worker process (a later call starts a new one)."""
        if self._pool is not None:
            self._pool.close()
