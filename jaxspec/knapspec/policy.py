"""KnapSpec for the speculative engine: a self-draft policy, the re-planning schedule, a driver.

This module holds the entry points (:func:`knapspec_generate`, :func:`knapspec_budget_generate`) and
re-exports the parts, each in a module of its own:

* :mod:`~jaxspec.knapspec.config` -- :class:`KnapSpecConfig` (every knob) and :class:`KnapSpecSchedule`;
* :mod:`~jaxspec.knapspec.draft` -- :class:`KnapSpecDraft`;
* :mod:`~jaxspec.knapspec.window` -- the reference window and its target states (:class:`WindowStates`);
* :mod:`~jaxspec.knapspec.skip_planner` -- one plan (:func:`plan_skip_set`), :class:`KnapSpecPlanner`, the
  planning allowance and :class:`PlanRecord`;
* :mod:`~jaxspec.knapspec.controller` -- :class:`KnapSpecController`.

* :class:`KnapSpecDraft` -- a draft policy (the engine contract of
  :mod:`jaxspec.decoding.policies`): the target with the sub-layers of ``state["skip_mask"]``
  ``[L, 2]`` skipped (a dynamic mask: a new plan needs no recompile), drafting up to
  ``min(engine gamma, state["gamma_cap"])`` tokens (the cap is the plan's gamma*, a dynamic
  value) with **early exit**: the draft loop is a ``lax.while_loop`` that stops once every row
  has drafted a token whose probability is below ``early_exit`` (0.7; the token itself is
  kept, as in the official code). The engine's proposal has a static length ``gamma``, so the
  remaining positions are filled with the last drafted token (one-hot draft distribution) and
  ``Proposal.num_drafted`` tells the engine how many are real: fillers are never accepted and
  never counted as drafted (``acceptance_rate`` = accepted / really drafted tokens).
  ``state["draft_steps"]`` counts the draft forwards actually run.
* :class:`KnapSpecSchedule` -- when to re-plan: before the first plan the draft is the full
  model; the DP runs after round ``plan_round`` (6) of every ``plan_interval`` (64) rounds
  (rounds 6, 70, 134, ...), on the tokens committed in the last ``reference_rounds`` (5) rounds,
  with ``t_attn`` at the *current* context length (official code: accumulate at
  ``step % 64 in 2..6``, optimise at ``step % 64 == 6``). Planning budget (docs/methods.md §5,
  ``KnapSpecConfig.max_plan_fraction``, default 5 %): a plan on this grid is skipped to a later
  grid point while the previous plan cost more than that fraction of the decode time since it, and
  no re-plan runs that would take the run's planning (priced as the previous plan) past that fraction
  of the run's projected decode time.
* :class:`KnapSpecController` -- the driver, an engine controller
  (:class:`~jaxspec.decoding.contract.Controller`): the engine's jitted ``while_loop`` runs in
  chunks between schedule events, and at each plan event a *planner* (:class:`KnapSpecPlanner`: reference states
  (:func:`~jaxspec.knapspec.dp.boundary_states`), DP (:func:`~jaxspec.knapspec.dp.knapsack_dp`),
  grid search (:func:`~jaxspec.knapspec.planner.choose_plan`); CLaSp and the static skip set of
  :mod:`jaxspec.baselines` plug in here) sets the new mask and gamma.
* :func:`knapspec_generate` -- :func:`~jaxspec.decoding.speculative.speculative_generate` with
  :class:`KnapSpecDraft` and a :class:`KnapSpecController` (so mesh, ``profile=True``, warm-up
  and prefilled caches are the engine's).

Per-plan gamma (``KnapSpecConfig.honor_gamma``, default on; off = the official code, which
reports gamma* but always drafts up to gamma_max):

* gamma* >= 1: drafting is capped at gamma* (dynamic, no recompile) and the verification runs
  ``b + 1`` rows, ``b`` the smallest of ``gamma_buckets`` (plus gamma_max) >= gamma*. Each
  bucket is a static engine gamma, compiled lazily the first time a plan picks it (one
  compile per bucket per model). Why buckets and not always ``gamma_max + 1`` verification
  rows: on a CPU (or any compute-bound setting) 11 verification rows cost about 2x 3 rows
  (SmolLM2-135M, 1k context: 54 ms vs 24 ms), which the TPT model -- verification = one
  decode step -- does not account for; on a memory-bound GPU the extra rows are nearly free,
  so ``gamma_buckets=()`` (a single compile, verify ``gamma_max + 1`` rows) is the choice there.
  Only ``accepted_histogram`` / ``draft_counts`` have a gamma-sized shape in the loop state;
  they are folded into host totals at a bucket change.
* gamma* = 0 (plain decoding predicted best): the interval until the next plan
  (``plan_interval`` steps, each counted as one round of the schedule) runs the jitted
  autoregressive loop of :mod:`jaxspec.decoding.autoregressive` on the same cache (no draft,
  no verification), so a plan can never make decoding slower than AR beyond the planning
  cost. The next plan then uses the last ``ar_reference_tokens`` committed tokens as its
  reference (an AR interval has no draft rounds to take a reference from). The interval
  bypasses the verify policy: a verify policy whose state follows the committed tokens
  (``update`` hook, e.g. Dustin) is not updated during it.

Measured arbitration (docs/methods.md §5, ``KnapSpecConfig.probe_rounds``, default 8): the grid search
trusts acceptance statistics from a few reference tokens, which can be optimistic (SmolLM2 on a
CPU: the DP's alpha 1.0 on 21 tokens, 0.84 measured; a plan predicted faster than AR ran at
0.8x). So after a plan that drafts, the driver times ``probe_rounds`` speculative rounds and then
as many plain-decoding steps on the live sequence (both commit real tokens) and keeps the faster,
in tokens committed per second, until the next plan. The plain-decoding rate is the better of
the probe's and the latency model's prediction: a short probe's fixed per-call cost weighs more
on a few cheap steps (on the H200 an 8-step probe measured 123 tok/s where AR ran at 171). A
mispredicted plan then costs at most its probe. Both probes have fixed shapes (``max_rounds`` is
traced; a plain-decoding stretch traces its step count into a buffer sized for the whole run), so
nothing compiles in a timed run whichever wins. CLaSp (no plain decoding) runs without it.

Planning allowance (docs/methods.md §5, with ``max_plan_fraction``): before decoding, the planner's
predicted DP cost per reference token (:meth:`KnapSpecPlanner.reference_cost`, from the latency
model's verification-row cost) and the predicted plain-decoding time of the run give how many
reference tokens per row one plan can afford (:func:`reference_allowance`); the DP's window is
capped there, and when fewer than ``min_reference_tokens`` fit, no plan is made and the run
decodes plainly from the start (on a 2-core CPU one SmolLM2 DP costs ~80 decode steps: a
256-token generation cannot pay for it).

Batch > 1 (beyond the official batch-1 code): one skip set for the whole batch; the DP's
value and alpha pool every row's reference tokens (each row attends to its own prefix); the
early exit is batch-level (the loop ends when every row has exited; rows that exited earlier
keep drafting meanwhile, which costs nothing extra in a batched forward, and those tokens are
real drafts: ``num_drafted`` is the loop's count for every row).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.arbitration import ChoiceTable
from jaxspec.decoding.policies import DenseVerify
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.speculative import EngineConfig, SpeculativeResult, speculative_generate
from jaxspec.knapspec.budgeted import BUDGET, BudgetDPCost, DENSE, SKIP, check_budget, plan_choices
from jaxspec.knapspec.config import KnapSpecConfig, KnapSpecSchedule, dp_history_backend, exit_threshold
from jaxspec.knapspec.controller import KnapSpecController
from jaxspec.knapspec.dp import check_keep_attention
from jaxspec.knapspec.draft import NO_GAMMA_CAP, KnapSpecDraft
from jaxspec.knapspec.latency import LatencyModel, effective_context
from jaxspec.knapspec.skip_planner import KnapSpecPlanner, PlanRecord, plan_price, plan_skip_set, reference_allowance
from jaxspec.knapspec.window import WindowStates, cache_rows, planning_rows, prefill_window, reference_window
from jaxspec.models.llama import freeze_skip_mask


def knapspec_generate(target_params, target_config: ModelConfig, prompts: Sequence[Sequence[int]], *,
                      latency: Optional[LatencyModel] = None, knapspec: KnapSpecConfig = KnapSpecConfig(),
                      engine: Optional[EngineConfig] = None, max_new_tokens: int = 64,
                      sampling: SamplingConfig = SamplingConfig(), stop_tokens: Sequence[int] = (),
                      verify_policy=DenseVerify(), verify_state=None, seed: int = 0, capacity: Optional[int] = None,
                      context_n: Optional[float] = None, warmup: bool = False, planner=None,
                      initial_plan: Optional[Tuple[np.ndarray, int]] = None, replan: bool = True,
                      prefilled=None, profile: bool = False, mesh=None, rules=None,
                      allow_beyond_context: bool = False, static_plan: bool = True,
                      attention_plan: Optional[Tuple[np.ndarray, int, int]] = None,
                      draft_policy=None, probe_fixed_plan: bool = False,
                      window_states: Optional[WindowStates] = None, choice_table: Optional[ChoiceTable] = None,
                      table_method: str = "knapspec") -> SpeculativeResult:
    """Greedy or sampled speculative generation with KnapSpec self-drafting: the engine's
    :func:`~jaxspec.decoding.speculative.speculative_generate` with :class:`KnapSpecDraft` and a
    :class:`KnapSpecController`.

    ``engine`` defaults to ``EngineConfig(gamma=knapspec.gamma_max, sampling=sampling,
    max_new_tokens=max_new_tokens, stop_tokens=stop_tokens)``; its ``gamma`` is gamma_max (the
    loop state is sized for it; smaller gamma buckets run as chunks of that gamma). ``context_n``
    overrides the context length ``t_attn`` is evaluated at (default: :func:`effective_context`).
    ``planner`` (default ``KnapSpecPlanner(latency, knapspec)``) chooses each plan;
    ``initial_plan=(mask [L, 2], gamma)`` replaces the full-model draft before the first plan
    (gamma 0: plain decoding); ``replan=False`` keeps it for the whole run (a static skip set).
    ``static_plan`` (with ``replan=False`` and an ``initial_plan``): the draft forward is compiled
    for that plan (``KnapSpecDraft.static_mask``: skipped sub-layers removed at trace time, no
    per-sub-layer ``lax.cond``); False keeps the dynamic mask. ``attention_plan=(codes [L, 2], sinks,
    window)`` (with ``replan=False``): draft with that three-choice plan (docs/methods.md §5.4) instead.
    ``probe_fixed_plan`` (with ``replan=False``): time ``knapspec.probe_rounds`` rounds of the fixed plan against as
    many plain-decoding steps at the start and keep the faster for the run (the measured arbitration;
    ``metrics["fixed_plan_probe"]``).
    ``draft_policy``: another self-draft in place of :class:`KnapSpecDraft` (e.g. Dustin's
    ``DustinSelfDraft``, docs/methods.md §5.5): a policy with ``initial_state(skip_mask)`` whose state
    holds ``"skip_mask"``; its state also gets ``"draft_steps"`` and ``"gamma_cap"`` (the controller sets the
    mask and the cap of each plan; a policy that ignores the cap drafts the plan's gamma bucket).
    ``choice_table`` / ``table_method``: whole KnapSpec runs measured earlier decide, per (context bucket,
    batch), whether a re-planning run plans at all (:class:`KnapSpecController`; docs/methods.md §5.2);
    ``metrics["choice_table"]`` holds the decision.

    ``prefilled=(cache, first_logits)``: the prompts already prefilled into a cache of
    ``capacity`` slots (e.g. one prefill shared by several methods in a benchmark); each run
    works on a copy, so the caller's cache stays valid (``timings["prefill_s"]`` is the copy).
    ``profile``, ``mesh``, ``rules``: as the engine's.

    With ``knapspec.plan_at_start`` the plan at the start takes its window's target states from the prefill
    (docs/methods.md §5.6): the engine's prefill keeps them (:meth:`KnapSpecController.prefill_target`), and
    with ``prefilled`` they come as ``window_states`` (the third result of :func:`prefill_window`, which made
    the cache); without them that plan computes its own.

    ``metrics["knapspec_plans"]`` lists every plan (skipped sub-layers, gamma* and the gamma
    used, context length, predicted TPT, seconds); ``metrics["draft_steps"]`` counts draft
    forwards actually run (early exit); ``metrics["ar_steps"]`` / ``["ar_tokens"]`` the plain
    decoding steps and the tokens they committed; ``metrics["tau"]`` counts speculative rounds
    only. ``timings["plan_s"]`` is the planning time inside ``decode_s``.
    """
    if engine is None:
        engine = EngineConfig(gamma=knapspec.gamma_max, sampling=sampling, max_new_tokens=max_new_tokens,
                              stop_tokens=tuple(int(t) for t in stop_tokens))
    if engine.gamma != knapspec.gamma_max:
        raise ValueError(f"engine gamma {engine.gamma} must equal knapspec.gamma_max {knapspec.gamma_max}")
    if engine.fixed_acceptance is not None:
        raise ValueError("knapspec_generate does not support fixed-acceptance mode")
    check_keep_attention(knapspec.keep_attention, target_config.num_layers)
    if planner is None and replan:
        if latency is None:
            raise ValueError("knapspec_generate needs a latency model (or a planner, or replan=False)")
        planner = KnapSpecPlanner(latency, knapspec)
    static_mask = None
    if static_plan and not replan and initial_plan is not None:
        static_mask = freeze_skip_mask(initial_plan[0])
    codes = budget = None
    if attention_plan is not None:
        if replan or initial_plan is None:
            raise ValueError("attention_plan is a fixed plan: it needs replan=False and an initial_plan")
        codes = tuple((int(a), int(m)) for a, m in np.asarray(attention_plan[0], np.int64))
        budget, static_mask = (int(attention_plan[1]), int(attention_plan[2])), None
    if draft_policy is None:
        policy = KnapSpecDraft(target_config, early_exit=knapspec.early_exit, static_mask=static_mask,
                               static_codes=codes, attention_budget=budget)
        draft_state = policy.initial_state()
    else:
        if codes is not None:
            raise ValueError("attention_plan runs KnapSpecDraft's budgeted forward: it takes no draft_policy")
        policy = draft_policy
        draft_state = dict(policy.initial_state(np.zeros((target_config.num_layers, 2), bool)),
                           draft_steps=jnp.zeros((), jnp.int32), gamma_cap=jnp.int32(NO_GAMMA_CAP))
    if not replan:  # static_plans is for re-planning runs; a fixed plan follows static_plan
        knapspec = dataclasses.replace(knapspec, static_plans=False)
    elif knapspec.static_plans and not isinstance(policy, KnapSpecDraft):
        raise ValueError(f"KnapSpecConfig.static_plans compiles KnapSpecDraft for each plan; the draft policy "
                         f"{type(policy).__name__} has its own forward")
    controller = KnapSpecController(knapspec, planner, latency=latency, context_n=context_n,
                                    initial_plan=initial_plan, replan=replan,
                                    draft_policy=policy if knapspec.static_plans else None,
                                    probe_fixed=probe_fixed_plan,
                                    window_states=window_states if prefilled is not None else None,
                                    choice_table=choice_table, table_method=table_method)
    return speculative_generate(target_params, target_config, prompts, draft_policy=policy,
                                draft_state=draft_state, verify_policy=verify_policy,
                                verify_state=verify_state, engine=engine, seed=seed, capacity=capacity, warmup=warmup,
                                profile=profile, controller=controller, prefilled=prefilled, mesh=mesh, rules=rules,
                                allow_beyond_context=allow_beyond_context)


def knapspec_budget_generate(target_params, target_config: ModelConfig, prompts: Sequence[Sequence[int]], *,
                             latency: LatencyModel, sinks: int, window: int, reference_tokens: int = 64,
                             knapspec: KnapSpecConfig = KnapSpecConfig(), engine: Optional[EngineConfig] = None,
                             max_new_tokens: int = 64, sampling: SamplingConfig = SamplingConfig(),
                             stop_tokens: Sequence[int] = (), seed: int = 0, capacity: Optional[int] = None,
                             context_n: Optional[float] = None, warmup: bool = False,
                             allow_beyond_context: bool = False) -> SpeculativeResult:
    """KnapSpec with budgeted attention (docs/methods.md §5.4): one three-choice plan
    (:func:`~jaxspec.knapspec.budgeted.plan_choices`) on the last ``reference_tokens`` prompt tokens of
    each row (attending to the prompt before them), then a fixed, statically compiled draft for the
    whole run. ``timings["plan_s"]`` (inside ``decode_s``) is the plan; ``metrics["budget_plan"]`` the
    plan's codes, gamma, predicted TPT and alpha. With ``knapspec.plan_rows = N`` the plan uses the first
    N rows' tails only (a copy of their cache rows), as the re-planning KnapSpec does (docs/methods.md
    §5.6): its dense choice attends to each planned row's whole cache for every slot state. The plan
    keeps to the planning allowance (:func:`reference_allowance` with :class:`BudgetDPCost`; ``metrics
    ["plan_allowance"]``): fewer reference tokens where it would cost more, no plan and plain decoding
    (gamma 0) where even ``knapspec.min_reference_tokens`` would not fit. A plan that drafts is then
    probed against plain decoding (``knapspec.probe_rounds`` rounds, the measured arbitration;
    ``metrics["fixed_plan_probe"]``; None = no probe): its acceptance comes from a few reference tokens."""
    from jaxspec.decoding.autoregressive import pad_prompts, prefill
    from jaxspec.models.cache import init_cache

    check_budget(sinks, window)
    if reference_tokens < 1:
        raise ValueError(f"reference_tokens={reference_tokens} must be >= 1")
    tokens, lengths = pad_prompts(prompts)
    if engine is None:
        engine = EngineConfig(gamma=knapspec.gamma_max, sampling=sampling, max_new_tokens=max_new_tokens,
                              stop_tokens=tuple(int(t) for t in stop_tokens))
    capacity = int(capacity) if capacity is not None else int(lengths.max()) + engine.max_new_tokens + engine.gamma + 2
    cache = init_cache(target_config, len(prompts), capacity)
    prefilled = prefill(target_params, target_config, tokens, lengths, cache)
    jax.block_until_ready(prefilled)
    r = int(min(reference_tokens, int(lengths.min()) - 1))
    if r < 1:
        raise ValueError(f"prompts of {int(lengths.min())} tokens leave no reference tokens for the plan")
    n = context_n if context_n is not None else effective_context(target_config, lengths + engine.max_new_tokens,
                                                                  capacity)
    planned = len(prompts) if knapspec.plan_rows is None else min(int(knapspec.plan_rows), len(prompts))
    # the planning allowance (docs/methods.md §5.6) priced for the three-choice DP: fewer reference
    # tokens, or no plan at all (plain decoding) when even the minimum would not fit
    allowance = reference_allowance(BudgetDPCost(latency, sinks, window, knapspec.weight_cap), latency, target_config,
                                    float(n), engine.max_new_tokens, knapspec, row_share=planned / len(prompts))
    if allowance["tokens"] is not None:
        r = min(r, int(allowance["tokens"]))
    prefix = lengths - r
    ref = np.stack([tokens[b, prefix[b]: prefix[b] + r] for b in range(len(prompts))]).astype(np.int32)
    plan_cache, plan_prefix = prefilled[0], prefix
    if planned < len(prompts):
        rows = list(range(planned))  # every row's tail has r tokens: the first rows
        ref, plan_prefix, plan_cache = ref[rows], prefix[rows], cache_rows(plan_cache, rows)

    def plan():
        return plan_choices(target_params, target_config, plan_cache, jnp.asarray(ref),
                            jnp.ones(ref.shape, jnp.float32), jnp.asarray(plan_prefix, jnp.int32), latency, float(n),
                            sinks=sinks, window=window, tau=knapspec.tau, weight_cap=knapspec.weight_cap,
                            gammas=knapspec.plan_gammas)

    if allowance["skip"]:  # no affordable plan: plain decoding from the start (gamma* = 0)
        best, cands, weights, plan_s = None, None, (), 0.0
    else:
        if warmup:  # compile the DP outside the timed plan, as the warm-up run does for the other planners
            plan()
        start = time.perf_counter()
        best, cands, weights = plan()
        plan_s = time.perf_counter() - start
    del plan_cache
    codes = best["plan"] if best is not None else np.zeros((target_config.num_layers, 2), np.int8)
    gamma = (0 if allowance["skip"] else
             min(int(best["gamma"]) if best is not None else knapspec.gamma_max, engine.gamma))
    result = knapspec_generate(target_params, target_config, prompts, knapspec=knapspec, engine=engine, seed=seed,
                               capacity=capacity, warmup=warmup, replan=False, prefilled=prefilled,
                               initial_plan=(codes == SKIP, gamma), attention_plan=(codes, sinks, window),
                               allow_beyond_context=allow_beyond_context,
                               probe_fixed_plan=knapspec.probe_rounds is not None)
    result.timings["plan_s"] = plan_s
    result.timings["decode_s"] = result.timings.get("decode_s", 0.0) + plan_s
    result.metrics["plan_allowance"] = allowance
    result.metrics["budget_plan"] = {
        "codes": np.asarray(codes).tolist(), "gamma": gamma, "sinks": int(sinks), "window": int(window),
        "predicted_tpt": None if best is None else best["tpt"], "alpha": None if best is None else
        float(cands.alpha[best["index"]]), "weights": list(weights), "candidates": 0 if cands is None else len(cands),
        "reference_tokens": 0 if allowance["skip"] else int(r * len(ref)), "rows": int(len(ref)), "n": float(n),
        "plan_s": plan_s, "allowance": allowance,
        "n_dense_attn": int((codes[:, 0] == DENSE).sum()), "n_budget_attn": int((codes[:, 0] == BUDGET).sum()),
        "n_skip_attn": int((codes[:, 0] == SKIP).sum()), "n_skip_mlp": int((codes[:, 1] == SKIP).sum())}
    return result


__all__ = ["KnapSpecConfig", "KnapSpecController", "KnapSpecDraft", "KnapSpecPlanner", "KnapSpecSchedule",
           "NO_GAMMA_CAP", "PlanRecord", "WindowStates", "cache_rows", "dp_history_backend", "exit_threshold",
           "knapspec_budget_generate", "knapspec_generate", "plan_price", "plan_skip_set", "planning_rows",
           "prefill_window", "reference_allowance", "reference_window"]
