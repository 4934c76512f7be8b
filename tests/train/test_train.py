"""The trainer end to end on a tiny model: per-G compilation, exact resume, logs, commands."""

import json
import re

import chex
import jax
import numpy as np
import pytest
from helpers import (
    RAW_ROWS,
    TINY,
    CyclingController,
    capture_figures,
    delta_lines,
    legend_labels,
    write_word_tokenizer,
)

from sagc_jax.cli import main
from sagc_jax.config import ConfigError, load_config, to_dict
from sagc_jax.sim import ReplayWorkload
from sagc_jax.train.loop import Trainer


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True])
def test_one_program_per_candidate(tmp_path, packing):
    """One rollout program per G; one padded update per G, or one packed update per row-count
    rung the steps used (whatever G)."""
    overrides = [*TINY, "train.steps=6", "logging.tensorboard=false", f"train.packing={packing}"]
    # every rollout trained: the padded update's rows are the step's rollouts
    overrides.append("train.drop_no_signal=false")
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    trainer.controller = CyclingController((2, 4))
    trainer.run(progress=False)
    trainer.close()
    assert trainer.controller.steps_per_candidate.tolist() == [3, 3]
    assert trainer.sampler.num_traces == 2
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = {r["update_rows"] for r in lines if "group_size" in r}
    assert trainer.programs.compiled_programs()["update"] == len(rows)
    if not packing:
        assert rows == {4, 8}  # 2 prompts x G


def test_a_step_without_learning_signal_runs_no_update(tmp_path):
    """Every group's rewards equal and no KL term: the loss and gradient are exactly 0, so the
    update is skipped (no program compiled, weights and optimizer state unchanged) and counted
    in update/no_signal, not in update/skipped (a failure that train.max_nonfinite_steps counts)."""
    overrides = [
        *TINY,
        "train.steps=2",
        "train.max_nonfinite_steps=1",
        "train.skip_no_signal=true",
        "logging.tensorboard=false",
        "logging.plots=false",
        "data.reward=helpers:constant_reward",
        "data.reward_timeout_s=0",
    ]
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    before = jax.tree.map(np.array, (trainer.state.params, trainer.state.opt_state))
    summary = trainer.run(progress=False)
    trainer.close()
    chex.assert_trees_all_equal(
        jax.tree.map(np.array, (trainer.state.params, trainer.state.opt_state)), before
    )
    assert trainer.programs.compiled_programs()["update"] == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "group_size" in r]
    assert [(r["update/no_signal"], r["update/skipped"]) for r in steps] == [(1.0, 0.0)] * 2
    assert summary["no_signal_steps"] == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["train.packing=false", "loss.algorithm=dapo", "train.microbatches=2"],
        # LoRA dropout: each rollout's masks by the rollout, not by its row or micro-batch
        ["model.lora_rank=4", "model.lora_dropout=0.1", "loss.algorithm=dr_grpo"],
        ["tail_batching.enabled=true", "tail_batching.extra=0.5"],
    ],
    ids=["grpo packed", "dapo padded microbatches", "dr_grpo lora dropout", "tail batching"],
)
def test_leaving_out_the_rollouts_without_signal_changes_no_update(tmp_path, extra):
    """train.drop_no_signal on and off: the same rollouts, losses and weights (to float
    error), the update trained only the rollouts of non-zero advantage, the rest counted."""
    runs = {}
    for drop in (False, True):
        overrides = [*TINY, "train.steps=3", "train.prompts_per_step=4", *extra]
        overrides.append("logging.tensorboard=false")
        overrides += ["data.reward=helpers:half_signal_reward", "data.reward_timeout_s=0"]
        trainer = Trainer(
            load_config(None, [*overrides, f"train.drop_no_signal={drop}"]), tmp_path / str(drop)
        )
        trainer.run(progress=False)
        trainer.close()
        lines = (tmp_path / str(drop) / "metrics.jsonl").read_text().splitlines()
        steps = [r for r in map(json.loads, lines) if "group_size" in r]
        runs[drop] = (jax.tree.map(np.asarray, trainer.state.params), steps)
    (params, full), (params_dropped, dropped) = runs[False], runs[True]
    assert [r["lengths"] for r in dropped] == [r["lengths"] for r in full]
    # Adam divides float error by tiny second moments: a tenth of one step (lr 1e-3) of margin
    chex.assert_trees_all_close(params_dropped, params, atol=1e-4)
    for a, b in zip(full, dropped, strict=True):
        # the loss is about 0 (ratio 1, advantages summing to 0 per group); the gradient norm
        # is not, and shows a wrong normaliser that Adam's scale invariance would hide
        np.testing.assert_allclose(b["update/loss"], a["update/loss"], atol=1e-6)
        np.testing.assert_allclose(b["update/grad_norm"], a["update/grad_norm"], rtol=1e-5)
        rollouts = a["prompts"] * a["group_size"]
        assert a["update/rollouts_trained"] == rollouts
        assert b["update/rollouts_trained"] == rollouts - b["update/rollouts_without_signal"]
        if "tail_batching.enabled=true" not in extra:  # (a tail step logs its cut groups too)
            # the groups the cost model counts as trained (sim.StepTimer, signal_only)
            signal = [len(g) for g, s in zip(b["lengths"], b["group_signal"], strict=True) if s]
            assert sum(signal) == b["update/rollouts_trained"]
    assert sum(r["update/rollouts_without_signal"] for r in dropped) > 0  # some were left out
    assert sum(r["update_rows"] for r in dropped) < sum(r["update_rows"] for r in full)


def test_with_a_kl_term_every_rollout_is_trained_and_the_log_says_so(tmp_path, capsys):
    overrides = [*TINY, "loss.kl_beta=0.05", "logging.tensorboard=false"]
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    trainer.close()
    assert "every rollout is trained" in capsys.readouterr().out
    assert trainer.batcher.trained(np.zeros(4, np.float32)).all()
    plain = Trainer(load_config(None, [*TINY, "logging.tensorboard=false"]), tmp_path / "plain")
    plain.close()
    assert "every rollout is trained" not in capsys.readouterr().out
    np.testing.assert_array_equal(
        plain.batcher.trained(np.array([0.0, 1.0, -1.0, 0.0])), [0, 1, 1, 0]
    )


@pytest.mark.slow
def test_the_evaluation_decodes_through_the_slots_the_memory_check_counts(tmp_path):
    """More held-out prompts than a step's rollout rows stream through those rows (the memory
    check counted their KV cache, not the held-out set's), with the same greedy figures as
    decoding them all at once."""
    from sagc_jax.programs.shapes import decode_rows
    from sagc_jax.sampling.sampler import policy_sampler
    from sagc_jax.train.evaluate import evaluate_policy

    overrides = [*TINY, "train.eval_size=12", "sampling.slots=4", "logging.tensorboard=false"]
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    assert trainer.shape.eval_slots == 4 == trainer.eval_sampler.slots
    assert decode_rows(trainer.cfg.train, 4, 0) == 2 * 4  # slots 0: the largest G's step, 2 x G = 4
    all_at_once = policy_sampler(
        trainer.programs.sampling_graphdef, trainer.model_config, trainer.tokenizer
    )
    figures = evaluate_policy(all_at_once, trainer.sampling_params(), trainer.source, trainer.cfg)
    assert trainer.evaluate() == figures
    trainer.close()


@pytest.mark.slow
def test_compile_ahead_compiles_every_candidate_once(tmp_path, capsys):
    overrides = [*TINY, "train.steps=4", "logging.tensorboard=false", "train.compile_ahead=true"]
    # packed rungs compile on use, and so do padded ones below every rollout
    cfg = load_config(None, [*overrides, "train.packing=false", "train.drop_no_signal=false"])
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.controller = CyclingController((2, 4))
    trainer.compile_ahead()
    assert "compiled G=2" in capsys.readouterr().out
    assert trainer.sampler.num_traces == 2
    assert trainer.programs.compiled_programs()["update"] == 2
    trainer.run(progress=False)  # compile_ahead runs again: nothing new is traced
    trainer.close()
    assert trainer.sampler.num_traces == 2
    assert trainer.programs.compiled_programs()["update"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sagc", "sagc_plus", "sagc_value"])
def test_resume_continues_exactly(tmp_path, kind):
    overrides = [
        *TINY,
        f"controller.kind={kind}",
        "train.steps=4",
        "train.checkpoint_every=2",
        "logging.tensorboard=false",
    ]
    straight = Trainer(load_config(None, overrides), tmp_path / "straight")
    straight.run(progress=False)
    straight.close()

    first = Trainer(
        load_config(None, [*overrides[:-2], "train.steps=2", "logging.tensorboard=false"]),
        tmp_path / "resumed",
    )
    first.run(progress=False)
    first.close()
    second = Trainer(load_config(None, overrides), tmp_path / "resumed")
    assert second.step == 2
    second.run(progress=False)
    second.close()

    chex.assert_trees_all_equal(second.state.params, straight.state.params)
    chex.assert_trees_all_equal(second.controller.state_dict(), straight.controller.state_dict())


@pytest.mark.slow
def test_resume_with_a_different_config_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    args = [
        "train",
        *[a for o in TINY for a in ("--set", o)],
        "--set",
        "train.steps=1",
        "--set",
        f"logging.run_dir={run}",
    ]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--set", "loss.eps_high=0.28"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "loss.eps_high" in err and err.count("\n") == 1
    # a run saved before a key existed resumes: the key takes its default (the old behaviour)
    trainer = Trainer(load_config(None, [*TINY, "train.steps=1", f"logging.run_dir={run}"]), run)
    try:
        older = to_dict(trainer.cfg)
        del older["controller"]["hybrid"], older["data"]["curriculum_steps"]
        trainer.run_state.check_resumable({"config": older})
        # the simulator's section (its defaults change with releases) is not the run's
        older["sim"]["controllers"] = ["fixed:4", "sagc"]
        trainer.run_state.check_resumable({"config": older})
        older["loss"]["eps_high"] = 0.28
        with pytest.raises(ConfigError, match="loss.eps_high"):
            trainer.run_state.check_resumable({"config": older})
    finally:
        trainer.close()


@pytest.mark.slow
def test_train_command_writes_replayable_metrics_and_tensorboard(tmp_path, capsys):
    run = tmp_path / "run"
    args = [
        "train",
        *[a for o in TINY for a in ("--set", o)],
        "--set",
        "train.steps=3",
        "--set",
        f"logging.run_dir={run}",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "train done" in out
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "group_size" in x]
    assert len(steps) == 3
    # the run's own figures and what to run next end the output
    evals = [x for x in lines if "eval/accuracy" in x]
    tail = out.split(f"train done, wrote {run}:")[1].splitlines()[1:]
    assert tail[0].startswith(
        f"held-out accuracy: {evals[0]['eval/accuracy']:.3f} at step 0 -> "
        f"{evals[-1]['eval/accuracy']:.3f} at step 3 ("
    )
    assert tail[1] == "next:"
    assert tail[2].split() == f"sagc-jax report {run} summary and plots of the run".split()
    for key in (
        "reward",
        "accuracy",
        "length/mean",
        "controller/lambda",
        "controller/s_t",
        "controller/posterior_mean",
        "group_ratios",
        "padding_waste",
        "time/rollout_s",
        "time/update_s",
        "time/step_s",
        "throughput/tokens_per_s",
        "compiles/sampler",
    ):
        assert key in steps[-1], key
    assert "eval/accuracy" in lines[0] and "eval/accuracy" in steps[-1]
    assert ReplayWorkload.from_file(run / "metrics.jsonl").num_steps == 3
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((run / "summary.json").read_text())["steps"] == 3


@pytest.mark.slow
def test_sft_then_train_from_the_warm_start(tmp_path, capsys):
    sft_dir = tmp_path / "sft"
    common = [a for o in TINY for a in ("--set", o)]
    assert (
        main(
            [
                "sft",
                *common,
                "--set",
                "sft.steps=3",
                "--set",
                "sft.batch_size=4",
                "--set",
                f"logging.run_dir={sft_dir}",
            ]
        )
        == 0
    )
    assert "sft done" in capsys.readouterr().out
    sft_sets = ["--set", "sft.steps=3", "--set", "sft.batch_size=4"]
    assert main(["sft", *common, *sft_sets, "--set", f"logging.run_dir={sft_dir}"]) == 0
    assert "reusing" in capsys.readouterr().out
    assert main(["eval", *common, "--checkpoint", str(sft_dir)]) == 0
    assert "eval/accuracy=" in capsys.readouterr().out

    cfg = load_config(
        None,
        [*TINY, "train.steps=1", f"train.init_checkpoint={sft_dir}", "logging.tensorboard=false"],
    )
    trainer = Trainer(cfg, tmp_path / "rl")
    from sagc_jax.train.warm_start import load_run_params

    warm = load_run_params(sft_dir, trainer.state.params)
    chex.assert_trees_all_equal(warm, trainer.state.params)
    trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["train.batch_mode=budget", "train.rollout_budget=8"],
        [
            "loss.algorithm=dapo",
            "loss.dynamic_sampling=true",
            "loss.max_sampling_rounds=2",
            "loss.eps_high=0.28",
            "loss.overlong_buffer=4",
            "loss.mask_truncated=true",
        ],
        # a KL term with remat, as the paper's GRPO configs have (the reference forward once
        # failed under nnx.remat with "Cannot mutate Param from a different trace level")
        [
            "loss.algorithm=dr_grpo",
            "loss.kl_beta=0.05",
            "model.remat=dots",
            "train.minibatches=2",
            "train.epochs=2",
        ],
    ],
)
def test_variants_run(tmp_path, extra):
    cfg = load_config(None, [*TINY, "train.steps=2", "logging.tensorboard=false", *extra])
    trainer = Trainer(cfg, tmp_path / "run")
    summary = trainer.run(progress=False)
    trainer.close()
    assert summary["steps"] == 2 and np.isfinite(summary["eval/accuracy"])
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [x for x in lines if "group_size" in x]
    if "train.batch_mode=budget" in extra:
        assert all(r["prompts"] * r["group_size"] == 8 for r in rows)
    assert all(r["update/skipped"] == 0 for r in rows)


def test_bad_batch_shapes_are_rejected():
    from sagc_jax.config import ConfigError

    cfg = load_config(None, [*TINY, "train.batch_mode=budget", "train.rollout_budget=6"])
    with pytest.raises(ConfigError, match="rollout_budget = 6 is not divisible by G = 4"):
        Trainer(cfg, "/nonexistent/never-created")


@pytest.mark.slow
def test_dataset_task_with_a_tokenizer_and_math_reward(tmp_path, capsys):
    write_word_tokenizer(tmp_path / "tok")
    rows = [
        {"prompt": f"what is {a} plus {b}", "answer": str(a + b)}
        for a in range(5)
        for b in range(5)
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    common = [
        *TINY,
        "data.task=dataset",
        *RAW_ROWS,
        f"data.path={data}",
        f"model.tokenizer={tmp_path / 'tok'}",
        "data.chat_template=true",
        "train.steps=2",
        "logging.tensorboard=false",
    ]
    trainer = Trainer(load_config(None, common), tmp_path / "run")
    assert trainer.source.encode(trainer.source.batch(0, 0, 1)[0])[-1] == 10  # "assistant:"
    summary = trainer.run(progress=False)
    trainer.close()
    assert summary["steps"] == 2 and 0.0 <= summary["eval/accuracy"] <= 1.0

    data.write_text(data.read_text() + '{"prompt": "what is 1 plus 1"}\n')
    args = [
        "train",
        *[a for o in common for a in ("--set", o)],
        "--set",
        f"logging.run_dir={tmp_path / 'bad'}",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{data}:26" in err and "answer" in err and err.count("\n") == 1


@pytest.mark.slow
def test_compare_and_report_commands(tmp_path, capsys, monkeypatch):
    figures = capture_figures(monkeypatch)
    out = tmp_path / "cmp"
    args = [
        "compare",
        "--config",
        "configs/demo.yaml",
        *[a for o in TINY for a in ("--set", o)],
        "--set",
        "train.eval_size=4",
        "--set",
        "sampling.prompt_buckets=auto",  # resolved from the data for the modeled times too
        "--set",
        f"logging.run_dir={out}",
        "--controllers",
        "fixed:2,sagc",
        "--seeds",
        "2",
        "--steps",
        "2",
        "--hardware",
        "h200",
        "--as-model",
        "qwen2.5-0.5b",
        "--also-hardware",
        "tpu-v5p",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| fixed:2 |" in printed and "| sagc |" in printed and "±" in printed
    assert "modeled s, qwen2.5-0.5b on 1 x h200, synchronous" in printed
    assert "| sagc - fixed:2 |" in printed  # the paired table
    # the dominance table: who (if anyone) dominates fixed:2
    assert re.search(r"^\| fixed:2 \| (sagc|none \(on the frontier\)) \|", printed, re.M)
    # accuracy at every evaluation (steps 0 and 2), pooled over both seeds' 4 questions
    assert re.search(r"^\| sagc \| [0-9.]+ \[[0-9.]+, [0-9.]+\] \(\d/8\) \|", printed, re.M)
    # the same runs re-timed on the second accelerator, paired too
    assert "The same runs timed as qwen2.5-0.5b on 1 x tpu-v5p:" in printed
    assert printed.count("| sagc - fixed:2 |") == 2
    # seed by seed, every controller in turn: a drift of the machine falls on both alike
    started = re.findall(r"^compare: (\S+), seed (\d+):", printed, re.M)
    assert started == [("fixed:2", "0"), ("sagc", "0"), ("fixed:2", "1"), ("sagc", "1")]
    for name in (
        "compare.md",
        "compare.csv",
        "runs.csv",
        "accuracy_vs_time.png",
        "pareto.png",
        "pareto_wall.png",
        "group_size_lambda.png",
        "posterior_mean.png",
        "straggler_ratio.png",
    ):
        assert (out / name).stat().st_size > 0, name
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "fixed2-seed0",
        "fixed2-seed1",
        "sagc-seed0",
        "sagc-seed1",
    ]
    # the posterior's legend names the candidates' G; the budget (demo.yaml's delta 0.3) is
    # drawn on the plots of straggling, in compare's plots and in report's
    (post,) = figures["posterior_mean.png"].axes
    assert legend_labels(post) == ["sagc G=2", "sagc G=4", "delta"]
    assert delta_lines(figures["straggler_ratio.png"].axes[0]) == [0.3]
    assert main(["report", str(out / "sagc-seed0")]) == 0
    assert "straggler_rate=" in capsys.readouterr().out
    assert (out / "sagc-seed0" / "report" / "group_size_lambda.png").exists()
    (post,) = figures["posterior_mean.png"].axes  # the report's, read from the run's config
    assert legend_labels(post) == ["sagc-seed0 G=2", "sagc-seed0 G=4", "delta"]
    assert delta_lines(figures["straggler_rate.png"].axes[0]) == [0.3]
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    bad = [*args[:-1], "tpu-v9"]  # refused before any run, with the names allowed
    assert main(bad) == 2
    assert "sim.hardware = 'tpu-v9' is not allowed" in capsys.readouterr().err
