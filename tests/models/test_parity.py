"""Parity of our forward with transformers (PyTorch, float32) on every family.

Tiny random models (built locally, see ``conftest.py``): prefill logits, decode through our KV
cache one token at a time, and (Llama-3.1) RoPE positions far beyond the original 8192 context
so the llama3 frequency scaling matters -- with a control that the test fails without it.
Real weights: SmolLM2-135M (``slow``) and Qwen2.5-Coder-0.5B (``qwen``, opt-in).

Metric: ``max|ours - ref| / max|ref|`` over all logits, bound 1e-4 (float32).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models.cache import init_cache
from jaxspec.models.llama import forward_jit

from tests.conftest import TINY_FAMILIES, TINY_VOCAB, max_rel_error

TOLERANCE = 1e-4
CAPACITY = 32  # one cache shape for every tiny parity test: compiled shapes are shared
BATCH = 2


def _tokens(seed: int, length: int, batch: int = BATCH) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, TINY_VOCAB, size=(batch, length)).astype(np.int32)


def _large_positions(length: int, batch: int = BATCH) -> np.ndarray:
    """Positions from 9000 in strides of 397: relative distances up to ~9.5k > original 8192."""
    return np.broadcast_to(9000 + 397 * np.arange(length, dtype=np.int32), (batch, length)).copy()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_prefill_logits_match_transformers(tiny_models, family):
    model = tiny_models[family]
    tokens = _tokens(1, 24)
    cache = init_cache(model.config, BATCH, CAPACITY)
    ours = forward_jit(model.params, jnp.asarray(tokens), cache, config=model.config)
    reference = model.hf_logits(tokens)
    assert ours.logits.shape == reference.shape == (BATCH, 24, TINY_VOCAB)
    assert max_rel_error(ours.logits, reference) <= TOLERANCE
    np.testing.assert_array_equal(np.asarray(ours.cache.lengths), [24, 24])


def _decode_through_cache(model, tokens, prefill_len, positions=None):
    """Prefill ``prefill_len`` tokens then feed the rest one at a time; per-step last logits ``[B, V]``."""
    cache = init_cache(model.config, tokens.shape[0], CAPACITY)
    kwargs = {} if positions is None else {"positions": jnp.asarray(positions[:, :prefill_len])}
    out = forward_jit(model.params, jnp.asarray(tokens[:, :prefill_len]), cache, config=model.config, **kwargs)
    cache = out.cache
    steps = []
    for t in range(prefill_len, tokens.shape[1]):
        kwargs = {} if positions is None else {"positions": jnp.asarray(positions[:, t:t + 1])}
        out = forward_jit(model.params, jnp.asarray(tokens[:, t:t + 1]), cache, config=model.config, **kwargs)
        cache = out.cache
        steps.append(np.asarray(out.logits[:, 0]))
    assert np.asarray(cache.lengths).tolist() == [tokens.shape[1]] * tokens.shape[0]
    return steps


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_cached_decode_matches_transformers_full_forward(tiny_models, family):
    model = tiny_models[family]
    prefill_len, num_steps = 8, 16
    tokens = _tokens(2, prefill_len + num_steps)
    steps = _decode_through_cache(model, tokens, prefill_len)
    for i, ours in enumerate(steps):
        prefix = tokens[:, : prefill_len + i + 1]
        reference = model.hf_logits(prefix)[:, -1]
        err = max_rel_error(ours, reference)
        assert err <= TOLERANCE, f"decode step {i}: rel err {err:.2e}"


def test_llama31_rope_scaling_at_large_positions(tiny_llama31):
    model = tiny_llama31
    assert model.config.rope_type == "llama3"
    tokens = _tokens(3, 24)
    positions = _large_positions(24)
    reference = model.hf_logits(tokens, position_ids=positions)
    cache = init_cache(model.config, BATCH, CAPACITY)
    ours = forward_jit(model.params, jnp.asarray(tokens), cache, config=model.config, positions=jnp.asarray(positions))
    assert max_rel_error(ours.logits, reference) <= TOLERANCE

    # Control: the same forward without the llama3 scaling must be clearly wrong, or this test proves nothing.
    unscaled_config = model.config.replace(rope_scaling=None)
    unscaled = forward_jit(model.params, jnp.asarray(tokens), cache, config=unscaled_config,
                       positions=jnp.asarray(positions))
    assert max_rel_error(unscaled.logits, reference) > 1e-3


def test_llama31_cached_decode_at_large_positions(tiny_llama31):
    model = tiny_llama31
    prefill_len, num_steps = 8, 16
    tokens = _tokens(4, prefill_len + num_steps)
    positions = _large_positions(prefill_len + num_steps)
    steps = _decode_through_cache(model, tokens, prefill_len, positions)
    for i, ours in enumerate(steps):
        end = prefill_len + i + 1
        reference = model.hf_logits(tokens[:, :end], position_ids=positions[:, :end])[:, -1]
        err = max_rel_error(ours, reference)
        assert err <= TOLERANCE, f"decode step {i} at position {positions[0, end - 1]}: rel err {err:.2e}"


# ---------------------------------------------------------------------------- real weights
PROMPT = "The three most important ideas in computer science are"


def _real_model_parity(name: str, num_tokens: int):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from jaxspec.decoding.autoregressive import generate
    from jaxspec.models.loading import load_model
    from jaxspec.models.registry import resolve_model_file

    gguf_path = resolve_model_file(name, progress=False)
    ours = load_model(name, dtype="float32", progress=False)
    assert ours.config.dtype == "float32"
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                              dtype=torch.float32)
    hf.eval()
    prompt_ids = ours.tokenizer(PROMPT)["input_ids"]
    assert len(prompt_ids) >= 5

    # prefill logits
    tokens = np.asarray([prompt_ids], np.int32)
    with torch.no_grad():
        reference = hf(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
    cache = init_cache(ours.config, 1, len(prompt_ids) + 8)
    logits = forward_jit(ours.params, jnp.asarray(tokens), cache, config=ours.config).logits
    assert logits.shape == reference.shape
    err = max_rel_error(logits, reference)
    assert err <= TOLERANCE, f"{name} prefill logits rel err {err:.2e}"

    # greedy continuation
    with torch.no_grad():
        hf_out = hf.generate(torch.as_tensor(tokens, dtype=torch.long), attention_mask=torch.ones_like(
            torch.as_tensor(tokens)), max_new_tokens=num_tokens, do_sample=False)
    hf_new = hf_out[0, len(prompt_ids):].tolist()
    result = generate(ours.params, ours.config, [prompt_ids], max_new_tokens=num_tokens)
    ours_new = result.rows()[0]
    assert len(ours_new) == num_tokens
    # transformers may stop early at its EOS; we were given no stop tokens, so compare its whole output
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
    assert len(hf_new) == num_tokens or (len(hf_new) >= 1 and hf_new[-1] in eos), hf_new
    assert ours_new[: len(hf_new)] == hf_new, (ours.tokenizer.decode(ours_new), ours.tokenizer.decode(hf_new))


@pytest.mark.slow
def test_smollm2_real_weights_match_transformers():
    _real_model_parity("smollm2-135m", 32)


@pytest.mark.slow
@pytest.mark.qwen
def test_qwen25_coder_real_weights_match_transformers():
    _real_model_parity("qwen2.5-coder-0.5b", 16)
