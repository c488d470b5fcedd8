"""The building blocks of the Llama-family forward (docs/methods.md §2), public so that code
running the model in its own order (the KnapSpec DP and latency profiler, Quest verification)
uses the very same computations instead of a copy of the forward's skeleton.

* :func:`embed` -- token ids ``[B, T]`` -> hidden states ``[B, T, d]``;
* :func:`attention_sublayer` -- pre-norm attention with residual; returns the new K/V;
* :func:`mlp_sublayer` -- pre-norm SwiGLU MLP with residual;
* :func:`decoder_layer` -- one attention + one MLP sub-layer, K/V written into the cache;
* :func:`lm_head` -- final RMSNorm and the LM head -> float32 logits;
* :func:`rms_norm`, :func:`rope_tables`, :func:`apply_rope`, :func:`project_qkv`.

Numerics: parameters and activations in ``config.dtype``; RMSNorm, RoPE angles, attention
scores/softmax and logits in float32.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.models.attention import attention
from jaxspec.models.cache import scatter_rows, write_positions
from jaxspec.models.params import LayerParams, ModelParams


# ---------------------------------------------------------------------------- helpers
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, result in ``x.dtype``."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * normed).astype(x.dtype)


def rope_tables(config: ModelConfig, positions: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """cos/sin ``[B, T, D]`` (float32) for rotate-half RoPE at integer ``positions [B, T]``."""
    inv_freq = jnp.asarray(config.inverse_frequencies(), jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face layout). ``x [B, T, H, D]``, ``cos/sin [B, T, D]``."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def default_positions(lengths: jax.Array, steps: int) -> jax.Array:
    """RoPE positions ``[B, T]`` of ``steps`` tokens appended after ``lengths [B]``."""
    return lengths[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]


# ---------------------------------------------------------------------------- blocks
def embed(params: ModelParams, tokens: jax.Array, config: ModelConfig) -> jax.Array:
    """Hidden states ``[B, T, d]`` (``config.dtype``) of token ids ``[B, T]``."""
    with jax.named_scope("embed"):
        return params.embed[tokens].astype(config.jnp_dtype)


def project_qkv(layer: LayerParams, h, config: ModelConfig, cos, sin):
    """Pre-norm, q/k/v projections (+ bias) and RoPE: ``q [B, T, Hq, D]``, ``k, v [B, T, Hkv, D]``."""
    batch, steps, _ = h.shape
    x = rms_norm(h, layer.attn_norm, config.rms_norm_eps)
    if layer.fused:  # one product for q, k and v (docs/methods.md §2, fused projections)
        qkv = jnp.einsum("btd,dn->btn", x, layer.wqkv)
        if config.attention_bias:
            qkv = qkv + layer.bqkv
        width, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        q, k, v = qkv[..., :width], qkv[..., width:width + kv], qkv[..., width + kv:]
    else:
        q = jnp.einsum("btd,dq->btq", x, layer.wq)
        k = jnp.einsum("btd,dk->btk", x, layer.wk)
        v = jnp.einsum("btd,dk->btk", x, layer.wv)
        if config.attention_bias:
            q, k, v = q + layer.bq, k + layer.bk, v + layer.bv
    q = apply_rope(q.reshape(batch, steps, config.num_heads, config.head_dim), cos, sin)
    k = apply_rope(k.reshape(batch, steps, config.num_kv_heads, config.head_dim), cos, sin)
    return q, k, v.reshape(batch, steps, config.num_kv_heads, config.head_dim)


class AttentionOutput(NamedTuple):
    hidden: jax.Array  # [B, T, d] residual stream after the sub-layer
    keys: jax.Array  # [B, Hkv, T, D] the new tokens' keys (post-RoPE)
    values: jax.Array  # [B, Hkv, T, D]
    probe_queries: Optional[jax.Array]  # [B, P, T, D] float32, for the probe_local heads
    probe_probs: Optional[jax.Array]  # [B, P, T, S or K]


def attention_sublayer(layer: LayerParams, h, config: ModelConfig, cos, sin, cache_k, cache_v, lengths,
                       verify_indices=None, probe_local: Tuple[int, ...] = (), *,
                       attend=None) -> AttentionOutput:
    """Pre-norm attention sub-layer over ``cache_k/v [B, Hkv, S, D]`` (first ``lengths[b]`` slots)
    plus the ``T`` new tokens (causal). Writes nothing: the new K/V are returned.

    ``attend``: ``attend(q, k_new, v_new) -> out [B, T, Hq, D]`` replacing the configured
    attention (a baseline's restricted attention; no probes then).
    """
    batch, steps, _ = h.shape
    q, k, v = project_qkv(layer, h, config, cos, sin)
    if attend is None:
        out, probe_probs = attention(config, q, k, v, cache_k, cache_v, lengths, verify_indices, probe_local)
    else:
        out, probe_probs = attend(q, k, v), None
    h = h + jnp.einsum("btq,qd->btd", out.reshape(batch, steps, -1), layer.wo)
    probe_q = q[:, :, jnp.asarray(probe_local)].astype(jnp.float32).transpose(0, 2, 1, 3) if probe_local else None
    return AttentionOutput(h, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), probe_q, probe_probs)


def mlp_sublayer(layer: LayerParams, h, config: ModelConfig) -> jax.Array:
    """Pre-norm SwiGLU MLP sub-layer with residual: ``h [B, T, d]`` -> ``[B, T, d]``."""
    x = rms_norm(h, layer.mlp_norm, config.rms_norm_eps)
    if layer.fused:  # one product for gate and up (docs/methods.md §2, fused projections)
        gate_up = jnp.einsum("btd,df->btf", x, layer.w_gate_up)
        gate, up = gate_up[..., :config.intermediate_size], gate_up[..., config.intermediate_size:]
    else:
        gate = jnp.einsum("btd,df->btf", x, layer.w_gate)
        up = jnp.einsum("btd,df->btf", x, layer.w_up)
    act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(h.dtype)
    return h + jnp.einsum("btf,fd->btd", act, layer.w_down)


class LayerOutput(NamedTuple):
    hidden: jax.Array  # [B, T, d]
    cache_k: jax.Array  # [B, Hkv, S, D] with the new keys written (unchanged where attention was skipped)
    cache_v: jax.Array
    probe_queries: Optional[jax.Array]
    probe_probs: Optional[jax.Array]
    # write_cache=False: the new tokens' K/V [B, Hkv, T, D] (zeros where attention was skipped), written nowhere
    new_keys: Optional[jax.Array] = None
    new_values: Optional[jax.Array] = None
    # the residual stream between the two sub-layers [B, T, d] (the input where attention was skipped)
    attention_hidden: Optional[jax.Array] = None


def _after_read(slots: jax.Array, hidden: jax.Array, capacity: int) -> jax.Array:
    """``slots`` made to depend on the attention sub-layer's output ``hidden [B, T, d]``.

    The new K/V come from the projections, not from the attention's read of the old cache, so
    nothing orders the in-place cache write after that read; XLA then copies the whole layer
    cache (on the CPU: twice per layer per step inside a decode loop, several times the step's
    own cache traffic). Routing the slots through ``hidden`` orders the write after the read. A row whose
    hidden state is NaN (its output is garbage already) writes nothing; every other row's slots
    are unchanged. The ``lax.cond`` of a dynamic skip mask orders the write the same way.
    """
    broken = jnp.isnan(hidden[:, :1, 0])  # [B, 1]: one element per row is enough for the dependency
    return jnp.where(broken, capacity, slots)


def decoder_layer(layer: LayerParams, h, config: ModelConfig, cos, sin, cache_k, cache_v, lengths,
                  verify_indices=None, probe_local: Tuple[int, ...] = (), *, skip_attn=False, skip_mlp=False,
                  attend=None, history_lengths=None, write_cache: bool = True) -> LayerOutput:
    """One decoder layer: attention sub-layer (its K/V written at slots ``lengths ..``) then MLP.

    ``history_lengths [B]``: the history slots the attention reads (default ``lengths``; a finished
    row's 1 under :attr:`jaxspec.models.cache.KVCache.read_lengths`).

    ``skip_attn`` / ``skip_mlp``: a Python bool removes the sub-layer at trace time; a traced
    bool scalar switches it with ``lax.cond`` (the skipped branch does no work). A skipped
    attention sub-layer writes nothing into the cache. ``attend``: see :func:`attention_sublayer`.
    ``write_cache=False``: the caches come back unchanged and the new K/V in ``new_keys`` / ``new_values``
    for the caller to write (e.g. after a ``lax.cond`` that should only read the cache).
    """
    steps = h.shape[1]
    capacity = cache_k.shape[2]
    probe_q = probe_p = None
    new_k = new_v = None
    static_attn = isinstance(skip_attn, bool)
    if not (static_attn and skip_attn):
        def run_attn(hh):
            return attention_sublayer(layer, hh, config, cos, sin, cache_k, cache_v,
                                      lengths if history_lengths is None else history_lengths, verify_indices,
                                      probe_local, attend=attend)

        with jax.named_scope("attention"):
            if static_attn:
                out = run_attn(h)
                enabled = True
            else:
                def skipped(hh):
                    shapes = jax.eval_shape(run_attn, hh)
                    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tuple(shapes[1:]))
                    return AttentionOutput(hh, *zeros)

                out = jax.lax.cond(skip_attn, skipped, run_attn, h)
                enabled = jnp.logical_not(skip_attn)
            h, probe_q, probe_p = out.hidden, out.probe_queries, out.probe_probs
            if write_cache:
                slots = write_positions(lengths, steps, capacity, enabled)
                if static_attn:
                    slots = _after_read(slots, h, capacity)
                cache_k = scatter_rows(cache_k, out.keys, slots)
                cache_v = scatter_rows(cache_v, out.values, slots)
            else:
                new_k, new_v = out.keys, out.values
    between = h
    if not (isinstance(skip_mlp, bool) and skip_mlp):
        with jax.named_scope("mlp"):
            if isinstance(skip_mlp, bool):
                h = mlp_sublayer(layer, h, config)
            else:
                h = jax.lax.cond(skip_mlp, lambda hh: hh, lambda hh: mlp_sublayer(layer, hh, config), h)
    if not write_cache and new_k is None:  # attention removed at trace time: no new K/V
        zeros = jnp.zeros((h.shape[0], config.num_kv_heads, steps, config.head_dim), cache_k.dtype)
        new_k, new_v = zeros, zeros
    return LayerOutput(h, cache_k, cache_v, probe_q, probe_p, new_k, new_v, between)


def lm_head(params: ModelParams, h, config: ModelConfig) -> jax.Array:
    """Final RMSNorm and the LM head: ``h [..., d]`` -> float32 logits ``[..., V]``."""
    with jax.named_scope("lm_head"):
        final = rms_norm(h, params.final_norm, config.rms_norm_eps)
        if params.lm_head is None:  # tied: contract with the embedding's rows (its transpose would be copied on the CPU)
            return jax.lax.dot_general(final, params.embed, (((final.ndim - 1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)
        return jnp.einsum("...d,dv->...v", final, params.lm_head, preferred_element_type=jnp.float32)


__all__ = ["AttentionOutput", "LayerOutput", "apply_rope", "attention_sublayer", "decoder_layer",
           "default_positions", "embed", "lm_head", "mlp_sublayer", "project_qkv", "rms_norm", "rope_tables"]
