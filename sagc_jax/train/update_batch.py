"""The update's input from a step's rollouts: global arrays over the mesh, either packed into
the row-count rung every process agrees on (``train.packing``; see ``programs.packing``) or
one padded row per rollout (``programs.update.BATCH_KEYS``)."""

from __future__ import annotations

import jax
import numpy as np

from sagc_jax.parallel import ShardingPlan, gather_rows
from sagc_jax.programs.packing import pack_update_batch, packed_rows_needed
from sagc_jax.programs.shapes import RunShape
from sagc_jax.rl import completion_mask
from sagc_jax.train.rollout import Rollouts


class UpdateBatcher:
    """Builds the update batch of each step of a run of shape ``shape`` on ``plan``'s mesh;
    packed rows hold ``shape.pack_len`` tokens (a ``train.pack_len`` shorter than a bucket
    plus ``sampling.max_new_tokens`` raises ConfigError here)."""

    def __init__(self, shape: RunShape, plan: ShardingPlan, aggregation: str):
        self.cfg = shape.cfg
        self.plan = plan
        self.aggregation = aggregation  # the loss's (``UpdateSettings.aggregation``)
        self.pack_len = shape.pack_len
        self.row_multiple = shape.row_multiple

    def __call__(self, batch: Rollouts, adv: np.ndarray) -> dict[str, jax.Array]:
        """The update's input of this process's rollouts ``batch`` and their advantages
        ``adv`` float32 [N] (a collective when packing: every process calls it)."""
        mask = completion_mask(
            batch.lengths,
            batch.completion.shape[1],
            batch.truncated if self.cfg.loss.mask_truncated else None,
        )
        if not self.cfg.train.packing:
            padded = {
                "prompt_ids": batch.prompt_ids,
                "prompt_lens": batch.prompt_lens,
                "completion": batch.completion,
                "old_logp": batch.logprobs,
                "mask": mask,
                "adv": adv,
            }
            return self.plan.global_rows(padded)
        rows = packed_rows_needed(
            batch.prompt_lens,
            mask,
            pack_len=self.pack_len,
            multiple=self.row_multiple,
            max_rows=len(batch.lengths),
        )
        rows = int(gather_rows(np.array([rows])).max())  # one rung for every process
        packed = pack_update_batch(
            batch.prompt_ids,
            batch.prompt_lens,
            batch.completion,
            batch.logprobs,
            adv,
            mask,
            aggregation=self.aggregation,
            max_new_tokens=self.cfg.sampling.max_new_tokens,
            pack_len=self.pack_len,
            rows=rows,
        )
        return self.plan.global_rows(packed)
