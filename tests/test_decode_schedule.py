"""The sampler's schedule (decode_schedule.py), by hand from its module docstring (numpy only).

Rollouts of lengths 1, 3, 5, 9 (tokens, the first drawn from the prefill: a rollout of length l
is decoded in l - 1 iterations at ages 1 .. l - 1), max_new_tokens 9, chunk 2: phases of 2, 4,
6, 8 completion slots.
"""

import numpy as np
import pytest

from sagc_jax import decode_schedule

LENGTHS = [1, 3, 5, 9]
PROMPTS = [7, 7, 11, 11]


def test_phases_rungs_and_start_times_by_hand():
    assert decode_schedule.phase_slots(9, 2) == (2, 4, 6, 8)
    assert decode_schedule.phase_slots(9, 0) == (9,) == decode_schedule.phase_slots(9, 8)
    assert decode_schedule.resolve_chunk(8192) == 1024 and decode_schedule.resolve_chunk(64) == 32
    assert decode_schedule.row_rungs(4, 3) == (4, 2, 1)
    assert decode_schedule.row_rungs(1024, 4, shards=8) == (1024, 512, 256, 128)
    assert decode_schedule.row_rungs(24, 4, shards=8) == (24,)  # 12 does not split into 8 shards
    with pytest.raises(ValueError, match="multiple of shards"):
        decode_schedule.row_rungs(12, 2, shards=8)
    # two slots: rollout 0 ends at its first token, so rollout 2 takes its slot before the
    # first iteration; rollout 1 (3 tokens) frees its slot at the end of iteration 2
    np.testing.assert_array_equal(decode_schedule.start_times(LENGTHS, 2), [0, 0, 0, 2])
    np.testing.assert_array_equal(decode_schedule.start_times(LENGTHS, 4), [0, 0, 0, 0])


def test_all_slots_one_rung():
    # every rollout starts at 0: at iteration k the running rows are those with l - 1 >= k,
    # all of age k; phase p holds ages up to 2 (p + 1)
    s = decode_schedule.simulate(
        LENGTHS, 9, slots=0, chunk=2, row_buckets=1, prompt_tokens_r=PROMPTS
    )
    np.testing.assert_array_equal(s.rows_k, [4] * 8)
    np.testing.assert_array_equal(s.live_k, [3, 3, 2, 2, 1, 1, 1, 1])
    np.testing.assert_array_equal(s.phase_k, [0, 0, 1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(s.age_sum_k, [3, 6, 6, 8, 5, 6, 7, 8])
    np.testing.assert_array_equal(s.prompt_sum_k, [29, 29, 22, 22, 11, 11, 11, 11])
    assert (s.decode_steps, s.rows_decoded, s.live_rows_decoded) == (8, 32, 14)


def test_all_slots_three_rungs():
    # rungs 4, 2, 1 for 3, 3, 2, 2, 1, ... running rows; from iteration 3 on they fit the second
    # rung (the tail: a cache of full width, the last phase)
    s = decode_schedule.simulate(
        LENGTHS, 9, slots=0, chunk=2, row_buckets=3, prompt_tokens_r=PROMPTS
    )
    np.testing.assert_array_equal(s.rows_k, [4, 4, 2, 2, 1, 1, 1, 1])
    np.testing.assert_array_equal(s.live_k, [3, 3, 2, 2, 1, 1, 1, 1])
    np.testing.assert_array_equal(s.phase_k, [0, 0, 3, 3, 3, 3, 3, 3])
    assert (s.decode_steps, s.rows_decoded, s.live_rows_decoded) == (8, 16, 14)


def test_two_slots_refilled_one_rung():
    # rollouts 1 (ages 1-2 in iterations 1-2) and 2 (iterations 1-4) decode first; rollout 3
    # takes rollout 1's slot at the end of iteration 2 and runs at ages 1-8 in iterations 3-10.
    # Phase 0 ends at iteration 3 (rollout 2 would reach age 3), phase 1 at 7 (rollout 3 at age
    # 5), phase 2 at 9.
    s = decode_schedule.simulate(
        LENGTHS, 9, slots=2, chunk=2, row_buckets=1, prompt_tokens_r=PROMPTS
    )
    np.testing.assert_array_equal(s.rows_k, [2] * 10)
    np.testing.assert_array_equal(s.live_k, [2, 2, 2, 2, 1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(s.phase_k, [0, 0, 1, 1, 1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(s.age_sum_k, [2, 4, 4, 6, 3, 4, 5, 6, 7, 8])
    np.testing.assert_array_equal(s.prompt_sum_k, [18, 18, 22, 22] + [11] * 6)
    assert (s.decode_steps, s.rows_decoded, s.live_rows_decoded) == (10, 20, 14)


def test_two_slots_refilled_two_rungs():
    # rungs 2, 1: rollout 3 waits until the end of iteration 2, so iterations 1-2 decode both
    # slots; at 3-4 two rows run (rung 2 = all slots); from 5 on one (the tail, rung 1)
    s = decode_schedule.simulate(
        LENGTHS, 9, slots=2, chunk=2, row_buckets=3, prompt_tokens_r=PROMPTS
    )
    np.testing.assert_array_equal(s.rows_k, [2, 2, 2, 2, 1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(s.live_k, [2, 2, 2, 2, 1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(s.phase_k, [0, 0, 1, 1, 3, 3, 3, 3, 3, 3])
    assert (s.decode_steps, s.rows_decoded, s.live_rows_decoded) == (10, 14, 14)


def test_rows_leave_as_soon_as_they_fit_a_smaller_rung():
    # lengths 2, 3, 6, 9, chunk 4 (phases of 4 and 8 slots), rungs 4, 2, 1: running 4, 3, 2, 2,
    # 2, 1, 1, 1; two rows fit rung 2 from iteration 3 (the tail, mid-phase), one fits rung 1
    # from iteration 6
    s = decode_schedule.simulate([2, 3, 6, 9], 9, chunk=4, row_buckets=3)
    np.testing.assert_array_equal(s.live_k, [4, 3, 2, 2, 2, 1, 1, 1])
    np.testing.assert_array_equal(s.rows_k, [4, 4, 2, 2, 2, 1, 1, 1])
    np.testing.assert_array_equal(s.phase_k, [0, 0, 1, 1, 1, 1, 1, 1])
    # one rung: every iteration decodes all 4 rows, the cache grows when the 9-token rollout
    # would reach age 5
    s = decode_schedule.simulate([2, 3, 6, 9], 9, chunk=4, row_buckets=1)
    np.testing.assert_array_equal(s.rows_k, [4] * 8)
    np.testing.assert_array_equal(s.phase_k, [0, 0, 0, 0, 1, 1, 1, 1])


def test_rows_leave_within_their_shard():
    """Rows are compacted within each device's shard: a rung holds the fullest shard's running
    rows on every shard, so two running rows on one of two shards keep all 4 rows."""
    # rollouts 0, 2 in shard 0 and 1, 3 in shard 1; two running rows from iteration 2
    apart = decode_schedule.simulate([9, 9, 2, 2], 9, row_buckets=2, shards=2)
    np.testing.assert_array_equal(apart.rows_k, [4] + [2] * 7)
    together = decode_schedule.simulate([9, 2, 9, 2], 9, row_buckets=2, shards=2)
    np.testing.assert_array_equal(together.rows_k, [4] * 8)
    assert decode_schedule.simulate([9, 2, 9, 2], 9, row_buckets=2).rows_k.tolist() == [4] + [2] * 7


def test_refilled_slots_are_taken_in_slot_order_in_passes():
    # 2 slots (passes of 1): rollouts 0 and 1 end at iterations 2 and 0; rollout 2 takes slot 1
    # at 0 and ends at once (length 1), so rollout 3 takes slot 1 too; rollout 4 takes slot 0 at 2
    assert decode_schedule.slot_of([3, 1, 1, 4, 2], 2).tolist() == [0, 1, 1, 1, 0]
    # 16 slots (passes of 2): slots 0..15 end together at 0 (length 1); the next 4 rollouts
    # take slots 0, 1, then 0 and 1 again (rollouts 16 and 17 end at once)
    assert decode_schedule.slot_of([1] * 18 + [5, 5], 16)[16:].tolist() == [0, 1, 0, 1]
    # with every rollout started together, rollout r is in slot r on one shard; on two shards
    # of 3 slots, rollouts 0, 2, 4 in shard 0 and 1, 3, 5 in shard 1
    assert decode_schedule.slot_of([3, 1, 2], 4).tolist() == [0, 1, 2]
    assert decode_schedule.first_rollouts(6, 2).tolist() == [0, 2, 4, 1, 3, 5]
    assert decode_schedule.slot_of([3] * 6, 6, shards=2).tolist() == [0, 3, 1, 4, 2, 5]
    # refill on two shards: rollout 1 (length 1) in slot 2 frees it for rollout 4 at once
    assert decode_schedule.slot_of([5, 1, 5, 5, 2], 4, shards=2).tolist() == [0, 2, 1, 3, 2]


def test_rollouts_of_one_token_decode_nothing():
    s = decode_schedule.simulate([1, 1, 1], 4, slots=2)
    assert s.decode_steps == 0 and s.rows_decoded == 0
    with pytest.raises(ValueError, match=r"lengths must be in \[1, 4\]"):
        decode_schedule.simulate([5], 4)


def test_group_stop_waits_for_every_part_and_follows_refill():
    """The exit test of tail batching: whole groups counted per part (process); with fewer slots
    a group finishes later because its rollouts start later."""
    lengths_r = [3, 1, 5, 2, 8, 2]  # all start together: rollouts end at 2, 0, 4, 1, 7, 1
    group_r = [0, 0, 1, 1, 2, 2]  # groups end at 2, 4, 7
    assert decode_schedule.group_stop(lengths_r, group_r, 1)[0] == 2
    stop_k, done_r = decode_schedule.group_stop(lengths_r, group_r, 2)
    assert stop_k == 4 and done_r.tolist() == [True, True, True, True, False, True]
    # parts: group 0 alone in part 0, groups 1 and 2 in part 1: part 1 needs group 1 (at 4)
    assert decode_schedule.group_stop(lengths_r, group_r, 1, part_g=[0, 1, 1])[0] == 4
    # more groups asked than a part has: the last of its groups
    assert decode_schedule.group_stop(lengths_r, group_r, 5)[0] == 7
    # two slots: rollouts 3.. start when 0 and 1 free them (ends 2, 0, 4, 3, 10, 5)
    stop_k, done_r = decode_schedule.group_stop(lengths_r, group_r, 2, slots=2)
    assert stop_k == 4 and done_r.tolist() == [True, True, True, True, False, False]
    full = decode_schedule.simulate(lengths_r, 8)
    cut = decode_schedule.simulate(lengths_r, 8, stop_at=stop_k)
    assert cut.decode_steps == stop_k and np.array_equal(cut.rows_k, full.rows_k[:stop_k])
