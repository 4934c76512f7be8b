"""SAGC: Straggler-Aware Group Control (host side, numpy only).

Chooses G from a ladder of candidates to maximise ``u(G) = log2 G`` subject to a long-run
straggler constraint ``E[s_t | G_t] <= delta``, through the Lagrangian
``u(G) - lambda * p(G)``. ``p(G)`` has a Beta posterior per candidate with exponential forgetting
(memory about ``1/(1-gamma)`` steps); ``lambda`` follows projected dual ascent. Each step draws
``p~_G`` for the candidates within ``radius`` rungs of the current G (Thompson sampling with local
search) and plays the best; ties go to the current G, then to the smaller G.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sagc_jax.config import ControllerConfig, SAGCConfig
from sagc_jax.controller.base import GroupController

_MASK64 = (1 << 64) - 1


def _pack_rng(rng: np.random.Generator) -> np.ndarray:
    """PCG64 state as uint64 [state_hi, state_lo, inc_hi, inc_lo, has_uint32, uinteger]."""
    st = rng.bit_generator.state
    s, inc = st["state"]["state"], st["state"]["inc"]
    words = [s >> 64, s & _MASK64, inc >> 64, inc & _MASK64, st["has_uint32"], st["uinteger"]]
    return np.array(words, dtype=np.uint64)


def _unpack_rng(words: np.ndarray) -> np.random.Generator:
    w = [int(x) for x in np.asarray(words, dtype=np.uint64)]
    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = {
        "bit_generator": "PCG64",
        "state": {"state": (w[0] << 64) | w[1], "inc": (w[2] << 64) | w[3]},
        "has_uint32": w[4],
        "uinteger": w[5],
    }
    return rng


class SAGCController(GroupController):
    """Straggler-aware group-size controller; see the module docstring.

    ``budget``: the ladder, the straggler definition, the budget delta and the first G
    (``controller.*``); ``config``: SAGC's own knobs (``controller.sagc``).
    """

    logged_metrics = ("posterior_mean",)

    def __init__(
        self, budget: ControllerConfig | None = None, config: SAGCConfig | None = None
    ) -> None:
        budget = budget or ControllerConfig()
        config = config or SAGCConfig()
        super().__init__(budget.candidates, budget.tau, budget.scope)
        self.delta = budget.delta
        self.config = config
        self.utility = np.log2(np.asarray(self.candidates, dtype=np.float64))
        k = len(self.candidates)
        self.alpha = np.full(k, config.alpha0, dtype=np.float64)
        self.beta = np.full(k, config.beta0, dtype=np.float64)
        self.lam = 0.0
        g_init = budget.g_init if budget.g_init is not None else self.candidates[k // 2]
        self.rung = self.candidates.index(g_init)
        self.rng = np.random.Generator(np.random.PCG64(config.seed))

    @property
    def posterior_mean(self) -> np.ndarray:
        """Posterior mean straggler probability per candidate, ``alpha / (alpha + beta)``."""
        return self.alpha / (self.alpha + self.beta)

    def _window(self) -> tuple[int, int]:
        """Rungs ``lo..hi`` (inclusive) within ``radius`` of the current rung."""
        r = self.config.radius
        return max(0, self.rung - r), min(len(self.candidates) - 1, self.rung + r)

    def _thompson_pick(self, lo: int, hi: int, utility, alpha, beta) -> int:
        """Rung maximising ``utility[k] - lambda * p~_k`` with ``p~_k ~ Beta(alpha_k, beta_k)``.

        ``utility``, ``alpha``, ``beta``: length ``hi - lo + 1``, for rungs ``lo..hi``. Ties go to
        the current rung, then to the smaller G.
        """
        p_draw = self.rng.beta(alpha, beta).tolist()
        utility = list(utility)
        return max(
            range(lo, hi + 1),
            key=lambda k: (utility[k - lo] - self.lam * p_draw[k - lo], k == self.rung, -k),
        )

    def _decide(self) -> int:
        if self.step == 0:
            return self.candidates[self.rung]
        lo, hi = self._window()
        window = slice(lo, hi + 1)
        best = self._thompson_pick(
            lo, hi, self.utility[window].tolist(), self.alpha[window], self.beta[window]
        )
        return self.candidates[best]

    def _learn(
        self, group_size: int | None, s_t: float, lengths_pg=None, finished_pg=None
    ) -> dict[str, Any]:
        """Decay every arm toward its prior, add ``s_t`` to the arm played (None: no arm, as
        with a fixed rollout budget) and take the dual step; the lengths are not used."""
        cfg = self.config
        self.alpha = cfg.alpha0 + cfg.posterior_gamma * (self.alpha - cfg.alpha0)
        self.beta = cfg.beta0 + cfg.posterior_gamma * (self.beta - cfg.beta0)
        if group_size is not None:
            played = self.candidates.index(group_size)
            self.alpha[played] += s_t
            self.beta[played] += 1.0 - s_t
            self.rung = played
        self.lam = min(max(self.lam + cfg.eta * (s_t - self.delta), 0.0), cfg.lambda_max)
        return {"lambda": self.lam, "posterior_mean": self.posterior_mean.copy()}

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "alpha": self.alpha.copy(),
            "beta": self.beta.copy(),
            "lambda": self.lam,
            "rung": self.rung,
            "rng": _pack_rng(self.rng),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.alpha = np.array(state["alpha"], dtype=np.float64)
        self.beta = np.array(state["beta"], dtype=np.float64)
        self.lam = float(state["lambda"])
        self.rung = int(state["rung"])
        self.rng = _unpack_rng(state["rng"])
