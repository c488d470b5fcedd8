"""``generate`` (decode prompts with any method) and ``demo`` (what the library is for, on CPU).

``generate --method NAME``: ``ar`` (autoregressive), ``sd`` (speculative with ``--draft`` or a
self-draft ``--draft-skip``), and every method registered in :mod:`experiments.registry` (the
KnapSpec family in :mod:`experiments.knapspec.self_spec`, the Dustin family in
:mod:`experiments.dustin_quality`). Options are checked before any model loads; an option the
chosen method does not read is refused, not ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any, Dict, List

from jaxspec.config import ATTENTION_BACKENDS
from experiments import registry
from experiments.common import (DEFAULT_MODEL, DEMO_PROMPT_FILE, CompileCounter, ResultWriter,
                                check_fused_projections, check_skip_ranges, config_of, encode_prompt, fused_if_asked,
                                load_model_timed, print_table, progress_line, read_prompts, stop_tokens)

DEFAULT_GAMMA = 4
IDENTITY_NOTE = ("greedy speculative output equals autoregressive output in float32; in bfloat16, verifying "
                 "several rows at once can round differently from one-row decoding, so a few tokens may differ")
#: methods whose verification reads a budget of the history: with k below the context the target's own
#: choice of token can change, so their output is compared with AR rather than expected to equal it
SPARSE_VERIFY_METHODS = frozenset({"dustin", "streaming", "snapkv", "quest", "knapspec-dustin"})
SPARSE_IDENTITY_NOTE = ("the verification attends to k positions of the history, so where k is below the context the "
                        "target's own tokens can differ from dense autoregressive decoding; with k >= the context "
                        "greedy output equals it in float32")
#: flag spelling of the options plain speculative decoding reads
SPECULATIVE_FLAGS = {"draft": "--draft", "draft_skip": "--draft-skip", "gamma": "--gamma", "profile": "--profile",
                     "fixed_tau": "--fixed-tau"}


def default_dtype() -> str:
    """float32 on CPU (there it is faster, and greedy speculative == AR holds), bfloat16 elsewhere."""
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


# ---------------------------------------------------------------------------- generate
def add_generate_args(parser: argparse.ArgumentParser) -> None:
    methods = registry.method_names()
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name, .gguf file, HF folder or orbax folder")
    parser.add_argument("--prompt", help="prompt text")
    parser.add_argument("--prompt-file", help="file whose whole text is the prompt")
    parser.add_argument("--batch-file", help="JSONL ({\"prompt\": ...} per line) or JSON list: one row per prompt")
    parser.add_argument("--batch", type=int, default=1, help="replicate a single prompt into this many rows")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--method", default="ar", choices=methods,
                        help="ar = autoregressive, sd = speculative; knapspec, clasp, static-skip, knapspec-budget = layer-skipping "
                             "self-speculation (KnapSpec and its baselines); knapspec-dustin = KnapSpec plans with "
                             "Dustin verification (--budget K); dustin, streaming, snapkv, quest, "
                             "magicdec = sparse attention with --budget K (Dustin and its baselines)")
    parser.add_argument("--draft", help="sd: draft model source (same tokenizer as --model)")
    parser.add_argument("--draft-skip", help="sd: self-draft skipping sub-layers, e.g. 'mlp:odd' or 'attn:4-9;mlp:12'")
    parser.add_argument("--gamma", type=int, default=None, help=f"sd: draft tokens per round (default {DEFAULT_GAMMA})")
    parser.add_argument("--compare-ar", action="store_true",
                        help="speculative methods: also run autoregressive decoding, same prompts (speed-up, "
                             "identical_to_ar)")
    parser.add_argument("--profile", action="store_true", help="sd: measure the draft/verify/other split")
    parser.add_argument("--fixed-tau", type=float, default=None,
                        help="sd: systems benchmark — accept a fixed-distribution number of tokens per round "
                             "with this mean tokens/round in [1, gamma + 1] (outputs are labelled; tokens are not "
                             "the model's)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="default: float32 on CPU (faster there, and greedy speculative output equals AR), "
                             "bfloat16 on accelerators")
    parser.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    parser.add_argument("--no-warmup", action="store_true", help="time the first (compiling) run")
    parser.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
                        help="history attention of the model (and of a separate draft): XLA reference or our "
                             "Pallas kernels (pallas needs a GPU, pallas-tpu a TPU; the -interpret variants run "
                             "them slowly on a CPU); auto: pallas-tpu on a TPU, xla elsewhere")
    parser.add_argument("--fused-projections", action="store_true",
                        help="the model's (and a separate draft's) q/k/v and gate/up as one matrix each: three "
                             "fewer products per layer, the same numbers (docs/methods.md §2, fused projections; one "
                             "device)")
    for add_arguments in registry.METHOD_ARGUMENTS.values():
        add_arguments(parser)


def generate_defaults() -> Dict[str, Any]:
    """Every ``generate`` option at its default (the demo starts from these)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_generate_args(parser)
    return vars(parser.parse_args([]))


def describe_method(args) -> str:
    if args.method == "sd":
        draft = f"draft {args.draft}" if args.draft else f"self-draft skipping {args.draft_skip}"
        return f"speculative, {draft}, gamma {args.gamma}"
    return f"--method {args.method}"


def check_generate_args(args) -> None:
    """Every check that needs no model, before anything loads (fills the dtype and gamma defaults)."""
    from jaxspec.decoding.sampling import SamplingConfig

    SamplingConfig(temperature=args.temperature, top_p=args.top_p)  # validates
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens}: must be >= 1")
    if args.batch < 1:
        raise ValueError(f"--batch={args.batch}: must be >= 1 (rows of the replicated prompt)")
    method = args.method
    if method not in registry.method_names():
        raise ValueError(f"unknown --method {method!r}; valid: {', '.join(registry.method_names())}")
    registered = registry.METHODS.get(method)
    takes = set(SPECULATIVE_FLAGS) if method == "sd" else (set(registered.takes) if registered else set())
    given = {"draft": args.draft is not None, "draft_skip": args.draft_skip is not None,
             "gamma": args.gamma is not None, "profile": args.profile, "fixed_tau": args.fixed_tau is not None}
    for option, flag in SPECULATIVE_FLAGS.items():
        if given[option] and option not in takes:
            users = ["sd"] + [m.name for m in registry.METHODS.values() if option in m.takes]
            raise ValueError(f"{flag} is an option of --method {' / '.join(users)}; --method {method} does not take it")
    check_fused_projections(args)
    if args.compare_ar and method == "ar":
        raise ValueError("--compare-ar compares a speculative method with autoregressive decoding; --method ar is "
                         "autoregressive already")
    for family in registry.METHOD_ARGUMENTS:
        if registered is not None and (registered.family == family or family in registered.also):
            continue
        for dest, default in registry.family_defaults(family).items():
            if getattr(args, dest) != default:
                users = ([m.name for m in registry.METHODS.values() if m.family == family]  # its own, then
                         + [m.name for m in registry.METHODS.values() if family in m.also])  # those borrowing it
                raise ValueError(f"--{dest.replace('_', '-')} is an option of --method {' / '.join(users)}; "
                                 f"--method {method} does not take it")
    if "gamma" in takes:
        if args.gamma is None:  # the default, no longer than the generation
            args.gamma = min(DEFAULT_GAMMA, args.max_new_tokens)
        if args.gamma < 1:
            raise ValueError(f"--gamma={args.gamma}: must be >= 1")
        if args.gamma > args.max_new_tokens:
            raise ValueError(f"--gamma={args.gamma} exceeds --max-new-tokens={args.max_new_tokens}: a round would "
                             f"draft more tokens than are generated; use --gamma <= {args.max_new_tokens}")
        if args.fixed_tau is not None and not 1.0 <= args.fixed_tau <= args.gamma + 1:
            raise ValueError(f"--fixed-tau={args.fixed_tau}: must lie in [1, gamma + 1 = {args.gamma + 1}] "
                             f"(mean tokens committed per round)")
    if args.draft_skip is not None:
        check_skip_ranges(args.draft_skip, "--draft-skip")
    if method == "sd" and (args.draft is None) == (args.draft_skip is None):
        raise ValueError("--method sd needs exactly one of --draft SOURCE or --draft-skip SPEC")
    if registered is not None:
        registered.validate(args)
    if args.dtype is None:
        args.dtype = default_dtype()


@dataclasses.dataclass
class Prepared:
    """What ``generate`` has once the models are loaded and the prompts encoded."""

    model: Any
    draft: Any
    prompts: List[List[int]]
    sampling: Any
    stops: List[int]
    mesh: Any
    out: Dict[str, Any]


def prepare_generate(args) -> Prepared:
    """Check the options, read the prompts, load the model(s), encode and check the context."""
    from jaxspec.decoding.sampling import SamplingConfig

    check_generate_args(args)
    method = args.method
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p)
    texts = read_prompts(args)
    if args.batch > 1:
        if len(texts) > 1:
            raise ValueError(f"--batch={args.batch} replicates one prompt; --batch-file already gives {len(texts)} "
                             f"rows (drop --batch)")
        texts = texts * args.batch
    mesh = None
    if getattr(args, "mesh", None):
        from jaxspec.parallel import parse_mesh

        mesh = parse_mesh(args.mesh)  # checks data x tensor against the device count before loading
    from jaxspec.models.attention import get_backend

    backend = get_backend(getattr(args, "attention_backend", "auto")).name  # "auto" resolved on this platform
    model = load_model_timed(args.model, args.dtype, backend)
    if model.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer; generate needs one to encode prompts")
    draft = None
    if method == "sd" and args.draft:
        from jaxspec.decoding.speculative import check_compatible

        draft = load_model_timed(args.draft, args.dtype, backend)
        check_compatible(model.config, draft.config, model.tokenizer, draft.tokenizer)
    model.params, = fused_if_asked(args, model.params)  # --fused-projections: every method and AR on it
    if draft is not None:
        draft.params, = fused_if_asked(args, draft.params)
    prompts = [encode_prompt(model.tokenizer, t, chat=not args.no_chat) for t in texts]
    capacity_limit = model.config.max_position_embeddings
    longest = max(len(p) for p in prompts)
    reserve = registry.METHODS[method].reserve(args) if method in registry.METHODS else (
        args.gamma + 2 if method == "sd" else 0)
    if longest + args.max_new_tokens + reserve > capacity_limit:
        extra = f" + {reserve} slots of a speculative round" if reserve else ""
        raise ValueError(f"prompt of {longest} tokens + {args.max_new_tokens} new tokens{extra} exceeds the model's "
                         f"context {capacity_limit} (max_position_embeddings of {args.model}); shorten the prompt or "
                         f"--max-new-tokens")
    stops = stop_tokens(model.tokenizer)
    out: Dict[str, Any] = {"method": method, "model": model.source, "model_config": model.config.to_dict(),
                           "attention_backend": backend,
                           "prompt_tokens": [len(p) for p in prompts]}
    if mesh is not None:
        out["mesh"] = check_memory_plan(model, draft, mesh, len(prompts),
                                         longest + args.max_new_tokens + (args.gamma + 2 if method == "sd" else 0))
    return Prepared(model=model, draft=draft, prompts=prompts, sampling=sampling, stops=stops, mesh=mesh, out=out)


def decode_generate(args, prepared: Prepared) -> Dict[str, Any]:
    """Decode the prepared prompts with ``args.method`` (and AR with ``--compare-ar``)."""
    method = args.method
    model, draft, prompts, mesh, out = prepared.model, prepared.draft, prepared.prompts, prepared.mesh, prepared.out
    sampling, stops = prepared.sampling, prepared.stops
    ar_result = None
    if method == "ar" or args.compare_ar:
        progress_line(f"decoding: autoregressive, {len(prompts)} row(s) x {args.max_new_tokens} new tokens"
                      + ("" if args.no_warmup else " (a first run compiles, then the timed run)"))
        from jaxspec.decoding.autoregressive import generate

        ar_result = generate(model.params, model.config, prompts, args.max_new_tokens, sampling=sampling,
                             stop_tokens=stops, seed=args.seed, warmup=not args.no_warmup, mesh=mesh)
    if method != "ar":
        progress_line(f"decoding: {describe_method(args)}" + ("" if args.no_warmup else
                                                               " (a first run compiles, then the timed run)"))
    if method == "ar":
        result = ar_result
    elif method in registry.METHODS:
        result = registry.METHODS[method].run(args, model, prompts, sampling, stops, out)
    else:
        from jaxspec.decoding.policies import SelfDraft, SeparateDraft, describe_skip_mask, parse_skip_spec
        from jaxspec.decoding.speculative import EngineConfig, acceptance_from_tau, speculative_generate

        fixed = acceptance_from_tau(args.fixed_tau, args.gamma) if args.fixed_tau is not None else None
        engine = EngineConfig(gamma=args.gamma, sampling=sampling, max_new_tokens=args.max_new_tokens,
                              stop_tokens=tuple(stops), fixed_acceptance=fixed)
        if draft is not None:
            policy, draft_params, draft_state = SeparateDraft(draft.config), draft.params, None
            out["draft"] = {"source": draft.source, "config": draft.config.to_dict()}
        else:
            mask = parse_skip_spec(args.draft_skip, model.config.num_layers)
            policy = SelfDraft(model.config)
            draft_params, draft_state = None, policy.initial_state(mask)
            out["draft"] = {"self_draft_skip": args.draft_skip, "skipped": describe_skip_mask(mask)}
        result = speculative_generate(model.params, model.config, prompts, draft_policy=policy,
                                      draft_params=draft_params, draft_state=draft_state, engine=engine,
                                      seed=args.seed, warmup=not args.no_warmup, profile=args.profile, mesh=mesh)
    if method != "ar":  # fields every speculative method shares
        out["metrics"] = result.metrics
        out.setdefault("gamma", args.gamma)
        if ar_result is not None:
            out["ar_tokens_per_s"] = ar_result.tokens_per_s
            out["speedup_vs_ar"] = result.tokens_per_s / ar_result.tokens_per_s
            out["ar_timings"] = ar_result.timings
            out["identical_to_ar"] = result.rows() == ar_result.rows()
            out["identity_note"] = SPARSE_IDENTITY_NOTE if method in SPARSE_VERIFY_METHODS else IDENTITY_NOTE
    rows = result.rows()
    out.update({
        "tokens": rows,
        "text": [model.tokenizer.decode(r, skip_special_tokens=True) for r in rows],
        "num_generated": result.num_generated.tolist(),
        "tokens_per_s": result.tokens_per_s,
        "timings": result.timings,
    })
    return out




def run_generate(args) -> Dict[str, Any]:
    return decode_generate(args, prepare_generate(args))


def check_memory_plan(model, draft, mesh, batch: int, capacity: int) -> Dict[str, Any]:
    """Per-device bytes of weights and caches on ``mesh``; raises before any cache is allocated if
    they exceed the device memory (where the backend reports it)."""
    from jaxspec.models.memory import device_memory_bytes, plan_memory
    from jaxspec.parallel import mesh_shape

    plan = plan_memory(model.config, context=capacity, batch=batch, mesh=mesh,
                       draft_config=draft.config if draft is not None else None)
    device_bytes = device_memory_bytes(mesh.devices.flat[0])
    print(plan.describe() + (f"; device memory {device_bytes / 2**30:.2f} GiB" if device_bytes else ""),
          file=sys.stderr)
    if device_bytes:
        plan.check(device_bytes)
    return {"shape": mesh_shape(mesh), "memory_plan": plan.as_dict(), "device_bytes": device_bytes}


def report_generate(out: Dict[str, Any]) -> None:
    for i, text in enumerate(out["text"]):
        print(f"--- row {i} ({out['prompt_tokens'][i]} prompt tokens, {out['num_generated'][i]} generated)")
        print(text)
    t = out["timings"]
    row = {"method": out["method"], "rows": len(out["tokens"]), "prefill_s": t["prefill_s"], "decode_s": t["decode_s"],
           "tokens_per_s": out["tokens_per_s"], "compile_s": t.get("compile_s", float("nan"))}
    if "metrics" in out:
        m = out["metrics"]
        row.update(gamma=out["gamma"], tau=m["tau"], acceptance=m["acceptance_rate"], rounds=m["rounds"])
        if "speedup_vs_ar" in out:
            row.update(ar_tokens_per_s=out["ar_tokens_per_s"], speedup=out["speedup_vs_ar"],
                       identical_to_ar=out["identical_to_ar"])
        if "profile_draft_s" in t:
            total = t["profile_draft_s"] + t["profile_verify_s"] + t["profile_other_s"]
            row.update(draft_frac=t["profile_draft_s"] / total, verify_frac=t["profile_verify_s"] / total,
                       other_frac=t["profile_other_s"] / total)
        if m["fixed_acceptance"] is not None:
            print("NOTE: fixed-acceptance mode — acceptance is drawn from a fixed distribution; tokens are not the "
                  "model's output and only the timing is meaningful")
    if out["method"] in registry.METHODS:
        registry.METHODS[out["method"]].report(out, row)
    print_table([row])
    if "identical_to_ar" in out:
        print(("output identical to autoregressive decoding" if out["identical_to_ar"] else
               "output DIFFERS from autoregressive decoding") + f" ({out['identity_note']})")


def cmd_generate(args) -> Dict[str, Any]:
    check_generate_args(args)  # before the writer: its config holds the filled-in defaults
    writer = ResultWriter(args.out, "generate", config_of(args))
    if writer.previous.get("results"):
        print(f"[resume] {args.out} already holds this run; delete it to run again", file=sys.stderr)
        report_generate(writer.previous["results"])
        return writer.previous["results"]
    out = run_generate(args)
    writer.set("results", out)
    report_generate(out)
    return out


# ---------------------------------------------------------------------------- prompt lookup
def add_prompt_lookup_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prompt-lookup (n-gram drafts from the row's own tokens, no draft model)")
    group.add_argument("--ngram-max", type=int, default=3, help="longest n-gram matched against earlier tokens")
    group.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram tried before drafting nothing")
    group.add_argument("--full-verify", action="store_true",
                       help="verify gamma + 1 rows every round, also when no n-gram matched (default: such a round "
                            "verifies the pending token alone, docs/methods.md §5.8)")


def validate_prompt_lookup(args) -> None:
    if not 1 <= args.ngram_min <= args.ngram_max:
        raise ValueError(f"--ngram-min={args.ngram_min} / --ngram-max={args.ngram_max}: need 1 <= ngram-min <= "
                         f"ngram-max")


def run_prompt_lookup(args, model, prompts, sampling, stops, out):
    """``generate --method prompt-lookup``: :class:`~jaxspec.baselines.prompt_lookup.PromptLookupDraft`
    in the speculative engine (docs/extending.md)."""
    from jaxspec.baselines.prompt_lookup import PromptLookupDraft
    from jaxspec.decoding.speculative import EngineConfig, speculative_generate

    engine = EngineConfig(gamma=args.gamma, sampling=sampling, max_new_tokens=args.max_new_tokens,
                          stop_tokens=tuple(stops), short_verify=not vars(args).get("full_verify"))
    policy = PromptLookupDraft(vocab_size=model.config.vocab_size, max_ngram=args.ngram_max, min_ngram=args.ngram_min)
    out["draft"] = {"prompt_lookup": {"max_ngram": args.ngram_max, "min_ngram": args.ngram_min,
                                      "short_verify": engine.short_verify}}
    return speculative_generate(model.params, model.config, prompts, draft_policy=policy, engine=engine,
                                seed=args.seed, warmup=not args.no_warmup, profile=args.profile)


registry.register_method(registry.Method(name="prompt-lookup", run=run_prompt_lookup, family="prompt-lookup",
                                         validate=validate_prompt_lookup, takes=frozenset({"gamma", "profile"})))
registry.register_method_arguments("prompt-lookup", add_prompt_lookup_args)


# ---------------------------------------------------------------------------- demo
#: the speculative methods the demo can put next to plain decoding: name -> generate options
DEMO_METHODS: Dict[str, Dict[str, Any]] = {
    # the target drafting for itself with three MLP sub-layers skipped (SelfDraft, docs/methods.md §2)
    "self-draft": {"method": "sd", "draft_skip": "mlp:10-12", "gamma": 4},
    # KnapSpec chooses the skip set and gamma from a latency model (docs/methods.md §4)
    "knapspec": {"method": "knapspec"},
    # prompt lookup: drafts by matching the last n-gram against the row's earlier tokens (no draft model). One
    # draft token a round: on a 2-core CPU each verified row costs a share of a float32 step, and gamma 1 paid
    # most in the demo's gamma sweep (cpu-demo steps gamma-1 .. gamma-4, docs/results.md)
    "prompt-lookup": {"method": "prompt-lookup", "gamma": 1},
}
#: the demo's method: the one measured to pay on a small CPU (see the report of `demo`)
DEMO_METHOD = "prompt-lookup"


def demo_args(args) -> argparse.Namespace:
    """The ``generate`` options the demo runs: the defaults, the demo's prompt and model, greedy,
    the chosen speculative method with ``--compare-ar``."""
    if args.demo_method not in DEMO_METHODS:
        raise ValueError(f"--demo-method {args.demo_method!r}: valid: {', '.join(DEMO_METHODS)}")
    choice = DEMO_METHODS[args.demo_method]
    if choice["method"] not in registry.method_names():
        raise ValueError(f"--demo-method {args.demo_method}: the method {choice['method']!r} is not available in "
                         f"this tree (registered methods: {', '.join(registry.method_names())})")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens}: must be >= 1")
    gamma = vars(args).get("gamma")
    if gamma is not None and "gamma" not in choice:
        raise ValueError(f"--gamma={gamma}: the {args.demo_method} demo chooses its draft length itself; --gamma "
                         f"applies to --demo-method {' | '.join(m for m, c in DEMO_METHODS.items() if 'gamma' in c)}")
    if gamma is not None:
        choice = dict(choice, gamma=gamma)
    if vars(args).get("full_verify"):
        if choice["method"] != "prompt-lookup":
            raise ValueError(f"--full-verify: only prompt lookup drafts nothing in some rounds; the "
                             f"{args.demo_method} demo always verifies gamma + 1 rows")
        choice = dict(choice, full_verify=True)
    values = generate_defaults()
    values.update(model=args.model, prompt_file=args.prompt_file or str(DEMO_PROMPT_FILE),
                  max_new_tokens=args.max_new_tokens, dtype=args.dtype, no_warmup=args.no_warmup,
                  compare_ar=True, **choice)
    if vars(args).get("mesh"):
        values["mesh"] = args.mesh
    return argparse.Namespace(**values)


def first_token_time(prepared: Prepared, args) -> Dict[str, float]:
    """Seconds from the first prefill call to the first new token (compile included: a fresh
    process pays it unless the compilation cache holds the program), then a second, compiled call."""
    import jax
    import numpy as np

    from jaxspec.decoding.autoregressive import pad_prompts, prefill
    from jaxspec.models.cache import init_cache

    model = prepared.model
    tokens, lengths = pad_prompts(prepared.prompts)
    capacity = int(lengths.max()) + args.max_new_tokens  # generate()'s own capacity: the same compiled prefill
    times = []
    for _ in range(2):
        start = time.perf_counter()
        cache = init_cache(model.config, len(prepared.prompts), capacity)
        _, logits = prefill(model.params, model.config, tokens, lengths, cache, None)
        first = int(np.asarray(jax.numpy.argmax(logits[0])))
        times.append(time.perf_counter() - start)
    return {"ttft_s": times[0], "ttft_compiled_s": times[1], "first_token": first}


def cmd_demo(args) -> Dict[str, Any]:
    run_args = demo_args(args)
    check_generate_args(run_args)
    writer = ResultWriter(args.out, "demo", config_of(args))
    if writer.previous.get("results"):
        print(f"[resume] {args.out} already holds this demo; delete it (or pass another --out) to run it again",
              file=sys.stderr)
        report_generate(writer.previous["results"])
        report_demo(writer.previous["results"])
        return writer.previous["results"]
    counter = CompileCounter()
    import jax

    # the folder experiments.run set (None: the cache is off)
    cache = None if args.no_compilation_cache else (jax.config.jax_compilation_cache_dir or None)
    demo_start = time.perf_counter()
    prepared = prepare_generate(run_args)
    prompt_tokens = len(prepared.prompts[0])
    progress_line(f"compiling and running the prefill of {prompt_tokens} prompt tokens (a first run compiles; "
                  + (f"the compilation cache {cache} keeps it for the next run)" if cache else
                     "the compilation cache is off)"))
    ttft = first_token_time(prepared, run_args)
    progress_line(f"prefill: first token after {ttft['ttft_s']:.2f} s ({ttft['ttft_compiled_s']:.2f} s once compiled)",
                  done=True)
    out = decode_generate(run_args, prepared)
    # the options as run (--gamma and --full-verify applied to the demo method's own)
    options = {key: getattr(run_args, key) for key in DEMO_METHODS[args.demo_method]}
    if vars(args).get("full_verify"):
        options["full_verify"] = True
    out["demo"] = {"demo_method": args.demo_method, "generate_options": options,
                   "time_to_first_token_s": ttft["ttft_s"], "time_to_first_token_compiled_s": ttft["ttft_compiled_s"],
                   "wall_s": time.perf_counter() - demo_start, "compilation_cache": str(cache) if cache else None,
                   "compilation_cache_emptied": bool(cache and args.empty_compilation_cache), "compiles": counter.counts()}
    writer.set("results", out)
    print(f"\nprompt: {run_args.prompt_file} ({prompt_tokens} tokens)\n")
    report_generate(out)
    report_demo(out)
    return out


def report_demo(out: Dict[str, Any]) -> None:
    d = out["demo"]
    name = d["demo_method"]
    speedup = out["speedup_vs_ar"]
    print_table([{"method": "autoregressive", "tokens_per_s": out["ar_tokens_per_s"], "speed-up": 1.0,
                  "identical": "-"},
                 {"method": f"{name} ({describe_options(d['generate_options'])})", "tokens_per_s": out["tokens_per_s"],
                  "speed-up": speedup, "identical": out["identical_to_ar"]}],
                title="demo: plain decoding vs speculative decoding, same prompt, greedy")
    if speedup > 1:
        print(f"{name} pays on this machine: {speedup:.2f}x the autoregressive tokens/s, "
              f"{'identical' if out['identical_to_ar'] else 'NOT identical'} output")
    else:
        m = out["metrics"]
        print(f"{name} does NOT pay on this machine: {speedup:.2f}x the autoregressive tokens/s (tau "
              f"{m['tau']:.2f} tokens per round of up to {out['gamma']} draft steps and one verification; a round "
              f"costs more than tau plain steps here)")
    compiles = d["compiles"]
    print(f"time to first token: {d['time_to_first_token_s']:.2f} s (compile + prefill; "
          f"{d['time_to_first_token_compiled_s']:.2f} s once compiled); compilation cache "
          f"{d['compilation_cache'] or 'off'}: {compiles['cache_hits']} programs loaded, "
          f"{compiles['cache_misses']} compiled")


def describe_options(options: Dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items())


def register(subparsers) -> None:
    demo = subparsers.add_parser("demo", help="embedded SmolLM2 on a long prompt: plain vs speculative decoding, "
                                              "tokens/s, speed-up, identical output, time to first token")
    demo.add_argument("--model", default=DEFAULT_MODEL)
    demo.add_argument("--prompt-file", default=None, help=f"default: {DEMO_PROMPT_FILE.name}")
    demo.add_argument("--max-new-tokens", type=int, default=96)
    demo.add_argument("--demo-method", default=DEMO_METHOD, choices=list(DEMO_METHODS),
                      help=f"the speculative method next to plain decoding (default {DEMO_METHOD})")
    demo.add_argument("--gamma", type=int, default=None,
                      help="draft tokens per round (default: the demo method's own, " + ", ".join(
                          f"{m} {c['gamma']}" for m, c in DEMO_METHODS.items() if "gamma" in c) + ")")
    demo.add_argument("--full-verify", action="store_true",
                      help="prompt lookup: verify gamma + 1 rows also in rounds without a match (default: the "
                           "pending token alone there)")
    demo.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"],
                      help="float32 is faster than bfloat16 on CPU, and keeps greedy speculative == AR")
    demo.add_argument("--no-warmup", action="store_true")
    demo.set_defaults(func=cmd_demo)

    gen = subparsers.add_parser("generate", help="decode with a method; JSON fields tokens, tokens_per_s")
    add_generate_args(gen)
    gen.set_defaults(func=cmd_generate)
    cmd_generate.supports_mesh = True
    cmd_demo.supports_mesh = True
