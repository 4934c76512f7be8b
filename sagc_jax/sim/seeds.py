"""The simulator comparison over several seeds, with spread and paired differences.

    sagc-jax simulate --config configs/sim/prompt_pool.yaml --seeds 5 [--set k=v ...]

Seed i sets ``sim.seed`` and the seed of every controller with a random generator (its
registry entry's ``seeded`` section: ``controller.sagc.seed``, ``controller.hybrid.seed``) to
their configured values + i, so every controller of a seed sees
the same workload (common random numbers) and differences between controllers can be paired.
Prints one markdown table: mean +- standard deviation over seeds of the straggler rate, mean G,
mean log2 G and the modeled hours of the three rollout regimes (``sim.roofline``: compacting,
the sampler's own, first), and the paired difference of each controller's compacting hours and
mean log2 G against ``--reference`` (default ``sagc``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sagc_jax.config import Config
from sagc_jax.controller.registry import CONTROLLERS
from sagc_jax.sim.runner import compare
from sagc_jax.sim.steptime import StepTimer
from sagc_jax.sim.workload import SyntheticWorkload

_MEASURES = (
    ("straggler_rate", "straggler rate", "{:.3f}"),
    ("mean_G", "mean G", "{:.2f}"),
    ("mean_log2_G", "mean log2 G", "{:.2f}"),
    ("compacting_h", "modeled h, {timed}, compacting", "{:.2f}"),
    ("synchronous_h", "modeled h, {timed}, synchronous", "{:.2f}"),
    ("continuous_h", "modeled h, {timed}, continuous", "{:.2f}"),
)
PAIRED = "compacting_h"  # the hours paired against the reference: the sampler's own regime


def seed_config(cfg: Config, offset: int) -> Config:
    """``cfg`` with ``sim.seed`` and each seeded controller's seed (``controller.sagc.seed``,
    ``controller.hybrid.seed``) moved by ``offset``."""
    c = cfg.controller
    sim = dataclasses.replace(cfg.sim, seed=cfg.sim.seed + offset)
    seeded = {e.seeded for e in CONTROLLERS.values() if e.seeded}  # a random generator's
    own = {name: getattr(c, name) for name in seeded}
    own = {name: dataclasses.replace(s, seed=s.seed + offset) for name, s in own.items()}
    controller = dataclasses.replace(c, **own)
    return dataclasses.replace(cfg, sim=sim, controller=controller)


def run_seeds(cfg: Config, seeds: int, timer: StepTimer) -> dict[str, dict[str, np.ndarray]]:
    """``{controller: {measure: [seeds]}}`` of the summary rows over ``seeds`` seeds."""
    out: dict[str, dict[str, list]] = {}
    for i in range(seeds):
        seeded = seed_config(cfg, i)
        for run in compare(seeded, SyntheticWorkload(seeded.sim), timer):
            row = run.summary()
            per = out.setdefault(run.name, {key: [] for key, _, _ in _MEASURES})
            for key, _, _ in _MEASURES:
                per[key].append(row[key])
    return {name: {k: np.array(v) for k, v in per.items()} for name, per in out.items()}


def format_seed_table(results: dict, timed: str, reference: str = "sagc") -> str:
    """Markdown: mean +- std per measure, then paired differences against ``reference``;
    ``timed`` (``StepTimer.label``) says what the modeled hours are of."""
    ref = results.get(reference)
    cols = [title.format(timed=timed) for _, title, _ in _MEASURES]
    if ref is not None:
        cols += [f"{PAIRED.removesuffix('_h')} h - {reference}", f"log2 G - {reference}"]
    lines = ["| controller | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 1)]

    def spread(values, fmt):
        std = values.std(ddof=1) if values.size > 1 else 0.0
        return f"{fmt.format(values.mean())} +- {fmt.replace('+', '').format(std)}"

    for name, per in results.items():
        cells = [spread(per[key], fmt) for key, _, fmt in _MEASURES]
        if ref is not None:
            cells.append(spread(per[PAIRED] - ref[PAIRED], "{:+.2f}"))
            cells.append(spread(per["mean_log2_G"] - ref["mean_log2_G"], "{:+.3f}"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
