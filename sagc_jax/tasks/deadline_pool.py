"""Worker processes that run calls under a hard deadline, from any thread.

A signal-based timeout (math-verify's ``signal.alarm``) works only in the main thread, and nothing
can stop a thread stuck inside sympy. A :class:`DeadlinePool` runs each call in a worker process
instead: a call still running at its deadline has its worker killed (SIGKILL) and replaced, so no
call holds its caller past its bound, whatever it does and whichever thread waits for it.

Workers are fresh interpreters (``python -c``, like the ``spawn`` start method: forking a process
that runs JAX's threads is unsafe; unlike it, the caller's ``__main__`` is not re-run in them),
started once and reused: a pool pays its start-up (an interpreter plus the ``warmup`` call, about
a second) on its first :meth:`DeadlinePool.map` and after each kill, not on every call. Workers
are stopped by :meth:`DeadlinePool.close` or at interpreter exit, and exit on their own when the
parent process dies.
"""

from __future__ import annotations

import atexit
import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["TIMED_OUT", "DeadlinePool", "WorkerError"]


class _TimedOut:
    def __repr__(self) -> str:
        return "TIMED_OUT"


TIMED_OUT: Any = _TimedOut()
"""What :meth:`DeadlinePool.map` gives for a call that missed its deadline."""

_READY = "ready"


class WorkerError(Exception):
    """A call raised in its worker, or its worker died (the message says which)."""


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _serve(fd: int) -> None:
    """A worker's main loop on socket ``fd``: run the warm-up it receives first, then receive
    ``(fn, args)`` and send back ``fn(*args)`` or a WorkerError; None (or EOF) stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    conn = Connection(fd)
    warmup = conn.recv()
    if warmup is not None:
        warmup()
    conn.send(_READY)
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the parent closed its end
            return
        if task is None:
            return
        fn, args = task
        try:
            out = fn(*args)
        except Exception as err:
            out = WorkerError(f"{type(err).__name__}: {err}")
        conn.send(out)


_WORKER_MAIN = (
    "import sys; from sagc_jax.tasks.deadline_pool import _serve; _serve(int(sys.argv[1]))"
)


class _Worker:
    def __init__(self, warmup: Callable[[], object] | None):
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))  # the caller's imports
        with theirs:  # the parent's copy is closed, so that the parent sees EOF when it dies
            self.process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_MAIN, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        self.conn = Connection(ours.detach())
        self.conn.send(warmup)
        self.ready = False
        self.task: tuple[int, float] | None = None  # (item, deadline) of the running call

    def stop(self, kill: bool) -> None:
        """Ask the worker to exit (or kill it); :meth:`reap` waits for it."""
        if kill:
            self.process.kill()
            return
        try:
            self.conn.send(None)
        except OSError:
            self.process.kill()

    def reap(self) -> None:
        try:
            self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.conn.close()


_LIVE_POOLS: weakref.WeakSet[DeadlinePool] = weakref.WeakSet()


class DeadlinePool:
    """``workers`` worker processes that run calls with per-call and per-map deadlines.

    ``warmup`` (a module-level function, or None) runs once in each new worker before it takes
    calls, for imports and caches that should not count against a call's deadline; a worker
    waits for it up to ``start_seconds``. Functions passed to :meth:`map` must be picklable by
    reference (module-level functions).
    """

    def __init__(
        self,
        workers: int,
        warmup: Callable[[], object] | None = None,
        start_seconds: float = 60.0,
    ):
        if workers < 1:
            raise ValueError(f"DeadlinePool: workers = {workers} must be >= 1")
        self.size = workers
        self.start_seconds = start_seconds
        self._warmup = warmup
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._broken = ""
        _LIVE_POOLS.add(self)

    def grow(self, workers: int) -> None:
        """Use at least ``workers`` processes from the next :meth:`map` on."""
        self.size = max(self.size, workers)

    def map(
        self,
        fn: Callable[..., Any],
        items: Sequence[tuple],
        *,
        item_seconds: float,
        total_seconds: float,
    ) -> list[Any]:
        """``[fn(*item) for item in items]``, computed by the workers, ``TIMED_OUT`` in place of
        each call that ran longer than ``item_seconds`` or had not finished ``total_seconds``
        after the start; a call that raised (or whose worker died) gives a :class:`WorkerError`.

        Waiting for a worker to start, when none is ready, is bounded by ``start_seconds`` and
        comes before the clock starts; waiting for another thread's ``map`` counts. Raises
        RuntimeError when a worker exits before it is ready (its traceback is on stderr).
        """
        t0 = time.monotonic()
        if not self._lock.acquire(timeout=max(total_seconds, 0.0)):
            return [TIMED_OUT] * len(items)
        try:
            return self._map(fn, list(items), item_seconds, total_seconds - (time.monotonic() - t0))
        finally:
            self._lock.release()

    def close(self) -> None:
        """Stop every worker (those in a call are killed). The pool restarts them if reused."""
        workers, self._workers = self._workers, []
        for w in workers:
            w.stop(kill=w.task is not None)
        for w in workers:
            w.reap()

    # ------------------------------------------------------------------ internals

    def _map(self, fn, items: list[tuple], item_seconds: float, total_seconds: float) -> list:
        results: list[Any] = [TIMED_OUT] * len(items)
        if not items:
            return results
        if self._broken:
            raise RuntimeError(self._broken)
        while len(self._workers) < self.size:
            self._workers.append(_Worker(self._warmup))
        start_by = time.monotonic() + self.start_seconds
        while not any(w.ready for w in self._workers) and time.monotonic() < start_by:
            self._receive(results, start_by)
        end = time.monotonic() + total_seconds
        todo = collections.deque(range(len(items)))
        while todo or any(w.task for w in self._workers):
            now = time.monotonic()
            if now >= end:
                break
            for w in self._workers:
                if todo and w.ready and w.task is None:
                    i = todo.popleft()
                    w.task = (i, min(now + item_seconds, end))
                    try:
                        w.conn.send((fn, items[i]))
                    except OSError:  # it died while idle: retry the item on another worker
                        todo.appendleft(i)
                        self._replace(w)
            self._receive(results, min([end] + [w.task[1] for w in self._workers if w.task]))
            now = time.monotonic()
            for w in [w for w in self._workers if w.task and now >= w.task[1]]:
                self._replace(w)  # its item stays TIMED_OUT
        for w in [w for w in self._workers if w.task]:  # the map's own deadline
            self._replace(w)
        return results

    def _receive(self, results: list, until: float) -> None:
        """Wait until a message arrives or ``until`` (monotonic seconds); take those ready."""
        by_conn = {w.conn: w for w in self._workers}
        for conn in wait(list(by_conn), timeout=max(0.0, until - time.monotonic())):
            w = by_conn[conn]
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                try:
                    code = w.process.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    code = None
                why = f"worker process exited (exit code {code})"
                if not w.ready:  # it cannot start (a failing import?): stop trying
                    self._broken = f"DeadlinePool: a {why} before it was ready; see its stderr"
                    self.close()
                    raise RuntimeError(self._broken) from None
                if w.task is not None:
                    results[w.task[0]] = WorkerError(why)
                self._replace(w)
                continue
            if not w.ready:
                w.ready = msg == _READY
            elif w.task is not None:
                results[w.task[0]] = msg
                w.task = None

    def _replace(self, w: _Worker) -> None:
        w.stop(kill=True)
        w.reap()
        self._workers[self._workers.index(w)] = _Worker(self._warmup)


@atexit.register
def _close_all() -> None:
    for pool in list(_LIVE_POOLS):
        pool.close()
