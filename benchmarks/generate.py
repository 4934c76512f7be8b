"""Tokens per second of sagc_jax's sampler, decoding only the rows still running, against the
same sampler decoding every row until the longest ends (the schedule of the sampler before issue
#31) and a peer's: transformers' generate (CPU torch) or Tunix's vanilla JAX sampler
(`--peer tunix`, the extra 'tunix').

Same model on every side: a random Llama (vocab 512, hidden 256, mlp 688, 4 layers, 8 heads, 4 kv
heads, tied embeddings; about 3M parameters), or with `--model DIR` a Hugging Face model
directory in float32 (the real model: `--model ~/.cache/sagc-jax/models/SmolLM2-135M-Instruct`;
forced workload and transformers only: its own end token would stop rows at different points on
each side). Prompts of `--prompt-len` random tokens (16 by default), sampling at temperature 1
without top-k/top-p. Workloads (`--workload`):
  * forced (default): batch 64, 128 new tokens, every row forced to generate all of them (no
    end-of-sequence stop).
  * early-exit: rows stop at the end-of-sequence token under a cap of 512, the model given the
    constant EOS logit bias of `grpo_step.py` (`add_eos_bias`) for a mean length of
    `--mean-length` (40: under a tenth of the cap) over batch 256: a long tail, the batch ends
    with its longest row.
  * refill: early exit as above over `--batch` 512 rollouts streamed through `--slots` 128 rows
    (a finished row's slot takes the next rollout) against sequential static micro-batches of
    128 (each decodes every row until its longest ends) and micro-batches whose finished rows
    leave (row buckets). No peer.

sagc_jax's sides use the same key, so forced and early-exit sample identical tokens (the random
stream is per rollout: `Sampler`); the line says so after checking it. The sides run one after
the other; one line is printed with every figure (generated tokens per second, EOS included;
decode iterations, rows decoded per iteration, padding share), the ratios and the JAX compile
times. With `--peer tunix` the model uses rope theta 1e6 (what Tunix 0.1.7's Llama 3 applies; see
`tunix_peer.py`), Tunix loads the same checkpoint, and both give the same logits before timing.

Both sides get the same cores: torch runs `torch.set_num_threads(threads)`; XLA:CPU runs each of
these small ops on one thread, so JAX gets `threads` host devices
(--xla_force_host_platform_device_count) and the sampler splits the rows across them
(`Sampler(plan=...)` on a `data` mesh, weights replicated). The process is pinned to `threads`
cores when the machine has more. `--decode-chunk` is `sampling.decode_chunk`, `--row-buckets`
`sampling.row_buckets`.

Beside the measured figure: the roofline's tokens per second for the same lengths
(`sim.roofline.rollout_seconds`, the `compacting` regime the sampler runs) on the host measured
by `host_roofline.py` (no derating; the host counts as one chip whatever the number of JAX host
devices), or on `--hardware PRESET` on an accelerator, and the ratio of the measured time to the
roofline's.

    .venv/bin/python benchmarks/generate.py [--threads 2] [--repeats 3] [--decode-chunk auto]
        [--peer transformers|tunix] [--workload forced|early-exit|refill]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument(
        "--batch", type=int, default=0, help="rollouts (default: 64 forced, 256 early-exit, 512)"
    )
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument(
        "--new-tokens", type=int, default=0, help="cap (default: 128 forced, 512 otherwise)"
    )
    parser.add_argument("--workload", choices=("forced", "early-exit", "refill"), default="forced")
    parser.add_argument(
        "--mean-length", type=float, default=40.0, help="early exit: expected completion length"
    )
    parser.add_argument("--slots", type=int, default=128, help="refill: rows decoded at once")
    parser.add_argument("--peer", choices=("transformers", "tunix"), default="transformers")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side (best kept)")
    parser.add_argument(
        "--jax-devices", type=int, default=0, help="host devices for JAX (default: --threads)"
    )
    parser.add_argument(
        "--decode-chunk",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="cache slots per decode phase (sampling.decode_chunk); 0: one phase",
    )
    parser.add_argument(
        "--row-buckets", type=int, default=6, help="sampling.row_buckets of the live side"
    )
    parser.add_argument("--hardware", default=None, help="roofline preset (default: measure)")
    parser.add_argument(
        "--model",
        default=None,
        help="a Hugging Face model directory (float32 on both sides; forced workload against "
        "transformers) instead of the random 3M Llama",
    )
    args = parser.parse_args()
    if args.model and (args.workload != "forced" or args.peer != "transformers"):
        parser.error("--model times the forced workload against transformers only")
    args.new_tokens = args.new_tokens or (128 if args.workload == "forced" else 512)
    args.batch = args.batch or {"forced": 64, "early-exit": 256, "refill": 512}[args.workload]
    return args


def main() -> None:
    args = _parse()
    # A CPU-against-CPU comparison unless the caller picks a platform (JAX_PLATFORMS=cuda).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={args.jax_devices or args.threads}"
    )
    # XLA's CPU thread pool is sized from the visible cores: give both sides the same ones.
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > args.threads:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.threads])

    import jax
    import numpy as np
    import torch
    import transformers
    import tunix_peer
    from flax import nnx
    from grpo_step import EOS, add_eos_bias
    from host_roofline import roofline_hardware

    from sagc_jax.config import MeshConfig
    from sagc_jax.decode_schedule import resolve_chunk
    from sagc_jax.models import load_hf_checkpoint, num_params
    from sagc_jax.parallel import ShardingPlan
    from sagc_jax.sampling import Sampler
    from sagc_jax.sim.roofline import model_costs, rollout_seconds

    torch.set_num_threads(args.threads)
    transformers.logging.disable_progress_bar()  # save_pretrained's "Writing model shards"
    torch.manual_seed(0)
    if args.model:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.expanduser(args.model), dtype=torch.float32
        ).eval()
    else:
        hf_model = transformers.LlamaForCausalLM(_tiny_llama(args)).eval()
    hf_config = hf_model.config
    note = "forced"
    if args.workload != "forced":
        raise_, expected = add_eos_bias(hf_model, args.mean_length, args.new_tokens, seed=0)
        note = f"{args.workload}, EOS logit +{raise_:.2f}, expected length {expected:.1f}"
    rng = np.random.RandomState(0)
    prompts_bt = rng.randint(3, hf_config.vocab_size, (args.batch, args.prompt_len)).astype(
        np.int32
    )
    with tempfile.TemporaryDirectory() as path:
        hf_model.save_pretrained(path)
        model, cfg = load_hf_checkpoint(path)
        if args.peer == "tunix" and args.workload != "refill":  # the same weights and logits
            tunix_model = tunix_peer.tunix_model(path, cfg)
            diff = tunix_peer.check_same_logits(model, tunix_model, prompts_bt[:2])
    eos_ids = () if args.workload == "forced" else (EOS,)

    # ---- sagc_jax: rows split over the host devices.
    devices = jax.devices()
    plan = ShardingPlan.from_config(MeshConfig(data=len(devices), fsdp=1, tensor=1))
    graphdef, state = nnx.split(model)
    param_sh = plan.params(state)
    state = jax.device_put(state, param_sh)

    def sampler(**kw):
        return Sampler(
            graphdef,
            cfg,
            eos_ids=eos_ids,
            pad_id=0,
            decode_chunk=args.decode_chunk,
            plan=plan,
            state_shardings=param_sh,
            **kw,
        )

    def timed(sampler, batches):
        """(seconds, outputs, compile seconds) of the timed runs: decoding each of `batches`
        (row ranges of prompts_bt) in turn, run i with key i, over 1 + repeats runs; the first
        compiles and is not timed. Every side decodes the same keys, so the same tokens where
        it decodes the same batches."""
        runs = []
        for seed in range(args.repeats + 1):
            start = time.perf_counter()
            outs = []
            for first, stop in batches:
                out = sampler(
                    state,
                    prompts_bt[first:stop],
                    np.full((stop - first,), args.prompt_len, np.int32),
                    jax.random.fold_in(jax.random.key(seed), first),
                    max_new_tokens=args.new_tokens,
                    temperature=1.0,
                )
                outs.append(jax.block_until_ready(out))
            runs.append((time.perf_counter() - start, [sampler.to_host(o) for o in outs]))
        assert sampler.compiled_programs() == 1
        seconds = sum(run[0] for run in runs[1:])
        return seconds, [o for run in runs[1:] for o in run[1]], runs[0][0] - seconds / args.repeats

    def describe(name, seconds, outs, compile_s):
        lengths = np.concatenate([o.lengths_b for o in outs])
        steps = sum(int(o.num_decode_steps) for o in outs)
        rows = sum(int(o.rows_decoded) for o in outs)
        live = sum(int(o.live_rows_decoded) for o in outs)
        tps = lengths.sum() / seconds
        text = (
            f"{name} {tps:,.0f} tok/s (mean length {lengths.mean():.1f}, "
            f"{steps / args.repeats:.0f} decode steps a run, {rows / max(steps, 1):.1f} rows/step, "
            f"padding {1 - live / max(rows, 1):.2f}, compile {compile_s:.1f} s)"
        )
        return tps, lengths, text

    whole = [(0, args.batch)]
    live = sampler(row_buckets=args.row_buckets, slots=args.slots * (args.workload == "refill"))
    live_s, live_outs, live_compile = timed(live, whole)
    live_tps, _, live_text = describe("sagc_jax", live_s, live_outs, live_compile)
    lengths = live_outs[0].lengths_b  # one run's (the roofline times one call)
    chunk = resolve_chunk(args.new_tokens, args.decode_chunk)
    hw, eff = roofline_hardware(args.hardware)
    roofline = rollout_seconds(
        model_costs(cfg),
        hw,
        lengths,
        args.prompt_len,
        regime="compacting",
        eff=eff,
        slots=args.slots if args.workload == "refill" else 0,
        max_new_tokens=args.new_tokens,
        chunk=chunk,
        row_buckets=args.row_buckets,
    )
    roofline_tps = lengths.sum() / roofline["seconds"]
    live_text += (
        f" [roofline {roofline_tps:,.0f} tok/s, {roofline['limit']}, on {hw.name} at "
        f"{hw.peak_flops / 1e9:,.0f} GFLOP/s, {hw.hbm_bandwidth / 1e9:,.0f} GB/s: measured time "
        f"{roofline_tps / live_tps:.1f}x the roofline's]"
    )
    parts = [live_text]
    if args.workload == "refill":
        micro = [(i, min(i + args.slots, args.batch)) for i in range(0, args.batch, args.slots)]
        static_s, static_outs, static_compile = timed(sampler(row_buckets=1), micro)
        static_tps, _, text = describe(
            f"static micro-batches of {args.slots}", static_s, static_outs, static_compile
        )
        parts.append(text)
        leave_s, leave_outs, leave_compile = timed(sampler(row_buckets=args.row_buckets), micro)
        leave_tps, _, text = describe(
            f"micro-batches of {args.slots} with rows leaving", leave_s, leave_outs, leave_compile
        )
        parts.append(text)
        ratios = (
            f"ratio {live_tps / static_tps:.2f}x static micro-batches, "
            f"{live_tps / leave_tps:.2f}x micro-batches with rows leaving"
        )
    else:
        static_s, static_outs, static_compile = timed(sampler(row_buckets=1), whole)
        static_tps, _, text = describe(
            "sagc_jax static (every row until the longest)", static_s, static_outs, static_compile
        )
        same = all(
            np.array_equal(a.tokens_bt, b.tokens_bt)
            for a, b in zip(live_outs, static_outs, strict=True)
        )
        parts.append(text + f" [same tokens: {same}]")
        if args.peer == "tunix":
            peer_s, peer_first, peer_lengths = tunix_peer.run_sampler(
                tunix_model,
                prompts_bt,
                new_tokens=args.new_tokens,
                eos_ids=eos_ids,
                repeats=args.repeats,
            )
            peer_tps = np.sum(peer_lengths) / peer_s
            parts.append(
                f"tunix {peer_tps:,.0f} tok/s (mean length {np.mean(peer_lengths):.1f}, first "
                f"call {peer_first:.1f} s; logits agree to {diff:.0e}; tunix "
                f"{tunix_peer.version()})"
            )
        else:
            peer_tps, text = run_transformers(hf_model, prompts_bt, eos_ids, args)
            parts.append(text + f" transformers {transformers.__version__}")
        ratios = f"ratio {live_tps / static_tps:.2f}x static, {live_tps / peer_tps:.2f}x peer"
    print(
        f"generate {note} {os.path.basename(os.path.normpath(args.model or 'random-llama'))} "
        f"B={args.batch} prompt={args.prompt_len} new<={args.new_tokens} "
        f"params={num_params(state) / 1e6:.2f}M row_buckets={args.row_buckets} "
        f"decode_chunk={args.decode_chunk}={chunk}: " + " | ".join(parts) + f" | {ratios} | "
        f"{len(devices)} host devices, jax {jax.__version__}"
    )
    sys.stdout.flush()


def _tiny_llama(args):
    """The random Llama's config (see the module's docstring)."""
    import transformers
    from grpo_step import EOS
    from tunix_peer import TUNIX_ROPE_THETA

    return transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        max_position_embeddings=max(512, args.prompt_len + args.new_tokens),
        rope_theta=TUNIX_ROPE_THETA if args.peer == "tunix" else 10_000.0,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
    )


def run_transformers(hf_model, prompts_bt, eos_ids, args) -> tuple[float, str]:
    """(tokens per second, the line's peer part) of transformers' generate: forced, with
    min_new_tokens = max_new_tokens and no EOS, so all rows run to the end; early exit, stopping
    at EOS (a row's tokens counted up to its EOS, included)."""
    import numpy as np
    import torch

    input_ids = torch.as_tensor(prompts_bt, dtype=torch.long)
    gen_kwargs = dict(
        attention_mask=torch.ones_like(input_ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=args.new_tokens,
        pad_token_id=0,
    )
    if eos_ids:
        gen_kwargs["eos_token_id"] = list(eos_ids)
    else:
        gen_kwargs.update(min_new_tokens=args.new_tokens, eos_token_id=None)
    runs = []
    with torch.inference_mode():
        hf_model.generate(input_ids, **{**gen_kwargs, "min_new_tokens": 4, "max_new_tokens": 4})
        for seed in range(args.repeats):
            torch.manual_seed(seed)
            start = time.perf_counter()
            hf_out = hf_model.generate(input_ids, **gen_kwargs)
            seconds = time.perf_counter() - start
            new_bt = hf_out[:, prompts_bt.shape[1] :].numpy()
            ended_bt = np.isin(new_bt, eos_ids) if eos_ids else np.zeros(new_bt.shape, bool)
            # a row's length: up to its first EOS, included, else the cap
            first = np.where(ended_bt.any(1), ended_bt.argmax(1) + 1, new_bt.shape[1])
            runs.append((seconds, first))
    if not eos_ids:
        assert hf_out.shape == (args.batch, args.prompt_len + args.new_tokens), hf_out.shape
    seconds, lengths = min(runs, key=lambda run: run[0])
    tps = lengths.sum() / seconds
    return tps, (
        f"transformers {tps:,.0f} tok/s (mean length {lengths.mean():.1f}; torch "
        f"{torch.__version__}, set_num_threads({args.threads}), {len(os.sched_getaffinity(0))} "
        "cores)"
    )


if __name__ == "__main__":
    main()
