"""``dustin-profile`` (SRH identification and Algorithm 1, docs/methods.md §3.3) and ``dustin-m-bounds`` (how
predictable the per-round best split m is, docs/methods.md §3.7)."""
from __future__ import annotations

import json
import sys
import time
from typing import Any, Dict

import numpy as np

from experiments.common import ResultWriter, config_of, print_table
from experiments.dustin_quality.options import check_self_draft_layers, profile_config
from experiments.dustin_quality.tasks import build_task_splits, load_pair, task_args


# ---------------------------------------------------------------------------- dustin-profile
def cmd_dustin_profile(args) -> Dict[str, Any]:
    """SRH identification + calibration rounds + Algorithm 1 on calibration-split needle tasks."""
    from jaxspec.decoding.policies import describe_skip_mask
    from jaxspec.dustin.search import profile_pair

    budgets, kinds, lengths, depths = task_args(args)
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
    target, draft, mask = load_pair(args)
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

    budgets, kinds, lengths, depths = task_args(args)
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
    target, draft, mask = load_pair(args)
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
    target, draft, mask = load_pair(args)
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
