"""Compilations per candidate G over a training run, and what they cost.

Reads the ``metrics.jsonl`` of one or more ``sagc-jax train`` runs and prints, per run, the group
sizes visited, the programs compiled (sampler and update, from the ``compiles/*`` counters the
trainer logs), and for every G the first step's time (which includes compiling that G's
programs) against the median of its later steps: the ratio is the one-off price of a new G.

    python benchmarks/compile_counts.py runs/demo/compare/sagc-seed0 [RUN ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def describe(run_dir: Path) -> str:
    steps = [
        r
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "group_size" in r
    ]
    visited = sorted({r["group_size"] for r in steps})
    parts = []
    for g in visited:
        times = [r["time/step_s"] for r in steps if r["group_size"] == g]
        later = float(np.median(times[1:])) if len(times) > 1 else float("nan")
        parts.append(
            f"G={g}: {len(times)} steps, first {times[0]:.2f} s vs {later:.2f} s "
            f"({times[0] / later:.1f}x)"
        )
    sampler, update = steps[-1]["compiles/sampler"], steps[-1]["compiles/update"]
    one_each = sampler == update == len(visited)
    return (
        f"{run_dir}: {len(steps)} steps, G visited {visited}, compiled programs: sampler "
        f"{sampler}, update {update} (one per G visited: {one_each}); " + "; ".join(parts)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="sagc-jax train run directories")
    for run in parser.parse_args().runs:
        print(describe(run))


if __name__ == "__main__":
    main()
