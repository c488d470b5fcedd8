"""Markdown tables for the README, computed from the committed JSON under experiments/results/.

``python -m experiments.tables`` prints every table; the README's numbers come from here.
"""

from __future__ import annotations

import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _load(name):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def foundation_tables() -> str:
    lines = []
    decode = _load("bench_decode_7b_h200.json")
    generate = _load("generate_smollm2_b16_h200.json")
    bandwidth = decode["cases"]["copy_bandwidth"]["bandwidth_Bps"] if decode else None
    lines.append("| model | context | batch | ms / step | tokens/s | bytes / step (weights + KV) | floor ms "
                 "| fraction of floor |")
    lines.append("|---|---|---|---|---|---|---|---|")
    if generate:
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
    if decode:
        for key, case in decode["cases"].items():
            if key == "copy_bandwidth":
                continue
            row = case["row"]
            lines.append(f"| Qwen2.5-7B shape (random weights, bf16, random KV) | {row['context']} | {row['batch']} "
                         f"| {row['ms_per_step']:.2f} | {row['tokens_per_s']:.0f} | {row['GB_per_step']:.1f} GB "
                         f"| {row['floor_ms']:.2f} | {row['fraction_of_floor']:.2f} |")
        lines.append("")
        lines.append(f"Copy bandwidth measured in the same run: {bandwidth / 1e12:.2f} TB/s "
                     f"(`y = x * 1.0001` over 4 GiB, bytes read + written).")
    parity_rows = []
    for name in ("parity_smollm2_cpu.json", "parity_smollm2_h200.json", "parity_random_7b_h200.json",
                 "parity_qwen0.5b_cpu.json"):
        data = _load(name)
        if data:
            r = data["results"]
            parity_rows.append(f"| {r['model']} | {data['environment']['devices'][0]} | {r['prompt_tokens']} + "
                               f"{r['decode_steps']} decode | {r['prefill_rel_err']:.2e} | {r['max_rel_err']:.2e} "
                               f"| {r['argmax_agreement_decode']:.2f} |")
    if parity_rows:
        lines += ["", "| parity (float32) | device | tokens | prefill rel. err | max rel. err | greedy agreement |",
                  "|---|---|---|---|---|---|", *parity_rows]
    skip = _load("bench_skip_7b_h200.json")
    if skip:
        for key, rows in skip["cases"].items():
            lines += ["", f"Skip-mask variants ({key}):", "", "| variant | mask | first call s (compile) | ms / forward |",
                      "|---|---|---|---|"]
            lines += [f"| {r['variant']} | {r['mask']} | {r['compile_s']:.2f} | {r['ms']:.2f} |" for r in rows]
    return "\n".join(lines)


def speculative_tables() -> str:
    lines = []
    smol = _load("sd_smollm2_selfdraft_b16_h200.json")
    if smol:
        r = smol["results"]
        m, t = r["metrics"], r["timings"]
        total = t["profile_draft_s"] + t["profile_verify_s"] + t["profile_other_s"]
        lines += ["| run | batch | gamma | tau | acceptance | SD tok/s | AR tok/s | speed-up | identical to AR "
                  "| draft / verify / other |", "|---|---|---|---|---|---|---|---|---|---|",
                  f"| SmolLM2-135M, self-draft skipping {r['draft']['skipped']}, {r['prompt_tokens'][0]}-token prompt, "
                  f"{max(r['num_generated'])} new tokens, greedy | {len(r['tokens'])} | {r['gamma']} | {m['tau']:.2f} "
                  f"| {m['acceptance_rate']:.2f} | {r['tokens_per_s']:.0f} | {r['ar_tokens_per_s']:.0f} "
                  f"| {r['speedup_vs_ar']:.2f} | {r['identical_to_ar']} | {t['profile_draft_s'] / total:.0%} / "
                  f"{t['profile_verify_s'] / total:.0%} / {t['profile_other_s'] / total:.0%} |"]
    bench = _load("bench_sd_7b_h200.json")
    if bench:
        acc = bench["acceptance"]
        lines += ["", f"Fixed acceptance: tau = {acc['tau']:.2f} tokens/round from `{acc['source']}`; "
                      f"{acc['mode']}.", "",
                  "| context | batch | AR tok/s | SD tok/s | speed-up | roofline speed-up | SD ms/round | AR ms/step |",
                  "|---|---|---|---|---|---|---|---|"]
        cases = sorted(((k, v) for k, v in bench["cases"].items() if k != "copy_bandwidth"),
                       key=lambda kv: (kv[1]["row"]["context"], kv[1]["row"]["batch"]))
        for _, v in cases:
            row, m = v["row"], v["metrics"]
            lines.append(f"| {row['context']} | {row['batch']} | {row['ar_tok_s']:.0f} | {row['sd_tok_s']:.0f} "
                         f"| {row['speedup']:.2f} | {row['roofline_speedup']:.2f} "
                         f"| {v['sd_timing']['median_s'] / m['rounds'] * 1e3:.1f} "
                         f"| {v['ar_timing']['median_s'] / bench['config']['new_tokens'] * 1e3:.1f} |")
    split = _load("bench_sd_7b_32k_profile_h200.json")
    if split:
        lines += ["", "| context | batch | fused loop ms/round | profiled draft ms | verify ms | other ms "
                      "| AR ms/step (same run) |", "|---|---|---|---|---|---|---|"]
        for key, v in split["cases"].items():
            if key == "copy_bandwidth":
                continue
            p, row = v["profile"], v["row"]
            rounds = p["profile_rounds"]
            lines.append(f"| {row['context']} | {row['batch']} "
                         f"| {v['sd_timing']['median_s'] / v['metrics']['rounds'] * 1e3:.1f} "
                         f"| {p['profile_draft_s'] / rounds * 1e3:.1f} | {p['profile_verify_s'] / rounds * 1e3:.1f} "
                         f"| {p['profile_other_s'] / rounds * 1e3:.1f} "
                         f"| {v['ar_timing']['median_s'] / split['config']['new_tokens'] * 1e3:.1f} |")
    return "\n".join(lines)


KERNEL_FILES = ("bench_attention_qwen2.5-7b_h200.json", "bench_attention_qwen2.5-7b_8k_h200.json",
                "bench_attention_qwen2.5-72b_h200.json")


def kernel_cases():
    """Every bench-attention case of the committed H200 sweep: ``{(shape, context, batch): rows}``."""
    cases = {}
    for name in KERNEL_FILES:
        data = _load(name)
        if not data:
            continue
        for key, case in data["cases"].items():
            if key == "copy_bandwidth":
                continue
            row = case["rows"][0]
            cases[(row["shape"], row["context"], row["batch"])] = case["rows"]
    return cases


def _pick(rows, variant, k="-"):
    for row in rows:
        if row["variant"] == variant and row["k"] == k:
            return row
    return None


def kernel_tables() -> str:
    cases = kernel_cases()
    if not cases:
        return ""
    lines = ["| shape | context | batch | ours dense µs (TB/s) | XLA dense µs | cuDNN µs | ours sparse k=512 µs "
             "| sparse speed-up vs fastest dense (k = 256 / 512 / 1024 / 2048) | XLA gather k=512 µs "
             "| selection, 4 KV groups: µs (% of dense verification) | selection, 1 KV group |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (shape, context, batch), rows in sorted(cases.items(), key=lambda kv: (kv[0][0], -kv[0][1], -kv[0][2])):
        dense, xla, cudnn = _pick(rows, "ours_dense"), _pick(rows, "xla_dense"), _pick(rows, "cudnn_dense")
        sparse = _pick(rows, "ours_sparse", 512)
        gather = _pick(rows, "xla_gather_dense", 512)
        speedups = " / ".join(f"{r['speedup_vs_fastest_dense']:.1f}" if r else "-"
                              for r in (_pick(rows, "ours_sparse", k) for k in (256, 512, 1024, 2048)))
        sel4, sel1 = _pick(rows, "selection_4groups", 512), _pick(rows, "selection_1group", 512)
        lines.append(
            f"| {shape} | {context // 1024}k | {batch} | {dense['us']:.0f} ({dense['TBps']:.2f}) | {xla['us']:.0f} "
            f"| {cudnn['us']:.0f} | {sparse['us']:.1f} | {speedups} | {gather['us']:.1f} "
            f"| {sel4['us']:.0f} ({100 * sel4['fraction_of_dense_verification']:.2f} %) "
            f"| {sel1['us']:.0f} ({100 * sel1['fraction_of_dense_verification']:.2f} %) |")
    return "\n".join(lines)


def kernel_plot(path) -> None:
    """Sparse speed-up vs k (32k context) and dense bandwidth by case, from the committed sweep."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = kernel_cases()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for (shape, context, batch), rows in sorted(cases.items()):
        if context != 32768:
            continue
        ks = [k for k in (256, 512, 1024, 2048) if _pick(rows, "ours_sparse", k)]
        axes[0].plot(ks, [_pick(rows, "ours_sparse", k)["speedup_vs_fastest_dense"] for k in ks], marker="o",
                     label=f"{shape}, b{batch}")
        axes[0].plot(ks, [_pick(rows, "ours_sparse", k)["GB"] and
                          _pick(rows, "ours_dense")["GB"] / _pick(rows, "ours_sparse", k)["GB"] for k in ks],
                     ls=":", color="gray", lw=0.8)
    axes[0].axhline(28, color="red", ls="--", lw=1, label="target 28x (k=512, b16)")
    axes[0].set(xscale="log", yscale="log", xlabel="budget k", ylabel="speed-up vs fastest dense",
                title="sparse vs dense, 32k context (dotted: byte ratio)")
    axes[0].set_xticks([256, 512, 1024, 2048], ["256", "512", "1024", "2048"])
    axes[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0].legend(fontsize=7, loc="lower left")
    labels, ours, xla, cudnn = [], [], [], []
    for (shape, context, batch), rows in sorted(cases.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        labels.append(f"{shape.replace('qwen2.5-', '')} {context // 1024}k b{batch}")
        ours.append(_pick(rows, "ours_dense")["TBps"])
        xla.append(_pick(rows, "xla_dense")["TBps"])
        cudnn.append(_pick(rows, "cudnn_dense")["TBps"])
    x = range(len(labels))
    axes[1].bar([i - 0.27 for i in x], ours, width=0.27, label="ours (Pallas)")
    axes[1].bar(list(x), xla, width=0.27, label="XLA")
    axes[1].bar([i + 0.27 for i in x], cudnn, width=0.27, label="cuDNN")
    axes[1].axhline(3.0, color="red", ls="--", lw=1, label="target 3.0 TB/s")
    axes[1].set_xticks(list(x), labels, rotation=70, fontsize=7)
    axes[1].set(ylabel="TB/s (K+V bytes / time)", title="dense decode attention, gamma+1 = 5 rows")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    import sys

    print(foundation_tables())
    print()
    print(speculative_tables())
    print()
    print(kernel_tables())
    if "--plots" in sys.argv:
        kernel_plot(RESULTS / "bench_attention_h200.png")
