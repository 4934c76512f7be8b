"""Rollout-length workloads: where the simulator's per-step response lengths come from.

A workload answers ``lengths(step, group_size) -> int64 [num_prompts, group_size]``. Workloads
use common random numbers: the first G completions of a prompt are the same whatever G is asked
for, so controllers compared on one workload see the same prompts and the same rollouts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from sagc_jax.config import SimConfig


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(key))))


class SyntheticWorkload:
    """The parameterised reasoning-RL length model described in :class:`SimConfig`."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.num_steps = cfg.steps
        self.prompt_tokens = cfg.prompt_tokens

    def median_at(self, step: int) -> float:
        """Drifting length scale ``m_t``: geometric from median_start to median_end."""
        frac = step / max(1, self.cfg.steps - 1)
        return self.cfg.median_start * (self.cfg.median_end / self.cfg.median_start) ** frac

    def group_sigma_at(self, step: int) -> float:
        """Within-group log-spread: linear from group_sigma to group_sigma_end (if set)."""
        end = self.cfg.group_sigma_end
        if end is None:
            return self.cfg.group_sigma
        frac = step / max(1, self.cfg.steps - 1)
        return self.cfg.group_sigma + (end - self.cfg.group_sigma) * frac

    def lengths(self, step: int, group_size: int) -> np.ndarray:
        cfg = self.cfg
        sigma = self.group_sigma_at(step)
        num_prompts = cfg.prompts_per_step
        prompt_rng = _rng(cfg.seed, step, 0)
        z_p = prompt_rng.standard_normal(num_prompts)
        a = cfg.success_mean * cfg.success_concentration
        b = (1.0 - cfg.success_mean) * cfg.success_concentration
        if cfg.success_mean in (0.0, 1.0):
            success_p = np.full(num_prompts, cfg.success_mean)
        else:
            success_p = prompt_rng.beta(a, b, size=num_prompts)
        log_scale_p = np.log(self.median_at(step)) + cfg.prompt_sigma * z_p
        lengths_gp = np.empty((group_size, num_prompts), dtype=np.int64)
        for i in range(group_size):  # one stream per completion index: common random numbers
            rng = _rng(cfg.seed, step, 1 + i)
            if np.isinf(cfg.tail_df):
                noise = rng.standard_normal(num_prompts)
            else:
                noise = rng.standard_t(cfg.tail_df, size=num_prompts)
            failed = rng.random(num_prompts) >= success_p
            runaway = rng.random(num_prompts) < cfg.runaway_prob
            raw = np.exp(log_scale_p + sigma * noise)
            raw = raw * np.where(failed, cfg.failure_length_ratio, 1.0)
            length = np.minimum(np.ceil(raw), cfg.max_new_tokens)
            lengths_gp[i] = np.where(runaway, cfg.max_new_tokens, np.maximum(length, 1))
        return lengths_gp.T.copy()


class ReplayWorkload:
    """Lengths logged by a real run, one JSON object per line (the trainer's metrics JSONL).

    A step is a line with ``"lengths"``: a list of groups, each a list of integer response lengths
    (all groups of a line the same size); lines without it (evaluations) are skipped. Optional:
    ``"prompt_tokens"`` (int, prompt length per sequence); other keys are ignored. A controller
    asking for G up to the logged group size gets the first G completions of every group; a
    larger G is filled by resampling the group's logged lengths with replacement (seeded), and
    the step is counted in ``bootstrapped_steps``.
    """

    def __init__(self, path: str | Path, seed: int = 0, default_prompt_tokens: int = 0) -> None:
        self.path = Path(path)
        self.seed = seed
        self.records: list[np.ndarray] = []
        self.prompt_tokens_per_step: list[int] = []
        try:
            text = self.path.read_text()
        except OSError as err:
            raise ValueError(f"{self.path}: cannot read the replay log ({err.strerror})") from None
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{self.path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object per line")
            groups = record.get("lengths")
            if groups is None:  # e.g. an evaluation-only line of the trainer's metrics
                continue
            try:
                arr = np.asarray(groups)
            except ValueError:
                arr = np.asarray([], dtype=object)
            ok = arr.ndim == 2 and arr.size > 0 and np.issubdtype(arr.dtype, np.integer)
            if not ok or np.any(arr < 0):
                raise ValueError(
                    f"{where}: 'lengths' must be a non-empty list of equal-size lists of "
                    f"non-negative integers"
                )
            prompt_tokens = record.get("prompt_tokens", default_prompt_tokens)
            if not isinstance(prompt_tokens, int) or prompt_tokens < 0:
                raise ValueError(f"{where}: 'prompt_tokens' must be an integer >= 0")
            self.records.append(arr.astype(np.int64))
            self.prompt_tokens_per_step.append(prompt_tokens)
        if not self.records:
            raise ValueError(f"{self.path}: the replay log has no line with 'lengths'")
        self.num_steps = len(self.records)

    def lengths(self, step: int, group_size: int) -> np.ndarray:
        logged = self.records[step]
        if group_size <= logged.shape[1]:
            return logged[:, :group_size].copy()
        extra = group_size - logged.shape[1]
        rng = _rng(self.seed, step)
        picks = rng.integers(0, logged.shape[1], size=(logged.shape[0], extra))
        return np.concatenate([logged, np.take_along_axis(logged, picks, axis=1)], axis=1)

    def is_bootstrapped(self, step: int, group_size: int) -> bool:
        return group_size > self.records[step].shape[1]
