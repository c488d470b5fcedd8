"""Every published number, from the committed JSON under experiments/results/.

``python -m experiments.tables`` regenerates, from the JSON alone:

* ``docs/results.md`` — the current numbers, grouped by what they measure, each figure with the
  JSON file it is read from and the command that reproduces it;
* the plots (``experiments/results/<experiment>/*.png``);
* ``experiments/results/index.json`` — every headline figure as ``{key, value, unit, device,
  command, source}``;
* the README's results block between ``<!-- results:begin -->`` and ``<!-- results:end -->``.

``python -m experiments.tables --check`` changes nothing and exits 1 if any of them would change.

The figures are declared in ``FIGURES`` (key, unit, source file, and a JSON path or a small
extractor); the command of a source file is the step of ``experiments/suites/*.toml`` whose
``--out`` is that file. This module imports no experiment module: it reads JSON and TOML only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import json
import pathlib
import re
import shlex
import statistics
import sys
import tomllib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

REPO = pathlib.Path(__file__).resolve().parent.parent
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
        data = load(self.source)
        raw = self.get(data) if callable(self.get) else read_path(data, self.get)
        return float(raw) * self.scale

    def entry(self) -> Dict[str, Any]:
        return {"key": self.key, "value": self.value(), "unit": self.unit, "device": device_of(self.source),
                "command": command_of(self.source), "source": f"experiments/results/{self.source}"}


DECODE = "bench_decode/bench_decode_qwen2.5-7b-shape_8k-32k_b16_h200.json"
GENERATE_AR = "generate/generate_smollm2-135m_ar_6.6k_b16_h200.json"
SKIP = "bench_skip/bench_skip_qwen2.5-7b-shape_8k_b16_h200.json"
SKIP_CMDBUF = "bench_skip/bench_skip_qwen2.5-7b-shape_8k_b16_cmdbuf_h200.json"
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
                    for device in ("cpu", "h100", "h200")))
#: the coverage-scoring files time the default coverage rule beside its two scorings only for the comparison: their
#: "coverage" column is not indexed or judged again (the selection-rules-cost files carry it)
SELECTION_SCORING_ONLY = ("coverage-scoring", "cost_held")


def selection_rules_of(source: str, rules) -> List[str]:
    """The rules of a bench-selection file that the index and the verdicts report."""
    if any(tag in source for tag in SELECTION_SCORING_ONLY):
        return [r for r in rules if r != "coverage"]
    return list(rules)


SELECTION_RULE_TAGS = {"coverage": "input-aware-coverage", "entropy": "input-aware-entropy",
                       "max-mass": "input-aware", "coverage-ladder": "input-aware-coverage-ladder",
                       "coverage-sort": "input-aware-coverage-sort", "coverage-radix": "input-aware-coverage-radix",
                       "fixed-rows": "fixed-per-row-m", "coverage-held3": "input-aware-coverage-held3"}
#: the rules that decide only in some rounds (bench-selection, docs/methods.md §3.7)
HELD_SELECTION_RULES = ("coverage-held3",)
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
    ("qwen2.5-1.5b-shape_32k_1row_h100", "the Qwen2.5-1.5B shape with random weights, bf16", "an H100"),
    ("qwen2.5-1.5b-shape_32k_1row_h200", "the Qwen2.5-1.5B shape with random weights, bf16", "the H200"),
    ("qwen2.5-1.5b-shape_32k_1row_2search_1finalist_h100", "the Qwen2.5-1.5B shape with random weights, bf16, the DP "
     "on 2 search tokens and 1 finalist", "an H100"),
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
                               "prefill), 2 search tokens and 1 finalist"))),
                        (KNAPSPEC_PALLAS_STATIC, "pallas-static",
                         " with static plans and a profile of compiled masks (--latency-fit forward-static)"),
                        *((source, slug, " with static plans and a profile of compiled masks (--latency-fit "
                                         "forward-static), " + what + ", one more run of each traced")
                          for source, _, what, _, slug in KNAPSPEC_PLAN_TRACES))


def _row(variant, k="-"):
    return {"variant": variant, "k": k}


def _kernel(shape, context, batch, variant, field, k="-"):
    return ("cases", f"{shape}/ctx{context}/b{batch}", "rows", _row(variant, k), field)


def _dustin(context, batch, method, field):
    return ("cases", f"ctx{context}/b{batch}", "rows", {"method": method}, field)


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


def _fixed_cases(d, prefix="cpu/summarize/ctx1024/b1/fixed/"):
    return [v for k, v in d["cases"].items() if k.startswith(prefix)]


def _fixed_median(*path, prefix="cpu/summarize/ctx1024/b1/fixed/"):
    def get(d):
        values = [read_path(c, path) for c in _fixed_cases(d, prefix)]
        values = sorted(v for v in values if v is not None)
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])
    return get


def _alpha_error(d, field="dp_alpha"):
    return max(abs(c[field] - c["acceptance_rate"]) for c in _fixed_cases(d))


def _chosen_fixed(d):
    """The fixed-plan case of the planner's own choice (the candidates' ``plan``), or None."""
    chosen = d["cases"]["cpu/summarize/ctx1024/b1/candidates"]["plan"].get("index")
    return next((c for c in _fixed_cases(d) if c.get("candidate") == chosen), None)


def knapspec_alpha_table() -> List[str]:
    """Each fixed plan of the alpha run: its acceptance estimate under both DP references beside the measured one."""
    if not (RESULTS / KNAPSPEC_ALPHA).exists():
        return []
    d = load(KNAPSPEC_ALPHA)
    chosen = _chosen_fixed(d)
    lines = [f"The DP's acceptance estimate under both references (docs/methods.md §4.3) for the same skip sets, "
             f"against the acceptance each measured as a fixed plan over 256 new tokens (SmolLM2-135M, CPU, the "
             f"1k summarisation prompt, 64 reference tokens = the first 64 AR tokens; `{KNAPSPEC_ALPHA}`):", "",
             "| skipped weight | Attn / MLP skipped | gamma | alpha, " + DP_REFERENCES[0][1] + " | alpha, "
             + DP_REFERENCES[1][1] + " | measured acceptance | tau | x AR |", "|---|---|---|---|---|---|---|---|"]
    for c in sorted(_fixed_cases(d), key=lambda c: c["weight"]):
        mark = " (the planner's choice)" if c is chosen else ""
        lines.append(f"| {c['weight']}{mark} | {c['final_skip']['n_skip_attn']} / {c['final_skip']['n_skip_mlp']} "
                     f"| {c['gamma']} | {c['alpha_branch']:.3f} | {c['alpha_target']:.3f} "
                     f"| {c['acceptance_rate']:.3f} | {c['tau']:.2f} | {c['speedup_vs_ar']:.2f} |")
    return ["\n".join(lines)]


def knapspec_dp_cost_note() -> str:
    """Why one DP on 64 reference tokens cannot fit 5 % of a 256-token decode on the CPU (from the 64ref JSON)."""
    d = load(KNAPSPEC_64REF)
    c = d["cases"]["cpu/summarize/ctx1024/b1/candidates"]
    layers = len(c["candidates"][0]["mask"])
    slots = (sum(c["weights"]) * layers) // 2 + 1  # skip budget floor((w_attn + w_mlp) L / 2) + 1 (methods.md §4.3)
    rows = slots * c["reference_tokens"]
    step = c["ar_decode_s"] / c["ar_new_tokens"]
    share = c["plan_share_of_ar_decode"]
    return (f"One DP at most 5 % of a {c['ar_new_tokens']}-token decode on the CPU: **{'met' if share <= 0.05 else 'missed'}** "
            f"({100 * share:.1f} %, SmolLM2, `{KNAPSPEC_64REF}`). The DP pushes each of its {slots} slot states "
            f"(skip budget + 1) of the {c['reference_tokens']} reference tokens through every sub-layer: {rows} "
            f"token rows in {c['plan_s']:.2f} s ({1e3 * c['plan_s'] / rows:.1f} ms a row) against "
            f"{c['ar_decode_s']:.2f} s for the AR decode ({1e3 * step:.1f} ms a step). One DP is the time of "
            f"{c['plan_s'] / step:.0f} decode steps where 5 % of the decode is {0.05 * c['ar_new_tokens']:.1f}: "
            f"on a 2-core CPU a row of a batched forward costs 1/{step / (c['plan_s'] / rows):.0f} of a decode step, "
            "so the DP as specified (every slot state through every sub-layer) cannot fit 64 reference tokens "
            "under 5 % here; on a GPU, where a decode "
            "step is bound by reading the weights and a few thousand rows cost little more, the same DP is not "
            "measured at 64 reference tokens yet." + knapspec_start_states_cpu_note())


def _start_plan_text(c) -> str:
    """One CPU KnapSpec case's first plan: its planning share, window, cost by stage against the prediction, and
    the run's speed-up."""
    a, share = c.get("plan_allowance") or {}, c["plan_fraction_of_decode"]
    if not c.get("plans"):
        return (f"no plan ({a.get('allowed_tokens')} reference tokens fit the {1e3 * a.get('plan_budget_s', 0):.0f} "
                f"ms budget), planning {100 * share:.1f} % of decode, {c['speedup_vs_ar']:.2f}x AR")
    p = c["plans"][0]
    st = p.get("stage_seconds") or {}
    return (f"planning {100 * share:.1f} % of decode on {p['reference_tokens']} reference tokens (the allowance "
            f"let {a.get('allowed_tokens')} in at its {1e3 * a.get('plan_budget_s', 0):.0f} ms budget), the plan "
            f"{1e3 * p['seconds']:.0f} ms (the window's states {1e3 * st.get('boundary_states', 0):.0f} ms, the DP "
            f"{1e3 * st.get('dp', 0):.0f} ms, rescoring {1e3 * st.get('rescore', 0):.0f} ms; predicted "
            f"{1e3 * p['predicted_seconds']:.0f} ms), {c['speedup_vs_ar']:.2f}x AR with the AR step "
            f"{1e3 * c['ar_step_s']:.1f} ms (gamma* = {p['gamma_star']}, output identical to AR: "
            f"{'yes' if c['identical_to_ar'] else 'no'})" + _postponed_text(c))


def _postponed_text(c) -> str:
    """How often a KnapSpec run put its next plan off because the last one still cost more than the allowed share of
    the decode time since it (docs/methods.md §5)."""
    n = int((c.get("timings") or {}).get("postponed_plans", 0))
    if not n:
        return ""
    return (f"; the re-plan was put off {n} time{'s' if n > 1 else ''} because the plan still cost more than "
            "the allowed share of the decode time since it, so the run made "
            f"{len(c['plans'])} plan{'s' if len(c['plans']) > 1 else ''}")


def knapspec_start_states_cpu_note() -> str:
    """The two-stage plan before the first round with its window's states kept by the prefill, against the same plan
    computing them (cpu-knapspec steps smollm2-135m-1k-two-stage-at-start-{prefill,own}-states, one profile)."""
    if not (RESULTS / KNAPSPEC_PREFILL_STATES_CPU).exists():
        return (" The two-stage plan with its window's states kept by the prefill: not measured yet (cpu-knapspec step "
                "smollm2-135m-1k-two-stage-at-start-prefill-states).")

    def case(source):
        (_, c), = [(k, v) for k, v in load(source)["cases"].items() if "speedup_vs_ar" in v]
        return c

    kept = case(KNAPSPEC_PREFILL_STATES_CPU)
    share = kept["plan_fraction_of_decode"]
    tokens = kept["plans"][0]["reference_tokens"] if kept.get("plans") else 0
    text = (f" The two-stage plan made before the first round with its window's target states kept by the prefill "
            f"(`--start-states prefill`, docs/methods.md §5.6; `{KNAPSPEC_PREFILL_STATES_CPU}`): "
            + _start_plan_text(kept) + f". At most 5 % with at least 64 reference tokens: "
            f"**{'met' if share <= 0.05 and tokens >= 64 else 'missed'}**")
    if (share > 0.05 or tokens < 64) and kept.get("plans"):
        p, a = kept["plans"][0], kept["plan_allowance"]
        st = p.get("stage_seconds") or {}
        decode = kept["timings"]["decode_s"]
        text += (f" (the DP on {load(KNAPSPEC_PREFILL_STATES_CPU)['config'].get('search_tokens')} search tokens alone "
                 f"took {100 * st.get('dp', 0) / decode:.1f} % of this decode; the allowance, sized at "
                 f"{100 * a['plan_budget_s'] / a['predicted_ar_decode_s']:.2f} % of the predicted decode, had "
                 f"{1e3 * (a['plan_budget_s'] - a['predicted_dp_search_s']):.0f} ms left after the search's predicted "
                 f"{1e3 * a['predicted_dp_search_s']:.0f} ms, at {1e3 * a['predicted_dp_s_per_token']:.1f} ms a window "
                 f"token; a 64-token window priced so is "
                 f"{100 * (a['predicted_dp_search_s'] + 64 * a['predicted_dp_s_per_token']) / a['predicted_ar_decode_s']:.1f}"
                 " % of the predicted decode: on this compute-bound CPU the search's slot rows and the finalists' "
                 "window rows cost too much against a decode step to fit 5 % of a 256-step decode at 64 tokens)")
    if (RESULTS / KNAPSPEC_OWN_STATES_CPU).exists():
        own = case(KNAPSPEC_OWN_STATES_CPU)
        text += (f". The same plan computing the states itself (`--start-states own`, the same profile, "
                 f"`{KNAPSPEC_OWN_STATES_CPU}`): " + _start_plan_text(own))
        text += (f". The prefill took {kept['prefill']['s']:.1f} s keeping the states and {own['prefill']['s']:.1f} s "
                 "without (each its process's first prefill, compilation included)")
        if kept.get("plans") and own.get("plans") and kept["plans"][0]["gamma_star"] == own["plans"][0]["gamma_star"] == 0:
            text += (f". Both plans chose plain decoding, so the speed-ups differ by the paired AR runs' step "
                     f"({1e3 * kept['ar_step_s']:.1f} against {1e3 * own['ar_step_s']:.1f} ms), not by the plans")
    if (RESULTS / KNAPSPEC_ONE_FINALIST_CPU).exists():
        one = case(KNAPSPEC_ONE_FINALIST_CPU)
        cfg = load(KNAPSPEC_ONE_FINALIST_CPU)["config"]
        share1 = one["plan_fraction_of_decode"]
        tokens1 = one["plans"][0]["reference_tokens"] if one.get("plans") else 0
        text += (f". The cheapest two-stage plan with the prefill's states ({cfg.get('search_tokens')} search tokens, "
                 f"{cfg.get('finalists')} finalist; step smollm2-135m-1k-at-start-prefill-states-1-finalist, "
                 f"`{KNAPSPEC_ONE_FINALIST_CPU}`): " + _start_plan_text(one) + ". At most 5 % with at least 64 reference "
                 f"tokens: **{'met' if share1 <= 0.05 and tokens1 >= 64 else 'missed'}** in this run")
        steps = [c["ar_step_s"] for c in (kept, own)]
        if one.get("plans") and one["ar_step_s"] > 1.1 * max(steps):
            plan_s = one["plans"][0]["seconds"]
            shares = sorted(plan_s / (256 * st) for st in steps)
            text += (f", with its decode at {1e3 * one['ar_step_s']:.1f} ms a step against "
                     f"{1e3 * min(steps):.1f}-{1e3 * max(steps):.1f} ms in the two runs above: at their step times the "
                     f"same {1e3 * plan_s:.0f} ms plan would be {100 * shares[0]:.1f}-{100 * shares[1]:.1f} % of a "
                     "256-step decode, so this machine's spread decides the verdict")
    return text + " (one run each on a shared 2-core CPU)."


def _fastest_rows(case) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The device-time case's fastest dense and fastest sparse rows."""
    rows = {r["variant"]: r for r in case["rows"]}
    return rows[case["fastest_dense"]], rows[case["fastest_sparse"]]


def _own_kernel_ratio(case) -> Optional[float]:
    """Fastest dense over fastest sparse by jaxspec's own kernels alone; None where the file has no split
    (or no own kernels, as on a CPU)."""
    dense, sparse = _fastest_rows(case)
    if not (dense.get("own_kernels_us_per_layer") and sparse.get("own_kernels_us_per_layer")):
        return None
    return dense["own_kernels_us_per_layer"] / sparse["own_kernels_us_per_layer"]


def _selection_share(data, method: str) -> float:
    row = read_path(data, ("cases", "ctx32768/b16", "rows", {"method": method}))
    # with a selection every R-th round (docs/methods.md §3.8) the mean per round, reuse rounds included
    return row.get("selection_ms_per_round", row["selection_ms"]) / (1e3 * row["batch"] * row["tau"] / row["tok_s"])


def cpu_choice_note() -> str:
    """MagicDec and the measured choice on the CPU, real pair, 2k (steps of cpu-dustin-sparse-draft)."""
    if not ((RESULTS / MAGICDEC_CPU).exists() and (RESULTS / ARBITRATE_CPU).exists()):
        return ("Not measured yet: MagicDec and the measured choice (`--arbitrate 8`) at this point (steps of "
                "`cpu-dustin-sparse-draft`).")
    mg, ab = load(MAGICDEC_CPU)["results"], load(ARBITRATE_CPU)["results"]
    event = ab["metrics"]["arbitration"]["events"][0]["probe"]
    return (f"MagicDec at the same point (`{MAGICDEC_CPU}`, with the warm-up run): tau {mg['metrics']['tau']:.2f}, "
            f"{mg['speedup_vs_ar']:.2f}x AR in the same process, output identical to AR "
            f"({'yes' if mg['identical_to_ar'] else 'no'}; dense verification, float32). The verify-set variant "
            f"under the measured choice (docs/methods.md §5.2, `--arbitrate 8`, `{ARBITRATE_CPU}`): its 8 probe "
            f"rounds decoded {event['speculative_tokens_per_s']:.2f} tokens/s against "
            f"{event['ar_tokens_per_s']:.2f} for 8 plain steps, so it chose **{event['choice']}** for the rest; the "
            f"whole 64-token run measured {ab['speedup_vs_ar']:.2f}x the AR run in the same process (target: never "
            f"slower than AR with the choice on: **missed** here). The run itself decoded {ab['tokens_per_s']:.2f} "
            f"tokens/s, about the rate its own plain steps measured in the probe ({event['ar_tokens_per_s']:.2f}); "
            f"the AR reference run, decoded separately, measured {ab['ar_tokens_per_s']:.2f}, a "
            f"{100 * (ab['ar_tokens_per_s'] / event['ar_tokens_per_s'] - 1):.0f} % spread between two measurements "
            "of the same plain decoding on this shared 2-core CPU, larger than anything the choice could save or "
            "lose at this point. " + h200_choice_note())


def h200_choice_note() -> str:
    """The measured choice with its tail check on the real pair at 32k/b16 (h200-qwen-pair ctx32k-b16-arbitrate),
    beside the same methods run without it (the 32k/b16 file)."""
    if not (RESULTS / PAIR_SPEED_ARBITRATE).exists():
        return "On the H200 the measured choice is not run yet (h200-qwen-pair step ctx32k-b16-arbitrate)."
    case = load(PAIR_SPEED_ARBITRATE)["cases"]["ctx32000/b16"]
    free_run = load(f"{PS}32k_b16_h200.json")["cases"]["ctx32000/b16"]
    methods = [(m, label.strip("*")) for m, label in PAIR_METHODS if m in case]
    parts, speedups, plain_ms, ar_ms, early, picked_ar = [], [], [], [], [], []
    pooled, tails = False, []
    for method, label in methods:
        r = case[method]
        events = r["metrics"]["arbitration"]["events"]
        probe = events[0]["probe"]
        speedups.append(r["speedup_vs_ar"])
        plain_ms.append(1e3 * probe.get("ar_step_s_mean", probe["ar_step_s"]))  # the mean over the probe's steps
        ar_ms.append(1e3 * case["batch"] / r["paired_ar_tok_s"])
        text = (f"{label} {r['speedup_vs_ar']:.2f}x (probe {probe['speculative_tokens_per_s']:.0f} against "
                f"{probe['ar_tokens_per_s']:.0f} tokens/s: {probe['choice']}")
        for e in events:
            if e.get("reason") == "tail":
                pooled = pooled or "tail_prior_rounds" in e
                tails.append(label)
                text += (f"; after {e['after_rounds']} more rounds the tail check estimated "
                         f"{e['speculative_finish_s']:.1f} s to finish speculating against "
                         f"{e['plain_finish_s']:.1f} s plainly: ar")
        parts.append(text + ")")
        if r["metrics"]["arbitration"]["choice"] == "ar" and not any(e.get("reason") == "tail" for e in events):
            picked_ar.append(label)
        if method in free_run:  # the probe's tokens a row a round against the whole run's tau without the choice
            early.append(f"{label} {probe['speculative_tokens'] / (probe['rounds'] * case['batch']):.2f} against "
                         f"{free_run[method]['metrics']['tau']:.2f} ({free_run[method]['speedup_vs_ar']:.2f}x AR)")
    worst = min(speedups)
    ratio = max(p / a for p, a in zip(plain_ms, ar_ms))
    text = ("On the H200 (real pair, 32k, batch 16, `--arbitrate 8 --arbitrate-tail 8`, "
            f"`{PAIR_SPEED_ARBITRATE}`): " + "; ".join(parts) + f". Never slower than AR: "
            f"**{'met' if worst >= 1 else 'missed'}**" + (f", by up to {100 * (1 - worst):.0f} % here" if worst < 1
                                                        else f" (lowest {worst:.2f}x)") + ". "
            f"The probe's 8 plain steps took {min(plain_ms):.1f}-{max(plain_ms):.1f} ms a step against "
            f"{min(ar_ms):.1f}-{max(ar_ms):.1f} ms in the 256-step AR loop")
    marginal = [1e3 * case[m]["metrics"]["arbitration"]["events"][0]["probe"]["ar_step_s"] for m, _ in methods
                if "ar_step_s_mean" in case[m]["metrics"]["arbitration"]["events"][0]["probe"]]
    if marginal:
        text += (f"; the two stretches' difference, the price the choice used (docs/methods.md §5.2), "
                 f"{min(marginal):.1f}-{max(marginal):.1f} ms")
    fixed = [1e3 * (pr["ar_s"] - pr["ar_steps"] * pr["ar_step_s"]) / 2 for pr in
             (case[m]["metrics"]["arbitration"]["events"][0]["probe"] for m, _ in methods) if "ar_step_s_mean" in pr]
    if ratio <= 1.1:
        text += " (a plain stretch no longer copies the cache into and out of its loop; docs/methods.md §5.2). "
    elif fixed:
        text += (f", within {100 * max(abs(m / a - 1) for m, a in zip(marginal, ar_ms)):.0f} % of the AR loop's "
                 f"step: each call of plain steps carries a fixed cost of about {min(fixed):.0f}-{max(fixed):.0f} ms "
                 "(not traced), which the difference leaves out, so plain decoding was priced right and the choice "
                 "went to AR on the speculative probe's own rate. ")
    elif not pooled:
        text += (" (each plain stretch then copied the whole cache into and out of its loop, half a cache read "
                 "more a step over 8 steps; fixed since, docs/methods.md §5.2). ")
    elif not marginal:
        text += (" (slower than the loop's, and not by a cache copy, which the compiled stretch no longer has: a "
                 "fixed cost of about a step per call, not traced; the probe now times its plain steps as two "
                 "stretches of 2 and 6 and prices a step by their difference, docs/methods.md §5.2, not measured "
                 "on the H200 yet). ")
    else:
        text += ". "
    if early:
        text += ("The first 8 rounds after the prefill commit fewer tokens a row than a whole run does (tokens a row "
                 "a round in the probe against the whole run's tau without the choice, `" + f"{PS}32k_b16_h200.json"
                 + "`: " + "; ".join(early) + ")")
        text += ". "
    losses = []
    for method, label in methods:
        r = case[method]
        if r["speedup_vs_ar"] >= 1:
            continue
        probe = r["metrics"]["arbitration"]["events"][0]["probe"]
        rate = r["paired_ar_tok_s"]  # tokens a second of the AR loop in the same process
        total = r["timings"]["decode_s"] - r["tok_s"] * r["timings"]["decode_s"] / rate
        spec = probe["speculative_s"] - probe["speculative_tokens"] / rate
        plain = probe["ar_s"] - probe["ar_tokens"] / rate
        idle = r["metrics"]["ar_steps"] - r["metrics"]["ar_tokens"] / case["batch"]  # row-steps of rows already done
        losses.append(f"{label} {1e3 * total:.0f} ms ({1e3 * spec:.0f} ms in the speculative probe, "
                      f"{1e3 * plain:.0f} ms in the plain one, and its {r['metrics']['ar_steps']} plain steps "
                      f"committed {r['metrics']['ar_tokens'] / case['batch']:.0f} tokens a row on average: the rows "
                      f"left speculation at different lengths, and a batch decodes until its last row is done, "
                      f"{idle:.0f} steps of about {1e3 * case['batch'] / rate:.1f} ms)")
    if losses:
        text += ("Where it lost against AR, the time beyond AR's for the same tokens: " + "; ".join(losses)
                 + (f"; the probe picked plain decoding at once for {', '.join(picked_ar)}" if picked_ar else "")
                 + ". ")
    if tails:
        text += ("The tail check " + ("pooled each row's rate toward the batch mean (docs/methods.md §5.2)"
                                      if pooled else "took each row's own rate (the rule now reached with "
                                      "`--arbitrate-tail-prior 0`; the pooled rule is the default)")
                 + f" and switched {', '.join(tails)} to plain decoding.")
    elif not pooled:
        text += "No tail check fired."
    return text.strip()


def selection_share_note() -> str:
    """Selection as a share of a Dustin round at 32k/b16 (target <= 3 %), from the runs at the real pair's tau."""
    parts = []
    for source, method, label in ((DUSTIN_SPEED_PAIR_TAU, "dustin", "full-KV Dustin-H"),
                                  (DUSTIN_SPEED_SPARSE, "dustin-kv-streaming", "Dustin-H with the streaming draft KV")):
        row = read_path(load(source), ("cases", "ctx32768/b16", "rows", {"method": method}))
        round_ms = 1e3 * row["batch"] * row["tau"] / row["tok_s"]
        ms = row.get("selection_ms_per_round", row["selection_ms"])
        parts.append(f"{label} {ms:.2f} ms of a {round_ms:.1f} ms round ({100 * ms / round_ms:.1f} %, `{source}`)")
    text = ("Selection at most 3 % of a round at 32k, batch 16, selecting every round: **missed** — "
            + "; ".join(parts) + ". A round's time here is batch x realised tau / tokens per second; the selection "
            "is timed as its own phase (`--profile`).")
    if not (RESULTS / DUSTIN_SPEED_RESELECT).exists():
        return text + " Selecting every second round (docs/methods.md §3.8, `--reselect-every 2`) is not measured yet."
    data = load(DUSTIN_SPEED_RESELECT)
    shares = _reselect_shares(data)
    text += (" Selecting every second round (docs/methods.md §3.8, `--reselect-every 2`, each method at the "
             f"tau the real pair measured with it, `{DUSTIN_SPEED_RESELECT}`): " + "; ".join(shares) + ". The "
             "speed-up barely moves: half a selection is a few per cent of a round, and a reused set lowers the "
             "real pair's tau a little (the next note's 32k/b16 runs).")
    return text + _reselect3_note()


def _reselect_shares(data) -> List[str]:
    """Per Dustin-H draft of a dustin-speed run selecting every R-th round: its selection share of a round
    against the 3 % target, the mean selection per round, the speed-up and the tau it ran at."""
    shares = []
    for method, label in (("dustin", "full-KV Dustin-H"), ("dustin-kv-streaming", "with the streaming draft KV")):
        row = read_path(data, ("cases", "ctx32768/b16", "rows", {"method": method}))
        share = _selection_share(data, method)
        shares.append(f"{label} {100 * share:.1f} % (**{'met' if share <= 0.03 else 'missed'}**; "
                      f"{row['selection_ms_per_round']:.2f} ms a round on average, {row['speedup']:.2f}x AR at "
                      f"tau {row['tau']:.2f})")
    return shares


def _reselect3_note() -> str:
    """Selection every third round: its share of a round on the 7B shape at the real pair's tau, and the real pair's
    own speed-ups selecting every round, every second and every third round at 32k/b16."""
    if not (RESULTS / DUSTIN_SPEED_RESELECT3).exists():
        return " Selecting every third round (step `b16-reselect-3-pair-tau-32k`) is not measured yet."
    data = load(DUSTIN_SPEED_RESELECT3)
    shares = _reselect_shares(data)
    text = (" Selecting every third round (`--reselect-every 3`, each method at the tau the real pair measured with "
            f"it, `{DUSTIN_SPEED_RESELECT3}`, commit {_code_commit(data)}): " + "; ".join(shares) + ".")
    runs = [(when, src) for when, src in (("every round", PAIR_SPEED_SPARSE_DRAFT),
                                          ("every round, finished rows reading their history", PAIR_SPEED_FINISHED_KEPT),
                                          ("every second round", PAIR_SPEED_RESELECT),
                                          ("every third round", PAIR_SPEED_RESELECT3)) if (RESULTS / src).exists()]
    labels = (("dustin", "full-KV Dustin-H"), ("dustin-kv-streaming", "the streaming draft KV"))
    speeds = {method: [(when, load(src)["cases"]["ctx32000/b16"][method]) for when, src in runs
                       if "speedup_vs_ar" in load(src)["cases"].get("ctx32000/b16", {}).get(method, {})]
              for method, _ in labels}
    parts = [f"{label}: " + ", ".join(f"{when} {c['speedup_vs_ar']:.2f}x (tau {c['metrics']['tau']:.2f})"
                                      for when, c in speeds[method]) for method, label in labels if speeds[method]]
    if parts:
        taus = [c["metrics"]["tau"] for method, _ in labels for _, c in speeds[method]]
        text += (" The real pair end to end at 32k/b16 against its paired AR, one run each (`"
                 + "`, `".join(src for _, src in runs) + "`): " + "; ".join(parts)
                 + f". Tau spans {min(taus):.2f}-{max(taus):.2f} across these runs")
        spreads = []
        for method, label in labels:
            values = [c["speedup_vs_ar"] for when, c in speeds[method] if when.startswith("every round")]
            fewer = [(when, c["speedup_vs_ar"]) for when, c in speeds[method] if not when.startswith("every round")]
            if len(values) > 1 and fewer:
                where = ["inside" if min(values) <= v <= max(values) else "above" if v > max(values) else "below"
                         for _, v in fewer]
                spreads.append(f"{label}: every round {min(values):.2f}-{max(values):.2f}x; "
                               + ", ".join(f"{when} {w} that span" for (when, _), w in zip(fewer, where)))
        text += ((". Against the two runs selecting every round (they differ only in reading finished rows): "
                  + "; ".join(spreads)) if spreads else "") + "."
    return text


def _draft_step_checks():
    """``(file, case key, draft_step_check)`` of every real-1.5B H200 KnapSpec case that timed a draft step."""
    sources = list(KNAPSPEC_REAL.values()) + [KNAPSPEC_TWO_STAGE, KNAPSPEC_PLAN_ROWS]
    for source in sources:
        if not (RESULTS / source).exists():
            continue
        for key, case in load(source)["cases"].items():
            check = case.get("draft_step_check") if isinstance(case, dict) else None
            if check and check.get("static_over_predicted"):
                yield source, key, check


def knapspec_draft_step_note() -> str:
    """A draft step of a plan against the latency model's prediction, on the H200 with the real 1.5B."""
    checks = list(_draft_step_checks())
    if not checks:
        return "A plan's draft step against the latency model on the H200: not measured yet."
    static = [c["static_over_predicted"] for _, _, c in checks]
    dynamic = [c["dynamic_over_predicted"] for _, _, c in checks if c.get("dynamic_over_predicted")]
    inside = sum(abs(x - 1) <= 0.1 for x in static)
    batches: Dict[str, List[float]] = {}
    for _, key, c in checks:
        batches.setdefault(key.split("/")[3], []).append(c["static_over_predicted"])
    by_batch = "; ".join(f"batch {b[1:]} {min(x):.2f}-{max(x):.2f}x ({sum(abs(y - 1) <= 0.1 for y in x)} of {len(x)} "
                         "within 10 %)" for b, x in sorted(batches.items(), key=lambda kv: int(kv[0][1:])))
    cpu = ""
    if (RESULTS / KNAPSPEC_64REF).exists():
        data = load(KNAPSPEC_64REF)
        cpu_checks = [c["draft_step_check"] for c in _fixed_cases(data)]
        static_cpu = [c["static_over_predicted"] for c in cpu_checks]
        timed = {c.get("timed", "one forward per jitted call") for c in cpu_checks}
        single = [c["single_call_static_over_predicted"] for c in cpu_checks if c.get("single_call_static_over_predicted")]
        cpu = (" On the CPU (SmolLM2, the fixed candidate plans, `" + KNAPSPEC_64REF + "`, timed "
               + " / ".join(sorted(timed)) + ") the median static step is "
               f"{v('knapspec/plans/smollm2-135m/ctx1024/b1/cpu/64ref/static-draft-step-over-predicted')} the "
               f"prediction, {sum(abs(x - 1) <= 0.1 for x in static_cpu)} of {len(static_cpu)} plans within 10 % "
               f"({min(static_cpu):.2f}-{max(static_cpu):.2f}x; figure "
               "`knapspec/plans/smollm2-135m/ctx1024/b1/cpu/64ref/static-draft-step-over-predicted`)"
               + (f"; timed one forward per jitted call, as the GPU cases above were, the same plans measure "
                  f"{min(single):.2f}-{max(single):.2f}x: a call that returns only the logits lets XLA drop the "
                  "forward's cache writes and pays its own dispatch, where the draft loop and the latency profile "
                  "write the cache inside one compiled loop"
                  if single else "") + ".")
    cpu += _draft_step_in_loop_cpu()
    gpu_timed = {c.get("timed", "one forward per jitted call") for _, _, c in checks}
    return (f"One draft step of each case's plan (the final skip set; docs/methods.md §5.3) against the latency "
            f"model's prediction on the H200, real Qwen2.5-Coder-1.5B bf16, {len(checks)} cases at batch 1 and 16, "
            f"8k-32k, timed {' / '.join(sorted(gpu_timed))}: with the plan compiled in (static, executed sub-layers "
            f"only) {min(static):.2f}-{max(static):.2f}x"
            f", {inside} of {len(static)} within 10 % (**{'met' if inside == len(static) else 'missed'}** on the "
            f"GPU)" + (f"; by batch: {by_batch}" if by_batch else "") + f"; with the dynamic mask (a lax.cond per "
            f"sub-layer) {min(dynamic):.2f}-{max(dynamic):.2f}x." + _draft_step_in_loop_gpu()
            + _draft_step_static_profile_gpu() + cpu)


def _draft_step_static_profile_gpu() -> str:
    """The static-plan run whose latency profile was fitted on forwards with each mask compiled in: its plans' draft
    steps (compiled for the plan, in a loop of 4 forwards) against that profile's prediction."""
    if not (RESULTS / KNAPSPEC_PALLAS_STATIC).exists():
        return ""
    checks = [(key, c["draft_step_check"]) for key, c in load(KNAPSPEC_PALLAS_STATIC)["cases"].items()
              if isinstance(c, dict) and c.get("draft_step_check", {}).get("static_over_predicted")]
    if not checks:
        return ""
    ratios = [c["static_over_predicted"] for _, c in checks]
    inside = sum(abs(x - 1) <= 0.1 for x in ratios)
    timed = sorted({c.get("timed", "one forward per jitted call") for _, c in checks})
    return (f" With the latency profile fitted on forwards with each plan's mask compiled in (`--latency-fit "
            f"forward-static`, `{KNAPSPEC_PALLAS_STATIC}`, batch 16, 8k-32k, skip plans and budgeted-attention "
            f"plans, timed {' / '.join(timed)}): {min(ratios):.2f}-{max(ratios):.2f}x, {inside} of {len(ratios)} "
            f"within 10 % (**{'met' if inside == len(ratios) else 'missed'}** for this profile on the GPU; the "
            "cases above were priced by each run's `--latency-fit forward` profile, fitted on forwards with the "
            "dynamic mask).")


def demo_note() -> str:
    """What the two committed demo runs measured: does prompt lookup pay, and what the cache saves."""
    runs = {run: load(f"demo/demo_smollm2-135m_prompt-lookup_767_b1_{run}_cpu.json")["results"]
            for run in ("first-run", "second-run")
            if (RESULTS / f"demo/demo_smollm2-135m_prompt-lookup_767_b1_{run}_cpu.json").exists()}
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
    sweep = {g: load(f"demo/demo_smollm2-135m_prompt-lookup_767_b1_gamma{g}_cpu.json")["results"]
             for g in (1, 2, 3, 4) if (RESULTS / f"demo/demo_smollm2-135m_prompt-lookup_767_b1_gamma{g}_cpu.json").exists()}
    if sweep:
        best = max(sweep, key=lambda g: sweep[g]["speedup_vs_ar"])
        text += (" By draft length (cpu-demo steps gamma-1 .. gamma-4, one demo run each against AR in the same "
                 "process): " + ", ".join(f"gamma {g} {r['speedup_vs_ar']:.2f}x (tau {r['metrics']['tau']:.2f})"
                                          for g, r in sweep.items())
                 + f"; gamma {best} measured the highest speed-up and {'is' if best == gamma else 'is not'} the "
                   f"demo's default ({gamma}).")
    full = {g: load(f"demo/demo_smollm2-135m_prompt-lookup_767_b1_gamma{g}_full-verify_cpu.json")["results"]
            for g in (1, 4)
            if (RESULTS / f"demo/demo_smollm2-135m_prompt-lookup_767_b1_gamma{g}_full-verify_cpu.json").exists()}
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


def _draft_step_in_loop_cpu() -> str:
    """The CPU correlation run's fixed plans, each draft step timed inside a compiled loop of forwards."""
    if not (RESULTS / KNAPSPEC_TPT_CORRELATION).exists():
        return ""
    data = load(KNAPSPEC_TPT_CORRELATION)
    parts, static_all = [], []
    for ctx in TPT_CORRELATION_CONTEXTS:
        checks = [c["draft_step_check"] for c in _fixed_cases(data, f"cpu/summarize/ctx{ctx}/b1/fixed/")
                  if "draft_step_check" in c]
        if not checks:
            continue
        static = [c["static_over_predicted"] for c in checks]
        dynamic = [c["dynamic_over_predicted"] for c in checks]
        static_all += static
        parts.append(f"{ctx // 1024}k: static {min(static):.2f}-{max(static):.2f}x ({sum(abs(x - 1) <= 0.1 for x in static)} "
                     f"of {len(static)} within 10 %), dynamic {min(dynamic):.2f}-{max(dynamic):.2f}x")
    if not parts:
        return ""
    inside = sum(abs(x - 1) <= 0.1 for x in static_all)
    return (" Timed inside a compiled loop of 4 forwards, as the draft loop and the latency profile run them "
            f"(the TPT-correlation run's fixed plans, `{KNAPSPEC_TPT_CORRELATION}`): " + "; ".join(parts)
            + f" (**{'met' if inside == len(static_all) else 'missed'}** on the CPU: {inside} of {len(static_all)}; "
            "figures `knapspec/plans/smollm2-135m/ctx{1024,2048}/b1/cpu/in-loop/...`). The decode step writes its "
            "cache in place (docs/methods.md §2), so a static plan's step is its executed sub-layers' bytes.")


def _draft_step_in_loop_gpu() -> str:
    """The H200 cases whose draft-step check timed the plan's forward inside the compiled draft loop."""
    if not (RESULTS / KNAPSPEC_DP_PALLAS).exists():
        return ""
    looped = [(key, c["draft_step_check"]) for key, c in load(KNAPSPEC_DP_PALLAS)["cases"].items()
              if isinstance(c, dict) and (c.get("draft_step_check") or {}).get("timed", "").startswith("4 forwards")]
    if not looped:
        return ""
    inside = sum(abs(c["static_over_predicted"] - 1) <= 0.1 for _, c in looped)
    return (f" Timed as the draft loop runs it ({looped[0][1]['timed']}, `{KNAPSPEC_DP_PALLAS}`, batch 16, each "
            "plan skipping one MLP): " + "; ".join(
                f"{int(key.split('/')[2][3:]) // 1000}k static {c['static_over_predicted']:.2f}x, dynamic "
                f"{c['dynamic_over_predicted']:.2f}x (one forward per call: static "
                f"{c['single_call_static_over_predicted']:.2f}x)" for key, c in looped)
            + f"; {inside} of {len(looped)} static steps within 10 %. The other H200 cases are not re-measured "
              "this way yet.")


def knapspec_real_note() -> str:
    """The real Qwen2.5-Coder-1.5B on the H200: what KnapSpec did at each measured point and why."""
    parts = []
    for batch, source in KNAPSPEC_REAL.items():
        if not (RESULTS / source).exists():
            continue
        cases = load(source)["cases"]
        for key, ks in cases.items():
            _, _, ctx, _, method = key.split("/")
            if method != "knapspec":
                continue
            a = ks["plan_allowance"]
            clasp = cases.get(key.replace("/knapspec", "/clasp"))
            text = f"{ctx[3:]} tokens, batch {batch}: KnapSpec {ks['speedup_vs_ar']:.2f}x AR"
            if a.get("skip"):
                text += (f" with no plan (the allowance predicted {1e3 * a['predicted_dp_s_per_token']:.1f} ms of DP "
                         f"per reference token against a {1e3 * a['plan_budget_s']:.0f} ms budget: "
                         f"{a['allowed_tokens']} tokens, under the minimum of 8, so it decoded plainly)")
            elif ks.get("plans"):
                p = ks["plans"][0]
                text += (f" (planned after round {p['round']} on {p['reference_tokens']} reference tokens, "
                         f"{1e3 * p['seconds']:.0f} ms against {1e3 * p['predicted_seconds']:.0f} ms predicted, "
                         f"planning {100 * ks['plan_fraction_of_decode']:.1f} % of decode; best candidate skipping "
                         f"{p['n_skip_attn']} Attention / {p['n_skip_mlp']} MLP sub-layers, gamma* = {p['gamma_star']}"
                         + (": plain decoding after the full-model rounds before the plan" if p["gamma_star"] == 0
                            else "") + ")")
            if clasp:
                text += (f"; CLaSp {clasp['speedup_vs_ar']:.2f}x (tau {clasp['tau']:.2f}, its draft step "
                         f"{clasp['draft_step_check']['static_over_predicted']:.2f}x the latency model's prediction)")
            parts.append(text)
    if not parts:
        return "Real Qwen2.5-Coder-1.5B on the H200: not measured yet (suite h200-knapspec)."
    data = load(KNAPSPEC_REAL[1])
    price = ""
    profile = data.get("latency_b1")  # the profile this file planned with (the file on disk may be newer)
    if profile:
        fwd = profile.get("forward", {})
        if "bulk_contexts" in fwd:
            price = (f" The DP's price per reference token is its slot rows (skip budget + 1) times the "
                     f"many-row price at the context, t_row(n) = u + u_n n (docs/methods.md §4.1), from "
                     f"forwards of {fwd['bulk_rows']} rows at {fwd['bulk_contexts']} tokens: "
                     + ", ".join(f"{1e3 * u:.3f} ms a row at {n}" for n, u in
                                 zip(fwd['bulk_contexts'], fwd['fit']['u_per_context'])) + ".")
        elif fwd.get("bulk_rows"):
            rows_times = ", ".join(f"{n} rows {1e3 * t:.1f} ms" for n, t in zip(fwd["bulk_rows"], fwd["bulk_times"]))
            price = (f" The DP's price per reference token is the slope `u` of many-row forwards (docs/methods.md "
                     f"§4.1) times its slot rows (skip budget + 1): u = {1e3 * profile['fit']['u']:.3f} ms a row, "
                     f"from forwards at the profile's largest context ({fwd['verify_context']} tokens: {rows_times}), "
                     "where every row's attention over the whole context is most of the cost. The same price is "
                     "applied at every context, so at 8k-16k, where a row reads less context, the allowance "
                     "probably overprices the DP (many-row forwards at those contexts are not timed) and may skip "
                     "planning that would have fitted. The profile now prices a row per context, "
                     "t_row(n) = u + u_n n from many-row forwards at its smallest and largest contexts (docs/methods.md "
                     "§4.1); this file was planned before that (the two-stage run below planned with the profile "
                     "measured again).")
    missing = []
    for batch, source in KNAPSPEC_REAL.items():
        cases = load(source)["cases"] if (RESULTS / source).exists() else {}
        measured = {key.split("/")[2] + "/" + key.split("/")[4] for key in cases}
        gone = [f"{m} at {round(c / 1000)}k" for c in (8192, 16384, 32000)
                for m in ("knapspec", "knapspec-target-ref", "clasp") if f"ctx{c}/{m}" not in measured]
        if gone:
            missing.append(", ".join(gone) + f" at batch {batch}" + (
                " (the step ran out of its 10 minutes before 32k)" if cases and batch == 16 else ""))
    return ("Real Qwen2.5-Coder-1.5B on the H200 (bf16, 256 new tokens; `" + "`, `".join(
                s for s in KNAPSPEC_REAL.values() if (RESULTS / s).exists()) + "`): "
            + "; ".join(parts) + "." + price + (" Not measured yet: " + "; ".join(missing) + "." if missing else "")
            + " " + _knapspec_real_baselines() + " " + _knapspec_attention_backend_note())


def _knapspec_attention_backend_note() -> str:
    """The knapspec runs' AR step (the reference attention unless the file names a backend) against pair-speed's
    AR on the Pallas kernel, at 32k/b16."""
    ks = KNAPSPEC_REAL_BASELINES[1][1]
    if not (RESULTS / ks).exists() or not (RESULTS / PAIR_SPEED_SELF[0]).exists():
        return ""
    data = load(ks)
    case = next((c for k, c in data["cases"].items() if "/ctx32000/b16/" in k and c.get("ar_step_s")), None)
    pair = dict(pair_cases(PAIR_SPEED_SELF[0])).get("ctx32000/b16")
    if case is None or pair is None:
        return ""
    pair_step = 1e3 / (pair["ar"]["tok_s_mean"] / pair["batch"])
    backend = data["config"].get("attention_backend", "auto")
    return (f"These KnapSpec runs decode with the {'jnp reference attention' if backend == 'auto' else backend} "
            f"(`--attention-backend {backend}`): their AR step at 32k/b16 takes "
            f"{1e3 * case['ar_step_s']:.1f} ms (`{ks}`) against {pair_step:.1f} ms for AR on jaxspec's Pallas kernel "
            f"(`{PAIR_SPEED_SELF[0]}`), so their speed-ups are against a {case['ar_step_s'] * 1e3 / pair_step:.1f}x slower "
            "AR; h200-knapspec step qwen2.5-coder-1.5b-b16-32k-8k-pallas measures AR and KnapSpec on the kernel"
            + (" (not run yet)." if not (RESULTS / KNAPSPEC_PALLAS).exists() else ": " + _knapspec_pallas_note())
            + _knapspec_pallas_more_note())


def _knapspec_pallas_more_note() -> str:
    """The Pallas-kernel KnapSpec runs beyond the first: static plans with a profile of compiled masks at batch 16,
    and batch 1 (or what is not measured of them)."""
    out = []
    for source, batch, what, step in (
            (KNAPSPEC_PALLAS_STATIC, 16, "With every plan compiled for itself and a latency profile fitted on "
                                         "forwards with each mask compiled in (`--static-plans --latency-fit "
                                         "forward-static`)", "h200-knapspec qwen2.5-coder-1.5b-b16-32k-8k-pallas-static"),
            (KNAPSPEC_PALLAS_B1, 1, "At batch 1, the same two variants and AR on the kernel, with static plans "
                                    "and a batch-1 profile of compiled masks",
             "h200-knapspec qwen2.5-coder-1.5b-b1-32k-8k-pallas-static"),
            (KNAPSPEC_PALLAS_B1_H100, 1, "The same at 32k on an H100",
             "h100-long-context knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static"),
            (KNAPSPEC_PALLAS_B1_H100_AFTER_PLAIN, 1, "The same with the first plan made after 64 plainly decoded "
                                                      "tokens on those alone (`--plan-after-plain 64`)",
             "h100-long-context knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-after-plain"),
            (KNAPSPEC_PALLAS_B1_H100_PROBE_WARMUP, 1, "The same with one untimed round, and one plain step, before "
                                                       "each side of the probe (`--probe-warmup 1`, docs/methods.md "
                                                       "§5.2)",
             "h100-long-context knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-after-plain-probe-warmup"),
            (KNAPSPEC_PALLAS_B1_H100_PROBE_WARMUP_SELECT, 1, "The same with the finalists rescored in one pass "
                                                              "without conditionals (`--rescore select`)",
             "h100-long-context knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-after-plain-probe-warmup-select"),
            (KNAPSPEC_PALLAS_B1_H100_TWO_STRETCH, 1, "The probe-warmup run with both sides of the probe priced as two "
                                                      "stretches, without the per-call cost (`--probe-pricing "
                                                      "two-stretch`, docs/methods.md §5.2)",
             "h100-long-context knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-after-plain-two-stretch"),
            (KNAPSPEC_PALLAS_B1_H200_TWO_STRETCH, 1, "The same on the H200",
             "h200-knapspec qwen2.5-coder-1.5b-b1-32k-pallas-static-after-plain-two-stretch"),
            *((runs[tag], batch, f"{what}{gpu}, with the latency profile fitted on forwards that skip every second "
                                 "sub-layer of a kind (`--latency-fit forward-static-half`, docs/methods.md §4.1)",
               f"{suite} {step}")
              for runs, batch, what, step_stem in (
                  (KNAPSPEC_PALLAS_B1_HALF_FIT, 1, "The two-stretch run on ",
                   "qwen2.5-coder-1.5b-b1-32k-pallas-static-half-fit"),
                  (KNAPSPEC_PALLAS_B16_HALF_FIT, 16, "At batch 16, one plan at the start on one row's window with "
                                                     "its states kept by the prefill, on ",
                   "qwen2.5-coder-1.5b-b16-32k-pallas-static-1row-half-fit"))
              for tag, gpu, suite, step in (
                  ("h100", "an H100", "h100-long-context", "knapspec-" + step_stem),
                  ("h200", "the H200", "h200-knapspec", step_stem))),
            *((runs["h100"], batch, f"{what} with a profile that takes each call's fixed cost off its steps "
                                    "(the full forward and the decode loop timed at 4 and 16 steps a call, "
                                    "docs/methods.md §4.1)", f"h100-long-context {step}")
              for runs, batch, what, step in (
                  (KNAPSPEC_PALLAS_B1_PER_STEP, 1, "The half-fit run on an H100 at batch 1",
                   "knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-half-fit-per-step"),
                  (KNAPSPEC_PALLAS_B16_PER_STEP, 16, "The half-fit run on an H100 at batch 16",
                   "knapspec-qwen2.5-coder-1.5b-b16-32k-pallas-static-1row-half-fit-per-step"),
                  (KNAPSPEC_PALLAS_B1_KEPT_STATES, 1, "The per-step batch-1 run with the first plan's window states "
                                                      "kept by the plain stretch (docs/methods.md §5.6), on an H100,",
                   "knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-half-fit-per-step-kept-states"),
                  (KNAPSPEC_PALLAS_B1_KEPT_STATES_768, 1, "The same decoding 768 new tokens (32k + 768 = the model's "
                                                          "trained length; the plan's fixed cost over 3x the decode),",
                   "knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-half-fit-per-step-kept-states-768new"),
                  (KNAPSPEC_PALLAS_B1_AT_START_1_FINALIST, 1, "The per-step batch-1 run on an H100 with one plan before "
                                                              "the first round on the prompt's last 64 tokens (states "
                                                              "from the prefill), the DP on 2 search tokens and 1 "
                                                              "finalist,",
                   "knapspec-qwen2.5-coder-1.5b-b1-32k-pallas-static-half-fit-per-step-at-start-1-finalist")))):
        if (RESULTS / source).exists():
            out.append(f"{what} (`{source}`): " + _knapspec_pallas_note(source, batch))
        else:
            out.append(f"{what} (suite and step {step}): not measured yet.")
    return " " + " ".join(out) + _half_fit_note() + _per_step_profile_note() + _knapspec_plan_trace_note()


def _half_fit_note() -> str:
    """The half-skip latency profile against the all-or-nothing one of the same GPU and batch: each sub-layer's
    price at the largest context and what skipping half, and all, of each kind saved (docs/methods.md §4.1)."""
    out = []
    folder = RESULTS / "knapspec"
    for tag, gpu in (("h100", "an H100"), ("h200", "the H200")):
        for batch in (1, 16):
            stem = f"latency_profiles_{tag}/latency_qwen2.5-coder-1.5b_bfloat16_pallas_{tag}_b{batch}_forward-static"
            half_path, all_path = folder / f"{stem}-half.json", folder / f"{stem}.json"
            if not (half_path.exists() and all_path.exists()):
                continue
            half, full = load(half_path), load(all_path)
            n = max(half["contexts"])

            def prices(profile):
                m = profile["model"]
                return (m["c2"] * n + m["c3"]) * 1e6, m["c1"] * 1e6

            def saved(profile, kind):
                times = profile["forward"]["times"]
                return (times["full"][-1] - times[kind][-1]) * 1e3

            skipped = half["forward"]["fit"]["skipped"]
            (ha, hm), (fa, fm) = prices(half), prices(full)
            out.append(
                f"The half-skip profile on {gpu} at batch {batch} (`{half_path.relative_to(RESULTS)}`) prices an "
                f"Attention sub-layer at {n / 1000:.0f}k at {ha:.1f} us and an MLP at {hm:.1f} us, against {fa:.1f} "
                f"and {fm:.1f} us from the all-or-nothing masks: skipping {skipped} Attention sub-layers saved "
                f"{saved(half, 'noattn'):.2f} ms of the {half['forward']['times']['full'][-1] * 1e3:.2f} ms step, "
                f"skipping all {half['forward']['fit']['skippable']} saved {saved(full, 'noattn'):.2f} ms "
                f"({saved(half, 'nomlp'):.2f} and {saved(full, 'nomlp'):.2f} ms for the MLPs).")
    return "".join(" " + part for part in out)


def _modelled_plain_step(profile, n: float) -> float:
    """A profile's price of a plain-decoding step at context ``n``, seconds: ``p t_step(n)`` (``a`` where ``p`` is 0),
    as ``LatencyModel.t_plain`` prices it (a sub-layer and the per-token term never below 0)."""
    m = profile["model"]
    L = profile["config"]["num_layers"]
    step = L * (max(0.0, m["c2"] * n + m["c3"]) + m["c1"]) + max(0.0, m["c0"] + m.get("c0_n", 0.0) * n)
    ratio = m.get("p", 0.0) or m.get("a", 1.0)
    return ratio * step


def _draft_check_timing(cases: dict, check: dict) -> str:
    """How a run's draft-step check timed its forwards: its own words, or, where its loops were timed at two call
    lengths (the profile took each call's fixed cost off), the slope between them (the time split records both)."""
    for case in cases.values():
        split = case.get("time_split_estimate") or {}
        if split.get("draft_long_steps_per_call"):
            return (f"{split['draft_steps_per_call']} and {split['draft_long_steps_per_call']} forwards per jitted "
                    "call, the slope between them")
    return check["timed"]


def _per_step_profile_note() -> str:
    """The half-skip profiles measured with each call's fixed cost taken off (docs/methods.md §4.1) against those that
    kept it: the fixed cost, and each profile's plain step against the AR step its run measured."""
    out = []
    folder = RESULTS / "knapspec"
    for batch, runs in ((1, KNAPSPEC_PALLAS_B1_PER_STEP), (16, KNAPSPEC_PALLAS_B16_PER_STEP)):
        name = f"latency_qwen2.5-coder-1.5b_bfloat16_pallas_h100_b{batch}_forward-static-half.json"
        new_path, old_path = folder / "latency_profiles_h100_per-step" / name, folder / "latency_profiles_h100" / name
        run_path = RESULTS / runs["h100"]
        if not (new_path.exists() and old_path.exists() and run_path.exists()):
            continue
        new, old, run = load(new_path), load(old_path), load(run_path)
        case = next(c for c in run["cases"].values() if isinstance(c, dict) and "ar_step_s" in c)
        n = float(case["latency_prediction"]["n"])
        fwd, fit = new["forward"], new["forward"]["fit"]
        fixed = [o * 1e3 for o in fwd["call_overhead"]]
        out.append(
            f"Each call's fixed cost, on an H100 at batch {batch} (`{new_path.relative_to(RESULTS)}`): "
            f"{min(fixed):.1f}-{max(fixed):.1f} ms a call of {fwd['steps_per_call']} forwards "
            f"(the decode loop's {fit['plain_call_overhead'] * 1e3:.1f} ms), so the profile that kept it "
            f"priced a plain step at {_modelled_plain_step(old, n) * 1e3:.2f} ms and this one at "
            f"{_modelled_plain_step(new, n) * 1e3:.2f} ms, against {case['ar_step_s'] * 1e3:.2f} ms for the AR step "
            f"measured in the run.")
    return "".join(" " + part for part in out)


def _knapspec_plan_trace_note() -> str:
    """Where the plan's time goes on the GPU: each traced KnapSpec run at 32k/b16 against the traced AR run of the
    same file (device-busy time and kernel launches from the profiler), and the runs not measured yet."""
    out, missing = [], []
    for source, tag, what, step, _ in KNAPSPEC_PLAN_TRACES:
        if (RESULTS / source).exists():
            out.append(_plan_trace_sentence(source, tag, what))
        else:
            missing.append(f"{what} ({step})")
    if missing:
        out.append("Where the plan's time goes, not measured yet: " + "; ".join(missing) + ".")
    out.extend(_plan_stages_sentence(source, model, device) for source, model, device in PLAN_STAGES)
    return "".join(" " + part for part in out)


PLAN_STAGE_NAMES = (("boundary_states", "the window's states"), ("dp", "the DP as one scan of every slot"),
                    ("rescore_executed", "the finalists rescored behind conditionals"),
                    ("rescore_select", "the same without them (--rescore select)"))


def plan_stage_names(case: Dict[str, Any]) -> List[Tuple[str, str]]:
    """A bench-plan case's stages in order with their labels: :data:`PLAN_STAGE_NAMES` and the DP split into runs
    of reachable slots (``dp_<K>seg``) where timed."""
    names = []
    for name, what in PLAN_STAGE_NAMES:
        if name == "rescore_executed":
            names += [(seg, f"the DP in {seg[3:-3]} runs of reachable slots") for seg in case["seconds_min"]
                      if seg.startswith("dp_") and seg.endswith("seg")]
        if name in case["seconds_min"]:
            names.append((name, what))
    return names


def _first_skip(masks: Dict[str, List[List[int]]], i: int) -> str:
    attn, mlp = masks["skip_attn"][i], masks["skip_mlp"][i]
    first = min([2 * a for a in attn] + [2 * m + 1 for m in mlp], default=None)
    return "none" if first is None else f"{'Attention' if first % 2 == 0 else 'MLP'} {first // 2}"


def _plan_stages_sentence(source: str, model: str, device: str) -> str:
    """One plan's stages timed alone on one cache (bench-plan): each stage's time, the two rescorings side by side,
    the device's busy time where traced."""
    data = load(source)
    parts = []
    for key, case in data["cases"].items():
        best, trace = case["seconds_min"], case.get("trace") or {}
        stages = "; ".join(
            f"{what} {1e3 * best[name]:.1f} ms" + (f" (GPU busy {1e3 * trace[name]['busy_s']:.1f} ms, "
                                                   f"{trace[name]['launches']:,} kernels)"
                                                   if trace.get(name, {}).get("busy_s") else "")
            for name, what in plan_stage_names(case))
        count = len(case["finalist_masks"]["skip_attn"])
        firsts = ", ".join(_first_skip(case["finalist_masks"], i) for i in range(count))
        parts.append(f"{case['context']} cached tokens, {data['config']['rows']} row(s), {case['window']}-token "
                     f"window, DP on {case['search_tokens']} tokens ({case['candidates']} candidates), {count} "
                     f"finalists first skipping at {firsts}: {stages}; select / executed "
                     f"{case['select_over_executed']:.2f}x, the statistics differing by at most "
                     f"{case['rescore_max_abs_diff']:.2g}")
    return (f"One plan's stages timed alone on {device} (`{source}`, bench-plan, {model}, best of "
            f"{data['config']['repeats']}): " + "; ".join(parts) + ".")


def _plan_trace_sentence(source: str, tag: str, what: str) -> str:
    (key, case), = [(k, v) for k, v in load(source)["cases"].items()
                    if k.startswith(f"{tag}/summarize/ctx32000/") and k.endswith("/knapspec")]
    batch = key.split("/")[3][1:]
    plan = case["plans"][0]
    stages = plan["stage_seconds"]
    ar, ks = (next(iter(case["trace"][m]["planes"].values())) for m in ("ar", "knapspec"))
    extra_busy = ks["busy_s"] - ar["busy_s"]
    extra_launches = ks["launches"] - ar["launches"]
    copies = {name: sum(k["total_s"] for k in plane["top_kernels"] if k["name"] == "MemcpyD2D")
              for name, plane in (("ar", ar), ("knapspec", ks))}
    n_copies = sum(k["count"] for k in ks["top_kernels"] if k["name"] == "MemcpyD2D")
    copy_text = (f", {1e3 * (copies['knapspec'] - copies['ar']):.0f} ms of it more device-to-device copies: "
                 f"{n_copies} MemcpyD2D in KnapSpec's run" + ("" if copies["ar"] else ", none among AR's top kernels")
                 if copies["knapspec"] else "")
    waiting = extra_busy < 0.5 * plan["seconds"]
    return (f"Where the plan's time goes, {what} (`{source}`, 32k, batch {batch}, KnapSpec alone with static plans and "
            f"a profile of compiled masks fitted on that GPU): {case['speedup_vs_ar']:.2f}x AR, planning "
            f"{100 * case['plan_fraction_of_decode']:.1f} % of decode; the plan before the first round took "
            f"{1e3 * plan['seconds']:.0f} ms against {1e3 * plan['predicted_seconds']:.0f} ms predicted (the target's "
            f"states of the window {1e3 * stages['boundary_states']:.0f} ms, the DP on the search tokens "
            f"{1e3 * stages['dp']:.0f} ms, rescoring the finalists {1e3 * stages['rescore']:.0f} ms "
            + ("in one batched pass without conditionals" if plan.get("rescore") == "select" else
               "behind per-sub-layer conditionals")
            + f"{_measured_split_text(case)}). One more run of "
            f"each under the profiler: KnapSpec kept the GPU busy {ks['busy_s']:.3f} s against "
            f"{ar['busy_s']:.3f} s for AR on the same cache ({1e3 * extra_busy:.0f} ms more{copy_text}) and launched "
            f"{ks['launches']:,} kernels against {ar['launches']:,} ({extra_launches:,} more), its wall time "
            f"{1e3 * (ks['span_s'] - ar['span_s']):.0f} ms longer: the plan's device work is at most "
            f"{1e3 * extra_busy:.0f} ms of its {1e3 * plan['seconds']:.0f} ms"
            + (f", and for the rest the GPU waits on the host (issuing the {extra_launches:,} extra kernels one by "
               "one, syncing between stages), so a cheaper plan needs fewer, larger programs (the DP, rescoring and "
               "the window's states in one compiled call) more than fewer bytes." if waiting else
               ", so most of the plan is device work.")
            + _plan_windows_sentence(ks.get("windows") or {}, plan.get("rescore"))
            + _plain_idle_sentence(case, ar, ks))


def _plain_idle_sentence(case: Dict[str, Any], ar: Dict[str, Any], ks: Dict[str, Any]) -> str:
    """For a traced run whose plain steps ran slower than the paired AR run's: the GPU-busy and wall time beyond AR's
    outside the plan's profiler window, which tells device work from the GPU waiting on the host."""
    split = case.get("time_split_measured") or {}
    window = (ks.get("windows") or {}).get("jaxspec.knapspec.plan")
    ratio = split.get("plain_step_over_ar_step")
    if not window or not ratio or ratio < 1.05:
        return ""
    busy = ks["busy_s"] - ar["busy_s"] - window["busy_s"]
    wall = ks["span_s"] - ar["span_s"] - window["wall_s"]
    return (f" Its plain steps ran {ratio:.2f}x the paired AR run's step; outside the plan's window the traced "
            f"KnapSpec run kept the GPU busy {1e3 * busy:.0f} ms more than AR over {split['plain_steps']} plain steps "
            f"while its wall time was {1e3 * wall:.0f} ms longer: the device did AR's work, and the rest is the GPU "
            "waiting on the host, inside the plain stretches or between them"
            + (f" (their fit over {split['plain_stretches']} stretches: "
               + (f"{1e3 * fit['fixed_s']:.1f} ms fixed a stretch" if fit["fixed_s"] > 0 else
                  "no fixed cost a stretch beyond the timing noise")
               + f", a step {fit['step_over_ar_step']:.3f}x AR's)." if (fit := split.get("plain_stretch_fit"))
               else f" (its {split['plain_stretches']} plain stretch(es) have one length: no fit)." if "chunks" in split
               else "; this run predates the engine's per-chunk log, which tells the two apart."))


def _measured_split_text(case: Dict[str, Any]) -> str:
    """Where a KnapSpec run's decode went by the engine's own chunk times (``time_split_measured``), if recorded."""
    split = case.get("time_split_measured")
    if not split:
        return ""
    text = (f"; by the engine's chunk times: plain stretches {1e3 * split['plain_stretches_s']:.0f} ms, rounds "
            f"{1e3 * split['rounds_s']:.0f} ms, the controller's rest {1e3 * split['controller_s']:.0f} ms")
    if split.get("plain_step_over_ar_step"):
        text += f", a plain step {split['plain_step_over_ar_step']:.3f}x the paired AR run's"
    return text


def _plan_windows_sentence(windows: Dict[str, Any], rescore: Optional[str] = None) -> str:
    """The traced plan's profiler annotations (experiments/trace.py windows), where the trace has them; with the
    finalists rescored behind conditionals (``rescore`` "executed", or None: before the choice existed), how long
    the GPU idled in the rescoring."""
    if not windows:
        return ""
    parts = [f"{name[len('jaxspec.knapspec.'):]} {1e3 * w['wall_s']:.1f} ms of wall time, the GPU busy "
             f"{1e3 * w['busy_s']:.1f} ms of it, {w['launches']:,} kernels" for name, w in sorted(windows.items())
             if name.startswith("jaxspec.knapspec.plan")]
    if not parts:
        return ""
    text = " Inside the traced plan's profiler annotations: " + "; ".join(parts) + "."
    window = windows.get("jaxspec.knapspec.plan.rescore")
    if window and rescore != "select" and window["wall_s"] > 0:
        text += (f" The GPU idled {100 * (1 - window['busy_s'] / window['wall_s']):.0f} % of the rescoring: each "
                 "finalist's sub-layers sit behind conditionals, and a GPU reads each predicate on the host before "
                 "it launches the branch (rescoring without them, `--rescore select`, and one plan's stages timed "
                 "alone: docs/methods.md §5.6).")
    return text


def _probe_text(probe: Optional[Dict[str, Any]]) -> str:
    """A KnapSpec plan's measured arbitration (docs/methods.md §5.2): both sides' rates and the choice."""
    if not probe:
        return ""
    own = probe.get("ar_tokens_per_s_measured")
    model = probe.get("ar_tokens_per_s_model")
    mean_round = probe.get("speculative_round_s_mean")
    two = (mean_round is not None and probe.get("speculative_round_s") is not None
           and probe["speculative_round_s"] != mean_round)  # priced as two stretches (--probe-pricing two-stretch)
    warm = (f", after {probe['speculative_warmup_units']} untimed round(s) of {1e3 * probe['speculative_warmup_s']:.1f} ms"
            if probe.get("speculative_warmup_s") is not None else "")
    if two:
        ar = (f"{probe['ar_tokens_per_s']:.0f} for plain steps ({1e3 * probe['ar_step_s']:.2f} ms a step by the two "
              f"stretches, {1e3 * probe['ar_step_s_mean']:.2f} ms on average over the {probe['ar_steps']} steps"
              + (f"; the latency model's rate {model:.0f}, not used" if model else "") + ")")
        return (f"; its {probe['rounds']} probe rounds, priced as two stretches, ran "
                f"{probe['speculative_tokens_per_s']:.0f} tokens/s ({1e3 * probe['speculative_round_s']:.2f} ms a "
                f"round by the stretches' difference, {1e3 * mean_round:.2f} ms on average{warm}) against {ar}, so it "
                + ("kept the plan" if probe["choice"] == "speculative" else "decoded plainly"))
    ar = (f"{probe['ar_tokens_per_s']:.0f} for plain steps"
          + (f" (the better of {own:.0f} measured over {probe['ar_steps']} steps and the latency model's {model:.0f})"
             if own is not None and model else ""))
    return (f"; its {probe['rounds']} probe rounds ran {probe['speculative_tokens_per_s']:.0f} tokens/s "
            f"({1e3 * probe['speculative_s'] / probe['rounds']:.1f} ms a round{warm}) against {ar}, so it "
            + ("kept the plan" if probe["choice"] == "speculative" else "decoded plainly"))


def _alpha_against_measured(plan: dict, case: dict) -> str:
    """The plan's alpha beside the acceptance its run measured: the estimate's binomial standard error on its
    reference tokens, and how far the two lie apart (the target: within 0.05)."""
    tokens, measured = plan.get("reference_tokens"), case.get("acceptance_rate")
    if not tokens or measured is None or not case.get("rounds"):
        return ""
    alpha = float(plan["alpha"])
    error = (alpha * (1 - alpha) / int(tokens)) ** 0.5
    gap = alpha - float(measured)
    return (f" (+/- {error:.2f}, one standard error on its {int(tokens)} reference tokens; the run accepted "
            f"{float(measured):.2f} of its drafted tokens over {int(case['rounds'])} rounds, {abs(gap):.2f} "
            f"{'below' if gap < 0 else 'above'} the "
            f"estimate: {'within' if abs(gap) <= 0.05 else 'outside'} the 0.05 target)")


def _knapspec_pallas_note(source: str = KNAPSPEC_PALLAS, batch: int = 16) -> str:
    """KnapSpec's two-stage plan and KnapSpec with budgeted attention against AR, all on the Pallas kernel
    (step qwen2.5-coder-1.5b-b16-32k-8k-pallas and its variants), and the 1.1x target of the paper's KnapSpec at
    32k/b16."""
    cases = load(source)["cases"]
    tag = "h100" if source.endswith("_h100.json") else "h200"  # the runs' --device-tag, in their case keys
    asked = [int(c) for c in _csv(load(source)["config"].get("contexts", "32000,16384,8192"))]
    parts, measured = [], set()
    for ctx in asked:
        ks, budget = (cases.get(f"{tag}/summarize/ctx{ctx}/b{batch}/{m}") for m in ("knapspec", "knapspec-budget"))
        if ks is None and budget is None:
            continue
        measured.add(ctx)
        text = f"{ctx} tokens"
        if ks:
            step = ks["ar_step_s"]
            text += f" (AR step {1e3 * step:.2f} ms): KnapSpec {ks['speedup_vs_ar']:.2f}x AR"
            if ks.get("plans"):
                p = ks["plans"][0]
                after_plain = load(source)["config"].get("plan_after_plain")
                when = ("before the first round" if not p["round"] else
                        f"after {p['round']} plainly decoded tokens" if after_plain else f"at round {p['round']}")
                text += (f" (its plan {when} skipped {p['n_skip_attn']} Attention / {p['n_skip_mlp']} "
                         f"MLP sub-layers at alpha {p['alpha']:.2f} on the window, gamma* = {p['gamma_star']}"
                         + (", so it decoded plainly" if p["gamma_star"] == 0 else _alpha_against_measured(p, ks))
                         + _probe_text(p.get("probe"))
                         + f"; planning {100 * ks['plan_fraction_of_decode']:.1f} % of decode, "
                           f"{1e3 * ks['timings']['plan_s']:.0f} ms" + _measured_split_text(ks) + ")")
        if budget:
            bp, probe = budget.get("budget_plan") or {}, budget.get("fixed_plan_probe") or {}
            text += (f"; KnapSpec with budgeted attention {budget['speedup_vs_ar']:.2f}x (its plan: "
                     f"{budget['draft_step_check']['n_dense_attn']} dense / {budget['draft_step_check']['n_budget_attn']} "
                     f"budgeted Attention sub-layers, gamma {bp.get('gamma')}, alpha {bp.get('alpha', 0):.2f}; planning "
                     f"{100 * budget['plan_fraction_of_decode']:.1f} % of decode")
            text += _probe_text(probe) + ")"
        parts.append(text)
    top = cases.get(f"{tag}/summarize/ctx32000/b16/knapspec")  # the target's point (batch 16 only)
    fit = load(source)["config"].get("latency_fit", "forward")
    checks = [(k, c["draft_step_check"]) for k, c in cases.items()
              if c.get("draft_step_check", {}).get("dynamic_s" if fit == "forward" else "static_s")]
    out = "; ".join(parts) + "."
    missing = [f"{round(c / 1000)}k" for c in asked if c not in measured]
    if missing:
        out += f" Not measured: {', '.join(missing)} (the device time ran out)."
    if top:
        plain = bool(top.get("plans")) and top["plans"][0]["gamma_star"] == 0
        out += (f" KnapSpec >= 1.1x AR at 32k/b16, on the kernel (with the two-stage plan made before the first "
                f"round): **{'met' if top['speedup_vs_ar'] >= 1.1 else 'missed'}** ({top['speedup_vs_ar']:.2f}x)."
                + (" With AR at the kernel's step, the skip plans that save a useful share of it drop the acceptance "
                   "on the window too far, the grid search rightly picks plain decoding, and the planning time is the "
                   "loss." if plain and top["speedup_vs_ar"] < 1.1 else ""))
    pred = [c["latency_prediction"]["ratio_measured_to_predicted"] for c in cases.values()
            if c.get("latency_prediction")]
    if checks and fit == "forward":
        dyn = [c["dynamic_over_predicted"] for _, c in checks]
        sta = [c["static_over_predicted"] for _, c in checks]
        out += (f" The latency profile on the kernel was fitted on forwards with the dynamic skip mask (a conditional "
                f"per sub-layer): the plans' draft step with that mask ran {min(dyn):.2f}-{max(dyn):.2f}x its "
                f"prediction, the same plan compiled in {min(sta):.2f}-{max(sta):.2f}x, and whole decodes less planning "
                f"{min(pred):.2f}-{max(pred):.2f}x the model's: on the GPU the conditionals cost what the static plans "
                "save, so a profile of static forwards is what static plans need.")
    elif checks:
        sta = [c["static_over_predicted"] for _, c in checks]
        within = sum(0.9 <= r <= 1.1 for r in sta)
        out += (f" With the profile of compiled masks, the plans' draft step (compiled for its plan, "
                f"{_draft_check_timing(cases, checks[0][1])}) ran {min(sta):.2f}-{max(sta):.2f}x its prediction, within 10 % at "
                f"{within} of {len(sta)} plans (target 0.9-1.1)"
                + (f", and whole decodes less planning {min(pred):.2f}-{max(pred):.2f}x the model's" if pred else "")
                + ".")
    for key in sorted(cases):
        out += _knapspec_loss_sentence(cases[key], key)
    return out


def _beyond(seconds: float) -> str:
    """'N ms beyond' or 'N ms ahead of' (a pace to finish with)."""
    return f"{1e3 * seconds:.0f} ms beyond" if seconds >= 0 else f"{-1e3 * seconds:.0f} ms ahead of"


def _knapspec_loss_sentence(case: Dict[str, Any], key: str) -> str:
    """Where a KnapSpec run whose plan drafted lost its time against the paired AR run (batch 1): planning, the plain
    stretches and the rounds each beyond AR's pace for the tokens they committed (from the engine's chunk times),
    the controller's rest; and the latency model's AR step and draft step against the measured ones, which is what
    made the DP expect the plan to pay. Empty for runs that decoded plainly, batch > 1, or runs without the log."""
    split, check, pred = (case.get(k) or {} for k in ("time_split_measured", "draft_step_check", "latency_prediction"))
    plans = case.get("plans") or []
    if (not key.endswith("/b1/knapspec") or not split.get("chunks") or not plans or not plans[0]["gamma_star"]
            or "rounds_s" not in split or not check.get("static_s") or not pred.get("step_s")):
        return ""
    step, total = case["ar_step_s"], case["ar_steps"] + round(case["tau"] * case["rounds"])
    plain_excess = split["plain_stretches_s"] - case["ar_steps"] * step
    round_tokens = total - case["ar_steps"]
    rounds_excess = split["rounds_s"] - round_tokens * step
    loss = case["timings"]["decode_s"] - case["ar_decode_s"]
    last = [c for c in split["chunks"] if c["kind"] == "rounds"][-1]
    rate = case["tau"] * last["units"] / last["seconds"]
    return (f" Where the {key.split('/')[2][3:]}-token run lost {1e3 * loss:.0f} ms against AR's "
            f"{1e3 * case['ar_decode_s']:.0f} ms: planning {1e3 * split['plan_s']:.0f} ms; the plain stretches "
            f"{_beyond(plain_excess)} AR's pace for their {case['ar_steps']} tokens; the rounds "
            f"{_beyond(rounds_excess)} it for their {round_tokens} tokens (tau {case['tau']:.2f}, the last "
            f"call {1e3 * last['seconds'] / last['units']:.2f} ms a round over {last['units']} rounds); the "
            f"controller {1e3 * split['controller_s']:.0f} ms. The latency model priced a plain step at "
            f"{1e3 * case['predicted_ar_step_s']:.2f} ms (measured {1e3 * step:.2f}), the full forward at "
            f"{1e3 * pred['step_s']:.2f} ms and the plan's draft step at {1e3 * check['predicted_s']:.2f} ms "
            f"(measured {1e3 * check['static_s']:.2f}): skipping its {check['n_skip_attn']} Attention / "
            f"{check['n_skip_mlp']} MLP sub-layers saved {1e3 * (step - check['static_s']):.2f} ms of AR's measured "
            f"step against {1e3 * (pred['step_s'] - check['predicted_s']):.2f} ms predicted, and the plan's last call "
            f"committed {rate:.0f} tokens/s at the run's tau against AR's {1 / step:.0f} ({rate * step:.2f}x).")


def _knapspec_real_baselines() -> str:
    """KnapSpec with budgeted attention and the static skip set on the real 1.5B (or what is not measured)."""
    labels = {"knapspec-budget": "KnapSpec with budgeted attention (sinks + window, K = 256, one plan)",
              "static-skip": "the static skip set (calibrated offline on another book)"}
    parts, missing = [], []
    for batch, source, methods, variant in KNAPSPEC_REAL_BASELINES:
        cases = load(source)["cases"] if (RESULTS / source).exists() else {}
        for method in methods:
            got = [(key.split("/")[2][3:], c) for key, c in cases.items()
                   if key.endswith(f"/{method}") and "speedup_vs_ar" in c]
            if got:
                bp = got[0][1].get("budget_plan") or {}
                rows = (f" (one plan before the first round on {bp['rows']} rows' last "
                        f"{bp['reference_tokens'] // bp['rows']} prompt tokens each)"
                        if method == "knapspec-budget" and bp.get("rows") else "")

                def plan_of(c):
                    bp = c.get("budget_plan")
                    if method != "knapspec-budget" or not bp:
                        return ""
                    text = (f"; plan: {bp['n_dense_attn']} dense / {bp['n_budget_attn']} budgeted / "
                            f"{bp['n_skip_attn']} skipped Attention, {bp['n_skip_mlp']} skipped MLP, gamma "
                            f"{bp['gamma']}, planning {100 * c['plan_fraction_of_decode']:.1f} % of decode")
                    t = c.get("timings") or {}
                    if c.get("rounds") and t.get("decode_s") and c.get("ar_step_s"):
                        text += (f", {1e3 * (t['decode_s'] - t.get('plan_s', 0.0)) / c['rounds']:.1f} ms a round "
                                 f"against an AR step of {1e3 * c['ar_step_s']:.1f} ms")
                    if bp.get("alpha") is not None and c.get("acceptance_rate") is not None:
                        text += (f"; the plan's alpha {bp['alpha']:.2f} on {bp['reference_tokens']} reference tokens "
                                 f"against {c['acceptance_rate']:.2f} of drafted tokens accepted")
                    if (c.get("draft_step_check") or {}).get("plan") != "budget":
                        text += "; this file's draft-step check timed the full model, not the plan, so it is not shown"
                    return text

                static = next((c for k, c in cases.items() if k.endswith(f"static_plan/b{batch}")), None)
                if method == "static-skip" and static and "gamma" in static:
                    src = (static.get("source") or {}).get("plan") or {}
                    rows = (f" (its offline plan skips {len(src.get('skip_attn', []))} Attention / "
                            f"{len(src.get('skip_mlp', []))} MLP sub-layers with gamma {static['gamma']}"
                            + (": plain decoding" if static["gamma"] == 0 else "") + ")")
                parts.append(f"{labels[method]}{' ' + KNAPSPEC_VARIANTS[variant] if variant else ''}, batch "
                             f"{batch}{rows}: " + ", ".join(
                    f"{ctx} tokens {c['speedup_vs_ar']:.2f}x AR (tau "
                    f"{'-' if c['tau'] is None else format(c['tau'], '.2f')}{plan_of(c)})" for ctx, c in got)
                    + f" (`{source}`)")
            else:
                missing.append(f"{labels[method]} at batch {batch}")
    return ((" ".join(p[:1].upper() + p[1:] + "." for p in parts) + " ") if parts else "") + (
        ("Not measured yet: " + "; ".join(missing) + " (h200-knapspec steps qwen2.5-coder-1.5b-b1-8k-32k-budget-static, "
         "qwen2.5-coder-1.5b-b16-32k-8k-budget-plan-rows, qwen2.5-coder-1.5b-b16-8k-32k-static)."
         ) if missing else "")


def h200_self_draft_note() -> str:
    """The real 1.5B drafting for itself over sinks + a window on the H200 (h200-qwen-pair self-drafts-b16)."""
    source = PAIR_SPEED_SELF[0]
    if not (RESULTS / source).exists():
        return ("The real 1.5B drafting for itself on the H200: not measured yet (h200-qwen-pair steps "
                "self-drafts-b16, self-drafts-b1).")
    def points_of(src):
        cases = {k: c for k, c in load(src)["cases"].items() if k != "copy_bandwidth"}
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
    if (RESULTS / PAIR_SPEED_SELF[1]).exists():
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
        if (RESULTS / source).exists():
            data = load(source)
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
            if "cmdbuf" in pair_run_tag(src) or int(load(src)["config"].get("gamma", 4)) != gamma:
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
                    cell = (f"{method} at {c['context'] // 1000}k, gamma {gamma}: {round_ms(r):.2f} ms a round, "
                            f"{r['metrics']['rounds']} rounds, {r['speedup_vs_ar']:.2f}x")
                    if base:
                        ratios.append(round_ms(base) / round_ms(r))
                        cell += (f" (without them {round_ms(base):.2f} ms, {base['metrics']['rounds']} rounds, "
                                 f"{base['speedup_vs_ar']:.2f}x)")
                    cmdbuf.append(cell)
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


def knapspec_two_stage_note() -> str:
    """The two-stage plan with a window of >= 64 tokens on the real 1.5B (h200-knapspec)."""
    if not (RESULTS / KNAPSPEC_TWO_STAGE).exists():
        return ("The two-stage plan on the real 1.5B: not measured yet (h200-knapspec step "
                "qwen2.5-coder-1.5b-b1-8k-32k-two-stage).")
    parts, ratios, shares, losses = [], [], [], []
    for key, c in load(KNAPSPEC_TWO_STAGE)["cases"].items():
        text = _plan_case_head(key, c, shares, losses)
        if c.get("plans"):
            p = c["plans"][0]
            ratios.append(p["seconds"] / p["predicted_seconds"])
            text += (f"; the plan: {p['reference_tokens']} reference tokens, {1e3 * p['seconds']:.0f} ms measured "
                     f"against {1e3 * p['predicted_seconds']:.0f} ms predicted, best candidate skipping "
                     f"{p['n_skip_attn']} Attention / {p['n_skip_mlp']} MLP sub-layers (alpha {p['alpha']:.2f} on the "
                     f"window) and gamma* = {p['gamma_star']} ({'plain decoding' if p['gamma_star'] == 0 else 'drafting'})")
        if not c.get("identical_to_ar"):
            text += " (bf16 output left AR's: see the bf16 note of the real-pair section)"
        parts.append(text)
    worst = max(shares)
    return ("Two-stage plan (docs/methods.md §5.6) on the real Qwen2.5-Coder-1.5B, H200, bf16, batch 1, 256 new "
            f"tokens, DP on 3 search tokens, 2 finalists scored on a window of at least 64 tokens "
            f"(`--search-tokens 3 --finalists 2 --reference-floor 64`, `{KNAPSPEC_TWO_STAGE}`): " + "; ".join(parts)
            + f". One plan with at least 64 reference tokens within 5 % of decode: **{'met' if worst <= 0.05 else 'missed'}**"
            f" ({100 * min(shares):.1f}-{100 * worst:.1f} %): the allowance predicted the plan to fit, but it ran "
            f"{min(ratios):.1f}-{max(ratios):.1f}x its prediction (the many-row price t_row(n) is timed on plain "
            "forwards of 64-256 rows, while the DP's rows go through a scan over sub-layers and, in the search, "
            "a vmap over slot states). At batch 1 the 1.5B's decode step reads its weights (3 GB) and little KV, "
            "so a skip set that keeps acceptance (one MLP) saves almost nothing, and the grid search rightly "
            "chose plain decoding. Where the time went beyond AR's (decode minus the paired AR decode; the run's "
            "own split): " + "; ".join(losses) + " (the first 6 rounds draft with the full model before the "
            "first plan; 'other' is what the split does not attribute: host work between the engine's calls and "
            "the fixed cost of each plain-decoding call, not traced). The chosen plan's predicted against "
            "measured acceptance could not be compared: no plan drafted." + knapspec_two_stage_cpu_note())


#: layers of the real Qwen2.5-Coder-1.5B (its DP's slot count is (w_attn + w_mlp) x layers / 2 + 1)
QWEN_15B_LAYERS = 28


def _old_branch_chunk(context: int) -> int:
    """Branches per attention batch the knapspec experiment used for the real 1.5B's batch-16 DP before its
    memory bound took the DP's own rows and tokens: that bound (4 GB of float32 scores, three buffers) as it
    was applied then, to 16 rows x 64 tokens x 12 heads over the case's capacity (256 new tokens, gamma_max 10);
    the files of those runs do not record it."""
    per_branch = 3 * 4 * 16 * 12 * 64 * (context + 256 + 10 + 2)
    slots = (5 + 1) * QWEN_15B_LAYERS // 2 + 1
    return 0 if per_branch * slots <= 4e9 else max(1, int(4e9 // per_branch))


def _plan_case_head(key: str, c: dict, shares: list, losses: list) -> str:
    """``8192 tokens: 0.79x AR, planning 13.8 % of decode`` for one KnapSpec case; appends its planning share
    and its time beyond AR (:func:`_time_beyond_ar`) to ``shares`` and ``losses``."""
    ctx = key.split("/")[2][3:]
    shares.append(c["plan_fraction_of_decode"])
    losses.append(_time_beyond_ar(ctx, c))
    return f"{ctx} tokens: {c['speedup_vs_ar']:.2f}x AR, planning {100 * c['plan_fraction_of_decode']:.1f} % of decode"


def _time_beyond_ar(ctx: str, c: dict) -> str:
    """Decode minus the paired AR decode of one KnapSpec case, split by the run's own estimate."""
    split = c["time_split_estimate"]
    return (f"{ctx} tokens {1e3 * (c['timings']['decode_s'] - c['ar_decode_s']):.0f} ms (plan "
            f"{1e3 * split['plan_s']:.0f}, draft + verify of the first rounds "
            f"{1e3 * (split['draft_s'] + split['verify_s']):.0f}, other {1e3 * split['other_s']:.0f}, less "
            f"the {1e3 * (c['ar_decode_s'] - split['ar_interval_s']):.0f} ms of AR steps the rounds replaced)")


def knapspec_plan_rows_note() -> str:
    """The two-stage plan at batch 16 on 2 rows' windows, real 1.5B (h200-knapspec step
    qwen2.5-coder-1.5b-b16-32k-8k-plan-rows)."""
    if not (RESULTS / KNAPSPEC_PLAN_ROWS).exists():
        return ("The two-stage plan at batch 16 on 2 rows' windows: not measured yet (h200-knapspec step "
                "qwen2.5-coder-1.5b-b16-32k-8k-plan-rows).")
    parts, shares, ratios, losses, speedups, dp, rest, slots, chunks = [], [], [], [], [], [], [], [], {}
    for key, c in load(KNAPSPEC_PLAN_ROWS)["cases"].items():
        text = _plan_case_head(key, c, shares, losses)
        speedups.append(c["speedup_vs_ar"])
        if c.get("plans"):
            p = c["plans"][0]
            slots.append((p["w_attn"] + p["w_mlp"]) * QWEN_15B_LAYERS // 2 + 1)
            chunks[int(key.split("/")[2][3:])] = _old_branch_chunk(int(key.split("/")[2][3:]))
            ratios.append(p["seconds"] / p["predicted_seconds"])
            dp.append(p.get("stage_seconds", {}).get("dp", float("nan")))
            rest.append(p.get("stage_seconds", {}).get("other", float("nan")))
            text += (f"; the plan: {p['reference_tokens']} reference tokens over 2 rows, {1e3 * p['seconds']:.0f} ms "
                     f"measured against {1e3 * p['predicted_seconds']:.0f} ms predicted"
                     + (f" ({_plan_stage_split(p)[2:]})" if p.get("stage_seconds") else "")
                     + f", best candidate skipping {p['n_skip_attn']} Attention / {p['n_skip_mlp']} MLP sub-layers "
                     f"(alpha {p['alpha']:.2f} on the window), gamma* = {p['gamma_star']}"
                     + (" (plain decoding)" if p["gamma_star"] == 0 else ""))
        parts.append(text)
    worst = max(shares)
    return ("Two-stage plan at batch 16 on 2 rows' windows (docs/methods.md §5.6; `--plan-rows 2 --search-tokens 3 "
            f"--finalists 2 --reference-floor 64`, `{KNAPSPEC_PLAN_ROWS}`), real Qwen2.5-Coder-1.5B, H200, bf16, 256 "
            "new tokens: " + "; ".join(parts) + f". Planning at most 5 % of decode: "
            f"**{'met' if worst <= 0.05 else 'missed'}** ({100 * min(shares):.1f}-{100 * worst:.1f} %): the plan ran "
            f"{min(ratios):.1f}-{max(ratios):.1f}x the allowance's prediction: the DP on the search tokens took "
            f"{min(dp):.2f}-{max(dp):.2f} s, growing with the context: the experiment bounded the DP's float32 "
            f"scores as if it ran on all 16 rows and 64 tokens, so its {min(slots)}-{max(slots)} slot states went "
            "through each attention " + ", ".join(f"{n} at a time at {round(ctx / 1000)}k"
                                                  for ctx, n in sorted(chunks.items())) + ", where the 2 rows x 3 "
            "search tokens it ran on fit all at once (the bound now uses the DP's own rows and tokens, "
            "`dp_branch_chunk` in each case), and "
            f"{min(rest):.2f}-{max(rest):.2f} s went outside the named stages at every context (not traced). "
            "No KnapSpec variant below 0.97x AR: "
            f"**{'met' if min(speedups) >= 0.97 else 'missed'}** here ({min(speedups):.2f}-{max(speedups):.2f}x). "
            "At every context the best candidate that keeps acceptance skipped a single MLP, which saves nothing "
            "measurable, so the grid search chose plain decoding and the loss is the plan and the full-model rounds "
            "before it. Where the time went beyond AR's: " + "; ".join(losses) + "."
            + " The same run with its first plan made before the first round (`--plan-at-start`, no full-model "
            "rounds; h200-knapspec step qwen2.5-coder-1.5b-b16-32k-8k-plan-rows-at-start): " + _speedups_and_shares(
                KNAPSPEC_PLAN_ROWS_AT_START) + ". " + _dp_pallas_note())


def _same_plan_as_reference() -> str:
    """Whether the plans made with the kernel's DP equal those of the reference DP's at-start run, per context."""
    if not (RESULTS / KNAPSPEC_PLAN_ROWS_AT_START).exists():
        return ""
    def firsts(source):
        return {k.split("/")[2]: (c["plans"][0]["skip_attn"], c["plans"][0]["skip_mlp"], c["plans"][0]["gamma_star"])
                for k, c in load(source)["cases"].items() if isinstance(c, dict) and c.get("plans")}
    kernel, reference = firsts(KNAPSPEC_DP_PALLAS), firsts(KNAPSPEC_PLAN_ROWS_AT_START)
    both = sorted(set(kernel) & set(reference), key=lambda c: -int(c[3:]))
    if not both:
        return ""
    same = [c for c in both if kernel[c] == reference[c]]
    plain = [c for c in both if c not in same and kernel[c][2] == 0 == reference[c][2]]
    return (f". The plan made with the kernel equals the reference DP's in the at-start run above at "
            f"{len(same)} of {len(both)} contexts ("
            + ", ".join(f"{c[3:]} tokens: skip Attention {list(kernel[c][0])}, MLP {list(kernel[c][1])}, gamma* "
                        f"{kernel[c][2]}" + ("" if c in same else " against " + str(reference[c])) for c in both) + ")"
            + (f"; where they differ ({', '.join(c[3:] for c in plain)} tokens) both have gamma* 0, so both decode "
               "plainly and the run is the same" if plain else ""))


def _dp_pallas_note() -> str:
    """The at-start run with the DP's branches in the Pallas history kernel (step ...-at-start-dp-pallas)."""
    head = ("The same with the DP's branch attention in the Pallas history kernel (`--dp-attention pallas`, "
            "docs/methods.md §4.3; step qwen2.5-coder-1.5b-b16-32k-8k-plan-rows-at-start-dp-pallas): ")
    if not (RESULTS / KNAPSPEC_DP_PALLAS).exists():
        return head + "not measured yet."
    data = load(KNAPSPEC_DP_PALLAS)
    cases, fraction = data["cases"], data["config"].get("max_plan_fraction")
    parts = []
    for key, c in cases.items():
        if not (isinstance(c, dict) and "speedup_vs_ar" in c):
            continue
        ctx = key.split("/")[2][3:]
        text = f"{ctx} tokens {c['speedup_vs_ar']:.2f}x AR, planning {100 * c['plan_fraction_of_decode']:.1f} %"
        plans = c.get("plans") or []
        if plans:
            text += " (" + "; ".join(f"the plan at round {p['round']} {1e3 * p['seconds']:.0f} ms"
                                     f"{_plan_stage_split(p)}" for p in plans) + ")"
        if len(plans) > 1 and fraction and c.get("plan_fraction_of_decode"):
            total_plan = sum(p["seconds"] for p in plans)
            decode = total_plan / c["plan_fraction_of_decode"]
            kept, spent = [plans[0]], plans[0]["seconds"]
            for prev, p in zip(plans, plans[1:]):  # the run rule: a re-plan priced as the previous one
                if spent + prev["seconds"] > fraction * decode:
                    break
                kept.append(p)
                spent += p["seconds"]
            if len(kept) < len(plans):
                rest = decode - total_plan + spent
                text += (f"; the run's planning budget (no re-plan that takes the run's planning past "
                         f"{100 * fraction:.0f} % of its projected decode time, added after this run) would not "
                         f"make {len(plans) - len(kept)} of its {len(plans)} plans: planning "
                         f"{100 * spent / rest:.1f} % of decode without them (predicted, not measured)")
        split = c.get("time_split_estimate") or {}
        if c["speedup_vs_ar"] < 0.97 and c.get("rounds") == 0 and split.get("other_s") is not None:
            text += (f"; after the plan it decoded plainly ({c['ar_steps']} plain steps, no draft round), and "
                     f"{split['other_s']:.2f} s of its {c['timings']['decode_s']:.2f} s decode went outside the plan "
                     f"and the plain steps' AR-priced time (not traced)")
        check = cases.get(key.rsplit("/", 1)[0] + "/dp_attention")
        if check:
            earlier = check.get("measured_in")
            text += (f"; the DP alone on {check['rows']} rows x {check['search_tokens']} tokens"
                     + (f" (an earlier run of the step, commit {earlier['commit'][:7]})" if earlier else "") + ": "
                     f"{1e3 * check['median_reference_s']:.0f} ms with the reference attention, "
                     f"{1e3 * check['median_folded_s']:.0f} ms in the kernel "
                     f"({check['median_reference_s'] / check['median_folded_s']:.1f}x), "
                     + ("the same candidates" if check["same_masks"] else "**different candidates**")
                     + (f" (largest cosine-sum difference {check['max_value_diff']:.1e})"
                        if check.get("max_value_diff") is not None else ""))
            blocks = []
            for rows, b in (check.get("kernel_rows_per_call") or {}).items():
                blocks.append(f"{rows} rows a call " + (f"failed ({b['error'].split(':')[0]})" if "error" in b else
                              f"{1e3 * b['median_s']:.0f} ms" + ("" if b["same_masks"] else ", **different candidates**")))
            if blocks:
                text += " (the kernel's default 64 query rows a call; " + ", ".join(blocks) + ")"
        parts.append(text)
    text = head + f"`{KNAPSPEC_DP_PALLAS}`: " + "; ".join(parts) + "."
    shares = {key.split("/")[2][3:]: c["plan_fraction_of_decode"] for key, c in cases.items()
              if isinstance(c, dict) and c.get("plan_fraction_of_decode") is not None}
    over = [f"{ctx} tokens {100 * f:.1f} %" for ctx, f in shares.items() if f > 0.05]
    if shares:
        text += (" Planning at most 5 % of decode: " + ("**met** at every context" if not over else
                 f"**missed** at {', '.join(over)}; met at the other {len(shares) - len(over)} of {len(shares)}")
                 + ".")
    checks = [c for k, c in cases.items() if k.endswith("/dp_attention")]
    if any(not c["same_masks"] for c in checks):
        text += (" The two DPs agree exactly in float32 (tests, the kernel interpreted on the CPU); this run is "
                 "bf16, where the kernel and XLA's attention round each branch's attention differently, and "
                 "through 56 sub-layers that moves some cosine sums and greedy tokens enough to change the "
                 "candidate set" + _same_plan_as_reference() + "; whether all of the difference is rounding is "
                 "not shown on the GPU.")
    windows = [p["stage_seconds"].get("window", 0.0) for c in cases.values() if isinstance(c, dict)
               for p in c.get("plans", []) if p.get("stage_seconds")]
    if windows:
        text += (f" The reference window (the plan rows' K/V copied out of the batch's cache in one compiled gather, "
                 f"jaxspec.knapspec.policy.cache_rows) took {1e3 * min(windows):.1f}-{1e3 * max(windows):.1f} ms a "
                 "plan; an eager copy of each layer's arrays, one dispatch each, was the plan's largest part in the "
                 "earlier run of this step.")
    return text



def _speedups_and_shares(source: str) -> str:
    """``32000 tokens 0.81x AR, planning 11.9 %; ...`` for each KnapSpec case of ``source``, or 'not measured yet'."""
    if not (RESULTS / source).exists():
        return "not measured yet"
    cases = [(k.split("/")[2][3:], c) for k, c in load(source)["cases"].items()
             if isinstance(c, dict) and "speedup_vs_ar" in c]
    return f"`{source}`: " + "; ".join(f"{ctx} tokens {c['speedup_vs_ar']:.2f}x AR, planning "
                                       f"{100 * c['plan_fraction_of_decode']:.1f} %" for ctx, c in cases)


def _plan_stage_split(plan: dict) -> str:
    """``: the target's states 0.13 s, the DP ... `` from a plan record's ``stage_seconds`` ('' without)."""
    stages = plan.get("stage_seconds")
    if not stages:
        return ""
    names = (("device_in_flight", "waiting for the device work in flight"),
             ("window", "the reference window"), ("boundary_states", "the target's states of the window"),
             ("dp", "the DP on the search tokens"), ("rescore", "rescoring the finalists on the window"),
             ("grid_search", "grid searches"), ("apply", "applying the plan"), ("other", "the rest"))
    return ": " + ", ".join(f"{label} {stages[k]:.2f} s" for k, label in names if k in stages)


def knapspec_two_stage_cpu_note() -> str:
    """The two-stage plan on the CPU (SmolLM2-135M, cpu-knapspec step smollm2-135m-1k-two-stage)."""
    if not (RESULTS / KNAPSPEC_TWO_STAGE_CPU).exists():
        return " On the CPU: not measured yet (cpu-knapspec step smollm2-135m-1k-two-stage)."
    (key, c), = [(k, v) for k, v in load(KNAPSPEC_TWO_STAGE_CPU)["cases"].items() if "speedup_vs_ar" in v]
    p, a = c["plans"][0], c["plan_allowance"]
    share = c["plan_fraction_of_decode"]
    single = load(KNAPSPEC_64REF)["cases"]["cpu/summarize/ctx1024/b1/candidates"]["plan_share_of_ar_decode"]
    return (f" On the CPU (SmolLM2-135M f32, 1k prompt, batch 1, 256 new tokens, the same options, "
            f"`{KNAPSPEC_TWO_STAGE_CPU}`): planning {100 * share:.1f} % of decode "
            f"(**{'met' if share <= 0.05 else 'missed'}**"
            f"; one single-stage DP on 64 tokens: {100 * single:.1f} %), {c['speedup_vs_ar']:.2f}x AR; the plan ran on "
            f"{p['reference_tokens']} reference tokens (the allowance's cap: {a['allowed_tokens']} fit its "
            f"{1e3 * a['plan_budget_s']:.0f} ms budget, below the floor of 64), {p['seconds']:.2f} s measured against "
            f"{p['predicted_seconds']:.2f} s predicted ({p['seconds'] / p['predicted_seconds']:.1f}x"
            + _plan_stage_split(p) + "); its best "
            f"candidate skipped {p['n_skip_attn']} Attention / {p['n_skip_mlp']} MLP sub-layers at alpha "
            f"{p['alpha']:.2f} on the window, and the grid search chose gamma* = {p['gamma_star']}"
            + (" (plain decoding)." if p["gamma_star"] == 0 else ".")
            + (f" The budget assumed the latency profile's {1e3 * c['predicted_ar_step_s']:.1f} ms AR step where the "
               f"paired AR run measured {1e3 * c['ar_step_s']:.1f} ms, so the plan the budget admitted is "
               f"{c['predicted_ar_step_s'] / c['ar_step_s']:.2f}x the share it was sized for"
               + (f"; a plan on 64 tokens at the modelled price ({a['predicted_dp_search_s']:.2f} s + 64 x "
                  f"{1e3 * a['predicted_dp_s_per_token']:.1f} ms) would be "
                  f"{100 * (a['predicted_dp_search_s'] + 64 * a['predicted_dp_s_per_token']) / (256 * c['ar_step_s']):.1f}"
                  " % of a 256-step decode at the measured step." if "predicted_dp_search_s" in a else ".")
               if c["predicted_ar_step_s"] > 1.1 * c["ar_step_s"] else "")
            + knapspec_at_start_cpu_note(c) + knapspec_after_plain_note(KNAPSPEC_AFTER_PLAIN_CPU, "cpu-knapspec step "
                                                                          "smollm2-135m-1k-two-stage-after-plain")
            + knapspec_plain_states_note()
            + knapspec_plain_priced_cpu_note(c) + knapspec_qwen_at_start_cpu_note())


def knapspec_qwen_at_start_cpu_note() -> str:
    """The at-start two-stage planner on the real Qwen2.5-Coder-1.5B on the CPU (cpu-knapspec step
    qwen2.5-coder-1.5b-1k-two-stage-at-start), against the single-stage run of the same model."""
    if not (RESULTS / KNAPSPEC_AT_START_QWEN_CPU).exists():
        return ""
    (_, c), = [(k, v) for k, v in load(KNAPSPEC_AT_START_QWEN_CPU)["cases"].items() if "speedup_vs_ar" in v]
    a = c.get("plan_allowance") or {}
    single = dict(pair for pair in load(f"{K}qwen2.5-coder-1.5b_1k_b1_cpu.json")["cases"].items()).get(
        "cpu/summarize/ctx1024/b1/knapspec") if (RESULTS / f"{K}qwen2.5-coder-1.5b_1k_b1_cpu.json").exists() else None
    text = (f" The real Qwen2.5-Coder-1.5B with the at-start planner (f32 CPU, 1k, batch 1, 256 new tokens, "
            f"`{KNAPSPEC_AT_START_QWEN_CPU}`, AR step {1e3 * c['ar_step_s']:.0f} ms): {c['speedup_vs_ar']:.2f}x AR, "
            f"planning {100 * c['plan_fraction_of_decode']:.1f} % of decode")
    if a.get("skip"):
        text += (f"; the allowance priced the DP's search alone at {a['predicted_dp_search_s']:.2f} s against a "
                 f"{a['plan_budget_s']:.2f} s budget ({1e3 * a['predicted_dp_s_per_token']:.0f} ms a reference token), "
                 "so it made no plan and decoded plainly")
    elif c.get("plans"):
        p = c["plans"][0]
        text += (f"; its plan skipped {p['n_skip_attn']} Attention / {p['n_skip_mlp']} MLP sub-layers at alpha "
                 f"{p['alpha']:.2f}, gamma* = {p['gamma_star']}")
    if single:
        text += (f" (the single-stage plan of the earlier qwen2.5-coder-1.5b-1k step, 128 new tokens: "
                 f"{single['speedup_vs_ar']:.2f}x AR with planning {100 * single['plan_fraction_of_decode']:.0f} % of "
                 "decode)")
    return text + "." + _qwen_one_finalist_cpu_note()


def _qwen_one_finalist_cpu_note() -> str:
    """The cheapest two-stage plan (2 search tokens, 1 finalist, the window's states from the prefill) on the real
    Qwen2.5-Coder-1.5B on the CPU (cpu-knapspec step qwen2.5-coder-1.5b-1k-at-start-prefill-states-1-finalist)."""
    step = "cpu-knapspec step qwen2.5-coder-1.5b-1k-at-start-prefill-states-1-finalist"
    if not (RESULTS / KNAPSPEC_ONE_FINALIST_QWEN_CPU).exists():
        return f" The same model with the cheapest two-stage plan: not measured yet ({step})."
    data = load(KNAPSPEC_ONE_FINALIST_QWEN_CPU)
    (_, c), = [(k, v) for k, v in data["cases"].items() if "speedup_vs_ar" in v]
    cfg, a, share = data["config"], c.get("plan_allowance") or {}, c["plan_fraction_of_decode"]
    text = (f" The same model with the cheapest two-stage plan ({cfg.get('search_tokens')} search tokens, "
            f"{cfg.get('finalists')} finalist, the window's states kept by the prefill; {step}, "
            f"`{KNAPSPEC_ONE_FINALIST_QWEN_CPU}`): " + _start_plan_text(c))
    tokens = c["plans"][0]["reference_tokens"] if c.get("plans") else 0
    if tokens and a.get("predicted_dp_search_s") and a.get("predicted_dp_s_per_token"):
        st = c["plans"][0].get("stage_seconds") or {}
        text += (f"; the allowance priced the DP's search at {a['predicted_dp_search_s']:.2f} s and the window at "
                 f"{1e3 * a['predicted_dp_s_per_token']:.1f} ms a token, so the DP ran "
                 f"{st.get('dp', 0) / a['predicted_dp_search_s']:.1f}x and the rescoring "
                 f"{st.get('rescore', 0) / (tokens * a['predicted_dp_s_per_token']):.1f}x its price: the many-row "
                 "price, timed on plain forwards, undercounts both here")
    return text + (f". At most 5 % with at least 64 reference tokens: "
                   f"**{'met' if share <= 0.05 and tokens >= 64 else 'missed'}** in this run.")


def knapspec_plain_priced_cpu_note(base: dict) -> str:
    """The CPU two-stage step with plain decoding priced at the decode loop's own step (the profile's p)."""
    if not (RESULTS / KNAPSPEC_PLAIN_PRICED_CPU).exists():
        return ""
    data = load(KNAPSPEC_PLAIN_PRICED_CPU)
    (_, c), = [(k, v) for k, v in data["cases"].items() if "speedup_vs_ar" in v]
    fit, a = data["latency_b1"]["fit"], c["plan_allowance"]
    share = c["plan_fraction_of_decode"]
    text = (f" Priced at the decode loop's own step instead (the profile times it beside the full step: p = "
            f"{fit['p']:.2f} against a = {fit['a']:.2f}; step smollm2-135m-1k-two-stage-plain-priced, "
            f"`{KNAPSPEC_PLAIN_PRICED_CPU}`): the predicted AR step is {1e3 * c['predicted_ar_step_s']:.1f} ms where "
            f"the paired AR run measured {1e3 * c['ar_step_s']:.1f} ms ({c['predicted_ar_step_s'] / c['ar_step_s']:.2f}x; "
            f"priced with this profile's a it would be "
            f"{c['predicted_ar_step_s'] * fit['a'] / fit['p'] / c['ar_step_s']:.2f}x; the run above, with its own "
            f"profile: {base['predicted_ar_step_s'] / base['ar_step_s']:.2f}x, so most of that miss came from that "
            f"profile's timings, which this machine did not repeat, not from a against p), the budget "
            f"{1e3 * a['plan_budget_s']:.0f} ms")
    if a.get("skip"):
        text += f", too little for the minimum window: no plan, planning {100 * share:.1f} % of decode"
    elif c.get("plans"):
        p = c["plans"][0]
        text += (f", the plan {p['reference_tokens']} reference tokens, {p['seconds']:.2f} s measured against "
                 f"{p['predicted_seconds']:.2f} s predicted; planning {100 * share:.1f} % of decode "
                 f"(**{'met' if share <= 0.05 else 'missed'}**), {c['speedup_vs_ar']:.2f}x AR, gamma* = "
                 f"{p['gamma_star']}")
    return text + " (one run on a shared 2-core CPU)."


def knapspec_calibrated_note() -> str:
    """The two-stage plan with the allowance pricing plans at their measured cost (``--plan-cost-scale-from``):
    the CPU step, and the H200 batch-16 step when measured."""
    parts = []
    for source, where in ((KNAPSPEC_CALIBRATED_CPU, "CPU, SmolLM2-135M f32, 1k, batch 1"),
                          (KNAPSPEC_PLAN_ROWS_CALIBRATED, "H200, real Qwen2.5-Coder-1.5B bf16, batch 16, 2 plan rows")):
        if not (RESULTS / source).exists():
            parts.append(f"{where}: not measured yet (`{source}`)")
            continue
        data = load(source)
        scale = data["config"].get("plan_cost_scale", 1.0)
        runs = []
        for key, c in data["cases"].items():
            if not isinstance(c, dict) or "speedup_vs_ar" not in c:
                continue
            a, ctx = c.get("plan_allowance") or {}, key.split("/")[2][3:]
            text = f"{ctx} tokens {c['speedup_vs_ar']:.2f}x AR, planning {100 * c['plan_fraction_of_decode']:.1f} %"
            if a.get("skip"):
                text += f" (no plan: {a.get('allowed_tokens')} tokens fit, under the minimum)"
            elif c.get("plans"):
                p = c["plans"][0]
                text += (f" ({p['reference_tokens']} reference tokens, {1e3 * p['seconds']:.0f} ms measured against "
                         f"{1e3 * p['predicted_seconds']:.0f} ms predicted, gamma* = {p['gamma_star']})")
                unscaled = KNAPSPEC_TWO_STAGE_CPU if source == KNAPSPEC_CALIBRATED_CPU else None
                if unscaled and (RESULTS / unscaled).exists() and "rescore" in p.get("stage_seconds", {}):
                    (_, b), = [(k, v) for k, v in load(unscaled)["cases"].items() if "speedup_vs_ar" in v]
                    bp = b["plans"][0]
                    if "rescore" in bp.get("stage_seconds", {}):
                        mine, theirs = p["stage_seconds"]["rescore"], bp["stage_seconds"]["rescore"]
                        width = p["reference_tokens"] / bp["reference_tokens"]
                        text += (f"; rescoring the finalists took {mine:.2f} s on {p['reference_tokens']} tokens "
                                 f"against {theirs:.2f} s on {bp['reference_tokens']} in the unscaled run "
                                 f"(`{unscaled}`)")
                        if width < 0.7 and mine / theirs > 0.7:
                            text += (": mostly a fixed cost per plan, which one factor on a per-token price cannot "
                                     "express, so the smaller window saved little")
                        else:
                            text += ", about in proportion to the window"
            runs.append(text)
        parts.append(f"{where}, price x {scale:.2f} (`{source}`): " + "; ".join(runs))
    return ("The allowance pricing a plan at what earlier plans of the model measured against their prediction "
            "(docs/methods.md §5.6, `--plan-cost-scale-from`): " + ". ".join(parts) + ".")


def knapspec_after_plain_note(source: str, step: str) -> str:
    """A KnapSpec run whose first plan came after plain tokens, on those alone (``--plan-after-plain``): its speed-up,
    the plan, and the plan's acceptance estimate against the acceptance its rounds measured."""
    if not (RESULTS / source).exists():
        return f" The first plan made after 64 plain tokens on those alone (`--plan-after-plain 64`): not measured yet ({step})."
    (key, c), = [(k, v) for k, v in load(source)["cases"].items() if "speedup_vs_ar" in v]
    plans = c.get("plans") or []
    text = (f" The first plan made after {load(source)['config'].get('plan_after_plain')} plain tokens on those alone "
            f"(`--plan-after-plain`, `{source}`): {c['speedup_vs_ar']:.2f}x AR, planning "
            f"{100 * c['plan_fraction_of_decode']:.1f} % of decode")
    if not plans:
        return text + ", no plan made (the planning allowance skipped it)."
    p = plans[0]
    text += (f"; its plan at step {p['round']} on {p['reference_tokens']} reference tokens skipped {p['n_skip_attn']} "
             f"Attention / {p['n_skip_mlp']} MLP sub-layers at an estimated acceptance of {p['alpha']:.2f} and chose "
             f"gamma* = {p['gamma_star']}")
    if c.get("rounds"):
        text += f"; the run's rounds measured an acceptance of {c['acceptance_rate']:.2f} (tau {c['tau']:.2f})"
    return text + "."


def knapspec_plain_states_note() -> str:
    """The plan after 64 plain tokens computing its window's target states against taking them from the plain
    stretch that decoded the window (docs/methods.md §5.6), the two runs measured one after the other with one
    latency profile."""
    found = {kind: RESULTS / path for kind, path in KNAPSPEC_AFTER_PLAIN_STATES_CPU.items()}
    if not all(path.exists() for path in found.values()):
        return (" The plan after plain tokens computing its window's states against taking them from the plain "
                "stretch: not measured yet (cpu-knapspec steps smollm2-135m-1k-two-stage-after-plain-own-states, "
                "-kept-states).")
    parts = []
    for kind, what in (("own", "computing its window's states"), ("kept", "with them kept by the plain stretch")):
        (_, c), = [(k, v) for k, v in load(found[kind])["cases"].items() if "speedup_vs_ar" in v]
        p = (c.get("plans") or [{}])[0]
        states = (p.get("stage_seconds") or {}).get("boundary_states")
        parts.append(f"{what} {c['speedup_vs_ar']:.2f}x AR, planning {100 * c['plan_fraction_of_decode']:.1f} % of "
                     f"decode" + (f" (the plan {1e3 * p['seconds']:.0f} ms, its window's states "
                                  f"{1e3 * states:.0f} ms of it)" if p.get("seconds") and states is not None else ""))
    return (f" The plan after 64 plain tokens, with a profile without the per-call cost "
            f"(`{KNAPSPEC_AFTER_PLAIN_STATES_CPU['own']}`, `{KNAPSPEC_AFTER_PLAIN_STATES_CPU['kept']}`): "
            + "; ".join(parts) + ".")


def knapspec_at_start_cpu_note(base: dict) -> str:
    """The CPU two-stage plan made before the first round (cpu-knapspec step smollm2-135m-1k-two-stage-at-start),
    beside ``base``, the same plan after round 6."""
    if not (RESULTS / KNAPSPEC_AT_START_CPU).exists():
        return (" The same plan before the first round (`--plan-at-start`): not measured yet (cpu-knapspec step "
                "smollm2-135m-1k-two-stage-at-start).")
    (key, c), = [(k, v) for k, v in load(KNAPSPEC_AT_START_CPU)["cases"].items() if "speedup_vs_ar" in v]
    p = c["plans"][0] if c.get("plans") else None
    split, base_split = c["time_split_estimate"], base["time_split_estimate"]
    return (f" The same plan made before the first round on the prompt's last 64 tokens (`--plan-at-start`, "
            f"`{KNAPSPEC_AT_START_CPU}`): {c['speedup_vs_ar']:.2f}x AR (after round 6: {base['speedup_vs_ar']:.2f}x), "
            f"planning {100 * c['plan_fraction_of_decode']:.1f} % of decode, draft + verify "
            f"{1e3 * (split['draft_s'] + split['verify_s']):.0f} ms (after round 6: "
            f"{1e3 * (base_split['draft_s'] + base_split['verify_s']):.0f} ms)"
            + (f"; the plan at round {p['round']} ran on {p['reference_tokens']} reference tokens in "
               f"{1e3 * p['seconds']:.0f} ms{_plan_stage_split(p).replace(': ', ' (', 1) + ')' if p.get('stage_seconds') else ''}, "
               f"skipped {p['n_skip_attn']} Attention / {p['n_skip_mlp']} MLP sub-layers at alpha {p['alpha']:.2f} "
               f"and chose gamma* = {p['gamma_star']}" if p else "")
            + (". The two speed-ups are within this machine's run-to-run spread of the paired AR speed-up (about "
               "±5 %)." if abs(c["speedup_vs_ar"] - base["speedup_vs_ar"]) < 0.05 else "."))


def _repriced_tpt(source: str, tag: str, ctx: int) -> str:
    """A correlation run's candidates priced again (``reprice-tpt``): with the measured acceptance in place of the
    DP's alpha, and by other latency profiles (the half-skip one, docs/methods.md §4.1): which side of the
    prediction holds the correlation back."""
    if not source or not (RESULTS / source).is_file():
        return ""
    case = load(source)["cases"].get(f"{tag}/summarize/ctx{ctx}/b1/repriced")
    if not case:
        return ""
    fmt = lambda r: "n/a" if r is None else f"{r:.2f}"  # noqa: E731
    by = {(row["profile"], row["alpha"]): row["pearson_vs_throughput"] for row in case["rows"]}
    own = case["rows"][0]["profile"]
    r_dp, r_measured = by.get((own, "dp")), by.get((own, "measured"))
    out = (f" The same candidates priced again (`{source}`, reprice-tpt): with their measured acceptance in place of "
           f"the DP's alpha, by the same latency model, r = {fmt(r_measured)} with tokens/s against {fmt(r_dp)} with "
           f"the DP's alpha")
    for profile in dict.fromkeys(row["profile"] for row in case["rows"]):
        if profile == own:
            continue
        method = next(row["method"] for row in case["rows"] if row["profile"] == profile)
        shown = "/".join(pathlib.Path(profile).parts[-2:])  # folder and name: two profiles may share a name
        out += (f"; by the {method} profile (`{shown}`) r = {fmt(by.get((profile, 'dp')))} with "
                f"the DP's alpha, {fmt(by.get((profile, 'measured')))} with the measured acceptance")
    if r_dp is not None and r_measured is not None and r_measured - r_dp >= 0.1:
        return out + ": the DP's alpha, more than the latency model, holds the prediction back."
    return out + "."


def _tpt_correlation_parts(source: str, tag: str = "cpu",
                           contexts: Sequence[int] = TPT_CORRELATION_CONTEXTS) -> Tuple[List[str], List[bool]]:
    """Per context of one TPT-correlation run (case keys under its device ``tag``): a sentence and whether the
    target was met there."""
    d = load(source)
    parts, verdicts = [], []
    for ctx in contexts:
        c = d["cases"].get(f"{tag}/summarize/ctx{ctx}/b1/correlation")
        if c is None:
            parts.append(f"At {_tokens_k(ctx)}: not measured.")
            continue
        if c["plans"] < 3:
            # Pearson needs three plans; a two-stage planner hands back only its finalists (--finalists)
            fixed = _fixed_cases(d, f"{tag}/summarize/ctx{ctx}/b1/fixed/")
            parts.append(f"At {_tokens_k(ctx)}: only {c['plans']} plans (the two-stage planner handed back only its "
                         f"{c['plans']} finalists), so no correlation; their median paired speed-ups "
                         + ", ".join(f"{f['speedup_vs_ar']:.2f}x (predicted TPT {f['predicted_tpt']:.0f})"
                                     for f in fixed) + ".")
            continue
        r_tpt, r_tput = c["pearson_predicted_tpt_vs_speedup"], c["pearson_predicted_tpt_vs_throughput"]
        r_plain, r_acc = c.get("pearson_predicted_tpt_no_exit_vs_speedup"), c["pearson_measured_acceptance_vs_speedup"]
        ok = [r is not None and r >= 0.84 and (r_acc is None or r > r_acc) for r in (r_tpt, r_tput)]
        verdicts.append(all(ok))
        fmt = lambda r: "n/a" if r is None else f"{r:.2f}"  # noqa: E731
        fixed = _fixed_cases(d, f"{tag}/summarize/ctx{ctx}/b1/fixed/")
        # the latency model fed each run's own rounds and draft steps: its time part alone
        timed = _pearson([f["ar_decode_s"] / f["latency_prediction"]["decode_s"] for f in fixed],
                         [f["speedup_vs_ar"] for f in fixed])
        errors = {mode: sum(f[f"alpha_{mode}"] - f["acceptance_rate"] for f in fixed) / len(fixed)
                  for mode, _ in DP_REFERENCES}
        abs_errors = {mode: sum(abs(f[f"alpha_{mode}"] - f["acceptance_rate"]) for f in fixed) / len(fixed)
                      for mode, _ in DP_REFERENCES}
        ar_rates = [f["ar_tokens_per_s"] for f in fixed]
        parts.append(f"At {_tokens_k(ctx)} ({c['plans']} plans): r = {fmt(r_tpt)} with speed-up, {fmt(r_tput)} with "
                     f"tokens/s (the exit-free TPT {fmt(r_plain)}; the DP's alpha "
                     f"{fmt(c.get('pearson_dp_alpha_vs_speedup'))}, the measured acceptance {fmt(r_acc)}; measured speed-ups "
                     f"{min(c['measured_speedup']):.2f}-{max(c['measured_speedup']):.2f}x, predicted "
                     f"{min(c['predicted_speedup']):.2f}-{max(c['predicted_speedup']):.2f}x; the paired AR "
                     f"{min(ar_rates):.1f}-{max(ar_rates):.1f} tokens/s). The latency model fed each run's own rounds "
                     f"and draft steps gives r = {fmt(timed)}"
                     + (": the time side holds" if timed is not None and timed >= 0.84 else "")
                     + " (DP alpha - measured acceptance, mean / mean absolute: " + ", ".join(
                         f"{'the paper' if mode == 'branch' else 'target'} reference {errors[mode]:+.3f} / "
                         f"{abs_errors[mode]:.3f}" for mode, _ in DP_REFERENCES)
                     + f"; the target reference above it on {sum(f['alpha_target'] > f['acceptance_rate'] for f in fixed)}"
                     f" of {len(fixed)} plans)."
                     + _repriced_tpt(REPRICED.get(source, ""), tag, ctx))
    return parts, verdicts


def knapspec_tpt_correlation_note() -> str:
    """Predicted TPT against measured speed-up and throughput over fixed candidate plans (the paper's
    Pearson 0.837 against 0.538 for acceptance), each candidate priced as the planner prices it."""
    if not (RESULTS / KNAPSPEC_TPT_CORRELATION).exists():
        return ("Pearson of predicted TPT with throughput >= 0.84 and above acceptance's: not measured with the "
                "planner's exit-aware prices yet (step `smollm2-135m-1k-2k-tpt-correlation` of `cpu-knapspec`).")
    parts, verdicts = _tpt_correlation_parts(KNAPSPEC_TPT_CORRELATION)
    target_text = ""
    if (RESULTS / KNAPSPEC_TPT_CORRELATION_TARGET).exists():
        target_parts, target_verdicts = _tpt_correlation_parts(KNAPSPEC_TPT_CORRELATION_TARGET)
        verdicts += target_verdicts
        target_text = (f" With the DP's acceptance taken against the target's K/V (docs/methods.md §4.3; its own "
                       f"candidate plans, the same latency profile, `{KNAPSPEC_TPT_CORRELATION_TARGET}`): "
                       + " ".join(target_parts))
    if (RESULTS / KNAPSPEC_TPT_CORRELATION_REPEATS).exists():
        repeat_parts, repeat_verdicts = _tpt_correlation_parts(KNAPSPEC_TPT_CORRELATION_REPEATS)
        verdicts += repeat_verdicts
        plans = [v for k, v in load(KNAPSPEC_TPT_CORRELATION_REPEATS)["cases"].items() if "/fixed/" in k]
        spreads = [max(p["speedup_vs_ar"] for p in f["pairs"]) / min(p["speedup_vs_ar"] for p in f["pairs"]) - 1
                   for f in plans if f.get("pairs")] or [0.0]
        target_text += (f" With each plan timed in {max(len(f.get('pairs') or [1]) for f in plans)} "
                        f"(AR, plan) pairs and its median pair's speed-up (`{KNAPSPEC_TPT_CORRELATION_REPEATS}`, step "
                        f"`smollm2-135m-1k-2k-tpt-correlation-repeats`; its own DP candidates and the same latency "
                        f"profile; a plan's pairs spread {100 * min(spreads):.1f}-{100 * max(spreads):.1f} %): "
                        + " ".join(repeat_parts))
    if (RESULTS / KNAPSPEC_TPT_CORRELATION_H100).exists():
        gpu_parts, gpu_verdicts = _tpt_correlation_parts(KNAPSPEC_TPT_CORRELATION_H100, "h100", (32000,))
        verdicts += gpu_verdicts
        target_text += (f" On an H100 with the real Qwen2.5-Coder-1.5B, batch 1, on the Pallas kernel, each plan "
                        f"compiled for itself and timed in 3 (AR, plan) pairs (`{KNAPSPEC_TPT_CORRELATION_H100}`, suite "
                        f"h100-long-context step `knapspec-qwen2.5-coder-1.5b-b1-32k-tpt-correlation`): "
                        + " ".join(gpu_parts))
    else:
        target_text += (" On an H100 with the real Qwen2.5-Coder-1.5B at 32k, batch 1 (suite h100-long-context step "
                        "`knapspec-qwen2.5-coder-1.5b-b1-32k-tpt-correlation`): not measured yet.")
    if (RESULTS / KNAPSPEC_TPT_CORRELATION_H100_8).exists():
        gpu_parts, gpu_verdicts = _tpt_correlation_parts(KNAPSPEC_TPT_CORRELATION_H100_8, "h100", (32000,))
        verdicts += gpu_verdicts
        target_text += (f" The same with 8 finalists (`{KNAPSPEC_TPT_CORRELATION_H100_8}`): " + " ".join(gpu_parts))
    else:
        target_text += (" The same with 8 finalists, so that 8 plans are timed (step "
                        "`knapspec-qwen2.5-coder-1.5b-b1-32k-tpt-correlation-8-finalists`): not measured yet.")
    verdict = "met" if verdicts and all(verdicts) else ("missed" if not any(verdicts) else "met in some runs")
    why = (" The DP's alpha comes from the first 64 generated tokens; the fixed plans are measured over 256, "
           "and the skip plans' speed-ups differ by little more than the estimate's error and the paired AR's "
           "drift, so those errors reorder them. Every fixed plan drafts one token a round, and such a draft "
           "attends to the target's K/V of every earlier token, which is what the target reference scores on the "
           "window: where that estimate misses the measured acceptance with one sign on (nearly) every plan, the "
           "window's tokens were easier or harder to draft than the ones decoded after it, which no estimate on "
           "the window alone can see.")
    return (f"Pearson of predicted TPT with measured speed-up and throughput >= 0.84 and above acceptance's "
            f"(`{KNAPSPEC_TPT_CORRELATION}`, fixed candidate plans each priced as the planner's grid search prices it, "
            f"early exit modelled from the DP's confidence statistics on 64 reference tokens; the paper's reference): "
            f"**{verdict}**. " + " ".join(parts) + target_text + why)


def _pearson(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
    n = len(x)
    if n < 3:
        return None
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else None


def knapspec_alpha_notes() -> List[str]:
    if not (RESULTS / KNAPSPEC_ALPHA).exists():
        return ["The DP's acceptance estimate within 0.05 of the measured acceptance: not measured with both "
                "references yet (step `smollm2-135m-1k-64ref-alpha` of `cpu-knapspec`)."]
    d = load(KNAPSPEC_ALPHA)
    fixed = _fixed_cases(d)
    err = {mode: [c[f"alpha_{mode}"] - c["acceptance_rate"] for c in fixed] for mode, _ in DP_REFERENCES}
    worst = {mode: max(map(abs, e)) for mode, e in err.items()}
    met = {mode: w <= 0.05 for mode, w in worst.items()}
    text = ("The DP's acceptance estimate within 0.05 of the measured acceptance (64 reference tokens, "
            f"{len(fixed)} fixed plans): " + "; ".join(
                f"{label}: **{'met' if met[mode] else 'missed'}**, largest error {worst[mode]:.3f}, mean "
                f"{sum(err[mode]) / len(err[mode]):+.3f}" for mode, label in DP_REFERENCES) + ".")
    chosen = _chosen_fixed(d)
    if chosen is not None:
        text += (f" The planner's choice (skipped weight {chosen['weight']}, gamma {chosen['gamma']}): estimates "
                 f"{chosen['alpha_branch']:.3f} / {chosen['alpha_target']:.3f} against {chosen['acceptance_rate']:.3f}"
                 " measured.")
    text += (" The paper's reference runs the window through each candidate as one sequence, so a skipped "
             "sub-layer's error reaches every later reference token through its K/V and the estimate comes out "
             "low; a draft step sees the full model's K/V of the committed tokens, which the target reference "
             "reproduces. For a gamma = 1 plan it computes nearly the measured quantity itself, on the first 64 of "
             "the 256 positions the plan is measured on (the outputs equal AR's, so the contexts are the same): "
             "what remains of its error is that sample's. KnapSpec keeps the paper's reference by default "
             "(`--knapspec-reference-kv target` switches).")
    target_ref = [(batch, key.split("/")[2][3:], c["speedup_vs_ar"]) for batch, src in KNAPSPEC_REAL.items()
                  if (RESULTS / src).exists() for key, c in load(src)["cases"].items()
                  if key.endswith("/knapspec-target-ref") and "speedup_vs_ar" in c]
    if target_ref:
        text += (" With the target reference on the real Qwen2.5-Coder-1.5B on the H200 (method knapspec-target-ref, "
                 "the real-weights note below) it decodes at " + ", ".join(
                     f"{x:.2f}x AR ({ctx} tokens, batch {b})" for b, ctx, x in target_ref) + ".")
    else:
        text += " Which plans the DP picks with the target reference, and what they decode at, is not measured yet."
    return [text]


def _quality(model, context, method, budget, field):
    def get(_):
        rows = quality_rows(quality_cases(model, context))
        return read_path(rows, ({"method": method, "k": budget}, field))
    return get


# ---------------------------------------------------------------------------- Dustin input-aware m (from the JSON)
#: the dustin-quality methods of docs/methods.md §3.7 (max-mass, coverage, the per-round oracle)
M_RULE_METHOD_NAMES = tuple(method for method, _, _ in M_RULES) + ("dustin-h-oracle",)


RULE_METHODS = tuple(method for method, _, _ in M_RULES)


def m_rule_rows(cases: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per k (mean over items): ARR of fixed m (dustin-h), each input-aware rule and the oracle, the
    share of the fixed-m-to-oracle ARR gap each rule closes, agreement with dense, accuracy, and
    the selection seconds per round (fixed vs each rule, on the same signals). ARR and the
    per-round records come from the dense reference runs (``arr``, ``m_rule``), so they exist as
    soon as an item's reference is measured; agreement and accuracy from each method's decode."""
    methods = ("dustin-h",) + M_RULE_METHOD_NAMES
    arrs: Dict[Tuple[str, int], List[float]] = {}
    stats: Dict[Tuple[str, int], List[dict]] = {}
    decodes: Dict[Tuple[str, int], List[dict]] = {}
    for record in cases.values():
        if "method" in record:
            if record["method"] in methods:
                decodes.setdefault((record["method"], record["budget"]), []).append(record)
            continue
        for key, value in (record.get("arr") or {}).items():
            name, _, budget = key.rpartition("/k")
            if name in methods and value is not None:
                arrs.setdefault((name, int(budget)), []).append(value)
        for key, value in (record.get("m_rule") or {}).items():
            name, _, budget = key.rpartition("/k")
            stats.setdefault((name, int(budget)), []).append(value)

    def mean(values):
        values = [x for x in values if x is not None]
        return sum(values) / len(values) if values else None

    rows = []
    for budget in sorted({b for _, b in arrs}):
        fixed, oracle = mean(arrs.get(("dustin-h", budget), [])), mean(arrs.get(("dustin-h-oracle", budget), []))
        row = {"k": budget, "items": len(arrs.get(("dustin-h", budget), [])),
               "m_fixed": mean([r.get("m") for r in decodes.get(("dustin-h", budget), [])])}
        for method, tag in (("dustin-h", "fixed"),) + tuple((m, t) for m, t, _ in M_RULES) + (
                ("dustin-h-oracle", "oracle"),):
            arr = mean(arrs.get((method, budget), []))
            row[f"arr_{tag}"] = arr
            row[f"match_{tag}"] = mean([r.get("match_rate") for r in decodes.get((method, budget), [])])
            row[f"accuracy_{tag}"] = mean([r.get("accuracy") for r in decodes.get((method, budget), [])])
            if method in RULE_METHODS:
                gap = None if oracle is None or fixed is None else oracle - fixed
                row[f"gap_closed_{tag}"] = (arr - fixed) / gap if arr is not None and gap and gap > 0 else None
                per_item = stats.get((method, budget), [])
                row[f"selection_s_{tag}"] = mean([r.get("selection_s_input_aware") for r in per_item])
                row[f"selection_s_fixed_{tag}"] = mean([r.get("selection_s_fixed") for r in per_item])
                row[f"selection_ratio_{tag}"] = mean([r.get("selection_cost_ratio") for r in per_item])
                row[f"mean_m_{tag}"] = mean([mean(r["m_per_round"]) for r in per_item if r.get("m_per_round")])
            if method == "dustin-h-oracle":
                row["mean_m_oracle"] = mean([mean(r["m_per_round"]) for r in stats.get((method, budget), [])
                                             if r.get("m_per_round")])
        row["selection_s_fixed"] = next((row[f"selection_s_fixed_{t}"] for _, t, _ in M_RULES
                                         if row.get(f"selection_s_fixed_{t}") is not None), None)
        rows.append(row)
    return rows


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

def _m_rule(budget, field):
    def get(data):
        return read_path(m_rule_rows(data["cases"]), ({"k": budget}, field))
    return get


def m_per_length_rows(source: str, base: str) -> List[Dict[str, Any]]:
    """Per k: the run with the profile's m per context length (``source``) against the run with its single m on the
    same items (``base``): m, ARR, the share of the single m's gap to the oracle closed, token match with dense and
    accuracy of the single m, the coverage rule around it, the length's m, the coverage rule around that, and the
    oracle; raises ValueError if the two runs did not decode the same items to the same dense tokens."""
    mine, theirs = load(source)["cases"], load(base)["cases"]
    dense = {k for k in mine if k.endswith("/dense")}
    if dense != {k for k in theirs if k.endswith("/dense")}:
        raise ValueError(f"{source}: not the items of {base}")
    same = {k[: -len("/dense")] for k in dense if mine[k]["tokens"] == theirs[k]["tokens"]}
    if not same:
        raise ValueError(f"{source}: no item's dense tokens equal {base}'s")
    # runs on two GPUs can round one item's dense decode apart: only the items both decoded alike are compared
    mine, theirs = ({k: v for k, v in cases.items() if k.rsplit("/", 2)[0] in same or k[: -len("/dense")] in same}
                    for cases in (mine, theirs))
    single = {r["k"]: r for r in m_rule_rows(theirs)}
    rows = []
    for r in m_rule_rows(mine):
        b = single.get(r["k"])
        if b is None:
            continue
        fixed, oracle = b["arr_fixed"], b["arr_oracle"]
        gap = None if fixed is None or oracle is None else oracle - fixed
        row = {"k": r["k"], "items": r["items"], "items_differing": len(dense) - len(same),
               "m_fixed": b["m_fixed"], "m_length": r["m_fixed"],
               "mean_m_coverage": b.get("mean_m_coverage"), "mean_m_length_coverage": r.get("mean_m_coverage"),
               "selection_ratio_length_coverage": r.get("selection_ratio_coverage"),
               "selection_ratio_coverage": b.get("selection_ratio_coverage")}
        for tag, src, field in (("fixed", b, "fixed"), ("coverage", b, "coverage"), ("length", r, "fixed"),
                                ("length_coverage", r, "coverage"), ("oracle", b, "oracle")):
            row[f"arr_{tag}"] = src.get(f"arr_{field}")
            row[f"match_{tag}"] = src.get(f"match_{field}")
            row[f"accuracy_{tag}"] = src.get(f"accuracy_{field}")
            if tag not in ("fixed", "oracle"):
                arr = row[f"arr_{tag}"]
                row[f"gap_closed_{tag}"] = (arr - fixed) / gap if arr is not None and gap and gap > 0 else None
        rows.append(row)
    return rows


def _m_per_length(source: str, base: str, budget: int, field: str):
    def get(_):
        return read_path(m_per_length_rows(source, base), ({"k": budget}, field))
    return get


def quality_contexts(source: str) -> List[int]:
    return sorted({int(k.split("/")[2]) for k in load(source)["cases"]})


def quality_budgets(source: str) -> List[int]:
    return [int(b) for b in str(load(source)["config"]["budgets"]).split(",")]


def complete_quality_cases(source: str) -> Dict[str, Any]:
    """The records of the items that have every (method, k) of the run (a run cut off by a time limit
    leaves its last item part-measured: means over items must not mix item sets)."""
    data = load(source)
    cases, config = data["cases"], data["config"]
    methods = [m.strip() for m in str(config["methods"]).split(",") if m.strip()]
    budgets = quality_budgets(source)
    items = {k[:-len("/dense")] for k in cases if k.endswith("/dense")}
    whole = {i for i in items if all(f"{i}/{m}/k{b}" in cases for m in methods for b in budgets)}
    return {k: c for k, c in cases.items() if k.rsplit("/", 2)[0] in whole or k[:-len("/dense")] in whole}


def _item_of(key: str) -> str:
    return key[:-len("/dense")] if key.endswith("/dense") else key.rsplit("/", 2)[0]


def quality_files(model: str) -> List[str]:
    """The QUALITY files of ``model`` that are committed (a declared run may not have run yet)."""
    return [s for s in QUALITY[model] if (RESULTS / s).is_file()]


def gpu_quality_contexts() -> List[int]:
    """The item contexts of the real pair's H200 quality files."""
    return sorted({c for s in quality_files(QUALITY_GPU_MODEL) if s.endswith("_h200.json") for c in quality_contexts(s)})


def quality_sources(model: str, context: int) -> List[str]:
    """The committed dustin-quality files of ``model`` holding ``context``-token items (a later run
    may add budgets to the same items in a file of its own)."""
    sources = [s for s in quality_files(model) if context in quality_contexts(s)]
    if not sources:
        raise KeyError(f"no dustin-quality file of {model} holds {context}-token items")
    return sources


def quality_source(model: str, context: int) -> str:
    return quality_sources(model, context)[0]


def quality_cases(model: str, context: int) -> Dict[str, Any]:
    merged: Dict[str, Any] = {}
    items = None
    for source in quality_sources(model, context):
        cases = {k: c for k, c in complete_quality_cases(source).items() if k.split("/")[2] == str(context)}
        here = {_item_of(k) for k in cases if k.endswith("/dense")}
        items = here if items is None else items & here  # the items every file has complete
        for key, case in cases.items():
            merged.setdefault(key, case)  # a repeated dense record: the first file's
    return {k: c for k, c in merged.items() if _item_of(k) in items}


def quality_items(model: str, context: int) -> Tuple[int, int]:
    """(items measured at ``context`` in every file of it, items the first run asked for there)."""
    done = {c["task"] for k, c in quality_cases(model, context).items() if k.endswith("/dense")}
    planned = dict(part.split(":") for part in str(load(quality_source(model, context))["config"]["items"]).split(","))
    return len(done), int(planned.get(str(context), len(done)))


# ---------------------------------------------------------------------------- pair-speed (from the JSON)
def pair_cases(source: str) -> List[Tuple[str, Dict[str, Any]]]:
    """The measured ``(key, case)`` of a pair-speed file (not its copy bandwidth or backend check)."""
    return [(k, c) for k, c in load(source)["cases"].items() if k.startswith("ctx")]


def _pair_ar_tok_s(key):
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


def _csv(text) -> List[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def pair_missing(source: str) -> Tuple[List[str], Dict[str, List[str]]]:
    """Against the file's own config: the cases not measured, and per measured case the methods missing."""
    data = load(source)
    cfg = data["config"]
    wanted = [f"ctx{c}/b{b}" for c in _csv(cfg["contexts"]) for b in _csv(cfg["batches"])]
    methods = _csv(cfg["methods"])
    missing = [k for k in wanted if k not in data["cases"]]
    partial = {k: [m for m in methods if m not in c] for k, c in pair_cases(source)
               if not c.get("complete", True) or any(m not in c for m in methods)}
    return missing, partial


def distinct_ngrams(tokens: Sequence[int], n: int = 8) -> Optional[float]:
    """Distinct n-grams / n-grams of a token list (1 = no n-gram repeats; low = a repeated loop)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None



SRH_GROUP_LABEL = {"any": "the best 4 anywhere", "1group": "from one KV group"}


def srh_group_contexts() -> List[int]:
    """The contexts whose quality runs exist with both profiles (and both profiles are committed)."""
    if not all((REPO / p).exists() for _, p in SRH_GROUP_PROFILES):
        return []
    return [ctx for ctx, runs in SRH_GROUP_QUALITY.items() if all((RESULTS / src).exists() for _, src in runs)]


def _srh_group_rows(ctx: int) -> Dict[str, Dict[Tuple[str, int], Dict[str, Any]]]:
    return {tag: {(r["method"], r["k"]): r for r in quality_rows(complete_quality_cases(src))}
            for tag, src in SRH_GROUP_QUALITY[ctx]}


def _srh_group_quality(source: str, method: str, budget: int, field: str):
    def get(_):
        return read_path(quality_rows(complete_quality_cases(source)), ({"method": method, "k": budget}, field))
    return get


def _scoring_ratio(data: Dict[str, Any], key: str) -> float:
    seconds = data["cases"][key]["seconds"]
    return seconds[SRH_GROUP_PROFILES[1][1]] / seconds[SRH_GROUP_PROFILES[0][1]]


def _groups(heads: Sequence[int], per_kv: int) -> str:
    count = len({h // per_kv for h in heads})
    return f"{list(heads)} ({count} group{'s' if count > 1 else ''})"


def srh_group_blocks() -> List[str]:
    """The two profiles' configs, their quality on the same items, and the per-round scoring of each."""
    if not srh_group_contexts():
        return ["Not measured yet (suite cpu-dustin-quality, steps `qwen2.5-coder-1.5b-profile-srh-1group`, "
                "`qwen2.5-coder-1.5b-2k-srh-any`, `qwen2.5-coder-1.5b-2k-srh-1group`, `scoring-srh-groups`)."]
    profiles = {tag: json.loads((REPO / path).read_text()) for tag, path in SRH_GROUP_PROFILES}
    t_qpk = profiles["any"]["target"]["num_heads"] // profiles["any"]["target"]["num_kv_heads"]
    d_qpk = profiles["any"]["draft"]["num_heads"] // profiles["any"]["draft"]["num_kv_heads"]
    budgets = sorted(set.intersection(*(set(map(int, p["configs"])) for p in profiles.values())))
    lines = ["| k | SRHs | target layer: heads | draft layers: heads | m | calibration ARR (Algorithm 1) |",
             "|---|---|---|---|---|---|"]
    for k in budgets:
        for tag, _ in SRH_GROUP_PROFILES:
            c = profiles[tag]["configs"][str(k)]
            draft = "; ".join(f"{layer}: {_groups(h, d_qpk)}" for layer, h in zip(c["draft_layers"], c["draft_heads"]))
            lines.append(f"| {k} | {SRH_GROUP_LABEL[tag]} | {c['target_layer']}: {_groups(c['target_heads'], t_qpk)} | "
                         f"{draft} | {c['m']} | {profiles[tag]['search'][str(k)]['arr']:.4f} |")
    out = ["The two profiles (`" + "`, `".join(p for _, p in SRH_GROUP_PROFILES) + "`; heads with their KV groups, "
           f"{t_qpk} query heads per KV head in the target, {d_qpk} in the draft):\n\n" + "\n".join(lines)]
    for ctx in srh_group_contexts():
        rows, runs = _srh_group_rows(ctx), SRH_GROUP_QUALITY[ctx]
        q_budgets = quality_budgets(runs[0][1])
        items = len({c["task"] for c in complete_quality_cases(runs[0][1]).values()})
        lines = ["| method | k | ARR any / one group | token match vs dense any / one group | "
                 "retrieval accuracy any / one group | tau any / one group |", "|---|---|---|---|---|---|"]
        for method in SRH_GROUP_METHODS:
            for k in q_budgets:
                a, g = rows["any"].get((method, k)), rows["1group"].get((method, k))
                if not a or not g:
                    continue
                lines.append(f"| {method} | {k} | {a['ARR']:.4f} / {g['ARR']:.4f} | {a['match']:.2f} / {g['match']:.2f} "
                             f"| {a['accuracy']:.2f} / {g['accuracy']:.2f} | {a['tau']:.2f} / {g['tau']:.2f} |")
        out.append(f"Quality on the same {items} seeded {ctx // 1024}k evaluation items (passkey, needle QA; float32, "
                   f"greedy, gamma 4, 16 new tokens, CPU; `{runs[0][1]}`, `{runs[1][1]}`, one commit):\n\n"
                   + "\n".join(lines))
    if (RESULTS / SRH_GROUP_SCORING).exists():
        data = load(SRH_GROUP_SCORING)
        lines = ["| positions | batch | k | KV groups read (target / draft layers), any | one group | "
                 "key MB any / one group | ms any | ms one group | one group / any |", "|---|---|---|---|---|---|---|---|---|"]
        for case in data["cases"].values():
            (pa, ia), (pg, ig) = [(p, case["profiles"][p]) for _, p in SRH_GROUP_PROFILES]
            fmt_g = lambda i: f"{i['target_kv_groups']} / {' + '.join(map(str, i['draft_kv_groups']))}"  # noqa: E731
            lines.append(f"| {case['context']} | {case['batch']} | {case['k']} | {fmt_g(ia)} | {fmt_g(ig)} | "
                         f"{ia['key_bytes'] / 1e6:.0f} / {ig['key_bytes'] / 1e6:.0f} | "
                         f"{1e3 * case['seconds'][pa]:.2f} | {1e3 * case['seconds'][pg]:.2f} | "
                         f"{case['seconds'][pg] / case['seconds'][pa]:.2f}x |")
        out.append(f"The signal scoring of one round (s_T of the target SRH layer and s_D of the draft SRH layers, "
                   f"gamma {data['config']['gamma']} draft rows, {data['config']['dtype']} keys, seeded; "
                   f"`{SRH_GROUP_SCORING}`, CPU, best of {data['config']['repeats']} interleaved timings of "
                   f"{data['config']['iters']} calls; each profile's own layers and heads at k = "
                   f"{data['config']['budgets']}):\n\n" + "\n".join(lines))
    out += _srh_group_gpu_blocks()
    return out


def _srh_group_gpu_blocks() -> List[str]:
    """dustin-speed with the target's SRHs in one KV group against the run with them in four (H200, H100), and the
    real pair end to end with the one-group profile."""
    out = []
    for when, source, base, _, _, dev in DUSTIN_SPEED_SRH_1GROUP:
        if not (RESULTS / source).exists() or not (RESULTS / base).exists():
            continue
        data, ref = load(source), load(base)
        lines = ["| method | target SRH heads | selection ms (mean per round) | selection / round | x AR |",
                 "|---|---|---|---|---|"]
        for method in ("dustin", "dustin-kv-streaming"):
            for d in (ref, data):
                heads = str(d["config"].get("target_heads") or "")
                label = heads.replace(",", ", ") if heads else "one per KV group (the default)"
                row = read_path(d, ("cases", "ctx32768/b16", "rows", {"method": method}))
                lines.append(f"| {method} | {label} | {_selection_ms(d, method):.3f} | "
                             f"{100 * _selection_share(d, method):.1f} % | {row['speedup']:.2f}x |")
        commits = {_code_commit(d) for d in (data, ref)}
        taus = sorted({f["path"].removeprefix("experiments/results/") for d in (data, ref)
                       for f in d.get("acceptance", {}).get("files", [])})
        shared = [f"`{f}` ran while {DUSTIN_SPEED_SHARED_GPU[f]}" for f in (source, base) if f in DUSTIN_SPEED_SHARED_GPU]
        out.append(f"On the {DEVICE_NAME[dev]}, the 7B / 0.5B shapes at 32k, batch 16, k = 512, selecting {when} (`{source}` against "
                   f"`{base}`, " + ("one commit" if len(commits) == 1 else f"commits {' and '.join(sorted(commits))}")
                   + (f"; each method at the tau the real pair measured for it in `{'`, `'.join(taus)}`" if taus else "")
                   + "):\n\n" + "\n".join(lines)
                   + (f"\n\nShared GPU: {'; '.join(shared)}, so its timings are provisional." if shared else ""))
    source, base = PAIR_SPEED_SRH_1GROUP
    if (RESULTS / source).exists() and (RESULTS / base).exists():
        data, ref = load(source), load(base)
        lines = ["| method | SRHs | x paired AR | tau | acceptance |", "|---|---|---|---|---|"]
        for method in ("dustin", "dustin-kv-streaming"):
            for label, d in (("the best 4 anywhere", ref), ("from one KV group", data)):
                case = d["cases"]["ctx32000/b16"].get(method) or {}
                if "speedup_vs_ar" in case:
                    lines.append(f"| {method} | {label} | {case['speedup_vs_ar']:.2f}x | {case['metrics']['tau']:.2f} | "
                                 f"{case['metrics']['acceptance_rate']:.3f} |")
        commits = {d["environment"].get("commit", "?")[:7] for d in (data, ref)}
        out.append(f"The real Qwen2.5-Coder pair on the H200 (pair-speed, 32000 tokens, batch 16, bf16, Pallas; "
                   f"`{source}` against `{base}`, "
                   + ("one commit" if len(commits) == 1 else f"commits {' and '.join(sorted(commits))}")
                   + "):\n\n" + "\n".join(lines))
    return out


def _code_commit(data: Dict[str, Any]) -> str:
    """The commit a run's code was at: a copied tree records it as ``tree_commit`` beside its older git metadata."""
    env = data["environment"]
    return (env.get("tree_commit") or env.get("commit") or "?")[:7]


def srh_group_verdicts() -> List[str]:
    out, diffs, accuracy_same, points, per_ctx = [], [], 0, 0, []
    for ctx in srh_group_contexts():
        rows, here = _srh_group_rows(ctx), []
        for (method, k), a in rows["any"].items():
            g = rows["1group"].get((method, k))
            if method == "dustin-h" and g:
                here.append(g["ARR"] - a["ARR"])
                points += 1
                accuracy_same += g["accuracy"] == a["accuracy"]
        diffs += here
        if here:
            per_ctx.append(f"{ctx // 1024}k {sum(here) / len(here):+.4f}")
        out += _srh_group_verdicts(ctx)
    if diffs:
        out.insert(0, f"Dustin-H with one-group SRHs against the best heads anywhere, {points} (context, k) points at "
                      + ", ".join(f"{c // 1024}k" for c in srh_group_contexts())
                      + f": ARR {min(diffs):+.4f} to {max(diffs):+.4f} (mean {sum(diffs) / len(diffs):+.4f}), "
                      f"higher at {sum(d > 0 for d in diffs)} of them; mean per context " + ", ".join(per_ctx)
                      + f"; retrieval accuracy the same at {accuracy_same} of {points}. Both profiles were "
                      "calibrated on 2k tasks.")
    return out + _srh_scoring_verdicts()


def _srh_group_verdicts(ctx: int) -> List[str]:
    rows, out = _srh_group_rows(ctx), []
    for method in SRH_GROUP_METHODS:
        pairs = [(k, rows["any"][(method, k)]["ARR"], rows["1group"][(method, k)]["ARR"])
                 for (m, k) in rows["any"] if m == method and (m, k) in rows["1group"]]
        if pairs:
            diffs = [g - a for _, a, g in pairs]
            out.append(f"{ctx // 1024}k, {method}: one-group SRHs change ARR by {min(diffs):+.4f} to {max(diffs):+.4f} across k "
                       f"(mean {sum(diffs) / len(diffs):+.4f}); token match " + ", ".join(
                           f"k = {k}: {rows['any'][(method, k)]['match']:.2f} → {rows['1group'][(method, k)]['match']:.2f}"
                           for k, _, _ in pairs) + ".")
    return out


def _srh_scoring_verdicts() -> List[str]:
    if not (RESULTS / SRH_GROUP_SCORING).exists():
        return []
    data = load(SRH_GROUP_SCORING)
    parts = []
    for key, case in data["cases"].items():
        (pa, ia), (pg, ig) = [(p, case["profiles"][p]) for _, p in SRH_GROUP_PROFILES]
        parts.append(f"{case['context'] // 1024}k/b{case['batch']}: {_scoring_ratio(data, key):.2f}x the time for "
                     f"{ig['key_bytes'] / ia['key_bytes']:.2f}x the key bytes")
    h200 = []
    for when, source, base, _, _, dev in DUSTIN_SPEED_SRH_1GROUP:
        if (RESULTS / source).exists() and (RESULTS / base).exists():
            shares = {m: (_selection_share(load(base), m), _selection_share(load(source), m))
                      for m in ("dustin", "dustin-kv-streaming")}
            h200.append(f"Selection at most 3 % of a round at 32k/b16 on the {DEVICE_NAME[dev]}, target SRHs in one KV group, "
                        f"selecting {when}: " + "; ".join(
                            f"{m} {100 * b:.1f} % → {100 * g:.1f} % ({'**met**' if g <= 0.03 else '**missed**'})"
                            for m, (b, g) in shares.items()) + ".")
    h200 += _srh_group_spread_verdicts()
    return h200 + [f"Signal scoring per round with one-group SRHs against the best-anywhere heads on the CPU (bench-scoring, "
            f"float32): " + "; ".join(parts) + ". The selection target (<= 3 % of "
            "a round at 32k/b16) is held on the GPU: on the H200 the 7B shape's scoring of 4 target heads measured "
            "297 µs in 4 KV groups against 207 µs in one (bench-attention above, 32k, batch 16, with the top-k)"
            + ("." if h200 else ", and the round with one-group target heads (h200-dustin-speed steps "
               "`b16-srh-1group-pair-tau-32k`, `b16-reselect-2-srh-1group-pair-tau-32k`) is not measured yet.")]


def _selection_ms(data: Dict[str, Any], method: str) -> float:
    """A dustin-speed 32k/b16 run's mean selection time per round (ms): a selection every round, or averaged
    with the reuse rounds in between (--reselect-every)."""
    row = read_path(data, ("cases", "ctx32768/b16", "rows", {"method": method}))
    return row.get("selection_ms_per_round", row["selection_ms"])


def _srh_group_spread_verdicts() -> List[str]:
    """Where a device ran the every-round pair twice: the one-group change in selection time against the spread of
    the same configuration between the two runs."""
    out = []
    for dev in DEVICE_NAME:
        pairs = [(load(src), load(base)) for when, src, base, _, _, d in DUSTIN_SPEED_SRH_1GROUP
                 if d == dev and when.startswith("every round") and (RESULTS / src).exists()
                 and (RESULTS / base).exists()]
        if len(pairs) < 2:
            continue
        parts, within = [], True
        for method in ("dustin", "dustin-kv-streaming"):
            one = [_selection_ms(a, method) for a, _ in pairs]
            anyg = [_selection_ms(b, method) for _, b in pairs]
            change = sum(one) / sum(anyg) - 1
            within &= min(one) <= max(anyg) and min(anyg) <= max(one)  # the two configurations' runs overlap
            parts.append(f"{method} {sum(anyg) / len(anyg):.3f} → {sum(one) / len(one):.3f} ms "
                         f"({100 * change:+.0f} %; the same configuration's runs "
                         f"{min(anyg):.3f}-{max(anyg):.3f} and {min(one):.3f}-{max(one):.3f} ms)")
        out.append(f"One-group target SRHs on the {DEVICE_NAME[dev]}, the every-round pair run {len(pairs)} times on "
                   f"one machine, mean selection time per round: " + "; ".join(parts) + "." + (
                       " The two configurations' runs overlap, so the change is within the run-to-run spread: the "
                       "target signal's key "
                       "reads that one group saves (what bench-attention measured for the 7B shape's target scoring "
                       "on the H200, below) are too small a part of the selection to show in one run, and the 3 % "
                       "target needs a cheaper top-k and draft scoring as well, or selecting less often."
                       if within else " The two configurations' runs do not overlap."))
    return out


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
    if (RESULTS / KERNEL_DEVICE).exists():
        for shape, (short, target) in DEVICE_TARGETS.items():
            add(Figure(f"kernels/{short}/ctx32768/b16/k512/attention_speedup_device",
                       f"sparse (k = 512) vs the fastest dense attention of all layers by device kernel time, {shape}, "
                       "32k, batch 16", "x", KERNEL_DEVICE, ("cases", f"{shape}/ctx32768/b16/k512", "speedup_device"),
                       target=f"target >= {target:.0f}x" + (" (paper 27.85x)" if short == "72b" else "")))
            case_key = f"{shape}/ctx32768/b16/k512"
            if case_key not in load(KERNEL_DEVICE)["cases"] or _own_kernel_ratio(
                    load(KERNEL_DEVICE)["cases"][case_key]) is None:
                continue
            if (RESULTS / KERNEL_DEVICE_UNROLLED).exists() and case_key in load(KERNEL_DEVICE_UNROLLED)["cases"]:
                add(Figure(f"kernels/{short}/ctx32768/b16/k512/attention_speedup_device_unrolled",
                           f"sparse (k = 512) vs the fastest dense attention of all layers by device kernel time, one "
                           f"call per layer on inputs of its own, {shape}, 32k, batch 16", "x", KERNEL_DEVICE_UNROLLED,
                           ("cases", case_key, "speedup_device"), target=f"target >= {target:.0f}x"))
            if (RESULTS / KERNEL_DEVICE_UNROLLED_H100).exists() and case_key in load(KERNEL_DEVICE_UNROLLED_H100)["cases"]:
                add(Figure(f"kernels/{short}/ctx32768/b16/k512/attention_speedup_device_unrolled_h100",
                           f"sparse (k = 512) vs the fastest dense attention of all layers by device kernel time, one "
                           f"call per layer on inputs of its own, {shape}, 32k, batch 16, on an H100", "x",
                           KERNEL_DEVICE_UNROLLED_H100, ("cases", case_key, "speedup_device"),
                           target=f"target >= {target:.0f}x on the H200"))
            add(Figure(f"kernels/{short}/ctx32768/b16/k512/attention_kernel_only_speedup_device",
                       f"jaxspec's sparse attention kernel (k = 512) vs its dense kernel alone, all layers by device "
                       f"kernel time, {shape}, 32k, batch 16 (the call's other kernels left out)", "x", KERNEL_DEVICE,
                       lambda d, key=case_key: _own_kernel_ratio(d["cases"][key])))
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
    for tag, (source, _) in BENCH_PLAIN.items():
        if not (RESULTS / source).exists():
            continue
        for case in load(source)["cases"]:
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
                       source, _dustin(ctx, batch, "dustin", "speedup"),
                       target="paper 2.33x" if (ctx, batch) == (32768, 16) else ""))
    for ctx in (32768, 16384, 8192):
        for method, label in (("ar", "AR"), ("classic", "ClassicSD"), ("magicdec", "MagicDec"), ("dustin", "Dustin-H")):
            what = f"7B/0.5B shapes, {ctx // 1024}k, batch 16, k = 512, its own tau from the real pair: {label}"
            if method == "ar":
                add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b16/ar/tok_s", what, "tokens/s", DUSTIN_SPEED_PAIR_TAU,
                           _dustin(ctx, 16, "ar", "tok_s")))
                continue
            add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b16/{method}/speedup", what, "x AR", DUSTIN_SPEED_PAIR_TAU,
                       _dustin(ctx, 16, method, "speedup"),
                       target="paper 2.33x" if (method, ctx) == ("dustin", 32768) else ""))
            add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b16/{method}/fixed-tau", f"{what}, the tau it ran with",
                       "tokens/round", DUSTIN_SPEED_PAIR_TAU, _dustin(ctx, 16, method, "fixed_tau")))
    for source, method in ((DUSTIN_SPEED_PAIR_TAU, "dustin"), (DUSTIN_SPEED_SPARSE, "dustin-kv-streaming")):
        add(Figure(f"dustin-speed/7b-shape/ctx32768/b16/{method}/selection-share-of-round",
                   f"selection / round time (batch x realised tau / tokens per second), {method}, the real pair's "
                   "tau", "%", source, functools.partial(_selection_share, method=method), scale=100,
                   target="target <= 3 %"))
    for key, sparse_case in load(DUSTIN_SPEED_SPARSE)["cases"].items():
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
                       _dustin(ctx, 16, method, "speedup"), target=target))
            add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b16/{method}/fixed-tau", f"{what}, the tau it ran with",
                       "tokens/round", DUSTIN_SPEED_SPARSE, _dustin(ctx, 16, method, "fixed_tau")))
    def speculative_rows(source):
        """(context, row) of each speculative method in a dustin-speed file (AR is the baseline)."""
        if not (RESULTS / source).exists():
            return
        for key, case in load(source)["cases"].items():
            if key == "copy_bandwidth" or "rows" not in case:
                continue
            yield from ((int(key.split("/")[0][3:]), r) for r in case["rows"] if r["method"] != "ar")

    for ctx, r in speculative_rows(DUSTIN_SPEED_FINISHED):  # the current default: finished rows read one slot
        what = (f"7B/0.5B shapes, {ctx // 1024}k, batch 16, k = 512, the real pair's tau: {r['method']} with "
                "finished rows reading one cache slot (AR in the same process)")
        add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b16/{r['method']}/finished-rows-skipped/speedup", what,
                   "x AR", DUSTIN_SPEED_FINISHED, _dustin(ctx, 16, r["method"], "speedup")))
    for ctx, r in speculative_rows(DUSTIN_SPEED_FINISHED_KEPT):  # the same, finished rows reading their history
        what = (f"7B/0.5B shapes, {ctx // 1024}k, batch 16, k = 512, the real pair's tau: {r['method']} with "
                "finished rows reading their whole history, --keep-finished-rows (AR in the same process)")
        add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b16/{r['method']}/finished-rows-kept/speedup", what,
                   "x AR", DUSTIN_SPEED_FINISHED_KEPT, _dustin(ctx, 16, r["method"], "speedup")))
    b8_labels = dict((("classic", "ClassicSD"), ("magicdec", "MagicDec")) + DUSTIN_SPEED_SPARSE_METHODS)
    for ctx, r in speculative_rows(DUSTIN_SPEED_SPARSE_B8):
        what = (f"7B/0.5B shapes, {ctx // 1024}k, batch 8, k = 512, the real pair's tau for this method "
                f"(batch 8): {b8_labels.get(r['method'], r['method'])} (AR in the same process)")
        add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b8/{r['method']}/speedup", what, "x AR",
                   DUSTIN_SPEED_SPARSE_B8, _dustin(ctx, 8, r["method"], "speedup")))
        add(Figure(f"dustin-speed/7b-shape/ctx{ctx}/b8/{r['method']}/fixed-tau", f"{what}, the tau it ran with",
                   "tokens/round", DUSTIN_SPEED_SPARSE_B8, _dustin(ctx, 8, r["method"], "fixed_tau")))
    src = DUSTIN_SPEED[16]
    for method in ("classic", "magicdec"):
        add(Figure(f"dustin/speed/qwen2.5-7b-shape/ctx32768/b16/{method}/speedup-vs-ar",
                   f"{'ClassicSD' if method == 'classic' else 'MagicDec'}, same point", "x AR", src,
                   _dustin(32768, 16, method, "speedup")))
    add(Figure("dustin/speed/qwen2.5-7b-shape/ctx32768/b16/roofline-speedup", "Dustin's bytes roofline at this tau",
               "x AR", src, _dustin(32768, 16, "dustin", "roofline_speedup")))
    add(Figure("dustin/speed/qwen2.5-7b-shape/ctx32768/b16/tau", "tau realised by the fixed acceptance",
               "tokens/round", src, _dustin(32768, 16, "dustin", "tau")))
    add(Figure("dustin/speed/qwen2.5-7b-shape/ctx32768/b16/attention-speedup",
               "verification attention (28 layers), dense / sparse", "x", src,
               _dustin(32768, 16, "dustin", "attn_speedup")))
    add(Figure("dustin/speed/qwen2.5-7b-shape/ctx32768/b16/selection-ms-per-round", "selection, one round", "ms",
               src, _dustin(32768, 16, "dustin", "selection_ms")))
    add(Figure("dustin/speed/qwen2.5-7b-shape/ctx32768/b16/selection-share-of-dense-attention",
               "selection as a share of one verification's dense attention", "%", src,
               lambda d: read_path(d, _dustin(32768, 16, "dustin", "selection_ms"))
               / read_path(d, _dustin(32768, 16, "dustin", "attn_dense_ms")), scale=100, target="target <= 1 %"))
    add(Figure("dustin/trace/qwen2.5-7b-shape/ctx32768/b16/draft-dense-attention-share-of-busy",
               "traced Dustin run: the draft's dense attention, share of device busy time", "%", DUSTIN_TRACE,
               _top_kernel_share("jaxspec_dense_history_attention"), scale=100))
    add(Figure("dustin/trace/qwen2.5-7b-shape/ctx32768/b16/target-sparse-attention-share-of-busy",
               "traced Dustin run: the target's sparse attention, share of device busy time", "%", DUSTIN_TRACE,
               _top_kernel_share("jaxspec_sparse_history_attention"), scale=100))
    if (RESULTS / DUSTIN_TRACE_SPARSE).exists():
        def traced(method, what):
            def get(d):
                case = d["cases"]["ctx32768/b16"]
                plane = next(iter(case[method]["trace"]["planes"].values()))
                row = next(r for r in case["rows"] if r["method"] == method)
                rounds = int(d["config"]["new_tokens"]) / row["tau"]
                floor_s = int(d["config"]["new_tokens"]) * row["batch"] / row["roofline_tok_s"]
                return {"launches": plane["launches"] / rounds, "busy": plane["busy_s"] / plane["span_s"],
                        "floor": plane["busy_s"] / floor_s}[what]
            return get
        for method in ("dustin", "dustin-kv-streaming"):
            base = f"dustin/trace/qwen2.5-7b-shape/ctx32768/b16/{method}"
            add(Figure(f"{base}/launches-per-round", f"traced {method} run at the real pair's tau: kernel launches "
                       "per round (64 / tau rounds)", "launches", DUSTIN_TRACE_SPARSE, traced(method, "launches")))
            add(Figure(f"{base}/device-busy-share", f"traced {method} run: device busy / span", "%",
                       DUSTIN_TRACE_SPARSE, traced(method, "busy"), scale=100))
            add(Figure(f"{base}/busy-over-bytes-floor", f"traced {method} run: device busy time / the run's bytes at "
                       "the measured copy bandwidth", "x", DUSTIN_TRACE_SPARSE, traced(method, "floor")))
    add(Figure("dustin/speed/qwen2.5-7b-shape/ctx32768/b16/smollm2-tau/speedup-vs-ar",
               "Dustin at the same point with SmolLM2's tau", "x AR", DUSTIN_SMOLLM2_TAU,
               _dustin(32768, 16, "dustin", "speedup")))
    for (method, backend), source in E2E.items():
        slug = method.split()[0].lower()
        add(Figure(f"dustin/end-to-end/smollm2-135m/ctx7.6k/b16/{slug}-{backend.lower()}/speedup-vs-ar",
                   f"real SmolLM2-135M, 7.6k prompt, batch 16: {method}, {backend} attention", "x AR", source,
                   ("results", "speedup_vs_ar")))
    measured = set()  # (key, method) already in the index: a second run's repeats go under its own name
    selfspec_seen = set()
    for source in PAIR_SPEED + PAIR_SPEED_H100:
        dtype, gamma = load(source)["config"]["dtype"], int(load(source)["config"].get("gamma", 4))
        dev = "h100" if source.endswith("_h100.json") else "h200"
        for key, case in pair_cases(source):
            what = (f"real Qwen2.5-Coder pair (pair-speed){' on an H100' if dev == 'h100' else ''}, "
                    f"{case['context'] // 1000}k, batch {case['batch']}, {dtype}, Pallas"
                    + (", shared GPU (provisional)" if pathlib.Path(source).name in PAIR_SPEED_SHARED_GPU else ""))

            def base_of(method):
                base = f"real-pair/{dev}/{key}"
                return f"{base}/{pair_run_tag(source)}-run" if (dev, key, method) in measured else base

            add(Figure(f"{base_of('ar')}/ar/tok_s", f"{what}: AR, mean of its paired runs", "tokens/s", source,
                       _pair_ar_tok_s(key)))
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
        if not (RESULTS / source).exists():
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
        if not (RESULTS / source).exists():
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
    check = load(PAIR_SPEED_CHECK)["cases"]["backend_check"]
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
        if "plan_fraction" in load(source)["results"]["timings"]:
            add(Figure(f"{key}/planning-share", f"planning time / decode time: {label}", "fraction", source,
                       ("results", "timings", "plan_fraction")))
    for g in (1, 2, 3, 4):
        source = f"demo/demo_smollm2-135m_prompt-lookup_767_b1_gamma{g}_cpu.json"
        if (RESULTS / source).exists():
            add(Figure(f"demo/smollm2-135m/ctx767/b1/cpu/prompt-lookup/gamma{g}/speedup-vs-ar",
                       f"the demo at gamma {g}: prompt lookup vs AR, SmolLM2-135M f32, 2-core CPU", "x AR", source,
                       ("results", "speedup_vs_ar")))
        source = f"demo/demo_smollm2-135m_prompt-lookup_767_b1_gamma{g}_full-verify_cpu.json"
        if (RESULTS / source).exists():
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
    if (RESULTS / MAGICDEC_CPU).exists():
        what = "MagicDec k = 512 (the 0.5B over 4 sinks + 508, dense verification)"
        for field, unit, path in (("tau", "tokens/round", ("results", "metrics", "tau")),
                                  ("acceptance-rate", "fraction", ("results", "metrics", "acceptance_rate")),
                                  ("speedup", "x AR", ("results", "speedup_vs_ar"))):
            add(Figure(f"{base}/magicdec/{field}", f"real Qwen2.5-Coder pair, 2k prompt, batch 1, CPU float32: "
                       f"{what}, {field} (AR in the same process)", unit, MAGICDEC_CPU, path))
    if (RESULTS / ARBITRATE_CPU).exists():
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
        for row in m_rule_rows(load(source)["cases"]):
            ctx = {c["context"] for c in load(source)["cases"].values() if "context" in c}.pop()
            base = f"dustin/input-aware-m/{model}/ctx{ctx}/k{row['k']}"
            steps = load(source).get("config", {}).get("m_steps", 1) or 1
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
        ctx = {c["context"] for c in load(source)["cases"].values() if "context" in c}.pop()
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
        data = load(source)
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
        if not (RESULTS / source).exists():
            continue
        for key, case in load(source)["cases"].items():
            for rule in selection_rules_of(source, case["ratio_to_fixed"]):
                add(Figure(f"dustin/input-aware-m/selection-cost/{device}/{key}/{SELECTION_RULE_TAGS[rule]}/vs-fixed",
                           f"selection per round, the {rule} rule / the fixed rule, same signals, {case['context']} "
                           f"positions, batch {case['batch']}, k = {case['k']} (bench-selection)", "x", source,
                           ("cases", key, "ratio_to_fixed", rule), target="target <= 1.1"))
    # GQA-aware SRHs
    for ctx in srh_group_contexts():
        for tag, source in SRH_GROUP_QUALITY[ctx]:
            for budget in quality_budgets(source):
                for field, name, label in (("ARR", "arr", "ARR"), ("match", "agreement", "token match with dense")):
                    add(Figure(f"dustin/srh-groups/qwen2.5-coder-1.5b/ctx{ctx}/k{budget}/dustin-h/{tag}/{name}",
                               f"{label}, Dustin-H, SRHs {SRH_GROUP_LABEL[tag]}, {ctx // 1024}k, k = {budget}",
                               "fraction", source, _srh_group_quality(source, "dustin-h", budget, field)))
    if (RESULTS / SRH_GROUP_SCORING).exists():
        for key, case in load(SRH_GROUP_SCORING)["cases"].items():
            add(Figure(f"dustin/srh-groups/qwen2.5-coder-1.5b-profile/scoring/cpu/{key}/1group-vs-any",
                       f"signal scoring per round (s_T + s_D), one-KV-group SRHs / the best heads anywhere, "
                       f"{case['context']} positions, batch {case['batch']}, k = {case['k']} (bench-scoring)", "x",
                       SRH_GROUP_SCORING, lambda d, key=key: _scoring_ratio(d, key)))
    for tag, src in (("reselect2", DUSTIN_SPEED_RESELECT), ("reselect3", DUSTIN_SPEED_RESELECT3)):
        if not (RESULTS / src).exists():
            continue
        for method in ("dustin", "dustin-kv-streaming"):
            what = (f"7B/0.5B shapes, 32k, batch 16, k = 512, selecting every {tag[-1]}{'nd' if tag[-1] == '2' else 'rd'} "
                    f"round, the tau the real pair measured with it: {method}")
            key = f"dustin-speed/7b-shape/ctx32768/b16/{method}/{tag}"
            add(Figure(f"{key}/speedup", what, "x AR", src, _dustin(32768, 16, method, "speedup")))
            add(Figure(f"{key}/selection-share-of-round", f"{what}: selection / round time", "%", src,
                       functools.partial(_selection_share, method=method), scale=100, target="target <= 3 %"))
    for when, source, base, tag, base_tag, dev in DUSTIN_SPEED_SRH_1GROUP:
        for src, tg, heads in ((source, tag, "target SRHs in one KV group"),
                               (base, base_tag, "target SRHs one per KV group")):
            if tg is None or not (RESULTS / src).exists():
                continue
            for method in ("dustin", "dustin-kv-streaming"):
                what = (f"7B/0.5B shapes, 32k, batch 16, k = 512, {heads}, selecting {when}: {method}"
                        + ("" if dev == "h200" else f", {DEVICE_NAME[dev]}"))
                key = f"dustin-speed/7b-shape/ctx32768/b16/{method}/{tg}" + ("" if dev == "h200" else f"/{dev}")
                add(Figure(f"{key}/speedup", what, "x AR", src, _dustin(32768, 16, method, "speedup")))
                add(Figure(f"{key}/selection-share-of-round", f"{what}: selection / round time", "%", src,
                           functools.partial(_selection_share, method=method), scale=100, target="target <= 3 %"))
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
        cases = load(other or source)["cases"]
        for method in ("clasp", "knapspec-official"):
            if f"{tag}/summarize/ctx{ctx}/b{batch}/{method}" in cases:
                add(Figure(f"{base}/{method}/speedup-vs-ar", f"{method} vs paired AR: {label}", "x AR",
                           other or source, _knapspec_case(tag, ctx, batch, method)))
    for batch, source, variant in [*((b, src, "") for b, src in KNAPSPEC_REAL.items()),
                                   *((b, src, v) for b, src, _, v in KNAPSPEC_REAL_BASELINES)]:
        if not (RESULTS / source).exists():
            continue
        for key, case in load(source)["cases"].items():
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
        if not (RESULTS / source).exists():
            continue
        for key, case in load(source)["cases"].items():
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
        if not (RESULTS / source).exists():
            continue
        new_tokens = load(source)["config"].get("max_new_tokens", 256)
        for key, case in load(source)["cases"].items():
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
            check = case.get("draft_step_check") or {}
            for mode in ("static", "dynamic"):
                if check.get(f"{mode}_over_predicted"):
                    add(Figure(f"{base}/{mode}-draft-step-over-predicted",
                               f"{what}: one draft step of its plan ({mode} mask, {check['timed']}) / the latency "
                               "model's prediction", "x", source,
                               ("cases", key, "draft_step_check", f"{mode}_over_predicted"), target="target 0.9-1.1"))
    for source, model, device in PLAN_STAGES:  # one plan's stages timed alone (bench-plan)
        data = load(source)
        tag = source.rsplit("_", 1)[1].split(".")[0]  # the file name ends in its device: cpu, h100, h200
        for key, case in data["cases"].items():
            masks = "-real-masks" if data["config"].get("masks_from") else ""  # the finalists a results file's plans
            search = (data["config"]["search_tokens"], data["config"]["finalists"])
            base = (f"knapspec/plan-stages/{data['config']['model'].replace('random:', '')}{masks}/{tag}/"
                    f"ctx{case['context']}/r{data['config']['rows']}"
                    + ("" if search == (3, 2) else "/s{}f{}".format(*search)))  # 3 search tokens, 2 finalists: bare
            for name, what in plan_stage_names(case):
                add(Figure(f"{base}/{name.replace('_', '-')}-ms", f"one two-stage plan's stage timed alone, {what}, "
                           f"{model}, {case['context']} cached tokens, {case['window']}-token window (best of "
                           f"{data['config']['repeats']})", "ms", source, ("cases", key, "seconds_min", name),
                           scale=1e3))
            add(Figure(f"{base}/rescore-select-over-executed", f"the finalists rescored without conditionals / behind "
                       f"them, {model}, {case['context']} cached tokens", "x", source,
                       ("cases", key, "select_over_executed")))
    for source, tag, what, _, slug in KNAPSPEC_PLAN_TRACES:  # the traced plan: its wall time and the GPU's work in it
        if not (RESULTS / source).exists():
            continue
        key = next(k for k in load(source)["cases"] if k.endswith("/knapspec"))  # the one traced KnapSpec case
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
             "by the prefill")):
        if not (RESULTS / source).exists():
            continue
        (key, _), = [(k, v) for k, v in load(source)["cases"].items() if "speedup_vs_ar" in v]
        model = ("qwen2.5-coder-1.5b" if source in (KNAPSPEC_AT_START_QWEN_CPU, KNAPSPEC_ONE_FINALIST_QWEN_CPU)
                 else "smollm2-135m")
        base = f"knapspec/plans/{model}/ctx1024/b1/cpu/{slug}"
        what = (f"KnapSpec, {variant}, {'Qwen2.5-Coder-1.5B' if model.startswith('qwen') else 'SmolLM2-135M'} f32 "
                "CPU, 1k, batch 1, 256 new")
        add(Figure(f"{base}/planning-share", f"{what}: planning / decode time", "%", source,
                   ("cases", key, "plan_fraction_of_decode"), scale=100, target="target <= 5 %"))
        add(Figure(f"{base}/speedup", f"{what}, vs paired AR", "x AR", source, ("cases", key, "speedup_vs_ar")))
        if source in (KNAPSPEC_PREFILL_STATES_CPU, KNAPSPEC_OWN_STATES_CPU, KNAPSPEC_ONE_FINALIST_CPU,
                      KNAPSPEC_ONE_FINALIST_QWEN_CPU, *KNAPSPEC_AFTER_PLAIN_STATES_CPU.values()) and \
                load(source)["cases"][key].get("plans"):
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
    if (RESULTS / KNAPSPEC_ALPHA).exists():
        for mode, label in DP_REFERENCES:
            add(Figure(f"{base}/alpha-error-{mode}", f"largest |DP alpha - measured acceptance| over the fixed plans "
                       f"of the alpha run, reference = {label}, SmolLM2 CPU 1k", "abs", KNAPSPEC_ALPHA,
                       functools.partial(_alpha_error, field=f"alpha_{mode}"), target="target <= 0.05"))
            add(Figure(f"{base}/chosen-plan/alpha-{mode}", f"the planner's chosen plan: DP alpha, reference = {label}",
                       "fraction", KNAPSPEC_ALPHA, lambda d, m=mode: _chosen_fixed(d)[f"alpha_{m}"]))
        add(Figure(f"{base}/chosen-plan/measured-acceptance", "the planner's chosen plan: measured acceptance as a "
                   "fixed plan over 256 new tokens", "fraction", KNAPSPEC_ALPHA,
                   lambda d: _chosen_fixed(d)["acceptance_rate"]))
    add(Figure(f"{base}/knapspec-budget/speedup-vs-ar", "KnapSpec with budgeted attention (K = 256, one plan) vs "
               "paired AR, SmolLM2 CPU 1k", "x AR", KNAPSPEC_64REF, _knapspec_case("cpu", 1024, 1, "knapspec-budget")))
    if (RESULTS / KNAPSPEC_TPT_CORRELATION).exists():
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
            if (RESULTS / KNAPSPEC_TPT_CORRELATION_REPEATS).exists():
                for field, slug, label, target in PAIRED_CORRELATION_FIELDS:
                    add(Figure(f"{base.replace('/exit-aware', '/exit-aware-repeats')}/{slug}",
                               f"Pearson r, {label}, {what}", "r", KNAPSPEC_TPT_CORRELATION_REPEATS,
                               ("cases", key, field), target=target))
            if (RESULTS / KNAPSPEC_TPT_CORRELATION_TARGET).exists():
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
            if any("draft_step_check" in c for c in _fixed_cases(load(KNAPSPEC_TPT_CORRELATION), fixed)):
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
        if not (RESULTS / source).exists():
            continue
        key = "h100/summarize/ctx32000/b1/correlation"
        fields = [f for f in PAIRED_CORRELATION_FIELDS if load(source)["cases"][key].get(f[0]) is not None]
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


# ---------------------------------------------------------------------------- Dustin quality (from the JSON)
QUALITY_METHODS = ("dustin-h", "dustin-t", "dustin-d", "streaming", "quest", "snapkv", "magicdec")


def _mean(values):
    values = [x for x in values if x is not None]
    return sum(values) / len(values) if values else None


def quality_rows(cases: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Mean per (method, k) over items, dense ClassicSD first (the dustin-quality experiment's own summary)."""
    # an item whose dense output ends at its first token has no rounds: it counts for perplexity and accuracy only
    ended = {r["task"] for r in cases.values() if "method" not in r and len(r.get("tokens", [])) <= 1}
    token_fields = ("arr", "match_rate", "first_divergence", "tau")
    groups: Dict[Tuple[str, Any], List[dict]] = {}
    for record in cases.values():
        if record.get("task") in ended:
            record = {k: x for k, x in record.items() if k not in token_fields}
        groups.setdefault((record.get("method", DENSE), record.get("budget")), []).append(record)
    order = {name: i for i, name in enumerate((DENSE,) + QUALITY_METHODS)}
    rows = []
    for (name, budget), records in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1] or 0)):
        firsts = [r["first_divergence"] for r in records if "match_rate" in r]
        rows.append({"method": name, "k": budget if budget is not None else "-", "items": len(records),
                     "ARR": _mean(r.get("arr") for r in records) if name != DENSE else 1.0,
                     "match": _mean(r.get("match_rate") for r in records) if firsts else 1.0,
                     "identical": (sum(x is None for x in firsts) / len(firsts)) if firsts else 1.0,
                     "accuracy": _mean(r.get("accuracy") for r in records),
                     "tau": _mean(r.get("tau") for r in records), "ppl": _mean(r.get("ppl") for r in records)})
    return rows


def quality_markdown(cases: Dict[str, Any], budgets: Sequence[int] = (128, 256, 512, 1024)) -> str:
    """One row per method; k = 128 / 256 / 512 / 1024 inside each cell."""
    by = {(r["method"], r["k"]): r for r in quality_rows(cases)}

    def two(x):
        return "-" if x is None else f"{x:.2f}"

    def cell(name, field, spec):
        values = [by.get((name, b), {}).get(field) for b in budgets]
        return " / ".join("-" if x is None else spec.format(x) for x in values)

    lines = ["| method | ARR | token match vs dense | identical outputs | retrieval accuracy | perplexity | tau |",
             "|---|---|---|---|---|---|---|"]
    dense = by.get((DENSE, "-"))
    if dense:
        lines.append(f"| {DENSE} | 1 | 1 | 1 | {two(dense['accuracy'])} | {two(dense['ppl'])} | {two(dense['tau'])} |")
    for name in QUALITY_METHODS:
        if any((name, b) in by for b in budgets):
            lines.append(f"| {name} | {cell(name, 'ARR', '{:.3f}')} | {cell(name, 'match', '{:.2f}')} | "
                         f"{cell(name, 'identical', '{:.2f}')} | {cell(name, 'accuracy', '{:.2f}')} | "
                         f"{cell(name, 'ppl', '{:.2f}')} | {cell(name, 'tau', '{:.2f}')} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- tables
def decode_table() -> str:
    decode, generate = load(DECODE), load(GENERATE_AR)
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


def parity_table() -> str:
    lines = ["| model | device | tokens | prefill rel. err | max rel. err | greedy agreement | JSON |",
             "|---|---|---|---|---|---|---|"]
    for source in PARITY.values():
        data = load(source)
        r = data["results"]
        lines.append(f"| {r['model']} | {device_of(source)} | {r['prompt_tokens']} + {r['decode_steps']} decode "
                     f"| {r['prefill_rel_err']:.2e} | {r['max_rel_err']:.2e} | {r['argmax_agreement_decode']:.2f} "
                     f"| `{source}` |")
    return "\n".join(lines)


def skip_table() -> str:
    lines = []
    for source, what in ((SKIP, "XLA's default flags"), (SKIP_CMDBUF, "device-side conditionals")):
        for key, rows in load(source)["cases"].items():
            lines += ["", f"Skip-mask variants ({key}, {what}; `{source}`):", "",
                      "| variant | mask | first call s (compile) | ms / forward |", "|---|---|---|---|"]
            lines += [f"| {r['variant']} | {r['mask']} | {r['compile_s']:.2f} | {r['ms']:.2f} |" for r in rows]
    return "\n".join(lines[1:])


def plain_table() -> str:
    """bench-plain: the engine's plain stretch, its variants and the AR loop on one cache, per step (two call lengths'
    difference) and per call, with the compiled programs' copies; or which suite step measures it."""
    lines = []
    for tag, (source, suite) in BENCH_PLAIN.items():
        gpu = "an H100" if tag == "h100" else "the H200"
        if not (RESULTS / source).exists():
            lines += ["", f"The engine's plain stretch against the AR loop on {gpu} (bench-plain, suite {suite} step "
                          "plain-vs-ar-32k): not measured yet."]
            continue
        for case, rows in load(source)["cases"].items():
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
    r = load(SELF_DRAFT)["results"]
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
        lines.append(f"| `{spec}` | {load(source)['results']['metrics']['tau']:.2f} | `{source}` |")
    bench = load(BENCH_SD)
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
    split = load(BENCH_SD_SPLIT)
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
        r = load(source)["results"]
        lines.append(f"| {dtype} | {r['metrics']['tau']:.2f} | {r['identical_to_ar']} | `{source}` |")
    return "\n".join(lines)


def kernel_cases() -> Dict[Tuple[str, int, int], List[Dict[str, Any]]]:
    """Every bench-attention case of the committed H200 sweep: ``{(shape, context, batch): rows}``."""
    cases = {}
    for name in KERNEL_FILES:
        for key, case in load(name)["cases"].items():
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


def kernel_table() -> str:
    lines = ["| shape | context | batch | ours dense µs (TB/s) | XLA dense µs | cuDNN µs | ours sparse k=512 µs "
             "| sparse speed-up vs fastest dense (k = 256 / 512 / 1024 / 2048) | XLA gather k=512 µs "
             "| selection, 4 KV groups: µs (% of dense verification) | selection, 1 KV group |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (shape, context, batch), rows in sorted(kernel_cases().items(), key=lambda kv: (kv[0][0], -kv[0][1], -kv[0][2])):
        dense, xla, cudnn = _pick(rows, "ours_dense"), _pick(rows, "xla_dense"), _pick(rows, "cudnn_dense")
        sparse, gather = _pick(rows, "ours_sparse", 512), _pick(rows, "xla_gather_dense", 512)
        speedups = " / ".join(f"{r['speedup_vs_fastest_dense']:.1f}" if r else "-"
                              for r in (_pick(rows, "ours_sparse", k) for k in (256, 512, 1024, 2048)))
        sel4, sel1 = _pick(rows, "selection_4groups", 512), _pick(rows, "selection_1group", 512)
        lines.append(
            f"| {shape} | {context // 1024}k | {batch} | {dense['us']:.0f} ({dense['TBps']:.2f}) | {xla['us']:.0f} "
            f"| {cudnn['us']:.0f} | {sparse['us']:.1f} | {speedups} | {gather['us']:.1f} "
            f"| {sel4['us']:.0f} ({100 * sel4['fraction_of_dense_verification']:.2f} %) "
            f"| {sel1['us']:.0f} ({100 * sel1['fraction_of_dense_verification']:.2f} %) |")
    return "\n".join(lines)


DUSTIN_METHODS = (("classic", "ClassicSD"), ("magicdec", "MagicDec"), ("dustin", "**Dustin**"))


def dustin_speed_tables() -> str:
    lines = ["| context | batch | AR tok/s | ClassicSD | MagicDec | **Dustin** | roofline (Classic / MagicDec / Dustin) "
             "| attention per verification dense → sparse (28 layers) | selection / round |",
             "|---|---|---|---|---|---|---|---|---|"]
    split = ["| context | batch | ClassicSD draft / verify / other | MagicDec draft / verify / other "
             "| Dustin draft / selection / verification / other |", "|---|---|---|---|---|"]
    for batch, source in DUSTIN_SPEED.items():
        for key, case in load(source)["cases"].items():
            if key == "copy_bandwidth":
                continue
            rows = {r["method"]: r for r in case["rows"]}
            ar, d = rows["ar"], rows["dustin"]
            cells = " | ".join(f"{rows[m]['tok_s']:.0f} ({rows[m]['speedup']:.2f}x)" for m, _ in DUSTIN_METHODS)
            roof = " / ".join(f"{rows[m]['roofline_speedup']:.2f}" for m, _ in DUSTIN_METHODS)
            lines.append(f"| {ar['context'] // 1024}k | {batch} | {ar['tok_s']:.0f} | {cells} | {roof}x "
                         f"| {ar['attn_dense_ms']:.2f} → {ar['attn_sparse_ms']:.2f} ms ({ar['attn_speedup']:.1f}x) "
                         f"| {d['selection_ms']:.2f} ms ({100 * d['selection_ms'] / d['attn_dense_ms']:.0f} %) |")
            c, mg = rows["classic"], rows["magicdec"]
            split.append(f"| {ar['context'] // 1024}k | {batch} | {c['draft_ms']:.1f} / {c['verify_ms']:.1f} / "
                         f"{c['other_ms']:.1f} | {mg['draft_ms']:.1f} / {mg['verify_ms']:.1f} / {mg['other_ms']:.1f} "
                         f"| {d['draft_ms']:.1f} / {d['selection_ms']:.1f} / {d['verification_ms']:.1f} / "
                         f"{d['other_ms']:.1f} |")
    sp = ["| context | batch | method | tok/s | speed-up vs AR | tau it ran with (real pair, pair-speed case) "
          "| realised tau | bytes roofline | selection / round |", "|---|---|---|---|---|---|---|---|---|"]
    table_methods = (("ar", "AR"), ("classic", "ClassicSD"), ("magicdec", "MagicDec")) + DUSTIN_SPEED_SPARSE_METHODS[1:]
    sparse_cases = [(k, c, 16) for k, c in load(DUSTIN_SPEED_SPARSE)["cases"].items()]
    if (RESULTS / DUSTIN_SPEED_SPARSE_B8).exists():
        sparse_cases += [(k, c, 8) for k, c in load(DUSTIN_SPEED_SPARSE_B8)["cases"].items()]
    for key, case, batch in sparse_cases:
        if key == "copy_bandwidth" or "rows" not in case:
            continue
        for method, label in table_methods:
            r = next((r for r in case["rows"] if r["method"] == method), None)
            if r is None:
                continue
            bold = "**" if method.startswith("dustin-kv") else ""
            sp.append(f"| {r['context'] // 1024}k | {batch} | {label} | {r['tok_s']:.0f} | {bold}{r['speedup']:.2f}x{bold} "
                      f"| {'-' if method == 'ar' else '%.2f (%s)' % (r['fixed_tau'], r['tau_case'])} "
                      f"| {r['tau']:.2f} | {r['roofline_speedup']:.2f}x "
                      f"| {'-' if 'selection_ms' not in r else '%.2f ms' % r['selection_ms']} |")
    first = load(DUSTIN_SPEED_SPARSE_32K)
    first_note = ("The earlier, shorter run of the 32k point alone (`" + DUSTIN_SPEED_SPARSE_32K + "`, suite `"
                  + suite_steps()[DUSTIN_SPEED_SPARSE_32K][0] + "`) measured "
                  + ", ".join(f"{label} {read_path(first, _dustin(32768, 16, m, 'speedup')):.2f}x"
                              for m, label in DUSTIN_SPEED_SPARSE_METHODS[1:]
                              if any(r["method"] == m for r in first["cases"]["ctx32768/b16"]["rows"]))
                  + "; the difference between the two runs is their run-to-run spread.")
    first_note += " " + finished_rows_speed_note()
    pt = ["| context | AR tok/s | ClassicSD | MagicDec | **Dustin-H** | roofline (Classic / MagicDec / Dustin-H) "
          "| selection / round |", "|---|---|---|---|---|---|---|"]
    for key, case in load(DUSTIN_SPEED_PAIR_TAU)["cases"].items():
        if key == "copy_bandwidth":
            continue
        rows = {r["method"]: r for r in case["rows"]}
        ar = rows["ar"]
        cells = " | ".join(f"{rows[m]['tok_s']:.0f} ({rows[m]['speedup']:.2f}x; tau {rows[m]['fixed_tau']:.2f}, "
                           f"{rows[m]['tau_case']})" for m in ("classic", "magicdec", "dustin"))
        roof = " / ".join(f"{rows[m]['roofline_speedup']:.2f}" for m in ("classic", "magicdec", "dustin"))
        pt.append(f"| {ar['context'] // 1024}k | {ar['tok_s']:.0f} | {cells} | {roof}x "
                  f"| {rows['dustin']['selection_ms']:.2f} ms |")
    trace = load(DUSTIN_TRACE)["cases"]["ctx32768/b16"]
    tr = ["| method | span ms | device busy ms (idle) | largest kernels (total over the run) |", "|---|---|---|---|"]
    for method in ("ar", "magicdec", "dustin"):
        plane = next(iter(trace[method]["trace"]["planes"].values()))
        top = ", ".join(f"`{k['name']}` {k['total_s'] * 1e3:.0f} ms" for k in plane["top_kernels"][:3])
        tr.append(f"| {method} | {plane['span_s'] * 1e3:.0f} | {plane['busy_s'] * 1e3:.0f} "
                  f"({100 * (1 - plane['busy_s'] / plane['span_s']):.0f} %) | {top} |")
    tr_sparse = []
    if (RESULTS / DUSTIN_TRACE_SPARSE).exists():
        traced = load(DUSTIN_TRACE_SPARSE)
        case = traced["cases"]["ctx32768/b16"]
        tokens = int(traced["config"]["new_tokens"])
        tr_sparse = ["| method | tok/s | rounds (64 / tau) | span ms | device busy ms (idle) | launches (per round) "
                     "| bytes floor ms (busy / floor) | largest kernels (total over the run) |",
                     "|---|---|---|---|---|---|---|---|"]
        labels, over, per_round = dict(DUSTIN_SPEED_SPARSE_METHODS), {}, {}
        for row in case["rows"]:
            method = row["method"]
            plane = next(iter(case[method]["trace"]["planes"].values()))
            rounds = tokens / row["tau"]
            floor_s = tokens * row["batch"] / row["roofline_tok_s"]
            top = ", ".join(f"`{k['name']}` {k['total_s'] * 1e3:.0f} ms" for k in plane["top_kernels"][:3])
            over[method], per_round[method] = plane["busy_s"] / floor_s, plane["launches"] / rounds
            tr_sparse.append(
                f"| {labels.get(method, method)} | {row['tok_s']:.0f} | {rounds:.1f} | {plane['span_s'] * 1e3:.0f} "
                f"| {plane['busy_s'] * 1e3:.0f} ({100 * (1 - plane['busy_s'] / plane['span_s']):.0f} %) "
                f"| {plane['launches']} ({plane['launches'] / rounds:.0f}) | {floor_s * 1e3:.0f} "
                f"({plane['busy_s'] / floor_s:.1f}x) | {top} |")
        tr_sparse = ["", f"The sparse draft KV traced the same way (`{DUSTIN_TRACE_SPARSE}`, suite "
                         f"`{suite_steps()[DUSTIN_TRACE_SPARSE][0]}`, {tokens} new tokens a row, each method at the "
                         "tau the real pair measured for it at 32k/b16; for AR a round is a step; the bytes floor "
                         "is the run's bytes at the copy bandwidth measured in the same run):", ""] + tr_sparse + [
            "", f"With the draft reading sinks + a window, the round is no longer bound by bytes: the device is "
                f"busy for {over['dustin-kv-streaming']:.1f} times the round's bytes floor and runs "
                f"{per_round['dustin-kv-streaming']:.0f} kernels a round, most of them small; the cuBLAS matrix "
                "products of the draft and the verification are now the largest kernels, not attention. Full-KV "
                f"Dustin-H is busy for {over['dustin']:.1f} times its (larger) floor."]
    e2e = ["| method | attention | tok/s | AR tok/s | speed-up | tau | acceptance | greedy output = AR | JSON |",
           "|---|---|---|---|---|---|---|---|---|"]
    for (method, backend), source in E2E.items():
        r = load(source)["results"]
        e2e.append(f"| {method} | {backend} | {r['tokens_per_s']:.0f} | {r['ar_tokens_per_s']:.0f} "
                   f"| {r['speedup_vs_ar']:.2f} | {r['metrics']['tau']:.2f} | {r['metrics']['acceptance_rate']:.2f} "
                   f"| {'yes' if r['identical_to_ar'] else 'no'} | `{source}` |")
    plot = f"![7B-shape speed-ups at the real pair's tau](../experiments/results/{DUSTIN_SPEED_PAIR_TAU_PLOT})"
    return "\n".join(lines + ["", "Batch 16 with each method's own tau as pair-speed measured it on the real pair "
                                  f"at the nearest context and batch 16 (`{DUSTIN_SPEED_PAIR_TAU}`, suite "
                                  f"`{suite_steps()[DUSTIN_SPEED_PAIR_TAU][0]}`; the same code and shapes as the "
                                  "table above, only the acceptance differs; for most of this run two other processes on the same host "
                                  "converted model weights to bfloat16, so its host-side times may carry some "
                                  "contention):", ""] + pt + ["", plot]
                     + ["", f"The sparse draft KV (docs/methods.md §5.1) beside the others, batch 16, all six "
                                  f"methods in one process (`{DUSTIN_SPEED_SPARSE}`, suite "
                                  f"`{suite_steps()[DUSTIN_SPEED_SPARSE][0]}`; each method at the tau pair-speed "
                                  "measured for it on the real pair at the nearest context, the sparse-draft "
                                  "variants from the real pair's sparse-draft runs at 16k and 32k; two weight "
                                  "conversions shared the host CPU during the first minutes of this run, while "
                                  "its 32k point compiled and ran), and at batch 8 "
                                  + (f"(`{DUSTIN_SPEED_SPARSE_B8}`, suite `{suite_steps()[DUSTIN_SPEED_SPARSE_B8][0]}`, "
                                     "the taus of the real pair's batch-8 runs; its 16k and 8k points were cut off by "
                                     "the end of the GPU time; a rerun of the step measures all three)"
                                     if (RESULTS / DUSTIN_SPEED_SPARSE_B8).exists() else "(not measured yet)")
                                  + ":", ""] + sp + ["", first_note]
                     + ["", "Per-round split (`--profile`: per-phase jitted calls with a host sync after each, "
                                  "so the sum exceeds a fused round), ms per round:", ""] + split
                     + ["", f"Where the time goes (`{DUSTIN_TRACE}`, 32k, batch 16, one more run of each method "
                            "under `jax.profiler`):", ""] + tr + tr_sparse
                     + ["", "Real SmolLM2-135M end to end (7.6k-token prompt, batch 16, 256 new tokens, gamma 4, "
                            "AR in the same process before each method):", ""] + e2e)


def _plans(case) -> str:
    plans = case.get("plans") or []
    if not plans:
        return "none"
    def one(p):
        star = p.get("gamma_star", p["gamma_used"])
        gamma = f"g{star}" if star == p["gamma_used"] else f"g*{star} → g{p['gamma_used']}"
        return f"{p['n_skip_attn']}/{p['n_skip_mlp']} {gamma}"

    return ", ".join(one(p) for p in plans)


def knapspec_comparison(method: str) -> Tuple[int, List[str]]:
    """How many of the runs in KNAPSPEC_RUNS KnapSpec beat ``method`` in, and the labels of those it did not."""
    wins, losses = 0, []
    for label, source, tag, ctx, batch, other in KNAPSPEC_RUNS:
        base = f"{tag}/summarize/ctx{ctx}/b{batch}"
        rival = load(other or source)["cases"].get(f"{base}/{method}")
        if rival is None:
            continue
        if load(source)["cases"][f"{base}/knapspec"]["speedup_vs_ar"] > rival["speedup_vs_ar"]:
            wins += 1
        else:
            losses.append(label)
    return wins, losses


def knapspec_tables() -> str:
    lines = ["| device, model, case | KnapSpec (x AR) | KnapSpec's plans (Attn / MLP skipped, gamma) | planning % "
             "| CLaSp (x AR) | authors' always-draft emulation (x AR) | JSON |", "|---|---|---|---|---|---|---|"]
    for label, source, tag, ctx, batch, other in KNAPSPEC_RUNS:
        cases = load(source)["cases"]
        others = load(other or source)["cases"]
        base = f"{tag}/summarize/ctx{ctx}/b{batch}"
        ks = cases[f"{base}/knapspec"]

        def rate(method):
            case = others.get(f"{base}/{method}")
            return f"{case['speedup_vs_ar']:.2f}" if case else "–"

        files = f"`{source}`" + (f", `{other}`" if other else "")
        lines.append(f"| {label} | **{ks['speedup_vs_ar']:.2f}** | {_plans(ks)} "
                     f"| {100 * ks['plan_fraction_of_decode']:.1f} | {rate('clasp')} | {rate('knapspec-official')} "
                     f"| {files} |")
    early = ["| prompt | method | tok/s | AR tok/s (paired) | speed-up | tau | plans (Attn / MLP skipped, gamma) "
             "| planning % | identical |", "|---|---|---|---|---|---|---|---|---|"]
    for source in KNAPSPEC_EARLY:
        for key, case in load(source)["cases"].items():
            parts = key.split("/")
            if len(parts) != 5 or "speedup_vs_ar" not in case:
                continue
            tau = "-" if case.get("tau") is None else f"{case['tau']:.2f}"
            early.append(f"| {parts[2][3:]} | {parts[4]} | {case['tokens_per_s']:.1f} | {case['ar_tokens_per_s']:.1f} "
                         f"| {case['speedup_vs_ar']:.2f} | {tau} | {_plans(case)} "
                         f"| {100 * case['plan_fraction_of_decode']:.0f} | {case['identical_to_ar']} |")
    return "\n".join(lines + ["", f"SmolLM2-135M on the CPU at 1k-8k, measured before the whole-forward latency fit, "
                                  f"the planning budget, the allowance and the measured arbitration "
                                  f"(`{KNAPSPEC_EARLY[0]}`, `{KNAPSPEC_EARLY[1]}`; rerunning their commands measures "
                                  f"the current code):", ""] + early)


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
        ks = [k for k in (256, 512, 1024, 2048) if _pick(rows, "ours_sparse", k)]
        axes[0].plot(ks, [_pick(rows, "ours_sparse", k)["speedup_vs_fastest_dense"] for k in ks], marker="o",
                     label=f"{shape}, b{batch}")
        axes[0].plot(ks, [_pick(rows, "ours_dense")["GB"] / _pick(rows, "ours_sparse", k)["GB"] for k in ks],
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
            cases = quality_cases(load(source)["config"]["model"], context)
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


def _m_run_label(source: str) -> str:
    """An input-aware-m run's label: its item contexts, the device where it is not the CPU, and the
    coverage rule's candidate ladder where it is wider than one step (``--m-steps``)."""
    steps = load(source).get("config", {}).get("m_steps", 1)
    return (_items_context(source) + (", H200" if source.endswith("_h200.json") else "")
            + (", H100" if source.endswith("_h100.json") else "")
            + (f", coverage ladder of {steps} steps" if steps and steps != 1 else ""))


def _tokens_k(tokens: int) -> str:
    """A context length in words: 32000 -> 32k, 16384 -> 16k."""
    return f"{tokens // 1000}k" if tokens % 1000 == 0 else f"{tokens // 1024}k"


def _items_context(source: str) -> str:
    return "/".join(sorted({_tokens_k(c["context"]) for c in load(source)["cases"].values() if "context" in c}))


def oracle_m_persistence(source: str) -> Tuple[float, int]:
    """``(r, pairs)``: the lag-1 correlation, over consecutive rounds of one item and one k, of the oracle's
    per-round m minus its mean at that k in the file (how much the previous round's best m says about this
    round's), and the number of round pairs it rests on."""
    per_k: Dict[str, List[List[int]]] = {}
    for key, case in load(source)["cases"].items():
        if key.endswith("/dense") and isinstance(case.get("m_rule"), dict):
            for name, stats in case["m_rule"].items():
                if name.startswith("dustin-h-oracle/") and "m_per_round" in stats:
                    per_k.setdefault(name, []).append(stats["m_per_round"])
    pairs = []
    for runs in per_k.values():
        values = [m for run in runs for m in run]
        mean = sum(values) / len(values)
        pairs += [(a - mean, b - mean) for run in runs for a, b in zip(run[:-1], run[1:])]
    if len(pairs) < 3:
        return float("nan"), len(pairs)
    xs, ys = zip(*pairs)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    cov = sum((x - mx) * (y - my) for x, y in pairs)
    var = (sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys)) ** 0.5
    return (cov / var if var > 0 else float("nan")), len(pairs)


def oracle_persistence_note() -> str:
    """Whether a rule that follows the previous round's best m (a feedback rule) has anything to follow."""
    parts, seen = [], set()
    for model, source in INPUT_AWARE_M:
        r, n = oracle_m_persistence(source)
        name = f"{model} {_items_context(source)}"
        if n and name not in seen:  # two files of one model and context share the same dense reference rounds
            seen.add(name)
            parts.append(f"{name} {r:+.2f} ({n} pairs)")
    return ("Does the best m persist from round to round? The lag-1 correlation of the oracle's per-round m (minus "
            "its mean at the same k), over consecutive rounds of an item: " + "; ".join(parts) + ". Small, or "
            "resting on few pairs: a round whose ARR is best with more draft positions is followed about as "
            "often by one that wants fewer, so a feedback rule that carries the previous round's best m forward "
            "has little to carry on these items (16 new tokens, 3-6 rounds an item), and the oracle's gain over "
            "fixed m comes from round-by-round choices that do not persist.")


def m_bounds_blocks() -> List[str]:
    """dustin-m-bounds: per k, fixed m, the oracle and the three per-round choices, with the gap each closes."""
    out = []
    for model, source in M_BOUNDS:
        data = load(source)
        extra = m_bounds_3kinds(source)
        tags = M_BOUND_TAGS + (M_BOUND_TAGS_3KINDS if extra else ())
        lines = ["| k | fixed m | rounds | ARR fixed | ARR oracle | oracle's m (mean ± sd, range) | "
                 + " | ".join(f"{label}: gap closed" for _, _, label in tags) + " |",
                 "|---|---|---|---|---|---|" + "---|" * len(tags)]
        for key, study in data.items():
            if not (key.startswith("k") and isinstance(study, dict) and "gap_closed" in study):
                continue
            om = study["oracle_m"]
            other = extra.get(key)
            lines.append(f"| {study['k']} | {study['m']} | {study['rounds']} | {study['arr']['fixed']:.4f} | "
                         f"{study['arr']['oracle']:.4f} | {om['mean']:.0f} ± {om['std']:.0f} ({om['min']}-{om['max']}) | "
                         + " | ".join("-" if study["gap_closed"].get(f) is None else
                                      f"{100 * study['gap_closed'][f]:+.0f} %"
                                      + (f" (m {study['best_fixed_m']['all']})" if f == "best_fixed" else "")
                                      + (" (m " + ", ".join(map(str, study["best_fixed_m"]["folds"])) + ")"
                                         if f == "best_fixed_crossval" and study.get("best_fixed_m", {}).get("folds")
                                         else "")
                                      + (f" (m {study['length_m']})" if f == "length_m" else "")
                                      for f, _, _ in M_BOUND_TAGS)
                         + "".join(" | " + ("-" if other is None or other["gap_closed"].get(f) is None else
                                            f"{100 * other['gap_closed'][f]:+.0f} %"
                                            + (f" (m {other['length_m']})" if f == "length_m" else ""))
                                   for f, _, _ in (M_BOUND_TAGS_3KINDS if extra else ())) + " |")
        cfg = data["config"]
        out.append(f"How predictable the best m is ({model}, `{source}`, `dustin-m-bounds`: {len(data['tasks'])} "
                   f"evaluation tasks at {cfg['lengths']} tokens decoded greedily with full-KV verification, "
                   f"{cfg['max_new_tokens']} new tokens, every round's ARR as a function of m). Carrying the previous "
                   "round's best m forward is what a rule that learns m from finished rounds gets if the best m "
                   "persists; the next round's target signal (the last committed token's SRH attention over the "
                   "history, the one view of the verification's attention a sparse round has) standing in for the "
                   "recall weights is an optimistic stand-in for rules that score m against that signal; the "
                   "hindsight rule applies it causally (the candidate among m and m ∓ one "
                   "step that would have covered the most of this round's target signal with the previous "
                   "round's signals). One m for every round, the one with the highest mean ARR over these rounds, "
                   "bounds what recalibrating the fixed m for these tasks and this length gets; the same m chosen "
                   "on the other half of the sequences and scored on this half (two folds) is that recalibration "
                   "on held-out tasks.\n\n" + "\n".join(lines))
    return out


def _held_cost_clause() -> str:
    """The measured selection cost per round of the coverage rule deciding every third round (bench-selection
    coverage-held3), per device where run."""
    measured = {device: [c["ratio_to_fixed"]["coverage-held3"] for c in load(source)["cases"].values()
                         if "coverage-held3" in c.get("ratio_to_fixed", {})]
                for device, source in SELECTION_COST if "cost_held" in source and (RESULTS / source).exists()}
    measured = {d: r for d, r in measured.items() if r}
    if not measured:
        return "; its selection cost per round is not measured yet (bench-selection coverage-held3)"
    return ("; measured per round (bench-selection coverage-held3: one decision and two selections with the held m), "
            "its selection costs " + ", ".join(
                f"{min(r):.2f}-{max(r):.2f}x on the {d.upper() if d != 'cpu' else 'CPU'} (within 1.1x at "
                f"{sum(x <= 1.1 for x in r)} of {len(r)} points)" for d, r in measured.items())
            + " the fixed rule's (not yet on a GPU where not listed)")


def _three_kinds_clause(source: str) -> str:
    """The m recalibrated on tasks of the evaluation's kinds, in the verdict's words ("" without that run)."""
    extra = list(m_bounds_3kinds(source).values())
    if not extra:
        return ""

    def mean(field):
        vals = [s["gap_closed"][field] for s in extra if s["gap_closed"].get(field) is not None]
        return 100 * sum(vals) / len(vals) if vals else float("nan")

    return (f"; recalibrated instead on calibration tasks of the evaluation's three kinds ("
            + ", ".join(f"{s['length_m'] / s['m']:.2f}x" for s in extra if s["m"]) + f" the profiled m) "
            f"{mean('length_m'):+.0f} %, and the coverage rule around it {mean('coverage_length_m'):+.0f} %"
            + (f" ({mean('coverage_length_m_held3'):+.0f} % deciding every third round)"
               if any(s["gap_closed"].get("coverage_length_m_held3") is not None for s in extra) else ""))


def m_bounds_verdict() -> List[str]:
    """What the dustin-m-bounds runs say about the input-aware-m target."""
    out = []
    for model, source in M_BOUNDS:
        data = load(source)
        studies = [s for k, s in data.items() if k.startswith("k") and isinstance(s, dict) and "gap_closed" in s]
        if not studies:
            continue

        def mean(field):
            vals = [s["gap_closed"][field] for s in studies if s["gap_closed"].get(field) is not None]
            return 100 * sum(vals) / len(vals) if vals else float("nan")

        gap = [s["arr"]["oracle"] - s["arr"]["fixed"] for s in studies]
        out.append(f"{model}, {data['config']['lengths']} tokens (`dustin-m-bounds`): the per-round oracle is "
                   f"{min(gap):.4f}-{max(gap):.4f} ARR above fixed m; carrying the previous round's best m closes "
                   f"{mean('persistence'):+.0f} % of that gap on average over k, the next round's target signal as "
                   f"the weights {mean('signal_proxy'):+.0f} %, and the hindsight rule {mean('hindsight'):+.0f} %"
                   + (f"; one m for every round, the best for these rounds, {mean('best_fixed'):+.0f} %, and the "
                      f"best of the other half of the sequences {mean('best_fixed_crossval'):+.0f} % (the best single "
                      f"m is " + ", ".join(f"{s['best_fixed_m']['all'] / s['m']:.2f}x" for s in studies
                                           if s.get("best_fixed_m") and s["m"])
                      + " the profile's m over k; the oracle's mean m " + ", ".join(
                          f"{s['oracle_m']['mean'] / s['m']:.2f}x" for s in studies if s["m"]) + ")"
                      if any(s["gap_closed"].get("best_fixed") is not None for s in studies) else "")
                   + (f"; the coverage rule on the recorded signals {mean('coverage'):+.0f} %, and with its "
                      f"candidates around the held-out single m {mean('coverage_crossval'):+.0f} %"
                      if any(s["gap_closed"].get("coverage") is not None for s in studies) else "")
                   + (f"; the profile's m for this length (recalibrated on calibration tasks of it, "
                      + ", ".join(f"{s['length_m'] / s['m']:.2f}x" for s in studies if s.get("length_m") is not None
                                  and s["m"]) + f" the profiled m over k) {mean('length_m'):+.0f} %, and the coverage "
                      f"rule around it {mean('coverage_length_m'):+.0f} %"
                      if any(s["gap_closed"].get("length_m") is not None for s in studies) else "")
                   + (f"; deciding only every third round (each row's m held in the two rounds between, where "
                      f"the fixed rule selects with it), the coverage rule closes {mean('coverage_held3'):+.0f} %"
                      + (f" around the profile's m and {mean('coverage_length_m_held3'):+.0f} % around the length's"
                         if any(s["gap_closed"].get("coverage_length_m_held3") is not None for s in studies) else "")
                      + _held_cost_clause()
                      if any(s["gap_closed"].get("coverage_held3") is not None for s in studies) else "")
                   + _three_kinds_clause(source) + ". "
                   + ("The best m does not persist from round to round" if mean("persistence") < 33 else
                      "The best m persists from round to round")
                   + (", and the target's own signal, scored as if it were the verification's attention, favours "
                      "the sets built from it (below fixed m)" if mean("signal_proxy") < 0 else "")
                   + (": none of the three per-round choices reaches a third of the gap here, so these signals do "
                      "not predict the oracle's m well enough for the 33 % target"
                      + ("; nor does one m recalibrated on held-out tasks of this length"
                         if mean("best_fixed_crossval") < 33 else "") + "."
                      if max(mean(f) for f, _, _ in M_BOUND_TAGS[:3]) < 33 else "."))
    return out


def _input_aware_reach(device: str) -> int:
    """The longest item context of the input-aware-m files run on ``device`` (0: none)."""
    return max((c["context"] for _, s in INPUT_AWARE_M if s.endswith(f"_{device}.json")
                for c in load(s)["cases"].values() if "context" in c), default=0)


def selection_cost_tables() -> List[str]:
    """The bench-selection runs: each rule's selection per round against the fixed rule's, same signals."""
    out = []
    for device, source in SELECTION_COST:
        if not (RESULTS / source).exists():
            continue
        data = load(source)
        rules = [r for r in SELECTION_RULE_TAGS if any(r in c["ratio_to_fixed"] for c in data["cases"].values())]
        lines = ["| positions | batch | k | m | fixed rule ms | " + " | ".join(f"{r} / fixed" for r in rules) + " |",
                 "|---|---|---|---|---|" + "---|" * len(rules)]
        for case in data["cases"].values():
            lines.append(f"| {case['context']} | {case['batch']} | {case['k']} | {case['m']} | "
                         f"{1e3 * case['seconds']['fixed']:.3f} | "
                         + " | ".join(f"{case['ratio_to_fixed'][r]:.2f}x" if r in case["ratio_to_fixed"] else "-"
                                      for r in rules) + " |")
        checked = [c[f] for c in data["cases"].values() for f in (
            "coverage_equals_reference", "coverage_ladder_equals_reference", "coverage_sort_equals_reference",
            "coverage_radix_equals_reference") if f in c]
        out.append(f"The selection alone, each rule against the fixed rule on the same seeded signals in one process "
                   f"(`{source}`, {data['environment'].get('devices', ['?'])[0] if device != 'cpu' else 'CPU'}, "
                   f"each budget's sinks, window and m from the Qwen2.5-Coder pair's profile; best of "
                   f"{data['config']['repeats']} interleaved timings of {data['config']['iters']} calls)"
                   + (f"; the coverage rule's sets equal its direct reference in {sum(checked)} of {len(checked)} "
                      "cases" if checked else "") + ":\n\n" + "\n".join(lines))
    return out


def selection_cost_verdicts() -> List[str]:
    out = []
    for device, source in SELECTION_COST:
        if not (RESULTS / source).exists():
            continue
        cases = list(load(source)["cases"].values())
        for rule in selection_rules_of(source, SELECTION_RULE_TAGS):
            ratios = [c["ratio_to_fixed"][rule] for c in cases if rule in c["ratio_to_fixed"]]
            if not ratios:
                continue
            inside = sum(r <= 1.1 for r in ratios)
            worst = [f"{c['context'] // 1024}k/b{c['batch']}/k{c['k']}" for c in cases
                     if c["ratio_to_fixed"].get(rule, 0) > 1.1]
            rows = [c["ratio_to_fixed"][rule] / c["ratio_to_fixed"]["fixed-rows"] for c in cases
                    if rule in HELD_SELECTION_RULES and "fixed-rows" in c["ratio_to_fixed"]]
            fixed_rows = [c["ratio_to_fixed"]["fixed-rows"] for c in cases if "fixed-rows" in c["ratio_to_fixed"]]
            out.append(f"Selection cost, {rule} rule, {device.upper() if device != 'cpu' else 'CPU'} "
                       f"(bench-selection): {min(ratios):.2f}-{max(ratios):.2f}x the fixed rule, within 1.1x at "
                       f"{inside} of {len(ratios)} points (target <= 1.1x: **{'met' if inside == len(ratios) else 'missed'}**"
                       + (f"; over at {', '.join(worst)}" if worst else "") + ")"
                       + ((f". Its rounds between decisions select with the fixed rule's per-row path, which itself runs "
                           f"{min(fixed_rows):.2f}-{max(fixed_rows):.2f}x the fixed rule's own path here (a mask where "
                           f"the fixed rule then extracted and scattered indices): against that path the held rule costs "
                           f"{min(rows):.2f}-{max(rows):.2f}x, so part of its margin was a cheaper fixed selection, which "
                           f"the fixed rule has used since"
                           if load(source).get("fixed_rule_draft_part") != "mask" else
                           f". Its rounds between decisions select with the per-row path, the fixed rule's own since "
                           f"it selects the draft's part as a mask too ({min(fixed_rows):.2f}-{max(fixed_rows):.2f}x "
                           f"the fixed rule here, the same work)") if rows else "") + ".")
    return out


def input_aware_reach_note() -> str:
    cpu, gpu, h100 = _input_aware_reach("cpu"), _input_aware_reach("h200"), _input_aware_reach("h100")
    h200 = (f"beyond {gpu // 1000}k on the H200 (step h200-dustin-quality/32k-input-aware-m)" if gpu else
            "the H200 at 16k-32k (suite step h200-dustin-quality/16k-input-aware-m)")
    return (f"Not measured: beyond {cpu // 1024}k on the CPU, and {h200}"
            + (f"; on an H100 up to {h100 // 1000}k (its acceptance and agreement do not depend on the GPU, the "
               "selection times do)." if h100 else "."))


def _m_rules_plot(model, source):
    def draw(fig_path) -> None:
        plot_m_rules(load(source)["cases"], fig_path,
                     title=f"{model} + {INPUT_AWARE_M_DRAFT[model]}, {_items_context(source)}: input-aware m")
    return draw


for _model, _source in INPUT_AWARE_M:
    PLOTS[_source.replace(".json", ".png")] = _m_rules_plot(_model, _source)


def _m_per_length_plot(model, source, base):
    def draw(fig_path) -> None:
        plot_m_per_length(source, base, fig_path, title=f"{model} + {INPUT_AWARE_M_DRAFT[model]}, "
                          f"{_m_run_label(source)}: the profile's m per context length")
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
            case = load((other or source) if method != "knapspec" else source)["cases"].get(f"{base}/{method}")
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


def _selfspec_series() -> List[Tuple[str, List[Tuple[int, float]]]]:
    """Speed-up vs paired AR of each self-speculative method on the real Qwen2.5-Coder-1.5B, batch 16, H200, by
    context (files that exist only): (label, [(context, speed-up)])."""
    series = []
    for method, label in (("knapspec", "KnapSpec (static plans, Pallas)"),
                          ("knapspec-budget", "KnapSpec + budgeted attention (Pallas)")):
        if (RESULTS / KNAPSPEC_PALLAS_STATIC).exists():
            cases = load(KNAPSPEC_PALLAS_STATIC)["cases"]
            points = [(ctx, cases[key]["speedup_vs_ar"]) for ctx in (8192, 16384, 32000)
                      if (key := f"h200/summarize/ctx{ctx}/b16/{method}") in cases]
            series.append((label, points))
    static = next(src for batch, src, methods, _ in KNAPSPEC_REAL_BASELINES if batch == 16 and "static-skip" in methods)
    for source, method, label in ((KNAPSPEC_REAL[16], "clasp", "CLaSp (jnp attention)"),
                                  (static, "static-skip", "static skip set (jnp attention)")):
        if (RESULTS / source).exists():
            cases = load(source)["cases"]
            series.append((label, [(ctx, cases[key]["speedup_vs_ar"]) for ctx in (8192, 16384, 32000)
                                   if (key := f"h200/summarize/ctx{ctx}/b16/{method}") in cases]))
    if (RESULTS / PAIR_SPEED_SELF[0]).exists():
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
    if not (RESULTS / KNAPSPEC_PALLAS_STATIC).exists():
        return []
    cases, rows = load(KNAPSPEC_PALLAS_STATIC)["cases"], []
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
    for label, points in _selfspec_series():
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


def _backend(name: str) -> str:
    return {"pallas": "Pallas", "xla": "XLA"}.get(name, name)


def _pair_label(method: str) -> str:
    return dict(PAIR_METHODS)[method]


def _round_ms(record: Dict[str, Any]) -> float:
    """A pair-speed method's decode time per loop round, ms."""
    return record["timings"]["decode_s"] / record["metrics"]["rounds"] * 1e3


def _ar_ms(case, new: int) -> float:
    runs = case["ar"]["runs"]
    return sum(r["decode_s"] for r in runs) / len(runs) / new * 1e3


def pair_case_table(source: str, key: str, case: Dict[str, Any]) -> str:
    """One (context, batch) case: AR and every method measured, per round and against the bytes floor."""
    data = load(source)
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
    lines.append(f"| AR | {_pair_ar_tok_s(key)(data):.0f} (mean of {len(ar['runs'])}) | 1 | 1 | 1 | {new} steps "
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
        data = load(source)
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
    not_run = [name for name, out in _pair_suite_steps() if not (RESULTS / out).exists()]
    unshown = [name for name, out in _pair_suite_steps() if (RESULTS / out).exists() and out not in shown]
    if not_run or unshown:
        blocks.append(f"Steps of `{PAIR_SPEED_SUITE}`"
                      + (f" not run yet: {', '.join(f'`{n}`' for n in not_run)}" if not_run else "")
                      + (";" if not_run and unshown else "")
                      + (f" with a committed file not shown here yet: {', '.join(f'`{n}`' for n in unshown)}"
                         if unshown else "") + ".")
    blocks.append(f"![pair-speed speed-ups](../experiments/results/{PAIR_SPEED_PLOT})")
    f32 = load(PAIR_SPEED_F32)
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
    check = load(PAIR_SPEED_CHECK)["cases"]["backend_check"]
    blocks.append(f"Attention backend check (`{PAIR_SPEED_CHECK}`, step `{_step_of(PAIR_SPEED_CHECK)}`): the "
                  f"target's logits over the first {check['tokens']} tokens of row 0 with {_backend(check['backend'])} "
                  f"attention against XLA's differ by at most {check['max_abs_logit_diff']:.3f} (the largest "
                  f"|logit| is {check['logit_scale']:.1f}: "
                  f"{100 * check['max_abs_logit_diff'] / check['logit_scale']:.2f} %); argmax equal at every "
                  f"position: {'yes' if check['argmax_equal'] else '**no**'}.")
    earlier = ["| method | tok/s | AR tok/s (same process) | speed-up | tau | identical to AR | JSON |",
               "|---|---|---|---|---|---|---|"]
    for _, label, source in REAL_PAIR:
        r = load(source)["results"]
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


def selfspec_table() -> str:
    lines = ["| method | tok/s | AR tok/s (same process) | speed-up | tau | acceptance | planning / decode | plans "
             "| identical to AR | JSON |", "|---|---|---|---|---|---|---|---|---|---|"]
    for _, label, source in SELFSPEC_CPU:
        r = load(source)["results"]
        t, m = r["timings"], r["metrics"]
        plans = m.get("knapspec_plans")
        lines.append(f"| {label} | {r['tokens_per_s']:.2f} | {r['ar_tokens_per_s']:.2f} | {r['speedup_vs_ar']:.2f}x "
                     f"| {m['tau']:.2f} | {m['acceptance_rate']:.2f} "
                     f"| {'%.0f %%' % (100 * t['plan_fraction']) if 'plan_fraction' in t else '–'} "
                     f"| {len(plans) if isinstance(plans, list) else '–'} "
                     f"| {'yes' if r['identical_to_ar'] else 'no'} | `{source}` |")
    return "\n".join(lines)


def _case(context: int, batch: int) -> Optional[Tuple[str, Dict[str, Any]]]:
    for source in PAIR_SPEED:
        for key, case in pair_cases(source):
            if (case["context"], case["batch"]) == (context, batch):
                return source, case
    return None


def device_time_note() -> str:
    """The attention speed-up as the paper states it: kernel time of all layers, from the profiler."""
    if not (RESULTS / KERNEL_DEVICE).exists():
        return ("Sparse ≥ 20x (7B) / ≥ 28x (72B) the fastest dense at k = 512, 32k, batch 16 by device kernel time "
                "(all layers, the paper's measure): **not measured yet** (suite h200-attention-kernels, step "
                "`device-time-32k-b16`).")
    cases = load(KERNEL_DEVICE)["cases"]
    first_run = ""
    if (RESULTS / KERNEL_DEVICE_FIRST).exists():
        first = load(KERNEL_DEVICE_FIRST)["cases"]
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
        own = _own_kernel_ratio(case)
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
    cases, parts = load(source)["cases"], []
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
    if not (RESULTS / KERNEL_DEVICE_UNROLLED).exists():
        out = (" With the layers unrolled, one call per layer on inputs of its own so that no loop slice or stacked "
               "write runs beside the attention (h200-attention-kernels step `device-time-32k-b16-unrolled`): not "
               "measured yet on the H200.")
    else:
        parts = _unrolled_parts(KERNEL_DEVICE_UNROLLED)
        out = (f" With the layers unrolled, one call per layer on inputs of its own, as the model's forward makes "
               f"them, so that no loop slice or stacked write runs beside the attention (`{KERNEL_DEVICE_UNROLLED}`, "
               "every kernel of the program): " + ("; ".join(parts) if parts else "no case measured") + ".")
    if (RESULTS / KERNEL_DEVICE_UNROLLED_H100).exists():
        parts = _unrolled_parts(KERNEL_DEVICE_UNROLLED_H100, ("above it on this GPU", "below it on this GPU"),
                                "the H200 target")
        dense = []
        if (RESULTS / KERNEL_DEVICE).exists():
            h100, h200 = load(KERNEL_DEVICE_UNROLLED_H100)["cases"], load(KERNEL_DEVICE)["cases"]
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
        ratio = _own_kernel_ratio(case)
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


def divergence_note(cases: Dict[str, Any], method: str = "dustin-h", budget: int = 512) -> str:
    """Where a method's greedy output leaves the dense output, item by item: after a shared correct
    answer, on items the dense run fails too, or with another answer (what the token match counts)."""
    dense = {k[:-len("/dense")]: c for k, c in cases.items() if k.endswith("/dense")}
    runs = [(dense[_item_of(k)], c) for k, c in cases.items()
            if c.get("method") == method and c.get("budget") == budget and _item_of(k) in dense]
    diverged = [(d, c) for d, c in runs if c["first_divergence"] is not None]
    after_answer = sum(1 for d, c in diverged if d["accuracy"] == c["accuracy"] == 1)
    both_wrong = sum(1 for d, c in diverged if d["accuracy"] == c["accuracy"] == 0)
    other = len(diverged) - after_answer - both_wrong
    firsts = sorted(c["first_divergence"] for _, c in diverged)
    return (f"Why the token match is low, item by item ({method}, k = {budget}): {len(runs) - len(diverged)} of "
            f"{len(runs)} outputs equal dense; of the {len(diverged)} that leave it (first differing token at "
            f"{', '.join(map(str, firsts))}), {after_answer} still give the correct answer, as dense "
            f"does (in other words), {both_wrong} are items dense fails too (the two runs guess differently), "
            f"{other} differ from dense in retrieval. The token match counts every token after the first difference as lost, so it measures "
            "identical continuations, not retrieval.")


def quality_target_notes() -> List[str]:
    """The quality targets of the real pair on the H200 (Dustin-H at k = 512), from the GPU quality files."""
    out = []
    measured = gpu_quality_contexts()
    for ctx in (16000, 32000):
        where = f"{ctx // 1000}k"
        if ctx not in measured:
            steps = [s["name"] for path in sorted(SUITES.glob("*.toml")) for suite in [tomllib.loads(path.read_text())]
                     if "h200" in suite.get("device", "") for s in suite["steps"]
                     if s["run"].startswith("dustin-quality") and f"--items {ctx}:" in s["run"]]
            out.append(f"Dustin-H at k = 512 keeping ≥ 97 % of dense retrieval accuracy and ≥ 0.95 greedy agreement "
                       f"at {where}: **not measured** (" + (f"suite step {', '.join(steps)}" if steps else
                                                             "no suite step runs it") + ", not run yet).")
            continue
        source = quality_source(QUALITY_GPU_MODEL, ctx)
        rows = {(r["method"], r["k"]): r for r in quality_rows(quality_cases(QUALITY_GPU_MODEL, ctx))}
        dense, dh = rows[(DENSE, "-")], rows.get(("dustin-h", 512))
        done, planned = quality_items(QUALITY_GPU_MODEL, ctx)
        if dh is None:
            continue
        kept = dh["accuracy"] / dense["accuracy"] if dense["accuracy"] else None
        verdict = "met" if kept is not None and kept >= 0.97 and dh["match"] >= 0.95 else "missed"
        partial = f" on the first {done} of {planned} items (provisional)" if done < planned else f" ({done} items)"
        others = ", ".join(f"{m} {rows[(m, 512)]['match']:.2f}" for m in QUALITY_GPU_METHODS[1:] if (m, 512) in rows)
        out.append(f"Dustin-H at k = 512 keeping ≥ 97 % of dense retrieval accuracy and ≥ 0.95 greedy agreement at "
                   f"{where}: **{verdict}**{partial} — accuracy {dh['accuracy']:.2f} against dense "
                   f"{dense['accuracy']:.2f} ({'-' if kept is None else f'{100 * kept:.0f} %'} of dense), token "
                   f"match with dense verification {dh['match']:.2f} (k = 512 others: {others}); the per-item "
                   f"records are in `{source}`. " + divergence_note(quality_cases(QUALITY_GPU_MODEL, ctx)))
    return out


def finished_rows_speed_note() -> str:
    """The 7B-shape batch-16 methods with finished rows reading one cache slot, against the sparse-draft run
    above (finished rows reading their whole history, an earlier commit): speed-ups and ms per loop round."""
    if not (RESULTS / DUSTIN_SPEED_FINISHED).exists():
        return ("The same methods with finished rows reading one cache slot (docs/methods.md §5.7): not measured "
                "yet (step `b16-finished-rows-pair-tau`).")
    new, old = load(DUSTIN_SPEED_FINISHED)["cases"], load(DUSTIN_SPEED_SPARSE)["cases"]
    labels = dict((("ar", "AR"), ("classic", "ClassicSD"), ("magicdec", "MagicDec")) + DUSTIN_SPEED_SPARSE_METHODS[1:])

    def per_round(case, method):
        record = case[method]
        return 1e3 * record["timing"]["median_s"] / record.get("metrics", {}).get("rounds", record.get("steps", 64))

    parts, change, ar_change, finished = [], {}, [], []
    for ctx in ("ctx32768/b16", "ctx16384/b16"):
        if ctx not in new:
            continue
        rows = {r["method"]: r for r in new[ctx]["rows"]}
        cells = []
        for method, label in labels.items():
            if method not in rows or method == "ar":
                continue
            cell = f"{label} {rows[method]['speedup']:.2f}x"
            if ctx in old and method in old[ctx]:
                now, before = per_round(new[ctx], method), per_round(old[ctx], method)
                change.setdefault("dustin" if method.startswith("dustin") else "other", []).append(now / before - 1)
                cell += f" ({now:.2f} ms a loop round, {before:.2f} before)"
            metrics = new[ctx][method].get("metrics", {})
            if metrics.get("rounds_per_row"):
                finished.append(1 - sum(metrics["rounds_per_row"]) / (len(metrics["rounds_per_row"]) * metrics["rounds"]))
            cells.append(cell)
        ar = f"AR {per_round(new[ctx], 'ar'):.2f} ms a step"
        if ctx in old:
            ar_change.append(per_round(new[ctx], "ar") / per_round(old[ctx], "ar") - 1)
            ar += f" ({per_round(old[ctx], 'ar'):.2f} before)"
        parts.append(f"{ctx[3:].split('/')[0]} tokens: {ar}; " + ", ".join(cells))

    def span(values):
        return f"{100 * min(values):+.0f} to {100 * max(values):+.0f} %"

    text = (f"The same methods with finished rows reading one cache slot (docs/methods.md §5.7; `{DUSTIN_SPEED_FINISHED}`,"
            f" suite `{suite_steps()[DUSTIN_SPEED_FINISHED][0]}`, the same taus, a later commit; \"before\" is the run "
            "above, whose finished rows read their whole history): " + "; ".join(parts) + ".")
    if change and ar_change:
        text += (f" Per loop round against the earlier run: ClassicSD and MagicDec {span(change.get('other', [0]))}, "
                 f"the Dustin-H variants {span(change.get('dustin', [0]))}, while AR's step moved "
                 f"{span(ar_change)} (it has no finished rows)")
        if finished:
            text += (f"; finished rows held {100 * min(finished):.0f}-{100 * max(finished):.0f} % of the row-rounds "
                     "(64 new tokens a row)")
        text += (". So skipping their reads bought no measurable time here, and the Dustin-H rounds got slower by "
                 "more than AR's change, which two runs of different commits cannot attribute (the commits between "
                 "them include the skip itself and the in-place cache writes of docs/methods.md §2).")
        text += _finished_rows_kept_note(new, per_round, labels, span)
    return text


def _finished_rows_kept_note(skipped, per_round, labels, span) -> str:
    """The skipped run against the same methods with --keep-finished-rows: per loop round, the skip plus the
    spread of two GPU runs (and whatever changed between their commits, both named)."""
    if not (RESULTS / DUSTIN_SPEED_FINISHED_KEPT).exists():
        return (" The same run with finished rows reading their whole history (--keep-finished-rows, step "
                "`b16-finished-rows-kept-pair-tau`) separates them: not measured yet.")
    kept = load(DUSTIN_SPEED_FINISHED_KEPT)["cases"]
    parts, change, ar_change = [], {}, []
    for ctx in ("ctx32768/b16", "ctx16384/b16"):
        if ctx not in kept or ctx not in skipped:
            continue
        speeds = {r["method"]: r["speedup"] for r in kept[ctx]["rows"]}
        cells = []
        for method, label in labels.items():
            if method == "ar" or method not in kept[ctx] or method not in skipped[ctx]:
                continue
            now, whole = per_round(skipped[ctx], method), per_round(kept[ctx], method)
            change.setdefault("dustin" if method.startswith("dustin") else "other", []).append(now / whole - 1)
            cells.append(f"{label} {speeds[method]:.2f}x AR ({whole:.2f} ms a loop round)" if method in speeds
                         else f"{label} {whole:.2f} ms a loop round")
        ar_change.append(per_round(skipped[ctx], "ar") / per_round(kept[ctx], "ar") - 1)
        parts.append(f"{ctx[3:].split('/')[0]} tokens: AR {per_round(kept[ctx], 'ar'):.2f} ms a step; "
                     + ", ".join(cells))
    if not parts:
        return ""
    commits = [load(f)["environment"].get("commit", "?")[:8] for f in (DUSTIN_SPEED_FINISHED, DUSTIN_SPEED_FINISHED_KEPT)]
    return (f" With finished rows reading their whole history (`{DUSTIN_SPEED_FINISHED_KEPT}`, --keep-finished-rows, "
            f"commit {commits[1]}; the skipped run: commit {commits[0]}"
            + (", the same commit" if commits[0] == commits[1] else
               ": what changed between them beyond the skip is for `git diff` to say")
            + "): " + "; ".join(parts)
            + ". The skipped run per loop round against it: ClassicSD and MagicDec "
            f"{span(change.get('other', [0]))}, the Dustin-H variants {span(change.get('dustin', [0]))}, and AR "
            f"(no finished rows: the spread of two runs) {span(ar_change)}.")


def sparse_draft_notes(main) -> List[str]:
    """The sparse-draft target on the real pair (Dustin-H whose draft reads a budget of its cache, 32k/b16)."""
    if not (RESULTS / PAIR_SPEED_SPARSE_DRAFT).exists():
        return ["Dustin + sparse draft >= 2.0x AR end to end on the real pair at 32k, batch 16: not measured yet "
                f"(step `{_step_of(PAIR_SPEED_SPARSE_DRAFT)}`)."]
    c = dict(pair_cases(PAIR_SPEED_SPARSE_DRAFT))["ctx32000/b16"]
    variants = [m for m in ("dustin-kv-streaming", "dustin-kv-verify-set") if m in c]

    def ms(m):
        return _round_ms(c[m])

    best = max(variants, key=lambda m: c[m]["speedup_vs_ar"])
    met = c[best]["speedup_vs_ar"] >= 2.0
    parts = [f"{_pair_label(m).strip('*')} {c[m]['speedup_vs_ar']:.2f}x AR (tau {c[m]['metrics']['tau']:.2f}, "
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
    if not (RESULTS / PAIR_SPEED_SPARSE_DRAFT_16K).exists():
        return [f"The sparse-draft variants at 16k, batch 16 on the real pair: not measured yet (step "
                f"`{_step_of(PAIR_SPEED_SPARSE_DRAFT_16K)}`)."]
    data = load(PAIR_SPEED_SPARSE_DRAFT_16K)
    c = data["cases"]["ctx16000/b16"]
    variants = [m for m in ("dustin-kv-streaming", "dustin-kv-verify-set", "dustin") if m in c]
    best = max((m for m in variants if m != "dustin"), key=lambda m: c[m]["speedup_vs_ar"])
    bandwidth = data["cases"]["copy_bandwidth"]["bandwidth_Bps"]

    def ar_ms(case):
        return 1e3 * case["batch"] / case["ar"]["tok_s_mean"]

    parts = [f"{_pair_label(m).strip('*')} {c[m]['speedup_vs_ar']:.2f}x AR (tau {c[m]['metrics']['tau']:.2f}, "
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
        return _pair_label(m).strip("*")

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
        r, new = c["sd"], load(s)["config"]["max_new_tokens"]
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
        cfg = load(s)["models"]["draft"]["config"]
        item = {"bfloat16": 2, "float16": 2, "float32": 4}[cfg["dtype"]]
        gamma = load(s)["config"]["gamma"]
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


DUSTIN_SPEED_PAIR_TAU_PLOT = DUSTIN_SPEED_PAIR_TAU.replace(".json", ".png")


@_plot(DUSTIN_SPEED_PAIR_TAU_PLOT)
def dustin_speed_pair_tau_plot(fig_path) -> None:
    """Speed-up vs AR against the context on the 7B/0.5B shapes at batch 16, each method at its own real-pair tau;
    the bytes roofline dashed; the sparse draft KV from its own run (stars)."""
    plt = _pyplot()
    cases = {k: c for k, c in load(DUSTIN_SPEED_PAIR_TAU)["cases"].items() if k != "copy_bandwidth"}
    fig, ax = plt.subplots(figsize=(9.6, 4.2))
    for i, (method, label) in enumerate((("classic", "ClassicSD"), ("magicdec", "MagicDec"), ("dustin", "Dustin-H"))):
        rows = sorted((r for c in cases.values() for r in c["rows"] if r["method"] == method), key=lambda r: r["context"])
        xs = [r["context"] / 1024 for r in rows]
        ax.plot(xs, [r["speedup"] for r in rows], "o-", color=f"C{i}", label=label)
        ax.plot(xs, [r["roofline_speedup"] for r in rows], "--", color=f"C{i}", alpha=0.5)
    sparse_cases = [c for k, c in load(DUSTIN_SPEED_SPARSE)["cases"].items() if k != "copy_bandwidth"]
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
               label=_pair_label(method).strip("*"), color=f"C{i}")
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


def choice_table_block() -> str:
    """The choice table per (context bucket, batch) and method: the speed-up it holds and what it picks."""
    if not (RESULTS / CHOICE_TABLE).exists():
        return "The choice table (docs/methods.md §5.2): not built yet (h200-qwen-pair step choice-table)."
    data = load(CHOICE_TABLE)
    margin, entries = data["margin"], data["entries"]
    labels = dict((m, label.strip("*")) for m, label in PAIR_METHODS)
    methods = [m for m, _ in PAIR_METHODS if any(e["method"] == m for e in entries)]
    cells = {(e["context_bucket"], e["batch"], e["method"]): e for e in entries}
    keys = sorted({(e["context_bucket"], e["batch"]) for e in entries}, key=lambda k: (-k[0], -k[1]))
    lines = ["| context bucket | batch | " + " | ".join(labels[m] for m in methods) + " |",
             "|---|---|" + "---|" * len(methods)]
    picks_ar = []
    for bucket, batch in keys:
        row = []
        for m in methods:
            e = cells.get((bucket, batch, m))
            if e is None:
                row.append("-")
                continue
            ar = e["speedup"] < 1 + margin
            row.append(f"{e['speedup']:.2f}x: {'**AR**' if ar else 'speculate'}"
                       + (f" ({len(e['measured'])} runs)" if len(e.get("measured", [])) > 1 else ""))
        ar_here = [labels[m] for m in methods if (bucket, batch, m) in cells
                   and cells[(bucket, batch, m)]["speedup"] < 1 + margin]
        if ar_here:
            picks_ar.append(f"{bucket // 1024}k/b{batch}: {', '.join(ar_here)}")
        lines.append(f"| {bucket // 1024}k | {batch} | " + " | ".join(row) + " |")
    outcomes = [e for e in entries if any(m.get("outcome") for m in e.get("measured", []))]
    flipped = [e for e in outcomes if e["speedup"] < 1 + margin
               and min(m["speedup"] for m in e["measured"] if not m.get("outcome")) >= 1 + margin]
    text = (f"The choice table (docs/methods.md §5.2; `{CHOICE_TABLE}`, step `choice-table`, no GPU needed): per method "
            "and (context bucket, batch), the lowest whole-run speed-up against the paired AR run among the plain runs "
            "above that measured it"
            + (" and the runs below that decided from the table and speculated (its decisions' outcomes)" if outcomes
               else "")
            + f", and the decision the measured choice takes from it (speculate at >= "
            f"{1 + margin:.2f}x, plain decoding below, no probe; a case the table lacks is probed as before). "
            f"{sum(e['speedup'] < 1 + margin for e in entries)} of {len(entries)} entries pick plain decoding: "
            + "; ".join(picks_ar) + ".")
    if flipped:
        text += (" The outcomes turn " + ", ".join(
            f"{labels[e['method']]} at {e['context_bucket'] // 1024}k/b{e['batch']} (plain runs "
            f"{min(m['speedup'] for m in e['measured'] if not m.get('outcome')):.2f}x, deciding from the table "
            + ", ".join(f"{m['speedup']:.2f}x" for m in e["measured"] if m.get("outcome")) + ")"
            for e in flipped)
            + " to plain decoding; the first runs below decided from the table before these outcomes were in it"
            + ("; the last decided from the table with these outcomes in it."
               if (RESULTS / PAIR_SPEED_CHOICE_TABLE_OUTCOMES).exists()
               else ", and a run deciding from the table as it is now is not measured yet."))
    if (RESULTS / PAIR_SPEED_CHOICE_TABLE).exists():
        text += _choice_runs_text(PAIR_SPEED_CHOICE_TABLE, guarded=False)
    else:
        text += (" Every method deciding from it at 32k, batch 16 and 8 (h200-qwen-pair step "
                 "`ctx32k-b16-b8-choice-table`): not measured yet.")
    if (RESULTS / PAIR_SPEED_CHOICE_TABLE_GUARDED_NO_MARGIN).exists():
        text += _choice_runs_text(PAIR_SPEED_CHOICE_TABLE_GUARDED_NO_MARGIN, guarded=True)
    if (RESULTS / PAIR_SPEED_CHOICE_TABLE_GUARDED).exists():
        text += _choice_runs_text(PAIR_SPEED_CHOICE_TABLE_GUARDED, guarded=True)
    else:
        text += (" The same with the table's speculative decisions tail-checked from their 32nd round on "
                 "(`--arbitrate-table-tail-after 32`, step `ctx32k-b8-b16-choice-table-guarded`): not measured yet.")
    if (RESULTS / PAIR_SPEED_CHOICE_TABLE_OUTCOMES).exists():
        text += _choice_runs_text(PAIR_SPEED_CHOICE_TABLE_OUTCOMES, guarded=True,
                                  title="Deciding from the table with those outcomes, guarded as above")
    else:
        text += (" Every method deciding from the table with those outcomes, guarded as above (step "
                 "`ctx32k-b8-b16-choice-table-outcomes`): not measured yet.")
    if (RESULTS / PAIR_SPEED_CHOICE_TABLE_REPEATS).exists():
        text += _choice_runs_text(PAIR_SPEED_CHOICE_TABLE_REPEATS, guarded=True,
                                  title="The same, each method timed in 3 (AR, method) pairs adjacent in time, the "
                                        "median pair's speed-up")
    else:
        text += (" The same with each method timed in 3 (AR, method) pairs adjacent in time, the median pair's "
                 "speed-up (`--repeats 3`, step `ctx32k-b8-b16-choice-table-outcomes-repeats`): not measured yet.")
    if (RESULTS / PAIR_SPEED_ARBITRATE_REPEATS_H100).exists():
        text += _probed_repeats_text(PAIR_SPEED_ARBITRATE_REPEATS_H100)
    return text + "\n\n" + "\n".join(lines)


def _table_decisions(path: str) -> str:
    """A choice table's entries in words: each method, key, decision and the speed-up it rests on."""
    table, labels = load(path), dict(PAIR_METHODS)
    return "; ".join(f"{labels.get(r['method'], r['method']).strip('*')} at {round(r['context_bucket'] / 1024)}k-"
                     f"bucket/b{r['batch']}: {'speculate' if r['speedup'] >= 1 + table['margin'] else 'AR'} "
                     f"({r['speedup']:.2f}x)" for r in table["entries"])


def _probed_repeats_text(path: str) -> str:
    """The runs of one pair-speed file under the measured choice without a table (each decision from its own probe),
    timed in (AR, method) pairs: each method's median pair, the decision, and, where it chose plain decoding, what
    each part of the run cost against the paired AR run's pace."""
    data = load(path)
    cfg, parts, worst, lost = data["config"], [], None, []
    new_tokens = int(cfg.get("max_new_tokens") or 256)
    for key, case in pair_cases(path):
        where = key[3:].replace("000/", "k/")
        step_s = statistics.median(r["decode_s"] for r in case["ar"]["runs"]) / new_tokens  # one plain step
        for m, label in PAIR_METHODS:
            run = case.get(m)
            if not (isinstance(run, dict) and "speedup_vs_ar" in run):
                continue
            ratios = [p["speedup_vs_ar"] for p in run.get("pairs") or []] or [run["speedup_vs_ar"]]
            metrics = run["metrics"]
            events = metrics["arbitration"]["events"]
            probe = (events[0].get("probe") or {}) if events else {}
            choice = events[0]["choice"] if events else None
            text = (f"{label.strip('*')} at {where} {run['speedup_vs_ar']:.2f}x (probed: "
                    f"{'AR' if choice == 'ar' else 'speculate'}; {len(ratios)} pairs {min(ratios):.2f}-{max(ratios):.2f}x")
            if probe and choice == "ar" and metrics.get("ar_steps"):
                # the batch finishes with its slowest row: the probe's rounds saved new_tokens - ar_steps plain steps
                saved = new_tokens - metrics["ar_steps"]
                spec = probe["speculative_s"] - saved * step_s
                timed = probe["ar_s"] - probe["ar_steps"] * step_s
                rest = (run["timings"]["decode_s"] - probe["speculative_s"] - probe["ar_s"]
                        - (metrics["ar_steps"] - probe["ar_steps"]) * step_s)
                lost.append((spec, timed, rest, run["timings"]["decode_s"]))
                text += (f"; its {probe['rounds']} probe rounds took {1000 * probe['speculative_s']:.0f} ms and moved "
                         f"the slowest row {saved} tokens on, {1000 * spec:+.0f} ms against {saved} plain steps; its "
                         f"{probe['ar_steps']} AR steps timed one by one {1000 * timed:+.0f} ms; the other "
                         f"{metrics['ar_steps'] - probe['ar_steps']} plain steps {1000 * rest:+.0f} ms")
            parts.append(text + ")")
            worst = run["speedup_vs_ar"] if worst is None else min(worst, run["speedup_vs_ar"])
    if not parts:
        return ""
    text = (f" On an H100 without a choice table (`{path}`, `--arbitrate {cfg.get('arbitrate')} --arbitrate-tail "
            f"{cfg.get('arbitrate_tail')} --repeats {cfg.get('repeats')}`, suite h100-long-context step "
            f"`pair-ctx32k-b8-arbitrate-repeats`; each method decides from its own probe; against the paired AR "
            f"runs' median pace): " + "; ".join(parts)
            + f". Never slower than AR: **{'met' if worst >= 1 else 'missed'}**"
            + (f" (lowest {worst:.2f}x)." if worst >= 1 else f", by up to {100 * (1 - worst):.0f} %."))
    if lost:
        spec_share = [x[0] / sum(x[:3]) for x in lost]
        text += (" Where the probe picks plain decoding the run pays for the probe, mostly its speculative rounds "
                 f"({100 * min(spec_share):.0f}-{100 * max(spec_share):.0f} % of the loss): the batch finishes with its "
                 "slowest row, and the rounds moved that row little further than as many plain steps would.")
    if (RESULTS / CHOICE_TABLE_H100).exists():
        text += (f" This GPU's choice table, built from that run (`{CHOICE_TABLE_H100}`, `choice-table --probed`, step "
                 "`choice-table`, no GPU needed: each method's whole-run speed-up with its probe), decides "
                 + _table_decisions(CHOICE_TABLE_H100) + ", with no probe.")
        if (RESULTS / PAIR_SPEED_CHOICE_TABLE_REPEATS_H100).exists():
            text += _choice_runs_text(PAIR_SPEED_CHOICE_TABLE_REPEATS_H100, guarded=True,
                                      title="On the H100 deciding from it, 3 (AR, method) pairs each")
        else:
            text += (" The same run deciding from it (step `pair-ctx32k-b8-choice-table-repeats`): not measured "
                     "yet.")
    if (RESULTS / CHOICE_TABLE_H100_B16).exists():
        text += (f" With the H100's batch-16 plain run and that run's outcomes in it (`{CHOICE_TABLE_H100_B16}`, step "
                 "`choice-table-b8-16`) the table decides " + _table_decisions(CHOICE_TABLE_H100_B16) + ".")
        if (RESULTS / PAIR_SPEED_CHOICE_TABLE_B16_REPEATS_H100).exists():
            text += _choice_runs_text(PAIR_SPEED_CHOICE_TABLE_B16_REPEATS_H100, guarded=True,
                                      title="On the H100 at batch 16 deciding from it, 3 (AR, method) pairs each")
        else:
            text += (" The 32k/b16 run deciding from it (step `pair-ctx32k-b16-choice-table-repeats`): not "
                     "measured yet.")
    if (RESULTS / CHOICE_TABLE_H100_16K).exists():
        text += (f" With the H100's 16k/b16 plain run and the 32k/b16 outcomes added (`{CHOICE_TABLE_H100_16K}`, step "
                 "`choice-table-16k-32k`) it decides " + _table_decisions(CHOICE_TABLE_H100_16K)
                 + "; no run has decided from it yet.")
    return text


def _choice_runs_text(path: str, guarded: bool, title: str = "") -> str:
    """The runs of one pair-speed file whose methods decided from the choice table: each speed-up, how it was
    decided, and what the tail check did."""
    runs, overruled, table_spec, plain_runs, stragglers, run_plain, run_where = [], [], 0, [], [], [], []
    data = load(path)
    cfg, labels_of = data["config"], dict(PAIR_METHODS)
    after = cfg.get("arbitrate_table_tail_after")
    missing = [f"{labels_of.get(m, m).strip('*')} at {round(int(c) / 1000)}k/b{b}"
               for c in str(cfg["contexts"]).split(",") for b in str(cfg["batches"]).split(",")
               for m in str(cfg["methods"]).split(",")
               if "speedup_vs_ar" not in (data["cases"].get(f"ctx{c}/b{b}", {}).get(m) or {})]
    for key, case in data["cases"].items():
        if not key.startswith("ctx"):
            continue
        for m, label in PAIR_METHODS:
            if not (isinstance(case.get(m), dict) and "speedup_vs_ar" in case[m]):
                continue
            metrics = case[m]["metrics"]
            where = key[3:].replace("000/", "k/")
            plain = bool(metrics.get("rounds") == 0 and metrics.get("ar_steps"))
            if plain:
                plain_runs.append((case[m]["speedup_vs_ar"], label.strip("*"), metrics["ar_steps"]))
            events = metrics["arbitration"]["events"]
            first = events[0] if events else {}
            tail = [e for e in events if e.get("reason") == "tail"]
            how = (f"table {first['table_speedup']:.2f}x: {'speculate' if first['choice'] == 'speculative' else 'AR'}"
                   if first.get("reason") == "table" else f"probed: {first.get('choice')}")
            if first.get("reason") == "table" and first["choice"] == "speculative":
                table_spec += 1
                rows = [r for r in metrics.get("rounds_per_row") or [] if r]
                if case[m]["speedup_vs_ar"] < 1 and rows and metrics.get("tau") and not tail:
                    stragglers.append(f"{label.strip('*')} at {where}: slowest row {max(rows)} rounds against a "
                                      f"mean row's {255 / metrics['tau']:.0f}")
            if tail:
                overruled.append((tail[0]["speculative_finish_s"] / tail[0]["plain_finish_s"],
                                  first.get("table_speedup"), case[m]["speedup_vs_ar"], label.strip("*"), where))
                how += f"; the tail check switched to AR after {tail[0]['after_rounds']} rounds"
            pairs = case[m].get("pairs") or []
            if pairs:  # --repeats: the median pair, the pairs' range and the decisions they took
                ratios = [p["speedup_vs_ar"] for p in pairs]
                choices = sorted({p.get("choice") for p in pairs if p.get("choice")})
                how += (f"; median of {len(pairs)} pairs, {min(ratios):.2f}-{max(ratios):.2f}x"
                        + (", the pairs deciding " + " and ".join({"ar": "AR"}.get(c, c) for c in choices)
                           if len(choices) > 1 else "")
                        + (f", {sum(p.get('same_tokens') is False for p in pairs)} of them decoding other tokens "
                           "than the first" if any(p.get("same_tokens") is False for p in pairs) else ""))
            runs.append((case[m]["speedup_vs_ar"], f"{label.strip('*')} at {where} "
                         f"{case[m]['speedup_vs_ar']:.2f}x ({how})"))
            run_plain.append(plain)
            run_where.append(where)
    if not runs:
        return ""
    worst = min(r[0] for r in runs)
    rule = (f"tail check every {cfg.get('arbitrate_tail')} rounds"
            + (f", the table's decisions checked from round {after} on" if after else
               ", on probed decisions only: the table's decisions stand"))
    # the guard's margin as its runs recorded it (runs from before the margin existed record none: 0)
    tail_margin = next((r["metrics"]["arbitration"].get("table_tail_margin", 0.0)
                        for case in data["cases"].values() if isinstance(case, dict) for r in case.values()
                        if isinstance(r, dict) and "arbitration" in (r.get("metrics") or {})), 0.0)
    if after:
        rule += (f", switching only where plain decoding finishes at least {100 * tail_margin:.0f} % sooner"
                 if tail_margin else ", switching at any gain")
    title = title or ("With the guard" if guarded else "Every method deciding from it")
    text = (f" {title} (`{path}`, {rule}): "
            + "; ".join(r[1] for r in runs) + f". Never slower than AR: **{'met' if worst >= 1 else 'missed'}**"
            + (f" (lowest {worst:.2f}x)." if worst >= 1 else f", by up to {100 * (1 - worst):.0f} %."))
    speculated = [r[0] for r, plain in zip(runs, run_plain) if not plain]
    if worst < 1 and plain_runs and all(plain for r, plain in zip(runs, run_plain) if r[0] < 1):
        text += (" Every run below 1.00x is one the table sent to plain decoding"
                 + (f"; the runs that speculated measured {min(speculated):.2f}-{max(speculated):.2f}x."
                    if speculated else "."))
    if stragglers:
        text += (" Below AR on a speculative table decision: " + "; ".join(stragglers) + " (the batch waits for its "
                 "slowest row).")
    if plain_runs:
        text += (f" The runs the table sent to plain decoding ({', '.join(sorted(set(p[1] for p in plain_runs)))}"
                 f") decoded " + "-".join(sorted({str(p[2]) for p in plain_runs}, key=int)) + " plain steps and "
                 f"no draft round, the same work as the paired AR run, and measured "
                 f"{min(p[0] for p in plain_runs):.2f}-{max(p[0] for p in plain_runs):.2f}x it: below 1.00x "
                 "there is the spread of two timings of identical plain decoding, not a decision.")
        spreads = [(key[3:].replace("000/", "k/"), [r["tok_s"] for r in case["ar"]["runs"]])
                   for key, case in data["cases"].items()
                   if key.startswith("ctx") and len((case.get("ar") or {}).get("runs") or []) >= 2]
        if spreads:
            text += (" The paired AR runs themselves (one before each "
                     + ("timed run" if any(r.get("repeat") for case in data["cases"].values() if isinstance(case, dict)
                                           for r in (case.get("ar") or {}).get("runs") or []) else "method")
                     + ", the same plain decoding) spread "
                     + ", ".join(f"{100 * (max(r) / min(r) - 1):.1f} % at {where} ({len(r)} runs, "
                                 f"{min(r):.0f}-{max(r):.0f} tokens/s)" for where, r in spreads) + ".")
            # the same target read against that spread: a run counts as slower than AR only where it is below
            # the slowest-over-fastest ratio of the paired AR runs at its own point
            floor = {where: min(r) / max(r) for where, r in spreads}
            below = [(r[0], w) for r, w in zip(runs, run_where) if w in floor and r[0] < floor[w]]
            if worst < 1 and len(floor) == len({w for w in run_where}):
                text += (" Read against that spread (a run is slower than AR only below its point's slowest "
                         "over fastest paired AR run): never slower than AR "
                         + ("**met**." if not below else
                            f"**missed** ({', '.join(f'{x:.2f}x at {w}' for x, w in below)})."))
    if missing:
        text += (" Not measured yet (the step's GPU time ran out; it resumes at the next method): "
                 + ", ".join(missing) + ".")
    if overruled:
        paces = [o[0] for o in overruled]
        text += (f" The tail check switched {len(overruled)} of the {table_spec} speculative table decisions to plain "
                 f"decoding, its estimate putting the batch's finish {min(paces):.1f}-{max(paces):.1f}x later than "
                 f"plain decoding's; those runs ended at {min(o[2] for o in overruled):.2f}-"
                 f"{max(o[2] for o in overruled):.2f}x AR.")
        if guarded and not tail_margin:
            stand = [o for o in overruled if 1 - 1 / o[0] >= TABLE_TAIL_MARGIN]
            text += (f" This run switched at any gain; the guard now switches a table's decision only where plain "
                     f"decoding finishes at least {100 * TABLE_TAIL_MARGIN:.0f} % sooner (docs/methods.md §5.2), "
                     f"which keeps {len(stand)} of these {len(overruled)} switches ("
                     + "; ".join(f"{o[3]} at {o[4]}: plain {100 * (1 - 1 / o[0]):.1f} % sooner" for o in overruled)
                     + ")" + ("; the run under that margin follows." if path != PAIR_SPEED_CHOICE_TABLE_GUARDED
                              and (RESULTS / PAIR_SPEED_CHOICE_TABLE_GUARDED).exists()
                              else "; that rule is not measured on the GPU yet."))
    return text


def _pair_intro() -> str:
    cfg = load(PAIR_SPEED[0])["config"]
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


def results_markdown() -> str:
    dec = "ar/decode/qwen2.5-7b-shape/ctx32768/b16"
    ker7 = "kernels/variants/qwen2.5-7b/ctx32768/b16/k512"
    ds = "dustin/speed/qwen2.5-7b-shape/ctx32768/b16"
    q16 = "dustin/quality/qwen2.5-coder-1.5b/ctx16384"
    k8 = "knapspec/speed/qwen2.5-7b-shape/ctx8192/b1/h200"
    kc = "knapspec/speed/smollm2-135m/ctx1024/b1/cpu"
    clasp, official = knapspec_comparison("clasp"), knapspec_comparison("knapspec-official")
    kernel_bytes = _pick(kernel_cases()[("qwen2.5-7b", 32768, 16)], "ours_dense")["GB"] / \
        _pick(kernel_cases()[("qwen2.5-7b", 32768, 16)], "ours_sparse", 512)["GB"]
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
                ("ar/",), [decode_table()],
                [f"The 7B shape reaches {v(dec + '/fraction-of-floor')} of its floor at 32k with XLA attention "
                 "(einsum + masked softmax over the whole cache buffer, float32 scores). The gap is the attention: in "
                 "the kernel sweep below XLA's dense decode attention reads the cache at "
                 f"{_pick(kernel_cases()[('qwen2.5-7b', 32768, 16)], 'xla_dense')['TBps']:.2f} TB/s at 32k/b16, "
                 f"against {v('kernels/dense-attention/qwen2.5-7b/ctx32768/b16/bandwidth')} for the Pallas kernel. "
                 "SmolLM2 (0.27 GB of weights) is launch-bound: ~30 layers × a dozen small kernels a step."]),
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
                 device_time_note()],
                extra_sources=[KERNEL_FILES[1]]),
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
                + ", ".join(f"{len({c['task'] for c in load(src)['cases'].values() if 'task' in c})} ({m}, "
                            f"{_m_run_label(src)})" for m, src in INPUT_AWARE_M)
                + " seeded evaluation-split item(s), means over items. The gap closed is (ARR of the rule − ARR "
                "of fixed m) / (ARR of the oracle − ARR of fixed m). Selection time: the selection alone on the "
                "same signals (the signals cost the same for every rule), best of 3 calls, mean over rounds; "
                "\"-\" where the profile's m is k − s − w (Dustin-D: one signal, no split to choose, both rules "
                "select as fixed m).",
                ("dustin/input-aware-m/",),
                [block for m, src in INPUT_AWARE_M
                 for block in (f"{m} + {INPUT_AWARE_M_DRAFT[m]}, {_m_run_label(src)} (`{src}`):\n\n"
                               + m_rule_table(src),
                               f"![input-aware m, {m}](../experiments/results/{src.replace('.json', '.png')})")]
                + m_per_length_blocks() + selection_cost_tables() + m_bounds_blocks(),
                [f"{m}, {_m_run_label(src)}: {line}" for m, src in INPUT_AWARE_M for line in m_rule_verdicts(src)]
                + m_per_length_verdicts() + selection_cost_verdicts()
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
                 f"({load(DUSTIN_SMOLLM2_TAU)['acceptance']['tau']:.2f}) the same code measured "
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
                 f"{read_path(load(DUSTIN_SPEED_SPARSE), _dustin(32768, 16, 'dustin', 'speedup')):.2f}x, MagicDec "
                 f"{read_path(load(DUSTIN_SPEED_SPARSE), _dustin(32768, 16, 'magicdec', 'speedup')):.2f}x in the "
                 "same run); >= 2.0x at 16k/b16 **met — "
                 f"{v('dustin-speed/7b-shape/ctx16384/b16/dustin-kv-streaming/speedup')}** (verify-set "
                 f"{v('dustin-speed/7b-shape/ctx16384/b16/dustin-kv-verify-set/speedup')}); at 8k "
                 f"{v('dustin-speed/7b-shape/ctx8192/b16/dustin-kv-streaming/speedup')}. Their bytes roofline at "
                 "32k is "
                 f"{read_path(load(DUSTIN_SPEED_SPARSE), _dustin(32768, 16, 'dustin-kv-streaming', 'roofline_speedup')):.1f}x: "
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
                _pair_intro(),
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
                 + "; ".join(f"{label}: {load(src)['results']['speedup_vs_ar']:.2f}x"
                             + (f" (planning {100 * load(src)['results']['timings']['plan_fraction']:.0f} % of "
                                "decode)" if "plan_fraction" in load(src)["results"]["timings"] else "")
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
                    f"(../experiments/results/{SELFSPEC_PLOT})"] if _selfspec_series() else []),
                 *([f"Fixed candidate plans, predicted against measured speed-up, each priced as the planner prices "
                    f"it (`{KNAPSPEC_TPT_CORRELATION}`, middle panel):\n\n![KnapSpec TPT correlation on the CPU]"
                    f"(../experiments/results/{KNAPSPEC_TPT_CORRELATION[:-len('.json')]}.png)"]
                   if (RESULTS / KNAPSPEC_TPT_CORRELATION).exists() else []),
                 *([f"The same with the DP's acceptance against the target's K/V (`{KNAPSPEC_TPT_CORRELATION_TARGET}`):"
                    f"\n\n![KnapSpec TPT correlation on the CPU, target reference]"
                    f"(../experiments/results/{KNAPSPEC_TPT_CORRELATION_TARGET[:-len('.json')]}.png)"]
                   if (RESULTS / KNAPSPEC_TPT_CORRELATION_TARGET).exists() else [])],
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


def m_rule_table(source: str) -> str:
    """Fixed m, max-mass, coverage and the oracle per k: ARR, gap closed, agreement, accuracy, selection time."""
    cases = load(source)["cases"]
    rows = m_rule_rows(cases)

    def f3(x):
        return "-" if x is None else f"{x:.4f}"

    def f2(x):
        return "-" if x is None else f"{x:.2f}"

    def pct(x):
        return "-" if x is None else f"{100 * x:.0f} %"

    def ms(x):
        return "-" if x is None else f"{1e3 * x:.3f}"

    rules = [(t, name) for _, t, name in M_RULES if any(r[f"arr_{t}"] is not None for r in rows)]  # in this file
    names = " / ".join(name for _, name in rules)
    tags = ("fixed",) + tuple(t for t, _ in rules) + ("oracle",)
    lines = [f"| k | ARR fixed / {names} / oracle | gap closed {names} | token match vs dense fixed / {names} / oracle "
             f"| accuracy fixed / {names} / oracle | selection ms per round fixed / {names} | mean m per round "
             f"fixed / {names} / oracle |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['k']} | {' / '.join(f3(r[f'arr_{t}']) for t in tags)} "
            f"| {' / '.join(pct(r[f'gap_closed_{t}']) for t, _ in rules)} "
            f"| {' / '.join(f2(r[f'match_{t}']) for t in tags)} "
            f"| {' / '.join(f2(r[f'accuracy_{t}']) for t in tags)} "
            f"| {' / '.join(ms(r[f]) for f in ('selection_s_fixed',) + tuple(f'selection_s_{t}' for t, _ in rules))} "
            f"| {' / '.join('-' if r.get(f) is None else f'{r[f]:.0f}' for f in ('m_fixed',) + tuple(f'mean_m_{t}' for t, _ in rules) + ('mean_m_oracle',))} |")
    return "\n".join(lines)


def m_rule_verdicts(source: str) -> List[str]:
    """The targets of the input-aware m against the measured rows (computed, not written by hand)."""
    rows = m_rule_rows(load(source)["cases"])
    out = []
    for _, tag, name in M_RULES:
        if all(r[f"arr_{tag}"] is None for r in rows):  # the rule was not run in this file
            continue
        worse = [r["k"] for r in rows if r[f"arr_{tag}"] is not None and r[f"arr_{tag}"] < r["arr_fixed"] - 1e-9]
        in_force = [r for r in rows if r[f"selection_ratio_{tag}"] is not None]

        def closed(rs):
            values = [r[f"gap_closed_{tag}"] or 0.0 for r in rs if r["arr_oracle"] is not None]
            return sum(values) / len(values) if values else None

        every, forced = closed(rows), closed(in_force)
        ratios = [r[f"selection_ratio_{tag}"] for r in in_force]
        out.append(
            f"{name}: ARR at least fixed m's at every k: **{'met' if not worse else 'missed'}**"
            + (f" (below at k = {', '.join(map(str, worse))})" if worse else "")
            + "; share of the fixed-to-oracle ARR gap closed, mean over all k: "
            + ("-" if every is None else f"{100 * every:.0f} %")
            + f" (target >= 33 %: **{'met' if every is not None and every >= 1 / 3 else 'missed'}**), over the k where "
            + f"the rule is in force (k = {', '.join(str(r['k']) for r in in_force) or 'none'}): "
            + ("-" if forced is None else f"{100 * forced:.0f} %")
            + "; selection time per round / fixed m's there: "
            + (", ".join(f"{x:.2f}x" for x in ratios) or "-")
            + f" (target <= 1.1x: **{'met' if ratios and max(ratios) <= 1.1 else 'missed'}**).")
    return out


M_PER_LENGTH_TAGS = (("coverage", "the coverage rule around the single m"),
                     ("length", "the length's m"), ("length_coverage", "the coverage rule around the length's m"))


def _or_dash(x: Optional[float], spec: str, scale: float = 1.0, suffix: str = "") -> str:
    """``x`` (times ``scale``) formatted by ``spec`` with ``suffix``; "-" for a value not measured."""
    return "-" if x is None else f"{scale * x:{spec}}{suffix}"


def m_per_length_blocks() -> List[str]:
    """The recalibrated m per context length and the online run deciding with it, beside the single m's run."""
    out, told = [], set()
    f4, f2, pct = (functools.partial(_or_dash, spec=spec, scale=scale, suffix=suffix)
                   for spec, scale, suffix in ((".4f", 1, ""), (".2f", 1, ""), ("+.0f", 100, " %")))
    for model, source, base, recal in INPUT_AWARE_M_PER_LENGTH:
        rows = m_per_length_rows(source, base)
        tags = ("fixed", "coverage", "length", "length_coverage", "oracle")
        lines = ["| k | m: single / length's / coverage around it (mean) | ARR single m / coverage / length's m / "
                 "coverage around it / oracle | gap closed: coverage / length's m / coverage around it | token match "
                 "vs dense (same order) | accuracy (same order) | selection time / fixed's: coverage around the "
                 "single m / around the length's m |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(
                f"| {r['k']} | {r['m_fixed']:.0f} / {r['m_length']:.0f} / "
                f"{'-' if r['mean_m_length_coverage'] is None else format(r['mean_m_length_coverage'], '.0f')} "
                f"| {' / '.join(f4(r[f'arr_{t}']) for t in tags)} "
                f"| {' / '.join(pct(r[f'gap_closed_{t}']) for t, _ in M_PER_LENGTH_TAGS)} "
                f"| {' / '.join(f2(r[f'match_{t}']) for t in tags)} "
                f"| {' / '.join(f2(r[f'accuracy_{t}']) for t in tags)} "
                f"| {f2(r['selection_ratio_coverage'])}x / {f2(r['selection_ratio_length_coverage'])}x |")
        text = (f"{model}, the profile's m per context length online ({_m_run_label(source)}, `{source}`, "
                f"`--dustin-m-per-length`), scored against the single-m run on the same items (`{base}`: its fixed m, "
                f"the coverage rule around it and the per-round oracle; an item counts where both runs decoded it "
                f"densely to the same tokens"
                + (f": {rows[0]['items']} do, {rows[0]['items_differing']} differ and are left out" if rows and
                   rows[0]["items_differing"] else ": every item does") + "). ")
        if (RESULTS / recal).is_file() and recal not in told:  # the recalibration, once
            told.add(recal)
            res = load(recal)["results"]
            by_k: Dict[int, List[dict]] = {}
            for x in res["rows"]:
                by_k.setdefault(x["k"], []).append(x)
            table = res["m_by_length"]
            text += (f"The lengths' m were recalibrated on calibration tasks of the evaluation's three kinds "
                     f"(`{recal}`, `dustin-profile --extend --recalibrate-m` at "
                     f"{', '.join(_tokens_k(int(n)) for n in str(load(recal)['config']['lengths']).split(','))}; docs/methods.md §3.7): m per length, k: " + "; ".join(
                         f"{k}: " + ", ".join(f"{_tokens_k(int(n))} {m}"
                                              for n, m in sorted(table[str(k)].items(), key=lambda x: int(x[0])))
                         for k in sorted(by_k)) + " (2k: the profile's own m); on the calibration rounds the "
                     "length's m gains over the profile's m, ARR: " + "; ".join(
                         f"k = {k}: " + ", ".join(f"{_tokens_k(x['context'])} {x['arr'] - x['arr_at_profile_m']:+.4f}"
                                                  for x in by_k[k]) for k in sorted(by_k)) + ". ")
        out.append(text + "\n\n" + "\n".join(lines)
                   + f"\n\n![the m per context length](../experiments/results/{source.replace('.json', '.png')})")
    return out


def m_per_length_verdicts() -> List[str]:
    out = []
    for model, source, base, _ in INPUT_AWARE_M_PER_LENGTH:
        rows = m_per_length_rows(source, base)

        def mean(field):
            vals = [r[field] for r in rows if r[field] is not None]
            return sum(vals) / len(vals) if vals else None

        parts = []
        for tag, label in M_PER_LENGTH_TAGS:
            worse = [r["k"] for r in rows if r[f"arr_{tag}"] is not None and r[f"arr_{tag}"] < r["arr_fixed"] - 1e-9]
            closed = mean(f"gap_closed_{tag}")
            parts.append(f"{label}: at least the single m's ARR at every k **{'met' if not worse else 'missed'}**"
                         + (f" (below at k = {', '.join(map(str, worse))})" if worse else "")
                         + ", gap closed " + ("-" if closed is None else f"{100 * closed:.0f} %") + " on average "
                         + f"(target >= 33 %: **{'met' if closed is not None and closed >= 1 / 3 else 'missed'}**)")
        ratios = [r["selection_ratio_length_coverage"] for r in rows if r["selection_ratio_length_coverage"]]
        out.append(f"{model}, {_m_run_label(source)}, the profile's m per context length online: " + "; ".join(parts)
                   + "; selection time of the coverage rule around the length's m / fixed m's: "
                   + (", ".join(f"{x:.2f}x" for x in ratios) or "-")
                   + f" (target <= 1.1x: **{'met' if ratios and max(ratios) <= 1.1 else 'missed'}**). "
                   + f"{rows[0]['items'] if rows else 0} items: the gap to the oracle is "
                   + ", ".join(f"{r['arr_oracle'] - r['arr_fixed']:.4f}" for r in rows) + " ARR (k = "
                   + ", ".join(str(r["k"]) for r in rows) + "), so one item moves these shares by tens of points.")
    return out


# ---------------------------------------------------------------------------- README block, index
def readme_block() -> str:
    lines = [BEGIN, "", "| figure | value | target / paper | device |", "|---|---|---|---|"]
    for key in README_KEYS:
        fig = BY_KEY[key]
        lines.append(f"| {fig.label} | {fmt(fig.value(), fig.unit)} | {fig.target or '–'} | {device_of(fig.source)} |")
    lines += ["", "All figures, their JSON files and commands: [docs/results.md](docs/results.md) "
                  "(regenerated by `python -m experiments.tables`).", "", END]
    return "\n".join(lines)


def index_json() -> str:
    return json.dumps([fig.entry() for fig in FIGURES], indent=1, ensure_ascii=False) + "\n"


def outputs() -> Dict[pathlib.Path, bytes]:
    """Every generated file and its content (the README only when it has the markers)."""
    out = {RESULTS_MD: results_markdown().encode(), INDEX: index_json().encode()}
    for name in PLOTS:
        out[RESULTS / name] = render_plot(name)
    if README.exists():
        text = readme_with_block(README.read_text())
        if text is not None:
            out[README] = text.encode()
    return out


def readme_with_block(text: str) -> Optional[str]:
    """``text`` with its results block regenerated; ``None`` when it has no begin/end markers."""
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        return None
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + readme_block() + text[stop:]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.tables", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file would change")
    args = parser.parse_args(argv)
    files = outputs()
    if README not in files:
        print(f"note: {README.name} has no {BEGIN} ... {END} markers; its results block was left alone",
              file=sys.stderr)
    stale = [path for path, content in files.items() if not path.exists() or path.read_bytes() != content]
    if args.check:
        for path in stale:
            print(f"out of date: {path.relative_to(REPO)}", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(files[path])
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
