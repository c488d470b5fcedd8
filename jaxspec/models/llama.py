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
  to these cache slots (one set per sequence, docs/methods.md §3.2). Negative, out-of-range
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

The forward is assembled from the blocks of :mod:`jaxspec.models.layers` (embedding, decoder
layers, LM head; ``jax.named_scope`` ``layer{i}/attention`` and ``layer{i}/mlp`` in profiles);
the parameters are :class:`~jaxspec.models.params.ModelParams`, the attention backend is
``config.attention_backend`` (:mod:`jaxspec.models.attention`).

Bad input raises ``ValueError`` before any work: params whose shapes do not match ``config``,
non-integer token ids, and -- when the values are concrete -- ids outside the vocabulary and a
write past the cache capacity (``CacheOverflowError``). Under ``jit`` the values are traced:
an out-of-range id gathers a clamped embedding row and K/V past the capacity are dropped
(the logits are then wrong), so check on the host first, as :func:`forward_jit` does.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.models.cache import KVCache, check_room, is_concrete, scatter_rows, write_positions
from jaxspec.models.layers import (apply_rope, attention_sublayer, decoder_layer, default_positions, embed,
                                   lm_head, mlp_sublayer, project_qkv, rms_norm, rope_tables)
from jaxspec.models.params import (LayerParams, ModelParams, cast_params, check_param_shapes,
                                   expected_param_shapes, fuse_projections, init_params, param_bytes, param_count,
                                   unfuse_projections)

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
    # write_cache=False: (keys, values), each a tuple over layers of the new tokens' [B, Hkv, T, D]
    new_kv: Optional[Tuple[Tuple[jax.Array, ...], Tuple[jax.Array, ...]]] = None
    # return_states=True: the residual stream [2L + 1, B, T, H] at every sub-layer boundary (the embedding, then
    # after each layer's Attention and after its MLP), as jaxspec.knapspec.dp.boundary_states computes it
    states: Optional[jax.Array] = None


# ---------------------------------------------------------------------------- forward
def check_tokens(tokens, config: ModelConfig) -> None:
    """Token ids must be an integer ``[B, T]`` array; when concrete (not traced), within
    ``[0, vocab_size)`` (out-of-range ids would silently gather a clamped embedding row)."""
    dtype = getattr(tokens, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"tokens must be integer token ids, got dtype {dtype}; convert with "
                         f"jnp.asarray(tokens, jnp.int32)")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, steps], got shape {tokens.shape}")
    if not is_concrete(tokens) or tokens.size == 0:
        return
    values = np.asarray(tokens)
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= config.vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} out of range for vocab_size={config.vocab_size} of {config.name!r}; "
                         f"valid ids: 0..{config.vocab_size - 1}")


def check_cache_room(cache: KVCache, steps: int) -> None:
    """When ``cache.lengths`` is concrete, raise :class:`~jaxspec.models.cache.CacheOverflowError`
    if a row cannot take ``steps`` more tokens (under ``jit`` the lengths are traced: the
    caller checks on the host, as the decoding entry points do with ``check_room``)."""
    if not is_concrete(cache.lengths):
        return
    check_room(cache.lengths, cache.capacity, steps, what="forward")


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


def forward(params: ModelParams, tokens, cache: KVCache, *, config: ModelConfig, skip_mask=None,
            verify_indices=None, probe_heads: ProbeHeads = (), positions=None, output_positions=None,
            return_hidden: bool = False, write_cache: bool = True, return_states: bool = False) -> ForwardOutput:
    """The forward of ``tokens [B, T]`` appended to ``cache`` (see the module docstring).

    ``write_cache=False``: the attention reads the cache and the new tokens as usual, but their K/V are
    returned in ``new_kv`` instead of written (the returned cache holds the old buffers, its lengths
    advanced by ``T``); :func:`write_new_kv` writes them.

    Checks (before any work): params' shapes against ``config`` (static), token ids' dtype
    and, when concrete, their range; when ``cache.lengths`` is concrete, that every row has
    room for ``T`` more tokens (``CacheOverflowError``). Under ``jit`` the lengths are traced
    and a write past the capacity is dropped (the logits are then wrong): call
    ``jaxspec.models.cache.check_room`` on the host first, or use :func:`forward_jit`, whose
    host wrapper checks.
    """
    _validate_static(config, skip_mask, probe_heads)
    check_param_shapes(params, config)
    check_tokens(tokens, config)
    batch, steps = tokens.shape
    if cache.batch_size != batch or cache.num_layers != config.num_layers:
        raise ValueError(f"cache has batch {cache.batch_size} and {cache.num_layers} layers; tokens have batch "
                         f"{batch} and the config {config.num_layers} layers")
    check_cache_room(cache, steps)
    if verify_indices is not None and (verify_indices.ndim != 2 or verify_indices.shape[0] != batch):
        raise ValueError(f"verify_indices must be [batch={batch}, K], got shape {verify_indices.shape}")
    static_skip = isinstance(skip_mask, tuple) and all(
        isinstance(flag, (bool, np.bool_)) for pair in skip_mask for flag in pair)
    dynamic_skip = skip_mask is not None and not static_skip
    if dynamic_skip:
        skip_mask = jnp.asarray(skip_mask, bool)
    lengths = cache.lengths
    history = cache.read_lengths  # what the attention reads: 1 slot for a frozen (finished) row
    capacity = cache.capacity
    if positions is None:
        positions = default_positions(lengths, steps)
    cos, sin = rope_tables(config, positions)
    h = embed(params, tokens, config)

    boundaries = [h] if return_states else None
    probe_q = [None] * len(probe_heads)
    probe_p = [None] * len(probe_heads)
    new_keys, new_values = list(cache.keys), list(cache.values)
    rows_k, rows_v = [], []
    for i, layer in enumerate(params.layers):
        local = tuple(hd for (ly, hd) in probe_heads if ly == i)
        if static_skip:
            skip_attn, skip_mlp = bool(skip_mask[i][0]), bool(skip_mask[i][1])
        elif dynamic_skip:
            skip_attn, skip_mlp = skip_mask[i, 0], skip_mask[i, 1]
        else:
            skip_attn = skip_mlp = False
        with jax.named_scope(f"layer{i}"):
            out = decoder_layer(layer, h, config, cos, sin, cache.keys[i], cache.values[i], lengths,
                                verify_indices, local, skip_attn=skip_attn, skip_mlp=skip_mlp,
                                history_lengths=history, write_cache=write_cache)
        h, new_keys[i], new_values[i] = out.hidden, out.cache_k, out.cache_v
        if return_states:
            boundaries += [out.attention_hidden, out.hidden]
        if not write_cache:
            rows_k.append(out.new_keys)
            rows_v.append(out.new_values)
        if out.probe_queries is not None:
            for j, n in enumerate(n for n, (ly, _) in enumerate(probe_heads) if ly == i):
                probe_q[n] = out.probe_queries[:, j]
                probe_p[n] = out.probe_probs[:, j]

    if output_positions is not None:
        h = jnp.take_along_axis(h, output_positions[:, :, None].astype(jnp.int32), axis=1)
    logits = lm_head(params, h, config)
    new_cache = KVCache(keys=tuple(new_keys), values=tuple(new_values), lengths=lengths + steps, frozen=cache.frozen)
    probes = None
    if probe_heads:
        probes = _assemble_probes(probe_q, probe_p, probe_heads, batch, steps, config, verify_indices, capacity)
    return ForwardOutput(logits=logits, cache=new_cache, probes=probes, hidden=h if return_hidden else None,
                         new_kv=None if write_cache else (tuple(rows_k), tuple(rows_v)),
                         states=jnp.stack(boundaries) if return_states else None)


def write_new_kv(cache: KVCache, new_kv, start, enabled=True) -> KVCache:
    """Write a ``forward(..., write_cache=False)``'s ``new_kv`` (``T`` tokens a row) into ``cache`` at slots
    ``start [B] ..``; ``enabled`` (bool, broadcast to ``[B, T]``): where false, that token writes nothing.
    Returns the cache with those buffers and lengths ``start + T``."""
    keys, values = new_kv
    steps = keys[0].shape[2]
    slots = write_positions(start, steps, cache.capacity, enabled)
    return KVCache(keys=tuple(scatter_rows(c, k, slots) for c, k in zip(cache.keys, keys)),
                   values=tuple(scatter_rows(c, v, slots) for c, v in zip(cache.values, values)),
                   lengths=start + steps, frozen=cache.frozen)


def _assemble_probes(probe_q, probe_p, probe_heads, batch, steps, config, verify_indices, capacity):
    hist = capacity if verify_indices is None else verify_indices.shape[1]
    qs = [q if q is not None else jnp.zeros((batch, steps, config.head_dim), jnp.float32) for q in probe_q]
    ps = [p if p is not None else jnp.zeros((batch, steps, hist), jnp.float32) for p in probe_p]
    return Probes(queries=jnp.stack(qs, axis=1), history_probs=jnp.stack(ps, axis=1))


#: ``jax.jit`` of :func:`forward` (no host-side checks); :func:`forward_jit` checks, then calls it.
forward_compiled = jax.jit(forward, static_argnames=("config", "probe_heads", "return_hidden"))


def forward_jit(params: ModelParams, tokens, cache: KVCache, *, config: ModelConfig, **options) -> ForwardOutput:
    """The jitted form of :func:`forward` (``config``, ``probe_heads`` and ``return_hidden`` are
    static). Its host wrapper checks token ids and cache room on the concrete inputs first."""
    check_tokens(tokens, config)
    check_cache_room(cache, np.shape(tokens)[1])
    return forward_compiled(params, tokens, cache, config=config, **options)


def freeze_skip_mask(mask) -> Tuple[Tuple[bool, bool], ...]:
    """Turn a ``[L, 2]`` bool mask into the static (recompiling) form ``((attn, mlp), ...)``."""
    return tuple((bool(a), bool(m)) for a, m in np.asarray(mask, bool))


def forward_static_skip(params, tokens, cache, *, config, skip_mask, **kwargs):
    """``forward`` with a static skip mask (sub-layers removed at trace time; one compile per mask)."""
    check_tokens(tokens, config)
    check_cache_room(cache, np.shape(tokens)[1])
    return forward_static_jit(params, tokens, cache, config=config, skip_mask=freeze_skip_mask(skip_mask), **kwargs)


#: :func:`forward` jitted with the skip mask static too (one compile per distinct mask).
forward_static_jit = jax.jit(forward, static_argnames=("config", "probe_heads", "return_hidden", "skip_mask"))


def layer_names(config: ModelConfig) -> Sequence[str]:
    return [f"layers.{i}" for i in range(config.num_layers)]


__all__ = ["ForwardOutput", "LayerParams", "ModelParams", "ProbeHeads", "Probes", "apply_rope", "attention_sublayer",
           "cast_params", "check_cache_room", "check_param_shapes", "check_tokens", "decoder_layer", "embed",
           "expected_param_shapes", "forward", "forward_compiled", "forward_jit", "forward_static_jit",
           "forward_static_skip", "freeze_skip_mask", "fuse_projections", "init_params", "is_concrete", "layer_names",
           "lm_head", "mlp_sublayer", "param_bytes", "param_count", "project_qkv", "rms_norm", "rope_tables",
           "unfuse_projections"]
