"""``dustin-speed``: AR, ClassicSD, MagicDec and Dustin side by side at paper shapes.

As ``bench-sd``: random weights, caches filled with random K/V up to the context, and
**fixed-acceptance mode** (accepted counts drawn from the distribution whose mean tokens/round
is a tau measured elsewhere; every row says so), all methods in one process on the same cache
buffers, so the speed-ups are side by side. Dustin's signals and selection run for real every
round (random weights make the selected positions meaningless, not their cost).

Where the tau comes from:

* ``--tau T``, or ``--tau-from FILE`` with one ``generate --method sd`` JSON
  (``results.metrics.tau``): one tau for every point and method.
* ``--tau-from A.json,B.json,...``: one or more ``pair-speed`` JSONs (a real pair, real
  acceptance). Each point (context, batch) and method takes the tau pair-speed measured for that
  method -- classic <- ``sd``, magicdec <- ``magicdec``, dustin <- ``dustin``, the per-round mean
  ``metrics.tau_untruncated`` (what the fixed acceptance draws from; ``metrics.tau`` also counts
  the last rounds cut short by the token limit) -- at the same batch and the nearest measured
  context (ties: the larger context). Refused up front, before any model is built or anything
  timed: files with another gamma than ``--gamma`` (or, when magicdec or dustin run, another
  budget than ``--budget``), files of different pairs (model, draft, dtype), one case in two
  files, a batch no case has, a method no case at that batch measured. ``FILE:sd+magicdec`` reads
  only those methods from FILE (two files that measured the same point and method can then be
  combined, each supplying its own).

Each case records, per method, the tau it ran with and where from (``<method>.fixed_tau``: the
file, the case key, its context and the distance to this point's); the top-level ``acceptance``
says the mode and the sources (with pair-speed files: their pair, gamma, budget and cases, and
the tau of every point and method).

Per point (context, batch): tokens/s of every method and its speed-up vs AR; for Dustin the
selection step timed alone (scores + exact top-k on the round's state) and the self-attention
of one verification dense vs sparse (our Pallas kernels, one layer timed, times the layers);
the roofline tokens/s of every method from the bytes a round must read at the measured copy
bandwidth.

SRHs for random weights: the target's 4 heads are spread over 4 KV groups (the expensive layout;
``--target-heads``), one draft layer with 4 heads (``--draft-layer``, ``--draft-heads``).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from jaxspec.config import ATTENTION_BACKENDS
from experiments.common import check_fused_projections, fused_if_asked, median_time, print_table
from experiments.decode_speed import (FIXED_ACCEPTANCE_MODE, check_positive, decode_bytes_per_step,
                                      fixed_acceptance_writer, int_list, is_pair_speed, one_tau, read_tau_json,
                                      tau_paths, time_rounds)

#: Dustin-H whose draft reads a budget of its cache (docs/methods.md §5.1): method -> DustinConfig.draft_kv
SPARSE_DRAFT_KV = {"dustin-kv-streaming": "streaming", "dustin-kv-verify-set": "verify-set"}
#: Dustin-H with the input-aware m (docs/methods.md §3.7): method -> its DustinConfig changes. The coverage rule
#: deciding every round, every third round with the loop unrolled over each cycle, and every third round through
#: one round body's lax.cond (the default schedule). Under a fixed acceptance they differ only in the round's cost.
M_RULE_METHODS = {"dustin-cov": {"m_rule": "coverage"},
                  "dustin-cov-held3": {"m_rule": "coverage", "m_every": 3, "m_every_schedule": "unrolled"},
                  "dustin-cov-held3-cond": {"m_rule": "coverage", "m_every": 3, "m_every_schedule": "cond"}}
METHODS = ("ar", "classic", "magicdec", "dustin") + tuple(SPARSE_DRAFT_KV) + tuple(M_RULE_METHODS)
DEFAULT_METHODS = METHODS[:4]  # the sparse-draft and m-rule variants are asked for by name
DUSTIN_METHODS = ("dustin",) + tuple(SPARSE_DRAFT_KV) + tuple(M_RULE_METHODS)
#: DustinConfig.scoring_layout's values (jaxspec.dustin.config.SCORING_LAYOUTS; kept here so the CLI imports no JAX)
SCORING_LAYOUTS = ("groups", "heads", "pallas")
#: the pair-speed method whose measured tau each speculative method here runs with
PAIR_SPEED_TAU_OF = {"classic": "sd", "magicdec": "magicdec", "dustin": "dustin",
                     **{m: m for m in SPARSE_DRAFT_KV}, **{m: "dustin" for m in M_RULE_METHODS}}
#: the field of a pair-speed method's ``metrics`` taken as the fixed acceptance's mean tokens/round
PAIR_SPEED_TAU_FIELD = "tau_untruncated"
#: methods whose acceptance depends on the budget k (their pair-speed tau must be at ``--budget``)
BUDGET_METHODS = ("magicdec",) + DUSTIN_METHODS


def _ints(text: str):
    return tuple(int(x) for x in text.split(",") if x.strip())


def _overrides(text: str) -> Dict[str, Any]:
    """``"vocab_size=512,hidden_size=256"`` -> ``{"vocab_size": 512, "hidden_size": 256}`` (ints/floats)."""
    out: Dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--override item {item!r}: expected KEY=VALUE")
        try:
            out[name.strip()] = int(value)
        except ValueError:
            try:
                out[name.strip()] = float(value)
            except ValueError as err:
                raise ValueError(f"--override {name}={value!r}: expected a number") from err
    return out


def init_params_on(config, key, mesh, rules):
    """Random params created directly in their sharded layout (a 72B model never exists whole on
    one device); ``mesh=None``: plain :func:`init_params`."""
    import jax

    from jaxspec.models.llama import init_params
    from jaxspec.models.sharding import check_divisible, param_shardings

    if mesh is None:
        return init_params(config, key)
    check_divisible(config, mesh, rules)
    return jax.jit(lambda k: init_params(config, k), out_shardings=param_shardings(config, mesh, rules))(key)


def allreduce_cost(mesh, rows: int, hidden: int, count: int, iters: int = 10, repeats: int = 5) -> Dict[str, Any]:
    """Seconds of ``count`` sequential all-reduces of a ``[rows, hidden]`` bf16 activation over the
    mesh's tensor axis (what one forward's row-parallel matmuls need: 2 per layer)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from experiments.kernels import loop_time

    tensor = dict(mesh.shape).get("tensor", 1)
    if tensor == 1:
        return {"tensor": 1, "seconds": 0.0, "count": count}

    def chain(x):
        def body(x):
            for _ in range(count):
                x = jax.lax.psum(x, "tensor") * (1.0 / tensor)
            return x

        return jax.shard_map(body, mesh=mesh, in_specs=P(None, None), out_specs=P(None, None), check_vma=False)(x)

    x = jnp.ones((rows, hidden), jnp.bfloat16)
    timing = loop_time(lambda x_: chain(x_), (x,), iters, repeats)
    return {"tensor": tensor, "rows": rows, "hidden": hidden, "count": count, "seconds": timing["median_s"],
            "bytes_each": rows * hidden * 2}


def tau_source_specs(text: str) -> List[Tuple[str, Optional[Tuple[str, ...]]]]:
    """``--tau-from``'s entries as ``(path, pair-speed methods to read or None for all)``: an entry
    ``FILE:sd+magicdec`` reads only those methods' taus from FILE (so two files that both measured
    one point and method can be combined, each supplying its own methods)."""
    valid = sorted(set(PAIR_SPEED_TAU_OF.values()))
    out = []
    for entry in tau_paths(text):
        path, only = entry, None
        head, sep, tail = entry.rpartition(":")
        if sep and head and tail and not tail.endswith(".json"):
            names = tuple(m.strip() for m in tail.split("+") if m.strip())
            bad = [m for m in names if m not in valid]
            if bad or not names:
                raise ValueError(f"--tau-from {entry}: unknown pair-speed method(s) {bad or [tail]} after ':'; "
                                 f"valid: {', '.join(valid)} (joined by '+')")
            path, only = head, names
        out.append((path, only))
    return out


def pair_speed_cases(loaded, *, gamma: int, budget: int, methods, only=None) -> List[Dict[str, Any]]:
    """The measured cases of the pair-speed files ``loaded`` (``[(path, data)]``), checked against
    ``--gamma`` / ``--budget`` (the budget only when one of ``methods`` depends on it) and each
    other (one pair, each (point, method) needed by ``methods`` in one file): ``[{"file", "case",
    "context", "batch", "taus": {pair-speed method: {"tau", "tau_truncated"}}}]``. ``only``: per
    path, the pair-speed methods to read from it (:func:`tau_source_specs`; absent = all)."""
    pair_of, seen, cases = None, {}, []
    needed = sorted({PAIR_SPEED_TAU_OF[m] for m in methods if m in PAIR_SPEED_TAU_OF})
    only = only or {}
    for path, data in loaded:
        wanted = [m for m in needed if only.get(path) is None or m in only[path]]
        if not is_pair_speed(data):
            kind = data.get("experiment") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"--tau-from {path}: not a pair-speed JSON ({kind!r}); with pair-speed files every "
                             f"file must be one (a generate JSON gives one tau alone)")
        config = data.get("config") or {}
        if config.get("gamma") != gamma:
            raise ValueError(f"--tau-from {path}: measured with gamma {config.get('gamma')}, not --gamma {gamma} "
                             f"(its taus are means over 1..gamma + 1 tokens a round); pass --gamma "
                             f"{config.get('gamma')} or files measured at gamma {gamma}")
        if any(m in BUDGET_METHODS for m in methods) and config.get("budget") != budget:
            raise ValueError(f"--tau-from {path}: measured with budget {config.get('budget')}, not --budget {budget} "
                             f"(the acceptance of {', '.join(m for m in methods if m in BUDGET_METHODS)} depends "
                             f"on it)")
        pair = {k: config.get(k) for k in ("model", "draft", "dtype")}
        if pair_of is None:
            pair_of = (path, pair)
        elif pair != pair_of[1]:
            raise ValueError(f"--tau-from {path}: measured {pair}, but {pair_of[0]} measured {pair_of[1]}; pass the "
                             f"files of one pair")
        for key, case in (data.get("cases") or {}).items():
            if not isinstance(case, dict) or not isinstance(case.get("context"), int) \
                    or not isinstance(case.get("batch"), int):
                continue  # copy_bandwidth, backend_check
            point = (case["context"], case["batch"])
            taus = {}
            for method in wanted:
                record = case.get(method)
                metrics = record.get("metrics") if isinstance(record, dict) else None
                tau = metrics.get(PAIR_SPEED_TAU_FIELD) if isinstance(metrics, dict) else None
                if not isinstance(tau, (int, float)):
                    continue  # not measured in this case
                if not 1.0 <= tau <= gamma + 1:
                    raise ValueError(f"--tau-from {path}: {key} {method} metrics.{PAIR_SPEED_TAU_FIELD}={tau} lies "
                                     f"outside [1, gamma + 1 = {gamma + 1}]")
                if (point, method) in seen:  # one point may come from several files, each method from one
                    raise ValueError(f"--tau-from {path}: case {key} {method} is also in {seen[point, method]}; "
                                     f"pass one of them")
                seen[point, method] = path
                taus[method] = {"tau": float(tau), "tau_truncated": metrics.get("tau")}
            cases.append({"file": path, "case": key, "context": case["context"], "batch": case["batch"],
                          "taus": taus})
    return cases


def nearest_case(cases, context: int, batch: int, method: str):
    """The case of ``cases`` (:func:`pair_speed_cases`) at ``batch`` that measured ``method`` with
    the context nearest ``context``, ties to the larger context; None when there is none."""
    here = [c for c in cases if c["batch"] == batch and method in c["taus"]]
    return min(here, key=lambda c: (abs(c["context"] - context), -c["context"]), default=None)


def acceptance_plan(args, contexts, batches, methods) -> Dict[str, Any]:
    """The fixed acceptance of every point and speculative method, decided (and every source
    checked) before any model is built: ``{"record": the top-level acceptance record, "points":
    {"ctx{C}/b{B}": {method: {"tau", ...where from}}}, "title": the table title's part,
    "pair_speed": bool}``."""
    from jaxspec.decoding.speculative import acceptance_from_tau

    speculative = [m for m in methods if m != "ar"]
    specs = tau_source_specs(args.tau_from) if args.tau_from else []
    loaded = [(p, read_tau_json(p)) for p, _ in specs] or None
    only = {p: names for p, names in specs if names is not None}
    if only and not all(is_pair_speed(data) for _, data in loaded):
        raise ValueError(f"--tau-from {args.tau_from}: FILE:METHODS selects methods of pair-speed files only")
    if not loaded or not any(is_pair_speed(data) for _, data in loaded):  # one tau for everything
        tau = one_tau(args, loaded)
        acceptance_from_tau(tau["tau"], args.gamma)  # in [1, gamma + 1]
        source = {"tau": tau["tau"], "source": tau["source"]}
        if loaded:
            source["field"] = "results.metrics.tau"
        points = {f"ctx{c}/b{b}": {m: dict(source) for m in speculative} for c in contexts for b in batches}
        return {"record": {**tau, "mode": FIXED_ACCEPTANCE_MODE}, "points": points, "pair_speed": False,
                "title": f"FIXED acceptance tau={tau['tau']:.2f} ({tau['source']})"}
    cases = pair_speed_cases(loaded, gamma=args.gamma, budget=args.budget, methods=speculative, only=only)
    paths = ",".join(path for path, _ in loaded)
    points: Dict[str, Dict[str, Any]] = {}
    for context in contexts:
        for batch in batches:
            here = {}
            for method in speculative:
                source = PAIR_SPEED_TAU_OF[method]
                case = nearest_case(cases, context, batch, source)
                if case is None:
                    measured_batches = sorted({c["batch"] for c in cases})
                    if batch not in measured_batches:
                        raise ValueError(f"--tau-from {paths}: no case at batch {batch} (measured batches: "
                                         f"{', '.join(map(str, measured_batches)) or 'none'}); run pair-speed "
                                         f"--batches {batch} or drop it from --batches")
                    raise ValueError(f"--tau-from {paths}: no case at batch {batch} measured {source} (the tau of "
                                     f"{method}); run pair-speed with --methods {source} or drop {method} from "
                                     f"--methods")
                measured = case["taus"][source]
                here[method] = {"tau": measured["tau"], "file": case["file"], "case": case["case"],
                                "context": case["context"], "context_distance": abs(case["context"] - context),
                                "method": source, "field": f"metrics.{PAIR_SPEED_TAU_FIELD}",
                                "tau_truncated": measured["tau_truncated"]}
            points[f"ctx{context}/b{batch}"] = here
    files = []
    for path, data in loaded:
        config = data.get("config") or {}
        files.append({"path": path, **{k: config.get(k) for k in ("model", "draft", "gamma", "budget", "dtype")},
                      "cases": sorted(c["case"] for c in cases if c["file"] == path),
                      **({"methods_read": list(only[path])} if path in only else {})})
    record = {"mode": "fixed acceptance (systems benchmark, random weights): accepted counts drawn, per point and "
                      "method, from the distribution with the mean tokens/round pair-speed measured for that method "
                      f"(metrics.{PAIR_SPEED_TAU_FIELD}) at the same batch and the nearest measured context (ties: "
                      "the larger); each case's <method>.fixed_tau says which",
              "source": "pair-speed", "files": files, "method_from": {m: PAIR_SPEED_TAU_OF[m] for m in speculative},
              "points": {key: {m: {k: r[k] for k in ("tau", "file", "case", "context_distance")}
                               for m, r in here.items()} for key, here in points.items()}}
    return {"record": record, "points": points, "pair_speed": True,
            "title": f"FIXED acceptance, tau per point and method as pair-speed measured it ({paths}; columns "
                     f"fixed_tau, tau_case)"}


def cmd_dustin_speed(args) -> Dict[str, Any]:
    import jax

    from jaxspec.config import preset
    from jaxspec.dustin.config import DustinConfig, check_budget
    from jaxspec.models.cache import random_cache
    from jaxspec.models.llama import param_bytes
    from jaxspec.models.sharding import RULES, check_cache_divisible, parse_mesh, use_mesh

    methods = tuple(m for m in args.methods.split(",") if m)
    unknown = [m for m in methods if m not in METHODS]
    if unknown or "ar" not in methods:
        raise ValueError(f"--methods {args.methods!r}: choose from {','.join(METHODS)} (ar is required: the "
                         f"speed-ups are against it)")
    budget = check_budget(args.budget)
    if args.reselect_every is not None and args.reselect_every < 1:
        raise ValueError(f"--reselect-every={args.reselect_every} must be >= 1 (1: select every round)")
    contexts, batches = int_list(args.contexts, "--contexts"), int_list(args.batches, "--batches")
    check_positive(args, ("gamma", "new_tokens", "repeats"))
    check_fused_projections(args)
    if args.compile_threads < 0:
        raise ValueError(f"--compile-threads={args.compile_threads}: >= 0 (0: one per method, 1: no precompiling)")
    plan = acceptance_plan(args, contexts, batches, methods)  # every tau source checked before anything runs
    writer, _, bandwidth = fixed_acceptance_writer(args, "dustin-speed", acceptance=plan["record"])
    backend = args.attention_backend
    overrides = _overrides(args.override)
    if args.layers:
        overrides["num_layers"] = args.layers
    target_config = preset(args.target_shape, attention_backend=backend, **overrides)
    draft_config = preset(args.draft_shape, attention_backend=backend, **overrides)
    mesh = parse_mesh(args.mesh) if getattr(args, "mesh", None) else None
    # target: tensor parallel; draft: replicated over the tensor axis (a 0.5B draft's 2 KV heads do
    # not split 4 or 8 ways), batch rows over data like the target
    draft_rules = dataclasses.replace(RULES, q_heads=None, kv_heads=None, mlp=None, vocab=None)
    target_params = init_params_on(target_config, jax.random.PRNGKey(0), mesh, RULES)
    draft_params = init_params_on(draft_config, jax.random.PRNGKey(1), mesh, draft_rules)
    # every method and AR on the fused layout with --fused-projections (docs/methods.md §2, fused projections)
    target_params, draft_params = fused_if_asked(args, target_params, draft_params)
    if mesh is not None:
        from jaxspec.parallel.sharding import mesh_shape

        writer.set("mesh", {"shape": mesh_shape(mesh), "devices": [str(d) for d in mesh.devices.flat],
                            "draft": "replicated over tensor, rows over data"})
    target_heads = _ints(args.target_heads) or tuple(
        g * target_config.queries_per_kv for g in range(min(4, target_config.num_kv_heads)))
    draft_layer = args.draft_layer if args.draft_layer >= 0 else draft_config.num_layers // 2
    dustin = DustinConfig(budget=budget, target_layer=target_config.num_layers // 2, target_heads=target_heads,
                          draft_layers=(draft_layer,), draft_heads=(_ints(args.draft_heads),), mode="hybrid",
                          reselect_every=args.reselect_every or 1,
                          scoring_layout=args.scoring_layout)
    writer.set("dustin_config", dustin.to_dict())
    target_bytes, draft_bytes = param_bytes(target_params), param_bytes(draft_params)
    scale = 1.0 / np.sqrt(target_config.head_dim)
    rows = []
    for context in contexts:
        for batch in batches:
            key = f"ctx{context}/b{batch}"
            taus = plan["points"][key]
            if writer.has(key):
                rows.extend(writer.get(key)["rows"])
                continue
            if budget >= context:
                raise ValueError(f"--budget {budget} must be smaller than the context {context}")
            capacity = -(-(context + args.new_tokens + 2 * args.gamma + 8) // 64) * 64
            kv_sharding = draft_kv_sharding = None
            if mesh is not None:
                from jaxspec.models.cache import CACHE_KV_AXES

                check_cache_divisible(batch, target_config.num_kv_heads, mesh, RULES)
                kv_sharding = RULES.sharding(mesh, CACHE_KV_AXES)
                draft_kv_sharding = draft_rules.sharding(mesh, CACHE_KV_AXES)
            with use_mesh(mesh):
                holder = {"cache": random_cache(target_config, batch, capacity, context, 2, sharding=kv_sharding),
                          "draft": random_cache(draft_config, batch, capacity, context - 1, 3,
                                                sharding=draft_kv_sharding)}
                entry, rows_here = _measure_point(**locals())
            writer.add(key, entry)
            rows.extend(rows_here)
            del holder
    print_table(rows, columns=["context", "batch", "method", "tok_s", "speedup", "tau", "fixed_tau"]
                + (["tau_case"] if plan["pair_speed"] else [])
                + ["roofline_tok_s", "roofline_speedup", "selection_ms", "attn_dense_ms", "attn_sparse_ms",
                   "attn_speedup", "allreduce_ms_per_step"],
                title=f"{args.target_shape} target + {args.draft_shape} draft, k={budget}, {plan['title']}; copy "
                      f"bandwidth {bandwidth / 1e12:.2f} TB/s" + (f"; mesh {dict(mesh.shape)}" if mesh is not None
                                                                 else ""))
    return writer.data


def method_round_bytes(method: str, *, target_config, draft_config, batch: int, context: int, budget: int,
                       gamma: int, target_bytes: int, draft_bytes: int, dustin=None, sinks: int = 4,
                       quest_page: int = 16, quest_dense_layers: int = 2, dtype_bytes: int = 2,
                       split: bool = False):
    """Fewest bytes one speculative round of ``method`` must read (weights once per forward, every
    K/V entry attended, bfloat16): ``gamma`` draft forwards plus one verification forward.

    ``classic`` / ``sd``: draft and target over the whole context; ``magicdec``: the draft over
    ``budget`` positions; ``dustin``: the target over ``budget`` plus the keys of the SRH KV groups
    (target and first draft SRH layer) over the context for the selection; ``dustin-kv-streaming`` /
    ``dustin-kv-verify-set``: the same, with the draft over ``budget`` (``budget`` + the verifier's
    draft window for verify-set: ``I_verify`` and the newest positions may overlap, the bound is
    upper); ``streaming``: the target over ``budget``; ``quest``: the first ``quest_dense_layers``
    target layers dense, the others over ``budget`` plus each page's min and max key
    (docs/methods.md §3). ``dtype_bytes``: bytes per cached K/V element (2 for bfloat16, 4 for float32).
    ``split=True``: the same bytes by round phase instead, ``{"draft", "verification"[, "selection"]}`` (the
    phases of a device trace's split, ``jaxspec.decoding.speculative.ROUND_PHASES``), summing to the total."""
    if method in DUSTIN_METHODS and dustin is None:
        raise ValueError(f"method_round_bytes({method!r}) needs the DustinConfig (its SRH heads)")
    draft_ctx = context
    if method == "magicdec":
        draft_ctx = budget
    elif SPARSE_DRAFT_KV.get(method) == "streaming":  # sinks + a window: k positions
        draft_ctx = min(context, budget)
    elif SPARSE_DRAFT_KV.get(method) == "verify-set":  # the last I_verify + a window
        draft_ctx = min(context, budget + dustin.draft_window_size)

    def step(config, n, params):
        return decode_bytes_per_step(config, batch, n, params, dtype_bytes)

    def out(**parts):
        parts = {name: int(value) for name, value in parts.items()}
        return parts if split else sum(parts.values())

    draft_round = gamma * step(draft_config, draft_ctx, draft_bytes)["total"]
    if method in ("classic", "sd", "magicdec"):
        return out(draft=draft_round, verification=step(target_config, context, target_bytes)["total"])
    sparse = step(target_config, budget, target_bytes)
    if method == "streaming":
        return out(draft=draft_round, verification=sparse["total"])
    if method in DUSTIN_METHODS:  # the selection scores the SRH layers' full history once per round
        groups_t = {h // target_config.queries_per_kv for h in dustin.target_heads}
        groups_d = {h // draft_config.queries_per_kv for h in dustin.draft_heads[0]} if dustin.draft_heads else set()
        if dustin.scoring_layout == "heads":  # one product over every KV head of the layer (docs/methods.md §3.1)
            groups_t = set(range(target_config.num_kv_heads)) if groups_t else set()
            groups_d = set(range(draft_config.num_kv_heads)) if groups_d else set()
        selection = dtype_bytes * batch * context * (len(groups_t) * target_config.head_dim
                                                     + len(groups_d) * draft_config.head_dim)
        return out(draft=draft_round, verification=sparse["total"], selection=selection)
    if method == "quest":
        layers = target_config.num_layers
        dense = min(quest_dense_layers, layers)
        per_layer = lambda n: 2 * batch * target_config.num_kv_heads * n * target_config.head_dim * dtype_bytes  # noqa: E731
        pages = -(-context // quest_page)
        kv = dense * per_layer(context) + (layers - dense) * (per_layer(budget) + per_layer(pages))
        return out(draft=draft_round, verification=sparse["weights"] + kv)
    raise ValueError(f"method_round_bytes: unknown method {method!r}; valid: classic, sd, magicdec, "
                     f"{', '.join(DUSTIN_METHODS)}, streaming, quest")


def selection_timing(draft_policy, verify_policy, draft_params, state, gamma: int, repeats: int = 10):
    """Dustin's selection step alone (scores + exact top-k, ``verify_policy.verify_indices``) on the
    signals of one draft proposal from ``state`` (a loop state): ``median_time``'s record."""
    import jax

    from jaxspec.decoding.sampling import SamplingConfig

    committed = state.committed
    feedback = verify_policy.draft_feedback(state.verify_state)  # a verify-set draft reads the last I_verify
    signals = draft_policy.propose(draft_params, state.draft_state, state.target_cache, state.pending,
                                   state.previous, committed, gamma=gamma, sampling=SamplingConfig(),
                                   key=jax.random.PRNGKey(8),
                                   **({} if feedback is None else {"feedback": feedback})).signals
    select = jax.jit(lambda vs, cache, c, sig: verify_policy.verify_indices(vs, cache, c, sig))
    indices = jax.block_until_ready(select(state.verify_state, state.target_cache, committed, signals))
    out = median_time(lambda: jax.block_until_ready(select(state.verify_state, state.target_cache, committed,
                                                           signals)), repeats=repeats, warmup=2)
    if getattr(verify_policy, "holds_m", False) and not verify_policy.reuses_selection:  # §3.7: a cycle's rounds, each
        import jax.numpy as jnp  # as the loop runs it (its kind compiled in, or read by the lax.cond)

        kinds = []
        for j in range(verify_policy.dustin.m_every):
            policy = verify_policy.at_phase(j)
            hold = dict(state.verify_state["m_hold"], since=jnp.asarray(j, jnp.int32))
            vs = dict(state.verify_state, m_hold=hold)
            kind = select if policy is verify_policy else jax.jit(  # the conditional's one program, compiled once
                lambda v, cache, c, sig, p=policy: p.verify_indices(v, cache, c, sig))
            jax.block_until_ready(kind(vs, state.target_cache, committed, signals))
            kinds.append(median_time(lambda k=kind, v=vs: jax.block_until_ready(k(v, state.target_cache, committed,
                                                                                  signals)),
                                     repeats=repeats, warmup=2))
        out["held_rounds"] = kinds  # round 0 decides, the others hold
        out["per_round_s"] = float(np.mean([k["median_s"] for k in kinds]))
    if getattr(verify_policy, "reuses_selection", False):  # docs/methods.md §3.8: a reuse round's own set
        from jaxspec.dustin.selection import reuse_verify_indices

        cfg, lengths = verify_policy.dustin, (committed - 1).astype("int32")
        reuse = jax.jit(lambda i, n: reuse_verify_indices(i, n, n, sinks=cfg.sinks, window=cfg.window_size))
        jax.block_until_ready(reuse(indices, lengths))
        out["reuse"] = median_time(lambda: jax.block_until_ready(reuse(indices, lengths)), repeats=repeats, warmup=2)
        every = cfg.reselect_every
        out["per_round_s"] = (out["median_s"] + (every - 1) * out["reuse"]["median_s"]) / every
    return out


def _measure_point(*, args, context, batch, holder, target_config, draft_config, target_params, draft_params,
                   dustin, taus, methods, bandwidth, budget, target_bytes, draft_bytes, scale, mesh, **_):
    """One point: ``taus`` maps each speculative method to its fixed tau and its source
    (:func:`acceptance_plan`)."""
    import jax
    import jax.numpy as jnp

    from experiments.kernels import loop_time
    from experiments.trace import trace_or_error
    from jaxspec.baselines.magicdec import MagicDecDraft
    from jaxspec.decoding.autoregressive import decode_loop
    from jaxspec.decoding.policies import DenseVerify, SeparateDraft
    from jaxspec.decoding.sampling import SamplingConfig
    from jaxspec.decoding.speculative import (EngineConfig, acceptance_from_tau, compile_loops,
                                              loop_state_from_caches, profile_phases, summarize)
    from jaxspec.dustin.policy import dustin_policies
    from jaxspec.models.attention import backend_of
    from pallas_kernels.attention import merged_history, pack_queries
    from pallas_kernels.reference import merge_partials

    pending = jnp.full((batch,), 11, jnp.int32)
    entry: Dict[str, Any] = {"acceptance": "fixed (see top-level 'acceptance'; each method's tau and its source "
                                           "under its 'fixed_tau')",
                             "cache_fill": "random K/V up to the context (random weights; no prefill)"}
    # ---- AR
    logits = jax.random.normal(jax.random.PRNGKey(4), (batch, target_config.vocab_size), jnp.float32)
    ar = decode_loop.lower(target_params, holder["cache"], logits, jax.random.PRNGKey(5),
                            config=target_config, sampling=SamplingConfig(), max_new_tokens=args.new_tokens,
                            stop_tokens=()).compile()

    def run_ar():
        out, cache = ar(target_params, holder["cache"], logits, jax.random.PRNGKey(5))
        out.block_until_ready()
        holder["cache"] = cache.with_lengths(jnp.full((batch,), context, jnp.int32))

    timing = median_time(run_ar, repeats=args.repeats, warmup=1)
    ar_tps = batch * args.new_tokens / timing["median_s"]
    entry["ar"] = {"timing": timing, "tok_s": ar_tps}
    if getattr(args, "trace", False):
        entry["ar"]["trace"] = trace_or_error(run_ar, f"[dustin-speed] trace ctx{context}/b{batch} ar")
    target_step = decode_bytes_per_step(target_config, batch, context, target_bytes)
    roof_ar = batch / (target_step["total"] / bandwidth)
    rows_here = [{"context": context, "batch": batch, "method": "ar", "tok_s": ar_tps, "speedup": 1.0,
                  "tau": 1.0, "roofline_tok_s": roof_ar, "roofline_speedup": 1.0}]

    def method_setup(method):
        verify_state = None
        fixed_tau = taus[method]
        engine = EngineConfig(gamma=args.gamma, max_new_tokens=args.new_tokens,
                              fixed_acceptance=acceptance_from_tau(fixed_tau["tau"], args.gamma),
                              skip_finished_rows=not args.keep_finished_rows)
        if method == "classic":
            draft_policy, verify_policy = SeparateDraft(draft_config), DenseVerify()
        elif method == "magicdec":  # draft reads a StreamingLLM view of the same budget
            draft_policy = MagicDecDraft(draft_config, sinks=dustin.sinks, window=budget - dustin.sinks)
            verify_policy = DenseVerify()
        else:
            cfg = dustin.replace(draft_kv=SPARSE_DRAFT_KV[method]) if method in SPARSE_DRAFT_KV else dustin
            cfg = cfg.replace(**M_RULE_METHODS.get(method, {}))
            draft_policy, verify_policy = dustin_policies(cfg, target_config, draft_config)
            verify_state = {"query": 0.1 * jax.random.normal(
                jax.random.PRNGKey(7), (batch, len(verify_policy.probe_heads), target_config.head_dim))}
            if verify_policy.reuses_selection:  # docs/methods.md §3.8
                verify_state["reuse"] = verify_policy.initial_reuse_state(batch)
            if verify_policy.holds_m:  # docs/methods.md §3.7: each row's m between the rule's decisions
                verify_state["m_hold"] = verify_policy.initial_hold_state(batch)
            if verify_policy.shares_verify_set:  # the first round's draft reads the prompt's StreamingLLM set
                from jaxspec.dustin.policy import draft_history_indices

                verify_state["indices"] = draft_history_indices(
                    "streaming", jnp.full((batch,), context - 1, jnp.int32), sinks=cfg.sinks,
                    window=cfg.budget - cfg.sinks)
        static = dict(target_config=target_config, draft_policy=draft_policy, verify_policy=verify_policy,
                      engine=engine)
        return fixed_tau, engine, draft_policy, verify_policy, verify_state, static

    def fresh_state_for(engine, verify_state):
        def fresh_state():
            cache = holder["cache"].with_lengths(jnp.full((batch,), context, jnp.int32))
            vs = None if verify_state is None else jax.tree.map(jnp.copy, verify_state)
            return loop_state_from_caches(cache, holder["draft"], pending, pending, engine, seed=6,
                                          verify_state=vs)
        return fresh_state

    # ---- speculative methods: their loops compiled at once (threads), then each timed in turn
    setups = {method: method_setup(method) for method in methods if method != "ar"}
    if getattr(args, "compile_threads", 1) != 1 and len(setups) > 1 and mesh is None:
        runs = ((fresh_state_for(engine, verify_state)(), static)
                for _, engine, _, _, verify_state, static in setups.values())
        entry["precompile"] = compile_loops(target_params, draft_params, runs,
                                            threads=args.compile_threads or None) | {"methods": list(setups)}
    for method in methods:
        if method == "ar":
            continue
        fixed_tau, engine, draft_policy, verify_policy, verify_state, static = setups[method]
        fresh_state = fresh_state_for(engine, verify_state)
        bytes_args = dict(target_config=target_config, draft_config=draft_config, batch=batch, context=context,
                          budget=budget, gamma=args.gamma, target_bytes=target_bytes, draft_bytes=draft_bytes,
                          dustin=verify_policy.dustin if method in DUSTIN_METHODS else dustin)
        round_bytes = method_round_bytes(method, **bytes_args)
        phase_bytes = method_round_bytes(method, split=True, **bytes_args)
        timing, compile_s, final = time_rounds(target_params, draft_params, holder, fresh_state, static, args.repeats)
        metrics = summarize(final, engine)
        tps = float(np.asarray(final.num_out).sum()) / timing["median_s"]
        trace = None
        if getattr(args, "trace", False):
            phase_args = round_phase_args(target_params, draft_params, fresh_state, static)
            compiled = phase_args.pop("compiled", None)

            def run_once():
                from jaxspec.decoding.speculative import run_loop

                if compiled is not None:  # the executable whose text the phase split reads
                    result = compiled(target_params, draft_params, fresh_state(), None)
                else:
                    result = run_loop(target_params, draft_params, fresh_state(), **static)
                jax.block_until_ready(result)
                holder["cache"], holder["draft"] = result.target_cache, result.draft_state

            if compiled is not None:  # its first call sets up its command buffers: not part of the traced run
                run_once()
            trace = trace_or_error(run_once, f"[dustin-speed] trace ctx{context}/b{batch} {method}", **phase_args)
        roof = batch * metrics["tau_untruncated"] / (round_bytes / bandwidth)
        entry[method] = {"timing": timing, "compile_s": compile_s, "metrics": metrics, "tok_s": tps,
                         "round_bytes": round_bytes, "phase_bytes": phase_bytes, "fixed_tau": fixed_tau}
        if trace is not None:
            entry[method]["trace"] = trace
        row = {"context": context, "batch": batch, "method": method, "tok_s": tps, "speedup": tps / ar_tps,
               "tau": metrics["tau"], "fixed_tau": fixed_tau["tau"], "roofline_tok_s": roof,
               "roofline_speedup": roof / roof_ar}
        if "case" in fixed_tau:
            row["tau_case"] = fixed_tau["case"]
        if method in DUSTIN_METHODS:  # the selection step alone, on this point's state
            sel = selection_timing(draft_policy, verify_policy, draft_params, fresh_state(), args.gamma,
                                   repeats=max(args.repeats, 10))
            entry[method]["selection_timing"] = sel
            row["selection_ms"] = sel["median_s"] * 1e3  # one selection from the signals
            if "per_round_s" in sel:  # the mean per round, reusing or holding rounds included
                if verify_policy.reuses_selection:
                    row["reselect_every"] = verify_policy.dustin.reselect_every
                if verify_policy.holds_m:
                    row["m_every"] = verify_policy.dustin.m_every
                    row["m_every_schedule"] = verify_policy.dustin.m_every_schedule
                row["selection_ms_per_round"] = sel["per_round_s"] * 1e3
        if args.profile:  # per-round split from per-phase jitted calls (one host sync per phase)
            phases, after = profile_phases(target_params, draft_params, fresh_state(), **static, return_state=True)
            holder["cache"], holder["draft"] = after.target_cache, after.draft_state  # the phases donate them
            rounds = max(phases["profile_rounds"], 1)
            entry[method]["profile"] = phases
            row.update(draft_ms=phases["profile_draft_s"] / rounds * 1e3,
                       verify_ms=phases["profile_verify_s"] / rounds * 1e3,
                       other_ms=phases["profile_other_s"] / rounds * 1e3)
            if "selection_ms" in row:  # the verify phase runs the selection first; split it out
                row["verification_ms"] = max(row["verify_ms"] - row["selection_ms"], 0.0)
            del after
        rows_here.append(row)
        del final
    # ---- self-attention of one verification: dense vs sparse (one layer, times the layers)
    attention = backend_of(target_config)
    if attention.opaque_kernel:  # the Pallas kernels
        groups = target_config.queries_per_kv
        q = jax.random.normal(jax.random.PRNGKey(9), (batch, args.gamma + 1, target_config.num_heads,
                                                      target_config.head_dim), jnp.bfloat16)
        packed = pack_queries(q, target_config.num_kv_heads, scale)
        used = groups * (args.gamma + 1)
        k_layer, v_layer = holder["cache"].keys[0], holder["cache"].values[0]
        lengths = jnp.full((batch,), context, jnp.int32)
        idx = jnp.sort(jax.random.permutation(jax.random.PRNGKey(10), context)[:budget]).astype(jnp.int32)
        idx = jnp.broadcast_to(idx, (batch, budget))
        # per device under a mesh (shard_map over batch rows and KV heads), as in the model
        dense_t = loop_time(lambda q_, k_, v_, l_: merged_history(attention.dense_history_partials(q_, k_, v_, l_),
                                                                  used),
                            (packed, k_layer, v_layer, lengths), 10, 5)["median_s"]
        sparse_t = loop_time(lambda q_, k_, v_, i_: merge_partials(attention.sparse_history_partials(q_, k_, v_, i_),
                                                                   axis=2),
                             (packed, k_layer, v_layer, idx), 10, 5)["median_s"]
        null_t = loop_time(lambda q_, k_, v_, l_: q_[:, :, :1, :1], (packed, k_layer, v_layer, lengths),
                           10, 5)["median_s"]
        entry["attention"] = {"dense_layer_s": dense_t, "sparse_layer_s": sparse_t, "harness_s": null_t,
                              "layers": target_config.num_layers}
        for row in rows_here:
            if row["method"] in ("dustin", "ar"):
                row["attn_dense_ms"] = dense_t * target_config.num_layers * 1e3
                row["attn_sparse_ms"] = sparse_t * target_config.num_layers * 1e3
                row["attn_speedup"] = dense_t / sparse_t
    if mesh is not None:  # the all-reduces of one AR step and of one verification (2 per layer)
        hidden = target_config.hidden_size
        count = 2 * target_config.num_layers
        ar_cost = allreduce_cost(mesh, batch, hidden, count)
        verify_cost = allreduce_cost(mesh, batch * (args.gamma + 1), hidden, count)
        entry["allreduce"] = {"ar_step": ar_cost, "verification": verify_cost}
        rows_here[0]["allreduce_ms_per_step"] = ar_cost["seconds"] * 1e3
        for row in rows_here[1:]:
            row["allreduce_ms_per_step"] = verify_cost["seconds"] * 1e3
    entry["rows"] = rows_here
    return entry, rows_here


def round_phase_args(target_params, draft_params, fresh_state, static) -> Dict[str, Any]:
    """``trace_or_error`` arguments that split the traced loop's device time by round phase: the loop's compiled
    text and the phases' scope names, plus ``compiled``, the executable that text describes, for the traced run to
    call. The compile is one of its own, past the persistent compilation cache and the executable already loaded:
    that cache's key leaves the ops' metadata out, so an executable cached from code before the scopes existed would
    carry none of them. The traced run calls this executable and not the timed one, because two compiles of one
    program need not name their kernels alike (a GPU compile autotunes its matrix products afresh)."""
    import jax

    from jaxspec.decoding.speculative import ROUND_PHASES, loop_jit

    cached = jax.config.jax_enable_compilation_cache
    try:
        jax.config.update("jax_enable_compilation_cache", False)
        lowered = loop_jit.lower(target_params, draft_params, fresh_state(), None, **static)
        # an option of its own keeps this compile from reusing an executable loaded from that cache earlier
        compiled = lowered.compile(compiler_options={"xla_embed_ir_in_executable": True})
        text = compiled.as_text()
    except Exception as error:  # the split is an addition to the trace: without it the trace still stands
        print(f"[dustin-speed] no per-phase split: {error!r}", file=sys.stderr, flush=True)
        return {}
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
    return {"hlo_text": text, "phases": ROUND_PHASES, "compiled": compiled}


def register(subparsers) -> None:
    bench = subparsers.add_parser("dustin-speed", help="AR / ClassicSD / MagicDec / Dustin speed at paper shapes "
                                                       "(random weights, fixed acceptance; H200)")
    bench.add_argument("--target-shape", default="qwen2.5-7b-shape")
    bench.add_argument("--draft-shape", default="qwen2.5-0.5b-shape")
    bench.add_argument("--contexts", default="32768,16384,8192")
    bench.add_argument("--batches", default="16,8")
    bench.add_argument("--budget", type=int, default=512)
    bench.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                       help=f"comma-separated, ar required: {', '.join(METHODS)} (default {', '.join(DEFAULT_METHODS)}; "
                            f"dustin-kv-*: Dustin-H whose draft reads a budget of its cache)")
    bench.add_argument("--gamma", type=int, default=4)
    bench.add_argument("--keep-finished-rows", action="store_true",
                       help="a batch's finished rows keep reading their whole history while the loop waits for "
                            "the others (default: they read none; docs/methods.md §5.7)")
    bench.add_argument("--reselect-every", type=int, default=None, metavar="R",
                       help="the Dustin methods select I_verify every R-th round and reuse it in between "
                            "(docs/methods.md §3.8; 1: every round)")
    bench.add_argument("--tau", type=float, default=None,
                       help="mean tokens per round of the fixed acceptance, for every point and method")
    bench.add_argument("--tau-from", default=None, metavar="FILE[,FILE...]",
                       help="take tau from one generate --method sd JSON (results.metrics.tau, for every point and "
                            "method) or from one or more comma-separated pair-speed JSONs: each point and method "
                            "takes the tau pair-speed measured for that method (classic <- sd, magicdec <- "
                            "magicdec, dustin <- dustin; metrics.tau_untruncated) at the same batch and the nearest "
                            "measured context (ties: the larger); their gamma must be --gamma (and their budget "
                            "--budget when magicdec or dustin run)")
    bench.add_argument("--target-heads", default="", help="target SRH query heads (default: one per KV group, 4)")
    bench.add_argument("--draft-layer", type=int, default=-1, help="draft SRH layer (default: the middle one)")
    bench.add_argument("--draft-heads", default="0,1,2,3")
    bench.add_argument("--new-tokens", type=int, default=64)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--compile-threads", type=int, default=0, metavar="N",
                       help="per point, compile every method's round loop in N threads at once before the first is "
                            "timed (0: one per method; 1: each compiles when first run); not part of the config")
    bench.add_argument("--attention-backend", default="pallas", choices=list(ATTENTION_BACKENDS))
    bench.add_argument("--copy-gib", type=float, default=4.0)
    bench.add_argument("--profile", action="store_true",
                       help="also split a round into draft / selection / verification / other (per-phase jitted "
                            "calls with a host sync each, so their sum exceeds the fused loop's round)")
    bench.add_argument("--scoring-layout", default="groups", choices=SCORING_LAYOUTS,
                       help="how Dustin's SRH scoring reads a layer's keys (DustinConfig.scoring_layout, docs/methods.md "
                            "§3.1): one product per used KV group on its slice (groups, the default), one product "
                            "over all KV heads with the probe rows packed per head (heads: no slice of the cache), or "
                            "the Pallas logits kernel reading each used KV head in place (pallas)")
    bench.add_argument("--trace", action="store_true",
                       help="after the timed runs, trace one run per method with jax.profiler and store the device "
                            "busy time, idle share and top kernels (experiments/trace.py)")
    bench.add_argument("--layers", type=int, default=0, help="override both models' layer count (smoke tests)")
    bench.add_argument("--override", default="", metavar="KEY=VAL,...",
                       help="override config fields of both shapes (smoke tests), e.g. vocab_size=512,hidden_size=256")
    bench.add_argument("--fused-projections", action="store_true",
                       help="both models' q/k/v and gate/up as one matrix each: three fewer products per layer "
                            "(docs/methods.md §2, fused projections; one device)")
    bench.set_defaults(func=cmd_dustin_speed)
    cmd_dustin_speed.supports_mesh = True
