"""One plan's stages, timed alone: ``bench-plan`` (:func:`cmd_bench_plan`, a two-stage plan's stages on one
cache, the finalists rescored both ways) and ``reprice-tpt`` (:func:`cmd_reprice_tpt`, a TPT-correlation run's
candidates priced again). Their flags are added with the ``knapspec`` experiment's (``experiment.register``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Any, Dict, List, Tuple

import numpy as np

from experiments.common import ResultWriter, config_of, print_table
from experiments.knapspec.flags import check_dp_attention
from experiments.knapspec.measure import pearson
from experiments.knapspec.model import load


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


#: the key of the DP traced once per layer (``--dp-unrolled``) among the segment counts
UNROLLED = "unrolled"


def dp_stage(segments) -> str:
    """bench-plan's name of the DP stage timed with ``segments`` runs (``dp`` for one scan of every slot;
    ``dp_unrolled`` for :data:`UNROLLED`, the DP traced once per layer)."""
    if segments == UNROLLED:
        return "dp_unrolled"
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
    # --dp-unrolled is named only when set: files written before it existed resume as they were
    writer = ResultWriter(args.out, "bench-plan", config_of(args, exclude=() if args.dp_unrolled else ("dp_unrolled",)))
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

        def dp_fn(segments, layers="scan"):
            return lambda: dp.knapsack_dp(params, config, cache, prefix, states[:, :, :s], mask[:, :s], w_attn=w_attn,
                                          w_mlp=w_mlp, exit_threshold=args.exit_threshold, history_backend=backend,
                                          segments=segments, layers=layers)

        dps = {count: dp_fn(count) for count in segment_counts}
        if args.dp_unrolled:
            dps[UNROLLED] = dp_fn(1, "unrolled")
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
                  # the DP's candidates with each segment count (and unrolled, where timed) against the first's: the
                  # same masks, values within
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
