"""What the persistent compilation cache saves a run: the same short run of a config twice, first
with an empty cache folder (cold: every program compiled), then with the folder the first run
filled (warm: every program loaded), each in its own process.

Per run: the seconds from the process's start to its first step's metrics line (start-up, the
step-0 evaluation, with ``train.compile_ahead`` every program), the seconds spent making programs
over the whole run (the sum of the metrics' ``time/compile_s``: tracing, lowering, compiling or
loading), and the run's wall time. Prints one line: both runs and the warm/cold ratios.

    python benchmarks/compile_cache.py --config configs/real/smollm2-study.yaml \\
        --set model.hf_checkpoint=$HOME/.cache/sagc-jax/models/SmolLM2-135M-Instruct \\
        [--steps 3] [--group-size 4] [--compile-ahead true|false]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed_run(args, run_dir: Path, cache: Path) -> dict:
    """One ``sagc-jax train`` process; its first-step time, compile seconds and wall time."""
    command = [
        sys.executable,
        "-m",
        "sagc_jax",
        "train",
        "--config",
        args.config,
        *[a for s in args.set for a in ("--set", s)],
        "--set",
        f"train.steps={args.steps}",
        "--set",
        "controller.kind=fixed",
        "--set",
        f"controller.group_size={args.group_size}",
        *(["--set", f"train.compile_ahead={args.compile_ahead}"] if args.compile_ahead else []),
        "--set",
        f"train.compilation_cache_dir={cache}",
        "--set",
        f"logging.run_dir={run_dir}",
        "--set",
        "logging.progress=false",
    ]
    metrics = run_dir / "metrics.jsonl"
    start = time.perf_counter()
    first_step = None
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        while proc.poll() is None:
            if first_step is None and metrics.is_file() and '"group_size"' in metrics.read_text():
                first_step = time.perf_counter() - start
            time.sleep(0.2)
        err = proc.stderr.read().decode()
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"the run failed ({proc.returncode}):\n{err[-2000:]}")
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    return {
        "first_step_s": first_step if first_step is not None else wall,
        "compile_s": sum(x.get("time/compile_s", 0.0) for x in lines),
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], help="a config override (repeatable)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument(
        "--compile-ahead",
        choices=("true", "false"),
        help="default: the config's train.compile_ahead",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "xla"
        cold = timed_run(args, Path(tmp) / "cold", cache)
        warm = timed_run(args, Path(tmp) / "warm", cache)
    fmt = "first step at {first_step_s:.0f} s, compiling {compile_s:.0f} s, run {wall_s:.0f} s"
    print(
        f"compile_cache: {args.config}, G = {args.group_size}, {args.steps} steps, compile_ahead "
        f"{args.compile_ahead or 'as configured'} | cold: {fmt.format(**cold)} | "
        f"warm: {fmt.format(**warm)} | "
        f"warm/cold: first step {warm['first_step_s'] / cold['first_step_s']:.2f}x, compiling "
        f"{warm['compile_s'] / max(cold['compile_s'], 1e-9):.2f}x, run "
        f"{warm['wall_s'] / cold['wall_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
