"""``python -m experiments.run knapspec``: its flags (:func:`register`, which adds ``bench-plan`` and
``reprice-tpt`` too), the config its results record (:func:`_config_of`), its checks (:func:`check_knapspec_args`)
and its driver (:func:`cmd_knapspec`: the cases of every batch, :func:`run_case`, :func:`correlation`).

What the experiment measures is told in the package's docstring (``experiments/knapspec/__init__.py``), which is
also its ``--help``. A case is a :class:`~experiments.knapspec.case.Case`; the latency profiles come from
``latency_profiles``, the tables and the figure from ``reporting``, the planning flags it shares with ``generate``
from ``flags``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from experiments.common import REPO, ResultWriter, load_choice_table, release_memory
from experiments.knapspec.bench_plan import cmd_bench_plan, cmd_reprice_tpt
from experiments.knapspec.case import Case
from experiments.knapspec.flags import (DEFAULT_LATENCY_FIT, DP_SEGMENTS, LATENCY_FITS, REPROFILE_HELP, WEIGHT_CAP,
                                        add_planning_arguments, check_clasp_skip_count, check_dp_attention,
                                        check_two_stage, experiment_knapspec_config)
from experiments.knapspec.latency_profiles import latency_profile, resumed_latency_profile, token_slope
from experiments.knapspec.measure import pearson
from experiments.knapspec.model import CALIBRATION_BOOK, Model, book_ids, load
from experiments.knapspec.reporting import plot, report

METHODS = ("knapspec", "clasp", "static-skip", "knapspec-tpl", "knapspec-coupled", "knapspec-official",
           "knapspec-budget", "knapspec-target-ref")
TASKS = ("summarize", "long-generation")


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
                              description=sys.modules[__package__].__doc__,  # the package's docstring
                              formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--choice-table", default=None, metavar="FILE",
                   help="whole KnapSpec runs measured earlier (`python -m experiments.run choice-table --from` knapspec "
                        "results files) decide per context bucket and batch whether the re-planning methods plan at "
                        "all: where their runs were below 1 + margin of AR a run makes no plan and decodes plainly "
                        "(docs/methods.md §5.2); a key the table lacks plans as usual")
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
    b.add_argument("--dp-unrolled", action="store_true",
                   help="also time the DP traced once per layer on the model's own weights (knapspec --dp-layers "
                        "unrolled; docs/methods.md §4.3)")
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
    if args.dp_layers != "scan":  # named only when set, like reference_kv
        config["dp_layers"] = args.dp_layers
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
    if args.choice_table:  # named only when set, like reference_kv
        config["choice_table"] = args.choice_table
    return config


def _static_plan(args, model: Model, profile, knapspec, context_n: float):
    from jaxspec.baselines.static_skip import calibrate_static_skip

    if model.real:
        calibration = book_ids(model.tokenizer, CALIBRATION_BOOK, 512)
    else:
        calibration = np.random.default_rng(args.seed + 1).integers(0, model.config.vocab_size, 512).tolist()
    return calibrate_static_skip(model.params, model.config, calibration, latency=profile.model, knapspec=knapspec,
                                 reference_tokens=64, context_n=context_n)


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
                                        (f"--dp-attention {args.dp_attention}", args.dp_attention != "xla"),
                                        (f"--dp-layers {args.dp_layers}", args.dp_layers != "scan")) if on]
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
    if args.choice_table:
        load_choice_table(args.choice_table, args.model, "self", "--choice-table")
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
        profile, path = latency_profile(args, model, batch, max_capacity, profile_dir)
        profile = resumed_latency_profile(writer, batch, profile, path)
        m = profile.model
        print(f"latency (batch {batch}, {profile.method} fit): t_mlp = {m.c1 * 1e6:.1f} us, "
              f"t_attn(n) = {m.c2 * 1e9:.3f} ns * n + {m.c3 * 1e6:.1f} us, "
              f"t_token = {m.c0 * 1e6:.1f} us{token_slope(m)}, "
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
