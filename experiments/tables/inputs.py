"""What every module of :mod:`experiments.tables` reads: the paths, the JSON reader and the result files.

* the paths: ``REPO``, ``RESULTS`` (experiments/results/), ``SUITES``, ``INDEX``, ``RESULTS_MD``, ``README`` and the
  README block's markers ``BEGIN`` / ``END``;
* reading: :func:`load` (the JSON of ``experiments/results/<source>``, cached), :func:`read_path`, the suite step
  that writes a file (:func:`suite_steps`, :func:`command_of`), the device it ran on (:func:`device_of`) and small
  helpers (:func:`split_csv`, :func:`code_commit`, :func:`tokens_k`);
* the result files, each with what it holds: ``DECODE``, ``BENCH_PLAIN``, ``KERNEL_*``, ``DUSTIN_SPEED*``,
  ``PAIR_SPEED*``, ``QUALITY``, ``INPUT_AWARE_M``, ``KNAPSPEC_*`` ... Some list only the files that exist, so
  they look under ``RESULTS`` when this module is imported.

Tests point the package at other files by patching this module alone: ``RESULTS``, ``load`` (and
``load.cache_clear()``) and ``BENCH_PLAIN``. Every other module therefore reads those three as
``inputs.RESULTS``, ``inputs.load(...)`` and ``inputs.BENCH_PLAIN`` at call time, never as names of its own.
"""

from __future__ import annotations

import functools
import json
import pathlib
import shlex
import tomllib
from typing import Any, Callable, Dict, List, Tuple, Union

REPO = pathlib.Path(__file__).resolve().parents[2]  # experiments/tables/inputs.py
RESULTS = REPO / "experiments" / "results"
SUITES = REPO / "experiments" / "suites"
INDEX = RESULTS / "index.json"
RESULTS_MD = REPO / "docs" / "results.md"
README = REPO / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

PathStep = Union[str, int, Dict[str, Any]]
Extractor = Union[Tuple[PathStep, ...], Callable[[Dict[str, Any]], float]]


# ---------------------------------------------------------------------------- reading
@functools.lru_cache(maxsize=None)
def load(source: str) -> Dict[str, Any]:
    """The JSON of ``experiments/results/<source>``."""
    path = RESULTS / source
    if not path.exists():
        raise FileNotFoundError(f"{path}: results file named by a figure is missing")
    return json.loads(path.read_text())


def read_path(data: Any, path: Tuple[PathStep, ...]) -> Any:
    """Follow ``path``: a str / int indexes a dict / list; a dict selects the one list item whose fields match."""
    node = data
    for step in path:
        if isinstance(step, dict):
            hits = [item for item in node if all(item.get(k) == v for k, v in step.items())]
            if len(hits) != 1:
                raise KeyError(f"{step}: {len(hits)} matching items (expected 1)")
            node = hits[0]
        else:
            node = node[step]
    return node


@functools.lru_cache(maxsize=None)
def suite_steps() -> Dict[str, Tuple[str, str]]:
    """``{source: (suite name, command)}`` for every suite step that writes under experiments/results/."""
    steps = {}
    for path in sorted(SUITES.glob("*.toml")):
        suite = tomllib.loads(path.read_text())
        for step in suite.get("steps", []):
            argv = shlex.split(step["run"])
            if "--out" not in argv:
                continue
            out = argv[argv.index("--out") + 1]
            prefix = "experiments/results/"
            if out.startswith(prefix):
                env = "".join(f"{k}={shlex.quote(v)} "  # the suite's env, then the step's own (as the runner)
                              for k, v in {**suite.get("env", {}), **step.get("env", {})}.items())
                steps[out[len(prefix):]] = (path.stem, f"{env}python -m experiments.run {step['run']}")
    return steps


def command_of(source: str) -> str:
    steps = suite_steps()
    if source not in steps:
        raise KeyError(f"experiments/results/{source}: no suite step writes it (add one to experiments/suites/)")
    return steps[source][1]


def device_of(source: str) -> str:
    devices = load(source)["environment"]["devices"]
    return str(devices[0])


def split_csv(text) -> List[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def code_commit(data: Dict[str, Any]) -> str:
    """The commit a run's code was at: a copied tree records it as ``tree_commit`` beside its older git metadata."""
    env = data["environment"]
    return (env.get("tree_commit") or env.get("commit") or "?")[:7]


def tokens_k(tokens: int) -> str:
    """A context length in words: 32000 -> 32k, 16384 -> 16k."""
    return f"{tokens // 1000}k" if tokens % 1000 == 0 else f"{tokens // 1024}k"


DECODE = "bench_decode/bench_decode_qwen2.5-7b-shape_8k-32k_b16_h200.json"
GENERATE_AR = "generate/generate_smollm2-135m_ar_6.6k_b16_h200.json"
SKIP = "bench_skip/bench_skip_qwen2.5-7b-shape_8k_b16_h200.json"
SKIP_CMDBUF = "bench_skip/bench_skip_qwen2.5-7b-shape_8k_b16_cmdbuf_h200.json"
#: bench-decode --projections separate,fused: the decode step with both layouts timed alternately in one run
#: (docs/methods.md §2, fused projections): (device tag, shape, file); a file not there yet is "not measured"
#: decoder layers of each bench-decode shape (jaxspec.config presets), for per-layer counts
SHAPE_LAYERS = {"smollm2-135m-shape": 30, "qwen2.5-7b-shape": 28, "qwen2.5-0.5b-shape": 24}
DECODE_PROJECTIONS = (
    ("cpu", "smollm2-135m-shape", "bench_decode/bench_decode_projections_smollm2-135m-shape_1k_b1-16_cpu.json"),
    ("h100", "qwen2.5-7b-shape", "bench_decode/bench_decode_projections_qwen2.5-7b-shape_8k-32k_b16_h100.json"),
    ("h100", "qwen2.5-0.5b-shape", "bench_decode/bench_decode_projections_qwen2.5-0.5b-shape_512-32k_b16_h100.json"),
    ("h200", "qwen2.5-7b-shape", "bench_decode/bench_decode_projections_qwen2.5-7b-shape_8k-32k_b16_h200.json"),
    ("h200", "qwen2.5-0.5b-shape", "bench_decode/bench_decode_projections_qwen2.5-0.5b-shape_512-32k_b16_h200.json"),
)
#: the traced 32k/b16 sparse-draft round per GPU, one run per layout (docs/methods.md §2, fused projections):
#: (tag, ((index slug, label, file), ...)); the first is the baseline the others are read against
DUSTIN_TRACE_FUSED = (
    ("h100", (("separate-projections", "separate",
               "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_sparse-draft_trace_pair-tau_h100.json"),
              ("fused-projections", "fused",
               "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_sparse-draft_fused-projections_trace_pair-tau_h100.json"),
              ("fused-projections-command-buffers", "fused + command buffers",
               "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_sparse-draft_fused-projections_cmdbuf_trace_pair-tau"
               "_h100.json"))),
    ("h200", (("separate-projections", "separate",
               "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_sparse-draft_trace_h200.json"),
              ("fused-projections", "fused",
               "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_sparse-draft_fused-projections_trace_h200.json"))),
)
#: the traced 32k/b16 sparse-draft round split by phase on the device (``dustin-speed --trace``, the round's named
#: scopes; docs/gpu.md), per GPU and target SRH choice: (tag, index slug ("" for the default heads), label, file)
DUSTIN_TRACE_PHASES = (
    ("h100", "", "target SRHs over 4 KV groups",
     "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_sparse-draft_phases_trace_pair-tau_h100.json"),
    ("h100", "srh-1group", "target SRHs in one KV group",
     "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_srh-1group_phases_trace_pair-tau_h100.json"),
    ("h100", "scoring-heads", "target SRHs over 4 KV groups, scored in one product over every KV head",
     "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_scoring-heads_phases_trace_pair-tau_h100.json"),
    ("h100", "scoring-pallas", "target SRHs over 4 KV groups, logits from the Pallas scoring kernel",
     "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_scoring-pallas_phases_trace_pair-tau_h100.json"),
    ("h100", "srh-1group-scoring-pallas", "target SRHs in one KV group, logits from the Pallas scoring kernel",
     "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_srh-1group_scoring-pallas_phases_trace_pair-tau_h100.json"),
    ("h100", "srh-1group-scoring-pallas-repeat", "target SRHs in one KV group, logits from the Pallas scoring kernel, "
     "run again (the tracer placing the kernel by name)",
     "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_srh-1group_scoring-pallas_phases_trace_pair-tau_repeat_h100.json"),
    ("h200", "", "target SRHs over 4 KV groups",
     "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_sparse-draft_phases_trace_h200.json"),
    ("h200", "scoring-heads", "target SRHs over 4 KV groups, scored in one product over every KV head",
     "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_scoring-heads_phases_trace_h200.json"),
    ("h200", "srh-1group", "target SRHs in one KV group",
     "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_srh-1group_phases_trace_h200.json"),
    ("h200", "scoring-pallas", "target SRHs over 4 KV groups, logits from the Pallas scoring kernel",
     "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_scoring-pallas_phases_trace_h200.json"),
    ("h200", "srh-1group-scoring-pallas", "target SRHs in one KV group, logits from the Pallas scoring kernel",
     "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_srh-1group_scoring-pallas_phases_trace_h200.json"),
)
#: the round phases in the order the tables show them (jaxspec.decoding.speculative.ROUND_PHASES, plus the trace's
#: ``other`` and ``unattributed``)
ROUND_PHASES = ("draft", "verification", "selection", "commit", "other", "unattributed")
#: the engine's plain stretch against the AR loop on one cache (bench-plain), per GPU: (file, suite)
BENCH_PLAIN = {"h100": ("bench_plain/bench_plain_qwen2.5-1.5b-shape_32k_b1-16_h100.json", "h100-long-context"),
               "h200": ("bench_plain/bench_plain_qwen2.5-1.5b-shape_32k_b1-16_h200.json", "h200-ar-decode")}
PLAIN_VARIANTS = (("ar", "the AR loop"), ("plain", "the engine's plain stretch"),
                  ("plain-keep-finished", "the same, finished rows reading their history"),
                  ("plain-static-bound", "the stretch with a static loop bound"))
PARITY = {("smollm2-135m", "cpu"): "parity/parity_smollm2-135m_cpu.json",
          ("smollm2-135m", "h200"): "parity/parity_smollm2-135m_h200.json",
          ("qwen2.5-7b-shape", "h200"): "parity/parity_qwen2.5-7b-shape_h200.json",
          ("qwen2.5-coder-0.5b", "cpu"): "parity/parity_qwen2.5-coder-0.5b_cpu.json"}
KERNEL_FILES = ("bench_attention/bench_attention_qwen2.5-7b_16k-32k_b1-16_h200.json",
                "bench_attention/bench_attention_qwen2.5-7b_8k_b1-16_h200.json",
                "bench_attention/bench_attention_qwen2.5-72b_8k-32k_b1-16_h200.json")
KERNEL_7B, _, KERNEL_72B = KERNEL_FILES
#: dense vs sparse attention of all layers by device kernel time (suite h200-attention-kernels, step device-time-32k-b16)
#: all layers by device kernel time, each variant split kernel by kernel (the earlier run without the split:
#: attention_device_time/attention_device_time_qwen2.5-7b_72b_32k_b16_k512_h200.json)
KERNEL_DEVICE = "attention_device_time/attention_device_time_kernels_qwen2.5-7b_72b_32k_b16_k512_h200.json"
#: the same measure with the layers unrolled: one call per layer on inputs of its own (no loop slices or stacked writes)
KERNEL_DEVICE_UNROLLED = "attention_device_time/attention_device_time_unrolled_qwen2.5-7b_72b_32k_b16_k512_h200.json"
#: the same on an H100 (suite h100-long-context)
KERNEL_DEVICE_UNROLLED_H100 = "attention_device_time/attention_device_time_unrolled_qwen2.5-7b_72b_32k_b16_k512_h100.json"
#: the exact top-k of the selection at 32k on an H100 (suite h100-long-context, step topk-radix-32k): the 8-bit
#: scatter-add radix, the 4-bit compare radix and lax.top_k, with SRH scoring and the whole selection, batch 1/8/16
KERNEL_TOPK_H100 = "bench_attention/bench_attention_qwen2.5-7b_32k_b1-16_topk_h100.json"
#: the top-k variants as bench-attention names them: (variant, label)
TOPK_VARIANTS = (("topk_radix8_scatter", "8-bit scatter-add radix"), ("topk_radix4_compare", "4-bit compare radix"),
                 ("topk_lax_top_k", "`lax.top_k`"))
KERNEL_DEVICE_FIRST = "attention_device_time/attention_device_time_qwen2.5-7b_72b_32k_b16_k512_h200.json"
DEVICE_TARGETS = {"qwen2.5-7b": ("7b", 20.0), "qwen2.5-72b": ("72b", 28.0)}  # the paper: 27.85x at 72B
KERNEL_VARIANTS = "kernel_explore/kernel_explore_qwen2.5-7b_32k_b16_k512_h200.json"
SELF_DRAFT = "generate/generate_smollm2-135m_sd-attn8-12_767_b16_h200.json"
SELF_DRAFT_SWEEP = {spec: f"generate/generate_smollm2-135m_sd-{name}_767_b1_64new_cpu.json" for spec, name in (
    ("attn:8-12", "attn8-12"), ("attn:5,8,11,14,17,20", "attn5-8-11-14-17-20"), ("mlp:10-12", "mlp10-12"),
    ("attn:4-20", "attn4-20"), ("attn:2-27", "attn2-27"))}
GREEDY_IDENTITY = {"float32": "generate/generate_smollm2-135m_sd-mlp10-12_767_b1_f32_cpu.json",
                   "bfloat16": "generate/generate_smollm2-135m_sd-mlp10-12_767_b1_bf16_cpu.json"}
BENCH_SD = "bench_sd/bench_sd_qwen2.5-7b-shape_8k-32k_b8-16_h200.json"
BENCH_SD_SPLIT = "bench_sd/bench_sd_qwen2.5-7b-shape_32k_b8-16_h200.json"
PAIR_TAU = "generate/generate_qwen2.5-coder-1.5b_sd-qwen2.5-coder-0.5b_2k_b1_cpu.json"
DUSTIN_SPEED = {16: "dustin_speed/dustin_speed_qwen2.5-7b-shape_8k-32k_b16_h200.json",
                8: "dustin_speed/dustin_speed_qwen2.5-7b-shape_8k-32k_b8_h200.json"}
DUSTIN_TRACE = "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_trace_h200.json"
#: the same trace with the sparse draft KV, each method at the tau the real pair measured for it
DUSTIN_TRACE_SPARSE = "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_sparse-draft_trace_h200.json"
#: batch 16 at 8k-32k, all six methods in one process, each at the tau the real pair measured for it (the sparse
#: draft KV from the real pair's sparse-draft runs at 16k and 32k)
DUSTIN_SPEED_SPARSE = "dustin_speed/dustin_speed_qwen2.5-7b-shape_8k-32k_b16_sparse-draft_pair-tau_h200.json"
#: the same batch-16 methods at 32k and 16k with finished rows reading one cache slot (docs/methods.md §5.7)
DUSTIN_SPEED_FINISHED = "dustin_speed/dustin_speed_qwen2.5-7b-shape_16k-32k_b16_finished-rows-skipped_pair-tau_h200.json"
#: the same with finished rows reading their whole history (--keep-finished-rows)
DUSTIN_SPEED_FINISHED_KEPT = "dustin_speed/dustin_speed_qwen2.5-7b-shape_16k-32k_b16_finished-rows-kept_pair-tau_h200.json"
#: the same six methods at batch 8 (taus from the real pair's batch-8 runs), when measured
DUSTIN_SPEED_SPARSE_B8 = "dustin_speed/dustin_speed_qwen2.5-7b-shape_8k-32k_b8_sparse-draft_pair-tau_h200.json"
#: the earlier, shorter run of the 32k point alone (AR, full-KV Dustin-H, the streaming draft KV)
DUSTIN_SPEED_SPARSE_32K = "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_sparse-draft_pair-tau_h200.json"
DUSTIN_SPEED_SPARSE_METHODS = (("ar", "AR"), ("dustin", "Dustin-H (full draft KV)"),
                               ("dustin-kv-streaming", "Dustin-H, draft reads sinks + window"),
                               ("dustin-kv-verify-set", "Dustin-H, draft reads the last I_verify + window"))
#: batch 16 at 8k-32k, each method at the tau pair-speed measured for it on the real pair (nearest context, batch 16)
DUSTIN_SPEED_PAIR_TAU = "dustin_speed/dustin_speed_qwen2.5-7b-shape_8k-32k_b16_pair-tau_h200.json"
DUSTIN_SPEED_RESELECT = "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_reselect2_pair-tau_h200.json"
#: GQA-aware SRHs on the GPU: the target's 4 SRHs in one KV group (--target-heads 0,1,2,3), each against the run with
#: them spread over 4 groups that it repeats: (selecting when, file, baseline file, index tag, the baseline's index
#: tag, device; the H200 baselines are indexed elsewhere under their own keys). The H100 runs
#: (suite h100-dustin-speed) hold both pairs and the every-round pair once more, all in one suite run.
_D = "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_"
DUSTIN_SPEED_SRH_1GROUP = (
    ("every round", f"{_D}srh-1group_pair-tau_h200.json", f"{_D}sparse-draft_pair-tau_h200.json", "srh-1group", None, "h200"),
    ("every second round", f"{_D}reselect2_srh-1group_pair-tau_h200.json", DUSTIN_SPEED_RESELECT,
     "reselect2-srh-1group", None, "h200"),
    ("every round", f"{_D}srh-1group_pair-tau_h100.json", f"{_D}sparse-draft_pair-tau_h100.json", "srh-1group",
     "sparse-draft", "h100"),
    ("every second round", f"{_D}reselect2_srh-1group_pair-tau_h100.json", f"{_D}reselect2_pair-tau_h100.json",
     "reselect2-srh-1group", "reselect2", "h100"),
    ("every round, run again", f"{_D}srh-1group_pair-tau_repeat_h100.json", f"{_D}sparse-draft_pair-tau_repeat_h100.json",
     "srh-1group-repeat", "sparse-draft-repeat", "h100"))
DEVICE_NAME = {"h200": "H200", "h100": "H100"}
#: selection every third round at 32k/b16, each method at the tau the real pair measured with it
DUSTIN_SPEED_RESELECT3 = f"{_D}reselect3_pair-tau_h200.json"
#: dustin-speed runs that shared their GPU with another process for part of the run: file -> what ran beside it
DUSTIN_SPEED_SHARED_GPU = {
    f"{_D}srh-1group_pair-tau_h200.json": "another process on the same GPU was loading two models and saving "
                                          "converted copies of their weights"}
#: the real pair end to end with the one-group profile, against the run with the committed profile
PAIR_SPEED_SRH_1GROUP = ("pair_speed/pair_speed_qwen2.5-coder-1.5b_0.5b_32k_b16_srh-1group_h200.json",
                         "pair_speed/pair_speed_qwen2.5-coder-1.5b_0.5b_32k_b16_sparse-draft_h200.json")
DUSTIN_SMOLLM2_TAU = "dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b8-16_smollm2-tau_h200.json"
E2E = {("ClassicSD (self-draft mlp:10-12)", "Pallas"): "generate/generate_smollm2-135m_sd-mlp10-12_7.6k_b16_pallas_h200.json",
       ("MagicDec k = 512", "Pallas"): "generate/generate_smollm2-135m_magicdec-k512_7.6k_b16_pallas_h200.json",
       ("Dustin k = 512", "Pallas"): "generate/generate_smollm2-135m_dustin-k512_7.6k_b16_pallas_h200.json",
       ("Dustin k = 512", "XLA"): "generate/generate_smollm2-135m_dustin-k512_7.6k_b16_xla_h200.json"}
REAL_PAIR = tuple((slug, label, f"generate/generate_qwen2.5-coder-1.5b_{tag}-qwen2.5-coder-0.5b_8k_b1_xla_h200.json")
                  for slug, label, tag in (("classic", "ClassicSD", "sd"), ("magicdec", "MagicDec k = 512", "magicdec-k512"),
                                           ("dustin", "Dustin-H k = 512", "dustin-k512")))
#: self-speculative sparse verification on the CPU (docs/methods.md §5.5): (slug, label, source)
SELFSPEC_CPU = tuple((slug, label, f"generate/generate_smollm2-135m_{tag}_767_b1_128new_cpu.json") for slug, label, tag in (
    ("knapspec", "KnapSpec (paper), re-plan every 16 rounds", "knapspec-i16"),
    ("knapspec-dustin", "KnapSpec plans keeping the SRH layers' attention + Dustin verification k = 512",
     "knapspec-dustin-k512-i16"),
    ("dustin-streaming-selfdraft", "Dustin k = 512 with the mlp:10-12 self-draft reading 4 sinks + a window",
     "dustin-k512-kv-streaming-mlp10-12")))
PS = "pair_speed/pair_speed_qwen2.5-coder-1.5b_0.5b_"
#: pair-speed files with bfloat16 speed cases, in the suite's order (a file may hold no case yet)
PAIR_SPEED_SPARSE_DRAFT = f"{PS}32k_b16_sparse-draft_h200.json"  # Dustin-H beside its two sparse-draft views
PAIR_SPEED_SPARSE_DRAFT_16K = f"{PS}16k_b16_sparse-draft_h200.json"  # the same three at 16k
PAIR_SPEED_SPARSE_DRAFT_B8 = f"{PS}8k-32k_b8_sparse-draft_h200.json"  # the same three at batch 8, 8k-32k
#: the 1.5B as its own draft over sinks + a window (no second model), batch 16 and 1, when measured
PAIR_SPEED_SELF = tuple(f"pair_speed/pair_speed_qwen2.5-coder-1.5b_self-draft_8k-32k_b{b}_h200.json" for b in (16, 1))
#: Dustin-H's self-draft at 32k/b16 again: the per-round split at gamma 4, 6 and 8, and the whole-loop command
#: buffers (CUDA graphs) at gamma 4 (32k and 16k) and 6; the sparse draft KV with command buffers (16k and 32k)
PSS = "pair_speed/pair_speed_qwen2.5-coder-1.5b_self-draft_"
PAIR_SPEED_SELF_LEVERS = (f"{PSS}32k_b16_split_h200.json", f"{PSS}32k_b16_gamma6_h200.json",
                          f"{PSS}32k_b16_gamma8_h200.json", f"{PSS}16k-32k_b16_cmdbuf_h200.json",
                          f"{PSS}32k_b16_gamma6_cmdbuf_h200.json")
PAIR_SPEED_SPARSE_DRAFT_CMDBUF = f"{PS}16k-32k_b16_sparse-draft_cmdbuf_h200.json"
#: 32k/b16 again: with the per-round split and a trace, selecting every second round, under the measured choice
PAIR_SPEED_SPLIT_32K = f"{PS}32k_b16_split_h200.json"
PAIR_SPEED_RESELECT = f"{PS}32k_b16_reselect2_h200.json"
PAIR_SPEED_RESELECT3 = f"{PS}32k_b16_reselect3_h200.json"
#: ClassicSD, MagicDec and both Dustin-H drafts with finished rows reading one cache slot (docs/methods.md §5.7, the
#: default) and reading their whole history (--keep-finished-rows)
PAIR_SPEED_FINISHED = f"{PS}32k_b16_finished-rows-skipped_h200.json"
PAIR_SPEED_FINISHED_KEPT = f"{PS}32k_b16_finished-rows-kept_h200.json"
PAIR_SPEED_ARBITRATE = f"{PS}32k_b16_arbitrate_h200.json"
PAIR_SPEED = (f"{PS}32k_b16_h200.json", PAIR_SPEED_SPARSE_DRAFT, f"{PS}16k_b16_h200.json", PAIR_SPEED_SPARSE_DRAFT_16K,
              f"{PS}32k_b1_h200.json", f"{PS}8k-16k_b1_h200.json", f"{PS}8k-32k_b8_h200.json", f"{PS}8k_h200.json"
              ) + tuple(p for p in PAIR_SPEED_SELF + (PAIR_SPEED_SPARSE_DRAFT_B8, PAIR_SPEED_SPLIT_32K, PAIR_SPEED_RESELECT,
                                                      PAIR_SPEED_RESELECT3, PAIR_SPEED_FINISHED,
                                                      PAIR_SPEED_FINISHED_KEPT, PAIR_SPEED_ARBITRATE, PAIR_SPEED_SPARSE_DRAFT_CMDBUF)
                        + PAIR_SPEED_SELF_LEVERS if (RESULTS / p).exists())
#: pair-speed files measured while another pair-speed process used the same GPU (see the section's first note)
PAIR_SPEED_SHARED_GPU = frozenset({"pair_speed_qwen2.5-coder-1.5b_0.5b_8k_h200.json"})
PAIR_SPEED_F32 = f"{PS}8k_b2_f32_identity_h200.json"   # float32: greedy ClassicSD / MagicDec = AR
#: the measured choice's decisions from whole runs (docs/methods.md §5.2), and every method deciding from it
CHOICE_TABLE = "choice_table/choice_table_qwen2.5-coder-1.5b_0.5b_h200.json"
PAIR_SPEED_CHOICE_TABLE = f"{PS}32k_b8-16_choice-table_h200.json"
PAIR_SPEED_CHOICE_TABLE_GUARDED = f"{PS}32k_b8-16_choice-table-guarded_h200.json"
PAIR_SPEED_CHOICE_TABLE_GUARDED_NO_MARGIN = f"{PS}32k_b8-16_choice-table-guarded-no-margin_h200.json"
PAIR_SPEED_CHOICE_TABLE_OUTCOMES = f"{PS}32k_b8-16_choice-table-outcomes_h200.json"
#: the same, each method timed in 3 (AR, method) pairs (pair-speed --repeats 3; the median pair's speed-up)
PAIR_SPEED_CHOICE_TABLE_REPEATS = f"{PS}32k_b8-16_choice-table-outcomes_repeats_h200.json"
#: every method under the measured choice (probed, no choice table) on an H100, timed in 3 (AR, method) pairs
PAIR_SPEED_ARBITRATE_REPEATS_H100 = f"{PS}32k_b8_arbitrate_repeats_h100.json"
#: the H100's choice table, built from that probed run (choice-table --probed), and the same run deciding from it
CHOICE_TABLE_H100 = "choice_table/choice_table_qwen2.5-coder-1.5b_0.5b_h100.json"
PAIR_SPEED_CHOICE_TABLE_REPEATS_H100 = f"{PS}32k_b8_choice-table_repeats_h100.json"
#: plain runs of the real pair on an H100 (pair-speed --repeats 3; suite h100-long-context), the files that exist
PAIR_SPEED_H100 = tuple(p for p in (f"{PS}16k_b16_repeats_h100.json", f"{PS}32k_b16_repeats_h100.json")
                        if (RESULTS / p).exists())
#: the H100's table with its batch-16 plain run in it (step choice-table-b8-16) and the 32k/b16 run deciding from it
CHOICE_TABLE_H100_B16 = "choice_table/choice_table_qwen2.5-coder-1.5b_0.5b_b8-16_h100.json"
CHOICE_TABLE_H100_16K = "choice_table/choice_table_qwen2.5-coder-1.5b_0.5b_16k-32k_b8-16_h100.json"
PAIR_SPEED_CHOICE_TABLE_B16_REPEATS_H100 = f"{PS}32k_b16_choice-table_repeats_h100.json"
#: the input-aware m rules' selection cost against the fixed rule (bench-selection), per device
SELECTION_COST = (("cpu", "selection/selection_rules_cost_qwen2.5-coder-1.5b-profile_16k-32k_cpu.json"),
                  ("h200", "selection/selection_rules_cost_qwen2.5-coder-1.5b-profile_16k-32k_h200.json"),
                  # the coverage rule's wider candidate ladder (bench-selection --rules coverage-ladder --m-steps 4)
                  ("cpu", "selection/selection_rules_cost_ladder4_qwen2.5-coder-1.5b-profile_16k-32k_cpu.json"),
                  # the coverage rule's two scorings side by side (bench-selection --rules coverage-sort,coverage-radix)
                  ("cpu", "selection/selection_rules_cost_coverage-scoring_qwen2.5-coder-1.5b-profile_16k-32k_cpu.json"),
                  ("h200", "selection/selection_rules_cost_coverage-scoring_qwen2.5-coder-1.5b-profile_16k-32k_h200.json"),
                  ("h100", "selection/selection_rules_cost_coverage-scoring_qwen2.5-coder-1.5b-profile_16k-32k_h100.json"),
                  # the coverage rule deciding every third round, and the fixed rule with a per-row m
                  # (bench-selection --rules coverage,fixed-rows,coverage-held3)
                  *((device, f"selection/selection_rules_cost_held_qwen2.5-coder-1.5b-profile_16k-32k_{device}.json")
                    for device in ("cpu", "h100", "h200")),
                  # the held rule scheduled from the host and through select_held's lax.cond, side by side
                  # (bench-selection --rules fixed-rows,coverage-held3,coverage-held3-cond)
                  *((device, f"selection/selection_rules_cost_held-cond_qwen2.5-coder-1.5b-profile_16k-32k_{device}"
                             ".json") for device in ("cpu", "h100", "h200")),
                  # ... and as the unrolled decoding loop runs it, one program of the three rounds
                  # (bench-selection --rules fixed-rows,coverage-held3,coverage-held3-cond,coverage-held3-unrolled)
                  *((device, f"selection/selection_rules_cost_held-unrolled_qwen2.5-coder-1.5b-profile_16k-32k_"
                             f"{device}.json") for device in ("cpu", "h100", "h200")))
#: the held rule in the decoding loop (dustin-speed, 7B shape, 32k, batch 16): the fixed m, the coverage rule deciding
#: every third round with the loop unrolled over each cycle and through one round body's lax.cond (docs/methods.md
#: §3.7); device -> (file, suite step)
M_EVERY_LOOP = {device: (f"dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_m-every3_pair-tau_{device}.json",
                         f"{device}-dustin-speed b16-m-every-pair-tau-32k") for device in ("h100", "h200")}
#: ... and the same methods with the device traced (device -> file)
M_EVERY_LOOP_TRACE = {device: f"dustin_speed/dustin_speed_qwen2.5-7b-shape_32k_b16_m-every3_trace_pair-tau_{device}.json"
                      for device in ("h100", "h200")}
M_EVERY_LOOP_METHODS = (("dustin", "fixed m"), ("dustin-cov-held3", "coverage rule every 3rd round, unrolled loop"),
                        ("dustin-cov-held3-cond", "coverage rule every 3rd round, lax.cond"))
#: the coverage-scoring files time the default coverage rule beside its two scorings only for the comparison: their
#: "coverage" column is not indexed or judged again (the selection-rules-cost files carry it)
SELECTION_SCORING_ONLY = ("coverage-scoring", "cost_held")


def selection_rules_of(source: str, rules) -> List[str]:
    """The rules of a bench-selection file that the index and the verdicts report (a held-cond file's other rules
    repeat the held file's, so only its conditional rule is reported from it; a held-unrolled file's, its unrolled
    rule)."""
    if "cost_held-unrolled" in source:
        return [r for r in rules if r == "coverage-held3-unrolled"]
    if "cost_held-cond" in source:
        return [r for r in rules if r == "coverage-held3-cond"]
    if any(tag in source for tag in SELECTION_SCORING_ONLY):
        return [r for r in rules if r != "coverage"]
    return list(rules)


SELECTION_RULE_TAGS = {"coverage": "input-aware-coverage", "entropy": "input-aware-entropy",
                       "max-mass": "input-aware", "coverage-ladder": "input-aware-coverage-ladder",
                       "coverage-sort": "input-aware-coverage-sort", "coverage-radix": "input-aware-coverage-radix",
                       "fixed-rows": "fixed-per-row-m", "coverage-held3": "input-aware-coverage-held3",
                       "coverage-held3-cond": "input-aware-coverage-held3-cond",
                       "coverage-held3-unrolled": "input-aware-coverage-held3-unrolled", "fixed-cycle3": "fixed-cycle3"}
#: the rules that decide only in some rounds (bench-selection, docs/methods.md §3.7)
HELD_SELECTION_RULES = ("coverage-held3", "coverage-held3-cond", "coverage-held3-unrolled")
#: MeasuredChoiceController's default table_tail_margin (jaxspec.decoding.arbitration; tests check they agree)
TABLE_TAIL_MARGIN = 0.1
PAIR_SPEED_CHECK = f"{PS}8k_h200.json"                  # holds the Pallas-vs-XLA logits check
PAIR_SPEED_SUITE = "h200-qwen-pair"
PAIR_SPEED_PLOT = f"{PS}speedup_h200.png"
PAIR_METHODS = (("sd", "ClassicSD"), ("magicdec", "MagicDec"), ("dustin", "**Dustin-H**"),
                ("streaming", "StreamingLLM verification"), ("quest", "Quest verification"),
                ("dustin-kv-streaming", "Dustin-H, draft reads sinks + window"),
                ("dustin-kv-verify-set", "Dustin-H, draft reads the last I_verify + window"),
                ("magicdec-self", "MagicDec self-draft (the 1.5B over sinks + window, dense verification)"),
                ("dustin-self", "Dustin-H self-draft (the 1.5B over sinks + window, verification on I_verify)"))
SPARSE_DRAFT_KV = tuple((slug, label, f"generate/generate_qwen2.5-coder-1.5b_{tag}-qwen2.5-coder-0.5b_2k_b1_cpu.json")
                        for slug, label, tag in (
                            ("dustin-full-kv", "Dustin-H k = 512, full draft KV", "dustin-k512"),
                            ("dustin-verify-set-kv", "Dustin-H k = 512, verify-set draft KV", "dustin-k512-kv-verify-set"),
                            ("dustin-streaming-kv", "Dustin-H k = 512, streaming draft KV", "dustin-k512-kv-streaming")))
#: full-KV Dustin-H selecting I_verify every second round (docs/methods.md §3.8), the same prompt and run as above
RESELECT_CPU = "generate/generate_qwen2.5-coder-1.5b_dustin-k512-reselect2-qwen2.5-coder-0.5b_2k_b1_cpu.json"
#: the same prompt: MagicDec (the 0.5B over sinks + window, dense verification) and the verify-set variant under
#: the measured choice between speculation and AR (docs/methods.md §5.2); both with the warm-up run
MAGICDEC_CPU = "generate/generate_qwen2.5-coder-1.5b_magicdec-k512-qwen2.5-coder-0.5b_2k_b1_cpu.json"
ARBITRATE_CPU = "generate/generate_qwen2.5-coder-1.5b_dustin-k512-kv-verify-set-arbitrate8-qwen2.5-coder-0.5b_2k_b1_cpu.json"
QUALITY = {"qwen2.5-coder-1.5b": ("dustin_quality/dustin_quality_qwen2.5-coder-1.5b_2k_cpu.json",
                                  "dustin_quality/dustin_quality_qwen2.5-coder-1.5b_4k-8k_cpu.json",
                                  "dustin_quality/dustin_quality_qwen2.5-coder-1.5b_16k_cpu.json",
                                  "dustin_quality/dustin_quality_qwen2.5-coder-1.5b_16k_h200.json",
                                  "dustin_quality/dustin_quality_qwen2.5-coder-1.5b_16k_k2048_h200.json",
                                  "dustin_quality/dustin_quality_qwen2.5-coder-1.5b_32k_h200.json"),
           "smollm2-135m": ("dustin_quality/dustin_quality_smollm2-135m_2k-8k_cpu.json",)}
DENSE = "dense (ClassicSD)"
#: the real pair measured on the H200 (its QUALITY files ending in _h200.json); the methods of its targets
QUALITY_GPU_MODEL = "qwen2.5-coder-1.5b"
QUALITY_GPU_METHODS = ("dustin-h", "dustin-t", "dustin-d", "streaming", "quest", "snapkv")
#: fixed m, the input-aware rules and the per-round oracle (docs/methods.md §3.7): (model, file), the files that exist
INPUT_AWARE_M = tuple((model, f"dustin_quality/dustin_quality_input_aware_m_{run}.json") for model, run in (
    ("smollm2-135m", "smollm2-135m_2k_cpu"), ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b_2k_cpu"),
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b_4k_cpu"), ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b_8k_cpu"),
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b_16k_cpu"),
    # the H200 run: 16000-token items (ctx16000 in its keys; the CPU's are 16384)
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b_16k_h200"), ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b_32k_h200"),
    # the 32k run on an H100 (the same step in h100-long-context)
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b_32k_h100"),
    # the coverage rule deciding every third round, beside fixed m and the oracle on the same items
    ("qwen2.5-coder-1.5b", "held_qwen2.5-coder-1.5b_2k_cpu"), ("qwen2.5-coder-1.5b", "held_qwen2.5-coder-1.5b_4k_cpu"),
    ("qwen2.5-coder-1.5b", "held_qwen2.5-coder-1.5b_32k_h100"),
    # the coverage rule with a wider candidate ladder (--m-steps), beside fixed m and the oracle on the same items
    ("qwen2.5-coder-1.5b", "ladder_qwen2.5-coder-1.5b_4k_cpu"),
    # the entropy rule's runs, files of their own (fixed m and the oracle repeat the 2k files' numbers)
    ("smollm2-135m", "entropy_smollm2-135m_2k_cpu"), ("qwen2.5-coder-1.5b", "entropy_qwen2.5-coder-1.5b_2k_cpu"))
    if (RESULTS / f"dustin_quality/dustin_quality_input_aware_m_{run}.json").is_file())
#: online runs with the profile's m per context length (``--dustin-m-per-length``; docs/methods.md §3.7), each on the
#: same items as an input-aware-m run with the profile's single m, whose fixed m and oracle they are scored against:
#: (model, file, that run's file, the recalibration run's file), the files that exist
INPUT_AWARE_M_PER_LENGTH = tuple(
    (model, f"dustin_quality/dustin_quality_input_aware_m_{run}.json",
     f"dustin_quality/dustin_quality_input_aware_m_{base}.json", f"dustin_quality/dustin_quality_profile_{recal}.json")
    for model, run, base, recal in (
        ("qwen2.5-coder-1.5b", "per-length_qwen2.5-coder-1.5b_32k_h100", "qwen2.5-coder-1.5b_32k_h100",
         "m-per-length-3kinds_qwen2.5-coder-1.5b_16k-32k_h100"),
        ("qwen2.5-coder-1.5b", "per-length_qwen2.5-coder-1.5b_16k_h100", "qwen2.5-coder-1.5b_16k_h200",
         "m-per-length-3kinds_qwen2.5-coder-1.5b_16k-32k_h100"))
    if (RESULTS / f"dustin_quality/dustin_quality_input_aware_m_{run}.json").is_file())
#: the coverage rule around the profile's m per context length deciding every third round (``--dustin-m-per-length``,
#: method dustin-h-cov-held; docs/methods.md §3.7), beside the per-length run deciding every round and the single-m
#: run on the same items: (model, file, the per-length run's file, the single-m run's file, suite step), the files
#: that exist (a run still resuming renders the items it has)
INPUT_AWARE_M_PER_LENGTH_HELD = tuple(
    (model, f"dustin_quality/dustin_quality_input_aware_m_{run}.json",
     f"dustin_quality/dustin_quality_input_aware_m_{per_length}.json",
     f"dustin_quality/dustin_quality_input_aware_m_{base}.json", step)
    for model, run, per_length, base, step in (
        ("qwen2.5-coder-1.5b", "per-length_held_qwen2.5-coder-1.5b_32k_h100", "per-length_qwen2.5-coder-1.5b_32k_h100",
         "qwen2.5-coder-1.5b_32k_h100", "h100-long-context 32k-input-aware-m-per-length-held"),)
    if (RESULTS / f"dustin_quality/dustin_quality_input_aware_m_{run}.json").is_file())
#: how predictable the per-round best m is (dustin-m-bounds; docs/methods.md §3.7): (model, file) that exist
M_BOUNDS = tuple((model, f"dustin_quality/dustin_quality_m_bounds_{run}.json") for model, run in (
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b_2k_cpu"),
    # the 4k study with the profile's m per context length (it repeats the same rounds and adds that m)
    ("qwen2.5-coder-1.5b", "per-length_qwen2.5-coder-1.5b_4k_cpu"))
    if (RESULTS / f"dustin_quality/dustin_quality_m_bounds_{run}.json").is_file())
#: the 4k study again with the m recalibrated on calibration tasks of the evaluation's kinds: its per-length columns
#: join the per-length file's table (every other number repeats it: the same rounds)
M_BOUNDS_3KINDS = ("dustin_quality/dustin_quality_m_bounds_per-length_qwen2.5-coder-1.5b_4k_cpu.json",
                   "dustin_quality/dustin_quality_m_bounds_per-length-3kinds_qwen2.5-coder-1.5b_4k_cpu.json")
M_BOUND_TAGS_3KINDS = (("length_m", "per-length-m-3kinds", "the m for this length recalibrated on tasks of the "
                                                            "evaluation's kinds"),
                       ("coverage_length_m", "coverage-offline-per-length-m-3kinds", "the coverage rule around it"),
                       ("coverage_length_m_held3", "coverage-offline-per-length-m-3kinds-held3",
                        "the coverage rule around it deciding every third round"))
#: the study's entries that depend on the per-length m (the rest repeat between two recalibrations of one study)
LENGTH_M_FIELDS = ("length_m", "coverage_length_m", "coverage_length_m_held3")
M_BOUND_TAGS = (("persistence", "persistence-bound", "the previous round's best m"),
                ("signal_proxy", "signal-proxy", "the next round's target signal as the recall weights (not causal)"),
                ("hindsight", "hindsight", "the hindsight rule (causal)"),
                ("best_fixed", "best-fixed-m", "the best single m for these rounds (hindsight)"),
                ("best_fixed_crossval", "best-fixed-m-crossval", "the best single m of the other half of the "
                                                                 "sequences (held out)"),
                ("coverage", "coverage-offline", "the coverage rule on the recorded signals"),
                ("coverage_crossval", "coverage-offline-crossval", "the coverage rule around the held-out single m"),
                ("length_m", "per-length-m", "the profile's m for this length (recalibrated on calibration tasks)"),
                ("coverage_length_m", "coverage-offline-per-length-m", "the coverage rule around that m"),
                ("coverage_held3", "coverage-offline-held3", "the coverage rule deciding every third round (its m "
                                                             "held between)"),
                ("coverage_length_m_held3", "coverage-offline-per-length-m-held3", "the coverage rule around the "
                                                                                   "length's m, deciding every third "
                                                                                   "round"))


def m_bounds_3kinds(source: str) -> Dict[str, Dict[str, Any]]:
    """The 3-kinds recalibration's studies per k where ``source`` is the study it repeats (empty otherwise); raises
    ValueError if the two files did not record the same rounds."""
    if source != M_BOUNDS_3KINDS[0] or not (RESULTS / M_BOUNDS_3KINDS[1]).is_file():
        return {}
    mine, theirs = load(source), load(M_BOUNDS_3KINDS[1])
    out = {}
    for key, study in theirs.items():
        if not (key.startswith("k") and isinstance(study, dict) and "gap_closed" in study):
            continue
        same = {f: v for f, v in study["arr"].items() if f not in LENGTH_M_FIELDS}
        if same != {f: v for f, v in mine[key]["arr"].items() if f not in LENGTH_M_FIELDS}:
            raise ValueError(f"{M_BOUNDS_3KINDS[1]} {key}: not the rounds of {source} (their other ARRs differ)")
        out[key] = study
    return out


#: the input-aware rules (docs/methods.md §3.7): quality method and the tag of its table columns
M_RULES = (("dustin-h-ia", "max_mass", "max-mass"), ("dustin-h-cov", "coverage", "coverage"),
           ("dustin-h-ent", "entropy", "entropy"), ("dustin-h-cov-held", "coverage_held", "coverage held"))
#: how each input-aware-m run drafts
INPUT_AWARE_M_DRAFT = {"smollm2-135m": "mlp:10-12 self-draft", "qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b draft"}
#: GQA-aware SRHs (docs/methods.md §3.4): the Qwen pair's profile with the best heads anywhere against the one whose
#: heads share one KV group per layer; quality on the same items at one commit, and the per-round scoring of both
SRH_GROUP_PROFILES = (("any", "experiments/profiles/qwen2.5-coder-1.5b_qwen2.5-coder-0.5b.json"),
                      ("1group", "experiments/profiles/qwen2.5-coder-1.5b_qwen2.5-coder-0.5b_srh-1group.json"))
SRH_GROUP_QUALITY = {ctx: tuple((tag, f"dustin_quality/dustin_quality_srh-{tag}_qwen2.5-coder-1.5b_{ctx // 1024}k_cpu.json")
                            for tag in ("any", "1group")) for ctx in (2048, 4096, 8192, 16384)}
SRH_GROUP_SCORING = "selection/selection_scoring_srh-groups_qwen2.5-coder-1.5b-profile_16k-32k_cpu.json"
#: the same scoring with the XLA products and the Pallas kernel (--scoring-layouts groups,pallas), per GPU
SCORING_LAYOUTS_GPU = tuple((gpu, f"selection/selection_scoring_layouts_srh-groups_qwen2.5-coder-1.5b-profile_16k-32k_{gpu}.json")
                            for gpu in ("h100", "h200"))
SRH_GROUP_METHODS = ("dustin-h", "dustin-t", "dustin-d")
QUALITY_PAIR = {"qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B + Qwen2.5-Coder-0.5B draft",
                "smollm2-135m": "SmolLM2-135M, self-draft mlp:10-12"}
K = "knapspec/knapspec_"
KNAPSPEC_RUNS = (  # (label, source, tag, context, batch, with the CLaSp / official rows from another file)
    ("CPU, SmolLM2-135M f32, 1k prompt, 256 new", f"{K}smollm2-135m_1k_b1_cpu.json", "cpu", 1024, 1, None),
    ("CPU, SmolLM2-135M f32, 1k prompt, 1024 new", f"{K}smollm2-135m_1k_b1_1024new_cpu.json", "cpu", 1024, 1, None),
    ("H200, Qwen2.5-7B shape bf16, 8k, b1, 256 new", f"{K}qwen2.5-7b-shape_8k_b1_h200.json", "h200", 8192, 1,
     f"{K}qwen2.5-7b-shape_8k-32k_b1_h200.json"),
    ("H200, Qwen2.5-7B shape bf16, 32k, b1, 256 new", f"{K}qwen2.5-7b-shape_32k_b1_h200.json", "h200", 32768, 1,
     f"{K}qwen2.5-7b-shape_8k-32k_b1_h200.json"),
    ("H200, Qwen2.5-7B shape bf16, 8k, b1, 1024 new", f"{K}qwen2.5-7b-shape_8k_b1_1024new_h200.json", "h200", 8192,
     1, None),
    ("H200, Qwen2.5-7B shape bf16, 8k, b16, 256 new", f"{K}qwen2.5-7b-shape_8k_b16_h200.json", "h200", 8192, 16,
     None),
    ("H200, SmolLM2-135M bf16, 1k, b1, 256 new", f"{K}smollm2-135m_1k-4k_b1_h200.json", "h200", 1024, 1, None),
    ("H200, SmolLM2-135M bf16, 4k, b1, 256 new", f"{K}smollm2-135m_1k-4k_b1_h200.json", "h200", 4096, 1, None),
    ("CPU, Qwen2.5-Coder-0.5B f32, 1k prompt, 128 new", f"{K}qwen2.5-coder-0.5b_1k_b1_cpu.json", "cpu", 1024, 1,
     None),
    ("CPU, Qwen2.5-Coder-1.5B f32, 1k prompt, 128 new", f"{K}qwen2.5-coder-1.5b_1k_b1_cpu.json", "cpu", 1024, 1,
     None),
    ("H200, Qwen2.5-Coder-1.5B (real) bf16, 8k, b1, 256 new", f"{K}qwen2.5-coder-1.5b_8k-32k_b1_h200.json", "h200",
     8192, 1, None),
)
#: the real Qwen2.5-Coder-1.5B on the H200 by batch (suite h200-knapspec); every case it holds becomes a figure
KNAPSPEC_REAL = {1: f"{K}qwen2.5-coder-1.5b_8k-32k_b1_h200.json", 16: f"{K}qwen2.5-coder-1.5b_8k-32k_b16_h200.json"}
#: KnapSpec with budgeted attention and the static skip set on the real 1.5B (h200-knapspec *-budget-static, *-static)
#: (batch, file, methods, variant): a variant names a run of a method under other settings (its figures' slug suffix)
KNAPSPEC_REAL_BASELINES = ((1, f"{K}qwen2.5-coder-1.5b_8k-32k_b1_budget-static_h200.json", ("knapspec-budget",
                                                                                                "static-skip"), ""),
                           (16, f"{K}qwen2.5-coder-1.5b_32k-8k_b16_budget_plan-rows_h200.json", ("knapspec-budget",), ""),
                           (16, f"{K}qwen2.5-coder-1.5b_32k-8k_b16_budget_plan-rows_no-allowance_h200.json",
                            ("knapspec-budget",), "no-allowance"),
                           (16, f"{K}qwen2.5-coder-1.5b_32k-8k_b16_static_h200.json", ("static-skip",), ""))
#: what each variant of KNAPSPEC_REAL_BASELINES changed
KNAPSPEC_VARIANTS = {"no-allowance": "without the planning allowance (16 reference tokens a row whatever they cost)"}
KNAPSPEC_EARLY = (f"{K}smollm2-135m_1k-4k_b1_cpu.json", f"{K}smollm2-135m_8k_b1_cpu.json")
#: the two-stage plan (docs/methods.md §5.6) on the real 1.5B, batch 1, a window of at least 64 tokens
KNAPSPEC_TWO_STAGE = f"{K}qwen2.5-coder-1.5b_8k-32k_b1_two-stage_h200.json"
KNAPSPEC_TWO_STAGE_CPU = f"{K}smollm2-135m_1k_b1_two-stage_cpu.json"  # the same plan on the CPU (cpu-knapspec)
#: the same plan made before the first round on the prompt's last tokens (docs/methods.md §5.6, --plan-at-start)
KNAPSPEC_AT_START_CPU = f"{K}smollm2-135m_1k_b1_two-stage_at-start_cpu.json"
#: the same plan made after 64 plainly decoded tokens, on those alone (docs/methods.md §5.6, --plan-after-plain)
KNAPSPEC_AFTER_PLAIN_CPU = f"{K}smollm2-135m_1k_b1_two-stage_after-plain_cpu.json"
#: the same with a per-step profile, the plan computing its window's states (own) or taking them from the stretch
KNAPSPEC_AFTER_PLAIN_STATES_CPU = {kind: f"{K}smollm2-135m_1k_b1_two-stage_after-plain_{kind}-states_cpu.json"
                                   for kind in ("own", "kept")}
#: the at-start two-stage planner on the real Qwen2.5-Coder-1.5B on the CPU (1k, batch 1, 256 new tokens)
KNAPSPEC_AT_START_QWEN_CPU = f"{K}qwen2.5-coder-1.5b_1k_b1_two-stage_at-start_cpu.json"
KNAPSPEC_PLAN_ROWS_AT_START = f"{K}qwen2.5-coder-1.5b_32k-8k_b16_plan-rows_at-start_h200.json"
KNAPSPEC_DP_PALLAS = f"{K}qwen2.5-coder-1.5b_32k-8k_b16_plan-rows_at-start_dp-pallas_h200.json"
#: the allowance pricing a plan at its measured cost (docs/methods.md §5.6, --plan-cost-scale-from)
KNAPSPEC_CALIBRATED_CPU = f"{K}smollm2-135m_1k_b1_two-stage_calibrated_cpu.json"
#: the two-stage step with plain decoding priced at the decode loop's own step (the profile's p)
KNAPSPEC_PLAIN_PRICED_CPU = f"{K}smollm2-135m_1k_b1_two-stage_plain-priced_cpu.json"
#: the at-start plan with its window's target states kept by the prefill, and the same plan computing them, one
#: profile (docs/methods.md §5.6, --start-states prefill / own)
KNAPSPEC_PREFILL_STATES_CPU = f"{K}smollm2-135m_1k_b1_two-stage_at-start_prefill-states_cpu.json"
KNAPSPEC_OWN_STATES_CPU = f"{K}smollm2-135m_1k_b1_two-stage_at-start_own-states_cpu.json"
#: the cheapest two-stage plan (2 search tokens, 1 finalist) with the prefill's states, the same profile
KNAPSPEC_ONE_FINALIST_CPU = f"{K}smollm2-135m_1k_b1_two-stage_at-start_prefill-states_1-finalist_cpu.json"
#: the same plan form on the real Qwen2.5-Coder-1.5B (its own profile)
KNAPSPEC_ONE_FINALIST_QWEN_CPU = f"{K}qwen2.5-coder-1.5b_1k_b1_two-stage_at-start_prefill-states_1-finalist_cpu.json"
#: the same with the knapsack weights capped at 2 (--weight-cap 2: 43 slot states instead of 71; docs/methods.md §4.3)
KNAPSPEC_ONE_FINALIST_CAP2_QWEN_CPU = (f"{K}qwen2.5-coder-1.5b_1k_b1_two-stage_at-start_prefill-states_1-finalist_"
                                       "weight-cap-2_cpu.json")
#: the same with the DP traced once per layer (--dp-layers unrolled; docs/methods.md §4.3), the profile's weights
KNAPSPEC_ONE_FINALIST_UNROLLED_QWEN_CPU = (f"{K}qwen2.5-coder-1.5b_1k_b1_two-stage_at-start_prefill-states_1-finalist_"
                                           "dp-unrolled_cpu.json")
KNAPSPEC_PLAN_ROWS_CALIBRATED = f"{K}qwen2.5-coder-1.5b_32k-8k_b16_plan-rows_calibrated_h200.json"
#: the two-stage plan at batch 16 on 2 rows' windows (docs/methods.md §5.6, `--plan-rows 2`), real 1.5B, 32k-8k
KNAPSPEC_PLAN_ROWS = f"{K}qwen2.5-coder-1.5b_32k-8k_b16_plan-rows_h200.json"
KNAPSPEC_TRACE = f"{K}qwen2.5-7b-shape_8k_b1_trace_h200.json"
#: AR, KnapSpec-budget and KnapSpec's two-stage plan on 2 rows decoding with the Pallas kernel (--attention-backend)
KNAPSPEC_PALLAS = f"{K}qwen2.5-coder-1.5b_32k-8k_b16_pallas_h200.json"
#: the same with every plan compiled for itself and a latency profile of compiled masks (--latency-fit forward-static)
KNAPSPEC_PALLAS_STATIC = f"{K}qwen2.5-coder-1.5b_32k-8k_b16_pallas_static_h200.json"
#: the same two KnapSpec variants at batch 1 on the kernel, static plans and a batch-1 profile of compiled masks
KNAPSPEC_PALLAS_B1 = f"{K}qwen2.5-coder-1.5b_32k-8k_b1_pallas_static_h200.json"
#: the same at 32k on an H100 (suite h100-long-context)
KNAPSPEC_PALLAS_B1_H100 = f"{K}qwen2.5-coder-1.5b_32k_b1_pallas_static_h100.json"
KNAPSPEC_PALLAS_B1_H100_AFTER_PLAIN = f"{K}qwen2.5-coder-1.5b_32k_b1_pallas_static_after-plain_h100.json"
#: the same with one untimed round (plain step) before each side of the probe (--probe-warmup 1)
KNAPSPEC_PALLAS_B1_H100_PROBE_WARMUP = f"{K}qwen2.5-coder-1.5b_32k_b1_pallas_static_after-plain_probe-warmup_h100.json"
#: and with the finalists rescored in one pass without conditionals (--rescore select)
KNAPSPEC_PALLAS_B1_H100_PROBE_WARMUP_SELECT = (f"{K}qwen2.5-coder-1.5b_32k_b1_pallas_static_after-plain_probe-warmup_"
                                               f"select_h100.json")
#: the probe-warmup run with both sides of the probe priced as two stretches (--probe-pricing two-stretch), per GPU
KNAPSPEC_PALLAS_B1_H100_TWO_STRETCH = (f"{K}qwen2.5-coder-1.5b_32k_b1_pallas_static_after-plain_probe-warmup_"
                                       f"two-stretch_h100.json")
KNAPSPEC_PALLAS_B1_H200_TWO_STRETCH = (f"{K}qwen2.5-coder-1.5b_32k_b1_pallas_static_after-plain_probe-warmup_"
                                       f"two-stretch_h200.json")
#: the two-stretch run with the latency profile fitted on half-skip masks (--latency-fit forward-static-half), per GPU
KNAPSPEC_PALLAS_B1_HALF_FIT = {tag: f"{K}qwen2.5-coder-1.5b_32k_b1_pallas_static_after-plain_two-stretch_half-fit_{tag}.json"
                               for tag in ("h100", "h200")}
#: batch 16 planning on one row (states from the prefill) with the half-skip fit, per GPU
KNAPSPEC_PALLAS_B16_HALF_FIT = {tag: f"{K}qwen2.5-coder-1.5b_32k_b16_pallas_static_1row_prefill-states_half-fit_{tag}.json"
                                for tag in ("h100", "h200")}
#: the same two with a profile that takes each call's fixed cost off its steps (docs/methods.md §4.1), on the H100
KNAPSPEC_PALLAS_B1_PER_STEP = {"h100": f"{K}qwen2.5-coder-1.5b_32k_b1_pallas_static_after-plain_two-stretch_half-fit_per-step_h100.json"}
KNAPSPEC_PALLAS_B16_PER_STEP = {"h100": f"{K}qwen2.5-coder-1.5b_32k_b16_pallas_static_1row_prefill-states_half-fit_per-step_h100.json"}
#: the batch-1 one with its first plan's window states kept by the plain stretch (docs/methods.md §5.6)
KNAPSPEC_PALLAS_B1_KEPT_STATES = {
    "h100": f"{K}qwen2.5-coder-1.5b_32k_b1_pallas_static_after-plain_two-stretch_half-fit_per-step_kept-states_h100.json"}
#: the batch-1 per-step run with one plan before the first round on the prompt's last 64 tokens (states from the
#: prefill), 2 search tokens and 1 finalist
KNAPSPEC_PALLAS_B1_AT_START_1_FINALIST = {"h100": f"{K}qwen2.5-coder-1.5b_32k_b1_pallas_static_at-start_prefill-states_"
                                                  "1-finalist_half-fit_per-step_h100.json"}
#: the same with the DP traced once per layer (--dp-layers unrolled), and with the knapsack weights capped at 2
KNAPSPEC_PALLAS_B1_AT_START_UNROLLED = {"h100": f"{K}qwen2.5-coder-1.5b_32k_b1_pallas_static_at-start_prefill-states_"
                                                "1-finalist_dp-unrolled_half-fit_per-step_h100.json"}
KNAPSPEC_PALLAS_B1_AT_START_UNROLLED_CAP2 = {"h100": f"{K}qwen2.5-coder-1.5b_32k_b1_pallas_static_at-start_prefill-"
                                                     "states_1-finalist_dp-unrolled_weight-cap-2_half-fit_per-step_"
                                                     "h100.json"}
#: batch 16 with one plan at the start on 2 rows' windows (states from the prefill), the DP traced once per layer,
#: and the same with the knapsack weights capped at 2
KNAPSPEC_PALLAS_B16_2ROWS_UNROLLED = {"h100": f"{K}qwen2.5-coder-1.5b_32k_b16_pallas_static_2rows_prefill-states_"
                                              "dp-unrolled_half-fit_per-step_h100.json"}
KNAPSPEC_PALLAS_B16_2ROWS_UNROLLED_CAP2 = {"h100": f"{K}qwen2.5-coder-1.5b_32k_b16_pallas_static_2rows_prefill-"
                                                   "states_dp-unrolled_weight-cap-2_half-fit_per-step_h100.json"}
#: the weight-cap-2 runs at batch 1 and 16 deciding from a choice table of the at-start runs whether to plan at all
#: (--choice-table, docs/methods.md §5.2)
KNAPSPEC_PALLAS_B1_AT_START_CAP2_TABLE = {"h100": f"{K}qwen2.5-coder-1.5b_32k_b1_pallas_static_at-start_prefill-"
                                                  "states_1-finalist_dp-unrolled_weight-cap-2_half-fit_per-step_"
                                                  "choice-table_h100.json"}
KNAPSPEC_PALLAS_B16_2ROWS_CAP2_TABLE = {"h100": f"{K}qwen2.5-coder-1.5b_32k_b16_pallas_static_2rows_prefill-states_"
                                                "dp-unrolled_weight-cap-2_half-fit_per-step_choice-table_h100.json"}
#: the KnapSpec choice table those two runs decide from (choice-table --from the five at-start runs above)
CHOICE_TABLE_KNAPSPEC_H100 = "choice_table/choice_table_knapspec_qwen2.5-coder-1.5b_h100.json"
#: the H200's: batch 16 at 8k-32k on the Pallas kernel with static plans deciding from a table of its H200 runs
KNAPSPEC_PALLAS_STATIC_TABLE_H200 = f"{K}qwen2.5-coder-1.5b_32k-8k_b16_pallas_static_choice-table_h200.json"
#: the same decoding 768 new tokens (the plan's fixed cost spread over 3x the decode)
KNAPSPEC_PALLAS_B1_KEPT_STATES_768 = {"h100": f"{K}qwen2.5-coder-1.5b_32k_b1_pallas_static_after-plain_two-stretch_"
                                              "half-fit_per-step_kept-states_768new_h100.json"}
#: what the two kept-states runs add to "on an H100 with static plans"
_KEPT_STATES_HOW = ("the first plan after 64 plain tokens on their states kept by the plain stretch, one untimed round "
                    "before each side of the probe and both sides priced as two stretches")
#: the traced plan runs: (file, device tag, what it adds, suite and step, index-key slug)
KNAPSPEC_PLAN_TRACES = tuple(
    (f"{K}qwen2.5-coder-1.5b_32k_b16_pallas_static{variant}_trace_{tag}.json", tag,
     ("on an H100" if tag == "h100" else "on the H200") + what,
     ("h100-long-context knapspec-" if tag == "h100" else "h200-knapspec ")
     + "qwen2.5-coder-1.5b-b16-32k-pallas-static-trace" + step, "pallas-static" + variant.replace("_", "-") + "-trace")
    for tag in ("h100", "h200")
    for variant, what, step in (("", "", ""), ("_cmdbuf", " with XLA's command buffers on", "-cmdbuf"),
                                ("_1row", " planning on one row's window (64 reference tokens)", "-1row"),
                                ("_1row_select", " planning on one row's window with the finalists rescored in one "
                                 "pass without conditionals (--rescore select)", "-1row-select"),
                                ("_1row_prefill-states", " planning on one row's window, its states kept by the "
                                 "prefill (--start-states prefill)", "-1row-prefill-states"))) + (
    # batch 1, where KnapSpec's plain steps ran 1.10x AR's: where a plainly decoding KnapSpec run's time goes
    (f"{K}qwen2.5-coder-1.5b_32k_b1_pallas_static_trace_h100.json", "h100", "on an H100 at batch 1",
     "h100-long-context knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-trace", "pallas-static-trace"),)
#: one plan's stages timed alone (bench-plan, docs/methods.md §5.6): (file, model label, device label), those that
#: exist
PLAN_STAGES = tuple((f"{K}plan_stages_{run}.json", model, device) for run, model, device in (
    ("smollm2-135m_2k_1row_cpu", "real SmolLM2-135M f32", "the CPU"),
    ("qwen2.5-coder-1.5b_1k_1row_w1-4_cpu", "real Qwen2.5-Coder-1.5B f32, knapsack weights 1 and 4 (71 slots, the "
     "latency profile's)", "the CPU"),
    ("qwen2.5-coder-1.5b_1k_1row_w1-2_cpu", "real Qwen2.5-Coder-1.5B f32, knapsack weights 1 and 2 (43 slots, "
     "--weight-cap 2)", "the CPU"),
    ("qwen2.5-1.5b-shape_32k_1row_h100", "the Qwen2.5-1.5B shape with random weights, bf16", "an H100"),
    ("qwen2.5-1.5b-shape_32k_1row_h200", "the Qwen2.5-1.5B shape with random weights, bf16", "the H200"),
    ("qwen2.5-1.5b-shape_32k_1row_2search_1finalist_h100", "the Qwen2.5-1.5B shape with random weights, bf16, the DP "
     "on 2 search tokens and 1 finalist", "an H100"),
    ("qwen2.5-1.5b-shape_32k_2row_unrolled_h100", "the Qwen2.5-1.5B shape with random weights, bf16, 2 plan rows "
     "(the batch-16 runs' --plan-rows 2)", "an H100"),
    *((f"real-masks_qwen2.5-1.5b-shape_{run}", f"the Qwen2.5-1.5B shape with random weights, {dtype}, the finalists "
       "the real 1-row plan at 32k/b16 chose (--masks-from)", device)
      for run, dtype, device in (("1k_1row_cpu", "f32", "the CPU"), ("32k_1row_h100", "bf16", "an H100"),
                                 ("32k_1row_h200", "bf16", "the H200"))))
    if (RESULTS / f"{K}plan_stages_{run}.json").is_file())
#: (file, index-key suffix, what the run adds to "on the Pallas attention kernel")
KNAPSPEC_PALLAS_RUNS = ((KNAPSPEC_PALLAS, "pallas", ""),
                        (KNAPSPEC_PALLAS_B1, "pallas-static",
                         " with static plans and a profile of compiled masks (--latency-fit forward-static)"),
                        (KNAPSPEC_PALLAS_B1_H100, "pallas-static",
                         " on an H100 with static plans and a profile of compiled masks (--latency-fit "
                         "forward-static)"),
                        (KNAPSPEC_PALLAS_B1_H100_AFTER_PLAIN, "pallas-static-after-plain",
                         " on an H100 with static plans, a profile of compiled masks and the first plan after 64 "
                         "plain tokens on those alone (--plan-after-plain 64)"),
                        (KNAPSPEC_PALLAS_B1_H100_PROBE_WARMUP, "pallas-static-after-plain-probe-warmup",
                         " on an H100 with static plans, a profile of compiled masks, the first plan after 64 plain "
                         "tokens on those alone and one untimed round before each side of the probe (--probe-warmup "
                         "1)"),
                        (KNAPSPEC_PALLAS_B1_H100_PROBE_WARMUP_SELECT, "pallas-static-after-plain-probe-warmup-select",
                         " on an H100 with static plans, a profile of compiled masks, the first plan after 64 plain "
                         "tokens, one untimed round before each side of the probe and the finalists rescored without "
                         "conditionals (--rescore select)"),
                        *((source, "pallas-static-after-plain-two-stretch",
                           f" on {gpu} with static plans, a profile of compiled masks, the first plan after 64 plain "
                           "tokens, one untimed round before each side of the probe and both sides priced as two "
                           "stretches (--probe-pricing two-stretch)")
                          for source, gpu in ((KNAPSPEC_PALLAS_B1_H100_TWO_STRETCH, "an H100"),
                                              (KNAPSPEC_PALLAS_B1_H200_TWO_STRETCH, "the H200"))),
                        *((runs[tag], slug, f" on {gpu} with static plans, {what} and a profile of compiled "
                                            "half-skip masks (--latency-fit forward-static-half)")
                          for tag, gpu in (("h100", "an H100"), ("h200", "the H200"))
                          for runs, slug, what in (
                              (KNAPSPEC_PALLAS_B1_HALF_FIT, "pallas-static-after-plain-two-stretch-half-fit",
                               "the first plan after 64 plain tokens, one untimed round before each side of the "
                               "probe and both sides priced as two stretches"),
                              (KNAPSPEC_PALLAS_B16_HALF_FIT, "pallas-static-1row-prefill-states-half-fit",
                               "one plan at the start on one row's window, its states kept by the prefill"))),
                        *((runs["h100"], slug, " on an H100 with static plans, " + what + " and a profile of "
                                               "compiled half-skip masks without each call's fixed cost (per step)")
                          for runs, slug, what in (
                              (KNAPSPEC_PALLAS_B1_PER_STEP, "pallas-static-after-plain-two-stretch-half-fit-per-step",
                               "the first plan after 64 plain tokens, one untimed round before each side of the "
                               "probe and both sides priced as two stretches"),
                              (KNAPSPEC_PALLAS_B16_PER_STEP, "pallas-static-1row-prefill-states-half-fit-per-step",
                               "one plan at the start on one row's window, its states kept by the prefill"),
                              (KNAPSPEC_PALLAS_B1_KEPT_STATES,
                               "pallas-static-after-plain-two-stretch-half-fit-per-step-kept-states",
                               _KEPT_STATES_HOW),
                              (KNAPSPEC_PALLAS_B1_KEPT_STATES_768,
                               "pallas-static-after-plain-two-stretch-half-fit-per-step-kept-states-768new",
                               _KEPT_STATES_HOW),
                              (KNAPSPEC_PALLAS_B1_AT_START_1_FINALIST,
                               "pallas-static-at-start-prefill-states-1-finalist-half-fit-per-step",
                               "one plan before the first round on the prompt's last 64 tokens (states from the "
                               "prefill), 2 search tokens and 1 finalist"),
                              (KNAPSPEC_PALLAS_B1_AT_START_UNROLLED,
                               "pallas-static-at-start-prefill-states-1-finalist-dp-unrolled-half-fit-per-step",
                               "one plan before the first round on the prompt's last 64 tokens (states from the "
                               "prefill), 2 search tokens and 1 finalist, the DP traced once per layer"),
                              (KNAPSPEC_PALLAS_B1_AT_START_UNROLLED_CAP2,
                               "pallas-static-at-start-prefill-states-1-finalist-dp-unrolled-weight-cap-2-half-fit-"
                               "per-step",
                               "one plan before the first round on the prompt's last 64 tokens (states from the "
                               "prefill), 2 search tokens and 1 finalist, the DP traced once per layer with the "
                               "knapsack weights capped at 2"),
                              (KNAPSPEC_PALLAS_B16_2ROWS_UNROLLED,
                               "pallas-static-2rows-prefill-states-dp-unrolled-half-fit-per-step",
                               "one plan at the start on 2 rows' windows (states from the prefill), the DP traced "
                               "once per layer"),
                              (KNAPSPEC_PALLAS_B16_2ROWS_UNROLLED_CAP2,
                               "pallas-static-2rows-prefill-states-dp-unrolled-weight-cap-2-half-fit-per-step",
                               "one plan at the start on 2 rows' windows (states from the prefill), the DP traced "
                               "once per layer with the knapsack weights capped at 2"),
                              (KNAPSPEC_PALLAS_B1_AT_START_CAP2_TABLE,
                               "pallas-static-at-start-prefill-states-1-finalist-dp-unrolled-weight-cap-2-half-fit-"
                               "per-step-choice-table",
                               "the batch-1 weight-cap-2 plan above deciding from a choice table of the at-start "
                               "runs whether to plan at all (--choice-table)"),
                              (KNAPSPEC_PALLAS_B16_2ROWS_CAP2_TABLE,
                               "pallas-static-2rows-prefill-states-dp-unrolled-weight-cap-2-half-fit-per-step-"
                               "choice-table",
                               "the batch-16 weight-cap-2 plan above deciding from a choice table of the at-start "
                               "runs whether to plan at all (--choice-table)"))),
                        (KNAPSPEC_PALLAS_STATIC, "pallas-static",
                         " with static plans and a profile of compiled masks (--latency-fit forward-static)"),
                        (KNAPSPEC_PALLAS_STATIC_TABLE_H200, "pallas-static-choice-table",
                         " with static plans and a profile of compiled masks, deciding from a choice table of the "
                         "H200's runs whether to plan at all (--choice-table)"),
                        *((source, slug, " with static plans and a profile of compiled masks (--latency-fit "
                                         "forward-static), " + what + ", one more run of each traced")
                          for source, _, what, _, slug in KNAPSPEC_PLAN_TRACES))


KNAPSPEC_64REF = f"{K}smollm2-135m_1k_b1_64ref_cpu.json"
#: the same 64 reference tokens, each fixed plan's acceptance estimate under both DP references (methods.md §4.3)
KNAPSPEC_ALPHA = f"{K}smollm2-135m_1k_b1_64ref_alpha_cpu.json"
#: predicted TPT (priced as the planner prices it, early exit modelled) against measured speed-up over fixed plans
KNAPSPEC_TPT_CORRELATION = f"{K}smollm2-135m_1k-2k_b1_tpt-correlation_cpu.json"
KNAPSPEC_TPT_CORRELATION_TARGET = f"{K}smollm2-135m_1k-2k_b1_tpt-correlation_target-ref_cpu.json"
#: the same correlation with each candidate plan timed in 3 (AR, plan) pairs, the median pair's speed-up
KNAPSPEC_TPT_CORRELATION_REPEATS = f"{K}smollm2-135m_1k-2k_b1_tpt-correlation_repeats_cpu.json"
TPT_CORRELATION_CONTEXTS = (1024, 2048)
#: the same measure on an H100 with the real Qwen2.5-Coder-1.5B at 32k, batch 1, each plan timed in 3 (AR, plan) pairs
KNAPSPEC_TPT_CORRELATION_H100 = f"{K}qwen2.5-coder-1.5b_32k_b1_tpt-correlation_h100.json"
KNAPSPEC_TPT_CORRELATION_H100_8 = f"{K}qwen2.5-coder-1.5b_32k_b1_tpt-correlation_8-finalists_h100.json"
#: a correlation run's candidates priced again (reprice-tpt): correlation file -> repriced file
REPRICED = {KNAPSPEC_TPT_CORRELATION_H100_8: f"{K}qwen2.5-coder-1.5b_32k_b1_tpt-correlation_8-finalists_repriced_h100.json"}
#: the index figures of a TPT-correlation run whose plans were each timed in 3 (AR, plan) pairs:
#: (correlation field, key slug, what, target)
PAIRED_CORRELATION_FIELDS = (
    ("pearson_predicted_tpt_vs_speedup", "predicted-tpt-vs-speedup",
     "predicted TPT vs the median of 3 paired speed-ups", "target >= 0.84 (paper 0.837)"),
    ("pearson_predicted_tpt_vs_throughput", "predicted-tpt-vs-throughput",
     "the same TPT vs the median pair's tokens/s", "target >= 0.84 (paper 0.837)"),
    ("pearson_measured_acceptance_vs_speedup", "measured-acceptance-vs-speedup",
     "measured acceptance vs the median paired speed-up", "paper 0.538 for acceptance"))
DP_REFERENCES = (("branch", "the window through the candidate (the paper)"),
                 ("target", "the target's K/V of earlier tokens"))
