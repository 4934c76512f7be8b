"""Per-prompt records of past groups, in a table of bounded size (numpy only).

RL revisits every prompt once per epoch, so what a prompt's last groups did predicts its next one.
:class:`PromptStats` keeps, per prompt id (an int64 stable across epochs and processes), an
exponentially decayed record of its groups: rollouts that were tails (longer than ``tau`` x the
group median), rollouts seen, log median length, max/median ratio, straggle indicator
(ratio > tau) and pass rate (fraction of rewards >= 1, when rewards are given), plus the features
known before sampling (prompt token length, optional difficulty in [0, 1]).

Decay is per visit, not per step: at each visit every decayed sum ``x`` of the prompt becomes
``decay * x + new``, so the record weighs the last visits (about ``1 / (1 - decay)`` of them)
whatever the epoch length.

Memory: ``capacity`` slots of fixed-size arrays (about 100 bytes per slot with the index). Slots
fill in order; once all are used, a step bringing k new prompts evicts the k least recently seen
ones (smallest ``last_seen`` step, ties to the lower slot), never one of the step's own prompts.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

# Decayed sums kept per slot (float64 [capacity] each); a mean is sum / weight.
_SUMS = (
    "weight",
    "tails",
    "rollouts",
    "log_median",
    "ratio",
    "straggle",
    "pass_sum",
    "pass_weight",
)


class PromptStats:
    """Fixed-capacity table of decayed per-prompt records keyed by int64 prompt id."""

    def __init__(self, capacity: int = 65536, decay: float = 0.5) -> None:
        if capacity < 1 or not 0.0 < decay <= 1.0:
            raise ValueError(f"capacity = {capacity} must be >= 1, decay = {decay} in (0, 1]")
        self.capacity = int(capacity)
        self.decay = float(decay)
        self.size = 0  # slots 0..size-1 are in use
        self.ids = np.zeros(capacity, dtype=np.int64)
        self.last_seen = np.full(capacity, -1, dtype=np.int64)
        self.visits = np.zeros(capacity, dtype=np.int64)
        self.prompt_length = np.full(capacity, -1, dtype=np.int64)
        self.difficulty = np.full(capacity, -1.0)  # -1: unknown (the state holds no nan)
        self.sums = {name: np.zeros(capacity) for name in _SUMS}
        self._index: dict[int, int] = {}  # id -> slot, rebuilt from ``ids`` on load
        self.evictions = 0

    def __len__(self) -> int:
        return self.size

    def lookup(self, ids_p) -> np.ndarray:
        """Slot of every id, -1 for ids not in the table; int64 ``[P]``."""
        ids = np.asarray(ids_p, dtype=np.int64)
        found = map(self._index.get, ids.tolist(), itertools.repeat(-1))
        return np.fromiter(found, dtype=np.int64, count=ids.size)

    def tails_and_rollouts(self, slots_p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Decayed tail and rollout counts of ``slots_p`` (0 for slot -1)."""
        known = slots_p >= 0
        s = np.where(known, slots_p, 0)
        return (
            np.where(known, self.sums["tails"][s], 0.0),
            np.where(known, self.sums["rollouts"][s], 0.0),
        )

    def record(self, ids_p) -> dict[str, np.ndarray]:
        """Decayed means of every prompt's record (nan for unknown prompts); arrays ``[P]``."""
        slots = self.lookup(ids_p)
        known = slots >= 0
        s = np.where(known, slots, 0)
        w = np.where(known, self.sums["weight"][s], np.nan)
        rollouts = np.where(known, self.sums["rollouts"][s], np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            pass_w = np.where(known, self.sums["pass_weight"][s], np.nan)
            return {
                "visits": np.where(known, self.visits[s], 0),
                "last_seen": np.where(known, self.last_seen[s], -1),
                "prompt_length": np.where(known, self.prompt_length[s], -1),
                "difficulty": np.where(
                    known & (self.difficulty[s] >= 0), self.difficulty[s], np.nan
                ),
                "tail_rate": self.sums["tails"][s] / rollouts,
                "median": np.exp(self.sums["log_median"][s] / w),
                "ratio": self.sums["ratio"][s] / w,
                "straggle_rate": self.sums["straggle"][s] / w,
                "pass_rate": np.where(pass_w > 0, self.sums["pass_sum"][s] / pass_w, np.nan),
            }

    def update(
        self,
        step: int,
        ids_p,
        *,
        tails_p,
        rollouts_p,
        median_p,
        ratio_p,
        straggle_p,
        prompt_length_p,
        difficulty_p=None,
        pass_rate_p=None,
        slots_p=None,
    ) -> None:
        """Add one visit per distinct id of the step (a duplicated id pools its groups).

        Arrays ``[P]`` aligned with ``ids_p``: tail and rollout counts, group median length,
        max/median ratio, straggle indicator (0/1), prompt token length, optional difficulty
        (< 0 or nan: unknown) and pass rate (nan: unknown); ``slots_p``: :meth:`lookup` of
        ``ids_p`` if already known (the table has not changed since).
        """
        ids = np.asarray(ids_p, dtype=np.int64)
        uniq, first, inv = np.unique(ids, return_index=True, return_inverse=True)
        n = uniq.size
        if n > self.capacity:
            raise ValueError(
                f"{n} distinct prompts in one step exceed controller.hybrid.capacity = "
                f"{self.capacity}; raise the capacity"
            )
        count = np.bincount(inv, minlength=n).astype(np.float64)

        def pooled(x, mean=True):
            total = np.bincount(inv, weights=np.asarray(x, dtype=np.float64), minlength=n)
            return total / count if mean else total

        new = {
            "tails": pooled(tails_p, mean=False),
            "rollouts": pooled(rollouts_p, mean=False),
            "log_median": pooled(np.log(np.maximum(1.0, median_p))),
            "ratio": pooled(ratio_p),
            "straggle": pooled(straggle_p),
        }
        if pass_rate_p is not None:
            pr = np.asarray(pass_rate_p, dtype=np.float64)
            has = ~np.isnan(pr)
            new["pass_weight"] = pooled(has) > 0
            new["pass_sum"] = np.bincount(inv, weights=np.where(has, pr, 0.0), minlength=n) / (
                np.maximum(1.0, np.bincount(inv, weights=has.astype(np.float64), minlength=n))
            )
        slots = self._slots_for(
            uniq, step, None if slots_p is None else np.asarray(slots_p, dtype=np.int64)[first]
        )
        d = self.decay
        fresh = self.visits[slots] == 0
        for name in _SUMS:
            old = np.where(fresh, 0.0, self.sums[name][slots])
            add = new.get(name, 0.0)
            if name == "weight":
                add = 1.0
            self.sums[name][slots] = d * old + add
        self.visits[slots] += 1
        self.last_seen[slots] = step
        self.prompt_length[slots] = np.asarray(prompt_length_p, dtype=np.int64)[first]
        if difficulty_p is not None:
            diff = np.asarray(difficulty_p, dtype=np.float64)[first]
            self.difficulty[slots] = np.where(np.isnan(diff), -1.0, diff)

    def _slots_for(self, uniq: np.ndarray, step: int, slots=None) -> np.ndarray:
        """Slots of sorted distinct ids, inserting the new ones (evicting when full)."""
        slots = self.lookup(uniq) if slots is None else slots.copy()
        new = slots < 0
        k = int(np.count_nonzero(new))
        if k == 0:
            return slots
        self.last_seen[slots[~new]] = step  # the step's own prompts are never evicted
        free = min(k, self.capacity - self.size)
        fresh = np.arange(self.size, self.size + free, dtype=np.int64)
        self.last_seen[fresh] = step  # claimed by this step: not to be evicted below
        self.size += free
        if k > free:
            m = k - free
            # least recently seen first, ties to the lower slot: one unique int64 key per slot
            key = self.last_seen * self.capacity + np.arange(self.capacity)
            evicted = np.sort(np.argpartition(key, m - 1)[:m])
            for slot in evicted.tolist():
                del self._index[int(self.ids[slot])]
            self.visits[evicted] = 0
            self.difficulty[evicted] = -1.0
            self.evictions += m
            fresh = np.concatenate([fresh, evicted])
        slots[new] = fresh
        self.ids[fresh] = uniq[new]
        for i, slot in zip(uniq[new].tolist(), fresh.tolist(), strict=True):
            self._index[i] = slot
        return slots

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The used part of the table: numpy arrays and ints only."""
        n = self.size
        return {
            "capacity": self.capacity,
            "size": n,
            "evictions": self.evictions,
            "ids": self.ids[:n].copy(),
            "last_seen": self.last_seen[:n].copy(),
            "visits": self.visits[:n].copy(),
            "prompt_length": self.prompt_length[:n].copy(),
            "difficulty": self.difficulty[:n].copy(),
            **{f"sum_{name}": self.sums[name][:n].copy() for name in _SUMS},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["capacity"]) != self.capacity:
            raise ValueError(
                f"saved prompt table capacity {int(state['capacity'])} differs from "
                f"controller.hybrid.capacity = {self.capacity}"
            )
        fresh = PromptStats(self.capacity, self.decay)
        n = fresh.size = int(state["size"])
        fresh.evictions = int(state["evictions"])
        for name in ("ids", "last_seen", "visits", "prompt_length", "difficulty"):
            getattr(fresh, name)[:n] = state[name]
        for name in _SUMS:
            fresh.sums[name][:n] = state[f"sum_{name}"]
        fresh._index = {int(i): slot for slot, i in enumerate(fresh.ids[:n].tolist())}
        self.__dict__.update(fresh.__dict__)
