"""docs/results.md: :func:`results_markdown` assembles it from every module's tables and notes.

Each :func:`section` ends with its figures (:func:`figures_table`) and the commands that write their JSON
(:func:`commands_block`).
"""

from __future__ import annotations

from typing import List, Sequence

from experiments.tables import inputs
from experiments.tables.choice import choice_table_block, cpu_choice_note
from experiments.tables.decode import (PROJECTIONS_INTRO, decode_table, demo_note, parity_table, plain_table,
                                      projections_note, projections_table, skip_table, speculative_tables)
from experiments.tables.dustin_quality import (quality_budgets, quality_cases, quality_contexts, quality_files,
                                               quality_items, quality_markdown, quality_sources)
from experiments.tables.dustin_speed import dustin, dustin_speed_tables, selection_share_note
from experiments.tables.figures import BY_KEY, FIGURES, fmt, v
from experiments.tables.input_aware_m import (input_aware_reach_note, m_bounds_blocks, m_bounds_verdict,
                                              m_per_length_blocks, m_per_length_held_blocks,
                                              m_every_loop_blocks, m_every_loop_verdicts,
                                              m_per_length_held_verdicts, m_per_length_verdicts, m_rule_table,
                                              m_rule_verdicts,
                                              m_run_label, oracle_persistence_note, selection_cost_tables,
                                              selection_cost_verdicts)
from experiments.tables.inputs import (BENCH_SD_SPLIT, CHOICE_TABLE, DECODE_PROJECTIONS, DUSTIN_SMOLLM2_TAU, DUSTIN_SPEED_SPARSE,
                                       GREEDY_IDENTITY, INPUT_AWARE_M, INPUT_AWARE_M_DRAFT, KERNEL_FILES,
                                       KNAPSPEC_EARLY, KNAPSPEC_PALLAS_STATIC, KNAPSPEC_TPT_CORRELATION,
                                       KNAPSPEC_TPT_CORRELATION_TARGET, KNAPSPEC_TRACE, PAIR_SPEED_F32, QUALITY,
                                       QUALITY_PAIR, SELFSPEC_CPU, SELF_DRAFT_SWEEP, SRH_GROUP_QUALITY, command_of,
                                       device_of, read_path, suite_steps)
from experiments.tables.kernels import device_time_note, kernel_cases, kernel_table, pick, topk_note
from experiments.tables.knapspec import (knapspec_comparison, knapspec_draft_step_note, knapspec_real_note,
                                         knapspec_tables, selfspec_table)
from experiments.tables.knapspec_plans import (knapspec_alpha_notes, knapspec_alpha_table, knapspec_calibrated_note,
                                               knapspec_dp_cost_note, knapspec_plan_rows_note,
                                               knapspec_tpt_correlation_note, knapspec_two_stage_note)
from experiments.tables.pair_speed import h200_self_draft_note, pair_intro, pair_speed_blocks, pair_speed_notes
from experiments.tables.plots import PLOTS, SELFSPEC_PLOT, selfspec_series
from experiments.tables.srh_groups import srh_group_blocks, srh_group_contexts, srh_group_verdicts


# ---------------------------------------------------------------------------- docs/results.md
def figures_table(prefixes: Sequence[str]) -> str:
    lines = ["| key | value | target / paper | device | JSON |", "|---|---|---|---|---|"]
    for fig in FIGURES:
        if fig.key.startswith(tuple(prefixes)):
            lines.append(f"| `{fig.key}` | {fmt(fig.value(), fig.unit)} | {fig.target or '–'} "
                         f"| {device_of(fig.source)} | `{fig.source}` |")
    return "\n".join(lines)


def commands_block(prefixes: Sequence[str], extra: Sequence[str] = ()) -> str:
    sources = []
    for fig in FIGURES:
        if fig.key.startswith(tuple(prefixes)) and fig.source not in sources:
            sources.append(fig.source)
    sources += [s for s in extra if s not in sources]
    lines = ["```bash"]
    for source in sources:
        lines += [f"# -> {source}  (suite {suite_steps()[source][0]})", command_of(source)]
    return "\n".join(lines + ["```"])


def section(title: str, intro: str, prefixes: Sequence[str], body: Sequence[str], misses: Sequence[str],
            extra_sources: Sequence[str] = ()) -> str:
    parts = [f"## {title}", "", intro, ""]
    for block in body:
        parts += [block, ""]
    if misses:
        parts += ["**Against the targets and the papers:**", ""] + [f"* {m}" for m in misses] + [""]
    parts += ["Figures (in `experiments/results/index.json`):", "", figures_table(prefixes), "",
              "Commands (each writes the JSON named above it):", "", commands_block(prefixes, extra_sources), ""]
    return "\n".join(parts)


def results_markdown() -> str:
    dec = "ar/decode/qwen2.5-7b-shape/ctx32768/b16"
    ker7 = "kernels/variants/qwen2.5-7b/ctx32768/b16/k512"
    ds = "dustin/speed/qwen2.5-7b-shape/ctx32768/b16"
    q16 = "dustin/quality/qwen2.5-coder-1.5b/ctx16384"
    k8 = "knapspec/speed/qwen2.5-7b-shape/ctx8192/b1/h200"
    kc = "knapspec/speed/smollm2-135m/ctx1024/b1/cpu"
    clasp, official = knapspec_comparison("clasp"), knapspec_comparison("knapspec-official")
    kernel_bytes = pick(kernel_cases()[("qwen2.5-7b", 32768, 16)], "ours_dense")["GB"] / \
        pick(kernel_cases()[("qwen2.5-7b", 32768, 16)], "ours_sparse", 512)["GB"]
    head = [
        "# Results",
        "",
        "<!-- generated by `python -m experiments.tables` from experiments/results/; do not edit by hand -->",
        "",
        "Every number below is read from a committed JSON file under `experiments/results/` (one folder per "
        "experiment, files named by model or shape, context, batch and device). Each file records the full "
        "config, the environment (device, JAX version, git commit) and the results; each figure names its file, "
        "and each file's command is the step of `experiments/suites/*.toml` that writes it "
        "(`python -m experiments.run suite NAME` runs a suite). Random-weight \"shape\" models measure time only; "
        "their tokens mean nothing. Methods: docs/methods.md.",
        "",
    ]
    sections = [
        section("Autoregressive decoding against its bandwidth floor",
                "bf16 on one H200. The floor is the fewest bytes a decode step must read — every weight but the "
                "embedding table (one row per sequence; a tied table is read whole as the LM head) plus every "
                "valid K/V entry — over the copy bandwidth measured in the same run "
                f"({v('ar/copy-bandwidth/h200')}). The 7B rows fill the cache with random K/V; SmolLM2 ran a real "
                "prefill of 16 rows.",
                ("ar/",), [decode_table(), PROJECTIONS_INTRO, projections_table()],
                [f"The 7B shape reaches {v(dec + '/fraction-of-floor')} of its floor at 32k with XLA attention "
                 "(einsum + masked softmax over the whole cache buffer, float32 scores). The gap is the attention: in "
                 "the kernel sweep below XLA's dense decode attention reads the cache at "
                 f"{pick(kernel_cases()[('qwen2.5-7b', 32768, 16)], 'xla_dense')['TBps']:.2f} TB/s at 32k/b16, "
                 f"against {v('kernels/dense-attention/qwen2.5-7b/ctx32768/b16/bandwidth')} for the Pallas kernel. "
                 "SmolLM2 (0.27 GB of weights) is launch-bound: ~30 layers × a dozen small kernels a step.",
                 projections_note()],
                extra_sources=[source for _, _, source in DECODE_PROJECTIONS]),
        section("Parity with transformers",
                "float32, `jax_default_matmul_precision=highest`, TF32 off in torch; a 64-token prefill and 16 decode "
                "steps through our cache; tolerance 1e-4.",
                ("parity/",), [parity_table()], []),
        section("Attention kernels",
                "One layer, gamma + 1 = 5 query rows, bf16, one H200. Each time is the median of 5 programs of 10 "
                "dependent calls unrolled into straight-line code. \"ours sparse\" is the fastest listed tiling; "
                "selection = SRH scoring of 4 heads + the fastest exact top-k, as a share of the dense attention of "
                "a whole verification step (all layers × the fastest dense).",
                ("kernels/",), [kernel_table(),
                                "![bench-attention](../experiments/results/bench_attention/"
                                "bench_attention_qwen2.5-7b_qwen2.5-72b_8k-32k_h200.png)"],
                [f"Dense ≥ 3.0 TB/s at 32k, batch 16: **met** ({v('kernels/dense-attention/qwen2.5-7b/ctx32768/b16/bandwidth')} "
                 f"on the 7B shape, {v('kernels/dense-attention/qwen2.5-72b/ctx32768/b16/bandwidth')} on the 72B).",
                 f"Sparse ≥ 28x the fastest dense at k = 512, 32k, batch 16: **missed** — "
                 f"{v('kernels/sparse-attention/qwen2.5-7b/ctx32768/b16/k512/speedup-vs-dense')} (7B), "
                 f"{v('kernels/sparse-attention/qwen2.5-72b/ctx32768/b16/k512/speedup-vs-dense')} (72B); the byte "
                 f"ratio allows {kernel_bytes:.0f}x. Cause, measured: a fixed cost per call, not bandwidth — the "
                 f"sparse time hardly moves with the work ({v('kernels/sparse-attention/qwen2.5-7b/ctx32768/b1/k512/time')} "
                 f"at batch 1, {v('kernels/sparse-attention/qwen2.5-7b/ctx32768/b16/k512/time')} at batch 16, 16x "
                 f"the bytes); the kernel without its partial merge takes {v(ker7 + '/sparse-kernel-without-merge')} "
                 f"and the timing harness alone {v(ker7 + '/harness-null')}. Fusing the merge and the new-token part "
                 f"into one launch made the layer slower ({v(ker7 + '/layer-sparse-fused')} against "
                 f"{v(ker7 + '/layer-sparse-unfused')} unfused): each program's gather is a chain of dependent loads "
                 "over only 512 rows.",
                 f"Selection ≤ 1 % of a dense verification step: **missed on the 7B shape** "
                 f"({v('kernels/selection/qwen2.5-7b/ctx32768/b16/k512/share-of-dense-verification')}), met on the "
                 f"72B shape ({v('kernels/selection/qwen2.5-72b/ctx32768/b16/k512/share-of-dense-verification')}). "
                 "Causes, measured: scoring 4 heads in 4 KV groups reads 4 / (layers × KV heads × 2) of a dense "
                 "verification's bytes (1.8 % on the 7B shape), and the exact top-k over 32k positions is "
                 f"launch-bound at every batch size (4-bit compare radix {v(ker7 + '/topk-radix4-compare')}, "
                 f"`lax.top_k` {v(ker7 + '/topk-lax')}; one Pallas kernel for all passes "
                 f"{v(ker7 + '/topk-pallas-one-kernel')}: 16 programs cannot fill the GPU).",
                 device_time_note(), topk_note()],
                extra_sources=[KERNEL_FILES[1], inputs.KERNEL_TOPK_H100]),
        section("Speculative engine",
                "Greedy speculative output is the autoregressive output token for token in float32 (tests); on the "
                "GPU in bf16 the 5-row verification and the 1-row decode round differently, so near-tied greedy "
                "choices can flip. The fixed-acceptance runs (random 7B/0.5B shapes) draw each round's accepted "
                "count from a distribution with the SmolLM2 run's tau: their timings are real, their tokens are not.",
                ("speculative/",), [speculative_tables(), skip_table(), plain_table()],
                [f"Self-speculation on real SmolLM2 at 767 tokens is slower than AR "
                 f"({v('speculative/self-draft/smollm2-135m/ctx767/b16/h200/speedup-vs-ar')} at tau "
                 f"{v('speculative/self-draft/smollm2-135m/ctx767/b16/h200/tau')}): a 135M model is launch-bound, so "
                 "a round of 4 draft steps and a verification costs about 5 steps.",
                 f"7B/0.5B shapes: {v('speculative/fixed-tau/qwen2.5-7b-shape/ctx32768/b16/speedup-vs-ar')} of a "
                 f"possible {v('speculative/fixed-tau/qwen2.5-7b-shape/ctx32768/b16/roofline-speedup')} at 32k/b16 "
                 "with XLA attention: verifying 5 rows costs about 2 AR steps (the split above) and the small "
                 "draft's step is several times its bytes floor.",
                 f"The dynamic skip mask costs {BY_KEY['speculative/skip-mask/qwen2.5-7b-shape/ctx8192/b16/dynamic-keep-all'].value() - BY_KEY['speculative/skip-mask/qwen2.5-7b-shape/ctx8192/b16/no-mask'].value():.2f} ms "
                 "per 7B forward (one host-read predicate per sub-layer); device-side conditionals do not remove "
                 f"it ({v('speculative/skip-mask/qwen2.5-7b-shape/ctx8192/b16/device-conditionals/dynamic-keep-all')} "
                 "with nothing skipped)."],
                extra_sources=list(SELF_DRAFT_SWEEP.values()) + list(GREEDY_IDENTITY.values()) + [BENCH_SD_SPLIT]),
        section("Dustin: quality",
                "float32, greedy, gamma 4, 16 new tokens; seeded evaluation-split items over the Austen haystack: "
                "on the CPU passkey / needle-QA (1 Qwen item per context, 2 SmolLM2 items per context), on the "
                "H200 passkey / needle-QA / key-value retrieval at 16k (20 items planned; the items of a run cut "
                "off by its time limit that lack a method or k are left out of the means). ARR = the mass of "
                "full-KV verification attention on each method's index set; cells are the k of each heading, "
                "means over items. MagicDec verifies densely (no ARR). The SmolLM2 4k items are needle-QA tasks on "
                "which SmolLM2 stops at its first token even densely: they count for perplexity and accuracy only.",
                ("dustin/quality/",), _quality_blocks(),
                [f"Dustin-H ≥ Dustin-T, Dustin-D, StreamingLLM and Quest in ARR and accuracy at every budget: met on "
                 f"the Qwen pair at 2k, 4k and 8k; **missed at 16k**, where Quest leads at k ≥ 512 "
                 f"(k = 1024: Dustin-H {v(q16 + '/k1024/dustin-h/arr')}, Quest {v(q16 + '/k1024/quest/arr')}; "
                 f"accuracy met, {v(q16 + '/k512/dustin-h/retrieval-accuracy')}). Cause: the profile (SRHs, layers, "
                 "the split m) was calibrated on 2k needle tasks; at 16k one index set shared by every layer and "
                 "head recalls less mass than Quest's per-layer, per-head pages, and the draft-heavy m chosen at 2k "
                 "is the wrong split there (Dustin-D is the weakest variant at 16k).",
                 "SmolLM2: missed at 2k-4k for k = 1024 "
                 f"(Dustin-H {v('dustin/quality/smollm2-135m/ctx2048/k1024/dustin-h/arr')}, Quest "
                 f"{v('dustin/quality/smollm2-135m/ctx2048/k1024/quest/arr')} at 2k); at 8k SmolLM2 fails both tasks "
                 "even densely, so its accuracy says nothing."]),
        section("Dustin: input-aware m",
                "The split m of Dustin-H's budget chosen per round and row from the two signals (docs/methods.md "
                "§3.7), against the profile's fixed m and an oracle that takes, every round, the m maximising that "
                "round's ARR (read from the full-KV verification). SmolLM2-135M with its mlp:10-12 self-draft and "
                "the Qwen2.5-Coder-1.5B with its 0.5B draft, each with its committed profile, float32 on the CPU "
                "(on the H200 where the run says so), greedy, "
                "gamma 4, 16 new tokens, "
                + ", ".join(f"{len({c['task'] for c in inputs.load(src)['cases'].values() if 'task' in c})} ({m}, "
                            f"{m_run_label(src)})" for m, src in INPUT_AWARE_M)
                + " seeded evaluation-split item(s), means over items. The gap closed is (ARR of the rule − ARR "
                "of fixed m) / (ARR of the oracle − ARR of fixed m). Selection time: the selection alone on the "
                "same signals (the signals cost the same for every rule), best of 3 calls, mean over rounds; "
                "\"-\" where the profile's m is k − s − w (Dustin-D: one signal, no split to choose, both rules "
                "select as fixed m).",
                ("dustin/input-aware-m/",),
                [block for m, src in INPUT_AWARE_M
                 for block in (f"{m} + {INPUT_AWARE_M_DRAFT[m]}, {m_run_label(src)} (`{src}`):\n\n"
                               + m_rule_table(src),
                               f"![input-aware m, {m}](../experiments/results/{src.replace('.json', '.png')})")]
                + m_per_length_blocks() + m_per_length_held_blocks() + selection_cost_tables() + m_every_loop_blocks()
                + m_bounds_blocks(),
                [f"{m}, {m_run_label(src)}: {line}" for m, src in INPUT_AWARE_M for line in m_rule_verdicts(src)]
                + m_per_length_verdicts() + m_per_length_held_verdicts() + selection_cost_verdicts()
                + m_every_loop_verdicts()
                + [oracle_persistence_note()] + m_bounds_verdict()
                + [input_aware_reach_note()]),
        section("Dustin: GQA-aware SRHs",
                "The scoring of Dustin's two signals reads each SRH layer's keys once per KV group its heads span "
                "(docs/methods.md §3.1), every round. A profile made with `--srh-kv-groups 1` takes each layer's 4 "
                "SRHs from one KV group (the best-scoring such set; docs/methods.md §3.4), so the scoring reads one "
                "KV head's keys per SRH layer. The Qwen2.5-Coder-1.5B / 0.5B pair (2 KV heads each) profiled both "
                "ways on the same calibration tasks, then measured on the same evaluation items at one commit.",
                ("dustin/srh-groups/",), srh_group_blocks(), srh_group_verdicts(),
                extra_sources=[s for ctx in srh_group_contexts() for _, s in SRH_GROUP_QUALITY[ctx]]),
        section("Dustin: speed",
                "One H200: random-weight Qwen2.5-7B-shaped target, Qwen2.5-0.5B-shaped draft, Pallas attention in "
                "both, gamma 4, k = 512, 64 new tokens, acceptance fixed to the real Qwen2.5-Coder pair's tau "
                f"({v('dustin/acceptance/qwen2.5-coder-1.5b+qwen2.5-coder-0.5b/ctx2k/b1/cpu/tau')} on the CPU; "
                f"realised {v(ds + '/tau')} at 32k/b16); all methods in one process on the same caches. Dustin's "
                "target SRHs are spread over 4 KV groups.",
                ("dustin/speed/", "dustin-speed/", "dustin/trace/", "dustin/acceptance/", "dustin/end-to-end/"),
                [dustin_speed_tables()],
                [f"Beat the paper's 2.33x at k = 512, 32k, batch 16 on the 7B shape: **missed — "
                 f"{v(ds + '/speedup-vs-ar')}**. Causes, measured: (1) acceptance: at this pair's tau even Dustin's "
                 f"bytes roofline is {v(ds + '/roofline-speedup')}; with SmolLM2's tau "
                 f"({inputs.load(DUSTIN_SMOLLM2_TAU)['acceptance']['tau']:.2f}) the same code measured "
                 f"{v(ds + '/smollm2-tau/speedup-vs-ar')}; (2) the draft reads its whole cache: its dense attention "
                 f"is {v('dustin/trace/qwen2.5-7b-shape/ctx32768/b16/draft-dense-attention-share-of-busy')} of "
                 "Dustin's device time, while the target's sparse verification attention is "
                 f"{v('dustin/trace/qwen2.5-7b-shape/ctx32768/b16/target-sparse-attention-share-of-busy')} "
                 "(the sparse draft KV below removes it); (3) selection "
                 f"costs {v(ds + '/selection-ms-per-round')} a round, "
                 f"{v(ds + '/selection-share-of-dense-attention')} of one verification's dense attention "
                 "(target ≤ 1 %).",
                 "With each method's own tau as the real pair measured it at the nearest context, batch 16 "
                 "(pair-speed on real text: Dustin-H "
                 f"{v('dustin-speed/7b-shape/ctx32768/b16/dustin/fixed-tau')} at 32k, against the 1k-token CPU "
                 "run's 2.61; greedy continuations of a novel repeat, which raises tau, so this is the optimistic "
                 f"end): Dustin-H {v('dustin-speed/7b-shape/ctx32768/b16/dustin/speedup')} at 32k (paper 2.33x), "
                 f"{v('dustin-speed/7b-shape/ctx16384/b16/dustin/speedup')} at 16k, "
                 f"{v('dustin-speed/7b-shape/ctx8192/b16/dustin/speedup')} at 8k; ClassicSD "
                 f"{v('dustin-speed/7b-shape/ctx32768/b16/classic/speedup')} and MagicDec "
                 f"{v('dustin-speed/7b-shape/ctx32768/b16/magicdec/speedup')} at 32k. "
                 "Dustin + sparse draft on the 7B shape, all six methods in one run, each at the real pair's "
                 "tau for it: >= 3.0x AR at 32k/b16 **met — "
                 f"{v('dustin-speed/7b-shape/ctx32768/b16/dustin-kv-streaming/speedup')}** with the streaming "
                 f"draft KV ({v('dustin-speed/7b-shape/ctx32768/b16/dustin-kv-verify-set/speedup')} with the "
                 "verify-set draft KV; full-KV Dustin-H "
                 f"{read_path(inputs.load(DUSTIN_SPEED_SPARSE), dustin(32768, 16, 'dustin', 'speedup')):.2f}x, MagicDec "
                 f"{read_path(inputs.load(DUSTIN_SPEED_SPARSE), dustin(32768, 16, 'magicdec', 'speedup')):.2f}x in the "
                 "same run); >= 2.0x at 16k/b16 **met — "
                 f"{v('dustin-speed/7b-shape/ctx16384/b16/dustin-kv-streaming/speedup')}** (verify-set "
                 f"{v('dustin-speed/7b-shape/ctx16384/b16/dustin-kv-verify-set/speedup')}); at 8k "
                 f"{v('dustin-speed/7b-shape/ctx8192/b16/dustin-kv-streaming/speedup')}. Their bytes roofline at "
                 "32k is "
                 f"{read_path(inputs.load(DUSTIN_SPEED_SPARSE), dustin(32768, 16, 'dustin-kv-streaming', 'roofline_speedup')):.1f}x: "
                 "the round runs well above its bytes floor (launches and per-layer fixed costs; the round's trace "
                 "with the sparse draft is not taken yet). Batch 8 with the sparse draft is not measured.",
                 selection_share_note(),
                 "Dustin is the fastest speculative method at every point and beats AR at 16k and 32k; ClassicSD is "
                 f"slower than AR at this tau everywhere ({v(ds + '/classic/speedup-vs-ar')} at 32k/b16).",
                 "Real SmolLM2 end to end: every speculative method is slower than AR (launch-bound 135M model: "
                 "a round of 4 draft steps and a 5-row verification costs more than the ~4 tokens it commits); "
                 f"Dustin is the fastest of them ({v('dustin/end-to-end/smollm2-135m/ctx7.6k/b16/dustin-pallas/speedup-vs-ar')}). "
                 "Greedy outputs differ from AR in bf16 on the GPU (see the speculative engine)."]),
        section("The demo",
                "`python -m experiments.run demo` on a 2-core CPU: SmolLM2-135M in float32, the 767-token demo "
                "prompt, 96 new tokens, greedy, plain decoding next to prompt lookup. The first run starts from an "
                "empty compilation cache, the second loads what the first compiled.",
                ("demo/",), [],
                [demo_note()]),
        section("The real Qwen2.5-Coder pair on the H200 (pair-speed)",
                pair_intro(),
                ("real-pair/", "dustin/real-pair/"), pair_speed_blocks() + [choice_table_block()], pair_speed_notes(),
                extra_sources=[PAIR_SPEED_F32, CHOICE_TABLE]),
        section("Sparse draft KV (CPU): Dustin where neither model reads the whole cache",
                "Dustin-H (k = 512, the pair's profile) with the draft attending to all of its cache (the paper), to "
                "the previous round's I_verify + a 64-token window (verify-set), or to 4 sinks + the last 508 "
                "positions (streaming); K/V writes and the lookahead signal over the full cache (methods.md §5.1). "
                "Real Qwen2.5-Coder-1.5B-Instruct + 0.5B-Instruct, the 2k-token summarisation prompt, batch 1, 64 "
                "new tokens, greedy, gamma 4, float32 on the shared 2-core CPU, one process per method against AR "
                "in the same process.",
                ("dustin/sparse-draft-kv/",), [],
                ["These runs skip the warm-up run (`--no-warmup`, to fit the shared CPU's time): tokens/s and the "
                 "speed-up include the compiles of both the method and AR, so only tau and the acceptance rate are "
                 "comparable here; on a CPU the draft's attention is not the bottleneck it is on the H200.",
                 "AR in the same process ran at 0.83-1.84 tokens/s across these three processes (other jobs shared "
                 "the two cores), so the speed-ups say nothing about the methods. Each variant also decodes its own "
                 "text (below), so the tau values are over different 64-token continuations: on this one prompt "
                 "neither sparse draft KV lowered the acceptance of full-KV Dustin-H.",
                 "Outputs differ from AR: k = 512 < the 2k context, so the sparse verification itself changes the "
                 "tokens (with k >= context every variant equals ClassicSD and AR, tests/dustin/test_sparse_draft_kv.py).",
                 "Selecting I_verify every second round and reusing it in between (docs/methods.md §3.8, "
                 f"`--dustin-reselect-every 2`, step dustin-reselect-2): tau "
                 f"{v('dustin/sparse-draft-kv/qwen2.5-coder-1.5b+qwen2.5-coder-0.5b/ctx2k/b1/cpu/dustin-full-kv-reselect-2/tau')}"
                 " against "
                 f"{v('dustin/sparse-draft-kv/qwen2.5-coder-1.5b+qwen2.5-coder-0.5b/ctx2k/b1/cpu/dustin-full-kv/tau')} "
                 "selecting every round, again over its own continuation: on this prompt the reuse did not cost "
                 "acceptance. What it saves (the signals and top-k of every other round) is measured on the H200 "
                 "only (h200-qwen-pair step ctx32k-b16-reselect-2, not run yet).",
                 cpu_choice_note()]),
        section("Self-speculative sparse verification",
                "The target drafts for itself and verifies on Dustin's I_verify (docs/methods.md §5.5), no second "
                "model: KnapSpec's re-planned skip sets with the draft SRH layers' attention always executed "
                "(`--method knapspec-dustin`), and a fixed mlp:10-12 self-draft whose attention reads 4 sinks + a "
                "recent window (`--method dustin --draft-skip mlp:10-12 --draft-kv streaming`), next to the paper's "
                "KnapSpec. SmolLM2-135M-Instruct with its committed profile, the 767-token demo prompt, 128 new "
                "tokens, batch 1, greedy, float32, one process per method against AR in the same process on the "
                "shared 2-core CPU (AR's rate moved between processes), re-planning every 16 rounds without the "
                "planning allowance.",
                ("selfspec/",),
                [selfspec_table()],
                ["Self-speculation ahead of AR: **missed** on the CPU — "
                 + "; ".join(f"{label}: {inputs.load(src)['results']['speedup_vs_ar']:.2f}x"
                             + (f" (planning {100 * inputs.load(src)['results']['timings']['plan_fraction']:.0f} % of "
                                "decode)" if "plan_fraction" in inputs.load(src)["results"]["timings"] else "")
                             for _, label, src in SELFSPEC_CPU)
                 + ". The DP runs every 16 rounds here and costs most of the decode; on a 135M model on a CPU a "
                 "round is not cheaper than AR steps. The Dustin variants verify sparsely at k = 512 < the "
                 "context, so their tokens differ from AR's; with k covering the history they equal AR "
                 "(tests/dustin/test_self_speculative.py).",
                 h200_self_draft_note()]),
        section("KnapSpec",
                "Each method decodes from a copy of one prefilled cache, paired with AR decoded just before it in "
                "the same process (speed-up = method / its paired AR); greedy; KnapSpec with the whole-forward "
                "latency fit, a 5 % planning budget, the planning allowance and 8 measured probe rounds. "
                "Plans: skipped Attention / MLP sub-layers and the gamma used (g0 = plain decoding). The 7B shape "
                "has random weights, so self-drafting cannot pay there; on the CPU the paired AR rate moved by up "
                "to ~15 % between pairings on a shared 2-core machine.",
                ("knapspec/",),
                [knapspec_tables(), *knapspec_alpha_table(),
                 "![KnapSpec speed-ups](../experiments/results/knapspec/"
                 "knapspec_speedup_qwen2.5-7b-shape_smollm2-135m_h200_cpu.png)",
                 "![KnapSpec on the CPU, 1k-4k](../experiments/results/knapspec/knapspec_smollm2-135m_1k-4k_b1_cpu.png)",
                 *(["Self-speculation on the real Qwen2.5-Coder-1.5B at batch 16 on the H200 by context (each point "
                    "against its own paired AR; CLaSp and the static skip set decoded with the jnp reference "
                    "attention, the others with jaxspec's Pallas kernel), and the plans KnapSpec and KnapSpec with "
                    "budgeted attention made before the first round as the context grows (static plans, "
                    f"`{KNAPSPEC_PALLAS_STATIC}`):\n\n![self-speculation on the real 1.5B]"
                    f"(../experiments/results/{SELFSPEC_PLOT})"] if selfspec_series() else []),
                 *([f"Fixed candidate plans, predicted against measured speed-up, each priced as the planner prices "
                    f"it (`{KNAPSPEC_TPT_CORRELATION}`, middle panel):\n\n![KnapSpec TPT correlation on the CPU]"
                    f"(../experiments/results/{KNAPSPEC_TPT_CORRELATION[:-len('.json')]}.png)"]
                   if (inputs.RESULTS / KNAPSPEC_TPT_CORRELATION).exists() else []),
                 *([f"The same with the DP's acceptance against the target's K/V (`{KNAPSPEC_TPT_CORRELATION_TARGET}`):"
                    f"\n\n![KnapSpec TPT correlation on the CPU, target reference]"
                    f"(../experiments/results/{KNAPSPEC_TPT_CORRELATION_TARGET[:-len('.json')]}.png)"]
                   if (inputs.RESULTS / KNAPSPEC_TPT_CORRELATION_TARGET).exists() else [])],
                [f"Never slower than AR beyond planning: **close, not met**. Without an affordable plan KnapSpec "
                 f"decodes plainly: {v(k8 + '/speedup-vs-ar')} (7B, 8k), "
                 f"{v('knapspec/speed/qwen2.5-7b-shape/ctx32768/b1/h200/speedup-vs-ar')} (32k), {v(kc + '/speedup-vs-ar')} "
                 "(CPU); with one plan, the full-model draft rounds before it and the losing probe rounds cost "
                 f"more ({v('knapspec/speed/smollm2-135m/ctx1024/b1/cpu/1024new/speedup-vs-ar')} on the CPU with 1024 "
                 f"new tokens, {v('knapspec/speed/qwen2.5-7b-shape/ctx8192/b1/h200/1024new/speedup-vs-ar')} on the "
                 "H200).",
                 f"Beats CLaSp: met in {clasp[0]} of {clasp[0] + len(clasp[1])} runs (CLaSp always drafts: "
                 f"{v(k8 + '/clasp/speedup-vs-ar')} on the 7B shape at 8k, where random weights accept almost "
                 f"nothing); missed in: {'; '.join(clasp[1])}. On the CPU Qwen runs one KnapSpec DP costs a third "
                 "to a half of the decode (the planning-share figures), CLaSp's DP over whole layers much less.",
                 f"Against the authors' always-draft behaviour: better in {official[0]} of "
                 f"{official[0] + len(official[1])} runs; worse in: {'; '.join(official[1]) or 'none'}.",
                 "Beats AR where the latency model says skipping pays: not shown — either no plan fits the planning "
                 "allowance of a 256-token decode, or the chosen plan's measured rate lost to plain decoding in the "
                 "probe (the acceptance estimated from ≤ 19 reference tokens is optimistic).",
                 *knapspec_alpha_notes(), knapspec_dp_cost_note(), knapspec_real_note(), knapspec_two_stage_note(),
                 knapspec_plan_rows_note(), knapspec_calibrated_note(), knapspec_draft_step_note(),
                 knapspec_tpt_correlation_note(),
                 f"The first correlation run (`{KNAPSPEC_EARLY[0]}`, 5 fixed plans; r = "
                 f"{v('knapspec/correlation/smollm2-135m/ctx1024/b1/cpu/predicted-tpt-vs-speedup')} / "
                 f"{v('knapspec/correlation/smollm2-135m/ctx2048/b1/cpu/predicted-tpt-vs-speedup')} / "
                 f"{v('knapspec/correlation/smollm2-135m/ctx4096/b1/cpu/predicted-tpt-vs-speedup')} at 1k / 2k / 4k) "
                 "priced its candidates without the draft's early exit, which the fixed plans ran with, and its "
                 "candidates ran within the noise of AR on a machine whose AR rate moved by 2x.",
                 "The authors' code is not available offline: the comparison is with an emulation of its "
                 "always-draft behaviour."],
                extra_sources=[KNAPSPEC_EARLY[1], KNAPSPEC_TRACE]),
    ]
    return "\n".join(head + sections).rstrip() + "\n"


def _quality_blocks() -> List[str]:
    blocks = []
    for model in QUALITY:
        contexts = sorted({c for s in quality_files(model) for c in quality_contexts(s)})
        for ctx in contexts:
            here = quality_sources(model, ctx)
            done, planned = quality_items(model, ctx)
            gpu = device_of(here[0]) != "cpu"
            count = f"{done} of {planned} items" if done < planned else f"{done} item(s)"
            budgets = sorted({b for s in here for b in quality_budgets(s)})
            blocks.append(f"{QUALITY_PAIR[model]}, {'H200' if gpu else 'CPU'}, {count} at "
                          f"{(ctx / 1000 if gpu else ctx / 1024):.0f}k, k = {' / '.join(map(str, budgets))} "
                          f"({', '.join(f'`{s}`' for s in here)}):\n\n"
                          + quality_markdown(quality_cases(model, ctx), budgets))
    for name in PLOTS:
        if name.startswith("dustin_quality/dustin_quality_arr_"):  # the input-aware-m plots have their own section
            blocks.append(f"![ARR vs k](../experiments/results/{name})")
    return blocks
