"""The sparse-verification methods of ``generate`` (``--method dustin | streaming | snapkv | quest | magicdec``):
their options, checks, Dustin configs from a profile, and the run (see :mod:`experiments.dustin_quality`)."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, Tuple

import numpy as np

from experiments import registry
from experiments.common import REPO, load_choice_table, load_model_timed


SPARSE_METHODS = ("dustin", "streaming", "snapkv", "quest", "magicdec")
PROFILE_DIR = REPO / "experiments" / "profiles"
SINKS = 4  # docs/methods.md §3.2, shared by every sparse baseline


# ---------------------------------------------------------------------------- generate options
def add_dustin_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dustin / streaming / snapkv / quest / magicdec (sparse attention, docs/methods.md §3)")
    group.add_argument("--budget", type=int, default=None, metavar="K",
                       help="KV budget k (history positions attended): one of 128, 256, 512, 1024, 2048")
    group.add_argument("--dustin-profile", default=None, metavar="FILE",
                       help="dustin: SRH profile of this target-draft pair (from `dustin-profile`); without it an "
                            "unprofiled default config is used and labelled as such")
    group.add_argument("--dustin-mode", default="hybrid", choices=["hybrid", "target", "draft"],
                       help="dustin: Dustin-H (both signals), Dustin-T (target signal only), Dustin-D (draft only)")
    group.add_argument("--draft-kv", default="full", choices=["full", "streaming", "verify-set"],
                       help="dustin: what the draft's attention reads of its cache (docs/methods.md §5.1): all of it, "
                            "4 sinks + a recent window (MagicDec's view), or the previous round's I_verify + a recent "
                            "window; K/V writes and the lookahead signal stay over the full cache")
    group.add_argument("--arbitrate", type=int, default=None, metavar="ROUNDS",
                       help="dustin / streaming / snapkv / magicdec: measured choice between the method and plain "
                            "decoding (docs/methods.md §5.2): time ROUNDS speculative rounds against as many AR "
                            "steps on the live sequence, keep the faster for the rest of the run")
    group.add_argument("--arbitrate-warmup", type=int, default=0, metavar="N",
                       help="with --arbitrate: before each side of the probe run N rounds (plain steps) untimed, "
                            "their tokens kept, so a first call's one-time costs do not decide (docs/methods.md §5.2; "
                            "default 0)")
    group.add_argument("--arbitrate-tail", type=int, default=None, metavar="ROUNDS",
                       help="with --arbitrate: while speculating, every ROUNDS rounds compare the time to finish the "
                            "whole batch (it waits for its slowest row) with plain decoding's, and switch to plain "
                            "decoding once that is sooner (docs/methods.md §5.2)")
    group.add_argument("--arbitrate-tail-prior", type=float, default=None, metavar="M",
                       help="with --arbitrate-tail: each row's tokens per round is pooled toward the batch mean with "
                            "the weight of M rounds (default: as many as observed; 0 = each row's own rate)")
    group.add_argument("--arbitrate-table", default=None, metavar="FILE",
                       help="with --arbitrate: decide from this choice table (whole-run speed-ups measured earlier for "
                            "this pair and device, `choice-table`) where it holds the run's (context bucket, batch), "
                            "with no probe; probe where it does not (docs/methods.md §5.2)")
    group.add_argument("--draft-window", type=int, default=None, metavar="W",
                       help="dustin with --draft-kv streaming|verify-set: the recent window (default K - 4 for "
                            "streaming, the verifier's window w for verify-set)")
    group.add_argument("--dustin-m-rule", default="fixed", choices=["fixed", "max-mass", "coverage", "entropy"],
                       help="dustin (hybrid): the split m of the budget -- the profiled m every round (fixed); per "
                            "round and row, positions ranked by the larger normalised signal mass (max-mass), the "
                            "candidate m covering the most of both signals' mass (coverage), or the profiled m "
                            "-/+ 10 %% of k - s - w when the signals' entropy gap leaves its usual range (entropy); "
                            "docs/methods.md §3.7")
    group.add_argument("--dustin-m-steps", type=int, default=1, metavar="N",
                       help="with --dustin-m-rule coverage: its candidates are the profiled m and m -/+ i x 10 %% of "
                            "k - s - w for i = 1..N (default 1)")
    group.add_argument("--dustin-m-every", type=int, default=1, metavar="N",
                       help="with --dustin-m-rule coverage: the rule decides each row's m every N-th round only; the "
                            "rounds between select with the m it chose, as the fixed rule (docs/methods.md §3.7; "
                            "default 1: every round)")
    group.add_argument("--dustin-m-every-schedule", default="cond", choices=["cond", "unrolled"],
                       help="with --dustin-m-every N: one round body choosing deciding or holding with a lax.cond on "
                            "the device (cond, the default), or the decoding loop running N rounds per iteration, "
                            "each compiled with its own selection (unrolled); the same tokens (docs/methods.md §3.7)")
    group.add_argument("--dustin-reselect-every", type=int, default=None, metavar="R",
                       help="dustin: select I_verify from the signals every R-th round only; the rounds between "
                            "reuse that selection with their own sinks and window (docs/methods.md §3.8; 1: every "
                            "round, the paper)")


def _supported_budgets() -> str:
    from jaxspec.dustin.config import SUPPORTED_BUDGETS

    return ", ".join(map(str, SUPPORTED_BUDGETS))


def validate(args) -> None:
    """Checks before any model loads (bad budget, missing/corrupt profile, draft options)."""
    from jaxspec.dustin.config import check_budget
    from jaxspec.dustin.search import DustinProfile

    method = args.method
    if getattr(args, "mesh", None):
        raise ValueError(f"--method {method} runs on one device; drop --mesh")
    if args.budget is None:
        raise ValueError(f"--method {method} needs --budget K (one of {_supported_budgets()})")
    check_budget(args.budget)
    if args.gamma < 1:
        raise ValueError(f"--gamma={args.gamma} must be >= 1")
    if args.draft and args.draft_skip:
        raise ValueError(f"--method {method}: give --draft SOURCE or --draft-skip SPEC, not both")
    if method != "magicdec" and not (args.draft or args.draft_skip):
        raise ValueError(f"--method {method} needs a draft: --draft SOURCE (separate model) or --draft-skip SPEC "
                         f"(self-draft)")
    if args.dustin_profile and method != "dustin":
        raise ValueError(f"--dustin-profile is a dustin option; --method {method} does not take it")
    if args.dustin_mode != "hybrid" and method != "dustin":
        raise ValueError(f"--dustin-mode is a dustin option; --method {method} does not take it")
    if args.draft_kv != "full" and method != "dustin":
        raise ValueError(f"--draft-kv is a dustin option (--method magicdec is the streaming draft with dense "
                         f"verification); --method {method} does not take it")
    if args.arbitrate is not None:
        if method == "quest":
            raise ValueError("--arbitrate: --method quest runs its own verification loop; use another method")
        if args.arbitrate < 1:
            raise ValueError(f"--arbitrate={args.arbitrate} must be >= 1 (speculative rounds per probe)")
    if getattr(args, "arbitrate_warmup", 0):
        if args.arbitrate is None or args.arbitrate_warmup < 0:
            raise ValueError(f"--arbitrate-warmup={args.arbitrate_warmup}: needs --arbitrate ROUNDS and a value >= 0")
    if getattr(args, "arbitrate_tail", None) is not None:
        if args.arbitrate is None:
            raise ValueError("--arbitrate-tail refines --arbitrate ROUNDS (the measured choice); give --arbitrate too")
        if args.arbitrate_tail < 1:
            raise ValueError(f"--arbitrate-tail={args.arbitrate_tail} must be >= 1 (rounds between tail checks)")
    if getattr(args, "arbitrate_tail_prior", None) is not None:
        if getattr(args, "arbitrate_tail", None) is None or args.arbitrate_tail_prior < 0:
            raise ValueError(f"--arbitrate-tail-prior={args.arbitrate_tail_prior}: needs --arbitrate-tail and a value "
                             f">= 0 (rounds of weight on the batch mean; 0 = each row's own rate)")
    if getattr(args, "arbitrate_table", None):
        if args.arbitrate is None:
            raise ValueError("--arbitrate-table gives the measured choice its decisions; give --arbitrate ROUNDS too "
                             "(the probe for cases the table does not hold)")
        load_choice_table(args.arbitrate_table, args.model, args.draft)
    if args.draft_window is not None:
        if args.draft_kv == "full":
            raise ValueError(f"--draft-window={args.draft_window} needs --draft-kv streaming or verify-set")
        if args.draft_window < 1:
            raise ValueError(f"--draft-window={args.draft_window} must be >= 1")
    reselect = getattr(args, "dustin_reselect_every", None)
    if reselect is not None and method != "dustin":
        raise ValueError(f"--dustin-reselect-every is a dustin option; --method {method} does not take it")
    if reselect is not None and reselect < 1:
        raise ValueError(f"--dustin-reselect-every={reselect} must be >= 1 (1: select every round)")
    m_rule = getattr(args, "dustin_m_rule", "fixed")
    if m_rule != "fixed" and (method != "dustin" or args.dustin_mode != "hybrid"):
        raise ValueError(f"--dustin-m-rule {m_rule} chooses Dustin-H's split: it needs --method dustin with "
                         f"--dustin-mode hybrid (got --method {method} --dustin-mode {args.dustin_mode})")
    m_steps = getattr(args, "dustin_m_steps", 1)
    if m_steps != 1 and (m_steps < 1 or m_rule != "coverage"):
        raise ValueError(f"--dustin-m-steps={m_steps}: an integer >= 1 that widens --dustin-m-rule coverage's "
                         f"candidates (got --dustin-m-rule {m_rule})")
    m_every = getattr(args, "dustin_m_every", 1)
    if m_every != 1 and (m_every < 1 or m_rule != "coverage"):
        raise ValueError(f"--dustin-m-every={m_every}: an integer >= 1 that holds --dustin-m-rule coverage's m "
                         f"between its decisions (got --dustin-m-rule {m_rule})")
    schedule = getattr(args, "dustin_m_every_schedule", "cond")
    if schedule != "cond" and m_every == 1:
        raise ValueError(f"--dustin-m-every-schedule={schedule} sets how the rounds of --dustin-m-every N run: give "
                         f"--dustin-m-every N >= 2")
    if method == "quest" and (args.profile or args.fixed_tau is not None):
        raise ValueError("--method quest runs its own verification loop: --profile and --fixed-tau are not supported")
    if args.dustin_profile:
        profile = DustinProfile.load(args.dustin_profile)  # missing / corrupt file: ProfileError (a ValueError)
        profile.config(args.budget, args.dustin_mode)  # budget not profiled: ProfileError naming the profiled ones
        self_draft = "self_draft_mask" in profile.draft
        if self_draft and args.draft:
            raise ValueError(f"{args.dustin_profile} profiles a self-draft ({profile.draft.get('name')}); "
                             f"use --draft-skip, not --draft {args.draft}")
        if not self_draft and args.draft_skip:
            raise ValueError(f"{args.dustin_profile} profiles the separate draft {profile.draft.get('name')!r}; "
                             f"use --draft SOURCE, not --draft-skip")


def default_dustin_config(budget: int, mode: str, target_config, draft_config, skip_mask=None):
    """An unprofiled Dustin config: the middle target layer and one middle draft layer (whose
    attention a self-draft executes), query heads 0..3, m = half of k - s - w."""
    from jaxspec.dustin.config import DustinConfig

    heads = tuple(range(min(4, target_config.num_heads)))
    draft_cfg = draft_config or target_config
    layers = list(range(draft_cfg.num_layers))
    if skip_mask is not None:
        layers = [layer for layer in layers if not skip_mask[layer, 0]]
    middle = min(layers, key=lambda layer: abs(layer - draft_cfg.num_layers // 2))
    return DustinConfig(budget=budget, target_layer=target_config.num_layers // 2, target_heads=heads,
                        draft_layers=(middle,), draft_heads=(tuple(range(min(4, draft_cfg.num_heads))),), mode=mode)


def check_self_draft_layers(config, skip_mask) -> None:
    """A self-draft's SRH layers must execute their attention under the skip mask."""
    if skip_mask is None or not config.uses_draft_signal:
        return
    skipped = [layer for layer in config.draft_layers if skip_mask[layer, 0]]
    if skipped:
        raise ValueError(f"the Dustin draft SRH layers {skipped} skip their attention under this --draft-skip; "
                         f"a self-draft's lookahead signal needs layers it executes")


def profile_config(profile, budget: int, mode: str):
    """The profiled config in ``mode``. Dustin-D when Algorithm 1 kept no draft layer (no draft layer
    improved the hybrid ARR by >= min_gain): the best single draft layer of its step (b) with that
    layer's SRHs, so the ablation still exists."""
    config = profile.config(budget)
    if mode != "draft" or config.draft_layers:
        return profile.config(budget, mode)
    if True:
        steps = profile.search.get(str(budget), {}).get("steps") or []
        heads = profile.srh.get("draft", {}).get("top_heads")
        if not steps or heads is None:
            from jaxspec.dustin.search import ProfileError

            raise ProfileError(f"the profile's k={budget} config has no draft layer and no search trace to take one "
                               f"from: Dustin-D is not defined for it")
        layer = int(steps[0]["best"])
        config = config.replace(draft_layers=(layer,), draft_heads=(tuple(heads[layer]),), mode="draft")
    return config


def dustin_config_for(args, target_config, draft_config, skip_mask) -> Tuple[Any, Dict[str, Any]]:
    """``(DustinConfig, info)`` from ``--dustin-profile`` (checked against the models) or the default."""
    from jaxspec.dustin.search import DustinProfile, ProfileError

    if args.dustin_profile:
        profile = DustinProfile.load(args.dustin_profile)
        profile.check_models(target_config, draft_config or target_config)
        if skip_mask is not None:
            profiled = np.asarray(profile.draft.get("self_draft_mask"), bool)
            if profiled.shape != skip_mask.shape or not np.array_equal(profiled, skip_mask):
                from jaxspec.decoding.policies import describe_skip_mask

                raise ProfileError(f"{args.dustin_profile} was profiled for the self-draft skipping "
                                   f"{describe_skip_mask(profiled) if profiled.ndim == 2 else profiled.tolist()}; "
                                   f"--draft-skip {args.draft_skip!r} skips {describe_skip_mask(skip_mask)}")
        config = profile_config(profile, args.budget, args.dustin_mode)
        info = {"profile": str(args.dustin_profile), "profile_created": profile.created,
                "profile_target": profile.target.get("name"), "profile_draft": profile.draft.get("name"),
                "profiled_arr": profile.search.get(str(args.budget), {}).get("arr")}
    else:
        config = default_dustin_config(args.budget, args.dustin_mode, target_config, draft_config, skip_mask)
        info = {"profile": None, "note": "unprofiled default config (no --dustin-profile): middle target layer, "
                                         "one middle draft layer, heads 0..3, m = (k - s - w) / 2"}
        print(f"[dustin] no --dustin-profile: using the unprofiled default {config.to_dict()}", file=sys.stderr)
    check_self_draft_layers(config, skip_mask)
    draft_kv = getattr(args, "draft_kv", "full")
    if draft_kv != "full":  # docs/methods.md §5.1: the draft's view of its cache, not part of the profile
        config = config.replace(draft_kv=draft_kv, draft_window=getattr(args, "draft_window", None))
    if getattr(args, "dustin_reselect_every", None) not in (None, 1):  # docs/methods.md §3.8: not in the profile
        config = config.replace(reselect_every=args.dustin_reselect_every)
        info["reselect_every"] = args.dustin_reselect_every
    if getattr(args, "dustin_m_rule", "fixed") != "fixed":
        config = config.replace(m_rule=args.dustin_m_rule)
        info["m_rule"] = args.dustin_m_rule
        if getattr(args, "dustin_m_steps", 1) != 1:
            config = config.replace(m_steps=args.dustin_m_steps)
            info["m_steps"] = args.dustin_m_steps
        if getattr(args, "dustin_m_every", 1) != 1:
            config = config.replace(m_every=args.dustin_m_every)
            info["m_every"] = args.dustin_m_every
            schedule = getattr(args, "dustin_m_every_schedule", "cond")
            if schedule != "cond":
                config = config.replace(m_every_schedule=schedule)
                info["m_every_schedule"] = schedule
        if args.dustin_m_rule == "max-mass":
            info["m_balance"] = config.m_balance
        else:
            info["m_candidates"] = list(config.m_candidates)
        if args.dustin_m_rule == "entropy":
            info.update(m_entropy_centre=config.m_entropy_centre, m_entropy_band=config.m_entropy_band)
    return config, info


def sparse_policies(args, config, draft_config=None, mask=None):
    """The policies of ``--method args.method`` (dustin | streaming | snapkv | quest | magicdec) with
    budget ``args.budget``: ``(draft_policy, draft_state, verify_policy, sparse, draft_info)``.
    ``draft_config``: a separate draft model's config, else a self-draft (``mask``: its skip mask,
    ``None`` = the whole target). ``draft_state`` is ``None`` where the policy's own ``prefill``
    builds it; ``verify_policy`` ``None`` means dense verification; ``sparse`` describes the method
    for the results; ``draft_info`` replaces the results' draft description (MagicDec's self-draft)."""
    from jaxspec.baselines import MagicDecDraft, MagicDecSelfDraft, QuestVerify, SnapKVVerify, StreamingVerify
    from jaxspec.decoding.policies import SelfDraft, SeparateDraft, describe_skip_mask
    from jaxspec.dustin import dustin_policies

    method, budget = args.method, args.budget
    sparse: Dict[str, Any] = {"method": method, "budget": budget, "sinks": SINKS}
    verify_policy = draft_info = None
    if method == "magicdec":
        if draft_config is not None:
            draft_policy, draft_state = MagicDecDraft(draft_config, sinks=SINKS, window=budget - SINKS), None
        else:
            draft_policy = MagicDecSelfDraft(config, sinks=SINKS, window=budget - SINKS)
            draft_state = draft_policy.initial_state(mask)
            draft_info = {"self_draft_streaming": f"{SINKS} sinks + {budget - SINKS} window",
                          **({"self_draft_skip": args.draft_skip, "skipped": describe_skip_mask(mask)}
                             if mask is not None else {})}
        sparse["draft_kv"] = f"StreamingLLM view, {SINKS} sinks + {budget - SINKS} window; dense verification"
        return draft_policy, draft_state, verify_policy, sparse, draft_info
    if method == "dustin":
        dustin, info = dustin_config_for(args, config, draft_config, mask)
        draft_policy, verify_policy = dustin_policies(dustin, config, draft_config)
        sparse.update(dustin=dustin.to_dict(), mode=dustin.mode, m=dustin.effective_m, **info)
        fixed = {"streaming": f"{dustin.sinks} sinks", "verify-set": "the previous round's I_verify"}
        sparse["draft_kv"] = dustin.draft_kv if dustin.draft_kv == "full" else \
            f"{dustin.draft_kv}: {fixed[dustin.draft_kv]} + a {dustin.draft_window_size}-token window"
    else:
        draft_policy = SeparateDraft(draft_config) if draft_config is not None else SelfDraft(config)
        if method == "streaming":
            verify_policy = StreamingVerify(sinks=SINKS, window=budget - SINKS)
            sparse["window"] = budget - SINKS
        elif method == "snapkv":
            verify_policy = SnapKVVerify(config, budget=budget, max_generated=args.max_new_tokens)
            sparse.update(observation_window=verify_policy.window, pooling=verify_policy.kernel,
                          note="prompt selection of k positions + every generated token")
        elif method == "quest":
            verify_policy = QuestVerify(budget=budget)
            sparse.update(page_size=verify_policy.page_size, pages=verify_policy.num_pages,
                          dense_layers=verify_policy.dense_layers)
        else:
            raise ValueError(f"unknown sparse method {method!r}; valid: {', '.join(SPARSE_METHODS)}")
    draft_state = draft_policy.initial_state(mask) if mask is not None else None
    return draft_policy, draft_state, verify_policy, sparse, draft_info


def run_sparse(args, model, prompts, sampling, stops, out):
    """The runner of ``generate --method dustin | streaming | snapkv | quest | magicdec``."""
    from jaxspec.baselines import quest_speculative_generate
    from jaxspec.decoding.policies import describe_skip_mask, parse_skip_spec
    from jaxspec.decoding.speculative import (EngineConfig, acceptance_from_tau, check_compatible,
                                              speculative_generate)

    method = args.method
    config = model.config
    fixed = acceptance_from_tau(args.fixed_tau, args.gamma) if args.fixed_tau is not None else None
    engine = EngineConfig(gamma=args.gamma, sampling=sampling, max_new_tokens=args.max_new_tokens,
                          stop_tokens=tuple(stops), fixed_acceptance=fixed)
    draft = mask = None
    if args.draft:
        draft = load_model_timed(args.draft, args.dtype, config.attention_backend)
        check_compatible(config, draft.config, model.tokenizer, draft.tokenizer)
        out["draft"] = {"source": draft.source, "config": draft.config.to_dict()}
    elif args.draft_skip:
        mask = parse_skip_spec(args.draft_skip, config.num_layers)
        out["draft"] = {"self_draft_skip": args.draft_skip, "skipped": describe_skip_mask(mask)}
    draft_params = draft.params if draft is not None else None
    draft_policy, draft_state, verify_policy, sparse, draft_info = sparse_policies(
        args, config, draft.config if draft is not None else None, mask)
    if draft_info is not None:
        out["draft"] = draft_info
    common = dict(draft_policy=draft_policy, draft_params=draft_params, draft_state=draft_state, engine=engine,
                  seed=args.seed, warmup=not args.no_warmup)
    if method == "quest":
        result = quest_speculative_generate(model.params, config, prompts, verify_policy=verify_policy, **common)
    else:
        kwargs = {} if verify_policy is None else {"verify_policy": verify_policy}
        if args.arbitrate is not None:
            from jaxspec.decoding.arbitration import MeasuredChoiceController

            tail = getattr(args, "arbitrate_tail", None)
            prior = getattr(args, "arbitrate_tail_prior", None)
            table, table_method = None, None
            if getattr(args, "arbitrate_table", None):
                table = load_choice_table(args.arbitrate_table, args.model, args.draft)
                table_method = choice_table_method(args)
            warm = getattr(args, "arbitrate_warmup", 0) or 0
            kwargs["controller"] = MeasuredChoiceController(probe_rounds=args.arbitrate, tail_check=tail,
                                                            tail_prior_rounds=prior, table=table,
                                                            table_method=table_method, probe_warmup=warm)
            sparse["arbitrate"] = {"probe_rounds": args.arbitrate, "tail_check": tail, "tail_prior_rounds": prior,
                                   "table": getattr(args, "arbitrate_table", None), "table_method": table_method,
                                   **({"probe_warmup": warm} if warm else {})}
        result = speculative_generate(model.params, config, prompts, profile=args.profile, **common, **kwargs)
    out["sparse"] = sparse
    return result


def choice_table_method(args) -> str:
    """The name a choice table knows this run's method by (``pair-speed``'s names): ``dustin`` is Dustin-H
    with a full draft KV, ``dustin-kv-streaming`` / ``dustin-kv-verify-set`` its sparse draft KV, ``dustin-t``
    / ``dustin-d`` the single-signal modes; the other methods by their own name."""
    if args.method != "dustin":
        return args.method
    name = "dustin" if args.dustin_mode == "hybrid" else f"dustin-{args.dustin_mode[0]}"
    return name if args.draft_kv == "full" else f"{name}-kv-{args.draft_kv}"


for _name in SPARSE_METHODS:
    registry.register_method(registry.Method(name=_name, run=run_sparse, family="sparse", validate=validate,
                                             takes=frozenset(registry.SPECULATIVE_OPTIONS)))
registry.register_method_arguments("sparse", add_dustin_args)
