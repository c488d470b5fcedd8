"""The plan at the start taking its window's target states from the prefill (docs/methods.md §5.6):
``prefill_window`` builds the prefill's cache and the boundary states of the last prompt tokens, a suffix
window's states are read from them, and a plan made on them is the plan made on states of its own."""

from dataclasses import replace as dataclasses_replace

import jax
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import generate, pad_prompts, prefill
from jaxspec.knapspec import dp, latency
from jaxspec.knapspec.policy import (KnapSpecConfig, KnapSpecPlanner, WindowStates, knapspec_generate,
                                     prefill_window, reference_allowance)
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import init_params

TARGET = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=5, num_heads=4, num_kv_heads=2,
                     head_dim=16, dtype="float32")
PROMPTS = [np.random.RandomState(0).randint(0, 97, n).tolist() for n in (5, 17, 40)]  # rows shorter than the window
LATENCY = latency.LatencyModel(c1=1.0, c2=0.01, c3=0.5)
NEW = 24
CAPACITY = 128
# one plan at the start on the last 24 prompt tokens: 3 search tokens, 2 finalists rescored on the window
KNAP = KnapSpecConfig(gamma_max=4, plan_interval=64, plan_round=2, reference_rounds=2, gamma_buckets=(1, 2, 3),
                      max_plan_fraction=None, probe_rounds=None, reference_floor=24, plan_at_start=True,
                      search_tokens=3, finalists=2)


@pytest.fixture(scope="module")
def params():
    return init_params(TARGET, jax.random.PRNGKey(0), scale=0.2)


@pytest.fixture(scope="module")
def ar_rows(params):  # NEW tokens (the controller tests decode more)
    return generate(params, TARGET, PROMPTS, NEW).rows()


def plain_prefill(params):
    tokens, lengths = pad_prompts(PROMPTS)
    return prefill(params, TARGET, tokens, lengths, init_cache(TARGET, len(PROMPTS), CAPACITY))


def windowed_prefill(params, window=24):
    tokens, lengths = pad_prompts(PROMPTS)
    return prefill_window(params, TARGET, tokens, lengths, init_cache(TARGET, len(PROMPTS), CAPACITY), window)


def window_of(count_cap):
    """Each row's last min(cap, length) prompt tokens: ``tokens, mask, prefix`` (right-padded to 16)."""
    lengths = np.asarray([len(p) for p in PROMPTS])
    counts = np.minimum(lengths, count_cap)
    width = int(-(-counts.max() // 16) * 16)
    tokens = np.zeros((len(PROMPTS), width), np.int32)
    mask = np.zeros((len(PROMPTS), width), np.float32)
    for b, prompt in enumerate(PROMPTS):
        tokens[b, : counts[b]] = prompt[len(prompt) - counts[b]:]
        mask[b, : counts[b]] = 1.0
    return tokens, mask, (lengths - counts).astype(np.int32)


class OwnStates(KnapSpecPlanner):
    """A planner that computes its window's states whatever was kept."""
    accepts_window_states = False


def count_boundary_states(monkeypatch) -> dict:
    """Count the plans' own ``boundary_states`` forwards: ``calls["n"]`` (reset it between runs)."""
    from jaxspec.knapspec import skip_planner

    calls = {"n": 0}
    computed = skip_planner.boundary_states

    def counted(*args, **kwargs):
        calls["n"] += 1
        return computed(*args, **kwargs)

    monkeypatch.setattr(skip_planner, "boundary_states", counted)
    return calls


def test_prefill_window_is_the_prefill_and_keeps_the_window_states(params):
    """The cache and first logits equal the plain prefill's (every row's valid slots); the kept states equal
    boundary_states of the same tokens on the plain prefill's cache (to float32 rounding: a different prefill chunking
    and the DP's attention path, about 5e-5 at the last layers); rows shorter than the window keep all."""
    cache, logits = plain_prefill(params)
    kept_cache, kept_logits, kept = windowed_prefill(params)
    lengths = [len(p) for p in PROMPTS]
    np.testing.assert_array_equal(np.asarray(kept_cache.lengths), lengths)
    np.testing.assert_allclose(np.asarray(kept_logits), np.asarray(logits), atol=2e-5, rtol=1e-5)
    for layer in range(TARGET.num_layers):
        for ours, theirs in ((kept_cache.keys[layer], cache.keys[layer]), (kept_cache.values[layer],
                                                                            cache.values[layer])):
            for b, n in enumerate(lengths):
                np.testing.assert_allclose(np.asarray(ours[b, :, :n]), np.asarray(theirs[b, :, :n]), atol=2e-5,
                                           rtol=1e-5)
    np.testing.assert_array_equal(kept.counts, np.minimum(lengths, 24))
    np.testing.assert_array_equal(kept.ends, lengths)
    tokens, mask, prefix = window_of(24)
    reference = dp.boundary_states(params, TARGET, tokens, cache, prefix)
    assert kept.states.shape == reference.shape
    for b, count in enumerate(kept.counts):
        np.testing.assert_allclose(np.asarray(kept.states[:, b, :count]), np.asarray(reference[:, b, :count]),
                                   atol=2e-4, rtol=1e-4)


def test_a_suffix_window_reads_its_states_from_the_kept_ones(params):
    """A window ending at the prompt's end and inside the kept tokens gets the states boundary_states computes
    for it (zeros past each row's tokens); a window reaching before them, or not ending at the prompt's end,
    gets None; ``rows`` keeps the chosen rows."""
    cache, _ = plain_prefill(params)
    _, _, kept = windowed_prefill(params)
    tokens, mask, prefix = window_of(8)
    taken = kept.for_window(mask, prefix)
    reference = dp.boundary_states(params, TARGET, tokens, cache, prefix)
    counts = mask.sum(axis=1).astype(int)
    assert taken.shape == reference.shape
    for b, count in enumerate(counts):
        np.testing.assert_allclose(np.asarray(taken[:, b, :count]), np.asarray(reference[:, b, :count]),
                                   atol=2e-4, rtol=1e-4)
        assert not np.asarray(taken[:, b, count:]).any()
    _, wide_mask, wide_prefix = window_of(32)  # row 2 (40 tokens) reaches 8 tokens before the kept 24
    assert kept.for_window(wide_mask, wide_prefix) is None
    assert kept.for_window(mask, prefix - 1) is None  # ends one token before the prompt's end
    one = kept.rows([2])
    np.testing.assert_array_equal(np.asarray(one.for_window(mask[2:], prefix[2:])), np.asarray(taken[:, 2:]))


def test_plan_at_start_uses_the_prefill_states_and_plans_the_same(params, ar_rows, monkeypatch):
    """With plan_at_start the engine's prefill keeps the window's states (the controller's prefill_target) and the
    plan uses them: its record says so, it runs no states forward of its own (one boundary_states call fewer than
    a planner's that computes its own states, over the same plans), and the plan (mask, gamma) and its window alpha
    equal that planner's; greedy output stays AR's. The same holds with a shared prefilled cache handed over with
    its window_states."""
    calls = count_boundary_states(monkeypatch)
    runs, states_calls = {}, {}
    for name, planner in (("kept", KnapSpecPlanner(LATENCY, KNAP)), ("own", OwnStates(LATENCY, KNAP))):
        calls["n"] = 0
        runs[name] = knapspec_generate(params, TARGET, PROMPTS, latency=LATENCY, knapspec=KNAP, max_new_tokens=NEW,
                                       planner=planner, capacity=CAPACITY)
        states_calls[name] = calls["n"]
    cache, logits, kept = windowed_prefill(params)
    calls["n"] = 0
    runs["prefilled"] = knapspec_generate(params, TARGET, PROMPTS, latency=LATENCY, knapspec=KNAP,
                                          max_new_tokens=NEW, capacity=CAPACITY, prefilled=(cache, logits),
                                          window_states=kept)
    states_calls["prefilled"] = calls["n"]
    for name, result in runs.items():
        assert result.rows() == ar_rows, name
    first = {name: result.metrics["knapspec_plans"][0] for name, result in runs.items()}
    assert first["kept"]["states_from_prefill"] and first["prefilled"]["states_from_prefill"]
    assert not first["own"]["states_from_prefill"]
    assert all(plan["round"] == 0 for plan in first.values())
    for name in ("kept", "prefilled"):
        assert first[name]["skip_attn"] == first["own"]["skip_attn"], name
        assert first[name]["skip_mlp"] == first["own"]["skip_mlp"], name
        assert first[name]["gamma_star"] == first["own"]["gamma_star"], name
        assert first[name]["alpha"] == pytest.approx(first["own"]["alpha"], abs=1e-6)
        plans = [len(runs[n].metrics["knapspec_plans"]) for n in (name, "own")]
        assert plans[0] == plans[1] and states_calls[name] == states_calls["own"] - 1 >= 0, (name, states_calls)


def test_prefill_states_price_one_row_less_per_window_token():
    """reference_costs with states_known: each window token costs the finalists' rows only (no row for the
    target's own states); the allowance then fits more tokens in the same budget."""
    lat = latency.LatencyModel(c1=1.0, c2=0.01, c3=0.5, c0=0.2, v=0.05, a=1.1, u=0.003)
    knap = dataclasses_replace(KNAP, max_plan_fraction=0.05)
    planner = KnapSpecPlanner(lat, knap)
    fixed, per = planner.reference_costs(TARGET, 100.0)
    fixed_known, per_known = planner.reference_costs(TARGET, 100.0, states_known=True)
    assert fixed_known == fixed and per_known == pytest.approx(per * knap.finalists / (knap.finalists + 1))
    own = reference_allowance(planner, lat, TARGET, 100.0, 1000, knap)
    known = reference_allowance(planner, lat, TARGET, 100.0, 1000, knap, states_known=True)
    assert known["allowed_tokens"] == int((known["plan_budget_s"] - fixed) // per_known) > own["allowed_tokens"]


def test_prefill_window_rejects_bad_input(params):
    tokens, lengths = pad_prompts(PROMPTS)
    with pytest.raises(ValueError, match="window=0"):
        prefill_window(params, TARGET, tokens, lengths, init_cache(TARGET, 3, CAPACITY), 0)
    held, _ = plain_prefill(params)
    with pytest.raises(ValueError, match="empty cache"):
        prefill_window(params, TARGET, tokens, lengths, held, 24)
    assert isinstance(windowed_prefill(params)[2], WindowStates)


def test_plain_stretch_keeps_the_states_of_the_tokens_it_feeds(params):
    """plain_decode(keep_states=True): column i holds the residual stream of the stretch's i-th fed token, equal to
    boundary_states of those tokens on the cache before the stretch; tokens, counts and cache are the stretch's
    without keep_states."""
    import jax.numpy as jnp

    from jaxspec.decoding.speculative import EngineConfig, loop_state_from_caches, plain_decode

    engine = EngineConfig(gamma=2, max_new_tokens=NEW)
    cache, logits = plain_prefill(params)
    pending = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    before = cache.lengths

    def state():
        return loop_state_from_caches(jax.tree.map(jnp.copy, cache), None, pending, pending, engine)

    steps = 6
    plain, count = plain_decode(params, state(), jnp.int32(steps), config=TARGET, engine=engine, steps=steps)
    kept_state, kept_count, states = plain_decode(params, state(), jnp.int32(steps), config=TARGET, engine=engine,
                                                  steps=steps, keep_states=True)
    np.testing.assert_array_equal(np.asarray(kept_count), np.asarray(count))
    np.testing.assert_array_equal(np.asarray(kept_state.out), np.asarray(plain.out))
    np.testing.assert_array_equal(np.asarray(kept_state.target_cache.lengths), np.asarray(plain.target_cache.lengths))
    assert states.shape == (2 * TARGET.num_layers + 1, len(PROMPTS), steps, TARGET.hidden_size)
    # the fed tokens: the pending one (the last committed before the stretch), then each token the stretch commits
    first = int(np.asarray(state().num_out)[0]) - 1
    fed = np.asarray(plain.out)[:, first: first + steps]
    np.testing.assert_array_equal(fed[:, 0], np.asarray(pending))
    want = dp.boundary_states(params, TARGET, fed, cache, before)
    # float32 rounding of two computation orders (one token a step against the DP's window forward): up to 2.2e-5
    # on values near 0.06 (the prefill's kept states above are compared within 2e-4)
    np.testing.assert_allclose(np.asarray(states), np.asarray(want), rtol=5e-5, atol=5e-5)
    from jaxspec.decoding.contract import Chunk

    with pytest.raises(ValueError, match="keep_states=True keeps the states of plain steps: give plain_steps"):
        Chunk(rounds=3, keep_states=True)
    with pytest.raises(ValueError, match="keep_states keeps column i"):
        plain_decode(params, state(), jnp.int32(steps), config=TARGET, engine=engine, steps=steps, keep_states=True,
                     static_bound=True)


def test_plan_after_plain_uses_the_plain_stretch_states_and_plans_the_same(params, monkeypatch):
    """With plan_after_plain the stretch before the first plan keeps its tokens' states and that plan uses them (its
    record says so, one boundary_states call fewer than a planner's that computes its own, the same plan and window
    alpha); start_states="own" computes them; greedy output stays AR's."""
    new = 32
    rows = generate(params, TARGET, PROMPTS, new).rows()
    knap = dataclasses_replace(KNAP, plan_at_start=False, plan_after_plain=8, reference_floor=None)
    calls = count_boundary_states(monkeypatch)
    runs, states_calls = {}, {}
    for name, planner, config in (("kept", KnapSpecPlanner(LATENCY, knap), knap),
                                  ("own", OwnStates(LATENCY, knap), knap),
                                  ("own-config", KnapSpecPlanner(LATENCY, knap),
                                   dataclasses_replace(knap, start_states="own"))):
        calls["n"] = 0
        runs[name] = knapspec_generate(params, TARGET, PROMPTS, latency=LATENCY, knapspec=config, max_new_tokens=new,
                                       planner=planner, capacity=CAPACITY)
        states_calls[name] = calls["n"]
    for name, result in runs.items():
        assert result.rows() == rows, name
    first = {name: result.metrics["knapspec_plans"][0] for name, result in runs.items()}
    assert first["kept"]["states_from_plain"] and not first["kept"]["states_from_prefill"]
    assert not first["own"]["states_from_plain"] and not first["own-config"]["states_from_plain"]
    assert all(plan["round"] == 8 for plan in first.values())
    for name in ("own", "own-config"):
        for key in ("skip_attn", "skip_mlp", "gamma_star"):
            assert first["kept"][key] == first[name][key], (name, key)
        assert first["kept"]["alpha"] == pytest.approx(first[name]["alpha"], abs=1e-6)
        assert states_calls["kept"] == states_calls[name] - 1 >= 0, (name, states_calls)
