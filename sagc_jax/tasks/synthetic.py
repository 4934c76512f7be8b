"""Running-sum problems: a synthetic reasoning task with verifiable answers, sized for a CPU.

A problem adds k terms; the completion writes every running sum, then the answer::

    prompt      3+5+2+7=
    completion  3>8>10>17#17        (then eos)

k is drawn per problem from ``[min_terms, max_terms]`` and the digits of every term from
``[min_digits, max_digits]``, so completion lengths vary several-fold with k (5 to about 50
characters with the defaults). The model must copy, add and count: a policy that loses count keeps
emitting ``>`` steps until ``max_new_tokens``, so stragglers arise by themselves. With
``modulus`` set, running sums are taken modulo it (``modulus=10`` with one-digit terms is the
easiest variant: one output digit per step).

Problems are a pure function of ``(seed, split, index)``: the same index gives the same problem
whatever the call order or process. A difficulty curriculum caps k on the ``train`` split: with
``problem(index, max_terms=cap)``, k is drawn from ``[min_terms, min(cap, max_terms)]``, a pure
function of ``(seed, split, index, cap)``; :meth:`SyntheticTask.curriculum_terms` gives the cap of
a training step. A cap of ``max_terms`` or more gives exactly the uncapped problem; the ``sft`` and
``heldout`` splits are never capped.

The ``heldout`` split is disjoint from ``train`` and ``sft`` by content: a prompt belongs to
``heldout`` iff a stable hash of its text falls in the first ``heldout_fraction`` of the hash
range, and each split draws until it gets one of its own.
"""

from __future__ import annotations

import dataclasses
import numbers
import random
import zlib

__all__ = ["SPLITS", "Problem", "SyntheticTask", "check_running_sum"]

SPLITS = ("train", "sft", "heldout")
_HASH_RANGE = 1_000_000
_MAX_DRAWS = 10_000


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem: ``prompt`` (ends with ``=``), reference ``answer`` (decimal digits) and the
    reference completion ``trace`` (running sums, ``#``, answer; eos not included)."""

    prompt: str
    answer: str
    trace: str
    num_terms: int


def check_running_sum(completion: str, answer: str) -> float:
    """1.0 when the completion ends in ``#<answer>`` (exactly one ``#``), else 0.0.

    Only the final answer is checked; the running sums before ``#`` are free. Surrounding
    whitespace is ignored; anything else after the answer, a missing or repeated ``#`` or a
    non-numeric answer scores 0.0. Never raises on a string.
    """
    text = completion.strip()
    if text.count("#") != 1:
        return 0.0
    final = text.split("#", 1)[1]
    return 1.0 if final.isdigit() and final.isascii() and final == answer.strip() else 0.0


class SyntheticTask:
    """Deterministic generator and checker of running-sum problems.

    Args:
      min_terms, max_terms: range of k, the number of terms (inclusive, ``1 <= min <= max``).
      min_digits, max_digits: range of the digits of each term (inclusive, ``1..9``).
      modulus: take running sums modulo this (``>= 2``); None keeps exact sums.
      heldout_fraction: share of the prompt space reserved for the ``heldout`` split, in (0, 1).
      seed: selects the problem streams; ``heldout`` membership does not depend on it.
    """

    def __init__(
        self,
        min_terms: int = 2,
        max_terms: int = 12,
        min_digits: int = 1,
        max_digits: int = 2,
        modulus: int | None = None,
        heldout_fraction: float = 0.1,
        seed: int = 0,
    ):
        checks = [
            ("min_terms", min_terms, 1 <= min_terms, ">= 1"),
            ("max_terms", max_terms, max_terms >= min_terms, f">= min_terms = {min_terms}"),
            ("min_digits", min_digits, 1 <= min_digits <= 9, "1..9"),
            ("max_digits", max_digits, min_digits <= max_digits <= 9, f"{min_digits}..9"),
            ("modulus", modulus, modulus is None or modulus >= 2, "None or >= 2"),
            ("heldout_fraction", heldout_fraction, 0.0 < heldout_fraction < 1.0, "in (0, 1)"),
        ]
        for name, value, ok, allowed in checks:
            if not ok:
                raise ValueError(
                    f"SyntheticTask: {name} = {value!r} is out of range; allowed: {allowed}"
                )
        self.min_terms, self.max_terms = int(min_terms), int(max_terms)
        self.min_digits, self.max_digits = int(min_digits), int(max_digits)
        self.modulus = None if modulus is None else int(modulus)
        self.heldout_fraction = float(heldout_fraction)
        self.seed = int(seed)

    # ------------------------------------------------------------------ problems

    def _draw(self, rng: random.Random, max_terms: int | None = None) -> Problem:
        # Uncapped (or capped at >= self.max_terms): the same randint call, hence the same draws.
        top = self.max_terms if max_terms is None else min(max_terms, self.max_terms)
        k = rng.randint(self.min_terms, top)
        terms = []
        for _ in range(k):
            d = rng.randint(self.min_digits, self.max_digits)
            terms.append(rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1))
        sums, total = [], 0
        for t in terms:
            total += t
            if self.modulus is not None:
                total %= self.modulus
            sums.append(str(total))
        prompt = "+".join(map(str, terms)) + "="
        return Problem(prompt, sums[-1], ">".join(sums) + "#" + sums[-1], k)

    def _is_heldout(self, prompt: str) -> bool:
        bucket = zlib.crc32(prompt.encode()) % _HASH_RANGE
        return bucket < self.heldout_fraction * _HASH_RANGE

    def problem(self, index: int, split: str = "train", max_terms: int | None = None) -> Problem:
        """Problem ``index`` (>= 0) of ``split`` (one of :data:`SPLITS`).

        ``max_terms`` caps the number of terms of a ``train`` problem (a curriculum, see
        :meth:`curriculum_terms`): k is drawn from ``[min_terms, min(max_terms, self.max_terms)]``.
        It must be ``>= min_terms``; None (or any cap ``>= self.max_terms``) gives the uncapped
        problem. The ``sft`` and ``heldout`` splits are never capped: evaluation covers every
        difficulty.
        """
        if split not in SPLITS:
            raise ValueError(f"SyntheticTask: split = {split!r} is not allowed; choose {SPLITS}")
        if not isinstance(index, numbers.Integral) or index < 0:
            raise ValueError(f"SyntheticTask: index = {index!r} must be an integer >= 0")
        if max_terms is not None:
            if split != "train":
                raise ValueError(
                    f"SyntheticTask: max_terms = {max_terms!r} caps the train split only, not "
                    f"{split!r}"
                )
            if not isinstance(max_terms, numbers.Integral) or max_terms < self.min_terms:
                raise ValueError(
                    f"SyntheticTask: max_terms = {max_terms!r} must be an integer >= min_terms "
                    f"= {self.min_terms}"
                )
        # A str seed is hashed with sha512: stable across Python versions and processes.
        rng = random.Random(f"sagc-running-sum/{self.seed}/{split}/{int(index)}")
        want_heldout = split == "heldout"
        for _ in range(_MAX_DRAWS):
            p = self._draw(rng, max_terms)
            if self._is_heldout(p.prompt) == want_heldout:
                return p
        raise ValueError(
            f"SyntheticTask: no {split} problem in {_MAX_DRAWS} draws; the problem space "
            f"(terms {self.min_terms}..{self.max_terms}, digits {self.min_digits}.."
            f"{self.max_digits}) is too small for heldout_fraction = {self.heldout_fraction}"
        )

    def batch(
        self, step: int, num_prompts: int, split: str = "train", max_terms: int | None = None
    ) -> list[Problem]:
        """The ``num_prompts`` problems of training step ``step``: indices
        ``step * num_prompts + [0, num_prompts)``, capped at ``max_terms`` terms (see
        :meth:`problem`)."""
        start = int(step) * int(num_prompts)
        return [self.problem(start + i, split, max_terms) for i in range(int(num_prompts))]

    def curriculum_terms(
        self, step: int, curriculum_steps: int, start_terms: int | None = None
    ) -> int:
        """The cap on the number of terms of training step ``step`` under a linear curriculum.

        The cap rises from ``start_terms`` (None: ``min_terms``) at step 0 to ``max_terms`` at step
        ``curriculum_steps`` and stays there: ``start + floor((max_terms - start) *
        min(step, curriculum_steps) / curriculum_steps)`` (floor, in exact integer arithmetic, so
        ``max_terms`` is first reached at step ``curriculum_steps``). ``curriculum_steps = 0``
        turns the curriculum off: the cap is ``max_terms`` (no cap) at every step.
        """
        start = self.min_terms if start_terms is None else int(start_terms)
        if not self.min_terms <= start <= self.max_terms:
            raise ValueError(
                f"SyntheticTask: start_terms = {start_terms!r} is outside [min_terms = "
                f"{self.min_terms}, max_terms = {self.max_terms}]"
            )
        if curriculum_steps < 0 or step < 0:
            raise ValueError(
                f"SyntheticTask: step = {step!r} and curriculum_steps = {curriculum_steps!r} must "
                f"be >= 0"
            )
        if curriculum_steps == 0:
            return self.max_terms
        done = min(int(step), int(curriculum_steps))
        return start + (self.max_terms - start) * done // int(curriculum_steps)

    def heldout(self, num: int) -> list[Problem]:
        """The first ``num`` problems of the held-out split (a fixed evaluation set)."""
        return [self.problem(i, "heldout") for i in range(int(num))]

    def sft_pairs(self, count: int, start: int = 0) -> list[tuple[str, str]]:
        """(prompt, completion) pairs for a supervised warm start, from the ``sft`` stream
        (training prompts, drawn apart from the ``train`` stream). Completions exclude eos."""
        probs = (self.problem(start + i, "sft") for i in range(int(count)))
        return [(p.prompt, p.trace) for p in probs]

    # ------------------------------------------------------------------ checking and sizes

    @staticmethod
    def score(problem: Problem | str, completion: str) -> float:
        """1.0 for the right final answer after ``#``, else 0.0 (see :func:`check_running_sum`);
        ``problem`` is a :class:`Problem` or its answer string."""
        answer = problem.answer if isinstance(problem, Problem) else problem
        return check_running_sum(completion, answer)

    def _max_sum(self, i: int) -> int:
        """Largest possible running sum after ``i`` terms."""
        exact = i * (10**self.max_digits - 1)
        return exact if self.modulus is None else min(exact, self.modulus - 1)

    def max_prompt_chars(self) -> int:
        """Longest possible prompt, in characters (= tokens of :class:`CharTokenizer`)."""
        return self.max_terms * (self.max_digits + 1)

    def max_completion_chars(self) -> int:
        """Longest possible reference completion in characters, eos excluded; a natural unit
        for ``max_new_tokens`` (set it a little above, so only runaway completions hit it)."""
        k = self.max_terms
        sums = sum(len(str(self._max_sum(i))) for i in range(1, k + 1))
        return sums + (k - 1) + 1 + len(str(self._max_sum(k)))
