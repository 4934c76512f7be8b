"""Multi-process runs on JAX's own runtime: start-up, the few host-side collectives, and the
watch that stops the survivors of a process that died.

Every process runs the same program on its own slice of the rows; the host values they must
agree on (the group size of a step, whether to checkpoint or stop, the rollout statistics the
controller sees) go through ``jax.experimental.multihost_utils``. In a single process every
helper here is the identity.

**A process that dies.** jax.distributed finds a dead process by its heartbeats (100 s by
default), then its runtime ends every other process with a fatal error: a C++ stack dump and
SIGABRT, which Python cannot catch (jaxlib 0.10's ``missed_heartbeat_callback`` cannot call
Python: it throws ``std::bad_cast``). So every process also beats in the coordination service's
key-value store (:class:`PeerWatch`, once a second) and checks the others' beats: a process
whose beat has not changed for ``peer_timeout_s`` seconds is dead, and every survivor prints one
line naming it and exits with :data:`EXIT_PEER_LOST`, within ``peer_timeout_s`` + 1 s of the
death. The runtime's own heartbeat timeout is set well past that (``peer_timeout_s`` plus the
larger of itself and a minute: :func:`runtime_heartbeat_timeout`), so that this watch speaks
first even on a loaded host; it stays as the backstop, and the supervisor names the process it
reports.
Process 0 hosts the coordination service: when it dies, the others lose the service at once
and the runtime ends them within a second with its own fatal message; nothing in jaxlib 0.10
lets Python replace that message from inside the process, so
each process of a multi-process run trains in a child process and its parent
(``sagc_jax.parallel.supervisor``) prints the one line instead, with the same exit code.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.errors import JaxRuntimeError
from jax.experimental import multihost_utils

from sagc_jax.config import ConfigError
from sagc_jax.parallel.supervisor import EXIT_PEER_LOST

ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
PEER_TIMEOUT_S = 10.0  # --peer-timeout: seconds without a beat after which a process is dead
BACKSTOP_MARGIN_S = 60.0  # the runtime's heartbeat timeout is at least this past --peer-timeout


def initialize(
    coordinator: str | None,
    num_processes: int | None,
    process_id: int | None,
    peer_timeout_s: float = PEER_TIMEOUT_S,
) -> bool:
    """Start ``jax.distributed`` when asked; returns whether this is a multi-process run.

    coordinator: ``HOST:PORT`` of process 0 (with num_processes and process_id), ``auto`` (Cloud
    TPU VMs, SLURM, Open MPI detect everything) or None. Without the flag, the environment
    variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID are used when set.
    peer_timeout_s: seconds without a beat after which a process counts as dead (see
    :class:`PeerWatch`); jax.distributed's own heartbeat timeout is
    ``runtime_heartbeat_timeout(peer_timeout_s)``.
    Must run before anything touches a device.
    """
    if not peer_timeout_s >= 1:
        raise ConfigError(f"--peer-timeout {peer_timeout_s:g}: expected at least 1 (seconds)")
    if coordinator is None and os.environ.get("JAX_COORDINATOR_ADDRESS"):
        missing = [v for v in ENV_VARS if not os.environ.get(v)]
        if missing:
            raise ConfigError(
                f"JAX_COORDINATOR_ADDRESS is set but {', '.join(missing)} is not; set all of "
                f"{', '.join(ENV_VARS)}"
            )
        coordinator = os.environ["JAX_COORDINATOR_ADDRESS"]
        num_processes = _int_env("JAX_NUM_PROCESSES")
        process_id = _int_env("JAX_PROCESS_ID")
    if coordinator is None:
        if num_processes is not None or process_id is not None:
            raise ConfigError("--num-processes/--process-id need --coordinator HOST:PORT")
        return False
    # CPU processes talk through gloo (the default CPU collectives stay inside one process);
    # GPU and TPU collectives are unaffected by this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    heartbeat = {"heartbeat_timeout_seconds": runtime_heartbeat_timeout(peer_timeout_s)}
    if coordinator == "auto":
        jax.distributed.initialize(**heartbeat)
        return jax.process_count() > 1
    if num_processes is None or process_id is None:
        raise ConfigError(
            f"--coordinator {coordinator} needs --num-processes N and --process-id I "
            f"(or use --coordinator auto on a Cloud TPU VM / SLURM)"
        )
    if ":" not in coordinator:
        raise ConfigError(f"--coordinator {coordinator!r}: expected HOST:PORT or auto")
    if not 0 <= process_id < num_processes:
        raise ConfigError(
            f"--process-id {process_id} is outside [0, {num_processes}) (--num-processes)"
        )
    jax.distributed.initialize(coordinator, num_processes, process_id, **heartbeat)
    return num_processes > 1


def _int_env(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def is_leader() -> bool:
    """True on process 0, the one that writes logs and prints."""
    return jax.process_index() == 0


def from_leader(value):
    """Process 0's ``value`` (a number or numpy array) on every process."""
    if jax.process_count() == 1:
        return value
    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(value)))


def gather_rows(local: np.ndarray) -> np.ndarray:
    """Every process's rows of ``local`` concatenated in process order (same on all)."""
    if jax.process_count() == 1:
        return np.asarray(local)
    return np.asarray(multihost_utils.process_allgather(np.asarray(local), tiled=True))


def any_process(flag: bool) -> bool:
    """True on every process when ``flag`` is True on any of them."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.bool_))))


# ---------------------------------------------------------------------- a process that dies

_KEY = "sagc_jax/peer/"
# What a process leaves in place of its beat when it ends: DONE (finished, or stopped with the
# others by the step loop), FAILED (an exception: it goes on to jax.distributed's shutdown, a
# barrier of every process), STOPPED (a signal outside the step loop: it exits without that
# shutdown), LOST (it saw another process die and exits without that shutdown).
DONE, FAILED, STOPPED, LOST = "done", "failed", "stopped", "lost"
_END_MARKS = (DONE, FAILED, STOPPED, LOST)


class PeerWatch:
    """Every process's beat in jax.distributed's key-value store, checked by every other.

    A thread writes this process's beat (a counter) every ``interval_s`` (1 s; a quarter of
    ``timeout_s`` when that is shorter) and reads every other's. A process whose beat has not
    changed for ``timeout_s`` seconds and that left no end mark is dead; one that left FAILED or
    STOPPED has ended. Either way this process prints ``report(what)`` (one line) and exits with
    :data:`EXIT_PEER_LOST`: after a death or a STOPPED without jax.distributed's shutdown (its
    barrier would wait for the missing process, then abort), after a FAILED through it (the
    failed process waits there for everyone). A FAILED or STOPPED mark counts once it is
    ``timeout_s`` old, so that a process stopping for the same reason (a signal to every
    process, the same error everywhere) reports its own end. When a collective fails, the main
    thread calls :meth:`explain` before it reports anything itself.

    The client's calls fail with ``JaxRuntimeError`` when the coordination service is gone or
    refuses them: the watch handles those. When process 0 stalls (stopped, swapping, a hung
    host) its service neither answers nor fails, and the call blocks, or its calls fail only
    after a while: a second thread (the guard) ends this process once no exchange has been
    answered for ``timeout_s``, counted from the start of the first unanswered one. Any other
    error is not its to judge: it says so in one line on stderr (what it could not do, the
    error, what follows) and goes on ending.
    """

    def __init__(
        self,
        client,
        process_id: int,
        num_processes: int,
        timeout_s: float,
        report,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client, self.me, self.n = client, process_id, num_processes
        self.timeout_s = timeout_s
        self.clock = clock  # what "timeout_s seconds" are measured with (tests: a fake clock)
        self.interval_s = min(1.0, timeout_s / 4)
        self.report: Callable[[str], str] = report
        self._seen: dict[int, tuple[str | None, float]] = {}  # peer -> (value, when it changed)
        self._seen_lock = threading.Lock()
        self._exit_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sagc-jax-peer-watch", daemon=True)
        self._guard = threading.Thread(
            target=self._guard_run, name="sagc-jax-peer-guard", daemon=True
        )
        self._silent_since: float | None = None  # when the first unanswered exchange began

    def start(self) -> PeerWatch:
        self._exchange(0)
        self._thread.start()
        self._guard.start()
        return self

    def _coordinator_silent(self, how: str) -> str:
        return (
            f"process 0 of {self.n} (the jax.distributed coordinator) {how} "
            f"({self.timeout_s:g} s, --peer-timeout)"
        )

    def _values(self) -> dict[int, str]:
        return {int(k.rsplit("/", 1)[-1]): v for k, v in self.client.key_value_dir_get(_KEY)}

    def _exchange(self, beat: int) -> None:
        """Write this process's beat, read everyone's."""
        self.client.key_value_set(f"{_KEY}{self.me}", str(beat), allow_overwrite=True)
        values = self._values()
        now = self.clock()
        with self._seen_lock:
            for peer in range(self.n):
                if peer != self.me and self._seen.get(peer, ("", 0.0))[0] != values.get(peer):
                    self._seen[peer] = (values.get(peer), now)

    def _run(self) -> None:
        beat = 0
        while not self._stop.wait(self.interval_s):
            beat += 1
            if self._silent_since is None:  # counts from the first exchange not answered
                self._silent_since = self.clock()
            try:
                self._exchange(beat)
                self._silent_since = None
            except JaxRuntimeError:  # the coordination service does not answer (process 0 gone)
                self._check_coordinator()
                continue
            except Exception as err:
                self._silent_since = None  # not the coordinator's silence: the guard stays quiet
                self._unexpected(
                    "exchange beats",
                    err,
                    "it stops: the other processes will stop the run "
                    f"within --peer-timeout ({self.timeout_s:g} s), naming this one",
                )
                return
            if (verdict := self._verdict(grace=True)) is not None:
                self._lost(*verdict)

    def _guard_run(self) -> None:
        """End this process when the coordination service has not answered for ``timeout_s``
        while an exchange hangs (a stalled process 0: its service holds the call open)."""
        while not self._stop.wait(self.interval_s):
            self._check_coordinator()

    def _check_coordinator(self) -> None:
        """End this process once no exchange has been answered for ``timeout_s``, counted from
        the start of the first unanswered one, whether its calls fail (the service is gone or
        refuses them) or hang (a stalled process 0), or both in turn: calls that fail after a
        while must not stretch the wait past the runtime's own heartbeat timeout. No end mark
        is left: the service that holds the marks is what stopped answering."""
        since = self._silent_since
        if since is not None and self.clock() - since > self.timeout_s:
            self._lost(self._coordinator_silent("stopped answering"), shutdown=False, mark=False)

    def _verdict(self, grace: bool) -> tuple[str, bool, bool] | None:
        """(what happened to the first process that died, stopped or failed; whether it takes
        part in jax.distributed's shutdown; whether to leave this process's end mark), or None.
        ``grace``: count an end mark only once it is ``timeout_s`` old.

        A silent process 0 is named as the guard names it, and no mark is left: its service,
        which holds the marks, may be what stalled (writing one would hang)."""
        now = self.clock()
        with self._seen_lock:
            seen = sorted(self._seen.items())
        for peer, (value, since) in seen:
            old = now - since > self.timeout_s
            who = f"process {peer} of {self.n}"
            if value not in _END_MARKS and old and peer == 0:
                return self._coordinator_silent("stopped answering"), False, False
            if value not in _END_MARKS and old:
                return (
                    f"{who} stopped responding (no heartbeat for {self.timeout_s:g} s, "
                    f"--peer-timeout)",
                    False,
                    True,
                )
            if value == STOPPED and (old or not grace):
                return f"{who} was stopped by a signal", False, True
            if value == FAILED and (old or not grace):
                return f"{who} failed (see its output)", True, True
        return None

    def _lost(self, what: str, shutdown: bool, mark: bool = True) -> None:
        """Print the one line and exit; ``shutdown``: through jax.distributed's shutdown;
        ``mark``: leave the LOST mark first (not when the service hangs)."""
        with self._exit_lock:  # one line, from whichever thread comes first
            if self._stop.is_set() and threading.current_thread() is not threading.main_thread():
                return  # this process is finishing: it no longer speaks for the run
            try:
                line = self.report(what)
            except Exception as err:  # the line must come out whatever the hook does
                line = f"{what} ({type(err).__name__} while describing the run: {err})"
            sys.stdout.flush()
            print(line, file=sys.stderr, flush=True)
            try:
                if shutdown:
                    jax.distributed.shutdown()
                elif mark:
                    self.client.key_value_set(f"{_KEY}{self.me}", LOST, allow_overwrite=True)
                    if self.me == 0:
                        self._let_the_others_go_first()
            except JaxRuntimeError:
                pass  # the service is gone too: the others find this process by its silence
            except Exception as err:
                self._unexpected("leave its end mark", err)
            os._exit(EXIT_PEER_LOST)

    def _let_the_others_go_first(self) -> None:
        """Process 0 hosts the coordination service, and the runtime aborts every process that
        loses it: wait (3 beats at most) for every other survivor's end mark."""
        now = time.monotonic()
        with self._seen_lock:
            waiting = {
                p
                for p, (value, since) in self._seen.items()
                if value not in _END_MARKS and now - since <= self.timeout_s
            }
        deadline = time.monotonic() + 3 * self.interval_s
        while waiting and time.monotonic() < deadline:
            values = self._values()
            waiting = {p for p in waiting if values.get(p) not in _END_MARKS}
            time.sleep(0.2)  # also lets the last of them reach its exit after its mark

    def explain(self) -> None:
        """After a collective failed in this process: exit naming a process that died, stopped
        or failed, or return (the failure is this process's own) once every other process has
        beaten twice since (one change seen could be a beat written just before it died).

        Takes at most ``timeout_s`` + 2 beats."""
        deadline = self.clock() + self.timeout_s + 2 * self.interval_s
        last: dict[int, str | None] | None = None
        changes = dict.fromkeys(range(self.n), 0)
        while True:
            if (verdict := self._verdict(grace=False)) is not None:
                self._lost(*verdict)
            with self._seen_lock:
                values = {p: v for p, (v, _) in self._seen.items()}
            for peer, value in values.items():
                changes[peer] += last is not None and value != last[peer]
            beating = [p for p, v in values.items() if v not in _END_MARKS]
            if all(changes[p] >= 2 for p in beating) or self.clock() > deadline:
                return
            last = values
            time.sleep(self.interval_s / 2)

    def finish(self, mark: str) -> None:
        """Stop watching and leave ``mark`` (DONE, FAILED or STOPPED) in place of the beat."""
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s)
        self._guard.join(timeout=5 * self.interval_s)
        try:
            self.client.key_value_set(f"{_KEY}{self.me}", mark, allow_overwrite=True)
        except JaxRuntimeError:
            pass  # the service is gone: nobody is left to read the mark
        except Exception as err:
            self._unexpected(f"leave its end mark ({mark})", err)

    def _unexpected(self, what: str, err: Exception, follows: str = "") -> None:
        """One line on stderr for an error the watch cannot handle (``follows``: what happens
        next; default: this process is ending, which the others may take a while to see)."""
        text = (str(err).strip().splitlines() or [""])[0][:160]
        follows = follows or (
            f"this process ends anyway; the others may take --peer-timeout ({self.timeout_s:g} "
            f"s) to see it"
        )
        print(
            f"process {self.me} of {self.n}: the peer watch could not {what} "
            f"({type(err).__name__}: {text}); {follows}",
            file=sys.stderr,
            flush=True,
        )


def watch_peers(timeout_s: float, report: Callable[[str], str]) -> PeerWatch | None:
    """Start this process's :class:`PeerWatch`; None in a single-process run.

    ``report(what)`` turns "process 1 of 2 stopped responding (...)" into the line to print
    (adding what was saved and how to resume)."""
    from jax._src import distributed  # the client that jax.distributed.initialize connected

    state = distributed.global_state
    if state.client is None or state.num_processes == 1:
        return None
    return PeerWatch(state.client, state.process_id, state.num_processes, timeout_s, report).start()


def runtime_heartbeat_timeout(peer_timeout_s: float) -> int:
    """jax.distributed's own heartbeat timeout, the backstop of :class:`PeerWatch`: far enough
    past ``peer_timeout_s`` (plus the larger of itself and ``BACKSTOP_MARGIN_S``) that the
    watch speaks first even on a host so loaded that its threads run late."""
    return math.ceil(peer_timeout_s + max(peer_timeout_s, BACKSTOP_MARGIN_S))


def run_rank(
    train: Callable[[], int],
    report: Callable[[str], str],
    *,
    coordinator: str | None,
    num_processes: int | None,
    process_id: int | None,
    peer_timeout: float,
    stopped: Callable[[], bool],
    bad_input: Callable[[], tuple[type[Exception], ...]],
) -> int:
    """``train()`` as one process of the run (or the only one): jax.distributed started before
    any device use; the other processes watched (one that dies, stops or fails ends this one
    with the line ``report(what)`` and :data:`EXIT_PEER_LOST`); this process's own end left for
    them to read. ``stopped()``: whether a stop signal has arrived (an error then means STOPPED,
    not FAILED); an error of a ``bad_input()`` type is this process's own, raised without
    waiting to hear of the others."""
    initialize(coordinator, num_processes, process_id, peer_timeout)
    watch = watch_peers(peer_timeout, report)
    mark = FAILED  # what the other processes learn of this one's end
    try:
        code = train()
        mark = DONE
        return code
    except Exception as err:
        if stopped():
            mark = STOPPED  # main() ends this process at once
        elif watch is not None and not isinstance(err, bad_input()):
            watch.explain()  # exits when another process died, stopped or failed
        raise
    except BaseException:  # Interrupted: main() ends this process at once
        mark = STOPPED
        raise
    finally:
        if watch is not None:
            watch.finish(mark)
