"""A run resolved once: ``resolve_run`` turns a config into the `RunShape` the trainer, ``plan``,
``plan --compile``, ``eval`` and ``compare`` read, every ``auto`` made concrete against the
target it is given (the data, the mesh, one device's memory) and nothing resolved again after.

In order: the names of its kinds (``planning.choices``), the prompt buckets
(``sampling.prompt_buckets: auto``, from the data), what the config makes of the trained state
(`programs.state.TrainingSettings`) and the model's architecture, the controller (its candidates;
``sagc_value`` with its step timer), the checks that every candidate G splits into the mesh's
shards and the processes, the memory model (`planning.memory.MemoryModel`:
the state ``build_run`` makes, traced abstractly), the rollout slots (``sampling.slots: auto``,
from that model and the device's memory) and the memory check. The config that comes out has
concrete values where ``auto`` stood: the one config of the run after start-up; what the
components below the trainer read of it is derived here once and handed to them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax

from sagc_jax.config import Config, ConfigError
from sagc_jax.controller.base import GroupController
from sagc_jax.controller.registry import CONTROLLERS
from sagc_jax.parallel import ShardingPlan
from sagc_jax.planning.choices import check_names
from sagc_jax.planning.memory import GIB, MemoryModel, MemoryPlan
from sagc_jax.planning.timing import controller_for_run
from sagc_jax.programs.packing import resolve_pack_len, row_multiple
from sagc_jax.programs.policy import Policy, architecture, source_tokenizer
from sagc_jax.programs.shapes import (
    check_batch_shapes,
    decode_rows,
    rollout_shapes,
    tail_rollout_shapes,
    training_settings,
)
from sagc_jax.programs.state import TrainingSettings
from sagc_jax.tasks.source import make_source

# The keys that shrink each item of plan's estimate, for the memory check's advice.
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


@dataclasses.dataclass(frozen=True)
class RunShape:
    """A run as ``resolve_run`` resolved it: what the samplers, the update batch, compile-ahead
    and ``plan --compile`` read.

    ``cfg``: the run's config with ``sampling.prompt_buckets`` and ``sampling.slots`` concrete
    (slots 0: every rollout of a step); ``controller``: the run's, built once (its state is the
    run's: the trainer checkpoints it); ``memory``: the run's memory model; ``training``: what
    its config makes of the trained state (``programs.state.build_run`` reads it)."""

    cfg: Config
    controller: GroupController
    processes: int
    memory: MemoryModel
    training: TrainingSettings
    refused: str = ""  # what_if: why a run of these shapes would not start ("": it would)

    @property
    def policy(self) -> Policy:
        """The run's model as shapes and shardings, traced once (the memory model's): what
        ``programs.policy.build_sharded_policy`` makes concrete."""
        return self.memory.policy

    @property
    def candidates(self) -> tuple[int, ...]:
        """The controller's group sizes."""
        return self.controller.candidates

    @property
    def batch_shards(self) -> int:
        """The mesh's batch shards."""
        return self.memory.sharding.batch_shards

    @property
    def slots(self) -> int:
        """Rollout rows decoding at once (0: every rollout of a step)."""
        return self.cfg.sampling.slots

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(self.cfg.sampling.prompt_buckets)

    @property
    def memory_plan(self) -> MemoryPlan:
        """The memory table of the largest G's step with the run's slots."""
        return self.memory.plan(self.slots)

    @property
    def pack_len(self) -> int:
        """Tokens of a packed update row (``train.pack_len``; 0: the longest bucket plus
        ``sampling.max_new_tokens``)."""
        t, s = self.cfg.train, self.cfg.sampling
        return resolve_pack_len(t.pack_len, self.buckets, s.max_new_tokens)

    @property
    def row_multiple(self) -> int:
        """What each process's update rows must be a multiple of (minibatches x microbatches
        x its share of the batch shards)."""
        t = self.cfg.train
        return row_multiple(t.minibatches, t.microbatches, self.batch_shards, self.processes)

    @property
    def eval_slots(self) -> int:
        """Rows the held-out evaluation decodes at once: the largest G's step's, which the
        memory check counts (more held-out prompts stream through them)."""
        return decode_rows(self.cfg.train, max(self.candidates), self.slots)

    @property
    def rollouts(self) -> dict[str, tuple[int, int]]:
        """``rollout_shapes`` of the run: (rollouts, prompts) of each sampler program."""
        return rollout_shapes(self.cfg, self.candidates)

    @property
    def tail_rollouts(self) -> dict[int, tuple[int, int]]:
        """``tail_rollout_shapes`` of the run (empty without tail batching)."""
        if not self.cfg.tail_batching.enabled:
            return {}
        return tail_rollout_shapes(self.cfg, self.candidates, self.processes)


def resolve_run(
    cfg: Config,
    plan: ShardingPlan,
    *,
    processes: int = 1,
    source=None,
    device_bytes: int | None = None,
    memory_check: str | None = None,
    report: Callable[[str], None] | None = None,
    what_if: bool = False,
) -> RunShape:
    """The run of ``cfg`` on the mesh of ``plan`` split over ``processes``, resolved once.

    ``source``: the run's prompt source (``tasks.source.make_source``; `data_source` for a
    command without one), read for ``sampling.prompt_buckets: auto`` (needed then);
    ``device_bytes``: one device's memory, for ``sampling.slots: auto`` (without it ``auto``
    counts every rollout, the upper bound) and the memory check; ``memory_check``: what
    ``device_bytes`` are (e.g. "host memory"), to refuse a run whose largest G does not fit
    them (ConfigError naming the largest item and the keys that shrink it); ``report``: where
    the resolved ``auto`` values are said; ``what_if`` (``sagc-jax plan``): batch shapes that
    the mesh or the processes cannot split are kept in ``refused`` instead of raised, so that the
    memory of another device count can still be planned."""
    say = report or (lambda line: None)
    check_names(cfg)
    if cfg.sampling.prompt_buckets == "auto":
        if source is None:
            raise ConfigError(
                "sampling.prompt_buckets = auto: resolve_run reads them from the run's prompt "
                "source (planning.resolve.data_source); none was given"
            )
        cfg = _with_sampling(cfg, prompt_buckets=source.prompt_buckets)
    training = training_settings(cfg)
    tokenizer = source.tokenizer if source is not None else None  # a preset's special tokens
    arch, arch_source = architecture(cfg, tokenizer)  # the model's, read once
    controller = controller_for_run(cfg, arch, training.signal_only)
    refused = ""
    try:
        CONTROLLERS[cfg.controller.kind].check_run(cfg.controller, processes)
        check_batch_shapes(cfg, controller.candidates, plan.batch_shards, processes)
    except ConfigError as err:
        if not what_if:
            raise
        refused = str(err)
    memory = MemoryModel(cfg, plan, max(controller.candidates), (arch, arch_source), training)
    slots = cfg.sampling.slots
    if slots == "auto":
        if device_bytes is None:
            slots = 0
            say("sampling.slots = auto without a device memory: every rollout counted")
        else:
            slots = memory.auto_slots(device_bytes)
            say(f"sampling.slots = auto: {slots} rows decode at once")
    cfg = _with_sampling(cfg, slots=slots)
    shape = RunShape(cfg, controller, processes, memory, training, refused)
    if memory_check is not None:
        _check_memory(shape.memory_plan, cfg, device_bytes, memory_check)
    return shape


def _with_sampling(cfg: Config, **resolved) -> Config:
    """``cfg`` with the ``sampling`` values that ``auto`` stood for made concrete."""
    return dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, **resolved))


def data_source(cfg: Config):
    """The prompt source ``resolve_run`` reads for ``sampling.prompt_buckets: auto``, for a
    command that has none of its own (``plan``, ``plan --compile``); None when the buckets are
    given."""
    if cfg.sampling.prompt_buckets != "auto":
        return None
    return make_source(cfg, source_tokenizer(cfg))  # tokenizer None: the source has its own


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
    return CONTROLLERS[cfg.controller.kind].sizes_key()


def _check_memory(plan: MemoryPlan, cfg: Config, available: int | None, what: str) -> None:
    """ConfigError when ``plan``'s per-device peak exceeds ``available`` bytes of ``what``."""
    if available is None or plan.per_device <= available:
        return
    biggest = max(plan.items, key=lambda item: item.per_device)
    raise ConfigError(
        f"{ladder_key(cfg)}: the largest candidate G does not fit: sagc-jax plan estimates "
        f"{plan.per_device / GIB:.1f} GiB per device against {available / GIB:.1f} GiB of "
        f"{what}, the most for the {biggest.name} ({biggest.per_device / GIB:.1f} GiB: "
        f"{biggest.detail}); lower the ladder or {_LEVERS.get(biggest.name, 'the batch')}, or set "
        f"train.memory_check=false to start anyway"
    )
