"""A character-level tokenizer for the synthetic tasks, and SFT batch encoding.

`CharTokenizer` has the interface of :class:`sagc_jax.models.tokenizer.Tokenizer` that the
trainer uses (``encode``, ``decode``, ``bos_id``, ``eos_id``, ``pad_id``, ``vocab_size``), so a
tiny model trained on a synthetic task needs no tokenizer files. Ids: 0 pad, 1 bos, 2 eos, then
one id per alphabet character in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["DEFAULT_ALPHABET", "CharTokenizer", "encode_sft_batch"]

#: Digits and the symbols of the running-sum task (``+`` between terms, ``=`` ends the prompt,
#: ``>`` separates running sums, ``#`` introduces the final answer), plus a few spare symbols.
DEFAULT_ALPHABET = "0123456789+-*=>#"
_SPECIALS = ("<pad>", "<bos>", "<eos>")


class CharTokenizer:
    """One token per character of a fixed alphabet, plus pad/bos/eos (ids 0, 1, 2)."""

    pad_id = 0
    bos_id = 1
    eos_id = 2

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if not alphabet or len(set(alphabet)) != len(alphabet):
            raise ValueError(
                f"CharTokenizer: alphabet = {alphabet!r} must be non-empty with distinct characters"
            )
        self.alphabet = alphabet
        self._ids = {ch: i + len(_SPECIALS) for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        """Number of ids (specials included); a model's vocab may be larger."""
        return len(_SPECIALS) + len(self.alphabet)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids, one per character; ``add_special_tokens`` prepends bos.

        Raises ValueError naming the first character outside the alphabet and its position.
        """
        try:
            ids = [self._ids[ch] for ch in text]
        except KeyError:
            pos = next(i for i, ch in enumerate(text) if ch not in self._ids)
            raise ValueError(
                f"CharTokenizer: character {text[pos]!r} at position {pos} of {text[:40]!r} is "
                f"not in the alphabet {self.alphabet!r}"
            ) from None
        return [self.bos_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text. Specials are dropped (or written as ``<pad>``/``<bos>``/``<eos>``).

        Decoding does not stop at eos: cut a completion at its first eos before decoding, as the
        sampler does. Raises ValueError for an id outside ``[0, vocab_size)``.
        """
        out = []
        n = len(_SPECIALS)
        for i in ids:
            i = int(i)
            if 0 <= i < n:
                if not skip_special_tokens:
                    out.append(_SPECIALS[i])
            elif n <= i < self.vocab_size:
                out.append(self.alphabet[i - n])
            else:
                raise ValueError(
                    f"CharTokenizer: id {i} is out of range; allowed: 0 <= id < {self.vocab_size}"
                )
        return "".join(out)


def encode_sft_batch(
    tokenizer, pairs: Sequence[tuple[str, str]], length: int
) -> tuple[np.ndarray, np.ndarray]:
    """Encode (prompt, completion) pairs for supervised warm-start.

    Each row is ``[bos] + prompt + completion + [eos]``, right-padded with ``pad_id`` to
    ``length`` tokens. Works with any tokenizer with ``encode``/``bos_id``/``eos_id``/``pad_id``.

    Returns:
      tokens_bt: int32 [B, length].
      loss_mask_bt: float32 [B, length]; 1.0 where the token belongs to the completion or is
        its eos, i.e. the positions whose token the model must predict from the prefix before it.
    Raises ValueError naming the row when an example does not fit in ``length``.
    """
    tokens_bt = np.full((len(pairs), length), tokenizer.pad_id, dtype=np.int32)
    loss_mask_bt = np.zeros((len(pairs), length), dtype=np.float32)
    for b, (prompt, completion) in enumerate(pairs):
        p = [tokenizer.bos_id, *tokenizer.encode(prompt)]
        c = [*tokenizer.encode(completion), tokenizer.eos_id]
        if len(p) + len(c) > length:
            raise ValueError(
                f"encode_sft_batch: row {b} has {len(p) + len(c)} tokens (bos, prompt, completion,"
                f" eos); allowed: at most length = {length}"
            )
        tokens_bt[b, : len(p) + len(c)] = p + c
        loss_mask_bt[b, len(p) : len(p) + len(c)] = 1.0
    return tokens_bt, loss_mask_bt
