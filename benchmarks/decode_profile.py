"""Decode-step profile of the sampler against the roofline: one line per batch size.

For each B in ``--batches``: a ``Sampler`` of the preset (random weights, nnx.Rngs(0)) forced to
generate every token (``eos_ids=()``), B random prompts of ``--prompt-len`` tokens, temperature
1. Figures:

- time per decode step = (T(new) - T(short)) / (new - short), T(n) the best of ``--repeats``
  calls with n new tokens (each its own compiled program, compiled before timing). The
  difference drops what a call pays once (prefill, first token, argument transfers, dispatch,
  the output fetch) and keeps what the decode steps between `short` and `new` cost, the cache
  growth between decode phases included;
- the roofline prediction of those same steps: the mean of ``sim.roofline.decode_step`` over
  steps s = short .. new - 1, B rows whose contexts sum to B x (prompt + s) tokens, on
  ``--hardware`` (a preset, with the roofline's default efficiencies) or, by default, this
  host measured by ``host_roofline.measure_host`` (no derating, no launch term); and the
  ratio measured / predicted (1 = at the roofline);
- what one call and one step launch, counted from a ``jax.profiler`` trace of one call with
  `new` tokens and one with `short` (the output fetch included): programs executed, host-to-
  device and device-to-host transfers, and device ops (XLA:CPU thunks named after the
  program's HLO instructions; on a GPU, the kernels and copies on its streams). Per step is
  the difference of the two calls over the step difference (0 programs and 0 transfers per
  step: the decode loop is ``while`` loops inside one program). From the compiled program:
  its ``while`` loops and ``conditional`` ops, and host callbacks / infeed / outfeed / send /
  recv. On a GPU, XLA copies a ``while`` loop's predicate (and a ``conditional``'s branch
  index) to the host every time it runs unless the loop is lowered into a CUDA graph (command
  buffer): the trace's device-to-host copies on the GPU's streams, per step, show which.
  ``--top N`` lists the N device ops that took the most time in the `new` call, in
  microseconds per decode step, with the jax operation each comes from.

    .venv/bin/python benchmarks/decode_profile.py [--preset tiny] [--batches 64,256,1024]
    python benchmarks/decode_profile.py --hardware h200 --preset tiny,qwen2.5-0.5b --batches 256

Runs in well under a minute on a 2-core CPU with the defaults; not part of ``make test``.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile
import time
from functools import partial
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from host_roofline import describe, roofline_hardware

from sagc_jax.models import Decoder, get_preset
from sagc_jax.models.hf_checkpoint import hf_architecture
from sagc_jax.sampling import Sampler
from sagc_jax.sim.roofline import decode_step, model_costs

_HOST_ROUND_TRIPS = re.compile(r"\b(infeed|outfeed|send|recv|send-done|recv-done)\(|callback")
_CONTROL_FLOW = re.compile(r"(while|cond|conditional|call)\b")
_DEVICE_TO_HOST = re.compile(r"d(evice)?\s*to\s*h(ost)?\b|dtoh|d2h", re.IGNORECASE)


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset",
        default="tiny",
        help="a preset or a comma-separated list; a Hugging Face directory (its config.json) "
        "gives that architecture (random weights)",
    )
    parser.add_argument("--batches", default="64,256,1024", help="comma-separated row counts")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--short-tokens", type=int, default=8, help="the call subtracted")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per length (best)")
    parser.add_argument("--hardware", default=None, help="a roofline preset (default: measure)")
    parser.add_argument(
        "--dtype", default=None, help="params and compute (default: float32 on CPU, else bf16)"
    )
    parser.add_argument(
        "--decode-chunk",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="sampling.decode_chunk (0: one phase over the whole cache)",
    )
    parser.add_argument("--no-trace", action="store_true", help="skip the launch counts")
    parser.add_argument(
        "--top", type=int, default=0, help="also list the N slowest device ops (from the trace)"
    )
    args = parser.parse_args()
    if not 1 <= args.short_tokens < args.new_tokens:
        parser.error(f"need 1 <= --short-tokens < --new-tokens, got {args.short_tokens}")
    return args


def _call(sampler, state, ids_bt, lens_b, key, new: int):
    """One forced call with ``new`` tokens, its outputs fetched to the host."""
    out = sampler(state, ids_bt, lens_b, key, max_new_tokens=new)
    return jax.device_get(out)


def _best_call_seconds(sampler, state, ids_bt, lens_b, new: int, repeats: int) -> float:
    keys = [jax.random.key(seed) for seed in range(repeats + 1)]
    _call(sampler, state, ids_bt, lens_b, keys[0], new)  # warm (compiled ahead)
    best = float("inf")
    for key in keys[1:]:
        start = time.perf_counter()
        out = _call(sampler, state, ids_bt, lens_b, key, new)
        best = min(best, time.perf_counter() - start)
    assert int(out.lengths_b.min()) == new, "forced generation ended a row early"
    return best


def _op_names(hlo_text: str) -> dict[str, str]:
    """Instruction name ('.' as '_', as kernels are named) -> its jax op_name metadata."""
    names = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) =", line)
        if m:
            meta = re.search(r'op_name="([^"]+)"', line)
            op_name = meta.group(1).replace("jit(_generate_impl)/", "") if meta else ""
            names[m.group(1).replace(".", "_")] = op_name
    return names


def _trace_counts(fn, hlo_text: str) -> dict:
    """Programs, transfers and device ops of one ``fn()`` from a profiler trace, and the
    device ops' total microseconds by name (``op_us``)."""
    names = _op_names(hlo_text)
    with tempfile.TemporaryDirectory() as log_dir:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
        with jax.profiler.trace(log_dir, create_perfetto_trace=True, profiler_options=options):
            fn()
        (path,) = glob.glob(f"{log_dir}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    devices = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and "/device:" in e["args"].get("name", "")
        and "CPU" not in e["args"]["name"]
    }
    spans = [e for e in events if e.get("ph") == "X"]
    if devices:  # GPU/TPU: what ran on the device's streams
        op_spans = [e for e in spans if e["pid"] in devices]
    else:  # XLA:CPU: thunks named after the program's instructions
        op_spans = [e for e in spans if e["name"].replace(".", "_") in names]
    op_us = collections.Counter()
    for e in op_spans:  # (control flow spans its body's ops: not an op of its own)
        if not _CONTROL_FLOW.match(e["name"]):
            op_us[e["name"]] += e.get("dur", 0)
    return {
        "op_us": op_us,
        "programs": sum("ExecuteHelper" in e["name"] for e in spans),
        "h2d": sum(e["name"] in ("DevicePut", "DevicePutWithSharding") for e in spans),
        "d2h": sum("copy_to_host" in e["name"] for e in spans),
        "ops": len(op_spans),
        "device_d2h": sum(
            e["pid"] in devices and bool(_DEVICE_TO_HOST.search(e["name"])) for e in spans
        ),
    }


def _counts_line(sampler, state, ids_bt, lens_b, text: dict, short: int, new: int, top: int) -> str:
    """Programs, transfers and device ops per step and per call, and the HLO's control flow;
    then the ``top`` device ops of the `new` call by time, in microseconds per decode step."""
    key = jax.random.key(9)
    counts = {
        n: _trace_counts(partial(_call, sampler, state, ids_bt, lens_b, key, n), text[n])
        for n in (short, new)
    }
    per_step = {
        k: (counts[new][k] - counts[short][k]) / (new - short) for k in counts[new] if k != "op_us"
    }
    loops = len(re.findall(r"\swhile\(", text[new]))
    conds = len(re.findall(r"\sconditional\(", text[new]))
    trips = len(_HOST_ROUND_TRIPS.findall(text[new]))
    c = counts[new]
    names = _op_names(text[new])
    slowest = [
        f"\n    {us / (new - 1):8.1f} us/step  {name}  {names.get(name.replace('.', '_'), '')}"
        for name, us in c["op_us"].most_common(top)
    ]
    return (
        f"per step: {per_step['programs']:g} programs, "
        f"{per_step['h2d'] + per_step['d2h']:g} transfers, {per_step['ops']:.0f} device ops, "
        f"{per_step['device_d2h']:g} device-to-host copies | per call: {c['programs']} programs, "
        f"{c['h2d']} h2d + {c['d2h']} d2h transfers, {c['ops']} device ops; HLO: {loops} while, "
        f"{conds} conditional, {trips} callbacks/feeds" + "".join(slowest)
    )


def profile_batch(cfg, graphdef, state, batch: int, args, hw, eff) -> str:
    """The comparable line of one batch size (see the module docstring)."""
    costs = model_costs(cfg)
    new, short, width = args.new_tokens, args.short_tokens, args.prompt_len
    ids_bt = np.random.RandomState(batch).randint(3, cfg.vocab_size, (batch, width))
    ids_bt = ids_bt.astype(np.int32)
    lens_b = np.full((batch,), width, np.int32)
    sampler = Sampler(graphdef, cfg, eos_ids=(), pad_id=0, decode_chunk=args.decode_chunk)
    # compiled ahead (the calls run these executables): their HLO for the census
    text = {
        n: sampler.compile(state, batch, width, max_new_tokens=n).as_text() for n in (short, new)
    }
    seconds = {
        n: _best_call_seconds(sampler, state, ids_bt, lens_b, n, args.repeats) for n in (short, new)
    }
    step_s = (seconds[new] - seconds[short]) / (new - short)
    predicted = [
        decode_step(costs, hw, batch, batch * (width + s), eff=eff) for s in range(short, new)
    ]
    roof_s = float(np.mean([p[0] for p in predicted]))
    line = (
        f"B={batch} prompt={width} new={new} (minus {short}): {step_s * 1e3:.3f} ms/step "
        f"({batch / step_s:,.0f} tok/s) | roofline {roof_s * 1e3:.3f} ms/step "
        f"({predicted[len(predicted) // 2][1]}) | measured/roofline {step_s / roof_s:.1f}x"
    )
    if not args.no_trace:
        line += " | " + _counts_line(sampler, state, ids_bt, lens_b, text, short, new, args.top)
    assert sampler.compiled_programs() == 2, sampler.compiled_programs()  # no recompiles
    return line


def main() -> None:
    args = _parse()
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    hw, eff = roofline_hardware(args.hardware)
    device = jax.devices()[0].device_kind
    print(f"decode_profile: {device} x {jax.device_count()}, jax {jax.__version__}")
    print(describe(hw, eff), flush=True)
    for preset in args.preset.split(","):
        if (Path(preset) / "config.json").is_file():
            cfg = hf_architecture(preset, param_dtype=dtype, compute_dtype=dtype)
            preset = Path(preset).name
        else:
            cfg = get_preset(preset, param_dtype=dtype, compute_dtype=dtype)
        print(f"{preset}: {model_costs(cfg).params / 1e6:.2f}M params, {dtype}", flush=True)
        graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
        for batch in (int(b) for b in args.batches.split(",")):
            start = time.perf_counter()
            head, _, slowest = profile_batch(cfg, graphdef, state, batch, args, hw, eff).partition(
                "\n"
            )
            elapsed = time.perf_counter() - start
            print(f"{preset} {head} | {elapsed:.1f} s" + ("\n" + slowest if slowest else ""))


if __name__ == "__main__":
    main()
