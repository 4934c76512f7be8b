"""The update of a real-model GRPO step on this host: its time, its FLOP/s against the host's
measured matmul peak, and where the time goes by XLA's own profile.

The run is built as the trainer builds it (`programs.state.build_run`) from `--config` (default:
the learning run's, configs/real/smollm2-arith.yaml: SmolLM2-135M-Instruct, float32, GRPO,
`model.remat: full`, `model.scan_layers: true`, two micro-batches, `loss.logprob_chunk` 1024)
with `--set` overrides. Its update batch is a step of `--prompts` x `--group` rollouts: prompts
of `--prompt-len` random tokens, completion lengths drawn (seed 0) from a geometric law of mean
`--mean-new` capped at the config's `sampling.max_new_tokens`, advantages drawn for the first
`--signal` share of the groups and 0 for the others, packed (or padded) as
`train/update_batch.py` builds it, with or without the rollouts of advantage 0 as
`train.drop_no_signal` says.

Printed:
- the update's seconds (best of `--repeats` after a compiling call) and the rows it ran on;
- its FLOPs: the roofline's useful ones (`sim.roofline`: forward + backward, 3 forwards of the
  trained tokens at their contexts), and those it executes with `model.remat: full` (one more
  forward); achieved FLOP/s of each against this host's matmul peak
  (`host_roofline.measure_host`: a float32 2048^3 matmul);
- the process's peak RSS (the model, its optimizer state and the update's activations);
- XLA's profile of one update (`jax.profiler` trace; XLA:CPU's thunks named after the compiled
  program's instructions): its time summed by pass (forward, backward, the remat recompute, the
  rest) and by the model's einsum it computes (`BTD,VD->BTV`: the LM head), then the `--top`
  instructions by time with the jax operation each comes from.

    .venv/bin/python benchmarks/update_profile.py [--signal 0.37] [--set loss.logprob_chunk=0]

About a minute a call on a 2-core host; run it on a quiet machine (load average printed).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import resource
import time
from pathlib import Path

import jax
import numpy as np
from decode_profile import _op_names, _trace_counts
from host_roofline import measure_host

from sagc_jax.config import load_config
from sagc_jax.parallel import ShardingPlan
from sagc_jax.programs.packing import (
    pack_update_batch,
    packed_rows_needed,
    padded_update_batch,
    resolve_pack_len,
    row_multiple,
    rung_for,
)
from sagc_jax.programs.policy import build_sharded_policy, build_tokenizer
from sagc_jax.programs.shapes import training_settings, trains_signal_only, update_settings
from sagc_jax.programs.state import build_run
from sagc_jax.rl import completion_mask
from sagc_jax.sim.roofline import model_costs

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = Path.home() / ".cache" / "sagc-jax" / "models" / "SmolLM2-135M-Instruct"

# What an instruction's jax op_name says of it: the pass it belongs to, then its operation.
# (jax names a remat'd block's recompute ``rematted_computation`` and a backward ``transpose``;
# the optimizer runs outside the gradient's loops.)
PASSES = (
    ("remat recompute", re.compile(r"rematted_computation")),
    ("backward", re.compile(r"transpose\(")),
    ("forward", re.compile(r"jvp\(")),
    ("optimizer and the rest", re.compile("")),
)
# The model's matmuls by their einsum (models/layers.py names: BTD,VD->BTV is the LM head).
EINSUM = re.compile(r"/([A-Z]+(?:,[A-Z]+)*->[A-Z]+)/")


def _parse():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="Hugging Face model dir")
    parser.add_argument("--config", default=str(ROOT / "configs/real/smollm2-arith.yaml"))
    parser.add_argument("--set", action="append", default=[], help="a config override")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=90, help="prompt tokens per rollout")
    parser.add_argument("--mean-new", type=float, default=60.0, help="mean completion tokens")
    parser.add_argument("--signal", type=float, default=1.0, help="share of groups with signal")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--top", type=int, default=12, help="instructions listed by time")
    parser.add_argument("--no-trace", action="store_true", help="time only, no profile")
    args = parser.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there (run `sagc-jax fetch-model`)")
    if not 0.0 <= args.signal <= 1.0:
        parser.error("--signal is a share of the groups, in [0, 1]")
    return args


def step_batch(cfg, args, vocab: int, batch_shards: int) -> tuple[dict, dict]:
    """(the update's batch, a description) of one step, as ``train.update_batch`` builds it."""
    rng = np.random.default_rng(0)
    n, new = args.prompts * args.group, cfg.sampling.max_new_tokens
    lengths = np.minimum(rng.geometric(1.0 / args.mean_new, n), new)
    prompt_ids = rng.integers(10, vocab, (n, args.prompt_len)).astype(np.int32)
    prompt_lens = np.full(n, args.prompt_len, np.int32)
    completion = rng.integers(10, vocab, (n, new)).astype(np.int32)
    old_logp = rng.normal(-2.0, 0.5, (n, new)).astype(np.float32)
    signal_p = np.arange(args.prompts) < round(args.signal * args.prompts)
    adv = np.where(np.repeat(signal_p, args.group), rng.normal(size=n), 0.0).astype(np.float32)
    mask = completion_mask(lengths, new)
    trained = adv != 0 if trains_signal_only(cfg) else np.ones(n, bool)
    t = cfg.train
    multiple = row_multiple(t.minibatches, t.microbatches, batch_shards)
    arrays = (prompt_ids, prompt_lens, completion, old_logp, adv, mask)
    kw = dict(aggregation=update_settings(cfg).aggregation, max_new_tokens=new)
    if t.packing:
        pack_len = resolve_pack_len(t.pack_len, (args.prompt_len,), new)
        rows = packed_rows_needed(
            prompt_lens, mask, pack_len=pack_len, multiple=multiple, max_rows=n, trained_b=trained
        )
        batch = pack_update_batch(*arrays, **kw, pack_len=pack_len, rows=rows, trained_b=trained)
    else:
        rows = rung_for(int(trained.sum()), multiple, n)
        batch = padded_update_batch(*arrays, **kw, rows=rows, trained_b=trained)
    widths = (prompt_lens + lengths)[trained]
    return batch, {
        "rollouts": n,
        "trained": int(trained.sum()),
        "rows": rows,
        "width": batch["mask"].shape[1] + (0 if t.packing else args.prompt_len),
        "tokens": int(widths.sum()),
        "context": float((widths * (widths + 1) / 2).sum()),
        "lengths": lengths,
    }


def _bucket(patterns, op_name: str) -> str:
    return next(label for label, pattern in patterns if pattern.search(op_name))


def profile(run, state, batch, key, text: str, top: int, seconds: float) -> str:
    """XLA's profile of one update: time by pass, by operation and the slowest instructions."""
    holder = {"state": state}

    def one():
        holder["state"], metrics = run.update(holder["state"], batch, key)
        jax.block_until_ready(metrics)

    counts = _trace_counts(one, text)
    names = _op_names(text)
    op_us = counts["op_us"]
    total = sum(op_us.values())
    by_pass, by_op = collections.Counter(), collections.Counter()
    for name, us in op_us.items():
        op_name = names.get(name.replace(".", "_"), "")
        by_pass[_bucket(PASSES, op_name)] += us
        einsum = EINSUM.search(op_name)
        by_op[einsum.group(1) if einsum else "other ops"] += us
    lines = [
        f"profile: {total / 1e6:.2f} s in {counts['ops']} XLA ops "
        f"({total / 1e6 / seconds:.0%} of the timed update's wall time; 2 threads sum their ops)"
    ]
    for title, counter in (("by pass", by_pass), ("by matmul (einsum)", by_op)):
        parts = ", ".join(f"{k} {v / total:.0%}" for k, v in counter.most_common())
        lines.append(f"  {title}: {parts}")
    for name, us in op_us.most_common(top):
        op_name = names.get(name.replace(".", "_"), "")
        lines.append(f"    {us / 1e3:9.1f} ms  {name}  {op_name[-110:]}")
    return "\n".join(lines)


def main() -> None:
    args = _parse()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print(f"jax {jax.__version__} | load average before: {os.getloadavg()[0]:.2f}", flush=True)
    cfg = load_config(args.config, [f"model.hf_checkpoint={args.model}", *args.set])
    plan = ShardingPlan.from_config(cfg.mesh)
    policy = build_sharded_policy(cfg.model, build_tokenizer(cfg), cfg.train.seed, plan)
    run, state = build_run(training_settings(cfg), plan, policy)
    arch = policy.arch
    batch, d = step_batch(cfg, args, arch.vocab_size, plan.batch_shards)
    batch = plan.global_rows(batch)
    key = jax.random.key(0)
    t0 = time.perf_counter()
    compiled = run.lower_update(state, batch, key).compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    m = cfg.model
    print(
        f"update of {d['rollouts']} rollouts ({args.prompts}x{args.group}, prompts "
        f"{args.prompt_len}, completions mean {d['lengths'].mean():.1f} max "
        f"{d['lengths'].max()} of {cfg.sampling.max_new_tokens}), {d['trained']} trained in "
        f"{d['rows']} {'packed' if cfg.train.packing else 'padded'} rows of {d['width']}; "
        f"remat {m.remat}, scan_layers {m.scan_layers}, microbatches "
        f"{cfg.train.microbatches}, logprob_chunk {cfg.loss.logprob_chunk}; compiled in "
        f"{compile_s:.1f} s",
        flush=True,
    )
    state, metrics = run.update(state, batch, key)  # warm: the first call pays its set-up
    jax.block_until_ready(metrics)
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        state, metrics = run.update(state, batch, key)
        jax.block_until_ready(metrics)
        best = min(best, time.perf_counter() - start)
    costs = model_costs(arch)
    forward = costs.forward_flops(d["tokens"], d["context"])
    useful = 3 * forward * cfg.train.epochs
    executed = useful + (forward * cfg.train.epochs if m.remat != "none" else 0.0)
    hw = measure_host()
    peak = hw.peak_flops
    print(
        f"update: {best:.2f} s (best of {args.repeats}); {d['tokens']:,} real tokens; useful "
        f"{useful / 1e12:.2f} TFLOP -> {useful / best / 1e9:.1f} GFLOP/s = "
        f"{useful / best / peak:.0%} of this host's matmul peak ({peak / 1e9:.1f} GFLOP/s); "
        f"executed with remat {executed / 1e12:.2f} TFLOP -> {executed / best / peak:.0%}",
        flush=True,
    )
    if not args.no_trace:
        print(profile(run, state, batch, key, text, args.top, best), flush=True)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(f"peak RSS {peak_gib:.2f} GiB | load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
