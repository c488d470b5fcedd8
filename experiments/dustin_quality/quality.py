"""``dustin-quality``: ARR, agreement with dense greedy output, perplexity, retrieval accuracy and tau per
method and budget, its tables and plots."""
from __future__ import annotations

import pathlib
import sys
import time
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from experiments.common import CompileCounter, ResultWriter, check_warm_workers, config_of, print_table, stop_tokens
from experiments.dustin_quality.runner import (HELD_EVERY, HELD_METHOD, M_RULE_METHODS, Method, PHASES, QUALITY_METHODS,
                                               QualityRunner, compiles_since, count_compiles, fmt_value, match_tokens,
                                               memory_summary, release_memory, select_items, warm_cache_for_quality)
from experiments.dustin_quality.tasks import build_task_splits, check_budgets, load_pair, parse_floats


def cmd_dustin_quality(args) -> Dict[str, Any]:
    """Every method x budget on a fixed seeded sample of evaluation-split retrieval tasks.

    Per item (one task prompt): the target (and draft) prefill the prompt up to a scored segment
    of ``--ppl-tokens`` haystack tokens that ends before the question; the segment is then verified
    chunk by chunk (``gamma + 1`` tokens, teacher forced) with dense attention and with each method
    (perplexity); the rest of the prompt is prefilled densely; dense greedy speculative decoding
    (ClassicSD) of ``--max-new-tokens`` gives the reference output, tau and -- probing every head --
    the ARR of every method's index set on each of its rounds; then every method decodes from the
    same caches (token match rate and first divergence vs dense, retrieval accuracy, tau).
    """
    from jaxspec.dustin.search import DustinProfile
    from jaxspec.data.tasks import score_answer

    budgets = check_budgets(args.budgets)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in names if m not in QUALITY_METHODS]
    if bad:
        raise ValueError(f"unknown --methods {bad}; valid: {', '.join(QUALITY_METHODS)}")
    m_steps = getattr(args, "m_steps", 1)
    per_length_m = getattr(args, "dustin_m_per_length", False)
    if m_steps < 1:
        raise ValueError(f"--m-steps={m_steps}: must be >= 1 (steps of the coverage rule's candidate ladder)")
    if m_steps != 1 and "dustin-h-cov" not in names:
        raise ValueError(f"--m-steps={m_steps} widens the coverage rule's candidates: add dustin-h-cov to --methods")
    m_every = getattr(args, "m_every", None)
    if m_every is not None and m_every < 2:
        raise ValueError(f"--m-every={m_every}: must be >= 2 (dustin-h-cov-held decides every N-th round; "
                         f"dustin-h-cov is the rule deciding every round)")
    if m_every is not None and HELD_METHOD not in names:
        raise ValueError(f"--m-every={m_every} sets how often {HELD_METHOD} decides: add it to --methods")
    m_every = HELD_EVERY if m_every is None else m_every
    m_every_schedule = getattr(args, "m_every_schedule", "cond")
    if m_every_schedule != "cond" and HELD_METHOD not in names:
        raise ValueError(f"--m-every-schedule={m_every_schedule} sets how {HELD_METHOD} runs its rounds: add it to "
                         f"--methods")
    per_length = {}
    for part in args.items.split(","):
        try:
            length, count = part.split(":")
            per_length[int(length)] = int(count)
        except ValueError:
            raise ValueError(f"--items {args.items!r}: expected LENGTH:COUNT pairs, e.g. 2048:2,4096:1") from None
    if not args.dustin_profile:
        raise ValueError("dustin-quality needs --dustin-profile FILE (from `dustin-profile` for this pair)")
    profile = DustinProfile.load(args.dustin_profile)
    missing = [b for b in budgets if b not in profile.configs]
    if missing:
        raise ValueError(f"{args.dustin_profile} has no config for k={missing}; profiled: {sorted(profile.configs)}")
    untabled = [b for b in budgets if not profile.m_by_length.get(b)]
    if per_length_m and untabled:
        raise ValueError(f"--dustin-m-per-length: {args.dustin_profile} has no m per context length for k={untabled} "
                         f"(add one with dustin-profile --extend FILE --recalibrate-m)")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    depths = parse_floats(args.depths, "--depths")
    per_split = len(kinds) * len(depths) * args.samples
    for length, count in per_length.items():
        if count > per_split:
            raise ValueError(f"--items {length}:{count} asks for more items than the evaluation split holds per "
                             f"length ({len(kinds)} kinds x {len(depths)} depths x --samples {args.samples} = "
                             f"{per_split}); raise --samples")
    warm_workers = getattr(args, "warm_workers", 1)
    check_warm_workers(warm_workers, getattr(args, "argv", None), len(names))
    writer = ResultWriter(args.out, "dustin-quality", config_of(args))
    target, draft, mask = load_pair(args)
    profile.check_models(target.config, draft.config if draft is not None else target.config)
    if mask is not None and not np.array_equal(np.asarray(profile.draft.get("self_draft_mask"), bool), mask):
        raise ValueError(f"{args.dustin_profile} was profiled for another self-draft skip set than {args.draft_skip!r}")
    _, evaluation = build_task_splits(target.tokenizer, args, kinds, sorted(per_length), depths)
    calib_hay = set(profile.data.get("haystack_sha256", []))
    overlap = calib_hay & {t.haystack_sha256 for t in evaluation if t.haystack_sha256}
    if overlap:
        raise ValueError(f"the evaluation tasks share haystack text with the profile's calibration data: {overlap}")
    items = select_items(evaluation, per_length, args.task_seed)
    runner = QualityRunner(target, draft, mask, profile, args.gamma, args.max_new_tokens, stop_tokens(target.tokenizer))
    methods = runner.methods(budgets, names, m_steps=m_steps, m_every=m_every,
                              m_every_schedule=m_every_schedule)
    writer.set("profile", {"file": args.dustin_profile, "created": profile.created, "target": profile.target.get("name"),
                           "draft": profile.draft.get("name"),
                           "configs": {str(b): c.to_dict() for b, c in sorted(profile.configs.items())},
                           "calibration_data": profile.data, "evaluation_haystack_disjoint": True})
    from jaxspec.data.tasks import TextCodec

    tok = TextCodec(target.tokenizer)
    pending = [task for task in items if not all(writer.has(f"{task.task_id}/{name}")
                                                 for name in ["dense"] + [m.key for m in methods])]
    warm_up = None
    if warm_workers > 1 and pending:
        warm_up = {"workers": warm_cache_for_quality(args, names, warm_workers, pending[0].context_tokens),
                   "first_item": None}
        counter = CompileCounter()
    started = time.perf_counter()
    compiled_for = None  # the context length the live executables were compiled for
    for number, task in enumerate(items, 1):
        item = task.task_id
        if task not in pending:
            continue
        if compiled_for is not None and compiled_for != task.context_tokens:
            release_memory(clear_compiled=True)  # other shapes from here on: free the old executables
        compiled_for = task.context_tokens
        item_methods = (runner.methods(budgets, names, m_steps=m_steps, context=task.context_tokens,
                                       m_every=m_every, m_every_schedule=m_every_schedule)
                        if per_length_m else methods)
        t0 = time.perf_counter()
        PHASES.clear()
        compiled0 = count_compiles()
        tokens = tok.encode(task.prompt)
        question = len(tok.encode(task.question)) + 2
        end = len(tokens) - question
        start = end - args.ppl_tokens
        if task.needle_span[1] > start:
            raise ValueError(f"{item}: the needle {task.needle_span} overlaps the perplexity segment [{start}, {end}); "
                             f"use depths < 1")
        capacity = task.context_tokens + args.max_new_tokens + 2 * args.gamma + 64
        print(f"[dustin-quality] item {number}/{len(items)} {item} ({len(tokens)} tokens): prefill ...",
              file=sys.stderr, flush=True)
        base0 = runner.prefill(tokens[:start], capacity)
        PHASES["prefill"] = time.perf_counter() - t0
        print(f"[dustin-quality]   prefill done ({time.perf_counter() - t0:.0f} s); {memory_summary()}", file=sys.stderr,
              flush=True)
        text = tokens[start:end]
        t_phase = time.perf_counter()
        draft_scores = runner.draft_chunk_scores(base0, text)
        ppl = {"dense": runner.perplexity(base0, text, Method("dense"), draft_scores)}
        for m in item_methods:
            if m.name not in ("magicdec", "dustin-h-oracle") and not writer.has(f"{item}/{m.key}"):
                ppl[m.key] = runner.perplexity(base0, text, m, draft_scores)
                release_memory()
                print(f"[dustin-quality]   ppl {m.key:16s} {ppl[m.key]['ppl']:.2f} ({time.perf_counter() - t0:.0f} s); "
                      f"{memory_summary()}", file=sys.stderr, flush=True)
        print(f"[dustin-quality]   perplexity done ({time.perf_counter() - t0:.0f} s): dense {ppl['dense']['ppl']:.2f}; "
              f"{memory_summary()}",
              file=sys.stderr, flush=True)
        PHASES["perplexity"] = time.perf_counter() - t_phase
        t_phase = time.perf_counter()
        base = runner.extend(base0, tokens[start:])
        del base0
        PHASES["extend"] = time.perf_counter() - t_phase
        if writer.has(f"{item}/dense"):
            dense = writer.get(f"{item}/dense")
        else:
            runner.m_rule_stats = {}
            t_phase = time.perf_counter()
            generated, metrics, arr = runner.decode(base, Method("dense"), reference=True, arr_methods=item_methods)
            PHASES["dense_decode_with_arr"] = time.perf_counter() - t_phase
            release_memory()
            text_out = target.tokenizer.decode(generated, skip_special_tokens=True)
            dense = {"task": item, "kind": task.kind, "context": task.context_tokens, "prompt_tokens": len(tokens),
                     "tokens": generated, "text": text_out, "accuracy": float(score_answer(task, text_out)),
                     "tau": metrics["tau"], "ppl": ppl["dense"]["ppl"], "nll": ppl["dense"]["nll"],
                     "ppl_tokens": ppl["dense"]["tokens"], "arr": arr, "rounds": metrics["rounds"],
                     "seconds": time.perf_counter() - t0,
                     "phase_seconds": dict(PHASES),  # release_memory: the part of the phases spent there
                     "compiles": compiles_since(compiled0)}  # XLA programs built for this item (none when warm)
            if runner.m_rule_stats:
                dense["m_rule"] = m_rule_summary(runner.m_rule_stats)
            writer.add(f"{item}/dense", dense)
        print(f"[dustin-quality]   dense: tau {fmt_value(dense['tau'])}, accuracy {dense['accuracy']:.0f}, "
              f"{dense['text'][:60]!r} ({time.perf_counter() - t0:.0f} s); {memory_summary()}", file=sys.stderr, flush=True)
        for m in item_methods:
            key = f"{item}/{m.key}"
            if writer.has(key):
                continue
            t1 = time.perf_counter()
            compiled1 = count_compiles()
            generated, metrics, _ = runner.decode(base, m)
            release_memory()
            text_out = target.tokenizer.decode(generated, skip_special_tokens=True)
            rate, first = match_tokens(generated, dense["tokens"])
            record = {"task": item, "kind": task.kind, "context": task.context_tokens, "method": m.name,
                      "budget": m.budget, "arr": None if m.name == "magicdec" else dense["arr"].get(m.key),
                      "match_rate": rate, "first_divergence": first, "accuracy": float(score_answer(task, text_out)),
                      "tau": metrics["tau"], "tokens": generated, "text": text_out,
                      "ppl": (ppl[m.key]["ppl"] if m.key in ppl else ppl["dense"]["ppl"]),
                      "nll": (ppl[m.key]["nll"] if m.key in ppl else ppl["dense"]["nll"]),
                      "seconds": time.perf_counter() - t1, "compiles": compiles_since(compiled1)}
            if m.name == "magicdec":
                record["note"] = "dense verification: output, accuracy and perplexity equal dense by construction"
            if m.dustin is not None:
                record["m"] = m.dustin.effective_m
            if m.name in M_RULE_METHODS:
                record["m_rule"] = M_RULE_METHODS[m.name]
                record.update(dense.get("m_rule", {}).get(m.key, {}))
                if m.name == "dustin-h-oracle":
                    record["ppl"] = record["nll"] = None
                    record["note"] = ("oracle: per round the m maximising ARR on the full-KV verification (a dense "
                                      "forward each round); no perplexity")
                elif m.dustin.m_rule in ("coverage", "entropy"):
                    record["m_candidates"] = list(m.dustin.m_candidates)
                    if m.dustin.m_rule == "entropy":
                        record.update(m_entropy_centre=m.dustin.m_entropy_centre,
                                      m_entropy_band=m.dustin.m_entropy_band)
                else:
                    record["m_balance"] = m.dustin.m_balance
            writer.add(key, record)
            arr_text = "-" if record["arr"] is None else f"{record['arr']:.3f}"
            print(f"[dustin-quality]   {m.key:16s} ARR {arr_text} match {rate:.2f} first_div {first} acc "
                  f"{record['accuracy']:.0f} tau {fmt_value(metrics['tau'])} ppl {fmt_value(record['ppl'])} "
                  f"({time.perf_counter() - t1:.0f} s; total {time.perf_counter() - started:.0f} s); {memory_summary()}",
                  file=sys.stderr, flush=True)
        del base
        release_memory()
        if warm_up is not None and warm_up["first_item"] is None:  # what the warm-up left this run to compile
            warm_up["first_item"] = {"task": item, **counter.counts()}
            writer.set("warm_up", writer.data.get("warm_up", []) + [warm_up])
    rows = quality_table(writer.data["cases"])
    print_table(rows, title=f"dustin-quality: mean over items ({len(items)} items)")
    print(quality_markdown(writer.data["cases"], budgets))
    if args.plot:
        plot = plot_m_rules if any(name in M_RULE_METHODS for name in names) else plot_arr
        plot(writer.data["cases"], args.plot, title=f"{args.model} + {args.draft or args.draft_skip}")
    return writer.data


def m_rule_summary(stats: Dict[str, Dict[str, list]]) -> Dict[str, Dict[str, Any]]:
    """Per method key: the chosen m per round and the mean selection seconds per round (fixed vs
    input-aware on the same signals; the rounds after the first, which compiles)."""
    out: Dict[str, Dict[str, Any]] = {}
    for key, values in stats.items():
        record: Dict[str, Any] = {}
        if "m" in values:
            record["m_per_round"] = [int(x) for x in values["m"]]
        if "fixed_arr_from_curve" in values:
            record["fixed_arr_from_curve"] = float(np.mean(values["fixed_arr_from_curve"]))
        for name in ("selection_s_fixed", "selection_s_input_aware"):
            if values.get(name):
                record[name] = float(np.mean(values[name]))
        if len(values.get("select_s", [])) > 1:  # signals + selection of the fixed rule; the first round compiles
            record["signals_and_selection_s"] = float(np.mean(values["select_s"][1:]))
        if record.get("selection_s_fixed"):
            record["selection_cost_ratio"] = record["selection_s_input_aware"] / record["selection_s_fixed"]
        out[key] = record
    return out


def quality_table(cases: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Mean per (method, k) over items; dense ClassicSD first."""
    # an item whose dense output ends at its first token (a stop token right after the prompt) has no
    # rounds: no ARR, nothing to agree on -- it counts for perplexity and accuracy only
    ended = {r["task"] for r in cases.values() if "method" not in r and len(r.get("tokens", [])) <= 1}
    token_fields = ("arr", "match_rate", "first_divergence", "tau")
    groups: Dict[Tuple[str, Any], List[dict]] = {}
    for record in cases.values():
        if record.get("task") in ended:
            record = {k: v for k, v in record.items() if k not in token_fields}
        name = record.get("method", "dense (ClassicSD)")
        groups.setdefault((name, record.get("budget")), []).append(record)
    order = {name: i for i, name in enumerate(("dense (ClassicSD)",) + QUALITY_METHODS)}
    rows = []
    for (name, budget), records in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1] or 0)):
        def mean(field):
            values = [r[field] for r in records if r.get(field) is not None]
            return float(np.mean(values)) if values else None

        firsts = [r["first_divergence"] for r in records if "match_rate" in r]
        rows.append({"method": name, "k": budget if budget is not None else "-", "items": len(records),
                     "ARR": mean("arr") if name != "dense (ClassicSD)" else 1.0,
                     "match": mean("match_rate") if firsts else 1.0,
                     "identical": (sum(f is None for f in firsts) / len(firsts)) if firsts else 1.0,
                     "first_div": (float(np.mean([f for f in firsts if f is not None]))
                                   if any(f is not None for f in firsts) else None),
                     "accuracy": mean("accuracy"), "tau": mean("tau"), "ppl": mean("ppl")})
    return rows


def quality_markdown(cases: Dict[str, Any], budgets: Sequence[int] = (128, 256, 512, 1024)) -> str:
    """One row per method, one column group per metric, k = 128/256/512/1024 inside each cell."""
    rows = quality_table(cases)
    by = {(r["method"], r["k"]): r for r in rows}

    def cell(name, field, fmt):
        values = [by.get((name, b), {}).get(field) for b in budgets]
        return " / ".join("-" if v is None else fmt.format(v) for v in values)

    lines = ["| method | ARR | token match vs dense | identical outputs | retrieval accuracy | perplexity | tau |",
             "|---|---|---|---|---|---|---|"]
    dense = by.get(("dense (ClassicSD)", "-"))
    if dense:
        lines.append(f"| dense (ClassicSD) | 1 | 1 | 1 | {fmt_value(dense['accuracy'])} | {fmt_value(dense['ppl'])} | "
                     f"{fmt_value(dense['tau'])} |")
    for name in QUALITY_METHODS:
        if not any((name, b) in by for b in budgets):
            continue
        lines.append(f"| {name} | {cell(name, 'ARR', '{:.3f}')} | {cell(name, 'match', '{:.2f}')} | "
                     f"{cell(name, 'identical', '{:.2f}')} | {cell(name, 'accuracy', '{:.2f}')} | "
                     f"{cell(name, 'ppl', '{:.2f}')} | {cell(name, 'tau', '{:.2f}')} |")
    return "\n".join(lines)


def plot_arr(cases: Dict[str, Any], path: str, title: str = "") -> None:
    """ARR, greedy agreement and retrieval accuracy against k (:func:`experiments.tables.plots.arr_plot`),
    its folder made first."""
    from experiments.tables.plots import arr_plot

    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    arr_plot(cases, path, title)


def plot_m_rules(cases: Dict[str, Any], path, title: str = "") -> None:
    """The m-rule plot of :func:`experiments.tables.plots.plot_m_rules`, its folder made first."""
    from experiments.tables.plots import plot_m_rules as plot

    if isinstance(path, (str, pathlib.Path)):
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    plot(cases, path, title)
