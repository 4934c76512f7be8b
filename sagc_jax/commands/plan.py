"""``sagc-jax plan``: a config's per-device memory from shapes alone, the predicted step time
(``--hardware``), full fine-tuning against LoRA (``--lora-compare``), or every program of the run
compiled for a target (``--compile``)."""

from __future__ import annotations

import argparse

from sagc_jax.commands.common import UserError, add_config_args, load_config
from sagc_jax.config import Config


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="per-device memory of a config (parameters, optimizer, KV cache, activations)",
        description="Shapes only (jax.eval_shape and traced residuals): nothing is allocated. "
        "Splits every array as the trainer would on a mesh of --devices devices.",
    )
    add_config_args(p, config_required=True)
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


def cmd_plan(args: argparse.Namespace) -> int:
    import jax

    from sagc_jax.parallel import ShardingPlan
    from sagc_jax.planning.memory import format_plan
    from sagc_jax.planning.resolve import data_source, resolve_run
    from sagc_jax.planning.timing import format_step, step_prediction
    from sagc_jax.sim.roofline import HARDWARE

    cfg = load_config(args.config, args.overrides)
    if args.devices is not None and args.devices < 1:
        raise UserError(f"--devices {args.devices}: must be >= 1")
    if args.compile is not None:
        return _plan_compile(cfg, args)
    devices = args.devices or jax.device_count()
    memory = args.device_memory
    if memory is None and args.devices is None:  # planning for this machine's devices
        from sagc_jax.planning.resolve import device_memory

        memory = device_memory()[0] / 1024**3  # on CPU: the host's, shared by its devices
    if memory is None and args.hardware in HARDWARE:
        memory = HARDWARE[args.hardware].memory_gib
    memory_bytes = int(memory * 1024**3) if memory else None
    plan = ShardingPlan.abstract(cfg.mesh, devices)
    shape = resolve_run(cfg, plan, source=data_source(cfg), device_bytes=memory_bytes, what_if=True)
    cfg = shape.cfg
    if args.lora_compare is not None:
        from sagc_jax.planning.memory import format_lora_comparison, lora_comparison

        if args.lora_compare < 1:
            raise UserError(f"--lora-compare {args.lora_compare}: the rank must be >= 1")
        print(format_lora_comparison(*lora_comparison(cfg, devices, args.lora_compare)))
        return 0
    step = None
    if args.hardware is not None:  # first: an unknown name stops before anything is printed
        step = step_prediction(cfg, args.hardware, devices, args.mean_new_tokens)
    print(format_plan(shape.memory_plan, memory))
    if args.devices is None and jax.devices()[0].platform == "cpu":
        print(
            "on CPU the devices' memory is this process's own: Python, jax, the data and the "
            "compiled programs come on top (plan --compile cpu measures them and estimates the "
            "run's peak resident memory)"
        )
    if shape.refused:
        print(f"a run of this config on {devices} devices would stop at start-up: {shape.refused}")
    if step is not None:
        print()
        print(format_step(step))
    return 0


def _plan_compile(cfg: Config, args: argparse.Namespace) -> int:
    """``plan --compile``: every program of the run compiled for the target, the table, and exit
    2 with one line when one does not fit or does not compile."""
    from sagc_jax.planning.aot import (
        compile_all,
        compiled_update,
        format_table,
        host_estimate,
        resolve_target,
        run_programs,
        verdict,
    )
    from sagc_jax.planning.host_memory import resident_bytes

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
    host = target.topology == "cpu"  # the programs' memory is this process's own
    start = resident_bytes() if host else None
    compiled = []
    try:
        report = lambda line: print(line, flush=True)  # noqa: E731
        compiled = compile_all(programs, report, host=start is not None)
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
    if start is not None:
        print(host_estimate(start, compiled))
    line = verdict(target, compiled)
    if line:
        raise UserError(line)
    if args.hardware is not None:  # the step's update timed by the compiled program's FLOPs
        from sagc_jax.planning.timing import format_step, step_prediction

        update = compiled_update(compiled)
        flops = None
        if update is not None and not update.windowed_matmuls:
            what = f"the compiled {update.program.name} ({update.program.shapes})"
            flops = (update.step_flops(len(target.devices)), what)
        step = step_prediction(cfg, args.hardware, len(target.devices), args.mean_new_tokens, flops)
        print()
        print(format_step(step))
    return 0
