"""A run's trained state and the programs over it, built in one place: concretely for a run
(``train.loop.Trainer``), or abstractly for ``sagc-jax plan``'s memory model
(``planning.memory``) and ``plan --compile`` (``planning.aot``): shapes and shardings, nothing
allocated.

``build_run`` reads the run's `TrainingSettings` (what its config makes of the trained state,
derived once by ``programs.shapes.training_settings``) and decides, once, what the rest of the run
reads:

- LoRA (``model.lora_rank > 0``): the model's params become the frozen ``base``, the adapters
  are what is trained, and the samplers decode the base with the adapters merged in;
- the reference policy of the KL term (``loss.kl_beta > 0``): a frozen copy of the initial
  params, or with LoRA the base itself (the adapters off), so no copy;
- the optimizer, and where every piece of the state lives on the mesh;
- the update programs and their static settings.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sagc_jax.config import ModelConfig
from sagc_jax.models import Decoder, DecoderConfig
from sagc_jax.models import lora as lora_lib
from sagc_jax.models.lora import LoRAParam
from sagc_jax.parallel import ShardingPlan
from sagc_jax.programs.policy import Policy
from sagc_jax.programs.update import PolicyPrograms, StateShardings, UpdateSettings


@dataclasses.dataclass(frozen=True)
class TrainingSettings:
    """What a run's config makes of its trained state and its update, derived once
    (``programs.shapes.training_settings``; a run's: ``RunShape.training``): what ``build_run``
    reads, and which rollouts the update batch keeps."""

    model: ModelConfig  # its ``lora_*``: adapters over frozen params when ``lora_rank`` > 0
    seed: int  # ``train.seed``: the adapters' initialisation
    reference: bool  # the KL term's frozen reference is held (``loss.kl_beta`` > 0)
    update: UpdateSettings  # the update programs' static settings
    drop_no_signal: bool  # ``train.drop_no_signal``
    tx: optax.GradientTransformation  # the optimizer

    @property
    def signal_only(self) -> bool:
        """Whether the update leaves out the rollouts of advantage 0 (``train.drop_no_signal``):
        only when no term of the loss gives them a gradient (no KL term)."""
        return self.drop_no_signal and self.update.zero_advantage_is_inert


class PolicyState(NamedTuple):
    """What a run trains and holds on the devices (a pytree; arrays, or ShapeDtypeStructs with
    their shardings when built abstractly)."""

    params: Any  # what is trained: the model's params, or (LoRA) the adapters
    opt_state: Any
    ref_params: Any = None  # the KL term's frozen reference (kl_beta > 0, without LoRA)
    base: Any = None  # LoRA: the frozen weights under the adapters


@dataclasses.dataclass(frozen=True)
class RunPrograms:
    """The programs of a run and what they are built over."""

    programs: PolicyPrograms  # the optimizer updates (one compiled program per batch shape)
    settings: UpdateSettings  # their static settings
    tx: optax.GradientTransformation
    shardings: StateShardings  # where each field of PolicyState lives
    graphdef: nnx.GraphDef  # the trained model's (with LoRA: the adapted model's)
    arch: DecoderConfig  # the architecture the samplers decode (the base's, with LoRA)
    sampling_graphdef: nnx.GraphDef  # the model the samplers decode
    sampling_shardings: Any  # where the decoded params live
    merge: Callable | None = None  # LoRA: (adapters, base) -> the base with them merged in

    def update(self, state: PolicyState, batch: dict, key) -> tuple[PolicyState, dict]:
        """``epochs x minibatches`` optimizer updates on one rollout batch (see
        ``PolicyPrograms.update``): the state after them and their metrics."""
        params, opt_state, metrics = self.programs.update(state, batch, key, self.settings)
        return state._replace(params=params, opt_state=opt_state), metrics

    def lower_update(self, state: PolicyState, batch: dict, key) -> jax.stages.Lowered:
        """The update for ``batch``'s shapes, lowered (arrays or ShapeDtypeStructs)."""
        return self.programs.lower_update(state, batch, key, self.settings)

    def compile_update(self, state: PolicyState, batch: dict, key) -> None:
        """Compile the update for ``batch``'s shapes now; the next call with them reuses it."""
        self.lower_update(state, batch, key).compile()

    def compiled_programs(self) -> dict[str, int]:
        return self.programs.compiled_programs()

    def sampling_params(self, state: PolicyState):
        """What the samplers decode: the params, or (LoRA) the base with the adapters merged
        in, once per use (faster than adding them in every decode step: docs/lora.md)."""
        return state.params if self.merge is None else self.merge(state.params, state.base)


def abstract(tree, shardings):
    """``tree``'s arrays as ShapeDtypeStructs placed by ``shardings`` (a tree of the same
    structure)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def abstract_policy(arch: DecoderConfig, plan: ShardingPlan) -> Policy:
    """The model of ``arch`` as shapes and shardings only (for compiling ahead of time)."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(arch, rngs=nnx.Rngs(0))))
    shardings = plan.params(params)
    return Policy(graphdef, abstract(params, shardings), arch, shardings)


def adapted_architecture(m: ModelConfig, base_arch: DecoderConfig) -> DecoderConfig:
    """``base_arch`` with the run's LoRA adapters (``model.lora_*``): the one place a run's
    adapted model is described (the trainer, plan, export)."""
    return base_arch.replace(
        lora_rank=m.lora_rank,
        lora_alpha=m.lora_alpha,
        lora_targets=m.lora_targets,
        lora_dropout=m.lora_dropout,
    )


def _adapters(m: ModelConfig, base_arch: DecoderConfig, seed: int, plan: ShardingPlan, concrete):
    """(graphdef of the adapted model, adapters, their shardings, adapted architecture): the
    adapters freshly initialised (B zeros) inside one program placed by ``plan`` (the base
    weights it would draw are never computed: only the adapters are its outputs), or only
    their shapes when not ``concrete``."""
    arch = adapted_architecture(m, base_arch)

    def adapted():
        return Decoder(arch, rngs=nnx.Rngs(seed))

    graphdef, shapes, _ = nnx.split(nnx.eval_shape(adapted), LoRAParam, ...)
    shardings = plan.params(shapes)
    if not concrete:
        return graphdef, abstract(shapes, shardings), shardings, arch
    init = jax.jit(lambda: nnx.split(adapted(), LoRAParam, ...)[1], out_shardings=shardings)
    return graphdef, init(), shardings, arch


def build_run(
    training: TrainingSettings, plan: ShardingPlan, policy: Policy, *, concrete: bool = True
) -> tuple[RunPrograms, PolicyState]:
    """The run's programs and its initial state, as ``training`` sets them, from the model it
    starts from (``policy``: built, and loaded from a warm start, by the caller; or
    ``abstract_policy``'s).

    ``concrete``: allocate and initialise the state on the devices (adapters, optimizer state,
    the reference's copy); else the same pytree of ShapeDtypeStructs with their shardings."""
    graphdef, params, param_shardings = policy.graphdef, policy.params, policy.shardings
    base = base_shardings = merge = None
    if training.model.lora_rank:  # the model's params become the frozen base
        base, base_shardings = params, param_shardings
        graphdef, params, param_shardings, adapted = _adapters(
            training.model, policy.arch, training.seed, plan, concrete
        )
        merge = jax.jit(
            functools.partial(lora_lib.merge_adapters, lora_scale=lora_lib.scale(adapted)),
            out_shardings=base_shardings,
        )
    tx = training.tx
    opt_shapes = jax.eval_shape(tx.init, params)
    opt_shardings = plan.opt_state(tx, opt_shapes, param_shardings)
    if concrete:
        opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    else:
        opt_state = abstract(opt_shapes, opt_shardings)
    ref_params = None  # LoRA: the reference is the base with the adapters off
    if training.reference and base is None:
        copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=param_shardings)
        ref_params = copy(params) if concrete else params
    shardings = StateShardings(
        param_shardings,
        opt_shardings,
        param_shardings if ref_params is not None else None,
        base_shardings,
    )
    run = RunPrograms(
        programs=PolicyPrograms(graphdef, tx, plan, shardings),
        settings=training.update,
        tx=tx,
        shardings=shardings,
        graphdef=graphdef,
        arch=policy.arch,
        sampling_graphdef=policy.graphdef,
        sampling_shardings=policy.shardings,
        merge=merge,
    )
    return run, PolicyState(params, opt_state, ref_params, base)
