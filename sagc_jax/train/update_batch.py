"""The update's input from a step's rollouts: global arrays over the mesh, either packed into
the row-count rung every process agrees on (``train.packing``; see ``programs.packing``) or
one padded row per rollout (``programs.packing.PADDED_KEYS``); in both, only the rollouts whose
gradient can be non-zero (``UpdateBatcher.trained``), each with its index in the step's rollouts
(every process's, in process order), by which LoRA dropout draws its masks."""

from __future__ import annotations

import jax
import numpy as np

from sagc_jax.parallel import ShardingPlan, gather_rows
from sagc_jax.planning.resolve import RunShape
from sagc_jax.programs.packing import (
    pack_update_batch,
    packed_rows_needed,
    padded_update_batch,
    rung_for,
)
from sagc_jax.rl import completion_mask
from sagc_jax.train.rollout import Rollouts


class UpdateBatcher:
    """Builds the update batch of each step of a run of shape ``shape`` on ``plan``'s mesh;
    packed rows hold ``shape.pack_len`` tokens (a ``train.pack_len`` shorter than a bucket
    plus ``sampling.max_new_tokens`` raises ConfigError here)."""

    def __init__(self, shape: RunShape, plan: ShardingPlan):
        self.cfg = shape.cfg
        self.plan = plan
        self.aggregation = shape.training.update.aggregation  # the loss's
        self.pack_len = shape.pack_len
        self.row_multiple = shape.row_multiple
        self.drops = shape.training.signal_only

    def trained(self, adv: np.ndarray) -> np.ndarray:
        """bool [N]: the rollouts the update trains, of advantages ``adv`` float32 [N]: those
        of non-zero advantage (``train.drop_no_signal``, no KL term), else every one."""
        if not self.drops:
            return np.ones(len(adv), bool)
        return np.asarray(adv) != 0

    def __call__(
        self, batch: Rollouts, adv: np.ndarray, trained: np.ndarray
    ) -> dict[str, jax.Array]:
        """The update's input of this process's rollouts ``batch``, their advantages ``adv``
        float32 [N] and which are trained (``trained`` bool [N], from :meth:`trained`); a
        collective (every process calls it): the row count is the rung every process needs,
        and the rollouts' ids follow the earlier processes' rollouts."""
        mask = completion_mask(
            batch.lengths,
            batch.completion.shape[1],
            batch.truncated if self.cfg.loss.mask_truncated else None,
        )
        arrays = (batch.prompt_ids, batch.prompt_lens, batch.completion, batch.logprobs, adv, mask)
        settings = dict(
            aggregation=self.aggregation, max_new_tokens=self.cfg.sampling.max_new_tokens
        )
        n = len(batch.lengths)
        if self.cfg.train.packing:
            rows = packed_rows_needed(
                batch.prompt_lens,
                mask,
                pack_len=self.pack_len,
                multiple=self.row_multiple,
                max_rows=n,
                trained_b=trained,
            )
        else:  # one row per trained rollout, rounded up to a rung (all: the step's rollouts)
            rows = rung_for(int(trained.sum()), self.row_multiple, n)
        rows_and_rollouts = gather_rows(np.array([[rows, n]]))  # [processes, 2]
        rows = int(rows_and_rollouts[:, 0].max())  # one rung for every process
        first = int(rows_and_rollouts[: jax.process_index(), 1].sum())
        settings.update(rows=rows, trained_b=trained, rollout_b=first + np.arange(n))
        if self.cfg.train.packing:
            local = pack_update_batch(*arrays, **settings, pack_len=self.pack_len)
        else:
            local = padded_update_batch(*arrays, **settings)
        return self.plan.global_rows(local)
