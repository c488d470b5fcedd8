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


if __name__ == "__main__":
    print(foundation_tables())
    print()
    print(speculative_tables())
