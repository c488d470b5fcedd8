"""Latency profiles (:mod:`jaxspec.knapspec.latency`) for the planner: where each is saved, loaded or measured.

* ``generate``'s self-speculative methods (``self_spec``): :func:`load_latency`, one file per model config, batch,
  device and fit in the jaxspec cache folder (:func:`default_profile_path`);
* the ``knapspec`` experiment (``experiment``): :func:`latency_profile`, one file next to its results, and
  :func:`resumed_latency_profile`, the latency model a resumed results file planned its cases with.

The ``--latency-fit`` and ``--reprofile`` flags that choose them are in ``flags``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import sys
from typing import List

import numpy as np

from experiments.knapspec.model import Model


def token_slope(m) -> str:
    """`` + c0_n * n`` of a half-mask fit's per-token remainder, for the profile's one-line summary."""
    return f" + {m.c0_n * 1e9:.3f} ns * n" if m.c0_n else ""


def _forward_fit_kwargs(fit: str) -> dict:
    """``profile_latency_forward`` options of a ``forward[-static][-half]`` latency fit (those of its profiler)."""
    from jaxspec.knapspec.latency import PROFILERS

    return dict(getattr(PROFILERS[fit], "keywords", {}))


def default_profile_path(config, batch: int, fit: str = "isolated") -> pathlib.Path:
    """``<cache>/latency/<config>-<digest>-b<batch>-<device>-<fit>.json`` (an isolated profile
    saved before the fit method was in the name is still found)."""
    from jaxspec.knapspec.latency import config_fields, device_name
    from jaxspec.models.registry import cache_dir

    digest = hashlib.sha1(json.dumps(config_fields(config), sort_keys=True).encode()).hexdigest()[:10]
    device = "".join(c if c.isalnum() else "-" for c in device_name())
    stem = f"{config.name}-{digest}-b{batch}-{device}"
    path = cache_dir() / "latency" / f"{stem}-{fit}.json"
    legacy = cache_dir() / "latency" / f"{stem}.json"
    if fit == "isolated" and not path.exists() and legacy.exists():
        return legacy
    return path


def profile_contexts(n_max: int) -> List[int]:
    """Context lengths to profile: six points up to the evaluated context (at least 1024)."""
    top = max(int(n_max), 1024)
    return sorted({int(x) for x in np.linspace(max(64, top // 16), top, 6).round()})


def load_latency(args, config, batch: int, n_max: int, params=None):
    """(LatencyProfile, info): the saved profile if it matches, else measured now (with a message).
    ``args.latency_fit``: ``isolated`` (sub-layers alone) or ``forward`` (whole forwards of
    ``params``, random ones when None)."""
    from jaxspec.knapspec.latency import (LatencyProfile, device_name, forward_contexts, load_or_profile,
                                          profile_latency, profile_latency_forward)

    fit = getattr(args, "latency_fit", "isolated")
    path = pathlib.Path(args.latency_profile) if args.latency_profile else default_profile_path(config, batch, fit)
    measured = []

    def profile_fn(cfg, b, **kwargs):
        if fit.startswith("forward"):
            contexts = forward_contexts(n_max)
            print(f"profiling whole-forward latency ({fit}) of {cfg.name} on {device_name()} (batch {b}, contexts "
                  f"{contexts}); saving to {path} ...", file=sys.stderr, flush=True)
            profile = profile_latency_forward(cfg, b, contexts, params=params, **_forward_fit_kwargs(fit),
                                              **kwargs)
        else:
            contexts = profile_contexts(n_max)
            print(f"profiling sub-layer latency of {cfg.name} on {device_name()} (batch {b}, contexts {contexts}); "
                  f"saving to {path} ...", file=sys.stderr, flush=True)
            profile = profile_latency(cfg, b, contexts, **kwargs)
        measured.append(True)
        m = profile.model
        print(f"latency profile ({fit}): t_mlp = {m.c1 * 1e6:.1f} us, t_attn(n) = {m.c2 * 1e9:.3f} ns * n + "
              f"{m.c3 * 1e6:.1f} us, t_token = {m.c0 * 1e6:.1f} us{token_slope(m)}, v = {m.v:.3f}", file=sys.stderr,
              flush=True)
        return profile

    profile: LatencyProfile = load_or_profile(path, config, batch, profile_fn=profile_fn, method=fit,
                                              remeasure=getattr(args, "reprofile", False))
    info = {"path": str(path), "measured_now": bool(measured), "device": profile.device, "batch": profile.batch,
            "contexts": profile.contexts, "fit": profile.model.as_dict(), "method": profile.method}
    return profile, info


def latency_profile(args, model: Model, batch: int, max_capacity: int, profile_dir: pathlib.Path):
    from jaxspec.knapspec.latency import (device_name, forward_contexts, load_or_profile, profile_latency,
                                          profile_latency_forward)


    fit = getattr(args, "latency_fit", "isolated")
    name = model.source.replace("random:", "random-").replace("/", "_")
    layers = f"-L{model.config.num_layers}" if not model.real else ""
    backend = getattr(args, "attention_backend", "auto")
    backend = f"_{backend}" if backend != "auto" else ""  # profiles of the default backend keep their names
    stem = f"latency_{name}{layers}_{model.config.dtype}{backend}_{args.device_tag}_b{batch}"
    path = profile_dir / f"{stem}_{fit}.json"
    legacy = profile_dir / f"{stem}.json"  # isolated profiles saved before the fit method was in the name
    if fit == "isolated" and not path.exists() and legacy.exists():
        path = legacy

    def measure(cfg, b, **kwargs):
        if fit.startswith("forward"):
            contexts = forward_contexts(max_capacity)
            print(f"profiling whole-forward latency ({fit}) on {device_name()} (batch {b}, contexts {contexts}) -> "
                  f"{path}", file=sys.stderr, flush=True)
            return profile_latency_forward(cfg, b, contexts, params=model.params,
                                           **_forward_fit_kwargs(fit), **kwargs)
        contexts = profile_contexts(max_capacity)
        print(f"profiling sub-layer latency on {device_name()} (batch {b}, contexts {contexts}) -> {path}",
              file=sys.stderr, flush=True)
        return profile_latency(cfg, b, contexts, **kwargs)

    profile = load_or_profile(path, model.config, batch, profile_fn=measure, method=fit, remeasure=getattr(args, "reprofile", False))
    if max(profile.contexts) < max_capacity:  # saved for shorter contexts: measure again over the full range
        profile = load_or_profile(path, model.config, batch, profile_fn=measure, method=fit, remeasure=True)
    return profile, path


#: the latency fields a results file keeps per batch (``latency_b{batch}``), enough to plan as it did
SAVED_LATENCY_FIELDS = ("method", "forward", "contexts", "attn_times", "mlp_time", "token_time", "verify_rows",
                        "verify_times")


def resumed_latency_profile(writer, batch: int, profile, path):
    """A resumed results file keeps one latency model per batch: its cases were planned with the model it
    saved (``latency_b{batch}``). If the profile at ``path`` now gives another (measured again for a longer
    context by another step, or a newer format), the rest of the file's cases are planned with the saved one
    (returned in place of ``profile``, with a note); a file that saved too little to plan with is refused
    before any case runs rather than mix plans of two models in one file."""
    from jaxspec.knapspec.latency import LatencyModel

    saved = writer.previous.get(f"latency_b{batch}") or {}
    old, fit = saved.get("fit"), profile.model.as_dict()
    if old is None or not any(f"/b{batch}/" in key for key in writer.data["cases"]):
        return profile
    differ = sorted(k for k in set(old) | set(fit) if not np.isclose(old.get(k, 0.0), fit.get(k, 0.0), rtol=1e-9))
    if not differ:
        return profile
    if any(field not in saved for field in SAVED_LATENCY_FIELDS):
        raise ValueError(f"{writer.path} holds batch-{batch} cases planned with another latency model than {path} "
                         f"gives now (differs in: {', '.join(differ)}) and does not keep enough of it to plan with; "
                         f"pass another --out (or move the file away) so one file holds one model")
    print(f"[resume] batch {batch}: planning with the latency model {writer.path}'s cases were planned with; {path} "
          f"gives another now (differs in: {', '.join(differ)})", file=sys.stderr, flush=True)
    return dataclasses.replace(profile, model=LatencyModel(**{k: float(v) for k, v in old.items()}),
                               **{field: saved[field] for field in SAVED_LATENCY_FIELDS})
