"""Attention kernel benchmark: ``bench-attention`` (run on the H200).

For each layer shape, context, batch and budget, in one process: our dense Pallas kernel, XLA
dense (the jnp reference), cuDNN dense (``jax.nn.dot_product_attention(implementation=
"cudnn")`` on its own [B, S, H, D] layout), our sparse Pallas kernel, XLA gather + dense, and the
selection step (SRH scoring of 4 heads + exact radix top-k, next to ``lax.top_k``). Every
variant is first checked against the jnp reference on the same random inputs.

Timing: each variant runs ``--iters`` times inside one jitted ``fori_loop`` whose iterations
depend on the previous output (so nothing is hoisted), after a warm-up; the per-call time is
the median over ``--repeats`` such loops. Bytes moved are the fewest the variant must read
(K and V rows it attends to, once), reported against the copy bandwidth measured in the run.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict

import numpy as np

from experiments.common import ResultWriter, print_table
from experiments.foundation import _config_of, copy_bandwidth

SHAPES = {"qwen2.5-7b": (28, 4, 128), "qwen2.5-72b": (64, 8, 128)}  # (q heads, kv heads, head_dim)
LAYERS = {"qwen2.5-7b": 28, "qwen2.5-72b": 80}


def loop_time(fn: Callable, args, iters: int, repeats: int) -> Dict[str, float]:
    """Median seconds per call of ``fn(*args)`` (first arg perturbed each iteration by the last output)."""
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

        return jax.lax.fori_loop(0, iters, body, (a[0], jnp.float32(0)))[1]

    compiled = jax.jit(run)
    compiled(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        compiled(*args).block_until_ready()
        times.append((time.perf_counter() - start) / iters)
    times.sort()
    return {"median_s": times[len(times) // 2], "min_s": times[0], "max_s": times[-1], "iters": iters,
            "repeats": repeats}


def cmd_bench_attention(args) -> Dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention import dense_history_partials, merged_history, sparse_history_partials
    from pallas_kernels.reference import (dense_history_reference, merge_partials, normalize,
                                          sparse_history_reference)
    from pallas_kernels.selection import select_top_k, srh_scores

    writer = ResultWriter(args.out, "bench-attention", _config_of(args))
    if not writer.has("copy_bandwidth"):
        writer.add("copy_bandwidth", copy_bandwidth(args.copy_gib))
    bandwidth = writer.get("copy_bandwidth")["bandwidth_Bps"]
    interpret = jax.default_backend() != "gpu"
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
                # selection: 4 SRH heads (target signal, 1 row) + exact radix top-k vs lax.top_k
                srh_q = (0.1 * jax.random.normal(keys[3], (batch, 4, 1, dim))).astype(jnp.bfloat16)
                srh_groups = tuple(sorted({0, 1, 2, 3} if kv_heads >= 4 else {0}))[:4]
                srh_groups = tuple(list(srh_groups) + [srh_groups[-1]] * (4 - len(srh_groups)))
                for budget in [int(b) for b in args.budgets.split(",")]:
                    if budget >= context:
                        continue
                    idx = jnp.sort(jax.random.permutation(jax.random.PRNGKey(budget), context)[:budget])
                    idx = jnp.broadcast_to(idx.astype(jnp.int32), (batch, budget))
                    sparse_ref = normalize(sparse_history_reference(q, k, v, idx))

                    def ours_sparse(q_, k_, v_, idx_):
                        return merge_partials(sparse_history_partials(q_, k_, v_, idx_, chunk=args.chunk,
                                                                      interpret=interpret), axis=2)

                    def xla_sparse(q_, k_, v_, idx_):
                        return sparse_history_reference(q_, k_, v_, idx_)

                    sparse_bytes = 2 * batch * kv_heads * budget * dim * 2
                    for name, fn in (("ours_sparse", ours_sparse), ("xla_gather_dense", xla_sparse)):
                        out = normalize(fn(q, k, v, idx))
                        err = float(jnp.linalg.norm((out - sparse_ref).astype(jnp.float32))
                                    / jnp.linalg.norm(sparse_ref.astype(jnp.float32)))
                        timing = loop_time(fn, (q, k, v, idx), args.iters, args.repeats)
                        case_rows.append({"shape": shape, "context": context, "batch": batch, "variant": name,
                                          "k": budget, "us": timing["median_s"] * 1e6, "GB": sparse_bytes / 1e9,
                                          "TBps": sparse_bytes / timing["median_s"] / 1e12,
                                          "of_copy_bw": sparse_bytes / timing["median_s"] / bandwidth,
                                          "rel_err": err,
                                          "speedup_vs_fastest_dense": fastest / timing["median_s"]})

                    scores_fixed = srh_scores(srh_q.astype(jnp.float32), k, lengths, srh_groups)

                    def scoring(sq, k_, len_):
                        return srh_scores(sq, k_, len_, srh_groups)

                    def radix(scores, len_):
                        return select_top_k(scores, len_, k=budget, sinks=4, window=64).astype(jnp.float32)

                    def lax_top(scores, len_):
                        return jax.lax.top_k(scores, budget)[1].astype(jnp.float32)

                    verify_dense = LAYERS[shape] * fastest
                    srh_bytes = batch * len(set(srh_groups)) * context * dim * 2
                    for name, fn, fn_args, moved in (
                            ("selection_scoring", scoring, (srh_q.astype(jnp.float32), k, lengths), srh_bytes),
                            ("selection_radix_top_k", radix, (scores_fixed, lengths), batch * context * 4),
                            ("selection_lax_top_k", lax_top, (scores_fixed, lengths), batch * context * 4)):
                        timing = loop_time(fn, fn_args, args.iters, args.repeats)
                        case_rows.append({"shape": shape, "context": context, "batch": batch, "variant": name,
                                          "k": budget, "us": timing["median_s"] * 1e6, "GB": moved / 1e9,
                                          "TBps": moved / timing["median_s"] / 1e12,
                                          "of_copy_bw": moved / timing["median_s"] / bandwidth,
                                          "rel_err": float("nan"), "speedup_vs_fastest_dense": "-",
                                          "fraction_of_dense_verification": timing["median_s"] / verify_dense})
                writer.add(key, {"rows": case_rows, "fastest_dense": fastest_name, "errors": errors})
                rows_out.extend(case_rows)
                del q, k, v
    print_table(rows_out, columns=["shape", "context", "batch", "variant", "k", "us", "TBps", "of_copy_bw",
                                   "rel_err", "speedup_vs_fastest_dense", "fraction_of_dense_verification"],
                title=f"attention, one layer, gamma + 1 = {steps} query rows; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    return writer.data


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench-attention", help="dense/sparse attention kernels and selection (H200)")
    bench.add_argument("--shapes", default="qwen2.5-7b,qwen2.5-72b")
    bench.add_argument("--contexts", default="8192,16384,32768")
    bench.add_argument("--batches", default="1,8,16")
    bench.add_argument("--budgets", default="256,512,1024,2048")
    bench.add_argument("--gamma", type=int, default=4)
    bench.add_argument("--chunk", type=int, default=64, help="sparse kernel: selected rows per program")
    bench.add_argument("--iters", type=int, default=20)
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--copy-gib", type=float, default=4.0)
    bench.set_defaults(func=cmd_bench_attention)
