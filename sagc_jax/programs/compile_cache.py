"""JAX's persistent compilation cache for every command that compiles (``train.
compilation_cache_dir``): a program compiled once on this machine is loaded by every later run,
as MaxText's ``jax_cache_dir`` does. The executables are the compiler's own, so no result
changes; a run's first step then costs its compile once per machine, not once per run.

``auto`` is the user's cache, like pip's: ``$XDG_CACHE_HOME/sagc-jax/xla`` (``~/.cache/...``),
unless ``JAX_COMPILATION_CACHE_DIR`` already names one (the test suite's, a user's). The cache is
bounded (the least recently used programs go) unless JAX was told otherwise. A folder that cannot
be written, or a disk with too little room, gives one line and the command goes on uncached.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import jax

MAX_BYTES = 2 << 30  # the bound when JAX has none: the least recently used programs go first
MIN_FREE_BYTES = 256 << 20  # below this much free space the cache is not used


def default_cache_dir() -> Path:
    """The user's cache folder for sagc-jax's compiled programs."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "sagc-jax" / "xla"


def use_compilation_cache(setting: str | None, report=print) -> Path | None:
    """Point JAX's persistent compilation cache at ``setting`` (a folder, ``"auto"``, or None:
    off); returns the folder in use, or None. One ``report`` line when the folder cannot be
    used, and the caller goes on compiling without it."""
    if setting is None:
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    current = jax.config.jax_compilation_cache_dir
    if setting == "auto":
        path = Path(current) if current else default_cache_dir()
    else:
        path = Path(setting).expanduser()
    problem = _unusable(path)
    if problem:
        report(
            f"train.compilation_cache_dir: {path} {problem}; compiling without a persistent "
            "cache (point it at a writable folder, or set it to null)"
        )
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    if current != str(path):
        jax.config.update("jax_compilation_cache_dir", str(path))
    if jax.config.jax_compilation_cache_max_size < 0:  # unbounded: JAX's default
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path


def _unusable(path: Path) -> str:
    """Why ``path`` cannot hold the cache ("" when it can): not creatable, not writable, or
    its disk nearly full."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as err:
        return f"cannot be written ({err.strerror or err})"
    free = shutil.disk_usage(path).free
    if free < MIN_FREE_BYTES:
        return f"has {free >> 20} MiB free (less than {MIN_FREE_BYTES >> 20} MiB)"
    return ""


# JAX's events for the work of making a program: tracing it, lowering it to MLIR, and compiling
# it in XLA (or loading it from the persistent cache).
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


class CompileClock:
    """Seconds this process spent making programs (``COMPILE_EVENTS``), read in stretches:
    ``take()`` returns those since the last ``take()`` (or since the clock was made). One
    listener serves every clock of the process."""

    _total = 0.0
    _listening = False

    def __init__(self) -> None:
        if not CompileClock._listening:
            jax.monitoring.register_event_duration_secs_listener(CompileClock._heard)
            CompileClock._listening = True
        self._mark = CompileClock._total

    @staticmethod
    def _heard(event: str, duration: float, **_) -> None:
        if event in COMPILE_EVENTS:
            CompileClock._total += duration

    def take(self) -> float:
        seconds, self._mark = CompileClock._total - self._mark, CompileClock._total
        return seconds
