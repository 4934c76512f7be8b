"""sagc-jax's GRPO/DAPO loss conventions against Tunix's own code (google-tunix 0.1.7).

Each test is a row of docs/tunix-conventions.md: where the conventions are the same, both sides
run on the same log-probs, masks and rewards and agree to 1e-5 (float32), gradients included;
where they differ, the test asserts the difference itself, so a change on either side fails here.
Tunix's registered GRPO policy loss (DAPO uses the same one) runs unmodified: only
``tunix.rl.common.compute_per_token_logps``, which it calls for the current log-probs, is
replaced by a function that returns the test's array, so no model is needed.

Skipped without Tunix (the optional extra ``tunix``: ``pip install -e '.[dev,tunix]'``). The
measured differences print with ``-s``:

    .venv/bin/python -m pytest -q -s tests/rl/test_tunix_conventions.py
"""

from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sagc_jax.config import LossConfig
from sagc_jax.programs.update import completion_logprobs
from sagc_jax.rl import (
    ALGORITHMS,
    completion_mask,
    group_advantages,
    kl_k3,
    loss_normalizer,
    overlong_penalty,
    policy_loss,
)

_REASON = "google-tunix is not installed; it is the peer these loss conventions are checked against"
algo_core = pytest.importorskip("tunix.rl.algo_core", reason=_REASON)
common = pytest.importorskip("tunix.rl.common", reason=_REASON)
function_registry = pytest.importorskip("tunix.rl.function_registry", reason=_REASON)
grpo_learner = pytest.importorskip("tunix.rl.grpo.grpo_learner", reason=_REASON)
dapo_learner = pytest.importorskip("tunix.rl.grpo.dapo_learner", reason=_REASON)
tunix_generate_utils = pytest.importorskip("tunix.generate.utils", reason=_REASON)

TOL = 1e-5
PAD, EOS = 0, 1
G, P, T, V = 4, 3, 6, 5  # group size, prompts, completion width, vocab of the dummy logits
# group 2 is all-equal; row 4 (group 1, non-zero advantage) has an empty completion
REWARDS_B = np.array([1.0, 0.0, 0.5, 1.0, 0.2, 0.9, 0.1, 0.4, 0.7, 0.7, 0.7, 0.7])
LENGTHS_B = np.array([6, 3, 1, 5, 0, 4, 2, 6, 6, 3, 5, 1])
GROUPS_B = np.repeat(np.arange(P), G)


def _max_abs(name: str, ours, theirs) -> float:
    """Max |ours - theirs| (printed with ``-s`` for the docs table)."""
    diff = float(np.max(np.abs(np.asarray(ours, np.float64) - np.asarray(theirs, np.float64))))
    print(f"tunix-conventions: {name}: max |diff| = {diff:.2e}")
    return diff


def _batch(seed: int = 0):
    """Per-token log-probs [B, T] (current, old, reference), mask, advantages and logits.

    The current log-probs are 0.5 nats (sd) off the old ones, so ratios reach both sides of the
    clip range for both advantage signs; off the mask all three hold unrelated finite values.
    """
    rng = np.random.default_rng(seed)
    b = len(REWARDS_B)
    old_bt = -rng.uniform(0.1, 3.0, (b, T))
    logp_bt = old_bt + rng.normal(0.0, 0.5, (b, T))
    ref_bt = old_bt + rng.normal(0.0, 0.3, (b, T))
    mask_bt = completion_mask(LENGTHS_B, T)
    for x_bt in (old_bt, logp_bt, ref_bt):
        x_bt[mask_bt == 0] = -rng.uniform(0.0, 8.0, int(np.sum(mask_bt == 0)))
    adv_b, _ = group_advantages(REWARDS_B.astype(np.float32), GROUPS_B, P)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    logits_btv = f32(rng.normal(size=(b, T, V)))
    return f32(logp_bt), f32(old_bt), f32(ref_bt), f32(mask_bt), f32(adv_b), logits_btv


class _NoModel(nnx.Module):
    """Stands in for the policy: Tunix's loss only splits it and passes the halves to
    ``compute_per_token_logps``, which the tests replace."""


def _tunix_loss(monkeypatch, cfg, logp_bt, old_bt, ref_bt, mask_bt, adv_b, logits_btv):
    """(loss, aux) of Tunix's registered policy loss ``cfg.policy_loss_fn`` on these arrays.

    ``old_bt`` / ``ref_bt`` None as Tunix passes them with num_iterations = 1 / beta = 0.
    """
    calls = []

    def per_token_logps(graphdef, state, **kwargs):
        calls.append(kwargs)
        return logp_bt, logits_btv

    monkeypatch.setattr(common, "compute_per_token_logps", per_token_logps)
    live_bt = np.asarray(mask_bt) > 0
    completion_ids = jnp.asarray(np.where(live_bt, 7, PAD), jnp.int32)
    example = common.TrainExample(
        prompt_ids=jnp.full((len(live_bt), 2), 3, jnp.int32),
        prompt_mask=jnp.ones((len(live_bt), 2), bool),
        completion_ids=completion_ids,
        completion_mask=completion_ids != PAD,  # as grpo_learner.py:256 builds it
        advantages=adv_b,
        ref_per_token_logps=ref_bt,
        old_per_token_logps=old_bt,
    )
    loss_fn = function_registry.get_policy_loss_fn(cfg.policy_loss_fn)
    loss, aux = loss_fn(_NoModel(), example, algo_config=cfg, pad_id=PAD, eos_id=EOS)
    # the replaced function is the one the loss looks up, called as in training
    assert len(calls) == 1
    assert calls[0]["stop_gradient"] is False and calls[0]["return_logits"] is True
    assert calls[0]["temperature"] == cfg.temperature
    return loss, aux


def _grpo_config(**kwargs):
    cfg = grpo_learner.GRPOConfig(num_generations=G, **kwargs)
    cfg.temperature = 1.0  # GRPOLearner sets it from the rollout config (grpo_learner.py:169)
    return cfg


def _dapo_config(**kwargs):
    cfg = dapo_learner.DAPOConfig(num_generations=G, **kwargs)
    cfg.temperature = 1.0
    return cfg


def test_defaults():
    """GRPO and DAPO defaults on both sides (the table's default columns)."""
    versions = {p: metadata.version(p) for p in ("google-tunix", "jax", "flax")}
    print(f"tunix-conventions: versions {versions}")
    ours = LossConfig()
    assert (ours.algorithm, ours.eps_low, ours.eps_high, ours.kl_beta) == ("grpo", 0.2, 0.2, 0.0)
    assert (ALGORITHMS["grpo"].aggregation, ALGORITHMS["grpo"].scale_by_std) == ("seq_mean", True)
    assert (ALGORITHMS["dapo"].aggregation, ALGORITHMS["dapo"].scale_by_std) == ("token_mean", True)
    grpo = grpo_learner.GRPOConfig()
    assert (grpo.loss_agg_mode, grpo.epsilon, grpo.beta, grpo.kl_loss_mode) == (
        "sequence-mean-token-mean",
        0.2,
        0.04,
        "kl",
    )
    assert grpo.num_iterations == 1 and grpo.advantage_estimator == "grpo"
    # no epsilon_high field: grpo_loss_fn falls back to epsilon (algo_core.py:371-375)
    assert not hasattr(grpo, "epsilon_high") and not hasattr(grpo, "epsilon_c")
    dapo = dapo_learner.DAPOConfig()
    assert (dapo.loss_agg_mode, dapo.epsilon, dapo.epsilon_high, dapo.beta) == (
        "token-mean",
        0.2,
        0.28,
        None,
    )
    assert dapo.policy_loss_fn == "grpo" and dapo.advantage_estimator == "grpo"
    assert dapo.overlong_buffer["overlong_buffer_length"] == 4096
    assert dapo.overlong_buffer["max_response_length"] == 20480


def test_advantages_match_tunix_grpo_estimator():
    """(r - mean) / (std(ddof=1) + 1e-6) per group on both sides; all-equal groups give 0."""
    ours, _ = group_advantages(REWARDS_B.astype(np.float32), GROUPS_B, P)
    estimator = function_registry.get_advantage_estimator("grpo")
    theirs = estimator(rewards=REWARDS_B, num_generations=G)  # float64, as reward_manager.py:127
    assert _max_abs("advantages", ours, theirs) < TOL
    assert np.all(np.asarray(ours)[8:] == 0.0) and np.all(np.abs(theirs[8:]) < TOL)
    # the std is unbiased on both sides: ddof=0 would move group 0's advantages by 0.20
    r = REWARDS_B[:4]
    assert np.max(np.abs((r - r.mean()) / (r.std() + 1e-6) - theirs[:4])) > 0.1
    # the eps is added to the std on both sides: on a spread of 1e-3 it is 0.2% of the std,
    # where inside the sqrt it would halve the advantages
    small = np.array([0.0, 1e-3, 0.0, 1e-3])
    ours_small, _ = group_advantages(small.astype(np.float32), np.zeros(4, int), 1)
    theirs_small = estimator(rewards=small, num_generations=4)
    assert _max_abs("advantages, spread 1e-3", ours_small, theirs_small) < TOL
    in_sqrt = (small - small.mean()) / np.sqrt(small.var(ddof=1) + 1e-6)
    assert np.max(np.abs(in_sqrt - theirs_small)) > 0.1

    # Differences. Float32 rewards: Tunix's numpy mean of 64 x 0.7 is an ulp off, and the 1e-6
    # eps does not absorb it; ours decides "all equal" on the rewards (exactly 0). Tunix's own
    # reward manager sums in float64, where the same group gives 0.
    equal = np.full(64, 0.7)
    assert np.max(np.abs(estimator(rewards=equal.astype(np.float32), num_generations=64))) > 0.01
    assert np.max(np.abs(estimator(rewards=equal, num_generations=64))) < TOL
    ours_equal, _ = group_advantages(equal.astype(np.float32), np.zeros(64, int), 1)
    assert np.all(np.asarray(ours_equal) == 0.0)
    # one G per batch (reshape(-1, G)); ours takes groups of any sizes, a group of 1 included
    with pytest.raises(ValueError):
        estimator(rewards=np.arange(5.0), num_generations=2)
    with pytest.warns(RuntimeWarning):
        single = estimator(rewards=np.array([1.0, 2.0]), num_generations=1)
    assert np.all(np.isnan(single))
    with pytest.raises(ValueError):
        grpo_learner.GRPOConfig(num_generations=1)
    ours_mixed, _ = group_advantages(np.array([1.0, 0.0, 2.0], np.float32), np.array([0, 0, 1]), 2)
    np.testing.assert_allclose(
        ours_mixed, [0.5 / np.sqrt(0.5), -0.5 / np.sqrt(0.5), 0.0], rtol=1e-5
    )


def test_kl_estimators():
    """Ours is k3, Tunix's 'low_var_kl'; Tunix's default 'kl' is k1 (log-ratio), 'mse_kl' k2."""
    logp_bt, _, ref_bt, mask_bt, _, _ = _batch()
    live = np.asarray(mask_bt) > 0
    ours = np.asarray(kl_k3(logp_bt, ref_bt))[live]
    k3 = np.asarray(common.compute_kl_divergence(logp_bt, ref_bt, "low_var_kl"))[live]
    assert _max_abs("k3 per token", ours, k3) < TOL
    k1 = np.asarray(common.compute_kl_divergence(logp_bt, ref_bt, "kl"))[live]
    np.testing.assert_allclose(k1, np.asarray(logp_bt - ref_bt)[live], atol=TOL)
    assert np.max(np.abs(k1 - ours)) > 0.1 and np.min(k1) < 0.0 <= np.min(ours)
    k2 = np.asarray(common.compute_kl_divergence(logp_bt, ref_bt, "mse_kl"))[live]
    np.testing.assert_allclose(k2, 0.5 * np.asarray(logp_bt - ref_bt)[live] ** 2, atol=TOL)


def _check_clip_is_active(logp_bt, old_bt, mask_bt, adv_b, eps_low, eps_high):
    """The batch has tokens clipped above (A > 0) and below (A < 0): the clip is tested."""
    ratio_bt = np.exp(np.asarray(logp_bt - old_bt))
    live_bt, adv_bt = np.asarray(mask_bt) > 0, np.asarray(adv_b)[:, None]
    assert np.any(live_bt & (ratio_bt > 1 + eps_high) & (adv_bt > 0))
    assert np.any(live_bt & (ratio_bt < 1 - eps_low) & (adv_bt < 0))
    assert np.any(live_bt & (ratio_bt > 1 + eps_high) & (adv_bt < 0))  # unclipped side, A < 0


def test_grpo_loss_matches_tunix(monkeypatch):
    """seq_mean with eps 0.2 and k3 KL (beta 0.04) against Tunix's grpo loss with
    sequence-mean-token-mean and kl_loss_mode='low_var_kl': values, gradients and metrics."""
    logp_bt, old_bt, ref_bt, mask_bt, adv_b, logits_btv = _batch()
    _check_clip_is_active(logp_bt, old_bt, mask_bt, adv_b, 0.2, 0.2)
    beta = 0.04
    cfg = _grpo_config(beta=beta, kl_loss_mode="low_var_kl")
    normalizer = loss_normalizer(mask_bt, "seq_mean")  # 11: the empty row does not count

    def ours(lp):
        return policy_loss(
            lp, old_bt, adv_b, mask_bt, normalizer, aggregation="seq_mean", eps_low=0.2,
            eps_high=0.2, kl_beta=beta, ref_logp_bt=ref_bt,
        )  # fmt: skip

    def theirs(lp, logits=logits_btv, config=cfg):
        return _tunix_loss(monkeypatch, config, lp, old_bt, ref_bt, mask_bt, adv_b, logits)

    (loss, metrics), grad = jax.jit(jax.value_and_grad(ours, has_aux=True))(logp_bt)
    (t_loss, aux), t_grad = jax.jit(jax.value_and_grad(theirs, has_aux=True))(logp_bt)
    assert _max_abs("grpo loss", loss, t_loss) < TOL
    assert _max_abs("grpo d loss / d logp", grad, t_grad) < TOL
    assert np.max(np.abs(grad)) > 1e-3  # the gradients compared are not all zero
    assert _max_abs("grpo clip fraction", metrics["clip_fraction"], aux["pg_clipfrac"]) < TOL
    assert _max_abs("grpo kl metric", metrics["kl"], aux["kl"]) < TOL
    assert _max_abs("grpo ratio mean", metrics["ratio_mean"], aux["is_ratio/mean"]) < TOL

    # Tunix's default KL mode, k1: the loss moves by beta x (agg(k1) - agg(k3)), nothing else
    k1_loss, _ = jax.jit(lambda lp: theirs(lp, config=_grpo_config(beta=beta)))(logp_bt)
    k1_bt, k3_bt = logp_bt - ref_bt, kl_k3(logp_bt, ref_bt)
    shift = beta * common.aggregate_loss(k1_bt - k3_bt, mask_bt, "sequence-mean-token-mean")
    assert abs(float(shift)) > 1e-3
    assert _max_abs("grpo loss with Tunix's k1 minus the k1-k3 term", k1_loss - loss, shift) < TOL

    # Entropy: Tunix reports it (aux['entropy']) and leaves it out of the loss; ours has none
    with_logits = jax.jit(lambda logits: theirs(logp_bt, logits=logits))
    base_loss, base_aux = with_logits(logits_btv)
    other_loss, other_aux = with_logits(3.0 * logits_btv)
    assert float(other_loss) == float(base_loss)
    assert abs(float(other_aux["entropy"]) - float(base_aux["entropy"])) > 0.1
    assert "entropy" not in metrics


def test_dapo_loss_matches_tunix(monkeypatch):
    """token_mean with eps 0.2 / 0.28 and no KL against Tunix's DAPOConfig defaults."""
    logp_bt, old_bt, ref_bt, mask_bt, adv_b, logits_btv = _batch(seed=1)
    _check_clip_is_active(logp_bt, old_bt, mask_bt, adv_b, 0.2, 0.28)
    normalizer = loss_normalizer(mask_bt, "token_mean")

    def ours(lp):
        return policy_loss(
            lp, old_bt, adv_b, mask_bt, normalizer, aggregation="token_mean", eps_low=0.2,
            eps_high=0.28,
        )  # fmt: skip

    def theirs(lp, ref=None):
        return _tunix_loss(monkeypatch, _dapo_config(), lp, old_bt, ref, mask_bt, adv_b, logits_btv)

    (loss, metrics), grad = jax.jit(jax.value_and_grad(ours, has_aux=True))(logp_bt)
    (t_loss, aux), t_grad = jax.jit(jax.value_and_grad(theirs, has_aux=True))(logp_bt)
    assert _max_abs("dapo loss", loss, t_loss) < TOL
    assert _max_abs("dapo d loss / d logp", grad, t_grad) < TOL
    assert np.max(np.abs(grad)) > 1e-3
    assert _max_abs("dapo clip fraction", metrics["clip_fraction"], aux["pg_clipfrac"]) < TOL
    # the clip-higher bound matters on this batch: a symmetric 0.2 clip gives another loss
    symmetric, _ = policy_loss(
        logp_bt, old_bt, adv_b, mask_bt, normalizer, aggregation="token_mean", eps_low=0.2,
        eps_high=0.2,
    )  # fmt: skip
    assert abs(float(symmetric) - float(t_loss)) > 1e-3
    # DAPOConfig.beta is None, yet the learner computes reference log-probs (grpo_learner.py:262
    # tests beta != 0.0); the loss then only logs their KL
    ref_loss, ref_aux = jax.jit(lambda lp: theirs(lp, ref_bt))(logp_bt)
    assert _max_abs("dapo loss with reference log-probs given", loss, ref_loss) < TOL
    assert float(ref_aux["kl"]) > 1e-3 and dapo_learner.DAPOConfig().beta != 0.0


def test_microbatch_normaliser(monkeypatch):
    """Ours divides by a whole-step count, so micro-batch losses sum to the full-batch loss;
    Tunix aggregates each micro-batch on its own and optax.MultiSteps averages their gradients
    (rl_cluster.py:140-142, peft_trainer.py:212-214), which differs when token counts differ."""
    logp_bt, old_bt, _, mask_bt, adv_b, logits_btv = _batch(seed=1)
    halves = (slice(0, 6), slice(6, 12))
    assert float(mask_bt[halves[0]].sum()) != float(mask_bt[halves[1]].sum())  # 19 and 23
    normalizer = loss_normalizer(mask_bt, "token_mean")

    def ours(rows):
        return policy_loss(
            logp_bt[rows], old_bt[rows], adv_b[rows], mask_bt[rows], normalizer,
            aggregation="token_mean", eps_low=0.2, eps_high=0.28,
        )[0]  # fmt: skip

    def theirs(rows):
        args = (logp_bt[rows], old_bt[rows], None, mask_bt[rows], adv_b[rows], logits_btv[rows])
        return _tunix_loss(monkeypatch, _dapo_config(), *args)[0]

    full = slice(0, 12)
    parts = sum(ours(rows) for rows in halves)
    assert _max_abs("micro-batches: our summed halves - full batch", parts, ours(full)) < TOL
    averaged = np.mean([theirs(rows) for rows in halves])
    assert (
        _max_abs("micro-batches: Tunix's mean of halves - full batch", averaged, theirs(full))
        > 1e-3
    )


def test_old_logps_when_one_iteration(monkeypatch):
    """With num_iterations = 1 Tunix passes no old log-probs and uses stop_gradient(current):
    ratio exactly 1. Ours with old = current (a sampler that matches the trainer) is the same."""
    logp_bt, _, _, mask_bt, adv_b, logits_btv = _batch(seed=2)
    normalizer = loss_normalizer(mask_bt, "seq_mean")

    def ours(lp):
        return policy_loss(
            lp, logp_bt, adv_b, mask_bt, normalizer, aggregation="seq_mean", eps_low=0.2,
            eps_high=0.2,
        )[0]  # fmt: skip

    def theirs(lp):
        return _tunix_loss(monkeypatch, _grpo_config(), lp, None, None, mask_bt, adv_b, logits_btv)

    loss, grad = jax.jit(jax.value_and_grad(ours))(logp_bt)
    (t_loss, aux), t_grad = jax.jit(jax.value_and_grad(theirs, has_aux=True))(logp_bt)
    assert float(aux["is_ratio/mean"]) == 1.0 and float(aux["pg_clipfrac"]) == 0.0
    assert _max_abs("one-iteration loss", loss, t_loss) < TOL
    assert _max_abs("one-iteration d loss / d logp", grad, t_grad) < TOL
    # the policy-gradient: -A / (tokens of the row) / (non-empty rows)
    tokens_b = np.maximum(np.asarray(mask_bt).sum(1, keepdims=True), 1)
    expected = -np.asarray(adv_b)[:, None] * np.asarray(mask_bt) / tokens_b / float(normalizer)
    np.testing.assert_allclose(t_grad, expected, atol=TOL)


def test_log_ratio_clamp_and_dual_clip(monkeypatch):
    """Two differences in the per-token term, both on negative advantages."""
    mask_bt, adv_b = jnp.ones((1, 1)), jnp.array([-1.0])
    old_bt, logits = jnp.full((1, 1), -30.0), jnp.zeros((1, 1, V))

    def ours(lp):
        return policy_loss(
            lp, old_bt, adv_b, mask_bt, 1.0, aggregation="token_mean", eps_low=0.2, eps_high=0.2
        )[0]

    ours_value_and_grad = jax.jit(jax.value_and_grad(ours))

    def both(log_ratio, cfg):
        """((loss, d loss / d logp), the same of Tunix) at this log-ratio, A = -1."""
        lp = old_bt + log_ratio

        def theirs(x):
            return _tunix_loss(monkeypatch, cfg, x, old_bt, None, mask_bt, adv_b, logits)[0]

        return ours_value_and_grad(lp), jax.jit(jax.value_and_grad(theirs))(lp)

    # Tunix clips the log-ratio to [-20, 20] before exp (algo_core.py:414); ours does not. At
    # log-ratio 19 the two agree; at 25 with A < 0 the loss is |A| e^25 here and |A| e^20 in
    # Tunix, whose gradient through the clamp is 0.
    (v, g), (tv, tg) = both(19.0, _dapo_config())
    np.testing.assert_allclose([v, g[0, 0]], [np.exp(19.0)] * 2, rtol=1e-5)
    np.testing.assert_allclose([tv, tg[0, 0]], [np.exp(19.0)] * 2, rtol=1e-5)
    (v, g), (tv, tg) = both(25.0, _dapo_config())
    np.testing.assert_allclose([v, g[0, 0]], [np.exp(25.0)] * 2, rtol=1e-5)
    np.testing.assert_allclose(tv, np.exp(20.0), rtol=1e-5)
    assert float(tg[0, 0]) == 0.0

    # Dual clip: off in Tunix unless epsilon_c is set (then A < 0 tokens cost at most
    # epsilon_c |A|); ours has none. Ratio 5 with A = -1: both 5 without, Tunix 3 with 3.
    (v, _), (tv, _) = both(float(np.log(5.0)), _grpo_config())
    assert abs(float(v) - 5.0) < TOL and abs(float(tv) - 5.0) < TOL
    dual = _grpo_config()
    dual.epsilon_c = 3.0
    (v, _), (tv, tg) = both(float(np.log(5.0)), dual)
    assert abs(float(v) - 5.0) < TOL and abs(float(tv) - 3.0) < TOL and float(tg[0, 0]) == 0.0


def test_masks_eos_and_off_mask_values(monkeypatch):
    """Which tokens are scored, and what the values off the mask can do."""
    # A completion "5 7 EOS" in a row of 6. Ours: length 3, EOS included (train/rollout.py:31).
    # Tunix: the sampler cuts the completion before the first EOS (sampler.py:943-951), the
    # learner pads it and masks ids != pad_id (grpo_learner.py:243-256).
    sampled = np.array([5, 7, EOS, 9, 9, 9])
    ours = completion_mask([3], T)[0]
    end = tunix_generate_utils.np_find_first_eos_idx(sampled, EOS)
    kept = tunix_generate_utils.pad_to_length(sampled[:end], T, PAD)
    theirs = np.not_equal(kept, PAD).astype(np.float32)
    np.testing.assert_array_equal(ours, [1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(theirs, [1, 1, 0, 0, 0, 0])
    # a sampled token that equals pad_id is unscored in Tunix; ours masks by length only
    sampled = np.array([5, PAD, 7, EOS, 9, 9])
    end = tunix_generate_utils.np_find_first_eos_idx(sampled, EOS)
    kept = tunix_generate_utils.pad_to_length(sampled[:end], T, PAD)
    np.testing.assert_array_equal(np.not_equal(kept, PAD), [1, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(completion_mask([4], T)[0], [1, 1, 1, 1, 0, 0])

    # Off the mask: ours replaces the values (ratio 1, KL 0 there), so no value there can reach
    # the loss or its gradient; Tunix multiplies the per-token terms by the mask, so finite
    # values vanish but a -inf reference log-prob (an infinite k3 term) makes the jitted loss
    # NaN (inf x 0; whether XLA rewrites a product with a bool mask as a select depends on the
    # program: op by op it does, in this jitted loss it does not).
    logp_bt, old_bt, ref_bt, mask_bt, adv_b, logits_btv = _batch(seed=3)
    bad_ref_bt = ref_bt.at[1, T - 1].set(-jnp.inf)
    assert float(mask_bt[1, T - 1]) == 0.0
    normalizer = loss_normalizer(mask_bt, "seq_mean")
    cfg = _grpo_config(kl_loss_mode="low_var_kl")

    def ours(lp, ref):
        return policy_loss(
            lp, old_bt, adv_b, mask_bt, normalizer, aggregation="seq_mean", eps_low=0.2,
            eps_high=0.2, kl_beta=cfg.beta, ref_logp_bt=ref,
        )[0]  # fmt: skip

    def theirs(lp, ref):
        return _tunix_loss(monkeypatch, cfg, lp, old_bt, ref, mask_bt, adv_b, logits_btv)[0]

    ours_value_and_grad = jax.jit(jax.value_and_grad(ours))
    theirs_value_and_grad = jax.jit(jax.value_and_grad(theirs))
    loss, grad = ours_value_and_grad(logp_bt, ref_bt)
    bad_loss, bad_grad = ours_value_and_grad(logp_bt, bad_ref_bt)
    assert float(bad_loss) == float(loss) and np.array_equal(bad_grad, grad)
    t_loss, t_grad = theirs_value_and_grad(logp_bt, ref_bt)
    assert _max_abs("masks: loss", loss, t_loss) < TOL
    assert _max_abs("masks: d loss / d logp", grad, t_grad) < TOL
    t_loss, _ = theirs_value_and_grad(logp_bt, bad_ref_bt)
    assert np.isnan(float(t_loss))


class _Bigram(nnx.Module):
    """Next-token logits from the current token alone (a [V, V] table): positions and
    attention masks, which the two callers build differently, do not change them."""

    def __init__(self, table_vv):
        self.table_vv = nnx.Param(table_vv)

    def __call__(self, tokens_bt, *, mask_bt=None, dropout_key=None, **tunix_kwargs):
        del dropout_key  # ours: LoRA dropout (None outside the update)
        logits_btv = self.table_vv[...][tokens_bt]
        return (logits_btv, None) if tunix_kwargs else logits_btv  # Tunix wants (logits, cache)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_temperature_and_alignment(temperature):
    """log_softmax(logits / temperature) of each completion token given what precedes it."""
    rng = np.random.default_rng(4)
    model = _Bigram(jnp.asarray(rng.normal(size=(V, V)), jnp.float32))
    prompt_bt = jnp.array([[PAD, 3, 4], [2, 3, 4]], jnp.int32)  # left-padded
    completion_bt = jnp.array([[2, 3, 4, EOS], [4, 4, PAD, PAD]], jnp.int32)
    ours = completion_logprobs(model, prompt_bt, jnp.array([2, 3]), completion_bt, temperature)
    graphdef, state = nnx.split(model)
    theirs = common.compute_per_token_logps(
        graphdef, state, prompt_bt, completion_bt, PAD, EOS, temperature=temperature
    )
    assert _max_abs(f"log-probs at temperature {temperature}", ours, theirs) < TOL
    # the temperature matters on these logits: at another one the log-probs move
    other = completion_logprobs(model, prompt_bt, jnp.array([2, 3]), completion_bt, 0.5)
    assert np.max(np.abs(np.asarray(other) - np.asarray(theirs))) > 0.01


def test_overlong_penalty_units():
    """DAPO's soft overlong punishment: ours counts tokens and stops at -factor; Tunix counts
    characters of the decoded text and keeps falling past the hard maximum."""
    buffer = {
        "overlong_buffer_length": 8,
        "overlong_buffer_penalty": 1.0,
        "max_response_length": 20,
    }
    lengths = np.array([10, 15, 18, 20, 25])
    ours = overlong_penalty(lengths, max_new_tokens=20, buffer_tokens=8)

    def theirs(texts):
        return np.array(dapo_learner.reward_shaping(["p"] * len(texts), texts, "train", buffer))

    one_char = theirs(["x" * n for n in lengths])  # one character per token: the same ramp
    assert _max_abs("overlong penalty, 1 character per token", ours[:4], one_char[:4]) < TOL
    np.testing.assert_allclose([ours[4], one_char[4]], [-1.0, -13 / 8], atol=TOL)
    four_chars = theirs(["abc " * n for n in lengths])  # a 4-character token: 4x the length
    np.testing.assert_allclose(four_chars, [-(4 * n - 12) / 8 for n in lengths], atol=TOL)


def test_dapo_dynamic_sampling_is_a_config_flag_only():
    """Tunix 0.1.7 declares DAPOConfig.dynamic_sampling (default True, a TODO) and reads it
    nowhere; ours samples again for groups whose rewards are all equal (loss.dynamic_sampling,
    train/loop.py with rl/shaping.py's informative_groups)."""
    rl_dir = Path(algo_core.__file__).parent
    users = [
        f"{path.relative_to(rl_dir)}:{n}"
        for path in sorted(rl_dir.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "dynamic_sampling" in line
    ]
    assert users == ["grpo/dapo_learner.py:49", "grpo/dapo_learner.py:65"], users
    assert LossConfig().dynamic_sampling is False
