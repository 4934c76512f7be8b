"""Straggle probability of each prompt at each candidate G, from its own history (numpy only).

A rollout is a *tail* when its length exceeds ``tau x max(1, its group's median)``; a group
straggles exactly when it holds at least one tail (max/median > tau). Per prompt p, the
per-rollout tail probability ``q_p`` has a Beta posterior ``Beta(a_p, b_p)`` with mean
``q^_p = a_p / (a_p + b_p)``, and the straggle probability of a group of G rollouts is

    P(straggle at G) = 1 - (1 - q^_p)^G

(approximate: tails are not independent of the median, so ``q`` learned at a small G, whose
median is often pulled up by long failed completions, under-predicts at a large G). The plug-in
mean is used rather than the Beta-binomial predictive ``1 - E[(1 - q)^G]``: the predictive
takes the prior's spread between prompts at face value, and on the simulator's prompt-pool
workload it under-predicted straggling by about 20% where the plug-in is within a few percent.

Hierarchy, each level shrunk toward the next with ``prior_strength`` pseudo-rollouts:
  prompt  a_p = K_p + s q_f,  b_p = (N_p - K_p) + s (1 - q_f)   (K, N: the prompt's decayed
          tail and rollout counts, per visit, from :class:`PromptStats`)
  feature q_f = (K_f + s q_g) / (N_f + s)  pooled over the prompts of the feature bin
          (prompt-length bin x difficulty bin, known before sampling)
  global  q_g = (K_g + 0.05) / (N_g + 1)  pooled over every rollout (a weak prior of one
          rollout at 5% for the very first step)
Feature and global counts decay per step by ``controller.hybrid.posterior_gamma`` (the forgetting
of the hybrid's SAGC posteriors), so they follow the drift of lengths over training. A prompt
never seen predicts its bin's rate; an empty bin, the global one.

The calibration record compares, for every observed group, the prediction made before its
lengths were seen with whether it straggled, binned by predicted probability.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sagc_jax.config import HybridConfig
from sagc_jax.controller.prompt_stats import PromptStats


class StragglePredictor:
    """Per-prompt tail-rate posteriors with feature and global fallbacks, and calibration."""

    def __init__(self, config: HybridConfig, candidates: tuple[int, ...], gamma: float) -> None:
        self.config = config
        self.candidates = np.asarray(candidates, dtype=np.int64)
        self.gamma = float(gamma)
        self.stats = PromptStats(config.capacity, config.decay)
        self.num_length_bins = len(config.length_bins) + 2  # + above the last edge, + unknown
        self.num_difficulty_bins = config.difficulty_bins + 1  # + unknown
        num_bins = self.num_length_bins * self.num_difficulty_bins
        self.bin_tails = np.zeros(num_bins)
        self.bin_rollouts = np.zeros(num_bins)
        self.global_tails = 0.0
        self.global_rollouts = 0.0
        nc = config.calibration_bins
        self.cal_count = np.zeros(nc, dtype=np.int64)
        self.cal_predicted = np.zeros(nc)  # sum of predicted probabilities
        self.cal_observed = np.zeros(nc)  # sum of straggle indicators
        self.cal_squared_error = 0.0

    # ------------------------------------------------------------------ features

    def feature_bins(self, prompt_length_p, difficulty_p=None) -> np.ndarray:
        """Feature bin of every prompt; int64 ``[P]``. Length < 0, difficulty < 0 or nan:
        unknown."""
        length = np.asarray(prompt_length_p, dtype=np.int64)
        lbin = np.searchsorted(np.asarray(self.config.length_bins), length, side="right")
        lbin = np.where(length < 0, self.num_length_bins - 1, lbin)
        nd = self.config.difficulty_bins
        if difficulty_p is None:
            dbin = np.full(length.shape, nd, dtype=np.int64)
        else:
            d = np.asarray(difficulty_p, dtype=np.float64)
            known = ~np.isnan(d) & (d >= 0)
            dbin = np.where(known, np.clip(np.nan_to_num(d) * nd, 0, nd - 1), nd)
            dbin = dbin.astype(np.int64)
        return lbin * self.num_difficulty_bins + dbin

    # ------------------------------------------------------------------ predictions

    @property
    def global_rate(self) -> float:
        """Global per-rollout tail rate ``q_g`` (0.05 before any observation)."""
        return (self.global_tails + 0.05) / (self.global_rollouts + 1.0)

    def bin_rates(self) -> np.ndarray:
        """Per-rollout tail rate of every feature bin, shrunk toward the global rate."""
        s = self.config.prior_strength
        return (self.bin_tails + s * self.global_rate) / (self.bin_rollouts + s)

    def tail_posterior(self, ids_p, prompt_length_p, difficulty_p=None, slots_p=None):
        """``(a_p, b_p)``: Beta posterior of every prompt's per-rollout tail probability.

        ``slots_p``: ``stats.lookup(ids_p)`` if already computed.
        """
        s = self.config.prior_strength
        q_f = self.bin_rates()[self.feature_bins(prompt_length_p, difficulty_p)]
        slots = self.stats.lookup(ids_p) if slots_p is None else slots_p
        tails, rollouts = self.stats.tails_and_rollouts(slots)
        return tails + s * q_f, (rollouts - tails) + s * (1.0 - q_f)

    def straggle_probability(
        self, ids_p, prompt_length_p, difficulty_p=None, slots_p=None
    ) -> np.ndarray:
        """Predicted straggle probability of every prompt at every candidate; ``[P, K]``."""
        a, b = self.tail_posterior(ids_p, prompt_length_p, difficulty_p, slots_p)
        return 1.0 - (1.0 - a / (a + b))[:, None] ** self.candidates[None, :]

    def straggle_at(self, ids_p, prompt_length_p, difficulty_p, sizes_p, slots_p=None):
        """Predicted straggle probability of every prompt at its own group size; ``[P]``."""
        a, b = self.tail_posterior(ids_p, prompt_length_p, difficulty_p, slots_p)
        return 1.0 - (1.0 - a / (a + b)) ** np.asarray(sizes_p)

    # ------------------------------------------------------------------ learning

    def update(
        self,
        step: int,
        tails_p: np.ndarray,
        sizes_p: np.ndarray,
        straggle_p: np.ndarray,
        prompts: dict[str, Any] | None = None,
        median_p: np.ndarray | None = None,
        ratio_p: np.ndarray | None = None,
        pass_rate_p: np.ndarray | None = None,
        predicted_p: np.ndarray | None = None,
    ) -> dict[str, float]:
        """Learn from a step's groups. ``prompts``: ``ids``, ``lengths``, ``difficulty`` and
        optionally ``slots`` (their lookup); None: only the global rate learns.
        ``predicted_p``: the straggle probability predicted for each group at its size, if
        already computed. Returns the step's mean predicted straggle (``predicted_s_t``) when
        prompts are known."""
        out = {}
        if prompts is not None:
            ids, plen, diff = prompts["ids"], prompts["lengths"], prompts["difficulty"]
            slots = prompts.get("slots")
            if slots is None:
                slots = self.stats.lookup(ids)
            predicted = predicted_p
            if predicted is None:
                predicted = self.straggle_at(ids, plen, diff, sizes_p, slots)
            self._calibrate(predicted, straggle_p)
            out["predicted_s_t"] = float(predicted.mean())
            bins = self.feature_bins(plen, diff)
        self.bin_tails *= self.gamma
        self.bin_rollouts *= self.gamma
        self.global_tails = self.gamma * self.global_tails + float(tails_p.sum())
        self.global_rollouts = self.gamma * self.global_rollouts + float(sizes_p.sum())
        if prompts is not None:
            n = self.bin_tails.size
            self.bin_tails += np.bincount(bins, weights=tails_p, minlength=n)
            self.bin_rollouts += np.bincount(bins, weights=sizes_p.astype(np.float64), minlength=n)
            self.stats.update(
                step,
                ids,
                tails_p=tails_p,
                rollouts_p=sizes_p,
                median_p=median_p,
                ratio_p=ratio_p,
                straggle_p=straggle_p,
                prompt_length_p=plen,
                difficulty_p=diff,
                pass_rate_p=pass_rate_p,
                slots_p=slots,
            )
        return out

    def _calibrate(self, predicted_p: np.ndarray, straggle_p: np.ndarray) -> None:
        nc = self.config.calibration_bins
        b = np.minimum((predicted_p * nc).astype(np.int64), nc - 1)
        self.cal_count += np.bincount(b, minlength=nc)
        self.cal_predicted += np.bincount(b, weights=predicted_p, minlength=nc)
        self.cal_observed += np.bincount(b, weights=straggle_p.astype(np.float64), minlength=nc)
        self.cal_squared_error += float(np.sum((predicted_p - straggle_p) ** 2))

    def calibration(self) -> dict[str, Any]:
        """Predicted against observed straggle over every group observed with its prompt.

        ``bins`` (lower edges), ``count``, ``mean_predicted`` and ``observed_rate`` per bin (nan
        when empty), ``ece`` (count-weighted mean of |predicted - observed|), ``brier`` (mean
        squared error of the probability), ``groups``.
        """
        nc = self.config.calibration_bins
        total = int(self.cal_count.sum())
        with np.errstate(invalid="ignore", divide="ignore"):
            pred = self.cal_predicted / self.cal_count
            obs = self.cal_observed / self.cal_count
        gap = np.abs(self.cal_predicted - self.cal_observed).sum()
        return {
            "bins": np.arange(nc) / nc,
            "count": self.cal_count.copy(),
            "mean_predicted": pred,
            "observed_rate": obs,
            "ece": float(gap / total) if total else float("nan"),
            "brier": self.cal_squared_error / total if total else float("nan"),
            "groups": total,
        }

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            **{f"table_{k}": v for k, v in self.stats.state_dict().items()},
            "bin_tails": self.bin_tails.copy(),
            "bin_rollouts": self.bin_rollouts.copy(),
            "global_tails": self.global_tails,
            "global_rollouts": self.global_rollouts,
            "cal_count": self.cal_count.copy(),
            "cal_predicted": self.cal_predicted.copy(),
            "cal_observed": self.cal_observed.copy(),
            "cal_squared_error": self.cal_squared_error,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if np.shape(state["bin_tails"]) != self.bin_tails.shape:
            raise ValueError(
                "saved feature bins differ from controller.hybrid.length_bins / difficulty_bins"
            )
        if np.shape(state["cal_count"]) != self.cal_count.shape:
            raise ValueError(
                "saved calibration bins differ from controller.hybrid.calibration_bins"
            )
        self.stats.load_state_dict(
            {k[len("table_") :]: v for k, v in state.items() if k.startswith("table_")}
        )
        self.bin_tails = np.array(state["bin_tails"], dtype=np.float64)
        self.bin_rollouts = np.array(state["bin_rollouts"], dtype=np.float64)
        self.global_tails = float(state["global_tails"])
        self.global_rollouts = float(state["global_rollouts"])
        self.cal_count = np.array(state["cal_count"], dtype=np.int64)
        self.cal_predicted = np.array(state["cal_predicted"], dtype=np.float64)
        self.cal_observed = np.array(state["cal_observed"], dtype=np.float64)
        self.cal_squared_error = float(state["cal_squared_error"])
