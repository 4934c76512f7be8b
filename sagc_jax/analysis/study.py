"""Statistics of a controller study: the runs of ``sagc-jax compare`` over several seeds.

Per run (``run_measures``): the last held-out accuracy; wall-clock (the steps' own time, without
evaluations and checkpoints); the *modeled accelerator time*, the run's logged lengths re-timed
by the step-time model (``sim.steptime.StepTimer``: the config's ``sim`` section names the model,
hardware and devices) in each rollout regime of ``sim.steptime.REGIMES`` (compacting, the
sampler's own; synchronous; continuous batching), because on a CPU the mix of decode and update
time differs from an accelerator's; the
work done, independent of the machine (decode slots: rows x decode steps the sampler ran; update
tokens: prompt + completion tokens trained on); time-to-accuracy, wall-clock and modeled, until
held-out accuracy first reaches a target; the straggler rate; the share of groups without
signal (rewards all equal) and of rollouts cut at the cap; mean G and mean log2 G over every
group sampled; and the mean G and completion length of the first and of the last steps (does the
length move over training, and G with it?). A step's ``lengths`` are read as groups of any sizes,
so runs of the hybrid ``per_prompt`` mode (a size per prompt) count alike. Per controller and
evaluation, the held-out questions right over every seed with a Wilson interval
(``accuracy_over_evals``).

Per controller (``study_rows``): mean and 95% confidence interval over seeds (Student t), and a
paired comparison of every adaptive controller against each controller listed before it, on the
same seeds (``paired_rows``). The
time-to-accuracy target is a fraction of the best fixed-G controller's mean final accuracy.
Which controllers another dominates (``dominance``): more accurate at the end in less modeled
time, by the means and by paired intervals that both exclude zero.
"""

from __future__ import annotations

import math

import numpy as np

from sagc_jax.analysis.run_report import candidate_labels, figure_writer
from sagc_jax.controller.registry import CONTROLLERS, parse_controller_spec
from sagc_jax.sim.report import PRICE_TITLE, delta_line
from sagc_jax.sim.steptime import REGIMES, StepTimer

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (then the normal's).
_T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip

TARGET_FRACTION = 0.9  # time-to-accuracy: this share of the best fixed G's final accuracy
LAST_STEPS = 10  # "first" and "final" length and G: means over this many first or last steps
Z_95 = 1.959964  # the normal's two-sided 95% quantile (Wilson intervals)

# (key, title, format) of the per-controller table, in order; "{timed}" in a title is the step
# timer's label (model and hardware).
MEASURES = (
    ("accuracy", "final held-out accuracy", "{:.3f}"),
    ("wall_clock_s", "wall-clock (s)", "{:.0f}"),
    *((f"{r}_s", f"modeled s, {{timed}}, {r}", "{:.1f}") for r in REGIMES),
    ("tta_wall_s", "time to target, wall (s)", "{:.0f}"),
    *((f"tta_{r}_s", f"time to target, modeled s, {r}", "{:.1f}") for r in REGIMES),
    ("straggler_rate", "straggler rate", "{:.3f}"),
    ("no_signal", "groups without signal", "{:.3f}"),
    ("at_cap", "rollouts at the cap", "{:.3f}"),
    ("mean_G", "mean G", "{:.2f}"),
    ("mean_log2_G", "mean log2 G", "{:.2f}"),
    ("first_G", "first mean G", "{:.2f}"),
    ("final_G", "final mean G", "{:.2f}"),
    ("first_length", "first length", "{:.1f}"),
    ("final_length", "final length", "{:.1f}"),
    ("decode_slots_M", "decode slots (M)", "{:.2f}"),
    ("update_tokens_M", "update tokens (M)", "{:.2f}"),
)
# the keys of MEASURES that are modeled times (not the wall-clock's): the tables of a second
# accelerator (``compare --also-hardware``) show these alone
MODELED = tuple(key for key, _, _ in MEASURES if key.endswith("_s") and "wall" not in key)
# (key, title, format) of the calibration table of prompt-aware (hybrid) controllers.
CALIBRATION = (
    ("predicted_s_t", "mean predicted straggler rate", "{:.3f}"),
    ("observed_s_t", "mean observed straggler rate", "{:.3f}"),
    ("calibration_ece", "final ECE", "{:.3f}"),
    ("calibration_brier", "final Brier", "{:.3f}"),
)
# (key, format) of the paired table, in order; the times (keys ending in _s) also get the ratio
# of the means.
PAIRED = (
    ("accuracy", "{:+.3f}"),
    ("wall_clock_s", "{:+.0f}"),
    *((f"{r}_s", "{:+.1f}") for r in REGIMES),
    ("tta_wall_s", "{:+.0f}"),
    *((f"tta_{r}_s", "{:+.1f}") for r in REGIMES),
    ("straggler_rate", "{:+.3f}"),
    ("mean_log2_G", "{:+.2f}"),
)


def t_quantile(df: int) -> float:
    """Two-sided 95% quantile of Student's t with ``df`` (>= 1) degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom = {df}; need >= 1")
    return _T_975[df - 1] if df <= len(_T_975) else 1.960


def mean_ci(values) -> tuple[float, float, int]:
    """(mean, half-width of the 95% t interval, n) over the finite values; the half-width is
    nan with fewer than two, the mean nan with none."""
    x = np.asarray(values, float)
    x = x[np.isfinite(x)]
    if len(x) == 0:
        return math.nan, math.nan, 0
    if len(x) == 1:
        return float(x[0]), math.nan, 1
    half = t_quantile(len(x) - 1) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return float(x.mean()), half, len(x)


def paired_difference(a, b) -> tuple[float, float, int]:
    """``mean_ci`` of ``a - b`` over the seeds where both are finite (same seed, same index)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.shape != b.shape:
        raise ValueError(f"paired values need equal lengths, got {a.shape} and {b.shape}")
    return mean_ci(a - b)


def step_lengths(record: dict) -> np.ndarray:
    """int64 [rows]: every completion length of a logged step (every sampling round), group after
    group; the groups may differ in size."""
    return np.concatenate([np.asarray(g, np.int64) for g in record["lengths"]])


def modeled_step_seconds(steps: list[dict], timer: StepTimer) -> dict[str, np.ndarray]:
    """Per rollout regime, float [steps]: each logged step's rollout + update seconds by
    ``timer``, from its lengths (every sampling round; each group one prompt), mean prompt
    tokens per rollout and which groups carried learning signal (``group_signal``; a run logged
    before it was recorded: every group)."""
    times = [
        timer(
            step_lengths(r),
            int(r["prompt_tokens"]),
            [len(g) for g in r["lengths"]],
            signal_p=r.get("group_signal"),
        )
        for r in steps
    ]
    return {
        regime: np.array([getattr(t, regime) + t.update for t in times], float)
        for regime in REGIMES
    }


def time_to_accuracy(steps: list[dict], evals: list[dict], step_s, target: float) -> float:
    """Seconds (summed ``step_s`` of the steps before it) until the first evaluation with
    accuracy >= ``target``; nan when none reaches it. Evaluation at step k follows k steps."""
    for at, r in zip(eval_clock(steps, evals, step_s), evals, strict=True):
        if r["eval/accuracy"] >= target:
            return float(at)
    return math.nan


def eval_clock(steps: list[dict], evals: list[dict], step_s) -> np.ndarray:
    """float [evals]: summed ``step_s`` of the steps logged before each evaluation."""
    clock = np.concatenate([[0.0], np.cumsum(np.asarray(step_s, float))])
    done = np.array([int(r["step"]) for r in steps])  # 1, 2, ...: steps completed
    return clock[np.searchsorted(done, [int(r["step"]) for r in evals], side="right")]


def run_measures(steps: list[dict], evals: list[dict], timer: StepTimer, target: float) -> dict:
    """The measures of one run (see the module docstring); ``target`` for time-to-accuracy."""
    wall = np.array([r["time/step_s"] for r in steps], float)
    modeled = modeled_step_seconds(steps, timer)
    lengths = [step_lengths(r) for r in steps]
    slots = sum(x.size * int(r["decode_steps"]) for x, r in zip(lengths, steps, strict=True))
    tokens = sum(
        int(x.sum()) + x.size * r["prompt_tokens"] for x, r in zip(lengths, steps, strict=True)
    )
    log2_sizes = [np.mean([math.log2(len(g)) for g in r["lengths"]]) for r in steps]
    return {
        "accuracy": float(evals[-1]["eval/accuracy"]) if evals else math.nan,
        "wall_clock_s": float(wall.sum()),
        **{f"{regime}_s": float(modeled[regime].sum()) for regime in REGIMES},
        "tta_wall_s": time_to_accuracy(steps, evals, wall, target),
        **{
            f"tta_{regime}_s": time_to_accuracy(steps, evals, modeled[regime], target)
            for regime in REGIMES
        },
        "straggler_rate": float(np.mean([r["controller/s_t"] for r in steps])),
        "no_signal": float(np.mean(_floats(r.get("zero_variance_frac") for r in steps))),
        "at_cap": float(np.mean(_floats(r.get("truncated_frac") for r in steps))),
        "mean_G": float(np.mean([r["group_size"] for r in steps])),
        "mean_log2_G": float(np.mean(log2_sizes)),
        "first_G": float(np.mean([r["group_size"] for r in steps[:LAST_STEPS]])),
        "final_G": float(np.mean([r["group_size"] for r in steps[-LAST_STEPS:]])),
        "first_length": float(np.mean([r["length/mean"] for r in steps[:LAST_STEPS]])),
        "final_length": float(np.mean([r["length/mean"] for r in steps[-LAST_STEPS:]])),
        "decode_slots_M": slots / 1e6,
        "update_tokens_M": tokens / 1e6,
    }


def calibration_measures(steps: list[dict]) -> dict | None:
    """A prompt-aware run's straggle prediction against what happened: the mean over steps of the
    step's predicted and observed straggler rate (the share of its groups predicted, made before
    sampling, and seen to straggle), and the final running ECE and Brier score of every group
    (``HybridController.calibration``); None for a run without predictions."""
    if not steps or "controller/calibration_ece" not in steps[-1]:
        return None
    predicted = _floats(r.get("controller/predicted_s_t") for r in steps)
    observed = np.array([r["controller/s_t"] for r in steps], float)
    both = np.isfinite(predicted)
    return {
        "predicted_s_t": float(predicted[both].mean()) if both.any() else math.nan,
        "observed_s_t": float(observed[both].mean()) if both.any() else math.nan,
        "calibration_ece": _floats([steps[-1]["controller/calibration_ece"]])[0],
        "calibration_brier": _floats([steps[-1].get("controller/calibration_brier")])[0],
    }


def _floats(values) -> np.ndarray:
    """float array of logged values; None (a non-finite number in the JSONL) becomes nan."""
    return np.array([math.nan if v is None else v for v in values], float)


def accuracy_target(per_run: dict, controllers: list[str], seeds: int) -> float:
    """``TARGET_FRACTION`` x the best mean final accuracy among the fixed-G controllers (all
    controllers when none is fixed)."""
    fixed = [c for c in controllers if not _adaptive(c)] or controllers
    best = max(
        np.nanmean([_last_accuracy(per_run[(c, s)][1]) for s in range(seeds)]) for c in fixed
    )
    return TARGET_FRACTION * float(best)


def _last_accuracy(evals: list[dict]) -> float:
    return float(evals[-1]["eval/accuracy"]) if evals else math.nan


def study(per_run: dict, controllers: list[str], seeds: int, timer: StepTimer) -> dict:
    """Measures of every (controller, seed) run, per-controller rows (mean, CI) and paired rows.

    ``per_run[(controller, seed)]`` is ``(steps, evals)`` as ``report.read_metrics`` gives.
    """
    target = accuracy_target(per_run, controllers, seeds)
    measures = {
        key: run_measures(*per_run[key], timer, target)
        for key in ((c, s) for c in controllers for s in range(seeds))
    }
    calibration = {
        c: [calibration_measures(per_run[(c, s)][0]) for s in range(seeds)] for c in controllers
    }
    return {
        "target": target,
        "timed": timer.label,
        "runs": measures,
        "rows": [
            _summary_row(c, [measures[(c, s)] for s in range(seeds)], MEASURES) for c in controllers
        ],
        "paired": paired_rows(measures, controllers, seeds),
        "dominance": dominance(measures, controllers, seeds),
        "accuracy_over_evals": accuracy_over_evals(per_run, controllers, seeds),
        "calibration": [
            _summary_row(c, runs, CALIBRATION)
            for c, runs in calibration.items()
            if all(m is not None for m in runs)
        ],
    }


def wilson_interval(correct: int, total: int) -> tuple[float, float]:
    """The Wilson score 95% interval of a binomial share ``correct / total`` (``(nan, nan)``
    when ``total`` is 0): unlike the normal interval it stays in [0, 1] and is not empty at 0."""
    if total <= 0:
        return math.nan, math.nan
    p, z2 = correct / total, Z_95 * Z_95
    center = (p + z2 / (2 * total)) / (1 + z2 / total)
    half = Z_95 * math.sqrt(p * (1 - p) / total + z2 / (4 * total * total)) / (1 + z2 / total)
    return max(0.0, center - half), min(1.0, center + half)


def accuracy_over_evals(per_run: dict, controllers: list[str], seeds: int) -> list[dict]:
    """Per controller and evaluation step that every seed reached: the held-out questions right
    over all seeds (``eval/accuracy`` x ``eval/prompts`` of each run, summed) and their share with
    its Wilson 95% interval (each question of each seed one trial; the training evaluation is
    greedy, one completion a question)."""
    rows = []
    for c in controllers:
        evals = [per_run[(c, s)][1] for s in range(seeds)]
        for i in range(min(len(e) for e in evals)):
            records = [e[i] for e in evals]
            if not all("eval/prompts" in r for r in records):
                continue  # logged before the count was: no interval to give
            total = sum(int(r["eval/prompts"]) for r in records)
            correct = sum(round(r["eval/accuracy"] * int(r["eval/prompts"])) for r in records)
            low, high = wilson_interval(correct, total)
            share = correct / total if total else math.nan
            row = {"controller": c, "step": int(records[0]["step"]), "correct": correct}
            rows.append({**row, "total": total, "accuracy": share, "low": low, "high": high})
    return rows


def format_accuracy_over_evals(rows: list[dict]) -> str:
    """Markdown: one row per controller, one column per evaluation step, each cell the share
    right over every seed's questions and its Wilson 95% interval."""
    steps = sorted({r["step"] for r in rows})
    lines = [
        "| controller | " + " | ".join(f"step {s}" for s in steps) + " |",
        "|" + " --- |" * (len(steps) + 1),
    ]
    for c in dict.fromkeys(r["controller"] for r in rows):
        cells = {
            r["step"]: f"{r['accuracy']:.3f} [{r['low']:.3f}, {r['high']:.3f}] "
            f"({r['correct']}/{r['total']})"
            for r in rows
            if r["controller"] == c
        }
        lines.append(f"| {c} | " + " | ".join(cells.get(s, "") for s in steps) + " |")
    return "\n".join(lines)


def _summary_row(controller: str, runs: list[dict], measures) -> dict:
    """Mean, 95% CI half-width and count over the runs (seeds) of each of ``measures``."""
    row = {"controller": controller, "seeds": len(runs)}
    for key, _, _ in measures:
        mean, half, n = mean_ci([m[key] for m in runs])
        row.update({key: mean, f"{key}_ci": half, f"{key}_n": n})
    return row


def paired_rows(measures: dict, controllers: list[str], seeds: int) -> list[dict]:
    """Every adaptive (not ``fixed``) controller minus each controller listed before it, on the
    same seeds, per ``PAIRED`` measure (and the ratio of the means for the times); empty when no
    adaptive controller follows another."""
    pairs = [
        (subject, other)
        for i, subject in enumerate(controllers)
        if _adaptive(subject)
        for other in controllers[:i]
    ]
    rows = []
    for subject, other in pairs:
        row = {"subject": subject, "against": other}
        for key, _ in PAIRED:
            a = [measures[(subject, s)][key] for s in range(seeds)]
            b = [measures[(other, s)][key] for s in range(seeds)]
            diff, half, n = paired_difference(a, b)
            row.update({key: diff, f"{key}_ci": half, f"{key}_n": n})
            if key.endswith("_s"):
                num, den = mean_ci(a)[0], mean_ci(b)[0]
                row[f"{key}_ratio"] = num / den if den > 0 else math.nan
        rows.append(row)
    return rows


DOMINANCE_REGIME = REGIMES[0]  # the modeled time a dominance reads: the sampler's own regime


def dominance(measures: dict, controllers: list[str], seeds: int) -> list[dict]:
    """Per controller, the others that dominate it: a higher final held-out accuracy in less
    modeled time (in ``DOMINANCE_REGIME``), by the means over seeds (``by_means``), and of those the
    ones whose paired differences on the same seeds both have 95% intervals that exclude zero
    (``resolved``). A controller no other dominates by the means is on the frontier."""

    def paired(key, a, b):
        return paired_difference(
            [measures[(a, s)][key] for s in range(seeds)],
            [measures[(b, s)][key] for s in range(seeds)],
        )

    rows = []
    for subject in controllers:
        by_means, resolved = [], []
        for other in controllers:
            if other == subject:
                continue
            (d_acc, acc_half, _), (d_time, time_half, _) = (
                paired("accuracy", other, subject),
                paired(f"{DOMINANCE_REGIME}_s", other, subject),
            )
            if d_acc > 0 and d_time < 0:
                by_means.append(other)
                if d_acc > acc_half and -d_time > time_half:  # nan (one seed): never resolved
                    resolved.append(other)
        rows.append({"controller": subject, "by_means": by_means, "resolved": resolved})
    return rows


def format_dominance(rows: list[dict]) -> str:
    """Markdown: per controller, who dominates it by the means and, of those, by resolved
    paired differences."""
    lines = [
        "| controller | dominated by (means) | of those, resolved (paired 95% CIs) |",
        "| --- | --- | --- |",
    ]
    for row in rows:
        means = ", ".join(row["by_means"]) or "none (on the frontier)"
        lines.append(f"| {row['controller']} | {means} | {', '.join(row['resolved']) or '-'} |")
    return "\n".join(lines)


def _cell(row: dict, key: str, fmt: str) -> str:
    value, half = row[key], row[f"{key}_ci"]
    if not math.isfinite(value):
        return "not reached"
    cell = fmt.format(value)
    if math.isfinite(half):
        cell += " ± " + fmt.replace("+", "").format(half)
    reached, seeds = row[f"{key}_n"], row.get("seeds")
    if seeds is not None and reached < seeds:
        cell += f" ({reached}/{seeds} reached)"
    return cell


def format_rows(rows: list[dict], measures=MEASURES, timed: str = "") -> str:
    """Markdown: per controller, the mean over seeds ± the 95% CI half-width of each of
    ``measures`` (the study's, or ``CALIBRATION``); ``timed`` fills the modeled titles."""
    lines = [
        "| controller | "
        + " | ".join(title.format(timed=timed) for _, title, _ in measures)
        + " |",
        "|" + " --- |" * (len(measures) + 1),
    ]
    for row in rows:
        cells = [_cell(row, key, fmt) for key, _, fmt in measures]
        lines.append(f"| {row['controller']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_paired(rows: list[dict], timed: str = "", modeled_only: bool = False) -> str:
    """Markdown: paired differences (subject - other, same seeds), mean ± 95% CI, and for the
    times the ratio of the means; ``modeled_only``: the modeled times alone."""
    titles = {key: title.format(timed=timed) for key, title, _ in MEASURES}
    paired = [p for p in PAIRED if not modeled_only or p[0] in MODELED]
    lines = [
        "| paired | " + " | ".join(f"Δ {titles[key]}" for key, _ in paired) + " |",
        "|" + " --- |" * (len(paired) + 1),
    ]
    for row in rows:
        cells = []
        for key, fmt in paired:
            cell = _cell(row, key, fmt)
            if key.endswith("_s") and math.isfinite(row[f"{key}_ratio"]):
                cell += f" (x{row[f'{key}_ratio']:.2f})"
            cells.append(cell)
        lines.append(f"| {row['subject']} - {row['against']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SHARE = (0.0, 1.0)  # the range of a share or probability: s_t, posterior means, accuracy


def _band(ax, x, runs_y, label, bounds=(-math.inf, math.inf)):
    """Mean line and 95% CI band of equal-length series over seeds: the tables' interval (mean
    ± Student t half-width) clipped to ``bounds``, the values the quantity can take (a share in
    [0, 1], G on its ladder). The mean of values in a range lies in it, so the clipped band
    still holds the mean whenever the t interval does; only the impossible part is cut."""
    y = np.asarray(runs_y, float)
    mean = y.mean(axis=0)
    (line,) = ax.plot(x, mean, label=label)
    if len(y) > 1:
        half = t_quantile(len(y) - 1) * y.std(axis=0, ddof=1) / math.sqrt(len(y))
        low, high = np.clip(mean - half, *bounds), np.clip(mean + half, *bounds)
        ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2)


def _g_bounds(controller: str, candidates: tuple[int, ...]) -> tuple[float, float]:
    """The values G can take under ``controller``: its fixed size, or the ladder's range."""
    kind, arg = parse_controller_spec(controller)
    return CONTROLLERS[kind].g_range(arg, candidates)


def _adaptive(controller: str) -> bool:
    """Whether the controller of spec ``controller`` chooses G (not one fixed G)."""
    return CONTROLLERS[parse_controller_spec(controller)[0]].adaptive


def _plot_pareto(plt, save, per_run, controllers, seeds, seconds_of, xlabel, name) -> None:
    """``name``: each controller's final held-out accuracy against a run's seconds
    (``seconds_of(steps)``), mean and 95% CI over seeds on both axes: a controller is dominated
    by another that is both more accurate and cheaper."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for c in controllers:
        seconds, accuracy = [], []
        for s in range(seeds):
            steps, evals = per_run[(c, s)]
            seconds.append(seconds_of(steps))
            accuracy.append(_last_accuracy(evals))
        (x, x_half, _), (y, y_half, _) = mean_ci(seconds), mean_ci(accuracy)
        ax.errorbar(x, y, xerr=x_half or None, yerr=y_half or None, fmt="o", capsize=3, label=c)
    ax.set(
        xlabel=xlabel,
        ylabel="final held-out accuracy",
        title=f"Accuracy against time (mean, 95% CI over {seeds} seeds)",
    )
    ax.legend(fontsize=8)
    save(fig, name)


def plot_study(
    per_run: dict,
    controllers: list[str],
    seeds: int,
    timer: StepTimer,
    out_dir,
    *,
    candidates: tuple[int, ...],
    delta: float,
):
    """PNGs of the study (mean line and 95% CI band over seeds, clipped to the quantity's range:
    ``_band``): held-out accuracy against wall-clock and against modeled time (both rollout
    regimes), final accuracy against modeled time and against wall-clock per controller
    (``pareto.png``, ``pareto_wall.png``: the frontier), G and lambda over steps, the
    posterior mean per candidate, the straggler rate and mean group max/median ratio over
    steps, and for prompt-aware controllers their predicted against observed straggler rate per
    step. ``candidates`` and ``delta`` are the study's ``controller`` ladder and straggler
    budget: the posterior's legend names each candidate's G, and ``delta`` is drawn on the plots
    of straggling and posterior means."""
    plt, save, paths = figure_writer(out_dir)

    def common_steps(c):  # steps every seed logged (a run in progress may be shorter)
        return min(len(per_run[(c, s)][0]) for s in range(seeds))

    clocks = {"wall-clock": lambda st: np.array([r["time/step_s"] for r in st])}
    for regime in REGIMES:
        clocks[regime] = lambda st, regime=regime: modeled_step_seconds(st, timer)[regime]
    fig, axes = plt.subplots(1, len(clocks), figsize=(5 * len(clocks), 3.8))
    for c in controllers:
        for ax, clock_of in zip(axes, clocks.values(), strict=True):
            times, accs = [], []
            for s in range(seeds):
                steps, evals = per_run[(c, s)]
                times.append(eval_clock(steps, evals, clock_of(steps)))
                accs.append([r["eval/accuracy"] for r in evals])
            n = min(len(a) for a in accs)  # evaluations every seed reached
            _band(ax, np.mean([t[:n] for t in times], axis=0), [a[:n] for a in accs], c, SHARE)
    axes[0].set(xlabel="wall-clock (s)", ylabel="held-out accuracy", title="Against wall-clock")
    for ax, regime in zip(axes[1:], REGIMES, strict=True):
        ax.set(xlabel=f"modeled seconds, {timer.label}", title=f"Against modeled time, {regime}")
    axes[0].legend(fontsize=8)
    save(fig, "accuracy_vs_time.png")
    regime = REGIMES[0]  # the sampler's
    modeled = (
        lambda st: float(modeled_step_seconds(st, timer)[regime].sum()),
        f"modeled seconds, {timer.label}, {regime}",
        "pareto.png",
    )
    wall = (
        lambda st: float(sum(r["time/step_s"] for r in st)),
        "this machine's seconds of the run's steps (wall-clock, compiles included)",
        "pareto_wall.png",
    )
    for clock in (modeled, wall):
        _plot_pareto(plt, save, per_run, controllers, seeds, *clock)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for c in controllers:
        n = common_steps(c)
        x = np.arange(1, n + 1)
        series = [per_run[(c, s)][0][:n] for s in range(seeds)]
        g_bounds = _g_bounds(c, candidates)
        _band(ax1, x, [[r["group_size"] for r in st] for st in series], c, g_bounds)
        # lambda >= 0: SAGC's multiplier is projected onto [0, lambda_max], SAGC+'s price is
        # the slope between a cheaper and a riskier, more useful rung
        _band(ax2, x, [[r["controller/lambda"] for r in st] for st in series], c, (0, math.inf))
    ax1.set(xlabel="step", ylabel="G", title="Group size")
    ax2.set(xlabel="step", ylabel="lambda", title=PRICE_TITLE)
    ax1.legend(fontsize=8)
    save(fig, "group_size_lambda.png")

    fig, ax = plt.subplots(figsize=(8, 3.8))
    for c in controllers:
        n = common_steps(c)
        series = [per_run[(c, s)][0][:n] for s in range(seeds)]
        if "controller/posterior_mean" not in series[0][0]:
            continue  # fixed G has no posterior
        post = np.array([[r["controller/posterior_mean"] for r in st] for st in series])
        for i, label in enumerate(candidate_labels(candidates, post.shape[2])):
            _band(ax, np.arange(1, n + 1), post[:, :, i], f"{c} {label}", SHARE)
    ax.set(
        xlabel="step",
        ylabel="alpha / (alpha + beta)",
        ylim=(0, 1),
        title="Posterior mean straggler probability per candidate",
    )
    if ax.get_legend_handles_labels()[0]:
        delta_line(ax, delta)
        ax.legend(fontsize=7)
    save(fig, "posterior_mean.png")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for c in controllers:
        n = common_steps(c)
        series = [per_run[(c, s)][0][:n] for s in range(seeds)]
        x = np.arange(1, n + 1)
        _band(ax1, x, [[r["controller/s_t"] for r in st] for st in series], c, SHARE)
        # a group's max / max(1, median) is >= 1: a completion has at least one token
        ratios = [[np.mean(r["group_ratios"]) for r in st] for st in series]
        _band(ax2, x, ratios, c, (1, math.inf))
    delta_line(ax1, delta)
    ax1.set(xlabel="step", ylabel="share of groups", title="Straggling groups per step")
    ax2.set(xlabel="step", ylabel="max / median", title="Mean group max/median length ratio")
    ax1.legend(fontsize=8)
    save(fig, "straggler_ratio.png")

    aware = [c for c in controllers if "controller/predicted_s_t" in per_run[(c, 0)][0][0]]
    if aware:
        fig, axes = plt.subplots(1, len(aware), figsize=(5.5 * len(aware), 3.8), squeeze=False)
        for ax, c in zip(axes[0], aware, strict=True):
            n = common_steps(c)
            series = [per_run[(c, s)][0][:n] for s in range(seeds)]
            x = np.arange(1, n + 1)
            _band(
                ax,
                x,
                [_floats(r["controller/predicted_s_t"] for r in st) for st in series],
                "predicted (before sampling)",
                SHARE,
            )
            observed = [[r["controller/s_t"] for r in st] for st in series]
            _band(ax, x, observed, "observed", SHARE)
            delta_line(ax, delta)
            ax.set(xlabel="step", ylabel="share of groups", title=f"{c}: straggling groups")
            ax.legend(fontsize=8)
        save(fig, "calibration.png")
    return paths
