"""The sampler's schedule, in plain Python and numpy (no jax): decode phases, row buckets, slot
refill, and `simulate`, which replays the sampler's decode iterations from the completion
lengths alone, so the roofline (``sim/roofline.py``) times the engine the project has and tests
check the sampler's own counters against it.

The engine (``sampling/sampler.py``) decodes N rollouts through S slots (rows):

- Prefill: one per prompt. Slots 0..S-1 take rollouts 0..S-1, a group's rollouts spread over
  the shards (`first_rollouts`); each draws its token 0 from its prompt's prefill logits (age 1);
  a rollout of length 1 is done at once.
- A decode iteration decodes every row of the current row bucket: a running row of age a writes
  its token a - 1 at completion slot a - 1 and samples token a (age a + 1); it is done at its
  end token or at age L = max_new_tokens. Then every free slot takes the next waiting rollout
  (slot order, rollout order): its prompt's cache is copied in and it draws its token 0, so a
  rollout that starts at the end of iteration k is first decoded in iteration k + 1.
- The cache grows in phases (`phase_slots`): phase p holds cap_p completion slots, so an
  iteration may run while every running row has age <= cap_p.
- Before each iteration the rows to decode are chosen: all S slots while rollouts are waiting,
  else the running rows, gathered into the smallest rung of `row_rungs` that holds them
  (finished rows fill the rest of the rung): rows leave the batch as soon as they fit a smaller
  rung. With the slots split into h shards (devices; slot s in shard s // (S / h)), rows are
  gathered within their shard, so a rung of R rows holds R / h rows of each shard: the running
  rows of the fullest shard, times h, must fit it.
- While all S slots decode, the cache grows at phase ends. Once the running rows fit the second
  rung with none waiting (the tail), they move to a cache of full width (prompt + L slots): the
  live count only falls from then on, so the tail visits the smaller rungs in order, each one
  branch of the program, with no phases.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

AUTO_CHUNK_MIN = 32  # 'auto': at least this many slots per phase...
AUTO_PHASES = 8  # ...and at most this many phases (each is one more loop body to compile)
REFILL_SHARE = 8  # a refill pass starts at most slots / REFILL_SHARE rollouts (cache copies)


def resolve_chunk(max_new_tokens: int, decode_chunk: int | str = "auto") -> int:
    """Cache slots added per decode phase; 0 means one phase over the whole cache.

    'auto' is max(AUTO_CHUNK_MIN, ceil(max_new_tokens / AUTO_PHASES)): short completions keep one
    phase, long ones at most AUTO_PHASES (compile time grows with the number of phases).
    """
    if decode_chunk == "auto":
        return max(AUTO_CHUNK_MIN, -(-max_new_tokens // AUTO_PHASES))
    if isinstance(decode_chunk, bool) or not isinstance(decode_chunk, int) or decode_chunk < 0:
        raise ValueError(f"decode_chunk={decode_chunk!r}; use an int >= 0 (0: one phase) or 'auto'")
    return decode_chunk


def phase_slots(max_new_tokens: int, chunk: int) -> tuple[int, ...]:
    """Completion slots of the cache in each decode phase (the cache holds prompt + these).

    A row of age a (tokens sampled so far) writes its token a - 1 at completion slot a - 1, so a
    phase of n slots runs iterations while every running row has age <= n. chunk 0 (or one that
    covers every iteration) gives a single phase of max_new_tokens slots.
    """
    steps = max_new_tokens - 1
    if chunk <= 0 or chunk >= steps:
        return (max_new_tokens,)
    return tuple(min(chunk * (p + 1), max_new_tokens) for p in range(-(-steps // chunk)))


def row_rungs(slots: int, row_buckets: int, shards: int = 1) -> tuple[int, ...]:
    """Row counts an iteration may decode at, largest first: ``slots`` and up to ``row_buckets - 1``
    halvings of it, each still a whole multiple of ``shards`` (the rows' shards of the mesh)."""
    if slots < 1 or row_buckets < 1 or shards < 1 or slots % shards:
        raise ValueError(
            f"row_rungs: slots={slots}, row_buckets={row_buckets}, shards={shards}; need "
            f"slots a positive multiple of shards and row_buckets >= 1"
        )
    rungs = [slots]
    while len(rungs) < row_buckets and rungs[-1] % 2 == 0 and (rungs[-1] // 2) % shards == 0:
        rungs.append(rungs[-1] // 2)
    return tuple(rungs)


def list_schedule(durations_r, slots: int) -> np.ndarray:
    """int64 [N]: when each job starts if ``slots`` slots run jobs of ``durations_r`` [N] and a
    free slot takes the next job in order (list scheduling; all slots free at 0)."""
    durations_r = np.asarray(durations_r, np.int64).ravel()
    if slots >= durations_r.size:
        return np.zeros(durations_r.size, np.int64)
    free_at = [0] * slots  # a heap of the times at which each slot frees up
    starts = np.empty(durations_r.size, np.int64)
    for r, duration in enumerate(durations_r.tolist()):
        starts[r] = heapq.heappop(free_at)
        heapq.heappush(free_at, int(starts[r]) + duration)
    return starts


def start_times(lengths_r, slots: int) -> np.ndarray:
    """int64 [N]: the iteration at whose end each rollout takes a slot (0: before the first),
    when ``slots`` slots are refilled in rollout order. A rollout of length l started at s frees
    its slot at the end of iteration s + l - 1 (at once if l = 1)."""
    return list_schedule(np.asarray(lengths_r, np.int64) - 1, slots)


def first_rollouts(slots: int, shards: int = 1) -> np.ndarray:
    """int64 [slots]: the rollout each slot starts with. Slot s is in shard s // (slots / shards);
    consecutive rollouts (a group's, whose lengths go together) go to consecutive shards, so each
    device gets its share of every group's long completions: slot d * (slots / shards) + i takes
    rollout i * shards + d."""
    per = slots // shards
    slot_s = np.arange(slots, dtype=np.int64)
    return (slot_s % per) * shards + slot_s // per


def slot_of(lengths_r, slots: int, shards: int = 1) -> np.ndarray:
    """int64 [N]: the slot each rollout of ``lengths_r`` [N] runs in, ``slots`` slots (split into
    ``shards``) filled as the sampler fills them: first as `first_rollouts` says, then, at the end
    of an iteration, passes of at most ``ceil(slots / REFILL_SHARE)`` waiting rollouts take the
    free slots in slot order, rollouts in order, until none is free or none waits (a rollout that
    ends at its first token frees its slot for the next pass)."""
    lengths_r = np.asarray(lengths_r, np.int64).ravel()
    n = lengths_r.size
    slots = min(slots, n)
    slot_r = np.empty(n, np.int64)
    slot_r[first_rollouts(slots, shards)] = np.arange(slots)
    if slots == n:
        return slot_r
    width = max(1, -(-slots // REFILL_SHARE))
    free_at = np.empty(slots, np.int64)  # the iteration at whose end each slot's rollout is done
    free_at[slot_r[:slots]] = lengths_r[:slots] - 1
    waiting = slots
    while waiting < n:
        k = int(free_at.min())
        while waiting < n:
            free = np.flatnonzero(free_at <= k)[: min(width, n - waiting)]
            if not free.size:
                break
            taken = np.arange(waiting, waiting + free.size)
            slot_r[taken] = free
            free_at[free] = k + lengths_r[taken] - 1
            waiting += free.size
    return slot_r


def group_stop(
    lengths_r, group_r, keep_groups: int, *, slots: int = 0, part_g=None
) -> tuple[int, np.ndarray]:
    """``(stop_k, done_r)``: the sampler's exit test with ``keep_groups`` > 0 (tail batching).

    Rollouts of ``lengths_r`` [N] (the lengths they would reach), rollout r in group
    ``group_r[r]`` (int [N], groups 0..num_groups-1), through ``slots`` slots (0: all N). A
    rollout started at the end of iteration s (`start_times`) with length l is done at the end of
    iteration s + l - 1. ``stop_k`` is the first iteration at whose end every part (``part_g``
    int [num_groups]: each group's process; default one part) has ``keep_groups`` groups whose
    rollouts are all done (0: before any decode iteration; the last iteration if a part has
    fewer groups); ``done_r`` bool [N]: the rollouts done by then."""
    lengths_r = np.asarray(lengths_r, np.int64).ravel()
    group_r = np.asarray(group_r, np.int64).ravel()
    num_groups = int(group_r.max()) + 1
    part_g = np.zeros(num_groups, np.int64) if part_g is None else np.asarray(part_g, np.int64)
    ends_r = start_times(lengths_r, min(slots or lengths_r.size, lengths_r.size)) + lengths_r - 1
    done_g = np.full(num_groups, -1, np.int64)
    np.maximum.at(done_g, group_r, ends_r)  # the iteration that ends each group
    stop_k = 0
    for part in np.unique(part_g):
        ends = np.sort(done_g[part_g == part])
        stop_k = max(stop_k, int(ends[min(keep_groups, ends.size) - 1]))
    return stop_k, ends_r <= stop_k


class Schedule(NamedTuple):
    """Per decode iteration k = 1..K of a step (numpy arrays of K values).

    rows_k: rows decoded (the rung); live_k: rows still running among them; phase_k: the cache
    phase (the last, of full width, in the tail); age_sum_k: sum of the running rows' ages
    (completion tokens in their caches); prompt_sum_k: sum of the running rows' prompt tokens.
    """

    rows_k: np.ndarray
    live_k: np.ndarray
    phase_k: np.ndarray
    age_sum_k: np.ndarray
    prompt_sum_k: np.ndarray

    @property
    def decode_steps(self) -> int:
        return int(self.rows_k.size)

    @property
    def rows_decoded(self) -> int:
        return int(self.rows_k.sum())

    @property
    def live_rows_decoded(self) -> int:
        return int(self.live_k.sum())


def simulate(
    lengths_r,
    max_new_tokens: int,
    *,
    slots: int = 0,
    chunk: int = 0,
    row_buckets: int = 1,
    shards: int = 1,
    prompt_tokens_r=0,
    stop_at: int | None = None,
) -> Schedule:
    """The sampler's decode iterations for rollouts of ``lengths_r`` [N] (in rollout order,
    each in [1, max_new_tokens]) through ``slots`` slots (0: all N), cache phases of ``chunk``
    slots (`phase_slots`) and ``row_buckets`` rungs (`row_rungs`), the slots split into
    ``shards`` devices that each gather their own running rows. ``prompt_tokens_r``: an int
    or [N], only summed into ``prompt_sum_k``. ``stop_at``: the iterations up to that one (the
    step cut by the exit test of `group_stop`; rows, rungs and phases before it are unchanged)."""
    lengths_r = np.asarray(lengths_r, np.int64).ravel()
    n = lengths_r.size
    if n == 0 or lengths_r.min() < 1 or lengths_r.max() > max_new_tokens:
        raise ValueError(f"simulate: lengths must be in [1, {max_new_tokens}] (got {n} rows)")
    prompts_r = np.broadcast_to(np.asarray(prompt_tokens_r, np.int64), lengths_r.shape)
    slots = min(slots or n, n)
    rungs = row_rungs(slots, row_buckets, shards)
    caps_p = phase_slots(max_new_tokens, chunk)
    starts_r = start_times(lengths_r, slots)
    ends_r = starts_r + lengths_r - 1  # last iteration that decodes the rollout (none if = start)
    last = int(ends_r.max())
    if last == 0:
        empty = np.zeros(0, np.int64)
        return Schedule(empty, empty, empty, empty, empty)
    # Per iteration k = 1..last: running rows, their ages and prompts (difference arrays: row r is
    # decoded in iterations starts_r + 1 .. ends_r at ages 1 .. l - 1, age = k - start).
    decoded = ends_r > starts_r
    first_r, stop_r = starts_r[decoded] + 1, ends_r[decoded] + 1
    # Rows are compacted within each shard (device): a rung holds the running rows of the
    # fullest shard on every shard.
    shard_r = slot_of(lengths_r, slots, shards)[decoded] // (slots // shards)
    live_ks = np.zeros((last + 2, shards), np.int64)
    np.add.at(live_ks, (first_r, shard_r), 1)
    np.add.at(live_ks, (stop_r, shard_r), -1)
    fullest_k = np.cumsum(live_ks, axis=0).max(axis=1) * shards
    live = np.zeros(last + 2, np.int64)
    offset = np.zeros(last + 2, np.int64)
    prompt = np.zeros(last + 2, np.int64)
    np.add.at(live, first_r, 1)
    np.add.at(live, stop_r, -1)
    np.add.at(offset, first_r, -starts_r[decoded])
    np.add.at(offset, stop_r, starts_r[decoded])
    np.add.at(prompt, first_r, prompts_r[decoded])
    np.add.at(prompt, stop_r, -prompts_r[decoded])
    k_all = np.arange(last + 2)
    live_k = np.cumsum(live)
    age_sum_k = np.cumsum(offset) + live_k * k_all
    prompt_sum_k = np.cumsum(prompt)
    # Phase p ends before the first iteration at which some running row would pass cap_p.
    phase_end_p = []
    for cap in caps_p:
        over = decoded & (lengths_r - 1 > cap)
        phase_end_p.append(int((starts_r[over] + cap + 1).min()) if over.any() else last + 1)
    all_started = int(starts_r.max())  # no rollout waits from the end of this iteration on
    k_k = np.arange(1, last + 1)
    rungs_desc = np.asarray(rungs)
    # the smallest rung that holds the fullest shard's running rows on every shard (rungs are in
    # decreasing order)
    fits_kr = rungs_desc[None, :] >= fullest_k[1 : last + 1, None]
    smallest_k = rungs_desc[np.sum(fits_kr, axis=1) - 1]
    waiting_k = k_k - 1 < all_started
    rows_k = np.where(waiting_k, slots, smallest_k)
    tail_k = ~waiting_k & (rows_k < slots)
    if tail_k.any():  # sticky: the live count only falls once no rollout waits
        tail_k[np.argmax(tail_k) :] = True
    phase_k = np.searchsorted(np.asarray(phase_end_p), k_k, side="right")
    phase_k = np.where(tail_k, len(caps_p) - 1, np.minimum(phase_k, len(caps_p) - 1))
    rows_k = np.concatenate([[0], rows_k])
    phase_k = np.concatenate([[0], phase_k])
    sl = slice(1, last + 1 if stop_at is None else min(last, stop_at) + 1)
    return Schedule(rows_k[sl], live_k[sl], phase_k[sl], age_sum_k[sl], prompt_sum_k[sl])
