"""Rollout time of a LoRA policy sampled merged (W + delta folded once, then the plain model
decodes) against unmerged (every decode step adds (x @ A) @ B to each adapted projection).

The CPU demo's shapes by default: the tiny preset with the synthetic task's 16-character
vocabulary, the demo's rollout batch (16 prompts x G = 8), 24-token prompts, 48 new tokens
forced (no end-of-sequence stop), rank 8 on every projection, adapters random (so the merge is
not trivially the base). Each side is compiled first, then the two are timed in turns
`--repeats` times (the best of each kept: a shared machine's busy spells hit both alike), in
wall time and in this process's CPU time (less sensitive to other jobs on the cores); the
merged side's time includes its merge program. One line: both sides' times, the ratios
unmerged / merged, and that both produced the same tokens.

    .venv/bin/python benchmarks/lora_sampler.py [--batch 128] [--rank 8] [--repeats 10]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import numpy as np
from flax import nnx

from sagc_jax.models import Decoder, get_preset
from sagc_jax.models.lora import LoRAParam, merge_adapters, scale
from sagc_jax.sampling import Sampler
from sagc_jax.tasks import CharTokenizer


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    return parser.parse_args()


def _best(fns, repeats: int) -> list[tuple[float, float]]:
    """(best wall seconds, best CPU seconds of this process) of each of ``fns``, run in turns
    (so a busy spell of a shared machine hits both sides alike), each compiled first."""
    for fn in fns:
        jax.block_until_ready(fn())
    walls, cpus = [[] for _ in fns], [[] for _ in fns]
    for _ in range(repeats):
        for fn, wall, cpu in zip(fns, walls, cpus, strict=True):
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn())
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return [(min(wall), min(cpu)) for wall, cpu in zip(walls, cpus, strict=True)]


def main() -> None:
    args = _parse()
    vocab = CharTokenizer().vocab_size
    cfg = get_preset(args.preset, vocab_size=vocab, lora_rank=args.rank)
    graphdef, adapters, base = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), LoRAParam, ...)
    key = jax.random.key(1)
    adapters = jax.tree.map(lambda x: jax.random.normal(key, x.shape, x.dtype) * 0.05, adapters)
    base_graphdef = nnx.split(Decoder(cfg.replace(lora_rank=0), rngs=nnx.Rngs(0)))[0]

    rng = np.random.default_rng(0)
    prompts = rng.integers(3, vocab, (args.batch, args.prompt_len)).astype(np.int32)
    lens = np.full((args.batch,), args.prompt_len, np.int32)
    kw = dict(max_new_tokens=args.new_tokens, temperature=1.0)
    unmerged_sampler = Sampler(graphdef, cfg, eos_ids=())
    merged_sampler = Sampler(base_graphdef, cfg.replace(lora_rank=0), eos_ids=())
    merge = jax.jit(functools.partial(merge_adapters, lora_scale=scale(cfg)))
    unmerged_state = nnx.merge_state(adapters, base)

    def unmerged():
        return unmerged_sampler(unmerged_state, prompts, lens, key, **kw).tokens_bt

    def merged():
        return merged_sampler(merge(adapters, base), prompts, lens, key, **kw).tokens_bt

    (wall_m, cpu_m), (wall_u, cpu_u) = _best([merged, unmerged], args.repeats)
    same = bool(np.array_equal(unmerged(), merged()))
    print(
        f"lora sampler ({args.preset}, rank {args.rank}, batch {args.batch}, prompt "
        f"{args.prompt_len}, {args.new_tokens} new tokens, {jax.devices()[0].platform}): "
        f"merged {wall_m * 1e3:.1f} ms (CPU {cpu_m * 1e3:.1f} ms), unmerged "
        f"{wall_u * 1e3:.1f} ms (CPU {cpu_u * 1e3:.1f} ms), unmerged / merged "
        f"{wall_u / wall_m:.2f}x wall, {cpu_u / cpu_m:.2f}x CPU, same tokens: {same}"
    )


if __name__ == "__main__":
    main()
