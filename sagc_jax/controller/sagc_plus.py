"""SAGC+: the improved SAGC, a controller that keeps its straggler budget within a few steps.

Same problem as the paper's SAGC (``sagc.py``): maximise ``log2 G`` on a ladder of candidates
subject to a long-run straggler budget ``E[s_t] <= delta``, one G per step, from response
lengths only. Same straggler definition (``tau``, ``scope``) and knobs of the budget
(``controller.*``: candidates, tau, scope, delta, g_init). What differs, and why
(docs/controller.md, "SAGC+"):

- **Evidence per group.** Every group of a step is one Bernoulli trial of its rung (16 groups: 16
  trials, not one fraction), and the played group also yields trials of every smaller rung: its
  rollouts are i.i.d. given the prompt, so consecutive chunks of ``G'`` of a group of ``G`` are
  samples of a group of ``G'`` (a group counts as one trial of ``G'``, the share of its chunks
  that straggle). Counts are forgotten by ``trial_gamma`` per step and capped at ``memory``
  trials, so a rung's estimate follows drift within a few steps and an unplayed rung keeps its last
  estimate instead of decaying to a flat prior.
- **Structure across rungs.** A one-parameter tail model, ``p(G) = 1 - exp(-theta G)`` (a
  per-rollout straggle hazard ``theta``, fitted to every rung's counts), gives each rung a prior
  of ``prior_strength`` pseudo-trials; the rung's own counts correct it where they disagree; an
  isotonic fit then makes the estimate non-decreasing in G (straggling is a maximum over the
  group). Extrapolated upward from a smaller G the model is pessimistic when prompts differ in
  their tail (``1 - E[(1-q)^G]`` grows slower than the homogeneous curve), which is the safe side
  for a constraint.
- **Decision: the best mixture, no multiplier.** The best randomised choice under the estimate
  is a small linear program whose solution mixes two rungs ``lo`` (within the budget) and ``hi``
  (over it). Instead of a dual variable that needs tens of steps to move, a budget slack
  ``B = sum(delta - s_t)``, clipped to ``[-h, h]`` (``h = hysteresis``), decides which of the two
  is played: the controller stays on ``lo`` until ``B >= h`` (budget saved up), then on ``hi``
  until ``B <= -h``. The realised rate therefore tracks delta (``B`` stays near the band), the
  time shares follow the true rates even where the estimate is off, G changes only when the
  slack crosses the band (a dwell of ``2h / |p - delta|`` steps), and the clip is the
  anti-wind-up: an infeasible stretch (even the smallest G over delta) leaves at most ``h`` of
  debt. A rung the estimate rules out is left at once, downward as well as upward; a rung the
  estimate allows but the slack contradicts is left for the rung below.

- **Cut steps (tail batching).** A step that stopped once enough groups were whole has
  ``finished_pg`` in its observation; ``s_t`` is then the expected straggle share of all the
  groups started (``observation.censored_straggle``: a cut group counts 1 when it certainly
  straggles, else its Kaplan-Meier probability, never 0), and the chunks of smaller rungs are
  read the same way, so the slack and the counts keep the budget on the true rate
  (docs/controller.md, "Tail batching").

Deterministic: same observations, same decisions; no random generator.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from sagc_jax.config import ControllerConfig, SAGCPlusConfig
from sagc_jax.controller.base import GroupController
from sagc_jax.controller.observation import censored_straggle, group_ratios


def isotonic_increasing(y_k, w_k) -> np.ndarray:
    """The weighted least-squares non-decreasing fit of ``y_k`` (pool adjacent violators);
    ``y_k``, ``w_k``: sequences of floats of one length."""
    y_k, w_k = list(y_k), list(w_k)
    if all(a <= b for a, b in zip(y_k, y_k[1:], strict=False)):
        return np.array(y_k)
    blocks: list[list[float]] = []  # [value, weight, count]
    for y, w in zip(y_k, w_k, strict=True):
        blocks.append([y, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return np.repeat([b[0] for b in blocks], [b[2] for b in blocks])


def best_mixture(p_k: np.ndarray, utility_k: np.ndarray, delta: float) -> tuple[int, int, float]:
    """``(lo, hi, share_hi)``: the mixture of two rungs that maximises expected utility with
    expected straggle rate ``<= delta`` under rates ``p_k`` (the linear program's solution).

    ``lo == hi``: one rung, the largest if every rung fits, the smallest if none does.
    """
    fits = [k for k in range(p_k.size) if p_k[k] <= delta]
    if not fits:
        return 0, 0, 0.0
    over = [j for j in range(p_k.size) if p_k[j] > delta]
    best = (utility_k[fits[-1]], fits[-1], fits[-1], 0.0)
    for k in fits:
        for j in over:
            if j < k:
                continue
            share = (delta - p_k[k]) / (p_k[j] - p_k[k])
            value = utility_k[k] + share * (utility_k[j] - utility_k[k])
            if value > best[0]:
                best = (value, k, j, share)
    return best[1], best[2], float(best[3])


class SAGCPlusController(GroupController):
    """SAGC+; see the module docstring.

    ``budget``: the ladder, the straggler definition, the budget delta and the first G
    (``controller.*``); ``plus``: SAGC+'s own knobs (``controller.sagc_plus``).
    """

    logged_metrics = ("posterior_mean", "slack")  # slack: moves G between its two rungs

    def __init__(
        self, budget: ControllerConfig | None = None, plus: SAGCPlusConfig | None = None
    ) -> None:
        budget = budget or ControllerConfig()
        super().__init__(budget.candidates, budget.tau, budget.scope)
        self.delta = budget.delta
        self.plus = plus or SAGCPlusConfig()
        self.sizes_k = np.asarray(self.candidates, dtype=np.float64)
        self.utility = np.log2(self.sizes_k)
        k = len(self.candidates)
        self.straggled = np.zeros(k)  # effective straggling trials per rung
        self.trials = np.zeros(k)  # effective trials per rung
        self.slack = 0.0  # B = sum(delta - s_t), clipped to [-hysteresis, hysteresis]
        g_init = budget.g_init if budget.g_init is not None else self.candidates[k // 2]
        self.rung = self.candidates.index(g_init)
        self._cached_plan = None  # derived from the counts: not part of the state

    # ------------------------------------------------------------------ estimate

    def estimate(self) -> np.ndarray:
        """Straggle probability per rung: tail-model prior + the rung's counts, made
        non-decreasing in G; float64 ``[K]`` (delta everywhere before any observation).

        Python floats, not numpy: the ladder has a handful of rungs, and numpy's per-call cost
        would dominate the controller's cycle."""
        n_k, x_k, g_k = self.trials.tolist(), self.straggled.tolist(), self.candidates
        total = sum(n * g for n, g in zip(n_k, g_k, strict=True))  # a group of G: G rollouts
        if total <= 0.0:
            return np.full(len(g_k), self.delta)
        # per-rollout hazard seen at each rung, the empirical rate kept inside (0, 1)
        theta = sum(n * -math.log1p(-(x + 0.5) / (n + 1.0)) for n, x in zip(n_k, x_k, strict=True))
        theta /= total
        m0 = self.plus.prior_strength
        mean_k = [
            (m0 * -math.expm1(-theta * g) + x) / (m0 + n)
            for g, n, x in zip(g_k, n_k, x_k, strict=True)
        ]
        return isotonic_increasing(mean_k, [n + m0 for n in n_k])

    def trials_by_rung(
        self, lengths_pg: np.ndarray, s_t: float, finished_pg: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(straggled_k, trials_k)`` of one step (lengths ``[P, G]``, observation ``s_t``):
        every rung up to the played G gets one trial per group (scope ``group``; the share of
        the group's consecutive chunks of ``G_k`` rollouts that straggle) or one per step (scope
        ``batch``); larger rungs get none. The played rung's share is ``s_t`` itself. A cut
        step (``finished_pg`` bool ``[P, G]``) reads its chunks as ``censored_straggle`` reads
        groups: a cut chunk counts 1 if it certainly straggles, else its estimated probability."""
        num_groups, g = lengths_pg.shape
        per_step = num_groups if self.scope == "group" else 1
        straggled, trials = np.zeros(self.sizes_k.size), np.zeros(self.sizes_k.size)
        for k, g_k in enumerate(self.candidates):
            if g_k > g:
                break
            trials[k] = per_step
            chunks = g // g_k
            if g_k == g:
                straggled[k] = s_t * per_step
                continue
            if self.scope == "group":
                shape = (num_groups * chunks, g_k)
                sub = lengths_pg[:, : chunks * g_k].reshape(shape)
            else:  # batch: chunk c of every group together is one step of G_k
                shape = (num_groups, chunks, g_k)
                sub = lengths_pg[:, : chunks * g_k].reshape(shape)
                sub = sub.transpose(1, 0, 2).reshape(chunks, num_groups * g_k)
            if finished_pg is None and self.straggle_test is not None:  # scope group
                chunk_c = np.split(lengths_pg[:, : chunks * g_k], chunks, axis=1)
                judged = [self.straggle_test.straggling(c, self.tau).sum() for c in chunk_c]
                straggled[k] = sum(judged) / chunks  # each chunk read as a step at G_k
                continue
            if finished_pg is None:
                straggled[k] = np.count_nonzero(group_ratios(sub) > self.tau) / chunks
                continue
            done = finished_pg[:, : chunks * g_k].reshape(shape)
            if self.scope == "batch":
                done = done.transpose(1, 0, 2).reshape(chunks, num_groups * g_k)
            straggled[k] = censored_straggle(sub, done, self.tau)[0].sum() / chunks
        return straggled, trials

    def _plan(self) -> tuple[np.ndarray, int, int, float]:
        """``(estimate, lo, hi, share_hi)`` of the current counts (kept until they change)."""
        if self._cached_plan is None:
            p_k = self.estimate()
            self._cached_plan = (p_k, *best_mixture(p_k, self.utility, self.delta))
        return self._cached_plan

    # ------------------------------------------------------------------ decisions

    def _decide(self) -> int:
        if self.step == 0:
            return self.candidates[self.rung]
        _, lo, hi, _ = self._plan()
        r, b, h = self.rung, self.slack, self.plus.hysteresis
        if r == hi and hi != lo:
            if b <= -h:  # the budget is spent: back to the rung within it
                r = lo
        elif r == lo:
            if b <= -h and r > 0:  # the estimate allows lo, the realised rate does not
                r -= 1
            elif b >= h and hi != lo:  # budget saved up: spend it on the larger G
                r = hi
        elif r < lo:  # the estimate says a larger G fits; go once the budget is not in debt
            if b >= 0:
                r = lo
        else:  # the estimate rules r out (over the budget, or off the best mixture)
            r = hi if b > 0 else lo
        return self.candidates[r]

    def _learn(
        self, group_size: int, s_t: float, lengths_pg: np.ndarray, finished_pg=None
    ) -> dict[str, Any]:
        plus = self.plus
        straggled, trials = self.trials_by_rung(lengths_pg, s_t, finished_pg)
        self.straggled = plus.trial_gamma * self.straggled + straggled
        self.trials = plus.trial_gamma * self.trials + trials
        scale = np.minimum(1.0, plus.memory / np.maximum(self.trials, 1e-12))
        self.straggled *= scale
        self.trials *= scale
        h = plus.hysteresis
        self.slack = min(max(self.slack + self.delta - s_t, -h), h)
        self.rung = self.candidates.index(group_size)
        self._cached_plan = None
        p_k, lo, hi, _ = self._plan()
        price = 0.0 if lo == hi else (self.utility[hi] - self.utility[lo]) / (p_k[hi] - p_k[lo])
        return {
            "lambda": float(price),
            "posterior_mean": p_k,
            "slack": self.slack,
        }

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "straggled": self.straggled.copy(),
            "trials": self.trials.copy(),
            "slack": self.slack,
            "rung": self.rung,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.straggled = np.array(state["straggled"], dtype=np.float64)
        self.trials = np.array(state["trials"], dtype=np.float64)
        self.slack = float(state["slack"])
        self.rung = int(state["rung"])
        self._cached_plan = None
