"""The ``knapspec`` experiment's results as tables (:func:`report`) and a figure (:func:`plot`), read from its
results data; ``experiment`` prints and draws them at the end of a run.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List

import numpy as np

from experiments.common import print_table


def _split(key: str):
    parts = key.split("/")
    return parts[0], parts[1], int(parts[2][3:]), int(parts[3][1:]), "/".join(parts[4:])


def report(data: Dict[str, Any]) -> List[Dict[str, Any]]:
    rows, corr = [], []
    for key, v in data["cases"].items():
        if "/static_plan/" in key:
            continue
        tag, task, ctx, batch, what = _split(key)
        if what == "correlation":
            corr.append({"case": f"{task} {ctx} b{batch}", "plans": v["plans"],
                         "r(TPT, tok/s)": v["pearson_predicted_tpt_vs_throughput"],
                         "r(alpha, tok/s)": v["pearson_dp_alpha_vs_throughput"],
                         "r(TPT, speed-up)": v.get("pearson_predicted_tpt_vs_speedup"),
                         "r(alpha, speed-up)": v.get("pearson_dp_alpha_vs_speedup")})
        elif "tokens_per_s" in v and not what.startswith("fixed/"):
            split = v["time_split_estimate"]
            decode = v["timings"]["decode_s"]
            rows.append({"task": task, "ctx": ctx, "b": batch, "method": what, "tok/s": v["tokens_per_s"],
                         "AR tok/s": v["ar_tokens_per_s"], "speedup": v["speedup_vs_ar"],
                         "tau": v["tau"] if v["tau"] is not None else float("nan"),
                         "acc": v["acceptance_rate"],
                         "skip A/M": " ".join(f"{p['n_skip_attn']}/{p['n_skip_mlp']}" for p in v["plans"]) or "-",
                         "gamma": " ".join(str(p["gamma_used"]) for p in v["plans"]) or "-",
                         "probe": " ".join({"speculative": "S", "ar": "AR"}[p["probe"]["choice"]]
                                           if p.get("probe") else "-" for p in v["plans"]) or "-",
                         "plan %": 100 * v["plan_fraction_of_decode"],
                         "draft/verify/AR %": "/".join(f"{100 * split[k] / decode:.0f}"
                                                       for k in ("draft_s", "verify_s", "ar_interval_s")),
                         "same": v["identical_to_ar"]})
    print_table(rows, title="KnapSpec and baselines (speed-up vs AR decoded just before, same cache)")
    if corr:
        print_table(corr, title="Pearson correlation across fixed candidate plans")
    return rows


def plot(data: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    plans = {}
    for key, v in data["cases"].items():
        tag, task, ctx, batch, what = _split(key) if key.count("/") >= 4 else (None,) * 5
        if what == "knapspec" and v.get("plans"):
            drafting = [p for p in v["plans"] if p["gamma_used"] > 0]
            if drafting:  # the skip set of the first plan that drafts (gamma* = 0 plans skip nothing in effect)
                plans.setdefault((task, batch, "planned"), []).append(
                    (ctx, drafting[0]["n_skip_attn"], drafting[0]["n_skip_mlp"]))
        if what == "candidates":  # the DP candidate of highest predicted TPT at gamma >= 1
            best = max(v["candidates"], key=lambda c: c["predicted_tpt"] if c["weight"] > 0 else -1)
            plans.setdefault((task, batch, "best drafting candidate"), []).append(
                (ctx, best["n_skip_attn"], best["n_skip_mlp"]))
    ax = axes[0]
    for (task, batch, kind), pts in sorted(plans.items()):
        pts.sort()
        x = [p[0] for p in pts]
        ax.plot(x, [p[1] for p in pts], "o-", label=f"Attention, {kind} ({task}, b{batch})")
        ax.plot(x, [p[2] for p in pts], "s--", label=f"MLP, {kind} ({task}, b{batch})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("skipped sub-layers")
    ax.set_title("KnapSpec skip set vs context")
    ax.legend(fontsize=6)
    ax = axes[1]
    for key, v in data["cases"].items():
        if key.endswith("/correlation"):
            base = key[: -len("/correlation")]
            fixed = [f for k, f in data["cases"].items() if k.startswith(base + "/fixed/")]
            if fixed:
                r = v.get("pearson_predicted_tpt_vs_speedup")
                label = base.split("/", 1)[1] + (f" (r={r:.2f})" if r is not None else "")
                ax.scatter([f["predicted_tpt"] * f["predicted_ar_step_s"] for f in fixed],
                           [f["speedup_vs_ar"] for f in fixed], label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("predicted speed-up (TPT x modelled AR step)")
    ax.set_ylabel("measured speed-up vs paired AR (fixed plan)")
    ax.set_title("Candidate plans: predicted vs measured")
    ax.legend(fontsize=7)
    ax = axes[2]
    methods = [m for m in ("knapspec", "knapspec-official", "clasp", "static-skip", "knapspec-tpl",
                           "knapspec-coupled")]
    ctxs = sorted({_split(k)[2] for k in data["cases"] if k.count("/") >= 4 and "/static_plan/" not in k
                   and _split(k)[1] == "summarize" and _split(k)[3] == 1})
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        ys = []
        for c in ctxs:
            hits = [v for k, v in data["cases"].items() if k.count("/") >= 4 and "/static_plan/" not in k
                    and _split(k)[1:] == ("summarize", c, 1, method)]
            ys.append(hits[0]["speedup_vs_ar"] if hits else np.nan)
        ax.bar(np.arange(len(ctxs)) + i * width, ys, width, label=method)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(ctxs)) + 0.4 - width / 2)
    ax.set_xticklabels([str(c) for c in ctxs])
    ax.set_xlabel("prompt tokens (summarize, batch 1)")
    ax.set_ylabel("speed-up vs AR (same run)")
    ax.set_title("Speed-up vs AR")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"figure: {path}", file=sys.stderr)
