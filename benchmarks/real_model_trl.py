"""Real-model GRPO steps of sagc-jax's Trainer against TRL's GRPOTrainer (CPU, float32).

Both sides train the same converted SmolLM2-135M-Instruct (`sagc-jax fetch-model`; a Hugging
Face directory: safetensors, config, tokenizer with its chat template) on the same reasoning-gym
prompts, step for step: sagc-jax's own `ReasoningGymSource` (`data.task: reasoning_gym`) gives
the prompts of step s (`source.batch(s, 0, prompts)`) rendered by the tokenizer's chat template;
TRL gets that text as plain (already templated) prompts in a `datasets.Dataset`, in the same
order, unshuffled (`shuffle_dataset=False`), so it does not template again; before anything is
timed the script checks that the token ids TRL feeds its model (`GRPOTrainer._tokenize_prompts`)
equal sagc-jax's (`source.encode`) for every prompt. The same settings on both sides: `--group`
completions per prompt (sagc-jax `controller.kind: fixed`), `--max-new-tokens` (completions stop
at the end-of-sequence token), temperature 1, top-p 1, no top-k, AdamW at `--lr` (constant, no
warm-up, no weight decay, global-norm clip 1.0), beta 0 (no reference model), PPO clip 0.2,
GRPO loss (per-sequence token mean, advantages scaled by the group std; TRL `loss_type="grpo"`,
`scale_rewards="group"`), one optimizer update per step (TRL: per-device batch = prompts x G,
`gradient_accumulation_steps=1` = sagc-jax's `train.minibatches`, `num_iterations=1`), no LoRA,
float32 weights and compute, each layer recomputed in the backward (`--remat full`, the
default: sagc-jax `model.remat: full`, TRL `gradient_checkpointing=True`), and the same reward:
`sagc_jax.tasks.reasoning_gym.score` of the completion text (the dataset's `score_answer` of
the last `<answer>...</answer>`, or with `--rg-answer final`, the default, of the final answer
when there are no tags). By default the task is the learning run's
(docs/experiments/real-model.md): `basic_arithmetic`, two terms. sagc-jax runs every step's
update even when every advantage is 0 (`train.skip_no_signal=false`), as TRL does. sagc-jax
runs with the learning run's own layout: layers scanned (`--scan-layers`, the default:
`model.scan_layers: true`), `--microbatches 2` (`train.microbatches`: the update's gradient
accumulated over two chunks of rows, one optimizer update; TRL keeps its one batch) and
`--logprob-chunk 4096` (`loss.logprob_chunk`).

`--drop`: sagc-jax with `train.drop_no_signal` on (the default of its config: the rollouts of
advantage 0 are left out of the update, which changes the loss and gradient by float error
only), off (every rollout trained, as TRL trains every one), or `both` (the default: two
sagc-jax runs, each with its ratio to the one TRL run). Both figures are honest: "on" is what a
sagc-jax user gets, "off" the same work row for row as TRL.

Each side runs in its own subprocess, one after the other (sagc-jax first), so its peak RSS
(`os.wait4`'s `ru_maxrss` of that child) is its own.
  * sagc-jax: its real `Trainer` (`sagc_jax.train.loop.Trainer`, config from `--set`-style
    overrides), `compile_ahead` first (reported as "compile"), then `--warmup` + `--steps`
    `train_step`s, each logged to its `metrics.jsonl` by the trainer's own writer; no evaluation
    or checkpoint runs (the steps are driven one by one, as `Trainer.run` drives them minus its
    hooks). The figures come back from `metrics.jsonl`: `time/step_s`, `time/rollout_s`
    (sampling and the reward), `time/update_s`, `lengths` (completion tokens, EOS included),
    `reward`. Packed updates (`train.packing`, the default) compile one program per row-count
    rung on first use, and `sampling.prompt_buckets: auto` one rollout program per prompt
    bucket: a timed step that compiled is named (`compiles/*` rose), its time is in the figure.
  * TRL: `GRPOTrainer.train()` on the `transformers` model (`use_cpu=True`, `bf16=False`), with
    a `TrainerCallback` that times each step from `on_step_begin` to `on_step_end` (generation,
    reward, loss, backward, optimizer step). TRL logs no generation/update split by default (its
    `step_time` metric is the whole `training_step`), so the script times
    `_generate_and_score_completions` by wrapping it (generation, decoding and the reward):
    "rollout"; "update" is the step less that. Rewards and completion lengths (EOS included) are
    TRL's own logged metrics (`reward`, `completions/mean_length`, `logging_steps=1`; logging
    runs after `on_step_end`, outside the timed step).

The figure per side is generated completion tokens per second of the whole timed steps. The
last line prints both and their ratio, sagc-jax over TRL (above 1: sagc-jax is faster), and
beside it the ratio with the seconds JAX spent compiling inside the timed steps taken out (its
own `jax.monitoring` duration events: tracing, lowering, XLA compilation): a packed update
compiles once per row-count rung it meets, which a long run pays once but three timed steps
meet several times.
torch runs with `torch.set_num_threads(--threads)` (default: every usable core) in TRL's child;
JAX uses its own CPU thread pool. The load average before and after is printed: run it on a
quiet machine (see benchmarks/grpo_step.py on how contention skews torch's side).

    .venv/bin/pip install -e '.[bench,rg]'     # once: trl, reasoning-gym
    .venv/bin/sagc-jax fetch-model             # once: the model, under ~/.cache/sagc-jax/models
    .venv/bin/python benchmarks/real_model_trl.py --prompts 4 --group 8 --max-new-tokens 128 \\
        --steps 5 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from grpo_step import Timing, _fmt, _lengths_summary, _versions

DEFAULT_MODEL = Path.home() / ".cache" / "sagc-jax" / "models" / "SmolLM2-135M-Instruct"
# the task of the learning run (configs/real/smollm2-arith.yaml, docs/experiments/real-model.md)
DEFAULT_RG_CONFIG = (
    '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"], '
    '"allow_parentheses": false, "allow_negation": false}'
)
EPS, MAX_GRAD_NORM = 0.2, 1.0


def _parse():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="Hugging Face model dir")
    parser.add_argument(
        "--rg-dataset", default="basic_arithmetic", help="reasoning-gym dataset name"
    )
    parser.add_argument(
        "--rg-answer",
        choices=("tags", "final"),
        default="final",
        help="data.rg_answer: where the reward reads the answer (default: %(default)s)",
    )
    parser.add_argument(
        "--rg-config", default=DEFAULT_RG_CONFIG, help="its keyword arguments, JSON"
    )
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="completion cap")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps per side")
    parser.add_argument("--lr", type=float, default=5e-6, help="AdamW learning rate")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (default: usable cores)"
    )
    parser.add_argument(
        "--remat",
        choices=("full", "none"),
        default="full",
        help="recompute each layer in the backward: sagc-jax model.remat, TRL "
        "gradient_checkpointing (default: %(default)s, as the learning run; none keeps every "
        "activation)",
    )
    parser.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sagc-jax model.scan_layers (default: on, as the learning run)",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=2,
        help="sagc-jax train.microbatches (default: %(default)s, as the learning run)",
    )
    parser.add_argument(
        "--logprob-chunk",
        type=int,
        default=4096,
        help="sagc-jax loss.logprob_chunk (default: %(default)s, as the learning run)",
    )
    parser.add_argument(
        "--drop",
        choices=("on", "off", "both"),
        default="both",
        help="sagc-jax train.drop_no_signal: on, off, or both (two sagc-jax runs; default)",
    )
    parser.add_argument("--side", choices=("both", "sagc", "trl"), default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", choices=("sagc", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (the first step compiles / warms up)")
    if args.prompts < 1 or args.group < 2:
        parser.error("--prompts must be >= 1 and --group >= 2 (advantages need a group)")
    try:
        rg_config = json.loads(args.rg_config)
    except json.JSONDecodeError as err:
        parser.error(f"--rg-config is not JSON ({err})")
    if not isinstance(rg_config, dict):
        parser.error("--rg-config must be a JSON object of the dataset's keyword arguments")
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there (run `sagc-jax fetch-model`)")
    return args


def _task(args) -> str:
    return args.rg_dataset


def sagc_config(args, run_dir: str):
    """The sagc-jax config both sides' prompts come from, and the sagc-jax side trains with."""
    from sagc_jax.config import load_config

    g = args.group
    overrides = [
        f"model.hf_checkpoint={args.model}",
        "model.param_dtype=float32",
        "model.compute_dtype=float32",
        "model.lora_rank=0",
        f"model.remat={args.remat}",
        f"model.scan_layers={str(args.scan_layers).lower()}",
        "data.task=reasoning_gym",
        f"data.rg_dataset={args.rg_dataset}",
        f"data.rg_config={args.rg_config}",
        f"data.rg_answer={args.rg_answer}",
        f"data.seed={args.seed}",
        f"sampling.max_new_tokens={args.max_new_tokens}",
        "sampling.temperature=1.0",
        "sampling.top_p=1.0",
        "sampling.top_k=0",
        "sampling.prompt_buckets=auto",
        "controller.kind=fixed",
        f"controller.group_size={g}",
        f"controller.candidates=[{g}]",
        "loss.algorithm=grpo",
        "loss.kl_beta=0.0",
        f"loss.eps_low={EPS}",
        f"loss.eps_high={EPS}",
        f"loss.logprob_chunk={args.logprob_chunk}",
        f"train.prompts_per_step={args.prompts}",
        f"train.steps={args.warmup + args.steps}",
        f"train.learning_rate={args.lr}",
        "train.lr_schedule=constant",
        "train.warmup_steps=0",
        "train.weight_decay=0.0",
        f"train.max_grad_norm={MAX_GRAD_NORM}",
        "train.epochs=1",
        "train.minibatches=1",
        f"train.microbatches={args.microbatches}",
        "train.skip_no_signal=false",
        f"train.drop_no_signal={str(args.drop == 'on').lower()}",
        f"train.seed={args.seed}",
        "train.eval_every=1000000",
        "train.checkpoint_every=0",
        "logging.tensorboard=false",
        "logging.plots=false",
        "logging.progress=false",
        f"logging.run_dir={run_dir}",
    ]
    return load_config(None, overrides)


# --------------------------------------------------------------------------- sagc-jax side


def child_sagc(args) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU-against-CPU comparison
    from jax import monitoring

    from sagc_jax.train.loop import Trainer
    from sagc_jax.train.metrics import read_metrics

    compiling = [0.0]  # seconds JAX spent tracing, lowering and compiling (its own events)

    def on_duration(name: str, seconds: float, **_) -> None:
        if name.startswith("/jax/core/compile/"):
            compiling[0] += seconds

    monitoring.register_event_duration_secs_listener(on_duration)
    step_compile_s = []
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cfg = sagc_config(args, str(run_dir))
        trainer = Trainer(cfg, run_dir)
        try:
            t0 = time.perf_counter()
            trainer.compile_ahead(log=lambda line: print(f"sagc-jax {line}", flush=True))
            compile_s = time.perf_counter() - t0
            for _ in range(args.warmup + args.steps):
                compiling[0] = 0.0
                record = trainer.step_log(trainer.train_step()).metrics  # advances trainer.step
                step_compile_s.append(compiling[0])
                trainer.writer.write(trainer.step, record, trainer.controller.candidates)
        finally:
            trainer.close()
        steps, _ = read_metrics(run_dir)
    assert [r["step"] for r in steps] == list(range(1, args.warmup + args.steps + 1)), steps
    timed = steps[args.warmup :]
    compiled = [
        r["step"]
        for prev, r in zip(steps[args.warmup - 1 :], timed, strict=False)
        if any(r[k] != prev[k] for k in ("compiles/sampler", "compiles/update"))
    ]
    return {
        "step_s": [r["time/step_s"] for r in timed],
        "rollout_s": [r["time/rollout_s"] for r in timed],
        "update_s": [r["time/update_s"] for r in timed],
        "tokens": [sum(sum(g) for g in r["lengths"]) for r in timed],
        "trained": [r["update/rollouts_trained"] for r in timed],
        "lengths": [n for r in timed for g in r["lengths"] for n in g],
        "reward": [r["reward"] for r in steps],
        "warmup_s": [r["time/step_s"] for r in steps[: args.warmup]],
        "compile_s": compile_s,
        "compiled_steps": compiled,
        "step_compile_s": step_compile_s[args.warmup :],
        "prompt_tokens": [r["prompt_tokens"] for r in steps],
    }


# --------------------------------------------------------------------------- TRL side


def step_prompts(args):
    """(sagc-jax's source, [(templated text, ids, question, answer)] of every step's prompts in
    order): what the sagc-jax Trainer samples at step s, `source.batch(s, 0, prompts)`."""
    from sagc_jax.programs.policy import build_tokenizer
    from sagc_jax.tasks.source import make_source

    with tempfile.TemporaryDirectory() as tmp:
        cfg = sagc_config(args, str(Path(tmp) / "run"))
        source = make_source(cfg, build_tokenizer(cfg), shard_index=0, num_shards=1)
    rows = []
    for step in range(args.warmup + args.steps):
        for p in source.batch(step, 0, args.prompts):
            messages = [
                {"role": "system", "content": source.system_prompt},
                {"role": "user", "content": p.text},
            ]
            text = source.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            rows.append((text, source.encode(p), p.text, p.answer))
    return source, rows


def child_trl(args) -> dict:
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from sagc_jax.tasks.reasoning_gym import score

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(args.threads or cores)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # from_pretrained's "Loading weights"
    _, rows = step_prompts(args)
    dataset = datasets.Dataset.from_dict(
        {
            "prompt": [r[0] for r in rows],
            "question": [r[2] for r in rows],
            "answer": [r[3] for r in rows],
        }
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    def reward_fn(prompts, completions, question, answer, **kwargs):
        return score(list(question), list(completions), list(answer))

    marks: list[tuple[float, float]] = []
    logged: list[dict] = []  # TRL's log of each step
    rollout_s: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            marks.append((time.perf_counter(), 0.0))

        def on_step_end(self, *a, **k):
            marks[-1] = (marks[-1][0], time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "reward" in logs:
                logged.append(dict(logs))

    class Timed(GRPOTrainer):
        # TRL logs no rollout/update split: time its generation + scoring.
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            rollout_s.append(time.perf_counter() - t0)
            return out

    rows_per_step = args.prompts * args.group
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=args.remat == "full",
            per_device_train_batch_size=rows_per_step,
            num_generations=args.group,
            gradient_accumulation_steps=1,
            num_iterations=1,
            shuffle_dataset=False,
            max_completion_length=args.max_new_tokens,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            beta=0.0,
            epsilon=EPS,
            loss_type="grpo",
            scale_rewards="group",
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=MAX_GRAD_NORM,
            max_steps=args.warmup + args.steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            log_completions=False,
            seed=args.seed,
        )
        trainer = Timed(
            model=model,
            reward_funcs=reward_fn,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[Clock()],
        )
        trainer.remove_callback(transformers.PrinterCallback)  # keep the output to our lines
        # the token ids TRL feeds its model are sagc-jax's, prompt for prompt
        fed, _, _ = trainer._tokenize_prompts([r[0] for r in rows])
        for (text, ids, _, _), got in zip(rows, fed, strict=True):
            assert list(got) == list(ids), (text, list(got)[:16], list(ids)[:16])
        print(
            f"trl prompt token ids == sagc-jax's for all {len(rows)} prompts "
            f"({min(len(r[1]) for r in rows)}-{max(len(r[1]) for r in rows)} tokens)",
            flush=True,
        )
        trainer.train()
    steps = args.warmup + args.steps
    assert len(marks) == steps and len(logged) == steps and len(rollout_s) == steps, (
        len(marks),
        len(logged),
        len(rollout_s),
    )
    step_s = [b - a for a, b in marks]
    timed = slice(args.warmup, None)
    tokens = [round(log["completions/mean_length"] * rows_per_step) for log in logged]
    return {
        "step_s": step_s[timed],
        "rollout_s": rollout_s[timed],
        "update_s": [s - r for s, r in zip(step_s[timed], rollout_s[timed], strict=True)],
        "tokens": tokens[timed],
        "lengths": [],  # TRL logs the mean, min and max only
        "mean_length": [log["completions/mean_length"] for log in logged][timed],
        "max_length": [log["completions/max_length"] for log in logged][timed],
        "reward": [log["reward"] for log in logged],
        "warmup_s": step_s[: args.warmup],
    }


# --------------------------------------------------------------------------- parent


def run_child(side: str, args, drop: str = "on") -> tuple[dict, float]:
    """(the child's result, its peak RSS in GiB); ``drop``: the sagc-jax child's ``--drop``."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        argv = [sys.executable, __file__, *sys.argv[1:], "--child", side, "--result", str(result)]
        argv += ["--drop", drop]  # the last one counts
        proc = subprocess.Popen(argv)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"the {side} side failed (exit {proc.returncode})")
        return json.loads(result.read_text()), usage.ru_maxrss / 2**20  # KiB -> GiB


def _timing(res: dict) -> Timing:
    lengths = res["lengths"] or [sum(res["tokens"]) / (len(res["tokens"]) or 1)]
    return Timing(res["step_s"], res["tokens"], lengths)


def _mean(x) -> float:
    return sum(x) / len(x)


def report(name: str, res: dict, rss: float, args) -> Timing:
    t = _timing(res)
    warm = _fmt(res["warmup_s"])
    print(f"{name} steps (s): {_fmt(t.step_s)} (first {args.warmup} untimed: {warm})")
    print(
        f"{name} rollout / update (s): "
        + " ".join(
            f"{r:.2f}/{u:.2f}" for r, u in zip(res["rollout_s"], res["update_s"], strict=True)
        )
    )
    rewards = " ".join(f"{r:.3f}" for r in res["reward"])
    print(f"{name} reward per step (warm-up included): {rewards}")
    if res["lengths"]:
        print(_lengths_summary(name, t, args.max_new_tokens))
    else:
        print(
            f"{name} completion lengths per timed step: mean "
            + " ".join(f"{m:.1f}" for m in res["mean_length"])
            + ", max "
            + " ".join(f"{m:.0f}" for m in res["max_length"])
        )
    extra = f", compile {res['compile_s']:.1f} s" if "compile_s" in res else ""
    print(
        f"{name}: {t.tokens_per_s:,.1f} tok/s, step {t.mean_step_s:.2f} s, rollout "
        f"{_mean(res['rollout_s']):.2f} s, update {_mean(res['update_s']):.2f} s, peak RSS "
        f"{rss:.2f} GiB, {sum(t.tokens)} tokens in {args.steps} timed steps{extra}"
    )
    if "trained" in res:
        trained = " ".join(str(n) for n in res["trained"])
        print(f"{name} rollouts trained per timed step: {trained} of {args.prompts * args.group}")
    if res.get("compiled_steps"):
        less = [s - c for s, c in zip(res["step_s"], res["step_compile_s"], strict=True)]
        print(
            f"{name}: timed steps {res['compiled_steps']} compiled a new program (time included; "
            f"JAX's compile events in the timed steps: {_fmt(res['step_compile_s'])} s): "
            f"{sum(t.tokens) / sum(less):,.1f} tok/s, step {_mean(less):.2f} s less compiling"
        )
    sys.stdout.flush()
    return t


def _summary(name: str, t: Timing, res: dict, rss: float) -> str:
    return (
        f"{name} {t.tokens_per_s:,.1f} tok/s (step {t.mean_step_s:.2f} s, rollout "
        f"{_mean(res['rollout_s']):.2f} s, update {_mean(res['update_s']):.2f} s, peak RSS "
        f"{rss:.2f} GiB)"
    )


def main() -> None:
    args = _parse()
    warnings.filterwarnings("ignore")
    if args.child:
        res = child_sagc(args) if args.child == "sagc" else child_trl(args)
        Path(args.result).write_text(json.dumps(res))
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import jax

    versions = f" | {_versions('trl')}" if args.side != "sagc" else ""
    print(
        f"jax {jax.__version__}{versions} | torch threads {args.threads or cores} | {cores} "
        f"usable cores | load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"work: {Path(args.model).name}, reasoning_gym {args.rg_dataset} {args.rg_config}, "
        f"{args.prompts}x{args.group}, max {args.max_new_tokens} new tokens, lr {args.lr}, "
        f"{args.warmup} warm-up + {args.steps} timed steps, seed {args.seed}",
        flush=True,
    )
    runs = [("trl", "trl", "off")]
    drops = ("on", "off") if args.drop == "both" else (args.drop,)
    runs = [("sagc", f"sagc-jax (drop {d})", d) for d in drops] + runs
    out = {}
    for side, name, drop in runs:
        if args.side in ("both", side):
            res, rss = run_child(side, args, drop)
            out[name] = (side, report(name, res, rss, args), res, rss)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    head = (
        f"real-model grpo step (smollm2-135m, {_task(args)}, {args.prompts}x{args.group}, max "
        f"{args.max_new_tokens} new tokens): "
    )
    line = head + " | ".join(_summary(name, t, res, rss) for name, (_, t, res, rss) in out.items())
    if "trl" in out:
        trl = out["trl"][1].tokens_per_s
        for name, (side, t, res, _) in out.items():
            if side == "sagc":
                line += f" | ratio {name} {t.tokens_per_s / trl:.2f}x"
                less = sum(res["step_s"]) - sum(res["step_compile_s"])
                line += f" ({sum(t.tokens) / less / trl:.2f}x less compiling)"
    print(line)


if __name__ == "__main__":
    main()
