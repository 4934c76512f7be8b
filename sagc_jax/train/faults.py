"""Stopping a run cleanly, and crashing it on purpose for the crash-resume tests.

``StopRequest`` turns SIGTERM (a TPU preemption notice) and SIGINT into a flag the training loop
checks between steps: the current step finishes, a checkpoint is written, the run exits. In
multi-process runs every process stops at the same step through JAX's preemption sync point.

``crash_point`` lets tests kill the process at a named phase: with the environment variable
``SAGC_JAX_CRASH_AT=phase:step`` set, the process sends itself SIGKILL when it reaches that phase
of that step (phases: ``rollout``, ``update``, ``checkpoint``). Nothing happens without it.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "SAGC_JAX_CRASH_AT"
PHASES = ("rollout", "update", "checkpoint")


def crash_point(phase: str, step: int) -> None:
    """SIGKILL this process if ``SAGC_JAX_CRASH_AT`` names this phase and step."""
    target = os.environ.get(CRASH_ENV)
    if target and target == f"{phase}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


class StopRequest:
    """Context manager: catches SIGTERM/SIGINT and records which arrived."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signum = signum

    def __enter__(self) -> StopRequest:
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def should_stop(self, step: int) -> bool:
        """True when a stop was requested here or, multi-process, on any process (a signal to
        one of them, or a preemption notice at JAX's sync point): all then stop at this step.
        A stop that came from elsewhere is recorded as SIGTERM."""
        import jax

        if jax.process_count() == 1:
            return self.signum is not None
        from jax.experimental import multihost_utils

        from sagc_jax.parallel import any_process

        stop = any_process(self.signum is not None)
        stop = multihost_utils.reached_preemption_sync_point(step) or stop
        if stop and self.signum is None:
            self.signum = signal.SIGTERM
        return stop

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""
