"""Pallas kernels: dense (flash-decoding) and sparse (gathered) history attention.

Both return flash-decoding partials (see :mod:`pallas_kernels.reference`) so the history part
and the new-token part of a verification step merge exactly, outside the kernel.

Layout (the one the KV cache already has): ``k_cache, v_cache [B, Hkv, S, D]``. Queries are
packed per KV group: ``q [B, Hkv, M, D]`` with ``M = G * T`` rows (G query heads sharing the KV
head, T query rows) padded to a power of two >= 16, already scaled by ``1/sqrt(D)``.

* **Dense**: grid ``(B, Hkv, splits)``; each program walks its share of the sequence in blocks
  of ``block_k`` rows with an online softmax (``lax.fori_loop`` inside the program: grid
  programs run in parallel on GPU, so nothing accumulates across the grid), and stops at the
  row's length, so ragged rows skip the work past their end. Split partials merge outside.
* **Sparse**: grid ``(B, Hkv, K / (chunk * chunks_per_program))``; each program walks
  ``chunks_per_program`` chunks of ``chunk`` selected rows with an online softmax, gathering them
  straight from the cache (``k_ref[idx, :]``: per-row pointer offsets; no gathered copy of the
  cache is materialised), and returns one partial. Entries < 0 are masked; callers clean the index set
  first (:func:`pallas_kernels.reference.clean_indices`).

The K/V BlockSpecs cover a whole ``[S, D]`` slab (on Triton a block is only a base pointer);
every array a kernel touches has a power-of-two size. On CPU the kernels run with
``interpret=True``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.reference import NEG_INF, Partial, merge_partials


#: Streaming multiprocessors assumed where the device does not report its count (JAX exposes
#: ``core_count`` on GPU devices, not on CPU, where the kernels run interpreted): an H200's 132.
FALLBACK_CORE_COUNT = 132


def device_core_count(device=None) -> int:
    """Parallel cores of ``device`` (default: the first device of the default backend): the SM
    count on a GPU (``device.core_count``), :data:`FALLBACK_CORE_COUNT` where JAX does not report one."""
    device = device or jax.devices()[0]
    count = getattr(device, "core_count", None)  # a GPU device attribute; absent on CPU
    return int(count) if count else FALLBACK_CORE_COUNT


def _pow2_at_least(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _compiler_params(num_warps, num_stages, interpret):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ---------------------------------------------------------------------------- dense
def _dense_kernel(lengths_ref, q_ref, k_ref, v_ref, acc_ref, l_ref, m_ref, *, block_k, blocks_per_split,
                  total_blocks):
    split = pl.program_id(2)
    length = lengths_ref[0]
    q = q_ref[...]  # [M, D]
    rows = q.shape[0]
    first_block = split * blocks_per_split
    end_block = jnp.minimum(jnp.minimum(first_block + blocks_per_split, total_blocks), pl.cdiv(length, block_k))
    offsets = jnp.arange(block_k)

    def body(block, carry):
        acc, l_prev, m_prev = carry
        start = block * block_k
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [M, block_k]
        valid = (start + offsets < length)[None, :]
        scores = jnp.where(valid, scores, NEG_INF)
        m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.where(valid, jnp.exp(scores - m_next[:, None]), 0.0)
        l_next = l_prev * correction + jnp.sum(p, axis=1)
        acc = acc * correction[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc, l_next, m_next

    init = (jnp.zeros((rows, q.shape[1]), jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.full((rows,), NEG_INF, jnp.float32))
    acc, l, m = jax.lax.fori_loop(first_block, jnp.maximum(end_block, first_block), body, init)
    acc_ref[...] = acc
    l_ref[...] = l
    m_ref[...] = m


#: most packed query rows one program holds: a prefill chunk's rows (G heads x up to 2048 tokens)
#: in one block ask for more shared memory than a GPU has (2 MiB at head_dim 128); larger blocks
#: are split into calls of this many rows, each the kernel configuration decode uses
MAX_QUERY_ROWS = 64


@functools.partial(jax.jit, static_argnames=("block_k", "num_splits", "num_warps", "num_stages", "interpret",
                                             "max_rows"))
def dense_history_partials(q, k_cache, v_cache, lengths, *, block_k: int = 64, num_splits: int = 0,
                           num_warps: int = 4, num_stages: int = 2, interpret: bool = False,
                           max_rows: int = MAX_QUERY_ROWS) -> Partial:
    """Per-split partials ``acc [B, Hkv, splits, M, D], l/m [B, Hkv, splits, M]`` of ``q`` over
    cache positions ``< lengths[b]``. ``num_splits = 0`` picks enough splits to fill the chip
    (about four programs per core of :func:`device_core_count`). More than ``max_rows`` query rows
    (a prefill chunk) run as one call per ``max_rows`` rows, concatenated."""
    batch, kv_heads, rows, dim = q.shape
    seq = k_cache.shape[2]
    if rows & (rows - 1) or rows < 16:
        raise ValueError(f"packed query rows M={rows} must be a power of two >= 16 (pad with pack_queries)")
    if max_rows & (max_rows - 1) or max_rows < 16:
        raise ValueError(f"max_rows={max_rows} must be a power of two >= 16")
    if rows > max_rows:
        parts = [dense_history_partials(q[:, :, start:start + max_rows], k_cache, v_cache, lengths, block_k=block_k,
                                        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                                        interpret=interpret, max_rows=max_rows)
                 for start in range(0, rows, max_rows)]
        return tuple(jnp.concatenate([part[i] for part in parts], axis=3) for i in range(3))
    if seq % block_k:
        raise ValueError(f"cache capacity S={seq} must be a multiple of block_k={block_k} "
                         f"(init_cache rounds capacity up when the attention backend is pallas)")
    total_blocks = seq // block_k
    if num_splits <= 0:  # ~4 programs per SM (device_core_count), at least 4 blocks per split
        wanted = max(1, (4 * device_core_count()) // max(batch * kv_heads, 1))
        num_splits = max(1, min(wanted, total_blocks // 4 or 1))
    blocks_per_split = math.ceil(total_blocks / num_splits)
    num_splits = math.ceil(total_blocks / blocks_per_split)
    kernel = functools.partial(_dense_kernel, block_k=block_k, blocks_per_split=blocks_per_split,
                               total_blocks=total_blocks)
    out_shape = (jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows, dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), jnp.float32))
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),
            pl.BlockSpec((None, None, rows, dim), lambda b, h, s: (b, h, 0, 0)),
            pl.BlockSpec((None, None, seq, dim), lambda b, h, s: (b, h, 0, 0)),
            pl.BlockSpec((None, None, seq, dim), lambda b, h, s: (b, h, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=out_shape,
        compiler_params=_compiler_params(num_warps, num_stages, interpret),
        interpret=interpret,
        name="jaxspec_dense_history_attention",
    )(lengths.astype(jnp.int32).reshape(batch, 1), q, k_cache, v_cache)


# ---------------------------------------------------------------------------- sparse
def _sparse_kernel(idx_ref, q_ref, k_ref, v_ref, acc_ref, l_ref, m_ref, *, chunk, chunks_per_program):
    q = q_ref[...]
    rows = q.shape[0]

    def body(c, carry):
        acc, l_prev, m_prev = carry
        idx = idx_ref[pl.ds(c * chunk, chunk)]  # [chunk]
        valid = idx >= 0
        safe = jnp.where(valid, idx, 0)
        k = k_ref[safe, :]  # gathered rows [chunk, D]: per-row pointers, no copy of the cache
        v = v_ref[safe, :]
        scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [M, chunk]
        scores = jnp.where(valid[None, :], scores, NEG_INF)
        m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.where(valid[None, :], jnp.exp(scores - m_next[:, None]), 0.0)
        l_next = l_prev * correction + jnp.sum(p, axis=1)
        acc = acc * correction[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc, l_next, m_next

    init = (jnp.zeros((rows, q.shape[1]), jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.full((rows,), NEG_INF, jnp.float32))
    if chunks_per_program == 1:
        acc, l, m = body(0, init)
    else:
        acc, l, m = jax.lax.fori_loop(0, chunks_per_program, body, init)
    acc_ref[...] = acc
    l_ref[...] = l
    m_ref[...] = m


#: the sparse tiling the model uses: the most frequent winner of the H200 sweep
#: (experiments/results/bench_attention/*.json, ``tiling`` of ``ours_sparse``)
SPARSE_CHUNK = 32
SPARSE_CHUNKS_PER_PROGRAM = 4


def default_sparse_programs(batch: int, kv_heads: int, budget: int, chunk: int) -> int:
    """Chunks each program walks: :data:`SPARSE_CHUNKS_PER_PROGRAM`, or the largest power of two
    below it that divides ``budget / chunk``."""
    chunks = max(budget // chunk, 1)
    per_program = SPARSE_CHUNKS_PER_PROGRAM
    while per_program > 1 and chunks % per_program:
        per_program //= 2
    return per_program


@functools.partial(jax.jit, static_argnames=("chunk", "chunks_per_program", "num_warps", "num_stages",
                                             "interpret"))
def sparse_history_partials(q, k_cache, v_cache, indices, *, chunk: int = SPARSE_CHUNK, chunks_per_program: int = 0,
                            num_warps: int = 4, num_stages: int = 2, interpret: bool = False) -> Partial:
    """Per-program partials of ``q`` over the cache rows ``indices [B, K]`` (entries < 0 ignored;
    ``K`` a multiple of ``chunk``): ``acc [B, Hkv, P, M, D]``, ``l/m [B, Hkv, P, M]`` with
    ``P = K / (chunk * chunks_per_program)`` (``chunks_per_program = 0``: :func:`default_sparse_programs`)."""
    batch, kv_heads, rows, dim = q.shape
    seq = k_cache.shape[2]
    budget = indices.shape[1]
    if rows & (rows - 1) or rows < 16:
        raise ValueError(f"packed query rows M={rows} must be a power of two >= 16 (pad with pack_queries)")
    if chunk & (chunk - 1) or chunk < 16:
        raise ValueError(f"chunk={chunk} must be a power of two >= 16")
    if budget % chunk:
        raise ValueError(f"budget K={budget} must be a multiple of chunk={chunk}; pad the index set with -1")
    chunks = budget // chunk
    if chunks_per_program <= 0:
        chunks_per_program = default_sparse_programs(batch, kv_heads, budget, chunk)
    if chunks % chunks_per_program:
        raise ValueError(f"chunks_per_program={chunks_per_program} must divide K/chunk={chunks}")
    programs = chunks // chunks_per_program
    span = chunk * chunks_per_program
    kernel = functools.partial(_sparse_kernel, chunk=chunk, chunks_per_program=chunks_per_program)
    out_shape = (jax.ShapeDtypeStruct((batch, kv_heads, programs, rows, dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv_heads, programs, rows), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv_heads, programs, rows), jnp.float32))
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, programs),
        in_specs=[
            pl.BlockSpec((None, span), lambda b, h, c: (b, c)),
            pl.BlockSpec((None, None, rows, dim), lambda b, h, c: (b, h, 0, 0)),
            pl.BlockSpec((None, None, seq, dim), lambda b, h, c: (b, h, 0, 0)),
            pl.BlockSpec((None, None, seq, dim), lambda b, h, c: (b, h, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, dim), lambda b, h, c: (b, h, c, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, c: (b, h, c, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, c: (b, h, c, 0)),
        ],
        out_shape=out_shape,
        compiler_params=_compiler_params(num_warps, num_stages, interpret),
        interpret=interpret,
        name="jaxspec_sparse_history_attention",
    )(indices.astype(jnp.int32), q, k_cache, v_cache)


# ---------------------------------------------------------------------------- sparse + new tokens, one launch
def _sparse_fused_kernel(idx_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, o_ref, *, chunk, chunks, steps):
    q = q_ref[...]
    rows = q.shape[0]

    def update(carry, scores, valid, values):
        acc, l_prev, m_prev = carry
        scores = jnp.where(valid, scores, NEG_INF)
        m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.where(valid, jnp.exp(scores - m_next[:, None]), 0.0)
        acc = acc * correction[:, None] + jnp.dot(p.astype(values.dtype), values, preferred_element_type=jnp.float32)
        return acc, l_prev * correction + jnp.sum(p, axis=1), m_next

    def body(c, carry):
        idx = idx_ref[pl.ds(c * chunk, chunk)]
        valid = idx >= 0
        safe = jnp.where(valid, idx, 0)
        k = k_ref[safe, :]
        scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32)
        return update(carry, scores, valid[None, :], v_ref[safe, :])

    init = (jnp.zeros((rows, q.shape[1]), jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.full((rows,), NEG_INF, jnp.float32))
    carry = jax.lax.fori_loop(0, chunks, body, init)
    kn = kn_ref[...]  # [Tp, D]: the verification's own keys, causal among the rows
    scores = jnp.dot(q, kn.T, preferred_element_type=jnp.float32)  # [M, Tp]
    new_pos = jnp.arange(kn.shape[0])[None, :]
    row_step = (jnp.arange(rows) % steps)[:, None]
    acc, l, _ = update(carry, scores, (new_pos <= row_step) & (new_pos < steps), vn_ref[...])
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("steps", "chunk", "num_warps", "num_stages", "interpret"))
def sparse_attention_fused(q, k_cache, v_cache, indices, k_new, v_new, *, steps: int, chunk: int = SPARSE_CHUNK,
                           num_warps: int = 4, num_stages: int = 2, interpret: bool = False) -> jax.Array:
    """The whole sparse verification attention of one layer in ONE launch: ``q [B, Hkv, M, D]``
    (packed, rows ``g * steps + t``) over the cache rows ``indices [B, K]`` (< 0 ignored) and the
    ``steps`` new keys ``k_new, v_new [B, Hkv, steps, D]`` (causal among the rows). Returns the
    normalised output ``[B, Hkv, M, D]`` float32 -- no partials, no merge in XLA. Grid (B, Hkv):
    one program walks all K indices (fewer programs than :func:`sparse_history_partials`; which
    is faster is measured by ``experiments.kernel_explore``)."""
    batch, kv_heads, rows, dim = q.shape
    seq = k_cache.shape[2]
    budget = indices.shape[1]
    if rows & (rows - 1) or rows < 16:
        raise ValueError(f"packed query rows M={rows} must be a power of two >= 16 (pad with pack_queries)")
    if budget % chunk:
        raise ValueError(f"budget K={budget} must be a multiple of chunk={chunk}; pad the index set with -1")
    if k_new.shape[2] != steps:
        raise ValueError(f"k_new has {k_new.shape[2]} rows, expected steps={steps}")
    padded = _pow2_at_least(steps)
    pad = ((0, 0), (0, 0), (0, padded - steps), (0, 0))
    k_new, v_new = jnp.pad(k_new, pad), jnp.pad(v_new, pad)
    kernel = functools.partial(_sparse_fused_kernel, chunk=chunk, chunks=budget // chunk, steps=steps)
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads),
        in_specs=[
            pl.BlockSpec((None, budget), lambda b, h: (b, 0)),
            pl.BlockSpec((None, None, rows, dim), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((None, None, seq, dim), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((None, None, seq, dim), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((None, None, padded, dim), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((None, None, padded, dim), lambda b, h: (b, h, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, rows, dim), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, rows, dim), jnp.float32),
        compiler_params=_compiler_params(num_warps, num_stages, interpret),
        interpret=interpret,
        name="jaxspec_sparse_attention_fused",
    )(indices.astype(jnp.int32), q, k_cache, v_cache, k_new.astype(k_cache.dtype), v_new.astype(v_cache.dtype))


# ---------------------------------------------------------------------------- packing helpers
def pack_queries(q: jax.Array, num_kv_heads: int, scale: float) -> jax.Array:
    """``q [B, T, Hq, D]`` -> ``[B, Hkv, M, D]`` with rows ``g * T + t`` (G heads per KV group),
    scaled, zero-padded to a power of two ``M >= 16``."""
    batch, steps, heads, dim = q.shape
    groups = heads // num_kv_heads
    packed = (q.astype(jnp.float32) * scale).astype(q.dtype)
    packed = packed.reshape(batch, steps, num_kv_heads, groups, dim).transpose(0, 2, 3, 1, 4)
    packed = packed.reshape(batch, num_kv_heads, groups * steps, dim)
    rows = _pow2_at_least(groups * steps)
    return jnp.pad(packed, ((0, 0), (0, 0), (0, rows - groups * steps), (0, 0)))


def merged_history(partials: Partial, used_rows: int) -> Partial:
    """Merge stacked split/chunk partials (axis 2) and drop the padding rows."""
    acc, l, m = merge_partials(partials, axis=2)
    return acc[..., :used_rows, :], l[..., :used_rows], m[..., :used_rows]
