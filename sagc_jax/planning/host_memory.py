"""The compiler's freed memory handed back to the system after each compile (Linux, glibc).

XLA compiles in the process: LLVM builds and frees a great many small objects, a gigabyte or more
for a real model's update, and glibc keeps the freed pages in the heap for reuse. The arrays that
follow (the update's temporaries, a sampler's KV cache) are large and mmapped apart from the
heap, so the compiler's garbage stays resident beside them: on CPU, where the device memory is
the host's, the process's peak RSS exceeded the compiled program's own peak by that much
(docs/scale-out.md, "Memory of a real model on CPU"). ``malloc_trim(0)`` returns the heap's free
pages; jax reports each backend compile as an event (``jax.monitoring``) once the executable
exists and before it runs, which is where the trim goes.
"""

from __future__ import annotations

import ctypes
import functools

import jax

# jax.monitoring's event for a backend compile, recorded after the executable is built
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _malloc_trim():
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _malloc_trim()


def release() -> None:
    """Hand the heap's free pages back to the system (``malloc_trim(0)``; without glibc,
    nothing)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def resident_bytes() -> int | None:
    """This process's resident set size (``VmRSS``, Linux), after :func:`release`; None where
    ``/proc`` does not say."""
    release()
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _after(event: str, duration_s: float, **_) -> None:
    if event == COMPILE_EVENT:
        release()


@functools.cache
def trim_after_compiles() -> bool:
    """Have every later compile of this process followed by :func:`release` (once per process;
    calling again does nothing). False where there is no glibc (nothing done)."""
    if _MALLOC_TRIM is None:
        return False
    jax.monitoring.register_event_duration_secs_listener(_after)
    return True
