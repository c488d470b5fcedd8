"""StreamingLLM index sets: attention sinks + a recent window (docs/methods.md §3.6).

:func:`streaming_indices` is the one rule, shared by the StreamingLLM *verification* baseline
(:class:`StreamingVerify`, a verify policy of the engine) and the MagicDec *draft*
(:mod:`jaxspec.baselines.magicdec`, whose draft forwards read the same index set of their own
cache).

Rule, for a row whose history holds ``n`` valid positions ``0 .. n-1`` and a budget
``k = sinks + window``:

* ``n <= k``: every position ``0 .. n-1`` (dense), then ``-1`` padding;
* ``n > k``: the sinks ``0 .. sinks-1`` followed by the window ``n-window .. n-1``.

The result is ``[B, k]`` int32, sorted, never a duplicate and never a position ``>= n``.
Keys keep their original RoPE positions (no StreamingLLM position shift); the ``T`` new
tokens of a forward are always attended in addition, causally among themselves (the
contract of ``forward(..., verify_indices=...)``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.decoding.contract import VerifyPolicyBase


def check_sinks_window(sinks: int, window: int) -> None:
    if sinks < 0 or window < 0 or sinks + window < 1:
        raise ValueError(f"sinks={sinks}, window={window}: both must be >= 0 and the budget sinks + window >= 1")


def streaming_indices(lengths: jax.Array, *, sinks: int, window: int) -> jax.Array:
    """Sinks + window history positions ``[B, sinks + window]`` for rows of ``lengths [B]`` valid positions."""
    check_sinks_window(sinks, window)
    budget = sinks + window
    n = jnp.asarray(lengths, jnp.int32)[:, None]
    slot = jnp.arange(budget, dtype=jnp.int32)[None, :]
    dense = jnp.where(slot < n, slot, -1)
    sparse = jnp.where(slot < sinks, slot, n - window + (slot - sinks))
    return jnp.where(n <= budget, dense, sparse).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class StreamingVerify(VerifyPolicyBase):
    """StreamingLLM verification: every target layer and KV head attends to the first ``sinks``
    and the last ``window`` committed history positions (budget ``k = sinks + window``), plus the
    ``gamma + 1`` verified rows. Stateless: ``verify_state`` is unused (pass ``None``)."""

    sinks: int = 4
    window: int = 1020
    name: str = "streaming"

    def __post_init__(self):
        check_sinks_window(self.sinks, self.window)

    @property
    def budget(self) -> int:
        return self.sinks + self.window

    def verify_indices(self, state, target_cache, committed, signals):
        # the verified history is committed - 1 positions (the pending token is a new row); a
        # self-draft may have advanced target_cache.lengths past it, so never read the lengths
        return streaming_indices(committed - 1, sinks=self.sinks, window=self.window)
