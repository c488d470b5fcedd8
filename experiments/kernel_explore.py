"""Kernel variant exploration on the H200: which sparse-kernel tiling, scoring kernel
and top-k variant to make the default. One process, one shape point, every variant checked
against its jnp reference before it is timed; JSON with every timing.

``python -m experiments.kernel_explore --out FILE [--shape qwen2.5-7b] [--context 32768] [--batch 16]``

Timing as ``bench-attention`` (:func:`experiments.kernels.loop_time`): ``iters`` dependent calls
per jitted program, median of ``repeats`` programs; each variant both unrolled (straight-line,
as the model's layers run) and as a rolled ``fori_loop`` (the earlier harness), plus a
null function (the harness's own per-iteration cost).
"""

from __future__ import annotations

import argparse
import json



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default="qwen2.5-7b,qwen2.5-72b")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="few variants (CPU smoke test)")


def register(subparsers) -> None:
    explore = subparsers.add_parser("kernel-explore", help="attention kernel variants at one point (fused vs "
                                                           "unfused sparse, tilings, harness cost, top-k variants)")
    add_arguments(explore)
    explore.set_defaults(func=cmd_kernel_explore)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m experiments.kernel_explore")
    parser.add_argument("--out", required=True)
    add_arguments(parser)
    cmd_kernel_explore(parser.parse_args(argv))


def cmd_kernel_explore(args):
    if not args.out:
        raise ValueError("kernel-explore needs --out FILE (its cases are resumed from there)")

    import jax
    import jax.numpy as jnp

    from experiments.common import ResultWriter, config_of
    from experiments.kernels import SHAPES, loop_time
    from pallas_kernels.attention import (dense_history_partials, merged_history, sparse_attention_fused,
                                          sparse_history_partials)
    from pallas_kernels.reference import (dense_history_reference, merge_partials, normalize, partial_from_scores,
                                          sparse_history_reference)
    from jaxspec.dustin.selection import select_top_k
    from jaxspec.dustin.signals import srh_scores
    from pallas_kernels.selection import srh_scores_pallas

    writer = ResultWriter(args.out, "kernel-explore", config_of(args))
    interpret = jax.default_backend() != "gpu"
    steps = 5

    def timed(name, fn, fn_args, check=None, moved=None, rolled=False):
        if writer.has(name):
            return writer.get(name)
        record = {}
        try:
            if check is not None:
                record["rel_err"] = float(check(fn(*fn_args)))
            for unroll in ((True, False) if rolled else (True,)):
                t = loop_time(fn, fn_args, args.iters, args.repeats, unroll=unroll)
                record["unrolled_us" if unroll else "rolled_us"] = t["median_s"] * 1e6
            if moved:
                record["GB"] = moved / 1e9
                record["TBps_unrolled"] = moved / (record["unrolled_us"] * 1e-6) / 1e12
        except Exception as err:  # report, never hide
            record["error"] = f"{type(err).__name__}: {err}"[:400]
        writer.add(name, record)
        print(name, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in record.items()}, flush=True)
        return record

    def rel(a, b):
        a = a.astype(jnp.float32)
        b = b.astype(jnp.float32)
        return jnp.linalg.norm(a - b) / jnp.linalg.norm(b)

    for shape in args.shapes.split(","):
        q_heads, kv_heads, dim = SHAPES[shape]
        groups = q_heads // kv_heads
        rows = max(16, 1 << (groups * steps - 1).bit_length())
        batch, context, budget = args.batch, args.context, args.budget
        keys = jax.random.split(jax.random.PRNGKey(0), 6)
        q = (0.1 * jax.random.normal(keys[0], (batch, kv_heads, rows, dim))).astype(jnp.bfloat16)
        k = jax.random.normal(keys[1], (batch, kv_heads, context, dim), jnp.bfloat16)
        v = jax.random.normal(keys[2], (batch, kv_heads, context, dim), jnp.bfloat16)
        lengths = jnp.full((batch,), context, jnp.int32)
        p = f"{shape}/"

        timed(p + "null", lambda q_, k_, v_, l_: q_[:, :, :1, :1], (q, k, v, lengths), rolled=True)
        dense_ref = normalize(dense_history_reference(q, k, v, lengths))
        kv_bytes = 2 * batch * kv_heads * context * dim * 2
        timed(p + "dense_ours", lambda q_, k_, v_, l_: merged_history(
            dense_history_partials(q_, k_, v_, l_, interpret=interpret), rows), (q, k, v, lengths),
            check=lambda out: rel(normalize(out), dense_ref), moved=kv_bytes, rolled=True)

        idx = jnp.sort(jax.random.permutation(keys[3], context)[:budget]).astype(jnp.int32)
        idx = jnp.broadcast_to(idx, (batch, budget))
        sparse_ref = normalize(sparse_history_reference(q, k, v, idx))
        sparse_bytes = 2 * batch * kv_heads * budget * dim * 2
        configs = [(64, 1, 4)] if args.quick else (
            [(c, p_, 4) for c in (32, 64, 128) for p_ in (1, 2, 4) if budget % (c * p_) == 0]
            + [(64, 1, 2), (32, 2, 2), (64, 1, 8), (128, 1, 8)])
        for chunk, per_program, warps in configs:
            def sparse(q_, k_, v_, i_, chunk=chunk, per_program=per_program, warps=warps):
                return merge_partials(sparse_history_partials(q_, k_, v_, i_, chunk=chunk, chunks_per_program=per_program,
                                                              num_warps=warps, interpret=interpret), axis=2)
            timed(p + f"sparse_c{chunk}_p{per_program}_w{warps}", sparse, (q, k, v, idx),
                  check=lambda out: rel(normalize(out), sparse_ref), moved=sparse_bytes,
                  rolled=(chunk, per_program, warps) == (64, 1, 4))
        # kernel alone (no merge): the merge's share
        timed(p + "sparse_c64_p1_w4_nomerge", lambda q_, k_, v_, i_: sparse_history_partials(
            q_, k_, v_, i_, chunk=64, chunks_per_program=1, interpret=interpret), (q, k, v, idx), moved=sparse_bytes)
        timed(p + "sparse_xla_gather", lambda q_, k_, v_, i_: sparse_history_reference(q_, k_, v_, i_),
              (q, k, v, idx), moved=sparse_bytes)
        # the whole sparse verification attention of a layer (history + causal new tokens):
        # one fused launch vs partials + the new-token part + the merge in XLA (as the model does now)
        kn = jax.random.normal(keys[5], (batch, kv_heads, steps, dim), jnp.bfloat16)
        vn = jax.random.normal(keys[4], (batch, kv_heads, steps, dim), jnp.bfloat16)
        causal = (jnp.arange(steps)[None, :] <= (jnp.arange(rows) % steps)[:, None])[None, None]

        def unfused(q_, k_, v_, i_):
            history = merge_partials(sparse_history_partials(q_, k_, v_, i_, interpret=interpret), axis=2)
            scores = jnp.einsum("bhmd,bhud->bhmu", q_, kn, preferred_element_type=jnp.float32)
            return normalize(merge_partials([history, partial_from_scores(scores, causal, vn)]))

        layer_ref = unfused(q, k, v, idx)
        timed(p + "layer_sparse_unfused", unfused, (q, k, v, idx), moved=sparse_bytes)
        timed(p + "layer_sparse_fused", lambda q_, k_, v_, i_: sparse_attention_fused(
            q_, k_, v_, i_, kn, vn, steps=steps, interpret=interpret), (q, k, v, idx),
            check=lambda out: rel(out[:, :, :groups * steps], layer_ref[:, :, :groups * steps]), moved=sparse_bytes)

        # selection: SRH scoring (4 heads, 1 row: the target signal; 4 heads x 4 rows: a draft signal)
        for label, srh_groups, srh_rows in (("4groups_r1", (0, 1, 2, 3), 1), ("1group_r1", (0, 0, 0, 0), 1),
                                            ("4groups_r4", (0, 1, 2, 3), 4)):
            srh_groups = tuple(g % kv_heads for g in srh_groups)
            sq = (0.1 * jax.random.normal(keys[4], (batch, 4, srh_rows, dim))).astype(jnp.float32)
            ref = srh_scores(sq, k, lengths, srh_groups)
            moved = batch * len(set(srh_groups)) * context * dim * 2
            timed(p + f"scoring_xla_{label}", lambda sq_, k_, l_, g=srh_groups: srh_scores(sq_, k_, l_, g),
                  (sq, k, lengths), check=lambda out: rel(out, ref), moved=moved)
            for block, warps in ([(128, 4)] if args.quick else [(128, 4), (256, 8), (512, 8)]):
                timed(p + f"scoring_pallas_{label}_b{block}_w{warps}",
                      lambda sq_, k_, l_, g=srh_groups, block=block, warps=warps: srh_scores_pallas(
                          sq_, k_, l_, g, block_s=block, num_warps=warps, interpret=interpret),
                      (sq, k, lengths), check=lambda out: rel(out, ref), moved=moved)
        scores = srh_scores(jax.random.normal(keys[5], (batch, 4, 1, dim)) * 0.1, k, lengths,
                            tuple(g % kv_heads for g in (0, 1, 2, 3)))
        base = select_top_k(scores, lengths, k=budget, sinks=4, window=64)
        for bits, hist in ((8, "scatter"), (8, "compare"), (4, "compare"), (16, "scatter"), (4, "pallas")):
            if args.quick and bits != 8:
                continue
            timed(p + f"topk_radix{bits}_{hist}",
                  lambda s_, l_, bits=bits, hist=hist: select_top_k(s_, l_, k=budget, sinks=4, window=64, bits=bits,
                                                                    histogram=hist).astype(jnp.float32),
                  (scores, lengths),
                  check=lambda out: jnp.mean((out != base.astype(jnp.float32)).astype(jnp.float32)))
        timed(p + "topk_lax", lambda s_, l_: jax.lax.top_k(s_, budget)[1].astype(jnp.float32), (scores, lengths))
        del q, k, v
    print(json.dumps(writer.data["cases"], indent=1)[:200])


if __name__ == "__main__":
    main()
