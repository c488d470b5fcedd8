"""Selection of the sparse-verification index set: SRH scoring and an exact, sort-free top-k.

``lax.top_k`` over 32k positions for 64 rows took ~0.4 ms on the H200 — more than the sparse
attention it feeds. Here the top-r is found by **radix select** on order-preserving 32-bit keys:
four passes, each a 256-bin histogram (scatter-add) of one byte among the surviving candidates,
find the exact r-th largest key; the selection is then ``key > threshold`` plus the first
``need`` positions with ``key == threshold`` (ties broken deterministically by lower position),
compacted with a cumulative sum. Every step is O(S) and elementwise or a scatter: no sort. The
output is sorted by position, which also makes the gather kernel's reads more local.

Protected positions (attention sinks ``[0, sinks)`` and the window ``[length - window,
length)``) are always kept and take part of the budget; padding (positions ``>= length``) is
never selected; when a row has ``length <= k`` every valid position is selected (dense).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp


def order_preserving_keys(scores: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (larger float, larger key; -0.0 and +0.0 tie)."""
    scores = scores.astype(jnp.float32)
    scores = jnp.where(scores == 0, jnp.float32(0), scores)  # -0.0 -> +0.0
    bits = jax.lax.bitcast_convert_type(scores, jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _radix_threshold(keys: jax.Array, candidate: jax.Array, need: jax.Array):
    """Exact ``need``-th largest key among ``candidate`` positions of each row.

    ``keys [B, S]`` uint32, ``candidate [B, S]`` bool, ``need [B]`` int32 (>= 1, <= #candidates).
    Returns (threshold [B] uint32, how many keys equal to the threshold to take [B]).
    """
    batch = keys.shape[0]
    prefix = jnp.zeros((batch,), jnp.uint32)
    rows = jnp.arange(batch)[:, None]
    for shift in (24, 16, 8, 0):
        if shift == 24:
            alive = candidate
        else:
            alive = candidate & ((keys >> (shift + 8)) == (prefix[:, None] >> (shift + 8)))
        digit = ((keys >> shift) & 0xFF).astype(jnp.int32)
        histogram = jnp.zeros((batch, 256), jnp.int32).at[rows, digit].add(alive.astype(jnp.int32))
        above = jnp.cumsum(histogram[:, ::-1], axis=1)[:, ::-1] - histogram  # count with a larger digit
        # the digit d with above[d] < need <= above[d] + hist[d]
        hit = (above < need[:, None]) & (above + histogram >= need[:, None])
        chosen = jnp.argmax(hit, axis=1).astype(jnp.uint32)
        need = need - jnp.take_along_axis(above, chosen[:, None].astype(jnp.int32), axis=1)[:, 0]
        prefix = prefix | (chosen << shift)
    return prefix, need


def _compact(chosen: jax.Array, k: int) -> jax.Array:
    """Positions where ``chosen [B, S]`` is True, in increasing order, padded with -1 to ``[B, k]``."""
    batch, seq = chosen.shape
    slot = jnp.cumsum(chosen.astype(jnp.int32), axis=1) - 1
    slot = jnp.where(chosen, slot, k)  # unchosen -> dropped
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    out = jnp.full((batch, k), -1, jnp.int32)
    return out.at[jnp.arange(batch)[:, None], slot].set(positions, mode="drop")


@functools.partial(jax.jit, static_argnames=("k", "sinks", "window"))
def select_top_k(scores: jax.Array, lengths: jax.Array, *, k: int, sinks: int = 0, window: int = 0) -> jax.Array:
    """Index set ``[B, k]`` (sorted; -1 padding): sinks + window + the top scores among the rest.

    Exact: equals a top-k by (score descending, position ascending) over the non-protected
    valid positions. ``scores [B, S]`` float32, ``lengths [B]`` valid history per row.
    """
    batch, seq = scores.shape
    if sinks + window > k:
        raise ValueError(f"sinks={sinks} + window={window} exceed the budget k={k}")
    if k > seq:
        raise ValueError(f"budget k={k} larger than the cache capacity S={seq}")
    positions = jnp.arange(seq, dtype=jnp.int32)[None, :]
    lengths = lengths.astype(jnp.int32)[:, None]
    valid = positions < lengths
    protected = valid & ((positions < sinks) | (positions >= lengths - window))
    candidate = valid & ~protected
    remaining = k - jnp.sum(protected, axis=1)
    available = jnp.sum(candidate, axis=1)
    need = jnp.clip(jnp.minimum(remaining, available), 1, None)  # >= 1 keeps the search defined
    keys = order_preserving_keys(scores)
    threshold, equal_needed = _radix_threshold(keys, candidate, need)
    greater = candidate & (keys > threshold[:, None])
    equal = candidate & (keys == threshold[:, None])
    equal_rank = jnp.cumsum(equal.astype(jnp.int32), axis=1)
    take = greater | (equal & (equal_rank <= equal_needed[:, None]))
    take = take & (jnp.minimum(remaining, available) > 0)[:, None]
    return _compact(protected | take, k)


def srh_scores(queries: jax.Array, keys: jax.Array, lengths: jax.Array, kv_groups: Sequence[int]) -> jax.Array:
    """Attention mass of semantic-retrieval heads on each history position.

    ``queries [B, P, R, D]``: R query rows of P heads (already scaled by ``1/sqrt(D)``);
    ``keys [B, Hkv, S, D]``; ``kv_groups``: the KV head each of the P query heads reads (static).
    Returns ``[B, S]``: softmax over the valid positions of each (head, row), summed over heads
    and rows. Heads sharing a KV head are scored together, so each KV head is read once.
    """
    batch, heads, rows, dim = queries.shape
    seq = keys.shape[2]
    valid = (jnp.arange(seq)[None, :] < lengths[:, None])[:, None, :]
    total = jnp.zeros((batch, seq), jnp.float32)
    for group in sorted(set(kv_groups)):
        members = [i for i, g in enumerate(kv_groups) if g == group]
        q = queries[:, members].reshape(batch, len(members) * rows, dim)
        scores = jnp.einsum("bqd,bsd->bqs", q, keys[:, group], preferred_element_type=jnp.float32)
        scores = jnp.where(valid, scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        total = total + jnp.sum(jnp.where(valid, probs, 0.0), axis=1)
    return total
