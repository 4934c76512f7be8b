"""The value-aware controller against an oracle of signal per second, on worlds of known
straggler rates and known success rates.

A world pairs a straggler world (``sim.worlds.TailWorld``: q, the mean per-rollout tail
probability, known per-G straggle rates) with a reward world: prompt p of step t succeeds with
probability ``p_p ~ Beta(c mu_t, c (1 - mu_t))``, each rollout independently (common random
numbers: the first G rewards of a prompt do not depend on G). Reward worlds:

- dense: mu = 0.5, c = 20 (prompts near 0.5);
- sparse: mu = 0.03, c = 20;
- sparse_to_dense: mu rises linearly from 0.02 to 0.5 over the run (a policy learning);
- mixed: mu = 0.3, c = 0.5 (most prompts near 0 or 1: solved or hopeless, a few in between).

Straggler worlds: steady (q = 0.04: rates about 0.10 / 0.21 / 0.32 at G = 4 / 8 / 16) and
drift_up (q from 0.005 to 0.08); each is paired with each reward world above. Then three worlds
where groups with reward variance are rare (issue 53): steady/nearly_all (mu = 0.98, c = 20),
steady/nearly_none (mu = 0.01, c = 20) and drift_down/rising (the tail falls, q from 0.08 to
0.005, while mu rises from 0.002 to 0.25). Ladder [4, 8, 16], tau 3, delta 0.2, 16 groups per
step (the training study's size), 80 steps. A step's cost is its modeled seconds by the
project's step-time model (``sim/steptime.py``: Qwen2.5-3B on one H100, compacting rollouts plus
the update, prompts of 256 tokens; ``--regime synchronous``: every row decodes until the step's
longest ends) on the lengths and rewards drawn at the played G, the update over the groups whose
rewards are not all equal (the trainer's default, ``train.drop_no_signal``); the signal of a
group of G is ``v(G) = P_nz(G) (1 - 1/G)`` with the true ``P_nz(G) = 1 - E[p^G] - E[(1-p)^G]``.

The oracle knows, per step, the true straggle rates, the true ``v`` and the seconds a step at
each G would take (the same draws), and plays the rung, or the two-rung mixture, with the most
signal per second whose expected straggle rate meets delta (the smallest G when none does).
Per controller (fixed G, SAGC+, sagc_value), mean over seeds (± 95% CI) after the first 10
steps: straggler rate and its excess over the allowed rate ``max(delta, p_smallest)``, signal
per second (expected signal over seconds spent), its regret (1 - its share of the oracle's), and
mean G. A fixed G ignores the budget: where it beats the oracle it does so by breaking delta.
Last, per world, each controller's signal per second as a share of the best fixed G's that keeps
the budget (the ratio of the means over seeds, then the mean ± 95% CI of the per-seed ratios on
the same seeds), and of the best fixed G's whatever its straggling; the bar on the rare-signal
worlds is 0.95 of the first (the ratio of the means). Five seeds leave these shares about
± 0.03 wide, too wide for a bar of 0.95: hence 20 by default.

    python benchmarks/value_quality.py [--seeds 20] [--first-seed 0] [--steps 80] [--prompts 16]
        [--worlds A,B] [--regime compacting|synchronous]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
from controller_quality import cell  # a mean ± its 95% CI, as that table prints it

from sagc_jax.config import ControllerConfig, load_config
from sagc_jax.controller import StepObservation, make_controller, varied_groups
from sagc_jax.controller.sagc_value import beta_moment
from sagc_jax.planning.timing import step_timer
from sagc_jax.sim.worlds import TailWorld, rates_table

CANDIDATES = (4, 8, 16)
TAU, DELTA, BURN_IN = 3.0, 0.2, 10
CONTROLLERS = ("fixed:4", "fixed:8", "fixed:16", "sagc_plus", "sagc_value")
PROMPT_TOKENS = 256
EXCESS_BAR = 0.03


RARE_WORLDS = ("steady/nearly_all", "steady/nearly_none", "drift_down/rising")
SHARE_BAR = 0.95


def step_seconds(regime: str):
    """Modeled seconds of a step from its lengths [P, G] and its groups with signal (bool [P]):
    Qwen2.5-3B on one H100, the update over the groups with signal."""
    overrides = ["sim.hardware=h100", "sim.devices=1", "sim.model=qwen2.5-3b"]
    cfg = load_config(None, [*overrides, "sampling.max_new_tokens=1"])  # cap: the step's longest
    return step_timer(cfg, PROMPT_TOKENS + 1).step_seconds(PROMPT_TOKENS, regime)


class RewardWorld:
    """Per-prompt success rates ``Beta(c mu_t, c (1 - mu_t))`` and Bernoulli rewards."""

    def __init__(self, mu_of_step, concentration: float, prompts: int, seed: int) -> None:
        self.mu_of_step, self.c, self.prompts, self.seed = mu_of_step, concentration, prompts, seed

    def _rates(self, step: int) -> np.ndarray:
        mu = self.mu_of_step(step)
        rng = np.random.default_rng([self.seed, step, 7])
        return rng.beta(self.c * mu, self.c * (1.0 - mu), size=self.prompts)

    def rewards(self, step: int, group_size: int) -> np.ndarray:
        u = np.random.default_rng([self.seed, step, 8]).random((max(CANDIDATES), self.prompts))
        return (u[:group_size].T < self._rates(step)[:, None]).astype(np.float64)

    def signal(self, step: int) -> np.ndarray:
        """True ``v(G)`` per rung: the Beta's moments (``beta_moment``), times (1 - 1/G)."""
        mu = self.mu_of_step(step)
        var = mu * (1.0 - mu) / (self.c + 1.0)
        return np.array(
            [
                (1.0 - beta_moment(mu, var, g) - beta_moment(1.0 - mu, var, g)) * (1.0 - 1.0 / g)
                for g in CANDIDATES
            ]
        )


def worlds(steps: int, prompts: int, seed: int) -> dict:
    last = max(1, steps - 1)
    tails = {
        "steady": lambda t: 0.04,
        "drift_up": lambda t: 0.005 + 0.075 * t / last,
    }
    rewards = {
        "dense": (lambda t: 0.5, 20.0),
        "sparse": (lambda t: 0.03, 20.0),
        "sparse_to_dense": (lambda t: 0.02 + 0.48 * t / last, 20.0),
        "mixed": (lambda t: 0.3, 0.5),
    }
    return {
        f"{tail}/{reward}": (
            TailWorld(q, steps, CANDIDATES, TAU, prompts, seed=seed),
            RewardWorld(mu, c, prompts, seed),
        )
        for tail, q in tails.items()
        for reward, (mu, c) in rewards.items()
    } | {
        "steady/nearly_all": (
            TailWorld(tails["steady"], steps, CANDIDATES, TAU, prompts, seed=seed),
            RewardWorld(lambda t: 0.98, 20.0, prompts, seed),
        ),
        "steady/nearly_none": (
            TailWorld(tails["steady"], steps, CANDIDATES, TAU, prompts, seed=seed),
            RewardWorld(lambda t: 0.01, 20.0, prompts, seed),
        ),
        "drift_down/rising": (
            TailWorld(
                lambda t: 0.08 - 0.075 * t / last, steps, CANDIDATES, TAU, prompts, seed=seed
            ),
            RewardWorld(lambda t: 0.002 + 0.248 * t / last, 20.0, prompts, seed),
        ),
    }


def best_ratio(p_k, v_k, t_k, delta: float) -> tuple[float, float, float]:
    """``(signal, seconds, rate)`` of the rung or two-rung mixture with the most signal per
    second whose expected straggle rate meets delta (the smallest rung when none does)."""
    options = [(v_k[0], t_k[0], p_k[0])] if p_k[0] > delta else []
    for k in range(len(p_k)):
        if p_k[k] > delta:
            continue
        options.append((v_k[k], t_k[k], p_k[k]))
        for j in range(len(p_k)):
            if p_k[j] > delta:
                w = (delta - p_k[k]) / (p_k[j] - p_k[k])
                mix = (1 - w) * np.array([v_k[k], t_k[k], p_k[k]]) + w * np.array(
                    [v_k[j], t_k[j], p_k[j]]
                )
                options.append(tuple(mix))
    return max(options, key=lambda o: o[0] / o[1])


def play(spec: str, tails: TailWorld, rewards: RewardWorld, seconds_tk, timer) -> dict:
    """``G_t``, ``s_t`` and the seconds of every step of one controller."""
    budget = ControllerConfig(candidates=CANDIDATES, tau=TAU, delta=DELTA)
    controller = make_controller(spec, budget, step_seconds=timer)
    out = {key: np.zeros(tails.num_steps) for key in ("g", "s", "seconds")}
    for t in range(tails.num_steps):
        g = controller.propose()
        obs = StepObservation.of_groups(tails.lengths(t, g), rewards_pg=rewards.rewards(t, g))
        m = controller.observe(obs)
        k = CANDIDATES.index(g)
        out["g"][t], out["s"][t], out["seconds"][t] = g, m["s_t"], seconds_tk[t, k]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument(
        "--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1"
    )
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--prompts", type=int, default=16, help="groups per step")
    parser.add_argument("--worlds", default="", help="comma-separated world names (default: all)")
    parser.add_argument(
        "--regime",
        choices=("compacting", "synchronous"),
        default="compacting",
        help="how the modeled rollouts decode: only the rows still running (the sampler), or "
        "every row until the step's longest ends",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    timer = step_seconds(args.regime)
    print(
        f"# value_quality: {args.seeds} seeds from {args.first_seed}, {args.steps} steps, "
        f"{args.prompts} groups per step, ladder {list(CANDIDATES)}, tau {TAU}, delta {DELTA}, "
        f"{args.regime} rollouts; "
        f"{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')}\n"
    )
    columns = ("straggler rate", "excess over allowed", "signal per s", "regret", "mean G")
    print("| world | oracle signal per s | controller | " + " | ".join(columns) + " |")
    print("|" + " --- |" * (len(columns) + 3))
    after = slice(BURN_IN, None)
    verdict = []
    per_seed = {}  # (world, controller) -> signal per second of each seed, for paired shares
    names = list(worlds(args.steps, args.prompts, 0))
    if args.worlds:
        unknown = set(args.worlds.split(",")) - set(names)
        if unknown:
            parser.error(f"--worlds: {', '.join(sorted(unknown))}; allowed: {', '.join(names)}")
        names = args.worlds.split(",")
    for name in names:
        rows = {spec: [] for spec in CONTROLLERS}
        oracle_rate = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            tails, rewards = worlds(args.steps, args.prompts, seed)[name]
            p_tk = rates_table(tails)
            v_tk = np.stack([rewards.signal(t) for t in range(args.steps)])
            seconds_tk = np.array(
                [
                    [
                        timer(tails.lengths(t, g), varied_groups(rewards.rewards(t, g)))
                        for g in CANDIDATES
                    ]
                    for t in range(args.steps)
                ]
            )
            best = [best_ratio(p_tk[t], v_tk[t], seconds_tk[t], DELTA) for t in range(args.steps)]
            best = np.array(best)[after]
            oracle = best[:, 0].sum() / best[:, 1].sum()
            oracle_rate.append(oracle)
            allowed = np.maximum(DELTA, p_tk[after, 0]).mean()
            for spec in CONTROLLERS:
                out = play(spec, tails, rewards, seconds_tk, timer)
                k_t = np.searchsorted(CANDIDATES, out["g"]).astype(int)
                signal = v_tk[np.arange(args.steps), k_t][after].sum()
                per_s = signal / out["seconds"][after].sum()
                rows[spec].append(
                    {
                        "rate": out["s"][after].mean(),
                        "excess": out["s"][after].mean() - allowed,
                        "per_s": per_s,
                        "regret": 1.0 - per_s / oracle,
                        "mean_G": out["g"][after].mean(),
                    }
                )
        formats = {"rate": "{:.3f}", "excess": "{:+.3f}", "per_s": "{:.4f}", "regret": "{:+.3f}"}
        formats["mean_G"] = "{:.1f}"
        for spec, runs in rows.items():
            cells = [cell([r[key] for r in runs], fmt) for key, fmt in formats.items()]
            print(f"| {name} | {np.mean(oracle_rate):.4f} | {spec} | " + " | ".join(cells) + " |")
            verdict.append((name, spec, *(np.mean([r[k] for r in runs]) for k in formats)))
            per_seed[(name, spec)] = np.array([r["per_s"] for r in runs])
    print()
    for spec in ("sagc_plus", "sagc_value"):
        mine = [v for v in verdict if v[1] == spec]
        worst = max(mine, key=lambda v: v[3])
        print(
            f"{spec}: largest excess {worst[3]:+.3f} ({worst[0]}; bar {EXCESS_BAR}), mean regret "
            f"{np.mean([v[5] for v in mine]):+.3f}, largest {max(v[5] for v in mine):+.3f} "
            f"({max(mine, key=lambda v: v[5])[0]})"
        )
    kept = [v for v in verdict if v[1].startswith("fixed") and v[3] <= EXCESS_BAR]
    by_world = {}
    for v in kept:  # the best fixed G that keeps the budget, per world
        if v[0] not in by_world or v[5] < by_world[v[0]][5]:
            by_world[v[0]] = v
    value = {v[0]: v for v in verdict if v[1] == "sagc_value"}
    plus = {v[0]: v for v in verdict if v[1] == "sagc_plus"}
    beats = sum(value[w][5] <= plus[w][5] + 1e-12 for w in value)
    print(f"sagc_value's regret <= sagc_plus's on {beats} of {len(value)} worlds")
    for world, v in by_world.items():
        print(
            f"  {world}: best fixed G within the budget {v[1]} regret {v[5]:+.3f}, "
            f"sagc_value {value[world][5]:+.3f}, sagc_plus {plus[world][5]:+.3f}"
        )
    print("signal per second over the best fixed G's (within the budget / any):")
    for world in value:
        fixed = [v for v in verdict if v[0] == world and v[1].startswith("fixed")]
        best_any = max(fixed, key=lambda v: v[4])
        best_kept = by_world.get(world)
        for spec, mine in (("sagc_value", value[world]), ("sagc_plus", plus[world])):
            kept = "none kept"
            if best_kept:  # the ratio of the means; then the per-seed ratios' mean ± 95% CI
                paired = per_seed[(world, spec)] / per_seed[(world, best_kept[1])]
                share = f"{mine[4] / best_kept[4]:.2f} of {best_kept[1]}"
                kept = f"{share} (per seed {cell(paired, '{:.2f}')})"
            bar = ""
            if world in RARE_WORLDS and spec == "sagc_value" and best_kept:
                bar = " (bar met)" if mine[4] >= SHARE_BAR * best_kept[4] else " (bar MISSED)"
            print(f"  {world} {spec}: {kept}{bar} / {mine[4] / best_any[4]:.2f} of {best_any[1]}")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
