"""The interface shared by every group-size controller, and its common bookkeeping."""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from sagc_jax.controller.observation import (
    CENSORED_KEYS,
    StraggleTest,
    censored_observation,
    group_ratios,
    observation_from_ratios,
    padding_waste,
)
from sagc_jax.controller.step import StepObservation, check_observation


class GroupController(abc.ABC):
    """Chooses the GRPO group size G before each step and learns from the step's lengths.

    Protocol per training step::

        G = controller.propose()          # same value until observe() is called
        ... generate prompts_per_step x G rollouts ...
        obs = StepObservation.of_groups(lengths_pg)   # [num_groups, G] response lengths
        metrics = controller.observe(obs)

    A step cut before every rollout finished (tail batching) has ``finished_pg`` (bool
    ``[num_groups, G]``) in its observation: where it is False the length is a lower bound. A
    cut group is a certain straggler when its ratio's lower bound exceeds tau, otherwise unknown
    and counted with its estimated probability of straggling
    (``observation.censored_straggle``), never as safe.

    Every controller measures stragglers the same way (``tau``, ``scope``) so that baselines and
    SAGC report comparable straggler rates. A controller with ``prompt_aware = True`` (the
    hybrid) decides from the step's prompts: the caller gathers them and proposes through
    ``propose_for(prompt_ids, prompt_lengths)`` instead of ``propose()``.
    """

    prompt_aware = False  # True: propose_for(prompt_ids, prompt_lengths) instead of propose()
    reward_aware = False  # True: observe() reads the observation's rewards
    weighs_step_time = False  # True: built with the modeled seconds of a step (step_seconds)
    # keys of observe()'s metrics the run logs as controller/<key> (when not None), beside the
    # ones every controller has (s_t, lambda, ...)
    logged_metrics: tuple[str, ...] = ()

    def __init__(self, candidates: tuple[int, ...], tau: float, scope: str) -> None:
        self.candidates = tuple(int(g) for g in candidates)
        self.tau = float(tau)
        self.scope = scope
        self._pending: int | None = None  # G proposed and not yet observed
        self.step = 0
        self.straggler_sum = 0.0  # running sum of s_t
        self.group_size_sum = 0  # running sum of G_t
        self.steps_per_candidate = np.zeros(len(self.candidates), dtype=np.int64)
        # None: the paper's relative test (tau, scope); another test judges whole steps only
        self.straggle_test: StraggleTest | None = None

    # ------------------------------------------------------------------ decisions

    @abc.abstractmethod
    def _decide(self) -> int:
        """The G of the next step (called once per step)."""

    @abc.abstractmethod
    def _learn(
        self, group_size: int, s_t: float, lengths_pg: np.ndarray, finished_pg=None
    ) -> dict[str, Any]:
        """Update internal state after a step at ``group_size`` (its lengths ``[P, G]``, its
        observation ``s_t``, ``finished_pg`` bool ``[P, G]`` of a cut step or None); return extra
        metrics."""

    def _learn_rewards(self, rewards_pg: np.ndarray, finished_pg: np.ndarray | None) -> None:
        """Learn from the step's rewards (float64 ``[P, G]``; ``finished_pg`` bool or None),
        before :meth:`_learn` sees its lengths; only controllers with ``reward_aware``."""
        return None  # the others learn from lengths alone

    def propose(self) -> int:
        """The G for the next step; repeated calls before :meth:`observe` return the same G."""
        if self._pending is None:
            self._pending = int(self._decide())
        return self._pending

    def observe(self, obs: StepObservation) -> dict[str, Any]:
        """Record the step that used the proposed G and return its metrics.

        ``obs``: the step's :class:`~sagc_jax.controller.step.StepObservation`, read as
        ``[num_groups, G]`` (``obs.lengths_pg``). Its ``finished_pg`` (a step cut by tail
        batching) is False where the step stopped the rollout first (its length a lower bound);
        None or all True: every length is exact. Its ``rewards_pg`` (raw rewards) is read only
        by a controller with ``reward_aware``; prompt ids only by the hybrid. Raises TypeError
        if ``obs`` is not a StepObservation, RuntimeError if nothing was proposed, ValueError if
        the group size is not the proposed G. With ``finished`` given the metrics add
        ``censored_groups``, ``censored_stragglers`` (certain) and ``censored_unknown``.
        """
        check_observation(obs)
        if self._pending is None:
            raise RuntimeError("observe() called before propose(); call propose() for the step")
        g = self._pending
        arr = obs.lengths_pg(expected_group_size=g)
        finished = obs.finished_pg if obs.cut else None
        if obs.rewards_b is not None and self.reward_aware:
            self._learn_rewards(obs.rewards_pg, finished)
        if finished is None:
            ratios_p = group_ratios(arr)
            if self.straggle_test is None:
                s_t = observation_from_ratios(arr, ratios_p, self.tau, self.scope)
            else:
                s_t = self.straggle_test.observation(arr, self.tau, self.scope)
            counts = {} if obs.finished_b is None else dict.fromkeys(CENSORED_KEYS, 0)
            extra = self._learn(g, s_t, arr)
        elif self.straggle_test is not None:
            raise ValueError(
                f"straggle test {self.straggle_test.name!r} judges whole steps; a step cut by "
                "tail batching is read by the paper's test only"
            )
        else:
            s_t, ratios_p, counts = censored_observation(arr, finished, self.tau, self.scope)
            extra = self._learn(g, s_t, arr, finished)
        return self._finish(g, s_t, obs.lengths_b, ratios_p, {**counts, **extra})

    def calibration(self) -> dict[str, Any] | None:
        """Predicted against observed straggle so far, for a controller that predicts it
        before the step (the hybrid); None for the others."""
        return None

    def _finish(
        self,
        group_size: int | None,
        s_t: float,
        lengths_b: np.ndarray,
        ratios_p: np.ndarray,
        extra: dict[str, Any],
    ) -> dict[str, Any]:
        """Close the step: counters and the common metrics (``group_size`` None: mixed sizes,
        not counted in ``mean_group_size`` and ``steps_per_candidate``)."""
        self._pending = None
        self.step += 1
        self.straggler_sum += s_t
        if group_size is not None:
            self.group_size_sum += group_size
            self.steps_per_candidate[self.candidates.index(group_size)] += 1
        return {
            "step": self.step - 1,
            "group_size": group_size,
            "s_t": s_t,
            "straggler_rate": self.straggler_sum / self.step,
            "mean_group_size": self.group_size_sum / self.step,
            "group_ratios": ratios_p,
            "max_ratio": float(ratios_p.max()),
            "padding_waste": padding_waste(lengths_b),
            "mean_length": float(lengths_b.sum()) / lengths_b.size,
            "max_length": int(lengths_b.max()),
            **extra,
        }

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-for-bit: numpy arrays and Python scalars only."""
        return {
            "kind": type(self).__name__,
            "candidates": np.asarray(self.candidates, dtype=np.int64),
            "pending": -1 if self._pending is None else self._pending,
            "step": self.step,
            "straggler_sum": self.straggler_sum,
            "group_size_sum": self.group_size_sum,
            "steps_per_candidate": self.steps_per_candidate.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; rejects state of another controller or ladder."""
        if state.get("kind") != type(self).__name__:
            raise ValueError(
                f"state of a {state.get('kind')!r} cannot be loaded into a {type(self).__name__}"
            )
        saved = tuple(int(g) for g in np.asarray(state["candidates"]).tolist())
        if saved != self.candidates:
            raise ValueError(
                f"saved controller candidates {list(saved)} differ from configured "
                f"{list(self.candidates)}"
            )
        pending = int(state["pending"])
        self._pending = None if pending < 0 else pending
        self.step = int(state["step"])
        self.straggler_sum = float(state["straggler_sum"])
        self.group_size_sum = int(state["group_size_sum"])
        self.steps_per_candidate = np.array(state["steps_per_candidate"], dtype=np.int64)
