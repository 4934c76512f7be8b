"""Cost of one controller cycle (propose + observe) on the host, SAGC and SAGC+ against fixed G.

The fixed-G baseline does the same per-step bookkeeping (straggler observation, padding waste,
counters) without any decision, so the ratio is the price of SAGC's decisions themselves.
Lengths come from the calibrated workload, precomputed, so only the controller is timed.

A second line times the prompt-aware hybrid controller (both modes) on ``--prompts`` prompts
per step drawn from a pool of 8x as many (the prompt-pool workload), after two epochs of
warm-up so every prompt has a record: the decision (``propose_for``) and the whole cycle.

    python benchmarks/controller_overhead.py [--groups 64] [--cycles 5000] [--prompts 512]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from sagc_jax.config import HybridConfig
from sagc_jax.config.sim import SimConfig
from sagc_jax.controller import (
    FixedGroupController,
    HybridController,
    SAGCConfig,
    SAGCController,
    SAGCPlusController,
    StepObservation,
)
from sagc_jax.sim import SyntheticWorkload


def time_cycles(make, lengths_by_g, cycles: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean seconds per propose + observe cycle (the
    step's ``StepObservation`` built in it, as the trainer builds one per step)."""
    results = []
    for _ in range(repeats):
        controller = make()
        start = time.perf_counter()
        for t in range(cycles):
            g = controller.propose()
            controller.observe(StepObservation.of_groups(lengths_by_g[g][t % len(lengths_by_g[g])]))
        results.append((time.perf_counter() - start) / cycles)
    return float(np.median(results))


def time_prompt_aware(make, steps, cycles: int, repeats: int = 3) -> tuple[float, float]:
    """Median seconds of ``(decision, cycle)`` of a prompt-aware controller; ``steps`` holds
    ``(prompt_ids, prompt_tokens, lengths_pg at the largest G)`` per step."""
    decide, cycle = [], []
    for _ in range(repeats):
        controller = make()
        d_sum = c_sum = 0.0
        for t in range(2 * len(steps) + cycles):
            ids, tokens, lengths_pg = steps[t % len(steps)]
            start = time.perf_counter()
            decision = controller.propose_for(ids, tokens)
            mid = time.perf_counter()
            if np.ndim(decision) == 0:
                lengths = lengths_pg[:, :decision]
                sizes = None
            else:
                sizes = decision
                lengths = lengths_pg[np.arange(lengths_pg.shape[1])[None, :] < sizes[:, None]]
            mid2 = time.perf_counter()
            controller.observe(StepObservation.of_rollouts(lengths, sizes))
            end = time.perf_counter()
            if t >= 2 * len(steps):  # after two epochs of warm-up
                d_sum += mid - start
                c_sum += (mid - start) + (end - mid2)
        decide.append(d_sum / cycles)
        cycle.append(c_sum / cycles)
    return float(np.median(decide)), float(np.median(cycle))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=64, help="prompts (groups) per step")
    parser.add_argument("--cycles", type=int, default=5000)
    parser.add_argument("--prompts", type=int, default=512, help="prompts per step (hybrid)")
    parser.add_argument("--hybrid-cycles", type=int, default=300)
    args = parser.parse_args()
    workload = SyntheticWorkload(SimConfig(prompts_per_step=args.groups))
    lengths_by_g = {g: [workload.lengths(t, g) for t in range(50)] for g in (4, 8, 16)}
    sagc = time_cycles(lambda: SAGCController(config=SAGCConfig(seed=0)), lengths_by_g, args.cycles)
    plus = time_cycles(lambda: SAGCPlusController(), lengths_by_g, args.cycles)
    fixed = time_cycles(lambda: FixedGroupController(16), lengths_by_g, args.cycles)
    print(
        f"controller cycle ({args.groups} groups, G in 4/8/16, {platform.processor() or 'cpu'}): "
        f"sagc {sagc * 1e6:.1f} us, sagc_plus {plus * 1e6:.1f} us, fixed {fixed * 1e6:.1f} us, "
        f"ratio sagc/fixed {sagc / fixed:.2f}, sagc_plus/fixed {plus / fixed:.2f}"
    )
    pool = SyntheticWorkload(SimConfig(prompts_per_step=args.prompts, prompt_pool=8 * args.prompts))
    steps = [(*pool.prompts(t), pool.lengths(t, 16)) for t in range(8)]  # one epoch
    timings = {}
    for mode in ("step", "per_prompt"):
        timings[mode] = time_prompt_aware(
            lambda mode=mode: HybridController(hybrid=HybridConfig(seed=0, mode=mode)),
            steps,
            args.hybrid_cycles,
        )
    print(
        f"hybrid ({args.prompts} prompts of a pool of {8 * args.prompts}, G in 4/8/16): "
        + ", ".join(
            f"{mode} decision {d * 1e6:.0f} us, cycle {c * 1e6:.0f} us"
            for mode, (d, c) in timings.items()
        )
    )


if __name__ == "__main__":
    main()
