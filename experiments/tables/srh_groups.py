"""GQA-aware SRHs (docs/methods.md §3.4): the best heads anywhere against heads that share one KV group.

The Qwen pair's two profiles: quality on the same items, the per-round scoring of both, and the dustin-speed /
pair-speed runs with the target's SRHs in one KV group against the runs they repeat (:func:`srh_group_blocks`,
:func:`srh_group_verdicts`).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Sequence, Tuple

from experiments.tables import inputs
from experiments.tables.dustin_quality import complete_quality_cases, quality_budgets, quality_rows
from experiments.tables.dustin_speed import selection_share
from experiments.tables.kernels import kernel_cases, pick
from experiments.tables.inputs import (DEVICE_NAME, DUSTIN_SPEED_SHARED_GPU, DUSTIN_SPEED_SRH_1GROUP,
                                       PAIR_SPEED_SRH_1GROUP, REPO, SCORING_LAYOUTS_GPU, SRH_GROUP_METHODS,
                                       SRH_GROUP_PROFILES,
                                       SRH_GROUP_QUALITY, SRH_GROUP_SCORING, code_commit, read_path)

SRH_GROUP_LABEL = {"any": "the best 4 anywhere", "1group": "from one KV group"}


def srh_group_contexts() -> List[int]:
    """The contexts whose quality runs exist with both profiles (and both profiles are committed)."""
    if not all((REPO / p).exists() for _, p in SRH_GROUP_PROFILES):
        return []
    return [ctx for ctx, runs in SRH_GROUP_QUALITY.items() if all((inputs.RESULTS / src).exists() for _, src in runs)]


def _srh_group_rows(ctx: int) -> Dict[str, Dict[Tuple[str, int], Dict[str, Any]]]:
    return {tag: {(r["method"], r["k"]): r for r in quality_rows(complete_quality_cases(src))}
            for tag, src in SRH_GROUP_QUALITY[ctx]}


def srh_group_quality(source: str, method: str, budget: int, field: str):
    def get(_):
        return read_path(quality_rows(complete_quality_cases(source)), ({"method": method, "k": budget}, field))
    return get


def scoring_ratio(data: Dict[str, Any], key: str) -> float:
    seconds = data["cases"][key]["seconds"]
    return seconds[SRH_GROUP_PROFILES[1][1]] / seconds[SRH_GROUP_PROFILES[0][1]]


def _groups(heads: Sequence[int], per_kv: int) -> str:
    count = len({h // per_kv for h in heads})
    return f"{list(heads)} ({count} group{'s' if count > 1 else ''})"


def srh_group_blocks() -> List[str]:
    """The two profiles' configs, their quality on the same items, and the per-round scoring of each."""
    if not srh_group_contexts():
        return ["Not measured yet (suite cpu-dustin-quality, steps `qwen2.5-coder-1.5b-profile-srh-1group`, "
                "`qwen2.5-coder-1.5b-2k-srh-any`, `qwen2.5-coder-1.5b-2k-srh-1group`, `scoring-srh-groups`)."]
    profiles = {tag: json.loads((REPO / path).read_text()) for tag, path in SRH_GROUP_PROFILES}
    t_qpk = profiles["any"]["target"]["num_heads"] // profiles["any"]["target"]["num_kv_heads"]
    d_qpk = profiles["any"]["draft"]["num_heads"] // profiles["any"]["draft"]["num_kv_heads"]
    budgets = sorted(set.intersection(*(set(map(int, p["configs"])) for p in profiles.values())))
    lines = ["| k | SRHs | target layer: heads | draft layers: heads | m | calibration ARR (Algorithm 1) |",
             "|---|---|---|---|---|---|"]
    for k in budgets:
        for tag, _ in SRH_GROUP_PROFILES:
            c = profiles[tag]["configs"][str(k)]
            draft = "; ".join(f"{layer}: {_groups(h, d_qpk)}" for layer, h in zip(c["draft_layers"], c["draft_heads"]))
            lines.append(f"| {k} | {SRH_GROUP_LABEL[tag]} | {c['target_layer']}: {_groups(c['target_heads'], t_qpk)} | "
                         f"{draft} | {c['m']} | {profiles[tag]['search'][str(k)]['arr']:.4f} |")
    out = ["The two profiles (`" + "`, `".join(p for _, p in SRH_GROUP_PROFILES) + "`; heads with their KV groups, "
           f"{t_qpk} query heads per KV head in the target, {d_qpk} in the draft):\n\n" + "\n".join(lines)]
    for ctx in srh_group_contexts():
        rows, runs = _srh_group_rows(ctx), SRH_GROUP_QUALITY[ctx]
        q_budgets = quality_budgets(runs[0][1])
        items = len({c["task"] for c in complete_quality_cases(runs[0][1]).values()})
        lines = ["| method | k | ARR any / one group | token match vs dense any / one group | "
                 "retrieval accuracy any / one group | tau any / one group |", "|---|---|---|---|---|---|"]
        for method in SRH_GROUP_METHODS:
            for k in q_budgets:
                a, g = rows["any"].get((method, k)), rows["1group"].get((method, k))
                if not a or not g:
                    continue
                lines.append(f"| {method} | {k} | {a['ARR']:.4f} / {g['ARR']:.4f} | {a['match']:.2f} / {g['match']:.2f} "
                             f"| {a['accuracy']:.2f} / {g['accuracy']:.2f} | {a['tau']:.2f} / {g['tau']:.2f} |")
        out.append(f"Quality on the same {items} seeded {ctx // 1024}k evaluation items (passkey, needle QA; float32, "
                   f"greedy, gamma 4, 16 new tokens, CPU; `{runs[0][1]}`, `{runs[1][1]}`, one commit):\n\n"
                   + "\n".join(lines))
    if (inputs.RESULTS / SRH_GROUP_SCORING).exists():
        data = inputs.load(SRH_GROUP_SCORING)
        lines = ["| positions | batch | k | KV groups read (target / draft layers), any | one group | "
                 "key MB any / one group | ms any | ms one group | one group / any |", "|---|---|---|---|---|---|---|---|---|"]
        for case in data["cases"].values():
            (pa, ia), (pg, ig) = [(p, case["profiles"][p]) for _, p in SRH_GROUP_PROFILES]
            fmt_g = lambda i: f"{i['target_kv_groups']} / {' + '.join(map(str, i['draft_kv_groups']))}"  # noqa: E731
            lines.append(f"| {case['context']} | {case['batch']} | {case['k']} | {fmt_g(ia)} | {fmt_g(ig)} | "
                         f"{ia['key_bytes'] / 1e6:.0f} / {ig['key_bytes'] / 1e6:.0f} | "
                         f"{1e3 * case['seconds'][pa]:.2f} | {1e3 * case['seconds'][pg]:.2f} | "
                         f"{case['seconds'][pg] / case['seconds'][pa]:.2f}x |")
        out.append(f"The signal scoring of one round (s_T of the target SRH layer and s_D of the draft SRH layers, "
                   f"gamma {data['config']['gamma']} draft rows, {data['config']['dtype']} keys, seeded; "
                   f"`{SRH_GROUP_SCORING}`, CPU, best of {data['config']['repeats']} interleaved timings of "
                   f"{data['config']['iters']} calls; each profile's own layers and heads at k = "
                   f"{data['config']['budgets']}):\n\n" + "\n".join(lines))
    out += _srh_group_gpu_blocks()
    out += _scoring_layout_blocks()
    return out


def _scoring_layout_blocks() -> List[str]:
    """bench-scoring with the XLA products and the Pallas scoring kernel on a GPU, both SRH profiles."""
    out = []
    for gpu, source in SCORING_LAYOUTS_GPU:
        if not (inputs.RESULTS / source).exists():
            out.append(f"The round's scoring by layout on the {gpu.upper()} (`{source}`): not measured yet (suite "
                       f"`{inputs.suite_steps()[source][0]}`, step `scoring-layouts-srh-groups`).")
            continue
        data = inputs.load(source)
        lines = ["| positions | batch | k | SRHs | key MB | XLA products ms | Pallas kernel ms | Pallas / XLA | "
                 "Pallas GB/s | scores differ by |", "|---|---|---|---|---|---|---|---|---|---|"]
        for key, case in data["cases"].items():
            for tag, profile in SRH_GROUP_PROFILES:
                xla, pallas = case["profiles"][f"{profile} [groups]"], case["profiles"][f"{profile} [pallas]"]
                t_x, t_p = case["seconds"][f"{profile} [groups]"], case["seconds"][f"{profile} [pallas]"]
                lines.append(f"| {case['context']} | {case['batch']} | {case['k']} | {SRH_GROUP_LABEL[tag]} | "
                             f"{xla['key_bytes'] / 1e6:.0f} | {1e3 * t_x:.3f} | {1e3 * t_p:.3f} | {t_p / t_x:.2f}x | "
                             f"{pallas['key_bytes'] / t_p / 1e9:.0f} | {pallas['rel_diff_vs_first']:.1e} |")
        out.append(f"The signal scoring of one round by layout on the {gpu.upper()} ({data['environment']['devices'][0]}; "
                   f"`{source}`, commit {code_commit(data)}; {data['config']['dtype']} keys, gamma "
                   f"{data['config']['gamma']} draft rows, best of {data['config']['repeats']} interleaved timings of "
                   f"{data['config']['iters']} calls): XLA's products per KV head (`scoring_layout=\"groups\"`, the "
                   "default) against the Pallas kernel reading each block of the cache in place (`\"pallas\"`, "
                   "docs/methods.md §3.1); the last column is the largest score difference relative to the largest "
                   "score (the kernel multiplies bf16 probe queries):\n\n" + "\n".join(lines))
    return out


def _srh_group_gpu_blocks() -> List[str]:
    """dustin-speed with the target's SRHs in one KV group against the run with them in four (H200, H100), and the
    real pair end to end with the one-group profile."""
    out = []
    for when, source, base, _, _, dev in DUSTIN_SPEED_SRH_1GROUP:
        if not (inputs.RESULTS / source).exists() or not (inputs.RESULTS / base).exists():
            continue
        data, ref = inputs.load(source), inputs.load(base)
        lines = ["| method | target SRH heads | selection ms (mean per round) | selection / round | x AR |",
                 "|---|---|---|---|---|"]
        for method in ("dustin", "dustin-kv-streaming"):
            for d in (ref, data):
                heads = str(d["config"].get("target_heads") or "")
                label = heads.replace(",", ", ") if heads else "one per KV group (the default)"
                row = read_path(d, ("cases", "ctx32768/b16", "rows", {"method": method}))
                lines.append(f"| {method} | {label} | {_selection_ms(d, method):.3f} | "
                             f"{100 * selection_share(d, method):.1f} % | {row['speedup']:.2f}x |")
        commits = {code_commit(d) for d in (data, ref)}
        taus = sorted({f["path"].removeprefix("experiments/results/") for d in (data, ref)
                       for f in d.get("acceptance", {}).get("files", [])})
        shared = [f"`{f}` ran while {DUSTIN_SPEED_SHARED_GPU[f]}" for f in (source, base) if f in DUSTIN_SPEED_SHARED_GPU]
        out.append(f"On the {DEVICE_NAME[dev]}, the 7B / 0.5B shapes at 32k, batch 16, k = 512, selecting {when} (`{source}` against "
                   f"`{base}`, " + ("one commit" if len(commits) == 1 else f"commits {' and '.join(sorted(commits))}")
                   + (f"; each method at the tau the real pair measured for it in `{'`, `'.join(taus)}`" if taus else "")
                   + "):\n\n" + "\n".join(lines)
                   + (f"\n\nShared GPU: {'; '.join(shared)}, so its timings are provisional." if shared else ""))
    source, base = PAIR_SPEED_SRH_1GROUP
    if (inputs.RESULTS / source).exists() and (inputs.RESULTS / base).exists():
        data, ref = inputs.load(source), inputs.load(base)
        lines = ["| method | SRHs | x paired AR | tau | acceptance |", "|---|---|---|---|---|"]
        for method in ("dustin", "dustin-kv-streaming"):
            for label, d in (("the best 4 anywhere", ref), ("from one KV group", data)):
                case = d["cases"]["ctx32000/b16"].get(method) or {}
                if "speedup_vs_ar" in case:
                    lines.append(f"| {method} | {label} | {case['speedup_vs_ar']:.2f}x | {case['metrics']['tau']:.2f} | "
                                 f"{case['metrics']['acceptance_rate']:.3f} |")
        commits = {d["environment"].get("commit", "?")[:7] for d in (data, ref)}
        out.append(f"The real Qwen2.5-Coder pair on the H200 (pair-speed, 32000 tokens, batch 16, bf16, Pallas; "
                   f"`{source}` against `{base}`, "
                   + ("one commit" if len(commits) == 1 else f"commits {' and '.join(sorted(commits))}")
                   + "):\n\n" + "\n".join(lines))
    return out


def srh_group_verdicts() -> List[str]:
    out, diffs, accuracy_same, points, per_ctx = [], [], 0, 0, []
    for ctx in srh_group_contexts():
        rows, here = _srh_group_rows(ctx), []
        for (method, k), a in rows["any"].items():
            g = rows["1group"].get((method, k))
            if method == "dustin-h" and g:
                here.append(g["ARR"] - a["ARR"])
                points += 1
                accuracy_same += g["accuracy"] == a["accuracy"]
        diffs += here
        if here:
            per_ctx.append(f"{ctx // 1024}k {sum(here) / len(here):+.4f}")
        out += _srh_group_verdicts(ctx)
    if diffs:
        out.insert(0, f"Dustin-H with one-group SRHs against the best heads anywhere, {points} (context, k) points at "
                      + ", ".join(f"{c // 1024}k" for c in srh_group_contexts())
                      + f": ARR {min(diffs):+.4f} to {max(diffs):+.4f} (mean {sum(diffs) / len(diffs):+.4f}), "
                      f"higher at {sum(d > 0 for d in diffs)} of them; mean per context " + ", ".join(per_ctx)
                      + f"; retrieval accuracy the same at {accuracy_same} of {points}. Both profiles were "
                      "calibrated on 2k tasks.")
    return out + _srh_scoring_verdicts()


def _srh_group_verdicts(ctx: int) -> List[str]:
    rows, out = _srh_group_rows(ctx), []
    for method in SRH_GROUP_METHODS:
        pairs = [(k, rows["any"][(method, k)]["ARR"], rows["1group"][(method, k)]["ARR"])
                 for (m, k) in rows["any"] if m == method and (m, k) in rows["1group"]]
        if pairs:
            diffs = [g - a for _, a, g in pairs]
            out.append(f"{ctx // 1024}k, {method}: one-group SRHs change ARR by {min(diffs):+.4f} to {max(diffs):+.4f} across k "
                       f"(mean {sum(diffs) / len(diffs):+.4f}); token match " + ", ".join(
                           f"k = {k}: {rows['any'][(method, k)]['match']:.2f} → {rows['1group'][(method, k)]['match']:.2f}"
                           for k, _, _ in pairs) + ".")
    return out


def _srh_scoring_verdicts() -> List[str]:
    if not (inputs.RESULTS / SRH_GROUP_SCORING).exists():
        return []
    data = inputs.load(SRH_GROUP_SCORING)
    parts = []
    for key, case in data["cases"].items():
        (pa, ia), (pg, ig) = [(p, case["profiles"][p]) for _, p in SRH_GROUP_PROFILES]
        parts.append(f"{case['context'] // 1024}k/b{case['batch']}: {scoring_ratio(data, key):.2f}x the time for "
                     f"{ig['key_bytes'] / ia['key_bytes']:.2f}x the key bytes")
    h200 = []
    for when, source, base, _, _, dev in DUSTIN_SPEED_SRH_1GROUP:
        if (inputs.RESULTS / source).exists() and (inputs.RESULTS / base).exists():
            shares = {m: (selection_share(inputs.load(base), m), selection_share(inputs.load(source), m))
                      for m in ("dustin", "dustin-kv-streaming")}
            h200.append(f"Selection at most 3 % of a round at 32k/b16 on the {DEVICE_NAME[dev]}, target SRHs in one KV group, "
                        f"selecting {when}: " + "; ".join(
                            f"{m} {100 * b:.1f} % → {100 * g:.1f} % ({'**met**' if g <= 0.03 else '**missed**'})"
                            for m, (b, g) in shares.items()) + ".")
    h200 += _srh_group_spread_verdicts()
    rows = kernel_cases()[("qwen2.5-7b", 32768, 16)]
    selection_us = {v: pick(rows, v, 512)["us"] for v in ("selection_4groups", "selection_1group")}
    return h200 + ["Signal scoring per round with one-group SRHs against the best-anywhere heads on the CPU (bench-scoring, "
            "float32): " + "; ".join(parts) + ". The selection target (<= 3 % of "
            "a round at 32k/b16) is held on the GPU: on the H200 the 7B shape's scoring of 4 target heads measured "
            f"{selection_us['selection_4groups']:.0f} µs in 4 KV groups against {selection_us['selection_1group']:.0f} "
            "µs in one (bench-attention above, 32k, batch 16, with the top-k)"
            + ("." if h200 else ", and the round with one-group target heads (h200-dustin-speed steps "
               "`b16-srh-1group-pair-tau-32k`, `b16-reselect-2-srh-1group-pair-tau-32k`) is not measured yet.")]


def _selection_ms(data: Dict[str, Any], method: str) -> float:
    """A dustin-speed 32k/b16 run's mean selection time per round (ms): a selection every round, or averaged
    with the reuse rounds in between (--reselect-every)."""
    row = read_path(data, ("cases", "ctx32768/b16", "rows", {"method": method}))
    return row.get("selection_ms_per_round", row["selection_ms"])


def _srh_group_spread_verdicts() -> List[str]:
    """Where a device ran the every-round pair twice: the one-group change in selection time against the spread of
    the same configuration between the two runs."""
    out = []
    for dev in DEVICE_NAME:
        pairs = [(inputs.load(src), inputs.load(base)) for when, src, base, _, _, d in DUSTIN_SPEED_SRH_1GROUP
                 if d == dev and when.startswith("every round") and (inputs.RESULTS / src).exists()
                 and (inputs.RESULTS / base).exists()]
        if len(pairs) < 2:
            continue
        parts, within = [], True
        for method in ("dustin", "dustin-kv-streaming"):
            one = [_selection_ms(a, method) for a, _ in pairs]
            anyg = [_selection_ms(b, method) for _, b in pairs]
            change = sum(one) / sum(anyg) - 1
            within &= min(one) <= max(anyg) and min(anyg) <= max(one)  # the two configurations' runs overlap
            parts.append(f"{method} {sum(anyg) / len(anyg):.3f} → {sum(one) / len(one):.3f} ms "
                         f"({100 * change:+.0f} %; the same configuration's runs "
                         f"{min(anyg):.3f}-{max(anyg):.3f} and {min(one):.3f}-{max(one):.3f} ms)")
        out.append(f"One-group target SRHs on the {DEVICE_NAME[dev]}, the every-round pair run {len(pairs)} times on "
                   f"one machine, mean selection time per round: " + "; ".join(parts) + "." + (
                       " The two configurations' runs overlap, so the change is within the run-to-run spread: the "
                       "target signal's key "
                       "reads that one group saves (what bench-attention measured for the 7B shape's target scoring "
                       "on the H200, below) are too small a part of the selection to show in one run, and the 3 % "
                       "target needs a cheaper top-k and draft scoring as well, or selecting less often."
                       if within else " The two configurations' runs do not overlap."))
    return out
