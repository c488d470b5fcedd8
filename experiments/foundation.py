"""Foundation experiments: ``demo``, ``parity``, ``generate`` and ``bench-decode``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from typing import Any, Dict, List

import numpy as np

from experiments import dustin_exp, self_spec
from experiments.common import REPO, ResultWriter, median_time, print_table

DEFAULT_MODEL = "smollm2-135m"
#: ``generate --method NAME`` beyond ar/sd: NAME -> runner(args, model, prompts, sampling, stops, out) returning a
#: result with rows(), num_generated, tokens_per_s, timings and metrics (it fills ``out`` with its own fields; an
#: optional ``runner.validate(args)`` runs before loading). A new method: one entry here, its options in
#: add_generate_args.
METHOD_RUNNERS = dict(self_spec.METHOD_RUNNERS)
METHOD_RUNNERS.update(dustin_exp.METHOD_RUNNERS)
DEMO_PROMPT_FILE = REPO / "experiments" / "prompts" / "long_demo.txt"


# ---------------------------------------------------------------------------- helpers
def _load(source: str, dtype: str, attention_backend: str = "xla"):
    from jaxspec.models.loading import load_model
    from jaxspec.models.params import num_params

    start = time.perf_counter()
    model = load_model(source, dtype=dtype)
    if attention_backend != model.config.attention_backend:
        model = dataclasses.replace(model, config=dataclasses.replace(model.config,
                                                                      attention_backend=attention_backend))
    print(f"loaded {source} ({model.config.num_layers} layers, {num_params(model.config) / 1e6:.1f} M params, "
          f"{dtype}) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return model


def _encode(tokenizer, text: str, chat: bool) -> List[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(text)["input_ids"])


def _stop_tokens(tokenizer) -> List[int]:
    stops = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        if tokenizer is not None and name in tokenizer.get_vocab():
            stops.add(int(tokenizer.convert_tokens_to_ids(name)))
    return sorted(stops)


def read_prompts(args) -> List[str]:
    """``--prompt``, ``--prompt-file`` or ``--batch-file`` (JSONL with "prompt", or a JSON list of strings)."""
    if args.batch_file:
        path = pathlib.Path(args.batch_file)
        text = path.read_text()
        try:
            data = json.loads(text)
            prompts = [p if isinstance(p, str) else p["prompt"] for p in data]
        except json.JSONDecodeError:
            prompts = []
            for number, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: not JSON ({err}); --batch-file takes JSONL lines "
                                     f'{{"prompt": "..."}} or a JSON list of strings') from err
                prompts.append(item if isinstance(item, str) else item["prompt"])
        if not prompts:
            raise ValueError(f"{path}: no prompts found")
        return prompts
    if args.prompt_file:
        return [pathlib.Path(args.prompt_file).read_text()]
    if args.prompt:
        return [args.prompt]
    raise ValueError("give --prompt TEXT, --prompt-file F or --batch-file F")


# ---------------------------------------------------------------------------- generate
def add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name, .gguf file, HF folder or orbax folder")
    parser.add_argument("--prompt", help="prompt text")
    parser.add_argument("--prompt-file", help="file whose whole text is the prompt")
    parser.add_argument("--batch-file", help="JSONL ({\"prompt\": ...} per line) or JSON list: one row per prompt")
    parser.add_argument("--batch", type=int, default=1, help="replicate a single prompt into this many rows")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--method", default="ar", choices=["ar", "sd", *METHOD_RUNNERS],
                        help="ar = autoregressive, sd = speculative; knapspec, clasp, static-skip = layer-skipping "
                             "self-speculation (KnapSpec and its baselines); dustin, streaming, snapkv, quest, "
                             "magicdec = sparse attention with --budget K (Dustin and its baselines)")
    parser.add_argument("--draft", help="sd: draft model source (same tokenizer as --model)")
    parser.add_argument("--draft-skip", help="sd: self-draft skipping sub-layers, e.g. 'mlp:odd' or 'attn:4-9;mlp:12'")
    parser.add_argument("--gamma", type=int, default=4, help="sd: draft tokens per round")
    parser.add_argument("--compare-ar", action="store_true", help="sd: also run autoregressive decoding, same prompts")
    parser.add_argument("--profile", action="store_true", help="sd: measure the draft/verify/other split")
    parser.add_argument("--fixed-tau", type=float, default=None,
                        help="sd: systems benchmark — accept a fixed-distribution number of tokens per round "
                             "with this mean tokens/round (outputs are labelled; tokens are not the model's)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    parser.add_argument("--no-warmup", action="store_true", help="time the first (compiling) run")
    parser.add_argument("--attention-backend", default="xla", choices=["xla", "pallas", "pallas-interpret"],
                        help="history attention of the model (and of a separate draft): XLA reference or our "
                             "Pallas kernels (pallas needs a GPU; pallas-interpret runs them slowly anywhere)")
    self_spec.add_self_spec_args(parser)
    dustin_exp.add_dustin_args(parser)


def run_generate(args) -> Dict[str, Any]:
    from jaxspec.decoding.sampling import SamplingConfig

    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p)  # validates before loading
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    method = getattr(args, "method", "ar")
    if method == "sd":
        if bool(getattr(args, "draft", None)) == bool(getattr(args, "draft_skip", None)):
            raise ValueError("--method sd needs exactly one of --draft SOURCE or --draft-skip SPEC")
        if args.gamma < 1:
            raise ValueError(f"--gamma={args.gamma} must be >= 1")
    if hasattr(METHOD_RUNNERS.get(method), "validate"):
        METHOD_RUNNERS[method].validate(args)
    texts = read_prompts(args)
    if len(texts) == 1 and args.batch > 1:
        texts = texts * args.batch
    mesh = None
    if getattr(args, "mesh", None):
        from jaxspec.parallel import parse_mesh

        mesh = parse_mesh(args.mesh)  # checks data x tensor against the device count before loading
    backend = getattr(args, "attention_backend", "xla")
    model = _load(args.model, args.dtype, backend)
    if model.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer; generate needs one to encode prompts")
    draft = None
    if method == "sd" and args.draft:
        from jaxspec.decoding.speculative import check_compatible

        draft = _load(args.draft, args.dtype, backend)
        check_compatible(model.config, draft.config, model.tokenizer, draft.tokenizer)
    prompts = [_encode(model.tokenizer, t, chat=not args.no_chat) for t in texts]
    capacity_limit = model.config.max_position_embeddings
    longest = max(len(p) for p in prompts)
    if longest + args.max_new_tokens > capacity_limit:
        raise ValueError(f"prompt of {longest} tokens + {args.max_new_tokens} new tokens exceeds the model's context "
                         f"{capacity_limit} (max_position_embeddings of {args.model})")
    stops = _stop_tokens(model.tokenizer)
    out: Dict[str, Any] = {"method": method, "model": model.source, "model_config": model.config.to_dict(),
                           "attention_backend": backend,
                           "prompt_tokens": [len(p) for p in prompts]}
    if mesh is not None:
        out["mesh"] = _check_memory_plan(model, draft, mesh, len(prompts),
                                         longest + args.max_new_tokens + (args.gamma + 2 if method == "sd" else 0))
    ar_result = None
    if method == "ar" or getattr(args, "compare_ar", False):
        from jaxspec.decoding.autoregressive import generate

        ar_result = generate(model.params, model.config, prompts, args.max_new_tokens, sampling=sampling,
                             stop_tokens=stops, seed=args.seed, warmup=not args.no_warmup, mesh=mesh)
    if method == "ar":
        result = ar_result
    elif method in METHOD_RUNNERS:
        result = METHOD_RUNNERS[method](args, model, prompts, sampling, stops, out)
    else:
        from jaxspec.decoding.policies import SelfDraft, SeparateDraft, describe_skip_mask, parse_skip_spec
        from jaxspec.decoding.speculative import EngineConfig, acceptance_from_tau, speculative_generate

        fixed = acceptance_from_tau(args.fixed_tau, args.gamma) if args.fixed_tau else None
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
    rows = result.rows()
    out.update({
        "tokens": rows,
        "text": [model.tokenizer.decode(r, skip_special_tokens=True) for r in rows],
        "num_generated": result.num_generated.tolist(),
        "tokens_per_s": result.tokens_per_s,
        "timings": result.timings,
    })
    return out


def _check_memory_plan(model, draft, mesh, batch: int, capacity: int) -> Dict[str, Any]:
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
    if "knapspec" in out:
        k = out["knapspec"]
        row.update(plan_frac=k["plan_fraction_of_decode"], ar_tokens=k["ar_tokens"])
        if k["plan_history"]:
            print_table(self_spec.plan_table_rows(out), title=f"{k['planner']} plans")
    print_table([row])


def cmd_generate(args) -> Dict[str, Any]:
    writer = ResultWriter(args.out, "generate", _config_of(args), resume=False)
    out = run_generate(args)
    writer.set("results", out)
    report_generate(out)
    return out


# ---------------------------------------------------------------------------- demo
def cmd_demo(args) -> Dict[str, Any]:
    args.prompt_file = args.prompt_file or str(DEMO_PROMPT_FILE)
    args.prompt, args.batch_file, args.batch = None, None, 1
    args.method, args.temperature, args.top_p, args.seed = "ar", 0.0, 1.0, 0
    args.no_chat = False
    args.no_warmup = getattr(args, "no_warmup", False)
    writer = ResultWriter(args.out, "demo", _config_of(args), resume=False)
    out = run_generate(args)
    writer.set("results", out)
    print(f"\nprompt: {args.prompt_file} ({out['prompt_tokens'][0]} tokens)\n")
    report_generate(out)
    return out


# ---------------------------------------------------------------------------- parity
def _torch_reference(source: str, config):
    """A transformers model on the same weights as ``source`` (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxspec.models import registry

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = pathlib.Path(source)
    if source in registry.KNOWN_MODELS:
        path = registry.resolve_model_file(source)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    elif path.is_dir() and (path / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        raise ValueError(f"parity needs a transformers-readable source (registry name, .gguf, HF folder); got {source!r}")
    return model.to(device).eval()


def _random_pair(shape: str, layers: int, seed: int):
    """Random transformers model of a preset shape and our params on the same weights (float32)."""
    import jax
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from jaxspec.config import preset
    from jaxspec.models.loading import hf_config_dict, params_from_state_dict

    overrides = {"dtype": "float32"}
    if layers:
        overrides["num_layers"] = layers
    config = preset(shape, **overrides)
    hf = hf_config_dict(config)
    hf_config = AutoConfig.for_model(**hf)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(1.0)
    to_array = (lambda t: jax.dlpack.from_dlpack(t.detach().contiguous())) if device == "cuda" else (
        lambda t: t.detach().numpy())
    params = params_from_state_dict(model.state_dict().items(), config, to_array)
    return config, params, model


def cmd_parity(args) -> Dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import torch

    from jaxspec.models.cache import init_cache
    from jaxspec.models.llama import forward_jit

    jax.config.update("jax_default_matmul_precision", "highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    writer = ResultWriter(args.out, "parity", _config_of(args), resume=False)
    if args.model.startswith("random:"):
        config, params, reference = _random_pair(args.model.split(":", 1)[1], args.layers, args.seed)
        prompt = np.random.RandomState(args.seed).randint(0, config.vocab_size, args.prompt_tokens).tolist()
        source = args.model
    else:
        model = _load(args.model, "float32")
        config, params = model.config, model.params
        reference = _torch_reference(args.model, config)
        text = pathlib.Path(DEMO_PROMPT_FILE).read_text()
        prompt = list(model.tokenizer(text)["input_ids"])[: args.prompt_tokens]
        source = model.source
    device = next(reference.parameters()).device
    batch = np.asarray([prompt], np.int32)
    cache = init_cache(config, 1, len(prompt) + args.decode_steps + 8)
    ours = forward_jit(params, jnp.asarray(batch), cache, config=config)
    with torch.no_grad():
        ref = reference(torch.tensor(batch, device=device, dtype=torch.long), use_cache=True)
    past = ref.past_key_values
    ref_logits = ref.logits[0].float().cpu().numpy()
    our_logits = np.asarray(ours.logits[0])
    steps = [_rel_err(our_logits, ref_logits)]
    agree = [float(np.mean(our_logits.argmax(-1) == ref_logits.argmax(-1)))]
    cache = ours.cache
    token = int(ref_logits[-1].argmax())
    for _ in range(args.decode_steps):
        ours = forward_jit(params, jnp.asarray([[token]], jnp.int32), cache, config=config)
        cache = ours.cache
        with torch.no_grad():
            ref = reference(torch.tensor([[token]], device=device), past_key_values=past, use_cache=True)
        past = ref.past_key_values
        r = ref.logits[0, -1].float().cpu().numpy()
        o = np.asarray(ours.logits[0, -1])
        steps.append(_rel_err(o, r))
        agree.append(float(o.argmax() == r.argmax()))
        token = int(r.argmax())  # both models are fed the reference's greedy tokens
    out = {"model": source, "model_config": config.to_dict(), "prompt_tokens": len(prompt),
           "decode_steps": args.decode_steps, "prefill_rel_err": steps[0], "decode_rel_err": steps[1:],
           "max_rel_err": max(steps), "argmax_agreement_prefill": agree[0],
           "argmax_agreement_decode": float(np.mean(agree[1:])) if len(agree) > 1 else None,
           "reference": f"transformers {sys.modules['transformers'].__version__} float32 on {device}",
           "tolerance": args.tolerance, "passed": max(steps) <= args.tolerance}
    writer.set("results", out)
    print_table([{"model": source, "prompt_tokens": len(prompt), "prefill_rel_err": steps[0],
                  "decode_max_rel_err": max(steps[1:]) if len(steps) > 1 else float("nan"),
                  "max_rel_err": out["max_rel_err"], "greedy_agree": out["argmax_agreement_decode"],
                  "passed": out["passed"]}], title="parity: max|ours - transformers| / max|transformers|")
    if not out["passed"]:
        raise SystemExit(f"parity failed: max_rel_err {out['max_rel_err']:.3e} > tolerance {args.tolerance}")
    return out


def _rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


# ---------------------------------------------------------------------------- bench-decode
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
    from jaxspec.models.llama import init_params, param_bytes

    writer = ResultWriter(args.out, "bench-decode", _config_of(args))
    if not writer.has("copy_bandwidth"):
        writer.add("copy_bandwidth", copy_bandwidth(args.copy_gib))
    bandwidth = writer.get("copy_bandwidth")["bandwidth_Bps"]
    config = preset(args.shape, **({"num_layers": args.layers} if args.layers else {}))
    params = init_params(config, jax.random.PRNGKey(0))
    pbytes = param_bytes(params)
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            key = f"{args.shape}/ctx{context}/b{batch}"
            if writer.has(key):
                rows.append(writer.get(key)["row"])
                continue
            cache = random_cache(config, batch, context + args.new_tokens + 64, context, seed=1)
            logits = jax.random.normal(jax.random.PRNGKey(2), (batch, config.vocab_size), jnp.float32)
            compile_start = time.perf_counter()
            compiled = decode_loop.lower(params, cache, logits, jax.random.PRNGKey(3), config=config,
                                          sampling=SamplingConfig(), max_new_tokens=args.new_tokens,
                                          stop_tokens=()).compile()
            compile_s = time.perf_counter() - compile_start
            state = {"cache": cache}

            def step():
                out, new_cache = compiled(params, state["cache"], logits, jax.random.PRNGKey(3))
                out.block_until_ready()
                state["cache"] = new_cache.with_lengths(jnp.full((batch,), context, jnp.int32))

            timing = median_time(step, repeats=args.repeats, warmup=2)
            per_step = timing["median_s"] / args.new_tokens
            moved = decode_bytes_per_step(config, batch, context + args.new_tokens // 2, pbytes)
            floor = moved["total"] / bandwidth
            row = {"shape": args.shape, "context": context, "batch": batch, "ms_per_step": per_step * 1e3,
                   "tokens_per_s": batch / per_step, "GB_per_step": moved["total"] / 1e9,
                   "achieved_TBps": moved["total"] / per_step / 1e12, "floor_ms": floor * 1e3,
                   "fraction_of_floor": floor / per_step, "compile_s": compile_s}
            writer.add(key, {"row": row, "timing": timing, "bytes": moved, "new_tokens": args.new_tokens,
                             "cache_fill": "random K/V, lengths set to context (random weights: prefill not timed)"})
            rows.append(row)
            del cache, state, compiled
    print_table(rows, title=f"autoregressive decode, {args.shape} (random weights), copy bandwidth "
                            f"{bandwidth / 1e12:.2f} TB/s")
    return writer.data


def cmd_bench_skip(args) -> Dict[str, Any]:
    """Cost of the dynamic skip mask (lax.cond per sub-layer, no recompile) vs static masks (recompile)."""
    import jax
    import jax.numpy as jnp

    from jaxspec.config import preset
    from jaxspec.models.cache import random_cache
    from jaxspec.models.llama import forward, freeze_skip_mask, init_params

    writer = ResultWriter(args.out, "bench-skip", _config_of(args))
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
    writer.add(f"{args.shape}/ctx{args.context}/b{args.batch}/T{args.steps}", rows)
    print_table(rows, title=f"skip-mask variants, one forward of {args.steps} token(s), {args.shape}, "
                            f"context {args.context}, batch {args.batch}")
    return writer.data


def _config_of(args) -> Dict[str, Any]:
    return {k: v for k, v in sorted(vars(args).items()) if k not in ("func", "out")}


def register(subparsers) -> None:
    demo = subparsers.add_parser("demo", help="embedded SmolLM2 on a long prompt: text and tokens/s")
    demo.add_argument("--model", default=DEFAULT_MODEL)
    demo.add_argument("--prompt-file", default=None)
    demo.add_argument("--max-new-tokens", type=int, default=96)
    demo.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"],
                      help="float32 is faster than bfloat16 on CPU")
    demo.add_argument("--no-warmup", action="store_true")
    demo.set_defaults(func=cmd_demo)

    parity = subparsers.add_parser("parity", help="our logits vs transformers on the same weights")
    parity.add_argument("--model", default=DEFAULT_MODEL,
                        help="registry name, .gguf, HF folder, or random:PRESET (e.g. random:qwen2.5-7b-shape)")
    parity.add_argument("--layers", type=int, default=0, help="random:PRESET only: override the layer count")
    parity.add_argument("--prompt-tokens", type=int, default=64)
    parity.add_argument("--decode-steps", type=int, default=16)
    parity.add_argument("--tolerance", type=float, default=1e-4)
    parity.add_argument("--seed", type=int, default=0)
    parity.set_defaults(func=cmd_parity)

    gen = subparsers.add_parser("generate", help="decode with a method; JSON fields tokens, tokens_per_s")
    add_generate_args(gen)
    gen.set_defaults(func=cmd_generate)
    cmd_generate.supports_mesh = True
    cmd_demo.supports_mesh = True

    bench = subparsers.add_parser("bench-decode", help="autoregressive decode throughput vs the bandwidth floor")
    bench.add_argument("--shape", default="qwen2.5-7b-shape")
    bench.add_argument("--layers", type=int, default=0)
    bench.add_argument("--contexts", default="8192,32768")
    bench.add_argument("--batches", default="16")
    bench.add_argument("--new-tokens", type=int, default=32)
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--copy-gib", type=float, default=4.0)
    bench.set_defaults(func=cmd_bench_decode)

    skip = subparsers.add_parser("bench-skip", help="dynamic (no recompile) vs static skip masks: step time, compile")
    skip.add_argument("--shape", default="qwen2.5-7b-shape")
    skip.add_argument("--layers", type=int, default=0)
    skip.add_argument("--context", type=int, default=8192)
    skip.add_argument("--batch", type=int, default=16)
    skip.add_argument("--steps", type=int, default=1, help="tokens per forward (gamma + 1 for verification)")
    skip.add_argument("--repeats", type=int, default=20)
    skip.set_defaults(func=cmd_bench_skip)
