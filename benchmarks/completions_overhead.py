"""Cost of writing a run's completions: the CPU demo's GRPO steps with completions written at
every step, every group (``logging.completions_every=1``, ``completions_groups=0``: the most a
run writes; ``--every``/``--groups`` for another setting, such as the defaults 10 and 4)
against none (``completions_every=0``), same config and seeds, the two alternating.

Each run trains ``--steps`` steps from the demo's random start (no warm start: many
completions ramble to the length limit, the longest texts there are), every step running its
update (``train.skip_no_signal=false``: the random policy's rewards are all 0, the warm-started
demo's are not); its step time is the median of ``time/step_s`` over the steps that compiled
nothing. The two settings generate the same rollouts (same seeds), so step k of one pairs with
step k of the other: the median of the paired ratios is printed beside the ratio of medians. Two
costs are timed where they are paid: the hook on the step's thread (it hands the
step over) and the writer on its background thread (the rows, JSON, the file, the TensorBoard
table), per logged step.

    python benchmarks/completions_overhead.py [--config configs/demo.yaml] [--steps 12]
        [--repeats 2] [--every 1] [--groups 0] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from sagc_jax.config import load_config
from sagc_jax.train import completions
from sagc_jax.train.loop import Trainer


def timed(name: str) -> list[float]:
    """Seconds of each call of ``CompletionLog.<name>`` from now on (the method wrapped)."""
    seconds = []
    method = getattr(completions.CompletionLog, name)

    def wrapped(self, *args):
        start = time.perf_counter()
        method(self, *args)
        seconds.append(time.perf_counter() - start)

    setattr(completions.CompletionLog, name, wrapped)
    return seconds


def step_times(config: str, overrides: list[str], run_dir: Path) -> dict[int, float]:
    """``time/step_s`` by step, of the steps of a run that compiled no program."""
    trainer = Trainer(load_config(config, overrides), run_dir)
    trainer.run(progress=False)
    trainer.close()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "group_size" in r]
    compiles = [(r["compiles/sampler"], r["compiles/update"]) for r in steps]
    pairs = zip(steps[1:], compiles[1:], compiles[:-1], strict=True)
    return {r["step"]: r["time/step_s"] for r, now, before in pairs if now == before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--every", type=int, default=1, help="logging.completions_every when on")
    parser.add_argument("--groups", type=int, default=0, help="logging.completions_groups (0: all)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides, last"
    )
    args = parser.parse_args()
    common = [
        f"train.steps={args.steps}",
        "train.eval_size=16",  # the step-0 evaluation is not timed: keep it short
        "train.checkpoint_every=0",
        "logging.progress=false",
        f"logging.completions_groups={args.groups}",
        "train.skip_no_signal=false",
    ]
    hooks, writes = timed("__call__"), timed("_write")
    on = args.every  # the setting timed against 0 (off)
    times: dict[int, list[float]] = {0: [], on: []}
    medians: dict[int, list[str]] = {0: [], on: []}
    paired: list[float] = []  # step k with completions over step k without, same repeat
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = (0, on) if repeat % 2 == 0 else (on, 0)
            runs = {}
            for every in order:
                run_dir = Path(tmp) / f"every{every}-{repeat}"
                overrides = [*common, f"logging.completions_every={every}", *args.set]
                runs[every] = run = step_times(args.config, overrides, run_dir)
                times[every] += run.values()
                medians[every].append(f"{np.median(list(run.values())):.3f}")
            paired += [runs[on][k] / runs[0][k] for k in runs[on].keys() & runs[0].keys()]
            files = list((Path(tmp) / f"every{on}-{repeat}" / "completions").iterdir())
            assert len(files) == args.steps // on, files  # every logged step wrote its file
    off, on_s = (float(np.median(times[e])) for e in (0, on))
    load = os.getloadavg()[0]
    print(
        f"completions overhead ({args.config}, {args.steps} steps x {args.repeats} runs each, "
        f"every {on} steps, {args.groups or 'every'} groups; load {load:.1f}): step {on_s:.3f} s "
        f"on, {off:.3f} s off, ratio {on_s / off:.3f}, paired by step {np.median(paired):.3f} "
        f"over {len(paired)} steps "
        f"(the runs' medians: on {' '.join(medians[on])}, off "
        f"{' '.join(medians[0])}); per logged step, the hook {1e6 * np.median(hooks):.0f} us on "
        f"the step's thread, the writer {1e3 * np.median(writes):.1f} ms on its own"
    )


if __name__ == "__main__":
    main()
