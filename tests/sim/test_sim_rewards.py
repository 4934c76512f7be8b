"""The synthetic workload's rewards (a success model that may rise over training) and the
value-aware controller (sagc_value) in the simulator."""

import numpy as np

from sagc_jax.config import load_config
from sagc_jax.config.sim import SimConfig
from sagc_jax.sim import StepTimer, SyntheticWorkload, compare
from sagc_jax.sim.report import format_table, summary_rows

CUSTOM = StepTimer(SimConfig(hardware="custom"))


def test_rewards_are_the_successes_of_the_same_draws():
    cfg = SimConfig(prompts_per_step=64, runaway_prob=0.0, max_new_tokens=10**6)
    w = SyntheticWorkload(cfg)
    rewards, lengths = w.rewards(3, 8), w.lengths(3, 8)
    assert rewards.shape == lengths.shape and set(np.unique(rewards)) <= {0.0, 1.0}
    np.testing.assert_array_equal(w.rewards(3, 16)[:, :8], rewards)  # common random numbers
    # a failed completion is the longer one (failure_length_ratio 3): per prompt, the failed
    # ones' mean length exceeds the successful ones'
    both = [
        (lengths[p][rewards[p] == 0].mean(), lengths[p][rewards[p] == 1].mean())
        for p in range(64)
        if 0 < rewards[p].sum() < 8
    ]
    assert np.mean([bad > good for bad, good in both]) > 0.9
    # without success_mean_end the lengths are the calibrated ones: the success draw is unchanged
    same = SyntheticWorkload(SimConfig(prompts_per_step=64, success_mean_end=None))
    np.testing.assert_array_equal(
        same.lengths(5, 4), SyntheticWorkload(SimConfig(prompts_per_step=64)).lengths(5, 4)
    )


def test_success_rises_with_success_mean_end():
    w = SyntheticWorkload(
        SimConfig(
            steps=100,
            prompts_per_step=256,
            success_mean=0.05,
            success_mean_end=0.6,
            runaway_prob=0.0,
        )
    )
    assert w.success_mean_at(0) == 0.05 and abs(w.success_mean_at(99) - 0.6) < 1e-12
    early = np.mean([w.rewards(t, 4).mean() for t in range(5)])
    late = np.mean([w.rewards(t, 4).mean() for t in range(95, 100)])
    assert early < 0.1 and late > 0.5


def test_simulate_gives_sagc_value_the_rewards_and_tables_the_signal():
    cfg = load_config(
        "configs/sim/reasoning_drift.yaml",
        [
            "sim.steps=40",
            "sim.prompts_per_step=16",
            "sim.success_mean=0.03",
            "sim.controllers=[fixed:4,fixed:16,sagc_plus,sagc_value]",
            "controller.delta=0.5",
            "sim.hardware=custom",
        ],
    )
    runs = compare(cfg, SyntheticWorkload(cfg.sim), CUSTOM)
    rows = {r["controller"]: r for r in summary_rows(runs)}
    assert rows["fixed:16"]["signal_share"] > rows["fixed:4"]["signal_share"]  # sparse rewards
    assert rows["sagc_value"]["signal_groups_per_h"] > 0
    assert "groups with signal per modeled h" in format_table(list(rows.values()), "custom")
