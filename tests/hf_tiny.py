"""Tiny Hugging Face models for parity tests against transformers (CPU torch): their sizes,
weights at unit scale, and the two forwards compared."""

import numpy as np
import torch
from flax import nnx

# Sizes every tiny HF config shares (the architecture-specific keys come per case).
COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=56,
    num_hidden_layers=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of unit-scale activations (HF's std-0.02 init gives near-zero logits)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def hf_logits(model, tokens_bt) -> np.ndarray:
    """float32 [B, T, V] logits of a transformers model."""
    with torch.no_grad():
        return model(torch.as_tensor(tokens_bt, dtype=torch.long)).logits.float().numpy()


@nnx.jit
def forward(model, tokens_bt):
    """Our model's logits [B, T, V], jitted."""
    return model(tokens_bt)
