"""One writer per run directory: ``run.lock`` holds the writer's host, pid and command.

The lock is an ``fcntl.flock`` on that file, which the kernel releases when the holder dies, so
a lock left by a process that was killed (SIGKILL, a crash, a reboot) is taken over at once,
with a message. A released lock removes its file (a finished run leaves none behind); a
directory that cannot be written is refused when the lock is taken, the first thing a command
does there. A lock written by another host cannot be checked from here (flock does not
reach across machines on most shared file systems): it is refused, saying which file to delete
if that process is gone. In multi-process runs process 0 holds the lock for all.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from sagc_jax import parallel  # its names load jax on first use only

LOCK_FILE = "run.lock"


class RunDirError(RuntimeError):
    """The run directory cannot be used (message is one line)."""


class RunDirBusy(RunDirError):
    """Another process is writing the run directory (message is one line)."""


def _holder_text(info: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return (
        f"sagc-jax {info.get('command', '?')} (pid {info.get('pid', '?')} on host "
        f"{info.get('host', '?')}, since {started})"
    )


class RunLock:
    """Context manager: hold ``run_dir/run.lock`` for the lifetime of one command."""

    def __init__(self, run_dir: str | Path, command: str, report=print):
        self.path = Path(run_dir) / LOCK_FILE
        self.command = command
        self.report = report
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunDirError(
                f"{self.path.parent}: cannot write the run directory ({err.strerror}); make it "
                f"writable or use another logging.run_dir"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise RunDirBusy(
                f"{self.path.parent}: already being written by {_holder_text(holder)}; wait for "
                f"it to finish or stop it, or use another logging.run_dir"
            ) from None
        if not _still_linked(fd, self.path):  # its holder released (removed) it meanwhile
            os.close(fd)
            return self.acquire()
        previous = _read(fd)
        host = socket.gethostname()
        if previous and previous.get("host") != host:
            os.close(fd)
            raise RunDirBusy(
                f"{self.path.parent}: locked by {_holder_text(previous)}, another machine whose "
                f"process cannot be checked from here; if it is gone, delete {self.path}"
            )
        if previous:
            self.report(
                f"{self.path.parent}: taking over the lock of {_holder_text(previous)}, "
                f"which is no longer running"
            )
        info = {"host": host, "pid": os.getpid(), "command": self.command, "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def acquire_for_all(self) -> None:
        """Process 0 takes the lock for every process of a run; every process raises
        RunDirError if it cannot (a collective)."""
        error = None
        if parallel.is_leader():
            try:
                self.acquire()
            except RunDirError as err:
                error = err
        if parallel.any_process(error is not None):
            raise error or RunDirError(
                f"{self.path.parent}: process 0 could not lock the run directory"
            )

    def release(self) -> None:
        """Remove the lock file, then release the lock (in this order, so that a process that
        opened the old file before the removal sees it unlinked and opens a new one)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self._fd)  # closing releases the flock
        self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _still_linked(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _read(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {"command": "?"}
