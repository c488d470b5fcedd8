"""Every headline figure: ``FIGURES``, ``BY_KEY``, the README's keys and their formatting.

A :class:`Figure` is a key, a label, a unit, the JSON file it is read from and a JSON path or a small extractor
(the private helpers here build those paths), and the target or the paper's number it is held against. Its
command is the suite step whose ``--out`` is its file (:func:`experiments.tables.inputs.command_of`);
``experiments/results/index.json`` is ``Figure.entry()`` of each. :func:`fmt` formats a value by its unit;
:func:`v` formats the figure of a key (the notes quote figures with it).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any, Dict, List

from experiments.tables import inputs
from experiments.tables.decode import projection_pairs
from experiments.tables.dustin_quality import (gpu_quality_contexts, quality_budgets, quality_cases, quality_items,
                                               quality_rows, quality_source, quality_sources)
from experiments.tables.dustin_speed import (dustin, phase_over_floor, phase_selection, selection_share,
                                             traced_phases, traced_rounds)
from experiments.tables.input_aware_m import m_per_length_rows, m_rule_rows
from experiments.tables.inputs import (ARBITRATE_CPU, BENCH_SD, DECODE, DENSE, DEVICE_NAME, DEVICE_TARGETS,
                                       DP_REFERENCES, DUSTIN_SMOLLM2_TAU, DUSTIN_SPEED, DUSTIN_SPEED_FINISHED,
                                       DUSTIN_SPEED_FINISHED_KEPT, DUSTIN_SPEED_PAIR_TAU, DUSTIN_SPEED_RESELECT,
                                       DUSTIN_SPEED_RESELECT3, DUSTIN_SPEED_SPARSE, DUSTIN_SPEED_SPARSE_B8,
                                       DUSTIN_SPEED_SPARSE_METHODS, DUSTIN_SPEED_SRH_1GROUP, DUSTIN_TRACE,
                                       DUSTIN_TRACE_SPARSE, E2E, Extractor, GENERATE_AR, INPUT_AWARE_M,
                                       INPUT_AWARE_M_PER_LENGTH, K, M_EVERY_LOOP, M_EVERY_LOOP_METHODS, KERNEL_72B, KERNEL_7B, KERNEL_DEVICE,
                                       KERNEL_DEVICE_UNROLLED, KERNEL_DEVICE_UNROLLED_H100, KERNEL_VARIANTS,
                                       KNAPSPEC_64REF, KNAPSPEC_AFTER_PLAIN_CPU, KNAPSPEC_AFTER_PLAIN_STATES_CPU,
                                       KNAPSPEC_ALPHA, KNAPSPEC_AT_START_CPU, KNAPSPEC_AT_START_QWEN_CPU,
                                       KNAPSPEC_CALIBRATED_CPU, KNAPSPEC_DP_PALLAS, KNAPSPEC_EARLY,
                                       KNAPSPEC_ONE_FINALIST_CAP2_QWEN_CPU, KNAPSPEC_ONE_FINALIST_CPU,
                                       KNAPSPEC_ONE_FINALIST_QWEN_CPU, KNAPSPEC_ONE_FINALIST_UNROLLED_QWEN_CPU,
                                       KNAPSPEC_OWN_STATES_CPU, KNAPSPEC_PALLAS_RUNS, KNAPSPEC_PLAIN_PRICED_CPU,
                                       KNAPSPEC_PLAN_ROWS, KNAPSPEC_PLAN_ROWS_AT_START, KNAPSPEC_PLAN_TRACES,
                                       KNAPSPEC_PREFILL_STATES_CPU, KNAPSPEC_REAL, KNAPSPEC_REAL_BASELINES,
                                       KNAPSPEC_RUNS, KNAPSPEC_TPT_CORRELATION, KNAPSPEC_TPT_CORRELATION_H100,
                                       KNAPSPEC_TPT_CORRELATION_H100_8, KNAPSPEC_TPT_CORRELATION_REPEATS,
                                       KNAPSPEC_TPT_CORRELATION_TARGET, KNAPSPEC_TWO_STAGE, KNAPSPEC_TWO_STAGE_CPU,
                                       MAGICDEC_CPU, M_BOUNDS, M_BOUNDS_3KINDS, M_BOUND_TAGS, M_BOUND_TAGS_3KINDS,
                                       PAIRED_CORRELATION_FIELDS, PAIR_METHODS, PAIR_SPEED,
                                       PAIR_SPEED_ARBITRATE_REPEATS_H100, PAIR_SPEED_CHECK,
                                       PAIR_SPEED_CHOICE_TABLE_B16_REPEATS_H100, PAIR_SPEED_CHOICE_TABLE_OUTCOMES,
                                       PAIR_SPEED_CHOICE_TABLE_REPEATS, PAIR_SPEED_CHOICE_TABLE_REPEATS_H100,
                                       PAIR_SPEED_F32, PAIR_SPEED_H100, PAIR_SPEED_SHARED_GPU, PAIR_TAU, PARITY,
                                       PLAIN_VARIANTS, PLAN_STAGES, QUALITY_GPU_METHODS, QUALITY_GPU_MODEL, REAL_PAIR,
                                       RESELECT_CPU, SELECTION_COST, SELECTION_RULE_TAGS, SELFSPEC_CPU, SELF_DRAFT,
                                       SKIP, SKIP_CMDBUF, SPARSE_DRAFT_KV, SRH_GROUP_QUALITY, SRH_GROUP_SCORING,
                                       TPT_CORRELATION_CONTEXTS, command_of, device_of, m_bounds_3kinds, read_path,
                                       selection_rules_of)
from experiments.tables.kernels import own_kernel_ratio, topk_rows
from experiments.tables.knapspec_plans import chosen_fixed, fixed_cases, plan_stage_names
from experiments.tables.pair_speed import pair_ar_tok_s, pair_cases, pair_run_tag
from experiments.tables.srh_groups import SRH_GROUP_LABEL, scoring_ratio, srh_group_contexts, srh_group_quality


# ---------------------------------------------------------------------------- figures
@dataclasses.dataclass(frozen=True)
class Figure:
    key: str            # hierarchical and stable: what / model or shape / context / batch / ... / quantity
    label: str          # what it is, in words
    unit: str
    source: str         # JSON file under experiments/results/
    get: Extractor      # JSON path, or a function of the loaded JSON
    scale: float = 1.0  # value = read * scale (e.g. 1e-12 for TB/s from B/s)
    target: str = ""    # the paper's number or the target it is held against, if any

    def value(self) -> float:
        data = inputs.load(self.source)
        raw = self.get(data) if callable(self.get) else read_path(data, self.get)
        return float(raw) * self.scale

    def entry(self) -> Dict[str, Any]:
        return {"key": self.key, "value": self.value(), "unit": self.unit, "device": device_of(self.source),
                "command": command_of(self.source), "source": f"experiments/results/{self.source}"}


def _row(variant, k="-"):
    return {"variant": variant, "k": k}


def _kernel(shape, context, batch, variant, field, k="-"):
    return ("cases", f"{shape}/ctx{context}/b{batch}", "rows", _row(variant, k), field)


def _skip_ms(variant, mask):
    return lambda d: read_path(d, ("cases", "qwen2.5-7b-shape/ctx8192/b16/T1", {"variant": variant, "mask": mask},
                                   "ms"))


def _top_kernel_share(name):
    def get(d):
        plane = next(iter(d["cases"]["ctx32768/b16"]["dustin"]["trace"]["planes"].values()))
        total = sum(k["total_s"] for k in plane["top_kernels"] if k["name"] == name)
        return total / plane["busy_s"]
    return get


def _knapspec_case(tag, context, batch, method, field="speedup_vs_ar"):
    return ("cases", f"{tag}/summarize/ctx{context}/b{batch}/{method}", field)


def _fixed_median(*path, prefix="cpu/summarize/ctx1024/b1/fixed/"):
    def get(d):
        values = [read_path(c, path) for c in fixed_cases(d, prefix)]
        values = sorted(v for v in values if v is not None)
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])
    return get


def _alpha_error(d, field="dp_alpha"):
    return max(abs(c[field] - c["acceptance_rate"]) for c in fixed_cases(d))


def _quality(model, context, method, budget, field):
    def get(_):
        rows = quality_rows(quality_cases(model, context))
        return read_path(rows, ({"method": method, "k": budget}, field))
    return get


def _m_rule(budget, field):
    def get(data):
        return read_path(m_rule_rows(data["cases"]), ({"k": budget}, field))
    return get


def _m_per_length(source: str, base: str, budget: int, field: str):
    def get(_):
        return read_path(m_per_length_rows(source, base), ({"k": budget}, field))
    return get


def _figures() -> List[Figure]:
    f: List[Figure] = []
    add = f.append
    # autoregressive decoding vs the bandwidth floor
    for ctx in (8192, 32768):
        row = ("cases", f"qwen2.5-7b-shape/ctx{ctx}/b16", "row")
        add(Figure(f"ar/decode/qwen2.5-7b-shape/ctx{ctx}/b16/fraction-of-floor",
                   f"AR decode, Qwen2.5-7B shape, {ctx // 1024}k, batch 16: bandwidth floor / step time", "fraction",
                   DECODE, row + ("fraction_of_floor",)))
        add(Figure(f"ar/decode/qwen2.5-7b-shape/ctx{ctx}/b16/ms-per-step",
                   f"AR decode step, Qwen2.5-7B shape, {ctx // 1024}k, batch 16", "ms", DECODE,
                   row + ("ms_per_step",)))
    for tag, shape, source in inputs.DECODE_PROJECTIONS:  # separate against fused projections, where measured
        if not (inputs.RESULTS / source).exists():
            continue
        for separate, fused in projection_pairs(source):
            point = f"{shape}/ctx{separate['context']}/b{separate['batch']}/{tag}"
            fused_key = ("cases", f"{shape}/ctx{separate['context']}/b{separate['batch']}/fused", "row")
            add(Figure(f"ar/decode-projections/{point}/fused-over-separate",
                       f"decode step with fused over separate projections, {shape}, {separate['context']} positions, "
                       f"batch {separate['batch']} (one run)", "x", source, fused_key + ("step_vs_separate",)))
            add(Figure(f"ar/decode-projections/{point}/matrix-products-fused",
                       f"matrix products in one compiled decode step, fused projections, {shape}", "products", source,
                       fused_key + ("matrix_products",)))
    add(Figure("ar/copy-bandwidth/h200", "copy bandwidth measured with the decode runs (bytes read + written)",
               "TB/s", DECODE, ("cases", "copy_bandwidth", "bandwidth_Bps"), scale=1e-12))
    add(Figure("ar/decode/smollm2-135m/ctx6.6k/b16/tokens-per-s", "AR decode, real SmolLM2-135M, 6.6k prompt, batch 16",
               "tokens/s", GENERATE_AR, ("results", "tokens_per_s")))
    # parity
    for (model, dev), source in PARITY.items():
        add(Figure(f"parity/{model}/{dev}/max-rel-err", f"parity with transformers (float32), {model}, {dev}",
                   "relative error", source, ("results", "max_rel_err"), target="tolerance 1e-4"))
    # attention kernels
    for shape, source in (("qwen2.5-7b", KERNEL_7B), ("qwen2.5-72b", KERNEL_72B)):
        add(Figure(f"kernels/dense-attention/{shape}/ctx32768/b16/bandwidth",
                   f"dense decode attention (Pallas), {shape} layer, 32k, batch 16", "TB/s", source,
                   _kernel(shape, 32768, 16, "ours_dense", "TBps"), target="target >= 3.0 TB/s"))
        add(Figure(f"kernels/sparse-attention/{shape}/ctx32768/b16/k512/speedup-vs-dense",
                   f"sparse attention k = 512 vs the fastest dense, {shape} layer, 32k, batch 16", "x", source,
                   _kernel(shape, 32768, 16, "ours_sparse", "speedup_vs_fastest_dense", 512),
                   target="target >= 28x"))
        add(Figure(f"kernels/selection/{shape}/ctx32768/b16/k512/share-of-dense-verification",
                   f"SRH scoring (4 KV groups) + exact top-k, share of a dense verification step, {shape}, 32k, b16",
                   "%", source, _kernel(shape, 32768, 16, "selection_4groups", "fraction_of_dense_verification", 512),
                   scale=100, target="target <= 1 %"))
    if (inputs.RESULTS / KERNEL_DEVICE).exists():
        for shape, (short, target) in DEVICE_TARGETS.items():
            add(Figure(f"kernels/{short}/ctx32768/b16/k512/attention_speedup_device",
                       f"sparse (k = 512) vs the fastest dense attention of all layers by device kernel time, {shape}, "
                       "32k, batch 16", "x", KERNEL_DEVICE, ("cases", f"{shape}/ctx32768/b16/k512", "speedup_device"),
                       target=f"target >= {target:.0f}x" + (" (paper 27.85x)" if short == "72b" else "")))
            case_key = f"{shape}/ctx32768/b16/k512"
            if case_key not in inputs.load(KERNEL_DEVICE)["cases"] or own_kernel_ratio(
                    inputs.load(KERNEL_DEVICE)["cases"][case_key]) is None:
                continue
            if (inputs.RESULTS / KERNEL_DEVICE_UNROLLED).exists() and case_key in inputs.load(KERNEL_DEVICE_UNROLLED)["cases"]:
                add(Figure(f"kernels/{short}/ctx32768/b16/k512/attention_speedup_device_unrolled",
                           f"sparse (k = 512) vs the fastest dense attention of all layers by device kernel time, one "
                           f"call per layer on inputs of its own, {shape}, 32k, batch 16", "x", KERNEL_DEVICE_UNROLLED,
                           ("cases", case_key, "speedup_device"), target=f"target >= {target:.0f}x"))
            if (inputs.RESULTS / KERNEL_DEVICE_UNROLLED_H100).exists() and case_key in inputs.load(KERNEL_DEVICE_UNROLLED_H100)["cases"]:
                add(Figure(f"kernels/{short}/ctx32768/b16/k512/attention_speedup_device_unrolled_h100",
                           f"sparse (k = 512) vs the fastest dense attention of all layers by device kernel time, one "
                           f"call per layer on inputs of its own, {shape}, 32k, batch 16, on an H100", "x",
                           KERNEL_DEVICE_UNROLLED_H100, ("cases", case_key, "speedup_device"),
                           target=f"target >= {target:.0f}x on the H200"))
            add(Figure(f"kernels/{short}/ctx32768/b16/k512/attention_kernel_only_speedup_device",
                       f"jaxspec's sparse attention kernel (k = 512) vs its dense kernel alone, all layers by device "
                       f"kernel time, {shape}, 32k, batch 16 (the call's other kernels left out)", "x", KERNEL_DEVICE,
                       lambda d, key=case_key: own_kernel_ratio(d["cases"][key])))
    if (inputs.RESULTS / inputs.KERNEL_TOPK_H100).exists():  # the exact top-k variants at 32k on the H100
        for batch in topk_rows(inputs.load(inputs.KERNEL_TOPK_H100)):
            for variant, label in inputs.TOPK_VARIANTS:
                add(Figure(f"kernels/topk/qwen2.5-7b/ctx32768/b{batch}/k512/{variant.replace('_', '-')}/h100",
                           f"exact top-k of 32k positions, {label}, batch {batch}, on an H100", "µs",
                           inputs.KERNEL_TOPK_H100, lambda d, b=batch, v=variant: topk_rows(d)[b][v]))
    for batch in (1, 16):
        add(Figure(f"kernels/sparse-attention/qwen2.5-7b/ctx32768/b{batch}/k512/time",
                   f"sparse attention k = 512, 7B layer, 32k, batch {batch}", "µs", KERNEL_7B,
                   _kernel("qwen2.5-7b", 32768, batch, "ours_sparse", "us", 512)))
    for name, case, label in (("harness-null", "null", "the timing harness alone (null function)"),
                              ("sparse-kernel-without-merge", "sparse_c64_p1_w4_nomerge",
                               "the sparse kernel without the partial merge"),
                              ("layer-sparse-unfused", "layer_sparse_unfused",
                               "sparse layer: kernel + XLA merge + new-token part"),
                              ("layer-sparse-fused", "layer_sparse_fused", "sparse layer: one fused launch"),
                              ("topk-radix4-compare", "topk_radix4_compare", "exact top-k, 4-bit compare radix"),
                              ("topk-pallas-one-kernel", "topk_radix4_pallas", "exact top-k, one Pallas kernel"),
                              ("topk-lax", "topk_lax", "lax.top_k")):
        add(Figure(f"kernels/variants/qwen2.5-7b/ctx32768/b16/k512/{name}", f"{label}, 7B layer, 32k, b16, k = 512",
                   "µs", KERNEL_VARIANTS, ("cases", f"qwen2.5-7b/{case}", "unrolled_us")))
    # speculative engine
    add(Figure("speculative/self-draft/smollm2-135m/ctx767/b16/h200/speedup-vs-ar",
               "SmolLM2-135M self-draft (attn:8-12, gamma 4), 767-token prompt, batch 16, vs AR", "x AR", SELF_DRAFT,
               ("results", "speedup_vs_ar")))
    add(Figure("speculative/self-draft/smollm2-135m/ctx767/b16/h200/tau", "its tau (tokens per round, of 5)",
               "tokens/round", SELF_DRAFT, ("results", "metrics", "tau")))
    for ctx, batch in ((32768, 16), (8192, 8)):
        row = ("cases", f"ctx{ctx}/b{batch}", "row")
        add(Figure(f"speculative/fixed-tau/qwen2.5-7b-shape/ctx{ctx}/b{batch}/speedup-vs-ar",
                   f"7B/0.5B shapes, fixed acceptance (tau 4.0), {ctx // 1024}k, batch {batch}", "x AR", BENCH_SD,
                   row + ("speedup",)))
        add(Figure(f"speculative/fixed-tau/qwen2.5-7b-shape/ctx{ctx}/b{batch}/roofline-speedup",
                   "its bytes-roofline speed-up", "x AR", BENCH_SD, row + ("roofline_speedup",)))
    add(Figure("speculative/skip-mask/qwen2.5-7b-shape/ctx8192/b16/no-mask", "7B forward, no skip-mask argument",
               "ms", SKIP, _skip_ms("no mask argument", "-")))
    add(Figure("speculative/skip-mask/qwen2.5-7b-shape/ctx8192/b16/dynamic-keep-all",
               "7B forward, dynamic skip mask (lax.cond), nothing skipped", "ms", SKIP,
               _skip_ms("dynamic (lax.cond)", "no_skip")))
    add(Figure("speculative/skip-mask/qwen2.5-7b-shape/ctx8192/b16/device-conditionals/dynamic-keep-all",
               "the same with device-side conditionals (command buffers)", "ms", SKIP_CMDBUF,
               _skip_ms("dynamic (lax.cond)", "no_skip")))
    for tag, (source, _) in inputs.BENCH_PLAIN.items():
        if not (inputs.RESULTS / source).exists():
            continue
        for case in inputs.load(source)["cases"]:
            batch = case.split("/b")[1].split("/")[0]
            for variant, what in PLAIN_VARIANTS[1:]:
                add(Figure(f"speculative/plain-stretch/qwen2.5-1.5b-shape/ctx32000/b{batch}/{tag}/{variant}/step-over-ar",
                           f"{what} vs the AR loop, per step beyond the per-call cost, 1.5B shape, 32k, batch {batch}",
                           "x AR step", source, ("cases", case, {"variant": variant}, "step_over_ar")))
    # Dustin speed
    add(Figure("dustin/acceptance/qwen2.5-coder-1.5b+qwen2.5-coder-0.5b/ctx2k/b1/cpu/tau",
               "tau of the real Qwen2.5-Coder 1.5B + 0.5B pair, gamma 4, 2k-token prompt", "tokens/round", PAIR_TAU,
               ("results", "metrics", "tau")))
    for batch, source in DUSTIN_SPEED.items():
        for ctx in (32768, 16384, 8192):
            add(Figure(f"dustin/speed/qwen2.5-7b-shape/ctx{ctx}/b{batch}/speedup-vs-ar",
                       f"Dustin k = 512, 7B/0.5B shapes, Qwen pair's tau, {ctx // 1024}k, batch {batch}", "x AR",
                       source, dustin(ctx, batch, "dustin", "speedup"),
                       target="paper 2.33x" if (ctx, batch) == (32768, 16) else ""))
    for ctx in (32768, 16384, 8192):
        for method, label in (("ar", "AR"), ("classic", "ClassicSD"), ("magicdec", "MagicDec"), ("dustin", "Dustin-H")):
            what = f"7B/0.5B shapes, {ctx // 1024}k, batch 16, k = 512, its own tau from the real pair: {label}"
            if method == "ar":
                add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b16/ar/tok_s", what, "tokens/s", DUSTIN_SPEED_PAIR_TAU,
                           dustin(ctx, 16, "ar", "tok_s")))
                continue
            add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b16/{method}/speedup", what, "x AR", DUSTIN_SPEED_PAIR_TAU,
                       dustin(ctx, 16, method, "speedup"),
                       target="paper 2.33x" if (method, ctx) == ("dustin", 32768) else ""))
            add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b16/{method}/fixed-tau", f"{what}, the tau it ran with",
                       "tokens/round", DUSTIN_SPEED_PAIR_TAU, dustin(ctx, 16, method, "fixed_tau")))
    for source, method in ((DUSTIN_SPEED_PAIR_TAU, "dustin"), (DUSTIN_SPEED_SPARSE, "dustin-kv-streaming")):
        add(Figure(f"dustin-speed/7b-shape/ctx32768/b16/{method}/selection-share-of-round",
                   f"selection / round time (batch x realised tau / tokens per second), {method}, the real pair's "
                   "tau", "%", source, functools.partial(selection_share, method=method), scale=100,
                   target="target <= 3 %"))
    for key, sparse_case in inputs.load(DUSTIN_SPEED_SPARSE)["cases"].items():
        if key == "copy_bandwidth":
            continue
        ctx = int(key.split("/")[0][3:])
        for method, label in DUSTIN_SPEED_SPARSE_METHODS:
            # AR and full-KV Dustin-H come from the pair-tau run above; this run adds the sparse draft
            if method in ("ar", "dustin") or not any(r["method"] == method for r in sparse_case["rows"]):
                continue
            what = (f"7B/0.5B shapes, {ctx // 1024}k, batch 16, k = 512, the real pair's tau for this method: {label}"
                    " (AR in the same process)")
            target = {32768: "target >= 3.0x", 16384: "target >= 2.0x"}.get(ctx, "")
            add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b16/{method}/speedup", what, "x AR", DUSTIN_SPEED_SPARSE,
                       dustin(ctx, 16, method, "speedup"), target=target))
            add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b16/{method}/fixed-tau", f"{what}, the tau it ran with",
                       "tokens/round", DUSTIN_SPEED_SPARSE, dustin(ctx, 16, method, "fixed_tau")))
    def speculative_rows(source):
        """(context, row) of each speculative method in a dustin-speed file (AR is the baseline)."""
        if not (inputs.RESULTS / source).exists():
            return
        for key, case in inputs.load(source)["cases"].items():
            if key == "copy_bandwidth" or "rows" not in case:
                continue
            yield from ((int(key.split("/")[0][3:]), r) for r in case["rows"] if r["method"] != "ar")

    for ctx, r in speculative_rows(DUSTIN_SPEED_FINISHED):  # the current default: finished rows read one slot
        what = (f"7B/0.5B shapes, {ctx // 1024}k, batch 16, k = 512, the real pair's tau: {r['method']} with "
                "finished rows reading one cache slot (AR in the same process)")
        add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b16/{r['method']}/finished-rows-skipped/speedup", what,
                   "x AR", DUSTIN_SPEED_FINISHED, dustin(ctx, 16, r["method"], "speedup")))
    for ctx, r in speculative_rows(DUSTIN_SPEED_FINISHED_KEPT):  # the same, finished rows reading their history
        what = (f"7B/0.5B shapes, {ctx // 1024}k, batch 16, k = 512, the real pair's tau: {r['method']} with "
                "finished rows reading their whole history, --keep-finished-rows (AR in the same process)")
        add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b16/{r['method']}/finished-rows-kept/speedup", what,
                   "x AR", DUSTIN_SPEED_FINISHED_KEPT, dustin(ctx, 16, r["method"], "speedup")))
    b8_labels = dict((("classic", "ClassicSD"), ("magicdec", "MagicDec")) + DUSTIN_SPEED_SPARSE_METHODS)
    for ctx, r in speculative_rows(DUSTIN_SPEED_SPARSE_B8):
        what = (f"7B/0.5B shapes, {ctx // 1024}k, batch 8, k = 512, the real pair's tau for this method "
                f"(batch 8): {b8_labels.get(r['method'], r['method'])} (AR in the same process)")
        add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b8/{r['method']}/speedup", what, "x AR",
                   DUSTIN_SPEED_SPARSE_B8, dustin(ctx, 8, r["method"], "speedup")))
        add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b8/{r['method']}/fixed-tau", f"{what}, the tau it ran with",
                   "tokens/round", DUSTIN_SPEED_SPARSE_B8, dustin(ctx, 8, r["method"], "fixed_tau")))
    src = DUSTIN_SPEED[16]
    for method in ("classic", "magicdec"):
        add(Figure(f"dustin/speed/qwen2.5-7b-shape/ctx32768/b16/{method}/speedup-vs-ar",
                   f"{'ClassicSD' if method == 'classic' else 'MagicDec'}, same point", "x AR", src,
                   dustin(32768, 16, method, "speedup")))
    add(Figure("dustin/speed/qwen2.5-7b-shape/ctx32768/b16/roofline-speedup", "Dustin's bytes roofline at this tau",
               "x AR", src, dustin(32768, 16, "dustin", "roofline_speedup")))
    add(Figure("dustin/speed/qwen2.5-7b-shape/ctx32768/b16/tau", "tau realised by the fixed acceptance",
               "tokens/round", src, dustin(32768, 16, "dustin", "tau")))
    add(Figure("dustin/speed/qwen2.5-7b-shape/ctx32768/b16/attention-speedup",
               "verification attention (28 layers), dense / sparse", "x", src,
               dustin(32768, 16, "dustin", "attn_speedup")))
    add(Figure("dustin/speed/qwen2.5-7b-shape/ctx32768/b16/selection-ms-per-round", "selection, one round", "ms",
               src, dustin(32768, 16, "dustin", "selection_ms")))
    add(Figure("dustin/speed/qwen2.5-7b-shape/ctx32768/b16/selection-share-of-dense-attention",
               "selection as a share of one verification's dense attention", "%", src,
               lambda d: read_path(d, dustin(32768, 16, "dustin", "selection_ms"))
               / read_path(d, dustin(32768, 16, "dustin", "attn_dense_ms")), scale=100, target="target <= 1 %"))
    add(Figure("dustin/trace/qwen2.5-7b-shape/ctx32768/b16/draft-dense-attention-share-of-busy",
               "traced Dustin run: the draft's dense attention, share of device busy time", "%", DUSTIN_TRACE,
               _top_kernel_share("jaxspec_dense_history_attention"), scale=100))
    add(Figure("dustin/trace/qwen2.5-7b-shape/ctx32768/b16/target-sparse-attention-share-of-busy",
               "traced Dustin run: the target's sparse attention, share of device busy time", "%", DUSTIN_TRACE,
               _top_kernel_share("jaxspec_sparse_history_attention"), scale=100))
    def traced(method, what):
        def get(d):
            t = traced_rounds(d)[method]
            return {"launches": t["launches_per_round"], "busy": t["plane"]["busy_s"] / t["plane"]["span_s"],
                    "floor": t["over_floor"], "busy_ms": t["busy_ms_per_round"], "speedup": t["speedup"]}[what]
        return get

    if (inputs.RESULTS / DUSTIN_TRACE_SPARSE).exists():
        for method in ("dustin", "dustin-kv-streaming"):
            base = f"dustin/trace/qwen2.5-7b-shape/ctx32768/b16/{method}"
            add(Figure(f"{base}/launches-per-round", f"traced {method} run at the real pair's tau: kernel launches "
                       "per round (64 / tau rounds)", "launches", DUSTIN_TRACE_SPARSE, traced(method, "launches")))
            add(Figure(f"{base}/device-busy-share", f"traced {method} run: device busy / span", "%",
                       DUSTIN_TRACE_SPARSE, traced(method, "busy"), scale=100))
            add(Figure(f"{base}/busy-over-bytes-floor", f"traced {method} run: device busy time / the run's bytes at "
                       "the measured copy bandwidth", "x", DUSTIN_TRACE_SPARSE, traced(method, "floor")))
    for tag, runs in inputs.DUSTIN_TRACE_FUSED:  # the round per projection layout, where measured
        for slug, label, source in runs[1:]:
            if not (inputs.RESULTS / source).exists():
                continue
            for method in ("dustin", "dustin-kv-streaming"):
                base = f"dustin/trace/qwen2.5-7b-shape/ctx32768/b16/{method}/{slug}/{tag}"
                add(Figure(f"{base}/launches-per-round", f"traced {method} run, {label}: kernel launches per round",
                           "launches", source, traced(method, "launches")))
                add(Figure(f"{base}/device-busy-ms-per-round", f"traced {method} run, {label}: device-busy ms per "
                           "round", "ms", source, traced(method, "busy_ms")))
                add(Figure(f"{base}/speedup", f"traced {method} run, {label}, against its own AR", "x AR", source,
                           traced(method, "speedup")))
    for tag, slug, heads, source in inputs.DUSTIN_TRACE_PHASES:  # the round split by phase, where traced
        if not (inputs.RESULTS / source).exists():
            continue
        for method in ("dustin", "dustin-kv-streaming"):
            if not traced_phases(inputs.load(source), method):
                continue
            base = f"dustin/trace/qwen2.5-7b-shape/ctx32768/b16/{method}/{slug + '/' if slug else ''}phases/{tag}"
            what = f"traced {method} run at the real pair's tau, {heads}, the round split by phase"
            add(Figure(f"{base}/selection-ms-per-round", f"{what}: the selection's device-busy ms per round", "ms",
                       source, lambda d, m=method: phase_selection(d, m)["selection_ms"]))
            add(Figure(f"{base}/selection-share-of-round", f"{what}: selection device-busy / the timed round", "%",
                       source, lambda d, m=method: phase_selection(d, m)["share_of_round"], scale=100,
                       target="target <= 3 %"))
            add(Figure(f"{base}/selection-share-of-busy", f"{what}: selection / all device-busy time", "%", source,
                       lambda d, m=method: phase_selection(d, m)["share_of_busy"], scale=100))
            phase_bytes = inputs.load(source)["cases"]["ctx32768/b16"][method].get("phase_bytes", {})
            for phase in ("draft", "verification", "selection"):
                if phase in phase_bytes:
                    add(Figure(f"{base}/{phase}-over-bytes-floor", f"{what}: {phase} device-busy per round / its "
                               "bytes at the copy bandwidth measured in the run", "x", source,
                               lambda d, m=method, p=phase: phase_over_floor(d, m, p),
                               target="draft step within 2x" if phase == "draft" else ""))
    add(Figure("dustin/speed/qwen2.5-7b-shape/ctx32768/b16/smollm2-tau/speedup-vs-ar",
               "Dustin at the same point with SmolLM2's tau", "x AR", DUSTIN_SMOLLM2_TAU,
               dustin(32768, 16, "dustin", "speedup")))
    for (method, backend), source in E2E.items():
        slug = method.split()[0].lower()
        add(Figure(f"dustin/end-to-end/smollm2-135m/ctx7.6k/b16/{slug}-{backend.lower()}/speedup-vs-ar",
                   f"real SmolLM2-135M, 7.6k prompt, batch 16: {method}, {backend} attention", "x AR", source,
                   ("results", "speedup_vs_ar")))
    measured = set()  # (key, method) already in the index: a second run's repeats go under its own name
    selfspec_seen = set()
    for source in PAIR_SPEED + PAIR_SPEED_H100:
        dtype, gamma = inputs.load(source)["config"]["dtype"], int(inputs.load(source)["config"].get("gamma", 4))
        dev = "h100" if source.endswith("_h100.json") else "h200"
        for key, case in pair_cases(source):
            what = (f"real Qwen2.5-Coder pair (pair-speed){' on an H100' if dev == 'h100' else ''}, "
                    f"{case['context'] // 1000}k, batch {case['batch']}, {dtype}, Pallas"
                    + (", shared GPU (provisional)" if pathlib.Path(source).name in PAIR_SPEED_SHARED_GPU else ""))

            def base_of(method):
                base = f"real-pair/{dev}/{key}"
                return f"{base}/{pair_run_tag(source)}-run" if (dev, key, method) in measured else base

            add(Figure(f"{base_of('ar')}/ar/tok_s", f"{what}: AR, mean of its paired runs", "tokens/s", source,
                       pair_ar_tok_s(key)))
            measured.add((dev, key, "ar"))
            for method, label in PAIR_METHODS:
                if method not in case:
                    continue
                name, base = label.strip("*"), base_of(method)
                measured.add((dev, key, method))
                target = ""
                if key == "ctx32000/b16" and base.endswith(key):
                    target = ("target > ClassicSD and MagicDec" if method == "dustin" else "target >= 2.0x"
                              if method.startswith("dustin-kv-") else "")
                add(Figure(f"{base}/{method}/speedup", f"{what}: {name} vs its paired AR", "x AR", source,
                           ("cases", key, method, "speedup_vs_ar"), target=target))
                add(Figure(f"{base}/{method}/tok_s", f"{what}: {name} tokens/s", "tokens/s", source,
                           ("cases", key, method, "tok_s")))
                add(Figure(f"{base}/{method}/tau", f"{what}: {name} tau (tokens per row-round, of {gamma + 1})",
                           "tokens/round", source, ("cases", key, method, "metrics", "tau")))
                # self-speculation: the first run of each method and gamma (command-buffer runs stay under their tag)
                slug = method if gamma == 4 else f"{method}-gamma{gamma}"
                if (method in ("magicdec-self", "dustin-self") and "cmdbuf" not in pair_run_tag(source)
                        and (key, slug) not in selfspec_seen):
                    selfspec_seen.add((key, slug))
                    add(Figure(f"selfspec/real-qwen1.5b/{dev}/{key}/{slug}/speedup",
                               f"{name} vs paired AR, real Qwen2.5-Coder-1.5B bf16, {case['context']} tokens, batch "
                               f"{case['batch']}, gamma {gamma} (pair-speed)", "x AR", source, ("cases", key, method, "speedup_vs_ar"),
                               target="target >= 2.0x (best self-speculative) at 32k/b16"
                               if key == "ctx32000/b16" else ""))
    for source, slug, how in ((PAIR_SPEED_CHOICE_TABLE_OUTCOMES, "choice-table", "whole run vs its paired AR"),
                              (PAIR_SPEED_CHOICE_TABLE_REPEATS, "choice-table-repeats",
                               "the median of 3 (AR, method) pairs")):
        if not (inputs.RESULTS / source).exists():
            continue
        for key, case in pair_cases(source):
            for method, label in PAIR_METHODS:
                if isinstance(case.get(method), dict) and "speedup_vs_ar" in case[method]:
                    add(Figure(f"real-pair/h200/{key}/{method}/{slug}/speedup",
                               f"real Qwen2.5-Coder pair, {case['context'] // 1000}k, batch {case['batch']}, bf16: "
                               f"{label.strip('*')} deciding from the choice table (tail-checked), {how}", "x AR",
                               source, ("cases", key, method, "speedup_vs_ar"),
                               target="never slower than AR with the choice on"))
    for source, slug, how in ((PAIR_SPEED_ARBITRATE_REPEATS_H100, "arbitrate-repeats",
                               "under the measured choice (probed, tail-checked)"),
                              (PAIR_SPEED_CHOICE_TABLE_REPEATS_H100, "choice-table-repeats",
                               "deciding from this GPU's choice table (tail-checked)"),
                              (PAIR_SPEED_CHOICE_TABLE_B16_REPEATS_H100, "choice-table-repeats",
                               "deciding from this GPU's choice table with its batch-16 runs (tail-checked)")):
        if not (inputs.RESULTS / source).exists():
            continue
        for key, case in pair_cases(source):
            for method, label in PAIR_METHODS:
                if isinstance(case.get(method), dict) and "speedup_vs_ar" in case[method]:
                    add(Figure(f"real-pair/h100/{key}/{method}/{slug}/speedup",
                               f"real Qwen2.5-Coder pair on an H100, {case['context'] // 1000}k, batch {case['batch']}, "
                               f"bf16: {label.strip('*')} {how}, the median of 3 (AR, method) pairs", "x AR", source,
                               ("cases", key, method, "speedup_vs_ar"), target="never slower than AR with the choice on"))
    for key, case in pair_cases(PAIR_SPEED_F32):
        for method, label in PAIR_METHODS:
            if method in case:
                add(Figure(f"real-pair/h200/{key}/f32/{method}/identical",
                           f"real Qwen2.5-Coder pair, float32, {case['context'] // 1000}k, batch {case['batch']}: "
                           f"{label.strip('*')} greedy output identical to AR's", "1 = identical", PAIR_SPEED_F32,
                           ("cases", key, method, "agreement_with_ar", "identical"),
                           target="must hold (dense verification)"))
    check = inputs.load(PAIR_SPEED_CHECK)["cases"]["backend_check"]
    add(Figure("real-pair/h200/pallas-vs-xla/max-abs-logit-diff",
               f"Qwen2.5-Coder-1.5B logits over {check['tokens']} tokens, Pallas vs XLA attention: max |difference|",
               "logit", PAIR_SPEED_CHECK, ("cases", "backend_check", "max_abs_logit_diff"),
               target=check["tolerance"].replace("|", "\\|")))
    for slug, label, source in REAL_PAIR:
        key = f"dustin/real-pair/qwen2.5-coder-1.5b+qwen2.5-coder-0.5b/ctx8k/b1/h200/{slug}"
        add(Figure(f"{key}/speedup-vs-ar", f"real Qwen2.5-Coder pair, 8k prompt, batch 1, bf16, XLA attention: {label}",
                   "x AR", source, ("results", "speedup_vs_ar")))
        add(Figure(f"{key}/tau", f"its tau (tokens per round, of 5): {label}", "tokens/round", source,
                   ("results", "metrics", "tau")))
        add(Figure(f"{key}/tokens-per-s", f"its tokens/s: {label}", "tokens/s", source, ("results", "tokens_per_s")))
    for slug, label, source in SELFSPEC_CPU:
        key = f"selfspec/smollm2-135m/cpu/ctx767/b1/{slug}"
        add(Figure(f"{key}/speedup", f"self-speculation, SmolLM2-135M f32, 2-core CPU, 767 + 128 tokens: {label}",
                   "x AR", source, ("results", "speedup_vs_ar")))
        add(Figure(f"{key}/tau", f"its tau: {label}", "tokens/round", source, ("results", "metrics", "tau")))
        if "plan_fraction" in inputs.load(source)["results"]["timings"]:
            add(Figure(f"{key}/planning-share", f"planning time / decode time: {label}", "fraction", source,
                       ("results", "timings", "plan_fraction")))
    for g in (1, 2, 3, 4):
        source = f"demo/demo_smollm2-135m_prompt-lookup_767_b1_gamma{g}_cpu.json"
        if (inputs.RESULTS / source).exists():
            add(Figure(f"demo/smollm2-135m/ctx767/b1/cpu/prompt-lookup/gamma{g}/speedup-vs-ar",
                       f"the demo at gamma {g}: prompt lookup vs AR, SmolLM2-135M f32, 2-core CPU", "x AR", source,
                       ("results", "speedup_vs_ar")))
        source = f"demo/demo_smollm2-135m_prompt-lookup_767_b1_gamma{g}_full-verify_cpu.json"
        if (inputs.RESULTS / source).exists():
            add(Figure(f"demo/smollm2-135m/ctx767/b1/cpu/prompt-lookup/gamma{g}/full-verify/speedup-vs-ar",
                       f"the demo at gamma {g}, every round verifying gamma + 1 rows (--full-verify): prompt lookup "
                       "vs AR, SmolLM2-135M f32, 2-core CPU", "x AR", source, ("results", "speedup_vs_ar")))
    for run in ("first-run", "second-run"):
        source = f"demo/demo_smollm2-135m_prompt-lookup_767_b1_{run}_cpu.json"
        key = f"demo/smollm2-135m/ctx767/b1/cpu/prompt-lookup/{run}"
        add(Figure(f"{key}/speedup-vs-ar", f"the demo ({run}): prompt lookup vs AR, SmolLM2-135M f32, 2-core CPU",
                   "x AR", source, ("results", "speedup_vs_ar")))
        add(Figure(f"{key}/ar-tokens-per-s", f"the demo ({run}): plain autoregressive decoding", "tokens/s", source,
                   ("results", "ar_tokens_per_s")))
        add(Figure(f"{key}/time-to-first-token", f"the demo ({run}): time to the first token (compile + prefill)",
                   "s", source, ("results", "demo", "time_to_first_token_s")))
        add(Figure(f"{key}/programs-compiled", f"the demo ({run}): programs compiled (the rest load from the cache)",
                   "programs", source, ("results", "demo", "compiles", "cache_misses")))
    for slug, label, source in SPARSE_DRAFT_KV:
        key = f"dustin/sparse-draft-kv/qwen2.5-coder-1.5b+qwen2.5-coder-0.5b/ctx2k/b1/cpu/{slug}"
        add(Figure(f"{key}/tau", f"real Qwen2.5-Coder pair, 2k prompt, batch 1, CPU float32: {label}, tau (of 5)",
                   "tokens/round", source, ("results", "metrics", "tau")))
        add(Figure(f"{key}/acceptance-rate", f"its acceptance rate (accepted / drafted): {label}", "fraction", source,
                   ("results", "metrics", "acceptance_rate")))
        # no speed-up figure: these runs timed their compiles on a shared CPU (docs/results.md says so)
    key = "dustin/sparse-draft-kv/qwen2.5-coder-1.5b+qwen2.5-coder-0.5b/ctx2k/b1/cpu/dustin-full-kv-reselect-2"
    what = "Dustin-H k = 512, full draft KV, I_verify selected every second round (methods.md §3.8)"
    add(Figure(f"{key}/tau", f"real Qwen2.5-Coder pair, 2k prompt, batch 1, CPU float32: {what}, tau (of 5)",
               "tokens/round", RESELECT_CPU, ("results", "metrics", "tau")))
    add(Figure(f"{key}/acceptance-rate", f"its acceptance rate (accepted / drafted): {what}", "fraction",
               RESELECT_CPU, ("results", "metrics", "acceptance_rate")))
    base = "dustin/sparse-draft-kv/qwen2.5-coder-1.5b+qwen2.5-coder-0.5b/ctx2k/b1/cpu"
    if (inputs.RESULTS / MAGICDEC_CPU).exists():
        what = "MagicDec k = 512 (the 0.5B over 4 sinks + 508, dense verification)"
        for field, unit, path in (("tau", "tokens/round", ("results", "metrics", "tau")),
                                  ("acceptance-rate", "fraction", ("results", "metrics", "acceptance_rate")),
                                  ("speedup", "x AR", ("results", "speedup_vs_ar"))):
            add(Figure(f"{base}/magicdec/{field}", f"real Qwen2.5-Coder pair, 2k prompt, batch 1, CPU float32: "
                       f"{what}, {field} (AR in the same process)", unit, MAGICDEC_CPU, path))
    if (inputs.RESULTS / ARBITRATE_CPU).exists():
        add(Figure(f"{base}/dustin-verify-set-kv-arbitrate-8/speedup", "real Qwen2.5-Coder pair, 2k prompt, batch "
                   "1, CPU float32: Dustin-H verify-set draft KV under the measured choice (8 probe rounds), whole "
                   "run vs AR in the same process", "x AR", ARBITRATE_CPU, ("results", "speedup_vs_ar"),
                   target="never slower than AR with the choice on"))
    # Dustin quality
    for model, ctx in (("qwen2.5-coder-1.5b", 2048), ("qwen2.5-coder-1.5b", 4096), ("qwen2.5-coder-1.5b", 8192),
                       ("qwen2.5-coder-1.5b", 16384), ("smollm2-135m", 2048), ("smollm2-135m", 8192)):
        source = quality_source(model, ctx)
        for method in ("dustin-h", "quest"):
            for budget in (512, 1024):
                add(Figure(f"dustin/quality/{model}/ctx{ctx}/k{budget}/{method}/arr",
                           f"ARR, {method}, {model}, {ctx // 1024}k items, k = {budget}", "fraction", source,
                           _quality(model, ctx, method, budget, "ARR")))
        add(Figure(f"dustin/quality/{model}/ctx{ctx}/k512/dustin-h/retrieval-accuracy",
                   f"retrieval accuracy, dustin-h, {model}, {ctx // 1024}k items, k = 512", "fraction", source,
                   _quality(model, ctx, "dustin-h", 512, "accuracy")))
    for ctx in gpu_quality_contexts():
        sources = quality_sources(QUALITY_GPU_MODEL, ctx)
        base, n = f"real-pair/h200/ctx{ctx}", quality_items(QUALITY_GPU_MODEL, ctx)
        what = f"real Qwen2.5-Coder pair, H200 float32, {ctx // 1000}k items ({n[0]} of {n[1]})"
        add(Figure(f"{base}/dense/accuracy", f"{what}: dense verification (ClassicSD), retrieval accuracy",
                   "fraction", sources[0], _quality(QUALITY_GPU_MODEL, ctx, DENSE, "-", "accuracy")))
        for source in sources:
            for method in QUALITY_GPU_METHODS:
                for budget in quality_budgets(source):
                    for tag, field, unit in (("arr", "ARR", "fraction"), ("agreement", "match", "fraction"),
                                             ("accuracy", "accuracy", "fraction")):
                        target = ("target >= 0.95" if tag == "agreement" else "target >= 97 % of dense"
                                  if tag == "accuracy" else "") if (method, budget) == ("dustin-h", 512) else ""
                        add(Figure(f"{base}/{method}/k{budget}/{tag}",
                                   f"{what}: {method}, k = {budget}, "
                                   + {"arr": "ARR", "agreement": "greedy token match with dense verification",
                                      "accuracy": "retrieval accuracy"}[tag], unit, source,
                                   _quality(QUALITY_GPU_MODEL, ctx, method, budget, field), target=target))
    # Dustin input-aware m
    for model, source in INPUT_AWARE_M:
        for row in m_rule_rows(inputs.load(source)["cases"]):
            ctx = {c["context"] for c in inputs.load(source)["cases"].values() if "context" in c}.pop()
            base = f"dustin/input-aware-m/{model}/ctx{ctx}/k{row['k']}"
            steps = inputs.load(source).get("config", {}).get("m_steps", 1) or 1
            cov = "input-aware-coverage" + (f"-ladder{steps}" if steps != 1 else "")  # --m-steps: its own keys
            for tag, field in (("fixed", "fixed"), ("input-aware", "max_mass"), (cov, "coverage"),
                               ("input-aware-entropy", "entropy"), ("input-aware-coverage-held", "coverage_held"),
                               ("oracle", "oracle")):
                if row.get(f"arr_{field}") is None or any(x.key == f"{base}/{tag}/arr" for x in f):  # fixed, oracle: once
                    continue
                add(Figure(f"{base}/{tag}/arr", f"ARR, Dustin-H {tag} m, {model}, {ctx // 1024}k, k = {row['k']}",
                           "fraction", source, _m_rule(row["k"], f"arr_{field}")))
                add(Figure(f"{base}/{tag}/agreement", f"token match with dense, Dustin-H {tag} m, k = {row['k']}",
                           "fraction", source, _m_rule(row["k"], f"match_{field}")))
            for tag, field in (("input-aware", "max_mass"), (cov, "coverage"), ("input-aware-entropy", "entropy"),
                               ("input-aware-coverage-held", "coverage_held")):
                if row.get(f"gap_closed_{field}") is None or row.get(f"selection_ratio_{field}") is None:
                    continue
                add(Figure(f"{base}/{tag}/gap-closed", f"share of the fixed-to-oracle ARR gap closed, {tag}, "
                           f"k = {row['k']}", "%", source, _m_rule(row["k"], f"gap_closed_{field}"), scale=100,
                           target="target >= 33 % (mean over k)"))
                add(Figure(f"{base}/{tag}/selection-cost-vs-fixed", f"selection time per round / fixed m's, {tag}, "
                           f"k = {row['k']}", "x", source, _m_rule(row["k"], f"selection_ratio_{field}"),
                           target="target <= 1.1"))
    for model, source, base, _ in INPUT_AWARE_M_PER_LENGTH:
        ctx = {c["context"] for c in inputs.load(source)["cases"].values() if "context" in c}.pop()
        for row in m_per_length_rows(source, base):
            where = f"dustin/input-aware-m/{model}/ctx{ctx}/k{row['k']}"
            for field, tag, label in (("length", "per-length-m", "the profile's m for this length"),
                                      ("length_coverage", "input-aware-coverage-per-length-m",
                                       "the coverage rule around the profile's m for this length")):
                if row[f"arr_{field}"] is None:
                    continue
                add(Figure(f"{where}/{tag}/arr", f"ARR, Dustin-H with {label}, {model}, {ctx // 1000}k, k = "
                           f"{row['k']}", "fraction", source, _m_per_length(source, base, row["k"], f"arr_{field}")))
                add(Figure(f"{where}/{tag}/agreement", f"token match with dense, Dustin-H with {label}, k = "
                           f"{row['k']}", "fraction", source, _m_per_length(source, base, row["k"], f"match_{field}")))
                if row[f"gap_closed_{field}"] is not None:
                    add(Figure(f"{where}/{tag}/gap-closed", f"share of the single m's ARR gap to the oracle (same "
                               f"items) closed by {label}, k = {row['k']}", "%", source,
                               _m_per_length(source, base, row["k"], f"gap_closed_{field}"), scale=100,
                               target="target >= 33 % (mean over k)"))
            if row["selection_ratio_length_coverage"] is not None:
                add(Figure(f"{where}/input-aware-coverage-per-length-m/selection-cost-vs-fixed",
                           f"selection time per round / fixed m's, the coverage rule around the length's m, k = "
                           f"{row['k']}", "x", source,
                           _m_per_length(source, base, row["k"], "selection_ratio_length_coverage"),
                           target="target <= 1.1"))
    for model, source in M_BOUNDS:
        data = inputs.load(source)
        ctx = int(str(data["config"]["lengths"]).split(",")[0])
        for key, study in data.items():
            if not (key.startswith("k") and isinstance(study, dict) and "gap_closed" in study):
                continue
            for field, tag, label in M_BOUND_TAGS:
                if study["gap_closed"].get(field) is not None:
                    add(Figure(f"dustin/input-aware-m/{model}/ctx{ctx}/{key}/{tag}/gap-closed",
                               f"share of the fixed-to-oracle ARR gap closed by {label}, full-KV decoding of "
                               f"{len(data['tasks'])} tasks, k = {study['k']} (dustin-m-bounds)", "%", source,
                               (key, "gap_closed", field), scale=100))
            other = m_bounds_3kinds(source).get(key)
            for field, tag, label in (M_BOUND_TAGS_3KINDS if other else ()):
                if other["gap_closed"].get(field) is None:
                    continue
                add(Figure(f"dustin/input-aware-m/{model}/ctx{ctx}/{key}/{tag}/gap-closed",
                           f"share of the fixed-to-oracle ARR gap closed by {label}, the same rounds, k = "
                           f"{study['k']} (dustin-m-bounds)", "%", M_BOUNDS_3KINDS[1], (key, "gap_closed", field),
                           scale=100))
    for device, source in SELECTION_COST:
        if not (inputs.RESULTS / source).exists():
            continue
        for key, case in inputs.load(source)["cases"].items():
            for rule in selection_rules_of(source, case["ratio_to_fixed"]):
                if rule in case.get("ratio_to_fixed_cycle", {}):  # a program of rounds: against its own kind below
                    continue
                add(Figure(f"dustin/input-aware-m/selection-cost/{device}/{key}/{SELECTION_RULE_TAGS[rule]}/vs-fixed",
                           f"selection per round, the {rule} rule / the fixed rule, same signals, {case['context']} "
                           f"positions, batch {case['batch']}, k = {case['k']} (bench-selection)", "x", source,
                           ("cases", key, "ratio_to_fixed", rule), target="target <= 1.1"))
            for rule in case.get("ratio_to_fixed_cycle", {}):  # three rounds as one program, each rule
                add(Figure(f"dustin/input-aware-m/selection-cost/{device}/{key}/{SELECTION_RULE_TAGS[rule]}/"
                           f"vs-fixed-cycle", f"selection per round, the {rule} rule's three rounds as one program / "
                           f"the fixed rule's three rounds as one program, {case['context']} positions, batch "
                           f"{case['batch']}, k = {case['k']} (bench-selection)", "x", source,
                           ("cases", key, "ratio_to_fixed_cycle", rule), target="target <= 1.1"))
    # the held rule in the decoding loop (dustin-speed)
    for device, (source, _) in M_EVERY_LOOP.items():
        if not (inputs.RESULTS / source).exists():
            continue
        for method, label in M_EVERY_LOOP_METHODS:
            add(Figure(f"dustin/input-aware-m/loop/{device}/7b-shape/ctx32768/b16/{method}/speedup",
                       f"tokens/s vs AR in the same process, {label}, 7B-shaped target + 0.5B-shaped draft, 32k, "
                       f"batch 16, k = 512 (dustin-speed)", "x", source,
                       ("cases", "ctx32768/b16", "rows", {"method": method}, "speedup")))
    # GQA-aware SRHs
    for ctx in srh_group_contexts():
        for tag, source in SRH_GROUP_QUALITY[ctx]:
            for budget in quality_budgets(source):
                for field, name, label in (("ARR", "arr", "ARR"), ("match", "agreement", "token match with dense")):
                    add(Figure(f"dustin/srh-groups/qwen2.5-coder-1.5b/ctx{ctx}/k{budget}/dustin-h/{tag}/{name}",
                               f"{label}, Dustin-H, SRHs {SRH_GROUP_LABEL[tag]}, {ctx // 1024}k, k = {budget}",
                               "fraction", source, srh_group_quality(source, "dustin-h", budget, field)))
    if (inputs.RESULTS / SRH_GROUP_SCORING).exists():
        for key, case in inputs.load(SRH_GROUP_SCORING)["cases"].items():
            add(Figure(f"dustin/srh-groups/qwen2.5-coder-1.5b-profile/scoring/cpu/{key}/1group-vs-any",
                       f"signal scoring per round (s_T + s_D), one-KV-group SRHs / the best heads anywhere, "
                       f"{case['context']} positions, batch {case['batch']}, k = {case['k']} (bench-scoring)", "x",
                       SRH_GROUP_SCORING, lambda d, key=key: scoring_ratio(d, key)))
    for tag, src in (("reselect2", DUSTIN_SPEED_RESELECT), ("reselect3", DUSTIN_SPEED_RESELECT3)):
        if not (inputs.RESULTS / src).exists():
            continue
        for method in ("dustin", "dustin-kv-streaming"):
            what = (f"7B/0.5B shapes, 32k, batch 16, k = 512, selecting every {tag[-1]}{'nd' if tag[-1] == '2' else 'rd'} "
                    f"round, the tau the real pair measured with it: {method}")
            key = f"dustin-speed/7b-shape/ctx32768/b16/{method}/{tag}"
            add(Figure(f"{key}/speedup", what, "x AR", src, dustin(32768, 16, method, "speedup")))
            add(Figure(f"{key}/selection-share-of-round", f"{what}: selection / round time", "%", src,
                       functools.partial(selection_share, method=method), scale=100, target="target <= 3 %"))
    for when, source, base, tag, base_tag, dev in DUSTIN_SPEED_SRH_1GROUP:
        for src, tg, heads in ((source, tag, "target SRHs in one KV group"),
                               (base, base_tag, "target SRHs one per KV group")):
            if tg is None or not (inputs.RESULTS / src).exists():
                continue
            for method in ("dustin", "dustin-kv-streaming"):
                what = (f"7B/0.5B shapes, 32k, batch 16, k = 512, {heads}, selecting {when}: {method}"
                        + ("" if dev == "h200" else f", {DEVICE_NAME[dev]}"))
                key = f"dustin-speed/7b-shape/ctx32768/b16/{method}/{tg}" + ("" if dev == "h200" else f"/{dev}")
                add(Figure(f"{key}/speedup", what, "x AR", src, dustin(32768, 16, method, "speedup")))
                add(Figure(f"{key}/selection-share-of-round", f"{what}: selection / round time", "%", src,
                           functools.partial(selection_share, method=method), scale=100, target="target <= 3 %"))
    # KnapSpec
    for label, source, tag, ctx, batch, other in KNAPSPEC_RUNS:
        model = source[len(K):].split("_")[0]
        extra = "/1024new" if "1024new" in source else ""
        base = f"knapspec/speed/{model}/ctx{ctx}/b{batch}/{tag}{extra}"
        add(Figure(f"{base}/speedup-vs-ar", f"KnapSpec vs paired AR: {label}", "x AR", source,
                   _knapspec_case(tag, ctx, batch, "knapspec")))
        add(Figure(f"{base}/planning-share", f"KnapSpec planning time / decode time: {label}", "%", source,
                   _knapspec_case(tag, ctx, batch, "knapspec", "plan_fraction_of_decode"), scale=100,
                   target="target < 5 %"))
        cases = inputs.load(other or source)["cases"]
        for method in ("clasp", "knapspec-official"):
            if f"{tag}/summarize/ctx{ctx}/b{batch}/{method}" in cases:
                add(Figure(f"{base}/{method}/speedup-vs-ar", f"{method} vs paired AR: {label}", "x AR",
                           other or source, _knapspec_case(tag, ctx, batch, method)))
    for batch, source, variant in [*((b, src, "") for b, src in KNAPSPEC_REAL.items()),
                                   *((b, src, v) for b, src, _, v in KNAPSPEC_REAL_BASELINES)]:
        if not (inputs.RESULTS / source).exists():
            continue
        for key, case in inputs.load(source)["cases"].items():
            if key.count("/") != 4 or "speedup_vs_ar" not in case:  # e.g. a static run's "h200/static_plan/b16"
                continue
            _, _, ctx, _, run_method = key.split("/")
            method = f"{run_method}-{variant}" if variant else run_method
            check = case.get("draft_step_check") or {}
            # a budget plan's draft is checked only where the check ran its codes (older files timed the full model)
            if check.get("static_over_predicted") and (run_method != "knapspec-budget" or check.get("plan") == "budget"):
                add(Figure(f"selfspec/real-qwen1.5b/h200/{ctx}/b{batch}/{method}/static-draft-step-over-predicted",
                           f"{method}: one draft step with its plan compiled in / the latency model's prediction, real "
                           f"Qwen2.5-Coder-1.5B bf16, {ctx[3:]} tokens, batch {batch}", "x", source,
                           ("cases", key, "draft_step_check", "static_over_predicted"), target="target 0.9-1.1"))
            add(Figure(f"selfspec/real-qwen1.5b/h200/{ctx}/b{batch}/{method}/speedup",
                       f"{method} vs paired AR, real Qwen2.5-Coder-1.5B bf16, {ctx[3:]} tokens, batch {batch}", "x AR",
                       source, ("cases", key, "speedup_vs_ar"),
                       target="target >= 1.1x at 32k/b16" if method == "knapspec" else ""))
    for source, batch, slug, variant, speedup_target, ref_target in (
            (KNAPSPEC_TWO_STAGE, 1, "knapspec-two-stage", "two-stage plan (3 search tokens, 2 finalists, a window of "
             ">= 64 tokens)", "", "target >= 64"),
            (KNAPSPEC_PLAN_ROWS, 16, "knapspec-plan-rows", "two-stage plan on 2 rows' windows (3 search tokens, 2 "
             "finalists, >= 64 tokens a row)", "target >= 0.97x", None),
            (KNAPSPEC_PLAN_ROWS_AT_START, 16, "knapspec-plan-rows-at-start", "two-stage plan on 2 rows' windows made "
             "before the first round", "target >= 0.97x", None),
            (KNAPSPEC_DP_PALLAS, 16, "knapspec-plan-rows-dp-pallas", "two-stage plan on 2 rows' windows made before "
             "the first round, the DP's attention in the Pallas history kernel", "target >= 0.97x", None)):
        if not (inputs.RESULTS / source).exists():
            continue
        for key, case in inputs.load(source)["cases"].items():
            ctx = key.split("/")[2]
            if key.endswith("/dp_attention"):  # the DP alone, reference attention against the kernel
                base = f"selfspec/real-qwen1.5b/h200/{ctx}/b{batch}/dp-attention"
                what = (f"one KnapSpec DP on {case['rows']} rows x {case['search_tokens']} tokens, real "
                        f"Qwen2.5-Coder-1.5B bf16, {ctx[3:]} tokens")
                add(Figure(f"{base}/reference-ms", f"{what}, the vmap-ed reference attention", "ms", source,
                           ("cases", key, "median_reference_s"), scale=1e3))
                add(Figure(f"{base}/pallas-ms", f"{what}, branches folded into the Pallas history kernel", "ms",
                           source, ("cases", key, "median_folded_s"), scale=1e3))
                continue
            if "speedup_vs_ar" not in case:
                continue
            base = f"selfspec/real-qwen1.5b/h200/{ctx}/b{batch}/{slug}"
            what = (f"KnapSpec, {variant}, real Qwen2.5-Coder-1.5B bf16, {ctx[3:]} tokens, batch {batch}, 256 new "
                    "tokens")
            add(Figure(f"{base}/speedup", f"{what}, vs paired AR", "x AR", source, ("cases", key, "speedup_vs_ar"),
                       target=speedup_target))
            add(Figure(f"{base}/planning-share", f"{what}: planning / decode time", "%", source,
                       ("cases", key, "plan_fraction_of_decode"), scale=100, target="target <= 5 %"))
            if case.get("plans"):
                if ref_target:
                    add(Figure(f"{base}/reference-tokens", f"{what}: reference tokens of the first plan", "tokens",
                               source, ("cases", key, "plans", 0, "reference_tokens"), target=ref_target))
                add(Figure(f"{base}/dp-ms", f"{what}: the first plan, measured", "ms", source,
                           ("cases", key, "plans", 0, "seconds"), scale=1e3))
                add(Figure(f"{base}/dp-predicted-ms", f"{what}: the first plan, the allowance's prediction",
                           "ms", source, ("cases", key, "plans", 0, "predicted_seconds"), scale=1e3))
    for source, suffix, how in KNAPSPEC_PALLAS_RUNS:  # AR and both KnapSpec variants on the Pallas kernel
        if not (inputs.RESULTS / source).exists():
            continue
        new_tokens = inputs.load(source)["config"].get("max_new_tokens", 256)
        for key, case in inputs.load(source)["cases"].items():
            if "speedup_vs_ar" not in case:
                continue
            tag, _, ctx, batch, method = key.split("/")
            base = f"selfspec/real-qwen1.5b/{tag}/{ctx}/{batch}/{method}-{suffix}"
            what = (f"{method} (two-stage plan on 2 rows before the first round)" if method == "knapspec" else
                    f"{method}") + (f", AR and {method} on the Pallas attention kernel{how}, real Qwen2.5-Coder-1.5B "
                                    f"bf16, {ctx[3:]} tokens, batch {batch[1:]}, {new_tokens} new tokens")
            add(Figure(f"{base}/speedup", f"{what}, vs paired AR", "x AR", source,
                       ("cases", key, "speedup_vs_ar"),
                       target="target >= 1.1x at 32k/b16" if method == "knapspec" else ""))
            add(Figure(f"{base}/planning-share", f"{what}: planning / decode time", "%", source,
                       ("cases", key, "plan_fraction_of_decode"), scale=100, target="target <= 5 %"))
            add(Figure(f"{base}/ar-step-ms", f"{what}: the paired AR step", "ms", source,
                       ("cases", key, "ar_step_s"), scale=1e3))
            # a run that made no plan drafted nothing: its check times the full model's mask, no plan's
            check = (case.get("draft_step_check") or {}) if case.get("plans") or case.get("budget_plan") else {}
            for mode in ("static", "dynamic"):
                if check.get(f"{mode}_over_predicted"):
                    add(Figure(f"{base}/{mode}-draft-step-over-predicted",
                               f"{what}: one draft step of its plan ({mode} mask, {check['timed']}) / the latency "
                               "model's prediction", "x", source,
                               ("cases", key, "draft_step_check", f"{mode}_over_predicted"), target="target 0.9-1.1"))
    for source, model, device in PLAN_STAGES:  # one plan's stages timed alone (bench-plan)
        data = inputs.load(source)
        tag = source.rsplit("_", 1)[1].split(".")[0]  # the file name ends in its device: cpu, h100, h200
        for key, case in data["cases"].items():
            masks = "-real-masks" if data["config"].get("masks_from") else ""  # the finalists a results file's plans
            search = (data["config"]["search_tokens"], data["config"]["finalists"])
            base = (f"knapspec/plan-stages/{data['config']['model'].replace('random:', '')}{masks}/{tag}/"
                    f"ctx{case['context']}/r{data['config']['rows']}"
                    + ("" if search == (3, 2) else "/s{}f{}".format(*search))  # 3 search tokens, 2 finalists: bare
                    + ("" if data["config"].get("weights", "5,1") == "5,1"  # the knapsack weights bench-plan defaults to
                       else "/w{}".format(data["config"]["weights"].replace(",", "-"))))
            for name, what in plan_stage_names(case):
                add(Figure(f"{base}/{name.replace('_', '-')}-ms", f"one two-stage plan's stage timed alone, {what}, "
                           f"{model}, {case['context']} cached tokens, {case['window']}-token window (best of "
                           f"{data['config']['repeats']})", "ms", source, ("cases", key, "seconds_min", name),
                           scale=1e3))
            add(Figure(f"{base}/rescore-select-over-executed", f"the finalists rescored without conditionals / behind "
                       f"them, {model}, {case['context']} cached tokens", "x", source,
                       ("cases", key, "select_over_executed")))
    for source, tag, what, _, slug in KNAPSPEC_PLAN_TRACES:  # the traced plan: its wall time and the GPU's work in it
        if not (inputs.RESULTS / source).exists():
            continue
        key = next(k for k in inputs.load(source)["cases"] if k.endswith("/knapspec"))  # the one traced KnapSpec case
        batch = int(key.split("/b")[-1].split("/")[0])
        base = f"selfspec/real-qwen1.5b/{tag}/ctx32000/b{batch}/knapspec-{slug}"
        add(Figure(f"{base}/plan-ms", f"KnapSpec's first plan, real Qwen2.5-Coder-1.5B bf16, 32k, "
                                      f"batch {batch}, {what}", "ms", source, ("cases", key, "plans", 0, "seconds"),
                   scale=1e3))
        add(Figure(f"{base}/gpu-busy-beyond-ar-ms",
                   f"the traced KnapSpec run's GPU-busy time beyond the traced AR run's on the same cache (at most the "
                   f"plan's device work), 32k, batch {batch}, {what}", "ms", source,
                   lambda d, key=key: 1e3 * (next(iter(d["cases"][key]["trace"]["knapspec"]["planes"].values()))[
                       "busy_s"] - next(iter(d["cases"][key]["trace"]["ar"]["planes"].values()))["busy_s"])))
    for source, slug, variant in (
            (KNAPSPEC_PLAIN_PRICED_CPU, "two-stage-plain-priced", "two-stage plan, plain decoding priced at the "
                                                                  "decode loop's own step"),
            (KNAPSPEC_CALIBRATED_CPU, "two-stage-calibrated", "two-stage plan priced at its measured cost "
                                                              "(--plan-cost-scale-from)"),
            (KNAPSPEC_AT_START_CPU, "two-stage-at-start", "two-stage plan made before the first round (--plan-at-start)"),
            (KNAPSPEC_AFTER_PLAIN_CPU, "two-stage-after-plain", "two-stage plan made after 64 plain tokens on those "
                                                                "alone (--plan-after-plain 64)"),
            *((KNAPSPEC_AFTER_PLAIN_STATES_CPU[kind], f"two-stage-after-plain-{kind}-states",
               f"two-stage plan made after 64 plain tokens, {what}, per-step profile")
              for kind, what in (("own", "its window's states computed by the plan"),
                                 ("kept", "its window's states kept by the plain stretch"))),
            (KNAPSPEC_PREFILL_STATES_CPU, "two-stage-at-start-prefill-states", "two-stage plan made before the first "
                                                                              "round, its window's states kept by the "
                                                                              "prefill"),
            (KNAPSPEC_OWN_STATES_CPU, "two-stage-at-start-own-states", "two-stage plan made before the first round, "
                                                                      "its window's states computed by the plan"),
            (KNAPSPEC_ONE_FINALIST_CPU, "two-stage-at-start-prefill-states-1-finalist",
             "two-stage plan on 2 search tokens and 1 finalist made before the first round, its window's states kept "
             "by the prefill"),
            (KNAPSPEC_TWO_STAGE_CPU, "two-stage", "two-stage plan (3 search tokens, 2 finalists)"),
            (KNAPSPEC_AT_START_QWEN_CPU, "two-stage-at-start", "two-stage plan made before the first round "
                                                               "(--plan-at-start)"),
            (KNAPSPEC_ONE_FINALIST_QWEN_CPU, "two-stage-at-start-prefill-states-1-finalist",
             "two-stage plan on 2 search tokens and 1 finalist made before the first round, its window's states kept "
             "by the prefill"),
            (KNAPSPEC_ONE_FINALIST_CAP2_QWEN_CPU, "two-stage-at-start-prefill-states-1-finalist-weight-cap-2",
             "two-stage plan on 2 search tokens and 1 finalist made before the first round, its window's states kept "
             "by the prefill, knapsack weights capped at 2"),
            (KNAPSPEC_ONE_FINALIST_UNROLLED_QWEN_CPU, "two-stage-at-start-prefill-states-1-finalist-dp-unrolled",
             "two-stage plan on 2 search tokens and 1 finalist made before the first round, its window's states kept "
             "by the prefill, the DP traced once per layer")):
        if not (inputs.RESULTS / source).exists():
            continue
        (key, _), = [(k, v) for k, v in inputs.load(source)["cases"].items() if "speedup_vs_ar" in v]
        model = ("qwen2.5-coder-1.5b" if source in (KNAPSPEC_AT_START_QWEN_CPU, KNAPSPEC_ONE_FINALIST_QWEN_CPU,
                                                    KNAPSPEC_ONE_FINALIST_CAP2_QWEN_CPU,
                                                    KNAPSPEC_ONE_FINALIST_UNROLLED_QWEN_CPU) else "smollm2-135m")
        base = f"knapspec/plans/{model}/ctx1024/b1/cpu/{slug}"
        what = (f"KnapSpec, {variant}, {'Qwen2.5-Coder-1.5B' if model.startswith('qwen') else 'SmolLM2-135M'} f32 "
                "CPU, 1k, batch 1, 256 new")
        add(Figure(f"{base}/planning-share", f"{what}: planning / decode time", "%", source,
                   ("cases", key, "plan_fraction_of_decode"), scale=100, target="target <= 5 %"))
        add(Figure(f"{base}/speedup", f"{what}, vs paired AR", "x AR", source, ("cases", key, "speedup_vs_ar")))
        if source in (KNAPSPEC_PREFILL_STATES_CPU, KNAPSPEC_OWN_STATES_CPU, KNAPSPEC_ONE_FINALIST_CPU,
                      KNAPSPEC_ONE_FINALIST_QWEN_CPU, KNAPSPEC_ONE_FINALIST_CAP2_QWEN_CPU,
                      KNAPSPEC_ONE_FINALIST_UNROLLED_QWEN_CPU,
                      *KNAPSPEC_AFTER_PLAIN_STATES_CPU.values()) and \
                inputs.load(source)["cases"][key].get("plans"):
            add(Figure(f"{base}/reference-tokens", f"{what}: the plan's reference tokens (target >= 64)", "tokens",
                       source, ("cases", key, "plans", 0, "reference_tokens")))
            add(Figure(f"{base}/plan-ms", f"{what}: the plan's wall time", "ms", source,
                       ("cases", key, "plans", 0, "seconds"), scale=1e3))
    # KnapSpec: static plans, one DP on 64 reference tokens, the DP's acceptance estimate, budgeted attention
    base = "knapspec/plans/smollm2-135m/ctx1024/b1/cpu/64ref"
    add(Figure(f"{base}/static-draft-step-over-predicted", "one draft step with a static plan (executed sub-layers "
               "only) / the latency model's draft time, median over the fixed candidate plans, SmolLM2 CPU 1k", "x",
               KNAPSPEC_64REF, _fixed_median("draft_step_check", "static_over_predicted"), target="target 0.9-1.1"))
    add(Figure(f"{base}/dynamic-draft-step-over-predicted", "the same plans with the dynamic mask (lax.cond per "
               "sub-layer) / the latency model", "x", KNAPSPEC_64REF,
               _fixed_median("draft_step_check", "dynamic_over_predicted")))
    add(Figure(f"{base}/dp-share-of-decode", "one DP (64 reference tokens) / the 256-token AR decode, SmolLM2 CPU 1k",
               "%", KNAPSPEC_64REF, ("cases", "cpu/summarize/ctx1024/b1/candidates", "plan_share_of_ar_decode"),
               scale=100, target="target < 5 %"))
    add(Figure(f"{base}/alpha-error", "largest |DP alpha (64 reference tokens) - measured acceptance| over the fixed "
               "candidate plans, SmolLM2 CPU 1k", "abs", KNAPSPEC_64REF, _alpha_error, target="target <= 0.05"))
    if (inputs.RESULTS / KNAPSPEC_ALPHA).exists():
        for mode, label in DP_REFERENCES:
            add(Figure(f"{base}/alpha-error-{mode}", f"largest |DP alpha - measured acceptance| over the fixed plans "
                       f"of the alpha run, reference = {label}, SmolLM2 CPU 1k", "abs", KNAPSPEC_ALPHA,
                       functools.partial(_alpha_error, field=f"alpha_{mode}"), target="target <= 0.05"))
            add(Figure(f"{base}/chosen-plan/alpha-{mode}", f"the planner's chosen plan: DP alpha, reference = {label}",
                       "fraction", KNAPSPEC_ALPHA, lambda d, m=mode: chosen_fixed(d)[f"alpha_{m}"]))
        add(Figure(f"{base}/chosen-plan/measured-acceptance", "the planner's chosen plan: measured acceptance as a "
                   "fixed plan over 256 new tokens", "fraction", KNAPSPEC_ALPHA,
                   lambda d: chosen_fixed(d)["acceptance_rate"]))
    add(Figure(f"{base}/knapspec-budget/speedup-vs-ar", "KnapSpec with budgeted attention (K = 256, one plan) vs "
               "paired AR, SmolLM2 CPU 1k", "x AR", KNAPSPEC_64REF, _knapspec_case("cpu", 1024, 1, "knapspec-budget")))
    if (inputs.RESULTS / KNAPSPEC_TPT_CORRELATION).exists():
        for ctx in TPT_CORRELATION_CONTEXTS:
            key = f"cpu/summarize/ctx{ctx}/b1/correlation"
            base = f"knapspec/correlation/smollm2-135m/ctx{ctx}/b1/cpu/exit-aware"
            what = f"over the fixed candidate plans, SmolLM2 CPU, {ctx // 1024}k"
            for field, slug, label, target in (
                    ("pearson_predicted_tpt_vs_speedup", "predicted-tpt-vs-speedup",
                     "predicted TPT (priced as the planner prices it, early exit modelled) vs measured speed-up",
                     "target >= 0.84 (paper 0.837)"),
                    ("pearson_predicted_tpt_vs_throughput", "predicted-tpt-vs-throughput",
                     "the same TPT vs measured tokens/s", "target >= 0.84 (paper 0.837)"),
                    ("pearson_predicted_tpt_no_exit_vs_speedup", "predicted-tpt-no-exit-vs-speedup",
                     "the exit-free TPT (docs/methods.md §4.2) vs measured speed-up", None),
                    ("pearson_measured_acceptance_vs_speedup", "measured-acceptance-vs-speedup",
                     "measured acceptance vs measured speed-up", "paper 0.538 for acceptance")):
                add(Figure(f"{base}/{slug}", f"Pearson r, {label}, {what}", "r", KNAPSPEC_TPT_CORRELATION,
                           ("cases", key, field), target=target))
            if (inputs.RESULTS / KNAPSPEC_TPT_CORRELATION_REPEATS).exists():
                for field, slug, label, target in PAIRED_CORRELATION_FIELDS:
                    add(Figure(f"{base.replace('/exit-aware', '/exit-aware-repeats')}/{slug}",
                               f"Pearson r, {label}, {what}", "r", KNAPSPEC_TPT_CORRELATION_REPEATS,
                               ("cases", key, field), target=target))
            if (inputs.RESULTS / KNAPSPEC_TPT_CORRELATION_TARGET).exists():
                for field, slug, label, target in (
                        ("pearson_predicted_tpt_vs_speedup", "predicted-tpt-vs-speedup",
                         "predicted TPT vs measured speed-up, the DP's acceptance against the target's K/V",
                         "target >= 0.84 (paper 0.837)"),
                        ("pearson_predicted_tpt_vs_throughput", "predicted-tpt-vs-throughput",
                         "the same TPT vs measured tokens/s", "target >= 0.84 (paper 0.837)"),
                        ("pearson_measured_acceptance_vs_speedup", "measured-acceptance-vs-speedup",
                         "measured acceptance vs measured speed-up (that run's plans)", "paper 0.538 for acceptance"),
                        ("alpha_target_mean_abs_error", "alpha-mean-abs-error",
                         "mean |DP alpha - measured acceptance| over that run's plans", "target <= 0.05")):
                    add(Figure(f"knapspec/correlation/smollm2-135m/ctx{ctx}/b1/cpu/target-ref/{slug}",
                               f"{'Pearson r, ' if slug != 'alpha-mean-abs-error' else ''}{label}, {what}",
                               "r" if slug != "alpha-mean-abs-error" else "abs", KNAPSPEC_TPT_CORRELATION_TARGET,
                               ("cases", key, field), target=target))
            fixed = f"cpu/summarize/ctx{ctx}/b1/fixed/"
            if any("draft_step_check" in c for c in fixed_cases(inputs.load(KNAPSPEC_TPT_CORRELATION), fixed)):
                loop = f"knapspec/plans/smollm2-135m/ctx{ctx}/b1/cpu/in-loop"
                add(Figure(f"{loop}/static-draft-step-over-predicted", "one draft step with a static plan (executed "
                           "sub-layers only), timed inside a compiled loop of 4 / the latency model's draft time, "
                           f"median {what}", "x", KNAPSPEC_TPT_CORRELATION,
                           _fixed_median("draft_step_check", "static_over_predicted", prefix=fixed),
                           target="target 0.9-1.1"))
                add(Figure(f"{loop}/dynamic-draft-step-over-predicted", "the same plans with the dynamic mask "
                           "(lax.cond per sub-layer) / the latency model", "x", KNAPSPEC_TPT_CORRELATION,
                           _fixed_median("draft_step_check", "dynamic_over_predicted", prefix=fixed)))
    for source in (KNAPSPEC_TPT_CORRELATION_H100_8, KNAPSPEC_TPT_CORRELATION_H100):
        if not (inputs.RESULTS / source).exists():
            continue
        key = "h100/summarize/ctx32000/b1/correlation"
        fields = [f for f in PAIRED_CORRELATION_FIELDS if inputs.load(source)["cases"][key].get(f[0]) is not None]
        for field, slug, label, target in fields:  # fewer than three plans: no Pearson to index
            add(Figure(f"knapspec/correlation/qwen2.5-coder-1.5b/ctx32000/b1/h100/{slug}",
                       f"Pearson r, {label}, over the fixed candidate plans, real Qwen2.5-Coder-1.5B on an H100, 32k",
                       "r", source, ("cases", key, field), target=target))
        if fields:
            break  # the 8-finalist run where it has a Pearson
    for ctx in (1024, 2048, 4096):
        add(Figure(f"knapspec/correlation/smollm2-135m/ctx{ctx}/b1/cpu/predicted-tpt-vs-speedup",
                   f"Pearson r, predicted TPT vs measured speed-up over 5 fixed plans, SmolLM2 CPU, {ctx // 1024}k",
                   "r", KNAPSPEC_EARLY[0], ("cases", f"cpu/summarize/ctx{ctx}/b1/correlation",
                                             "pearson_predicted_tpt_vs_speedup"), target="paper 0.837"))
    return f


FIGURES = _figures()
BY_KEY = {fig.key: fig for fig in FIGURES}
README_KEYS = (  # the README's short table
    "dustin-speed/7b-shape/ctx32768/b16/dustin/speedup",
    "dustin-speed/7b-shape/ctx32768/b16/dustin-kv-streaming/speedup",
    "real-pair/h200/ctx32000/b16/dustin/speedup",
    "real-pair/h200/ctx32000/b16/dustin-kv-streaming/speedup",
    "real-pair/h100/ctx32000/b16/dustin-kv-verify-set/speedup",
    "selfspec/real-qwen1.5b/h200/ctx32000/b16/dustin-self-gamma6/speedup",
    "real-pair/h200/ctx32000/dustin-h/k512/agreement",
    "kernels/dense-attention/qwen2.5-7b/ctx32768/b16/bandwidth",
    "kernels/72b/ctx32768/b16/k512/attention_speedup_device",
    "ar/decode/qwen2.5-7b-shape/ctx32768/b16/fraction-of-floor",
    "knapspec/speed/qwen2.5-7b-shape/ctx8192/b1/h200/speedup-vs-ar",
    "parity/smollm2-135m/cpu/max-rel-err",
)


def value(key: str) -> float:
    return BY_KEY[key].value()


def fmt(x: float, unit: str = "") -> str:
    if unit == "relative error":
        return f"{x:.2e}"
    if unit == "1 = identical":
        return "yes" if x else "no"
    if unit == "logit":
        return f"{x:.3f}"
    if unit in ("%",):
        return f"{x:.2f} %" if abs(x) < 10 else f"{x:.1f} %"
    if unit in ("x", "x AR"):
        return f"{x:.2f}x"
    if unit == "tokens/s":
        return f"{x:.0f} tokens/s"
    if unit == "s":
        return f"{x:.2f} s"
    if unit == "programs":
        return f"{x:.0f}"
    if unit == "µs":
        return f"{x:.1f} µs"
    if unit in ("ms", "TB/s", "tokens/round"):
        return f"{x:.2f} {unit}"
    return f"{x:.3f}" if unit == "fraction" else f"{x:.2f}"


def v(key: str) -> str:
    fig = BY_KEY[key]
    return fmt(fig.value(), fig.unit)
