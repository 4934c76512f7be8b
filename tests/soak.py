"""Chaos soak: kill a training run at random moments, restart it with the same command until it
completes, and check that it ends exactly where an uninterrupted run of the same seed ends.

The run is the demo (configs/demo.yaml, trained from its random init) for ``--steps`` steps with
a checkpoint every ``--checkpoint-every`` steps, ``train.compile_ahead`` on (compilation is a
stage of its own) and a persistent compilation cache shared by every run of the soak. First one
uninterrupted reference run; then killed runs, one after the other, until ``--minutes`` of wall
time are spent (the run in progress then completes without further kills and is checked). With
``--processes 2`` every run is two local CPU processes of one device each, started the way
tests/parallel starts them (``--coordinator``, ``--num-processes``, ``--process-id``), and a
kill hits one of the two (its supervising parent: a SIGKILL takes the trainer with it).

Each start of a killed run draws a signal (SIGKILL half the time, SIGTERM or SIGINT a quarter
each) and an aim, then watches the run and signals it when the aim is met:

- ``start-up``: a uniform delay up to the reference's time to its "train: mesh ..." line;
- ``compile``: a delay within the reference's compilation, once it begins;
- ``rollout`` / ``update``: a delay within the reference's ``time/rollout_s`` of a random step
  (or between it and ``time/step_s``), counted from the previous step's metrics line;
- ``checkpoint``: as soon as an Orbax temporary directory (a write in flight) shows up;
- ``metrics``: as soon as metrics.jsonl grows by a random step's line;
- ``random``: a uniform delay up to the reference's whole duration.

Where a kill landed is told from outside, when the signal is sent, in this order: an Orbax
temporary directory exists (``checkpoint write``); metrics.jsonl grew within the last two polls
(``metrics append``: the line is whole by then; the next instants are the checkpoint hook);
every step is logged (``finish``); no "train: mesh" line yet (``start-up``: imports, model,
resume); a fresh run without its step-0 line (``eval``); fewer "compiled" lines than the
reference printed (``compile``); else the time since the last step ended against the
reference's ``time/rollout_s`` of this step (``rollout`` before it, ``update`` after). The
labels inside a step are estimates: another load on the machine shifts them.

After every kill the next start must resume from the newest step whose files verify (the
trainer's own rule, computed here with its ``CheckpointStore`` before the start; a run none of
whose steps is sealed restores its newest unverified, and that is counted), and must log "train:
resuming DIR from step S" accordingly (a start stopped before its "train: mesh" line, which
comes with that one, has not said yet and is not judged); a process must end with 0 or the
signal's code (128 + n, or -n before the handlers are installed; 4 for the survivor of a
two-process run) and print no traceback. A completed run must hold, in its final checkpoint,
parameters, optimizer state and controller state bit-identical to the reference's (restored with
``CheckpointStore``, compared with ``np.array_equal``); metrics.jsonl must hold one whole record
per step, 0 (the step-0 evaluation) to ``--steps``; no Orbax temporary directory, ``*.tmp``
file, ``run.lock`` or step without a verifying integrity record may remain (steps moved to
``checkpoints-rejected/`` are kept there by design and counted). The first failure ends the
soak.

Export: with one process, each completed run is then exported (``sagc-jax export RUN OUT``)
and the export is signalled at a uniform delay up to 1.2 x the reference export's duration, up
to ``--kills-per-export`` times (the ``export`` stage), then run to completion. After every
start OUT must be absent or whole (the same file digests as the reference run's export), and at
the end whole, with no ``OUT.export-tmp`` left beside it.

Prints one line: kills by signal and stage, restarts, most steps lost by one kill, runs
checked, the verdict; exit code 1 on FAIL.

    .venv/bin/python benchmarks/soak.py                     # an hour of the demo (make soak)
    .venv/bin/python benchmarks/soak.py --processes 2 --tiny
    .venv/bin/python benchmarks/soak.py --minutes 2 --tiny --steps 3   # the self-check
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers import tree_digest  # tests/ is this file's folder: sys.path[0]

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo.yaml"
# tests/helpers.py's tiny run: a short self-check on a loaded machine
TINY = [
    "sampling.max_new_tokens=12",
    "sampling.prompt_buckets=[16]",
    "data.max_terms=4",
    "train.prompts_per_step=2",
    "train.eval_size=4",
    "controller.candidates=[2,4]",
    "sampling.row_buckets=1",
]
SIGNALS = [signal.SIGKILL, signal.SIGKILL, signal.SIGTERM, signal.SIGINT]
AIMS = ("start-up", "compile", "rollout", "update", "checkpoint", "metrics", "random")
EXIT_PEER_LOST = 4  # sagc_jax.parallel.supervisor: the survivor of a dead process
POLL_S = 0.01
RESUMED = re.compile(r"^train: resuming .+ from step (\d+)$")
FINISHED = re.compile(r"^train: .+ is finished \(step (\d+) of")


class Failure(Exception):
    """The first thing the soak found wrong (message is one line)."""


# ---------------------------------------------------------------------- what the run left


def read_steps(run_dir: Path) -> list[int]:
    """The steps of metrics.jsonl, in order; raises Failure on a torn or unreadable line."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    if text and not text.endswith("\n"):
        raise Failure(f"{path}: ends with a torn line ({text.splitlines()[-1][:60]!r})")
    steps = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError) as err:
            raise Failure(f"{path}:{number}: not a whole record ({err})") from None
    return steps


def logged_steps(run_dir: Path) -> list[int]:
    """What a watch can read while the run writes: the steps of the whole lines so far."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]
        return [int(json.loads(line)["step"]) for line in lines]
    except (OSError, ValueError, KeyError):
        return []


def _store(ckpt_dir: Path):
    from sagc_jax.train.safety.checkpoint import CheckpointStore

    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's missing-metadata warnings
    return CheckpointStore(ckpt_dir)  # a reader: never rotates


def expected_resume(run_dir: Path) -> tuple[int, bool]:
    """(step the next start must resume from, 0 for none; whether it restores it unverified).

    The trainer's rule (``CheckpointStore.newest_verified_step``): the newest step that verifies;
    when no step of the run has an integrity record, the newest step, unverified."""
    from sagc_jax.train.safety.checkpoint import INTEGRITY_FILE

    ckpt = run_dir / "checkpoints"
    if not ckpt.is_dir():
        return 0, False
    store = _store(ckpt)
    try:
        steps = sorted(store.manager.all_steps(), reverse=True)
        if steps and not any((ckpt / str(s) / INTEGRITY_FILE).exists() for s in steps):
            return steps[0], True
        return next((s for s in steps if store.verify(s) is None), 0), False
    finally:
        store.close()


def leftovers(run_dir: Path) -> list[str]:
    """Orphan temporary files, a lock, and checkpoint steps that do not verify."""
    found = [
        str(p.relative_to(run_dir))
        for p in run_dir.rglob("*")
        if "orbax-checkpoint-tmp" in p.name or p.name.endswith(".tmp") or p.name == "run.lock"
    ]
    ckpt = run_dir / "checkpoints"
    store = _store(ckpt)
    try:
        for p in sorted(ckpt.iterdir()):
            if not p.name.isdigit():
                found += [] if "orbax-checkpoint-tmp" in p.name else [f"checkpoints/{p.name}"]
            elif (problem := store.verify(int(p.name))) is not None:
                found.append(f"checkpoints/{p.name} ({problem})")
    finally:
        store.close()
    return found


def final_state(run_dir: Path, step: int) -> tuple[dict, dict]:
    """({item: {leaf path: numpy array}}, meta) of checkpoint ``step``: every array item
    (params, opt_state, the hybrid's prompt table) restored as saved, onto one device."""
    import jax
    import orbax.checkpoint as ocp

    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's missing-metadata warnings
    step_dir = run_dir / "checkpoints" / str(step)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = {}
    for item in sorted(p.name for p in step_dir.iterdir() if p.is_dir() and p.name != "meta"):
        meta = ocp.StandardCheckpointer().metadata(step_dir / item)
        meta = getattr(meta, "item_metadata", meta)
        to_shape = lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device)  # noqa: E731
        targets[item] = jax.tree.map(to_shape, meta)
    store = _store(run_dir / "checkpoints")
    try:
        items, meta = store.restore(step, targets)
    finally:
        store.close()
    flat = {
        name: {jax.tree_util.keystr(k): jax.device_get(v) for k, v in jax.tree.leaves_with_path(t)}
        for name, t in items.items()
    }
    return flat, meta


def first_difference(a, b, where: str) -> str | None:
    """Where JSON-like trees ``a`` and ``b`` (numpy arrays inside) first differ, bit for bit."""
    import numpy as np

    if isinstance(a, dict) and isinstance(b, dict):
        if sorted(a) != sorted(b):
            return f"{where}: keys {sorted(set(a) ^ set(b))} in one only"
        return next((d for k in a if (d := first_difference(a[k], b[k], f"{where}.{k}"))), None)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return f"{where}: {len(a)} items against {len(b)}"
        pairs = enumerate(zip(a, b, strict=True))
        return next(
            (d for i, (x, y) in pairs if (d := first_difference(x, y, f"{where}[{i}]"))), None
        )
    x, y = np.asarray(a), np.asarray(b)
    if x.dtype != y.dtype or x.shape != y.shape:
        return f"{where}: {x.dtype}{list(x.shape)} against {y.dtype}{list(y.shape)}"
    if x.dtype.kind in "fc":  # bit for bit: -0.0 is not 0.0, a NaN equals the same NaN
        x, y = x.view(f"V{x.dtype.itemsize}"), y.view(f"V{y.dtype.itemsize}")
    if np.array_equal(x, y):
        return None
    differ = int(np.sum(x != y)) if x.shape else 1
    return f"{where}: {differ} of {max(x.size, 1)} values differ"


def check_completed(run_dir: Path, reference: tuple[dict, dict], steps: int) -> int:
    """Raise Failure unless the completed run matches the reference; its rejected steps."""
    logged = read_steps(run_dir)
    if logged != list(range(steps + 1)):
        extra = [s for s, n in collections.Counter(logged).items() if n > 1]
        raise Failure(
            f"{run_dir}/metrics.jsonl: steps {logged[:12]}{'...' if len(logged) > 12 else ''} "
            f"(repeated: {extra}), not 0..{steps} once each"
        )
    if found := leftovers(run_dir):
        raise Failure(f"{run_dir}: left behind {', '.join(found[:5])}")
    arrays, meta = final_state(run_dir, steps)
    ref_arrays, ref_meta = reference
    if diff := first_difference(arrays, ref_arrays, "checkpoint"):
        raise Failure(f"{run_dir} step {steps} differs from the reference: {diff}")
    for key in ("step", "controller", "tail_batching", "last_eval"):
        if diff := first_difference(meta.get(key), ref_meta.get(key), f"meta.{key}"):
            raise Failure(f"{run_dir} step {steps} differs from the reference: {diff}")
    rejected = run_dir / "checkpoints-rejected"
    return len(list(rejected.iterdir())) if rejected.is_dir() else 0


# ---------------------------------------------------------------------- one start of a run


@dataclass
class Timing:
    """What the uninterrupted reference took (seconds), to aim kills at stages."""

    to_mesh_s: float = 30.0  # launch to the "train: mesh" line
    compile_s: float = 10.0  # the step-0 line (or mesh line) to the last "compiled" line
    compiled: int = 0  # "compiled" lines printed
    rollout_s: dict[int, float] = field(default_factory=dict)  # step -> time/rollout_s
    step_s: dict[int, float] = field(default_factory=dict)  # step -> time/step_s
    total_s: float = 60.0

    def learn(self, start: Start) -> None:
        """Take what ``start`` took: the latest figures replace older ones (the reference
        starts with a cold compilation cache, later starts find it warm)."""
        mesh = start.seen("train: mesh")
        if not mesh:
            return
        self.to_mesh_s = mesh[0] - start.t0
        compiled = start.seen("compiled ")
        begin = start.step0_at if start.fresh else mesh[0]
        if compiled and begin and len(compiled) >= self.compiled:
            self.compiled, self.compile_s = len(compiled), max(compiled[-1] - begin, 0.0)
        path = start.run_dir / "metrics.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            with contextlib.suppress(ValueError, KeyError):
                record = json.loads(line)
                if record["step"] > start.first and "time/step_s" in record:
                    self.rollout_s[record["step"]] = record["time/rollout_s"]
                    self.step_s[record["step"]] = record["time/step_s"]
        steps_s = sum(self.step_s.values())
        self.total_s = self.to_mesh_s + self.compile_s + steps_s


@dataclass
class Kill:
    signal: str
    stage: str
    aim: str
    progress: int = 0  # the last step logged when the process(es) had ended


class Start:
    """One start of a run (its process or processes) and what a watch sees of it."""

    def __init__(self, cmd: list[str], run_dir: Path, processes: int, log: Path, first: int):
        self.run_dir, self.first = run_dir, first  # the step it must resume from (0: none)
        self.fresh = first == 0
        self.lines: list[tuple[float, str]] = []  # process 0's stdout, with arrival times
        self.t0, self.wall0 = time.monotonic(), time.time()
        self.step_began = self.t0  # the watch's: when the step in progress began
        self.step0_at: float | None = None  # the watch's: when the step-0 line appeared
        self.compiled_lines = 0  # the "compiled" lines a start prints before its first step
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        env.pop("SAGC_JAX_CRASH_AT", None)
        env.pop("JAX_COORDINATOR_ADDRESS", None)
        port = _free_port()
        self.procs, self.logs = [], []
        for i in range(processes):
            extra = []
            if processes > 1:
                extra = [f"--coordinator=localhost:{port}", f"--num-processes={processes}"]
                extra.append(f"--process-id={i}")
            err = open(log.with_suffix(f".p{i}.err"), "w")  # noqa: SIM115 (closed in wait)
            self.logs.append(err)
            self.procs.append(
                subprocess.Popen(
                    [*cmd, *extra],
                    env=env,
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                )
            )
        self.out = open(log.with_suffix(".out"), "w")  # noqa: SIM115
        self.readers = [
            threading.Thread(target=self._read, args=(p, i)) for i, p in enumerate(self.procs)
        ]
        for r in self.readers:
            r.start()

    def _read(self, proc: subprocess.Popen, i: int) -> None:
        for line in proc.stdout:
            if i == 0:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self.out.write(line)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def seen(self, prefix: str) -> list[float]:
        return [t for t, line in list(self.lines) if line.startswith(prefix)]

    def done(self) -> list[int]:
        """The steps logged by this start or kept from before: until the trainer is built
        (its "train: mesh" line), lines past the resume step are a killed start's, which the
        resume trims."""
        done = logged_steps(self.run_dir)
        if self.seen("train: mesh"):
            return done
        return [s for s in done if s <= self.first] if self.first else []

    def writing(self) -> bool:
        """Whether an Orbax temporary directory changed since this start began (a write in
        flight; one a killed start left behind is older)."""
        ckpt = self.run_dir / "checkpoints"
        try:
            tmps = [e for e in os.scandir(ckpt) if "orbax-checkpoint-tmp" in e.name]
            return any(e.stat().st_mtime >= self.wall0 for e in tmps)
        except FileNotFoundError:  # no directory yet, or the write ended as we looked
            return False

    def stage(self, timing: Timing, steps: int, last_growth: float, now: float) -> str:
        """Where the run is now, told from outside (the module docstring says how)."""
        if self.writing():
            return "checkpoint write"
        if now - last_growth <= 2 * POLL_S:
            return "metrics append"
        if not self.seen("train: mesh"):
            return "start-up"
        done = self.done()
        if done and done[-1] >= steps:
            return "finish"
        if self.fresh and not done:
            return "eval"
        compiled = self.seen("compiled ")
        if len(compiled) < timing.compiled:
            return "compile"
        since = now - max([last_growth, *compiled[-1:]])
        nxt = (done[-1] if done else 0) + 1
        return "rollout" if since < timing.rollout_s.get(nxt, 0.0) else "update"

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            for p in self.procs:
                p.wait(max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            self.stop()
            raise Failure(f"{self.run_dir}: a start ran past {timeout:.0f} s (hung?)") from None
        finally:
            for r in self.readers:
                r.join(5)
            for f in [*self.logs, self.out]:
                f.close()
        return [p.returncode for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def stderr(self) -> list[str]:
        return [Path(f.name).read_text() for f in self.logs]

    def resumed_from(self) -> int | None:
        """The step this start resumed from (0: a fresh start), or None when it was stopped
        before it said (its "train: mesh" line comes with the resume line, once restored)."""
        matches = [r.match(line) for _, line in self.lines for r in (RESUMED, FINISHED)]
        step = next((int(m.group(1)) for m in matches if m), None)
        return step if step is not None or not self.seen("train: mesh") else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- aiming


@dataclass
class Aim:
    """When to signal a start: ``kind`` (one of AIMS), a delay, the step it waits for."""

    kind: str
    delay_s: float
    step: int


def draw_aim(rng: random.Random, timing: Timing, first: int, steps: int) -> Aim:
    kind = rng.choice(AIMS)
    step = rng.randint(first + 1, steps)  # a step this start has to run
    rollout = timing.rollout_s.get(step, 1.0)
    delay = {
        "start-up": rng.uniform(0, timing.to_mesh_s),
        "compile": rng.uniform(0, timing.compile_s),
        "rollout": rng.uniform(0, rollout),
        "update": rng.uniform(rollout, max(timing.step_s.get(step, rollout), rollout)),
        "random": rng.uniform(0, timing.total_s),
    }.get(kind, 0.0)
    return Aim(kind, delay, step)


def ready(aim: Aim, start: Start, done: list[int], now: float) -> bool:
    """Whether the watch should signal now."""
    since = now - start.t0
    if aim.kind in ("start-up", "random"):
        return since >= aim.delay_s
    if aim.kind == "compile":  # it begins after the step-0 line, or the mesh line of a resume
        mesh = start.seen("train: mesh")
        begun = start.step0_at if start.fresh else (mesh[0] if mesh else None)
        return begun is not None and now - begun >= aim.delay_s
    if aim.kind == "metrics":
        return bool(done) and done[-1] >= aim.step
    if aim.kind == "checkpoint":
        return start.writing() and bool(done) and done[-1] >= aim.step - 1
    # rollout / update: counted from the line of the step before, or the end of compilation
    compiled = len(start.seen("compiled ")) >= start.compiled_lines
    waited = now - start.step_began >= aim.delay_s
    return compiled and bool(done) and done[-1] >= aim.step - 1 and waited


# ---------------------------------------------------------------------- the soak


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.work = Path(args.work or tempfile.mkdtemp(prefix="sagc-soak-")).absolute()
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / "logs").mkdir(exist_ok=True)
        self.kills: list[Kill] = []
        self.restarts = 0
        self.lost: list[int] = []
        self.unverified = 0
        self.rejected = 0
        self.export_s, self.export_digest = 0.0, ""
        self.checked = 0
        self.timing = Timing()
        self.live: Start | None = None  # the latest start: stopped if the soak itself ends
        self.deadline = time.monotonic() + 60 * args.minutes

    def say(self, line: str) -> None:
        with open(self.work / "soak.log", "a") as log:
            log.write(f"{time.strftime('%H:%M:%S')} {line}\n")

    def command(self, run_dir: Path) -> list[str]:
        a = self.args
        sets = list(TINY) if a.tiny else []
        if a.tiny and a.processes > 1:
            sets.append("train.prompts_per_step=4")  # one whole prompt pair per process
        sets += [
            f"train.steps={a.steps}",
            f"train.checkpoint_every={a.checkpoint_every}",
            "train.compile_ahead=true",
            f"train.compilation_cache_dir={self.work / 'xla-cache'}",
            "logging.progress=false",
            *a.set,
            f"logging.run_dir={run_dir}",
        ]
        cmd = [sys.executable, "-m", "sagc_jax", "train", "--config", str(CONFIG)]
        return [*cmd, *(f"--set={s}" for s in sets)]

    def start(self, run_dir: Path, tag: str, first: int = 0) -> Start:
        log = self.work / "logs" / tag
        start = Start(self.command(run_dir), run_dir, self.args.processes, log, first)
        start.compiled_lines = self.timing.compiled
        self.live = start
        return start

    def reference(self) -> tuple[dict, dict]:
        run_dir = self.work / "reference"
        shutil.rmtree(run_dir, ignore_errors=True)
        start = self.start(run_dir, "reference")
        self.watch(start, None)
        codes = start.wait(self.args.start_timeout)
        if codes != [0] * len(codes):
            raise Failure(f"the reference run ended with {codes}: {_last_line(start)}")
        self.timing.learn(start)
        if (logged := read_steps(run_dir)) != list(range(self.args.steps + 1)):
            raise Failure(f"the reference run logged steps {logged}")
        if found := leftovers(run_dir):
            raise Failure(f"the reference run left behind {', '.join(found[:5])}")
        if self.args.processes == 1:
            out = self.work / "reference-export"
            shutil.rmtree(out, ignore_errors=True)
            began = time.monotonic()
            code, err = self.export(run_dir, out, None, "reference-export")
            self.export_s = time.monotonic() - began
            if code != 0:
                raise Failure(f"the reference export ended with {code}: {_tail(err)}")
            self.export_digest = tree_digest(out)
        return final_state(run_dir, self.args.steps)

    def export(self, run_dir: Path, out: Path, delay: float | None, tag: str) -> tuple[int, str]:
        """Run ``sagc-jax export run_dir out``, signalled after ``delay`` seconds (None: never);
        (exit code, stderr)."""
        cmd = [sys.executable, "-m", "sagc_jax", "export", str(run_dir), str(out)]
        env = dict(
            os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS="--xla_force_host_platform_device_count=1"
        )
        with open(self.work / "logs" / f"{tag}.err", "w+") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
            if delay is not None:
                try:
                    proc.wait(delay)
                except subprocess.TimeoutExpired:
                    sig = self.rng.choice(SIGNALS)
                    proc.send_signal(sig)
                    self.kills.append(Kill(signal.Signals(sig).name, "export", "export"))
            code = proc.wait(self.args.start_timeout)
            err.seek(0)
            return code, err.read()

    def killed_export(self, run_dir: Path, number: int) -> None:
        """Export ``run_dir`` under kills, then to completion; OUT whole or absent throughout."""
        out = self.work / f"export-{number:03d}"
        shutil.rmtree(out, ignore_errors=True)
        for attempt in range(self.args.kills_per_export + 1):
            if out.exists():
                break  # a signal that came after the rename: checked below
            killing = attempt < self.args.kills_per_export and time.monotonic() < self.deadline
            delay = self.rng.uniform(0, 1.2 * self.export_s) if killing else None
            kills = len(self.kills)
            code, err = self.export(run_dir, out, delay, f"export-{number:03d}-{attempt:03d}")
            if "Traceback (most recent call last)" in err:
                raise Failure(f"{out}: the export printed a traceback: {_tail(err)}")
            if len(self.kills) > kills:
                n = getattr(signal, self.kills[-1].signal).value
                allowed = {0, -n} if n == signal.SIGKILL else {0, -n, 128 + n}
            else:
                allowed = {0}
            if code not in allowed:
                raise Failure(f"{out}: the export ended with {code}: {_tail(err)}")
            if out.exists() and tree_digest(out) != self.export_digest:
                raise Failure(f"{out}: exists but differs from the reference export (torn?)")
        if not out.exists():  # every start was signalled: once more, to completion
            code, err = self.export(run_dir, out, None, f"export-{number:03d}-final")
            if code != 0 or tree_digest(out) != self.export_digest:
                raise Failure(f"{out}: the last export ended with {code}: {_tail(err)}")
        if (staging := out.with_name(out.name + ".export-tmp")).exists():
            raise Failure(f"{staging} was left behind")
        shutil.rmtree(out)

    def killed_run(self, number: int, reference: tuple[dict, dict]) -> None:
        run_dir = self.work / f"run-{number:03d}"
        shutil.rmtree(run_dir, ignore_errors=True)
        kills_here, previous = 0, None
        for attempt in range(10_000):
            expect, unverified = expected_resume(run_dir)
            stopping = time.monotonic() >= self.deadline or kills_here >= self.args.kills_per_run
            stopping = stopping or expect >= self.args.steps  # finished: the start only says so
            aim = None if stopping else draw_aim(self.rng, self.timing, expect, self.args.steps)
            start = self.start(run_dir, f"run-{number:03d}-{attempt:03d}", expect)
            if attempt:
                self.restarts += 1
            kill = self.watch(start, aim)
            codes = start.wait(self.args.start_timeout)
            self.timing.learn(start)
            if kill is not None:
                kill.progress = max(logged_steps(run_dir), default=0)
            got = start.resumed_from()
            self.say(
                f"{start.run_dir.name} start {attempt}: resumed from {got} (expected {expect}"
                f"{', unverified' if unverified else ''}), aim {aim}, kill {kill}, exit {codes}"
            )
            if got is not None and got != expect:
                raise Failure(
                    f"{run_dir} start {attempt}: resumed from step {got}, the newest verified "
                    f"step is {expect}"
                )
            self.unverified += unverified
            if previous is not None:
                self.lost.append(max(previous.progress - expect, 0))
            self.check_exit(start, codes, kill)
            if kill is None:
                break  # the run completed (any other end failed check_exit)
            self.kills.append(kill)
            kills_here += 1
            previous = kill
        self.rejected += check_completed(run_dir, reference, self.args.steps)
        if self.args.processes == 1:
            self.killed_export(run_dir, number)
        self.checked += 1
        if not self.args.keep_runs:
            shutil.rmtree(run_dir)

    def watch(self, start: Start, aim: Aim | None) -> Kill | None:
        """Signal ``start`` when ``aim`` is met; the kill, or None if it ended first (or
        there is no aim: the start is only watched)."""
        sig = self.rng.choice(SIGNALS)
        victim = self.rng.randrange(len(start.procs))
        metrics = start.run_dir / "metrics.jsonl"
        size, last_growth, done = -1, -1e9, start.done()
        while start.alive():
            now = time.monotonic()
            try:
                new = metrics.stat().st_size
            except FileNotFoundError:
                new = 0
            if new != size:
                size, before, done = new, done, start.done()
                if len(done) > len(before):  # a line appended (a resume's trim shortens it)
                    last_growth = start.step_began = now
                    start.step0_at = start.step0_at or now
            compiled = start.seen("compiled ")
            if len(compiled) == self.timing.compiled and compiled:
                start.step_began = max(start.step_began, compiled[-1])
            if aim is not None and ready(aim, start, done, now):
                stage = start.stage(self.timing, self.args.steps, last_growth, now)
                with_pid = start.procs[victim]
                if with_pid.poll() is not None:
                    return None
                with_pid.send_signal(sig)
                return Kill(signal.Signals(sig).name, stage, aim.kind)
            time.sleep(POLL_S)
        return None

    def check_exit(self, start: Start, codes: list[int], kill: Kill | None) -> None:
        for i, (code, err) in enumerate(zip(codes, start.stderr(), strict=True)):
            if "Traceback (most recent call last)" in err:
                raise Failure(f"{start.run_dir} process {i}: a traceback: {_tail(err)}")
            allowed = {0}
            if kill is not None:
                n = getattr(signal, kill.signal).value
                allowed |= {-n} if n == signal.SIGKILL else {-n, 128 + n}
                if len(codes) > 1:
                    allowed |= {EXIT_PEER_LOST, 128 + signal.SIGTERM}
            if code not in allowed:
                what = f"after {kill.signal} in {kill.stage}" if kill else "unsignalled"
                raise Failure(f"{start.run_dir} process {i}: exit code {code} {what}: {_tail(err)}")

    def summary(self, verdict: str) -> str:
        a = self.args
        kinds = collections.Counter(k.signal for k in self.kills)
        stages = collections.Counter(k.stage for k in self.kills)
        minutes = (time.monotonic() - self.deadline) / 60 + a.minutes
        return (
            f"soak ({a.processes} process{'es' if a.processes > 1 else ''}, "
            f"{'tiny ' if a.tiny else ''}demo, {a.steps} steps, checkpoint every "
            f"{a.checkpoint_every}, {minutes:.1f} min): {len(self.kills)} kills "
            f"({_counts(kinds)}; {_counts(stages)}), {self.restarts} restarts, max "
            f"{max(self.lost, default=0)} steps lost per kill, {self.unverified} unverified "
            f"resumes, {self.rejected} steps set aside, {self.checked} runs checked: {verdict}"
        )


def _counts(counter: collections.Counter) -> str:
    return ", ".join(f"{k} {n}" for k, n in counter.most_common()) or "none"


def _tail(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-2:])[:300] or "(no output)"


def _last_line(start: Start) -> str:
    return " / ".join(_tail(e) for e in start.stderr())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="wall time to spend")
    parser.add_argument("--steps", type=int, default=8, help="train.steps of every run")
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument("--processes", type=int, choices=(1, 2), default=1)
    parser.add_argument("--tiny", action="store_true", help="tests' tiny run (a self-check)")
    parser.add_argument("--kills-per-run", type=int, default=8, help="then it may complete")
    parser.add_argument("--kills-per-export", type=int, default=2, help="1 process only")
    parser.add_argument("--start-timeout", type=float, default=1800.0, help="a start that hangs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kills (not the run)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--work", help="work directory (default: a new one under $TMPDIR)")
    parser.add_argument("--keep-runs", action="store_true", help="keep the checked runs")
    args = parser.parse_args()
    soak = Soak(args)
    # a SIGTERM (a `timeout`) ends the soak like a Ctrl-C: through the `finally` that stops the
    # trainer it started
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    print(f"soak: working in {soak.work} (a line per start in soak.log)", flush=True)
    verdict = "PASS"
    try:
        reference = soak.reference()
        number = 0
        while number == 0 or time.monotonic() < soak.deadline:
            number += 1
            soak.killed_run(number, reference)
            soak.say(soak.summary("so far"))
    except Failure as err:
        verdict = f"FAIL: {err}"
    finally:
        if soak.live is not None:
            soak.live.stop()  # a Ctrl-C or an error of the soak leaves no trainer running
    soak.say(soak.summary(verdict))
    print(soak.summary(verdict))
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
