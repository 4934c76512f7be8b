"""Where one long-tail sampler call spends its time: device time per region of the program.

The workload is `sampler_ab.py`'s early exit (256 rows, mean length about 40 under a cap of 512,
the rows split over ``--devices`` host devices). One call with key ``--seed`` is traced with
``jax.profiler``; every device op of the trace (XLA:CPU thunks, named after the compiled
program's HLO instructions) is charged to the chain of ``while`` loops and ``conditional`` ops
that encloses it in the HLO (the decode phases' loops, the tail's gathers and rungs), summed over
the devices and divided by their number. Printed: the regions by time, each with its thunk count;
the ``--top`` ops of the two regions that spend the most outside any loop (the prologue, the
gathers into the tail); and the decode iterations the call ran at each row count
(`decode_schedule.simulate` on its lengths, checked against the program's own count), so a
loop's time over its iterations is its cost per iteration. This is the profile that found the
tail's gather computed whole on every device (BENCHMARKS.md).

    .venv/bin/python benchmarks/tail_profile.py [--devices 2] [--seed 1] [--top 8]

About a minute on a 2-core CPU; not part of ``make test``.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
_CONTROL = re.compile(r"\b(while|conditional)\(")
_CALLED = re.compile(r"(?:condition|body|true_computation|false_computation)=%([\w.\-]+)")


def enclosing_chains(hlo_text: str) -> dict[str, tuple[str, ...]]:
    """Instruction name ('.' as '_', as thunks are named) -> the while / conditional ops that
    enclose it, outermost first (empty: the entry computation)."""
    computation_of, caller_of = {}, {}
    computation = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) .*\{\s*$", line)
        if head:
            computation = head.group(1)
            continue
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.*)$", line)
        if not m or computation is None:
            continue
        name, rest = m.groups()
        computation_of[name] = computation
        if _CONTROL.search(rest):
            called = _CALLED.findall(rest)
            branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
            if branches:
                called += re.findall(r"%([\w.\-]+)", branches.group(1))
            for c in called:
                caller_of[c] = name
    chains = {}
    for name, computation in computation_of.items():
        chain = []
        while computation in caller_of:
            chain.append(caller_of[computation])
            computation = computation_of[caller_of[computation]]
        chains[name.replace(".", "_")] = tuple(reversed(chain))
    return chains


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="host devices (rows split)")
    parser.add_argument("--seed", type=int, default=1, help="the traced call's key")
    parser.add_argument("--top", type=int, default=8, help="ops listed of the heaviest region")
    parser.add_argument("--depth", type=int, default=3, help="enclosing ops a region is named by")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path[:0] = [str(HERE.parent), str(HERE)]
    import jax
    import numpy as np
    from decode_profile import _trace_counts
    from sampler_ab import build

    from sagc_jax import decode_schedule

    sampler, state, prompts, lens, new = build("early-exit", args.devices)
    compiled = sampler.compile(state, *prompts.shape, max_new_tokens=new)
    text = compiled.as_text()

    def call():
        out = sampler(
            state, prompts, lens, jax.random.key(args.seed), max_new_tokens=new, temperature=1.0
        )
        return jax.block_until_ready(out)

    out = call()  # the traced call runs warm
    op_us = _trace_counts(call, text)["op_us"]
    chains = enclosing_chains(text)
    region_us, region_ops = collections.Counter(), collections.Counter()
    outside_us: dict[str, collections.Counter] = {}  # ops in no loop, by region
    for name, us in op_us.items():
        chain = chains.get(name.replace(".", "_"), ())
        region = " > ".join(chain[: args.depth]) or "(entry: prefill, first tokens, outputs)"
        region_us[region] += us / args.devices
        region_ops[region] += 1
        if not any(op.startswith("while") for op in chain):
            outside_us.setdefault(region, collections.Counter())[name] += us / args.devices
    total = sum(region_us.values())
    lengths = np.asarray(out.lengths_b)
    print(
        f"tail_profile: key {args.seed}, {lengths.size} rows, mean length {lengths.mean():.1f}, "
        f"longest {lengths.max()}, {int(out.num_decode_steps)} decode iterations; device time "
        f"{total / 1e3:.1f} ms a device"
    )
    for region, us in region_us.most_common():
        if us >= 0.005 * total:
            print(f"  {us / 1e3:8.1f} ms {us / total:6.1%}  {region}  ({region_ops[region]} ops)")
    for region in sorted(outside_us, key=lambda r: -sum(outside_us[r].values()))[:2]:
        spent = sum(outside_us[region].values())
        print(f"ops outside the decode loops in {region}: {spent / 1e3:.1f} ms; the heaviest")
        for name, us in outside_us[region].most_common(args.top):
            print(f"  {us / 1e3:8.1f} ms  {name}")
    plan = decode_schedule.simulate(
        lengths,
        new,
        chunk=decode_schedule.resolve_chunk(new, sampler.decode_chunk),
        row_buckets=sampler.row_buckets,
        shards=sampler.shards,
    )
    assert plan.rows_decoded == int(out.rows_decoded), (plan.rows_decoded, int(out.rows_decoded))
    per_rung = sorted(collections.Counter(plan.rows_k.tolist()).items(), reverse=True)
    print(
        "iterations by rows decoded: "
        + ", ".join(f"{rows} rows x {k}" for rows, k in per_rung)
        + f" ({plan.rows_decoded} rows decoded, {plan.live_rows_decoded} running)"
    )


if __name__ == "__main__":
    main()
