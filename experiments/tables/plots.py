"""The plots (``experiments/results/<experiment>/*.png``).

``PLOTS`` maps each file, relative to experiments/results/, to the function that draws it; :func:`render_plot`
returns its PNG bytes. :func:`arr_plot` and :func:`plot_m_rules` are also called by ``experiments.dustin_quality``.
matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import io
from typing import Any, Callable, Dict, List, Optional, Tuple

from experiments.tables import inputs
from experiments.tables.dustin_quality import QUALITY_METHODS, complete_quality_cases, quality_cases, quality_rows
from experiments.tables.dustin_speed import DUSTIN_SPEED_PAIR_TAU_PLOT
from experiments.tables.input_aware_m import (M_PER_LENGTH_TAGS, items_context, m_per_length_rows, m_rule_rows,
                                              m_run_label)
from experiments.tables.inputs import (DENSE, DUSTIN_SPEED_PAIR_TAU, DUSTIN_SPEED_SPARSE, DUSTIN_SPEED_SPARSE_METHODS,
                                       INPUT_AWARE_M, INPUT_AWARE_M_DRAFT, INPUT_AWARE_M_PER_LENGTH,
                                       KNAPSPEC_PALLAS_STATIC, KNAPSPEC_REAL, KNAPSPEC_REAL_BASELINES, KNAPSPEC_RUNS,
                                       M_RULES, PAIR_METHODS, PAIR_SPEED, PAIR_SPEED_PLOT, PAIR_SPEED_SELF, QUALITY)
from experiments.tables.kernels import kernel_cases, pick
from experiments.tables.pair_speed import pair_cases, pair_label, pair_run_tag


# ---------------------------------------------------------------------------- plots
PLOTS: Dict[str, Callable[[Any], None]] = {}


def _plot(name):
    def register(fn):
        PLOTS[name] = fn
        return fn
    return register


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_m_rules(cases: Dict[str, Any], path: str, title: str = "") -> None:
    """Left: ARR gap to dense (1 - ARR) per k for fixed m, max-mass, coverage and the oracle; right:
    selection time per round (fixed vs each rule, same signals)."""
    plt = _pyplot()

    rows = m_rule_rows(cases)
    ks = [r["k"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for field, label in ((("arr_fixed", "fixed m (profile)"),) + tuple((f"arr_{t}", f"input-aware: {name}")
                                                                         for _, t, name in M_RULES)
                         + (("arr_oracle", "oracle m per round"),)):
        points = [(r["k"], 1 - r[field]) for r in rows if r.get(field) is not None]
        if points:
            left.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("KV budget k")
    left.set_ylabel("1 - ARR (gap to dense verification)")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    width = 0.16
    for i, (field, label) in enumerate((("selection_s_fixed", "fixed m"),) + tuple(
            (f"selection_s_{t}", name) for _, t, name in M_RULES)):
        values = [(j, r[field] * 1e3) for j, r in enumerate(rows) if r.get(field) is not None]
        if values:
            right.bar([j + (i - 2) * width for j, _ in values], [v for _, v in values], width, label=label)
    right.set_xticks(range(len(ks)))
    right.set_xticklabels([str(k) for k in ks])
    right.set_xlabel("KV budget k")
    right.set_ylabel("selection per round (ms, signals given)")
    right.grid(alpha=0.3, axis="y")
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png", metadata={"Software": None})
    plt.close(fig)



def plot_m_per_length(source: str, base: str, path: str, title: str = "") -> None:
    """Left: the share of the single m's ARR gap to the per-round oracle closed per k by the coverage rule around
    the single m, the length's m and the coverage rule around it; right: selection time per round over the fixed
    rule's for the two coverage rules (the length's m alone selects as the fixed rule)."""
    plt = _pyplot()
    rows = m_per_length_rows(source, base)
    ks = [r["k"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.25
    for i, (tag, label) in enumerate(M_PER_LENGTH_TAGS):
        values = [(j, 100 * r[f"gap_closed_{tag}"]) for j, r in enumerate(rows) if r[f"gap_closed_{tag}"] is not None]
        left.bar([j + (i - 1) * width for j, _ in values], [v for _, v in values], width, label=label)
    left.axhline(100 / 3, color="k", linestyle="--", linewidth=1, label="target: a third (mean over k)")
    left.axhline(0, color="k", linewidth=0.5)
    top = max([100 * r[f"gap_closed_{t}"] for r in rows for t, _ in M_PER_LENGTH_TAGS
               if r[f"gap_closed_{t}"] is not None] + [100 / 3])
    left.set_ylim(top=1.6 * top)  # room for the legend above the bars
    left.set_xticks(range(len(ks)))
    left.set_xticklabels([str(k) for k in ks])
    left.set_xlabel("KV budget k")
    left.set_ylabel("gap to the per-round oracle closed (%)")
    left.grid(alpha=0.3, axis="y")
    left.legend(fontsize=8, loc="upper left")
    for i, (field, label) in enumerate((("selection_ratio_coverage", "coverage rule around the single m"),
                                        ("selection_ratio_length_coverage", "coverage rule around the length's m"))):
        values = [(j, r[field]) for j, r in enumerate(rows) if r[field] is not None]
        right.bar([j + (i - 0.5) * width for j, _ in values], [v for _, v in values], width, label=label)
    right.axhline(1.1, color="k", linestyle="--", linewidth=1, label="target <= 1.1x")
    right.axhline(1.0, color="k", linewidth=0.5)
    right.set_xticks(range(len(ks)))
    right.set_xticklabels([str(k) for k in ks])
    right.set_xlabel("KV budget k")
    right.set_ylabel("selection time / fixed rule's (same signals)")
    right.set_ylim(0, 1.45 * max([r[f] for r in rows for f in ("selection_ratio_coverage",
                                                                 "selection_ratio_length_coverage")
                                  if r[f] is not None] + [1.1]))
    right.grid(alpha=0.3, axis="y")
    right.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png", metadata={"Software": None})
    plt.close(fig)


@_plot("bench_attention/bench_attention_qwen2.5-7b_qwen2.5-72b_8k-32k_h200.png")
def kernel_plot(fig_path) -> None:
    """Sparse speed-up vs k (32k context) and dense bandwidth by case, from the committed sweep."""
    import matplotlib.ticker

    plt = _pyplot()
    cases = kernel_cases()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for (shape, context, batch), rows in sorted(cases.items()):
        if context != 32768:
            continue
        ks = [k for k in (256, 512, 1024, 2048) if pick(rows, "ours_sparse", k)]
        axes[0].plot(ks, [pick(rows, "ours_sparse", k)["speedup_vs_fastest_dense"] for k in ks], marker="o",
                     label=f"{shape}, b{batch}")
        axes[0].plot(ks, [pick(rows, "ours_dense")["GB"] / pick(rows, "ours_sparse", k)["GB"] for k in ks],
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
        ours.append(pick(rows, "ours_dense")["TBps"])
        xla.append(pick(rows, "xla_dense")["TBps"])
        cudnn.append(pick(rows, "cudnn_dense")["TBps"])
    x = range(len(labels))
    axes[1].bar([i - 0.27 for i in x], ours, width=0.27, label="ours (Pallas)")
    axes[1].bar(list(x), xla, width=0.27, label="XLA")
    axes[1].bar([i + 0.27 for i in x], cudnn, width=0.27, label="cuDNN")
    axes[1].axhline(3.0, color="red", ls="--", lw=1, label="target 3.0 TB/s")
    axes[1].set_xticks(list(x), labels, rotation=70, fontsize=7)
    axes[1].set(ylabel="TB/s (K+V bytes / time)", title="dense decode attention, gamma+1 = 5 rows")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(fig_path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def arr_plot(cases: Dict[str, Any], fig_path, title: str) -> None:
    """Three panels against the KV budget k, means over items: ARR (attention recall of the index
    set), greedy token match with dense verification, retrieval accuracy (dense as a line)."""
    plt = _pyplot()
    rows = quality_rows(cases)
    sparse = [r for r in rows if r["method"] not in (DENSE, "magicdec")]
    dense = next((r for r in rows if r["method"] == DENSE), None)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = (("ARR", "ARR (mean over rounds and items)"), ("match", "greedy token match with dense"),
              ("accuracy", "retrieval accuracy"))
    for ax, (field, label) in zip(axes, panels):
        for i, name in enumerate(m for m in QUALITY_METHODS if m != "magicdec"):
            points = sorted((r["k"], r[field]) for r in sparse if r["method"] == name and r[field] is not None)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name, color=f"C{i}")
        if field == "accuracy" and dense is not None and dense["accuracy"] is not None:
            ax.axhline(dense["accuracy"], color="k", lw=1, ls="--", label="dense verification")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV budget k")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    items = max((r["items"] for r in rows), default=0)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.suptitle(f"{title} ({items} items)" if items else title, fontsize=9)
    fig.tight_layout()
    fig.savefig(fig_path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def _arr(source: str, title: str, context: Optional[int] = None, merged: bool = False):
    """One quality file's plot (``context``: only its items of that length); ``merged``: every committed
    file of the same model and item length together (a later run's budgets on the same items)."""
    def draw(fig_path):
        if merged:
            cases = quality_cases(inputs.load(source)["config"]["model"], context)
        else:
            cases = complete_quality_cases(source)
            if context is not None:
                cases = {k: c for k, c in cases.items() if k.split("/")[2] == str(context)}
        arr_plot(cases, fig_path, title)
    return draw


for _source, _title, _ctx, _merged in (
        (QUALITY["qwen2.5-coder-1.5b"][0], "qwen2.5-coder-1.5b + qwen2.5-coder-0.5b, 2k", None, False),
        (QUALITY["qwen2.5-coder-1.5b"][1], "qwen2.5-coder-1.5b + qwen2.5-coder-0.5b, 4k and 8k", None, False),
        (QUALITY["qwen2.5-coder-1.5b"][2], "qwen2.5-coder-1.5b + qwen2.5-coder-0.5b, 16k", None, False),
        # with the k = 2048 step's file (the same items)
        (QUALITY["qwen2.5-coder-1.5b"][3], "qwen2.5-coder-1.5b + qwen2.5-coder-0.5b, 16k items, H200", 16000, True),
        (QUALITY["qwen2.5-coder-1.5b"][5], "qwen2.5-coder-1.5b + qwen2.5-coder-0.5b, 32k items, H200", 32000, True),
        (QUALITY["smollm2-135m"][0], "smollm2-135m + mlp:10-12, 2k-8k", None, False),
        (QUALITY["smollm2-135m"][0], "smollm2-135m + mlp:10-12, 8k", 8192, False)):
    _name = _source.replace("dustin_quality/dustin_quality_", "dustin_quality/dustin_quality_arr_")
    if _ctx is not None and not _merged:
        _name = _name.replace("_2k-8k_", f"_{_ctx // 1024}k_")
    PLOTS[_name.replace(".json", ".png")] = _arr(_source, _title, _ctx, _merged)


def _m_rules_plot(model, source):
    def draw(fig_path) -> None:
        plot_m_rules(inputs.load(source)["cases"], fig_path,
                     title=f"{model} + {INPUT_AWARE_M_DRAFT[model]}, {items_context(source)}: input-aware m")
    return draw


for _model, _source in INPUT_AWARE_M:
    PLOTS[_source.replace(".json", ".png")] = _m_rules_plot(_model, _source)


def _m_per_length_plot(model, source, base):
    def draw(fig_path) -> None:
        plot_m_per_length(source, base, fig_path, title=f"{model} + {INPUT_AWARE_M_DRAFT[model]}, "
                          f"{m_run_label(source)}: the profile's m per context length")
    return draw


for _model, _source, _base, _ in INPUT_AWARE_M_PER_LENGTH:
    PLOTS[_source.replace(".json", ".png")] = _m_per_length_plot(_model, _source, _base)


@_plot("knapspec/knapspec_speedup_qwen2.5-7b-shape_smollm2-135m_h200_cpu.png")
def knapspec_plot(fig_path) -> None:
    """KnapSpec, CLaSp and the always-draft emulation against paired AR, one bar group per run."""
    plt = _pyplot()
    labels, series = [], {"knapspec": [], "clasp": [], "knapspec-official": []}
    for label, source, tag, ctx, batch, other in KNAPSPEC_RUNS:
        labels.append(label.replace(", ", "\n", 2))
        base = f"{tag}/summarize/ctx{ctx}/b{batch}"
        for method, values in series.items():
            case = inputs.load((other or source) if method != "knapspec" else source)["cases"].get(f"{base}/{method}")
            values.append(case["speedup_vs_ar"] if case else float("nan"))
    fig, ax = plt.subplots(figsize=(13, 4.6))
    width = 0.27
    for i, (method, values) in enumerate(series.items()):
        ax.bar([j + (i - 1) * width for j in range(len(labels))], values, width=width,
               label={"knapspec-official": "authors' always-draft (emulation)"}.get(method, method))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=6.5)
    ax.set_ylabel("speed-up vs AR decoded just before (same cache)")
    ax.set_title("KnapSpec and baselines")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(fig_path, dpi=110, metadata={"Software": None})
    plt.close(fig)


SELFSPEC_PLOT = "knapspec/knapspec_selfspec_real-qwen1.5b_8k-32k_b16_h200.png"


def selfspec_series() -> List[Tuple[str, List[Tuple[int, float]]]]:
    """Speed-up vs paired AR of each self-speculative method on the real Qwen2.5-Coder-1.5B, batch 16, H200, by
    context (files that exist only): (label, [(context, speed-up)])."""
    series = []
    for method, label in (("knapspec", "KnapSpec (static plans, Pallas)"),
                          ("knapspec-budget", "KnapSpec + budgeted attention (Pallas)")):
        if (inputs.RESULTS / KNAPSPEC_PALLAS_STATIC).exists():
            cases = inputs.load(KNAPSPEC_PALLAS_STATIC)["cases"]
            points = [(ctx, cases[key]["speedup_vs_ar"]) for ctx in (8192, 16384, 32000)
                      if (key := f"h200/summarize/ctx{ctx}/b16/{method}") in cases]
            series.append((label, points))
    static = next(src for batch, src, methods, _ in KNAPSPEC_REAL_BASELINES if batch == 16 and "static-skip" in methods)
    for source, method, label in ((KNAPSPEC_REAL[16], "clasp", "CLaSp (jnp attention)"),
                                  (static, "static-skip", "static skip set (jnp attention)")):
        if (inputs.RESULTS / source).exists():
            cases = inputs.load(source)["cases"]
            series.append((label, [(ctx, cases[key]["speedup_vs_ar"]) for ctx in (8192, 16384, 32000)
                                   if (key := f"h200/summarize/ctx{ctx}/b16/{method}") in cases]))
    if (inputs.RESULTS / PAIR_SPEED_SELF[0]).exists():
        for method, label in (("dustin-self", "Dustin-H, sinks + window self-draft (Pallas)"),
                              ("magicdec-self", "MagicDec self-draft (Pallas)")):
            points = [(case["context"], row["speedup"]) for _, case in pair_cases(PAIR_SPEED_SELF[0])
                      for row in case["rows"] if row["method"] == method]
            series.append((label, sorted(points)))
    return [(label, points) for label, points in series if points]


def _knapspec_patterns() -> List[Tuple[str, List[int]]]:
    """The plans of KnapSpec and KnapSpec with budgeted attention on the real 1.5B at batch 16 (static plans on the
    Pallas kernel), per context: (row label, one code per layer: 0 executed, 1 over the budget, 2 skipped), an
    Attention row and an MLP row per plan."""
    if not (inputs.RESULTS / KNAPSPEC_PALLAS_STATIC).exists():
        return []
    cases, rows = inputs.load(KNAPSPEC_PALLAS_STATIC)["cases"], []
    for ctx in (8192, 16384, 32000):
        plain = cases.get(f"h200/summarize/ctx{ctx}/b16/knapspec")
        if plain and plain.get("plans"):
            plan = plain["plans"][0]
            layers = len(cases.get(f"h200/summarize/ctx{ctx}/b16/knapspec-budget", {}).get("budget_plan", {}).get(
                "codes", [])) or 1 + max(plan["skip_attn"] + plan["skip_mlp"] + [0])
            gamma = f"g{plan['gamma_star']}"
            rows.append((f"KnapSpec {ctx // 1000}k ({gamma}) Attn", [2 if i in plan["skip_attn"] else 0
                                                                     for i in range(layers)]))
            rows.append((f"KnapSpec {ctx // 1000}k MLP", [2 if i in plan["skip_mlp"] else 0 for i in range(layers)]))
        budget = cases.get(f"h200/summarize/ctx{ctx}/b16/knapspec-budget", {}).get("budget_plan")
        if budget:
            codes = budget["codes"]
            rows.append((f"budgeted {ctx // 1000}k (g{budget['gamma']}) Attn", [int(c[0]) for c in codes]))
            rows.append((f"budgeted {ctx // 1000}k MLP", [int(c[1]) for c in codes]))
    return rows


@_plot(SELFSPEC_PLOT)
def selfspec_plot(fig_path) -> None:
    """Self-speculation on the real Qwen2.5-Coder-1.5B at batch 16 on the H200: speed-up vs context per method,
    and KnapSpec's plans (skipped / budgeted / executed sub-layers) as the context grows."""
    from matplotlib.colors import ListedColormap

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13.5, 4.6), gridspec_kw={"width_ratios": [1, 1.35]})
    for label, points in selfspec_series():
        axes[0].plot([p[0] / 1000 for p in points], [p[1] for p in points], marker="o", label=label)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].axhline(1.1, color="red", ls="--", lw=0.8, label="KnapSpec target 1.1x (32k)")
    axes[0].set(xlabel="context (k tokens)", ylabel="speed-up vs AR decoded just before (same cache)",
                title="real Qwen2.5-Coder-1.5B, batch 16, H200", xticks=[8, 16, 32])
    axes[0].legend(fontsize=7)
    axes[0].grid(alpha=0.3)
    rows = _knapspec_patterns()
    if rows:
        axes[1].imshow([r[1] for r in rows], aspect="auto", interpolation="nearest", vmin=0, vmax=2,
                       cmap=ListedColormap(["#e8e8e8", "#f0a030", "#202020"]))
        axes[1].set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=7)
        axes[1].set_xlabel("layer")
        axes[1].set_title("plans before the first round (light: executed, orange: sinks + window, black: skipped;"
                          " g = gamma)", fontsize=8)
    fig.tight_layout()
    fig.savefig(fig_path, dpi=110, metadata={"Software": None})
    plt.close(fig)


@_plot(DUSTIN_SPEED_PAIR_TAU_PLOT)
def dustin_speed_pair_tau_plot(fig_path) -> None:
    """Speed-up vs AR against the context on the 7B/0.5B shapes at batch 16, each method at its own real-pair tau;
    the bytes roofline dashed; the sparse draft KV from its own run (stars)."""
    plt = _pyplot()
    cases = {k: c for k, c in inputs.load(DUSTIN_SPEED_PAIR_TAU)["cases"].items() if k != "copy_bandwidth"}
    fig, ax = plt.subplots(figsize=(9.6, 4.2))
    for i, (method, label) in enumerate((("classic", "ClassicSD"), ("magicdec", "MagicDec"), ("dustin", "Dustin-H"))):
        rows = sorted((r for c in cases.values() for r in c["rows"] if r["method"] == method), key=lambda r: r["context"])
        xs = [r["context"] / 1024 for r in rows]
        ax.plot(xs, [r["speedup"] for r in rows], "o-", color=f"C{i}", label=label)
        ax.plot(xs, [r["roofline_speedup"] for r in rows], "--", color=f"C{i}", alpha=0.5)
    sparse_cases = [c for k, c in inputs.load(DUSTIN_SPEED_SPARSE)["cases"].items() if k != "copy_bandwidth"]
    for i, (method, label) in enumerate(DUSTIN_SPEED_SPARSE_METHODS[2:], start=3):
        rows = sorted((r for c in sparse_cases for r in c["rows"] if r["method"] == method),
                      key=lambda r: r["context"])
        if rows:
            ax.plot([r["context"] / 1024 for r in rows], [r["speedup"] for r in rows], "*-", ms=11, color=f"C{i}",
                    label=label + " (its own run)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("context (k tokens)")
    ax.set_ylabel("speed-up vs AR (same process)")
    ax.set_title("7B / 0.5B shapes, batch 16, k = 512, one H200; each method at the real pair's tau\n"
                 "(dashed: bytes roofline at that tau)", fontsize=9)
    ax.set_xticks([8, 16, 32])
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(fig_path, dpi=110, metadata={"Software": None})
    plt.close(fig)


@_plot(PAIR_SPEED_PLOT)
def pair_speed_plot(fig_path) -> None:
    """Speed-up vs paired AR per method at each measured (context, batch), the bytes roofline as markers."""
    plt = _pyplot()
    runs = sorted(((s, c) for s in PAIR_SPEED for _, c in pair_cases(s)), key=lambda t: (t[1]["context"], t[1]["batch"]))
    groups = [c for _, c in runs]
    points = [(c["context"], c["batch"]) for c in groups]
    labels = [f"{c['context'] // 1000}k, batch {c['batch']}"
              + (f"\n({pair_run_tag(s)} run)" if points.count((c["context"], c["batch"])) > 1 and s != PAIR_SPEED[0]
                 else "") for s, c in runs]
    methods = [m for m, _ in PAIR_METHODS if any(m in c for c in groups)]
    fig, ax = plt.subplots(figsize=(9.5, 4.4))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(groups))]
        nan = float("nan")
        ax.bar(xs, [c[method]["speedup_vs_ar"] if method in c else nan for c in groups], width,
               label=pair_label(method).strip("*"), color=f"C{i}")
        ax.scatter(xs, [c[method]["roofline_speedup"] if method in c else nan for c in groups], marker="_", s=160,
                   color="k", zorder=3, label="bytes roofline at its tau" if i == 0 else None)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(groups)), labels, fontsize=8)
    ax.set_ylabel("speed-up vs AR decoded just before (same prefill)")
    ax.set_title("Qwen2.5-Coder-1.5B + 0.5B draft, bf16, Pallas attention, one H200 (pair-speed, k = 512)",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(fig_path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def render_plot(name: str) -> bytes:
    buffer = io.BytesIO()
    PLOTS[name](buffer)
    return buffer.getvalue()
