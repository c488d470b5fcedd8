"""Attention kernel benchmark: ``bench-attention`` (run on the H200).

For each layer shape, context, batch and budget, in one process: our dense Pallas kernel, XLA
dense (the jnp reference), cuDNN dense (``jax.nn.dot_product_attention(implementation=
"cudnn")`` on its own [B, S, H, D] layout), our sparse Pallas kernel, XLA gather + dense, and the
selection step (SRH scoring of 4 heads in XLA and in a Pallas kernel + exact radix top-k
variants, next to ``lax.top_k``). Every variant is first checked against the jnp reference on
the same random inputs. Our sparse kernel is timed in every listed tiling (``--sparse-configs``)
and reported as the fastest of them, all tilings kept in the JSON.

Timing: each variant runs ``--iters`` times inside one jitted ``fori_loop`` whose iterations
depend on the previous output (so nothing is hoisted), after a warm-up; the per-call time is
the median over ``--repeats`` such loops; the loop is unrolled (straight-line, as the model's
layers run) unless stated. Bytes moved are the fewest the variant must read
(K and V rows it attends to, once), reported against the copy bandwidth measured in the run.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List

import numpy as np

from experiments.common import ResultWriter, config_of, print_table
from experiments.decode_speed import copy_bandwidth

SHAPES = {"qwen2.5-7b": (28, 4, 128), "qwen2.5-72b": (64, 8, 128)}  # (q heads, kv heads, head_dim)
LAYERS = {"qwen2.5-7b": 28, "qwen2.5-72b": 80}


def loop_time(fn: Callable, args, iters: int, repeats: int, unroll: bool = True) -> Dict[str, float]:
    """Median seconds per call of ``fn(*args)`` (first arg perturbed each iteration by the last output).

    ``unroll=True`` (the default) unrolls the ``iters`` calls into one straight-line program, as
    the model's unrolled layers run them: a rolled GPU while loop reads its predicate on the host
    every iteration, which adds microseconds that only the small (sparse) kernels would feel."""
    import jax
    import jax.numpy as jnp

    def run(*a):
        def body(_, carry):
            q, acc = carry
            out = fn(q, *a[1:])
            leaf = jax.tree.leaves(out)[0]
            acc = acc + jnp.sum(leaf.reshape(-1)[:8].astype(jnp.float32))
            q = q * (1 + 1e-30 * acc).astype(q.dtype)
            return q, acc

        return jax.lax.fori_loop(0, iters, body, (a[0], jnp.float32(0)), unroll=unroll)[1]

    compiled = jax.jit(run)
    compiled(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        compiled(*args).block_until_ready()
        times.append((time.perf_counter() - start) / iters)
    times.sort()
    return {"median_s": times[len(times) // 2], "min_s": times[0], "max_s": times[-1], "iters": iters,
            "repeats": repeats, "unrolled": unroll}


def _parse_configs(text: str, width: int, types=None):
    """``"64x1x4,32x2x4"`` -> ``[(64, 1, 4), (32, 2, 4)]`` (``width`` fields each)."""
    types = types or (int,) * width
    out = []
    for item in text.split(","):
        fields = item.strip().split("x")
        if len(fields) != width:
            raise ValueError(f"config {item!r} in {text!r}: expected {width} fields joined by 'x'")
        try:
            out.append(tuple(t(f) for t, f in zip(types, fields)))
        except ValueError as err:
            raise ValueError(f"config {item!r} in {text!r}: {err}") from err
    return out


def cmd_bench_attention(args) -> Dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention import dense_history_partials, merged_history, sparse_history_partials
    from pallas_kernels.reference import (dense_history_reference, merge_partials, normalize,
                                          sparse_history_reference)
    from jaxspec.dustin.selection import select_top_k
    from jaxspec.dustin.signals import srh_scores
    from pallas_kernels.selection import srh_scores_pallas
    from pallas_kernels.tpu_attention import tpu_dense_history_partials, tpu_sparse_history_partials
    from pallas_kernels.tpu_selection import tpu_srh_scores

    writer = ResultWriter(args.out, "bench-attention", config_of(args))
    if not writer.has("copy_bandwidth"):
        writer.add("copy_bandwidth", copy_bandwidth(args.copy_gib))
    bandwidth = writer.get("copy_bandwidth")["bandwidth_Bps"]
    interpret = jax.default_backend() != "gpu"
    tpu = jax.default_backend() == "tpu"  # "ours" are then the Mosaic TPU kernels, compiled (docs/tpu.md)
    rows_out = []
    steps = args.gamma + 1
    for shape in args.shapes.split(","):
        q_heads, kv_heads, dim = SHAPES[shape]
        groups = q_heads // kv_heads
        used = groups * steps
        packed_rows = max(16, 1 << (used - 1).bit_length())
        for context in [int(c) for c in args.contexts.split(",")]:
            for batch in [int(b) for b in args.batches.split(",")]:
                key = f"{shape}/ctx{context}/b{batch}"
                if writer.has(key):
                    rows_out.extend(writer.get(key)["rows"])
                    continue
                keys = jax.random.split(jax.random.PRNGKey(context + batch), 4)
                seq = context
                q = (0.1 * jax.random.normal(keys[0], (batch, kv_heads, packed_rows, dim))).astype(jnp.bfloat16)
                k = jax.random.normal(keys[1], (batch, kv_heads, seq, dim), jnp.bfloat16)
                v = jax.random.normal(keys[2], (batch, kv_heads, seq, dim), jnp.bfloat16)
                lengths = jnp.full((batch,), context, jnp.int32)
                reference = normalize(dense_history_reference(q, k, v, lengths))
                kv_bytes = 2 * batch * kv_heads * context * dim * 2

                def ours_dense(q_, k_, v_, len_):
                    if tpu:
                        return merged_history(tpu_dense_history_partials(q_, k_, v_, len_), packed_rows)
                    return merged_history(dense_history_partials(q_, k_, v_, len_, interpret=interpret),
                                          packed_rows)

                def xla_dense(q_, k_, v_, len_):
                    return dense_history_reference(q_, k_, v_, len_)

                results = {}
                errors = {}
                for name, fn in (("ours_dense", ours_dense), ("xla_dense", xla_dense)):
                    out = normalize(fn(q, k, v, lengths))
                    errors[name] = float(jnp.linalg.norm((out - reference).astype(jnp.float32))
                                         / jnp.linalg.norm(reference.astype(jnp.float32)))
                    results[name] = loop_time(fn, (q, k, v, lengths), args.iters, args.repeats)
                if not interpret:  # cuDNN on its own layout: [B, T, Hq, D] queries, [B, S, Hkv, D] keys/values
                    try:
                        qc = jax.random.normal(keys[3], (batch, steps, q_heads, dim), jnp.bfloat16)
                        kc = k.transpose(0, 2, 1, 3)
                        vc = v.transpose(0, 2, 1, 3)
                        kv_len = jnp.full((batch,), context, jnp.int32)

                        def cudnn_dense(q_, k_, v_, len_):
                            return jax.nn.dot_product_attention(q_, k_, v_, key_value_seq_lengths=len_,
                                                                implementation="cudnn")

                        results["cudnn_dense"] = loop_time(cudnn_dense, (qc, kc, vc, kv_len), args.iters,
                                                           args.repeats)
                        del kc, vc
                    except Exception as err:  # report, never hide
                        results["cudnn_dense"] = {"error": f"{type(err).__name__}: {err}"[:300]}
                dense_times = {n: r["median_s"] for n, r in results.items() if "median_s" in r}
                fastest_name = min(dense_times, key=dense_times.get)
                fastest = dense_times[fastest_name]
                case_rows = []
                for name, timing in results.items():
                    if "median_s" not in timing:
                        continue
                    case_rows.append({"shape": shape, "context": context, "batch": batch, "variant": name, "k": "-",
                                      "us": timing["median_s"] * 1e6, "GB": kv_bytes / 1e9,
                                      "TBps": kv_bytes / timing["median_s"] / 1e12,
                                      "of_copy_bw": kv_bytes / timing["median_s"] / bandwidth,
                                      "rel_err": errors.get(name, float("nan")), "speedup_vs_fastest_dense": "-"})
                # selection, part 1 (independent of k): SRH scoring of 4 heads, 1 query row (the target
                # signal), in 4 KV groups (the general case) and all in one group (a layout restriction)
                srh_q = 0.1 * jax.random.normal(keys[3], (batch, 4, 1, dim), jnp.float32)
                verify_dense = LAYERS[shape] * fastest
                scoring_best = None
                for layout, srh_groups in (("4groups", (0, 1, 2, 3)), ("1group", (0, 0, 0, 0))):
                    srh_groups = tuple(g % kv_heads for g in srh_groups)
                    srh_bytes = batch * len(set(srh_groups)) * context * dim * 2
                    ref_scores = srh_scores(srh_q, k, lengths, srh_groups)
                    variants = [("xla", lambda sq, k_, len_, g=srh_groups: srh_scores(sq, k_, len_, g))]
                    for block, warps in _parse_configs(args.scoring_configs, 2):
                        if tpu:  # the Mosaic kernel has no warps: one variant per block size
                            variants.append((f"pallas_tpu_b{block}", lambda sq, k_, len_, g=srh_groups, block=block:
                                             tpu_srh_scores(sq, k_, len_, g, block_s=block)))
                            continue
                        variants.append((f"pallas_b{block}_w{warps}",
                                         lambda sq, k_, len_, g=srh_groups, block=block, warps=warps: srh_scores_pallas(
                                             sq, k_, len_, g, block_s=block, num_warps=warps, interpret=interpret)))
                    timings = {}
                    for impl, fn in variants:
                        out = fn(srh_q, k, lengths)
                        err = float(jnp.linalg.norm(out - ref_scores) / jnp.linalg.norm(ref_scores))
                        timings[impl] = (loop_time(fn, (srh_q, k, lengths), args.iters, args.repeats)["median_s"], err)
                    best = min(timings, key=lambda n: timings[n][0])
                    for impl, (seconds, err) in timings.items():
                        case_rows.append({"shape": shape, "context": context, "batch": batch,
                                          "variant": f"scoring_{layout}_{impl}", "k": "-", "us": seconds * 1e6,
                                          "GB": srh_bytes / 1e9, "TBps": srh_bytes / seconds / 1e12,
                                          "of_copy_bw": srh_bytes / seconds / bandwidth, "rel_err": err,
                                          "speedup_vs_fastest_dense": "-",
                                          "fraction_of_dense_verification": seconds / verify_dense,
                                          "best_of_layout": impl == best})
                    if layout == "4groups":
                        scoring_best = timings[best][0]
                        scores_fixed = srh_scores(srh_q, k, lengths, srh_groups)
                    else:
                        scoring_best_1group = timings[best][0]
                for budget in [int(b) for b in args.budgets.split(",")]:
                    if budget >= context:
                        continue
                    idx = jnp.sort(jax.random.permutation(jax.random.PRNGKey(budget), context)[:budget])
                    idx = jnp.broadcast_to(idx.astype(jnp.int32), (batch, budget))
                    sparse_ref = normalize(sparse_history_reference(q, k, v, idx))
                    sparse_bytes = 2 * batch * kv_heads * budget * dim * 2
                    # ours: every listed tiling (chunk x chunks per program x warps) is checked and timed;
                    # "ours_sparse" is the fastest of them (all are kept in the JSON)
                    tilings = {}
                    for chunk, per_program, warps in _parse_configs(args.sparse_configs, 3):
                        if budget % (chunk * per_program):
                            continue

                        def ours_sparse(q_, k_, v_, idx_, chunk=chunk, per_program=per_program, warps=warps):
                            if tpu:  # chunk rows per DMA batch, chunks per program; warps do not apply
                                return merge_partials(tpu_sparse_history_partials(
                                    q_, k_, v_, idx_, chunk=chunk, chunks_per_program=per_program), axis=2)
                            return merge_partials(sparse_history_partials(
                                q_, k_, v_, idx_, chunk=chunk, chunks_per_program=per_program, num_warps=warps,
                                interpret=interpret), axis=2)

                        out = normalize(ours_sparse(q, k, v, idx))
                        err = float(jnp.linalg.norm((out - sparse_ref).astype(jnp.float32))
                                    / jnp.linalg.norm(sparse_ref.astype(jnp.float32)))
                        tilings[f"c{chunk}_p{per_program}_w{warps}"] = (
                            loop_time(ours_sparse, (q, k, v, idx), args.iters, args.repeats)["median_s"], err)
                    best_tiling = min(tilings, key=lambda n: tilings[n][0])
                    out = normalize(sparse_history_reference(q, k, v, idx))
                    xla_time = loop_time(sparse_history_reference, (q, k, v, idx), args.iters, args.repeats)["median_s"]
                    for name, (seconds, err), extra in (
                            ("ours_sparse", tilings[best_tiling], {"tiling": best_tiling,
                                                                   "tilings_us": {n: t * 1e6 for n, (t, _) in
                                                                                  tilings.items()}}),
                            ("xla_gather_dense", (xla_time, 0.0), {})):
                        case_rows.append({"shape": shape, "context": context, "batch": batch, "variant": name,
                                          "k": budget, "us": seconds * 1e6, "GB": sparse_bytes / 1e9,
                                          "TBps": sparse_bytes / seconds / 1e12,
                                          "of_copy_bw": sparse_bytes / seconds / bandwidth, "rel_err": err,
                                          "speedup_vs_fastest_dense": fastest / seconds, **extra})
                    # selection, part 2: exact top-k (radix variants, all equal to lax.top_k's set) vs lax.top_k
                    reference_set = select_top_k(scores_fixed, lengths, k=budget, sinks=4, window=64)
                    topk = {}
                    for bits, hist in _parse_configs(args.topk_configs, 2, types=(int, str)):
                        def radix(scores, len_, bits=bits, hist=hist):
                            return select_top_k(scores, len_, k=budget, sinks=4, window=64, bits=bits,
                                                histogram=hist).astype(jnp.float32)

                        same = bool(jnp.all(radix(scores_fixed, lengths) == reference_set))
                        topk[f"radix{bits}_{hist}"] = (
                            loop_time(radix, (scores_fixed, lengths), args.iters, args.repeats)["median_s"], same)

                    def lax_top(scores, len_):
                        return jax.lax.top_k(scores, budget)[1].astype(jnp.float32)

                    topk["lax_top_k"] = (loop_time(lax_top, (scores_fixed, lengths), args.iters,
                                                   args.repeats)["median_s"], None)
                    exact = {n: t for n, (t, same) in topk.items() if same}
                    best_topk = min(exact, key=exact.get) if exact else None
                    for name, (seconds, same) in topk.items():
                        case_rows.append({"shape": shape, "context": context, "batch": batch,
                                          "variant": f"topk_{name}", "k": budget, "us": seconds * 1e6,
                                          "GB": batch * context * 4 / 1e9, "TBps": batch * context * 4 / seconds / 1e12,
                                          "of_copy_bw": batch * context * 4 / seconds / bandwidth,
                                          "rel_err": float("nan"), "speedup_vs_fastest_dense": "-",
                                          "same_set_as_reference": same,
                                          "fraction_of_dense_verification": seconds / verify_dense})
                    if best_topk is not None:
                        for layout, scoring_time in (("4groups", scoring_best), ("1group", scoring_best_1group)):
                            total = scoring_time + exact[best_topk]
                            case_rows.append({"shape": shape, "context": context, "batch": batch,
                                              "variant": f"selection_{layout}", "k": budget, "us": total * 1e6,
                                              "GB": float("nan"), "TBps": float("nan"), "of_copy_bw": float("nan"),
                                              "rel_err": float("nan"), "speedup_vs_fastest_dense": "-",
                                              "top_k": best_topk,
                                              "fraction_of_dense_verification": total / verify_dense})
                writer.add(key, {"rows": case_rows, "fastest_dense": fastest_name, "errors": errors})
                rows_out.extend(case_rows)
                del q, k, v
    print_table(rows_out, columns=["shape", "context", "batch", "variant", "k", "us", "TBps", "of_copy_bw",
                                   "rel_err", "speedup_vs_fastest_dense", "fraction_of_dense_verification"],
                title=f"attention, one layer, gamma + 1 = {steps} query rows; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    return writer.data


#: how attention-device-time runs a model's layers in its one program
LAYER_LOOPS = ("scan", "unrolled")
#: the Pallas kernels' names start with this (``pallas_kernels/attention.py``)
OWN_KERNEL_PREFIX = "jaxspec_"


def kernel_breakdown(planes, layers: int, top: int = 12) -> Dict[str, Any]:
    """One traced run's device time kernel by kernel, per layer: the ``top`` kernels by time
    (name, microseconds and launches per layer) and the time in jaxspec's own Pallas kernels (names
    starting ``jaxspec_``) apart from everything else the program launches (XLA's slices, merges,
    gathers and the loop's own per-layer work)."""
    totals: Dict[str, List[float]] = {}
    for plane in planes:
        for k in plane["top_kernels"]:
            entry = totals.setdefault(k["name"], [0.0, 0])
            entry[0] += k["total_s"]
            entry[1] += k["count"]
    own = sum(t for name, (t, _) in totals.items() if name.startswith(OWN_KERNEL_PREFIX))
    everything = sum(p["kernel_time_s"] for p in planes)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kernels": [{"name": name, "us_per_layer": t / layers * 1e6, "launches_per_layer": n / layers}
                        for name, (t, n) in ranked],
            "own_kernels_us_per_layer": own / layers * 1e6,
            "other_kernels_us_per_layer": (everything - own) / layers * 1e6}


def cmd_attention_device_time(args) -> Dict[str, Any]:
    """Dense against sparse attention of all of a model's layers, by device kernel time from the profiler.

    The paper states its attention speed-up as kernel time. The harness of ``bench-attention`` times
    one layer's call inside a loop on the host clock, and its fixed cost per call (18 µs measured
    alone at 7B / 32k / b16) is most of a sparse call, so it understates the sparse kernel. Here one
    jitted program runs the attention of ``layers`` layers (the shape's own count; a rolled loop, so
    its host time also holds the loop's per-layer overhead), each with its own
    query rows and, for the sparse variants, its own index set (distinct positions, so one layer's
    gathered rows are not another's cache hits), over one [B, Hkv, S, D] K/V pair (each dense layer
    reads all of it, far beyond the L2). ``--layer-loop unrolled`` calls the layers one after another in
    the program instead (as the model's own forward does), each layer's queries and index set a buffer
    of its own and each output its own result, so no per-layer slice or stacked write runs beside the
    attention; each call compiles separately, so give it few variants. Per variant: the device time of
    every kernel the program launches (the profiler's device planes, merges and slices included;
    median of ``--repeats`` traced runs), the host time of the same program, kernel launches, and the layer-0 output's error
    against the jnp reference. ``speedup_device``: the fastest dense variant's device time over the
    fastest sparse tiling's."""
    import jax
    import jax.numpy as jnp

    from experiments.trace import trace_on_backend
    from pallas_kernels.attention import dense_history_partials, merged_history, sparse_history_partials
    from pallas_kernels.reference import (dense_history_reference, merge_partials, normalize,
                                          sparse_history_reference)

    tilings = _parse_configs(args.sparse_configs, 3)
    if args.layer_loop not in LAYER_LOOPS:
        raise ValueError(f"--layer-loop {args.layer_loop!r}: one of {', '.join(LAYER_LOOPS)}")
    if args.repeats < 1 or args.layers < 0:
        raise ValueError(f"--repeats {args.repeats} / --layers {args.layers}: repeats >= 1, layers >= 0 "
                         f"(0: the shape's own count)")
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        raise ValueError(f"--shapes: unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    for budget in [int(b) for b in args.budgets.split(",")]:
        if not any(budget % (chunk * per_program) == 0 for chunk, per_program, _ in tilings):
            raise ValueError(f"--budgets {budget}: no --sparse-configs tiling divides it ({args.sparse_configs}: "
                             f"k must be a multiple of CHUNK x CHUNKS_PER_PROGRAM)")
    writer = ResultWriter(args.out, "attention-device-time", config_of(args))
    if not writer.has("copy_bandwidth"):
        writer.add("copy_bandwidth", copy_bandwidth(args.copy_gib))
    bandwidth = writer.get("copy_bandwidth")["bandwidth_Bps"]
    interpret = jax.default_backend() != "gpu"
    steps = args.gamma + 1
    rows_out = []
    for shape in args.shapes.split(","):
        q_heads, kv_heads, dim = SHAPES[shape]
        layers = args.layers or LAYERS[shape]
        packed_rows = max(16, 1 << (q_heads // kv_heads * steps - 1).bit_length())
        for context in [int(c) for c in args.contexts.split(",")]:
            for batch in [int(b) for b in args.batches.split(",")]:
                for budget in [int(b) for b in args.budgets.split(",")]:
                    key = f"{shape}/ctx{context}/b{batch}/k{budget}"
                    if writer.has(key):
                        rows_out.extend(writer.get(key)["rows"])
                        continue
                    if budget >= context:
                        raise ValueError(f"--budgets {budget} is not below the context {context}")
                    keys = jax.random.split(jax.random.PRNGKey(context + batch + budget), 5)
                    q = (0.1 * jax.random.normal(keys[0], (layers, batch, kv_heads, packed_rows, dim))).astype(
                        jnp.bfloat16)
                    k = jax.random.normal(keys[1], (batch, kv_heads, context, dim), jnp.bfloat16)
                    v = jax.random.normal(keys[2], (batch, kv_heads, context, dim), jnp.bfloat16)
                    lengths = jnp.full((batch,), context, jnp.int32)
                    order = jax.vmap(lambda key_: jax.random.permutation(key_, context)[:budget])(
                        jax.random.split(keys[3], layers))
                    idx = jnp.broadcast_to(jnp.sort(order, axis=1).astype(jnp.int32)[:, None], (layers, batch, budget))
                    dense_bytes = 2 * batch * kv_heads * context * dim * 2 * layers
                    sparse_bytes = 2 * batch * kv_heads * budget * dim * 2 * layers

                    def ours_dense(q_, k_, v_, x_):
                        return merged_history(dense_history_partials(q_, k_, v_, x_, interpret=interpret), packed_rows)

                    variants = {"ours_dense": (ours_dense, (q, k, v, lengths), "dense"),
                                "xla_dense": (dense_history_reference, (q, k, v, lengths), "dense")}
                    if not interpret:  # cuDNN on its own layout: [B, T, Hq, D] queries, [B, S, Hkv, D] keys/values
                        qc = jax.random.normal(keys[4], (layers, batch, steps, q_heads, dim), jnp.bfloat16)

                        def cudnn_dense(q_, k_, v_, x_):
                            return jax.nn.dot_product_attention(q_, k_, v_, key_value_seq_lengths=x_,
                                                                implementation="cudnn")

                        variants["cudnn_dense"] = (cudnn_dense, (qc, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                                                 lengths), "dense")
                    for chunk, per_program, warps in tilings:
                        if budget % (chunk * per_program):
                            continue

                        def ours_sparse(q_, k_, v_, x_, chunk=chunk, per_program=per_program, warps=warps):
                            return merge_partials(sparse_history_partials(
                                q_, k_, v_, x_, chunk=chunk, chunks_per_program=per_program, num_warps=warps,
                                interpret=interpret), axis=2)

                        variants[f"ours_sparse_c{chunk}_p{per_program}_w{warps}"] = (ours_sparse, (q, k, v, idx),
                                                                                    "sparse")
                    dense_ref = normalize(dense_history_reference(q[0], k, v, lengths))
                    sparse_ref = normalize(sparse_history_reference(q[0], k, v, idx[0]))
                    case_rows = []
                    for name, (fn, (q_all, k_, v_, x_all), kind) in variants.items():
                        per_layer_x = x_all.ndim == 3  # index sets differ per layer; lengths are shared
                        if args.layer_loop == "unrolled":
                            # each layer's inputs as buffers of their own, cut before the timed program
                            q_all = [q_all[i] for i in range(layers)]
                            x_all = [x_all[i] for i in range(layers)] if per_layer_x else x_all

                            def all_layers(q_all, k_, v_, x_all, fn=fn, per_layer_x=per_layer_x):
                                # one call per layer, in order, as the model's forward makes them
                                return [fn(q_l, k_, v_, x_all[i] if per_layer_x else x_all)
                                        for i, q_l in enumerate(q_all)]
                        else:
                            def all_layers(q_all, k_, v_, x_all, fn=fn, per_layer_x=per_layer_x):
                                # a rolled loop over the layers: each kernel compiles once (80 unrolled Pallas
                                # calls compile 80 times); its per-layer slices count as kernels too
                                def layer(_, xs):
                                    q_l, x_l = xs if per_layer_x else (xs, x_all)
                                    return None, fn(q_l, k_, v_, x_l)

                                return jax.lax.scan(layer, None, (q_all, x_all) if per_layer_x else q_all)[1]

                        program = jax.jit(all_layers)
                        try:
                            outs = program(q_all, k_, v_, x_all)
                            jax.block_until_ready(outs)
                        except Exception as err:  # cuDNN may refuse a shape: report, never hide
                            if name != "cudnn_dense":
                                raise
                            case_rows.append({"shape": shape, "context": context, "batch": batch, "k": budget,
                                              "layers": layers, "variant": name, "kind": "error",
                                              "error": f"{type(err).__name__}: {err}"[:300]})
                            continue
                        error = None
                        if name != "cudnn_dense":  # its queries are its own (another layout)
                            ref = dense_ref if kind == "dense" else sparse_ref
                            first = outs[0] if args.layer_loop == "unrolled" else jax.tree.map(lambda leaf: leaf[0], outs)
                            out = normalize(first)
                            error = float(jnp.linalg.norm((out - ref).astype(jnp.float32))
                                          / jnp.linalg.norm(ref.astype(jnp.float32)))
                        del outs
                        run = lambda: jax.block_until_ready(program(q_all, k_, v_, x_all))  # noqa: E731
                        walls, device, launches, breakdowns = [], [], [], []
                        for _ in range(args.repeats):
                            start = time.perf_counter()
                            run()
                            walls.append(time.perf_counter() - start)
                        for _ in range(args.repeats):
                            summary = trace_on_backend(run)
                            planes = summary["planes"].values()
                            device.append(sum(p["kernel_time_s"] for p in planes))
                            launches.append(sum(p["launches"] for p in planes))
                            breakdowns.append(kernel_breakdown(planes, layers))
                        if not all(device):
                            raise RuntimeError(f"{key} {name}: the profiler recorded no device kernels, so device "
                                               "time cannot be measured here (is CUPTI available?)")
                        wall, device_s = float(np.median(walls)), float(np.median(device))
                        moved = dense_bytes if kind == "dense" else sparse_bytes
                        case_rows.append({"shape": shape, "context": context, "batch": batch, "k": budget,
                                          "layers": layers, "variant": name, "kind": kind,
                                          "device_us_per_layer": device_s / layers * 1e6,
                                          "wall_us_per_layer": wall / layers * 1e6,
                                          "launches_per_layer": float(np.median(launches)) / layers,
                                          "device_TBps": moved / device_s / 1e12 if device_s else float("nan"),
                                          "of_copy_bw": moved / device_s / bandwidth if device_s else float("nan"),
                                          "rel_err": error, "device_s_runs": device, "wall_s_runs": walls,
                                          # the run of median device time, kernel by kernel
                                          **breakdowns[int(np.argsort(device)[len(device) // 2])]})
                    dense = [r for r in case_rows if r["kind"] == "dense"]
                    sparse = [r for r in case_rows if r["kind"] == "sparse"]
                    best_dense = min(dense, key=lambda r: r["device_us_per_layer"])
                    best_sparse = min(sparse, key=lambda r: r["device_us_per_layer"])
                    wall_dense = min(dense, key=lambda r: r["wall_us_per_layer"])
                    wall_sparse = min(sparse, key=lambda r: r["wall_us_per_layer"])
                    summary = {"layer_loop": args.layer_loop,
                               "fastest_dense": best_dense["variant"], "fastest_sparse": best_sparse["variant"],
                               "speedup_device": best_dense["device_us_per_layer"] / best_sparse["device_us_per_layer"],
                               "speedup_wall": wall_dense["wall_us_per_layer"] / wall_sparse["wall_us_per_layer"],
                               "byte_ratio": dense_bytes / sparse_bytes}
                    for row in dense + sparse:  # a cuDNN error row has no time
                        row["speedup_device_vs_fastest_dense"] = (best_dense["device_us_per_layer"]
                                                                  / row["device_us_per_layer"])
                    writer.add(key, {"rows": case_rows, **summary})
                    rows_out.extend(case_rows)
                    print(f"{key}: sparse {summary['speedup_device']:.1f}x the fastest dense by device time "
                          f"({best_sparse['variant']} against {best_dense['variant']}), "
                          f"{summary['speedup_wall']:.1f}x by host time", flush=True)
                    del q, k, v, variants
    print_table(rows_out, columns=["shape", "context", "batch", "k", "variant", "device_us_per_layer",
                                   "wall_us_per_layer", "launches_per_layer", "device_TBps", "rel_err",
                                   "speedup_device_vs_fastest_dense"],
                title=f"attention of all layers, gamma + 1 = {steps} query rows, by device kernel time")
    return writer.data


def register(subparsers) -> None:
    device = subparsers.add_parser("attention-device-time", help="dense vs sparse attention of all layers by "
                                                                 "device kernel time from the profiler (H200)")
    device.add_argument("--shapes", default="qwen2.5-7b,qwen2.5-72b")
    device.add_argument("--contexts", default="32768")
    device.add_argument("--batches", default="16")
    device.add_argument("--budgets", default="512")
    device.add_argument("--gamma", type=int, default=4)
    device.add_argument("--layers", type=int, default=0, help="layers per program (0: the shape's own count)")
    device.add_argument("--sparse-configs", default="32x4x4,64x2x4,64x1x4",
                        help="sparse kernel tilings, CHUNKxCHUNKS_PER_PROGRAMxWARPS; the fastest by device time counts")
    device.add_argument("--repeats", type=int, default=3, help="traced (and host-timed) runs per variant; median")
    device.add_argument("--layer-loop", default="scan", choices=LAYER_LOOPS,
                        help="scan: one rolled loop over the layers (its per-layer slices and stacked writes run as "
                             "kernels too); unrolled: one call per layer on inputs of its own (each call compiles)")
    device.add_argument("--copy-gib", type=float, default=4.0)
    device.set_defaults(func=cmd_attention_device_time)
    bench = subparsers.add_parser("bench-attention", help="dense/sparse attention kernels and selection (H200)")
    bench.add_argument("--shapes", default="qwen2.5-7b,qwen2.5-72b")
    bench.add_argument("--contexts", default="8192,16384,32768")
    bench.add_argument("--batches", default="1,8,16")
    bench.add_argument("--budgets", default="256,512,1024,2048")
    bench.add_argument("--gamma", type=int, default=4)
    bench.add_argument("--sparse-configs", default="64x1x4,32x2x4,64x2x4,128x1x8,32x4x4",
                       help="sparse kernel tilings to time, CHUNKxCHUNKS_PER_PROGRAMxWARPS; ours_sparse = the fastest")
    bench.add_argument("--scoring-configs", default="128x4,256x8",
                       help="Pallas SRH scoring kernel, BLOCKxWARPS (XLA scoring is always timed too)")
    bench.add_argument("--topk-configs", default="8xscatter,4xcompare,4xpallas",
                       help="radix top-k variants, BITSxHISTOGRAM (histogram: scatter | compare | pallas)")
    bench.add_argument("--iters", type=int, default=20)
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--copy-gib", type=float, default=4.0)
    bench.set_defaults(func=cmd_bench_attention)
    sel = subparsers.add_parser("bench-selection", help="the input-aware m rules' selection cost against the "
                                                        "fixed rule (docs/methods.md §3.7), any backend")
    sel.add_argument("--contexts", default="16384,32768")
    sel.add_argument("--batches", default="1,16")
    sel.add_argument("--budgets", default="128,256,512,1024")
    sel.add_argument("--rules", default=",".join(DEFAULT_SELECTION_RULES),
                     help="coverage, entropy, max-mass, coverage-ladder (the coverage rule with --m-steps), "
                          "coverage-sort / coverage-radix (the coverage rule with its candidates scored that way; "
                          "coverage is the platform's default, docs/methods.md §3.7), fixed-rows (the fixed rule "
                          "with a per-row m), coverage-held3 (the coverage rule deciding every third round: its "
                          "selection and two per-row fixed selections with the m it chose, per round, scheduled from "
                          "the host), coverage-held3-cond (the same three rounds as the verifier runs them: "
                          "select_held with the decision a traced predicate, a lax.cond)")
    sel.add_argument("--m-steps", type=int, default=4, metavar="N",
                     help="coverage-ladder: steps of its candidate ladder on each side of m (docs/methods.md §3.7)")
    sel.add_argument("--dustin-profile", default=None,
                     help="take each budget's sinks, window and m from this Dustin profile (default: m = (k-s-w)/2)")
    sel.add_argument("--iters", type=int, default=20, help="calls per timing (best of groups of 4)")
    sel.add_argument("--repeats", type=int, default=5, help="timings per rule, interleaved across rules; best")
    sel.set_defaults(func=cmd_bench_selection)
    sco = subparsers.add_parser("bench-scoring", help="Dustin's per-round signal scoring (s_T and s_D) of each "
                                                      "profile's SRHs, same keys, one process (any backend)")
    sco.add_argument("--dustin-profile", required=True,
                     help="comma-separated Dustin profiles of one pair (the first is the baseline of the ratios)")
    sco.add_argument("--contexts", default="16384,32768")
    sco.add_argument("--batches", default="1,16")
    sco.add_argument("--budgets", default="512", help="the profiles' budgets whose SRH layers and heads are timed")
    sco.add_argument("--gamma", type=int, default=4, help="draft steps: query rows of the draft signal")
    sco.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"], help="the caches' key dtype")
    sco.add_argument("--iters", type=int, default=20, help="calls per timing (best of groups of 4)")
    sco.add_argument("--repeats", type=int, default=5, help="timings per profile, interleaved; best")
    sco.add_argument("--scoring-layouts", default=None, metavar="L1,L2",
                     help="time each profile with each of these scoring layouts (DustinConfig.scoring_layout: "
                          "groups, heads, pallas; default: groups alone); the first profile's first layout is the "
                          "baseline of the ratios")
    sco.set_defaults(func=cmd_bench_scoring)


# ---------------------------------------------------------------------------- the input-aware m rules' cost
SELECTION_RULES = ("coverage", "entropy", "max-mass", "coverage-ladder", "coverage-sort", "coverage-radix",
                   "fixed-rows", "coverage-held3", "coverage-held3-cond", "coverage-held3-unrolled", "fixed-cycle3")
#: rules timed as several calls per round: the coverage rule deciding every third round (one coverage selection and
#: two fixed selections with the per-row m it chose, docs/methods.md §3.7), its time per round the three calls' / 3.
#: coverage-held3 schedules the three rounds from the host (a decision call, then two per-row fixed calls);
#: coverage-held3-cond runs each round as the verifier does, through ``select_held`` with the decision a traced
#: predicate on the device (a ``lax.cond``, whose predicate a GPU copies to the host before it runs a branch);
#: coverage-held3-unrolled runs the three rounds as the unrolled decoding loop does (m_every_schedule="unrolled"):
#: one program, each round's kind compiled in (``select_scheduled``), no conditional
#: (a program of several rounds pays a call's fixed cost once, so its baseline is fixed-cycle3: the fixed rule's three
#: rounds in one program, on the same signals). Rule -> rounds per timed call.
ROUNDS_PER_CALL = {"coverage-held3": 3, "coverage-held3-cond": 3, "coverage-held3-unrolled": 3, "fixed-cycle3": 3}
#: the several-round rules whose last round, on the same signals throughout, selects the coverage rule's own set
#: (checked against its reference); the one-program rules run their later rounds on other signals
SAME_SIGNALS_HELD = ("coverage-held3", "coverage-held3-cond")
#: the coverage rule with its candidates scored one way (jaxspec.dustin.selection.COVERAGE_SCORING); "coverage" is
#: the platform's default
COVERAGE_SCORED = {"coverage-sort": "sort", "coverage-radix": "radix"}
#: what bench-selection times unless --rules says otherwise (the ladder is the coverage rule widened)
DEFAULT_SELECTION_RULES = SELECTION_RULES[:3]


def _cycle_program(select_round, m_rows, later):
    """``fn(s_D, s_T, lengths)``: one jitted program of ``1 + len(later)`` selection rounds as a decoding loop runs
    them, round 0 on the given signals and round j on ``later[j - 1]``, each after the one before (an optimization
    barrier passes the next round's inputs only once the last round's set exists: with the same signals XLA would
    merge rounds, and without the barrier it could run them side by side). ``select_round(j, s_D, s_T, lengths,
    m_rows) -> (I_verify, m_rows)``. Returns every round's set (a round whose set went unused would be dropped as
    dead code), the last one last."""
    import jax

    def cycle(a, b, rounds, n):
        m, outs = m_rows, []
        for j, (sd, st) in enumerate(((a, b),) + tuple(rounds)):
            if outs:
                (sd, st, m), _ = jax.lax.optimization_barrier(((sd, st, m), outs[-1]))
            out, m = select_round(j, sd, st, n, m)
            outs.append(out)
        return tuple(outs)

    program = jax.jit(cycle)
    return lambda a, b, n: program(a, b, later, n)


def _best_of_groups(fn, operands, iters: int) -> float:
    """Seconds per call of ``fn(*operands)``: the best of ``iters // 4 + 1`` groups of 4 back-to-back calls."""
    import jax

    best = float("inf")
    for _ in range(iters // 4 + 1):
        start = time.perf_counter()
        for _ in range(4):
            out = fn(*operands)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / 4)
    return best


def _rule_configs(profile_path, budgets):
    """``{k: DustinConfig}`` (hybrid, fixed m) from a Dustin profile's per-budget sinks, window and m; without a
    profile the defaults (m = half of k - s - w). The SRH layers and heads only switch the rules on here."""
    import json
    import pathlib

    from jaxspec.dustin.config import DustinConfig

    configs = json.loads(pathlib.Path(profile_path).read_text())["configs"] if profile_path else {}
    out = {}
    for k in budgets:
        entry = configs.get(str(k))
        if profile_path and entry is None:
            raise ValueError(f"--dustin-profile {profile_path} has no config for k={k}; it has k = "
                             f"{', '.join(sorted(configs, key=int))}")
        base = dict(budget=k, sinks=entry["sinks"], window=entry["window"], m=entry["m"]) if entry else dict(budget=k)
        out[k] = DustinConfig(**base, target_layer=0, target_heads=(0, 1, 2, 3), draft_layers=(0,),
                              draft_heads=((0, 1, 2, 3),), mode="hybrid")
    return out


#: the fixed rule's draft part in jaxspec.dustin.selection.select_verify_indices (the per-row mask path)
FIXED_RULE_DRAFT_PART = "mask"


def cmd_bench_selection(args) -> Dict[str, Any]:
    """The input-aware m rules (docs/methods.md §3.7) against the fixed rule, each timed on the same signals in
    the same process, interleaved: ``select_for_config`` with ``m_rule`` fixed and each rule. Signals are
    seeded and heavy-tailed (``u ** 8``), which is the shape of attention mass; the cost does not depend on
    their values. The coverage rule is checked against its direct reference (every candidate selected in full)."""
    import jax
    import jax.numpy as jnp

    from jaxspec.dustin.selection import (select_for_config, select_held, select_input_aware,
                                          select_input_aware_reference, select_scheduled,
                                          select_verify_indices_rows)

    rules = [r for r in args.rules.split(",") if r]
    unknown = [r for r in rules if r not in SELECTION_RULES]
    if unknown:
        raise ValueError(f"--rules {args.rules!r}: unknown {unknown}; valid: {', '.join(SELECTION_RULES)}")
    if "coverage-ladder" in rules and args.m_steps < 2:
        raise ValueError(f"--m-steps={args.m_steps}: the coverage-ladder rule needs a ladder of at least 2 steps "
                         f"(1 is the coverage rule)")
    budgets = [int(k) for k in args.budgets.split(",")]
    configs = _rule_configs(args.dustin_profile, budgets)
    if args.repeats < 1 or args.iters < 1:
        raise ValueError(f"--repeats {args.repeats} / --iters {args.iters}: each must be >= 1")
    writer = ResultWriter(args.out, "bench-selection", config_of(args))
    # how the fixed rule, every ratio's baseline, selects the draft's part (earlier files: indices + scatter)
    writer.set("fixed_rule_draft_part", FIXED_RULE_DRAFT_PART)

    rows_out = []
    for context in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            rng = np.random.default_rng(context + batch)
            s_d = jnp.asarray(rng.random((batch, context), np.float32) ** 8)
            s_t = jnp.asarray(rng.random((batch, context), np.float32) ** 8)
            lengths = jnp.asarray(context - rng.integers(0, max(context // 64, 1), batch), jnp.int32)
            # the next rounds' signals, for a program that runs several rounds (coverage-held3-unrolled)
            later_signals = tuple((jnp.asarray(rng.random((batch, context), np.float32) ** 8),
                                   jnp.asarray(rng.random((batch, context), np.float32) ** 8))
                                  for _ in range(ROUNDS_PER_CALL["coverage-held3-unrolled"] - 1))
            # (coverage-held3-unrolled and fixed-cycle3 run 3 rounds: round 0 on s_d / s_t, then these)
            for k in budgets:
                key = f"ctx{context}/b{batch}/k{k}"
                if writer.has(key):
                    rows_out.extend(writer.get(key)["rows"])
                    continue
                fixed_cfg = configs[k]
                fns = {"fixed": jax.jit(lambda a, b, n, c=fixed_cfg: select_for_config(c, a, b, n))}
                rows_fn = jax.jit(lambda a, b, n, m, c=fixed_cfg: select_verify_indices_rows(
                    a, b, n, m, k=c.budget, sinks=c.sinks, window=c.window_size))
                per_row_m = jnp.full((batch,), fixed_cfg.effective_m, jnp.int32)
                for rule in rules:
                    if rule == "fixed-rows":  # the fixed rule with a per-row m (traced), as a held m selects
                        fns[rule] = lambda a, b, n, f=rows_fn: f(a, b, n, per_row_m)
                        continue
                    if rule == "coverage-held3-cond":  # the verifier's own round: select_held, traced decision
                        cfg = fixed_cfg.replace(m_rule="coverage")
                        if cfg.input_aware:
                            step = jax.jit(lambda a, b, n, m, d, c=cfg: select_held(c, a, b, n, m, d))
                            flags = [jnp.asarray(r == 0) for r in range(ROUNDS_PER_CALL[rule])]  # on the device once

                            def held_cond(a, b, n, step=step, flags=flags):
                                m_rows = per_row_m
                                for decide in flags:
                                    out, m_rows = step(a, b, n, m_rows, decide)
                                return out
                            fns[rule] = held_cond
                        continue
                    if rule == "coverage-held3-unrolled":  # the unrolled loop's cycle: one program, kinds compiled in
                        cfg = fixed_cfg.replace(m_rule="coverage")
                        if cfg.input_aware:
                            fns[rule] = _cycle_program(lambda j, sd, st, n, m, c=cfg: select_scheduled(
                                c, sd, st, n, m, decide=j == 0), per_row_m, later_signals)
                        continue
                    if rule == "fixed-cycle3":  # its baseline: the fixed rule's three rounds in one program
                        fns[rule] = _cycle_program(lambda j, sd, st, n, m, c=fixed_cfg: (
                            select_for_config(c, sd, st, n), m), per_row_m, later_signals)
                        continue
                    if rule == "coverage-held3":  # scheduled from the host: a deciding call, then calls with its m
                        cfg = fixed_cfg.replace(m_rule="coverage")
                        if cfg.input_aware:
                            decide = jax.jit(lambda a, b, n, c=cfg: select_input_aware(
                                a, b, n, k=c.budget, sinks=c.sinks, window=c.window_size, candidates=c.m_candidates))

                            def held(a, b, n, decide=decide, every=ROUNDS_PER_CALL[rule]):
                                out, m_rows = decide(a, b, n)
                                for _ in range(every - 1):
                                    out = rows_fn(a, b, n, m_rows)
                                return out
                            fns[rule] = held
                        continue
                    if rule in COVERAGE_SCORED:  # the coverage rule, its scoring named
                        cfg = fixed_cfg.replace(m_rule="coverage")
                        if cfg.input_aware:
                            fns[rule] = jax.jit(lambda a, b, n, c=cfg, how=COVERAGE_SCORED[rule]: select_input_aware(
                                a, b, n, k=c.budget, sinks=c.sinks, window=c.window_size, candidates=c.m_candidates,
                                scoring=how)[0])
                        continue
                    cfg = (fixed_cfg.replace(m_rule="coverage", m_steps=args.m_steps) if rule == "coverage-ladder"
                           else fixed_cfg.replace(m_rule=rule))
                    if cfg.input_aware:
                        fns[rule] = jax.jit(lambda a, b, n, c=cfg: select_for_config(c, a, b, n))
                for fn in fns.values():
                    jax.block_until_ready(fn(s_d, s_t, lengths))  # compile
                samples = {name: [] for name in fns}
                for _ in range(args.repeats):  # interleaved, so drift on the machine touches every rule alike
                    for name, fn in fns.items():
                        samples[name].append(_best_of_groups(fn, (s_d, s_t, lengths), args.iters))
                best = {name: min(v) / ROUNDS_PER_CALL.get(name, 1) for name, v in samples.items()}  # per round
                result = {"context": context, "batch": batch, "k": k, "m": fixed_cfg.effective_m,
                          "sinks": fixed_cfg.sinks, "window": fixed_cfg.window_size,
                          "seconds": best, "samples_s": samples,
                          "ratio_to_fixed": {n: best[n] / best["fixed"] for n in best if n != "fixed"}}
                if "fixed-cycle3" in best:  # a program of three rounds against the fixed rule's own such program
                    result["ratio_to_fixed_cycle"] = {n: best[n] / best["fixed-cycle3"] for n in best
                                                      if n == "coverage-held3-unrolled"}
                # the held rule too: on the deciding round's own signals the held m selects the rule's own set
                for name, steps in (("coverage", 1), ("coverage-ladder", args.m_steps), ("coverage-sort", 1),
                                    ("coverage-radix", 1), *((held, 1) for held in SAME_SIGNALS_HELD)):
                    if name in fns:
                        cfg = fixed_cfg.replace(m_rule="coverage", m_steps=steps)
                        ref = select_input_aware_reference(s_d, s_t, lengths, k=k, sinks=cfg.sinks,
                                                           window=cfg.window_size, candidates=cfg.m_candidates)[0]
                        result[f"{name.replace('-', '_')}_equals_reference"] = bool(
                            jnp.all(ref == fns[name](s_d, s_t, lengths)))
                if "coverage-held3-unrolled" in fns:  # its last round: the m decided on round 0's signals
                    cfg = fixed_cfg.replace(m_rule="coverage")
                    decided = select_input_aware(s_d, s_t, lengths, k=k, sinks=cfg.sinks, window=cfg.window_size,
                                                 candidates=cfg.m_candidates)[1]
                    want = rows_fn(*later_signals[-1], lengths, decided)
                    result["coverage_held3_unrolled_equals_host"] = bool(
                        jnp.all(want == fns["coverage-held3-unrolled"](s_d, s_t, lengths)[-1]))
                rows = [{"context": context, "batch": batch, "k": k, "rule": n, "ms": 1e3 * best[n],
                         "vs_fixed": result["ratio_to_fixed"].get(n, 1.0)} for n in best]
                result["rows"] = rows
                rows_out.extend(rows)
                writer.add(key, result)
                print(f"[bench-selection] {key}: " + ", ".join(f"{r['rule']} {r['ms']:.3f} ms ({r['vs_fixed']:.2f}x)"
                                                             for r in rows), flush=True)
    print_table(rows_out, title="selection per round: the input-aware m rules vs the fixed rule (same signals)")
    return writer.data


# ---------------------------------------------------------------------------- the signals' scoring cost
def _kv_groups_read(heads, queries_per_kv) -> int:
    return len({int(h) // queries_per_kv for h in heads})


def cmd_bench_scoring(args) -> Dict[str, Any]:
    """Dustin's two signals as a round computes them (docs/methods.md §3.1, §3.4): ``target_signal`` (the last
    committed token's query at the target SRH heads against that layer's keys) and ``draft_signal`` (gamma query
    rows per draft SRH layer against the draft's keys), for each profile's config of a budget, on the same seeded
    keys, timed interleaved in one process. The scoring reads each KV group's keys once per layer, so the key
    bytes follow the number of KV groups the SRHs span (GQA-aware SRHs: ``dustin-profile --srh-kv-groups``)."""
    import jax
    import jax.numpy as jnp

    from jaxspec.dustin.config import SCORING_LAYOUTS
    from jaxspec.dustin.search import DustinProfile
    from jaxspec.dustin.signals import DraftSignals, draft_signal, target_signal

    paths = [p for p in args.dustin_profile.split(",") if p]
    layouts = [x for x in (args.scoring_layouts or "groups").split(",") if x]
    bad = [x for x in layouts if x not in SCORING_LAYOUTS]
    if bad or not layouts or len(set(layouts)) != len(layouts):
        raise ValueError(f"--scoring-layouts {args.scoring_layouts!r}: give distinct layouts of "
                         f"{', '.join(SCORING_LAYOUTS)}")
    if not paths or len(set(paths)) != len(paths):
        raise ValueError(f"--dustin-profile {args.dustin_profile!r}: give one or more distinct profiles")
    budgets = [int(k) for k in args.budgets.split(",")]
    if args.repeats < 1 or args.iters < 1 or args.gamma < 1:
        raise ValueError(f"--repeats {args.repeats} / --iters {args.iters} / --gamma {args.gamma}: each must be >= 1")
    profiles = [DustinProfile.load(p) for p in paths]
    shape_keys = ("num_heads", "num_kv_heads", "head_dim")
    for path, prof in zip(paths[1:], profiles[1:]):
        for side in ("target", "draft"):
            if any(getattr(prof, side).get(k) != getattr(profiles[0], side).get(k) for k in shape_keys):
                raise ValueError(f"--dustin-profile {path}: its {side} shape differs from {paths[0]}'s; compare "
                                 "profiles of one pair")
    for path, prof in zip(paths, profiles):
        missing = [k for k in budgets if k not in prof.configs]
        if missing:
            raise ValueError(f"--dustin-profile {path} has no config for k={missing}; it has k = {sorted(prof.configs)}")
    tgt, dft = profiles[0].target, profiles[0].draft
    t_qpk, d_qpk = tgt["num_heads"] // tgt["num_kv_heads"], dft["num_heads"] // dft["num_kv_heads"]
    dtype = jnp.dtype(args.dtype)
    writer = ResultWriter(args.out, "bench-scoring", config_of(args))

    rows_out = []
    for context in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            for k in budgets:
                key = f"ctx{context}/b{batch}/k{k}"
                if writer.has(key):
                    rows_out.extend(writer.get(key)["rows"])
                    continue
                configs = [prof.config(k) for prof in profiles]
                draft_layers = max(len(c.draft_layers) for c in configs)
                rng = jax.random.split(jax.random.PRNGKey(context + batch), 2 + draft_layers)
                t_keys = jax.random.normal(rng[0], (batch, tgt["num_kv_heads"], context, tgt["head_dim"]), dtype)
                d_keys = [jax.random.normal(r, (batch, dft["num_kv_heads"], context, dft["head_dim"]), dtype)
                          for r in rng[2:]]
                lengths = jnp.full((batch,), context - 1, jnp.int32)
                fns, operands, info = {}, {}, {}
                variants = [(path, cfg, layout) for path, cfg in zip(paths, configs) for layout in layouts]
                for path, cfg, layout in variants:
                    label = path if len(layouts) == 1 else f"{path} [{layout}]"
                    t_query = jax.random.normal(rng[1], (batch, len(cfg.target_heads), tgt["head_dim"]), jnp.float32)
                    d_queries = jax.random.normal(rng[1], (batch, sum(len(h) for h in cfg.draft_heads), args.gamma,
                                                           dft["head_dim"]), jnp.float32)

                    def round_scoring(tq, tk, dq, dk, n, cfg=cfg, layout=layout):
                        s_t = target_signal(tq, tk, n, cfg.target_heads, t_qpk, layout)
                        s_d = draft_signal(DraftSignals(dq, tuple(dk)), n, cfg.draft_heads, d_qpk, context, layout)
                        return s_t, s_d

                    fns[label] = jax.jit(round_scoring)
                    operands[label] = (t_query, t_keys, d_queries, d_keys[:len(cfg.draft_layers)], lengths)
                    groups_t = _kv_groups_read(cfg.target_heads, t_qpk)
                    groups_d = [_kv_groups_read(h, d_qpk) for h in cfg.draft_heads]
                    key_bytes = batch * context * dtype.itemsize * (groups_t * tgt["head_dim"]
                                                                    + sum(groups_d) * dft["head_dim"])
                    info[label] = {"profile": path, "layout": layout, "target_layer": cfg.target_layer,
                                   "target_heads": list(cfg.target_heads), "target_kv_groups": groups_t,
                                   "draft_layers": list(cfg.draft_layers),
                                   "draft_heads": [list(h) for h in cfg.draft_heads], "draft_kv_groups": groups_d,
                                   "key_bytes": key_bytes}
                outputs = {label: jax.block_until_ready(fn(*operands[label])) for label, fn in fns.items()}  # compile
                base = next(iter(fns))
                scale = max(float(jnp.max(jnp.abs(x))) for x in outputs[base])
                for label, out in outputs.items():  # every layout scores the same signals
                    info[label]["max_abs_diff_vs_first"] = max(float(jnp.max(jnp.abs(a - b)))
                                                               for a, b in zip(out, outputs[base]))
                    info[label]["rel_diff_vs_first"] = info[label]["max_abs_diff_vs_first"] / max(scale, 1e-30)
                samples = {label: [] for label in fns}
                for _ in range(args.repeats):  # interleaved, so drift on the machine touches every variant alike
                    for label, fn in fns.items():
                        samples[label].append(_best_of_groups(fn, operands[label], args.iters))
                best = {label: min(v) for label, v in samples.items()}
                rows = [{"context": context, "batch": batch, "k": k, "profile": info[label]["profile"],
                         **({"layout": info[label]["layout"]} if len(layouts) > 1 else {}),
                         "kv_groups": f"{info[label]['target_kv_groups']} / "
                                      f"{'+'.join(map(str, info[label]['draft_kv_groups']))}",
                         "MB": info[label]["key_bytes"] / 1e6, "ms": 1e3 * best[label],
                         "GBps": info[label]["key_bytes"] / best[label] / 1e9,
                         "vs_first": best[label] / best[base],
                         "bytes_vs_first": info[label]["key_bytes"] / info[base]["key_bytes"]} for label in fns]
                writer.add(key, {"context": context, "batch": batch, "k": k, "seconds": best, "samples_s": samples,
                                 "profiles": info, "rows": rows})
                rows_out.extend(rows)
                print(f"[bench-scoring] {key}: " + ", ".join(
                    f"{r['profile']}{' [' + r['layout'] + ']' if 'layout' in r else ''} {r['ms']:.3f} ms "
                    f"({r['vs_first']:.2f}x, bytes {r['bytes_vs_first']:.2f}x)" for r in rows), flush=True)
                del t_keys, d_keys
    print_table(rows_out, title="Dustin's signal scoring per round (s_T + s_D), each profile's SRHs, same keys")
    return writer.data
