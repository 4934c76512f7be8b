"""Tokens per second of sagc_jax's sampler against transformers' generate (CPU torch).

Same model (a random Llama: vocab 512, hidden 256, mlp 688, 4 layers, 8 heads, 4 kv heads, tied
embeddings; about 3M parameters) on both sides, batch 64, 16-token prompts, 128 new tokens, both
forced to generate all 128 tokens (no end-of-sequence stop), sampling at temperature 1 without
top-k/top-p. The two run one after the other; one line is printed with both figures, their ratio
and the JAX compile time.

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
    parser.add_argument("--new-tokens", type=int, default=128)
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
    return parser.parse_args()


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
    from flax import nnx
    from host_roofline import roofline_hardware

    from sagc_jax.config import MeshConfig
    from sagc_jax.models import load_hf_checkpoint, num_params
    from sagc_jax.parallel import ShardingPlan
    from sagc_jax.sampling import Sampler
    from sagc_jax.sampling.sampler import phase_slots, resolve_chunk
    from sagc_jax.sim.roofline import model_costs, rollout_seconds

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    with tempfile.TemporaryDirectory() as path:
        hf_model.save_pretrained(path)
        model, cfg = load_hf_checkpoint(path)

    rng = np.random.RandomState(0)
    prompts_bt = rng.randint(3, cfg.vocab_size, (args.batch, args.prompt_len)).astype(np.int32)
    lens_b = np.full((args.batch,), args.prompt_len, np.int32)
    total_new = args.batch * args.new_tokens

    # ---- sagc_jax: eos_ids=() so every row generates all new tokens; rows split over devices.
    devices = jax.devices()
    plan = ShardingPlan.from_config(MeshConfig(data=len(devices), fsdp=1, tensor=1))
    graphdef, state = nnx.split(model)
    param_sh = plan.params(state)
    state = jax.device_put(state, param_sh)
    sampler = Sampler(
        graphdef,
        cfg,
        eos_ids=(),
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
    jax_times = []
    for seed in range(1, args.repeats + 1):
        start = time.perf_counter()
        out = run_jax(seed)
        jax_times.append(time.perf_counter() - start)
    assert int(out.lengths_b.min()) == args.new_tokens and sampler.compiled_programs() == 1
    chunk = resolve_chunk(args.new_tokens, args.decode_chunk)
    jax_tps = total_new / min(jax_times)
    compile_s = first_call - min(jax_times)
    hw, eff = roofline_hardware(args.hardware)
    lengths_b = np.full(args.batch, args.new_tokens)
    roofline = rollout_seconds(model_costs(cfg), hw, lengths_b, args.prompt_len, eff=eff)
    roofline_tps = total_new / roofline["seconds"]

    # ---- transformers: min_new_tokens = max_new_tokens and no eos, so all rows run to the end.
    input_ids = torch.as_tensor(prompts_bt, dtype=torch.long)
    gen_kwargs = dict(
        attention_mask=torch.ones_like(input_ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_new_tokens=args.new_tokens,
        max_new_tokens=args.new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    with torch.inference_mode():
        hf_model.generate(input_ids, **{**gen_kwargs, "min_new_tokens": 4, "max_new_tokens": 4})
        hf_times = []
        for seed in range(args.repeats):
            torch.manual_seed(seed)
            start = time.perf_counter()
            hf_out = hf_model.generate(input_ids, **gen_kwargs)
            hf_times.append(time.perf_counter() - start)
    assert hf_out.shape == (args.batch, args.prompt_len + args.new_tokens), hf_out.shape
    hf_tps = total_new / min(hf_times)

    print(
        f"generate B={args.batch} prompt={args.prompt_len} new={args.new_tokens} "
        f"params={num_params(state) / 1e6:.2f}M: sagc_jax {jax_tps:,.0f} tok/s (roofline "
        f"{roofline_tps:,.0f} tok/s, {roofline['limit']}, on {hw.name} at "
        f"{hw.peak_flops / 1e9:,.0f} GFLOP/s, {hw.hbm_bandwidth / 1e9:,.0f} GB/s: measured time "
        f"{roofline_tps / jax_tps:.1f}x the roofline's) | "
        f"transformers {hf_tps:,.0f} tok/s (torch {torch.__version__}, "
        f"set_num_threads({args.threads}), {len(os.sched_getaffinity(0))} cores) | "
        f"ratio {jax_tps / hf_tps:.2f}x | jax compile {compile_s:.1f} s "
        f"({len(devices)} host devices, decode_chunk {args.decode_chunk} = {chunk}: "
        f"{len(phase_slots(args.new_tokens, chunk))} phases) | "
        f"jax {jax.__version__} transformers {transformers.__version__}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
