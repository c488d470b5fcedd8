"""Dustin's two scoring signals over history positions (docs/methods.md §3.1), from probe queries + cache keys.

* target historical ``s_T [B, S]``: the post-RoPE query of the **last committed token** at the
  target SRH layer (its SRH query heads) against every history key of that layer;
* draft lookahead ``s_D [B, S]``: the draft's queries of the gamma drafting steps at each draft
  SRH layer's SRH heads against the draft's history keys of that layer.

Each (head, query row) contributes a softmax over the **valid history keys** (positions
``< lengths``), and the signal is the sum over its heads, rows and layers (docs/methods.md §3.1: summed within
each signal; the two signals are never added -- selection is by rank). GQA: an SRH is a query
head and reads its KV group's keys (``head // queries_per_kv``). The scoring itself is
:func:`srh_scores` (each KV head read once per layer; ``pallas_kernels.selection.srh_scores_pallas``
is the same with the logits from a Pallas kernel).

For ``s_T`` the query of the last committed token sees exactly the history (its own key is the
last history key), so the softmax over the history is the softmax the target computed. The
draft rows also see the drafted tokens; ``s_D`` normalises over the history only.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.attention import key_scores
from pallas_kernels.selection import pack_srh_queries, srh_scores_pallas
from pallas_kernels.tpu_selection import tpu_srh_scores


class DraftSignals(NamedTuple):
    """What a Dustin draft policy hands the verify policy (``Proposal.signals``).

    ``queries [B, P, gamma, D]`` float32 post-RoPE queries of the draft SRH heads (in the order
    of ``DustinConfig.draft_probe_heads``) at the gamma drafting steps; ``keys``: per draft SRH
    layer (order of ``DustinConfig.draft_layers``) the draft's key cache ``[B, Hkv, S, D]``.
    """

    queries: jax.Array
    keys: Tuple[jax.Array, ...]


def srh_scores(queries: jax.Array, keys: jax.Array, lengths: jax.Array, kv_groups: Sequence[int],
               layout: str = "groups") -> jax.Array:
    """Attention mass of semantic-retrieval heads on each history position.

    ``queries [B, P, R, D]``: R query rows of P heads (already scaled by ``1/sqrt(D)``);
    ``keys [B, Hkv, S, D]``; ``kv_groups``: the KV head each of the P query heads reads (static).
    Returns ``[B, S]``: softmax over the valid positions of each (head, row), summed over heads
    and rows. Heads sharing a KV head are scored together, so each KV head is read once.
    ``layout`` (``DustinConfig.scoring_layout``): ``"groups"``, one product per used KV head on its
    slice of ``keys``; ``"heads"``, one product over all of ``keys`` with the rows packed per KV head
    (zero rows where no head reads; their scores are dropped) -- no slice of the cache to copy;
    ``"pallas"``, the logits from the Pallas scoring kernel, which reads each used KV head's keys in place
    (:func:`_srh_scores_kernel`).
    """
    batch, heads, rows, dim = queries.shape
    seq = keys.shape[2]
    valid = (jnp.arange(seq)[None, :] < lengths[:, None])[:, None, :]
    if layout == "heads":
        return _srh_scores_all_heads(queries, keys, valid, kv_groups)
    if layout == "pallas":
        block = _kernel_block(seq)
        if block:
            return _srh_scores_kernel(queries, keys, lengths, tuple(int(g) for g in kv_groups), block)
    elif layout != "groups":
        raise ValueError(f"srh_scores layout={layout!r}; valid: 'groups', 'heads', 'pallas'")
    total = jnp.zeros((batch, seq), jnp.float32)
    for group in sorted(set(kv_groups)):
        members = [i for i, g in enumerate(kv_groups) if g == group]
        q = queries[:, members].reshape(batch, len(members) * rows, dim)
        scores = key_scores(keys[:, group], q)
        scores = jnp.where(valid, scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        total = total + jnp.sum(jnp.where(valid, probs, 0.0), axis=1)
    return total


def _srh_scores_all_heads(queries, keys, valid, kv_groups) -> jax.Array:
    """:func:`srh_scores` with one product over every KV head: the probe rows packed ``[B, Hkv, Rg, D]`` per KV head
    (``pack_srh_queries``, as the Pallas scoring packs them), logits ``[B, Hkv, Rg, S]``, and the softmax summed over
    the real rows only."""
    packed, real = pack_srh_queries(queries, tuple(kv_groups), keys.shape[1])
    logits = jnp.where(valid[:, :, None, :], key_scores(keys, packed), -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    keep = jnp.asarray(np.asarray(real))[None, :, :, None] & valid[:, :, None, :]
    return jnp.sum(jnp.where(keep, probs, 0.0), axis=(1, 2))


def _kernel_block(seq: int) -> int:
    """The Pallas scoring's sequence block for a cache of ``seq`` slots: 128 on a TPU (its lanes; 0 where ``seq`` is
    not a multiple), elsewhere the largest power of two from 256 down to 16 that divides ``seq`` (256 positions with
    8 warps was the faster of the two tilings bench-attention timed for the 4-group scoring on the H200: 177 µs
    against 193 µs); 0 where none does (such a cache is scored by the ``"groups"`` products instead, with the same
    result)."""
    if jax.default_backend() == "tpu":
        return 128 if seq % 128 == 0 else 0
    return next((b for b in (256, 128, 64, 32, 16) if seq % b == 0), 0)


def _srh_scores_kernel(queries, keys, lengths, kv_groups, block) -> jax.Array:
    """:func:`srh_scores` with the logits from the platform's Pallas kernel (docs/methods.md §3.1, scoring layout):
    ``pallas_kernels.selection.srh_scores_pallas`` (Triton) on a GPU, ``pallas_kernels.tpu_selection.tpu_srh_scores``
    (Mosaic) on a TPU, the Triton kernel interpreted elsewhere (slow; for tests). Each program reads one block of one
    used KV head's keys from the cache itself, so no slice of the cache is copied and no unused head is read. The
    kernel multiplies in the cache's dtype: with a bf16 cache the probe queries are rounded to bf16 first."""
    lengths = lengths.astype(jnp.int32)
    backend = jax.default_backend()
    if backend == "tpu":
        return tpu_srh_scores(queries, keys, lengths, kv_groups, block_s=block)
    return srh_scores_pallas(queries, keys, lengths, kv_groups, block_s=block, num_warps=8 if block >= 256 else 4,
                             interpret=backend != "gpu")


def fit_width(scores: jax.Array, width: int) -> jax.Array:
    seq = scores.shape[1]
    if seq == width:
        return scores
    if seq > width:
        return scores[:, :width]
    return jnp.pad(scores, ((0, 0), (0, width - seq)))


def head_scores(queries: jax.Array, keys: jax.Array, lengths: jax.Array, heads: Sequence[int],
                queries_per_kv: int, layout: str = "groups") -> jax.Array:
    """``queries [B, P, R, D]`` (unscaled, post-RoPE) of query ``heads`` of one layer against that
    layer's ``keys [B, Hkv, S, D]``: softmax over the valid keys per (head, row), summed -> ``[B, S]``."""
    dim = queries.shape[-1]
    groups = tuple(int(h) // queries_per_kv for h in heads)
    scaled = queries.astype(jnp.float32) * jnp.float32(1.0 / np.sqrt(dim))
    return srh_scores(scaled, keys, lengths.astype(jnp.int32), groups, layout)


def target_signal(query: jax.Array, keys: jax.Array, lengths: jax.Array, heads: Sequence[int],
                  queries_per_kv: int, layout: str = "groups") -> jax.Array:
    """``s_T [B, S]``: ``query [B, P, D]`` of the last committed token at the target SRH layer's
    heads against its ``keys [B, Hkv, S, D]``, ``lengths [B]`` history positions."""
    return head_scores(query[:, :, None, :], keys, lengths, heads, queries_per_kv, layout)


def draft_signal(signals: DraftSignals, lengths: jax.Array, layer_heads: Sequence[Sequence[int]],
                 queries_per_kv: int, width: int, layout: str = "groups") -> jax.Array:
    """``s_D [B, width]``: the draft SRH queries against the draft history keys of their layers,
    summed over layers, heads and rows; ``width`` is the target cache's ``S`` (padded/cut)."""
    total = None
    start = 0
    for layer_keys, heads in zip(signals.keys, layer_heads):
        part = signals.queries[:, start:start + len(heads)]
        start += len(heads)
        scores = head_scores(part, layer_keys, lengths, heads, queries_per_kv, layout)
        total = scores if total is None else total + scores
    if total is None:
        raise ValueError("no draft SRH layers: the draft signal is empty")
    if start != signals.queries.shape[1]:
        raise ValueError(f"draft signals carry {signals.queries.shape[1]} query heads, the config names {start}")
    return fit_width(total, width)
