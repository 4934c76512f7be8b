"""Prompt-aware hybrid controller: SAGC plus a per-prompt straggle predictor (numpy only).

SAGC reacts only to observed lengths; RL revisits every prompt once per epoch, so each prompt's
own history predicts its next group. This controller keeps SAGC's ladder, utility ``log2 G``,
straggler budget ``delta``, dual variable ``lambda``, per-candidate Beta posteriors and
Thompson draws (it subclasses :class:`SAGCController`), and adds a
:class:`~sagc_jax.controller.predictor.StragglePredictor` that gives every prompt of the step a
straggle probability ``r_p(G)`` at every candidate (per-prompt history, then its feature bin,
then the global rate).

Modes (``controller.hybrid.mode``):

``step``  one G per step, as SAGC. The Thompson draw for each candidate G within ``radius`` is
    ``p~_G ~ Beta(alpha_G + c m_G, beta_G + c (1 - m_G))`` where ``m_G`` is the mean predicted
    straggle probability of the step's prompts at G and ``c = prediction_weight`` (pseudo-steps
    the prediction is worth); play ``argmax u(G) - lambda p~_G``. ``c = 0``, or no prompts, is
    SAGC exactly.
``per_prompt``  every prompt gets its own size from the ladder, the sizes summing to a budget
    of B rows (static shapes): :func:`~sagc_jax.controller.allocation.allocate` maximises
    ``sum_p log2 G_p - lambda r_p(G_p)`` greedily, so risky prompts get smaller groups and safe
    ones larger. ``rows_per_step > 0`` fixes B; ``0`` makes B = P x G_t where the budget level
    G_t is chosen each step among the candidates by the rule of ``step`` mode, with the
    allocation's mean utility and mean predicted risk at each level (one rollout shape per
    candidate, as SAGC). ``s_t`` is still the fraction of straggling groups.

Trainer protocol::

    ctrl = HybridController(cfg.controller, cfg.controller.hybrid)
    decision = ctrl.propose_for(prompt_ids, prompt_lengths, difficulty=None)
    # step:       decision is an int G; generate P x G rollouts, lengths [P, G]
    # per_prompt: decision is int64 [P] of sizes, sum == B; generate sizes[p] rollouts of
    #             prompt p, lengths flat [B] group by group (or padded [P, max G], or a list)
    obs = StepObservation.of_rollouts(lengths, group_sizes, rewards=rewards, prompt_ids=ids)
    metrics = ctrl.observe(obs)

``prompt_ids``: int64 ``[P]`` stable across epochs and processes (e.g. the dataset row);
``prompt_lengths``: prompt tokens ``[P]`` (None or -1: unknown); ``difficulty``: optional float
``[P]`` in [0, 1] (nan or < 0: unknown). The observation's sizes must be the proposed ones and
its prompt ids (optional) the proposed prompts; its rewards (optional) feed the per-prompt pass
rate (reward >= 1). Repeated ``propose_for`` calls with the same prompts before ``observe``
return the same decision. In ``step`` mode ``propose()`` and an observation without prompt ids
still work (plain SAGC draws, only the global tail rate learns). Metrics add ``predicted_s_t``
(the step's mean predicted straggle, made before its lengths were seen),
``predicted_straggle`` (mean prediction per candidate at decision time), ``group_sizes``
(per_prompt) and ``prompts_tracked``; ``calibration()`` gives the binned
predicted-against-observed summary. Multi-host: give every process the same (all-gathered)
prompts and lengths, or decide on process 0 and broadcast.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sagc_jax.config import ControllerConfig, HybridConfig
from sagc_jax.controller.allocation import allocate, check_budget
from sagc_jax.controller.observation import observation_from_ratios, ragged_median_ratio
from sagc_jax.controller.predictor import StragglePredictor
from sagc_jax.controller.sagc import SAGCController
from sagc_jax.controller.step import StepObservation, check_observation


class HybridController(SAGCController):
    """SAGC with per-prompt straggle predictions; see the module docstring.

    ``budget``: the ladder, the straggler definition, the budget delta and the first G
    (``controller.*``); ``hybrid``: its own knobs, SAGC's among them (``controller.hybrid``).
    """

    prompt_aware = True

    def __init__(
        self, budget: ControllerConfig | None = None, hybrid: HybridConfig | None = None
    ) -> None:
        self.hybrid = hybrid or HybridConfig()
        super().__init__(budget, self.hybrid)
        self.mode = self.hybrid.mode
        gamma = self.hybrid.posterior_gamma
        self.predictor = StragglePredictor(self.hybrid, self.candidates, gamma)
        self.rows_sum = 0
        self.groups_sum = 0
        self._prompts: dict[str, Any] | None = None  # the pending step's prompts
        self._sizes: np.ndarray | None = None  # per_prompt: the pending sizes
        self._arm: int | None = None  # per_prompt: the pending budget level G (None: fixed B)
        self._predicted = np.full(len(self.candidates), np.nan)  # m_G at the last decision

    # ------------------------------------------------------------------ decisions

    def propose(self) -> int:
        """``step`` mode without prompts: plain SAGC. ``per_prompt`` needs :meth:`propose_for`."""
        if self.mode == "per_prompt":
            raise RuntimeError(
                "controller.hybrid.mode = per_prompt needs the step's prompts: call "
                "propose_for(prompt_ids, prompt_lengths) instead of propose()"
            )
        return super().propose()

    def propose_for(self, prompt_ids, prompt_lengths=None, difficulty=None) -> int | np.ndarray:
        """The next step's decision for these prompts: an int G (``step``) or int64 ``[P]``
        sizes summing to the budget (``per_prompt``); see the module docstring."""
        prompts = _check_prompts(prompt_ids, prompt_lengths, difficulty)
        if self._pending is not None or self._sizes is not None:
            if self._prompts is None or not _same_prompts(prompts, self._prompts):
                raise RuntimeError(
                    "propose_for() called with other prompts (or after propose()) before "
                    "observe() of the proposed step"
                )
            return self._decision()
        if self.mode == "per_prompt" and self.hybrid.rows_per_step:
            check_budget(self.hybrid.rows_per_step, prompts["ids"].size, self.candidates)
        self._prompts = prompts
        try:
            if self.mode == "step":
                self._pending = int(self._decide())
            else:
                self._arm, self._sizes = self._decide_sizes()
        except ValueError:
            self._prompts = None
            raise
        return self._decision()

    def _decision(self) -> int | np.ndarray:
        return self._pending if self.mode == "step" else self._sizes.copy()

    def _risk(self) -> np.ndarray:
        """Predicted straggle probability of the pending prompts at every candidate ``[P, K]``."""
        p = self._prompts
        if p.get("risk") is None:  # cached until observe(): the table does not change before
            p["slots"] = self.predictor.stats.lookup(p["ids"])
            p["risk"] = self.predictor.straggle_probability(
                p["ids"], p["lengths"], p["difficulty"], p["slots"]
            )
        return p["risk"]

    def _decide(self) -> int:
        if self._prompts is None:
            return super()._decide()
        risk_pk = self._risk()
        self._predicted = risk_pk.mean(axis=0)
        if self.step == 0 or self.hybrid.prediction_weight == 0:
            return super()._decide()
        lo, hi = self._window()
        w = slice(lo, hi + 1)
        best = self._pick(lo, hi, self.utility[w], self._predicted[w])
        return self.candidates[best]

    def _pick(self, lo: int, hi: int, utility, predicted) -> int:
        """Thompson pick with each candidate's Beta shifted toward the predicted probability."""
        c = self.hybrid.prediction_weight
        w = slice(lo, hi + 1)
        alpha = self.alpha[w] + c * predicted
        beta = self.beta[w] + c * (1.0 - predicted)
        return self._thompson_pick(lo, hi, utility, alpha, beta)

    def _decide_sizes(self) -> tuple[int | None, np.ndarray]:
        g_k = np.asarray(self.candidates, dtype=np.int64)
        risk_pk = self._risk()
        num_p = risk_pk.shape[0]
        value_pk = self.utility[None, :] - self.lam * risk_pk
        self._predicted = risk_pk.mean(axis=0)
        if self.hybrid.rows_per_step:
            return None, g_k[allocate(value_pk, self.candidates, self.hybrid.rows_per_step)]
        if self.step == 0:
            arm = self.rung
            rung_p = allocate(value_pk, self.candidates, num_p * int(g_k[arm]))
            return self.candidates[arm], g_k[rung_p]
        lo, hi = self._window()
        rows = np.arange(num_p)
        allocs = [
            allocate(value_pk, self.candidates, num_p * int(g_k[k])) for k in range(lo, hi + 1)
        ]
        utility = [float(self.utility[r].mean()) for r in allocs]
        predicted = np.array([risk_pk[rows, r].mean() for r in allocs])
        arm = self._pick(lo, hi, utility, predicted)
        return self.candidates[arm], g_k[allocs[arm - lo]]

    # ------------------------------------------------------------------ observation

    def observe(self, obs: StepObservation) -> dict[str, Any]:
        """Record the proposed step from its :class:`~sagc_jax.controller.step.StepObservation`
        (the ragged view: ``lengths_b`` and ``sizes_p``; ``rewards_b`` and ``prompt_ids_p`` when
        given).

        Raises TypeError if ``obs`` is not a StepObservation, RuntimeError if nothing was
        proposed, ValueError if the sizes, the number of groups or the prompt ids differ from
        the proposal or the step was cut by tail batching (nothing is changed then).
        """
        check_observation(obs)
        if self._pending is None and self._sizes is None:
            raise RuntimeError(
                "observe() called before propose_for(); call propose_for() for the step"
            )
        if self.mode == "step" and obs.group_size is not None:
            obs.lengths_pg(expected_group_size=self._pending)  # SAGC's message
        flat_b, sizes_p = obs.lengths_b, obs.sizes_p
        expected = (
            self._sizes if self.mode == "per_prompt" else np.full_like(sizes_p, self._pending)
        )
        if not np.array_equal(sizes_p, expected):
            raise ValueError(
                f"observed group sizes {sizes_p.tolist()} differ from the proposed "
                f"{expected.tolist()}; observe the lengths of the step that used the proposal"
            )
        if obs.cut:
            raise ValueError(
                "the hybrid controller reads whole groups only: a step cut by tail batching "
                "(finished False somewhere) cannot be observed"
            )
        prompts = self._prompts
        if obs.prompt_ids_p is not None:
            ids = obs.prompt_ids_p
            if prompts is None:
                prompts = _check_prompts(ids, None, None)
            elif not np.array_equal(ids, prompts["ids"]):
                raise ValueError("prompt_ids differ from the prompts given to propose_for()")
        if prompts is not None and prompts["ids"].size != sizes_p.size:
            raise ValueError(
                f"{sizes_p.size} groups observed for {prompts['ids'].size} proposed prompts"
            )
        pass_rate_p = None if obs.rewards_b is None else _pass_rates(obs.rewards_b, sizes_p)
        median_p, ratio_p = ragged_median_ratio(flat_b, sizes_p)
        straggle_p = ratio_p > self.tau
        s_t = observation_from_ratios(flat_b, ratio_p, self.tau, self.scope)
        group_b = np.repeat(np.arange(sizes_p.size), sizes_p)
        tail_b = flat_b / np.maximum(1.0, median_p)[group_b] > self.tau  # as ratio > tau
        tails_p = np.bincount(group_b, weights=tail_b, minlength=sizes_p.size)
        predicted_p = None
        if prompts is not None and prompts.get("risk") is not None:
            rung_p = np.searchsorted(self.candidates, sizes_p)
            predicted_p = prompts["risk"][np.arange(sizes_p.size), rung_p]
        learned = self.predictor.update(
            self.step,
            tails_p,
            sizes_p,
            straggle_p,
            prompts,
            median_p,
            ratio_p,
            pass_rate_p,
            predicted_p,
        )
        arm = self._pending if self.mode == "step" else self._arm
        extra = self._learn(arm, s_t)
        self.rows_sum += int(flat_b.size)
        self.groups_sum += int(sizes_p.size)
        extra.update(learned)
        extra["predicted_straggle"] = self._predicted.copy()
        extra["prompts_tracked"] = len(self.predictor.stats)
        if self.mode == "per_prompt":
            extra["group_sizes"] = sizes_p
        self._prompts, self._sizes, self._arm = None, None, None
        self._predicted = np.full(len(self.candidates), np.nan)
        metrics = self._finish(arm, s_t, flat_b, ratio_p, extra)
        metrics["mean_group_size"] = self.rows_sum / self.groups_sum
        return metrics

    def calibration(self) -> dict[str, Any]:
        """Binned predicted against observed straggle; see ``StragglePredictor.calibration``."""
        return self.predictor.calibration()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        p = self._prompts
        empty_i, empty_f = np.zeros(0, dtype=np.int64), np.zeros(0)
        return {
            **super().state_dict(),
            "mode": self.mode,
            "rows_sum": self.rows_sum,
            "groups_sum": self.groups_sum,
            "pending_ids": empty_i if p is None else p["ids"].copy(),
            "pending_lengths": empty_i if p is None else p["lengths"].copy(),
            "pending_difficulty": empty_f
            if p is None or p["difficulty"] is None
            else p["difficulty"].copy(),
            "pending_has_prompts": int(p is not None),
            "pending_sizes": empty_i if self._sizes is None else self._sizes.copy(),
            "pending_arm": -1 if self._arm is None else self._arm,
            **{f"predictor_{k}": v for k, v in self.predictor.state_dict().items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") == type(self).__name__ and str(state["mode"]) != self.mode:
            raise ValueError(
                f"saved hybrid controller mode {str(state['mode'])!r} differs from "
                f"controller.hybrid.mode = {self.mode!r}"
            )
        super().load_state_dict(state)
        self.predictor.load_state_dict(
            {k[len("predictor_") :]: v for k, v in state.items() if k.startswith("predictor_")}
        )
        self.rows_sum = int(state["rows_sum"])
        self.groups_sum = int(state["groups_sum"])
        self._prompts = None
        self._predicted = np.full(len(self.candidates), np.nan)
        if int(state["pending_has_prompts"]):
            ids = np.array(state["pending_ids"], dtype=np.int64)
            diff = np.array(state["pending_difficulty"], dtype=np.float64)
            self._prompts = {
                "ids": ids,
                "lengths": np.array(state["pending_lengths"], dtype=np.int64),
                "difficulty": diff if diff.size == ids.size else None,
            }
            # the cache a live controller holds between propose and observe
            self._predicted = self._risk().mean(axis=0)
        sizes = np.array(state["pending_sizes"], dtype=np.int64)
        self._sizes = sizes if sizes.size else None
        arm = int(state["pending_arm"])
        self._arm = None if arm < 0 else arm


def _check_prompts(prompt_ids, prompt_lengths, difficulty) -> dict[str, Any]:
    ids = np.asarray(prompt_ids)
    if ids.ndim != 1 or ids.size < 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"prompt_ids must be a non-empty 1-D integer array, got {ids!r}")
    n = ids.size
    if prompt_lengths is None:
        lengths = np.full(n, -1, dtype=np.int64)
    else:
        lengths = np.asarray(prompt_lengths)
        if lengths.shape != (n,) or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(
                f"prompt_lengths must be an integer array [{n}] like prompt_ids, got "
                f"shape {lengths.shape} dtype {lengths.dtype}"
            )
    diff = None
    if difficulty is not None:
        diff = np.asarray(difficulty, dtype=np.float64)
        if diff.shape != (n,):
            raise ValueError(f"difficulty must be a float array [{n}], got shape {diff.shape}")
        diff = np.where(np.isnan(diff) | (diff < 0), -1.0, diff)  # -1: unknown
    return {"ids": ids.astype(np.int64), "lengths": lengths.astype(np.int64), "difficulty": diff}


def _same_prompts(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        np.array_equal(a["ids"], b["ids"])
        and np.array_equal(a["lengths"], b["lengths"])
        and (a["difficulty"] is None) == (b["difficulty"] is None)
        and (a["difficulty"] is None or np.array_equal(a["difficulty"], b["difficulty"]))
    )


def _pass_rates(rewards_b: np.ndarray, sizes_p: np.ndarray) -> np.ndarray:
    """Per-group fraction of rewards >= 1; ``rewards_b`` float64 ``[B]``, group by group."""
    group_b = np.repeat(np.arange(sizes_p.size), sizes_p)
    return np.bincount(group_b, weights=rewards_b >= 1.0, minlength=sizes_p.size) / sizes_p
