"""Forward options: skip mask (dynamic and static), verify_indices, probe heads.

The reference is an independent float64 numpy forward (:func:`reference_forward`) that takes
the history keys/values straight from a cache (their correctness is covered by
``test_cache.py`` / ``test_parity.py``), an explicit per-row set of history slots to attend,
explicit RoPE positions and a skip mask. Tiny Llama: 3 layers, 4 query / 2 KV heads, float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import llama as llama_module
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import forward_jit, forward_static_skip

from tests.conftest import TINY_VOCAB

CAPACITY = 24
HISTORY = 16  # tokens written by the history prefill (slots 0..15 hold real keys/values)
LENGTHS = (12, 9)  # the rows' valid history: slots 12..15 / 9..15 hold stale but real data
NEW = 4
RTOL, ATOL = 2e-5, 2e-5


# ---------------------------------------------------------------------------- numpy reference
def _np_tree(params):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), params)


def _rms(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x, positions, inv_freq):
    """``x [T, H, D]`` at ``positions [T]`` (rotate-half)."""
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(angles) + rotated * np.sin(angles)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def reference_forward(config, params, tokens, hist_keys, hist_values, hist_mask, positions, skip=None):
    """Float64 forward of ``tokens [B, T]`` over a given history.

    ``hist_keys/values``: per layer ``[B, Hkv, S, D]``; ``hist_mask [B, S]`` the slots each row
    attends (in every layer); ``skip [L, 2]`` bool (attention, MLP). Returns ``logits [B, T, V]``
    and per layer ``queries [B, T, Hq, D]`` (post-RoPE), ``probs [B, Hq, T, S + T]``, new keys
    ``[B, T, Hkv, D]`` (``None`` where attention is skipped).
    """
    p = _np_tree(params)
    batch, steps = tokens.shape
    hq, hkv, dim = config.num_heads, config.num_kv_heads, config.head_dim
    groups = hq // hkv
    inv_freq = config.inverse_frequencies()
    skip = np.zeros((config.num_layers, 2), bool) if skip is None else np.asarray(skip, bool)
    h = p.embed[np.asarray(tokens)]  # [B, T, d]
    queries, probs, new_keys = [], [], []
    causal = np.tril(np.ones((steps, steps), bool))
    for i, layer in enumerate(p.layers):
        layer_q = np.zeros((batch, steps, hq, dim))
        layer_p = np.zeros((batch, hq, steps, hist_keys[i].shape[2] + steps))
        layer_k = None
        if not skip[i, 0]:
            layer_k = np.zeros((batch, steps, hkv, dim))
            for b in range(batch):
                x = _rms(h[b], layer.attn_norm, config.rms_norm_eps)
                q, k, v = x @ layer.wq, x @ layer.wk, x @ layer.wv
                if config.attention_bias:
                    q, k, v = q + layer.bq, k + layer.bk, v + layer.bv
                q = _rope(q.reshape(steps, hq, dim), positions[b], inv_freq)
                k = _rope(k.reshape(steps, hkv, dim), positions[b], inv_freq)
                v = v.reshape(steps, hkv, dim)
                layer_q[b], layer_k[b] = q, k
                out = np.zeros((steps, hq, dim))
                for head in range(hq):
                    kv = head // groups
                    keys_hist = np.asarray(hist_keys[i][b, kv], np.float64)  # [S, D]
                    values_hist = np.asarray(hist_values[i][b, kv], np.float64)
                    s_hist = q[:, head] @ keys_hist.T / np.sqrt(dim)
                    s_hist = np.where(hist_mask[b][None, :], s_hist, -np.inf)
                    s_new = np.where(causal, q[:, head] @ k[:, kv].T / np.sqrt(dim), -np.inf)
                    scores = np.concatenate([s_hist, s_new], axis=-1)
                    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
                    weights /= weights.sum(axis=-1, keepdims=True)
                    layer_p[b, head] = weights
                    out[:, head] = weights[:, : len(keys_hist)] @ values_hist + weights[:, len(keys_hist):] @ v[:, kv]
                h[b] = h[b] + out.reshape(steps, hq * dim) @ layer.wo
        queries.append(layer_q)
        probs.append(layer_p)
        new_keys.append(layer_k)
        if not skip[i, 1]:
            x = _rms(h, layer.mlp_norm, config.rms_norm_eps)
            h = h + (_silu(x @ layer.w_gate) * (x @ layer.w_up)) @ layer.w_down
    head_matrix = p.embed.T if config.tie_word_embeddings else p.lm_head
    logits = _rms(h, p.final_norm, config.rms_norm_eps) @ head_matrix
    return logits, queries, probs, new_keys


# ---------------------------------------------------------------------------- shared setup
@pytest.fixture(scope="module")
def setup(tiny_llama):
    """History cache (lengths 12 / 9, slots up to 15 filled) and 4 new tokens per row."""
    model = tiny_llama
    rng = np.random.RandomState(0)
    history = jnp.asarray(rng.randint(0, TINY_VOCAB, size=(2, HISTORY)), jnp.int32)
    new_tokens = jnp.asarray(rng.randint(0, TINY_VOCAB, size=(2, NEW)), jnp.int32)
    cache = forward_jit(model.params, history, init_cache(model.config, 2, CAPACITY), config=model.config).cache
    cache = cache.with_lengths(LENGTHS)
    positions = np.asarray(LENGTHS)[:, None] + np.arange(NEW)[None, :]
    return model, cache, new_tokens, positions


def _reference(setup, hist_mask, skip=None, params=None):
    model, cache, new_tokens, positions = setup
    return reference_forward(model.config, params or model.params, np.asarray(new_tokens),
                             [np.asarray(k) for k in cache.keys], [np.asarray(v) for v in cache.values],
                             hist_mask, positions, skip)


def _dense_mask(lengths=LENGTHS, capacity=CAPACITY):
    return np.arange(capacity)[None, :] < np.asarray(lengths)[:, None]


def test_reference_matches_dense_forward(setup):
    """Sanity check of the numpy reference itself against the plain forward."""
    model, cache, new_tokens, _ = setup
    ours = forward_jit(model.params, new_tokens, cache, config=model.config)
    logits, _, _, _ = _reference(setup, _dense_mask())
    np.testing.assert_allclose(np.asarray(ours.logits), logits, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------- skip mask
SKIP_MASKS = [
    np.array([[False, True], [True, False], [False, False]]),  # MLP of layer 0, attention of layer 1
    np.array([[True, True], [False, False], [False, True]]),  # all of layer 0, MLP of layer 2
]


def _with_sentinel(cache, value=7.0):
    """Fill slots >= the row length with a sentinel so any write there is visible."""
    slots = jnp.arange(cache.capacity)[None, None, :, None] >= cache.lengths[:, None, None, None]
    fill = lambda x: jnp.where(slots, jnp.asarray(value, x.dtype), x)  # noqa: E731
    return dataclasses.replace(cache, keys=tuple(map(fill, cache.keys)), values=tuple(map(fill, cache.values)))


def _zeroed_params(params, mask):
    """Params where a skipped sub-layer's output projection is zero (its residual contributes nothing)."""
    layers = []
    for layer, (skip_attn, skip_mlp) in zip(params.layers, np.asarray(mask)):
        if skip_attn:
            layer = dataclasses.replace(layer, wo=jnp.zeros_like(layer.wo))
        if skip_mlp:
            layer = dataclasses.replace(layer, w_down=jnp.zeros_like(layer.w_down))
        layers.append(layer)
    return params.replace(layers=tuple(layers))


@pytest.mark.parametrize("mode", ["dynamic", "static"])
@pytest.mark.parametrize("mask_index", range(len(SKIP_MASKS)))
def test_skip_mask_equals_removed_sublayers(setup, mode, mask_index):
    model, cache, new_tokens, _ = setup
    mask = SKIP_MASKS[mask_index]
    cache = _with_sentinel(cache)
    if mode == "dynamic":
        out = forward_jit(model.params, new_tokens, cache, config=model.config, skip_mask=jnp.asarray(mask))
    else:
        out = forward_static_skip(model.params, new_tokens, cache, config=model.config, skip_mask=mask)

    # reference 1: zeroed output projections through the plain forward
    zeroed = forward_jit(_zeroed_params(model.params, mask), new_tokens, cache, config=model.config)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(zeroed.logits), rtol=RTOL, atol=ATOL)
    # reference 2: the numpy forward with the sub-layers removed
    logits, _, _, new_keys = _reference(setup, _dense_mask(), skip=mask)
    np.testing.assert_allclose(np.asarray(out.logits), logits, rtol=RTOL, atol=ATOL)
    # control: the mask really changes the result
    assert np.max(np.abs(np.asarray(out.logits) - _reference(setup, _dense_mask())[0])) > 1e-3

    np.testing.assert_array_equal(np.asarray(out.cache.lengths), np.asarray(LENGTHS) + NEW)
    for layer in range(model.config.num_layers):
        keys = np.asarray(out.cache.keys[layer])
        values = np.asarray(out.cache.values[layer])
        for b, length in enumerate(LENGTHS):
            np.testing.assert_array_equal(keys[b, :, :length], np.asarray(cache.keys[layer])[b, :, :length])
            written_k = keys[b, :, length:length + NEW]
            written_v = values[b, :, length:length + NEW]
            if mask[layer, 0]:  # skipped attention writes nothing into the cache
                assert np.all(written_k == 7.0) and np.all(written_v == 7.0), f"layer {layer} row {b} was written"
            else:
                np.testing.assert_allclose(written_k, new_keys[layer][b].transpose(1, 0, 2), rtol=RTOL, atol=ATOL)
                assert not np.any(written_v == 7.0)


def test_dynamic_skip_mask_does_not_recompile(setup):
    model, cache, new_tokens, _ = setup
    traces = []

    def counted(params, tokens, cache, skip_mask):
        traces.append(1)
        return llama_module.forward(params, tokens, cache, config=model.config, skip_mask=skip_mask).logits

    counted_jit = jax.jit(counted)
    results = []
    for mask in SKIP_MASKS + [np.zeros((3, 2), bool), np.ones((3, 2), bool)]:
        results.append(np.asarray(counted_jit(model.params, new_tokens, cache, jnp.asarray(mask))))
    assert len(traces) == 1, f"{len(traces)} traces for 4 masks of one shape"
    assert not np.allclose(results[0], results[1])  # the masks did take effect

    # the library's own jitted forward: its compile cache does not grow with new masks
    compiled = llama_module.forward_compiled
    forward_jit(model.params, new_tokens, cache, config=model.config, skip_mask=jnp.asarray(SKIP_MASKS[0]))
    size = compiled._cache_size()
    for mask in SKIP_MASKS[1:] + [np.ones((3, 2), bool)]:
        forward_jit(model.params, new_tokens, cache, config=model.config, skip_mask=jnp.asarray(mask))
    assert compiled._cache_size() == size
    # while the static form compiles once per distinct mask (shows the counter can move)
    static_before = llama_module.forward_static_jit._cache_size()
    for mask in SKIP_MASKS:
        forward_static_skip(model.params, new_tokens, cache, config=model.config, skip_mask=~mask)
    assert llama_module.forward_static_jit._cache_size() == static_before + len(SKIP_MASKS)


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_skip_everything_gives_normed_embeddings(setup, mode):
    model, cache, new_tokens, _ = setup
    config = model.config
    mask = np.ones((config.num_layers, 2), bool)
    if mode == "dynamic":
        out = forward_jit(model.params, new_tokens, cache, config=config, skip_mask=jnp.asarray(mask))
    else:
        out = forward_static_skip(model.params, new_tokens, cache, config=config, skip_mask=mask)
    p = _np_tree(model.params)
    assert config.tie_word_embeddings
    expected = _rms(p.embed[np.asarray(new_tokens)], p.final_norm, config.rms_norm_eps) @ p.embed.T
    np.testing.assert_allclose(np.asarray(out.logits), expected, rtol=RTOL, atol=ATOL)


def test_skip_mask_wrong_shape_raises(setup):
    model, cache, new_tokens, _ = setup
    with pytest.raises(ValueError, match=r"skip_mask shape"):
        forward_jit(model.params, new_tokens, cache, config=model.config, skip_mask=jnp.zeros((2, 2), bool))


# ---------------------------------------------------------------------------- verify_indices
def _padded(rows, width):
    return jnp.asarray([list(r) + [-1] * (width - len(r)) for r in rows], jnp.int32)


def test_verify_all_valid_positions_equals_dense(setup):
    model, cache, new_tokens, _ = setup
    dense = forward_jit(model.params, new_tokens, cache, config=model.config)
    indices = _padded([range(LENGTHS[0]), range(LENGTHS[1])], 12)
    sparse = forward_jit(model.params, new_tokens, cache, config=model.config, verify_indices=indices)
    np.testing.assert_allclose(np.asarray(sparse.logits), np.asarray(dense.logits), rtol=RTOL, atol=ATOL)
    for layer in range(model.config.num_layers):  # the new tokens are still written to the cache
        np.testing.assert_allclose(np.asarray(sparse.cache.keys[layer]), np.asarray(dense.cache.keys[layer]),
                                   rtol=RTOL, atol=ATOL)


SUBSET = ([0, 3, 5, 11], [1, 2, 8])


def _subset_mask(rows=SUBSET):
    mask = np.zeros((2, CAPACITY), bool)
    for b, row in enumerate(rows):
        mask[b, list(row)] = True
    return mask


def test_verify_subset_equals_masked_reference(setup):
    model, cache, new_tokens, _ = setup
    indices = _padded(SUBSET, 4)
    out = forward_jit(model.params, new_tokens, cache, config=model.config, verify_indices=indices)
    logits, _, _, _ = _reference(setup, _subset_mask())
    np.testing.assert_allclose(np.asarray(out.logits), logits, rtol=RTOL, atol=ATOL)
    dense_logits, _, _, _ = _reference(setup, _dense_mask())
    assert np.max(np.abs(dense_logits - logits)) > 1e-3  # the subset really changes the result


def test_verify_ignores_padded_out_of_range_and_duplicate_indices(setup):
    model, cache, new_tokens, _ = setup
    # row 0 (length 12): -1 padding, 12 and 15 are >= length (slots hold stale real keys), 40 >= capacity,
    # 3 and 5 repeated. Row 1 (length 9): 9 and 14 stale, -7 negative, 8 repeated.
    messy = jnp.asarray([[3, -1, 5, 3, 40, 11, 12, 0, 5, 15],
                         [8, 9, -7, 1, 14, 8, 2, -1, 8, 1]], jnp.int32)
    out = forward_jit(model.params, new_tokens, cache, config=model.config, verify_indices=messy)
    clean = forward_jit(model.params, new_tokens, cache, config=model.config, verify_indices=_padded(SUBSET, 4))
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(clean.logits), rtol=RTOL, atol=ATOL)
    logits, _, _, _ = _reference(setup, _subset_mask())
    np.testing.assert_allclose(np.asarray(out.logits), logits, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------- probes
PROBES = ((0, 1), (2, 3), (1, 0), (2, 2))


def test_probe_queries_and_history_probs_match_reference(setup):
    model, cache, new_tokens, _ = setup
    out = forward_jit(model.params, new_tokens, cache, config=model.config, probe_heads=PROBES)
    _, queries, probs, _ = _reference(setup, _dense_mask())
    assert out.probes.queries.shape == (2, len(PROBES), NEW, model.config.head_dim)
    assert out.probes.history_probs.shape == (2, len(PROBES), NEW, CAPACITY)
    for n, (layer, head) in enumerate(PROBES):
        np.testing.assert_allclose(np.asarray(out.probes.queries[:, n]), queries[layer][:, :, head],
                                   rtol=RTOL, atol=ATOL)
        hist = np.asarray(out.probes.history_probs[:, n])  # [B, T, S]
        np.testing.assert_allclose(hist, probs[layer][:, head, :, :CAPACITY], rtol=RTOL, atol=1e-6)
        new_mass = probs[layer][:, head, :, CAPACITY:].sum(-1)
        np.testing.assert_allclose(hist.sum(-1) + new_mass, 1.0, rtol=1e-5)
        assert np.all(hist.sum(-1) <= 1.0 + 1e-6)
        assert np.all(hist[~np.broadcast_to(_dense_mask()[:, None, :], hist.shape)] == 0.0)  # padding gets nothing


def test_probe_history_probs_with_verify_indices(setup):
    model, cache, new_tokens, _ = setup
    indices = jnp.asarray([[3, -1, 5, 3, 40, 11, 12, 0], [8, 9, -7, 1, 14, 8, 2, -1]], jnp.int32)
    out = forward_jit(model.params, new_tokens, cache, config=model.config, probe_heads=PROBES,
                  verify_indices=indices)
    assert out.probes.history_probs.shape == (2, len(PROBES), NEW, indices.shape[1])
    _, _, probs, _ = _reference(setup, _subset_mask())
    ignored = np.asarray([[False, True, False, True, True, False, True, False],
                          [False, True, True, False, True, True, False, True]])
    for n, (layer, head) in enumerate(PROBES):
        hist = np.asarray(out.probes.history_probs[:, n])  # [B, T, K]
        assert np.all(hist[0][:, ignored[0]] == 0.0) and np.all(hist[1][:, ignored[1]] == 0.0)
        for b in range(2):
            expected = probs[layer][b, head, :, np.asarray(indices[b]).clip(0, CAPACITY - 1)]  # [K, T]
            np.testing.assert_allclose(hist[b][:, ~ignored[b]], expected.T[:, ~ignored[b]], rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("bad", [(0, 4), (3, 0), (-1, 0)])
def test_probe_head_out_of_range_raises(setup, bad):
    model, cache, new_tokens, _ = setup
    with pytest.raises(ValueError, match="out of range"):
        forward_jit(model.params, new_tokens, cache, config=model.config, probe_heads=((0, 0), bad))


# ---------------------------------------------------------------------------- write_cache=False
@pytest.mark.parametrize("skip", [None, SKIP_MASKS[0]], ids=["dense", "attention-1-skipped"])
def test_unwritten_kv_written_after_equals_the_forward(setup, skip):
    """forward(write_cache=False) returns the logits of the plain forward, leaves the cache as it was, and
    write_new_kv then gives the cache the plain forward writes (a skipped attention writes nothing)."""
    model, cache, new_tokens, _ = setup
    cache = _with_sentinel(cache)
    options = {} if skip is None else {"skip_mask": tuple(tuple(bool(f) for f in row) for row in skip)}
    plain = llama_module.forward(model.params, new_tokens, cache, config=model.config, **options)
    out = llama_module.forward(model.params, new_tokens, cache, config=model.config, write_cache=False, **options)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(plain.logits), rtol=RTOL, atol=ATOL)
    for before, after in zip(cache.keys + cache.values, out.cache.keys + out.cache.values):
        np.testing.assert_array_equal(np.asarray(before), np.asarray(after))
    assert [k.shape for k in out.new_kv[0]] == [(2, model.config.num_kv_heads, NEW, model.config.head_dim)] * 3
    written = llama_module.write_new_kv(cache, out.new_kv, cache.lengths,
                                        enabled=np.ones((1, NEW), bool) if skip is None else True)
    skipped_layers = set() if skip is None else {i for i, row in enumerate(skip) if row[0]}
    for i in range(model.config.num_layers):
        for ours, theirs, old in ((written.keys[i], plain.cache.keys[i], cache.keys[i]),
                                  (written.values[i], plain.cache.values[i], cache.values[i])):
            if i in skipped_layers:  # the plain forward wrote nothing there (write_new_kv wrote the zeros)
                np.testing.assert_array_equal(np.asarray(theirs), np.asarray(old))
            else:
                np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(np.asarray(written.lengths), np.asarray(plain.cache.lengths))
    # disabled tokens write nothing: only the first new token lands
    first = llama_module.write_new_kv(cache, out.new_kv, cache.lengths, enabled=np.arange(NEW)[None, :] < 1)
    slots = np.arange(CAPACITY)
    for ours, theirs, old in zip(first.keys, written.keys, cache.keys):
        for row, length in enumerate(LENGTHS):
            ours_row, theirs_row, old_row = (np.asarray(x)[row] for x in (ours, theirs, old))
            np.testing.assert_array_equal(ours_row[:, slots == length], theirs_row[:, slots == length])
            np.testing.assert_array_equal(ours_row[:, slots > length], old_row[:, slots > length])
