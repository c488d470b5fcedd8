"""The flags of KnapSpec and its baselines, their checks before any model loads, and the KnapSpecConfig built from them.

* ``generate --method knapspec | clasp | static-skip | knapspec-budget | knapspec-dustin`` adds
  :func:`add_self_spec_args`, checked by :func:`validate_self_spec` (:func:`validate_knapspec_dustin`) and turned
  into a config by :func:`knapspec_config_from_args`; the runner is in ``self_spec``;
* the ``knapspec`` experiment (``experiment``) shares the planning flags (:func:`add_planning_arguments`, checked by
  :func:`check_two_stage` and :func:`check_dp_attention`) and builds its config with
  :func:`experiment_knapspec_config`.

This module loads no JAX at import (the CLI parses its flags without it): what needs jaxspec's JAX-side modules
imports them inside the function.
"""

from __future__ import annotations

import argparse

from experiments import registry
from experiments.common import DEMO_PROMPT_FILE, load_choice_table

#: ``--latency-fit`` default (see jaxspec.knapspec.latency)
DEFAULT_LATENCY_FIT = "forward"
DEFAULT_CALIBRATION_FILE = DEMO_PROMPT_FILE
#: ``--latency-fit`` choices: jaxspec.knapspec.latency.FIT_METHODS (kept here so the parser imports no jax; a test
#: holds the two equal)
LATENCY_FITS = ("isolated", "forward", "forward-static", "forward-half", "forward-static-half")
REPROFILE_HELP = ("measure the latency profile again even if a matching one is saved (a saved profile does not "
                  "record which code it timed); the old file is kept, renamed *.replaced-<time>.json. A resumed --out "
                  "still plans its remaining cases with the latency model it saved")


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
    group.add_argument("--knapspec-choice-table", default=None, metavar="FILE",
                       help="knapspec: whole KnapSpec runs measured earlier (a choice table built by `python -m "
                            "experiments.run choice-table --from` knapspec results files) decide per context bucket "
                            "and batch whether the run plans at all: where they ran below 1 + margin of AR it makes "
                            "no plan and decodes plainly (docs/methods.md §5.2)")
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
#: --[knapspec-]dp-layers' choices: jaxspec.knapspec.dp.DP_LAYERS (held equal by the same test)
DP_LAYERS = ("scan", "unrolled")


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
    add(f"--{prefix}dp-layers", choices=DP_LAYERS, default="scan",
        help="how the DP walks the layers: scan = one lax.scan over a stacked copy of the layer weights (default; in "
             f"--{prefix}dp-segments runs); unrolled = one traced step per layer on the model's own weights, each "
             "sub-layer on the slots it can reach (no stacked copy; faster on the CPU). The same candidates either "
             "way. docs/methods.md §4.3")
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
                          dp_layers=getattr(args, "knapspec_dp_layers", "scan"),
                          weight_cap=getattr(args, "knapspec_weight_cap", WEIGHT_CAP))


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
                          dp_layers=args.dp_layers, start_states=args.start_states, weight_cap=args.weight_cap)


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
    if getattr(args, "knapspec_choice_table", None):
        if args.method != "knapspec":
            raise ValueError(f"--knapspec-choice-table decides whether the re-planning KnapSpec plans; --method "
                             f"{args.method} does not re-plan: drop the option")
        load_choice_table(args.knapspec_choice_table, args.model, "self", "--knapspec-choice-table")
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
