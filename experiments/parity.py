"""``parity``: our logits against transformers on the same weights (float32), prefill and decode."""

from __future__ import annotations

import pathlib
import sys
from typing import Any, Dict

import numpy as np

from experiments.common import DEFAULT_MODEL, DEMO_PROMPT_FILE, ResultWriter, config_of, load_model_timed, print_table

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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_parity_args(args) -> None:
    """Bad values and unusable sources, before anything loads."""
    if args.prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens={args.prompt_tokens}: must be >= 1")
    if args.decode_steps < 0:
        raise ValueError(f"--decode-steps={args.decode_steps}: must be >= 0")
    if not args.tolerance > 0:
        raise ValueError(f"--tolerance={args.tolerance}: must be > 0")
    if args.model.startswith("random:"):
        if args.layers < 0:
            raise ValueError(f"--layers={args.layers}: must be >= 0 (0: the preset's own count)")
        return
    if args.layers:
        raise ValueError(f"--layers is for random:PRESET models only; {args.model!r} has its own layer count")
    folder = pathlib.Path(args.model)
    if folder.is_dir():
        if not (folder / "config.json").exists():
            raise ValueError(f"--model {args.model}: folder without config.json; parity needs a transformers-"
                             f"readable source (registry name, .gguf file, HF folder)")
        if not any((folder / name).exists() for name in TOKENIZER_FILES):
            raise ValueError(f"--model {args.model}: folder without tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                             f"parity encodes the demo prompt, so it needs the model's tokenizer")


def cmd_parity(args) -> Dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import torch

    from jaxspec.models.cache import init_cache
    from jaxspec.models.llama import forward_jit

    check_parity_args(args)
    writer = ResultWriter(args.out, "parity", config_of(args))
    if writer.previous.get("results"):
        print(f"[resume] {args.out} already holds this parity run; delete it to measure again", file=sys.stderr)
        report_parity(writer.previous["results"])
        return writer.previous["results"]
    jax.config.update("jax_default_matmul_precision", "highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.model.startswith("random:"):
        config, params, reference = _random_pair(args.model.split(":", 1)[1], args.layers, args.seed)
        prompt = np.random.RandomState(args.seed).randint(0, config.vocab_size, args.prompt_tokens).tolist()
        source = args.model
    else:
        model = load_model_timed(args.model, "float32")
        if model.tokenizer is None:
            raise ValueError(f"--model {args.model}: loaded without a tokenizer; parity needs one to encode the "
                             f"demo prompt")
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
    report_parity(out)
    return out


def report_parity(out: Dict[str, Any]) -> None:
    decode = out["decode_rel_err"]
    print_table([{"model": out["model"], "prompt_tokens": out["prompt_tokens"], "prefill_rel_err": out["prefill_rel_err"],
                  "decode_max_rel_err": max(decode) if decode else float("nan"),
                  "max_rel_err": out["max_rel_err"], "greedy_agree": out["argmax_agreement_decode"],
                  "passed": out["passed"]}], title="parity: max|ours - transformers| / max|transformers|")
    if not out["passed"]:
        raise SystemExit(f"parity failed: max_rel_err {out['max_rel_err']:.3e} > tolerance {out['tolerance']}")


def _rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def register(subparsers) -> None:
    parity = subparsers.add_parser("parity", help="our logits vs transformers on the same weights")
    parity.add_argument("--model", default=DEFAULT_MODEL,
                        help="registry name, .gguf, HF folder, or random:PRESET (e.g. random:qwen2.5-7b-shape)")
    parity.add_argument("--layers", type=int, default=0, help="random:PRESET only: override the layer count")
    parity.add_argument("--prompt-tokens", type=int, default=64)
    parity.add_argument("--decode-steps", type=int, default=16)
    parity.add_argument("--tolerance", type=float, default=1e-4)
    parity.add_argument("--seed", type=int, default=0)
    parity.set_defaults(func=cmd_parity)

