"""Speculative engine: lossless greedy decoding, distribution-preserving sampling, rollback, stops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import generate
from jaxspec.decoding.policies import SelfDraft, SeparateDraft, parse_skip_spec
from jaxspec.decoding.sampling import SamplingConfig, sampling_probs
from jaxspec.decoding.speculative import (EngineConfig, acceptance_from_tau, check_compatible,
                                          rejection_accept, speculative_generate)
from jaxspec.models.cache import CacheOverflowError, init_cache
from jaxspec.models.llama import forward, init_params

from tests.conftest import chi_square_pvalue

TARGET = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=16, dtype="float32")
DRAFT = TARGET.replace(num_layers=2)
PROMPTS = [np.random.RandomState(0).randint(0, 97, n).tolist() for n in (5, 17, 40)]


@pytest.fixture(scope="module")
def models():
    return init_params(TARGET, jax.random.PRNGKey(0), scale=0.2), init_params(DRAFT, jax.random.PRNGKey(5), scale=0.2)


@pytest.fixture(scope="module")
def ar_tokens(models):
    return generate(models[0], TARGET, PROMPTS, 20).rows()


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("draft", ["target", "random", "skip"])
def test_greedy_speculative_equals_autoregressive(models, ar_tokens, gamma, draft):
    target_params, draft_params = models
    if draft == "target":  # the target as its own draft: everything is accepted
        kwargs = dict(draft_policy=SeparateDraft(TARGET), draft_params=target_params)
    elif draft == "random":  # a random-weight draft: almost nothing is accepted
        kwargs = dict(draft_policy=SeparateDraft(DRAFT), draft_params=draft_params)
    else:
        policy = SelfDraft(TARGET)
        kwargs = dict(draft_policy=policy, draft_state=policy.initial_state(parse_skip_spec("mlp:odd", 4)))
    result = speculative_generate(target_params, TARGET, PROMPTS, engine=EngineConfig(gamma=gamma, max_new_tokens=20),
                                  **kwargs)
    assert result.rows() == ar_tokens
    rates = result.metrics["acceptance_rate_per_position"]
    if draft == "target":
        assert result.metrics["acceptance_rate"] == 1.0
    if draft == "random":
        assert result.metrics["acceptance_rate"] < 0.2
        assert rates[0] is not None


def test_rollback_leaves_caches_equal_to_never_drafting(models):
    target_params, draft_params = models
    result = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=SeparateDraft(DRAFT),
                                  draft_params=draft_params, engine=EngineConfig(gamma=4, max_new_tokens=12))
    state = result.final_state
    assert result.metrics["acceptance_rate"] < 0.5  # many drafts were rejected and rolled back
    committed = np.asarray(state.committed)
    for row, prompt in enumerate(PROMPTS):
        sequence = prompt + result.rows()[row]
        assert len(sequence) == committed[row]
        for params, config, cache, valid in ((target_params, TARGET, state.target_cache, committed[row] - 1),
                                             (draft_params, DRAFT, state.draft_state, committed[row] - 2)):
            fresh = init_cache(config, 1, 128)
            fresh = forward(params, jnp.asarray([sequence[:valid]]), fresh, config=config).cache
            for layer in range(config.num_layers):
                np.testing.assert_allclose(np.asarray(cache.keys[layer][row, :, :valid]),
                                           np.asarray(fresh.keys[layer][0, :, :valid]), rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(np.asarray(cache.values[layer][row, :, :valid]),
                                           np.asarray(fresh.values[layer][0, :, :valid]), rtol=1e-4, atol=1e-5)
    assert int(state.target_cache.lengths[0]) == committed[0] - 1


def test_stop_token_inside_accepted_block(models, ar_tokens):
    target_params, _ = models
    stop = ar_tokens[0][6]  # a token of row 0's greedy output, mid-sequence
    expected = generate(target_params, TARGET, PROMPTS, 20, stop_tokens=(stop,)).rows()
    result = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=SeparateDraft(TARGET),
                                  draft_params=target_params,
                                  engine=EngineConfig(gamma=5, max_new_tokens=20, stop_tokens=(stop,)))
    assert result.rows() == expected
    first = ar_tokens[0].index(stop)
    assert result.rows()[0] == ar_tokens[0][: first + 1]
    assert (result.tokens[0, first + 1:] == -1).all()
    assert result.metrics["acceptance_rate"] == 1.0  # the stop came inside a fully accepted block


@pytest.mark.parametrize("draft", ["random", "skip"])
def test_finished_rows_read_no_history_and_change_no_token(models, ar_tokens, monkeypatch, draft):
    """Once a row is done (here row 0 stops early) the engine marks it frozen each round: its forwards
    read one history slot (seen inside the jitted loop by a callback on the attention's lengths), and the
    tokens of every row are those of AR and of the loop that keeps finished rows running in full."""
    from jaxspec.models import layers

    target_params, draft_params = models
    stop = ar_tokens[0][2]
    expected = generate(target_params, TARGET, PROMPTS, 19, stop_tokens=(stop,)).rows()
    seen = []
    real = layers.attention

    def recording(config, q, k_new, v_new, cache_k, cache_v, lengths, *args):
        jax.debug.callback(lambda n: seen.append(np.asarray(n).copy()), lengths)
        return real(config, q, k_new, v_new, cache_k, cache_v, lengths, *args)

    monkeypatch.setattr(layers, "attention", recording)
    if draft == "random":
        kwargs = dict(draft_policy=SeparateDraft(DRAFT), draft_params=draft_params)
    else:
        policy = SelfDraft(TARGET)
        kwargs = dict(draft_policy=policy, draft_state=policy.initial_state(parse_skip_spec("mlp:odd", 4)))
    rows = {}
    for skip in (True, False):  # gamma 2 and 19 new tokens: a loop no other test compiles
        seen.clear()
        result = speculative_generate(target_params, TARGET, PROMPTS, engine=EngineConfig(
            gamma=2, max_new_tokens=19, stop_tokens=(stop,), skip_finished_rows=skip), **kwargs)
        rows[skip] = result.rows()
        assert result.final_state.target_cache.frozen is None
        # row 0's history length in the last forward of the loop, long after it stopped (the other rows
        # run ~8 rounds more): unmarked, it reads at least its prompt and the 2 tokens before its stop
        last = [n[0] for n in seen if n.shape == (3,)][-1]
        assert last == 1 if skip else last >= len(PROMPTS[0]) + 2
    assert rows[True] == rows[False] == expected
    assert len(expected[0]) == 3 and len(expected[1]) == 19


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_rejection_sampling_preserves_target_distribution(top_p):
    """First committed token ~ p_0 and, when all drafts are accepted, the bonus ~ p_gamma."""
    vocab, gamma, rows = 6, 3, 120_000
    sampling = SamplingConfig(temperature=1.0, top_p=top_p)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    target_logits = jnp.broadcast_to(2.0 * jax.random.normal(keys[0], (1, gamma + 1, vocab)), (rows, gamma + 1, vocab))
    draft_logits = 2.0 * jax.random.normal(keys[1], (1, gamma, vocab))
    q = jnp.broadcast_to(sampling_probs(draft_logits, sampling), (rows, gamma, vocab))
    drafts = jax.random.categorical(keys[2], jnp.log(q), axis=-1).astype(jnp.int32)
    accepted, next_token = rejection_accept(target_logits, drafts, q, sampling, keys[3])
    first = np.where(np.asarray(accepted) > 0, np.asarray(drafts[:, 0]), np.asarray(next_token))
    p = np.asarray(sampling_probs(target_logits[0], sampling))
    assert chi_square_pvalue(np.bincount(first, minlength=vocab), p[0]) > 1e-3
    # a wrong rule (e.g. always keeping the draft) must fail the same test
    assert chi_square_pvalue(np.bincount(np.asarray(drafts[:, 0]), minlength=vocab), p[0]) < 1e-6


def test_sampled_speculative_decoding_matches_target_end_to_end():
    """Tiny-vocabulary model: the joint of generated tokens 2 and 3 under speculative decoding
    (random draft, gamma 2) matches the target's own conditional distributions."""
    config = ModelConfig(vocab_size=5, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, dtype="float32")
    params = init_params(config, jax.random.PRNGKey(1), scale=0.5)
    draft_params = init_params(config, jax.random.PRNGKey(2), scale=0.5)
    rows = 3000
    prompt = [1, 2, 3]
    sampling = SamplingConfig(temperature=1.0)
    result = speculative_generate(params, config, [prompt] * rows, draft_policy=SeparateDraft(config),
                                  draft_params=draft_params,
                                  engine=EngineConfig(gamma=2, max_new_tokens=3, sampling=sampling), seed=3)
    tokens = result.tokens
    assert 0 < result.metrics["acceptance_rate"] < 1
    # exact distribution of (t2, t3) given t1, from full forwards of every prefix
    counts = np.zeros((5, 5, 5))
    np.add.at(counts, (tokens[:, 0], tokens[:, 1], tokens[:, 2]), 1)
    prefixes = np.array([[*prompt, a, b] for a in range(5) for b in range(5)])
    cache = init_cache(config, len(prefixes), 16)
    logits = np.asarray(forward(params, jnp.asarray(prefixes), cache, config=config).logits)
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1))
    for t1 in range(5):
        n = counts[t1].sum()
        if n < 200:
            continue
        p2 = probs[t1 * 5, 3]  # after prompt + t1
        joint = np.array([[p2[b] * probs[t1 * 5 + b, 4, c] for c in range(5)] for b in range(5)])
        assert chi_square_pvalue(counts[t1].reshape(-1), joint.reshape(-1)) > 1e-3


def test_fixed_acceptance_mode_is_labelled_and_follows_distribution(models):
    target_params, draft_params = models
    fixed = acceptance_from_tau(2.5, 4)
    assert abs(sum((n + 1) * p for n, p in enumerate(fixed)) - 2.5) < 1e-6
    result = speculative_generate(target_params, TARGET, [PROMPTS[0]] * 8, draft_policy=SeparateDraft(DRAFT),
                                  draft_params=draft_params,
                                  engine=EngineConfig(gamma=4, max_new_tokens=40, fixed_acceptance=fixed))
    assert "fixed" in result.metrics["acceptance_mode"]
    assert abs(result.metrics["tau_untruncated"] - 2.5) < 0.5
    assert (result.num_generated == 40).all()


def test_bad_input_errors(models):
    target_params, draft_params = models
    with pytest.raises(ValueError, match="gamma"):
        EngineConfig(gamma=0)
    with pytest.raises(ValueError, match="vocabulary size 50"):
        check_compatible(TARGET, DRAFT.replace(vocab_size=50))
    with pytest.raises(CacheOverflowError, match="gamma=4"):
        speculative_generate(target_params, TARGET, PROMPTS, draft_policy=SeparateDraft(DRAFT),
                             draft_params=draft_params, engine=EngineConfig(gamma=4, max_new_tokens=20), capacity=50)
    with pytest.raises(ValueError, match="out of range"):
        parse_skip_spec("mlp:3-9", 4)
    with pytest.raises(ValueError, match="fixed_acceptance"):
        EngineConfig(gamma=2, fixed_acceptance=(0.5, 0.5))

    class FakeTokenizer:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    with pytest.raises(ValueError, match="tokenizers differ"):
        check_compatible(TARGET, DRAFT, FakeTokenizer({"a": 0}), FakeTokenizer({"b": 0}))


# ---------------------------------------------------------------------------- the controller hook
def test_default_controller_is_one_dispatch_and_a_chunked_one_keeps_the_output(models, ar_tokens, monkeypatch):
    """The default controller runs every round in one ``run_loop`` call; a controller mixing short
    chunks, a smaller gamma and a plain-decoding stretch gives AR's output and counts only the
    speculative rounds' tokens in tau. ``profile=True`` follows the controller's chunks."""
    from jaxspec.decoding import speculative
    from jaxspec.decoding.contract import Chunk, ControllerBase

    target_params, draft_params = models
    calls = []
    real = speculative.run_loop

    def counted(*args, **kwargs):
        calls.append(kwargs.get("max_rounds"))
        return real(*args, **kwargs)

    monkeypatch.setattr(speculative, "run_loop", counted)
    kwargs = dict(draft_policy=SeparateDraft(DRAFT), draft_params=draft_params,
                  engine=EngineConfig(gamma=3, max_new_tokens=20))
    plain = speculative_generate(target_params, TARGET, PROMPTS, **kwargs)
    assert calls == [None] and plain.rows() == ar_tokens

    class Chunked(ControllerBase):
        def start(self, run):
            self.script = [Chunk(rounds=2), Chunk(rounds=2, gamma=1), Chunk(plain_steps=3), Chunk()]
            self.seen = []

        def next_chunk(self, run):
            self.seen.append(run.last_chunk)
            return self.script.pop(0) if self.script else None

        def finish(self, run):
            return {"plain_tokens": run.counters.plain_tokens, "gammas": sorted(run.counters.gammas_used)}, {}

    calls.clear()
    controller = Chunked()
    result = speculative_generate(target_params, TARGET, PROMPTS, controller=controller, profile=True, **kwargs)
    assert result.rows() == ar_tokens
    assert calls == [2, 2, None] and controller.seen[:3] == [0, 2, 2]
    assert result.metrics["gammas"] == [1, 3] and result.metrics["plain_tokens"] == 9  # 3 rows x 3 steps
    assert result.timings["profile_rounds"] > 0
    rounds_tokens = int((result.num_generated - 1).sum()) - result.metrics["plain_tokens"]
    assert result.metrics["tau"] == rounds_tokens / result.metrics["row_rounds"]
    per_row = result.metrics["rounds_per_row"]
    assert len(per_row) == len(PROMPTS) and sum(per_row) == result.metrics["row_rounds"]
    assert max(per_row) <= result.metrics["rounds"]  # the loop ran until its busiest row was done

    class TooWide(Chunked):
        def start(self, run):
            self.script, self.seen = [Chunk(gamma=4)], []

    with pytest.raises(ValueError, match="gamma=4 exceeds the engine's gamma=3"):
        speculative_generate(target_params, TARGET, PROMPTS, controller=TooWide(), **kwargs)


def test_a_policy_outside_the_contract_is_refused(models):
    class NotADraft:
        name = "nothing"

    with pytest.raises(TypeError, match="is not a DraftPolicy.*DraftPolicyBase"):
        speculative_generate(models[0], TARGET, PROMPTS, draft_policy=NotADraft())


def test_precompiled_loops_leave_the_runs_nothing_to_compile(models):
    """`precompile_loops` builds each (draft, verify) pair's round loop in a thread pool before any run;
    the runs that follow, with the same arguments, compile no program and decode as without it."""
    from jaxspec.decoding.autoregressive import prefill
    from jaxspec.decoding.policies import DenseVerify
    from jaxspec.decoding.speculative import precompile_loops

    target_params, draft_params = models
    tokens = np.random.RandomState(1).randint(0, 97, (2, 24)).astype(np.int32)
    lengths = np.full((2,), 24, np.int32)
    capacity, engine = 64, EngineConfig(gamma=3, max_new_tokens=10)
    prefilled = prefill(target_params, TARGET, tokens, lengths, init_cache(TARGET, 2, capacity))
    pairs = [(SeparateDraft(DRAFT), DenseVerify()), (SeparateDraft(DRAFT, name="another-draft"), DenseVerify())]
    draft_cache = pairs[0][0].prefill(draft_params, tokens, lengths, capacity)
    kwargs = dict(prompt_tokens=(tokens, lengths), draft_params=draft_params, draft_state=draft_cache, engine=engine,
                  capacity=capacity, prefilled=prefilled)
    plain = speculative_generate(target_params, TARGET, [], draft_policy=pairs[0][0], **kwargs)
    compiles = []
    listener = lambda name, seconds, **_: compiles.append(name) if name.endswith("backend_compile_duration") else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        report = precompile_loops(target_params, TARGET, pairs, tokens=tokens, lengths=lengths, capacity=capacity,
                                  engine=engine, draft_params=draft_params, draft_state=draft_cache,
                                  prefilled=prefilled)
        assert report["programs"] == 2 and report["threads"] == 2 and compiles  # the second pair's loop is new
        built = len(compiles)
        results = [speculative_generate(target_params, TARGET, [], draft_policy=draft, verify_policy=verify, **kwargs)
                   for draft, verify in pairs]
        assert len(compiles) == built, compiles[built:]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert all(np.array_equal(r.tokens, plain.tokens) for r in results)



@pytest.mark.parametrize("draft_kind", ["separate", "magicdec"])
def test_speculative_rounds_after_plain_decoding(models, draft_kind):
    """Chunks of speculative rounds, plain decoding, speculative rounds again (a measured choice that
    probes both modes and speculates on; docs/methods.md §5.2):

    * the round loop compiles once: the state enters every chunk with the same placement whether it
      came from the prefill or from plain decoding (a second compile of a 32k loop inside a timed run
      costs seconds);
    * the draft's own cache holds the K/V of the tokens plain decoding committed (the draft catches
      up before its next round): at the end, every position before ``committed - 2`` equals a fresh
      draft prefill of the whole sequence, and the output is AR's."""
    from jaxspec.baselines.magicdec import MagicDecDraft
    from jaxspec.decoding.autoregressive import generate, prefill
    from jaxspec.decoding.contract import Chunk, ScriptedController
    from jaxspec.decoding.speculative import loop_jit

    class SpecPlainSpec(ScriptedController):
        def chunks(self, run):
            yield Chunk(rounds=2)
            yield Chunk(plain_steps=3)
            yield Chunk(plain_steps=2)  # one stretch of two chunks: one catch-up
            yield Chunk(rounds=2)
            state = run.state
            self.final = (jax.tree.map(jnp.copy, state.draft_state), np.asarray(state.out),
                          np.asarray(state.num_out), np.asarray(state.committed))

    # weights placed on the device (as a loaded model's are): every jitted output is then committed too
    target_params, draft_params = jax.device_put(models, jax.devices()[0])
    tokens = np.random.RandomState(2).randint(0, 97, (2, 20)).astype(np.int32)
    lengths = np.array([20, 13], np.int32)
    capacity, engine = 64, EngineConfig(gamma=3, max_new_tokens=16)
    prefilled = prefill(target_params, TARGET, tokens, lengths, init_cache(TARGET, 2, capacity))
    draft = {"separate": SeparateDraft(DRAFT, name="spec-plain-spec"),  # loops no other test compiles
             "magicdec": MagicDecDraft(DRAFT, sinks=2, window=62, name="spec-plain-spec")}[draft_kind]
    # (MagicDec with sinks + window >= the capacity: its rounds write the K/V a dense prefill does)
    draft_cache = draft.prefill(draft_params, tokens, lengths, capacity)
    before = loop_jit._cache_size()
    controller = SpecPlainSpec()
    result = speculative_generate(target_params, TARGET, [], prompt_tokens=(tokens, lengths), draft_policy=draft,
                                  draft_params=draft_params, draft_state=draft_cache, engine=engine,
                                  capacity=capacity, prefilled=prefilled, controller=controller)
    assert loop_jit._cache_size() == before + 1
    ar = generate(target_params, TARGET, [tokens[b, :lengths[b]].tolist() for b in range(2)], 16).rows()
    rows = result.rows()  # the scripted chunks end before max_new_tokens: a prefix of AR's output
    assert all(row == ar_row[:len(row)] for row, ar_row in zip(rows, ar))
    cache, out, num_out, committed = controller.final
    assert (num_out >= 2 + 5 + 2).all()  # rounds, then 5 plain tokens, then rounds: each row ran all three
    assert [len(row) for row in rows] == num_out.tolist()
    for b in range(2):
        sequence = np.concatenate([tokens[b, :lengths[b]], out[b, :num_out[b]]])[None].astype(np.int32)
        fresh = SeparateDraft(DRAFT).prefill(draft_params, sequence, np.array([sequence.shape[1]]), capacity)
        n = int(committed[b]) - 2
        for layer in range(DRAFT.num_layers):
            np.testing.assert_allclose(np.asarray(cache.keys[layer][b, :, :n]), np.asarray(fresh.keys[layer][0, :, :n]),
                                       rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(np.asarray(cache.values[layer][b, :, :n]),
                                       np.asarray(fresh.values[layer][0, :, :n]), rtol=1e-4, atol=1e-5)


def _entry_copies(hlo: str, shape: str):
    """Copy instructions of ``shape`` (e.g. ``f32[3,2,64,16]``) in the entry computation of ``hlo``."""
    entry = hlo[hlo.index("\nENTRY "):]
    entry = entry[: entry.index("\n}")]
    return [line for line in entry.splitlines() if " copy(" in line and f"= {shape}" in line]


def test_plain_decoding_reuses_the_donated_cache(models):
    """A stretch of plain decoding writes into the state's own cache: no copy of a cache buffer in the
    compiled program's entry (a forward before the decode loop made XLA copy the whole cache into
    the loop and out again, twice the cache's bytes per stretch; docs/methods.md §5.2)."""
    from jaxspec.decoding.speculative import loop_state_from_caches, plain_decode

    target_params, _ = models
    engine = EngineConfig(gamma=3, max_new_tokens=16)
    cache = init_cache(TARGET, 3, 64).with_lengths(jnp.array([5, 17, 40], jnp.int32))
    state = loop_state_from_caches(cache, None, jnp.array([1, 2, 3]), jnp.array([4, 5, 6]), engine)
    hlo = plain_decode.lower(target_params, state, jnp.int32(4), config=TARGET, engine=engine,
                             steps=16).compile().as_text()
    shape = f"f32[{','.join(map(str, cache.keys[0].shape))}]"
    assert "while" in hlo and shape in hlo
    assert _entry_copies(hlo, shape) == []


@pytest.mark.parametrize("num_steps", [1, 5, 16])
def test_plain_decoding_with_a_static_bound_commits_the_same_tokens(models, num_steps):
    """``static_bound``: the loop counts up to the static buffer size from a traced start, and the tokens are moved
    back after it; the state it returns equals the traced bound's, with a stop token, a row that finishes on its
    limit and one already done; no copy of a cache buffer in the program's entry either way."""
    from jaxspec.decoding.speculative import loop_state_from_caches, plain_decode

    target_params, _ = models
    cache = init_cache(TARGET, 3, 64).with_lengths(jnp.array([5, 17, 40], jnp.int32))
    filled = plain_decode(target_params, loop_state_from_caches(cache, None, jnp.array([1, 2, 3]),
                                                                jnp.array([4, 5, 6]), EngineConfig(gamma=3, max_new_tokens=16)),
                          jnp.int32(6), config=TARGET, engine=EngineConfig(gamma=3, max_new_tokens=16), steps=16)[0]
    stop = int(np.asarray(filled.out)[0, 3])  # a token row 0 samples: it stops there
    first_stop = int(np.argmax(np.asarray(filled.out)[0, 1:] == stop)) + 1  # its first sampled position
    engine = EngineConfig(gamma=3, max_new_tokens=12, stop_tokens=(stop,))

    def state():
        fresh = init_cache(TARGET, 3, 64).with_lengths(jnp.array([5, 17, 40], jnp.int32))
        s = loop_state_from_caches(fresh, None, jnp.array([1, 2, 3]), jnp.array([4, 5, 6]), engine,
                                   done=jnp.array([False, False, True]))
        return s._replace(num_out=jnp.array([1, 6, 1], jnp.int32))  # row 1 reaches its 12-token limit first

    got = {}
    for bound in (False, True):
        s, count = plain_decode(target_params, state(), jnp.int32(num_steps), config=TARGET, engine=engine, steps=16,
                                static_bound=bound)
        got[bound] = (np.asarray(count), np.asarray(s.out), np.asarray(s.num_out), np.asarray(s.done),
                      np.asarray(s.pending), np.asarray(s.previous), np.asarray(s.target_cache.lengths),
                      np.asarray(s.target_cache.keys[0]))
    for a, b in zip(got[False], got[True]):
        np.testing.assert_array_equal(a, b)
    assert got[True][0].tolist() == [min(num_steps, first_stop), min(num_steps, 6), 0]
    hlo = plain_decode.lower(target_params, state(), jnp.int32(4), config=TARGET, engine=engine, steps=16,
                             static_bound=True).compile().as_text()
    assert _entry_copies(hlo, f"f32[{','.join(map(str, cache.keys[0].shape))}]") == []


def test_round_schedule_runs_each_round_as_its_phase(models, ar_tokens):
    """A verify policy with a round schedule (``round_period``, docs/methods.md §3.7): the loop runs whole cycles,
    each round compiled as ``at_phase(j)``, while a cycle fits (under the chunk's limit, and some row with at least
    ``period * (gamma + 1)`` tokens to go); a chunk that starts inside a cycle first aligns it, and the rounds left
    after the last whole cycle read their kind from the state. The target as its own draft commits 4 tokens a
    round: 19 tokens after the prefill's are one cycle (12) and two single rounds. A row that stops at a stop
    token inside a cycle leaves its last rounds with no row active: they count no round. Tokens are AR's."""
    import dataclasses
    from typing import Optional

    from jaxspec.decoding.contract import Chunk, ScriptedController
    from jaxspec.decoding.policies import DenseVerify

    @dataclasses.dataclass(frozen=True)
    class Phased(DenseVerify):
        name: str = "phased"
        period: int = 3
        phase: Optional[int] = None  # fixed when compiled (at_phase); None: read from the state (+10 in the log)

        @property
        def round_period(self):
            return self.period

        def prefill(self, target_params, target_cache, tokens, prompt_lengths):
            return {"count": jnp.zeros((), jnp.int32), "log": jnp.full((16,), -1, jnp.int32)}

        def round_phase(self, state):
            return state["count"] % self.period

        def at_phase(self, phase):
            return dataclasses.replace(self, phase=phase)

        def update(self, state, probes, num_committed, committed):
            kind = state["count"] % self.period + 10 if self.phase is None else jnp.int32(self.phase)
            return {"count": state["count"] + 1, "log": state["log"].at[state["count"]].set(kind)}

    class EveryFour(ScriptedController):
        def chunks(self, run):
            while not run.finished():
                yield Chunk(rounds=4)

    def run(period, controller=None, prompts=PROMPTS, **engine_args):
        engine = EngineConfig(gamma=3, max_new_tokens=20, **engine_args)
        result = speculative_generate(target_params, TARGET, prompts, draft_policy=SeparateDraft(TARGET),
                                      draft_params=target_params, verify_policy=Phased(period=period), engine=engine,
                                      controller=controller)
        log = np.asarray(result.final_state.verify_state["log"])
        return result.rows(), result.metrics["rounds"], log[log >= 0].tolist()

    target_params, _ = models
    assert run(3) == (ar_tokens, 5, [0, 1, 2, 10, 11])  # one cycle, then 7 tokens to go: single rounds
    assert run(3, EveryFour()) == (ar_tokens, 5, [0, 1, 2, 10, 11])  # chunk 2 starts at phase 1: a single round
    assert run(1) == (ar_tokens, 5, [10] * 5)  # no schedule: one round body
    # one row stopping at a token of its round 1: the cycle's third round runs with no row active
    row = ar_tokens[0]
    stop = next(i for i in range(5, 8) if row[i] not in row[:i])
    tokens, rounds, log = run(3, prompts=PROMPTS[:1], stop_tokens=(row[stop],))
    assert tokens == [row[:stop + 1]] and rounds == 2 and log == [0, 1, 2]
    assert run(1, prompts=PROMPTS[:1], stop_tokens=(row[stop],)) == ([row[:stop + 1]], 2, [10, 10])
