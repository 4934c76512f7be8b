"""No growth over a long run: the demo trained for ``--steps`` steps (2,000) while its process is
sampled from outside, and every resource checked against a stated bound after warm-up.

Sampled every ``--every`` seconds from /proc (Linux) and the run directory:

- host RSS (on a CPU backend the device's buffers live there too; a GPU's or TPU's own memory
  is not read here), threads, open file descriptors, and child processes (reward workers);
- the run directory: its checkpoints (rotated: ``train.keep_checkpoints``), metrics.jsonl and
  the TensorBoard events (one record per step by design: reported in bytes per step);
- the persistent compilation cache (``train.compilation_cache_dir``: no program compiles after
  warm-up, so it must not grow);
- the controller's state, as saved in the newest checkpoint (its JSON size).

Warm-up is the first ``--warmup`` of the steps (0.1); the steps after it are cut in quarters,
and the median of the last quarter's samples is held against the first's (a single sample is a
random moment: a checkpoint write or an evaluation lifts RSS, threads and open files for a
second; a leak lifts the median). The bounds: RSS and the controller's state at most 1.10x
(allocator noise; the controller's floats print longer or shorter); threads, open files and
child processes not above; checkpoints at most (``keep_checkpoints`` + 1) x the largest step
directory (one being written beside those kept); the compilation cache not growing in the last
quarter (every program it holds compiled by then). Prints a table, one summary line and exit
code 1 when a bound is broken; ``--samples`` judges a finished run's samples again.

    .venv/bin/python benchmarks/growth.py                 # 2,000 demo steps
    .venv/bin/python benchmarks/growth.py --steps 300 --set train.eval_every=50
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo.yaml"
RSS_BOUND = 1.10
CONTROLLER_BOUND = 1.10


@dataclass
class Sample:
    seconds: float
    step: int
    rss_mib: float
    threads: int
    fds: int
    children: int
    checkpoints_mib: float
    largest_step_mib: float
    metrics_kib: float
    events_kib: float
    cache_mib: float
    controller_bytes: int


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":", 1) for line in lines if ":" in line)


def _descendants(pid: int) -> int:
    """Processes below ``pid`` (reward workers and their children)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # it ended meanwhile
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = 0, {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found += len(frontier)
    return found


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:  # rotated away meanwhile
                pass
    return total


def _steps_logged(metrics: Path) -> int:
    try:
        with metrics.open("rb") as f:
            return max(sum(1 for _ in f) - 1, 0)  # the step-0 evaluation is a line too
    except FileNotFoundError:
        return 0


def _controller_bytes(checkpoints: Path) -> int:
    steps = sorted(
        (p for p in checkpoints.glob("*") if p.name.isdigit()), key=lambda p: int(p.name)
    )
    for step in reversed(steps):
        try:
            meta = json.loads((step / "meta" / "metadata").read_text())
        except (OSError, ValueError):  # being written or rotated: the one before
            continue
        return len(json.dumps(meta["controller"]))
    return 0


def sample(pid: int, run_dir: Path, cache: Path, began: float) -> Sample:
    status = _status(pid)
    checkpoints = run_dir / "checkpoints"
    steps = [p for p in checkpoints.glob("*") if p.is_dir()] if checkpoints.exists() else []
    sizes = [_size(p) for p in steps]
    mib = 1 << 20
    return Sample(
        seconds=time.monotonic() - began,
        step=_steps_logged(run_dir / "metrics.jsonl"),
        rss_mib=int(status["VmRSS"].split()[0]) / 1024,
        threads=int(status["Threads"]),
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        children=_descendants(pid),
        checkpoints_mib=sum(sizes) / mib,
        largest_step_mib=max(sizes, default=0) / mib,
        metrics_kib=_size(run_dir / "metrics.jsonl") / 1024,
        events_kib=_size(run_dir / "tensorboard") / 1024
        if (run_dir / "tensorboard").exists()
        else 0,
        cache_mib=_size(cache) / mib if cache.exists() else 0,
        controller_bytes=_controller_bytes(checkpoints) if checkpoints.exists() else 0,
    )


def judge(samples: list[Sample], warmup_steps: int, keep: int) -> list[tuple[str, str, str, bool]]:
    """(quantity, what was seen, bound, within it) for every bounded quantity.

    The steps after warm-up are cut in quarters; the first ("early") and the last ("late") are
    compared by their medians (one sample is a random moment: a checkpoint write or an
    evaluation raises RSS, threads and open files for a second, so single samples and maxima
    move with what the sampler happened to catch; a leak moves the median)."""
    after = [s for s in samples if s.step > warmup_steps]
    span = (samples[-1].step - warmup_steps) / 4
    early = [s for s in after if s.step <= warmup_steps + span]
    late = [s for s in after if s.step > samples[-1].step - span]
    if len(early) < 3 or len(late) < 3:
        raise SystemExit("growth: too few samples after warm-up; lower --every or add --steps")
    rows = []

    def row(name, field, factor, fmt="{:.1f}"):
        first = statistics.median(getattr(s, field) for s in early)
        last = statistics.median(getattr(s, field) for s in late)
        top = max(getattr(s, field) for s in after)
        seen = f"{fmt.format(first)} -> {fmt.format(last)} (max {fmt.format(top)})"
        bound = f"late <= {factor:.2f}x early" if factor != 1 else "late <= early"
        rows.append((name, seen, bound, last <= factor * first))

    row("host RSS (MiB)", "rss_mib", RSS_BOUND)
    row("threads", "threads", 1, "{:.0f}")
    row("open files", "fds", 1, "{:.0f}")
    row("child processes", "children", 1, "{:.0f}")
    row("controller state (bytes)", "controller_bytes", CONTROLLER_BOUND, "{:.0f}")
    largest = max(s.largest_step_mib for s in samples)
    top = max(s.checkpoints_mib for s in samples)
    rows.append(
        (
            "checkpoints (MiB)",
            f"max {top:.1f}",
            f"<= ({keep} kept + 1 being written) x {largest:.2f}",
            top <= (keep + 1) * largest,
        )
    )
    grew = late[-1].cache_mib - late[0].cache_mib
    cache = f"{early[0].cache_mib:.2f} -> {late[-1].cache_mib:.2f}"
    rows.append(
        (
            "compilation cache (MiB)",
            f"{cache} ({grew:+.2f} in the last quarter)",
            "no growth in the last quarter",
            grew <= 0,
        )
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=float, default=0.1, help="share of the steps")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--work", help="work directory (default: a new one under $TMPDIR)")
    parser.add_argument("--samples", help="a finished run's samples.jsonl: judge it, run nothing")
    args = parser.parse_args(argv)
    from sagc_jax.config import load_config  # the run's own resolved settings

    keep = load_config(args.config, overrides=args.set).train.keep_checkpoints
    if args.samples:
        lines = Path(args.samples).read_text().splitlines()
        return report([Sample(**json.loads(line)) for line in lines], args, keep, args.samples)
    work = Path(args.work or tempfile.mkdtemp(prefix="sagc-growth-"))
    work.mkdir(parents=True, exist_ok=True)
    run_dir, cache = work / "run", work / "xla-cache"
    sets = [
        f"train.steps={args.steps}",
        f"train.compilation_cache_dir={cache}",
        "logging.progress=false",
        *args.set,
        f"logging.run_dir={run_dir}",
    ]
    cmd = [sys.executable, "-m", "sagc_jax", "train", "--config", args.config]
    cmd += [f"--set={s}" for s in sets]
    log = (work / "train.log").open("w")
    began = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    samples: list[Sample] = []
    while proc.poll() is None:
        try:
            samples.append(sample(proc.pid, run_dir, cache, began))
        except (FileNotFoundError, ProcessLookupError):  # it ended between poll and read
            break
        time.sleep(args.every)
    if proc.wait() != 0:
        print(f"growth: the run ended with exit code {proc.returncode}; see {work / 'train.log'}")
        return 1
    (work / "samples.jsonl").write_text("".join(json.dumps(vars(s)) + "\n" for s in samples))
    return report(samples, args, keep, work / "samples.jsonl")


def report(samples: list[Sample], args: argparse.Namespace, keep: int, where) -> int:
    """Print the table and the summary line; 1 when a bound is broken."""
    warmup_steps = int(args.warmup * samples[-1].step)
    rows = judge(samples, warmup_steps, keep)
    last = samples[-1]
    print("| quantity | first -> last quarter after warm-up, medians (max) | bound | within |")
    print("| --- | --- | --- | --- |")
    for name, seen, bound, ok in rows:
        print(f"| {name} | {seen} | {bound} | {'yes' if ok else 'NO'} |")
    per_step = [
        f"metrics.jsonl {last.metrics_kib * 1024 / max(last.step, 1):.0f} B/step",
        f"TensorBoard {last.events_kib * 1024 / max(last.step, 1):.0f} B/step",
    ]
    broken = [name for name, _, _, ok in rows if not ok]
    verdict = f"FAIL ({', '.join(broken)})" if broken else "PASS"
    print(
        f"growth ({last.step} steps of {Path(args.config).name}, warm-up {warmup_steps}, "
        f"{len(samples)} samples, {last.seconds / 60:.1f} min): by design {', '.join(per_step)}; "
        f"{verdict}; samples in {where}"
    )
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
