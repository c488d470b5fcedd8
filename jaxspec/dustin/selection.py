"""Selection of ``I_verify`` (SPEC 3.2): sinks + window, top-m by ``s_D``, the rest by ``s_T``.

One set of ``k`` history positions per sequence, shared by every layer and KV head:

1. the first ``s`` positions (sinks) and the last ``w`` history positions (window);
2. the top ``m`` positions by the draft signal ``s_D`` among the rest;
3. the top ``k - s - w - m`` by the target signal ``s_T`` among what is still left.

The signals are only ranked, never added. Ties are broken by the lower position (the exact
top-k of :func:`pallas_kernels.selection.select_top_k`). Padding (positions ``>= length``) is
never chosen; a row whose history has at most ``k`` positions gets all of them (dense). The
output ``[B, k]`` int32 is sorted by position with ``-1`` after the chosen positions (only when
the history is shorter than ``k``); the forward ignores ``-1`` entries.

Built on two radix selections: (i) ``select_top_k(s_D, k=s+w+m)`` gives the protected set plus
the top-m by ``s_D``; (ii) ``select_top_k`` of ``s_T`` with those m positions lifted to ``+inf``
keeps them and fills the remaining budget by ``s_T``.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jaxspec.dustin.config import DustinConfig
from pallas_kernels.selection import select_top_k


def _pad_width(scores: jax.Array, width: int) -> jax.Array:
    seq = scores.shape[1]
    return scores if seq >= width else jnp.pad(scores, ((0, 0), (0, width - seq)))


def indices_to_mask(indices: jax.Array, width: int) -> jax.Array:
    """``[B, K]`` positions (``-1`` = none) -> ``[B, width]`` bool membership."""
    safe = jnp.where((indices >= 0) & (indices < width), indices, width)  # negatives would wrap: drop them
    mask = jnp.zeros((indices.shape[0], width), bool)
    return mask.at[jnp.arange(indices.shape[0])[:, None], safe].set(True, mode="drop")


@functools.partial(jax.jit, static_argnames=("k", "sinks", "window", "m"))
def select_verify_indices(s_draft: Optional[jax.Array], s_target: Optional[jax.Array], lengths: jax.Array, *,
                          k: int, sinks: int, window: int, m: int) -> jax.Array:
    """``I_verify [B, k]`` from ``s_draft``/``s_target [B, S]`` (either may be ``None`` when its share
    of the budget is zero) and ``lengths [B]`` (valid history positions per row)."""
    free = k - sinks - window
    if free < 0:
        raise ValueError(f"sinks={sinks} + window={window} exceed the budget k={k}")
    if not 0 <= m <= free:
        raise ValueError(f"m={m} must lie in 0..k - s - w = {free}")
    if m > 0 and s_draft is None:
        raise ValueError(f"m={m} > 0 needs the draft signal")
    if m < free and s_target is None:
        raise ValueError(f"m={m} < k - s - w = {free} needs the target signal")
    lengths = lengths.astype(jnp.int32)
    some = s_draft if s_draft is not None else s_target
    width = max(k, some.shape[1])  # a budget larger than the cache: pad (padding is never chosen)
    if m == 0:
        return select_top_k(_pad_width(s_target.astype(jnp.float32), width), lengths, k=k, sinks=sinks, window=window)
    s_draft = _pad_width(s_draft.astype(jnp.float32), width)
    if m == free:
        return select_top_k(s_draft, lengths, k=k, sinks=sinks, window=window)
    first = select_top_k(s_draft, lengths, k=sinks + window + m, sinks=sinks, window=window)
    chosen = indices_to_mask(first, width)
    lifted = jnp.where(chosen, jnp.inf, _pad_width(s_target.astype(jnp.float32), width))
    return select_top_k(lifted, lengths, k=k, sinks=sinks, window=window)


def select_for_config(config: DustinConfig, s_draft, s_target, lengths) -> jax.Array:
    """:func:`select_verify_indices` with the budget, sinks, window and m of ``config`` (its mode)."""
    m = config.effective_m
    return select_verify_indices(s_draft if m > 0 else None, s_target if m < config.free_budget else None, lengths,
                                 k=config.budget, sinks=config.sinks, window=config.window_size, m=m)
