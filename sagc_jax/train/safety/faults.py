"""Stopping a run cleanly, and crashing or signalling it on purpose for the fault tests.

Two ways a stop signal (SIGTERM: a TPU preemption notice; SIGINT: Ctrl-C) is handled:

- ``StopRequest``, inside a step loop (train, sft), turns it into a flag the loop checks between
  steps: the current step finishes, a checkpoint is written, the run exits. In multi-process runs
  every process stops at the same step through JAX's preemption sync point.
- Everywhere else (start-up, compilation, evaluation), the process-wide handler of
  ``stop_signals`` (installed by ``sagc_jax.cli.main``) raises :class:`Interrupted` and records
  the signal. A JAX callback may wrap that exception into another one or swallow it; the record
  still tells: ``phase`` turns any exception raised while a signal is pending into
  ``Interrupted``, and raises it at its end if the signal was swallowed. A signal that lands
  inside an import (start-up imports jax, numpy and their C extensions, which print what an
  import they make raises) is sent again 50 ms later, until it lands outside one.

``Interrupted`` knows what was stopped (the innermost ``phase``) and what was saved; the command
line prints that as one line and exits with 128 + the signal number.

``crash_point`` lets tests stop the process at a named point: with the environment variable
``SAGC_JAX_CRASH_AT=point:step`` set, the process sends itself SIGKILL when it reaches that point
of that step (``rollout``, ``update``, ``checkpoint`` of a train step); with
``point:step:SIGTERM`` (or ``SIGINT``) it sends that signal instead, at those points or at
``startup``, ``eval`` (the step-0 evaluation), ``compile`` and ``sft`` (before an SFT step).
Nothing happens without it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

CRASH_ENV = "SAGC_JAX_CRASH_AT"
SIGNALS = (signal.SIGTERM, signal.SIGINT)

_received: int | None = None  # the first stop signal since stop_signals() was entered
_phases: list[tuple[str, str]] = []  # (what is running, what a stop keeps), outermost first
_phases_entered = False  # once a phase ran, an empty stack no longer means start-up


def crash_point(point: str, step: int) -> None:
    """Signal this process if ``SAGC_JAX_CRASH_AT`` names this point and step."""
    parts = os.environ.get(CRASH_ENV, "").split(":")
    if parts[:2] == [point, str(step)]:
        os.kill(os.getpid(), getattr(signal, parts[2]) if len(parts) > 2 else signal.SIGKILL)


def resume_hint(cfg, run_dir: str | Path) -> str:
    """How to continue a run in ``run_dir``: the same command when it names the directory."""
    if cfg.logging.run_dir:
        return "run the same command to resume"
    return f"run the same command with --set logging.run_dir={run_dir} to resume"


class Interrupted(BaseException):
    """A stop signal ended a command outside its step loop (or a step loop that then saved).

    A BaseException, like KeyboardInterrupt, so that ``except Exception`` (a reward function's
    guard, a retry) does not swallow it. ``during``: what was running (default: the current
    phases, innermost first); ``saved``: what was kept and how to resume (default: the innermost
    phase's, else "nothing was saved").
    """

    def __init__(self, signum: int, during: str | None = None, saved: str | None = None):
        super().__init__(signum)
        self.signum = signum
        if during is None:
            during = " of ".join(what for what, _ in reversed(_phases))
            if not during and not _phases_entered:
                during = "start-up"
        self.during = during
        kept = [keep for _, keep in reversed(_phases) if keep]
        self.saved = saved or (kept[0] if kept else "nothing was saved")

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def message(self, command: str) -> str:
        """The one line the command line prints."""
        during = f" during {self.during}" if self.during else ""
        return f"{command}: stopped by {self.name}{during}; {self.saved}"

    def __str__(self) -> str:
        return self.message("sagc-jax")


def received() -> int | None:
    """The stop signal this process received (inside ``stop_signals``), if any."""
    return _received


def check_stop() -> None:
    """A safe point: raise ``Interrupted`` if a stop signal arrived and was not acted on."""
    if _received is not None:
        raise Interrupted(_received)


IMPORT_RETRY_S = 0.05  # a signal that lands in an import is delivered again this much later


def _raise_interrupted(signum, frame) -> None:
    global _received
    if _received is None:
        _received = signum
    if _importing(frame):
        # A C extension that imports a module prints what that import raises (PyErr_Print: a
        # traceback) before our one line; the signal is sent again once the import is done.
        timer = threading.Timer(IMPORT_RETRY_S, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()
        return
    raise Interrupted(signum)


def _importing(frame) -> bool:
    """Whether ``frame`` runs inside an import (a module's top level, at any depth)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Install the process-wide handler (raise ``Interrupted``) for SIGTERM and SIGINT; the
    previous handlers come back on exit. Outside the main thread nothing is installed."""
    global _received, _phases_entered
    _received, _phases_entered = None, False
    _phases.clear()
    previous = {}
    for sig in SIGNALS:
        try:
            previous[sig] = signal.signal(sig, _raise_interrupted)
        except ValueError:  # not the main thread: leave signals alone
            pass
    unraisable = sys.unraisablehook

    def quiet_stop(info) -> None:  # raised in a callback that cannot raise (JAX's gc hook)
        if not isinstance(info.exc_value, Interrupted):  # that one is recorded: say nothing
            unraisable(info)

    sys.unraisablehook = quiet_stop
    try:
        yield
    finally:
        sys.unraisablehook = unraisable
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _received = None


@contextlib.contextmanager
def phase(what: str, saved: str = "") -> Iterator[None]:
    """Run a stretch of work (``what``: "the step-0 evaluation") that a stop signal may end.

    ``saved``: what a stop here keeps and how to resume. Any exception raised while a signal is
    pending becomes ``Interrupted`` (a JAX callback may have wrapped it); a signal swallowed
    inside is raised at the end.
    """
    global _phases_entered
    _phases.append((what, saved))
    _phases_entered = True
    try:
        yield
        check_stop()
    except Interrupted:
        raise
    except BaseException:
        if _received is None:
            raise
        raise Interrupted(_received) from None
    finally:
        _phases.pop()


class StopRequest:
    """Context manager for a step loop: catches SIGTERM/SIGINT and records which arrived.

    A signal already pending on entry (swallowed before the loop) stops at once (several
    processes: after the first step, all together). A second SIGINT inside stops at once too,
    keeping the checkpoints written before it.
    """

    SIGNALS = SIGNALS

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise Interrupted(signum, "a step (a second SIGINT)", "earlier checkpoints are kept")
        self.signum = signum

    def __enter__(self) -> StopRequest:
        if _received is not None:  # a stop that arrived (and was swallowed) before the loop
            import jax

            if jax.process_count() == 1:
                raise Interrupted(_received)
            self.signum = _received  # the first should_stop tells the others: all stop together
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
