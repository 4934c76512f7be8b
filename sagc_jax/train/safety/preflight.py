"""Checks a run makes before it builds or compiles anything costly: does the config's largest
candidate G fit the devices' memory (``sagc-jax plan``'s estimate), and does one checkpoint fit
the run directory's disk. Each refusal is one line naming the size and the key to change. And
from the same estimate, how many rollout rows decode at once (``sampling.slots: auto``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import jax

from sagc_jax.config import Config, ConfigError
from sagc_jax.train.safety import disk
from sagc_jax.train.safety.runlock import RunDirError

GIB = 1024**3

# The keys that shrink each item of plan's estimate, for the refusal's advice.
_LEVERS = {
    "KV cache": "sampling.slots, sampling.max_new_tokens, train.prompts_per_step",
    "prompt cache": "train.prompts_per_step or sampling.prompt_buckets",
    "activations": "train.microbatches or model.remat",
    "parameters": "mesh.fsdp or model.param_dtype",
    "optimizer state": "mesh.fsdp or train.optimizer_dtype",
    "gradients": "mesh.fsdp",
    "reference model": "loss.kl_beta (0: no reference copy) or mesh.fsdp",
    "decode weights": "mesh.tensor",
}


def device_memory() -> tuple[int, str]:
    """(bytes one device may use, what they are): the accelerator's limit, or on CPU the host's
    physical memory shared by this process's devices."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind} memory"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    devices = jax.local_device_count()
    share = f", shared by {devices} host devices" if devices > 1 else ""
    return host // devices, f"host memory{share}"


def ladder_key(cfg: Config) -> str:
    """The config key that sets the largest candidate G."""
    kind = cfg.controller.kind
    return "controller.group_size" if kind == "fixed" else "controller.candidates"


def check_device_memory(cfg: Config, slots: int) -> None:
    """ConfigError when plan's per-device estimate for the largest candidate G, ``slots`` rows
    decoding at once (`rollout_slots`), exceeds the memory of one device (``cfg``'s prompt
    buckets must be concrete)."""
    from sagc_jax.planning.plan import memory_plan

    available, what = device_memory()
    plan = memory_plan(cfg, jax.device_count(), available, slots=slots)
    if plan.per_device <= available:
        return
    biggest = max(plan.items, key=lambda item: item.per_device)
    raise ConfigError(
        f"{ladder_key(cfg)}: the largest candidate G does not fit: sagc-jax plan estimates "
        f"{plan.per_device / GIB:.1f} GiB per device against {available / GIB:.1f} GiB of "
        f"{what}, the most for the {biggest.name} ({biggest.per_device / GIB:.1f} GiB: "
        f"{biggest.detail}); lower the ladder or {_LEVERS.get(biggest.name, 'the batch')}, or set "
        f"train.memory_check=false to start anyway"
    )


def rollout_slots(cfg: Config, report: Callable[[str], None]) -> int:
    """``sampling.slots`` as rows (0: every rollout of a step); ``auto``: as many as the
    devices' memory holds beside the rest of ``sagc-jax plan``'s estimate, said through
    ``report`` (``cfg``'s prompt buckets must be concrete)."""
    slots = cfg.sampling.slots
    if slots != "auto":
        return slots
    from sagc_jax.planning.plan import auto_slots

    chosen = auto_slots(cfg, jax.device_count(), device_memory()[0])
    report(f"sampling.slots = auto: {chosen} rows decode at once")
    return chosen


def check_free_space(run_dir: str | Path, items) -> None:
    """RunDirError when the disk of ``run_dir`` has less room than a checkpoint of ``items``
    (the parameters and optimizer state, uncompressed: what a checkpoint holds once the
    optimizer's moments are no longer zeros)."""
    needed = disk.tree_bytes(items)
    free = disk.free_bytes(Path(run_dir))
    if free < needed:
        raise RunDirError(
            f"{run_dir}: {disk.human_bytes(free)} free on its disk, one checkpoint needs "
            f"about {disk.human_bytes(needed)} (parameters and optimizer state); free space "
            f"or use another logging.run_dir"
        )
