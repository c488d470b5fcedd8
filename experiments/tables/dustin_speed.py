"""Dustin on the Qwen2.5-7B shape (``dustin_speed/*.json``): its speed-up over AR by context and batch.

Each method at the tau the real pair measured for it, with the sparse draft KV and finished rows skipped or
kept (:func:`dustin_speed_tables`, :func:`finished_rows_speed_note`), and selection's share of a round,
selecting every round or every R-th (:func:`selection_share_note`). :func:`dustin` (the JSON path of one
method's field) and :func:`selection_share` are read by the figures too.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Dict, List

from experiments.tables import inputs
from experiments.tables.inputs import (DUSTIN_SPEED, DUSTIN_SPEED_FINISHED, DUSTIN_SPEED_FINISHED_KEPT,
                                       DUSTIN_SPEED_PAIR_TAU, DUSTIN_SPEED_RESELECT, DUSTIN_SPEED_RESELECT3,
                                       DUSTIN_SPEED_SPARSE, DUSTIN_SPEED_SPARSE_32K, DUSTIN_SPEED_SPARSE_B8,
                                       DUSTIN_SPEED_SPARSE_METHODS, DUSTIN_TRACE, DUSTIN_TRACE_SPARSE, E2E,
                                       PAIR_SPEED_FINISHED_KEPT, PAIR_SPEED_RESELECT, PAIR_SPEED_RESELECT3,
                                       PAIR_SPEED_SPARSE_DRAFT, code_commit, read_path, suite_steps)


def dustin(context, batch, method, field):
    return ("cases", f"ctx{context}/b{batch}", "rows", {"method": method}, field)


def selection_share(data, method: str) -> float:
    row = read_path(data, ("cases", "ctx32768/b16", "rows", {"method": method}))
    # with a selection every R-th round (docs/methods.md §3.8) the mean per round, reuse rounds included
    return row.get("selection_ms_per_round", row["selection_ms"]) / (1e3 * row["batch"] * row["tau"] / row["tok_s"])


#: Pallas kernels that only the selection launches (the SRH scoring, ``DustinConfig.scoring_layout="pallas"``), by
#: kernel name; XLA numbers a kernel's further instances ``__1``, ``__2``, ...
SELECTION_KERNELS = ("jaxspec_srh_logits",)


def _selection_kernel(name: str) -> bool:
    return re.sub(r"__\d+$", "", name) in SELECTION_KERNELS


def traced_phases(data, method: str):
    """The device-time split by round phase of ``method``'s traced plane in a ``dustin-speed --trace`` file's 32k/b16
    case (``None`` where the method was not traced or its trace was not split). A trace taken before the tracer
    placed Pallas kernels by their custom call's name left the SRH scoring kernel unattributed inside a command
    buffer; such kernels (:data:`SELECTION_KERNELS`, named for the selection alone) are moved to the selection here,
    their kernel time added to its busy time (one stream: they overlap none of its other kernels) and recorded
    under ``moved_from_unattributed``."""
    phases = traced_rounds(data).get(method, {}).get("plane", {}).get("phases")
    if not phases or "unattributed" not in phases:
        return phases
    moved = [k for k in phases["unattributed"].get("top_kernels", []) if _selection_kernel(k["name"])]
    if not moved:
        return phases
    phases = copy.deepcopy(phases)
    seconds, count = sum(k["total_s"] for k in moved), sum(int(k["count"]) for k in moved)
    rest = phases["unattributed"]
    rest.update(busy_s=max(0.0, rest["busy_s"] - seconds), kernel_time_s=max(0.0, rest["kernel_time_s"] - seconds),
                launches=rest["launches"] - count,
                top_kernels=[k for k in rest["top_kernels"] if not _selection_kernel(k["name"])])
    selection = phases.setdefault("selection", {"busy_s": 0.0, "kernel_time_s": 0.0, "launches": 0, "top_kernels": []})
    selection.update(busy_s=selection["busy_s"] + seconds, kernel_time_s=selection["kernel_time_s"] + seconds,
                     launches=selection["launches"] + count,
                     top_kernels=sorted(selection["top_kernels"] + moved, key=lambda k: -k["total_s"])[:8],
                     moved_from_unattributed={"kernels": [k["name"] for k in moved], "seconds": seconds,
                                              "launches": count})
    return phases


def phase_rounds(data, method: str) -> Dict[str, float]:
    """The loop's rounds (iterations, every row's phases run in each: ``metrics.rounds``) of a ``dustin-speed``
    file's 32k/b16 case, and the timed run's ms per such round."""
    entry = data["cases"]["ctx32768/b16"][method]
    rounds = int(entry["metrics"]["rounds"])
    return {"rounds": rounds, "round_ms": entry["timing"]["median_s"] * 1e3 / rounds}


def phase_over_floor(data, method: str, phase: str) -> float:
    """A phase's device-busy time over its bytes floor per loop round (the run's ``phase_bytes`` at its measured copy
    bandwidth), from a ``dustin-speed --trace`` file with the round split by phase."""
    floor_s = data["cases"]["ctx32768/b16"][method]["phase_bytes"][phase] / data["cases"]["copy_bandwidth"]["bandwidth_Bps"]
    return traced_phases(data, method)[phase]["busy_s"] / phase_rounds(data, method)["rounds"] / floor_s


def phase_selection(data, method: str) -> Dict[str, float]:
    """From a ``dustin-speed --trace`` file with the round split by phase, per loop round: the selection's
    device-busy ms, the timed run's ms, the method's device-busy ms, and the selection's share of each."""
    phases = traced_phases(data, method)
    loop = phase_rounds(data, method)
    selection = phases.get("selection", {"busy_s": 0.0})["busy_s"] * 1e3 / loop["rounds"]
    busy = sum(p["busy_s"] for p in phases.values()) * 1e3 / loop["rounds"]
    return {"selection_ms": selection, "round_ms": loop["round_ms"], "busy_ms": busy,
            "share_of_round": selection / loop["round_ms"], "share_of_busy": selection / busy}


def _phase_selection_note() -> str:
    """The selection's in-loop share of a round, from the phase-split traces, per GPU where one exists."""
    parts = []
    for tag, _, heads, source in inputs.DUSTIN_TRACE_PHASES:
        if not (inputs.RESULTS / source).exists():
            continue
        data = inputs.load(source)
        for method, label in (("dustin", "full-KV Dustin-H"), ("dustin-kv-streaming", "with the streaming draft KV")):
            if not traced_phases(data, method):
                continue
            s = phase_selection(data, method)
            parts.append(f"{tag.upper()}, {heads}, {label}: {s['selection_ms']:.2f} ms of a {s['round_ms']:.1f} ms round "
                         f"({100 * s['share_of_round']:.1f} %, **{'met' if s['share_of_round'] <= 0.03 else 'missed'}**;"
                         f" {100 * s['share_of_busy']:.1f} % of the device-busy time)")
    if not parts:
        return ""
    return (" Inside the fused loop, with no host synchronisation between phases (the selection's kernels in a "
            "device trace of one run, placed by the round's named scopes; the timed run's round): "
            + "; ".join(parts) + ".")


def selection_share_note() -> str:
    """Selection as a share of a Dustin round at 32k/b16 (target <= 3 %), from the runs at the real pair's tau."""
    parts = []
    for source, method, label in ((DUSTIN_SPEED_PAIR_TAU, "dustin", "full-KV Dustin-H"),
                                  (DUSTIN_SPEED_SPARSE, "dustin-kv-streaming", "Dustin-H with the streaming draft KV")):
        row = read_path(inputs.load(source), ("cases", "ctx32768/b16", "rows", {"method": method}))
        round_ms = 1e3 * row["batch"] * row["tau"] / row["tok_s"]
        ms = row.get("selection_ms_per_round", row["selection_ms"])
        parts.append(f"{label} {ms:.2f} ms of a {round_ms:.1f} ms round ({100 * ms / round_ms:.1f} %, `{source}`)")
    text = ("Selection at most 3 % of a round at 32k, batch 16, selecting every round: **missed** — "
            + "; ".join(parts) + ". A round's time here is batch x realised tau / tokens per second; the selection "
            "is timed as its own phase (`--profile`), which adds each phase's dispatch." + _phase_selection_note())
    if not (inputs.RESULTS / DUSTIN_SPEED_RESELECT).exists():
        return text + " Selecting every second round (docs/methods.md §3.8, `--reselect-every 2`) is not measured yet."
    data = inputs.load(DUSTIN_SPEED_RESELECT)
    shares = _reselect_shares(data)
    text += (" Selecting every second round (docs/methods.md §3.8, `--reselect-every 2`, each method at the "
             f"tau the real pair measured with it, `{DUSTIN_SPEED_RESELECT}`): " + "; ".join(shares) + ". The "
             "speed-up barely moves: half a selection is a few per cent of a round, and a reused set lowers the "
             "real pair's tau a little (the next note's 32k/b16 runs).")
    return text + _reselect3_note()


def _reselect_shares(data) -> List[str]:
    """Per Dustin-H draft of a dustin-speed run selecting every R-th round: its selection share of a round
    against the 3 % target, the mean selection per round, the speed-up and the tau it ran at."""
    shares = []
    for method, label in (("dustin", "full-KV Dustin-H"), ("dustin-kv-streaming", "with the streaming draft KV")):
        row = read_path(data, ("cases", "ctx32768/b16", "rows", {"method": method}))
        share = selection_share(data, method)
        shares.append(f"{label} {100 * share:.1f} % (**{'met' if share <= 0.03 else 'missed'}**; "
                      f"{row['selection_ms_per_round']:.2f} ms a round on average, {row['speedup']:.2f}x AR at "
                      f"tau {row['tau']:.2f})")
    return shares


def _reselect3_note() -> str:
    """Selection every third round: its share of a round on the 7B shape at the real pair's tau, and the real pair's
    own speed-ups selecting every round, every second and every third round at 32k/b16."""
    if not (inputs.RESULTS / DUSTIN_SPEED_RESELECT3).exists():
        return " Selecting every third round (step `b16-reselect-3-pair-tau-32k`) is not measured yet."
    data = inputs.load(DUSTIN_SPEED_RESELECT3)
    shares = _reselect_shares(data)
    text = (" Selecting every third round (`--reselect-every 3`, each method at the tau the real pair measured with "
            f"it, `{DUSTIN_SPEED_RESELECT3}`, commit {code_commit(data)}): " + "; ".join(shares) + ".")
    runs = [(when, src) for when, src in (("every round", PAIR_SPEED_SPARSE_DRAFT),
                                          ("every round, finished rows reading their history", PAIR_SPEED_FINISHED_KEPT),
                                          ("every second round", PAIR_SPEED_RESELECT),
                                          ("every third round", PAIR_SPEED_RESELECT3)) if (inputs.RESULTS / src).exists()]
    labels = (("dustin", "full-KV Dustin-H"), ("dustin-kv-streaming", "the streaming draft KV"))
    speeds = {method: [(when, inputs.load(src)["cases"]["ctx32000/b16"][method]) for when, src in runs
                       if "speedup_vs_ar" in inputs.load(src)["cases"].get("ctx32000/b16", {}).get(method, {})]
              for method, _ in labels}
    parts = [f"{label}: " + ", ".join(f"{when} {c['speedup_vs_ar']:.2f}x (tau {c['metrics']['tau']:.2f})"
                                      for when, c in speeds[method]) for method, label in labels if speeds[method]]
    if parts:
        taus = [c["metrics"]["tau"] for method, _ in labels for _, c in speeds[method]]
        text += (" The real pair end to end at 32k/b16 against its paired AR, one run each (`"
                 + "`, `".join(src for _, src in runs) + "`): " + "; ".join(parts)
                 + f". Tau spans {min(taus):.2f}-{max(taus):.2f} across these runs")
        spreads = []
        for method, label in labels:
            values = [c["speedup_vs_ar"] for when, c in speeds[method] if when.startswith("every round")]
            fewer = [(when, c["speedup_vs_ar"]) for when, c in speeds[method] if not when.startswith("every round")]
            if len(values) > 1 and fewer:
                where = ["inside" if min(values) <= v <= max(values) else "above" if v > max(values) else "below"
                         for _, v in fewer]
                spreads.append(f"{label}: every round {min(values):.2f}-{max(values):.2f}x; "
                               + ", ".join(f"{when} {w} that span" for (when, _), w in zip(fewer, where)))
        text += ((". Against the two runs selecting every round (they differ only in reading finished rows): "
                  + "; ".join(spreads)) if spreads else "") + "."
    return text


DUSTIN_SPEED_PAIR_TAU_PLOT = DUSTIN_SPEED_PAIR_TAU.replace(".json", ".png")


DUSTIN_METHODS = (("classic", "ClassicSD"), ("magicdec", "MagicDec"), ("dustin", "**Dustin**"))



def traced_rounds(traced: Dict[str, Any], case_key: str = "ctx32768/b16") -> Dict[str, Dict[str, Any]]:
    """Per method of a ``dustin-speed --trace`` file's case: its device plane, tok/s, speed-up, loop rounds
    (new tokens / tau; for AR a step), the timed run's ms per round, kernels launched per round, device-busy ms per
    round and busy time over the run's bytes floor (the run's bytes at the copy bandwidth measured in the same
    run)."""
    tokens = int(traced["config"]["new_tokens"])
    case, out = traced["cases"][case_key], {}
    for row in case["rows"]:
        plane = next(iter(case[row["method"]]["trace"]["planes"].values()))
        rounds = tokens / row["tau"]
        floor_s = tokens * row["batch"] / row["roofline_tok_s"]
        out[row["method"]] = {"plane": plane, "tok_s": row["tok_s"], "speedup": row["speedup"], "rounds": rounds,
                              "launches_per_round": plane["launches"] / rounds, "floor_s": floor_s,
                              "busy_ms_per_round": plane["busy_s"] * 1e3 / rounds,
                              "round_ms": 1e3 * tokens * row["batch"] / row["tok_s"] / rounds,
                              "over_floor": plane["busy_s"] / floor_s}
    return out


def _and(items) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def fused_trace_table() -> str:
    """The traced 32k/b16 round per projection layout (docs/methods.md §2, fused projections), one run each, per GPU
    where the baseline and at least one other run exist; otherwise which step measures what is missing."""
    lines = []
    for tag, runs in inputs.DUSTIN_TRACE_FUSED:
        present = [(label, f) for _, label, f in runs if (inputs.RESULTS / f).exists()]
        missing = [f for _, _, f in runs if not (inputs.RESULTS / f).exists()]
        if len(present) < 2 or present[0][1] != runs[0][2]:
            lines += ["", f"The round with fused projections on the {tag.upper()}: not measured yet (suite "
                          + ", ".join(f"`{suite_steps()[f][0]}` writes `{f}`" for f in missing) + ")."]
            continue
        data = [inputs.load(f) for _, f in present]
        rounds = [traced_rounds(d) for d in data]
        labels = dict(DUSTIN_SPEED_SPARSE_METHODS)
        runs_text = "; ".join(f"{label}: `{f}`, {d['environment'].get('time_utc', '?')[:10]}, commit "
                              f"{inputs.code_commit(d)}" for (label, f), d in zip(present, data))
        order = " → ".join(label for label, _ in present)
        lines += ["", f"The traced 32k/b16 round per layout on the {tag.upper()} ({runs_text}; {len(present)} runs, "
                      f"each method against the AR of its own run; each cell reads {order}):",
                  "", "| method | x AR | tok/s | launches per round | device-busy ms per round | device idle share "
                      "| busy / bytes floor |", "|---|---|---|---|---|---|---|"]
        for method in rounds[0]:
            if not all(method in r for r in rounds):
                continue
            per = [r[method] for r in rounds]

            def cell(fmt, get):
                return " → ".join(fmt.format(get(t)) for t in per)
            lines.append(f"| {labels.get(method, method)} | {cell('{:.2f}', lambda t: t['speedup'])} "
                         f"| {cell('{:.0f}', lambda t: t['tok_s'])} | {cell('{:.0f}', lambda t: t['launches_per_round'])} "
                         f"| {cell('{:.2f}', lambda t: t['busy_ms_per_round'])} "
                         f"| {cell('{:.0f} %', lambda t: 100 * (1 - t['plane']['busy_s'] / t['plane']['span_s']))} "
                         f"| {cell('{:.2f}', lambda t: t['over_floor'])} |")
        for (label, _), d, r in zip(present[1:], data[1:], rounds[1:]):
            if "command_buffer" not in (d["environment"].get("xla_flags") or ""):
                continue
            hidden = [labels.get(m, m) for m in r if m in rounds[0]
                      and r[m]["launches_per_round"] < 0.5 * rounds[0][m]["launches_per_round"]]
            kept = [labels.get(m, m) for m in r if m in rounds[0] and labels.get(m, m) not in hidden]
            lines += ["", f"In the {label} run XLA replays captured code as CUDA graphs, and the profiler sees a "
                          "replayed graph as one launch, not its kernels: "
                      + (f"{_and(hidden)} ran as graphs (launches per round fell to "
                         + ", ".join(f"{r[m]['launches_per_round']:.0f}" for m in r if labels.get(m, m) in hidden)
                         + f"), so {'its' if len(hidden) == 1 else 'their'} launch, busy and idle cells there count graphs, "
                         "not kernels; "
                         if hidden else "")
                      + (f"{_and(kept)} launched as many kernels as without graphs, so "
                         f"{'its' if len(kept) == 1 else 'their'} rounds were not captured; " if kept else "")
                      + "tok/s and x AR are timed outside the profiler and hold for every method."]
        if missing:
            lines += ["", "Not measured yet: " + ", ".join(f"`{f}` (suite `{suite_steps()[f][0]}`)" for f in missing)
                      + "."]
    return "\n".join(lines[1:])


def phase_split_table() -> str:
    """The traced 32k/b16 round split by phase on the device (the round's named scopes, attributed per kernel event;
    docs/gpu.md), per GPU and SRH choice where a phases trace exists; otherwise which step measures it. Per loop
    round, each phase's busy time, its share of the method's busy time, launches and busy time over its bytes floor;
    the selection's busy time over the timed run's round, with no host synchronisation between phases (unlike
    ``--profile``'s per-phase calls)."""
    lines, missing = [], []
    labels = dict(DUSTIN_SPEED_SPARSE_METHODS)
    for tag, _, heads, source in inputs.DUSTIN_TRACE_PHASES:
        if not (inputs.RESULTS / source).exists():
            missing.append(source)
            continue
        data = inputs.load(source)
        rounds = traced_rounds(data)
        split = {m: traced_phases(data, m) for m in rounds}
        if not any(split.values()):
            errors = sorted({str(r["plane"].get("phases_error", "no phases recorded")) for r in rounds.values()})
            lines += ["", f"The round by phase on the {tag.upper()}, {heads} (`{source}`): not split: "
                          f"{'; '.join(errors)}."]
            continue
        bandwidth = data["cases"]["copy_bandwidth"]["bandwidth_Bps"]  # for the header; phase_over_floor reads it too
        lines += ["", f"The traced 32k/b16 round by phase on the {tag.upper()}, {heads} (`{source}`, "
                      f"{data['environment'].get('time_utc', '?')[:10]}, commit {inputs.code_commit(data)}; one fused "
                      "jitted loop per method, each kernel placed in the innermost named scope of its op; per round "
                      "of the loop (every row's phases run in each; the loop runs until the last row is done, so more "
                      "rounds than new tokens / tau): device-busy ms, its share of the method's busy time, kernels and, "
                      "where the phase has "
                      f"a bytes floor, busy time over it at the copy bandwidth measured in the run, "
                      f"{bandwidth / 1e12:.2f} TB/s):", "",
                  "| method | " + " | ".join(inputs.ROUND_PHASES) + " | selection / the timed round |",
                  "|---|" + "---|" * (len(inputs.ROUND_PHASES) + 1)]
        for method, r in rounds.items():
            phases = split[method]
            if not phases:
                continue
            total = sum(p["busy_s"] for p in phases.values())
            floored = data["cases"]["ctx32768/b16"][method].get("phase_bytes", {})
            loop = phase_rounds(data, method)["rounds"]

            def cell(name):
                p = phases.get(name)
                if not p:
                    return "-"
                over = f", {phase_over_floor(data, method, name):.1f}x floor" if floored.get(name) else ""
                return (f"{p['busy_s'] * 1e3 / loop:.2f} ({100 * p['busy_s'] / total:.0f} %, "
                        f"{p['launches'] / loop:.0f}{over})")
            share = (f"{100 * phase_selection(data, method)['share_of_round']:.1f} %" if "selection" in phases
                     else "0 %")
            lines.append(f"| {labels.get(method, method)} | " + " | ".join(cell(n) for n in inputs.ROUND_PHASES)
                         + f" | {share} |")
        for method in rounds:
            top = (split[method] or {}).get("selection", {}).get("top_kernels", [])
            if top:
                loop = phase_rounds(data, method)["rounds"]
                lines += ["", f"The selection's largest kernels, {labels.get(method, method)} (µs per round, launches per "
                              "round): " + ", ".join(f"`{k['name']}` {k['total_s'] * 1e6 / loop:.0f} "
                                                     f"({k['count'] / loop:.0f})" for k in top[:6]) + "."]
                moved = (split[method] or {}).get("selection", {}).get("moved_from_unattributed")
                if moved:
                    lines[-1] += (" The trace left " + ", ".join(f"`{k}`" for k in moved["kernels"]) + " (the Pallas "
                                  f"SRH scoring, {moved['seconds'] * 1e6 / loop:.0f} µs per round) unattributed: "
                                  "inside an XLA command buffer a Pallas kernel carries neither an op nor a fusion's "
                                  "name, and it sits where the draft ends and the selection begins, so its neighbours "
                                  "disagree. Only the selection launches it, so it is counted there (the tracer now "
                                  "places a Pallas kernel by its custom call's name).")
        routes = {m: r["plane"].get("phases_attributed_by") for m, r in rounds.items() if r["plane"].get("phases")}
        if any(routes.values()):
            lines += ["", "Kernel events placed, by route (the `hlo_op` stat through the compiled text's op names; "
                          "else a `tf_op` scope path; else the kernel's name, which is its fusion's inside an XLA "
                          "command buffer; else the phase of its nearest placed neighbours on its stream where both "
                          "agree, as for a cuBLAS kernel inside a command buffer; `none`: left unattributed): "
                      + "; ".join(f"{labels.get(m, m)} " + ", ".join(f"{k} {v}" for k, v in sorted(rt.items()))
                                  for m, rt in routes.items() if rt) + "."]
    if missing:
        lines += ["", "The round by phase, not measured yet: " + ", ".join(
            f"`{f}` (suite `{suite_steps()[f][0]}`)" for f in missing) + "."]
    return "\n".join(lines[1:])


def dustin_speed_tables() -> str:
    lines = ["| context | batch | AR tok/s | ClassicSD | MagicDec | **Dustin** | roofline (Classic / MagicDec / Dustin) "
             "| attention per verification dense → sparse (28 layers) | selection / round |",
             "|---|---|---|---|---|---|---|---|---|"]
    split = ["| context | batch | ClassicSD draft / verify / other | MagicDec draft / verify / other "
             "| Dustin draft / selection / verification / other |", "|---|---|---|---|---|"]
    for batch, source in DUSTIN_SPEED.items():
        for key, case in inputs.load(source)["cases"].items():
            if key == "copy_bandwidth":
                continue
            rows = {r["method"]: r for r in case["rows"]}
            ar, d = rows["ar"], rows["dustin"]
            cells = " | ".join(f"{rows[m]['tok_s']:.0f} ({rows[m]['speedup']:.2f}x)" for m, _ in DUSTIN_METHODS)
            roof = " / ".join(f"{rows[m]['roofline_speedup']:.2f}" for m, _ in DUSTIN_METHODS)
            lines.append(f"| {ar['context'] // 1024}k | {batch} | {ar['tok_s']:.0f} | {cells} | {roof}x "
                         f"| {ar['attn_dense_ms']:.2f} → {ar['attn_sparse_ms']:.2f} ms ({ar['attn_speedup']:.1f}x) "
                         f"| {d['selection_ms']:.2f} ms ({100 * d['selection_ms'] / d['attn_dense_ms']:.0f} %) |")
            c, mg = rows["classic"], rows["magicdec"]
            split.append(f"| {ar['context'] // 1024}k | {batch} | {c['draft_ms']:.1f} / {c['verify_ms']:.1f} / "
                         f"{c['other_ms']:.1f} | {mg['draft_ms']:.1f} / {mg['verify_ms']:.1f} / {mg['other_ms']:.1f} "
                         f"| {d['draft_ms']:.1f} / {d['selection_ms']:.1f} / {d['verification_ms']:.1f} / "
                         f"{d['other_ms']:.1f} |")
    sp = ["| context | batch | method | tok/s | speed-up vs AR | tau it ran with (real pair, pair-speed case) "
          "| realised tau | bytes roofline | selection / round |", "|---|---|---|---|---|---|---|---|---|"]
    table_methods = (("ar", "AR"), ("classic", "ClassicSD"), ("magicdec", "MagicDec")) + DUSTIN_SPEED_SPARSE_METHODS[1:]
    sparse_cases = [(k, c, 16) for k, c in inputs.load(DUSTIN_SPEED_SPARSE)["cases"].items()]
    if (inputs.RESULTS / DUSTIN_SPEED_SPARSE_B8).exists():
        sparse_cases += [(k, c, 8) for k, c in inputs.load(DUSTIN_SPEED_SPARSE_B8)["cases"].items()]
    for key, case, batch in sparse_cases:
        if key == "copy_bandwidth" or "rows" not in case:
            continue
        for method, label in table_methods:
            r = next((r for r in case["rows"] if r["method"] == method), None)
            if r is None:
                continue
            bold = "**" if method.startswith("dustin-kv") else ""
            sp.append(f"| {r['context'] // 1024}k | {batch} | {label} | {r['tok_s']:.0f} | {bold}{r['speedup']:.2f}x{bold} "
                      f"| {'-' if method == 'ar' else '%.2f (%s)' % (r['fixed_tau'], r['tau_case'])} "
                      f"| {r['tau']:.2f} | {r['roofline_speedup']:.2f}x "
                      f"| {'-' if 'selection_ms' not in r else '%.2f ms' % r['selection_ms']} |")
    first = inputs.load(DUSTIN_SPEED_SPARSE_32K)
    first_note = ("The earlier, shorter run of the 32k point alone (`" + DUSTIN_SPEED_SPARSE_32K + "`, suite `"
                  + suite_steps()[DUSTIN_SPEED_SPARSE_32K][0] + "`) measured "
                  + ", ".join(f"{label} {read_path(first, dustin(32768, 16, m, 'speedup')):.2f}x"
                              for m, label in DUSTIN_SPEED_SPARSE_METHODS[1:]
                              if any(r["method"] == m for r in first["cases"]["ctx32768/b16"]["rows"]))
                  + "; the difference between the two runs is their run-to-run spread.")
    first_note += " " + finished_rows_speed_note()
    pt = ["| context | AR tok/s | ClassicSD | MagicDec | **Dustin-H** | roofline (Classic / MagicDec / Dustin-H) "
          "| selection / round |", "|---|---|---|---|---|---|---|"]
    for key, case in inputs.load(DUSTIN_SPEED_PAIR_TAU)["cases"].items():
        if key == "copy_bandwidth":
            continue
        rows = {r["method"]: r for r in case["rows"]}
        ar = rows["ar"]
        cells = " | ".join(f"{rows[m]['tok_s']:.0f} ({rows[m]['speedup']:.2f}x; tau {rows[m]['fixed_tau']:.2f}, "
                           f"{rows[m]['tau_case']})" for m in ("classic", "magicdec", "dustin"))
        roof = " / ".join(f"{rows[m]['roofline_speedup']:.2f}" for m in ("classic", "magicdec", "dustin"))
        pt.append(f"| {ar['context'] // 1024}k | {ar['tok_s']:.0f} | {cells} | {roof}x "
                  f"| {rows['dustin']['selection_ms']:.2f} ms |")
    trace = inputs.load(DUSTIN_TRACE)["cases"]["ctx32768/b16"]
    tr = ["| method | span ms | device busy ms (idle) | largest kernels (total over the run) |", "|---|---|---|---|"]
    for method in ("ar", "magicdec", "dustin"):
        plane = next(iter(trace[method]["trace"]["planes"].values()))
        top = ", ".join(f"`{k['name']}` {k['total_s'] * 1e3:.0f} ms" for k in plane["top_kernels"][:3])
        tr.append(f"| {method} | {plane['span_s'] * 1e3:.0f} | {plane['busy_s'] * 1e3:.0f} "
                  f"({100 * (1 - plane['busy_s'] / plane['span_s']):.0f} %) | {top} |")
    tr_sparse = []
    if (inputs.RESULTS / DUSTIN_TRACE_SPARSE).exists():
        traced = inputs.load(DUSTIN_TRACE_SPARSE)
        case = traced["cases"]["ctx32768/b16"]
        tokens = int(traced["config"]["new_tokens"])
        tr_sparse = ["| method | tok/s | rounds (64 / tau) | span ms | device busy ms (idle) | launches (per round) "
                     "| bytes floor ms (busy / floor) | largest kernels (total over the run) |",
                     "|---|---|---|---|---|---|---|---|"]
        labels, over, per_round = dict(DUSTIN_SPEED_SPARSE_METHODS), {}, {}
        for method, t in traced_rounds(traced).items():
            plane = t["plane"]
            top = ", ".join(f"`{k['name']}` {k['total_s'] * 1e3:.0f} ms" for k in plane["top_kernels"][:3])
            over[method], per_round[method] = t["over_floor"], t["launches_per_round"]
            tr_sparse.append(
                f"| {labels.get(method, method)} | {t['tok_s']:.0f} | {t['rounds']:.1f} | {plane['span_s'] * 1e3:.0f} "
                f"| {plane['busy_s'] * 1e3:.0f} ({100 * (1 - plane['busy_s'] / plane['span_s']):.0f} %) "
                f"| {plane['launches']} ({t['launches_per_round']:.0f}) | {t['floor_s'] * 1e3:.0f} "
                f"({t['over_floor']:.1f}x) | {top} |")
        tr_sparse = ["", f"The sparse draft KV traced the same way (`{DUSTIN_TRACE_SPARSE}`, suite "
                         f"`{suite_steps()[DUSTIN_TRACE_SPARSE][0]}`, {tokens} new tokens a row, each method at the "
                         "tau the real pair measured for it at 32k/b16; for AR a round is a step; the bytes floor "
                         "is the run's bytes at the copy bandwidth measured in the same run):", ""] + tr_sparse + [
            "", f"With the draft reading sinks + a window, the round is no longer bound by bytes: the device is "
                f"busy for {over['dustin-kv-streaming']:.1f} times the round's bytes floor and runs "
                f"{per_round['dustin-kv-streaming']:.0f} kernels a round, most of them small; the cuBLAS matrix "
                "products of the draft and the verification are now the largest kernels, not attention. Full-KV "
                f"Dustin-H is busy for {over['dustin']:.1f} times its (larger) floor."]
    e2e = ["| method | attention | tok/s | AR tok/s | speed-up | tau | acceptance | greedy output = AR | JSON |",
           "|---|---|---|---|---|---|---|---|---|"]
    for (method, backend), source in E2E.items():
        r = inputs.load(source)["results"]
        e2e.append(f"| {method} | {backend} | {r['tokens_per_s']:.0f} | {r['ar_tokens_per_s']:.0f} "
                   f"| {r['speedup_vs_ar']:.2f} | {r['metrics']['tau']:.2f} | {r['metrics']['acceptance_rate']:.2f} "
                   f"| {'yes' if r['identical_to_ar'] else 'no'} | `{source}` |")
    plot = f"![7B-shape speed-ups at the real pair's tau](../experiments/results/{DUSTIN_SPEED_PAIR_TAU_PLOT})"
    return "\n".join(lines + ["", "Batch 16 with each method's own tau as pair-speed measured it on the real pair "
                                  f"at the nearest context and batch 16 (`{DUSTIN_SPEED_PAIR_TAU}`, suite "
                                  f"`{suite_steps()[DUSTIN_SPEED_PAIR_TAU][0]}`; the same code and shapes as the "
                                  "table above, only the acceptance differs; for most of this run two other processes on the same host "
                                  "converted model weights to bfloat16, so its host-side times may carry some "
                                  "contention):", ""] + pt + ["", plot]
                     + ["", f"The sparse draft KV (docs/methods.md §5.1) beside the others, batch 16, all six "
                                  f"methods in one process (`{DUSTIN_SPEED_SPARSE}`, suite "
                                  f"`{suite_steps()[DUSTIN_SPEED_SPARSE][0]}`; each method at the tau pair-speed "
                                  "measured for it on the real pair at the nearest context, the sparse-draft "
                                  "variants from the real pair's sparse-draft runs at 16k and 32k; two weight "
                                  "conversions shared the host CPU during the first minutes of this run, while "
                                  "its 32k point compiled and ran), and at batch 8 "
                                  + (f"(`{DUSTIN_SPEED_SPARSE_B8}`, suite `{suite_steps()[DUSTIN_SPEED_SPARSE_B8][0]}`, "
                                     "the taus of the real pair's batch-8 runs; its 16k and 8k points were cut off by "
                                     "the end of the GPU time; a rerun of the step measures all three)"
                                     if (inputs.RESULTS / DUSTIN_SPEED_SPARSE_B8).exists() else "(not measured yet)")
                                  + ":", ""] + sp + ["", first_note]
                     + ["", "Per-round split (`--profile`: per-phase jitted calls with a host sync after each, "
                                  "so the sum exceeds a fused round), ms per round:", ""] + split
                     + ["", f"Where the time goes (`{DUSTIN_TRACE}`, 32k, batch 16, one more run of each method "
                            "under `jax.profiler`):", ""] + tr + tr_sparse + ["", fused_trace_table(), "", phase_split_table()]
                     + ["", "Real SmolLM2-135M end to end (7.6k-token prompt, batch 16, 256 new tokens, gamma 4, "
                            "AR in the same process before each method):", ""] + e2e)


def finished_rows_speed_note() -> str:
    """The 7B-shape batch-16 methods with finished rows reading one cache slot, against the sparse-draft run
    above (finished rows reading their whole history, an earlier commit): speed-ups and ms per loop round."""
    if not (inputs.RESULTS / DUSTIN_SPEED_FINISHED).exists():
        return ("The same methods with finished rows reading one cache slot (docs/methods.md §5.7): not measured "
                "yet (step `b16-finished-rows-pair-tau`).")
    new, old = inputs.load(DUSTIN_SPEED_FINISHED)["cases"], inputs.load(DUSTIN_SPEED_SPARSE)["cases"]
    labels = dict((("ar", "AR"), ("classic", "ClassicSD"), ("magicdec", "MagicDec")) + DUSTIN_SPEED_SPARSE_METHODS[1:])

    def per_round(case, method):
        record = case[method]
        return 1e3 * record["timing"]["median_s"] / record.get("metrics", {}).get("rounds", record.get("steps", 64))

    parts, change, ar_change, finished = [], {}, [], []
    for ctx in ("ctx32768/b16", "ctx16384/b16"):
        if ctx not in new:
            continue
        rows = {r["method"]: r for r in new[ctx]["rows"]}
        cells = []
        for method, label in labels.items():
            if method not in rows or method == "ar":
                continue
            cell = f"{label} {rows[method]['speedup']:.2f}x"
            if ctx in old and method in old[ctx]:
                now, before = per_round(new[ctx], method), per_round(old[ctx], method)
                change.setdefault("dustin" if method.startswith("dustin") else "other", []).append(now / before - 1)
                cell += f" ({now:.2f} ms a loop round, {before:.2f} before)"
            metrics = new[ctx][method].get("metrics", {})
            if metrics.get("rounds_per_row"):
                finished.append(1 - sum(metrics["rounds_per_row"]) / (len(metrics["rounds_per_row"]) * metrics["rounds"]))
            cells.append(cell)
        ar = f"AR {per_round(new[ctx], 'ar'):.2f} ms a step"
        if ctx in old:
            ar_change.append(per_round(new[ctx], "ar") / per_round(old[ctx], "ar") - 1)
            ar += f" ({per_round(old[ctx], 'ar'):.2f} before)"
        parts.append(f"{ctx[3:].split('/')[0]} tokens: {ar}; " + ", ".join(cells))

    def span(values):
        return f"{100 * min(values):+.0f} to {100 * max(values):+.0f} %"

    text = (f"The same methods with finished rows reading one cache slot (docs/methods.md §5.7; `{DUSTIN_SPEED_FINISHED}`,"
            f" suite `{suite_steps()[DUSTIN_SPEED_FINISHED][0]}`, the same taus, a later commit; \"before\" is the run "
            "above, whose finished rows read their whole history): " + "; ".join(parts) + ".")
    if change and ar_change:
        text += (f" Per loop round against the earlier run: ClassicSD and MagicDec {span(change.get('other', [0]))}, "
                 f"the Dustin-H variants {span(change.get('dustin', [0]))}, while AR's step moved "
                 f"{span(ar_change)} (it has no finished rows)")
        if finished:
            text += (f"; finished rows held {100 * min(finished):.0f}-{100 * max(finished):.0f} % of the row-rounds "
                     "(64 new tokens a row)")
        text += (". So skipping their reads bought no measurable time here, and the Dustin-H rounds got slower by "
                 "more than AR's change, which two runs of different commits cannot attribute (the commits between "
                 "them include the skip itself and the in-place cache writes of docs/methods.md §2).")
        text += _finished_rows_kept_note(new, per_round, labels, span)
    return text


def _finished_rows_kept_note(skipped, per_round, labels, span) -> str:
    """The skipped run against the same methods with --keep-finished-rows: per loop round, the skip plus the
    spread of two GPU runs (and whatever changed between their commits, both named)."""
    if not (inputs.RESULTS / DUSTIN_SPEED_FINISHED_KEPT).exists():
        return (" The same run with finished rows reading their whole history (--keep-finished-rows, step "
                "`b16-finished-rows-kept-pair-tau`) separates them: not measured yet.")
    kept = inputs.load(DUSTIN_SPEED_FINISHED_KEPT)["cases"]
    parts, change, ar_change = [], {}, []
    for ctx in ("ctx32768/b16", "ctx16384/b16"):
        if ctx not in kept or ctx not in skipped:
            continue
        speeds = {r["method"]: r["speedup"] for r in kept[ctx]["rows"]}
        cells = []
        for method, label in labels.items():
            if method == "ar" or method not in kept[ctx] or method not in skipped[ctx]:
                continue
            now, whole = per_round(skipped[ctx], method), per_round(kept[ctx], method)
            change.setdefault("dustin" if method.startswith("dustin") else "other", []).append(now / whole - 1)
            cells.append(f"{label} {speeds[method]:.2f}x AR ({whole:.2f} ms a loop round)" if method in speeds
                         else f"{label} {whole:.2f} ms a loop round")
        ar_change.append(per_round(skipped[ctx], "ar") / per_round(kept[ctx], "ar") - 1)
        parts.append(f"{ctx[3:].split('/')[0]} tokens: AR {per_round(kept[ctx], 'ar'):.2f} ms a step; "
                     + ", ".join(cells))
    if not parts:
        return ""
    commits = [inputs.load(f)["environment"].get("commit", "?")[:8] for f in (DUSTIN_SPEED_FINISHED, DUSTIN_SPEED_FINISHED_KEPT)]
    return (f" With finished rows reading their whole history (`{DUSTIN_SPEED_FINISHED_KEPT}`, --keep-finished-rows, "
            f"commit {commits[1]}; the skipped run: commit {commits[0]}"
            + (", the same commit" if commits[0] == commits[1] else
               ": what changed between them beyond the skip is for `git diff` to say")
            + "): " + "; ".join(parts)
            + ". The skipped run per loop round against it: ClassicSD and MagicDec "
            f"{span(change.get('other', [0]))}, the Dustin-H variants {span(change.get('dustin', [0]))}, and AR "
            f"(no finished rows: the spread of two runs) {span(ar_change)}.")
