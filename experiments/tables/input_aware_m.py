"""Dustin's input-aware m (docs/methods.md §3.7): choosing the selection's m per round or per length.

* the input-aware rules against fixed m and the per-round oracle (``dustin_quality_input_aware_m_*``;
  :func:`m_rule_rows`, :func:`m_rule_table`, :func:`m_rule_verdicts`, :func:`oracle_persistence_note`);
* the profile's m per context length (:func:`m_per_length_rows`, :func:`m_per_length_blocks`,
  :func:`m_per_length_verdicts`), and the coverage rule around it deciding every third round
  (:func:`m_per_length_held_rows`, :func:`m_per_length_held_blocks`);
* how predictable the per-round best m is (``dustin_quality_m_bounds_*``; :func:`m_bounds_blocks`,
  :func:`m_bounds_verdict`);
* the rules' selection cost against the fixed rule (``selection/``; :func:`selection_cost_tables`,
  :func:`selection_cost_verdicts`, :func:`input_aware_reach_note`).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Tuple

from experiments.tables import inputs
from experiments.tables.inputs import (HELD_SELECTION_RULES, INPUT_AWARE_M, INPUT_AWARE_M_PER_LENGTH, M_EVERY_LOOP,
                                       M_EVERY_LOOP_METHODS, M_EVERY_LOOP_TRACE,
                                       INPUT_AWARE_M_PER_LENGTH_HELD, M_BOUNDS,
                                       M_BOUND_TAGS, M_BOUND_TAGS_3KINDS, M_RULES, SELECTION_COST, SELECTION_RULE_TAGS,
                                       m_bounds_3kinds, selection_rules_of, tokens_k)


# ---------------------------------------------------------------------------- Dustin input-aware m (from the JSON)
#: the dustin-quality methods of docs/methods.md §3.7 (max-mass, coverage, the per-round oracle)
M_RULE_METHOD_NAMES = tuple(method for method, _, _ in M_RULES) + ("dustin-h-oracle",)


RULE_METHODS = tuple(method for method, _, _ in M_RULES)


def m_rule_rows(cases: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per k (mean over items): ARR of fixed m (dustin-h), each input-aware rule and the oracle, the
    share of the fixed-m-to-oracle ARR gap each rule closes, agreement with dense, accuracy, and
    the selection seconds per round (fixed vs each rule, on the same signals). ARR and the
    per-round records come from the dense reference runs (``arr``, ``m_rule``), so they exist as
    soon as an item's reference is measured; agreement and accuracy from each method's decode."""
    methods = ("dustin-h",) + M_RULE_METHOD_NAMES
    arrs: Dict[Tuple[str, int], List[float]] = {}
    stats: Dict[Tuple[str, int], List[dict]] = {}
    decodes: Dict[Tuple[str, int], List[dict]] = {}
    for record in cases.values():
        if "method" in record:
            if record["method"] in methods:
                decodes.setdefault((record["method"], record["budget"]), []).append(record)
            continue
        for key, value in (record.get("arr") or {}).items():
            name, _, budget = key.rpartition("/k")
            if name in methods and value is not None:
                arrs.setdefault((name, int(budget)), []).append(value)
        for key, value in (record.get("m_rule") or {}).items():
            name, _, budget = key.rpartition("/k")
            stats.setdefault((name, int(budget)), []).append(value)

    def mean(values):
        values = [x for x in values if x is not None]
        return sum(values) / len(values) if values else None

    rows = []
    for budget in sorted({b for _, b in arrs}):
        fixed, oracle = mean(arrs.get(("dustin-h", budget), [])), mean(arrs.get(("dustin-h-oracle", budget), []))
        row = {"k": budget, "items": len(arrs.get(("dustin-h", budget), [])),
               "m_fixed": mean([r.get("m") for r in decodes.get(("dustin-h", budget), [])])}
        for method, tag in (("dustin-h", "fixed"),) + tuple((m, t) for m, t, _ in M_RULES) + (
                ("dustin-h-oracle", "oracle"),):
            arr = mean(arrs.get((method, budget), []))
            row[f"arr_{tag}"] = arr
            row[f"match_{tag}"] = mean([r.get("match_rate") for r in decodes.get((method, budget), [])])
            row[f"accuracy_{tag}"] = mean([r.get("accuracy") for r in decodes.get((method, budget), [])])
            if method in RULE_METHODS:
                gap = None if oracle is None or fixed is None else oracle - fixed
                row[f"gap_closed_{tag}"] = (arr - fixed) / gap if arr is not None and gap and gap > 0 else None
                per_item = stats.get((method, budget), [])
                row[f"selection_s_{tag}"] = mean([r.get("selection_s_input_aware") for r in per_item])
                row[f"selection_s_fixed_{tag}"] = mean([r.get("selection_s_fixed") for r in per_item])
                row[f"selection_ratio_{tag}"] = mean([r.get("selection_cost_ratio") for r in per_item])
                row[f"mean_m_{tag}"] = mean([mean(r["m_per_round"]) for r in per_item if r.get("m_per_round")])
            if method == "dustin-h-oracle":
                row["mean_m_oracle"] = mean([mean(r["m_per_round"]) for r in stats.get((method, budget), [])
                                             if r.get("m_per_round")])
        row["selection_s_fixed"] = next((row[f"selection_s_fixed_{t}"] for _, t, _ in M_RULES
                                         if row.get(f"selection_s_fixed_{t}") is not None), None)
        rows.append(row)
    return rows


def _item_of(key: str) -> str:
    """A dustin-quality case key's item: ``.../dense`` or ``.../{method}/k{K}`` without that tail."""
    return key[: -len("/dense")] if key.endswith("/dense") else key.rsplit("/", 2)[0]


def m_per_length_rows(source: str, base: str, items: Optional[set] = None) -> List[Dict[str, Any]]:
    """Per k: the run with the profile's m per context length (``source``) against the run with its single m on the
    same items (``base``): m, ARR, the share of the single m's gap to the oracle closed, token match with dense and
    accuracy of the single m, the coverage rule around it, the length's m, the coverage rule around that, and the
    oracle; raises ValueError if the two runs did not decode the same items to the same dense tokens. ``items``:
    only these items (of the two runs' shared ones)."""
    mine, theirs = inputs.load(source)["cases"], inputs.load(base)["cases"]
    dense = {k for k in mine if k.endswith("/dense")}
    if dense != {k for k in theirs if k.endswith("/dense")}:
        raise ValueError(f"{source}: not the items of {base}")
    same = {k[: -len("/dense")] for k in dense if mine[k]["tokens"] == theirs[k]["tokens"]}
    if items is not None:
        same &= set(items)
    if not same:
        raise ValueError(f"{source}: no item's dense tokens equal {base}'s")
    # runs on two GPUs can round one item's dense decode apart: only the items both decoded alike are compared
    mine, theirs = ({k: v for k, v in cases.items() if _item_of(k) in same} for cases in (mine, theirs))
    single = {r["k"]: r for r in m_rule_rows(theirs)}
    rows = []
    for r in m_rule_rows(mine):
        b = single.get(r["k"])
        if b is None:
            continue
        fixed, oracle = b["arr_fixed"], b["arr_oracle"]
        gap = None if fixed is None or oracle is None else oracle - fixed
        row = {"k": r["k"], "items": r["items"], "items_differing": len(dense) - len(same),
               "m_fixed": b["m_fixed"], "m_length": r["m_fixed"],
               "mean_m_coverage": b.get("mean_m_coverage"), "mean_m_length_coverage": r.get("mean_m_coverage"),
               "selection_ratio_length_coverage": r.get("selection_ratio_coverage"),
               "selection_ratio_coverage": b.get("selection_ratio_coverage")}
        for tag, src, field in (("fixed", b, "fixed"), ("coverage", b, "coverage"), ("length", r, "fixed"),
                                ("length_coverage", r, "coverage"), ("oracle", b, "oracle")):
            row[f"arr_{tag}"] = src.get(f"arr_{field}")
            row[f"match_{tag}"] = src.get(f"match_{field}")
            row[f"accuracy_{tag}"] = src.get(f"accuracy_{field}")
            if tag not in ("fixed", "oracle"):
                arr = row[f"arr_{tag}"]
                row[f"gap_closed_{tag}"] = (arr - fixed) / gap if arr is not None and gap and gap > 0 else None
        rows.append(row)
    return rows


def m_run_label(source: str) -> str:
    """An input-aware-m run's label: its item contexts, the device where it is not the CPU, and the
    coverage rule's candidate ladder where it is wider than one step (``--m-steps``)."""
    steps = inputs.load(source).get("config", {}).get("m_steps", 1)
    return (items_context(source) + (", H200" if source.endswith("_h200.json") else "")
            + (", H100" if source.endswith("_h100.json") else "")
            + (f", coverage ladder of {steps} steps" if steps and steps != 1 else ""))


def items_context(source: str) -> str:
    return "/".join(sorted({tokens_k(c["context"]) for c in inputs.load(source)["cases"].values() if "context" in c}))


def oracle_m_persistence(source: str) -> Tuple[float, int]:
    """``(r, pairs)``: the lag-1 correlation, over consecutive rounds of one item and one k, of the oracle's
    per-round m minus its mean at that k in the file (how much the previous round's best m says about this
    round's), and the number of round pairs it rests on."""
    per_k: Dict[str, List[List[int]]] = {}
    for key, case in inputs.load(source)["cases"].items():
        if key.endswith("/dense") and isinstance(case.get("m_rule"), dict):
            for name, stats in case["m_rule"].items():
                if name.startswith("dustin-h-oracle/") and "m_per_round" in stats:
                    per_k.setdefault(name, []).append(stats["m_per_round"])
    pairs = []
    for runs in per_k.values():
        values = [m for run in runs for m in run]
        mean = sum(values) / len(values)
        pairs += [(a - mean, b - mean) for run in runs for a, b in zip(run[:-1], run[1:])]
    if len(pairs) < 3:
        return float("nan"), len(pairs)
    xs, ys = zip(*pairs)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    cov = sum((x - mx) * (y - my) for x, y in pairs)
    var = (sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys)) ** 0.5
    return (cov / var if var > 0 else float("nan")), len(pairs)


def oracle_persistence_note() -> str:
    """Whether a rule that follows the previous round's best m (a feedback rule) has anything to follow."""
    parts, seen = [], set()
    for model, source in INPUT_AWARE_M:
        r, n = oracle_m_persistence(source)
        name = f"{model} {items_context(source)}"
        if n and name not in seen:  # two files of one model and context share the same dense reference rounds
            seen.add(name)
            parts.append(f"{name} {r:+.2f} ({n} pairs)")
    return ("Does the best m persist from round to round? The lag-1 correlation of the oracle's per-round m (minus "
            "its mean at the same k), over consecutive rounds of an item: " + "; ".join(parts) + ". Small, or "
            "resting on few pairs: a round whose ARR is best with more draft positions is followed about as "
            "often by one that wants fewer, so a feedback rule that carries the previous round's best m forward "
            "has little to carry on these items (16 new tokens, 3-6 rounds an item), and the oracle's gain over "
            "fixed m comes from round-by-round choices that do not persist.")


def m_bounds_blocks() -> List[str]:
    """dustin-m-bounds: per k, fixed m, the oracle and the three per-round choices, with the gap each closes."""
    out = []
    for model, source in M_BOUNDS:
        data = inputs.load(source)
        extra = m_bounds_3kinds(source)
        tags = M_BOUND_TAGS + (M_BOUND_TAGS_3KINDS if extra else ())
        lines = ["| k | fixed m | rounds | ARR fixed | ARR oracle | oracle's m (mean ± sd, range) | "
                 + " | ".join(f"{label}: gap closed" for _, _, label in tags) + " |",
                 "|---|---|---|---|---|---|" + "---|" * len(tags)]
        for key, study in data.items():
            if not (key.startswith("k") and isinstance(study, dict) and "gap_closed" in study):
                continue
            om = study["oracle_m"]
            other = extra.get(key)
            lines.append(f"| {study['k']} | {study['m']} | {study['rounds']} | {study['arr']['fixed']:.4f} | "
                         f"{study['arr']['oracle']:.4f} | {om['mean']:.0f} ± {om['std']:.0f} ({om['min']}-{om['max']}) | "
                         + " | ".join("-" if study["gap_closed"].get(f) is None else
                                      f"{100 * study['gap_closed'][f]:+.0f} %"
                                      + (f" (m {study['best_fixed_m']['all']})" if f == "best_fixed" else "")
                                      + (" (m " + ", ".join(map(str, study["best_fixed_m"]["folds"])) + ")"
                                         if f == "best_fixed_crossval" and study.get("best_fixed_m", {}).get("folds")
                                         else "")
                                      + (f" (m {study['length_m']})" if f == "length_m" else "")
                                      for f, _, _ in M_BOUND_TAGS)
                         + "".join(" | " + ("-" if other is None or other["gap_closed"].get(f) is None else
                                            f"{100 * other['gap_closed'][f]:+.0f} %"
                                            + (f" (m {other['length_m']})" if f == "length_m" else ""))
                                   for f, _, _ in (M_BOUND_TAGS_3KINDS if extra else ())) + " |")
        cfg = data["config"]
        out.append(f"How predictable the best m is ({model}, `{source}`, `dustin-m-bounds`: {len(data['tasks'])} "
                   f"evaluation tasks at {cfg['lengths']} tokens decoded greedily with full-KV verification, "
                   f"{cfg['max_new_tokens']} new tokens, every round's ARR as a function of m). Carrying the previous "
                   "round's best m forward is what a rule that learns m from finished rounds gets if the best m "
                   "persists; the next round's target signal (the last committed token's SRH attention over the "
                   "history, the one view of the verification's attention a sparse round has) standing in for the "
                   "recall weights is an optimistic stand-in for rules that score m against that signal; the "
                   "hindsight rule applies it causally (the candidate among m and m ∓ one "
                   "step that would have covered the most of this round's target signal with the previous "
                   "round's signals). One m for every round, the one with the highest mean ARR over these rounds, "
                   "bounds what recalibrating the fixed m for these tasks and this length gets; the same m chosen "
                   "on the other half of the sequences and scored on this half (two folds) is that recalibration "
                   "on held-out tasks.\n\n" + "\n".join(lines))
    return out


def _held_cost_clause() -> str:
    """The measured selection cost per round of the coverage rule deciding every third round (bench-selection
    coverage-held3), per device where run."""
    measured = {device: [c["ratio_to_fixed"]["coverage-held3"] for c in inputs.load(source)["cases"].values()
                         if "coverage-held3" in c.get("ratio_to_fixed", {})]
                for device, source in SELECTION_COST if "cost_held_" in source and (inputs.RESULTS / source).exists()}
    measured = {d: r for d, r in measured.items() if r}
    if not measured:
        return "; its selection cost per round is not measured yet (bench-selection coverage-held3)"
    return ("; measured per round (bench-selection coverage-held3: one decision and two selections with the held m), "
            "its selection costs " + ", ".join(
                f"{min(r):.2f}-{max(r):.2f}x on the {d.upper() if d != 'cpu' else 'CPU'} (within 1.1x at "
                f"{sum(x <= 1.1 for x in r)} of {len(r)} points)" for d, r in measured.items())
            + " the fixed rule's (not yet on a GPU where not listed)")


def _three_kinds_clause(source: str) -> str:
    """The m recalibrated on tasks of the evaluation's kinds, in the verdict's words ("" without that run)."""
    extra = list(m_bounds_3kinds(source).values())
    if not extra:
        return ""

    def mean(field):
        vals = [s["gap_closed"][field] for s in extra if s["gap_closed"].get(field) is not None]
        return 100 * sum(vals) / len(vals) if vals else float("nan")

    return ("; recalibrated instead on calibration tasks of the evaluation's three kinds ("
            + ", ".join(f"{s['length_m'] / s['m']:.2f}x" for s in extra if s["m"]) + f" the profiled m) "
            f"{mean('length_m'):+.0f} %, and the coverage rule around it {mean('coverage_length_m'):+.0f} %"
            + (f" ({mean('coverage_length_m_held3'):+.0f} % deciding every third round)"
               if any(s["gap_closed"].get("coverage_length_m_held3") is not None for s in extra) else ""))


def m_bounds_verdict() -> List[str]:
    """What the dustin-m-bounds runs say about the input-aware-m target."""
    out = []
    for model, source in M_BOUNDS:
        data = inputs.load(source)
        studies = [s for k, s in data.items() if k.startswith("k") and isinstance(s, dict) and "gap_closed" in s]
        if not studies:
            continue

        def mean(field):
            vals = [s["gap_closed"][field] for s in studies if s["gap_closed"].get(field) is not None]
            return 100 * sum(vals) / len(vals) if vals else float("nan")

        gap = [s["arr"]["oracle"] - s["arr"]["fixed"] for s in studies]
        out.append(f"{model}, {data['config']['lengths']} tokens (`dustin-m-bounds`): the per-round oracle is "
                   f"{min(gap):.4f}-{max(gap):.4f} ARR above fixed m; carrying the previous round's best m closes "
                   f"{mean('persistence'):+.0f} % of that gap on average over k, the next round's target signal as "
                   f"the weights {mean('signal_proxy'):+.0f} %, and the hindsight rule {mean('hindsight'):+.0f} %"
                   + (f"; one m for every round, the best for these rounds, {mean('best_fixed'):+.0f} %, and the "
                      f"best of the other half of the sequences {mean('best_fixed_crossval'):+.0f} % (the best single "
                      f"m is " + ", ".join(f"{s['best_fixed_m']['all'] / s['m']:.2f}x" for s in studies
                                           if s.get("best_fixed_m") and s["m"])
                      + " the profile's m over k; the oracle's mean m " + ", ".join(
                          f"{s['oracle_m']['mean'] / s['m']:.2f}x" for s in studies if s["m"]) + ")"
                      if any(s["gap_closed"].get("best_fixed") is not None for s in studies) else "")
                   + (f"; the coverage rule on the recorded signals {mean('coverage'):+.0f} %, and with its "
                      f"candidates around the held-out single m {mean('coverage_crossval'):+.0f} %"
                      if any(s["gap_closed"].get("coverage") is not None for s in studies) else "")
                   + ("; the profile's m for this length (recalibrated on calibration tasks of it, "
                      + ", ".join(f"{s['length_m'] / s['m']:.2f}x" for s in studies if s.get("length_m") is not None
                                  and s["m"]) + f" the profiled m over k) {mean('length_m'):+.0f} %, and the coverage "
                      f"rule around it {mean('coverage_length_m'):+.0f} %"
                      if any(s["gap_closed"].get("length_m") is not None for s in studies) else "")
                   + (f"; deciding only every third round (each row's m held in the two rounds between, where "
                      f"the fixed rule selects with it), the coverage rule closes {mean('coverage_held3'):+.0f} %"
                      + (f" around the profile's m and {mean('coverage_length_m_held3'):+.0f} % around the length's"
                         if any(s["gap_closed"].get("coverage_length_m_held3") is not None for s in studies) else "")
                      + _held_cost_clause()
                      if any(s["gap_closed"].get("coverage_held3") is not None for s in studies) else "")
                   + _three_kinds_clause(source) + ". "
                   + ("The best m does not persist from round to round" if mean("persistence") < 33 else
                      "The best m persists from round to round")
                   + (", and the target's own signal, scored as if it were the verification's attention, favours "
                      "the sets built from it (below fixed m)" if mean("signal_proxy") < 0 else "")
                   + (": none of the three per-round choices reaches a third of the gap here, so these signals do "
                      "not predict the oracle's m well enough for the 33 % target"
                      + ("; nor does one m recalibrated on held-out tasks of this length"
                         if mean("best_fixed_crossval") < 33 else "") + "."
                      if max(mean(f) for f, _, _ in M_BOUND_TAGS[:3]) < 33 else "."))
    return out


def _input_aware_reach(device: str) -> int:
    """The longest item context of the input-aware-m files run on ``device`` (0: none)."""
    return max((c["context"] for _, s in INPUT_AWARE_M if s.endswith(f"_{device}.json")
                for c in inputs.load(s)["cases"].values() if "context" in c), default=0)


def _loop_rows(source: str) -> Dict[str, Dict[str, Any]]:
    """The m-every dustin-speed file's rows at 32k/b16 by method, with ``ms_per_round`` (a round of the batch:
    batch x tau tokens)."""
    rows = {r["method"]: dict(r) for r in inputs.load(source)["cases"]["ctx32768/b16"]["rows"]}
    for row in rows.values():
        row["ms_per_round"] = 1e3 * row["batch"] * row["tau"] / row["tok_s"]
    return rows


def m_every_loop_blocks() -> List[str]:
    """The held rule's rounds as the decoding loop runs them (dustin-speed), per device."""
    out = []
    for device, (source, step) in M_EVERY_LOOP.items():
        if not (inputs.RESULTS / source).exists():
            out.append(f"The held rule in the decoding loop on the {device.upper()} (7B-shaped target + 0.5B-shaped draft, "
                       f"32k, batch 16, k = 512; suite step `{step}`): not measured yet.")
            continue
        rows, data = _loop_rows(source), inputs.load(source)
        lines = ["| method | tok/s | x AR | tau | ms per round | selection ms per round |", "|---|---|---|---|---|---|"]
        for method, label in (("ar", "AR"),) + M_EVERY_LOOP_METHODS:
            r = rows.get(method)
            if r is None:
                continue
            sel = r.get("selection_ms_per_round", r.get("selection_ms"))
            lines.append(f"| {label} | {r['tok_s']:.0f} | {r['speedup']:.2f}x | {r['tau']:.2f} | "
                         f"{r['ms_per_round']:.2f} | {'-' if sel is None else f'{sel:.3f}'} |")
        out.append(f"The held rule in the decoding loop (`{source}`, {data['environment'].get('devices', ['?'])[0]}, "
                   f"7B-shaped target + 0.5B-shaped draft, 32k, batch 16, k = 512, "
                   f"{data['config'].get('new_tokens')} new tokens, every method at the tau the real pair measured "
                   f"for Dustin; one process): the round time comes from the loop's tokens per second; the selection "
                   f"per round is the selection alone on one round's signals, each round of a cycle as the loop "
                   f"compiles it, averaged over the cycle:\n\n" + "\n".join(lines))
        trace = M_EVERY_LOOP_TRACE[device]
        if (inputs.RESULTS / trace).exists():
            from experiments.tables.dustin_speed import traced_rounds

            traced = traced_rounds(inputs.load(trace))
            lines = ["| method | x AR (traced run) | ms per round | device-busy ms per round | idle | kernels launched "
                     "per round |", "|---|---|---|---|---|---|"]
            for method, label in M_EVERY_LOOP_METHODS:
                t = traced.get(method)
                if t is None:
                    continue
                idle = 1 - t["plane"]["busy_s"] / t["plane"]["span_s"]
                lines.append(f"| {label} | {t['speedup']:.2f}x | {t['round_ms']:.2f} | {t['busy_ms_per_round']:.2f} | "
                             f"{100 * idle:.0f} % | {t['launches_per_round']:.0f} |")
            out.append(f"The same methods with the device traced (`{trace}`; a second run, one generation traced, "
                       f"rounds = new tokens / tau):\n\n" + "\n".join(lines))
    return out


def m_every_loop_verdicts() -> List[str]:
    out = []
    for device, (source, _) in M_EVERY_LOOP.items():
        if not (inputs.RESULTS / source).exists():
            continue
        rows = _loop_rows(source)
        fixed = rows.get("dustin")
        if fixed is None:
            continue
        parts = []
        for method, label in M_EVERY_LOOP_METHODS[1:]:
            r = rows.get(method)
            if r is None:
                continue
            sel = r.get("selection_ms_per_round")
            extra = r["ms_per_round"] - fixed["ms_per_round"]
            # in the loop: the fixed rule's selection plus what the held rule's round takes beyond the fixed m's
            in_loop = (fixed["selection_ms"] + extra) / fixed["selection_ms"]
            parts.append(f"{label}: round {r['ms_per_round'] / fixed['ms_per_round']:.3f}x the fixed m's "
                         f"({extra:+.2f} ms), so its selection in the loop costs {in_loop:.2f}x the fixed rule's "
                         f"(target <= 1.1x: **{'met' if in_loop <= 1.1 else 'missed'}**)"
                         + ("" if sel is None else
                            f"; alone on one round's signals {sel / fixed['selection_ms']:.2f}x"))
        if parts:
            out.append(f"Held rule in the decoding loop, {device.upper()} (32k, batch 16): " + "; ".join(parts) + ".")
    return out


def selection_cost_tables() -> List[str]:
    """The bench-selection runs: each rule's selection per round against the fixed rule's, same signals."""
    out = []
    for device, source in SELECTION_COST:
        if not (inputs.RESULTS / source).exists():
            continue
        data = inputs.load(source)
        rules = [r for r in SELECTION_RULE_TAGS if any(r in c["ratio_to_fixed"] for c in data["cases"].values())]
        lines = ["| positions | batch | k | m | fixed rule ms | " + " | ".join(f"{r} / fixed" for r in rules) + " |",
                 "|---|---|---|---|---|" + "---|" * len(rules)]
        for case in data["cases"].values():
            lines.append(f"| {case['context']} | {case['batch']} | {case['k']} | {case['m']} | "
                         f"{1e3 * case['seconds']['fixed']:.3f} | "
                         + " | ".join(f"{case['ratio_to_fixed'][r]:.2f}x" if r in case["ratio_to_fixed"] else "-"
                                      for r in rules) + " |")
        checked = [c[f] for c in data["cases"].values() for f in (
            "coverage_equals_reference", "coverage_ladder_equals_reference", "coverage_sort_equals_reference",
            "coverage_radix_equals_reference") if f in c]
        out.append(f"The selection alone, each rule against the fixed rule on the same seeded signals in one process "
                   f"(`{source}`, {data['environment'].get('devices', ['?'])[0] if device != 'cpu' else 'CPU'}, "
                   f"each budget's sinks, window and m from the Qwen2.5-Coder pair's profile; best of "
                   f"{data['config']['repeats']} interleaved timings of {data['config']['iters']} calls)"
                   + (f"; the coverage rule's sets equal its direct reference in {sum(checked)} of {len(checked)} "
                      "cases" if checked else "") + ":\n\n" + "\n".join(lines))
    return out


def selection_cost_verdicts() -> List[str]:
    out = []
    for device, source in SELECTION_COST:
        if not (inputs.RESULTS / source).exists():
            continue
        cases = list(inputs.load(source)["cases"].values())
        for rule in selection_rules_of(source, SELECTION_RULE_TAGS):
            ratios = [c["ratio_to_fixed"][rule] for c in cases if rule in c["ratio_to_fixed"]]
            if not ratios:
                continue
            cycle = [c["ratio_to_fixed_cycle"][rule] for c in cases if rule in c.get("ratio_to_fixed_cycle", {})]
            if cycle:  # a program of three rounds: judged against the fixed rule's own (fixed-cycle3)
                out.append(_cycle_verdict(device, rule, cases, cycle))
                continue
            inside = sum(r <= 1.1 for r in ratios)
            worst = [f"{c['context'] // 1024}k/b{c['batch']}/k{c['k']}" for c in cases
                     if c["ratio_to_fixed"].get(rule, 0) > 1.1]
            rows = [c["ratio_to_fixed"][rule] / c["ratio_to_fixed"]["fixed-rows"] for c in cases
                    if rule in HELD_SELECTION_RULES and "fixed-rows" in c["ratio_to_fixed"]]
            fixed_rows = [c["ratio_to_fixed"]["fixed-rows"] for c in cases if "fixed-rows" in c["ratio_to_fixed"]]
            out.append(f"Selection cost, {rule} rule, {device.upper() if device != 'cpu' else 'CPU'} "
                       f"(bench-selection): {min(ratios):.2f}-{max(ratios):.2f}x the fixed rule, within 1.1x at "
                       f"{inside} of {len(ratios)} points (target <= 1.1x: **{'met' if inside == len(ratios) else 'missed'}**"
                       + (f"; over at {', '.join(worst)}" if worst else "") + ")"
                       + ((f". Its rounds between decisions select with the fixed rule's per-row path, which itself runs "
                           f"{min(fixed_rows):.2f}-{max(fixed_rows):.2f}x the fixed rule's own path here (a mask where "
                           f"the fixed rule then extracted and scattered indices): against that path the held rule costs "
                           f"{min(rows):.2f}-{max(rows):.2f}x, so part of its margin was a cheaper fixed selection, which "
                           f"the fixed rule has used since"
                           if inputs.load(source).get("fixed_rule_draft_part") != "mask" else
                           f". Its rounds between decisions select with the per-row path, the fixed rule's own since "
                           f"it selects the draft's part as a mask too ({min(fixed_rows):.2f}-{max(fixed_rows):.2f}x "
                           f"the fixed rule here, the same work)") if rows else "")
                       + _cond_clause(cases, rule) + ".")
    return out


def _cycle_verdict(device: str, rule: str, cases, cycle) -> str:
    """The held rule's three rounds as one program (the unrolled loop's cycle) against the fixed rule's three rounds
    as one program, and what each call's fixed cost hides in the per-call comparison."""
    inside = sum(r <= 1.1 for r in cycle)
    worst = [f"{c['context'] // 1024}k/b{c['batch']}/k{c['k']}" for c in cases
             if c.get("ratio_to_fixed_cycle", {}).get(rule, 0) > 1.1]
    per_call = [c["ratio_to_fixed"]["fixed-cycle3"] for c in cases if "fixed-cycle3" in c["ratio_to_fixed"]]
    return (f"Selection cost, {rule} rule, {device.upper() if device != 'cpu' else 'CPU'} (bench-selection, its three "
            f"rounds as one program with each round's kind compiled in, as the unrolled decoding loop runs them): "
            f"{min(cycle):.2f}-{max(cycle):.2f}x the fixed rule's three rounds as one program (fixed-cycle3), within "
            f"1.1x at {inside} of {len(cycle)} points (target <= 1.1x: "
            f"**{'met' if inside == len(cycle) else 'missed'}**" + (f"; over at {', '.join(worst)}" if worst else "")
            + ")" + (f". A program of three fixed rounds takes {min(per_call):.2f}-{max(per_call):.2f}x three single "
                     f"calls' time per round here: a call's fixed cost, which the per-call comparisons above include "
                     f"and a decoding loop (one program) pays once" if per_call else "")
            + _cond_clause(cases, rule) + ".")


def _cond_clause(cases, rule: str) -> str:
    """For the held rule run through ``select_held``'s ``lax.cond`` or as the unrolled loop's one program: its time
    against the same rounds scheduled from the host, in the same process (and the unrolled one's against the
    conditional's)."""
    def against(other):
        return [c["ratio_to_fixed"][rule] / c["ratio_to_fixed"][other] for c in cases
                if other in c["ratio_to_fixed"] and rule in c["ratio_to_fixed"]]

    if rule not in ("coverage-held3-cond", "coverage-held3-unrolled") or not against("coverage-held3"):
        return ""
    host = against("coverage-held3")
    what = "the conditional path" if rule == "coverage-held3-cond" else "the unrolled program"
    cond = against("coverage-held3-cond") if rule == "coverage-held3-unrolled" else []
    return (f"; against the same three rounds scheduled from the host (coverage-held3, same process) {what} takes "
            f"{min(host):.2f}-{max(host):.2f}x"
            + (f", against the conditional path (coverage-held3-cond) {min(cond):.2f}-{max(cond):.2f}x" if cond else ""))


def input_aware_reach_note() -> str:
    cpu, gpu, h100 = _input_aware_reach("cpu"), _input_aware_reach("h200"), _input_aware_reach("h100")
    h200 = (f"beyond {gpu // 1000}k on the H200 (step h200-dustin-quality/32k-input-aware-m)" if gpu else
            "the H200 at 16k-32k (suite step h200-dustin-quality/16k-input-aware-m)")
    return (f"Not measured: beyond {cpu // 1024}k on the CPU, and {h200}"
            + (f"; on an H100 up to {h100 // 1000}k (its acceptance and agreement do not depend on the GPU, the "
               "selection times do)." if h100 else "."))


def m_rule_table(source: str) -> str:
    """Fixed m, max-mass, coverage and the oracle per k: ARR, gap closed, agreement, accuracy, selection time."""
    cases = inputs.load(source)["cases"]
    rows = m_rule_rows(cases)

    def f3(x):
        return "-" if x is None else f"{x:.4f}"

    def f2(x):
        return "-" if x is None else f"{x:.2f}"

    def pct(x):
        return "-" if x is None else f"{100 * x:.0f} %"

    def ms(x):
        return "-" if x is None else f"{1e3 * x:.3f}"

    rules = [(t, name) for _, t, name in M_RULES if any(r[f"arr_{t}"] is not None for r in rows)]  # in this file
    names = " / ".join(name for _, name in rules)
    tags = ("fixed",) + tuple(t for t, _ in rules) + ("oracle",)
    lines = [f"| k | ARR fixed / {names} / oracle | gap closed {names} | token match vs dense fixed / {names} / oracle "
             f"| accuracy fixed / {names} / oracle | selection ms per round fixed / {names} | mean m per round "
             f"fixed / {names} / oracle |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['k']} | {' / '.join(f3(r[f'arr_{t}']) for t in tags)} "
            f"| {' / '.join(pct(r[f'gap_closed_{t}']) for t, _ in rules)} "
            f"| {' / '.join(f2(r[f'match_{t}']) for t in tags)} "
            f"| {' / '.join(f2(r[f'accuracy_{t}']) for t in tags)} "
            f"| {' / '.join(ms(r[f]) for f in ('selection_s_fixed',) + tuple(f'selection_s_{t}' for t, _ in rules))} "
            f"| {' / '.join('-' if r.get(f) is None else f'{r[f]:.0f}' for f in ('m_fixed',) + tuple(f'mean_m_{t}' for t, _ in rules) + ('mean_m_oracle',))} |")
    return "\n".join(lines)


def m_rule_verdicts(source: str) -> List[str]:
    """The targets of the input-aware m against the measured rows (computed, not written by hand)."""
    rows = m_rule_rows(inputs.load(source)["cases"])
    out = []
    for _, tag, name in M_RULES:
        if all(r[f"arr_{tag}"] is None for r in rows):  # the rule was not run in this file
            continue
        worse = [r["k"] for r in rows if r[f"arr_{tag}"] is not None and r[f"arr_{tag}"] < r["arr_fixed"] - 1e-9]
        in_force = [r for r in rows if r[f"selection_ratio_{tag}"] is not None]

        def closed(rs):
            values = [r[f"gap_closed_{tag}"] or 0.0 for r in rs if r["arr_oracle"] is not None]
            return sum(values) / len(values) if values else None

        every, forced = closed(rows), closed(in_force)
        ratios = [r[f"selection_ratio_{tag}"] for r in in_force]
        out.append(
            f"{name}: ARR at least fixed m's at every k: **{'met' if not worse else 'missed'}**"
            + (f" (below at k = {', '.join(map(str, worse))})" if worse else "")
            + "; share of the fixed-to-oracle ARR gap closed, mean over all k: "
            + ("-" if every is None else f"{100 * every:.0f} %")
            + f" (target >= 33 %: **{'met' if every is not None and every >= 1 / 3 else 'missed'}**), over the k where "
            + f"the rule is in force (k = {', '.join(str(r['k']) for r in in_force) or 'none'}): "
            + ("-" if forced is None else f"{100 * forced:.0f} %")
            + "; selection time per round / fixed m's there: "
            + (", ".join(f"{x:.2f}x" for x in ratios) or "-")
            + f" (target <= 1.1x: **{'met' if ratios and max(ratios) <= 1.1 else 'missed'}**).")
    return out


M_PER_LENGTH_TAGS = (("coverage", "the coverage rule around the single m"),
                     ("length", "the length's m"), ("length_coverage", "the coverage rule around the length's m"))


def _or_dash(x: Optional[float], spec: str, scale: float = 1.0, suffix: str = "") -> str:
    """``x`` (times ``scale``) formatted by ``spec`` with ``suffix``; "-" for a value not measured."""
    return "-" if x is None else f"{scale * x:{spec}}{suffix}"


def m_per_length_blocks() -> List[str]:
    """The recalibrated m per context length and the online run deciding with it, beside the single m's run."""
    out, told = [], set()
    f4, f2, pct = (functools.partial(_or_dash, spec=spec, scale=scale, suffix=suffix)
                   for spec, scale, suffix in ((".4f", 1, ""), (".2f", 1, ""), ("+.0f", 100, " %")))
    for model, source, base, recal in INPUT_AWARE_M_PER_LENGTH:
        rows = m_per_length_rows(source, base)
        tags = ("fixed", "coverage", "length", "length_coverage", "oracle")
        lines = ["| k | m: single / length's / coverage around it (mean) | ARR single m / coverage / length's m / "
                 "coverage around it / oracle | gap closed: coverage / length's m / coverage around it | token match "
                 "vs dense (same order) | accuracy (same order) | selection time / fixed's: coverage around the "
                 "single m / around the length's m |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(
                f"| {r['k']} | {r['m_fixed']:.0f} / {r['m_length']:.0f} / "
                f"{'-' if r['mean_m_length_coverage'] is None else format(r['mean_m_length_coverage'], '.0f')} "
                f"| {' / '.join(f4(r[f'arr_{t}']) for t in tags)} "
                f"| {' / '.join(pct(r[f'gap_closed_{t}']) for t, _ in M_PER_LENGTH_TAGS)} "
                f"| {' / '.join(f2(r[f'match_{t}']) for t in tags)} "
                f"| {' / '.join(f2(r[f'accuracy_{t}']) for t in tags)} "
                f"| {f2(r['selection_ratio_coverage'])}x / {f2(r['selection_ratio_length_coverage'])}x |")
        text = (f"{model}, the profile's m per context length online ({m_run_label(source)}, `{source}`, "
                f"`--dustin-m-per-length`), scored against the single-m run on the same items (`{base}`: its fixed m, "
                f"the coverage rule around it and the per-round oracle; an item counts where both runs decoded it "
                f"densely to the same tokens"
                + (f": {rows[0]['items']} do, {rows[0]['items_differing']} differ and are left out" if rows and
                   rows[0]["items_differing"] else ": every item does") + "). ")
        if (inputs.RESULTS / recal).is_file() and recal not in told:  # the recalibration, once
            told.add(recal)
            res = inputs.load(recal)["results"]
            by_k: Dict[int, List[dict]] = {}
            for x in res["rows"]:
                by_k.setdefault(x["k"], []).append(x)
            table = res["m_by_length"]
            text += (f"The lengths' m were recalibrated on calibration tasks of the evaluation's three kinds "
                     f"(`{recal}`, `dustin-profile --extend --recalibrate-m` at "
                     f"{', '.join(tokens_k(int(n)) for n in str(inputs.load(recal)['config']['lengths']).split(','))}; docs/methods.md §3.7): m per length, k: " + "; ".join(
                         f"{k}: " + ", ".join(f"{tokens_k(int(n))} {m}"
                                              for n, m in sorted(table[str(k)].items(), key=lambda x: int(x[0])))
                         for k in sorted(by_k)) + " (2k: the profile's own m); on the calibration rounds the "
                     "length's m gains over the profile's m, ARR: " + "; ".join(
                         f"k = {k}: " + ", ".join(f"{tokens_k(x['context'])} {x['arr'] - x['arr_at_profile_m']:+.4f}"
                                                  for x in by_k[k]) for k in sorted(by_k)) + ". ")
        out.append(text + "\n\n" + "\n".join(lines)
                   + f"\n\n![the m per context length](../experiments/results/{source.replace('.json', '.png')})")
    return out


def m_per_length_held_rows(held: str, per_length: str, base: str) -> Tuple[List[Dict[str, Any]], int, int]:
    """``(rows, measured, planned)``: per k, :func:`m_per_length_rows` of the per-length run against the single-m
    run, restricted to the items the held run (``held``: the coverage rule around the length's m deciding every third
    round, method dustin-h-cov-held) decoded densely to the same tokens, plus that rule's ARR, gap closed, token
    match, accuracy and selection time against the fixed rule's (tag ``length_held``) on those items (each row's
    ``items``); ``measured``: the items the held run has decoded, of the ``planned`` ones of its ``--items``."""
    data = inputs.load(held)
    cases, others = data["cases"], inputs.load(per_length)["cases"]
    dense = [k for k in cases if k.endswith("/dense")]
    items = {_item_of(k) for k in dense if k in others and cases[k]["tokens"] == others[k]["tokens"]}
    planned = int(str(data["config"]["items"]).split(":")[1])
    if not items:
        return [], len(dense), planned
    rows = m_per_length_rows(per_length, base, items)
    held_rows = {r["k"]: r for r in m_rule_rows({k: v for k, v in cases.items() if _item_of(k) in items})}
    for row in rows:
        h = held_rows.get(row["k"], {})
        for field in ("arr", "match", "accuracy", "selection_ratio"):
            row[f"{field}_length_held"] = h.get(f"{field}_coverage_held")
        gap = (None if row["arr_oracle"] is None or row["arr_fixed"] is None
               else row["arr_oracle"] - row["arr_fixed"])
        arr = row["arr_length_held"]
        row["gap_closed_length_held"] = (arr - row["arr_fixed"]) / gap if arr is not None and gap and gap > 0 else None
        row["mean_m_length_held"] = h.get("mean_m_coverage_held")
    return rows, len(dense), planned


def m_per_length_held_blocks() -> List[str]:
    """The coverage rule around the length's m deciding every third round, beside the same rule every round."""
    out = []
    f4, f2, pct = (functools.partial(_or_dash, spec=spec, scale=scale, suffix=suffix)
                   for spec, scale, suffix in ((".4f", 1, ""), (".2f", 1, ""), ("+.0f", 100, " %")))
    for model, held, per_length, base, step in INPUT_AWARE_M_PER_LENGTH_HELD:
        rows, measured, planned = m_per_length_held_rows(held, per_length, base)
        tags = ("fixed", "length", "length_coverage", "length_held", "oracle")
        lines = ["| k | ARR: single m / length's m / coverage around it, every round / every third round / oracle "
                 "| gap closed: length's m / coverage every round / every third round | token match vs dense (same "
                 "order) | selection time / fixed's: coverage every round / every third round |",
                 "|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['k']} | {' / '.join(f4(r[f'arr_{t}']) for t in tags)} "
                         f"| {' / '.join(pct(r[f'gap_closed_{t}']) for t in ('length', 'length_coverage', 'length_held'))} "
                         f"| {' / '.join(f2(r[f'match_{t}']) for t in tags)} "
                         f"| {f2(r['selection_ratio_length_coverage'])}x / {f2(r['selection_ratio_length_held'])}x |")
        compared = rows[0]["items"] if rows else 0
        status = (f"{compared} items" + ("" if measured >= planned else
                  f", {measured} of the run's {planned} planned items measured so far (the step resumes from the "
                  f"file: suite `{step.split()[0]}`, step `{step.split()[1]}`), so no verdict yet"))
        text = (f"{model}, {m_run_label(held)}: the coverage rule around the profile's m for this length deciding "
                f"every third round (`{held}`, method `dustin-h-cov-held`; docs/methods.md §3.7), beside the same "
                f"rule deciding every round (`{per_length}`) and the single m's run with its per-round oracle "
                f"(`{base}`), on the items all three decoded densely to the same tokens: {status}.")
        out.append(text + "\n\n" + "\n".join(lines))
    return out


def m_per_length_held_verdicts() -> List[str]:
    out = []
    for model, held, per_length, base, _ in INPUT_AWARE_M_PER_LENGTH_HELD:
        rows, measured, planned = m_per_length_held_rows(held, per_length, base)
        if not rows or measured < planned:
            continue
        worse = [r["k"] for r in rows if r["arr_length_held"] is not None and r["arr_length_held"] < r["arr_fixed"] - 1e-9]
        closed = [r["gap_closed_length_held"] for r in rows if r["gap_closed_length_held"] is not None]
        mean = sum(closed) / len(closed) if closed else None
        ratios = [r["selection_ratio_length_held"] for r in rows if r["selection_ratio_length_held"]]
        out.append(f"{model}, {m_run_label(held)}, the coverage rule around the length's m deciding every third round: "
                   f"at least the single m's ARR at every k **{'met' if not worse else 'missed'}**"
                   + (f" (below at k = {', '.join(map(str, worse))})" if worse else "")
                   + ", gap closed " + ("-" if mean is None else f"{100 * mean:.0f} %") + " on average (target >= 33 "
                   f"%: **{'met' if mean is not None and mean >= 1 / 3 else 'missed'}**); selection time / fixed m's: "
                   + (", ".join(f"{x:.2f}x" for x in ratios) or "-")
                   + f" (target <= 1.1x: **{'met' if ratios and max(ratios) <= 1.1 else 'missed'}**); {rows[0]['items']} "
                   "items.")
    return out


def m_per_length_verdicts() -> List[str]:
    out = []
    for model, source, base, _ in INPUT_AWARE_M_PER_LENGTH:
        rows = m_per_length_rows(source, base)

        def mean(field):
            vals = [r[field] for r in rows if r[field] is not None]
            return sum(vals) / len(vals) if vals else None

        parts = []
        for tag, label in M_PER_LENGTH_TAGS:
            worse = [r["k"] for r in rows if r[f"arr_{tag}"] is not None and r[f"arr_{tag}"] < r["arr_fixed"] - 1e-9]
            closed = mean(f"gap_closed_{tag}")
            parts.append(f"{label}: at least the single m's ARR at every k **{'met' if not worse else 'missed'}**"
                         + (f" (below at k = {', '.join(map(str, worse))})" if worse else "")
                         + ", gap closed " + ("-" if closed is None else f"{100 * closed:.0f} %") + " on average "
                         + f"(target >= 33 %: **{'met' if closed is not None and closed >= 1 / 3 else 'missed'}**)")
        ratios = [r["selection_ratio_length_coverage"] for r in rows if r["selection_ratio_length_coverage"]]
        out.append(f"{model}, {m_run_label(source)}, the profile's m per context length online: " + "; ".join(parts)
                   + "; selection time of the coverage rule around the length's m / fixed m's: "
                   + (", ".join(f"{x:.2f}x" for x in ratios) or "-")
                   + f" (target <= 1.1x: **{'met' if ratios and max(ratios) <= 1.1 else 'missed'}**). "
                   + f"{rows[0]['items'] if rows else 0} items: the gap to the oracle is "
                   + ", ".join(f"{r['arr_oracle'] - r['arr_fixed']:.4f}" for r in rows) + " ARR (k = "
                   + ", ".join(str(r["k"]) for r in rows) + "), so one item moves these shares by tens of points.")
    return out
