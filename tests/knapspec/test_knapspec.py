"""KnapSpec: latency model, knapsack DP (scan vs loop vs brute force), TPT planner, engine policy."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import generate
from jaxspec.knapspec import dp, latency, planner
from jaxspec.knapspec.policy import (KnapSpecConfig, KnapSpecDraft, KnapSpecSchedule, knapspec_generate,
                                     reference_window)
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import forward_jit, init_params
from tests.conftest import (check_same_candidates, check_scan_dp_against_brute_force, decomposable_dp_instance,
                            dp_model_problem)

TINY = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=5, num_heads=4, num_kv_heads=2,
                   head_dim=16, dtype="float32")


# ---------------------------------------------------------------------------- latency model
def test_fit_recovers_synthetic_linear_model():
    n = np.array([1024, 3072, 5120, 9000, 25600])
    c1, c2, c3 = 3.5e-5, 2.25e-9, 1.75e-5
    fit = latency.fit_latency(n, c2 * n + c3, [c1] * 4)
    assert fit.c1 == pytest.approx(c1, rel=1e-12)
    assert fit.c2 == pytest.approx(c2, rel=1e-9)
    assert fit.c3 == pytest.approx(c3, rel=1e-9)
    assert fit.t_attn(12345) == pytest.approx(c2 * 12345 + c3, rel=1e-9)
    noisy = latency.fit_latency([1, 2, 3, 4], [1.1, 1.9, 3.1, 3.9], [1.0, 3.0])  # plain least squares
    assert (noisy.c2, noisy.c3, noisy.c1) == pytest.approx((0.96, 0.1, 2.0))
    with pytest.raises(ValueError, match="two distinct"):
        latency.fit_latency([5, 5], [1.0, 2.0], [1.0])


def test_fit_recovers_synthetic_model_with_per_token_constant():
    """t_step(n) = L (c2 n + c3 + c1) + c0: the fit recovers c0 from the per-token samples, and the
    planner's draft/target times use it (a draft that skips everything still pays c0)."""
    rng = np.random.default_rng(0)
    n = np.array([512, 1024, 2048, 4096, 8192])
    c0, c1, c2, c3 = 4.0e-3, 1.8e-4, 6.8e-8, 9.8e-5
    token_samples = c0 + rng.normal(0.0, 1e-5, 50)
    fit = latency.fit_latency(n, c2 * n + c3, [c1], token_samples)
    assert fit.c0 == pytest.approx(c0, rel=1e-2) and fit.c0 == pytest.approx(token_samples.mean(), rel=1e-12)
    assert fit.t_step(3000, 30) == pytest.approx(30 * (c2 * 3000 + c3 + c1) + fit.c0, rel=1e-9)
    assert latency.fit_latency(n, c2 * n + c3, [c1]).c0 == 0.0  # docs/methods.md §4.1 without the constant
    with pytest.raises(ValueError, match="token_times is empty"):
        latency.fit_latency(n, c2 * n + c3, [c1], [])
    L = 4
    everything = np.ones((1, L, 2), bool)
    assert planner.draft_time(everything, 2.0, 1.0, 0.5)[0] == 0.5
    assert planner.target_time(L, 2.0, 1.0, 0.5) == L * 3.0 + 0.5
    # the constant lowers the predicted gain of skipping: with c0 the same candidate at the same
    # gamma has a lower TPT, and a plan that only paid without c0 falls back to gamma = 0
    masks = np.zeros((2, L, 2), bool)
    masks[1, 1:3] = True  # skip the two middle layers entirely (half the sub-layers)
    alphas = [1.0, 0.7]
    without = planner.choose_plan(masks, alphas, (1.0, 1.0), gammas=range(6))
    with_c0 = planner.choose_plan(masks, alphas, (1.0, 1.0, 8.0), gammas=range(6))
    assert without.index == 1 and without.gamma >= 1  # 0.7 acceptance at half the cost pays
    assert with_c0.gamma == 0  # the head makes a draft cost (4 + 8) / (8 + 8) of a step: no longer pays
    assert with_c0.t_token == 8.0 and with_c0.predicted_tpt == pytest.approx(1 / 16.0)
    model = latency.LatencyModel(c1=1.0, c2=0.0, c3=1.0, c0=8.0)
    assert planner.choose_plan(masks, alphas, model, n=123.0).gamma == 0


def test_verification_row_cost():
    """v: verifying g + 1 rows costs (1 + v g) steps; v = 0 is docs/methods.md §4.2 (one step whatever g)."""
    assert latency.verify_row_cost(10.0, 20.0, 11) == pytest.approx(0.1)
    assert latency.verify_row_cost(10.0, 9.0, 11) == 0.0  # never negative
    with pytest.raises(ValueError):
        latency.verify_row_cost(10.0, 20.0, 1)
    assert planner.tpt(0.5, 3, 1.0, 4.0, 0.0) == planner.tpt(0.5, 3, 1.0, 4.0)
    assert planner.tpt(0.5, 3, 1.0, 4.0, 0.2) == pytest.approx(planner.expected_tokens(0.5, 3) / (3 + 4 * 1.6))
    assert planner.tpt(0.9, 0, 1.0, 4.0, 0.5) == pytest.approx(0.25)  # gamma = 0: one plain step
    L = 4
    masks = np.zeros((2, L, 2), bool)
    masks[1, 1:3] = True
    cheap_verify = planner.choose_plan(masks, [1.0, 0.8], (1.0, 1.0, 0.0, 0.0), gammas=range(11))
    costly_verify = planner.choose_plan(masks, [1.0, 0.8], (1.0, 1.0, 0.0, 0.35), gammas=range(11))
    assert cheap_verify.gamma > costly_verify.gamma >= 0
    assert costly_verify.verify_row_cost == 0.35
    assert costly_verify.predicted_tpt == pytest.approx(costly_verify.score)
    tpl = planner.choose_plan(masks, [1.0, 0.8], (1.0, 1.0, 0.0, 0.35), gammas=range(11), objective="tpl")
    assert tpl.verify_row_cost == 0.0 and tpl.gamma == cheap_verify.gamma  # TPL counts layers only


def test_profile_save_load_and_reuse(tmp_path):
    config = TINY.replace(num_layers=2, name="tiny-knapspec")
    profile = latency.profile_latency(config, batch=2, contexts=(64, 512), warmup=1, repeats=2)
    assert profile.device == latency.device_name() and profile.batch == 2
    assert len(profile.attn_samples) == 2 and all(len(s) == 2 for s in profile.attn_samples)
    assert profile.mlp_time > 0 and min(profile.attn_times) > 0 and profile.token_time > 0
    assert len(profile.token_samples) == 2
    assert profile.model == latency.fit_latency(profile.contexts, profile.attn_times, [profile.mlp_time],
                                                [profile.token_time], v=profile.model.v)
    assert profile.verify_rows == 11 and profile.model.v >= 0
    assert set(profile.verify_times) == {"attn_one", "attn_rows", "mlp_one", "mlp_rows", "token_one", "token_rows"}
    assert profile.model.t_token(4096) == profile.token_time and profile.model.c0_n == 0.0
    path = tmp_path / "profiles" / "tiny.json"
    profile.save(path)
    loaded = latency.LatencyProfile.load(path)
    assert loaded == profile
    assert json.loads(path.read_text())["config_name"] == "tiny-knapspec"

    def must_not_profile(*args, **kwargs):
        raise AssertionError("profiled although a matching profile was saved")

    assert latency.load_or_profile(path, config, 2, profile_fn=must_not_profile) == profile
    calls = []

    def fake_profile(cfg, batch, **kwargs):
        calls.append(batch)
        return dataclass_replace(profile, batch=batch)

    other = latency.load_or_profile(path, config, 4, profile_fn=fake_profile)  # batch differs: re-measured
    assert calls == [4] and other.batch == 4 and latency.LatencyProfile.load(path).batch == 4
    assert not latency.LatencyProfile.load(path).matches(config.replace(hidden_size=128), 4)
    # a format-1 profile (no per-token constant) is not reused: it is measured again
    old = json.loads(path.read_text())
    old["format_version"] = 1
    path.write_text(json.dumps(old))
    calls.clear()
    latency.load_or_profile(path, config, 4, profile_fn=fake_profile)
    assert calls == [4]


def dataclass_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


# ---------------------------------------------------------------------------- weights and budget
def test_weights_and_budget():
    assert dp.knapsack_weights(5.0, 1.0) == (5, 1)
    assert dp.knapsack_weights(12.0, 1.0) == (5, 1)  # capped at 5
    assert dp.knapsack_weights(1.0, 2.6) == (1, 3)
    assert dp.knapsack_weights(1.4, 1.0) == (1, 1)
    assert dp.knapsack_weights(2.5, 1.0) == (2, 1)  # Python round (as the official int(round(.)))
    assert dp.knapsack_weights(1.0, 1.0) == (1, 1)
    assert dp.skip_budget(5, 1, 28) == 84 and dp.skip_budget(1, 1, 5) == 5 and dp.skip_budget(2, 1, 5) == 7


# ---------------------------------------------------------------------------- DP vs brute force
@pytest.mark.parametrize("w_attn,w_mlp,segments,layers", [(1, 1, 1, "scan"), (2, 1, 1, "scan"), (1, 3, 1, "scan"),
                                                           (2, 1, 3, "scan"), (1, 3, 1, "unrolled"),
                                                           (2, 1, 1, "unrolled")])
def test_dp_equals_brute_force_on_decomposable_objective(w_attn, w_mlp, segments, layers):
    """The oracle "the knapsack DP matches brute force on small instances", in the form that is true.

    The DP keeps ONE state per (depth i, skipped weight j) -- the one with the best cosine at
    depth i -- so it is a heuristic: on a real model a prefix that wins at depth i can lose after
    the remaining sub-layers, and the DP then misses the exhaustive optimum of some weight (a
    random 5-layer model, 3 skippable layers, already shows it: test_dp_never_beats_brute_force_on_model).
    It is exact exactly when the objective has optimal substructure: whenever prefix A beats
    prefix B at (i, j), A + s beats B + s at every later depth for every common suffix s (then,
    by induction, the retained state dominates every feasible path of the same weight, also under
    the per-depth pruning). We therefore test DP == exhaustive search on instances built to have
    that property: every sub-layer adds a fixed component orthogonal to everything else, so the
    cosine at depth i is sqrt(executed mass / total mass), a monotone function of the additive
    executed mass (per-token scales are proportional, so the sum over tokens keeps the order).
    On these, the DP's value AND mask for every skipped weight equal the brute-force optimum over
    all 4^(L-2) skip sets (same fixed edge layers, same tau-pruning at every depth, same budget),
    and the DP finds every weight class brute force finds. The sub-layer functions are plugged
    into the very dp_scan the model DP uses, as one scan and split into runs of reachable slots, and into
    dp_unrolled (one traced step per layer, each sub-layer on its reachable slots).
    """
    num_layers = 6
    can_skip = np.arange(1, num_layers) < num_layers - 1
    run = check_scan_dp_against_brute_force(*decomposable_dp_instance(num_layers), can_skip, num_layers=num_layers,
                                            w_attn=w_attn, w_mlp=w_mlp, tau=0.6,  # tau 0.6 prunes the heaviest sets
                                            segments=segments, layers=layers)
    if segments > 1:
        assert len(dp.slot_segments(can_skip, w_attn, w_mlp, run.budget, segments)) > 1  # the split is exercised
    best = run.best
    # the pruning bites on these instances: without it the optimum of some weight differs
    # ((1, 1): a better skip set for weight 6 dips below tau midway) or another weight is feasible
    unpruned = run.brute(can_skip, -2.0)
    if (w_attn, w_mlp) != (1, 3):
        assert unpruned != best


def test_slot_segments_cover_the_layers_with_the_reachable_slots_at_least_cost():
    """slot_segments: the runs cover the scanned layers in order, each with at least the slots its last layer can
    reach (capped at the budget), at the least slot-layers over every split into at most K runs (all splits
    enumerated); K = 1, or nothing to save, is one run of every slot; a kept Attention adds no weight."""
    import itertools

    for num_layers, w_attn, w_mlp, keep in ((6, 2, 1, ()), (8, 1, 1, ()), (9, 5, 1, (3,)), (28, 5, 1, ())):
        can = dp.scan_can_skip(num_layers, keep)
        budget = dp.skip_budget(w_attn, w_mlp, num_layers)
        reach = np.minimum(np.cumsum(can[:, 0] * w_attn + can[:, 1] * w_mlp), budget)
        n = len(can)
        assert dp.slot_segments(can, w_attn, w_mlp, budget, 1) == ((n, budget + 1),)
        for k in (2, 3, 4):
            runs = dp.slot_segments(can, w_attn, w_mlp, budget, k)
            assert sum(c for c, _ in runs) == n and 1 <= len(runs) <= k
            end = np.cumsum([c for c, _ in runs]) - 1
            assert all(slots >= reach[e] + 1 for (_, slots), e in zip(runs, end))
            if n > 12:
                continue
            best = min(sum((b - a) * (reach[b - 1] + 1) for a, b in zip((0,) + cuts, cuts + (n,)))
                       for m in range(k) for cuts in itertools.combinations(range(1, n), m))
            assert sum(c * s for c, s in runs) == best
    assert dp.slot_segments(dp.scan_can_skip(28), 5, 1, 84, 4) == ((3, 19), (3, 37), (4, 61), (17, 85))
    with pytest.raises(ValueError, match="segments=0 must be an integer >= 1"):
        dp.knapsack_dp(None, TINY, None, None, jnp.zeros((11, 1, 2, 8)), w_attn=1, w_mlp=1, segments=0)
    with pytest.raises(ValueError, match="dp_segments=0"):
        KnapSpecConfig(dp_segments=0)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="weight_cap=.* must be an integer >= 1"):
            KnapSpecConfig(weight_cap=bad)


@pytest.fixture(scope="module")
def tiny_problem():
    """Tiny random model, a 2-row cache with different prefixes and ragged reference windows."""
    params = init_params(TINY, jax.random.PRNGKey(0), scale=0.2)
    return (params, *dp_model_problem(params, TINY))


def test_boundary_states_match_the_forward(tiny_problem):
    params, cache, prefix, tokens, _, states = tiny_problem
    assert states.shape == (2 * TINY.num_layers + 1, 2, 8, TINY.hidden_size)
    out = forward_jit(params, tokens, cache.with_lengths(prefix), config=TINY, return_hidden=True)
    np.testing.assert_allclose(np.asarray(states[-1]), np.asarray(out.hidden), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("w_attn,w_mlp", [(2, 1), (1, 3)])
def test_scan_dp_equals_python_loop_dp(tiny_problem, w_attn, w_mlp):
    """Same recursion, two implementations: jit(lax.scan) vectorised over budgets with vmapped
    (branch-parallel) attention vs a Python loop calling attention_block once per candidate."""
    params, cache, prefix, _, token_mask, states = tiny_problem
    fast = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=w_attn, w_mlp=w_mlp,
                          keep_states=True)
    ref = dp.knapsack_dp_reference(params, TINY, cache, prefix, states, token_mask, w_attn=w_attn, w_mlp=w_mlp)
    assert fast.budget == ref.budget == dp.skip_budget(w_attn, w_mlp, TINY.num_layers)
    check_same_candidates(fast, ref, weights=True)
    one = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=w_attn, w_mlp=w_mlp, segments=1,
                         keep_states=True)
    assert len(dp.slot_segments(dp.scan_can_skip(TINY.num_layers), w_attn, w_mlp, fast.budget, 4)) > 1
    check_same_candidates(fast, one, weights=True)  # the default split scan = one scan of every slot
    valid = one.trace.valid
    np.testing.assert_array_equal(fast.trace.valid, valid)
    np.testing.assert_array_equal(fast.trace.skipped[valid], one.trace.skipped[valid])
    np.testing.assert_allclose(fast.trace.values[valid], one.trace.values[valid], rtol=1e-5)
    if w_attn == 1:
        return
    chunked = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=w_attn, w_mlp=w_mlp,
                             branch_chunk=3)
    np.testing.assert_array_equal(chunked.masks, fast.masks)
    np.testing.assert_allclose(chunked.cosine, fast.cosine, rtol=1e-5)


@pytest.mark.parametrize("w_attn,w_mlp,reference_kv,keep", [(2, 1, "branch", ()), (1, 3, "branch", (2,)),
                                                             (2, 1, "target", ())])
def test_unrolled_dp_equals_the_scan(tiny_problem, w_attn, w_mlp, reference_kv, keep):
    """layers="unrolled" (one traced step per layer on the model's own weights, each sub-layer on the slots it can
    reach) finds the scan's trace, masks, alphas and final states: both references, a kept Attention sub-layer, and
    the branches folded into the history kernel (interpreted) on a cache whose capacity is off the kernel's block;
    a bad value is refused before anything runs."""
    params, cache, prefix, _, token_mask, states = tiny_problem
    common = dict(w_attn=w_attn, w_mlp=w_mlp, keep_states=True, reference_kv=reference_kv, keep_attention=keep,
                  exit_threshold=0.3)
    scan = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, **common)
    unrolled = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, layers="unrolled", **common)
    check_same_candidates(unrolled, scan, weights=True)
    for field in ("confident", "agree_confident"):
        np.testing.assert_allclose(getattr(unrolled, field), getattr(scan, field), atol=1e-6)
    if keep:
        assert not unrolled.masks[:, keep[0], 0].any()
    if reference_kv == "branch" and not keep:
        trimmed = dataclass_replace(cache, keys=tuple(k[:, :, :40] for k in cache.keys),  # 40 slots: padded to 64
                                    values=tuple(v[:, :, :40] for v in cache.values))
        folded = dp.knapsack_dp(params, TINY, trimmed, prefix, states, token_mask, layers="unrolled",
                                history_backend="pallas-interpret", **common)
        check_same_candidates(folded, scan)
    with pytest.raises(ValueError, match="layers='loop'; valid: scan, unrolled"):
        dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=1, w_mlp=1, layers="loop")
    with pytest.raises(ValueError, match="dp_layers='loop'"):
        KnapSpecConfig(dp_layers="loop")
    with pytest.raises(ValueError, match="dp_layers='unrolled' is for the sub-layer DP"):
        KnapSpecConfig(dp_layers="unrolled", coupled=True)


def test_candidates_scored_per_head_pass_by_rows_give_the_same_statistics(tiny_problem):
    """The LM head scores the DP's candidates AGREEMENT_ROWS rows a pass by default (not 8 candidates): the same
    (alpha, p_c, p_ac) as one candidate a pass; a bad chunk fails before anything runs."""
    params, cache, prefix, _, token_mask, states = tiny_problem
    finals = jnp.zeros((30, 2, 8, TINY.hidden_size))
    assert dp.agreement_chunk(finals) == 30  # 480 rows fit one pass
    assert dp.agreement_chunk(jnp.zeros((30, 16, 64, 4))) == 1
    assert dp.agreement_chunk(jnp.zeros((300, 1, 2, 4))) == dp.AGREEMENT_ROWS // 2
    assert dp.agreement_chunk(finals, 8) == 8
    by_rows = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=2, w_mlp=1, exit_threshold=0.3)
    one = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=2, w_mlp=1, exit_threshold=0.3,
                         alpha_chunk=1)
    assert len(by_rows) > 1
    np.testing.assert_array_equal(by_rows.masks, one.masks)
    for field in ("alpha", "confident", "agree_confident"):  # shares of 14 tokens: one token apart is 0.07
        np.testing.assert_allclose(getattr(by_rows, field), getattr(one, field), rtol=1e-6)
    with pytest.raises(ValueError, match="alpha_chunk=0 must be a positive number"):
        dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=2, w_mlp=1, alpha_chunk=0)


@pytest.mark.parametrize("w_attn,w_mlp", [(2, 1)])
def test_dp_with_branches_folded_into_the_history_kernel_equals_the_vmapped_dp(tiny_problem, w_attn, w_mlp):
    """history_backend: every branch's rows in one call of the Pallas history kernel (interpreted here),
    merged with each branch's own K/V by their softmax statistics, give the DP of the vmap-ed reference
    attention: the same trace, masks and alphas (docs/methods.md §4.3). Both cache rows are ragged and the
    cache capacity is not a multiple of the kernel's block (the stacked copy is padded)."""
    params, cache, prefix, _, token_mask, states = tiny_problem
    assert int(np.max(prefix)) <= 40 < cache.capacity
    trimmed = dataclass_replace(cache, keys=tuple(k[:, :, :40] for k in cache.keys),  # 40 slots: padded to 64
                                values=tuple(v[:, :, :40] for v in cache.values))
    ref = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=w_attn, w_mlp=w_mlp,
                         keep_states=True)
    folded = dp.knapsack_dp(params, TINY, trimmed, prefix, states, token_mask, w_attn=w_attn, w_mlp=w_mlp,
                            keep_states=True, history_backend="pallas-interpret")
    check_same_candidates(folded, ref)
    same = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=w_attn, w_mlp=w_mlp,
                          history_backend="xla")  # "xla" names the reference attention
    np.testing.assert_array_equal(same.masks, ref.masks)
    wide = dp.knapsack_dp(params, TINY, trimmed, prefix, states, token_mask, w_attn=w_attn, w_mlp=w_mlp,
                          history_backend="pallas-interpret", history_rows=16, keep_states=True)  # several calls
    check_same_candidates(wide, ref)
    for rows, match in ((24, "power of two >= 16"), (8, "power of two >= 16")):
        with pytest.raises(ValueError, match=match):
            dp.knapsack_dp(params, TINY, trimmed, prefix, states, token_mask, w_attn=1, w_mlp=1,
                           history_backend="pallas-interpret", history_rows=rows)
    with pytest.raises(ValueError, match="needs a history_backend"):
        dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=1, w_mlp=1, history_rows=64)
    for bad, match in (("pallas-tpu", "Triton history kernel"), ("nope", "attention_backend")):
        with pytest.raises(ValueError, match=match):
            dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=1, w_mlp=1, history_backend=bad)
    with pytest.raises(ValueError, match="reference_kv='target'"):
        dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=1, w_mlp=1,
                       history_backend="pallas-interpret", reference_kv="target")
    with pytest.raises(ValueError, match="branch_chunk=3"):
        dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=1, w_mlp=1,
                       history_backend="pallas-interpret", branch_chunk=3)


def test_dp_candidates_are_realised_by_the_skip_forward(tiny_problem):
    """Each backtracked mask, run through the model's own forward with that dynamic skip mask
    (what the draft policy executes), reproduces the DP's final state, cosine and alpha; slot 0
    is the full model (cosine 1, alpha 1); edge layers are never skipped; weights add up."""
    params, cache, prefix, tokens, token_mask, states = tiny_problem
    cands = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=2, w_mlp=1, keep_states=True)
    assert cands.weights[0] == 0 and not cands.masks[0].any()
    assert cands.cosine[0] == pytest.approx(1.0, abs=1e-5) and cands.alpha[0] == 1.0
    mask = np.asarray(token_mask)
    teacher = np.argmax(np.asarray(forward_jit(params, tokens, cache.with_lengths(prefix), config=TINY).logits), -1)
    for c, skip in enumerate(cands.masks):
        assert not skip[0].any() and not skip[-1].any()
        assert 2 * skip[:, 0].sum() + skip[:, 1].sum() == cands.weights[c]
        out = forward_jit(params, tokens, cache.with_lengths(prefix), config=TINY, skip_mask=jnp.asarray(skip),
                       return_hidden=True)
        np.testing.assert_allclose(cands.final_states[c], np.asarray(out.hidden), rtol=1e-4, atol=1e-4)
        cos = float(dp.cos_sum(out.hidden, states[-1], token_mask)) / mask.sum()
        assert cos == pytest.approx(cands.cosine[c], abs=1e-5)
        agree = ((np.argmax(np.asarray(out.logits), -1) == teacher) * mask).sum() / mask.sum()
        assert agree == pytest.approx(cands.alpha[c], abs=1e-6)
        assert cos >= dp.DEFAULT_TAU


def test_dp_never_beats_brute_force_on_model(tiny_problem):
    """On a real model the DP is a heuristic: every DP candidate is a feasible skip set, so its
    value is <= the exhaustive optimum for its weight (equality is typical but not guaranteed:
    with w = (1, 3) this instance has a weight class brute force reaches and the DP does not)."""
    params, cache, prefix, _, token_mask, states = tiny_problem
    for w_attn, w_mlp in ((1, 1), (1, 3)):
        cands = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=w_attn, w_mlp=w_mlp)
        best = dp.knapsack_brute_force(params, TINY, cache, prefix, states, token_mask, w_attn=w_attn, w_mlp=w_mlp)
        assert set(cands.weights.tolist()) <= set(best)
        for c, j in enumerate(cands.weights):
            assert cands.cosine[c] <= best[int(j)][0] + 1e-6
        if (w_attn, w_mlp) == (1, 3):  # the DP's greedy choice per (depth, weight) loses a weight class
            assert set(best) - set(cands.weights.tolist())
    assert dp.knapsack_exhaustive_count(TINY.num_layers) == 64


# ---------------------------------------------------------------------------- planner
def test_tpt_edge_cases():
    assert planner.expected_tokens(0.0, 5) == 1.0  # alpha = 0: only the correction token
    assert planner.expected_tokens(1.0, 5) == 6.0  # alpha = 1: gamma + 1
    assert planner.expected_tokens(1.0 - 1e-9, 5) == pytest.approx(6.0, rel=1e-6)  # continuous limit
    assert planner.expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert planner.tpt(0.0, 3, 0.1, 1.0) == pytest.approx(1.0 / 1.3)
    assert planner.tpt(1.0, 3, 0.1, 1.0) == pytest.approx(4.0 / 1.3)
    for alpha in (0.0, 0.3, 1.0):  # gamma = 0: plain decoding, 1 / t_target whatever the draft
        assert planner.tpt(alpha, 0, 123.0, 2.0) == pytest.approx(0.5)
    # a: the target's unmasked forward in modelled steps (verification a + v g; plain decoding a)
    assert planner.tpt(0.7, 0, 0.5, 2.0, v=0.1, a=0.5) == pytest.approx(1.0)
    assert planner.tpt(1.0, 2, 0.5, 2.0, v=0.1, a=0.5) == pytest.approx(3.0 / (1.0 + 2.0 * 0.7))
    # plain: the decode loop's own step prices gamma = 0 only; verification keeps a + v g
    assert planner.tpt(0.7, 0, 0.5, 2.0, v=0.1, a=0.5, plain=0.25) == pytest.approx(2.0)
    assert planner.tpt(1.0, 2, 0.5, 2.0, v=0.1, a=0.5, plain=0.25) == pytest.approx(3.0 / (1.0 + 2.0 * 0.7))
    model = latency.LatencyModel(c1=1e-3, c2=0.0, c3=1e-3, a=1.4, p=0.9)
    plan = planner.choose_plan(np.zeros((1, 3, 2), bool), [0.0], model, 100.0, gammas=(0, 1))
    step = model.t_step(100.0, 3)
    assert plan.gamma == 0 and plan.table[0, 0] == pytest.approx(1.0 / (0.9 * step))  # p, not a
    assert plan.predicted_tpt == pytest.approx(1.0 / (0.9 * step)) and plan.summary()["plain_ratio"] == 0.9
    masks = np.zeros((1, 3, 2), bool)
    masks[0, 1] = True  # skip attention and MLP of layer 1
    assert planner.draft_time(masks, 2.0, 1.0)[0] == 2 * 2.0 + 2 * 1.0
    assert planner.target_time(3, 2.0, 1.0) == 9.0


def test_grid_search_picks_the_analytic_optimum():
    L = 4
    full = np.zeros((L, 2), bool)
    middle = full.copy()
    middle[1:3] = True  # skips layers 1-2 entirely: executes 2 attention + 2 MLP
    skip_attn = full.copy()
    skip_attn[1:3, 0] = True  # executes 2 attention + 4 MLP
    skip_mlp = full.copy()
    skip_mlp[1:3, 1] = True  # executes 4 attention + 2 MLP
    lat = (1 / 8, 1 / 8)  # t_target = 4 (1/8 + 1/8) = 1, t_draft(middle) = 0.5
    assert planner.target_time(L, *lat) == 1.0 and planner.draft_time(middle[None], *lat)[0] == 0.5
    # alpha = 0.9: TPT(g) = 10 (1 - 0.9^(g+1)) / (1 + g/2):
    # g=2: 2.71/2 = 1.355, g=3: 3.439/2.5 = 1.3756, g=4: 4.0951/3 = 1.3650  ->  gamma* = 3
    plan = planner.choose_plan(np.stack([full, middle]), [1.0, 0.9], lat)
    assert (plan.index, plan.gamma) == (1, 3) and plan.score == pytest.approx(3.439 / 2.5)
    assert plan.predicted_tpt == pytest.approx(plan.score)
    # the full model is excluded although its TPT (1 / t_target = 1 at every gamma) would compete
    assert np.isinf(plan.table[0]).all()
    # alpha = 0.5: g=0: 1, g=1: 1.5/1.5 = 1 (tie -> smaller gamma), g=2: 1.75/2 < 1  ->  gamma* = 0
    assert planner.choose_plan(middle[None], [0.5], lat).gamma == 0
    # alpha = 1 and t_draft < t_target: (g+1) / (1 + g/2) increases -> the grid's end, 17
    assert planner.choose_plan(middle[None], [1.0], lat).gamma == 17
    # alpha = 0: every draft token is wasted -> 0
    assert planner.choose_plan(middle[None], [0.0], lat).gamma == 0
    # the grid search equals an independent double loop on a random instance
    rng = np.random.RandomState(1)
    masks = rng.rand(6, L, 2) < 0.4
    alphas = rng.rand(6)
    plan = planner.choose_plan(masks, alphas, (0.3, 0.7), exclude_full=False)
    best = max(((float(planner.tpt(alphas[c], g, planner.draft_time(masks[c][None], 0.3, 0.7)[0],
                                    planner.target_time(L, 0.3, 0.7))), -c, -g) for c in range(6) for g in range(18)))
    assert (plan.index, plan.gamma) == (-best[1], -best[2]) and plan.score == pytest.approx(best[0])
    # context dependence: equal alpha; long context (attention dominates) -> skip attention,
    # short context (MLP dominates) -> skip MLP
    model = latency.LatencyModel(c1=1.0, c2=1e-3, c3=0.1)
    both = np.stack([skip_attn, skip_mlp])
    assert planner.choose_plan(both, [0.8, 0.8], model, n=20000).index == 0
    assert planner.choose_plan(both, [0.8, 0.8], model, n=100).index == 1
    # TPL ignores latencies: both execute 6 of 8 sub-layers -> a tie, the first candidate
    tpl = planner.choose_plan(both, [0.8, 0.8], model, n=100, objective="tpl")
    assert tpl.index == 0 and tpl.score == pytest.approx(
        float(planner.expected_tokens(0.8, tpl.gamma)) / (tpl.gamma * 6 + 8))
    # only the full model: it is chosen
    assert planner.choose_plan(full[None], [1.0], model, n=10).index == 0
    # a target forward much cheaper than the draft-form step (a GPU's masked draft): plain decoding
    even = latency.LatencyModel(c1=1.0, c2=0.0, c3=1.0)
    assert planner.choose_plan(middle[None], [0.9], even).gamma > 0
    cheap_target = planner.choose_plan(middle[None], [0.9], dataclasses.replace(even, a=0.3))
    assert cheap_target.gamma == 0 and cheap_target.target_ratio == 0.3
    assert cheap_target.score == pytest.approx(1.0 / (0.3 * 8.0))
    with pytest.raises(ValueError, match="objective"):
        planner.choose_plan(both, [0.8, 0.8], model, objective="alpha")


# ---------------------------------------------------------------------------- policy and schedule
def test_schedule_and_reference_window():
    events = KnapSpecSchedule().events()
    assert [next(events) for _ in range(4)] == [("mark", 1), ("plan", 6), ("mark", 65), ("plan", 70)]
    assert KnapSpecSchedule().is_plan_round(134) and not KnapSpecSchedule().is_plan_round(64)
    sched = KnapSpecSchedule()
    assert [sched.next_plan_round(r) for r in (0, 6, 7, 70, 71, 200)] == [6, 6, 70, 70, 134, 262]
    assert sched.mark_round(70) == 65
    prompt = np.array([[10, 11, 12, 0], [20, 21, 22, 23]])
    out = np.array([[30, 31, 32, 33, 34, -1], [40, 41, -1, -1, -1, -1]])
    # row 0: prompt 3 + 5 generated = 8 committed, cache holds 7; row 1: 4 + 2 = 6, cache holds 5
    tokens, mask, prefix = reference_window(prompt, np.array([3, 4]), out, np.array([5, 2]), np.array([7, 5]),
                                            np.array([4, 5]), bucket=4)
    np.testing.assert_array_equal(prefix, [4, 5])
    np.testing.assert_array_equal(tokens, [[31, 32, 33, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 1, 0], [0, 0, 0, 0]])
    assert reference_window(prompt, np.array([3, 4]), out, np.array([5, 2]), np.array([7, 5]),
                            np.array([7, 5])) is None
    # a cap narrower than the bucket: the window is never wider than the cap (the latest tokens)
    tokens, mask, _ = reference_window(prompt, np.array([3, 4]), out, np.array([5, 2]), np.array([7, 5]),
                                       np.array([4, 5]), max_tokens=2, bucket=16)
    np.testing.assert_array_equal(tokens, [[32, 33], [0, 0]])
    np.testing.assert_array_equal(mask, [[1, 1], [0, 0]])
    with pytest.raises(ValueError, match="reference_rounds"):
        KnapSpecConfig(plan_round=2, reference_rounds=3)


SPEC_TARGET = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
                          num_kv_heads=2, head_dim=16, dtype="float32")
PROMPTS = [np.random.RandomState(0).randint(0, 97, n).tolist() for n in (5, 17, 40)]


@pytest.fixture(scope="module")
def spec_params():
    return init_params(SPEC_TARGET, jax.random.PRNGKey(0), scale=0.2)


@pytest.mark.parametrize("dp_layers", ["scan", "unrolled"])
def test_greedy_knapspec_equals_autoregressive(spec_params, dp_layers):
    """End to end: prefill, full-model draft, re-plans (DP + grid search) every 4 rounds on the
    last 2 rounds' tokens, early exit at 0.7 with fillers: the output is exactly greedy AR, with the DP as a scan
    and traced once per layer."""
    expected = generate(spec_params, SPEC_TARGET, PROMPTS, 24).rows()
    knap = KnapSpecConfig(gamma_max=4, plan_interval=4, plan_round=2, reference_rounds=2, max_plan_fraction=None,
                          probe_rounds=None, dp_layers=dp_layers)
    lat = latency.LatencyModel(c1=1.0, c2=0.01, c3=0.5)
    result = knapspec_generate(spec_params, SPEC_TARGET, PROMPTS, latency=lat, knapspec=knap, max_new_tokens=24)
    assert result.rows() == expected
    plans = result.metrics["knapspec_plans"]
    assert [p["round"] for p in plans][:3] == [2, 6, 10]
    assert all(p["skip_attn"] or p["skip_mlp"] for p in plans)  # the full model is never chosen
    assert all(0 not in p["skip_attn"] + p["skip_mlp"] and 3 not in p["skip_attn"] + p["skip_mlp"] for p in plans)
    assert np.asarray(result.metrics["final_skip_mask"]).any()
    rounds = result.metrics["rounds"]
    assert rounds == int(result.final_state.round) and 0 < rounds < 24
    assert 0 < result.metrics["draft_steps"] < 4 * rounds  # the random model's drafts are unsure: early exits


def test_expensive_plans_are_postponed_and_output_stays_exact(spec_params):
    """max_plan_fraction: a planner that costs far more than the decoding between plans is run
    once (the first plan always runs); the fixed schedule (None) re-plans every interval. Greedy
    output equals AR either way."""
    import time

    from jaxspec.knapspec.planner import PlannerBase
    from jaxspec.knapspec.policy import KnapSpecPlanner

    class SlowPlanner(PlannerBase):
        name = "slow"

        def __init__(self, inner, seconds):
            self.inner, self.seconds, self.calls = inner, seconds, 0

        def plan(self, *args):
            self.calls += 1
            time.sleep(self.seconds)
            return self.inner.plan(*args)

    expected = generate(spec_params, SPEC_TARGET, PROMPTS, 24).rows()
    lat = latency.LatencyModel(c1=1.0, c2=0.01, c3=0.5)
    for fraction, one_plan in ((0.05, True), (None, False)):
        knap = KnapSpecConfig(gamma_max=4, plan_interval=4, plan_round=2, reference_rounds=2,
                              max_plan_fraction=fraction)
        planner = SlowPlanner(KnapSpecPlanner(lat, knap), 1.0)  # >= 20 s of decoding needed per plan at 5 %
        result = knapspec_generate(spec_params, SPEC_TARGET, PROMPTS, latency=lat, knapspec=knap, max_new_tokens=24,
                                   planner=planner)
        assert result.rows() == expected
        rounds = [p["round"] for p in result.metrics["knapspec_plans"]]
        if one_plan:
            assert rounds == [2] and planner.calls == 1
            assert result.timings["postponed_plans"] >= 1
        else:
            assert rounds[:2] == [2, 6] and planner.calls >= 2 and "postponed_plans" not in result.timings
    with pytest.raises(ValueError, match="max_plan_fraction"):
        KnapSpecConfig(max_plan_fraction=1.5)


def test_replans_stop_at_the_run_planning_budget(spec_params, monkeypatch):
    """max_plan_fraction over the whole run: on a clock where a plain step costs 1 and a plan 1, the spacing
    rule alone (at 5 %, a plan only after 20 units of decoding since the previous one) still re-plans at step 22
    of 30 and plans 2 units of 32 (6 %: the second plan has too little run left after it); with the run rule
    that re-plan would take the planning past 5 % of the projected decode time and is not made. Greedy output
    equals AR either way."""
    import types

    from jaxspec.knapspec import controller, skip_planner
    from jaxspec.knapspec.planner import PlannerBase
    from jaxspec.knapspec.policy import KnapSpecController, KnapSpecPlanner

    clock = types.SimpleNamespace(t=0.0)

    def fake_clock():  # the controller's and the planner's clocks
        for module in (controller, skip_planner):
            monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=lambda: clock.t))

    fake_clock()

    class PlainPlanner(PlannerBase):  # each plan costs 1 clock unit and picks plain decoding
        name = "plain"

        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def plan(self, *args):
            self.calls += 1
            clock.t += 1.0
            plan, candidates, weights = self.inner.plan(*args)
            return dataclasses.replace(plan, gamma=0), candidates, weights

    real_chunks = KnapSpecController.chunks

    def timed_chunks(self, run):  # a plain step costs 1 unit, a round 2
        gen = real_chunks(self, run)
        try:
            chunk = next(gen)
            while True:
                if not run.warmup:
                    clock.t += float(chunk.plain_steps or 0) + 2.0 * float(chunk.rounds or 0)
                sent = yield chunk
                chunk = gen.send(sent)
        except StopIteration as stop:
            return stop.value

    monkeypatch.setattr(KnapSpecController, "chunks", timed_chunks)
    expected = generate(spec_params, SPEC_TARGET, PROMPTS, 30).rows()
    lat = latency.LatencyModel(c1=1.0, c2=0.01, c3=0.5)
    shares = {}
    for run_rule in (False, True):
        knap = KnapSpecConfig(gamma_max=4, plan_interval=4, plan_round=2, reference_rounds=2, max_plan_fraction=0.05,
                              probe_rounds=None, min_reference_tokens=1)
        if not run_rule:  # the spacing rule only: a run budget too large to bind
            monkeypatch.setattr(controller, "remaining_steps", lambda run: run.engine.max_new_tokens - 1)
        else:
            monkeypatch.undo()
            fake_clock()
            monkeypatch.setattr(KnapSpecController, "chunks", timed_chunks)
        clock.t = 0.0
        planner = PlainPlanner(KnapSpecPlanner(lat, knap))
        result = knapspec_generate(spec_params, SPEC_TARGET, PROMPTS, latency=lat, knapspec=knap, max_new_tokens=30,
                                   planner=planner)
        assert result.rows() == expected
        shares[run_rule] = (result.timings["plan_s"] / clock.t, planner.calls,
                            result.timings.get("plans_over_run_budget", 0))
    assert shares[False][0] > 0.05 and shares[False][1] == 2 and shares[False][2] == 0  # spacing alone overspends
    assert shares[True][0] <= 0.05 and shares[True][1] == 1 and shares[True][2] == 1


@pytest.mark.parametrize("greedy", [True, False])
def test_draft_early_exit_and_fillers(spec_params, greedy):
    """One proposal: without early exit the draft equals SelfDraft's (greedy); with a threshold no
    token reaches (1.0) the loop stops after one forward and the rest are fillers whose draft
    distribution is one-hot (what keeps rejection sampling exact)."""
    from jaxspec.decoding.policies import SelfDraft
    from jaxspec.decoding.sampling import SamplingConfig

    sampling = SamplingConfig() if greedy else SamplingConfig(temperature=1.0)
    batch, gamma = 3, 4
    prompts = np.random.RandomState(1).randint(0, 97, (batch, 12))
    cache = forward_jit(spec_params, jnp.asarray(prompts[:, :-1]), init_cache(SPEC_TARGET, batch, 32),
                    config=SPEC_TARGET).cache
    pending, previous = jnp.asarray(prompts[:, -1]), jnp.asarray(prompts[:, -2])
    committed = jnp.full((batch,), 12, jnp.int32)
    skip = np.zeros((4, 2), bool)
    skip[2, 0] = True
    for early_exit in (None, 1.0):
        policy = KnapSpecDraft(SPEC_TARGET, early_exit=early_exit)
        propose = jax.jit(lambda state, cache, key, policy=policy: policy.propose(
            spec_params, state, cache, pending, previous, committed, gamma=gamma, sampling=sampling, key=key))
        out = propose(policy.initial_state(skip), cache, jax.random.PRNGKey(0))
        tokens = np.asarray(out.tokens)
        if early_exit is None:
            assert int(out.state["draft_steps"]) == gamma
            if greedy:
                base = SelfDraft(SPEC_TARGET)
                ref = jax.jit(lambda state, cache: base.propose(
                    spec_params, state, cache, pending, previous, committed, gamma=gamma, sampling=sampling,
                    key=jax.random.PRNGKey(0)))(base.initial_state(skip), cache)
                np.testing.assert_array_equal(tokens, np.asarray(ref.tokens))
            else:
                np.testing.assert_allclose(np.asarray(out.probs).sum(-1), 1.0, rtol=1e-5)
        else:
            assert int(out.state["draft_steps"]) == 1
            np.testing.assert_array_equal(tokens[:, 1:], np.repeat(tokens[:, :1], gamma - 1, axis=1))
            if not greedy:
                probs = np.asarray(out.probs)
                np.testing.assert_array_equal(probs[:, 1:], np.eye(97)[tokens[:, 1:]])
                np.testing.assert_allclose(probs[:, 0].sum(-1), 1.0, rtol=1e-5)
        assert np.asarray(out.state["skip_mask"]).tolist() == skip.tolist()
    with pytest.raises(ValueError, match="early_exit"):
        KnapSpecDraft(SPEC_TARGET, early_exit=1.5)


def test_exit_aware_tpt_formulas_and_monte_carlo():
    """Early-exit TPT: reduces to the paper's formulas without exits (p_c = 1, p_ac = alpha), gamma 0 is
    plain decoding, and the closed forms match a simulation of rounds with i.i.d. (agree,
    confident) positions."""
    g = np.arange(0, 11)
    for a in (0.0, 0.3, 0.8, 1.0):
        np.testing.assert_allclose(planner.expected_tokens_exit(a, a, g), planner.expected_tokens(a, g))
        np.testing.assert_allclose(planner.expected_drafts(1.0, g), g)
        np.testing.assert_allclose(planner.tpt(a, g, 0.3, 1.0, 0.05, 1.2, p_c=1.0, p_ac=a),
                                   planner.tpt(a, g, 0.3, 1.0, 0.05, 1.2))
    assert planner.expected_tokens_exit(0.9, 0.5, 0) == 1.0 and planner.expected_drafts(0.5, 0) == 0.0
    # simulation: draft i is produced if drafts 1..i-1 were confident; the round commits the leading
    # accepted drafts + 1 (positions independent, joint law of (agree, confident) given)
    rng = np.random.RandomState(0)
    joint = {(1, 1): 0.6, (1, 0): 0.15, (0, 1): 0.15, (0, 0): 0.10}
    keys = list(joint)
    alpha = joint[(1, 1)] + joint[(1, 0)]
    p_c = joint[(1, 1)] + joint[(0, 1)]
    p_ac = joint[(1, 1)]
    for gamma in (1, 3, 6):
        draws = rng.choice(len(keys), size=(40000, gamma), p=[joint[k] for k in keys])
        tokens = drafts = 0
        for row in draws:
            produced, accepted, run = 0, 0, True
            for i in range(gamma):
                agree, confident = keys[row[i]]
                produced += 1
                if run and agree:
                    accepted += 1
                else:
                    run = False
                if not confident:
                    break
            tokens += accepted + 1
            drafts += produced
        assert tokens / len(draws) == pytest.approx(planner.expected_tokens_exit(alpha, p_ac, gamma), rel=0.02)
        assert drafts / len(draws) == pytest.approx(planner.expected_drafts(p_c, gamma), rel=0.02)


def test_exit_stats_of_the_dp_and_the_plan(tiny_problem):
    """knapsack_dp(exit_threshold=) adds p_c / p_ac per candidate (shares in [0, 1] with
    p_ac <= min(alpha, p_c), alpha unchanged); threshold 0 makes every token confident; the
    exit-aware grid search uses them and a plan records them."""
    params, cache, prefix, _, token_mask, states = tiny_problem
    plain = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=1, w_mlp=1)
    assert plain.confident is None and plain.agree_confident is None
    half = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=1, w_mlp=1, exit_threshold=0.05)
    np.testing.assert_allclose(half.alpha, plain.alpha)
    for x in (half.confident, half.agree_confident):
        assert x.shape == plain.alpha.shape and (x >= 0).all() and (x <= 1 + 1e-9).all()
    assert (half.agree_confident <= np.minimum(half.alpha, half.confident) + 1e-9).all()
    zero = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=1, w_mlp=1, exit_threshold=0.0)
    np.testing.assert_allclose(zero.confident, 1.0)
    np.testing.assert_allclose(zero.agree_confident, zero.alpha)
    # the random tiny model is unsure (greedy probabilities far below 0.7): with the exit model a
    # long draft buys nothing, so the exit-aware plan drafts no more than the paper's
    strict = dp.knapsack_dp(params, TINY, cache, prefix, states, token_mask, w_attn=1, w_mlp=1, exit_threshold=0.7)
    assert strict.confident.max() < 0.5
    lat = (0.01, 0.01, 0.02)
    spec = planner.choose_plan(strict.masks, strict.alpha, lat, gammas=range(11))
    aware = planner.choose_plan(strict.masks, strict.alpha, lat, gammas=range(11),
                                exit_stats=(strict.confident, strict.agree_confident))
    assert aware.gamma <= spec.gamma and aware.p_c == strict.confident[aware.index]
    assert aware.summary()["p_ac"] == strict.agree_confident[aware.index] and spec.p_c is None
    with pytest.raises(ValueError, match="exit_stats"):
        planner.choose_plan(strict.masks, strict.alpha, lat, exit_stats=(strict.confident,))


def test_weight_cap_sets_the_dps_slots_and_its_price():
    """A coarser weight cap gives the DP fewer slot states, (w_attn + w_mlp) L / 2 + 1 with the heavier weight
    capped, and the allowance's price of the DP falls with them."""
    from jaxspec.knapspec.latency import LatencyModel
    from jaxspec.knapspec.policy import KnapSpecPlanner

    lat = LatencyModel(c1=4.0, c2=0.0, c3=1.0, u=1e-3)  # t_mlp = 4 t_attn: weights (1, 4) under the default cap
    assert dp.knapsack_weights(lat.t_attn(0), lat.t_mlp()) == (1, 4)
    assert dp.knapsack_weights(lat.t_attn(0), lat.t_mlp(), cap=2) == (1, 2)
    costs = {}
    for cap, slots in ((5, 5 * TINY.num_layers // 2 + 1), (2, 3 * TINY.num_layers // 2 + 1), (1, TINY.num_layers + 1)):
        planner = KnapSpecPlanner(lat, KnapSpecConfig(weight_cap=cap))
        assert planner._slots(TINY, 0.0) == slots
        costs[cap] = planner.reference_cost(TINY, 0.0)
        assert costs[cap] == pytest.approx(slots * lat.t_extra_row(0.0, TINY.num_layers))
    assert costs[1] < costs[2] < costs[5]
