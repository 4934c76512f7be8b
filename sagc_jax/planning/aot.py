"""``sagc-jax plan --compile TARGET``: compile every program a run of a config would compile, for
a TPU slice that need not exist or for this host's CPU devices, and set the compiler's figures
beside ``sagc-jax plan``'s formula.

With ``libtpu`` installed (the ``tpu-aot`` extra), ``jax.experimental.topologies`` describes the
devices of any TPU slice, and ``jit(...).lower(abstract inputs).compile()`` builds the real TPU
executable on a CPU host: its ``memory_analysis()`` (argument, output, temporary bytes per chip)
and ``cost_analysis()`` (FLOPs, bytes accessed) are the compiler's, not a model's. The inputs are
``jax.ShapeDtypeStruct`` with the run's shardings: no weight is loaded and nothing is allocated.

The programs (``run_programs``): the rollout sampler of every candidate G (tail-batched steps'
too), the update of every packed row-count rung (or padded batch), the held-out evaluation
sampler, and with LoRA the merge of the adapters into the weights the samplers decode.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from sagc_jax.config import Config, ConfigError
from sagc_jax.models.layers import attention_platform
from sagc_jax.parallel import ShardingPlan
from sagc_jax.planning.host_memory import resident_bytes
from sagc_jax.planning.memory import GIB, device_bytes
from sagc_jax.planning.resolve import RunShape, data_source, resolve_run
from sagc_jax.programs.packing import row_ladder
from sagc_jax.programs.update import batch_spec, packed_batch_spec
from sagc_jax.sampling.sampler import Sampler, policy_sampler
from sagc_jax.sim.roofline import HARDWARE, model_costs, update_passes

# TPU generations a target may name: the roofline preset with the chip's HBM, and whether the
# Cloud name's number counts TensorCores (two per chip: v4, v5p) or chips (v5e, v6e).
GENERATIONS = {
    "v4": ("tpu-v4", 2),
    "v5p": ("tpu-v5p", 2),
    "v5e": ("tpu-v5e", 1),
    "v5litepod": ("tpu-v5e", 1),
    "v6e": ("tpu-v6e", 1),
}
# Chips -> the slice's shape, as Cloud TPU builds them (3D tori for v4/v5p, 2D for v5e/v6e).
SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"}
SHAPES_3D |= {256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16"}
SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16"}
SHAPES_2D |= {256: "16x16"}
TARGET_HELP = (
    "a TPU topology (v5p:2x2x4, v5e:4x4, v6e:4x4, v4:2x2x4) or Cloud name (v5p-32, "
    "v5litepod-16, v6e-16, v4-32), or cpu (this host's CPU devices)"
)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the programs are compiled for."""

    name: str  # as the user gave it
    topology: str  # "v5p:2x2x4", or "cpu"
    devices: tuple  # the slice's devices (TPU: described by libtpu, not attached)
    hardware: str | None  # roofline preset of the chip (its HBM), None on CPU
    memory_bytes: int | None  # one device's memory to fit in (None: not judged)

    @property
    def processes(self) -> int:
        """Hosts of the slice: each runs one process of the run."""
        return len({d.process_index for d in self.devices})

    @property
    def platform(self) -> str:
        return self.devices[0].platform

    def describe(self) -> str:
        kind = HARDWARE[self.hardware].name if self.hardware else "CPU"
        return f"{self.topology}: {len(self.devices)} {kind} devices, {self.processes} host(s)"


def parse_topology(name: str) -> tuple[str, str]:
    """(topology as libtpu names it, roofline preset) of a topology or Cloud TPU name; a bad name
    raises ConfigError saying what is allowed."""
    text = name.strip().lower()
    if m := re.fullmatch(r"(v4|v5p|v5e|v6e):(\d+(?:x\d+){1,2})", text):
        gen, dims = m.groups()
        rank = 3 if GENERATIONS[gen][1] == 2 else 2  # 3D tori: v4, v5p
        if len(dims.split("x")) != rank:
            shape = "AxBxC" if rank == 3 else "AxB"
            raise ConfigError(f"--compile {name}: a {gen} slice has {rank} dimensions ({shape})")
        return f"{gen}:{dims}", GENERATIONS[gen][0]
    if m := re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", text):
        gen, count = m.group(1), int(m.group(2))
        preset, cores_per_chip = GENERATIONS[gen]
        chips, odd = divmod(count, cores_per_chip)
        shapes = SHAPES_3D if cores_per_chip == 2 else SHAPES_2D
        if odd or chips not in shapes:
            sizes = ", ".join(f"{gen}-{c * cores_per_chip}" for c in sorted(shapes))
            raise ConfigError(f"--compile {name}: not a {gen} slice size; use one of {sizes}")
        gen = "v5e" if gen == "v5litepod" else gen
        return f"{gen}:{shapes[chips]}", preset
    raise ConfigError(f"--compile {name}: use {TARGET_HELP}")


def resolve_target(name: str, device_memory_gib: float | None = None) -> Target:
    """The devices of ``name``: a TPU slice described by libtpu (no TPU needed), or ``cpu``."""
    memory = int(device_memory_gib * GIB) if device_memory_gib else None
    if name.strip().lower() == "cpu":
        return Target(name, "cpu", tuple(jax.devices("cpu")), None, memory)
    topology, preset = parse_topology(name)
    try:
        from jax.experimental import topologies

        desc = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    except Exception as err:  # noqa: BLE001 - libtpu missing or refusing: one line either way
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if importlib.util.find_spec("libtpu") is None:
            why = "libtpu is not installed: pip install -e '.[tpu-aot]' (jax[tpu] of this jax)"
        elif "lockfile" in first:  # one process per host may load libtpu
            why = (
                "another process on this host has libtpu loaded (/tmp/libtpu_lockfile): wait "
                "for it, or set ALLOW_MULTIPLE_LIBTPU_LOAD=1"
            )
        else:
            why = f"libtpu: {first[:200]}"
        raise ConfigError(f"--compile {name}: cannot describe {topology}; {why}") from None
    memory = memory or int(HARDWARE[preset].memory_gib * GIB)
    return Target(name, topology, tuple(desc.devices), preset, memory)


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of a run, ready to lower: ``lower()`` gives the ``jax.stages.Lowered``."""

    name: str
    shapes: str
    lower: Callable[[], jax.stages.Lowered]
    resident: int  # per-device bytes of the run's state held beside it (not its arguments)
    estimate: int | None  # sagc-jax plan's formula, per device, the resident state included
    flops: float | None  # the roofline's FLOPs per device, as the cost analysis counts them
    loop_scale: float = 1.0  # the whole program's FLOPs over what the cost analysis counts


@dataclasses.dataclass(frozen=True)
class Compiled:
    """The compiler's figures for one program (per device)."""

    program: Program
    seconds: float
    argument: int
    output: int
    temporary: int
    alias: int
    flops: float
    bytes_accessed: float
    windowed_matmuls: int = 0  # matmuls the partitioner made loops (see windowed_matmuls)
    host_growth: int | None = None  # CPU: resident bytes the compile added (code, compiler's)

    def step_flops(self, devices: int) -> float:
        """FLOPs of one run of the whole program on ``devices`` devices (every loop trip)."""
        return self.flops * self.program.loop_scale * devices

    @property
    def peak(self) -> int:
        """Bytes held while it runs: its arguments, outputs (less those aliasing donated
        arguments), temporaries, and the run's state that stays beside it."""
        return self.argument + self.output - self.alias + self.temporary + self.program.resident


def loops_counted_once(devices) -> bool:
    """Whether the target's cost analysis counts a loop's body once (XLA's HLO cost analysis
    does, whatever the trip count): probed with a 4-step scan of one matmul."""
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=sharding)

    def four(a):
        return jax.lax.scan(lambda c, _: (c @ c, None), a, None, length=4)[0]

    flops = jax.jit(four).lower(x).compile().cost_analysis()
    flops = flops[0] if isinstance(flops, list) else flops
    return flops.get("flops", 0.0) < 2 * 2 * 64**3


def run_programs(cfg: Config, target: Target, shapes: str = "largest") -> list[Program]:
    """Every program a run of ``cfg`` compiles on ``target`` (``shapes``: ``largest``, the
    largest prompt bucket and packed rung of each G, which bound the memory; ``all``: every
    bucket and rung). Prompt buckets must be concrete (``auto`` resolved from the data)."""
    if shapes not in ("largest", "all"):
        raise ConfigError(f"--shapes {shapes}: use largest or all")
    plan = ShardingPlan.from_config(cfg.mesh, target.devices)
    processes = target.processes
    shape = resolve_run(
        cfg,
        plan,
        processes=processes,
        source=data_source(cfg),
        device_bytes=target.memory_bytes,
    )
    cfg, memory = shape.cfg, shape.memory
    m, s, t = cfg.model, cfg.sampling, cfg.train

    # The run's state, abstract, as the trainer builds it (the memory model's).
    arch, run, state = memory.arch, memory.run, memory.state
    decoded = memory.decoded  # what the samplers decode (with LoRA: the base, merged into)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=plan.replicated)

    # What stays in memory beside a sampler: everything trained, less what it decodes.
    state_bytes = device_bytes(state)
    decoded_bytes = device_bytes(decoded)
    beside_sampler = state_bytes - (0 if state.base is not None else decoded_bytes)

    buckets = sorted(s.prompt_buckets)
    buckets = buckets if shapes == "all" else buckets[-1:]
    new = s.max_new_tokens

    def sampler(slots: int) -> Sampler:
        graphdef, shardings = run.sampling_graphdef, run.sampling_shardings
        return policy_sampler(graphdef, arch, None, plan, shardings, cfg.sampling, slots)

    def on_target(fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` lowered as on the target ("auto" attention its platform's)."""

        def lower():
            with attention_platform(target.platform):
                return fn(*args, **kwargs)

        return lower

    rollout_sampler = sampler(shape.slots)
    out: list[Program] = []
    if run.merge is not None:
        out.append(
            Program(
                "merge adapters",
                f"rank {m.lora_rank} into {decoded_bytes / GIB:.2f} GiB/device",
                on_target(run.merge.lower, state.params, state.base),
                state_bytes,
                None,
                None,
            )
        )
    estimates = {}
    for label, (rollouts, prompts) in shape.rollouts.items():
        g = rollouts // prompts
        with attention_platform(target.platform):  # the residuals of the target's attention
            planned = memory.plan(rollout_sampler.slots_for(rollouts), g)
            estimates[label] = {
                "sampler": planned.during("sampling"),
                "update": planned.during("update"),
            }
        for bucket in buckets:
            lower = on_target(
                rollout_sampler.lower,
                decoded,
                rollouts,
                bucket,
                max_new_tokens=new,
                prompts=prompts,
            )
            detail = f"{rollouts} rollouts of {prompts} prompts, {bucket} + {new} tokens"
            slots = rollout_sampler.slots_for(rollouts)
            detail += f", {slots} slots" if slots < rollouts else ""
            out.append(
                Program(
                    f"sampler {label}",
                    detail,
                    lower,
                    beside_sampler,
                    estimates[label]["sampler"] if bucket == buckets[-1] else None,
                    None,
                )
            )
    for g, (started, keep) in shape.tail_rollouts.items():
        lower = on_target(
            rollout_sampler.lower,
            decoded,
            started * g,
            buckets[-1],
            max_new_tokens=new,
            prompts=started,
            keep_groups=keep,
        )
        detail = f"{started * g} rollouts of {started} prompts, keeps {keep * processes}"
        out.append(Program(f"tail sampler G={g}", detail, lower, beside_sampler, None, None))

    counted_once = loops_counted_once(target.devices)
    for label, (rollouts, _) in shape.rollouts.items():
        batches = _update_batches(shape, plan, rollouts, buckets, shapes)
        for i, (rows, width, batch) in enumerate(batches):
            lower = on_target(run.lower_update, state, batch, key)
            layout = "packed" if t.packing else "padded"
            flops, scale = _update_flops(cfg, arch, rows, width, len(target.devices), counted_once)
            top = i == len(batches) - 1  # the largest rung or bucket, which plan's estimate sizes
            out.append(
                Program(
                    f"update {label}",
                    f"{rows} {layout} rows x {width} tokens",
                    lower,
                    0,
                    estimates[label]["update"] if top else None,
                    flops,
                    scale,
                )
            )
    if t.eval_every:
        shards = plan.batch_shards
        rows = t.eval_size + (-t.eval_size % shards)
        eval_sampler = sampler(shape.eval_slots)  # as the trainer's
        lower = on_target(
            eval_sampler.lower, decoded, rows, buckets[-1], max_new_tokens=new, prompts=rows
        )
        slots = eval_sampler.slots_for(rows)
        detail = f"{rows} held-out prompts, greedy, {buckets[-1]} + {new} tokens, {slots} at once"
        out.append(Program("eval sampler", detail, lower, beside_sampler, None, None))
    return _unique(out)


def _unique(programs: list[Program]) -> list[Program]:
    """One entry per distinct program: a fixed budget gives every G the same update rows."""
    seen, out = set(), []
    for p in programs:
        key = (p.name.split()[0], p.shapes)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _update_batches(shape: RunShape, plan, rollouts: int, buckets, shapes: str):
    """(global rows, tokens per row, abstract batch) of each update program of a step of
    ``rollouts`` rollouts: the packed rungs (the top one with ``largest``) or one padded batch
    per prompt bucket."""
    new, processes = shape.cfg.sampling.max_new_tokens, shape.processes
    if not shape.cfg.train.packing:
        return [(rollouts, b + new, batch_spec(rollouts, b, new, plan.rows)) for b in buckets]
    pack_len = shape.pack_len
    rungs = row_ladder(shape.row_multiple, rollouts // processes)
    rungs = rungs if shapes == "all" else rungs[-1:]
    return [
        (r * processes, pack_len, packed_batch_spec(r * processes, pack_len, plan.rows))
        for r in rungs
    ]


def _update_flops(
    cfg: Config, arch, rows: int, width: int, devices: int, counted_once: bool
) -> tuple[float, float]:
    """The roofline's update FLOPs per device (forward + backward = 3 forwards of every token,
    causal attention over the row, and the reference policy's forward with a KL term), counted
    as the cost analysis counts them (with loop bodies counted once: one update of the first
    microbatch plus the body of the rest), and the factor from those to the whole program's."""
    t = cfg.train
    micro_rows = rows // (t.minibatches * t.microbatches)
    tokens = micro_rows * width
    passes = update_passes(cfg.loss.kl_beta > 0)
    micro = passes * model_costs(arch).forward_flops(tokens, tokens * (width + 1) / 2)
    whole = t.microbatches * t.minibatches * t.epochs
    counted = min(t.microbatches, 2) if counted_once else whole
    return micro * counted / devices, whole / counted


def windowed_matmuls(hlo_text: str) -> int:
    """Loops of a compiled program that are one matmul split by the SPMD partitioner into a
    window per shard of a gathered (or reduce-scattered) operand ("collective matmuls", which
    overlap the transfer with the math; TPU's partitioner does this for large FSDP matmuls).
    The cost analysis counts a loop's body once, so each such matmul counts one window of its
    FLOPs, not all of them."""
    return len(re.findall(r"body=%?[\w.-]*windowed_dot_general_body", hlo_text))


def compile_all(programs: list[Program], report=print, host: bool = False) -> list[Compiled]:
    """Lower and compile each program (one line each through ``report`` as it finishes).
    ``host``: the programs run on this host's CPU, whose memory is the process's own: each
    records the resident memory its compile added (``host_growth``)."""
    done = []
    for p in programs:
        before = resident_bytes() if host else None  # outside the timing: it trims the heap
        t0 = time.perf_counter()
        compiled = p.lower().compile()
        seconds = time.perf_counter() - t0
        after = resident_bytes() if host else None
        mem = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = (cost[0] if isinstance(cost, list) else cost) or {}
        c = Compiled(
            p,
            seconds,
            mem.argument_size_in_bytes,
            mem.output_size_in_bytes,
            mem.temp_size_in_bytes,
            mem.alias_size_in_bytes,
            float(cost.get("flops", 0.0)),
            float(cost.get("bytes accessed", 0.0)),
            windowed_matmuls(compiled.as_text() or ""),
            None if before is None or after is None else max(0, after - before),
        )
        del compiled
        jax.clear_caches()  # the traced and lowered programs: a 3B one holds GBs of host memory
        estimate = "" if p.estimate is None else f" (plan's estimate {p.estimate / GIB:.3g})"
        report(  # the figures as each program finishes: a long compile stopped keeps them
            f"compiled {p.name} ({p.shapes}) in {seconds:.1f} s: peak {c.peak / GIB:.3g} GiB "
            f"per device{estimate}, {c.flops / 1e12:.3g} TFLOPs counted"
        )
        done.append(c)
    return done


def _ratio(measured: float, formula: float | None) -> str:
    return "-" if not formula or not measured else f"{measured / formula:.2f}"


def format_table(target: Target, compiled: list[Compiled]) -> str:
    """The compiler's figures per device beside plan's formula, one row per program (markdown);
    bytes in GiB, or MiB when every program is under 1 GiB."""
    hbm = target.memory_bytes
    unit, scale = ("GiB", GIB) if max(c.peak for c in compiled) >= GIB else ("MiB", 2**20)

    def size(n: int | None) -> str:
        return "-" if n is None else f"{n / scale:.3g}"

    head = (
        f"| program | shapes | compile s | arguments {unit} | outputs {unit} | temporaries "
        f"{unit} | state beside {unit} | peak {unit} | fits | plan's estimate {unit} | peak / "
        "estimate | TFLOPs (compiler) | TFLOPs (roofline) | compiler / roofline | GB accessed |"
    )
    memory = f"; {hbm / GIB:.1f} GiB per device" if hbm else ""
    lines = [
        f"{target.describe()}{memory}; figures per device",
        "",
        head,
        "|" + " --- |" * (head.count(" | ") + 1),
    ]
    for c in compiled:
        p = c.program
        fits = "-" if hbm is None else ("yes" if c.peak <= hbm else "NO")
        roofline = "-" if p.flops is None else f"{p.flops / 1e12:.3g}"
        lines.append(
            f"| {p.name} | {p.shapes} | {c.seconds:.1f} | {size(c.argument)} | "
            f"{size(c.output - c.alias)} | {size(c.temporary)} | {size(p.resident)} | "
            f"{size(c.peak)} | {fits} | {size(p.estimate)} | {_ratio(c.peak, p.estimate)} | "
            f"{c.flops / 1e12:.3g} | {roofline} | {_ratio(c.flops, p.flops)} | "
            f"{c.bytes_accessed / 1e9:.3g} |"
        )
    total = sum(c.seconds for c in compiled)
    lines.append("")
    lines.append(
        f"{len(compiled)} programs compiled in {total:.0f} s. Outputs are net of the donated "
        "inputs they reuse; 'state beside' is what the run keeps in memory while a sampler runs "
        "(optimizer state, reference weights), not among its arguments. FLOPs: XLA's cost "
        "analysis counts a loop's body once (the samplers' decode loop, the update's "
        "microbatch scan), and so does the roofline column (docs/scale-out.md)."
    )
    windowed = [c for c in compiled if c.windowed_matmuls]
    if windowed:
        names = ", ".join(f"{c.program.name} ({c.windowed_matmuls})" for c in windowed)
        lines.append(
            f"Matmuls split into a loop of windows by the partitioner (collective matmuls): "
            f"{names}. The cost analysis counts one window of each, so these programs' compiled "
            "FLOPs are a fraction of their work; --hardware times the update by the roofline's."
        )
    return "\n".join(lines)


def host_estimate(start: int, compiled: list[Compiled]) -> str:
    """On a CPU target, whose device memory is the process's own: the run's peak resident memory
    as the process before compiling (``start`` bytes: Python, jax, the tokenizer and the data),
    plus what every compile added (the compiled code and what the compiler kept, which a run
    holds for its whole length), plus the largest program's peak."""
    growth = [c.host_growth or 0 for c in compiled]
    peak = max(c.peak for c in compiled)
    total = start + sum(growth) + peak
    pairs = zip(compiled, growth, strict=True)
    added = ", ".join(f"{c.program.name} {g / GIB:.2f}" for c, g in pairs)
    return (
        f"On this host a run's peak resident memory is about {total / GIB:.2f} GiB: this "
        f"process before compiling ({start / GIB:.2f} GiB: Python, jax, the tokenizer and the "
        f"data), what each compile added and a run keeps ({added} GiB: the compiled code and "
        f"the compiler's retained heap), and the largest program's peak ({peak / GIB:.2f} GiB)."
    )


def verdict(target: Target, compiled: list[Compiled]) -> str | None:
    """One line naming the first program that does not fit, or None."""
    hbm = target.memory_bytes
    for c in compiled:
        if hbm is not None and c.peak > hbm:
            return (
                f"{c.program.name} ({c.program.shapes}) needs {c.peak / GIB:.2f} GiB per device "
                f"on {target.topology}, more than its {hbm / GIB:.1f} GiB: raise "
                f"train.microbatches, use model.remat: full, set sampling.slots, or take a "
                f"larger slice"
            )
    return None


def compiled_update(compiled: list[Compiled]) -> Compiled | None:
    """The update of the largest G at its largest shape (what ``plan --hardware`` times), if it
    was compiled: the last update in ``run_programs``' order."""
    updates = [c for c in compiled if c.program.name.startswith("update")]
    return updates[-1] if updates else None
