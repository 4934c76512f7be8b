"""The roofline hardware a benchmark compares against: a named preset on an accelerator, or the
host CPU measured by a short micro-benchmark (a CPU has no vendor preset in sim/roofline.py).

Host figures, each the best of a few timed runs of one jitted program on device 0:
- peak FLOP/s: a float32 matmul of ``matmul_size`` x ``matmul_size`` (2 n^3 FLOPs);
- bandwidth: a sum over ``read_mib`` MiB of float32 (bytes read; a copy would time the page
  faults of its fresh output instead).

These are achieved figures, not vendor peaks, so the host's ``Efficiency`` derates nothing
(bandwidth, decode FLOPs and MFU at 1) and has no launch term: a ``lax.fori_loop`` iteration
with a scalar body costs about 15 ns on XLA:CPU, so the prediction is the roofline proper,
the larger of the memory and the compute time. A named preset keeps the roofline's default
efficiencies (the assumptions ``sagc-jax plan`` uses). Imported by ``decode_profile.py``,
``generate.py`` and ``device_check.py``.
"""

from __future__ import annotations

import os
import time

from sagc_jax.sim.roofline import HARDWARE, Efficiency, Hardware


def _best_seconds(fn, *args, repeats: int) -> float:
    """Best wall time of ``fn(*args)`` over ``repeats`` runs after one warm-up (compile)."""
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def measure_host(matmul_size: int = 2048, read_mib: int = 256, repeats: int = 10) -> Hardware:
    """This host as a ``Hardware``, from the micro-benchmarks above (about 3 s on 2 cores; the
    best of ``repeats`` runs each, as other work on the machine only slows them)."""
    import jax
    import jax.numpy as jnp

    a_nn = jnp.ones((matmul_size, matmul_size), jnp.float32)
    peak = 2.0 * matmul_size**3 / _best_seconds(jax.jit(jnp.matmul), a_nn, a_nn, repeats=repeats)
    x_n = jnp.ones((read_mib * 2**20 // 4,), jnp.float32)
    bandwidth = x_n.nbytes / _best_seconds(jax.jit(jnp.sum), x_n, repeats=repeats)
    del a_nn, x_n
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    source = (
        f"measured: float32 matmul {matmul_size}^2, sum of {read_mib} MiB, {os.cpu_count()} cores"
    )
    device = jax.devices()[0]
    name = "host CPU" if device.platform == "cpu" else f"{device.device_kind} (measured)"
    return Hardware(name, peak, bandwidth, memory_gib, source)


def roofline_hardware(name: str | None) -> tuple[Hardware, Efficiency]:
    """``(hardware, efficiency)`` to predict against: the preset ``name`` (a key of
    ``HARDWARE``) with the default efficiencies, or, for ``None``/'host', this host measured.

    Raises ``ValueError`` naming the allowed keys for an unknown name.
    """
    if name in (None, "host"):
        return measure_host(), Efficiency(1.0, 1.0, 1.0, launch_seconds=0.0)
    if name not in HARDWARE:
        raise ValueError(f"--hardware {name!r} is not a preset; allowed: host, {sorted(HARDWARE)}")
    return HARDWARE[name], Efficiency()


def describe(hw: Hardware, eff: Efficiency) -> str:
    """One line: the hardware's figures and the efficiencies the prediction assumes."""
    return (
        f"roofline hardware: {hw.name}, peak {hw.peak_flops / 1e9:,.1f} GFLOP/s, bandwidth "
        f"{hw.hbm_bandwidth / 1e9:,.1f} GB/s, {hw.memory_gib:.0f} GiB ({hw.source}); efficiency "
        f"bandwidth {eff.bandwidth:g}, decode FLOPs {eff.decode_flops:g}, MFU {eff.mfu:g}, "
        f"launch {eff.launch_seconds * 1e6:.1f} us/step"
    )
