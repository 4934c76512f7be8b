"""The length tail of many completions per prompt, by hand: straggling groups, groups without
signal and a synchronous step's decoded tokens for each G, and the file eval writes."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from sagc_jax.analysis.tail import tail_summary, tail_table, write_completions
from sagc_jax.tasks.prompt_source import Prompt

# 2 prompts x 4 samples under a cap of 100: prompt 0 has one runaway (100: at the cap) among
# 10s; prompt 1 is even. Rewards: prompt 0 one right, prompt 1 none.
LENGTHS_PK = np.array([[10, 10, 100, 12], [20, 20, 20, 20]])
REWARDS_PK = np.array([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_tail_figures_by_hand():
    tail = tail_summary(LENGTHS_PK, REWARDS_PK, cap=100, groups=(2, 4, 8), tau=3.0)
    assert tail["completions"] == 8 and tail["prompts"] == 2 and tail["samples"] == 4
    assert tail["at_cap"] == pytest.approx(1 / 8)
    assert tail["length_median"] == 20.0 and tail["length_mean"] == pytest.approx(212 / 8)
    assert tail["solved"] == pytest.approx(1 / 8)
    assert tail["prompts_none_solved"] == 0.5 and tail["prompts_all_solved"] == 0.0
    # G = 2: groups [10 10] [100 12] [20 20] [20 20]; [100 12]: 100 / median 56 < 3
    assert tail["straggle@2"] == 0.0
    # rewards [0 1] varies; the other three are all equal
    assert tail["no_signal@2"] == pytest.approx(3 / 4)
    assert tail["sync_decode@2"] == pytest.approx((20 + 200 + 40 + 40) / 212)
    # G = 4: [10 10 100 12]: 100 / median 11 > 3 straggles; [20 x4] does not
    assert tail["straggle@4"] == 0.5 and tail["no_signal@4"] == 0.5
    assert tail["sync_decode@4"] == pytest.approx((400 + 80) / 212)
    assert "straggle@8" not in tail  # G above the samples per prompt: no group to cut


def test_a_group_size_that_does_not_divide_the_samples_leaves_the_rest_out():
    tail = tail_summary(LENGTHS_PK[:, :3], REWARDS_PK[:, :3], cap=100, groups=(2,), tau=3.0)
    # groups [10 10] and [20 20]: the third sample of each prompt left out
    assert tail["straggle@2"] == 0.0 and tail["sync_decode@2"] == pytest.approx(1.0)
    assert tail["no_signal@2"] == 0.5


def test_completions_written_one_per_line_with_a_histogram(tmp_path):
    completions = SimpleNamespace(
        lengths_pk=LENGTHS_PK,
        rewards_pk=REWARDS_PK,
        truncated_pk=LENGTHS_PK >= 100,
        prompts=(Prompt("1+1=", "2", 7), Prompt("2+2=", "4", 9)),
        texts_pk=(("2", "2#2", "2" * 100, "3"), ("4", "4", "5", "x\udcff")),
    )
    tail = tail_summary(LENGTHS_PK, REWARDS_PK, cap=100, groups=(4,), tau=3.0)
    plot = write_completions(tmp_path / "out" / "c.jsonl", completions, tail, chars=64)
    lines = [json.loads(line) for line in (tmp_path / "out" / "c.jsonl").read_text().splitlines()]
    assert len(lines) == 8
    assert lines[1] == {
        "prompt": 0,
        "sample": 1,
        "length": 10,
        "reward": 1.0,
        "truncated": False,
        "prompt_id": 7,
        "prompt_text": "1+1=",
        "completion_text": "2#2",
        "answer": "2",
        "accepted": True,  # the checker's: reward >= 1, as eval/accuracy counts
    }
    assert lines[2]["completion_text"] == "2" * 32 + " [... 36 characters cut ...] " + "2" * 32
    assert lines[5]["accepted"] is False and lines[5]["answer"] == "4"
    assert lines[7]["completion_text"] == "x\\udcff"  # a byte that was not UTF-8, escaped
    # several processes (each decoded its share of the texts): the figures only
    several = SimpleNamespace(**{**vars(completions), "texts_pk": None})
    write_completions(tmp_path / "out" / "c.jsonl", several, tail)
    lines = [json.loads(line) for line in (tmp_path / "out" / "c.jsonl").read_text().splitlines()]
    assert lines[2] == {"prompt": 0, "sample": 2, "length": 100, "reward": 0.0, "truncated": True}
    assert lines[5] == {"prompt": 1, "sample": 1, "length": 20, "reward": 0.0, "truncated": False}
    assert plot == tmp_path / "out" / "c.png" and plot.stat().st_size > 0
    assert sorted(p.name for p in plot.parent.iterdir()) == ["c.jsonl", "c.png"]


def test_the_table_has_a_row_per_setting_written(tmp_path):
    tail = tail_summary(LENGTHS_PK, REWARDS_PK, cap=100, groups=(4,), tau=3.0)
    record = {"eval/accuracy": 0.125, **{f"tail/{k}": v for k, v in tail.items()}}
    (tmp_path / "b-cap100.json").write_text(json.dumps(record))
    (tmp_path / "a-cap100.json").write_text(json.dumps({"eval/accuracy": 0.0}))
    lines = tail_table(tmp_path).splitlines()
    assert len(lines) == 4 and lines[2].startswith("| a-cap100 | - |")
    row = lines[3].split(" | ")
    assert row[0] == "| b-cap100" and row[1] == "20" and row[4] == "12.5%"  # median, at the cap
    assert row[7] == "0.50" and row[8] == "-"  # straggle@4; G = 8 did not fit 4 samples
