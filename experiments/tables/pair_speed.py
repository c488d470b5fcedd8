"""The real Qwen2.5-Coder pair end to end (``pair_speed/*.json``): every method against AR, per context and batch.

Reading a file (:func:`pair_cases`, :func:`pair_missing`, :func:`pair_run_tag`), one case per round and
against the bytes floor (:func:`pair_case_table`, :func:`pair_split_table`), the section's blocks and notes
(:func:`pair_intro`, :func:`pair_speed_blocks`, :func:`pair_speed_notes`, :func:`sparse_draft_notes`) and the
1.5B as its own draft (:func:`h200_self_draft_note`, :func:`self_draft_levers`).
"""

from __future__ import annotations

import pathlib
import re
import shlex
import tomllib
from typing import Any, Dict, List, Optional, Sequence, Tuple

from experiments.tables import inputs
from experiments.tables.dustin_quality import quality_target_notes
from experiments.tables.inputs import (PAIR_METHODS, PAIR_SPEED, PAIR_SPEED_CHECK, PAIR_SPEED_F32, PAIR_SPEED_H100,
                                       PAIR_SPEED_PLOT, PAIR_SPEED_SELF, PAIR_SPEED_SELF_LEVERS, PAIR_SPEED_SHARED_GPU,
                                       PAIR_SPEED_SPARSE_DRAFT, PAIR_SPEED_SPARSE_DRAFT_16K,
                                       PAIR_SPEED_SPARSE_DRAFT_CMDBUF, PAIR_SPEED_SRH_1GROUP, PAIR_SPEED_SUITE,
                                       REAL_PAIR, SUITES, split_csv)


# ---------------------------------------------------------------------------- pair-speed (from the JSON)
def pair_cases(source: str) -> List[Tuple[str, Dict[str, Any]]]:
    """The measured ``(key, case)`` of a pair-speed file (not its copy bandwidth or backend check)."""
    return [(k, c) for k, c in inputs.load(source)["cases"].items() if k.startswith("ctx")]


def pair_ar_tok_s(key):
    def get(d):
        ar = d["cases"][key]["ar"]
        if "tok_s_mean" in ar:
            return ar["tok_s_mean"]
        return sum(r["tok_s"] for r in ar["runs"]) / len(ar["runs"])  # a partial case: the runs so far
    return get


def pair_run_tag(source: str) -> str:
    """What distinguishes a pair-speed file of a point measured more than once: its name without the
    models, contexts, batch and device (``..._0.5b_32k_b16_sparse-draft_h200.json`` -> ``sparse-draft``,
    ``..._1.5b_self-draft_8k-32k_b16_h200.json`` -> ``self-draft``)."""
    stem = pathlib.Path(source).stem
    parts = stem.split("_")[3:-1]  # after pair_speed_<target>, before the device
    return "-".join(p for p in parts if not re.fullmatch(r"0\.5b|\d+k(-\d+k)?|b\d+(-\d+)?", p)) or stem


def pair_methods(case: Dict[str, Any]) -> List[str]:
    return [m for m, _ in PAIR_METHODS if m in case]


def pair_missing(source: str) -> Tuple[List[str], Dict[str, List[str]]]:
    """Against the file's own config: the cases not measured, and per measured case the methods missing."""
    data = inputs.load(source)
    cfg = data["config"]
    wanted = [f"ctx{c}/b{b}" for c in split_csv(cfg["contexts"]) for b in split_csv(cfg["batches"])]
    methods = split_csv(cfg["methods"])
    missing = [k for k in wanted if k not in data["cases"]]
    partial = {k: [m for m in methods if m not in c] for k, c in pair_cases(source)
               if not c.get("complete", True) or any(m not in c for m in methods)}
    return missing, partial


def distinct_ngrams(tokens: Sequence[int], n: int = 8) -> Optional[float]:
    """Distinct n-grams / n-grams of a token list (1 = no n-gram repeats; low = a repeated loop)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def _backend(name: str) -> str:
    return {"pallas": "Pallas", "xla": "XLA"}.get(name, name)


def pair_label(method: str) -> str:
    return dict(PAIR_METHODS)[method]


def _round_ms(record: Dict[str, Any]) -> float:
    """A pair-speed method's decode time per loop round, ms."""
    return record["timings"]["decode_s"] / record["metrics"]["rounds"] * 1e3


def _ar_ms(case, new: int) -> float:
    runs = case["ar"]["runs"]
    return sum(r["decode_s"] for r in runs) / len(runs) / new * 1e3


def pair_case_table(source: str, key: str, case: Dict[str, Any]) -> str:
    """One (context, batch) case: AR and every method measured, per round and against the bytes floor."""
    data = inputs.load(source)
    new, batch = data["config"]["max_new_tokens"], case["batch"]
    bandwidth = data["cases"]["copy_bandwidth"]["bandwidth_Bps"]

    def rep(tokens):
        x = distinct_ngrams(tokens) if tokens else None
        return "-" if x is None else f"{x:.2f}"

    lines = ["| method | tok/s | speed-up vs paired AR (its tok/s) | tau | batch tokens / round (new / rounds) "
             "| loop rounds (mean per row) | ms / round | floor ms / round (share) | roofline speed-up "
             "| AR match rate | row 0: distinct 8-grams |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    ar = case["ar"]
    ar_ms = _ar_ms(case, new)
    if "step_bytes" in ar:
        floor = ar["step_bytes"]["total"] / bandwidth * 1e3
        ar_floor = f"{floor:.2f} ({100 * floor / ar_ms:.0f} %)"
    else:
        ar_floor = "- (partial case)"
    lines.append(f"| AR | {pair_ar_tok_s(key)(data):.0f} (mean of {len(ar['runs'])}) | 1 | 1 | 1 | {new} steps "
                 f"| {ar_ms:.2f} per step | {ar_floor} per step | 1 | 1 | {rep(ar.get('tokens_row0'))} |")
    for method, label in PAIR_METHODS:
        if method not in case:
            continue
        r = case[method]
        m = r["metrics"]
        rounds = m["rounds"]
        ms = _round_ms(r)
        floor = r["round_bytes"] / bandwidth * 1e3
        lines.append(f"| {label} | {r['tok_s']:.0f} | {r['speedup_vs_ar']:.2f}x ({r['paired_ar_tok_s']:.0f}) "
                     f"| {m['tau']:.2f} | {new / rounds:.2f} | {rounds} ({m['row_rounds'] / batch:.0f}) | {ms:.2f} "
                     f"| {floor:.2f} ({100 * floor / ms:.0f} %) | {r['roofline_speedup']:.2f}x "
                     f"| {r['agreement_with_ar']['match_rate']:.2f} | {rep(r.get('tokens_row0'))} |")
    return "\n".join(lines)


def _pair_suite_steps(name: str = PAIR_SPEED_SUITE) -> List[Tuple[str, str]]:
    """``(step name, source)`` of every step of a suite (default: the pair's) that writes under
    experiments/results/."""
    suite = tomllib.loads((SUITES / f"{name}.toml").read_text())
    out = []
    for step in suite["steps"]:
        argv = shlex.split(step["run"])
        if "--out" in argv:
            target = argv[argv.index("--out") + 1]
            out.append((step["name"], target[len("experiments/results/"):]))
    return out


def _step_of(source: str) -> str:
    """The step writing ``source``: in the pair's suite, or (an ``_h100`` file) in h100-long-context."""
    suite = "h100-long-context" if source.endswith("_h100.json") else PAIR_SPEED_SUITE
    return next(name for name, out in _pair_suite_steps(suite) if out == source)


def pair_speed_blocks() -> List[str]:
    blocks = []
    for source in PAIR_SPEED + PAIR_SPEED_H100:
        data = inputs.load(source)
        missing, partial = pair_missing(source)
        bandwidth = data["cases"]["copy_bandwidth"]["bandwidth_Bps"]
        for key, case in pair_cases(source):
            head = (f"{'On an H100 (suite h100-long-context), ' if source.endswith('_h100.json') else ''}"
                    f"{case['context'] // 1000}k context, batch {case['batch']}, {data['config']['dtype']} "
                    f"(`{source}`, step `{_step_of(source)}`; copy bandwidth {bandwidth / 1e12:.2f} TB/s)")
            if partial.get(key):
                done = [m for m, _ in PAIR_METHODS if m in case]
                head += (f" — **partial**: measured {', '.join(done)}; not yet {', '.join(partial[key])} (rerunning "
                         "the step resumes at the next method)")
            blocks.append(head + ":\n\n" + pair_case_table(source, key, case))
            split = pair_split_table(case)
            same_draft = [case[m]["round_split_ms"]["draft_ms"] for m in ("sd", "streaming", "quest")
                          if "round_split_ms" in case.get(m, {})]
            if split and len(same_draft) > 1 and max(same_draft) > 1.5 * min(same_draft):
                split += (f"\n\n**Not a reliable split**: ClassicSD, StreamingLLM and Quest run the same draft "
                          f"model, yet its draft time ranges {min(same_draft):.1f}-{max(same_draft):.1f} ms a round "
                          "here (compiles inside the profiled rounds, or the shared GPU); the trace columns come "
                          "from the fused loop and do not have this problem.")
            if split:
                blocks.append(f"Per-round split and profiler trace, {case['context'] // 1000}k, batch "
                              f"{case['batch']}: the split comes from a further run with one jitted call and one "
                              "host sync per phase (so it is slower than the fused loop, and the shares, not the "
                              "sums, are what it says); the trace is one run of the fused loop (kernels launched "
                              "per loop round, device-busy time over the span of its kernels and over host wall "
                              "time).\n\n" + split)
        if missing:
            blocks.append(f"`{source}` (step `{_step_of(source)}`): not measured yet: {', '.join(missing)}"
                          + (" — only its Pallas-vs-XLA logits check ran (below)." if not pair_cases(source)
                             and "backend_check" in data["cases"] else "."))
    shown = set(PAIR_SPEED + PAIR_SPEED_H100) | {PAIR_SPEED_F32, PAIR_SPEED_SRH_1GROUP[0]} | {source for _, _, source in REAL_PAIR}
    not_run = [name for name, out in _pair_suite_steps() if not (inputs.RESULTS / out).exists()]
    unshown = [name for name, out in _pair_suite_steps() if (inputs.RESULTS / out).exists() and out not in shown]
    if not_run or unshown:
        blocks.append(f"Steps of `{PAIR_SPEED_SUITE}`"
                      + (f" not run yet: {', '.join(f'`{n}`' for n in not_run)}" if not_run else "")
                      + (";" if not_run and unshown else "")
                      + (f" with a committed file not shown here yet: {', '.join(f'`{n}`' for n in unshown)}"
                         if unshown else "") + ".")
    blocks.append(f"![pair-speed speed-ups](../experiments/results/{PAIR_SPEED_PLOT})")
    f32 = inputs.load(PAIR_SPEED_F32)
    lines = ["| case | method | identical to AR | AR match rate | tau | tok/s (vs paired AR) |",
             "|---|---|---|---|---|---|"]
    for key, case in pair_cases(PAIR_SPEED_F32):
        for method, label in PAIR_METHODS:
            if method in case:
                r = case[method]
                lines.append(f"| {case['context'] // 1000}k, batch {case['batch']} | {label} "
                             f"| {'yes' if r['agreement_with_ar']['identical'] else '**no**'} "
                             f"| {r['agreement_with_ar']['match_rate']:.3f} | {r['metrics']['tau']:.2f} "
                             f"| {r['tok_s']:.0f} ({r['speedup_vs_ar']:.2f}x) |")
    cfg = f32["config"]
    blocks.append(f"Greedy identity in {cfg['dtype']} (`{PAIR_SPEED_F32}`, step `{_step_of(PAIR_SPEED_F32)}`: "
                  f"methods {cfg['methods']}, {cfg['max_new_tokens']} new tokens, {_backend(cfg['attention_backend'])} "
                  "attention): dense verification must reproduce AR token for token. Its bytes floor counts "
                  "bfloat16 K/V, so no floor or roofline is shown for it.\n\n" + "\n".join(lines))
    check = inputs.load(PAIR_SPEED_CHECK)["cases"]["backend_check"]
    blocks.append(f"Attention backend check (`{PAIR_SPEED_CHECK}`, step `{_step_of(PAIR_SPEED_CHECK)}`): the "
                  f"target's logits over the first {check['tokens']} tokens of row 0 with {_backend(check['backend'])} "
                  f"attention against XLA's differ by at most {check['max_abs_logit_diff']:.3f} (the largest "
                  f"|logit| is {check['logit_scale']:.1f}: "
                  f"{100 * check['max_abs_logit_diff'] / check['logit_scale']:.2f} %); argmax equal at every "
                  f"position: {'yes' if check['argmax_equal'] else '**no**'}.")
    earlier = ["| method | tok/s | AR tok/s (same process) | speed-up | tau | identical to AR | JSON |",
               "|---|---|---|---|---|---|---|"]
    for _, label, source in REAL_PAIR:
        r = inputs.load(source)["results"]
        earlier.append(f"| {label} | {r['tokens_per_s']:.0f} | {r['ar_tokens_per_s']:.0f} | {r['speedup_vs_ar']:.2f}x "
                       f"| {r['metrics']['tau']:.2f} | {'yes' if r['identical_to_ar'] else 'no'} | `{source}` |")
    blocks.append("Earlier per-process runs (`generate`, one process per method, each against AR in the same "
                  "process): an 8k-token excerpt of *Emma*, batch 1, 256 new tokens, greedy, gamma 4, bfloat16, "
                  "**XLA attention** (Pallas then failed in the prefill of a long prompt; it now runs, above). The "
                  "greedy continuation of raw novel text soon repeats itself, which raises tau: these are an upper "
                  "end for this pair. All three differ from AR in bf16, the dense ClassicSD included.\n\n"
                  + "\n".join(earlier))
    return blocks


def pair_split_table(case: Dict[str, Any]) -> str:
    """The per-round split (``round_split_ms``) and trace summary of each method of a case that has them."""
    lines = ["| method | draft ms | selection ms | verification ms | other ms | draft share | kernels / round "
             "| busy / span | busy / wall |", "|---|---|---|---|---|---|---|---|---|"]
    rows = 0
    for method, label in [("ar", "AR (per step)")] + list(PAIR_METHODS):
        r = case.get(method) or {}
        split, trace = r.get("round_split_ms"), r.get("trace") or {}
        if not split and "launches" not in trace:
            continue
        rows += 1
        cells = ["–"] * 5
        if split:
            verification = split.get("verification_ms", split["verify_ms"])
            total = split["draft_ms"] + split["verify_ms"] + split["other_ms"]
            cells = [f"{split['draft_ms']:.1f}", f"{split['selection_ms']:.2f}" if "selection_ms" in split else "–",
                     f"{verification:.1f}", f"{split['other_ms']:.1f}", f"{100 * split['draft_ms'] / total:.0f} %"]
        launches = trace.get("launches_per_round")
        cells += [f"{launches:.0f}" if launches else "–",
                  f"{100 * trace['busy_share']:.0f} %" if trace.get("busy_share") else "–",
                  f"{100 * trace['busy_share_of_wall']:.0f} %" if trace.get("busy_share_of_wall") else "–"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if rows else ""


def _case(context: int, batch: int) -> Optional[Tuple[str, Dict[str, Any]]]:
    for source in PAIR_SPEED:
        for key, case in pair_cases(source):
            if (case["context"], case["batch"]) == (context, batch):
                return source, case
    return None


def sparse_draft_notes(main) -> List[str]:
    """The sparse-draft target on the real pair (Dustin-H whose draft reads a budget of its cache, 32k/b16)."""
    if not (inputs.RESULTS / PAIR_SPEED_SPARSE_DRAFT).exists():
        return ["Dustin + sparse draft >= 2.0x AR end to end on the real pair at 32k, batch 16: not measured yet "
                f"(step `{_step_of(PAIR_SPEED_SPARSE_DRAFT)}`)."]
    c = dict(pair_cases(PAIR_SPEED_SPARSE_DRAFT))["ctx32000/b16"]
    variants = [m for m in ("dustin-kv-streaming", "dustin-kv-verify-set") if m in c]

    def ms(m):
        return _round_ms(c[m])

    best = max(variants, key=lambda m: c[m]["speedup_vs_ar"])
    met = c[best]["speedup_vs_ar"] >= 2.0
    parts = [f"{pair_label(m).strip('*')} {c[m]['speedup_vs_ar']:.2f}x AR (tau {c[m]['metrics']['tau']:.2f}, "
             f"acceptance {c[m]['metrics']['acceptance_rate']:.2f}, {ms(m):.1f} ms a loop round)" for m in variants]
    text = (f"Dustin + sparse draft >= 2.0x AR end to end on the real pair at 32k, batch 16: **{'met' if met else 'missed'}** "
            f"(`{PAIR_SPEED_SPARSE_DRAFT}`, one prefill, each method against AR decoded just before it) — "
            + "; ".join(parts) + ". ")
    if "dustin" in c:
        d = c["dustin"]
        text += (f"Full-KV Dustin-H in the same run: {d['speedup_vs_ar']:.2f}x (tau {d['metrics']['tau']:.2f}, "
                 f"acceptance {d['metrics']['acceptance_rate']:.2f}, {ms('dustin'):.1f} ms a loop round), so the "
                 f"sparse draft KV keeps most of the acceptance and takes {100 * (1 - ms(best) / ms('dustin')):.0f} % "
                 "off a round: at least that share of a full-KV round was the 0.5B draft reading its 32k-position "
                 "cache.")
        if main and "dustin" in main[1]:
            o = main[1]["dustin"]
            o_ms = _round_ms(o)
            text += (f" The same full-KV Dustin-H measured {o['speedup_vs_ar']:.2f}x in the five-method run "
                     f"(`{main[0]}`): {o_ms:.1f} ms a loop round there too, but {o['metrics']['rounds']} loop "
                     f"rounds against {d['metrics']['rounds']} here (tau {o['metrics']['tau']:.2f} vs "
                     f"{d['metrics']['tau']:.2f}): the batched loop runs until its slowest row is done, and "
                     f"{sum(x != y for x, y in zip(o['metrics']['rounds_per_row'], d['metrics']['rounds_per_row']))}"
                     " of the 16 rows took a different number of rounds in the two processes (bf16 decoding on the "
                     "GPU is not bit-reproducible across processes), which moved the slowest row from "
                     f"{max(o['metrics']['rounds_per_row'])} to {max(d['metrics']['rounds_per_row'])} rounds; a "
                     "batch-16 speed-up from one run carries a spread of that size.")
    return [text] + sparse_draft_16k_notes(c)


def sparse_draft_16k_notes(c32) -> List[str]:
    """The same three Dustin-H variants at 16k/b16 on the real pair, and why the ratio drops there: a sparse-draft
    round costs about what it costs at 32k while AR's step gets cheaper (computed from both files)."""
    if not (inputs.RESULTS / PAIR_SPEED_SPARSE_DRAFT_16K).exists():
        return [f"The sparse-draft variants at 16k, batch 16 on the real pair: not measured yet (step "
                f"`{_step_of(PAIR_SPEED_SPARSE_DRAFT_16K)}`)."]
    data = inputs.load(PAIR_SPEED_SPARSE_DRAFT_16K)
    c = data["cases"]["ctx16000/b16"]
    variants = [m for m in ("dustin-kv-streaming", "dustin-kv-verify-set", "dustin") if m in c]
    best = max((m for m in variants if m != "dustin"), key=lambda m: c[m]["speedup_vs_ar"])
    bandwidth = data["cases"]["copy_bandwidth"]["bandwidth_Bps"]

    def ar_ms(case):
        return 1e3 * case["batch"] / case["ar"]["tok_s_mean"]

    parts = [f"{pair_label(m).strip('*')} {c[m]['speedup_vs_ar']:.2f}x AR (tau {c[m]['metrics']['tau']:.2f}, "
             f"{_round_ms(c[m]):.1f} ms a loop round)" for m in variants]
    text = (f"The same variants at 16k, batch 16 on the real pair (`{PAIR_SPEED_SPARSE_DRAFT_16K}`): "
            + "; ".join(parts) + ". ")
    if best in c32:
        text += (f"A sparse-draft round costs about the same at 16k as at 32k ({_round_ms(c[best]):.1f} vs "
                 f"{_round_ms(c32[best]):.1f} ms) while AR's step drops from {ar_ms(c32):.2f} to {ar_ms(c):.2f} ms, "
                 f"so the ratio falls with the context. The round's bytes floor is "
                 f"{1e3 * c[best]['round_bytes'] / bandwidth:.1f} ms ({c[best]['round_bytes'] / 1e9:.1f} GB at the "
                 f"{bandwidth / 1e12:.2f} TB/s copy bandwidth of the same run): {_round_ms(c[best]) / (1e3 * c[best]['round_bytes'] / bandwidth):.1f}x "
                 "over it (where the rest of the round goes is not traced yet for the sparse-draft variants).")
    return [text]


def pair_speed_notes() -> List[str]:
    """The targets and the notes of the pair-speed section, computed from the JSON."""
    cases = sorted(((s, k, c) for s in PAIR_SPEED for k, c in pair_cases(s)),
                   key=lambda t: (-t[2]["context"], -t[2]["batch"]))

    def name(m):
        return pair_label(m).strip("*")

    source_of = {id(c): s for s, _, c in cases}
    points = [(c["context"], c["batch"]) for _, _, c in cases]

    def where(c):
        text = f"{c['context'] // 1000}k/b{c['batch']}"
        tag = pair_run_tag(source_of.get(id(c), ""))
        if points.count((c["context"], c["batch"])) > 1 and tag != pathlib.Path(source_of.get(id(c), "")).stem:
            text += f" ({tag} run)"
        return text

    out = []
    shared = [(k, c) for s, k, c in cases if pathlib.Path(s).name in PAIR_SPEED_SHARED_GPU]
    if shared:
        spreads = "; ".join(f"{where(c)} {min(r['tok_s'] for r in c['ar']['runs']):.0f}-"
                            f"{max(r['tok_s'] for r in c['ar']['runs']):.0f}" for _, c in shared
                            if c.get("ar", {}).get("runs"))
        out.append("**Measured on a shared GPU.** " + ", ".join(where(c) for _, c in shared) + " ran while a second "
                   "pair-speed process decoded on the same H200 for part of the time (a suite runner stopped by a "
                   "time limit left its step running; `suite` now kills the step of a stopped runner). tau, "
                   "acceptance and the match rates do not depend on it; tokens/s and speed-ups are provisional "
                   "until these steps are re-run alone. The paired AR runs (tokens/s, lowest-highest) were " + spreads
                   + ". The float32 identity check and the logits check ran alone.")
    main = _case(32000, 16)
    if main and all(m in main[1] for m in ("sd", "magicdec", "dustin")):
        c = main[1]
        met = c["dustin"]["speedup_vs_ar"] > max(c["sd"]["speedup_vs_ar"], c["magicdec"]["speedup_vs_ar"])
        caveat = " (provisional: shared GPU)" if any(c is cc for _, cc in shared) else ""
        text = (f"At 32k, batch 16, Dustin-H faster than ClassicSD and MagicDec on real weights: "
                f"**{'met' if met else 'missed'}**{caveat} — Dustin-H {c['dustin']['speedup_vs_ar']:.2f}x AR "
                f"({c['dustin']['tok_s']:.0f} tokens/s), ClassicSD {c['sd']['speedup_vs_ar']:.2f}x, MagicDec "
                f"{c['magicdec']['speedup_vs_ar']:.2f}x.")
        fastest = max(pair_methods(c), key=lambda m: c[m]["speedup_vs_ar"])
        if fastest != "dustin":
            def ms(m):
                return _round_ms(c[m])

            text += (f" The fastest method there is {name(fastest)} ({c[fastest]['speedup_vs_ar']:.2f}x, "
                     f"tau {c[fastest]['metrics']['tau']:.2f} against Dustin-H's {c['dustin']['metrics']['tau']:.2f}, "
                     f"{ms(fastest):.2f} ms a round against Dustin-H's {ms('dustin'):.2f}).")
        others = [f"{where(c)}: Dustin-H {c['dustin']['speedup_vs_ar']:.2f}x, "
                  f"ClassicSD {c['sd']['speedup_vs_ar']:.2f}x, MagicDec {c['magicdec']['speedup_vs_ar']:.2f}x"
                  for _, _, c in cases
                  if c is not main[1] and all(m in c for m in ("sd", "magicdec", "dustin"))]
        if others:
            text += " Elsewhere: " + "; ".join(others) + "."
        out.append(text)
    else:
        out.append("At 32k, batch 16, Dustin-H faster than ClassicSD and MagicDec on real weights: not measured yet.")
    out.extend(sparse_draft_notes(main))
    out.extend(quality_target_notes())
    dense = [(c, m) for _, _, c in cases for m in ("sd", "magicdec") if m in c]
    if dense:
        f32 = [(c, m) for _, c in pair_cases(PAIR_SPEED_F32) for m in ("sd", "magicdec") if m in c]
        exact = all(c[m]["agreement_with_ar"]["identical"] for c, m in f32)
        out.append("bfloat16: ClassicSD and MagicDec verify densely, yet their AR match rate is "
                   + "; ".join(f"{name(m)} {c[m]['agreement_with_ar']['match_rate']:.2f} at {where(c)} "
                               f"({sum(x is None for x in c[m]['agreement_with_ar']['first_divergence'])} of "
                               f"{c['batch']} rows identical)" for c, m in dense)
                   + ": in bfloat16 a row's 5-row verification and AR's 1-row step round differently, a near-tie "
                   "flips and the row goes on along other text. In float32 "
                   + ("both are identical to AR token for token (the table above)." if exact and f32 else
                      "they are **not** all identical to AR (the table above)."))
    rep = []
    for _, _, c in cases:
        ar = distinct_ngrams(c["ar"].get("tokens_row0") or [])
        parts = ([f"AR {ar:.2f}"] if ar is not None else []) + [
            f"{name(m)} {distinct_ngrams(c[m]['tokens_row0']):.2f}" for m in pair_methods(c) if c[m].get("tokens_row0")]
        rep.append(f"{where(c)}: " + ", ".join(parts))
    sparse = [m for m, _ in PAIR_METHODS if m not in ("sd", "magicdec")]
    firsts = [x for _, _, c in cases for m in sparse if m in c for x in c[m]["agreement_with_ar"]["first_divergence"]
              if x is not None]
    out.append("The sparse-verification methods (Dustin-H, StreamingLLM, Quest) decode their own continuation: their "
               f"rows leave AR's tokens within the first {max(firsts) + 1 if firsts else '-'} positions (AR match "
               "rate " + ", ".join(f"{name(m)} {c[m]['agreement_with_ar']['match_rate']:.2f}" for _, _, c in cases[:1]
                                   for m in sparse if m in c)
               + f" at {where(cases[0][2]) if cases else '-'}), so their tau is over different text. Repetition of "
               "row 0 (distinct 8-grams / 8-grams of its tokens; 1 = no 8-gram repeats): " + "; ".join(rep)
               + "; the most repetitive row 0: "
               + "; ".join(f"{name(min(pair_methods(c), key=lambda m: distinct_ngrams(c[m]['tokens_row0'])))} at "
                           f"{where(c)}" for _, _, c in cases if pair_methods(c))
               + ". A continuation that falls into a loop is easy to draft and raises tau.")
    slow = []
    for s, _, c in cases:
        if "sd" not in c:
            continue
        r, new = c["sd"], inputs.load(s)["config"]["max_new_tokens"]
        ar_ms = _ar_ms(c, new)
        ms = _round_ms(r)
        slow.append(f"at {where(c)} ClassicSD ran {r['metrics']['rounds']} rounds where its mean row needed "
                    f"{r['metrics']['row_rounds'] / c['batch']:.0f} ({new} / tau = {new / r['metrics']['tau']:.1f}); "
                    f"a round costs {ms / ar_ms:.1f} AR steps and commits {new / r['metrics']['rounds']:.2f} tokens "
                    f"per row, {(new / r['metrics']['rounds']) / (ms / ar_ms):.2f}x AR (measured "
                    f"{r['speedup_vs_ar']:.2f}x); at tau tokens per round it would be "
                    f"{r['metrics']['tau'] / (ms / ar_ms):.2f}x"
                    + (f"; MagicDec {c['magicdec']['metrics']['rounds']} rounds against a mean row's "
                       f"{c['magicdec']['metrics']['row_rounds'] / c['batch']:.0f}" if "magicdec" in c else ""))
    if slow:
        out.append("The batched loop runs until its slowest row has all its tokens (the roofline counts tau per "
                   "round, as if every row finished together): " + "; ".join(slow)
                   + ". That is part of why ClassicSD is below AR at batch 16.")
    draft_notes = []
    for s, _, c in cases:
        cfg = inputs.load(s)["models"]["draft"]["config"]
        item = {"bfloat16": 2, "float16": 2, "float32": 4}[cfg["dtype"]]
        gamma = inputs.load(s)["config"]["gamma"]
        kv = gamma * 2 * cfg["num_layers"] * c["batch"] * cfg["num_kv_heads"] * c["context"] * cfg["head_dim"] * item
        shares = ", ".join(f"{100 * kv / c[m]['round_bytes']:.0f} % of {name(m)}'s" for m in pair_methods(c)
                           if m != "magicdec")
        draft_notes.append(f"{kv / 1e9:.1f} GB at {where(c)} ({shares} round bytes)")
    if draft_notes:
        out.append("The draft reads its whole cache every draft step (all but MagicDec, whose draft reads 4 sinks + "
                   "the recent window): gamma x the 0.5B's K/V per round is " + "; ".join(draft_notes) + ".")
    spread = []
    for _, _, c in cases:
        runs = [r["tok_s"] for r in c["ar"]["runs"]]
        low = min(c["ar"]["runs"], key=lambda r: r["tok_s"])
        spread.append(f"{min(runs):.0f}-{max(runs):.0f} tokens/s at {where(c)} (slowest: before {name(low['before'])})")
    if spread:
        out.append("AR paired with each method moves between runs of one case: " + "; ".join(spread)
                   + ", so a method's speed-up carries that much noise.")
    return out


def h200_self_draft_note() -> str:
    """The real 1.5B drafting for itself over sinks + a window on the H200 (h200-qwen-pair self-drafts-b16)."""
    source = PAIR_SPEED_SELF[0]
    if not (inputs.RESULTS / source).exists():
        return ("The real 1.5B drafting for itself on the H200: not measured yet (h200-qwen-pair steps "
                "self-drafts-b16, self-drafts-b1).")
    def points_of(src):
        cases = {k: c for k, c in inputs.load(src)["cases"].items() if k != "copy_bandwidth"}
        points = []
        for key, case in cases.items():
            cells = ", ".join(f"{m} {case[m]['speedup_vs_ar']:.2f}x (tau {case[m]['metrics']['tau']:.2f})"
                              for m in ("dustin-self", "magicdec-self") if m in case)
            points.append(f"{key.split('/')[0][3:]} tokens: {cells}")
        return cases, points

    cases, points = points_of(source)
    best = max((case[m]["speedup_vs_ar"], m) for case in [cases.get("ctx32000/b16", {})] for m in case
               if m in ("dustin-self", "magicdec-self"))
    levers = self_draft_levers()
    if levers["best"] is not None and levers["best"][0] > best[0]:
        best = levers["best"]
    b1 = "Batch 1 (step self-drafts-b1) is not measured yet. "
    if (inputs.RESULTS / PAIR_SPEED_SELF[1]).exists():
        b1_cases, b1_points = points_of(PAIR_SPEED_SELF[1])
        taus = {k.split("/")[0][3:]: c["magicdec-self"]["metrics"]["tau"] for k, c in b1_cases.items()
                if "magicdec-self" in c}
        b1 = (f"At batch 1 (`{PAIR_SPEED_SELF[1]}`, step `self-drafts-b1`): " + "; ".join(b1_points)
              + ". There one read of the 1.5B's weights dominates every step, cache or not, so a window-only draft "
              "saves little; MagicDec's self-draft accepted " + ", ".join(f"{t:.2f} at {c} tokens" for c, t in
                                                                        taus.items()) + " tokens a round. ")
    straggle = []  # the batch loop runs until its slowest row is done
    for key, case in cases.items():
        met = (case.get("dustin-self") or {}).get("metrics") or {}
        if met.get("rounds") and met.get("row_rounds"):
            batch = int(key.split("/b")[1])
            straggle.append(f"{key.split('/')[0][3:]} tokens {met['rounds']} against {met['row_rounds'] / batch:.0f}")
    if straggle:
        b1 += ("At batch 16 the loop runs until its slowest row is done, so Dustin-H's self-draft ran more loop "
               "rounds than its rows' mean (" + ", ".join(straggle) + "): the rows that finish early wait. ")
    return ("On the H200, the real Qwen2.5-Coder-1.5B drafting for itself over 4 sinks + a window of its own cache "
            f"(bf16, batch 16, 256 new tokens, `{source}`, step `self-drafts-b16`): " + "; ".join(points)
            + f". The best self-speculative method at 32k/b16 >= 2.0x AR: **{'met' if best[0] >= 2.0 else 'missed'}** "
            f"({best[1]} {best[0]:.2f}x{', one run' if best[0] >= 2.0 else ''}). " + levers["text"] + "A self-draft step still reads all of the 1.5B's weights, so only at 32k, "
            "where its KV reads dominate AR's step, does the window-only draft pay; MagicDec's dense verification "
            "then reads the whole cache once a round. " + b1 + "KnapSpec and CLaSp on the real 1.5B are in the "
            "KnapSpec section.")


def self_draft_levers() -> Dict[str, Any]:
    """Dustin-H's self-draft at 32k/b16 measured again (PAIR_SPEED_SELF_LEVERS): the split, gamma 6 and 8 and the
    command buffers; ``{"best": (speed-up, label) of the runs without command buffers or None, "text": ...}``."""
    runs = []
    for source in PAIR_SPEED_SELF_LEVERS + (PAIR_SPEED_SPARSE_DRAFT_CMDBUF,):
        if (inputs.RESULTS / source).exists():
            data = inputs.load(source)
            runs.append((source, int(data["config"].get("gamma", 4)), dict(pair_cases(source))))
    if not runs:
        return {"best": None, "text": ""}

    def cell(case, method="dustin-self"):
        r = case[method]
        met = r["metrics"]
        return (f"{r['speedup_vs_ar']:.2f}x (tau {met['tau']:.2f}, {100 * met['acceptance_rate']:.0f} % of drafted "
                f"tokens accepted, {met['rounds']} loop rounds against the rows' mean {met['row_rounds'] / case['batch']:.1f}, "
                f"{1e3 * r['timings']['decode_s'] / met['rounds']:.1f} ms a round)")

    def round_ms(r):
        return 1e3 * r["timings"]["decode_s"] / r["metrics"]["rounds"]

    def without(key, method, gamma):
        """The same point measured without command buffers: the first such run in PAIR_SPEED."""
        for src in PAIR_SPEED:
            if "cmdbuf" in pair_run_tag(src) or int(inputs.load(src)["config"].get("gamma", 4)) != gamma:
                continue
            c = dict(pair_cases(src)).get(key)
            if c and method in c:
                return c[method]
        return None

    best, by_gamma, cmdbuf, ratios, split = None, [], [], [], ""
    for source, gamma, cases in runs:
        tag = pair_run_tag(source)
        if "cmdbuf" in tag:
            for key, c in cases.items():
                for method in ("dustin-self", "dustin-kv-streaming", "dustin"):
                    if method not in c:
                        continue
                    r, base = c[method], without(key, method, gamma)
                    line = (f"{method} at {c['context'] // 1000}k, gamma {gamma}: {round_ms(r):.2f} ms a round, "
                            f"{r['metrics']['rounds']} rounds, {r['speedup_vs_ar']:.2f}x")
                    if base:
                        ratios.append(round_ms(base) / round_ms(r))
                        line += (f" (without them {round_ms(base):.2f} ms, {base['metrics']['rounds']} rounds, "
                                 f"{base['speedup_vs_ar']:.2f}x)")
                    cmdbuf.append(line)
            continue
        case = cases.get("ctx32000/b16")
        if case is None or "dustin-self" not in case:
            continue
        if best is None or case["dustin-self"]["speedup_vs_ar"] > best[0]:
            best = (case["dustin-self"]["speedup_vs_ar"], f"dustin-self at gamma {gamma}")
        by_gamma.append(f"gamma {gamma}: {cell(case)}")
        sp = case["dustin-self"].get("round_split_ms")
        if sp and gamma == 4 and not split:
            total = sp["draft_ms"] + sp["verify_ms"] + sp["other_ms"]
            split = (f"The per-round split at gamma 4 (`{source}`; one call and one host sync per phase, so "
                     f"{total:.1f} ms against the fused loop's round; the shares are what it says): the draft's "
                     f"{gamma} steps {100 * sp['draft_ms'] / total:.0f} %, selection "
                     f"{100 * sp['selection_ms'] / total:.0f} %, verification "
                     f"{100 * sp['verification_ms'] / total:.0f} %, the rest {100 * sp['other_ms'] / total:.0f} %. ")
    text = ""
    if by_gamma:
        text += ("Dustin-H's self-draft at 32k/b16 measured again with longer drafts (steps self-draft-32k-b16-split, "
                 "-gamma6, -gamma8): " + "; ".join(by_gamma) + ". Longer drafts pay until acceptance falls and the "
                 "slowest row sets the loop's length. " + split)
    if cmdbuf:
        faster = 100 * (max(ratios) - 1) if ratios else 0.0
        text += ("With the whole-loop command buffers (CUDA graphs; steps self-drafts-b16-cmdbuf, "
                 "self-draft-32k-b16-gamma6-cmdbuf, b16-sparse-draft-cmdbuf): " + "; ".join(cmdbuf) + ". "
                 + (f"No round ran more than {max(faster, 0):.0f} % faster with them, so they do not remove a round's "
                    "excess over its bytes floor (no trace checked which launches XLA captured). " if faster <= 3 else
                    f"The best round ran {faster:.0f} % faster with them. ")
                 + "Where the speed-ups differ, the loop ran a different number of rounds: at batch 16 the slowest "
                 "row sets the loop's length, and which row straggles moves from run to run (bf16, sparse "
                 "selection), so a batch-16 speed-up varies by that much between runs of the same point. ")
    return {"best": best, "text": text}


def pair_intro() -> str:
    cfg = inputs.load(PAIR_SPEED[0])["config"]
    return (f"`pair-speed`: {cfg['model']} (target) and {cfg['draft']} (draft), real weights staged onto one H200, "
            f"{cfg['dtype']}, {_backend(cfg['attention_backend'])} attention in both, a real prefill of real long text "
            f"(`{cfg['text_file']}`, no chat template; row b of a batch starts {cfg['row_stride']} tokens after "
            f"row b - 1), {cfg['max_new_tokens']} new tokens, greedy, gamma {cfg['gamma']}, real acceptance, "
            f"k = {cfg['budget']} for the sparse methods (Dustin-H with the pair's profile). Every method decodes "
            "from a copy of one shared prefill and is paired with AR decoded just before it in the same process. "
            "tau = mean tokens committed per row and round; the batched loop runs until its slowest row has all "
            "its tokens, so each row gets new tokens / rounds per loop round (the batch tokens per round), below "
            "tau. ms / round = decode time / loop rounds; the floor = the fewest bytes a round (AR: a step) must "
            "read over the copy bandwidth measured in the same process, its share = floor / measured; the "
            "roofline speed-up = that floor at tau tokens per round against AR's floor. AR match rate = the "
            "share of tokens equal to AR's at the same position.")
