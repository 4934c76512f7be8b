"""Drive controllers over a workload and summarise what each would have cost."""

from __future__ import annotations

import dataclasses

import numpy as np

from sagc_jax.config import Config
from sagc_jax.controller import GroupController, make_controller
from sagc_jax.sim.steptime import REGIMES, StepTimer


@dataclasses.dataclass
class SimRun:
    """Per-step history of one controller on one workload (arrays indexed by step)."""

    name: str
    candidates: tuple[int, ...]
    group_size: np.ndarray  # float [T], rollouts per prompt (the G of a uniform step)
    log2_group_size: np.ndarray  # float [T], mean over the step's groups of log2 G
    s_t: np.ndarray  # float [T]
    lam: np.ndarray  # float [T] (0 for fixed baselines)
    posterior_mean: np.ndarray  # float [T, K] (nan for fixed baselines)
    padding_waste: np.ndarray  # float [T]
    max_ratio: np.ndarray  # float [T], largest group max/median of the step
    group_ratios: list[np.ndarray]  # per step, [num_groups]
    rollout_seconds: dict[str, np.ndarray]  # regime (REGIMES) -> float [T] (StepTimer)
    update_seconds: np.ndarray  # float [T]
    mean_length: np.ndarray  # float [T]
    num_sequences: np.ndarray  # int [T], rollouts generated at each step
    bootstrapped_steps: int = 0
    calibration: dict | None = None  # prompt-aware controllers: predicted vs observed straggle

    def summary(self) -> dict:
        """One row of the comparison table: modeled hours in each rollout regime (``REGIMES``;
        the update alike in all) and the rollout share of the first, the sampler's own."""
        update = float(self.update_seconds.sum())
        total = {regime: float(self.rollout_seconds[regime].sum()) + update for regime in REGIMES}
        primary = total[REGIMES[0]]
        return {
            "controller": self.name,
            "straggler_rate": float(self.s_t.mean()),
            "mean_G": float(self.group_size.mean()),
            "mean_log2_G": float(self.log2_group_size.mean()),
            "rollouts": int(self.num_sequences.sum()),
            **{f"{regime}_h": total[regime] / 3600.0 for regime in REGIMES},
            "rollout_share": (primary - update) / primary if primary else 0.0,
            "padding_waste": float(self.padding_waste.mean()),
            "bootstrapped_steps": self.bootstrapped_steps,
        }


def _play_step(controller: GroupController, workload, t: int):
    """Decide, generate and observe step ``t``; ``(sizes_p, lengths_b, prompt_tokens, metrics)``."""
    ids_p, tokens_p = workload.prompts(t)
    if controller.prompt_aware:
        decision = controller.propose_for(ids_p, tokens_p)
    else:
        decision = controller.propose()
    if np.ndim(decision) == 0:  # one G for the step
        g = int(decision)
        lengths_pg = workload.lengths(t, g)
        sizes_p = np.full(lengths_pg.shape[0], g, dtype=np.int64)
        metrics = controller.observe(lengths_pg)
        lengths_b = lengths_pg.ravel()
    else:  # a size per prompt: the first sizes[p] completions of each prompt
        sizes_p = np.asarray(decision, dtype=np.int64)
        lengths_pg = workload.lengths(t, int(sizes_p.max()))
        lengths_b = lengths_pg[np.arange(lengths_pg.shape[1])[None, :] < sizes_p[:, None]]
        metrics = controller.observe(lengths_b, group_sizes=sizes_p)
    if np.all(tokens_p == tokens_p[0]):
        tokens = int(tokens_p[0])
    else:
        tokens = np.repeat(tokens_p, sizes_p)
    return sizes_p, lengths_b, tokens, metrics


def run_controller(name: str, controller: GroupController, workload, timer: StepTimer) -> SimRun:
    """Play ``controller`` for every step of ``workload`` (its ``num_steps``), each step timed
    by ``timer``.

    A prompt-aware controller gets the step's prompt ids and prompt lengths
    (``workload.prompts``) and may answer a size per prompt; the step then generates the first
    ``sizes[p]`` completions of each prompt and its time follows the longest sequence.
    """
    steps = workload.num_steps
    k = len(controller.candidates)
    hist = {
        key: np.zeros(steps)
        for key in ("g", "log2_g", "s_t", "lam", "waste", "max_ratio", "update", *REGIMES)
    }
    hist["mean_len"] = np.zeros(steps)
    num_sequences = np.zeros(steps, dtype=np.int64)
    posterior = np.full((steps, k), np.nan)
    ratios = []
    bootstrapped = 0
    for t in range(steps):
        sizes_p, lengths_b, tokens, m = _play_step(controller, workload, t)
        if hasattr(workload, "is_bootstrapped"):
            bootstrapped += workload.is_bootstrapped(t, int(sizes_p.max()))
        seconds = timer(lengths_b, tokens, group_sizes=sizes_p)
        hist["g"][t] = lengths_b.size / sizes_p.size
        hist["log2_g"][t] = np.log2(sizes_p).mean()
        num_sequences[t] = lengths_b.size
        hist["s_t"][t] = m["s_t"]
        hist["lam"][t] = m.get("lambda", 0.0)
        hist["waste"][t] = m["padding_waste"]
        hist["max_ratio"][t] = m["max_ratio"]
        for key, value in seconds._asdict().items():
            hist[key][t] = value
        hist["mean_len"][t] = m["mean_length"]
        if m.get("posterior_mean") is not None:
            posterior[t] = m["posterior_mean"]
        ratios.append(m["group_ratios"])
    return SimRun(
        name=name,
        candidates=controller.candidates,
        group_size=hist["g"],
        log2_group_size=hist["log2_g"],
        s_t=hist["s_t"],
        lam=hist["lam"],
        posterior_mean=posterior,
        padding_waste=hist["waste"],
        max_ratio=hist["max_ratio"],
        group_ratios=ratios,
        rollout_seconds={regime: hist[regime] for regime in REGIMES},
        update_seconds=hist["update"],
        mean_length=hist["mean_len"],
        num_sequences=num_sequences,
        bootstrapped_steps=int(bootstrapped),
        calibration=controller.calibration() if controller.prompt_aware else None,
    )


def compare(cfg: Config, workload, timer: StepTimer) -> list[SimRun]:
    """Run every controller of ``cfg.sim.controllers`` over the same workload."""
    return [
        run_controller(spec, make_controller(spec, cfg.controller), workload, timer)
        for spec in cfg.sim.controllers
    ]
