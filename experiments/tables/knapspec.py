"""KnapSpec end to end (``knapspec/*.json``): speed-up over AR and where the time goes.

* the real Qwen2.5-Coder-1.5B on the H200 and an H100, on XLA and the Pallas kernels, against its baselines, and
  the traced runs (:func:`knapspec_real_note`);
* a plan's draft step against the latency model (:func:`knapspec_draft_step_note`, which quotes figures);
* the comparison tables of every run (:func:`knapspec_comparison`, :func:`knapspec_tables`) and self-speculative
  sparse verification on the CPU (:func:`selfspec_table`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from experiments.tables import inputs
from experiments.tables.figures import v
from experiments.tables.inputs import (KNAPSPEC_64REF, KNAPSPEC_DP_PALLAS, KNAPSPEC_EARLY, KNAPSPEC_PALLAS,
                                       KNAPSPEC_PALLAS_B1, KNAPSPEC_PALLAS_B16_HALF_FIT, KNAPSPEC_PALLAS_B16_PER_STEP,
                                       KNAPSPEC_PALLAS_B1_AT_START_1_FINALIST, KNAPSPEC_PALLAS_B1_AT_START_UNROLLED,
                                       KNAPSPEC_PALLAS_B1_AT_START_UNROLLED_CAP2, KNAPSPEC_PALLAS_B16_2ROWS_UNROLLED,
                                       KNAPSPEC_PALLAS_B16_2ROWS_UNROLLED_CAP2, KNAPSPEC_PALLAS_B1_H100,
                                       KNAPSPEC_PALLAS_B1_AT_START_CAP2_TABLE, KNAPSPEC_PALLAS_B16_2ROWS_CAP2_TABLE,
                                       KNAPSPEC_PALLAS_STATIC_TABLE_H200,
                                       KNAPSPEC_PALLAS_B1_H100_AFTER_PLAIN, KNAPSPEC_PALLAS_B1_H100_PROBE_WARMUP,
                                       KNAPSPEC_PALLAS_B1_H100_PROBE_WARMUP_SELECT, KNAPSPEC_PALLAS_B1_H100_TWO_STRETCH,
                                       KNAPSPEC_PALLAS_B1_H200_TWO_STRETCH, KNAPSPEC_PALLAS_B1_HALF_FIT,
                                       KNAPSPEC_PALLAS_B1_KEPT_STATES, KNAPSPEC_PALLAS_B1_KEPT_STATES_768,
                                       KNAPSPEC_PALLAS_B1_PER_STEP, KNAPSPEC_PALLAS_STATIC, KNAPSPEC_PLAN_ROWS,
                                       KNAPSPEC_PLAN_TRACES, KNAPSPEC_REAL, KNAPSPEC_REAL_BASELINES, KNAPSPEC_RUNS,
                                       KNAPSPEC_TPT_CORRELATION, KNAPSPEC_TWO_STAGE, KNAPSPEC_VARIANTS, PAIR_SPEED_SELF,
                                       PLAN_STAGES, SELFSPEC_CPU, TPT_CORRELATION_CONTEXTS, split_csv)
from experiments.tables.knapspec_plans import fixed_cases, plan_stage_names
from experiments.tables.pair_speed import pair_cases


def _draft_step_checks():
    """``(file, case key, draft_step_check)`` of every real-1.5B H200 KnapSpec case that timed a draft step."""
    sources = list(KNAPSPEC_REAL.values()) + [KNAPSPEC_TWO_STAGE, KNAPSPEC_PLAN_ROWS]
    for source in sources:
        if not (inputs.RESULTS / source).exists():
            continue
        for key, case in inputs.load(source)["cases"].items():
            check = case.get("draft_step_check") if isinstance(case, dict) else None
            if check and check.get("static_over_predicted"):
                yield source, key, check


def knapspec_draft_step_note() -> str:
    """A draft step of a plan against the latency model's prediction, on the H200 with the real 1.5B."""
    checks = list(_draft_step_checks())
    if not checks:
        return "A plan's draft step against the latency model on the H200: not measured yet."
    static = [c["static_over_predicted"] for _, _, c in checks]
    dynamic = [c["dynamic_over_predicted"] for _, _, c in checks if c.get("dynamic_over_predicted")]
    inside = sum(abs(x - 1) <= 0.1 for x in static)
    batches: Dict[str, List[float]] = {}
    for _, key, c in checks:
        batches.setdefault(key.split("/")[3], []).append(c["static_over_predicted"])
    by_batch = "; ".join(f"batch {b[1:]} {min(x):.2f}-{max(x):.2f}x ({sum(abs(y - 1) <= 0.1 for y in x)} of {len(x)} "
                         "within 10 %)" for b, x in sorted(batches.items(), key=lambda kv: int(kv[0][1:])))
    cpu = ""
    if (inputs.RESULTS / KNAPSPEC_64REF).exists():
        data = inputs.load(KNAPSPEC_64REF)
        cpu_checks = [c["draft_step_check"] for c in fixed_cases(data)]
        static_cpu = [c["static_over_predicted"] for c in cpu_checks]
        timed = {c.get("timed", "one forward per jitted call") for c in cpu_checks}
        single = [c["single_call_static_over_predicted"] for c in cpu_checks if c.get("single_call_static_over_predicted")]
        cpu = (" On the CPU (SmolLM2, the fixed candidate plans, `" + KNAPSPEC_64REF + "`, timed "
               + " / ".join(sorted(timed)) + ") the median static step is "
               f"{v('knapspec/plans/smollm2-135m/ctx1024/b1/cpu/64ref/static-draft-step-over-predicted')} the "
               f"prediction, {sum(abs(x - 1) <= 0.1 for x in static_cpu)} of {len(static_cpu)} plans within 10 % "
               f"({min(static_cpu):.2f}-{max(static_cpu):.2f}x; figure "
               "`knapspec/plans/smollm2-135m/ctx1024/b1/cpu/64ref/static-draft-step-over-predicted`)"
               + (f"; timed one forward per jitted call, as the GPU cases above were, the same plans measure "
                  f"{min(single):.2f}-{max(single):.2f}x: a call that returns only the logits lets XLA drop the "
                  "forward's cache writes and pays its own dispatch, where the draft loop and the latency profile "
                  "write the cache inside one compiled loop"
                  if single else "") + ".")
    cpu += _draft_step_in_loop_cpu()
    gpu_timed = {c.get("timed", "one forward per jitted call") for _, _, c in checks}
    return (f"One draft step of each case's plan (the final skip set; docs/methods.md §5.3) against the latency "
            f"model's prediction on the H200, real Qwen2.5-Coder-1.5B bf16, {len(checks)} cases at batch 1 and 16, "
            f"8k-32k, timed {' / '.join(sorted(gpu_timed))}: with the plan compiled in (static, executed sub-layers "
            f"only) {min(static):.2f}-{max(static):.2f}x"
            f", {inside} of {len(static)} within 10 % (**{'met' if inside == len(static) else 'missed'}** on the "
            f"GPU)" + (f"; by batch: {by_batch}" if by_batch else "") + f"; with the dynamic mask (a lax.cond per "
            f"sub-layer) {min(dynamic):.2f}-{max(dynamic):.2f}x." + _draft_step_in_loop_gpu()
            + _draft_step_static_profile_gpu() + cpu)


def _draft_step_static_profile_gpu() -> str:
    """The static-plan run whose latency profile was fitted on forwards with each mask compiled in: its plans' draft
    steps (compiled for the plan, in a loop of 4 forwards) against that profile's prediction."""
    if not (inputs.RESULTS / KNAPSPEC_PALLAS_STATIC).exists():
        return ""
    checks = [(key, c["draft_step_check"]) for key, c in inputs.load(KNAPSPEC_PALLAS_STATIC)["cases"].items()
              if isinstance(c, dict) and c.get("draft_step_check", {}).get("static_over_predicted")]
    if not checks:
        return ""
    ratios = [c["static_over_predicted"] for _, c in checks]
    inside = sum(abs(x - 1) <= 0.1 for x in ratios)
    timed = sorted({c.get("timed", "one forward per jitted call") for _, c in checks})
    return (f" With the latency profile fitted on forwards with each plan's mask compiled in (`--latency-fit "
            f"forward-static`, `{KNAPSPEC_PALLAS_STATIC}`, batch 16, 8k-32k, skip plans and budgeted-attention "
            f"plans, timed {' / '.join(timed)}): {min(ratios):.2f}-{max(ratios):.2f}x, {inside} of {len(ratios)} "
            f"within 10 % (**{'met' if inside == len(ratios) else 'missed'}** for this profile on the GPU; the "
            "cases above were priced by each run's `--latency-fit forward` profile, fitted on forwards with the "
            "dynamic mask).")


def _draft_step_in_loop_cpu() -> str:
    """The CPU correlation run's fixed plans, each draft step timed inside a compiled loop of forwards."""
    if not (inputs.RESULTS / KNAPSPEC_TPT_CORRELATION).exists():
        return ""
    data = inputs.load(KNAPSPEC_TPT_CORRELATION)
    parts, static_all = [], []
    for ctx in TPT_CORRELATION_CONTEXTS:
        checks = [c["draft_step_check"] for c in fixed_cases(data, f"cpu/summarize/ctx{ctx}/b1/fixed/")
                  if "draft_step_check" in c]
        if not checks:
            continue
        static = [c["static_over_predicted"] for c in checks]
        dynamic = [c["dynamic_over_predicted"] for c in checks]
        static_all += static
        parts.append(f"{ctx // 1024}k: static {min(static):.2f}-{max(static):.2f}x ({sum(abs(x - 1) <= 0.1 for x in static)} "
                     f"of {len(static)} within 10 %), dynamic {min(dynamic):.2f}-{max(dynamic):.2f}x")
    if not parts:
        return ""
    inside = sum(abs(x - 1) <= 0.1 for x in static_all)
    return (" Timed inside a compiled loop of 4 forwards, as the draft loop and the latency profile run them "
            f"(the TPT-correlation run's fixed plans, `{KNAPSPEC_TPT_CORRELATION}`): " + "; ".join(parts)
            + f" (**{'met' if inside == len(static_all) else 'missed'}** on the CPU: {inside} of {len(static_all)}; "
            "figures `knapspec/plans/smollm2-135m/ctx{1024,2048}/b1/cpu/in-loop/...`). The decode step writes its "
            "cache in place (docs/methods.md §2), so a static plan's step is its executed sub-layers' bytes.")


def _draft_step_in_loop_gpu() -> str:
    """The H200 cases whose draft-step check timed the plan's forward inside the compiled draft loop."""
    if not (inputs.RESULTS / KNAPSPEC_DP_PALLAS).exists():
        return ""
    looped = [(key, c["draft_step_check"]) for key, c in inputs.load(KNAPSPEC_DP_PALLAS)["cases"].items()
              if isinstance(c, dict) and (c.get("draft_step_check") or {}).get("timed", "").startswith("4 forwards")]
    if not looped:
        return ""
    inside = sum(abs(c["static_over_predicted"] - 1) <= 0.1 for _, c in looped)
    return (f" Timed as the draft loop runs it ({looped[0][1]['timed']}, `{KNAPSPEC_DP_PALLAS}`, batch 16, each "
            "plan skipping one MLP): " + "; ".join(
                f"{int(key.split('/')[2][3:]) // 1000}k static {c['static_over_predicted']:.2f}x, dynamic "
                f"{c['dynamic_over_predicted']:.2f}x (one forward per call: static "
                f"{c['single_call_static_over_predicted']:.2f}x)" for key, c in looped)
            + f"; {inside} of {len(looped)} static steps within 10 %. The other H200 cases are not re-measured "
              "this way yet.")


def knapspec_real_note() -> str:
    """The real Qwen2.5-Coder-1.5B on the H200: what KnapSpec did at each measured point and why."""
    parts = []
    for batch, source in KNAPSPEC_REAL.items():
        if not (inputs.RESULTS / source).exists():
            continue
        cases = inputs.load(source)["cases"]
        for key, ks in cases.items():
            _, _, ctx, _, method = key.split("/")
            if method != "knapspec":
                continue
            a = ks["plan_allowance"]
            clasp = cases.get(key.replace("/knapspec", "/clasp"))
            text = f"{ctx[3:]} tokens, batch {batch}: KnapSpec {ks['speedup_vs_ar']:.2f}x AR"
            if a.get("skip"):
                text += (f" with no plan (the allowance predicted {1e3 * a['predicted_dp_s_per_token']:.1f} ms of DP "
                         f"per reference token against a {1e3 * a['plan_budget_s']:.0f} ms budget: "
                         f"{a['allowed_tokens']} tokens, under the minimum of 8, so it decoded plainly)")
            elif ks.get("plans"):
                p = ks["plans"][0]
                text += (f" (planned after round {p['round']} on {p['reference_tokens']} reference tokens, "
                         f"{1e3 * p['seconds']:.0f} ms against {1e3 * p['predicted_seconds']:.0f} ms predicted, "
                         f"planning {100 * ks['plan_fraction_of_decode']:.1f} % of decode; best candidate skipping "
                         f"{p['n_skip_attn']} Attention / {p['n_skip_mlp']} MLP sub-layers, gamma* = {p['gamma_star']}"
                         + (": plain decoding after the full-model rounds before the plan" if p["gamma_star"] == 0
                            else "") + ")")
            if clasp:
                text += (f"; CLaSp {clasp['speedup_vs_ar']:.2f}x (tau {clasp['tau']:.2f}, its draft step "
                         f"{clasp['draft_step_check']['static_over_predicted']:.2f}x the latency model's prediction)")
            parts.append(text)
    if not parts:
        return "Real Qwen2.5-Coder-1.5B on the H200: not measured yet (suite h200-knapspec)."
    data = inputs.load(KNAPSPEC_REAL[1])
    price = ""
    profile = data.get("latency_b1")  # the profile this file planned with (the file on disk may be newer)
    if profile:
        fwd = profile.get("forward", {})
        if "bulk_contexts" in fwd:
            price = (f" The DP's price per reference token is its slot rows (skip budget + 1) times the "
                     f"many-row price at the context, t_row(n) = u + u_n n (docs/methods.md §4.1), from "
                     f"forwards of {fwd['bulk_rows']} rows at {fwd['bulk_contexts']} tokens: "
                     + ", ".join(f"{1e3 * u:.3f} ms a row at {n}" for n, u in
                                 zip(fwd['bulk_contexts'], fwd['fit']['u_per_context'])) + ".")
        elif fwd.get("bulk_rows"):
            rows_times = ", ".join(f"{n} rows {1e3 * t:.1f} ms" for n, t in zip(fwd["bulk_rows"], fwd["bulk_times"]))
            price = (f" The DP's price per reference token is the slope `u` of many-row forwards (docs/methods.md "
                     f"§4.1) times its slot rows (skip budget + 1): u = {1e3 * profile['fit']['u']:.3f} ms a row, "
                     f"from forwards at the profile's largest context ({fwd['verify_context']} tokens: {rows_times}), "
                     "where every row's attention over the whole context is most of the cost. The same price is "
                     "applied at every context, so at 8k-16k, where a row reads less context, the allowance "
                     "probably overprices the DP (many-row forwards at those contexts are not timed) and may skip "
                     "planning that would have fitted. The profile now prices a row per context, "
                     "t_row(n) = u + u_n n from many-row forwards at its smallest and largest contexts (docs/methods.md "
                     "§4.1); this file was planned before that (the two-stage run below planned with the profile "
                     "measured again).")
    missing = []
    for batch, source in KNAPSPEC_REAL.items():
        cases = inputs.load(source)["cases"] if (inputs.RESULTS / source).exists() else {}
        measured = {key.split("/")[2] + "/" + key.split("/")[4] for key in cases}
        gone = [f"{m} at {round(c / 1000)}k" for c in (8192, 16384, 32000)
                for m in ("knapspec", "knapspec-target-ref", "clasp") if f"ctx{c}/{m}" not in measured]
        if gone:
            missing.append(", ".join(gone) + f" at batch {batch}" + (
                " (the step ran out of its 10 minutes before 32k)" if cases and batch == 16 else ""))
    return ("Real Qwen2.5-Coder-1.5B on the H200 (bf16, 256 new tokens; `" + "`, `".join(
                s for s in KNAPSPEC_REAL.values() if (inputs.RESULTS / s).exists()) + "`): "
            + "; ".join(parts) + "." + price + (" Not measured yet: " + "; ".join(missing) + "." if missing else "")
            + " " + _knapspec_real_baselines() + " " + _knapspec_attention_backend_note())


def _knapspec_attention_backend_note() -> str:
    """The knapspec runs' AR step (the reference attention unless the file names a backend) against pair-speed's
    AR on the Pallas kernel, at 32k/b16."""
    ks = KNAPSPEC_REAL_BASELINES[1][1]
    if not (inputs.RESULTS / ks).exists() or not (inputs.RESULTS / PAIR_SPEED_SELF[0]).exists():
        return ""
    data = inputs.load(ks)
    case = next((c for k, c in data["cases"].items() if "/ctx32000/b16/" in k and c.get("ar_step_s")), None)
    pair = dict(pair_cases(PAIR_SPEED_SELF[0])).get("ctx32000/b16")
    if case is None or pair is None:
        return ""
    pair_step = 1e3 / (pair["ar"]["tok_s_mean"] / pair["batch"])
    backend = data["config"].get("attention_backend", "auto")
    return (f"These KnapSpec runs decode with the {'jnp reference attention' if backend == 'auto' else backend} "
            f"(`--attention-backend {backend}`): their AR step at 32k/b16 takes "
            f"{1e3 * case['ar_step_s']:.1f} ms (`{ks}`) against {pair_step:.1f} ms for AR on jaxspec's Pallas kernel "
            f"(`{PAIR_SPEED_SELF[0]}`), so their speed-ups are against a {case['ar_step_s'] * 1e3 / pair_step:.1f}x slower "
            "AR; h200-knapspec step qwen2.5-coder-1.5b-b16-32k-8k-pallas measures AR and KnapSpec on the kernel"
            + (" (not run yet)." if not (inputs.RESULTS / KNAPSPEC_PALLAS).exists() else ": " + _knapspec_pallas_note())
            + _knapspec_pallas_more_note())


def _knapspec_pallas_more_note() -> str:
    """The Pallas-kernel KnapSpec runs beyond the first: static plans with a profile of compiled masks at batch 16,
    and batch 1 (or what is not measured of them)."""
    out = []
    for source, batch, what, step in (
            (KNAPSPEC_PALLAS_STATIC, 16, "With every plan compiled for itself and a latency profile fitted on "
                                         "forwards with each mask compiled in (`--static-plans --latency-fit "
                                         "forward-static`)", "h200-knapspec qwen2.5-coder-1.5b-b16-32k-8k-pallas-static"),
            (KNAPSPEC_PALLAS_B1, 1, "At batch 1, the same two variants and AR on the kernel, with static plans "
                                    "and a batch-1 profile of compiled masks",
             "h200-knapspec qwen2.5-coder-1.5b-b1-32k-8k-pallas-static"),
            (KNAPSPEC_PALLAS_B1_H100, 1, "The same at 32k on an H100",
             "h100-long-context knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static"),
            (KNAPSPEC_PALLAS_B1_H100_AFTER_PLAIN, 1, "The same with the first plan made after 64 plainly decoded "
                                                      "tokens on those alone (`--plan-after-plain 64`)",
             "h100-long-context knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-after-plain"),
            (KNAPSPEC_PALLAS_B1_H100_PROBE_WARMUP, 1, "The same with one untimed round, and one plain step, before "
                                                       "each side of the probe (`--probe-warmup 1`, docs/methods.md "
                                                       "§5.2)",
             "h100-long-context knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-after-plain-probe-warmup"),
            (KNAPSPEC_PALLAS_B1_H100_PROBE_WARMUP_SELECT, 1, "The same with the finalists rescored in one pass "
                                                              "without conditionals (`--rescore select`)",
             "h100-long-context knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-after-plain-probe-warmup-select"),
            (KNAPSPEC_PALLAS_B1_H100_TWO_STRETCH, 1, "The probe-warmup run with both sides of the probe priced as two "
                                                      "stretches, without the per-call cost (`--probe-pricing "
                                                      "two-stretch`, docs/methods.md §5.2)",
             "h100-long-context knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-after-plain-two-stretch"),
            (KNAPSPEC_PALLAS_B1_H200_TWO_STRETCH, 1, "The same on the H200",
             "h200-knapspec qwen2.5-coder-1.5b-b1-32k-pallas-static-after-plain-two-stretch"),
            (KNAPSPEC_PALLAS_STATIC_TABLE_H200, 16, "KnapSpec on the H200 at batch 16 with static plans deciding from "
                                                    "a choice table of its H200 runs whether to plan at all "
                                                    "(`--choice-table`, docs/methods.md §5.2)",
             "h200-knapspec qwen2.5-coder-1.5b-b16-32k-8k-pallas-static-choice-table"),
            *((runs[tag], batch, f"{what}{gpu}, with the latency profile fitted on forwards that skip every second "
                                 "sub-layer of a kind (`--latency-fit forward-static-half`, docs/methods.md §4.1)",
               f"{suite} {step}")
              for runs, batch, what, step_stem in (
                  (KNAPSPEC_PALLAS_B1_HALF_FIT, 1, "The two-stretch run on ",
                   "qwen2.5-coder-1.5b-b1-32k-pallas-static-half-fit"),
                  (KNAPSPEC_PALLAS_B16_HALF_FIT, 16, "At batch 16, one plan at the start on one row's window with "
                                                     "its states kept by the prefill, on ",
                   "qwen2.5-coder-1.5b-b16-32k-pallas-static-1row-half-fit"))
              for tag, gpu, suite, step in (
                  ("h100", "an H100", "h100-long-context", "knapspec-" + step_stem),
                  ("h200", "the H200", "h200-knapspec", step_stem))),
            *((runs["h100"], batch, f"{what} with a profile that takes each call's fixed cost off its steps "
                                    "(the full forward and the decode loop timed at 4 and 16 steps a call, "
                                    "docs/methods.md §4.1)", f"h100-long-context {step}")
              for runs, batch, what, step in (
                  (KNAPSPEC_PALLAS_B1_PER_STEP, 1, "The half-fit run on an H100 at batch 1",
                   "knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-half-fit-per-step"),
                  (KNAPSPEC_PALLAS_B16_PER_STEP, 16, "The half-fit run on an H100 at batch 16",
                   "knapspec-qwen2.5-coder-1.5b-b16-32k-pallas-static-1row-half-fit-per-step"),
                  (KNAPSPEC_PALLAS_B1_KEPT_STATES, 1, "The per-step batch-1 run with the first plan's window states "
                                                      "kept by the plain stretch (docs/methods.md §5.6), on an H100,",
                   "knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-half-fit-per-step-kept-states"),
                  (KNAPSPEC_PALLAS_B1_KEPT_STATES_768, 1, "The same decoding 768 new tokens (32k + 768 = the model's "
                                                          "trained length; the plan's fixed cost over 3x the decode),",
                   "knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-half-fit-per-step-kept-states-768new"),
                  (KNAPSPEC_PALLAS_B1_AT_START_1_FINALIST, 1, "The per-step batch-1 run on an H100 with one plan before "
                                                              "the first round on the prompt's last 64 tokens (states "
                                                              "from the prefill), the DP on 2 search tokens and 1 "
                                                              "finalist,",
                   "knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-half-fit-per-step-at-start-1-finalist"),
                  (KNAPSPEC_PALLAS_B1_AT_START_UNROLLED, 1, "The same with the DP traced once per layer "
                                                            "(`--dp-layers unrolled`, docs/methods.md §4.3)",
                   "knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-half-fit-per-step-at-start-1-finalist-dp-"
                   "unrolled"),
                  (KNAPSPEC_PALLAS_B1_AT_START_UNROLLED_CAP2, 1, "The same with the knapsack weights capped at 2 "
                                                                 "(`--weight-cap 2`)",
                   "knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-half-fit-per-step-at-start-1-finalist-dp-"
                   "unrolled-weight-cap-2"),
                  (KNAPSPEC_PALLAS_B16_2ROWS_UNROLLED, 16, "At batch 16 on an H100, one plan at the start on 2 rows' "
                                                           "windows of 64 tokens (states from the prefill, 3 search "
                                                           "tokens, 2 finalists), the DP traced once per layer,",
                   "knapspec-qwen2.5-coder-1.5b-b16-32k-pallas-static-2rows-half-fit-per-step-at-start-dp-unrolled"),
                  (KNAPSPEC_PALLAS_B16_2ROWS_UNROLLED_CAP2, 16, "The same with the knapsack weights capped at 2 "
                                                                "(`--weight-cap 2`)",
                   "knapspec-qwen2.5-coder-1.5b-b16-32k-pallas-static-2rows-half-fit-per-step-at-start-dp-unrolled-"
                   "weight-cap-2"),
                  (KNAPSPEC_PALLAS_B1_AT_START_CAP2_TABLE, 1, "The batch-1 weight-cap-2 run deciding from a choice "
                                                              "table of the five at-start runs above whether to plan "
                                                              "at all (`--choice-table`, docs/methods.md §5.2)",
                   "knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-half-fit-per-step-at-start-1-finalist-dp-"
                   "unrolled-weight-cap-2-choice-table"),
                  (KNAPSPEC_PALLAS_B16_2ROWS_CAP2_TABLE, 16, "The batch-16 weight-cap-2 run deciding from the same "
                                                             "table",
                   "knapspec-qwen2.5-coder-1.5b-b16-32k-pallas-static-2rows-half-fit-per-step-at-start-dp-unrolled-"
                   "weight-cap-2-choice-table")))):
        if (inputs.RESULTS / source).exists():
            out.append(f"{what} (`{source}`): " + _knapspec_pallas_note(source, batch))
        else:
            out.append(f"{what} (suite and step {step}): not measured yet.")
    return " " + " ".join(out) + _half_fit_note() + _per_step_profile_note() + _knapspec_plan_trace_note()


def _half_fit_note() -> str:
    """The half-skip latency profile against the all-or-nothing one of the same GPU and batch: each sub-layer's
    price at the largest context and what skipping half, and all, of each kind saved (docs/methods.md §4.1)."""
    out = []
    folder = inputs.RESULTS / "knapspec"
    for tag, gpu in (("h100", "an H100"), ("h200", "the H200")):
        for batch in (1, 16):
            stem = f"latency_profiles_{tag}/latency_qwen2.5-coder-1.5b_bfloat16_pallas_{tag}_b{batch}_forward-static"
            half_path, all_path = folder / f"{stem}-half.json", folder / f"{stem}.json"
            if not (half_path.exists() and all_path.exists()):
                continue
            half, full = inputs.load(half_path), inputs.load(all_path)
            n = max(half["contexts"])

            def prices(profile):
                m = profile["model"]
                return (m["c2"] * n + m["c3"]) * 1e6, m["c1"] * 1e6

            def saved(profile, kind):
                times = profile["forward"]["times"]
                return (times["full"][-1] - times[kind][-1]) * 1e3

            skipped = half["forward"]["fit"]["skipped"]
            (ha, hm), (fa, fm) = prices(half), prices(full)
            out.append(
                f"The half-skip profile on {gpu} at batch {batch} (`{half_path.relative_to(inputs.RESULTS)}`) prices an "
                f"Attention sub-layer at {n / 1000:.0f}k at {ha:.1f} us and an MLP at {hm:.1f} us, against {fa:.1f} "
                f"and {fm:.1f} us from the all-or-nothing masks: skipping {skipped} Attention sub-layers saved "
                f"{saved(half, 'noattn'):.2f} ms of the {half['forward']['times']['full'][-1] * 1e3:.2f} ms step, "
                f"skipping all {half['forward']['fit']['skippable']} saved {saved(full, 'noattn'):.2f} ms "
                f"({saved(half, 'nomlp'):.2f} and {saved(full, 'nomlp'):.2f} ms for the MLPs).")
    return "".join(" " + part for part in out)


def _modelled_plain_step(profile, n: float) -> float:
    """A profile's price of a plain-decoding step at context ``n``, seconds: ``p t_step(n)`` (``a`` where ``p`` is 0),
    as ``LatencyModel.t_plain`` prices it (a sub-layer and the per-token term never below 0)."""
    m = profile["model"]
    L = profile["config"]["num_layers"]
    step = L * (max(0.0, m["c2"] * n + m["c3"]) + m["c1"]) + max(0.0, m["c0"] + m.get("c0_n", 0.0) * n)
    ratio = m.get("p", 0.0) or m.get("a", 1.0)
    return ratio * step


def _draft_check_timing(cases: dict, check: dict) -> str:
    """How a run's draft-step check timed its forwards: its own words, or, where its loops were timed at two call
    lengths (the profile took each call's fixed cost off), the slope between them (the time split records both)."""
    for case in cases.values():
        split = case.get("time_split_estimate") or {}
        if split.get("draft_long_steps_per_call"):
            return (f"{split['draft_steps_per_call']} and {split['draft_long_steps_per_call']} forwards per jitted "
                    "call, the slope between them")
    return check["timed"]


def _per_step_profile_note() -> str:
    """The half-skip profiles measured with each call's fixed cost taken off (docs/methods.md §4.1) against those that
    kept it: the fixed cost, and each profile's plain step against the AR step its run measured."""
    out = []
    folder = inputs.RESULTS / "knapspec"
    for batch, runs in ((1, KNAPSPEC_PALLAS_B1_PER_STEP), (16, KNAPSPEC_PALLAS_B16_PER_STEP)):
        name = f"latency_qwen2.5-coder-1.5b_bfloat16_pallas_h100_b{batch}_forward-static-half.json"
        new_path, old_path = folder / "latency_profiles_h100_per-step" / name, folder / "latency_profiles_h100" / name
        run_path = inputs.RESULTS / runs["h100"]
        if not (new_path.exists() and old_path.exists() and run_path.exists()):
            continue
        new, old, run = inputs.load(new_path), inputs.load(old_path), inputs.load(run_path)
        case = next(c for c in run["cases"].values() if isinstance(c, dict) and "ar_step_s" in c)
        n = float(case["latency_prediction"]["n"])
        fwd, fit = new["forward"], new["forward"]["fit"]
        fixed = [o * 1e3 for o in fwd["call_overhead"]]
        out.append(
            f"Each call's fixed cost, on an H100 at batch {batch} (`{new_path.relative_to(inputs.RESULTS)}`): "
            f"{min(fixed):.1f}-{max(fixed):.1f} ms a call of {fwd['steps_per_call']} forwards "
            f"(the decode loop's {fit['plain_call_overhead'] * 1e3:.1f} ms), so the profile that kept it "
            f"priced a plain step at {_modelled_plain_step(old, n) * 1e3:.2f} ms and this one at "
            f"{_modelled_plain_step(new, n) * 1e3:.2f} ms, against {case['ar_step_s'] * 1e3:.2f} ms for the AR step "
            f"measured in the run.")
    return "".join(" " + part for part in out)


def _knapspec_plan_trace_note() -> str:
    """Where the plan's time goes on the GPU: each traced KnapSpec run at 32k/b16 against the traced AR run of the
    same file (device-busy time and kernel launches from the profiler), and the runs not measured yet."""
    out, missing = [], []
    for source, tag, what, step, _ in KNAPSPEC_PLAN_TRACES:
        if (inputs.RESULTS / source).exists():
            out.append(_plan_trace_sentence(source, tag, what))
        else:
            missing.append(f"{what} ({step})")
    if missing:
        out.append("Where the plan's time goes, not measured yet: " + "; ".join(missing) + ".")
    out.extend(_plan_stages_sentence(source, model, device) for source, model, device in PLAN_STAGES)
    return "".join(" " + part for part in out)


def _first_skip(masks: Dict[str, List[List[int]]], i: int) -> str:
    attn, mlp = masks["skip_attn"][i], masks["skip_mlp"][i]
    first = min([2 * a for a in attn] + [2 * m + 1 for m in mlp], default=None)
    return "none" if first is None else f"{'Attention' if first % 2 == 0 else 'MLP'} {first // 2}"


def _plan_stages_sentence(source: str, model: str, device: str) -> str:
    """One plan's stages timed alone on one cache (bench-plan): each stage's time, the two rescorings side by side,
    the device's busy time where traced."""
    data = inputs.load(source)
    parts = []
    for key, case in data["cases"].items():
        best, trace = case["seconds_min"], case.get("trace") or {}
        stages = "; ".join(
            f"{what} {1e3 * best[name]:.1f} ms" + (f" (GPU busy {1e3 * trace[name]['busy_s']:.1f} ms, "
                                                   f"{trace[name]['launches']:,} kernels)"
                                                   if trace.get(name, {}).get("busy_s") else "")
            for name, what in plan_stage_names(case))
        count = len(case["finalist_masks"]["skip_attn"])
        firsts = ", ".join(_first_skip(case["finalist_masks"], i) for i in range(count))
        parts.append(f"{case['context']} cached tokens, {data['config']['rows']} row(s), {case['window']}-token "
                     f"window, DP on {case['search_tokens']} tokens ({case['candidates']} candidates), {count} "
                     f"finalists first skipping at {firsts}: {stages}; select / executed "
                     f"{case['select_over_executed']:.2f}x, the statistics differing by at most "
                     f"{case['rescore_max_abs_diff']:.2g}")
    return (f"One plan's stages timed alone on {device} (`{source}`, bench-plan, {model}, best of "
            f"{data['config']['repeats']}): " + "; ".join(parts) + ".")


def _plan_trace_sentence(source: str, tag: str, what: str) -> str:
    (key, case), = [(k, v) for k, v in inputs.load(source)["cases"].items()
                    if k.startswith(f"{tag}/summarize/ctx32000/") and k.endswith("/knapspec")]
    batch = key.split("/")[3][1:]
    plan = case["plans"][0]
    stages = plan["stage_seconds"]
    ar, ks = (next(iter(case["trace"][m]["planes"].values())) for m in ("ar", "knapspec"))
    extra_busy = ks["busy_s"] - ar["busy_s"]
    extra_launches = ks["launches"] - ar["launches"]
    copies = {name: sum(k["total_s"] for k in plane["top_kernels"] if k["name"] == "MemcpyD2D")
              for name, plane in (("ar", ar), ("knapspec", ks))}
    n_copies = sum(k["count"] for k in ks["top_kernels"] if k["name"] == "MemcpyD2D")
    copy_text = (f", {1e3 * (copies['knapspec'] - copies['ar']):.0f} ms of it more device-to-device copies: "
                 f"{n_copies} MemcpyD2D in KnapSpec's run" + ("" if copies["ar"] else ", none among AR's top kernels")
                 if copies["knapspec"] else "")
    waiting = extra_busy < 0.5 * plan["seconds"]
    return (f"Where the plan's time goes, {what} (`{source}`, 32k, batch {batch}, KnapSpec alone with static plans and "
            f"a profile of compiled masks fitted on that GPU): {case['speedup_vs_ar']:.2f}x AR, planning "
            f"{100 * case['plan_fraction_of_decode']:.1f} % of decode; the plan before the first round took "
            f"{1e3 * plan['seconds']:.0f} ms against {1e3 * plan['predicted_seconds']:.0f} ms predicted (the target's "
            f"states of the window {1e3 * stages['boundary_states']:.0f} ms, the DP on the search tokens "
            f"{1e3 * stages['dp']:.0f} ms, rescoring the finalists {1e3 * stages['rescore']:.0f} ms "
            + ("in one batched pass without conditionals" if plan.get("rescore") == "select" else
               "behind per-sub-layer conditionals")
            + f"{_measured_split_text(case)}). One more run of "
            f"each under the profiler: KnapSpec kept the GPU busy {ks['busy_s']:.3f} s against "
            f"{ar['busy_s']:.3f} s for AR on the same cache ({1e3 * extra_busy:.0f} ms more{copy_text}) and launched "
            f"{ks['launches']:,} kernels against {ar['launches']:,} ({extra_launches:,} more), its wall time "
            f"{1e3 * (ks['span_s'] - ar['span_s']):.0f} ms longer: the plan's device work is at most "
            f"{1e3 * extra_busy:.0f} ms of its {1e3 * plan['seconds']:.0f} ms"
            + (f", and for the rest the GPU waits on the host (issuing the {extra_launches:,} extra kernels one by "
               "one, syncing between stages), so a cheaper plan needs fewer, larger programs (the DP, rescoring and "
               "the window's states in one compiled call) more than fewer bytes." if waiting else
               ", so most of the plan is device work.")
            + _plan_windows_sentence(ks.get("windows") or {}, plan.get("rescore"))
            + _plain_idle_sentence(case, ar, ks))


def _plain_idle_sentence(case: Dict[str, Any], ar: Dict[str, Any], ks: Dict[str, Any]) -> str:
    """For a traced run whose plain steps ran slower than the paired AR run's: the GPU-busy and wall time beyond AR's
    outside the plan's profiler window, which tells device work from the GPU waiting on the host."""
    split = case.get("time_split_measured") or {}
    window = (ks.get("windows") or {}).get("jaxspec.knapspec.plan")
    ratio = split.get("plain_step_over_ar_step")
    if not window or not ratio or ratio < 1.05:
        return ""
    busy = ks["busy_s"] - ar["busy_s"] - window["busy_s"]
    wall = ks["span_s"] - ar["span_s"] - window["wall_s"]
    return (f" Its plain steps ran {ratio:.2f}x the paired AR run's step; outside the plan's window the traced "
            f"KnapSpec run kept the GPU busy {1e3 * busy:.0f} ms more than AR over {split['plain_steps']} plain steps "
            f"while its wall time was {1e3 * wall:.0f} ms longer: the device did AR's work, and the rest is the GPU "
            "waiting on the host, inside the plain stretches or between them"
            + (f" (their fit over {split['plain_stretches']} stretches: "
               + (f"{1e3 * fit['fixed_s']:.1f} ms fixed a stretch" if fit["fixed_s"] > 0 else
                  "no fixed cost a stretch beyond the timing noise")
               + f", a step {fit['step_over_ar_step']:.3f}x AR's)." if (fit := split.get("plain_stretch_fit"))
               else f" (its {split['plain_stretches']} plain stretch(es) have one length: no fit)." if "chunks" in split
               else "; this run predates the engine's per-chunk log, which tells the two apart."))


def _measured_split_text(case: Dict[str, Any]) -> str:
    """Where a KnapSpec run's decode went by the engine's own chunk times (``time_split_measured``), if recorded."""
    split = case.get("time_split_measured")
    if not split:
        return ""
    text = (f"; by the engine's chunk times: plain stretches {1e3 * split['plain_stretches_s']:.0f} ms, rounds "
            f"{1e3 * split['rounds_s']:.0f} ms, the controller's rest {1e3 * split['controller_s']:.0f} ms")
    if split.get("plain_step_over_ar_step"):
        text += f", a plain step {split['plain_step_over_ar_step']:.3f}x the paired AR run's"
    return text


def _plan_windows_sentence(windows: Dict[str, Any], rescore: Optional[str] = None) -> str:
    """The traced plan's profiler annotations (experiments/trace.py windows), where the trace has them; with the
    finalists rescored behind conditionals (``rescore`` "executed", or None: before the choice existed), how long
    the GPU idled in the rescoring."""
    if not windows:
        return ""
    parts = [f"{name[len('jaxspec.knapspec.'):]} {1e3 * w['wall_s']:.1f} ms of wall time, the GPU busy "
             f"{1e3 * w['busy_s']:.1f} ms of it, {w['launches']:,} kernels" for name, w in sorted(windows.items())
             if name.startswith("jaxspec.knapspec.plan")]
    if not parts:
        return ""
    text = " Inside the traced plan's profiler annotations: " + "; ".join(parts) + "."
    window = windows.get("jaxspec.knapspec.plan.rescore")
    if window and rescore != "select" and window["wall_s"] > 0:
        text += (f" The GPU idled {100 * (1 - window['busy_s'] / window['wall_s']):.0f} % of the rescoring: each "
                 "finalist's sub-layers sit behind conditionals, and a GPU reads each predicate on the host before "
                 "it launches the branch (rescoring without them, `--rescore select`, and one plan's stages timed "
                 "alone: docs/methods.md §5.6).")
    return text


def _probe_text(probe: Optional[Dict[str, Any]]) -> str:
    """A KnapSpec plan's measured arbitration (docs/methods.md §5.2): both sides' rates and the choice."""
    if not probe:
        return ""
    own = probe.get("ar_tokens_per_s_measured")
    model = probe.get("ar_tokens_per_s_model")
    mean_round = probe.get("speculative_round_s_mean")
    two = (mean_round is not None and probe.get("speculative_round_s") is not None
           and probe["speculative_round_s"] != mean_round)  # priced as two stretches (--probe-pricing two-stretch)
    warm = (f", after {probe['speculative_warmup_units']} untimed round(s) of {1e3 * probe['speculative_warmup_s']:.1f} ms"
            if probe.get("speculative_warmup_s") is not None else "")
    if two:
        ar = (f"{probe['ar_tokens_per_s']:.0f} for plain steps ({1e3 * probe['ar_step_s']:.2f} ms a step by the two "
              f"stretches, {1e3 * probe['ar_step_s_mean']:.2f} ms on average over the {probe['ar_steps']} steps"
              + (f"; the latency model's rate {model:.0f}, not used" if model else "") + ")")
        return (f"; its {probe['rounds']} probe rounds, priced as two stretches, ran "
                f"{probe['speculative_tokens_per_s']:.0f} tokens/s ({1e3 * probe['speculative_round_s']:.2f} ms a "
                f"round by the stretches' difference, {1e3 * mean_round:.2f} ms on average{warm}) against {ar}, so it "
                + ("kept the plan" if probe["choice"] == "speculative" else "decoded plainly"))
    ar = (f"{probe['ar_tokens_per_s']:.0f} for plain steps"
          + (f" (the better of {own:.0f} measured over {probe['ar_steps']} steps and the latency model's {model:.0f})"
             if own is not None and model else ""))
    return (f"; its {probe['rounds']} probe rounds ran {probe['speculative_tokens_per_s']:.0f} tokens/s "
            f"({1e3 * probe['speculative_s'] / probe['rounds']:.1f} ms a round{warm}) against {ar}, so it "
            + ("kept the plan" if probe["choice"] == "speculative" else "decoded plainly"))


def _alpha_against_measured(plan: dict, case: dict) -> str:
    """The plan's alpha beside the acceptance its run measured: the estimate's binomial standard error on its
    reference tokens, and how far the two lie apart (the target: within 0.05)."""
    tokens, measured = plan.get("reference_tokens"), case.get("acceptance_rate")
    if not tokens or measured is None or not case.get("rounds"):
        return ""
    alpha = float(plan["alpha"])
    error = (alpha * (1 - alpha) / int(tokens)) ** 0.5
    gap = alpha - float(measured)
    return (f" (+/- {error:.2f}, one standard error on its {int(tokens)} reference tokens; the run accepted "
            f"{float(measured):.2f} of its drafted tokens over {int(case['rounds'])} rounds, {abs(gap):.2f} "
            f"{'below' if gap < 0 else 'above'} the "
            f"estimate: {'within' if abs(gap) <= 0.05 else 'outside'} the 0.05 target)")


def _knapspec_pallas_note(source: str = KNAPSPEC_PALLAS, batch: int = 16) -> str:
    """KnapSpec's two-stage plan and KnapSpec with budgeted attention against AR, all on the Pallas kernel
    (step qwen2.5-coder-1.5b-b16-32k-8k-pallas and its variants), and the 1.1x target of the paper's KnapSpec at
    32k/b16."""
    cases = inputs.load(source)["cases"]
    tag = "h100" if source.endswith("_h100.json") else "h200"  # the runs' --device-tag, in their case keys
    asked = [int(c) for c in split_csv(inputs.load(source)["config"].get("contexts", "32000,16384,8192"))]
    parts, measured = [], set()
    for ctx in asked:
        ks, budget = (cases.get(f"{tag}/summarize/ctx{ctx}/b{batch}/{m}") for m in ("knapspec", "knapspec-budget"))
        if ks is None and budget is None:
            continue
        measured.add(ctx)
        text = f"{ctx} tokens"
        if ks:
            step = ks["ar_step_s"]
            text += f" (AR step {1e3 * step:.2f} ms): KnapSpec {ks['speedup_vs_ar']:.2f}x AR"
            decision = ks.get("choice_table") or {}
            if decision.get("reason") == "table":
                split = ks.get("time_split_measured") or {}
                text += (f" (the choice table's entry for ({decision['context_bucket']}, batch "
                         f"{decision['active_rows']}), KnapSpec's lowest whole run at {decision['table_speedup']:.2f}x "
                         f"AR, is " + ("below" if decision["choice"] == "ar" else "at least")
                         + f" 1 + {decision['table_margin']:g}: "
                         + ("no plan, one plain stretch" if decision["choice"] == "ar" else "it planned")
                         + (f", its step {split['plain_step_over_ar_step']:.3f}x the paired AR step"
                            if split.get("plain_step_over_ar_step") else "") + ")")
            if ks.get("plans"):
                p = ks["plans"][0]
                after_plain = inputs.load(source)["config"].get("plan_after_plain")
                when = ("before the first round" if not p["round"] else
                        f"after {p['round']} plainly decoded tokens" if after_plain else f"at round {p['round']}")
                text += (f" (its plan {when} skipped {p['n_skip_attn']} Attention / {p['n_skip_mlp']} "
                         f"MLP sub-layers at alpha {p['alpha']:.2f} on the window, gamma* = {p['gamma_star']}"
                         + (", so it decoded plainly" if p["gamma_star"] == 0 else _alpha_against_measured(p, ks))
                         + _probe_text(p.get("probe"))
                         + f"; planning {100 * ks['plan_fraction_of_decode']:.1f} % of decode, "
                           f"{1e3 * ks['timings']['plan_s']:.0f} ms" + _measured_split_text(ks) + ")")
        if budget:
            bp, probe = budget.get("budget_plan") or {}, budget.get("fixed_plan_probe") or {}
            text += (f"; KnapSpec with budgeted attention {budget['speedup_vs_ar']:.2f}x (its plan: "
                     f"{budget['draft_step_check']['n_dense_attn']} dense / {budget['draft_step_check']['n_budget_attn']} "
                     f"budgeted Attention sub-layers, gamma {bp.get('gamma')}, alpha {bp.get('alpha', 0):.2f}; planning "
                     f"{100 * budget['plan_fraction_of_decode']:.1f} % of decode")
            text += _probe_text(probe) + ")"
        parts.append(text)
    top = cases.get(f"{tag}/summarize/ctx32000/b16/knapspec")  # the target's point (batch 16 only)
    fit = inputs.load(source)["config"].get("latency_fit", "forward")
    checks = [(k, c["draft_step_check"]) for k, c in cases.items()  # runs that made a plan: a plan's draft step
              if (c.get("plans") or c.get("budget_plan")) and c.get("draft_step_check", {}).get("dynamic_s" if fit == "forward" else "static_s")]
    out = "; ".join(parts) + "."
    missing = [f"{round(c / 1000)}k" for c in asked if c not in measured]
    if missing:
        out += f" Not measured: {', '.join(missing)} (the device time ran out)."
    if top:
        plain = bool(top.get("plans")) and top["plans"][0]["gamma_star"] == 0
        how = ("deciding from the choice table, no plan" if (top.get("choice_table") or {}).get("choice") == "ar"
               else "with the two-stage plan made before the first round")
        out += (f" KnapSpec >= 1.1x AR at 32k/b16, on the kernel ({how}): "
                f"**{'met' if top['speedup_vs_ar'] >= 1.1 else 'missed'}** ({top['speedup_vs_ar']:.2f}x)."
                + (" With AR at the kernel's step, the skip plans that save a useful share of it drop the acceptance "
                   "on the window too far, the grid search rightly picks plain decoding, and the planning time is the "
                   "loss." if plain and top["speedup_vs_ar"] < 1.1 else ""))
    pred = [c["latency_prediction"]["ratio_measured_to_predicted"] for c in cases.values()
            if c.get("latency_prediction")]
    if checks and fit == "forward":
        dyn = [c["dynamic_over_predicted"] for _, c in checks]
        sta = [c["static_over_predicted"] for _, c in checks]
        out += (f" The latency profile on the kernel was fitted on forwards with the dynamic skip mask (a conditional "
                f"per sub-layer): the plans' draft step with that mask ran {min(dyn):.2f}-{max(dyn):.2f}x its "
                f"prediction, the same plan compiled in {min(sta):.2f}-{max(sta):.2f}x, and whole decodes less planning "
                f"{min(pred):.2f}-{max(pred):.2f}x the model's: on the GPU the conditionals cost what the static plans "
                "save, so a profile of static forwards is what static plans need.")
    elif checks:
        sta = [c["static_over_predicted"] for _, c in checks]
        within = sum(0.9 <= r <= 1.1 for r in sta)
        out += (f" With the profile of compiled masks, the plans' draft step (compiled for its plan, "
                f"{_draft_check_timing(cases, checks[0][1])}) ran {min(sta):.2f}-{max(sta):.2f}x its prediction, within 10 % at "
                f"{within} of {len(sta)} plans (target 0.9-1.1)"
                + (f", and whole decodes less planning {min(pred):.2f}-{max(pred):.2f}x the model's" if pred else "")
                + ".")
    for key in sorted(cases):
        out += _knapspec_loss_sentence(cases[key], key)
    return out


def _beyond(seconds: float) -> str:
    """'N ms beyond' or 'N ms ahead of' (a pace to finish with)."""
    return f"{1e3 * seconds:.0f} ms beyond" if seconds >= 0 else f"{-1e3 * seconds:.0f} ms ahead of"


def _knapspec_loss_sentence(case: Dict[str, Any], key: str) -> str:
    """Where a KnapSpec run whose plan drafted lost its time against the paired AR run (batch 1): planning, the plain
    stretches and the rounds each beyond AR's pace for the tokens they committed (from the engine's chunk times),
    the controller's rest; and the latency model's AR step and draft step against the measured ones, which is what
    made the DP expect the plan to pay. Empty for runs that decoded plainly, batch > 1, or runs without the log."""
    split, check, pred = (case.get(k) or {} for k in ("time_split_measured", "draft_step_check", "latency_prediction"))
    plans = case.get("plans") or []
    if (not key.endswith("/b1/knapspec") or not split.get("chunks") or not plans or not plans[0]["gamma_star"]
            or "rounds_s" not in split or not check.get("static_s") or not pred.get("step_s")):
        return ""
    step, total = case["ar_step_s"], case["ar_steps"] + round(case["tau"] * case["rounds"])
    plain_excess = split["plain_stretches_s"] - case["ar_steps"] * step
    round_tokens = total - case["ar_steps"]
    rounds_excess = split["rounds_s"] - round_tokens * step
    loss = case["timings"]["decode_s"] - case["ar_decode_s"]
    last = [c for c in split["chunks"] if c["kind"] == "rounds"][-1]
    rate = case["tau"] * last["units"] / last["seconds"]
    return (f" Where the {key.split('/')[2][3:]}-token run lost {1e3 * loss:.0f} ms against AR's "
            f"{1e3 * case['ar_decode_s']:.0f} ms: planning {1e3 * split['plan_s']:.0f} ms; the plain stretches "
            f"{_beyond(plain_excess)} AR's pace for their {case['ar_steps']} tokens; the rounds "
            f"{_beyond(rounds_excess)} it for their {round_tokens} tokens (tau {case['tau']:.2f}, the last "
            f"call {1e3 * last['seconds'] / last['units']:.2f} ms a round over {last['units']} rounds); the "
            f"controller {1e3 * split['controller_s']:.0f} ms. The latency model priced a plain step at "
            f"{1e3 * case['predicted_ar_step_s']:.2f} ms (measured {1e3 * step:.2f}), the full forward at "
            f"{1e3 * pred['step_s']:.2f} ms and the plan's draft step at {1e3 * check['predicted_s']:.2f} ms "
            f"(measured {1e3 * check['static_s']:.2f}): skipping its {check['n_skip_attn']} Attention / "
            f"{check['n_skip_mlp']} MLP sub-layers saved {1e3 * (step - check['static_s']):.2f} ms of AR's measured "
            f"step against {1e3 * (pred['step_s'] - check['predicted_s']):.2f} ms predicted, and the plan's last call "
            f"committed {rate:.0f} tokens/s at the run's tau against AR's {1 / step:.0f} ({rate * step:.2f}x).")


def _knapspec_real_baselines() -> str:
    """KnapSpec with budgeted attention and the static skip set on the real 1.5B (or what is not measured)."""
    labels = {"knapspec-budget": "KnapSpec with budgeted attention (sinks + window, K = 256, one plan)",
              "static-skip": "the static skip set (calibrated offline on another book)"}
    parts, missing = [], []
    for batch, source, methods, variant in KNAPSPEC_REAL_BASELINES:
        cases = inputs.load(source)["cases"] if (inputs.RESULTS / source).exists() else {}
        for method in methods:
            got = [(key.split("/")[2][3:], c) for key, c in cases.items()
                   if key.endswith(f"/{method}") and "speedup_vs_ar" in c]
            if got:
                bp = got[0][1].get("budget_plan") or {}
                rows = (f" (one plan before the first round on {bp['rows']} rows' last "
                        f"{bp['reference_tokens'] // bp['rows']} prompt tokens each)"
                        if method == "knapspec-budget" and bp.get("rows") else "")

                def plan_of(c):
                    bp = c.get("budget_plan")
                    if method != "knapspec-budget" or not bp:
                        return ""
                    text = (f"; plan: {bp['n_dense_attn']} dense / {bp['n_budget_attn']} budgeted / "
                            f"{bp['n_skip_attn']} skipped Attention, {bp['n_skip_mlp']} skipped MLP, gamma "
                            f"{bp['gamma']}, planning {100 * c['plan_fraction_of_decode']:.1f} % of decode")
                    t = c.get("timings") or {}
                    if c.get("rounds") and t.get("decode_s") and c.get("ar_step_s"):
                        text += (f", {1e3 * (t['decode_s'] - t.get('plan_s', 0.0)) / c['rounds']:.1f} ms a round "
                                 f"against an AR step of {1e3 * c['ar_step_s']:.1f} ms")
                    if bp.get("alpha") is not None and c.get("acceptance_rate") is not None:
                        text += (f"; the plan's alpha {bp['alpha']:.2f} on {bp['reference_tokens']} reference tokens "
                                 f"against {c['acceptance_rate']:.2f} of drafted tokens accepted")
                    if (c.get("draft_step_check") or {}).get("plan") != "budget":
                        text += "; this file's draft-step check timed the full model, not the plan, so it is not shown"
                    return text

                static = next((c for k, c in cases.items() if k.endswith(f"static_plan/b{batch}")), None)
                if method == "static-skip" and static and "gamma" in static:
                    src = (static.get("source") or {}).get("plan") or {}
                    rows = (f" (its offline plan skips {len(src.get('skip_attn', []))} Attention / "
                            f"{len(src.get('skip_mlp', []))} MLP sub-layers with gamma {static['gamma']}"
                            + (": plain decoding" if static["gamma"] == 0 else "") + ")")
                parts.append(f"{labels[method]}{' ' + KNAPSPEC_VARIANTS[variant] if variant else ''}, batch "
                             f"{batch}{rows}: " + ", ".join(
                    f"{ctx} tokens {c['speedup_vs_ar']:.2f}x AR (tau "
                    f"{'-' if c['tau'] is None else format(c['tau'], '.2f')}{plan_of(c)})" for ctx, c in got)
                    + f" (`{source}`)")
            else:
                missing.append(f"{labels[method]} at batch {batch}")
    return ((" ".join(p[:1].upper() + p[1:] + "." for p in parts) + " ") if parts else "") + (
        ("Not measured yet: " + "; ".join(missing) + " (h200-knapspec steps qwen2.5-coder-1.5b-b1-8k-32k-budget-static, "
         "qwen2.5-coder-1.5b-b16-32k-8k-budget-plan-rows, qwen2.5-coder-1.5b-b16-8k-32k-static)."
         ) if missing else "")


def _plans(case) -> str:
    plans = case.get("plans") or []
    if not plans:
        return "none"
    def one(p):
        star = p.get("gamma_star", p["gamma_used"])
        gamma = f"g{star}" if star == p["gamma_used"] else f"g*{star} → g{p['gamma_used']}"
        return f"{p['n_skip_attn']}/{p['n_skip_mlp']} {gamma}"

    return ", ".join(one(p) for p in plans)


def knapspec_comparison(method: str) -> Tuple[int, List[str]]:
    """How many of the runs in KNAPSPEC_RUNS KnapSpec beat ``method`` in, and the labels of those it did not."""
    wins, losses = 0, []
    for label, source, tag, ctx, batch, other in KNAPSPEC_RUNS:
        base = f"{tag}/summarize/ctx{ctx}/b{batch}"
        rival = inputs.load(other or source)["cases"].get(f"{base}/{method}")
        if rival is None:
            continue
        if inputs.load(source)["cases"][f"{base}/knapspec"]["speedup_vs_ar"] > rival["speedup_vs_ar"]:
            wins += 1
        else:
            losses.append(label)
    return wins, losses


def knapspec_tables() -> str:
    lines = ["| device, model, case | KnapSpec (x AR) | KnapSpec's plans (Attn / MLP skipped, gamma) | planning % "
             "| CLaSp (x AR) | authors' always-draft emulation (x AR) | JSON |", "|---|---|---|---|---|---|---|"]
    for label, source, tag, ctx, batch, other in KNAPSPEC_RUNS:
        cases = inputs.load(source)["cases"]
        others = inputs.load(other or source)["cases"]
        base = f"{tag}/summarize/ctx{ctx}/b{batch}"
        ks = cases[f"{base}/knapspec"]

        def rate(method):
            case = others.get(f"{base}/{method}")
            return f"{case['speedup_vs_ar']:.2f}" if case else "–"

        files = f"`{source}`" + (f", `{other}`" if other else "")
        lines.append(f"| {label} | **{ks['speedup_vs_ar']:.2f}** | {_plans(ks)} "
                     f"| {100 * ks['plan_fraction_of_decode']:.1f} | {rate('clasp')} | {rate('knapspec-official')} "
                     f"| {files} |")
    early = ["| prompt | method | tok/s | AR tok/s (paired) | speed-up | tau | plans (Attn / MLP skipped, gamma) "
             "| planning % | identical |", "|---|---|---|---|---|---|---|---|---|"]
    for source in KNAPSPEC_EARLY:
        for key, case in inputs.load(source)["cases"].items():
            parts = key.split("/")
            if len(parts) != 5 or "speedup_vs_ar" not in case:
                continue
            tau = "-" if case.get("tau") is None else f"{case['tau']:.2f}"
            early.append(f"| {parts[2][3:]} | {parts[4]} | {case['tokens_per_s']:.1f} | {case['ar_tokens_per_s']:.1f} "
                         f"| {case['speedup_vs_ar']:.2f} | {tau} | {_plans(case)} "
                         f"| {100 * case['plan_fraction_of_decode']:.0f} | {case['identical_to_ar']} |")
    return "\n".join(lines + ["", f"SmolLM2-135M on the CPU at 1k-8k, measured before the whole-forward latency fit, "
                                  f"the planning budget, the allowance and the measured arbitration "
                                  f"(`{KNAPSPEC_EARLY[0]}`, `{KNAPSPEC_EARLY[1]}`; rerunning their commands measures "
                                  f"the current code):", ""] + early)


def selfspec_table() -> str:
    lines = ["| method | tok/s | AR tok/s (same process) | speed-up | tau | acceptance | planning / decode | plans "
             "| identical to AR | JSON |", "|---|---|---|---|---|---|---|---|---|---|"]
    for _, label, source in SELFSPEC_CPU:
        r = inputs.load(source)["results"]
        t, m = r["timings"], r["metrics"]
        plans = m.get("knapspec_plans")
        lines.append(f"| {label} | {r['tokens_per_s']:.2f} | {r['ar_tokens_per_s']:.2f} | {r['speedup_vs_ar']:.2f}x "
                     f"| {m['tau']:.2f} | {m['acceptance_rate']:.2f} "
                     f"| {'%.0f %%' % (100 * t['plan_fraction']) if 'plan_fraction' in t else '–'} "
                     f"| {len(plans) if isinstance(plans, list) else '–'} "
                     f"| {'yes' if r['identical_to_ar'] else 'no'} | `{source}` |")
    return "\n".join(lines)
