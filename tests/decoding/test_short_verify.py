"""A round in which no row drafted anything verifies the pending token alone (EngineConfig.short_verify,
docs/methods.md §5.8): the same logits for that token, the same tokens as the full
verification and as AR; and the cache is still updated in place."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.baselines.prompt_lookup import PromptLookupDraft
from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import generate
from jaxspec.decoding.contract import Proposal, VerifyPolicyBase
from jaxspec.decoding.policies import DenseVerify, SelfDraft, SeparateDraft
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.speculative import (EngineConfig, loop_jit, prefill_loop_state, short_verify_supported,
                                          skip_drafts_of, speculative_generate, verify_phase)
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import forward, init_params

CONFIG = ModelConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, dtype="float32")
GAMMA = 3
LOOKUP = PromptLookupDraft(CONFIG.vocab_size)


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, jax.random.PRNGKey(3), scale=0.3)


def test_short_verification_gives_the_pending_tokens_logits(params):
    """verify_phase with skip_drafts: every returned row holds the logits the full verification gives its
    first row (the pending token), and the pending token's K/V land where the full one writes them."""
    rng = np.random.RandomState(0)
    batch, prompt = 2, 12
    tokens = jnp.asarray(rng.randint(0, CONFIG.vocab_size, (batch, prompt)), jnp.int32)
    cache = forward(params, tokens, init_cache(CONFIG, batch, 32), config=CONFIG).cache
    committed = jnp.full((batch,), prompt + 1, jnp.int32)  # the prompt plus the pending token
    pending = jnp.asarray(rng.randint(0, CONFIG.vocab_size, (batch,)), jnp.int32)
    drafts = jnp.asarray(rng.randint(0, CONFIG.vocab_size, (batch, GAMMA)), jnp.int32)
    static = dict(target_config=CONFIG, verify_policy=DenseVerify(), engine=EngineConfig(gamma=GAMMA))
    full, full_cache, _ = verify_phase(params, cache, None, committed, pending, drafts, None, **static)
    short, short_cache, _ = verify_phase(params, cache, None, committed, pending, drafts, None, jnp.asarray(True),
                                         **static)
    taken, _, _ = verify_phase(params, cache, None, committed, pending, drafts, None, jnp.asarray(False), **static)
    assert short.shape == full.shape
    np.testing.assert_allclose(np.asarray(short), np.broadcast_to(np.asarray(full)[:, :1], full.shape),
                               rtol=1e-4, atol=1e-4)
    # the cond's other branch is the full verification (compiled inside the cond: equal up to rounding)
    np.testing.assert_allclose(np.asarray(taken), np.asarray(full), rtol=1e-4, atol=1e-4)
    slot = prompt  # committed - 1: where the pending token's K/V go
    compared = 0
    for short_layer, full_layer in zip(jax.tree.leaves(short_cache), jax.tree.leaves(full_cache)):
        if short_layer.ndim == 4:  # [B, KV heads, capacity, head dim]: each layer's K and V
            np.testing.assert_allclose(np.asarray(short_layer)[:, :, : slot + 1],
                                       np.asarray(full_layer)[:, :, : slot + 1], rtol=1e-4, atol=1e-4)
            compared += 1
    assert compared == 2 * CONFIG.num_layers


def test_which_rounds_and_policies_take_it():
    engine = EngineConfig(gamma=GAMMA)  # the default
    tokens = jnp.zeros((2, GAMMA), jnp.int32)
    none = Proposal(tokens, None, None, None, num_drafted=jnp.asarray([0, 0], jnp.int32))
    some = Proposal(tokens, None, None, None, num_drafted=jnp.asarray([0, 2], jnp.int32))
    always = Proposal(tokens, None, None, None)  # no num_drafted: every row drafts gamma
    live, one_done = jnp.asarray([False, False]), jnp.asarray([False, True])
    dense = DenseVerify()
    assert bool(skip_drafts_of(none, live, draft_policy=LOOKUP, verify_policy=dense, engine=engine))
    assert not bool(skip_drafts_of(some, live, draft_policy=LOOKUP, verify_policy=dense, engine=engine))
    # a finished row's drafts do not count
    assert bool(skip_drafts_of(some, one_done, draft_policy=LOOKUP, verify_policy=dense, engine=engine))
    assert skip_drafts_of(always, live, draft_policy=LOOKUP, verify_policy=dense, engine=engine) is None
    off = EngineConfig(gamma=GAMMA, short_verify=False)
    assert skip_drafts_of(none, live, draft_policy=LOOKUP, verify_policy=dense, engine=off) is None
    assert short_verify_supported(dense)
    # a draft that never drafts nothing in every row (KnapSpec's early exit keeps its first token): no branch
    assert skip_drafts_of(none, live, draft_policy=SeparateDraft(CONFIG), verify_policy=dense, engine=engine) is None
    # a policy with its own verification forward (e.g. Quest, Dustin) or with probes: always the full one

    class Probing(DenseVerify):
        @property
        def probe_heads(self):
            return ((0, 0),)

    class OwnForward(VerifyPolicyBase):
        def verify_forward(self, target_params, rows, target_cache, committed, signals, *, config, state):
            raise AssertionError("not called")

    assert not short_verify_supported(Probing()) and not short_verify_supported(OwnForward())
    assert skip_drafts_of(none, live, draft_policy=LOOKUP, verify_policy=Probing(), engine=engine) is None


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "sampled"])
def test_prompt_lookup_same_tokens_with_and_without_it(params, sampling):
    """Prompt lookup at batch 1 on a prompt of distinct tokens: rounds without a match verify one row.
    The tokens equal the full verification's (the same random draws in sampling, which happen outside
    the verification) and, greedily, AR's."""
    prompt = list(range(1, 41))  # no token repeats: the lookup finds nothing until the output repeats
    runs = {}
    for short in (True, False):
        engine = EngineConfig(gamma=GAMMA, max_new_tokens=24, sampling=sampling, short_verify=short)
        runs[short] = speculative_generate(params, CONFIG, [prompt], draft_policy=PromptLookupDraft(CONFIG.vocab_size),
                                           engine=engine, seed=7)
    assert runs[True].metrics["drafted_histogram"][0] > 0  # rounds that drafted nothing: the short branch ran
    assert runs[True].rows() == runs[False].rows()
    if sampling.greedy:
        assert runs[True].rows() == generate(params, CONFIG, [prompt], 24).rows()


def test_a_separate_draft_keeps_the_full_verification(params):
    """A draft that always drafts gamma (no num_drafted) compiles no short branch: the same tokens as AR."""
    draft = init_params(CONFIG.replace(num_layers=1), jax.random.PRNGKey(4), scale=0.3)
    prompt = list(range(1, 21))
    result = speculative_generate(params, CONFIG, [prompt], draft_policy=SeparateDraft(CONFIG.replace(num_layers=1)),
                                  draft_params=draft, engine=EngineConfig(gamma=GAMMA, max_new_tokens=12))
    assert result.rows() == generate(params, CONFIG, [prompt], 12).rows()


CAPACITY = 4096  # a cache length no other buffer of the loops below has


def _cache_copies(params, draft_policy, draft_params, draft_state, engine):
    """Cache-sized copies in the compiled round loop (its text) and whether it holds a conditional."""
    pattern = re.compile(rf"= f32\[1,{CONFIG.num_kv_heads},{CAPACITY},{CONFIG.head_dim}\]\{{[^}}]*\}} copy\(")
    static = dict(target_config=CONFIG, draft_policy=draft_policy, verify_policy=DenseVerify(), engine=engine)
    state = prefill_loop_state(params, CONFIG, np.arange(1, 41)[None], np.array([40]), CAPACITY,
                               draft_policy=draft_policy, draft_params=draft_params, draft_state=draft_state,
                               verify_policy=DenseVerify(), verify_state=None, engine=engine)
    text = loop_jit.lower(params, draft_params, state, **static).compile().as_text()
    return len(pattern.findall(text)), " conditional(" in text


def test_the_loop_updates_the_cache_in_place(params):
    """The compiled round loop (prompt lookup, dense verification) copies no cache-sized buffer, with or
    without the short verification: its conditional only reads the cache, the new K/V are written after it
    (a conditional whose branches wrote the cache had XLA copy every layer's K and V each round)."""
    for short in (False, True):
        engine = EngineConfig(gamma=GAMMA, max_new_tokens=8, short_verify=short)
        assert _cache_copies(params, LOOKUP, None, None, engine) == (0, short)


def test_other_round_loops_update_the_caches_in_place(params):
    """The same for a separate draft (its own cache of the same shape) and a self-draft whose dynamic skip
    mask switches each sub-layer with a lax.cond (KnapSpec's draft): no cache-sized copy."""
    engine = EngineConfig(gamma=GAMMA, max_new_tokens=8)
    one_layer = CONFIG.replace(num_layers=1)
    draft = init_params(one_layer, jax.random.PRNGKey(4), scale=0.3)
    assert _cache_copies(params, SeparateDraft(one_layer), draft, None, engine) == (0, False)
    mask = np.zeros((CONFIG.num_layers, 2), bool)
    mask[1, 1] = True
    self_draft = SelfDraft(CONFIG)
    assert _cache_copies(params, self_draft, params, self_draft.initial_state(mask), engine) == (0, True)
