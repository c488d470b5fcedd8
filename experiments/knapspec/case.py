"""One case of the ``knapspec`` experiment (:class:`Case`): a (task, prompt length, batch) prefilled once, every
method decoded from a copy of that cache after an AR run on another copy, and per case the DP's candidate plans,
the planner's cost and the DP attention check.

The driver that builds and runs the cases is ``experiment``; the timings a case takes beside its decode are in
``measure``, its model and prompts in ``model``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import Any, Dict, Optional

import numpy as np

from experiments.common import ResultWriter
from experiments.knapspec.flags import experiment_knapspec_config
from experiments.knapspec.measure import (DP_CHECK_ROW_BLOCKS, ar_run, auto_branch_chunk, budget_draft_times, dp_shape,
                                          forward_times, stretch_fit, timed_as)
from experiments.knapspec.model import Model, build_prompts


class Case:
    def __init__(self, args, model: Model, writer: ResultWriter, profile, task: str, context: int,
                 max_new: int, batch: int, static_plan):
        from jaxspec.knapspec.dp import skip_budget

        self.args, self.model, self.writer, self.task = args, model, writer, task
        self.context, self.max_new, self.batch = context, max_new, batch
        self.latency = profile.model
        self.latency_method = profile.method
        # the forward profile's forwards per timed call (the draft-step check times its forwards alike)
        self.profile_steps_per_call = int((getattr(profile, "forward", None) or {}).get("steps_per_call", 4))
        # and its second call length (0: the profile kept each call's fixed cost in its steps)
        self.profile_long_steps = int((getattr(profile, "forward", None) or {}).get("long_steps_per_call", 0))
        self.static_plan = static_plan
        self.key = f"{args.device_tag}/{task}/ctx{context}/b{batch}"
        cfg = model.config
        from jaxspec.models.attention import backend_of

        self.capacity = backend_of(cfg).round_capacity(context + max_new + args.gamma_max + 2)  # the kernels' blocks
        rows, reference = dp_shape(args, batch)
        chunk = args.branch_chunk
        if chunk is None and args.dp_attention == "xla":  # the kernel writes no scores: nothing to bound
            chunk = auto_branch_chunk(cfg, rows, self.capacity, reference, skip_budget(5, 1, cfg.num_layers) + 1)
        self.knapspec = experiment_knapspec_config(args, branch_chunk=chunk)
        self.prompts = build_prompts(model, task, context, batch, args.seed)
        self.prefilled = None
        self.window_states = None  # the prompt's last tokens' target states, kept by the prefill (plan_at_start)
        self.prefill_s = None
        self.ar_compiled = False
        self.last_ar = None

    def prefill(self):
        if self.prefilled is None:
            import jax

            from jaxspec.decoding.autoregressive import pad_prompts, prefill
            from jaxspec.models.cache import init_cache

            start = time.perf_counter()
            tokens, lengths = pad_prompts(self.prompts)
            cache = init_cache(self.model.config, self.batch, self.capacity)
            ks = self.knapspec
            if ks.plan_at_start and ks.start_states == "prefill":  # the plan at the start reads its window's states
                from jaxspec.knapspec.policy import prefill_window

                cache, logits, self.window_states = prefill_window(self.model.params, self.model.config, tokens,
                                                                   lengths, cache, ks.reference_floor,
                                                                   ks.token_bucket)
                self.prefilled = (cache, logits)
            else:
                self.prefilled = prefill(self.model.params, self.model.config, tokens, lengths, cache)
            jax.block_until_ready(self.prefilled)
            self.prefill_s = time.perf_counter() - start
            print(f"[{self.key}] prefilled {self.batch} x {self.context} tokens in "
                  f"{self.prefill_s:.1f} s", file=sys.stderr, flush=True)
        return self.prefilled

    def ar(self) -> Dict[str, Any]:
        prefilled = self.prefill()
        if not self.ar_compiled:
            ar_run(self.model, prefilled, self.max_new)  # compile
            self.ar_compiled = True
        self.last_ar = ar_run(self.model, prefilled, self.max_new)
        return self.last_ar

    def ar_tokens(self) -> np.ndarray:
        return (self.last_ar if self.last_ar is not None else self.ar())["tokens"]

    @staticmethod
    def time_split_measured(metrics, decode_s: float, plan_s: float, ar_step_s: float) -> Optional[Dict[str, Any]]:
        """The decode time as the engine's chunks measured it: plain-decoding stretches and speculative rounds
        (each chunk's wall time up to its own host read), planning, and the controller's rest; the plain steps'
        own step time against the paired AR run's."""
        plain, rounds = metrics.get("plain_chunk_seconds"), metrics.get("round_chunk_seconds")
        if plain is None or rounds is None:
            return None
        steps = metrics["ar_steps"]
        log = metrics.get("chunk_log") or []
        stretches = [(units, seconds) for kind, units, seconds in log if kind == "plain"]
        return {"how": "wall seconds inside the engine's chunks (each ended by its own host read); controller = "
                       "decode - plain stretches - rounds - planning",
                "plain_stretches_s": plain, "rounds_s": rounds, "plan_s": plan_s,
                "controller_s": decode_s - plain - rounds - plan_s, "plain_steps": steps,
                "plain_step_s": plain / steps if steps else None,
                "plain_step_over_ar_step": plain / steps / ar_step_s if steps and ar_step_s else None,
                "chunks": [{"kind": kind, "units": units, "seconds": seconds} for kind, units, seconds in log],
                "plain_stretches": len(stretches),
                "plain_stretch_fit": stretch_fit(stretches, ar_step_s)}

    @functools.cached_property
    def choice_table(self):
        """The ``--choice-table`` of the run (checked before the model loaded), or None."""
        from jaxspec.decoding.arbitration import ChoiceTable

        path = getattr(self.args, "choice_table", None)
        return ChoiceTable.load(path) if path else None

    def _generate(self, method: str, warmup: bool = True, **kwargs):
        from jaxspec.baselines.clasp import clasp_generate
        from jaxspec.baselines.static_skip import static_skip_generate
        from jaxspec.decoding.speculative import EngineConfig
        from jaxspec.knapspec.policy import knapspec_generate

        engine = EngineConfig(gamma=self.args.gamma_max, max_new_tokens=self.max_new, stop_tokens=())
        # random-weight shapes time paper contexts up to the model's limit plus the new tokens
        common = dict(engine=engine, seed=0, warmup=warmup, capacity=self.capacity, prefilled=self.prefill(),
                      allow_beyond_context=not self.model.real)
        ks = self.knapspec
        # the re-planning KnapSpec variants: the plan at the start's window states; the choice table (looked up
        # by the method's name) decides whether they plan at all (docs/methods.md §5.2)
        kept = dict(window_states=self.window_states, choice_table=self.choice_table, table_method=method)
        if method == "knapspec":
            return knapspec_generate(self.model.params, self.model.config, self.prompts, latency=self.latency,
                                     knapspec=ks, **common, **kept)
        if method == "knapspec-official":
            return knapspec_generate(self.model.params, self.model.config, self.prompts, latency=self.latency,
                                     knapspec=dataclasses.replace(ks, honor_gamma=False), **common, **kept)
        if method == "knapspec-tpl":
            return knapspec_generate(self.model.params, self.model.config, self.prompts, latency=self.latency,
                                     knapspec=dataclasses.replace(ks, objective="tpl"), **common, **kept)
        if method == "knapspec-coupled":
            return knapspec_generate(self.model.params, self.model.config, self.prompts, latency=self.latency,
                                     # the whole-layer DP runs its own scan: --dp-layers is the sub-layer DP's
                                     knapspec=dataclasses.replace(ks, coupled=True, dp_layers="scan"), **common, **kept)
        if method == "knapspec-target-ref":
            return knapspec_generate(self.model.params, self.model.config, self.prompts, latency=self.latency,
                                     knapspec=dataclasses.replace(ks, reference_kv="target"), **common, **kept)
        if method == "clasp":
            return clasp_generate(self.model.params, self.model.config, self.prompts,
                                  skip_count=self.args.clasp_skip_count, knapspec=ks, latency=self.latency, **common)
        if method == "static-skip":
            return static_skip_generate(self.model.params, self.model.config, self.prompts, plan=self.static_plan,
                                        knapspec=ks, **common)
        if method == "knapspec-budget":
            from jaxspec.knapspec.policy import knapspec_budget_generate

            sinks = self.args.attention_sinks
            return knapspec_budget_generate(self.model.params, self.model.config, self.prompts, latency=self.latency,
                                            sinks=sinks, window=self.args.attention_budget - sinks,
                                            reference_tokens=self.args.candidate_reference_tokens, knapspec=ks,
                                            engine=engine, seed=0, warmup=warmup, capacity=self.capacity,
                                            context_n=float(self.capacity), allow_beyond_context=not self.model.real)
        if method == "fixed":
            return knapspec_generate(self.model.params, self.model.config, self.prompts, knapspec=ks,
                                     replan=False, **common, **kwargs)
        raise ValueError(f"unknown method {method!r}")

    def run_method(self, method: str, **kwargs) -> Dict[str, Any]:
        """AR, then the method, on copies of the same prefilled cache."""
        import os

        load_before = list(os.getloadavg())
        ar = self.ar()
        result = self._generate(method, **kwargs)
        metrics = result.metrics
        timings = dict(result.timings)
        rounds = int(metrics["rounds"])
        plans = metrics["knapspec_plans"]
        final_mask = np.asarray(metrics["final_skip_mask"], bool)
        bucket = max(metrics.get("gamma_buckets_used") or [self.args.gamma_max])
        fwd = forward_times(self.model, self.prefill(), final_mask, bucket + 1,
                            steps_per_call=self.profile_steps_per_call, long_steps_per_call=self.profile_long_steps)
        budget = metrics.get("budget_plan") if method == "knapspec-budget" else None
        if budget:  # the draft runs the plan's dense / budgeted / skipped sub-layers, not a skip mask
            fwd.update(budget_draft_times(self.model, self.prefill(), budget["codes"], budget["sinks"],
                                          budget["window"], steps_per_call=self.profile_steps_per_call,
                                          long_steps_per_call=self.profile_long_steps))
        draft_est = metrics["draft_steps"] * fwd["draft_forward_budget_s" if budget else "draft_forward_s"]
        verify_est = rounds * fwd["verify_forward_s"]
        ar_est = metrics["ar_steps"] * ar["step_s"]
        plan_s = timings.get("plan_s", 0.0)
        decode_s = timings["decode_s"]
        out = {
            "method": method, "tokens_per_s": result.tokens_per_s, "ar_tokens_per_s": ar["tokens_per_s"],
            "speedup_vs_ar": result.tokens_per_s / ar["tokens_per_s"],
            "identical_to_ar": bool(np.array_equal(np.asarray(result.tokens), ar["tokens"])),
            "tau": metrics["tau"], "acceptance_rate": metrics["acceptance_rate"], "rounds": rounds,
            "draft_steps": metrics["draft_steps"], "ar_steps": metrics["ar_steps"], "ar_tokens": metrics["ar_tokens"],
            "gamma_buckets_used": metrics.get("gamma_buckets_used"), "honor_gamma": metrics.get("honor_gamma"),
            "static_plans": metrics.get("static_plans"), "compiled_plans": metrics.get("compiled_plans"),
            "dp_branch_chunk": self.knapspec.branch_chunk,  # branches per attention batch of the DP (None: all)
            "plans": [{k: p.get(k) for k in ("round", "context_length", "n", "n_skip_attn", "n_skip_mlp",
                                            "skip_attn", "skip_mlp", "gamma_star", "gamma_used", "mode",
                                            "alpha", "p_c", "p_ac", "predicted_tpt", "t_attn", "t_mlp", "t_token",
                                            "verify_row_cost", "seconds", "predicted_seconds", "probe",
                                            "reference_tokens", "candidates", "w_attn", "w_mlp", "planner",
                                            "stage_seconds", "dp_attention", "rescore", "states_from_prefill",
                                            "states_from_plain")}
                      for p in plans],
            "final_skip": {"n_skip_attn": int(final_mask[:, 0].sum()), "n_skip_mlp": int(final_mask[:, 1].sum())},
            "timings": timings, "ar_decode_s": ar["decode_s"], "ar_step_s": ar["step_s"],
            "plan_fraction_of_decode": plan_s / max(decode_s, 1e-9),
            "prefill": {"s": self.prefill_s, "window_states": self.window_states is not None},
            "plan_allowance": metrics.get("plan_allowance"),
            "choice_table": metrics.get("choice_table"),
            "time_split_estimate": {
                "how": "planning measured; draft = draft forwards x one draft forward with the final mask (a "
                       "budget plan: with its codes); verify = "
                       "rounds x one verification forward (largest bucket used); plain decoding = AR-interval "
                       "steps x AR step; other = the rest",
                "plan_s": plan_s, "draft_s": draft_est, "verify_s": verify_est, "ar_interval_s": ar_est,
                "other_s": decode_s - plan_s - draft_est - verify_est - ar_est, **fwd},
            "time_split_measured": self.time_split_measured(metrics, decode_s, plan_s, ar["step_s"]),
            "predicted_ar_step_s": self.latency.t_plain(self.capacity, self.model.config.num_layers),
            "latency_prediction": self.latency_prediction(final_mask, bucket + 1, metrics, rounds, decode_s - plan_s,
                                                          budget=budget),
            "draft_step_check": (self.budget_draft_step_check(budget, fwd) if budget
                                 else self.draft_step_check(final_mask, fwd)),
            "load_average_before": load_before,
        }
        if method == "clasp":
            out["clasp_skip_count"] = metrics.get("clasp_skip_count")
        if method == "knapspec-budget":
            out["budget_plan"] = metrics["budget_plan"]
            out["fixed_plan_probe"] = metrics.get("fixed_plan_probe")  # the plan against plain decoding, at the start
        if getattr(self.args, "trace", False):  # one more (compiled) run of each, under the profiler
            from experiments.trace import trace_or_error

            out["trace"] = {
                "ar": trace_or_error(lambda: ar_run(self.model, self.prefill(), self.max_new), f"[{self.key}] trace ar"),
                method: trace_or_error(lambda: self._generate(method, warmup=False, **kwargs),
                                       f"[{self.key}] trace {method}")}
        return out

    def latency_prediction(self, mask, verify_rows: int, metrics, rounds: int, measured_s: float,
                           budget: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The latency model's step times at the cache capacity (what the planner used: the xla
        backend reads every slot) and its decode time for the counted forwards (draft forwards with
        ``mask``, every round verifying ``verify_rows`` rows, AR-interval steps), vs the measured
        decode time less planning."""
        from jaxspec.knapspec.planner import draft_time

        m, L, n = self.latency, self.model.config.num_layers, float(self.capacity)
        step = m.t_step(n, L)
        if budget:
            from jaxspec.knapspec.budgeted import plan_draft_time

            draft = float(plan_draft_time(budget["codes"], m, n, budget["sinks"] + budget["window"]))
        else:
            draft = float(draft_time(np.asarray(mask, bool), m.t_attn(n), m.t_mlp(), m.t_token(n)))
        verify = step * (m.a + m.v * (verify_rows - 1))
        total = metrics["draft_steps"] * draft + rounds * verify + metrics["ar_steps"] * m.t_plain(n, L)
        return {"method": self.latency_method, "n": n, "step_s": step, "draft_step_s": draft,
                "verify_s": verify, "verify_rows": int(verify_rows), "decode_s": total,
                "measured_decode_minus_plan_s": measured_s, "ratio_measured_to_predicted": measured_s / total
                if total > 0 else None}

    def draft_step_check(self, mask, fwd: Dict[str, float]) -> Dict[str, Any]:
        """One draft forward of ``mask``, measured with the dynamic mask and with the static
        (executed sub-layers only) variant, against the latency model's draft time for the plan at
        the cache capacity (:func:`~jaxspec.knapspec.planner.draft_time`): the ratios measured /
        predicted (target: within 10 %)."""
        from jaxspec.knapspec.planner import draft_time

        m, n = self.latency, float(self.capacity)
        mask = np.asarray(mask, bool)
        predicted = float(draft_time(mask, m.t_attn(n), m.t_mlp(), m.t_token(n)))
        # timed as the profile was measured and as the draft loop runs: several forwards per jitted call
        dynamic, static = fwd["draft_step_in_loop_s"], fwd["draft_step_static_in_loop_s"]
        single_dynamic, single_static = fwd["draft_forward_s"], fwd["draft_forward_static_s"]
        ratio = (lambda t: t / predicted if predicted > 0 else None)
        return {"n": n, "n_skip_attn": int(mask[:, 0].sum()), "n_skip_mlp": int(mask[:, 1].sum()),
                "predicted_s": predicted, "timed": timed_as(fwd),
                "dynamic_s": dynamic, "static_s": static,
                "dynamic_over_predicted": ratio(dynamic), "static_over_predicted": ratio(static),
                "static_within_10pct": bool(predicted > 0 and abs(static / predicted - 1) <= 0.10),
                "single_call_dynamic_s": single_dynamic, "single_call_static_s": single_static,
                "single_call_static_over_predicted": ratio(single_static)}

    def budget_draft_step_check(self, budget: Dict[str, Any], fwd: Dict[str, float]) -> Dict[str, Any]:
        """One draft forward of a budget plan (its dense / budgeted / skipped sub-layers compiled in)
        against the latency model's time for it at the cache capacity
        (:func:`~jaxspec.knapspec.budgeted.plan_draft_time`)."""
        from jaxspec.knapspec.budgeted import plan_draft_time

        predicted = float(plan_draft_time(budget["codes"], self.latency, float(self.capacity),
                                          budget["sinks"] + budget["window"]))
        timed, single = fwd["draft_step_budget_in_loop_s"], fwd["draft_forward_budget_s"]
        ratio = (lambda t: t / predicted if predicted > 0 else None)
        return {"plan": "budget", "n": float(self.capacity), "n_dense_attn": budget.get("n_dense_attn"),
                "n_budget_attn": budget.get("n_budget_attn"), "n_skip_attn": budget.get("n_skip_attn"),
                "n_skip_mlp": budget.get("n_skip_mlp"), "predicted_s": predicted,
                "timed": timed_as(fwd), "static_s": timed,
                "static_over_predicted": ratio(timed),
                "static_within_10pct": bool(predicted > 0 and abs(timed / predicted - 1) <= 0.10),
                "single_call_static_s": single, "single_call_static_over_predicted": ratio(single)}

    # ------------------------------------------------------------------------ candidates
    def candidates(self) -> Dict[str, Any]:
        """The DP on the case's text: reference = the first ``--candidate-reference-tokens`` (16) AR tokens
        of each row (at the prompt's end). ``plan_share_of_ar_decode``: one (compiled) plan's seconds over
        the AR decode of the case's new tokens."""
        import jax.numpy as jnp

        from jaxspec.knapspec.dp import REFERENCE_KV, boundary_states, plan_alpha
        from jaxspec.knapspec.planner import objective_table
        from jaxspec.knapspec.policy import exit_threshold, plan_skip_set

        prefilled = self.prefill()
        r = min(self.args.candidate_reference_tokens, self.max_new)
        tokens = jnp.asarray(self.ar_tokens()[:, :r], jnp.int32)
        token_mask = jnp.ones(tokens.shape, jnp.float32)
        prefix = jnp.asarray([len(p) for p in self.prompts], jnp.int32)
        n = float(self.capacity)  # the xla backend reads every slot
        start = time.perf_counter()
        plan, cands, weights = plan_skip_set(self.model.params, self.model.config, prefilled[0], tokens, token_mask,
                                             prefix, self.latency, n, self.knapspec)
        first = time.perf_counter() - start
        start = time.perf_counter()
        plan_skip_set(self.model.params, self.model.config, prefilled[0], tokens, token_mask, prefix, self.latency,
                      n, self.knapspec)
        steady = time.perf_counter() - start
        gammas = tuple(range(1, self.args.gamma_max + 1))
        # each candidate's TPT as the planner's grid search prices it: with the draft's early exit modelled
        # from the DP's confidence statistics where the planner models it (planner module doc), so the
        # correlation is that of the prediction the plan is chosen by; the exit-free TPT of §4.2 beside it
        exits = (cands.confident, cands.agree_confident) if exit_threshold(self.knapspec) is not None \
            and cands.confident is not None else None
        table_args = (cands.masks, cands.alpha, self.latency.t_attn(n), self.latency.t_mlp(), gammas, "tpt",
                      self.latency.t_token(n), self.latency.v, self.latency.a)
        table = objective_table(*table_args, exit_stats=exits)
        plain_table = objective_table(*table_args)
        # every candidate's acceptance estimate under both references of the DP (docs/methods.md §4.3)
        states = boundary_states(self.model.params, self.model.config, tokens, prefilled[0], prefix)
        by_reference = {mode: plan_alpha(self.model.params, self.model.config, prefilled[0], prefix, states,
                                         cands.masks, token_mask, reference_kv=mode) for mode in REFERENCE_KV}
        rows = []
        for c in range(len(cands)):
            g = int(np.argmax(table[c]))
            exit_stats = {} if exits is None else {"p_c": float(exits[0][c]), "p_ac": float(exits[1][c])}
            rows.append({"index": c, "weight": int(cands.weights[c]), "alpha": float(cands.alpha[c]),
                         **{f"alpha_{mode}": float(a[c]) for mode, a in by_reference.items()},
                         "cosine": float(cands.cosine[c]), "gamma": gammas[g], "predicted_tpt": float(table[c, g]),
                         "exit_aware_tpt": exits is not None, **exit_stats,
                         "predicted_tpt_no_exit": float(plain_table[c, g]),
                         "n_skip_attn": int(cands.masks[c, :, 0].sum()), "n_skip_mlp": int(cands.masks[c, :, 1].sum()),
                         "mask": cands.masks[c].tolist()})
        ar_decode = (self.last_ar or self.ar())["decode_s"]
        return {"plan": plan.summary(), "weights": list(weights), "reference_tokens": r * self.batch,
                "reference_tokens_per_row": r, "plan_first_call_s": first, "plan_s": steady,
                "ar_decode_s": ar_decode, "ar_new_tokens": self.max_new, "plan_share_of_ar_decode": steady / ar_decode,
                "candidates": rows}

    def plan_cost(self, repeats: int) -> Dict[str, Any]:
        """Planner seconds (reference states + DP + grid search) without / with the stacked-weights reuse,
        interleaved, on the reference window of :meth:`candidates`."""
        import jax
        import jax.numpy as jnp

        from jaxspec.knapspec.dp import boundary_states, knapsack_dp, knapsack_weights
        from jaxspec.knapspec.planner import choose_plan

        prefilled = self.prefill()
        r = min(self.args.candidate_reference_tokens, self.max_new)
        tokens = jnp.asarray(self.ar_tokens()[:, :r], jnp.int32)
        token_mask = jnp.ones(tokens.shape, jnp.float32)
        prefix = jnp.asarray([len(p) for p in self.prompts], jnp.int32)
        n = float(self.capacity)
        w_attn, w_mlp = knapsack_weights(self.latency.t_attn(n), self.latency.t_mlp())
        cfg = self.model.config

        def plan(reuse: bool):
            start = time.perf_counter()
            states = boundary_states(self.model.params, cfg, tokens, prefilled[0], prefix)
            cands = knapsack_dp(self.model.params, cfg, prefilled[0], prefix, states, token_mask, w_attn=w_attn,
                                w_mlp=w_mlp, branch_chunk=self.knapspec.branch_chunk, reuse_stacked=reuse,
                                reference_kv=self.knapspec.reference_kv)
            choose_plan(cands.masks, cands.alpha, self.latency, n, gammas=self.knapspec.plan_gammas)
            jax.block_until_ready(cands.alpha)
            return time.perf_counter() - start

        plan(False)
        plan(True)
        times = {"restack_each_plan_s": [], "reuse_stacked_s": []}
        for _ in range(repeats):
            times["restack_each_plan_s"].append(plan(False))
            times["reuse_stacked_s"].append(plan(True))
        return {"reference_tokens": r * self.batch, "w_attn": w_attn, "w_mlp": w_mlp, **times,
                "median_restack_s": float(np.median(times["restack_each_plan_s"])),
                "median_reuse_s": float(np.median(times["reuse_stacked_s"]))}


    def dp_attention_check(self, repeats: int) -> Dict[str, Any]:
        """The DP of this run's planning shape (its plan rows, its search tokens or
        ``--candidate-reference-tokens``; the prompts' last tokens as the window, as a plan at the start
        makes it) with the reference attention and with ``--dp-attention``'s kernel, interleaved
        ``repeats`` times after a warm-up of each: the DP's seconds and whether the two agree (trace,
        masks, values, alphas; docs/methods.md §4.3)."""
        import jax.numpy as jnp

        from jaxspec.knapspec.dp import boundary_states, knapsack_dp, knapsack_weights
        from jaxspec.knapspec.policy import cache_rows, dp_history_backend

        cache = self.prefill()[0]
        folded = dp_history_backend(self.knapspec)
        rows = list(range(min(int(self.knapspec.plan_rows or self.batch), self.batch)))
        width = int(self.knapspec.search_tokens or self.args.candidate_reference_tokens)
        lengths = np.asarray([len(self.prompts[b]) for b in rows])
        tokens = jnp.asarray(np.stack([np.asarray(self.prompts[b][n - width:n]) for b, n in zip(rows, lengths)]),
                             jnp.int32)
        prefix = jnp.asarray(lengths - width, jnp.int32)
        if len(rows) < self.batch:
            cache = cache_rows(cache, rows)
        cfg = self.model.config
        states = boundary_states(self.model.params, cfg, tokens, cache, prefix)
        n = float(self.capacity)
        w_attn, w_mlp = knapsack_weights(self.latency.t_attn(n), self.latency.t_mlp())

        def dp(backend, rows_per_call=None):
            start = time.perf_counter()
            cands = knapsack_dp(self.model.params, cfg, cache, prefix, states, None, w_attn=w_attn, w_mlp=w_mlp,
                                reference_kv=self.knapspec.reference_kv, history_backend=backend,
                                history_rows=rows_per_call)
            return time.perf_counter() - start, cands  # knapsack_dp returns host arrays: the DP has finished

        def agreement(got, ref):
            valid, same_shape = ref.trace.valid, got.masks.shape == ref.masks.shape
            same_valid = bool(np.array_equal(got.trace.valid, valid))
            return {"same_valid": same_valid, "same_masks": bool(same_shape and np.array_equal(got.masks, ref.masks)),
                    "max_value_diff": float(np.max(np.abs(got.trace.values[valid] - ref.trace.values[valid])))
                    if same_valid and valid.any() else None,
                    "max_alpha_diff": float(np.max(np.abs(got.alpha - ref.alpha))) if same_shape else None}

        _, ref = dp(None)
        _, got = dp(folded)
        times = {"reference_s": [], "folded_s": []}
        for _ in range(repeats):
            times["reference_s"].append(dp(None)[0])
            times["folded_s"].append(dp(folded)[0])
        # the kernel's rows per call (each call reads the cache once): larger blocks than its default, each
        # compiled and checked first; a block the device cannot hold is recorded, not fatal
        blocks = {}
        for rows_per_call in DP_CHECK_ROW_BLOCKS:
            try:
                _, other = dp(folded, rows_per_call)
                seconds = [dp(folded, rows_per_call)[0] for _ in range(repeats)]
            except Exception as err:  # noqa: BLE001 -- a compile or resource error of this block size
                blocks[str(rows_per_call)] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                continue
            blocks[str(rows_per_call)] = {"seconds": seconds, "median_s": float(np.median(seconds)),
                                          **agreement(other, ref)}
        return {"dp_attention": folded, "rows": len(rows), "search_tokens": width, "budget": ref.budget,
                "w_attn": w_attn, "w_mlp": w_mlp, **times,
                "median_reference_s": float(np.median(times["reference_s"])),
                "median_folded_s": float(np.median(times["folded_s"])), **agreement(got, ref),
                "kernel_rows_per_call": blocks}
