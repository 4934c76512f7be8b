"""The statistics of a controller study (analysis/study.py) on hand-made logs."""

import math

import numpy as np
import pytest
from helpers import band_limits, capture_figures, delta_lines, legend_labels

from sagc_jax.analysis.run_report import plot_runs
from sagc_jax.analysis.study import (
    accuracy_over_evals,
    calibration_measures,
    dominance,
    format_accuracy_over_evals,
    format_dominance,
    format_paired,
    format_rows,
    mean_ci,
    modeled_step_seconds,
    paired_difference,
    plot_study,
    run_measures,
    study,
    t_quantile,
    time_to_accuracy,
    wilson_interval,
)
from sagc_jax.config.sim import SimConfig
from sagc_jax.sim import StepTimer

TIMER = StepTimer(SimConfig(hardware="custom"))


def test_t_interval_by_hand():
    assert t_quantile(1) == 12.706 and t_quantile(4) == 2.776 and t_quantile(200) == 1.96
    mean, half, n = mean_ci([1.0, 2.0, 3.0])  # sd 1
    assert (mean, n) == (2.0, 3) and half == pytest.approx(4.303 / math.sqrt(3))
    mean, half, n = mean_ci([5.0, float("nan")])  # one finite value: no interval
    assert (mean, n) == (5.0, 1) and math.isnan(half)
    assert mean_ci([])[2] == 0
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile(0)


def test_paired_difference_uses_the_same_seeds():
    a, b = [3.0, 5.0, 7.0], [1.0, 4.0, 5.0]  # differences 2, 1, 2
    diff, half, n = paired_difference(a, b)
    assert diff == pytest.approx(5 / 3) and n == 3
    assert half == pytest.approx(4.303 * np.std([2, 1, 2], ddof=1) / math.sqrt(3))
    # a pair with a missing side (a run that never reached the target) is left out
    assert paired_difference([1.0, float("nan")], [0.5, 2.0])[:3:2] == (0.5, 1)
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([1.0], [1.0, 2.0])


def _log(accuracies_at, step_s, lengths, decode_steps=10, prompt_tokens=5):
    """(steps, evals) as read_metrics gives them: step records 1..N, evaluations merged into
    the step record of their step (step 0 on its own)."""
    steps = []
    for i, t in enumerate(step_s, start=1):
        g = len(lengths[0])
        r = {
            "step": i,
            "time/step_s": t,
            "lengths": lengths,
            "prompt_tokens": prompt_tokens,
            "decode_steps": decode_steps,
            "controller/s_t": 0.5 if i % 2 else 0.0,
            "group_size": g,
            "length/mean": float(np.mean(np.concatenate(lengths))) + i,
            "zero_variance_frac": 0.25 * (i % 2),
            "truncated_frac": 0.1,
        }
        if i in accuracies_at:
            r["eval/accuracy"] = accuracies_at[i]
            r["eval/prompts"] = 20
        steps.append(r)
    evals = [{"step": 0, "eval/accuracy": accuracies_at.get(0, 0.0), "eval/prompts": 20}]
    evals += [r for r in steps if "eval/accuracy" in r]
    return steps, evals


def test_time_to_accuracy_counts_the_steps_before_the_evaluation():
    steps, evals = _log({2: 0.3, 4: 0.6, 6: 0.7}, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [[4, 8]])
    assert time_to_accuracy(steps, evals, [r["time/step_s"] for r in steps], 0.5) == 10.0
    assert time_to_accuracy(steps, evals, np.ones(6), 0.65) == 6.0
    assert time_to_accuracy(steps, evals, np.ones(6), 0.0) == 0.0  # the step-0 evaluation
    assert math.isnan(time_to_accuracy(steps, evals, np.ones(6), 0.9))


def test_modeled_time_replays_the_logged_lengths():
    lengths = [[10, 40, 12], [9, 11, 300]]
    steps, _ = _log({}, [1.0, 1.0], lengths, prompt_tokens=7)
    t = TIMER(np.array(lengths), 7)  # [P, G]: a prompt per group
    modeled = modeled_step_seconds(steps, TIMER)
    for regime in ("compacting", "synchronous", "continuous"):
        np.testing.assert_allclose(modeled[regime], [getattr(t, regime) + t.update] * 2)
    # a straggler costs modeled time: the same step without the 300-token rollout is cheaper
    short, _ = _log({}, [1.0], [[10, 40, 12], [9, 11, 13]], prompt_tokens=7)
    assert modeled_step_seconds(short, TIMER)["synchronous"][0] < t.synchronous + t.update
    assert modeled_step_seconds(short, TIMER)["compacting"][0] < t.compacting + t.update


def test_run_measures_by_hand():
    lengths = [[4, 8], [6, 2]]  # 4 rows, 20 completion tokens
    steps, evals = _log({2: 0.25, 3: 0.5}, [1.0, 2.0, 4.0], lengths, decode_steps=8)
    m = run_measures(steps, evals, TIMER, target=0.4)
    assert m["accuracy"] == 0.5 and m["wall_clock_s"] == 7.0 and m["tta_wall_s"] == 7.0
    assert m["decode_slots_M"] * 1e6 == 3 * 4 * 8  # steps x rows x decode steps
    assert m["update_tokens_M"] * 1e6 == pytest.approx(3 * (20 + 4 * 5))
    assert m["straggler_rate"] == pytest.approx(1 / 3) and m["mean_G"] == 2.0
    assert m["final_length"] == pytest.approx(5.0 + 2.0)  # mean over the last steps logged
    assert m["first_length"] == pytest.approx(5.0 + 2.0)  # 3 steps: first and last 10 alike
    assert m["no_signal"] == pytest.approx(0.5 / 3) and m["at_cap"] == pytest.approx(0.1)
    assert m["first_G"] == m["final_G"] == 2.0


def test_first_and_final_steps_show_the_length_and_g_moving():
    steps, evals = _log({}, [1.0] * 25, [[4, 8]])
    for r in steps[-10:]:
        r["group_size"] = 8
    m = run_measures(steps, evals, TIMER, target=0.4)
    assert m["first_G"] == 2.0 and m["final_G"] == 8.0 and m["mean_G"] == pytest.approx(4.4)
    # length/mean is the lengths' mean + the step: steps 1-10 and 16-25
    assert m["first_length"] == pytest.approx(6.0 + 5.5)
    assert m["final_length"] == pytest.approx(6.0 + 20.5)


def test_wilson_interval_by_hand():
    low, high = wilson_interval(8, 114)  # center (p + z^2/2n) / (1 + z^2/n)
    p, z, n = 8 / 114, 1.959964, 114
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert (low, high) == pytest.approx((center - half, center + half))
    assert low < p < high and low > 0
    low, high = wilson_interval(0, 20)  # not empty at 0, unlike the normal interval
    assert low == 0.0 and high == pytest.approx(0.1611, abs=1e-4)
    assert wilson_interval(20, 20)[1] == 1.0 and math.isnan(wilson_interval(0, 0)[0])


def test_accuracy_over_evals_pools_every_seeds_questions():
    per_run = {
        ("fixed:8", 0): _log({0: 0.1, 2: 0.25}, [1.0] * 2, [[5] * 8]),
        ("fixed:8", 1): _log({0: 0.05, 2: 0.5}, [1.0] * 2, [[5] * 8]),
    }
    rows = accuracy_over_evals(per_run, ["fixed:8"], 2)
    assert [(r["step"], r["correct"], r["total"]) for r in rows] == [(0, 3, 40), (2, 15, 40)]
    assert (rows[1]["low"], rows[1]["high"]) == pytest.approx(wilson_interval(15, 40))
    table = format_accuracy_over_evals(rows)
    assert "| controller | step 0 | step 2 |" in table
    assert f"| fixed:8 | 0.075 [{rows[0]['low']:.3f}, {rows[0]['high']:.3f}] (3/40) |" in table


def test_study_rows_target_and_paired_table():
    per_run = {}
    for seed in range(3):
        # fixed:8 ends at 0.6 after 4 s; sagc at 0.58 after 2 s, reaching 0.54 at step 2
        per_run[("fixed:8", seed)] = _log({2: 0.4, 4: 0.6}, [1.0] * 4, [[5] * 8])
        per_run[("sagc", seed)] = _log({2: 0.55 + 0.01 * seed, 4: 0.58}, [0.5] * 4, [[5] * 4])
    result = study(per_run, ["fixed:8", "sagc"], 3, TIMER)
    assert result["target"] == pytest.approx(0.54)
    rows = {r["controller"]: r for r in result["rows"]}
    assert rows["sagc"]["accuracy"] == pytest.approx(0.58) and rows["sagc"]["accuracy_ci"] == 0
    assert rows["sagc"]["tta_wall_s"] == 1.0 and rows["fixed:8"]["tta_wall_s"] == 4.0
    (paired,) = result["paired"]
    assert paired["against"] == "fixed:8" and paired["wall_clock_s"] == -2.0
    assert paired["wall_clock_s_ratio"] == 0.5 and paired["tta_wall_s_ratio"] == 0.25
    table = format_rows(result["rows"])
    assert "| sagc | 0.580 ± 0.000 |" in table
    paired_table = format_paired(result["paired"])
    assert "| sagc - fixed:8 | -0.020 ± 0.000 | -2 ± 0 (x0.50) |" in paired_table
    # a controller that never reaches the target says so
    for seed in range(3):
        per_run[("fixed:8", seed)] = _log({2: 0.1, 4: 0.9}, [1.0] * 4, [[5] * 8])
        per_run[("sagc", seed)] = _log({2: 0.1, 4: 0.5}, [1.0] * 4, [[5] * 4])
    result = study(per_run, ["fixed:8", "sagc"], 3, TIMER)
    assert "not reached" in format_rows(result["rows"])


def test_dominance_by_the_means_and_by_resolved_paired_intervals():
    """B beats A on every seed (resolved); C is more accurate than A but slower (no dominance);
    D beats A by the means only, its paired accuracy difference straddling zero."""
    runs = {
        "A": ([0.50, 0.52, 0.48], [10.0, 11.0, 9.0]),
        "B": ([0.60, 0.63, 0.58], [8.0, 9.0, 7.5]),
        "C": ([0.70, 0.70, 0.70], [20.0, 20.0, 20.0]),
        "D": ([0.70, 0.40, 0.50], [9.0, 10.0, 8.5]),
    }
    measures = {
        (c, s): {"accuracy": acc[s], "compacting_s": t[s]}
        for c, (acc, t) in runs.items()
        for s in range(3)
    }
    rows = {r["controller"]: r for r in dominance(measures, list(runs), 3)}
    assert rows["A"] == {"controller": "A", "by_means": ["B", "D"], "resolved": ["B"]}
    assert rows["B"]["by_means"] == [] and rows["C"]["by_means"] == []
    assert rows["D"]["by_means"] == ["B"] and rows["D"]["resolved"] == []  # accuracy unresolved
    table = format_dominance(list(rows.values()))
    assert "| A | B, D | B |" in table and "| C | none (on the frontier) | - |" in table
    # one seed: the means still rank, but nothing is resolved
    one = {k: v for k, v in measures.items() if k[1] == 0}
    assert dominance(one, list(runs), 1)[0] == {
        "controller": "A", "by_means": ["B", "D"], "resolved": [],
    }  # fmt: skip


def test_mixed_group_sizes_count_every_rollout():
    """A hybrid per_prompt step logs one list per group, of its own size: the modeled time, the
    work and mean log2 G read every rollout as a flat batch would."""
    mixed = [[10, 40, 12, 9], [11, 300]]  # sizes 4 and 2
    steps, evals = _log({1: 0.5}, [1.0], mixed, decode_steps=300, prompt_tokens=7)
    t = TIMER(np.array([10, 40, 12, 9, 11, 300]), 7, group_sizes=[4, 2])
    modeled = modeled_step_seconds(steps, TIMER)
    np.testing.assert_allclose(modeled["synchronous"], [t.synchronous + t.update])
    np.testing.assert_allclose(modeled["compacting"], [t.compacting + t.update])
    m = run_measures(steps, evals, TIMER, target=0.4)
    assert m["decode_slots_M"] * 1e6 == 6 * 300
    assert m["update_tokens_M"] * 1e6 == pytest.approx(382 + 6 * 7)
    assert m["mean_log2_G"] == pytest.approx(1.5)  # (log2 4 + log2 2) / 2


def test_every_adaptive_controller_is_paired_with_those_before_it():
    per_run = {}
    for seed in range(2):
        per_run[("fixed:8", seed)] = _log({2: 0.5}, [1.0, 1.0], [[5] * 8])
        per_run[("sagc", seed)] = _log({2: 0.5}, [1.0, 1.0], [[5] * 4])
        per_run[("hybrid:per_prompt", seed)] = _log({2: 0.5}, [0.5, 0.5], [[5] * 8, [5] * 2])
    result = study(per_run, ["fixed:8", "sagc", "hybrid:per_prompt"], 2, TIMER)
    pairs = [(r["subject"], r["against"]) for r in result["paired"]]
    assert pairs == [
        ("sagc", "fixed:8"),
        ("hybrid:per_prompt", "fixed:8"),
        ("hybrid:per_prompt", "sagc"),
    ]
    last = result["paired"][-1]
    assert last["wall_clock_s"] == -1.0 and last["wall_clock_s_ratio"] == 0.5
    assert last["mean_log2_G"] == pytest.approx(0.0)  # (3 + 1) / 2 against 2
    assert "| hybrid:per_prompt - sagc |" in format_paired(result["paired"])
    assert result["calibration"] == []  # no run logged predictions


def test_calibration_of_a_prompt_aware_run():
    steps, evals = _log({2: 0.5}, [1.0, 1.0, 1.0], [[5, 6]])
    for r, predicted in zip(steps, (None, 0.25, 0.75), strict=True):
        r["controller/predicted_s_t"] = predicted  # None: a non-finite value in the JSONL
        r["controller/calibration_ece"] = 0.1
        r["controller/calibration_brier"] = None
    m = calibration_measures(steps)
    assert m["predicted_s_t"] == 0.5 and m["observed_s_t"] == 0.25  # steps 2 and 3 only
    assert m["calibration_ece"] == 0.1 and math.isnan(m["calibration_brier"])
    assert calibration_measures(_log({}, [1.0], [[5]])[0]) is None
    per_run = {("hybrid:step", 0): (steps, evals)}
    (row,) = study(per_run, ["hybrid:step"], 1, TIMER)["calibration"]
    assert row["controller"] == "hybrid:step" and row["predicted_s_t"] == 0.5


def _plot_log(controller, seed, steps=4):
    """(steps, evals) of a run whose seeds 0 and 1 never straggle at G = 4 and whose seed 2
    always straggles at G = 16: over 3 seeds every t band (half-width 4.303 sd / sqrt 3) reaches
    past the values the quantity can take (a share from -1.1 to 1.8, G from -9 to 25)."""
    wild = seed == 2
    g = 4 if controller.startswith("fixed") or not wild else 16
    records = []
    for i in range(1, steps + 1):
        r = {
            "step": i,
            "time/step_s": 1.0,
            "lengths": [[5] * g],
            "prompt_tokens": 5,
            "decode_steps": 5,
            "group_size": g,
            "controller/s_t": float(wild),
            "controller/lambda": 5.0 * wild,
            "group_ratios": [5.0 if wild else 1.0],
            "length/mean": 5.0,
            "reward": 0.5,
        }
        if not controller.startswith("fixed"):
            r["controller/posterior_mean"] = [float(wild)] * 3
        if controller.startswith("hybrid"):
            r["controller/predicted_s_t"] = float(wild)
        records.append(r)
    evals = [{"step": 0, "eval/accuracy": 0.0}, {**records[-1], "eval/accuracy": float(wild)}]
    records[-1] = evals[-1]
    return records, evals


def test_study_plots_keep_bands_in_range_and_name_candidates(tmp_path, monkeypatch):
    figures = capture_figures(monkeypatch)
    controllers = ["fixed:4", "sagc", "hybrid:step"]
    per_run = {(c, s): _plot_log(c, s) for c in controllers for s in range(3)}
    plot_study(per_run, controllers, 3, TIMER, tmp_path, candidates=(4, 8, 16), delta=0.2)

    accuracy = figures["accuracy_vs_time.png"].axes
    assert all(band_limits(ax) == (0.0, 1.0) for ax in accuracy)
    (pareto_ax,) = figures["pareto.png"].axes  # final accuracy against modeled time, with CIs
    assert legend_labels(pareto_ax) == controllers
    (wall_ax,) = figures["pareto_wall.png"].axes  # and against this machine's seconds
    assert legend_labels(wall_ax) == controllers and "wall-clock" in wall_ax.get_xlabel()
    walls = [sum(r["time/step_s"] for r in per_run[("sagc", s)][0]) for s in range(3)]
    sagc_point = next(c for c in wall_ax.containers if c.get_label() == "sagc")
    np.testing.assert_allclose(np.asarray(sagc_point.lines[0].get_xdata(), float), [np.mean(walls)])
    g_ax, lam_ax = figures["group_size_lambda.png"].axes
    assert band_limits(g_ax) == (4.0, 16.0)  # the ladder's range, not -9..25
    sagc_g = next(line for line in g_ax.get_lines() if line.get_label() == "sagc")
    np.testing.assert_allclose(sagc_g.get_ydata(), 8.0)  # the mean itself is not moved
    assert band_limits(lam_ax)[0] == 0.0
    s_ax, ratio_ax = figures["straggler_ratio.png"].axes
    assert band_limits(s_ax) == (0.0, 1.0) and band_limits(ratio_ax)[0] == 1.0
    assert delta_lines(s_ax) == [0.2]
    (post_ax,) = figures["posterior_mean.png"].axes
    assert band_limits(post_ax) == (0.0, 1.0) and delta_lines(post_ax) == [0.2]
    assert legend_labels(post_ax) == [
        *[f"{c} G={g}" for c in ("sagc", "hybrid:step") for g in (4, 8, 16)],
        "delta",
    ]
    (cal_ax,) = figures["calibration.png"].axes
    assert band_limits(cal_ax) == (0.0, 1.0) and delta_lines(cal_ax) == [0.2]


def test_report_plots_name_candidates_and_draw_delta(tmp_path, monkeypatch):
    figures = capture_figures(monkeypatch)
    run = {"run": _plot_log("sagc", 2)}
    plot_runs(run, tmp_path, candidates=(4, 8, 16), delta=0.25)
    (post_ax,) = figures["posterior_mean.png"].axes
    assert legend_labels(post_ax) == ["run G=4", "run G=8", "run G=16", "delta"]
    (rate_ax,) = figures["straggler_rate.png"].axes
    assert delta_lines(rate_ax) == [0.25] and delta_lines(post_ax) == [0.25]
    # a run without a saved config: the ladder's order, and no budget to draw
    plot_runs(run, tmp_path)
    (post_ax,) = figures["posterior_mean.png"].axes
    assert legend_labels(post_ax) == ["run rung 0", "run rung 1", "run rung 2"]
    assert delta_lines(figures["straggler_rate.png"].axes[0]) == []


def test_the_trainer_never_imports_the_analysis():
    import subprocess
    import sys

    code = (
        "import sys; import sagc_jax.train.loop, sagc_jax.train.sft, sagc_jax.planning.resolve; "
        "bad = [m for m in sys.modules if m.startswith('sagc_jax.analysis')]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
