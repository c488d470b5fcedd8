"""Speculative-decoding systems benchmark at paper shapes: ``bench-sd``.

Random weights, caches filled with random K/V up to the context (a prefill of random weights
measures nothing useful), and **fixed-acceptance mode**: each round accepts a number of draft
tokens drawn from the distribution whose mean tokens/round is ``--tau`` (taken from a real
run, e.g. SmolLM2's self-draft, via ``--tau-from``). Every row of the output says so.
Autoregressive decoding runs in the same process on the same cache buffers, so the speed-up is
measured side by side.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict

import numpy as np

from experiments.common import ResultWriter, median_time, print_table
from experiments.foundation import _config_of, copy_bandwidth, decode_bytes_per_step


def _tau(args) -> Dict[str, Any]:
    if args.tau_from:
        data = json.loads(open(args.tau_from).read())
        results = data.get("results", data)
        return {"tau": float(results["metrics"]["tau"]), "source": args.tau_from,
                "measured_with": {k: results.get(k) for k in ("model", "draft", "gamma")}}
    if args.tau is None:
        raise ValueError("give --tau T or --tau-from FILE (a generate --method sd JSON)")
    return {"tau": float(args.tau), "source": "--tau"}


def fixed_acceptance_writer(args, experiment: str):
    """The results file of a fixed-acceptance benchmark: ``(writer, tau record, copy bandwidth B/s)``,
    the acceptance mode and the measured copy bandwidth recorded once (kept on resume)."""
    tau = _tau(args)
    writer = ResultWriter(args.out, experiment, _config_of(args))
    writer.set("acceptance", {**tau, "mode": "fixed acceptance (systems benchmark, random weights): accepted "
                                             "counts drawn from the distribution with this mean tokens/round"})
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
    for context in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
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
    bench = subparsers.add_parser("bench-sd", help="speculative vs autoregressive decoding at paper shapes "
                                                   "(random weights, fixed acceptance)")
    bench.add_argument("--target-shape", default="qwen2.5-7b-shape")
    bench.add_argument("--draft-shape", default="qwen2.5-0.5b-shape")
    bench.add_argument("--draft-skip", default=None, help="use a self-draft of the target with this skip spec")
    bench.add_argument("--contexts", default="8192,16384,32768")
    bench.add_argument("--batches", default="8,16")
    bench.add_argument("--gamma", type=int, default=4)
    bench.add_argument("--tau", type=float, default=None, help="mean tokens per round of the fixed acceptance")
    bench.add_argument("--tau-from", default=None, help="take tau from a generate --method sd JSON")
    bench.add_argument("--new-tokens", type=int, default=64)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--profile", action="store_true", help="also measure the draft/verify/other split")
    bench.add_argument("--attention-backend", default="xla", choices=["xla", "pallas", "pallas-interpret"],
                       help="history attention of both models")
    bench.add_argument("--copy-gib", type=float, default=4.0)
    bench.set_defaults(func=cmd_bench_sd)
