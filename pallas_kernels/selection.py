"""Pallas kernels of the sparse-verification selection: SRH scoring and the radix threshold.

The algorithms they accelerate are plain XLA code in :mod:`jaxspec.dustin.signals`
(:func:`~jaxspec.dustin.signals.srh_scores`, the reference of :func:`srh_scores_pallas`) and
:mod:`jaxspec.dustin.selection` (:func:`~jaxspec.dustin.selection.select_top_k`, whose
``histogram="pallas"`` variant calls :func:`radix_threshold_pallas`; the jnp
:func:`~jaxspec.dustin.selection.radix_threshold` is its reference).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# ---------------------------------------------------------------------------- Pallas SRH scoring
def _srh_logits_kernel(lengths_ref, q_ref, k_ref, o_ref, *, groups, rows, block_s, store_rows):
    h = pl.program_id(1)
    start = pl.program_id(2) * block_s  # read outside pl.when (interpret mode cannot inside)
    active = functools.reduce(jnp.logical_or, [h == g for g in groups])

    @pl.when(active)
    def _():
        length = lengths_ref[0]
        k = k_ref[...]  # [block_s, D]
        valid = start + jnp.arange(block_s) < length
        if rows == 1:  # one probe row: multiply-reduce, bytes-bound
            q = q_ref[0, :].astype(jnp.float32)
            o_ref[0, :] = jnp.where(valid, jnp.sum(k.astype(jnp.float32) * q[None, :], axis=1), NEG_INF)
        else:  # tensor cores; q_ref holds the rows padded to >= 16 (tl.dot's minimum); store_rows of them are stored
            logits = jnp.dot(q_ref[...], k.T, preferred_element_type=jnp.float32)  # [dot_rows, block_s]
            if store_rows < logits.shape[0]:  # keep the real rows (a power-of-two split: Triton's tt.split)
                logits = jnp.split(logits, logits.shape[0] // store_rows, axis=0)[0]
            o_ref[...] = jnp.where(valid[None, :], logits, NEG_INF)


NEG_INF = -1e30


def pack_srh_queries(queries: jax.Array, kv_groups: Sequence[int], num_kv_heads: int):
    """``queries [B, P, R, D]`` of P heads -> ``[B, Hkv, Rg, D]`` (rows of the heads of each KV
    group, zero-padded to a power of two ``Rg``) and the static real-row mask ``[Hkv, Rg]``."""
    batch, heads, rows, dim = queries.shape
    members = {g: [i for i, x in enumerate(kv_groups) if x == g] for g in sorted(set(kv_groups))}
    per_group = max(len(m) for m in members.values()) * rows
    padded = 1 << (per_group - 1).bit_length() if per_group > 1 else 1
    out = jnp.zeros((batch, num_kv_heads, padded, dim), queries.dtype)
    real = [[False] * padded for _ in range(num_kv_heads)]
    for g, idx in members.items():
        block = queries[:, idx].reshape(batch, len(idx) * rows, dim)
        out = out.at[:, g, :len(idx) * rows].set(block)
        for r in range(len(idx) * rows):
            real[g][r] = True
    return out, tuple(tuple(r) for r in real)


@functools.partial(jax.jit, static_argnames=("kv_groups", "block_s", "num_warps", "interpret", "store_padding"))
def srh_scores_pallas(queries: jax.Array, keys: jax.Array, lengths: jax.Array, kv_groups: Sequence[int], *,
                      block_s: int = 128, num_warps: int = 4, interpret: bool = False,
                      store_padding: bool = False) -> jax.Array:
    """``jaxspec.dustin.signals.srh_scores`` with the logits from a Pallas kernel that reads each used KV head's keys
    once (grid over batch, KV heads, sequence blocks; unused KV heads do nothing); the softmax
    over positions and the sum over heads and rows run in XLA on the small ``[B, Hkv, Rg, S]``
    logits. Same result as ``srh_scores``. With 2-15 probe rows per KV head the dot runs on rows
    zero-padded to 16; the kernel stores only the real rows, or (``store_padding``) all 16, which
    writes more but needs no in-kernel split."""
    batch, _, rows, dim = queries.shape
    kv_heads, seq = keys.shape[1], keys.shape[2]
    if seq % block_s:
        raise ValueError(f"cache capacity S={seq} must be a multiple of block_s={block_s}")
    kv_groups = tuple(int(g) for g in kv_groups)
    if any(not 0 <= g < kv_heads for g in kv_groups):
        raise ValueError(f"kv_groups={kv_groups}: every entry must be in [0, {kv_heads})")
    packed, real = pack_srh_queries(queries.astype(keys.dtype), kv_groups, kv_heads)
    group_rows = packed.shape[2]  # a power of two
    dot_rows = group_rows if group_rows == 1 else max(group_rows, 16)
    if dot_rows > group_rows:  # zero rows up to tl.dot's 16; the kernel stores only the first group_rows
        packed = jnp.pad(packed, ((0, 0), (0, 0), (0, dot_rows - group_rows), (0, 0)))
    used = tuple(sorted(set(kv_groups)))
    store_rows = dot_rows if store_padding else group_rows
    kernel = functools.partial(_srh_logits_kernel, groups=used, rows=group_rows, block_s=block_s,
                               store_rows=store_rows)
    compiler = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        compiler = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
    logits = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, seq // block_s),
        in_specs=[
            pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),
            pl.BlockSpec((None, None, dot_rows, dim), lambda b, h, s: (b, h, 0, 0)),
            pl.BlockSpec((None, None, block_s, dim), lambda b, h, s: (b, h, s, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, store_rows, block_s), lambda b, h, s: (b, h, 0, s)),
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, store_rows, seq), jnp.float32),
        compiler_params=compiler,
        interpret=interpret,
        name="jaxspec_srh_logits",
    )(lengths.astype(jnp.int32).reshape(batch, 1), packed, keys)
    valid = (jnp.arange(seq)[None, :] < lengths[:, None])
    total = jnp.zeros((batch, seq), jnp.float32)
    for g in used:
        real_rows = [r for r, ok in enumerate(real[g]) if ok]
        rows_logits = logits[:, g, :len(real_rows)]  # real rows come first
        probs = jax.nn.softmax(jnp.where(valid[:, None, :], rows_logits, -jnp.inf), axis=-1)
        total = total + jnp.sum(jnp.where(valid[:, None, :], probs, 0.0), axis=1)
    return total


# ---------------------------------------------------------------------------- Pallas radix threshold
def _radix_kernel(keys_ref, cand_ref, need_ref, thr_ref, left_ref, *, seq, block):
    bins = jnp.arange(16, dtype=jnp.int32)
    need = need_ref[0]
    prefix = jnp.int32(0)
    for shift in range(28, -1, -4):
        def body(i, hist, shift=shift, prefix=prefix):
            x = keys_ref[pl.ds(i * block, block)]  # int32 bit patterns of the uint32 keys
            alive = cand_ref[pl.ds(i * block, block)] != 0
            if shift < 28:  # same higher digits as the prefix chosen so far (equal sign extension)
                alive = alive & ((x >> (shift + 4)) == (prefix >> (shift + 4)))
            digit = (x >> shift) & 15
            hit = (digit[:, None] == bins[None, :]) & alive[:, None]
            return hist + jnp.sum(hit.astype(jnp.int32), axis=0)

        hist = jax.lax.fori_loop(0, seq // block, body, jnp.zeros((16,), jnp.int32))
        above = jnp.sum(jnp.where(bins[None, :] > bins[:, None], hist[None, :], 0), axis=1)  # larger digits
        found = (above < need) & (above + hist >= need)
        chosen = jnp.max(jnp.where(found, bins, -1))
        need = need - jnp.sum(jnp.where(bins == chosen, above, 0))
        prefix = prefix | (chosen << shift)
    thr_ref[...] = jnp.full((1,), prefix, jnp.int32)
    left_ref[...] = jnp.full((1,), need, jnp.int32)


def radix_threshold_pallas(keys: jax.Array, candidate: jax.Array, need: jax.Array, *, block: int = 256,
                           num_warps: int = 4, interpret: bool = False):
    """``jaxspec.dustin.selection.radix_threshold`` (8 passes of 4-bit digits) in ONE kernel launch: one program per
    row walks its keys in blocks of ``block``, eight times, keeping the 16-bin histogram in
    registers (no atomics, no per-pass launches). ``keys [B, S]`` uint32 with ``S`` a multiple
    of ``block``. Returns (threshold uint32 [B], keys equal to it to take [B])."""
    batch, seq = keys.shape
    if seq % block:
        pad = (-seq) % block  # padded positions are never candidates
        keys = jnp.pad(keys, ((0, 0), (0, pad)))
        candidate = jnp.pad(candidate, ((0, 0), (0, pad)))
        seq += pad
    compiler = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        compiler = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    kernel = functools.partial(_radix_kernel, seq=seq, block=block)
    threshold, left = pl.pallas_call(
        kernel,
        grid=(batch,),
        in_specs=[pl.BlockSpec((None, seq), lambda b: (b, 0)), pl.BlockSpec((None, seq), lambda b: (b, 0)),
                  pl.BlockSpec((None, 1), lambda b: (b, 0))],
        out_specs=[pl.BlockSpec((None, 1), lambda b: (b, 0)), pl.BlockSpec((None, 1), lambda b: (b, 0))],
        out_shape=(jax.ShapeDtypeStruct((batch, 1), jnp.int32), jax.ShapeDtypeStruct((batch, 1), jnp.int32)),
        compiler_params=compiler,
        interpret=interpret,
        name="jaxspec_radix_threshold",
    )(jax.lax.bitcast_convert_type(keys, jnp.int32), candidate.astype(jnp.int32),
      need.astype(jnp.int32).reshape(batch, 1))
    return jax.lax.bitcast_convert_type(threshold[:, 0], jnp.uint32), left[:, 0]
