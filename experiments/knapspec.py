"""``python -m experiments.run knapspec``: KnapSpec against AR, CLaSp, a static skip set and its ablations.

For every (task, prompt length, batch) *case* the prompts are prefilled once; every method then
decodes from a copy of that cache, and each method's run is paired with an autoregressive run
decoded just before it in the same process (same cache, same capacity, same load), so the
speed-up compares runs that saw the same machine. Both are greedy and are checked token for
token (``identical_to_ar``). Each method runs twice (a warm-up that compiles, then the timed
run); compile time is reported apart.

Methods (``--methods``):

* ``knapspec`` -- the TPT planner (decoupled sub-layers, gamma* honoured: gamma* = 0 runs plain
  decoding until the next plan);
* ``knapspec-official`` -- the authors' behaviour: always draft up to gamma_max with early exit,
  whatever gamma* (their code ignores the planner's gamma);
* ``knapspec-tpl`` / ``knapspec-coupled`` -- the objective and item ablations;
* ``knapspec-target-ref`` -- KnapSpec whose DP's reference tokens see the target's K/V of the earlier
  tokens (``reference_kv="target"``, docs/methods.md §4.3) instead of the candidate's own;
* ``clasp`` -- whole-layer DP with a fixed skip count, re-optimised every 64 rounds;
* ``static-skip`` -- one skip set chosen offline on calibration text (another book), never changed.

Per case also: the DP's candidate skip sets on the case's own text (reference = the first
generated tokens), ``--candidate-plans`` of them (spread over the skipped weights, plus the
planner's own choice) run as fixed plans (no re-planning) to correlate the predicted TPT and the
DP's acceptance estimate with measured throughput (Pearson) and to set each candidate's acceptance
estimate under both DP references (``alpha_branch``, ``alpha_target``, docs/methods.md §4.3)
against its measured acceptance, and a time split (planning measured; draft / verify / plain-decoding seconds estimated from
per-forward timings times the counted forwards). ``plan_cost`` cases time the planner with and
without the stacked-weights reuse on the same reference window.

Latency model (``--latency-fit``, default ``forward``): fitted on whole forwards of the model as
the engine runs them (:func:`jaxspec.knapspec.latency.profile_latency_forward`), or ``isolated``
(each sub-layer timed alone, the original profile). The profile file name ends in the method;
each case records the model's step / draft / verification times and its decode time for the
counted forwards next to the measured decode (``latency_prediction``).

Real weights (``--model smollm2-135m``, a registry name or a path) summarise a long Austen text
(``summarize``) or continue a short one for many tokens (``long-generation``); random weights
(``--model random:PRESET``, e.g. ``random:qwen2.5-7b-shape``; ``--layers N`` for a tiny copy)
use random prompt tokens: acceptance there means nothing, the latency-driven skip pattern does.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import pathlib
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from experiments import registry
from experiments.common import (DEMO_PROMPT_FILE, REPO, ResultWriter, config_of, load_model_timed, print_table,
                                release_memory)

METHODS = ("knapspec", "clasp", "static-skip", "knapspec-tpl", "knapspec-coupled", "knapspec-official",
           "knapspec-budget", "knapspec-target-ref")
TASKS = ("summarize", "long-generation")
INSTRUCTION = "Summarise the following text in a few paragraphs.\n\n"
#: prompts come from these books (row b uses book b mod 5); calibration from the sixth
PROMPT_BOOKS = ("Pride and Prejudice", "Emma", "Sense and Sensibility", "Mansfield Park", "Northanger Abbey")
CALIBRATION_BOOK = "Persuasion"
#: ``--latency-fit`` default (see jaxspec.knapspec.latency)
DEFAULT_LATENCY_FIT = "forward"


# ---------------------------------------------------------------------------- generate --method knapspec | clasp | static-skip
# ``generate --method knapspec | clasp | static-skip``: layer-skipping self-speculation (docs/methods.md §4).
#
# Each runner takes ``(args, model, prompts, sampling, stops, out)``, fills ``out`` with its own
# fields and returns a SpeculativeResult (``generate`` adds the fields every speculative method
# shares: ``metrics``, ``gamma``, the AR comparison, tokens, text, ``tokens_per_s``, ``timings``).
# Own fields (``out["knapspec"]``): the KnapSpec config, the latency profile used (file, device,
# fit, measured now or loaded), the plan history (round, context length, skipped Attention vs MLP
# sub-layers, gamma* and the gamma used, predicted TPT, alpha, seconds) and the planning time as a
# fraction of the decode time (planning runs inside the timed decode).
SELF_SPEC_METHODS = ("knapspec", "clasp", "static-skip", "knapspec-budget")
#: KnapSpec plans (the draft SRH layers' Attention kept executed) + Dustin verification (docs/methods.md §5.5);
#: reads the self-speculative options and the sparse ones (--budget, --dustin-profile, --dustin-mode, --draft-kv, ...)
KNAPSPEC_DUSTIN = "knapspec-dustin"
DEFAULT_CALIBRATION_FILE = DEMO_PROMPT_FILE
#: ``--latency-fit`` choices: jaxspec.knapspec.latency.FIT_METHODS (kept here so the parser imports no jax; a test
#: holds the two equal)
LATENCY_FITS = ("isolated", "forward", "forward-static", "forward-half", "forward-static-half")
REPROFILE_HELP = ("measure the latency profile again even if a matching one is saved (a saved profile does not "
                  "record which code it timed); the old file is kept, renamed *.replaced-<time>.json. A resumed --out "
                  "still plans its remaining cases with the latency model it saved")


def _token_slope(m) -> str:
    """`` + c0_n * n`` of a half-mask fit's per-token remainder, for the profile's one-line summary."""
    return f" + {m.c0_n * 1e9:.3f} ns * n" if m.c0_n else ""


def _forward_fit_kwargs(fit: str) -> dict:
    """``profile_latency_forward`` options of a ``forward[-static][-half]`` latency fit (those of its profiler)."""
    from jaxspec.knapspec.latency import PROFILERS

    return dict(getattr(PROFILERS[fit], "keywords", {}))


def add_self_spec_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("knapspec / clasp / static-skip (layer-skipping self-speculation)")
    group.add_argument("--latency-profile", default=None, metavar="FILE",
                       help="sub-layer latency profile (JSON); measured now and saved there if missing or made on "
                            "another device/model/batch (default: a file in the jaxspec cache folder)")
    group.add_argument("--latency-fit", default=DEFAULT_LATENCY_FIT, choices=list(LATENCY_FITS),
                       help="latency model: 'forward' = fitted on whole forwards of the model as the engine runs "
                            "them with the dynamic skip mask; 'forward-static' = the same with each mask compiled "
                            "in (for plans compiled for themselves: --knapspec-static-plans, budget plans, the "
                            "static skip set); '-half' = the skip masks skip every second sub-layer of a kind, not "
                            "all (a plan skips about half); "
                            "'isolated' = each sub-layer timed alone (the profile file name holds the method)")
    group.add_argument("--reprofile", action="store_true", help=REPROFILE_HELP)
    group.add_argument("--knapspec-objective", default="tpt", choices=["tpt", "tpl"],
                       help="grid-search objective: tokens per time (KnapSpec) or tokens per layer (ablation)")
    group.add_argument("--knapspec-coupled", action="store_true",
                       help="ablation: skip whole layers (Attention + MLP together) instead of sub-layers")
    group.add_argument("--knapspec-gamma-max", type=int, default=10, help="longest draft (early exit below it)")
    group.add_argument("--knapspec-early-exit", type=float, default=0.7,
                       help="stop drafting once a token's probability is below this (<= 0: never)")
    group.add_argument("--knapspec-interval", type=int, default=64, help="re-plan every this many rounds")
    add_planning_arguments(group.add_argument, "knapspec-")
    group.add_argument("--knapspec-gamma-buckets", default="1,2,3,4,6,8",
                       help="static verification lengths a planned gamma is rounded up to (gamma-max is always "
                            "one); '' = always verify gamma-max + 1 rows (one compile; the GPU choice)")
    group.add_argument("--knapspec-spec-tpt", action="store_true",
                       help="ablation: docs/methods.md §4.2's TPT (every round drafts gamma tokens) instead of the early-exit-aware "
                            "TPT in the grid search")
    group.add_argument("--knapspec-official-gamma", action="store_true",
                       help="as the official code: always draft up to gamma-max with early exit (gamma* is only "
                            "reported; gamma* = 0 does not switch to plain decoding)")
    group.add_argument("--knapspec-attention-budget", type=int, default=256, metavar="K",
                       help="knapspec-budget: history slots of a budgeted Attention sub-layer (sinks + window), the "
                            "third choice of the DP (docs/methods.md §5.4)")
    group.add_argument("--knapspec-attention-sinks", type=int, default=4,
                       help="knapspec-budget: of the budget, the first cache slots (the rest is the recent window)")
    group.add_argument("--knapspec-budget-reference-tokens", type=int, default=64,
                       help="knapspec-budget: the plan's reference = the last this many prompt tokens of each row")
    group.add_argument("--clasp-skip-count", type=int, default=None,
                       help="clasp: whole layers to skip (default by size: 4 ~1B, 8 3-8B, 10 14B, 20 32-70B)")
    group.add_argument("--static-skip-file", default=None, metavar="FILE",
                       help="static-skip: the offline skip set (JSON); calibrated and saved there if missing")
    group.add_argument("--calibration-file", default=str(DEFAULT_CALIBRATION_FILE),
                       help="static-skip: calibration text (its first --calibration-tokens tokens)")
    group.add_argument("--calibration-tokens", type=int, default=512)
    group.add_argument("--calibration-reference-tokens", type=int, default=64,
                       help="static-skip: the DP's reference = the last this many calibration tokens")


#: --[knapspec-]dp-segments' default: jaxspec.knapspec.dp.DEFAULT_SEGMENTS (not imported here: the CLI loads no JAX to
#: parse its flags; tests/experiments/test_knapspec.py holds the two equal)
DP_SEGMENTS = 4
#: --[knapspec-]weight-cap's default: jaxspec.knapspec.dp.WEIGHT_CAP (held equal by the same test)
WEIGHT_CAP = 5


def add_planning_arguments(add, prefix: str = "") -> None:
    """The planning-budget and arbitration flags (``generate --knapspec-*`` and the ``knapspec``
    experiment share them): ``--{prefix}max-plan-fraction``, ``--{prefix}probe-rounds``."""
    add(f"--{prefix}max-plan-fraction", type=float, default=0.05,
        help="planning budget: postpone a re-plan while the previous plan cost more than this fraction of the decode "
             "time since it, and cap the DP's reference (or make no plan) so one plan's predicted cost fits it "
             "(<= 0: the paper's fixed schedule, a plan every interval, no cap)")
    add(f"--{prefix}plan-cost-scale", type=float, default=1.0, metavar="X",
        help="the planning allowance multiplies the latency model's price of a plan by X: measured / predicted plan "
             "time of earlier plans of this model on this device (docs/methods.md §5.6; default 1, the model alone)")
    add(f"--{prefix}probe-rounds", type=int, default=8,
        help="measured arbitration: after a plan that drafts, time this many speculative rounds and as many "
             "plain-decoding steps, keep the faster until the next plan (0: off, as in the paper)")
    add(f"--{prefix}probe-warmup", type=int, default=0, metavar="N",
        help="before each side of that probe, run N rounds (plain steps) untimed, their tokens kept, so the first "
             "call after a switch of plan or mode does not weigh on the few timed ones (docs/methods.md §5.2; "
             "default 0)")
    add(f"--{prefix}probe-pricing", choices=("mean", "two-stretch"), default="mean",
        help="how that probe prices its sides: mean (the speculative call's mean rate against the better of the "
             "measured and modelled plain rates) or two-stretch (each side as two calls, priced by their "
             "difference, no per-call cost on either; docs/methods.md §5.2)")
    add(f"--{prefix}static-plans", action="store_true",
        help="re-planning runs draft each plan with a forward compiled for it (skipped sub-layers removed, no "
             "per-sub-layer conditional; one compile per distinct plan, docs/methods.md §5.3) instead of the "
             "dynamic skip mask")
    add(f"--{prefix}reference-kv", choices=("branch", "target"), default="branch",
        help="how the DP's reference tokens see one another (docs/methods.md §4.3): branch = each candidate runs "
             "the window as one causal sequence through its own K/V (the paper); target = each token attends to "
             "the target's K/V of the earlier tokens and to the candidate's only at its own position (a draft step "
             "after committed tokens). KnapSpec's sub-layer DP; CLaSp and knapspec-budget keep branch")
    add(f"--{prefix}search-tokens", type=int, default=None, metavar="S",
        help="a two-stage plan (docs/methods.md §5.6): the DP searches on the first S reference tokens of each row "
             "and its best candidates are scored again on the whole window (default: the DP on the whole window, "
             "the paper). KnapSpec's sub-layer DP")
    add(f"--{prefix}finalists", type=int, default=4, metavar="K",
        help=f"with --{prefix}search-tokens: candidates scored again on the whole window")
    add(f"--{prefix}plan-rows", type=int, default=None, metavar="N",
        help="plan on the reference windows of N rows of the batch (the most reference tokens first): the DP's "
             "cost grows with its rows and one plan serves the whole batch (default: every row). "
             "docs/methods.md §5.6")
    add(f"--{prefix}reference-floor", type=int, default=None, metavar="R",
        help="the DP's reference window reaches back (earlier committed tokens, then the prompt's last ones) until "
             "each row has at least R tokens; the planning allowance still caps it (default: the tokens committed "
             "in the last 5 rounds, the paper). docs/methods.md §5.6")
    add(f"--{prefix}dp-attention", choices=("xla", "pallas", "pallas-interpret"), default="xla",
        help="the attention of the DP's branches (docs/methods.md §4.3): xla = the vmap-ed reference (default); "
             "pallas = every branch's rows folded into the query rows of the Pallas history kernel, no scores "
             "written (GPU; pallas-interpret anywhere, slow)")
    add(f"--{prefix}dp-segments", type=int, default=DP_SEGMENTS, metavar="K",
        help="the DP's scan in at most K runs of layers, each over the skipped weights its layers can reach (the "
             "same plan, fewer slot-layers, one compiled body a run; 1: one scan of every slot). docs/methods.md §4.3")
    add(f"--{prefix}weight-cap", type=int, default=WEIGHT_CAP, metavar="N",
        help="the heavier sub-layer's knapsack weight is at most N (the lighter's is 1): the DP carries "
             "(w_attn + w_mlp) L / 2 + 1 slot states, so a coarser cap makes it cheaper and its latency weights "
             "coarser (default: the official code's 5; the grid search still prices plans with the latency model). "
             "docs/methods.md §4.3")
    add(f"--{prefix}rescore", choices=("executed", "select"), default="executed",
        help=f"with --{prefix}search-tokens: how the finalists are scored on the whole window: executed = only the "
             "sub-layers each runs after its first skip, behind conditionals (a GPU reads each predicate on the "
             "host; default); select = every sub-layer of every finalist in one batched pass, no control flow. "
             "docs/methods.md §5.6")
    add(f"--{prefix}plan-at-start", action="store_true",
        help=f"with --{prefix}reference-floor R: the first plan runs before the first round, on the prompt's last R "
             "tokens a row, so no round drafts with the full model (default: after round 6, the paper). "
             "docs/methods.md §5.6")
    add(f"--{prefix}plan-after-plain", type=int, default=None, metavar="N",
        help="the first plan runs after N plainly decoded tokens a row, on those tokens alone (the model's own "
             "continuation; no full-model rounds, no prompt tokens in its window unless the reference floor asks "
             "for more). docs/methods.md §5.6")
    add(f"--{prefix}start-states", choices=("prefill", "own"), default="prefill",
        help=f"with --{prefix}plan-at-start or --{prefix}plan-after-plain: the target's states of that first plan's "
             "window are kept by the forward that wrote those tokens, the prefill or the plain stretch (prefill, "
             "default), or computed by the plan (own). docs/methods.md §5.6")


def check_two_stage(search_tokens, finalists, prefix: str = "", reference_floor=None, plan_rows=None,
                    plan_at_start=False, plan_after_plain=None) -> None:
    """``--[knapspec-]search-tokens`` / ``--[knapspec-]finalists`` / ``--[knapspec-]reference-floor`` /
    ``--[knapspec-]plan-rows`` / ``--[knapspec-]plan-at-start`` before any model loads."""
    if plan_at_start and reference_floor is None:
        raise ValueError(f"--{prefix}plan-at-start plans on the prompt's last tokens before any round: give "
                         f"--{prefix}reference-floor R (how many a row's window holds)")
    if plan_rows is not None and plan_rows < 1:
        raise ValueError(f"--{prefix}plan-rows={plan_rows}: must be >= 1 (or left out: every row of the batch)")
    if plan_after_plain is not None and plan_after_plain < 1:
        raise ValueError(f"--{prefix}plan-after-plain={plan_after_plain}: must be >= 1 (plain tokens a row before the "
                         f"first plan)")
    if plan_after_plain is not None and plan_at_start:
        raise ValueError(f"--{prefix}plan-after-plain {plan_after_plain} and --{prefix}plan-at-start both place the "
                         f"first plan: give one")
    if reference_floor is not None and reference_floor < 1:
        raise ValueError(f"--{prefix}reference-floor={reference_floor}: must be >= 1 (or left out: the tokens of the "
                         f"last 5 rounds)")
    if search_tokens is not None and search_tokens < 1:
        raise ValueError(f"--{prefix}search-tokens={search_tokens}: must be >= 1 (or left out: the DP on the "
                         f"whole window)")
    if finalists < 1:
        raise ValueError(f"--{prefix}finalists={finalists}: must be >= 1")


def check_dp_attention(choice: str, reference_kv: str = "branch", branch_chunk=None, prefix: str = "") -> None:
    """``--[knapspec-]dp-attention`` before any model loads: a kernel backend must run here and apply."""
    if choice == "xla":
        return
    from jaxspec.knapspec.dp import check_history_backend

    try:
        check_history_backend(choice, reference_kv, branch_chunk)
    except ValueError as err:
        raise ValueError(f"--{prefix}dp-attention={choice}: {err}") from None


def parse_gamma_buckets(text: str, flag: str = "--knapspec-gamma-buckets"):
    text = (text or "").strip()
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError as err:
        raise ValueError(f"{flag}={text!r}: expected comma-separated integers") from err


def plan_fraction(value, flag: str = "--knapspec-max-plan-fraction"):
    """The planning budget as a fraction of the decode time; None (<= 0) = the fixed schedule."""
    value = None if value is None or value <= 0 else float(value)
    if value is not None and value >= 1:
        raise ValueError(f"{flag}={value}: must be < 1 (or <= 0 for the fixed schedule)")
    return value


def knapspec_config_from_args(args):
    from jaxspec.knapspec.policy import KnapSpecConfig

    early = args.knapspec_early_exit
    return KnapSpecConfig(gamma_max=args.knapspec_gamma_max, early_exit=None if early <= 0 else early,
                          plan_interval=args.knapspec_interval, objective=args.knapspec_objective,
                          coupled=args.knapspec_coupled, honor_gamma=not args.knapspec_official_gamma,
                          gamma_buckets=parse_gamma_buckets(args.knapspec_gamma_buckets),
                          max_plan_fraction=plan_fraction(args.knapspec_max_plan_fraction),
                          plan_cost_scale=getattr(args, "knapspec_plan_cost_scale", 1.0),
                          exit_aware_tpt=not getattr(args, "knapspec_spec_tpt", False),
                          probe_rounds=getattr(args, "knapspec_probe_rounds", 8) or None,
                          probe_warmup=getattr(args, "knapspec_probe_warmup", 0),
                          probe_pricing=getattr(args, "knapspec_probe_pricing", "mean"),
                          reference_kv=getattr(args, "knapspec_reference_kv", "branch"),
                          static_plans=getattr(args, "knapspec_static_plans", False),
                          search_tokens=getattr(args, "knapspec_search_tokens", None),
                          finalists=getattr(args, "knapspec_finalists", 4),
                          reference_floor=getattr(args, "knapspec_reference_floor", None),
                          plan_rows=getattr(args, "knapspec_plan_rows", None),
                          plan_at_start=getattr(args, "knapspec_plan_at_start", False),
                          plan_after_plain=getattr(args, "knapspec_plan_after_plain", None),
                          start_states=getattr(args, "knapspec_start_states", "prefill"),
                          dp_attention=getattr(args, "knapspec_dp_attention", "xla"),
                          rescore=getattr(args, "knapspec_rescore", "executed"),
                          dp_segments=getattr(args, "knapspec_dp_segments", DP_SEGMENTS),
                          weight_cap=getattr(args, "knapspec_weight_cap", WEIGHT_CAP))


def validate_self_spec(args) -> None:
    """Checks before any model loads (``generate --method knapspec | clasp | static-skip``)."""
    if getattr(args, "mesh", None):
        raise ValueError(f"--method {args.method} runs on one device; drop --mesh")
    if args.knapspec_interval < 6:
        raise ValueError(f"--knapspec-interval={args.knapspec_interval} must be >= 6 (the DP runs at round 6)")
    if getattr(args, "knapspec_dp_segments", DP_SEGMENTS) < 1:
        raise ValueError(f"--knapspec-dp-segments={args.knapspec_dp_segments}: must be >= 1 (1: one scan of every "
                         f"slot)")
    if getattr(args, "knapspec_weight_cap", WEIGHT_CAP) < 1:
        raise ValueError(f"--knapspec-weight-cap={args.knapspec_weight_cap}: must be >= 1 (the official code's "
                         f"{WEIGHT_CAP})")
    check_two_stage(getattr(args, "knapspec_search_tokens", None), getattr(args, "knapspec_finalists", 4), "knapspec-",
                    getattr(args, "knapspec_reference_floor", None), getattr(args, "knapspec_plan_rows", None),
                    getattr(args, "knapspec_plan_at_start", False), getattr(args, "knapspec_plan_after_plain", None))
    check_dp_attention(getattr(args, "knapspec_dp_attention", "xla"), getattr(args, "knapspec_reference_kv", "branch"),
                       prefix="knapspec-")
    if args.knapspec_gamma_max < 1:
        raise ValueError(f"--knapspec-gamma-max={args.knapspec_gamma_max}: must be >= 1")
    default_gamma_max = registry.family_defaults("self-speculative")["knapspec_gamma_max"]
    if args.knapspec_gamma_max != default_gamma_max and args.knapspec_gamma_max > args.max_new_tokens:
        raise ValueError(f"--knapspec-gamma-max={args.knapspec_gamma_max} exceeds --max-new-tokens="
                         f"{args.max_new_tokens}; use a value <= {args.max_new_tokens}")
    if args.clasp_skip_count is not None and args.clasp_skip_count < 1:
        raise ValueError(f"--clasp-skip-count={args.clasp_skip_count}: must be >= 1")
    if args.calibration_tokens < 2 or not 1 <= args.calibration_reference_tokens < args.calibration_tokens:
        raise ValueError(f"--calibration-tokens={args.calibration_tokens} / --calibration-reference-tokens="
                         f"{args.calibration_reference_tokens}: need 1 <= reference < calibration tokens")
    if args.method == "knapspec-budget":
        sinks, budget = args.knapspec_attention_sinks, args.knapspec_attention_budget
        if sinks < 0 or budget <= sinks:
            raise ValueError(f"--knapspec-attention-budget={budget} / --knapspec-attention-sinks={sinks}: need "
                             f"0 <= sinks < budget (the window is budget - sinks >= 1)")
        if args.knapspec_budget_reference_tokens < 1:
            raise ValueError(f"--knapspec-budget-reference-tokens={args.knapspec_budget_reference_tokens}: "
                             f"must be >= 1")
    if args.knapspec_reference_kv != "branch" and args.method in ("clasp", "knapspec-budget"):
        raise ValueError(f"--knapspec-reference-kv {args.knapspec_reference_kv}: --method {args.method} runs "
                         f"its own DP with the paper's reference (branch); drop the option")
    knapspec_config_from_args(args)  # validates the knobs


def validate_knapspec_dustin(args) -> None:
    """Checks before any model loads (``generate --method knapspec-dustin``): the KnapSpec knobs, then the
    Dustin ones (budget, profile, draft KV)."""
    from jaxspec.dustin.config import check_budget
    from jaxspec.dustin.search import DustinProfile

    validate_self_spec(args)
    defaults = registry.family_defaults("self-speculative")
    if args.knapspec_static_plans:
        raise ValueError("--knapspec-static-plans compiles KnapSpec's own draft per plan; --method knapspec-dustin "
                         "drafts with the Dustin self-draft (dynamic mask); drop the option")
    if args.knapspec_coupled:
        raise ValueError("--knapspec-coupled skips whole layers; --method knapspec-dustin keeps the SRH layers' "
                         "Attention sub-layers executed, which needs the sub-layer DP")
    if args.knapspec_early_exit != defaults["knapspec_early_exit"]:
        raise ValueError(f"--knapspec-early-exit={args.knapspec_early_exit}: --method knapspec-dustin drafts every "
                         f"token of a round (no early exit); drop the option")
    if args.budget is None:
        raise ValueError("--method knapspec-dustin needs --budget K (one of 128, 256, 512, 1024, 2048)")
    check_budget(args.budget)
    if args.arbitrate is not None:
        raise ValueError(f"--arbitrate={args.arbitrate}: --method knapspec-dustin arbitrates after each plan with "
                         f"--knapspec-probe-rounds; drop --arbitrate")
    if args.draft_window is not None:
        if args.draft_kv == "full":
            raise ValueError(f"--draft-window={args.draft_window} needs --draft-kv streaming or verify-set")
        if args.draft_window < 1:
            raise ValueError(f"--draft-window={args.draft_window} must be >= 1")
    if args.dustin_m_rule != "fixed" and args.dustin_mode != "hybrid":
        raise ValueError(f"--dustin-m-rule {args.dustin_m_rule} chooses Dustin-H's split: it needs --dustin-mode "
                         f"hybrid (got {args.dustin_mode})")
    if args.dustin_profile:
        profile = DustinProfile.load(args.dustin_profile)  # missing / corrupt file: ProfileError (a ValueError)
        profile.config(args.budget, args.dustin_mode)  # budget not profiled: ProfileError naming the profiled ones
        if "self_draft_mask" not in profile.draft:
            raise ValueError(f"{args.dustin_profile} profiles the separate draft {profile.draft.get('name')!r}; "
                             f"--method knapspec-dustin needs a self-draft profile (its SRH layers are target layers)")


def check_clasp_skip_count(count, num_layers: int) -> None:
    """CLaSp skips whole layers: at least one must stay (the count must be < the layer count)."""
    if count is not None and not 1 <= count < num_layers:
        raise ValueError(f"--clasp-skip-count={count}: the model has {num_layers} layers; give 1..{num_layers - 1}")


def default_profile_path(config, batch: int, fit: str = "isolated") -> pathlib.Path:
    """``<cache>/latency/<config>-<digest>-b<batch>-<device>-<fit>.json`` (an isolated profile
    saved before the fit method was in the name is still found)."""
    from jaxspec.knapspec.latency import config_fields, device_name
    from jaxspec.models.registry import cache_dir

    digest = hashlib.sha1(json.dumps(config_fields(config), sort_keys=True).encode()).hexdigest()[:10]
    device = "".join(c if c.isalnum() else "-" for c in device_name())
    stem = f"{config.name}-{digest}-b{batch}-{device}"
    path = cache_dir() / "latency" / f"{stem}-{fit}.json"
    legacy = cache_dir() / "latency" / f"{stem}.json"
    if fit == "isolated" and not path.exists() and legacy.exists():
        return legacy
    return path


def profile_contexts(n_max: int) -> List[int]:
    """Context lengths to profile: six points up to the evaluated context (at least 1024)."""
    top = max(int(n_max), 1024)
    return sorted({int(x) for x in np.linspace(max(64, top // 16), top, 6).round()})


def load_latency(args, config, batch: int, n_max: int, params=None):
    """(LatencyProfile, info): the saved profile if it matches, else measured now (with a message).
    ``args.latency_fit``: ``isolated`` (sub-layers alone) or ``forward`` (whole forwards of
    ``params``, random ones when None)."""
    from jaxspec.knapspec.latency import (LatencyProfile, device_name, forward_contexts, load_or_profile,
                                          profile_latency, profile_latency_forward)

    fit = getattr(args, "latency_fit", "isolated")
    path = pathlib.Path(args.latency_profile) if args.latency_profile else default_profile_path(config, batch, fit)
    measured = []

    def profile_fn(cfg, b, **kwargs):
        if fit.startswith("forward"):
            contexts = forward_contexts(n_max)
            print(f"profiling whole-forward latency ({fit}) of {cfg.name} on {device_name()} (batch {b}, contexts "
                  f"{contexts}); saving to {path} ...", file=sys.stderr, flush=True)
            profile = profile_latency_forward(cfg, b, contexts, params=params, **_forward_fit_kwargs(fit),
                                              **kwargs)
        else:
            contexts = profile_contexts(n_max)
            print(f"profiling sub-layer latency of {cfg.name} on {device_name()} (batch {b}, contexts {contexts}); "
                  f"saving to {path} ...", file=sys.stderr, flush=True)
            profile = profile_latency(cfg, b, contexts, **kwargs)
        measured.append(True)
        m = profile.model
        print(f"latency profile ({fit}): t_mlp = {m.c1 * 1e6:.1f} us, t_attn(n) = {m.c2 * 1e9:.3f} ns * n + "
              f"{m.c3 * 1e6:.1f} us, t_token = {m.c0 * 1e6:.1f} us{_token_slope(m)}, v = {m.v:.3f}", file=sys.stderr,
              flush=True)
        return profile

    profile: LatencyProfile = load_or_profile(path, config, batch, profile_fn=profile_fn, method=fit,
                                              remeasure=getattr(args, "reprofile", False))
    info = {"path": str(path), "measured_now": bool(measured), "device": profile.device, "batch": profile.batch,
            "contexts": profile.contexts, "fit": profile.model.as_dict(), "method": profile.method}
    return profile, info


def _plan_history(plans: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    keys = ("round", "context_length", "n", "n_skip_attn", "n_skip_mlp", "skip_attn", "skip_mlp", "gamma_star",
            "gamma_used", "mode", "verify_rows", "alpha", "predicted_tpt", "objective", "seconds", "planner",
            "predicted_seconds", "probe")
    return [{k: p.get(k) for k in keys} for p in plans]


def run_self_spec(args, model, prompts, sampling, stops, out):
    """The runner of ``--method knapspec | clasp | static-skip``."""
    from jaxspec.decoding.speculative import EngineConfig
    from jaxspec.knapspec.latency import effective_context
    from jaxspec.knapspec.policy import knapspec_generate
    from jaxspec.models.attention import backend_of

    method = args.method
    config = model.config
    check_clasp_skip_count(args.clasp_skip_count, config.num_layers)  # before any latency profiling
    knapspec = knapspec_config_from_args(args)
    gamma_max = knapspec.gamma_max
    batch = len(prompts)
    lengths = [len(p) for p in prompts]
    capacity = max(lengths) + args.max_new_tokens + gamma_max + 2
    # the context t_attn is evaluated at: the cache capacity for the xla backend (it reads every slot)
    n_max = capacity if backend_of(config).reads_full_capacity else max(lengths) + args.max_new_tokens
    profile, latency_info = load_latency(args, config, batch, n_max, params=model.params)
    latency = profile.model
    engine = EngineConfig(gamma=gamma_max, sampling=sampling, max_new_tokens=args.max_new_tokens,
                          stop_tokens=tuple(stops))
    common = dict(engine=engine, seed=args.seed, warmup=not args.no_warmup, capacity=capacity)
    extra: Dict[str, Any] = {}
    if method == "knapspec":
        result = knapspec_generate(model.params, config, prompts, latency=latency, knapspec=knapspec, **common)
        planner = "knapspec" + ("-coupled" if knapspec.coupled else "") + (
            "" if knapspec.objective == "tpt" else "-" + knapspec.objective)
    elif method == "clasp":
        from jaxspec.baselines.clasp import clasp_generate

        result = clasp_generate(model.params, config, prompts, skip_count=args.clasp_skip_count, knapspec=knapspec,
                                latency=latency, **common)
        planner = "clasp"
        extra["clasp_skip_count"] = result.metrics["clasp_skip_count"]
    elif method == "static-skip":
        from jaxspec.baselines.static_skip import load_or_calibrate, static_skip_generate

        text = pathlib.Path(args.calibration_file).read_text()
        calibration = list(model.tokenizer(text)["input_ids"])[: args.calibration_tokens]
        n = effective_context(config, [max(lengths)], capacity)
        plan, loaded = load_or_calibrate(args.static_skip_file, model.params, config, calibration, latency=latency,
                                         knapspec=knapspec, reference_tokens=args.calibration_reference_tokens,
                                         context_n=n)
        print(f"static skip set ({'loaded from ' + args.static_skip_file if loaded else 'calibrated now'}): "
              f"{plan.summary()}", file=sys.stderr)
        result = static_skip_generate(model.params, config, prompts, plan=plan, knapspec=knapspec, **common)
        planner = "static (" + plan.source.get("planner", "?") + ", offline)"
        extra["static_skip"] = dict(plan.summary(), file=args.static_skip_file, loaded=loaded,
                                    calibration_file=args.calibration_file)
    elif method == "knapspec-budget":
        from jaxspec.knapspec.policy import knapspec_budget_generate

        sinks = args.knapspec_attention_sinks
        result = knapspec_budget_generate(model.params, config, prompts, latency=latency, sinks=sinks,
                                          window=args.knapspec_attention_budget - sinks,
                                          reference_tokens=args.knapspec_budget_reference_tokens, knapspec=knapspec,
                                          engine=engine, seed=args.seed, warmup=not args.no_warmup,
                                          capacity=capacity)
        planner = f"knapspec-budget (K={args.knapspec_attention_budget}, one plan)"
        extra["budget_plan"] = result.metrics["budget_plan"]
        extra["fixed_plan_probe"] = result.metrics.get("fixed_plan_probe")
    elif method == KNAPSPEC_DUSTIN:
        from experiments.dustin_quality import SINKS, dustin_config_for
        from jaxspec.dustin.self_speculative import knapspec_dustin_config, knapspec_dustin_generate

        dustin, info = dustin_config_for(args, config, None, None)  # a self-draft profile, no fixed mask
        knapspec = knapspec_dustin_config(knapspec, dustin, config)  # refuses SRH layers outside the model
        result = knapspec_dustin_generate(model.params, config, prompts, dustin=dustin, latency=latency,
                                          knapspec=knapspec, **common)
        planner = f"knapspec (attention of layers {list(knapspec.keep_attention)} kept) + dustin k={dustin.budget}"
        sparse = {"method": "dustin", "budget": dustin.budget, "sinks": SINKS, "dustin": dustin.to_dict(),
                  "mode": dustin.mode, "m": dustin.effective_m, "draft_kv": dustin.draft_kv, **info}
        out["sparse"] = sparse
        extra["keep_attention"] = list(knapspec.keep_attention)
    else:
        raise ValueError(f"unknown self-speculative method {method!r}")
    timings = result.timings
    allowance = result.metrics.get("plan_allowance")
    if allowance and allowance.get("skip"):
        a = allowance
        print(f"{method}: no plan -- one DP is predicted at {a['predicted_dp_s_per_token']:.3g} s per reference "
              f"token, the planning budget is {a['plan_budget_s']:.3g} s ({knapspec.allowance_margin:g} x "
              f"{knapspec.max_plan_fraction:g} of the predicted {a['predicted_ar_decode_s']:.3g} s decode): "
              f"{a['allowed_tokens']} tokens < min_reference_tokens {knapspec.min_reference_tokens}, decoded "
              f"plainly (--knapspec-max-plan-fraction 0 plans anyway)", file=sys.stderr)
    out["gamma"] = gamma_max
    out["knapspec"] = {
        "method": method, "planner": planner, "config": dataclasses.asdict(knapspec), "latency_profile": latency_info,
        "plan_history": _plan_history(result.metrics["knapspec_plans"]),
        "plan_s": timings.get("plan_s", 0.0), "plan_fraction_of_decode": timings.get("plan_fraction", 0.0),
        "ar_steps": result.metrics["ar_steps"], "ar_tokens": result.metrics["ar_tokens"],
        "draft_steps": result.metrics["draft_steps"], "plan_allowance": allowance, **extra}
    return result


def plan_table_rows(out: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [{"round": p["round"], "context": p["context_length"], "skip_attn": p["n_skip_attn"],
             "skip_mlp": p["n_skip_mlp"], "gamma*": p["gamma_star"], "gamma": p["gamma_used"],
             "pred_TPT": p["predicted_tpt"], "alpha": p["alpha"], "plan_s": p["seconds"]}
            for p in out["knapspec"]["plan_history"]]


def report_self_spec(out: Dict[str, Any], row: Dict[str, Any]) -> None:
    k = out["knapspec"]
    row.update(plan_frac=k["plan_fraction_of_decode"], ar_tokens=k["ar_tokens"])
    if k["plan_history"]:
        print_table(plan_table_rows(out), title=f"{k['planner']} plans")


def self_spec_reserve(args) -> int:
    return args.knapspec_gamma_max + 2


for _name in SELF_SPEC_METHODS:
    registry.register_method(registry.Method(name=_name, run=run_self_spec, family="self-speculative",
                                             validate=validate_self_spec, reserve=self_spec_reserve,
                                             report=report_self_spec))
registry.register_method(registry.Method(name=KNAPSPEC_DUSTIN, run=run_self_spec, family="self-speculative",
                                         validate=validate_knapspec_dustin, reserve=self_spec_reserve,
                                         report=report_self_spec, also=frozenset({"sparse"})))
registry.register_method_arguments("self-speculative", add_self_spec_args)


# ---------------------------------------------------------------------------- arguments
def _ints(text: str, name: str) -> List[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError as err:
        raise ValueError(f"--{name}={text!r}: expected comma-separated integers") from err
    if not values or min(values) < 1:
        raise ValueError(f"--{name}={text!r}: expected positive integers")
    return values


def _names(text: str, valid: Sequence[str], name: str) -> List[str]:
    values = [x.strip() for x in str(text).split(",") if x.strip()]
    bad = [v for v in values if v not in valid]
    if bad:
        raise ValueError(f"--{name}: unknown {bad}; valid: {list(valid)}")
    return values


def register(subparsers) -> None:
    p = subparsers.add_parser("knapspec", help="KnapSpec vs AR, CLaSp, static skip set and ablations (docs/methods.md §4)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help="real weights (registry name or path) or random:PRESET (random weights, random prompts)")
    p.add_argument("--layers", type=int, default=None, help="random presets only: override the number of layers")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tasks", default="summarize", help=f"comma-separated: {', '.join(TASKS)}")
    p.add_argument("--contexts", default="1024,2048,4096", help="summarize: prompt lengths in tokens")
    p.add_argument("--max-new-tokens", type=int, default=256, help="summarize: new tokens")
    p.add_argument("--long-prompt", type=int, default=256, help="long-generation: prompt tokens")
    p.add_argument("--long-new-tokens", type=int, default=1024, help="long-generation: new tokens")
    p.add_argument("--batches", default="1", help="comma-separated batch sizes (one skip set per batch)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated: {', '.join(METHODS)}")
    p.add_argument("--candidate-plans", type=int, default=6,
                   help="DP candidates run as fixed plans for the TPT / alpha vs throughput correlation, spread over the "
                        "skipped weights, plus the planner's choice (0: none)")
    p.add_argument("--candidate-repeats", type=int, default=1, metavar="N",
                   help="each candidate plan timed in N (AR, plan) pairs, adjacent in time; its speed-up and tokens/s "
                        "are the median pair's (every pair is kept), so the correlation is not read off one timing")
    p.add_argument("--candidate-reference-tokens", type=int, default=16,
                   help="reference tokens per row of the candidates' DP and of the plan-cost timing (the first AR "
                        "tokens after the prompt)")
    p.add_argument("--attention-budget", type=int, default=256, metavar="K",
                   help="knapspec-budget: history slots of a budgeted Attention (sinks + window; docs/methods.md §5.4)")
    p.add_argument("--attention-sinks", type=int, default=4, help="knapspec-budget: sinks of the budget")
    from jaxspec.config import ATTENTION_BACKENDS

    p.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
                   help="the decode attention of every method and of AR (auto: the platform's default, the jnp "
                        "reference on a GPU, which reads the whole cache capacity; pallas: jaxspec's kernels); the "
                        "DP's branches keep the reference (--dp-attention moves them)")
    p.add_argument("--plan-cost-repeats", type=int, default=3,
                   help="planner timings with / without the stacked-weights reuse per case (0: skip)")
    p.add_argument("--dp-attention-check", type=int, default=0, metavar="REPEATS",
                   help="with --dp-attention pallas|pallas-interpret: per case, time the DP of the run's planning "
                        "shape with the reference attention and with the kernel, REPEATS times each, and record "
                        "whether they agree (0: skip)")
    p.add_argument("--device-tag", default=None, help="label in case keys and file names (default: the backend)")
    p.add_argument("--gamma-max", type=int, default=10)
    p.add_argument("--gamma-buckets", default="1,2,3,4,6,8",
                   help="static verification lengths; '' = always gamma-max + 1 rows (the GPU choice)")
    p.add_argument("--branch-chunk", type=int, default=None,
                   help="DP branches per attention batch (default: all, or fewer when the scores would pass 4 GB)")
    p.add_argument("--max-reference-tokens", type=int, default=None, help="cap the DP reference per row")
    add_planning_arguments(p.add_argument)
    p.add_argument("--plan-cost-scale-from", default=None, metavar="FILES",
                   help="set --plan-cost-scale to the largest measured / predicted plan time in these knapspec results "
                        "files (the same model and --device-tag)")
    p.add_argument("--clasp-skip-count", type=int, default=None)
    p.add_argument("--profile-dir", default=None,
                   help="latency profiles (JSON) are read / written here (default: next to --out)")
    p.add_argument("--reprofile", action="store_true", help=REPROFILE_HELP)
    p.add_argument("--latency-fit", default=DEFAULT_LATENCY_FIT, choices=list(LATENCY_FITS),
                   help="latency model: 'forward' = fitted on whole forwards of the model as the engine runs them "
                        "(full / no-Attention / no-MLP steps with the dynamic skip mask, verification of 1..11 rows); "
                        "'forward-static' = the same with each mask compiled in (plans compiled for themselves: "
                        "--static-plans, budget plans, the static skip set); '-half' = the no-Attention / no-MLP "
                        "masks skip every second sub-layer of a kind instead of all (a plan skips about half); "
                        "'isolated' = each "
                        "sub-layer timed alone (launch-bound on a GPU)")
    p.add_argument("--trace", action="store_true",
                   help="trace one more run of AR and of each method with jax.profiler: device busy time, idle "
                        "share, top kernels (experiments/trace.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, metavar="PNG", help="draw the figure from the results at the end")
    p.set_defaults(func=cmd_knapspec)
    b = subparsers.add_parser("bench-plan", help="a two-stage KnapSpec plan's stages timed alone on one cache, the "
                                                 "finalists rescored both ways (docs/methods.md §5.6), any backend")
    b.add_argument("--model", default="random:qwen2.5-1.5b-shape",
                   help="random:PRESET (random weights: the stages' cost does not depend on their values) or real "
                        "weights (registry name or path)")
    b.add_argument("--layers", type=int, default=None, help="random presets only: override the number of layers")
    b.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    b.add_argument("--contexts", default="32000", help="comma-separated cached tokens per row before the window")
    b.add_argument("--rows", type=int, default=1, help="rows the plan runs on (knapspec --plan-rows)")
    b.add_argument("--window", type=int, default=64, help="reference tokens a row (knapspec --reference-floor)")
    b.add_argument("--search-tokens", type=int, default=3, help="the DP's tokens a row (knapspec --search-tokens)")
    b.add_argument("--finalists", type=int, default=2, help="candidates rescored on the whole window")
    b.add_argument("--weights", default="5,1", metavar="W_ATTN,W_MLP",
                   help="the knapsack weights of an Attention and an MLP sub-layer (a plan derives them from the "
                        "latency profile; 5,1 is the 1.5B's at 32k/b16 on an H100)")
    b.add_argument("--exit-threshold", type=float, default=0.7, help="the early-exit statistics' threshold")
    b.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
                   help="the model's attention (the window's states and the rescoring)")
    b.add_argument("--dp-attention", choices=("xla", "pallas", "pallas-interpret"), default="xla",
                   help="the DP branches' attention, as knapspec --dp-attention")
    b.add_argument("--dp-segments", default="4,1", metavar="K,...",
                   help="the DP timed with each of these segment counts (knapspec --dp-segments; the first is the "
                        "plan's, the rescoring's finalists come from it)")
    b.add_argument("--masks-from", default=None, metavar="FILE",
                   help="rescore these finalists instead of the DP's: the skip sets of the plans in a knapspec results "
                        "file (its own model's layers; the first --finalists distinct ones, repeated to fill). The "
                        "executed-only rescoring's cost depends on where a mask first skips, not on the weights")
    b.add_argument("--repeats", type=int, default=5, help="timed calls per stage (interleaved); min and median")
    b.add_argument("--trace", action="store_true",
                   help="also run each stage once under the profiler: the device's busy time and kernel launches")
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=cmd_bench_plan)
    r = subparsers.add_parser("reprice-tpt", help="a TPT-correlation run's candidates priced again: with the measured "
                                                  "acceptance for the DP's alpha, and by other latency profiles")
    r.add_argument("--from", dest="source", required=True, metavar="FILE",
                   help="a knapspec results file with --candidate-plans (its correlation and candidates cases)")
    r.add_argument("--profiles", default=None, metavar="FILES",
                   help="comma-separated latency profiles to price with beside the run's own")
    r.set_defaults(func=cmd_reprice_tpt)


def _config_of(args) -> Dict[str, Any]:
    keys = ("model", "layers", "dtype", "tasks", "contexts", "max_new_tokens", "long_prompt", "long_new_tokens",
            "batches", "candidate_plans", "gamma_max", "gamma_buckets", "branch_chunk", "max_reference_tokens",
            "clasp_skip_count", "seed", "device_tag", "latency_fit", "max_plan_fraction",
            "probe_rounds", "candidate_reference_tokens", "attention_budget", "attention_sinks")
    config = {k: getattr(args, k) for k in keys}
    if args.reference_kv != "branch":  # named only when set: files written before the flag still resume
        config["reference_kv"] = args.reference_kv
    if args.candidate_repeats != 1:  # likewise
        config["candidate_repeats"] = args.candidate_repeats
    # the two-stage search (docs/methods.md §5.6), named only when set, like reference_kv
    for key, default in (("search_tokens", None), ("finalists", 4), ("reference_floor", None), ("plan_rows", None)):
        if getattr(args, key) != default:
            config[key] = getattr(args, key)
    if args.probe_warmup:  # named only when set, like reference_kv
        config["probe_warmup"] = args.probe_warmup
    if args.probe_pricing != "mean":  # likewise
        config["probe_pricing"] = args.probe_pricing
    if args.plan_after_plain is not None:  # named only when set, like reference_kv
        config["plan_after_plain"] = args.plan_after_plain
        config["start_states"] = args.start_states  # files written before the stretch kept them computed their own
    if args.plan_at_start:
        config["plan_at_start"] = True
        if args.start_states == "prefill":  # named only then: files written before the prefill kept the states
            config["start_states"] = "prefill"  # computed their own, as "own" still does
    if args.dp_attention != "xla":
        config["dp_attention"] = args.dp_attention
    if args.rescore != "executed":  # named only when set, like reference_kv
        config["rescore"] = args.rescore
    if args.dp_segments != DP_SEGMENTS:
        config["dp_segments"] = args.dp_segments
    if args.weight_cap != WEIGHT_CAP:  # named only when set, like reference_kv
        config["weight_cap"] = args.weight_cap
    if args.attention_backend != "auto":
        config["attention_backend"] = args.attention_backend
    if args.dp_attention_check:
        config["dp_attention_check"] = args.dp_attention_check
    if args.plan_cost_scale != 1.0:
        config["plan_cost_scale"] = args.plan_cost_scale
    if args.plan_cost_scale_from:
        config["plan_cost_scale_from"] = args.plan_cost_scale_from
    return config


# ---------------------------------------------------------------------------- model and prompts
@dataclasses.dataclass
class Model:
    params: Any
    config: Any
    tokenizer: Any
    source: str
    real: bool


def load(args) -> Model:
    import jax

    if args.model.startswith("random:"):
        from jaxspec.config import preset
        from jaxspec.models.llama import init_params

        overrides = {"dtype": args.dtype, "attention_backend": args.attention_backend}
        if args.layers is not None:
            overrides["num_layers"] = int(args.layers)
        config = preset(args.model.split(":", 1)[1], **overrides)
        params = init_params(config, jax.random.PRNGKey(args.seed))
        return Model(params, config, None, args.model, real=False)
    if args.layers is not None:
        raise ValueError("--layers only applies to random:PRESET models")
    model = load_model_timed(args.model, args.dtype, args.attention_backend)
    return Model(model.params, model.config, model.tokenizer, args.model, real=True)


def _chat_frame(tokenizer) -> Tuple[List[int], List[int]]:
    """Token ids before and after the user text (chat template if the tokenizer has one)."""
    if getattr(tokenizer, "chat_template", None):
        marker = "@@TEXT@@"
        text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                             tokenize=False)
        head, tail = text.split(marker)
        return list(tokenizer(head)["input_ids"]), list(tokenizer(tail)["input_ids"])
    return [], list(tokenizer("\n\nSummary:")["input_ids"])


_BOOK_IDS: Dict[str, List[int]] = {}


def _book_ids(tokenizer, title: str, limit: int) -> List[int]:
    if title not in _BOOK_IDS or len(_BOOK_IDS[title]) < limit:
        from jaxspec.data.corpus import austen_books

        text = austen_books(progress=False)[title]
        # skip the title page; 6 characters a token is ample for English prose
        _BOOK_IDS[title] = list(tokenizer(text[2000: 2000 + 6 * limit + 1000])["input_ids"])
    ids = _BOOK_IDS[title]
    if len(ids) < limit:
        raise ValueError(f"{title}: only {len(ids)} tokens available, {limit} needed")
    return ids[:limit]


def build_prompts(model: Model, task: str, length: int, batch: int, seed: int) -> List[List[int]]:
    """``batch`` prompts of exactly ``length`` tokens."""
    if not model.real:
        rng = np.random.default_rng(seed + length)
        return [rng.integers(0, model.config.vocab_size, length).tolist() for _ in range(batch)]
    head, tail = _chat_frame(model.tokenizer)
    if task == "summarize":
        head = head + list(model.tokenizer(INSTRUCTION)["input_ids"])
    else:
        head = head + list(model.tokenizer("Continue this story for several pages.\n\n")["input_ids"])
    room = length - len(head) - len(tail)
    if room < 16:
        raise ValueError(f"prompt length {length} leaves {room} tokens for the text")
    return [head + _book_ids(model.tokenizer, PROMPT_BOOKS[b % len(PROMPT_BOOKS)], room) + tail
            for b in range(batch)]


# ---------------------------------------------------------------------------- measurements
def pearson(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 3 or np.std(x) == 0 or np.std(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def stretch_fit(stretches, ar_step_s: Optional[float] = None) -> Optional[Dict[str, float]]:
    """Least squares of each plain stretch's wall seconds over its steps, ``seconds = fixed + steps x step``: the
    per-stretch fixed cost (dispatch, the stretch's host read) apart from the per-step cost, which is what the
    paired AR run's step compares with. None with fewer than two distinct stretch lengths."""
    if len({steps for steps, _ in stretches}) < 2:
        return None
    x = np.array([steps for steps, _ in stretches], np.float64)
    y = np.array([seconds for _, seconds in stretches], np.float64)
    step, fixed = np.polyfit(x, y, 1)
    return {"fixed_s": float(fixed), "step_s": float(step),
            "step_over_ar_step": float(step / ar_step_s) if ar_step_s else None}


def _copy(tree):
    import jax
    import jax.numpy as jnp

    return jax.tree.map(jnp.copy, tree)


def ar_run(model: Model, prefilled, max_new_tokens: int) -> Dict[str, Any]:
    """Greedy autoregressive decoding from a copy of the prefilled cache (compiled beforehand)."""
    import jax

    from jaxspec.decoding.autoregressive import decode_loop
    from jaxspec.decoding.sampling import SamplingConfig

    cache, logits = _copy(prefilled)
    jax.block_until_ready(cache)
    start = time.perf_counter()
    out, _ = decode_loop(model.params, cache, logits, jax.random.PRNGKey(0), config=model.config,
                          sampling=SamplingConfig(), max_new_tokens=max_new_tokens, stop_tokens=())
    out = np.asarray(out)
    decode_s = time.perf_counter() - start
    return {"tokens": out, "decode_s": decode_s, "tokens_per_s": out.size / decode_s,
            "step_s": decode_s / max_new_tokens}


_FORWARDS: Dict[Any, Any] = {}


def forward_times(model: Model, prefilled, mask, verify_rows: int, repeats: int = 5,
                  steps_per_call: int = 4, long_steps_per_call: int = 0) -> Dict[str, float]:
    """Median seconds of one draft forward (1 token) with the dynamic skip ``mask`` (a ``lax.cond``
    per sub-layer) and with the same mask static (skipped sub-layers removed at trace time, one
    compile per mask), and of one verification forward (``verify_rows`` tokens, full model) on the
    prefilled cache, each one jitted call.

    ``draft_step_in_loop_s`` / ``draft_step_static_in_loop_s``: the same two draft forwards timed as
    the latency profile times its forwards and as the draft loop runs them, ``steps_per_call`` of them
    in one jitted loop carrying the (donated) cache, per forward (median of ``repeats`` calls, the two
    variants round-robin); on a copy of the cache. A call per forward returning only the logits lets
    XLA drop the forward's cache writes and pays its own dispatch; the profile and the draft loop
    write the cache inside one compiled loop. ``long_steps_per_call`` (the profile's, 0: none): each loop
    is timed at that call length too and its step is the slope between the two, without the call's
    fixed cost, as the profile's steps are."""
    import jax
    import jax.numpy as jnp

    from jaxspec.knapspec.latency import forward_loop, forward_loop_fn
    from jaxspec.models.llama import forward, freeze_skip_mask

    config = model.config
    cache = prefilled[0]
    batch = cache.batch_size
    if config not in _FORWARDS:
        _FORWARDS[config] = (jax.jit(lambda p, t, c, m: forward(p, t, c, config=config, skip_mask=m).logits),
                             jax.jit(lambda p, t, c: forward(p, t, c, config=config).logits))
    draft, verify = _FORWARDS[config]
    one = jnp.zeros((batch, 1), jnp.int32)
    rows = jnp.zeros((batch, max(int(verify_rows), 1)), jnp.int32)
    mask = jnp.asarray(mask, bool)

    def median(fn, *a):
        return _median_call_s(lambda: fn(*a), repeats)

    frozen = freeze_skip_mask(mask)
    key = (config, frozen)
    if key not in _FORWARDS:
        _FORWARDS[key] = jax.jit(lambda p, t, c: forward(p, t, c, config=config, skip_mask=frozen).logits)
    out = {"draft_forward_s": median(draft, model.params, one, cache, mask),
           "draft_forward_static_s": median(_FORWARDS[key], model.params, one, cache),
           "verify_forward_s": median(verify, model.params, rows, cache)}
    if "static_loop" not in _FORWARDS:
        _FORWARDS["static_loop"] = jax.jit(forward_loop_fn, static_argnames=("config", "steps", "mask"),
                                           donate_argnames=("cache",))
    static_loop, steps = _FORWARDS["static_loop"], int(steps_per_call)
    calls = {"draft_step_in_loop_s": lambda c, k: forward_loop(model.params, c, one, mask, config=config, steps=k),
             "draft_step_static_in_loop_s": lambda c, k: static_loop(model.params, c, one, mask=frozen,
                                                                     config=config, steps=k)}
    out.update(_in_loop_step_s(calls, cache, repeats, steps, long_steps_per_call))
    out.update(draft_steps_per_call=steps, draft_long_steps_per_call=int(long_steps_per_call))
    return out


def _timed_as(fwd: Dict[str, Any]) -> str:
    """How the draft-step check timed its forwards: one call length, or the slope between two."""
    long_steps = int(fwd.get("draft_long_steps_per_call", 0))
    if long_steps:
        return f"{fwd['draft_steps_per_call']} and {long_steps} forwards per jitted call, the slope between them"
    return f"{fwd['draft_steps_per_call']} forwards per jitted call"


def _median_call_s(call, repeats: int) -> float:
    """Median seconds of ``call()`` (a jitted call) over ``repeats`` timed calls after one untimed."""
    import jax

    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _in_loop_step_s(calls: Dict[str, Any], cache, repeats: int, steps: int, long_steps: int = 0) -> Dict[str, float]:
    """Per-forward median seconds of each ``calls[name](cache, k) -> (tokens, cache)`` (``k`` forwards in
    one jitted loop donating the cache), round-robin over the names on one copy of ``cache``; the first
    round compiles and is not timed. With ``long_steps`` each is timed at ``steps`` and ``long_steps`` a
    call and its forward is the slope between the two (the call's fixed cost off,
    :func:`~jaxspec.knapspec.latency.call_overhead`); ``<name>_call_overhead_s`` is that cost."""
    import jax

    from jaxspec.knapspec.latency import call_overhead

    lengths = (steps, long_steps) if long_steps else (steps,)
    state = {"cache": _copy(cache)}
    times: Dict[tuple, List[float]] = {(name, k): [] for name in calls for k in lengths}
    for round_ in range(1 + repeats):
        for name, call in calls.items():
            for k in lengths:
                start = time.perf_counter()
                tokens, state["cache"] = call(state["cache"], k)
                jax.block_until_ready(tokens)
                if round_:
                    times[(name, k)].append((time.perf_counter() - start) / k)
    del state
    out = {}
    for name in calls:
        step = float(np.median(times[(name, steps)]))
        if long_steps:
            fixed = call_overhead(step, float(np.median(times[(name, long_steps)])), steps, long_steps)
            out[f"{name}_call_overhead_s"] = fixed
            step -= fixed / steps
        out[name] = step
    return out


def _budget_loop_fn(params, cache, tokens, *, config, plan, sinks, window, steps):
    """``steps`` draft forwards under a budget ``plan`` at the cache's current lengths, each fed the
    previous step's greedy tokens (as :func:`~jaxspec.knapspec.latency.forward_loop_fn`)."""
    import jax
    import jax.numpy as jnp

    from jaxspec.knapspec.budgeted import budgeted_forward

    start = cache.lengths

    def body(_, carry):
        cache, tokens = carry
        logits, cache, _ = budgeted_forward(params, tokens, cache.with_lengths(start), config=config, plan=plan,
                                            sinks=sinks, window=window)
        return cache.with_lengths(start), jnp.argmax(logits, axis=-1).astype(jnp.int32)

    cache, tokens = jax.lax.fori_loop(0, steps, body, (cache, tokens))
    return tokens, cache


def budget_draft_times(model: Model, prefilled, plan, sinks: int, window: int, repeats: int = 5,
                       steps_per_call: int = 4, long_steps_per_call: int = 0) -> Dict[str, float]:
    """One draft forward under a budget ``plan`` (docs/methods.md §5.4: dense, budgeted or skipped
    Attention per layer), timed as :func:`forward_times` times the static skip mask: one jitted call,
    and ``steps_per_call`` forwards in one jitted loop carrying the (donated) cache, per forward
    (median of ``repeats``; on a copy of the cache); with ``long_steps_per_call`` the slope between the two
    call lengths, as :func:`forward_times`."""
    import jax
    import jax.numpy as jnp

    from jaxspec.knapspec.budgeted import budgeted_forward_jit, freeze_plan

    config, cache = model.config, prefilled[0]
    frozen = freeze_plan(plan)
    one = jnp.zeros((cache.batch_size, 1), jnp.int32)
    single = _median_call_s(lambda: budgeted_forward_jit(model.params, one, cache, config=config, plan=frozen,
                                                         sinks=sinks, window=window)[0], repeats)
    if "budget_loop" not in _FORWARDS:
        _FORWARDS["budget_loop"] = jax.jit(_budget_loop_fn, static_argnames=("config", "plan", "sinks", "window",
                                                                            "steps"), donate_argnames=("cache",))
    loop, steps = _FORWARDS["budget_loop"], int(steps_per_call)
    looped = _in_loop_step_s({"draft_step_budget_in_loop_s": lambda c, k: loop(
        model.params, c, one, config=config, plan=frozen, sinks=sinks, window=window, steps=k)},
        cache, repeats, steps, long_steps_per_call)
    return {"draft_forward_budget_s": single, **looped, "draft_steps_per_call": steps,
            "draft_long_steps_per_call": int(long_steps_per_call)}


def auto_branch_chunk(config, batch: int, capacity: int, reference: int, budget_slots: int,
                      limit_bytes: float = 4e9) -> Optional[int]:
    """Branches per attention batch so the DP's float32 scores stay under ``limit_bytes``: ``batch`` and
    ``reference`` are the rows and tokens the DP runs on (:func:`dp_shape`)."""
    per_branch = 3 * 4 * batch * config.num_heads * reference * capacity
    if per_branch * budget_slots <= limit_bytes:
        return None
    return max(1, int(limit_bytes // per_branch))


def dp_shape(args, batch: int) -> Tuple[int, int]:
    """The rows and reference tokens per row one DP runs on: ``--plan-rows`` of the batch (else all), and
    ``--search-tokens`` with a two-stage plan, else the window, ``--max-reference-tokens`` or 64."""
    rows = min(int(args.plan_rows), batch) if args.plan_rows else batch
    return rows, int(args.search_tokens or args.max_reference_tokens or 64)


#: kernel rows per call the DP attention check times beside the kernel's default (64)
DP_CHECK_ROW_BLOCKS = (128, 256)


# ---------------------------------------------------------------------------- one case
class Case:
    def __init__(self, args, model: Model, writer: ResultWriter, profile, task: str, context: int,
                 max_new: int, batch: int, static_plan):
        from jaxspec.knapspec.dp import skip_budget

        self.args, self.model, self.writer, self.task = args, model, writer, task
        self.context, self.max_new, self.batch = context, max_new, batch
        self.latency = profile.model
        self.latency_method = profile.method
        # the forward profile's forwards per timed call (the draft-step check times its forwards alike)
        self.profile_steps_per_call = int((getattr(profile, "forward", None) or {}).get("steps_per_call", 4))
        # and its second call length (0: the profile kept each call's fixed cost in its steps)
        self.profile_long_steps = int((getattr(profile, "forward", None) or {}).get("long_steps_per_call", 0))
        self.static_plan = static_plan
        self.key = f"{args.device_tag}/{task}/ctx{context}/b{batch}"
        cfg = model.config
        from jaxspec.models.attention import backend_of

        self.capacity = backend_of(cfg).round_capacity(context + max_new + args.gamma_max + 2)  # the kernels' blocks
        rows, reference = dp_shape(args, batch)
        chunk = args.branch_chunk
        if chunk is None and args.dp_attention == "xla":  # the kernel writes no scores: nothing to bound
            chunk = auto_branch_chunk(cfg, rows, self.capacity, reference, skip_budget(5, 1, cfg.num_layers) + 1)
        self.knapspec = experiment_knapspec_config(args, branch_chunk=chunk)
        self.prompts = build_prompts(model, task, context, batch, args.seed)
        self.prefilled = None
        self.window_states = None  # the prompt's last tokens' target states, kept by the prefill (plan_at_start)
        self.prefill_s = None
        self.ar_compiled = False
        self.last_ar = None

    def prefill(self):
        if self.prefilled is None:
            import jax

            from jaxspec.decoding.autoregressive import pad_prompts, prefill
            from jaxspec.models.cache import init_cache

            start = time.perf_counter()
            tokens, lengths = pad_prompts(self.prompts)
            cache = init_cache(self.model.config, self.batch, self.capacity)
            ks = self.knapspec
            if ks.plan_at_start and ks.start_states == "prefill":  # the plan at the start reads its window's states
                from jaxspec.knapspec.policy import prefill_window

                cache, logits, self.window_states = prefill_window(self.model.params, self.model.config, tokens,
                                                                   lengths, cache, ks.reference_floor,
                                                                   ks.token_bucket)
                self.prefilled = (cache, logits)
            else:
                self.prefilled = prefill(self.model.params, self.model.config, tokens, lengths, cache)
            jax.block_until_ready(self.prefilled)
            self.prefill_s = time.perf_counter() - start
            print(f"[{self.key}] prefilled {self.batch} x {self.context} tokens in "
                  f"{self.prefill_s:.1f} s", file=sys.stderr, flush=True)
        return self.prefilled

    def ar(self) -> Dict[str, Any]:
        prefilled = self.prefill()
        if not self.ar_compiled:
            ar_run(self.model, prefilled, self.max_new)  # compile
            self.ar_compiled = True
        self.last_ar = ar_run(self.model, prefilled, self.max_new)
        return self.last_ar

    def ar_tokens(self) -> np.ndarray:
        return (self.last_ar if self.last_ar is not None else self.ar())["tokens"]

    @staticmethod
    def time_split_measured(metrics, decode_s: float, plan_s: float, ar_step_s: float) -> Optional[Dict[str, Any]]:
        """The decode time as the engine's chunks measured it: plain-decoding stretches and speculative rounds
        (each chunk's wall time up to its own host read), planning, and the controller's rest; the plain steps'
        own step time against the paired AR run's."""
        plain, rounds = metrics.get("plain_chunk_seconds"), metrics.get("round_chunk_seconds")
        if plain is None or rounds is None:
            return None
        steps = metrics["ar_steps"]
        log = metrics.get("chunk_log") or []
        stretches = [(units, seconds) for kind, units, seconds in log if kind == "plain"]
        return {"how": "wall seconds inside the engine's chunks (each ended by its own host read); controller = "
                       "decode - plain stretches - rounds - planning",
                "plain_stretches_s": plain, "rounds_s": rounds, "plan_s": plan_s,
                "controller_s": decode_s - plain - rounds - plan_s, "plain_steps": steps,
                "plain_step_s": plain / steps if steps else None,
                "plain_step_over_ar_step": plain / steps / ar_step_s if steps and ar_step_s else None,
                "chunks": [{"kind": kind, "units": units, "seconds": seconds} for kind, units, seconds in log],
                "plain_stretches": len(stretches),
                "plain_stretch_fit": stretch_fit(stretches, ar_step_s)}

    def _generate(self, method: str, warmup: bool = True, **kwargs):
        from jaxspec.baselines.clasp import clasp_generate
        from jaxspec.baselines.static_skip import static_skip_generate
        from jaxspec.decoding.speculative import EngineConfig
        from jaxspec.knapspec.policy import knapspec_generate

        engine = EngineConfig(gamma=self.args.gamma_max, max_new_tokens=self.max_new, stop_tokens=())
        # random-weight shapes time paper contexts up to the model's limit plus the new tokens
        common = dict(engine=engine, seed=0, warmup=warmup, capacity=self.capacity, prefilled=self.prefill(),
                      allow_beyond_context=not self.model.real)
        ks = self.knapspec
        kept = dict(window_states=self.window_states)  # the re-planning KnapSpec variants' plan at the start
        if method == "knapspec":
            return knapspec_generate(self.model.params, self.model.config, self.prompts, latency=self.latency,
                                     knapspec=ks, **common, **kept)
        if method == "knapspec-official":
            return knapspec_generate(self.model.params, self.model.config, self.prompts, latency=self.latency,
                                     knapspec=dataclasses.replace(ks, honor_gamma=False), **common, **kept)
        if method == "knapspec-tpl":
            return knapspec_generate(self.model.params, self.model.config, self.prompts, latency=self.latency,
                                     knapspec=dataclasses.replace(ks, objective="tpl"), **common, **kept)
        if method == "knapspec-coupled":
            return knapspec_generate(self.model.params, self.model.config, self.prompts, latency=self.latency,
                                     knapspec=dataclasses.replace(ks, coupled=True), **common, **kept)
        if method == "knapspec-target-ref":
            return knapspec_generate(self.model.params, self.model.config, self.prompts, latency=self.latency,
                                     knapspec=dataclasses.replace(ks, reference_kv="target"), **common, **kept)
        if method == "clasp":
            return clasp_generate(self.model.params, self.model.config, self.prompts,
                                  skip_count=self.args.clasp_skip_count, knapspec=ks, latency=self.latency, **common)
        if method == "static-skip":
            return static_skip_generate(self.model.params, self.model.config, self.prompts, plan=self.static_plan,
                                        knapspec=ks, **common)
        if method == "knapspec-budget":
            from jaxspec.knapspec.policy import knapspec_budget_generate

            sinks = self.args.attention_sinks
            return knapspec_budget_generate(self.model.params, self.model.config, self.prompts, latency=self.latency,
                                            sinks=sinks, window=self.args.attention_budget - sinks,
                                            reference_tokens=self.args.candidate_reference_tokens, knapspec=ks,
                                            engine=engine, seed=0, warmup=warmup, capacity=self.capacity,
                                            context_n=float(self.capacity), allow_beyond_context=not self.model.real)
        if method == "fixed":
            return knapspec_generate(self.model.params, self.model.config, self.prompts, knapspec=ks,
                                     replan=False, **common, **kwargs)
        raise ValueError(f"unknown method {method!r}")

    def run_method(self, method: str, **kwargs) -> Dict[str, Any]:
        """AR, then the method, on copies of the same prefilled cache."""
        import os

        load_before = list(os.getloadavg())
        ar = self.ar()
        result = self._generate(method, **kwargs)
        metrics = result.metrics
        timings = dict(result.timings)
        rounds = int(metrics["rounds"])
        plans = metrics["knapspec_plans"]
        final_mask = np.asarray(metrics["final_skip_mask"], bool)
        bucket = max(metrics.get("gamma_buckets_used") or [self.args.gamma_max])
        fwd = forward_times(self.model, self.prefill(), final_mask, bucket + 1,
                            steps_per_call=self.profile_steps_per_call, long_steps_per_call=self.profile_long_steps)
        budget = metrics.get("budget_plan") if method == "knapspec-budget" else None
        if budget:  # the draft runs the plan's dense / budgeted / skipped sub-layers, not a skip mask
            fwd.update(budget_draft_times(self.model, self.prefill(), budget["codes"], budget["sinks"],
                                          budget["window"], steps_per_call=self.profile_steps_per_call,
                                          long_steps_per_call=self.profile_long_steps))
        draft_est = metrics["draft_steps"] * fwd["draft_forward_budget_s" if budget else "draft_forward_s"]
        verify_est = rounds * fwd["verify_forward_s"]
        ar_est = metrics["ar_steps"] * ar["step_s"]
        plan_s = timings.get("plan_s", 0.0)
        decode_s = timings["decode_s"]
        out = {
            "method": method, "tokens_per_s": result.tokens_per_s, "ar_tokens_per_s": ar["tokens_per_s"],
            "speedup_vs_ar": result.tokens_per_s / ar["tokens_per_s"],
            "identical_to_ar": bool(np.array_equal(np.asarray(result.tokens), ar["tokens"])),
            "tau": metrics["tau"], "acceptance_rate": metrics["acceptance_rate"], "rounds": rounds,
            "draft_steps": metrics["draft_steps"], "ar_steps": metrics["ar_steps"], "ar_tokens": metrics["ar_tokens"],
            "gamma_buckets_used": metrics.get("gamma_buckets_used"), "honor_gamma": metrics.get("honor_gamma"),
            "static_plans": metrics.get("static_plans"), "compiled_plans": metrics.get("compiled_plans"),
            "dp_branch_chunk": self.knapspec.branch_chunk,  # branches per attention batch of the DP (None: all)
            "plans": [{k: p.get(k) for k in ("round", "context_length", "n", "n_skip_attn", "n_skip_mlp",
                                            "skip_attn", "skip_mlp", "gamma_star", "gamma_used", "mode",
                                            "alpha", "p_c", "p_ac", "predicted_tpt", "t_attn", "t_mlp", "t_token",
                                            "verify_row_cost", "seconds", "predicted_seconds", "probe",
                                            "reference_tokens", "candidates", "w_attn", "w_mlp", "planner",
                                            "stage_seconds", "dp_attention", "rescore", "states_from_prefill",
                                            "states_from_plain")}
                      for p in plans],
            "final_skip": {"n_skip_attn": int(final_mask[:, 0].sum()), "n_skip_mlp": int(final_mask[:, 1].sum())},
            "timings": timings, "ar_decode_s": ar["decode_s"], "ar_step_s": ar["step_s"],
            "plan_fraction_of_decode": plan_s / max(decode_s, 1e-9),
            "prefill": {"s": self.prefill_s, "window_states": self.window_states is not None},
            "plan_allowance": metrics.get("plan_allowance"),
            "time_split_estimate": {
                "how": "planning measured; draft = draft forwards x one draft forward with the final mask (a "
                       "budget plan: with its codes); verify = "
                       "rounds x one verification forward (largest bucket used); plain decoding = AR-interval "
                       "steps x AR step; other = the rest",
                "plan_s": plan_s, "draft_s": draft_est, "verify_s": verify_est, "ar_interval_s": ar_est,
                "other_s": decode_s - plan_s - draft_est - verify_est - ar_est, **fwd},
            "time_split_measured": self.time_split_measured(metrics, decode_s, plan_s, ar["step_s"]),
            "predicted_ar_step_s": self.latency.t_plain(self.capacity, self.model.config.num_layers),
            "latency_prediction": self.latency_prediction(final_mask, bucket + 1, metrics, rounds, decode_s - plan_s,
                                                          budget=budget),
            "draft_step_check": (self.budget_draft_step_check(budget, fwd) if budget
                                 else self.draft_step_check(final_mask, fwd)),
            "load_average_before": load_before,
        }
        if method == "clasp":
            out["clasp_skip_count"] = metrics.get("clasp_skip_count")
        if method == "knapspec-budget":
            out["budget_plan"] = metrics["budget_plan"]
            out["fixed_plan_probe"] = metrics.get("fixed_plan_probe")  # the plan against plain decoding, at the start
        if getattr(self.args, "trace", False):  # one more (compiled) run of each, under the profiler
            from experiments.trace import trace_or_error

            out["trace"] = {
                "ar": trace_or_error(lambda: ar_run(self.model, self.prefill(), self.max_new), f"[{self.key}] trace ar"),
                method: trace_or_error(lambda: self._generate(method, warmup=False, **kwargs),
                                       f"[{self.key}] trace {method}")}
        return out

    def latency_prediction(self, mask, verify_rows: int, metrics, rounds: int, measured_s: float,
                           budget: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The latency model's step times at the cache capacity (what the planner used: the xla
        backend reads every slot) and its decode time for the counted forwards (draft forwards with
        ``mask``, every round verifying ``verify_rows`` rows, AR-interval steps), vs the measured
        decode time less planning."""
        from jaxspec.knapspec.planner import draft_time

        m, L, n = self.latency, self.model.config.num_layers, float(self.capacity)
        step = m.t_step(n, L)
        if budget:
            from jaxspec.knapspec.budgeted import plan_draft_time

            draft = float(plan_draft_time(budget["codes"], m, n, budget["sinks"] + budget["window"]))
        else:
            draft = float(draft_time(np.asarray(mask, bool), m.t_attn(n), m.t_mlp(), m.t_token(n)))
        verify = step * (m.a + m.v * (verify_rows - 1))
        total = metrics["draft_steps"] * draft + rounds * verify + metrics["ar_steps"] * m.t_plain(n, L)
        return {"method": self.latency_method, "n": n, "step_s": step, "draft_step_s": draft,
                "verify_s": verify, "verify_rows": int(verify_rows), "decode_s": total,
                "measured_decode_minus_plan_s": measured_s, "ratio_measured_to_predicted": measured_s / total
                if total > 0 else None}

    def draft_step_check(self, mask, fwd: Dict[str, float]) -> Dict[str, Any]:
        """One draft forward of ``mask``, measured with the dynamic mask and with the static
        (executed sub-layers only) variant, against the latency model's draft time for the plan at
        the cache capacity (:func:`~jaxspec.knapspec.planner.draft_time`): the ratios measured /
        predicted (target: within 10 %)."""
        from jaxspec.knapspec.planner import draft_time

        m, n = self.latency, float(self.capacity)
        mask = np.asarray(mask, bool)
        predicted = float(draft_time(mask, m.t_attn(n), m.t_mlp(), m.t_token(n)))
        # timed as the profile was measured and as the draft loop runs: several forwards per jitted call
        dynamic, static = fwd["draft_step_in_loop_s"], fwd["draft_step_static_in_loop_s"]
        single_dynamic, single_static = fwd["draft_forward_s"], fwd["draft_forward_static_s"]
        ratio = (lambda t: t / predicted if predicted > 0 else None)
        return {"n": n, "n_skip_attn": int(mask[:, 0].sum()), "n_skip_mlp": int(mask[:, 1].sum()),
                "predicted_s": predicted, "timed": _timed_as(fwd),
                "dynamic_s": dynamic, "static_s": static,
                "dynamic_over_predicted": ratio(dynamic), "static_over_predicted": ratio(static),
                "static_within_10pct": bool(predicted > 0 and abs(static / predicted - 1) <= 0.10),
                "single_call_dynamic_s": single_dynamic, "single_call_static_s": single_static,
                "single_call_static_over_predicted": ratio(single_static)}

    def budget_draft_step_check(self, budget: Dict[str, Any], fwd: Dict[str, float]) -> Dict[str, Any]:
        """One draft forward of a budget plan (its dense / budgeted / skipped sub-layers compiled in)
        against the latency model's time for it at the cache capacity
        (:func:`~jaxspec.knapspec.budgeted.plan_draft_time`)."""
        from jaxspec.knapspec.budgeted import plan_draft_time

        predicted = float(plan_draft_time(budget["codes"], self.latency, float(self.capacity),
                                          budget["sinks"] + budget["window"]))
        timed, single = fwd["draft_step_budget_in_loop_s"], fwd["draft_forward_budget_s"]
        ratio = (lambda t: t / predicted if predicted > 0 else None)
        return {"plan": "budget", "n": float(self.capacity), "n_dense_attn": budget.get("n_dense_attn"),
                "n_budget_attn": budget.get("n_budget_attn"), "n_skip_attn": budget.get("n_skip_attn"),
                "n_skip_mlp": budget.get("n_skip_mlp"), "predicted_s": predicted,
                "timed": _timed_as(fwd), "static_s": timed,
                "static_over_predicted": ratio(timed),
                "static_within_10pct": bool(predicted > 0 and abs(timed / predicted - 1) <= 0.10),
                "single_call_static_s": single, "single_call_static_over_predicted": ratio(single)}

    # ------------------------------------------------------------------------ candidates
    def candidates(self) -> Dict[str, Any]:
        """The DP on the case's text: reference = the first ``--candidate-reference-tokens`` (16) AR tokens
        of each row (at the prompt's end). ``plan_share_of_ar_decode``: one (compiled) plan's seconds over
        the AR decode of the case's new tokens."""
        import jax.numpy as jnp

        from jaxspec.knapspec.dp import REFERENCE_KV, boundary_states, plan_alpha
        from jaxspec.knapspec.planner import objective_table
        from jaxspec.knapspec.policy import exit_threshold, plan_skip_set

        prefilled = self.prefill()
        r = min(self.args.candidate_reference_tokens, self.max_new)
        tokens = jnp.asarray(self.ar_tokens()[:, :r], jnp.int32)
        token_mask = jnp.ones(tokens.shape, jnp.float32)
        prefix = jnp.asarray([len(p) for p in self.prompts], jnp.int32)
        n = float(self.capacity)  # the xla backend reads every slot
        start = time.perf_counter()
        plan, cands, weights = plan_skip_set(self.model.params, self.model.config, prefilled[0], tokens, token_mask,
                                             prefix, self.latency, n, self.knapspec)
        first = time.perf_counter() - start
        start = time.perf_counter()
        plan_skip_set(self.model.params, self.model.config, prefilled[0], tokens, token_mask, prefix, self.latency,
                      n, self.knapspec)
        steady = time.perf_counter() - start
        gammas = tuple(range(1, self.args.gamma_max + 1))
        # each candidate's TPT as the planner's grid search prices it: with the draft's early exit modelled
        # from the DP's confidence statistics where the planner models it (planner module doc), so the
        # correlation is that of the prediction the plan is chosen by; the exit-free TPT of §4.2 beside it
        exits = (cands.confident, cands.agree_confident) if exit_threshold(self.knapspec) is not None \
            and cands.confident is not None else None
        table_args = (cands.masks, cands.alpha, self.latency.t_attn(n), self.latency.t_mlp(), gammas, "tpt",
                      self.latency.t_token(n), self.latency.v, self.latency.a)
        table = objective_table(*table_args, exit_stats=exits)
        plain_table = objective_table(*table_args)
        # every candidate's acceptance estimate under both references of the DP (docs/methods.md §4.3)
        states = boundary_states(self.model.params, self.model.config, tokens, prefilled[0], prefix)
        by_reference = {mode: plan_alpha(self.model.params, self.model.config, prefilled[0], prefix, states,
                                         cands.masks, token_mask, reference_kv=mode) for mode in REFERENCE_KV}
        rows = []
        for c in range(len(cands)):
            g = int(np.argmax(table[c]))
            exit_stats = {} if exits is None else {"p_c": float(exits[0][c]), "p_ac": float(exits[1][c])}
            rows.append({"index": c, "weight": int(cands.weights[c]), "alpha": float(cands.alpha[c]),
                         **{f"alpha_{mode}": float(a[c]) for mode, a in by_reference.items()},
                         "cosine": float(cands.cosine[c]), "gamma": gammas[g], "predicted_tpt": float(table[c, g]),
                         "exit_aware_tpt": exits is not None, **exit_stats,
                         "predicted_tpt_no_exit": float(plain_table[c, g]),
                         "n_skip_attn": int(cands.masks[c, :, 0].sum()), "n_skip_mlp": int(cands.masks[c, :, 1].sum()),
                         "mask": cands.masks[c].tolist()})
        ar_decode = (self.last_ar or self.ar())["decode_s"]
        return {"plan": plan.summary(), "weights": list(weights), "reference_tokens": r * self.batch,
                "reference_tokens_per_row": r, "plan_first_call_s": first, "plan_s": steady,
                "ar_decode_s": ar_decode, "ar_new_tokens": self.max_new, "plan_share_of_ar_decode": steady / ar_decode,
                "candidates": rows}

    def plan_cost(self, repeats: int) -> Dict[str, Any]:
        """Planner seconds (reference states + DP + grid search) without / with the stacked-weights reuse,
        interleaved, on the reference window of :meth:`candidates`."""
        import jax
        import jax.numpy as jnp

        from jaxspec.knapspec.dp import boundary_states, knapsack_dp, knapsack_weights
        from jaxspec.knapspec.planner import choose_plan

        prefilled = self.prefill()
        r = min(self.args.candidate_reference_tokens, self.max_new)
        tokens = jnp.asarray(self.ar_tokens()[:, :r], jnp.int32)
        token_mask = jnp.ones(tokens.shape, jnp.float32)
        prefix = jnp.asarray([len(p) for p in self.prompts], jnp.int32)
        n = float(self.capacity)
        w_attn, w_mlp = knapsack_weights(self.latency.t_attn(n), self.latency.t_mlp())
        cfg = self.model.config

        def plan(reuse: bool):
            start = time.perf_counter()
            states = boundary_states(self.model.params, cfg, tokens, prefilled[0], prefix)
            cands = knapsack_dp(self.model.params, cfg, prefilled[0], prefix, states, token_mask, w_attn=w_attn,
                                w_mlp=w_mlp, branch_chunk=self.knapspec.branch_chunk, reuse_stacked=reuse,
                                reference_kv=self.knapspec.reference_kv)
            choose_plan(cands.masks, cands.alpha, self.latency, n, gammas=self.knapspec.plan_gammas)
            jax.block_until_ready(cands.alpha)
            return time.perf_counter() - start

        plan(False)
        plan(True)
        times = {"restack_each_plan_s": [], "reuse_stacked_s": []}
        for _ in range(repeats):
            times["restack_each_plan_s"].append(plan(False))
            times["reuse_stacked_s"].append(plan(True))
        return {"reference_tokens": r * self.batch, "w_attn": w_attn, "w_mlp": w_mlp, **times,
                "median_restack_s": float(np.median(times["restack_each_plan_s"])),
                "median_reuse_s": float(np.median(times["reuse_stacked_s"]))}


    def dp_attention_check(self, repeats: int) -> Dict[str, Any]:
        """The DP of this run's planning shape (its plan rows, its search tokens or
        ``--candidate-reference-tokens``; the prompts' last tokens as the window, as a plan at the start
        makes it) with the reference attention and with ``--dp-attention``'s kernel, interleaved
        ``repeats`` times after a warm-up of each: the DP's seconds and whether the two agree (trace,
        masks, values, alphas; docs/methods.md §4.3)."""
        import jax.numpy as jnp

        from jaxspec.knapspec.dp import boundary_states, knapsack_dp, knapsack_weights
        from jaxspec.knapspec.policy import cache_rows, dp_history_backend

        cache = self.prefill()[0]
        folded = dp_history_backend(self.knapspec)
        rows = list(range(min(int(self.knapspec.plan_rows or self.batch), self.batch)))
        width = int(self.knapspec.search_tokens or self.args.candidate_reference_tokens)
        lengths = np.asarray([len(self.prompts[b]) for b in rows])
        tokens = jnp.asarray(np.stack([np.asarray(self.prompts[b][n - width:n]) for b, n in zip(rows, lengths)]),
                             jnp.int32)
        prefix = jnp.asarray(lengths - width, jnp.int32)
        if len(rows) < self.batch:
            cache = cache_rows(cache, rows)
        cfg = self.model.config
        states = boundary_states(self.model.params, cfg, tokens, cache, prefix)
        n = float(self.capacity)
        w_attn, w_mlp = knapsack_weights(self.latency.t_attn(n), self.latency.t_mlp())

        def dp(backend, rows_per_call=None):
            start = time.perf_counter()
            cands = knapsack_dp(self.model.params, cfg, cache, prefix, states, None, w_attn=w_attn, w_mlp=w_mlp,
                                reference_kv=self.knapspec.reference_kv, history_backend=backend,
                                history_rows=rows_per_call)
            return time.perf_counter() - start, cands  # knapsack_dp returns host arrays: the DP has finished

        def agreement(got, ref):
            valid, same_shape = ref.trace.valid, got.masks.shape == ref.masks.shape
            same_valid = bool(np.array_equal(got.trace.valid, valid))
            return {"same_valid": same_valid, "same_masks": bool(same_shape and np.array_equal(got.masks, ref.masks)),
                    "max_value_diff": float(np.max(np.abs(got.trace.values[valid] - ref.trace.values[valid])))
                    if same_valid and valid.any() else None,
                    "max_alpha_diff": float(np.max(np.abs(got.alpha - ref.alpha))) if same_shape else None}

        _, ref = dp(None)
        _, got = dp(folded)
        times = {"reference_s": [], "folded_s": []}
        for _ in range(repeats):
            times["reference_s"].append(dp(None)[0])
            times["folded_s"].append(dp(folded)[0])
        # the kernel's rows per call (each call reads the cache once): larger blocks than its default, each
        # compiled and checked first; a block the device cannot hold is recorded, not fatal
        blocks = {}
        for rows_per_call in DP_CHECK_ROW_BLOCKS:
            try:
                _, other = dp(folded, rows_per_call)
                seconds = [dp(folded, rows_per_call)[0] for _ in range(repeats)]
            except Exception as err:  # noqa: BLE001 -- a compile or resource error of this block size
                blocks[str(rows_per_call)] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                continue
            blocks[str(rows_per_call)] = {"seconds": seconds, "median_s": float(np.median(seconds)),
                                          **agreement(other, ref)}
        return {"dp_attention": folded, "rows": len(rows), "search_tokens": width, "budget": ref.budget,
                "w_attn": w_attn, "w_mlp": w_mlp, **times,
                "median_reference_s": float(np.median(times["reference_s"])),
                "median_folded_s": float(np.median(times["folded_s"])), **agreement(got, ref),
                "kernel_rows_per_call": blocks}


# ---------------------------------------------------------------------------- driver
def _latency_profile(args, model: Model, batch: int, max_capacity: int, profile_dir: pathlib.Path):
    from jaxspec.knapspec.latency import (device_name, forward_contexts, load_or_profile, profile_latency,
                                          profile_latency_forward)


    fit = getattr(args, "latency_fit", "isolated")
    name = model.source.replace("random:", "random-").replace("/", "_")
    layers = f"-L{model.config.num_layers}" if not model.real else ""
    backend = getattr(args, "attention_backend", "auto")
    backend = f"_{backend}" if backend != "auto" else ""  # profiles of the default backend keep their names
    stem = f"latency_{name}{layers}_{model.config.dtype}{backend}_{args.device_tag}_b{batch}"
    path = profile_dir / f"{stem}_{fit}.json"
    legacy = profile_dir / f"{stem}.json"  # isolated profiles saved before the fit method was in the name
    if fit == "isolated" and not path.exists() and legacy.exists():
        path = legacy

    def measure(cfg, b, **kwargs):
        if fit.startswith("forward"):
            contexts = forward_contexts(max_capacity)
            print(f"profiling whole-forward latency ({fit}) on {device_name()} (batch {b}, contexts {contexts}) -> "
                  f"{path}", file=sys.stderr, flush=True)
            return profile_latency_forward(cfg, b, contexts, params=model.params,
                                           **_forward_fit_kwargs(fit), **kwargs)
        contexts = profile_contexts(max_capacity)
        print(f"profiling sub-layer latency on {device_name()} (batch {b}, contexts {contexts}) -> {path}",
              file=sys.stderr, flush=True)
        return profile_latency(cfg, b, contexts, **kwargs)

    profile = load_or_profile(path, model.config, batch, profile_fn=measure, method=fit, remeasure=getattr(args, "reprofile", False))
    if max(profile.contexts) < max_capacity:  # saved for shorter contexts: measure again over the full range
        profile = load_or_profile(path, model.config, batch, profile_fn=measure, method=fit, remeasure=True)
    return profile, path


def _static_plan(args, model: Model, profile, knapspec, context_n: float):
    from jaxspec.baselines.static_skip import calibrate_static_skip

    if model.real:
        calibration = _book_ids(model.tokenizer, CALIBRATION_BOOK, 512)
    else:
        calibration = np.random.default_rng(args.seed + 1).integers(0, model.config.vocab_size, 512).tolist()
    return calibrate_static_skip(model.params, model.config, calibration, latency=profile.model, knapspec=knapspec,
                                 reference_tokens=64, context_n=context_n)


#: the latency fields a results file keeps per batch (``latency_b{batch}``), enough to plan as it did
SAVED_LATENCY_FIELDS = ("method", "forward", "contexts", "attn_times", "mlp_time", "token_time", "verify_rows",
                        "verify_times")


def resumed_latency_profile(writer, batch: int, profile, path):
    """A resumed results file keeps one latency model per batch: its cases were planned with the model it
    saved (``latency_b{batch}``). If the profile at ``path`` now gives another (measured again for a longer
    context by another step, or a newer format), the rest of the file's cases are planned with the saved one
    (returned in place of ``profile``, with a note); a file that saved too little to plan with is refused
    before any case runs rather than mix plans of two models in one file."""
    from jaxspec.knapspec.latency import LatencyModel

    saved = writer.previous.get(f"latency_b{batch}") or {}
    old, fit = saved.get("fit"), profile.model.as_dict()
    if old is None or not any(f"/b{batch}/" in key for key in writer.data["cases"]):
        return profile
    differ = sorted(k for k in set(old) | set(fit) if not np.isclose(old.get(k, 0.0), fit.get(k, 0.0), rtol=1e-9))
    if not differ:
        return profile
    if any(field not in saved for field in SAVED_LATENCY_FIELDS):
        raise ValueError(f"{writer.path} holds batch-{batch} cases planned with another latency model than {path} "
                         f"gives now (differs in: {', '.join(differ)}) and does not keep enough of it to plan with; "
                         f"pass another --out (or move the file away) so one file holds one model")
    print(f"[resume] batch {batch}: planning with the latency model {writer.path}'s cases were planned with; {path} "
          f"gives another now (differs in: {', '.join(differ)})", file=sys.stderr, flush=True)
    return dataclasses.replace(profile, model=LatencyModel(**{k: float(v) for k, v in old.items()}),
                               **{field: saved[field] for field in SAVED_LATENCY_FIELDS})


def experiment_knapspec_config(args, branch_chunk=None):
    """The experiment's KnapSpecConfig (``--gamma-max``, ``--gamma-buckets``, the planning budget)."""
    from jaxspec.knapspec.policy import KnapSpecConfig

    return KnapSpecConfig(gamma_max=args.gamma_max, gamma_buckets=parse_gamma_buckets(args.gamma_buckets,
                                                                                      "--gamma-buckets"),
                          branch_chunk=branch_chunk, max_reference_tokens=args.max_reference_tokens,
                          max_plan_fraction=plan_fraction(args.max_plan_fraction, "--max-plan-fraction"),
                          probe_rounds=args.probe_rounds or None, probe_warmup=args.probe_warmup,
                          probe_pricing=args.probe_pricing,
                          reference_kv=args.reference_kv,
                          static_plans=args.static_plans, search_tokens=args.search_tokens,
                          finalists=args.finalists, reference_floor=args.reference_floor, plan_rows=args.plan_rows,
                          plan_at_start=args.plan_at_start, plan_after_plain=args.plan_after_plain,
                          plan_cost_scale=args.plan_cost_scale,
                          dp_attention=args.dp_attention, rescore=args.rescore, dp_segments=args.dp_segments,
                          start_states=args.start_states, weight_cap=args.weight_cap)


def check_knapspec_args(args) -> None:
    """Every flag of the ``knapspec`` experiment, before the model loads or latency is profiled."""
    for flag in ("max_new_tokens", "long_prompt", "long_new_tokens", "gamma_max", "dp_segments", "weight_cap"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be >= 1")
    for flag in ("layers", "max_reference_tokens", "branch_chunk", "clasp_skip_count"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be >= 1 (or left out)")
    check_two_stage(args.search_tokens, args.finalists, reference_floor=args.reference_floor, plan_rows=args.plan_rows,
                    plan_at_start=args.plan_at_start, plan_after_plain=args.plan_after_plain)
    check_dp_attention(args.dp_attention, args.reference_kv, args.branch_chunk)
    if args.dp_attention_check < 0:
        raise ValueError(f"--dp-attention-check={args.dp_attention_check}: must be >= 0 (repeats; 0 = skip)")
    if args.dp_attention_check and args.dp_attention == "xla":
        raise ValueError("--dp-attention-check compares the DP's kernel attention with the reference: give "
                         "--dp-attention pallas (GPU) or pallas-interpret")
    methods = {m.strip() for m in args.methods.split(",") if m.strip()}
    replanning = [flag for flag, on in (("--search-tokens", args.search_tokens is not None),
                                        ("--reference-floor", args.reference_floor is not None),
                                        ("--plan-at-start", args.plan_at_start),
                                        (f"--dp-attention {args.dp_attention}", args.dp_attention != "xla")) if on]
    if methods and methods <= {"knapspec-budget"} and replanning:
        raise ValueError(f"{', '.join(replanning)}: options of the re-planning KnapSpec's DP; knapspec-budget plans once "
                         f"before the first round with the three-choice DP on --candidate-reference-tokens tokens a "
                         f"row (docs/methods.md §5.4): drop them")
    if args.layers is not None and not args.model.startswith("random:"):
        raise ValueError(f"--layers is for random:PRESET models only; {args.model!r} has its own layer count")
    if not 0 <= args.attention_sinks < args.attention_budget:
        raise ValueError(f"--attention-budget={args.attention_budget} / --attention-sinks={args.attention_sinks}: "
                         f"need 0 <= sinks < budget")
    if args.candidate_reference_tokens < 1:
        raise ValueError(f"--candidate-reference-tokens={args.candidate_reference_tokens}: must be >= 1")
    negative = [f"--{k.replace('_', '-')}={getattr(args, k)}"
                for k in ("candidate_plans", "plan_cost_repeats", "probe_rounds", "probe_warmup") if getattr(args, k) < 0]
    if negative:
        raise ValueError(f"{', '.join(negative)}: must be >= 0")
    if args.candidate_repeats < 1:
        raise ValueError(f"--candidate-repeats {args.candidate_repeats}: give a number of (AR, plan) pairs >= 1")
    if args.candidate_plans > 2 and args.search_tokens is not None and args.finalists < args.candidate_plans:
        # a two-stage plan hands back only its finalists as candidates (and Pearson needs three plans)
        print(f"warning: --candidate-plans={args.candidate_plans} with --search-tokens: the two-stage planner hands "
              f"back only its --finalists={args.finalists} plans, so at most {args.finalists} are timed; give "
              f"--finalists >= {args.candidate_plans} for that many", file=sys.stderr, flush=True)
    if args.plan_cost_scale_from:
        if args.plan_cost_scale != 1.0:
            raise ValueError(f"--plan-cost-scale {args.plan_cost_scale:g} and --plan-cost-scale-from: give one "
                             f"(the second measures the first from earlier plans)")
        sources = [s.strip() for s in args.plan_cost_scale_from.split(",") if s.strip()]
        # --dp-attention is checked above: its value names the DP's attention as plan records do
        args.plan_cost_scale = plan_cost_scale_from(sources, args.model, args.device_tag, args.dp_attention)
    experiment_knapspec_config(args)  # the planner's own checks


def plan_cost_scale_from(paths: Sequence[str], model: str, device_tag: Optional[str],
                         dp_attention: Optional[str] = None) -> float:
    """The largest measured / predicted time of the plans recorded in knapspec results files of ``model``
    (and ``device_tag`` when given): the price the planning allowance should have put on them
    (docs/methods.md §5.6). A file planned with a scale already has it in its predictions, so its ratios
    are multiplied by it. ``dp_attention`` (the run's, resolved): KnapSpec plans made with another DP
    attention are refused (a plan record without the field ran the reference, ``"xla"``)."""
    ratios = []
    for path in paths:
        path = pathlib.Path(path)
        if not path.is_file():
            raise ValueError(f"--plan-cost-scale-from {path}: no such file")
        data = json.loads(path.read_text())
        config = data.get("config", {})
        if data.get("experiment") != "knapspec":
            raise ValueError(f"--plan-cost-scale-from {path}: not a knapspec results file "
                             f"(experiment {data.get('experiment')!r})")
        if config.get("model") != model:
            raise ValueError(f"--plan-cost-scale-from {path}: its plans are of model {config.get('model')!r}, this "
                             f"run's is {model!r}")
        if device_tag and config.get("device_tag") != device_tag:
            raise ValueError(f"--plan-cost-scale-from {path}: measured on {config.get('device_tag')!r}, this run is "
                             f"tagged {device_tag!r}")
        scale = float(config.get("plan_cost_scale", 1.0))
        for case in data.get("cases", {}).values():
            for plan in (case.get("plans") or []) if isinstance(case, dict) else []:
                used = plan.get("dp_attention", "xla")
                if dp_attention and plan.get("planner", "knapspec") == "knapspec" and used != dp_attention:
                    raise ValueError(f"--plan-cost-scale-from {path}: its plans ran the DP with {used!r} attention, "
                                     f"this run's is {dp_attention!r} (--dp-attention): their cost does not carry "
                                     f"over")
                if plan.get("predicted_seconds") and plan.get("seconds"):
                    ratios.append(scale * plan["seconds"] / plan["predicted_seconds"])
    if not ratios:
        raise ValueError(f"--plan-cost-scale-from {', '.join(map(str, paths))}: no plan with a predicted time in "
                         f"these files")
    return max(ratios)


def cmd_knapspec(args) -> Dict[str, Any]:
    import jax

    tasks = _names(args.tasks, TASKS, "tasks")
    methods = _names(args.methods, METHODS, "methods")
    contexts = _ints(args.contexts, "contexts")
    batches = _ints(args.batches, "batches")
    args.device_tag = args.device_tag or jax.default_backend()  # before the checks: --plan-cost-scale-from matches it
    check_knapspec_args(args)
    writer = ResultWriter(args.out, "knapspec", _config_of(args))
    model = load(args)
    if "clasp" in methods:
        check_clasp_skip_count(args.clasp_skip_count, model.config.num_layers)
    profile_dir = pathlib.Path(args.profile_dir) if args.profile_dir else (
        pathlib.Path(args.out).parent if args.out else REPO / "experiments" / "results")
    cases = []
    for task in tasks:
        if task == "summarize":
            cases += [(task, c, args.max_new_tokens) for c in contexts]
        else:
            cases.append((task, args.long_prompt, args.long_new_tokens))
    max_capacity = max(c + n + args.gamma_max + 2 for _, c, n in cases)
    for batch in batches:
        profile, path = _latency_profile(args, model, batch, max_capacity, profile_dir)
        profile = resumed_latency_profile(writer, batch, profile, path)
        m = profile.model
        print(f"latency (batch {batch}, {profile.method} fit): t_mlp = {m.c1 * 1e6:.1f} us, "
              f"t_attn(n) = {m.c2 * 1e9:.3f} ns * n + {m.c3 * 1e6:.1f} us, "
              f"t_token = {m.c0 * 1e6:.1f} us{_token_slope(m)}, "
              f"verify row cost v = {m.v:.3f}",
              file=sys.stderr, flush=True)
        writer.set(f"latency_b{batch}", {"path": str(path), "device": profile.device, "fit": m.as_dict(),
                                         "method": profile.method, "forward": profile.forward,
                                         "contexts": profile.contexts, "attn_times": profile.attn_times,
                                         "mlp_time": profile.mlp_time, "token_time": profile.token_time,
                                         "verify_rows": profile.verify_rows, "verify_times": profile.verify_times})
        static_plan = None
        for task, context, max_new in cases:
            case = Case(args, model, writer, profile, task, context, max_new, batch, static_plan)
            if "static-skip" in methods and static_plan is None:
                key = f"{args.device_tag}/static_plan/b{batch}"
                if writer.has(key):
                    from jaxspec.baselines.static_skip import StaticSkipPlan

                    saved = writer.get(key)
                    static_plan = StaticSkipPlan(np.asarray(saved["mask"], bool), saved["gamma"], saved["config"],
                                                 saved["source"])
                else:
                    static_plan = _static_plan(args, model, profile, case.knapspec, float(case.capacity))
                    writer.add(key, {"mask": static_plan.mask.tolist(), "gamma": static_plan.gamma,
                                     "config": static_plan.config, "source": static_plan.source})
                print(f"[static skip set] {static_plan.summary()}", file=sys.stderr, flush=True)
                case.static_plan = static_plan
            run_case(case, methods)
            # a case's programs serve its cache capacity only: drop them (and the heap their compiles left),
            # or a run over several contexts with fixed candidate plans outgrows the host's memory
            release_memory(clear_compiled=True)
    report(writer.data)
    if args.plot:
        plot(writer.data, args.plot)
    return writer.data


def run_case(case: Case, methods: Sequence[str]) -> None:
    writer, key, args = case.writer, case.key, case.args
    for method in methods:
        k = f"{key}/{method}"
        if writer.has(k):
            continue
        start = time.perf_counter()
        out = case.run_method(method)
        writer.add(k, out)
        print(f"[{k}] {out['tokens_per_s']:.1f} tok/s vs AR {out['ar_tokens_per_s']:.1f} "
              f"({out['speedup_vs_ar']:.2f}x), tau {out['tau'] if out['tau'] is None else round(out['tau'], 2)}, "
              f"plans {[(p['n_skip_attn'], p['n_skip_mlp'], p['gamma_used']) for p in out['plans']]}, planning "
              f"{100 * out['plan_fraction_of_decode']:.1f} %, identical {out['identical_to_ar']} "
              f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    if args.dp_attention_check and not writer.has(f"{key}/dp_attention"):
        out = case.dp_attention_check(args.dp_attention_check)
        writer.add(f"{key}/dp_attention", out)
        print(f"[{key}/dp_attention] DP on {out['rows']} rows x {out['search_tokens']} tokens: reference "
              f"{out['median_reference_s']:.3f} s, {out['dp_attention']} {out['median_folded_s']:.3f} s, same masks "
              f"{out['same_masks']}", file=sys.stderr, flush=True)
    if args.plan_cost_repeats and not writer.has(f"{key}/plan_cost"):
        out = case.plan_cost(args.plan_cost_repeats)
        writer.add(f"{key}/plan_cost", out)
        print(f"[{key}/plan_cost] restack {out['median_restack_s']:.3f} s, reuse {out['median_reuse_s']:.3f} s",
              file=sys.stderr, flush=True)
    if args.candidate_plans:
        if not writer.has(f"{key}/candidates"):
            writer.add(f"{key}/candidates", case.candidates())
        chosen = writer.get(f"{key}/candidates")["plan"].get("index")
        cands = writer.get(f"{key}/candidates")["candidates"]
        pool = [c for c in cands if c["weight"] > 0] or cands
        picks = {int(round(i)) for i in np.linspace(0, len(pool) - 1, min(args.candidate_plans, len(pool)))}
        picks = sorted(picks | {i for i, c in enumerate(pool) if c["index"] == chosen})  # and the planner's choice
        for i in picks:
            c = pool[i]
            k = f"{key}/fixed/w{c['weight']}"
            if writer.has(k):
                continue
            runs = [case.run_method("fixed", initial_plan=(np.asarray(c["mask"], bool), c["gamma"]))
                    for _ in range(args.candidate_repeats)]
            # the median pair (the lower middle one for an even count) stands for the plan; every pair is kept
            out = dict(sorted(runs, key=lambda r: r["speedup_vs_ar"])[(len(runs) - 1) // 2])
            if len(runs) > 1:
                out["pairs"] = [{k: r[k] for k in ("speedup_vs_ar", "tokens_per_s", "ar_tokens_per_s",
                                                   "acceptance_rate")} for r in runs]
            out.update(candidate=c["index"], weight=c["weight"], predicted_tpt=c["predicted_tpt"],
                       dp_alpha=c["alpha"], gamma=c["gamma"],
                       **{k: c[k] for k in ("alpha_branch", "alpha_target", "exit_aware_tpt", "p_c", "p_ac",
                                            "predicted_tpt_no_exit") if k in c})
            writer.add(k, out)
            print(f"[{k}] predicted TPT {c['predicted_tpt']:.1f}, alpha {c['alpha']:.2f} -> "
                  f"{out['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
        fixed = [writer.get(k) for k in writer.data["cases"] if k.startswith(f"{key}/fixed/")]
        writer.add(f"{key}/correlation", correlation(fixed))
    case.prefilled = None


def correlation(fixed: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Pearson correlations across fixed plans. Raw throughput follows the machine's load as much
    as the plan on a shared CPU; the speed-up over the AR run paired with each plan (decoded just
    before it) is the load-normalised throughput, so both are reported. The predicted speed-up is
    the predicted TPT times the latency model's own AR step (``t_step``) -- nothing measured."""
    tput = [f["tokens_per_s"] for f in fixed]
    speedup = [f["speedup_vs_ar"] for f in fixed]
    tpt = [f["predicted_tpt"] for f in fixed]
    alpha = [f["dp_alpha"] for f in fixed]
    measured = [f["acceptance_rate"] for f in fixed]
    errors = {}
    for mode in ("branch", "target"):  # each reference's acceptance estimate against the measured acceptance
        if all(f"alpha_{mode}" in f for f in fixed):
            est = [f[f"alpha_{mode}"] for f in fixed]
            errors[f"alpha_{mode}"] = est
            errors[f"alpha_{mode}_mean_abs_error"] = float(np.mean(np.abs(np.subtract(est, measured)))) if fixed \
                else None
            errors[f"alpha_{mode}_mean_error"] = float(np.mean(np.subtract(est, measured))) if fixed else None
    no_exit = {}
    if fixed and all("predicted_tpt_no_exit" in f for f in fixed):  # the exit-free TPT of §4.2 beside it
        plain = [f["predicted_tpt_no_exit"] for f in fixed]
        no_exit = {"exit_aware_tpt": bool(fixed[0].get("exit_aware_tpt")),
                   "pearson_predicted_tpt_no_exit_vs_throughput": pearson(plain, tput),
                   "pearson_predicted_tpt_no_exit_vs_speedup": pearson(plain, speedup)}
    return {"plans": len(fixed), **errors, **no_exit,
            "pearson_predicted_tpt_vs_throughput": pearson(tpt, tput),
            "pearson_dp_alpha_vs_throughput": pearson(alpha, tput),
            "pearson_measured_acceptance_vs_throughput": pearson([f["acceptance_rate"] for f in fixed], tput),
            "pearson_measured_acceptance_vs_speedup": pearson([f["acceptance_rate"] for f in fixed], speedup),
            "pearson_predicted_tpt_vs_speedup": pearson(tpt, speedup),
            "pearson_dp_alpha_vs_speedup": pearson(alpha, speedup),
            "predicted_speedup": [t * f["predicted_ar_step_s"] for t, f in zip(tpt, fixed)],
            "measured_speedup": speedup, "dp_alpha": alpha,
            "measured_acceptance": [f["acceptance_rate"] for f in fixed], "tokens_per_s": tput}


# ---------------------------------------------------------------------------- report and plot
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


# ---------------------------------------------------------------------------- one plan's stages, timed alone
def check_bench_plan_args(args) -> Tuple[List[int], int, int, List[int]]:
    """``bench-plan``'s numbers before any model loads: ``(contexts, w_attn, w_mlp, DP segment counts)``."""
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c]
        w_attn, w_mlp = (int(w) for w in args.weights.split(","))
    except ValueError:
        raise ValueError(f"--contexts {args.contexts!r} / --weights {args.weights!r}: expected comma-separated "
                         f"integers (--weights: exactly two, W_ATTN,W_MLP)") from None
    if not contexts or min(contexts) < 1:
        raise ValueError(f"--contexts {args.contexts!r}: each must be >= 1")
    if min(w_attn, w_mlp) < 1:
        raise ValueError(f"--weights {args.weights!r}: both must be >= 1")
    for name in ("rows", "window", "search_tokens", "finalists", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.search_tokens >= args.window:
        raise ValueError(f"--search-tokens={args.search_tokens} must be below --window={args.window} (a two-stage "
                         f"plan searches on a prefix of the window)")
    if not 0 < args.exit_threshold < 1:
        raise ValueError(f"--exit-threshold={args.exit_threshold}: must be in (0, 1)")
    if args.layers is not None and not args.model.startswith("random:"):
        raise ValueError(f"--layers is for random:PRESET models only; {args.model!r} has its own layer count")
    if args.masks_from:
        if not pathlib.Path(args.masks_from).is_file():
            raise ValueError(f"--masks-from {args.masks_from}: no such file")
        plan_masks_from(args.masks_from, 10 ** 6, 1)  # it holds plans (their layers: checked once the model loads)
    check_dp_attention(args.dp_attention)
    try:
        segment_counts = [int(k) for k in args.dp_segments.split(",") if k]
    except ValueError:
        raise ValueError(f"--dp-segments {args.dp_segments!r}: expected comma-separated integers >= 1") from None
    if not segment_counts or min(segment_counts) < 1 or len(set(segment_counts)) != len(segment_counts):
        raise ValueError(f"--dp-segments {args.dp_segments!r}: expected distinct integers >= 1")
    return contexts, w_attn, w_mlp, segment_counts


def plan_masks_from(path: str, num_layers: int, count: int) -> np.ndarray:
    """``[count, L, 2]`` skip masks from the plans of a ``knapspec`` results file (``skip_attn`` / ``skip_mlp`` of
    every case's plans, in order, distinct ones only, the first repeated to fill ``count``); a ValueError names
    the file when it holds no plan or a plan outside ``num_layers`` layers."""
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--masks-from {path}: cannot read a results file ({err})") from None
    masks, seen = [], set()
    for case in (data.get("cases") or {}).values():
        for plan in (case.get("plans") or []) if isinstance(case, dict) else []:
            if plan.get("skip_attn") is None or plan.get("skip_mlp") is None:
                continue
            key = (tuple(plan["skip_attn"]), tuple(plan["skip_mlp"]))
            if key in seen:
                continue
            if max(key[0] + key[1], default=0) >= num_layers:
                raise ValueError(f"--masks-from {path}: a plan skips layer {max(key[0] + key[1])}, but the model has "
                                 f"{num_layers} layers")
            seen.add(key)
            mask = np.zeros((num_layers, 2), bool)
            mask[list(key[0]), 0] = True
            mask[list(key[1]), 1] = True
            masks.append(mask)
    if not masks:
        raise ValueError(f"--masks-from {path}: no plan with skip_attn / skip_mlp in its cases")
    masks = masks[:count]
    return np.stack(masks + [masks[0]] * (count - len(masks)))


def dp_stage(segments: int) -> str:
    """bench-plan's name of the DP stage timed with ``segments`` runs (``dp`` for one scan of every slot)."""
    return "dp" if segments == 1 else f"dp_{segments}seg"


def _finalist_masks(masks: np.ndarray, finalists: int) -> np.ndarray:
    """``finalists`` of the DP's candidate masks spread over its skipped weights, leaving out the first (it
    skips nothing, so its executed-only forward runs nothing) unless there is no other."""
    pool = masks[1:] if len(masks) > 1 else masks
    index = np.unique(np.linspace(0, len(pool) - 1, finalists).round().astype(int))
    return pool[index]


def cmd_reprice_tpt(args) -> Dict[str, Any]:
    """A TPT-correlation run's candidate plans (``knapspec --candidate-plans``) priced again as the planner prices
    them -- the exit-free TPT at each candidate's gamma, at the candidates' context -- with the DP's alpha and with
    the measured acceptance in its place, by the run's own latency profile and by each ``--profiles`` file; the
    Pearson of each with the measured tokens/s. It tells which side of the prediction, the acceptance estimate or
    the latency model, holds the correlation back (docs/methods.md §4.1). No device work."""
    from jaxspec.knapspec.latency import LatencyModel, LatencyProfile
    from jaxspec.knapspec.planner import objective_table

    source = pathlib.Path(args.source)
    if not source.is_file():
        raise ValueError(f"--from={args.source}: no such results file")
    extra = [pathlib.Path(x) for x in (args.profiles or "").split(",") if x.strip()]
    missing = [str(x) for x in extra if not x.is_file()]
    if missing:
        raise ValueError(f"--profiles: no such latency profile {missing[0]}")
    data = json.loads(source.read_text())
    if "latency_b1" not in data or not any(k.endswith("/correlation") for k in data.get("cases", {})):
        raise ValueError(f"--from={args.source}: not a knapspec TPT-correlation run (no batch-1 latency profile and "
                         f"correlation case)")
    cases = {}  # correlation case key -> (candidates, correlation): those with >= 3 plans, all candidates timed
    for key, corr in data["cases"].items():
        cands = data["cases"].get(key[: -len("correlation")] + "candidates") if key.endswith("/correlation") else None
        if cands and corr.get("plans", 0) >= 3 and len(cands.get("candidates") or []) == len(corr["tokens_per_s"]):
            cases[key] = (cands, corr)
    if not cases:
        raise ValueError(f"--from={args.source}: no correlation case with >= 3 candidate plans")
    models = [(data["latency_b1"]["path"], data["latency_b1"].get("method"), LatencyModel(**data["latency_b1"]["fit"]))]
    for path in extra:
        profile = LatencyProfile.load(path)
        models.append((str(path), profile.method, profile.model))
    writer = ResultWriter(args.out, "reprice-tpt", config_of(args))
    for key, (cands, corr) in cases.items():
        rows, n, tput = cands["candidates"], float(cands["plan"]["n"]), corr["tokens_per_s"]
        out_rows = []
        for path, method, model in models:
            for alpha_source, alphas in (("dp", [r["alpha"] for r in rows]), ("measured", corr["measured_acceptance"])):
                tpt = [float(objective_table(np.asarray([r["mask"]], bool), [a], model.t_attn(n), model.t_mlp(),
                                             (int(r["gamma"]),), "tpt", model.t_token(n), model.v, model.a)[0, 0])
                       for r, a in zip(rows, alphas)]
                out_rows.append({"profile": path, "method": method, "alpha": alpha_source, "predicted_tpt": tpt,
                                 "pearson_vs_throughput": pearson(tpt, tput)})
        case = key[: -len("correlation")] + "repriced"
        writer.add(case, {"source": str(source), "plans": len(rows), "n": n, "tokens_per_s": tput, "rows": out_rows})
        print_table([{k: v for k, v in r.items() if k != "predicted_tpt"} for r in out_rows],
                    title=f"{case}: the candidates' TPT priced again, Pearson with tokens/s")
    return writer.data


def cmd_bench_plan(args) -> Dict[str, Any]:
    """The stages of one two-stage plan (docs/methods.md §5.6) on one cache: the target's states of the
    window (``dp.boundary_states``), the DP on the first ``--search-tokens`` tokens (``dp.knapsack_dp``) and
    the finalists rescored on the whole window both ways (``dp.plan_agreement``: ``executed_only`` behind
    per-sub-layer conditionals, and the select form without them, ``KnapSpecConfig.rescore``), each compiled
    first and then timed ``--repeats`` times, interleaved; the two rescorings' statistics are compared. The
    cache holds seeded random K/V and the window random tokens: the stages' cost depends on the shapes, not on
    the values (the finalists' executed-only cost depends on where they first skip: the masks are recorded)."""
    import jax
    import jax.numpy as jnp

    from experiments.trace import trace_or_error
    from jaxspec.knapspec import dp
    from jaxspec.knapspec.dp import skip_budget
    from jaxspec.models.cache import init_cache

    contexts, w_attn, w_mlp, segment_counts = check_bench_plan_args(args)
    writer = ResultWriter(args.out, "bench-plan", config_of(args))
    model = load(args)
    params, config = model.params, model.config
    fixed_finals = plan_masks_from(args.masks_from, config.num_layers, args.finalists) if args.masks_from else None
    backend = None if args.dp_attention == "xla" else args.dp_attention
    rows_out = []
    for context in contexts:
        key = f"ctx{context}/r{args.rows}/w{args.window}/s{args.search_tokens}/f{args.finalists}"
        if writer.has(key):
            done = writer.get(key)
            rows_out.extend(done.get("table") or done["rows"])  # files written before "table" kept it in "rows"
            continue
        rng = jax.random.PRNGKey(args.seed + context)
        cache = init_cache(config, args.rows, context + args.window)
        keys, values = [], []
        for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
            rk, rv = jax.random.split(jax.random.fold_in(rng, i))
            keys.append(jax.random.normal(rk, k.shape, k.dtype))
            values.append(jax.random.normal(rv, v.shape, v.dtype))
        prefix = jnp.full((args.rows,), context, jnp.int32)
        cache = dataclasses.replace(cache, keys=tuple(keys), values=tuple(values), lengths=prefix)
        tokens = jax.random.randint(jax.random.fold_in(rng, 10 ** 6), (args.rows, args.window), 0, config.vocab_size)
        mask = np.ones((args.rows, args.window), np.float32)
        s = args.search_tokens

        def states_fn():
            return dp.boundary_states(params, config, tokens, cache, prefix)

        states = jax.block_until_ready(states_fn())

        def dp_fn(segments):
            return lambda: dp.knapsack_dp(params, config, cache, prefix, states[:, :, :s], mask[:, :s], w_attn=w_attn,
                                          w_mlp=w_mlp, exit_threshold=args.exit_threshold, history_backend=backend,
                                          segments=segments)

        dps = {count: dp_fn(count) for count in segment_counts}
        found = {count: fn() for count, fn in dps.items()}  # compiled; each segment count finds the same candidates
        candidates = found[segment_counts[0]]
        finals = fixed_finals if fixed_finals is not None else _finalist_masks(candidates.masks, args.finalists)

        def rescore_fn(executed_only):
            return lambda: dp.plan_agreement(params, config, cache, prefix, states, finals, mask,
                                             exit_threshold=args.exit_threshold, executed_only=executed_only)

        stages = {"boundary_states": states_fn, **{dp_stage(count): fn for count, fn in dps.items()},
                  "rescore_executed": rescore_fn(True), "rescore_select": rescore_fn(False)}
        stats = {name: np.asarray(stages[name]()) for name in ("rescore_executed", "rescore_select")}  # compiled
        samples = {name: [] for name in stages}
        for _ in range(args.repeats):  # interleaved: drift on the machine touches every stage alike
            for name, fn in stages.items():
                start = time.perf_counter()
                jax.block_until_ready(fn())  # the DP and the rescoring return host arrays: they end synced
                samples[name].append(time.perf_counter() - start)
        budget = skip_budget(w_attn, w_mlp, config.num_layers)
        result = {"context": context, "rows": args.rows, "window": args.window, "search_tokens": s,
                  "budget": budget, "candidates": len(candidates),
                  "dp_segments": {str(count): [list(run) for run in dp.slot_segments(
                      dp.scan_can_skip(config.num_layers), w_attn, w_mlp, budget, count)] for count in segment_counts},
                  # the DP's candidates with each segment count against the first's: the same masks, values within
                  # float rounding (a batch of fewer slots may round differently)
                  "dp_same_masks": all(np.array_equal(c.masks, candidates.masks) for c in found.values()),
                  "dp_max_cosine_diff": max(float(np.max(np.abs(c.cosine - candidates.cosine)))
                                            if c.masks.shape == candidates.masks.shape else float("inf")
                                            for c in found.values()),
                  "finalist_masks": {"skip_attn": [np.flatnonzero(m[:, 0]).tolist() for m in finals],
                                     "skip_mlp": [np.flatnonzero(m[:, 1]).tolist() for m in finals]},
                  "seconds_min": {n: min(v) for n, v in samples.items()},
                  "seconds_median": {n: float(np.median(v)) for n, v in samples.items()}, "samples_s": samples,
                  # (alpha, p_c, p_ac) per finalist: the same statistics either way, up to the dtype's rounding
                  "rescore_stats": {n: v.tolist() for n, v in stats.items()},
                  "rescore_max_abs_diff": float(np.max(np.abs(stats["rescore_executed"] - stats["rescore_select"])))}
        result["select_over_executed"] = result["seconds_min"]["rescore_select"] / result["seconds_min"][
            "rescore_executed"]
        if args.trace:
            traces = {}
            for name, fn in stages.items():
                summary = trace_or_error(fn, f"[bench-plan] {key} {name}")
                planes = summary.get("planes") or {}
                plane = next(iter(planes.values()), None)
                traces[name] = ({"error": summary["error"]} if "error" in summary else
                                {"wall_s": summary["wall_s"], "busy_s": plane["busy_s"] if plane else None,
                                 "launches": plane["launches"] if plane else None, "plane": next(iter(planes), None)})
            result["trace"] = traces
        rows = [{"context": context, "stage": n, "min ms": 1e3 * result["seconds_min"][n],
                 "median ms": 1e3 * result["seconds_median"][n],
                 **({"busy ms": 1e3 * (result["trace"][n].get("busy_s") or float("nan")),
                     "launches": result["trace"][n].get("launches")} if args.trace else {})} for n in stages]
        result["table"] = rows
        rows_out.extend(rows)
        writer.add(key, result)
        print(f"[bench-plan] {key}: " + ", ".join(f"{r['stage']} {r['min ms']:.1f} ms" for r in rows)
              + f"; select / executed {result['select_over_executed']:.2f}x, statistics differ by at most "
                f"{result['rescore_max_abs_diff']:.3g}", flush=True)
    print_table(rows_out, title=f"one two-stage plan's stages ({model.source}, {args.rows} row(s), {args.window}-token "
                                f"window, DP on {args.search_tokens} tokens)")
    return writer.data
