"""``sagc-jax plan``'s memory: what a run holds on each device, before it is launched.

The trained state (parameters, LoRA adapters, optimizer state, the KL term's reference, and where
each lives on the mesh) is the one ``programs.state.build_run`` builds, traced abstractly on the
run's mesh (an ``AbstractMesh`` of the target's device count when no device is attached): the plan
cannot disagree with the trainer about it, whatever optimizer or LoRA targets a run uses.
Formulas only for what has no abstract value before a step runs: the KV and prompt caches (rows x
slots x layers, from the largest candidate G), the residuals the update's backward pass saves
(traced, not run, with the configured rematerialisation), and the compiled backward's temporaries
and log-prob logits (factors measured on CPU).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from sagc_jax.config import Config, ConfigError
from sagc_jax.controller import make_controller
from sagc_jax.decode_schedule import row_rungs
from sagc_jax.models import DecoderConfig
from sagc_jax.models import axes as ax
from sagc_jax.parallel import ShardingPlan
from sagc_jax.programs.packing import resolve_pack_len
from sagc_jax.programs.policy import architecture
from sagc_jax.programs.shapes import decode_rows, prompts_for, training_settings
from sagc_jax.programs.state import (
    PolicyState,
    RunPrograms,
    TrainingSettings,
    abstract_policy,
    build_run,
)
from sagc_jax.programs.update import (
    PACKED,
    PADDED,
    batch_spec,
    chunk_loss,
    packed_batch_spec,
)
from sagc_jax.rl.logprobs import chunk_positions
from sagc_jax.sim.roofline import HARDWARE

GIB = 1024**3


# Items held only while the samplers run or only while the update runs (never both at once);
# the rest (the trained state) is held throughout.
STAGES = {
    "decode weights": "sampling",
    "KV cache": "sampling",
    "prompt cache": "sampling",
    "merged weights": "sampling",
    "gradients": "update",
    "activations": "update",
    "log-prob logits": "update",
    "backward temps": "update",
}

# What the compiled backward pass holds beyond the residuals jax says it saves (``activations``),
# as a share of them. XLA CPU's update of SmolLM2-135M (remat none, 16 rows x 168 tokens) held
# 0.359 GiB of temporaries a layer against 0.205 GiB of residuals (0.75 more) under its
# breadth-first scheduler, 0.291 under the depth-first one sagc_jax sets; the tiny demo model's
# holds little more than its residuals (tests/planning/test_aot.py: within 0.8-1.2 of plan needs
# at most 0.2 with the depth-first scheduler: its G = 4 update is at 0.81). One factor cannot
# fit both (docs/scale-out.md, "Memory of a real model on CPU").
BACKWARD_TEMPS = 0.2
# float32 [tokens, vocab] buffers of the log-prob logits alive at once: the logits, their softmax
# (or, chunked, the backward's recomputed logits) and their gradient.
LOGIT_COPIES = 3


@dataclasses.dataclass(frozen=True)
class Item:
    name: str
    detail: str
    per_device: int  # bytes on the most loaded device
    total: int  # bytes of one whole copy (the distinct pieces of every device together)

    @property
    def stage(self) -> str:
        """``sampling``, ``update`` or ``state`` (held throughout)."""
        return STAGES.get(self.name, "state")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    source: str  # where the architecture came from
    num_params: int
    param_dtype: str
    mesh: dict[str, int]
    items: list[Item]
    lora: str = ""  # "rank R on q_proj, ...": the adapters trained over frozen parameters

    def during(self, stage: str) -> int:
        """Bytes per device while ``stage`` (``sampling`` or ``update``) runs: the state too."""
        return sum(i.per_device for i in self.items if i.stage in (stage, "state"))

    @property
    def per_device(self) -> int:
        """The peak: the larger of sampling and the update."""
        return max(self.during("sampling"), self.during("update"))


def device_bytes(tree) -> int:
    """Bytes of one device's pieces of ``tree`` (ShapeDtypeStructs or arrays with a
    NamedSharding, concrete or abstract mesh)."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
    )


def whole_bytes(tree) -> int:
    """Bytes of one whole copy of ``tree``'s arrays."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _sized(name: str, detail: str, tree, copies: int = 1) -> Item:
    return Item(name, detail, copies * device_bytes(tree), copies * whole_bytes(tree))


class MemoryModel:
    """The memory of a run of ``cfg`` on the mesh of ``plan`` (prompt buckets concrete), its
    steps at most of G = ``group_size``, its model ``architecture`` (the architecture and where
    it came from: ``programs.policy.architecture``): the state as ``build_run`` makes it of
    ``training`` (``programs.shapes.training_settings``; abstract), the update's items traced
    once per G, the samplers' caches for any number of slots.
    `plan` gives the whole table; `auto_slots` the rows that fit a device."""

    def __init__(
        self,
        cfg: Config,
        plan: ShardingPlan,
        group_size: int,
        architecture: tuple[DecoderConfig, str],
        training: TrainingSettings,
    ):
        if isinstance(cfg.sampling.prompt_buckets, str):
            raise ConfigError(
                "sagc-jax plan needs the prompt buckets: resolve sampling.prompt_buckets = auto "
                "from the data first (planning.resolve.resolve_run)"
            )
        self.cfg, self.sharding, self.group_size = cfg, plan, group_size
        arch, self.source = architecture  # the model's, and where it came from
        self.policy = abstract_policy(arch, plan)  # the model, traced once
        self.run, self.state = build_run(training, plan, self.policy, concrete=False)
        self.arch = self.policy.arch  # what the samplers decode (with LoRA: the base's)
        self.decoded = self.policy.params
        self._update_items: dict[int, list[Item]] = {}
        m = cfg.model
        self.lora = f"rank {m.lora_rank} on {', '.join(m.lora_targets)}" if m.lora_rank else ""
        self.num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(self.decoded))
        self.state_items = self._state_items()

    def _state_items(self) -> list[Item]:
        """The trained state (held throughout), and what training adds to the weights while
        sampling (LoRA's merged copy; the decode copy gathered over fsdp)."""
        cfg, state, params, lora = self.cfg, self.state, self.decoded, self.lora
        frozen = ", frozen" if lora else ""
        detail = f"{self.num_params:,} x {self.arch.param_dtype}{frozen}"
        weights = _sized("parameters", detail, params)
        items = [weights]
        dtype = str(jax.tree.leaves(state.params)[0].dtype)
        of = " of the adapters" if lora else ""
        if lora:
            adapters = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
            items.append(_sized("LoRA adapters", f"{adapters:,} x {dtype}, {lora}", state.params))
        master = cfg.train.optimizer_dtype == "float32" and dtype != "float32"
        master = " + float32 master copy of the parameters" if master else ""
        detail = f"Adam moments in {cfg.train.optimizer_dtype}{master}{of}"
        items.append(_sized("optimizer state", detail, state.opt_state))
        copies = 2 if cfg.train.microbatches > 1 else 1
        detail = dtype + of + (", x2 while accumulating microbatches" if copies == 2 else "")
        items.append(_sized("gradients", detail, state.params, copies))
        if cfg.loss.kl_beta > 0:
            if lora:
                items.append(
                    Item("reference model", "the base with the adapters off: no copy", 0, 0)
                )
            else:
                detail = f"kl_beta = {cfg.loss.kl_beta}"
                items.append(_sized("reference model", detail, state.ref_params))
        if lora:  # the samplers decode the plain model: the base with the adapters merged in
            base = cfg.model.param_dtype
            detail = f"the base with the adapters merged in ({base}), a copy while sampling"
            items.append(dataclasses.replace(weights, name="merged weights", detail=detail))
        if self.sharding.mesh.shape["fsdp"] > 1:  # the sampler gathers the weights over fsdp
            shardings = self.sharding.for_decoding(self.run.sampling_shardings)
            cd = self.arch.compute_dtype
            decode = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, cd, sharding=s), params, shardings
            )
            detail = f"weights gathered over fsdp in {cd} while sampling"
            items.append(_sized("decode weights", detail, decode))
        return items

    def _sampling_items(self, g: int, slots: int) -> list[Item]:
        """The KV cache of ``slots`` rows (0: every rollout) of a step of G = ``g`` and its
        prompts' prefill cache."""
        cfg, arch, shards = self.cfg, self.arch, self.sharding.batch_shards
        prompts, bucket = prompts_for(cfg.train, g), max(cfg.sampling.prompt_buckets)
        rows = prompts * g
        decoded = decode_rows(cfg.train, g, slots)
        width = bucket + cfg.sampling.max_new_tokens
        cache = (decoded, arch.num_kv_heads, arch.head_dim, width)
        layer = jax.ShapeDtypeStruct(
            cache,
            arch.compute_jnp_dtype,
            sharding=self.sharding.named((ax.BATCH, ax.ACT_KV_HEADS, None, ax.CACHE_LENGTH), cache),
        )
        # The sampler grows the cache in blocks, phase by phase (nothing copied); the rows that
        # leave for the tail are copied into a cache of their own (the second rung's rows, full
        # width) while the all-slots cache is still held.
        tail = 0  # rows that leave for the tail (none where the rows do not split over the shards)
        if decoded and decoded % shards == 0:
            tail = (row_rungs(decoded, cfg.sampling.row_buckets, shards) + (0,))[1]
        growth = 1 + tail / decoded if decoded else 1.0
        detail = (
            f"G = {g}: {decoded} of {rows} rollouts decoding at once (sampling.slots) x {width} "
            f"slots x {arch.num_layers} layers"
            + (f", x{growth:.2f} while the tail's {tail} rows are copied out" if tail else "")
        )
        per_layer = 2 * arch.num_layers  # keys and values of every layer
        kv = Item(
            "KV cache",
            detail,
            round(growth * per_layer * device_bytes(layer)),
            round(growth * per_layer * whole_bytes(layer)),
        )
        # One prefill per prompt, its cache replicated on every device (copied into the slots).
        prompt_bytes = per_layer * prompts * arch.num_kv_heads * arch.head_dim * bucket
        prompt_bytes *= np.dtype(arch.compute_jnp_dtype).itemsize
        detail = f"{prompts} prompts x {bucket} tokens x {arch.num_layers} layers, on every device"
        return [kv, Item("prompt cache", detail, prompt_bytes, prompt_bytes)]

    def update_items(self, g: int) -> list[Item]:
        """The update's activations, backward temporaries and log-prob logits at G = ``g``
        (traced once per G)."""
        if g not in self._update_items:
            self._update_items[g] = _update_items(
                self.cfg, self.run, self.state, self.arch, self.sharding.batch_shards, g
            )
        return self._update_items[g]

    def plan(self, slots: int, group_size: int | None = None) -> MemoryPlan:
        """The table for a step of G = ``group_size`` (default: the largest) with ``slots``
        rows decoding at once (resolved; 0: every rollout)."""
        g = group_size or self.group_size
        items = self.state_items + self._sampling_items(g, slots) + self.update_items(g)
        mesh = dict(self.sharding.mesh.shape)
        arch = self.arch
        return MemoryPlan(self.source, self.num_params, arch.param_dtype, mesh, items, self.lora)

    def auto_slots(self, device_bytes: int, share: float = 0.9) -> int:
        """``sampling.slots: auto``: the most rows of the largest G's rollouts whose KV cache
        fits ``share`` of ``device_bytes`` per device beside everything else held while
        sampling, a multiple of the mesh's batch shards (at most every rollout); with a tail
        (``sampling.row_buckets`` > 1), an even number of rows per device, so that half the
        slots is a rung and the KV cache's share per row is the one counted here."""
        cfg, g, shards = self.cfg, self.group_size, self.sharding.batch_shards
        rollouts = prompts_for(cfg.train, g) * g
        kv, prompt_cache = self._sampling_items(g, rollouts)
        held = [i for i in self.state_items if i.stage in ("state", "sampling")]
        per_row = kv.per_device / (rollouts // shards)  # bytes of one row's cache on its device
        rest = sum(i.per_device for i in held) + prompt_cache.per_device
        rows_per_device = min(int((share * device_bytes - rest) // per_row), rollouts // shards)
        if cfg.sampling.row_buckets > 1 and rows_per_device > 1:
            rows_per_device -= rows_per_device % 2
        if rows_per_device < 1:
            raise ConfigError(
                f"sampling.slots = auto: not one row's KV cache ({per_row / GIB:.2f} GiB) fits "
                f"beside the rest of sagc-jax plan's estimate ({rest / GIB:.1f} GiB) in "
                f"{share:.0%} of {device_bytes / GIB:.1f} GiB per device; shorten "
                f"sampling.max_new_tokens or spread the model (mesh.fsdp, mesh.tensor)"
            )
        return rows_per_device * shards


def memory_plan(
    cfg: Config, num_devices: int, slots: int | None = None, group_size: int | None = None
) -> MemoryPlan:
    """The table of `MemoryModel` for ``cfg`` on an abstract mesh of ``num_devices``, a step of
    the largest candidate G (or ``group_size``), ``slots`` rows decoding at once (default:
    ``sampling.slots``, ``auto`` counted as every rollout). Runs resolve theirs once through
    ``planning.resolve.resolve_run``; this is the plan of a config as it stands (the LoRA
    table, tests)."""
    g = max(make_controller(cfg.controller).candidates)
    plan = ShardingPlan.abstract(cfg.mesh, num_devices)
    model = MemoryModel(cfg, plan, g, architecture(cfg), training_settings(cfg))
    if slots is None:
        slots = 0 if cfg.sampling.slots == "auto" else cfg.sampling.slots
    return model.plan(slots, group_size)


def _update_items(cfg: Config, run: RunPrograms, state: PolicyState, arch, shards: int, g: int):
    rows = prompts_for(cfg.train, g) * g
    micro_rows = rows // (cfg.train.minibatches * cfg.train.microbatches)
    local_rows = max(1, micro_rows // shards)
    width = _update_width(cfg)
    residual = _residual_bytes(cfg, run, state, local_rows, width)
    layout = "packed" if cfg.train.packing else "padded"
    detail = (
        f"remat {arch.remat}: {local_rows} of {micro_rows} microbatch rows x {width} tokens "
        f"({layout}, at most); attention {arch.attention} as resolved on this machine: einsum "
        f"keeps each layer's [T, T] probabilities, cudnn / splash only per-row softmax statistics"
    )
    scale = micro_rows // local_rows
    items = [Item("activations", detail, residual, residual * scale)]
    temps = round(BACKWARD_TEMPS * residual)
    detail = f"{BACKWARD_TEMPS:g} x the activations: what the compiled backward holds beyond them"
    items.append(Item("backward temps", detail, temps, temps * scale))
    chunk = cfg.loss.logprob_chunk
    positions = chunk_positions(local_rows, width, chunk)
    logits = LOGIT_COPIES * local_rows * positions * arch.vocab_size * 4
    how = (
        "the whole microbatch's at once (loss.logprob_chunk 0)"
        if positions >= width
        else f"chunks of {local_rows} rows x {positions} positions (loss.logprob_chunk {chunk})"
    )
    detail = f"{LOGIT_COPIES} float32 [tokens, {arch.vocab_size}] buffers: {how}"
    items.append(Item("log-prob logits", detail, logits, logits * scale))
    return items


def _update_width(cfg: Config) -> int:
    """Tokens per update row: the packed row length, or the longest bucket + max_new_tokens."""
    buckets, new = cfg.sampling.prompt_buckets, cfg.sampling.max_new_tokens
    if cfg.train.packing:
        return resolve_pack_len(cfg.train.pack_len, buckets, new)
    return max(buckets) + new


def _residual_bytes(
    cfg: Config, run: RunPrograms, state: PolicyState, rows: int, width: int
) -> int:
    """Bytes the backward pass of ``run``'s loss keeps for ``rows`` update rows of ``width``
    tokens of ``state`` (abstract): its params are trained, its base (LoRA) and reference
    are not."""
    from jax._src.ad_checkpoint import saved_residuals  # what jax.ad_checkpoint prints

    graphdef, settings = run.graphdef, run.settings
    if cfg.train.packing:
        batch, layout = packed_batch_spec(rows, width), PACKED
    else:
        new = cfg.sampling.max_new_tokens
        batch, layout = batch_spec(rows, width - new, new), PADDED

    def loss(p, b, r, frozen):
        # The frozen weights take no gradient, so nothing is kept to compute one; what the
        # backward pass keeps of them is then the stop_gradient's output, an argument too.
        frozen = None if frozen is None else jax.lax.stop_gradient(frozen)
        return chunk_loss(layout, graphdef, p, r, b, 1.0, settings, frozen)[0]

    saved = saved_residuals(loss, state.params, batch, state.ref_params, state.base)
    frozen_here = f"output of stop_gradient from {__file__}:"
    return sum(
        math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
        for aval, why in saved
        if not why.startswith(("from the argument", frozen_here))
    )


def format_plan(plan: MemoryPlan, device_memory: float | None = None) -> str:
    mesh = " x ".join(f"{a} {n}" for a, n in plan.mesh.items())
    devices = math.prod(plan.mesh.values())
    lines = [
        f"model: {plan.source}, {plan.num_params / 1e9:.3f} B parameters ({plan.param_dtype})",
        f"mesh: {mesh} ({devices} device{'s' if devices > 1 else ''})",
        "",
        f"{'':<17}{'per device':>12}{'whole':>14}  detail",
    ]
    for item in plan.items:
        lines.append(
            f"{item.name:<17}{item.per_device / GIB:>8.2f} GiB{item.total / GIB:>10.2f} GiB"
            f"  {item.detail}"
        )
    total = plan.per_device
    sampling, update = plan.during("sampling"), plan.during("update")
    lines.append(
        f"{'total':<17}{total / GIB:>8.2f} GiB  the larger of sampling ({sampling / GIB:.2f} "
        f"GiB: all but the update's gradients, activations and temporaries) and the update "
        f"({update / GIB:.2f} GiB: all but decode weights and caches)"
    )
    if device_memory:
        verdict = "fits" if total <= device_memory * GIB else "does NOT fit"
        used = 100 * total / (device_memory * GIB)
        lines.append(
            f"{verdict} in {device_memory:.1f} GiB per device ({used:.0f}% used; XLA needs "
            f"headroom for temporaries)"
        )
    lines.append(
        "activations: residuals the backward pass keeps for one microbatch (tensor-parallel "
        "splits of them not counted: an upper bound when mesh.tensor > 1)"
    )
    return "\n".join(lines)


# One device of each size the LoRA table checks: (name, GiB).
FIT_DEVICES = (
    ("24 GB GPU", 24.0),
    ("48 GB GPU", 48.0),
    ("80 GB GPU", 80.0),
    (f"{HARDWARE['tpu-v5e'].name} chip", HARDWARE["tpu-v5e"].memory_gib),
)


def lora_comparison(cfg: Config, num_devices: int, rank: int) -> tuple[MemoryPlan, MemoryPlan]:
    """The memory plans of ``cfg`` with full fine-tuning and with LoRA adapters of ``rank`` on
    ``model.lora_targets`` (the rest of the config as it is)."""
    plans = []
    for r in (0, rank):
        model = dataclasses.replace(cfg.model, lora_rank=r)
        plans.append(memory_plan(dataclasses.replace(cfg, model=model), num_devices))
    return plans[0], plans[1]


def format_lora_comparison(full: MemoryPlan, lora: MemoryPlan) -> str:
    """Per-device GiB of each item and the totals of the two plans of :func:`lora_comparison`,
    and whether each fits one device of every size of ``FIT_DEVICES``."""
    devices = math.prod(full.mesh.values())
    head = ("full fine-tuning", f"LoRA {lora.lora.split(' on ')[0]}")
    lines = [
        f"model: {full.source}, {full.num_params / 1e9:.3f} B parameters ({full.param_dtype}); "
        f"LoRA: {lora.lora}",
        f"GiB per device on {devices} device{'s' if devices > 1 else ''}",
        "",
        f"{'':<28}{head[0]:>18}{head[1]:>18}",
    ]
    full_items = {i.name: i for i in full.items}
    for item in lora.items:
        was = full_items.get(item.name)
        cell = f"{was.per_device / GIB:.2f}" if was is not None else "-"
        lines.append(f"{item.name:<28}{cell:>18}{item.per_device / GIB:>18.2f}")
    lines.append(f"{'total':<28}{full.per_device / GIB:>18.2f}{lora.per_device / GIB:>18.2f}")
    for name, gib in FIT_DEVICES:
        used = [p.per_device / (gib * GIB) for p in (full, lora)]
        cells = [f"{'fits' if u <= 1 else 'no'} ({100 * u:.0f}%)" for u in used]
        lines.append(f"{f'one {name} ({gib:g} GiB)':<28}{cells[0]:>18}{cells[1]:>18}")
    lines.append(
        "totals: the larger of sampling and the update (the samplers' caches and the update's "
        "gradients and activations are never held at once); XLA needs headroom for temporaries"
    )
    return "\n".join(lines)
