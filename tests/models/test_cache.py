"""KV cache: incremental decoding, rollback, the end of the buffer, capacity errors, ragged rows.

All tests use the tiny Llama (3 layers, GQA 4/2, float32) and one cache capacity so the
compiled forward shapes are shared across tests.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import autoregressive
from jaxspec.models.cache import CacheOverflowError, check_room, freeze_rows, init_cache
from jaxspec.models.llama import forward, forward_compiled, forward_jit

from tests.conftest import TINY_VOCAB

CAPACITY = 24
RTOL, ATOL = 1e-5, 1e-5


def _tokens(seed, batch, length):
    return jnp.asarray(np.random.RandomState(seed).randint(0, TINY_VOCAB, size=(batch, length)), jnp.int32)


def _run(model, tokens, cache, **kwargs):
    return forward_jit(model.params, tokens, cache, config=model.config, **kwargs)


@pytest.fixture(scope="module")
def llama(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def full_reference(llama):
    """Tokens ``[2, 20]`` and the logits of one full forward over them (empty cache)."""
    tokens = _tokens(0, 2, 20)
    out = _run(llama, tokens, init_cache(llama.config, 2, CAPACITY))
    return tokens, np.asarray(out.logits), out.cache


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_decode_equals_full_forward(llama, full_reference, chunk):
    tokens, full_logits, full_cache = full_reference
    prefill_len = 8
    out = _run(llama, tokens[:, :prefill_len], init_cache(llama.config, 2, CAPACITY))
    pieces = [np.asarray(out.logits)]
    cache = out.cache
    for start in range(prefill_len, tokens.shape[1], chunk):
        out = _run(llama, tokens[:, start:start + chunk], cache)
        cache = out.cache
        pieces.append(np.asarray(out.logits))
    incremental = np.concatenate(pieces, axis=1)
    assert incremental.shape == full_logits.shape
    np.testing.assert_allclose(incremental, full_logits, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [20, 20])
    for layer in range(llama.config.num_layers):
        np.testing.assert_allclose(np.asarray(cache.keys[layer][:, :, :20]),
                                   np.asarray(full_cache.keys[layer][:, :, :20]), rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(np.asarray(cache.values[layer][:, :, :20]),
                                   np.asarray(full_cache.values[layer][:, :, :20]), rtol=RTOL, atol=ATOL)


def test_rollback_then_rewrite_equals_never_written(llama):
    prefix = _tokens(1, 2, 8)
    rejected = _tokens(2, 2, 3)  # 5 written = 2 kept + 3 rolled back
    kept = _tokens(3, 2, 2)
    rewrite = _tokens(4, 2, 3)
    follow = _tokens(5, 2, 1)

    base = _run(llama, prefix, init_cache(llama.config, 2, CAPACITY)).cache

    # A: write 5 (kept + rejected), roll back 3, write 3 different tokens, then one more token
    cache_a = _run(llama, jnp.concatenate([kept, rejected], axis=1), base).cache
    np.testing.assert_array_equal(np.asarray(cache_a.lengths), [13, 13])
    cache_a = cache_a.rollback(3)
    np.testing.assert_array_equal(np.asarray(cache_a.lengths), [10, 10])
    cache_a = _run(llama, rewrite, cache_a).cache
    out_a = _run(llama, follow, cache_a)

    # B: write the 2 kept tokens, then the same 3, then the same one
    cache_b = _run(llama, kept, base).cache
    cache_b = _run(llama, rewrite, cache_b).cache
    out_b = _run(llama, follow, cache_b)

    np.testing.assert_allclose(np.asarray(out_a.logits), np.asarray(out_b.logits), rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(np.asarray(out_a.cache.lengths), np.asarray(out_b.cache.lengths))
    valid = int(out_b.cache.lengths[0])
    assert valid == 14
    for layer in range(llama.config.num_layers):
        for a, b in ((out_a.cache.keys[layer], out_b.cache.keys[layer]),
                     (out_a.cache.values[layer], out_b.cache.values[layer])):
            np.testing.assert_allclose(np.asarray(a[:, :, :valid]), np.asarray(b[:, :, :valid]), rtol=RTOL, atol=ATOL)

    # Control: without the rollback the rejected tokens stay in the history and the logits differ.
    cache_c = _run(llama, jnp.concatenate([kept, rejected], axis=1), base).cache
    cache_c = _run(llama, rewrite, cache_c).cache
    out_c = _run(llama, follow, cache_c)
    assert np.max(np.abs(np.asarray(out_c.logits) - np.asarray(out_b.logits))) > 1e-3


def test_write_past_capacity_is_dropped_and_never_clobbers_history(llama):
    """Under jit (traced lengths, no host check): row 0 at length 22 of 24 takes 4 tokens: slots
    22, 23 written, 24, 25 dropped, 0..21 untouched.

    A ``dynamic_update_slice`` write would clamp the start to 20 and overwrite slots 20 and 21.
    """
    config = llama.config
    history = _tokens(6, 2, 22)
    cache = _run(llama, history, init_cache(config, 2, CAPACITY)).cache  # both rows length 22
    cache = cache.with_lengths([22, 15])  # row 1 has only 15 valid slots; it writes 15..18
    new_tokens = _tokens(7, 2, 4)
    out = forward_compiled(llama.params, new_tokens, cache, config=config)

    # what the 4 new tokens' keys/values are, computed in a roomy cache with the same history
    roomy = _run(llama, history, init_cache(config, 2, 40)).cache.with_lengths([22, 15])
    roomy_out = _run(llama, new_tokens, roomy)

    for layer in range(config.num_layers):
        for before, after, wide in ((cache.keys[layer], out.cache.keys[layer], roomy_out.cache.keys[layer]),
                                    (cache.values[layer], out.cache.values[layer], roomy_out.cache.values[layer])):
            before, after, wide = np.asarray(before), np.asarray(after), np.asarray(wide)
            assert after.shape == before.shape  # capacity unchanged
            # row 0: history bit-for-bit intact, the two slots that fit hold the first two new tokens
            np.testing.assert_array_equal(after[0, :, :22], before[0, :, :22])
            np.testing.assert_allclose(after[0, :, 22:24], wide[0, :, 22:24], rtol=RTOL, atol=ATOL)
            # row 1: writes at its own offset 15..18, everything else untouched
            np.testing.assert_array_equal(after[1, :, :15], before[1, :, :15])
            np.testing.assert_allclose(after[1, :, 15:19], wide[1, :, 15:19], rtol=RTOL, atol=ATOL)
            np.testing.assert_array_equal(after[1, :, 19:], before[1, :, 19:])
    # the tokens that did fit see exactly the right history
    np.testing.assert_allclose(np.asarray(out.logits[0, :2]), np.asarray(roomy_out.logits[0, :2]),
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(out.logits[1]), np.asarray(roomy_out.logits[1]), rtol=RTOL, atol=ATOL)


def test_forward_refuses_to_write_past_capacity(llama):
    """With concrete lengths the forward (jitted wrapper or eager) raises before any work."""
    config = llama.config
    cache = init_cache(config, 2, CAPACITY).with_lengths([22, 15])
    new_tokens = _tokens(7, 2, 4)
    for run in (forward_jit, forward):
        with pytest.raises(CacheOverflowError, match=r"capacity 24 for row 0 \(length 22\)"):
            run(llama.params, new_tokens, cache, config=config)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [22, 15])  # nothing changed


def test_rollback_refuses_negative_or_too_many(llama):
    cache = init_cache(llama.config, 2, CAPACITY).with_lengths([5, 3])
    np.testing.assert_array_equal(np.asarray(cache.rollback(np.array([5, 0])).lengths), [0, 3])
    np.testing.assert_array_equal(np.asarray(cache.rollback(2).lengths), [3, 1])
    with pytest.raises(ValueError, match="rollback of 4 tokens in row 1 of length 3"):
        cache.rollback(np.array([1, 4]))
    with pytest.raises(ValueError, match="rollback of -1 tokens in row 0"):
        cache.rollback(-1)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [5, 3])


def test_forward_checks_tokens_and_params(llama):
    config = llama.config
    cache = init_cache(config, 2, CAPACITY)
    with pytest.raises(ValueError, match="integer token ids, got dtype float32"):
        forward_jit(llama.params, jnp.zeros((2, 3), jnp.float32), cache, config=config)
    with pytest.raises(ValueError, match=f"token id {TINY_VOCAB} out of range for vocab_size={TINY_VOCAB}"):
        forward_jit(llama.params, jnp.full((2, 3), TINY_VOCAB, jnp.int32), cache, config=config)
    with pytest.raises(ValueError, match="token id -1 out of range"):
        forward(llama.params, jnp.full((2, 3), -1, jnp.int32), cache, config=config)
    wrong = config.replace(hidden_size=2 * config.hidden_size, name="wider")
    with pytest.raises(ValueError, match=r"parameter 'embed' has shape .* config 'wider' expects"):
        forward_jit(llama.params, jnp.zeros((2, 3), jnp.int32), cache, config=wrong)
    fewer = config.replace(num_layers=config.num_layers - 1)
    with pytest.raises(ValueError, match="params have 3 layers"):
        forward_jit(llama.params, jnp.zeros((2, 3), jnp.int32), init_cache(fewer, 2, CAPACITY), config=fewer)


def test_check_room_names_row_and_capacity():
    check_room(np.array([20, 10]), 24, 4)  # exactly fits: no error
    with pytest.raises(CacheOverflowError) as info:
        check_room(np.array([22, 10, 23]), 24, 4, "decode")
    message = str(info.value)
    assert "row 0 (length 22)" in message and "row 2 (length 23)" in message
    assert "row 1" not in message
    assert "capacity 24" in message
    assert "27" in message  # the capacity that would fit
    with pytest.raises(ValueError):
        check_room(np.array([1]), 24, -1)


def test_generate_beyond_capacity_raises_before_any_work(llama, monkeypatch):
    calls = []

    def forbidden(*args, **kwargs):
        calls.append(args)
        raise AssertionError("work started before the capacity check")

    monkeypatch.setattr(autoregressive, "init_cache", forbidden)
    monkeypatch.setattr(autoregressive, "prefill", forbidden)
    monkeypatch.setattr(autoregressive, "decode_loop", forbidden)
    prompts = [[1, 2, 3], list(range(3, 18))]  # longest prompt 15 tokens
    with pytest.raises(CacheOverflowError) as info:
        autoregressive.generate(llama.params, llama.config, prompts, max_new_tokens=10, capacity=20)
    assert "row 1" in str(info.value) and "capacity 20" in str(info.value)
    assert "row 0" not in str(info.value)
    assert calls == []


def test_ragged_rows_write_at_their_own_offsets(llama):
    """Rows of lengths 3 and 7 (right-padded prefill) each write the next 2 tokens at their own end."""
    config = llama.config
    prompt_a = _tokens(8, 1, 3)
    prompt_b = _tokens(9, 1, 7)
    padded = jnp.concatenate([jnp.pad(prompt_a, ((0, 0), (0, 4))), prompt_b], axis=0)  # [2, 7]
    cache = _run(llama, padded, init_cache(config, 2, CAPACITY)).cache.with_lengths([3, 7])
    new = _tokens(10, 2, 2)
    out = _run(llama, new, cache)
    np.testing.assert_array_equal(np.asarray(out.cache.lengths), [5, 9])

    # each row alone (batch 1, no padding)
    alone = []
    for prompt, row in ((prompt_a, 0), (prompt_b, 1)):
        c = _run(llama, prompt, init_cache(config, 1, CAPACITY)).cache
        alone.append(_run(llama, new[row:row + 1], c))

    np.testing.assert_allclose(np.asarray(out.logits[0]), np.asarray(alone[0].logits[0]), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(out.logits[1]), np.asarray(alone[1].logits[0]), rtol=RTOL, atol=ATOL)
    for layer in range(config.num_layers):
        keys = np.asarray(out.cache.keys[layer])
        before = np.asarray(cache.keys[layer])
        np.testing.assert_allclose(keys[0, :, :5], np.asarray(alone[0].cache.keys[layer])[0, :, :5],
                                   rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(keys[1, :, :9], np.asarray(alone[1].cache.keys[layer])[0, :, :9],
                                   rtol=RTOL, atol=ATOL)
        # row 0's stale padding slots 5, 6 are not touched (row 0 wrote 3, 4 only)
        np.testing.assert_array_equal(keys[0, :, 5:7], before[0, :, 5:7])
        assert not np.allclose(keys[0, :, 3:5], before[0, :, 3:5])  # the padding was really overwritten


def test_prefill_into_partly_filled_cache_checks_its_room(llama):
    """``prefill`` must count the rows' current lengths: 6 held + 7 prompt tokens do not fit in 10.

    (Library bug at the time of writing: ``prefill`` checks only ``prompt_lengths <= capacity``, so
    this call silently drops 3 prompt tokens and returns lengths 13 > capacity 10.)
    """
    config = llama.config
    cache = _run(llama, _tokens(11, 1, 6), init_cache(config, 1, 10)).cache
    before = [np.asarray(k).copy() for k in cache.keys]
    prompt = np.asarray(_tokens(12, 1, 7))
    with pytest.raises(CacheOverflowError) as info:
        autoregressive.prefill(llama.params, config, prompt, np.array([7]), cache, chunk=4)
    assert "row 0" in str(info.value) and "capacity 10" in str(info.value)
    # raised before any work: the (donated) buffers are still alive and unchanged
    for layer, keys in enumerate(before):
        np.testing.assert_array_equal(np.asarray(cache.keys[layer]), keys)


def test_prefill_into_partly_filled_cache_that_fits(llama):
    """Prefill continuing a cached prefix (6 + 7 tokens in 16 slots) equals one full forward."""
    config = llama.config
    first, second = _tokens(11, 1, 6), _tokens(12, 1, 7)
    cache = _run(llama, first, init_cache(config, 1, 16)).cache
    cache, last_logits = autoregressive.prefill(llama.params, config, np.asarray(second), np.array([7]), cache,
                                                chunk=4)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [13])
    full = _run(llama, jnp.concatenate([first, second], axis=1), init_cache(config, 1, 16))
    np.testing.assert_allclose(np.asarray(last_logits[0]), np.asarray(full.logits[0, -1]), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("backend", ["xla", "pallas-interpret"])
def test_frozen_rows_read_no_history_and_write_where_they_would(llama, backend):
    """A frozen row (a batched decode's finished row) attends to its first slot only: its logits do not
    change when the rest of its history does, while an unfrozen row's logits equal those of a forward
    without the mark. Its new K/V still go to slot ``lengths`` and the mark rides along the cache."""
    config = llama.config.replace(attention_backend=backend)
    prompts = _tokens(11, 2, 12)
    cache = _run(llama, prompts, init_cache(config, 2, 64))
    cache = cache.cache
    new = _tokens(12, 2, 2)
    noisy_keys = tuple(k.at[0, :, 1:12].set(jnp.asarray(np.random.RandomState(13).randn(*k[0, :, 1:12].shape),
                                                         k.dtype)) for k in cache.keys)
    noisy = dataclasses.replace(cache, keys=noisy_keys)
    frozen = jnp.asarray([True, False])

    plain = forward(llama.params, new, cache, config=config)
    marked = forward(llama.params, new, cache.with_frozen(frozen), config=config)
    marked_noisy = forward(llama.params, new, noisy.with_frozen(frozen), config=config)
    plain_noisy = forward(llama.params, new, noisy, config=config)

    np.testing.assert_allclose(np.asarray(marked.logits[1]), np.asarray(plain.logits[1]), rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(np.asarray(marked_noisy.logits[0]), np.asarray(marked.logits[0]))
    assert not np.allclose(np.asarray(plain_noisy.logits[0]), np.asarray(plain.logits[0]), atol=1e-3)
    assert not np.allclose(np.asarray(marked.logits[0]), np.asarray(plain.logits[0]), atol=1e-3)
    np.testing.assert_array_equal(np.asarray(marked.cache.lengths), [14, 14])
    np.testing.assert_array_equal(np.asarray(marked.cache.frozen), [True, False])
    for layer in range(config.num_layers):  # row 0's history untouched; its new K/V at slots 12, 13
        np.testing.assert_array_equal(np.asarray(marked.cache.keys[layer][0, :, :12]),
                                      np.asarray(cache.keys[layer][0, :, :12]))
        assert not np.allclose(np.asarray(marked.cache.keys[layer][0, :, 12:14]), 0.0)
    # layer 0's new keys depend on the tokens only: the frozen row's equal the plain forward's
    np.testing.assert_allclose(np.asarray(marked.cache.keys[0][0, :, 12:14]),
                               np.asarray(plain.cache.keys[0][0, :, 12:14]), rtol=RTOL, atol=ATOL)


def test_freeze_rows_marks_caches_of_the_batch_only(llama):
    config = llama.config
    big, small = init_cache(config, 3, CAPACITY), init_cache(config, 2, CAPACITY)
    tree = {"draft": big, "plan": small, "step": jnp.int32(0)}
    marked = freeze_rows(tree, jnp.asarray([False, True, False]))
    np.testing.assert_array_equal(np.asarray(marked["draft"].frozen), [False, True, False])
    assert marked["plan"].frozen is None
    np.testing.assert_array_equal(np.asarray(marked["draft"].read_lengths), [0, 0, 0])
    cleared = freeze_rows(marked, None)
    assert cleared["draft"].frozen is None
    with pytest.raises(ValueError, match=r"frozen has shape \(2,\); the cache has 3 rows"):
        big.with_frozen(jnp.asarray([True, False]))
    filled = big.with_lengths([5, 0, 9]).with_frozen(jnp.asarray([True, True, False]))
    np.testing.assert_array_equal(np.asarray(filled.read_lengths), [1, 0, 9])
