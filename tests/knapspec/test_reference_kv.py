"""The DP's ``reference_kv="target"`` (docs/methods.md §4.3): each reference token attends to the
target's K/V of the earlier reference tokens and to the candidate's own only at its position."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import generate
from jaxspec.knapspec import dp, latency
from jaxspec.knapspec.policy import KnapSpecConfig, knapspec_generate
from jaxspec.models.attention import xla_attention
from jaxspec.models.llama import forward_jit, init_params
from tests.conftest import check_same_candidates, dp_model_problem

TINY = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=5, num_heads=4, num_kv_heads=2,
                   head_dim=16, dtype="float32")
SPEC_TARGET = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
                          num_kv_heads=2, head_dim=16, dtype="float32")
PROMPTS = [np.random.RandomState(0).randint(0, 97, n).tolist() for n in (5, 17, 40)]


@pytest.fixture(scope="module")
def problem():
    """The tiny model, a 2-row cache holding the full model's K/V of every position (prompt and
    reference window), ragged prefixes and a padded row."""
    params = init_params(TINY, jax.random.PRNGKey(0), scale=0.2)
    return (params, *dp_model_problem(params, TINY))


def test_target_kv_attention_equals_attention_over_a_cache_holding_the_target_rows():
    """Row t of target_kv_attention = the reference attention of one query over a cache whose slots
    lengths .. lengths + t - 1 hold the target's K/V, with the row's own K/V as its new token."""
    rng = np.random.RandomState(1)
    batch, steps, capacity = 2, 5, 24
    hq, hkv, d = TINY.num_heads, TINY.num_kv_heads, TINY.head_dim

    def arr(*shape):
        return jnp.asarray(rng.randn(*shape), jnp.float32)

    q, k_new, v_new, k_ref, v_ref = (arr(batch, steps, h, d) for h in (hq, hkv, hkv, hkv, hkv))
    cache_k, cache_v = arr(batch, hkv, capacity, d), arr(batch, hkv, capacity, d)
    lengths = jnp.asarray([9, 4], jnp.int32)
    got = dp.target_kv_attention(TINY, q, k_new, v_new, cache_k, cache_v, lengths, k_ref, v_ref)
    assert got.shape == q.shape
    for t in range(steps):
        ck, cv = np.array(cache_k), np.array(cache_v)
        for b in range(batch):
            for u in range(t):
                ck[b, :, int(lengths[b]) + u] = np.asarray(k_ref[b, u])
                cv[b, :, int(lengths[b]) + u] = np.asarray(v_ref[b, u])
        want, _ = xla_attention(TINY, q[:, t:t + 1], k_new[:, t:t + 1], v_new[:, t:t + 1], jnp.asarray(ck),
                                jnp.asarray(cv), lengths + t, None, ())
        np.testing.assert_allclose(np.asarray(got[:, t]), np.asarray(want[:, 0]), rtol=1e-5, atol=1e-5)


def test_on_the_target_state_both_references_agree(problem):
    """A candidate that executed everything so far carries the target's own state: its K/V are the
    target's, so both references give the target's next boundary state."""
    params, cache, prefix, _, _, states = problem
    for layer in range(1, TINY.num_layers):
        x = (params.layers[layer], cache.keys[layer], cache.values[layer], states[2 * layer])
        for mode in dp.REFERENCE_KV:
            attn, _, _, _ = dp.model_sublayers(TINY, prefix, states.shape[2], None, mode)
            np.testing.assert_allclose(np.asarray(attn(x, states[2 * layer])), np.asarray(states[2 * layer + 1]),
                                       rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("w_attn,w_mlp", [(2, 1), (1, 3)])
def test_scan_dp_equals_python_loop_dp_with_target_reference(problem, w_attn, w_mlp):
    params, cache, prefix, _, token_mask, states = problem
    kw = dict(w_attn=w_attn, w_mlp=w_mlp, reference_kv="target")
    fast = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, keep_states=True, **kw)
    ref = dp.knapsack_dp_reference(params, TINY, cache, prefix, states, token_mask, **kw)
    check_same_candidates(fast, ref)
    chunked = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, branch_chunk=3, **kw)
    np.testing.assert_array_equal(chunked.masks, fast.masks)
    np.testing.assert_allclose(chunked.cosine, fast.cosine, rtol=1e-5)


def test_target_reference_candidates_are_one_token_draft_steps(problem):
    """The oracle of the option: each candidate's final state and alpha at reference token i are what
    the skip-mask forward gives for that one token when the cache holds the full model's K/V of every
    earlier position (a draft step after committed tokens), and they differ from the paper's
    reference, where the window runs through the candidate as one sequence."""
    params, cache, prefix, tokens, token_mask, states = problem
    cands = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=2, w_mlp=1, keep_states=True,
                           reference_kv="target")
    branch = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=2, w_mlp=1, keep_states=True)
    mask = np.asarray(token_mask)
    teacher = np.argmax(np.asarray(forward_jit(params, tokens, cache.with_lengths(prefix), config=TINY).logits), -1)
    assert cands.weights[0] == 0 and cands.alpha[0] == 1.0
    differs = False
    for c, skip in enumerate(cands.masks):
        hidden, agree = [], []
        for i in range(tokens.shape[1]):
            out = forward_jit(params, tokens[:, i:i + 1], cache.with_lengths(prefix + i), config=TINY,
                              skip_mask=jnp.asarray(skip), return_hidden=True)
            hidden.append(np.asarray(out.hidden[:, 0]))
            agree.append(np.argmax(np.asarray(out.logits[:, 0]), -1) == teacher[:, i])
        hidden = np.stack(hidden, 1)
        np.testing.assert_allclose(cands.final_states[c], hidden, rtol=1e-4, atol=1e-4)
        alpha = (np.stack(agree, 1) * mask).sum() / mask.sum()
        assert alpha == pytest.approx(cands.alpha[c], abs=1e-6)
        same = np.where(branch.weights == cands.weights[c])[0]
        if skip.any() and len(same) and (branch.masks[same[0]] == skip).all():
            differs |= not np.allclose(branch.final_states[same[0]], cands.final_states[c], atol=1e-4)
    assert differs  # the two references are different estimates for the same skip set


def test_target_reference_never_beats_brute_force(problem):
    params, cache, prefix, _, token_mask, states = problem
    for w_attn, w_mlp in ((1, 1), (2, 1)):
        kw = dict(w_attn=w_attn, w_mlp=w_mlp, reference_kv="target")
        cands = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, **kw)
        best = dp.knapsack_brute_force(params, TINY, cache, prefix, states, token_mask, **kw)
        assert set(cands.weights.tolist()) <= set(best)
        for c, j in enumerate(cands.weights):
            assert cands.cosine[c] <= best[int(j)][0] + 1e-6
        assert any(abs(cands.cosine[c] - best[int(j)][0]) < 1e-6 for c, j in enumerate(cands.weights) if j > 0)


def test_bad_reference_kv_is_refused_before_any_work(problem):
    params, cache, prefix, _, token_mask, states = problem
    with pytest.raises(ValueError, match=r"reference_kv='teacher': choose from 'branch', 'target'"):
        dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=2, w_mlp=1, reference_kv="teacher")
    with pytest.raises(ValueError, match="reference_kv='prefix'"):
        KnapSpecConfig(reference_kv="prefix")
    with pytest.raises(ValueError, match="sub-layer DP"):
        KnapSpecConfig(reference_kv="target", coupled=True)


def test_greedy_knapspec_with_target_reference_equals_autoregressive():
    params = init_params(SPEC_TARGET, jax.random.PRNGKey(0), scale=0.2)
    expected = generate(params, SPEC_TARGET, PROMPTS, 24).rows()
    knap = KnapSpecConfig(gamma_max=4, plan_interval=4, plan_round=2, reference_rounds=2, max_plan_fraction=None,
                          probe_rounds=None, reference_kv="target")
    lat = latency.LatencyModel(c1=1.0, c2=0.01, c3=0.5)
    result = knapspec_generate(params, SPEC_TARGET, PROMPTS, latency=lat, knapspec=knap, max_new_tokens=24)
    assert result.rows() == expected
    assert result.metrics["knapspec_plans"] and all(p["skip_attn"] or p["skip_mlp"]
                                                    for p in result.metrics["knapspec_plans"])


@pytest.mark.parametrize("mode", dp.REFERENCE_KV)
def test_plan_alpha_of_the_dp_candidates_is_their_dp_alpha(problem, mode):
    """plan_alpha recomputes, for any mask, the alpha the DP reports for the masks it finds."""
    params, cache, prefix, _, token_mask, states = problem
    cands = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=2, w_mlp=1, reference_kv=mode)
    got = dp.plan_alpha(params, TINY, cache, prefix, states, cands.masks, token_mask, reference_kv=mode)
    np.testing.assert_allclose(got, cands.alpha, atol=1e-6)
    assert len(set(np.round(got, 6))) > 1  # the instance tells masks apart
    with pytest.raises(ValueError, match=r"masks of shape \(5, 2\): expected \[C, 5, 2\]"):
        dp.plan_alpha(params, TINY, cache, prefix, states, cands.masks[0], token_mask)


@pytest.mark.parametrize("mode", dp.REFERENCE_KV)
def test_plan_states_running_only_executed_sublayers_equal_running_all(problem, mode):
    """The rescoring forward runs a mask's executed sub-layers after its first skip only (before it the
    target's boundary states stand in): the final states equal those of running every sub-layer and
    selecting, for masks skipping nothing, the first sub-layer, the last one, everything skippable and
    random sets."""
    params, cache, prefix, _, token_mask, states = problem
    rng = np.random.RandomState(3)
    masks = np.zeros((6, TINY.num_layers, 2), bool)
    masks[1, 0, 0] = True
    masks[2, -1, 1] = True
    masks[3, 1:-1] = True
    masks[4:] = rng.rand(2, TINY.num_layers, 2) < 0.4
    prefix = jnp.asarray(prefix, jnp.int32)
    args = (params, cache, prefix, states, jnp.asarray(masks))
    fast = dp._plan_states(*args, config=TINY, reference_kv=mode, executed_only=True)
    full = dp._plan_states(*args, config=TINY, reference_kv=mode, executed_only=False)
    np.testing.assert_allclose(np.asarray(fast), np.asarray(full), rtol=1e-4, atol=1e-4)  # float32 fusion order
    np.testing.assert_allclose(np.asarray(fast[0]), np.asarray(states[-1]), rtol=1e-5, atol=1e-5)  # the target
    assert not np.allclose(np.asarray(fast[3]), np.asarray(states[-1]), atol=1e-3)  # skipping changes the state
    got = dp.plan_agreement(params, TINY, cache, prefix, states, masks, token_mask, reference_kv=mode)
    want = dp.plan_agreement(params, TINY, cache, prefix, states, masks, token_mask, reference_kv=mode,
                             executed_only=False)
    np.testing.assert_array_equal(got, want)


def test_plan_agreement_gives_the_dps_exit_statistics(problem):
    """plan_agreement recomputes (alpha, p_c, p_ac) for any mask: for the DP's own candidates, what the
    DP reported (the statistics a two-stage plan re-scores its finalists with, docs/methods.md §5.6)."""
    params, cache, prefix, _, token_mask, states = problem
    cands = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=2, w_mlp=1, exit_threshold=0.3)
    got = dp.plan_agreement(params, TINY, cache, prefix, states, cands.masks, token_mask, exit_threshold=0.3)
    np.testing.assert_allclose(got, np.stack([cands.alpha, cands.confident, cands.agree_confident], 1), atol=1e-6)
    assert len(set(np.round(got[:, 1], 6))) > 1  # p_c tells masks apart here
    plain = dp.plan_agreement(params, TINY, cache, prefix, states, cands.masks, token_mask)
    np.testing.assert_allclose(plain[:, 1], 1.0)
    np.testing.assert_allclose(plain[:, 2], plain[:, 0])


def test_two_stage_plan_searches_on_a_prefix_of_the_window_and_scores_finalists_on_all_of_it(problem):
    """search_tokens = s: the DP runs on the first s reference tokens of each row; the `finalists`
    candidates of best grid score there are scored again on the whole window, and the plan is chosen
    among them with those statistics. s >= the window width is the one-stage plan, unchanged."""
    from jaxspec.knapspec.planner import choose_plan
    from jaxspec.knapspec.policy import plan_skip_set

    params, cache, prefix, tokens, token_mask, states = problem
    lat = latency.LatencyModel(c1=1.0, c2=0.0, c3=2.0, c0=0.5)
    base = KnapSpecConfig(probe_rounds=None, early_exit=0.3)
    one_plan, one, weights = plan_skip_set(params, TINY, cache, tokens, token_mask, prefix, lat, 100.0, base)
    same_plan, same, _ = plan_skip_set(params, TINY, cache, tokens, token_mask, prefix, lat, 100.0,
                                       KnapSpecConfig(probe_rounds=None, early_exit=0.3, search_tokens=8))
    assert same.search_alpha is None and np.array_equal(same.masks, one.masks) and same_plan.gamma == one_plan.gamma
    s, k = 3, 2
    plan, finals, _ = plan_skip_set(params, TINY, cache, tokens, token_mask, prefix, lat, 100.0,
                                    KnapSpecConfig(probe_rounds=None, early_exit=0.3, search_tokens=s, finalists=k))
    searched = dp.knapsack_dp(params, TINY, cache, prefix, states[:, :, :s], token_mask[:, :s], w_attn=weights[0],
                              w_mlp=weights[1], exit_threshold=0.3)
    table = choose_plan(searched.masks, searched.alpha, lat, 100.0, gammas=base.plan_gammas,
                        exit_stats=(searched.confident, searched.agree_confident)).table
    best = np.max(table, axis=1)
    expected = sorted(sorted(range(len(best)), key=lambda i: (-best[i], i))[:k])
    assert len(searched) > k and finals.search_tokens == s
    np.testing.assert_array_equal(finals.masks, searched.masks[expected])
    np.testing.assert_allclose(finals.search_alpha, searched.alpha[expected])
    whole = dp.plan_agreement(params, TINY, cache, prefix, states, finals.masks, token_mask, exit_threshold=0.3)
    np.testing.assert_allclose(np.stack([finals.alpha, finals.confident, finals.agree_confident], 1), whole, atol=1e-6)
    assert not np.allclose(finals.alpha, finals.search_alpha)  # the whole window says something else here
    again = choose_plan(finals.masks, finals.alpha, lat, 100.0, gammas=base.plan_gammas,
                        exit_stats=(finals.confident, finals.agree_confident))
    assert np.array_equal(plan.mask, again.mask) and plan.gamma == again.gamma and plan.alpha == finals.alpha[again.index]
    with pytest.raises(ValueError, match="search_tokens=0"):
        KnapSpecConfig(search_tokens=0)
    with pytest.raises(ValueError, match="finalists=0"):
        KnapSpecConfig(finalists=0)


def test_two_stage_rescore_without_conditionals_chooses_the_same_plan(problem):
    """rescore="select" (every sub-layer of every finalist in one batched pass, no conditional) gives the
    finalists the statistics of rescore="executed" (the default: the conditionals), so the same plan; the mode
    is recorded; an unknown mode is refused."""
    from jaxspec.knapspec.policy import plan_skip_set

    params, cache, prefix, tokens, token_mask, _ = problem
    lat = latency.LatencyModel(c1=1.0, c2=0.0, c3=2.0, c0=0.5)
    runs = {}
    for mode in ("executed", "select", None):
        knobs = KnapSpecConfig(probe_rounds=None, early_exit=0.3, search_tokens=3, finalists=3,
                               **({} if mode is None else {"rescore": mode}))
        runs[mode] = plan_skip_set(params, TINY, cache, tokens, token_mask, prefix, lat, 100.0, knobs)
    (p_exec, c_exec, _), (p_sel, c_sel, _) = runs["executed"], runs["select"]
    assert (c_exec.rescore, c_sel.rescore, runs[None][1].rescore) == ("executed", "select", "executed")
    assert len(c_exec) == 3
    np.testing.assert_array_equal(c_sel.masks, c_exec.masks)
    for name in ("alpha", "confident", "agree_confident"):
        np.testing.assert_allclose(getattr(c_sel, name), getattr(c_exec, name), atol=1e-6)
    assert np.array_equal(p_sel.mask, p_exec.mask) and p_sel.gamma == p_exec.gamma
    with pytest.raises(ValueError, match="rescore='cond'; valid: executed, select"):
        KnapSpecConfig(rescore="cond")
