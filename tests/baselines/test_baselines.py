"""Baselines (StreamingLLM, SnapKV, Quest verification; MagicDec drafts): index rules against numpy
references, never padding, dense when the budget covers the history, lossless greedy output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.baselines import (MagicDecDraft, MagicDecSelfDraft, QuestVerify, SnapKVVerify, StreamingVerify,
                               page_bounds, page_scores, quest_mask, quest_speculative_generate,
                               quest_verify_forward, snapkv_scores, snapkv_select, streaming_indices)
from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import generate, pad_prompts, prefill
from jaxspec.decoding.policies import SeparateDraft
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.speculative import EngineConfig, speculative_generate
from jaxspec.dustin.selection import select_top_k
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import forward_jit, init_params

# 3 target layers: 0 and 1 are Quest's dense layers, 2 is paged. Every speculative run compiles its own loop
# (~4 s on 2 CPU cores), so the end-to-end checks are combined: a sparse draft with a full-budget verifier.
TARGET = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                     head_dim=16, dtype="float32")
DRAFT = TARGET.replace(num_layers=1)
PROMPTS = [np.random.RandomState(1).randint(0, 97, n).tolist() for n in (9, 50, 90)]
NEW = 16
ENGINE = EngineConfig(gamma=3, max_new_tokens=NEW)
FULL = 128  # >= longest prompt + NEW + gamma + 1: every budget below this size covers the history
quest_forward = jax.jit(quest_verify_forward, static_argnames=("config", "budget", "dense_layers"))


@pytest.fixture(scope="module")
def models():
    return init_params(TARGET, jax.random.PRNGKey(0), scale=0.2), init_params(DRAFT, jax.random.PRNGKey(5), scale=0.2)


@pytest.fixture(scope="module")
def ar_tokens(models):
    return generate(models[0], TARGET, PROMPTS, NEW).rows()


@pytest.fixture(scope="module")
def classic(models):
    target, draft = models
    return speculative_generate(target, TARGET, PROMPTS, draft_policy=SeparateDraft(DRAFT), draft_params=draft,
                                engine=ENGINE)


def assert_clean(indices, lengths):
    """-1 padding only; every other entry a valid history position, no duplicates."""
    indices = np.asarray(indices)
    for row, n in zip(indices, np.asarray(lengths)):
        kept = row[row >= 0]
        assert np.all((row == -1) | ((row >= 0) & (row < n)))
        assert len(set(kept.tolist())) == len(kept)


# ---------------------------------------------------------------------------- StreamingLLM
def np_streaming(n, sinks, window):
    return sorted(set(range(min(sinks, n))) | set(range(max(n - window, 0), n)))


def test_streaming_indices_follow_rule():
    lengths = np.array([0, 1, 3, 4, 7, 15, 16, 17, 40, 1000])
    for sinks, window in [(4, 12), (0, 16), (16, 0), (1, 1)]:
        out = np.asarray(streaming_indices(jnp.asarray(lengths), sinks=sinks, window=window))
        assert out.shape == (len(lengths), sinks + window)
        assert_clean(out, lengths)
        for row, n in zip(out, lengths):
            assert row[row >= 0].tolist() == np_streaming(n, sinks, window)
            if n <= sinks + window:  # the budget covers the history: dense
                assert row[row >= 0].tolist() == list(range(n))
    # the same set as the exact selector with nothing to choose beyond the protected positions
    scores = jnp.asarray(np.random.RandomState(0).randn(len(lengths), 1024), jnp.float32)
    np.testing.assert_array_equal(streaming_indices(jnp.asarray(lengths), sinks=4, window=12),
                                  select_top_k(scores, jnp.asarray(lengths), k=16, sinks=4, window=12))
    policy = StreamingVerify(sinks=2, window=6)
    committed = jnp.asarray([3, 20])
    np.testing.assert_array_equal(policy.verify_indices(None, None, committed, None),
                                  streaming_indices(committed - 1, sinks=2, window=6))


def test_streaming_verify_full_budget_equals_ar(models, ar_tokens):
    """Also docs/methods.md §5's combination: a MagicDec (sparse-KV) draft with a sparse verifier in one run."""
    target, draft = models
    result = speculative_generate(target, TARGET, PROMPTS, draft_policy=MagicDecDraft(DRAFT, sinks=2, window=6),
                                  draft_params=draft, verify_policy=StreamingVerify(sinks=4, window=FULL - 4),
                                  engine=ENGINE)
    assert result.rows() == ar_tokens


# ---------------------------------------------------------------------------- SnapKV
def np_avg_pool(x, kernel):
    padded = np.pad(x, kernel // 2)
    return np.array([padded[i:i + kernel].sum() / kernel for i in range(len(x))])


def np_topk_positions(scores, candidates, count):
    """Top ``count`` of ``candidates`` by (score descending, position ascending)."""
    order = sorted(candidates, key=lambda p: (-scores[p], p))
    return order[:count]


def test_snapkv_scores_and_selection_follow_rule(models):
    target, _ = models
    tokens, lengths = pad_prompts(PROMPTS)
    window, kernel, budget = 32, 7, 48
    cache = init_cache(TARGET, len(PROMPTS), tokens.shape[1])
    cache, _ = prefill(target, TARGET, tokens, lengths, cache)
    ours = np.asarray(snapkv_scores(target, TARGET, tokens, lengths, cache, window=window, kernel=kernel))
    # independent path: the window re-run over the prefix with every head probed; the probe probabilities
    # over the history are SnapKV's attn_weights[..., :-window] (softmax over prefix + causal window)
    probe = tuple((layer, head) for layer in range(TARGET.num_layers) for head in range(TARGET.num_heads))
    start = np.maximum(lengths - window, 0)
    window_tokens = tokens[np.arange(len(PROMPTS))[:, None], np.minimum(start[:, None] + np.arange(window),
                                                                         tokens.shape[1] - 1)]
    out = forward_jit(target, jnp.asarray(window_tokens), cache.with_lengths(jnp.asarray(start)), config=TARGET,
                  probe_heads=probe)
    probs = np.asarray(out.probes.history_probs, np.float64)  # [B, L * Hq, W, S]
    for row, n in enumerate(lengths):
        reference = np.zeros(tokens.shape[1])
        if start[row] > 0:
            reference[:start[row]] = np_avg_pool(probs[row].sum(axis=(0, 1))[:start[row]], kernel)
        np.testing.assert_allclose(ours[row], reference, rtol=1e-4, atol=1e-6)
    selected = np.asarray(snapkv_select(jnp.asarray(ours), lengths, budget=budget, window=window))
    assert selected.shape == (len(PROMPTS), budget)
    assert_clean(selected, lengths)
    for row, n in enumerate(lengths):
        got = selected[row][selected[row] >= 0].tolist()
        if n <= budget:
            assert got == list(range(n))
        else:
            start = n - window
            expected = sorted(np_topk_positions(ours[row], range(start), budget - window) + list(range(start, n)))
            assert got == expected


def test_snapkv_verify_indices(models):
    target, _ = models
    tokens, lengths = pad_prompts(PROMPTS)
    policy = SnapKVVerify(budget=48, window=32, max_generated=5)
    state = policy.prepare(target, TARGET, tokens, lengths)
    prompt_sets = [row[row >= 0].tolist() for row in np.asarray(state["prompt_indices"])]
    for generated in (1, 3, 9):
        committed = jnp.asarray(lengths + generated)
        out = np.asarray(policy.verify_indices(state, None, committed, None))
        assert out.shape == (len(PROMPTS), 48 + 5)
        assert_clean(out, np.asarray(committed) - 1)
        for row, n in enumerate(lengths):
            gen = list(range(n, n + generated - 1))[-5:]  # history holds generated - 1 new positions
            assert out[row][out[row] >= 0].tolist() == prompt_sets[row] + gen
    # the engine's hook on a prefilled cache gives the same state as prepare
    cache, _ = prefill(target, TARGET, tokens, lengths, init_cache(TARGET, len(PROMPTS), FULL))
    hooked = SnapKVVerify(TARGET, budget=48, window=32, max_generated=5).prefill(target, cache, tokens, lengths)
    np.testing.assert_array_equal(hooked["prompt_indices"], state["prompt_indices"])


def test_snapkv_full_budget_equals_ar(models, ar_tokens):
    target, draft = models
    tokens, lengths = pad_prompts(PROMPTS)
    policy = SnapKVVerify(TARGET, budget=FULL, max_generated=NEW)  # state built by the engine's prefill hook
    draft_policy = MagicDecDraft(DRAFT, sinks=2, window=6, exact_first_step=True)
    result = speculative_generate(target, TARGET, PROMPTS, draft_policy=draft_policy, draft_params=draft,
                                  verify_policy=policy, engine=ENGINE)
    assert result.rows() == ar_tokens
    state = result.final_state.verify_state
    for row, n in enumerate(lengths):
        kept = np.asarray(state["prompt_indices"])[row]
        assert kept[kept >= 0].tolist() == list(range(n))


# ---------------------------------------------------------------------------- Quest
def np_quest_mask(q, keys, lengths, budget, page_size, min_pages):
    """Loop reference: ``q [B, H, G, T, D]``, ``keys [B, H, S, D]`` -> mask ``[B, H, G, T, S]``."""
    q, keys = np.asarray(q, np.float64), np.asarray(keys, np.float64)
    batch, heads, groups, steps, _ = q.shape
    mask = np.zeros(q.shape[:4] + (keys.shape[2],), bool)
    for b in range(batch):
        n = int(lengths[b])
        pages = -(-n // page_size)
        take = min(max(min_pages, budget // page_size), pages)
        for h in range(heads):
            bounds = [(keys[b, h, p * page_size:min((p + 1) * page_size, n)].max(0),
                       keys[b, h, p * page_size:min((p + 1) * page_size, n)].min(0)) for p in range(pages)]
            for g in range(groups):
                for t in range(steps):
                    qq = q[b, h, g, t]
                    scores = [np.maximum(qq * hi, qq * lo).sum() for hi, lo in bounds]
                    for p in np_topk_positions(scores, range(pages), take):
                        mask[b, h, g, t, p * page_size:min((p + 1) * page_size, n)] = True
    return mask


def test_quest_page_bound_is_upper_bound():
    rng = np.random.RandomState(0)
    for trial in range(5):
        dtype = jnp.bfloat16 if trial % 2 else jnp.float32
        keys = jnp.asarray(rng.randn(2, 2, 75, 8) * rng.uniform(0.1, 3), dtype)
        q = jnp.asarray(rng.randn(2, 2, 2, 3, 8), jnp.float32)
        lengths = jnp.asarray([75, int(rng.randint(1, 75))])
        k_max, k_min, page_valid = page_bounds(keys, lengths, 16)
        scores = np.asarray(page_scores(q, k_max, k_min, page_valid), np.float64)  # [B, H, G, T, P]
        exact = np.einsum("bhgtd,bhsd->bhgts", np.asarray(q, np.float64), np.asarray(keys.astype(jnp.float32),
                                                                                     np.float64))
        for b in range(2):
            n = int(lengths[b])
            assert np.asarray(page_valid)[b].tolist() == [p * 16 < n for p in range(5)]
            for s in range(n):
                bound = scores[b, :, :, :, s // 16]
                assert np.all(bound >= exact[b, :, :, :, s] - 1e-4 * (1 + np.abs(exact[b, :, :, :, s])))
            assert np.all(np.isneginf(scores[b, ..., -(-n // 16):]))  # pages with no valid key: -inf


def test_quest_mask_follows_rule():
    rng = np.random.RandomState(1)
    q = rng.randn(3, 2, 2, 4, 8).astype(np.float32)
    keys = rng.randn(3, 2, 100, 8).astype(np.float32)
    lengths = np.array([100, 37, 5])
    for budget in (16, 48, 64, 2000):
        ours = np.asarray(quest_mask(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(lengths), budget=budget))
        np.testing.assert_array_equal(ours, np_quest_mask(q, keys, lengths, budget, 16, 3))
        assert not ours[..., 100:].any() and not ours[1, ..., 37:].any() and not ours[2, ..., 5:].any()
        if budget >= 112:  # covers every page: dense
            assert all(ours[b, ..., :n].all() for b, n in enumerate(lengths))


def _rows_and_cache(params, config, seed=0):
    tokens, lengths = pad_prompts(PROMPTS)
    cache = init_cache(config, len(PROMPTS), FULL)
    cache, _ = prefill(params, config, tokens, lengths, cache)
    rows = jnp.asarray(np.random.RandomState(seed).randint(0, 97, (len(PROMPTS), ENGINE.gamma + 1)), jnp.int32)
    return rows, cache


def test_quest_forward_dense_when_budget_covers(models):
    target, _ = models
    rows, cache = _rows_and_cache(target, TARGET)
    dense = forward_jit(target, rows, cache, config=TARGET)
    quest = quest_forward(target, rows, cache, config=TARGET, budget=FULL)
    np.testing.assert_allclose(quest.logits, dense.logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(quest.cache.keys + quest.cache.values, dense.cache.keys + dense.cache.values):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(quest.cache.lengths, dense.cache.lengths)
    sparse = quest_forward(target, rows, cache, config=TARGET, budget=16)
    assert not np.allclose(sparse.logits, dense.logits, atol=1e-3)  # a small budget does change the output


def test_quest_forward_single_head_equals_indexed_forward():
    """One layer, one head, one row: Quest's set is one index set, so the forward must equal
    ``forward_jit(verify_indices=<the numpy reference pages>)``."""
    config = TARGET.replace(num_layers=1, num_heads=1, num_kv_heads=1)
    params = init_params(config, jax.random.PRNGKey(3), scale=0.3)
    tokens, lengths = pad_prompts(PROMPTS)
    cache = init_cache(config, len(PROMPTS), FULL)
    cache, _ = prefill(params, config, tokens, lengths, cache)
    rows = jnp.asarray([[5], [17], [60]], jnp.int32)
    budget = 48
    out = quest_forward(params, rows, cache, config=config, budget=budget, dense_layers=0)
    # the row's query, recomputed as the forward does (probe of head 0 of layer 0)
    q = forward_jit(params, rows, cache, config=config, probe_heads=((0, 0),)).probes.queries  # [B, 1, 1, D]
    mask = np_quest_mask(np.asarray(q)[:, None], np.asarray(cache.keys[0]), lengths, budget, 16, 3)[:, 0, 0, 0]
    indices = np.full((len(PROMPTS), FULL), -1, np.int32)
    for b in range(len(PROMPTS)):
        chosen = np.nonzero(mask[b])[0]
        indices[b, :len(chosen)] = chosen
        assert len(set((chosen // 16).tolist())) == min(3, -(-lengths[b] // 16))  # 3 whole pages (or all)
    reference = forward_jit(params, rows, cache, config=config, verify_indices=jnp.asarray(indices))
    np.testing.assert_allclose(out.logits, reference.logits, rtol=1e-5, atol=1e-5)
    dense = forward_jit(params, rows, cache, config=config)
    assert not np.allclose(out.logits[2], dense.logits[2], atol=1e-4)  # 90 history > 48: really sparse


def test_quest_verify_policy_refuses_engine_indices():
    with pytest.raises(TypeError, match="quest_speculative_generate"):
        QuestVerify().verify_indices(None, None, None, None)


def test_quest_speculative_full_budget_equals_ar(models, ar_tokens, classic):
    target, draft = models
    result = quest_speculative_generate(target, TARGET, PROMPTS, verify_policy=QuestVerify(budget=FULL),
                                        draft_policy=SeparateDraft(DRAFT), draft_params=draft, engine=ENGINE)
    assert result.rows() == ar_tokens
    assert result.metrics["accepted_histogram"] == classic.metrics["accepted_histogram"]


def test_quest_sparse_rounds_without_acceptance_equal_quest_decoding(models, ar_tokens):
    """With no draft token ever accepted (fixed acceptance, gamma 1), each round commits the argmax of the
    pending row under Quest attention: plain Quest decoding, checked against a manual one-token loop."""
    target, draft = models
    budget, new = 32, 8
    engine = EngineConfig(gamma=1, max_new_tokens=new, fixed_acceptance=(1.0, 0.0))
    result = quest_speculative_generate(target, TARGET, PROMPTS, verify_policy=QuestVerify(budget=budget),
                                        draft_policy=SeparateDraft(DRAFT), draft_params=draft, engine=engine)
    tokens, lengths = pad_prompts(PROMPTS)
    cache, logits = prefill(target, TARGET, tokens, lengths, init_cache(TARGET, len(PROMPTS), FULL))
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    expected = [token]
    for _ in range(new - 1):
        out = quest_forward(target, token[:, None], cache, config=TARGET, budget=budget)
        cache, token = out.cache, jnp.argmax(out.logits[:, 0], -1).astype(jnp.int32)
        expected.append(token)
    assert result.rows() == np.stack(expected, 1).tolist()
    assert result.rows() != [row[:new] for row in ar_tokens]  # the budget really is sparse for the long rows


# ---------------------------------------------------------------------------- MagicDec
@pytest.mark.parametrize("exact_first_step", [False, True])
def test_magicdec_draft_follows_rule(models, exact_first_step):
    """Greedy draft tokens equal a manual loop of forwards restricted to the numpy sinks + window sets."""
    _, draft = models
    sinks, window, gamma = 2, 6, 3
    policy = MagicDecDraft(DRAFT, sinks=sinks, window=window, exact_first_step=exact_first_step)
    tokens, lengths = pad_prompts(PROMPTS)
    state = policy.prefill(draft, tokens, lengths, FULL)
    previous = jnp.asarray(tokens[np.arange(len(PROMPTS)), lengths - 1])
    pending = jnp.asarray([3, 4, 5], jnp.int32)
    committed = jnp.asarray(lengths + 1)
    proposal = jax.jit(lambda st: policy.propose(draft, st, None, pending, previous, committed, gamma=gamma,
                                                 sampling=SamplingConfig(), key=jax.random.PRNGKey(0)))(state)

    def indices(cache):
        rows = [np_streaming(int(n), sinks, window) for n in np.asarray(cache.lengths)]
        return jnp.asarray([r + [-1] * (sinks + window - len(r)) for r in rows], jnp.int32)

    cache = state.with_lengths(committed - 2)
    if exact_first_step:
        cache = forward_jit(draft, previous[:, None], cache, config=DRAFT, verify_indices=indices(cache)).cache
        out = forward_jit(draft, pending[:, None], cache, config=DRAFT, verify_indices=indices(cache))
    else:
        out = forward_jit(draft, jnp.stack([previous, pending], 1), cache, config=DRAFT, verify_indices=indices(cache))
    dense_first = forward_jit(draft, jnp.stack([previous, pending], 1), state.with_lengths(committed - 2), config=DRAFT)
    assert not np.allclose(out.logits[:, -1], dense_first.logits[:, -1], atol=1e-3)  # the window really restricts
    expected, cache, token = [], out.cache, jnp.argmax(out.logits[:, -1], -1).astype(jnp.int32)
    for _ in range(gamma):
        expected.append(np.asarray(token))
        result = forward_jit(draft, token[:, None], cache, config=DRAFT, verify_indices=indices(cache))
        cache, token = result.cache, jnp.argmax(result.logits[:, 0], -1).astype(jnp.int32)
    np.testing.assert_array_equal(proposal.tokens, np.stack(expected, 1))
    np.testing.assert_array_equal(proposal.state.lengths, committed + gamma - 1)


def test_magicdec_full_budget_equals_classic_sd(models, classic):
    target, draft = models
    result = speculative_generate(target, TARGET, PROMPTS, draft_policy=MagicDecDraft(DRAFT, sinks=4, window=FULL - 4),
                                  draft_params=draft, engine=ENGINE)
    assert result.rows() == classic.rows()
    assert result.metrics["accepted_histogram"] == classic.metrics["accepted_histogram"]


def test_magicdec_full_budget_draft_equals_separate_draft_sampling(models):
    """With sinks + window covering the history, the draft's tokens and distributions are ClassicSD's."""
    _, draft = models
    tokens, lengths = pad_prompts(PROMPTS)
    state = SeparateDraft(DRAFT).prefill(draft, tokens, lengths, FULL)
    previous = jnp.asarray(tokens[np.arange(len(PROMPTS)), lengths - 1])
    args = (jnp.asarray([3, 4, 5], jnp.int32), previous, jnp.asarray(lengths + 1))
    sampling = SamplingConfig(temperature=1.0)

    def propose(policy):
        run = jax.jit(lambda st, key: policy.propose(draft, st, None, *args, gamma=3, sampling=sampling, key=key))
        return run(state, jax.random.PRNGKey(11))

    classic, magic = propose(SeparateDraft(DRAFT)), propose(MagicDecDraft(DRAFT, sinks=4, window=FULL - 4))
    np.testing.assert_array_equal(magic.tokens, classic.tokens)
    np.testing.assert_allclose(magic.probs, classic.probs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("full", [False, True])
def test_magicdec_self_draft(models, ar_tokens, full):
    """Greedy output is always the target's; with a covering budget the draft is the target (all accepted).
    The sparse run also skips one MLP sub-layer (the state's optional skip mask)."""
    target, _ = models
    policy = MagicDecSelfDraft(TARGET, sinks=4, window=FULL - 4) if full else MagicDecSelfDraft(TARGET, sinks=2,
                                                                                              window=6)
    mask = np.zeros((TARGET.num_layers, 2), bool)
    mask[1, 1] = True
    result = speculative_generate(target, TARGET, PROMPTS, draft_policy=policy, engine=ENGINE,
                                  draft_state=policy.initial_state(None if full else mask))
    assert result.rows() == ar_tokens
    if full:
        assert result.metrics["acceptance_rate"] == 1.0
    else:
        assert result.metrics["acceptance_rate"] < 1.0


# ---------------------------------------------------------------------------- prompt lookup (n-gram) drafting
def test_ngram_lookup_matches_python_rule():
    """Ragged rows: the longest n-gram (3 .. 1) ending at the last committed token, its earliest earlier
    occurrence, the tokens after it (at most gamma, never past the committed ones); none: 0 drafted."""
    from jaxspec.baselines.prompt_lookup import ngram_lookup

    rng = np.random.RandomState(0)
    rows = [rng.randint(0, 4, n).tolist() for n in (2, 7, 12, 25)] + [[1, 2, 3, 4, 5]]
    capacity, gamma = 32, 4
    history = np.zeros((len(rows), capacity), np.int32)
    for b, r in enumerate(rows):
        history[b, : len(r)] = r
        history[b, len(r):] = 9  # stale slots: never read
    tokens, drafted = ngram_lookup(jnp.asarray(history), jnp.asarray([len(r) for r in rows], jnp.int32), gamma=gamma,
                                   max_ngram=3, min_ngram=1)
    for b, r in enumerate(rows):
        want = []
        for n in (3, 2, 1):
            starts = [j for j in range(len(r) - n) if len(r) >= n + 1 and r[j: j + n] == r[len(r) - n:]]
            if starts:
                want = r[starts[0] + n: starts[0] + n + gamma]
                break
        assert int(drafted[b]) == len(want)
        assert np.asarray(tokens[b, : len(want)]).tolist() == want


def test_prompt_lookup_greedy_equals_ar(models, ar_tokens):
    from jaxspec.baselines.prompt_lookup import PromptLookupDraft

    result = speculative_generate(models[0], TARGET, PROMPTS, draft_policy=PromptLookupDraft(TARGET.vocab_size),
                                  engine=ENGINE)
    assert result.rows() == ar_tokens
    assert result.metrics["drafted_tokens"] <= result.metrics["row_rounds"] * ENGINE.gamma


def test_prompt_lookup_acceptance_high_on_a_repetitive_prompt(models):
    """A target whose next token depends on the current one only (attention and MLP outputs zeroed)
    repeats a cycle; on a prompt that already holds the cycle, the lookup's drafts are (almost) all
    accepted, and the output is still AR's."""
    from jaxspec.baselines.prompt_lookup import PromptLookupDraft

    def zero_outputs(path, x):
        last = path[-1]
        name = last.key if isinstance(last, jax.tree_util.DictKey) else getattr(last, "name", None)
        return x * 0 if name in ("wo", "w_down") else x

    copycat = jax.tree_util.tree_map_with_path(zero_outputs, models[0])
    prompt = generate(copycat, TARGET, [[5]], 40).rows()[0]
    ar = generate(copycat, TARGET, [prompt], 24).rows()
    result = speculative_generate(copycat, TARGET, [prompt], draft_policy=PromptLookupDraft(TARGET.vocab_size),
                                  engine=EngineConfig(gamma=4, max_new_tokens=24))
    assert result.rows() == ar
    assert result.metrics["acceptance_rate"] > 0.9 and result.metrics["tau"] > 3.5


def test_prompt_lookup_sampling_keeps_the_target_distribution():
    """Tiny vocabulary, a prompt the lookup matches: the joint of generated tokens 2 and 3 under
    rejection sampling with one-hot lookup drafts matches the target's own conditionals."""
    from jaxspec.baselines.prompt_lookup import PromptLookupDraft
    from jaxspec.decoding.sampling import SamplingConfig
    from jaxspec.models.llama import forward

    from tests.conftest import chi_square_pvalue

    config = ModelConfig(vocab_size=5, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, dtype="float32")
    params = init_params(config, jax.random.PRNGKey(1), scale=0.5)
    rows, prompt = 3000, [1, 2, 3, 1, 2, 3, 4]
    result = speculative_generate(params, config, [prompt] * rows, draft_policy=PromptLookupDraft(5),
                                  engine=EngineConfig(gamma=2, max_new_tokens=3,
                                                      sampling=SamplingConfig(temperature=1.0)), seed=3)
    assert 0 < result.metrics["acceptance_rate"] < 1 and result.metrics["drafted_tokens"] > 0
    tokens = result.tokens
    counts = np.zeros((5, 5, 5))
    np.add.at(counts, (tokens[:, 0], tokens[:, 1], tokens[:, 2]), 1)
    prefixes = np.array([[*prompt, a, b] for a in range(5) for b in range(5)])
    cache = init_cache(config, len(prefixes), 16)
    probs = np.asarray(jax.nn.softmax(forward(params, jnp.asarray(prefixes), cache, config=config).logits, axis=-1))
    checked = 0
    for t1 in range(5):
        if counts[t1].sum() < 200:
            continue
        p2 = probs[t1 * 5, len(prompt)]  # after prompt + t1
        joint = np.array([[p2[b] * probs[t1 * 5 + b, len(prompt) + 1, c] for c in range(5)] for b in range(5)])
        assert chi_square_pvalue(counts[t1].reshape(-1), joint.reshape(-1)) > 1e-3
        checked += 1
    assert checked >= 1
