"""``generate --method knapspec | clasp | static-skip``: layer-skipping self-speculation (docs/methods.md §4).

Each runner takes ``(args, model, prompts, sampling, stops, out)``, fills ``out`` with its own
fields and returns a SpeculativeResult (``generate`` adds the fields every speculative method
shares: ``metrics``, ``gamma``, the AR comparison, tokens, text, ``tokens_per_s``, ``timings``).
Own fields (``out["knapspec"]``): the KnapSpec config, the latency profile used (file, device,
fit, measured now or loaded), the plan history (round, context length, skipped Attention vs MLP
sub-layers, gamma* and the gamma used, predicted TPT, alpha, seconds) and the planning time as a
fraction of the decode time (planning runs inside the timed decode).

Importing this module registers the methods (``knapspec``, ``clasp``, ``static-skip``, ``knapspec-budget``,
``knapspec-dustin``) and their options with :mod:`experiments.registry`. The options and their checks are in
``flags``, the latency profile comes from ``latency_profiles``.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Any, Dict, List

from experiments import registry
from experiments.common import load_choice_table, print_table
from experiments.knapspec.flags import (add_self_spec_args, check_clasp_skip_count, knapspec_config_from_args,
                                        validate_knapspec_dustin, validate_self_spec)
from experiments.knapspec.latency_profiles import load_latency

SELF_SPEC_METHODS = ("knapspec", "clasp", "static-skip", "knapspec-budget")
#: KnapSpec plans (the draft SRH layers' Attention kept executed) + Dustin verification (docs/methods.md §5.5);
#: reads the self-speculative options and the sparse ones (--budget, --dustin-profile, --dustin-mode, --draft-kv, ...)
KNAPSPEC_DUSTIN = "knapspec-dustin"


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
        table = (load_choice_table(args.knapspec_choice_table, args.model, "self", "--knapspec-choice-table")
                 if getattr(args, "knapspec_choice_table", None) else None)
        result = knapspec_generate(model.params, config, prompts, latency=latency, knapspec=knapspec,
                                   choice_table=table, **common)
        if table is not None:
            extra["choice_table"] = result.metrics.get("choice_table")
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
    decision = result.metrics.get("choice_table") or {}
    if decision.get("reason") == "table":
        print(f"{method}: the choice table's whole runs at context bucket {decision['context_bucket']}, batch "
              f"{decision['active_rows']} ran {decision['table_speedup']:.2f}x AR: "
              + ("no plan, decoded plainly" if decision["choice"] == "ar" else "planned as usual"), file=sys.stderr)
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
