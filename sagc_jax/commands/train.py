"""``sagc-jax train``: GRPO/DAPO training under the configured group-size controller, on one
process or several (``sagc_jax.parallel.supervisor`` runs each of several)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path

from sagc_jax.commands.common import (
    UserError,
    add_config_args,
    bad_input_errors,
    load_config,
    print_summary,
    run_dir,
)
from sagc_jax.config import Config

EXIT_DIVERGED = 3  # training stopped: too many non-finite updates in a row


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="GRPO/DAPO training with the configured group-size controller",
        description="Each step: controller.propose -> rollout -> rewards -> advantages -> "
        "update -> controller.observe. Writes metrics.jsonl (replayable), TensorBoard events "
        "and Orbax checkpoints into the run directory; pointing logging.run_dir at an existing "
        "run resumes it from its latest checkpoint.",
    )
    add_config_args(p)
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
        "%(default)g; jax.distributed's own heartbeat timeout, the backstop, is set to this plus "
        "the larger of this and 60 s)",
    )
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from sagc_jax.parallel import supervisor  # the supervising parent imports no jax

    cfg = load_config(args.config, args.overrides)
    if supervisor.should_supervise(args.coordinator, args.num_processes):
        named = Path(cfg.logging.run_dir) if cfg.logging.run_dir else None

        def line(what: str) -> str:
            return _peer_lost_line({"dir": named if named and named.is_dir() else None}, what)

        return supervisor.rerun_supervised(args.argv, args.num_processes, line)
    from sagc_jax.parallel.distributed import run_rank
    from sagc_jax.train.safety.faults import received

    run: dict = {}  # the run directory and the trainer, once they exist
    return run_rank(
        lambda: _train(cfg, args, run),
        lambda what: _peer_lost_line(run, what),
        coordinator=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        peer_timeout=args.peer_timeout,
        stopped=lambda: received() is not None,
        bad_input=bad_input_errors,
    )


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
    from sagc_jax.train.hooks import TrainingDiverged
    from sagc_jax.train.loop import Trainer
    from sagc_jax.train.safety.faults import resume_hint

    if jax.process_count() > 1 and not cfg.logging.run_dir:
        raise UserError(
            "a multi-process run needs logging.run_dir: one directory every process sees (the "
            "default name holds each process's own start time)"
        )

    out_dir = run["dir"] = run_dir(cfg, args.config, "train")
    try:
        trainer = run["trainer"] = Trainer(cfg, out_dir)
    except BaseException:
        with contextlib.suppress(OSError):
            out_dir.rmdir()  # a start refused in a new directory leaves none behind
        raise
    leader = is_leader()
    if trainer.finished:
        # a run whose summary.json was not written (a full disk at the very end) gets it now
        summary = trainer.summary() if not (out_dir / "summary.json").exists() else None
        trainer.close()
        if leader:
            print(
                f"train: {out_dir} is finished (step {trainer.step} of train.steps = "
                f"{cfg.train.steps}); nothing changed (raise train.steps to train further)"
            )
            if summary is not None:
                print_summary("train: wrote its missing summary.json", summary, out_dir)
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
        print_summary(f"train done, wrote {out_dir}", summary, out_dir)
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
            f"{last['eval/accuracy']:.3f} at step {last['step']} "
            f"({last.get('eval/prompts', cfg.train.eval_size)} prompts)"
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
