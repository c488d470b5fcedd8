"""One Llama-family forward (Llama-2/3/3.x, Qwen2/2.5, SmolLM2) as a pure jit-able function.

``forward(params, tokens [B, T], cache, ...)`` serves prefill, decode, draft and
verification. Options (all keyword-only):

* ``skip_mask`` -- which sub-layers to skip. Either a *dynamic* bool array ``[L, 2]``
  (column 0 = Attention, column 1 = MLP; ``True`` = skip) that switches each sub-layer with
  ``lax.cond`` -- the skipped branch does no work and a new mask needs no recompile -- or a
  *static* tuple of ``L`` pairs of Python bools, which removes the sub-layers at trace time
  (a recompile per distinct mask, no per-layer branch at run time). A skipped Attention
  sub-layer writes nothing into the KV cache.
* ``verify_indices`` ``[B, K]`` int32 -- restrict history attention of every layer and KV head
  to these cache slots (one set per sequence, SPEC 3.2). Negative, out-of-range
  (``>= lengths``) and duplicate entries are ignored. The ``T`` new tokens are always
  attended, causally among themselves. This is the dense jnp reference path.
* ``probe_heads`` -- a static tuple of ``(layer, query_head)`` pairs. The forward returns the
  post-RoPE queries ``[B, P, T, D]`` of those heads and their attention probabilities over
  the history ``[B, P, T, S]`` (``S = S_max``, or ``K`` with ``verify_indices``; the
  probabilities are the ones the forward used: normalised over history and new tokens).
* ``positions`` ``[B, T]`` -- RoPE positions (default: ``lengths[:, None] + arange(T)``).
* ``output_positions`` ``[B, P]`` -- compute logits only at these token indices (prefill of
  long prompts would otherwise materialise ``[B, T, V]`` float32 logits).

Numerics: parameters and activations in ``config.dtype`` (bfloat16 by default); RMSNorm,
RoPE angles, attention scores/softmax and logits in float32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.models.cache import KVCache, scatter_rows, write_positions

ProbeHeads = Tuple[Tuple[int, int], ...]


class Probes(NamedTuple):
    """Probe outputs for the requested ``(layer, query_head)`` pairs, in request order."""

    queries: Optional[jax.Array]  # [B, P, T, D] float32, after RoPE
    history_probs: Optional[jax.Array]  # [B, P, T, S] float32


class ForwardOutput(NamedTuple):
    logits: jax.Array  # [B, T, V] (or [B, P, V] with output_positions), float32
    cache: KVCache  # lengths advanced by T
    probes: Optional[Probes]
    hidden: Optional[jax.Array] = None  # [B, T, H] final hidden state before the norm, if requested


# ---------------------------------------------------------------------------- parameters
def init_params(config: ModelConfig, key: jax.Array, scale: float = 0.02) -> dict:
    """Random parameters with the real layout (for tests and paper-shape benchmarks)."""
    dtype = config.jnp_dtype
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    keys = iter(jax.random.split(key, 14 * config.num_layers + 4))

    def normal(shape, std=scale):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def norm_weight(shape):
        return (1.0 + 0.1 * jax.random.normal(next(keys), shape, jnp.float32)).astype(jnp.float32)

    layers = []
    for _ in range(config.num_layers):
        layer = {
            "attn_norm": norm_weight((d,)),
            "wq": normal((d, q)),
            "wk": normal((d, kv)),
            "wv": normal((d, kv)),
            "wo": normal((q, d)),
            "mlp_norm": norm_weight((d,)),
            "w_gate": normal((d, f)),
            "w_up": normal((d, f)),
            "w_down": normal((f, d)),
        }
        if config.attention_bias:
            layer.update(bq=normal((q,)), bk=normal((kv,)), bv=normal((kv,)))
        layers.append(layer)
    params = {"embed": normal((config.vocab_size, d), 1.0), "layers": layers, "final_norm": norm_weight((d,))}
    if not config.tie_word_embeddings:
        params["lm_head"] = normal((d, config.vocab_size))
    return params


def expected_param_shapes(config: ModelConfig) -> dict:
    """``{path: shape}`` of every parameter, used by the loaders to validate checkpoints."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"embed": (config.vocab_size, d), "final_norm": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (d, config.vocab_size)
    for i in range(config.num_layers):
        layer = {"attn_norm": (d,), "wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d), "mlp_norm": (d,),
                 "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
        if config.attention_bias:
            layer.update(bq=(q,), bk=(kv,), bv=(kv,))
        for name, shape in layer.items():
            shapes[f"layers.{i}.{name}"] = shape
    return shapes


# ---------------------------------------------------------------------------- building blocks
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


def duplicate_mask(indices: jax.Array) -> jax.Array:
    """``[B, K]`` True where an index already occurred earlier in its row."""
    order = jnp.argsort(indices, axis=-1, stable=True)
    sorted_idx = jnp.take_along_axis(indices, order, axis=-1)
    dup_sorted = jnp.concatenate(
        [jnp.zeros_like(sorted_idx[:, :1], bool), sorted_idx[:, 1:] == sorted_idx[:, :-1]], axis=-1)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(dup_sorted, inverse, axis=-1)


def _attention_xla(config: ModelConfig, q, k_new, v_new, cache_k, cache_v, lengths, verify_indices, probe_local):
    """Attention of ``T`` new query rows over the history plus the new tokens.

    q ``[B, T, Hq, D]``; k_new/v_new ``[B, T, Hkv, D]``; cache_k/v ``[B, Hkv, S, D]``;
    lengths ``[B]`` (valid history); verify_indices ``[B, K]`` or None.
    Returns the output ``[B, T, Hq, D]`` and, for ``probe_local`` query heads, their history
    probabilities ``[B, P, T, S or K]``.
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
    scores_hist = jnp.einsum("bkgtd,bksd->bkgts", qg, keys, preferred_element_type=jnp.float32) * scale
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


def _attention_pallas(config: ModelConfig, q, k_new, v_new, cache_k, cache_v, lengths, verify_indices, probe_local):
    """Same contract as :func:`_attention_xla`, with the history part computed by the Pallas
    kernels and merged exactly with the new-token part (flash-decoding partials)."""
    from pallas_kernels.attention import (SPARSE_CHUNK, dense_history_partials, merged_history, pack_queries,
                                          sparse_history_partials)
    from pallas_kernels.reference import clean_indices, merge_partials, normalize, partial_from_scores

    interpret = config.attention_backend == "pallas-interpret"
    if not interpret and jax.default_backend() != "gpu":
        raise ValueError(f"attention_backend='pallas' lowers through Triton and needs a GPU; this platform is "
                         f"{jax.default_backend()!r}. Use 'xla' (reference) or 'pallas-interpret' (slow, for tests)")
    batch, steps, num_heads, dim = q.shape
    groups, kv_heads = config.queries_per_kv, config.num_kv_heads
    scale = 1.0 / np.sqrt(dim)
    used = groups * steps
    packed = pack_queries(q, kv_heads, scale)  # [B, Hkv, M, D], rows g * T + t
    # under a mesh, each device runs the kernel on its own [B/data, Hkv/tensor, S, D] cache blocks
    from jaxspec.parallel.sharding import per_device_kernel

    if verify_indices is None:
        history = per_device_kernel(functools.partial(dense_history_partials, interpret=interpret),
                                    packed, cache_k, cache_v, lengths)
        hist_valid, hist_keys = None, cache_k
    else:
        idx = clean_indices(verify_indices, lengths)
        pad = (-idx.shape[1]) % SPARSE_CHUNK
        idx_padded = jnp.pad(idx, ((0, 0), (0, pad)), constant_values=-1)
        history = per_device_kernel(functools.partial(sparse_history_partials, chunk=SPARSE_CHUNK, interpret=interpret),
                                    packed, cache_k, cache_v, idx_padded)
        hist_valid = idx >= 0
        hist_keys = jnp.take_along_axis(cache_k, jnp.where(hist_valid, idx, 0)[:, None, :, None], axis=2) \
            if probe_local else None
    history = merged_history(history, used)
    qg = packed[:, :, :used].reshape(batch, kv_heads, groups, steps, dim)
    kn = k_new.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    vn = v_new.transpose(0, 2, 1, 3)
    scores_new = jnp.einsum("bkgtd,bkud->bkgtu", qg, kn, preferred_element_type=jnp.float32)
    causal = jnp.tril(jnp.ones((steps, steps), bool))
    new_part = partial_from_scores(scores_new.reshape(batch, kv_heads, used, steps),
                                   jnp.tile(causal, (groups, 1))[None, None], vn)
    total = merge_partials([history, new_part])
    out = normalize(total, q.dtype).reshape(batch, kv_heads, groups, steps, dim)
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


def attention(config: ModelConfig, q, k_new, v_new, cache_k, cache_v, lengths, verify_indices, probe_local):
    """History + new-token attention with the configured backend (``config.attention_backend``)."""
    if config.attention_backend == "xla":
        return _attention_xla(config, q, k_new, v_new, cache_k, cache_v, lengths, verify_indices, probe_local)
    return _attention_pallas(config, q, k_new, v_new, cache_k, cache_v, lengths, verify_indices, probe_local)


def mlp_block(layer, h, config):
    x = rms_norm(h, layer["mlp_norm"], config.rms_norm_eps)
    gate = jnp.einsum("btd,df->btf", x, layer["w_gate"])
    up = jnp.einsum("btd,df->btf", x, layer["w_up"])
    act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(h.dtype)
    return h + jnp.einsum("btf,fd->btd", act, layer["w_down"])


def project_qkv(layer, h, config, cos, sin):
    """Pre-norm, q/k/v projections (+ bias) and RoPE: ``q [B, T, Hq, D]``, ``k, v [B, T, Hkv, D]``."""
    batch, steps, _ = h.shape
    x = rms_norm(h, layer["attn_norm"], config.rms_norm_eps)
    q = jnp.einsum("btd,dq->btq", x, layer["wq"])
    k = jnp.einsum("btd,dk->btk", x, layer["wk"])
    v = jnp.einsum("btd,dk->btk", x, layer["wv"])
    if config.attention_bias:
        q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    q = apply_rope(q.reshape(batch, steps, config.num_heads, config.head_dim), cos, sin)
    k = apply_rope(k.reshape(batch, steps, config.num_kv_heads, config.head_dim), cos, sin)
    return q, k, v.reshape(batch, steps, config.num_kv_heads, config.head_dim)


def attention_block(layer, h, config, cos, sin, cache_k, cache_v, lengths, verify_indices, probe_local):
    """Pre-norm attention sub-layer. Returns (h + attn, k_new, v_new, probe queries, probe probs)."""
    batch, steps, _ = h.shape
    q, k, v = project_qkv(layer, h, config, cos, sin)
    out, probe_probs = attention(config, q, k, v, cache_k, cache_v, lengths, verify_indices, probe_local)
    h = h + jnp.einsum("btq,qd->btd", out.reshape(batch, steps, -1), layer["wo"])
    probe_q = q[:, :, jnp.asarray(probe_local)].astype(jnp.float32).transpose(0, 2, 1, 3) if probe_local else None
    return h, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), probe_q, probe_probs


# ---------------------------------------------------------------------------- forward
def _validate_static(config: ModelConfig, skip_mask, probe_heads):
    for layer, head in probe_heads:
        if not (0 <= layer < config.num_layers and 0 <= head < config.num_heads):
            raise ValueError(
                f"probe head (layer={layer}, head={head}) out of range: layers 0..{config.num_layers - 1}, "
                f"query heads 0..{config.num_heads - 1}")
    if skip_mask is not None:
        shape = np.shape(skip_mask)
        if shape != (config.num_layers, 2):
            raise ValueError(f"skip_mask shape {shape}; expected ({config.num_layers}, 2) = (layers, [attn, mlp])")


def forward(params, tokens, cache: KVCache, *, config: ModelConfig, skip_mask=None, verify_indices=None,
             probe_heads: ProbeHeads = (), positions=None, output_positions=None, return_hidden: bool = False):
    _validate_static(config, skip_mask, probe_heads)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, steps], got shape {tokens.shape}")
    batch, steps = tokens.shape
    if cache.batch_size != batch or cache.num_layers != config.num_layers:
        raise ValueError(f"cache has batch {cache.batch_size} and {cache.num_layers} layers; tokens have batch "
                         f"{batch} and the config {config.num_layers} layers")
    if verify_indices is not None and (verify_indices.ndim != 2 or verify_indices.shape[0] != batch):
        raise ValueError(f"verify_indices must be [batch={batch}, K], got shape {verify_indices.shape}")
    static_skip = isinstance(skip_mask, tuple) and all(
        isinstance(flag, (bool, np.bool_)) for pair in skip_mask for flag in pair)
    dynamic_skip = skip_mask is not None and not static_skip
    if dynamic_skip:
        skip_mask = jnp.asarray(skip_mask, bool)
    lengths = cache.lengths
    capacity = cache.capacity
    if positions is None:
        positions = lengths[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    cos, sin = rope_tables(config, positions)
    h = params["embed"][tokens].astype(config.jnp_dtype)

    probe_q = [None] * len(probe_heads)
    probe_p = [None] * len(probe_heads)
    new_keys, new_values = list(cache.keys), list(cache.values)
    for i, layer in enumerate(params["layers"]):
        local = tuple(hd for (ly, hd) in probe_heads if ly == i)
        slots_in_layer = [n for n, (ly, _) in enumerate(probe_heads) if ly == i]
        run_attn = functools.partial(attention_block, layer, config=config, cos=cos, sin=sin,
                                     cache_k=cache.keys[i], cache_v=cache.values[i], lengths=lengths,
                                     verify_indices=verify_indices, probe_local=local)
        with jax.named_scope(f"layer{i}"):
            if static_skip and skip_mask[i][0]:
                pass  # attention removed at trace time; nothing written to the cache
            else:
                if dynamic_skip:
                    def skipped(hh, _run=run_attn):
                        shapes = jax.eval_shape(_run, hh)
                        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[1:])
                        return (hh,) + tuple(zeros)

                    h, k_new, v_new, pq, pp = jax.lax.cond(skip_mask[i, 0], skipped, run_attn, h)
                    enabled = jnp.logical_not(skip_mask[i, 0])
                else:
                    h, k_new, v_new, pq, pp = run_attn(h)
                    enabled = True
                slots = write_positions(lengths, steps, capacity, enabled)
                new_keys[i] = scatter_rows(cache.keys[i], k_new, slots)
                new_values[i] = scatter_rows(cache.values[i], v_new, slots)
                for j, n in enumerate(slots_in_layer):
                    probe_q[n] = pq[:, j]
                    probe_p[n] = pp[:, j]
            if static_skip and skip_mask[i][1]:
                pass
            elif dynamic_skip:
                h = jax.lax.cond(skip_mask[i, 1], lambda hh: hh, functools.partial(mlp_block, layer, config=config), h)
            else:
                h = mlp_block(layer, h, config)

    if output_positions is not None:
        h = jnp.take_along_axis(h, output_positions[:, :, None].astype(jnp.int32), axis=1)
    final = rms_norm(h, params["final_norm"], config.rms_norm_eps)
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    logits = jnp.einsum("btd,dv->btv", final, head, preferred_element_type=jnp.float32)
    new_cache = KVCache(keys=tuple(new_keys), values=tuple(new_values), lengths=lengths + steps)
    probes = None
    if probe_heads:
        probes = _assemble_probes(probe_q, probe_p, probe_heads, batch, steps, config, verify_indices, capacity)
    return ForwardOutput(logits=logits, cache=new_cache, probes=probes, hidden=h if return_hidden else None)


def _assemble_probes(probe_q, probe_p, probe_heads, batch, steps, config, verify_indices, capacity):
    hist = capacity if verify_indices is None else verify_indices.shape[1]
    qs = [q if q is not None else jnp.zeros((batch, steps, config.head_dim), jnp.float32) for q in probe_q]
    ps = [p if p is not None else jnp.zeros((batch, steps, hist), jnp.float32) for p in probe_p]
    return Probes(queries=jnp.stack(qs, axis=1), history_probs=jnp.stack(ps, axis=1))


forward_jit = jax.jit(forward, static_argnames=("config", "probe_heads", "return_hidden"))
forward_jit.__doc__ = "The jitted form of :func:`forward` (config, probe_heads and return_hidden are static)."


def freeze_skip_mask(mask) -> Tuple[Tuple[bool, bool], ...]:
    """Turn a ``[L, 2]`` bool mask into the static (recompiling) form ``((attn, mlp), ...)``."""
    return tuple((bool(a), bool(m)) for a, m in np.asarray(mask, bool))


def forward_static_skip(params, tokens, cache, *, config, skip_mask, **kwargs):
    """``forward`` with a static skip mask (sub-layers removed at trace time; one compile per mask)."""
    return _forward_static(params, tokens, cache, config=config, skip_mask=freeze_skip_mask(skip_mask), **kwargs)


_forward_static = jax.jit(forward, static_argnames=("config", "probe_heads", "return_hidden", "skip_mask"))


def param_bytes(params) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))


def param_count(params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


def cast_params(params, config: ModelConfig):
    """Cast float params to ``config.dtype`` (norm weights stay float32)."""
    dtype = config.jnp_dtype

    def cast(path, x):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            return jnp.asarray(x, jnp.float32)
        return jnp.asarray(x, dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


def layer_names(config: ModelConfig) -> Sequence[str]:
    return [f"layers.{i}" for i in range(config.num_layers)]
