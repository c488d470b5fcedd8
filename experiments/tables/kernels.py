"""The attention kernels (``bench_attention/``, ``attention_device_time/``): dense against sparse attention.

By wall time per shape, context and batch (:func:`kernel_cases`, :func:`kernel_table`) and by device kernel
time over all layers, rolled and unrolled, on the H200 and an H100 (:func:`device_time_note`);
:func:`own_kernel_ratio` (jaxspec's own kernels alone) is read by the figures too.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from experiments.tables import inputs
from experiments.tables.dustin_speed import traced_rounds
from experiments.tables.inputs import (DEVICE_TARGETS, KERNEL_DEVICE, KERNEL_DEVICE_FIRST, KERNEL_DEVICE_UNROLLED,
                                       KERNEL_DEVICE_UNROLLED_H100, KERNEL_FILES)


def _fastest_rows(case) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The device-time case's fastest dense and fastest sparse rows."""
    rows = {r["variant"]: r for r in case["rows"]}
    return rows[case["fastest_dense"]], rows[case["fastest_sparse"]]


def own_kernel_ratio(case) -> Optional[float]:
    """Fastest dense over fastest sparse by jaxspec's own kernels alone; None where the file has no split
    (or no own kernels, as on a CPU)."""
    dense, sparse = _fastest_rows(case)
    if not (dense.get("own_kernels_us_per_layer") and sparse.get("own_kernels_us_per_layer")):
        return None
    return dense["own_kernels_us_per_layer"] / sparse["own_kernels_us_per_layer"]


def kernel_cases() -> Dict[Tuple[str, int, int], List[Dict[str, Any]]]:
    """Every bench-attention case of the committed H200 sweep: ``{(shape, context, batch): rows}``."""
    cases = {}
    for name in KERNEL_FILES:
        for key, case in inputs.load(name)["cases"].items():
            if key == "copy_bandwidth":
                continue
            row = case["rows"][0]
            cases[(row["shape"], row["context"], row["batch"])] = case["rows"]
    return cases


def pick(rows, variant, k="-"):
    for row in rows:
        if row["variant"] == variant and row["k"] == k:
            return row
    return None


def kernel_table() -> str:
    lines = ["| shape | context | batch | ours dense µs (TB/s) | XLA dense µs | cuDNN µs | ours sparse k=512 µs "
             "| sparse speed-up vs fastest dense (k = 256 / 512 / 1024 / 2048) | XLA gather k=512 µs "
             "| selection, 4 KV groups: µs (% of dense verification) | selection, 1 KV group |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (shape, context, batch), rows in sorted(kernel_cases().items(), key=lambda kv: (kv[0][0], -kv[0][1], -kv[0][2])):
        dense, xla, cudnn = pick(rows, "ours_dense"), pick(rows, "xla_dense"), pick(rows, "cudnn_dense")
        sparse, gather = pick(rows, "ours_sparse", 512), pick(rows, "xla_gather_dense", 512)
        speedups = " / ".join(f"{r['speedup_vs_fastest_dense']:.1f}" if r else "-"
                              for r in (pick(rows, "ours_sparse", k) for k in (256, 512, 1024, 2048)))
        sel4, sel1 = pick(rows, "selection_4groups", 512), pick(rows, "selection_1group", 512)
        lines.append(
            f"| {shape} | {context // 1024}k | {batch} | {dense['us']:.0f} ({dense['TBps']:.2f}) | {xla['us']:.0f} "
            f"| {cudnn['us']:.0f} | {sparse['us']:.1f} | {speedups} | {gather['us']:.1f} "
            f"| {sel4['us']:.0f} ({100 * sel4['fraction_of_dense_verification']:.2f} %) "
            f"| {sel1['us']:.0f} ({100 * sel1['fraction_of_dense_verification']:.2f} %) |")
    return "\n".join(lines)


def device_time_note() -> str:
    """The attention speed-up as the paper states it: kernel time of all layers, from the profiler."""
    if not (inputs.RESULTS / KERNEL_DEVICE).exists():
        return ("Sparse ≥ 20x (7B) / ≥ 28x (72B) the fastest dense at k = 512, 32k, batch 16 by device kernel time "
                "(all layers, the paper's measure): **not measured yet** (suite h200-attention-kernels, step "
                "`device-time-32k-b16`).")
    cases = inputs.load(KERNEL_DEVICE)["cases"]
    first_run = ""
    if (inputs.RESULTS / KERNEL_DEVICE_FIRST).exists():
        first = inputs.load(KERNEL_DEVICE_FIRST)["cases"]
        first_run = (f" The earlier run without the split (`{KERNEL_DEVICE_FIRST}`) measured "
                     + ", ".join(f"{shape} {first[f'{shape}/ctx32768/b16/k512']['speedup_device']:.1f}x"
                                 for shape in DEVICE_TARGETS if f"{shape}/ctx32768/b16/k512" in first) + ".")
    parts = []
    for shape, (short, target) in DEVICE_TARGETS.items():
        case = cases.get(f"{shape}/ctx32768/b16/k512")
        if case is None:
            parts.append(f"{shape}: not measured")
            continue
        dense, sparse = _fastest_rows(case)
        own = own_kernel_ratio(case)
        parts.append(f"{shape} {case['speedup_device']:.1f}x (target {target:.0f}x: "
                     f"{'**met**' if case['speedup_device'] >= target else '**missed**'}; {sparse['variant']} "
                     f"{sparse['device_us_per_layer']:.1f} µs a layer against {dense['variant']} "
                     f"{dense['device_us_per_layer']:.0f} µs; by host time in the same run {case['speedup_wall']:.1f}x; "
                     f"byte ratio {case['byte_ratio']:.0f}x"
                     + (f"; jaxspec's attention kernels alone {sparse['own_kernels_us_per_layer']:.1f} against "
                        f"{dense['own_kernels_us_per_layer']:.0f} µs, {own:.1f}x, the other kernels of the call "
                        f"{sparse['other_kernels_us_per_layer']:.1f} against "
                        f"{dense['other_kernels_us_per_layer']:.1f} µs" if own is not None else "") + ")")
    return ("By device kernel time of all layers (the paper's measure; every kernel the program launches, from the "
            f"profiler, `{KERNEL_DEVICE}`): " + "; ".join(parts) + "." + _other_kernels_sentence(cases) + first_run
            + _unrolled_device_time_sentence())


def _unrolled_parts(source: str, verdicts: Tuple[str, str] = ("**met**", "**missed**"),
                    target_label: str = "target") -> List[str]:
    """Per layer shape: the unrolled run's sparse-vs-dense ratio by device time against its target."""
    cases, parts = inputs.load(source)["cases"], []
    for shape, (_, target) in DEVICE_TARGETS.items():
        case = cases.get(f"{shape}/ctx32768/b16/k512")
        if case is None:
            continue
        dense, sparse = _fastest_rows(case)
        parts.append(f"{shape} {case['speedup_device']:.1f}x ({target_label} {target:.0f}x: "
                     f"{verdicts[0] if case['speedup_device'] >= target else verdicts[1]}; {sparse['variant']} "
                     f"{sparse['device_us_per_layer']:.1f} µs a layer, {sparse['other_kernels_us_per_layer']:.1f} of "
                     f"them outside jaxspec's kernels, against {dense['variant']} {dense['device_us_per_layer']:.0f} µs)")
    return parts


def _unrolled_device_time_sentence() -> str:
    """The device-time targets measured with the layers unrolled, where that run exists (on the H200, and the
    same measure on an H100 where that run exists)."""
    if not (inputs.RESULTS / KERNEL_DEVICE_UNROLLED).exists():
        out = (" With the layers unrolled, one call per layer on inputs of its own so that no loop slice or stacked "
               "write runs beside the attention (h200-attention-kernels step `device-time-32k-b16-unrolled`): not "
               "measured yet on the H200.")
    else:
        parts = _unrolled_parts(KERNEL_DEVICE_UNROLLED)
        out = (f" With the layers unrolled, one call per layer on inputs of its own, as the model's forward makes "
               f"them, so that no loop slice or stacked write runs beside the attention (`{KERNEL_DEVICE_UNROLLED}`, "
               "every kernel of the program): " + ("; ".join(parts) if parts else "no case measured") + ".")
    if (inputs.RESULTS / KERNEL_DEVICE_UNROLLED_H100).exists():
        parts = _unrolled_parts(KERNEL_DEVICE_UNROLLED_H100, ("above it on this GPU", "below it on this GPU"),
                                "the H200 target")
        dense = []
        if (inputs.RESULTS / KERNEL_DEVICE).exists():
            h100, h200 = inputs.load(KERNEL_DEVICE_UNROLLED_H100)["cases"], inputs.load(KERNEL_DEVICE)["cases"]
            for shape in DEVICE_TARGETS:
                key = f"{shape}/ctx32768/b16/k512"
                if key in h100 and key in h200:
                    dense.append(f"{shape} {_fastest_rows(h200[key])[0]['device_us_per_layer']:.0f} µs on the H200 "
                                 f"against {_fastest_rows(h100[key])[0]['device_us_per_layer']:.0f} µs here")
        out += (f" The same unrolled measure on an H100 (`{KERNEL_DEVICE_UNROLLED_H100}`, suite h100-long-context): "
                + ("; ".join(parts) if parts else "no case measured") + ". The targets are stated for the H200, "
                "and the ratio depends on the GPU: its fastest dense attention a layer is "
                + ("; ".join(dense) if dense else "not measured on both") + ", so the same sparse time gives the H100 "
                "the larger ratio; on the H200 the unrolled run is what settles the targets.")
    return out


def _other_kernels_sentence(cases) -> str:
    """What the kernels other than jaxspec's own cost per layer, and whether the own kernels alone meet the
    targets (from the split rows of the device-time file; empty where the file has no split)."""
    others, verdicts = [], []
    for shape, (_, target) in DEVICE_TARGETS.items():
        case = cases.get(f"{shape}/ctx32768/b16/k512")
        if case is None:
            continue
        dense, sparse = _fastest_rows(case)
        ratio = own_kernel_ratio(case)
        if ratio is None:
            return ""
        others += [dense["other_kernels_us_per_layer"], sparse["other_kernels_us_per_layer"]]
        verdicts.append(f"{shape} {ratio:.1f}x against {target:.0f}x")
    if not others:
        return ""
    return (f" The other kernels, {min(others):.0f}-{max(others):.0f} µs a layer in the fastest dense and sparse "
            "variants alike, are the merge of the kernel's partial results (two small fusions) and the measuring "
            "loop's own per-layer work (slicing each layer's queries and index set, writing its output into the "
            "stacked result); they do not shrink with k. The attention kernels alone: " + ", ".join(verdicts) + ".")


def topk_rows(data: Dict[str, Any]) -> Dict[int, Dict[str, float]]:
    """Per batch of a bench-attention top-k file: µs of each variant (top-k, scoring, whole selection) at k = 512."""
    out = {}
    for key, case in data["cases"].items():
        if key == "copy_bandwidth" or "rows" not in case:
            continue
        rows = case["rows"]
        out[rows[0]["batch"]] = {r["variant"]: r["us"] for r in rows if r["k"] in ("-", 512)}
    return out


def topk_note() -> str:
    """The exact top-k variants at 32k on the H100 beside the H200's, and what the default takes there."""
    source = inputs.KERNEL_TOPK_H100
    if not (inputs.RESULTS / source).exists():
        return (f"The exact top-k variants at 32k on the H100: not measured yet (suite "
                f"`{inputs.suite_steps()[source][0]}`, `{source}`).")
    per_batch = topk_rows(inputs.load(source))
    labels = dict(inputs.TOPK_VARIANTS)
    parts = []
    for batch in sorted(per_batch, reverse=True):
        us = per_batch[batch]
        fastest = min(labels, key=lambda v: us[v])
        parts.append(f"batch {batch}: " + ", ".join(f"{labels[v]} {us[v]:.0f} µs" for v in labels)
                     + f" (fastest: {labels[fastest]}; the whole selection {us['selection_4groups']:.0f} µs with "
                     f"4 KV groups, {us['selection_1group']:.0f} µs with 1)")
    compare_over_lax = [per_batch[b]["topk_radix4_compare"] / per_batch[b]["topk_lax_top_k"] for b in per_batch]
    lax_fastest = all(min(labels, key=lambda v: per_batch[b][v]) == "topk_lax_top_k" for b in per_batch)
    gap = max(per_batch[b]["topk_radix4_compare"] - per_batch[b]["topk_lax_top_k"] for b in per_batch)
    text = (f"The exact top-k at 32k on an H100 (`{source}`, the 7B layer shape, k = 512): " + "; ".join(parts) + ". "
            + ("There `lax.top_k` is the fastest at every batch" if lax_fastest else "There the fastest varies")
            + f"; the 4-bit compare radix, the GPU default from 32k positions (chosen on the H200, where it led), "
            f"takes {min(compare_over_lax):.2f}-{max(compare_over_lax):.2f}x the time of `lax.top_k`, at most "
            f"{gap:.0f} µs a top-k")
    trace = dict(inputs.DUSTIN_TRACE_FUSED)["h100"][0][2]  # the H100's sparse-draft round, separate projections
    if (inputs.RESULTS / trace).exists():
        round_ms = traced_rounds(inputs.load(trace))["dustin-kv-streaming"]["round_ms"]
        text += (f": two a round (the draft's and the target's signal) would save at most {2 * gap / 1e3:.3f} ms of "
                 f"the H100's {round_ms:.1f} ms sparse-draft round at 32k/b16 ({100 * 2 * gap / 1e3 / round_ms:.1f} "
                 "%), so the default stays one for both GPUs")
    return text + "."
