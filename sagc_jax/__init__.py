import os as _os

__version__ = "0.1.0"

# XLA CPU's default scheduler (breadth-first, "concurrency optimized") places each layer's
# backward recomputation (model.remat) beside the layer's forward, where its inputs are ready:
# jax.checkpoint's optimization barriers are stripped before scheduling on CPU, so the recomputed
# activations live from the forward to the backward, as if nothing were rematerialised. The
# gradient of SmolLM2's decoder and chunked log-probs (32 rows x 168 tokens, remat full) held
# 0.36 GiB a layer (0.39 without remat); with the depth-first scheduler, 0.012 GiB, one layer's
# input (tests/models/test_decoder.py). It must be in XLA_FLAGS before jax starts its CPU backend
# (jax 0.10's compiler_options do not reach it); an explicit setting of the flag wins. Only
# XLA CPU reads it.
_SCHEDULER_FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"
if _SCHEDULER_FLAG not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = (
        _os.environ.get("XLA_FLAGS", "") + f" --{_SCHEDULER_FLAG}=false"
    ).strip()
