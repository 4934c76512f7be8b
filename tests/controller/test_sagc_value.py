"""The value-aware controller (controller.kind: sagc_value): SAGC+'s budget, G for learning
signal per modeled second; its pieces by hand, its choices on worlds of known success rates,
its reduction to SAGC+, resume and agreement."""

import numpy as np
import pytest

from sagc_jax.config import ControllerConfig, SAGCPlusConfig, SAGCValueConfig, load_config
from sagc_jax.controller import (
    SAGCPlusController,
    SAGCValueController,
    StepObservation,
    make_controller,
)
from sagc_jax.controller.sagc_value import beta_moment, decode_slots
from sagc_jax.sim.worlds import TailWorld, oracle, rates_table


def overhead_seconds(lengths_pg, signal_p=None):
    """A step of 64 rollouts costs twice a step of none: a fixed part and a part per row."""
    return 1.0 + lengths_pg.size / 64.0


def value(delta=0.2, g_init=None, step_seconds=overhead_seconds, **knobs):
    budget = ControllerConfig(delta=delta, g_init=g_init)
    return SAGCValueController(
        budget, SAGCPlusConfig(), SAGCValueConfig(**knobs), step_seconds=step_seconds
    )


def bernoulli_rewards(rng, shape, p_p):
    """Rewards [P, G]: 1 with the prompt's success rate ``p_p`` ([P] or a float), else 0."""
    p_p = np.broadcast_to(np.asarray(p_p, dtype=np.float64), shape[:1])
    return (rng.random(shape) < p_p[:, None]).astype(np.float64)


def drive(controller, world, rewards_of, steps, rng):
    """``(G_t, s_t)`` over ``steps`` steps of ``world``'s lengths; ``rewards_of(t, shape)``
    gives the step's rewards (None: no rewards given)."""
    gs, ss = [], []
    for t in range(steps):
        g = controller.propose()
        lengths = world.lengths(t, g)
        rewards = rewards_of(t, lengths.shape, rng)
        m = controller.observe(StepObservation.of_groups(lengths, rewards_pg=rewards))
        assert g <= m.get("ceiling_group_size", g)  # never above SAGC+'s choice
        gs.append(g)
        ss.append(m["s_t"])
    return np.array(gs), np.array(ss)


def calm_world(steps=60, seed=0):
    """No tails: nothing straggles, SAGC+'s budget allows every rung."""
    return TailWorld(lambda t: 1e-6, steps=steps, prompts_per_step=16, seed=seed)


def dense(t, shape, rng):
    return bernoulli_rewards(rng, shape, 0.5)


def sparse(t, shape, rng):
    return bernoulli_rewards(rng, shape, 0.03)


# ---------------------------------------------------------------- pieces


def test_beta_moment_by_hand():
    assert beta_moment(0.5, 0.0, 3) == pytest.approx(0.125)  # no spread: mean^n
    # Beta(1, 1) (mean 1/2, variance 1/12): E[p^2] = 1/3
    assert beta_moment(0.5, 1.0 / 12.0, 2) == pytest.approx(1.0 / 3.0)
    assert beta_moment(0.0, 0.1, 4) == 0.0


def test_signal_counts_every_smaller_rung_through_chunks():
    c = value(g_init=16)
    assert c.propose() == 16
    rewards = np.zeros((4, 16))
    rewards[0, 0] = 1.0  # group 0: only its first chunk of 4 and of 8 holds a success
    rewards[1, 5] = 1.0  # group 1: its second chunk of 4, its first of 8
    c.observe(StepObservation.of_groups(np.full((4, 16), 10), rewards_pg=rewards))
    # rung 4: groups 0 and 1 each have 1 of 4 chunks varied -> 0.5 trials; rung 8: 2 x 1/2
    np.testing.assert_allclose(c.signal, [0.5, 1.0, 2.0])
    np.testing.assert_allclose(c.groups, [4.0, 4.0, 4.0])
    # rows of 4 cost 1 + 16/64 s; the played rung's own step: 1 + 64/64
    np.testing.assert_allclose(c.seconds(), [1.25, 1.5, 2.0])


def test_a_cut_group_gives_no_signal_evidence():
    c = value(g_init=4)
    c.propose()
    rewards = np.array([[1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    finished = np.array([[True] * 4, [True, True, True, False]])
    c.observe(
        StepObservation.of_groups(np.array([[10, 10, 10, 10], [10, 10, 10, 40]]), finished, rewards)
    )
    np.testing.assert_allclose(c.groups, [1.0, 0.0, 0.0])


def test_rewards_of_another_shape_are_rejected():
    c = value()
    c.propose()
    with pytest.raises(ValueError, match="rewards_pg has shape"):
        c.observe(StepObservation.of_groups(np.full((2, 8), 10), rewards_pg=np.zeros((2, 4))))


# ---------------------------------------------------------------- choices


def test_picks_the_smallest_g_where_every_rung_has_the_same_signal():
    """Rewards 1, 0, 1, 0, ... in every group: every group of every rung has signal, so a
    larger group adds only its (1 - 1/G) and costs more: G = 4, where SAGC+ plays 16."""

    def alternating(t, shape, rng):
        return np.tile([1.0, 0.0], (shape[0], shape[1] // 2))

    world = calm_world()
    gs, _ = drive(value(), world, alternating, 60, np.random.default_rng(0))
    assert set(gs[5:]) == {4}
    plus_gs, _ = drive(
        SAGCPlusController(ControllerConfig(delta=0.2)),
        world,
        lambda *a: None,
        60,
        np.random.default_rng(0),
    )
    assert set(plus_gs[5:]) == {16}


def test_dense_rewards_small_groups_sparse_rewards_large_groups():
    world = calm_world()
    dense_gs, _ = drive(value(), world, dense, 60, np.random.default_rng(1))
    sparse_gs, _ = drive(value(), world, sparse, 60, np.random.default_rng(1))
    assert np.mean(dense_gs[10:] == 4) >= 0.9
    assert np.mean(sparse_gs[10:] == 16) >= 0.9


def test_moves_up_as_rewards_turn_sparse_and_down_as_they_turn_dense():
    def drifting(t, shape, rng):
        return bernoulli_rewards(rng, shape, 0.5 if t < 40 else 0.03)

    gs, _ = drive(value(), calm_world(steps=100), drifting, 100, np.random.default_rng(2))
    # a rung up must beat the one played by min_gain: the climb takes about 30 steps
    assert np.mean(gs[10:40] == 4) >= 0.9 and np.mean(gs[70:] == 16) >= 0.9


def test_mixed_prompts_unsolvable_ones_add_nothing():
    """Half the prompts are never solved (no group of any size has signal), half are solved
    half the time: P_nz = 0.44, 0.50, 0.50 at G = 4, 8, 16, signal per second 0.164, 0.145,
    0.094 (steps of 2, 3, 5 s). The best is G = 4; the Beta success model, fitted to two kinds
    of prompts, overrates G = 8 a little, which it then plays now and then."""

    def mixed(t, shape, rng):
        return bernoulli_rewards(rng, shape, np.tile([0.0, 0.5], shape[0] // 2))

    gs, _ = drive(value(), calm_world(), mixed, 60, np.random.default_rng(3))
    assert np.mean(gs[10:] == 4) >= 0.75 and 16 not in gs[10:]


# ---------------------------------------------------------------- reduction to SAGC+


def straggle_world():
    """Tails whose rate drifts up: SAGC+ moves through its rungs."""
    return TailWorld(lambda t: 0.005 + 0.0008 * t, steps=80, prompts_per_step=16, seed=4)


def test_without_rewards_it_is_sagc_plus():
    world = straggle_world()
    plus_gs, plus_ss = drive(
        SAGCPlusController(ControllerConfig(delta=0.2)),
        world,
        lambda *a: None,
        80,
        np.random.default_rng(5),
    )
    gs, ss = drive(value(), world, lambda *a: None, 80, np.random.default_rng(5))
    np.testing.assert_array_equal(gs, plus_gs)
    np.testing.assert_array_equal(ss, plus_ss)
    assert len(set(gs.tolist())) > 1  # SAGC+ moves, so the check can fail


def test_told_its_signal_per_second_is_flat_it_stays_unless_the_budget_moves_it():
    """Every group has signal, and a step's cost is its signal (1 - 1/G): signal per second
    is the same at every rung, so nothing beats the rung played by min_gain: G stays where it
    is, and goes down only when SAGC+'s choice (the ceiling) does."""

    def alternating(t, shape, rng):
        return np.tile([1.0, 0.0], (shape[0], shape[1] // 2))

    def flat(lengths_pg, signal_p):
        return 1.0 - 1.0 / lengths_pg.shape[1]

    world, rng, c = straggle_world(), np.random.default_rng(6), value(step_seconds=flat)
    gs, ceilings = [], []
    for t in range(80):
        g = c.propose()
        lengths = world.lengths(t, g)
        rewards = alternating(t, lengths.shape, rng)
        m = c.observe(StepObservation.of_groups(lengths, rewards_pg=rewards))
        gs.append(g)
        ceilings.append(m["ceiling_group_size"])
    assert gs[0] == ceilings[0] == 8  # g_init
    for t in range(1, 80):
        assert gs[t] == min(gs[t - 1], ceilings[t])
    assert len(set(ceilings)) > 1 and len(set(gs)) > 1  # SAGC+ moves, so the check can fail


def test_each_rung_is_timed_with_its_own_groups_with_signal():
    """The cost of a rung is asked with the signal of the groups it would have: a chunk of G'
    rollouts has signal when its own rewards differ; a rung above the played one is timed on
    the step's columns repeated, the same groups with signal."""
    calls = []

    def recording(lengths_pg, signal_p):
        calls.append((lengths_pg.shape[1], None if signal_p is None else signal_p.tolist()))
        return 1.0 + lengths_pg.size

    c = value(g_init=8, step_seconds=recording)
    assert c.propose() == 8
    rewards = np.zeros((2, 8))
    rewards[0, 1] = 1.0  # group 0: its first chunk of 4 varies, its second does not
    c.observe(StepObservation.of_groups(np.full((2, 8), 10), rewards_pg=rewards))
    assert calls == [
        (4, [True, False]),
        (4, [False, False]),
        (8, [True, False]),
        (16, [True, False]),
    ]
    calls.clear()
    c = value(g_init=8, step_seconds=recording)
    c.propose()
    c.observe(StepObservation.of_groups(np.full((2, 8), 10)))  # no rewards: every group counts
    assert calls == [(4, None), (4, None), (8, None), (16, None)]


def test_groups_without_signal_make_a_larger_rung_cheap_when_the_update_skips_them():
    """A step costs 1 per decoded row plus 10 per row trained, and only groups with signal are
    trained: with rewards all equal every rung costs its decoding alone (ratio 2 from rung to
    rung); given no rewards it counts every row as trained (ratio about 2 as well, but 11x the
    seconds)."""

    def signal_only(lengths_pg, signal_p):
        trained = lengths_pg.shape[0] if signal_p is None else int(np.count_nonzero(signal_p))
        return lengths_pg.size + 10.0 * trained * lengths_pg.shape[1]

    quiet, counted = (
        value(g_init=16, step_seconds=signal_only),
        value(g_init=16, step_seconds=signal_only),
    )
    lengths = np.full((4, 16), 10)
    quiet.propose(), counted.propose()
    quiet.observe(StepObservation.of_groups(lengths, rewards_pg=np.zeros((4, 16))))
    counted.observe(StepObservation.of_groups(lengths))
    np.testing.assert_allclose(quiet.seconds(), [16.0, 32.0, 64.0])
    np.testing.assert_allclose(counted.seconds(), [176.0, 352.0, 704.0])


def test_step_times_are_learned_as_a_ratio_of_expected_seconds():
    """Synchronous cost (rows x the step's longest), G = 8 played: in one step of two a
    straggler falls in the second chunk of 4 only. Per step the G = 8 / G = 4 ratio is 2 or
    3.6 (mean 2.8); the controller learns the ratio of the sums, of expected seconds (3.4)."""

    def synchronous(lengths_pg, signal_p):
        return float(lengths_pg.size * lengths_pg.max())

    c = value(step_seconds=synchronous, gamma=1.0)
    plain, straggled = np.full((4, 8), 10), np.full((4, 8), 10)
    straggled[0, 5] = 100  # in the second chunk of 4 only
    for lengths in (plain, straggled) * 3:
        c._learn_seconds(lengths, None)  # what observe() does with a step played at G = 8
    t4 = [16 * 10, (16 * 10 + 16 * 100) / 2]  # G = 4: the mean of the step's two chunks
    t8 = [32 * 10, 32 * 100]
    expected = sum(t8) / sum(t4)
    assert c.seconds()[1] / c.seconds()[0] == pytest.approx(expected, rel=1e-12)
    per_step = np.mean([t8[0] / t4[0], t8[1] / t4[1]])
    assert expected == pytest.approx(3.38, abs=0.01) and per_step == pytest.approx(2.82, abs=0.01)


def test_a_state_saved_with_log_ratios_restores_all_but_the_step_times():
    c = value()
    c.propose()
    c.observe(StepObservation.of_groups(np.full((4, 8), 10), rewards_pg=np.zeros((4, 8))))
    state = c.state_dict()
    old = {k: v for k, v in state.items() if k not in ("seconds_sum", "below_sum", "last_seconds")}
    old.update(log_ratio=np.zeros(3), timed=np.ones(3), log_bound=np.zeros(3))
    restored = value()
    restored.load_state_dict(old)
    np.testing.assert_array_equal(restored.signal, c.signal)
    assert restored.seconds().tolist() == [0.0, 0.0, 0.0]  # learned again from the next step
    assert restored.propose() == c.propose()  # until then SAGC+'s rung


# ---------------------------------------------------------------- budget


@pytest.mark.parametrize("rewards_of", [dense, sparse], ids=["dense", "sparse"])
def test_keeps_the_budget_on_the_oracle_worlds(rewards_of):
    """The worlds of SAGC+'s quick oracle slice (test_sagc_plus.py), 80 steps, 16 groups."""
    for q_of_step, delta in [
        (lambda t: 0.04, 0.2),
        (lambda t: 0.2, 0.3),  # heavy tail: even G=4 breaks delta
        (lambda t: 0.1 if t < 40 else 0.01, 0.2),  # sudden shift down
        (lambda t: 0.005 + 0.0008 * t, 0.2),  # drift up
    ]:
        world = TailWorld(q_of_step, steps=80, prompts_per_step=16, seed=7)
        best = oracle(rates_table(world), world.candidates, delta)
        _, ss = drive(value(delta=delta), world, rewards_of, 80, np.random.default_rng(8))
        assert np.mean(ss[10:]) - best["allowed"][10:].mean() <= 0.03


# ---------------------------------------------------------------- state, agreement, config


@pytest.mark.parametrize("mid_step", [False, True])
def test_state_round_trips_bit_exactly(mid_step):
    def drifting(t, shape, rng):
        return bernoulli_rewards(rng, shape, 0.02 + 0.006 * t)

    world = straggle_world()

    def run(restore_at):
        c = value(delta=0.25)
        rng = np.random.default_rng(9)
        gs, _ = drive(c, world, drifting, restore_at, rng)
        if mid_step and restore_at < 80:
            c.propose()
        state = c.state_dict()
        for key, item in state.items():
            assert isinstance(item, np.ndarray | int | float | str), key
        restored = value(delta=0.25)
        restored.load_state_dict(state)
        for key, item in restored.state_dict().items():
            np.testing.assert_array_equal(item, state[key])  # bit for bit
        later, _ = drive(
            restored,
            _Shifted(world, restore_at),
            lambda t, shape, rng: drifting(t + restore_at, shape, rng),
            80 - restore_at,
            rng,
        )
        return np.concatenate([gs, later]), restored.state_dict()

    straight, end = run(80)
    resumed, resumed_end = run(33)
    np.testing.assert_array_equal(resumed, straight)
    for key, item in end.items():
        np.testing.assert_array_equal(resumed_end[key], item)
    assert len(set(straight.tolist())) > 1  # the trajectory moves, so the check can fail


class _Shifted:
    """``world`` seen from step ``offset`` on (the resumed half of a run)."""

    def __init__(self, world, offset):
        self.world, self.offset = world, offset

    def lengths(self, t, g):
        return self.world.lengths(t + self.offset, g)


def test_processes_with_the_same_gathered_statistics_agree_on_g():
    """Every process runs its own controller on the all-gathered lengths and rewards: the
    decisions must be identical (no random generator, no process-dependent state)."""
    world = straggle_world()
    rng = np.random.default_rng(10)
    procs = [value(), value()]
    for t in range(60):
        gs = {c.propose() for c in procs}
        assert len(gs) == 1
        g = gs.pop()
        lengths = world.lengths(t, g)
        rewards = bernoulli_rewards(rng, lengths.shape, 0.02 + 0.008 * t)
        for c in procs:
            c.observe(StepObservation.of_groups(lengths.copy(), rewards_pg=rewards.copy()))
    for key, item in procs[0].state_dict().items():
        np.testing.assert_array_equal(procs[1].state_dict()[key], item)


def test_state_of_sagc_plus_is_rejected():
    with pytest.raises(ValueError, match="SAGCValueController"):
        make_controller("sagc_value").load_state_dict(make_controller("sagc_plus").state_dict())


def test_config_and_spec():
    cfg = load_config(
        None, ["controller.kind=sagc_value", "controller.sagc_value.min_gain=0.2"]
    ).controller
    c = make_controller(cfg)
    assert isinstance(c, SAGCValueController) and c.value.min_gain == 0.2
    assert c.step_seconds is decode_slots
    assert make_controller("sagc_value", cfg, step_seconds=overhead_seconds).step_seconds is (
        overhead_seconds
    )
    assert not make_controller("sagc_plus").reward_aware and c.reward_aware


def test_a_fixed_rollout_budget_is_refused_in_one_line():
    from sagc_jax.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, ["controller.kind=sagc_value", "train.batch_mode=budget"])
    assert "needs train.batch_mode = prompts" in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- in the trainer


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["loss.algorithm=dapo", "loss.dynamic_sampling=true", "loss.max_sampling_rounds=2"],
        ["tail_batching.enabled=true", "tail_batching.extra=0.5"],
    ],
    ids=["grpo", "dapo-dynamic-sampling", "tail-batching"],
)
def test_the_trainer_gives_it_rewards_and_the_step_time_model(tmp_path, extra):
    import json

    from helpers import TINY

    from sagc_jax.train.loop import Trainer

    overrides = [*TINY, "controller.kind=sagc_value", "train.steps=3", *extra]
    trainer = Trainer(load_config(None, [*overrides, "logging.tensorboard=false"]), tmp_path)
    trainer.run(progress=False)
    trainer.close()
    ctrl = trainer.controller
    assert isinstance(ctrl, SAGCValueController) and ctrl.step == 3
    assert ctrl.step_seconds is not decode_slots  # the sim section's roofline
    assert ctrl.success[0] > 0 and np.all(ctrl.seconds() > 0)  # rewards and step times seen
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "group_size" in r]
    assert len(steps) == 3
    for r in steps:
        assert len(r["controller/signal"]) == len(r["controller/step_seconds"]) == 2
        assert r["group_size"] <= r["controller/ceiling_group_size"]
