"""KnapSpec's planner (``knapspec/*.json``): how good its plans are and what planning costs.

* the fixed candidate plans' acceptance against the DP's estimate (:func:`knapspec_alpha_table`,
  :func:`knapspec_alpha_notes`) and predicted TPT against measured speed-up (:func:`knapspec_tpt_correlation_note`);
* the DP's cost and the CPU runs that plan at the start, after plain tokens, on kept states or in two stages
  (:func:`knapspec_dp_cost_note`, :func:`knapspec_two_stage_note`, :func:`knapspec_calibrated_note`);
* planning on one row's window on the GPU (:func:`knapspec_plan_rows_note`) and one plan's stages timed alone
  (:func:`plan_stage_names`).

:func:`fixed_cases` and :func:`chosen_fixed` are read by the figures too.
"""

from __future__ import annotations

import pathlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

from experiments.tables import inputs
from experiments.tables.inputs import (DP_REFERENCES, K, KNAPSPEC_64REF, KNAPSPEC_AFTER_PLAIN_CPU,
                                       KNAPSPEC_AFTER_PLAIN_STATES_CPU, KNAPSPEC_ALPHA, KNAPSPEC_AT_START_CPU,
                                       KNAPSPEC_AT_START_QWEN_CPU, KNAPSPEC_CALIBRATED_CPU, KNAPSPEC_DP_PALLAS,
                                       KNAPSPEC_ONE_FINALIST_CAP2_QWEN_CPU, KNAPSPEC_ONE_FINALIST_CPU,
                                       KNAPSPEC_ONE_FINALIST_QWEN_CPU, KNAPSPEC_ONE_FINALIST_UNROLLED_QWEN_CPU,
                                       KNAPSPEC_OWN_STATES_CPU, KNAPSPEC_PLAIN_PRICED_CPU, KNAPSPEC_PLAN_ROWS,
                                       KNAPSPEC_PLAN_ROWS_AT_START, KNAPSPEC_PLAN_ROWS_CALIBRATED,
                                       KNAPSPEC_PREFILL_STATES_CPU, KNAPSPEC_REAL, KNAPSPEC_TPT_CORRELATION,
                                       KNAPSPEC_TPT_CORRELATION_H100, KNAPSPEC_TPT_CORRELATION_H100_8,
                                       KNAPSPEC_TPT_CORRELATION_REPEATS, KNAPSPEC_TPT_CORRELATION_TARGET,
                                       KNAPSPEC_TWO_STAGE, KNAPSPEC_TWO_STAGE_CPU, REPRICED, TPT_CORRELATION_CONTEXTS,
                                       tokens_k)


def fixed_cases(d, prefix="cpu/summarize/ctx1024/b1/fixed/"):
    return [v for k, v in d["cases"].items() if k.startswith(prefix)]


def chosen_fixed(d):
    """The fixed-plan case of the planner's own choice (the candidates' ``plan``), or None."""
    chosen = d["cases"]["cpu/summarize/ctx1024/b1/candidates"]["plan"].get("index")
    return next((c for c in fixed_cases(d) if c.get("candidate") == chosen), None)


def knapspec_alpha_table() -> List[str]:
    """Each fixed plan of the alpha run: its acceptance estimate under both DP references beside the measured one."""
    if not (inputs.RESULTS / KNAPSPEC_ALPHA).exists():
        return []
    d = inputs.load(KNAPSPEC_ALPHA)
    chosen = chosen_fixed(d)
    lines = [f"The DP's acceptance estimate under both references (docs/methods.md §4.3) for the same skip sets, "
             f"against the acceptance each measured as a fixed plan over 256 new tokens (SmolLM2-135M, CPU, the "
             f"1k summarisation prompt, 64 reference tokens = the first 64 AR tokens; `{KNAPSPEC_ALPHA}`):", "",
             "| skipped weight | Attn / MLP skipped | gamma | alpha, " + DP_REFERENCES[0][1] + " | alpha, "
             + DP_REFERENCES[1][1] + " | measured acceptance | tau | x AR |", "|---|---|---|---|---|---|---|---|"]
    for c in sorted(fixed_cases(d), key=lambda c: c["weight"]):
        mark = " (the planner's choice)" if c is chosen else ""
        lines.append(f"| {c['weight']}{mark} | {c['final_skip']['n_skip_attn']} / {c['final_skip']['n_skip_mlp']} "
                     f"| {c['gamma']} | {c['alpha_branch']:.3f} | {c['alpha_target']:.3f} "
                     f"| {c['acceptance_rate']:.3f} | {c['tau']:.2f} | {c['speedup_vs_ar']:.2f} |")
    return ["\n".join(lines)]


def knapspec_dp_cost_note() -> str:
    """Why one DP on 64 reference tokens cannot fit 5 % of a 256-token decode on the CPU (from the 64ref JSON)."""
    d = inputs.load(KNAPSPEC_64REF)
    c = d["cases"]["cpu/summarize/ctx1024/b1/candidates"]
    layers = len(c["candidates"][0]["mask"])
    slots = (sum(c["weights"]) * layers) // 2 + 1  # skip budget floor((w_attn + w_mlp) L / 2) + 1 (methods.md §4.3)
    rows = slots * c["reference_tokens"]
    step = c["ar_decode_s"] / c["ar_new_tokens"]
    share = c["plan_share_of_ar_decode"]
    return (f"One DP at most 5 % of a {c['ar_new_tokens']}-token decode on the CPU: **{'met' if share <= 0.05 else 'missed'}** "
            f"({100 * share:.1f} %, SmolLM2, `{KNAPSPEC_64REF}`). The DP pushes each of its {slots} slot states "
            f"(skip budget + 1) of the {c['reference_tokens']} reference tokens through every sub-layer: {rows} "
            f"token rows in {c['plan_s']:.2f} s ({1e3 * c['plan_s'] / rows:.1f} ms a row) against "
            f"{c['ar_decode_s']:.2f} s for the AR decode ({1e3 * step:.1f} ms a step). One DP is the time of "
            f"{c['plan_s'] / step:.0f} decode steps where 5 % of the decode is {0.05 * c['ar_new_tokens']:.1f}: "
            f"on a 2-core CPU a row of a batched forward costs 1/{step / (c['plan_s'] / rows):.0f} of a decode step, "
            "so the DP as specified (every slot state through every sub-layer) cannot fit 64 reference tokens "
            "under 5 % here; on a GPU, where a decode "
            "step is bound by reading the weights and a few thousand rows cost little more, the same DP is not "
            "measured at 64 reference tokens yet." + knapspec_start_states_cpu_note())


def _start_plan_text(c) -> str:
    """One CPU KnapSpec case's first plan: its planning share, window, cost by stage against the prediction, and
    the run's speed-up."""
    a, share = c.get("plan_allowance") or {}, c["plan_fraction_of_decode"]
    if not c.get("plans"):
        return (f"no plan ({a.get('allowed_tokens')} reference tokens fit the {1e3 * a.get('plan_budget_s', 0):.0f} "
                f"ms budget), planning {100 * share:.1f} % of decode, {c['speedup_vs_ar']:.2f}x AR")
    p = c["plans"][0]
    st = p.get("stage_seconds") or {}
    allowed = (f"its floor of {a.get('allowed_tokens')} kept: predicted within 5 % of the decode, above the "
               f"{1e3 * a.get('plan_budget_s', 0):.0f} ms budget its margin leaves" if a.get("floor_in_margin") else
               f"the allowance let {a.get('allowed_tokens')} in at its {1e3 * a.get('plan_budget_s', 0):.0f} ms budget")
    plain = ""
    if p["gamma_star"] == 0 and c.get("ar_decode_s") and c.get("ar_step_s") and c["timings"].get("decode_s"):
        steps = c["ar_decode_s"] / c["ar_step_s"]  # the steps AR's step is counted over
        step = (c["timings"]["decode_s"] - c["timings"].get("plan_s", 0.0)) / steps
        plain = f"; its plain steps took {1e3 * step:.1f} ms"
    return (f"planning {100 * share:.1f} % of decode on {p['reference_tokens']} reference tokens ({allowed}), the plan "
            f"{1e3 * p['seconds']:.0f} ms (the window's states {1e3 * st.get('boundary_states', 0):.0f} ms, the DP "
            f"{1e3 * st.get('dp', 0):.0f} ms, rescoring {1e3 * st.get('rescore', 0):.0f} ms; predicted "
            f"{1e3 * p['predicted_seconds']:.0f} ms), {c['speedup_vs_ar']:.2f}x AR with the AR step "
            f"{1e3 * c['ar_step_s']:.1f} ms (gamma* = {p['gamma_star']}, output identical to AR: "
            f"{'yes' if c['identical_to_ar'] else 'no'}{plain})" + _postponed_text(c))


def _postponed_text(c) -> str:
    """How often a KnapSpec run put its next plan off because the last one still cost more than the allowed share of
    the decode time since it (docs/methods.md §5)."""
    n = int((c.get("timings") or {}).get("postponed_plans", 0))
    if not n:
        return ""
    return (f"; the re-plan was put off {n} time{'s' if n > 1 else ''} because the plan still cost more than "
            "the allowed share of the decode time since it, so the run made "
            f"{len(c['plans'])} plan{'s' if len(c['plans']) > 1 else ''}")


def knapspec_start_states_cpu_note() -> str:
    """The two-stage plan before the first round with its window's states kept by the prefill, against the same plan
    computing them (cpu-knapspec steps smollm2-135m-1k-two-stage-at-start-{prefill,own}-states, one profile)."""
    if not (inputs.RESULTS / KNAPSPEC_PREFILL_STATES_CPU).exists():
        return (" The two-stage plan with its window's states kept by the prefill: not measured yet (cpu-knapspec step "
                "smollm2-135m-1k-two-stage-at-start-prefill-states).")

    def case(source):
        (_, c), = [(k, v) for k, v in inputs.load(source)["cases"].items() if "speedup_vs_ar" in v]
        return c

    kept = case(KNAPSPEC_PREFILL_STATES_CPU)
    share = kept["plan_fraction_of_decode"]
    tokens = kept["plans"][0]["reference_tokens"] if kept.get("plans") else 0
    text = (f" The two-stage plan made before the first round with its window's target states kept by the prefill "
            f"(`--start-states prefill`, docs/methods.md §5.6; `{KNAPSPEC_PREFILL_STATES_CPU}`): "
            + _start_plan_text(kept) + f". At most 5 % with at least 64 reference tokens: "
            f"**{'met' if share <= 0.05 and tokens >= 64 else 'missed'}**")
    if (share > 0.05 or tokens < 64) and kept.get("plans"):
        p, a = kept["plans"][0], kept["plan_allowance"]
        st = p.get("stage_seconds") or {}
        decode = kept["timings"]["decode_s"]
        text += (f" (the DP on {inputs.load(KNAPSPEC_PREFILL_STATES_CPU)['config'].get('search_tokens')} search tokens alone "
                 f"took {100 * st.get('dp', 0) / decode:.1f} % of this decode; the allowance, sized at "
                 f"{100 * a['plan_budget_s'] / a['predicted_ar_decode_s']:.2f} % of the predicted decode, had "
                 f"{1e3 * (a['plan_budget_s'] - a['predicted_dp_search_s']):.0f} ms left after the search's predicted "
                 f"{1e3 * a['predicted_dp_search_s']:.0f} ms, at {1e3 * a['predicted_dp_s_per_token']:.1f} ms a window "
                 f"token; a 64-token window priced so is "
                 f"{100 * (a['predicted_dp_search_s'] + 64 * a['predicted_dp_s_per_token']) / a['predicted_ar_decode_s']:.1f}"
                 " % of the predicted decode: on this compute-bound CPU the search's slot rows and the finalists' "
                 "window rows cost too much against a decode step to fit 5 % of a 256-step decode at 64 tokens)")
    if (inputs.RESULTS / KNAPSPEC_OWN_STATES_CPU).exists():
        own = case(KNAPSPEC_OWN_STATES_CPU)
        text += (f". The same plan computing the states itself (`--start-states own`, the same profile, "
                 f"`{KNAPSPEC_OWN_STATES_CPU}`): " + _start_plan_text(own))
        text += (f". The prefill took {kept['prefill']['s']:.1f} s keeping the states and {own['prefill']['s']:.1f} s "
                 "without (each its process's first prefill, compilation included)")
        if kept.get("plans") and own.get("plans") and kept["plans"][0]["gamma_star"] == own["plans"][0]["gamma_star"] == 0:
            text += (f". Both plans chose plain decoding, so the speed-ups differ by the paired AR runs' step "
                     f"({1e3 * kept['ar_step_s']:.1f} against {1e3 * own['ar_step_s']:.1f} ms), not by the plans")
    if (inputs.RESULTS / KNAPSPEC_ONE_FINALIST_CPU).exists():
        one = case(KNAPSPEC_ONE_FINALIST_CPU)
        cfg = inputs.load(KNAPSPEC_ONE_FINALIST_CPU)["config"]
        share1 = one["plan_fraction_of_decode"]
        tokens1 = one["plans"][0]["reference_tokens"] if one.get("plans") else 0
        text += (f". The cheapest two-stage plan with the prefill's states ({cfg.get('search_tokens')} search tokens, "
                 f"{cfg.get('finalists')} finalist; step smollm2-135m-1k-at-start-prefill-states-1-finalist, "
                 f"`{KNAPSPEC_ONE_FINALIST_CPU}`): " + _start_plan_text(one) + ". At most 5 % with at least 64 reference "
                 f"tokens: **{'met' if share1 <= 0.05 and tokens1 >= 64 else 'missed'}** in this run")
        steps = [c["ar_step_s"] for c in (kept, own)]
        if one.get("plans") and one["ar_step_s"] > 1.1 * max(steps):
            plan_s = one["plans"][0]["seconds"]
            shares = sorted(plan_s / (256 * st) for st in steps)
            text += (f", with its decode at {1e3 * one['ar_step_s']:.1f} ms a step against "
                     f"{1e3 * min(steps):.1f}-{1e3 * max(steps):.1f} ms in the two runs above: at their step times the "
                     f"same {1e3 * plan_s:.0f} ms plan would be {100 * shares[0]:.1f}-{100 * shares[1]:.1f} % of a "
                     "256-step decode, so this machine's spread decides the verdict")
    return text + " (one run each on a shared 2-core CPU)."


PLAN_STAGE_NAMES = (("boundary_states", "the window's states"), ("dp", "the DP as one scan of every slot"),
                    ("rescore_executed", "the finalists rescored behind conditionals"),
                    ("rescore_select", "the same without them (--rescore select)"))


def plan_stage_names(case: Dict[str, Any]) -> List[Tuple[str, str]]:
    """A bench-plan case's stages in order with their labels: :data:`PLAN_STAGE_NAMES` and the DP split into runs
    of reachable slots (``dp_<K>seg``) where timed."""
    names = []
    for name, what in PLAN_STAGE_NAMES:
        if name == "rescore_executed":
            names += [(seg, f"the DP in {seg[3:-3]} runs of reachable slots") for seg in case["seconds_min"]
                      if seg.startswith("dp_") and seg.endswith("seg")]
            names += [(seg, "the DP traced once per layer (--dp-layers unrolled)") for seg in case["seconds_min"]
                      if seg == "dp_unrolled"]
        if name in case["seconds_min"]:
            names.append((name, what))
    return names


def knapspec_two_stage_note() -> str:
    """The two-stage plan with a window of >= 64 tokens on the real 1.5B (h200-knapspec)."""
    if not (inputs.RESULTS / KNAPSPEC_TWO_STAGE).exists():
        return ("The two-stage plan on the real 1.5B: not measured yet (h200-knapspec step "
                "qwen2.5-coder-1.5b-b1-8k-32k-two-stage).")
    parts, ratios, shares, losses = [], [], [], []
    for key, c in inputs.load(KNAPSPEC_TWO_STAGE)["cases"].items():
        text = _plan_case_head(key, c, shares, losses)
        if c.get("plans"):
            p = c["plans"][0]
            ratios.append(p["seconds"] / p["predicted_seconds"])
            text += (f"; the plan: {p['reference_tokens']} reference tokens, {1e3 * p['seconds']:.0f} ms measured "
                     f"against {1e3 * p['predicted_seconds']:.0f} ms predicted, best candidate skipping "
                     f"{p['n_skip_attn']} Attention / {p['n_skip_mlp']} MLP sub-layers (alpha {p['alpha']:.2f} on the "
                     f"window) and gamma* = {p['gamma_star']} ({'plain decoding' if p['gamma_star'] == 0 else 'drafting'})")
        if not c.get("identical_to_ar"):
            text += " (bf16 output left AR's: see the bf16 note of the real-pair section)"
        parts.append(text)
    worst = max(shares)
    return ("Two-stage plan (docs/methods.md §5.6) on the real Qwen2.5-Coder-1.5B, H200, bf16, batch 1, 256 new "
            f"tokens, DP on 3 search tokens, 2 finalists scored on a window of at least 64 tokens "
            f"(`--search-tokens 3 --finalists 2 --reference-floor 64`, `{KNAPSPEC_TWO_STAGE}`): " + "; ".join(parts)
            + f". One plan with at least 64 reference tokens within 5 % of decode: **{'met' if worst <= 0.05 else 'missed'}**"
            f" ({100 * min(shares):.1f}-{100 * worst:.1f} %): the allowance predicted the plan to fit, but it ran "
            f"{min(ratios):.1f}-{max(ratios):.1f}x its prediction (the many-row price t_row(n) is timed on plain "
            "forwards of 64-256 rows, while the DP's rows go through a scan over sub-layers and, in the search, "
            "a vmap over slot states). At batch 1 the 1.5B's decode step reads its weights (3 GB) and little KV, "
            "so a skip set that keeps acceptance (one MLP) saves almost nothing, and the grid search rightly "
            "chose plain decoding. Where the time went beyond AR's (decode minus the paired AR decode; the run's "
            "own split): " + "; ".join(losses) + " (the first 6 rounds draft with the full model before the "
            "first plan; 'other' is what the split does not attribute: host work between the engine's calls and "
            "the fixed cost of each plain-decoding call, not traced). The chosen plan's predicted against "
            "measured acceptance could not be compared: no plan drafted." + knapspec_two_stage_cpu_note())


#: layers of the real Qwen2.5-Coder-1.5B (its DP's slot count is (w_attn + w_mlp) x layers / 2 + 1)
QWEN_15B_LAYERS = 28


def _old_branch_chunk(context: int) -> int:
    """Branches per attention batch the knapspec experiment used for the real 1.5B's batch-16 DP before its
    memory bound took the DP's own rows and tokens: that bound (4 GB of float32 scores, three buffers) as it
    was applied then, to 16 rows x 64 tokens x 12 heads over the case's capacity (256 new tokens, gamma_max 10);
    the files of those runs do not record it."""
    per_branch = 3 * 4 * 16 * 12 * 64 * (context + 256 + 10 + 2)
    slots = (5 + 1) * QWEN_15B_LAYERS // 2 + 1
    return 0 if per_branch * slots <= 4e9 else max(1, int(4e9 // per_branch))


def _plan_case_head(key: str, c: dict, shares: list, losses: list) -> str:
    """``8192 tokens: 0.79x AR, planning 13.8 % of decode`` for one KnapSpec case; appends its planning share
    and its time beyond AR (:func:`_time_beyond_ar`) to ``shares`` and ``losses``."""
    ctx = key.split("/")[2][3:]
    shares.append(c["plan_fraction_of_decode"])
    losses.append(_time_beyond_ar(ctx, c))
    return f"{ctx} tokens: {c['speedup_vs_ar']:.2f}x AR, planning {100 * c['plan_fraction_of_decode']:.1f} % of decode"


def _time_beyond_ar(ctx: str, c: dict) -> str:
    """Decode minus the paired AR decode of one KnapSpec case, split by the run's own estimate."""
    split = c["time_split_estimate"]
    return (f"{ctx} tokens {1e3 * (c['timings']['decode_s'] - c['ar_decode_s']):.0f} ms (plan "
            f"{1e3 * split['plan_s']:.0f}, draft + verify of the first rounds "
            f"{1e3 * (split['draft_s'] + split['verify_s']):.0f}, other {1e3 * split['other_s']:.0f}, less "
            f"the {1e3 * (c['ar_decode_s'] - split['ar_interval_s']):.0f} ms of AR steps the rounds replaced)")


def knapspec_plan_rows_note() -> str:
    """The two-stage plan at batch 16 on 2 rows' windows, real 1.5B (h200-knapspec step
    qwen2.5-coder-1.5b-b16-32k-8k-plan-rows)."""
    if not (inputs.RESULTS / KNAPSPEC_PLAN_ROWS).exists():
        return ("The two-stage plan at batch 16 on 2 rows' windows: not measured yet (h200-knapspec step "
                "qwen2.5-coder-1.5b-b16-32k-8k-plan-rows).")
    parts, shares, ratios, losses, speedups, dp, rest, slots, chunks = [], [], [], [], [], [], [], [], {}
    for key, c in inputs.load(KNAPSPEC_PLAN_ROWS)["cases"].items():
        text = _plan_case_head(key, c, shares, losses)
        speedups.append(c["speedup_vs_ar"])
        if c.get("plans"):
            p = c["plans"][0]
            slots.append((p["w_attn"] + p["w_mlp"]) * QWEN_15B_LAYERS // 2 + 1)
            chunks[int(key.split("/")[2][3:])] = _old_branch_chunk(int(key.split("/")[2][3:]))
            ratios.append(p["seconds"] / p["predicted_seconds"])
            dp.append(p.get("stage_seconds", {}).get("dp", float("nan")))
            rest.append(p.get("stage_seconds", {}).get("other", float("nan")))
            text += (f"; the plan: {p['reference_tokens']} reference tokens over 2 rows, {1e3 * p['seconds']:.0f} ms "
                     f"measured against {1e3 * p['predicted_seconds']:.0f} ms predicted"
                     + (f" ({_plan_stage_split(p)[2:]})" if p.get("stage_seconds") else "")
                     + f", best candidate skipping {p['n_skip_attn']} Attention / {p['n_skip_mlp']} MLP sub-layers "
                     f"(alpha {p['alpha']:.2f} on the window), gamma* = {p['gamma_star']}"
                     + (" (plain decoding)" if p["gamma_star"] == 0 else ""))
        parts.append(text)
    worst = max(shares)
    return ("Two-stage plan at batch 16 on 2 rows' windows (docs/methods.md §5.6; `--plan-rows 2 --search-tokens 3 "
            f"--finalists 2 --reference-floor 64`, `{KNAPSPEC_PLAN_ROWS}`), real Qwen2.5-Coder-1.5B, H200, bf16, 256 "
            "new tokens: " + "; ".join(parts) + f". Planning at most 5 % of decode: "
            f"**{'met' if worst <= 0.05 else 'missed'}** ({100 * min(shares):.1f}-{100 * worst:.1f} %): the plan ran "
            f"{min(ratios):.1f}-{max(ratios):.1f}x the allowance's prediction: the DP on the search tokens took "
            f"{min(dp):.2f}-{max(dp):.2f} s, growing with the context: the experiment bounded the DP's float32 "
            f"scores as if it ran on all 16 rows and 64 tokens, so its {min(slots)}-{max(slots)} slot states went "
            "through each attention " + ", ".join(f"{n} at a time at {round(ctx / 1000)}k"
                                                  for ctx, n in sorted(chunks.items())) + ", where the 2 rows x 3 "
            "search tokens it ran on fit all at once (the bound now uses the DP's own rows and tokens, "
            "`dp_branch_chunk` in each case), and "
            f"{min(rest):.2f}-{max(rest):.2f} s went outside the named stages at every context (not traced). "
            "No KnapSpec variant below 0.97x AR: "
            f"**{'met' if min(speedups) >= 0.97 else 'missed'}** here ({min(speedups):.2f}-{max(speedups):.2f}x). "
            "At every context the best candidate that keeps acceptance skipped a single MLP, which saves nothing "
            "measurable, so the grid search chose plain decoding and the loss is the plan and the full-model rounds "
            "before it. Where the time went beyond AR's: " + "; ".join(losses) + "."
            + " The same run with its first plan made before the first round (`--plan-at-start`, no full-model "
            "rounds; h200-knapspec step qwen2.5-coder-1.5b-b16-32k-8k-plan-rows-at-start): " + _speedups_and_shares(
                KNAPSPEC_PLAN_ROWS_AT_START) + ". " + _dp_pallas_note())


def _same_plan_as_reference() -> str:
    """Whether the plans made with the kernel's DP equal those of the reference DP's at-start run, per context."""
    if not (inputs.RESULTS / KNAPSPEC_PLAN_ROWS_AT_START).exists():
        return ""
    def firsts(source):
        return {k.split("/")[2]: (c["plans"][0]["skip_attn"], c["plans"][0]["skip_mlp"], c["plans"][0]["gamma_star"])
                for k, c in inputs.load(source)["cases"].items() if isinstance(c, dict) and c.get("plans")}
    kernel, reference = firsts(KNAPSPEC_DP_PALLAS), firsts(KNAPSPEC_PLAN_ROWS_AT_START)
    both = sorted(set(kernel) & set(reference), key=lambda c: -int(c[3:]))
    if not both:
        return ""
    same = [c for c in both if kernel[c] == reference[c]]
    plain = [c for c in both if c not in same and kernel[c][2] == 0 == reference[c][2]]
    return (f". The plan made with the kernel equals the reference DP's in the at-start run above at "
            f"{len(same)} of {len(both)} contexts ("
            + ", ".join(f"{c[3:]} tokens: skip Attention {list(kernel[c][0])}, MLP {list(kernel[c][1])}, gamma* "
                        f"{kernel[c][2]}" + ("" if c in same else " against " + str(reference[c])) for c in both) + ")"
            + (f"; where they differ ({', '.join(c[3:] for c in plain)} tokens) both have gamma* 0, so both decode "
               "plainly and the run is the same" if plain else ""))


def _dp_pallas_note() -> str:
    """The at-start run with the DP's branches in the Pallas history kernel (step ...-at-start-dp-pallas)."""
    head = ("The same with the DP's branch attention in the Pallas history kernel (`--dp-attention pallas`, "
            "docs/methods.md §4.3; step qwen2.5-coder-1.5b-b16-32k-8k-plan-rows-at-start-dp-pallas): ")
    if not (inputs.RESULTS / KNAPSPEC_DP_PALLAS).exists():
        return head + "not measured yet."
    data = inputs.load(KNAPSPEC_DP_PALLAS)
    cases, fraction = data["cases"], data["config"].get("max_plan_fraction")
    parts = []
    for key, c in cases.items():
        if not (isinstance(c, dict) and "speedup_vs_ar" in c):
            continue
        ctx = key.split("/")[2][3:]
        text = f"{ctx} tokens {c['speedup_vs_ar']:.2f}x AR, planning {100 * c['plan_fraction_of_decode']:.1f} %"
        plans = c.get("plans") or []
        if plans:
            text += " (" + "; ".join(f"the plan at round {p['round']} {1e3 * p['seconds']:.0f} ms"
                                     f"{_plan_stage_split(p)}" for p in plans) + ")"
        if len(plans) > 1 and fraction and c.get("plan_fraction_of_decode"):
            total_plan = sum(p["seconds"] for p in plans)
            decode = total_plan / c["plan_fraction_of_decode"]
            kept, spent = [plans[0]], plans[0]["seconds"]
            for prev, p in zip(plans, plans[1:]):  # the run rule: a re-plan priced as the previous one
                if spent + prev["seconds"] > fraction * decode:
                    break
                kept.append(p)
                spent += p["seconds"]
            if len(kept) < len(plans):
                rest = decode - total_plan + spent
                text += (f"; the run's planning budget (no re-plan that takes the run's planning past "
                         f"{100 * fraction:.0f} % of its projected decode time, added after this run) would not "
                         f"make {len(plans) - len(kept)} of its {len(plans)} plans: planning "
                         f"{100 * spent / rest:.1f} % of decode without them (predicted, not measured)")
        split = c.get("time_split_estimate") or {}
        if c["speedup_vs_ar"] < 0.97 and c.get("rounds") == 0 and split.get("other_s") is not None:
            text += (f"; after the plan it decoded plainly ({c['ar_steps']} plain steps, no draft round), and "
                     f"{split['other_s']:.2f} s of its {c['timings']['decode_s']:.2f} s decode went outside the plan "
                     f"and the plain steps' AR-priced time (not traced)")
        check = cases.get(key.rsplit("/", 1)[0] + "/dp_attention")
        if check:
            earlier = check.get("measured_in")
            text += (f"; the DP alone on {check['rows']} rows x {check['search_tokens']} tokens"
                     + (f" (an earlier run of the step, commit {earlier['commit'][:7]})" if earlier else "") + ": "
                     f"{1e3 * check['median_reference_s']:.0f} ms with the reference attention, "
                     f"{1e3 * check['median_folded_s']:.0f} ms in the kernel "
                     f"({check['median_reference_s'] / check['median_folded_s']:.1f}x), "
                     + ("the same candidates" if check["same_masks"] else "**different candidates**")
                     + (f" (largest cosine-sum difference {check['max_value_diff']:.1e})"
                        if check.get("max_value_diff") is not None else ""))
            blocks = []
            for rows, b in (check.get("kernel_rows_per_call") or {}).items():
                blocks.append(f"{rows} rows a call " + (f"failed ({b['error'].split(':')[0]})" if "error" in b else
                              f"{1e3 * b['median_s']:.0f} ms" + ("" if b["same_masks"] else ", **different candidates**")))
            if blocks:
                text += " (the kernel's default 64 query rows a call; " + ", ".join(blocks) + ")"
        parts.append(text)
    text = head + f"`{KNAPSPEC_DP_PALLAS}`: " + "; ".join(parts) + "."
    shares = {key.split("/")[2][3:]: c["plan_fraction_of_decode"] for key, c in cases.items()
              if isinstance(c, dict) and c.get("plan_fraction_of_decode") is not None}
    over = [f"{ctx} tokens {100 * f:.1f} %" for ctx, f in shares.items() if f > 0.05]
    if shares:
        text += (" Planning at most 5 % of decode: " + ("**met** at every context" if not over else
                 f"**missed** at {', '.join(over)}; met at the other {len(shares) - len(over)} of {len(shares)}")
                 + ".")
    checks = [c for k, c in cases.items() if k.endswith("/dp_attention")]
    if any(not c["same_masks"] for c in checks):
        text += (" The two DPs agree exactly in float32 (tests, the kernel interpreted on the CPU); this run is "
                 "bf16, where the kernel and XLA's attention round each branch's attention differently, and "
                 "through 56 sub-layers that moves some cosine sums and greedy tokens enough to change the "
                 "candidate set" + _same_plan_as_reference() + "; whether all of the difference is rounding is "
                 "not shown on the GPU.")
    windows = [p["stage_seconds"].get("window", 0.0) for c in cases.values() if isinstance(c, dict)
               for p in c.get("plans", []) if p.get("stage_seconds")]
    if windows:
        text += (f" The reference window (the plan rows' K/V copied out of the batch's cache in one compiled gather, "
                 f"jaxspec.knapspec.window.cache_rows) took {1e3 * min(windows):.1f}-{1e3 * max(windows):.1f} ms a "
                 "plan; an eager copy of each layer's arrays, one dispatch each, was the plan's largest part in the "
                 "earlier run of this step.")
    return text



def _speedups_and_shares(source: str) -> str:
    """``32000 tokens 0.81x AR, planning 11.9 %; ...`` for each KnapSpec case of ``source``, or 'not measured yet'."""
    if not (inputs.RESULTS / source).exists():
        return "not measured yet"
    cases = [(k.split("/")[2][3:], c) for k, c in inputs.load(source)["cases"].items()
             if isinstance(c, dict) and "speedup_vs_ar" in c]
    return f"`{source}`: " + "; ".join(f"{ctx} tokens {c['speedup_vs_ar']:.2f}x AR, planning "
                                       f"{100 * c['plan_fraction_of_decode']:.1f} %" for ctx, c in cases)


def _plan_stage_split(plan: dict) -> str:
    """``: the target's states 0.13 s, the DP ... `` from a plan record's ``stage_seconds`` ('' without)."""
    stages = plan.get("stage_seconds")
    if not stages:
        return ""
    names = (("device_in_flight", "waiting for the device work in flight"),
             ("window", "the reference window"), ("boundary_states", "the target's states of the window"),
             ("dp", "the DP on the search tokens"), ("rescore", "rescoring the finalists on the window"),
             ("grid_search", "grid searches"), ("apply", "applying the plan"), ("other", "the rest"))
    return ": " + ", ".join(f"{label} {stages[k]:.2f} s" for k, label in names if k in stages)


def knapspec_two_stage_cpu_note() -> str:
    """The two-stage plan on the CPU (SmolLM2-135M, cpu-knapspec step smollm2-135m-1k-two-stage)."""
    if not (inputs.RESULTS / KNAPSPEC_TWO_STAGE_CPU).exists():
        return " On the CPU: not measured yet (cpu-knapspec step smollm2-135m-1k-two-stage)."
    (key, c), = [(k, v) for k, v in inputs.load(KNAPSPEC_TWO_STAGE_CPU)["cases"].items() if "speedup_vs_ar" in v]
    p, a = c["plans"][0], c["plan_allowance"]
    share = c["plan_fraction_of_decode"]
    single = inputs.load(KNAPSPEC_64REF)["cases"]["cpu/summarize/ctx1024/b1/candidates"]["plan_share_of_ar_decode"]
    return (f" On the CPU (SmolLM2-135M f32, 1k prompt, batch 1, 256 new tokens, the same options, "
            f"`{KNAPSPEC_TWO_STAGE_CPU}`): planning {100 * share:.1f} % of decode "
            f"(**{'met' if share <= 0.05 else 'missed'}**"
            f"; one single-stage DP on 64 tokens: {100 * single:.1f} %), {c['speedup_vs_ar']:.2f}x AR; the plan ran on "
            f"{p['reference_tokens']} reference tokens (the allowance's cap: {a['allowed_tokens']} fit its "
            f"{1e3 * a['plan_budget_s']:.0f} ms budget, below the floor of 64), {p['seconds']:.2f} s measured against "
            f"{p['predicted_seconds']:.2f} s predicted ({p['seconds'] / p['predicted_seconds']:.1f}x"
            + _plan_stage_split(p) + "); its best "
            f"candidate skipped {p['n_skip_attn']} Attention / {p['n_skip_mlp']} MLP sub-layers at alpha "
            f"{p['alpha']:.2f} on the window, and the grid search chose gamma* = {p['gamma_star']}"
            + (" (plain decoding)." if p["gamma_star"] == 0 else ".")
            + (f" The budget assumed the latency profile's {1e3 * c['predicted_ar_step_s']:.1f} ms AR step where the "
               f"paired AR run measured {1e3 * c['ar_step_s']:.1f} ms, so the plan the budget admitted is "
               f"{c['predicted_ar_step_s'] / c['ar_step_s']:.2f}x the share it was sized for"
               + (f"; a plan on 64 tokens at the modelled price ({a['predicted_dp_search_s']:.2f} s + 64 x "
                  f"{1e3 * a['predicted_dp_s_per_token']:.1f} ms) would be "
                  f"{100 * (a['predicted_dp_search_s'] + 64 * a['predicted_dp_s_per_token']) / (256 * c['ar_step_s']):.1f}"
                  " % of a 256-step decode at the measured step." if "predicted_dp_search_s" in a else ".")
               if c["predicted_ar_step_s"] > 1.1 * c["ar_step_s"] else "")
            + knapspec_at_start_cpu_note(c) + knapspec_after_plain_note(KNAPSPEC_AFTER_PLAIN_CPU, "cpu-knapspec step "
                                                                          "smollm2-135m-1k-two-stage-after-plain")
            + knapspec_plain_states_note()
            + knapspec_plain_priced_cpu_note(c) + knapspec_qwen_at_start_cpu_note())


def knapspec_qwen_at_start_cpu_note() -> str:
    """The at-start two-stage planner on the real Qwen2.5-Coder-1.5B on the CPU (cpu-knapspec step
    qwen2.5-coder-1.5b-1k-two-stage-at-start), against the single-stage run of the same model."""
    if not (inputs.RESULTS / KNAPSPEC_AT_START_QWEN_CPU).exists():
        return ""
    (_, c), = [(k, v) for k, v in inputs.load(KNAPSPEC_AT_START_QWEN_CPU)["cases"].items() if "speedup_vs_ar" in v]
    a = c.get("plan_allowance") or {}
    single = dict(pair for pair in inputs.load(f"{K}qwen2.5-coder-1.5b_1k_b1_cpu.json")["cases"].items()).get(
        "cpu/summarize/ctx1024/b1/knapspec") if (inputs.RESULTS / f"{K}qwen2.5-coder-1.5b_1k_b1_cpu.json").exists() else None
    text = (f" The real Qwen2.5-Coder-1.5B with the at-start planner (f32 CPU, 1k, batch 1, 256 new tokens, "
            f"`{KNAPSPEC_AT_START_QWEN_CPU}`, AR step {1e3 * c['ar_step_s']:.0f} ms): {c['speedup_vs_ar']:.2f}x AR, "
            f"planning {100 * c['plan_fraction_of_decode']:.1f} % of decode")
    if a.get("skip"):
        text += (f"; the allowance priced the DP's search alone at {a['predicted_dp_search_s']:.2f} s against a "
                 f"{a['plan_budget_s']:.2f} s budget ({1e3 * a['predicted_dp_s_per_token']:.0f} ms a reference token), "
                 "so it made no plan and decoded plainly")
    elif c.get("plans"):
        p = c["plans"][0]
        text += (f"; its plan skipped {p['n_skip_attn']} Attention / {p['n_skip_mlp']} MLP sub-layers at alpha "
                 f"{p['alpha']:.2f}, gamma* = {p['gamma_star']}")
    if single:
        text += (f" (the single-stage plan of the earlier qwen2.5-coder-1.5b-1k step, 128 new tokens: "
                 f"{single['speedup_vs_ar']:.2f}x AR with planning {100 * single['plan_fraction_of_decode']:.0f} % of "
                 "decode)")
    return text + "." + _qwen_one_finalist_cpu_note()


def _qwen_one_finalist_cpu_note() -> str:
    """The cheapest two-stage plan (2 search tokens, 1 finalist, the window's states from the prefill) on the real
    Qwen2.5-Coder-1.5B on the CPU (cpu-knapspec step qwen2.5-coder-1.5b-1k-at-start-prefill-states-1-finalist)."""
    step = "cpu-knapspec step qwen2.5-coder-1.5b-1k-at-start-prefill-states-1-finalist"
    if not (inputs.RESULTS / KNAPSPEC_ONE_FINALIST_QWEN_CPU).exists():
        return f" The same model with the cheapest two-stage plan: not measured yet ({step})."
    data = inputs.load(KNAPSPEC_ONE_FINALIST_QWEN_CPU)
    (_, c), = [(k, v) for k, v in data["cases"].items() if "speedup_vs_ar" in v]
    cfg, share = data["config"], c["plan_fraction_of_decode"]
    text = (f" The same model with the cheapest two-stage plan ({cfg.get('search_tokens')} search tokens, "
            f"{cfg.get('finalists')} finalist, the window's states kept by the prefill; {step}, "
            f"`{KNAPSPEC_ONE_FINALIST_QWEN_CPU}`): " + _start_plan_text(c))
    tokens = c["plans"][0]["reference_tokens"] if c.get("plans") else 0
    if tokens and c["plans"][0].get("predicted_seconds"):
        plan = c["plans"][0]
        text += f"; the plan ran {plan['seconds'] / plan['predicted_seconds']:.2f}x the allowance's price"
    return text + (f". At most 5 % with at least 64 reference tokens: "
                   f"**{'met' if share <= 0.05 and tokens >= 64 else 'missed'}** in this run."
                   + "".join(_qwen_cheaper_dp_cpu_note(base=c, **v) for v in QWEN_CHEAPER_DP_CPU))


#: the 1.5B's cheapest CPU plan with a cheaper DP: (file, cpu-knapspec step, what changes)
QWEN_CHEAPER_DP_CPU = (
    dict(source=KNAPSPEC_ONE_FINALIST_CAP2_QWEN_CPU,
         step="qwen2.5-coder-1.5b-1k-at-start-prefill-states-1-finalist-weight-cap-2",
         what="the knapsack weights capped at 2, `--weight-cap 2`, docs/methods.md §4.3"),
    dict(source=KNAPSPEC_ONE_FINALIST_UNROLLED_QWEN_CPU,
         step="qwen2.5-coder-1.5b-1k-at-start-prefill-states-1-finalist-dp-unrolled",
         what="the DP traced once per layer, `--dp-layers unrolled`, docs/methods.md §4.3"))


def _qwen_cheaper_dp_cpu_note(base: dict, source: str, step: str, what: str) -> str:
    """The 1.5B's cheapest CPU plan with a cheaper DP (one of :data:`QWEN_CHEAPER_DP_CPU`), against the run with the
    profile's weights and the scan (``base``)."""
    step = f"cpu-knapspec step {step}"
    if not (inputs.RESULTS / source).exists():
        return f" With {what}: not measured yet ({step})."
    (_, c), = [(k, v) for k, v in inputs.load(source)["cases"].items() if "speedup_vs_ar" in v]
    share = c["plan_fraction_of_decode"]
    tokens = c["plans"][0]["reference_tokens"] if c.get("plans") else 0
    text = f" With {what} ({step}, `{source}`): " + _start_plan_text(c)
    if c.get("plans") and base.get("plans"):
        p, q = c["plans"][0], base["plans"][0]
        same = (p["skip_attn"], p["skip_mlp"], p["gamma_star"]) == (q["skip_attn"], q["skip_mlp"], q["gamma_star"])
        text += (f"; weights {p['w_attn']} and {p['w_mlp']} (the profile's {q['w_attn']} and {q['w_mlp']}), "
                 f"the plan {p['seconds'] / q['seconds']:.2f}x as long as the scan's with the profile's weights (the DP "
                 f"{p['stage_seconds']['dp'] / q['stage_seconds']['dp']:.2f}x) and "
                 f"{p['seconds'] / p['predicted_seconds']:.2f}x its predicted price, "
                 + ("the same skip set and gamma*" if same else
                    f"another plan (skipping Attention {p['skip_attn']} / MLP {p['skip_mlp']}, gamma* = "
                    f"{p['gamma_star']})"))
    return text + (f". At most 5 % with at least 64 reference tokens: "
                   f"**{'met' if share <= 0.05 and tokens >= 64 else 'missed'}** in this run ({100 * share:.2f} %; one "
                   "run on a shared 2-core CPU).")


def knapspec_plain_priced_cpu_note(base: dict) -> str:
    """The CPU two-stage step with plain decoding priced at the decode loop's own step (the profile's p)."""
    if not (inputs.RESULTS / KNAPSPEC_PLAIN_PRICED_CPU).exists():
        return ""
    data = inputs.load(KNAPSPEC_PLAIN_PRICED_CPU)
    (_, c), = [(k, v) for k, v in data["cases"].items() if "speedup_vs_ar" in v]
    fit, a = data["latency_b1"]["fit"], c["plan_allowance"]
    share = c["plan_fraction_of_decode"]
    text = (f" Priced at the decode loop's own step instead (the profile times it beside the full step: p = "
            f"{fit['p']:.2f} against a = {fit['a']:.2f}; step smollm2-135m-1k-two-stage-plain-priced, "
            f"`{KNAPSPEC_PLAIN_PRICED_CPU}`): the predicted AR step is {1e3 * c['predicted_ar_step_s']:.1f} ms where "
            f"the paired AR run measured {1e3 * c['ar_step_s']:.1f} ms ({c['predicted_ar_step_s'] / c['ar_step_s']:.2f}x; "
            f"priced with this profile's a it would be "
            f"{c['predicted_ar_step_s'] * fit['a'] / fit['p'] / c['ar_step_s']:.2f}x; the run above, with its own "
            f"profile: {base['predicted_ar_step_s'] / base['ar_step_s']:.2f}x, so most of that miss came from that "
            f"profile's timings, which this machine did not repeat, not from a against p), the budget "
            f"{1e3 * a['plan_budget_s']:.0f} ms")
    if a.get("skip"):
        text += f", too little for the minimum window: no plan, planning {100 * share:.1f} % of decode"
    elif c.get("plans"):
        p = c["plans"][0]
        text += (f", the plan {p['reference_tokens']} reference tokens, {p['seconds']:.2f} s measured against "
                 f"{p['predicted_seconds']:.2f} s predicted; planning {100 * share:.1f} % of decode "
                 f"(**{'met' if share <= 0.05 else 'missed'}**), {c['speedup_vs_ar']:.2f}x AR, gamma* = "
                 f"{p['gamma_star']}")
    return text + " (one run on a shared 2-core CPU)."


def knapspec_calibrated_note() -> str:
    """The two-stage plan with the allowance pricing plans at their measured cost (``--plan-cost-scale-from``):
    the CPU step, and the H200 batch-16 step when measured."""
    parts = []
    for source, where in ((KNAPSPEC_CALIBRATED_CPU, "CPU, SmolLM2-135M f32, 1k, batch 1"),
                          (KNAPSPEC_PLAN_ROWS_CALIBRATED, "H200, real Qwen2.5-Coder-1.5B bf16, batch 16, 2 plan rows")):
        if not (inputs.RESULTS / source).exists():
            parts.append(f"{where}: not measured yet (`{source}`)")
            continue
        data = inputs.load(source)
        scale = data["config"].get("plan_cost_scale", 1.0)
        runs = []
        for key, c in data["cases"].items():
            if not isinstance(c, dict) or "speedup_vs_ar" not in c:
                continue
            a, ctx = c.get("plan_allowance") or {}, key.split("/")[2][3:]
            text = f"{ctx} tokens {c['speedup_vs_ar']:.2f}x AR, planning {100 * c['plan_fraction_of_decode']:.1f} %"
            if a.get("skip"):
                text += f" (no plan: {a.get('allowed_tokens')} tokens fit, under the minimum)"
            elif c.get("plans"):
                p = c["plans"][0]
                text += (f" ({p['reference_tokens']} reference tokens, {1e3 * p['seconds']:.0f} ms measured against "
                         f"{1e3 * p['predicted_seconds']:.0f} ms predicted, gamma* = {p['gamma_star']})")
                unscaled = KNAPSPEC_TWO_STAGE_CPU if source == KNAPSPEC_CALIBRATED_CPU else None
                if unscaled and (inputs.RESULTS / unscaled).exists() and "rescore" in p.get("stage_seconds", {}):
                    (_, b), = [(k, v) for k, v in inputs.load(unscaled)["cases"].items() if "speedup_vs_ar" in v]
                    bp = b["plans"][0]
                    if "rescore" in bp.get("stage_seconds", {}):
                        mine, theirs = p["stage_seconds"]["rescore"], bp["stage_seconds"]["rescore"]
                        width = p["reference_tokens"] / bp["reference_tokens"]
                        text += (f"; rescoring the finalists took {mine:.2f} s on {p['reference_tokens']} tokens "
                                 f"against {theirs:.2f} s on {bp['reference_tokens']} in the unscaled run "
                                 f"(`{unscaled}`)")
                        if width < 0.7 and mine / theirs > 0.7:
                            text += (": mostly a fixed cost per plan, which one factor on a per-token price cannot "
                                     "express, so the smaller window saved little")
                        else:
                            text += ", about in proportion to the window"
            runs.append(text)
        parts.append(f"{where}, price x {scale:.2f} (`{source}`): " + "; ".join(runs))
    return ("The allowance pricing a plan at what earlier plans of the model measured against their prediction "
            "(docs/methods.md §5.6, `--plan-cost-scale-from`): " + ". ".join(parts) + ".")


def knapspec_after_plain_note(source: str, step: str) -> str:
    """A KnapSpec run whose first plan came after plain tokens, on those alone (``--plan-after-plain``): its speed-up,
    the plan, and the plan's acceptance estimate against the acceptance its rounds measured."""
    if not (inputs.RESULTS / source).exists():
        return f" The first plan made after 64 plain tokens on those alone (`--plan-after-plain 64`): not measured yet ({step})."
    (key, c), = [(k, v) for k, v in inputs.load(source)["cases"].items() if "speedup_vs_ar" in v]
    plans = c.get("plans") or []
    text = (f" The first plan made after {inputs.load(source)['config'].get('plan_after_plain')} plain tokens on those alone "
            f"(`--plan-after-plain`, `{source}`): {c['speedup_vs_ar']:.2f}x AR, planning "
            f"{100 * c['plan_fraction_of_decode']:.1f} % of decode")
    if not plans:
        return text + ", no plan made (the planning allowance skipped it)."
    p = plans[0]
    text += (f"; its plan at step {p['round']} on {p['reference_tokens']} reference tokens skipped {p['n_skip_attn']} "
             f"Attention / {p['n_skip_mlp']} MLP sub-layers at an estimated acceptance of {p['alpha']:.2f} and chose "
             f"gamma* = {p['gamma_star']}")
    if c.get("rounds"):
        text += f"; the run's rounds measured an acceptance of {c['acceptance_rate']:.2f} (tau {c['tau']:.2f})"
    return text + "."


def knapspec_plain_states_note() -> str:
    """The plan after 64 plain tokens computing its window's target states against taking them from the plain
    stretch that decoded the window (docs/methods.md §5.6), the two runs measured one after the other with one
    latency profile."""
    found = {kind: inputs.RESULTS / path for kind, path in KNAPSPEC_AFTER_PLAIN_STATES_CPU.items()}
    if not all(path.exists() for path in found.values()):
        return (" The plan after plain tokens computing its window's states against taking them from the plain "
                "stretch: not measured yet (cpu-knapspec steps smollm2-135m-1k-two-stage-after-plain-own-states, "
                "-kept-states).")
    parts = []
    for kind, what in (("own", "computing its window's states"), ("kept", "with them kept by the plain stretch")):
        (_, c), = [(k, v) for k, v in inputs.load(found[kind])["cases"].items() if "speedup_vs_ar" in v]
        p = (c.get("plans") or [{}])[0]
        states = (p.get("stage_seconds") or {}).get("boundary_states")
        parts.append(f"{what} {c['speedup_vs_ar']:.2f}x AR, planning {100 * c['plan_fraction_of_decode']:.1f} % of "
                     f"decode" + (f" (the plan {1e3 * p['seconds']:.0f} ms, its window's states "
                                  f"{1e3 * states:.0f} ms of it)" if p.get("seconds") and states is not None else ""))
    return (f" The plan after 64 plain tokens, with a profile without the per-call cost "
            f"(`{KNAPSPEC_AFTER_PLAIN_STATES_CPU['own']}`, `{KNAPSPEC_AFTER_PLAIN_STATES_CPU['kept']}`): "
            + "; ".join(parts) + ".")


def knapspec_at_start_cpu_note(base: dict) -> str:
    """The CPU two-stage plan made before the first round (cpu-knapspec step smollm2-135m-1k-two-stage-at-start),
    beside ``base``, the same plan after round 6."""
    if not (inputs.RESULTS / KNAPSPEC_AT_START_CPU).exists():
        return (" The same plan before the first round (`--plan-at-start`): not measured yet (cpu-knapspec step "
                "smollm2-135m-1k-two-stage-at-start).")
    (key, c), = [(k, v) for k, v in inputs.load(KNAPSPEC_AT_START_CPU)["cases"].items() if "speedup_vs_ar" in v]
    p = c["plans"][0] if c.get("plans") else None
    split, base_split = c["time_split_estimate"], base["time_split_estimate"]
    return (f" The same plan made before the first round on the prompt's last 64 tokens (`--plan-at-start`, "
            f"`{KNAPSPEC_AT_START_CPU}`): {c['speedup_vs_ar']:.2f}x AR (after round 6: {base['speedup_vs_ar']:.2f}x), "
            f"planning {100 * c['plan_fraction_of_decode']:.1f} % of decode, draft + verify "
            f"{1e3 * (split['draft_s'] + split['verify_s']):.0f} ms (after round 6: "
            f"{1e3 * (base_split['draft_s'] + base_split['verify_s']):.0f} ms)"
            + (f"; the plan at round {p['round']} ran on {p['reference_tokens']} reference tokens in "
               f"{1e3 * p['seconds']:.0f} ms{_plan_stage_split(p).replace(': ', ' (', 1) + ')' if p.get('stage_seconds') else ''}, "
               f"skipped {p['n_skip_attn']} Attention / {p['n_skip_mlp']} MLP sub-layers at alpha {p['alpha']:.2f} "
               f"and chose gamma* = {p['gamma_star']}" if p else "")
            + (". The two speed-ups are within this machine's run-to-run spread of the paired AR speed-up (about "
               "±5 %)." if abs(c["speedup_vs_ar"] - base["speedup_vs_ar"]) < 0.05 else "."))


def _repriced_tpt(source: str, tag: str, ctx: int) -> str:
    """A correlation run's candidates priced again (``reprice-tpt``): with the measured acceptance in place of the
    DP's alpha, and by other latency profiles (the half-skip one, docs/methods.md §4.1): which side of the
    prediction holds the correlation back."""
    if not source or not (inputs.RESULTS / source).is_file():
        return ""
    case = inputs.load(source)["cases"].get(f"{tag}/summarize/ctx{ctx}/b1/repriced")
    if not case:
        return ""
    fmt = lambda r: "n/a" if r is None else f"{r:.2f}"  # noqa: E731
    by = {(row["profile"], row["alpha"]): row["pearson_vs_throughput"] for row in case["rows"]}
    own = case["rows"][0]["profile"]
    r_dp, r_measured = by.get((own, "dp")), by.get((own, "measured"))
    out = (f" The same candidates priced again (`{source}`, reprice-tpt): with their measured acceptance in place of "
           f"the DP's alpha, by the same latency model, r = {fmt(r_measured)} with tokens/s against {fmt(r_dp)} with "
           f"the DP's alpha")
    for profile in dict.fromkeys(row["profile"] for row in case["rows"]):
        if profile == own:
            continue
        method = next(row["method"] for row in case["rows"] if row["profile"] == profile)
        shown = "/".join(pathlib.Path(profile).parts[-2:])  # folder and name: two profiles may share a name
        out += (f"; by the {method} profile (`{shown}`) r = {fmt(by.get((profile, 'dp')))} with "
                f"the DP's alpha, {fmt(by.get((profile, 'measured')))} with the measured acceptance")
    if r_dp is not None and r_measured is not None and r_measured - r_dp >= 0.1:
        return out + ": the DP's alpha, more than the latency model, holds the prediction back."
    return out + "."


def _tpt_correlation_parts(source: str, tag: str = "cpu",
                           contexts: Sequence[int] = TPT_CORRELATION_CONTEXTS) -> Tuple[List[str], List[bool]]:
    """Per context of one TPT-correlation run (case keys under its device ``tag``): a sentence and whether the
    target was met there."""
    d = inputs.load(source)
    parts, verdicts = [], []
    for ctx in contexts:
        c = d["cases"].get(f"{tag}/summarize/ctx{ctx}/b1/correlation")
        if c is None:
            parts.append(f"At {tokens_k(ctx)}: not measured.")
            continue
        if c["plans"] < 3:
            # Pearson needs three plans; a two-stage planner hands back only its finalists (--finalists)
            fixed = fixed_cases(d, f"{tag}/summarize/ctx{ctx}/b1/fixed/")
            parts.append(f"At {tokens_k(ctx)}: only {c['plans']} plans (the two-stage planner handed back only its "
                         f"{c['plans']} finalists), so no correlation; their median paired speed-ups "
                         + ", ".join(f"{f['speedup_vs_ar']:.2f}x (predicted TPT {f['predicted_tpt']:.0f})"
                                     for f in fixed) + ".")
            continue
        r_tpt, r_tput = c["pearson_predicted_tpt_vs_speedup"], c["pearson_predicted_tpt_vs_throughput"]
        r_plain, r_acc = c.get("pearson_predicted_tpt_no_exit_vs_speedup"), c["pearson_measured_acceptance_vs_speedup"]
        ok = [r is not None and r >= 0.84 and (r_acc is None or r > r_acc) for r in (r_tpt, r_tput)]
        verdicts.append(all(ok))
        fmt = lambda r: "n/a" if r is None else f"{r:.2f}"  # noqa: E731
        fixed = fixed_cases(d, f"{tag}/summarize/ctx{ctx}/b1/fixed/")
        # the latency model fed each run's own rounds and draft steps: its time part alone
        timed = _pearson([f["ar_decode_s"] / f["latency_prediction"]["decode_s"] for f in fixed],
                         [f["speedup_vs_ar"] for f in fixed])
        errors = {mode: sum(f[f"alpha_{mode}"] - f["acceptance_rate"] for f in fixed) / len(fixed)
                  for mode, _ in DP_REFERENCES}
        abs_errors = {mode: sum(abs(f[f"alpha_{mode}"] - f["acceptance_rate"]) for f in fixed) / len(fixed)
                      for mode, _ in DP_REFERENCES}
        ar_rates = [f["ar_tokens_per_s"] for f in fixed]
        parts.append(f"At {tokens_k(ctx)} ({c['plans']} plans): r = {fmt(r_tpt)} with speed-up, {fmt(r_tput)} with "
                     f"tokens/s (the exit-free TPT {fmt(r_plain)}; the DP's alpha "
                     f"{fmt(c.get('pearson_dp_alpha_vs_speedup'))}, the measured acceptance {fmt(r_acc)}; measured speed-ups "
                     f"{min(c['measured_speedup']):.2f}-{max(c['measured_speedup']):.2f}x, predicted "
                     f"{min(c['predicted_speedup']):.2f}-{max(c['predicted_speedup']):.2f}x; the paired AR "
                     f"{min(ar_rates):.1f}-{max(ar_rates):.1f} tokens/s). The latency model fed each run's own rounds "
                     f"and draft steps gives r = {fmt(timed)}"
                     + (": the time side holds" if timed is not None and timed >= 0.84 else "")
                     + " (DP alpha - measured acceptance, mean / mean absolute: " + ", ".join(
                         f"{'the paper' if mode == 'branch' else 'target'} reference {errors[mode]:+.3f} / "
                         f"{abs_errors[mode]:.3f}" for mode, _ in DP_REFERENCES)
                     + f"; the target reference above it on {sum(f['alpha_target'] > f['acceptance_rate'] for f in fixed)}"
                     f" of {len(fixed)} plans)."
                     + _repriced_tpt(REPRICED.get(source, ""), tag, ctx))
    return parts, verdicts


def knapspec_tpt_correlation_note() -> str:
    """Predicted TPT against measured speed-up and throughput over fixed candidate plans (the paper's
    Pearson 0.837 against 0.538 for acceptance), each candidate priced as the planner prices it."""
    if not (inputs.RESULTS / KNAPSPEC_TPT_CORRELATION).exists():
        return ("Pearson of predicted TPT with throughput >= 0.84 and above acceptance's: not measured with the "
                "planner's exit-aware prices yet (step `smollm2-135m-1k-2k-tpt-correlation` of `cpu-knapspec`).")
    parts, verdicts = _tpt_correlation_parts(KNAPSPEC_TPT_CORRELATION)
    target_text = ""
    if (inputs.RESULTS / KNAPSPEC_TPT_CORRELATION_TARGET).exists():
        target_parts, target_verdicts = _tpt_correlation_parts(KNAPSPEC_TPT_CORRELATION_TARGET)
        verdicts += target_verdicts
        target_text = (f" With the DP's acceptance taken against the target's K/V (docs/methods.md §4.3; its own "
                       f"candidate plans, the same latency profile, `{KNAPSPEC_TPT_CORRELATION_TARGET}`): "
                       + " ".join(target_parts))
    if (inputs.RESULTS / KNAPSPEC_TPT_CORRELATION_REPEATS).exists():
        repeat_parts, repeat_verdicts = _tpt_correlation_parts(KNAPSPEC_TPT_CORRELATION_REPEATS)
        verdicts += repeat_verdicts
        plans = [v for k, v in inputs.load(KNAPSPEC_TPT_CORRELATION_REPEATS)["cases"].items() if "/fixed/" in k]
        spreads = [max(p["speedup_vs_ar"] for p in f["pairs"]) / min(p["speedup_vs_ar"] for p in f["pairs"]) - 1
                   for f in plans if f.get("pairs")] or [0.0]
        target_text += (f" With each plan timed in {max(len(f.get('pairs') or [1]) for f in plans)} "
                        f"(AR, plan) pairs and its median pair's speed-up (`{KNAPSPEC_TPT_CORRELATION_REPEATS}`, step "
                        f"`smollm2-135m-1k-2k-tpt-correlation-repeats`; its own DP candidates and the same latency "
                        f"profile; a plan's pairs spread {100 * min(spreads):.1f}-{100 * max(spreads):.1f} %): "
                        + " ".join(repeat_parts))
    if (inputs.RESULTS / KNAPSPEC_TPT_CORRELATION_H100).exists():
        gpu_parts, gpu_verdicts = _tpt_correlation_parts(KNAPSPEC_TPT_CORRELATION_H100, "h100", (32000,))
        verdicts += gpu_verdicts
        target_text += (f" On an H100 with the real Qwen2.5-Coder-1.5B, batch 1, on the Pallas kernel, each plan "
                        f"compiled for itself and timed in 3 (AR, plan) pairs (`{KNAPSPEC_TPT_CORRELATION_H100}`, suite "
                        f"h100-long-context step `knapspec-qwen2.5-coder-1.5b-b1-32k-tpt-correlation`): "
                        + " ".join(gpu_parts))
    else:
        target_text += (" On an H100 with the real Qwen2.5-Coder-1.5B at 32k, batch 1 (suite h100-long-context step "
                        "`knapspec-qwen2.5-coder-1.5b-b1-32k-tpt-correlation`): not measured yet.")
    if (inputs.RESULTS / KNAPSPEC_TPT_CORRELATION_H100_8).exists():
        gpu_parts, gpu_verdicts = _tpt_correlation_parts(KNAPSPEC_TPT_CORRELATION_H100_8, "h100", (32000,))
        verdicts += gpu_verdicts
        target_text += (f" The same with 8 finalists (`{KNAPSPEC_TPT_CORRELATION_H100_8}`): " + " ".join(gpu_parts))
    else:
        target_text += (" The same with 8 finalists, so that 8 plans are timed (step "
                        "`knapspec-qwen2.5-coder-1.5b-b1-32k-tpt-correlation-8-finalists`): not measured yet.")
    verdict = "met" if verdicts and all(verdicts) else ("missed" if not any(verdicts) else "met in some runs")
    why = (" The DP's alpha comes from the first 64 generated tokens; the fixed plans are measured over 256, "
           "and the skip plans' speed-ups differ by little more than the estimate's error and the paired AR's "
           "drift, so those errors reorder them. Every fixed plan drafts one token a round, and such a draft "
           "attends to the target's K/V of every earlier token, which is what the target reference scores on the "
           "window: where that estimate misses the measured acceptance with one sign on (nearly) every plan, the "
           "window's tokens were easier or harder to draft than the ones decoded after it, which no estimate on "
           "the window alone can see.")
    return (f"Pearson of predicted TPT with measured speed-up and throughput >= 0.84 and above acceptance's "
            f"(`{KNAPSPEC_TPT_CORRELATION}`, fixed candidate plans each priced as the planner's grid search prices it, "
            f"early exit modelled from the DP's confidence statistics on 64 reference tokens; the paper's reference): "
            f"**{verdict}**. " + " ".join(parts) + target_text + why)


def _pearson(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
    n = len(x)
    if n < 3:
        return None
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else None


def knapspec_alpha_notes() -> List[str]:
    if not (inputs.RESULTS / KNAPSPEC_ALPHA).exists():
        return ["The DP's acceptance estimate within 0.05 of the measured acceptance: not measured with both "
                "references yet (step `smollm2-135m-1k-64ref-alpha` of `cpu-knapspec`)."]
    d = inputs.load(KNAPSPEC_ALPHA)
    fixed = fixed_cases(d)
    err = {mode: [c[f"alpha_{mode}"] - c["acceptance_rate"] for c in fixed] for mode, _ in DP_REFERENCES}
    worst = {mode: max(map(abs, e)) for mode, e in err.items()}
    met = {mode: w <= 0.05 for mode, w in worst.items()}
    text = ("The DP's acceptance estimate within 0.05 of the measured acceptance (64 reference tokens, "
            f"{len(fixed)} fixed plans): " + "; ".join(
                f"{label}: **{'met' if met[mode] else 'missed'}**, largest error {worst[mode]:.3f}, mean "
                f"{sum(err[mode]) / len(err[mode]):+.3f}" for mode, label in DP_REFERENCES) + ".")
    chosen = chosen_fixed(d)
    if chosen is not None:
        text += (f" The planner's choice (skipped weight {chosen['weight']}, gamma {chosen['gamma']}): estimates "
                 f"{chosen['alpha_branch']:.3f} / {chosen['alpha_target']:.3f} against {chosen['acceptance_rate']:.3f}"
                 " measured.")
    text += (" The paper's reference runs the window through each candidate as one sequence, so a skipped "
             "sub-layer's error reaches every later reference token through its K/V and the estimate comes out "
             "low; a draft step sees the full model's K/V of the committed tokens, which the target reference "
             "reproduces. For a gamma = 1 plan it computes nearly the measured quantity itself, on the first 64 of "
             "the 256 positions the plan is measured on (the outputs equal AR's, so the contexts are the same): "
             "what remains of its error is that sample's. KnapSpec keeps the paper's reference by default "
             "(`--knapspec-reference-kv target` switches).")
    target_ref = [(batch, key.split("/")[2][3:], c["speedup_vs_ar"]) for batch, src in KNAPSPEC_REAL.items()
                  if (inputs.RESULTS / src).exists() for key, c in inputs.load(src)["cases"].items()
                  if key.endswith("/knapspec-target-ref") and "speedup_vs_ar" in c]
    if target_ref:
        text += (" With the target reference on the real Qwen2.5-Coder-1.5B on the H200 (method knapspec-target-ref, "
                 "the real-weights note below) it decodes at " + ", ".join(
                     f"{x:.2f}x AR ({ctx} tokens, batch {b})" for b, ctx, x in target_ref) + ".")
    else:
        text += " Which plans the DP picks with the target reference, and what they decode at, is not measured yet."
    return [text]
