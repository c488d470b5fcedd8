"""Dustin's quality against dense verification (``dustin_quality/*.json``): acceptance, ARR and agreement.

The quality files of each model and context and their cases (:func:`quality_sources`, :func:`quality_cases`,
:func:`quality_items`), one row per method and budget k (:func:`quality_rows`, :func:`quality_markdown`), where
outputs leave dense decoding (:func:`divergence_note`) and the real pair's quality targets on the H200
(:func:`quality_target_notes`).
"""

from __future__ import annotations

import tomllib
from typing import Any, Dict, List, Sequence, Tuple

from experiments.tables import inputs
from experiments.tables.inputs import DENSE, QUALITY, QUALITY_GPU_METHODS, QUALITY_GPU_MODEL, SUITES


# ---------------------------------------------------------------------------- Dustin quality (from the JSON)
QUALITY_METHODS = ("dustin-h", "dustin-t", "dustin-d", "streaming", "quest", "snapkv", "magicdec")


def _mean(values):
    values = [x for x in values if x is not None]
    return sum(values) / len(values) if values else None


def quality_rows(cases: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Mean per (method, k) over items, dense ClassicSD first (the dustin-quality experiment's own summary)."""
    # an item whose dense output ends at its first token has no rounds: it counts for perplexity and accuracy only
    ended = {r["task"] for r in cases.values() if "method" not in r and len(r.get("tokens", [])) <= 1}
    token_fields = ("arr", "match_rate", "first_divergence", "tau")
    groups: Dict[Tuple[str, Any], List[dict]] = {}
    for record in cases.values():
        if record.get("task") in ended:
            record = {k: x for k, x in record.items() if k not in token_fields}
        groups.setdefault((record.get("method", DENSE), record.get("budget")), []).append(record)
    order = {name: i for i, name in enumerate((DENSE,) + QUALITY_METHODS)}
    rows = []
    for (name, budget), records in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1] or 0)):
        firsts = [r["first_divergence"] for r in records if "match_rate" in r]
        rows.append({"method": name, "k": budget if budget is not None else "-", "items": len(records),
                     "ARR": _mean(r.get("arr") for r in records) if name != DENSE else 1.0,
                     "match": _mean(r.get("match_rate") for r in records) if firsts else 1.0,
                     "identical": (sum(x is None for x in firsts) / len(firsts)) if firsts else 1.0,
                     "accuracy": _mean(r.get("accuracy") for r in records),
                     "tau": _mean(r.get("tau") for r in records), "ppl": _mean(r.get("ppl") for r in records)})
    return rows


def quality_markdown(cases: Dict[str, Any], budgets: Sequence[int] = (128, 256, 512, 1024)) -> str:
    """One row per method; k = 128 / 256 / 512 / 1024 inside each cell."""
    by = {(r["method"], r["k"]): r for r in quality_rows(cases)}

    def two(x):
        return "-" if x is None else f"{x:.2f}"

    def cell(name, field, spec):
        values = [by.get((name, b), {}).get(field) for b in budgets]
        return " / ".join("-" if x is None else spec.format(x) for x in values)

    lines = ["| method | ARR | token match vs dense | identical outputs | retrieval accuracy | perplexity | tau |",
             "|---|---|---|---|---|---|---|"]
    dense = by.get((DENSE, "-"))
    if dense:
        lines.append(f"| {DENSE} | 1 | 1 | 1 | {two(dense['accuracy'])} | {two(dense['ppl'])} | {two(dense['tau'])} |")
    for name in QUALITY_METHODS:
        if any((name, b) in by for b in budgets):
            lines.append(f"| {name} | {cell(name, 'ARR', '{:.3f}')} | {cell(name, 'match', '{:.2f}')} | "
                         f"{cell(name, 'identical', '{:.2f}')} | {cell(name, 'accuracy', '{:.2f}')} | "
                         f"{cell(name, 'ppl', '{:.2f}')} | {cell(name, 'tau', '{:.2f}')} |")
    return "\n".join(lines)


def quality_contexts(source: str) -> List[int]:
    return sorted({int(k.split("/")[2]) for k in inputs.load(source)["cases"]})


def quality_budgets(source: str) -> List[int]:
    return [int(b) for b in str(inputs.load(source)["config"]["budgets"]).split(",")]


def complete_quality_cases(source: str) -> Dict[str, Any]:
    """The records of the items that have every (method, k) of the run (a run cut off by a time limit
    leaves its last item part-measured: means over items must not mix item sets)."""
    data = inputs.load(source)
    cases, config = data["cases"], data["config"]
    methods = [m.strip() for m in str(config["methods"]).split(",") if m.strip()]
    budgets = quality_budgets(source)
    items = {k[:-len("/dense")] for k in cases if k.endswith("/dense")}
    whole = {i for i in items if all(f"{i}/{m}/k{b}" in cases for m in methods for b in budgets)}
    return {k: c for k, c in cases.items() if k.rsplit("/", 2)[0] in whole or k[:-len("/dense")] in whole}


def _item_of(key: str) -> str:
    return key[:-len("/dense")] if key.endswith("/dense") else key.rsplit("/", 2)[0]


def quality_files(model: str) -> List[str]:
    """The QUALITY files of ``model`` that are committed (a declared run may not have run yet)."""
    return [s for s in QUALITY[model] if (inputs.RESULTS / s).is_file()]


def gpu_quality_contexts() -> List[int]:
    """The item contexts of the real pair's H200 quality files."""
    return sorted({c for s in quality_files(QUALITY_GPU_MODEL) if s.endswith("_h200.json") for c in quality_contexts(s)})


def quality_sources(model: str, context: int) -> List[str]:
    """The committed dustin-quality files of ``model`` holding ``context``-token items (a later run
    may add budgets to the same items in a file of its own)."""
    sources = [s for s in quality_files(model) if context in quality_contexts(s)]
    if not sources:
        raise KeyError(f"no dustin-quality file of {model} holds {context}-token items")
    return sources


def quality_source(model: str, context: int) -> str:
    return quality_sources(model, context)[0]


def quality_cases(model: str, context: int) -> Dict[str, Any]:
    merged: Dict[str, Any] = {}
    items = None
    for source in quality_sources(model, context):
        cases = {k: c for k, c in complete_quality_cases(source).items() if k.split("/")[2] == str(context)}
        here = {_item_of(k) for k in cases if k.endswith("/dense")}
        items = here if items is None else items & here  # the items every file has complete
        for key, case in cases.items():
            merged.setdefault(key, case)  # a repeated dense record: the first file's
    return {k: c for k, c in merged.items() if _item_of(k) in items}


def quality_items(model: str, context: int) -> Tuple[int, int]:
    """(items measured at ``context`` in every file of it, items the first run asked for there)."""
    done = {c["task"] for k, c in quality_cases(model, context).items() if k.endswith("/dense")}
    planned = dict(part.split(":") for part in str(inputs.load(quality_source(model, context))["config"]["items"]).split(","))
    return len(done), int(planned.get(str(context), len(done)))


def divergence_note(cases: Dict[str, Any], method: str = "dustin-h", budget: int = 512) -> str:
    """Where a method's greedy output leaves the dense output, item by item: after a shared correct
    answer, on items the dense run fails too, or with another answer (what the token match counts)."""
    dense = {k[:-len("/dense")]: c for k, c in cases.items() if k.endswith("/dense")}
    runs = [(dense[_item_of(k)], c) for k, c in cases.items()
            if c.get("method") == method and c.get("budget") == budget and _item_of(k) in dense]
    diverged = [(d, c) for d, c in runs if c["first_divergence"] is not None]
    after_answer = sum(1 for d, c in diverged if d["accuracy"] == c["accuracy"] == 1)
    both_wrong = sum(1 for d, c in diverged if d["accuracy"] == c["accuracy"] == 0)
    other = len(diverged) - after_answer - both_wrong
    firsts = sorted(c["first_divergence"] for _, c in diverged)
    return (f"Why the token match is low, item by item ({method}, k = {budget}): {len(runs) - len(diverged)} of "
            f"{len(runs)} outputs equal dense; of the {len(diverged)} that leave it (first differing token at "
            f"{', '.join(map(str, firsts))}), {after_answer} still give the correct answer, as dense "
            f"does (in other words), {both_wrong} are items dense fails too (the two runs guess differently), "
            f"{other} differ from dense in retrieval. The token match counts every token after the first difference as lost, so it measures "
            "identical continuations, not retrieval.")


def quality_target_notes() -> List[str]:
    """The quality targets of the real pair on the H200 (Dustin-H at k = 512), from the GPU quality files."""
    out = []
    measured = gpu_quality_contexts()
    for ctx in (16000, 32000):
        where = f"{ctx // 1000}k"
        if ctx not in measured:
            steps = [s["name"] for path in sorted(SUITES.glob("*.toml")) for suite in [tomllib.loads(path.read_text())]
                     if "h200" in suite.get("device", "") for s in suite["steps"]
                     if s["run"].startswith("dustin-quality") and f"--items {ctx}:" in s["run"]]
            out.append(f"Dustin-H at k = 512 keeping ≥ 97 % of dense retrieval accuracy and ≥ 0.95 greedy agreement "
                       f"at {where}: **not measured** (" + (f"suite step {', '.join(steps)}" if steps else
                                                             "no suite step runs it") + ", not run yet).")
            continue
        source = quality_source(QUALITY_GPU_MODEL, ctx)
        rows = {(r["method"], r["k"]): r for r in quality_rows(quality_cases(QUALITY_GPU_MODEL, ctx))}
        dense, dh = rows[(DENSE, "-")], rows.get(("dustin-h", 512))
        done, planned = quality_items(QUALITY_GPU_MODEL, ctx)
        if dh is None:
            continue
        kept = dh["accuracy"] / dense["accuracy"] if dense["accuracy"] else None
        verdict = "met" if kept is not None and kept >= 0.97 and dh["match"] >= 0.95 else "missed"
        partial = f" on the first {done} of {planned} items (provisional)" if done < planned else f" ({done} items)"
        others = ", ".join(f"{m} {rows[(m, 512)]['match']:.2f}" for m in QUALITY_GPU_METHODS[1:] if (m, 512) in rows)
        out.append(f"Dustin-H at k = 512 keeping ≥ 97 % of dense retrieval accuracy and ≥ 0.95 greedy agreement at "
                   f"{where}: **{verdict}**{partial} — accuracy {dh['accuracy']:.2f} against dense "
                   f"{dense['accuracy']:.2f} ({'-' if kept is None else f'{100 * kept:.0f} %'} of dense), token "
                   f"match with dense verification {dh['match']:.2f} (k = 512 others: {others}); the per-item "
                   f"records are in `{source}`. " + divergence_note(quality_cases(QUALITY_GPU_MODEL, ctx)))
    return out
