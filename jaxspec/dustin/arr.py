"""ARR, the attention recall rate of an index set (docs/methods.md §3.3).

For one verification round of one sequence::

    ARR(I) = mean over target layers l, query heads h, query rows t (the gamma + 1 verified rows) of
             sum_{i in I} p[l, h, t, i] / sum_{i in history} p[l, h, t, i]

with ``p`` the exact softmax of the **full-KV** verification. The reported ARR is the mean over
rounds (and sequences). Since ARR is linear in the membership of ``I``, one round is summarised
by the **recall weights** ``w[i] = mean_{l,h,t} p[l,h,t,i] / sum_history p[l,h,t,:]`` (``[S]``,
summing to 1 over the history): ``ARR(I) = sum_{i in I} w[i]``. Profiling stores ``w`` once
per round and evaluates any number of candidate selections against it.

``history_probs`` come from a forward with ``probe_heads`` = every (layer, head) pair
(:func:`all_heads`); their normalisation (over history + new tokens) cancels in the ratio.
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.dustin.selection import indices_to_mask
from jaxspec.models.cache import KVCache
from jaxspec.models.llama import forward


def all_heads(config: ModelConfig) -> Tuple[Tuple[int, int], ...]:
    """Every (layer, query head) pair: probe them all for exact ARR."""
    return tuple((layer, head) for layer in range(config.num_layers) for head in range(config.num_heads))


def recall_weights(history_probs: jax.Array, lengths: jax.Array) -> jax.Array:
    """``history_probs [B, P, T, S]`` of a full-KV forward -> recall weights ``[B, S]``
    (each (head, row) renormalised over the valid history, then averaged)."""
    seq = history_probs.shape[-1]
    valid = (jnp.arange(seq)[None, :] < lengths[:, None])[:, None, None, :]
    probs = jnp.where(valid, history_probs.astype(jnp.float32), 0.0)
    mass = jnp.sum(probs, axis=-1, keepdims=True)
    return jnp.mean(probs / jnp.where(mass > 0, mass, 1.0), axis=(1, 2))


def recall_of_indices(weights: jax.Array, indices: jax.Array) -> jax.Array:
    """``ARR [B]`` of ``indices [B, K]`` (``-1`` and duplicates ignored) under ``weights [B, S]``."""
    mask = indices_to_mask(indices, weights.shape[1])
    return jnp.sum(jnp.where(mask, weights, 0.0), axis=1)


def _round_weights_fn(params, rows, cache, *, config):
    out = forward(params, rows, cache, config=config, probe_heads=all_heads(config))
    return recall_weights(out.probes.history_probs, cache.lengths), out


_round_weights = jax.jit(_round_weights_fn, static_argnames=("config",))


def round_recall_weights(params, config: ModelConfig, rows: jax.Array, cache: KVCache) -> jax.Array:
    """Recall weights ``[B, S]`` of one full-KV verification of ``rows [B, T]`` (``[pending, drafts]``)
    over the history ``cache`` (``cache.lengths`` = history length)."""
    return _round_weights(params, rows, cache, config=config)[0]


def round_arr(params, config: ModelConfig, rows: jax.Array, cache: KVCache, indices: jax.Array) -> jax.Array:
    """ARR ``[B]`` of ``indices [B, K]`` for one verification round (full-KV reference forward)."""
    return recall_of_indices(round_recall_weights(params, config, rows, cache), indices)
