"""Modeled seconds of a training step from its rollout lengths, in both rollout regimes.

``StepTimer`` times a step's rollouts and update on ``sim.devices`` chips of ``sim.hardware``
with a model's costs (``sim.roofline``): the rollouts ``synchronous`` (every row stays in the
batch until the longest ends: today's sampler) and ``continuous`` (``sim.slots`` rows per chip
decode at a time and a finished row's slot takes the next rollout), the update on the tokens it
processes (packed: the real tokens; padded: rows x (longest prompt + max_new_tokens)).

``sim.hardware: custom`` keeps the illustrative constants of ``SimConfig``: a decode step costs
``decode_step_seconds + decode_seq_seconds`` per row in it, prefill ``prefill_token_seconds`` per
prompt token, the update ``step_overhead_seconds + update_token_seconds`` per real token.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from sagc_jax.config import SimConfig
from sagc_jax.sim import roofline

REGIMES = ("synchronous", "continuous")


class StepTime(NamedTuple):
    """Seconds of one step: its rollouts in each regime and its update."""

    synchronous: float
    continuous: float
    update: float


@dataclasses.dataclass(frozen=True)
class StepTimer:
    """Times steps on ``sim.devices`` x ``sim.hardware`` with ``costs`` (the model named
    ``model_name``; None with ``hardware: custom``). ``padded_width``: tokens of a padded update
    row (longest prompt bucket + max_new_tokens); None for packed updates. ``epochs``: update
    passes over each batch."""

    sim: SimConfig
    costs: roofline.ModelCosts | None = None
    model_name: str = ""
    padded_width: int | None = None
    epochs: int = 1

    def __post_init__(self):
        if self.sim.hardware != "custom" and self.costs is None:
            raise ValueError(f"StepTimer: sim.hardware = {self.sim.hardware!r} needs model costs")

    @property
    def label(self) -> str:
        """What the modeled seconds are of, e.g. ``qwen2.5-3b on 1 x h100``."""
        if self.sim.hardware == "custom":
            return "custom constants"
        return f"{self.model_name} on {self.sim.devices} x {self.sim.hardware}"

    def __call__(self, lengths, prompt_tokens) -> StepTime:
        """Seconds of a step whose completions have ``lengths`` (``[B]`` or ``[P, G]``, groups of
        any sizes flattened in order) and prompts ``prompt_tokens`` (an int or ``[B]``)."""
        lengths = np.asarray(lengths, np.int64).ravel()
        prompts = np.broadcast_to(np.asarray(prompt_tokens, np.int64), lengths.shape)
        if self.sim.hardware == "custom":
            return self._custom(lengths, prompts)
        hw, sim = roofline.HARDWARE[self.sim.hardware], self.sim
        eff = roofline.Efficiency.of(sim)
        rollout = {
            regime: roofline.rollout_seconds(
                self.costs, hw, lengths, prompts, sim.devices, regime, sim.slots * sim.devices, eff
            )["seconds"]
            for regime in REGIMES
        }
        if self.padded_width is None:
            width = prompts + lengths
        else:
            longest = int((prompts + lengths).max())  # a longer row would not fit
            width = np.full(lengths.size, max(self.padded_width, longest))
        update = roofline.update_seconds(
            self.costs,
            hw,
            int(width.sum()),
            float((width * (width + 1) / 2).sum()),
            sim.devices,
            self.epochs,
            eff,
        )
        return StepTime(rollout["synchronous"], rollout["continuous"], update)

    def _custom(self, lengths, prompts) -> StepTime:
        sim = self.sim
        prefill = sim.prefill_token_seconds * float(prompts.sum())
        rows = lengths.size
        synchronous = prefill + int(lengths.max()) * (
            sim.decode_step_seconds + sim.decode_seq_seconds * rows
        )
        # continuous: the decode steps of the slot schedule, each costing its active rows
        slots = min(sim.slots * sim.devices, rows)
        starts = roofline.slot_schedule(lengths, slots)
        steps = int((starts + lengths).max())
        continuous = (
            prefill + steps * sim.decode_step_seconds + sim.decode_seq_seconds * lengths.sum()
        )
        update = sim.step_overhead_seconds + sim.update_token_seconds * float(
            prompts.sum() + lengths.sum()
        )
        return StepTime(synchronous, float(continuous), update)
