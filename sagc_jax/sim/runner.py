"""Drive controllers over a workload and summarise what each would have cost."""

from __future__ import annotations

import dataclasses
import math
from collections import deque

import numpy as np

from sagc_jax.config import Config, TailBatchingConfig
from sagc_jax.controller import (
    GroupController,
    StepObservation,
    make_controller,
    varied_groups,
)
from sagc_jax.controller.observation import straggler_observation
from sagc_jax.sim import roofline
from sagc_jax.sim.steptime import REGIMES, StepTimer
from sagc_jax.sim.workload import SyntheticWorkload


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
    tail: dict | None = None  # tail batching: per step arrays (see run_tail_batched)
    signal_share: np.ndarray | None = None  # float [T]: groups whose rewards differ (rewards)

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
            **(tail_summary(self.tail) if self.tail is not None else {}),
            **(self._signal_summary(primary) if self.signal_share is not None else {}),
        }

    def _signal_summary(self, hours_s: float) -> dict:
        """Mean share of groups with a GRPO advantage, and such groups per modeled hour of the
        first regime (``hours_s``: its seconds)."""
        groups = float((self.signal_share * self.num_sequences / self.group_size).sum())
        return {
            "signal_share": float(self.signal_share.mean()),
            "signal_groups_per_h": groups / (hours_s / 3600.0) if hours_s else 0.0,
        }


def tail_summary(tail: dict) -> dict:
    """The tail-batching columns of a run: the controller's mean reading of s_t, the share of
    started prompts deferred, the longest deferral (steps), the long rounds and the prompts
    still waiting at the end."""
    started = int(tail["started"].sum())
    return {
        "read_straggler_rate": float(tail["s_read"].mean()),
        "deferred_share": int(tail["deferred"].sum()) / started if started else 0.0,
        "longest_deferral": int(tail["longest_deferral"]),
        "long_rounds": int(tail["long_round"].sum()),
        "queue_left": int(tail["queue"][-1]),
    }


def _play_step(controller: GroupController, workload, t: int):
    """Decide, generate and observe step ``t``; ``(sizes_p, lengths_b, prompt_tokens, metrics,
    signal_p)``: ``signal_p`` bool [P] the groups whose rewards are not all equal (None: the
    workload has no rewards); a uniform step of a workload with rewards adds their share to the
    metrics (``signal_share``)."""
    ids_p, tokens_p = workload.prompts(t)
    if controller.prompt_aware:
        decision = controller.propose_for(ids_p, tokens_p)
    else:
        decision = controller.propose()
    # one G for the step, or a size per prompt: the first sizes[p] completions of each prompt
    sizes_p = np.broadcast_to(np.asarray(decision, dtype=np.int64), ids_p.shape).copy()
    widest = int(sizes_p.max())
    lengths_pg = workload.lengths(t, widest)
    rewards_pg = workload.rewards(t, widest) if hasattr(workload, "rewards") else None
    obs = StepObservation.of_rollouts(lengths_pg, sizes_p, rewards=rewards_pg, prompt_ids=ids_p)
    metrics = controller.observe(obs)
    signal_p = None if obs.rewards_b is None else varied_groups(obs.rewards_b, sizes_p)
    if signal_p is not None and np.ndim(decision) == 0:
        metrics = {**metrics, "signal_share": float(signal_p.mean())}
    lengths_b = obs.lengths_b
    if np.all(tokens_p == tokens_p[0]):
        tokens = int(tokens_p[0])
    else:
        tokens = np.repeat(tokens_p, sizes_p)
    return sizes_p, lengths_b, tokens, metrics, signal_p


def simulate_controller(
    name: str, controller: GroupController, workload, timer: StepTimer
) -> SimRun:
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
    signal = np.full(steps, np.nan)
    ratios = []
    bootstrapped = 0
    for t in range(steps):
        sizes_p, lengths_b, tokens, m, signal_p = _play_step(controller, workload, t)
        if hasattr(workload, "is_bootstrapped"):
            bootstrapped += workload.is_bootstrapped(t, int(sizes_p.max()))
        seconds = timer(lengths_b, tokens, group_sizes=sizes_p, signal_p=signal_p)
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
        signal[t] = m.get("signal_share", np.nan)
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
        calibration=controller.calibration(),
        signal_share=None if np.isnan(signal).any() else signal,
    )


def run_tail_batched(
    name: str,
    controller: GroupController,
    workload: SyntheticWorkload,
    timer: StepTimer,
    tail: TailBatchingConfig,
) -> SimRun:
    """Play ``controller`` with tail batching (``tail``) for ``workload.num_steps`` steps.

    A step of P = ``sim.prompts_per_step`` draws ``P + ceil(extra P)`` new prompts at the
    proposed G, stops once P groups are whole (``roofline.cut_step``, the sampler's slots),
    trains those and defers the others, oldest first, into a queue; the controller reads the
    cut step (an observation of the reached lengths and the finished flags). A long round (when
    P prompts wait, or every ``long_round_every`` steps while any wait) takes up to P of the
    oldest deferred prompts, draws their rollouts again at the step's drift
    (``SyntheticWorkload.redraw``: a prompt keeps its own length scale and straggle tendency)
    and waits for all of its groups; it draws no new prompt. ``s_t`` is the true straggle share
    of the step's started groups, from their full lengths; ``tail`` holds per step: ``s_read``
    (the controller's reading), ``started``, ``deferred``, ``long_round``, ``queue`` (prompts
    waiting after the step) and ``longest_deferral`` (steps, over the run).
    """
    if controller.prompt_aware:
        raise ValueError("tail batching runs one G per step: the hybrid controller is refused")
    if not isinstance(workload, SyntheticWorkload):
        raise ValueError(
            "tail batching needs the synthetic workload (sim section); a replayed log has no "
            "rollouts for the prompts a step would start beyond it"
        )
    num = workload.cfg.prompts_per_step
    start = num + math.ceil(tail.extra * num)
    fresh = SyntheticWorkload(dataclasses.replace(workload.cfg, prompts_per_step=start))
    slots = timer.engine.settings([1])["slots"]
    steps = workload.num_steps
    queue: deque = deque()  # (prompt step, row, step deferred at)
    drawn = 0  # prompt steps drawn so far
    rec = {key: np.zeros(steps) for key in ("s_read", "started", "deferred", "long_round", "queue")}
    longest = 0
    cols = {key: np.zeros(steps) for key in ("g", "s_t", "lam", "waste", "max_ratio", "mean")}
    seconds_by = {key: np.zeros(steps) for key in (*REGIMES, "update")}
    posterior = np.full((steps, len(controller.candidates)), np.nan)
    ratios, num_sequences = [], np.zeros(steps, dtype=np.int64)
    for t in range(steps):
        g = int(controller.propose())
        every = tail.long_round_every
        if queue and (len(queue) >= num or (every and (t + 1) % every == 0)):
            take = [queue.popleft() for _ in range(min(num, len(queue)))]
            longest = max(longest, *(t - deferred_at for _, _, deferred_at in take))
            lengths_pg = np.concatenate(
                [fresh.redraw(t, origin, [row], g) for origin, row, _ in take]
            )
            tokens_p = np.array([fresh.prompts(origin)[1][row] for origin, row, _ in take])
            m = controller.observe(StepObservation.of_groups(lengths_pg))
            times = timer(lengths_pg, np.repeat(tokens_p, g))
            rec["long_round"][t] = 1
            s_true = m["s_t"]
        else:
            lengths_pg = fresh.lengths_at(drawn, t, g)
            tokens_p = fresh.prompts(drawn)[1]
            groups_r = np.repeat(np.arange(start), g)
            _, reached_r, done_r, kept_g = roofline.cut_step(lengths_pg, groups_r, num, slots)
            rewards_pg = fresh.rewards_at(drawn, t, g)
            obs = StepObservation.of_groups(
                reached_r.reshape(start, g), done_r.reshape(start, g), rewards_pg
            )
            m = controller.observe(obs)
            signal_p = varied_groups(rewards_pg)
            times = timer(lengths_pg, np.repeat(tokens_p, g), keep_groups=num, signal_p=signal_p)
            queue.extend((drawn, int(row), t) for row in np.flatnonzero(~kept_g))
            rec["started"][t], rec["deferred"][t] = start, start - num
            s_true = straggler_observation(lengths_pg, controller.tau, controller.scope)
            drawn += 1
        rec["s_read"][t], rec["queue"][t] = m["s_t"], len(queue)
        cols["g"][t], cols["s_t"][t], cols["lam"][t] = g, s_true, m.get("lambda", 0.0)
        cols["waste"][t], cols["max_ratio"][t] = m["padding_waste"], m["max_ratio"]
        cols["mean"][t] = m["mean_length"]
        num_sequences[t] = lengths_pg.size
        for key, value in times._asdict().items():
            seconds_by[key][t] = value
        if m.get("posterior_mean") is not None:
            posterior[t] = m["posterior_mean"]
        ratios.append(m["group_ratios"])
    if queue:  # prompts still waiting: their wait so far
        longest = max(longest, *(steps - deferred_at for _, _, deferred_at in queue))
    rec["longest_deferral"] = longest
    return SimRun(
        name=name,
        candidates=controller.candidates,
        group_size=cols["g"],
        log2_group_size=np.log2(cols["g"]),
        s_t=cols["s_t"],
        lam=cols["lam"],
        posterior_mean=posterior,
        padding_waste=cols["waste"],
        max_ratio=cols["max_ratio"],
        group_ratios=ratios,
        rollout_seconds={regime: seconds_by[regime] for regime in REGIMES},
        update_seconds=seconds_by["update"],
        mean_length=cols["mean"],
        num_sequences=num_sequences,
        tail=rec,
    )


def compare(cfg: Config, workload, timer: StepTimer) -> list[SimRun]:
    """Run every controller of ``cfg.sim.controllers`` over the same workload (tail-batched
    when ``tail_batching.enabled``; ``run_tail_batched``)."""
    seconds = timer.step_seconds(cfg.sim.prompt_tokens)  # what sagc_value weighs

    def controller(spec: str) -> GroupController:
        return make_controller(spec, cfg.controller, step_seconds=seconds)

    if cfg.tail_batching.enabled:
        return [
            run_tail_batched(spec, controller(spec), workload, timer, cfg.tail_batching)
            for spec in cfg.sim.controllers
        ]
    return [
        simulate_controller(spec, controller(spec), workload, timer) for spec in cfg.sim.controllers
    ]
