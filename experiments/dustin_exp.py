"""Dustin (SPEC 3) from the command line: sparse-verification methods, the offline profile, quality.

* ``generate --method dustin | streaming | snapkv | quest | magicdec --budget K`` -- registered in
  :data:`experiments.foundation.METHOD_RUNNERS`. Every method runs in the same speculative engine
  with the same draft (``--draft SOURCE`` or a self-draft ``--draft-skip SPEC``) and gamma:

  - ``dustin``: Dustin verification (``--dustin-mode hybrid|target|draft`` = Dustin-H/T/D), the
    per-budget config of ``--dustin-profile FILE`` (written by ``dustin-profile``), else an
    unprofiled default (labelled in the JSON);
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

from experiments.common import REPO, ResultWriter, print_table

SPARSE_METHODS = ("dustin", "streaming", "snapkv", "quest", "magicdec")
PROFILE_DIR = REPO / "experiments" / "profiles"
SINKS = 4  # SPEC 3.2, shared by every sparse baseline


# ---------------------------------------------------------------------------- generate options
def add_dustin_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dustin / streaming / snapkv / quest / magicdec (sparse attention, SPEC 3)")
    group.add_argument("--budget", type=int, default=None, metavar="K",
                       help="KV budget k (history positions attended): one of 128, 256, 512, 1024, 2048")
    group.add_argument("--dustin-profile", default=None, metavar="FILE",
                       help="dustin: SRH profile of this target-draft pair (from `dustin-profile`); without it an "
                            "unprofiled default config is used and labelled as such")
    group.add_argument("--dustin-mode", default="hybrid", choices=["hybrid", "target", "draft"],
                       help="dustin: Dustin-H (both signals), Dustin-T (target signal only), Dustin-D (draft only)")


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
    if method == "quest" and (args.profile or args.fixed_tau):
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
        config = profile.config(args.budget, args.dustin_mode)
        info = {"profile": str(args.dustin_profile), "profile_created": profile.created,
                "profile_target": profile.target.get("name"), "profile_draft": profile.draft.get("name"),
                "profiled_arr": profile.search.get(str(args.budget), {}).get("arr")}
    else:
        config = default_dustin_config(args.budget, args.dustin_mode, target_config, draft_config, skip_mask)
        info = {"profile": None, "note": "unprofiled default config (no --dustin-profile): middle target layer, "
                                         "one middle draft layer, heads 0..3, m = (k - s - w) / 2"}
        print(f"[dustin] no --dustin-profile: using the unprofiled default {config.to_dict()}", file=sys.stderr)
    check_self_draft_layers(config, skip_mask)
    return config, info


def run_sparse(args, model, prompts, sampling, stops, out):
    """The runner of ``generate --method dustin | streaming | snapkv | quest | magicdec``."""
    from jaxspec.baselines import (MagicDecDraft, MagicDecSelfDraft, QuestVerify, SnapKVVerify, StreamingVerify,
                                   quest_speculative_generate)
    from jaxspec.decoding.policies import SelfDraft, SeparateDraft, describe_skip_mask, parse_skip_spec
    from jaxspec.decoding.speculative import (EngineConfig, acceptance_from_tau, check_compatible,
                                              speculative_generate)
    from jaxspec.dustin import dustin_policies

    from experiments.foundation import _load

    method, budget = args.method, args.budget
    config = model.config
    fixed = acceptance_from_tau(args.fixed_tau, args.gamma) if args.fixed_tau else None
    engine = EngineConfig(gamma=args.gamma, sampling=sampling, max_new_tokens=args.max_new_tokens,
                          stop_tokens=tuple(stops), fixed_acceptance=fixed)
    draft = mask = None
    if args.draft:
        draft = _load(args.draft, args.dtype)
        check_compatible(config, draft.config, model.tokenizer, draft.tokenizer)
        out["draft"] = {"source": draft.source, "config": draft.config.to_dict()}
    elif args.draft_skip:
        mask = parse_skip_spec(args.draft_skip, config.num_layers)
        out["draft"] = {"self_draft_skip": args.draft_skip, "skipped": describe_skip_mask(mask)}
    draft_params = draft.params if draft is not None else None
    draft_config = draft.config if draft is not None else None
    sparse: Dict[str, Any] = {"method": method, "budget": budget, "sinks": SINKS}
    verify_policy = None
    if method == "magicdec":
        if draft is not None:
            draft_policy, draft_state = MagicDecDraft(draft_config, sinks=SINKS, window=budget - SINKS), None
        else:
            draft_policy = MagicDecSelfDraft(config, sinks=SINKS, window=budget - SINKS)
            draft_state = draft_policy.initial_state(mask)
            out["draft"] = {"self_draft_streaming": f"{SINKS} sinks + {budget - SINKS} window",
                            **({"self_draft_skip": args.draft_skip, "skipped": describe_skip_mask(mask)}
                               if mask is not None else {})}
        sparse["draft_kv"] = f"StreamingLLM view, {SINKS} sinks + {budget - SINKS} window; dense verification"
    else:
        if method == "dustin":
            dustin, info = dustin_config_for(args, config, draft_config, mask)
            draft_policy, verify_policy = dustin_policies(dustin, config, draft_config)
            sparse.update(dustin=dustin.to_dict(), mode=dustin.mode, m=dustin.effective_m, **info)
        else:
            draft_policy = SeparateDraft(draft_config) if draft is not None else SelfDraft(config)
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
        draft_state = draft_policy.initial_state(mask) if mask is not None else None
    common = dict(draft_policy=draft_policy, draft_params=draft_params, draft_state=draft_state, engine=engine,
                  seed=args.seed, warmup=not args.no_warmup)
    if method == "quest":
        result = quest_speculative_generate(model.params, config, prompts, verify_policy=verify_policy, **common)
    else:
        kwargs = {} if verify_policy is None else {"verify_policy": verify_policy}
        result = speculative_generate(model.params, config, prompts, profile=args.profile, **common, **kwargs)
    out["sparse"] = sparse
    return result


run_sparse.validate = validate
METHOD_RUNNERS = {name: run_sparse for name in SPARSE_METHODS}
