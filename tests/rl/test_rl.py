"""Advantages, losses and DAPO shaping against hand-computed values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sagc_jax.rl import (
    ALGORITHMS,
    completion_mask,
    group_advantages,
    informative_groups,
    kl_k3,
    loss_normalizer,
    overlong_penalty,
    policy_loss,
)

REWARDS = np.array([1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 0], np.float32)
GROUPS = np.repeat(np.arange(3), 4)


def test_group_advantages_by_hand():
    adv, stats = group_advantages(REWARDS, GROUPS, 3)
    s0 = np.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, 0, 0, 0, 0, -0.5, -0.5, 1.5, -0.5]
    np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(stats["zero_variance_p"], [False, True, False])
    np.testing.assert_allclose(stats["mean_p"], [0.5, 1.0, 0.25])


@pytest.mark.parametrize("value", [0.7, 1 / 3, 0.1, 0.35, -0.45, 1.0])
@pytest.mark.parametrize("group_size", [4, 8, 16, 32, 64])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_all_equal_groups_get_exactly_zero_advantage(value, group_size, scale_by_std):
    """Values float32 does not represent exactly (DAPO's overlong shaping makes them) used to
    leave a one-ulp mean error that the std then blew up to advantages of 0.05-0.3."""
    rewards = np.concatenate([np.full(group_size, value), [0.0, 1.0] * (group_size // 2)])
    groups = np.repeat(np.arange(2), group_size)
    adv, stats = group_advantages(rewards.astype(np.float32), groups, 2, scale_by_std=scale_by_std)
    np.testing.assert_array_equal(np.asarray(adv)[:group_size], 0.0)
    np.testing.assert_array_equal(stats["zero_variance_p"], [True, False])
    assert np.all(np.abs(np.asarray(adv)[group_size:]) > 0.1)


def test_dr_grpo_advantages_are_centred_only():
    adv, _ = group_advantages(REWARDS, GROUPS, 3, scale_by_std=False)
    np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -0.25, -0.25, 0.75, -0.25])


def test_group_advantages_need_no_layout():
    """Shuffled rows and unequal group sizes give the same per-row advantages."""
    perm = np.random.default_rng(0).permutation(len(REWARDS))
    adv, _ = group_advantages(REWARDS, GROUPS, 3)
    adv_perm, _ = group_advantages(REWARDS[perm], GROUPS[perm], 3)
    np.testing.assert_allclose(adv_perm, np.asarray(adv)[perm], rtol=1e-6)
    # groups of sizes 2 and 3 (G is not hard-wired)
    adv, _ = group_advantages(np.array([1, 0, 2, 2, 5.0]), np.array([0, 0, 1, 1, 1]), 2)
    np.testing.assert_allclose(adv[:2], [0.5 / np.sqrt(0.5), -0.5 / np.sqrt(0.5)], rtol=1e-5)
    np.testing.assert_allclose(
        adv[2:], [-1 / np.sqrt(3), -1 / np.sqrt(3), 2 / np.sqrt(3)], rtol=1e-5
    )


MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
ADV = np.array([1.0, -2.0], np.float32)
ZEROS = np.zeros((2, 4), np.float32)
KW = dict(aggregation="token_mean", eps_low=0.2, eps_high=0.28)


@pytest.mark.parametrize(
    "aggregation, expected",
    [("token_mean", 1 / 5), ("seq_mean", 1 / 2), ("constant", 1 / (2 * 8))],
)
def test_loss_at_ratio_one_by_hand(aggregation, expected):
    # per-token terms -A: seq0 three tokens of -1 (sum -3), seq1 two tokens of +2 (sum +4)
    norm = loss_normalizer(MASK, aggregation, max_new_tokens=8)
    loss, metrics = policy_loss(
        ZEROS, ZEROS, ADV, MASK, norm, aggregation=aggregation, eps_low=0.2, eps_high=0.28
    )
    assert float(loss) == pytest.approx(expected)
    assert float(metrics["clip_fraction"]) == 0.0 and float(metrics["ratio_mean"]) == 1.0


def test_clip_higher_by_hand():
    """ratio 1.5: positive advantages are capped at 1 + eps_high, negative ones are not."""
    logp = np.full((2, 1), np.log(1.5), np.float32)
    old = np.zeros((2, 1), np.float32)
    mask = np.ones((2, 1), np.float32)
    adv = np.array([1.0, -1.0], np.float32)
    loss, metrics = policy_loss(
        logp,
        old,
        adv,
        mask,
        jnp.float32(1.0),
        aggregation="token_mean",
        eps_low=0.2,
        eps_high=0.28,
    )
    assert float(loss) == pytest.approx(-1.28 + 1.5, rel=1e-6)
    assert float(metrics["clip_fraction"]) == pytest.approx(0.5)


def test_gradients_vanish_where_clipped():
    old = np.zeros((1, 3), np.float32)
    logp = np.log(np.array([[1.0, 1.5, 0.5]], np.float32))  # inside, above, below the range
    mask = np.ones((1, 3), np.float32)

    def f(lp, adv):
        return policy_loss(
            lp,
            old,
            adv,
            mask,
            jnp.float32(3.0),
            aggregation="token_mean",
            eps_low=0.2,
            eps_high=0.2,
        )[0]

    g_pos = jax.grad(f)(logp, jnp.array([2.0]))
    # d(-ratio * A / 3)/dlogp = -ratio * A / 3 where unclipped; 0 above 1 + eps for A > 0
    np.testing.assert_allclose(g_pos, [[-2.0 / 3, 0.0, -0.5 * 2.0 / 3]], rtol=1e-6)
    g_neg = jax.grad(f)(logp, jnp.array([-2.0]))
    # A < 0: the clip binds below 1 - eps (0.5 < 0.8), so that token gets no gradient
    np.testing.assert_allclose(g_neg, [[2.0 / 3, 1.5 * 2.0 / 3, 0.0]], rtol=1e-6)


def test_masked_tokens_equal_the_subset():
    rng = np.random.default_rng(0)
    logp = rng.normal(size=(2, 4)).astype(np.float32) * 0.1
    old = rng.normal(size=(2, 4)).astype(np.float32) * 0.1
    for agg in ("token_mean", "seq_mean", "constant"):
        full = policy_loss(
            logp,
            old,
            ADV,
            MASK,
            loss_normalizer(MASK, agg, 8),
            aggregation=agg,
            eps_low=0.2,
            eps_high=0.2,
        )[0]
        # garbage in masked positions changes nothing
        noisy = np.where(MASK > 0, logp, 50.0).astype(np.float32)
        same = policy_loss(
            noisy,
            old,
            ADV,
            MASK,
            loss_normalizer(MASK, agg, 8),
            aggregation=agg,
            eps_low=0.2,
            eps_high=0.2,
        )[0]
        np.testing.assert_allclose(full, same, rtol=1e-6)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "constant"])
def test_minibatch_losses_sum_to_the_full_batch(aggregation):
    rng = np.random.default_rng(1)
    mask = (np.arange(6)[None] < rng.integers(1, 7, size=(8, 1))).astype(np.float32)
    logp = rng.normal(size=(8, 6)).astype(np.float32) * 0.2
    old = rng.normal(size=(8, 6)).astype(np.float32) * 0.2
    adv = rng.normal(size=8).astype(np.float32)
    norm = loss_normalizer(mask, aggregation, 6)
    kw = dict(aggregation=aggregation, eps_low=0.2, eps_high=0.28)
    full = policy_loss(logp, old, adv, mask, norm, **kw)[0]
    parts = sum(
        policy_loss(logp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], norm, **kw)[0]
        for i in range(0, 8, 2)
    )
    np.testing.assert_allclose(full, parts, rtol=1e-5)


def test_kl_k3():
    assert float(kl_k3(jnp.float32(0.3), jnp.float32(0.3))) == 0.0
    assert float(kl_k3(jnp.float32(0.0), jnp.log(2.0))) == pytest.approx(1 - np.log(2.0))
    logp = jnp.zeros((1, 2))
    ref = jnp.log(jnp.full((1, 2), 2.0))
    mask = jnp.ones((1, 2))
    args = (logp, logp, jnp.zeros(1), mask, 2.0)
    kw = dict(aggregation="token_mean", eps_low=0.2, eps_high=0.2)
    base = policy_loss(*args, **kw)[0]
    with_kl, m = policy_loss(*args, **kw, kl_beta=0.1, ref_logp_bt=ref)
    assert float(with_kl - base) == pytest.approx(0.1 * (1 - np.log(2.0)), rel=1e-5)
    assert float(m["kl"]) == pytest.approx(1 - np.log(2.0), rel=1e-5)
    with pytest.raises(ValueError, match="ref_logp_bt"):
        policy_loss(*args, **kw, kl_beta=0.1)


def test_overlong_penalty_by_hand():
    np.testing.assert_allclose(
        overlong_penalty([10, 80, 90, 100, 120], max_new_tokens=100, buffer_tokens=20, factor=1.0),
        [0, 0, -0.5, -1, -1],
    )
    np.testing.assert_array_equal(overlong_penalty([100], 100, 0), [0])


def test_informative_groups_and_completion_mask():
    np.testing.assert_array_equal(
        informative_groups([[1, 1], [0, 1], [0, 0]]), [False, True, False]
    )
    mask = completion_mask([2, 4, 0], width=4, truncated_b=[False, True, False])
    np.testing.assert_array_equal(mask, [[1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "call, message",
    [
        # a [B, T] advantage would broadcast to [B, B, T] terms: a loss, and no error
        (lambda: policy_loss(ZEROS, ZEROS, ZEROS, MASK, 1.0, **KW), "assert_shape"),
        (lambda: policy_loss(ZEROS.astype(jnp.bfloat16), ZEROS, ADV, MASK, 1.0, **KW), "bfloat16"),
        (lambda: policy_loss(ZEROS, ZEROS[:, :3], ADV, MASK, 1.0, **KW), "different shapes"),
        # rewards [1, B] would give [B, B] advantages
        (lambda: group_advantages(REWARDS[None], GROUPS, 3), "rank 2"),
        (lambda: group_advantages(REWARDS, GROUPS.astype(np.float32), 3), "float32"),
    ],
    ids=["advantage per token", "bfloat16 log-probs", "ragged", "rewards row", "float groups"],
)
def test_wrong_shapes_and_dtypes_are_refused_at_the_boundary(call, message):
    """Checked when traced (under jit: once per program, not per call)."""
    with pytest.raises(AssertionError, match=message):
        call()
    with pytest.raises(AssertionError, match=message):
        jax.jit(call)()


def test_every_algorithm_names_a_registered_aggregation():
    from sagc_jax.rl.losses import AGGREGATIONS

    assert all(a.aggregation in AGGREGATIONS for a in ALGORITHMS.values())
