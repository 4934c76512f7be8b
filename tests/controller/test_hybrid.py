"""The prompt-aware hybrid controller: per-prompt table, predictor, allocation, resume (numpy),
and training with it: prompt ids, both modes, mixed group sizes, exact resume."""

import dataclasses
import json

import chex
import numpy as np
import pytest

from sagc_jax.config import (
    ConfigError,
    ControllerConfig,
    HybridConfig,
    SAGCConfig,
    load_config,
)
from sagc_jax.controller import (
    HybridController,
    PromptStats,
    SAGCController,
    StepObservation,
    StragglePredictor,
    allocate,
    check_ragged_lengths,
    group_ratios,
    make_controller,
    parse_controller_spec,
    ragged_median_ratio,
)
from sagc_jax.planning.choices import check_names

LADDER = (4, 8, 16)


def tail_groups(rng, q_p, sizes_p):
    """Groups of lengths 100, each rollout a tail (1000) with its prompt's probability q_p."""
    return [np.where(rng.random(g) < q, 1000, 100) for q, g in zip(q_p, sizes_p, strict=True)]


def difficulty_of(ids):
    """A difficulty in [0, 1] for two prompts in three, unknown (nan) for the third."""
    return np.where(ids % 3, ids / 50, np.nan)


def drive(ctrl, q_pool, steps, rng, num_prompts=16, lengths_pool=None):
    """``steps`` steps over a pool with per-prompt tail probabilities; returns the decisions."""
    decisions = []
    for _ in range(steps):
        ids = rng.choice(q_pool.size, num_prompts, replace=False)
        plen = None if lengths_pool is None else lengths_pool[ids]
        d = ctrl.propose_for(ids, plen, None if plen is None else difficulty_of(ids))
        sizes = np.full(num_prompts, d) if np.ndim(d) == 0 else d
        ctrl.observe(StepObservation.of_rollouts(tail_groups(rng, q_pool[ids], sizes)))
        decisions.append(np.atleast_1d(d).copy())
    return decisions


# ---------------------------------------------------------------- the per-prompt table


def visit(stats, step, ids, tails, rollouts, median=100.0, ratio=1.0, straggle=0.0, **kw):
    n = len(ids)
    stats.update(
        step,
        np.asarray(ids),
        tails_p=np.full(n, tails, dtype=float),
        rollouts_p=np.full(n, rollouts, dtype=float),
        median_p=np.full(n, median),
        ratio_p=np.full(n, ratio),
        straggle_p=np.full(n, straggle),
        prompt_length_p=np.full(n, 50),
        **kw,
    )


def test_table_update_decays_per_visit():
    stats = PromptStats(capacity=8, decay=0.5)
    visit(stats, 0, [7], tails=2, rollouts=8, median=100.0, ratio=4.0, straggle=1.0)
    visit(stats, 3, [7], tails=0, rollouts=4, median=400.0, ratio=1.0, straggle=0.0)
    rec = {k: v[0] for k, v in stats.record([7]).items()}
    # decayed sums: weight 0.5 * 1 + 1 = 1.5; tails 0.5 * 2 + 0 = 1; rollouts 0.5 * 8 + 4 = 8
    assert rec["visits"] == 2 and rec["last_seen"] == 3
    assert rec["tail_rate"] == pytest.approx(1 / 8)
    assert rec["ratio"] == pytest.approx((0.5 * 4 + 1) / 1.5)
    assert rec["straggle_rate"] == pytest.approx(0.5 / 1.5)
    assert rec["median"] == pytest.approx(np.exp((0.5 * np.log(100) + np.log(400)) / 1.5))
    assert np.isnan(rec["pass_rate"])
    visit(stats, 4, [7], tails=0, rollouts=4, pass_rate_p=np.array([0.25]))
    assert stats.record([7])["pass_rate"][0] == pytest.approx(0.25)
    unknown = stats.record([99])
    assert unknown["visits"][0] == 0 and np.isnan(unknown["tail_rate"][0])


def test_table_pools_a_prompt_repeated_within_a_step():
    stats = PromptStats(capacity=8, decay=0.5)
    stats.update(
        0,
        np.array([5, 5]),
        tails_p=np.array([1.0, 3.0]),
        rollouts_p=np.array([4.0, 4.0]),
        median_p=np.array([100.0, 100.0]),
        ratio_p=np.array([2.0, 4.0]),
        straggle_p=np.array([0.0, 1.0]),
        prompt_length_p=np.array([10, 10]),
    )
    assert len(stats) == 1 and stats.visits[0] == 1
    assert stats.record([5])["tail_rate"][0] == pytest.approx(4 / 8)
    assert stats.record([5])["ratio"][0] == pytest.approx(3.0)


def test_table_evicts_least_recently_seen_and_stays_bounded():
    stats = PromptStats(capacity=4, decay=0.5)
    nbytes = sum(a.nbytes for a in (stats.ids, stats.last_seen, *stats.sums.values()))
    visit(stats, 0, [10, 11, 12, 13], tails=0, rollouts=4)
    visit(stats, 1, [11, 13], tails=1, rollouts=4)  # 10 and 12 are now the oldest
    visit(stats, 2, [20, 21], tails=0, rollouts=4)
    assert sorted(stats._index) == [11, 13, 20, 21] and stats.evictions == 2
    assert stats.lookup([10, 12]).tolist() == [-1, -1]
    assert stats.record([20])["visits"][0] == 1  # a reused slot starts afresh
    # all four seen at step 2 or 1: 11 (slot 1) and 13 (slot 3) tie at step 1 -> lower slot goes
    visit(stats, 3, [30], tails=0, rollouts=4)
    assert 11 not in stats._index and 13 in stats._index
    for step in range(4, 40):
        visit(stats, step, [100 + step, 200 + step], tails=0, rollouts=4)
        assert len(stats) <= 4 and len(stats._index) == len(stats)
    assert sum(a.nbytes for a in (stats.ids, stats.last_seen, *stats.sums.values())) == nbytes
    with pytest.raises(ValueError, match="exceed controller.hybrid.capacity = 4"):
        visit(stats, 50, [1, 2, 3, 4, 5], tails=0, rollouts=4)


def test_table_state_round_trip_is_exact():
    rng = np.random.default_rng(0)
    stats = PromptStats(capacity=16, decay=0.7)
    for step in range(30):
        ids = rng.choice(40, 6, replace=False)
        visit(stats, step, ids, tails=float(rng.integers(0, 3)), rollouts=8.0)
    restored = PromptStats(capacity=16, decay=0.7)
    restored.load_state_dict(stats.state_dict())
    for key, value in stats.state_dict().items():
        np.testing.assert_array_equal(restored.state_dict()[key], value, err_msg=key)
    assert restored._index == stats._index
    with pytest.raises(ValueError, match="capacity"):
        PromptStats(capacity=8).load_state_dict(stats.state_dict())


# ---------------------------------------------------------------- the predictor


def observe_prompts(pred, step, ids, plen, tails, rollouts):
    n = len(ids)
    sizes = np.full(n, rollouts, dtype=np.int64)
    pred.update(
        step,
        np.asarray(tails, dtype=float),
        sizes,
        np.asarray(tails) > 0,
        {"ids": np.asarray(ids), "lengths": np.asarray(plen), "difficulty": None},
        np.full(n, 100.0),
        np.full(n, 1.0),
    )


def test_predictor_falls_back_prompt_then_feature_bin_then_global():
    cfg = HybridConfig(prior_strength=4.0, length_bins=(100, 1000))
    pred = StragglePredictor(cfg, LADDER, gamma=1.0)
    assert pred.global_rate == 0.05  # (0 + 0.05) / (0 + 1) before any observation
    # prompts 1, 2 (short, bin 0) see tails; prompt 3 (long, bin 1) none
    observe_prompts(pred, 0, [1, 2, 3], [50, 60, 5000], tails=[2, 0, 0], rollouts=8)
    q_g = (2 + 0.05) / (24 + 1)
    assert pred.global_rate == pytest.approx(q_g)
    q_short = (2 + 4 * q_g) / (16 + 4)
    q_long = (0 + 4 * q_g) / (8 + 4)
    a, b = pred.tail_posterior([1, 9, 8, 7], [50, 70, 5000, 500])
    q = a / (a + b)
    assert q[0] == pytest.approx((2 + 4 * q_short) / (8 + 4))  # seen: its own history
    assert q[1] == pytest.approx(q_short)  # unseen, short: its feature bin
    assert q[2] == pytest.approx(q_long)
    assert q[3] == pytest.approx(q_g)  # unseen, in a bin nobody has been seen in: global
    risk = pred.straggle_probability([1, 9, 8, 7], [50, 70, 5000, 500])
    np.testing.assert_allclose(risk, 1 - (1 - q[:, None]) ** np.array(LADDER))
    assert np.all(np.diff(risk, axis=1) > 0)  # more rollouts, likelier to straggle


def test_predictor_is_calibrated_where_the_truth_is_known():
    """Independent tails with per-prompt probability q: the truth is 1 - (1 - q)^G.

    The prompts do not change, so the test forgets nothing (decay 1); with the default 0.5 a
    prompt's record holds about 16 rollouts, too few to rank prompts this close.
    """
    rng = np.random.default_rng(3)
    q_pool = rng.uniform(0.0, 0.08, size=128)
    pred = StragglePredictor(HybridConfig(decay=1.0), LADDER, gamma=0.95)
    g = 8
    predicted, truth, observed = [], [], []
    for step in range(240):  # 30 epochs of the pool
        ids = rng.permutation(128)[:32]
        p_hat = pred.straggle_at(ids, np.full(32, -1), None, np.full(32, g))
        tails = np.array(
            [np.count_nonzero(grp == 1000) for grp in tail_groups(rng, q_pool[ids], [g] * 32)]
        )
        if step >= 80:
            predicted.append(p_hat)
            truth.append(1 - (1 - q_pool[ids]) ** g)
            observed.append(tails > 0)
        observe_prompts(pred, step, ids, np.full(32, -1), tails, g)
    predicted, truth, observed = map(np.concatenate, (predicted, truth, observed))
    assert abs(predicted.mean() - observed.mean()) < 0.02
    assert np.corrcoef(predicted, truth)[0, 1] > 0.85  # it tells risky prompts from safe ones
    cal = pred.calibration()
    assert cal["groups"] == 240 * 32 and cal["ece"] < 0.05
    bulk = cal["count"] >= 1000  # sparse top bins hold the prompts that looked worst by chance
    assert bulk.sum() >= 4
    np.testing.assert_allclose(cal["mean_predicted"][bulk], cal["observed_rate"][bulk], atol=0.05)


# ---------------------------------------------------------------- allocation


def risk_values(q_p, lam):
    g = np.array(LADDER, dtype=float)
    return np.log2(g)[None, :] - lam * (1 - (1 - q_p[:, None]) ** g[None, :])


def test_allocation_sums_to_the_budget_with_ladder_sizes_only():
    rng = np.random.default_rng(0)
    for trial in range(200):
        ladder = (4, 8, 16) if trial % 2 else (2, 3, 8, 12)
        p = int(rng.integers(2, 40))
        budget = int(rng.integers(p * ladder[0], p * ladder[-1] + 1))
        if ladder == (4, 8, 16):
            budget -= budget % 4
        value = rng.normal(size=(p, len(ladder))) + np.log2(ladder)
        try:
            rung = allocate(value, ladder, max(budget, p * ladder[0]))
        except ValueError as err:
            assert "cannot be reached exactly" in str(err)
            continue
        sizes = np.asarray(ladder)[rung]
        assert sizes.sum() == max(budget, p * ladder[0]) and set(sizes) <= set(ladder)
    with pytest.raises(ValueError, match="must lie in \\[8, 32\\]"):
        allocate(np.zeros((2, 3)), LADDER, 40)
    with pytest.raises(ValueError, match="cannot be reached exactly"):
        allocate(np.zeros((1, 3)), LADDER, 12)
    # greedy stuck at [8, 16, 8] (36 - 32 = 4 left, no upgrade of 4 rows): fixed by a swap
    rung = allocate(risk_values(np.zeros(3), 0.0), LADDER, 36)
    assert sorted(np.asarray(LADDER)[rung].tolist()) == [4, 16, 16]


def test_allocation_gives_risky_prompts_smaller_groups():
    q_p = np.array([0.0, 0.05, 0.002, 0.03, 0.01, 0.04, 0.0, 0.02])
    for lam in (0.0, 2.0, 5.0, 20.0):
        sizes = np.asarray(LADDER)[allocate(risk_values(q_p, lam), LADDER, 8 * len(q_p))]
        order = np.argsort(q_p, kind="stable")
        assert np.all(np.diff(sizes[order]) <= 0), (lam, sizes)
        if lam == 0.0:
            assert np.all(sizes == 8)  # log2 is concave: no risk price, equal groups
    assert sizes.min() == 4 and sizes.max() == 16  # the price is felt
    # deterministic, ties to the earlier prompt
    twins = allocate(risk_values(np.zeros(3), 1.0), LADDER, 28)
    assert np.asarray(LADDER)[twins].tolist() == [16, 8, 4]


# ---------------------------------------------------------------- mixed-size observation


def test_mixed_size_observation_equals_per_group_computation():
    rng = np.random.default_rng(1)
    sizes = np.array([4, 16, 8, 4, 8, 16, 1, 2])
    groups = [rng.integers(0, 500, size=g) for g in sizes]
    groups[1][3] = 5000
    flat, got_sizes = check_ragged_lengths(np.concatenate(groups), sizes)
    np.testing.assert_array_equal(got_sizes, sizes)
    med, ratio = ragged_median_ratio(flat, sizes)
    for p, grp in enumerate(groups):
        assert med[p] == np.median(grp)
        assert ratio[p] == grp.max() / max(1.0, np.median(grp))
    padded = np.zeros((sizes.size, 16), dtype=np.int64)
    for p, grp in enumerate(groups):
        padded[p, : grp.size] = grp
    for form, gs in ((groups, None), (padded, sizes)):
        f2, s2 = check_ragged_lengths(form, gs)
        np.testing.assert_array_equal(f2, flat)
        np.testing.assert_array_equal(s2, sizes)
    uniform = rng.integers(0, 900, size=(5, 8))
    _, r = ragged_median_ratio(uniform.ravel(), np.full(5, 8))
    np.testing.assert_array_equal(r, group_ratios(uniform))  # bit for bit
    with pytest.raises(ValueError, match="do not match group_sizes"):
        check_ragged_lengths(flat[:-1], sizes)
    with pytest.raises(ValueError, match="do not fit group_sizes"):
        check_ragged_lengths(padded[:, :8], sizes)


def test_per_prompt_observe_reports_the_fraction_of_straggling_groups():
    ctrl = HybridController(ControllerConfig(tau=3.0), HybridConfig(mode="per_prompt"))
    sizes = ctrl.propose_for(np.arange(4), np.full(4, 64))
    assert sizes.tolist() == [8, 8, 8, 8]  # step 0: the middle rung, no price yet
    groups = [np.full(8, 100) for _ in range(4)]
    groups[2][0] = 400  # 400 / 100 > 3
    m = ctrl.observe(StepObservation.of_rollouts(np.concatenate(groups), sizes))
    assert m["s_t"] == 0.25 and m["group_sizes"].tolist() == [8, 8, 8, 8]
    np.testing.assert_array_equal(m["group_ratios"], [1.0, 1.0, 4.0, 1.0])


# ---------------------------------------------------------------- the controller


@pytest.mark.parametrize("mode", ["step", "per_prompt"])
@pytest.mark.parametrize("mid_step", [False, True])
def test_state_dict_restores_exact_decisions(mode, mid_step):
    rng_q = np.random.default_rng(5)
    q_pool = rng_q.uniform(0.0, 0.15, size=48)
    lengths_pool = rng_q.integers(20, 3000, size=48)
    budget, cfg = ControllerConfig(delta=0.25), HybridConfig(seed=9, mode=mode, capacity=32)
    original = HybridController(budget, cfg)  # evictions too
    drive(original, q_pool, 40, np.random.default_rng(0), lengths_pool=lengths_pool)
    ids16 = np.arange(16)
    if mid_step:
        original.propose_for(ids16, lengths_pool[:16], difficulty_of(ids16))
    state = original.state_dict()
    for key, value in state.items():
        assert isinstance(value, np.ndarray | int | float | str), key
        if isinstance(value, np.ndarray | float):  # checkpoints keep it as JSON: no nan
            assert np.all(np.isfinite(value)), key
    restored = HybridController(budget, dataclasses.replace(cfg, seed=123))
    restored.load_state_dict(state)
    if mid_step:  # the pending proposal survives, and its observation continues the run
        for ctrl in (original, restored):
            d = ctrl.propose_for(ids16, lengths_pool[:16], difficulty_of(ids16))
            sizes = np.full(16, d) if np.ndim(d) == 0 else d
            groups = tail_groups(np.random.default_rng(2), q_pool[:16], sizes)
            ctrl.observe(StepObservation.of_rollouts(groups))
    a = drive(original, q_pool, 40, np.random.default_rng(1), lengths_pool=lengths_pool)
    b = drive(restored, q_pool, 40, np.random.default_rng(1), lengths_pool=lengths_pool)
    chex.assert_trees_all_equal(b, a)
    assert original.lam == restored.lam and original.predictor.stats.evictions > 0
    chex.assert_trees_all_equal(restored.state_dict(), original.state_dict())
    with pytest.raises(ValueError, match="mode"):
        other = "step" if mode == "per_prompt" else "per_prompt"
        HybridController(budget, dataclasses.replace(cfg, mode=other)).load_state_dict(state)


def test_step_mode_without_prediction_is_sagc():
    rng = np.random.default_rng(0)
    hybrid = HybridController(hybrid=HybridConfig(seed=4, prediction_weight=0.0))
    sagc = SAGCController(config=SAGCConfig(seed=4))
    q_pool = rng.uniform(0, 0.1, size=32)
    for _ in range(80):
        ids = rng.choice(32, 8, replace=False)
        g = sagc.propose()
        assert hybrid.propose_for(ids) == g
        groups = tail_groups(rng, q_pool[ids], [g] * 8)
        sagc.observe(StepObservation.of_groups(np.stack(groups)))
        hybrid.observe(StepObservation.of_groups(np.stack(groups)))
    np.testing.assert_array_equal(hybrid.alpha, sagc.alpha)
    assert hybrid.lam == sagc.lam


def test_step_mode_prefers_small_groups_for_risky_prompts():
    """Same posteriors and price: a step of risky prompts is likelier to get a smaller G."""
    rng = np.random.default_rng(2)
    q_pool = np.concatenate([np.full(64, 0.002), np.full(64, 0.12)])
    ctrl = HybridController(
        ControllerConfig(delta=0.3), HybridConfig(seed=1, prediction_weight=30.0)
    )
    drive(ctrl, q_pool, 120, rng)
    state = ctrl.state_dict()
    picks = {}
    for name, ids in (("safe", np.arange(16)), ("risky", np.arange(64, 80))):
        gs = []
        for seed in range(60):
            trial = HybridController(hybrid=HybridConfig(prediction_weight=30.0))
            trial.load_state_dict(
                {**state, "rng": SAGCController(config=SAGCConfig(seed=seed)).state_dict()["rng"]}
            )
            gs.append(trial.propose_for(ids))
        picks[name] = np.mean(np.log2(gs))
    assert picks["risky"] < picks["safe"]


def test_proposal_protocol_and_errors():
    ctrl = HybridController(hybrid=HybridConfig(mode="per_prompt", rows_per_step=40))
    with pytest.raises(RuntimeError, match="propose_for"):
        ctrl.propose()
    with pytest.raises(RuntimeError, match="before propose_for"):
        ctrl.observe(StepObservation.of_rollouts(np.ones(40, int), np.full(4, 10)))
    with pytest.raises(ValueError, match="must lie in"):
        ctrl.propose_for(np.arange(2))  # 2 prompts cannot take 40 rows from [4, 8, 16]
    sizes = ctrl.propose_for(np.arange(4), np.array([10, 20, 30, 40]))
    assert sizes.sum() == 40
    np.testing.assert_array_equal(ctrl.propose_for(np.arange(4), np.array([10, 20, 30, 40])), sizes)
    with pytest.raises(RuntimeError, match="other prompts"):
        ctrl.propose_for(np.arange(1, 5), np.array([10, 20, 30, 40]))
    with pytest.raises(ValueError, match="differ from the proposed"):
        ctrl.observe(StepObservation.of_rollouts(np.ones(40, int), np.array([16, 16, 4, 4])))
    with pytest.raises(ValueError, match="prompt_ids differ"):
        ctrl.observe(
            StepObservation.of_rollouts(np.ones(40, int), sizes, prompt_ids=np.arange(1, 5))
        )
    with pytest.raises(ValueError, match="integer array"):
        HybridController().propose_for(np.array([0.5, 1.5]))
    m = ctrl.observe(
        StepObservation.of_rollouts(np.ones(40, int), sizes, rewards=np.ones(40))
    )  # the rejected calls changed nothing
    assert m["step"] == 0 and ctrl.predictor.stats.record([0])["pass_rate"][0] == 1.0
    step = HybridController()
    g = step.propose()  # step mode keeps the plain protocol
    assert step.observe(StepObservation.of_groups(np.ones((3, g), int)))["group_size"] == g


def test_controller_specs_and_config():
    assert parse_controller_spec("hybrid") == ("hybrid", None)
    assert parse_controller_spec("hybrid:step") == ("hybrid", "step")
    assert parse_controller_spec("hybrid:per_prompt") == ("hybrid", "per_prompt")
    for bad in ("hybrid:", "hybrid:fast", "hybrids", "hybrid:step:2", "sagc:", "fixed:0"):
        with pytest.raises(ConfigError) as err:
            parse_controller_spec(bad)
        msg = str(err.value)
        assert msg.count("\n") == 0 and f"controller spec {bad!r} is not allowed" in msg
        assert "'hybrid:per_prompt'" in msg
    cfg = load_config(None, ["sim.controllers=[sagc,hybrid:per_prompt]", "controller.kind=hybrid"])
    assert cfg.sim.controllers == ("sagc", "hybrid:per_prompt")
    ctrl = make_controller(cfg.controller)
    assert isinstance(ctrl, HybridController) and ctrl.mode == "step"
    assert make_controller("hybrid:per_prompt", cfg.controller).mode == "per_prompt"
    assert make_controller(ControllerConfig(kind="fixed", group_size=4)).propose() == 4
    bad = ["sim.controllers=[hybrid:x]"]
    msg = str(pytest.raises(ConfigError, load_config, None, bad, check_names).value)
    assert "controller spec 'hybrid:x' is not allowed" in msg
    msg = str(pytest.raises(ConfigError, load_config, None, ["controller.hybrid.mode=fast"]).value)
    assert "choose one of ['step', 'per_prompt']" in msg
    msg = str(
        pytest.raises(ConfigError, load_config, None, ["controller.hybrid.length_bins=[8,4]"]).value
    )
    assert "strictly increasing" in msg


# --------------------------------------------------------------------------- in the trainer

HYBRID_TINY = [
    "controller.kind=hybrid",
    "data.prompt_pool=4",
    "logging.tensorboard=false",
]


def trainer_config(*overrides):
    from helpers import TINY

    return load_config(None, [*TINY, *HYBRID_TINY, *overrides])


def test_synthetic_prompt_pool_is_revisited_every_epoch_in_a_seeded_order():
    from sagc_jax.tasks.source import SyntheticSource

    def ids(cfg, steps, shard=0, shards=1):
        source = SyntheticSource(cfg, shard_index=shard, num_shards=shards, log=lambda _: None)
        return [p.id for step in range(steps) for p in source.batch(step, 0, 2)]

    cfg = trainer_config("data.prompt_pool=4")
    seen = ids(cfg, 6)  # three epochs of the pool of 4
    assert seen == ids(cfg, 6)  # a pure function of (step, round, index)
    for epoch in range(3):
        assert sorted(seen[4 * epoch : 4 * epoch + 4]) == [0, 1, 2, 3]
    assert seen[:4] != seen[4:8] or seen[4:8] != seen[8:]  # each epoch its own order
    # a second process gets its share of the same global order
    halves = [ids(cfg, 6, shard, 2) for shard in (0, 1)]
    assert [x for pair in zip(*halves, strict=True) for x in pair] == seen
    # the same id is the same problem, whatever the epoch
    source = SyntheticSource(cfg, log=lambda _: None)
    texts = {}
    for step in range(6):
        for p in source.batch(step, 0, 2):
            assert texts.setdefault(p.id, p.text) == p.text
    # with a curriculum the pool index is still the id, capped by the step
    curriculum = trainer_config("data.prompt_pool=4", "data.curriculum_steps=4")
    assert ids(curriculum, 6) == seen
    # no pool: the endless stream of new problems, id = its position
    assert ids(trainer_config("data.prompt_pool=0"), 3) == list(range(6))


def test_dataset_prompt_ids_are_row_indices(tmp_path):
    from helpers import RAW_ROWS, write_word_tokenizer

    from sagc_jax.programs.policy import build_tokenizer
    from sagc_jax.tasks.source import DatasetSource

    write_word_tokenizer(tmp_path / "tok")
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"what is {a} plus 1", "answer": str(a + 1)} for a in range(5)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = trainer_config(
        "data.task=dataset", *RAW_ROWS, f"data.path={data}", f"model.tokenizer={tmp_path}/tok"
    )
    tok = build_tokenizer(cfg)
    source = DatasetSource(cfg, tok, log=lambda _: None)
    prompts = [p for step in range(5) for p in source.batch(step, 0, 2)]
    for p in prompts:
        assert p.text == rows[p.id]["prompt"]
    assert sorted(p.id for p in prompts[:5]) == [0, 1, 2, 3, 4]  # every row once an epoch
    shard = DatasetSource(cfg, tok, shard_index=1, num_shards=2, log=lambda _: None)
    assert sorted(r.index for r in shard.rows) == [1, 3]  # rows of the file, not of the shard


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, extra, programs",
    [
        ("step", [], 2),  # at most one rollout program per candidate G
        ("per_prompt", ["controller.hybrid.rows_per_step=6"], 1),  # one per budget
        ("per_prompt", [], 2),  # budget level G_t chosen among the candidates
    ],
)
def test_the_trainer_trains_with_the_hybrid_controller(tmp_path, mode, extra, programs):
    from sagc_jax.train.loop import Trainer

    cfg = trainer_config("train.steps=3", f"controller.hybrid.mode={mode}", *extra)
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.run(progress=False)
    trainer.close()
    assert trainer.sampler.num_traces <= programs
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "group_size" in r]
    assert len(steps) == 3 and trainer.controller.step == 3
    assert len(trainer.controller.predictor.stats) == 4  # the pool, seen through the ids
    for r in steps:
        sizes = [len(group) for group in r["lengths"]]
        assert r["prompts"] == len(sizes) == 2
        if mode == "step":
            assert r["group_size"] in (2, 4) and set(sizes) == {r["group_size"]}
        else:
            assert r["group_sizes"] == sizes and r["group_size"] == np.mean(sizes)
        if extra:
            assert sum(sizes) == 6


@pytest.mark.slow
def test_hybrid_resume_continues_exactly(tmp_path):
    from sagc_jax.train.loop import Trainer

    common = ["controller.hybrid.mode=per_prompt", "controller.hybrid.rows_per_step=6"]
    run = lambda steps, where: Trainer(  # noqa: E731
        trainer_config(*common, f"train.steps={steps}", "train.checkpoint_every=2"), where
    )
    straight = run(4, tmp_path / "straight")
    straight.run(progress=False)
    straight.close()
    first = run(2, tmp_path / "resumed")
    first.run(progress=False)
    first.close()
    meta = json.loads((tmp_path / "resumed/checkpoints/2/meta/metadata").read_text())
    assert not any(k.startswith("predictor_table_ids") for k in meta["controller"])  # in Orbax
    assert (tmp_path / "resumed/checkpoints/2/prompt_table").is_dir()
    second = run(4, tmp_path / "resumed")
    assert second.step == 2 and len(second.controller.predictor.stats) == 4
    second.run(progress=False)
    second.close()
    chex.assert_trees_all_equal(second.state.params, straight.state.params)
    chex.assert_trees_all_equal(second.controller.state_dict(), straight.controller.state_dict())


@pytest.mark.parametrize(
    "extra, message",
    [
        (["train.batch_mode=budget"], "needs train.batch_mode = prompts"),
        (["loss.dynamic_sampling=true"], "loss.dynamic_sampling"),
        (
            ["controller.hybrid.mode=per_prompt", "controller.hybrid.rows_per_step=20"],
            "rows_per_step = 20 cannot be split into train.prompts_per_step = 2 groups",
        ),
    ],
)
def test_the_trainer_refuses_what_the_hybrid_cannot_train(tmp_path, extra, message):
    from sagc_jax.train.loop import Trainer

    with pytest.raises(ConfigError) as err:
        Trainer(trainer_config(*extra), tmp_path / "run")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo"])
def test_a_mixed_size_step_equals_its_groups_computed_one_by_one(algorithm):
    from types import SimpleNamespace

    from sagc_jax.rl import ALGORITHMS, group_advantages, loss_normalizer, policy_loss
    from sagc_jax.train.loop import Trainer

    aggregation, scale_by_std = (
        ALGORITHMS[algorithm].aggregation,
        ALGORITHMS[algorithm].scale_by_std,
    )
    rng = np.random.default_rng(0)
    sizes_p = np.array([4, 2, 8, 2])
    n, t = int(sizes_p.sum()), 6
    rewards = rng.integers(0, 2, n).astype(np.float32)
    rewards[4:6] = 1.0  # an all-equal group: zero advantage
    trainer = SimpleNamespace(scale_by_std=scale_by_std)
    adv, zero_variance_p = Trainer._advantages(trainer, rewards, sizes_p)
    bounds = np.cumsum(sizes_p)[:-1]
    for p, (r, a) in enumerate(zip(np.split(rewards, bounds), np.split(adv, bounds), strict=True)):
        alone, stats = group_advantages(r, np.zeros(len(r), int), 1, scale_by_std=scale_by_std)
        np.testing.assert_allclose(a, alone, rtol=1e-6, atol=1e-7)
        assert zero_variance_p[p] == bool(stats["zero_variance_p"][0])
    assert zero_variance_p[1]
    # the loss: the whole step's normaliser, so the groups' losses sum to the step's
    logp = rng.normal(size=(n, t)).astype(np.float32) * 0.1 - 1.0
    old = logp + rng.normal(size=(n, t)).astype(np.float32) * 0.05
    mask = (np.arange(t)[None, :] < rng.integers(1, t + 1, n)[:, None]).astype(np.float32)
    norm = loss_normalizer(mask, aggregation, max_new_tokens=t)
    kw = dict(aggregation=aggregation, eps_low=0.2, eps_high=0.28)
    whole, _ = policy_loss(logp, old, adv, mask, norm, **kw)
    parts = [
        policy_loss(lp, o, a, m, norm, **kw)[0]
        for lp, o, a, m in zip(*(np.split(x, bounds) for x in (logp, old, adv, mask)), strict=True)
    ]
    np.testing.assert_allclose(float(whole), float(sum(parts)), rtol=1e-5)
