"""jnp references for every kernel, returning the same flash-decoding partials.

A *partial* is ``(acc, l, m)`` for a set of key positions: ``m [..., M]`` the running max of
the (scaled) scores, ``l [..., M]`` the sum of ``exp(score - m)`` and ``acc [..., M, D]`` the
sum of ``exp(score - m) * value``. Partials over disjoint position sets merge exactly
(:func:`merge_partials`); ``acc / l`` of the merged partial is the attention output. Empty
sets have ``m = NEG_INF`` (a finite very negative number, so no ``inf - inf``), ``l = 0``,
``acc = 0``.

Shapes: queries ``q [B, Hkv, M, D]`` (the query heads of one KV group times the query rows,
packed into M rows, already multiplied by the softmax scale), caches ``[B, Hkv, S, D]``.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import jax
import jax.numpy as jnp

NEG_INF = -1e30
Partial = Tuple[jax.Array, jax.Array, jax.Array]


def partial_from_scores(scores: jax.Array, valid: jax.Array, values: jax.Array) -> Partial:
    """``scores [..., M, N]`` (float32), ``valid`` broadcastable to it, ``values [..., N, D]``."""
    scores = jnp.where(valid, scores, NEG_INF)
    m = jnp.max(scores, axis=-1)
    p = jnp.where(valid, jnp.exp(scores - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    acc = jnp.einsum("...mn,...nd->...md", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return acc, l, m


def merge_partials(partials: Sequence[Partial], axis=None) -> Partial:
    """Merge partials over disjoint position sets (a list, or stacked along ``axis``)."""
    if axis is not None:
        acc, l, m = partials
        m_all = jnp.max(m, axis=axis)
        scale = jnp.exp(m - jnp.expand_dims(m_all, axis))
        return (jnp.sum(acc * scale[..., None], axis=axis), jnp.sum(l * scale, axis=axis), m_all)
    m_all = partials[0][2]
    for _, _, m in partials[1:]:
        m_all = jnp.maximum(m_all, m)
    acc_all = 0.0
    l_all = 0.0
    for acc, l, m in partials:
        scale = jnp.exp(m - m_all)
        acc_all = acc_all + acc * scale[..., None]
        l_all = l_all + l * scale
    return acc_all, l_all, m_all


def normalize(partial: Partial, dtype=jnp.float32) -> jax.Array:
    acc, l, _ = partial
    return (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(dtype)


def dense_history_reference(q, k_cache, v_cache, lengths) -> Partial:
    """Attention of ``q [B, Hkv, M, D]`` over cache positions ``< lengths[b]``."""
    scores = jnp.einsum("bhmd,bhsd->bhms", q, k_cache, preferred_element_type=jnp.float32)
    valid = (jnp.arange(k_cache.shape[2])[None, :] < lengths[:, None])[:, None, None, :]
    return partial_from_scores(scores, valid, v_cache)


def sparse_history_reference(q, k_cache, v_cache, indices) -> Partial:
    """Attention over the cache rows ``indices [B, K]`` (entries < 0 are ignored; callers mark
    out-of-range and duplicate entries with -1, see :func:`clean_indices`)."""
    valid = indices >= 0
    safe = jnp.where(valid, indices, 0)[:, None, :, None]
    keys = jnp.take_along_axis(k_cache, safe, axis=2)
    values = jnp.take_along_axis(v_cache, safe, axis=2)
    scores = jnp.einsum("bhmd,bhkd->bhmk", q, keys, preferred_element_type=jnp.float32)
    return partial_from_scores(scores, valid[:, None, None, :], values)


def clean_indices(indices: jax.Array, lengths: jax.Array) -> jax.Array:
    """Mark padding (< 0), out-of-range (>= lengths) and repeated entries with -1 (``[B, K]``)."""
    idx = indices.astype(jnp.int32)
    order = jnp.argsort(idx, axis=-1, stable=True)
    sorted_idx = jnp.take_along_axis(idx, order, axis=-1)
    dup_sorted = jnp.concatenate([jnp.zeros_like(sorted_idx[:, :1], bool),
                                  sorted_idx[:, 1:] == sorted_idx[:, :-1]], axis=-1)
    dup = jnp.take_along_axis(dup_sorted, jnp.argsort(order, axis=-1), axis=-1)
    valid = (idx >= 0) & (idx < lengths[:, None]) & ~dup
    return jnp.where(valid, idx, -1)
