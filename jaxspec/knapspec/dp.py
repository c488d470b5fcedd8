"""KnapSpec's knapsack DP on the model (docs/methods.md §4.3): the target's states of the reference window, the
DP over its sub-layers, the candidates' acceptance estimates, and the references the DP is tested against.

The DP itself (weights, values, transitions, the scan, the unrolled loop, the Python loop and brute force) is
model-independent and lives in :mod:`jaxspec.knapspec.knapsack`; this module re-exports it. Here the sub-layers
are the model's:

* :func:`knapsack_dp` -- :func:`~jaxspec.knapspec.knapsack.dp_scan` (or, ``layers="unrolled"``,
  :func:`~jaxspec.knapspec.knapsack.dp_unrolled`) over the model's layers, the attention *branch-parallel*:
  every branch's ``r`` query rows attend to the true full-model prefix KV cache of that layer (``prefix_len``
  valid slots) plus the branch's own new K/V, causally -- exactly
  :func:`jaxspec.models.layers.attention_sublayer`, ``vmap``-ed over branches (the cache is shared, not
  copied); ``branch_chunk`` bounds memory with ``lax.map(batch_size=...)``. With ``history_backend`` (a kernel
  backend, e.g. ``"pallas"`` on a GPU) the branches are folded into the query rows instead: the backend's
  history kernel serves all ``J x r`` rows of a row's cache with an online softmax (one read of the cache per
  block of query rows), and each branch's own new K/V are merged in exactly (:func:`branch_folded_attention`);
  the vmap-ed reference materialises ``J x Hq x r x S`` float32 scores per layer, several passes of which
  dominate the DP at long context. With ``reference_kv="target"`` (:data:`REFERENCE_KV`) a branch's row ``t``
  attends instead to the target's K/V of rows ``< t`` and to its own only at ``t``
  (:func:`target_kv_attention`; the target's K/V of a layer are projected once from its boundary state, for
  all branches).
* :func:`boundary_states`, :func:`window_prefill` -- the target's residual stream of the window;
* :func:`plan_alpha`, :func:`plan_agreement` -- fixed plans' statistics;
* :func:`knapsack_dp_reference`, :func:`knapsack_brute_force` -- the Python-loop DP and exhaustive search on
  the model.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.knapspec.knapsack import (DEFAULT_SEGMENTS, DEFAULT_TAU, DPTrace, DP_LAYERS, REFERENCE_KV, WEIGHT_CAP,
                                       backtrack, brute_force, check_keep_attention, cos_sum, dp_loop, dp_scan,
                                       dp_unrolled, knapsack_weights, per_sublayer_can_skip, scan_can_skip, skip_budget,
                                       slot_segments, sublayer_can_skip, transition)
from jaxspec.models.attention import batchable_config, get_backend, grouped_key_scores
from jaxspec.models.cache import KVCache
from jaxspec.models.layers import (attention_sublayer, decoder_layer, default_positions, embed, lm_head, mlp_sublayer,
                                   project_qkv, rope_tables)


# ---------------------------------------------------------------------------- model plumbing
def check_reference_kv(reference_kv: str) -> str:
    if reference_kv not in REFERENCE_KV:
        raise ValueError(f"reference_kv={reference_kv!r}: choose from {', '.join(map(repr, REFERENCE_KV))}")
    return reference_kv


def target_kv_attention(config: ModelConfig, q, k_new, v_new, cache_k, cache_v, lengths, k_ref, v_ref):
    """Attention of ``T`` reference rows (``reference_kv="target"``): row ``t`` attends to the first
    ``lengths[b]`` cache slots, to the target's K/V ``k_ref, v_ref [B, T, Hkv, D]`` of rows ``< t``
    and to its own (the candidate's) ``k_new, v_new`` at ``t``. ``q [B, T, Hq, D]``; returns
    ``[B, T, Hq, D]`` (jnp, float32 softmax, the same GQA layout as the reference attention)."""
    batch, steps, num_heads, dim = q.shape
    groups = config.queries_per_kv
    scale = 1.0 / np.sqrt(dim)
    qg = q.reshape(batch, steps, config.num_kv_heads, groups, dim).transpose(0, 2, 3, 1, 4)  # [B,Hkv,G,T,D]
    valid = jnp.arange(cache_k.shape[2])[None, :] < lengths[:, None]  # [B, S]
    s_hist = grouped_key_scores(cache_k, qg) * scale
    s_hist = jnp.where(valid[:, None, None, None, :], s_hist, -jnp.inf)
    kr, vr = k_ref.transpose(0, 2, 1, 3), v_ref.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    kn, vn = k_new.transpose(0, 2, 1, 3), v_new.transpose(0, 2, 1, 3)
    s_ref = jnp.einsum("bkgtd,bkud->bkgtu", qg, kr, preferred_element_type=jnp.float32) * scale
    s_ref = jnp.where(jnp.tril(jnp.ones((steps, steps), bool), -1), s_ref, -jnp.inf)  # strictly earlier rows
    s_self = jnp.einsum("bkgtd,bktd->bkgt", qg, kn, preferred_element_type=jnp.float32)[..., None] * scale
    probs = jax.nn.softmax(jnp.concatenate([s_hist, s_ref, s_self], axis=-1), axis=-1)
    hist = cache_k.shape[2]
    p_hist, p_ref, p_self = probs[..., :hist], probs[..., hist:hist + steps], probs[..., hist + steps:]
    out = jnp.einsum("bkgts,bksd->bkgtd", p_hist.astype(q.dtype), cache_v, preferred_element_type=jnp.float32)
    out = out + jnp.einsum("bkgtu,bkud->bkgtd", p_ref.astype(q.dtype), vr, preferred_element_type=jnp.float32)
    out = out + p_self * vn[:, :, None].astype(jnp.float32)
    return out.astype(q.dtype).transpose(0, 3, 1, 2, 4).reshape(batch, steps, num_heads, dim)


def _layer_arg(params, cache: KVCache, states, i: int, reference_kv: str):
    """Layer ``i``'s argument of the sub-layer functions (:func:`_model_sublayers`)."""
    return (params.layers[i], cache.keys[i], cache.values[i]) + ((states[2 * i],) if reference_kv == "target" else ())


def reference_attention_inputs(states, num_layers: int):
    """The target's input to the Attention sub-layer of each scanned layer ``1 .. L-1`` (boundary
    ``2l``) from :func:`boundary_states`: ``[L - 1, B, r, H]``."""
    return states[2:2 * num_layers - 1:2]


def _rope(config: ModelConfig, prefix_len, steps: int):
    return rope_tables(config, default_positions(prefix_len.astype(jnp.int32), steps))


def _residual_stream(params, tokens, cache: KVCache, prefix_len, *, config: ModelConfig, write: bool):
    """The target's residual stream ``[2L + 1, B, r, H]`` of ``tokens`` at positions ``prefix_len ..``, each layer
    the model's own :func:`~jaxspec.models.layers.decoder_layer` (attending to the first ``prefix_len[b]`` slots
    and the tokens themselves, causally); with ``write`` their K/V are written at those slots as a prefill chunk
    writes them. Returns ``(states, keys, values)``: the cache's buffers (unchanged without ``write``)."""
    cos, sin = _rope(config, prefix_len, tokens.shape[1])
    h = embed(params, tokens, config)
    states, keys, values = [h], list(cache.keys), list(cache.values)
    for i, layer in enumerate(params.layers):
        with jax.named_scope(f"layer{i}"):
            out = decoder_layer(layer, h, config, cos, sin, cache.keys[i], cache.values[i], prefix_len,
                                write_cache=write)
        states += [out.attention_hidden, out.hidden]
        h, keys[i], values[i] = out.hidden, out.cache_k, out.cache_v
    return jnp.stack(states), keys, values


def _boundary_states_fn(params, tokens, cache: KVCache, prefix_len, *, config: ModelConfig):
    return _residual_stream(params, tokens, cache, prefix_len, config=config, write=False)[0]


_boundary_states = jax.jit(_boundary_states_fn, static_argnames=("config",))


def boundary_states(params, config: ModelConfig, tokens, cache: KVCache, prefix_len) -> jax.Array:
    """The target's residual stream ``[2L + 1, B, r, H]`` for ``tokens [B, r]`` at positions
    ``prefix_len[b] + 0 .. r-1``, attending to the first ``prefix_len[b]`` cache slots of each row
    plus themselves (causally). Nothing is written to the cache."""
    return _boundary_states(params, jnp.asarray(tokens, jnp.int32), cache, jnp.asarray(prefix_len, jnp.int32),
                            config=_dp_config(config))


def _window_prefill_fn(params, tokens, cache: KVCache, prefix_len, counts, *, config: ModelConfig):
    """:func:`_boundary_states_fn` that also writes the tokens' K/V into ``cache`` (the prefill of a prompt's last
    tokens, docs/methods.md §5.6): the cache is the prefill's, and the residual stream between the sub-layers is
    kept. Padding tokens past a row's ``counts`` write beyond its new length, as a prefill's padding does."""
    states, keys, values = _residual_stream(params, tokens, cache, prefix_len, config=config, write=True)
    last = jnp.take_along_axis(states[-1], jnp.maximum(counts - 1, 0)[:, None, None].astype(jnp.int32), axis=1)[:, 0]
    new_cache = KVCache(keys=tuple(keys), values=tuple(values), lengths=prefix_len + counts, frozen=cache.frozen)
    return states, new_cache, lm_head(params, last, config)


_window_prefill = jax.jit(_window_prefill_fn, static_argnames=("config",), donate_argnames=("cache",))


def window_prefill(params, config: ModelConfig, tokens, cache: KVCache, prefix_len, counts):
    """Prefill ``tokens [B, r]`` (row ``b``'s first ``counts[b]`` valid, right-padded) at slots
    ``prefix_len[b] ..`` of ``cache`` (donated) and keep their residual stream. Returns
    ``(states [2L + 1, B, r, H], cache with lengths prefix_len + counts, logits [B, V] at each row's
    last valid token)``. ``states`` equal :func:`boundary_states` of the same tokens before the write."""
    return _window_prefill(params, jnp.asarray(tokens, jnp.int32), cache, jnp.asarray(prefix_len, jnp.int32),
                           jnp.asarray(counts, jnp.int32), config=config)


def _dp_config(config: ModelConfig) -> ModelConfig:
    # the DP vmaps attention over branches: a backend that cannot run batched falls back to the
    # reference attention
    return batchable_config(config)


def _head_argmax(params, config: ModelConfig, states):
    return jnp.argmax(lm_head(params, states, config), axis=-1)


#: reference rows (candidates x batch rows x tokens) scored per pass of the LM head when the candidates per pass are
#: not given: the head's weights are read once per pass, so passes of a few rows each (8 candidates of a two-stage
#: plan's 2 search tokens: 16 rows) re-read the whole head ~9 times per DP, a large share of the DP of
#: Qwen2.5-Coder-1.5B on a 2-core CPU; 512 rows of float32 logits of a 152k vocabulary are ~0.3 GB
AGREEMENT_ROWS = 512


def agreement_chunk(final_states, chunk: Optional[int] = None) -> int:
    """Candidates per LM-head pass of :func:`_agreement` for ``final_states [C, B, r, H]``: ``chunk`` when given,
    else as many as fill :data:`AGREEMENT_ROWS` rows (at least 1, at most ``C``)."""
    if chunk is not None:
        if isinstance(chunk, bool) or int(chunk) < 1:
            raise ValueError(f"alpha_chunk={chunk!r} must be a positive number of candidates per pass (or None)")
        return int(chunk)
    rows = max(int(np.prod(final_states.shape[1:-1])), 1)
    return int(min(max(AGREEMENT_ROWS // rows, 1), max(final_states.shape[0], 1)))


def _agreement(params, config, final_states, teacher_state, token_mask, chunk: Optional[int],
               threshold: Optional[float]):
    """Per candidate, over the masked reference tokens: ``[J, 3]`` = (alpha: greedy agreement with
    the target; p_c: share of tokens whose greedy probability is >= ``threshold``, i.e. where the
    draft would not exit early; p_ac: share both agreeing and confident). ``threshold`` None: no
    early exit (p_c = 1, p_ac = alpha). ``chunk``: candidates per pass of the LM head (None:
    :func:`agreement_chunk`)."""
    teacher = jnp.argmax(lm_head(params, teacher_state, config), -1)
    mask = jnp.asarray(token_mask, jnp.float32)
    denom = jnp.maximum(jnp.sum(mask), 1.0)

    def one(state):
        logits = lm_head(params, state, config)
        agree = (jnp.argmax(logits, -1) == teacher).astype(jnp.float32) * mask
        if threshold is None:
            confident = mask
        else:  # greedy probability = exp(max logit - logsumexp)
            top = jnp.max(logits, -1)
            confident = (jnp.exp(top - jax.nn.logsumexp(logits, -1)) >= threshold).astype(jnp.float32) * mask
        return jnp.stack([jnp.sum(agree), jnp.sum(confident), jnp.sum(agree * confident)]) / denom

    return jax.lax.map(one, final_states, batch_size=agreement_chunk(final_states, chunk))


# compiled once per shape: run eagerly, the map over candidates re-traced and dispatched op by op on
# every call (~0.13 s per rescore of SmolLM2 on a 2-core CPU, whatever the window's width)
_agreement_jit = jax.jit(_agreement, static_argnums=(1, 5, 6))


def _alpha(params, config, final_states, teacher_state, token_mask, chunk: Optional[int] = None):
    """Greedy agreement of each candidate's final state with the target's, over the masked tokens."""
    return _agreement(params, config, final_states, teacher_state, token_mask, chunk, None)[:, 0]


def branch_folded_attention(config: ModelConfig, backend: str, q, k_new, v_new, cache_k, cache_v, lengths,
                            max_rows: Optional[int] = None):
    """The DP's branch-parallel attention with the branches folded into the query rows: ``q [J, B, r, Hq, D]``
    and each branch's own ``k_new, v_new [J, B, r, Hkv, D]``; every branch's rows attend to the first
    ``lengths[b]`` slots of the shared ``cache_k/v [B, Hkv, S, D]`` and causally to their own branch's new
    K/V. Returns ``[J, B, r, Hq, D]``, what :func:`jaxspec.models.layers.attention_sublayer`'s attention
    gives per branch. The history part is ``backend``'s history kernel over all ``J x r`` rows (no scores
    written; the cache read once per block of query rows), merged with each branch's new-token part by
    their softmax statistics (docs/methods.md §4.3). ``max_rows``: query rows per kernel call (a power of
    two >= 16; default the kernel's ``MAX_QUERY_ROWS``), each call one read of the cache."""
    from pallas_kernels import attention as kernels
    from pallas_kernels import reference

    branches, batch, steps, num_heads, dim = q.shape
    kv_heads, groups = config.num_kv_heads, config.queries_per_kv
    rows = branches * steps  # per KV group: row j * r + t
    folded = q.transpose(1, 0, 2, 3, 4).reshape(batch, rows, num_heads, dim)
    packed = kernels.pack_queries(folded, kv_heads, 1.0 / np.sqrt(dim))  # [B, Hkv, >= G * J * r, D]
    used = groups * rows
    chosen = get_backend(backend)
    if max_rows is None:
        partials = chosen.dense_history_partials(packed, cache_k, cache_v, lengths)
    else:
        partials = kernels.dense_history_partials(packed, cache_k, cache_v, lengths, interpret=chosen.interpret,
                                                  max_rows=int(max_rows))
    history = kernels.merged_history(partials, used)
    qg = packed[:, :, :used].reshape(batch, kv_heads, groups, branches, steps, dim)
    kn = k_new.transpose(1, 3, 0, 2, 4)  # [B, Hkv, J, r, D]
    vn = v_new.transpose(1, 3, 0, 2, 4)
    scores = jnp.einsum("bkgjtd,bkjud->bkjgtu", qg, kn, preferred_element_type=jnp.float32)
    causal = jnp.tril(jnp.ones((steps, steps), bool))
    acc, l, m = reference.partial_from_scores(scores, causal, vn[:, :, :, None])  # [B, Hkv, J, G, r, (D)]
    new_part = (acc.transpose(0, 1, 3, 2, 4, 5).reshape(batch, kv_heads, used, dim),
                l.transpose(0, 1, 3, 2, 4).reshape(batch, kv_heads, used),
                m.transpose(0, 1, 3, 2, 4).reshape(batch, kv_heads, used))
    out = reference.normalize(reference.merge_partials([history, new_part]), q.dtype)  # [B, Hkv, G*J*r, D]
    out = out.reshape(batch, kv_heads, groups, branches, steps, dim)
    return out.transpose(3, 0, 4, 1, 2, 5).reshape(branches, batch, steps, num_heads, dim)


def check_history_backend(history_backend: Optional[str], reference_kv: str = "branch",
                          branch_chunk: Optional[int] = None) -> Optional[str]:
    """``history_backend`` of :func:`knapsack_dp` checked: None for the reference attention (None or
    ``"xla"``), else the name of a backend with a history kernel that runs on this platform."""
    if history_backend is None or history_backend == "xla":
        return None
    backend = get_backend(history_backend)  # raises on an unknown name, listing the valid ones
    if not backend.opaque_kernel or backend.tpu_kernels:
        raise ValueError(f"history_backend={history_backend!r}: the DP folds its branches into a Triton history "
                         f"kernel; valid: 'pallas' (GPU), 'pallas-interpret' (any platform, slow), 'xla' or None "
                         f"(the reference attention)")
    if not backend.runs_on():
        raise ValueError(f"history_backend={history_backend!r} needs a GPU ({backend.description}); this platform "
                         f"is {jax.default_backend()!r}: valid here 'pallas-interpret' (slow) or 'xla' / None")
    if reference_kv != "branch":
        raise ValueError(f"history_backend={history_backend!r} folds the 'branch' reference's attention; "
                         f"reference_kv={reference_kv!r} runs the reference attention (leave history_backend None)")
    if branch_chunk:
        raise ValueError(f"history_backend={history_backend!r} runs every branch in one kernel call; "
                         f"branch_chunk={branch_chunk} (branches per batch) is for the reference attention")
    return history_backend


def _model_sublayers(config: ModelConfig, prefix_len, steps: int, branch_chunk: Optional[int],
                     reference_kv: str = "branch", history_backend: Optional[str] = None,
                     history_rows: Optional[int] = None):
    """Sub-layer functions of the model for the DP: single state and all-slots versions. A layer's
    argument is ``(layer, cache_k, cache_v)``, with ``reference_kv="target"`` also the target's input
    to its Attention sub-layer ``[B, r, H]`` (:func:`reference_attention_inputs`). ``history_backend``:
    the all-slots Attention folds the branches into one history-kernel call of that backend
    (:func:`branch_folded_attention`; the "branch" reference only)."""
    cos, sin = _rope(config, prefix_len, steps)
    check_reference_kv(reference_kv)

    def reference_kv_of(layer_x):  # the target's K/V of the reference tokens at this layer
        _, k, v = project_qkv(layer_x[0], layer_x[3], config, cos, sin)
        return k, v

    def attn(layer_x, h, ref_kv=None):
        layer, cache_k, cache_v = layer_x[:3]
        if reference_kv == "target":
            k_ref, v_ref = reference_kv_of(layer_x) if ref_kv is None else ref_kv
            attend = functools.partial(target_kv_attention, config, cache_k=cache_k, cache_v=cache_v,
                                       lengths=prefix_len, k_ref=k_ref, v_ref=v_ref)
        else:
            attend = None
        return attention_sublayer(layer, h, config, cos, sin, cache_k, cache_v, prefix_len, attend=attend).hidden

    def mlp(layer_x, h):
        return mlp_sublayer(layer_x[0], h, config)

    def attn_all(layer_x, g):  # branch-parallel: every branch attends to the shared prefix cache
        if history_backend is not None and reference_kv == "branch":
            layer, cache_k, cache_v = layer_x[:3]
            q, k, v = jax.vmap(lambda h: project_qkv(layer, h, config, cos, sin))(g)
            out = branch_folded_attention(config, history_backend, q, k, v, cache_k, cache_v, prefix_len,
                                          history_rows)
            return g + jnp.einsum("jbtq,qd->jbtd", out.reshape(g.shape[:3] + (-1,)), layer.wo)
        ref_kv = reference_kv_of(layer_x) if reference_kv == "target" else None  # once for all branches
        fn = functools.partial(attn, layer_x, ref_kv=ref_kv)
        if branch_chunk:
            return jax.lax.map(fn, g, batch_size=branch_chunk)
        return jax.vmap(fn)(g)

    def mlp_all(layer_x, g):
        return mlp(layer_x, g.reshape((-1,) + g.shape[2:])).reshape(g.shape)

    return attn, mlp, attn_all, mlp_all


_stack_layers = jax.jit(lambda layers: jax.tree.map(lambda *xs: jnp.stack(xs), *layers))
_STACKED: list = []  # [(params.layers tuple, its layers 1.. stacked)], newest last


def stacked_scan_layers(params, reuse: bool = True):
    """Layers ``1 .. L-1`` of ``params`` stacked along a leading axis (the scan's ``xs``).

    With ``reuse`` the stacked copy is kept for the same ``params.layers`` tuple object (the
    two most recent), so a re-plan does not copy every weight again (~0.4 GB for SmolLM2 in
    float32, ~0.1-0.2 s on a 2-core CPU per plan); the price is one extra copy of the layer
    weights in memory. A new or modified parameter tree (another tuple object) is stacked anew."""
    layers = params.layers
    if reuse:
        for held, stacked in _STACKED:
            if held is layers:
                return stacked
    stacked = _stack_layers(layers[1:])
    if reuse:
        _STACKED.append((layers, stacked))
        del _STACKED[:-2]
    return stacked


def _knapsack_dp_fn(params, stacked, cache: KVCache, prefix_len, states, token_mask, *, config, w_attn, w_mlp,
                    budget, tau, branch_chunk, alpha_chunk, exit_threshold=None, keep_attention=(),
                    reference_kv="branch", history_backend=None, history_rows=None, segments=None,
                    layers="scan"):
    """``layers="scan"``: :func:`dp_scan` over ``stacked`` (layers 1.. stacked) and a stacked copy of the cache;
    ``"unrolled"``: :func:`dp_unrolled` over ``params.layers`` and the cache's own arrays (``stacked`` unused)."""
    num_layers = config.num_layers
    _, _, attn_all, mlp_all = _model_sublayers(config, prefix_len, states.shape[2], branch_chunk, reference_kv,
                                               history_backend, history_rows)
    targets = states[3:].reshape((num_layers - 1, 2) + states.shape[1:])
    can = scan_can_skip(num_layers, keep_attention)
    refs = reference_attention_inputs(states, num_layers) if reference_kv == "target" else None
    if layers == "unrolled":
        def block_padded(x):  # the kernel walks the cache in blocks: pad where the capacity is off its block
            extra = get_backend(history_backend).round_capacity(x.shape[2]) - x.shape[2]
            return x if extra == 0 else jnp.pad(x, ((0, 0),) * 2 + ((0, extra), (0, 0)))

        fix = block_padded if history_backend is not None else (lambda x: x)
        args = [(params.layers[i], fix(cache.keys[i]), fix(cache.values[i])) + (() if refs is None else (refs[i - 1],))
                for i in range(1, num_layers)]
        values, skipped, valid, final = dp_unrolled(attn_all, mlp_all, args, states[2], targets, can, token_mask,
                                                    w_attn=w_attn, w_mlp=w_mlp, budget=budget, tau=tau)
    else:
        keys, values = jnp.stack(cache.keys[1:]), jnp.stack(cache.values[1:])
        if history_backend is not None:  # the kernel walks the cache in blocks: pad the stacked copy (slots unread)
            pad = get_backend(history_backend).round_capacity(keys.shape[3]) - keys.shape[3]
            keys, values = (jnp.pad(x, ((0, 0),) * 3 + ((0, pad), (0, 0))) for x in (keys, values))
        layer_xs = (stacked, keys, values) + (() if refs is None else (refs,))
        values, skipped, valid, final = dp_scan(attn_all, mlp_all, layer_xs, states[2], targets, jnp.asarray(can),
                                                token_mask, w_attn=w_attn, w_mlp=w_mlp, budget=budget, tau=tau,
                                                segments=segments)
    stats = _agreement(params, config, final, states[-1], token_mask, alpha_chunk, exit_threshold)
    return values, skipped, valid, stats, final


_knapsack_dp = jax.jit(_knapsack_dp_fn, static_argnames=("config", "w_attn", "w_mlp", "budget", "tau",
                                                          "branch_chunk", "alpha_chunk", "exit_threshold",
                                                          "keep_attention", "reference_kv", "history_backend",
                                                          "history_rows", "segments", "layers"))


@dataclasses.dataclass
class Candidates:
    """The DP's output: one candidate skip set per surviving final slot (ascending skipped weight)."""

    masks: np.ndarray  # [C, L, 2] bool, True = skip (column 0 Attention, column 1 MLP)
    weights: np.ndarray  # [C] skipped weight j of each candidate
    cosine: np.ndarray  # [C] mean cosine with the target's final state
    alpha: np.ndarray  # [C] greedy-token agreement with the target on the reference tokens
    w_attn: int
    w_mlp: int
    budget: int
    trace: Optional[DPTrace] = None
    final_states: Any = None  # [C, B, r, H] (kept only when asked)
    # early-exit statistics (knapsack_dp(exit_threshold=...)): share of reference tokens where the
    # candidate's greedy probability reaches the threshold, and where it also agrees with the target
    confident: Optional[np.ndarray] = None  # [C] p_c
    agree_confident: Optional[np.ndarray] = None  # [C] p_ac
    # a two-stage plan (jaxspec.knapspec.skip_planner.rescore_finalists): alpha on the search tokens the DP ran on,
    # and their number per row; alpha / confident / agree_confident are then the whole window's
    search_alpha: Optional[np.ndarray] = None  # [C]
    search_tokens: Optional[int] = None
    # how the finalists were scored on the window: "executed" (conditionals) or "select" (policy.KnapSpecConfig.rescore)
    rescore: Optional[str] = None
    # the backend the DP's branch attention folded into (knapsack_dp's history_backend; None: the reference)
    history_backend: Optional[str] = None
    # wall seconds of each part of the plan that produced these candidates (policy.plan_skip_set:
    # boundary_states, dp, grid_search, rescore), None when not recorded
    stage_seconds: Optional[Dict[str, float]] = None

    def __len__(self) -> int:
        return len(self.weights)


def _trivial_candidates(params, config, states, token_mask, w_attn, w_mlp, budget) -> Candidates:
    return Candidates(masks=np.zeros((1, config.num_layers, 2), bool), weights=np.zeros(1, int),
                      cosine=np.ones(1), alpha=np.ones(1), w_attn=w_attn, w_mlp=w_mlp, budget=budget)


def knapsack_dp(params, config: ModelConfig, cache: KVCache, prefix_len, states, token_mask=None, *, w_attn: int,
                w_mlp: int, budget: Optional[int] = None, tau: float = DEFAULT_TAU, branch_chunk: Optional[int] = None,
                alpha_chunk: Optional[int] = None, keep_states: bool = False, reuse_stacked: bool = True,
                exit_threshold: Optional[float] = None, keep_attention: Sequence[int] = (),
                reference_kv: str = "branch", history_backend: Optional[str] = None,
                history_rows: Optional[int] = None, segments: int = DEFAULT_SEGMENTS,
                layers: str = "scan") -> Candidates:
    """Run the jit-compiled, scan-vectorised DP on the model.

    ``reuse_stacked``: keep the stacked layer weights between calls (:func:`stacked_scan_layers`).

    ``cache``: the target cache whose first ``prefix_len[b]`` slots of row ``b`` hold the
    full-model K/V of the prefix (later slots are ignored); ``states [2L+1, B, r, H]`` from
    :func:`boundary_states` for the reference tokens at positions ``prefix_len + 0..r-1``;
    ``token_mask [B, r]`` (default all ones) marks real reference tokens (padding = 0).
    ``exit_threshold``: also return each candidate's early-exit statistics at this draft
    confidence (``Candidates.confident`` / ``agree_confident``; for the exit-aware TPT).
    ``keep_attention``: layers whose Attention sub-layer no candidate skips (module doc).
    ``reference_kv``: how the reference tokens see one another (:data:`REFERENCE_KV`).
    ``history_backend``: an attention backend with a history kernel (``"pallas"`` on a GPU,
    ``"pallas-interpret"`` anywhere, for tests) that the branch-parallel Attention folds all branches
    into (:func:`branch_folded_attention`); None or ``"xla"``: the ``vmap``-ed reference attention.
    ``history_rows``: with ``history_backend``, query rows per kernel call (a power of two >= 16; default
    the kernel's); each call reads the cache once.
    ``segments``: the scan in at most this many runs of layers, each over the slots it can reach
    (:func:`slot_segments`; the same result, fewer slot-layers computed, one compiled body per run); 1 = one
    scan of every slot.
    ``alpha_chunk``: candidates per pass of the LM head that scores them (None: :data:`AGREEMENT_ROWS` rows a pass).
    ``layers``: :data:`DP_LAYERS` -- ``"scan"`` (:func:`dp_scan` over the stacked layers, in ``segments`` runs) or
    ``"unrolled"`` (:func:`dp_unrolled`: one traced step per layer on the model's own weights, each sub-layer on
    the slots it can reach; no stacked copy, ``segments`` unused). The same candidates either way.
    """
    if layers not in DP_LAYERS:
        raise ValueError(f"layers={layers!r}; valid: {', '.join(DP_LAYERS)}")
    config = _dp_config(config)
    keep_attention = check_keep_attention(keep_attention, config.num_layers)
    check_reference_kv(reference_kv)
    history_backend = check_history_backend(history_backend, reference_kv, branch_chunk)
    if history_rows is not None:
        if history_backend is None:
            raise ValueError(f"history_rows={history_rows} sets the kernel's rows per call: it needs a "
                             f"history_backend (the reference attention has no kernel)")
        if isinstance(history_rows, bool) or int(history_rows) < 16 or int(history_rows) & (int(history_rows) - 1):
            raise ValueError(f"history_rows={history_rows} must be a power of two >= 16")
    budget = skip_budget(w_attn, w_mlp, config.num_layers) if budget is None else int(budget)
    if isinstance(segments, bool) or int(segments) < 1:
        raise ValueError(f"segments={segments!r} must be an integer >= 1 (1: one scan of every slot)")
    if alpha_chunk is not None:
        agreement_chunk(states, alpha_chunk)  # a bad value fails here, before anything is compiled
    token_mask = jnp.ones(states.shape[1:3], jnp.float32) if token_mask is None else jnp.asarray(token_mask,
                                                                                                  jnp.float32)
    if config.num_layers < 2:
        return _trivial_candidates(params, config, states, token_mask, w_attn, w_mlp, budget)
    outer = params.replace(layers=())  # the scan gets the layers stacked
    values, skipped, valid, stats, final = _knapsack_dp(
        params if layers == "unrolled" else outer,
        None if layers == "unrolled" else stacked_scan_layers(params, reuse_stacked), cache,
        jnp.asarray(prefix_len, jnp.int32), states,
        token_mask, config=config, w_attn=int(w_attn), w_mlp=int(w_mlp), budget=budget, tau=float(tau),
        branch_chunk=branch_chunk, alpha_chunk=alpha_chunk,
        exit_threshold=None if exit_threshold is None else float(exit_threshold), keep_attention=keep_attention,
        reference_kv=reference_kv, history_backend=history_backend,
        history_rows=None if history_rows is None else int(history_rows),
        segments=None if layers == "unrolled" else slot_segments(scan_can_skip(config.num_layers, keep_attention),
                                                                 int(w_attn), int(w_mlp), budget, int(segments)),
        layers=layers)
    trace = DPTrace(np.asarray(values, np.float64), np.asarray(skipped), np.asarray(valid), first_layer=1)
    masks, slots = backtrack(trace, config.num_layers, w_attn, w_mlp)
    denom = max(float(np.asarray(token_mask).sum()), 1.0)
    stats = np.asarray(stats, np.float64)[slots]
    exits = exit_threshold is not None
    return Candidates(masks=masks, weights=slots, cosine=trace.final_values[slots] / denom,
                      alpha=stats[:, 0], w_attn=int(w_attn), w_mlp=int(w_mlp), budget=budget,
                      trace=trace, final_states=np.asarray(final)[slots] if keep_states else None,
                      confident=stats[:, 1] if exits else None, agree_confident=stats[:, 2] if exits else None,
                      history_backend=history_backend)


# ---------------------------------------------------------------------------- fixed plans
def _plan_states_fn(params, cache: KVCache, prefix_len, states, masks, *, config, reference_kv, executed_only=True):
    """Each mask's final state on the reference tokens. ``executed_only``: a sub-layer runs only where
    the mask executes it after an earlier skip (``lax.cond``): a skipped one passes its input on, and
    one before the mask's first skip sees the target's own input, so its output is the target's
    boundary state, read from ``states``. The cost is the executed sub-layers after the first skip,
    not the whole model, but a GPU reads each conditional's predicate on the host (2L round trips per
    mask). ``False``: every sub-layer of every mask runs, all masks in one ``vmap``, and a select keeps
    or drops it: more arithmetic, no control flow (the reference, and
    :attr:`~jaxspec.knapspec.config.KnapSpecConfig.rescore` ``"select"``)."""
    attn, mlp, _, _ = _model_sublayers(config, prefix_len, states.shape[2], None, reference_kv)

    def one(mask):
        h = states[0]
        diverged = jnp.asarray(False)
        for i in range(config.num_layers):
            x = _layer_arg(params, cache, states, i, reference_kv)
            for col, fn in ((0, attn), (1, mlp)):
                skip = mask[i, col]
                if not executed_only:
                    h = jnp.where(skip, h, fn(x, h))
                    continue
                target = states[2 * i + 1 + col]
                run = jnp.logical_and(diverged, jnp.logical_not(skip))
                h = jax.lax.cond(run, lambda x=x, h=h, fn=fn: fn(x, h),
                                 lambda h=h, skip=skip, target=target: jnp.where(skip, h, target))
                diverged = jnp.logical_or(diverged, skip)
        return h

    # with executed_only the conditionals need one mask at a time; the select form has no control flow, so every
    # mask runs in one batched pass (the weights read once for all of them)
    return jax.lax.map(one, masks) if executed_only else jax.vmap(one)(masks)


_plan_states = jax.jit(_plan_states_fn, static_argnames=("config", "reference_kv", "executed_only"))


def plan_alpha(params, config: ModelConfig, cache: KVCache, prefix_len, states, masks, token_mask=None, *,
               reference_kv: str = "branch") -> np.ndarray:
    """The DP's acceptance estimate for given skip masks ``[C, L, 2]`` (True = skip): each mask's
    greedy-token agreement with the target on the reference tokens of ``states``
    (:func:`boundary_states`), with the reference ``reference_kv`` (:data:`REFERENCE_KV`) -- the
    ``alpha`` :func:`knapsack_dp` reports for the masks it finds, for any mask."""
    return plan_agreement(params, config, cache, prefix_len, states, masks, token_mask, reference_kv=reference_kv)[:, 0]


def plan_agreement(params, config: ModelConfig, cache: KVCache, prefix_len, states, masks, token_mask=None, *,
                   reference_kv: str = "branch", exit_threshold: Optional[float] = None,
                   executed_only: bool = True) -> np.ndarray:
    """``[C, 3]`` per skip mask: (alpha, p_c, p_ac) on the reference tokens of ``states``, the statistics
    :func:`knapsack_dp` reports for its candidates (``exit_threshold`` None: p_c = 1, p_ac = alpha).
    ``executed_only``: run only each mask's executed sub-layers after its first skip (the default);
    ``False`` runs every sub-layer of every mask (the reference; same result)."""
    config = _dp_config(config)
    check_reference_kv(reference_kv)
    masks = np.asarray(masks, bool)
    if masks.ndim != 3 or masks.shape[1:] != (config.num_layers, 2):
        raise ValueError(f"masks of shape {masks.shape}: expected [C, {config.num_layers}, 2]")
    token_mask = jnp.ones(states.shape[1:3], jnp.float32) if token_mask is None else jnp.asarray(token_mask,
                                                                                                  jnp.float32)
    finals = _plan_states(params, cache, jnp.asarray(prefix_len, jnp.int32), states, jnp.asarray(masks),
                          config=config, reference_kv=reference_kv, executed_only=executed_only)
    threshold = None if exit_threshold is None else float(exit_threshold)
    return np.asarray(_agreement_jit(params, config, finals, states[-1], token_mask, None, threshold), np.float64)


# ---------------------------------------------------------------------------- references on the model
@functools.partial(jax.jit, static_argnames=("config", "kind", "reference_kv"))
def _apply_single_jit(layer_x, h, prefix_len, *, config, kind, reference_kv="branch"):
    attn, mlp, _, _ = _model_sublayers(config, prefix_len, h.shape[1], None, reference_kv)
    return attn(layer_x, h) if kind == 0 else mlp(layer_x, h)


def _model_problem(params, config, cache, prefix_len, states, keep_attention=(), reference_kv="branch"):
    """Arguments of the generic :func:`dp_loop` / :func:`brute_force` for the model."""
    prefix_len = jnp.asarray(prefix_len, jnp.int32)
    check_reference_kv(reference_kv)
    layers = [_layer_arg(params, cache, states, i, reference_kv) for i in range(1, config.num_layers)]
    targets = [(states[2 * i + 1], states[2 * i + 2]) for i in range(1, config.num_layers)]
    can_skip = scan_can_skip(config.num_layers, check_keep_attention(keep_attention, config.num_layers))

    def apply_single(kind, layer_x, h):
        return _apply_single_jit(layer_x, h, prefix_len, config=config, kind=kind, reference_kv=reference_kv)

    return apply_single, layers, targets, can_skip


def knapsack_dp_reference(params, config: ModelConfig, cache: KVCache, prefix_len, states, token_mask=None, *,
                          w_attn: int, w_mlp: int, budget: Optional[int] = None,
                          tau: float = DEFAULT_TAU, keep_attention: Sequence[int] = (),
                          reference_kv: str = "branch") -> Candidates:
    """The same DP with the Python loop of :func:`dp_loop` (unbatched ``attention_sublayer`` per
    candidate): the reference for :func:`knapsack_dp`."""
    config = _dp_config(config)
    budget = skip_budget(w_attn, w_mlp, config.num_layers) if budget is None else int(budget)
    token_mask = jnp.ones(states.shape[1:3], jnp.float32) if token_mask is None else jnp.asarray(token_mask,
                                                                                                  jnp.float32)
    if config.num_layers < 2:
        return _trivial_candidates(params, config, states, token_mask, w_attn, w_mlp, budget)
    apply_single, layers, targets, can_skip = _model_problem(params, config, cache, prefix_len, states,
                                                             keep_attention, reference_kv)
    trace, final = dp_loop(apply_single, layers, states[2], targets, can_skip, token_mask, w_attn=w_attn,
                           w_mlp=w_mlp, budget=budget, tau=tau)
    masks, slots = backtrack(trace, config.num_layers, w_attn, w_mlp)
    denom = max(float(np.asarray(token_mask).sum()), 1.0)
    teacher = _head_argmax(params, config, states[-1])
    alpha = [float(jnp.sum((_head_argmax(params, config, final[int(j)]) == teacher) * token_mask)) / denom
             for j in slots]
    return Candidates(masks=masks, weights=slots, cosine=trace.final_values[slots] / denom,
                      alpha=np.asarray(alpha), w_attn=int(w_attn), w_mlp=int(w_mlp), budget=budget, trace=trace,
                      final_states=np.stack([np.asarray(final[int(j)]) for j in slots]))


def knapsack_brute_force(params, config: ModelConfig, cache: KVCache, prefix_len, states, token_mask=None, *,
                         w_attn: int, w_mlp: int, budget: Optional[int] = None, tau: float = DEFAULT_TAU,
                         keep_attention: Sequence[int] = (), reference_kv: str = "branch"
                         ) -> Dict[int, Tuple[float, np.ndarray]]:
    """Exhaustive search on the model (tiny models only: ``4^(L-2)`` skip sets):
    ``{skipped weight: (best mean final cosine, [L, 2] mask)}``."""
    config = _dp_config(config)
    budget = skip_budget(w_attn, w_mlp, config.num_layers) if budget is None else int(budget)
    token_mask = jnp.ones(states.shape[1:3], jnp.float32) if token_mask is None else jnp.asarray(token_mask,
                                                                                                  jnp.float32)
    apply_single, layers, targets, can_skip = _model_problem(params, config, cache, prefix_len, states,
                                                             keep_attention, reference_kv)
    found = brute_force(apply_single, layers, states[2], targets, can_skip, token_mask, w_attn=w_attn, w_mlp=w_mlp,
                        budget=budget, tau=tau)
    denom = max(float(np.asarray(token_mask).sum()), 1.0)
    out = {}
    for weight, (value, skips) in found.items():
        mask = np.zeros((config.num_layers, 2), bool)
        for layer, col in skips:
            mask[1 + layer, col] = True
        out[weight] = (value / denom, mask)
    return out


def knapsack_exhaustive_count(num_layers: int) -> int:
    """Skip sets brute force enumerates (edge layers fixed): ``4^(L-2)``."""
    return 4 ** max(num_layers - 2, 0)



# public names of the DP's building blocks, for the coupled (whole-layer) DP of jaxspec.knapspec.coupled
dp_config = _dp_config
agreement_alpha = _alpha
model_sublayers = _model_sublayers
trivial_candidates = _trivial_candidates
model_problem = _model_problem


__all__ = ["agreement_alpha", "agreement_chunk", "AGREEMENT_ROWS", "backtrack", "boundary_states", "brute_force",
           "Candidates", "check_keep_attention", "check_reference_kv", "cos_sum", "DEFAULT_SEGMENTS", "DEFAULT_TAU",
           "dp_config", "DP_LAYERS", "dp_loop", "dp_scan", "dp_unrolled", "DPTrace", "knapsack_brute_force",
           "knapsack_dp", "knapsack_dp_reference", "knapsack_exhaustive_count", "knapsack_weights", "model_problem",
           "model_sublayers", "per_sublayer_can_skip", "plan_agreement", "plan_alpha", "reference_attention_inputs",
           "REFERENCE_KV", "scan_can_skip", "skip_budget", "slot_segments", "stacked_scan_layers", "sublayer_can_skip",
           "target_kv_attention", "transition", "trivial_candidates", "WEIGHT_CAP", "window_prefill"]
