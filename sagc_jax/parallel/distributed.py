"""Multi-process runs on JAX's own runtime: start-up and the few host-side collectives.

Every process runs the same program on its own slice of the rows; the host values they must
agree on (the group size of a step, whether to checkpoint or stop, the rollout statistics the
controller sees) go through ``jax.experimental.multihost_utils``. In a single process every
helper here is the identity.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from sagc_jax.config import ConfigError

ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Start ``jax.distributed`` when asked; returns whether this is a multi-process run.

    coordinator: ``HOST:PORT`` of process 0 (with num_processes and process_id), ``auto`` (Cloud
    TPU VMs, SLURM, Open MPI detect everything) or None. Without the flag, the environment
    variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID are used when set.
    Must run before anything touches a device.
    """
    if coordinator is None and os.environ.get("JAX_COORDINATOR_ADDRESS"):
        missing = [v for v in ENV_VARS if not os.environ.get(v)]
        if missing:
            raise ConfigError(
                f"JAX_COORDINATOR_ADDRESS is set but {', '.join(missing)} is not; set all of "
                f"{', '.join(ENV_VARS)}"
            )
        coordinator = os.environ["JAX_COORDINATOR_ADDRESS"]
        num_processes = _int_env("JAX_NUM_PROCESSES")
        process_id = _int_env("JAX_PROCESS_ID")
    if coordinator is None:
        if num_processes is not None or process_id is not None:
            raise ConfigError("--num-processes/--process-id need --coordinator HOST:PORT")
        return False
    # CPU processes talk through gloo (the default CPU collectives stay inside one process);
    # GPU and TPU collectives are unaffected by this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator == "auto":
        jax.distributed.initialize()
        return jax.process_count() > 1
    if num_processes is None or process_id is None:
        raise ConfigError(
            f"--coordinator {coordinator} needs --num-processes N and --process-id I "
            f"(or use --coordinator auto on a Cloud TPU VM / SLURM)"
        )
    if ":" not in coordinator:
        raise ConfigError(f"--coordinator {coordinator!r}: expected HOST:PORT or auto")
    if not 0 <= process_id < num_processes:
        raise ConfigError(
            f"--process-id {process_id} is outside [0, {num_processes}) (--num-processes)"
        )
    jax.distributed.initialize(coordinator, num_processes, process_id)
    return num_processes > 1


def _int_env(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def is_leader() -> bool:
    """True on process 0, the one that writes logs and prints."""
    return jax.process_index() == 0


def from_leader(value):
    """Process 0's ``value`` (a number or numpy array) on every process."""
    if jax.process_count() == 1:
        return value
    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(value)))


def gather_rows(local: np.ndarray) -> np.ndarray:
    """Every process's rows of ``local`` concatenated in process order (same on all)."""
    if jax.process_count() == 1:
        return np.asarray(local)
    return np.asarray(multihost_utils.process_allgather(np.asarray(local), tiled=True))


def any_process(flag: bool) -> bool:
    """True on every process when ``flag`` is True on any of them."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.bool_))))
