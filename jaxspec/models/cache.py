"""KV cache pytree with per-sequence lengths.

Layout: one ``[B, Hkv, S_max, D]`` array per layer for keys and for values (the layout the
dense and sparse decode kernels read: each (sequence, KV head) is one contiguous
``[S_max, D]`` slab), and ``lengths [B]`` int32, the number of valid positions of each row.

* A forward with ``T`` new tokens writes row ``b`` at slots ``lengths[b] .. lengths[b]+T-1``
  (a scatter with ``mode="drop"``: a slot past the end is dropped, never clamped onto valid
  history the way ``dynamic_update_slice`` would) and returns ``lengths + T``. With concrete
  lengths the forward refuses such a write (:class:`CacheOverflowError`); under ``jit`` it
  cannot see them, and the dropped K/V make the logits wrong: check on the host first.
* Rollback of rejected tokens is ``cache.rollback(n)`` / ``cache.with_lengths(...)``: only the
  lengths move, no copies; the stale slots are overwritten by the next write.
* :func:`check_room` is the host-side guard every public entry point calls before launching
  work: it raises :class:`CacheOverflowError` naming the rows that would overflow.
* The capacity is rounded up to the attention backend's ``capacity_multiple``
  (:mod:`jaxspec.models.attention`); under a mesh :func:`init_cache` allocates the buffers
  already sharded (:data:`CACHE_KV_AXES`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxspec.config import ModelConfig
from jaxspec.models.attention import backend_of
from jaxspec.parallel.sharding import RULES, LogicalAxes, ShardingRules, axis_size

#: Logical axes of the cache arrays (mapped to mesh axes by :class:`jaxspec.parallel.ShardingRules`).
CACHE_KV_AXES: LogicalAxes = ("batch", "kv_heads", "sequence", "head_dim")  # keys/values [B, Hkv, S, D]
CACHE_LENGTHS_AXES: LogicalAxes = ("lengths",)  # [B]


class CacheOverflowError(ValueError):
    """A write would go past the KV cache capacity."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer keys/values ``[B, Hkv, S_max, D]`` and per-row valid lengths ``[B]``."""

    keys: Tuple[jax.Array, ...]
    values: Tuple[jax.Array, ...]
    lengths: jax.Array
    # [B] bool or None: rows whose history the attention does not read (a batched decode's finished
    # rows, docs/methods.md §5.7); they attend to slot 0 only, their writes still land at ``lengths``.
    # Set per round by the engine (:func:`freeze_rows`), never carried between rounds.
    frozen: Optional[jax.Array] = None

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        """``S_max``: slots per row."""
        return self.keys[0].shape[2]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def with_lengths(self, lengths) -> "KVCache":
        """Same buffers, new per-row lengths (rollback or commit: no data moves)."""
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))

    @property
    def read_lengths(self) -> jax.Array:
        """History slots the attention reads per row: ``lengths``, and at most 1 (the first slot, so
        no softmax is empty) for :attr:`frozen` rows."""
        if self.frozen is None:
            return self.lengths
        return jnp.where(self.frozen, jnp.minimum(self.lengths, 1), self.lengths)

    def with_frozen(self, frozen) -> "KVCache":
        """Same buffers and lengths; ``frozen [B]`` bool (or ``None``) as :attr:`frozen`."""
        if frozen is not None:
            frozen = jnp.asarray(frozen, bool)
            if frozen.shape != self.lengths.shape:
                raise ValueError(f"frozen has shape {frozen.shape}; the cache has {self.batch_size} rows")
        return dataclasses.replace(self, frozen=frozen)

    def rollback(self, num_rejected) -> "KVCache":
        """Forget the last ``num_rejected[b]`` tokens of each row (a scalar or ``[B]``).

        When the counts and lengths are concrete (not traced), a negative count or one above
        the row's length raises ``ValueError`` (the cache is left as it was); under ``jit`` the
        caller guarantees ``0 <= num_rejected <= lengths``.
        """
        if is_concrete(num_rejected) and is_concrete(self.lengths):
            counts = np.broadcast_to(np.asarray(num_rejected), np.shape(self.lengths))
            lengths = np.asarray(self.lengths)
            bad = np.nonzero((counts < 0) | (counts > lengths))[0]
            if bad.size:
                row = int(bad[0])
                raise ValueError(f"rollback of {int(counts[row])} tokens in row {row} of length {int(lengths[row])}; "
                                 f"valid counts: 0..length")
        return self.with_lengths(self.lengths - jnp.asarray(num_rejected, jnp.int32))

    def nbytes(self) -> int:
        return sum(int(k.size) * k.dtype.itemsize for k in self.keys + self.values)


def freeze_rows(tree, frozen):
    """``tree`` (any pytree, e.g. a draft policy's state) with every :class:`KVCache` of ``frozen``'s
    batch marked :attr:`KVCache.frozen` (``None`` clears the mark). Caches of another batch size (a
    planner's few rows) are left as they are."""
    def mark(node):
        if isinstance(node, KVCache) and (frozen is None or node.lengths.shape == jnp.shape(frozen)):
            return node.with_frozen(frozen)
        return node

    return jax.tree.map(mark, tree, is_leaf=lambda node: isinstance(node, KVCache))


def is_concrete(x) -> bool:
    """``x`` holds values this host can read (not a tracer, not an array spread over other hosts)."""
    if isinstance(x, jax.core.Tracer):
        return False
    return not isinstance(x, jax.Array) or x.is_fully_addressable


def init_cache(config: ModelConfig, batch_size: int, capacity: int, dtype=None, lengths=None, *, mesh=None,
               rules=None) -> KVCache:
    """An empty cache of ``capacity`` slots per row for ``batch_size`` rows.

    Leave headroom: ``capacity`` should be at least prompt + new tokens + (gamma + 1).
    With a ``mesh`` (``jax.sharding.Mesh``) the buffers are allocated already sharded (batch
    over ``data``, KV heads over ``tensor``; ``rules``: a ``jaxspec.parallel.ShardingRules``),
    never whole on one device.
    """
    if batch_size <= 0 or capacity <= 0:
        raise ValueError(f"batch_size={batch_size} and capacity={capacity} must be positive")
    if mesh is not None:
        return allocate_cache(config, batch_size, capacity, mesh, rules, dtype=dtype, lengths=lengths)
    capacity = backend_of(config).round_capacity(capacity)  # the kernels walk the cache in blocks
    dtype = dtype or config.jnp_dtype
    shape = (batch_size, config.num_kv_heads, capacity, config.head_dim)
    keys = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    values = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    if lengths is None:
        lengths = jnp.zeros((batch_size,), jnp.int32)
    return KVCache(keys=keys, values=values, lengths=jnp.asarray(lengths, jnp.int32))


def cache_bytes(config: ModelConfig, batch_size: int, capacity: int, dtype_bytes: int = 2) -> int:
    """Bytes a cache of this shape occupies (keys and values, all layers)."""
    return 2 * config.num_layers * batch_size * config.num_kv_heads * capacity * config.head_dim * dtype_bytes


def check_room(lengths, capacity: int, num_new: int, what: str = "write") -> None:
    """Raise :class:`CacheOverflowError` if any row cannot take ``num_new`` more tokens.

    ``lengths`` must be concrete (host values): call this before launching jitted work.
    """
    lengths = np.asarray(jax.device_get(lengths)).reshape(-1)
    if num_new < 0:
        raise ValueError(f"num_new={num_new} must be >= 0")
    over = np.nonzero(lengths + num_new > capacity)[0]
    if over.size:
        rows = ", ".join(f"row {int(r)} (length {int(lengths[r])})" for r in over[:8])
        raise CacheOverflowError(
            f"KV cache overflow: {what} of {num_new} tokens does not fit in capacity {capacity} for {rows}"
            f"{' and more' if over.size > 8 else ''}; allocate capacity >= {int(lengths.max()) + num_new}"
        )


def check_context(config: ModelConfig, lengths, num_new: int, what: str = "prompt + generation") -> None:
    """Raise ``ValueError`` if a prompt plus ``num_new`` tokens runs past the model's context
    (``config.max_position_embeddings``): RoPE positions beyond it were never trained. Callers that
    mean it (e.g. timing random-weight shapes) pass ``allow_beyond_context=True`` to the entry points."""
    longest = int(np.max(np.asarray(jax.device_get(lengths))))
    if longest + num_new > config.max_position_embeddings:
        raise ValueError(f"{what}: a prompt of {longest} tokens + {num_new} new = {longest + num_new} positions exceeds "
                         f"the context of {config.name!r} (max_position_embeddings={config.max_position_embeddings}); "
                         f"shorten the prompt or generate fewer tokens (allow_beyond_context=True runs it anyway)")


def write_positions(lengths: jax.Array, num_new: int, capacity: int, enabled=True) -> jax.Array:
    """Slots ``[B, T]`` the next ``num_new`` tokens go to; ``capacity`` (dropped) where disabled."""
    slots = lengths[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]
    return jnp.where(enabled, slots, capacity)


def scatter_rows(buffer: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """Write ``new [B, H, T, D]`` into ``buffer [B, H, S, D]`` at ``slots [B, T]`` (out of range: dropped).

    Written as a per-(row, head) scatter under ``vmap``: the scatter then carries batch/head
    *batching* dimensions, which the SPMD partitioner splits like the cache (no gather of the
    new K/V when the cache is sharded over batch or heads); on one device XLA lowers it to the
    same in-place scatter as explicit ``(b, h, slot)`` indices.
    """
    def write_one(rows, new_rows, row_slots):  # [S, D], [T, D], [T]
        return rows.at[row_slots].set(new_rows, mode="drop")

    per_head = jax.vmap(write_one, in_axes=(0, 0, None))
    return jax.vmap(per_head, in_axes=(0, 0, 0))(buffer, new.astype(buffer.dtype), slots)


def stack_lengths(lengths: Sequence[int]) -> jax.Array:
    return jnp.asarray(np.asarray(lengths, np.int32))


def random_cache(config: ModelConfig, batch_size: int, capacity: int, length, seed: int = 0, *,
                 sharding=None) -> KVCache:
    """A cache filled with random K/V up to ``length`` (for systems benchmarks with random weights:
    decode cost does not depend on the values, and a random-weight prefill would measure nothing).
    ``sharding``: a ``NamedSharding`` for each ``[B, Hkv, S, D]`` array, created in place (each
    device fills only its blocks; a cache larger than one device's memory never exists whole)."""
    capacity = backend_of(config).round_capacity(capacity)
    shape = (batch_size, config.num_kv_heads, capacity, config.head_dim)
    fill = jax.jit(lambda key: jax.random.normal(key, shape, jnp.float32).astype(config.jnp_dtype),
                   out_shardings=sharding)
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * config.num_layers)
    lengths = jnp.broadcast_to(jnp.asarray(length, jnp.int32), (batch_size,))
    return KVCache(keys=tuple(fill(keys[i]) for i in range(config.num_layers)),
                   values=tuple(fill(keys[config.num_layers + i]) for i in range(config.num_layers)),
                   lengths=lengths)


# ---------------------------------------------------------------------------- placement on a mesh
def cache_shardings(mesh: Mesh, num_layers: int, rules: ShardingRules = RULES) -> KVCache:
    """``KVCache``-shaped pytree of ``NamedSharding`` (keys/values per layer, lengths)."""
    kv = rules.sharding(mesh, CACHE_KV_AXES)
    return KVCache(keys=(kv,) * num_layers, values=(kv,) * num_layers,
                   lengths=rules.sharding(mesh, CACHE_LENGTHS_AXES))


def check_cache_divisible(batch: int, num_kv_heads: int, mesh, rules: ShardingRules = RULES) -> None:
    """Raise ``ValueError`` when the cache's batch or KV-head count does not split over its mesh axis."""
    for logical, count, what in (("batch", batch, "cache batch"), ("kv_heads", num_kv_heads, "cache num_kv_heads")):
        axis = rules.mesh_axis(logical)
        size = axis_size(mesh, axis)
        if count % size:
            hint = ("the number of rows (prompts) must be a multiple of it" if logical == "batch" else
                    "tensor parallelism splits whole KV heads")
            raise ValueError(f"{what}={count} is not divisible by the mesh axis {axis!r} of size {size} "
                             f"(ShardingRules.{logical}={axis!r}): {hint}")


def allocate_cache(config: ModelConfig, batch_size: int, capacity: int, mesh: Mesh,
                   rules: Optional[ShardingRules] = None, dtype=None, lengths=None) -> KVCache:
    """An empty :class:`KVCache` created directly in its sharded layout (each device allocates
    only its ``[B/data, Hkv/tensor, S, D]`` blocks)."""
    rules = RULES if rules is None else rules
    check_cache_divisible(batch_size, config.num_kv_heads, mesh, rules)
    lengths = np.zeros((batch_size,), np.int32) if lengths is None else np.asarray(lengths, np.int32)
    return _cache_allocator(config, batch_size, capacity, dtype, mesh, rules)(lengths)


@functools.lru_cache(maxsize=64)
def _cache_allocator(config, batch_size, capacity, dtype, mesh, rules):
    return jax.jit(lambda lengths: init_cache(config, batch_size, capacity, dtype=dtype, lengths=lengths),
                   out_shardings=cache_shardings(mesh, config.num_layers, rules))
