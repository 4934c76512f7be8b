"""The sampler of two checkouts on one workload: this tree against another commit (for example
the code before a change), each in its own processes, alternating, on the same seeds.

Workloads are `generate.py`'s on its model (a random 3M Llama built by transformers, seed 0):
forced (64 rows, 128 tokens, no end token) and early-exit (256 rows, EOS logit bias for a mean
length of 40 under a cap of 512). Every process compiles once (untimed), then times calls with
keys 1..runs. The random stream of two checkouts may differ: on the forced workload the work is
the same whatever the tokens; on early exit the lengths differ from seed to seed, so the figure
is tokens over time summed over the seeds, the same seeds on both sides, and the per-seed mean
with its 95% interval.

    git worktree add /tmp/before 309433d
    .venv/bin/python benchmarks/sampler_ab.py /tmp/before [--workload forced] [--runs 10]
        [--pairs 2] [--devices 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(workload: str, devices: int):
    """``(sampler, state, prompts, prompt lengths, max_new_tokens)`` of the workload, with the
    sagc_jax found first on sys.path; the rows split over ``devices`` host devices (which
    XLA_FLAGS must already ask for)."""
    import tempfile

    import jax
    import numpy as np
    import torch
    import transformers
    from flax import nnx
    from grpo_step import EOS, add_eos_bias

    from sagc_jax.config import MeshConfig
    from sagc_jax.models import load_hf_checkpoint
    from sagc_jax.parallel import ShardingPlan
    from sagc_jax.sampling import Sampler

    torch.manual_seed(0)
    batch, new = (64, 128) if workload == "forced" else (256, 512)
    hf_config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        max_position_embeddings=max(512, 16 + new),
        rope_theta=10_000.0,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    if workload != "forced":
        add_eos_bias(hf_model, 40.0, new, seed=0)
    prompts = np.random.RandomState(0).randint(3, 512, (batch, 16)).astype(np.int32)
    transformers.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as path:
        hf_model.save_pretrained(path)
        model, cfg = load_hf_checkpoint(path)
    plan = ShardingPlan.from_config(MeshConfig(data=devices, fsdp=1, tensor=1))
    graphdef, state = nnx.split(model)
    shardings = plan.params(state)
    state = jax.device_put(state, shardings)
    sampler = Sampler(
        graphdef,
        cfg,
        eos_ids=() if workload == "forced" else (EOS,),
        pad_id=0,
        plan=plan,
        state_shardings=shardings,
    )
    return sampler, state, prompts, np.full((batch,), 16, np.int32), new


def _one(root: str, workload: str, runs: int, devices: int) -> None:
    """Child: time `runs` calls of `root`'s sampler; print one JSON line."""
    import time

    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path[:0] = [root, str(Path(root) / "benchmarks")]
    import jax
    import numpy as np

    sampler, state, prompts, lens, new = build(workload, devices)
    timed = []
    for seed in range(runs + 1):
        start = time.perf_counter()
        out = sampler(
            state, prompts, lens, jax.random.key(seed), max_new_tokens=new, temperature=1.0
        )
        lengths = np.asarray(jax.block_until_ready(out).lengths_b)
        if seed:  # the first call compiles
            timed.append((time.perf_counter() - start, int(lengths.sum()), int(lengths.max())))
    print(json.dumps({"root": root, "runs": timed, "load": os.getloadavg()[0]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", help="the other checkout's root (a git worktree)")
    parser.add_argument("--workload", choices=("forced", "early-exit"), default="forced")
    parser.add_argument("--runs", type=int, default=10, help="timed calls per process")
    parser.add_argument("--pairs", type=int, default=2, help="processes per side, alternating")
    parser.add_argument("--devices", type=int, default=2, help="host devices (rows split)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _one(args.child, args.workload, args.runs, args.devices)
    import numpy as np

    this = str(HERE.parent)
    results: dict[str, list] = {this: [], args.other: []}
    for _ in range(args.pairs):
        for root in (args.other, this):
            cmd = [sys.executable, __file__, root, "--child", root]
            cmd += ["--workload", args.workload, "--runs", str(args.runs)]
            cmd += ["--devices", str(args.devices)]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results[root].append(json.loads(line.strip().splitlines()[-1]))
    figures = {}
    rows = 64 if args.workload == "forced" else 256
    for root, procs in results.items():
        runs = np.array([r for p in procs for r in p["runs"]], float)
        per_seed = runs[:, 1] / runs[:, 0]
        half = 1.96 * per_seed.std(ddof=1) / np.sqrt(len(per_seed))
        figures[root] = runs[:, 1].sum() / runs[:, 0].sum()
        loads = ", ".join(f"{p['load']:.2f}" for p in procs)
        print(
            f"{root}: {figures[root]:,.0f} tok/s (per call {per_seed.mean():,.0f} +- {half:,.0f}; "
            f"fastest call {runs[:, 0].min():.3f} s, median {np.median(runs[:, 0]):.3f} s; "
            f"mean length {runs[:, 1].sum() / len(runs) / rows:.1f}, "
            f"mean longest {runs[:, 2].mean():.0f}; load after each process {loads})"
        )
    ratio = figures[this] / figures[args.other]
    print(f"sampler_ab {args.workload}: this tree {ratio:.2f}x {args.other}")


if __name__ == "__main__":
    main()
