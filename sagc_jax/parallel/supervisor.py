"""Each process of a multi-process run trains in a child process of its own; the parent only
passes the child's output through, forwards signals, and turns the distributed runtime's abort
into one line.

Why: process 0 hosts jax.distributed's coordination service. When it dies, the runtime of every
other process loses the service and ends that process at once with a fatal error (a glog ``F``
line, a C++ stack dump, SIGABRT), which Python cannot catch or replace (see
``sagc_jax.parallel.distributed``). From outside the process it can: the parent holds back the
child's error output from the runtime's first coordination-service error on; when the child then
dies by SIGABRT, the parent prints one line naming what happened and the last sealed checkpoint
instead, and exits with :data:`EXIT_PEER_LOST`. If the child lives on, or ends any other way,
the held-back lines are printed as they were.

The child runs in its own session, so a signal reaches it once, through the parent (a Ctrl-C on
the terminal goes to the parent's group only; a second SIGINT would mean "stop now" to the
trainer); it dies with the parent (``PR_SET_PDEATHSIG`` on Linux). Standard output is shared as
it is; the child's exit code becomes the parent's (a signal death is repeated on the parent).

``sagc-jax train`` uses it in two steps: :func:`should_supervise` tells the parent to rerun its
own command under :func:`supervise` (:func:`rerun_supervised`); the child trains through
:func:`sagc_jax.parallel.distributed.run_rank`, which starts jax.distributed and watches the
other processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

EXIT_PEER_LOST = 4  # exit code of the survivors of a process that died or stopped
CHILD_ENV = "SAGC_JAX_RANK_CHILD"  # set in the child: it trains instead of supervising
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# The runtime's first line once the coordination service fails: a glog warning, error or fatal
# line naming it (which of its threads speaks first varies from run to run; a heartbeat that
# times out goes straight to the fatal "JAX distributed service detected fatal errors").
_SERVICE_ERROR = re.compile(rb"^[WEF]\d{4} .*(coordination.?service|distributed service)", re.I)
# The coordinator cannot be reached: process 0 died, or this host lost the network.
_COORDINATOR_GONE = (b"Failed to send RPC to coordination service", b"leader task")
# The coordinator is there but does not answer this process's heartbeats: process 0 stalled.
_COORDINATOR_SILENT = re.compile(rb"DEADLINE_EXCEEDED(.|\n)*?CoordinationService/Heartbeat")
# The service's heartbeat timeout (the backstop of the peer watch) names the silent processes, a
# "/job:jax_worker/replica:0/task:N" line each.
_UNHEALTHY = re.compile(rb"tasks are unhealthy \(stopped sending heartbeats\):((?:\s*/job:\S+)+)")
_TASK = re.compile(rb"/task:(\d+)")
_STATUS = re.compile(rb"absl::Status: ([^.\n]*)")


def should_supervise(coordinator: str | None, num_processes: int | None) -> bool:
    """Whether a train process with these flags (``--coordinator``, ``--num-processes``) is one
    of several (or may be: ``auto``) and not yet the supervised child: it then reruns itself
    under :func:`supervise` instead of training."""
    if os.environ.get(CHILD_ENV) == "1":
        return False
    if coordinator is not None:
        return num_processes != 1
    return (
        bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))
        and os.environ.get("JAX_NUM_PROCESSES") != "1"
    )


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def what_ended(held: bytes, num_processes: int | None) -> str:
    """What the runtime's held-back fatal output says happened, in a few words."""
    of = f" of {num_processes}" if num_processes else ""
    if any(marker in held for marker in _COORDINATOR_GONE):
        return f"process 0{of} (the jax.distributed coordinator) disappeared"
    if _COORDINATOR_SILENT.search(held):
        return f"process 0{of} (the jax.distributed coordinator) stopped answering heartbeats"
    if unhealthy := _UNHEALTHY.search(held):
        tasks = ", ".join(t.decode() for t in _TASK.findall(unhealthy.group(1)))
        who = "process" if "," not in tasks else "processes"
        return (
            f"{who} {tasks}{of} stopped sending heartbeats (jax.distributed's heartbeat "
            f"timeout, the backstop of --peer-timeout)"
        )
    status = _STATUS.search(held)
    detail = status.group(1).decode(errors="replace").strip() if status else "a fatal error"
    return f"jax.distributed's coordination service ended this process: {detail[:160]}"


def supervise(command: Sequence[str], num_processes: int | None, line: Callable[[str], str]) -> int:
    """Run ``command`` (this process's own, e.g. ``python -m sagc_jax train ...``) as the
    child; returns its exit code (or repeats the signal that killed it). ``line(what)`` makes
    the one line printed when the runtime aborted the child ("process 0 of 2 ... disappeared"
    -> "train: ...; the last checkpoint is ...")."""
    child = subprocess.Popen(
        list(command),
        env={**os.environ, CHILD_ENV: "1"},
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )

    def forward(signum, frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    held: list[bytes] = []
    try:
        for out in iter(child.stderr.readline, b""):
            if held or _SERVICE_ERROR.match(out):
                held.append(out)
            else:
                sys.stderr.buffer.write(out)
                sys.stderr.flush()
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    sys.stdout.flush()
    if held and code == -signal.SIGABRT:
        print(line(what_ended(b"".join(held), num_processes)), file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    sys.stderr.buffer.write(b"".join(held))
    sys.stderr.flush()
    if code < 0:  # the child died by a signal: so does the parent, for whoever waits on it
        with contextlib.suppress(OSError, ValueError):  # SIGKILL keeps its default anyway
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def rerun_supervised(
    argv: Sequence[str], num_processes: int | None, line: Callable[[str], str]
) -> int:
    """This process's command (``argv``: ``train ...``) rerun by :func:`supervise` in a child
    process, so that the runtime's abort when process 0 dies ends in one line (exit code 4) here
    too. ``num_processes``: the flag's, else ``$JAX_NUM_PROCESSES`` (None: unknown)."""
    if num_processes is None and (env := os.environ.get("JAX_NUM_PROCESSES", "")).isdigit():
        num_processes = int(env)
    return supervise([sys.executable, "-m", "sagc_jax", *argv], num_processes, line)
