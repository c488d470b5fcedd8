"""Dustin (docs/methods.md §3) from the command line: sparse-verification methods, the offline profile, quality.

* ``generate --method dustin | streaming | snapkv | quest | magicdec --budget K`` -- registered in
  :data:`experiments.registry.METHODS`. Every method runs in the same speculative engine
  with the same draft (``--draft SOURCE`` or a self-draft ``--draft-skip SPEC``) and gamma:

  - ``dustin``: Dustin verification (``--dustin-mode hybrid|target|draft`` = Dustin-H/T/D), the
    per-budget config of ``--dustin-profile FILE`` (written by ``dustin-profile``), else an
    unprofiled default (labelled in the JSON); with ``--draft-skip SPEC --draft-kv streaming`` the
    self-draft reads a StreamingLLM view of the target cache (MagicDec's self-draft) and still gives the
    lookahead signal over the full keys (docs/methods.md §5.5); KnapSpec's re-planned self-draft with
    Dustin verification is ``--method knapspec-dustin`` (:mod:`experiments.knapspec.self_spec`);
  - ``streaming``: StreamingLLM verification (4 sinks + the last ``K - 4`` positions);
  - ``snapkv``: SnapKV verification (static prompt selection of ``K`` positions after prefill +
    every generated token);
  - ``quest``: Quest verification (pages of 16, top ``K / 16`` pages per layer, query head and row;
    first 2 layers dense) -- its own verification forward inside the engine's rounds;
  - ``magicdec``: MagicDec, a draft reading a StreamingLLM view (4 sinks + ``K - 4``) of its KV with
    dense verification; with neither ``--draft`` nor ``--draft-skip`` the draft is the target
    itself with StreamingLLM attention.

  ClassicSD is ``--method sd``.
* ``dustin-profile`` -- SRH identification on calibration-split needle tasks + Algorithm 1 for one
  pair; saves a :class:`~jaxspec.dustin.search.DustinProfile` (provenance included).
* ``dustin-quality`` -- ARR, agreement with dense greedy output, perplexity under sparse vs dense
  attention, retrieval accuracy and tau for every method and budget (see :func:`cmd_dustin_quality`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from experiments import registry
from experiments.common import (REPO, CompileCounter, ResultWriter, check_skip_ranges, check_warm_workers, config_of,
                                load_choice_table, load_model_timed, print_table, stop_tokens, warm_compilation_cache)
from experiments.common import release_memory as common_release_memory

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


# ---------------------------------------------------------------------------- shared helpers
def _parse_ints(text: str, what: str) -> List[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}={text!r}: expected comma-separated integers") from None
    if not values:
        raise ValueError(f"{what} is empty")
    return values


def _parse_floats(text: str, what: str) -> List[float]:
    try:
        return [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}={text!r}: expected comma-separated numbers") from None


def _check_budgets(text: str) -> List[int]:
    from jaxspec.dustin.config import check_budget

    return [check_budget(b) for b in _parse_ints(text, "--budgets")]


def _load_pair(args):
    """(target, draft or None, skip mask or None) from --model and --draft / --draft-skip."""
    from jaxspec.decoding.policies import parse_skip_spec
    from jaxspec.decoding.speculative import check_compatible

    if bool(args.draft) == bool(args.draft_skip):
        raise ValueError("give exactly one of --draft SOURCE (separate draft) or --draft-skip SPEC (self-draft)")
    if args.draft_skip:
        check_skip_ranges(args.draft_skip, "--draft-skip")
    target = load_model_timed(args.model, args.dtype)
    if target.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer; the needle tasks need one")
    draft = mask = None
    if args.draft:
        draft = load_model_timed(args.draft, args.dtype)
        check_compatible(target.config, draft.config, target.tokenizer, draft.tokenizer)
    else:
        mask = parse_skip_spec(args.draft_skip, target.config.num_layers)
    return target, draft, mask


def build_task_splits(tokenizer, args, kinds, lengths, depths):
    """(calibration, evaluation) suites from --source over disjoint haystack parts and seeds."""
    from jaxspec.data import build_splits
    from jaxspec.data.corpus import load_haystack

    haystack = load_haystack(args.source, progress=False) if any(k != "kv_retrieval" for k in kinds) else None
    return build_splits(tokenizer, haystack, kinds=kinds, context_lengths=lengths, depths=depths,
                        calibration_samples=args.samples, evaluation_samples=args.samples, seed=args.task_seed,
                        source=args.source)


def _task_args(args) -> Tuple[List[int], List[str], List[int], List[float]]:
    """``--budgets``, ``--kinds``, ``--lengths``, ``--depths`` of the commands that build needle tasks, checked."""
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    return (_check_budgets(args.budgets), kinds, _parse_ints(args.lengths, "--lengths"),
            _parse_floats(args.depths, "--depths"))


# ---------------------------------------------------------------------------- dustin-profile
def cmd_dustin_profile(args) -> Dict[str, Any]:
    """SRH identification + calibration rounds + Algorithm 1 on calibration-split needle tasks."""
    from jaxspec.decoding.policies import describe_skip_mask
    from jaxspec.dustin.search import profile_pair

    budgets, kinds, lengths, depths = _task_args(args)
    if not args.profile_file:
        raise ValueError("give --profile-file FILE: where to save the profile (e.g. experiments/profiles/NAME.json)")
    if args.srh_kv_groups is not None and args.srh_kv_groups < 1:
        raise ValueError(f"--srh-kv-groups {args.srh_kv_groups}: give a number of KV groups >= 1")
    if getattr(args, "recalibrate_m", False) and not args.extend:
        raise ValueError("--recalibrate-m recalibrates an existing profile's m: give it with --extend FILE")
    if args.extend:
        if args.srh_kv_groups is not None:
            raise ValueError("--srh-kv-groups chooses SRHs; --extend keeps the profile's own SRHs (profile anew)")
        if getattr(args, "recalibrate_m", False):
            return _recalibrate_m(args, budgets, kinds, lengths, depths)
        return _extend_profile(args, budgets, kinds, lengths, depths)
    writer = ResultWriter(args.out, "dustin-profile", config_of(args))
    target, draft, mask = _load_pair(args)
    started = time.perf_counter()
    calibration, evaluation = build_task_splits(target.tokenizer, args, kinds, lengths, depths)
    print(f"[dustin-profile] {len(calibration)} calibration tasks ({', '.join(kinds)}; {lengths} tokens), "
          f"disjoint from {len(evaluation)} evaluation tasks", file=sys.stderr, flush=True)
    profile, records = profile_pair(
        target.params, target.config, draft.params if draft else None, draft.config if draft else None,
        list(calibration), target.tokenizer, budgets=budgets, evaluation=list(evaluation),
        target_name=args.model, target_source=target.source,
        draft_name=args.draft or f"{args.model} self-draft ({args.draft_skip})",
        draft_source=draft.source if draft else target.source, gamma=args.gamma,
        max_new_tokens=args.max_new_tokens, recall_threshold=args.recall_threshold,
        srh_max_new_tokens=args.srh_max_new_tokens, batch_size=1, self_draft_mask=mask,
        srh_kv_groups=args.srh_kv_groups)
    if mask is not None:  # a self-draft's SRH layers must execute their attention: drop any that do not
        for budget in budgets:
            check_self_draft_layers(profile.configs[budget], mask)
        profile.draft["self_draft_skip"] = args.draft_skip
        profile.draft["skipped"] = describe_skip_mask(mask)
    profile.data.update(source=args.source, task_seed=args.task_seed, kinds=kinds, depths=depths,
                        command="python -m experiments.run dustin-profile " + " ".join(sys.argv[2:]),
                        evaluation_task_ids_excluded=len(evaluation), seconds=time.perf_counter() - started)
    profile.save(args.profile_file)
    rows = [{"k": b, "target_layer": c.target_layer, "target_heads": list(c.target_heads),
             "draft_layers": list(c.draft_layers), "m": c.effective_m, "free": c.free_budget,
             "arr_hybrid": profile.search[str(b)]["arr"],
             "arr_target_only": max(x for x in profile.search[str(b)]["target_layer_arr"] if x is not None)}
            for b, c in sorted(profile.configs.items())]
    print_table(rows, title=f"Dustin profile -> {args.profile_file} ({records.num_items} calibration round-rows, "
                            f"{time.perf_counter() - started:.0f} s)")
    srh_recall = {"target": profile.srh["target"]["recall"], "draft": profile.srh["draft"]["recall"]}
    print(f"needle answer recall per calibration task: {json.dumps(srh_recall)}")
    writer.set("results", {"profile_file": str(args.profile_file), "rows": rows, "srh_recall": srh_recall})
    return writer.data


# ---------------------------------------------------------------------------- dustin-m-bounds
def cmd_dustin_m_bounds(args) -> Dict[str, Any]:
    """How predictable the per-round best m is (docs/methods.md §3.7): full-KV greedy decoding of
    evaluation-split needle tasks recording every round (``collect_calibration``), then per budget
    ``m_choice_study``: fixed m, the per-round oracle, the previous round's best m, the next round's
    target signal as the recall weights, and the causal hindsight rule."""
    from jaxspec.dustin.search import DustinProfile, collect_calibration, m_choice_study, profile_signal_layers

    budgets, kinds, lengths, depths = _task_args(args)
    if not args.dustin_profile:
        raise ValueError("give --dustin-profile FILE (the pair's profile: its SRH layers, heads and m per budget)")
    if args.items < 1:
        raise ValueError(f"--items {args.items} must be >= 1")
    profile = DustinProfile.load(args.dustin_profile)
    configs = {b: profile_config(profile, b, "hybrid") for b in budgets}
    missing = [b for b, c in configs.items() if not (c.draft_layers and c.target_heads)]
    if missing:
        raise ValueError(f"--budgets {missing}: the profile's config has no draft layer there, so there is no split "
                         f"to choose")
    # every draft layer any budget reads, with its heads, and the target's heads per layer
    layers, layer_heads, target_heads = profile_signal_layers(profile, budgets)
    # the profile's m for this length (dustin-profile --recalibrate-m), where it has a per-length table
    length_m = {b: profile.m_at(b, lengths[0]) for b in budgets
                if profile.m_by_length.get(b) and len(lengths) == 1}
    writer = ResultWriter(args.out, "dustin-m-bounds", config_of(args))
    target, draft, mask = _load_pair(args)
    if len(target_heads) != target.config.num_layers:
        raise ValueError(f"{args.dustin_profile} is for a target of {len(target_heads)} layers; --model has "
                         f"{target.config.num_layers}")
    _, evaluation = build_task_splits(target.tokenizer, args, kinds, lengths, depths)
    tasks = list(evaluation)[:args.items]
    started = time.perf_counter()
    prompts = [target.tokenizer.encode(task.prompt) for task in tasks]
    print(f"[dustin-m-bounds] {len(prompts)} evaluation tasks ({', '.join(kinds)}; {lengths} tokens, task seed "
          f"{args.task_seed}): full-KV greedy decoding, every round recorded ...", file=sys.stderr, flush=True)
    records = collect_calibration(target.params, target.config, draft.params if draft else None,
                                  draft.config if draft else None, prompts, target_heads=target_heads,
                                  draft_heads=layer_heads, draft_layers=layers,
                                  gamma=args.gamma, max_new_tokens=args.max_new_tokens, batch_size=1,
                                  self_draft_mask=mask)
    print(f"[dustin-m-bounds] {records.num_items} rounds in {time.perf_counter() - started:.0f} s", file=sys.stderr,
          flush=True)
    rows = []
    for b, c in sorted(configs.items()):
        study = m_choice_study(records, c, target_layer=c.target_layer,
                               draft_layers=[layers.index(x) for x in c.draft_layers], length_m=length_m.get(b))
        writer.set(f"k{b}", study)
        gap = study["gap_closed"]
        rows.append({"k": b, "m": study["m"], "rounds": study["rounds"], "fixed": study["arr"]["fixed"],
                     "oracle": study["arr"]["oracle"], "oracle_m": f"{study['oracle_m']['mean']:.0f} ± "
                                                                 f"{study['oracle_m']['std']:.0f}",
                     **{f"{name} closes": "-" if gap[name] is None else f"{100 * gap[name]:+.0f} %"
                        for name in ("persistence", "signal_proxy", "hindsight")},
                     **({"m at this length": study["length_m"],
                         "coverage around it closes": "-" if gap.get("coverage_length_m") is None else
                         f"{100 * gap['coverage_length_m']:+.0f} %"} if "length_m" in study else {})})
    writer.set("tasks", [task.task_id for task in tasks])
    writer.set("seconds", time.perf_counter() - started)
    print_table(rows, title="dustin-m-bounds: share of the fixed-to-oracle ARR gap each per-round choice closes")
    return writer.data


def _open_extension(args, profile, kinds, lengths, depths):
    """What ``dustin-profile --extend FILE`` works on, after the checks that need no model: ``(writer, target, draft,
    self-draft mask, calibration tasks, evaluation tasks)``."""
    if args.gamma != profile.gamma:
        raise ValueError(f"--gamma={args.gamma}: {args.extend} was profiled with gamma {profile.gamma}")
    writer = ResultWriter(args.out, "dustin-profile", config_of(args))
    target, draft, mask = _load_pair(args)
    if mask is not None and not np.array_equal(np.asarray(profile.draft.get("self_draft_mask"), bool), mask):
        raise ValueError(f"{args.extend} was profiled for another self-draft skip set than {args.draft_skip!r}")
    calibration, evaluation = build_task_splits(target.tokenizer, args, kinds, lengths, depths)
    return writer, target, draft, mask, calibration, evaluation


def _recalibrate_m(args, budgets, kinds, lengths, depths) -> Dict[str, Any]:
    """``dustin-profile --extend FILE --recalibrate-m``: the split m of --budgets recalibrated at each of --lengths on
    calibration tasks, the profile's layers kept (jaxspec.dustin.search.recalibrate_m, docs/methods.md §3.7)."""
    from jaxspec.dustin.search import DustinProfile, ProfileError, check_recalibration, recalibrate_m

    profile = DustinProfile.load(args.extend)
    try:  # before any model loads
        check_recalibration(profile, budgets)
    except ProfileError as error:
        raise ProfileError(f"--extend {args.extend} --budgets: {error}") from None
    writer, target, draft, mask, calibration, evaluation = _open_extension(args, profile, kinds, lengths, depths)
    started = time.perf_counter()
    print(f"[dustin-profile] recalibrating m of {args.extend} at k={budgets}: {len(calibration)} calibration tasks "
          f"({', '.join(kinds)}; {lengths} tokens) on its SRH layers", file=sys.stderr, flush=True)
    updated, records = recalibrate_m(
        profile, target.params, target.config, draft.params if draft else None, draft.config if draft else None,
        list(calibration), target.tokenizer, budgets=budgets, evaluation=list(evaluation),
        max_new_tokens=args.max_new_tokens, batch_size=1, self_draft_mask=mask)
    updated.data["m_recalibrations"][-1].update(
        source=args.source, task_seed=args.task_seed, kinds=kinds, depths=depths,
        command="python -m experiments.run dustin-profile " + " ".join(sys.argv[2:]),
        seconds=time.perf_counter() - started)
    updated.save(args.profile_file)
    rows = []
    for b in budgets:
        found = updated.search[str(b)]["m_by_length"]
        for length in lengths:
            entry = found[str(length)]
            rows.append({"k": b, "context": length, "rounds": entry["rounds"], "profile_m": entry["profile_m"],
                         "m": entry["m"], "arr_at_profile_m": entry["arr_at_profile_m"], "arr": entry["arr"]})
    print_table(rows, title=f"Dustin profile {args.extend}: m per context length -> {args.profile_file} "
                            f"({time.perf_counter() - started:.0f} s)")
    writer.set("results", {"profile_file": str(args.profile_file), "recalibrated": str(args.extend), "rows": rows,
                           "m_by_length": {str(b): {str(n): m for n, m in sorted(t.items())}
                                           for b, t in sorted(updated.m_by_length.items())},
                           "rounds": {str(n): r.num_items for n, r in records.items()}})
    return writer.data


def _extend_profile(args, budgets, kinds, lengths, depths) -> Dict[str, Any]:
    """``dustin-profile --extend FILE``: new budgets on the profile's own SRHs (jaxspec.dustin.search.extend_profile)."""
    from jaxspec.dustin.search import DustinProfile, extend_profile

    profile = DustinProfile.load(args.extend)
    present = [b for b in budgets if b in profile.configs]
    if present:
        raise ValueError(f"--extend {args.extend} already has k={present} (profiled: {sorted(profile.configs)}); "
                         f"give --budgets it lacks")
    writer, target, draft, mask, calibration, evaluation = _open_extension(args, profile, kinds, lengths, depths)
    started = time.perf_counter()
    print(f"[dustin-profile] extending {args.extend} with k={budgets}: {len(calibration)} calibration tasks "
          f"({', '.join(kinds)}; {lengths} tokens) on its SRHs", file=sys.stderr, flush=True)
    extended, records = extend_profile(
        profile, target.params, target.config, draft.params if draft else None, draft.config if draft else None,
        list(calibration), target.tokenizer, budgets=budgets, evaluation=list(evaluation),
        max_new_tokens=args.max_new_tokens, batch_size=1, self_draft_mask=mask)
    if mask is not None:
        for budget in budgets:
            check_self_draft_layers(extended.configs[budget], mask)
    extended.data["extensions"][-1].update(
        source=args.source, task_seed=args.task_seed, kinds=kinds, depths=depths,
        command="python -m experiments.run dustin-profile " + " ".join(sys.argv[2:]),
        seconds=time.perf_counter() - started)
    extended.save(args.profile_file)
    rows = [{"k": b, "target_layer": c.target_layer, "target_heads": list(c.target_heads),
             "draft_layers": list(c.draft_layers), "m": c.effective_m, "free": c.free_budget,
             "arr_hybrid": extended.search[str(b)]["arr"]} for b, c in sorted(extended.configs.items())
            if b in budgets]
    print_table(rows, title=f"Dustin profile {args.extend} + k={budgets} -> {args.profile_file} "
                            f"({records.num_items} calibration round-rows, {time.perf_counter() - started:.0f} s)")
    writer.set("results", {"profile_file": str(args.profile_file), "extended": str(args.extend), "rows": rows})
    return writer.data


# ---------------------------------------------------------------------------- dustin-quality: the machinery
# Every method of one item starts from the same prefilled caches (copied), and runs the engine's own
# draft and commit phases (``speculative.draft_phase`` / ``commit_phase``, jitted as the engine does) around a verification forward
# whose index set is an *argument* (so Dustin-H/T/D, StreamingLLM, SnapKV and dense share one compiled
# verification per budget). The greedy tokens equal ``speculative_generate`` with the same policies
# (the CLI tests check that through ``generate``); only the compile count differs.

@dataclasses.dataclass(frozen=True)
class Method:
    """One verification method at one budget (``budget`` None: dense)."""

    name: str  # dense, dustin-h, dustin-t, dustin-d, streaming, snapkv, quest, magicdec
    budget: Optional[int] = None
    dustin: Any = None  # DustinConfig for dustin-*

    @property
    def key(self) -> str:
        return self.name if self.budget is None else f"{self.name}/k{self.budget}"


DUSTIN_MODES = {"dustin-h": "hybrid", "dustin-t": "target", "dustin-d": "draft"}
ALL_METHODS = ("dustin-h", "dustin-t", "dustin-d", "streaming", "quest", "snapkv", "magicdec")
#: Dustin-H with an input-aware m (docs/methods.md §3.7: max-mass, coverage, entropy) and with the per-round
#: ARR-maximising m (an oracle: it reads the full-KV verification's attention); not in the default --methods.
M_RULE_METHODS = {"dustin-h-ia": "max-mass", "dustin-h-cov": "coverage", "dustin-h-ent": "entropy",
                  "dustin-h-oracle": "oracle", "dustin-h-cov-held": "coverage"}
#: the coverage rule deciding every --m-every-th round only (DustinConfig.m_every; the rounds between select with
#: each row's held m by the fixed rule's per-row path)
HELD_METHOD, HELD_EVERY = "dustin-h-cov-held", 3
QUALITY_METHODS = ALL_METHODS[:1] + tuple(M_RULE_METHODS) + ALL_METHODS[1:]


def _jax():
    import jax
    import jax.numpy as jnp

    return jax, jnp


JITS: Dict[str, Any] = {}
#: seconds per phase of the current item (the dense record keeps them: where an item's time goes)
PHASES: Dict[str, float] = {}
EXTEND_CHUNK = 64  # tokens per prefill chunk when an item's question is appended to its cached prefix
#: XLA programs compiled (or loaded from the persistent cache) so far in this process, and their seconds
COMPILES = {"count": 0, "seconds": 0.0, "listening": False}


def count_compiles() -> Dict[str, float]:
    """A snapshot of :data:`COMPILES` (registers the listener on the first call)."""
    jax, _ = _jax()
    if not COMPILES["listening"]:
        def listener(name, seconds, **_):
            if name == "/jax/core/compile/backend_compile_duration":
                COMPILES["count"] += 1
                COMPILES["seconds"] += seconds

        jax.monitoring.register_event_duration_secs_listener(listener)
        COMPILES["listening"] = True
    return {"count": COMPILES["count"], "seconds": COMPILES["seconds"]}


def compiles_since(start: Dict[str, float]) -> Dict[str, float]:
    """Programs compiled since ``start`` (a :func:`count_compiles` snapshot) and their seconds."""
    now = count_compiles()
    return {"count": int(now["count"] - start["count"]), "seconds": round(now["seconds"] - start["seconds"], 3)}


def cached_jit(name, fn, **kwargs):
    jax, _ = _jax()
    if name not in JITS:
        JITS[name] = jax.jit(fn, **kwargs)
    return JITS[name]


def _verify_forward(params, rows, cache, indices, *, config, probe_heads):
    from jaxspec.models.llama import forward

    out = forward(params, rows, cache, config=config, verify_indices=indices, probe_heads=probe_heads)
    return out.logits, out.cache, (out.probes.queries if probe_heads else None)


def _reference_forward(params, rows, cache, *, config):
    """Dense verification probing every head: logits, cache, queries, history probabilities."""
    from jaxspec.dustin.arr import all_heads
    from jaxspec.models.llama import forward

    out = forward(params, rows, cache, config=config, probe_heads=all_heads(config))
    return out.logits, out.cache, out.probes.queries, out.probes.history_probs


def _quest_forward(params, rows, cache, *, config, budget):
    from jaxspec.baselines.quest import quest_verify_forward

    out = quest_verify_forward(params, rows, cache, config=config, budget=budget)
    return out.logits, out.cache


def _select_with(method_name, budget, dustin, query, target_keys, committed, snap, draft_scores_of, *, probe_t,
                 target_qpk, max_generated):
    """I_verify ``[B, k]`` of one method (traced); ``draft_scores_of(cfg, history)`` gives ``s_D``."""
    from jaxspec.baselines.streaming import streaming_indices
    from jaxspec.dustin.selection import select_for_config
    from jaxspec.dustin.signals import target_signal

    _, jnp = _jax()
    history = (committed - 1).astype(jnp.int32)
    if method_name == "streaming":
        return streaming_indices(history, sinks=SINKS, window=budget - SINKS)
    if method_name == "snapkv":
        from jaxspec.baselines.snapkv import SnapKVVerify

        return SnapKVVerify(budget=budget, max_generated=max_generated).verify_indices(snap, None, committed, None)
    cfg = dustin
    s_target = s_draft = None
    if cfg.uses_target_signal:
        rows = [probe_t.index((cfg.target_layer, h)) for h in cfg.target_heads]
        s_target = target_signal(query[:, rows], target_keys[cfg.target_layer], history, cfg.target_heads, target_qpk)
    if cfg.uses_draft_signal:
        s_draft = draft_scores_of(cfg, history)
    return select_for_config(cfg, s_draft, s_target, history)


def _draft_rows(cfg, probe_d):
    return [probe_d.index((layer, h)) for layer, hs in zip(cfg.draft_layers, cfg.draft_heads) for h in hs]


def _select(method_name, budget, dustin, query, target_keys, committed, draft_q, draft_keys, snap, *, probe_t,
            probe_d, target_qpk, draft_qpk, capacity, max_generated):
    """I_verify ``[B, k]`` of one method (traced; ``query [B, P_T, D]`` the target probes ``probe_t``
    of the last committed token, ``draft_q [B, P_D, gamma, D]`` the draft probes ``probe_d``)."""
    from jaxspec.dustin.signals import DraftSignals, draft_signal

    def draft_scores_of(cfg, history):
        layers = sorted({layer for layer, _ in probe_d})
        keys = tuple(draft_keys[layers.index(layer)] for layer in cfg.draft_layers)
        return draft_signal(DraftSignals(queries=draft_q[:, _draft_rows(cfg, probe_d)], keys=keys), history,
                            cfg.draft_heads, draft_qpk, capacity)

    return _select_with(method_name, budget, dustin, query, target_keys, committed, snap, draft_scores_of,
                        probe_t=probe_t, target_qpk=target_qpk, max_generated=max_generated)


def _take_last_query(old, queries, num_committed):
    _, jnp = _jax()
    row = jnp.maximum(num_committed - 1, 0)[:, None, None, None]
    query = jnp.take_along_axis(queries, row, axis=2)[:, :, 0]
    return jnp.where((num_committed > 0)[:, None, None], query, old)


def _quest_layer_arr(probs, queries, keys, lengths, *, budget, config):
    """Quest's ARR in one layer, one round: ``probs [B, H, T, S]`` (full-KV history probabilities),
    ``queries [B, H, T, D]``, ``keys [B, Hkv, S, D]``; mean over heads and rows of the mass on each
    (head, row)'s own Quest pages. One compile per budget serves every layer (same shapes)."""
    from jaxspec.baselines.quest import quest_mask

    _, jnp = _jax()
    batch, heads, steps, seq = probs.shape
    valid = (jnp.arange(seq)[None, :] < lengths[:, None])[:, None, None, :]
    p = jnp.where(valid, probs, 0.0)
    qg = queries.reshape(batch, config.num_kv_heads, config.queries_per_kv, steps, queries.shape[-1])
    mask = quest_mask(qg, keys, lengths, budget=budget).reshape(batch, heads, steps, seq)
    total = jnp.sum(p, axis=-1)
    kept = jnp.sum(jnp.where(mask, p, 0.0), axis=-1)
    return jnp.mean(kept / jnp.where(total > 0, total, 1.0), axis=(1, 2))


def _round_arr(weights, history_probs, queries, keys, lengths, quest_budgets, *, config):
    """ARR of Quest (per layer/head/row pages; the first 2 layers dense count 1) for each budget, one
    round: ``[len(quest_budgets), B]``."""
    _, jnp = _jax()
    heads = config.num_heads
    fn = cached_jit("quest_layer_arr", _quest_layer_arr, static_argnames=("budget", "config"))
    out = []
    for budget in quest_budgets:
        per_layer = [jnp.ones((history_probs.shape[0],), jnp.float32)] * min(2, config.num_layers)
        for layer in range(2, config.num_layers):
            part = slice(layer * heads, (layer + 1) * heads)
            per_layer.append(fn(history_probs[:, part], queries[:, part], keys[layer], lengths, budget=budget,
                                config=config))
        out.append(jnp.mean(jnp.stack(per_layer), axis=0))
    return jnp.stack(out)


class QualityRunner:
    """Runs every method on one prefilled item (see the module doc of ``dustin-quality``)."""

    def __init__(self, target, draft, mask, profile, gamma: int, max_new_tokens: int, stops):
        from jaxspec.decoding.sampling import SamplingConfig
        from jaxspec.decoding.speculative import EngineConfig

        self.target, self.draft, self.mask, self.profile = target, draft, mask, profile
        self.m_rule_stats: Dict[str, Dict[str, list]] = {}  # per method key, per round (docs/methods.md §3.7)
        self.m_held: Dict[str, Any] = {}  # dustin-h-cov-held: each method key's m per row since its last decision
        self.tcfg = target.config
        self.dcfg = draft.config if draft is not None else target.config
        self.engine = EngineConfig(gamma=gamma, sampling=SamplingConfig(), max_new_tokens=max_new_tokens,
                                   stop_tokens=tuple(stops))
        configs = [profile_config(profile, b, mode) for b in profile.configs for mode in ("hybrid", "draft")]
        t_layers = sorted({c.target_layer for c in configs})
        d_layers = sorted({layer for c in configs for layer in c.draft_layers})
        self.probe_t = tuple((layer, h) for layer in t_layers for h in range(self.tcfg.num_heads))
        self.probe_d = tuple((layer, h) for layer in d_layers for h in range(self.dcfg.num_heads))
        from jaxspec.dustin.policy import DustinDraft, DustinSelfDraft

        heads = tuple(tuple(range(self.dcfg.num_heads)) for _ in d_layers)
        if draft is not None:
            self.draft_policy = DustinDraft(config=self.dcfg, layers=tuple(d_layers), heads=heads)
        else:
            self.draft_policy = DustinSelfDraft(config=self.tcfg, layers=tuple(d_layers), heads=heads)

    # -- methods
    def methods(self, budgets, names, m_steps: int = 1, context: Optional[int] = None,
                m_every: int = HELD_EVERY) -> List[Method]:
        """The methods per budget; ``context``: Dustin-H's m (and the input-aware rules' centre) from the
        profile's per-length table at that many tokens (:meth:`DustinProfile.m_at`)."""
        out = []
        for budget in budgets:
            for name in names:
                dustin = profile_config(self.profile, budget, DUSTIN_MODES[name]) if name in DUSTIN_MODES else None
                if name in M_RULE_METHODS:
                    dustin = profile_config(self.profile, budget, "hybrid")
                    if name != "dustin-h-oracle":
                        dustin = dustin.replace(m_rule=M_RULE_METHODS[name])
                    if name == "dustin-h-cov" and m_steps != 1:
                        dustin = dustin.replace(m_steps=m_steps)
                    if name == HELD_METHOD:
                        dustin = dustin.replace(m_every=m_every)
                if context is not None and dustin is not None and dustin.mode == "hybrid":
                    dustin = dustin.replace(m=self.profile.m_at(budget, context))
                out.append(Method(name, budget, dustin))
        return out

    def magicdec_policy(self, budget):
        from jaxspec.baselines import MagicDecDraft, MagicDecSelfDraft

        if self.draft is not None:
            return MagicDecDraft(self.dcfg, sinks=SINKS, window=budget - SINKS)
        return MagicDecSelfDraft(self.tcfg, sinks=SINKS, window=budget - SINKS)

    # -- prefill
    def prefill(self, tokens: Sequence[int], capacity: int):
        """Target and draft caches holding ``tokens``; returns a dict (caches, first logits)."""
        from jaxspec.decoding.autoregressive import choose_prefill_chunk, prefill
        from jaxspec.models.cache import init_cache

        _, jnp = _jax()
        array = np.asarray([tokens], np.int32)
        lengths = np.asarray([len(tokens)], np.int32)
        # the chunk from the capacity, not the prompt length: one compiled chunk for every item of a length
        cache = init_cache(self.tcfg, 1, capacity)
        cache, logits = prefill(self.target.params, self.tcfg, array, lengths, cache,
                                chunk=choose_prefill_chunk(self.tcfg, 1, capacity, capacity))
        dcache = None
        if self.draft is not None:
            dcache = init_cache(self.dcfg, 1, capacity)
            dcache, _ = prefill(self.draft.params, self.dcfg, array, lengths, dcache,
                                chunk=choose_prefill_chunk(self.dcfg, 1, capacity, capacity))
        return {"cache": cache, "draft_cache": dcache, "logits": logits, "tokens": list(tokens)}

    def extend(self, base, tokens: Sequence[int]):
        """``base`` with ``tokens`` appended densely (a continued prefill)."""
        from jaxspec.decoding.autoregressive import prefill

        jax, jnp = _jax()
        array = np.asarray([tokens], np.int32)
        lengths = np.asarray([len(tokens)], np.int32)
        # one chunk size for every item (the chunk prefill picks grows with the token count: a new
        # compile whenever an item's question is longer)
        cache, logits = prefill(self.target.params, self.tcfg, array, lengths, jax.tree.map(jnp.copy, base["cache"]),
                                chunk=EXTEND_CHUNK)
        dcache = None
        if self.draft is not None:
            dcache, _ = prefill(self.draft.params, self.dcfg, array, lengths,
                                jax.tree.map(jnp.copy, base["draft_cache"]), chunk=EXTEND_CHUNK)
        return {"cache": cache, "draft_cache": dcache, "logits": logits, "tokens": base["tokens"] + list(tokens)}

    def _last_query(self, base, probe):
        from jaxspec.dustin.policy import last_prompt_query

        _, jnp = _jax()
        n = len(base["tokens"])
        if not probe:
            return jnp.zeros((1, 0, self.tcfg.head_dim), jnp.float32)
        return last_prompt_query(self.target.params, jnp.asarray([[base["tokens"][-1]]], jnp.int32),
                                  base["cache"].with_lengths(jnp.asarray([n - 1], jnp.int32)), config=self.tcfg,
                                  probe_heads=probe)

    def snap_state(self, base, budget):
        from jaxspec.baselines import SnapKVVerify

        _, jnp = _jax()
        policy = SnapKVVerify(self.tcfg, budget=budget, max_generated=self.engine.max_new_tokens + 64)
        n = len(base["tokens"])
        tokens = np.asarray([base["tokens"]], np.int32)
        if n >= policy.window:  # right-padded to the cache capacity: one compile for every item of a length
            tokens = np.pad(tokens, ((0, 0), (0, base["cache"].capacity - n)))
        return policy.prepare(self.target.params, self.tcfg, tokens, np.asarray([n], np.int32), cache=base["cache"])

    # -- decoding
    def decode(self, base, method: Method, *, reference: bool = False, arr_methods: Sequence[Method] = ()):
        """Greedy speculative decoding of one method from ``base`` (a full-prompt prefill). Returns
        (tokens, metrics, arr) -- ``arr``: mean ARR per ``arr_methods`` key on this (dense) trajectory
        when ``reference``."""
        from jaxspec.decoding import speculative
        from jaxspec.dustin.arr import all_heads, recall_of_indices, recall_weights

        jax, jnp = _jax()
        engine, tcfg = self.engine, self.tcfg
        copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731
        tokens = base["tokens"]
        n = len(tokens)
        first = jnp.argmax(base["logits"], axis=-1).astype(jnp.int32)
        draft_policy = self.magicdec_policy(method.budget) if method.name == "magicdec" else self.draft_policy
        if self.draft is not None:
            draft_state = copy(base["draft_cache"])
        elif method.name == "magicdec":
            draft_state = {}  # StreamingLLM self-draft without skipping (docs/methods.md §6: the SmolLM2 self-draft)
        else:
            draft_state = {"skip_mask": jnp.asarray(self.mask, bool)}
        probe_t = all_heads(tcfg) if reference else (self.probe_t if method.name.startswith("dustin") else ())
        query = self._last_query(base, probe_t)
        state = speculative.loop_state_from_caches(copy(base["cache"]), draft_state, first,
                                                   jnp.asarray([tokens[-1]], jnp.int32), engine, verify_state=query)
        stop = set(engine.stop_tokens)
        if int(first[0]) in stop:
            state = state._replace(done=jnp.ones((1,), bool))
        snaps = {}
        for m in ([method] if method.name == "snapkv" else []) + [m for m in arr_methods if m.name == "snapkv"]:
            snaps[m.budget] = self.snap_state(base, m.budget)
        probe_d = self.probe_d if draft_policy is self.draft_policy else ()
        select_static = dict(probe_t=probe_t, probe_d=probe_d, target_qpk=tcfg.queries_per_kv,
                             draft_qpk=self.dcfg.queries_per_kv, capacity=state.target_cache.capacity,
                             max_generated=self.engine.max_new_tokens + 64)
        arr_sums: Dict[str, float] = {m.key: 0.0 for m in arr_methods}
        arr_rounds = 0
        quest_budgets = tuple(sorted({m.budget for m in arr_methods if m.name == "quest"}))
        while int(state.round) < engine.max_new_tokens and not bool(jnp.all(state.done)):
            proposal, key = cached_jit("draft_phase", speculative.draft_phase,
                                       static_argnames=("target_config", "draft_policy", "engine"),
                                       donate_argnames=("draft_state", "target_cache"))(self.target.params, self.draft.params if self.draft else
                                                   self.target.params, state.draft_state, state.target_cache,
                                                   state.pending, state.previous, state.committed, state.key,
                                                   target_config=tcfg, draft_policy=draft_policy, engine=engine)
            signals = proposal.signals
            draft_q = signals.queries if signals is not None else None
            draft_keys = signals.keys if signals is not None else ()
            history = state.committed - 1
            cache = proposal.target_cache.with_lengths(history)
            rows = jnp.concatenate([state.pending[:, None], proposal.tokens], axis=1)
            if reference:
                logits, new_cache, queries, hprobs = cached_jit(
                    "reference", _reference_forward, static_argnames=("config",))(
                    self.target.params, rows, cache, config=tcfg)
                weights = recall_weights(hprobs, history)
                for m in arr_methods:
                    if m.name in ("quest", "magicdec"):
                        continue
                    if m.name in M_RULE_METHODS:
                        arr_sums[m.key] += self.m_rule_round(m, weights, state.verify_state, cache.keys,
                                                             state.committed, draft_q, draft_keys, select_static,
                                                             round_index=arr_rounds)
                        continue
                    t_select = time.perf_counter()
                    indices = cached_jit(f"select/{m.key}", _select, static_argnames=(
                        "method_name", "budget", "dustin", "probe_t", "probe_d", "target_qpk", "draft_qpk",
                        "capacity", "max_generated"))(
                        m.name, m.budget, m.dustin, state.verify_state, cache.keys, state.committed, draft_q,
                        draft_keys, snaps.get(m.budget), **select_static)
                    indices.block_until_ready()
                    if m.name == "dustin-h":
                        self.m_rule_stats.setdefault(m.key, {}).setdefault("select_s", []).append(
                            time.perf_counter() - t_select)
                    arr_sums[m.key] += float(recall_of_indices(weights, indices)[0])
                if quest_budgets:
                    quest = _round_arr(weights, hprobs, queries, cache.keys, history, quest_budgets, config=tcfg)
                    for i, budget in enumerate(quest_budgets):
                        arr_sums[f"quest/k{budget}"] += float(quest[i, 0])
                arr_rounds += 1
            elif method.name == "quest":
                logits, new_cache = cached_jit(f"quest/{method.budget}", _quest_forward,
                                         static_argnames=("config", "budget"))(
                    self.target.params, rows, cache, config=tcfg, budget=method.budget)
                queries = None
            else:
                indices = None
                if method.name == "dustin-h-oracle":
                    indices = self.oracle_indices(method, rows, cache, state.verify_state, state.committed, draft_q,
                                                  draft_keys, select_static)
                elif method.name not in ("dense", "magicdec"):
                    indices = cached_jit(f"select/{method.key}", _select, static_argnames=(
                        "method_name", "budget", "dustin", "probe_t", "probe_d", "target_qpk", "draft_qpk",
                        "capacity", "max_generated"))(
                        method.name, method.budget, method.dustin, state.verify_state, cache.keys, state.committed,
                        draft_q, draft_keys, snaps.get(method.budget), **select_static)
                logits, new_cache, queries = cached_jit("verify", _verify_forward,
                                                  static_argnames=("config", "probe_heads"))(
                    self.target.params, rows, cache, indices, config=tcfg, probe_heads=probe_t)
            before = state
            state = cached_jit("commit_phase", speculative.commit_phase, static_argnames=("engine",),
                               donate_argnames=("proposal", "target_cache"))(state._replace(target_cache=None, draft_state=None),
                                            proposal._replace(target_cache=None), logits, new_cache, key,
                                            engine=engine)
            if probe_t:
                num = state.committed - before.committed
                state = state._replace(verify_state=cached_jit("last_query", _take_last_query)(
                    before.verify_state, queries, num))
        out = np.asarray(state.out)[0, :engine.max_new_tokens]
        generated = [int(t) for t in out if t >= 0]
        metrics = speculative.summarize(state, engine)
        arr = {k: v / max(arr_rounds, 1) for k, v in arr_sums.items()} if reference else {}
        return generated, metrics, arr

    # -- input-aware and oracle m (docs/methods.md §3.7)
    def _signals(self, method, query, target_keys, committed, draft_q, draft_keys, select_static):
        static = {k: v for k, v in select_static.items() if k != "max_generated"}
        return cached_jit(f"signals/{method.key}", _dustin_signals, static_argnames=(
            "dustin", "probe_t", "probe_d", "target_qpk", "draft_qpk", "capacity"))(
            method.dustin, query, target_keys, committed, draft_q, draft_keys, **static)

    def _arr_curve(self, method, weights, s_draft, s_target, committed):
        from jaxspec.dustin.search import sweep_m

        cfg = method.dustin
        return sweep_m(np.asarray(weights), np.asarray(s_draft), np.asarray(s_target), np.asarray(committed - 1),
                       k=cfg.budget, sinks=cfg.sinks, window=cfg.window_size)

    def m_rule_round(self, method, weights, query, target_keys, committed, draft_q, draft_keys, select_static,
                     round_index: int = 0) -> float:
        """One reference round of ``dustin-h-ia`` / ``dustin-h-oracle``: its ARR; records the chosen m
        (and, for the input-aware rule, the selection time beside the fixed rule's on the same signals).
        ``round_index``: the round within the item; ``dustin-h-cov-held`` decides at multiples of its
        ``m_every`` and selects with the m it chose in the rounds between."""
        from jaxspec.dustin.arr import recall_of_indices
        from jaxspec.dustin.selection import (entropy_rule_args, max_mass_split, select_entropy_gated,
                                              select_held, select_input_aware, select_max_mass,
                                              select_verify_indices)

        cfg = method.dustin
        stats = self.m_rule_stats.setdefault(method.key, {})
        both = cfg.input_aware if method.name != "dustin-h-oracle" else bool(cfg.draft_layers and cfg.target_heads)
        if not both:  # no split to choose (no draft layer, or the rule has no choice at this m)
            stats.setdefault("m", []).append(cfg.effective_m)
            indices = cached_jit(f"select/{method.key}", _select, static_argnames=(
                "method_name", "budget", "dustin", "probe_t", "probe_d", "target_qpk", "draft_qpk", "capacity",
                "max_generated"))("dustin-h", cfg.budget, cfg.replace(m_rule="fixed"), query, target_keys, committed,
                                  draft_q, draft_keys, None, **select_static)
            return float(recall_of_indices(weights, indices)[0])
        s_draft, s_target = self._signals(method, query, target_keys, committed, draft_q, draft_keys, select_static)
        history = committed - 1
        if method.name == "dustin-h-oracle":
            curve = self._arr_curve(method, weights, s_draft, s_target, committed)
            best = int(np.argmax(curve))
            stats.setdefault("m", []).append(best)
            stats.setdefault("fixed_arr_from_curve", []).append(float(curve[cfg.effective_m]))
            return float(curve[best])
        # selection only (signals given), best of 3 calls each: fixed m vs this rule
        shape = dict(k=cfg.budget, sinks=cfg.sinks, window=cfg.window_size)
        if cfg.m_rule == "max-mass":
            rule = lambda: select_max_mass(s_draft, s_target, history, balance=cfg.m_balance, **shape)  # noqa: E731
        elif cfg.m_rule == "entropy":
            rule = lambda: select_entropy_gated(s_draft, s_target, history, **entropy_rule_args(cfg))  # noqa: E731
        else:
            rule = lambda: select_input_aware(s_draft, s_target, history, candidates=cfg.m_candidates, **shape)  # noqa: E731
        if cfg.m_every > 1:  # the held rule as the verifier runs it: decides at multiples of m_every, else holds
            _, jnp = _jax()
            held = self.m_held.get(method.key, jnp.full(history.shape, cfg.effective_m, jnp.int32))
            decide = jnp.asarray(round_index % cfg.m_every == 0)
            rule = lambda: select_held(cfg, s_draft, s_target, history, held, decide)  # noqa: E731
        timings = {}
        for name, call in (("fixed", lambda: select_verify_indices(s_draft, s_target, history, m=cfg.effective_m,
                                                                   **shape)),
                           ("input-aware", rule)):
            jax_out = call()  # compiled on the first round
            jax_out = jax_out[0] if isinstance(jax_out, tuple) else jax_out
            jax_out.block_until_ready()
            best_t = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                out = call()
                (out[0] if isinstance(out, tuple) else out).block_until_ready()
                best_t = min(best_t, time.perf_counter() - t0)
            timings[name] = best_t
        stats.setdefault("selection_s_fixed", []).append(timings["fixed"])
        stats.setdefault("selection_s_input_aware", []).append(timings["input-aware"])
        if cfg.m_rule == "max-mass":
            indices = rule()
            chosen = max_mass_split(s_draft, s_target, history, indices, sinks=cfg.sinks, window=cfg.window_size,
                                    balance=cfg.m_balance)
        else:
            indices, chosen = rule()
            if cfg.m_every > 1:
                self.m_held[method.key] = chosen
        stats.setdefault("m", []).append(int(chosen[0]))
        return float(recall_of_indices(weights, indices)[0])

    def oracle_indices(self, method, rows, cache, query, committed, draft_q, draft_keys, select_static):
        """``I_verify`` with the m maximising this round's ARR, read from a full-KV forward of the
        round (an oracle: it costs a dense verification)."""
        from jaxspec.dustin.arr import recall_weights
        from jaxspec.dustin.selection import select_verify_indices_rows

        _, jnp = _jax()
        cfg = method.dustin
        if not (cfg.draft_layers and cfg.target_heads):  # one signal only: the fixed selection
            return cached_jit(f"select/{method.key}", _select, static_argnames=(
                "method_name", "budget", "dustin", "probe_t", "probe_d", "target_qpk", "draft_qpk", "capacity",
                "max_generated"))("dustin-h", cfg.budget, cfg, query, cache.keys, committed, draft_q, draft_keys,
                                  None, **select_static)
        _, _, _, hprobs = cached_jit("reference", _reference_forward, static_argnames=("config",))(
            self.target.params, rows, cache, config=self.tcfg)
        weights = recall_weights(hprobs, committed - 1)
        s_draft, s_target = self._signals(method, query, cache.keys, committed, draft_q, draft_keys, select_static)
        best = int(np.argmax(self._arr_curve(method, weights, s_draft, s_target, committed)))
        return select_verify_indices_rows(s_draft, s_target, committed - 1, jnp.asarray([best], jnp.int32),
                                          k=cfg.budget, sinks=cfg.sinks, window=cfg.window_size)

    # -- teacher-forced perplexity
    def draft_chunk_scores(self, base, text: Sequence[int]):
        """Per chunk of ``gamma + 1`` text tokens, the draft's per-(layer, head) lookahead scores
        ``[P_D, S]`` (rows ``pending, x_1 .. x_{gamma-1}``; history = the tokens before the chunk)."""
        from jaxspec.dustin.signals import head_scores
        from jaxspec.models.llama import forward

        jax, jnp = _jax()
        gamma = self.engine.gamma
        if not self.probe_d:
            return [None] * (len(text) // (gamma + 1))
        d_layers = sorted({layer for layer, _ in self.probe_d})

        def fn(params, rows, cache, skip_mask, *, config, probe):
            out = forward(params, rows, cache, config=config, probe_heads=probe, skip_mask=skip_mask)
            q = out.probes.queries[:, :, :gamma]
            per_head = []
            for index, (layer, head) in enumerate(probe):
                per_head.append(head_scores(q[:, index:index + 1], out.cache.keys[layer], cache.lengths, (head,),
                                            config.queries_per_kv)[0])
            return jnp.stack(per_head), out.cache

        scorer = cached_jit("draft_scores", fn, static_argnames=("config", "probe"))
        cache = jax.tree.map(jnp.copy, base["draft_cache"] if self.draft is not None else base["cache"])
        params = self.draft.params if self.draft is not None else self.target.params
        mask = None if self.draft is not None else jnp.asarray(self.mask, bool)
        scores = []
        n = len(base["tokens"])
        for start in range(0, len(text) - gamma, gamma + 1):
            rows = jnp.asarray([text[start:start + gamma + 1]], jnp.int32)
            s, new_cache = scorer(params, rows, cache.with_lengths(jnp.asarray([n + start], jnp.int32)), mask,
                                  config=self.dcfg, probe=self.probe_d)
            scores.append(s)
            if self.draft is not None:
                cache = new_cache
            else:  # a self-draft reads the (dense) target cache: write the text's dense target KV there
                cache = cached_jit("dense_write", _verify_forward, static_argnames=("config", "probe_heads"))(
                    self.target.params, rows, cache.with_lengths(jnp.asarray([n + start], jnp.int32)), None,
                    config=self.tcfg, probe_heads=())[1]
        del d_layers
        return scores

    def perplexity(self, base, text: Sequence[int], method: Method, draft_scores) -> Dict[str, float]:
        """Teacher-forced NLL of ``text`` after ``base``: chunks of ``gamma + 1`` tokens verified like a
        round (every row attends to ``I_verify`` of the method + the chunk, causally); the KV the
        chunk writes is computed under the method's attention (as in decoding)."""
        jax, jnp = _jax()
        gamma = self.engine.gamma
        tcfg = self.tcfg
        cache = jax.tree.map(jnp.copy, base["cache"])
        n = len(base["tokens"])
        probe_t = self.probe_t if method.name.startswith("dustin") else ()
        query = self._last_query(base, probe_t)
        snap = self.snap_state(base, method.budget) if method.name == "snapkv" else None
        nll, count = 0.0, 0
        select_static = dict(probe_t=probe_t, probe_d=self.probe_d, target_qpk=tcfg.queries_per_kv,
                             draft_qpk=self.dcfg.queries_per_kv, capacity=cache.capacity,
                             max_generated=self.engine.max_new_tokens + 64)
        for chunk, start in enumerate(range(0, len(text) - gamma, gamma + 1)):
            rows = jnp.asarray([text[start:start + gamma + 1]], jnp.int32)
            committed = jnp.asarray([n + start + 1], jnp.int32)  # history = n + start positions
            cache = cache.with_lengths(committed - 1)
            queries = None
            if method.name == "quest":
                logits, cache = cached_jit(f"quest/{method.budget}", _quest_forward, static_argnames=("config", "budget"))(
                    self.target.params, rows, cache, config=tcfg, budget=method.budget)
            else:
                indices = None
                if method.name not in ("dense", "magicdec"):
                    scores = draft_scores[chunk]
                    indices = cached_jit(f"ppl-select/{method.key}", _select_from_scores, static_argnames=(
                        "method_name", "budget", "dustin", "probe_t", "probe_d", "target_qpk", "draft_qpk",
                        "capacity", "max_generated"))(
                        method.name, method.budget, method.dustin, query, cache.keys, committed, scores, snap,
                        **select_static)
                logits, cache, queries = cached_jit("verify", _verify_forward, static_argnames=("config", "probe_heads"))(
                    self.target.params, rows, cache, indices, config=tcfg, probe_heads=probe_t)
            targets = text[start + 1:start + gamma + 2]
            logp = jax.nn.log_softmax(logits[0, :len(targets)], axis=-1)
            nll -= float(jnp.sum(logp[jnp.arange(len(targets)), jnp.asarray(targets)]))
            count += len(targets)
            if probe_t:
                query = queries[:, :, -1]
        return {"nll": nll / count, "ppl": float(np.exp(nll / count)), "tokens": count}


def _dustin_signals(dustin, query, target_keys, committed, draft_q, draft_keys, *, probe_t, probe_d, target_qpk,
                    draft_qpk, capacity):
    """``(s_D, s_T) [B, S]`` of a hybrid Dustin config (traced; the inputs of :func:`_select`)."""
    from jaxspec.dustin.signals import DraftSignals, draft_signal, target_signal

    _, jnp = _jax()
    cfg = dustin
    history = (committed - 1).astype(jnp.int32)
    rows = [probe_t.index((cfg.target_layer, h)) for h in cfg.target_heads]
    s_target = target_signal(query[:, rows], target_keys[cfg.target_layer], history, cfg.target_heads, target_qpk)
    layers = sorted({layer for layer, _ in probe_d})
    keys = tuple(draft_keys[layers.index(layer)] for layer in cfg.draft_layers)
    s_draft = draft_signal(DraftSignals(queries=draft_q[:, _draft_rows(cfg, probe_d)], keys=keys), history,
                           cfg.draft_heads, draft_qpk, capacity)
    return s_draft, s_target


def _select_from_scores(method_name, budget, dustin, query, target_keys, committed, draft_scores, snap, *, probe_t,
                        probe_d, target_qpk, draft_qpk, capacity, max_generated):
    """``_select`` with the draft signal given as per-(layer, head) scores ``[P_D, S]`` (perplexity)."""
    from jaxspec.dustin.signals import fit_width

    _, jnp = _jax()

    def draft_scores_of(cfg, history):
        rows = jnp.asarray(_draft_rows(cfg, probe_d))
        return fit_width(jnp.sum(draft_scores[rows], axis=0)[None], capacity)

    return _select_with(method_name, budget, dustin, query, target_keys, committed, snap, draft_scores_of,
                        probe_t=probe_t, target_qpk=target_qpk, max_generated=max_generated)


def _match(tokens, reference) -> Tuple[float, Optional[int]]:
    """(token match rate over the reference's positions, first divergence index or None)."""
    total = max(len(reference), 1)
    same = sum(1 for a, b in zip(tokens, reference) if a == b)
    first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    if first is None and len(tokens) != len(reference):
        first = min(len(tokens), len(reference))
    return same / total, first


def _fmt(value) -> str:
    """``None`` (e.g. tau of a run whose first token was a stop token: no rounds) as ``-``."""
    return "-" if value is None else f"{value:.2f}"


def memory_summary() -> str:
    """Resident memory of this process and the live JAX arrays (progress lines; memory diagnostics)."""
    jax, _ = _jax()
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        rss = f"rss {int(fields['VmRSS'].split()[0]) / 2**20:.2f} GB (peak {int(fields['VmHWM'].split()[0]) / 2**20:.2f})"
    except (OSError, KeyError, ValueError):
        rss = "rss ?"
    arrays = jax.live_arrays()
    return f"{rss}, {len(arrays)} live arrays {sum(a.nbytes for a in arrays) / 2**30:.2f} GB"


def release_memory(clear_compiled: bool = False) -> None:
    """:func:`experiments.common.release_memory` with this module's jit table, timed into ``PHASES``."""
    t0 = time.perf_counter()
    common_release_memory(clear_compiled, jit_tables=(JITS,))
    PHASES["release_memory"] = PHASES.get("release_memory", 0.0) + time.perf_counter() - t0


def warm_cache_for_quality(args, names: Sequence[str], workers: int, length: int) -> List[Dict[str, Any]]:
    """Compile this run's programs in ``workers`` processes at once (:func:`warm_compilation_cache`):
    worker i runs one item of ``length`` with every ``workers``-th method from the i-th on, all budgets
    of a method in one worker (the ARR of Quest's budgets is one program); the programs every method
    needs (prefill, perplexity, dense decoding) are built in each."""
    groups = [",".join(names[i::workers]) for i in range(workers)]
    overrides = [{"--methods": group, "--items": f"{length}:1", "--out": f"{{tmp}}/worker{i}.json", "--plot": None,
                  "--warm-workers": None} for i, group in enumerate(groups)]
    return warm_compilation_cache("dustin-quality", args.argv, overrides)


def _select_items(evaluation, per_length: Dict[int, int], seed: int):
    import random

    items = []
    for length, count in sorted(per_length.items()):
        pool = [t for t in evaluation if t.context_tokens == length]
        random.Random(seed * 1000 + length).shuffle(pool)
        items.extend(pool[:count])
    return items


def cmd_dustin_quality(args) -> Dict[str, Any]:
    """Every method x budget on a fixed seeded sample of evaluation-split retrieval tasks.

    Per item (one task prompt): the target (and draft) prefill the prompt up to a scored segment
    of ``--ppl-tokens`` haystack tokens that ends before the question; the segment is then verified
    chunk by chunk (``gamma + 1`` tokens, teacher forced) with dense attention and with each method
    (perplexity); the rest of the prompt is prefilled densely; dense greedy speculative decoding
    (ClassicSD) of ``--max-new-tokens`` gives the reference output, tau and -- probing every head --
    the ARR of every method's index set on each of its rounds; then every method decodes from the
    same caches (token match rate and first divergence vs dense, retrieval accuracy, tau).
    """
    from jaxspec.dustin.search import DustinProfile
    from jaxspec.data.tasks import score_answer

    budgets = _check_budgets(args.budgets)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in names if m not in QUALITY_METHODS]
    if bad:
        raise ValueError(f"unknown --methods {bad}; valid: {', '.join(QUALITY_METHODS)}")
    m_steps = getattr(args, "m_steps", 1)
    per_length_m = getattr(args, "dustin_m_per_length", False)
    if m_steps < 1:
        raise ValueError(f"--m-steps={m_steps}: must be >= 1 (steps of the coverage rule's candidate ladder)")
    if m_steps != 1 and "dustin-h-cov" not in names:
        raise ValueError(f"--m-steps={m_steps} widens the coverage rule's candidates: add dustin-h-cov to --methods")
    m_every = getattr(args, "m_every", None)
    if m_every is not None and m_every < 2:
        raise ValueError(f"--m-every={m_every}: must be >= 2 (dustin-h-cov-held decides every N-th round; "
                         f"dustin-h-cov is the rule deciding every round)")
    if m_every is not None and HELD_METHOD not in names:
        raise ValueError(f"--m-every={m_every} sets how often {HELD_METHOD} decides: add it to --methods")
    m_every = HELD_EVERY if m_every is None else m_every
    per_length = {}
    for part in args.items.split(","):
        try:
            length, count = part.split(":")
            per_length[int(length)] = int(count)
        except ValueError:
            raise ValueError(f"--items {args.items!r}: expected LENGTH:COUNT pairs, e.g. 2048:2,4096:1") from None
    if not args.dustin_profile:
        raise ValueError("dustin-quality needs --dustin-profile FILE (from `dustin-profile` for this pair)")
    profile = DustinProfile.load(args.dustin_profile)
    missing = [b for b in budgets if b not in profile.configs]
    if missing:
        raise ValueError(f"{args.dustin_profile} has no config for k={missing}; profiled: {sorted(profile.configs)}")
    untabled = [b for b in budgets if not profile.m_by_length.get(b)]
    if per_length_m and untabled:
        raise ValueError(f"--dustin-m-per-length: {args.dustin_profile} has no m per context length for k={untabled} "
                         f"(add one with dustin-profile --extend FILE --recalibrate-m)")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    depths = _parse_floats(args.depths, "--depths")
    per_split = len(kinds) * len(depths) * args.samples
    for length, count in per_length.items():
        if count > per_split:
            raise ValueError(f"--items {length}:{count} asks for more items than the evaluation split holds per "
                             f"length ({len(kinds)} kinds x {len(depths)} depths x --samples {args.samples} = "
                             f"{per_split}); raise --samples")
    warm_workers = getattr(args, "warm_workers", 1)
    check_warm_workers(warm_workers, getattr(args, "argv", None), len(names))
    writer = ResultWriter(args.out, "dustin-quality", config_of(args))
    target, draft, mask = _load_pair(args)
    profile.check_models(target.config, draft.config if draft is not None else target.config)
    if mask is not None and not np.array_equal(np.asarray(profile.draft.get("self_draft_mask"), bool), mask):
        raise ValueError(f"{args.dustin_profile} was profiled for another self-draft skip set than {args.draft_skip!r}")
    _, evaluation = build_task_splits(target.tokenizer, args, kinds, sorted(per_length), depths)
    calib_hay = set(profile.data.get("haystack_sha256", []))
    overlap = calib_hay & {t.haystack_sha256 for t in evaluation if t.haystack_sha256}
    if overlap:
        raise ValueError(f"the evaluation tasks share haystack text with the profile's calibration data: {overlap}")
    items = _select_items(evaluation, per_length, args.task_seed)
    runner = QualityRunner(target, draft, mask, profile, args.gamma, args.max_new_tokens, stop_tokens(target.tokenizer))
    methods = runner.methods(budgets, names, m_steps=m_steps, m_every=m_every)
    writer.set("profile", {"file": args.dustin_profile, "created": profile.created, "target": profile.target.get("name"),
                           "draft": profile.draft.get("name"),
                           "configs": {str(b): c.to_dict() for b, c in sorted(profile.configs.items())},
                           "calibration_data": profile.data, "evaluation_haystack_disjoint": True})
    from jaxspec.data.tasks import TextCodec

    tok = TextCodec(target.tokenizer)
    pending = [task for task in items if not all(writer.has(f"{task.task_id}/{name}")
                                                 for name in ["dense"] + [m.key for m in methods])]
    warm_up = None
    if warm_workers > 1 and pending:
        warm_up = {"workers": warm_cache_for_quality(args, names, warm_workers, pending[0].context_tokens),
                   "first_item": None}
        counter = CompileCounter()
    started = time.perf_counter()
    compiled_for = None  # the context length the live executables were compiled for
    for number, task in enumerate(items, 1):
        item = task.task_id
        if task not in pending:
            continue
        if compiled_for is not None and compiled_for != task.context_tokens:
            release_memory(clear_compiled=True)  # other shapes from here on: free the old executables
        compiled_for = task.context_tokens
        item_methods = (runner.methods(budgets, names, m_steps=m_steps, context=task.context_tokens,
                                       m_every=m_every)
                        if per_length_m else methods)
        t0 = time.perf_counter()
        PHASES.clear()
        compiled0 = count_compiles()
        tokens = tok.encode(task.prompt)
        question = len(tok.encode(task.question)) + 2
        end = len(tokens) - question
        start = end - args.ppl_tokens
        if task.needle_span[1] > start:
            raise ValueError(f"{item}: the needle {task.needle_span} overlaps the perplexity segment [{start}, {end}); "
                             f"use depths < 1")
        capacity = task.context_tokens + args.max_new_tokens + 2 * args.gamma + 64
        print(f"[dustin-quality] item {number}/{len(items)} {item} ({len(tokens)} tokens): prefill ...",
              file=sys.stderr, flush=True)
        base0 = runner.prefill(tokens[:start], capacity)
        PHASES["prefill"] = time.perf_counter() - t0
        print(f"[dustin-quality]   prefill done ({time.perf_counter() - t0:.0f} s); {memory_summary()}", file=sys.stderr,
              flush=True)
        text = tokens[start:end]
        t_phase = time.perf_counter()
        draft_scores = runner.draft_chunk_scores(base0, text)
        ppl = {"dense": runner.perplexity(base0, text, Method("dense"), draft_scores)}
        for m in item_methods:
            if m.name not in ("magicdec", "dustin-h-oracle") and not writer.has(f"{item}/{m.key}"):
                ppl[m.key] = runner.perplexity(base0, text, m, draft_scores)
                release_memory()
                print(f"[dustin-quality]   ppl {m.key:16s} {ppl[m.key]['ppl']:.2f} ({time.perf_counter() - t0:.0f} s); "
                      f"{memory_summary()}", file=sys.stderr, flush=True)
        print(f"[dustin-quality]   perplexity done ({time.perf_counter() - t0:.0f} s): dense {ppl['dense']['ppl']:.2f}; "
              f"{memory_summary()}",
              file=sys.stderr, flush=True)
        PHASES["perplexity"] = time.perf_counter() - t_phase
        t_phase = time.perf_counter()
        base = runner.extend(base0, tokens[start:])
        del base0
        PHASES["extend"] = time.perf_counter() - t_phase
        if writer.has(f"{item}/dense"):
            dense = writer.get(f"{item}/dense")
        else:
            runner.m_rule_stats = {}
            t_phase = time.perf_counter()
            generated, metrics, arr = runner.decode(base, Method("dense"), reference=True, arr_methods=item_methods)
            PHASES["dense_decode_with_arr"] = time.perf_counter() - t_phase
            release_memory()
            text_out = target.tokenizer.decode(generated, skip_special_tokens=True)
            dense = {"task": item, "kind": task.kind, "context": task.context_tokens, "prompt_tokens": len(tokens),
                     "tokens": generated, "text": text_out, "accuracy": float(score_answer(task, text_out)),
                     "tau": metrics["tau"], "ppl": ppl["dense"]["ppl"], "nll": ppl["dense"]["nll"],
                     "ppl_tokens": ppl["dense"]["tokens"], "arr": arr, "rounds": metrics["rounds"],
                     "seconds": time.perf_counter() - t0,
                     "phase_seconds": dict(PHASES),  # release_memory: the part of the phases spent there
                     "compiles": compiles_since(compiled0)}  # XLA programs built for this item (none when warm)
            if runner.m_rule_stats:
                dense["m_rule"] = m_rule_summary(runner.m_rule_stats)
            writer.add(f"{item}/dense", dense)
        print(f"[dustin-quality]   dense: tau {_fmt(dense['tau'])}, accuracy {dense['accuracy']:.0f}, "
              f"{dense['text'][:60]!r} ({time.perf_counter() - t0:.0f} s); {memory_summary()}", file=sys.stderr, flush=True)
        for m in item_methods:
            key = f"{item}/{m.key}"
            if writer.has(key):
                continue
            t1 = time.perf_counter()
            compiled1 = count_compiles()
            generated, metrics, _ = runner.decode(base, m)
            release_memory()
            text_out = target.tokenizer.decode(generated, skip_special_tokens=True)
            rate, first = _match(generated, dense["tokens"])
            record = {"task": item, "kind": task.kind, "context": task.context_tokens, "method": m.name,
                      "budget": m.budget, "arr": None if m.name == "magicdec" else dense["arr"].get(m.key),
                      "match_rate": rate, "first_divergence": first, "accuracy": float(score_answer(task, text_out)),
                      "tau": metrics["tau"], "tokens": generated, "text": text_out,
                      "ppl": (ppl[m.key]["ppl"] if m.key in ppl else ppl["dense"]["ppl"]),
                      "nll": (ppl[m.key]["nll"] if m.key in ppl else ppl["dense"]["nll"]),
                      "seconds": time.perf_counter() - t1, "compiles": compiles_since(compiled1)}
            if m.name == "magicdec":
                record["note"] = "dense verification: output, accuracy and perplexity equal dense by construction"
            if m.dustin is not None:
                record["m"] = m.dustin.effective_m
            if m.name in M_RULE_METHODS:
                record["m_rule"] = M_RULE_METHODS[m.name]
                record.update(dense.get("m_rule", {}).get(m.key, {}))
                if m.name == "dustin-h-oracle":
                    record["ppl"] = record["nll"] = None
                    record["note"] = ("oracle: per round the m maximising ARR on the full-KV verification (a dense "
                                      "forward each round); no perplexity")
                elif m.dustin.m_rule in ("coverage", "entropy"):
                    record["m_candidates"] = list(m.dustin.m_candidates)
                    if m.dustin.m_rule == "entropy":
                        record.update(m_entropy_centre=m.dustin.m_entropy_centre,
                                      m_entropy_band=m.dustin.m_entropy_band)
                else:
                    record["m_balance"] = m.dustin.m_balance
            writer.add(key, record)
            arr_text = "-" if record["arr"] is None else f"{record['arr']:.3f}"
            print(f"[dustin-quality]   {m.key:16s} ARR {arr_text} match {rate:.2f} first_div {first} acc "
                  f"{record['accuracy']:.0f} tau {_fmt(metrics['tau'])} ppl {_fmt(record['ppl'])} "
                  f"({time.perf_counter() - t1:.0f} s; total {time.perf_counter() - started:.0f} s); {memory_summary()}",
                  file=sys.stderr, flush=True)
        del base
        release_memory()
        if warm_up is not None and warm_up["first_item"] is None:  # what the warm-up left this run to compile
            warm_up["first_item"] = {"task": item, **counter.counts()}
            writer.set("warm_up", writer.data.get("warm_up", []) + [warm_up])
    rows = quality_table(writer.data["cases"])
    print_table(rows, title=f"dustin-quality: mean over items ({len(items)} items)")
    print(quality_markdown(writer.data["cases"], budgets))
    if args.plot:
        plot = plot_m_rules if any(name in M_RULE_METHODS for name in names) else plot_arr
        plot(writer.data["cases"], args.plot, title=f"{args.model} + {args.draft or args.draft_skip}")
    return writer.data


def m_rule_summary(stats: Dict[str, Dict[str, list]]) -> Dict[str, Dict[str, Any]]:
    """Per method key: the chosen m per round and the mean selection seconds per round (fixed vs
    input-aware on the same signals; the rounds after the first, which compiles)."""
    out: Dict[str, Dict[str, Any]] = {}
    for key, values in stats.items():
        record: Dict[str, Any] = {}
        if "m" in values:
            record["m_per_round"] = [int(x) for x in values["m"]]
        if "fixed_arr_from_curve" in values:
            record["fixed_arr_from_curve"] = float(np.mean(values["fixed_arr_from_curve"]))
        for name in ("selection_s_fixed", "selection_s_input_aware"):
            if values.get(name):
                record[name] = float(np.mean(values[name]))
        if len(values.get("select_s", [])) > 1:  # signals + selection of the fixed rule; the first round compiles
            record["signals_and_selection_s"] = float(np.mean(values["select_s"][1:]))
        if record.get("selection_s_fixed"):
            record["selection_cost_ratio"] = record["selection_s_input_aware"] / record["selection_s_fixed"]
        out[key] = record
    return out


def quality_table(cases: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Mean per (method, k) over items; dense ClassicSD first."""
    # an item whose dense output ends at its first token (a stop token right after the prompt) has no
    # rounds: no ARR, nothing to agree on -- it counts for perplexity and accuracy only
    ended = {r["task"] for r in cases.values() if "method" not in r and len(r.get("tokens", [])) <= 1}
    token_fields = ("arr", "match_rate", "first_divergence", "tau")
    groups: Dict[Tuple[str, Any], List[dict]] = {}
    for record in cases.values():
        if record.get("task") in ended:
            record = {k: v for k, v in record.items() if k not in token_fields}
        name = record.get("method", "dense (ClassicSD)")
        groups.setdefault((name, record.get("budget")), []).append(record)
    order = {name: i for i, name in enumerate(("dense (ClassicSD)",) + QUALITY_METHODS)}
    rows = []
    for (name, budget), records in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1] or 0)):
        def mean(field):
            values = [r[field] for r in records if r.get(field) is not None]
            return float(np.mean(values)) if values else None

        firsts = [r["first_divergence"] for r in records if "match_rate" in r]
        rows.append({"method": name, "k": budget if budget is not None else "-", "items": len(records),
                     "ARR": mean("arr") if name != "dense (ClassicSD)" else 1.0,
                     "match": mean("match_rate") if firsts else 1.0,
                     "identical": (sum(f is None for f in firsts) / len(firsts)) if firsts else 1.0,
                     "first_div": (float(np.mean([f for f in firsts if f is not None]))
                                   if any(f is not None for f in firsts) else None),
                     "accuracy": mean("accuracy"), "tau": mean("tau"), "ppl": mean("ppl")})
    return rows


def quality_markdown(cases: Dict[str, Any], budgets: Sequence[int] = (128, 256, 512, 1024)) -> str:
    """One row per method, one column group per metric, k = 128/256/512/1024 inside each cell."""
    rows = quality_table(cases)
    by = {(r["method"], r["k"]): r for r in rows}

    def cell(name, field, fmt):
        values = [by.get((name, b), {}).get(field) for b in budgets]
        return " / ".join("-" if v is None else fmt.format(v) for v in values)

    lines = ["| method | ARR | token match vs dense | identical outputs | retrieval accuracy | perplexity | tau |",
             "|---|---|---|---|---|---|---|"]
    dense = by.get(("dense (ClassicSD)", "-"))
    if dense:
        lines.append(f"| dense (ClassicSD) | 1 | 1 | 1 | {_fmt(dense['accuracy'])} | {_fmt(dense['ppl'])} | "
                     f"{_fmt(dense['tau'])} |")
    for name in QUALITY_METHODS:
        if not any((name, b) in by for b in budgets):
            continue
        lines.append(f"| {name} | {cell(name, 'ARR', '{:.3f}')} | {cell(name, 'match', '{:.2f}')} | "
                     f"{cell(name, 'identical', '{:.2f}')} | {cell(name, 'accuracy', '{:.2f}')} | "
                     f"{cell(name, 'ppl', '{:.2f}')} | {cell(name, 'tau', '{:.2f}')} |")
    return "\n".join(lines)


def plot_arr(cases: Dict[str, Any], path: str, title: str = "") -> None:
    """ARR, greedy agreement and retrieval accuracy against k (:func:`experiments.tables.plots.arr_plot`),
    its folder made first."""
    from experiments.tables.plots import arr_plot

    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    arr_plot(cases, path, title)


# ---------------------------------------------------------------------------- registration
def plot_m_rules(cases: Dict[str, Any], path, title: str = "") -> None:
    """The m-rule plot of :func:`experiments.tables.plots.plot_m_rules`, its folder made first."""
    from experiments.tables.plots import plot_m_rules as plot

    if isinstance(path, (str, pathlib.Path)):
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    plot(cases, path, title)


def _pair_args(parser, budgets_default: str) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="target: registry name, .gguf, HF or orbax folder")
    parser.add_argument("--draft", default=None, help="separate draft model (same tokenizer)")
    parser.add_argument("--draft-skip", default=None, help="self-draft skipping sub-layers, e.g. 'mlp:10-12'")
    parser.add_argument("--budgets", default=budgets_default, help="KV budgets k (each one of 128..2048)")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--source", default="austen", help="haystack: austen, wikipedia, or a .txt/.jsonl path")
    parser.add_argument("--task-seed", type=int, default=0, help="seed of the task suites (both splits)")
    parser.add_argument("--samples", type=int, default=1, help="tasks per (kind, length, depth) in each split")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"],
                        help="float32 is faster than bfloat16 on CPU")


def register(subparsers) -> None:
    prof = subparsers.add_parser("dustin-profile", help="Dustin offline search: SRHs on calibration needle tasks + "
                                                        "Algorithm 1; saves the profile (--profile-file)")
    _pair_args(prof, "128,256,512,1024")
    prof.add_argument("--profile-file", default=None, metavar="FILE", help="where to save the profile JSON")
    prof.add_argument("--kinds", default="passkey,needle_qa", help="needle task kinds for SRH identification")
    prof.add_argument("--lengths", default="2048", help="calibration context lengths (tokens)")
    prof.add_argument("--depths", default="0.25,0.75")
    prof.add_argument("--max-new-tokens", type=int, default=16, help="greedy SD rounds' new tokens per calibration "
                                                                    "prompt (the ARR records)")
    prof.add_argument("--srh-max-new-tokens", type=int, default=None,
                      help="decode steps per needle test (default: longest answer + 8)")
    prof.add_argument("--recall-threshold", type=float, default=0.5)
    prof.add_argument("--srh-kv-groups", type=int, default=None, metavar="G",
                      help="GQA-aware SRHs: each layer's 4 heads from at most G KV groups (the best-scoring set "
                           "under that limit), so the scoring reads G KV heads' keys per SRH layer; default: "
                           "the best heads anywhere")
    prof.add_argument("--extend", default=None, metavar="FILE",
                      help="add --budgets to this existing profile: its SRHs, calibration rounds on --lengths "
                           "(e.g. longer prompts for a larger k), Algorithm 1 per new budget; its configs are kept")
    prof.add_argument("--recalibrate-m", action="store_true",
                      help="with --extend FILE: keep its SRH layers and recalibrate the split m of --budgets at each "
                           "of --lengths (step (c) of Algorithm 1 on calibration tasks of that length); the profile "
                           "then gives each run the m for its context length where asked (--dustin-m-per-length; "
                           "docs/methods.md §3.7)")
    prof.set_defaults(func=cmd_dustin_profile)

    bounds = subparsers.add_parser("dustin-m-bounds", help="how predictable the per-round best split m is: fixed m, "
                                                           "the oracle, the previous round's best m, the target "
                                                           "signal as the recall weights, the hindsight rule")
    _pair_args(bounds, "128,256,512,1024")
    bounds.add_argument("--dustin-profile", default=None, metavar="FILE", help="the pair's profile (dustin-profile)")
    bounds.add_argument("--kinds", default="passkey,needle_qa,kv_retrieval")
    bounds.add_argument("--lengths", default="2048", help="context lengths of the evaluation tasks (tokens)")
    bounds.add_argument("--depths", default="0.25,0.5,0.75")
    bounds.add_argument("--items", type=int, default=12, help="evaluation tasks decoded (the first N of the split)")
    bounds.add_argument("--max-new-tokens", type=int, default=48, help="greedy tokens per task (its rounds)")
    bounds.set_defaults(func=cmd_dustin_m_bounds)

    qual = subparsers.add_parser("dustin-quality", help="ARR, agreement with dense, perplexity, retrieval accuracy and "
                                                        "tau of Dustin-H/T/D and the sparse baselines per budget")
    _pair_args(qual, "128,256,512,1024")
    qual.add_argument("--dustin-profile", default=None, metavar="FILE", help="the pair's profile (dustin-profile)")
    qual.add_argument("--methods", default=",".join(ALL_METHODS))
    qual.add_argument("--items", default="2048:1,4096:1", help="LENGTH:COUNT evaluation tasks per context length")
    qual.add_argument("--kinds", default="passkey,needle_qa")
    qual.add_argument("--depths", default="0.25,0.5,0.75")
    qual.add_argument("--max-new-tokens", type=int, default=16)
    qual.add_argument("--ppl-tokens", type=int, default=40, help="teacher-forced haystack tokens for perplexity")
    qual.add_argument("--m-steps", type=int, default=1, metavar="N",
                      help="dustin-h-cov: steps of the coverage rule's candidate ladder on each side of the profiled m "
                           "(m -/+ i x 10 %% of k - s - w, i = 1..N; docs/methods.md §3.7)")
    qual.add_argument("--m-every", type=int, default=None, metavar="N",
                      help="dustin-h-cov-held: the coverage rule decides each row's m every N-th round only, the "
                           "rounds between select with that m by the fixed rule (docs/methods.md §3.7; default 3)")
    qual.add_argument("--dustin-m-per-length", action="store_true",
                      help="Dustin-H's m (and the input-aware rules' centre) from the profile's m per context length "
                           "at each item's length (dustin-profile --recalibrate-m; docs/methods.md §3.7) instead of "
                           "its one profiled m")
    qual.add_argument("--plot", default=None, metavar="PNG", help="ARR vs k per method")
    qual.add_argument("--warm-workers", type=int, default=1, metavar="N",
                      help="before the first item, N processes (each a share of --methods, one item of that length) "
                           "fill the persistent compilation cache in parallel, and the run loads its programs from it "
                           "instead of compiling them one by one (a fresh H200 process compiled 434 programs in "
                           "739 s for its first 32k item); 1: no warm-up. Not part of the results' config")
    qual.set_defaults(func=cmd_dustin_quality)
