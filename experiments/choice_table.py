"""``python -m experiments.run choice-table``: a choice table for the measured choice between speculation and AR
(docs/methods.md §5.2) from measured whole runs: ``pair-speed`` results (a target with a separate draft, for
``pair-speed --arbitrate-table``) or ``knapspec`` results (the model drafting for itself, for ``knapspec
--choice-table``)."""

from __future__ import annotations

import pathlib
from typing import Any, Dict, List, Mapping, Sequence, Tuple

from experiments.common import print_table
from experiments.pair_speed import METHODS
from jaxspec.decoding.arbitration import CHOICE_MARGIN, ChoiceTable, start_bucket


def register(subparsers) -> None:
    c = subparsers.add_parser("choice-table", help="a choice table for the measured choice from pair-speed results "
                                                   "(pair-speed --arbitrate-table) or knapspec results (knapspec "
                                                   "--choice-table): whole-run speed-ups per method, context and "
                                                   "batch")
    c.add_argument("--from", dest="sources", default="", metavar="FILES",
                   help="comma-separated pair-speed results files (runs without --arbitrate, one target/draft pair "
                        "and device), or knapspec results files (runs without --choice-table, one model and "
                        "device: a table for knapspec --choice-table); where several measure one key the lowest "
                        "speed-up is kept")
    c.add_argument("--probed", default="", metavar="FILES",
                   help="comma-separated pair-speed results files measured under the measured choice without a "
                        "table (--arbitrate): each method's whole-run speed-up, its probe included, joins its key, "
                        "so a probe that chose plain decoding is not paid again (docs/methods.md §5.2)")
    c.add_argument("--outcomes", default="", metavar="FILES",
                   help="comma-separated pair-speed results files measured deciding from a choice table "
                        "(--arbitrate-table; knapspec results files: --choice-table): each speculative decision the "
                        "table took there adds that run's whole-run speed-up to its key, so a decision that lost "
                        "once is not taken again (docs/methods.md §5.2)")
    c.add_argument("--margin", type=float, default=CHOICE_MARGIN,
                   help="speculate only where the measured speed-up is at least 1 + MARGIN (default %(default)s)")
    c.set_defaults(func=cmd_choice_table)


#: pair-speed options that change what a method does; a choice table is built from runs without them
CHANGED_METHOD_OPTIONS = ("arbitrate", "reselect_every")


def choice_table_from(paths: Sequence[str], margin: float = CHOICE_MARGIN,
                      outcomes: Sequence[str] = (), probed: Sequence[str] = ()) -> ChoiceTable:
    """A :class:`~jaxspec.decoding.arbitration.ChoiceTable` from pair-speed results files: one entry per
    (method, context bucket, batch) with a measured speed-up against the paired AR run; where several files
    (or runs) measure the same key, the lowest speed-up is kept (the table should never promise a gain that
    one of its runs did not show), and every measurement is listed under ``measured``.

    ``outcomes``: pair-speed files measured deciding from a choice table (``--arbitrate-table``). Where the
    table's decision in such a run was to speculate, that run's whole-run speed-up (tail-check switches
    included: they are part of what the decision delivered) joins its key's runs, marked ``"outcome":
    True``; decisions for plain decoding and probed ones add nothing (they measured no speculative run the
    table chose). So a speculative decision that once ended below ``1 + margin`` is not taken again
    (docs/methods.md §5.2).

    ``probed``: pair-speed files measured under the measured choice without a table (``--arbitrate``, each
    method deciding from its own probe). Each method's whole-run speed-up there, its probe included, joins
    its key's runs, marked ``"probed": True`` with the probe's choice: where the probe chose plain decoding it
    is below 1 (the probe's cost), so the table decides plain decoding with no probe next time; where it chose
    to speculate it is the method's whole run less its probe's cost. So one probed run per key on a device
    without plain runs gives that device a table (docs/methods.md §5.2).

    ``knapspec`` results files may stand in ``paths`` and ``outcomes`` (not mixed with pair-speed files of another
    pair): their runs of the model drafting for itself, one entry per method name (:func:`knapspec_table_runs`),
    for ``knapspec --choice-table``."""
    import json

    if not paths and not probed:
        raise ValueError("choice-table: give at least one pair-speed or knapspec results file (--from, or --probed)")
    found: Dict[Tuple[str, int, int], List[Dict[str, Any]]] = {}
    meta: Dict[str, Any] = {}
    sources = ([(p, False, False) for p in paths] + [(p, True, False) for p in outcomes]
               + [(p, False, True) for p in probed])
    for path, outcome, by_probe in sources:
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"choice-table: {path}: no such file")
        data = json.loads(path.read_text())
        if data.get("experiment") == "knapspec":  # self-speculation: the model drafts for itself
            if by_probe:
                raise ValueError(f"choice-table: --probed {path} is a knapspec results file; KnapSpec probes each "
                                 f"plan itself: give its runs with --from")
            this, runs = knapspec_table_runs(path, data, outcome)
        elif data.get("experiment") == "pair-speed":
            this, runs = pair_speed_table_runs(path, data, outcome, by_probe)
        else:
            raise ValueError(f"choice-table: {path} is not a pair-speed or knapspec results file (experiment "
                             f"{data.get('experiment')!r})")
        for k, v in this.items():
            if meta.get(k, v) != v:
                raise ValueError(f"choice-table: {path} has {k} {v!r}, the files before it {meta[k]!r} (one table "
                                 f"holds one pair on one device)")
            meta[k] = v
        for key, run in runs:
            found.setdefault(key, []).append(run)
    if not found:
        raise ValueError(f"choice-table: no measured method in {', '.join(map(str, [*paths, *probed]))}")
    entries = []
    for (method, bucket, batch), runs in sorted(found.items()):
        low = min(runs, key=lambda r: r["speedup"])
        entry = {"method": method, "context_bucket": bucket, "batch": batch, "speedup": low["speedup"],
                 "measured": runs}
        if low.get("paired_ar_tok_s"):
            entry["ar_step_s"] = batch / float(low["paired_ar_tok_s"])
        entries.append(entry)
    return ChoiceTable(entries, margin=margin, meta=meta)


def pair_speed_table_runs(path, data: Mapping[str, Any], outcome: bool = False, by_probe: bool = False):
    """The whole runs of a ``pair-speed`` results file for a choice table: ``(meta, [((method, context bucket,
    batch), run), ...])``; ``outcome`` / ``by_probe``: the file goes in ``--outcomes`` / ``--probed``
    (:func:`choice_table_from` says what each counts)."""
    cfg = data.get("config", {})
    changed = [k for k in CHANGED_METHOD_OPTIONS if cfg.get(k) not in (None, 0, 1)]
    if outcome and not (cfg.get("arbitrate") and cfg.get("arbitrate_table")):
        raise ValueError(f"choice-table: --outcomes {path} was not measured deciding from a choice table "
                         f"(--arbitrate with --arbitrate-table); give plain runs with --from")
    if outcome and cfg.get("reselect_every") not in (None, 0, 1):
        raise ValueError(f"choice-table: --outcomes {path} was measured with --reselect-every; outcomes "
                         f"count only for the methods as the table holds them")
    if by_probe and not (cfg.get("arbitrate") and not cfg.get("arbitrate_table")):
        raise ValueError(f"choice-table: --probed {path} was not measured under the measured choice without a "
                         f"table (--arbitrate, no --arbitrate-table); "
                         + ("runs deciding from a table go in --outcomes" if cfg.get("arbitrate_table")
                            else "give plain runs with --from"))
    if by_probe and cfg.get("reselect_every") not in (None, 0, 1):
        raise ValueError(f"choice-table: --probed {path} was measured with --reselect-every; a choice table "
                         f"holds the methods as they are")
    if not outcome and not by_probe and changed:
        flags = ", ".join("--" + k.replace("_", "-") for k in changed)
        raise ValueError(f"choice-table: {path} was measured with {flags}; a choice table is built from plain "
                         f"runs of each method (runs deciding from a table go in --outcomes)")
    meta = {"target": cfg.get("model"), "draft": cfg.get("draft"), "dtype": cfg.get("dtype"),
            "device": (data.get("environment", {}).get("devices") or [None])[0]}
    runs = []
    for key, case in data.get("cases", {}).items():
        if not key.startswith("ctx") or not isinstance(case, dict):
            continue
        context, batch = int(case.get("context", key.split("/")[0][3:])), int(case.get("batch", key.split("/b")[1]))
        bucket = start_bucket(context)  # the bucket the run started in: prompt + the prefill's token
        for method in METHODS:
            r = case.get(method)
            if not isinstance(r, dict) or not r.get("speedup_vs_ar"):
                continue
            run = {"speedup": float(r["speedup_vs_ar"]), "tok_s": r.get("tok_s"),
                   "paired_ar_tok_s": r.get("paired_ar_tok_s"), "context": context, "source": str(path)}
            events = ((r.get("metrics") or {}).get("arbitration") or {}).get("events") or []
            first = events[0] if events else {}
            if outcome:
                if first.get("reason") != "table" or first.get("choice") != "speculative":
                    continue
                run["outcome"] = True
                run["switched_to_ar"] = any(e.get("reason") == "tail" and e.get("choice") == "ar"
                                            for e in events[1:])
            if by_probe:
                run["probed"] = True
                run["probe_choice"] = first.get("choice")
            runs.append(((method, bucket, batch), run))
    return meta, runs


def knapspec_table_runs(path, data: Mapping[str, Any], outcome: bool = False):
    """The whole runs of a ``knapspec`` results file for a choice table (docs/methods.md §5.2): ``(meta, [((method,
    context bucket, batch), run), ...])``. Each case (``TAG/TASK/ctxN/bB/METHOD``) gives its speed-up against the AR
    run paired with it; the table looks a run up by the method's name, so the re-planning KnapSpec of
    ``knapspec --choice-table`` finds the runs of its own method. ``outcome``: the file was measured deciding from
    a table (``knapspec --choice-table``); only the runs whose table decision was to plan count, as outcomes."""
    cfg = data.get("config", {})
    if outcome and not cfg.get("choice_table"):
        raise ValueError(f"choice-table: --outcomes {path} was not measured deciding from a choice table "
                         f"(knapspec --choice-table); give its runs with --from")
    if not outcome and cfg.get("choice_table"):
        raise ValueError(f"choice-table: {path} was measured deciding from a choice table (knapspec --choice-table); "
                         f"give it with --outcomes")
    meta = {"target": cfg.get("model"), "draft": "self", "dtype": cfg.get("dtype"),
            "device": (data.get("environment", {}).get("devices") or [None])[0]}
    runs = []
    for key, case in data.get("cases", {}).items():
        parts = key.split("/")
        if not isinstance(case, dict) or len(parts) != 5 or not parts[2].startswith("ctx") \
                or not parts[3].startswith("b") or not case.get("speedup_vs_ar"):
            continue
        context, batch, method = int(parts[2][3:]), int(parts[3][1:]), str(case.get("method", parts[4]))
        run = {"speedup": float(case["speedup_vs_ar"]), "tok_s": case.get("tokens_per_s"),
               "paired_ar_tok_s": case.get("ar_tokens_per_s"), "context": context, "source": str(path)}
        if outcome:
            decision = case.get("choice_table") or {}
            if decision.get("reason") != "table" or decision.get("choice") != "speculative":
                continue
            run["outcome"] = True
        runs.append(((method, start_bucket(context), batch), run))  # the bucket the run started in
    return meta, runs


def cmd_choice_table(args) -> Dict[str, Any]:
    if not args.out:
        raise ValueError("choice-table: give --out FILE, the table to write")
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    outcomes = [s.strip() for s in (args.outcomes or "").split(",") if s.strip()]
    probed = [s.strip() for s in (getattr(args, "probed", "") or "").split(",") if s.strip()]
    table = choice_table_from(sources, margin=args.margin, outcomes=outcomes, probed=probed)
    path = table.save(args.out)
    rows = [{"method": r["method"], "context_bucket": r["context_bucket"], "batch": r["batch"],
             "speedup": round(r["speedup"], 3), "runs": len(r["measured"]),
             "outcomes": sum(bool(m.get("outcome")) for m in r["measured"]),
             "probed": sum(bool(m.get("probed")) for m in r["measured"]), "choice": r["choice"]}
            for r in table.rows()]
    print_table(rows, ["method", "context_bucket", "batch", "speedup", "runs", "outcomes", "probed", "choice"])
    print(f"wrote {path} ({len(rows)} entries, margin {table.margin:g}; "
          f"{sum(r['choice'] == 'ar' for r in rows)} choose plain decoding)")
    return table.to_json()
