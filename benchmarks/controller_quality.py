"""Controller quality against an oracle, on straggler worlds with known per-G rates.

The paper's SAGC (``sagc``, its defaults) and SAGC+ (``sagc_plus``, its defaults) play the
same worlds on the same seeds (common random numbers) for 80 and 300 steps at delta 0.2 and
0.3, ladder [4, 8, 16], tau 3. Worlds (``sim.worlds``; q: mean per-rollout tail probability):

- steady: q = 0.04 throughout (per-G rates about 0.10 / 0.21 / 0.32);
- rare_tail: q = 0.005 (every G within either delta: the oracle plays G = 16);
- heavy_tail: q = 0.2 (even G = 4 straggles at 0.34: the oracle plays G = 4);
- drift_up: q rises linearly from 0.005 to 0.08 over the run;
- shift_down: q = 0.1 for the first half, then 0.01;
- reasoning_drift: the calibrated simulator workload (configs/sim/reasoning_drift.yaml, its
  drift stretched over the horizon).

Per world and controller, mean over seeds (± 95% CI where it varies), over the steps after the
first ``--burn_in`` (10): the straggler rate, its excess over the rate the oracle is allowed
(``max(delta, p_smallest)`` per step), mean log2 G and its regret against the oracle's (the best
mixture of rungs meeting delta at every step), mean G, and the number of rung changes over the
whole run. The last lines check SAGC+ against the issue's bars at 80 steps (excess <= 0.03,
regret <= 0.3 log2 G on every world and both deltas).

With ``--tail-batching [EXTRA]`` (default 0.25) every step starts ``P + ceil(EXTRA P)`` groups
(P = ``--prompts``) and stops once P of them are whole (every rollout starts at the step's
start, so a group ends with its longest rollout); the controllers read the cut step (lengths
reached, finished flags: ``StepObservation.of_groups(lengths, finished)``). The straggler rate
judged is the true one: the share of all the groups started that straggle, from their full
lengths (its expectation is the world's rate at the played G); the controller's own reading is
reported beside it. A third row, ``sagc_plus:naive``, reads the cut lengths as if complete.

    python benchmarks/controller_quality.py [--seeds 5] [--prompts 64] [--horizons 80 300]
        [--tail-batching [EXTRA]]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import time

import numpy as np

from sagc_jax.analysis.study import mean_ci
from sagc_jax.config import ControllerConfig, HybridConfig, SAGCConfig, load_config
from sagc_jax.config.sim import SimConfig
from sagc_jax.controller import make_controller
from sagc_jax.sim.runner import simulate_controller
from sagc_jax.sim.steptime import StepTimer
from sagc_jax.sim.worlds import TailWorld, WorkloadWorld, oracle, play_cut, rates_table

CANDIDATES = (4, 8, 16)
TAU = 3.0
CONTROLLERS = ("sagc", "sagc_plus")
EXCESS_BAR, REGRET_BAR = 0.03, 0.3
UNTIMED = StepTimer(SimConfig(hardware="custom"))  # the suite reads rates and G, not time


def worlds(horizon: int, seed: int, prompts: int) -> dict:
    """Every world of the suite for one horizon and seed."""
    half = horizon // 2

    def tail(q_of_step):
        return TailWorld(q_of_step, horizon, CANDIDATES, TAU, prompts, seed=seed)

    sim = load_config("configs/sim/reasoning_drift.yaml").sim
    sim = dataclasses.replace(sim, steps=horizon, seed=seed, prompts_per_step=prompts)
    return {
        "steady": tail(lambda t: 0.04),
        "rare_tail": tail(lambda t: 0.005),
        "heavy_tail": tail(lambda t: 0.2),
        "drift_up": tail(lambda t: 0.005 + 0.075 * t / max(1, horizon - 1)),
        "shift_down": tail(lambda t: 0.1 if t < half else 0.01),
        "reasoning_drift": WorkloadWorld(sim, CANDIDATES, TAU),
    }


def play(spec: str, world, delta: float, seed: int, keep: int | None = None):
    """``(G_t, s_t, read_t)`` of one controller over the world; ``keep``: tail batching, every
    step cut once that many groups are whole (``worlds.play_cut``; spec ``X:naive`` reads the
    cut lengths as complete)."""
    controller_cfg = ControllerConfig(
        candidates=CANDIDATES,
        tau=TAU,
        delta=delta,
        sagc=SAGCConfig(seed=seed),
        hybrid=HybridConfig(seed=seed),
    )
    name, _, reading = spec.partition(":")
    controller = make_controller(name, controller_cfg)
    if keep is not None:
        return play_cut(controller, world, keep, naive=reading == "naive")
    run = simulate_controller(spec, controller, world, UNTIMED)
    return run.group_size, run.s_t, run.s_t


def measures(g_t, s_t, read_t, best: dict, burn_in: int) -> dict:
    after = slice(burn_in, None)
    log2_g = np.log2(g_t)
    return {
        "rate": s_t[after].mean(),
        "read": read_t[after].mean(),
        "excess": s_t[after].mean() - best["allowed"][after].mean(),
        "log2_G": log2_g[after].mean(),
        "regret": best["log2_G"][after].mean() - log2_g[after].mean(),
        "mean_G": g_t[after].mean(),
        "changes": float(np.count_nonzero(np.diff(g_t))),
    }


COLUMNS = (
    ("rate", "straggler rate", "{:.3f}"),
    ("read", "rate read", "{:.3f}"),
    ("excess", "excess over allowed", "{:+.3f}"),
    ("log2_G", "mean log2 G", "{:.2f}"),
    ("regret", "regret (log2 G)", "{:+.2f}"),
    ("mean_G", "mean G", "{:.1f}"),
    ("changes", "rung changes", "{:.1f}"),
)


def cell(values, fmt: str) -> str:
    mean, half, _ = mean_ci(values)
    if not half or not np.isfinite(half):
        return fmt.format(mean)
    return f"{fmt.format(mean)} ± {fmt.replace('+', '').format(half)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=64, help="groups per step")
    parser.add_argument("--horizons", type=int, nargs="+", default=[80, 300])
    parser.add_argument("--deltas", type=float, nargs="+", default=[0.2, 0.3])
    parser.add_argument("--burn_in", type=int, default=10)
    parser.add_argument(
        "--tail-batching",
        type=float,
        nargs="?",
        const=0.25,
        default=None,
        metavar="EXTRA",
        help="start P + ceil(EXTRA P) groups a step, stop once P are whole (default 0.25)",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    keep, started, controllers = None, args.prompts, CONTROLLERS
    tail = ""
    if args.tail_batching is not None:
        keep, started = args.prompts, args.prompts + math.ceil(args.tail_batching * args.prompts)
        controllers = (*CONTROLLERS, "sagc_plus:naive")
        tail = f", tail batching: {started} groups started, the first {keep} whole kept"
    print(
        f"# controller_quality: {args.seeds} seeds, {args.prompts} groups per step{tail}, "
        f"ladder {list(CANDIDATES)}, tau {TAU}; {platform.processor() or platform.machine()}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    verdict = []
    for horizon in args.horizons:
        seeded = [worlds(horizon, seed, started) for seed in range(args.seeds)]
        rates = {name: rates_table(world) for name, world in seeded[0].items()}
        for delta in args.deltas:
            print(f"\n## {horizon} steps, delta {delta}\n")
            print(
                "| world | oracle log2 G | controller | "
                + " | ".join(title for _, title, _ in COLUMNS)
                + " |"
            )
            print("|" + " --- |" * (len(COLUMNS) + 3))
            for name in seeded[0]:
                best = oracle(rates[name], CANDIDATES, delta)
                for spec in controllers:
                    rows = [
                        measures(*play(spec, ws[name], delta, seed, keep), best, args.burn_in)
                        for seed, ws in enumerate(seeded)
                    ]
                    cells = [cell([r[key] for r in rows], fmt) for key, _, fmt in COLUMNS]
                    oracle_log2 = best["log2_G"][args.burn_in :].mean()
                    print(f"| {name} | {oracle_log2:.2f} | {spec} | " + " | ".join(cells) + " |")
                    if spec == "sagc_plus" and horizon == 80:
                        verdict.append(
                            (
                                name,
                                delta,
                                float(np.mean([r["excess"] for r in rows])),
                                float(np.mean([r["regret"] for r in rows])),
                            )
                        )
    if verdict:
        worst_excess = max(verdict, key=lambda v: v[2])
        worst_regret = max(verdict, key=lambda v: v[3])
        ok = worst_excess[2] <= EXCESS_BAR and worst_regret[3] <= REGRET_BAR
        print(
            f"\nsagc_plus at 80 steps: largest excess {worst_excess[2]:+.3f} "
            f"({worst_excess[0]}, delta {worst_excess[1]}; bar {EXCESS_BAR}), largest regret "
            f"{worst_regret[3]:+.2f} ({worst_regret[0]}, delta {worst_regret[1]}; bar "
            f"{REGRET_BAR}): {'PASS' if ok else 'FAIL'}"
        )
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
