#!/usr/bin/env bash
# The accelerator check of issue #12 (one short run, under 8 minutes on one H200): the tiny and
# the 0.5B preset, random bfloat16 weights, a few GRPO steps packed and padded, from the checkout.
#   bash benchmarks/device_check.sh [extra device_check.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=. timeout 470 python benchmarks/device_check.py "$@"
