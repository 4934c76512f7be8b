"""The straggle tests beside the paper's (a median floor, a tail's modeled cost) and their replay
over a study's records (``sagc-jax replay --records``)."""

import numpy as np
import pytest
from helpers import TINY

from sagc_jax.analysis.records import make_record, run_name, write_record
from sagc_jax.analysis.straggle_replay import replay_study, rule_verdict
from sagc_jax.cli import main
from sagc_jax.config import load_config
from sagc_jax.controller import StepObservation, make_controller
from sagc_jax.controller.observation import StraggleTest, straggler_observation
from sagc_jax.sim.workload import ReplayWorkload


def test_the_default_test_is_the_papers():
    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = rng.integers(1, 300, size=(4, 8))
        assert StraggleTest().observation(lengths, 3.0, "group") == straggler_observation(
            lengths, 3.0
        )


def test_the_floor_spares_a_short_answer_among_shorter_ones():
    short, long = [10, 12, 14, 60], [10, 12, 14, 200]  # both past 3 x their median of 13
    lengths = np.array([short, long])
    assert StraggleTest().straggling(lengths, 3.0).tolist() == [True, True]
    assert StraggleTest("floor", median_floor=32).straggling(lengths, 3.0).tolist() == [
        False,  # 60 / 32 < 3
        True,  # 200 / 32 > 3
    ]


def test_the_cost_test_counts_what_cutting_the_tail_saves():
    def synchronous(lengths_pg):  # a step lasts as long as its longest rollout
        return float(lengths_pg.max())

    cost = StraggleTest("cost", min_cost=0.10, step_seconds=synchronous)
    tail = [10, 12, 14, 60]  # cut at 3 x 13 = 39 tokens
    alone = np.array([tail, [10, 10, 10, 10]])
    assert cost.straggling(alone, 3.0).tolist() == [True, False]  # saves 21 of 60 s
    beside = np.array([tail, [50, 52, 55, 58]])  # another group holds the step to 58
    assert cost.straggling(beside, 3.0).tolist() == [False, False]  # saves 2 of 60 s
    with pytest.raises(ValueError, match="min_cost > 0 needs step_seconds"):
        StraggleTest("cost", min_cost=0.1)


def test_a_test_other_than_the_papers_refuses_a_cut_step():
    controller = make_controller("sagc_plus")
    controller.straggle_test = StraggleTest("floor", median_floor=32)
    g = controller.propose()
    lengths = np.full((2, g), 5)
    finished = np.ones((2, g), bool)
    finished[0, 0] = False
    with pytest.raises(ValueError, match="judges whole steps"):
        controller.observe(StepObservation.of_groups(lengths, finished))


def test_a_replayed_trace_carries_its_rewards_and_prompts():
    lines = [
        {"step": 0, "eval/accuracy": 0.1},  # an evaluation line: skipped
        {"lengths": [[3, 4], [5, 9]], "rewards": [[0, 1], [1, 1]], "prompt_ids": [7, 8]},
    ]
    w = ReplayWorkload.from_steps(lines, "rec.json", seed=3)
    assert w.prompts(0)[0].tolist() == [7, 8]
    np.testing.assert_array_equal(w.rewards(0, 2), [[0, 1], [1, 1]])
    lengths, rewards = w.lengths(0, 6), w.rewards(0, 6)  # resampled: a length with its reward
    table = {(3, 0.0), (4, 1.0), (5, 1.0), (9, 1.0)}
    assert {
        (int(n), float(r)) for n, r in zip(lengths.ravel(), rewards.ravel(), strict=True)
    } <= table
    bad = [{"lengths": [[3, 4]], "rewards": [[0]]}]
    with pytest.raises(ValueError, match=r"rec\.json\[0\]: 'rewards' must be numbers shaped"):
        ReplayWorkload.from_steps(bad, "rec.json")
    assert ReplayWorkload.from_steps([{"lengths": [[1]]}], "r").rewards(0, 1) is None


def _study(folder, steps=12):
    """Records of fixed:2 and fixed:4 on TINY (candidates 2, 4) at a cap of 512, short
    completions whose every group has a 45-token answer, over 3x its median: the paper's test
    calls each a straggler, the floor (1/16 of the cap: 32 tokens) none."""
    cfg = load_config(None, [*TINY, "sampling.max_new_tokens=512"])
    rng = np.random.default_rng(0)
    for g in (2, 4):
        lines = []
        for step in range(steps):
            lengths = rng.integers(8, 12, size=(2, g))
            lengths[:, -1] = 45  # a 45-token answer among ~10-token ones
            rewards = rng.integers(0, 2, size=(2, g)).astype(float)
            lines.append(
                {
                    "step": step + 1,
                    "group_size": g,
                    "lengths": lengths.tolist(),
                    "rewards": rewards.tolist(),
                    "prompt_tokens": 16,
                }
            )
        for seed in (0, 1):
            spec = f"fixed:{g}"
            record = make_record(
                run_name(spec, seed),
                spec,
                seed,
                cfg,
                cfg,
                lines,
                [{"step": steps, "eval/accuracy": (10 * g + seed) / 100}],
                segments=[],
                weights={},
                data={},
            )
            write_record(folder / f"{run_name(spec, seed)}.json", record)


def test_replay_over_records_spares_the_cheap_tails(tmp_path, capsys):
    _study(tmp_path)
    result = replay_study(tmp_path)
    assert result["arm"] == "fixed:4" and result["seeds"] == [0, 1]
    rows = result["rows"]
    assert ("sagc", "relative") in rows and ("sagc", "floor") not in rows  # the paper's, kept
    assert rows[("fixed:4", "relative")]["paper_rate"] == [1.0, 1.0]
    floor, paper = rows[("sagc_plus", "floor")], rows[("sagc_plus", "relative")]
    assert floor["own_rate"] == [0.0, 0.0]  # 45 / 32 < 3: no straggler by the floor
    assert min(floor["late_G"]) > max(paper["late_G"])  # the floor keeps G larger
    assert result["accuracy"] == {2: {0: 0.2, 1: 0.21}, 4: {0: 0.4, 1: 0.41}}
    assert main(["replay", "--records", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| sagc_plus | floor |" in out and "| 4 | 0, 1 | 0.405 ± " in out
    # fixed G = 4 learned more on both seeds, but every variant played G = 4 at its cost
    assert "a larger G learned more: yes" in out and "Winners: none." in out
    assert main(["replay", "--records", str(tmp_path), "--set", "controller.tau=2"]) == 2
    assert "drop --config/--set" in capsys.readouterr().err


def _replayed(late_g, vs_widest, own_rate, seconds):
    return {
        "late_G": late_g,
        "compacting_vs_widest": vs_widest,
        "own_rate": own_rate,
        "compacting_s": seconds,
    }


def test_the_rule_takes_the_cheaper_winner_only_where_a_larger_g_learned_more():
    three = [0.3, 0.3, 0.3]
    rows = {
        ("fixed:4", "relative"): _replayed([4] * 3, [1.0] * 3, three, [3.0] * 3),
        ("sagc_plus", "relative"): _replayed([2.0, 2.1, 2.0], [0.5] * 3, three, [1.0] * 3),
        ("sagc_plus", "floor"): _replayed([3.0, 3.5, 3.2], [0.8, 0.9, 0.95], [0.2] * 3, [2.0] * 3),
        ("sagc_plus", "cost"): _replayed([3.5, 3.9, 3.7], [0.7, 0.8, 0.9], [0.1] * 3, [1.8] * 3),
        ("sagc_value", "relative"): _replayed([2.0] * 3, [0.5] * 3, three, [1.0] * 3),
        # dearer than fixed G = 4 on one seed; over the straggle budget
        ("sagc_value", "floor"): _replayed([3.0, 3.2, 3.1], [0.9, 1.01, 0.9], three, [2.0] * 3),
        ("sagc_value", "cost"): _replayed([3.0, 3.2, 3.1], [0.9] * 3, [0.4] * 3, [2.0] * 3),
    }
    accuracy = {2: {0: 0.20, 1: 0.21, 2: 0.19}, 4: {0: 0.30, 1: 0.33, 2: 0.31}}
    result = {"rows": rows, "candidates": (2, 4), "accuracy": accuracy, "rate_budget": 0.35}
    verdict = rule_verdict(result)
    assert verdict["learned"] is True
    assert {(r["controller"], r["test"]): r["wins"] for r in verdict["rows"]} == {
        ("sagc_plus", "floor"): True,
        ("sagc_plus", "cost"): True,
        ("sagc_value", "floor"): False,
        ("sagc_value", "cost"): False,
    }
    assert verdict["winners"] == {"sagc_plus": "cost"}  # of two winners, the cheaper
    # where the larger G did not learn more, keeping G large buys nothing: no test wins
    flipped = {2: accuracy[4], 4: accuracy[2]}
    assert rule_verdict({**result, "accuracy": flipped})["winners"] == {}
    # one seed decides nothing
    one = {k: {key: vals[:1] for key, vals in v.items()} for k, v in rows.items()}
    single = rule_verdict({**result, "rows": one, "accuracy": {2: {0: 0.2}, 4: {0: 0.3}}})
    assert single["learned"] is None and {r["wins"] for r in single["rows"]} == {None, False}
    assert single["winners"] == {}
