"""The rollout-length workloads, the step-time model, replay and the simulate command."""

import json

import numpy as np
import pytest
from helpers import capture_figures, delta_lines, legend_labels

from sagc_jax.cli import main
from sagc_jax.config import load_config
from sagc_jax.config.sim import SimConfig
from sagc_jax.controller import FixedGroupController, make_controller
from sagc_jax.planning.timing import step_timer
from sagc_jax.sim import ReplayWorkload, StepTimer, SyntheticWorkload, compare, simulate_controller
from sagc_jax.sim.report import summary_rows

CUSTOM = StepTimer(SimConfig(hardware="custom"))  # timing does not matter to these tests


def test_common_random_numbers_across_group_sizes():
    w = SyntheticWorkload(SimConfig(prompts_per_step=8))
    big, small = w.lengths(5, 16), w.lengths(5, 4)
    assert big.shape == (8, 16) and small.shape == (8, 4)
    np.testing.assert_array_equal(big[:, :4], small)
    assert not np.array_equal(w.lengths(6, 4), small)  # other step, other rollouts


def test_lengths_drift_truncate_and_failures_are_longer():
    cfg = SimConfig(
        steps=100,
        prompts_per_step=64,
        median_start=100,
        median_end=400,
        max_new_tokens=600,
        failure_length_ratio=3.0,
        runaway_prob=0.0,
        group_sigma_end=None,
    )
    w = SyntheticWorkload(cfg)
    early = np.concatenate([w.lengths(t, 8).ravel() for t in range(10)])
    late = np.concatenate([w.lengths(t, 8).ravel() for t in range(90, 100)])
    assert np.median(late) > 2.5 * np.median(early)
    assert late.max() == 600 and early.min() >= 1
    runaway = SyntheticWorkload(SimConfig(prompts_per_step=64, runaway_prob=1.0))
    assert np.all(runaway.lengths(0, 4) == runaway.cfg.max_new_tokens)
    # all successes vs all failures: 3x the length for the same random numbers
    ok = SyntheticWorkload(
        SimConfig(success_mean=1.0, max_new_tokens=10**6, runaway_prob=0)
    ).lengths(0, 4)
    bad = SyntheticWorkload(
        SimConfig(success_mean=0.0, max_new_tokens=10**6, runaway_prob=0)
    ).lengths(0, 4)
    np.testing.assert_allclose(bad / ok, 3.0, rtol=0.05)  # ceil on short ones


def test_larger_groups_straggle_more_on_the_calibrated_workload():
    cfg = load_config("configs/sim/reasoning_drift.yaml")
    w = SyntheticWorkload(cfg.sim)
    rates = [
        simulate_controller(f"fixed:{g}", FixedGroupController(g, tau=3.0), w, CUSTOM).s_t.mean()
        for g in (4, 8, 16)
    ]
    assert rates[0] < rates[1] < rates[2]


def test_custom_step_time_model_by_hand():
    cfg = SimConfig(
        hardware="custom",
        slots=1,
        devices=2,
        prefill_token_seconds=0.001,
        decode_step_seconds=0.1,
        decode_seq_seconds=0.01,
        update_token_seconds=0.002,
        step_overhead_seconds=1.0,
    )
    lengths = np.array([[10, 20], [30, 40]])
    t = StepTimer(cfg)(lengths, prompt_tokens=5)
    assert t.synchronous == pytest.approx(0.001 * 4 * 5 + 40 * (0.1 + 0.01 * 4))
    # two slots (1 per chip x 2): 10 | 20, then 30 joins the first at 10 and 40 the second at
    # 20: 60 steps, each row's tokens once
    assert t.continuous == pytest.approx(0.001 * 4 * 5 + 60 * 0.1 + 0.01 * 100)
    # the sampler (sampling defaults: all 4 rows, rungs 4 and 2 over 2 chips): two prefills;
    # 39 iterations, 19 of 4 rows (4 or 3 running), then 20 of 2 (the last two, then the last)
    assert t.compacting == pytest.approx(0.001 * 2 * 5 + 39 * 0.1 + 0.01 * (4 * 19 + 2 * 20))
    assert t.update == pytest.approx(1.0 + 0.002 * (4 * 5 + 100))


@pytest.mark.slow
def test_sagc_meets_the_done_criteria_on_the_calibrated_workload():
    """SAGC near delta where fixed 16 is not, cheaper than fixed 16, larger G than fixed 4."""
    cfg = load_config("configs/sim/reasoning_drift.yaml")
    timer = step_timer(cfg, cfg.sim.prompt_tokens + cfg.sim.max_new_tokens, cfg.sim.max_new_tokens)
    assert timer.label == "qwen2.5-3b on 8 x h100"
    runs = compare(cfg, SyntheticWorkload(cfg.sim), timer)
    rows = {r["controller"]: r for r in summary_rows(runs)}
    delta = cfg.controller.delta
    assert abs(rows["sagc"]["straggler_rate"] - delta) <= 0.05
    assert rows["fixed:16"]["straggler_rate"] > delta + 0.1
    for regime in ("compacting_h", "synchronous_h", "continuous_h"):
        assert rows["sagc"][regime] < rows["fixed:16"][regime]
    # the sampler compacting its rows: between keeping every row and continuous batching
    for row in rows.values():
        assert row["continuous_h"] < row["compacting_h"] < row["synchronous_h"]
    assert rows["sagc"]["mean_log2_G"] > rows["fixed:4"]["mean_log2_G"]
    # SAGC+ keeps the budget SAGC overshoots, at a lower modeled time
    assert rows["sagc_plus"]["straggler_rate"] <= delta + 0.01
    assert rows["sagc_plus"]["synchronous_h"] < rows["sagc"]["synchronous_h"]


def test_simulate_command_writes_table_csv_and_plots(tmp_path, capsys, monkeypatch):
    figures = capture_figures(monkeypatch)
    out = tmp_path / "run"
    code = main(
        [
            "simulate",
            "--set",
            "sim.steps=30",
            "--set",
            "sim.prompts_per_step=8",
            "--set",
            f"logging.run_dir={out}",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    for name in ("fixed:4", "fixed:16", "sagc", "sagc_plus", "straggler rate", "mean log2 G"):
        assert name in printed
    for name in (
        "summary.csv",
        "steps.csv",
        "table.md",
        "config.yaml",
        "group_size.png",
        "lambda.png",
        "posterior_mean.png",
        "straggler_rate.png",
    ):
        assert (out / name).stat().st_size > 0, name
    steps_csv = (out / "steps.csv").read_text().splitlines()
    assert len(steps_csv) == 1 + 5 * 30  # five default controllers
    # the budget on the plots of straggling (delta_line, shared with report and compare)
    delta = load_config(out / "config.yaml").controller.delta
    for name in ("posterior_mean.png", "straggler_rate.png"):
        assert delta_lines(figures[name].axes[0]) == [delta], name
    assert "sagc G=16" in legend_labels(figures["posterior_mean.png"].axes[0])


def write_log(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_replay_first_g_then_bootstrap(tmp_path):
    log = write_log(
        tmp_path / "log.jsonl",
        [
            {"step": 0, "lengths": [[1, 2, 3, 4], [5, 6, 7, 8]], "reward": 0.5},
            {"step": 1, "lengths": [[9, 9, 9, 90], [1, 1, 1, 1]], "prompt_tokens": 10},
        ],
    )
    w = ReplayWorkload.from_file(log)
    assert w.num_steps == 2
    np.testing.assert_array_equal(w.lengths(0, 2), [[1, 2], [5, 6]])
    filled = w.lengths(0, 8)
    assert filled.shape == (2, 8) and not w.is_bootstrapped(0, 4) and w.is_bootstrapped(0, 8)
    np.testing.assert_array_equal(filled[:, :4], [[1, 2, 3, 4], [5, 6, 7, 8]])
    assert set(filled[0, 4:]) <= {1, 2, 3, 4} and set(filled[1, 4:]) <= {5, 6, 7, 8}
    np.testing.assert_array_equal(filled, ReplayWorkload.from_file(log).lengths(0, 8))  # seeded


def test_replay_reads_groups_of_mixed_sizes(tmp_path):
    """A hybrid per_prompt log: groups of their own sizes; a request beyond a group's size
    resamples that group's own lengths, and groups of one size replay as before."""
    log = write_log(tmp_path / "log.jsonl", [{"lengths": [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10]]}])
    w = ReplayWorkload.from_file(log)
    np.testing.assert_array_equal(w.lengths(0, 2), [[1, 2], [5, 6], [7, 8]])
    assert not w.is_bootstrapped(0, 2) and w.is_bootstrapped(0, 4)
    filled = w.lengths(0, 4)
    np.testing.assert_array_equal(filled[[0, 2]], [[1, 2, 3, 4], [7, 8, 9, 10]])
    np.testing.assert_array_equal(filled[1, :2], [5, 6])
    assert set(filled[1, 2:]) <= {5, 6}
    assert set(w.lengths(0, 6)[0, 4:]) <= {1, 2, 3, 4}
    # the resampling of equal groups is the same draw whichever way the sizes are stored
    equal = write_log(tmp_path / "equal.jsonl", [{"lengths": [[1, 2, 3, 4], [5, 6, 7, 8]]}])
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([0, 0])))
    picks = rng.integers(0, 4, size=(2, 4))
    logged = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    np.testing.assert_array_equal(
        ReplayWorkload.from_file(equal).lengths(0, 8)[:, 4:],
        np.take_along_axis(logged, picks, axis=1),
    )


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "log.jsonl:2: not valid JSON"),
        ("[1, 2]", "log.jsonl:2: expected a JSON object"),
        ('{"lengths": [[1, 2], []]}', "log.jsonl:2: 'lengths' must be"),
        ('{"lengths": [[1, 2.5]]}', "log.jsonl:2: 'lengths' must be"),
        ('{"lengths": [[1, -2]]}', "log.jsonl:2: 'lengths' must be"),
        ('{"lengths": [[1, 2]], "prompt_tokens": "x"}', "log.jsonl:2: 'prompt_tokens'"),
    ],
)
def test_replay_errors_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "log.jsonl"
    path.write_text('{"lengths": [[1, 2]]}\n' + line + "\n")
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        ReplayWorkload.from_file(path)


def test_replay_command(tmp_path, capsys):
    rng = np.random.default_rng(0)
    records = [{"lengths": rng.integers(1, 500, size=(8, 16)).tolist()} for _ in range(20)]
    log = write_log(tmp_path / "log.jsonl", records)
    out = tmp_path / "replay"
    assert main(["replay", "--log", str(log), "--set", f"logging.run_dir={out}"]) == 0
    printed = capsys.readouterr().out
    assert "replay: 20 steps" in printed and "bootstrapped steps" in printed
    assert (out / "summary.csv").exists()
    assert main(["replay", "--log", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read the replay log" in capsys.readouterr().err


# ---------------------------------------------------------------- prompt pool


def pool_config(**kw):
    base = dict(steps=40, prompts_per_step=8, prompt_pool=24, seed=3, prompt_heterogeneity=1.0)
    return SimConfig(**{**base, **kw})


def test_prompt_pool_revisits_every_prompt_once_per_epoch():
    w = SyntheticWorkload(pool_config())
    ids = np.concatenate([w.prompts(t)[0] for t in range(9)])  # 72 draws = 3 epochs of 24
    for epoch in range(3):
        assert sorted(ids[24 * epoch : 24 * (epoch + 1)].tolist()) == list(range(24))
    assert not np.array_equal(ids[:24], ids[24:48])  # a new order every epoch
    tokens = {}
    for t in range(9):
        for i, tok in zip(*w.prompts(t), strict=True):
            assert tokens.setdefault(int(i), int(tok)) == tok  # a prompt keeps its length
    big, small = w.lengths(5, 16), w.lengths(5, 4)
    np.testing.assert_array_equal(big[:, :4], small)  # common random numbers
    np.testing.assert_array_equal(w.prompts(5)[0], SyntheticWorkload(pool_config()).prompts(5)[0])


def test_prompt_pool_straggle_tendency_persists_across_epochs():
    cfg = pool_config(steps=600, prompt_pool=64, runaway_prob=0.02, prompt_heterogeneity=1.5)
    w = SyntheticWorkload(cfg)
    runaway = np.zeros((2, 64))  # runaways per prompt in the first and second half
    for t in range(600):
        ids, _ = w.prompts(t)
        np.add.at(runaway[t // 300], ids, (w.lengths(t, 8) == cfg.max_new_tokens).sum(1))
    assert np.corrcoef(runaway[0], runaway[1])[0, 1] > 0.5
    flat = SyntheticWorkload(pool_config(prompt_heterogeneity=0.0))
    assert np.all(flat.pool.runaway_p == flat.cfg.runaway_prob)
    assert np.all(flat.pool.spread_p == 1.0)


def test_step_time_of_mixed_groups_follows_the_longest_sequence():
    cfg = SimConfig(
        hardware="custom",
        prefill_token_seconds=0.001,
        decode_step_seconds=0.1,
        decode_seq_seconds=0.01,
    )
    timer = StepTimer(cfg)
    lengths = np.array([[10, 20], [30, 40]])
    assert timer(lengths.ravel(), 5, group_sizes=[2, 2]) == timer(lengths, 5)
    flat = timer(lengths.ravel(), 5)  # without sizes, a prompt per row: two more prefills
    assert flat.compacting - timer(lengths, 5).compacting == pytest.approx(0.001 * 2 * 5)
    t = timer(np.array([10, 20, 30, 40, 50]), np.array([5, 5, 7, 7, 7]))
    assert t.synchronous == pytest.approx(0.001 * 31 + 50 * (0.1 + 0.01 * 5))
    assert t.update == pytest.approx(cfg.step_overhead_seconds + cfg.update_token_seconds * 181)
    # the sampler prefills each prompt once: groups of 2 and 3 rows, prompts 5 and 7
    grouped = timer(np.array([10, 20, 30, 40, 50]), np.array([5, 5, 7, 7, 7]), [2, 3])
    assert t.compacting - grouped.compacting == pytest.approx(0.001 * (31 - 12))


@pytest.mark.parametrize("budget", [0, 80])
def test_runner_plays_per_prompt_sizes(budget):
    cfg = load_config(
        None,
        [
            "sim.steps=40",
            "sim.prompts_per_step=8",
            "sim.prompt_pool=24",
            f"controller.hybrid.rows_per_step={budget}",
            "controller.delta=0.1",
        ],
    )
    w = SyntheticWorkload(cfg.sim)
    run = simulate_controller(
        "hybrid:per_prompt", make_controller("hybrid:per_prompt", cfg.controller), w, CUSTOM
    )
    if budget:
        assert np.all(run.num_sequences == budget)
    else:
        assert set((run.num_sequences // 8).tolist()) <= {4, 8, 16}
    np.testing.assert_allclose(run.group_size, run.num_sequences / 8)
    assert np.all(run.log2_group_size <= np.log2(run.group_size) + 1e-12)  # Jensen
    assert np.any(run.log2_group_size < np.log2(run.group_size) - 1e-9)  # sizes were mixed
    assert run.calibration["groups"] == 40 * 8


def test_simulate_command_with_the_prompt_aware_controllers(tmp_path, capsys):
    out = tmp_path / "pool"
    code = main(
        [
            "simulate",
            "--set",
            "sim.steps=30",
            "--set",
            "sim.prompts_per_step=8",
            "--set",
            "sim.prompt_pool=40",
            "--set",
            "sim.controllers=[sagc,hybrid,hybrid:per_prompt]",
            "--set",
            "logging.plots=false",
            "--set",
            f"logging.run_dir={out}",
            "--seeds",
            "2",
            "--hardware",
            "tpu-v5e",
            "--devices",
            "4",
            "--as-model",
            "llama-3.2-1b",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "| hybrid |" in printed and "| hybrid:per_prompt |" in printed
    assert "over 2 seeds" in printed and "log2 G - sagc" in printed  # the multi-seed table
    # both tables name the model, hardware and regime of their modeled hours
    assert printed.count("modeled h, llama-3.2-1b on 4 x tpu-v5e, compacting") == 2
    assert "modeled h, llama-3.2-1b on 4 x tpu-v5e, synchronous" in printed
    assert "| modeled h, synchronous |" in printed and "modeled h, continuous batching" in printed
    assert "compacting h - sagc" in printed
    calibration = (out / "calibration.csv").read_text().splitlines()
    assert calibration[0].startswith("controller,bin_low") and len(calibration) == 1 + 2 * 10
