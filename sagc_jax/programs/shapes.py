"""What a run's config makes of its shapes and settings (``planning.resolve.resolve_run`` reads
them once for a run): prompts and rollout rows per step at each G, the checks that every
candidate G splits into the mesh's shards, the processes and the (micro)batches, and the
`TrainingSettings` of its state (the update program's static settings and the optimizer)."""

from __future__ import annotations

import math

from sagc_jax.config import Config, ConfigError, ControllerConfig, TrainConfig
from sagc_jax.controller.registry import CONTROLLERS
from sagc_jax.programs.optim import make_optimizer
from sagc_jax.programs.state import TrainingSettings
from sagc_jax.programs.tail import TailBatcher
from sagc_jax.programs.update import UpdateSettings
from sagc_jax.rl import ALGORITHMS


def prompts_for(train: TrainConfig, group_size: int) -> int:
    """Prompts per step at group size G (the ``train`` section's): fixed, or a fixed rollout
    budget divided by G."""
    if train.batch_mode == "prompts":
        return train.prompts_per_step
    return train.rollout_budget // group_size


def decode_rows(train: TrainConfig, group_size: int, slots: int) -> int:
    """Rows whose KV cache a step of G = ``group_size`` holds at once: ``slots`` (resolved;
    0: every rollout), at most the step's rollouts."""
    rows = prompts_for(train, group_size) * group_size
    return min(slots or rows, rows)


def per_prompt_budget(controller: ControllerConfig) -> int:
    """The fixed rollout rows of a step whose controller fixes them whatever the sizes (the
    hybrid's ``per_prompt`` mode; its entry's ``row_budget``), 0: none, the rows are P x G."""
    return CONTROLLERS[controller.kind].row_budget(controller)


def rollout_shapes(cfg: Config, candidates: tuple[int, ...]) -> dict[str, tuple[int, int]]:
    """(rollouts, prompts) of every batch shape a step can sample, by label (one sampler
    program each): a fixed per-prompt budget is one shape, else one per candidate G."""
    t = cfg.train
    budget = per_prompt_budget(cfg.controller)
    if budget:
        return {f"B={budget}": (budget, t.prompts_per_step)}
    return {f"G={g}": (prompts_for(t, g) * g, prompts_for(t, g)) for g in candidates}


def tail_rollout_shapes(
    cfg: Config, candidates: tuple[int, ...], processes: int
) -> dict[int, tuple[int, int]]:
    """G -> (prompts a tail step starts, every process's; groups each process keeps) of the
    rollout of a step under tail batching: each process's trained prompts and the extra ones
    started beyond them (``tail_batching.extra``); the rollout stops once the kept ones are
    complete."""
    tail = TailBatcher(cfg.tail_batching, processes)
    shapes = {}
    for g in candidates:
        keep, extra = tail.shape(prompts_for(cfg.train, g))
        shapes[g] = ((keep + extra) * processes, keep)
    return shapes


def check_batch_shapes(
    cfg: Config, candidates: tuple[int, ...], batch_shards: int = 1, processes: int = 1
) -> None:
    """Every candidate G must give a batch the update can split into (micro)batches, the mesh
    into equal row shards and the processes into equal shares of whole groups."""
    t = cfg.train
    parts = t.minibatches * t.microbatches
    size_key = "train.rollout_budget" if t.batch_mode == "budget" else "train.prompts_per_step"
    if batch_shards % processes:
        raise ConfigError(
            f"mesh.data x mesh.fsdp = {batch_shards} batch shards is not a multiple of the "
            f"{processes} processes: every process must hold its own rows"
        )
    budget = per_prompt_budget(cfg.controller)
    if budget:
        candidates = ()  # one fixed batch of rows, whatever the sizes
        if budget % (parts * batch_shards):
            raise ConfigError(
                f"{CONTROLLERS[cfg.controller.kind].row_budget_key} = {budget} rollouts cannot "
                f"be split into "
                f"train.minibatches x train.microbatches = {parts} (micro)batches of rows the "
                f"{batch_shards} batch shards of the mesh divide"
            )
    for g in candidates:
        if t.batch_mode == "budget" and t.rollout_budget % g:
            raise ConfigError(
                f"train.rollout_budget = {t.rollout_budget} is not divisible by G = {g} "
                f"(controller candidates {list(candidates)})"
            )
        prompts = prompts_for(t, g)
        if prompts < 1 or (prompts * g) % parts:
            raise ConfigError(
                f"at G = {g} a step has {prompts * g} rollouts, which train.minibatches x "
                f"train.microbatches = {parts} does not divide"
            )
        if (prompts * g) % (parts * batch_shards):
            raise ConfigError(
                f"at G = {g} a step has {prompts * g} rollouts, {prompts * g // parts} per "
                f"microbatch, which the {batch_shards} batch shards of the mesh (mesh.data x "
                f"mesh.fsdp) do not divide; change train.minibatches / train.microbatches or "
                f"{size_key}"
            )
        if prompts % processes:
            raise ConfigError(
                f"at G = {g} a step has {prompts} prompts, which {processes} processes cannot "
                f"share evenly (train.prompts_per_step / train.rollout_budget)"
            )
        if cfg.tail_batching.enabled:  # a tail step's rollouts: more prompts per process
            local = prompts // processes
            started = (local + math.ceil(cfg.tail_batching.extra * local)) * processes
            if (started * g) % batch_shards:
                raise ConfigError(
                    f"at G = {g} a tail step starts {started} prompts ({started * g} rollouts), "
                    f"which the {batch_shards} batch shards of the mesh do not divide; change "
                    f"tail_batching.extra or {size_key}"
                )


def update_settings(cfg: Config) -> UpdateSettings:
    """The static settings of the update program for ``cfg``."""
    t = cfg.train
    return UpdateSettings(
        aggregation=ALGORITHMS[cfg.loss.algorithm].aggregation,
        eps_low=cfg.loss.eps_low,
        eps_high=cfg.loss.eps_high,
        kl_beta=cfg.loss.kl_beta,
        # the sampler reports log_softmax(logits) when greedy (temperature 0)
        temperature=cfg.sampling.temperature if cfg.sampling.temperature > 0 else 1.0,
        epochs=t.epochs,
        minibatches=t.minibatches,
        microbatches=t.microbatches,
        lora_dropout=cfg.model.lora_dropout if cfg.model.lora_rank else 0.0,
        logprob_chunk=cfg.loss.logprob_chunk,
    )


def trains_signal_only(cfg: Config) -> bool:
    """Whether the update of ``cfg``'s run leaves out the rollouts of advantage 0
    (`TrainingSettings.signal_only`)."""
    return training_settings(cfg).signal_only


def make_trainer_optimizer(cfg: Config):
    """The run's optimizer (its schedule counts optimizer updates over the whole run)."""
    t = cfg.train
    return make_optimizer(
        t.learning_rate,
        total_steps=t.steps * t.epochs * t.minibatches,
        warmup_steps=t.warmup_steps,
        schedule=t.lr_schedule,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        b1=t.adam_b1,
        b2=t.adam_b2,
        state_dtype=t.optimizer_dtype,
        # LoRA trains only the adapters, which are float32 (models.lora): no master copy
        param_dtype="float32" if cfg.model.lora_rank else cfg.model.param_dtype,
    )


def training_settings(cfg: Config) -> TrainingSettings:
    """What ``cfg`` makes of the run's trained state and its update: what
    ``programs.state.build_run`` reads (``planning.resolve.resolve_run`` derives it once for a
    run: ``RunShape.training``)."""
    return TrainingSettings(
        model=cfg.model,
        seed=cfg.train.seed,
        reference=cfg.loss.kl_beta > 0,
        update=update_settings(cfg),
        drop_no_signal=cfg.train.drop_no_signal,
        tx=make_trainer_optimizer(cfg),
    )
