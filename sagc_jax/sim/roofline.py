"""A roofline step-time model: seconds of a rollout and an update from the hardware and the model.

Hardware: published per-chip peak dense bfloat16 FLOP/s, HBM bandwidth and memory (``HARDWARE``,
each with its vendor page). Model: parameter count, weight bytes, KV-cache bytes per token and
FLOPs per token from the decoder's shapes (``ModelCosts``; built from a ``DecoderConfig`` by
``model_costs``). A mesh of ``devices`` chips splits the rows of a batch between them (data
parallel) and each chip holds the weights it decodes with.

- Decode step of ``B`` rows whose contexts sum to ``C`` tokens, per chip: the larger of the
  memory time, ``(weight bytes + KV bytes of C tokens) / (bandwidth x bandwidth efficiency)``,
  and the compute time, ``FLOPs of B tokens at their contexts / (peak x decode efficiency)``,
  plus a fixed launch cost per step. The limit that binds is reported with it.
- Prefill and the update: FLOPs of the tokens actually processed (packed rows: the real tokens;
  padded rows: rows x width) over ``devices x peak x MFU``; the update costs forward + backward
  (3x the forward's FLOPs) per epoch.
- Three rollout regimes (``REGIMES``):

  - ``compacting``: the project's sampler (``sampling/sampler.py``), its decode iterations
    replayed by ``decode_schedule.simulate`` (whose docstring gives the order of events): one
    prefill per prompt; ``slots`` rows decode at once and a finished row's slot takes the next
    waiting rollout; with none waiting, the rows still running are gathered into the smallest of
    ``row_buckets`` row counts that holds them. The finished rows that fill the rest of a row
    count cost what the running ones do on average.
  - ``synchronous``: the sampler before row compaction: every row of the step stays in the
    batch until the longest ends (a finished row keeps its growing cache), each row prefills its
    own prompt, so the step's time follows its longest completion.
  - ``continuous`` batching with a fixed number of slots (vLLM-style: a finished row's slot
    takes the next rollout at once, each step reads only the active rows' caches), so time
    follows the total tokens, bounded below by the longest completion.

The efficiency factors (``Efficiency``) are assumptions to override, not measurements: no
device run of this project has measured them at real RL sizes yet.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from sagc_jax import decode_schedule

REGIMES = ("compacting", "synchronous", "continuous")  # the first is the sampler's own
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator chip: peak dense bfloat16 FLOP/s, HBM bytes/s and GiB, vendor page."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    memory_gib: float
    source: str


HARDWARE = {
    # NVIDIA's product pages: dense (no sparsity) BF16 Tensor Core figures of the SXM parts.
    "h100": Hardware(
        "NVIDIA H100 SXM", 989e12, 3.35e12, 80, "https://www.nvidia.com/en-us/data-center/h100/"
    ),
    "h200": Hardware(
        "NVIDIA H200 SXM", 989e12, 4.8e12, 141, "https://www.nvidia.com/en-us/data-center/h200/"
    ),
    "a100-80gb": Hardware(
        "NVIDIA A100 80GB SXM",
        312e12,
        2.039e12,
        80,
        "https://www.nvidia.com/en-us/data-center/a100/",
    ),
    # Cloud TPU system architecture pages, per chip.
    "tpu-v4": Hardware("TPU v4", 275e12, 1228e9, 32, "https://cloud.google.com/tpu/docs/v4"),
    "tpu-v5e": Hardware("TPU v5e", 197e12, 819e9, 16, "https://cloud.google.com/tpu/docs/v5e"),
    "tpu-v5p": Hardware("TPU v5p", 459e12, 2765e9, 95, "https://cloud.google.com/tpu/docs/v5p"),
    "tpu-v6e": Hardware("TPU v6e", 918e12, 1638e9, 32, "https://cloud.google.com/tpu/docs/v6e"),
}

# What this project's own programs reached on a chip (benchmarks/device_check.sh; details in
# BENCHMARKS.md): (date, machine, what was measured). Not used as the default efficiencies:
# none was taken at real RL sizes, and the sampler's is far from the limit the defaults assume.
MEASURED = {
    "h200": (
        (
            "2026-12-01",
            "one H200, jax 0.11.2",
            "qwen2.5-0.5b, 128 rows of <= 256 new tokens: rollouts 10,298 tok/s; update MFU "
            "14.25% packed on 4,352 tokens a step",
        ),
    ),
}


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Shares of the peaks a real program reaches (assumptions; override with measurements).

    bandwidth: of HBM bandwidth in a decode step; decode_flops: of peak FLOP/s in a decode step;
    mfu: of peak FLOP/s in prefill and the update; launch_seconds: fixed cost of one decode step
    (program launch, sampling, host round trip).
    """

    bandwidth: float = 0.7
    decode_flops: float = 0.5
    mfu: float = 0.4
    launch_seconds: float = 50e-6

    @classmethod
    def of(cls, sim) -> Efficiency:
        """The factors a ``SimConfig`` sets (``sim.bandwidth_efficiency`` ...)."""
        return cls(
            sim.bandwidth_efficiency, sim.decode_flops_efficiency, sim.mfu, sim.launch_seconds
        )


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    """What one token costs a decoder: ``params`` (every weight), ``matmul_params`` (the weights
    a token multiplies: all but the embedding lookup, the LM head included), ``weight_bytes``
    (read once per decode step), ``kv_bytes_per_token`` (all layers, K and V) and
    ``attention_flops_per_context`` (forward FLOPs of one token per token of its context)."""

    params: int
    matmul_params: int
    weight_bytes: int
    kv_bytes_per_token: int
    attention_flops_per_context: int

    def forward_flops(self, tokens, context) -> float:
        """Forward FLOPs of ``tokens`` tokens whose contexts sum to ``context`` tokens."""
        return 2.0 * self.matmul_params * tokens + self.attention_flops_per_context * context


def model_costs(arch) -> ModelCosts:
    """``ModelCosts`` of a ``DecoderConfig`` (weights read in its compute dtype when decoding)."""
    d, f, v, layers = arch.hidden_size, arch.intermediate_size, arch.vocab_size, arch.num_layers
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f  # attention projections + SwiGLU MLP
    biases = (q + 2 * kv) * layers if arch.qkv_bias else 0
    norms = (2 * layers + 1) * d
    head = 0 if arch.tie_embeddings else v * d
    params = v * d + head + layers * per_layer + biases + norms
    matmul = layers * per_layer + v * d  # the LM head multiplies whether tied or not
    itemsize = _DTYPE_BYTES[arch.compute_dtype]
    return ModelCosts(
        params=params,
        matmul_params=matmul,
        weight_bytes=params * itemsize,
        kv_bytes_per_token=2 * layers * kv * itemsize,
        attention_flops_per_context=4 * layers * q,  # scores and values: 2 FLOPs each per dim
    )


def _decode_terms(costs: ModelCosts, hw: Hardware, rows, context, devices: int, eff: Efficiency):
    """``(memory seconds, compute seconds)`` of decode steps (numpy arrays or scalars) of
    ``rows`` rows whose contexts sum to ``context`` tokens, split over ``devices`` chips."""
    memory = (costs.weight_bytes + costs.kv_bytes_per_token * context / devices) / (
        hw.hbm_bandwidth * eff.bandwidth
    )
    compute = costs.forward_flops(rows / devices, context / devices) / (
        hw.peak_flops * eff.decode_flops
    )
    return memory, compute


def decode_step(
    costs: ModelCosts, hw: Hardware, rows: int, context: float, devices: int = 1, eff=None
) -> tuple[float, str]:
    """``(seconds, binding limit)`` of one decode step of ``rows`` rows whose contexts sum to
    ``context`` tokens, on ``devices`` chips splitting the rows; the limit is ``bandwidth``,
    ``compute`` or ``launch`` (the largest of the three terms)."""
    eff = eff or Efficiency()
    memory, compute = _decode_terms(costs, hw, rows, context, devices, eff)
    terms = {"bandwidth": memory, "compute": compute, "launch": eff.launch_seconds}
    return float(max(memory, compute) + eff.launch_seconds), max(terms, key=terms.get)


def dense_seconds(flops: float, hw: Hardware, devices: int = 1, eff=None) -> float:
    """Seconds of compute-bound work (prefill, update) of ``flops`` FLOPs on ``devices`` chips."""
    eff = eff or Efficiency()
    return flops / (devices * hw.peak_flops * eff.mfu)


def slot_schedule(lengths, slots: int) -> np.ndarray:
    """int64 [B]: the decode step at which each rollout starts when ``slots`` rows decode at
    once and a finished row's slot takes the next rollout in order (each holds its slot for as
    many steps as it has tokens)."""
    return decode_schedule.list_schedule(lengths, slots)


def _prefill_seconds(costs: ModelCosts, hw: Hardware, prompts, devices: int, eff) -> float:
    """Seconds of prefilling prompts of ``prompts`` tokens (int [P]), each token attending over
    the tokens before it."""
    prompts = np.asarray(prompts, np.int64)
    flops = costs.forward_flops(prompts.sum(), (prompts * (prompts + 1) / 2).sum())
    return dense_seconds(flops, hw, devices, eff)


def _decode_seconds(costs: ModelCosts, hw: Hardware, rows_k, context_k, devices: int, eff):
    """``(seconds, limit)`` of decode steps k of ``rows_k`` rows whose contexts sum to
    ``context_k`` tokens (float [K] each): the sum of the steps' times and the limit that binds
    most of them (``bandwidth``, ``compute`` or ``launch``; ``none`` when K = 0)."""
    if len(rows_k) == 0:
        return 0.0, "none"
    memory, compute = _decode_terms(costs, hw, rows_k, context_k, devices, eff)
    bound = np.where(compute > memory, "compute", "bandwidth")
    bound = np.where(np.maximum(memory, compute) < eff.launch_seconds, "launch", bound)
    names, counts = np.unique(bound, return_counts=True)
    seconds = float(np.maximum(memory, compute).sum()) + len(rows_k) * eff.launch_seconds
    return seconds, str(names[np.argmax(counts)])


def prompt_rows(shape, group_sizes=None) -> np.ndarray:
    """int64 [P]: the first row of each prompt's rollouts among ``B`` rows read row-major.
    ``shape``: the lengths' shape, ``[P, G]`` (P prompts of G rollouts) or ``[B]``;
    ``group_sizes``: int [P], rollouts per prompt in row order (they must sum to B); None: a
    ``[P, G]`` shape gives them, a flat ``[B]`` means one prompt per row."""
    rows = int(np.prod(shape))
    if group_sizes is None:
        size = shape[1] if len(shape) == 2 else 1
        return np.arange(0, rows, max(size, 1), dtype=np.int64)
    sizes_p = np.asarray(group_sizes, np.int64).ravel()
    if sizes_p.size == 0 or sizes_p.min() < 1 or sizes_p.sum() != rows:
        raise ValueError(
            f"group_sizes {sizes_p.tolist()} must be >= 1 each and sum to the {rows} rows of the "
            "lengths"
        )
    return np.concatenate([[0], np.cumsum(sizes_p)[:-1]]).astype(np.int64)


def group_rows(shape, group_sizes=None) -> np.ndarray:
    """int64 [B]: each row's prompt group (``prompt_rows``'s groups, row-major)."""
    first_p = prompt_rows(shape, group_sizes)
    sizes_p = np.diff(np.append(first_p, int(np.prod(shape))))
    return np.repeat(np.arange(first_p.size, dtype=np.int64), sizes_p)


def cut_step(lengths, groups_r, keep_groups: int, slots: int = 0):
    """A tail-batched step of rollouts ``lengths`` [B] (the lengths they would reach; groups
    ``groups_r`` int [B], started in row order through ``slots`` slots, 0: all), stopped at
    ``decode_schedule.group_stop`` with ``keep_groups``: ``(stop_k, reached_r, done_r, kept_g)``:
    the stop iteration, the tokens each rollout has then (its length if done, else what it
    reached, 0 if never started), which are done, and bool [num_groups] the groups kept: the
    first ``keep_groups`` whole ones in group order (the trainer's rule: ``programs/tail.py``)."""
    lengths = np.asarray(lengths, np.int64).ravel()
    groups_r = np.asarray(groups_r, np.int64).ravel()
    slots = min(slots or lengths.size, lengths.size)
    stop_k, done_r = decode_schedule.group_stop(lengths, groups_r, keep_groups, slots=slots)
    start_r = decode_schedule.start_times(lengths, slots)
    reached_r = np.where(done_r, lengths, np.clip(stop_k - start_r + 1, 0, lengths))
    end_g = np.zeros(int(groups_r.max()) + 1, np.int64)
    np.maximum.at(end_g, groups_r, start_r + lengths - 1)
    kept_g = np.zeros(end_g.size, bool)
    kept_g[np.flatnonzero(end_g <= stop_k)[:keep_groups]] = True
    return stop_k, reached_r, done_r, kept_g


def reached_lengths(lengths, groups_r, keep_groups: int, slots: int = 0) -> np.ndarray:
    """int64 [B]: ``cut_step``'s tokens reached by each rollout."""
    return cut_step(lengths, groups_r, keep_groups, slots)[1]


def _compacting(
    costs, hw, lengths, prompts, devices, eff, slots, max_new_tokens, chunk, buckets, stop=None
):
    """The decode of the ``compacting`` regime: ``(seconds, limit, Schedule)``; ``stop``:
    ``(groups_r, keep_groups)`` of a tail-batched step, cut at ``decode_schedule.group_stop``."""
    lengths = np.maximum(lengths, 1)  # a completion has at least its first token
    cap = int(lengths.max()) if max_new_tokens is None else int(max_new_tokens)
    if lengths.max() > cap:
        raise ValueError(
            f"rollout_seconds: a completion of {int(lengths.max())} tokens is longer than "
            f"max_new_tokens = {cap}; pass the sampler's cap (or None: the longest)"
        )
    rows = min(slots or lengths.size, lengths.size)
    stop_at = None
    if stop is not None:
        stop_at, _ = decode_schedule.group_stop(lengths, stop[0], stop[1], slots=rows)
    plan = decode_schedule.simulate(
        lengths,
        cap,
        slots=rows,
        chunk=chunk,
        row_buckets=buckets,
        shards=math.gcd(rows, devices),  # the sampler needs slots a multiple of the shards
        prompt_tokens_r=prompts,
        stop_at=stop_at,
    )
    # the finished rows that fill a row count cost the running rows' mean context
    context_k = plan.rows_k / np.maximum(plan.live_k, 1) * (plan.prompt_sum_k + plan.age_sum_k)
    seconds, limit = _decode_seconds(costs, hw, plan.rows_k, context_k, devices, eff)
    return seconds, limit, plan


def rollout_seconds(
    costs: ModelCosts,
    hw: Hardware,
    lengths,
    prompt_tokens,
    devices: int = 1,
    regime: str = "synchronous",
    slots: int | None = None,
    eff=None,
    *,
    max_new_tokens: int | None = None,
    chunk: int = 0,
    row_buckets: int = 1,
    group_sizes=None,
    keep_groups: int | None = None,
    groups_r=None,
) -> dict:
    """Seconds of one step's rollouts: ``lengths`` are the completions' lengths (``[B]`` or
    ``[P, G]``, read row-major), ``prompt_tokens`` their prompt lengths (one int, or ``[B]``).

    ``synchronous``: every row prefills its prompt, then ``max(lengths)`` decode steps of all
    ``B`` rows (finished rows keep their slot and their growing cache). ``continuous``:
    ``slots`` rows in all (default ``B``) decode at a time and a finished row's slot takes the
    next rollout (``slot_schedule``), so the step lasts until the last slot finishes, at least
    ``sum / slots`` and at least the longest completion; each step reads the caches of the rows
    active in it; every row prefills its prompt. ``compacting`` (the sampler): one prefill per
    prompt (``group_sizes``, see ``prompt_rows``), then the decode iterations of
    ``decode_schedule.simulate`` through ``slots`` slots (None or 0: all ``B``; the sampler's
    ``sampling.slots``), cache phases of ``chunk`` slots (``decode_schedule.resolve_chunk``'s value;
    0: one phase), ``row_buckets`` rungs, rows sharded over ``devices`` chips, lengths capped at
    ``max_new_tokens`` (None: the longest); iteration k decodes ``rows_k`` rows whose contexts
    sum to ``rows_k / live_k x`` the running rows' (prompt + age) tokens.

    Tail batching: ``keep_groups`` (None: off) ends the step once that many prompt groups
    (``groups_r`` int [B], each row's group; None: from the shape and ``group_sizes``) have all
    their rollouts done, at ``decode_schedule.group_stop``'s iteration: ``compacting`` replays the
    sampler's iterations up to it; the other regimes time the tokens each rollout reached by
    the same exit test (``reached_lengths``; a rollout never started costs nothing).

    Returns seconds, prefill seconds, decode steps, the limit that binds most of them,
    ``rows_decoded`` (rows summed over the decode steps) and ``live_rows_decoded`` (of those,
    rows still running)."""
    eff = eff or Efficiency()
    shape = np.shape(lengths)
    lengths = np.asarray(lengths, np.int64).ravel()
    prompts = np.broadcast_to(np.asarray(prompt_tokens, np.int64), lengths.shape)
    rows = lengths.size
    if keep_groups is not None and groups_r is None:
        groups_r = group_rows(shape, group_sizes)
    if regime == "compacting":
        first_p = prompt_rows(shape, group_sizes)
        prefill = _prefill_seconds(costs, hw, prompts[first_p], devices, eff)
        stop = None if keep_groups is None else (groups_r, keep_groups)
        decode, limit, plan = _compacting(
            costs,
            hw,
            lengths,
            prompts,
            devices,
            eff,
            slots,
            max_new_tokens,
            chunk,
            row_buckets,
            stop,
        )
        return {
            "seconds": prefill + decode,
            "prefill_seconds": prefill,
            "decode_steps": plan.decode_steps,
            "limit": limit,
            "rows_decoded": plan.rows_decoded,
            "live_rows_decoded": plan.live_rows_decoded,
        }
    if keep_groups is not None:
        width = slots if regime == "continuous" else 0
        lengths = reached_lengths(lengths, groups_r, keep_groups, width or 0)
        started = lengths > 0
        lengths, prompts = lengths[started], prompts[started]
        rows = lengths.size
    prefill = _prefill_seconds(costs, hw, prompts, devices, eff)
    if regime == "synchronous":
        starts, occupied = np.zeros(rows, np.int64), np.full(rows, lengths.max())
    elif regime == "continuous":
        starts, occupied = slot_schedule(lengths, min(slots or rows, rows)), lengths
    else:
        raise ValueError(f"regime = {regime!r} is not allowed; use one of {list(REGIMES)}")
    # Row i holds a slot in decode steps starts[i] .. starts[i] + occupied[i] - 1 (0-based) with
    # a context of prompt + (step - start + 1) tokens: count rows and sum contexts per step from
    # difference arrays (a row adds prompt - start + 1 + step to every step it is active in).
    num_steps = int((starts + occupied).max())
    ends = starts + occupied
    active = np.zeros(num_steps + 1)
    offset = np.zeros(num_steps + 1)
    np.add.at(active, starts, 1)
    np.add.at(active, ends, -1)
    np.add.at(offset, starts, prompts - starts + 1)
    np.add.at(offset, ends, -(prompts - starts + 1))
    active, offset = np.cumsum(active)[:-1], np.cumsum(offset)[:-1]
    context = offset + active * np.arange(num_steps)
    decode, limit = _decode_seconds(costs, hw, active, context, devices, eff)
    return {
        "seconds": prefill + decode,
        "prefill_seconds": prefill,
        "decode_steps": num_steps,
        "limit": limit,
        "rows_decoded": int(active.sum()),
        "live_rows_decoded": int(lengths.sum()),
    }


def update_seconds(
    costs: ModelCosts,
    hw: Hardware,
    tokens: int,
    context: float,
    devices: int = 1,
    epochs: int = 1,
    eff=None,
    reference: bool = False,
) -> float:
    """Seconds of the update on ``tokens`` processed tokens whose contexts sum to ``context``
    (packed rows: the real tokens; padded: rows x width), forward + backward (3 forwards) per
    epoch, and with ``reference`` (a KL term) the reference policy's forward too."""
    passes = update_passes(reference)
    return dense_seconds(passes * epochs * costs.forward_flops(tokens, context), hw, devices, eff)


def update_passes(reference: bool) -> float:
    """Forwards' worth of FLOPs an update does per token: forward + backward (3), and one more
    for the reference policy's log-probabilities of a KL term."""
    return 3.0 + (1.0 if reference else 0.0)
