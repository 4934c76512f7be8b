"""The straggle test where completions are short, replayed over a study's records.

The paper's test calls a group a straggler when its longest rollout exceeds ``tau`` times its
median. Where completions are short (15 tokens), a 45-token answer is then a straggler, though
its tail costs the step a few decode steps; the adaptive controllers then settle on the
smallest G. This replays the controllers over the real traces of a study's widest fixed arm (the
first G of each of its groups, their rewards with them) with the paper's test and with two tests
that judge a straggler by what it costs, chosen before any replay ran (docs/experiments/
real-straggler.md):

- ``floor``: the ratio reads the median as at least 1/16 of the cap (32 tokens at 512): among
  short answers a group straggles only when its longest runs past ``tau`` x 32 tokens.
- ``cost``: a group whose ratio exceeds ``tau`` straggles only when cutting its rollouts at
  ``tau`` x its median saves at least 10% of the step's modeled seconds (the step-time model
  of the study's hardware, the sampler's compacting regime, the update included).

The paper's SAGC is replayed with its own test only. Each replay reports the G it played (all
steps, and the second half, where the study's completions had shortened), the straggle rate by
the paper's test and by its own, and the modeled time of the replayed steps against each fixed
G's on the same trace; beside them, the held-out accuracy each fixed arm reached, so that a
reader sees whether a test kept G larger where a larger fixed G learned more. A replay is not a
run: the trace's policy is the fixed arm's, whatever G the replay plays.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from sagc_jax.analysis.compare import timing_config
from sagc_jax.analysis.records import RecordError, read_record
from sagc_jax.analysis.study import mean_ci, paired_difference
from sagc_jax.config import Config, from_dict
from sagc_jax.controller import make_controller
from sagc_jax.controller.observation import StraggleTest
from sagc_jax.controller.registry import parse_controller_spec
from sagc_jax.planning.timing import step_timer
from sagc_jax.sim.runner import simulate_controller
from sagc_jax.sim.steptime import REGIMES, StepTimer
from sagc_jax.sim.workload import ReplayWorkload

ADAPTIVE = ("sagc", "sagc_plus", "sagc_value")
FLOOR_SHARE = 1 / 16  # the floor test's median floor, a share of the cap
MIN_COST = 0.10  # the cost test's share of the step's modeled seconds
RATE_MARGIN = 0.05  # the study's H3: a controller's straggle rate within delta + 0.05


def straggle_tests(seconds, cap: int) -> list[StraggleTest | None]:
    """The paper's test (None), then the two cost-aware ones of the module docstring;
    ``seconds``: a step's modeled seconds from its lengths (``StepTimer.step_seconds``)."""
    return [
        None,
        StraggleTest("floor", median_floor=FLOOR_SHARE * cap),
        StraggleTest("cost", min_cost=MIN_COST, step_seconds=seconds),
    ]


def _final_accuracy(record: dict) -> float:
    evals = record["evals"]
    return float(evals[-1]["eval/accuracy"]) if evals else math.nan


def read_traces(folder: Path, arm: str | None = None) -> tuple[str, list[tuple[Path, dict]], dict]:
    """``(arm, traces, accuracy)``: the records of ``arm`` (default: the fixed arm of the
    widest G in ``folder``) by seed, and every fixed arm's final held-out accuracy by seed."""
    paths = sorted(folder.glob("*.json"))
    if not paths:
        raise RecordError(f"{folder}: no run record (*.json) there")
    records = [(p, read_record(p)) for p in paths]
    fixed = {}
    for path, record in records:
        kind, g = parse_controller_spec(record["controller"])
        if kind == "fixed":
            fixed.setdefault(int(g), []).append((path, record))
    if arm is None:
        if not fixed:
            raise RecordError(f"{folder}: no record of a fixed G to replay; name one with --arm")
        arm = f"fixed:{max(fixed)}"
    traces = [(p, r) for p, r in records if r["controller"] == arm]
    if not traces:
        have = sorted({r["controller"] for _, r in records})
        raise RecordError(f"{folder}: no record of {arm!r} (have {have})")
    traces.sort(key=lambda pr: pr[1]["seed"])
    accuracy = {
        g: {r["seed"]: _final_accuracy(r) for _, r in runs} for g, runs in sorted(fixed.items())
    }
    return arm, traces, accuracy


def replay_trace(cfg: Config, workload: ReplayWorkload, timer: StepTimer) -> list[dict]:
    """One row per (controller, test) and per fixed G of the ladder, replayed over one trace."""
    c = cfg.controller
    # the sampler's regime (compacting), update included: what sagc_value and the cost test weigh
    seconds = timer.step_seconds(workload.prompt_tokens_per_step[0], REGIMES[0])
    tests = straggle_tests(seconds, cfg.sampling.max_new_tokens)
    plays = [(f"fixed:{g}", None) for g in c.candidates]
    plays += [(kind, test) for kind in ADAPTIVE for test in tests if kind != "sagc" or test is None]
    half = workload.num_steps // 2
    rows = []
    for spec, test in plays:
        controller = make_controller(spec, c, step_seconds=seconds)
        controller.straggle_test = test
        run = simulate_controller(spec, controller, workload, timer)
        paper_s = [float(np.count_nonzero(r > c.tau)) / r.size for r in run.group_ratios]
        rows.append(
            {
                "controller": spec,
                "test": "relative" if test is None else test.name,
                "mean_G": float(run.group_size.mean()),
                "late_G": float(run.group_size[half:].mean()),
                "paper_rate": float(np.mean(paper_s)),
                "own_rate": float(run.s_t.mean()),
                "bootstrapped": float(run.bootstrapped_steps),
                **{f"{r}_s": v for r, v in _seconds(run).items()},
            }
        )
    return rows


def _seconds(run) -> dict[str, float]:
    """Modeled seconds of the replayed steps, rollouts in the first two regimes and updates."""
    update = float(run.update_seconds.sum())
    return {r: float(run.rollout_seconds[r].sum()) + update for r in REGIMES[:2]}


def replay_study(folder: Path, arm: str | None = None, sim: dict | None = None) -> dict:
    """Replay every (controller, test) over each seed's trace of ``arm`` (``read_traces``);
    ``{"arm", "seeds", "timer", "rows": per (controller, test) the seeds' values, "accuracy"}``.
    Each seed's modeled seconds are also divided by the same trace's fixed G = max and min.
    ``sim``: ``sim`` keys that replace the study's (another hardware to time the steps on)."""
    arm, traces, accuracy = read_traces(folder, arm)
    per_seed = []
    for path, record in traces:
        resolved = from_dict(record["resolved"])
        resolved = dataclasses.replace(resolved, sim=dataclasses.replace(resolved.sim, **sim or {}))
        # the step-time model reads the model's config.json, from the record where the
        # checkpoint is not on this machine
        with timing_config(resolved, record, None) as cfg:
            length = max(cfg.sampling.prompt_buckets) + cfg.sampling.max_new_tokens
            timer = step_timer(cfg, length)
        try:
            workload = ReplayWorkload.from_steps(record["steps"], str(path), seed=record["seed"])
        except ValueError as err:
            raise RecordError(str(err)) from None
        per_seed.append(replay_trace(cfg, workload, timer))
    candidates = cfg.controller.candidates
    keyed = {}
    for rows in per_seed:
        base = {row["controller"]: row for row in rows if row["test"] == "relative"}
        widest, narrowest = base[f"fixed:{max(candidates)}"], base[f"fixed:{min(candidates)}"]
        for row in rows:
            key = (row["controller"], row["test"])
            entry = keyed.setdefault(key, {})
            for name, value in row.items():
                if isinstance(value, float):
                    entry.setdefault(name, []).append(value)
            for r in REGIMES[:2]:
                entry.setdefault(f"{r}_vs_widest", []).append(row[f"{r}_s"] / widest[f"{r}_s"])
                entry.setdefault(f"{r}_vs_narrowest", []).append(
                    row[f"{r}_s"] / narrowest[f"{r}_s"]
                )
    return {
        "arm": arm,
        "seeds": [r["seed"] for _, r in traces],
        "timer": timer.label,
        "rows": keyed,
        "candidates": candidates,
        "accuracy": accuracy,
        "rate_budget": cfg.controller.delta + RATE_MARGIN,
    }


def _above_zero(diff: tuple[float, float, int]) -> bool | None:
    """Whether a paired difference's 95% interval lies above 0; None with fewer than 2 pairs."""
    mean, half, n = diff
    return None if n < 2 else bool(mean - half > 0)


def rule_verdict(result: dict) -> dict:
    """The win rule of docs/experiments/real-straggler.md, written before any replay ran, read
    off ``replay_study``'s result. A test other than the paper's wins for a controller when a
    larger fixed G learned more (the widest fixed arm's final held-out accuracy above the
    narrowest's, paired over the seeds, the 95% interval above 0) and, paired over the seeds
    against the paper's test, the controller's second-half mean G is larger (interval above 0),
    its modeled compacting time stays below the widest fixed G's on every seed and its own
    straggle rate (mean over the seeds) within ``delta + 0.05``. Of two winners the one of the
    smaller mean modeled time is taken. None where a comparison needs more seeds than there are."""
    lo, hi = min(result["candidates"]), max(result["candidates"])
    acc = result["accuracy"]
    both = sorted(set(acc.get(hi, {})) & set(acc.get(lo, {})))
    gain = paired_difference([acc[hi][s] for s in both], [acc[lo][s] for s in both])
    learned = _above_zero(gain)
    rows = []
    for (controller, test), v in result["rows"].items():
        if test == "relative":  # the paper's test, and every fixed G: what a variant is held to
            continue
        late = paired_difference(v["late_G"], result["rows"][(controller, "relative")]["late_G"])
        worst, own_rate = max(v["compacting_vs_widest"]), float(np.mean(v["own_rate"]))
        checks = [learned, _above_zero(late), worst < 1, own_rate <= result["rate_budget"]]
        rows.append(
            {
                "controller": controller,
                "test": test,
                "late_G_gain": late,
                "worst_vs_widest": worst,
                "own_rate": own_rate,
                "compacting_s": float(np.mean(v["compacting_s"])),
                "wins": False if False in checks else (None if None in checks else True),
            }
        )
    winners = {}
    for row in sorted(rows, key=lambda r: r["compacting_s"]):
        if row["wins"]:
            winners.setdefault(row["controller"], row["test"])
    return {"gain": gain, "learned": learned, "rows": rows, "winners": winners}


def format_verdict(result: dict) -> str:
    """``rule_verdict`` of ``replay_study``'s result, as markdown."""
    verdict = rule_verdict(result)
    lo, hi, budget = min(result["candidates"]), max(result["candidates"]), result["rate_budget"]
    mean, half, n = verdict["gain"]
    gain = "no pair of seeds" if n == 0 else _pm(mean, half, ".3f")
    lines = [
        f"The rule (docs/experiments/real-straggler.md): fixed G = {hi} minus fixed G = {lo}, "
        f"final held-out accuracy paired over {n} seed(s): {gain}; a larger G learned more: "
        f"{_yes(verdict['learned'])}.",
        "",
        f"| controller | straggle test | G, 2nd half, minus the paper's test | worst / fixed {hi} "
        f"| own straggle rate (<= {budget:.2f}) | wins |",
        "|---|---|---|---|---|---|",
    ]
    for row in verdict["rows"]:
        lines.append(
            f"| {row['controller']} | {row['test']} | {_pm(*row['late_G_gain'][:2], '.2f')} "
            f"| {row['worst_vs_widest']:.2f} | {row['own_rate']:.3f} | {_yes(row['wins'])} |"
        )
    undecided = any(row["wins"] is None for row in verdict["rows"])
    won = ", ".join(f"{c}: {t}" for c, t in verdict["winners"].items()) or (
        "undecided (needs 2+ seeds)" if undecided else "none"
    )
    return "\n".join([*lines, "", f"Winners: {won}."])


def _yes(flag: bool | None) -> str:
    return "needs 2+ seeds" if flag is None else ("yes" if flag else "no")


def _pm(mean: float, half: float, fmt: str) -> str:
    return f"{mean:{fmt}}" if not math.isfinite(half) else f"{mean:{fmt}} ± {half:{fmt}}"


def format_replay(result: dict) -> str:
    """The replay as markdown: one row per (controller, test), mean +- 95% CI over the seeds;
    then the fixed arms' final held-out accuracy."""
    lo, hi = min(result["candidates"]), max(result["candidates"])
    seeds = result["seeds"]
    head = (
        f"Replayed over the records of {result['arm']} (seeds {', '.join(map(str, seeds))}; "
        f"{result['timer']}); mean +- 95% CI over seeds where there are several.\n\n"
        f"| controller | straggle test | mean G | G, 2nd half | straggle rate (paper's test) "
        f"| straggle rate (own test) | compacting s | / fixed {hi} | / fixed {lo} "
        f"| synchronous s | / fixed {hi} |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    filled = max(max(v["bootstrapped"]) for v in result["rows"].values())
    if filled:
        head = (
            f"{head.splitlines()[0]} Up to {filled:.0f} steps of a replay asked for more "
            f"completions than a group logged and were filled by resampling its own.\n"
            + "\n".join(head.splitlines()[1:])
        )
    lines = [head]
    for (controller, test), v in result["rows"].items():
        cells = [
            _mci(v["mean_G"], ".2f"),
            _mci(v["late_G"], ".2f"),
            _mci(v["paper_rate"], ".3f"),
            _mci(v["own_rate"], ".3f"),
            _mci(v["compacting_s"], ".2f"),
            _mci(v["compacting_vs_widest"], ".2f"),
            _mci(v["compacting_vs_narrowest"], ".2f"),
            _mci(v["synchronous_s"], ".2f"),
            _mci(v["synchronous_vs_widest"], ".2f"),
        ]
        lines.append(f"| {controller} | {test} | " + " | ".join(cells) + " |")
    acc = result["accuracy"]
    lines += [
        "",
        "Final held-out accuracy of the fixed arms recorded (mean +- 95% CI over their seeds):",
        "",
        "| fixed G | seeds | accuracy |",
        "|---|---|---|",
    ]
    for g, by_seed in acc.items():
        seeds_g = ", ".join(map(str, sorted(by_seed)))
        lines.append(f"| {g} | {seeds_g} | {_mci(list(by_seed.values()), '.3f')} |")
    return "\n".join([*lines, "", format_verdict(result)])


def _mci(values, fmt: str) -> str:
    mean, half, _ = mean_ci(values)
    return _pm(mean, half, fmt)
