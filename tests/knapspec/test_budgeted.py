"""KnapSpec with budgeted attention (docs/methods.md §5.4): the three-choice DP (scan) vs brute force,
its weights, the budgeted forward, and the planner."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.knapspec import budgeted as bd
from jaxspec.knapspec import dp, latency
from jaxspec.models.llama import forward_jit, forward_static_skip, init_params
from tests.conftest import decomposable_increments, dp_model_problem, slow_engine_side

TINY = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=5, num_heads=4, num_kv_heads=2,
                   head_dim=16, dtype="float32")


def test_choice_weights_and_indices():
    assert bd.choice_weights(4.0, 1.0, 1.0) == (4, 1, 1)  # budgeted attention saves 3
    assert bd.choice_weights(4.0, 9.0, 1.0) == (4, 4, 1)  # never heavier than dense
    assert bd.choice_weights(1.0, 0.2, 3.0) == (1, 0, 3)  # attention the lighter: budgeted saves 1
    idx = np.asarray(bd.sink_window_indices(jnp.asarray([10, 3]), 2, 3))
    np.testing.assert_array_equal(idx, [[0, 1, 7, 8, 9], [0, 1, 0, 1, 2]])
    with pytest.raises(ValueError, match="window"):
        bd.check_budget(4, 0)


def _instance(num_layers, tokens=3, hidden=24, seed=0, beta=0.45):
    """Orthogonal increments (as the two-choice test): sub-layer k adds a_k e_k; a budgeted Attention
    adds a_k (beta e_k + sqrt(beta - beta^2) f_k) with f_k orthogonal to the target. Both the dot product
    with the target and the squared norm then grow by beta a_k^2, so the cosine at every depth is a
    monotone function of one additive mass: optimal substructure, the DP is exact."""
    n = num_layers - 1
    inc, mags, scale, bases = decomposable_increments(num_layers, tokens, hidden, seed)  # [2n+1, T, H]
    extra = np.stack([np.stack([scale[t] * mags[1 + 2 * k] * bases[t][:, 2 * n + 1 + k] for t in range(tokens)])
                      for k in range(n)]).astype(np.float32)  # [n, T, H]
    budget_inc = beta * inc[1::2] + np.sqrt(beta - beta ** 2) * extra  # the attention sub-layers' budgeted step
    g0 = jnp.asarray(inc[0])
    steps = jnp.asarray(inc[1:].reshape(n, 2, tokens, hidden))
    targets = jnp.asarray(np.cumsum(inc, axis=0)[1:].reshape(n, 2, tokens, hidden))
    can_skip = np.arange(1, num_layers) < num_layers - 1
    return g0, steps, jnp.asarray(budget_inc), targets, can_skip


@pytest.mark.parametrize("weights", [(2, 1, 1), (3, 1, 1), (1, 0, 3)])
def test_three_choice_dp_equals_brute_force(weights):
    """DP == exhaustive search over every plan (dense / budgeted / skipped Attention, executed / skipped
    MLP) for every saved weight, in value and plan, on instances with optimal substructure."""
    w_attn, w_budget, w_mlp = weights
    num_layers = 5
    g0, steps, budget_inc, targets, can_skip = _instance(num_layers)
    token_mask = jnp.ones(g0.shape[:1])
    budget = dp.skip_budget(w_attn, w_mlp, num_layers)
    tau = 0.6
    xs = (steps[:, 0], steps[:, 1], budget_inc)
    scan = jax.jit(lambda: bd.dp_scan_choices(
        lambda x, g: g + x[0], lambda x, g: g + x[2], lambda x, g: g + x[1], xs, g0, targets, jnp.asarray(can_skip),
        token_mask, w_attn=w_attn, w_budget=w_budget, w_mlp=w_mlp, budget=budget, tau=tau))
    values, choice, valid, _ = scan()
    trace = bd.ChoiceTrace(np.asarray(values, np.float64), np.asarray(choice), np.asarray(valid))
    plans, slots = bd.backtrack_choices(trace, num_layers, w_attn, w_budget, w_mlp)

    layers = [(steps[k, 0], steps[k, 1], budget_inc[k]) for k in range(num_layers - 1)]
    single = lambda kind, x, h: h + x[{0: 0, 1: 1, 2: 2}[kind]]  # noqa: E731
    tgt = [(targets[k, 0], targets[k, 1]) for k in range(num_layers - 1)]
    best = bd.brute_force_choices(single, layers, g0, tgt, can_skip, token_mask, w_attn=w_attn, w_budget=w_budget,
                                  w_mlp=w_mlp, budget=budget, tau=tau)
    assert sorted(best) == slots.tolist()
    assert (plans == bd.BUDGET).any()  # the third choice is used by some optimum
    for c, j in enumerate(slots):
        value, nondense = best[int(j)]
        assert trace.final_values[j] == pytest.approx(value, rel=1e-5)
        expected = np.zeros((num_layers, 2), np.int8)
        for layer, col, code in nondense:
            expected[1 + layer, col] = code
        np.testing.assert_array_equal(plans[c], expected)
    # the two-choice DP is the special case without the budgeted option: its weight classes are a subset
    two = dp.brute_force(lambda kind, x, h: h + x[kind], [(s[0], s[1]) for s in layers], g0, tgt, can_skip,
                         token_mask, w_attn=w_attn, w_mlp=w_mlp, budget=budget, tau=tau)
    for j, (value, _) in two.items():
        assert best[j][0] >= value - 1e-6


@pytest.fixture(scope="module")
def tiny_problem():
    params = init_params(TINY, jax.random.PRNGKey(0), scale=0.2)
    return (params, *dp_model_problem(params, TINY, width=6, capacity=48, ragged=False))


def test_model_dp_is_realised_by_the_budgeted_forward_and_bounded_by_brute_force(tiny_problem):
    """Every candidate plan, run through budgeted_forward (what a draft executes), reproduces the DP's
    final state, cosine and alpha; no candidate beats the exhaustive optimum of its weight."""
    params, cache, prefix, tokens, token_mask, states = tiny_problem
    sinks, window, w = 2, 4, (3, 1, 1)
    cands = bd.knapsack_dp_choices(params, TINY, cache, prefix, states, token_mask, w_attn=w[0], w_budget=w[1],
                                   w_mlp=w[2], sinks=sinks, window=window, budget=5, keep_states=True)
    assert len(cands) > 3 and (cands.plans == bd.BUDGET).any()
    assert cands.weights[0] == 0 and not cands.plans[0].any() and cands.alpha[0] == 1.0
    teacher = np.argmax(np.asarray(forward_jit(params, tokens, cache.with_lengths(prefix), config=TINY).logits), -1)
    saved = {(0, 0): 0, (0, 1): w[0] - w[1], (0, 2): w[0], (1, 0): 0, (1, 2): w[2]}
    for c, plan in enumerate(cands.plans):
        assert sum(saved[(col, int(code))] for code_row in [plan] for col in (0, 1)
                   for code in code_row[:, col]) == cands.weights[c]
        logits, _, hidden = bd.budgeted_forward_jit(params, tokens, cache.with_lengths(prefix), config=TINY,
                                                    plan=bd.freeze_plan(plan), sinks=sinks, window=window,
                                                    return_hidden=True)
        np.testing.assert_allclose(cands.final_states[c], np.asarray(hidden), rtol=1e-4, atol=1e-4)
        cos = float(dp.cos_sum(hidden, states[-1], token_mask)) / float(token_mask.sum())
        assert cos == pytest.approx(cands.cosine[c], abs=1e-5)
        assert ((np.argmax(np.asarray(logits), -1) == teacher).mean()) == pytest.approx(cands.alpha[c], abs=1e-6)
    apply_single, layers, targets, can_skip = dp.model_problem(params, dp.dp_config(TINY), cache, prefix, states)

    def single(kind, layer_x, h):
        if kind < 2:
            return apply_single(kind, layer_x, h)
        return _budgeted_single(layer_x, h, prefix, sinks, window)

    best = bd.brute_force_choices(single, layers, states[2], targets, can_skip, token_mask, w_attn=w[0],
                                  w_budget=w[1], w_mlp=w[2], budget=cands.budget)
    assert set(cands.weights.tolist()) <= set(best)
    for c, j in enumerate(cands.weights):
        assert cands.cosine[c] <= best[int(j)][0] / float(token_mask.sum()) + 1e-6


@jax.jit
def _budgeted_jit(layer_x, h, prefix, indices):
    from jaxspec.models.layers import attention_sublayer, default_positions, rope_tables

    layer, ck, cv = layer_x
    cos, sin = rope_tables(TINY, default_positions(prefix, h.shape[1]))
    return attention_sublayer(layer, h, TINY, cos, sin, ck, cv, prefix, indices).hidden


def _budgeted_single(layer_x, h, prefix, sinks, window):
    return _budgeted_jit(layer_x, h, prefix, bd.sink_window_indices(prefix, sinks, window))


def test_budgeted_forward_edge_cases(tiny_problem):
    """All dense = the forward; a window covering the history = dense; skip codes = the static skip forward."""
    params, cache, prefix, tokens, _, _ = tiny_problem
    c = cache.with_lengths(prefix)
    ref = np.asarray(forward_jit(params, tokens, c, config=TINY).logits)
    dense = bd.freeze_plan(np.zeros((TINY.num_layers, 2), np.int8))
    out = bd.budgeted_forward_jit(params, tokens, c, config=TINY, plan=dense, sinks=1, window=2)
    np.testing.assert_allclose(np.asarray(out[0]), ref, rtol=1e-5, atol=1e-5)
    all_budget = np.zeros((TINY.num_layers, 2), np.int8)
    all_budget[:, 0] = bd.BUDGET
    wide = bd.budgeted_forward_jit(params, tokens, c, config=TINY, plan=bd.freeze_plan(all_budget), sinks=4, window=40)
    np.testing.assert_allclose(np.asarray(wide[0]), ref, rtol=1e-4, atol=1e-4)
    narrow = bd.budgeted_forward_jit(params, tokens, c, config=TINY, plan=bd.freeze_plan(all_budget), sinks=1,
                                     window=2)
    assert np.abs(np.asarray(narrow[0]) - ref).max() > 1e-3
    skips = np.zeros((TINY.num_layers, 2), np.int8)
    skips[2, 0] = skips[3, 1] = bd.SKIP
    out = bd.budgeted_forward_jit(params, tokens, c, config=TINY, plan=bd.freeze_plan(skips), sinks=1, window=2)
    static = forward_static_skip(params, tokens, c, config=TINY, skip_mask=skips == bd.SKIP).logits
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(static), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out[1].lengths), np.asarray(prefix) + tokens.shape[1])


def test_plan_choices_prefers_budgeted_attention_at_long_context(tiny_problem):
    """With attention dominating (t_attn(n) >> t_attn(K)) the grid search's plan uses the budget, and
    its predicted draft time is the latency model's for that plan."""
    params, cache, prefix, tokens, token_mask, _ = tiny_problem
    lat = latency.LatencyModel(c1=1.0, c2=1.0, c3=0.1)  # t_attn(n) = n + 0.1, t_mlp = 1
    best, cands, weights = bd.plan_choices(params, TINY, cache, tokens, token_mask, prefix, lat, 20.0, sinks=1,
                                           window=2, tau=0.3)
    assert weights[0] > weights[1]
    assert best is not None and best["gamma"] >= 1
    plan = best["plan"]
    assert (plan != bd.DENSE).any()
    n_dense, n_budget = int((plan[:, 0] == bd.DENSE).sum()), int((plan[:, 0] == bd.BUDGET).sum())
    expected = n_dense * lat.t_attn(20.0) + n_budget * lat.t_attn(3.0) + int((plan[:, 1] == 0).sum()) * lat.t_mlp() \
        + lat.t_token(20.0)
    assert bd.plan_draft_time(plan, lat, 20.0, 3) == pytest.approx(expected)


def test_budget_generate_is_exact_and_drafts_with_the_plan():
    """Greedy KnapSpec with budgeted attention (one plan on the prompt tail, a static three-choice
    draft) equals greedy AR; the plan it reports is the one the draft ran."""
    from jaxspec.decoding.autoregressive import generate
    from jaxspec.knapspec.policy import KnapSpecConfig, KnapSpecDraft, knapspec_budget_generate

    params = init_params(TINY, jax.random.PRNGKey(1), scale=0.2)
    prompts = [np.random.RandomState(1).randint(0, 97, n).tolist() for n in (30, 24)]
    lat = latency.LatencyModel(c1=1.0, c2=1.0, c3=0.1)
    knap = KnapSpecConfig(gamma_max=4, gamma_buckets=(), max_plan_fraction=None, probe_rounds=None, tau=0.3,
                          gammas=(1, 2, 3, 4))  # no gamma 0 in the grid: the run drafts
    result = knapspec_budget_generate(params, TINY, prompts, latency=lat, sinks=1, window=4, reference_tokens=8,
                                      knapspec=knap, max_new_tokens=12)
    assert result.rows() == generate(params, TINY, prompts, 12).rows()
    plan = result.metrics["budget_plan"]
    assert plan["reference_tokens"] == 16 and plan["gamma"] >= 1 and result.timings["plan_s"] > 0
    assert plan["n_budget_attn"] + plan["n_skip_attn"] + plan["n_skip_mlp"] > 0
    with pytest.raises(ValueError, match="static_codes"):
        KnapSpecDraft(TINY, static_codes=((0, 1),) * TINY.num_layers, attention_budget=(1, 4))
    # planned on the first row's tail only (plan_rows = 1): still AR's tokens, half the reference tokens
    one_row = knapspec_budget_generate(params, TINY, prompts, latency=lat, sinks=1, window=4, reference_tokens=8,
                                       knapspec=dataclasses.replace(knap, plan_rows=1), max_new_tokens=12)
    assert one_row.rows() == result.rows()
    assert one_row.metrics["budget_plan"]["reference_tokens"] == 8 and one_row.metrics["budget_plan"]["rows"] == 1


def test_budget_generate_keeps_its_plan_within_the_planning_allowance():
    """The one three-choice plan is priced like the two-choice DP (slot rows x t_row(n) per reference
    token, docs/methods.md §5.6): a plan that would cost more than the allowance runs on fewer tokens,
    and one that cannot fit even the minimum is not made (plain decoding, still AR's tokens)."""
    from jaxspec.decoding.autoregressive import generate
    from jaxspec.knapspec.budgeted import BudgetDPCost
    from jaxspec.knapspec.policy import KnapSpecConfig, knapspec_budget_generate

    params = init_params(TINY, jax.random.PRNGKey(1), scale=0.2)
    prompts = [np.random.RandomState(1).randint(0, 97, n).tolist() for n in (30, 24)]
    ar = generate(params, TINY, prompts, 12).rows()
    knap = KnapSpecConfig(gamma_max=4, gamma_buckets=(), max_plan_fraction=0.5, probe_rounds=None, tau=0.3,
                          gammas=(1, 2, 3, 4), min_reference_tokens=2)
    base = latency.LatencyModel(c1=1.0, c2=1.0, c3=0.1)
    cost = BudgetDPCost(base, 1, 4)
    n = 26.0  # the plan's context: the cache capacity
    per_token = cost.reference_cost(TINY, n)
    assert per_token == pytest.approx(cost.slots(TINY, n) * base.v * base.t_step(n, TINY.num_layers))
    decode = 12 * base.t_plain(n, TINY.num_layers)
    # scale the many-row price so that about 3 reference tokens fit (of the 8 asked for)
    u = 0.5 * knap.allowance_margin * decode / 3.2 / cost.slots(TINY, n)
    capped = latency.LatencyModel(c1=1.0, c2=1.0, c3=0.1, u=u)
    result = knapspec_budget_generate(params, TINY, prompts, latency=capped, sinks=1, window=4, reference_tokens=8,
                                      knapspec=knap, max_new_tokens=12, context_n=n)
    plan = result.metrics["budget_plan"]
    assert plan["allowance"]["allowed_tokens"] == 3 and plan["reference_tokens"] == 3 * 2
    assert result.rows() == ar and result.metrics["plan_allowance"] is plan["allowance"]
    # a price at which not even min_reference_tokens fit: no plan, gamma 0, plain decoding
    dear = latency.LatencyModel(c1=1.0, c2=1.0, c3=0.1, u=100 * u)
    plain = knapspec_budget_generate(params, TINY, prompts, latency=dear, sinks=1, window=4, reference_tokens=8,
                                     knapspec=knap, max_new_tokens=12, context_n=n)
    plan = plain.metrics["budget_plan"]
    assert plan["allowance"]["skip"] and plan["gamma"] == 0 and plan["reference_tokens"] == 0
    assert plain.timings["plan_s"] == 0.0 and plain.rows() == ar


@pytest.mark.parametrize("slow", ["speculative", "ar"])
def test_budget_generate_probes_its_plan_against_plain_decoding(monkeypatch, slow):
    """The one budgeted plan comes from a few reference tokens, so with ``probe_rounds`` the run times
    that many rounds of it against as many plain-decoding steps at the start and keeps the faster for the
    rest (the measured arbitration). Slowing one side on the host makes the choice certain; the output
    is AR's either way, and only a plain-decoding winner adds plain steps after the probe."""
    from jaxspec.decoding.autoregressive import generate
    from jaxspec.knapspec.policy import KnapSpecConfig, knapspec_budget_generate

    slow_engine_side(monkeypatch, slow)
    params = init_params(TINY, jax.random.PRNGKey(1), scale=0.2)
    prompts = [np.random.RandomState(1).randint(0, 97, n).tolist() for n in (30, 24)]
    lat = latency.LatencyModel(c1=1.0, c2=1.0, c3=0.1)
    knap = KnapSpecConfig(gamma_max=4, gamma_buckets=(), max_plan_fraction=None, probe_rounds=2, tau=0.3,
                          gammas=(1, 2, 3, 4))
    result = knapspec_budget_generate(params, TINY, prompts, latency=lat, sinks=1, window=4, reference_tokens=8,
                                      knapspec=knap, max_new_tokens=12)
    assert result.rows() == generate(params, TINY, prompts, 12).rows()
    probe = result.metrics["fixed_plan_probe"]
    winner = "ar" if slow == "speculative" else "speculative"
    assert probe["rounds"] == 2 and probe["choice"] == winner
    assert probe["speculative_tokens"] > 0 and probe["ar_steps"] == 2
    assert (probe["ar_tokens_per_s"] > probe["speculative_tokens_per_s"]) == (winner == "ar")
    # after the probe: plain decoding to the end, or the plan's rounds (no further plain steps)
    assert (result.metrics["ar_steps"] > probe["ar_steps"]) == (winner == "ar")
    # no probe without probe_rounds
    unprobed = knapspec_budget_generate(params, TINY, prompts, latency=lat, sinks=1, window=4, reference_tokens=8,
                                        knapspec=dataclasses.replace(knap, probe_rounds=None), max_new_tokens=12)
    assert unprobed.metrics["fixed_plan_probe"] is None and unprobed.metrics["ar_steps"] == 0


def _probed_budget_run(probe_rounds: int, max_new_tokens: int):
    """The tiny model, two prompts and ``run(**config_changes)``: one budgeted KnapSpec plan probed against plain
    decoding (``probe_rounds`` rounds) under a KnapSpecConfig with those changes."""
    from jaxspec.knapspec.policy import KnapSpecConfig, knapspec_budget_generate

    params = init_params(TINY, jax.random.PRNGKey(1), scale=0.2)
    prompts = [np.random.RandomState(1).randint(0, 97, n).tolist() for n in (30, 24)]
    lat = latency.LatencyModel(c1=1.0, c2=1.0, c3=0.1)
    knap = KnapSpecConfig(gamma_max=4, gamma_buckets=(), max_plan_fraction=None, probe_rounds=probe_rounds, tau=0.3,
                          gammas=(1, 2, 3, 4))

    def run(**changes):
        return knapspec_budget_generate(params, TINY, prompts, latency=lat, sinks=1, window=4, reference_tokens=8,
                                        knapspec=dataclasses.replace(knap, **changes), max_new_tokens=max_new_tokens)
    return params, prompts, run


def test_probe_warmup_keeps_a_first_call_cost_off_the_timed_rounds(monkeypatch):
    """The first speculative call after a switch of plan can pay one-time costs (a program's first run on a GPU).
    Charged to the probe's few timed rounds, such a cost makes plain decoding win; with ``probe_warmup`` an untimed
    round takes it (its tokens kept) and the timed rounds show the plan's own rate. Made certain with host sleeps:
    the run's first speculative call sleeps 2 s, every plain stretch 0.2 s. Greedy output is AR's either way."""
    import time

    from jaxspec.decoding import speculative as engine_module
    from jaxspec.decoding.autoregressive import generate
    from jaxspec.knapspec.policy import KnapSpecConfig

    params, prompts, probed = _probed_budget_run(probe_rounds=2, max_new_tokens=12)

    def run(warmup_rounds):
        return probed(probe_warmup=warmup_rounds)

    run(1)  # compiles everything, unslowed
    calls = {"loop": 0}
    real_loop, real_plain = engine_module.run_loop, engine_module.plain_decode

    def first_loop_slow(*args, **kwargs):
        out = jax.block_until_ready(real_loop(*args, **kwargs))
        calls["loop"] += 1
        if calls["loop"] == 1:
            time.sleep(2.0)
        return out

    def plain_slow(*args, **kwargs):
        out = jax.block_until_ready(real_plain(*args, **kwargs))
        time.sleep(0.2)
        return out

    monkeypatch.setattr(engine_module, "run_loop", first_loop_slow)
    monkeypatch.setattr(engine_module, "plain_decode", plain_slow)
    ar = generate(params, TINY, prompts, 12).rows()
    cold = run(0)
    probe = cold.metrics["fixed_plan_probe"]
    assert probe["choice"] == "ar" and probe["speculative_s"] > 2.0 and "speculative_warmup_s" not in probe
    assert cold.rows() == ar
    calls["loop"] = 0
    warm = run(1)
    probe = warm.metrics["fixed_plan_probe"]
    assert probe["choice"] == "speculative" and probe["speculative_s"] < 2.0 <= probe["speculative_warmup_s"]
    assert probe["speculative_warmup_units"] == 1 and probe["ar_warmup_units"] == 1 and probe["ar_steps"] == 2
    assert probe["speculative_warmup_tokens"] >= 2 and probe["rounds"] == 2
    assert warm.rows() == ar
    # every chunk is logged in order: the plain ones add up to the run's plain steps and plain-stretch seconds
    log = warm.metrics["chunk_log"]
    plain = [(units, seconds) for kind, units, seconds in log if kind == "plain"]
    assert [kind for kind, _, _ in log[:4]] == ["rounds", "rounds", "plain", "plain"]  # warm-up, timed, warm-up, timed
    assert sum(u for u, _ in plain) == warm.metrics["ar_steps"]
    assert sum(s for _, s in plain) == pytest.approx(warm.metrics["plain_chunk_seconds"])
    assert log[0][2] >= 2.0  # the slowed first call is the warm-up round
    with pytest.raises(ValueError, match="probe_warmup=-1"):
        KnapSpecConfig(probe_warmup=-1)
    # both probes and their warm-ups fit between a plan and the next reference window
    assert KnapSpecConfig(plan_interval=16).probe == 5 and KnapSpecConfig(plan_interval=16, probe_warmup=2).probe == 3


def test_two_stretch_pricing_takes_the_per_call_cost_off_both_sides(monkeypatch):
    """After a probe the chosen mode runs in one long call, so a per-call cost (dispatch, host reads) should
    price neither side. Made certain with host sleeps: every speculative call sleeps 1.5 s plus 0.01 s a round,
    every plain step 0.05 s (no per-call cost). The mean price charges the 1.5 s to the probe's 8 rounds and picks
    plain decoding; the two-stretch price times each side as 2 + 6 units and takes the difference, which
    cancels the per-call sleep, and picks speculation. Greedy output is AR's both ways."""
    import time

    from jaxspec.decoding import speculative as engine_module
    from jaxspec.decoding.autoregressive import generate
    from jaxspec.knapspec.policy import KnapSpecConfig

    params, prompts, probed = _probed_budget_run(probe_rounds=8, max_new_tokens=48)

    def run(pricing):
        return probed(probe_pricing=pricing)

    run("two-stretch")  # compiles everything, unslowed
    real_loop, real_plain = engine_module.run_loop, engine_module.plain_decode

    def loop_slow(*args, max_rounds=None, **kwargs):
        out = jax.block_until_ready(real_loop(*args, max_rounds=max_rounds, **kwargs))
        time.sleep(1.5 + 0.01 * (max_rounds or 0))
        return out

    def plain_slow(params, state, num_steps, **kwargs):
        out = jax.block_until_ready(real_plain(params, state, num_steps, **kwargs))
        time.sleep(0.05 * int(num_steps))
        return out

    monkeypatch.setattr(engine_module, "run_loop", loop_slow)
    monkeypatch.setattr(engine_module, "plain_decode", plain_slow)
    ar = generate(params, TINY, prompts, 48).rows()
    mean = run("mean")
    probe = mean.metrics["fixed_plan_probe"]
    assert probe["choice"] == "ar" and probe["speculative_round_s"] == probe["speculative_round_s_mean"] > 0.15
    assert mean.rows() == ar
    two = run("two-stretch")
    probe = two.metrics["fixed_plan_probe"]
    assert probe["choice"] == "speculative" and probe["rounds"] == 8 and probe["ar_steps"] == 8
    # the difference keeps the 0.01 s a round slept (and the rounds' own compute, more on a loaded machine), but none
    # of the 1.5 s a call, which puts the mean above 0.15 s a round. The lower bound is half the slept 0.01 s: the two
    # 1.5 s sleeps jitter by a few ms on a loaded machine, and the difference divides that by only 4 rounds
    assert 0.005 <= probe["speculative_round_s"] < 0.06 and probe["speculative_round_s_mean"] > 0.15
    assert probe["ar_step_s"] == pytest.approx(0.05, rel=0.5)
    assert probe["speculative_tokens_per_s"] > probe["ar_tokens_per_s"] == probe["ar_tokens_per_s_measured"]
    assert [(kind, units) for kind, units, _ in two.metrics["chunk_log"][:4]] == [
        ("rounds", 2), ("rounds", 6), ("plain", 2), ("plain", 6)]
    assert two.rows() == ar
    with pytest.raises(ValueError, match="probe_pricing='median' is not one of mean, two-stretch"):
        KnapSpecConfig(probe_pricing="median")


def test_budget_generate_on_the_attention_kernels():
    """On a kernel backend (the Pallas kernels, interpreted) the cache the plan prefills is rounded to the
    kernels' blocks, and the speculative run takes it as is: greedy output still equals AR's."""
    from jaxspec.config import preset
    from jaxspec.decoding.autoregressive import generate
    from jaxspec.knapspec.policy import KnapSpecConfig, knapspec_budget_generate

    cfg = preset("smollm2-135m-shape", num_layers=2, dtype="float32", attention_backend="pallas-interpret")
    params = init_params(cfg, jax.random.PRNGKey(0))
    prompts = [np.random.RandomState(1).randint(0, 1000, n).tolist() for n in (30, 24)]  # 30 + 8 + 4: not x 64
    knap = KnapSpecConfig(gamma_max=2, gamma_buckets=(), max_plan_fraction=None, probe_rounds=None, tau=0.3,
                          gammas=(1, 2))
    result = knapspec_budget_generate(params, cfg, prompts, latency=latency.LatencyModel(c1=1.0, c2=1.0, c3=0.1),
                                      sinks=1, window=4, reference_tokens=8, knapspec=knap, max_new_tokens=8)
    assert result.rows() == generate(params, cfg, prompts, 8).rows()
    assert result.metrics["budget_plan"]["gamma"] >= 1
