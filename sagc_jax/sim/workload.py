"""Rollout-length workloads: where the simulator's per-step response lengths come from.

A workload answers ``lengths(step, group_size) -> int64 [num_prompts, group_size]`` and
``prompts(step) -> (prompt_ids, prompt_tokens)``, int64 ``[num_prompts]`` each. Workloads
use common random numbers: the first G completions of a prompt are the same whatever G is asked
for, so controllers compared on one workload see the same prompts and the same rollouts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sagc_jax.config.sim import SimConfig


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(key))))


class SyntheticWorkload:
    """The parameterised reasoning-RL length model described in :class:`SimConfig`.

    ``sim.prompt_pool: 0``: every step draws fresh prompts. ``sim.prompt_pool: N``: a fixed pool
    of N prompts revisited every epoch; every prompt keeps its length scale, success
    probability, straggle tendency and prompt length for the whole run (lengths still drift over
    training). Each epoch visits the pool in a new seeded order; step t takes positions
    ``t*P .. t*P+P-1`` of the epochs laid end to end (a step may straddle two epochs).
    """

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.num_steps = cfg.steps
        self.prompt_tokens = cfg.prompt_tokens
        self.pool = _PromptPool(cfg, self._success) if cfg.prompt_pool else None

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

    def prompts(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """``(prompt_ids, prompt_tokens)`` of the step, int64 ``[P]`` each: pool indices and
        their prompt lengths, or (no pool) fresh ids never revisited, all ``prompt_tokens``."""
        num = self.cfg.prompts_per_step
        if self.pool is not None:
            ids = self.pool.ids_at(step, num)
            return ids, self.pool.prompt_tokens_p[ids]
        ids = step * num + np.arange(num, dtype=np.int64)
        return ids, np.full(num, self.prompt_tokens, dtype=np.int64)

    def lengths(self, step: int, group_size: int) -> np.ndarray:
        return self.lengths_at(step, step, group_size)

    def lengths_at(self, prompt_step: int, step: int, group_size: int) -> np.ndarray:
        """``lengths(prompt_step, G)``'s prompts and completions at the drift of ``step`` (a
        tail-batched run draws its prompts ahead of its steps: long rounds take none)."""
        return self._draw(prompt_step, step, None, group_size, (self.cfg.seed, prompt_step))[0]

    def rewards(self, step: int, group_size: int) -> np.ndarray:
        """float64 ``[P, G]``: 1 where completion i of prompt p of ``lengths(step, G)``
        succeeded, else 0 (the same draws: a failed completion is the longer one)."""
        return self.rewards_at(step, step, group_size)

    def rewards_at(self, prompt_step: int, step: int, group_size: int) -> np.ndarray:
        """The rewards of ``lengths_at(prompt_step, step, G)``."""
        key = (self.cfg.seed, prompt_step)
        return self._draw(prompt_step, step, None, group_size, key)[1]

    def success_mean_at(self, step: int) -> float:
        """Mean success probability of a fresh prompt: linear from success_mean to
        success_mean_end (if set: the policy learns)."""
        end = self.cfg.success_mean_end
        if end is None:
            return self.cfg.success_mean
        frac = step / max(1, self.cfg.steps - 1)
        return self.cfg.success_mean + (end - self.cfg.success_mean) * frac

    def redraw(self, step: int, origin_step: int, rows, group_size: int) -> np.ndarray:
        """int64 ``[len(rows), group_size]``: prompts ``rows`` of step ``origin_step``'s draw
        rolled out again at ``step`` (a deferred prompt's long round): the prompt keeps its
        length scale, success probability and straggle tendency, the drift is the one of
        ``step`` and the completions are new draws."""
        key = (self.cfg.seed, _REDRAW_KEY, step, origin_step)
        return self._draw(origin_step, step, np.asarray(rows, np.int64), group_size, key)[0]

    def _draw(
        self, prompt_step: int, step: int, rows, group_size: int, key
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(lengths int64, rewards float64)`` ``[P, G]`` of the prompts of ``prompt_step``
        (``rows`` of them, None: all) at the drift of ``step``, completion i drawn from the
        stream ``key + (1 + i,)``."""
        cfg = self.cfg
        sigma, runaway = self.group_sigma_at(step), cfg.runaway_prob
        if self.pool is None:
            prompt_rng = _rng(cfg.seed, prompt_step, 0)
            z_p = prompt_rng.standard_normal(cfg.prompts_per_step)
            success_p = self._success(prompt_rng, cfg.prompts_per_step, prompt_step)
        else:
            ids = self.pool.ids_at(prompt_step, cfg.prompts_per_step)
            z_p, success_p = self.pool.z_p[ids], self.pool.success_p[ids]
            sigma, runaway = sigma * self.pool.spread_p[ids], self.pool.runaway_p[ids]
        if rows is not None:
            z_p, success_p = z_p[rows], success_p[rows]
            sigma, runaway = np.asarray(sigma), np.asarray(runaway)
            sigma = sigma[rows] if sigma.ndim else sigma
            runaway = runaway[rows] if runaway.ndim else runaway
        log_scale_p = np.log(self.median_at(step)) + cfg.prompt_sigma * z_p
        lengths_gp = np.empty((group_size, z_p.size), dtype=np.int64)
        rewards_gp = np.empty((group_size, z_p.size))
        for i in range(group_size):  # one stream per completion index: common random numbers
            rng = _rng(*key, 1 + i)
            if np.isinf(cfg.tail_df):
                noise = rng.standard_normal(z_p.size)
            else:
                noise = rng.standard_t(cfg.tail_df, size=z_p.size)
            failed = rng.random(z_p.size) >= success_p
            runaway_p = rng.random(z_p.size) < runaway
            raw = np.exp(log_scale_p + sigma * noise)
            raw = raw * np.where(failed, cfg.failure_length_ratio, 1.0)
            length = np.minimum(np.ceil(raw), cfg.max_new_tokens)
            lengths_gp[i] = np.where(runaway_p, cfg.max_new_tokens, np.maximum(length, 1))
            rewards_gp[i] = ~failed & ~runaway_p  # a runaway loop is cut off: no answer
        return lengths_gp.T.copy(), rewards_gp.T.copy()

    def _success(self, rng: np.random.Generator, num: int, step: int = 0) -> np.ndarray:
        """Per-prompt success probability, Beta with mean ``success_mean_at(step)``."""
        cfg = self.cfg
        mean = self.success_mean_at(step)
        if mean in (0.0, 1.0):
            return np.full(num, mean)
        a = mean * cfg.success_concentration
        b = (1.0 - mean) * cfg.success_concentration
        return rng.beta(a, b, size=num)


_POOL_KEY = 2**32 - 1  # a "step" no run reaches: the pool's streams never meet a step's
_REDRAW_KEY = 2**32 - 2  # nor do the streams of long rounds


class _PromptPool:
    """The persistent per-prompt parameters of ``sim.prompt_pool`` (see :class:`SimConfig`)."""

    def __init__(self, cfg: SimConfig, success) -> None:
        n = cfg.prompt_pool
        self.seed, self.size = cfg.seed, n
        rng = _rng(cfg.seed, _POOL_KEY, 1)
        self.z_p = rng.standard_normal(n)
        self.success_p = success(rng, n)
        v_p = rng.standard_normal(n)  # straggle tendency
        rho = cfg.prompt_length_corr
        w_p = rho * v_p + np.sqrt(1.0 - rho * rho) * rng.standard_normal(n)
        h = cfg.prompt_heterogeneity
        self.tendency_p = v_p
        self.spread_p = np.exp(0.5 * h * v_p)
        self.runaway_p = np.minimum(1.0, cfg.runaway_prob * np.exp(h * v_p - 0.5 * h * h))
        tokens = np.rint(cfg.prompt_tokens * np.exp(cfg.prompt_length_sigma * w_p))
        self.prompt_tokens_p = np.maximum(1, tokens).astype(np.int64)
        self._orders: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        """The pool's visiting order in ``epoch`` (seeded)."""
        if epoch not in self._orders:
            self._orders[epoch] = _rng(self.seed, _POOL_KEY, 2, epoch).permutation(self.size)
        return self._orders[epoch]

    def ids_at(self, step: int, num: int) -> np.ndarray:
        pos = step * num + np.arange(num)
        epochs, within = pos // self.size, pos % self.size
        return np.array(
            [self.order(e)[k] for e, k in zip(epochs.tolist(), within.tolist(), strict=True)],
            dtype=np.int64,
        )


class ReplayWorkload:
    """Lengths logged by a real run, one JSON object per line (the trainer's metrics JSONL).

    A step is a line with ``"lengths"``: a list of groups, each a non-empty list of integer
    response lengths (groups of one size, or of mixed sizes as the hybrid ``per_prompt`` mode
    logs them); lines without it (evaluations) are skipped. Optional: ``"prompt_tokens"`` (int,
    prompt length per sequence), ``"rewards"`` (the rollouts' raw rewards, shaped as
    ``"lengths"``: a reward-aware controller learns from them when every step has them) and
    ``"prompt_ids"`` (one per group: a prompt-aware controller sees the prompts again as they
    came back); other keys are ignored. A controller asking for G gets the first G completions
    of every group; a group with fewer is filled by resampling its own logged completions with
    replacement (seeded; a length and its reward together), and the step is counted in
    ``bootstrapped_steps``.
    """

    def __init__(
        self,
        lines: Sequence[tuple[str, object]],
        source: str,
        seed: int = 0,
        default_prompt_tokens: int = 0,
    ) -> None:
        """``lines``: the log's JSON values, each with where it came from (``file:line``) for
        errors; ``source`` names the whole log. :meth:`from_file` and :meth:`from_steps` build
        them."""
        self.source = source
        self.seed = seed
        self.records: list[np.ndarray] = []  # int64 [P, widest group], padded with -1
        self.rewards_logged: list[np.ndarray | None] = []  # float64, shaped as records
        self.ids_logged: list[np.ndarray | None] = []  # int64 [P]
        self.group_sizes: list[np.ndarray] = []  # int64 [P]
        self.prompt_tokens_per_step: list[int] = []
        for where, record in lines:
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object per line")
            groups = record.get("lengths")
            if groups is None:  # e.g. an evaluation-only line of the trainer's metrics
                continue
            padded = _padded_groups(groups)
            if padded is None:
                raise ValueError(
                    f"{where}: 'lengths' must be a non-empty list of non-empty lists of "
                    f"non-negative integers"
                )
            prompt_tokens = record.get("prompt_tokens", default_prompt_tokens)
            if not isinstance(prompt_tokens, int) or prompt_tokens < 0:
                raise ValueError(f"{where}: 'prompt_tokens' must be an integer >= 0")
            self.rewards_logged.append(_logged_rewards(record.get("rewards"), groups, where))
            ids = record.get("prompt_ids")
            if ids is not None and (
                not isinstance(ids, list)
                or len(ids) != len(groups)
                or not all(isinstance(i, int) for i in ids)
            ):
                raise ValueError(f"{where}: 'prompt_ids' must be one integer per group")
            self.ids_logged.append(None if ids is None else np.asarray(ids, np.int64))
            self.records.append(padded)
            self.group_sizes.append(np.array([len(g) for g in groups], np.int64))
            self.prompt_tokens_per_step.append(prompt_tokens)
        if not self.records:
            raise ValueError(f"{self.source}: the replay log has no line with 'lengths'")
        self.num_steps = len(self.records)
        self.has_rewards = all(r is not None for r in self.rewards_logged)
        self.has_prompt_ids = all(i is not None for i in self.ids_logged)

    @classmethod
    def from_file(
        cls, path: str | Path, seed: int = 0, default_prompt_tokens: int = 0
    ) -> ReplayWorkload:
        """The workload of a metrics JSONL file."""
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ValueError(f"{path}: cannot read the replay log ({err.strerror})") from None
        lines = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                lines.append((f"{path}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
        return cls(lines, str(path), seed, default_prompt_tokens)

    @classmethod
    def from_steps(
        cls, steps: list[dict], source: str, seed: int = 0, default_prompt_tokens: int = 0
    ) -> ReplayWorkload:
        """The workload of metrics lines already read (a study record's ``steps``); errors name
        the i-th as ``source[i]``."""
        return cls(
            [(f"{source}[{i}]", r) for i, r in enumerate(steps)],
            source,
            seed,
            default_prompt_tokens,
        )

    def prompts(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """``(prompt_ids, prompt_tokens)``: the logged ids, or (a log without them) every group a
        new prompt."""
        num = self.records[step].shape[0]
        if self.has_prompt_ids:
            ids = self.ids_logged[step].copy()
        else:
            start = sum(r.shape[0] for r in self.records[:step])
            ids = start + np.arange(num, dtype=np.int64)
        return ids, np.full(num, self.prompt_tokens_per_step[step], dtype=np.int64)

    def _columns(self, step: int, group_size: int) -> np.ndarray:
        """int64 [P, group_size]: which logged completion of each group fills each column."""
        sizes = self.group_sizes[step]
        cols = np.arange(group_size)[None, :]
        if group_size <= sizes.min():
            return np.broadcast_to(cols, (len(sizes), group_size))
        # column c of group p: its own completion c while c < n_p, else resampled pick c - n_p
        rng = _rng(self.seed, step)
        picks = rng.integers(0, sizes[:, None], size=(len(sizes), group_size - sizes.min()))
        resampled = np.take_along_axis(picks, np.maximum(cols - sizes[:, None], 0), axis=1)
        return np.where(cols < sizes[:, None], cols, resampled)

    def lengths(self, step: int, group_size: int) -> np.ndarray:
        return np.take_along_axis(self.records[step], self._columns(step, group_size), axis=1)

    def rewards(self, step: int, group_size: int) -> np.ndarray | None:
        """float64 [P, group_size], the rewards of the completions :meth:`lengths` gives; None
        when a step of the log has no rewards."""
        if not self.has_rewards:
            return None
        logged = self.rewards_logged[step]
        return np.take_along_axis(logged, self._columns(step, group_size), axis=1)

    def is_bootstrapped(self, step: int, group_size: int) -> bool:
        return group_size > self.group_sizes[step].min()


def _logged_rewards(rewards, groups: list, where: str) -> np.ndarray | None:
    """float64 [P, widest group] of a line's ``rewards`` (None if it has none), shaped as its
    ``lengths``; padded with nan."""
    if rewards is None:
        return None
    shaped = isinstance(rewards, list) and len(rewards) == len(groups)
    if shaped:
        shaped = all(
            isinstance(r, list) and len(r) == len(g) for r, g in zip(rewards, groups, strict=True)
        )
    values = [v for r in rewards for v in r] if shaped else []
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if not shaped or not numbers:
        raise ValueError(f"{where}: 'rewards' must be numbers shaped as 'lengths'")
    out = np.full((len(groups), max(len(g) for g in groups)), np.nan)
    for p, r in enumerate(rewards):
        out[p, : len(r)] = r
    return out


def _padded_groups(groups) -> np.ndarray | None:
    """int64 [P, widest group] of a log line's groups, padded with -1; None unless ``groups`` is a
    non-empty list of non-empty lists of non-negative integers."""
    if not isinstance(groups, list) or not groups:
        return None
    if not all(isinstance(g, list) and g for g in groups):
        return None
    values = [v for g in groups for v in g]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        return None
    out = np.full((len(groups), max(len(g) for g in groups)), -1, np.int64)
    for p, g in enumerate(groups):
        out[p, : len(g)] = g
    return out
