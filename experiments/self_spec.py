"""``generate --method knapspec | clasp | static-skip``: layer-skipping self-speculation (SPEC 4).

Registered in :data:`experiments.foundation.METHOD_RUNNERS`; each runner takes
``(args, model, prompts, sampling, stops, out)``, fills ``out`` with its own fields and returns
a :class:`~jaxspec.decoding.speculative.SpeculativeResult` (the ``generate`` command adds the
fields every speculative method shares: ``metrics``, ``gamma``, the AR comparison, tokens,
text, ``tokens_per_s``, ``timings``).

Own fields (``out["knapspec"]``): the KnapSpec config, the latency profile used (file, device,
fit, measured now or loaded), the plan history (round, context length, skipped Attention vs
MLP sub-layers, gamma* and the gamma used, predicted TPT, alpha, seconds) and the planning time
as a fraction of the decode time (planning runs inside the timed decode).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import pathlib
import sys
from typing import Any, Dict, List

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_CALIBRATION_FILE = REPO / "experiments" / "prompts" / "long_demo.txt"
SELF_SPEC_METHODS = ("knapspec", "clasp", "static-skip")
#: ``--latency-fit`` default (see jaxspec.knapspec.latency)
DEFAULT_LATENCY_FIT = "forward"


def add_self_spec_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("knapspec / clasp / static-skip (layer-skipping self-speculation)")
    group.add_argument("--latency-profile", default=None, metavar="FILE",
                       help="sub-layer latency profile (JSON); measured now and saved there if missing or made on "
                            "another device/model/batch (default: a file in the jaxspec cache folder)")
    group.add_argument("--latency-fit", default=DEFAULT_LATENCY_FIT, choices=["isolated", "forward"],
                       help="latency model: 'forward' = fitted on whole forwards of the model as the engine runs "
                            "them; 'isolated' = each sub-layer timed alone (the profile file name holds the method)")
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
                       help="ablation: SPEC 4.2's TPT (every round drafts gamma tokens) instead of the early-exit-aware "
                            "TPT in the grid search")
    group.add_argument("--knapspec-official-gamma", action="store_true",
                       help="as the official code: always draft up to gamma-max with early exit (gamma* is only "
                            "reported; gamma* = 0 does not switch to plain decoding)")
    group.add_argument("--clasp-skip-count", type=int, default=None,
                       help="clasp: whole layers to skip (default by size: 4 ~1B, 8 3-8B, 10 14B, 20 32-70B)")
    group.add_argument("--static-skip-file", default=None, metavar="FILE",
                       help="static-skip: the offline skip set (JSON); calibrated and saved there if missing")
    group.add_argument("--calibration-file", default=str(DEFAULT_CALIBRATION_FILE),
                       help="static-skip: calibration text (its first --calibration-tokens tokens)")
    group.add_argument("--calibration-tokens", type=int, default=512)
    group.add_argument("--calibration-reference-tokens", type=int, default=64,
                       help="static-skip: the DP's reference = the last this many calibration tokens")


def add_planning_arguments(add, prefix: str = "") -> None:
    """The planning-budget and arbitration flags (``generate --knapspec-*`` and the ``knapspec``
    experiment share them): ``--{prefix}max-plan-fraction``, ``--{prefix}probe-rounds``."""
    add(f"--{prefix}max-plan-fraction", type=float, default=0.05,
        help="planning budget: postpone a re-plan while the previous plan cost more than this fraction of the decode "
             "time since it, and cap the DP's reference (or make no plan) so one plan's predicted cost fits it "
             "(<= 0: SPEC's fixed schedule, a plan every interval, no cap)")
    add(f"--{prefix}probe-rounds", type=int, default=8,
        help="measured arbitration: after a plan that drafts, time this many speculative rounds and as many "
             "plain-decoding steps, keep the faster until the next plan (0: off, SPEC 4)")


def _buckets(text: str):
    text = (text or "").strip()
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError as err:
        raise ValueError(f"--knapspec-gamma-buckets={text!r}: expected comma-separated integers") from err


def _plan_fraction(value):
    value = None if value is None or value <= 0 else float(value)
    if value is not None and value >= 1:
        raise ValueError(f"--knapspec-max-plan-fraction={value}: must be < 1 (or <= 0 for the fixed schedule)")
    return value


def knapspec_config_from_args(args):
    from jaxspec.knapspec.policy import KnapSpecConfig

    early = args.knapspec_early_exit
    return KnapSpecConfig(gamma_max=args.knapspec_gamma_max, early_exit=None if early <= 0 else early,
                          plan_interval=args.knapspec_interval, objective=args.knapspec_objective,
                          coupled=args.knapspec_coupled, honor_gamma=not args.knapspec_official_gamma,
                          gamma_buckets=_buckets(args.knapspec_gamma_buckets),
                          max_plan_fraction=_plan_fraction(args.knapspec_max_plan_fraction),
                          exit_aware_tpt=not getattr(args, "knapspec_spec_tpt", False),
                          probe_rounds=getattr(args, "knapspec_probe_rounds", 8) or None)


def validate(args) -> None:
    """Checks before any model loads."""
    if getattr(args, "mesh", None):
        raise ValueError(f"--method {args.method} runs on one device; drop --mesh")
    if args.knapspec_interval < 6:
        raise ValueError(f"--knapspec-interval={args.knapspec_interval} must be >= 6 (the DP runs at round 6)")
    if args.profile or args.fixed_tau:
        raise ValueError(f"--profile and --fixed-tau are sd options; --method {args.method} does not take them")
    knapspec_config_from_args(args)  # validates the knobs


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
        if fit == "forward":
            contexts = forward_contexts(n_max)
            print(f"profiling whole-forward latency of {cfg.name} on {device_name()} (batch {b}, contexts "
                  f"{contexts}); saving to {path} ...", file=sys.stderr, flush=True)
            profile = profile_latency_forward(cfg, b, contexts, params=params, **kwargs)
        else:
            contexts = profile_contexts(n_max)
            print(f"profiling sub-layer latency of {cfg.name} on {device_name()} (batch {b}, contexts {contexts}); "
                  f"saving to {path} ...", file=sys.stderr, flush=True)
            profile = profile_latency(cfg, b, contexts, **kwargs)
        measured.append(True)
        m = profile.model
        print(f"latency profile ({fit}): t_mlp = {m.c1 * 1e6:.1f} us, t_attn(n) = {m.c2 * 1e9:.3f} ns * n + "
              f"{m.c3 * 1e6:.1f} us, t_token = {m.c0 * 1e6:.1f} us, v = {m.v:.3f}", file=sys.stderr, flush=True)
        return profile

    profile: LatencyProfile = load_or_profile(path, config, batch, profile_fn=profile_fn, method=fit)
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


run_self_spec.validate = validate
METHOD_RUNNERS = {name: run_self_spec for name in SELF_SPEC_METHODS}
