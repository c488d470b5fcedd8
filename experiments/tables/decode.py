"""AR decoding and the building blocks under speculation.

``bench_decode/`` (AR against the bandwidth floor, :func:`decode_table`; separate against fused projections,
:func:`projections_table`), ``parity/`` (:func:`parity_table`),
``bench_skip/`` (the skip mask's cost, :func:`skip_table`), ``bench_plain/`` (the engine's plain stretch against
the AR loop, :func:`plain_table`), ``bench_sd/`` and the self-draft ``generate/`` runs (ClassicSD,
:func:`speculative_tables`) and the committed demo runs (prompt lookup, :func:`demo_note`).
"""

from __future__ import annotations

from experiments.tables import inputs
from experiments.tables.inputs import (BENCH_SD, BENCH_SD_SPLIT, DECODE, GENERATE_AR, GREEDY_IDENTITY, PARITY,
                                       PLAIN_VARIANTS, SELF_DRAFT, SELF_DRAFT_SWEEP, SKIP, SKIP_CMDBUF, device_of)


# ---------------------------------------------------------------------------- tables
def decode_table() -> str:
    decode, generate = inputs.load(DECODE), inputs.load(GENERATE_AR)
    bandwidth = decode["cases"]["copy_bandwidth"]["bandwidth_Bps"]
    lines = ["| model | context | batch | ms / step | tokens/s | bytes / step (weights + KV) | floor ms "
             "| fraction of floor |", "|---|---|---|---|---|---|---|---|"]
    res = generate["results"]
    cfg = res["model_config"]
    steps = max(res["num_generated"])
    per_step = res["timings"]["decode_s"] / steps
    batch = len(res["tokens"])
    context = sum(res["prompt_tokens"]) / batch + steps / 2
    weights = 2 * (cfg["vocab_size"] * cfg["hidden_size"] + cfg["num_layers"] * (
        cfg["hidden_size"] * cfg["head_dim"] * (cfg["num_heads"] * 2 + cfg["num_kv_heads"] * 2)
        + 3 * cfg["hidden_size"] * cfg["intermediate_size"]))
    kv = 2 * cfg["num_layers"] * batch * cfg["num_kv_heads"] * context * cfg["head_dim"] * 2
    floor = (weights + kv) / bandwidth
    lines.append(f"| SmolLM2-135M (real weights, bf16, real prefill) | {context:.0f} (mean) | {batch} "
                 f"| {per_step * 1e3:.2f} | {res['tokens_per_s']:.0f} | {(weights + kv) / 1e9:.2f} GB "
                 f"| {floor * 1e3:.2f} | {floor / per_step:.2f} |")
    for key, case in decode["cases"].items():
        if key == "copy_bandwidth":
            continue
        row = case["row"]
        lines.append(f"| Qwen2.5-7B shape (random weights, bf16, random KV) | {row['context']} | {row['batch']} "
                     f"| {row['ms_per_step']:.2f} | {row['tokens_per_s']:.0f} | {row['GB_per_step']:.1f} GB "
                     f"| {row['floor_ms']:.2f} | {row['fraction_of_floor']:.2f} |")
    return "\n".join(lines)


def projection_pairs(source: str):
    """``[(separate row, fused row)]`` of a ``bench-decode --projections separate,fused`` file, by point."""
    cases = inputs.load(source)["cases"]
    return [(case["row"], cases[key + "/fused"]["row"]) for key, case in cases.items()
            if key != "copy_bandwidth" and not key.endswith("/fused") and key + "/fused" in cases]


PROJECTIONS_INTRO = ("The decode step with each layer's q/k/v and gate/up projections as separate matrices and as one "
                     "matrix each (`bench-decode --projections separate,fused`, docs/methods.md §2, fused "
                     "projections): random weights and K/V, both layouts compiled for one cache fill and timed "
                     "alternately, so the ratio is within one run; the matrix products are counted on each compiled "
                     "step.")


def projections_note() -> str:
    """What the separate-against-fused runs say, per measured file; which devices still lack a run."""
    measured, missing, gpu_short = [], [], []
    for tag, shape, source in inputs.DECODE_PROJECTIONS:
        if not (inputs.RESULTS / source).exists():
            missing.append(f"{tag} ({shape})")
            continue
        pairs = projection_pairs(source)
        ratios = [fused["step_vs_separate"] for _, fused in pairs]
        fewer = sorted({separate["matrix_products"] - fused["matrix_products"] for separate, fused in pairs})
        layers = inputs.load(source)["config"].get("layers") or inputs.SHAPE_LAYERS[shape]
        per_layer = "/".join(f"{f / layers:.0f}" for f in fewer)
        span = (f"{min(ratios):.2f}" if f"{min(ratios):.2f}" == f"{max(ratios):.2f}"
                else f"{min(ratios):.2f}-{max(ratios):.2f}")
        measured.append(f"{device_of(source)}, {shape}: the fused step {span}x the separate one over {len(pairs)} "
                        f"points, {'/'.join(map(str, fewer))} fewer matrix products a step ({per_layer} of the 3 a "
                        "layer that the layout merges)")
        if tag != "cpu" and max(fewer) < 3 * layers:
            gpu_short.append(f"{shape} on the {tag.upper()} ({per_layer} of 3 a layer)")
    text = ("Fewer, larger kernels per layer (fused projections): " + "; ".join(measured) + "."
            if measured else "Fewer, larger kernels per layer (fused projections): not measured yet.")
    if gpu_short:
        text += (" On the GPU the layout removes fewer products than on the CPU (" + ", ".join(gpu_short) + "): "
                 "XLA's GPU compiler merges matrix products that read the same input by itself, up to a size limit "
                 "(docs/methods.md §2, fused projections), so the separate layout's compiled step already holds "
                 "most of the merged products and the fused layout adds only the merges too large for the compiler.")
    if missing:
        text += " Not measured on " + ", ".join(missing) + " yet."
    return text


def projections_table() -> str:
    """The decode step with q/k/v and gate/up as separate matrices and fused (docs/methods.md §2, fused projections),
    both layouts timed alternately in one run; a file not there yet says which command writes it."""
    lines = ["| device | shape | context | batch | ms / step separate | ms / step fused | fused / separate "
             "| matrix products per step separate → fused | JSON |", "|---|---|---|---|---|---|---|---|---|"]
    missing = []
    for tag, shape, source in inputs.DECODE_PROJECTIONS:
        if not (inputs.RESULTS / source).exists():
            missing.append(f"{tag}, {shape} (`{source}`)")
            continue
        device = device_of(source)
        dtype = inputs.load(source)["config"].get("dtype") or "the preset's dtype"
        for separate, fused in projection_pairs(source):
            lines.append(f"| {device} | {shape} ({dtype}) | {separate['context']} | {separate['batch']} "
                         f"| {separate['ms_per_step']:.2f} | {fused['ms_per_step']:.2f} "
                         f"| {fused['step_vs_separate']:.3f} | {separate['matrix_products']} → "
                         f"{fused['matrix_products']} | `{source}` |")
    if missing:
        lines += ["", "Not measured yet: " + "; ".join(missing) + " (the suite steps named in the commands below)."]
    return "\n".join(lines)


def parity_table() -> str:
    lines = ["| model | device | tokens | prefill rel. err | max rel. err | greedy agreement | JSON |",
             "|---|---|---|---|---|---|---|"]
    for source in PARITY.values():
        data = inputs.load(source)
        r = data["results"]
        lines.append(f"| {r['model']} | {device_of(source)} | {r['prompt_tokens']} + {r['decode_steps']} decode "
                     f"| {r['prefill_rel_err']:.2e} | {r['max_rel_err']:.2e} | {r['argmax_agreement_decode']:.2f} "
                     f"| `{source}` |")
    return "\n".join(lines)


def skip_table() -> str:
    lines = []
    for source, what in ((SKIP, "XLA's default flags"), (SKIP_CMDBUF, "device-side conditionals")):
        for key, rows in inputs.load(source)["cases"].items():
            lines += ["", f"Skip-mask variants ({key}, {what}; `{source}`):", "",
                      "| variant | mask | first call s (compile) | ms / forward |", "|---|---|---|---|"]
            lines += [f"| {r['variant']} | {r['mask']} | {r['compile_s']:.2f} | {r['ms']:.2f} |" for r in rows]
    return "\n".join(lines[1:])


def plain_table() -> str:
    """bench-plain: the engine's plain stretch, its variants and the AR loop on one cache, per step (two call lengths'
    difference) and per call, with the compiled programs' copies; or which suite step measures it."""
    lines = []
    for tag, (source, suite) in inputs.BENCH_PLAIN.items():
        gpu = "an H100" if tag == "h100" else "the H200"
        if not (inputs.RESULTS / source).exists():
            lines += ["", f"The engine's plain stretch against the AR loop on {gpu} (bench-plain, suite {suite} step "
                          "plain-vs-ar-32k): not measured yet."]
            continue
        for case, rows in inputs.load(source)["cases"].items():
            labels = dict(PLAIN_VARIANTS)
            lines += ["", f"The engine's plain stretch against the AR loop on {gpu} ({case}, random weights; "
                          f"`{source}`): each timed at {rows[0]['n1']} and {rows[0]['n2']} steps, the step is the "
                          "difference over the extra steps, the per-call cost what is left of the short call.", "",
                      "| variant | ms / step | x AR step | ms / call beyond the steps | copies (>= 1 MiB) |",
                      "|---|---|---|---|---|"]
            lines += [f"| {labels.get(r['variant'], r['variant'])} | {r['step_ms']:.3f} | {r['step_over_ar']:.3f} "
                      f"| {r['per_call_ms']:.2f} | {r['hlo']['copies']} ({len(r['hlo']['large'])}) |" for r in rows]
    return "\n".join(lines[1:])


def speculative_tables() -> str:
    r = inputs.load(SELF_DRAFT)["results"]
    m, t = r["metrics"], r["timings"]
    total = t["profile_draft_s"] + t["profile_verify_s"] + t["profile_other_s"]
    lines = ["| run | batch | gamma | tau | acceptance | SD tok/s | AR tok/s | speed-up | identical to AR "
             "| draft / verify / other |", "|---|---|---|---|---|---|---|---|---|---|",
             f"| SmolLM2-135M, self-draft skipping {r['draft']['skipped']}, {r['prompt_tokens'][0]}-token prompt, "
             f"{max(r['num_generated'])} new tokens, greedy | {len(r['tokens'])} | {r['gamma']} | {m['tau']:.2f} "
             f"| {m['acceptance_rate']:.2f} | {r['tokens_per_s']:.0f} | {r['ar_tokens_per_s']:.0f} "
             f"| {r['speedup_vs_ar']:.2f} | {r['identical_to_ar']} | {t['profile_draft_s'] / total:.0%} / "
             f"{t['profile_verify_s'] / total:.0%} / {t['profile_other_s'] / total:.0%} |"]
    lines += ["", "The self-draft's skip set came from a CPU sweep on the same prompt (gamma 4, 64 new tokens, "
                  "float32):", "", "| draft skip | tau | JSON |", "|---|---|---|"]
    for spec, source in SELF_DRAFT_SWEEP.items():
        lines.append(f"| `{spec}` | {inputs.load(source)['results']['metrics']['tau']:.2f} | `{source}` |")
    bench = inputs.load(BENCH_SD)
    acc = bench["acceptance"]
    lines += ["", f"Fixed acceptance: tau = {acc['tau']:.2f} tokens/round from `{acc['source']}`; {acc['mode']}.", "",
              "| context | batch | AR tok/s | SD tok/s | speed-up | roofline speed-up | SD ms/round | AR ms/step |",
              "|---|---|---|---|---|---|---|---|"]
    cases = sorted(((k, c) for k, c in bench["cases"].items() if k != "copy_bandwidth"),
                   key=lambda kv: (kv[1]["row"]["context"], kv[1]["row"]["batch"]))
    for _, c in cases:
        row, m = c["row"], c["metrics"]
        lines.append(f"| {row['context']} | {row['batch']} | {row['ar_tok_s']:.0f} | {row['sd_tok_s']:.0f} "
                     f"| {row['speedup']:.2f} | {row['roofline_speedup']:.2f} "
                     f"| {c['sd_timing']['median_s'] / m['rounds'] * 1e3:.1f} "
                     f"| {c['ar_timing']['median_s'] / bench['config']['new_tokens'] * 1e3:.1f} |")
    split = inputs.load(BENCH_SD_SPLIT)
    lines += ["", f"Where the time goes at 32k (`{BENCH_SD_SPLIT}`; per-phase jitted calls with donated caches, "
                  "so read them as proportions):", "",
              "| context | batch | fused loop ms/round | profiled draft ms | verify ms | other ms "
              "| AR ms/step (same run) |", "|---|---|---|---|---|---|---|"]
    for key, c in split["cases"].items():
        if key == "copy_bandwidth":
            continue
        p, row = c["profile"], c["row"]
        rounds = p["profile_rounds"]
        lines.append(f"| {row['context']} | {row['batch']} | {c['sd_timing']['median_s'] / c['metrics']['rounds'] * 1e3:.1f} "
                     f"| {p['profile_draft_s'] / rounds * 1e3:.1f} | {p['profile_verify_s'] / rounds * 1e3:.1f} "
                     f"| {p['profile_other_s'] / rounds * 1e3:.1f} "
                     f"| {c['ar_timing']['median_s'] / split['config']['new_tokens'] * 1e3:.1f} |")
    lines += ["", "Greedy identity with AR on the CPU (self-draft `mlp:10-12`, 128 new tokens):", "",
              "| dtype | tau | identical to AR | JSON |", "|---|---|---|---|"]
    for dtype, source in GREEDY_IDENTITY.items():
        r = inputs.load(source)["results"]
        lines.append(f"| {dtype} | {r['metrics']['tau']:.2f} | {r['identical_to_ar']} | `{source}` |")
    return "\n".join(lines)


def demo_note() -> str:
    """What the two committed demo runs measured: does prompt lookup pay, and what the cache saves."""
    runs = {run: inputs.load(f"demo/demo_smollm2-135m_prompt-lookup_767_b1_{run}_cpu.json")["results"]
            for run in ("first-run", "second-run")
            if (inputs.RESULTS / f"demo/demo_smollm2-135m_prompt-lookup_767_b1_{run}_cpu.json").exists()}
    if not runs:
        return "The demo: not measured yet."
    speedups = [r["speedup_vs_ar"] for r in runs.values()]
    ar = [r["ar_tokens_per_s"] for r in runs.values()]
    tau = runs[next(iter(runs))]["metrics"]["tau"]
    gamma = runs[next(iter(runs))]["gamma"]
    identical = all(r["identical_to_ar"] for r in runs.values())
    pays = min(speedups) > 1.0
    text = (f"Prompt lookup {'pays' if pays else 'does not pay'} here: {min(speedups):.2f}-{max(speedups):.2f}x AR "
            f"(AR {min(ar):.1f}-{max(ar):.1f} tokens/s), tau {tau:.2f} with gamma {gamma}, output "
            f"{'identical to AR' if identical else 'NOT identical to AR'}.")
    if not pays:
        text += (" On this 2-core CPU a float32 step of a 135M model is partly compute-bound: each extra verified "
                 "row costs a share of a step (the latency profiles' row cost v), so a round of gamma + 1 rows that "
                 "commits tau tokens costs about as much as tau plain steps.")
    sweep = {g: inputs.load(f"demo/demo_smollm2-135m_prompt-lookup_767_b1_gamma{g}_cpu.json")["results"]
             for g in (1, 2, 3, 4) if (inputs.RESULTS / f"demo/demo_smollm2-135m_prompt-lookup_767_b1_gamma{g}_cpu.json").exists()}
    if sweep:
        best = max(sweep, key=lambda g: sweep[g]["speedup_vs_ar"])
        text += (" By draft length (cpu-demo steps gamma-1 .. gamma-4, one demo run each against AR in the same "
                 "process): " + ", ".join(f"gamma {g} {r['speedup_vs_ar']:.2f}x (tau {r['metrics']['tau']:.2f})"
                                          for g, r in sweep.items())
                 + f"; gamma {best} measured the highest speed-up and {'is' if best == gamma else 'is not'} the "
                   f"demo's default ({gamma}).")
    full = {g: inputs.load(f"demo/demo_smollm2-135m_prompt-lookup_767_b1_gamma{g}_full-verify_cpu.json")["results"]
            for g in (1, 4)
            if (inputs.RESULTS / f"demo/demo_smollm2-135m_prompt-lookup_767_b1_gamma{g}_full-verify_cpu.json").exists()}
    if full:
        cells = []
        for g, r in full.items():
            rounds = r["metrics"]["drafted_histogram"]
            cells.append(f"gamma {g} {r['speedup_vs_ar']:.2f}x AR"
                         + (f" against {sweep[g]['speedup_vs_ar']:.2f}x with the one-row rounds" if g in sweep else "")
                         + f" ({rounds[0]} of {sum(rounds)} rounds found no match)")
        text += (" A round in which no n-gram matched verifies the pending token alone (docs/methods.md §5.8); with "
                 "every round verifying gamma + 1 rows instead (--full-verify, steps gamma-1-full-verify and "
                 "gamma-4-full-verify): " + "; ".join(cells) + ".")
    if len(runs) == 2:
        first, second = runs["first-run"]["demo"], runs["second-run"]["demo"]
        text += (f" Time to the first token: {first['time_to_first_token_s']:.2f} s with an empty compilation cache "
                 f"({first['compiles']['cache_misses']} programs compiled), {second['time_to_first_token_s']:.2f} s "
                 f"when the second run loads them ({second['compiles']['cache_misses']} compiled).")
    return text
