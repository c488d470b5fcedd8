"""What the compiled decode step does with the KV cache: it updates it in place.

A decode step reads each layer's whole cache and writes one slot of it. Two things used to turn
that into copies of the whole cache on the CPU (docs/methods.md §2, in-place cache writes):

* the new K/V did not depend on the attention's read of the old cache, so nothing ordered the
  in-place write after the read and XLA copied each layer's K and V (twice per step in a loop);
* the score product had the queries on the left, so the CPU's dot materialised ``K^T`` (a prefill's
  many query rows keep that order: there the transposed scores would cost more).

These tests compile the loops the library runs (AR's ``decode_loop``, the latency profile's
loop of static and dynamic skip masks) and check their optimised HLO for both, and that the
keys-first score product equals the plain einsum.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import decode_loop
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.knapspec.latency import forward_loop_fn
from jaxspec.models.attention import grouped_key_scores, key_scores
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import freeze_skip_mask
from jaxspec.models.params import init_params

CAPACITY = 256
CONFIG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=16, dtype="float32", attention_backend="xla")
LAYER_ELEMENTS = CONFIG.num_kv_heads * CAPACITY * CONFIG.head_dim  # one layer's K (or V) at batch 1

_SHAPED = re.compile(r"= f32\[([0-9,]*)\]\{[0-9,]*\} (\S+?)\(")


def _big_values(hlo: str):
    """``(shape, opcode)`` of every f32 value of at least one layer's cache size in ``hlo``."""
    out = []
    for dims, op in _SHAPED.findall(hlo):
        shape = tuple(int(d) for d in dims.split(",") if d)
        if int(np.prod(shape)) >= LAYER_ELEMENTS:
            out.append((shape, op))
    return out


def _check_in_place(hlo: str) -> None:
    big = _big_values(hlo)
    copies = [v for v in big if v[1] == "copy"]
    transposed = [v for v in big if v[0][-2:] == (CONFIG.head_dim, CAPACITY)]  # K^T of a layer
    assert not copies, f"whole-cache copies in the compiled loop: {copies}"
    assert not transposed, f"transposed keys materialised in the compiled loop: {transposed}"
    assert big, "the check saw no cache-sized value at all: the HLO pattern no longer matches"


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, jax.random.PRNGKey(0), scale=0.2)


def test_ar_decode_loop_updates_the_cache_in_place(params):
    cache = init_cache(CONFIG, 1, CAPACITY, lengths=jnp.asarray([100]))
    logits = jnp.zeros((1, CONFIG.vocab_size), jnp.float32)
    hlo = decode_loop.lower(params, cache, logits, jax.random.PRNGKey(0), config=CONFIG, sampling=SamplingConfig(),
                            max_new_tokens=8, stop_tokens=()).compile().as_text()
    _check_in_place(hlo)


@pytest.mark.parametrize("mask_kind", ["none", "static", "dynamic"])
def test_draft_forward_loop_updates_the_cache_in_place(params, mask_kind):
    mask = np.zeros((CONFIG.num_layers, 2), bool)
    mask[1, 0] = mask[2, 1] = True
    loop = jax.jit(forward_loop_fn, static_argnames=("config", "steps", "mask"), donate_argnames=("cache",))
    cache = init_cache(CONFIG, 1, CAPACITY, lengths=jnp.asarray([100]))
    tokens = jnp.zeros((1, 1), jnp.int32)
    if mask_kind == "dynamic":
        lowered = jax.jit(forward_loop_fn, static_argnames=("config", "steps"), donate_argnames=("cache",)).lower(
            params, cache, tokens, jnp.asarray(mask), config=CONFIG, steps=4)
    else:
        static = None if mask_kind == "none" else freeze_skip_mask(mask)
        lowered = loop.lower(params, cache, tokens, mask=static, config=CONFIG, steps=4)
    _check_in_place(lowered.compile().as_text())


@pytest.mark.parametrize("rows", [5, 13])  # keys on the left (rows <= D = 8) and queries on the left (prefill)
@pytest.mark.parametrize("lead", [(), (2,), (2, 3)])
def test_key_scores_equal_the_einsum(lead, rows):
    rng = np.random.default_rng(0)
    keys = jnp.asarray(rng.standard_normal(lead + (37, 8)), jnp.float32)
    queries = jnp.asarray(rng.standard_normal(lead + (rows, 8)), jnp.float32)
    want = jnp.einsum("...md,...sd->...ms", queries, keys)
    np.testing.assert_allclose(np.asarray(key_scores(keys, queries)), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_grouped_key_scores_equal_the_einsum():
    rng = np.random.default_rng(1)
    keys = jnp.asarray(rng.standard_normal((2, 3, 41, 8)), jnp.float32)
    qg = jnp.asarray(rng.standard_normal((2, 3, 4, 5, 8)), jnp.float32)  # [B, Hkv, G, T, D]
    want = jnp.einsum("bkgtd,bksd->bkgts", qg, keys)
    got = grouped_key_scores(keys, qg)
    assert got.shape == (2, 3, 4, 5, 41) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
