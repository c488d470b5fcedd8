"""The KnapSpec driver: :class:`KnapSpecController`, an engine controller that re-plans on the schedule,
arbitrates each plan against plain decoding and runs plain stretches; :mod:`jaxspec.knapspec.policy` gives
the overview."""
from __future__ import annotations

import dataclasses
import time
from typing import List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.arbitration import (ChoiceTable, context_bucket, measured_arbitration, remaining_steps,
                                          two_stretches)
from jaxspec.decoding.autoregressive import prefill
from jaxspec.decoding.contract import Chunk, ScriptedController
from jaxspec.knapspec.config import KnapSpecConfig
from jaxspec.knapspec.draft import KnapSpecDraft
from jaxspec.knapspec.latency import LatencyModel, effective_context
from jaxspec.knapspec.planner import Planner
from jaxspec.knapspec.skip_planner import PLAN_ANNOTATION, PlanRecord, plan_price, reference_allowance
from jaxspec.knapspec.window import WindowStates, cache_rows, planning_rows, prefill_window, reference_window
from jaxspec.models.llama import freeze_skip_mask


class KnapSpecController(ScriptedController):
    """The KnapSpec driver as an engine :class:`~jaxspec.decoding.contract.Controller`: re-planning on
    :class:`KnapSpecSchedule` (postponed under ``max_plan_fraction``, the window capped by
    :func:`reference_allowance`), per-plan gamma buckets, plain-decoding stretches for gamma* = 0 and
    the measured arbitration (see :mod:`jaxspec.knapspec.policy`). ``planner`` None with ``replan=False`` keeps
    ``initial_plan`` for the whole run (a static skip set). The warm-up run keeps the fixed schedule
    (a plan at every interval), so the timed run finds every shape it can meet compiled, and it
    compiles plain decoding whichever mode the timed run takes.

    ``choice_table`` (a :class:`~jaxspec.decoding.arbitration.ChoiceTable` of whole KnapSpec runs against AR,
    looked up as ``table_method`` at the run's ``(context bucket, batch)``): where its entry's speed-up is below
    ``1 + margin`` the run makes no plan and decodes plainly from the start, so a context and batch where
    KnapSpec's plans were measured not to pay cost no plan again; where it is at least that, or the table has
    no entry, the run plans as usual (docs/methods.md §5.2). ``metrics["choice_table"]`` records the decision."""

    def __init__(self, knapspec: KnapSpecConfig, planner=None, *, latency: Optional[LatencyModel] = None,
                 context_n: Optional[float] = None, initial_plan: Optional[Tuple[np.ndarray, int]] = None,
                 replan: bool = True, draft_policy: Optional["KnapSpecDraft"] = None, probe_fixed: bool = False,
                 window_states: Optional[WindowStates] = None, choice_table: Optional[ChoiceTable] = None,
                 table_method: str = "knapspec"):
        if replan and planner is None:
            raise ValueError("KnapSpecController needs a planner to re-plan (or replan=False)")
        if planner is not None and not isinstance(planner, Planner):
            raise TypeError(f"planner {type(planner).__name__} is not a jaxspec.knapspec.planner.Planner (it needs "
                            f"name, plan, latency_model, reference_cost); derive it from PlannerBase")
        self.knapspec, self.planner, self.context_n = knapspec, planner, context_n
        self.initial_plan, self.replan = initial_plan, replan
        # a fixed plan (replan=False) that drafts: probe it against plain decoding once, at the start
        self.probe_fixed = bool(probe_fixed) and not replan
        self.fixed_probe = None  # that probe's record (measured_arbitration) once it ran
        self.latency = latency if latency is not None else (planner.latency_model() if planner is not None else None)
        if knapspec.static_plans and not isinstance(draft_policy, KnapSpecDraft):
            raise ValueError(f"KnapSpecConfig.static_plans compiles KnapSpecDraft for each plan: pass the run's "
                             f"KnapSpecDraft as draft_policy (got {type(draft_policy).__name__})")
        self.draft_policy = draft_policy if knapspec.static_plans else None
        # the prompt's last tokens' target states kept from the prefill (prefill_window): the plan at the start
        # takes its window's states from them when its planner accepts them
        self.window_states = window_states
        if choice_table is not None and not isinstance(choice_table, ChoiceTable):
            raise TypeError(f"choice_table is a {type(choice_table).__name__}, not a "
                            f"jaxspec.decoding.arbitration.ChoiceTable (load one with ChoiceTable.load)")
        if choice_table is not None and not table_method:
            raise ValueError("a choice table needs table_method: the method name its entries are looked up by")
        self.choice_table, self.table_method = choice_table, table_method
        self.table_event = None

    def table_decision(self, run) -> Optional[dict]:
        """The choice table's decision for this run: None without a table or for a run that makes no plans of
        its own; else a dict with the key (``context_bucket``, ``active_rows``, ``method``) and ``choice``:
        ``"speculative"`` (plan as usual), ``"ar"`` (no plan, plain decoding) with the entry's speed-up and the
        table's margin, or None where the table has no entry for the key (plan as usual)."""
        if self.choice_table is None or not (self.replan and self.knapspec.honor_gamma):
            return None
        key = (context_bucket(run), int(np.sum(~np.asarray(run.state.done))))
        entry = self.choice_table.lookup(self.table_method, *key)
        if entry is None:
            return {"context_bucket": key[0], "active_rows": key[1], "method": self.table_method, "choice": None,
                    "reason": "no table entry"}
        return {"context_bucket": key[0], "active_rows": key[1], "method": self.table_method,
                "choice": self.choice_table.decide(entry), "reason": "table", "table_speedup": float(entry["speedup"]),
                "table_margin": self.choice_table.margin}

    def keeps_window_states(self) -> bool:
        """Whether the plan at the start takes its window's target states from the prefill: a plan at the start
        (``plan_at_start``, re-planning, ``start_states="prefill"``) by a planner that accepts them
        (``accepts_window_states``)."""
        return bool(self.replan and self.knapspec.plan_at_start and self.knapspec.start_states == "prefill"
                    and getattr(self.planner, "accepts_window_states", False))

    def keeps_plain_states(self) -> bool:
        """Whether the first plan after plain decoding (``plan_after_plain``) takes its window's target states from
        the plain stretch that decoded those tokens (``start_states="prefill"``: kept by the forward that wrote
        them, docs/methods.md §5.6) instead of computing them."""
        return bool(self.replan and self.knapspec.plan_after_plain is not None and self.knapspec.honor_gamma
                    and self.knapspec.start_states == "prefill"
                    and getattr(self.planner, "accepts_window_states", False))

    def prefill_target(self, target_params, target_config, tokens, lengths, cache):
        """The engine's prefill (:class:`~jaxspec.decoding.contract.Controller`): with
        :meth:`keeps_window_states`, :func:`prefill_window` over the last ``reference_floor`` prompt tokens
        (their states go to the plan at the start); otherwise the plain prefill."""
        if not self.keeps_window_states():
            return prefill(target_params, target_config, tokens, lengths, cache)
        cache, logits, self.window_states = prefill_window(target_params, target_config, tokens, lengths, cache,
                                                           int(self.knapspec.reference_floor),
                                                           self.knapspec.token_bucket)
        return cache, logits

    def _policy_for(self, mask) -> Optional["KnapSpecDraft"]:
        """With ``static_plans``: the draft compiled for ``mask`` (equal plans give equal policies, so jit
        reuses the compiled loop); otherwise None (the run's dynamic mask)."""
        if self.draft_policy is None:
            return None
        return dataclasses.replace(self.draft_policy, static_mask=freeze_skip_mask(np.asarray(mask, bool)))

    def chunks(self, run):
        knapspec, engine, config = self.knapspec, run.engine, run.target_config
        gamma_max = engine.gamma
        fraction = None if run.warmup else knapspec.max_plan_fraction
        self.records: List[PlanRecord] = []
        self.timings = {"plan_s": 0.0}
        decode_start = time.perf_counter()
        self.allowance = None
        self.buckets_used = set()
        self.schedule_rounds = 0
        current = {"gamma": gamma_max, "bucket": gamma_max, "draft_state": None,
                   "policy": self._policy_for(np.zeros((config.num_layers, 2), bool))}
        planner, model, tokens, lengths = self.planner, self.latency, run.prompt_tokens, run.prompt_lengths

        def apply_plan(mask, gamma):
            """Switch to a plan: (mask, gamma); gamma 0 = plain decoding until the next plan."""
            gamma = min(max(int(gamma), 0), gamma_max)
            bucket = knapspec.bucket_for(gamma) if gamma > 0 else current["bucket"]
            base = current["draft_state"] if current["draft_state"] is not None else run.state.draft_state
            current.update(gamma=gamma, bucket=bucket, draft_state=dict(
                base, skip_mask=jnp.asarray(mask, bool), gamma_cap=jnp.int32(max(gamma, 1))))
            if gamma > 0:
                current["policy"] = self._policy_for(mask)

        def take_draft_state():
            state, current["draft_state"] = current["draft_state"], None
            return state

        def advance(rounds: Optional[int], keep_states: bool = False):
            """Run ``rounds`` schedule rounds (None: to the end) under the current plan; ``keep_states``: a plain
            stretch also keeps its tokens' target states (``LiveRun.kept_states``)."""
            if current["gamma"] == 0:
                state = run.state
                remaining = np.asarray(engine.max_new_tokens - state.num_out)[~np.asarray(state.done)]
                steps = int(remaining.max(initial=0))
                steps = steps if rounds is None else min(int(rounds), steps)
                if steps <= 0:
                    return 0
                # one dispatch, the step count traced and the token buffer sized for the whole run: one
                # compile whatever the length (a probe, an interval, a postponed plan's longer stretch)
                yield Chunk(plain_steps=steps, draft_state=take_draft_state(), keep_states=keep_states)
                return steps
            self.buckets_used.add(current["bucket"])
            yield Chunk(rounds=rounds, gamma=current["bucket"], draft_state=take_draft_state(),
                        draft_policy=current["policy"])
            return run.last_chunk

        def arbitrate(n, rounds=None):
            """Time ``probe_rounds`` speculative rounds under the new plan, then as many plain-decoding
            steps; keep the faster (tokens committed per second) until the next plan
            (:func:`~jaxspec.decoding.arbitration.measured_arbitration`). The plain-decoding rate is the
            better of the probe's and the latency model's (active rows per ``LatencyModel.t_plain(n)``): a short
            probe's fixed per-call cost (dispatch, host syncs) weighs more on a few cheap AR steps than
            on the longer speculative rounds, which would favour drafting. With ``probe_pricing="two-stretch"``
            each side runs as two calls priced by their difference instead (no per-call cost on either side;
            the model's rate is recorded only)."""
            rounds = knapspec.probe if rounds is None else int(rounds)
            speculative_gamma = current["gamma"]

            def plain(steps=rounds):
                current["gamma"] = 0
                return (yield from advance(steps))

            ar_model = None
            if model is not None:
                def ar_model(active):
                    return active / max(model.t_plain(n, config.num_layers), 1e-12)
            warm = knapspec.probe_warmup > 0
            two = knapspec.probe_pricing == "two-stretch"
            probe, units = yield from measured_arbitration(
                run, (lambda: two_stretches(advance, rounds)) if two else (lambda: advance(rounds)),
                (lambda: two_stretches(plain, rounds)) if two else plain, rounds=rounds,
                ar_model_rate=ar_model, ar_model_floor=not two,
                warmup_speculative=(lambda: advance(knapspec.probe_warmup)) if warm else None,
                warmup_plain=(lambda: plain(knapspec.probe_warmup)) if warm else None)
            if probe is not None and probe["choice"] == "speculative":
                current["gamma"] = speculative_gamma
            return probe, units

        if self.initial_plan is not None:
            mask, gamma = self.initial_plan
            apply_plan(mask, gamma if knapspec.honor_gamma else gamma_max)
        true_round, mark = 0, None
        self.fixed_probe = None
        if self.probe_fixed and knapspec.probe_rounds and current["gamma"] > 0 and knapspec.honor_gamma:
            # the measured arbitration for a plan made once (docs/methods.md §5.4): its acceptance comes from
            # a few reference tokens, so time it against plain decoding before trusting it for the whole run
            n0 = self.context_n if self.context_n is not None else effective_context(config, lengths, run.capacity)
            self.fixed_probe, true_round = yield from arbitrate(n0, knapspec.probe_rounds)
        last = None  # (plan end time, plan seconds, round) of the previous plan
        schedule = knapspec.schedule
        next_plan = (0 if knapspec.plan_at_start else schedule.next_plan_round(0)) if self.replan else None
        self.table_event = self.table_decision(run)
        table_plain = self.table_event is not None and self.table_event["choice"] == "ar"
        if table_plain:  # whole KnapSpec runs at this context and batch did not pay: no plan (docs/methods.md §5.2)
            apply_plan(np.zeros((config.num_layers, 2), bool), 0)
            next_plan = None
        ref_cap = knapspec.max_reference_tokens
        batch = len(lengths)
        row_share = 1.0 if knapspec.plan_rows is None else min(int(knapspec.plan_rows), batch) / batch
        if self.replan and knapspec.honor_gamma and not table_plain:  # the official code always plans and drafts
            n0 = self.context_n if self.context_n is not None else effective_context(config, lengths, run.capacity)
            kept = (self.window_states is not None and self.keeps_window_states()) or self.keeps_plain_states()
            self.allowance = reference_allowance(planner, model, config, n0, engine.max_new_tokens, knapspec,
                                                 row_share=row_share, states_known=kept)
            if kept:
                self.allowance["states_from_prefill" if self.keeps_window_states() else "states_from_plain"] = True
            if self.allowance["skip"]:  # no affordable plan: plain decoding from the start (gamma* = 0)
                apply_plan(np.zeros((config.num_layers, 2), bool), 0)
                next_plan = None
            elif self.allowance["tokens"] is not None:
                ref_cap = int(self.allowance["tokens"])
        plain_start = None  # plan_after_plain: the plain steps before the first plan (a plain step is a round here)
        if next_plan is not None and knapspec.plan_after_plain is not None and knapspec.honor_gamma:
            plain_start = int(knapspec.plan_after_plain)
            apply_plan(np.zeros((config.num_layers, 2), bool), 0)
            next_plan = plain_start
        while next_plan is not None and not run.finished():
            mark_at = schedule.mark_round(next_plan)
            at_start = next_plan == 0
            if next_plan == 0:  # plan_at_start: the prompt's last reference_floor tokens are the whole reference
                mark = np.maximum(np.asarray(run.state.target_cache.lengths) - int(knapspec.reference_floor), 0)
            elif current["gamma"] != 0:  # plain decoding: the reference is taken when planning
                if mark_at > true_round:
                    true_round += yield from advance(mark_at - true_round)
                    if true_round < mark_at:  # every row finished
                        break
                mark = np.asarray(run.state.target_cache.lengths)
            if next_plan > true_round:
                # the stretch before the first plan after plain decoding keeps its tokens' states for that plan
                keep = plain_start is not None and next_plan == plain_start and self.keeps_plain_states()
                run.kept_states = None
                true_round += yield from advance(next_plan - true_round, keep_states=keep)
                if true_round < next_plan:
                    break
            if run.finished():
                break
            if fraction is not None and last is not None:
                # postpone while the previous plan still costs more than the allowed fraction of the
                # decode time since it (the schedule's interval is the minimum spacing)
                since = time.perf_counter() - last[0]
                rounds_since = max(true_round - last[2], 1)
                if last[1] > fraction * since:
                    # the first grid point after the rounds still needed: plans stay on the schedule's grid
                    needed = max((last[1] / fraction - since) / (since / rounds_since), 1.0)
                    next_plan = schedule.next_plan_round(true_round + int(np.ceil(needed)))
                    self.timings["postponed_plans"] = self.timings.get("postponed_plans", 0) + 1
                    continue
                # and over the whole run: no re-plan (priced as the previous one) that would take the run's
                # planning past the fraction of its projected decode time (docs/methods.md §5)
                left = remaining_steps(run)
                done = max(engine.max_new_tokens - left, 1)
                projected = (time.perf_counter() - decode_start) * engine.max_new_tokens / done
                if self.timings["plan_s"] + last[1] > fraction * projected:
                    self.timings["plans_over_run_budget"] = 1
                    next_plan = None
                    break
            with jax.profiler.TraceAnnotation(PLAN_ANNOTATION):  # the whole plan, for profiles
                plan_start = time.perf_counter()
                state = run.state
                cache_lengths = np.asarray(state.target_cache.lengths)  # waits for the device work in flight
                host = {"device_in_flight": time.perf_counter() - plan_start}  # the controller's own parts of a plan
                if current["gamma"] == 0 or mark is None:
                    after_plain = plain_start is not None and next_plan == plain_start
                    mark = np.maximum(cache_lengths - (plain_start if after_plain else knapspec.ar_reference_tokens), 0)
                if knapspec.reference_floor is not None:  # at least this many tokens a row (earlier ones, the prompt's)
                    mark = np.minimum(mark, np.maximum(cache_lengths - int(knapspec.reference_floor), 0))
                window = reference_window(tokens, lengths, np.asarray(state.out), np.asarray(state.num_out),
                                          cache_lengths, mark, ref_cap, knapspec.token_bucket)
                mark = None
                if window is not None:
                    ref_tokens, token_mask, prefix = window
                    n = self.context_n if self.context_n is not None else effective_context(
                        config, cache_lengths, state.target_cache.capacity)
                    plan_cache = state.target_cache
                    kept = self.window_states if at_start and self.keeps_window_states() else None
                    from_plain = kept is None and run.kept_states is not None
                    if from_plain:  # the plain stretch that decoded the window kept its states
                        states, first, count = run.kept_states
                        count = np.asarray(count, np.int64)
                        kept = WindowStates(states, count, np.asarray(first, np.int64) + count)
                    run.kept_states = None
                    if knapspec.plan_rows is not None and int(knapspec.plan_rows) < batch:
                        rows = planning_rows(token_mask, np.asarray(state.done), int(knapspec.plan_rows))
                        ref_tokens, token_mask, prefix = ref_tokens[rows], token_mask[rows], prefix[rows]
                        plan_cache = cache_rows(plan_cache, rows)
                        kept = None if kept is None else kept.rows(rows)
                        jax.block_until_ready(plan_cache.keys)
                    window_states = None if kept is None else kept.for_window(token_mask, prefix)
                    host["window"] = time.perf_counter() - plan_start - host["device_in_flight"]
                    extra = {} if window_states is None else {"states": window_states}
                    plan, candidates, weights = planner.plan(run.target_params, config, plan_cache,
                                                             jnp.asarray(ref_tokens), jnp.asarray(token_mask),
                                                             jnp.asarray(prefix), n, **extra)
                    del plan_cache
                    applying = time.perf_counter()
                    apply_plan(plan.mask, plan.gamma if knapspec.honor_gamma else gamma_max)
                    search = knapspec.search_tokens
                    priced = plan_price(planner, config, n, knapspec, row_share, window_states is not None,
                                        two_stage=search is not None and ref_tokens.shape[1] > search)
                    # the allowance's prediction, as it priced the plan
                    cost = None if priced is None else priced[0] + priced[1] * ref_tokens.shape[1]
                    host["apply"] = time.perf_counter() - applying
                    self.records.append(PlanRecord(
                        true_round, plan, candidates, int(token_mask.sum()), weights, time.perf_counter() - plan_start,
                        gamma_used=current["gamma"], verify_rows=current["bucket"] + 1 if current["gamma"] else 1,
                        context_length=float(np.mean(cache_lengths + 1)), planner=planner.name,
                        predicted_seconds=cost, rows=int(ref_tokens.shape[0]), host_seconds=host,
                        states_from_prefill=window_states is not None and not from_plain,
                        states_from_plain=window_states is not None and from_plain))
                plan_end = time.perf_counter()
            self.timings["plan_s"] += plan_end - plan_start
            last = (plan_end, plan_end - plan_start, true_round)
            if window is not None and knapspec.probe and current["gamma"] > 0 and knapspec.honor_gamma:
                probe, probe_rounds = yield from arbitrate(n)
                true_round += probe_rounds
                self.records[-1].probe = probe
                if probe is not None and probe["choice"] == "ar":
                    self.records[-1].gamma_used, self.records[-1].verify_rows = 0, 1
            if plain_start is not None and next_plan == plain_start:  # a plan_interval of rounds after it
                next_plan = schedule.next_plan_round(true_round + knapspec.plan_interval)
                continue
            # after a plan at the start the schedule's own first grid point is skipped (its window would be
            # the few rounds since)
            next_plan = schedule.next_plan_round(max(true_round, schedule.plan_round if next_plan == 0 else 0) + 1)
        if not run.finished():
            true_round += yield from advance(None)
        if current["draft_state"] is not None:  # a plan made as the last rows finished: keep it in the state
            yield Chunk(rounds=0, gamma=current["bucket"], draft_state=take_draft_state(),
                        draft_policy=current["policy"])
        # compile plain decoding, whichever mode the timed run takes
        if run.warmup and (self.replan or self.probe_fixed) and knapspec.honor_gamma:
            yield Chunk(plain_steps=1)
        self.schedule_rounds = true_round

    def finish(self, run):
        counters, final = run.counters, run.state
        timings = dict(self.timings)
        timings["plan_fraction"] = timings["plan_s"] / max(run.timings["decode_s"], 1e-9)
        metrics = dict(ar_steps=counters.plain_steps, ar_tokens=counters.plain_tokens,
                       ar_intervals=counters.plain_stretches, schedule_rounds=self.schedule_rounds,
                       plain_chunk_seconds=counters.plain_seconds, round_chunk_seconds=counters.round_seconds,
                       chunk_log=[list(entry) for entry in counters.chunk_log],
                       gamma_buckets_used=sorted(self.buckets_used), honor_gamma=self.knapspec.honor_gamma,
                       knapspec_plans=[r.summary() for r in self.records], plan_allowance=self.allowance,
                       fixed_plan_probe=self.fixed_probe, choice_table=self.table_event,
                       draft_steps=int(final.draft_state["draft_steps"]),
                       static_plans=self.draft_policy is not None,
                       compiled_plans=len(counters.draft_policies),
                       final_skip_mask=np.asarray(final.draft_state["skip_mask"]).tolist())
        return metrics, timings
