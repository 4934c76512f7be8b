"""The persistent compilation cache: the user's folder by default, one line and no cache where the
folder cannot be written or its disk is full, off with null."""

import shutil
from collections import namedtuple

import jax
import pytest

from sagc_jax.programs import compile_cache
from sagc_jax.programs.compile_cache import (
    CompileClock,
    default_cache_dir,
    use_compilation_cache,
)


@pytest.fixture
def jax_cache_settings():
    """Whatever the test sets, the suite's own cache settings afterwards."""
    saved = jax.config.jax_compilation_cache_dir, jax.config.jax_compilation_cache_max_size
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_compilation_cache_max_size", saved[1])


def test_auto_is_the_users_cache_unless_jax_names_one(jax_cache_settings, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "sagc-jax" / "xla"
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_compilation_cache_max_size", -1)
    assert use_compilation_cache("auto") == tmp_path / "xdg" / "sagc-jax" / "xla"
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xdg" / "sagc-jax" / "xla")
    assert jax.config.jax_compilation_cache_max_size == compile_cache.MAX_BYTES  # bounded
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "named"))  # e.g. by the env
    assert use_compilation_cache("auto") == tmp_path / "named"
    assert use_compilation_cache(str(tmp_path / "mine")) == tmp_path / "mine"
    assert use_compilation_cache(None) is None
    assert jax.config.jax_compilation_cache_dir is None


def test_an_unwritable_folder_is_one_line_and_no_cache(jax_cache_settings, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    lines = []
    assert use_compilation_cache(str(blocker / "xla"), report=lines.append) is None
    assert len(lines) == 1 and str(blocker / "xla") in lines[0]
    assert "cannot be written" in lines[0] and "null" in lines[0]
    assert jax.config.jax_compilation_cache_dir is None
    # the command goes on and compiles, uncached
    assert float(jax.jit(lambda x: x + 1)(1.0)) == 2.0


def test_a_full_disk_is_one_line_and_no_cache(jax_cache_settings, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 << 30, 10 << 30, 5 << 20))
    lines = []
    assert use_compilation_cache(str(tmp_path / "xla"), report=lines.append) is None
    assert lines == [
        f"train.compilation_cache_dir: {tmp_path / 'xla'} has 5 MiB free (less than 256 MiB); "
        "compiling without a persistent cache (point it at a writable folder, or set it to null)"
    ]


def test_the_compile_clock_counts_making_programs_not_running_them():
    clock = CompileClock()
    f = jax.jit(lambda x: x * 3.0 + 1.0)
    f(jax.numpy.ones(7))
    assert clock.take() > 0  # traced, lowered, compiled (or loaded from the cache)
    f(jax.numpy.ones(7))
    assert clock.take() == 0  # the same shapes: the program is reused
    other = CompileClock()
    f(jax.numpy.ones(9))
    assert other.take() > 0 and clock.take() > 0  # every clock hears every compile
