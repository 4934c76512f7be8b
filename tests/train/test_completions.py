"""A run's completions: the rows of a step (fields, the cap, text that is not UTF-8), the share
each process writes, a full disk and an unwritable folder (one warning, the run goes on), a
resumed run (each logged step's rows once), and a run's metrics unchanged by writing them."""

import errno
import json

import chex
import jax
import numpy as np
import pyarrow as pa
import pyarrow.json as pj
import pytest
from helpers import TINY

from sagc_jax.cli import main
from sagc_jax.config import LoggingConfig, load_config
from sagc_jax.tasks.prompt_source import Prompt
from sagc_jax.train import completions
from sagc_jax.train.completions import (
    CompletionLog,
    capped,
    completion_rows,
    read_completions,
    sampled_groups,
)
from sagc_jax.train.hooks import StepLog
from sagc_jax.train.loop import Trainer
from sagc_jax.train.metrics import StepResult
from sagc_jax.train.rollout import Rollouts


def step_log(step: int, sizes=(2, 3), texts=None, prompt_text="1+2=") -> StepLog:
    """A step of groups of ``sizes`` as the hooks see it (what the completions read of it)."""
    sizes = np.array(sizes)
    n = int(sizes.sum())
    rewards = np.linspace(0, 1, n, dtype=np.float32)
    batch = Rollouts(
        prompts=[Prompt(f"{prompt_text}{p}", str(p), 100 + p) for p in range(len(sizes))],
        group_sizes=sizes,
        prompt_ids=np.zeros((n, 4), np.int32),
        prompt_lens=np.full(n, 4, np.int32),
        completion=np.zeros((n, 6), np.int32),
        logprobs=np.zeros((n, 6), np.float32),
        lengths=np.arange(1, n + 1, dtype=np.int32),
        truncated=np.arange(n) % 2 == 0,
        texts=texts or [f"completion {r}" for r in range(n)],
        rewards=rewards,
        shaped=rewards - 0.5,
    )
    advantages = np.where(np.arange(n) < sizes[0], 0.0, np.arange(n) - 3.0).astype(np.float32)
    result = StepResult(
        step=step,
        group_size=int(sizes.max()),
        batch=batch,
        rounds=[batch],
        update_rows=n,
        trained=advantages != 0,
        advantages=advantages,
        rewards=batch.shaped,
        zero_variance_p=np.zeros(len(sizes), bool),
        update={},
        controller={},
        observation=None,
        clock={},
    )
    return StepLog(result, None, {})


def test_a_row_per_completion_with_its_prompt_text_rewards_and_advantage():
    rows = completion_rows(step_log(7).result, np.array([1]), first_group=10, process=2, chars=100)
    assert [r["sample"] for r in rows] == [0, 1, 2]
    assert rows[1] == {
        "step": 7,
        "process": 2,
        "group": 11,  # this process's group 1, after 10 groups of the processes before it
        "sample": 1,
        "G": 3,
        "step_G": 3,
        "prompt_id": 101,
        "prompt_text": "1+2=1",
        "prompt_tokens": 4,
        "completion_text": "completion 3",
        "length": 4,
        "answer": "1",
        "reward_raw": pytest.approx(0.75),
        "reward": pytest.approx(0.25),  # shaped
        "advantage": 0.0,
        "trained": False,
        "truncated": False,
    }
    assert [r["advantage"] for r in rows] == [-1.0, 0.0, 1.0]
    assert [r["trained"] for r in rows] == [True, False, True]


def test_long_texts_keep_their_head_and_tail_and_bad_bytes_are_escaped():
    text = "a" * 50 + "b" * 100 + "c" * 50
    assert capped(text, 200) == text
    assert capped(text, 100) == "a" * 50 + " [... 100 characters cut ...] " + "c" * 50
    assert capped("ok \udcff", 100) == "ok \\udcff"  # a lone surrogate: a byte that was not UTF-8
    assert capped(b"ok \xff", 100) == "ok \\xff"
    # a prompt of 20k tokens is capped like a completion; the rows stay valid UTF-8 JSON
    log = step_log(1, texts=["x\udcff", "y", "z", "w", "v"], prompt_text="9+" * 20_000)
    rows = completion_rows(log.result, np.array([0]), first_group=0, process=0, chars=64)
    prompt = "9+" * 20_000 + "0"
    assert (
        rows[0]["prompt_text"]
        == f"{prompt[:32]} [... {40_001 - 64} characters cut ...] {prompt[-32:]}"
    )
    line = json.dumps(rows[0], ensure_ascii=False).encode("utf-8")
    assert json.loads(line)["completion_text"] == "x\\udcff"


def test_the_processes_write_a_step_s_sampled_groups_between_them(tmp_path):
    """Two processes of 2 groups each, 3 groups logged: each process writes its own file of its
    own groups, the draw the same on both; the files read as one table."""
    drawn = [set(sampled_groups(5, 2, p, 2, 3, seed=0) + 2 * p) for p in (0, 1)]
    assert not drawn[0] & drawn[1] and len(drawn[0] | drawn[1]) == 3
    assert sampled_groups(5, 2, 0, 1, 0, seed=0).tolist() == [0, 1]  # 0: every group
    logging = LoggingConfig(completions_every=1, completions_groups=3)
    for process in (0, 1):
        log = CompletionLog(tmp_path, logging, seed=0, process=process, processes=2)
        log(5, step_log(5, sizes=(2, 2)))
        log.close()
    files = sorted((tmp_path / "completions").iterdir())
    for path in files:
        assert {r["process"] for r in map(json.loads, path.open())} == {int(path.name[-7])}
    table = pa.concat_tables(pj.read_json(path) for path in files)
    assert sorted(set(table["group"].to_pylist())) == sorted(drawn[0] | drawn[1])
    assert table.num_rows == 3 * 2 and len(read_completions(tmp_path)) == 6


def test_a_full_disk_is_said_once_and_the_completions_stop(tmp_path, monkeypatch):
    said, written = [], []

    def full(path, data):
        written.append(path)
        path.write_bytes(data[:10])  # a partial file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(completions, "_write_file", full)
    log = CompletionLog(tmp_path, LoggingConfig(), seed=0, report=said.append)
    for step in (1, 2, 3):
        log(step, step_log(step))
        log.flush()
    log.close()
    assert len(said) == 1 and "no space left on" in said[0] and "goes on" in said[0], said
    assert len(written) == 1  # nothing more was tried
    assert list((tmp_path / "completions").iterdir()) == []  # the partial file removed


def test_tensorboard_gets_a_table_of_a_group(tmp_path):
    texts = []
    log = CompletionLog(tmp_path, LoggingConfig(), seed=0, text=lambda *a: texts.append(a))
    log(3, step_log(3, texts=["a|b\nc", "d", "e", "f", "g"]))
    log.close()
    [(tag, markdown, step)] = texts
    assert (tag, step) == ("completions", 3)
    assert "| sample | tokens | reward | advantage | trained | completion |" in markdown
    assert "a\\|b ⏎ c" in markdown  # one line per row


def metric_lines(run) -> list[dict]:
    """The run's metrics lines without the ones that time it."""
    timed = ("time/", "throughput/")
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(timed)}
        for line in (run / "metrics.jsonl").read_text().splitlines()
    ]


SIGNAL = ["data.reward=helpers:half_signal_reward", "data.reward_timeout_s=0"]


@pytest.mark.slow
def test_writing_completions_changes_no_metric_of_the_run(tmp_path, capsys):
    """The same run with completions off and on (every step, every group): every metric but
    the timings and the weights are the same; the rows are the step's rollouts, as its
    metrics count them; TensorBoard has the text; ``report`` writes the page and the plot."""
    overrides = [*TINY, "train.steps=3", *SIGNAL, "logging.plots=false"]
    runs = {}
    for every in (0, 1):
        cfg = load_config(
            None, [*overrides, f"logging.completions_every={every}", "logging.completions_groups=0"]
        )
        trainer = Trainer(cfg, tmp_path / str(every))
        trainer.run(progress=False)
        trainer.close()
        runs[every] = jax.tree.map(np.asarray, trainer.state.params)
    chex.assert_trees_all_equal(runs[1], runs[0])
    run = tmp_path / "1"
    assert metric_lines(run) == metric_lines(tmp_path / "0")
    assert not (tmp_path / "0" / "completions").exists()
    rows = read_completions(run)
    steps = [r for r in metric_lines(run) if "group_size" in r]
    for record in steps:
        at = [r for r in rows if r["step"] == record["step"]]
        groups = [[r["length"] for r in at if r["group"] == g] for g in range(record["prompts"])]
        assert groups == record["lengths"]  # one round: the batch is the step's rollouts
        assert sum(r["trained"] for r in at) == record["update/rollouts_trained"]
        assert np.mean([r["reward"] for r in at]) == pytest.approx(record["reward"])
        assert {r["step_G"] for r in at} == {record["group_size"]}
    assert any(r["trained"] for r in rows) and not all(r["trained"] for r in rows)
    [events] = (run / "tensorboard").glob("events.out.tfevents.*")
    shown = next(r for r in rows if r["step"] == 3)  # the table of a step shows its first group
    assert b"completions" in events.read_bytes()
    assert f"| {shown['sample']} | {shown['length']}".encode() in events.read_bytes()
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    assert "completions at the first, middle and last" in capsys.readouterr().out
    page = (run / "report" / "completions.md").read_text()
    assert [line for line in page.splitlines() if line.startswith("## ")] == [
        "## Step 1 (G = 4)",
        "## Step 2 (G = 4)",
        "## Step 3 (G = 4)",
    ]
    assert (run / "report" / "length_reward.png").stat().st_size > 0


@pytest.mark.slow
def test_a_resumed_run_writes_each_logged_step_once(tmp_path):
    """Rows written after the checkpoint a run resumes from (a crash after step 3's rows) are
    removed, and the steps redone write theirs once; a changed period keeps no stale step."""
    run = tmp_path / "run"
    overrides = [*TINY, "logging.tensorboard=false", "logging.completions_groups=1"]
    first = Trainer(load_config(None, [*overrides, "train.steps=2"]), run)
    first.run(progress=False)
    first.close()
    folder = run / "completions"
    assert sorted(p.name for p in folder.iterdir()) == ["step-000002.p0.jsonl"]  # the last
    stale = '{"step": 3, "group": 9}\n'
    for name in ("step-000003.p0.jsonl", "step-000004.p0.jsonl", "step-000004.p0.jsonl.tmp"):
        (folder / name).write_text(stale)
    second = Trainer(
        load_config(None, [*overrides, "train.steps=5", "logging.completions_every=4"]), run
    )
    assert second.step == 2
    second.run(progress=False)
    second.close()
    assert sorted(p.name for p in folder.iterdir()) == [
        "step-000002.p0.jsonl",
        "step-000004.p0.jsonl",
        "step-000005.p0.jsonl",
    ]
    rows = read_completions(run)
    for step in (2, 4, 5):  # one group each, its G rows once
        at = [r for r in rows if r["step"] == step]
        assert len({r["group"] for r in at}) == 1
        assert sorted(r["sample"] for r in at) == list(range(at[0]["G"]))
    assert {r["step"] for r in rows} == {2, 4, 5}


@pytest.mark.slow
def test_an_unwritable_folder_is_said_once_and_the_run_completes(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "completions").write_text("a file where the folder should be")
    overrides = [*TINY, "train.steps=2", "logging.tensorboard=false"]
    trainer = Trainer(load_config(None, [*overrides, "logging.completions_every=1"]), run)
    summary = trainer.run(progress=False)
    trainer.close()
    said = [line for line in capsys.readouterr().out.splitlines() if "completions" in line]
    assert len(said) == 1 and "the run goes on without them" in said[0], said
    assert summary["steps"] == 2 and (run / "checkpoints").is_dir()
