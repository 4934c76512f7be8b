"""The completions page of ``sagc-jax report``: the first, middle and last logged steps, the
longest, a highest- and a lowest-reward completion of a few groups, and the length-reward plot."""

import json

from sagc_jax.analysis.completions import group_examples, picked_steps, write_completions_report


def row(step, group, sample, length, reward, text="3>8#8"):
    return {
        "step": step,
        "process": 0,
        "group": group,
        "sample": sample,
        "G": 3,
        "step_G": 3,
        "prompt_id": 40 + group,
        "prompt_text": "3+5=",
        "prompt_tokens": 4,
        "completion_text": text,
        "length": length,
        "answer": "8",
        "reward_raw": reward,
        "reward": reward,
        "advantage": reward - 0.5,
        "trained": True,
        "truncated": length >= 48,
    }


def test_the_first_middle_and_last_steps_and_each_group_s_extremes():
    assert picked_steps([10, 20, 30, 40, 50]) == [10, 30, 50]
    assert picked_steps([5, 5, 6]) == [5, 6] and picked_steps([]) == []
    group = [row(1, 0, 0, 10, 1.0), row(1, 0, 1, 48, 0.0), row(1, 0, 2, 12, 1.0)]
    assert [(label, r["sample"]) for label, r in group_examples(group)] == [
        ("longest, lowest reward", 1),
        ("highest reward", 0),  # the first of the ties
    ]


def test_the_page_and_the_plot_of_a_run_s_completions(tmp_path):
    folder = tmp_path / "run" / "completions"
    folder.mkdir(parents=True)
    for step in (10, 20, 30, 40, 50):
        rows = [
            row(step, g, k, length=step + 3 * k, reward=float(k == 1), text="~~~ x" * k)
            for g in range(4)
            for k in range(3)
        ]
        text = "".join(json.dumps(r) + "\n" for r in rows)
        (folder / f"step-{step:06d}.p0.jsonl").write_text(text)
    page = write_completions_report(tmp_path / "run", tmp_path / "run" / "report")
    text = page.read_text()
    assert [line for line in text.splitlines() if line.startswith("## ")] == [
        "## Step 10 (G = 3)",
        "## Step 30 (G = 3)",
        "## Step 50 (G = 3)",
    ]
    assert text.count("### Group ") == 3 * 3  # a few groups of each step
    assert "**longest** (sample 2): 16 tokens; reward 0 (raw 0), advantage -0.500" in text
    assert "~~~~text\n~~~ x~~~ x\n~~~~" in text  # a fence its text cannot close
    assert (tmp_path / "run" / "report" / "length_reward.png").stat().st_size > 0
    assert write_completions_report(tmp_path / "empty", tmp_path / "out") is None
