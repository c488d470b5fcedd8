"""The measured choice between speculation and AR (docs/methods.md §5.2).

The probe on the CPU and on the H200 (:func:`cpu_choice_note`, :func:`h200_choice_note`), and the choice tables
built from whole runs (``choice_table/``) with every method deciding from them, on the H200 and an H100
(:func:`choice_table_block`).
"""

from __future__ import annotations

import statistics

from experiments.tables import inputs
from experiments.tables.inputs import (ARBITRATE_CPU, CHOICE_TABLE, CHOICE_TABLE_H100, CHOICE_TABLE_H100_16K,
                                       CHOICE_TABLE_H100_B16, MAGICDEC_CPU, PAIR_METHODS, PAIR_SPEED_ARBITRATE,
                                       PAIR_SPEED_ARBITRATE_REPEATS_H100, PAIR_SPEED_CHOICE_TABLE,
                                       PAIR_SPEED_CHOICE_TABLE_B16_REPEATS_H100, PAIR_SPEED_CHOICE_TABLE_GUARDED,
                                       PAIR_SPEED_CHOICE_TABLE_GUARDED_NO_MARGIN, PAIR_SPEED_CHOICE_TABLE_OUTCOMES,
                                       PAIR_SPEED_CHOICE_TABLE_REPEATS, PAIR_SPEED_CHOICE_TABLE_REPEATS_H100, PS,
                                       TABLE_TAIL_MARGIN)
from experiments.tables.pair_speed import pair_cases


def cpu_choice_note() -> str:
    """MagicDec and the measured choice on the CPU, real pair, 2k (steps of cpu-dustin-sparse-draft)."""
    if not ((inputs.RESULTS / MAGICDEC_CPU).exists() and (inputs.RESULTS / ARBITRATE_CPU).exists()):
        return ("Not measured yet: MagicDec and the measured choice (`--arbitrate 8`) at this point (steps of "
                "`cpu-dustin-sparse-draft`).")
    mg, ab = inputs.load(MAGICDEC_CPU)["results"], inputs.load(ARBITRATE_CPU)["results"]
    event = ab["metrics"]["arbitration"]["events"][0]["probe"]
    return (f"MagicDec at the same point (`{MAGICDEC_CPU}`, with the warm-up run): tau {mg['metrics']['tau']:.2f}, "
            f"{mg['speedup_vs_ar']:.2f}x AR in the same process, output identical to AR "
            f"({'yes' if mg['identical_to_ar'] else 'no'}; dense verification, float32). The verify-set variant "
            f"under the measured choice (docs/methods.md §5.2, `--arbitrate 8`, `{ARBITRATE_CPU}`): its 8 probe "
            f"rounds decoded {event['speculative_tokens_per_s']:.2f} tokens/s against "
            f"{event['ar_tokens_per_s']:.2f} for 8 plain steps, so it chose **{event['choice']}** for the rest; the "
            f"whole 64-token run measured {ab['speedup_vs_ar']:.2f}x the AR run in the same process (target: never "
            f"slower than AR with the choice on: **missed** here). The run itself decoded {ab['tokens_per_s']:.2f} "
            f"tokens/s, about the rate its own plain steps measured in the probe ({event['ar_tokens_per_s']:.2f}); "
            f"the AR reference run, decoded separately, measured {ab['ar_tokens_per_s']:.2f}, a "
            f"{100 * (ab['ar_tokens_per_s'] / event['ar_tokens_per_s'] - 1):.0f} % spread between two measurements "
            "of the same plain decoding on this shared 2-core CPU, larger than anything the choice could save or "
            "lose at this point. " + h200_choice_note())


def h200_choice_note() -> str:
    """The measured choice with its tail check on the real pair at 32k/b16 (h200-qwen-pair ctx32k-b16-arbitrate),
    beside the same methods run without it (the 32k/b16 file)."""
    if not (inputs.RESULTS / PAIR_SPEED_ARBITRATE).exists():
        return "On the H200 the measured choice is not run yet (h200-qwen-pair step ctx32k-b16-arbitrate)."
    case = inputs.load(PAIR_SPEED_ARBITRATE)["cases"]["ctx32000/b16"]
    free_run = inputs.load(f"{PS}32k_b16_h200.json")["cases"]["ctx32000/b16"]
    methods = [(m, label.strip("*")) for m, label in PAIR_METHODS if m in case]
    parts, speedups, plain_ms, ar_ms, early, picked_ar = [], [], [], [], [], []
    pooled, tails = False, []
    for method, label in methods:
        r = case[method]
        events = r["metrics"]["arbitration"]["events"]
        probe = events[0]["probe"]
        speedups.append(r["speedup_vs_ar"])
        plain_ms.append(1e3 * probe.get("ar_step_s_mean", probe["ar_step_s"]))  # the mean over the probe's steps
        ar_ms.append(1e3 * case["batch"] / r["paired_ar_tok_s"])
        text = (f"{label} {r['speedup_vs_ar']:.2f}x (probe {probe['speculative_tokens_per_s']:.0f} against "
                f"{probe['ar_tokens_per_s']:.0f} tokens/s: {probe['choice']}")
        for e in events:
            if e.get("reason") == "tail":
                pooled = pooled or "tail_prior_rounds" in e
                tails.append(label)
                text += (f"; after {e['after_rounds']} more rounds the tail check estimated "
                         f"{e['speculative_finish_s']:.1f} s to finish speculating against "
                         f"{e['plain_finish_s']:.1f} s plainly: ar")
        parts.append(text + ")")
        if r["metrics"]["arbitration"]["choice"] == "ar" and not any(e.get("reason") == "tail" for e in events):
            picked_ar.append(label)
        if method in free_run:  # the probe's tokens a row a round against the whole run's tau without the choice
            early.append(f"{label} {probe['speculative_tokens'] / (probe['rounds'] * case['batch']):.2f} against "
                         f"{free_run[method]['metrics']['tau']:.2f} ({free_run[method]['speedup_vs_ar']:.2f}x AR)")
    worst = min(speedups)
    ratio = max(p / a for p, a in zip(plain_ms, ar_ms))
    text = ("On the H200 (real pair, 32k, batch 16, `--arbitrate 8 --arbitrate-tail 8`, "
            f"`{PAIR_SPEED_ARBITRATE}`): " + "; ".join(parts) + f". Never slower than AR: "
            f"**{'met' if worst >= 1 else 'missed'}**" + (f", by up to {100 * (1 - worst):.0f} % here" if worst < 1
                                                        else f" (lowest {worst:.2f}x)") + ". "
            f"The probe's 8 plain steps took {min(plain_ms):.1f}-{max(plain_ms):.1f} ms a step against "
            f"{min(ar_ms):.1f}-{max(ar_ms):.1f} ms in the 256-step AR loop")
    marginal = [1e3 * case[m]["metrics"]["arbitration"]["events"][0]["probe"]["ar_step_s"] for m, _ in methods
                if "ar_step_s_mean" in case[m]["metrics"]["arbitration"]["events"][0]["probe"]]
    if marginal:
        text += (f"; the two stretches' difference, the price the choice used (docs/methods.md §5.2), "
                 f"{min(marginal):.1f}-{max(marginal):.1f} ms")
    fixed = [1e3 * (pr["ar_s"] - pr["ar_steps"] * pr["ar_step_s"]) / 2 for pr in
             (case[m]["metrics"]["arbitration"]["events"][0]["probe"] for m, _ in methods) if "ar_step_s_mean" in pr]
    if ratio <= 1.1:
        text += " (a plain stretch no longer copies the cache into and out of its loop; docs/methods.md §5.2). "
    elif fixed:
        text += (f", within {100 * max(abs(m / a - 1) for m, a in zip(marginal, ar_ms)):.0f} % of the AR loop's "
                 f"step: each call of plain steps carries a fixed cost of about {min(fixed):.0f}-{max(fixed):.0f} ms "
                 "(not traced), which the difference leaves out, so plain decoding was priced right and the choice "
                 "went to AR on the speculative probe's own rate. ")
    elif not pooled:
        text += (" (each plain stretch then copied the whole cache into and out of its loop, half a cache read "
                 "more a step over 8 steps; fixed since, docs/methods.md §5.2). ")
    elif not marginal:
        text += (" (slower than the loop's, and not by a cache copy, which the compiled stretch no longer has: a "
                 "fixed cost of about a step per call, not traced; the probe now times its plain steps as two "
                 "stretches of 2 and 6 and prices a step by their difference, docs/methods.md §5.2, not measured "
                 "on the H200 yet). ")
    else:
        text += ". "
    if early:
        text += ("The first 8 rounds after the prefill commit fewer tokens a row than a whole run does (tokens a row "
                 "a round in the probe against the whole run's tau without the choice, `" + f"{PS}32k_b16_h200.json"
                 + "`: " + "; ".join(early) + ")")
        text += ". "
    losses = []
    for method, label in methods:
        r = case[method]
        if r["speedup_vs_ar"] >= 1:
            continue
        probe = r["metrics"]["arbitration"]["events"][0]["probe"]
        rate = r["paired_ar_tok_s"]  # tokens a second of the AR loop in the same process
        total = r["timings"]["decode_s"] - r["tok_s"] * r["timings"]["decode_s"] / rate
        spec = probe["speculative_s"] - probe["speculative_tokens"] / rate
        plain = probe["ar_s"] - probe["ar_tokens"] / rate
        idle = r["metrics"]["ar_steps"] - r["metrics"]["ar_tokens"] / case["batch"]  # row-steps of rows already done
        losses.append(f"{label} {1e3 * total:.0f} ms ({1e3 * spec:.0f} ms in the speculative probe, "
                      f"{1e3 * plain:.0f} ms in the plain one, and its {r['metrics']['ar_steps']} plain steps "
                      f"committed {r['metrics']['ar_tokens'] / case['batch']:.0f} tokens a row on average: the rows "
                      f"left speculation at different lengths, and a batch decodes until its last row is done, "
                      f"{idle:.0f} steps of about {1e3 * case['batch'] / rate:.1f} ms)")
    if losses:
        text += ("Where it lost against AR, the time beyond AR's for the same tokens: " + "; ".join(losses)
                 + (f"; the probe picked plain decoding at once for {', '.join(picked_ar)}" if picked_ar else "")
                 + ". ")
    if tails:
        text += ("The tail check " + ("pooled each row's rate toward the batch mean (docs/methods.md §5.2)"
                                      if pooled else "took each row's own rate (the rule now reached with "
                                      "`--arbitrate-tail-prior 0`; the pooled rule is the default)")
                 + f" and switched {', '.join(tails)} to plain decoding.")
    elif not pooled:
        text += "No tail check fired."
    return text.strip()


def choice_table_block() -> str:
    """The choice table per (context bucket, batch) and method: the speed-up it holds and what it picks."""
    if not (inputs.RESULTS / CHOICE_TABLE).exists():
        return "The choice table (docs/methods.md §5.2): not built yet (h200-qwen-pair step choice-table)."
    data = inputs.load(CHOICE_TABLE)
    margin, entries = data["margin"], data["entries"]
    labels = dict((m, label.strip("*")) for m, label in PAIR_METHODS)
    methods = [m for m, _ in PAIR_METHODS if any(e["method"] == m for e in entries)]
    cells = {(e["context_bucket"], e["batch"], e["method"]): e for e in entries}
    keys = sorted({(e["context_bucket"], e["batch"]) for e in entries}, key=lambda k: (-k[0], -k[1]))
    lines = ["| context bucket | batch | " + " | ".join(labels[m] for m in methods) + " |",
             "|---|---|" + "---|" * len(methods)]
    picks_ar = []
    for bucket, batch in keys:
        row = []
        for m in methods:
            e = cells.get((bucket, batch, m))
            if e is None:
                row.append("-")
                continue
            ar = e["speedup"] < 1 + margin
            row.append(f"{e['speedup']:.2f}x: {'**AR**' if ar else 'speculate'}"
                       + (f" ({len(e['measured'])} runs)" if len(e.get("measured", [])) > 1 else ""))
        ar_here = [labels[m] for m in methods if (bucket, batch, m) in cells
                   and cells[(bucket, batch, m)]["speedup"] < 1 + margin]
        if ar_here:
            picks_ar.append(f"{bucket // 1024}k/b{batch}: {', '.join(ar_here)}")
        lines.append(f"| {bucket // 1024}k | {batch} | " + " | ".join(row) + " |")
    outcomes = [e for e in entries if any(m.get("outcome") for m in e.get("measured", []))]
    flipped = [e for e in outcomes if e["speedup"] < 1 + margin
               and min(m["speedup"] for m in e["measured"] if not m.get("outcome")) >= 1 + margin]
    text = (f"The choice table (docs/methods.md §5.2; `{CHOICE_TABLE}`, step `choice-table`, no GPU needed): per method "
            "and (context bucket, batch), the lowest whole-run speed-up against the paired AR run among the plain runs "
            "above that measured it"
            + (" and the runs below that decided from the table and speculated (its decisions' outcomes)" if outcomes
               else "")
            + f", and the decision the measured choice takes from it (speculate at >= "
            f"{1 + margin:.2f}x, plain decoding below, no probe; a case the table lacks is probed as before). "
            f"{sum(e['speedup'] < 1 + margin for e in entries)} of {len(entries)} entries pick plain decoding: "
            + "; ".join(picks_ar) + ".")
    if flipped:
        text += (" The outcomes turn " + ", ".join(
            f"{labels[e['method']]} at {e['context_bucket'] // 1024}k/b{e['batch']} (plain runs "
            f"{min(m['speedup'] for m in e['measured'] if not m.get('outcome')):.2f}x, deciding from the table "
            + ", ".join(f"{m['speedup']:.2f}x" for m in e["measured"] if m.get("outcome")) + ")"
            for e in flipped)
            + " to plain decoding; the first runs below decided from the table before these outcomes were in it"
            + ("; the last decided from the table with these outcomes in it."
               if (inputs.RESULTS / PAIR_SPEED_CHOICE_TABLE_OUTCOMES).exists()
               else ", and a run deciding from the table as it is now is not measured yet."))
    if (inputs.RESULTS / PAIR_SPEED_CHOICE_TABLE).exists():
        text += _choice_runs_text(PAIR_SPEED_CHOICE_TABLE, guarded=False)
    else:
        text += (" Every method deciding from it at 32k, batch 16 and 8 (h200-qwen-pair step "
                 "`ctx32k-b16-b8-choice-table`): not measured yet.")
    if (inputs.RESULTS / PAIR_SPEED_CHOICE_TABLE_GUARDED_NO_MARGIN).exists():
        text += _choice_runs_text(PAIR_SPEED_CHOICE_TABLE_GUARDED_NO_MARGIN, guarded=True)
    if (inputs.RESULTS / PAIR_SPEED_CHOICE_TABLE_GUARDED).exists():
        text += _choice_runs_text(PAIR_SPEED_CHOICE_TABLE_GUARDED, guarded=True)
    else:
        text += (" The same with the table's speculative decisions tail-checked from their 32nd round on "
                 "(`--arbitrate-table-tail-after 32`, step `ctx32k-b8-b16-choice-table-guarded`): not measured yet.")
    if (inputs.RESULTS / PAIR_SPEED_CHOICE_TABLE_OUTCOMES).exists():
        text += _choice_runs_text(PAIR_SPEED_CHOICE_TABLE_OUTCOMES, guarded=True,
                                  title="Deciding from the table with those outcomes, guarded as above")
    else:
        text += (" Every method deciding from the table with those outcomes, guarded as above (step "
                 "`ctx32k-b8-b16-choice-table-outcomes`): not measured yet.")
    if (inputs.RESULTS / PAIR_SPEED_CHOICE_TABLE_REPEATS).exists():
        text += _choice_runs_text(PAIR_SPEED_CHOICE_TABLE_REPEATS, guarded=True,
                                  title="The same, each method timed in 3 (AR, method) pairs adjacent in time, the "
                                        "median pair's speed-up")
    else:
        text += (" The same with each method timed in 3 (AR, method) pairs adjacent in time, the median pair's "
                 "speed-up (`--repeats 3`, step `ctx32k-b8-b16-choice-table-outcomes-repeats`): not measured yet.")
    if (inputs.RESULTS / PAIR_SPEED_ARBITRATE_REPEATS_H100).exists():
        text += _probed_repeats_text(PAIR_SPEED_ARBITRATE_REPEATS_H100)
    return text + "\n\n" + "\n".join(lines)


def _table_decisions(path: str) -> str:
    """A choice table's entries in words: each method, key, decision and the speed-up it rests on."""
    table, labels = inputs.load(path), dict(PAIR_METHODS)
    return "; ".join(f"{labels.get(r['method'], r['method']).strip('*')} at {round(r['context_bucket'] / 1024)}k-"
                     f"bucket/b{r['batch']}: {'speculate' if r['speedup'] >= 1 + table['margin'] else 'AR'} "
                     f"({r['speedup']:.2f}x)" for r in table["entries"])


def _probed_repeats_text(path: str) -> str:
    """The runs of one pair-speed file under the measured choice without a table (each decision from its own probe),
    timed in (AR, method) pairs: each method's median pair, the decision, and, where it chose plain decoding, what
    each part of the run cost against the paired AR run's pace."""
    data = inputs.load(path)
    cfg, parts, worst, lost = data["config"], [], None, []
    new_tokens = int(cfg.get("max_new_tokens") or 256)
    for key, case in pair_cases(path):
        where = key[3:].replace("000/", "k/")
        step_s = statistics.median(r["decode_s"] for r in case["ar"]["runs"]) / new_tokens  # one plain step
        for m, label in PAIR_METHODS:
            run = case.get(m)
            if not (isinstance(run, dict) and "speedup_vs_ar" in run):
                continue
            ratios = [p["speedup_vs_ar"] for p in run.get("pairs") or []] or [run["speedup_vs_ar"]]
            metrics = run["metrics"]
            events = metrics["arbitration"]["events"]
            probe = (events[0].get("probe") or {}) if events else {}
            choice = events[0]["choice"] if events else None
            text = (f"{label.strip('*')} at {where} {run['speedup_vs_ar']:.2f}x (probed: "
                    f"{'AR' if choice == 'ar' else 'speculate'}; {len(ratios)} pairs {min(ratios):.2f}-{max(ratios):.2f}x")
            if probe and choice == "ar" and metrics.get("ar_steps"):
                # the batch finishes with its slowest row: the probe's rounds saved new_tokens - ar_steps plain steps
                saved = new_tokens - metrics["ar_steps"]
                spec = probe["speculative_s"] - saved * step_s
                timed = probe["ar_s"] - probe["ar_steps"] * step_s
                rest = (run["timings"]["decode_s"] - probe["speculative_s"] - probe["ar_s"]
                        - (metrics["ar_steps"] - probe["ar_steps"]) * step_s)
                lost.append((spec, timed, rest, run["timings"]["decode_s"]))
                text += (f"; its {probe['rounds']} probe rounds took {1000 * probe['speculative_s']:.0f} ms and moved "
                         f"the slowest row {saved} tokens on, {1000 * spec:+.0f} ms against {saved} plain steps; its "
                         f"{probe['ar_steps']} AR steps timed one by one {1000 * timed:+.0f} ms; the other "
                         f"{metrics['ar_steps'] - probe['ar_steps']} plain steps {1000 * rest:+.0f} ms")
            parts.append(text + ")")
            worst = run["speedup_vs_ar"] if worst is None else min(worst, run["speedup_vs_ar"])
    if not parts:
        return ""
    text = (f" On an H100 without a choice table (`{path}`, `--arbitrate {cfg.get('arbitrate')} --arbitrate-tail "
            f"{cfg.get('arbitrate_tail')} --repeats {cfg.get('repeats')}`, suite h100-long-context step "
            f"`pair-ctx32k-b8-arbitrate-repeats`; each method decides from its own probe; against the paired AR "
            f"runs' median pace): " + "; ".join(parts)
            + f". Never slower than AR: **{'met' if worst >= 1 else 'missed'}**"
            + (f" (lowest {worst:.2f}x)." if worst >= 1 else f", by up to {100 * (1 - worst):.0f} %."))
    if lost:
        spec_share = [x[0] / sum(x[:3]) for x in lost]
        text += (" Where the probe picks plain decoding the run pays for the probe, mostly its speculative rounds "
                 f"({100 * min(spec_share):.0f}-{100 * max(spec_share):.0f} % of the loss): the batch finishes with its "
                 "slowest row, and the rounds moved that row little further than as many plain steps would.")
    if (inputs.RESULTS / CHOICE_TABLE_H100).exists():
        text += (f" This GPU's choice table, built from that run (`{CHOICE_TABLE_H100}`, `choice-table --probed`, step "
                 "`choice-table`, no GPU needed: each method's whole-run speed-up with its probe), decides "
                 + _table_decisions(CHOICE_TABLE_H100) + ", with no probe.")
        if (inputs.RESULTS / PAIR_SPEED_CHOICE_TABLE_REPEATS_H100).exists():
            text += _choice_runs_text(PAIR_SPEED_CHOICE_TABLE_REPEATS_H100, guarded=True,
                                      title="On the H100 deciding from it, 3 (AR, method) pairs each")
        else:
            text += (" The same run deciding from it (step `pair-ctx32k-b8-choice-table-repeats`): not measured "
                     "yet.")
    if (inputs.RESULTS / CHOICE_TABLE_H100_B16).exists():
        text += (f" With the H100's batch-16 plain run and that run's outcomes in it (`{CHOICE_TABLE_H100_B16}`, step "
                 "`choice-table-b8-16`) the table decides " + _table_decisions(CHOICE_TABLE_H100_B16) + ".")
        if (inputs.RESULTS / PAIR_SPEED_CHOICE_TABLE_B16_REPEATS_H100).exists():
            text += _choice_runs_text(PAIR_SPEED_CHOICE_TABLE_B16_REPEATS_H100, guarded=True,
                                      title="On the H100 at batch 16 deciding from it, 3 (AR, method) pairs each")
        else:
            text += (" The 32k/b16 run deciding from it (step `pair-ctx32k-b16-choice-table-repeats`): not "
                     "measured yet.")
    if (inputs.RESULTS / CHOICE_TABLE_H100_16K).exists():
        text += (f" With the H100's 16k/b16 plain run and the 32k/b16 outcomes added (`{CHOICE_TABLE_H100_16K}`, step "
                 "`choice-table-16k-32k`) it decides " + _table_decisions(CHOICE_TABLE_H100_16K)
                 + "; no run has decided from it yet.")
    return text


def _choice_runs_text(path: str, guarded: bool, title: str = "") -> str:
    """The runs of one pair-speed file whose methods decided from the choice table: each speed-up, how it was
    decided, and what the tail check did."""
    runs, overruled, table_spec, plain_runs, stragglers, run_plain, run_where = [], [], 0, [], [], [], []
    data = inputs.load(path)
    cfg, labels_of = data["config"], dict(PAIR_METHODS)
    after = cfg.get("arbitrate_table_tail_after")
    missing = [f"{labels_of.get(m, m).strip('*')} at {round(int(c) / 1000)}k/b{b}"
               for c in str(cfg["contexts"]).split(",") for b in str(cfg["batches"]).split(",")
               for m in str(cfg["methods"]).split(",")
               if "speedup_vs_ar" not in (data["cases"].get(f"ctx{c}/b{b}", {}).get(m) or {})]
    for key, case in data["cases"].items():
        if not key.startswith("ctx"):
            continue
        for m, label in PAIR_METHODS:
            if not (isinstance(case.get(m), dict) and "speedup_vs_ar" in case[m]):
                continue
            metrics = case[m]["metrics"]
            where = key[3:].replace("000/", "k/")
            plain = bool(metrics.get("rounds") == 0 and metrics.get("ar_steps"))
            if plain:
                plain_runs.append((case[m]["speedup_vs_ar"], label.strip("*"), metrics["ar_steps"]))
            events = metrics["arbitration"]["events"]
            first = events[0] if events else {}
            tail = [e for e in events if e.get("reason") == "tail"]
            how = (f"table {first['table_speedup']:.2f}x: {'speculate' if first['choice'] == 'speculative' else 'AR'}"
                   if first.get("reason") == "table" else f"probed: {first.get('choice')}")
            if first.get("reason") == "table" and first["choice"] == "speculative":
                table_spec += 1
                rows = [r for r in metrics.get("rounds_per_row") or [] if r]
                if case[m]["speedup_vs_ar"] < 1 and rows and metrics.get("tau") and not tail:
                    stragglers.append(f"{label.strip('*')} at {where}: slowest row {max(rows)} rounds against a "
                                      f"mean row's {255 / metrics['tau']:.0f}")
            if tail:
                overruled.append((tail[0]["speculative_finish_s"] / tail[0]["plain_finish_s"],
                                  first.get("table_speedup"), case[m]["speedup_vs_ar"], label.strip("*"), where))
                how += f"; the tail check switched to AR after {tail[0]['after_rounds']} rounds"
            pairs = case[m].get("pairs") or []
            if pairs:  # --repeats: the median pair, the pairs' range and the decisions they took
                ratios = [p["speedup_vs_ar"] for p in pairs]
                choices = sorted({p.get("choice") for p in pairs if p.get("choice")})
                how += (f"; median of {len(pairs)} pairs, {min(ratios):.2f}-{max(ratios):.2f}x"
                        + (", the pairs deciding " + " and ".join({"ar": "AR"}.get(c, c) for c in choices)
                           if len(choices) > 1 else "")
                        + (f", {sum(p.get('same_tokens') is False for p in pairs)} of them decoding other tokens "
                           "than the first" if any(p.get("same_tokens") is False for p in pairs) else ""))
            runs.append((case[m]["speedup_vs_ar"], f"{label.strip('*')} at {where} "
                         f"{case[m]['speedup_vs_ar']:.2f}x ({how})"))
            run_plain.append(plain)
            run_where.append(where)
    if not runs:
        return ""
    worst = min(r[0] for r in runs)
    rule = (f"tail check every {cfg.get('arbitrate_tail')} rounds"
            + (f", the table's decisions checked from round {after} on" if after else
               ", on probed decisions only: the table's decisions stand"))
    # the guard's margin as its runs recorded it (runs from before the margin existed record none: 0)
    tail_margin = next((r["metrics"]["arbitration"].get("table_tail_margin", 0.0)
                        for case in data["cases"].values() if isinstance(case, dict) for r in case.values()
                        if isinstance(r, dict) and "arbitration" in (r.get("metrics") or {})), 0.0)
    if after:
        rule += (f", switching only where plain decoding finishes at least {100 * tail_margin:.0f} % sooner"
                 if tail_margin else ", switching at any gain")
    title = title or ("With the guard" if guarded else "Every method deciding from it")
    text = (f" {title} (`{path}`, {rule}): "
            + "; ".join(r[1] for r in runs) + f". Never slower than AR: **{'met' if worst >= 1 else 'missed'}**"
            + (f" (lowest {worst:.2f}x)." if worst >= 1 else f", by up to {100 * (1 - worst):.0f} %."))
    speculated = [r[0] for r, plain in zip(runs, run_plain) if not plain]
    if worst < 1 and plain_runs and all(plain for r, plain in zip(runs, run_plain) if r[0] < 1):
        text += (" Every run below 1.00x is one the table sent to plain decoding"
                 + (f"; the runs that speculated measured {min(speculated):.2f}-{max(speculated):.2f}x."
                    if speculated else "."))
    if stragglers:
        text += (" Below AR on a speculative table decision: " + "; ".join(stragglers) + " (the batch waits for its "
                 "slowest row).")
    if plain_runs:
        text += (f" The runs the table sent to plain decoding ({', '.join(sorted(set(p[1] for p in plain_runs)))}"
                 f") decoded " + "-".join(sorted({str(p[2]) for p in plain_runs}, key=int)) + " plain steps and "
                 f"no draft round, the same work as the paired AR run, and measured "
                 f"{min(p[0] for p in plain_runs):.2f}-{max(p[0] for p in plain_runs):.2f}x it: below 1.00x "
                 "there is the spread of two timings of identical plain decoding, not a decision.")
        spreads = [(key[3:].replace("000/", "k/"), [r["tok_s"] for r in case["ar"]["runs"]])
                   for key, case in data["cases"].items()
                   if key.startswith("ctx") and len((case.get("ar") or {}).get("runs") or []) >= 2]
        if spreads:
            text += (" The paired AR runs themselves (one before each "
                     + ("timed run" if any(r.get("repeat") for case in data["cases"].values() if isinstance(case, dict)
                                           for r in (case.get("ar") or {}).get("runs") or []) else "method")
                     + ", the same plain decoding) spread "
                     + ", ".join(f"{100 * (max(r) / min(r) - 1):.1f} % at {where} ({len(r)} runs, "
                                 f"{min(r):.0f}-{max(r):.0f} tokens/s)" for where, r in spreads) + ".")
            # the same target read against that spread: a run counts as slower than AR only where it is below
            # the slowest-over-fastest ratio of the paired AR runs at its own point
            floor = {where: min(r) / max(r) for where, r in spreads}
            below = [(r[0], w) for r, w in zip(runs, run_where) if w in floor and r[0] < floor[w]]
            if worst < 1 and len(floor) == len({w for w in run_where}):
                text += (" Read against that spread (a run is slower than AR only below its point's slowest "
                         "over fastest paired AR run): never slower than AR "
                         + ("**met**." if not below else
                            f"**missed** ({', '.join(f'{x:.2f}x at {w}' for x, w in below)})."))
    if missing:
        text += (" Not measured yet (the step's GPU time ran out; it resumes at the next method): "
                 + ", ".join(missing) + ".")
    if overruled:
        paces = [o[0] for o in overruled]
        text += (f" The tail check switched {len(overruled)} of the {table_spec} speculative table decisions to plain "
                 f"decoding, its estimate putting the batch's finish {min(paces):.1f}-{max(paces):.1f}x later than "
                 f"plain decoding's; those runs ended at {min(o[2] for o in overruled):.2f}-"
                 f"{max(o[2] for o in overruled):.2f}x AR.")
        if guarded and not tail_margin:
            stand = [o for o in overruled if 1 - 1 / o[0] >= TABLE_TAIL_MARGIN]
            text += (f" This run switched at any gain; the guard now switches a table's decision only where plain "
                     f"decoding finishes at least {100 * TABLE_TAIL_MARGIN:.0f} % sooner (docs/methods.md §5.2), "
                     f"which keeps {len(stand)} of these {len(overruled)} switches ("
                     + "; ".join(f"{o[3]} at {o[4]}: plain {100 * (1 - 1 / o[0]):.1f} % sooner" for o in overruled)
                     + ")" + ("; the run under that margin follows." if path != PAIR_SPEED_CHOICE_TABLE_GUARDED
                              and (inputs.RESULTS / PAIR_SPEED_CHOICE_TABLE_GUARDED).exists()
                              else "; that rule is not measured on the GPU yet."))
    return text
