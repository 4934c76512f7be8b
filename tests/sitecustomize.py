"""Loaded at start-up by every Python process a test starts with tests/ on PYTHONPATH (the
multi-process runs of tests/parallel/): lets every process of a
multi-process run keep its compiled programs in the suite's compilation cache (tests/conftest.py).

JAX writes cache entries from process 0 only, so that many hosts do not write one shared folder
at once. On CPU the other processes' programs have keys of their own (the key hashes the
process's view of the device topology), so without this they compiled every program again in
every run: about 20 s of CPU per two-process run of the suite. Here process 1 writes its own
entries, through JAX's own cache writer, and reads them back in later runs. Nothing else
changes: the programs are the compiler's own. Outside the tests, JAX's rule stands.
"""

import importlib.abc
import importlib.machinery
import inspect
import sys
import warnings

# jax 0.10's ``_cache_write(cache_key, compile_time_secs, module_name, backend, executable,
# host_callbacks)``
_KNOWN = (
    "cache_key",
    "compile_time_secs",
    "module_name",
    "backend",
    "executable",
    "host_callbacks",
)


def _write_from_every_process(compiler) -> None:
    """Wrap ``jax._src.compiler._cache_write``; leaves it alone if its shape is not the one known
    (jax 0.10): then only process 0 writes, as in JAX."""
    from jax._src import compilation_cache, distributed

    original = getattr(compiler, "_cache_write", None)
    if original is None or tuple(inspect.signature(original).parameters) != _KNOWN:
        return

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if distributed.global_state.process_id in (None, 0) or host_callbacks:
            return original(
                cache_key, compile_time_secs, module_name, backend, executable, host_callbacks
            )
        if compile_time_secs < compiler.config.persistent_cache_min_compile_time_secs.value:
            return None
        try:
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs)
            )
        except Exception as err:  # as JAX does: a cache that cannot be written only warns
            what = f"{module_name}: {type(err).__name__}: {err}"
            warnings.warn(f"not cached: {what}", stacklevel=2)
        return None

    compiler._cache_write = cache_write


class _AfterJaxCompiler(importlib.abc.MetaPathFinder):
    """Patches ``jax._src.compiler`` as it is imported, so that a process that never imports jax
    pays nothing."""

    def find_spec(self, name, path, target=None):
        if name != "jax._src.compiler":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _write_from_every_process(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterJaxCompiler())
