"""Straggler worlds with known per-G rates, and the oracle that knows them.

A world is a rollout-length workload (``lengths(step, G)``, ``prompts(step)``, ``num_steps``,
as in ``sim.workload``) that also answers ``rates(step) -> p_k``: the true probability that a
group of each candidate size straggles at that step (max/median > tau), estimated once by Monte
Carlo on many groups drawn from the same distribution (standard error below 0.004). The oracle
(:func:`oracle`) plays, at every step, the best mixture of rungs whose expected straggler rate
meets delta (``controller.sagc_plus.best_mixture``), or the smallest G when none does; a
controller is judged by its straggler rate against the rate the oracle is allowed
(``max(delta, p_smallest)``) and by its mean log2 G against the oracle's.

``TailWorld``: every rollout of prompt p is a tail rollout (4-8x the group's typical length)
with probability ``q_p ~ Beta(c q_t, c (1 - q_t))`` (prompts differ in their tail; ``c`` =
``concentration``), where the mean ``q_t`` follows a schedule over the run; the other rollouts
spread log-normally (sigma 0.25) around the prompt's length. ``WorkloadWorld`` wraps the
calibrated simulator workload (``SyntheticWorkload``). Both use common random numbers: the first
G completions of a prompt are the same whatever G is asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from sagc_jax.config.sim import SimConfig
from sagc_jax.controller.observation import group_ratios, straggler_observation
from sagc_jax.controller.sagc_plus import best_mixture
from sagc_jax.controller.step import StepObservation
from sagc_jax.sim.roofline import cut_step
from sagc_jax.sim.workload import SyntheticWorkload

MONTE_CARLO_GROUPS = 16384


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(key))))


def _rates_of(lengths_ng: np.ndarray, candidates, tau: float) -> np.ndarray:
    """Share of groups straggling at each candidate G, from the first G columns."""
    return np.array([np.mean(group_ratios(lengths_ng[:, :g]) > tau) for g in candidates])


class TailWorld:
    """Tail rollouts with a per-prompt probability whose mean follows ``q_of_step``."""

    def __init__(
        self,
        q_of_step: Callable[[int], float],
        steps: int,
        candidates=(4, 8, 16),
        tau: float = 3.0,
        prompts_per_step: int = 64,
        concentration: float = 10.0,
        seed: int = 0,
    ) -> None:
        self.q_of_step, self.num_steps = q_of_step, steps
        self.candidates, self.tau = tuple(candidates), tau
        self.prompts_per_step, self.concentration, self.seed = prompts_per_step, concentration, seed
        self._cache: dict[float, np.ndarray] = {}

    def _draw(self, q: float, num: int, group_size: int, streams) -> np.ndarray:
        """Lengths ``[num, group_size]``: ``streams[0]`` draws the prompts, ``streams[1 + i]``
        completion i (so the first G completions do not depend on ``group_size``)."""
        c = self.concentration
        q_p = streams[0].beta(c * q, c * (1.0 - q), size=num)
        base_p = 500.0 * np.exp(0.5 * streams[0].standard_normal(num))
        out = np.empty((num, group_size), dtype=np.int64)
        for i in range(group_size):
            rng = streams[1 + i]
            spread = np.exp(0.25 * rng.standard_normal(num))
            tail = np.where(rng.random(num) < q_p, rng.uniform(4.0, 8.0, size=num), 1.0)
            out[:, i] = np.ceil(base_p * spread * tail)
        return out

    def prompts(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        ids = step * self.prompts_per_step + np.arange(self.prompts_per_step, dtype=np.int64)
        return ids, np.full(self.prompts_per_step, 256, dtype=np.int64)

    def lengths(self, step: int, group_size: int) -> np.ndarray:
        streams = [_rng(self.seed, step, i) for i in range(group_size + 1)]
        return self._draw(self.q_of_step(step), self.prompts_per_step, group_size, streams)

    def rates(self, step: int) -> np.ndarray:
        q = float(self.q_of_step(step))
        if q not in self._cache:
            g = max(self.candidates)
            streams = [_rng(2**31 - 1, i) for i in range(g + 1)]  # independent of the seed
            lengths = self._draw(q, MONTE_CARLO_GROUPS, g, streams)
            self._cache[q] = _rates_of(lengths, self.candidates, self.tau)
        return self._cache[q]


class WorkloadWorld:
    """The simulator's ``SyntheticWorkload`` (``sim`` section) with its per-step true rates."""

    def __init__(self, sim: SimConfig, candidates=(4, 8, 16), tau: float = 3.0) -> None:
        self.workload = SyntheticWorkload(sim)
        self.num_steps = sim.steps
        self.candidates, self.tau = tuple(candidates), tau
        # many prompts of the same distribution, another seed: the rates, not this run's draws
        many = dataclasses.replace(sim, prompts_per_step=MONTE_CARLO_GROUPS, seed=2**31 - 1)
        self._reference = SyntheticWorkload(many)
        self._cache: dict[int, np.ndarray] = {}

    def prompts(self, step: int):
        return self.workload.prompts(step)

    def lengths(self, step: int, group_size: int) -> np.ndarray:
        return self.workload.lengths(step, group_size)

    def rates(self, step: int) -> np.ndarray:
        if step not in self._cache:
            lengths = self._reference.lengths(step, max(self.candidates))
            self._cache[step] = _rates_of(lengths, self.candidates, self.tau)
        return self._cache[step]


def rates_table(world) -> np.ndarray:
    """The world's true rates, float64 ``[num_steps, K]``."""
    return np.stack([world.rates(t) for t in range(world.num_steps)])


def oracle(rates_tk: np.ndarray, candidates, delta: float) -> dict[str, np.ndarray]:
    """Per step: the oracle's expected ``log2_G`` and straggler ``rate``, and the ``allowed``
    rate ``max(delta, p_smallest)``, from the true rates ``[T, K]``; float64 ``[T]`` each."""
    utility = np.log2(np.asarray(candidates, dtype=np.float64))
    out = {key: np.zeros(len(rates_tk)) for key in ("log2_G", "rate", "allowed")}
    for t, p_k in enumerate(rates_tk):
        lo, hi, share = best_mixture(p_k, utility, delta)
        out["log2_G"][t] = utility[lo] + share * (utility[hi] - utility[lo])
        out["rate"][t] = p_k[lo] + share * (p_k[hi] - p_k[lo])
        out["allowed"][t] = max(delta, p_k[0])
    return out


def play_cut(controller, world, keep: int, naive: bool = False):
    """``(G_t, s_t, read_t)``, float64 ``[T]`` each, of ``controller`` over ``world`` with
    every step cut (tail batching, no long rounds): the step draws all of the world's groups at
    the proposed G, every rollout starting at once, and stops once ``keep`` groups are whole;
    the controller reads the cut step (an observation of the reached lengths and the finished
    flags, or with ``naive`` of the reached lengths as if complete: a cut rollout read as
    ended). ``s_t`` is the true straggle share of all the groups started (their full lengths:
    what the budget is judged on), ``read_t`` the controller's reading."""
    steps = world.num_steps
    g_t, s_t, read_t = np.zeros(steps), np.zeros(steps), np.zeros(steps)
    for t in range(steps):
        g = int(controller.propose())
        full = world.lengths(t, g)
        groups_r = np.repeat(np.arange(full.shape[0]), g)
        _, reached_r, done_r, _ = cut_step(full, groups_r, keep)
        reached = reached_r.reshape(full.shape)
        finished = None if naive else done_r.reshape(full.shape)
        m = controller.observe(StepObservation.of_groups(reached, finished))
        g_t[t], read_t[t] = g, m["s_t"]
        s_t[t] = straggler_observation(full, controller.tau, controller.scope)
    return g_t, s_t, read_t
