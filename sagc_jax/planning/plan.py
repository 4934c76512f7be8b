"""``sagc-jax plan``: the memory a config needs on each device, before launching it.

Everything comes from shapes: the parameters and optimizer state from ``jax.eval_shape``, the
activations from the residuals the update's backward pass saves (traced, not run, with the
configured rematerialisation), the KV cache from the largest candidate G. Each array is split the
way the trainer splits it: the same logical-axis rules on an abstract mesh of ``num_devices``
devices, so no device is needed and nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AbstractMesh

from sagc_jax.config import Config, ConfigError
from sagc_jax.controller import make_controller
from sagc_jax.controller.registry import CONTROLLERS
from sagc_jax.decode_schedule import row_rungs
from sagc_jax.models import PRESETS, Decoder, DecoderConfig, get_preset
from sagc_jax.models import axes as ax
from sagc_jax.models.hf_checkpoint import hf_architecture
from sagc_jax.models.lora import LoRAParam
from sagc_jax.parallel import BATCH_AXES, MESH_AXES, RULES, mesh_shape
from sagc_jax.programs.packing import resolve_pack_len
from sagc_jax.programs.policy import adapted_architecture, preset_architecture, run_settings
from sagc_jax.programs.shapes import (
    decode_rows,
    make_trainer_optimizer,
    prompts_for,
    trains_signal_only,
    update_settings,
)
from sagc_jax.programs.update import (
    PACKED,
    PADDED,
    batch_spec,
    chunk_loss,
    packed_batch_spec,
)
from sagc_jax.rl.logprobs import chunk_positions
from sagc_jax.sim.roofline import (
    HARDWARE,
    MEASURED,
    REGIMES,
    Efficiency,
    dense_seconds,
    model_costs,
    rollout_seconds,
    update_seconds,
)
from sagc_jax.sim.steptime import Engine, StepTimer
from sagc_jax.tasks import CharTokenizer

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


def architecture(cfg: Config) -> tuple[DecoderConfig, str]:
    """The model's shapes: the HF checkpoint's config.json if present, else the preset."""
    m = cfg.model
    if m.hf_checkpoint and (Path(m.hf_checkpoint) / "config.json").is_file():
        # a bad config.json: one line naming it
        arch = hf_architecture(m.hf_checkpoint, **run_settings(cfg))
        return arch, f"{m.hf_checkpoint}/config.json"
    source = f"preset {m.preset}"
    if m.hf_checkpoint:
        source += f" ({m.hf_checkpoint} not found)"
    synthetic = cfg.data.task == "synthetic"  # its character vocabulary
    return preset_architecture(cfg, CharTokenizer() if synthetic else None), source


def timed_architecture(cfg: Config) -> tuple[DecoderConfig, str]:
    """The model ``sim.model`` names, as the step-time model times it: a preset or an HF
    checkpoint (its directory or config.json), in bfloat16; empty: the config's own model."""
    name = cfg.sim.model
    if not name:
        arch, _ = architecture(cfg)
        return arch, cfg.model.preset if not cfg.model.hf_checkpoint else cfg.model.hf_checkpoint
    dtypes = {"param_dtype": "bfloat16", "compute_dtype": "bfloat16"}
    if name in PRESETS:
        return get_preset(name, **dtypes), name
    path = Path(name)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(
            f"sim.model = {name!r} is neither a model preset ({sorted(PRESETS)}) nor an HF "
            "checkpoint directory or config.json"
        )
    try:
        return hf_architecture(str(path), **dtypes), name
    except ConfigError as err:  # names the file: truncated, not an object, a bad size
        raise ConfigError(f"sim.model: {err}") from None


def step_timer(cfg: Config, padded_width: int, max_new_tokens: int | None = None) -> StepTimer:
    """The step-time model of ``cfg.sim`` (``sim.steptime.StepTimer``) for the model of
    ``timed_architecture``, with the config's update layout (``train.packing``; padded rows are
    ``padded_width`` tokens), ``train.epochs`` and the sampler's settings (``sampling``) with a
    cap of ``max_new_tokens`` (default ``sampling.max_new_tokens``; the synthetic workload's is
    ``sim.max_new_tokens``)."""
    costs, name = None, ""
    if cfg.sim.hardware != "custom":
        arch, name = timed_architecture(cfg)
        costs = model_costs(arch)
    cap = cfg.sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
    return StepTimer(
        cfg.sim,
        costs,
        name,
        padded_width=None if cfg.train.packing else padded_width,
        epochs=cfg.train.epochs,
        reference=cfg.loss.kl_beta > 0,
        signal_only=trains_signal_only(cfg),
        engine=Engine.of(cfg.sampling, cap),
    )


def controller_for_run(cfg: Config):
    """The run's controller (``controller.*``); one that ``weighs_step_time`` (``sagc_value``)
    weighs the modeled seconds of a step at each G by ``cfg.sim``'s step-time model (compacting
    rollouts plus the update, the prompts at the largest prompt bucket: ``cfg`` with its
    buckets resolved)."""
    step_seconds = None
    if CONTROLLERS[cfg.controller.kind].cls.weighs_step_time:
        prompt = max(cfg.sampling.prompt_buckets)
        timer = step_timer(cfg, prompt + cfg.sampling.max_new_tokens)
        step_seconds = timer.step_seconds(prompt)
    return make_controller(cfg.controller, step_seconds=step_seconds)


def _shard_bytes(x, logical, mesh: AbstractMesh, rules=RULES) -> int:
    """Bytes of one device's piece of ``x`` when its dimensions have the ``logical`` names."""
    spec = ax.mesh_spec(tuple(logical), x.shape, mesh, rules)
    shape = list(x.shape)
    for dim, entry in enumerate(spec):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        shape[dim] //= math.prod(mesh.shape[a] for a in names)
    return math.prod(shape) * np.dtype(x.dtype).itemsize


def _tree_bytes(tree, logical_tree, mesh, rules=RULES) -> tuple[int, int]:
    leaves = jax.tree.leaves(tree)
    is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)  # noqa: E731
    specs = jax.tree.leaves(logical_tree, is_leaf=is_spec)
    per_device = sum(_shard_bytes(x, s, mesh, rules) for x, s in zip(leaves, specs, strict=True))
    total = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)
    return per_device, total


def memory_plan(
    cfg: Config,
    num_devices: int,
    device_bytes: int | None = None,
    slots: int | None = None,
    group_size: int | None = None,
) -> MemoryPlan:
    """Per-device memory of ``cfg`` on ``num_devices``; its prompt buckets must be concrete
    (``data.with_resolved_buckets`` turns ``auto`` into the data's). The step is one of G =
    ``group_size`` (default: the largest candidate). The KV cache holds ``slots`` rows
    (default: ``sampling.slots`` of the step's rollouts; ``auto`` resolved by `auto_slots`
    against ``device_bytes`` per device, or all the rollouts when that is not given)."""
    if isinstance(cfg.sampling.prompt_buckets, str):
        raise ConfigError(
            "sagc-jax plan needs the prompt buckets: resolve sampling.prompt_buckets = auto "
            "from the data first (data.with_resolved_buckets)"
        )
    arch, source = architecture(cfg)
    sizes = mesh_shape(cfg.mesh, num_devices)
    mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
    batch_shards = math.prod(sizes[a] for a in BATCH_AXES)
    items: list[Item] = []

    m = cfg.model
    lora = f"rank {m.lora_rank} on {', '.join(m.lora_targets)}" if m.lora_rank else ""
    if lora:  # the adapted model: adapters trained, the weights under them frozen
        arch = adapted_architecture(cfg, arch)
    model = nnx.eval_shape(lambda: Decoder(arch, rngs=nnx.Rngs(0)))
    graphdef, adapters, params = nnx.split(model, LoRAParam, ...)
    logical = nnx.get_partition_spec(params)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    p_dev, p_total = _tree_bytes(params, logical, mesh)
    frozen = ", frozen" if lora else ""
    items.append(Item("parameters", f"{count:,} x {arch.param_dtype}{frozen}", p_dev, p_total))
    items += _training_items(cfg, adapters if lora else params, (p_dev, p_total), mesh, lora)

    if sizes["fsdp"] > 1:  # the sampler gathers the weights over fsdp for the decode loop
        decode = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, arch.compute_dtype), params)
        gathered = {**RULES, ax.EMBED: None}
        d_dev, d_total = _tree_bytes(decode, logical, mesh, gathered)
        detail = f"weights gathered over fsdp in {arch.compute_dtype} while sampling"
        items.append(Item("decode weights", detail, d_dev, d_total))

    g = group_size or max(make_controller(cfg.controller).candidates)
    if slots is None:
        slots = cfg.sampling.slots
        if slots == "auto":
            slots = auto_slots(cfg, num_devices, device_bytes) if device_bytes else 0
    rows = prompts_for(cfg, g) * g
    decoded = decode_rows(cfg, g, slots)
    width = max(cfg.sampling.prompt_buckets) + cfg.sampling.max_new_tokens
    cd = arch.compute_jnp_dtype
    cache = jax.ShapeDtypeStruct((decoded, arch.num_kv_heads, arch.head_dim, width), cd)
    per_layer = _shard_bytes(cache, (ax.BATCH, ax.ACT_KV_HEADS, None, ax.CACHE_LENGTH), mesh)
    total_cache = 2 * arch.num_layers * math.prod(cache.shape) * cache.dtype.itemsize
    # The sampler grows the cache in blocks, phase by phase (nothing copied); the rows that leave
    # for the tail are copied into a cache of their own (the second rung's rows, full width)
    # while the all-slots cache is still held.
    tail = 0  # rows that leave for the tail (none where the rows do not split over the shards)
    if decoded and decoded % batch_shards == 0:
        tail = (row_rungs(decoded, cfg.sampling.row_buckets, batch_shards) + (0,))[1]
    growth = 1 + tail / decoded if decoded else 1.0
    detail = (
        f"G = {g}: {decoded} of {rows} rollouts decoding at once (sampling.slots) x {width} "
        f"slots x {arch.num_layers} layers"
        + (f", x{growth:.2f} while the tail's {tail} rows are copied out" if tail else "")
    )
    per_device = round(growth * 2 * arch.num_layers * per_layer)
    items.append(Item("KV cache", detail, per_device, round(growth * total_cache)))
    # One prefill per prompt, its cache replicated on every device (copied into the slots).
    prompts = prompts_for(cfg, g)
    bucket = max(cfg.sampling.prompt_buckets)
    prompt_bytes = 2 * arch.num_layers * prompts * arch.num_kv_heads * arch.head_dim * bucket
    prompt_bytes *= cache.dtype.itemsize
    detail = f"{prompts} prompts x {bucket} tokens x {arch.num_layers} layers, on every device"
    items.append(Item("prompt cache", detail, prompt_bytes, prompt_bytes))

    # Packed rows: at most the padded row count (the ladder's top rung) of pack_len tokens.
    micro_rows = rows // (cfg.train.minibatches * cfg.train.microbatches)
    local_rows = max(1, micro_rows // batch_shards)
    width = _update_width(cfg)
    trainable, base = (adapters, params) if lora else (params, None)
    residual = _residual_bytes(cfg, graphdef, trainable, base, local_rows, width)
    layout = "packed" if cfg.train.packing else "padded"
    detail = (
        f"remat {arch.remat}: {local_rows} of {micro_rows} microbatch rows x {width} tokens "
        f"({layout}, at most); attention {arch.attention} as resolved on this machine: einsum "
        f"keeps each layer's [T, T] probabilities, cudnn / splash only per-row softmax statistics"
    )
    items.append(Item("activations", detail, residual, residual * micro_rows // local_rows))
    scale = micro_rows // local_rows
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
    return MemoryPlan(source, count, arch.param_dtype, sizes, items, lora)


def auto_slots(cfg: Config, num_devices: int, device_bytes: int, share: float = 0.9) -> int:
    """``sampling.slots: auto``: the most rows of the largest candidate G's rollouts whose KV
    cache fits ``share`` of ``device_bytes`` per device beside everything else `memory_plan`
    counts, a multiple of the mesh's batch shards (at most every rollout); with a tail
    (``sampling.row_buckets`` > 1), an even number of rows per device, so that half the slots
    is a rung and the KV cache's share per row is the one counted here."""
    g = max(make_controller(cfg.controller).candidates)
    rollouts = prompts_for(cfg, g) * g
    sizes = mesh_shape(cfg.mesh, num_devices)
    shards = math.prod(sizes[a] for a in BATCH_AXES)
    plan = memory_plan(cfg, num_devices, slots=rollouts)
    kv = next(item for item in plan.items if item.name == "KV cache")
    per_row = kv.per_device / (rollouts // shards)  # bytes of one row's cache on its device
    rest = plan.during("sampling") - kv.per_device
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


def _training_items(cfg: Config, trainable, weight_bytes, mesh, lora: str) -> list[Item]:
    """What training adds to the weights (``weight_bytes``: their per-device and whole bytes):
    optimizer state and gradients of ``trainable`` (the parameters, or the LoRA adapters when
    ``lora`` describes them), the reference model, and with LoRA the adapters themselves and the
    merged weights the samplers decode."""
    items = []
    logical = nnx.get_partition_spec(trainable)
    t_dev, t_total = _tree_bytes(trainable, logical, mesh)
    dtype = str(jax.tree.leaves(trainable)[0].dtype)
    of = " of the adapters" if lora else ""
    if lora:
        count = sum(math.prod(x.shape) for x in jax.tree.leaves(trainable))
        items.append(Item("LoRA adapters", f"{count:,} x {dtype}, {lora}", t_dev, t_total))

    tx = make_trainer_optimizer(cfg)
    opt_state = jax.eval_shape(tx.init, trainable)
    opt_logical = optax.tree_map_params(
        tx,
        lambda _, spec: spec,
        opt_state,
        logical,
        transform_non_params=lambda _: jax.sharding.PartitionSpec(),
    )
    o_dev, o_total = _tree_bytes(opt_state, opt_logical, mesh)
    master = cfg.train.optimizer_dtype == "float32" and dtype != "float32"
    master = " + float32 master copy of the parameters" if master else ""
    detail = f"Adam moments in {cfg.train.optimizer_dtype}{master}{of}"
    items.append(Item("optimizer state", detail, o_dev, o_total))

    copies = 2 if cfg.train.microbatches > 1 else 1
    detail = dtype + of + (", x2 while accumulating microbatches" if copies == 2 else "")
    items.append(Item("gradients", detail, copies * t_dev, copies * t_total))
    if cfg.loss.kl_beta > 0:
        if lora:
            items.append(Item("reference model", "the base with the adapters off: no copy", 0, 0))
        else:
            detail = f"kl_beta = {cfg.loss.kl_beta}"
            items.append(Item("reference model", detail, *weight_bytes))
    if lora:  # the samplers decode the plain model: the base with the adapters merged in
        dtype = cfg.model.param_dtype
        detail = f"the base with the adapters merged in ({dtype}), a copy while sampling"
        items.append(Item("merged weights", detail, *weight_bytes))
    return items


def _update_width(cfg: Config) -> int:
    """Tokens per update row: the packed row length, or the longest bucket + max_new_tokens."""
    buckets, new = cfg.sampling.prompt_buckets, cfg.sampling.max_new_tokens
    if cfg.train.packing:
        return resolve_pack_len(cfg.train.pack_len, buckets, new)
    return max(buckets) + new


def _residual_bytes(cfg: Config, graphdef, params, base, rows: int, width: int) -> int:
    """Bytes the backward pass of the loss keeps for ``rows`` update rows of ``width`` tokens;
    ``params`` are what is trained, ``base`` the frozen weights under LoRA adapters (or None)."""
    from jax._src.ad_checkpoint import saved_residuals  # what jax.ad_checkpoint prints

    settings = update_settings(cfg)
    if cfg.train.packing:
        batch, layout = packed_batch_spec(rows, width), PACKED
    else:
        new = cfg.sampling.max_new_tokens
        batch, layout = batch_spec(rows, width - new, new), PADDED
    ref = params if settings.kl_beta > 0 and base is None else None

    def loss(p, b, r, frozen):
        # The frozen weights take no gradient, so nothing is kept to compute one; what the
        # backward pass keeps of them is then the stop_gradient's output, an argument too.
        frozen = None if frozen is None else jax.lax.stop_gradient(frozen)
        return chunk_loss(layout, graphdef, p, r, b, 1.0, settings, frozen)[0]

    saved = saved_residuals(loss, params, batch, ref, base)
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


def step_prediction(
    cfg: Config,
    hardware: str,
    num_devices: int,
    mean_new_tokens: int | None = None,
    update_flops: tuple[float, str] | None = None,
) -> dict:
    """Rollout and update seconds of one step at the ladder's largest G on ``num_devices``
    chips of ``hardware`` (a key of ``sim.roofline.HARDWARE``), by the roofline model.

    Lengths: prompts as long as the longest bucket; one completion reaches
    ``max_new_tokens`` (the straggler every synchronous step waits for) and the others are
    ``mean_new_tokens`` long (default: half of ``max_new_tokens``). Rollouts in each regime of
    ``sim.roofline.REGIMES``: ``compacting`` with the config's sampling settings (one prefill per
    prompt; ``sampling.slots: auto`` modeled as all rows), ``continuous`` with ``sim.slots`` per
    chip. The update's FLOPs: the roofline's for the step's tokens, or ``update_flops`` (FLOPs,
    what they are: the compiled update program's, from ``plan --compile``).
    """
    if hardware not in HARDWARE:
        raise ConfigError(f"--hardware {hardware!r} is not known; choose one of {list(HARDWARE)}")
    hw, arch = HARDWARE[hardware], architecture(cfg)[0]
    costs = model_costs(arch)
    g = max(make_controller(cfg.controller).candidates)
    rows = prompts_for(cfg, g) * g
    prompt, cap = max(cfg.sampling.prompt_buckets), cfg.sampling.max_new_tokens
    mean = min(cap, mean_new_tokens if mean_new_tokens is not None else max(1, cap // 2))
    lengths = np.full((rows // g, g), mean)
    lengths[0, 0] = cap
    eff = Efficiency.of(cfg.sim)
    settings = {  # what each regime of sim.roofline.rollout_seconds needs besides the lengths
        "compacting": Engine.of(cfg.sampling, cap).settings(lengths),
        "synchronous": {},
        "continuous": {"slots": cfg.sim.slots * num_devices},
    }
    rollout = {
        regime: rollout_seconds(
            costs, hw, lengths, prompt, num_devices, regime, eff=eff, **settings[regime]
        )
        for regime in REGIMES
    }
    tail = None
    if cfg.tail_batching.enabled:  # a tail step: extra prompts, cut once P groups are whole
        prompts = rows // g
        started = prompts + math.ceil(cfg.tail_batching.extra * prompts)
        tail_lengths = np.full((started, g), mean)
        tail_lengths[0, 0] = cap  # the straggler's group is cut and deferred
        tail_seconds = rollout_seconds(
            costs,
            hw,
            tail_lengths,
            prompt,
            num_devices,
            "compacting",
            eff=eff,
            keep_groups=prompts,
            groups_r=np.repeat(np.arange(started), g),
            **Engine.of(cfg.sampling, cap).settings(tail_lengths),
        )["seconds"]
        # the queue gains (started - prompts) a tail step; a long round (the compacting step
        # above: it waits for the deferred straggler) when it holds a step's prompts
        every = cfg.tail_batching.long_round_every
        tail_steps = math.ceil(prompts / (started - prompts))
        if every:
            tail_steps = min(tail_steps, max(every - 1, 1))
        tail = {"seconds": tail_seconds, "tail_steps": tail_steps, "started": started}
    # the update's tokens: packed rows hold the real tokens, padded rows prompt + cap each
    width = prompt + (int(lengths.mean()) if cfg.train.packing else cap)
    tokens, context = rows * width, rows * width * (width + 1) / 2
    update = update_seconds(
        costs, hw, tokens, context, num_devices, cfg.train.epochs, eff, cfg.loss.kl_beta > 0
    )
    flops_source = "forward + backward of the step's tokens by the roofline"
    if cfg.loss.kl_beta > 0:
        flops_source += ", and the reference policy's forward (KL)"
    if update_flops is not None:
        update = dense_seconds(update_flops[0], hw, num_devices, eff)
        flops_source = f"{update_flops[0] / 1e12:.3g} TFLOPs of {update_flops[1]}"
    return {
        "hardware": hw,
        "hardware_key": hardware,
        "devices": num_devices,
        "costs": costs,
        "group_size": g,
        "rows": rows,
        "prompt": prompt,
        "cap": cap,
        "mean": mean,
        "generated": int(lengths.sum()),
        "rollout": rollout,
        "update_tokens": tokens,
        "layout": "packed: real tokens" if cfg.train.packing else "padded: rows x width",
        "update_seconds": update,
        "update_flops_source": flops_source,
        "signal_only": trains_signal_only(cfg),
        "steps": cfg.train.steps,
        "tail": tail,
    }


_REGIME_NOTES = {  # what each rollout regime of the roofline is (sim/roofline.py)
    "compacting": " (this sampler: finished rows leave, slots refill)",
    "synchronous": " (every row until the longest ends)",
    "continuous": " (vLLM-style: a finished row's slot refilled at once)",
}


def format_step(pred: dict) -> str:
    """The prediction of :func:`step_prediction` as lines of text."""
    hw, costs = pred["hardware"], pred["costs"]
    lines = [
        f"step on {pred['devices']} x {hw.name} (roofline model; peak {hw.peak_flops / 1e12:.0f} "
        f"TFLOP/s, {hw.hbm_bandwidth / 1e12:.2f} TB/s per chip; {hw.source})",
        f"  model: {costs.params / 1e9:.3f} B parameters, {costs.weight_bytes / GIB:.2f} GiB of "
        f"weights read per decode step, {costs.kv_bytes_per_token / 1024:.0f} KiB of KV cache "
        f"per token",
        f"  at G = {pred['group_size']}: {pred['rows']} rollouts, prompts of {pred['prompt']} "
        f"tokens, one completion of {pred['cap']} tokens and the others {pred['mean']} "
        f"(--mean-new-tokens)",
    ]
    for date, machine, what in MEASURED.get(pred["hardware_key"], ()):
        lines.append(f"  measured here before ({date}, {machine}): {what}")
    for regime, r in pred["rollout"].items():
        rows, padding = r["rows_decoded"], 1 - r["live_rows_decoded"] / max(r["rows_decoded"], 1)
        lines.append(
            f"  rollout, {regime}{_REGIME_NOTES[regime]}: {r['seconds']:.2f} s "
            f"({r['decode_steps']} decode steps of {rows / max(r['decode_steps'], 1):,.0f} rows "
            f"on average, {100 * padding:.0f}% of them finished; {r['limit']}-bound; "
            f"{pred['generated'] / r['seconds']:,.0f} generated tokens/s)"
        )
    every = ""
    if pred["signal_only"]:
        every = (
            "; every group with learning signal: train.drop_no_signal leaves the groups whose "
            "rewards are all equal out, a share s of groups with signal costs about s x this"
        )
    lines.append(
        f"  update: {pred['update_seconds']:.2f} s ({pred['update_tokens']:,} tokens "
        f"({pred['layout']}); {pred['update_flops_source']}, at the assumed MFU{every})"
    )
    hours = {
        regime: pred["steps"] * (r["seconds"] + pred["update_seconds"]) / 3600
        for regime, r in pred["rollout"].items()
    }
    tail = pred["tail"]
    if tail is not None:
        long_s = pred["rollout"]["compacting"]["seconds"]
        cycle = (tail["tail_steps"] * tail["seconds"] + long_s) / (tail["tail_steps"] + 1)
        trained = pred["rows"] // pred["group_size"]
        hours["tail batching"] = pred["steps"] * (cycle + pred["update_seconds"]) / 3600
        lines.append(
            f"  rollout, tail batching (tail_batching.enabled): {tail['seconds']:.2f} s a tail "
            f"step ({tail['started']} prompts started, cut once {trained} groups are whole: "
            f"the straggler's group is deferred), then a long round of the deferred "
            f"prompts every {tail['tail_steps'] + 1} steps ({long_s:.2f} s, compacting): "
            f"{cycle:.2f} s a step on average"
        )
    lines.append(
        f"  {pred['steps']} steps (train.steps) at this G: {hours['compacting']:.1f} h with this "
        f"sampler (compacting), {hours['synchronous']:.1f} h synchronous, "
        f"{hours['continuous']:.1f} h with continuous batching"
        + (f", {hours['tail batching']:.1f} h with tail batching" if tail is not None else "")
        + " (one sampling round a step; no evaluation or checkpoint time)"
    )
    return "\n".join(lines)
