"""The controller's two calls in a training step, the same on every process: the group size it
proposes before sampling (checked to be process 0's) and what it observes after the update
(every process's rollouts of every round, gathered once into a ``StepObservation``)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from sagc_jax.controller import GroupController, StepObservation
from sagc_jax.parallel import any_process, from_leader, gather_rows
from sagc_jax.train.rollout import Rollouts, StepPrompts


def agreed_group_size(
    controller: GroupController, prompts: StepPrompts, prompts_per_step: int
) -> int | np.ndarray:
    """The controller's G for the step of ``prompts``, or int64 [P] per-prompt sizes (hybrid
    ``per_prompt``), checked to be process 0's (the controllers of all processes see the same
    gathered statistics and prompts, so they must agree)."""
    if controller.prompt_aware:
        g = controller.propose_for(*_step_prompts(prompts, prompts_per_step))
    else:
        g = controller.propose()
    leader_g = from_leader(np.asarray(g, np.int32))
    if any_process(not np.array_equal(leader_g, g)):  # all stop together, none waits alone
        raise RuntimeError(
            f"step {prompts.step}: the processes' controllers disagree (process "
            f"{jax.process_index()}: G = {g}, process 0: G = {leader_g}); their states diverged"
        )
    return g


def _step_prompts(prompts: StepPrompts, prompts_per_step: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 [P], prompt tokens int64 [P]) of the step's prompts, every process's, in
    the order of the global batch (``train.batch_mode: prompts``: they do not depend on G)."""
    batch, encoded = prompts.round(0, prompts_per_step)
    ids = np.array([p.id for p in batch], np.int64)
    tokens = np.array([len(x) for x in encoded], np.int64)
    return gather_rows(ids), gather_rows(tokens)


def observe(
    controller: GroupController, rounds: list[Rollouts]
) -> tuple[dict[str, Any], StepObservation]:
    """The controller observes the step: (its stats, the step's observation, which the step's
    metrics read too). The observation holds every process's rollouts of every round: lengths,
    group sizes, raw rewards and prompt ids, and the finished flags when tail batching cut the
    step (a cut rollout's length is a lower bound)."""
    every = Rollouts.concat(rounds)
    obs = StepObservation(
        lengths_b=gather_rows(every.lengths),
        sizes_p=gather_rows(every.group_sizes),
        finished_b=None if every.cut is None else ~gather_rows(every.cut),
        rewards_b=gather_rows(every.rewards),
        prompt_ids_p=gather_rows(np.array([p.id for p in every.prompts], np.int64)),
    )
    return controller.observe(obs), obs
