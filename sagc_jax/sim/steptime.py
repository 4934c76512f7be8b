"""Modeled seconds of a training step from its rollout lengths, in three rollout regimes.

``StepTimer`` times a step's rollouts and update on ``sim.devices`` chips of ``sim.hardware``
with a model's costs (``sim.roofline``): the rollouts ``compacting`` (the project's sampler:
one prefill per prompt, ``sampling.slots`` slots refilled, the running rows gathered into the
smallest of ``sampling.row_buckets`` row counts, cache phases of ``sampling.decode_chunk``;
``Engine`` holds those settings), ``synchronous`` (every row stays in the batch until the
longest ends: the sampler before row compaction) and ``continuous`` (``sim.slots`` rows per chip
decode at a time and a finished row's slot takes the next rollout), the update on the tokens it
processes (packed: the real tokens; padded: rows x (longest prompt + max_new_tokens)).

``sim.hardware: custom`` keeps the illustrative constants of ``SimConfig``: a decode step costs
``decode_step_seconds + decode_seq_seconds`` per row in it, prefill ``prefill_token_seconds`` per
prompt token, the update ``step_overhead_seconds + update_token_seconds`` per real token.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from sagc_jax import decode_schedule
from sagc_jax.config import SamplingConfig
from sagc_jax.config.sim import SimConfig
from sagc_jax.sim import roofline

REGIMES = roofline.REGIMES  # compacting (the sampler), synchronous, continuous


class StepTime(NamedTuple):
    """Seconds of one step: its rollouts in each regime (``REGIMES``) and its update."""

    compacting: float
    synchronous: float
    continuous: float
    update: float


@dataclasses.dataclass(frozen=True)
class Engine:
    """The sampler's settings the ``compacting`` regime replays (``decode_schedule``).

    max_new_tokens: the sampler's length cap (0: each step's longest completion; a step with a
    longer completion raises it to that length); decode_chunk: ``sampling.decode_chunk`` (an int
    or 'auto', resolved against the cap); row_buckets: ``sampling.row_buckets``; slots:
    ``sampling.slots``, rows decoded at once over all chips (0: all of the step's rollouts;
    'auto', which the sampler sizes from the device memory, is modeled as 0).
    """

    max_new_tokens: int = 0
    decode_chunk: int | str = SamplingConfig.decode_chunk
    row_buckets: int = SamplingConfig.row_buckets
    slots: int | str = SamplingConfig.slots

    @classmethod
    def of(cls, sampling: SamplingConfig, max_new_tokens: int) -> Engine:
        """The settings of a ``SamplingConfig``, with the cap of the lengths timed (the run's
        ``sampling.max_new_tokens``, or ``sim.max_new_tokens`` for the synthetic workload)."""
        return cls(max_new_tokens, sampling.decode_chunk, sampling.row_buckets, sampling.slots)

    def settings(self, lengths) -> dict:
        """``rollout_seconds``'s compacting keywords for a step of ``lengths``: slots, cap,
        resolved chunk and row buckets."""
        cap = max(self.max_new_tokens, int(np.max(lengths, initial=1)))
        slots = 0 if self.slots == "auto" else int(self.slots)
        return {
            "slots": slots,
            "max_new_tokens": cap,
            "chunk": decode_schedule.resolve_chunk(cap, self.decode_chunk),
            "row_buckets": self.row_buckets,
        }


@dataclasses.dataclass(frozen=True)
class StepTimer:
    """Times steps on ``sim.devices`` x ``sim.hardware`` with ``costs`` (the model named
    ``model_name``; None with ``hardware: custom``). ``padded_width``: tokens of a padded update
    row (longest prompt bucket + max_new_tokens); None for packed updates. ``epochs``: update
    passes over each batch. ``reference``: the update also runs the reference policy (a KL term).
    ``signal_only``: the update trains only the rollouts of groups with learning signal
    (``train.drop_no_signal`` without a KL term), so a group whose rewards are all equal costs
    its rollouts only. ``engine``: the sampler's settings (``compacting``)."""

    sim: SimConfig
    costs: roofline.ModelCosts | None = None
    model_name: str = ""
    padded_width: int | None = None
    epochs: int = 1
    reference: bool = False
    signal_only: bool = False
    engine: Engine = Engine()

    def __post_init__(self):
        if self.sim.hardware != "custom" and self.costs is None:
            raise ValueError(f"StepTimer: sim.hardware = {self.sim.hardware!r} needs model costs")

    @property
    def label(self) -> str:
        """What the modeled seconds are of, e.g. ``qwen2.5-3b on 1 x h100``."""
        if self.sim.hardware == "custom":
            return "custom constants"
        return f"{self.model_name} on {self.sim.devices} x {self.sim.hardware}"

    def __call__(
        self, lengths, prompt_tokens, group_sizes=None, keep_groups=None, signal_p=None
    ) -> StepTime:
        """Seconds of a step whose completions have ``lengths`` (``[B]`` or ``[P, G]``, groups of
        any sizes flattened in order) and prompts ``prompt_tokens`` (an int or ``[B]``).
        ``group_sizes``: int [P], rollouts per prompt in row order (the compacting regime
        prefills each prompt once); None: a ``[P, G]`` shape gives them, a flat ``[B]`` means
        one prompt per row. ``keep_groups``: a tail-batched step, cut once that many groups are
        whole (``roofline.rollout_seconds``); its update trains only the groups kept
        (``roofline.cut_step``). ``signal_p``: bool [P], the groups whose rewards are not all
        equal (None: every group); with ``signal_only`` the update trains only those."""
        first_p = roofline.prompt_rows(np.shape(lengths), group_sizes)
        lengths = np.asarray(lengths, np.int64).ravel()
        prompts = np.broadcast_to(np.asarray(prompt_tokens, np.int64), lengths.shape)
        sizes_p = np.diff(np.append(first_p, lengths.size))
        groups_r = np.repeat(np.arange(sizes_p.size), sizes_p)
        trained = np.ones(lengths.size, bool)
        if keep_groups is not None:
            slots = self.engine.settings(lengths)["slots"]
            trained = roofline.cut_step(lengths, groups_r, keep_groups, slots)[3][groups_r]
        if self.signal_only and signal_p is not None:
            trained = trained & np.asarray(signal_p, bool)[groups_r]
        update = self.update_of(lengths[trained], prompts[trained])
        if self.sim.hardware == "custom":
            return self._custom(lengths, prompts, sizes_p, groups_r, keep_groups, update)
        hw, sim = roofline.HARDWARE[self.sim.hardware], self.sim
        eff = roofline.Efficiency.of(sim)
        settings = {  # what each regime needs besides the lengths
            "compacting": {"group_sizes": sizes_p, **self.engine.settings(lengths)},
            "synchronous": {},
            "continuous": {"slots": sim.slots * sim.devices},
        }
        cut = {} if keep_groups is None else {"keep_groups": keep_groups, "groups_r": groups_r}
        rollout = {
            regime: roofline.rollout_seconds(
                self.costs,
                hw,
                lengths,
                prompts,
                sim.devices,
                regime,
                eff=eff,
                **settings[regime],
                **cut,
            )["seconds"]
            for regime in REGIMES
        }
        return StepTime(**rollout, update=update)

    def step_seconds(self, prompt_tokens: int, regime: str = "compacting"):
        """A function of a step's lengths ``[P, G]`` (and optionally ``signal_p``, bool [P]: the
        groups whose rewards are not all equal) giving its modeled seconds, rollouts in
        ``regime`` plus the update (over the groups with signal with ``signal_only``): the cost
        the value-aware controller weighs."""

        def seconds(lengths_pg, signal_p=None) -> float:
            step = self(lengths_pg, prompt_tokens, signal_p=signal_p)
            return float(getattr(step, regime) + step.update)

        return seconds

    def update_of(self, lengths, prompt_tokens) -> float:
        """Seconds of the update on completions of ``lengths`` [B] (prompts ``prompt_tokens``,
        an int or [B]); 0 for no rollout (the update is skipped: ``train.skip_no_signal``)."""
        lengths = np.asarray(lengths, np.int64).ravel()
        prompts = np.broadcast_to(np.asarray(prompt_tokens, np.int64), lengths.shape)
        if lengths.size == 0:
            return 0.0
        sim = self.sim
        if sim.hardware == "custom":
            return sim.step_overhead_seconds + sim.update_token_seconds * float(
                prompts.sum() + lengths.sum()
            )
        hw, eff = roofline.HARDWARE[sim.hardware], roofline.Efficiency.of(sim)
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
            self.reference,
        )
        return update

    def _custom(self, lengths, prompts, sizes_p, groups_r, keep_groups, update) -> StepTime:
        sim = self.sim
        full = lengths
        if keep_groups is not None:  # synchronous and continuous: the tokens reached
            lengths = roofline.reached_lengths(lengths, groups_r, keep_groups)
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
        # compacting: one prefill per prompt, the sampler's iterations, each costing its rows
        settings = self.engine.settings(full)
        width = min(settings.pop("slots") or rows, rows)
        stop_at = None
        if keep_groups is not None:
            stop_at, _ = decode_schedule.group_stop(full, groups_r, keep_groups, slots=width)
        plan = decode_schedule.simulate(
            np.maximum(full, 1),
            slots=width,
            shards=math.gcd(width, sim.devices),
            stop_at=stop_at,
            **settings,
        )
        first_p = np.concatenate([[0], np.cumsum(sizes_p)[:-1]])
        compacting = (
            sim.prefill_token_seconds * float(prompts[first_p].sum())
            + plan.decode_steps * sim.decode_step_seconds
            + sim.decode_seq_seconds * plan.rows_decoded
        )
        return StepTime(float(compacting), synchronous, float(continuous), update)
