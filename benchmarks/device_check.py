"""GPU/TPU check of the training step at a realistic RL size: a few GRPO steps of a preset
(random weights, bfloat16) printing rollout and update tokens per second, the rollout's ratio to
the roofline and the update's model-FLOPs utilisation (MFU). Runs from a checkout
(``PYTHONPATH=.``); see ``device_check.sh``. The figures are medians over the steps that
compiled nothing new.

Default workload (issue #20): 64 prompts x G = 8 = 512 rollouts per step of 1,024 new tokens,
forced to full length (the policy's sampler is replaced by one with no end token, as random
weights end their completions after a few tokens; ``--stop-at-eos`` keeps the task's end
token), so the packed update trains on 512 x (prompt + 1,024) real tokens, over 500k. One
prompt bucket of 32 tokens (the task's prompts have 5-17): every step runs the same sampler
program, and a packed row holds one rollout (not 4096 + 1,024 tokens of mostly masked
attention, as the default buckets would make). The update runs in ``--microbatches``
gradient-accumulation chunks (8: about 70k tokens each, what the 0.5B preset's activations
allow on one 141 GB H200 without remat, by estimate).

Roofline (``sim/roofline.py``, ``--hardware``, default h200 with its default efficiencies; on
a CPU the host measured by ``host_roofline.py``): the rollout's predicted seconds for the same
rows, lengths and (real) prompt tokens, synchronous (every row decodes until the longest
ends), against the measured ``time/rollout_s``: ``Nx`` is measured time over predicted. MFU
counts useful work only: 6 x parameters x real (prompt + completion) tokens of the update per
second, over the hardware's peak FLOP/s x devices.

    PYTHONPATH=. python benchmarks/device_check.py [--presets tiny,qwen2.5-0.5b] [--steps 3]
    .venv/bin/python benchmarks/device_check.py --presets tiny --prompts 2 --group-size 2 \
        --max-new-tokens 16 --steps 2 --microbatches 1      # a CPU smoke run
"""

from __future__ import annotations

import argparse
import tempfile

import jax
import numpy as np
from host_roofline import describe, roofline_hardware

from sagc_jax.config import load_config
from sagc_jax.sampling import Sampler
from sagc_jax.sim.roofline import model_costs, rollout_seconds
from sagc_jax.train.loop import Trainer


def _force_full_length(trainer: Trainer) -> None:
    """The trainer's policy sampler replaced by the same one without end tokens: every rollout
    runs to ``sampling.max_new_tokens`` (random weights would end most after a few tokens)."""
    old = trainer.sampler
    trainer.sampler = Sampler(
        old.graphdef,
        old.config,
        eos_ids=(),
        pad_id=old.pad_id,
        decode_chunk=old.decode_chunk,
        plan=old.plan,
        state_shardings=jax.tree.map(lambda x: x.sharding, trainer.state.params),
    )


def run(preset: str, packing: bool, args, hw, eff) -> dict:
    overrides = [
        f"model.preset={preset}",
        "model.param_dtype=bfloat16",
        "model.compute_dtype=bfloat16",
        f"sampling.max_new_tokens={args.max_new_tokens}",
        # one bucket for every step (the task's prompts are 5-17 tokens): no new sampler program
        # after the first step, and packed rows of 32 + max_new_tokens, one rollout each
        "sampling.prompt_buckets=[32]",
        f"train.prompts_per_step={args.prompts}",
        "controller.kind=fixed",
        f"controller.group_size={args.group_size}",
        f"train.packing={str(packing).lower()}",
        f"train.microbatches={args.microbatches}",
        f"train.steps={args.steps}",
        "train.checkpoint_every=0",
        "logging.tensorboard=false",
        "logging.progress=false",
    ]
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(load_config(None, overrides), run_dir, log=False)
        if not args.stop_at_eos:
            _force_full_length(trainer)
        params = sum(x.size for x in jax.tree.leaves(trainer.state.params))
        costs = model_costs(trainer.model_config)
        records = [trainer.step_log(trainer.train_step()).metrics for _ in range(args.steps)]
        trainer.lock.release()
    # steps that compiled nothing new (a packed step may meet a new row-count rung)
    warm = [
        r
        for prev, r in zip(records, records[1:], strict=False)
        if (r["compiles/update"], r["compiles/sampler"])
        == (prev["compiles/update"], prev["compiles/sampler"])
    ]
    compiled = not warm  # every step compiled something: the figures include compilation
    warm = warm or records[-1:]
    roofline_s = [
        rollout_seconds(
            costs,
            hw,
            np.concatenate([np.asarray(g) for g in r["lengths"]]),
            r["prompt_tokens"],
            devices=jax.device_count(),
            eff=eff,
        )
        for r in warm
    ]
    update_tps = float(np.median([r["throughput/update_tokens_per_s"] for r in warm]))
    update_s = float(np.median([r["time/update_s"] for r in warm]))
    return {
        "params": params,
        "rollouts": int(np.median([sum(map(len, r["lengths"])) for r in warm])),
        "rollout_tps": float(np.median([r["throughput/rollout_tokens_per_s"] for r in warm])),
        "rollout_s": float(np.median([r["time/rollout_s"] for r in warm])),
        "roofline_s": float(np.median([p["seconds"] for p in roofline_s])),
        "roofline_limit": roofline_s[-1]["limit"],
        "update_tps": update_tps,
        "update_s": update_s,
        "update_tokens": round(update_tps * update_s),  # real tokens, one epoch
        "mean_length": float(np.mean([r["length/mean"] for r in warm])),
        "update_rows": int(warm[-1]["update_rows"]),
        "model_flops_per_s": 6.0 * params * update_tps,
        "note": " (every step compiled: figures include compilation)" if compiled else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny,qwen2.5-0.5b")
    parser.add_argument("--layouts", default="packed", help="packed, padded or packed,padded")
    parser.add_argument("--steps", type=int, default=3, help="the first compiles; median of rest")
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--stop-at-eos", action="store_true", help="do not force full length")
    parser.add_argument(
        "--hardware",
        default=None,
        help="roofline preset (default: h200 on an accelerator, the host measured on a CPU)",
    )
    args = parser.parse_args()
    on_cpu = jax.default_backend() == "cpu"
    hw, eff = roofline_hardware(args.hardware or ("host" if on_cpu else "h200"))
    print(f"device: {jax.devices()[0].device_kind} x {jax.device_count()}, jax {jax.__version__}")
    print(describe(hw, eff), flush=True)
    for preset in args.presets.split(","):
        for layout in args.layouts.split(","):
            r = run(preset, layout == "packed", args, hw, eff)
            mfu = r["model_flops_per_s"] / (hw.peak_flops * jax.device_count())
            print(
                f"{preset} {layout}: {r['params'] / 1e6:.1f}M params, {r['rollouts']} rollouts, "
                f"mean length {r['mean_length']:.0f}, rollout {r['rollout_tps']:,.0f} tok/s "
                f"({r['rollout_s']:.3f} s; roofline {r['roofline_s']:.3f} s, "
                f"{r['roofline_limit']}: {r['rollout_s'] / r['roofline_s']:.1f}x) | update "
                f"{r['update_tokens']:,} real tokens on {r['update_rows']} rows, "
                f"{r['update_tps']:,.0f} tok/s ({r['update_s']:.3f} s), MFU {100 * mfu:.2f}%"
                + r["note"],
                flush=True,
            )


if __name__ == "__main__":
    main()
