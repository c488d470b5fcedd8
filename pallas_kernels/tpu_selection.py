"""Mosaic TPU Pallas kernel of the sparse-verification selection: SRH scoring logits (the TPU
twin of :func:`pallas_kernels.selection.srh_scores_pallas`; reference
:func:`jaxspec.dustin.signals.srh_scores`).

Grid ``(B, Hkv, S / block_s)``; the lengths are scalar-prefetched into SMEM. Each program reads
one ``[block_s, D]`` tile of one KV head's keys and writes the ``[Rg, block_s]`` logits of the
probe rows of that head's group (rows padded to >= 8 sublanes, ``block_s`` a multiple of 128
lanes); KV heads no probe head uses do no compute, and their key index map is pinned to block 0
so the pipeline fetches their keys once, not per block. Softmax over positions and the sum over
heads and rows run in XLA on the small logits.

The radix threshold of the top-k (:func:`pallas_kernels.selection.radix_threshold_pallas`) has
no TPU kernel: its 16-bin histogram passes are scalar-bound loops, which XLA's own sort / top-k
on a TPU already serve, so on a TPU the selection uses the jnp radix
(:func:`jaxspec.dustin.selection.radix_threshold`).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.selection import NEG_INF, pack_srh_queries
from pallas_kernels.tpu_attention import compiler_params, interpret_params


def _srh_logits_kernel(lengths_ref, q_ref, k_ref, o_ref, *, groups, block_s):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[b]
    start = s * block_s
    active = functools.reduce(jnp.logical_or, [h == g for g in groups])

    @pl.when(active)
    def _():
        logits = jax.lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)  # [Rg, block_s]
        positions = start + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
        o_ref[...] = jnp.where(positions < length, logits, NEG_INF)

    @pl.when(jnp.logical_not(active))
    def _():
        o_ref[...] = jnp.full(o_ref.shape, NEG_INF, jnp.float32)


@functools.partial(jax.jit, static_argnames=("kv_groups", "block_s", "interpret"))
def tpu_srh_scores(queries: jax.Array, keys: jax.Array, lengths: jax.Array, kv_groups: Sequence[int], *,
                   block_s: int = 128, interpret: bool = False) -> jax.Array:
    """``jaxspec.dustin.signals.srh_scores`` (``queries [B, P, R, D]`` of P probe heads, their KV
    heads ``kv_groups``, ``keys [B, Hkv, S, D]``) with the logits from the Mosaic kernel above.
    ``S`` must be a multiple of ``block_s`` (a multiple of 128). Returns ``[B, S]``."""
    batch, _, _, dim = queries.shape
    kv_heads, seq = keys.shape[1], keys.shape[2]
    if block_s % 128 or block_s <= 0:
        raise ValueError(f"block_s={block_s} must be a positive multiple of 128 (TPU lanes)")
    if seq % block_s:
        raise ValueError(f"cache capacity S={seq} must be a multiple of block_s={block_s}")
    kv_groups = tuple(int(g) for g in kv_groups)
    if any(not 0 <= g < kv_heads for g in kv_groups):
        raise ValueError(f"kv_groups={kv_groups}: every entry must be in [0, {kv_heads})")
    packed, real = pack_srh_queries(queries.astype(keys.dtype), kv_groups, kv_heads)
    if packed.shape[2] < 8:  # at least one full sublane tile of rows
        packed = jnp.pad(packed, ((0, 0), (0, 0), (0, 8 - packed.shape[2]), (0, 0)))
    group_rows = packed.shape[2]
    used = tuple(sorted(set(kv_groups)))

    def key_map(b, h, s, lengths_ref):  # unused KV heads: block 0 every step (fetched once)
        active = functools.reduce(jnp.logical_or, [h == g for g in used])
        return (b, h, jnp.where(active, s, 0), 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, kv_heads, seq // block_s),
        in_specs=[pl.BlockSpec((None, None, group_rows, dim), lambda b, h, s, lengths_ref: (b, h, 0, 0)),
                  pl.BlockSpec((None, None, block_s, dim), key_map)],
        out_specs=pl.BlockSpec((None, None, group_rows, block_s), lambda b, h, s, lengths_ref: (b, h, 0, s)),
    )
    options = (dict(interpret=interpret_params()) if interpret
               else dict(compiler_params=compiler_params(("parallel", "parallel", "parallel"))))
    logits = pl.pallas_call(
        functools.partial(_srh_logits_kernel, groups=used, block_s=block_s),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, group_rows, seq), jnp.float32),
        name="jaxspec_tpu_srh_logits",
        **options,
    )(lengths.astype(jnp.int32), packed, keys)
    valid = jnp.arange(seq)[None, :] < lengths[:, None]
    total = jnp.zeros((batch, seq), jnp.float32)
    for g in used:
        count = sum(real[g])  # real rows come first
        probs = jax.nn.softmax(jnp.where(valid[:, None, :], logits[:, g, :count], -jnp.inf), axis=-1)
        total = total + jnp.sum(jnp.where(valid[:, None, :], probs, 0.0), axis=1)
    return total
