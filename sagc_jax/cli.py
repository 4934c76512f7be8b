"""The ``sagc-jax`` command line: sft, train, plan, eval, compare, report, export, tokenizer,
simulate, replay, config.

Every subcommand but ``report RUN``, ``export RUN OUT`` and ``tokenizer`` takes
``--config FILE`` and any number of ``--set section.key=value``.
Bad input (config, paths, logs) ends with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import yaml

from sagc_jax.config import Config, ConfigError, load_config, reference_markdown, to_dict

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3  # training stopped: too many non-finite updates in a row
# 4 (sagc_jax.parallel.supervisor.EXIT_PEER_LOST): another process of the run died or failed


class UserError(Exception):
    """Bad input from the user: reported as one line, exit code 2."""


def _add_common(parser: argparse.ArgumentParser, config_required: bool = False) -> None:
    parser.add_argument("--config", type=Path, required=config_required, help="YAML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set controller.delta=0.2",
    )


def _add_timing(parser: argparse.ArgumentParser) -> None:
    """--hardware / --devices / --as-model: shorthands for sim.hardware, sim.devices and
    sim.model, the step-time model that re-times the lengths (``sim.steptime``)."""
    group = parser.add_argument_group("modeled time (the sim section's step-time model)")
    group.add_argument(
        "--hardware",
        help="sim.hardware: h100, h200, a100-80gb, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e, or custom "
        "(the illustrative constants)",
    )
    group.add_argument("--devices", type=int, help="sim.devices: chips of that accelerator")
    group.add_argument(
        "--as-model",
        metavar="MODEL",
        help="sim.model: time the lengths as this model's (a preset or an HF checkpoint)",
    )


def _timing_overrides(args: argparse.Namespace) -> list[str]:
    """The --set overrides of ``_add_timing``'s flags, after the user's own --set."""
    flags = (("hardware", args.hardware), ("devices", args.devices), ("model", args.as_model))
    return args.overrides + [f"sim.{key}={value}" for key, value in flags if value is not None]


def _run_dir(cfg: Config, config_path: Path | None, command: str) -> Path:
    if cfg.logging.run_dir:
        path = Path(cfg.logging.run_dir)
    else:
        stem = config_path.stem if config_path else "defaults"
        path = Path("runs") / f"{command}-{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"{path}: cannot create the run directory ({err.strerror})") from None
    return path


def cmd_config(args: argparse.Namespace) -> int:
    if args.reference:
        print(reference_markdown(), end="")
        return 0
    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


def _compare_and_report(args, workload_factory, command: str):
    """Play sim.controllers over the workload, print and write the table; returns the
    ``StepTimer`` that timed the steps."""
    from sagc_jax.sim import compare
    from sagc_jax.sim.report import format_table, summary_rows, write_csv, write_plots
    from sagc_jax.train.plan import step_timer

    cfg = load_config(args.config, _timing_overrides(args))
    workload = workload_factory(cfg)
    # the sampler's cap: the synthetic workload's, or the logged run's (sampling section)
    cap = cfg.sim.max_new_tokens if command == "simulate" else cfg.sampling.max_new_tokens
    timer = step_timer(cfg, cfg.sim.prompt_tokens + cfg.sim.max_new_tokens, max_new_tokens=cap)
    runs = compare(cfg, workload, timer)
    rows = summary_rows(runs)
    table = format_table(rows, timer.label, bootstrapped=command == "replay")
    out_dir = _run_dir(cfg, args.config, command)
    (out_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    (out_dir / "table.md").write_text(table + "\n")
    written = write_csv(runs, rows, out_dir)
    if cfg.logging.plots:
        written += write_plots(runs, out_dir, cfg.controller.delta)
    c = cfg.controller
    print(
        f"{command}: {workload.num_steps} steps, tau={c.tau}, delta={c.delta}, "
        f"scope={c.scope}, candidates={list(c.candidates)}"
    )
    print(table)
    print(f"wrote {len(written)} files to {out_dir}")
    return timer


def cmd_simulate(args: argparse.Namespace) -> int:
    from sagc_jax.sim import SyntheticWorkload

    timer = _compare_and_report(args, lambda cfg: SyntheticWorkload(cfg.sim), "simulate")
    if args.seeds > 1:
        from sagc_jax.sim.seeds import format_seed_table, run_seeds

        cfg = load_config(args.config, _timing_overrides(args))
        print(
            f"over {args.seeds} seeds (sim.seed and controller.sagc/hybrid.seed + "
            f"0..{args.seeds - 1}, mean +- std; the last two columns paired against sagc):"
        )
        print(format_seed_table(run_seeds(cfg, args.seeds, timer), timer.label))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from sagc_jax.sim import ReplayWorkload

    def workload(cfg: Config):
        try:
            return ReplayWorkload(
                args.log, seed=cfg.sim.seed, default_prompt_tokens=cfg.sim.prompt_tokens
            )
        except ValueError as err:
            raise UserError(str(err)) from None

    _compare_and_report(args, workload, "replay")
    return 0


def _print_summary(title: str, summary: dict, out_dir: Path) -> None:
    plain = {
        k: v
        for k, v in summary.items()
        if (isinstance(v, int | str) and v != "") or (isinstance(v, float) and math.isfinite(v))
    }
    (out_dir / "summary.json").write_text(json.dumps(plain, indent=2, allow_nan=False) + "\n")
    print(
        f"{title}: "
        + ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in plain.items()
        )
    )


def cmd_sft(args: argparse.Namespace) -> int:
    from sagc_jax.train.safety.runlock import RunLock

    cfg = load_config(args.config, args.overrides)
    out_dir = _run_dir(cfg, args.config, "sft")
    with RunLock(out_dir, "sft", report=lambda line: print(f"sft: {line}")):
        return _sft_locked(args, cfg, out_dir)


def _sft_locked(args: argparse.Namespace, cfg: Config, out_dir: Path) -> int:
    from flax import nnx

    from sagc_jax.tasks.source import make_source
    from sagc_jax.train.evaluate import evaluate_policy, policy_sampler
    from sagc_jax.train.policy import build_model
    from sagc_jax.train.safety.faults import phase, resume_hint
    from sagc_jax.train.sft import run_sft, set_aside, sft_progress

    if args.force:
        moved = set_aside(out_dir)
        if moved:
            print(f"sft: --force: {moved}; training from scratch")
    else:
        step, finished = sft_progress(cfg, out_dir)  # refuses a run of another config
        if finished and (out_dir / "summary.json").exists():
            print(f"sft: reusing the warm start in {out_dir} (--force to train it again)")
            return 0
        if step is not None:
            print(f"sft: resuming {out_dir} from step {step}")
    source = make_source(cfg)
    model = build_model(cfg, source.tokenizer, seed=cfg.sft.seed)
    graphdef, params = nnx.split(model)
    result = run_sft(cfg, (graphdef, params, source), out_dir, progress=cfg.logging.progress)
    sampler = policy_sampler(graphdef, model.config, source.tokenizer, sampling=cfg.sampling)
    kept = f"the finished warm start is saved in {out_dir}; {resume_hint(cfg, out_dir)}"
    with phase("the final evaluation", kept):
        result.update(evaluate_policy(sampler, result.pop("params"), source, cfg))
    _print_summary(f"sft done, wrote {out_dir}", result, out_dir)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from sagc_jax.parallel import supervisor  # the supervising parent imports no jax

    cfg = load_config(args.config, args.overrides)
    if _multi_process(args) and not supervisor.is_child():
        return _supervise_train(cfg, args)
    from sagc_jax.parallel import initialize, watch_peers
    from sagc_jax.parallel.distributed import DONE, FAILED, STOPPED

    # before any device use
    initialize(args.coordinator, args.num_processes, args.process_id, args.peer_timeout)
    from sagc_jax.train.safety.faults import received

    run: dict = {}  # the run directory and the trainer, once they exist
    watch = watch_peers(args.peer_timeout, lambda what: _peer_lost_line(run, what))
    mark = FAILED  # what the other processes learn of this one's end
    try:
        code = _train(cfg, args, run)
        mark = DONE
        return code
    except Exception as err:
        if received() is not None:
            mark = STOPPED  # main() ends this process at once
        elif watch is not None and not isinstance(err, _bad_input_errors()):
            watch.explain()  # exits when another process died, stopped or failed
        raise
    except BaseException:  # Interrupted: main() ends this process at once
        mark = STOPPED
        raise
    finally:
        if watch is not None:
            watch.finish(mark)


def _multi_process(args: argparse.Namespace) -> bool:
    """Whether this train command is one process of several (or may be: ``auto``)."""
    if args.coordinator is not None:
        return args.num_processes != 1
    return (
        bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))
        and os.environ.get("JAX_NUM_PROCESSES") != "1"
    )


def _supervise_train(cfg: Config, args: argparse.Namespace) -> int:
    """This process's training, run by ``sagc_jax.parallel.supervisor`` in a child process, so
    that the runtime's abort when process 0 dies ends in one line (exit code 4) here too."""
    from sagc_jax.parallel import supervisor

    run_dir = Path(cfg.logging.run_dir) if cfg.logging.run_dir else None
    num_processes = args.num_processes
    if num_processes is None and (env := os.environ.get("JAX_NUM_PROCESSES", "")).isdigit():
        num_processes = int(env)

    def line(what: str) -> str:
        return _peer_lost_line({"dir": run_dir if run_dir and run_dir.is_dir() else None}, what)

    command = [sys.executable, "-m", "sagc_jax", *args.argv]
    return supervisor.supervise(command, num_processes, line)


def _peer_lost_line(run: dict, what: str) -> str:
    """The line a surviving process prints when another process of the run died or failed:
    which one, the last sealed checkpoint, how to resume. Releases the run lock first (process
    0 holds it) since the process exits without cleaning up."""
    from sagc_jax.train.safety.checkpoint import INTEGRITY_FILE

    if (trainer := run.get("trainer")) is not None:
        with contextlib.suppress(Exception):
            trainer.lock.release()
    if run.get("dir") is None:
        return f"train: {what}; nothing was saved yet; run the same command on every process"
    ckpt = Path(run["dir"]) / "checkpoints"
    sealed = [
        int(p.name)
        for p in (ckpt.iterdir() if ckpt.is_dir() else ())
        if p.name.isdigit() and (p / INTEGRITY_FILE).is_file()
    ]
    saved = (
        f"the last checkpoint is step {max(sealed)} in {ckpt}" if sealed else "no checkpoint yet"
    )
    return f"train: {what}; {saved}; run the same command on every process to resume"


def _train(cfg: Config, args: argparse.Namespace, run: dict) -> int:
    import jax

    from sagc_jax.parallel import is_leader
    from sagc_jax.train.loop import Trainer, TrainingDiverged
    from sagc_jax.train.safety.faults import resume_hint

    if jax.process_count() > 1 and not cfg.logging.run_dir:
        raise UserError(
            "a multi-process run needs logging.run_dir: one directory every process sees (the "
            "default name holds each process's own start time)"
        )

    out_dir = run["dir"] = _run_dir(cfg, args.config, "train")
    try:
        trainer = run["trainer"] = Trainer(cfg, out_dir)
    except BaseException:
        with contextlib.suppress(OSError):
            out_dir.rmdir()  # a start refused in a new directory leaves none behind
        raise
    leader = is_leader()
    if trainer.finished:
        trainer.close()
        if leader:
            print(
                f"train: {out_dir} is finished (step {trainer.step} of train.steps = "
                f"{cfg.train.steps}); nothing changed (raise train.steps to train further)"
            )
        return 0
    if leader:
        print(f"train: {trainer.plan.describe()}, {jax.process_count()} process(es)")
    if trainer.step and leader:
        print(f"train: resuming {out_dir} from step {trainer.step}")
    try:
        summary = trainer.run(progress=cfg.logging.progress)
    except TrainingDiverged as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_DIVERGED
    finally:
        trainer.close()
    if summary["interrupted"]:
        signum = getattr(signal, summary["interrupted"])
        if leader:
            print(
                f"train: stopped by {summary['interrupted']} after step {summary['steps']}; "
                f"checkpoint saved in {out_dir}; {resume_hint(cfg, out_dir)}",
                file=sys.stderr,
            )
        return 128 + signum
    if leader:
        _print_summary(f"train done, wrote {out_dir}", summary, out_dir)
        print(_what_next(cfg, out_dir))
    return 0


def _what_next(cfg: Config, out_dir: Path) -> str:
    """The run's held-out accuracy, first evaluation to last, and the commands to go on with."""
    from sagc_jax.train.metrics import read_metrics

    _, evals = read_metrics(out_dir)
    scored = [e for e in evals if "eval/accuracy" in e]
    lines = []
    if len(scored) >= 2:
        first, last = scored[0], scored[-1]
        lines.append(
            f"held-out accuracy: {first['eval/accuracy']:.3f} at step {first['step']} -> "
            f"{last['eval/accuracy']:.3f} at step {last['step']} ({cfg.train.eval_size} prompts)"
        )
    steps = [
        (f"sagc-jax report {out_dir}", "summary and plots of the run"),
        (f"sagc-jax eval --checkpoint {out_dir}", "evaluate the saved policy again"),
        (f"tensorboard --logdir {out_dir}", "the curves (pip install tensorboard)"),
        (f"sagc-jax export {out_dir} OUT_DIR", "a Hugging Face model directory"),
    ]
    if not cfg.logging.tensorboard:
        steps.pop(2)
    width = max(len(command) for command, _ in steps)
    lines += ["next:", *(f"  {command:<{width}}   {what}" for command, what in steps)]
    return "\n".join(lines)


def _saved_run_config(run: Path) -> tuple[dict, int]:
    """(the config saved with the newest verified checkpoint of ``run``, its step)."""
    from sagc_jax.config import from_dict
    from sagc_jax.train.safety.checkpoint import newest_verified_meta

    if not (run / "checkpoints").is_dir():
        raise UserError(f"{run}: no checkpoints/ directory; --checkpoint takes a run directory")
    step, meta = newest_verified_meta(run / "checkpoints")
    if step is None:
        raise UserError(f"{run / 'checkpoints'}: no complete checkpoint to evaluate")
    try:
        return to_dict(from_dict(meta["config"])), step  # keys added since get defaults
    except ConfigError as err:
        raise UserError(f"{run}: its saved config no longer loads ({err}); pass --config") from None


def cmd_eval(args: argparse.Namespace) -> int:
    from flax import nnx

    from sagc_jax.config import changed_keys, config_differences, config_over_saved
    from sagc_jax.export import merged_run_params
    from sagc_jax.tasks.source import make_source
    from sagc_jax.train.evaluate import evaluate_policy, policy_sampler
    from sagc_jax.train.policy import build_model, build_tokenizer, load_run_params
    from sagc_jax.train.safety.faults import phase

    run = args.checkpoint
    saved, step = _saved_run_config(run)
    if args.config is None:  # the run's own config, with the --set overrides
        cfg = config_over_saved(saved, args.overrides, str(run))
        used = f"the config saved with the run (step {step})"
        if args.overrides:
            used += " with " + " ".join(f"--set {o}" for o in args.overrides)
        print(f"eval {run}: {used}")
    else:
        cfg = load_config(args.config, args.overrides)
        differ = [
            k for k in config_differences(saved, to_dict(cfg)) if not k.startswith("logging.")
        ]
        blocking = changed_keys(saved, cfg, "params")
        if blocking:
            raise UserError(
                f"{run}: its parameters do not fit --config {args.config}, which differs from "
                f"the run's saved config in {', '.join(blocking)}; leave out --config to use "
                f"the run's own"
            )
        listed = ", ".join(differ[:8]) + ("..." if len(differ) > 8 else "")
        print(
            f"eval {run}: config {args.config}"
            + (f"; differs from the run's saved config in {listed}" if differ else "")
        )
    tokenizer = build_tokenizer(cfg) if cfg.data.task != "synthetic" else None
    source = make_source(cfg, tokenizer)
    model = build_model(cfg, source.tokenizer, seed=0)
    graphdef, params = nnx.split(model)
    if cfg.model.lora_rank:  # the adapters merged into their base: the plain model's weights
        params = merged_run_params(run, source.tokenizer)
    else:
        params = load_run_params(run, params, unfinished_ok=True)
    sampler = policy_sampler(graphdef, model.config, source.tokenizer, sampling=cfg.sampling)
    with phase("the evaluation"):
        result = evaluate_policy(sampler, params, source, cfg, args.num)
    print(f"eval {run}: " + ", ".join(f"{k}={v:.4g}" for k, v in result.items()))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from sagc_jax.sim.roofline import HARDWARE
    from sagc_jax.train.plan import format_plan, format_step, memory_plan, step_prediction

    cfg = load_config(args.config, args.overrides)
    if args.devices is not None and args.devices < 1:
        raise UserError(f"--devices {args.devices}: must be >= 1")
    if cfg.sampling.prompt_buckets == "auto":  # the longest bucket comes from the data
        from sagc_jax.tasks.source import make_source, with_resolved_buckets
        from sagc_jax.train.policy import build_tokenizer

        tokenizer = build_tokenizer(cfg) if cfg.data.task != "synthetic" else None
        cfg = with_resolved_buckets(cfg, make_source(cfg, tokenizer))
    import jax

    devices = args.devices or jax.device_count()
    memory = args.device_memory
    if memory is None and args.devices is None:  # planning for this machine's devices
        from sagc_jax.train.safety.preflight import device_memory

        memory = device_memory()[0] / 1024**3  # on CPU: the host's, shared by its devices
    if args.lora_compare is not None:
        from sagc_jax.train.plan import format_lora_comparison, lora_comparison

        if args.lora_compare < 1:
            raise UserError(f"--lora-compare {args.lora_compare}: the rank must be >= 1")
        print(format_lora_comparison(*lora_comparison(cfg, devices, args.lora_compare)))
        return 0
    if args.compile is not None:
        return _plan_compile(cfg, args)
    step = None
    if args.hardware is not None:  # first: an unknown name stops before anything is printed
        step = step_prediction(cfg, args.hardware, devices, args.mean_new_tokens)
        memory = memory or HARDWARE[args.hardware].memory_gib
    print(format_plan(memory_plan(cfg, devices, int(memory * 1024**3) if memory else None), memory))
    if step is not None:
        print()
        print(format_step(step))
    return 0


def _plan_compile(cfg: Config, args: argparse.Namespace) -> int:
    """``plan --compile``: every program of the run compiled for the target, the table, and exit
    2 with one line when one does not fit or does not compile."""
    from sagc_jax.train.aot import (
        compile_all,
        compiled_update,
        format_table,
        resolve_target,
        run_programs,
        verdict,
    )

    target = resolve_target(args.compile, args.device_memory)
    programs = run_programs(cfg, target, args.shapes)
    if args.programs:
        wanted = [w.strip() for w in args.programs.split(",") if w.strip()]
        programs = [p for p in programs if any(p.name.startswith(w) for w in wanted)]
        if not programs:
            raise UserError(
                f"--programs {args.programs}: matches none of this run's programs; start each "
                f"name with sampler, tail, update, eval or merge"
            )
    print(f"plan --compile: {len(programs)} programs for {target.describe()}", flush=True)
    compiled = []
    try:
        compiled = compile_all(programs, report=lambda line: print(line, flush=True))
    except Exception as err:  # noqa: BLE001 - the compiler's refusal, reported in one line
        failed = programs[len(compiled)] if len(compiled) < len(programs) else programs[-1]
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        # a TPU compiler refuses a program whose buffers exceed the chip's HBM
        what = "does not fit" if "RESOURCE_EXHAUSTED" in reason else "does not compile for"
        raise UserError(
            f"{failed.name} ({failed.shapes}) {what} {target.topology}: {reason[:300]}"
        ) from None
    print()
    print(format_table(target, compiled))
    line = verdict(target, compiled)
    if line:
        raise UserError(line)
    if args.hardware is not None:  # the step's update timed by the compiled program's FLOPs
        from sagc_jax.train.plan import format_step, step_prediction

        update = compiled_update(compiled)
        flops = None
        if update is not None:
            what = f"the compiled {update.program.name} ({update.program.shapes})"
            flops = (update.step_flops(len(target.devices)), what)
        step = step_prediction(cfg, args.hardware, len(target.devices), args.mean_new_tokens, flops)
        print()
        print(format_step(step))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from sagc_jax.analysis.compare import compare, format_tables
    from sagc_jax.config import parse_controller_spec

    cfg = load_config(args.config, _timing_overrides(args))
    controllers = [c.strip() for c in args.controllers.split(",") if c.strip()]
    for spec in controllers:
        parse_controller_spec(spec)
    if args.seeds < 1 or (args.steps is not None and args.steps < 1):
        raise UserError(f"--seeds {args.seeds} / --steps {args.steps}: both must be >= 1")
    out_dir = _run_dir(cfg, args.config, "compare")
    result = compare(cfg, controllers, args.seeds, args.steps, out_dir, cfg.logging.progress)
    print(format_tables(result))
    print(f"wrote compare.md, compare.csv, runs.csv and plots to {out_dir}")
    return 0


def _run_ladder_and_budget(run: Path) -> tuple[tuple[int, ...], float | None]:
    """(``controller.candidates``, ``controller.delta``) of the config saved with the
    newest checkpoint of ``run``, read without verifying or moving anything (the run may still
    be training); ((), None) when there is no checkpoint or its config no longer loads."""
    from sagc_jax.config import from_dict

    if not (run / "checkpoints").is_dir():
        return (), None
    from sagc_jax.train.safety.checkpoint import CheckpointStore

    store = CheckpointStore(run / "checkpoints", async_save=False)
    try:
        step = store.latest_step()
        if step is None:
            return (), None
        controller = from_dict(store.read_meta(step)["config"]).controller
    except (ConfigError, OSError, KeyError, ValueError):  # unreadable, or keys since removed
        return (), None
    finally:
        store.close()
    return controller.candidates, controller.delta


def cmd_report(args: argparse.Namespace) -> int:
    from sagc_jax.analysis.run_report import plot_runs
    from sagc_jax.train.metrics import read_metrics, summarize

    try:
        steps, evals = read_metrics(args.run_dir)
    except FileNotFoundError as err:
        raise UserError(str(err)) from None
    summary = summarize(steps, evals)
    if steps:
        candidates, delta = _run_ladder_and_budget(args.run_dir)
        plot_runs({args.run_dir.name: (steps, evals)}, args.run_dir / "report", candidates, delta)
    print(
        f"report {args.run_dir}: "
        + ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()
        )
    )
    if steps:
        print(f"plots in {args.run_dir / 'report'}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from sagc_jax.export import export_run

    export_run(
        args.run_dir, args.out_dir, adapters_only=args.adapters_only, unfinished_ok=args.unfinished
    )
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from sagc_jax.models.tokenizer import train_tokenizer
    from sagc_jax.tasks import load_dataset

    out = args.out
    if (out / "tokenizer.json").exists() and not args.force:
        raise UserError(f"{out / 'tokenizer.json'} exists; choose another --out or add --force")
    rows = [row for path in args.data for row in load_dataset(path)]
    texts = (text for row in rows for text in (row.prompt, row.answer))
    try:
        tok = train_tokenizer(texts, out, kind=args.kind, vocab_size=args.vocab_size)
    except ValueError as err:
        raise UserError(f"--kind {args.kind} --vocab-size {args.vocab_size}: {err}") from None
    except OSError as err:
        raise UserError(f"{out}: cannot write the tokenizer ({err.strerror})") from None
    print(
        f"tokenizer: wrote {out / 'tokenizer.json'} and tokenizer_config.json ({args.kind}, "
        f"{tok.vocab_size} tokens, from {len(rows)} rows); train with --set model.tokenizer={out}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sagc-jax",
        description="JAX-native GRPO/DAPO trainer with Straggler-Aware Group Control.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "sft",
        help="supervised warm start on task traces",
        description="Next-token training on reference traces of the synthetic task; writes "
        "Orbax checkpoints into the run directory (every sft.checkpoint_every steps, at a stop "
        "signal, at the end) for train.init_checkpoint. A finished run directory is reused and "
        "an unfinished one resumed when its config matches on the keys that shape the warm "
        "start (model, sft, data, sampling.max_new_tokens); otherwise it is refused.",
    )
    _add_common(p)
    p.add_argument(
        "--force",
        action="store_true",
        help="train again from scratch (the old checkpoints move to checkpoints.replaced/)",
    )
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser(
        "train",
        help="GRPO/DAPO training with the configured group-size controller",
        description="Each step: controller.propose -> rollout -> rewards -> advantages -> "
        "update -> controller.observe. Writes metrics.jsonl (replayable), TensorBoard events "
        "and Orbax checkpoints into the run directory; pointing logging.run_dir at an existing "
        "run resumes it from its latest checkpoint.",
    )
    _add_common(p)
    dist = p.add_argument_group(
        "multi-process (one process per host; every process runs the same command)"
    )
    dist.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="address of process 0 for jax.distributed, or 'auto' on Cloud TPU VMs / SLURM "
        "(default: $JAX_COORDINATOR_ADDRESS if set, else one process)",
    )
    dist.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
    dist.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1")
    dist.add_argument(
        "--peer-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a process whose heartbeat stops for this long is dead: the others stop within it "
        "(+1 s) with one line naming it and the last checkpoint, exit code 4 (default: "
        "%(default)g; jax.distributed's own heartbeat timeout is set to twice this)",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "plan",
        help="per-device memory of a config (parameters, optimizer, KV cache, activations)",
        description="Shapes only (jax.eval_shape and traced residuals): nothing is allocated. "
        "Splits every array as the trainer would on a mesh of --devices devices.",
    )
    _add_common(p, config_required=True)
    p.add_argument(
        "--devices", type=int, help="devices of the run (default: this machine's device count)"
    )
    p.add_argument(
        "--device-memory",
        type=float,
        metavar="GIB",
        help="memory of one device, to say whether the config fits (default: --hardware's, or "
        "without --devices this machine's: an accelerator's limit, on CPU the host's memory)",
    )
    p.add_argument(
        "--hardware",
        help="also predict one step's rollout and update seconds on this accelerator by the "
        "roofline model: h100, h200, a100-80gb, tpu-v4, tpu-v5e, tpu-v5p or tpu-v6e",
    )
    p.add_argument(
        "--mean-new-tokens",
        type=int,
        metavar="N",
        help="with --hardware: mean completion length of the predicted step (default: half of "
        "sampling.max_new_tokens; one completion always reaches it)",
    )
    p.add_argument(
        "--lora-compare",
        type=int,
        metavar="RANK",
        help="instead: the per-device memory of full fine-tuning against LoRA adapters of this "
        "rank (on model.lora_targets), item by item, and whether each fits one 24, 48 or 80 GB "
        "GPU and one TPU v5e chip",
    )
    p.add_argument(
        "--compile",
        metavar="TARGET",
        help="instead: compile every program of the run for TARGET, "
        "and print the compiler's per-device memory and FLOPs beside this plan's; TARGET: "
        "a TPU topology (v5p:2x2x4, v5e:4x4, v6e:4x4, v4:2x2x4) or Cloud name (v5p-32, "
        "v5litepod-16, v6e-16, v4-32), compiled without the TPU (needs the tpu-aot extra), or "
        "cpu (this host's CPU devices)",
    )
    p.add_argument(
        "--shapes",
        choices=("largest", "all"),
        default="largest",
        help="with --compile: largest (the largest prompt bucket and packed row rung of each "
        "G, which bound the memory) or all (every bucket and rung a run may compile)",
    )
    p.add_argument(
        "--programs",
        metavar="NAMES",
        help="with --compile: only these programs, comma-separated name prefixes: sampler, "
        "tail, update, eval, merge (default: all)",
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "eval",
        help="held-out accuracy and mean completion length of a run",
        description="Evaluates with the config saved in the run's checkpoint (plus any --set); "
        "--config FILE replaces it, and the keys that differ from the saved one are listed.",
    )
    _add_common(p)
    p.add_argument("--checkpoint", type=Path, required=True, help="run directory to evaluate")
    p.add_argument("--num", type=int, default=None, help="held-out prompts (train.eval_size)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "compare",
        help="train under several controllers side by side and tabulate the results",
        description="Runs the config once per controller and seed, one after the other (seed "
        "by seed, every controller in turn, so that a drift of the machine's speed falls on "
        "all alike), into one directory; writes compare.md, compare.csv and PNG plots.",
    )
    _add_common(p, config_required=True)
    p.add_argument(
        "--controllers",
        default="fixed:4,fixed:8,fixed:16,sagc,sagc_plus",
        help="comma-separated controller specs (default: %(default)s)",
    )
    p.add_argument("--seeds", type=int, default=1, help="seeds per controller")
    p.add_argument("--steps", type=int, default=None, help="step budget (default: train.steps)")
    _add_timing(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("report", help="summary and plots of one run (finished or running)")
    p.add_argument("run_dir", type=Path, help="a sagc-jax train run directory")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "export",
        help="a run's newest checkpoint as a Hugging Face model directory (LoRA: merged, and "
        "the adapters in PEFT's layout)",
        description="Writes OUT_DIR/config.json and model.safetensors (a LoRA run's adapters "
        "merged into the weights) and the run's tokenizer files; for a LoRA run also "
        "OUT_DIR/adapter/ (adapter_config.json, adapter_model.safetensors) for "
        "peft.PeftModel.from_pretrained over its base: model.hf_checkpoint, or else the base "
        "written to OUT_DIR/base/.",
    )
    p.add_argument("run_dir", type=Path, help="a sagc-jax train (or sft) run directory")
    p.add_argument("out_dir", type=Path, help="a new (or empty) directory to write")
    p.add_argument(
        "--adapters-only",
        action="store_true",
        help="LoRA run over model.hf_checkpoint: only the PEFT adapters, into OUT_DIR",
    )
    p.add_argument(
        "--unfinished",
        action="store_true",
        help="export the newest checkpoint of a run that has not reached its last step",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "tokenizer",
        help="build a tokenizer directory from a dataset's text (no Hugging Face model needed)",
        description="Trains a tokenizer on the prompts and answers of JSONL/Parquet files and "
        "writes tokenizer.json and tokenizer_config.json (pad/bos/eos tokens, a chat template) "
        "into --out, for model.tokenizer.",
    )
    p.add_argument(
        "--data", type=Path, nargs="+", required=True, metavar="FILE", help="dataset files"
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="directory to write")
    p.add_argument(
        "--kind",
        choices=("bpe", "char"),
        default="bpe",
        help="bpe: byte-level BPE trained on the text; char: one token per character "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=512,
        metavar="N",
        help="most tokens, specials included; at most the model's vocabulary (default: "
        "%(default)s, the tiny preset's)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing tokenizer in --out")
    p.set_defaults(func=cmd_tokenizer)

    p = sub.add_parser("config", help="print the resolved configuration as YAML")
    _add_common(p)
    p.add_argument(
        "--reference",
        action="store_true",
        help="print every key with its default, what it accepts and its meaning (Markdown: "
        "docs/config.md) instead",
    )
    p.set_defaults(func=cmd_config)

    p = sub.add_parser(
        "simulate",
        help="compare controllers on a synthetic rollout-length workload (no accelerator)",
        description="Run every controller of sim.controllers over the workload of the sim "
        "section; print a table and write CSV files and PNG plots into the run directory.",
    )
    _add_common(p)
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="also run seeds 0..N-1 and print mean +- std and differences paired against sagc",
    )
    _add_timing(p)
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser(
        "replay",
        help="compare controllers on lengths logged by a real run (JSONL)",
        description="Like simulate, but the lengths come from a JSONL log with one object per "
        "step holding 'lengths': [[int, ...], ...] (one list per group).",
    )
    _add_common(p)
    p.add_argument("--log", type=Path, required=True, help="JSONL file of per-step lengths")
    _add_timing(p)
    p.set_defaults(func=cmd_replay)
    return parser


def _bad_input_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean bad user input (a sentence, not a traceback)."""
    from sagc_jax.tasks import DatasetError, RewardError

    errors: tuple[type[Exception], ...] = (ConfigError, UserError, DatasetError, RewardError)
    if "sagc_jax.train.safety.checkpoint" in sys.modules:  # only loaded by commands that read runs
        from sagc_jax.train.safety.checkpoint import CheckpointError
        from sagc_jax.train.safety.runlock import RunDirError

        errors += (CheckpointError, RunDirError)
    if "sagc_jax.models" in sys.modules:  # only loaded by commands that build a model
        from sagc_jax.models import CheckpointMismatchError

        errors += (CheckpointMismatchError,)
    return errors


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. SIGINT/SIGTERM end it with one line on stderr and exit code 128 +
    the signal number (130, 143), whatever it was doing (see ``sagc_jax.train.safety.faults``)."""
    from sagc_jax.train.safety.faults import Interrupted, received, stop_signals

    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # what a supervised child reruns

    def stopped(stop: Interrupted) -> int:
        print(stop.message(args.command), file=sys.stderr)
        if argv is None:  # this process is the command (not a caller's test)
            # Interpreter teardown can crash (SIGSEGV) after an import or a compilation that
            # the signal cut short; every file is written and closed by now, so skip it.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + stop.signum)
        return 128 + stop.signum

    with stop_signals():
        try:
            code = args.func(args)
        except Interrupted as stop:
            return stopped(stop)
        except Exception as err:
            if received() is not None:  # the stop, wrapped into another error (a JAX callback)
                return stopped(Interrupted(received()))
            if not isinstance(err, _bad_input_errors()):
                raise
            # Multi-line messages (a header, then one line per problem): header, first
            # problem, count.
            lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [""]
            head = " ".join(lines[:2])
            more = f" (+{len(lines) - 2} more)" if len(lines) > 2 else ""
            print(f"error: {head}{more}", file=sys.stderr)
            return EXIT_BAD_INPUT
        if code == 0 and received() is not None:  # swallowed, and the command ran to its end
            return stopped(Interrupted(received(), "", "it had finished: its results are written"))
        return code


if __name__ == "__main__":
    sys.exit(main())
