"""Mosaic TPU Pallas kernels: dense and sparse history attention (the TPU twins of
:mod:`pallas_kernels.attention`, same inputs, same flash-decoding partials).

Layout as on the GPU: ``k_cache, v_cache [B, Hkv, S, D]`` in HBM, packed queries
``q [B, Hkv, M, D]`` (``M = G * T`` rows padded to a power of two >= 16, pre-scaled by
``1/sqrt(D)``, :func:`pallas_kernels.attention.pack_queries`). Both return ``(acc, l, m)`` with a
partial axis 2, merged outside (:func:`pallas_kernels.attention.merged_history`).

* **Dense** (:func:`tpu_dense_history_partials`): grid ``(B, Hkv, splits, blocks_per_split)``,
  the last axis sequential ("arbitrary") with the online-softmax state in VMEM scratch. The
  per-row lengths are *scalar-prefetched* into SMEM, so the K/V ``index_map`` clamps the block
  index to the row's last valid block: past a row's end the pipeline sees the same block index
  again and issues no DMA, and the body is skipped (``pl.when``). One partial per split.
* **Sparse** (:func:`tpu_sparse_history_partials`): the index set ``[B, K]`` is
  scalar-prefetched; K/V stay in HBM (``memory_space=ANY``) and each program copies its selected
  rows into a double-buffered VMEM tile ``[2, chunk, D]`` with one async DMA per row
  (``pltpu.make_async_copy``, a DMA semaphore per buffer), starting chunk ``c + 1`` before
  computing chunk ``c``. No gathered copy of K/V is written to HBM. Entries < 0 copy row 0 and
  are masked; callers clean the set first (:func:`pallas_kernels.reference.clean_indices`).

``interpret=True`` runs the kernels in JAX's TPU interpret mode (``pltpu.InterpretParams``:
memory spaces, DMAs, semaphores and scalar prefetch simulated on the CPU) -- the tests' mode.
The l/m state is kept lane-replicated ``[M, 128]`` (the TPU vector layout) and returned as
``[..., M]``. See docs/kernels.md ("TPU kernels").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.reference import NEG_INF, Partial

#: TPU vector lane count: the l/m state is replicated over this many lanes
LANES = 128


def interpret_params():
    """The TPU interpret-mode parameter object of the installed JAX (``InterpretParams``; older
    releases call it ``TPUInterpretParams``)."""
    cls = getattr(pltpu, "InterpretParams", None) or getattr(pltpu, "TPUInterpretParams", None)
    if cls is None:
        raise RuntimeError(f"jax {jax.__version__} has no Pallas TPU interpret mode "
                           "(jax.experimental.pallas.tpu.InterpretParams)")
    return cls()


def compiler_params(semantics):
    """Mosaic compiler parameters with ``dimension_semantics`` (``CompilerParams``; older releases
    ``TPUCompilerParams``)."""
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    return cls(dimension_semantics=semantics)


def _any_space():
    """The 'leave it in HBM' memory space (``pl.ANY``; ``pltpu.ANY`` / ``TPUMemorySpace.ANY`` before)."""
    for owner, name in ((pl, "ANY"), (pltpu, "ANY")):
        if hasattr(owner, name):
            return getattr(owner, name)
    return pltpu.TPUMemorySpace.ANY


def _call_options(interpret, semantics):
    if interpret:
        return dict(interpret=interpret_params())
    return dict(compiler_params=compiler_params(semantics))


def _check_rows(rows):
    if rows & (rows - 1) or rows < 16:
        raise ValueError(f"packed query rows M={rows} must be a power of two >= 16 (pad with pack_queries)")


def _online_update(q, k, v, valid, acc_ref, l_ref, m_ref):
    """One online-softmax step of the VMEM state over a tile of keys ``k, v [N, D]``
    (``valid [1 or M, N]``); l/m are lane-replicated ``[M, LANES]``."""
    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [M, N]
    scores = jnp.where(valid, scores, NEG_INF)
    m_prev = m_ref[...]  # [M, LANES], all lanes equal
    l_prev = l_ref[...]
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.where(valid, jnp.exp(scores - m_next[:, :1]), 0.0)
    l_ref[...] = l_prev * correction + jnp.sum(p, axis=1, keepdims=True)
    m_ref[...] = m_next
    acc_ref[...] = acc_ref[...] * correction[:, :1] + jnp.dot(p.astype(v.dtype), v,
                                                               preferred_element_type=jnp.float32)


def _init_state(acc_ref, l_ref, m_ref):
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)


# ---------------------------------------------------------------------------- dense
def _dense_kernel(lengths_ref, q_ref, k_ref, v_ref, acc_out, l_out, m_out, acc_ref, l_ref, m_ref, *, block_k,
                  blocks_per_split):
    b, split, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    length = lengths_ref[b]
    start = (split * blocks_per_split + j) * block_k

    @pl.when(j == 0)
    def _():
        _init_state(acc_ref, l_ref, m_ref)

    @pl.when(start < length)  # ragged rows: nothing past the row's end (and no DMA, see index_map)
    def _():
        positions = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        _online_update(q_ref[...], k_ref[...], v_ref[...], positions < length, acc_ref, l_ref, m_ref)

    @pl.when(j == blocks_per_split - 1)
    def _():
        acc_out[...] = acc_ref[...]
        l_out[...] = l_ref[...]
        m_out[...] = m_ref[...]


#: most packed query rows one program holds in VMEM; a prefill chunk's rows run as calls of this many
TPU_MAX_QUERY_ROWS = 256


@functools.partial(jax.jit, static_argnames=("block_k", "num_splits", "interpret", "max_rows"))
def tpu_dense_history_partials(q, k_cache, v_cache, lengths, *, block_k: int = 128, num_splits: int = 2,
                               interpret: bool = False, max_rows: int = TPU_MAX_QUERY_ROWS) -> Partial:
    """Per-split partials ``acc [B, Hkv, splits, M, D], l/m [B, Hkv, splits, M]`` of ``q`` over
    cache positions ``< lengths[b]`` (the contract of
    :func:`pallas_kernels.attention.dense_history_partials`). ``num_splits`` partitions the
    sequence blocks between parallel grid programs (a v4/v5p/v7x chip has 2 TensorCores; ``1`` on
    v5e/v6e is enough); ``S`` must be a multiple of ``block_k`` (a multiple of 8). More than
    ``max_rows`` query rows (a prefill chunk) run as one call per ``max_rows`` rows, concatenated
    (the q tile, the f32 accumulator and the lane-replicated l/m of one program live in VMEM)."""
    batch, kv_heads, rows, dim = q.shape
    seq = k_cache.shape[2]
    _check_rows(rows)
    if max_rows & (max_rows - 1) or max_rows < 16:
        raise ValueError(f"max_rows={max_rows} must be a power of two >= 16")
    if rows > max_rows:
        parts = [tpu_dense_history_partials(q[:, :, start:start + max_rows], k_cache, v_cache, lengths,
                                            block_k=block_k, num_splits=num_splits, interpret=interpret,
                                            max_rows=max_rows) for start in range(0, rows, max_rows)]
        return tuple(jnp.concatenate([part[i] for part in parts], axis=3) for i in range(3))
    if block_k % 8 or block_k <= 0:
        raise ValueError(f"block_k={block_k} must be a positive multiple of 8 (TPU sublanes)")
    if seq % block_k:
        raise ValueError(f"cache capacity S={seq} must be a multiple of block_k={block_k} "
                         f"(init_cache rounds capacity up to the backend's capacity_multiple)")
    if num_splits <= 0:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    total_blocks = seq // block_k
    num_splits = min(num_splits, total_blocks)
    blocks_per_split = -(-total_blocks // num_splits)
    num_splits = -(-total_blocks // blocks_per_split)

    def kv_map(b, h, s, j, lengths_ref):  # clamp to the row's last valid block: repeats fetch nothing
        last = jnp.maximum(pl.cdiv(lengths_ref[b], block_k) - 1, 0)
        return (b, h, jnp.minimum(jnp.minimum(s * blocks_per_split + j, last), total_blocks - 1), 0)

    kernel = functools.partial(_dense_kernel, block_k=block_k, blocks_per_split=blocks_per_split)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, kv_heads, num_splits, blocks_per_split),
        in_specs=[
            pl.BlockSpec((None, None, rows, dim), lambda b, h, s, j, lengths_ref: (b, h, 0, 0)),
            pl.BlockSpec((None, None, block_k, dim), kv_map),
            pl.BlockSpec((None, None, block_k, dim), kv_map),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, dim), lambda b, h, s, j, lengths_ref: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows, LANES), lambda b, h, s, j, lengths_ref: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows, LANES), lambda b, h, s, j, lengths_ref: (b, h, s, 0, 0)),
        ],
        scratch_shapes=[pltpu.VMEM((rows, dim), jnp.float32), pltpu.VMEM((rows, LANES), jnp.float32),
                        pltpu.VMEM((rows, LANES), jnp.float32)],
    )
    out_shape = (jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows, dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows, LANES), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows, LANES), jnp.float32))
    acc, l, m = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        name="jaxspec_tpu_dense_history_attention",
        **_call_options(interpret, ("parallel", "parallel", "parallel", "arbitrary")),
    )(lengths.astype(jnp.int32), q, k_cache, v_cache)
    return acc, l[..., 0], m[..., 0]


# ---------------------------------------------------------------------------- sparse
def _sparse_kernel(idx_ref, q_ref, k_hbm, v_hbm, acc_out, l_out, m_out, k_buf, v_buf, sems, acc_ref, l_ref, m_ref,
                   *, chunk, chunks_per_program):
    b, h, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    base = p * chunks_per_program * chunk

    def row_copies(c, slot):
        """The 2 * chunk row DMAs of chunk ``c`` into buffer ``slot`` (K rows signal sems[0, slot],
        V rows sems[1, slot])."""
        copies = []
        for r in range(chunk):  # static unroll: chunk is small (the descriptors are scalar work)
            row = jnp.maximum(idx_ref[b, base + c * chunk + r], 0)  # < 0: row 0, masked below
            copies.append(pltpu.make_async_copy(k_hbm.at[b, h, pl.ds(row, 1), :], k_buf.at[slot, pl.ds(r, 1), :],
                                                sems.at[0, slot]))
            copies.append(pltpu.make_async_copy(v_hbm.at[b, h, pl.ds(row, 1), :], v_buf.at[slot, pl.ds(r, 1), :],
                                                sems.at[1, slot]))
        return copies

    def start(c, slot):
        for copy in row_copies(c, slot):
            copy.start()

    def wait(c, slot):
        for copy in row_copies(c, slot):
            copy.wait()

    _init_state(acc_ref, l_ref, m_ref)
    start(0, 0)

    def body(c, carry):
        slot = c % 2

        @pl.when(c + 1 < chunks_per_program)  # prefetch the next chunk into the other buffer
        def _():
            start(c + 1, 1 - slot)

        wait(c, slot)
        valid = _valid_row(idx_ref, b, base + c * chunk, chunk)
        _online_update(q_ref[...], k_buf[slot], v_buf[slot], valid, acc_ref, l_ref, m_ref)
        return carry

    jax.lax.fori_loop(0, chunks_per_program, body, 0)
    acc_out[...] = acc_ref[...]
    l_out[...] = l_ref[...]
    m_out[...] = m_ref[...]


def _valid_row(idx_ref, b, first, chunk):
    """``[1, chunk]`` mask of the entries ``idx[b, first : first + chunk] >= 0`` built from SMEM
    scalars (a vector load from SMEM is not a TPU operation)."""
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
    valid = jnp.zeros((1, chunk), jnp.bool_)
    for r in range(chunk):
        valid = jnp.where(lane == r, idx_ref[b, first + r] >= 0, valid)
    return valid


#: selected rows per DMA batch (one VMEM buffer holds ``chunk`` K rows and ``chunk`` V rows)
TPU_SPARSE_CHUNK = 32


@functools.partial(jax.jit, static_argnames=("chunk", "chunks_per_program", "interpret"))
def tpu_sparse_history_partials(q, k_cache, v_cache, indices, *, chunk: int = TPU_SPARSE_CHUNK,
                                chunks_per_program: int = 0, interpret: bool = False) -> Partial:
    """Per-program partials of ``q`` over the cache rows ``indices [B, K]`` (entries < 0 ignored,
    ``K`` a multiple of ``chunk``), the contract of
    :func:`pallas_kernels.attention.sparse_history_partials`: ``acc [B, Hkv, P, M, D]``,
    ``l/m [B, Hkv, P, M]`` with ``P = K / (chunk * chunks_per_program)``
    (``chunks_per_program = 0``: all chunks in one program, ``P = 1``)."""
    batch, kv_heads, rows, dim = q.shape
    budget = indices.shape[1]
    _check_rows(rows)
    if chunk % 8 or chunk <= 0:
        raise ValueError(f"chunk={chunk} must be a positive multiple of 8 (TPU sublanes)")
    if budget % chunk:
        raise ValueError(f"budget K={budget} must be a multiple of chunk={chunk}; pad the index set with -1")
    chunks = budget // chunk
    if chunks_per_program <= 0:
        chunks_per_program = chunks
    if chunks % chunks_per_program:
        raise ValueError(f"chunks_per_program={chunks_per_program} must divide K/chunk={chunks}")
    programs = chunks // chunks_per_program
    kernel = functools.partial(_sparse_kernel, chunk=chunk, chunks_per_program=chunks_per_program)
    hbm = _any_space()
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, kv_heads, programs),
        in_specs=[
            pl.BlockSpec((None, None, rows, dim), lambda b, h, p, idx: (b, h, 0, 0)),
            pl.BlockSpec(memory_space=hbm),
            pl.BlockSpec(memory_space=hbm),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, dim), lambda b, h, p, idx: (b, h, p, 0, 0)),
            pl.BlockSpec((None, None, None, rows, LANES), lambda b, h, p, idx: (b, h, p, 0, 0)),
            pl.BlockSpec((None, None, None, rows, LANES), lambda b, h, p, idx: (b, h, p, 0, 0)),
        ],
        scratch_shapes=[pltpu.VMEM((2, chunk, dim), k_cache.dtype), pltpu.VMEM((2, chunk, dim), v_cache.dtype),
                        pltpu.SemaphoreType.DMA((2, 2)), pltpu.VMEM((rows, dim), jnp.float32),
                        pltpu.VMEM((rows, LANES), jnp.float32), pltpu.VMEM((rows, LANES), jnp.float32)],
    )
    out_shape = (jax.ShapeDtypeStruct((batch, kv_heads, programs, rows, dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv_heads, programs, rows, LANES), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv_heads, programs, rows, LANES), jnp.float32))
    acc, l, m = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        name="jaxspec_tpu_sparse_history_attention",
        **_call_options(interpret, ("parallel", "parallel", "parallel")),
    )(indices.astype(jnp.int32), q, k_cache, v_cache)
    return acc, l[..., 0], m[..., 0]
