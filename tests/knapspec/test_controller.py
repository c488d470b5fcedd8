"""KnapSpec driver and baselines: num_drafted clamping, max_rounds, per-plan gamma (buckets and the
plain-decoding fallback), CLaSp, the static skip set, the coupled DP, and the ``generate`` CLI."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from dataclasses import replace as dataclasses_replace
import pytest

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import generate
from jaxspec.decoding.sampling import SamplingConfig, sampling_probs
from jaxspec.decoding.speculative import (EngineConfig, rejection_accept, run_loop, speculative_generate,
                                          summarize)
from jaxspec.knapspec import dp, latency
from jaxspec.knapspec.planner import Plan, PlannerBase
from jaxspec.knapspec.policy import KnapSpecConfig, KnapSpecDraft, knapspec_generate
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import forward_jit, init_params
from tests.conftest import dp_model_problem, slow_engine_side

TARGET = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=5, num_heads=4, num_kv_heads=2,
                     head_dim=16, dtype="float32")
PROMPTS = [np.random.RandomState(0).randint(0, 97, n).tolist() for n in (5, 17, 40)]
NEW = 30
LATENCY = latency.LatencyModel(c1=1.0, c2=0.01, c3=0.5)
# re-plan every 4 rounds (at 2, 6, 10, ...) on the last 2 rounds; buckets 1, 2, 3 and gamma_max 5; the fixed
# schedule without arbitration: the tests below check plan rounds and gammas
KNAP = KnapSpecConfig(gamma_max=5, plan_interval=4, plan_round=2, reference_rounds=2, gamma_buckets=(1, 2, 3),
                      max_plan_fraction=None, probe_rounds=None)


@pytest.fixture(scope="module")
def params():
    return init_params(TARGET, jax.random.PRNGKey(0), scale=0.2)


@pytest.fixture(scope="module")
def ar_rows(params):
    return generate(params, TARGET, PROMPTS, NEW).rows()


class ScriptedPlanner(PlannerBase):
    """Returns a scripted sequence of gammas (and masks skipping one sub-layer)."""

    name = "scripted"

    def __init__(self, gammas):
        self.gammas, self.calls = list(gammas), 0

    def plan(self, params, config, cache, tokens, token_mask, prefix_len, n):
        gamma = self.gammas[self.calls % len(self.gammas)]
        self.calls += 1
        mask = np.zeros((config.num_layers, 2), bool)
        mask[1 + self.calls % (config.num_layers - 2), self.calls % 2] = True
        plan = Plan(mask=mask, gamma=gamma, score=0.0, index=0, alpha=0.5, objective="scripted", n=float(n),
                    t_attn=1.0, t_mlp=1.0, table=np.zeros((1, 1)), gammas=(gamma,))
        return plan, None, (1, 1)


# ---------------------------------------------------------------------------- engine: num_drafted, max_rounds
class _NoCount(KnapSpecDraft):
    """KnapSpecDraft without ``num_drafted``: fillers are verified like drafts (the old behaviour)."""

    def propose(self, *args, **kwargs):
        return super().propose(*args, **kwargs)._replace(num_drafted=None)


def test_num_drafted_keeps_greedy_output_and_counts_only_drafts(params, ar_rows):
    """A full-model draft that exits after one token (threshold 1.0), gamma 4: the 3 fillers repeat
    the draft. With num_drafted the engine never accepts a filler and the acceptance rate is over
    real drafts (1 per round, always accepted: rate 1); without it, fillers the target happens to
    repeat are accepted and every round counts 4 drafts. Greedy output is AR's either way."""
    engine = EngineConfig(gamma=4, max_new_tokens=NEW)
    results = {}
    for name, cls in (("clamped", KnapSpecDraft), ("unclamped", _NoCount)):
        policy = cls(TARGET, early_exit=1.0)
        results[name] = speculative_generate(params, TARGET, PROMPTS, draft_policy=policy,
                                             draft_state=policy.initial_state(), engine=engine)
        assert results[name].rows() == ar_rows
    clamped, unclamped = results["clamped"].metrics, results["unclamped"].metrics
    assert clamped["accepted_histogram"][2:] == [0, 0, 0]
    assert clamped["drafted_tokens"] == clamped["row_rounds"] == clamped["drafted_histogram"][1]
    assert clamped["acceptance_rate"] == 1.0 and clamped["mean_drafted"] == 1.0
    assert clamped["acceptance_rate_per_position"] == [1.0, None, None, None]
    assert unclamped["drafted_tokens"] == 4 * unclamped["row_rounds"]
    assert unclamped["acceptance_rate"] < 0.5


def test_other_policies_metrics_unchanged(params, ar_rows):
    """Policies without num_drafted: drafted = gamma per round, as before."""
    from jaxspec.decoding.policies import SelfDraft, parse_skip_spec

    policy = SelfDraft(TARGET)
    result = speculative_generate(params, TARGET, PROMPTS, draft_policy=policy,
                                  draft_state=policy.initial_state(parse_skip_spec("mlp:odd", 5)),
                                  engine=EngineConfig(gamma=3, max_new_tokens=NEW))
    m = result.metrics
    hist = np.asarray(m["accepted_histogram"])
    assert result.rows() == ar_rows
    assert m["drafted_tokens"] == 3 * m["row_rounds"] == 3 * hist.sum()
    assert m["acceptance_rate"] == pytest.approx((hist * np.arange(4)).sum() / (3 * hist.sum()))


def test_rejection_sampling_with_num_drafted_is_standard_sd():
    """gamma 3 but only d_1 drafted (fillers carry an arbitrary q): never more than one accepted,
    the first committed token ~ p_0 and, after an accepted d_1, the next token ~ p_1 (the bonus
    of a one-token draft), not a residual against the filler's q."""
    from tests.conftest import chi_square_pvalue as _chi_square

    vocab, gamma, rows = 6, 3, 120_000
    sampling = SamplingConfig(temperature=1.0)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    target_logits = jnp.broadcast_to(2.0 * jax.random.normal(keys[0], (1, gamma + 1, vocab)), (rows, gamma + 1, vocab))
    q = jnp.broadcast_to(sampling_probs(2.0 * jax.random.normal(keys[1], (1, gamma, vocab)), sampling),
                         (rows, gamma, vocab))
    drafts = jax.random.categorical(keys[2], jnp.log(q), axis=-1).astype(jnp.int32)
    num_drafted = jnp.ones((rows,), jnp.int32)
    accepted, next_token = rejection_accept(target_logits, drafts, q, sampling, keys[3], num_drafted)
    accepted, next_token = np.asarray(accepted), np.asarray(next_token)
    assert accepted.max() == 1 and accepted.min() == 0
    p = np.asarray(sampling_probs(target_logits[0], sampling))
    first = np.where(accepted > 0, np.asarray(drafts[:, 0]), next_token)
    assert _chi_square(np.bincount(first, minlength=vocab), p[0]) > 1e-3
    bonus = next_token[accepted == 1]
    assert _chi_square(np.bincount(bonus, minlength=vocab), p[1]) > 1e-3
    residual = np.maximum(p[1] - np.asarray(q[0, 1]), 0)
    assert _chi_square(np.bincount(bonus, minlength=vocab), residual / residual.sum()) < 1e-6


def test_run_loop_max_rounds(params, ar_rows):
    """max_rounds bounds a call (a traced value: no recompile) and continuing gives the same output."""
    from jaxspec.decoding.autoregressive import pad_prompts, prefill
    from jaxspec.decoding.policies import DenseVerify, SelfDraft, parse_skip_spec
    from jaxspec.decoding.speculative import loop_state_from_caches, loop_jit

    policy = SelfDraft(TARGET)
    engine = EngineConfig(gamma=2, max_new_tokens=NEW)
    result = speculative_generate(params, TARGET, PROMPTS, draft_policy=policy,
                                  draft_state=policy.initial_state(parse_skip_spec("attn:2", 5)), engine=engine)
    tokens, lengths = pad_prompts(PROMPTS)
    cache = init_cache(TARGET, 3, int(lengths.max()) + NEW + 8)
    cache, logits = prefill(params, TARGET, tokens, lengths, cache)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    previous = jnp.asarray(tokens[np.arange(3), lengths - 1])
    state = loop_state_from_caches(cache, policy.initial_state(parse_skip_spec("attn:2", 5)), first, previous, engine)
    static = dict(target_config=TARGET, draft_policy=policy, verify_policy=DenseVerify(), engine=engine)
    state = run_loop(params, params, state, max_rounds=3, **static)
    assert int(state.round) == 3
    compiled = loop_jit._cache_size()
    while not bool(jnp.all(state.done)):
        before = int(state.round)
        state = run_loop(params, params, state, max_rounds=5, **static)
        assert int(state.round) - before <= 5
    assert loop_jit._cache_size() == compiled  # one compile for every max_rounds value
    out = np.asarray(state.out)[:, :NEW]
    assert [row[row >= 0].tolist() for row in out] == ar_rows == result.rows()
    assert summarize(state, engine)["rounds"] == int(state.round)


# ---------------------------------------------------------------------------- per-plan gamma
def test_scripted_gammas_buckets_and_plain_decoding_equal_ar(params, ar_rows):
    """Plans with gamma 3, 0, 5, 1, 0, 2: drafting capped at the plan's gamma, verification in the
    bucket's rows (3 -> 3, 5 -> 5, 1 -> 1, 2 -> 2), gamma 0 runs the plain decoding loop for the
    interval; the greedy output is AR's throughout."""
    result = knapspec_generate(params, TARGET, PROMPTS, knapspec=KNAP, max_new_tokens=NEW,
                               planner=ScriptedPlanner([3, 0, 5, 1, 0, 2]))
    assert result.rows() == ar_rows
    m = result.metrics
    plans = m["knapspec_plans"]
    assert [p["round"] for p in plans][:6] == [2, 6, 10, 14, 18, 22]
    assert [p["gamma_used"] for p in plans][:6] == [3, 0, 5, 1, 0, 2]
    assert [p["verify_rows"] for p in plans][:6] == [4, 1, 6, 2, 1, 3]
    assert [p["mode"] for p in plans][:2] == ["speculative", "ar"]
    assert m["ar_tokens"] > 0 and m["ar_steps"] >= 4 and m["ar_intervals"] >= 1
    assert set(m["gamma_buckets_used"]) >= {3, 5}
    assert max(np.nonzero(m["drafted_histogram"])[0]) <= 5
    assert m["drafted_tokens"] == int(np.dot(m["drafted_histogram"], np.arange(6)))
    generated = int((result.num_generated - 1).sum())
    assert m["tau"] == pytest.approx((generated - m["ar_tokens"]) / m["row_rounds"])
    assert m["schedule_rounds"] >= m["rounds"] + 4


def test_gamma_zero_plan_runs_plain_decoding(params, ar_rows):
    """A plan with gamma* = 0 for the whole run (static, no re-planning): no draft forward, no
    speculative round, every token from the autoregressive loop; also with stop tokens."""
    mask = np.zeros((TARGET.num_layers, 2), bool)
    mask[2, 0] = True
    result = knapspec_generate(params, TARGET, PROMPTS, knapspec=KNAP, max_new_tokens=NEW, initial_plan=(mask, 0),
                               replan=False)
    assert result.rows() == ar_rows
    m = result.metrics
    assert m["rounds"] == 0 and m["draft_steps"] == 0 and m["row_rounds"] == 0
    # one call for the whole run (the step count is traced, the buffer sized for the run)
    assert m["ar_tokens"] == int((result.num_generated - 1).sum()) and m["ar_intervals"] == 1
    # stop tokens: rows end at different times; interleave gamma 0 and drafting
    stop = ar_rows[0][7]
    expected = generate(params, TARGET, PROMPTS, NEW, stop_tokens=[stop]).rows()
    assert len({len(r) for r in expected}) > 1
    result = knapspec_generate(params, TARGET, PROMPTS, knapspec=KNAP, max_new_tokens=NEW, stop_tokens=(stop,),
                               planner=ScriptedPlanner([0, 2]))
    assert result.rows() == expected


def test_planned_gamma_zero_switches_to_ar_with_the_real_planner(params, ar_rows):
    """The KnapSpec planner on a random model (alpha ~ 0.5, expensive draft): gamma* = 0, so after
    the first plan every interval is plain decoding, re-planned on the last AR tokens."""
    result = knapspec_generate(params, TARGET, PROMPTS, latency=LATENCY, knapspec=KNAP, max_new_tokens=NEW)
    assert result.rows() == ar_rows
    plans = result.metrics["knapspec_plans"]
    assert plans and all(p["gamma_star"] == 0 and p["mode"] == "ar" for p in plans)
    assert all(p["reference_tokens"] > 0 for p in plans)
    assert result.metrics["rounds"] == KNAP.plan_round  # speculative rounds only before the first plan
    official = knapspec_generate(params, TARGET, PROMPTS, latency=LATENCY, max_new_tokens=NEW,
                                 knapspec=KnapSpecConfig(gamma_max=5, plan_interval=4, plan_round=2,
                                                         reference_rounds=2, honor_gamma=False, probe_rounds=None,
                                                         max_plan_fraction=None))
    assert official.rows() == ar_rows
    assert official.metrics["ar_tokens"] == 0
    assert all(p["gamma_used"] == 5 for p in official.metrics["knapspec_plans"])


@pytest.mark.parametrize("slow,fast_model", [("speculative", False), ("ar", False), ("ar", True)])
def test_measured_arbitration_keeps_the_faster_mode(params, ar_rows, monkeypatch, slow, fast_model):
    """probe_rounds: after a plan that drafts, one speculative probe and one plain-decoding probe
    are timed on the live sequence and the faster runs until the next plan. Slowing one side down
    on the host (a sleep after each call) makes the choice certain; the output is AR's either way
    and the record carries both measured rates. With a latency model predicting fast plain
    decoding, its rate stands in for a slow AR probe (the better of the two), so AR wins."""
    import dataclasses

    slow_engine_side(monkeypatch, slow)
    knap = dataclasses.replace(KNAP, probe_rounds=5)  # clamped to (4 - 2) // 2 = 1 round per probe
    assert knap.probe == 1 and dataclasses.replace(KNAP, probe_rounds=None).probe == 0
    fast = latency.LatencyModel(c1=1e-7, c2=0.0, c3=1e-7, c0=1e-7) if fast_model else None  # ~1e6 tok/s
    result = knapspec_generate(params, TARGET, PROMPTS, knapspec=knap, max_new_tokens=NEW, latency=fast,
                               planner=ScriptedPlanner([3]))
    assert result.rows() == ar_rows
    plans = result.metrics["knapspec_plans"]
    probed = [p for p in plans if p["probe"] is not None]
    assert probed and [p["round"] for p in plans][:2] == [2, 6]
    winner = "ar" if slow == "speculative" or fast_model else "speculative"
    for p in probed:
        probe = p["probe"]
        assert probe["rounds"] == 1 and probe["choice"] == winner
        assert probe["speculative_tokens"] > 0 and probe["ar_tokens"] > 0
        faster = probe["ar_tokens_per_s"] > probe["speculative_tokens_per_s"]
        assert faster == (winner == "ar")
        assert probe["ar_tokens_per_s"] == max(probe["ar_tokens_per_s_measured"], probe["ar_tokens_per_s_model"] or 0)
        assert (probe["ar_tokens_per_s_model"] is not None) == fast_model
        assert p["gamma_used"] == (0 if winner == "ar" else 3)
        assert p["mode"] == ("ar" if winner == "ar" else "speculative")
    assert result.metrics["ar_tokens"] > 0  # the plain-decoding probes committed tokens
    with pytest.raises(ValueError, match="probe_rounds"):
        KnapSpecConfig(probe_rounds=0)


def test_reference_allowance_caps_or_skips_planning(params, ar_rows):
    """The planning allowance: J slots x v t_step seconds per reference token against
    max_plan_fraction of the predicted plain-decoding time; below min_reference_tokens no plan is
    made (plain decoding from the start), otherwise the DP's window is capped."""
    from jaxspec.baselines.clasp import ClaspPlanner
    from jaxspec.knapspec.dp import knapsack_weights, skip_budget
    from jaxspec.knapspec.policy import KnapSpecPlanner, reference_allowance

    lat = latency.LatencyModel(c1=1.0, c2=0.01, c3=0.5, c0=0.2, v=0.05, a=1.1)
    knap = dataclasses_replace(KNAP, max_plan_fraction=0.05, probe_rounds=None)
    planner = KnapSpecPlanner(lat, knap)
    n = 100.0
    slots = skip_budget(*knapsack_weights(lat.t_attn(n), lat.t_mlp()), TARGET.num_layers) + 1
    per_token = slots * 0.05 * lat.t_step(n, TARGET.num_layers)
    assert planner.reference_cost(TARGET, n) == pytest.approx(per_token)
    for new_tokens in (10, 1000, 100000):
        out = reference_allowance(planner, lat, TARGET, n, new_tokens, knap)
        allowed = int(0.05 * 0.75 * new_tokens * 1.1 * lat.t_step(n, TARGET.num_layers) // per_token)
        assert out["allowed_tokens"] == allowed
        assert out["skip"] == (allowed < knap.min_reference_tokens)
        assert out["tokens"] == (None if out["skip"] else allowed)
    # a profile that measured the many-row slope u prices the J slot rows with it instead of v t_step
    with_u = dataclasses_replace(lat, u=0.003)
    assert KnapSpecPlanner(with_u, knap).reference_cost(TARGET, n) == pytest.approx(slots * 0.003)
    # with a per-context price the row costs u + u_n n at this context
    per_ctx = dataclasses_replace(lat, u=0.001, u_n=2e-7)
    assert KnapSpecPlanner(per_ctx, knap).reference_cost(TARGET, n) == pytest.approx(slots * (0.001 + 2e-7 * n))
    out = reference_allowance(KnapSpecPlanner(with_u, knap), with_u, TARGET, n, 1000, knap)
    assert out["allowed_tokens"] == int(0.05 * 0.75 * 1000 * 1.1 * lat.t_step(n, TARGET.num_layers) // (slots * 0.003))
    # a two-stage plan (search_tokens): the DP's J rows per search token are fixed, each window token costs the
    # finalists' rows and the target's own (its boundary states); many more reference tokens fit the same budget
    two = dataclasses_replace(knap, search_tokens=4, finalists=2)
    fixed, per = KnapSpecPlanner(with_u, two).reference_costs(TARGET, n)
    assert (fixed, per) == (pytest.approx(slots * 0.003 * 4), pytest.approx((2 + 1) * 0.003))
    budget = 0.05 * 0.75 * 1000 * 1.1 * lat.t_step(n, TARGET.num_layers)
    out2 = reference_allowance(KnapSpecPlanner(with_u, two), with_u, TARGET, n, 1000, two)
    assert out2["allowed_tokens"] == int((budget - fixed) // per) > out["allowed_tokens"]
    assert out2["predicted_dp_search_s"] == pytest.approx(fixed)
    # a profile with the many-row forwards' fixed part: the DP, the rescoring and the window's states pay it once each
    passes = dataclasses_replace(with_u, w=0.02, w_n=1e-6)
    fixed_w, per_w = KnapSpecPlanner(passes, two).reference_costs(TARGET, n)
    assert (fixed_w, per_w) == (pytest.approx(fixed + 3 * passes.t_pass(n)), pytest.approx(per))
    assert KnapSpecPlanner(passes, two).reference_costs(TARGET, n, states_known=True)[0] == pytest.approx(
        fixed + 2 * passes.t_pass(n))
    assert KnapSpecPlanner(passes, knap).reference_costs(TARGET, n) == (pytest.approx(2 * passes.t_pass(n)),
                                                                        pytest.approx(slots * 0.003))
    # a reference floor above the cap: raised to the floor while the floor's window fits the unmargined budget
    full = budget / two.allowance_margin
    for floor, raised in ((out2["allowed_tokens"] + 1, True), (int((full - fixed) // per), True),
                          (int((full - fixed) // per) + 1, False)):
        floored = reference_allowance(KnapSpecPlanner(with_u, two), with_u, TARGET, n, 1000,
                                      dataclasses_replace(two, reference_floor=floor))
        assert floored["allowed_tokens"] == (floor if raised else out2["allowed_tokens"])
        assert floored.get("floor_in_margin", False) is raised
    low = reference_allowance(KnapSpecPlanner(with_u, two), with_u, TARGET, n, 1000,
                              dataclasses_replace(two, reference_floor=out2["allowed_tokens"] - 1))
    assert low["allowed_tokens"] == out2["allowed_tokens"] and "floor_in_margin" not in low  # a floor the cap exceeds
    capped = reference_allowance(planner, lat, TARGET, n, 100000, dataclasses_replace(knap, max_reference_tokens=9))
    assert capped["tokens"] == 9
    # no cap: no budget, no row cost, a planner without a cost model
    for args in ((planner, lat, dataclasses_replace(knap, max_plan_fraction=None)),
                 (KnapSpecPlanner(LATENCY, knap), LATENCY, knap),
                 (ClaspPlanner(1, gamma=5, latency=lat), lat, knap)):
        out = reference_allowance(args[0], args[1], TARGET, n, 10, args[2])
        assert out["tokens"] is None and not out["skip"]

    # a 30-token run cannot pay for a DP: plain decoding from the start, output = AR
    result = knapspec_generate(params, TARGET, PROMPTS, latency=lat, knapspec=knap, max_new_tokens=NEW)
    assert result.rows() == ar_rows
    m = result.metrics
    assert m["plan_allowance"]["skip"] and m["knapspec_plans"] == []
    assert m["rounds"] == 0 and m["draft_steps"] == 0 and m["ar_tokens"] == int((result.num_generated - 1).sum())
    # a cheap row cost: the window is capped at the allowance. t_attn 0.5 < t_mlp 1 at any context:
    # weights (1, 2), budget 3 * 5 // 2 = 7, J = 8 slots; allowed = 0.05 * 0.75 * 30 * 1.1 / (8 v) = 2.5 -> 2
    cheap = latency.LatencyModel(c1=1.0, c2=0.0, c3=0.5, c0=0.2, v=0.75 * 1.65 / (2.5 * 8), a=1.1)
    knap2 = dataclasses_replace(knap, min_reference_tokens=1)
    result = knapspec_generate(params, TARGET, PROMPTS, latency=cheap, knapspec=knap2, max_new_tokens=NEW)
    assert result.rows() == ar_rows
    m = result.metrics
    cap = m["plan_allowance"]["tokens"]
    assert cap == 2 and not m["plan_allowance"]["skip"]
    assert m["knapspec_plans"] and all(p["reference_tokens"] <= cap * len(PROMPTS) for p in m["knapspec_plans"])
    assert all(p["predicted_seconds"] == pytest.approx(2 * 8 * cheap.v * cheap.t_step(p["n"], TARGET.num_layers))
               for p in m["knapspec_plans"])  # the window is exactly the cap wide


def test_clasp_has_no_arbitration(params):
    from jaxspec.baselines.clasp import clasp_generate

    knap = dataclasses_replace(KNAP, probe_rounds=1)
    result = clasp_generate(params, TARGET, PROMPTS, knapspec=knap, max_new_tokens=NEW, latency=LATENCY)
    assert all(p["probe"] is None for p in result.metrics["knapspec_plans"])
    assert result.metrics["ar_tokens"] == 0


def test_sampled_knapspec_with_plain_intervals_runs(params):
    result = knapspec_generate(params, TARGET, PROMPTS, knapspec=KNAP, max_new_tokens=NEW,
                               sampling=SamplingConfig(temperature=1.0), planner=ScriptedPlanner([2, 0]))
    assert (result.num_generated == NEW).all()
    assert ((result.tokens >= 0) & (result.tokens < TARGET.vocab_size)).all()


# ---------------------------------------------------------------------------- baselines
def test_clasp_static_and_ablations_equal_ar(params, ar_rows):
    import dataclasses

    from jaxspec.baselines.clasp import clasp_generate, clasp_skip_count
    from jaxspec.baselines.static_skip import StaticSkipPlan, calibrate_static_skip, static_skip_generate

    assert clasp_skip_count(TARGET) == 3  # 4 for a <= 1B model, capped at L - 2
    result = clasp_generate(params, TARGET, PROMPTS, knapspec=KNAP, latency=LATENCY, max_new_tokens=NEW,
                            skip_count=2)
    assert result.rows() == ar_rows
    for p in result.metrics["knapspec_plans"]:
        assert p["skip_attn"] == p["skip_mlp"] and len(p["skip_attn"]) == 2 and p["gamma_used"] == 5
        assert 0 not in p["skip_attn"] and 4 not in p["skip_attn"]
    calibration = np.random.RandomState(3).randint(0, 97, 80).tolist()
    plan = calibrate_static_skip(params, TARGET, calibration, latency=LATENCY, knapspec=KNAP, reference_tokens=32)
    assert plan.mask.any() and plan.source["reference_tokens"] == 32
    assert StaticSkipPlan.from_json(plan.to_json()).mask.tolist() == plan.mask.tolist()
    forced = StaticSkipPlan(mask=plan.mask, gamma=3, config=plan.config, source=plan.source)
    for static in (plan, forced):
        result = static_skip_generate(params, TARGET, PROMPTS, plan=static, knapspec=KNAP, max_new_tokens=NEW)
        assert result.rows() == ar_rows and result.metrics["knapspec_plans"] == []
        assert result.metrics["final_skip_mask"] == plan.mask.tolist()
    assert result.metrics["rounds"] > 0 and result.metrics["gamma_buckets_used"] == [3]
    for change in (dict(coupled=True), dict(objective="tpl")):
        result = knapspec_generate(params, TARGET, PROMPTS, latency=LATENCY, max_new_tokens=NEW,
                                   knapspec=dataclasses.replace(KNAP, **change))
        assert result.rows() == ar_rows
        for p in result.metrics["knapspec_plans"]:
            assert p["objective"] == change.get("objective", "tpt")
            if "coupled" in change:
                assert p["skip_attn"] == p["skip_mlp"]


@pytest.fixture(scope="module")
def coupled_problem(params):
    return dp_model_problem(params, TARGET)


@pytest.mark.parametrize("tau", [dp.DEFAULT_TAU, float("-inf")])
def test_coupled_dp_equals_python_loop_and_is_realised_by_the_forward(params, coupled_problem, tau):
    """The scan (vectorised over slots, branch-parallel attention) equals a Python loop over layers
    and slots; each candidate skips whole layers (never 0 or L-1), and running the model with its
    mask reproduces the DP's cosine and alpha; it never beats exhaustive whole-layer search."""
    import itertools

    from jaxspec.baselines.clasp import coupled_knapsack_dp, coupled_knapsack_reference

    cache, prefix, tokens, token_mask, states = coupled_problem
    cands = coupled_knapsack_dp(params, TARGET, cache, prefix, states, token_mask, budget=3, tau=tau)
    ref = coupled_knapsack_reference(params, TARGET, cache, prefix, states, token_mask, budget=3, tau=tau)
    assert sorted(ref) == cands.weights.tolist() and cands.weights[0] == 0
    if tau == float("-inf"):
        assert cands.weights.tolist() == [0, 1, 2, 3]
    mask_sum = float(np.asarray(token_mask).sum())
    teacher = np.argmax(np.asarray(forward_jit(params, tokens, cache.with_lengths(prefix), config=TARGET).logits), -1)
    for c, j in enumerate(cands.weights):
        value, mask = ref[int(j)]
        np.testing.assert_array_equal(cands.masks[c], mask)
        assert cands.cosine[c] == pytest.approx(value, abs=1e-5)
        skip = cands.masks[c]
        assert (skip[:, 0] == skip[:, 1]).all() and skip[:, 0].sum() == j and not skip[0].any() and not skip[-1].any()
        out = forward_jit(params, tokens, cache.with_lengths(prefix), config=TARGET, skip_mask=jnp.asarray(skip),
                      return_hidden=True)
        cos = float(dp.cos_sum(out.hidden, states[-1], token_mask)) / mask_sum
        assert cos == pytest.approx(cands.cosine[c], abs=1e-5)
        agree = ((np.argmax(np.asarray(out.logits), -1) == teacher) * np.asarray(token_mask)).sum() / mask_sum
        assert agree == pytest.approx(cands.alpha[c], abs=1e-6)
        # exhaustive over whole-layer sets of this size (no pruning): the DP is a heuristic, never better
        best = -np.inf
        for layers in itertools.combinations(range(1, TARGET.num_layers - 1), int(j)):
            trial = np.zeros((TARGET.num_layers, 2), bool)
            trial[list(layers), :] = True
            h = forward_jit(params, tokens, cache.with_lengths(prefix), config=TARGET, skip_mask=jnp.asarray(trial),
                        return_hidden=True).hidden
            best = max(best, float(dp.cos_sum(h, states[-1], token_mask)) / mask_sum)
        assert cands.cosine[c] <= best + 1e-5


# ---------------------------------------------------------------------------- CLI
def _tiny_hf_folder_with_tokenizer(tmp_path):
    """The conftest tiny Llama (vocab 128) saved with a character-level tokenizer (98 tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import build_tiny_hf_model

    folder = tmp_path / "tiny-llama"
    build_tiny_hf_model("llama").save_pretrained(str(folder))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): i + 3 for i, c in enumerate(range(32, 127))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(folder))
    return folder


@pytest.mark.slow
def test_cli_generate_knapspec_clasp_static(tmp_path, capsys):
    """``generate --method knapspec`` on a tiny random HF model: profiles the latency on the fly
    (then reuses the file), equals AR (--compare-ar), reports the plan history and the planning
    fraction; clasp and static-skip run through the same path."""
    import torch

    from experiments.run import main

    torch.set_num_threads(1)
    folder = _tiny_hf_folder_with_tokenizer(tmp_path)
    profile = tmp_path / "latency.json"
    calibration = tmp_path / "calib.txt"
    calibration.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    base = ["generate", "--model", str(folder), "--prompt", "Once upon a time, in a land far away,",
            "--max-new-tokens", "48", "--dtype", "float32", "--no-warmup", "--compare-ar",
            "--latency-profile", str(profile), "--knapspec-interval", "8", "--knapspec-gamma-max", "4",
            "--knapspec-max-plan-fraction", "0"]  # the paper's fixed schedule: plan rounds checked below
    out_file = tmp_path / "knapspec.json"
    assert main(base + ["--method", "knapspec", "--out", str(out_file)]) == 0
    err = capsys.readouterr().err
    assert "profiling whole-forward latency" in err and profile.exists()  # the default --latency-fit forward
    results = json.loads(out_file.read_text())["results"]
    assert results["method"] == "knapspec" and results["identical_to_ar"] is True
    k = results["knapspec"]
    assert k["latency_profile"]["measured_now"] is True and k["latency_profile"]["path"] == str(profile)
    history = k["plan_history"]
    # the plans follow a latency profile measured on the fly: the messages carry what a failure needs
    assert history and [h["round"] for h in history][:2] == [6, 14], history
    for h in history:
        assert {"context_length", "n_skip_attn", "n_skip_mlp", "gamma_star", "gamma_used", "predicted_tpt"} <= set(h)
        assert h["n_skip_attn"] + h["n_skip_mlp"] > 0 and h["predicted_tpt"] > 0, (h, k["latency_profile"])
    assert 0 <= k["plan_fraction_of_decode"] < 1 and k["plan_s"] > 0, k
    for field in ("metrics", "gamma", "tokens", "text", "num_generated", "tokens_per_s", "timings", "speedup_vs_ar"):
        assert field in results
    assert results["metrics"]["knapspec_plans"] and results["gamma"] == 4
    for method, extra in (("clasp", ["--clasp-skip-count", "1"]),
                          ("static-skip", ["--calibration-file", str(calibration), "--calibration-tokens", "200",
                                           "--static-skip-file", str(tmp_path / "static.json")]),
                          ("knapspec", ["--knapspec-coupled", "--knapspec-objective", "tpl"]),
                          ("knapspec-budget", ["--knapspec-attention-budget", "6", "--knapspec-attention-sinks", "2",
                                               "--knapspec-budget-reference-tokens", "4"])):
        out_file = tmp_path / f"{method}-2.json"  # knapspec.json holds the first run (other options)
        assert main(base + ["--method", method, "--out", str(out_file)] + extra) == 0
        err = capsys.readouterr().err
        assert "latency of" not in err  # the saved profile is reused (no "profiling ... latency of" line)
        results = json.loads(out_file.read_text())["results"]
        assert results["identical_to_ar"] is True and results["knapspec"]["latency_profile"]["measured_now"] is False
        if method == "clasp":
            assert all(h["n_skip_attn"] == h["n_skip_mlp"] == 1 for h in results["knapspec"]["plan_history"])
        if method == "static-skip":
            assert (tmp_path / "static.json").exists() and results["knapspec"]["static_skip"]["loaded"] is False
        if method == "knapspec-budget":
            plan = results["knapspec"]["budget_plan"]
            assert plan["sinks"] == 2 and plan["window"] == 4 and plan["reference_tokens"] == 4
            assert results["knapspec"]["plan_history"] == [] and plan["candidates"] >= 1
    # the default planning budget with a latency profile whose verification-row cost makes one DP
    # unaffordable for 48 tokens: no plan, plain decoding, and the CLI says why
    import dataclasses

    from jaxspec.knapspec.latency import LatencyProfile

    measured = LatencyProfile.load(profile)
    costly = tmp_path / "costly.json"
    # u = u_n = 0: no many-row price, so the DP's row is priced at v t_step, and p = 1: plain decoding priced at
    # t_step (a measured many-row price or decode-loop ratio would make the outcome depend on this machine's load)
    dataclasses.replace(measured, model=dataclasses.replace(measured.model, v=10.0, u=0.0, u_n=0.0, p=1.0)).save(costly)
    assert base[-2:] == ["--knapspec-max-plan-fraction", "0"]
    budgeted = [str(costly) if x == str(profile) else x for x in base[:-2]]
    out_file = tmp_path / "budgeted.json"
    assert main(budgeted + ["--method", "knapspec", "--out", str(out_file)]) == 0
    assert "knapspec: no plan" in capsys.readouterr().err
    results = json.loads(out_file.read_text())["results"]
    k = results["knapspec"]
    assert results["identical_to_ar"] is True and k["plan_history"] == [] and k["plan_allowance"]["skip"] is True
    assert k["ar_tokens"] == 47 and k["draft_steps"] == 0
    assert main(base + ["--method", "knapspec", "--knapspec-interval", "3"]) == 2  # validated before loading
    assert main(base + ["--method", "knapspec-budget", "--knapspec-attention-budget", "4",
                        "--knapspec-attention-sinks", "4"]) == 2
    # --knapspec-choice-table: a table of this model's KnapSpec runs below 1.02x AR at every small context bucket
    from jaxspec.decoding.arbitration import ChoiceTable

    table = tmp_path / "table.json"
    ChoiceTable([{"method": "knapspec", "context_bucket": 2 ** i, "batch": 1, "speedup": 0.9} for i in range(8)],
                meta={"target": str(folder), "draft": "self"}).save(table)
    out_file = tmp_path / "table-run.json"
    assert main(base + ["--method", "knapspec", "--knapspec-choice-table", str(table), "--out", str(out_file)]) == 0
    results = json.loads(out_file.read_text())["results"]
    k = results["knapspec"]
    assert results["identical_to_ar"] is True and k["plan_history"] == [] and k["draft_steps"] == 0
    assert k["choice_table"]["choice"] == "ar" and k["choice_table"]["table_speedup"] == pytest.approx(0.9)
    assert "ran 0.90x AR: no plan, decoded plainly" in capsys.readouterr().err
    assert main(base + ["--method", "clasp", "--knapspec-choice-table", str(table)]) == 2  # CLaSp does not re-plan
    assert "does not re-plan" in capsys.readouterr().err


def test_knapspec_warmup_and_profile_come_from_the_engine(params, ar_rows):
    """KnapSpec runs through the engine: warm-up (compile_s) and profile=True (the per-phase split,
    following the controller's chunks) work as for every method; the output stays AR's."""
    knap = dataclasses_replace(KNAP, probe_rounds=1)
    result = knapspec_generate(params, TARGET, PROMPTS, knapspec=knap, max_new_tokens=NEW, latency=LATENCY,
                               planner=ScriptedPlanner([3, 0]), warmup=True, profile=True)
    assert result.rows() == ar_rows
    assert result.timings["compile_s"] >= 0 and result.timings["profile_rounds"] > 0
    assert result.timings["profile_draft_s"] > 0 and result.timings["profile_verify_s"] > 0
    assert [p["round"] for p in result.metrics["knapspec_plans"]][:2] == [2, 6]


def test_fixed_plan_compiles_a_static_draft_equal_to_the_dynamic_mask(params, ar_rows):
    """A fixed plan (replan=False) drafts with the plan's executed sub-layers only (static mask, no
    lax.cond): same tokens, acceptance and draft steps as the dynamic mask, and greedy == AR."""
    mask = np.zeros((TARGET.num_layers, 2), bool)
    mask[1, 0] = mask[2, 1] = mask[3, 0] = True
    runs = {}
    for static in (True, False):
        result = knapspec_generate(params, TARGET, PROMPTS, knapspec=KNAP, max_new_tokens=NEW, replan=False,
                                   initial_plan=(mask, 3), static_plan=static)
        runs[static] = result
        assert result.rows() == ar_rows
    assert runs[True].metrics["acceptance_rate"] == runs[False].metrics["acceptance_rate"]
    assert runs[True].metrics["draft_steps"] == runs[False].metrics["draft_steps"]
    policy = KnapSpecDraft(TARGET, static_mask=tuple((bool(a), bool(m)) for a, m in mask))
    jaxpr = str(jax.make_jaxpr(lambda s: policy.propose(
        params, s, init_cache(TARGET, 1, 16).with_lengths(jnp.ones((1,), jnp.int32)), jnp.zeros((1,), jnp.int32),
        jnp.zeros((1,), jnp.int32), jnp.full((1,), 2, jnp.int32), gamma=2, sampling=SamplingConfig(),
        key=jax.random.PRNGKey(0)))(policy.initial_state()))
    assert " cond[" not in jaxpr  # no per-sub-layer conditional left in the static draft
    with pytest.raises(ValueError, match="static_mask"):
        KnapSpecDraft(TARGET, static_mask=((True, False),))


def test_replanning_with_static_plans_equals_the_dynamic_mask(params, ar_rows):
    """``static_plans``: every plan's rounds run a draft compiled for that plan (its own loop, found again
    when a plan recurs): the same tokens, acceptance and draft steps as the dynamic mask, greedy == AR,
    and one compiled draft per distinct plan (the full model before the first plan included)."""

    class TwoMasks(ScriptedPlanner):  # plans alternate between two skip sets: the second use of each recurs
        def plan(self, *args):
            plan, candidates, weights = super().plan(*args)
            mask = np.zeros_like(plan.mask)
            mask[1 + self.calls % 2, self.calls % 2] = True
            return dataclasses_replace(plan, mask=mask), candidates, weights

    runs = {}
    for static in (False, True):
        knap = dataclasses_replace(KNAP, static_plans=static)
        runs[static] = knapspec_generate(params, TARGET, PROMPTS, knapspec=knap, max_new_tokens=NEW,
                                         planner=TwoMasks([3, 2]))
        assert runs[static].rows() == ar_rows
    dynamic, static = runs[False].metrics, runs[True].metrics
    for key in ("acceptance_rate", "draft_steps", "rounds"):
        assert static[key] == dynamic[key], key
    untimed = [[{k: v for k, v in p.items() if k != "seconds"} for p in m["knapspec_plans"]] for m in (static, dynamic)]
    assert untimed[0] == untimed[1] and len(untimed[0]) >= 3  # a skip set came back
    assert not dynamic["static_plans"] and dynamic["compiled_plans"] == 0
    assert static["static_plans"] and static["compiled_plans"] == 3  # the full model and the two skip sets


def test_a_chunk_runs_its_own_draft_policy(params, ar_rows):
    """``Chunk.draft_policy`` replaces the run's draft for that chunk; a bad one is refused up front."""
    from jaxspec.decoding.contract import Chunk, ScriptedController

    mask = np.zeros((TARGET.num_layers, 2), bool)
    mask[2, 1] = True
    frozen = tuple((bool(a), bool(m)) for a, m in mask)

    class TwoPolicies(ScriptedController):
        def chunks(self, run):
            yield Chunk(rounds=2)
            yield Chunk(draft_policy=KnapSpecDraft(TARGET, static_mask=frozen))

    base = KnapSpecDraft(TARGET)
    result = speculative_generate(params, TARGET, PROMPTS, draft_policy=base, draft_state=base.initial_state(),
                                  engine=EngineConfig(gamma=3, max_new_tokens=NEW), controller=TwoPolicies())
    assert result.rows() == ar_rows
    with pytest.raises(TypeError, match="Chunk draft_policy str is not a DraftPolicy"):
        Chunk(draft_policy="knapspec")
    with pytest.raises(ValueError, match="plain_steps run no draft"):
        Chunk(plain_steps=2, draft_policy=base)


def test_two_stage_plans_decode_as_ar_and_report_both_estimates(params, ar_rows):
    """A run re-planning with the two-stage plan (search_tokens, docs/methods.md §5.6): greedy output is AR's,
    and each plan records the search's acceptance estimate beside the whole window's."""
    knap = dataclasses_replace(KNAP, max_plan_fraction=None, probe_rounds=None, search_tokens=4, finalists=2)
    result = knapspec_generate(params, TARGET, PROMPTS, latency=LATENCY, knapspec=knap, max_new_tokens=NEW)
    assert result.rows() == ar_rows
    plans = [p for p in result.metrics["knapspec_plans"] if "search_alpha" in p]
    assert plans and all(p["search_tokens"] == 4 and p["candidates"] <= 2 and 0 <= p["search_alpha"] <= 1
                         for p in plans)
    for p in plans:  # the planning time split into its parts; they add up to the plan's seconds
        stages = p["stage_seconds"]
        assert set(stages) == {"device_in_flight", "window", "boundary_states", "dp", "grid_search", "rescore",
                               "apply", "other"}
        assert min(v for k, v in stages.items() if k != "other") > 0 and stages["other"] >= 0
        assert sum(stages.values()) == pytest.approx(p["seconds"])
        assert p["dp_attention"] == "xla"  # the default
        assert p["rescore"] == "executed"  # the default


def test_plans_with_the_dp_attention_folded_into_the_history_kernel_decode_as_ar(params, ar_rows):
    """dp_attention="pallas-interpret": the DP's branches run through the (interpreted) Pallas history kernel;
    the run still decodes AR's tokens and each plan names the attention its DP used."""
    knap = dataclasses_replace(KNAP, max_plan_fraction=None, probe_rounds=None, search_tokens=4, finalists=2,
                               dp_attention="pallas-interpret")
    result = knapspec_generate(params, TARGET, PROMPTS, latency=LATENCY, knapspec=knap, max_new_tokens=NEW)
    assert result.rows() == ar_rows
    plans = [p for p in result.metrics["knapspec_plans"] if "stage_seconds" in p]
    assert plans and all(p["dp_attention"] == "pallas-interpret" for p in plans)


class WindowPlanner(ScriptedPlanner):
    """A scripted planner that keeps each reference window it is given."""

    def __init__(self, gammas):
        super().__init__(gammas)
        self.windows = []

    def plan(self, params, config, cache, tokens, token_mask, prefix_len, n):
        self.windows.append((np.asarray(tokens), np.asarray(token_mask), np.asarray(prefix_len),
                             np.asarray(cache.lengths)))
        return super().plan(params, config, cache, tokens, token_mask, prefix_len, n)


@pytest.mark.parametrize("floor", [None, 24])
def test_reference_floor_reaches_back_into_earlier_tokens(params, ar_rows, floor):
    """reference_floor = R: each row's window holds at least min(R, cache length) tokens, ending at the cache's
    end and equal to the row's sequence there (prompt tokens included); without it the window is the tokens of
    the last reference_rounds rounds, fewer than R for a row that commits one token a round."""
    planner = WindowPlanner([2, 0, 3])
    knap = dataclasses_replace(KNAP, reference_floor=floor)
    result = knapspec_generate(params, TARGET, PROMPTS, latency=LATENCY, knapspec=knap, max_new_tokens=NEW,
                               planner=planner)
    assert result.rows() == ar_rows
    assert len(planner.windows) >= 3
    short = 0
    for tokens, mask, prefix, lengths in planner.windows:
        counts = mask.sum(axis=1).astype(int)
        np.testing.assert_array_equal(prefix + counts, lengths)  # every window ends at the cache's end
        for b, count in enumerate(counts):
            sequence = list(PROMPTS[b]) + list(ar_rows[b])
            assert tokens[b, :count].tolist() == sequence[prefix[b]: prefix[b] + count]
        if floor is not None:
            assert (counts >= np.minimum(floor, lengths)).all()
        short += int((counts < np.minimum(24, lengths)).sum())
    assert (short == 0) == (floor is not None)  # without the floor some windows are short; with it, none
    with pytest.raises(ValueError, match="reference_floor=0"):
        KnapSpecConfig(reference_floor=0)


def test_plan_cost_scale_prices_the_plan_as_measured(params, ar_rows):
    """plan_cost_scale = X: the allowance prices a plan at X times the latency model's cost (fewer reference
    tokens fit; none when too few would), and each plan record's prediction carries the same X."""
    from jaxspec.knapspec.policy import KnapSpecPlanner, reference_allowance

    lat = latency.LatencyModel(c1=1.0, c2=0.01, c3=0.5, c0=0.2, v=0.05, a=1.1, u=0.003)
    knap = dataclasses_replace(KNAP, max_plan_fraction=0.05, probe_rounds=None)
    base = reference_allowance(KnapSpecPlanner(lat, knap), lat, TARGET, 100.0, 100000, knap)
    scaled_knap = dataclasses_replace(knap, plan_cost_scale=4.0)
    scaled = reference_allowance(KnapSpecPlanner(lat, scaled_knap), lat, TARGET, 100.0, 100000, scaled_knap)
    assert scaled["predicted_dp_s_per_token"] == pytest.approx(4 * base["predicted_dp_s_per_token"])
    assert scaled["allowed_tokens"] == int(base["plan_budget_s"] // (4 * base["predicted_dp_s_per_token"]))
    assert scaled["plan_cost_scale"] == 4.0 and "plan_cost_scale" not in base
    # a scale that leaves fewer than min_reference_tokens: no plan, plain decoding from the start, output = AR
    cheap = latency.LatencyModel(c1=1.0, c2=0.0, c3=0.5, c0=0.2, v=0.75 * 1.65 / (2.5 * 8), a=1.1)
    runs = {}
    for scale in (1.0, 1e4):
        k = dataclasses_replace(knap, min_reference_tokens=1, plan_cost_scale=scale)
        runs[scale] = knapspec_generate(params, TARGET, PROMPTS, latency=cheap, knapspec=k, max_new_tokens=NEW)
        assert runs[scale].rows() == ar_rows
    assert runs[1.0].metrics["knapspec_plans"] and not runs[1.0].metrics["plan_allowance"]["skip"]
    assert runs[1e4].metrics["plan_allowance"]["skip"] and runs[1e4].metrics["knapspec_plans"] == []
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="plan_cost_scale"):
            KnapSpecConfig(plan_cost_scale=bad)


def test_plan_at_start_plans_on_the_prompt_before_any_round(params, ar_rows):
    """plan_at_start with reference_floor = R: the first plan runs at round 0 on each row's last min(R, prompt)
    prompt tokens, so no round drafts with the full model before it; the next plan is the schedule's second grid
    point, not round 6; greedy output is AR's."""
    planner = WindowPlanner([2, 0, 3])
    knap = dataclasses_replace(KNAP, reference_floor=24, plan_at_start=True, plan_interval=8)
    result = knapspec_generate(params, TARGET, PROMPTS, latency=LATENCY, knapspec=knap, max_new_tokens=NEW,
                               planner=planner)
    assert result.rows() == ar_rows
    rounds = [p["round"] for p in result.metrics["knapspec_plans"]]
    assert rounds[0] == 0 and rounds[1] == knap.plan_round + knap.plan_interval
    tokens, mask, prefix, lengths = planner.windows[0]
    counts = mask.sum(axis=1).astype(int)
    np.testing.assert_array_equal(lengths, [len(p) for p in PROMPTS])  # nothing committed beyond the prompt yet
    np.testing.assert_array_equal(counts, np.minimum(24, lengths))
    for b, count in enumerate(counts):
        assert tokens[b, :count].tolist() == list(PROMPTS[b])[-count:]
    with pytest.raises(ValueError, match="needs reference_floor"):
        KnapSpecConfig(plan_at_start=True)


def test_plan_after_plain_plans_on_the_plain_tokens_alone(params, ar_rows):
    """plan_after_plain = N: the run decodes N tokens a row plainly (no round drafts), then the first plan's window
    is exactly each row's N generated tokens (AR's own continuation, no prompt token); the next plan is a
    plan_interval of rounds later on the schedule's grid; greedy output is AR's. It and plan_at_start exclude
    each other, and N < 1 is refused."""
    planner = WindowPlanner([2, 0, 3])
    knap = dataclasses_replace(KNAP, plan_after_plain=8, plan_interval=8)
    result = knapspec_generate(params, TARGET, PROMPTS, latency=LATENCY, knapspec=knap, max_new_tokens=NEW,
                               planner=planner)
    assert result.rows() == ar_rows
    rounds = [p["round"] for p in result.metrics["knapspec_plans"]]
    assert rounds[0] == 8 and rounds[1] == knap.schedule.next_plan_round(8 + knap.plan_interval)
    assert result.metrics["ar_steps"] >= 8  # the plain start, and gamma 0 (the scripted second plan) after it
    tokens, mask, prefix, lengths = planner.windows[0]
    np.testing.assert_array_equal(lengths, [len(p) + 8 for p in PROMPTS])
    np.testing.assert_array_equal(mask.sum(axis=1).astype(int), [8, 8, 8])
    for b, row in enumerate(ar_rows):
        assert tokens[b, :8].tolist() == list(row[:8])
    for bad, match in ((dict(plan_after_plain=0), "plan_after_plain=0 must be >= 1"),
                       (dict(plan_after_plain=4, plan_at_start=True, reference_floor=8), "give one")):
        with pytest.raises(ValueError, match=match):
            KnapSpecConfig(**bad)


class PricedWindowPlanner(WindowPlanner):
    """A window-keeping planner with a price per reference token (so the allowance and the records price plans)."""

    def reference_cost(self, config, n):
        return 1e-3


def test_plan_rows_plan_on_the_rows_with_the_most_reference_tokens(params, ar_rows):
    """plan_rows = 1 at batch 3: each plan gets one row's window and that row's cache, the row with the most
    reference tokens (ties to the lower row) of the window every row would have given; greedy output stays AR's;
    the plan's predicted cost is a third of the whole batch's (docs/methods.md §5.6)."""
    from jaxspec.knapspec.policy import planning_rows

    knap = dataclasses_replace(KNAP, max_plan_fraction=None, probe_rounds=None)
    every, one = PricedWindowPlanner([2, 0, 3]), PricedWindowPlanner([2, 0, 3])
    full = knapspec_generate(params, TARGET, PROMPTS, latency=LATENCY, knapspec=knap, max_new_tokens=NEW,
                             planner=every)
    single = knapspec_generate(params, TARGET, PROMPTS, latency=LATENCY,
                               knapspec=dataclasses_replace(knap, plan_rows=1), max_new_tokens=NEW, planner=one)
    assert full.rows() == ar_rows and single.rows() == ar_rows
    assert len(one.windows) == len(every.windows) >= 3
    for (tokens, mask, prefix, lengths), (t1, m1, p1, l1) in zip(every.windows, one.windows):
        counts = mask.sum(axis=1)
        b = max(range(len(counts)), key=lambda i: (counts[i], -i))  # the most tokens, ties to the lower row
        assert t1.shape[0] == 1 and l1.tolist() == [lengths[b]] and p1.tolist() == [prefix[b]]
        np.testing.assert_array_equal(m1[0], mask[b])
        np.testing.assert_array_equal(t1[0], tokens[b])
    plans_full = [p for p in full.metrics["knapspec_plans"] if p.get("predicted_seconds")]
    plans_one = [p for p in single.metrics["knapspec_plans"] if p.get("predicted_seconds")]
    assert plans_full and len(plans_one) == len(plans_full)
    for a, b in zip(plans_full, plans_one):
        assert a["rows"] == 3 and b["rows"] == 1
        assert b["predicted_seconds"] == pytest.approx(a["predicted_seconds"] / 3)
    # finished rows go last, then the most reference tokens, ties to the lower row
    np.testing.assert_array_equal(planning_rows(np.array([[1, 1, 0], [1, 1, 1], [1, 1, 1]]),
                                                np.array([False, True, False]), 2), [0, 2])
    with pytest.raises(ValueError, match="plan_rows=0"):
        KnapSpecConfig(plan_rows=0)


def test_cache_rows_copies_the_rows_of_every_layer():
    """The plan rows' cache (one compiled gather for all layers) holds exactly those rows' K/V and lengths."""
    from jaxspec.knapspec.policy import cache_rows
    from jaxspec.models.cache import KVCache

    rng = np.random.default_rng(0)
    keys = tuple(jnp.asarray(rng.normal(size=(4, 2, 8, 3)), jnp.float32) for _ in range(3))
    values = tuple(jnp.asarray(rng.normal(size=(4, 2, 8, 3)), jnp.float32) for _ in range(3))
    cache = KVCache(keys=keys, values=values, lengths=jnp.asarray([5, 6, 7, 8], jnp.int32))
    out = cache_rows(cache, np.array([3, 1], np.int64))
    assert out.lengths.tolist() == [8, 6] and out.num_layers == 3
    for new, old in zip(out.keys + out.values, keys + values):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old)[[3, 1]])


# ---------------------------------------------------------------------------- the choice table (docs/methods.md §5.2)
def _table(speedup, bucket=32, batch=3, method="knapspec"):
    from jaxspec.decoding.arbitration import ChoiceTable

    return ChoiceTable([{"method": method, "context_bucket": bucket, "batch": batch, "speedup": speedup}])


@pytest.mark.parametrize("speedup,bucket,method,plans", [
    (0.85, 32, "knapspec", False),   # whole runs here did not pay: no plan, one plain stretch
    (1.20, 32, "knapspec", True),    # they paid: plan as usual
    (0.85, 64, "knapspec", True),    # another context bucket: no entry, plan as usual
    (0.85, 32, "clasp", True),       # another method's entry
])
def test_choice_table_decides_whether_knapspec_plans(params, ar_rows, speedup, bucket, method, plans):
    """The prompts (5, 17, 40 tokens, 20.7 on average) put the run in context bucket 32 with 3 active rows. Where
    the table's entry for ("knapspec", 32, 3) is below 1 + margin, the re-planning run makes no plan, runs no round and
    decodes the whole run in one plain stretch; otherwise it plans on the schedule. Greedy output is AR's."""
    planner = ScriptedPlanner([2, 3])
    result = knapspec_generate(params, TARGET, PROMPTS, knapspec=KNAP, max_new_tokens=NEW, planner=planner,
                               choice_table=_table(speedup, bucket, method=method))
    assert result.rows() == ar_rows
    m = result.metrics
    event = m["choice_table"]
    assert event["context_bucket"] == 32 and event["active_rows"] == 3 and event["method"] == "knapspec"
    if plans:
        assert planner.calls > 0 and m["knapspec_plans"] and m["rounds"] > 0
        assert event["choice"] == ("speculative" if event["reason"] == "table" else None)
    else:
        assert event == dict(event, choice="ar", reason="table", table_speedup=speedup, table_margin=0.02)
        assert planner.calls == 0 and not m["knapspec_plans"] and m["plan_allowance"] is None
        assert m["rounds"] == 0 and m["draft_steps"] == 0 and m["ar_intervals"] == 1
        assert m["ar_tokens"] == int((result.num_generated - 1).sum())


def test_choice_table_leaves_fixed_plans_alone_and_checks_its_type(params):
    """A fixed plan (replan=False) makes no plans, so the table has nothing to decide (no event); a table must
    be a ChoiceTable with a method name to look up."""
    from jaxspec.knapspec.controller import KnapSpecController

    mask = np.zeros((TARGET.num_layers, 2), bool)
    result = knapspec_generate(params, TARGET, PROMPTS, knapspec=KNAP, max_new_tokens=8, initial_plan=(mask, 2),
                               replan=False, choice_table=_table(0.5))
    assert result.metrics["choice_table"] is None
    with pytest.raises(TypeError, match="not a jaxspec.decoding.arbitration.ChoiceTable"):
        KnapSpecController(KNAP, ScriptedPlanner([1]), choice_table={"entries": []})
    with pytest.raises(ValueError, match="needs table_method"):
        KnapSpecController(KNAP, ScriptedPlanner([1]), choice_table=_table(0.5), table_method="")
