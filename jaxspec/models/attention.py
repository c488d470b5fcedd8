"""History + new-token attention, and the registry of its backends.

``ModelConfig.attention_backend`` names one :class:`AttentionBackend` of :data:`BACKENDS`:

==================  =========  ===========================================================
name                platforms  history attention
==================  =========  ===========================================================
``xla``             any        the jnp reference (scores over every cache slot, masked)
``pallas``          gpu        the Pallas kernels of :mod:`pallas_kernels.attention`
                               (dense flash-decoding / sparse gather), lowered through Triton
``pallas-interpret`` any       the same kernels interpreted (slow; for tests on CPU)
``pallas-tpu``      tpu        the Mosaic TPU kernels of :mod:`pallas_kernels.tpu_attention`
                               (scalar-prefetched lengths / indices, per-row DMA gather)
``pallas-tpu-       cpu, tpu   the TPU kernels in TPU interpret mode (``pltpu.InterpretParams``;
interpret``                    slow; for tests on CPU)
==================  =========  ===========================================================

``auto`` (the :class:`~jaxspec.config.ModelConfig` default) is not a backend: a config made with it
names :func:`platform_default_backend` instead (``pallas-tpu`` on a TPU, ``xla`` elsewhere), and
:func:`get_backend` resolves the name the same way (e.g. for ``--attention-backend auto``).

Everything that depends on the backend asks it here, never by comparing its name:
:attr:`AttentionBackend.capacity_multiple` (cache capacity granularity),
:meth:`~AttentionBackend.dense_history_partials` / :meth:`~AttentionBackend.sparse_history_partials`
(flash-decoding partials of the history part), :meth:`~AttentionBackend.per_device`
(whether a kernel runs per device inside ``shard_map`` under a mesh),
:meth:`~AttentionBackend.check_platform`, :attr:`~AttentionBackend.reads_full_capacity`
(cost model: the dense path reads every slot) and :attr:`~AttentionBackend.batchable`
(may run under ``vmap`` over an extra query axis, as the KnapSpec DP does).

Shapes: ``q [B, T, Hq, D]``; ``k_new/v_new [B, T, Hkv, D]``; ``cache_k/v [B, Hkv, S, D]``;
``lengths [B]``; ``verify_indices [B, K]`` (docs/methods.md §3.2) or ``None``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ATTENTION_BACKENDS, ModelConfig
from jaxspec.parallel.sharding import per_device_kernel
from pallas_kernels import attention as kernels
from pallas_kernels import reference
from pallas_kernels import tpu_attention as tpu_kernels

Partial = reference.Partial


def duplicate_mask(indices: jax.Array) -> jax.Array:
    """``[B, K]`` True where an index already occurred earlier in its row."""
    order = jnp.argsort(indices, axis=-1, stable=True)
    sorted_idx = jnp.take_along_axis(indices, order, axis=-1)
    dup_sorted = jnp.concatenate(
        [jnp.zeros_like(sorted_idx[:, :1], bool), sorted_idx[:, 1:] == sorted_idx[:, :-1]], axis=-1)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(dup_sorted, inverse, axis=-1)


def _warn_if_interpreter_can_hang() -> None:
    """Warn when the TPU interpreter runs under a multi-device mesh that contains CPU device 0.

    JAX's ``io_callback`` (the interpreter calls one per buffer, DMA and semaphore) stages its
    arguments on CPU device 0; a host-to-device copy over 100 KiB onto a device that is running its
    shard of the same program never completes (JAX 0.10.2; docs/tpu.md, "Tests";
    its reproducer is in docs/tpu.md). A CPU mesh over devices 1..n does not hang."""
    try:  # the concrete mesh of jax.set_mesh / use_mesh, also inside jit (no public API for it there)
        from jax._src.mesh import get_concrete_mesh

        mesh = get_concrete_mesh()
    except Exception:  # noqa: BLE001 - a JAX without it: no warning
        return
    if mesh is None or getattr(mesh, "empty", True) or mesh.devices.size < 2:
        return
    try:
        staging = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return
    if staging in set(mesh.devices.flat):
        warnings.warn("pallas-tpu-interpret under a multi-device mesh that contains CPU device 0 can hang once a "
                      "kernel buffer exceeds 100 KiB (io_callback stages its arguments on CPU device 0); build "
                      "the mesh over the other devices, e.g. make_mesh(1, 8, devices=jax.devices()[1:9]) on 9 "
                      "host devices (docs/tpu.md)", RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------- the two implementations
def key_scores(keys: jax.Array, queries: jax.Array) -> jax.Array:
    """``keys [*batch, S, D]`` x ``queries [*batch, M, D]`` -> float32 scores ``[*batch, M, S]``.

    With few query rows (``M <= D``: decoding, drafting, verification) the keys are the product's
    left operand (``[S, D] x [D, M]``, then the small ``[S, M]`` result is transposed): with the
    queries on the left, as ``jnp.einsum`` orders them, the CPU's dot materialises ``K^T``, a full
    read and write of the keys on every call. With many rows (prefill) transposing the ``[S, M]``
    result would cost more than ``K^T``, so the queries stay on the left.
    """
    lead = tuple(range(keys.ndim - 2))
    contract = ((keys.ndim - 1,), (queries.ndim - 1,))
    if queries.shape[-2] > keys.shape[-1]:
        return jax.lax.dot_general(queries, keys, ((contract[1], contract[0]), (lead, lead)),
                                   preferred_element_type=jnp.float32)
    scores = jax.lax.dot_general(keys, queries, (contract, (lead, lead)), preferred_element_type=jnp.float32)
    return jnp.swapaxes(scores, -1, -2)


def grouped_key_scores(keys: jax.Array, qg: jax.Array) -> jax.Array:
    """``keys [B, Hkv, S, D]`` x ``qg [B, Hkv, G, T, D]`` -> float32 ``[B, Hkv, G, T, S]`` (:func:`key_scores`)."""
    batch, heads, groups, steps, dim = qg.shape
    scores = key_scores(keys, qg.reshape(batch, heads, groups * steps, dim))
    return scores.reshape(batch, heads, groups, steps, keys.shape[2])


def xla_attention(config: ModelConfig, q, k_new, v_new, cache_k, cache_v, lengths, verify_indices, probe_local):
    """Attention of ``T`` new query rows over the history plus the new tokens (jnp reference).

    Returns the output ``[B, T, Hq, D]`` and, for ``probe_local`` query heads, their history
    probabilities ``[B, P, T, S or K]`` (normalised over history and new tokens).
    """
    batch, steps, num_heads, dim = q.shape
    groups = config.queries_per_kv
    scale = 1.0 / np.sqrt(dim)
    qg = q.reshape(batch, steps, config.num_kv_heads, groups, dim).transpose(0, 2, 3, 1, 4)  # [B,Hkv,G,T,D]
    if verify_indices is None:
        keys, values = cache_k, cache_v
        valid = jnp.arange(cache_k.shape[2])[None, :] < lengths[:, None]  # [B, S]
    else:
        idx = verify_indices.astype(jnp.int32)
        valid = (idx >= 0) & (idx < lengths[:, None]) & ~duplicate_mask(idx)
        safe = jnp.clip(idx, 0, cache_k.shape[2] - 1)[:, None, :, None]
        keys = jnp.take_along_axis(cache_k, safe, axis=2)
        values = jnp.take_along_axis(cache_v, safe, axis=2)
    scores_hist = grouped_key_scores(keys, qg) * scale
    scores_hist = jnp.where(valid[:, None, None, None, :], scores_hist, -jnp.inf)
    kn = k_new.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    vn = v_new.transpose(0, 2, 1, 3)
    scores_new = jnp.einsum("bkgtd,bkud->bkgtu", qg, kn, preferred_element_type=jnp.float32) * scale
    causal = jnp.tril(jnp.ones((steps, steps), bool))
    scores_new = jnp.where(causal, scores_new, -jnp.inf)
    scores = jnp.concatenate([scores_hist, scores_new], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)  # float32; each row sees at least itself
    hist_len = keys.shape[2]
    p_hist = probs[..., :hist_len]
    out = jnp.einsum("bkgts,bksd->bkgtd", p_hist.astype(q.dtype), values, preferred_element_type=jnp.float32)
    out = out + jnp.einsum("bkgtu,bkud->bkgtd", probs[..., hist_len:].astype(q.dtype), vn,
                           preferred_element_type=jnp.float32)
    out = out.astype(q.dtype).transpose(0, 3, 1, 2, 4).reshape(batch, steps, num_heads, dim)
    probe_probs = None
    if probe_local:
        flat = p_hist.reshape(batch, num_heads, steps, hist_len)  # head h = kv * G + g
        probe_probs = flat[:, jnp.asarray(probe_local)]
    return out, probe_probs


def partials_attention(backend: "AttentionBackend", config: ModelConfig, q, k_new, v_new, cache_k, cache_v,
                       lengths, verify_indices, probe_local):
    """Same contract as :func:`xla_attention`, with the history part from ``backend``'s partials
    (flash-decoding) merged exactly with the new-token part."""
    batch, steps, num_heads, dim = q.shape
    groups, kv_heads = config.queries_per_kv, config.num_kv_heads
    scale = 1.0 / np.sqrt(dim)
    used = groups * steps
    packed = kernels.pack_queries(q, kv_heads, scale)  # [B, Hkv, M, D], rows g * T + t
    if verify_indices is None:
        history = backend.dense_history_partials(packed, cache_k, cache_v, lengths)
        hist_valid, hist_keys = None, cache_k
    else:
        idx = reference.clean_indices(verify_indices, lengths)
        pad = (-idx.shape[1]) % kernels.SPARSE_CHUNK
        idx_padded = jnp.pad(idx, ((0, 0), (0, pad)), constant_values=-1)
        history = backend.sparse_history_partials(packed, cache_k, cache_v, idx_padded)
        hist_valid = idx >= 0
        hist_keys = jnp.take_along_axis(cache_k, jnp.where(hist_valid, idx, 0)[:, None, :, None], axis=2) \
            if probe_local else None
    history = kernels.merged_history(history, used)
    qg = packed[:, :, :used].reshape(batch, kv_heads, groups, steps, dim)
    kn = k_new.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    vn = v_new.transpose(0, 2, 1, 3)
    scores_new = jnp.einsum("bkgtd,bkud->bkgtu", qg, kn, preferred_element_type=jnp.float32)
    causal = jnp.tril(jnp.ones((steps, steps), bool))
    new_part = reference.partial_from_scores(scores_new.reshape(batch, kv_heads, used, steps),
                                             jnp.tile(causal, (groups, 1))[None, None], vn)
    total = reference.merge_partials([history, new_part])
    out = reference.normalize(total, q.dtype).reshape(batch, kv_heads, groups, steps, dim)
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, steps, num_heads, dim)
    probe_probs = None
    if probe_local:  # exact probabilities of the probe heads, normalised by the merged (m, l)
        _, l_total, m_total = total
        probs = []
        for head in probe_local:
            group, g = divmod(head, groups)
            rows = slice(g * steps, (g + 1) * steps)
            keys = hist_keys[:, group]
            s_hist = jnp.einsum("btd,bsd->bts", qg[:, group, g], keys, preferred_element_type=jnp.float32)
            if verify_indices is None:
                valid = (jnp.arange(keys.shape[1])[None, :] < lengths[:, None])[:, None, :]
            else:
                valid = hist_valid[:, None, :]
            p = jnp.exp(s_hist - m_total[:, group, rows, None]) / l_total[:, group, rows, None]
            probs.append(jnp.where(valid, p, 0.0))
        probe_probs = jnp.stack(probs, axis=1)
    return out, probe_probs


# ---------------------------------------------------------------------------- the registry
@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """What the rest of jaxspec needs to know about one history-attention implementation."""

    name: str
    description: str
    #: cache capacity granularity (the kernels walk the cache in blocks of this many slots)
    capacity_multiple: int
    #: the dense path reads every cache slot (cost grows with capacity, not with the valid length)
    reads_full_capacity: bool
    #: may run under ``vmap`` over an extra query axis (the KnapSpec DP's branches)
    batchable: bool
    #: the history part is an opaque kernel: under a mesh it runs per device inside ``shard_map``
    opaque_kernel: bool
    #: platforms it can run on (``None``: any)
    platforms: Optional[Tuple[str, ...]] = None
    interpret: bool = False
    #: the kernels are the Mosaic TPU ones (:mod:`pallas_kernels.tpu_attention`), not the Triton ones
    tpu_kernels: bool = False

    def runs_on(self, platform: Optional[str] = None) -> bool:
        """Whether this backend can run on ``platform`` (default: ``jax.default_backend()``)."""
        platform = platform or jax.default_backend()
        return self.platforms is None or platform in self.platforms

    def check_platform(self, platform: Optional[str] = None) -> None:
        """Raise ``ValueError`` naming the platform and the valid backends where this one cannot run."""
        platform = platform or jax.default_backend()
        if not self.runs_on(platform):
            usable = [b.name for b in BACKENDS.values() if b.runs_on(platform)]
            raise ValueError(f"attention_backend={self.name!r} needs a {'/'.join(self.platforms).upper()} "
                             f"({self.description}); this platform is {platform!r}. Valid here: {usable}")

    def round_capacity(self, capacity: int) -> int:
        """``capacity`` rounded up to :attr:`capacity_multiple`."""
        return -(-int(capacity) // self.capacity_multiple) * self.capacity_multiple

    def per_device(self, kernel: Callable, queries, k_cache, v_cache, rows):
        """``kernel(queries [B, Hkv, M, D], k_cache, v_cache [B, Hkv, S, D], rows [B, ...])``, run per
        device inside ``shard_map`` under the active mesh when the kernel is opaque to GSPMD
        (:func:`jaxspec.parallel.per_device_kernel`), else called as is (GSPMD partitions it)."""
        if self.opaque_kernel:
            if self.tpu_kernels and self.interpret:
                _warn_if_interpreter_can_hang()
            return per_device_kernel(kernel, queries, k_cache, v_cache, rows)
        return kernel(queries, k_cache, v_cache, rows)

    def dense_history_partials(self, packed, k_cache, v_cache, lengths) -> Partial:
        """Partials of packed queries ``[B, Hkv, M, D]`` (pre-scaled) over cache slots ``< lengths``."""
        if self.tpu_kernels:
            kernel = functools.partial(tpu_kernels.tpu_dense_history_partials, block_k=self.capacity_multiple,
                                       interpret=self.interpret)
        elif self.opaque_kernel:
            kernel = functools.partial(kernels.dense_history_partials, interpret=self.interpret)
        else:
            kernel = reference.dense_history_reference
        return self.per_device(kernel, packed, k_cache, v_cache, lengths)

    def sparse_history_partials(self, packed, k_cache, v_cache, indices) -> Partial:
        """Partials over the cache rows ``indices [B, K]`` (cleaned: entries < 0 ignored; ``K`` a
        multiple of ``pallas_kernels.attention.SPARSE_CHUNK`` for the kernels)."""
        if self.tpu_kernels:
            kernel = functools.partial(tpu_kernels.tpu_sparse_history_partials, chunk=kernels.SPARSE_CHUNK,
                                       interpret=self.interpret)
        elif self.opaque_kernel:
            kernel = functools.partial(kernels.sparse_history_partials, chunk=kernels.SPARSE_CHUNK,
                                       interpret=self.interpret)
        else:
            kernel = reference.sparse_history_reference
        return self.per_device(kernel, packed, k_cache, v_cache, indices)

    def attend(self, config: ModelConfig, q, k_new, v_new, cache_k, cache_v, lengths, verify_indices=None,
               probe_local: Tuple[int, ...] = ()):
        """History + new-token attention: ``(out [B, T, Hq, D], probe probs [B, P, T, S or K] or None)``."""
        if not self.opaque_kernel:
            return xla_attention(config, q, k_new, v_new, cache_k, cache_v, lengths, verify_indices, probe_local)
        self.check_platform()
        return partials_attention(self, config, q, k_new, v_new, cache_k, cache_v, lengths, verify_indices,
                                  probe_local)


#: The backends, by name (``ModelConfig.attention_backend`` is validated against these names).
BACKENDS: Dict[str, AttentionBackend] = {
    "xla": AttentionBackend("xla", "jnp reference attention", capacity_multiple=1, reads_full_capacity=True,
                            batchable=True, opaque_kernel=False),
    "pallas": AttentionBackend("pallas", "Pallas kernels lowered through Triton", capacity_multiple=64,
                               reads_full_capacity=False, batchable=False, opaque_kernel=True, platforms=("gpu",)),
    "pallas-interpret": AttentionBackend("pallas-interpret", "the Pallas kernels interpreted: slow, for tests",
                                         capacity_multiple=64, reads_full_capacity=False, batchable=False,
                                         opaque_kernel=True, interpret=True),
    "pallas-tpu": AttentionBackend("pallas-tpu", "Mosaic TPU Pallas kernels", capacity_multiple=128,
                                   reads_full_capacity=False, batchable=False, opaque_kernel=True, platforms=("tpu",),
                                   tpu_kernels=True),
    "pallas-tpu-interpret": AttentionBackend("pallas-tpu-interpret",
                                             "the Mosaic TPU kernels in TPU interpret mode: slow, for tests",
                                             capacity_multiple=128, reads_full_capacity=False, batchable=False,
                                             opaque_kernel=True, platforms=("cpu", "tpu"), interpret=True,
                                             tpu_kernels=True),
}
#: the name that resolves per platform (:func:`platform_default_backend`); the config default
AUTO_BACKEND = "auto"
if tuple(BACKENDS) + (AUTO_BACKEND,) != ATTENTION_BACKENDS:  # the config validates names without importing the model
    raise ImportError(f"attention registry {tuple(BACKENDS)} differs from jaxspec.config.ATTENTION_BACKENDS "
                      f"{ATTENTION_BACKENDS}")

#: The backend every other one is checked against (and the one batched code falls back to).
REFERENCE_BACKEND = "xla"


def platform_default_backend(platform: Optional[str] = None) -> str:
    """The backend ``"auto"`` resolves to on ``platform`` (default ``jax.default_backend()``):
    the Mosaic kernels on a TPU, the jnp reference elsewhere (on a GPU ``"pallas"`` is opt-in)."""
    platform = platform or jax.default_backend()
    return "pallas-tpu" if platform == "tpu" else REFERENCE_BACKEND


def get_backend(name: str) -> AttentionBackend:
    if name == AUTO_BACKEND:
        return BACKENDS[platform_default_backend()]
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r}; valid: {sorted(BACKENDS) + [AUTO_BACKEND]}")
    return BACKENDS[name]


def backend_of(config: ModelConfig) -> AttentionBackend:
    """The :class:`AttentionBackend` ``config.attention_backend`` names."""
    return get_backend(config.attention_backend)


def batchable_config(config: ModelConfig) -> ModelConfig:
    """``config``, or the same config on the reference backend when its backend cannot run under
    ``vmap`` over an extra query axis (the kernels are not written for one)."""
    return config if backend_of(config).batchable else config.replace(attention_backend=REFERENCE_BACKEND)


def attention(config: ModelConfig, q, k_new, v_new, cache_k, cache_v, lengths, verify_indices=None,
              probe_local: Tuple[int, ...] = ()):
    """History + new-token attention with ``config.attention_backend`` (see :meth:`AttentionBackend.attend`)."""
    return backend_of(config).attend(config, q, k_new, v_new, cache_k, cache_v, lengths, verify_indices,
                                     probe_local)


__all__ = ["AUTO_BACKEND", "AttentionBackend", "BACKENDS", "REFERENCE_BACKEND", "attention", "backend_of",
           "batchable_config", "duplicate_mask", "get_backend", "grouped_key_scores", "key_scores",
           "partials_attention", "platform_default_backend", "xla_attention"]
