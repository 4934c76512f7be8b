"""Tokens per second of sagc_jax's sampler against a peer's: transformers' generate (CPU torch)
or Tunix's vanilla JAX sampler (`--peer tunix`, the extra 'tunix').

Same model (a random Llama: vocab 512, hidden 256, mlp 688, 4 layers, 8 heads, 4 kv heads, tied
embeddings; about 3M parameters) on both sides, batch 64, 16-token prompts, sampling at
temperature 1 without top-k/top-p. `--workload forced` (default): 128 new tokens, every row
forced to generate all of them (no end-of-sequence stop). `--workload early-exit`: rows stop at
the end-of-sequence token under a cap of 512, the model given the constant EOS logit bias of
`grpo_step.py` (`add_eos_bias`) for a mean length of `--mean-length` (60), so the batch ends with
its longest row. The two run one after the other; one line is printed with both figures
(generated tokens per second, EOS included), their ratio and the JAX compile time. With
`--peer tunix` the model uses rope theta 1e6 (what Tunix 0.1.7's Llama 3 applies; see
`tunix_peer.py`), Tunix loads the same checkpoint, and both give the same logits before timing.

Both sides get the same cores: torch runs `torch.set_num_threads(threads)`; XLA:CPU runs each of
these small ops on one thread, so JAX gets `threads` host devices
(--xla_force_host_platform_device_count) and the sampler splits the batch across them
(`Sampler(plan=...)` on a `data` mesh, weights replicated). The process is pinned to `threads`
cores when the machine has more. `--decode-chunk` is `sampling.decode_chunk` (0: every decode
step attends over the whole cache).

Beside the measured figure: the roofline's tokens per second for the same shapes (prefill and
synchronous decode of B rows to the full length, `sim.roofline.rollout_seconds`) on the host
measured by `host_roofline.py` (no derating; the host counts as one chip whatever the number of
JAX host devices), or on `--hardware PRESET` on an accelerator, and the ratio of the measured
time to the roofline's.

    .venv/bin/python benchmarks/generate.py [--threads 2] [--repeats 3] [--decode-chunk auto]
        [--peer transformers|tunix] [--workload forced|early-exit]
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
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument(
        "--new-tokens", type=int, default=0, help="cap (default: 128 forced, 512 early-exit)"
    )
    parser.add_argument("--workload", choices=("forced", "early-exit"), default="forced")
    parser.add_argument(
        "--mean-length", type=float, default=60.0, help="early-exit: expected completion length"
    )
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
    parser.add_argument("--hardware", default=None, help="roofline preset (default: measure)")
    args = parser.parse_args()
    args.new_tokens = args.new_tokens or (128 if args.workload == "forced" else 512)
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
    from tunix_peer import TUNIX_ROPE_THETA

    from sagc_jax.config import MeshConfig
    from sagc_jax.models import load_hf_checkpoint, num_params
    from sagc_jax.parallel import ShardingPlan
    from sagc_jax.sampling import Sampler
    from sagc_jax.sampling.sampler import phase_slots, resolve_chunk
    from sagc_jax.sim.roofline import model_costs, rollout_seconds

    torch.set_num_threads(args.threads)
    transformers.logging.disable_progress_bar()  # save_pretrained's "Writing model shards"
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
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
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    note = "forced"
    if args.workload == "early-exit":
        raise_, expected = add_eos_bias(hf_model, args.mean_length, args.new_tokens, seed=0)
        note = f"early exit, EOS logit +{raise_:.2f}, expected length {expected:.1f}"
    rng = np.random.RandomState(0)
    prompts_bt = rng.randint(3, hf_config.vocab_size, (args.batch, args.prompt_len)).astype(
        np.int32
    )
    with tempfile.TemporaryDirectory() as path:
        hf_model.save_pretrained(path)
        model, cfg = load_hf_checkpoint(path)
        if args.peer == "tunix":  # before anything is timed: the same weights, the same logits
            tunix_model = tunix_peer.tunix_model(path, cfg)
            diff = tunix_peer.check_same_logits(model, tunix_model, prompts_bt[:2])
    lens_b = np.full((args.batch,), args.prompt_len, np.int32)
    eos_ids = () if args.workload == "forced" else (EOS,)

    # ---- sagc_jax: rows split over the host devices.
    devices = jax.devices()
    plan = ShardingPlan.from_config(MeshConfig(data=len(devices), fsdp=1, tensor=1))
    graphdef, state = nnx.split(model)
    param_sh = plan.params(state)
    state = jax.device_put(state, param_sh)
    sampler = Sampler(
        graphdef,
        cfg,
        eos_ids=eos_ids,
        pad_id=0,
        decode_chunk=args.decode_chunk,
        plan=plan,
        state_shardings=param_sh,
    )

    def run_jax(seed):
        out = sampler(
            state,
            prompts_bt,
            lens_b,
            jax.random.key(seed),
            max_new_tokens=args.new_tokens,
            temperature=1.0,
        )
        return jax.block_until_ready(out)

    start = time.perf_counter()
    out = run_jax(0)
    first_call = time.perf_counter() - start
    jax_runs = []
    for seed in range(1, args.repeats + 1):
        start = time.perf_counter()
        out = run_jax(seed)
        jax_runs.append((time.perf_counter() - start, np.asarray(out.lengths_b)))
    if args.workload == "forced":
        assert int(out.lengths_b.min()) == args.new_tokens
    assert sampler.compiled_programs() == 1
    chunk = resolve_chunk(args.new_tokens, args.decode_chunk)
    jax_s, jax_lengths = min(jax_runs, key=lambda run: run[0])
    jax_tps = jax_lengths.sum() / jax_s
    compile_s = first_call - jax_s
    hw, eff = roofline_hardware(args.hardware)
    roofline = rollout_seconds(model_costs(cfg), hw, jax_lengths, args.prompt_len, eff=eff)
    roofline_tps = jax_lengths.sum() / roofline["seconds"]

    if args.peer == "tunix":
        peer_s, peer_first, peer_lengths = tunix_peer.run_sampler(
            tunix_model,
            prompts_bt,
            new_tokens=args.new_tokens,
            eos_ids=eos_ids,
            repeats=args.repeats,
        )
        peer = (
            f"tunix {np.sum(peer_lengths) / peer_s:,.0f} tok/s (mean length "
            f"{np.mean(peer_lengths):.1f}, first call {peer_first:.1f} s; logits agree to "
            f"{diff:.0e})"
        )
        versions = f"tunix {tunix_peer.version()}"
        peer_tps = np.sum(peer_lengths) / peer_s
    else:
        peer_tps, peer = run_transformers(hf_model, prompts_bt, eos_ids, args)
        versions = f"transformers {transformers.__version__}"
    print(
        f"generate {note} B={args.batch} prompt={args.prompt_len} new<={args.new_tokens} "
        f"params={num_params(state) / 1e6:.2f}M: sagc_jax {jax_tps:,.0f} tok/s (mean length "
        f"{jax_lengths.mean():.1f}; roofline {roofline_tps:,.0f} tok/s, {roofline['limit']}, on "
        f"{hw.name} at {hw.peak_flops / 1e9:,.0f} GFLOP/s, {hw.hbm_bandwidth / 1e9:,.0f} GB/s: "
        f"measured time {roofline_tps / jax_tps:.1f}x the roofline's) | {peer} | "
        f"ratio {jax_tps / peer_tps:.2f}x | jax compile {compile_s:.1f} s "
        f"({len(devices)} host devices, decode_chunk {args.decode_chunk} = {chunk}: "
        f"{len(phase_slots(args.new_tokens, chunk))} phases) | jax {jax.__version__} {versions}"
    )
    sys.stdout.flush()


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
