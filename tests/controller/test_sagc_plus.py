"""SAGC+ (controller.kind: sagc_plus): each failure mode of the paper's SAGC that it removes,
on hand-made lengths, plus its pieces (isotonic fit, best mixture), resume and the oracle suite."""

import numpy as np
import pytest

from sagc_jax.config import ControllerConfig, SAGCPlusConfig, load_config
from sagc_jax.controller import SAGCPlusController, StepObservation, make_controller
from sagc_jax.controller.sagc_plus import best_mixture, isotonic_increasing
from sagc_jax.sim.worlds import TailWorld, oracle, rates_table

U = np.log2([4.0, 8.0, 16.0])


def tail_lengths(rng, num_groups, group_size, q):
    """Lengths [P, G]: every rollout is 100 tokens, or a 1000-token tail with probability q
    (i.i.d.), so a group of G straggles (tau 3) about as often as 1 - (1 - q)^G."""
    return np.where(rng.random((num_groups, group_size)) < q, 1000, 100).astype(np.int64)


def drive(controller, q_of_step, steps, rng, num_groups=16):
    """``(G_t, s_t)`` over ``steps`` steps of tail rollouts with probability ``q_of_step(t)``."""
    gs, ss = [], []
    for t in range(steps):
        g = controller.propose()
        m = controller.observe(
            StepObservation.of_groups(tail_lengths(rng, num_groups, g, q_of_step(t)))
        )
        gs.append(g)
        ss.append(m["s_t"])
    return np.array(gs), np.array(ss)


def plus(delta=0.2, g_init=None, **knobs):
    return SAGCPlusController(ControllerConfig(delta=delta, g_init=g_init), SAGCPlusConfig(**knobs))


# ---------------------------------------------------------------- pieces


def test_isotonic_fit_by_hand():
    np.testing.assert_allclose(
        isotonic_increasing(np.array([0.1, 0.3, 0.2]), np.ones(3)), [0.1, 0.25, 0.25]
    )
    # the heavier rung pulls the pooled value: (0.4 * 3 + 0.1 * 1) / 4
    np.testing.assert_allclose(
        isotonic_increasing(np.array([0.4, 0.1, 0.5]), np.array([3.0, 1.0, 1.0])),
        [0.325, 0.325, 0.5],
    )
    np.testing.assert_allclose(
        isotonic_increasing(np.array([0.1, 0.2, 0.3]), np.ones(3)), [0.1, 0.2, 0.3]
    )


def test_best_mixture_by_hand():
    # adjacent rungs: 0.2 = 0.1 + share (0.3 - 0.1) -> share 0.5 of G = 8
    assert best_mixture(np.array([0.1, 0.3, 0.5]), U, 0.2) == (0, 1, pytest.approx(0.5))
    # a concave p: mixing 4 and 16 (2 + 0.4 * 2 = 2.8) beats 4 and 8 (2 + 0.5 = 2.5)
    assert best_mixture(np.array([0.1, 0.3, 0.35]), U, 0.2) == (0, 2, pytest.approx(0.4))
    assert best_mixture(np.array([0.01, 0.05, 0.1]), U, 0.2) == (2, 2, 0.0)  # all fit
    assert best_mixture(np.array([0.3, 0.5, 0.7]), U, 0.2) == (0, 0, 0.0)  # none fits


def test_oracle_on_a_steady_world_is_the_best_mixture():
    world = TailWorld(lambda t: 0.04, steps=3)
    rates = rates_table(world)
    assert np.all(np.diff(rates, axis=1) > 0)  # straggling grows with G
    best = oracle(rates, world.candidates, 0.2)
    lo, hi, share = best_mixture(rates[0], U, 0.2)
    assert best["log2_G"][0] == pytest.approx(U[lo] + share * (U[hi] - U[lo]))
    assert best["rate"][0] == pytest.approx(0.2)
    np.testing.assert_allclose(best["allowed"], 0.2)


# ---------------------------------------------------------------- failure modes of the paper's SAGC


def test_every_group_is_a_trial_and_a_played_group_informs_smaller_rungs():
    c = plus(g_init=16)
    assert c.propose() == 16
    lengths = np.full((16, 16), 100, dtype=np.int64)
    lengths[:4, 0] = 1000  # 4 of 16 groups straggle, each through its first rollout
    c.observe(StepObservation.of_groups(lengths))
    # G=16: 16 trials, 4 straggling. G=8: chunks [0:8] and [8:16], the first straggles in those
    # 4 groups -> 4 x 1/2. G=4: 1 of 4 chunks -> 4 x 1/4.
    np.testing.assert_allclose(c.trials, [16, 16, 16])
    np.testing.assert_allclose(c.straggled, [1.0, 2.0, 4.0])
    # batch scope: one trial per step, for each rung the share of its chunks that straggle
    b = SAGCPlusController(ControllerConfig(g_init=16, scope="batch"))
    b.propose()
    b.observe(StepObservation.of_groups(lengths))
    np.testing.assert_allclose(b.trials, [1, 1, 1])
    np.testing.assert_allclose(b.straggled, [0.25, 0.5, 1.0])


def test_an_unplayed_smaller_rung_is_chosen_when_the_played_larger_one_breaks_the_budget():
    c = plus(delta=0.2, g_init=16)
    rng = np.random.default_rng(0)
    assert c.propose() == 16
    # q = 0.04: G=16 straggles about 0.48 of the time, G=4 about 0.15
    c.observe(StepObservation.of_groups(tail_lengths(rng, 16, 16, 0.04)))
    p = c.estimate()
    assert p[0] <= p[1] <= p[2]  # the unplayed rungs do not look riskier than the played one
    assert c.propose() < 16  # left at once, not after the tens of steps SAGC's multiplier needs
    gs, ss = drive(c, lambda t: 0.04, 60, rng)
    assert 4 in gs and np.mean(gs == 16) < 0.1
    assert ss[10:].mean() <= 0.2 + 0.03


def test_an_unplayed_larger_rung_is_extrapolated_pessimistically_and_then_tried():
    c = plus(delta=0.3, g_init=4)
    rng = np.random.default_rng(1)
    c.propose()
    c.observe(
        StepObservation.of_groups(tail_lengths(rng, 64, 4, 0.01))
    )  # G=4 straggles ~0.04: every G fits 0.3
    p = c.estimate()
    assert p[0] < p[1] < p[2]  # the tail model grows with G
    gs, _ = drive(c, lambda t: 0.01, 20, rng)
    assert gs[-1] == 16 and int(np.argmax(gs == 16)) <= 10


def test_the_budget_acts_within_ten_steps_of_a_rise():
    c = plus(delta=0.2, g_init=16)
    rng = np.random.default_rng(2)
    gs, _ = drive(c, lambda t: 0.002, 40, rng)
    assert np.all(gs[-20:] == 16)  # every G is safe: the largest
    gs, ss = drive(c, lambda t: 0.05, 60, rng)  # now G=16 breaks 0.2 by far (~0.55)
    assert int(np.argmax(gs != 16)) < 10
    assert ss[10:].mean() <= 0.2 + 0.03  # and the long-run rate meets delta, not around it


def test_no_wind_up_after_an_infeasible_stretch():
    c = plus(delta=0.2, g_init=8)
    rng = np.random.default_rng(3)
    gs, ss = drive(c, lambda t: 0.3, 40, rng)  # even G=4 straggles ~0.4
    assert np.all(gs[5:] == 4) and ss[5:].mean() > 0.3
    assert c.slack == pytest.approx(-c.plus.hysteresis)  # the debt is clipped, not accumulated
    gs, _ = drive(c, lambda t: 0.002, 20, rng)  # every G safe again
    assert int(np.argmax(gs == 16)) <= 10


def test_long_run_rate_meets_delta_with_few_rung_changes():
    c = plus(delta=0.2, g_init=8)
    gs, ss = drive(c, lambda t: 0.03, 300, np.random.default_rng(4), num_groups=64)
    assert abs(ss[10:].mean() - 0.2) <= 0.02
    assert set(gs[10:]) >= {4, 8}  # a mixture of the two rungs around delta
    assert np.count_nonzero(np.diff(gs)) < 300 / 4  # a dwell, not a flip every step


def test_decisions_are_deterministic_and_resume_exactly():
    def run(restore_at, mid_step):
        c = plus(delta=0.25)
        rng = np.random.default_rng(5)
        q = lambda t: 0.01 + 0.0004 * t  # noqa: E731
        gs, _ = drive(c, q, restore_at, rng)
        if mid_step:
            c.propose()
        state = c.state_dict()
        for key, value in state.items():
            assert isinstance(value, np.ndarray | int | float | str), key
        restored = plus(delta=0.25)
        restored.load_state_dict(state)
        later, _ = drive(restored, lambda t: q(t + restore_at), 100 - restore_at, rng)
        return np.concatenate([gs, later])

    straight = run(100, False)
    np.testing.assert_array_equal(straight, run(37, False))
    np.testing.assert_array_equal(straight, run(37, True))
    assert len(set(straight.tolist())) > 1  # the trajectory moves, so the check can fail


def test_state_of_the_paper_controller_is_rejected():
    state = make_controller("sagc").state_dict()
    with pytest.raises(ValueError, match="SAGCPlusController"):
        make_controller("sagc_plus").load_state_dict(state)


def test_config_and_spec():
    cfg = load_config(None, ["controller.kind=sagc_plus", "controller.sagc_plus.hysteresis=0.5"])
    c = make_controller(cfg.controller)
    assert isinstance(c, SAGCPlusController) and c.plus.hysteresis == 0.5
    assert isinstance(make_controller("sagc_plus", ControllerConfig()), SAGCPlusController)


def test_meets_the_bars_against_the_oracle_on_short_worlds():
    """A quick slice of benchmarks/controller_quality.py: 80 steps, 16 groups per step."""
    for q_of_step, delta in [
        (lambda t: 0.04, 0.2),
        (lambda t: 0.2, 0.3),  # heavy tail: even G=4 breaks delta
        (lambda t: 0.1 if t < 40 else 0.01, 0.2),  # sudden shift down
    ]:
        world = TailWorld(q_of_step, steps=80, prompts_per_step=16, seed=7)
        best = oracle(rates_table(world), world.candidates, delta)
        c = plus(delta=delta)
        gs, ss = [], []
        for t in range(80):
            g = c.propose()
            ss.append(c.observe(StepObservation.of_groups(world.lengths(t, g)))["s_t"])
            gs.append(g)
        assert np.mean(ss[10:]) - best["allowed"][10:].mean() <= 0.03
        assert best["log2_G"][10:].mean() - np.log2(gs[10:]).mean() <= 0.3
