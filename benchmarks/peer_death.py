"""How fast the survivor of a two-process run stops when the other process is SIGKILLed.

Two local CPU processes train the tiny preset (tests/parallel/test_dead_peer.py's run:
checkpoints every 2 steps, 4 steps); ``--kill`` chooses the process that kills itself in step 4
(0, the jax.distributed coordinator, or 1). Prints, per repeat, the survivor's exit code, the
seconds from the death to the survivor's exit, and the survivor's stderr lines; then the range.

    .venv/bin/python benchmarks/peer_death.py --kill 0 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_dead_peer import RUN, _free_port  # noqa: E402  (the test's own run)


def one_death(kill: int, peer_timeout: float) -> tuple[int, float, list[str]]:
    """(survivor's exit code, seconds from the death to its exit, its stderr lines)."""
    with tempfile.TemporaryDirectory(prefix="peer-death-") as run_dir:
        return _one_death(kill, peer_timeout, run_dir)


def _one_death(kill: int, peer_timeout: float, run_dir: str) -> tuple[int, float, list[str]]:
    port = _free_port()
    procs = []
    for i in range(2):
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
        env.pop("JAX_COORDINATOR_ADDRESS", None)
        if i == kill:
            env["SAGC_JAX_CRASH_AT"] = "rollout:3"  # SIGKILL in step 4
        cmd = [sys.executable, "-m", "sagc_jax", "train"]
        cmd += [f"--set={o}" for o in [*RUN, f"logging.run_dir={run_dir}"]]
        cmd += [f"--coordinator=localhost:{port}", "--num-processes=2", f"--process-id={i}"]
        cmd += [f"--peer-timeout={peer_timeout:g}"]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        )
    errs = [""] * 2

    def drain(i: int) -> None:
        errs[i] = procs[i].stderr.read()

    readers = [threading.Thread(target=drain, args=(i,)) for i in range(2)]
    for reader in readers:
        reader.start()
    ends: list[float | None] = [None, None]
    while None in ends:
        for i, proc in enumerate(procs):
            if ends[i] is None and proc.poll() is not None:
                ends[i] = time.monotonic()
        time.sleep(0.01)
    for reader in readers:
        reader.join()
    survivor = 1 - kill
    lines = [line for line in errs[survivor].splitlines() if line.strip()]
    return procs[survivor].returncode, ends[survivor] - ends[kill], lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill", type=int, choices=(0, 1), default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer-timeout", type=float, default=10.0)
    args = parser.parse_args()
    seconds = []
    for r in range(args.repeats):
        code, after, lines = one_death(args.kill, args.peer_timeout)
        seconds.append(after)
        print(f"repeat {r}: survivor exit {code}, {after:.2f} s after the death; {lines}")
    print(
        f"process {args.kill} killed, --peer-timeout {args.peer_timeout:g}: the survivor "
        f"stopped {min(seconds):.2f}-{max(seconds):.2f} s after the death ({args.repeats} runs)"
    )


if __name__ == "__main__":
    main()
