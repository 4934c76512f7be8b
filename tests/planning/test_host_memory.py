"""The compiler's freed memory is handed back after each compile (sagc_jax.planning.host_memory)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sagc_jax.planning import host_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_every_compile_is_followed_by_a_release(monkeypatch):
    releases = []
    monkeypatch.setattr(host_memory, "release", lambda: releases.append(1))
    assert host_memory.trim_after_compiles() and host_memory.trim_after_compiles()

    @jax.jit
    def f(x):
        return jnp.sin(x) * 3.0 + 1.0

    x7, x9 = np.ones(7, np.float32), np.ones(9, np.float32)
    f(x7).block_until_ready()  # a compile
    assert len(releases) == 1
    f(x7).block_until_ready()  # cached: no compile, no release
    assert len(releases) == 1
    f(x9).block_until_ready()  # another shape: another compile
    assert len(releases) == 2
    host_memory._MALLOC_TRIM(0)  # the real call returns (glibc is there)
