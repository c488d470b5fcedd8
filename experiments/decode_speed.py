"""Decode-speed benchmarks at paper shapes (random weights): ``bench-decode``, ``bench-skip``, ``bench-sd``.

* ``bench-decode``: autoregressive decode throughput against the copy-bandwidth floor (the bytes
  one step must read: weights and every valid K/V entry).
* ``bench-skip``: the dynamic skip mask (``lax.cond`` per sub-layer, no recompile) against static
  masks (one compile each).
* ``bench-sd``: speculative against autoregressive decoding. Caches are filled with random K/V up
  to the context (a prefill of random weights measures nothing useful), and **fixed-acceptance
  mode**: each round accepts a number of draft tokens drawn from the distribution whose mean
  tokens/round is ``--tau`` (taken from a real run, e.g. SmolLM2's self-draft, via ``--tau-from``
  and one ``generate --method sd`` JSON; ``dustin-speed`` also reads ``pair-speed`` JSONs).
  Every row of the output says so. Autoregressive decoding runs in the same process on the same
  cache buffers, so the speed-up is measured side by side.
"""

from __future__ import annotations

import json
import re
import sys
import time
from typing import Any, Dict, Iterable, List, Optional

import numpy as np

from jaxspec.config import ATTENTION_BACKENDS
from experiments.common import ResultWriter, check_skip_ranges, config_of, median_time, print_table


def check_positive(args, names: Iterable[str]) -> None:
    """Each ``--name`` of ``names`` (attribute spelling) must be an integer >= 1."""
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value}: must be >= 1")


def int_list(text: str, flag: str) -> list:
    """``"8192,32768"`` -> ``[8192, 32768]``; each value >= 1."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}={text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag}={text!r}: expected one or more integers >= 1")
    return values


def copy_bandwidth(gib: float = 4.0) -> Dict[str, float]:
    """Device copy bandwidth: ``y = x * 1.0001`` over ``gib`` GiB (bytes read + written / time)."""
    import jax
    import jax.numpy as jnp

    n = int(gib * (1 << 30) / 4)
    x = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.float32)
    scale = jax.jit(lambda v: v * 1.0001)
    timing = median_time(lambda: scale(x).block_until_ready(), repeats=20, warmup=3)
    del x
    return {"bytes": 2 * n * 4, "median_s": timing["median_s"], "bandwidth_Bps": 2 * n * 4 / timing["median_s"]}


def decode_bytes_per_step(config, batch: int, context: int, param_bytes: int, dtype_bytes: int = 2) -> Dict[str, int]:
    """Fewest bytes one decode step must read: all weights but the embedding table (one row per
    sequence), plus every valid K/V entry."""
    embed = config.vocab_size * config.hidden_size * dtype_bytes
    weights = param_bytes - (0 if config.tie_word_embeddings else embed)  # tied: the table is the LM head
    kv = 2 * config.num_layers * batch * config.num_kv_heads * context * config.head_dim * dtype_bytes
    return {"weights": int(weights), "kv": int(kv), "total": int(weights + kv)}


def cmd_bench_decode(args) -> Dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from jaxspec.config import preset
    from jaxspec.decoding.autoregressive import decode_loop
    from jaxspec.decoding.sampling import SamplingConfig
    from jaxspec.models.cache import random_cache
    from jaxspec.models.llama import fuse_projections, init_params, param_bytes

    contexts, batches = int_list(args.contexts, "--contexts"), int_list(args.batches, "--batches")
    layouts = parse_projections(args.projections)
    check_positive(args, ("new_tokens", "repeats"))
    if not args.copy_gib > 0:
        raise ValueError(f"--copy-gib={args.copy_gib}: must be > 0")
    # the default layout stays out of the config, so files written before --projections existed still resume
    writer = ResultWriter(args.out, "bench-decode",
                          config_of(args, exclude=["projections"] if layouts == ["separate"] else []))
    if not writer.has("copy_bandwidth"):
        writer.add("copy_bandwidth", copy_bandwidth(args.copy_gib))
    bandwidth = writer.get("copy_bandwidth")["bandwidth_Bps"]
    config = preset(args.shape, **({"num_layers": args.layers} if args.layers else {}),
                    **({"dtype": args.dtype} if args.dtype else {}))
    separate = init_params(config, jax.random.PRNGKey(0))
    pbytes = param_bytes(separate)
    fused = fuse_projections(separate) if "fused" in layouts else None
    rows = []
    for context in contexts:
        for batch in batches:
            # the layouts back to back on one cache fill, each timed alternately (the ratio is within one run)
            pending = [layout for layout in layouts if not writer.has(_decode_key(args.shape, context, batch, layout))]
            timings, compiled_of, products, compile_of, listing = {}, {}, {}, {}, {}
            cache = random_cache(config, batch, context + args.new_tokens + 64, context, seed=1) if pending else None
            logits = jax.random.normal(jax.random.PRNGKey(2), (batch, config.vocab_size), jnp.float32)
            state = {"cache": cache}
            for layout in pending:
                params = fused if layout == "fused" else separate
                compile_start = time.perf_counter()
                lowered = decode_loop.lower(params, cache, logits, jax.random.PRNGKey(3), config=config,
                                            sampling=SamplingConfig(), max_new_tokens=args.new_tokens, stop_tokens=())
                compiled_of[layout] = lowered.compile()
                compile_of[layout] = time.perf_counter() - compile_start
                products[layout] = matrix_products(compiled_of[layout].as_text())
                listing[layout] = layer_products(compiled_of[layout].as_text())

            def step(layout):
                params = fused if layout == "fused" else separate
                out, new_cache = compiled_of[layout](params, state["cache"], logits, jax.random.PRNGKey(3))
                out.block_until_ready()
                state["cache"] = new_cache.with_lengths(jnp.full((batch,), context, jnp.int32))

            for _ in range(2):  # warm-up of every layout first
                for layout in pending:
                    step(layout)
            samples = {layout: [] for layout in pending}
            for _ in range(args.repeats):  # interleaved: drift of a shared machine hits every layout alike
                for layout in pending:
                    start = time.perf_counter()
                    step(layout)
                    samples[layout].append(time.perf_counter() - start)
            for layout in pending:
                values = sorted(samples[layout])
                timings[layout] = {"median_s": values[len(values) // 2], "min_s": values[0], "max_s": values[-1],
                                   "repeats": args.repeats, "all_s": values}
            for layout in layouts:
                key = _decode_key(args.shape, context, batch, layout)
                if writer.has(key):
                    rows.append(writer.get(key)["row"])
                    continue
                timing = timings[layout]
                per_step = timing["median_s"] / args.new_tokens
                moved = decode_bytes_per_step(config, batch, context + args.new_tokens // 2, pbytes)
                floor = moved["total"] / bandwidth
                row = {"shape": args.shape, "context": context, "batch": batch, "projections": layout,
                       "ms_per_step": per_step * 1e3, "tokens_per_s": batch / per_step,
                       "GB_per_step": moved["total"] / 1e9, "achieved_TBps": moved["total"] / per_step / 1e12,
                       "floor_ms": floor * 1e3, "fraction_of_floor": floor / per_step,
                       "compile_s": compile_of[layout], "matrix_products": products[layout]}
                if layout == "fused" and "separate" in timings:
                    row["step_vs_separate"] = timing["median_s"] / timings["separate"]["median_s"]
                fill = "random K/V, lengths set to context (random weights: prefill not timed)"
                writer.add(key, {"row": row, "timing": timing, "bytes": moved, "new_tokens": args.new_tokens,
                                 "cache_fill": fill, "layer_products": listing[layout]})
                rows.append(row)
            del cache, state, compiled_of
    print_table(rows, title=f"autoregressive decode, {args.shape} (random weights), copy bandwidth "
                            f"{bandwidth / 1e12:.2f} TB/s")
    return writer.data


PROJECTIONS = ("separate", "fused")


def parse_projections(spec: str) -> List[str]:
    """``--projections``: a comma list of ``separate`` (q/k/v and gate/up as separate matrices) and ``fused``
    (:func:`jaxspec.models.params.fuse_projections`)."""
    layouts = [item.strip() for item in str(spec).split(",") if item.strip()]
    bad = [item for item in layouts if item not in PROJECTIONS]
    if not layouts or bad or len(set(layouts)) != len(layouts):
        raise ValueError(f"--projections={spec!r}: give a comma list of distinct layouts from {list(PROJECTIONS)}")
    return layouts


def _decode_key(shape: str, context: int, batch: int, layout: str) -> str:
    return f"{shape}/ctx{context}/b{batch}" + ("" if layout == "separate" else f"/{layout}")


def matrix_products(hlo_text: str) -> int:
    """Matrix products in a compiled program's text: XLA dots (inside fusions included) and the GPU's
    cuBLAS calls. A decode loop's body is compiled once, so this counts one step's products (plus any
    outside the loop), a proxy for its GEMM kernels per step."""
    return len(_product_lines(hlo_text))


def _product_lines(hlo_text: str) -> List[str]:
    """The lines of a compiled program's text that are matrix products: XLA dots and cuBLAS calls."""
    return [line for line in hlo_text.splitlines()
            if re.search(r"\bdot\(", line) or 'custom_call_target="__cublas$gemm"' in line
            or 'custom_call_target="__cublas$lt$matmul"' in line]


def layer_products(hlo_text: str, layer: int = 1) -> List[str]:
    """The matrix products of one decoder layer in a compiled program's text, each as ``"<result shape> <op>"``
    (the op is the einsum or source name in its metadata): which products the compiler merged or split, e.g. the
    GPU's merge of q, k and v into one product in the separate layout (docs/methods.md §2, fused projections)."""
    out = []
    for line in _product_lines(hlo_text):
        name = re.search(r'op_name="([^"]*)"', line)
        if not name or f"/layer{layer}/" not in name.group(1):
            continue
        shape = re.search(r"=\s*(\S+)\s+(?:dot|custom-call)\(", line)
        op = name.group(1).split(f"/layer{layer}/", 1)[1]
        out.append(f"{shape.group(1) if shape else '?'} {op}")
    return out


def cmd_bench_skip(args) -> Dict[str, Any]:
    """Cost of the dynamic skip mask (lax.cond per sub-layer, no recompile) vs static masks (recompile)."""
    import jax
    import jax.numpy as jnp

    from jaxspec.config import preset
    from jaxspec.models.cache import random_cache
    from jaxspec.models.llama import forward, freeze_skip_mask, init_params

    check_positive(args, ("context", "batch", "steps", "repeats"))
    writer = ResultWriter(args.out, "bench-skip", config_of(args))
    key = f"{args.shape}/ctx{args.context}/b{args.batch}/T{args.steps}"
    title = (f"skip-mask variants, one forward of {args.steps} token(s), {args.shape}, context {args.context}, "
             f"batch {args.batch}")
    if writer.has(key):
        print(f"[resume] {args.out} already holds {key}; delete it to measure again", file=sys.stderr)
        print_table(writer.get(key), title=title)
        return writer.data
    config = preset(args.shape, **({"num_layers": args.layers} if args.layers else {}))
    params = init_params(config, jax.random.PRNGKey(0))
    layers = config.num_layers
    cache = random_cache(config, args.batch, args.context + 64, args.context, seed=1)
    tokens = jnp.zeros((args.batch, args.steps), jnp.int32)
    none = np.zeros((layers, 2), bool)
    half_mlp = none.copy()
    half_mlp[1:-1:2, 1] = True
    half_attn = none.copy()
    half_attn[1:-1:2, 0] = True
    masks = {"no_skip": none, "every_other_mlp": half_mlp, "every_other_attention": half_attn}
    dynamic = jax.jit(lambda p, t, c, m: forward(p, t, c, config=config, skip_mask=m).logits)
    plain = jax.jit(lambda p, t, c: forward(p, t, c, config=config).logits)
    rows = []
    start = time.perf_counter()
    plain(params, tokens, cache).block_until_ready()
    rows.append({"variant": "no mask argument", "mask": "-", "compile_s": time.perf_counter() - start,
                 "ms": median_time(lambda: plain(params, tokens, cache).block_until_ready(),
                                   args.repeats)["median_s"] * 1e3})
    for name, mask in masks.items():
        start = time.perf_counter()
        dynamic(params, tokens, cache, jnp.asarray(mask)).block_until_ready()
        first = time.perf_counter() - start
        t = median_time(lambda: dynamic(params, tokens, cache, jnp.asarray(mask)).block_until_ready(), args.repeats)
        rows.append({"variant": "dynamic (lax.cond)", "mask": name, "compile_s": first, "ms": t["median_s"] * 1e3})
        frozen = freeze_skip_mask(mask)
        static = jax.jit(lambda p, t_, c, _m=frozen: forward(p, t_, c, config=config, skip_mask=_m).logits)
        start = time.perf_counter()
        static(params, tokens, cache).block_until_ready()
        first = time.perf_counter() - start
        t = median_time(lambda: static(params, tokens, cache).block_until_ready(), args.repeats)
        rows.append({"variant": "static (recompile)", "mask": name, "compile_s": first, "ms": t["median_s"] * 1e3})
    writer.add(key, rows)
    print_table(rows, title=title)
    return writer.data


def hlo_copies(text: str, min_bytes: int = 1 << 20) -> Dict[str, Any]:
    """Copy instructions of a compiled program's text: how many, and those of at least ``min_bytes`` (shape,
    bytes, the computation they sit in): a copy of a cache buffer inside a decode loop costs its bytes every
    step."""
    import re

    sizes = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}
    total, large, computation = 0, [], ""
    for line in text.splitlines():
        if line and not line[0].isspace():
            computation = line.split(" ", 2)[1 if line.startswith("ENTRY") else 0].lstrip("%")
            continue
        match = re.search(r"= (\w+)\[([\d,]*)\]\S* copy(?:-start)?\(", line)
        if not match:
            continue
        total += 1
        dims = [int(d) for d in match.group(2).split(",") if d]
        nbytes = int(np.prod(dims or [1])) * sizes.get(match.group(1), 4)
        if nbytes >= min_bytes:
            large.append({"shape": f"{match.group(1)}[{match.group(2)}]", "bytes": nbytes, "in": computation})
    return {"copies": total, "large": large}


def cmd_bench_plain(args) -> Dict[str, Any]:
    """The speculative engine's plain stretch (``plain_decode``, what a controller runs when it decides to decode
    plainly) against the AR decode loop (``decode_loop``) on the same cache, each timed at two lengths so the
    per-step cost comes without the per-call cost: step = (T(n2) - T(n1)) / (n2 - n1). Variants: finished rows
    reading their history (``skip_finished_rows=False``), and the loop bound static (``static_bound``)."""
    import pathlib

    import jax
    import jax.numpy as jnp

    from jaxspec.config import preset
    from jaxspec.decoding.autoregressive import decode_loop
    from jaxspec.decoding.sampling import SamplingConfig
    from jaxspec.decoding.speculative import EngineConfig, loop_state_from_caches, plain_decode
    from jaxspec.models.cache import random_cache
    from jaxspec.models.llama import init_params

    check_positive(args, ("context", "new_tokens", "repeats"))
    batches = int_list(args.batches, "--batches")
    if args.new_tokens < 8:
        raise ValueError(f"--new-tokens={args.new_tokens}: must be >= 8 (timed at a quarter of it and at all of it)")
    writer = ResultWriter(args.out, "bench-plain", config_of(args))
    config = preset(args.shape, attention_backend=args.attention_backend,
                    **({"num_layers": args.layers} if args.layers else {}))
    params = init_params(config, jax.random.PRNGKey(0))
    n2 = args.new_tokens
    n1 = n2 // 4
    hlo_dir = pathlib.Path(args.hlo_dir) if args.hlo_dir else None
    for batch in batches:
        key = f"{args.shape}/ctx{args.context}/b{batch}/n{n2}"
        if writer.has(key):
            print(f"[resume] {args.out} already holds {key}", file=sys.stderr)
            continue

        def lengths():  # a fresh buffer each call: the calls donate the cache, its lengths too
            return jnp.full((batch,), args.context, jnp.int32)

        holder = {"cache": random_cache(config, batch, args.context + n2 + 64, args.context, seed=1)}
        logits = jnp.zeros((batch, config.vocab_size), jnp.float32)
        pending = jnp.ones((batch,), jnp.int32)
        engines = {"plain": EngineConfig(gamma=1, max_new_tokens=n2),
                   "plain-keep-finished": EngineConfig(gamma=1, max_new_tokens=n2, skip_finished_rows=False)}

        def ar_call(n):
            def call():
                out, cache = decode_loop(params, holder["cache"].with_lengths(lengths()), logits, jax.random.PRNGKey(0),
                                         config=config, sampling=SamplingConfig(), max_new_tokens=n + 1,
                                         stop_tokens=())
                holder["cache"] = cache
                return out
            return call

        def plain_call(engine, n, static_bound=False):
            def call():
                state = loop_state_from_caches(holder["cache"].with_lengths(lengths()), None, pending, pending, engine)
                state, count = plain_decode(params, state, jnp.int32(n), config=config, engine=engine, steps=n2,
                                            static_bound=static_bound)
                holder["cache"] = state.target_cache
                return count
            return call

        variants = {"ar": ar_call, **{name: (lambda n, e=engine: plain_call(e, n)) for name, engine in engines.items()},
                    "plain-static-bound": lambda n: plain_call(engines["plain"], n, static_bound=True)}
        rows, texts = [], {}
        for name, make in variants.items():
            calls = {n: make(n) for n in (n1, n2)}
            for call in calls.values():
                jax.block_until_ready(call())  # compile and warm up
            samples = {n: [] for n in calls}
            for _ in range(args.repeats):  # the two lengths alternate, so drift hits both alike
                for n, call in calls.items():
                    start = time.perf_counter()
                    jax.block_until_ready(call())
                    samples[n].append(time.perf_counter() - start)
            med = {n: float(np.median(v)) for n, v in samples.items()}
            step = (med[n2] - med[n1]) / (n2 - n1)
            rows.append({"variant": name, "n1": n1, "n2": n2, "call_n1_ms": med[n1] * 1e3, "call_n2_ms": med[n2] * 1e3,
                         "step_ms": step * 1e3, "per_call_ms": (med[n1] - n1 * step) * 1e3,
                         "samples_s": {str(n): v for n, v in samples.items()}})
        ar = rows[0]["step_ms"]
        for row in rows:
            row["step_over_ar"] = row["step_ms"] / ar if ar > 0 else None
        cache = holder["cache"].with_lengths(lengths())
        texts["ar"] = decode_loop.lower(params, cache, logits, jax.random.PRNGKey(0), config=config,
                                        sampling=SamplingConfig(), max_new_tokens=n2 + 1,
                                        stop_tokens=()).compile().as_text()
        for name, engine in engines.items():
            state = loop_state_from_caches(cache, None, pending, pending, engine)
            texts[name] = plain_decode.lower(params, state, jnp.int32(n2), config=config, engine=engine,
                                             steps=n2).compile().as_text()
        state = loop_state_from_caches(cache, None, pending, pending, engines["plain"])
        texts["plain-static-bound"] = plain_decode.lower(params, state, jnp.int32(n2), config=config,
                                                         engine=engines["plain"], steps=n2,
                                                         static_bound=True).compile().as_text()
        for row in rows:
            row["hlo"] = hlo_copies(texts[row["variant"]])
            if hlo_dir is not None:
                hlo_dir.mkdir(parents=True, exist_ok=True)
                (hlo_dir / f"{row['variant']}_b{batch}.hlo.txt").write_text(texts[row["variant"]])
        writer.add(key, rows)
        print_table([{k: v for k, v in r.items() if k not in ("samples_s", "hlo")} | {"copies": r["hlo"]["copies"],
                      "large copies": len(r["hlo"]["large"])} for r in rows],
                    title=f"plain stretch vs AR loop, {args.shape}, context {args.context}, batch {batch}")
    return writer.data


#: the top-level ``acceptance`` record's mode of a fixed-acceptance benchmark
FIXED_ACCEPTANCE_MODE = ("fixed acceptance (systems benchmark, random weights): accepted counts drawn from the "
                         "distribution with this mean tokens/round")


def tau_paths(text: str) -> list:
    """``--tau-from``'s comma-separated paths (one or more)."""
    paths = [p.strip() for p in str(text).split(",") if p.strip()]
    if not paths:
        raise ValueError(f"--tau-from {text!r}: give one or more JSON files")
    return paths


def read_tau_json(path: str) -> Any:
    """One ``--tau-from`` file, parsed (a one-line error when it is missing or not JSON)."""
    try:
        text = open(path).read()
    except OSError as err:
        raise ValueError(f"--tau-from {path}: cannot read it ({err.strerror or err})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--tau-from {path}: not JSON ({err})") from None


def is_pair_speed(data: Any) -> bool:
    """A ``pair-speed`` results file (taus per case and method), not a ``generate`` JSON."""
    return isinstance(data, dict) and data.get("experiment") == "pair-speed"


def one_tau(args, loaded=None) -> Dict[str, Any]:
    """The one tau of ``--tau T`` or of ``--tau-from FILE`` (a ``generate --method sd`` JSON's
    ``results.metrics.tau``). ``loaded``: ``[(path, data)]`` already read. ``pair-speed`` files
    (a tau per point and method) are refused: only ``dustin-speed`` reads them."""
    if args.tau_from:
        loaded = loaded if loaded is not None else [(p, read_tau_json(p)) for p in tau_paths(args.tau_from)]
        pair = [path for path, data in loaded if is_pair_speed(data)]
        if pair:
            raise ValueError(f"--tau-from {pair[0]}: a pair-speed JSON (a tau per point and method); this benchmark "
                             f"takes one tau: --tau T or one `generate --method sd` JSON (dustin-speed reads "
                             f"pair-speed files)")
        if len(loaded) > 1:
            raise ValueError(f"--tau-from {args.tau_from}: several files must all be pair-speed JSONs (dustin-speed); "
                             f"a `generate --method sd` JSON gives one tau alone")
        path, data = loaded[0]
        results = data.get("results", data) if isinstance(data, dict) else None
        tau = (results.get("metrics") or {}).get("tau") if isinstance(results, dict) else None
        if not isinstance(tau, (int, float)):
            raise ValueError(f"--tau-from {path}: no results.metrics.tau; give the JSON of a "
                             f"`generate --method sd` run (or pair-speed JSONs, for dustin-speed)")
        return {"tau": float(tau), "source": path,
                "measured_with": {k: results.get(k) for k in ("model", "draft", "gamma")}}
    if args.tau is None:
        raise ValueError("give --tau T or --tau-from FILE (a generate --method sd JSON)")
    return {"tau": float(args.tau), "source": "--tau"}


def fixed_acceptance_writer(args, experiment: str, acceptance: Optional[Dict[str, Any]] = None):
    """The results file of a fixed-acceptance benchmark: ``(writer, tau record, copy bandwidth B/s)``,
    the acceptance record and the measured copy bandwidth recorded once (kept on resume).
    ``acceptance``: the whole top-level record, already made (with its ``mode``); default: the one
    tau of :func:`one_tau` with :data:`FIXED_ACCEPTANCE_MODE`."""
    tau = one_tau(args) if acceptance is None else acceptance
    writer = ResultWriter(args.out, experiment, config_of(args))
    writer.set("acceptance", {**tau, "mode": FIXED_ACCEPTANCE_MODE} if acceptance is None else acceptance)
    if not writer.has("copy_bandwidth"):
        writer.add("copy_bandwidth", copy_bandwidth(args.copy_gib))
    return writer, tau, writer.get("copy_bandwidth")["bandwidth_Bps"]


def time_rounds(target_params, draft_params, holder, fresh_state, static, repeats: int):
    """Compile (first run) and time a fused speculative loop on benchmark caches.

    ``holder["cache"]`` / ``holder["draft"]`` are the cache buffers (donated by each run and
    replaced by its output); ``fresh_state()`` builds the start state from them. Returns
    ``(timing, compile_s, final_state_of_the_last_run)``.
    """
    import jax

    from jaxspec.decoding.speculative import run_loop

    start = time.perf_counter()
    final = run_loop(target_params, draft_params, fresh_state(), **static)
    jax.block_until_ready(final)
    compile_s = time.perf_counter() - start
    holder["cache"], holder["draft"] = final.target_cache, final.draft_state
    last = {}

    def run():
        result = run_loop(target_params, draft_params, fresh_state(), **static)
        jax.block_until_ready(result)
        holder["cache"], holder["draft"] = result.target_cache, result.draft_state
        last["final"] = result

    timing = median_time(run, repeats=repeats, warmup=1)
    return timing, compile_s, last["final"]


def cmd_bench_sd(args) -> Dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from jaxspec.config import preset
    from jaxspec.decoding.autoregressive import decode_loop
    from jaxspec.decoding.policies import DenseVerify, SelfDraft, SeparateDraft, parse_skip_spec
    from jaxspec.decoding.sampling import SamplingConfig
    from jaxspec.decoding.speculative import (EngineConfig, acceptance_from_tau, loop_state_from_caches,
                                              profile_phases, summarize)
    from jaxspec.models.cache import random_cache
    from jaxspec.models.llama import init_params, param_bytes

    contexts, batches = int_list(args.contexts, "--contexts"), int_list(args.batches, "--batches")
    check_positive(args, ("gamma", "new_tokens", "repeats"))
    if args.draft_skip is not None:
        check_skip_ranges(args.draft_skip, "--draft-skip")
    writer, tau, bandwidth = fixed_acceptance_writer(args, "bench-sd")
    target_config = preset(args.target_shape, attention_backend=args.attention_backend)
    target_params = init_params(target_config, jax.random.PRNGKey(0))
    if args.draft_skip:
        draft_policy = SelfDraft(target_config)
        draft_config, draft_params = target_config, target_params
        mask = parse_skip_spec(args.draft_skip, target_config.num_layers)
    else:
        draft_config = preset(args.draft_shape, attention_backend=args.attention_backend)
        draft_params = init_params(draft_config, jax.random.PRNGKey(1))
        draft_policy = SeparateDraft(draft_config)
    fixed = acceptance_from_tau(tau["tau"], args.gamma)
    engine = EngineConfig(gamma=args.gamma, max_new_tokens=args.new_tokens, fixed_acceptance=fixed)
    static = dict(target_config=target_config, draft_policy=draft_policy, verify_policy=DenseVerify(), engine=engine)
    target_bytes, draft_bytes = param_bytes(target_params), param_bytes(draft_params)
    rows = []
    for context in contexts:
        for batch in batches:
            key = f"ctx{context}/b{batch}"
            if writer.has(key):
                rows.append(writer.get(key)["row"])
                continue
            capacity = -(-(context + args.new_tokens + 2 * args.gamma + 8) // 64) * 64  # Pallas blocks of 64
            target_cache = random_cache(target_config, batch, capacity, context, 2)
            if args.draft_skip:
                draft_state = {"skip_mask": jnp.asarray(mask)}
            else:
                draft_state = random_cache(draft_config, batch, capacity, context - 1, 3)
            pending = jnp.full((batch,), 11, jnp.int32)
            logits = jax.random.normal(jax.random.PRNGKey(4), (batch, target_config.vocab_size), jnp.float32)
            holder = {"cache": target_cache, "draft": draft_state}

            # autoregressive, same cache buffers
            start = time.perf_counter()
            ar = decode_loop.lower(target_params, holder["cache"], logits, jax.random.PRNGKey(5),
                                    config=target_config, sampling=SamplingConfig(), max_new_tokens=args.new_tokens,
                                    stop_tokens=()).compile()
            ar_compile = time.perf_counter() - start

            def run_ar():
                out, cache = ar(target_params, holder["cache"], logits, jax.random.PRNGKey(5))
                out.block_until_ready()
                holder["cache"] = cache.with_lengths(jnp.full((batch,), context, jnp.int32))

            ar_time = median_time(run_ar, repeats=args.repeats, warmup=1)

            def fresh_state():
                cache = holder["cache"].with_lengths(jnp.full((batch,), context, jnp.int32))
                return loop_state_from_caches(cache, holder["draft"], pending, pending, engine, seed=6)

            sd_time, sd_compile, final = time_rounds(target_params, draft_params, holder, fresh_state, static,
                                                     args.repeats)
            metrics = summarize(final, engine)
            generated = int(np.asarray(final.num_out).sum())
            ar_tps = batch * args.new_tokens / ar_time["median_s"]
            sd_tps = generated / sd_time["median_s"]
            # roofline: bytes per round (gamma draft steps + one verification) over measured bandwidth
            target_step = decode_bytes_per_step(target_config, batch, context, target_bytes)
            if args.draft_skip:
                kept = 1.0 - mask.mean()
                draft_step = {"total": int(kept * target_step["total"])}
            else:
                draft_step = decode_bytes_per_step(draft_config, batch, context, draft_bytes)
            round_bytes = args.gamma * draft_step["total"] + target_step["total"]
            roofline_sd = batch * metrics["tau_untruncated"] / (round_bytes / bandwidth)
            roofline_ar = batch / (target_step["total"] / bandwidth)
            row = {"context": context, "batch": batch, "gamma": args.gamma, "tau": metrics["tau"],
                   "ar_tok_s": ar_tps, "sd_tok_s": sd_tps, "speedup": sd_tps / ar_tps,
                   "roofline_ar_tok_s": roofline_ar, "roofline_sd_tok_s": roofline_sd,
                   "roofline_speedup": roofline_sd / roofline_ar}
            entry = {"row": row, "ar_timing": ar_time, "sd_timing": sd_time, "ar_compile_s": ar_compile,
                     "sd_compile_s": sd_compile, "metrics": metrics, "round_bytes": round_bytes,
                     "acceptance": "fixed (see top-level 'acceptance')",
                     "cache_fill": "random K/V up to the context (random weights; no prefill)"}
            if args.profile:
                phases = profile_phases(target_params, draft_params, fresh_state(), **static)
                total = phases["profile_draft_s"] + phases["profile_verify_s"] + phases["profile_other_s"]
                entry["profile"] = phases
                row.update(draft_frac=phases["profile_draft_s"] / total, verify_frac=phases["profile_verify_s"] / total,
                           other_frac=phases["profile_other_s"] / total)
            writer.add(key, entry)
            rows.append(row)
            del holder, target_cache, draft_state, final
    draft_name = f"self-draft skipping {args.draft_skip}" if args.draft_skip else args.draft_shape
    print_table(rows, title=f"{args.target_shape} target, {draft_name} draft, FIXED acceptance tau={tau['tau']:.2f} "
                            f"({tau['source']}); copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    return writer.data


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench-decode", help="autoregressive decode throughput vs the bandwidth floor")
    bench.add_argument("--shape", default="qwen2.5-7b-shape")
    bench.add_argument("--layers", type=int, default=0)
    bench.add_argument("--contexts", default="8192,32768")
    bench.add_argument("--batches", default="16")
    bench.add_argument("--new-tokens", type=int, default=32)
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--copy-gib", type=float, default=4.0)
    bench.add_argument("--projections", default="separate",
                       help="comma list of weight layouts timed alternately in one run: separate (q/k/v and gate/up "
                            "as separate matrices) and fused (one matrix each; docs/methods.md §2, fused projections)")
    bench.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                       help="the shape's dtype (default: the preset's)")
    bench.set_defaults(func=cmd_bench_decode)

    skip = subparsers.add_parser("bench-skip", help="dynamic (no recompile) vs static skip masks: step time, compile")
    skip.add_argument("--shape", default="qwen2.5-7b-shape")
    skip.add_argument("--layers", type=int, default=0)
    skip.add_argument("--context", type=int, default=8192)
    skip.add_argument("--batch", type=int, default=16)
    skip.add_argument("--steps", type=int, default=1, help="tokens per forward (gamma + 1 for verification)")
    skip.add_argument("--repeats", type=int, default=20)
    skip.set_defaults(func=cmd_bench_skip)

    plain = subparsers.add_parser("bench-plain", help="the speculative engine's plain stretch vs the AR decode loop "
                                                      "on the same cache: per-step and per-call time, copies")
    plain.add_argument("--shape", default="qwen2.5-1.5b-shape")
    plain.add_argument("--layers", type=int, default=0)
    plain.add_argument("--context", type=int, default=32000)
    plain.add_argument("--batches", default="1,16")
    plain.add_argument("--new-tokens", type=int, default=256, help="timed at a quarter of it and at all of it")
    plain.add_argument("--repeats", type=int, default=5)
    plain.add_argument("--attention-backend", default="pallas", choices=list(ATTENTION_BACKENDS))
    plain.add_argument("--hlo-dir", default=None, help="also write each compiled program's text here")
    plain.set_defaults(func=cmd_bench_plain)

    bench = subparsers.add_parser("bench-sd", help="speculative vs autoregressive decoding at paper shapes "
                                                   "(random weights, fixed acceptance)")
    bench.add_argument("--target-shape", default="qwen2.5-7b-shape")
    bench.add_argument("--draft-shape", default="qwen2.5-0.5b-shape")
    bench.add_argument("--draft-skip", default=None, help="use a self-draft of the target with this skip spec")
    bench.add_argument("--contexts", default="8192,16384,32768")
    bench.add_argument("--batches", default="8,16")
    bench.add_argument("--gamma", type=int, default=4)
    bench.add_argument("--tau", type=float, default=None, help="mean tokens per round of the fixed acceptance")
    bench.add_argument("--tau-from", default=None, metavar="FILE",
                       help="take tau from a generate --method sd JSON (results.metrics.tau; pair-speed JSONs, a "
                            "tau per point and method, are for dustin-speed)")
    bench.add_argument("--new-tokens", type=int, default=64)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--profile", action="store_true", help="also measure the draft/verify/other split")
    bench.add_argument("--attention-backend", default="xla", choices=list(ATTENTION_BACKENDS),
                       help="history attention of both models")
    bench.add_argument("--copy-gib", type=float, default=4.0)
    bench.set_defaults(func=cmd_bench_sd)
