"""Autoregressive decoding: ragged batches, stop tokens, sampling distribution, input errors.

Tiny Llama-3.1 (2 layers, untied head, float32). Every ``generate`` call uses the same explicit capacity and
prefill chunk so the compiled prefill/decode shapes are shared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding.autoregressive import PAD_OUTPUT, generate, pad_prompts
from jaxspec.decoding.sampling import SamplingConfig, sample_token, sampling_probs
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import forward_jit

from tests.conftest import TINY_VOCAB

CAPACITY = 64
CHUNK = 16
NEW_TOKENS = 8
PROMPT_LENGTHS = (5, 17, 40)


@pytest.fixture(scope="module")
def model(tiny_llama31):
    # the untied Llama-3.1 model: its greedy continuations vary (the tied tiny Llama repeats one token)
    return tiny_llama31


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(0)
    return [rng.randint(3, TINY_VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]


def _generate(model, prompts, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW_TOKENS)
    return generate(model.params, model.config, prompts, capacity=CAPACITY, prefill_chunk=CHUNK, **kwargs)


@pytest.fixture(scope="module")
def batch_result(model, prompts):
    return _generate(model, prompts)


def _argmax_loop(model, prompt, num_tokens):
    """Greedy tokens from full forwards without a KV cache (one fixed padded shape; causal => exact)."""
    total = len(prompt) + num_tokens
    sequence = list(prompt)
    for _ in range(num_tokens):
        padded = np.zeros((1, total), np.int32)
        padded[0, : len(sequence)] = sequence
        logits = forward_jit(model.params, jnp.asarray(padded), init_cache(model.config, 1, total),
                         config=model.config).logits
        sequence.append(int(np.argmax(np.asarray(logits[0, len(sequence) - 1]))))
    return sequence[len(prompt):]


def test_greedy_generate_equals_argmax_of_full_forwards(model, prompts, batch_result):
    expected = _argmax_loop(model, prompts[1], NEW_TOKENS)
    assert batch_result.rows()[1] == expected
    assert len(set(expected)) > 2  # setup check: a constant continuation would make the comparison weak


def test_ragged_batch_equals_each_prompt_alone(model, prompts, batch_result):
    assert batch_result.tokens.shape == (3, NEW_TOKENS)
    np.testing.assert_array_equal(batch_result.prompt_lengths, PROMPT_LENGTHS)
    np.testing.assert_array_equal(batch_result.num_generated, [NEW_TOKENS] * 3)
    assert np.all(batch_result.tokens >= 0)
    for row, prompt in enumerate(prompts):
        alone = _generate(model, [prompt])
        assert alone.rows()[0] == batch_result.rows()[row], f"prompt {row} (length {len(prompt)})"
    # the rows really are different continuations (a padding bug that leaks rows would likely equalise them)
    assert len({tuple(r) for r in batch_result.rows()}) == 3


def test_stop_token_ends_only_its_row(model, prompts, batch_result):
    rows = batch_result.rows()
    # a token that row 0 emits at position >= 1 and that no other row emits at all
    others = set(rows[1]) | set(rows[2])
    candidates = [(i, t) for i, t in enumerate(rows[0]) if i >= 1 and t not in others and t not in rows[0][:i]]
    if not candidates:
        pytest.fail(f"test setup: no usable stop token in {rows}")
    position, stop = candidates[0]
    result = _generate(model, prompts, stop_tokens=[stop])
    expected_row0 = rows[0][: position + 1] + [PAD_OUTPUT] * (NEW_TOKENS - position - 1)
    assert result.tokens[0].tolist() == expected_row0
    assert result.num_generated[0] == position + 1
    assert result.rows()[0][-1] == stop
    assert result.tokens[1].tolist() == rows[1] and result.tokens[2].tolist() == rows[2]
    np.testing.assert_array_equal(result.num_generated[1:], [NEW_TOKENS, NEW_TOKENS])


def test_all_rows_stopping_on_their_first_token(model, prompts, batch_result):
    first = sorted({r[0] for r in batch_result.rows()})
    result = _generate(model, prompts, stop_tokens=first)
    np.testing.assert_array_equal(result.num_generated, [1, 1, 1])
    assert np.all(result.tokens[:, 1:] == PAD_OUTPUT)
    np.testing.assert_array_equal(result.tokens[:, 0], [r[0] for r in batch_result.rows()])


# ---------------------------------------------------------------------------- sampling
def test_top_p_keeps_the_smallest_nucleus():
    probs = np.array([0.15, 0.5, 0.05, 0.2, 0.1])  # sorted: 0.5 (1), 0.2 (3), 0.15 (0), 0.1 (4), 0.05 (2)
    logits = jnp.asarray(np.log(probs)[None, :] + 3.0, jnp.float32)  # a shift must not matter

    def nucleus(top_p):
        return np.asarray(sampling_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p)))[0]

    np.testing.assert_allclose(nucleus(1.0), probs, rtol=1e-5)
    np.testing.assert_allclose(nucleus(0.45), [0, 1, 0, 0, 0], atol=1e-6)  # 0.5 alone reaches 0.45
    np.testing.assert_allclose(nucleus(0.6), [0, 0.5 / 0.7, 0, 0.2 / 0.7, 0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(nucleus(0.8), [0.15 / 0.85, 0.5 / 0.85, 0, 0.2 / 0.85, 0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(nucleus(0.9), [0.15, 0.5, 0, 0.2, 0.1] / np.float64(0.95), rtol=1e-5, atol=1e-7)
    # temperature is applied before the nucleus: T=2 flattens to p**0.5 (normalised)
    flat = np.sqrt(probs) / np.sqrt(probs).sum()
    got = np.asarray(sampling_probs(logits, SamplingConfig(temperature=2.0, top_p=1.0)))[0]
    np.testing.assert_allclose(got, flat, rtol=1e-5)
    # greedy is a one-hot of the argmax
    np.testing.assert_array_equal(np.asarray(sampling_probs(logits, SamplingConfig()))[0], [0, 1, 0, 0, 0])


def test_sampling_config_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1.0)
    for top_p in (0.0, 1.5):
        with pytest.raises(ValueError, match="top_p"):
            SamplingConfig(temperature=1.0, top_p=top_p)


def _chi_square(counts, expected_probs):
    """Pearson statistic and p-value (scipy if installed, else None for the p-value)."""
    expected = expected_probs * counts.sum()
    statistic = float(np.sum((counts - expected) ** 2 / expected))
    try:
        from scipy import stats

        return statistic, float(stats.chi2.sf(statistic, len(counts) - 1))
    except ImportError:
        return statistic, None


# chi-square critical values at p = 1e-3 (for the no-scipy path), by degrees of freedom
_CRITICAL_1E3 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


def test_sample_token_matches_sampling_probs():
    logits = jnp.asarray(np.log([[0.4, 0.25, 0.2, 0.1, 0.05]]), jnp.float32)
    sampling = SamplingConfig(temperature=0.8, top_p=0.85)
    probs = np.asarray(sampling_probs(logits, sampling), np.float64)[0]
    kept = probs > 0
    # T=0.8 gives [0.448, 0.249, 0.189, 0.079, 0.033]: the top 3 (mass 0.887) form the 0.85 nucleus
    assert kept.tolist() == [True, True, True, False, False]

    num_samples = 20000
    keys = jax.random.split(jax.random.PRNGKey(1234), num_samples)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: sample_token(logits, k, sampling)[0]))(keys))
    counts = np.bincount(draws, minlength=5).astype(np.float64)
    assert counts[~kept].sum() == 0, f"tokens outside the nucleus drawn: {counts}"

    statistic, p_value = _chi_square(counts[kept], probs[kept])
    if p_value is not None:
        assert p_value > 1e-3, (counts, probs, statistic)
    assert statistic < _CRITICAL_1E3[int(kept.sum()) - 1], (counts, probs)

    # control: the plain softmax (no temperature, no nucleus) is clearly rejected by the same statistic
    plain = np.array([0.4, 0.25, 0.2, 0.1, 0.05])[kept]
    wrong_statistic, _ = _chi_square(counts[kept], plain / plain.sum())
    assert wrong_statistic > 3 * _CRITICAL_1E3[int(kept.sum()) - 1]


def test_sampled_generate_is_seeded_and_valid(model, prompts):
    sampling = SamplingConfig(temperature=1.0, top_p=0.9)
    first = _generate(model, prompts, sampling=sampling, seed=3)
    again = _generate(model, prompts, sampling=sampling, seed=3)
    other = _generate(model, prompts, sampling=sampling, seed=4)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    assert not np.array_equal(first.tokens, other.tokens)
    assert np.all((first.tokens >= 0) & (first.tokens < TINY_VOCAB))


# ---------------------------------------------------------------------------- input errors
def test_bad_inputs_raise(model):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model.params, model.config, [[1, 2, 3]], max_new_tokens=0)
    with pytest.raises(ValueError, match=rf"\[{TINY_VOCAB}\].*outside the vocabulary"):
        generate(model.params, model.config, [[1, TINY_VOCAB, 3]], max_new_tokens=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model.params, model.config, [[1, -5, 3]], max_new_tokens=2)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model.params, model.config, [[1, 2], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="no prompts"):
        generate(model.params, model.config, [], max_new_tokens=2)


def test_pad_prompts_right_pads():
    tokens, lengths = pad_prompts([[5, 6], [7, 8, 9, 10], [11]], pad_id=0)
    np.testing.assert_array_equal(tokens, [[5, 6, 0, 0], [7, 8, 9, 10], [11, 0, 0, 0]])
    np.testing.assert_array_equal(lengths, [2, 4, 1])
    assert tokens.dtype == np.int32


def test_generation_past_the_model_context_is_refused_unless_asked_for(model, prompts):
    """A prompt + new tokens beyond ``max_position_embeddings`` is an error before any work;
    ``allow_beyond_context=True`` (timing random-weight shapes) runs it."""
    from jaxspec.decoding.policies import SelfDraft
    from jaxspec.decoding.speculative import EngineConfig, speculative_generate

    short = model.config.replace(max_position_embeddings=40)
    with pytest.raises(ValueError, match=r"17 tokens \+ 24 new = 41 positions exceeds the context"):
        generate(model.params, short, [prompts[1]], 24)
    policy = SelfDraft(short)
    with pytest.raises(ValueError, match="max_position_embeddings=40"):
        speculative_generate(model.params, short, [prompts[1]], draft_policy=policy,
                             draft_state=policy.initial_state(np.zeros((short.num_layers, 2), bool)),
                             engine=EngineConfig(gamma=2, max_new_tokens=24))
    allowed = generate(model.params, short, [prompts[1]], 24, allow_beyond_context=True)
    assert allowed.num_generated[0] == 24


def test_continued_prefill_compiles_once_whatever_the_cache_lengths_came_from(model):
    """A continued prompt (prefill into a cache that already holds tokens) reuses the compiled chunk
    whether the cache's lengths were made on the host or returned committed by a jitted call."""
    from jaxspec.decoding import autoregressive

    rng = np.random.RandomState(1)
    first, second = rng.randint(3, TINY_VOCAB, size=(1, 20)), rng.randint(3, TINY_VOCAB, size=(1, 7))
    lengths = np.asarray([first.shape[1]], np.int32)
    base, _ = autoregressive.prefill(model.params, model.config, first, lengths, init_cache(model.config, 1, CAPACITY),
                                     chunk=CHUNK)
    outs = []
    for committed in (False, True, False):
        cache = jax.tree.map(jnp.copy, base)
        if committed:
            cache = cache.with_lengths(jax.device_put(cache.lengths, jax.devices()[0]))
        cache, logits = autoregressive.prefill(model.params, model.config, second, np.asarray([7], np.int32), cache,
                                               chunk=CHUNK)
        outs.append(np.asarray(logits))
        if not committed and len(outs) == 1:
            size = autoregressive._prefill_chunk._cache_size()
    assert autoregressive._prefill_chunk._cache_size() == size
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_run_with_warmup_releases_the_warm_up_result_before_the_timed_run():
    """The warm-up run's result (a run's caches) must not stay alive beside the timed run's own: at long context and
    large batch the two would not fit one GPU together."""
    import weakref

    from jaxspec.decoding.autoregressive import run_with_warmup

    class Result:  # stands in for a run's state
        pass

    made = []

    def run():
        assert all(ref() is None for ref in made), "an earlier run's result is still alive"
        result = Result()
        made.append(weakref.ref(result))
        return result, {"prefill_s": 0.0, "decode_s": 0.0}

    result, timings = run_with_warmup(run, warmup=True)
    assert len(made) == 2 and made[1]() is result and "compile_s" in timings
