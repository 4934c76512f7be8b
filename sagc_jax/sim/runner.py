"""Drive controllers over a workload and summarise what each would have cost."""

from __future__ import annotations

import dataclasses

import numpy as np

from sagc_jax.config import Config
from sagc_jax.controller import GroupController, SAGCController, make_controller
from sagc_jax.sim.steptime import step_seconds


@dataclasses.dataclass
class SimRun:
    """Per-step history of one controller on one workload (arrays indexed by step)."""

    name: str
    candidates: tuple[int, ...]
    group_size: np.ndarray  # int [T]
    s_t: np.ndarray  # float [T]
    lam: np.ndarray  # float [T] (0 for fixed baselines)
    posterior_mean: np.ndarray  # float [T, K] (nan for fixed baselines)
    padding_waste: np.ndarray  # float [T]
    max_ratio: np.ndarray  # float [T], largest group max/median of the step
    group_ratios: list[np.ndarray]  # per step, [num_groups]
    rollout_seconds: np.ndarray  # float [T]
    update_seconds: np.ndarray  # float [T]
    mean_length: np.ndarray  # float [T]
    num_sequences: np.ndarray  # int [T], rollouts generated at each step
    bootstrapped_steps: int = 0

    def summary(self) -> dict:
        """One row of the comparison table."""
        total = float(self.rollout_seconds.sum() + self.update_seconds.sum())
        return {
            "controller": self.name,
            "straggler_rate": float(self.s_t.mean()),
            "mean_G": float(self.group_size.mean()),
            "mean_log2_G": float(np.log2(self.group_size).mean()),
            "rollouts": int(self.num_sequences.sum()),
            "wall_clock_h": total / 3600.0,
            "rollout_share": float(self.rollout_seconds.sum()) / total if total else 0.0,
            "padding_waste": float(self.padding_waste.mean()),
            "bootstrapped_steps": self.bootstrapped_steps,
        }


def run_controller(name: str, controller: GroupController, workload, cfg: Config) -> SimRun:
    """Play ``controller`` for every step of ``workload`` (its ``num_steps``)."""
    steps = workload.num_steps
    k = len(controller.candidates)
    hist = {
        key: np.zeros(steps)
        for key in ("s_t", "lam", "waste", "max_ratio", "rollout", "update", "mean_len")
    }
    group_size = np.zeros(steps, dtype=np.int64)
    num_sequences = np.zeros(steps, dtype=np.int64)
    posterior = np.full((steps, k), np.nan)
    ratios = []
    bootstrapped = 0
    prompt_tokens = getattr(workload, "prompt_tokens_per_step", None)
    for t in range(steps):
        g = controller.propose()
        lengths_pg = workload.lengths(t, g)
        if hasattr(workload, "is_bootstrapped"):
            bootstrapped += workload.is_bootstrapped(t, g)
        m = controller.observe(lengths_pg)
        tokens = prompt_tokens[t] if prompt_tokens is not None else workload.prompt_tokens
        rollout, update = step_seconds(lengths_pg, tokens, cfg.sim)
        group_size[t] = g
        num_sequences[t] = lengths_pg.size
        hist["s_t"][t] = m["s_t"]
        hist["lam"][t] = m.get("lambda", 0.0)
        hist["waste"][t] = m["padding_waste"]
        hist["max_ratio"][t] = m["max_ratio"]
        hist["rollout"][t], hist["update"][t] = rollout, update
        hist["mean_len"][t] = m["mean_length"]
        if isinstance(controller, SAGCController):
            posterior[t] = m["posterior_mean"]
        ratios.append(m["group_ratios"])
    return SimRun(
        name=name,
        candidates=controller.candidates,
        group_size=group_size,
        s_t=hist["s_t"],
        lam=hist["lam"],
        posterior_mean=posterior,
        padding_waste=hist["waste"],
        max_ratio=hist["max_ratio"],
        group_ratios=ratios,
        rollout_seconds=hist["rollout"],
        update_seconds=hist["update"],
        mean_length=hist["mean_len"],
        num_sequences=num_sequences,
        bootstrapped_steps=int(bootstrapped),
    )


def compare(cfg: Config, workload) -> list[SimRun]:
    """Run every controller of ``cfg.sim.controllers`` over the same workload."""
    return [
        run_controller(spec, make_controller(spec, cfg.controller), workload, cfg)
        for spec in cfg.sim.controllers
    ]
