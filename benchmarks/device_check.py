"""GPU/TPU check of the training step: a few GRPO steps of a preset (random weights, bfloat16),
packed and padded, printing rollout and update tokens per second and the update's model-FLOPs
utilisation (MFU). Runs from a checkout (``PYTHONPATH=.``); see ``device_check.sh``.
The figures are medians over the steps that compiled nothing new.

MFU counts useful work only: 6 x parameters x real (prompt + completion) tokens of the update
per second, over the accelerator's peak (``--peak-tflops``, default the H200's dense bfloat16
989 TFLOP/s).
"""

from __future__ import annotations

import argparse
import tempfile

import jax
import numpy as np

from sagc_jax.config import load_config
from sagc_jax.train.loop import Trainer


def run(preset: str, packing: bool, steps: int, max_new: int, prompts: int, group: int) -> dict:
    overrides = [
        f"model.preset={preset}",
        "model.param_dtype=bfloat16",
        "model.compute_dtype=bfloat16",
        f"sampling.max_new_tokens={max_new}",
        f"train.prompts_per_step={prompts}",
        "controller.kind=fixed",
        f"controller.group_size={group}",
        f"train.packing={str(packing).lower()}",
        f"train.steps={steps}",
        "train.checkpoint_every=0",
        "logging.tensorboard=false",
        "logging.progress=false",
    ]
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(load_config(None, overrides), run_dir, log=False)
        params = sum(x.size for x in jax.tree.leaves(trainer.params))
        records = [trainer.train_step() for _ in range(steps)]
        trainer.lock.release()
    # steps that compiled nothing new (a packed step may meet a new row-count rung)
    warm = [
        r
        for prev, r in zip(records, records[1:], strict=False)
        if (r["compiles/update"], r["compiles/sampler"])
        == (prev["compiles/update"], prev["compiles/sampler"])
    ] or records[-1:]
    update_tps = float(np.median([r["throughput/update_tokens_per_s"] for r in warm]))
    return {
        "params": params,
        "rollout_tps": float(np.median([r["throughput/rollout_tokens_per_s"] for r in warm])),
        "update_tps": update_tps,
        "update_s": float(np.median([r["time/update_s"] for r in warm])),
        "mean_length": float(np.mean([r["length/mean"] for r in warm])),
        "update_rows": int(warm[-1]["update_rows"]),
        "model_flops_per_s": 6.0 * params * update_tps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny,qwen2.5-0.5b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind} x {jax.device_count()}, jax {jax.__version__}")
    for preset in args.presets.split(","):
        for packing in (True, False):
            r = run(preset, packing, args.steps, args.max_new_tokens, args.prompts, args.group_size)
            mfu = r["model_flops_per_s"] / (args.peak_tflops * 1e12 * jax.device_count())
            print(
                f"{preset} {'packed' if packing else 'padded'}: {r['params'] / 1e6:.1f}M params, "
                f"mean length {r['mean_length']:.0f}, update rows {r['update_rows']}, rollout "
                f"{r['rollout_tps']:,.0f} tok/s, update {r['update_tps']:,.0f} tok/s "
                f"({r['update_s']:.3f} s), update MFU {100 * mfu:.2f}%",
                flush=True,
            )


if __name__ == "__main__":
    main()
