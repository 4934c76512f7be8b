"""Cost of one controller cycle (propose + observe) on the host, SAGC against fixed G.

The fixed-G baseline does the same per-step bookkeeping (straggler observation, padding waste,
counters) without any decision, so the ratio is the price of SAGC's decisions themselves.
Lengths come from the calibrated workload, precomputed, so only the controller is timed.

    python benchmarks/controller_overhead.py [--groups 64] [--cycles 5000]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from sagc_jax.config import SimConfig
from sagc_jax.controller import FixedGroupController, SAGCConfig, SAGCController
from sagc_jax.sim import SyntheticWorkload


def time_cycles(make, lengths_by_g, cycles: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean seconds per propose + observe cycle."""
    results = []
    for _ in range(repeats):
        controller = make()
        start = time.perf_counter()
        for t in range(cycles):
            g = controller.propose()
            controller.observe(lengths_by_g[g][t % len(lengths_by_g[g])])
        results.append((time.perf_counter() - start) / cycles)
    return float(np.median(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=64, help="prompts (groups) per step")
    parser.add_argument("--cycles", type=int, default=5000)
    args = parser.parse_args()
    workload = SyntheticWorkload(SimConfig(prompts_per_step=args.groups))
    lengths_by_g = {g: [workload.lengths(t, g) for t in range(50)] for g in (4, 8, 16)}
    sagc = time_cycles(lambda: SAGCController(SAGCConfig(seed=0)), lengths_by_g, args.cycles)
    fixed = time_cycles(lambda: FixedGroupController(16), lengths_by_g, args.cycles)
    print(
        f"controller cycle ({args.groups} groups, G in 4/8/16, {platform.processor() or 'cpu'}): "
        f"sagc {sagc * 1e6:.1f} us, fixed {fixed * 1e6:.1f} us, ratio sagc/fixed {sagc / fixed:.2f}"
    )


if __name__ == "__main__":
    main()
