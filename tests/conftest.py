"""Suite-wide setup: one persistent XLA compilation cache for every test and every process a test
starts (the CLI runs, the multi-process runs).

Most of the suite's time used to be XLA compiling the same tiny programs again: in each test's
Trainer, in each resumed run, in each subprocess. With the cache, a program compiled once is
loaded afterwards, in this run and in later ones; the executables are the compiler's own, so no
result changes. The cache is the user's, like pip's (``~/.cache/sagc-jax/xla``, or
``$XDG_CACHE_HOME``), shared by every clone on the machine and bounded to 2 GiB (the least
recently used programs go). An explicit ``JAX_COMPILATION_CACHE_DIR`` wins; pointing it at an
empty folder times the suite from a cold start. ``tests/sitecustomize.py`` lets every process
of a multi-process test write its own programs there, not only process 0.
"""

import os
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sagc-jax" / "xla"

# Read by jax when it is imported, here and in every subprocess the tests start.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # tiny programs too
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# a bound turns on eviction, and with it the file lock that lets processes write side by side
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))
