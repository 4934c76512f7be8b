#!/usr/bin/env bash
# The accelerator check of issues #12, #20 and #31, one call under 8 minutes on one H200, from
# the checkout: the decode-step profile against the H200 roofline at B = 256 (tiny and 0.5B
# presets, random bfloat16 weights), the sampler's rows leaving on a long tail (generate.py),
# then a few GRPO steps of each preset at the realistic size (512 rollouts of 1,024 forced
# tokens, a packed update of over 500k real tokens; device_check.py; two steps per preset: the
# first compiles, the second is measured).
#   bash benchmarks/device_check.sh [extra device_check.py flags]
# Budget (estimated; no GPU has run this version): the roofline puts a 0.5B step at 1.4 s of
# rollout (512 x 1,024 tokens) and 3.1 s of update; at the 10-40x off the roofline that the
# sampler was on the H200 before (10,000 tok/s for 128 rows), a rollout takes 15-55 s, and
# compiling took most of the earlier check's 229 s per 0.5B case. So: the profile about 2 min,
# the long tail under 2 min, the GRPO steps 3-5 min; each part has its own limit and the whole
# stops at 470 s.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 150 python benchmarks/decode_profile.py --hardware h200 --preset tiny,qwen2.5-0.5b \
    --batches 256 || echo "decode_profile.py: exit $? (124: over its 150 s)"
# The sampler on a long tail (256 rows, mean 40 under 512): rows leaving against every row
# decoded to the longest (same tokens), against transformers' generate on the host's CPUs.
JAX_PLATFORMS=cuda timeout 120 python benchmarks/generate.py --workload early-exit --threads 1 \
    --repeats 2 --hardware h200 || echo "generate.py: exit $? (124: over its 120 s)"
timeout $((470 - SECONDS)) python benchmarks/device_check.py --hardware h200 --steps 2 "$@" \
    || echo "device_check.py: exit $? (124: over the 470 s of the whole check)"
