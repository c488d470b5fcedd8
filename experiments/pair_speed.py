"""``pair-speed``: a real target + draft pair end to end at long context, every method side by side.

For every (context, batch) *case*, row ``b`` of the batch is the window of ``--text-file``'s tokens
starting at ``b * --row-stride`` (so the rows are different texts ending at different places),
cut to exactly ``context`` tokens, no chat template. The target and the draft are prefilled
once per case; every method then decodes from copies of both caches, greedy, with real
acceptance (no fixed-acceptance mode), and each method's timed run is paired with an
autoregressive run decoded just before it from the same prefilled cache in the same process.

Methods (``--methods``; AR is always run, it is the baseline): ``sd`` (ClassicSD: the draft
model, dense verification), ``magicdec`` (the draft reads 4 sinks + ``k - 4`` recent positions,
dense verification), ``dustin`` (Dustin-H/T/D with the pair's ``--dustin-profile``),
``streaming`` (StreamingLLM verification, 4 sinks + ``k - 4``), ``quest`` (Quest verification,
pages of 16, first 2 layers dense). Every speculative method uses the same draft model and gamma.

Per method and case: tokens/s, the speed-up against its paired AR run, tau, acceptance per draft
position, agreement with AR's greedy tokens (match rate, first divergence per row;
``identical_to_ar`` -- must hold for the dense-verification methods in float32), the roofline
tokens/s from the bytes a round must read at the copy bandwidth measured in the same process
(:func:`experiments.dustin_speed.method_round_bytes`), compile time apart. For the batches in
``--profile-batches`` the per-round split (draft / selection / verification / other, per-phase
jitted calls; Dustin's selection timed alone); for ``--trace-batches`` one profiler trace of the
timed loop per method (kernel launches and device-busy share per round).

``--backend-check N``: before the first case, the target's logits over the first ``N`` tokens of
row 0 with the chosen attention backend against the XLA reference (max abs difference, argmax
agreement), recorded once.

``--repeats N``: each method is timed in N (AR, method) pairs, each AR run decoded just before its
method's run; the record's speed-up is the median pair's ratio (adjacent runs share the machine's
drift), its tokens/s the medians of each side, and ``pairs`` keeps every pair (and the measured
choice's decision in each, which depends on timings, and whether it decoded the first pair's tokens).

Each method's record is written as soon as it is measured: a rerun with the same ``--out`` skips
finished cases and, in an interrupted case (``"complete": false``), the finished methods (the
case is prefilled again for the rest).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import time
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from experiments.common import (ResultWriter, config_of, fused_if_asked, load_choice_table, print_table,
                                progress_line)
from experiments.dustin_speed import DUSTIN_METHODS, SPARSE_DRAFT_KV  # Dustin-H, and with a sparse draft KV
from jaxspec.decoding.arbitration import MeasuredChoiceController

#: self-speculation without a second model (docs/methods.md §5.1): the target drafts over sinks + a window of its
#: own cache; MagicDec's self-draft verifies densely, Dustin-H's sparsely on I_verify
SELF_METHODS = ("magicdec-self", "dustin-self")
METHODS = ("sd", "magicdec", "dustin", "streaming", "quest") + tuple(SPARSE_DRAFT_KV) + SELF_METHODS
#: what runs without --methods (the sparse-draft variants and the self-drafts are asked for by name)
DEFAULT_METHODS = METHODS[:5]
#: the round's bytes of a self method are those of this separate-draft method with the target as the draft
SELF_BYTES_METHOD = {"magicdec-self": "magicdec", "dustin-self": "dustin-kv-streaming"}
#: the methods that read --dustin-profile
PROFILED_METHODS = DUSTIN_METHODS + ("dustin-self",)
#: dense verification: greedy output equals AR's (token for token in float32)
DENSE_METHODS = ("sd", "magicdec", "magicdec-self")
SPARSE_BUDGET_METHODS = ("magicdec", "dustin", "streaming", "quest") + tuple(SPARSE_DRAFT_KV) + SELF_METHODS
#: options recorded in a results file's config only when set
OPTIONAL_CONFIG = (
    "arbitrate", "arbitrate_tail", "arbitrate_tail_prior", "arbitrate_table", "arbitrate_table_tail_after",
    "arbitrate_table_tail_margin", "arbitrate_warmup", "fused_projections", "repeats")
#: ``--backend-check`` fails when the last-position logits differ by more than this share of their scale
BACKEND_CHECK_RTOL = 0.05


def _ints(text: str, flag: str, allow_empty: bool = False) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag}={text!r}: expected comma-separated integers") from None
    if (not values and not allow_empty) or any(v < 1 for v in values):
        raise ValueError(f"{flag}={text!r}: expected {'zero or ' if allow_empty else ''}more integers >= 1")
    return values


def check_args(args) -> Tuple[List[int], List[int], List[str]]:
    """Every check that needs no model (before anything loads)."""
    from jaxspec.dustin.config import check_budget

    contexts = _ints(args.contexts, "--contexts")
    batches = _ints(args.batches, "--batches")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"--methods={args.methods!r}: choose one or more of {', '.join(METHODS)} (AR always runs)")
    if args.reselect_every is not None and args.reselect_every < 1:
        raise ValueError(f"--reselect-every={args.reselect_every} must be >= 1 (1: select every round)")
    _ints(args.profile_batches, "--profile-batches", allow_empty=True)
    _ints(args.trace_batches, "--trace-batches", allow_empty=True)
    if any(m in SPARSE_BUDGET_METHODS for m in methods):
        check_budget(args.budget)
        small = [c for c in contexts if c <= args.budget]
        if small:
            raise ValueError(f"--contexts {small} are not longer than --budget {args.budget}: the sparse methods "
                             f"would attend to the whole history")
    if any(m in PROFILED_METHODS for m in methods) and args.dustin_profile and not pathlib.Path(
            args.dustin_profile).is_file():
        raise ValueError(f"--dustin-profile {args.dustin_profile}: no such file")
    for flag in ("gamma", "max_new_tokens", "row_stride"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be >= 1")
    if args.arbitrate < 0 or args.arbitrate_tail < 0:
        raise ValueError(f"--arbitrate={args.arbitrate} / --arbitrate-tail={args.arbitrate_tail}: rounds >= 0 "
                         f"(0 = off)")
    if args.arbitrate_tail and not args.arbitrate:
        raise ValueError("--arbitrate-tail refines --arbitrate ROUNDS (the measured choice); give --arbitrate too")
    warmup = getattr(args, "arbitrate_warmup", 0)
    if warmup < 0 or (warmup and not args.arbitrate):
        raise ValueError(f"--arbitrate-warmup={warmup}: untimed rounds >= 0 before each side of the probe, with "
                         f"--arbitrate ROUNDS")
    if args.arbitrate_tail_prior is not None and (args.arbitrate_tail_prior < 0 or not args.arbitrate_tail):
        raise ValueError(f"--arbitrate-tail-prior={args.arbitrate_tail_prior}: needs --arbitrate-tail and a value >= 0 "
                         f"(rounds of weight on the batch mean; 0 = each row's own rate)")
    if getattr(args, "arbitrate_table", None):
        if not args.arbitrate:
            raise ValueError("--arbitrate-table gives the measured choice its decisions; give --arbitrate ROUNDS too "
                             "(the probe for keys the table does not hold)")
        load_choice_table(args.arbitrate_table, args.model, args.draft)
    after = getattr(args, "arbitrate_table_tail_after", 0)
    if after < 0 or (after and not (getattr(args, "arbitrate_table", None) and args.arbitrate_tail)):
        raise ValueError(f"--arbitrate-table-tail-after={after}: rounds >= 1 (0 = off), and it needs --arbitrate-table "
                         f"and --arbitrate-tail (it tail-checks the table's decisions)")
    margin = getattr(args, "arbitrate_table_tail_margin", None)
    if margin is not None and (not after or not 0 <= margin < 1):
        raise ValueError(f"--arbitrate-table-tail-margin={margin}: a share in [0, 1) (switch a table's decision when "
                         f"plain decoding finishes at least that much sooner), with --arbitrate-table-tail-after")
    if args.arbitrate and "quest" in methods:
        raise ValueError("--arbitrate: quest is not run under the measured choice; drop it from --methods")
    if getattr(args, "repeats", None) is not None and args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats}: timed (AR, method) pairs per method, >= 1")
    if args.backend_check < 0:
        raise ValueError(f"--backend-check={args.backend_check}: a token count >= 0 (0 = off)")
    if getattr(args, "compile_threads", 0) < 0:
        raise ValueError(f"--compile-threads={args.compile_threads}: >= 0 (0: one per method, 1: no precompiling)")
    if not pathlib.Path(args.text_file).is_file():
        raise ValueError(f"--text-file {args.text_file}: no such file")
    return contexts, batches, methods


def row_windows(ids: Sequence[int], context: int, batch: int, stride: int) -> np.ndarray:
    """``[batch, context]`` token windows of ``ids``, row ``b`` starting at ``b * stride``."""
    needed = context + (batch - 1) * stride
    if len(ids) < needed:
        raise ValueError(f"the text has {len(ids)} tokens; {batch} rows of {context} tokens {stride} apart need "
                         f"{needed} (a longer --text-file or a smaller --row-stride)")
    ids = np.asarray(ids, np.int32)
    return np.stack([ids[b * stride: b * stride + context] for b in range(batch)])


def agreement(tokens: np.ndarray, reference: np.ndarray) -> Dict[str, Any]:
    """Token match rate with ``reference`` and each row's first differing position (``None``: none)."""
    same = tokens == reference
    first = [None if row.all() else int(np.argmin(row)) for row in same]
    return {"match_rate": float(same.mean()), "first_divergence": first, "identical": bool(same.all())}


def sparse_args(args, method: str) -> argparse.Namespace:
    """The ``generate``-style options :func:`experiments.dustin_quality.sparse_policies` reads."""
    draft_kv = SPARSE_DRAFT_KV.get(method, "full")
    return argparse.Namespace(method="dustin" if method in DUSTIN_METHODS else method, budget=args.budget,
                              dustin_profile=args.dustin_profile, dustin_mode=args.dustin_mode, draft_kv=draft_kv,
                              draft_window=None, dustin_reselect_every=getattr(args, "reselect_every", None),
                              dustin_m_rule="fixed", draft_skip=None, max_new_tokens=args.max_new_tokens)


def self_draft_dustin_config(args, target_config, draft_config):
    """Dustin-H with the target as its own draft over sinks + a window of its cache: the pair's profile
    (``--dustin-profile``, checked against both models) at ``--budget`` gives the target SRH layer and heads,
    the split m and the sinks; the draft signal is the self-draft's lookahead queries at those same target
    SRH heads (the self-draft is the target, so its SRHs are the target's; not searched by Algorithm 1
    for the self-draft). ``(DustinConfig, info)``."""
    from experiments.dustin_quality import dustin_config_for

    dustin, info = dustin_config_for(sparse_args(args, "dustin"), target_config, draft_config, None)
    dustin = dustin.replace(draft_layers=(dustin.target_layer,), draft_heads=(tuple(dustin.target_heads),),
                            draft_kv="streaming")
    return dustin, {**info, "draft_srh": "the target's SRH layer and heads (self-draft)"}


def build_policies(args, method: str, target_config, draft_config):
    """``(draft_policy, verify_policy, description)`` of one method: with the separate draft, or (the
    :data:`SELF_METHODS`) the target drafting over sinks + a window of its own cache."""
    from jaxspec.decoding.policies import DenseVerify, SeparateDraft

    if method == "sd":
        return SeparateDraft(draft_config), DenseVerify(), {"method": "sd", "verification": "dense"}
    if method == "magicdec-self":
        from experiments.dustin_quality import SINKS
        from jaxspec.baselines import MagicDecSelfDraft

        return (MagicDecSelfDraft(target_config, sinks=SINKS, window=args.budget - SINKS), DenseVerify(),
                {"method": method, "budget": args.budget, "sinks": SINKS, "verification": "dense",
                 "draft": f"the target over {SINKS} sinks + a {args.budget - SINKS}-token window of its cache"})
    if method == "dustin-self":
        from jaxspec.dustin import dustin_policies

        dustin, info = self_draft_dustin_config(args, target_config, draft_config)
        draft_policy, verify_policy = dustin_policies(dustin, target_config, None)
        return draft_policy, verify_policy, {"method": method, "budget": args.budget, "dustin": dustin.to_dict(),
                                             "mode": dustin.mode, "m": dustin.effective_m, **info,
                                             "draft": f"the target over {dustin.sinks} sinks + a "
                                                      f"{dustin.draft_window_size}-token window of its cache"}
    from experiments.dustin_quality import sparse_policies

    draft_policy, _, verify_policy, sparse, _ = sparse_policies(sparse_args(args, method), target_config,
                                                                draft_config)
    return draft_policy, verify_policy or DenseVerify(), {**sparse, "method": method}


def check_pair_memory(config, draft_config, cases: Sequence[Tuple[int, int, int]], separate: bool,
                      device_bytes) -> List[Any]:
    """The memory plan of each ``(context, batch, capacity)`` case: weights, the prefilled caches every method
    starts from, and one run's own copy of them (a timed run works on a copy; the warm-up's and the finished
    runs' states are released first). Raises :class:`~jaxspec.models.memory.MemoryPlanError` before any cache
    is allocated where one does not fit ``device_bytes`` (``None``: not reported, e.g. the CPU)."""
    from jaxspec.models.memory import plan_memory

    plans = []
    for context, batch, capacity in cases:
        plan = plan_memory(config, context=capacity, batch=batch, draft_config=draft_config if separate else None)
        if device_bytes:
            try:
                plan.check(device_bytes, reserve_bytes=plan.target_cache + plan.draft_cache)
            except ValueError as err:
                raise type(err)(f"pair-speed at context {context}, batch {batch} (the prefilled caches plus one "
                                f"run's copy of them) {err}; run a smaller --batches or --contexts") from None
        plans.append(plan)
    return plans


def backend_check(model, ids: Sequence[int], tokens: int) -> Dict[str, Any]:
    """The target's logits over the first ``tokens`` ids with its attention backend vs XLA's."""
    import jax
    import jax.numpy as jnp

    from jaxspec.decoding.autoregressive import prefill
    from jaxspec.models.cache import init_cache

    row = np.asarray(ids[:tokens], np.int32)[None]
    lengths = np.array([row.shape[1]], np.int32)
    from jaxspec.models.attention import backend_of

    out = {}
    for name, config in (("backend", model.config), ("xla", dataclasses.replace(model.config,
                                                                                  attention_backend="xla"))):
        capacity = backend_of(config).round_capacity(row.shape[1] + 8)
        cache = init_cache(config, 1, capacity)
        _, logits = prefill(model.params, config, row, lengths, cache)
        out[name] = np.asarray(jnp.asarray(logits, jnp.float32))
        jax.block_until_ready(logits)
    diff = np.abs(out["backend"] - out["xla"])
    result = {"tokens": int(row.shape[1]), "backend": model.config.attention_backend,
              "max_abs_logit_diff": float(diff.max()), "logit_scale": float(np.abs(out["xla"]).max()),
              "argmax_equal": bool((out["backend"].argmax(-1) == out["xla"].argmax(-1)).all()),
              "tolerance": f"argmax equal and max |diff| <= {BACKEND_CHECK_RTOL} x the largest |logit|"}
    if not result["argmax_equal"] or result["max_abs_logit_diff"] > BACKEND_CHECK_RTOL * result["logit_scale"]:
        raise RuntimeError(f"--backend-check: the {result['backend']} attention disagrees with XLA's on "
                           f"{result['tokens']} tokens (max |logit diff| {result['max_abs_logit_diff']:.4g} of "
                           f"{result['logit_scale']:.4g}, argmax equal: {result['argmax_equal']}); not timing it")
    return result


def cmd_pair_speed(args) -> Dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from experiments.common import encode_prompt, load_model_timed
    from experiments.decode_speed import copy_bandwidth, decode_bytes_per_step
    from experiments.dustin_speed import method_round_bytes, selection_timing
    from experiments.trace import trace_or_error
    from jaxspec.decoding.autoregressive import decode_loop, prefill
    from jaxspec.decoding.policies import SeparateDraft
    from jaxspec.decoding.sampling import SamplingConfig
    from jaxspec.decoding.speculative import (EngineConfig, check_compatible, precompile_loops, run_loop,
                                              speculative_generate)
    from jaxspec.models.attention import backend_of, get_backend
    from jaxspec.models.cache import init_cache
    from jaxspec.models.llama import param_bytes
    from jaxspec.models.memory import device_memory_bytes

    contexts, batches, methods = check_args(args)
    profile_batches = set(_ints(args.profile_batches, "--profile-batches", allow_empty=True))
    trace_batches = set(_ints(args.trace_batches, "--trace-batches", allow_empty=True))
    # options at their "off" default stay out of the config, so files written before they existed still resume
    writer = ResultWriter(args.out, "pair-speed", config_of(args, exclude=[k for k in OPTIONAL_CONFIG
                                                                            if not getattr(args, k)]))
    if not writer.has("copy_bandwidth"):
        writer.add("copy_bandwidth", copy_bandwidth(args.copy_gib))
    bandwidth = writer.get("copy_bandwidth")["bandwidth_Bps"]
    backend = get_backend(args.attention_backend).name
    model = load_model_timed(args.model, args.dtype, backend)
    draft = load_model_timed(args.draft, args.dtype, backend)
    check_compatible(model.config, draft.config, model.tokenizer, draft.tokenizer)
    # both models, every method and AR (docs/methods.md §2, fused projections)
    model.params, draft.params = fused_if_asked(args, model.params, draft.params)
    config, draft_config = model.config, draft.config
    writer.set("models", {"target": {"source": model.source, "config": config.to_dict()},
                          "draft": {"source": draft.source, "config": draft_config.to_dict()}})
    ids = encode_prompt(model.tokenizer, pathlib.Path(args.text_file).read_text(), chat=False)
    if args.backend_check and backend != "xla" and not writer.has("backend_check"):
        progress_line(f"checking the {backend} attention against XLA on {args.backend_check} tokens")
        writer.add("backend_check", backend_check(model, ids, args.backend_check))
    target_bytes, draft_bytes = param_bytes(model.params), param_bytes(draft.params)
    kv_bytes = 4 if args.dtype == "float32" else 2  # bytes per cached K/V element (the cache has the model dtype)
    engine = EngineConfig(gamma=args.gamma, sampling=SamplingConfig(), max_new_tokens=args.max_new_tokens,
                          stop_tokens=(), skip_finished_rows=not args.keep_finished_rows)
    policies = {m: build_policies(args, m, config, draft_config) for m in methods}
    capacity_of = {c: backend_of(config).round_capacity(c + args.max_new_tokens + args.gamma + 2) for c in contexts}
    check_pair_memory(config, draft_config, [(c, b, capacity_of[c]) for c in contexts for b in batches],
                      any(m not in SELF_METHODS for m in methods), device_memory_bytes())
    rows: List[Dict[str, Any]] = []
    for context in contexts:
        for batch in batches:
            key = f"ctx{context}/b{batch}"
            previous = writer.get(key) if writer.has(key) else None
            if previous is not None and previous.get("complete", True):
                rows.extend(previous["rows"])
                continue
            tokens = row_windows(ids, context, batch, args.row_stride)
            lengths = np.full((batch,), context, np.int32)
            capacity = capacity_of[context]
            entry: Dict[str, Any] = {"context": context, "batch": batch, "capacity": capacity,
                                     "row_starts": [b * args.row_stride for b in range(batch)], "complete": False}
            if previous is not None:  # an interrupted case: keep the methods it finished
                entry.update({m: previous[m] for m in methods if m in previous})
            separate = any(m not in SELF_METHODS for m in methods)  # a self-draft reads the target's cache
            progress_line(f"{key}: prefilling the target{' and the draft' if separate else ''} "
                          f"({batch} x {context} tokens)")
            start = time.perf_counter()
            cache = init_cache(config, batch, capacity)
            prefilled = prefill(model.params, config, tokens, lengths, cache)
            jax.block_until_ready(prefilled)
            entry["target_prefill_s"] = time.perf_counter() - start  # compile included
            draft_cache = None
            if separate:
                start = time.perf_counter()
                draft_cache = SeparateDraft(draft_config).prefill(draft.params, tokens, lengths, capacity)
                jax.block_until_ready(draft_cache)
                entry["draft_prefill_s"] = time.perf_counter() - start
            # ---- AR, compiled once per case; one run paired with each method
            start = time.perf_counter()
            ar_compiled = decode_loop.lower(model.params, prefilled[0], prefilled[1], jax.random.PRNGKey(0),
                                            config=config, sampling=SamplingConfig(),
                                            max_new_tokens=args.max_new_tokens, stop_tokens=()).compile()
            entry["ar_compile_s"] = time.perf_counter() - start

            def ar_run():
                c, logits = jax.tree.map(jnp.copy, prefilled)
                jax.block_until_ready(c)
                t0 = time.perf_counter()
                out, _ = ar_compiled(model.params, c, logits, jax.random.PRNGKey(0))
                out = np.asarray(out)
                return out, time.perf_counter() - t0

            ar_run()  # the first call allocates; not timed
            pending = [m for m in methods if m not in entry and not args.arbitrate]  # arbitration runs other loops
            if args.compile_threads != 1 and len(pending) > 1:
                progress_line(f"{key}: compiling the round loops of {', '.join(pending)} at once")
                # the separate-draft methods and the self-drafts take different draft inputs: one call each
                groups = [g for g in ([m for m in pending if m not in SELF_METHODS],
                                      [m for m in pending if m in SELF_METHODS]) if g]
                records = []
                for group in groups:
                    dp, ds = _draft_inputs(group[0], model, draft, draft_cache)
                    records.append(precompile_loops(
                        model.params, config, [policies[m][:2] for m in group], tokens=tokens, lengths=lengths,
                        capacity=capacity, engine=engine, draft_params=dp, draft_state=ds, prefilled=prefilled,
                        threads=args.compile_threads or None))
                entry["precompile"] = records[0] | {"methods": pending} if len(records) == 1 else {
                    "methods": pending, "groups": [{"methods": g, **r} for g, r in zip(groups, records)],
                    **{k: sum(r[k] for r in records) for k in ("programs", "lower_s", "compile_s")},
                    "threads": max(r["threads"] for r in records)}
            target_step = decode_bytes_per_step(config, batch, context, target_bytes, kv_bytes)
            roof_ar = batch / (target_step["total"] / bandwidth)
            ar_runs = list((previous or {}).get("ar", {}).get("runs", []))
            ar_tokens = None
            case_rows = []
            for method in methods:
                if method in entry:  # finished before an interruption
                    case_rows.append(entry[method]["row"])
                    continue
                draft_policy, verify_policy, description = policies[method]
                progress_line(f"{key}: {method} (a first run compiles, then the timed run)")
                ar_tokens, ar_s = ar_run()
                ar_tps = ar_tokens.size / ar_s
                ar_runs.append({"before": method, "decode_s": ar_s, "tok_s": ar_tps})
                dp, ds = _draft_inputs(method, model, draft, draft_cache)

                def spec_run(profile=False, method=method, draft_policy=draft_policy, verify_policy=verify_policy,
                             dp=dp, ds=ds):
                    # the measured choice (docs/methods.md §5.2) is probed afresh in every timed run
                    controller = measured_choice(args, method) if args.arbitrate else None
                    return speculative_generate(model.params, config, [], prompt_tokens=(tokens, lengths),
                                                draft_policy=draft_policy, draft_params=dp,
                                                draft_state=ds, verify_policy=verify_policy, engine=engine,
                                                capacity=capacity, warmup=True, profile=profile,
                                                prefilled=prefilled, controller=controller)

                # the final loop state (both caches) is not read here: dropped, so that the repeats below and the
                # next method's runs do not hold it beside their own
                result = dataclasses.replace(spec_run(profile=batch in profile_batches), final_state=None)
                spec_tokens = np.asarray(result.tokens)
                tok_s = float(result.num_generated.sum()) / result.timings["decode_s"]
                pairs = [_pair(tok_s, ar_tps, result.metrics)]
                for repeat in range(1, args.repeats or 1):  # more (AR, method) pairs, adjacent in time
                    progress_line(f"{key}: {method}, timed pair {repeat + 1} of {args.repeats}")
                    again_tokens, again_s = ar_run()
                    ar_runs.append({"before": method, "repeat": repeat, "decode_s": again_s,
                                    "tok_s": again_tokens.size / again_s})
                    again = dataclasses.replace(spec_run(), final_state=None)
                    pairs.append(_pair(float(again.num_generated.sum()) / again.timings["decode_s"],
                                       ar_runs[-1]["tok_s"], again.metrics))
                    # greedy decoding from the same cache repeats its tokens, unless the measured choice took
                    # another path (plain decoding from another round) under sparse or low-precision verification
                    pairs[-1]["same_tokens"] = bool(np.array_equal(np.asarray(again.tokens), spec_tokens))
                    del again
                if len(pairs) > 1:  # the median pair's ratio: adjacent runs share the machine's drift
                    tok_s = float(np.median([p["tok_s"] for p in pairs]))
                    ar_tps = float(np.median([p["paired_ar_tok_s"] for p in pairs]))
                dustin = getattr(verify_policy, "dustin", None)  # the Dustin methods' DustinConfig
                self_draft = method in SELF_METHODS
                bytes_round = method_round_bytes(SELF_BYTES_METHOD.get(method, method), target_config=config,
                                                 draft_config=config if self_draft else draft_config,
                                                 batch=batch, context=context, budget=args.budget,
                                                 gamma=args.gamma, target_bytes=target_bytes,
                                                 draft_bytes=target_bytes if self_draft else draft_bytes,
                                                 dustin=dustin, dtype_bytes=kv_bytes)
                metrics = result.metrics
                roof = batch * metrics["tau_untruncated"] / (bytes_round / bandwidth)
                record = {"description": description, "metrics": metrics, "timings": result.timings,
                          "tok_s": tok_s, "paired_ar_tok_s": ar_tps,
                          "speedup_vs_ar": float(np.median([p["speedup_vs_ar"] for p in pairs])),
                          "agreement_with_ar": agreement(spec_tokens, ar_tokens), "round_bytes": bytes_round,
                          "roofline_tok_s": roof, "roofline_speedup": roof / roof_ar,
                          "tokens_row0": spec_tokens[0].tolist()}
                if len(pairs) > 1:
                    record["pairs"] = pairs
                row = {"context": context, "batch": batch, "method": method, "tok_s": tok_s,
                       "speedup": record["speedup_vs_ar"], "tau": metrics["tau"], "match_ar": record["agreement_with_ar"][
                           "match_rate"], "roofline_speedup": roof / roof_ar,
                       "compile_s": result.timings.get("compile_s")}
                if "profile_draft_s" in result.timings:
                    t = result.timings
                    rounds = max(t["profile_rounds"], 1)
                    split = {"draft_ms": t["profile_draft_s"] / rounds * 1e3,
                             "verify_ms": t["profile_verify_s"] / rounds * 1e3,
                             "other_ms": t["profile_other_s"] / rounds * 1e3}
                    if dustin is not None:
                        state = _start_state(model, draft, draft_policy, verify_policy, draft_cache, prefilled,
                                             tokens, lengths, capacity, engine, method)
                        sel = selection_timing(draft_policy, verify_policy, dp, state, args.gamma)
                        split["selection_ms"] = sel["median_s"] * 1e3
                        split["verification_ms"] = max(split["verify_ms"] - split["selection_ms"], 0.0)
                        record["selection_timing"] = sel
                        del state
                    record["round_split_ms"] = split
                    row.update(split)
                if batch in trace_batches:
                    def traced():
                        state = _start_state(model, draft, draft_policy, verify_policy, draft_cache, prefilled,
                                             tokens, lengths, capacity, engine, method)
                        jax.block_until_ready(state)
                        holder["rounds"] = int(run_loop(model.params, dp, state, target_config=config,
                                                        draft_policy=draft_policy, verify_policy=verify_policy,
                                                        engine=engine).round)

                    holder: Dict[str, int] = {}
                    trace = trace_or_error(traced, f"[pair-speed] trace {key} {method}")
                    record["trace"] = per_round_trace(trace, holder.get("rounds"))
                    row["launches_per_round"] = record["trace"].get("launches_per_round")
                    row["busy_share"] = record["trace"].get("busy_share")
                if "arbitration" in metrics:  # the measured choice: what it ran
                    row["choice"] = metrics["arbitration"]["choice"]
                record["row"] = row
                entry[method] = record
                entry["ar"] = {"runs": ar_runs}
                writer.add(key, entry)  # resumable per method (still "complete": false)
                case_rows.append(row)
                del result
            if ar_tokens is None:  # every method came from the interrupted run
                ar_tokens, _ = ar_run()
            entry["ar"] = {"runs": ar_runs, "tok_s_mean": float(np.mean([r["tok_s"] for r in ar_runs])),
                           "roofline_tok_s": roof_ar, "step_bytes": target_step, "tokens_row0": ar_tokens[0].tolist()}
            if batch in trace_batches:
                def traced_ar():
                    ar_run()

                entry["ar"]["trace"] = per_round_trace(trace_or_error(traced_ar, f"[pair-speed] trace {key} ar"),
                                                       args.max_new_tokens)
            ar_row = {"context": context, "batch": batch, "method": "ar", "tok_s": entry["ar"]["tok_s_mean"],
                      "speedup": 1.0, "tau": 1.0, "match_ar": 1.0, "roofline_speedup": 1.0}
            entry["rows"] = [ar_row] + case_rows
            entry["complete"] = True
            writer.add(key, entry)
            rows.extend(entry["rows"])
            del prefilled, draft_cache, ar_compiled
    print_table(rows, columns=["context", "batch", "method", "tok_s", "speedup", "tau", "match_ar",
                               "roofline_speedup", "draft_ms", "selection_ms", "verification_ms", "verify_ms",
                               "other_ms", "launches_per_round", "busy_share", "choice", "compile_s"],
                title=f"{args.model} + {args.draft} draft, {args.dtype}, {backend} attention, k={args.budget}, "
                      f"gamma {args.gamma}, {args.max_new_tokens} new tokens, greedy, real acceptance; copy "
                      f"bandwidth {bandwidth / 1e12:.2f} TB/s")
    return writer.data


def measured_choice(args, method: str):
    """A fresh measured-choice controller for one timed run of ``method`` (docs/methods.md §5.2)."""
    table = load_choice_table(args.arbitrate_table, args.model, args.draft) if args.arbitrate_table else None
    return MeasuredChoiceController(probe_rounds=args.arbitrate, remember=False,
                                    tail_check=args.arbitrate_tail or None,
                                    tail_prior_rounds=args.arbitrate_tail_prior, table=table, table_method=method,
                                    table_tail_after=args.arbitrate_table_tail_after or None,
                                    probe_warmup=getattr(args, "arbitrate_warmup", 0),
                                    **({} if args.arbitrate_table_tail_margin is None else
                                       {"table_tail_margin": args.arbitrate_table_tail_margin}))


def _pair(tok_s: float, ar_tok_s: float, metrics: Dict[str, Any]) -> Dict[str, Any]:
    """One timed (AR, method) pair of ``--repeats``; the measured choice's decision where it ran."""
    pair = {"tok_s": tok_s, "paired_ar_tok_s": ar_tok_s, "speedup_vs_ar": tok_s / ar_tok_s}
    if "arbitration" in metrics:
        pair["choice"] = metrics["arbitration"]["choice"]
    return pair


def _draft_inputs(method: str, model, draft, draft_cache):
    """``(draft_params, draft_state)`` for the engine: the separate draft's, or the target's parameters and
    ``None`` for a self method (the target drafts, and its policy builds its own state)."""
    if method in SELF_METHODS:
        return model.params, None
    return draft.params, draft_cache


def _start_state(model, draft, draft_policy, verify_policy, draft_cache, prefilled, tokens, lengths, capacity, engine,
                 method):
    """The loop state of one method's run from copies of the shared prefill (for the selection timing and
    the trace)."""
    from jaxspec.decoding.speculative import prefill_loop_state

    dp, ds = _draft_inputs(method, model, draft, draft_cache)
    return prefill_loop_state(model.params, model.config, tokens, lengths, capacity, draft_policy=draft_policy,
                              draft_params=dp, draft_state=ds,
                              verify_policy=verify_policy, verify_state=None, engine=engine, prefilled=prefilled)


def per_round_trace(trace: Dict[str, Any], rounds) -> Dict[str, Any]:
    """The trace summary plus launches per round and the device-busy share (busy / span and busy /
    host wall time) of its first device plane."""
    if "error" in trace or not trace.get("planes"):
        return trace
    name, plane = next(iter(trace["planes"].items()))
    out = {"plane": name, "wall_s": trace["wall_s"], "busy_s": plane["busy_s"], "span_s": plane["span_s"],
           "launches": plane["launches"], "distinct_kernels": plane["distinct_kernels"],
           "busy_share": plane["busy_s"] / plane["span_s"] if plane["span_s"] else None,
           "busy_share_of_wall": plane["busy_s"] / trace["wall_s"] if trace["wall_s"] else None,
           "top_kernels": plane["top_kernels"][:10], "rounds": rounds}
    if rounds:
        out["launches_per_round"] = plane["launches"] / rounds
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser("pair-speed", help="a real target + draft pair at long context: AR, ClassicSD, "
                                                 "MagicDec, Dustin, StreamingLLM, Quest side by side, real acceptance")
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="target: registry name, .gguf, HF or orbax folder")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model (same tokenizer)")
    p.add_argument("--text-file", default="experiments/prompts/emma_qwen_64k.txt",
                   help="the rows' text (row b: its tokens from b * --row-stride, cut to the context)")
    p.add_argument("--row-stride", type=int, default=2048, help="tokens between the starts of consecutive rows")
    p.add_argument("--contexts", default="8000,16000,32000", help="prompt tokens per row")
    p.add_argument("--batches", default="1,8,16")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated: {', '.join(METHODS)} (AR always runs; default: {', '.join(DEFAULT_METHODS)}; "
                        f"dustin-kv-*: Dustin-H whose draft reads a budget of its cache)")
    p.add_argument("--budget", type=int, default=512, help="k of the sparse methods")
    p.add_argument("--reselect-every", type=int, default=None, metavar="R",
                   help="the Dustin methods select I_verify every R-th round and reuse it in between "
                        "(docs/methods.md §3.8; 1: every round)")
    p.add_argument("--dustin-profile", default="experiments/profiles/qwen2.5-coder-1.5b_qwen2.5-coder-0.5b.json",
                   help="the pair's SRH profile (dustin-profile)")
    p.add_argument("--dustin-mode", default="hybrid", choices=["hybrid", "target", "draft"])
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--keep-finished-rows", action="store_true",
                    help="a batch's finished rows keep reading their whole history while the loop waits for the "
                         "others (default: they read none; docs/methods.md §5.7)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    from jaxspec.config import ATTENTION_BACKENDS

    p.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS))
    p.add_argument("--fused-projections", action="store_true",
                   help="both models' q/k/v and gate/up as one matrix each: three fewer products per layer "
                        "(docs/methods.md §2, fused projections)")
    p.add_argument("--profile-batches", default="", help="batches whose cases also measure the per-round split")
    p.add_argument("--trace-batches", default="", help="batches whose cases also take one profiler trace per method")
    p.add_argument("--backend-check", type=int, default=0, metavar="N",
                   help="check the attention backend's logits against XLA's on N tokens first (0 = off)")
    p.add_argument("--arbitrate", type=int, default=0, metavar="ROUNDS",
                   help="run every method under the measured choice between speculation and plain decoding "
                        "(probe ROUNDS rounds against as many AR steps; docs/methods.md §5.2); 0 = off")
    p.add_argument("--arbitrate-warmup", type=int, default=0, metavar="N",
                   help="with --arbitrate: before each side of the probe run N rounds (plain steps) untimed, their "
                        "tokens kept, so a first call's one-time costs do not decide (docs/methods.md §5.2; default 0)")
    p.add_argument("--arbitrate-tail", type=int, default=0, metavar="ROUNDS",
                   help="with --arbitrate: the tail check every ROUNDS speculative rounds (0 = off); it guards probed "
                        "decisions, and those taken from --arbitrate-table only with --arbitrate-table-tail-after "
                        "(docs/methods.md §5.2)")
    p.add_argument("--arbitrate-tail-prior", type=float, default=None, metavar="M",
                   help="with --arbitrate-tail: each row's tokens per round is pooled toward the batch mean with the "
                        "weight of M rounds (default: as many rounds as observed; 0 = each row's own rate, the rule "
                        "before pooling); docs/methods.md §5.2")
    p.add_argument("--arbitrate-table", default=None, metavar="FILE",
                   help="with --arbitrate: take each method's decision from this choice table (whole-run speed-ups "
                        "measured earlier, `choice-table`) where it holds the case's (context bucket, batch); probe "
                        "only where it does not (docs/methods.md §5.2)")
    p.add_argument("--arbitrate-table-tail-after", type=int, default=0, metavar="N",
                   help="with --arbitrate-table and --arbitrate-tail: tail-check the table's speculative decisions "
                        "too, from their N-th round on, switching when plain decoding finishes at least 10 %% sooner "
                        "(0 = off: a table's decision stands for the run); catches a straggler row the table's run "
                        "did not have (docs/methods.md §5.2)")
    p.add_argument("--arbitrate-table-tail-margin", type=float, default=None, metavar="M",
                   help="with --arbitrate-table-tail-after: switch a table's decision only where plain decoding "
                        "finishes at least this share sooner (default: the controller's, 0.1; 0 = at any gain)")
    p.add_argument("--repeats", type=int, default=None, metavar="N",
                   help="time each method in N (AR, method) pairs, adjacent in time, and report the median pair's "
                        "speed-up (and the median tokens/s of each side); every pair is recorded (default: one pair)")
    p.add_argument("--copy-gib", type=float, default=4.0, help="size of the copy-bandwidth measurement")
    p.add_argument("--compile-threads", type=int, default=0, metavar="N",
                   help="per case, build every method's round loop in N threads at once before the first one runs "
                        "(0: one thread per method; 1: each method compiles when it first runs). Compiling is most "
                        "of a case's time (22-36 s a method at 32k on the H200, under 1.5 s of decoding); "
                        "not part of the results' config")
    p.set_defaults(func=cmd_pair_speed)
