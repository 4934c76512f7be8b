"""The value-aware controller: SAGC+'s straggler budget, G chosen for learning signal per second.

SAGC and SAGC+ maximise ``log2 G`` under the straggler budget: they assume a larger group is
always worth more and learn only what it costs. This controller (``controller.kind:
sagc_value``) also learns what a group of G is worth, from the rewards of the step, and plays
the rung with the most learning signal per second of modeled step time among the rungs SAGC+'s
budget allows (docs/controller.md, "The value-aware controller"):

- **Budget: SAGC+'s.** It is a :class:`SAGCPlusController`: the same straggle counts, tail
  model, slack and rung logic (``controller.sagc_plus``). Each step SAGC+'s choice is the
  *ceiling*; only that rung or a smaller one is played. Straggling cannot fall as G grows, so a
  smaller rung never spends more of the budget than SAGC+'s own choice.
- **Signal of a group of G**: ``v(G) = P_nz(G) (1 - 1/G)``. ``P_nz(G)``, the probability that
  a group's rewards are not all equal, is the chance that it has any GRPO advantage at all (a
  group whose rewards are equal contributes no gradient); ``1 - 1/G`` is what the group's size
  adds to the expected policy gradient of a prompt with a group-mean baseline (each rollout's
  own reward is in its baseline: ``E[(r_i - mean r) grad log pi_i] = (1 - 1/G) grad J``).
  With dense rewards ``P_nz`` is near 1 at every rung and ``v`` grows little with G; with sparse
  ones (success rate p: ``P_nz = 1 - p^G - (1-p)^G``) a larger group is the only way to get any.
- **P_nz learned as SAGC+ learns straggling**: every kept group of a step is one trial of its
  rung and, through its consecutive chunks of ``G'`` rollouts (i.i.d. given the prompt), of
  every smaller rung; counts forgotten by ``gamma`` per step. A success model, a Beta
  distribution of per-prompt success rates fitted by moments to the groups' success shares
  (``reward > success_threshold``; pooled mean with half a success of prior), gives each rung
  ``prior_strength`` pseudo-groups of ``1 - E[p^G] - E[(1-p)^G]``, the only evidence a rung
  above the played one has; the estimate is then made non-decreasing in G.
- **Cost**: the modeled seconds of a step at each rung, ``step_seconds(lengths_pg,
  signal_p)`` (the trainer and the simulator give the roofline step-time model of
  ``sim/steptime.py``, rollouts compacting plus the update), on the lengths and rewards the
  controller sees: the played step's own, and for a smaller rung the step's chunks of ``G'``
  rollouts (a step at ``G'``, in distribution). ``signal_p`` marks the groups whose rewards are
  not all equal: where the update trains only those (``train.drop_no_signal``), a group without
  signal costs its rollouts only, so where signal is rare a larger G costs little more than its
  decoding. Step times swing with the step's prompts far more than their ratios between rungs
  do, and only the ratios decide, so the controller learns the ratio of each rung's expected time
  to the rung below's as a ratio of sums over the steps that timed both (forgotten by ``gamma``):
  the ratio of expected seconds, which signal per second needs, where a mean of per-step ratios
  would miss the rare step whose straggler only the larger rung drew. A rung not timed by a
  step keeps what it learned. A rung above the played one is timed on the step's lengths
  repeated to ``G'`` per group (a lower bound: the same longest completion, more rows, the same
  groups with signal); a rung never timed is priced by that bound alone, so it looks cheap and
  is tried when the budget allows it, and a rung timed once by its ratio of sums alone (a low
  bound kept beside the measurements made a larger rung look cheaper than it is for good).
- **Decision**: ``k* = argmax_{k <= ceiling} v_k / seconds_k``; it is played when it beats the
  signal per second of the rung played last (or of the ceiling, when the budget no longer
  allows that rung) by more than ``min_gain`` (relative), otherwise that rung is played again:
  ``min_gain`` is a hysteresis against the noise of the estimates, with no preference for the
  larger G. Before any reward is seen, or when no observation carries rewards, it is SAGC+
  exactly.

Deterministic (no random generator); ``state_dict()`` holds SAGC+'s state and the signal
counts, the success moments and the step-time sums. ``step_seconds`` is configuration,
not state: give the restored controller the same one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from sagc_jax.config import ControllerConfig, SAGCPlusConfig, SAGCValueConfig
from sagc_jax.controller.sagc_plus import SAGCPlusController, isotonic_increasing
from sagc_jax.controller.step import varied_groups

# (lengths [P, G], signal_p: bool [P] or None) -> modeled seconds of the step
StepSeconds = Callable[[np.ndarray, np.ndarray | None], float]

_MAX_CHUNKS = 4  # chunks of a smaller rung timed per step: a few give its cost in distribution


def decode_slots(lengths_pg: np.ndarray, signal_p: np.ndarray | None = None) -> float:
    """The default cost when no step-time model is given: rows x the longest completion, the
    decode slots of a synchronous rollout (only ratios between rungs matter; no update, so
    ``signal_p`` changes nothing)."""
    return float(lengths_pg.size) * float(lengths_pg.max(initial=1))


def beta_moment(mean: float, var: float, n: int) -> float:
    """``E[p^n]`` for p with the given mean and variance, as a Beta distribution (var <= 0:
    p = mean everywhere; var is kept below ``mean (1 - mean)``)."""
    if var <= 0.0 or mean <= 0.0 or mean >= 1.0:
        return mean**n
    var = min(var, 0.999 * mean * (1.0 - mean))
    conc = mean * (1.0 - mean) / var - 1.0
    a, total = mean * conc, conc
    out = 1.0
    for i in range(n):
        out *= (a + i) / (total + i)
    return out


def _below(seconds_k: np.ndarray) -> np.ndarray:
    """Per rung, the seconds of the rung below it (1 below the smallest: its entry of a ratio
    is its own seconds)."""
    return np.concatenate([[1.0], seconds_k[:-1]])


class SAGCValueController(SAGCPlusController):
    """SAGC+'s budget, G for signal per second; see the module docstring.

    ``budget``: ``controller.*``; ``plus``: SAGC+'s knobs (``controller.sagc_plus``), which keep
    the budget; ``value``: ``controller.sagc_value``; ``step_seconds``: modeled seconds of a
    step from its lengths ``[P, G]`` and its groups with signal (None: :func:`decode_slots`).
    """

    reward_aware = True
    weighs_step_time = True
    # what a group of each G is worth, what a step at each G costs, SAGC+'s rung
    logged_metrics = (
        *SAGCPlusController.logged_metrics,
        "signal",
        "step_seconds",
        "ceiling_group_size",
    )

    def __init__(
        self,
        budget: ControllerConfig | None = None,
        plus: SAGCPlusConfig | None = None,
        value: SAGCValueConfig | None = None,
        step_seconds: StepSeconds | None = None,
    ) -> None:
        super().__init__(budget, plus)
        self.value = value or SAGCValueConfig()
        self.step_seconds = step_seconds or decode_slots
        k = len(self.candidates)
        self.signal = np.zeros(k)  # effective groups whose rewards were not all equal, per rung
        self.groups = np.zeros(k)  # effective groups, per rung
        # success model: decayed [groups, sum share, sum share^2, sum 1/G, successes, rollouts]
        self.success = np.zeros(6)
        # decayed sums over the steps that timed rung k and the rung below it: of rung k's
        # seconds and of the rung below's ([0]: the smallest rung's seconds and the steps)
        self.seconds_sum = np.zeros(k)
        self.below_sum = np.zeros(k)
        self.last_seconds = np.zeros(k)  # the last step's seconds per rung (bounds above it)
        self.ceiling = self.rung  # SAGC+'s rung at the last decision
        self._step_rewards_pg = None  # the observed step's rewards, for its timing only

    # ------------------------------------------------------------------ estimates

    def success_model(self) -> np.ndarray:
        """``1 - E[p^G] - E[(1-p)^G]`` per rung under the fitted Beta of per-prompt success
        rates; float64 ``[K]``."""
        groups, s1, s2, inv_g, succ, rollouts = self.success.tolist()
        mean = (succ + 0.5) / (rollouts + 1.0)
        var = 0.0
        if groups > 0.0:
            share, inv = s1 / groups, inv_g / groups
            spread = s2 / groups - share * share  # per-prompt variance + binomial noise
            var = (spread - share * (1.0 - share) * inv) / max(1.0 - inv, 1e-12)
        return np.array(
            [
                1.0 - beta_moment(mean, var, g) - beta_moment(1.0 - mean, var, g)
                for g in self.candidates
            ]
        )

    def signal_probability(self) -> np.ndarray:
        """``P_nz`` per rung: success-model prior + the rung's counts, non-decreasing in G;
        float64 ``[K]``."""
        m0 = self.value.prior_strength
        model_k = self.success_model()
        mean_k = (m0 * model_k + self.signal) / (m0 + self.groups)
        return isotonic_increasing(mean_k.tolist(), (self.groups + m0).tolist())

    def seconds(self) -> np.ndarray:
        """Estimated modeled seconds of a step at each rung (0 before any step); ``[K]``."""
        if self.below_sum[0] <= 0.0:
            return np.zeros(len(self.candidates))
        timed = self.below_sum > 0.0  # a rung never timed: the last step's bound alone
        ratio = np.where(
            timed,
            self.seconds_sum / np.where(timed, self.below_sum, 1.0),
            self.last_seconds / _below(self.last_seconds),
        )
        return np.cumprod(ratio)

    def signal_per_second(self) -> np.ndarray:
        """``v(G) / seconds(G)`` per rung (0 before any step); ``[K]``."""
        v_k = self.signal_probability() * (1.0 - 1.0 / self.sizes_k)
        seconds = self.seconds()
        return v_k / seconds if self.below_sum[0] > 0.0 else np.zeros_like(v_k)

    # ------------------------------------------------------------------ decisions

    def _decide(self) -> int:
        ceiling = self.candidates.index(super()._decide())
        self.ceiling = ceiling
        if self.step == 0 or self.success[0] <= 0.0:
            return self.candidates[ceiling]  # no signal seen yet: SAGC+
        rate_k = self.signal_per_second()[: ceiling + 1].tolist()
        current = min(self.rung, ceiling)  # the rung played last, if the budget still allows it
        best = max(range(ceiling + 1), key=lambda k: (rate_k[k], k))
        if rate_k[best] > (1.0 + self.value.min_gain) * rate_k[current]:
            return self.candidates[best]
        return self.candidates[current]

    # ------------------------------------------------------------------ observation

    def _learn_rewards(self, rewards_pg: np.ndarray, finished_pg: np.ndarray | None) -> None:
        """Signal trials of every rung up to the played G, and the success moments, from the
        groups whose rollouts all finished (a cut group's rewards are of unfinished text)."""
        self._step_rewards_pg = rewards_pg
        gamma = self.value.gamma
        kept = rewards_pg if finished_pg is None else rewards_pg[finished_pg.all(axis=1)]
        num_groups, g = kept.shape
        self.signal *= gamma
        self.groups *= gamma
        self.success *= gamma
        if num_groups == 0:
            return
        for k, g_k in enumerate(self.candidates):
            if g_k > g:
                break
            chunks = g // g_k
            sub = kept[:, : chunks * g_k].reshape(num_groups * chunks, g_k)
            self.signal[k] += np.count_nonzero(varied_groups(sub)) / chunks
            self.groups[k] += num_groups
        share_p = (kept > self.value.success_threshold).mean(axis=1)
        self.success += [
            num_groups,
            share_p.sum(),
            (share_p * share_p).sum(),
            num_groups / g,
            share_p.sum() * g,
            num_groups * g,
        ]

    def _learn(
        self, group_size: int, s_t: float, lengths_pg: np.ndarray, finished_pg=None
    ) -> dict[str, Any]:
        metrics = super()._learn(group_size, s_t, lengths_pg, finished_pg)
        self._learn_seconds(lengths_pg, self._step_rewards_pg)
        self._step_rewards_pg = None
        return {
            **metrics,
            "ceiling_group_size": self.candidates[self.ceiling],
            "signal": self.signal_probability(),
            "step_seconds": self.seconds(),
        }

    def _learn_seconds(self, lengths_pg: np.ndarray, rewards_pg: np.ndarray | None) -> None:
        """This step's seconds at each rung from its lengths and rewards (None: every group
        counts as having signal), added to the sums of the rungs it timed: measured where the
        rung is at most the played G (its chunks, each with its own groups with signal), a lower
        bound above it (``last_seconds`` only)."""
        gamma = self.value.gamma
        g = lengths_pg.shape[1]

        def seconds(columns) -> float:
            lengths = lengths_pg[:, columns]
            if rewards_pg is None:
                return self.step_seconds(lengths, None)
            rewards = rewards_pg[:, columns]
            return self.step_seconds(lengths, varied_groups(rewards))

        t_k = []
        for g_k in self.candidates:
            if g_k <= g:
                chunks = min(g // g_k, _MAX_CHUNKS)
                t = sum(seconds(slice(c * g_k, (c + 1) * g_k)) for c in range(chunks))
                t_k.append(t / chunks)
            else:
                tiled = np.arange(g_k) % g  # the step's columns repeated to g_k
                t_k.append(seconds(tiled))
        t_k = np.array(t_k)
        self.last_seconds = t_k
        measured = self.sizes_k <= g
        self.seconds_sum[measured] *= gamma  # a rung not timed keeps what it learned
        self.below_sum[measured] *= gamma
        self.seconds_sum[measured] += t_k[measured]
        self.below_sum[measured] += _below(t_k)[measured]

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "signal": self.signal.copy(),
            "groups": self.groups.copy(),
            "success": self.success.copy(),
            "seconds_sum": self.seconds_sum.copy(),
            "below_sum": self.below_sum.copy(),
            "last_seconds": self.last_seconds.copy(),
            "ceiling": self.ceiling,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The state of :meth:`state_dict`. A state saved before the step times were learned as
        ratios of sums (``log_ratio``, ``timed``, ``log_bound``) restores all but them: they are
        learned again from the next step (until then the controller plays SAGC+'s rung)."""
        super().load_state_dict(state)
        for key in ("signal", "groups", "success"):
            setattr(self, key, np.array(state[key], dtype=np.float64))
        relearn = "log_ratio" in state  # the old format's timings: learned again
        for key in ("seconds_sum", "below_sum", "last_seconds"):
            k = len(self.candidates)
            setattr(self, key, np.zeros(k) if relearn else np.array(state[key], dtype=np.float64))
        self.ceiling = int(state["ceiling"])
